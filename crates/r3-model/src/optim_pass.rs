//! The GPU half of the training engine's fused AdamW pass: one kernel per parameter tensor
//! (`r3_adamw_f32` in `cuda/kernels.cu`) reads θ, g, m, v once and writes the staged θ', m',
//! v' and the largest |θ'|, |m'|, |v'| the guard checks, where candle's composed ops took
//! about seventeen kernels and a host round trip for each of three or four checks per tensor.
//! The CPU half, the guard and the commit are r3-train's (`algo/fused_optim.rs`,
//! `algo/optim.rs`); the kernel is here because this crate builds r3's CUDA kernels. Its
//! arithmetic is the CPU pass's operation for operation, so a GPU update equals a CPU update
//! bit for bit. A gradient a backward kept in bf16 / f16 (`train.narrow_gradients`) is read
//! as it is and widened in the kernel (exact): no widened copy and its pass, 6 bytes a
//! parameter (at 5.6 B parameters ≈ 34 GB of memory traffic a step), and 2 bytes less read.

use candle_core::Tensor;

use crate::error::Result;

/// AdamW's constants for one tensor's pass, each rounded to f32 where candle's `affine`
/// rounds it (r3-train makes them from its parameters and the step).
#[derive(Debug, Clone, Copy)]
pub struct AdamWPassConstants {
    /// β1.
    pub beta1: f32,
    /// 1 − β1.
    pub one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// 1 − β2.
    pub one_minus_beta2: f32,
    /// 1 / (1 − β1ᵗ).
    pub inv_bc1: f32,
    /// 1 / (1 − β2ᵗ).
    pub inv_bc2: f32,
    /// The denominator's epsilon.
    pub eps: f32,
    /// The learning rate.
    pub lr: f32,
    /// 1 − lr·wd for a decayed tensor, `None` for one left undecayed.
    pub decay: Option<f32>,
    /// The gradient-clip factor, `None` when the gradients are not clipped.
    pub grad_scale: Option<f32>,
    /// The key of the stochastic rounding of a bf16 θ' (`stochastic_round::rounding_key`;
    /// unread for an f32 θ).
    pub rounding_key: u64,
    /// The keys of the stochastic rounding of bf16 m' and v' (unread for f32 moments).
    pub moment_keys: [u64; 2],
}

/// One tensor's update staged on its GPU: the new θ, m and v (nothing written to the
/// variable or the old moments yet) and `maxima`, a `[3]` u32 device tensor of the bit
/// patterns of the largest |θ'|, |m'| and |v'| (any at or above the bits of +∞ means a NaN
/// or an infinity).
#[derive(Debug)]
pub struct StagedOnDevice {
    /// θ'.
    pub theta: Tensor,
    /// m'.
    pub m: Tensor,
    /// v'.
    pub v: Tensor,
    /// The three maxima as bit patterns.
    pub maxima: Tensor,
    /// θ' rounded to the held 16-bit copy's dtype, where the pass was asked for one.
    pub copy: Option<Tensor>,
}

/// The fused pass over one tensor on a GPU: `None` where it does not apply (a tensor off a
/// GPU, θ not f32 or bf16, m and v not both f32 or both bf16, a gradient not f32, bf16 or
/// f16 — nor f16 for a bf16 θ —, or the four of different lengths), and the caller composes
/// candle's ops. A bf16 θ (weights held without an f32 master) is read widened and θ' rounded
/// to bf16 stochastically by `k.rounding_key`'s draws, bf16 moments by `k.moment_keys`', the
/// CPU pass's bits. `copy` (bf16 / f16), for a trainer
/// holding a 16-bit copy of θ: the pass also writes θ' rounded to it (the values of
/// `cast16(θ')`), so the copy is not rewritten by a second pass reading θ again.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn adamw_pass_on_device(
    theta: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    k: &AdamWPassConstants,
    copy: Option<candle_core::DType>,
) -> Result<Option<StagedOnDevice>> {
    #[cfg(feature = "cuda")]
    {
        let n = theta.elem_count();
        use candle_core::DType;
        // θ, m and v f32; the gradient f32, or 16-bit as a backward kept it (read widened).
        let applies = matches!(m.dtype(), DType::F32 | DType::BF16)
            && v.dtype() == m.dtype()
            && match theta.dtype() {
                DType::F32 => matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16),
                DType::BF16 => matches!(g.dtype(), DType::F32 | DType::BF16) && copy.is_none(),
                _ => false,
            }
            && [theta, g, m, v]
                .iter()
                .all(|t| t.device().is_cuda() && t.elem_count() == n)
            && n > 0;
        if applies {
            return gpu::pass(theta, g, m, v, k, copy).map(Some);
        }
    }
    Ok(None)
}

/// Commits a staged θ' (or its staged 16-bit copy) into its variable on a GPU by handing
/// the staged buffer to the variable in place of its own (every holder of the variable sees
/// the new values; nothing is copied: `Var::set` copied 8 bytes a parameter of θ, ≈ 45 GB a
/// step at 5.6 B parameters). `staged` comes back where this does not apply (off a GPU,
/// other dtypes or shapes, a variable that is a view of a larger buffer), for the caller
/// to copy.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn swap_staged_into(var: &Tensor, staged: Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if gpu::swappable(var, &staged)? {
        gpu::swap(var, staged)?;
        return Ok(None);
    }
    Ok(Some(staged))
}

/// Σ g² over the gradient tensors `grads` on a GPU, the global gradient norm's square: each
/// tensor's squares summed in one read of it (`r3_sum_squares_*` in `cuda/kernels.cu`: f32,
/// bf16 or f16 gradients, each value widened and squared in f32, the squares added in f64
/// within a tensor), the tensors' sums added in their order in f32, one value read back. candle's
/// composed `sqr()?.sum_all()` wrote every square to a temporary and read it again, after
/// widening a 16-bit gradient into another: 12 bytes an f32 parameter and 18 a bf16 one of
/// memory traffic, where this reads 4 or 2, and no temporary as large as the largest tensor.
/// `None` where it does not apply (a build without `cuda`, no tensors, a tensor off a GPU or
/// on another GPU than the first, or of another dtype), and the caller composes candle's ops.
/// Deterministic: the same gradients give the same bits.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn sum_of_squares_on_device(grads: &[&Tensor]) -> Result<Option<f32>> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        let Some(first) = grads.first() else {
            return Ok(None);
        };
        let applies = grads.iter().all(|g| {
            g.device().same_device(first.device())
                && g.device().is_cuda()
                && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
        });
        if applies {
            return gpu::sum_of_squares(grads).map(Some);
        }
    }
    Ok(None)
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Mutex;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtrMut};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, DType, InplaceOp1, Layout, Storage, Tensor};

    use super::{AdamWPassConstants, StagedOnDevice};
    use crate::cuda;
    use crate::error::{ModelError, Result};

    /// The launch: contiguous views of the four inputs, three fresh outputs, zeroed maxima.
    pub(super) fn pass(
        theta: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        k: &AdamWPassConstants,
        copy: Option<DType>,
    ) -> Result<StagedOnDevice> {
        let n = theta.elem_count();
        let [theta_c, g_c, m_c, v_c] = [theta, g, m, v].map(Tensor::contiguous);
        let (theta_c, g_c, m_c, v_c) = (theta_c?, g_c?, m_c?, v_c?);
        let (st, lt) = theta_c.storage_and_layout();
        let (sg, lg) = g_c.storage_and_layout();
        let (sm, lm) = m_c.storage_and_layout();
        let (sv, lv) = v_c.storage_and_layout();
        let (Storage::Cuda(st), Storage::Cuda(sg), Storage::Cuda(sm), Storage::Cuda(sv)) =
            (&*st, &*sg, &*sm, &*sv)
        else {
            return Err(ModelError::Input(
                "the fused AdamW pass on a GPU got a tensor off the GPU".into(),
            ));
        };
        let dev = cuda::device(st);
        let maxima = dev.alloc_zeros::<u32>(3)?;
        let (n64, decay, scale) = (
            n as u64,
            k.decay.unwrap_or(1.0),
            k.grad_scale.unwrap_or(1.0),
        );
        let (use_decay, use_scale) = (
            u32::from(k.decay.is_some()),
            u32::from(k.grad_scale.is_some()),
        );
        // The staged 16-bit copy, where one is asked for (`copy_code` 0 none, 1 bf16, 2 f16).
        let stream = dev.cuda_stream();
        let mut copy_out = match copy {
            // SAFETY: the kernel writes every element (its loop covers n) when asked to.
            Some(DType::BF16) => Some(StagedCopy::Bf16(unsafe { dev.alloc::<half::bf16>(n)? })),
            Some(DType::F16) => Some(StagedCopy::F16(unsafe { dev.alloc::<half::f16>(n)? })),
            None => None,
            Some(other) => {
                return Err(ModelError::Input(format!(
                    "AdamW's pass writes a bf16 or f16 copy of θ, not {other:?}"
                )))
            }
        };
        // The kernel writes the copy: its guard records a write.
        let (copy_ptr, copy_guard, copy_code) = match &mut copy_out {
            Some(StagedCopy::Bf16(c)) => {
                let (ptr, guard) = c.device_ptr_mut(&stream);
                (cuda::DeviceAddr(ptr), Some(guard), 1u32)
            }
            Some(StagedCopy::F16(c)) => {
                let (ptr, guard) = c.device_ptr_mut(&stream);
                (cuda::DeviceAddr(ptr), Some(guard), 2u32)
            }
            None => (cuda::DeviceAddr(0), None, 0u32),
        };
        // The kernel for θ's, the gradient's and the moments' dtypes (their pointers' types
        // are all that differs); θ', m' and v' come out in their inputs' dtypes.
        let moments_bf16 = m.dtype() == DType::BF16;
        macro_rules! launch_pass {
            ($name:expr, $param:ty, $moment:ty, $grad:expr) => {{
                let vt = cuda::view::<$param>(st, lt, "θ")?;
                let vm = cuda::view::<$moment>(sm, lm, "first moment")?;
                let vv = cuda::view::<$moment>(sv, lv, "second moment")?;
                // SAFETY: the kernel writes every element of the three outputs (its loop
                // covers n).
                let (theta_out, m_out, v_out) = unsafe {
                    (
                        dev.alloc::<$param>(n)?,
                        dev.alloc::<$moment>(n)?,
                        dev.alloc::<$moment>(n)?,
                    )
                };
                let vg = $grad;
                let name: &str = $name;
                let (func, stream) = cuda::kernel(&dev, name)?;
                let mut launch = cuda::CheckedLaunch::new(&stream, &func, name);
                launch
                    .arg(&vt)
                    .arg(&vg)
                    .arg(&vm)
                    .arg(&vv)
                    .arg(&theta_out)
                    .arg(&m_out)
                    .arg(&v_out)
                    .arg(&maxima)
                    .arg(&n64)
                    .arg(&k.beta1)
                    .arg(&k.one_minus_beta1)
                    .arg(&k.beta2)
                    .arg(&k.one_minus_beta2)
                    .arg(&k.inv_bc1)
                    .arg(&k.inv_bc2)
                    .arg(&k.eps)
                    .arg(&k.lr)
                    .arg(&decay)
                    .arg(&scale)
                    .arg(&use_decay)
                    .arg(&use_scale)
                    .arg(&copy_ptr)
                    .arg(&copy_code)
                    .arg(&k.rounding_key)
                    .arg(&k.moment_keys[0])
                    .arg(&k.moment_keys[1]);
                // SAFETY: the arguments are the AdamW kernels' signature (`ADAMW_KERNEL` in
                // kernels.cu, θ's, the gradient's and the moments' types by the name), the
                // views hold n elements.
                unsafe { launch.launch(cuda::elementwise(n)) }?;
                (
                    CudaStorage::wrap_cuda_slice(theta_out, dev.clone()),
                    CudaStorage::wrap_cuda_slice(m_out, dev.clone()),
                    CudaStorage::wrap_cuda_slice(v_out, dev.clone()),
                )
            }};
        }
        macro_rules! launch {
            ($base:expr, $param:ty, $grad:expr) => {{
                match moments_bf16 {
                    true => launch_pass!(&format!("{}_mbf16", $base), $param, half::bf16, $grad),
                    false => launch_pass!($base, $param, f32, $grad),
                }
            }};
        }
        let (theta_out, m_out, v_out) = match (theta.dtype(), g.dtype()) {
            (DType::BF16, DType::BF16) => launch!(
                "r3_adamw_bf16_grad_bf16",
                half::bf16,
                cuda::view::<half::bf16>(sg, lg, "gradient")?
            ),
            (DType::BF16, _) => launch!(
                "r3_adamw_bf16",
                half::bf16,
                cuda::view::<f32>(sg, lg, "gradient")?
            ),
            (_, DType::BF16) => launch!(
                "r3_adamw_f32_grad_bf16",
                f32,
                cuda::view::<half::bf16>(sg, lg, "gradient")?
            ),
            (_, DType::F16) => launch!(
                "r3_adamw_f32_grad_f16",
                f32,
                cuda::view::<half::f16>(sg, lg, "gradient")?
            ),
            _ => launch!("r3_adamw_f32", f32, cuda::view::<f32>(sg, lg, "gradient")?),
        };
        // The copy's write is recorded on the stream now that the kernel is queued.
        drop(copy_guard);
        let shape = theta.shape().clone();
        let wrap = |storage: CudaStorage| {
            Tensor::from_storage(
                Storage::Cuda(storage),
                shape.clone(),
                BackpropOp::none(),
                false,
            )
        };
        Ok(StagedOnDevice {
            theta: wrap(theta_out),
            m: wrap(m_out),
            v: wrap(v_out),
            maxima: Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(maxima, dev.clone())),
                3,
                BackpropOp::none(),
                false,
            ),
            copy: copy_out.map(|c| {
                let storage = match c {
                    StagedCopy::Bf16(c) => CudaStorage::wrap_cuda_slice(c, dev.clone()),
                    StagedCopy::F16(c) => CudaStorage::wrap_cuda_slice(c, dev.clone()),
                };
                Tensor::from_storage(
                    Storage::Cuda(storage),
                    theta.shape().clone(),
                    BackpropOp::none(),
                    false,
                )
            }),
        })
    }

    /// [`super::sum_of_squares_on_device`] (its conditions checked): one launch per tensor
    /// into one buffer of f64 partial sums, one launch adding them up, one f32 read back.
    pub(super) fn sum_of_squares(grads: &[&Tensor]) -> Result<f32> {
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let blocks: Vec<u32> = grads
            .iter()
            .map(|g| crate::launch_shape::sum_squares_blocks(g.elem_count()))
            .collect();
        let mut offsets = Vec::with_capacity(blocks.len() + 1);
        let mut at = 0u32;
        offsets.push(at);
        for &b in &blocks {
            at = at.checked_add(b).ok_or_else(|| {
                ModelError::Input("the gradient norm's partial sums exceed 2³² blocks".into())
            })?;
            offsets.push(at);
        }
        let mut dev = None;
        let mut partials = None;
        for ((g, &count), &first) in grads.iter().zip(&blocks).zip(&offsets) {
            let g = g.contiguous()?;
            let (storage, layout) = g.storage_and_layout();
            let Storage::Cuda(cs) = &*storage else {
                return Err(ModelError::Input(
                    "the gradient norm on a GPU got a gradient off the GPU".into(),
                ));
            };
            let dev = dev.get_or_insert_with(|| cuda::device(cs)).clone();
            let partials = match &mut partials {
                Some(p) => p,
                None => partials.insert(dev.alloc_zeros::<f64>(at as usize)?),
            };
            let n = g.elem_count() as u64;
            let cfg = LaunchConfig {
                grid_dim: (count, 1, 1),
                block_dim: (crate::launch_shape::SUM_SQUARES_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // The kernel of the gradient's dtype, over a view of that element type.
            macro_rules! launch_squares {
                ($name:literal, $ty:ty) => {{
                    let (func, stream) = cuda::kernel(&dev, $name)?;
                    let mut launch = cuda::CheckedLaunch::new(&stream, &func, $name);
                    let view = cuda::view::<$ty>(cs, layout, "gradient")?;
                    launch.arg(&view).arg(&n).arg(&*partials).arg(&first);
                    // SAFETY: the arguments are `r3_sum_squares_*`'s signature; the view holds
                    // n values and the partials buffer `first + count` at least (`offsets`).
                    unsafe { launch.launch(cfg) }?;
                }};
            }
            match cs.dtype() {
                DType::BF16 => launch_squares!("r3_sum_squares_bf16", half::bf16),
                DType::F16 => launch_squares!("r3_sum_squares_f16", half::f16),
                _ => launch_squares!("r3_sum_squares_f32", f32),
            }
        }
        let (Some(dev), Some(partials)) = (dev, partials) else {
            return Err(ModelError::Input(
                "the gradient norm got no gradients".into(),
            ));
        };
        let tensors = u32::try_from(grads.len())
            .map_err(|_| ModelError::Input("more than 2³² gradient tensors".into()))?;
        let stream = dev.cuda_stream();
        let offsets_dev = stream.clone_htod(&offsets).w()?;
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (crate::launch_shape::SUM_SQUARES_TOTAL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let total = cuda::launch_f32!(
            dev.clone(),
            "r3_sum_squares_total",
            1,
            one_block,
            [partials.slice(..), offsets_dev.slice(..), tensors],
            []
        );
        let total = Tensor::from_storage(Storage::Cuda(total), 1, BackpropOp::none(), false);
        total
            .to_vec1::<f32>()?
            .first()
            .copied()
            .ok_or_else(|| ModelError::Input("the gradient norm's total came back empty".into()))
    }

    /// A staged 16-bit copy of θ'.
    enum StagedCopy {
        Bf16(CudaSlice<half::bf16>),
        F16(CudaSlice<half::f16>),
    }

    /// Whether [`swap`] applies: both on a GPU in one dtype (f32, bf16 or f16), the same
    /// shape, each contiguous over the whole of its own buffer.
    pub(super) fn swappable(var: &Tensor, staged: &Tensor) -> Result<bool> {
        if var.dtype() != staged.dtype() || var.dims() != staged.dims() {
            return Ok(false);
        }
        let n = var.elem_count();
        let whole = |t: &Tensor| -> Result<bool> {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*storage else {
                return Ok(false);
            };
            let len = match cs.dtype() {
                DType::F32 => cs.as_cuda_slice::<f32>()?.len(),
                DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.len(),
                DType::F16 => cs.as_cuda_slice::<half::f16>()?.len(),
                _ => return Ok(false),
            };
            Ok(layout.contiguous_offsets() == Some((0, n)) && len == n)
        };
        Ok(whole(var)? && whole(staged)?)
    }

    /// Moves `staged`'s buffer into `var` (checked by [`swappable`]), leaving `staged` a
    /// one-value placeholder that is dropped here.
    pub(super) fn swap(var: &Tensor, staged: Tensor) -> Result<()> {
        let take = Handover(Mutex::new(None));
        staged.inplace_op1(&take)?;
        var.inplace_op1(&take)?;
        Ok(())
    }

    /// The buffer handed from the staged tensor to the variable: the first application
    /// takes it (a one-value placeholder left behind), the second puts it in place of the
    /// variable's own buffer (which is freed).
    struct Handover(Mutex<Option<CudaStorage>>);

    impl InplaceOp1 for Handover {
        fn name(&self) -> &'static str {
            "adamw-commit-on-device"
        }

        fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!("the on-device commit runs on a GPU only")
        }

        fn cuda_fwd(&self, storage: &mut CudaStorage, _: &Layout) -> candle_core::Result<()> {
            let mut held = self
                .0
                .lock()
                .map_err(|_| candle_core::Error::Msg("on-device commit: poisoned".into()))?;
            match held.take() {
                None => {
                    let dev = storage.device().clone();
                    let placeholder = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(1)?, dev);
                    *held = Some(std::mem::replace(storage, placeholder));
                }
                Some(staged) => *storage = staged,
            }
            Ok(())
        }
    }
}
