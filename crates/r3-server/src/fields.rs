//! Checked reading of the polymorphic JSON fields clients send: a prompt that is one token
//! list or a batch of them, per-request options that are one value or one per prompt.
//! Every error names the field and, for lists, the index.

use r3_text::json_kind;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::ApiError;

/// Parses a request body, naming the problem if it is not the expected JSON object.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            json_kind(&value)
        )));
    }
    from_value_at(value, "invalid request")
}

/// Deserialises `value`, naming the field at fault in the error (`{context}.a.b: …`).
pub fn from_value_at<T: DeserializeOwned>(value: Value, context: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(format!("{context}: {inner}"))
        } else {
            ApiError::bad_request(format!("{context}.{path}: {inner}"))
        }
    })
}

/// One token list (`[1, 2]`) or a batch of them (`[[1, 2], [3]]`); returns the prompts and
/// whether it was a batch.
pub fn token_prompts(v: &Value, field: &str) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    let Value::Array(items) = v else {
        return Err(ApiError::bad_request(format!(
            "{field} must be a list of token ids or a list of such lists, got {}",
            json_kind(v)
        )));
    };
    if items.first().is_some_and(Value::is_array) {
        let prompts = items
            .iter()
            .enumerate()
            .map(|(i, p)| token_list(p, &format!("{field}[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((prompts, true))
    } else {
        Ok((vec![token_list(v, field)?], false))
    }
}

/// A flat list of token ids (non-negative integers that fit in u32).
pub fn token_list(v: &Value, field: &str) -> Result<Vec<u32>, ApiError> {
    let Value::Array(items) = v else {
        return Err(ApiError::bad_request(format!(
            "{field} must be a list of token ids, got {}",
            json_kind(v)
        )));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "{field}[{i}] must be a non-negative integer token id, got {t}"
                    ))
                })
        })
        .collect()
}

/// One string or a list of strings; returns them and whether it was a list.
pub fn text_prompts(v: &Value, field: &str) -> Result<(Vec<String>, bool), ApiError> {
    match v {
        Value::String(s) => Ok((vec![s.clone()], false)),
        Value::Array(items) => {
            let texts = items
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    t.as_str().map(str::to_owned).ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "{field}[{i}] must be a string, got {}",
                            json_kind(t)
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((texts, true))
        }
        other => Err(ApiError::bad_request(format!(
            "{field} must be a string or a list of strings, got {}",
            json_kind(other)
        ))),
    }
}

/// A per-request option: absent (every request gets `default`), one value for all, or (for
/// a batch) a list with one value per request.
pub fn per_request<T: DeserializeOwned + Clone>(
    v: Option<&Value>,
    field: &str,
    n: usize,
    default: T,
) -> Result<Vec<T>, ApiError> {
    let parse = |v: &Value, name: &str| {
        serde_json::from_value::<T>(v.clone())
            .map_err(|e| ApiError::bad_request(format!("{name}: {e}")))
    };
    match v {
        None | Some(Value::Null) => Ok(vec![default; n]),
        Some(Value::Array(items)) => {
            if items.len() != n {
                return Err(ApiError::bad_request(format!(
                    "{field} has {} entries but the request has {n} prompts",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| parse(item, &format!("{field}[{i}]")))
                .collect()
        }
        Some(one) => Ok(vec![parse(one, field)?; n]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_single_and_batch() {
        assert_eq!(
            token_prompts(&json!([1, 2]), "input_ids"),
            Ok((vec![vec![1, 2]], false))
        );
        assert_eq!(
            token_prompts(&json!([[1], [2, 3]]), "input_ids"),
            Ok((vec![vec![1], vec![2, 3]], true))
        );
        let err = token_prompts(&json!([[1], [2, -3]]), "input_ids").expect_err("negative id");
        assert!(err.message.contains("input_ids[1][1]"), "{}", err.message);
        let err = token_prompts(&json!([1, 2.5]), "input_ids").expect_err("fractional id");
        assert!(err.message.contains("input_ids[1]"), "{}", err.message);
        let err = token_prompts(&json!("hi"), "input_ids").expect_err("string");
        assert!(err.message.contains("got a string"), "{}", err.message);
        let err = token_prompts(&json!([1, 4294967296u64]), "input_ids").expect_err("too big");
        assert!(err.message.contains("input_ids[1]"), "{}", err.message);
    }

    #[test]
    fn per_request_values() {
        assert_eq!(per_request::<bool>(None, "f", 3, false), Ok(vec![false; 3]));
        assert_eq!(
            per_request(Some(&json!(true)), "f", 2, false),
            Ok(vec![true, true])
        );
        assert_eq!(
            per_request(Some(&json!([1, 2])), "f", 2, 0usize),
            Ok(vec![1, 2])
        );
        let err = per_request(Some(&json!([1])), "f", 2, 0usize).expect_err("length");
        assert!(err.message.contains("1 entries"), "{}", err.message);
        let err = per_request(Some(&json!([1, "x"])), "f", 2, 0usize).expect_err("type");
        assert!(err.message.starts_with("f[1]"), "{}", err.message);
    }

    #[test]
    fn body_errors_are_400_with_reasons() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct B {
            a: u32,
        }
        for (body, needle) in [
            (&b""[..], "empty"),
            (&b"{\"a\": 1"[..], "malformed JSON"),
            (&b"[1]"[..], "got a list"),
            (&b"{\"a\": \"x\"}"[..], "invalid type"),
            (&b"{\"b\": 1}"[..], "unknown field `b`"),
            (&b"{}"[..], "missing field `a`"),
        ] {
            let err = parse_body::<B>(body).expect_err("bad body");
            assert_eq!(err.status.as_u16(), 400);
            assert!(
                err.message.contains(needle),
                "{needle:?} not in {:?}",
                err.message
            );
        }
    }
}
