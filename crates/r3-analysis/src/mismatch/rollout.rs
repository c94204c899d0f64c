//! The rollout side of the analysis: sampled completions from the rollout engine (the CPU
//! engine or the device engine, whichever `--device` names) with their
//! per-token log-probs and (for an MoE model) the routes it used, checked for alignment, as
//! r3-train's [`RolloutSample`]s (the same value the RL step's trajectories carry).
//!
//! The log-probs are the raw distribution's (`LogprobScale::Raw`, temperature 1) at any
//! sampling temperature: the training side recomputes `log softmax(logits)` at temperature
//! 1, and the mismatch it is compared with must be of the same distribution. An RL step's
//! `mismatch.k3_kl` differs there: it compares the rollout's T-scaled log-probs with
//! training scored at `rollout.temperature`, so at T ≠ 1 the two k3 KLs are different
//! quantities.

use r3_rollout::{GenerateResult, LogprobScale, RolloutEngine};
use r3_train::rl::sampling::{sampling_requests, Generate, RolloutSample, SamplingSpec};

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

/// Generates one completion per prompt with r3-train's requests (`sampling_requests`, the
/// RL loop's seeding, as its `sample_prompts` at step 0), asking each for raw log-probs,
/// and checks each result's shape: one log-prob per output id and, for an MoE model,
/// exactly `prompt + output − 1` route rows from position 0.
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
    let mut requests = sampling_requests(prompts, spec, &stop, setup.seed, 0, 0);
    for r in &mut requests {
        // The training side's recomputation is at temperature 1.
        r.sampling.logprob_scale = LogprobScale::Raw;
    }
    let results = engine.generate_batch(requests)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use r3_rollout::{Dtype, Engine, EngineConfig, GenerateRequest, SamplingParams};

    /// The CPU engine over the tests' fixture checkpoint, f32, no prefix cache.
    fn cpu_engine() -> Engine {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_tiny");
        let cfg = EngineConfig {
            dtype: Dtype::F32,
            prefix_cache: false,
            ..EngineConfig::default()
        };
        Engine::from_dir(&dir, cfg).expect("the fixture loads")
    }

    /// At temperature 0.7 the samples carry the raw distribution's log-probs, what the
    /// training side recomputes: the teacher-forced prompt log-probs of the same sequences
    /// (raw at any scale) within 1e-4, where the tempered ones (from the same whole rows)
    /// are further off than that.
    #[test]
    fn samples_carry_raw_logprobs_at_any_temperature() {
        let prompts = vec![vec![3u32, 17, 42, 99, 7], vec![5, 8, 13, 21, 34, 55]];
        let setup = SamplingSetup {
            temperature: 0.7,
            max_new_tokens: 6,
            seed: 3,
        };
        let mut engine = RolloutEngine::Cpu(cpu_engine());
        let samples = generate_samples(&mut engine, &prompts, setup).expect("samples");
        let mut forced = cpu_engine();
        let vocab = forced.model_config().vocab_size;
        let mut apart = 0;
        for s in &samples {
            let mut sequence = s.prompt_ids.clone();
            sequence.extend(&s.response_ids);
            let sampling = SamplingParams {
                prompt_logprobs_from: Some(s.prompt_ids.len() - 1),
                top_logprobs: vocab,
                ..SamplingParams::greedy(1)
            };
            let r = forced
                .generate(vec![GenerateRequest::new(sequence, sampling)])
                .expect("teacher-forced")
                .remove(0);
            let p = r.prompt_logprobs.expect("prompt log-probs");
            assert_eq!(p.logprobs.len(), s.rollout_logp.len());
            for ((&got, &raw), top) in s.rollout_logp.iter().zip(&p.logprobs).zip(&p.top_logprobs) {
                assert!((got - raw).abs() < 1e-4, "rollout {got} vs raw {raw}");
                // The tempered log-prob of the same token, from its whole raw row.
                let sum: f64 = top.iter().map(|&(_, lp)| (f64::from(lp) / 0.7).exp()).sum();
                let tempered = f64::from(raw) / 0.7 - sum.ln();
                apart += usize::from((tempered - f64::from(raw)).abs() > 0.01);
            }
        }
        assert!(apart >= 3, "only {apart} tokens tell the temperature apart");
    }
}
