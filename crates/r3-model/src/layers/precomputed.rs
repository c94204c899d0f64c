//! The forward value of a custom op computed before the op from candle's own ops, outside
//! the autograd graph, and handed to the op once.
//!
//! candle keeps every input of every op alive until the backward. An op composed of many
//! candle ops therefore keeps all its intermediates (attention's scores, masked scores,
//! exponentials and probabilities; log-softmax's shifted and exponentiated logits), where
//! its backward needs only its inputs. Computing the value on detached inputs first and
//! wrapping it in a custom op whose backward recomputes what it needs makes the graph keep
//! the inputs alone, on every device, with the same forward arithmetic (the same candle
//! ops) as the composed form.

use std::sync::Mutex;

use candle_core::{CpuStorage, Shape, Storage, Tensor};

/// A forward value waiting for its op's `fwd` (taken once).
#[derive(Debug)]
pub struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    /// Holds `value` (detached: it is a value, not part of the graph).
    pub fn new(value: Tensor) -> Self {
        Precomputed(Mutex::new(Some(value.detach())))
    }

    /// No value yet (an op being built).
    pub fn empty() -> Self {
        Precomputed(Mutex::new(None))
    }

    /// The value, contiguous from the start of its own storage (what a custom op returns:
    /// candle reads the returned storage from its start in row-major order, whatever view
    /// it came from).
    fn take(&self, op: &str) -> candle_core::Result<Tensor> {
        let value = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{op}: precomputed value poisoned")))?
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("{op}: precomputed value already used"))
            })?;
        let layout = value.layout();
        if layout.is_contiguous() && layout.start_offset() == 0 {
            Ok(value)
        } else {
            // The view's elements alone, in order (`copy` would clone the whole storage and
            // keep the view's offset and strides, which the op's output does not carry).
            value.force_contiguous()
        }
    }

    /// The value as CPU storage and its shape.
    pub fn cpu(&self, op: &str) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let value = self.take(op)?;
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{op}: precomputed value is not on the CPU"),
        }
    }

    /// The value as CUDA storage and its shape.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self, op: &str) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let value = self.take(op)?;
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{op}: precomputed value is not on the GPU"),
        }
    }
}

/// The `cpu_fwd` and `cuda_fwd` of a custom op whose value is its [`Precomputed`] field
/// `value`, for ops of 1, 2 or 3 arguments: `precomputed_fwd!(2);` inside `impl CustomOp2`.
macro_rules! precomputed_fwd {
    (1) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.value.cpu(self.name())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.value.cuda(self.name())
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.value.cpu(self.name())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.value.cuda(self.name())
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.value.cpu(self.name())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.value.cuda(self.name())
        }
    };
}
pub(crate) use precomputed_fwd;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CustomOp1, Device};

    /// An op whose value is precomputed.
    struct Given {
        value: Precomputed,
    }

    impl CustomOp1 for Given {
        fn name(&self) -> &'static str {
            "given"
        }

        precomputed_fwd!(1);
    }

    /// A value that is a view (an offset into its storage, or strided) comes out of the op
    /// as the view's values: the op's output is read from its storage's start.
    #[test]
    fn a_view_comes_out_as_its_values() {
        let base = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .and_then(|t| t.reshape((4, 6)))
            .expect("base");
        let offset = base.narrow(0, 2, 2).expect("rows 2..4");
        let strided = base.narrow(1, 1, 3).expect("columns 1..4");
        let x = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu).expect("x");
        for view in [offset, strided] {
            let op = Given {
                value: Precomputed::new(view.clone()),
            };
            let got = x.apply_op1_no_bwd(&op).expect("op");
            assert_eq!(got.dims(), view.dims());
            assert_eq!(
                got.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("got"),
                view.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("want")
            );
        }
    }
}
