//! Sampling trajectories: G seeded requests per prompt, answered by whatever generates
//! ([`Generate`]: the in-process engine, a fleet, the trainer's backend) with each
//! response's rollout log-probs and routes, decoded and scored by the configured reward
//! (one batch per step, so an external verifier starts once per step); and evaluation on
//! the held-out prompts.

use r3_model::ReplayRoutes;
use r3_rollout::{Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams};
use r3_routing::{LayerLayout, RouteTable};
use r3_tasks::{Problem, Reward, RewardInput, RewardSpec};

use crate::error::{Result, TrainError};
use crate::policy::model_text::ModelText;
use crate::policy::trainable::ResponseBatch;
pub use crate::rl::evaluation::EvalResult;
use crate::rl::evaluation::{eval_requests, summarise_eval, EvalSpec};
use crate::rl::prompt_source::{arith_item, PromptItem};
pub use crate::rl::seed::mix_seed;

/// One sampled response as the rollout side returned it: what a training engine scores
/// and replays (the RL step's trajectories and the mismatch analysis' samples alike).
#[derive(Debug, Clone)]
pub struct RolloutSample {
    /// Prompt tokens (`<bos>` first).
    pub prompt_ids: Vec<u32>,
    /// Generated tokens (including a final `<eos>` when it stopped).
    pub response_ids: Vec<u32>,
    /// Rollout log-prob of each response token (raw distribution, engine precision).
    pub rollout_logp: Vec<f32>,
    /// Rollout routes of positions `[0, prompt + response − 1)` (MoE-only space); `None`
    /// for a dense model or when routes were not asked for.
    pub routes: Option<RouteTable>,
    /// Prompt tokens the rollout engine read from its prefix cache instead of computing
    /// (SGLang's `meta_info.cached_tokens`): the work it did not do.
    pub cached_tokens: usize,
}

impl RolloutSample {
    /// Prompt followed by response: the sequence the training engine scores.
    pub fn tokens(&self) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.prompt_ids.len() + self.response_ids.len());
        t.extend_from_slice(&self.prompt_ids);
        t.extend_from_slice(&self.response_ids);
        t
    }
}

/// One sampled response with everything the trainer needs from the rollout.
#[derive(Debug, Clone)]
pub struct Trajectory {
    /// Index of the prompt's group within the step.
    pub group: usize,
    /// The tokens, rollout log-probs and routes.
    pub sample: RolloutSample,
    /// Whether generation ended with `<eos>` (rather than the length limit).
    pub stopped: bool,
    /// Weight version of the rollout's last piece (0 for the in-process engine's first
    /// weights; a fleet reply's `meta_info.weight_version`).
    pub weight_version: u64,
    /// The decoded completion (before `<eos>`).
    pub completion: String,
    /// Reward of the response.
    pub reward: f32,
    /// Whether the reward's first function judged the response correct.
    pub correct: bool,
}

impl Trajectory {
    /// The oldest and newest weight version its route rows came from; they differ when a
    /// fleet worker aborted it at a weight update and it was resumed on the new weights.
    pub fn weight_versions(&self) -> Option<(u64, u64)> {
        let v = self.sample.routes.as_ref()?.versions()?;
        Some((*v.iter().min()?, *v.iter().max()?))
    }

    /// The oldest weight version any part of it came from.
    pub fn oldest_version(&self) -> u64 {
        self.weight_versions()
            .map_or(self.weight_version, |(lo, _)| lo.min(self.weight_version))
    }
}

/// How responses are sampled.
#[derive(Debug, Clone, Copy)]
pub struct SamplingSpec {
    /// Samples per prompt.
    pub group_size: usize,
    /// Most generated tokens.
    pub max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
}

/// The ids a response stops at: the model's eos ids (from its `config.json`), the tokenizer's
/// stop ids and SGLang's extra turn-final added tokens, by r3-text's rule
/// ([`r3_text::model_stop_ids`], the one r3-server stops every request at), so the fleet asks
/// for every id a worker may stop at.
pub fn stop_ids(eos: &[u32], text: &ModelText) -> Vec<u32> {
    r3_text::model_stop_ids(eos, Some(text.tokenizer()))
}

/// What answers sampling requests: the in-process engine, the workers of a rollout fleet,
/// or the trainer's backend (either of them).
pub trait Generate {
    /// One result per request, in request order (a count that differs is an error).
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>>;
}

impl Generate for Engine {
    fn generate_batch(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<GenerateResult>> {
        let expected = requests.len();
        let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.input_ids.clone()).collect();
        let results = self.generate(requests)?;
        refuse_non_finite_logprobs(self, &prompts, &results)?;
        check_count(results.len(), expected)?;
        Ok(results)
    }
}

/// An error naming where the forward first turned non-finite when a result holds a NaN
/// or infinite log-prob: the sequence is run once more through `engine` with every stage
/// checked (only on this failure path, so rollouts pay nothing for it).
fn refuse_non_finite_logprobs(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    results: &[GenerateResult],
) -> Result<()> {
    let bad = results
        .iter()
        .zip(prompts)
        .enumerate()
        .find_map(|(n, (r, prompt))| {
            let token = r.output_logprobs.iter().position(|l| !l.is_finite())?;
            Some((n, token, r.output_logprobs[token], prompt, r))
        });
    let Some((request, token, value, prompt, result)) = bad else {
        return Ok(());
    };
    let mut ids = prompt.clone();
    ids.extend_from_slice(&result.output_ids[..token]);
    let stage = engine.locate_non_finite(&ids)?;
    Err(TrainError::NonFiniteRollout {
        request,
        token,
        value,
        location: match stage {
            Some(stage) => format!("first non-finite in {stage}"),
            None => "every stage of a re-run was finite (the sampler's log-softmax turned it \
                     non-finite)"
                .into(),
        },
    })
}

/// Samples `spec.group_size` responses for every prompt (group-major order), stopping at
/// `stop`, the seed of sample `j` of prompt `i` being `mix_seed([seed, step, i, j])`; the
/// engine's results in request order, routes included.
pub fn sample_prompts<G: Generate + ?Sized>(
    engine: &mut G,
    prompts: &[Vec<u32>],
    spec: SamplingSpec,
    stop: &[u32],
    seed: u64,
    step: u64,
) -> Result<Vec<GenerateResult>> {
    engine.generate_batch(sampling_requests(prompts, spec, stop, seed, step, 0))
}

/// The requests of [`sample_prompts`]: `spec.group_size` per prompt, group-major, seeded
/// `mix_seed([seed, step, i, j])` in a step's first rollout round and
/// `mix_seed([seed, step, i, j, round])` in a refill round (`algo.sampling_rounds`), routes
/// asked for.
pub fn sampling_requests(
    prompts: &[Vec<u32>],
    spec: SamplingSpec,
    stop: &[u32],
    seed: u64,
    step: u64,
    round: u64,
) -> Vec<GenerateRequest> {
    let mut requests = Vec::with_capacity(prompts.len() * spec.group_size);
    for (i, ids) in prompts.iter().enumerate() {
        for j in 0..spec.group_size {
            let sampling = SamplingParams {
                temperature: spec.temperature,
                max_new_tokens: spec.max_new_tokens,
                stop_token_ids: stop.to_vec(),
                seed: match round {
                    0 => mix_seed(&[seed, step, i as u64, j as u64]),
                    r => mix_seed(&[seed, step, i as u64, j as u64, r]),
                },
                ..SamplingParams::default()
            };
            requests.push(GenerateRequest::new(ids.clone(), sampling));
        }
    }
    requests
}

/// An error unless `got` results answer `expected` requests.
pub fn check_count(got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(TrainError::EngineResults { got, expected });
    }
    Ok(())
}

/// The `spec.group_size` sampling requests for every prompt of `items` (group-major
/// order) in rollout round `round` of step `step`, stopping at `eos` and the tokenizer's
/// stop ids, seeded as [`sampling_requests`] says.
pub fn group_requests(
    eos: &[u32],
    tokenizer: &ModelText,
    items: &[PromptItem],
    spec: SamplingSpec,
    seed: u64,
    (step, round): (u64, u64),
) -> Vec<GenerateRequest> {
    let stop = stop_ids(eos, tokenizer);
    let prompts: Vec<Vec<u32>> = items.iter().map(|p| p.ids.clone()).collect();
    sampling_requests(&prompts, spec, &stop, seed, step, round)
}

/// Decodes and scores `results`, the `group_size` responses per prompt of `items`
/// (group-major), into trajectories; each text ends where its request stopped (the model's
/// `eos` and the tokenizer's stop ids, [`stop_ids`]).
pub fn score_groups(
    eos: &[u32],
    tokenizer: &ModelText,
    items: &[PromptItem],
    results: Vec<GenerateResult>,
    group_size: usize,
    reward: &Reward,
) -> Result<Vec<Trajectory>> {
    check_count(results.len(), items.len() * group_size)?;
    // A round whose every group failed at the fleet: nothing to score, and an external
    // verifier is not started for an empty batch.
    if results.is_empty() {
        return Ok(Vec::new());
    }
    let stop = stop_ids(eos, tokenizer);
    let completions = results
        .iter()
        .map(|r| tokenizer.decode_completion(&r.output_ids, &stop))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let groups: Vec<usize> = (0..results.len()).map(|n| n / group_size).collect();
    let scores = score_responses(reward, items, &groups, &completions)?;
    Ok(results
        .into_iter()
        .zip(completions)
        .zip(scores)
        .enumerate()
        .map(|(n, ((r, completion), score))| {
            let group = groups[n];
            Trajectory {
                group,
                stopped: matches!(r.finish, FinishReason::Stop { .. }),
                sample: RolloutSample {
                    prompt_ids: items[group].ids.clone(),
                    response_ids: r.output_ids,
                    rollout_logp: r.output_logprobs,
                    routes: r.routes,
                    cached_tokens: r.cached_tokens,
                },
                weight_version: r.weight_version,
                reward: score.reward,
                correct: score.correct,
                completion,
            }
        })
        .collect())
}

/// Scores `completions[n]`, the response to prompt `items[prompt_of[n]]`, in one batch.
pub fn score_responses(
    reward: &Reward,
    items: &[PromptItem],
    prompt_of: &[usize],
    completions: &[String],
) -> Result<Vec<r3_tasks::RewardScore>> {
    Ok(reward.score_batch(&reward_inputs(items, prompt_of, completions))?)
}

/// What the reward sees of `completions[n]`, the response to prompt `items[prompt_of[n]]`.
pub fn reward_inputs<'a>(
    items: &'a [PromptItem],
    prompt_of: &[usize],
    completions: &'a [String],
) -> Vec<RewardInput<'a>> {
    completions
        .iter()
        .zip(prompt_of)
        .map(|(c, &i)| {
            let item = &items[i];
            RewardInput {
                prompt: &item.text,
                response: c,
                ground_truth: &item.ground_truth,
                data_source: &item.data_source,
                extra_info: &item.extra_info,
            }
        })
        .collect()
}

/// The trajectories as a scoring batch (prompt + response, prompt lengths).
pub fn response_batch(trajectories: &[Trajectory]) -> Result<ResponseBatch> {
    ResponseBatch::new(
        trajectories.iter().map(|t| t.sample.tokens()).collect(),
        trajectories
            .iter()
            .map(|t| t.sample.prompt_ids.len())
            .collect(),
    )
}

/// The rollout route tables of the samples, checked: one per sample, covering exactly
/// the positions `[0, prompt + response − 1)` the rollout fed.
pub fn rollout_tables<'a>(
    samples: impl IntoIterator<Item = &'a RolloutSample>,
) -> Result<Vec<RouteTable>> {
    samples
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let table = s
                .routes
                .clone()
                .ok_or(TrainError::MissingRolloutRoutes { trajectory: i })?;
            let expected = s.prompt_ids.len() + s.response_ids.len() - 1;
            if table.start_pos() != 0 || table.num_tokens() != expected {
                return Err(TrainError::MisalignedRolloutRoutes {
                    trajectory: i,
                    start: table.start_pos(),
                    rows: table.num_tokens(),
                    expected,
                });
            }
            Ok(table)
        })
        .collect()
}

/// The rollout routes of the samples in the `len − 1`-row form replay accepts: where
/// routes enter a training engine, so the one place their row range
/// ([`rollout_tables`]) and coverage (a route in every cell, proven by [`ReplayRoutes`])
/// are checked.
pub fn rollout_routes<'a>(
    samples: impl IntoIterator<Item = &'a RolloutSample>,
    layout: &LayerLayout,
) -> Result<ReplayRoutes> {
    Ok(ReplayRoutes::new(rollout_tables(samples)?, layout)?)
}

/// Answers every prompt `spec.samples_per_prompt` times with `generator` (greedy when
/// `spec.temperature == 0`), stopping at `eos` and the tokenizer's stop ids, and summarises
/// what the reward judges correct per data source (`evaluation.rs`). Routes are not
/// captured.
pub fn evaluate_prompts(
    generator: &mut dyn Generate,
    eos: &[u32],
    tokenizer: &ModelText,
    items: &[PromptItem],
    reward: &Reward,
    spec: &EvalSpec,
) -> Result<EvalResult> {
    if items.is_empty() {
        return Err(TrainError::EmptyEvalSet);
    }
    let stop = stop_ids(eos, tokenizer);
    let results = generator.generate_batch(eval_requests(items, spec, &stop))?;
    let tokens: usize = results.iter().map(|r| r.output_ids.len()).sum();
    let completions = results
        .iter()
        .map(|r| tokenizer.decode_completion(&r.output_ids, &stop))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let k = spec.samples_per_prompt.max(1);
    let prompt_of: Vec<usize> = (0..completions.len()).map(|n| n / k).collect();
    let inputs = reward_inputs(items, &prompt_of, &completions);
    let scores = reward.score_batch(&inputs)?;
    summarise_eval(items, &scores, reward.vote_keys(&inputs), tokens, spec)
}

/// Answers every problem of the built-in task once with the engine (greedy when
/// `temperature == 0`) and reports exact-match accuracy: [`evaluate_prompts`] with the
/// `arith` reward. Routes are not captured.
pub fn evaluate(
    engine: &mut Engine,
    tokenizer: &ModelText,
    problems: &[Problem],
    max_new_tokens: usize,
    temperature: f32,
    seed: u64,
) -> Result<EvalResult> {
    let items = problems
        .iter()
        .map(|p| arith_item(tokenizer, p))
        .collect::<Result<Vec<_>>>()?;
    let reward = Reward::from_spec(&RewardSpec::default(), 0.0);
    let eos = engine.eos_token_ids().to_vec();
    evaluate_prompts(
        engine,
        &eos,
        tokenizer,
        &items,
        &reward,
        &EvalSpec::single(max_new_tokens, temperature, seed),
    )
}
