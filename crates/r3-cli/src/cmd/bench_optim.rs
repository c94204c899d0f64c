//! `r3 bench optim`: one optimiser step (global gradient norm, then AdamW) on the mid config's
//! trainable parameter set, or a synthetic set shaped like it, by candle's composed ops and by
//! the fused pass, timed alternately in one run, against this machine's streaming bandwidth
//! measured on the spot.

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use clap::Args;
use r3_model::{presets, tensor_specs_in, ExpertLayout};
use r3_train::{
    decay_matrices_only, global_grad_norm, global_grad_norm_composed, AdamW, AdamWKernel,
    AdamWParams, AdamWStep, UpdateStaging,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::matmul_work::stream_bandwidth;

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
    /// AdamW: θ, g, m, v read and θ, m, v written, 4 bytes each (28 per parameter). The fused
    /// pass writes the new θ, m, v into buffers that the commit swaps in, so it moves nothing
    /// more; the composed ops move several times this (their passes are counted as the same
    /// useful bytes, an effective rate).
    pub adamw: u64,
    /// The global gradient norm: each gradient read once (4 per parameter).
    pub grad_norm: u64,
}

/// [`OptimBytes`] of `params` f32 parameters.
pub fn optimiser_bytes(params: usize) -> OptimBytes {
    let n = params as u64;
    OptimBytes {
        adamw: 7 * 4 * n,
        grad_norm: 4 * n,
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
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut vars = Vec::with_capacity(shapes.len());
    let mut grads = GradStore::default();
    for (i, shape) in shapes.iter().enumerate() {
        let var = Var::from_tensor(&uniform(&mut rng, shape, 0.02)?)?;
        grads.insert(var.as_tensor(), uniform(&mut rng, shape, 1e-3)?);
        vars.push((format!("p{i:04}"), var));
    }
    let params: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let plain: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
    let adamw_params = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let mut opt = AdamW::new(vars, adamw_params, decay_matrices_only)?;
    opt.set_staging(args.update_staging.into());
    let bytes = optimiser_bytes(params);
    println!(
        "r3 bench optim: {:.1}M f32 parameters in {} tensors ({}), {} warm-up + {} timed steps per kernel, seed {}",
        params as f64 / 1e6,
        shapes.len(),
        match args.params {
            Some(_) => "synthetic, mid-config shapes",
            None => "the mid config's trainable set",
        },
        args.warmup,
        args.steps,
        args.seed
    );
    println!("update staging: {:?}", args.update_staging);
    // The machine's bandwidth is measured between the steps too, and the best kept: on a
    // shared machine one measurement may fall in a loaded moment the steps do not.
    let mut bandwidth = stream_bandwidth();

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
            let t0 = Instant::now();
            norms[k] = match kernel {
                AdamWKernel::Composed => global_grad_norm_composed(plain.iter(), &grads)?,
                AdamWKernel::Fused => global_grad_norm(plain.iter(), &grads)?,
            };
            let t1 = Instant::now();
            opt.set_kernel(*kernel);
            let out = opt.step(&grads, 1e-4)?;
            let t2 = Instant::now();
            anyhow::ensure!(out == AdamWStep::Applied, "the step was skipped: {out:?}");
            if i >= args.warmup {
                norm_times[k].push((t1 - t0).as_secs_f64());
                adamw_times[k].push((t2 - t1).as_secs_f64());
            }
        }
        bandwidth = bandwidth.max(stream_bandwidth());
    }
    anyhow::ensure!(
        norms[0].to_bits() == norms[1].to_bits(),
        "fused gradient norm {} differs from the composed {}",
        norms[1],
        norms[0]
    );

    println!(
        "streaming bandwidth (STREAM triad, measured now, best of {} measurements between the steps): {bandwidth:.1} GB/s",
        args.warmup + args.steps + 1
    );
    println!(
        "bytes per step: AdamW {:.2} GB (28 B/param), gradient norm {:.2} GB (4 B/param)",
        bytes.adamw as f64 / 1e9,
        bytes.grad_norm as f64 / 1e9
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
    println!(
        "gradient norm {:.6} (fused and composed bit-identical)",
        norms[1]
    );
    if let (Some(before), Some(after)) = (memory_before, r3_train::rl::memory::read_memory()) {
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
            optimiser_bytes(1000),
            OptimBytes {
                adamw: 28_000,
                grad_norm: 4_000
            }
        );
        // 3 B parameters do not overflow
        assert_eq!(optimiser_bytes(3_000_000_000).adamw, 84_000_000_000);
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
