//! The policy as the training engine sees it: trainable f32 weights (candle `Var`s under
//! HF names), and the scoring of prompt+response sequences — per-token log-probs of the
//! response tokens, entropy, and the routing mode of the forward (`Native`, `Record`,
//! `Replay`) with the routes and replay proof it returns.

use std::ops::Range;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use r3_model::layers::attention::ScoreTiles;
use r3_model::model::head_positions::spread_over_spans;
use r3_model::model::head_scores::scale_logits;
use r3_model::model::LayerRecompute;
use r3_model::token_stats::{entropy, token_log_probs_host_checked};
use r3_model::{
    Batch, Config, HeadPositions, LoadOptions, Model, NarrowMasters, Precision, ReplayProof,
    Routing, ScoreTargets, SharedLen, Weights,
};
use r3_routing::RouteTable;

use crate::algo::logprob::{masked_mean, scalar_f32};
use crate::config::limits::refuse_greedy_band;
use crate::error::{Result, TrainError};
use crate::policy::precision::MasterWeights;

/// Prompt+response token sequences and where each response starts.
#[derive(Debug, Clone)]
pub struct ResponseBatch {
    sequences: Vec<Vec<u32>>,
    prompt_lens: Vec<usize>,
}

impl ResponseBatch {
    /// Checks that every sequence has a non-empty prompt and a non-empty response.
    pub fn new(sequences: Vec<Vec<u32>>, prompt_lens: Vec<usize>) -> Result<Self> {
        if sequences.is_empty() || sequences.len() != prompt_lens.len() {
            return Err(TrainError::Length {
                what: "response batch prompt lengths (one per sequence, at least one)".into(),
                got: prompt_lens.len(),
                expected: sequences.len(),
            });
        }
        for (i, (s, &p)) in sequences.iter().zip(&prompt_lens).enumerate() {
            if p == 0 || p >= s.len() {
                return Err(TrainError::PromptLength {
                    sequence: i,
                    prompt_len: p,
                    len: s.len(),
                });
            }
        }
        Ok(Self {
            sequences,
            prompt_lens,
        })
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// Whether there are no sequences (never true for a constructed batch).
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// The full sequences.
    pub fn sequences(&self) -> &[Vec<u32>] {
        &self.sequences
    }

    /// Prompt length of each sequence.
    pub fn prompt_lens(&self) -> &[usize] {
        &self.prompt_lens
    }

    /// Predicted positions per row: `T − 1` for the longest sequence `T`.
    pub fn width(&self) -> usize {
        self.sequences.iter().map(Vec::len).max().unwrap_or(1) - 1
    }

    /// Number of response tokens of sequence `i`.
    pub fn response_len(&self, i: usize) -> usize {
        self.sequences[i].len() - self.prompt_lens[i]
    }

    /// Column of the prediction of response token `j` of any row (`prompt_len − 1 + j`).
    fn first_column(&self, i: usize) -> usize {
        self.prompt_lens[i] - 1
    }

    /// `[B, T−1]` f32 with `row_weight[b]` on response positions and 0 elsewhere.
    pub fn response_mask(&self, row_weight: Option<&[f32]>, device: &Device) -> Result<Tensor> {
        let w = self.width();
        let mut mask = vec![0f32; self.len() * w];
        for i in 0..self.len() {
            let value = row_weight.map_or(1.0, |r| r[i]);
            let from = i * w + self.first_column(i);
            mask[from..from + self.response_len(i)].fill(value);
        }
        Ok(Tensor::from_vec(mask, (self.len(), w), device)?)
    }

    /// `[B, T−1]` f32 holding `per_response[b][j]` at the column of response token `j`.
    pub fn align(&self, per_response: &[Vec<f32>], device: &Device) -> Result<Tensor> {
        let w = self.width();
        let mut out = vec![0f32; self.len() * w];
        for (i, values) in per_response.iter().enumerate() {
            if values.len() != self.response_len(i) {
                return Err(TrainError::Length {
                    what: format!("sequence {i}: per-token values (one per response token)"),
                    got: values.len(),
                    expected: self.response_len(i),
                });
            }
            let from = i * w + self.first_column(i);
            out[from..from + values.len()].copy_from_slice(values);
        }
        Ok(Tensor::from_vec(out, (self.len(), w), device)?)
    }

    /// Per-sequence response values read back from a `[B, T−1]` tensor.
    pub fn gather_responses(&self, x: &Tensor) -> Result<Vec<Vec<f32>>> {
        let rows = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        Ok((0..self.len())
            .map(|i| {
                let from = self.first_column(i);
                rows[i][from..from + self.response_len(i)].to_vec()
            })
            .collect())
    }

    /// The rows `rows` as a new batch.
    pub fn subset(&self, rows: &[usize]) -> Result<ResponseBatch> {
        let pick = |i: usize| {
            self.sequences
                .get(i)
                .cloned()
                .ok_or(TrainError::RowOutOfRange {
                    row: i,
                    len: self.len(),
                })
        };
        let sequences = rows.iter().map(|&i| pick(i)).collect::<Result<Vec<_>>>()?;
        let prompt_lens = rows.iter().map(|&i| self.prompt_lens[i]).collect();
        ResponseBatch::new(sequences, prompt_lens)
    }
}

/// What scoring a batch returns.
#[derive(Debug)]
pub struct Scored {
    /// `[B, T−1]` log-prob of each next token: each row's response predictions (columns
    /// `prompt_len − 1 .. len − 1`), 0 elsewhere.
    pub logp: Tensor,
    /// `[P, vocab]` logits of the response predictions, row after row (`spans`), divided by
    /// the scoring's temperature ([`ScoreOptions::temperature`]; the head's own at 1): the
    /// logits of the distribution `logp` and the entropy are taken from. The head runs over
    /// no prompt or padding position, whose predictions no loss reads. None where the head
    /// was scored in chunks without keeping them ([`ScoreOptions::head_chunk_tokens`]).
    pub logits: Option<Tensor>,
    /// Per row, the predicting positions the head covers: `prompt_len − 1 .. len − 1`.
    pub spans: Vec<Range<usize>>,
    /// `Record`: the routes the forward chose, one table per sequence (`len − 1` rows: the
    /// positions it fed, as a rollout's tables).
    pub routes: Option<Vec<RouteTable>>,
    /// `Replay`: the proof of what was replayed.
    pub replay: Option<ReplayProof>,
    /// Per row, what of it another row's computation stood for (`share_prefixes`; all 0
    /// unshared).
    pub shared_lens: Vec<SharedLen>,
    /// `[P]` entropies of the head rows where the head was scored in chunks, and whether
    /// their gradient was asked for.
    chunked_entropy: Option<(Tensor, bool)>,
}

impl Scored {
    /// Mean entropy of the next-token distribution over `mask` (detached).
    pub fn mean_entropy(&self, mask: &Tensor) -> Result<f32> {
        scalar_f32(&masked_mean(&self.entropy(false)?, mask)?)
    }

    /// `[B, T−1]` entropy of the next-token distribution at each row's response predictions
    /// (0 elsewhere, where the head did not run); `differentiable` keeps its graph to the
    /// logits (an entropy bonus), else detached. A chunked scoring gives a differentiable
    /// entropy only where it was asked for one ([`ScoreOptions::entropy_grad`]).
    pub fn entropy(&self, differentiable: bool) -> Result<Tensor> {
        let rows = match (&self.logits, &self.chunked_entropy) {
            (Some(logits), _) => match differentiable {
                true => entropy(logits)?,
                false => entropy(&logits.detach())?,
            },
            (None, Some((rows, with_grad))) => match (differentiable, with_grad) {
                (false, _) => rows.detach(),
                (true, true) => rows.clone(),
                (true, false) => {
                    return Err(TrainError::InvalidConfig {
                        field: "algo.head_chunk_tokens",
                        reason: "a differentiable entropy of a chunked scoring that was not \
                                 asked for its gradient (ScoreOptions::entropy_grad)"
                            .into(),
                    })
                }
            },
            (None, None) => {
                return Err(TrainError::InvalidConfig {
                    field: "algo.head_chunk_tokens",
                    reason: "a scoring with neither logits nor entropies".into(),
                })
            }
        };
        let width = self.logp.dim(1)?;
        Ok(spread_over_spans(&rows, &self.spans, width)?)
    }
}

/// How [`score_with`] scores a batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreOptions {
    /// By a recomputing forward (activation checkpointing), whose layers then give the
    /// gradients ([`LayerRecompute::backward`]).
    pub recompute: bool,
    /// Computing the positions the sequences hold alike once ([`Batch::sharing_prefixes`]).
    pub share_prefixes: bool,
    /// Scoring the head this many response tokens at a time without keeping the logits
    /// ([`Model::forward_scores`]); 0: the logits kept whole.
    pub head_chunk_tokens: usize,
    /// With `head_chunk_tokens`, whether the entropy takes part in the loss (an entropy
    /// bonus): its gradient is then computed in the backward.
    pub entropy_grad: bool,
    /// The temperature `T` the policy is scored at: the log-probs and entropies are those
    /// of `softmax(logits / T)`, the distribution a rollout at `rollout.temperature = T`
    /// samples from and its engine reports log-probs under (verl and slime score the policy
    /// the same way). 1 (the default): the raw logits, bit for bit. Finite and at least
    /// [`r3_rollout::sampler::GREEDY_TEMPERATURE`] (below it the engines sample greedily
    /// and report raw log-probs).
    pub temperature: f32,
}

impl Default for ScoreOptions {
    /// The whole logits at temperature 1, no recomputation, no sharing.
    fn default() -> Self {
        Self {
            recompute: false,
            share_prefixes: false,
            head_chunk_tokens: 0,
            entropy_grad: false,
            temperature: 1.0,
        }
    }
}

impl ScoreOptions {
    /// `1 / temperature` in f32, the factor the rollout samplers compute (they scale
    /// `z − max` where the trainer scales `z`, so the log-probs agree within rounding, not bit
    /// for bit); a temperature that is not a finite number above 0, or one below
    /// [`r3_rollout::sampler::GREEDY_TEMPERATURE`] (where the engines sample greedily and
    /// report raw log-probs), is refused.
    pub fn inv_temperature(&self) -> Result<f32> {
        let t = self.temperature;
        let inv = 1.0 / t;
        if !(t.is_finite() && t > 0.0 && inv.is_finite()) {
            return Err(TrainError::InvalidConfig {
                field: "rollout.temperature",
                reason: format!("the policy is scored at temperature {t}: must be > 0"),
            });
        }
        refuse_greedy_band("rollout.temperature", f64::from(t))?;
        Ok(inv)
    }
}

/// The most values a logits tensor that one of candle's elementwise ops runs over may hold on
/// a GPU: the sum of the log-prob's and the entropy's gradients (an entropy bonus), and the
/// temperature's scaling, forward and backward (candle's affine op). candle's elementwise
/// CUDA kernels step a 32-bit index by the grid's size, about the element count, so past
/// 2^31 values a thread's index wraps around 2^32 and it runs its loop again from lower down
/// (tens of thousands of passes near 2^32, none ending just below it). r3's own kernels and
/// cuBLAS, which every other pass over the logits runs on, index in 64 bits.
const MAX_SUMMED_LOGITS_VALUES: usize = 1 << 31;

/// Refuses, by the setting that lowers it, a scoring whose logits candle's elementwise
/// kernels would run over past [`MAX_SUMMED_LOGITS_VALUES`] values: on a GPU, with the
/// entropy's gradient asked for (`algo.entropy_coef` ≠ 0) or at a temperature other than 1
/// (`rollout.temperature`), `rows` response tokens scored at once (or
/// `algo.head_chunk_tokens` at a time) times `vocab` columns; `on_gpu`: the model's device
/// is a CUDA GPU.
fn check_logits_gradients_fit(
    rows: usize,
    vocab: usize,
    options: ScoreOptions,
    on_gpu: bool,
) -> Result<()> {
    let at_once = match options.head_chunk_tokens {
        0 => rows,
        chunk => chunk.min(rows),
    };
    let elementwise = options.entropy_grad || options.temperature != 1.0;
    if !(elementwise && on_gpu) || at_once.saturating_mul(vocab) <= MAX_SUMMED_LOGITS_VALUES {
        return Ok(());
    }
    Err(TrainError::InvalidConfig {
        field: "algo.head_chunk_tokens",
        reason: format!(
            "{at_once} response tokens scored at once × a vocabulary of {vocab} is {} logits, \
             past the {MAX_SUMMED_LOGITS_VALUES} candle's CUDA kernels can run over (summing \
             the log-prob and entropy gradients, scaling by a temperature); score the head at \
             most {} tokens at a time (or set algo.entropy_coef = 0 and \
             rollout.temperature = 1)",
            at_once.saturating_mul(vocab),
            MAX_SUMMED_LOGITS_VALUES / vocab.max(1)
        ),
    })
}

/// Runs the training forward over `batch` with `routing` and takes the log-prob of every
/// next token (at temperature 1).
pub fn score(model: &Model, batch: &ResponseBatch, routing: Routing<'_>) -> Result<Scored> {
    Ok(score_with(model, batch, routing, ScoreOptions::default())?.0)
}

/// [`score`] as `options` say (at their temperature: the log-probs and entropies of
/// `softmax(logits / T)`); with `recompute`, the layers that give the gradients of a loss of
/// the returned log-probs ([`LayerRecompute::backward`]).
pub fn score_with<'m>(
    model: &'m Model,
    batch: &ResponseBatch,
    routing: Routing<'_>,
    options: ScoreOptions,
) -> Result<(Scored, Option<LayerRecompute<'m>>)> {
    // Each sequence is fed without its last token, which only a position past it would
    // read: the last position predicts nothing any loss reads, so computing it (as a forward
    // of whole sequences does) was `1/len` of every layer's work for nothing, and the
    // positions fed are then the rollout's (`len − 1` route rows), so a replay forces every
    // row and leaves none to the router. The tokens predicted come from the whole sequences.
    let fed: Vec<Vec<u32>> = batch
        .sequences()
        .iter()
        .map(|s| s[..s.len() - 1].to_vec())
        .collect();
    let padded = Batch::new(&fed, 0, model.device())?.sharing_prefixes(options.share_prefixes);
    // Each row's response predictions (`ResponseBatch::new` keeps every prompt and
    // response non-empty): the head runs there only.
    let spans: Vec<Range<usize>> = batch
        .sequences()
        .iter()
        .zip(batch.prompt_lens())
        .map(|(s, &p)| p - 1..s.len() - 1)
        .collect();
    let head = HeadPositions::Spans(spans.clone());
    // The tokens they predict, on the host, where their range is checked (a device read
    // per forward otherwise).
    let host_targets: Vec<u32> = batch
        .sequences()
        .iter()
        .zip(&spans)
        .flat_map(|(s, span)| s[span.start + 1..=span.end].iter().copied())
        .collect();
    let width = batch.width();
    let inv_temperature = options.inv_temperature()?;
    check_logits_gradients_fit(
        host_targets.len(),
        model.config().vocab_size,
        options,
        model.device().is_cuda(),
    )?;
    let (logp, logits, chunked_entropy, out, layers) = match options.head_chunk_tokens {
        0 => {
            let (out, layers) = match options.recompute {
                true => {
                    let (out, layers) = model.forward_recomputing(&padded, routing, head)?;
                    (out, Some(layers))
                }
                false => (model.forward_head(&padded, routing, head)?, None),
            };
            let targets = Tensor::from_slice(&host_targets, host_targets.len(), model.device())?;
            // The one scaling the chunked head takes too (`ScoreTargets::inv_temperature`):
            // the log-probs, the entropy `Scored::entropy` takes from these logits and their
            // gradients are the tempered policy's.
            let logits = scale_logits(&out.logits, inv_temperature)?;
            let logp = token_log_probs_host_checked(&logits, &targets, &host_targets)?;
            (logp, Some(logits), None, out, layers)
        }
        chunk_rows => {
            let targets = ScoreTargets {
                targets: host_targets,
                chunk_rows,
                entropy_grad: options.entropy_grad,
                inv_temperature,
            };
            let (out, layers) =
                model.forward_scores(&padded, routing, head, &targets, options.recompute)?;
            let logp = out.logits.narrow(1, 0, 1)?.squeeze(1)?;
            let entropy = out.logits.narrow(1, 1, 1)?.squeeze(1)?;
            (
                logp,
                None,
                Some((entropy, options.entropy_grad)),
                out,
                layers,
            )
        }
    };
    let scored = Scored {
        logp: spread_over_spans(&logp, &spans, width)?,
        logits,
        spans,
        routes: out.routes,
        replay: out.replay,
        shared_lens: out.shared_lens,
        chunked_entropy,
    };
    Ok((scored, layers))
}

/// Trainable weights: every trainable tensor is a `Var` registered under its HF name.
#[derive(Debug)]
pub struct TrainablePolicy {
    cfg: Config,
    vars: Vec<(String, Var)>,
    weights: Weights,
    precision: Precision,
    /// How many scores one attention product of its models' forwards may hold.
    score_tiles: ScoreTiles,
}

impl TrainablePolicy {
    /// Wraps loaded f32 weights, making the trainable ones variables.
    pub fn new(cfg: Config, weights: Weights) -> Result<Self> {
        let (varmap, weights) = weights.into_trainable(&cfg)?;
        let mut vars: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| TrainError::LockPoisoned)?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Self {
            cfg,
            vars,
            weights,
            precision: Precision::F32,
            score_tiles: ScoreTiles::WHOLE,
        })
    }

    /// Loads `config.json` + safetensors from an HF model directory (f32, CPU).
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_on(dir, &Device::Cpu)
    }

    /// Loads an HF model directory (f32) onto `device`: the variables, their gradients and
    /// the optimiser's moments all live there.
    pub fn load_on(dir: &Path, device: &Device) -> Result<Self> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let weights = Weights::load(dir, &cfg, device)?;
        Self::new(cfg, weights)
    }

    /// Loads an HF model directory onto `device` to train at `precision`, the weight
    /// matrices held as `masters` says. With [`MasterWeights::Bf16`] (a bf16 precision only)
    /// the embedding and every matrix the forward rounds to bf16 are bf16 variables with no
    /// f32 copy (`Weights::narrow_for_training`: the projections, experts and head, and the
    /// router unless it runs in f32): the values the forward reads, bit for bit, in half the
    /// memory.
    pub fn load_for_training(
        dir: &Path,
        device: &Device,
        precision: Precision,
        masters: MasterWeights,
    ) -> Result<Self> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        // With bf16 masters the loader narrows each tensor as it reads it (no f32 copy of
        // the whole model on the device); `for_training` then finds nothing left to narrow.
        let options = LoadOptions {
            narrow_masters: narrow_masters(precision, masters)?,
            ..LoadOptions::default()
        };
        let weights = Weights::load_with(dir, &cfg, device, &options)?;
        Self::for_training(cfg, weights, precision, masters)
    }

    /// [`TrainablePolicy::load_for_training`] of f32 weights already in memory, on the
    /// device they live on (drawn there by a benchmark, say): trained at `precision`, the
    /// matrices held as `masters` says.
    pub fn for_training(
        cfg: Config,
        mut weights: Weights,
        precision: Precision,
        masters: MasterWeights,
    ) -> Result<Self> {
        if let Some(held) = narrow_masters(precision, masters)? {
            weights = weights.narrow_for_training(&cfg, held.dtype, held.router)?;
        }
        let mut policy = Self::new(cfg, weights)?;
        policy.set_precision(precision);
        Ok(policy)
    }

    /// The device the variables live on.
    pub fn device(&self) -> Device {
        self.vars
            .first()
            .map_or(Device::Cpu, |(_, v)| v.as_tensor().device().clone())
    }

    /// The model config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The variables, sorted by name (for the optimiser).
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Sets the forward precision of the models handed out (the variables keep their dtypes:
    /// f32 master weights, or matrices held in bf16 by [`TrainablePolicy::load_for_training`]).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Bounds the scores one attention product of the models handed out from now on holds
    /// (`algo.attention_tile_mib`; [`Model::set_score_tiles`]).
    pub fn set_score_tiles(&mut self, tiles: ScoreTiles) {
        self.score_tiles = tiles;
    }

    /// The forward precision of the models handed out.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// A model whose forward is differentiable in every variable.
    pub fn model(&self) -> Result<Model> {
        let mut model = Model::with_precision(&self.cfg, &self.weights, self.precision)?;
        model.set_score_tiles(self.score_tiles);
        Ok(model)
    }

    /// A model over detached views of the current values (no autograd graph is built).
    pub fn frozen_model(&self) -> Result<Model> {
        let mut model = Model::with_precision(&self.cfg, &self.detached(), self.precision)?;
        model.set_score_tiles(self.score_tiles);
        Ok(model)
    }

    /// Holds a 16-bit copy (the precision's: bf16 or f16) of every weight matrix beside its
    /// f32 variable (`Weights::hold_narrow_copies`), read by the models handed out from now
    /// on instead of a cast of the weight at every matmul. Returns the copies for the
    /// optimiser, which must rewrite them after each update (`AdamW::hold_narrow_copies`):
    /// until it holds them, do not update the variables. An f32 precision has nothing to
    /// copy and is refused, and so is a second call (the copies the optimiser holds would no
    /// longer be the ones read).
    pub fn hold_narrow_copies(&mut self) -> Result<Vec<(String, Var)>> {
        if self.holds_narrow_copies() {
            return Err(TrainError::InvalidConfig {
                field: "train.narrow_weight_copies",
                reason: "the policy holds 16-bit weight copies already".into(),
            });
        }
        let narrow = self
            .precision
            .narrow_dtype()
            .ok_or_else(|| TrainError::InvalidConfig {
                field: "train.narrow_weight_copies",
                reason: "16-bit weight copies need train.dtype = bf16 or f16".into(),
            })?;
        Ok(self.weights.hold_narrow_copies(&self.cfg, narrow)?)
    }

    /// Whether 16-bit copies of the weights are held ([`TrainablePolicy::hold_narrow_copies`]).
    pub fn holds_narrow_copies(&self) -> bool {
        !self.weights.narrow_copies().is_empty()
    }

    /// Current values, detached, under HF names (routed experts fused, as trained), with the
    /// held 16-bit copies where there are some (detached views: no copy).
    pub fn detached(&self) -> Weights {
        self.weights.detached()
    }

    /// Current values as the name→tensor map the rollout engine loads: HF names with the
    /// routed experts fused, as trained (the engine packs them directly; detached views, no
    /// copy on the CPU).
    pub fn tensor_map(&self) -> Result<r3_rollout::TensorMap> {
        // The rollout engine runs on the CPU: a GPU policy's weights cross once per sync (on
        // the CPU `to_device` is the same tensor, no copy).
        self.detached()
            .into_map()
            .into_iter()
            .map(|(name, t)| Ok((name, t.to_device(&Device::Cpu)?)))
            .collect()
    }

    /// Current values as the name→tensor map, left on the device the variables live on
    /// (detached views, no copy): for the device rollout engine, which copies what it keeps
    /// onto its own device, so a GPU policy's weights reach a GPU engine without crossing the
    /// host.
    pub fn device_tensor_map(&self) -> r3_rollout::TensorMap {
        self.detached().into_map()
    }

    /// Current value of the non-trainable buffer `name` (e.g. DeepSeek's
    /// `e_score_correction_bias`) as f32 values.
    pub fn buffer(&self, name: &str) -> Result<Vec<f32>> {
        self.check_buffer(name)?;
        Ok(self
            .weights
            .get(name)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?)
    }

    /// Replaces the non-trainable buffer `name` by `values` (same length); later
    /// [`TrainablePolicy::model`]s see the new values.
    pub fn set_buffer(&mut self, name: &str, values: Vec<f32>) -> Result<()> {
        self.check_buffer(name)?;
        let old = self.weights.get(name)?;
        if old.elem_count() != values.len() {
            return Err(TrainError::Length {
                what: format!("buffer {name}"),
                got: values.len(),
                expected: old.elem_count(),
            });
        }
        let new = Tensor::from_vec(values, old.shape(), old.device())?.to_dtype(old.dtype())?;
        // A buffer has no copy; the matrices' held copies stay (the optimiser rewrites them).
        let copies = self.weights.narrow_copies().clone();
        self.weights = Weights::from_map(
            self.weights
                .tensors()
                .iter()
                .map(|(k, t)| (k.clone(), if k == name { new.clone() } else { t.clone() }))
                .collect(),
        )
        .with_narrow_copies(copies)?;
        Ok(())
    }

    /// Errors unless `name` is a tensor of the model that is not a trainable variable.
    fn check_buffer(&self, name: &str) -> Result<()> {
        if self.vars.iter().any(|(n, _)| n == name) {
            return Err(TrainError::InvalidConfig {
                field: "buffer",
                reason: format!("{name} is a trainable variable, not a buffer"),
            });
        }
        Ok(())
    }

    /// Writes `config.json` + `model.safetensors` into `dir`.
    pub fn save_hf(&self, dir: &Path) -> Result<()> {
        Ok(self.detached().save(dir, &self.cfg)?)
    }
}

/// The weights held without f32 masters that `masters` asks of a forward at `precision`:
/// with [`MasterWeights::Bf16`] (a bf16 forward only, else the config is refused) the
/// matrices in bf16, the routers' gates too where the router runs in bf16.
fn narrow_masters(precision: Precision, masters: MasterWeights) -> Result<Option<NarrowMasters>> {
    if masters != MasterWeights::Bf16 {
        return Ok(None);
    }
    let dtype = precision
        .narrow_dtype()
        .filter(|d| *d == DType::BF16)
        .ok_or_else(|| TrainError::InvalidConfig {
            field: "train.master_weights",
            reason: format!("bf16 master weights need a bf16 forward, not {precision:?}"),
        })?;
    Ok(Some(NarrowMasters {
        dtype,
        router: precision.router().narrow_dtype().is_some(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU with the entropy's gradient, logits past 2^31 values scored at once are
    /// refused naming `algo.head_chunk_tokens` and the most tokens that fit (at a Qwen
    /// vocabulary of 151,936: 14,134 × 151,936 = 2,147,463,424 fit, 14,135 × 151,936 =
    /// 2,147,615,360 do not, by hand); chunks that fit, no entropy gradient, or the CPU pass.
    #[test]
    fn logits_gradients_past_32_bits_are_refused_on_a_gpu() {
        let vocab = 151_936;
        let with_entropy = ScoreOptions {
            entropy_grad: true,
            ..ScoreOptions::default()
        };
        let Err(e) = check_logits_gradients_fit(14_135, vocab, with_entropy, true) else {
            panic!("14,135 × 151,936 logits accepted");
        };
        let text = e.to_string();
        assert!(text.contains("algo.head_chunk_tokens"), "{text}");
        assert!(text.contains("at most 14134 tokens"), "{text}");
        assert!(text.contains("2147615360 logits"), "{text}");
        assert!(check_logits_gradients_fit(14_134, vocab, with_entropy, true).is_ok());
        let chunked = ScoreOptions {
            head_chunk_tokens: 4096,
            ..with_entropy
        };
        assert!(check_logits_gradients_fit(100_000, vocab, chunked, true).is_ok());
        let wide_chunks = ScoreOptions {
            head_chunk_tokens: 20_000,
            ..with_entropy
        };
        assert!(check_logits_gradients_fit(100_000, vocab, wide_chunks, true).is_err());
        assert!(check_logits_gradients_fit(15_000, vocab, wide_chunks, true).is_err());
        assert!(check_logits_gradients_fit(10_000, vocab, wide_chunks, true).is_ok());
        let no_entropy = ScoreOptions::default();
        assert!(check_logits_gradients_fit(100_000, vocab, no_entropy, true).is_ok());
        assert!(check_logits_gradients_fit(100_000, vocab, with_entropy, false).is_ok());
        // A temperature other than 1 scales the logits with candle's affine kernels: the
        // same bound with no entropy gradient, met by chunks.
        let tempered = ScoreOptions {
            temperature: 0.7,
            ..no_entropy
        };
        let Err(e) = check_logits_gradients_fit(14_135, vocab, tempered, true) else {
            panic!("14,135 × 151,936 tempered logits accepted");
        };
        assert!(e.to_string().contains("rollout.temperature = 1"), "{e}");
        assert!(check_logits_gradients_fit(14_134, vocab, tempered, true).is_ok());
        assert!(check_logits_gradients_fit(100_000, vocab, tempered, false).is_ok());
        let tempered_chunks = ScoreOptions {
            head_chunk_tokens: 4096,
            ..tempered
        };
        assert!(check_logits_gradients_fit(100_000, vocab, tempered_chunks, true).is_ok());
    }

    /// The inverse temperature is `1 / T` in f32 (the rollout samplers' factor); a
    /// temperature of 0, below 0, NaN, infinite or so small its inverse overflows is refused
    /// naming `rollout.temperature`.
    #[test]
    fn the_inverse_temperature_is_the_samplers() {
        let at = |temperature: f32| ScoreOptions {
            temperature,
            ..ScoreOptions::default()
        };
        assert_eq!(ScoreOptions::default().inv_temperature().ok(), Some(1.0));
        assert_eq!(at(0.7).inv_temperature().ok(), Some(1.0f32 / 0.7f32));
        assert_eq!(at(0.5).inv_temperature().ok(), Some(2.0));
        // The engines' greedy threshold itself is still a temperature.
        assert_eq!(at(1e-6).inv_temperature().ok(), Some(1.0f32 / 1e-6f32));
        // Below it (and 1 / T still finite) the engines sample greedily with raw log-probs.
        for t in [5e-7, 1e-7, 1e-30] {
            let Err(e) = at(t).inv_temperature() else {
                panic!("temperature {t} accepted");
            };
            assert!(e.to_string().contains("rollout.temperature"), "{e}");
            assert!(e.to_string().contains("greedily"), "{e}");
        }
        for t in [0.0, -0.5, f32::NAN, f32::INFINITY, 1e-40] {
            let Err(e) = at(t).inv_temperature() else {
                panic!("temperature {t} accepted");
            };
            assert!(e.to_string().contains("rollout.temperature"), "{e}");
        }
    }
}
