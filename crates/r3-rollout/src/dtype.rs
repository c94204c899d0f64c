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

pub(crate) use r3_model::round16::bf16_bits;
pub use r3_model::round16::round_to_bf16;

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

impl RouterDtype {
    /// The router precision `text` names for an engine computing in `engine`: `model`, or
    /// the engine dtype's own name, is the engine dtype; `f32` (`fp32`, `float32`) an f32
    /// router. Another dtype's name is an error: the router runs in the model dtype or in
    /// f32, so `bf16` next to an f32 or f16 engine would be silently replaced by the
    /// engine's dtype.
    pub fn parse_for(text: &str, engine: Dtype) -> Result<Self, RolloutError> {
        let router = text.parse::<RouterDtype>()?;
        // `f32` always parses to `F32` (an f32 engine's `Model` router is the same gate);
        // a named 16-bit dtype is the engine's only when the engine computes in it.
        if router == RouterDtype::Model && text != "model" {
            let named = text.parse::<Dtype>()?;
            if named != engine {
                return Err(RolloutError::InvalidConfig(format!(
                    "router dtype {text:?} is not the engine dtype ({engine}): the router runs \
                     in the model dtype (`model`, here {engine}) or in f32"
                )));
            }
        }
        Ok(router)
    }
}

/// Parses without knowing the engine's dtype: `bf16` / `f16` are taken as the engine's own
/// (`Model`) whatever it is, so callers that know the engine dtype use
/// [`RouterDtype::parse_for`], which refuses one that differs.
impl FromStr for RouterDtype {
    type Err = RolloutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "model" | "bf16" | "bfloat16" | "f16" | "float16" => Ok(RouterDtype::Model),
            "f32" | "fp32" | "float32" => Ok(RouterDtype::F32),
            other => Err(RolloutError::InvalidConfig(format!(
                "unknown router dtype {other:?}: expected `model` (the engine dtype, or its \
                 name: f16 / bf16) or f32"
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

    /// A router dtype named next to an engine of another dtype would run in the engine's:
    /// refused, and the message says which dtypes the router can run in.
    #[test]
    fn a_named_router_dtype_must_be_the_engines() {
        use RouterDtype::{Model, F32};
        let ok = [
            ("model", Dtype::F32, Model),
            ("model", Dtype::Bf16, Model),
            ("bf16", Dtype::Bf16, Model),
            ("f16", Dtype::F16, Model),
            ("f32", Dtype::F32, F32),
            ("f32", Dtype::Bf16, F32),
            ("fp32", Dtype::F16, F32),
        ];
        for (text, engine, want) in ok {
            let got = RouterDtype::parse_for(text, engine).expect(text);
            assert_eq!(got, want, "{text} on {engine}");
        }
        for (text, engine) in [
            ("bf16", Dtype::F32),
            ("bf16", Dtype::F16),
            ("f16", Dtype::Bf16),
            ("f16", Dtype::F32),
        ] {
            let err = RouterDtype::parse_for(text, engine)
                .expect_err(text)
                .to_string();
            assert!(err.contains(text) && err.contains("model dtype"), "{err}");
            assert!(
                err.contains(&engine.to_string()) && err.contains("f32"),
                "{err}"
            );
        }
        let err = RouterDtype::parse_for("fp8", Dtype::Bf16).expect_err("unknown");
        assert!(!err.to_string().contains("bf16 (the model dtype)"), "{err}");
    }
}
