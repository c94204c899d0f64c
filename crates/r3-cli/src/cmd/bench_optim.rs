//! `r3 bench optim`: one optimiser step (global gradient norm, then AdamW) on the mid config's
//! trainable parameter set, or a synthetic set shaped like it, by candle's composed ops and by
//! the fused pass, timed alternately in one run, against the device's streaming bandwidth
//! measured on the spot (the CPU's STREAM triad, or a GPU's own copy rate); on the CPU or a
//! GPU, with f32 or 16-bit gradients (`train.narrow_gradients`) and with held 16-bit copies
//! of the matrices (`train.narrow_weight_copies`) rewritten by each update.

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use clap::Args;
use r3_model::cast16::cast16;
use r3_model::{presets, tensor_specs_in, DeviceSpec, ExpertLayout};
use r3_train::{
    decay_matrices_only, global_grad_norm, global_grad_norm_composed, AdamW, AdamWKernel,
    AdamWParams, AdamWStep, UpdateStaging,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::matmul_work::device_bandwidth;

/// Options of `r3 bench optim`.
#[derive(Debug, Args)]
pub struct BenchOptimArgs {
    /// A synthetic set of this many parameters: the mid config's tensor shapes in order,
    /// repeated or cut to the count (default: the mid config's own trainable set).
    #[arg(long)]
    pub params: Option<usize>,
    /// Timed steps per kernel (the kernels alternate step by step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed warm-up steps per kernel.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Seed of the parameters and gradients.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How each step is staged before it commits (`optim.update_staging`): `whole-step`
    /// or `tensor-by-tensor` (checked tensor by tensor, then each computed again: twice the
    /// arithmetic, one tensor's staged values held instead of the whole model's). The steps'
    /// resident-memory high-water mark is printed either way, to compare.
    #[arg(long, value_enum, default_value_t = StagingArg::WholeStep)]
    pub update_staging: StagingArg,
    /// Where the parameters live: `cpu`, `cuda` or `cuda:N` (a build with the `cuda`
    /// feature).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// The gradients' dtype: `f32`, or `bf16` as a backward keeping them narrow hands them
    /// over (`train.narrow_gradients`; read widened by the update).
    #[arg(long, value_enum, default_value_t = GradDtype::F32)]
    pub grad_dtype: GradDtype,
    /// Hold a bf16 copy of every matrix, rewritten by each update (`train.narrow_weight_copies`).
    #[arg(long)]
    pub held_copies: bool,
    /// Hold every matrix in bf16 with no f32 master (`train.master_weights = "bf16"`): its
    /// update computed in f32 and rounded stochastically, 2 bytes of θ read and written.
    #[arg(long, conflicts_with = "held_copies")]
    pub bf16_matrices: bool,
    /// Keep AdamW's moments in bf16 (`optim.moments_dtype = "bf16"`): computed in f32 and
    /// rounded stochastically, 2 bytes of each read and written instead of 4.
    #[arg(long)]
    pub bf16_moments: bool,
}

/// `--grad-dtype`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradDtype {
    /// f32 gradients.
    F32,
    /// bf16 gradients.
    Bf16,
}

/// `--update-staging`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StagingArg {
    /// Every tensor staged, then all committed.
    WholeStep,
    /// Checked tensor by tensor, then each computed again and committed.
    TensorByTensor,
}

impl From<StagingArg> for UpdateStaging {
    fn from(s: StagingArg) -> Self {
        match s {
            StagingArg::WholeStep => UpdateStaging::WholeStep,
            StagingArg::TensorByTensor => UpdateStaging::TensorByTensor,
        }
    }
}

/// The bytes one optimiser step must move for a set of f32 parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimBytes {
    /// AdamW: θ, m, v read and written, 4 bytes each, and the gradient read (4 bytes, or 2
    /// in 16 bits): 28 per parameter with f32 gradients; plus a held 16-bit copy written (2
    /// per parameter of the matrices that have one). The fused pass writes the new θ, m, v
    /// (and copy) into buffers that the commit swaps in, so it moves nothing more; the
    /// composed ops move several times this (their passes are counted as the same useful
    /// bytes, an effective rate).
    pub adamw: u64,
    /// The global gradient norm: each gradient read once (4 or 2 per parameter).
    pub grad_norm: u64,
}

/// [`OptimBytes`] of `params` parameters whose gradients take `grad_bytes` bytes a value,
/// `copied` of them holding a 16-bit copy and `narrow` of them held in bf16 (θ read and
/// written in 2 bytes instead of 4), the moments `moment_bytes` a value each (4, or 2 in
/// bf16).
pub fn optimiser_bytes(
    params: usize,
    grad_bytes: u64,
    copied: usize,
    narrow: usize,
    moment_bytes: u64,
) -> OptimBytes {
    let n = params as u64;
    OptimBytes {
        adamw: 2 * 4 * n - 2 * 2 * narrow as u64
            + 4 * moment_bytes * n
            + grad_bytes * n
            + 2 * copied as u64,
        grad_norm: grad_bytes * n,
    }
}

/// The parameter shapes: the mid config's trainable tensors, or `params` parameters of them
/// in order (repeated, the last one cut to a vector).
fn shapes(params: Option<usize>) -> anyhow::Result<Vec<Vec<usize>>> {
    let cfg = presets::mid_size_bench_config()?;
    let specs: Vec<Vec<usize>> = tensor_specs_in(&cfg, ExpertLayout::Fused)
        .into_iter()
        .filter(|s| s.role.is_trainable())
        .map(|s| s.shape)
        .collect();
    let Some(target) = params else {
        return Ok(specs);
    };
    anyhow::ensure!(target > 0, "--params must be at least 1");
    let mut out = Vec::new();
    let mut total = 0usize;
    for shape in specs.iter().cycle() {
        if total == target {
            break;
        }
        let n: usize = shape.iter().product();
        if total + n <= target {
            out.push(shape.clone());
            total += n;
        } else {
            out.push(vec![target - total]);
            total = target;
        }
    }
    Ok(out)
}

/// A seeded tensor of uniform values in ±`scale`.
fn uniform(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32) -> anyhow::Result<Tensor> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| scale * (rng.random::<f32>() * 2.0 - 1.0))
        .collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Best and median of timings in seconds.
fn best_and_median(times: &mut [f64]) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[0], times[times.len() / 2])
}

/// Runs `r3 bench optim`.
pub fn run(args: BenchOptimArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    let shapes = shapes(args.params)?;
    let device = args.device.open()?;
    let grad_dtype = match args.grad_dtype {
        GradDtype::F32 => DType::F32,
        GradDtype::Bf16 => DType::BF16,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut vars = Vec::with_capacity(shapes.len());
    let mut copies = Vec::new();
    let mut grads = GradStore::default();
    for (i, shape) in shapes.iter().enumerate() {
        let name = format!("p{i:04}");
        let values = uniform(&mut rng, shape, 0.02)?.to_device(&device)?;
        let values = match args.bf16_matrices && shape.len() >= 2 {
            true => values.to_dtype(DType::BF16)?,
            false => values,
        };
        let var = Var::from_tensor(&values)?;
        let grad = uniform(&mut rng, shape, 1e-3)?
            .to_device(&device)?
            .to_dtype(grad_dtype)?;
        grads.insert(var.as_tensor(), grad);
        if args.held_copies && shape.len() >= 2 {
            copies.push((
                name.clone(),
                Var::from_tensor(&cast16(var.as_tensor(), DType::BF16)?)?,
            ));
        }
        vars.push((name, var));
    }
    let params: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let copied: usize = copies.iter().map(|(_, c)| c.elem_count()).sum();
    let narrow: usize = vars
        .iter()
        .filter(|(_, v)| v.dtype() == DType::BF16)
        .map(|(_, v)| v.elem_count())
        .sum();
    let plain: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
    let adamw_params = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(vars, adamw_params, decay_matrices_only)?;
    opt.set_staging(args.update_staging.into());
    let moments = match args.bf16_moments {
        true => DType::BF16,
        false => DType::F32,
    };
    opt.set_moment_dtype(moments)?;
    if !copies.is_empty() {
        opt.hold_narrow_copies(copies)?;
    }
    let bytes = optimiser_bytes(
        params,
        grad_dtype.size_in_bytes() as u64,
        copied,
        narrow,
        moments.size_in_bytes() as u64,
    );
    println!(
        "r3 bench optim: {:.1}M parameters ({:.1}M of them bf16 with no f32 master) in {} tensors ({}) on {}, {grad_dtype:?} gradients, {moments:?} moments, {}, {} warm-up + {} timed steps per kernel, seed {}",
        params as f64 / 1e6,
        narrow as f64 / 1e6,
        shapes.len(),
        match args.params {
            Some(_) => "synthetic, mid-config shapes",
            None => "the mid config's trainable set",
        },
        args.device,
        match copied {
            0 => "no held copies".to_string(),
            c => format!("bf16 copies of {:.1}M parameters held", c as f64 / 1e6),
        },
        args.warmup,
        args.steps,
        args.seed
    );
    println!("update staging: {:?}", args.update_staging);
    // The machine's bandwidth is measured between the steps too, and the best kept: on a
    // shared machine one measurement may fall in a loaded moment the steps do not.
    let mut bandwidth = device_bandwidth(&device)?;

    // The steps' resident high-water mark, the mark reset before them (the allocator keeps
    // freed buffers: compare runs that differ in one setting).
    let memory_before = r3_train::rl::memory::reset_peak()
        .then(r3_train::rl::memory::read_memory)
        .flatten();
    let kernels = [AdamWKernel::Composed, AdamWKernel::Fused];
    let mut adamw_times = [Vec::new(), Vec::new()];
    let mut norm_times = [Vec::new(), Vec::new()];
    let mut norms = [0f32; 2];
    for i in 0..args.warmup + args.steps {
        for (k, kernel) in kernels.iter().enumerate() {
            // A GPU runs queued kernels after a call returns: each phase is timed to its end.
            device.synchronize()?;
            let t0 = Instant::now();
            norms[k] = match kernel {
                AdamWKernel::Composed => global_grad_norm_composed(plain.iter(), &grads)?,
                AdamWKernel::Fused => global_grad_norm(plain.iter(), &grads)?,
            };
            device.synchronize()?;
            let t1 = Instant::now();
            opt.set_kernel(*kernel);
            let out = opt.step(&grads, 1e-4)?;
            device.synchronize()?;
            let t2 = Instant::now();
            anyhow::ensure!(out == AdamWStep::Applied, "the step was skipped: {out:?}");
            if i >= args.warmup {
                norm_times[k].push((t1 - t0).as_secs_f64());
                adamw_times[k].push((t2 - t1).as_secs_f64());
            }
        }
        bandwidth = bandwidth.max(device_bandwidth(&device)?);
    }
    // On the CPU the fused norm adds in candle's own order (the same bits); a GPU's kernel
    // adds each tensor's squares in f64 (candle's f32 tree differs in the last bits).
    let norm_gap = (f64::from(norms[0]) - f64::from(norms[1])).abs() / f64::from(norms[0]);
    match device.is_cpu() {
        true => anyhow::ensure!(
            norms[0].to_bits() == norms[1].to_bits(),
            "fused gradient norm {} differs from the composed {}",
            norms[1],
            norms[0]
        ),
        false => anyhow::ensure!(
            norm_gap < 1e-4,
            "fused gradient norm {} is {norm_gap:e} off the composed {}",
            norms[1],
            norms[0]
        ),
    }

    println!(
        "streaming bandwidth ({}, measured now, best of {} measurements between the steps): {bandwidth:.1} GB/s",
        match device.is_cpu() {
            true => "STREAM triad",
            false => "the device's own copy, y = x · 1 + 0",
        },
        args.warmup + args.steps + 1
    );
    println!(
        "bytes per step: AdamW {:.2} GB ({:.1} B/param), gradient norm {:.2} GB ({} B/param)",
        bytes.adamw as f64 / 1e9,
        bytes.adamw as f64 / params as f64,
        bytes.grad_norm as f64 / 1e9,
        grad_dtype.size_in_bytes()
    );
    let mut best = [[0.0; 2]; 2];
    for (what, times, b) in [
        ("AdamW", &mut adamw_times, bytes.adamw),
        ("grad norm", &mut norm_times, bytes.grad_norm),
    ] {
        let row = if what == "AdamW" { 0 } else { 1 };
        for (k, name) in ["composed", "fused"].iter().enumerate() {
            let (b_t, med) = best_and_median(&mut times[k]);
            best[row][k] = b_t;
            let rate = b as f64 / b_t / 1e9;
            println!(
                "{what:<9} {name:<8}: best {b_t:7.4} s  median {med:7.4} s  {rate:6.2} GB/s{}  = {:5.1}% of bandwidth",
                if k == 0 { " effective" } else { "" },
                rate / bandwidth * 100.0
            );
        }
    }
    let composed = best[0][0] + best[1][0];
    let fused = best[0][1] + best[1][1];
    println!(
        "whole optimiser step (norm + AdamW), best: composed {composed:.4} s, fused {fused:.4} s: {:.2}× faster; fused at {:.1}% of bandwidth (goal ≥ 70%)",
        composed / fused,
        (bytes.adamw + bytes.grad_norm) as f64 / fused / 1e9 / bandwidth * 100.0
    );
    match device.is_cpu() {
        true => println!(
            "gradient norm {:.6} (fused and composed bit-identical)",
            norms[1]
        ),
        false => println!(
            "gradient norm {:.6} (composed {:.6}: {norm_gap:.1e} apart)",
            norms[1], norms[0]
        ),
    }
    let host_memory = memory_before.filter(|_| device.is_cpu());
    if let (Some(before), Some(after)) = (host_memory, r3_train::rl::memory::read_memory()) {
        println!(
            "memory: resident high-water mark during the steps {:.0} MiB (the resident set before them {:.0} MiB; update staging {:?})",
            after.peak_mib, before.rss_mib, args.update_staging
        );
    }
    std::hint::black_box(opt.step_count());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_step_by_hand() {
        // 1000 parameters: 4 streams read + 3 written, 4 bytes each = 28 000; norm 4 000
        assert_eq!(
            optimiser_bytes(1000, 4, 0, 0, 4),
            OptimBytes {
                adamw: 28_000,
                grad_norm: 4_000
            }
        );
        // bf16 gradients (2 bytes read each) and 600 of them holding a bf16 copy (2 written)
        assert_eq!(
            optimiser_bytes(1000, 2, 600, 0, 4),
            OptimBytes {
                adamw: 24_000 + 2_000 + 1_200,
                grad_norm: 2_000
            }
        );
        // 700 of them held in bf16: θ read and written in 2 bytes each (4 fewer a parameter)
        assert_eq!(optimiser_bytes(1000, 4, 0, 700, 4).adamw, 28_000 - 2_800);
        // bf16 moments: m and v read and written in 2 bytes each (8 fewer a parameter)
        assert_eq!(optimiser_bytes(1000, 4, 0, 0, 2).adamw, 28_000 - 8_000);
        // 3 B parameters do not overflow
        assert_eq!(
            optimiser_bytes(3_000_000_000, 4, 0, 0, 4).adamw,
            84_000_000_000
        );
    }

    #[test]
    fn synthetic_shapes_add_up_to_the_count() {
        let mid = shapes(None).expect("mid");
        let mid_total: usize = mid.iter().map(|s| s.iter().product::<usize>()).sum();
        for target in [1, 1000, mid_total, mid_total + 12_345] {
            let s = shapes(Some(target)).expect("shapes");
            let total: usize = s.iter().map(|s| s.iter().product::<usize>()).sum();
            assert_eq!(total, target);
        }
        assert!(shapes(Some(0)).is_err());
        // the mid config's trainable set: ≈ 240 M parameters
        assert!(
            (230_000_000..250_000_000).contains(&mid_total),
            "{mid_total}"
        );
    }
}
