use r3_rollout::kernels::linear::Linear;
use r3_rollout::Dtype;
use std::time::Instant;
fn main() {
    for &(n, k) in &[(1024usize, 512usize), (512, 512), (32000, 512)] {
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        for dtype in [Dtype::F16, Dtype::F32] {
            let lin = Linear::new("w", w.clone(), n, k, None, dtype).unwrap();
            for &m in &[1usize, 4, 8, 9, 16, 32, 64, 256] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 31) % 100) as f32 / 100.0)
                    .collect();
                let mut out = vec![0f32; m * n];
                for par in [false, true] {
                    let iters = (2e9 / (m * n * k) as f64).clamp(3.0, 2000.0) as usize;
                    lin.forward(&x, m, &mut out, par);
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        lin.forward(&x, m, &mut out, par);
                    }
                    let s = t0.elapsed().as_secs_f64() / iters as f64;
                    println!(
                        "n={n:5} k={k} {dtype} m={m:3} par={par:5}: {:8.1} us  {:6.1} GFLOP/s",
                        s * 1e6,
                        2.0 * (m * n * k) as f64 / s / 1e9
                    );
                }
            }
        }
    }
}
