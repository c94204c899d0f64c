//! Micro-batches of a mini-batch, for bounded memory: rows packed by a token budget (a
//! forward pads every row to the longest, so a micro-batch costs rows × its widest row),
//! gradients summed over the micro-batches, and what each micro-batch's forward returned
//! (log-probs, recorded routes, replay proofs) put back in the mini-batch's row order.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, TensorId, Var};
use r3_model::model::LayerRecompute;
use r3_model::narrow_grads::{in_dtype_of, keep_narrow};
use r3_model::stochastic_round::{sum_round_bf16_stochastic, sum_rounding_key};
use r3_model::ReplayProof;
use r3_routing::RouteTable;

use crate::error::{Result, TrainError};
use crate::policy::trainable::ResponseBatch;

/// The rows `0..lens.len()` of a mini-batch (sequence `i` has `lens[i]` tokens, prompt +
/// response) grouped into micro-batches whose forward holds at most `budget` tokens
/// (rows × the longest row's length). `budget` 0, or a mini-batch within it, gives one
/// micro-batch in the original order. Otherwise the rows are sorted by length (ties by
/// row) so each micro-batch pads little, and filled greedily; a single row longer than the
/// budget forms its own micro-batch. Deterministic: no randomness, the same lengths give
/// the same packing.
pub fn pack_micro_batches(lens: &[usize], budget: usize) -> Vec<Vec<usize>> {
    let widest = lens.iter().copied().max().unwrap_or(0);
    if lens.is_empty() || budget == 0 || lens.len().saturating_mul(widest) <= budget {
        return vec![(0..lens.len()).collect()];
    }
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&r| (lens[r], r));
    let mut parts: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    for r in order {
        // Rows come shortest first, so row `r` sets the padded width of `current`.
        if !current.is_empty() && (current.len() + 1).saturating_mul(lens[r]) > budget {
            parts.push(std::mem::take(&mut current));
        }
        current.push(r);
    }
    parts.push(current);
    parts
}

/// The micro-batches of `sequences` within `budget` tokens: with `share_prefixes`, in token
/// order ([`pack_micro_batches_by_prefix`]), so that the sequences a forward can share
/// positions between land together; otherwise shortest first ([`pack_micro_batches`]).
pub fn pack_rows(sequences: &[Vec<u32>], budget: usize, share_prefixes: bool) -> Vec<Vec<usize>> {
    match share_prefixes {
        true => pack_micro_batches_by_prefix(sequences, budget),
        false => pack_micro_batches(&sequences.iter().map(Vec::len).collect::<Vec<_>>(), budget),
    }
}

/// [`pack_micro_batches`] for forwards that share prefixes: the rows sorted by their tokens
/// (ties by row), so that sequences beginning alike (a GRPO group's samples, whose prompt a
/// forward then computes once) are neighbours, and filled greedily while rows × the
/// longest row stays within `budget`. `budget` 0, or a batch within it, gives one
/// micro-batch in the original order; a row longer than the budget forms its own.
/// Deterministic, as [`pack_micro_batches`].
pub fn pack_micro_batches_by_prefix(sequences: &[Vec<u32>], budget: usize) -> Vec<Vec<usize>> {
    let widest = sequences.iter().map(Vec::len).max().unwrap_or(0);
    if sequences.is_empty() || budget == 0 || sequences.len().saturating_mul(widest) <= budget {
        return vec![(0..sequences.len()).collect()];
    }
    let mut order: Vec<usize> = (0..sequences.len()).collect();
    order.sort_by(|&a, &b| sequences[a].cmp(&sequences[b]).then(a.cmp(&b)));
    let mut parts: Vec<Vec<usize>> = Vec::new();
    let (mut current, mut width): (Vec<usize>, usize) = (Vec::new(), 0);
    for r in order {
        let wider = width.max(sequences[r].len());
        if !current.is_empty() && (current.len() + 1).saturating_mul(wider) > budget {
            parts.push(std::mem::take(&mut current));
            width = 0;
        }
        width = width.max(sequences[r].len());
        current.push(r);
    }
    parts.push(current);
    parts
}

/// Sequence lengths (prompt + response) of `batch`'s rows: what
/// [`pack_micro_batches`] packs.
pub fn sequence_lens(batch: &ResponseBatch) -> Vec<usize> {
    batch.sequences().iter().map(Vec::len).collect()
}

/// How the sums over micro-batches of a bf16 variable's gradient are held
/// (`train.grad_accum_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradientSums {
    /// In f32: each sum exact to f32 rounding, 4 bytes a parameter.
    F32,
    /// In bf16, as one micro-batch's gradient is: each sum computed in f32 and rounded to
    /// bf16 stochastically (`r3_model::stochastic_round::sum_round_bf16_stochastic`), by the
    /// draws of the run's `seed`, the optimiser `step` the sums are for, the sum's `micro`
    /// (1 for the second micro-batch's, counting on) and the variable's place.
    Bf16 {
        /// The run's seed (`AdamW::rounding_seed`).
        seed: u64,
        /// The optimiser step these gradients are for.
        step: u64,
        /// Which sum of the update this is: 1 adds the second micro-batch's gradients.
        micro: u64,
    },
}

/// Adds the gradients of `next` to `acc` for every variable of `vars`: a variable with a
/// gradient in either store ends with the sum of both (one missing in `acc` takes
/// `next`'s), so no micro-batch's gradient is lost. The sums are detached: a variable's
/// gradient from candle's backward still records the op that made it, whose inputs are
/// the forward's activations, so keeping it as it is would keep that micro-batch's whole
/// graph alive until the step (measured: memory then grew with the batch, not the budget).
/// A gradient kept in 16 bits (`r3_model::narrow_grads`) stays so while it is alone; sums
/// are in f32 for a 16-bit variable (the dtype its update is computed in) and in the
/// variable's dtype otherwise, except that with [`GradientSums::Bf16`] a bf16 variable's
/// sum is rounded back to bf16 stochastically (the draws of the variable's place in `vars`).
pub fn accumulate_grads<'v>(
    acc: &mut GradStore,
    next: &GradStore,
    vars: impl IntoIterator<Item = &'v Var>,
    sums: GradientSums,
) -> Result<()> {
    for (place, var) in vars.into_iter().enumerate() {
        if let Some(g) = next.get(var.as_tensor()) {
            add_gradient(acc, var.as_tensor(), place, g, sums)?;
        }
    }
    Ok(())
}

/// Adds `g`, a gradient of `var` (the variable at `place` among the optimiser's), to its sum
/// in `acc` as [`accumulate_grads`] does.
fn add_gradient(
    acc: &mut GradStore,
    var: &Tensor,
    place: usize,
    g: &Tensor,
    sums: GradientSums,
) -> Result<()> {
    let sum = match (acc.get(var), sums) {
        (Some(a), GradientSums::Bf16 { seed, step, micro })
            if var.dtype() == candle_core::DType::BF16 =>
        {
            let key = sum_rounding_key(seed, step, micro, place as u64);
            sum_round_bf16_stochastic(a, g, key)?
        }
        (Some(a), _) => in_dtype_of(a, var)?.add(&in_dtype_of(g, var)?)?.detach(),
        (None, _) => g.detach().contiguous()?,
    };
    acc.insert(var, sum);
    Ok(())
}

/// Each of `vars` by its tensor's id: its place among them (which draws its bf16 sums take)
/// and its tensor.
fn var_places<'v>(vars: impl IntoIterator<Item = &'v Var>) -> HashMap<TensorId, (usize, Tensor)> {
    vars.into_iter()
        .enumerate()
        .map(|(place, var)| (var.as_tensor().id(), (place, var.as_tensor().clone())))
        .collect()
}

/// `loss`'s backward with each gradient of `vars` added to its sum in `acc` (as
/// [`accumulate_grads`] adds a whole store) the moment the backward completes it, and then
/// dropped (through candle's `Tensor::backward_with`): an update of several micro-batches
/// never holds a second store of gradients beside its sums, which at the end of each
/// backward held as many bytes again as the sums (2 or 4 a parameter). With `narrow` (bf16 or
/// f16, `train.narrow_gradients`) each gradient is first kept narrow where that holds it
/// exactly, as [`r3_model::narrow_grads::backward_narrowing`] keeps it. Gradients of other
/// tensors are dropped with the backward's own store.
pub fn backward_into<'v>(
    loss: &Tensor,
    acc: &mut GradStore,
    vars: impl IntoIterator<Item = &'v Var>,
    sums: GradientSums,
    narrow: Option<candle_core::DType>,
) -> Result<()> {
    let places = var_places(vars);
    let wrap = |e: TrainError| candle_core::Error::Msg(e.to_string());
    loss.backward_with(|node, grad| {
        let Some((place, var)) = places.get(&node.id()) else {
            return Ok(grad);
        };
        let grad = match narrow {
            Some(narrow) => {
                keep_narrow(&grad, narrow).map_err(|e| candle_core::Error::Msg(e.to_string()))?
            }
            None => grad,
        };
        add_gradient(acc, var, *place, &grad, sums).map_err(wrap)?;
        // What the backward's own store keeps of it: nothing of its buffer.
        Tensor::zeros((), grad.dtype(), grad.device())
    })?;
    Ok(())
}

/// A recomputing forward's backward ([`LayerRecompute::backward_each`], gradient
/// checkpointing) with each gradient of `vars` added to its sum in `acc` as the layer that
/// makes it runs again, and then dropped, as [`backward_into`] does for a plain backward. A
/// tied embedding's two parts are summed first, so its sum gets one addition (and with
/// [`GradientSums::Bf16`] one rounding), as a plain backward's.
pub fn recomputed_backward_into<'v>(
    layers: LayerRecompute<'_>,
    loss: Tensor,
    acc: &mut GradStore,
    vars: impl IntoIterator<Item = &'v Var>,
    sums: GradientSums,
) -> Result<()> {
    let vars: Vec<&Var> = vars.into_iter().collect();
    let places = var_places(vars.iter().copied());
    // Each variable's gradient comes once (a tied embedding's two parts summed first).
    layers.backward_each(loss, vars.iter().copied(), |var, gradient| {
        // `backward_each` hands the variables it was given only.
        let (place, _) = places.get(&var.id()).ok_or_else(|| {
            r3_model::ModelError::Input("a gradient of a variable not asked for".into())
        })?;
        add_gradient(acc, var, *place, &gradient, sums)
            .map_err(|e| r3_model::ModelError::Input(e.to_string()))
    })?;
    Ok(())
}

/// `[rows.len(), width]`: the rows `rows` of `t` (`[n, W ≥ width]`), cut to `width` columns.
pub fn pick_rows(t: &Tensor, rows: &[usize], width: usize) -> Result<Tensor> {
    let idx = Tensor::from_vec(
        rows.iter().map(|&r| r as u32).collect(),
        rows.len(),
        t.device(),
    )?;
    Ok(t.index_select(&idx, 0)?.narrow(1, 0, width)?.contiguous()?)
}

/// `[n, width]` from per-micro-batch `[rows, w ≤ width]` tensors: row `j` of the part for
/// `rows` goes to row `rows[j]`, columns past a part's `w` are 0 (outside every response).
pub fn place_rows(
    parts: &[(Vec<usize>, Tensor)],
    n: usize,
    width: usize,
    device: &Device,
) -> Result<Tensor> {
    let mut out = vec![0f32; n * width];
    for (rows, t) in parts {
        for (&r, values) in rows.iter().zip(t.to_vec2::<f32>()?) {
            if r >= n || values.len() > width {
                return Err(TrainError::RowOutOfRange { row: r, len: n });
            }
            out[r * width..r * width + values.len()].copy_from_slice(&values);
        }
    }
    Ok(Tensor::from_vec(out, (n, width), device)?)
}

/// One table per row from per-micro-batch tables, back in row order.
pub fn place_tables(
    parts: Vec<(Vec<usize>, Vec<RouteTable>)>,
    n: usize,
) -> Result<Vec<RouteTable>> {
    let mut out: Vec<Option<RouteTable>> = vec![None; n];
    for (rows, tables) in parts {
        for (r, table) in rows.into_iter().zip(tables) {
            *out.get_mut(r)
                .ok_or(TrainError::RowOutOfRange { row: r, len: n })? = Some(table);
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(row, t)| t.ok_or(TrainError::RowOutOfRange { row, len: n }))
        .collect()
}

/// The proof of a forward over all `n` rows from its micro-batches' proofs: cell counts
/// summed per MoE layer, each row's final-position flag back in row order.
pub fn merge_proofs(parts: Vec<(Vec<usize>, ReplayProof)>, n: usize) -> Result<ReplayProof> {
    let mut merged: Option<ReplayProof> = None;
    let mut finals: Vec<Option<bool>> = vec![None; n];
    for (rows, proof) in parts {
        for (&r, &f) in rows.iter().zip(&proof.native_final_position) {
            *finals
                .get_mut(r)
                .ok_or(TrainError::RowOutOfRange { row: r, len: n })? = Some(f);
        }
        match merged.as_mut() {
            None => merged = Some(proof),
            Some(m) => {
                if m.layers != proof.layers {
                    return Err(TrainError::Length {
                        what: format!("replay proof MoE layers {:?}", proof.layers),
                        got: proof.layers.len(),
                        expected: m.layers.len(),
                    });
                }
                let add = |a: &mut Vec<usize>, b: &[usize]| {
                    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                };
                add(&mut m.replayed_cells, &proof.replayed_cells);
                add(&mut m.native_cells, &proof.native_cells);
                add(&mut m.differs_from_native, &proof.differs_from_native);
            }
        }
    }
    let mut merged = merged.ok_or(TrainError::RowOutOfRange { row: 0, len: n })?;
    merged.native_final_position = finals
        .into_iter()
        .enumerate()
        .map(|(row, f)| f.ok_or(TrainError::RowOutOfRange { row, len: n }))
        .collect::<Result<_>>()?;
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_within_the_budget_is_one_micro_batch_in_row_order() {
        assert_eq!(pack_micro_batches(&[5, 3, 4], 0), vec![vec![0, 1, 2]]);
        assert_eq!(pack_micro_batches(&[5, 3, 4], 15), vec![vec![0, 1, 2]]);
    }

    #[test]
    fn sharing_rows_are_packed_in_token_order_within_the_budget() {
        let seqs = vec![
            vec![7, 1, 2],
            vec![3, 1],
            vec![7, 1, 5, 5, 5],
            vec![3, 1, 9],
            vec![7, 0],
        ];
        // Token order: 1 [3,1], 3 [3,1,9], 4 [7,0], 0 [7,1,2], 2 [7,1,5,5,5]. Budget 9:
        // [1, 3, 4] costs 3 × 3 = 9; adding row 0 would cost 12; [0] then [0, 2] would cost
        // 10.
        assert_eq!(
            pack_micro_batches_by_prefix(&seqs, 9),
            vec![vec![1, 3, 4], vec![0], vec![2]]
        );
        assert_eq!(pack_rows(&seqs, 25, true), vec![vec![0, 1, 2, 3, 4]]);
        // Unshared packing keeps its shortest-first order.
        assert_eq!(
            pack_rows(&seqs, 9, false),
            pack_micro_batches(&[3, 2, 5, 3, 2], 9)
        );
    }

    #[test]
    fn token_order_packing_places_every_row_once_within_the_budget() {
        // Deterministic pseudo-random sequences (a fixed LCG): groups of 4 with a common
        // prompt and responses of 1 to 40 tokens over a 6-token vocabulary.
        let mut x = 7u64;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let seqs: Vec<Vec<u32>> = (0..60)
            .map(|i| {
                let prompt = (0..5 + i / 4 % 7).map(|j| ((i / 4 + j) % 6) as u32);
                let response: Vec<u32> = (0..1 + next(40)).map(|_| next(6) as u32).collect();
                prompt.chain(response).collect()
            })
            .collect();
        for budget in [1, 45, 200, 1000] {
            let parts = pack_micro_batches_by_prefix(&seqs, budget);
            let mut seen: Vec<usize> = parts.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..seqs.len()).collect::<Vec<_>>(), "every row once");
            for p in &parts {
                let cost = p.len() * p.iter().map(|&r| seqs[r].len()).max().expect("row");
                assert!(cost <= budget || p.len() == 1, "{cost} > {budget}");
            }
            // In token order across the micro-batches.
            let order: Vec<&Vec<u32>> = parts.iter().flatten().map(|&r| &seqs[r]).collect();
            assert!(order.windows(2).all(|w| w[0] <= w[1]), "token order");
            assert_eq!(parts, pack_micro_batches_by_prefix(&seqs, budget));
        }
    }

    #[test]
    fn rows_are_packed_shortest_first_within_the_budget() {
        // Sorted: 1 (3), 2 (4), 0 (5), 3 (9). Budget 10: [1, 2] costs 2 × 4 = 8; adding
        // row 0 would cost 3 × 5 = 15; [0] then [0, 3] would cost 18; row 3 alone is 9.
        assert_eq!(
            pack_micro_batches(&[5, 3, 4, 9], 10),
            vec![vec![1, 2], vec![0], vec![3]]
        );
        // A row longer than the budget forms its own micro-batch.
        assert_eq!(
            pack_micro_batches(&[2, 12, 2], 5),
            vec![vec![0, 2], vec![1]]
        );
    }
}
