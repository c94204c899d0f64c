//! The rollout side of the analysis: sampled completions from the rollout engine with their
//! per-token log-probs and (for an MoE model) the routes it used, checked for alignment.

use std::collections::HashMap;

use indicatif::{ProgressBar, ProgressStyle};
use r3_rollout::{Engine, GenerateRequest, GenerateResult, SamplingParams};
use r3_routing::RouteTable;

use super::AnalysisError;

/// One rollout: a prompt, the sampled completion and what the rollout engine reported.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Generated token ids (at least one).
    pub output: Vec<u32>,
    /// Rollout-engine log-prob of each output id (raw distribution, temperature 1).
    pub rollout_logp: Vec<f32>,
    /// Rollout routes of positions `[0, prompt + output − 1)`, MoE-only space; `None` for a
    /// dense model.
    pub routes: Option<RouteTable>,
}

impl Sample {
    /// Tokens the training engine is fed: prompt + output without the final token, whose
    /// output predicts nothing. Position `prompt.len() − 1 + i` predicts `output[i]`.
    pub fn forward_input(&self) -> Vec<u32> {
        let keep = self.output.len().saturating_sub(1);
        let mut ids = Vec::with_capacity(self.prompt.len() + keep);
        ids.extend_from_slice(&self.prompt);
        ids.extend_from_slice(&self.output[..keep]);
        ids
    }

    /// The token each fed position predicts (`forward_input` shifted by one).
    pub fn targets(&self) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.prompt.len() + self.output.len() - 1);
        t.extend_from_slice(&self.prompt[1..]);
        t.extend_from_slice(&self.output);
        t
    }
}

/// How the rollout engine samples.
#[derive(Debug, Clone, Copy)]
pub struct SamplingSetup {
    /// Sampling temperature (1 = the raw distribution, as RL rollouts use).
    pub temperature: f32,
    /// Most tokens generated per prompt.
    pub max_new_tokens: usize,
    /// Base seed; request `i` uses `seed + i`.
    pub seed: u64,
}

/// Generates one completion per prompt and checks each result's shape: one log-prob per
/// output id and, for an MoE model, exactly `prompt + output − 1` route rows from position 0.
pub fn generate_samples(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    setup: SamplingSetup,
    progress: &ProgressBar,
) -> Result<Vec<Sample>, AnalysisError> {
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
    let requests: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut req = GenerateRequest::new(
                p.clone(),
                SamplingParams {
                    temperature: setup.temperature,
                    max_new_tokens: setup.max_new_tokens,
                    stop_token_ids: stop.clone(),
                    seed: setup.seed.wrapping_add(i as u64),
                    ..SamplingParams::default()
                },
            );
            req.return_routes = is_moe;
            req
        })
        .collect();
    progress.set_style(bar_style());
    progress.set_length(requests.len() as u64);
    progress.set_message("rollout (f16 engine)");
    let ids = requests
        .into_iter()
        .map(|r| engine.submit(r))
        .collect::<Result<Vec<_>, _>>()?;
    let mut done = HashMap::with_capacity(ids.len());
    while engine.has_work() {
        for r in engine.step()? {
            done.insert(r.id, r);
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    let results: Vec<GenerateResult> = ids.iter().filter_map(|id| done.remove(id)).collect();
    if results.len() != prompts.len() {
        return Err(AnalysisError::Invalid(format!(
            "the rollout engine returned {} results for {} prompts",
            results.len(),
            prompts.len()
        )));
    }
    let mut samples = Vec::with_capacity(results.len());
    for (i, (prompt, r)) in prompts.iter().zip(results).enumerate() {
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
        samples.push(Sample {
            prompt: prompt.clone(),
            output: r.output_ids,
            rollout_logp: r.output_logprobs,
            routes: r.routes,
        });
    }
    Ok(samples)
}

/// Progress bar style shared by the analysis stages.
pub fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{msg:28} [{bar:30}] {pos}/{len} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}
