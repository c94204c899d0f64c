//! What the server takes from the model besides its weights, as SGLang's `ModelConfig` and
//! `Req` take it: the ids that end every request ([`model_stop_ids`], one rule for all
//! endpoints) and, with `--sampling-defaults model` (SGLang's default), the sampling values of
//! `generation_config.json` that a chat request without its own takes ([`SamplingDefaults`]).

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use r3_text::{GenerationConfig, TextError, TextTokenizer};

use super::openai_sampling::OpenAiSampling;

/// The ids that end a request unless it sets `ignore_eos`, on every endpoint:
/// config.json's `eos_token_id`(s) and generation_config.json's
/// (`ModelConfig._get_hf_eos_token_id`) with the tokenizer's stops by r3-text's rule
/// ([`r3_text::model_stop_ids`], the one the trainer sends as its fleet's stop ids).
pub fn model_stop_ids(
    config_eos: &[u32],
    generation_eos: &[u32],
    tokenizer: Option<&TextTokenizer>,
) -> Vec<u32> {
    let model_eos: Vec<u32> = config_eos.iter().chain(generation_eos).copied().collect();
    r3_text::model_stop_ids(&model_eos, tokenizer)
}

/// SGLang's `--sampling-defaults`: where a chat request's unset `temperature`, `top_p`,
/// `top_k`, `min_p` and `repetition_penalty` come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SamplingDefaultsMode {
    /// The model's `generation_config.json`, then OpenAI's (SGLang's default).
    #[default]
    Model,
    /// OpenAI's alone: temperature 1, top-p 1, no top-k, min-p 0, no repetition penalty.
    OpenAi,
}

impl FromStr for SamplingDefaultsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "model" => Ok(SamplingDefaultsMode::Model),
            "openai" => Ok(SamplingDefaultsMode::OpenAi),
            other => Err(format!("{other:?} is not one of model, openai")),
        }
    }
}

impl fmt::Display for SamplingDefaultsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SamplingDefaultsMode::Model => "model",
            SamplingDefaultsMode::OpenAi => "openai",
        })
    }
}

/// The sampling values a chat request takes where it sets none of its own (SGLang's
/// `ChatCompletionRequest.to_sampling_params`: "user value > model generation_config >
/// OpenAI defaults"). `/generate` and `/v1/completions` never take them: SGLang's native
/// `SamplingParams` and its `CompletionRequest` have fixed defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k` (-1: no cut).
    pub top_k: Option<i64>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// The values `generation_config.json` sets. Its `top_k: 0` (transformers' "no top-k
    /// cut") becomes -1: SGLang would pass the 0 on and refuse every chat request that sets
    /// no `top_k` of its own, which cannot be what the file means.
    pub fn of(generation: &GenerationConfig) -> Self {
        SamplingDefaults {
            temperature: generation.temperature.map(|t| t as f32),
            top_p: generation.top_p.map(|p| p as f32),
            top_k: generation.top_k.map(|k| if k == 0 { -1 } else { k }),
            min_p: generation.min_p.map(|p| p as f32),
            repetition_penalty: generation.repetition_penalty.map(|r| r as f32),
        }
    }

    /// Whether no value is set.
    pub fn is_empty(&self) -> bool {
        *self == SamplingDefaults::default()
    }

    /// `sampling` with every value it leaves unset taken from these defaults.
    pub fn fill(&self, sampling: &OpenAiSampling) -> OpenAiSampling {
        OpenAiSampling {
            temperature: sampling.temperature.or(self.temperature),
            top_p: sampling.top_p.or(self.top_p),
            top_k: sampling.top_k.or(self.top_k),
            min_p: sampling.min_p.or(self.min_p),
            repetition_penalty: sampling.repetition_penalty.or(self.repetition_penalty),
            ..sampling.clone()
        }
    }
}

impl fmt::Display for SamplingDefaults {
    /// `temperature=0.6 top_p=0.95 top_k=20`, or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let floats = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
        ];
        let mut parts: Vec<String> = floats
            .iter()
            .filter_map(|(name, v)| v.map(|v| format!("{name}={v}")))
            .collect();
        if let Some(k) = self.top_k {
            parts.insert(2.min(parts.len()), format!("top_k={k}"));
        }
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

/// What the server takes from the model directory's `generation_config.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelGeneration {
    /// Its `eos_token_id`(s): every request stops at them as at config.json's
    /// ([`model_stop_ids`]).
    pub eos_token_ids: Vec<u32>,
    /// Where chat defaults come from.
    pub mode: SamplingDefaultsMode,
    /// The chat defaults taken from it (empty with [`SamplingDefaultsMode::OpenAi`]).
    pub chat_defaults: SamplingDefaults,
}

impl ModelGeneration {
    /// Reads `dir/generation_config.json` (absent: nothing taken). Under
    /// [`SamplingDefaultsMode::Model`] a value out of a sampler's range is an error naming the
    /// file and the field; under [`SamplingDefaultsMode::OpenAi`] only its eos ids are read, as
    /// SGLang never looks at the sampling values in that mode.
    pub fn from_model_dir(dir: &Path, mode: SamplingDefaultsMode) -> Result<Self, TextError> {
        let generation = match mode {
            SamplingDefaultsMode::Model => GenerationConfig::from_model_dir(dir)?,
            SamplingDefaultsMode::OpenAi => GenerationConfig::eos_from_model_dir(dir)?,
        };
        Ok(Self::of(&generation, mode))
    }

    /// What the server takes from `generation` under `mode`.
    pub fn of(generation: &GenerationConfig, mode: SamplingDefaultsMode) -> Self {
        ModelGeneration {
            eos_token_ids: generation.eos_token_ids.clone(),
            mode,
            chat_defaults: match mode {
                SamplingDefaultsMode::Model => SamplingDefaults::of(generation),
                SamplingDefaultsMode::OpenAi => SamplingDefaults::default(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's file under each mode: `model` takes its three values (and its eos list),
    /// `openai` takes none but keeps the eos list; top-k 0 is no cut.
    #[test]
    fn modes_take_what_sglang_takes() {
        let qwen = GenerationConfig {
            eos_token_ids: vec![151645, 151643],
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            ..GenerationConfig::default()
        };
        let model = ModelGeneration::of(&qwen, SamplingDefaultsMode::Model);
        assert_eq!(model.eos_token_ids, vec![151645, 151643]);
        assert_eq!(
            model.chat_defaults.to_string(),
            "temperature=0.6 top_p=0.95 top_k=20"
        );
        let openai = ModelGeneration::of(&qwen, SamplingDefaultsMode::OpenAi);
        assert!(openai.chat_defaults.is_empty());
        assert_eq!(openai.eos_token_ids, vec![151645, 151643]);
        let off = GenerationConfig {
            top_k: Some(0),
            ..GenerationConfig::default()
        };
        assert_eq!(SamplingDefaults::of(&off).top_k, Some(-1));
        assert_eq!("openai".parse(), Ok(SamplingDefaultsMode::OpenAi));
        let err = "vllm".parse::<SamplingDefaultsMode>().expect_err("unknown");
        assert!(err.contains("model, openai"), "{err}");
    }

    /// `--sampling-defaults openai` starts on a generation_config.json whose sampling values
    /// are out of range (SGLang ignores them in that mode) and keeps its eos ids; `model`
    /// still refuses the file, naming the field.
    #[test]
    fn openai_mode_reads_only_the_eos_ids() {
        let dir = std::env::temp_dir().join(format!("r3-server-gen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let file = r#"{"eos_token_id": [7, 9], "top_p": 0, "repetition_penalty": 2.5}"#;
        std::fs::write(dir.join("generation_config.json"), file).expect("write");
        let openai = ModelGeneration::from_model_dir(&dir, SamplingDefaultsMode::OpenAi);
        let model = ModelGeneration::from_model_dir(&dir, SamplingDefaultsMode::Model);
        let _ = std::fs::remove_dir_all(&dir);
        let openai = openai.expect("openai mode ignores the sampling values");
        assert_eq!(openai.eos_token_ids, vec![7, 9]);
        assert!(openai.chat_defaults.is_empty());
        let err = model.expect_err("model mode checks them").to_string();
        assert!(err.contains("top_p"), "{err}");
    }

    /// A request's own value wins; an unset one takes the default; other fields are kept.
    #[test]
    fn fill_keeps_the_requests_own_values() {
        let d = SamplingDefaults {
            temperature: Some(0.6),
            top_k: Some(20),
            repetition_penalty: Some(1.1),
            ..SamplingDefaults::default()
        };
        let asked = OpenAiSampling {
            temperature: Some(1.0),
            seed: Some(4),
            ..OpenAiSampling::default()
        };
        let s = d.fill(&asked);
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.repetition_penalty),
            (Some(1.0), Some(20), None, Some(1.1))
        );
        assert_eq!(s.seed, Some(4));
    }
}
