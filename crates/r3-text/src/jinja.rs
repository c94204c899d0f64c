//! The minijinja environment chat templates run in, set up as transformers sets up its
//! jinja2 one: `trim_blocks` and `lstrip_blocks`, loop controls, Python string and dict
//! methods, and the globals `raise_exception` and `strftime_now` and transformers' `tojson`
//! filter, which writes what Python's `json.dumps` writes (`ensure_ascii`, `indent`,
//! `separators`, `sort_keys`).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// A fresh environment with transformers' chat-template settings and helpers.
pub(crate) fn environment() -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    Ok(env)
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

/// A scalar as JSON; with `ensure_ascii`, every character outside `' '..='~'` that serde
/// leaves as it is written as Python writes it: `\uXXXX` in lower-case hex, a surrogate
/// pair above U+FFFF.
fn scalar_json(value: &Value, ensure_ascii: bool) -> Result<String, Error> {
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
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
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
