//! The routed experts of one MoE layer as two stacked tensors — `gate_up` `[E, 2I, H]` (gate
//! rows first) and `down` `[E, H, I]`, the transformers-5 fused layout — and the gate-weighted
//! sum of their SwiGLUs over each row's chosen experts.
//!
//! On CPU in f32/f64 the whole layer (dispatch, grouped GEMMs with experts in parallel,
//! combine) is one custom op with its own backward (`routed_op`); candle's autograd would
//! otherwise build ~10 nodes per expert, each with a gradient pass over its input (upstream
//! candle, measured then, also zero-filled one per node) — most of a training step's time at
//! 32 experts.

use candle_core::{Tensor, D};

use super::dispatch::Dispatch;
use super::gather_rows::GatherRows;
use super::linear::{matmul_wt, matmul_wt_at};
use super::routed_op::RoutedSwiGlu;
use crate::error::{ModelError, Result};
use crate::precision::Precision;
use crate::spec::fused_expert_names;
use crate::weights::Weights;

/// The routed experts of one MoE layer, stacked.
#[derive(Debug, Clone)]
pub struct RoutedExperts {
    gate_up: Tensor,
    down: Tensor,
    intermediate: usize,
    precision: Precision,
}

impl RoutedExperts {
    /// Takes the fused expert pair under `{moe_prefix}.experts` (see `Weights::fuse_experts`).
    pub fn new(weights: &Weights, moe_prefix: &str, num_experts: usize) -> Result<Self> {
        let (gate_up_name, down_name) = fused_expert_names(moe_prefix);
        let gate_up = weights.get(&gate_up_name)?.clone();
        let down = weights.get(&down_name)?.clone();
        let (e, two_i, h) = gate_up.dims3()?;
        let (e2, h2, i) = down.dims3()?;
        if e != num_experts || e2 != e || h2 != h || two_i != 2 * i {
            return Err(ModelError::TensorShape {
                name: gate_up_name,
                expected: vec![num_experts, 2 * i, h2],
                got: gate_up.dims().to_vec(),
            });
        }
        Ok(RoutedExperts {
            gate_up,
            down,
            intermediate: i,
            precision: Precision::F32,
        })
    }

    /// Sets the precision. bf16 runs the composed path with every expert matmul rounded
    /// (inputs, weights, outputs) and the SwiGLU output rounded; the gate-weighted sum stays
    /// f32 (the caller rounds the block output).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// `y[r] = Σ_j gates[r, j] · SwiGLU_{e(r, j)}(x[r])` for `x` `[rows, H]` and `gates`
    /// `[rows, top_k]`, the experts `e(r, j)` as `dispatch` groups them.
    pub fn forward(&self, x: &Tensor, gates: &Tensor, dispatch: &Dispatch) -> Result<Tensor> {
        let e = self.gate_up.dim(0)?;
        let (rows, _) = x.dims2()?;
        let k = dispatch.top_k();
        if dispatch.rows() != rows || dispatch.offsets().len() != e + 1 {
            return Err(ModelError::Input(format!(
                "dispatch of {} rows over {} experts does not fit {rows} rows and {e} experts",
                dispatch.rows(),
                dispatch.offsets().len().saturating_sub(1)
            )));
        }
        if gates.dims() != [rows, k] {
            return Err(ModelError::Input(format!(
                "gates {:?} are not [{rows}, {k}]",
                gates.dims()
            )));
        }
        let fused_dtype = matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64);
        if x.device().is_cpu() && fused_dtype && !self.precision.is_mixed() {
            let rows_with_gates = Tensor::cat(&[x, &gates.to_dtype(x.dtype())?], 1)?;
            Ok(rows_with_gates.apply_op3(
                &self.gate_up.contiguous()?,
                &self.down.contiguous()?,
                RoutedSwiGlu::new(dispatch.clone()),
            )?)
        } else if !x.device().is_cpu() && padded_fits(dispatch) {
            self.forward_padded(x, gates, dispatch)
        } else {
            self.forward_composed(x, gates, dispatch)
        }
    }

    /// The same computation as three batched GEMMs over all experts at once, for a GPU: each
    /// expert's rows gathered into a `[E, cap, H]` block (`cap` the busiest expert's row
    /// count, shorter experts padded with a zero row), `[E, cap, H] · [E, H, 2I]`, SwiGLU,
    /// `· [E, I, H]`, then each row's `top_k` outputs gathered back in slot order, weighted
    /// by its gates and summed. One launch per GEMM instead of one per expert, and the
    /// weights' gradients come out of the batched GEMM's backward whole (slicing each expert
    /// out of the stacked weight would make candle's backward build a zero-filled copy of
    /// the whole stack per expert). Both gathers are [`GatherRows`], whose backward is a
    /// gather too (candle's `index_select` → `index_add` backward is serial over the rows on
    /// a GPU). The same rounding points as `forward_composed`.
    fn forward_padded(&self, x: &Tensor, gates: &Tensor, dispatch: &Dispatch) -> Result<Tensor> {
        let i = self.intermediate;
        let p = self.precision;
        let device = x.device();
        let (rows, h) = x.dims2()?;
        let k = dispatch.top_k();
        let layout = padded_layout(dispatch, rows);
        let (e, cap) = (layout.experts, layout.cap);
        // Row `rows` of `x_pad` is the zero row padding reads; it gets no gradient.
        let x_pad = Tensor::cat(&[x, &Tensor::zeros((1, h), x.dtype(), device)?], 0)?;
        let xs = GatherRows::new(layout.gather, rows + 1, rows)?
            .apply(&x_pad)?
            .reshape((e, cap, h))?;
        let hidden = matmul_wt_at(p, &xs, &self.gate_up)?;
        let a = p.round(&(hidden.narrow(2, 0, i)?.silu()? * hidden.narrow(2, i, i)?)?)?;
        let y = matmul_wt_at(p, &a, &self.down)?.reshape((e * cap, h))?;
        let by_slot = GatherRows::new(layout.place_of_slot, e * cap, e * cap)?
            .apply(&y)?
            .reshape((rows, k, h))?;
        let weights = gates.to_dtype(x.dtype())?.unsqueeze(D::Minus1)?;
        Ok(by_slot.broadcast_mul(&weights)?.sum(1)?)
    }

    /// The same computation from candle's composed ops, expert by expert (other devices and
    /// dtypes, and the reference the fused op is tested against).
    fn forward_composed(&self, x: &Tensor, gates: &Tensor, dispatch: &Dispatch) -> Result<Tensor> {
        let i = self.intermediate;
        let device = x.device();
        let source = Tensor::from_vec(dispatch.source_rows(), dispatch.slots().len(), device)?;
        let xs = x.index_select(&source, 0)?;
        let mut outputs = Vec::new();
        for (j, w) in dispatch.offsets().windows(2).enumerate() {
            if w[0] == w[1] {
                continue;
            }
            let p = self.precision;
            let xj = xs.narrow(0, w[0], w[1] - w[0])?;
            let h = p.round(&matmul_wt(
                &p.round(&xj)?,
                &p.round(&self.gate_up.get(j)?)?,
            )?)?;
            let a = p.round(&(h.narrow(1, 0, i)?.silu()? * h.narrow(1, i, i)?)?)?;
            outputs.push(p.round(&matmul_wt(&a, &p.round(&self.down.get(j)?)?)?)?);
        }
        if outputs.is_empty() {
            return Ok(x.zeros_like()?);
        }
        let expert_out = Tensor::cat(&outputs, 0)?;
        let slots = Tensor::from_vec(dispatch.slots().to_vec(), dispatch.slots().len(), device)?;
        let weights = gates
            .to_dtype(x.dtype())?
            .flatten_all()?
            .index_select(&slots, 0)?
            .unsqueeze(D::Minus1)?;
        let weighted = expert_out.broadcast_mul(&weights)?;
        Ok(x.zeros_like()?.index_add(&source, &weighted, 0)?)
    }
}

/// The busiest expert's row count: the padded layout's places per expert.
fn busiest(dispatch: &Dispatch) -> usize {
    let offsets = dispatch.offsets();
    offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
}

/// Whether the padded layout wastes at most as many rows as it uses: the busiest expert's
/// count times the experts within twice the routed slots. Small batches (decode) spread few
/// slots over many experts; there one GEMM per chosen expert reads only those experts'
/// weights, where the padded GEMM would read every expert's.
fn padded_fits(dispatch: &Dispatch) -> bool {
    let offsets = dispatch.offsets();
    let cap = busiest(dispatch);
    let experts = offsets.len().saturating_sub(1);
    cap > 0 && experts * cap <= 2 * dispatch.slots().len()
}

/// The padded `[E, cap]` layout of a dispatch: `cap` places per expert, filled in the
/// dispatch's order and padded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PaddedLayout {
    experts: usize,
    cap: usize,
    /// For each of the `E · cap` places the row it reads (`rows`, the zero row, for padding).
    gather: Vec<u32>,
    /// For each slot `r · top_k + j` its place.
    place_of_slot: Vec<u32>,
}

/// The padded layout of `dispatch` over `rows` rows.
fn padded_layout(dispatch: &Dispatch, rows: usize) -> PaddedLayout {
    let offsets = dispatch.offsets();
    let experts = offsets.len().saturating_sub(1);
    let cap = busiest(dispatch);
    let k = dispatch.top_k();
    let mut gather = vec![rows as u32; experts * cap];
    let mut place_of_slot = vec![0u32; dispatch.slots().len()];
    for (expert, w) in offsets.windows(2).enumerate() {
        for (n, &slot) in dispatch.slots()[w[0]..w[1]].iter().enumerate() {
            let place = expert * cap + n;
            gather[place] = slot / k as u32;
            place_of_slot[slot as usize] = place as u32;
        }
    }
    PaddedLayout {
        experts,
        cap,
        gather,
        place_of_slot,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Var};

    fn experts(e: usize, h: usize, i: usize, dtype: DType) -> (Var, Var, RoutedExperts) {
        let gu = Var::from_tensor(&seeded_tensor(&[e, 2 * i, h], 2, dtype)).expect("var");
        let dn = Var::from_tensor(&seeded_tensor(&[e, h, i], 3, dtype)).expect("var");
        let experts = RoutedExperts {
            gate_up: gu.as_tensor().clone(),
            down: dn.as_tensor().clone(),
            intermediate: i,
            precision: Precision::F32,
        };
        (gu, dn, experts)
    }

    /// The case both path comparisons run: 6 rows, top-2 over 5 experts of width 7
    /// (expert 1 gets no row, expert 3 one), seeded rows, gates, weights and loss probe.
    struct PathCase {
        dispatch: Dispatch,
        rows: usize,
        x: Var,
        gates: Var,
        gu: Var,
        dn: Var,
        experts: RoutedExperts,
        probe: Tensor,
    }

    impl PathCase {
        fn new(dtype: DType, precision: Precision) -> Self {
            let (e, h, i, k) = (5, 12, 7, 2);
            let ids = [0, 2, 2, 4, 3, 0, 4, 2, 0, 4, 2, 0];
            let rows = ids.len() / k;
            let dispatch = Dispatch::new(&ids, k, e).expect("dispatch");
            let x = Var::from_tensor(&seeded_tensor(&[rows, h], 1, dtype)).expect("var");
            let gates = Var::from_tensor(&seeded_tensor(&[rows, k], 5, dtype)).expect("var");
            let (gu, dn, mut experts) = experts(e, h, i, dtype);
            experts.set_precision(precision);
            let probe = seeded_tensor(&[rows, h], 4, dtype);
            PathCase {
                dispatch,
                rows,
                x,
                gates,
                gu,
                dn,
                experts,
                probe,
            }
        }

        /// The gradients of `sum(y · probe)`.
        fn grads(&self, y: &Tensor) -> candle_core::backprop::GradStore {
            (y * &self.probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward")
        }

        /// The four variables, by name.
        fn vars(&self) -> [(&'static str, &Var); 4] {
            [
                ("x", &self.x),
                ("gates", &self.gates),
                ("gate_up", &self.gu),
                ("down", &self.dn),
            ]
        }
    }

    /// The fused op and candle's composed ops agree on outputs and on the gradients of the
    /// rows, the gates and both expert weights, including an expert no row goes to.
    #[test]
    fn fused_matches_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let c = PathCase::new(dtype, Precision::F32);
            assert_eq!(c.dispatch.offsets()[1], c.dispatch.offsets()[2]);
            let (x, gates) = (c.x.as_tensor(), c.gates.as_tensor());
            let fused = c.experts.forward(x, gates, &c.dispatch).expect("fused");
            let composed = c
                .experts
                .forward_composed(x, gates, &c.dispatch)
                .expect("composed");
            let (gf, gc) = (c.grads(&fused), c.grads(&composed));
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            assert!(max_abs_diff(&fused, &composed) < tol, "{dtype:?} outputs");
            for (name, v) in c.vars() {
                let a = gf.get(v.as_tensor()).expect("fused grad");
                let b = gc.get(v.as_tensor()).expect("composed grad");
                assert!(max_abs_diff(a, b) < tol, "{dtype:?} grad of {name}");
            }
            // expert 1 has no rows: its weight gradients are exactly zero
            let dw = gf.get(c.gu.as_tensor()).expect("grad").get(1).expect("e1");
            assert_eq!(max_abs_diff(&dw, &dw.zeros_like().expect("z")), 0.0);
        }
    }

    /// The padded batched layout (the GPU's path) equals the expert-by-expert composed ops
    /// on outputs and on the gradients of the rows, the gates and both stacked weights, in
    /// f64, f32 and bf16 rounding, with an expert no row goes to and uneven expert loads.
    #[test]
    fn padded_matches_composed_ops() {
        let k = 2;
        let case = PathCase::new(DType::F64, Precision::F32);
        let rows = case.rows;
        let layout = padded_layout(&case.dispatch, rows);
        let cap = layout.cap;
        assert_eq!(
            (layout.experts, cap),
            (5, 4),
            "experts 0 and 2 carry four rows each"
        );
        // expert 1 is all padding: the zero row
        assert!(layout.gather[cap..2 * cap]
            .iter()
            .all(|&r| r as usize == rows));
        // every slot has its own place, and that place reads the slot's row
        let mut places = layout.place_of_slot.clone();
        places.sort_unstable();
        places.dedup();
        assert_eq!(places.len(), rows * k);
        for (slot, &place) in layout.place_of_slot.iter().enumerate() {
            assert_eq!(layout.gather[place as usize] as usize, slot / k);
        }
        for (dtype, precision, tol) in [
            (DType::F64, Precision::F32, 1e-12),
            (DType::F32, Precision::F32, 2e-5),
            // bf16: the two sum in different orders, so a rounding may land one ulp apart
            (DType::F32, Precision::Bf16 { router_f32: false }, 1e-2),
        ] {
            let c = PathCase::new(dtype, precision);
            let (x, gates) = (c.x.as_tensor(), c.gates.as_tensor());
            let padded = c
                .experts
                .forward_padded(x, gates, &c.dispatch)
                .expect("padded");
            let composed = c
                .experts
                .forward_composed(x, gates, &c.dispatch)
                .expect("composed");
            let (gp, gc) = (c.grads(&padded), c.grads(&composed));
            let scale = max_abs_diff(&composed, &composed.zeros_like().expect("z"));
            assert!(scale > 0.1, "a non-trivial output");
            assert!(
                max_abs_diff(&padded, &composed) < tol * scale.max(1.0),
                "{dtype:?} {precision:?} outputs"
            );
            for (name, v) in c.vars() {
                let a = gp.get(v.as_tensor()).expect("padded grad");
                let b = gc.get(v.as_tensor()).expect("composed grad");
                let scale = max_abs_diff(b, &b.zeros_like().expect("z")).max(1.0);
                assert!(
                    max_abs_diff(a, b) < tol * scale,
                    "{dtype:?} {precision:?} grad of {name}"
                );
            }
        }
    }

    /// The padded layout is used only where it wastes at most as many rows as it uses.
    #[test]
    fn padding_is_chosen_for_even_loads_only() {
        // 4 rows top-1 over 4 experts, one each: cap 1, 4 padded places for 4 slots
        let even = Dispatch::new(&[0, 1, 2, 3], 1, 4).expect("dispatch");
        assert!(padded_fits(&even));
        // one row top-2 over 8 experts (a decode step): 8 places for 2 slots
        let sparse = Dispatch::new(&[3, 5], 2, 8).expect("dispatch");
        assert!(!padded_fits(&sparse));
        // every row on one expert of two: 2 · 4 = 8 places for 4 slots, the limit
        let skewed = Dispatch::new(&[1, 1, 1, 1], 1, 2).expect("dispatch");
        assert!(padded_fits(&skewed));
        let more_skewed = Dispatch::new(&[1, 1, 1, 1], 1, 3).expect("dispatch");
        assert!(!padded_fits(&more_skewed));
    }

    /// One row, one expert, gate 1: the output is that expert's SwiGLU, computed by hand.
    #[test]
    fn single_row_is_the_chosen_experts_swiglu() {
        let (e, h, i) = (3, 4, 2);
        let (_, _, experts) = experts(e, h, i, DType::F64);
        let x = seeded_tensor(&[1, h], 9, DType::F64);
        let gates = Tensor::new(&[[1.0f64]], x.device()).expect("gates");
        let dispatch = Dispatch::new(&[2], 1, e).expect("dispatch");
        let y = experts.forward(&x, &gates, &dispatch).expect("forward");
        let xv = x.flatten_all().and_then(|t| t.to_vec1::<f64>()).expect("x");
        let w1 = experts
            .gate_up
            .get(2)
            .and_then(|t| t.to_vec2::<f64>())
            .expect("w1");
        let w2 = experts
            .down
            .get(2)
            .and_then(|t| t.to_vec2::<f64>())
            .expect("w2");
        let dot = |w: &[f64], v: &[f64]| w.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
        let a: Vec<f64> = (0..i)
            .map(|c| {
                let g = dot(&w1[c], &xv);
                let u = dot(&w1[i + c], &xv);
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        let want: Vec<f64> = (0..h).map(|o| dot(&w2[o], &a)).collect();
        let got = y.flatten_all().and_then(|t| t.to_vec1::<f64>()).expect("y");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn a_dispatch_or_gates_that_do_not_fit_are_errors() {
        let (_, _, experts) = experts(2, 3, 2, DType::F64);
        let x = seeded_tensor(&[3, 3], 3, DType::F64);
        let gates = seeded_tensor(&[3, 1], 4, DType::F64);
        let two_rows = Dispatch::new(&[0, 1], 1, 2).expect("dispatch");
        let err = experts.forward(&x, &gates, &two_rows).expect_err("rows");
        assert!(err.to_string().contains("dispatch"), "{err}");
        let three_experts = Dispatch::new(&[0, 1, 2], 1, 3).expect("dispatch");
        let err = experts
            .forward(&x, &gates, &three_experts)
            .expect_err("experts");
        assert!(err.to_string().contains("experts"), "{err}");
        let fits = Dispatch::new(&[0, 1, 1], 1, 2).expect("dispatch");
        let wide = seeded_tensor(&[3, 2], 4, DType::F64);
        let err = experts.forward(&x, &wide, &fits).expect_err("gates");
        assert!(err.to_string().contains("gates"), "{err}");
    }
}
