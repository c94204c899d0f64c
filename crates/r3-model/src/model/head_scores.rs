//! The vocabulary head's token log-probs and entropies without its logits kept: the final
//! norm, the head, the log-softmax and the entropy run a chunk of rows at a time, and the
//! backward runs each chunk again (the memory trade of a fused linear cross-entropy).
//!
//! A policy's scoring keeps `[P, vocab]` f32 logits from its forward to its backward and
//! builds their gradient, as large, in the backward: at a real vocabulary (151,936 columns)
//! and a micro-batch of 16,384 response tokens that is 10 GB each, more than the layers'
//! activations. Here the graph keeps the head's input rows (`[P, H]`) alone; a chunk's
//! logits live while that chunk is scored, in the forward and again in the backward. The
//! chunk runs the model's own norm and head (the same precision, held copies and weight
//! gradients), so each row's log-prob and entropy are the values the whole head gives it,
//! and the backward's gradients are the same ops' gradients, summed over the chunks. The
//! price is one more forward of the head.
//!
//! A rollout sampled at temperature `T` draws from `softmax(logits / T)`, and so does the
//! policy this scores ([`ScoreTargets::inv_temperature`], as verl and slime divide the
//! logits by the rollout temperature before the log-softmax and the entropy): each chunk's
//! logits are scaled before they are scored, inside the graph the backward differentiates,
//! so the rows' and weights' gradients carry the factor (`d/dz f(z·s) = s·f'(z·s)`).

use std::sync::Arc;

use candle_core::{CustomOp3, DType, Tensor, Var};

use super::head_positions::check_rows;
use crate::error::{ModelError, Result};
use crate::layers::linear::Linear;
use crate::layers::norm::RmsNorm;
use crate::layers::precomputed::{precomputed_fwd, Precomputed};
use crate::token_stats::{entropy, token_log_probs_host_checked};

/// What a scoring forward asks of the head: the token each head row is scored against, how
/// many rows a chunk holds, whether the entropies take part in the loss, and the
/// temperature the distribution is scored at.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreTargets {
    /// The target of each head row (the next token at each head position), in the head's row
    /// order.
    pub targets: Vec<u32>,
    /// Rows scored at a time (at least 1).
    pub chunk_rows: usize,
    /// Whether the entropy column is differentiated (an entropy bonus): without it the
    /// backward reads the log-probs' gradient alone and skips the entropy's pass.
    pub entropy_grad: bool,
    /// `1 / T`: the log-probs and entropies are those of `softmax(logits · inv_temperature)`,
    /// the distribution a rollout at temperature `T` samples from. 1 scores the raw logits,
    /// bit for bit as without the factor (no multiply runs); finite and above 0.
    pub inv_temperature: f32,
}

impl ScoreTargets {
    /// Refuses targets that are not one per head row of `rows` or lie outside a vocabulary
    /// of `vocab` (naming the row among all of them, not within its chunk), a chunk of no
    /// rows, or an inverse temperature that is not a finite number above 0.
    pub(crate) fn check(&self, rows: usize, vocab: usize) -> Result<()> {
        if self.chunk_rows == 0 {
            return Err(ModelError::Input("head scores: a chunk of 0 rows".into()));
        }
        check_inv_temperature(self.inv_temperature)?;
        check_rows("head scores: targets", self.targets.len(), rows)?;
        match self.targets.iter().position(|&t| t as usize >= vocab) {
            Some(row) => Err(ModelError::Input(format!(
                "head scores: target {} of head row {row} is outside the vocabulary of {vocab}",
                self.targets[row]
            ))),
            None => Ok(()),
        }
    }
}

/// Refuses an inverse temperature that is not a finite number above 0 (a temperature of 0,
/// greedy decoding, has no log-probs to score).
fn check_inv_temperature(inv_temperature: f32) -> Result<()> {
    match inv_temperature.is_finite() && inv_temperature > 0.0 {
        true => Ok(()),
        false => Err(ModelError::Input(format!(
            "head scores: inverse temperature {inv_temperature} is not a finite number above 0"
        ))),
    }
}

/// `logits · inv_temperature`, the logits of the distribution a rollout at temperature
/// `1 / inv_temperature` samples from (the rollout samplers multiply `z − max` by the same
/// f32 `1 / T`, so the log-probs agree within rounding, not bit for bit), differentiable in
/// `logits`; at 1 the logits themselves, no op run, so the
/// temperature-1 scoring keeps its bits and its graph. The one scaling both of a policy's
/// scoring paths take (this module's chunks and a scoring that keeps its logits whole), so
/// they agree. Device-agnostic (candle's affine op).
pub fn scale_logits(logits: &Tensor, inv_temperature: f32) -> Result<Tensor> {
    check_inv_temperature(inv_temperature)?;
    if inv_temperature == 1.0 {
        return Ok(logits.clone());
    }
    Ok(logits.affine(f64::from(inv_temperature), 0.0)?)
}

/// `[P, 2]`: per row of `rows` (`[P, H]`, the last layer's states at the head's positions),
/// the log-prob of its target under `head(norm(row)) · targets.inv_temperature` and the
/// entropy of that distribution,
/// computed `targets.chunk_rows` rows at a time; differentiable in `rows` and in the norm's
/// and head's weights, keeping `rows` alone for the backward.
pub(crate) fn head_scores(
    rows: &Tensor,
    norm: &RmsNorm,
    head: &Linear,
    targets: &ScoreTargets,
) -> Result<Tensor> {
    let p = rows.dim(0)?;
    targets.check(p, head.weight().dim(0)?)?;
    let rows = rows.contiguous()?;
    let op = HeadScores {
        norm: norm.clone(),
        head: head.clone(),
        targets: Arc::new(targets.clone()),
        value: Precomputed::empty(),
    };
    let value = op.scores(&rows.detach())?;
    if !rows.track_op() && !norm.weight().track_op() && !head.weight().track_op() {
        // Nothing to differentiate (inference): the value, without the op's copy of it.
        return Ok(value);
    }
    let op = HeadScores {
        value: Precomputed::new(value),
        ..op
    };
    Ok(rows.apply_op3(norm.weight(), head.weight(), op)?)
}

/// The op: the scores precomputed, its backward from the rows and the weights.
#[derive(Debug)]
struct HeadScores {
    norm: RmsNorm,
    head: Linear,
    targets: Arc<ScoreTargets>,
    value: Precomputed,
}

impl HeadScores {
    /// The chunks' row ranges.
    fn chunks(&self, p: usize) -> impl Iterator<Item = (usize, usize)> {
        let n = self.targets.chunk_rows;
        (0..p).step_by(n).map(move |s| (s, n.min(p - s)))
    }

    /// Log-probs `[n]` of the rows `x` (`[n, H]`) whose targets start at row `start`,
    /// through the model's norm and head (a graph to `x` and the weights where they carry
    /// one), and with `with_entropy` the entropies `[n]`.
    fn chunk(
        &self,
        x: &Tensor,
        start: usize,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let n = x.dim(0)?;
        let logits = self.head.forward(&self.norm.forward(x)?)?;
        // Scaled inside the chunk's graph: the backward, which runs the chunk again,
        // differentiates through the factor.
        let logits = scale_logits(&logits, self.targets.inv_temperature)?;
        let host = &self.targets.targets[start..start + n];
        let targets = Tensor::from_slice(host, n, x.device())?;
        let logp = token_log_probs_host_checked(&logits, &targets, host)?;
        let ent = match with_entropy {
            true => Some(entropy(&logits)?),
            false => None,
        };
        Ok((logp, ent))
    }

    /// The op's value from detached rows, chunk by chunk.
    fn scores(&self, rows: &Tensor) -> Result<Tensor> {
        let mut parts = Vec::new();
        for (start, n) in self.chunks(rows.dim(0)?) {
            let (logp, ent) = self.chunk(&rows.narrow(0, start, n)?, start, true)?;
            let ent = ent.ok_or_else(|| ModelError::Input("head scores: no entropy".into()))?;
            parts.push(Tensor::stack(&[logp.detach(), ent.detach()], 1)?);
        }
        if parts.is_empty() {
            return Ok(Tensor::zeros((0, 2), DType::F32, rows.device())?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The gradients of `Σ grad ⊙ scores` in the rows and both weights: each chunk's
    /// scores again, with their graph, differentiated alone; the weights' gradients summed
    /// over the chunks in f32 (a one-chunk gradient handed back as the ops gave it), a 16-bit
    /// weight's rounded to its dtype.
    fn grads(
        &self,
        rows: &Tensor,
        weights: [&Tensor; 2],
        grad: &Tensor,
    ) -> Result<(Tensor, [Option<Tensor>; 2])> {
        let mut row_grads = Vec::new();
        let mut sums: [Option<Tensor>; 2] = [None, None];
        let chunks: Vec<(usize, usize)> = self.chunks(rows.dim(0)?).collect();
        let single = chunks.len() == 1;
        for (start, n) in chunks {
            let x = Var::from_tensor(&rows.narrow(0, start, n)?.detach())?;
            let (logp, ent) = self.chunk(x.as_tensor(), start, self.targets.entropy_grad)?;
            let g = grad.narrow(0, start, n)?;
            let mut loss = (logp * g.narrow(1, 0, 1)?.squeeze(1)?)?.sum_all()?;
            if let Some(ent) = ent {
                loss = (loss + (ent * g.narrow(1, 1, 1)?.squeeze(1)?)?.sum_all()?)?;
            }
            let store = loss.backward()?;
            row_grads.push(match store.get(x.as_tensor()) {
                Some(d) => d.to_dtype(rows.dtype())?,
                None => x.as_tensor().zeros_like()?,
            });
            for (sum, w) in sums.iter_mut().zip(weights) {
                let Some(d) = store.get(w) else { continue };
                *sum = Some(match (sum.take(), single) {
                    (None, true) => d.clone(),
                    (None, false) => d.to_dtype(DType::F32)?,
                    (Some(s), _) => (s + d.to_dtype(DType::F32)?)?,
                });
            }
        }
        let d_rows = match row_grads.is_empty() {
            true => rows.zeros_like()?,
            false => Tensor::cat(&row_grads, 0)?,
        };
        // A weight held in 16 bits (a trainer's bf16 weights, `Weights::narrow_for_training`)
        // takes its gradient in its own dtype: the chunks' f32 sum rounded once.
        let [norm_sum, head_sum] = sums;
        let in_weight_dtype = |sum: Option<Tensor>, w: &Tensor| -> Result<Option<Tensor>> {
            Ok(match sum {
                Some(d) if w.dtype() != DType::F32 && d.dtype() != w.dtype() => {
                    Some(d.to_dtype(w.dtype())?)
                }
                other => other,
            })
        };
        let sums = [
            in_weight_dtype(norm_sum, weights[0])?,
            in_weight_dtype(head_sum, weights[1])?,
        ];
        Ok((d_rows, sums))
    }
}

impl CustomOp3 for HeadScores {
    fn name(&self) -> &'static str {
        "head-scores"
    }

    precomputed_fwd!(3);

    fn bwd(
        &self,
        rows: &Tensor,
        norm_weight: &Tensor,
        head_weight: &Tensor,
        _scores: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (d_rows, [d_norm, d_head]) = self
            .grads(rows, [norm_weight, head_weight], &grad.contiguous()?)
            .map_err(candle_core::Error::wrap)?;
        Ok((Some(d_rows), d_norm, d_head))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn targets_are_one_per_head_row_in_chunks_of_some_rows() {
        let targets = |n: usize, chunk_rows: usize| ScoreTargets {
            targets: vec![3; n],
            chunk_rows,
            entropy_grad: false,
            inv_temperature: 1.0,
        };
        assert!(targets(4, 2).check(4, 8).is_ok());
        let err = targets(3, 2).check(4, 8).expect_err("one target short");
        assert!(
            err.to_string().contains("targets: 3 for 4 head rows"),
            "{err}"
        );
        let err = targets(4, 0).check(4, 8).expect_err("empty chunks");
        assert!(err.to_string().contains("a chunk of 0 rows"), "{err}");
        let mut past = targets(5, 2);
        past.targets[3] = 8;
        let err = past.check(5, 8).expect_err("a target past the vocabulary");
        assert!(
            err.to_string()
                .contains("target 8 of head row 3 is outside the vocabulary of 8"),
            "{err}"
        );
        for inv in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let tempered = ScoreTargets {
                inv_temperature: inv,
                ..targets(4, 2)
            };
            let err = tempered
                .check(4, 8)
                .expect_err("no temperature to score at");
            assert!(err.to_string().contains("inverse temperature"), "{err}");
        }
    }

    /// The scaling multiplies every logit by the inverse temperature (0.5 and 3 against
    /// the products by hand), keeps the logits as they are at 1 (the same tensor: no op in
    /// the graph), and refuses a factor of 0.
    #[test]
    fn logits_are_scaled_by_the_inverse_temperature() {
        let logits =
            Tensor::new(&[[1.5f32, -2.0, 0.25], [3.0, 0.0, -0.75]], &Device::Cpu).expect("logits");
        let scaled = |inv: f32| -> Vec<Vec<f32>> {
            scale_logits(&logits, inv)
                .and_then(|t| Ok(t.to_vec2::<f32>()?))
                .expect("scaled")
        };
        assert_eq!(scaled(0.5), [[0.75, -1.0, 0.125], [1.5, 0.0, -0.375]]);
        assert_eq!(scaled(3.0), [[4.5, -6.0, 0.75], [9.0, 0.0, -2.25]]);
        let same = scale_logits(&logits, 1.0).expect("at 1");
        assert_eq!(same.id(), logits.id());
        assert!(scale_logits(&logits, 0.0).is_err());
    }
}
