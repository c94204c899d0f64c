//! The rollout side of the analysis: sampled completions from the rollout engine (the CPU
//! engine or the device engine, whichever `--device` names) with their
//! per-token log-probs and (for an MoE model) the routes it used, checked for alignment, as
//! r3-train's [`RolloutSample`]s (the same value the RL step's trajectories carry).

use r3_rollout::{GenerateResult, RolloutEngine};
use r3_train::rl::sampling::{sample_prompts, RolloutSample, SamplingSpec};

use crate::AnalysisError;

/// How the rollout engine samples.
#[derive(Debug, Clone, Copy)]
pub struct SamplingSetup {
    /// Sampling temperature (1 = the raw distribution, as RL rollouts use).
    pub temperature: f32,
    /// Most tokens generated per prompt.
    pub max_new_tokens: usize,
    /// Run seed; prompt `i` is sampled with r3-train's seed `mix_seed([seed, 0, i, 0])`, as
    /// step 0 of an RL run with one sample per prompt would be.
    pub seed: u64,
}

/// Generates one completion per prompt through r3-train's `sample_prompts` (the RL loop's
/// seeding) and checks each result's shape: one log-prob per output id and, for an MoE
/// model, exactly `prompt + output − 1` route rows from position 0.
pub fn generate_samples(
    engine: &mut RolloutEngine,
    prompts: &[Vec<u32>],
    setup: SamplingSetup,
) -> Result<Vec<RolloutSample>, AnalysisError> {
    let max_pos = engine.model_config().max_position_embeddings;
    let is_moe = engine.model_config().moe.is_some();
    let stop = engine.eos_token_ids().to_vec();
    if let Some((i, p)) = prompts
        .iter()
        .enumerate()
        .find(|(_, p)| p.len() + setup.max_new_tokens > max_pos)
    {
        return Err(AnalysisError::Invalid(format!(
            "prompt {i} has {} tokens: with --max-new-tokens {} it exceeds the model's \
             max_position_embeddings {max_pos}",
            p.len(),
            setup.max_new_tokens
        )));
    }
    let spec = SamplingSpec {
        group_size: 1,
        max_new_tokens: setup.max_new_tokens,
        temperature: setup.temperature,
    };
    let results = sample_prompts(engine, prompts, spec, &stop, setup.seed, 0)?;
    prompts
        .iter()
        .zip(results)
        .enumerate()
        .map(|(i, (prompt, r))| checked_sample(i, prompt, r, is_moe))
        .collect()
}

/// The `i`-th rollout as a [`RolloutSample`], after checking its log-probs and routes line up.
fn checked_sample(
    i: usize,
    prompt: &[u32],
    r: GenerateResult,
    is_moe: bool,
) -> Result<RolloutSample, AnalysisError> {
    if r.output_ids.is_empty() {
        return Err(AnalysisError::Invalid(format!(
            "rollout {i} generated no token"
        )));
    }
    if r.output_logprobs.len() != r.output_ids.len() {
        return Err(AnalysisError::Invalid(format!(
            "rollout {i}: {} log-probs for {} output tokens",
            r.output_logprobs.len(),
            r.output_ids.len()
        )));
    }
    let rows = prompt.len() + r.output_ids.len() - 1;
    match (&r.routes, is_moe) {
        (Some(t), true) if t.start_pos() == 0 && t.num_tokens() == rows => {}
        (Some(t), true) => {
            return Err(AnalysisError::Invalid(format!(
                "rollout {i}: routes cover positions [{}, {}), expected [0, {rows})",
                t.start_pos(),
                t.start_pos() + t.num_tokens()
            )))
        }
        (None, true) => {
            return Err(AnalysisError::Invalid(format!(
                "rollout {i}: the MoE model returned no routes"
            )))
        }
        (_, false) => {}
    }
    Ok(RolloutSample {
        prompt_ids: prompt.to_vec(),
        response_ids: r.output_ids,
        rollout_logp: r.output_logprobs,
        routes: r.routes,
        cached_tokens: r.cached_tokens,
    })
}
