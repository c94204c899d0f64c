//! Mixed precision of the training forward (Megatron style): the weights and the optimiser
//! stay f32 (master weights); in bf16 mode every matmul reads its inputs and weights rounded to
//! bf16, accumulates in f32 and rounds its output to bf16, and the activations between ops are
//! bf16 at the same boundaries the rollout engine's bf16 mode uses (embeddings, norm outputs,
//! projection outputs, rotated q/k, SwiGLU and expert outputs, MoE block output, residual
//! stream). Rounding is one op ([`RoundTo`]) whose gradient is the incoming gradient rounded
//! to the same format (what the cast pair's backward computes), so gradients reach the f32
//! master weights; the backward runs in f32 between rounding points.
//! f16 mode rounds at the same points to f16 (the FP16 paper's training side).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use crate::config::AttentionConfig;
use crate::error::Result;
use crate::round16::{rounded_copy, rounding_to};

/// The dtype in which a 16-bit forward hands back the gradients of the f32 weights it reads
/// rounded: a GPU's 16-bit GEMMs (the routed experts' stacks, `layers/moe/expert_gemm/`; the
/// projections, `layers/matmul16.rs`) and the weight roundings on any device
/// (`layers/linear.rs` `round_weight`). Either way the same values: a rounding's gradient is
/// the incoming one rounded, so each is a 16-bit value, which is what the GEMMs write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightGradients {
    /// In the weight's own dtype (an f32 master's in f32): widened from the GEMM's 16-bit
    /// output.
    #[default]
    InWeightDtype,
    /// In the 16-bit float as the GEMMs wrote it (2 bytes a parameter, no widening pass and
    /// no check): for a trainer keeping its weight gradients in 16 bits
    /// (`train.narrow_gradients`), whose readers widen them.
    Narrow,
}

/// Where the training forward rounds to a 16-bit float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Full f32 forward (the default; gradient checks run here).
    #[default]
    F32,
    /// bf16 matmul inputs/outputs and activations at op boundaries, f32 accumulation.
    Bf16 {
        /// Router logits in f32 from the f32 gate weight (Megatron's `moe_router_dtype =
        /// fp32`); otherwise the gate is a bf16 projection like every other.
        router_f32: bool,
    },
    /// The same rounding points in f16 (11 significant bits, largest finite 65504): the FP16
    /// paper's training side. A value past the f16 range becomes infinite, so the loss turns
    /// non-finite and the trainer's non-finite guard skips the update and says so.
    F16 {
        /// Router logits in f32 from the f32 gate weight.
        router_f32: bool,
    },
}

impl Precision {
    /// Whether activations and matmuls are rounded to a 16-bit float (bf16 or f16).
    pub fn is_mixed(self) -> bool {
        !matches!(self, Precision::F32)
    }

    /// The format whose finite range the weights must lie in for this forward (they are
    /// rounded to it at every matmul).
    pub fn weight_precision(self) -> crate::weights::WeightPrecision {
        use crate::weights::WeightPrecision as W;
        match self {
            Precision::F32 => W::F32,
            Precision::Bf16 { .. } => W::Bf16,
            Precision::F16 { .. } => W::F16,
        }
    }

    /// The precision of the router projection: f32 when the router is kept in f32.
    pub fn router(self) -> Precision {
        match self {
            Precision::Bf16 { router_f32: true } | Precision::F16 { router_f32: true } => {
                Precision::F32
            }
            other => other,
        }
    }

    /// The 16-bit float this precision rounds to; None in f32.
    pub fn narrow_dtype(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 { .. } => Some(DType::BF16),
            Precision::F16 { .. } => Some(DType::F16),
        }
    }

    /// The dtype a KV cache holds this forward's keys and values in exactly, for attention
    /// `attention`: keys are rounded after RoPE and values after their projection (and
    /// bias), so a 16-bit forward's are values of its 16-bit float, held in half the bytes of
    /// f32 — except where OLMoE's `clip_qkv` clamps the values after that rounding to a bound
    /// that is not a value of the float (a clamped value is the bound itself): f32 then, and
    /// f32 in f32.
    pub fn kv_dtype(self, attention: &AttentionConfig) -> DType {
        let Some(narrow) = self.narrow_dtype() else {
            return DType::F32;
        };
        let bound_exact = match attention {
            AttentionConfig::Gqa {
                clip_qkv: Some(c), ..
            } => {
                let c = [*c as f32];
                let mut rounded = c;
                if let Some(round) = rounding_to(narrow) {
                    round(&mut rounded);
                }
                rounded == c
            }
            _ => true,
        };
        match bound_exact {
            true => narrow,
            false => DType::F32,
        }
    }

    /// `t` rounded to the 16-bit float of this precision (nearest, ties to even) and widened
    /// back to f32; `t` itself in f32 mode. Differentiable: the gradient is the incoming one
    /// rounded the same way (as through `t.to_dtype(narrow).to_dtype(f32)`). A tensor already
    /// in the 16-bit float (an inference engine's weight copies, [`Weights::narrow_matrices`])
    /// is only widened, the same values its f32 original rounds to; f64 and other floats are
    /// returned as they are.
    ///
    /// [`Weights::narrow_matrices`]: crate::weights::Weights::narrow_matrices
    pub fn round(self, t: &Tensor) -> Result<Tensor> {
        let narrow = match self.narrow_dtype() {
            None => return Ok(t.clone()),
            Some(narrow) => narrow,
        };
        if t.dtype() == narrow {
            return Ok(t.to_dtype(DType::F32)?);
        }
        if t.dtype() != DType::F32 {
            return Ok(t.clone());
        }
        Ok(t.apply_op1(RoundTo { narrow })?)
    }

    /// `a + b` rounded at this precision (the residual stream's rounding point): in bf16 /
    /// f16 with nothing differentiated, for same-shaped f32 operands on the CPU or a GPU, one
    /// pass ([`AddRounded`]: on a GPU one kernel where the sum and the rounding were two);
    /// otherwise `round(a + b)`. The same values either way.
    pub fn add_rounded(self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let fused = match self.narrow_dtype() {
            Some(narrow) => {
                a.dims() == b.dims()
                    && a.dtype() == DType::F32
                    && b.dtype() == DType::F32
                    && !a.track_op()
                    && !b.track_op()
                    && crate::device::row_ops_run_on(a)
                    && a.device().same_device(b.device())
                    && rounding_to(narrow).is_some()
            }
            None => false,
        };
        match self.narrow_dtype() {
            Some(narrow) if fused => Ok(a
                .contiguous()?
                .apply_op2_no_bwd(&b.contiguous()?, &AddRounded { narrow })?),
            _ => self.round(&(a + b)?),
        }
    }
}

/// An f32 tensor rounded to a 16-bit float and widened back, as one op. The same values,
/// forward and backward, as the cast pair `to_dtype(narrow).to_dtype(f32)`, but the graph
/// keeps only the input: the pair kept the 16-bit copy alive until the backward as well,
/// and each of its casts' backward filled a zero gradient to add the incoming one to (on a
/// GPU: three buffers and five kernels per rounding point instead of one and two).
#[derive(Debug, Clone, Copy)]
pub struct RoundTo {
    /// The 16-bit float rounded to.
    pub narrow: DType,
}

impl RoundTo {
    /// The rounded storage: the narrow cast of `storage` (any layout), widened back.
    fn round<S: BackendStorage>(&self, storage: &S, layout: &Layout) -> candle_core::Result<S> {
        let narrow = storage.to_dtype(layout, self.narrow)?;
        narrow.to_dtype(&Layout::contiguous(layout.shape()), DType::F32)
    }
}

/// `a + b` of two same-shaped contiguous f32 tensors, rounded to a 16-bit float and widened
/// back, as one op with no backward ([`Precision::add_rounded`]).
#[derive(Debug, Clone, Copy)]
pub struct AddRounded {
    /// The 16-bit float rounded to.
    pub narrow: DType,
}

impl candle_core::CustomOp2 for AddRounded {
    fn name(&self) -> &'static str {
        "add-rounded-to-16-bit"
    }

    /// The f32 sums, then the rounding ([`crate::round16::round_in_place`]).
    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (a, b) else {
            candle_core::bail!("add rounded: the operands must be f32");
        };
        let (a, b) = (
            crate::host::contiguous(a, al, "sum's first operand")?,
            crate::host::contiguous(b, bl, "sum's second operand")?,
        );
        if a.len() != b.len() {
            candle_core::bail!(
                "add rounded: operands of {} and {} values",
                a.len(),
                b.len()
            );
        }
        let round = crate::round16::rounding_for(self.narrow, "add rounded")?;
        let mut sum: Vec<f32> = a.iter().zip(b).map(|(x, y)| x + y).collect();
        crate::round16::round_in_place(&mut sum, round);
        Ok((CpuStorage::F32(sum), al.shape().clone()))
    }

    /// One kernel (`r3_add_rounded_f32`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let n = al.shape().elem_count();
        if bl.shape().elem_count() != n {
            candle_core::bail!(
                "add rounded: operands of {:?} and {:?}",
                al.shape(),
                bl.shape()
            );
        }
        // A grid-stride loop writing every element.
        let out = cuda::launch_f32!(
            cuda::device(a),
            "r3_add_rounded_f32",
            n,
            cuda::elementwise(n),
            [
                cuda::view::<f32>(a, al, "sum's first operand")?,
                cuda::view::<f32>(b, bl, "sum's second operand")?
            ],
            [n as u64, cuda::round_code(Some(self.narrow))?]
        );
        Ok((out, al.shape().clone()))
    }
}

impl CustomOp1 for RoundTo {
    fn name(&self) -> &'static str {
        "round-to-16-bit"
    }

    /// One pass into a new f32 buffer ([`rounded_copy`], threads side by side) for a
    /// contiguous f32 input: the cast pair allocated and filled a 16-bit buffer in between,
    /// one pass each way on one thread (most of a bf16 training step's rounding time).
    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if let (CpuStorage::F32(values), Some((start, end)), Some(round)) = (
            storage,
            layout.contiguous_offsets(),
            rounding_to(self.narrow),
        ) {
            let rounded = rounded_copy(&values[start..end], round);
            return Ok((CpuStorage::F32(rounded), layout.shape().clone()));
        }
        Ok((self.round(storage, layout)?, layout.shape().clone()))
    }

    /// One kernel (`r3_round_bf16_f32` / `r3_round_f16_f32`: the casts' round-to-nearest-even
    /// conversions, no 16-bit buffer) for a contiguous f32 input; the cast pair otherwise.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use candle_core::backend::BackendStorage;

        let name = match self.narrow {
            DType::BF16 => "r3_round_bf16_f32",
            DType::F16 => "r3_round_f16_f32",
            _ => return Ok((self.round(storage, layout)?, layout.shape().clone())),
        };
        if storage.dtype() != DType::F32
            || !layout.is_contiguous()
            || layout.shape().elem_count() == 0
        {
            return Ok((self.round(storage, layout)?, layout.shape().clone()));
        }
        let n = layout.shape().elem_count();
        // A grid-stride loop writing every element.
        let out = cuda::launch_f32!(
            cuda::device(storage),
            name,
            n,
            cuda::elementwise(n),
            [cuda::view::<f32>(storage, layout, "rounded tensor")?],
            [n as u64]
        );
        Ok((out, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // The same values as `grad.to_dtype(narrow).to_dtype(f32)`, in one kernel on a GPU.
        Ok(Some(grad.apply_op1_no_bwd(self)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The KV cache's exact dtype, by hand: the forward's 16-bit float, f32 in f32, and f32
    /// where OLMoE's `clip_qkv` bound is not a value of the float (0.1 is neither bf16 nor
    /// f16; 6.0 is both; 1000.25 needs 12 significant bits and 1001 needs 10: f16 has 11,
    /// bf16 8).
    #[test]
    fn the_kv_cache_holds_the_narrow_float_only_where_values_are_its_values() {
        let gqa = |clip_qkv| AttentionConfig::Gqa {
            num_kv_heads: 1,
            head_dim: 8,
            qkv_bias: false,
            qk_norm: crate::config::QkNorm::None,
            clip_qkv,
            sliding_window: None,
        };
        let mla = AttentionConfig::Mla {
            q_lora_rank: None,
            kv_lora_rank: 4,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 2,
            v_head_dim: 4,
        };
        let bf16 = Precision::Bf16 { router_f32: false };
        let f16 = Precision::F16 { router_f32: true };
        assert_eq!(Precision::F32.kv_dtype(&gqa(None)), DType::F32);
        assert_eq!(bf16.kv_dtype(&gqa(None)), DType::BF16);
        assert_eq!(f16.kv_dtype(&mla), DType::F16);
        assert_eq!(bf16.kv_dtype(&gqa(Some(6.0))), DType::BF16);
        assert_eq!(f16.kv_dtype(&gqa(Some(6.0))), DType::F16);
        assert_eq!(bf16.kv_dtype(&gqa(Some(0.1))), DType::F32);
        assert_eq!(f16.kv_dtype(&gqa(Some(0.1))), DType::F32);
        assert_eq!(f16.kv_dtype(&gqa(Some(1000.25))), DType::F32);
        assert_eq!(f16.kv_dtype(&gqa(Some(1000.5))), DType::F16);
        assert_eq!(bf16.kv_dtype(&gqa(Some(1001.0))), DType::F32);
        assert_eq!(bf16.kv_dtype(&gqa(Some(1024.0))), DType::BF16);
    }

    /// Values checked by hand: bf16 keeps 8 significant bits, ties to even; the gradient of
    /// the rounding is the identity.
    /// The residual sum's rounding in one op equals `round(a + b)` bit for bit in bf16 and
    /// f16 (and is the plain sum in f32); with an operand to differentiate it takes the
    /// composed form, through which the gradient still flows.
    #[test]
    fn add_rounded_equals_the_rounded_sum() {
        let bits = crate::test_util::f32_bits;
        let a = (crate::test_util::seeded_tensor(&[3, 5, 70], 1, DType::F32) * 7.0).expect("a");
        let b = crate::test_util::seeded_tensor(&[3, 5, 70], 2, DType::F32);
        for p in [
            Precision::F32,
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let got = p.add_rounded(&a, &b).expect("fused");
            let want = p.round(&(&a + &b).expect("sum")).expect("rounded");
            assert_eq!(bits(&got), bits(&want), "{p:?}");
        }
        let p = Precision::Bf16 { router_f32: false };
        let va = Var::from_tensor(&a).expect("var");
        let y = p.add_rounded(va.as_tensor(), &b).expect("tracked");
        let want = p.round(&(&a + &b).expect("sum")).expect("rounded");
        assert_eq!(bits(&y), bits(&want));
        let grads = y.sum_all().and_then(|l| l.backward()).expect("backward");
        assert!(
            grads.get(va.as_tensor()).is_some(),
            "no gradient through the sum"
        );
    }

    #[test]
    fn bf16_round_by_hand_with_straight_through_gradient() {
        let v = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            3.0,
            2.5234375,
        ];
        let x = Var::from_slice(&v, 4, &Device::Cpu).expect("var");
        let p = Precision::Bf16 { router_f32: false };
        let y = p.round(x.as_tensor()).expect("round");
        let got = y.to_vec1::<f32>().expect("values");
        assert_eq!(got, vec![1.0, 1.0 + 2f32.powi(-6), 3.0, 2.53125]);
        let grads = (y * 2.0)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        let g = grads.get(&x).expect("grad").to_vec1::<f32>().expect("grad");
        assert_eq!(g, vec![2.0; 4]);
        let same = Precision::F32.round(x.as_tensor()).expect("f32");
        assert_eq!(same.to_vec1::<f32>().expect("values"), v.to_vec());
        assert_eq!(
            Precision::Bf16 { router_f32: true }.router(),
            Precision::F32
        );
    }

    /// The op equals the cast pair it replaces, forward and backward (the incoming gradient
    /// rounded), on a strided input, in bf16 and f16.
    #[test]
    fn round_op_equals_the_cast_pair_forward_and_backward() {
        let n = 4096;
        // Values spread over many binades, with ties and subnormals among them.
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let m = 1.0 + (i % 97) as f32 / 256.0 + (i % 5) as f32 * 2f32.powi(-9);
                let e = (i % 61) - 40;
                let s = if i % 3 == 0 { -1.0 } else { 1.0 };
                s * m * 2f32.powi(e)
            })
            .collect();
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1.0009)
            .collect();
        let x = Var::from_slice(&v, (64, 64), &Device::Cpu).expect("var");
        let probe = Tensor::from_slice(&g, (64, 64), &Device::Cpu).expect("probe");
        for p in [
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: false },
        ] {
            let narrow = p.narrow_dtype().expect("narrow");
            // a transposed (strided) input
            let xt = x.as_tensor().t().expect("t");
            let want = xt
                .to_dtype(narrow)
                .and_then(|t| t.to_dtype(DType::F32))
                .expect("pair");
            let got = p.round(&xt).expect("round");
            let bits = |t: &Tensor| -> Vec<u32> {
                t.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("values")
                    .iter()
                    .map(|f| f.to_bits())
                    .collect()
            };
            assert_eq!(bits(&got), bits(&want), "{p:?} forward");
            let grad = |y: &Tensor| {
                let grads = (y * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                grads.get(&x).expect("grad").clone()
            };
            let (gw, gg) = (grad(&want), grad(&got));
            // Equal values (the pair's zero-filled sums may turn a -0 into +0).
            let diff = (gw - &gg)
                .and_then(|d| d.abs())
                .and_then(|d| d.max_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(diff, 0.0, "{p:?} backward");
            // the gradient was rounded, not passed through: some probe value is not a 16-bit float
            assert_ne!(
                bits(&gg),
                bits(&probe.t().expect("t")),
                "{p:?} gradient rounded"
            );
        }
    }

    /// f16 by hand: 11 significant bits, ties to even, past 65504 infinite, below half the
    /// smallest subnormal zero; the router stays f32 when asked.
    #[test]
    fn f16_round_by_hand() {
        let v = [
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            2.523_437_5,
            70_000.0,
            1e-8,
        ];
        let x = Tensor::from_slice(&v, 5, &Device::Cpu).expect("tensor");
        let p = Precision::F16 { router_f32: false };
        let got = p
            .round(&x)
            .expect("round")
            .to_vec1::<f32>()
            .expect("values");
        assert_eq!(
            got,
            vec![1.0, 1.0 + 2f32.powi(-9), 2.523_437_5, f32::INFINITY, 0.0]
        );
        assert!(p.is_mixed());
        assert_eq!(p.router(), p);
        assert_eq!(Precision::F16 { router_f32: true }.router(), Precision::F32);
    }
}
