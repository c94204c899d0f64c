//! Answers of math word problems (GSM8K / MATH style): reading the final answer out of a
//! free-text completion (`\boxed{…}`, `#### N`, or the last number) and deciding whether it
//! equals a ground truth, numerically where both sides are numbers (commas, `$`, trailing
//! `.0`, fractions, `\frac{a}{b}`) and as normalised text otherwise.

use std::cmp::Ordering;

/// Longest digit string parsed as a number; longer ones are compared as text (no overflow).
const MAX_DIGITS: usize = 30;

/// Where an extracted answer came from, most explicit first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerSource {
    /// The content of the last `\boxed{…}` (or `\fbox{…}`).
    Boxed,
    /// The text after the last `####` (GSM8K's marker), up to the end of its line.
    Hashes,
    /// The last number anywhere in the text (the flexible fallback).
    LastNumber,
}

/// The final answer of a completion and where it was found; `None` when the text holds no
/// boxed answer, no `####` answer and no number.
pub fn extract_math_answer(text: &str) -> Option<(String, AnswerSource)> {
    if let Some(b) = last_boxed(text) {
        return Some((b.trim().to_string(), AnswerSource::Boxed));
    }
    if let Some(pos) = text.rfind("####") {
        let rest = &text[pos + 4..];
        let line = rest.lines().next().unwrap_or("").trim();
        if !line.is_empty() {
            return Some((line.to_string(), AnswerSource::Hashes));
        }
    }
    last_number(text).map(|n| (n.to_string(), AnswerSource::LastNumber))
}

/// Whether an extracted answer equals the ground truth: as exact rationals when both parse as
/// numbers, otherwise as text with whitespace, `$` and `\text{…}` wrappers removed.
pub fn math_equal(answer: &str, truth: &str) -> bool {
    match (parse_number(answer), parse_number(truth)) {
        (Some(a), Some(b)) => a == b,
        _ => normalise_text(answer) == normalise_text(truth),
    }
}

/// An exact rational `num / den` in lowest terms with `den > 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rational {
    /// Numerator (carries the sign).
    pub num: i128,
    /// Denominator, always positive.
    pub den: i128,
}

impl Rational {
    /// `num / den` reduced; `None` when `den` is zero.
    pub fn new(num: i128, den: i128) -> Option<Rational> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1) as i128;
        let sign = if den < 0 { -1 } else { 1 };
        Some(Rational {
            num: sign * num / g,
            den: sign * den / g,
        })
    }
}

impl PartialOrd for Rational {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        let l = self.num.checked_mul(other.den)?;
        let r = other.num.checked_mul(self.den)?;
        Some(l.cmp(&r))
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Parses a number as people write answers: `1,234`, `$5`, `-3.50`, `12.`, `7/8`,
/// `\frac{7}{8}`, `-\dfrac{1}{2}`. `50%` is *not* a number (the percent changes meaning).
pub fn parse_number(s: &str) -> Option<Rational> {
    let t = strip_wrappers(s);
    let t = t.trim_end_matches('.');
    if let Some(rest) = t.strip_prefix('-') {
        if !rest.starts_with('-') {
            return parse_unsigned(rest).map(|r| Rational {
                num: -r.num,
                den: r.den,
            });
        }
        return None;
    }
    parse_unsigned(t)
}

/// A number without a leading sign of its own (a fraction's parts may carry signs).
fn parse_unsigned(t: &str) -> Option<Rational> {
    match split_frac(t) {
        Some((n, d)) => {
            let (n, d) = (parse_decimal(n)?, parse_decimal(d)?);
            let num = n.num.checked_mul(d.den)?;
            let den = n.den.checked_mul(d.num)?;
            Rational::new(num, den)
        }
        None => parse_decimal(t),
    }
}

/// `\frac{a}{b}`, `\dfrac{a}{b}`, `\tfrac{a}{b}` or `a/b` split into its two parts.
fn split_frac(t: &str) -> Option<(&str, &str)> {
    for cmd in ["\\frac", "\\dfrac", "\\tfrac"] {
        if let Some(rest) = t.strip_prefix(cmd) {
            let (a, rest) = braced(rest)?;
            let (b, rest) = braced(rest)?;
            return rest.is_empty().then_some((a, b));
        }
    }
    let (a, b) = t.split_once('/')?;
    (!b.contains('/')).then_some((a, b))
}

/// The content of a leading `{…}` group (balanced) and what follows it.
fn braced(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    let inner = s.strip_prefix('{')?;
    let mut depth = 1usize;
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&inner[..i], &inner[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// A signed decimal with optional thousands commas (`-1,234.50`) as an exact rational.
fn parse_decimal(s: &str) -> Option<Rational> {
    let s = s.trim();
    let (neg, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest.trim_start()),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (int_part, frac_part) = match body.split_once('.') {
        Some((i, f)) => (i, f),
        None => (body, ""),
    };
    if !valid_grouping(int_part) || !frac_part.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let digits: String = int_part.chars().filter(|c| *c != ',').collect();
    if digits.is_empty() && frac_part.is_empty() {
        return None;
    }
    if digits.len() + frac_part.len() > MAX_DIGITS {
        return None;
    }
    let mut num: i128 = 0;
    for c in digits.chars().chain(frac_part.chars()) {
        num = num * 10 + i128::from(c.to_digit(10)? as u8);
    }
    let den = 10i128.checked_pow(frac_part.len() as u32)?;
    Rational::new(if neg { -num } else { num }, den)
}

/// Digits, optionally grouped by commas in threes (`1,234,567`); `12,34` is not a number.
fn valid_grouping(s: &str) -> bool {
    if !s.contains(',') {
        return s.chars().all(|c| c.is_ascii_digit());
    }
    let groups: Vec<&str> = s.split(',').collect();
    let first_ok =
        matches!(groups[0].len(), 1..=3) && groups[0].chars().all(|c| c.is_ascii_digit());
    first_ok
        && groups[1..]
            .iter()
            .all(|g| g.len() == 3 && g.chars().all(|c| c.is_ascii_digit()))
}

/// Removes what surrounds an answer but does not change it: whitespace, `$` signs, a
/// `\text{…}` wrapper, `\!` / `\,` thin spaces, and a leading `=`.
fn strip_wrappers(s: &str) -> String {
    let mut t: String = s
        .replace("\\!", "")
        .replace("\\,", "")
        .replace("\\$", "")
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '$')
        .collect();
    if let Some(rest) = t.strip_prefix("\\text") {
        if let Some((inner, tail)) = braced(rest) {
            t = format!("{inner}{tail}");
        }
    }
    t.trim_start_matches('=').to_string()
}

/// An answer as text compared: wrappers (`$`, `\text{…}`, spaces, a leading `=`) removed,
/// lower-cased.
pub fn normalise_text(s: &str) -> String {
    strip_wrappers(s).to_lowercase()
}

/// The content of the last `\boxed{…}` / `\fbox{…}` with balanced braces.
fn last_boxed(text: &str) -> Option<&str> {
    let b = text.rfind("\\boxed");
    let f = text.rfind("\\fbox");
    let (pos, len) = match (b, f) {
        (Some(b), Some(f)) if f > b => (f, 5),
        (Some(b), _) => (b, 6),
        (None, Some(f)) => (f, 5),
        (None, None) => return None,
    };
    braced(&text[pos + len..]).map(|(inner, _)| inner)
}

/// The last number in free text (`-` sign, thousands commas and a decimal part kept).
fn last_number(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let mut end = bytes.len();
    while end > 0 && !bytes[end - 1].is_ascii_digit() {
        end -= 1;
    }
    if end == 0 {
        return None;
    }
    let mut start = end;
    while start > 0 {
        let c = bytes[start - 1];
        let grouping_comma = c == b','
            && start >= 2
            && bytes[start - 2].is_ascii_digit()
            && bytes[start..end]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count()
                == 3;
        let decimal_point = c == b'.' && start >= 2 && bytes[start - 2].is_ascii_digit();
        if c.is_ascii_digit() || grouping_comma || decimal_point {
            start -= 1;
        } else {
            break;
        }
    }
    if start > 0 && bytes[start - 1] == b'-' {
        start -= 1;
    }
    Some(&text[start..end])
}
