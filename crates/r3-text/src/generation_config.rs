//! [`GenerationConfig`]: a model directory's `generation_config.json` as transformers (5.x)
//! reads it, for what a server takes from it: the eos ids generation stops on and the
//! sampling values the model's authors recommend. A key the file does not set is None (no
//! default filled in), as transformers 5's `GenerationConfig` leaves it.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, TextError};
use crate::model_files::{id_list, read_json_opt};

/// The keys of `generation_config.json` r3 reads; a file without them (or no file) is all
/// empty.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// `eos_token_id` (an id or a list of ids).
    pub eos_token_ids: Vec<u32>,
    /// `temperature`: finite, at least 0.
    pub temperature: Option<f64>,
    /// `top_p`: in (0, 1].
    pub top_p: Option<f64>,
    /// `top_k`: -1, 0 (both: no cut, 0 as transformers reads it) or a count.
    pub top_k: Option<i64>,
    /// `min_p`: in [0, 1].
    pub min_p: Option<f64>,
    /// `repetition_penalty`: in (0, 2] (SGLang's bound; 1 is none).
    pub repetition_penalty: Option<f64>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a directory without one gives the empty config.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        match read_json_opt(dir, "generation_config.json")? {
            Some(v) => Self::from_json(&v, &path),
            None => Ok(Self::default()),
        }
    }

    /// Reads only the eos ids of `dir/generation_config.json`: its sampling values are neither
    /// read nor checked, for a server that ignores them (SGLang's `--sampling-defaults openai`
    /// never looks at them).
    pub fn eos_from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        Ok(match read_json_opt(dir, "generation_config.json")? {
            Some(v) => GenerationConfig {
                eos_token_ids: id_list(v.get("eos_token_id"), &path, "eos_token_id")?,
                ..Self::default()
            },
            None => Self::default(),
        })
    }

    /// The config of the parsed file `v` (`path` names it in errors). Each sampling value is
    /// checked to lie in the range a sampler takes (SGLang's `SamplingParams.verify`), so a
    /// bad file is refused when it is read rather than on every request that leans on it.
    pub fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let bad = |field: &str, reason: String| TextError::BadField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        let number = |field: &str, ok: fn(f64) -> bool, range: &str| -> Result<Option<f64>> {
            match v.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => match x.as_f64() {
                    Some(f) if ok(f) => Ok(Some(f)),
                    _ => Err(bad(field, format!("{x} is not {range}"))),
                },
            }
        };
        let top_k = match v.get("top_k") {
            None | Some(Value::Null) => None,
            Some(x) => match x.as_i64() {
                Some(k) if k >= -1 => Some(k),
                _ => {
                    return Err(bad(
                        "top_k",
                        format!("{x} is not -1, 0 (no top-k cut) or a positive count"),
                    ))
                }
            },
        };
        Ok(GenerationConfig {
            eos_token_ids: id_list(v.get("eos_token_id"), path, "eos_token_id")?,
            temperature: number(
                "temperature",
                |t| t.is_finite() && t >= 0.0,
                "a finite number at least 0",
            )?,
            top_p: number("top_p", |p| p > 0.0 && p <= 1.0, "in (0, 1]")?,
            top_k,
            min_p: number("min_p", |p| (0.0..=1.0).contains(&p), "in [0, 1]")?,
            repetition_penalty: number("repetition_penalty", |r| r > 0.0 && r <= 2.0, "in (0, 2]")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<GenerationConfig> {
        GenerationConfig::from_json(&v, Path::new("m/generation_config.json"))
    }

    /// Qwen3-30B-A3B's file: its eos list and its recommended sampling values; keys the file
    /// leaves out stay None.
    #[test]
    fn reads_qwen3s_file() {
        let g = read(json!({"bos_token_id": 151643, "do_sample": true,
            "eos_token_id": [151645, 151643], "pad_token_id": 151643,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}))
        .expect("valid");
        assert_eq!(g.eos_token_ids, vec![151645, 151643]);
        assert_eq!(
            (g.temperature, g.top_p, g.top_k),
            (Some(0.6), Some(0.95), Some(20))
        );
        assert_eq!((g.min_p, g.repetition_penalty), (None, None));
        let one = read(json!({"eos_token_id": 2})).expect("an int");
        assert_eq!(
            one,
            GenerationConfig {
                eos_token_ids: vec![2],
                ..GenerationConfig::default()
            }
        );
    }

    /// Every out-of-range value is refused naming the file and the field.
    #[test]
    fn bad_values_name_the_field() {
        for (v, field) in [
            (json!({"temperature": -0.5}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"top_k": 2.5}), "top_k"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
            (json!({"eos_token_id": [-1]}), "eos_token_id"),
        ] {
            let err = read(v).expect_err(field).to_string();
            assert!(
                err.contains(&format!("`{field}`")) && err.contains("generation_config.json"),
                "{err}"
            );
        }
    }

    /// A directory without the file reads as the empty config.
    #[test]
    fn no_file_is_empty() {
        let dir = std::env::temp_dir().join(format!("r3-text-gen-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let g = GenerationConfig::from_model_dir(&dir).expect("no file");
        assert_eq!(g, GenerationConfig::default());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
