//! The minijinja environment chat templates run in, set up as transformers sets up its
//! jinja2 one: `trim_blocks` and `lstrip_blocks`, loop controls, Python string and dict
//! methods, and the globals `raise_exception` and `strftime_now` and a `tojson` filter that
//! writes what Python's `json.dumps(..., ensure_ascii=False)` writes.

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

/// `json.dumps(value, ensure_ascii=False, indent=indent)`: `", "` and `": "` separators
/// without indent, `","` and newlines with it, keys in their order.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // transformers' filter accepts these; it always writes non-ASCII as it is.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(out)
}

fn scalar_json(value: &Value) -> Result<String, Error> {
    serde_json::to_string(value).map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))
}

fn newline(indent: Option<usize>, level: usize, out: &mut String) {
    if let Some(width) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(width * level));
    }
}

fn write_json(
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let item_sep = if indent.is_some() { "," } else { ", " };
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
                    out.push_str(item_sep);
                }
                newline(indent, level + 1, out);
                write_json(item, indent, sort_keys, level + 1, out)?;
            }
            newline(indent, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(indent, level + 1, out);
                let name = key.as_str().map_or_else(|| key.to_string(), str::to_string);
                out.push_str(&scalar_json(&Value::from(name))?);
                out.push_str(": ");
                write_json(&value.get_item(key)?, indent, sort_keys, level + 1, out)?;
            }
            newline(indent, level, out);
            out.push('}');
        }
        _ => out.push_str(&scalar_json(value)?),
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
