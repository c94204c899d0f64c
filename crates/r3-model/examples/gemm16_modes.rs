//! The 16-bit GEMM of bf16 training on a GPU, four ways, timed and compared on the routed
//! experts' shape of Qwen3-30B-A3B (and a dense mid-config projection), to decide how the
//! bf16 path should call cuBLAS:
//!
//! - `cast`: what r3 runs today: both f32 operands cast to bf16 (r3's cast kernel), a bf16
//!   GEMM with f32 accumulation, its bf16 output widened to f32;
//! - `held`: the weight already held in bf16 (a copy made once per optimiser step), only the
//!   activation cast, the GEMM and the output widened;
//! - `fast16bf`: cuBLAS's `CUBLAS_COMPUTE_32F_FAST_16BF` on the f32 operands as they are (no
//!   cast pass, no copy), f32 output;
//! - `f32`: the plain f32 GEMM.
//!
//! It first finds how `fast16bf` turns an f32 operand into bf16: a product with one non-zero
//! column makes every output exactly the converted operand, compared with round-to-nearest-even
//! (what r3's casts and the CPU engines do), ties away from zero, and truncation. `fast16bf` can
//! stand in for `cast` only if it rounds as r3 rounds.
//!
//! ```text
//! cargo run --release -p r3-model --features cuda --example gemm16_modes
//! ```
//! (`scripts/cuda/build.sh` builds it, `scripts/cuda/check.sh --steps 7` runs it.) Ends with
//! one `GEMM16` line.

use std::time::Instant;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::sys;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::{DType, Device, Storage, Tensor};
use r3_model::cast16::cast16;
use r3_model::DeviceSpec;

type Error = Box<dyn std::error::Error>;

/// The device address of a contiguous tensor's first element.
fn address(t: &Tensor, stream: &CudaStream) -> Result<u64, Error> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err("tensor not on the GPU".into());
    };
    let start = layout
        .contiguous_offsets()
        .ok_or("tensor not contiguous")?
        .0;
    let (base, _) = match cuda.dtype() {
        DType::F32 => cuda.as_cuda_slice::<f32>()?.device_ptr(stream),
        DType::BF16 => cuda.as_cuda_slice::<half::bf16>()?.device_ptr(stream),
        other => return Err(format!("{other:?} operand").into()),
    };
    Ok(base + (start * t.dtype().size_in_bytes()) as u64)
}

fn data_type(dtype: DType) -> sys::cudaDataType_t {
    match dtype {
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        _ => sys::cudaDataType_t::CUDA_R_32F,
    }
}

/// `c[e] = a[e] · b[e]ᵀ` for `a` `[E, m, k]`, `b` `[E, n, k]` into a new `[E, m, n]` of
/// `out`: one strided batched cuBLAS GEMM (column-major: `cᵀ = b · aᵀ`).
fn batched(
    gpu: &candle_core::CudaDevice,
    a: &Tensor,
    b: &Tensor,
    out: DType,
    compute: sys::cublasComputeType_t,
) -> Result<Tensor, Error> {
    let (e, m, k) = a.dims3()?;
    let (_, n, _) = b.dims3()?;
    let c = Tensor::zeros((e, m, n), out, a.device())?;
    let stream = gpu.cuda_stream();
    let (pa, pb, pc) = (
        address(a, &stream)?,
        address(b, &stream)?,
        address(&c, &stream)?,
    );
    let (alpha, beta) = (1f32, 0f32);
    let blas = gpu.cublas_handle();
    let int = |v: usize| i32::try_from(v).map_err(|_| format!("{v} past i32"));
    // SAFETY: the three buffers hold E matrices of the sizes given (made above), the handle
    // is candle's on the stream the buffers were made on.
    unsafe {
        sys::cublasGemmStridedBatchedEx(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            int(n)?,
            int(m)?,
            int(k)?,
            &alpha as *const f32 as *const _,
            pb as *const _,
            data_type(b.dtype()),
            int(k)?,
            (n * k) as i64,
            pa as *const _,
            data_type(a.dtype()),
            int(k)?,
            (m * k) as i64,
            &beta as *const f32 as *const _,
            pc as *mut _,
            data_type(out),
            int(n)?,
            (m * n) as i64,
            int(e)?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
        .result()?;
    }
    Ok(c)
}

/// The four ways, by name.
#[derive(Clone, Copy, Debug)]
enum Way {
    Cast,
    Held,
    Fast16bf,
    F32,
}

/// One product `x · wᵀ` the given way (`wn` is `w` already in bf16, for `Held`).
fn product(
    gpu: &candle_core::CudaDevice,
    way: Way,
    x: &Tensor,
    w: &Tensor,
    wn: &Tensor,
) -> Result<Tensor, Error> {
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_16BF};
    Ok(match way {
        Way::Cast => {
            let (xn, wn) = (cast16(x, DType::BF16)?, cast16(w, DType::BF16)?);
            cast16(
                &batched(gpu, &xn, &wn, DType::BF16, CUBLAS_COMPUTE_32F)?,
                DType::F32,
            )?
        }
        Way::Held => {
            let xn = cast16(x, DType::BF16)?;
            cast16(
                &batched(gpu, &xn, wn, DType::BF16, CUBLAS_COMPUTE_32F)?,
                DType::F32,
            )?
        }
        Way::Fast16bf => batched(gpu, x, w, DType::F32, CUBLAS_COMPUTE_32F_FAST_16BF)?,
        Way::F32 => batched(gpu, x, w, DType::F32, CUBLAS_COMPUTE_32F)?,
    })
}

/// bf16 of `v` by each candidate rule, as f32: nearest-even, nearest with ties away from
/// zero, toward zero.
fn candidates(v: f32) -> [f32; 3] {
    let bits = v.to_bits();
    let even = half::bf16::from_f32(v).to_f32();
    let low = bits & 0xffff;
    let truncated = f32::from_bits(bits & 0xffff_0000);
    let away = if low >= 0x8000 {
        f32::from_bits((bits & 0xffff_0000).wrapping_add(0x1_0000))
    } else {
        truncated
    };
    [even, away, truncated]
}

/// How `CUBLAS_COMPUTE_32F_FAST_16BF` converts f32 operands: counts of outputs matching each
/// rule, over random values and exact ties.
fn rounding_rule(gpu: &candle_core::CudaDevice, device: &Device) -> Result<[usize; 4], Error> {
    // 64 output columns and 64 reduction steps: a shape cuBLAS runs on tensor cores (a
    // one-column product may take a GEMV path that converts nothing).
    let (m, n, k) = (4096usize, 64usize, 64usize);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut values = Vec::with_capacity(m);
    for i in 0..m {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // exponents around 1, random sign and mantissa; every fourth an exact tie
        let exponent = 120 + (state >> 60) as u32;
        let mut mantissa = (state >> 20) as u32 & 0x7f_ffff;
        if i % 4 == 0 {
            mantissa = (mantissa & 0x7f_0000) | 0x8000;
        }
        let sign = ((state >> 59) & 1) as u32;
        values.push(f32::from_bits(sign << 31 | exponent << 23 | mantissa));
    }
    // x [1, m, k]: the values in column 0; w [1, n, k]: every row a one in column 0, so
    // every output of row i is x[i, 0] as converted, times one.
    let mut x = vec![0f32; m * k];
    for (i, v) in values.iter().enumerate() {
        x[i * k] = *v;
    }
    let mut w = vec![0f32; n * k];
    for j in 0..n {
        w[j * k] = 1.0;
    }
    let x = Tensor::from_vec(x, (1, m, k), device)?;
    let w = Tensor::from_vec(w, (1, n, k), device)?;
    let got = batched(
        gpu,
        &x,
        &w,
        DType::F32,
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
    )?
    .squeeze(0)?
    .to_vec2::<f32>()?;
    let mut counts = [0usize; 4];
    for (v, row) in values.iter().zip(&got) {
        // Every column holds the same product; one that differs is counted as no rule.
        let g = &row[0];
        if row.iter().any(|c| c.to_bits() != g.to_bits()) {
            continue;
        }
        let c = candidates(*v);
        for (rule, want) in c.iter().enumerate() {
            counts[rule] += usize::from(g.to_bits() == want.to_bits());
        }
        counts[3] += usize::from(g.to_bits() == v.to_bits());
    }
    Ok(counts)
}

/// Median seconds of `reps` runs of `f` (each synchronised), after two warm-ups.
fn time(
    device: &Device,
    reps: usize,
    mut f: impl FnMut() -> Result<Tensor, Error>,
) -> Result<f64, Error> {
    for _ in 0..2 {
        f()?;
    }
    device.synchronize()?;
    let mut runs = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        let out = f()?;
        device.synchronize()?;
        runs.push(t.elapsed().as_secs_f64());
        drop(out);
    }
    runs.sort_by(f64::total_cmp);
    Ok(runs[reps / 2])
}

fn main() -> Result<(), Error> {
    let device = DeviceSpec::Cuda { ordinal: 0 }.open()?;
    let Device::Cuda(gpu) = &device else {
        return Err("cuda:0 did not open as a GPU".into());
    };
    let [even, away, truncated, unchanged] = rounding_rule(gpu, &device)?;
    println!(
        "fast16bf operand conversion over 4096 values (1024 exact ties): nearest-even {even}, ties-away {away}, truncation {truncated}, unchanged f32 {unchanged}"
    );
    let rule = if even == 4096 {
        "nearest-even"
    } else if away == 4096 {
        "ties-away"
    } else if truncated == 4096 {
        "truncation"
    } else if unchanged == 4096 {
        "no conversion"
    } else {
        "mixed"
    };
    let mut summary = vec![format!("fast16bf_rounding={rule}")];
    // (name, experts, rows each, k, n): the 30B-A3B routed experts' gate-up at 2 × 512 tokens
    // (8,192 routed rows over 128 experts), their down projection, and the mid config's
    // dense q/k/v-sized projection of 4,096 tokens.
    let shapes = [
        ("a3b_gate_up", 128usize, 64usize, 2048usize, 1536usize),
        ("a3b_down", 128, 64, 768, 2048),
        ("mid_dense", 1, 4096, 512, 1024),
    ];
    for (name, e, m, k, n) in shapes {
        let x = Tensor::randn(0f32, 1f32, (e, m, k), &device)?;
        let w = (Tensor::randn(0f32, 1f32, (e, n, k), &device)? * 0.02)?;
        let wn = cast16(&w, DType::BF16)?;
        let flops = 2.0 * (e * m * n * k) as f64;
        let reference = product(gpu, Way::Cast, &x, &w, &wn)?;
        let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
        let mut line = format!("{name} [{e} × {m} × {k}] · [{n} × {k}]ᵀ:");
        for way in [Way::Cast, Way::Held, Way::Fast16bf, Way::F32] {
            let s = time(&device, 20, || product(gpu, way, &x, &w, &wn))?;
            let diff = (product(gpu, way, &x, &w, &wn)? - &reference)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            line.push_str(&format!(
                " {way:?} {:.3} ms ({:.0} TFLOP/s, max |Δ| vs Cast {:.2e} of {:.2e})",
                s * 1e3,
                flops / s / 1e12,
                diff,
                scale
            ));
            summary.push(format!("{name}_{way:?}_ms={:.3}", s * 1e3));
        }
        println!("{line}");
    }
    println!("GEMM16 {}", summary.join(" "));
    Ok(())
}
