//! The engine's compute precision: which float type weights are stored in, which activations
//! are rounded to it and where, and the router's precision.

use std::fmt;
use std::str::FromStr;

use r3_model::WeightPrecision;

use crate::error::RolloutError;

/// Precision of the rollout engine.
///
/// * `F32`: full precision everywhere (reproduces the HF oracle).
/// * `F16`: f16 weights; matmul inputs and outputs rounded to f16 (f32 accumulation); norms,
///   residual stream, attention and sampling in f32 between matmuls.
/// * `Bf16`: bf16 weights (norm scales included) and every activation rounded to bf16 at the
///   op boundaries where SGLang / vLLM keep tensors in bf16: embeddings, norm outputs,
///   projection outputs (bias added before rounding), rotated q/k (the KV cache), attention
///   output, SwiGLU output, expert and MoE block outputs, and the residual stream after every
///   addition. Inside an op the math is f32 (matmul accumulation, norm statistics, softmax).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dtype {
    /// Half precision weights and matmul inputs/outputs (accumulation in f32): the fast mode.
    #[default]
    F16,
    /// Full precision everywhere: reproduces the HF oracle.
    F32,
    /// bf16 weights and activations at the boundaries SGLang / vLLM use (see the type docs).
    Bf16,
}

impl Dtype {
    /// The precision whose finite range every weight must lie in for this engine: f16 and
    /// bf16 engines hold (or round to) their weights in that format, so a value past its
    /// range would turn into ±inf.
    pub fn weight_precision(self) -> WeightPrecision {
        match self {
            Dtype::F16 => WeightPrecision::F16,
            Dtype::Bf16 => WeightPrecision::Bf16,
            Dtype::F32 => WeightPrecision::F32,
        }
    }

    /// Bytes of one value stored in this dtype (a packed weight, a cached key or value).
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// Rounds activations to this dtype where the engine keeps them in it between ops: bf16
    /// only (f16 mode rounds around matmuls alone, f32 never).
    #[inline]
    pub fn round_activations(self, v: &mut [f32]) {
        if self == Dtype::Bf16 {
            round_to_bf16(v);
        }
    }
}

/// Rounds every value to the nearest bf16 (ties to even), in place; the same values as
/// `half::bf16::from_f32` (NaN stays a quiet NaN, overflow goes to infinity), computed on the
/// bits without branches so the loop vectorises (it runs at every op boundary).
pub fn round_to_bf16(v: &mut [f32]) {
    for x in v.iter_mut() {
        *x = f32::from_bits(bf16_round_bits(x.to_bits()));
    }
}

/// The bits of the bf16 nearest to `v`: `half::bf16::from_f32(v).to_bits()`, branch-free.
#[inline(always)]
pub(crate) fn bf16_bits(v: f32) -> u16 {
    (bf16_round_bits(v.to_bits()) >> 16) as u16
}

/// The f32 bits of the bf16 nearest to the f32 with bits `b`.
#[inline(always)]
fn bf16_round_bits(b: u32) -> u32 {
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    let quiet_nan = (b | 0x0040_0000) & 0xFFFF_0000;
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

impl FromStr for Dtype {
    type Err = RolloutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" | "float16" => Ok(Dtype::F16),
            "f32" | "float32" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            other => Err(RolloutError::InvalidConfig(format!(
                "unknown dtype {other:?}: expected f16, bf16 or f32"
            ))),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        })
    }
}

/// Precision of the MoE router (gate) matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouterDtype {
    /// The gate runs in the engine dtype like every other projection, its logits rounded to
    /// it (vLLM / SGLang's default gate).
    #[default]
    Model,
    /// An fp32 router: f32 gate weights, the (already rounded) hidden state widened to f32,
    /// f32 logits (Megatron's `moe_router_dtype = fp32`, SGLang's fp32 gate option).
    F32,
}

impl FromStr for RouterDtype {
    type Err = RolloutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "model" | "bf16" | "f16" => Ok(RouterDtype::Model),
            "f32" | "fp32" | "float32" => Ok(RouterDtype::F32),
            other => Err(RolloutError::InvalidConfig(format!(
                "unknown router dtype {other:?}: expected bf16 (the model dtype) or f32"
            ))),
        }
    }
}

impl fmt::Display for RouterDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RouterDtype::Model => "model",
            RouterDtype::F32 => "f32",
        })
    }
}

/// What the CPU engine's KV cache stores keys and values in (SGLang's `--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The engine's own dtype, as an f16 / bf16 GPU engine's cache holds them (SGLang's and
    /// vLLM's `auto`): an f16 engine rounds keys to f16 after RoPE.
    #[default]
    Auto,
    /// This dtype whatever the engine's: `f32` keeps an f16 engine's keys exact (twice the
    /// memory and the attention's reads).
    Fixed(Dtype),
}

impl KvCacheDtype {
    /// The dtype the cache of an engine computing in `engine` holds.
    pub fn resolve(self, engine: Dtype) -> Dtype {
        match self {
            KvCacheDtype::Auto => engine,
            KvCacheDtype::Fixed(d) => d,
        }
    }
}

impl FromStr for KvCacheDtype {
    type Err = RolloutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            return Ok(KvCacheDtype::Auto);
        }
        s.parse::<Dtype>().map(KvCacheDtype::Fixed).map_err(|_| {
            RolloutError::InvalidConfig(format!(
                "unknown KV cache dtype {s:?}: expected auto (the engine's dtype), f16, bf16 or f32"
            ))
        })
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvCacheDtype::Auto => f.write_str("auto"),
            KvCacheDtype::Fixed(d) => d.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_dtypes_parse_print_and_resolve() {
        for text in ["auto", "f16", "bf16", "f32"] {
            let d: KvCacheDtype = text.parse().expect("known");
            assert_eq!(d.to_string(), text);
        }
        assert_eq!(KvCacheDtype::Auto.resolve(Dtype::Bf16), Dtype::Bf16);
        let f32_cache: KvCacheDtype = "float32".parse().expect("alias");
        assert_eq!(f32_cache.resolve(Dtype::F16), Dtype::F32);
        let err = "fp8".parse::<KvCacheDtype>().expect_err("unknown");
        assert!(err.to_string().contains("fp8"), "{err}");
    }

    #[test]
    fn bf16_rounding_keeps_eight_significant_bits_ties_to_even() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
        let mut v = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 3.0, -0.1];
        round_to_bf16(&mut v);
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], 1.0 + 2f32.powi(-6));
        assert_eq!(v[2], 3.0);
        // -0.1 = -0x3DCCCCCD: the upper 16 bits 0xBDCD after rounding up the 0xCCCD tail.
        assert_eq!(v[3].to_bits(), 0xBDCD_0000);
    }

    #[test]
    fn bit_rounding_equals_half_on_edge_cases_and_a_sweep() {
        let mut values = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            3.3961514e38,
        ];
        // A sweep over exponents and low mantissa bits, ties included.
        values.extend((0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B1))));
        let mut got = values.clone();
        round_to_bf16(&mut got);
        for (v, g) in values.iter().zip(&got) {
            let want = half::bf16::from_f32(*v).to_f32();
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "{v:e} ({:#x}): {g:e} vs half {want:e}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn only_bf16_rounds_activations() {
        let x = 1.0 + 2f32.powi(-10);
        for (d, want) in [(Dtype::F32, x), (Dtype::F16, x), (Dtype::Bf16, 1.0)] {
            let mut v = [x];
            d.round_activations(&mut v);
            assert_eq!(v[0], want, "{d}");
        }
        assert_eq!("bf16".parse::<Dtype>().ok(), Some(Dtype::Bf16));
        assert_eq!("f32".parse::<RouterDtype>().ok(), Some(RouterDtype::F32));
        assert!("f8".parse::<Dtype>().is_err());
    }
}
