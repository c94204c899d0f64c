//! The words error messages use for the type of a JSON value a caller sent ("got a list"),
//! shared by everything that checks JSON from outside: the HTTP server's request bodies and
//! the RL datasets' rows.

use serde_json::Value;

/// The type of `v` as an error message says it: `null`, `a boolean`, `a number`, `a string`,
/// `a list` or `an object`.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::json_kind;
    use serde_json::json;

    #[test]
    fn every_json_type_has_its_word() {
        let cases = [
            (json!(null), "null"),
            (json!(true), "a boolean"),
            (json!(1.5), "a number"),
            (json!("x"), "a string"),
            (json!([1]), "a list"),
            (json!({"a": 1}), "an object"),
        ];
        for (v, word) in cases {
            assert_eq!(json_kind(&v), word, "{v}");
        }
    }
}
