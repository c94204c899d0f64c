//! Answers of math word problems (GSM8K / MATH style): reading the final answer out of a
//! free-text completion (`\boxed{…}`, `#### N`, or the last number) and deciding whether it
//! equals a ground truth, numerically where both sides are numbers (commas, `$`, trailing
//! `.0`, a trailing `%`, fractions, `\frac{a}{b}`, mixed numbers, exponents, a trailing
//! `\text{…}` unit; see [`parse_number`]) and as normalised text otherwise.

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
/// boxed answer, no `####` answer and no number. A Unicode minus (U+2212) reads as `-`.
pub fn extract_math_answer(text: &str) -> Option<(String, AnswerSource)> {
    let text = text.replace('\u{2212}', "-");
    if let Some(b) = last_boxed(&text) {
        return Some((b.trim().to_string(), AnswerSource::Boxed));
    }
    if let Some(pos) = text.rfind("####") {
        let rest = &text[pos + 4..];
        let line = rest.lines().next().unwrap_or("").trim();
        if !line.is_empty() {
            return Some((hashes_answer(line), AnswerSource::Hashes));
        }
    }
    last_number(&text).map(|n| (n.to_string(), AnswerSource::LastNumber))
}

/// Most words of a `####` line tried as its leading number (`1 000 000`, `3 1/2`, `$ 5`).
const MAX_LEADING_WORDS: usize = 6;

/// The answer on a `####` line: the whole line when it is a number (`1,234`, `3/4`, `50%`);
/// else its leading number when one stands alone, `**` bold and a leading `=` / `:` ignored
/// (`42 dollars`, `$18 (she keeps the rest)`, `**42**.`), as GSM8K's scorer reads it; else
/// the whole line (a non-numeric answer, a number that starts an expression: `5 + 3 = 8`,
/// `5x`, `5 x 3`, `6 divided by 2`, `15 apples = 3 bags`, or one of several values:
/// `x=5, y=7`, `12, 345`).
fn hashes_answer(line: &str) -> String {
    if parse_number(line).is_some() {
        return line.to_string();
    }
    let bare = line.replace("**", "");
    let bare = bare.trim_start_matches(|c: char| c.is_whitespace() || c == '=' || c == ':');
    match leading_number(bare) {
        Some(n) => n.to_string(),
        None => line.to_string(),
    }
}

/// The longest run of leading words of `s` that parses as a number (trailing sentence
/// punctuation dropped), unless the word after it starts an expression (an operator, or an
/// operator word before a number: `x 3`, `times 3`, `divided by 2`), the rest of the line
/// holds an `=`, or a comma after it starts a list (`5, 7`).
fn leading_number(s: &str) -> Option<&str> {
    let mut ends = Vec::new();
    let mut in_word = false;
    for (i, c) in s.char_indices() {
        if !c.is_whitespace() {
            in_word = true;
        } else if in_word {
            ends.push(i);
            in_word = false;
            if ends.len() > MAX_LEADING_WORDS {
                break;
            }
        }
    }
    if in_word {
        ends.push(s.len());
    }
    for n in (1..=ends.len().min(MAX_LEADING_WORDS)).rev() {
        let candidate = s[..ends[n - 1]].trim_end_matches(['.', ',', ';', ':', '!', '?']);
        if parse_number(candidate).is_none() {
            continue;
        }
        let next = s[ends[n - 1]..].trim_start();
        let list = s[candidate.len()..ends[n - 1]].contains(',') && starts_number(next);
        if next.starts_with(|c: char| "+-*/×÷=^<>".contains(c))
            || next.contains('=')
            || list
            || starts_with_operator_word(next)
        {
            return None;
        }
        return Some(candidate);
    }
    None
}

/// Whether `s` starts with a number's first digit (after a `$` or a sign), or `\frac`.
fn starts_number(s: &str) -> bool {
    let s = s.trim_start_matches(['$', '-', '+']);
    s.starts_with(|c: char| c.is_ascii_digit())
        || ["\\frac", "\\dfrac", "\\tfrac"]
            .iter()
            .any(|f| s.starts_with(f))
}

/// Whether `s` starts with an operator word before a number: `x 3`, `x3`, `times 3`,
/// `plus 3`, `minus 3`, `over 3`, `divided by 3` (case ignored).
fn starts_with_operator_word(s: &str) -> bool {
    let word_end = s.find(char::is_whitespace).unwrap_or(s.len());
    let (word, rest) = s.split_at(word_end);
    let word = word.to_lowercase();
    if let Some(tail) = word.strip_prefix(['x', '×']) {
        if starts_number(tail) {
            return true;
        }
    }
    let rest = rest.trim_start();
    match word.as_str() {
        "x" | "×" | "times" | "plus" | "minus" | "over" => starts_number(rest),
        "divided" => {
            let rest = rest.strip_prefix("by").unwrap_or(rest);
            starts_number(rest.trim_start())
        }
        _ => false,
    }
}

/// Whether an extracted answer equals the ground truth: as exact rationals when both parse as
/// numbers, otherwise as text with whitespace, `$` and `\text{…}` wrappers removed; a number
/// never equals a non-number (`2, 100`, a list, is not `2,100`).
pub fn math_equal(answer: &str, truth: &str) -> bool {
    match (parse_number(answer), parse_number(truth)) {
        (Some(a), Some(b)) => a == b,
        (None, None) => normalise_text(answer) == normalise_text(truth),
        _ => false,
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

/// Parses a number as people write answers: `1,234`, `1 000 000`, `1{,}000`, `$5`, `-3.50`,
/// `12.`, `7/8`, `3 1/2` (a mixed number, 7/2), `\frac{7}{8}`, `-\dfrac{1}{2}`, `\frac12`,
/// `2.5e3`, `50%` (50, as GSM8K's scorers read it), `90^\circ`, `5\text{ cm}` (a trailing
/// unit dropped), `x=5` (a single letter's value). Digits that a space separates otherwise
/// (`4 5`) are no number.
pub fn parse_number(s: &str) -> Option<Rational> {
    let t = strip_wrappers(s);
    let t = without_unit(&t);
    let t = strip_percent(t);
    let t = value_of_variable(t).trim_end_matches('.');
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

/// A number without a leading sign of its own (a fraction's parts may carry signs): a
/// decimal, a fraction, or a mixed number `a b/c` (whole `a`, proper fraction `b/c`).
fn parse_unsigned(t: &str) -> Option<Rational> {
    if let Some((whole, frac)) = t.split_once(' ').filter(|_| !t.starts_with('\\')) {
        return parse_mixed(whole, frac);
    }
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

/// `whole + num/den` for a mixed number: all three plain integers, `0 < num < den`.
fn parse_mixed(whole: &str, frac: &str) -> Option<Rational> {
    let plain = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
    let (num, den) = split_frac(frac)?;
    if !(plain(whole) && plain(num) && plain(den)) {
        return None;
    }
    let (w, n, d) = (
        parse_decimal(whole)?,
        parse_decimal(num)?,
        parse_decimal(den)?,
    );
    if n.num == 0 || n.num >= d.num {
        return None;
    }
    Rational::new(w.num.checked_mul(d.num)?.checked_add(n.num)?, d.num)
}

/// `\frac{a}{b}`, `\dfrac{a}{b}`, `\tfrac{a}{b}` (an argument may be a single digit without
/// braces: `\frac12`) or `a/b` split into its two parts.
fn split_frac(t: &str) -> Option<(&str, &str)> {
    for cmd in ["\\frac", "\\dfrac", "\\tfrac"] {
        if let Some(rest) = t.strip_prefix(cmd) {
            let (a, rest) = frac_argument(rest)?;
            let (b, rest) = frac_argument(rest)?;
            return rest.is_empty().then_some((a, b));
        }
    }
    let (a, b) = t.split_once('/')?;
    (!b.contains('/')).then_some((a, b))
}

/// A `\frac` argument: a `{…}` group, or one digit (TeX reads `\frac12` as one half).
fn frac_argument(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    match s.as_bytes().first()? {
        b'{' => braced(s),
        b if b.is_ascii_digit() => Some(s.split_at(1)),
        _ => None,
    }
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

/// A signed decimal with optional thousands commas (`-1,234.50`) and an optional exponent
/// (`2.5e3`, `1E-4`) as an exact rational.
fn parse_decimal(s: &str) -> Option<Rational> {
    let s = s.trim();
    let (neg, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest.trim_start()),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (body, exponent) = match body.split_once(['e', 'E']) {
        Some((mantissa, e)) => (mantissa, Some(parse_exponent(e)?)),
        None => (body, None),
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
    if exponent.is_some() && int_part.contains(',') {
        return None;
    }
    if digits.len() + frac_part.len() > MAX_DIGITS {
        return None;
    }
    let mut num: i128 = 0;
    for c in digits.chars().chain(frac_part.chars()) {
        num = num * 10 + i128::from(c.to_digit(10)? as u8);
    }
    let mut den = 10i128.checked_pow(frac_part.len() as u32)?;
    match exponent {
        Some(e) if e >= 0 => num = num.checked_mul(10i128.checked_pow(e.unsigned_abs())?)?,
        Some(e) => den = den.checked_mul(10i128.checked_pow(e.unsigned_abs())?)?,
        None => {}
    }
    Rational::new(if neg { -num } else { num }, den)
}

/// An exponent's digits with an optional sign, at most [`MAX_DIGITS`] in size.
fn parse_exponent(e: &str) -> Option<i32> {
    let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
    if digits.is_empty() || digits.len() > 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let v: i32 = digits.parse().ok()?;
    if v > MAX_DIGITS as i32 {
        return None;
    }
    Some(if e.starts_with('-') { -v } else { v })
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

/// Removes what surrounds an answer but does not change it: `$` signs, a `\text{…}`
/// wrapper, braces around the whole answer, `\left` / `\right`, `^\circ`, `{,}` (as `,`), a trailing `%` / `\%`, a leading
/// `=`, and whitespace (`\,`, `\!`, `~` count as spaces), except after a comma and between
/// two digits: after a comma it stays as one space (`2, 100` is a list, not 2100); between
/// digits a space that separates groups of three (`1 000 000`) goes and any other stays as
/// one space, so `3 1/2` and `4 5` do not merge into other numbers. A Unicode minus reads as
/// `-`.
fn strip_wrappers(s: &str) -> String {
    let spaced = s
        .replace('\u{2212}', "-")
        .replace("\\!", " ")
        .replace("\\,", " ")
        .replace('~', " ")
        .replace("\\$", "");
    let no_dollars: String = spaced.chars().filter(|c| *c != '$').collect();
    let mut t = without_left_right(&squeeze_spaces(&no_dollars))
        .replace("{,}", ",")
        .replace("^{\\circ}", "")
        .replace("^\\circ", "");
    t = without_outer_braces(t);
    if let Some(rest) = t.strip_prefix("\\text") {
        if let Some((inner, tail)) = braced(rest) {
            t = without_outer_braces(squeeze_spaces(&format!("{inner}{tail}")));
        }
    }
    strip_percent(t.trim_start_matches('=')).to_string()
}

/// `s` without braces around all of it (`{42}` and `{{42}}` read as `42`: a TeX group
/// changes nothing).
fn without_outer_braces(mut s: String) -> String {
    while let Some((inner, "")) = s.starts_with('{').then(|| braced(&s)).flatten() {
        s = inner.trim().to_string();
    }
    s
}

/// `s` without a trailing `%` / `\%` (a trailing `.` after it goes with it).
fn strip_percent(s: &str) -> &str {
    let core = s.trim_end_matches('.');
    core.strip_suffix("\\%")
        .or_else(|| core.strip_suffix('%'))
        .unwrap_or(s)
}

/// Whitespace removed except between digits (see [`strip_wrappers`]).
fn squeeze_spaces(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    // Digits since the last removed group separator, and whether one was removed in this run.
    let (mut group, mut grouped) = (0usize, false);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if !c.is_whitespace() {
            if c.is_ascii_digit() {
                group += 1;
            } else {
                (group, grouped) = (0, false);
            }
            out.push(c);
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        let before = out.chars().next_back();
        let after = chars.get(j).copied();
        if before == Some(',') && after.is_some() {
            out.push(' ');
            (group, grouped) = (0, false);
        } else if before.is_some_and(|b| b.is_ascii_digit())
            && after.is_some_and(|a| a.is_ascii_digit())
        {
            let next_group = chars[j..].iter().take_while(|c| c.is_ascii_digit()).count();
            let closes = chars.get(j + next_group).is_none_or(|c| *c != '/');
            let run_start = out.chars().rev().nth(group);
            let opens = if grouped {
                group == 3
            } else {
                (1..=3).contains(&group) && run_start.is_none_or(|c| c != '.' && c != ',')
            };
            if next_group == 3 && closes && opens {
                (group, grouped) = (0, true);
            } else {
                out.push(' ');
                (group, grouped) = (0, false);
            }
        }
        i = j;
    }
    out
}

/// `\left` / `\right` before a delimiter removed (`\left(1,2\right)` → `(1,2)`); commands
/// that merely start so (`\rightarrow`) are kept.
fn without_left_right(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest
        .find("\\left")
        .into_iter()
        .chain(rest.find("\\right"))
        .min()
    {
        let len = if rest[pos..].starts_with("\\left") {
            5
        } else {
            6
        };
        let after = &rest[pos + len..];
        out.push_str(&rest[..pos]);
        if after.starts_with(|c: char| c.is_ascii_alphabetic()) {
            out.push_str(&rest[pos..pos + len]);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// A number followed by a `\text{…}` / `\mbox{…}` unit (`5\text{ cm}`, `\frac12\text{ cup}`)
/// without the unit, when what precedes it is a number; otherwise `s` unchanged.
fn without_unit(s: &str) -> &str {
    for cmd in ["\\text", "\\mbox"] {
        let Some(pos) = s.rfind(cmd) else { continue };
        let Some((_, tail)) = braced(&s[pos + cmd.len()..]) else {
            continue;
        };
        let head = &s[..pos];
        if tail.is_empty() && !head.is_empty() && parse_number(head).is_some() {
            return head;
        }
    }
    s
}

/// The value in `x=5` (one `=`, a single letter on its left, optionally subscripted:
/// `x_1=5`, `y_{n}=5`); otherwise `s` unchanged, as for several assignments or values
/// (`x=5,y=3`, `x=5, 7`).
fn value_of_variable(s: &str) -> &str {
    let Some((name, value)) = s.split_once('=') else {
        return s;
    };
    if is_variable(name) && !value.contains('=') && !value.contains(", ") {
        value
    } else {
        s
    }
}

/// Whether `name` is a single letter, optionally subscripted (`x`, `x_1`, `y_{n}`).
fn is_variable(name: &str) -> bool {
    let mut chars = name.chars();
    let letter = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let subscript = chars.as_str();
    letter
        && (subscript.is_empty()
            || subscript.strip_prefix('_').is_some_and(|x| {
                let x = x
                    .strip_prefix('{')
                    .and_then(|x| x.strip_suffix('}'))
                    .unwrap_or(x);
                !x.is_empty() && x.chars().all(|c| c.is_ascii_alphanumeric())
            }))
}

/// An answer as text compared (a symbolic answer: `\sqrt`, `\pi`, a variable, a tuple), with
/// the normalisations of verl's MATH scorer (`strip_string` in
/// `verl/utils/reward_score/math_reward.py`) so that one answer written two ways reads the
/// same: the wrappers `strip_wrappers` removes (`$`, a `\text{…}` wrapper, `\left` /
/// `\right`, `^\circ`, a trailing `%`, outer braces `{…}`), a trailing `\text{ unit}` (a
/// unit: its text starts with a space) dropped, `\\` read as `\`, `\dfrac` / `\tfrac` as
/// `\frac`, every `\%` dropped, a leading `x =` (one `=`, a single letter on its left,
/// optionally subscripted: `y_1 =`) dropped, the arguments of `\frac` and `\sqrt` braced as
/// TeX reads them (`\frac12` → `\frac{1}{2}`, `\sqrt3` → `\sqrt{3}`, `\frac\pi4` →
/// `\frac{\pi}{4}`), a `0` put before a bare decimal point (`.5` → `0.5`), whitespace removed
/// except between two digits, and lower-cased (`(1, 2)` reads as `(1,2)`).
pub fn normalise_text(s: &str) -> String {
    let s = s.replace("\\$", "").replace('$', "");
    let t = strip_wrappers(without_text_unit(&s))
        .replace("\\\\", "\\")
        .replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
        .replace("\\%", "");
    let t = brace_arguments(without_variable(&t), 0);
    without_spaces(&leading_zeros(&t)).to_lowercase()
}

/// `s` without a trailing `\text{ …}` / `\mbox{ …}` whose text starts with whitespace (a
/// unit, as verl's `remove_right_units` reads it: `5\sqrt{2}\text{ cm}`), when something
/// precedes it; otherwise `s` unchanged.
fn without_text_unit(s: &str) -> &str {
    let s = s.trim_end();
    for cmd in ["\\text", "\\mbox"] {
        let Some(pos) = s.rfind(cmd) else { continue };
        let Some((inner, tail)) = braced(&s[pos + cmd.len()..]) else {
            continue;
        };
        let head = s[..pos].trim_end();
        if tail.is_empty() && inner.starts_with(char::is_whitespace) && !head.is_empty() {
            return head;
        }
    }
    s
}

/// The right side of a leading `x=` (one `=`, a single letter on its left, optionally
/// subscripted: `y_1=`, `n_{0}=`), as verl drops `k = ` before comparing; otherwise `s`
/// unchanged (`2x=6`, `x=y=5`, `x=5,y=3` stay).
fn without_variable(s: &str) -> &str {
    let Some((name, value)) = s.split_once('=') else {
        return s;
    };
    if is_variable(name.trim()) && !value.contains('=') && !value.trim().is_empty() {
        value.trim_start()
    } else {
        s
    }
}

/// Deepest `\frac` / `\sqrt` nesting whose arguments are braced; deeper ones are copied as
/// they are (bounds the recursion on a pathological answer).
const MAX_ARGUMENT_DEPTH: usize = 32;

/// `s` with the arguments of `\frac` (two) and `\sqrt` (one, after an optional `[n]`) in
/// braces, as TeX reads them: a `{…}` group stays, a control sequence (`\pi`) or one
/// character (`1`, `x`) is braced, so `\frac12`, `\frac 1 2` and `\frac{1}{2}` read the same
/// (verl's `fix_fracs` / `fix_sqrt`, which read `\frac\pi4` and `\sqrt 3` otherwise). Other
/// commands (`\fracture`-like names included) are left alone.
fn brace_arguments(s: &str, depth: usize) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(pos) = rest.find('\\') {
        out.push_str(&rest[..pos]);
        let (command, tail) = control_sequence(&rest[pos..]);
        out.push_str(command);
        rest = tail;
        let arguments = match command {
            "\\frac" => 2,
            "\\sqrt" => 1,
            _ => 0,
        };
        if arguments == 0 || depth >= MAX_ARGUMENT_DEPTH {
            continue;
        }
        if command == "\\sqrt" {
            let trimmed = rest.trim_start();
            if let Some(close) = trimmed.strip_prefix('[').and_then(|t| t.find(']')) {
                out.push('[');
                out.push_str(&brace_arguments(&trimmed[1..close + 1], depth + 1));
                out.push(']');
                rest = &trimmed[close + 2..];
            }
        }
        for _ in 0..arguments {
            let Some((argument, tail)) = tex_argument(rest) else {
                break;
            };
            out.push('{');
            out.push_str(&brace_arguments(argument, depth + 1));
            out.push('}');
            rest = tail;
        }
    }
    out.push_str(rest);
    out
}

/// The control sequence at the start of `s` (which starts with `\`): `\` and a run of
/// letters (`\frac`), else `\` and one character (`\{`, `\,`); and what follows it.
fn control_sequence(s: &str) -> (&str, &str) {
    let after = &s[1..];
    let letters = after.bytes().take_while(u8::is_ascii_alphabetic).count();
    let len = match letters {
        0 => after.chars().next().map_or(0, char::len_utf8),
        n => n,
    };
    s.split_at(1 + len)
}

/// One TeX macro argument at the start of `s` (leading whitespace skipped): a `{…}` group's
/// content, a control sequence, or one character; `None` at the end of `s` or a `}`.
fn tex_argument(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    match s.chars().next()? {
        '{' => braced(s),
        '}' => None,
        '\\' => Some(control_sequence(s)),
        c => Some(s.split_at(c.len_utf8())),
    }
}

/// A `0` before a decimal point that starts a number (`.5`, `(1,.5)`, `{.5}`), as verl writes
/// ` .5` and `{.5` as ` 0.5` and `{0.5`.
fn leading_zeros(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    let mut prev: Option<char> = None;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        let starts_number = c == '.'
            && chars.peek().is_some_and(char::is_ascii_digit)
            && prev.is_none_or(|p| !p.is_alphanumeric() && p != '.' && p != '\\');
        if starts_number {
            out.push('0');
        }
        out.push(c);
        prev = Some(c);
    }
    out
}

/// Whitespace removed, except one space between two digits (`3 1/2` and `31/2` stay
/// apart, as [`parse_number`] keeps them).
fn without_spaces(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut pending_space = false;
    for c in s.chars() {
        if c.is_whitespace() {
            pending_space = out.ends_with(|p: char| p.is_ascii_digit());
            continue;
        }
        if pending_space && c.is_ascii_digit() {
            out.push(' ');
        }
        pending_space = false;
        out.push(c);
    }
    out
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

/// The last number in free text (thousands commas and a decimal part kept). A `-` before it
/// is its sign only at the start of the text or after whitespace, `=`, `(`, `$` or `:`: in
/// `1990-2000` and `5-3` it is a hyphen.
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
        let sign = start == 1
            || matches!(bytes[start - 2], b'=' | b'(' | b'$' | b':')
            || bytes[start - 2].is_ascii_whitespace();
        if sign {
            start -= 1;
        }
    }
    Some(&text[start..end])
}
