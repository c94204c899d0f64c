//! The routed experts of one MoE layer as two stacked tensors — `gate_up` `[E, 2I, H]` (gate
//! rows first) and `down` `[E, H, I]`, the transformers-5 fused layout — and the gate-weighted
//! sum of their SwiGLUs over each row's chosen experts.
//!
//! On CPU in f32/f64 the whole layer (dispatch, grouped GEMMs with experts in parallel,
//! combine) is one custom op with its own backward (`routed_op`); candle's autograd would
//! otherwise build ~10 nodes per expert and, for each node, materialise a zero-filled
//! gradient of its input — most of a training step's time at 32 experts.

use candle_core::{Tensor, D};

use super::dispatch::Dispatch;
use super::linear::matmul_wt;
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
        } else {
            self.forward_composed(x, gates, dispatch)
        }
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

    /// The fused op and candle's composed ops agree on outputs and on the gradients of the
    /// rows, the gates and both expert weights, including an expert no row goes to.
    #[test]
    fn fused_matches_composed_ops() {
        let (e, h, i, k) = (5, 12, 7, 2);
        // 6 rows, top-2; expert 1 gets nothing, expert 3 gets one row
        let ids = [0, 2, 2, 4, 3, 0, 4, 2, 0, 4, 2, 0];
        let rows = ids.len() / k;
        let dispatch = Dispatch::new(&ids, k, e).expect("dispatch");
        assert_eq!(dispatch.offsets()[1], dispatch.offsets()[2]);
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&seeded_tensor(&[rows, h], 1, dtype)).expect("var");
            let gates = Var::from_tensor(&seeded_tensor(&[rows, k], 5, dtype)).expect("var");
            let (gu, dn, experts) = experts(e, h, i, dtype);
            let probe = seeded_tensor(&[rows, h], 4, dtype);
            let fused = experts
                .forward(x.as_tensor(), gates.as_tensor(), &dispatch)
                .expect("fused");
            let composed = experts
                .forward_composed(x.as_tensor(), gates.as_tensor(), &dispatch)
                .expect("composed");
            let backward = |y: &Tensor| {
                (y * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward")
            };
            let (gf, gc) = (backward(&fused), backward(&composed));
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            assert!(max_abs_diff(&fused, &composed) < tol, "{dtype:?} outputs");
            for (name, v) in [
                ("x", &x),
                ("gates", &gates),
                ("gate_up", &gu),
                ("down", &dn),
            ] {
                let a = gf.get(v.as_tensor()).expect("fused grad");
                let b = gc.get(v.as_tensor()).expect("composed grad");
                assert!(max_abs_diff(a, b) < tol, "{dtype:?} grad of {name}");
            }
            // expert 1 has no rows: its weight gradients are exactly zero
            let dw = gf.get(gu.as_tensor()).expect("grad").get(1).expect("e1");
            assert_eq!(max_abs_diff(&dw, &dw.zeros_like().expect("z")), 0.0);
        }
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
