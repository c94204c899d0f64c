//! Reading a [`TrainConfig`]: built-in defaults ← a TOML file or text ← `--set key=value`
//! overrides (an unknown key anywhere is an error that names it), then the checks on values
//! that are well-typed but meaningless (each error names its key); and writing the
//! resolved config into the run directory.

use std::path::{Path, PathBuf};

use r3_tasks::RewardKind;

use crate::config::limits::{check_limits, refuse_greedy_band};
use crate::config::overrides::{apply_overrides, merge_known};
use crate::config::train::{RolloutBackend, TrainConfig};
use crate::error::{Result, TrainError};

impl TrainConfig {
    /// Defaults, then the TOML file `file` (if any), then `overrides` (`key=value`), then
    /// validation.
    pub fn resolve(file: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let from_file = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
                Some(
                    toml::from_str(&text)
                        .map_err(TrainError::config_parse(path.display().to_string()))?,
                )
            }
            None => None,
        };
        Self::layered(from_file, overrides)
    }

    /// Defaults, then the TOML `text`, then `overrides`, then validation: how `r3 train`
    /// resolves its built-in default config.
    pub fn resolve_text(text: &str, overrides: &[String]) -> Result<Self> {
        let incoming = toml::from_str(text).map_err(TrainError::config_parse("text"))?;
        Self::layered(Some(incoming), overrides)
    }

    fn layered(incoming: Option<toml::Value>, overrides: &[String]) -> Result<Self> {
        let mut value =
            toml::Value::try_from(Self::default()).map_err(TrainError::config_serialize)?;
        if let Some(incoming) = incoming {
            merge_known(&mut value, incoming, "")?;
        }
        apply_overrides(&mut value, overrides)?;
        let cfg: Self = value
            .try_into()
            .map_err(TrainError::config_parse("values"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a complete config from TOML text (missing fields take their defaults).
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let cfg: Self = toml::from_str(text).map_err(TrainError::config_parse("text"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The config as TOML text (every field, so a run can be repeated from it).
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(TrainError::config_serialize)
    }

    /// Writes the resolved config to `path` atomically (temporary file, then rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = self.to_toml_string()?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let io = |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Checks values that are well-typed but meaningless, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |field: &'static str, reason: String| Err(TrainError::InvalidConfig { field, reason });
        let (r, a, o) = (&self.rollout, &self.algo, &self.optim);
        self.train.precision()?;
        self.train.check_narrow_gradients()?;
        self.train.master_weights()?;
        self.train.bf16_gradient_sums()?;
        self.optim.moment_dtype()?;
        self.train.device_spec()?;
        if self.task.difficulty == 0 {
            return bad("task.difficulty", "levels start at 1".into());
        }
        if r.prompts_per_step == 0 || r.group_size == 0 {
            return bad(
                "rollout",
                "prompts_per_step and group_size must be >= 1".into(),
            );
        }
        if r.max_new_tokens == 0 {
            return bad("rollout.max_new_tokens", "must be >= 1".into());
        }
        if !matches!(r.dtype.as_str(), "f16" | "bf16" | "f32") {
            return bad(
                "rollout.dtype",
                format!("`{}` must be `f16`, `bf16` or `f32`", r.dtype),
            );
        }
        // `rollout.dtype` is checked above. A router named `bf16` / `f16` beside an engine
        // of another dtype would run in the engine's: `parse_for` refuses it.
        if let Err(e) = r
            .dtype
            .parse::<r3_rollout::Dtype>()
            .and_then(|engine| r3_rollout::RouterDtype::parse_for(&r.router_dtype, engine))
        {
            return bad("rollout.router_dtype", e.to_string());
        }
        let device = match r.device.parse::<r3_rollout::RolloutDevice>() {
            Ok(device) => device,
            Err(e) => return bad("rollout.device", e.to_string()),
        };
        if let Err(e) = r
            .kv_cache_dtype
            .parse::<r3_rollout::KvCacheDtype>()
            .and_then(|kv| {
                // `rollout.dtype` is checked above.
                let engine = r.dtype.parse::<r3_rollout::Dtype>()?;
                device.check_kv_cache_dtype(kv, engine)
            })
        {
            return bad("rollout.kv_cache_dtype", e.to_string());
        }
        if r.temperature.is_nan() || r.temperature <= 0.0 {
            return bad(
                "rollout.temperature",
                format!("{} must be > 0", r.temperature),
            );
        }
        // Below r3_rollout's GREEDY_TEMPERATURE (SGLang's rule) every engine samples greedily
        // and reports temperature-1 log-probs, which the trainer's 1 / T scoring would not
        // match (it also keeps 1 / T finite in f32).
        refuse_greedy_band("rollout.temperature", r.temperature)?;
        // Any temperature in [GREEDY_TEMPERATURE, MAX_TEMPERATURE] (limits.rs holds the
        // upper bound): the trainer scores the policy `softmax(logits / T)` the rollouts
        // sample from and the engines report log-probs under, so ratios, IS weights and the
        // mismatch compare like with like.
        if r.backend == RolloutBackend::Sglang && r.urls.is_empty() {
            return bad(
                "rollout.urls",
                "rollout.backend = \"sglang\" needs at least one worker URL".into(),
            );
        }
        if r.async_rollout && r.backend != RolloutBackend::Sglang {
            return bad(
                "rollout.async",
                "needs rollout.backend = \"sglang\" (the in-process engine shares the trainer's cores)"
                    .into(),
            );
        }
        if r.async_rollout && r.max_staleness == 0 {
            return bad(
                "rollout.max_staleness",
                "rollout.async = true trains on batches one weight version old; set max_staleness >= 1"
                    .into(),
            );
        }
        if r.max_in_flight == 0 {
            return bad("rollout.max_in_flight", "must be >= 1".into());
        }
        if !(r.request_timeout_s.is_finite() && r.request_timeout_s > 0.0) {
            return bad(
                "rollout.request_timeout_s",
                format!("{} must be > 0", r.request_timeout_s),
            );
        }
        for (name, eps, max) in [
            ("algo.eps_low", a.eps_low, 1.0),
            ("algo.gspo_eps_low", a.gspo_eps_low, 1.0),
            ("algo.eps_high", a.eps_high, f64::INFINITY),
            ("algo.gspo_eps_high", a.gspo_eps_high, f64::INFINITY),
        ] {
            if eps.is_nan() || eps < 0.0 || eps >= max {
                return bad(name, format!("{eps} must be in [0, {max})"));
            }
        }
        if a.mini_batches == 0 {
            return bad("algo.mini_batches", "must be >= 1".into());
        }
        if a.mini_batches > r.prompts_per_step * r.group_size {
            return bad(
                "algo.mini_batches",
                format!("{} exceeds the samples per step", a.mini_batches),
            );
        }
        if a.is_threshold.is_nan() || a.is_threshold <= 0.0 {
            return bad(
                "algo.is_threshold",
                format!("{} must be > 0", a.is_threshold),
            );
        }
        if o.lr.is_nan() || o.lr <= 0.0 {
            return bad("optim.lr", format!("{} must be > 0", o.lr));
        }
        for (name, beta) in [("optim.beta1", o.beta1), ("optim.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(name, format!("{beta} must be in [0, 1)"));
            }
        }
        if !(0.0..=1.0).contains(&o.min_lr_ratio) {
            return bad(
                "optim.min_lr_ratio",
                format!("{} must be in [0, 1]", o.min_lr_ratio),
            );
        }
        if self.eval.temperature.is_nan() || self.eval.temperature < 0.0 {
            return bad("eval.temperature", "must be >= 0".into());
        }
        // 0 is greedy; (0, GREEDY_TEMPERATURE) would be too, but silently.
        refuse_greedy_band("eval.temperature", self.eval.temperature)?;
        if self.eval.samples_per_prompt == 0 {
            return bad("eval.samples_per_prompt", "must be >= 1".into());
        }
        if self.eval.samples_per_prompt > 1 && self.eval.temperature == 0.0 {
            return bad(
                "eval.samples_per_prompt",
                format!(
                    "{k} samples per prompt at eval.temperature = 0 would be {k} identical \
                     greedy answers; set eval.temperature > 0",
                    k = self.eval.samples_per_prompt
                ),
            );
        }
        self.validate_data_and_reward()?;
        check_limits(self)
    }

    fn validate_data_and_reward(&self) -> Result<()> {
        let bad =
            |field: &'static str, reason: String| Err(TrainError::InvalidConfig { field, reason });
        if !(0.0..1.0).contains(&self.task.format_reward) {
            return bad(
                "task.format_reward",
                format!("{} must be in [0, 1)", self.task.format_reward),
            );
        }
        if let Err((field, reason)) = self.reward.validate() {
            return bad("reward", format!("{field}: {reason}"));
        }
        let d = &self.data;
        if !self.uses_dataset() {
            if !d.val_files.is_empty() {
                return bad(
                    "data.val_files",
                    "set without data.train_files (the built-in task has its own eval set)".into(),
                );
            }
            return Ok(());
        }
        if d.prompt_key.is_empty() {
            return bad("data.prompt_key", "must not be empty".into());
        }
        if self.eval.every > 0 && d.val_files.is_empty() {
            return bad(
                "data.val_files",
                "eval.every > 0 needs held-out files (or set eval.every = 0)".into(),
            );
        }
        if self.reward.funcs.is_empty() && self.reward.kind == RewardKind::Arith {
            tracing::warn!("a dataset with the default `arith` reward: set reward.kind (math, exact, command) unless its answers are `#N` integers");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rollout.router_dtype` and `train.router_dtype` name `bf16` / `f16` only as their
    /// engine's own dtype: another would run silently in the engine's, so `validate` refuses
    /// it naming the key.
    #[test]
    fn router_dtypes_other_than_the_engines_are_refused() {
        let with = |overrides: &[&str]| {
            let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
            TrainConfig::resolve_text("", &overrides)
        };
        for ok in [
            &["rollout.dtype=bf16", "rollout.router_dtype=bf16"][..],
            &["rollout.dtype=f16", "rollout.router_dtype=f16"],
            &["rollout.dtype=f32", "rollout.router_dtype=f32"],
            &["rollout.dtype=bf16", "rollout.router_dtype=model"],
            &["train.dtype=bf16", "train.router_dtype=bf16"],
            &["train.dtype=f16", "train.router_dtype=f32"],
        ] {
            let cfg = with(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
            cfg.validate().unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        for (bad, key) in [
            (
                ["rollout.dtype=f32", "rollout.router_dtype=bf16"],
                "rollout.router_dtype",
            ),
            (
                ["rollout.dtype=f16", "rollout.router_dtype=bf16"],
                "rollout.router_dtype",
            ),
            (
                ["rollout.dtype=bf16", "rollout.router_dtype=f16"],
                "rollout.router_dtype",
            ),
            (
                ["train.dtype=bf16", "train.router_dtype=f16"],
                "train.router_dtype",
            ),
            (
                ["train.dtype=f32", "train.router_dtype=bf16"],
                "train.router_dtype",
            ),
        ] {
            let err = with(&bad)
                .and_then(|cfg| cfg.validate())
                .expect_err(bad[1])
                .to_string();
            assert!(err.contains(key) && err.contains("model dtype"), "{err}");
        }
    }
}
