//! The minijinja environment chat templates run in, set up as transformers sets up its
//! jinja2 one: `trim_blocks` and `lstrip_blocks`, loop controls, Python string and dict
//! methods, and the globals `raise_exception` and `strftime_now` and transformers' `tojson`
//! filter, which writes what Python's `json.dumps` writes (`ensure_ascii`, `indent`,
//! `separators`, `sort_keys`, floats as `repr`). Where minijinja and jinja2 would print the
//! same input differently it follows Python: floats print as `repr(float)` (`1e-05`,
//! `1e+20`), `strip` / `split` / `isspace` / `trim` take Python's whitespace (`\x1c`-`\x1f`
//! too), `str.title()` capitalises after digits, `is sequence` holds for strings and dicts,
//! and `list.index` / `str.index` exist.

use std::fmt::Write as _;

use minijinja::value::{from_args, Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

/// A fresh environment with transformers' chat-template settings and helpers.
pub(crate) fn environment() -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(python_methods);
    env.set_formatter(python_formatter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", trim);
    env.add_filter("string", string);
    env.add_test("sequence", is_sequence);
    Ok(env)
}

/// transformers' `{% generation %}` ... `{% endgeneration %}` tag (its `AssistantTracker`
/// extension, which renders the body through a call block) as minijinja's `{% with %}` ...
/// `{% endwith %}`: the same text, whitespace control (`-` / `+`) kept, and a `set` inside
/// stays inside, as in the call block.
pub(crate) fn generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        match generation_tag(tag) {
            Some((replacement, len)) => {
                out.push_str(&replacement);
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `tag` (starting at `{%`) rewritten when it is a `generation` or `endgeneration` tag, with
/// the number of bytes it spans.
fn generation_tag(tag: &str) -> Option<(String, usize)> {
    fn modifier(s: &str) -> (&str, &str) {
        match s.as_bytes().first() {
            Some(b'-' | b'+') => s.split_at(1),
            _ => ("", s),
        }
    }
    let (open, body) = modifier(&tag[2..]);
    let word_at = body.len() - body.trim_start().len();
    let (lead, word_and_rest) = body.split_at(word_at);
    let (word, after) = if let Some(after) = word_and_rest.strip_prefix("endgeneration") {
        ("endwith", after)
    } else if let Some(after) = word_and_rest.strip_prefix("generation") {
        ("with", after)
    } else {
        return None;
    };
    let close_at = after.len() - after.trim_start().len();
    let (trail, close) = after.split_at(close_at);
    let (close_mod, close) = modifier(close);
    let rest = close.strip_prefix("%}")?;
    Some((
        format!("{{%{open}{lead}{word}{trail}{close_mod}%}}"),
        tag.len() - rest.len(),
    ))
}

/// Python's `str.isspace` for one character: Rust's whitespace and the four separators
/// `\x1c`-`\x1f`, which Python counts and Rust does not.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.split(None, maxsplit)`: runs of whitespace separate, leading whitespace
/// goes, and after `maxsplit` splits the rest is one item as it stands.
fn py_split_whitespace(s: &str, maxsplit: Option<i64>) -> Vec<Value> {
    let mut items = Vec::new();
    let mut rest = s.trim_start_matches(is_py_space);
    let limit = maxsplit.filter(|n| *n >= 0);
    while !rest.is_empty() {
        if limit.is_some_and(|n| items.len() as i64 == n) {
            items.push(Value::from(rest));
            break;
        }
        match rest.find(is_py_space) {
            Some(end) => {
                items.push(Value::from(&rest[..end]));
                rest = rest[end..].trim_start_matches(is_py_space);
            }
            None => {
                items.push(Value::from(rest));
                break;
            }
        }
    }
    items
}

/// Python's `str.title()`: a cased character is upper-cased after an uncased one (a digit, an
/// apostrophe, a space) and lower-cased after a cased one.
fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut previous_cased = false;
    for c in s.chars() {
        let cased = c.is_lowercase() || c.is_uppercase();
        if previous_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        previous_cased = cased;
    }
    out
}

fn not_found(what: &Value, kind: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("{what:?} is not in {kind}"),
    )
}

/// Python methods minijinja's `pycompat` lacks or gets different from Python, then `pycompat`.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let unset = |v: &Option<Value>| v.as_ref().is_none_or(|v| v.is_none() || v.is_undefined());
    if let Some(s) = value.as_str() {
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<Value>,) = from_args(args)?;
                if unset(&chars) {
                    return Ok(Value::from(match method {
                        "strip" => s.trim_matches(is_py_space),
                        "lstrip" => s.trim_start_matches(is_py_space),
                        _ => s.trim_end_matches(is_py_space),
                    }));
                }
            }
            "split" => {
                let (sep, maxsplit, kwargs): (Option<Value>, Option<Value>, Kwargs) =
                    from_args(args)?;
                let sep = match sep {
                    Some(v) => Some(v),
                    None => kwargs.get::<Option<Value>>("sep")?,
                };
                let maxsplit = match maxsplit {
                    Some(v) => Some(v),
                    None => kwargs.get::<Option<Value>>("maxsplit")?,
                };
                kwargs.assert_all_used()?;
                let maxsplit = maxsplit
                    .filter(|v| !v.is_none() && !v.is_undefined())
                    .map(i64::try_from)
                    .transpose()?;
                if unset(&sep) {
                    return Ok(Value::from(py_split_whitespace(s, maxsplit)));
                }
                let sep = match sep.as_ref().and_then(Value::as_str) {
                    Some(sep) => std::sync::Arc::from(sep),
                    None => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            "split: the separator must be a string or none",
                        ))
                    }
                };
                return Ok(minijinja::filters::split(value, Some(sep), maxsplit)?
                    .try_iter()?
                    .collect());
            }
            "isspace" if args.is_empty() => {
                return Ok(Value::from(!s.is_empty() && s.chars().all(is_py_space)));
            }
            "title" if args.is_empty() => return Ok(Value::from(py_title(s))),
            "index" => {
                let (needle,): (&str,) = from_args(args)?;
                return match s.find(needle) {
                    Some(byte) => Ok(Value::from(s[..byte].chars().count())),
                    None => Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "substring not found",
                    )),
                };
            }
            _ => {}
        }
    } else if value.kind() == ValueKind::Seq && method == "index" {
        let (needle,): (Value,) = from_args(args)?;
        return match value.try_iter()?.position(|item| item == needle) {
            Some(at) => Ok(Value::from(at)),
            None => Err(not_found(&needle, "list")),
        };
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// jinja2's `trim` filter is Python's `str.strip(chars)`: without `chars`, Python's whitespace.
fn trim(value: &Value, chars: Option<Value>) -> Result<Value, Error> {
    let mut text = String::new();
    if holds_float(value) {
        py_str(value, &mut text);
    } else {
        text = value.to_string();
    }
    let out = match chars.as_ref().filter(|c| !c.is_none() && !c.is_undefined()) {
        Some(chars) => {
            let set: Vec<char> = chars.to_string().chars().collect();
            text.trim_matches(&set[..]).to_string()
        }
        None => text.trim_matches(is_py_space).to_string(),
    };
    Ok(if value.is_safe() {
        Value::from_safe_string(out)
    } else {
        Value::from(out)
    })
}

/// Whether a value is or holds a float, the one kind minijinja prints differently from Python.
fn holds_float(value: &Value) -> bool {
    match value.kind() {
        ValueKind::Number => !value.is_integer(),
        ValueKind::Seq | ValueKind::Map => value.try_iter().is_ok_and(|mut items| {
            items.any(|item| {
                holds_float(&item)
                    || (value.kind() == ValueKind::Map
                        && value.get_item(&item).is_ok_and(|v| holds_float(&v)))
            })
        }),
        _ => false,
    }
}

/// Python's `repr(float)` (= `str(float)`): the shortest digits that read back, written out
/// unless the decimal exponent is below -4 or at least 16, then as `1.5e-05` / `1e+16`.
pub(crate) fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x < 0.0 { "-inf" } else { "inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // `{:e}` writes Rust's shortest round-trip digits, as Python's repr chooses them.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.unsigned_abs());
    }
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let point = exp + 1;
    let text = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else {
        let point = point as usize;
        if digits.len() > point {
            format!("{}.{}", &digits[..point], &digits[point..])
        } else {
            format!("{digits}{}.0", "0".repeat(point - digits.len()))
        }
    };
    format!("{sign}{text}")
}

/// A value as Python's `str()` writes it, for values that hold floats: a float as
/// [`py_float`], a list or dict item by item (their other items as minijinja writes them,
/// which is Python's repr already).
fn py_str(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Number if !value.is_integer() => {
            out.push_str(&py_float(f64::try_from(value.clone()).unwrap_or(f64::NAN)));
        }
        ValueKind::Seq => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let items: Vec<Value> = value.try_iter().map(Iterator::collect).unwrap_or_default();
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(item, out);
            }
            if tuple && items.len() == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            let keys: Vec<Value> = value.try_iter().map(Iterator::collect).unwrap_or_default();
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(key, out);
                out.push_str(": ");
                py_repr(&value.get_item(key).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// An item inside a printed list or dict: as [`py_str`] when it holds a float, else
/// minijinja's repr (Python's for strings, numbers, booleans and `None`).
fn py_repr(value: &Value, out: &mut String) {
    if holds_float(value) {
        py_str(value, out);
    } else {
        let _ = write!(out, "{value:?}");
    }
}

/// Prints values as jinja2 prints them: minijinja's own formatting, except for values that
/// hold a float (`{{ 1e-05 }}` is `1e-05`, not `0.00001`).
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut State,
    value: &Value,
) -> Result<(), Error> {
    if holds_float(value) {
        let mut text = String::new();
        py_str(value, &mut text);
        out.write_str(&text)
            .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
    } else {
        minijinja::escape_formatter(out, state, value)
    }
}

/// jinja2's `string` filter is Python's `str()`, floats included.
fn string(state: &State, value: &Value) -> Result<Value, Error> {
    if holds_float(value) {
        let mut text = String::new();
        py_str(value, &mut text);
        Ok(Value::from(text))
    } else {
        minijinja::filters::string(state, value)
    }
}

/// jinja2's `sequence` test: `len(value)` and `value[...]` work, so strings, lists and dicts
/// (and undefined, whose `len` is 0) are sequences.
fn is_sequence(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Bytes
        )
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, Error> {
    format_at(chrono::Utc::now(), &format)
}

/// `time` formatted as Python's `strftime` formats it (chrono's codes, a superset of the C
/// ones templates use: `%d %b %Y`, `%-d`, `%e`, `%j`, `%p`, ...); a code chrono does not know
/// is copied as it is, as glibc does.
fn format_at(time: chrono::DateTime<chrono::Utc>, format: &str) -> Result<String, Error> {
    let items = chrono::format::StrftimeItems::new_lenient(format);
    let mut out = String::new();
    write!(out, "{}", time.format_with_items(items)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format the time with {format:?}"),
        )
    })?;
    Ok(out)
}

/// How `json.dumps` lays a value out.
struct JsonStyle {
    /// `indent` as the string written once per level (`None`: all on one line).
    indent: Option<String>,
    /// Written between items of a list or dict.
    item_sep: String,
    /// Written between a key and its value.
    key_sep: String,
    /// Non-ASCII characters (and DEL) written as `\uXXXX` escapes.
    ensure_ascii: bool,
    /// Dict keys in sorted order rather than insertion order.
    sort_keys: bool,
}

fn filter_error(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// transformers' filter: `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` = `json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, its arguments given by position or name.
/// Without `separators`, `", "` and `": "` (`","` and `": "` with an indent); keys in their
/// order unless sorted.
fn tojson(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<String, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            format!(
                "tojson takes at most {} arguments after the value ({}), got {}",
                NAMES.len(),
                NAMES.join(", "),
                args.len()
            ),
        ));
    }
    let mut given = Vec::with_capacity(NAMES.len());
    for (i, name) in NAMES.iter().enumerate() {
        let by_name: Option<Value> = kwargs.get(name)?;
        given.push(
            match (args.get(i), by_name) {
                (Some(_), Some(_)) => {
                    return Err(filter_error(format!(
                        "tojson got multiple values for argument {name:?}"
                    )))
                }
                (Some(v), None) => Some(v.clone()),
                (None, v) => v,
            }
            // `none` is the default, as in Python.
            .filter(|v| !v.is_none() && !v.is_undefined()),
        );
    }
    kwargs.assert_all_used()?;
    let indent = match &given[1] {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        // Python writes `" " * indent`: a negative indent is no indentation, but newlines.
        Some(v) => match i64::try_from(v.clone()) {
            Ok(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            Err(_) => {
                return Err(filter_error(format!(
                    "tojson: indent must be an int or a string, got {v}"
                )))
            }
        },
    };
    let (item_sep, key_sep) = match &given[2] {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some(v) => {
            let parts: Vec<Value> = match v.kind() {
                ValueKind::Seq => v.try_iter()?.collect(),
                _ => Vec::new(),
            };
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(filter_error(format!(
                        "tojson: separators must be an (item_separator, key_separator) pair of \
                         strings, got {v}"
                    )))
                }
            }
        }
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: given[0].as_ref().is_some_and(Value::is_true),
        sort_keys: given[3].as_ref().is_some_and(Value::is_true),
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(out)
}

/// A scalar as JSON; a float as Python's `json.dumps` writes it (`repr(float)`, `NaN`,
/// `Infinity`); with `ensure_ascii`, every character outside `' '..='~'` that serde
/// leaves as it is written as Python writes it: `\uXXXX` in lower-case hex, a surrogate
/// pair above U+FFFF.
fn scalar_json(value: &Value, ensure_ascii: bool) -> Result<String, Error> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        let x = f64::try_from(value.clone())?;
        return Ok(match py_float(x).as_str() {
            "nan" => "NaN".into(),
            "inf" => "Infinity".into(),
            "-inf" => "-Infinity".into(),
            text => text.into(),
        });
    }
    let text = serde_json::to_string(value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    if !ensure_ascii {
        return Ok(text);
    }
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() && c != '\u{7f}' {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(out, "\\u{unit:04x}").map_err(|_| {
                    Error::new(
                        ErrorKind::BadSerialization,
                        "tojson: cannot escape".to_string(),
                    )
                })?;
            }
        }
    }
    Ok(out)
}

fn newline(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(level));
    }
}

fn write_json(
    value: &Value,
    style: &JsonStyle,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    match value.kind() {
        // transformers' `json.dumps` cannot serialise jinja2's Undefined (a TypeError).
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(style, level + 1, out);
                write_json(item, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(style, level + 1, out);
                let name = key.as_str().map_or_else(|| key.to_string(), str::to_string);
                out.push_str(&scalar_json(&Value::from(name), style.ensure_ascii)?);
                out.push_str(&style.key_sep);
                write_json(&value.get_item(key)?, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push('}');
        }
        _ => out.push_str(&scalar_json(value, style.ensure_ascii)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use minijinja::context;

    use super::format_at;

    fn at(unix_secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(unix_secs, 0).expect("in range")
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-07-26 23:05:09 UTC (`date -u -d @1722035109`): a Friday, day 208 of a leap year.
        let t = at(1_722_035_109);
        assert_eq!(format_at(t, "%d %b %Y").expect("format"), "26 Jul 2024");
        assert_eq!(
            format_at(t, "%A %B %-d, %y %H:%M:%S %I%p %j %%").expect("format"),
            "Friday July 26, 24 23:05:09 11PM 208 %"
        );
        // The epoch itself, and a day before it.
        assert_eq!(
            format_at(at(0), "%Y-%m-%d %a").expect("format"),
            "1970-01-01 Thu"
        );
        assert_eq!(
            format_at(at(-86_400), "%Y-%m-%d %a %j").expect("format"),
            "1969-12-31 Wed 365"
        );
        // 2000 is a leap year: 29 Feb exists and 1 Mar is day 61.
        assert_eq!(
            format_at(at(951_868_800), "%Y-%m-%d %j").expect("format"),
            "2000-03-01 061"
        );
    }

    #[test]
    fn strftime_hand_checked_leap_day_and_padding() {
        // 2024-02-29 00:00:00 UTC = 19782 days × 86400 s after the epoch: leap day, a
        // Thursday (19782 = 7·2826, and day 0 was a Thursday), day 31 + 29 = 60 of the year;
        // midnight is 12 AM on a 12-hour clock.
        let t = at(19_782 * 86_400);
        assert_eq!(
            format_at(t, "%Y-%m-%d %A %j %-d %I%p").expect("format"),
            "2024-02-29 Thursday 060 29 12AM"
        );
        // One second before 1 March: the day is space-padded by %e, zero-padded by %d.
        let t = at(19_783 * 86_400 - 1);
        assert_eq!(
            format_at(t, "%e|%d %H:%M:%S %I %p").expect("format"),
            "29|29 23:59:59 11 PM"
        );
        assert_eq!(
            format_at(at(19_783 * 86_400), "[%e]").expect("format"),
            "[ 1]"
        );
    }

    #[test]
    fn strftime_copies_an_unknown_code() {
        assert_eq!(format_at(at(0), "%Y %Q").expect("format"), "1970 %Q");
    }

    fn render(src: &str, ctx: minijinja::Value) -> String {
        let env = super::environment().expect("env");
        env.render_str(src, ctx).expect("render")
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Expected strings are what Python 3.11 prints for x = {"a": {"x": None, "y": True},
        // "b": [1, 2.5, "é\n"], "c": []}: json.dumps(x, ensure_ascii=False) and with indent=2.
        let v = serde_json::json!({"a": {"x": null, "y": true}, "b": [1, 2.5, "é\n"], "c": []});
        let ctx = context! { v => minijinja::Value::from(minijinja::value::Serde(&v)) };
        let flat = render("{{ v | tojson }}", ctx.clone());
        assert_eq!(
            flat,
            r#"{"a": {"x": null, "y": true}, "b": [1, 2.5, "é\n"], "c": []}"#
        );
        let indented = render("{{ v | tojson(indent=2) }}", ctx);
        assert_eq!(
            indented,
            "{\n  \"a\": {\n    \"x\": null,\n    \"y\": true\n  },\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],\n  \"c\": []\n}"
        );
    }

    /// A tool schema or tool-call arguments parsed from a request keep their keys' order
    /// through `tojson`, as Python's `json.loads` then `json.dumps` keep it, so the prompt
    /// is the one SGLang's transformers renders (serde_json's `preserve_order`: its maps
    /// sorted their keys before).
    #[test]
    fn tojson_keeps_the_order_a_request_wrote() {
        // json.dumps(json.loads(s), ensure_ascii=False) == s for this s in Python 3.11: its
        // separators are json.dumps' defaults, so the output must be the input.
        let s = r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"], "type": "string"}}, "required": ["city"]}}}"#;
        let v: serde_json::Value = serde_json::from_str(s).expect("json");
        let ctx = context! { v => minijinja::Value::from(minijinja::value::Serde(&v)) };
        assert_eq!(render("{{ v | tojson }}", ctx.clone()), s);
        // Iterating the map in a template sees the same order.
        assert_eq!(
            render("{% for k in v.function %}{{ k }},{% endfor %}", ctx),
            "name,description,parameters,"
        );
    }

    #[test]
    fn tojson_takes_transformers_arguments_as_json_dumps_does() {
        // Expected strings are what Python 3.11 prints for x = {"a": {"x": None, "y": True},
        // "b": [1, 2.5, "é\n"], "c": [], "d": "π😀\x7f"}: json.dumps(x, ensure_ascii=True),
        // json.dumps(x, ensure_ascii=False, separators=(",", ":")) and json.dumps(x,
        // ensure_ascii=False, indent=2, separators=(", ", " = "), sort_keys=True).
        let v = serde_json::json!({"a": {"x": null, "y": true}, "b": [1, 2.5, "é\n"], "c": [], "d": "π😀\u{7f}"});
        let ctx = context! { v => minijinja::Value::from(minijinja::value::Serde(&v)) };
        assert_eq!(
            render("{{ v | tojson(ensure_ascii=true) }}", ctx.clone()),
            r#"{"a": {"x": null, "y": true}, "b": [1, 2.5, "\u00e9\n"], "c": [], "d": "\u03c0\ud83d\ude00\u007f"}"#
        );
        assert_eq!(
            render("{{ v | tojson(separators=(',', ':')) }}", ctx.clone()),
            "{\"a\":{\"x\":null,\"y\":true},\"b\":[1,2.5,\"é\\n\"],\"c\":[],\"d\":\"π😀\u{7f}\"}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(indent=2, separators=[', ', ' = '], sort_keys=true) }}",
                ctx.clone()
            ),
            "{\n  \"a\" = {\n    \"x\" = null, \n    \"y\" = true\n  }, \n  \"b\" = [\n    1, \n    2.5, \n    \"é\\n\"\n  ], \n  \"c\" = [], \n  \"d\" = \"π😀\u{7f}\"\n}"
        );
        // transformers' jinja2 (5.25) renders {"b": "é", "a": [1, 2]} through
        // `tojson(True)|tojson(false, none, (",", ":"))|tojson(indent=1)` as below: the
        // arguments by position too, in json.dumps' order.
        let x = context! { b => "é", a => vec![1, 2] };
        let ctx = context! { x => x };
        assert_eq!(
            render(
                "{{ x | tojson(True) }}|{{ x | tojson(false, none, (',', ':')) }}|{{ x | tojson(indent=1) }}",
                ctx.clone()
            ),
            "{\"b\": \"\\u00e9\", \"a\": [1, 2]}|{\"b\":\"é\",\"a\":[1,2]}|{\n \"b\": \"é\",\n \"a\": [\n  1,\n  2\n ]\n}"
        );
        // A string indent is written as it is, a zero or negative one gives bare newlines
        // (json.dumps({"b": 1, "a": [1]}, indent="\t") and indent=0 / indent=-3).
        let x = context! { b => 1, a => vec![1] };
        let ctx = context! { x => x };
        assert_eq!(
            render("{{ x | tojson(indent='\t') }}", ctx.clone()),
            "{\n\t\"b\": 1,\n\t\"a\": [\n\t\t1\n\t]\n}"
        );
        for indent in ["0", "-3"] {
            assert_eq!(
                render(
                    &format!("{{{{ x | tojson(indent={indent}) }}}}"),
                    ctx.clone()
                ),
                "{\n\"b\": 1,\n\"a\": [\n1\n]\n}"
            );
        }
        // Wrong arguments are refused by name.
        let env = super::environment().expect("env");
        for (src, want) in [
            ("{{ x | tojson(separators=(',',)) }}", "separators must be"),
            (
                "{{ x | tojson(indent=[1]) }}",
                "indent must be an int or a string",
            ),
            (
                "{{ x | tojson(true, ensure_ascii=true) }}",
                "multiple values for argument \"ensure_ascii\"",
            ),
            ("{{ x | tojson(1, 2, 3, 4, 5) }}", "at most 4 arguments"),
            ("{{ x | tojson(colour=1) }}", "colour"),
        ] {
            let err = env.render_str(src, ctx.clone()).expect_err(src);
            assert!(format!("{err:#}").contains(want), "{src}: {err:#}");
        }
    }

    #[test]
    fn floats_are_written_as_python_repr_writes_them() {
        // Python 3.11: [repr(x) for x in (1e-05, 0.0001, 1e16, 1e15, 9999999999999998.0,
        // 1.7976931348623157e308, 5e-324, -0.0, 0.1, 1/3, 2.5e-10, 123456.789, 1e22, 1.0,
        // -1e-7, 12345678901234567890.0)].
        let cases = [
            (1e-05, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (9999999999999998.0, "9999999999999998.0"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1.0 / 3.0, "0.3333333333333333"),
            (2.5e-10, "2.5e-10"),
            (123456.789, "123456.789"),
            (1e22, "1e+22"),
            (1.0, "1.0"),
            (-1e-7, "-1e-07"),
            (12345678901234567890.0, "1.2345678901234567e+19"),
        ];
        for (x, want) in cases {
            assert_eq!(super::py_float(x), want, "{x:e}");
        }
    }

    #[test]
    fn generation_tags_become_with_blocks() {
        assert_eq!(
            super::generation_blocks(
                "a{%- generation +%}b{%endgeneration%}{% if x %}{%+ generation  -%}"
            ),
            "a{%- with +%}b{%endwith%}{% if x %}{%+ with  -%}"
        );
        // Other tags and names that only start with the word stay as they are.
        let other = "{% generations %}{{ generation }}{% set generation = 1 %}{%";
        assert_eq!(super::generation_blocks(other), other);
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let env = super::environment().expect("env");
        let err = env
            .render_str("{{ raise_exception('no system role') }}", context! {})
            .expect_err("must fail");
        assert!(err.to_string().contains("no system role"), "{err}");
    }

    #[test]
    fn python_methods_and_block_trimming() {
        let out = render(
            "{% for m in ms %}\n  {{ m.strip().upper() }}|{% if m.startswith(' a') %}A{% endif %}\n{% endfor %}",
            context! { ms => vec![" ab ", "cd"] },
        );
        // jinja2 with trim_blocks + lstrip_blocks renders this to the same string: the
        // newline after each `%}` is dropped, the indentation before `{{` is kept.
        assert_eq!(out, "  AB|A  CD|");
    }
}
