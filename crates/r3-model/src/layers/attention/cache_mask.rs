//! A step's mask over a KV cache as its attention layers read it: each query row's runs of
//! seen slots on the device where the caller gave them (the decode kernel reads those, so a
//! step it takes builds no mask), and the additive `[B, 1, 1, T, S]` mask that the composed
//! attention adds to its scores, built the first time a layer asks for it and then shared
//! by every layer of the step.

use std::cell::OnceCell;

use candle_core::Tensor;

use crate::error::{ModelError, Result};

/// Builds a step's additive mask (from its runs, where it runs).
type BuildMask<'a> = Box<dyn Fn() -> Result<Tensor> + 'a>;

/// Which cache slots each query row of a step sees.
pub struct CacheMask<'a> {
    /// u32 `[B · T, 4]`: each query row's two half-open runs (`from, to, from, to`),
    /// checked against the step's slots.
    seen: Option<Tensor>,
    /// The additive mask, once built.
    additive: OnceCell<Tensor>,
    /// How to build it where it is not yet.
    build: Option<BuildMask<'a>>,
}

impl<'a> CacheMask<'a> {
    /// A mask given as its additive values `[B, 1, 1, T, S]`.
    pub fn from_additive(additive: Tensor) -> Self {
        CacheMask {
            seen: None,
            additive: OnceCell::from(additive),
            build: None,
        }
    }

    /// A mask given as each query row's runs of seen slots (u32 `[B · T, 4]`, checked by
    /// the caller: every row sees at least one slot and none past the step's), its additive
    /// form built by `build` where a layer asks for it.
    pub fn from_seen(seen: Tensor, build: impl Fn() -> Result<Tensor> + 'a) -> Self {
        CacheMask {
            seen: Some(seen),
            additive: OnceCell::new(),
            build: Some(Box::new(build)),
        }
    }

    /// The runs of seen slots, where the mask was given as runs.
    pub fn seen(&self) -> Option<&Tensor> {
        self.seen.as_ref()
    }

    /// The additive mask `[B, 1, 1, T, S]`, built at the first call.
    pub fn additive(&self) -> Result<&Tensor> {
        if let Some(mask) = self.additive.get() {
            return Ok(mask);
        }
        let build = self
            .build
            .as_ref()
            .ok_or_else(|| ModelError::Input("a step's mask with nothing to build".into()))?;
        let mask = build()?;
        Ok(self.additive.get_or_init(|| mask))
    }

    /// Whether the additive mask has been built (a step the decode kernel took in every
    /// layer never builds it).
    pub fn is_built(&self) -> bool {
        self.additive.get().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use std::cell::Cell;

    /// Runs give their mask only when asked, built once and then shared; a mask given as
    /// values has no runs and is those values.
    #[test]
    fn the_additive_mask_is_built_once_where_asked() {
        let builds = Cell::new(0);
        let runs = Tensor::zeros((2, 4), DType::U32, &Device::Cpu).expect("runs");
        let mask = CacheMask::from_seen(runs, || {
            builds.set(builds.get() + 1);
            Ok(Tensor::ones((1, 1, 1, 2, 3), DType::F32, &Device::Cpu)?)
        });
        assert!(mask.seen().is_some() && !mask.is_built());
        assert_eq!(builds.get(), 0);
        for _ in 0..3 {
            assert_eq!(mask.additive().expect("built").dims(), &[1, 1, 1, 2, 3]);
        }
        assert!(mask.is_built());
        assert_eq!(builds.get(), 1, "built once for every layer");
        let values = Tensor::zeros((1, 1, 1, 1, 5), DType::F32, &Device::Cpu).expect("mask");
        let given = CacheMask::from_additive(values);
        assert!(given.seen().is_none() && given.is_built());
        assert_eq!(given.additive().expect("given").dims(), &[1, 1, 1, 1, 5]);
    }

    /// A build that fails fails the layer that asked, with its error.
    #[test]
    fn a_failed_build_is_the_callers_error() {
        let runs = Tensor::zeros((1, 4), DType::U32, &Device::Cpu).expect("runs");
        let mask = CacheMask::from_seen(runs, || Err(ModelError::Input("too big".into())));
        let err = mask.additive().expect_err("failed").to_string();
        assert!(err.contains("too big"), "{err}");
        assert!(!mask.is_built());
    }
}
