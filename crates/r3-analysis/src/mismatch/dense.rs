//! The dense reference point of the analysis (paper: Qwen3-8B beside Qwen3-30B-A3B): either a
//! dense checkpoint the user names, or a dense config with the MoE model's attention, width
//! and depth and an MLP as wide as the MoE layer's *active* experts, with seeded random
//! weights.

use std::path::{Path, PathBuf};

use candle_core::Device;
use r3_model::{AttentionConfig, Config, DeviceSpec, RandomInit, SharedExpert, Weights};
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::AnalysisError;

/// Keys copied verbatim from the MoE config.json into the dense one.
const COPIED_KEYS: [&str; 15] = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
];

/// Where the dense model came from (recorded in summary.json).
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DenseSource {
    /// A checkpoint directory given with `--dense-model`.
    Checkpoint {
        /// The directory.
        dir: PathBuf,
    },
    /// Built from the MoE config with seeded random weights (not trained).
    RandomInit {
        /// Seed of the weights.
        seed: u64,
        /// The dense MLP width: top-k × expert width (+ shared expert).
        intermediate_size: usize,
        /// HF model_type of the dense config.
        model_type: String,
    },
}

/// A dense model ready for both engines.
#[derive(Debug)]
pub struct DenseModel {
    /// Its config.
    pub config: Config,
    /// f32 weights with HF names.
    pub weights: Weights,
    /// Where it came from.
    pub source: DenseSource,
}

impl DenseModel {
    /// Loads a dense checkpoint; an MoE checkpoint here is an error.
    pub fn load(dir: &Path) -> Result<Self, AnalysisError> {
        let config = Config::from_file(&dir.join("config.json"))
            .map_err(AnalysisError::model(format!("reading {}", dir.display())))?;
        if config.moe.is_some() {
            return Err(AnalysisError::Invalid(format!(
                "--dense-model {} is an MoE model ({} experts); give a dense checkpoint",
                dir.display(),
                config.num_experts()
            )));
        }
        let weights = Weights::load(dir, &config, &Device::Cpu)
            .map_err(AnalysisError::model(format!("loading {}", dir.display())))?;
        Ok(Self {
            config,
            weights,
            source: DenseSource::Checkpoint {
                dir: dir.to_path_buf(),
            },
        })
    }

    /// A dense model of the MoE model's active size with seeded random weights.
    pub fn random_like(moe: &Config, seed: u64) -> Result<Self, AnalysisError> {
        let (value, intermediate_size, model_type) = dense_config_json(moe)?;
        let config = Config::from_value(value)
            .map_err(AnalysisError::model("building the dense reference config"))?;
        let weights = Weights::random(&config, &RandomInit::new(seed), &Device::Cpu)
            .map_err(AnalysisError::model("random dense weights"))?;
        Ok(Self {
            config,
            weights,
            source: DenseSource::RandomInit {
                seed,
                intermediate_size,
                model_type,
            },
        })
    }

    /// Its weights on `device` for the training pass (the rollout engines read the CPU
    /// copy; on the CPU this shares the tensors, copying nothing).
    pub fn on_device(&self, device: DeviceSpec) -> Result<Weights, AnalysisError> {
        let device = device.open()?;
        let map = self
            .weights
            .tensors()
            .iter()
            .map(|(name, t)| Ok((name.clone(), t.to_device(&device)?)))
            .collect::<Result<_, AnalysisError>>()?;
        Ok(Weights::from_map(map))
    }
}

/// The dense config.json for an MoE config, its MLP width and model_type.
fn dense_config_json(moe: &Config) -> Result<(Value, usize, String), AnalysisError> {
    let Some(m) = &moe.moe else {
        return Err(AnalysisError::Invalid(
            "the model is already dense; give an MoE model to analyze".into(),
        ));
    };
    let shared = match m.shared {
        SharedExpert::None => 0,
        SharedExpert::Plain { intermediate_size } | SharedExpert::Gated { intermediate_size } => {
            intermediate_size
        }
    };
    let intermediate_size = m.top_k * m.expert_intermediate_size + shared;
    if matches!(moe.attention, AttentionConfig::Mla { .. }) {
        // The same DeepSeek-V3 config (MLA attention, dense first layers) with no routed
        // experts: every layer is then a dense MLP of the MoE layers' active width.
        let mut out = moe.raw.as_object().cloned().unwrap_or_default();
        out.insert("n_routed_experts".into(), json!(0));
        out.insert("intermediate_size".into(), json!(intermediate_size));
        let model_type = moe.architecture.model_type().to_string();
        return Ok((Value::Object(out), intermediate_size, model_type));
    }
    let model_type = match moe.architecture.model_type() {
        "qwen3_moe" => "qwen3",
        "qwen2_moe" => "qwen2",
        _ => "llama",
    };
    let mut out = Map::new();
    if let Some(raw) = moe.raw.as_object() {
        for key in COPIED_KEYS {
            if let Some(v) = raw.get(key) {
                out.insert(key.to_string(), v.clone());
            }
        }
    }
    out.insert("model_type".into(), json!(model_type));
    out.insert("intermediate_size".into(), json!(intermediate_size));
    out.insert("hidden_act".into(), json!("silu"));
    Ok((
        Value::Object(out),
        intermediate_size,
        model_type.to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped DeepSeek-V3-style model: its dense counterpart keeps MLA attention and the
    /// depth, drops the routed experts, and has the MoE layers' active width (top-8 experts of
    /// width 16 plus the shared expert's 16).
    #[test]
    fn mla_model_gets_a_dense_deepseek_counterpart_of_its_active_width() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/deep-moe");
        let moe = Config::from_file(&dir.join("config.json")).expect("deep-moe config");
        let dense = DenseModel::random_like(&moe, 3).expect("dense counterpart");
        assert!(dense.config.moe.is_none());
        assert!(matches!(
            dense.config.attention,
            AttentionConfig::Mla { .. }
        ));
        assert_eq!(dense.config.num_hidden_layers, moe.num_hidden_layers);
        let m = moe.moe.as_ref().expect("moe");
        let shared = match m.shared {
            SharedExpert::Plain { intermediate_size }
            | SharedExpert::Gated { intermediate_size } => intermediate_size,
            SharedExpert::None => 0,
        };
        assert_eq!(
            dense.config.intermediate_size,
            m.top_k * m.expert_intermediate_size + shared
        );
        assert_eq!(dense.config.intermediate_size, 8 * 16 + 16);
    }
}
