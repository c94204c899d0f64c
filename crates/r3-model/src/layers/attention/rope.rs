//! Rotary position embeddings: frequency tables (plain, linear, YaRN) and their
//! application — a fused custom op on CPU, candle's rope kernel with a backward on a GPU,
//! candle's composed `rope_slow` (half-split) / `rope_i_slow` (interleaved) elsewhere.

use std::sync::Arc;

use candle_core::{CustomOp1, DType, Device, Tensor};

use super::rope_op::RotaryOp;
use super::rope_rounded::rope_rounded;
use crate::layers::precomputed::{precomputed_fwd, Precomputed};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::precision::Precision;

/// Inverse frequencies and the cos/sin scale of one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    interleaved: bool,
}

/// YaRN's magnitude correction `0.1 · m · ln(s) + 1` (1 for s ≤ 1).
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Multiplier of MLA's softmax scale: DeepSeek-V3 multiplies `1/sqrt(qk_head_dim)` by
/// `yarn_mscale(factor, mscale_all_dim)²` under YaRN with a non-zero `mscale_all_dim`.
pub fn mla_softmax_scale_multiplier(cfg: &RopeConfig) -> f64 {
    match &cfg.scaling {
        RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m_all),
            ..
        } if *m_all != 0.0 => {
            let m = yarn_mscale(*factor, *m_all);
            m * m
        }
        _ => 1.0,
    }
}

fn yarn_correction_dim(rotations: f64, dim: usize, base: f64, max_pos: usize) -> f64 {
    (dim as f64 * (max_pos as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln())
        / (2.0 * base.ln())
}

impl Rope {
    /// Frequencies as HF computes them (f32), including the scaling rule.
    pub fn new(cfg: &RopeConfig) -> Self {
        let dim = cfg.dim;
        let base = cfg.theta as f32;
        let plain: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let (inv_freq, attention_factor) = match &cfg.scaling {
            RopeScaling::None => (plain, 1.0),
            RopeScaling::Linear { factor } => {
                (plain.iter().map(|f| f / *factor as f32).collect(), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let base = cfg.theta;
                let mut low =
                    yarn_correction_dim(*beta_fast, dim, base, *original_max_position_embeddings);
                let mut high =
                    yarn_correction_dim(*beta_slow, dim, base, *original_max_position_embeddings);
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim as f64 - 1.0);
                let span = if low == high { 0.001 } else { high - low };
                let inv: Vec<f32> = plain
                    .iter()
                    .enumerate()
                    .map(|(i, &extrapolated)| {
                        let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
                        let extrapolation_weight = 1.0 - ramp;
                        let interpolated = extrapolated as f64 / factor;
                        (interpolated * (1.0 - extrapolation_weight)
                            + extrapolated as f64 * extrapolation_weight)
                            as f32
                    })
                    .collect();
                let af = match (attention_factor, mscale, mscale_all_dim) {
                    (Some(a), _, _) => *a,
                    (None, Some(m), Some(m_all)) if *m != 0.0 && *m_all != 0.0 => {
                        yarn_mscale(*factor, *m) / yarn_mscale(*factor, *m_all)
                    }
                    _ => yarn_mscale(*factor, 1.0),
                };
                (inv, af as f32)
            }
        };
        Rope {
            inv_freq,
            attention_factor,
            interleaved: cfg.interleaved,
        }
    }

    /// Inverse frequencies, one per rotated pair.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Whether pairs are `(2i, 2i+1)` (DeepSeek `rope_interleave`) rather than `(i, i + d/2)`.
    pub fn interleaved(&self) -> bool {
        self.interleaved
    }

    /// Row-major `[seq_len, inv_freq.len()]` host tables `(cos, sin)`, both scaled by the
    /// attention factor (YaRN's magnitude correction, 1 otherwise): the tables both engines
    /// rotate with.
    pub fn host_tables(&self, seq_len: usize) -> (Vec<f32>, Vec<f32>) {
        self.host_tables_at((0..seq_len).map(|p| p as u32))
    }

    /// [`Rope::host_tables`] for the given positions, one row each (the same values as
    /// the full table's rows at those positions).
    fn host_tables_at(
        &self,
        positions: impl ExactSizeIterator<Item = u32>,
    ) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for pos in positions {
            for &f in &self.inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * self.attention_factor);
                sin.push(angle.sin() * self.attention_factor);
            }
        }
        (cos, sin)
    }

    /// cos/sin of `positions` (`[batch, time]` row-major: each sequence at its own
    /// positions), for a step over a KV cache.
    pub fn tables_at(
        &self,
        positions: &[u32],
        batch: usize,
        time: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<PositionTables> {
        let half = self.inv_freq.len();
        let (cos, sin) = self.host_tables_at(positions.iter().copied());
        Ok(PositionTables {
            cos: Tensor::from_vec(cos, (batch, time, half), device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, (batch, time, half), device)?.to_dtype(dtype)?,
            interleaved: self.interleaved,
        })
    }

    /// cos/sin tables for positions `0..seq_len` in `dtype`.
    pub fn tables(&self, seq_len: usize, device: &Device, dtype: DType) -> Result<RopeTables> {
        let half = self.inv_freq.len();
        let (cos, sin) = self.host_tables(seq_len);
        let sin_t = Tensor::from_slice(&sin, (seq_len, half), device)?.to_dtype(dtype)?;
        Ok(RopeTables {
            cos: Tensor::from_slice(&cos, (seq_len, half), device)?.to_dtype(dtype)?,
            neg_sin: sin_t.neg()?,
            sin: sin_t,
            cos_host: Arc::new(cos),
            sin_host: Arc::new(sin),
            interleaved: self.interleaved,
        })
    }
}

/// Precomputed cos/sin for one forward pass.
#[derive(Debug, Clone)]
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    /// `−sin`: rotating by `−θ` (a GPU's backward).
    neg_sin: Tensor,
    /// The f32 tables on the host for the fused CPU op (`cos`/`sin` are these, converted).
    cos_host: Arc<Vec<f32>>,
    sin_host: Arc<Vec<f32>>,
    interleaved: bool,
}

impl RopeTables {
    /// Rotates `x` `[batch, heads, seq, dim]`.
    ///
    /// HF DeepSeek's interleaved variant permutes pairs to half-split before rotating;
    /// rotating pairs in place (`rope_i`) gives the same q·k since q and k share the permutation.
    /// On CPU in f32/f64 this is one fused op ([`RotaryOp`]) that reads `x` through its
    /// strides; on a GPU in f32 candle's rope kernel with a backward (`RotateBack`);
    /// elsewhere candle's composed ops.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        // A GPU's kernel and the composed ops take the tables as operands of `x`'s dtype;
        // the CPU's op reads its f32 host copies and would pass anything. Refused on every
        // device alike, so a mismatch shows in the CPU's tests too.
        if self.cos.dtype() != x.dtype() {
            return Err(ModelError::Input(format!(
                "rope: tables in {:?} for {:?} values (build them in the activations' dtype)",
                self.cos.dtype(),
                x.dtype()
            )));
        }
        if x.device().is_cuda() && x.dtype() == DType::F32 && x.rank() == 4 {
            return self.apply_kernel(x);
        }
        let fused = x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64);
        if fused && x.rank() == 4 {
            // The op reads rows through the strides but needs each row contiguous.
            let x = match x.stride().last() {
                Some(1) => x.clone(),
                _ => x.contiguous()?,
            };
            return Ok(x.apply_op1(RotaryOp {
                cos: self.cos_host.clone(),
                sin: self.sin_host.clone(),
                interleaved: self.interleaved,
            })?);
        }
        self.apply_composed(x)
    }

    /// candle's fused rope kernel (`rope` / `rope_i`, which has no backward) on detached
    /// `x`, in an op whose backward is the same kernel rotating the gradient back by `−θ`
    /// (the rotation's transpose). The composed `rope_slow` was ~7 kernels each way, ≈ 6 ms
    /// of a mid bf16 training step on an H200 (its kernel table). A GPU's path; on the CPU
    /// its tests hold it to the composed ops.
    pub fn apply_kernel(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let value = self.rope_kernel(&x.detach(), &self.sin)?;
        if !x.track_op() {
            return Ok(value);
        }
        Ok(x.apply_op1(RotateBack {
            value: Precomputed::new(value),
            tables: self.clone(),
        })?)
    }

    /// candle's rope kernel on contiguous `x` with `sin` (the tables' own or negated).
    fn rope_kernel(&self, x: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        if self.interleaved {
            candle_nn::rotary_emb::rope_i(x, &self.cos, sin)
        } else {
            candle_nn::rotary_emb::rope(x, &self.cos, sin)
        }
    }

    /// [`RopeTables::apply`] from candle's composed ops (other devices and dtypes, and the
    /// reference the fused op is tested against).
    pub fn apply_composed(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        if self.interleaved {
            Ok(candle_nn::rotary_emb::rope_i_slow(
                &x, &self.cos, &self.sin,
            )?)
        } else {
            Ok(candle_nn::rotary_emb::rope_slow(&x, &self.cos, &self.sin)?)
        }
    }
}

/// [`RopeTables::apply_kernel`]'s op: its value precomputed by candle's rope kernel, its
/// backward the kernel with `sin` negated.
#[derive(Debug)]
struct RotateBack {
    value: Precomputed,
    tables: RopeTables,
}

impl CustomOp1 for RotateBack {
    fn name(&self) -> &'static str {
        "rope-kernel"
    }

    precomputed_fwd!(1);

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        Ok(Some(self.tables.rope_kernel(&grad, &self.tables.neg_sin)?))
    }
}

/// What rotates q and k in an attention layer: the tables of positions `0..T` of a full
/// forward ([`RopeTables`]) or the positions of a step over a KV cache ([`PositionTables`]).
/// Cheap to clone (tensors share their storage), so a segment run again in a backward can
/// hold its own.
pub trait Rotary: Clone + Send + Sync + 'static {
    /// Rotates `x` `[batch, heads, seq, dim]`.
    fn rotate(&self, x: &Tensor) -> Result<Tensor>;

    /// Rotates `x` and rounds the result at `precision` (the rounding point after RoPE).
    fn rotate_rounded(&self, x: &Tensor, precision: Precision) -> Result<Tensor> {
        precision.round(&self.rotate(x)?)
    }
}

impl Rotary for RopeTables {
    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x)
    }
}

/// cos/sin `[batch, time, dim / 2]` of each sequence's own positions (one step of
/// incremental decoding, where the sequences of a batch sit at different positions).
#[derive(Debug, Clone)]
pub struct PositionTables {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl Rotary for PositionTables {
    /// candle's rope kernels (CPU, CUDA), which take per-sequence `[B, T, D/2]` tables.
    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        if self.interleaved {
            Ok(candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)?)
        } else {
            Ok(candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)?)
        }
    }

    /// In bf16 / f16 with nothing differentiated, the rotation and its rounding in one op
    /// (`rope_rounded`: the same values, one kernel on a GPU where they were two).
    fn rotate_rounded(&self, x: &Tensor, precision: Precision) -> Result<Tensor> {
        if let Some(narrow) = precision.narrow_dtype() {
            if let Some(y) = rope_rounded(x, &self.cos, &self.sin, self.interleaved, narrow)? {
                return Ok(y);
            }
        }
        precision.round(&self.rotate(x)?)
    }
}
