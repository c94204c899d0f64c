//! Range checks on the numbers of a [`TrainConfig`] beyond their types: every float finite,
//! every rate and coefficient inside the range where an update stays meaningful, every
//! size that must count something at least 1. Each error names its key.

use crate::algo::loss::PolicyLossKind;
use crate::config::train::TrainConfig;
use crate::error::{Result, TrainError};
use r3_rollout::sampler::GREEDY_TEMPERATURE;

/// Largest accepted `optim.lr`. An AdamW step moves each weight by about `lr`, so a rate
/// near 1 already rewrites the model every step; larger ones only blow weights up.
pub const MAX_LR: f64 = 1.0;

/// Largest accepted sampling temperature (`rollout.temperature`, `eval.temperature`,
/// pretraining's `word_problems.eval_temperature`):
/// far above it sampling is uniform noise.
pub const MAX_TEMPERATURE: f64 = 100.0;

/// Most rollout rounds one step may draw (`algo.sampling_rounds`): past it a task whose
/// groups all score alike would sample without end in all but name.
pub const MAX_SAMPLING_ROUNDS: usize = 64;

/// Largest accepted `algo.max_tokens_per_micro_batch`: 2^30 tokens of activations is far
/// past any machine's memory, so a larger budget is a typo (or a negative number's
/// wrap-around), not a setting.
pub const MAX_TOKENS_PER_MICRO_BATCH: usize = 1 << 30;

/// Largest accepted rollout engine budget in MiB (`rollout.kv_cache_mib`,
/// `rollout.activation_mib`, `rollout.prefix_cache_mib`): 1 PiB, past any device; the byte
/// count (`mib << 20`) stays far inside a `usize`.
pub const MAX_ENGINE_BUDGET_MIB: usize = 1 << 30;

fn invalid(field: &'static str, reason: String) -> TrainError {
    TrainError::InvalidConfig { field, reason }
}

/// Refuses a sampling temperature in `(0, GREEDY_TEMPERATURE)` for `field`. The engines
/// decide in f32 (the value they receive) that such a temperature samples greedily, as
/// SGLang's `_SAMPLING_EPS` rule does, and report the raw (temperature-1) log-probs, while
/// the trainer would score the policy at `1 / T`: ratios, IS weights and the mismatch would
/// compare different distributions. 0 and the NaN / negative values are left to the
/// field's own range check.
pub(crate) fn refuse_greedy_band(field: &'static str, temperature: f64) -> Result<()> {
    // Compared as the f32 the engines get: a value that rounds up to the threshold is not
    // greedy there, one that rounds down to 0 is.
    if temperature > 0.0 && (temperature as f32) < GREEDY_TEMPERATURE {
        return Err(invalid(
            field,
            format!(
                "{temperature:e} is below {GREEDY_TEMPERATURE:e} (SGLang's greedy threshold, \
                 _SAMPLING_EPS): the engines sample greedily there and report raw \
                 (temperature-1) log-probs, not those of softmax(logits / T); use a \
                 temperature of at least {GREEDY_TEMPERATURE:e}"
            ),
        ));
    }
    Ok(())
}

/// `value` must be finite and inside `[low, high]` (`open_low`: `low` itself excluded).
pub(crate) fn in_range(
    field: &'static str,
    value: f64,
    low: f64,
    open_low: bool,
    high: f64,
) -> Result<()> {
    let low_ok = if open_low { value > low } else { value >= low };
    if !value.is_finite() || !low_ok || value > high {
        let open = if open_low { "(" } else { "[" };
        return Err(invalid(
            field,
            format!("{value} must be finite and in {open}{low}, {high}]"),
        ));
    }
    Ok(())
}

/// Checks the numeric ranges of `cfg` (called by [`TrainConfig::validate`]).
pub fn check_limits(cfg: &TrainConfig) -> Result<()> {
    let (o, a) = (&cfg.optim, &cfg.algo);
    in_range("optim.lr", o.lr, 0.0, true, MAX_LR)?;
    in_range("optim.beta1", o.beta1, 0.0, false, 1.0)?;
    in_range("optim.beta2", o.beta2, 0.0, false, 1.0)?;
    if o.beta1 >= 1.0 || o.beta2 >= 1.0 {
        let (field, v) = match o.beta1 >= 1.0 {
            true => ("optim.beta1", o.beta1),
            false => ("optim.beta2", o.beta2),
        };
        return Err(invalid(field, format!("{v} must be in [0, 1)")));
    }
    in_range("optim.adam_eps", o.adam_eps, 0.0, true, 1.0)?;
    // lr · weight_decay stays below 1, so decay shrinks weights and never flips their sign.
    in_range("optim.weight_decay", o.weight_decay, 0.0, false, 1.0)?;
    if o.weight_decay >= 1.0 {
        return Err(invalid(
            "optim.weight_decay",
            format!("{} must be in [0, 1)", o.weight_decay),
        ));
    }
    in_range("optim.grad_clip", o.grad_clip, 0.0, false, f64::MAX)?;
    in_range("optim.min_lr_ratio", o.min_lr_ratio, 0.0, false, 1.0)?;
    in_range(
        "rollout.temperature",
        cfg.rollout.temperature,
        0.0,
        true,
        MAX_TEMPERATURE,
    )?;
    in_range(
        "eval.temperature",
        cfg.eval.temperature,
        0.0,
        false,
        MAX_TEMPERATURE,
    )?;
    in_range(
        "task.format_reward",
        cfg.task.format_reward,
        -1.0,
        false,
        1.0,
    )?;
    in_range("algo.eps_low", a.eps_low, 0.0, false, 1.0)?;
    in_range("algo.eps_high", a.eps_high, 0.0, false, f64::MAX)?;
    // Dual-clip caps the loss at −A·c, above the clipped branch's −A·(1 − eps_low) only for
    // c > 1; 0 is off.
    if a.clip_ratio_c != 0.0 && !(a.clip_ratio_c.is_finite() && a.clip_ratio_c > 1.0) {
        return Err(invalid(
            "algo.clip_ratio_c",
            format!(
                "{} must be 0 (dual-clip off) or finite and > 1 (verl's default is 3.0)",
                a.clip_ratio_c
            ),
        ));
    }
    // verl's GSPO loss has no dual-clip either: a set `c` would be silently dropped.
    if a.clip_ratio_c != 0.0 && a.loss == PolicyLossKind::Gspo {
        return Err(invalid(
            "algo.clip_ratio_c",
            format!(
                "{} is set with algo.loss = gspo, which has no dual-clip (as verl's); set \
                 algo.clip_ratio_c = 0 or algo.loss = ppo",
                a.clip_ratio_c
            ),
        ));
    }
    in_range("algo.gspo_eps_low", a.gspo_eps_low, 0.0, false, 1.0)?;
    in_range("algo.gspo_eps_high", a.gspo_eps_high, 0.0, false, f64::MAX)?;
    in_range("algo.is_threshold", a.is_threshold, 0.0, true, f64::MAX)?;
    in_range(
        "algo.entropy_coef",
        a.entropy_coef,
        -f64::MAX,
        false,
        f64::MAX,
    )?;
    // Dividing by the group std needs a positive epsilon (a uniform group has std 0).
    in_range("algo.adv_eps", a.adv_eps, 0.0, a.adv_norm_by_std, 1.0)?;
    for (field, count) in [
        ("steps", cfg.steps as usize),
        ("rollout.prompts_per_step", cfg.rollout.prompts_per_step),
        ("rollout.group_size", cfg.rollout.group_size),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("rollout.max_running", cfg.rollout.max_running),
        ("rollout.kv_cache_mib", cfg.rollout.kv_cache_mib),
        ("rollout.activation_mib", cfg.rollout.activation_mib),
        ("algo.mini_batches", a.mini_batches),
        ("algo.sampling_rounds", a.sampling_rounds),
    ] {
        if count == 0 {
            return Err(invalid(field, "must be >= 1".into()));
        }
    }
    for (field, mib) in [
        ("rollout.kv_cache_mib", cfg.rollout.kv_cache_mib),
        ("rollout.activation_mib", cfg.rollout.activation_mib),
        ("rollout.prefix_cache_mib", cfg.rollout.prefix_cache_mib),
    ] {
        if mib > MAX_ENGINE_BUDGET_MIB {
            return Err(invalid(
                field,
                format!("{mib} MiB is past the largest budget {MAX_ENGINE_BUDGET_MIB} MiB (1 PiB)"),
            ));
        }
    }
    if a.sampling_rounds > MAX_SAMPLING_ROUNDS {
        return Err(invalid(
            "algo.sampling_rounds",
            format!(
                "{} is past the most rounds a step may draw, {MAX_SAMPLING_ROUNDS}",
                a.sampling_rounds
            ),
        ));
    }
    if a.sampling_rounds > 1 && !a.dynamic_sampling {
        return Err(invalid(
            "algo.sampling_rounds",
            format!(
                "{} rounds refill the groups dynamic sampling drops: set \
                 algo.dynamic_sampling = true, or sampling_rounds = 1",
                a.sampling_rounds
            ),
        ));
    }
    if a.max_tokens_per_micro_batch > MAX_TOKENS_PER_MICRO_BATCH {
        return Err(invalid(
            "algo.max_tokens_per_micro_batch",
            format!(
                "{} is past the largest budget {MAX_TOKENS_PER_MICRO_BATCH} \
                 (0 = one micro-batch per mini-batch)",
                a.max_tokens_per_micro_batch
            ),
        ));
    }
    // With a dataset, eval.size 0 means "every validation row"; only the built-in task
    // needs a held-out size to evaluate at all.
    if cfg.eval.every > 0 && cfg.eval.size == 0 && cfg.data.train_files.is_empty() {
        return Err(invalid(
            "eval.size",
            "must be >= 1 when eval.every > 0 with the built-in task".into(),
        ));
    }
    Ok(())
}
