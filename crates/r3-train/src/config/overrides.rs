//! Layering TOML values onto the config: a file merged over the defaults, and dotted
//! `--set key=value` overrides. Both refuse keys the config does not have.

use crate::error::{Result, TrainError};
use toml::Value;

fn known_keys(table: &toml::Table) -> String {
    let mut keys: Vec<&str> = table.keys().map(String::as_str).collect();
    keys.sort_unstable();
    keys.join(", ")
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Integer written where a float is expected becomes that float (`lr = 1` is `1.0`).
fn coerce(existing: &Value, new: Value) -> Value {
    match (existing, new) {
        (Value::Float(_), Value::Integer(i)) => Value::Float(i as f64),
        (_, v) => v,
    }
}

/// Deep-merges `incoming` into `base`; a key absent from `base` is an error naming its
/// dotted path (`prefix` is the path of `base`).
pub fn merge_known(base: &mut Value, incoming: Value, prefix: &str) -> Result<()> {
    let (Value::Table(base_t), Value::Table(inc_t)) = (&mut *base, &incoming) else {
        *base = coerce(base, incoming);
        return Ok(());
    };
    let known = known_keys(base_t);
    for (k, v) in inc_t.clone() {
        let path = join(prefix, &k);
        match base_t.get_mut(&k) {
            Some(slot) => merge_known(slot, v, &path)?,
            None => {
                return Err(TrainError::UnknownConfigKey {
                    key: path,
                    known: known.clone(),
                })
            }
        }
    }
    Ok(())
}

/// Splits `key=value` and parses the value as a TOML value (a bare word that is not valid
/// TOML is taken as a string, so `model_dir=models/x` works without quotes).
pub fn parse_override(text: &str) -> Result<(Vec<String>, Value)> {
    let bad = |reason: &str| TrainError::BadOverride {
        text: text.to_string(),
        reason: reason.to_string(),
    };
    let (key, raw) = text
        .split_once('=')
        .ok_or_else(|| bad("expected key=value"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(|part| part.trim().is_empty()) {
        return Err(bad("empty key or key part"));
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_string()));
    let path = key.split('.').map(|p| p.trim().to_string()).collect();
    Ok((path, value))
}

/// Applies `key=value` overrides in order. Unknown keys, setting a whole section, and a
/// value of the wrong type (e.g. text for a number) are errors naming the override.
pub fn apply_overrides(base: &mut Value, overrides: &[String]) -> Result<()> {
    for text in overrides {
        let (path, value) = parse_override(text)?;
        let mut node = &mut *base;
        let mut prefix = String::new();
        for part in &path {
            let Value::Table(table) = node else {
                return Err(TrainError::BadOverride {
                    text: text.clone(),
                    reason: format!("`{prefix}` is a value, not a section"),
                });
            };
            let known = known_keys(table);
            prefix = join(&prefix, part);
            node = table
                .get_mut(part)
                .ok_or_else(|| TrainError::UnknownConfigKey {
                    key: prefix.clone(),
                    known,
                })?;
        }
        *node = typed_like(node, value, text)?;
    }
    Ok(())
}

fn typed_like(existing: &Value, new: Value, text: &str) -> Result<Value> {
    let raw = text.split_once('=').map_or("", |(_, r)| r.trim());
    let new = coerce(existing, new);
    let ok = match (existing, &new) {
        (Value::Table(_), _) => {
            return Err(TrainError::BadOverride {
                text: text.to_string(),
                reason: "that key is a section; set one of its keys".into(),
            })
        }
        // Strings accept anything as its text (paths like `runs/3`, numbers as names).
        (Value::String(_), Value::String(_)) => true,
        (Value::String(_), _) => return Ok(Value::String(raw.to_string())),
        (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
    };
    if ok {
        Ok(new)
    } else {
        Err(TrainError::BadOverride {
            text: text.to_string(),
            reason: format!("expected {}, got {}", existing.type_str(), new.type_str()),
        })
    }
}
