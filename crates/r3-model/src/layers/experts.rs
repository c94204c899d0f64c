//! The routed experts of one MoE layer as two stacked tensors — `gate_up` `[E, 2I, H]` (gate
//! rows first) and `down` `[E, H, I]`, the transformers-5 fused layout — and their SwiGLU over
//! rows grouped by expert.
//!
//! On CPU in f32/f64 the whole expert computation is one custom op with its own backward
//! (a grouped GEMM, experts in parallel): candle's autograd would otherwise build ~10 nodes
//! per expert and, for each expert, materialise a full-batch zero gradient for its row gather
//! and one more for each of its three weights — most of a training step's time at 32 experts.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::gemm::{matmul, MatRef};
use super::linear::matmul_wt;
use crate::error::{ModelError, Result};
use crate::host::{contiguous, with_host};
use crate::math::Float;
use crate::spec::fused_expert_names;
use crate::weights::Weights;

/// The routed experts of one MoE layer, stacked.
#[derive(Debug, Clone)]
pub struct RoutedExperts {
    gate_up: Tensor,
    down: Tensor,
    intermediate: usize,
}

impl RoutedExperts {
    /// Takes the fused expert pair under `{moe_prefix}.experts` (see `Weights::fuse_experts`).
    pub fn new(weights: &Weights, moe_prefix: &str, num_experts: usize) -> Result<Self> {
        let (gate_up_name, down_name) = fused_expert_names(moe_prefix);
        let gate_up = weights.get(&gate_up_name)?.clone();
        let down = weights.get(&down_name)?.clone();
        let (e, two_i, h) = gate_up.dims3()?;
        let (e2, h2, i) = down.dims3()?;
        if e != num_experts || e2 != e || h2 != h || two_i != 2 * i {
            return Err(ModelError::TensorShape {
                name: gate_up_name,
                expected: vec![num_experts, 2 * i, h2],
                got: gate_up.dims().to_vec(),
            });
        }
        Ok(RoutedExperts {
            gate_up,
            down,
            intermediate: i,
        })
    }

    /// SwiGLU of every row of `x` `[M, H]` through its expert: rows
    /// `offsets[j]..offsets[j + 1]` go to expert `j` (`offsets` has `E + 1` entries).
    pub fn forward(&self, x: &Tensor, offsets: &[usize]) -> Result<Tensor> {
        let e = self.gate_up.dim(0)?;
        let rows = x.dim(0)?;
        if offsets.len() != e + 1
            || offsets.first() != Some(&0)
            || offsets.last() != Some(&rows)
            || offsets.windows(2).any(|w| w[0] > w[1])
        {
            return Err(ModelError::Input(format!(
                "expert row offsets {offsets:?} do not split {rows} rows over {e} experts"
            )));
        }
        let fused_dtype = matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64);
        if x.device().is_cpu() && fused_dtype {
            let op = GroupedSwiGlu {
                offsets: offsets.to_vec(),
                hidden: Mutex::new(None),
            };
            Ok(x.contiguous()?.apply_op3(
                &self.gate_up.contiguous()?,
                &self.down.contiguous()?,
                op,
            )?)
        } else {
            self.forward_composed(x, offsets)
        }
    }

    /// The same computation from candle's composed ops, expert by expert (other devices and
    /// dtypes, and the reference the fused op is tested against).
    fn forward_composed(&self, x: &Tensor, offsets: &[usize]) -> Result<Tensor> {
        let i = self.intermediate;
        let mut outputs = Vec::new();
        for (j, w) in offsets.windows(2).enumerate() {
            if w[0] == w[1] {
                continue;
            }
            let xj = x.narrow(0, w[0], w[1] - w[0])?;
            let h = matmul_wt(&xj, &self.gate_up.get(j)?)?;
            let a = (h.narrow(1, 0, i)?.silu()? * h.narrow(1, i, i)?)?;
            outputs.push(matmul_wt(&a, &self.down.get(j)?)?);
        }
        if outputs.is_empty() {
            return Ok(x.zeros_like()?);
        }
        Ok(Tensor::cat(&outputs, 0)?)
    }
}

/// Grouped SwiGLU `(x, gate_up, down) → y`, caching the `[M, 2I]` gate/up activations for
/// the backward.
struct GroupedSwiGlu {
    offsets: Vec<usize>,
    hidden: Mutex<Option<CpuStorage>>,
}

/// Dimensions of one grouped product.
#[derive(Debug, Clone, Copy)]
struct Dims {
    hidden: usize,
    inter: usize,
}

/// Splits a row-major buffer into the row groups `offsets` describes.
fn split_groups<'a, T>(mut buf: &'a mut [T], offsets: &[usize], width: usize) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, tail) = buf.split_at_mut((w[1] - w[0]) * width);
        out.push(head);
        buf = tail;
    }
    out
}

/// `split_groups` where the buffer is wanted, else one `None` per group.
fn optional_groups<'a, T>(
    buf: &'a mut [T],
    wanted: bool,
    offsets: &[usize],
    width: usize,
) -> Vec<Option<&'a mut [T]>> {
    if wanted {
        split_groups(buf, offsets, width)
            .into_iter()
            .map(Some)
            .collect()
    } else {
        offsets.windows(2).map(|_| None).collect()
    }
}

/// Runs `work` on every job: across the rayon pool when each job's GEMMs run on one thread
/// (`threads == 1`), else one job after another with the GEMMs using every thread.
fn run_jobs<J: Send>(jobs: Vec<J>, threads: usize, work: impl Fn(J) + Sync + Send) {
    if threads == 1 {
        jobs.into_par_iter().for_each(work);
    } else {
        jobs.into_iter().for_each(work);
    }
}

/// Threads inside each expert's GEMM: one when there are enough groups to keep every thread
/// busy across experts, else all of them.
fn inner_threads(offsets: &[usize]) -> usize {
    let threads = candle_core::utils::get_num_threads();
    let busy = offsets.windows(2).filter(|w| w[1] > w[0]).count();
    if busy >= 4 * threads {
        1
    } else {
        threads
    }
}

/// `h = x W1ᵀ`, `y = (silu(h_gate) · h_up) W2ᵀ` per group; returns `(y, h)`.
fn grouped_forward<T: Float>(
    x: &[T],
    w1: &[T],
    w2: &[T],
    offsets: &[usize],
    d: Dims,
) -> (Vec<T>, Vec<T>) {
    let (hd, id) = (d.hidden, d.inter);
    let rows = offsets.last().copied().unwrap_or(0);
    let mut h = vec![T::ZERO; rows * 2 * id];
    let mut y = vec![T::ZERO; rows * hd];
    let threads = inner_threads(offsets);
    let work = |(j, (hj, yj)): (usize, (&mut [T], &mut [T]))| {
        let (from, to) = (offsets[j], offsets[j + 1]);
        let m = to - from;
        if m == 0 {
            return;
        }
        let xj = MatRef::row_major(&x[from * hd..to * hd], hd);
        let w1j = MatRef::transposed(&w1[j * 2 * id * hd..(j + 1) * 2 * id * hd], hd);
        matmul(m, 2 * id, hd, hj, xj, w1j, threads);
        let mut a = vec![T::ZERO; m * id];
        for (ar, hr) in a.chunks_exact_mut(id).zip(hj.chunks_exact(2 * id)) {
            let (g, u) = hr.split_at(id);
            for ((a, &g), &u) in ar.iter_mut().zip(g).zip(u) {
                *a = g * g.sigmoid() * u;
            }
        }
        let w2j = MatRef::transposed(&w2[j * hd * id..(j + 1) * hd * id], id);
        matmul(m, hd, id, yj, MatRef::row_major(&a, id), w2j, threads);
    };
    let jobs: Vec<_> = split_groups(&mut h, offsets, 2 * id)
        .into_iter()
        .zip(split_groups(&mut y, offsets, hd))
        .enumerate()
        .collect();
    run_jobs(jobs, threads, work);
    (y, h)
}

/// Gradients of the grouped SwiGLU: `(dx, dW1, dW2)`, each `None` where not wanted.
struct GroupedGrads<T> {
    dx: Option<Vec<T>>,
    dw1: Option<Vec<T>>,
    dw2: Option<Vec<T>>,
}

/// One expert's backward job: its index and its slices of `dx`, `dW1` and `dW2`.
type GroupJob<'a, T> = (
    usize,
    Option<&'a mut [T]>,
    Option<&'a mut [T]>,
    Option<&'a mut [T]>,
);

/// Which gradients the backward computes.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    dx: bool,
    dw1: bool,
    dw2: bool,
}

#[allow(clippy::too_many_arguments)]
fn grouped_backward<T: Float>(
    x: &[T],
    w1: &[T],
    w2: &[T],
    h: &[T],
    gy: &[T],
    offsets: &[usize],
    d: Dims,
    wanted: Wanted,
) -> GroupedGrads<T> {
    let (hd, id) = (d.hidden, d.inter);
    let rows = offsets.last().copied().unwrap_or(0);
    let experts = offsets.len() - 1;
    let mut dx = vec![T::ZERO; if wanted.dx { rows * hd } else { 0 }];
    let mut dw1 = vec![T::ZERO; if wanted.dw1 { experts * 2 * id * hd } else { 0 }];
    let mut dw2 = vec![T::ZERO; if wanted.dw2 { experts * hd * id } else { 0 }];
    let threads = inner_threads(offsets);
    let per_expert: Vec<usize> = (0..=experts).collect();
    let jobs: Vec<GroupJob<'_, T>> = optional_groups(&mut dx, wanted.dx, offsets, hd)
        .into_iter()
        .zip(optional_groups(
            &mut dw1,
            wanted.dw1,
            &per_expert,
            2 * id * hd,
        ))
        .zip(optional_groups(&mut dw2, wanted.dw2, &per_expert, hd * id))
        .enumerate()
        .map(|(j, ((a, b), c))| (j, a, b, c))
        .collect();
    let work = |(j, dxj, dw1j, dw2j): GroupJob<'_, T>| {
        let (from, to) = (offsets[j], offsets[j + 1]);
        let m = to - from;
        if m == 0 {
            return;
        }
        let gyj = &gy[from * hd..to * hd];
        let hj = &h[from * 2 * id..to * 2 * id];
        let w1j = &w1[j * 2 * id * hd..(j + 1) * 2 * id * hd];
        let w2j = &w2[j * hd * id..(j + 1) * hd * id];
        // da = gy · W2 (W2 is [H, I], read as-is)
        let mut da = vec![T::ZERO; m * id];
        matmul(
            m,
            id,
            hd,
            &mut da,
            MatRef::row_major(gyj, hd),
            MatRef::row_major(w2j, id),
            threads,
        );
        let mut a = vec![T::ZERO; m * id];
        let mut dh = vec![T::ZERO; m * 2 * id];
        for r in 0..m {
            let (g, u) = hj[r * 2 * id..(r + 1) * 2 * id].split_at(id);
            let (dg, du) = dh[r * 2 * id..(r + 1) * 2 * id].split_at_mut(id);
            for c in 0..id {
                let s = g[c].sigmoid();
                let silu = g[c] * s;
                let grad = da[r * id + c];
                a[r * id + c] = silu * u[c];
                // d silu(g)/dg = s · (1 + g · (1 − s))
                dg[c] = grad * u[c] * s * (T::ONE + g[c] * (T::ONE - s));
                du[c] = grad * silu;
            }
        }
        if let Some(dw2j) = dw2j {
            // dW2 = gyᵀ · a
            matmul(
                hd,
                id,
                m,
                dw2j,
                MatRef::transposed(gyj, hd),
                MatRef::row_major(&a, id),
                threads,
            );
        }
        if let Some(dw1j) = dw1j {
            // dW1 = dhᵀ · x
            matmul(
                2 * id,
                hd,
                m,
                dw1j,
                MatRef::transposed(&dh, 2 * id),
                MatRef::row_major(&x[from * hd..to * hd], hd),
                threads,
            );
        }
        if let Some(dxj) = dxj {
            // dx = dh · W1 (W1 is [2I, H], read as-is)
            matmul(
                m,
                hd,
                2 * id,
                dxj,
                MatRef::row_major(&dh, 2 * id),
                MatRef::row_major(w1j, hd),
                threads,
            );
        }
    };
    run_jobs(jobs, threads, work);
    GroupedGrads {
        dx: wanted.dx.then_some(dx),
        dw1: wanted.dw1.then_some(dw1),
        dw2: wanted.dw2.then_some(dw2),
    }
}

impl GroupedSwiGlu {
    /// Shapes of the three operands, checked against each other and the offsets.
    fn dims(&self, x: &Shape, w1: &Shape, w2: &Shape) -> candle_core::Result<(usize, Dims)> {
        let (rows, hd) = x.dims2()?;
        let (e, two_i, hd1) = w1.dims3()?;
        let (e2, hd2, id) = w2.dims3()?;
        if hd1 != hd || hd2 != hd || e2 != e || two_i != 2 * id || self.offsets.len() != e + 1 {
            candle_core::bail!(
                "grouped experts: x {x:?}, gate_up {w1:?}, down {w2:?} and {} offsets do not fit",
                self.offsets.len()
            );
        }
        if self.offsets.last() != Some(&rows) {
            candle_core::bail!("grouped experts: offsets cover a different number of rows");
        }
        Ok((
            rows,
            Dims {
                hidden: hd,
                inter: id,
            },
        ))
    }

    fn fwd_typed<T: Float + WithDType>(
        &self,
        x: &[T],
        w1: &[T],
        w2: &[T],
        d: Dims,
        wrap: fn(Vec<T>) -> CpuStorage,
    ) -> candle_core::Result<CpuStorage> {
        let (y, h) = grouped_forward(x, w1, w2, &self.offsets, d);
        let mut cache = self
            .hidden
            .lock()
            .map_err(|_| candle_core::Error::Msg("grouped experts: cache lock poisoned".into()))?;
        *cache = Some(wrap(h));
        Ok(wrap(y))
    }

    fn bwd_typed<T: Float + WithDType>(
        &self,
        (x, w1, w2, grad): (&Tensor, &Tensor, &Tensor, &Tensor),
        d: Dims,
        wanted: Wanted,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grads = with_host::<T, _>(x, |xv| {
            with_host::<T, _>(w1, |w1v| {
                with_host::<T, _>(w2, |w2v| {
                    with_host::<T, _>(grad, |gv| {
                        let cached = self.hidden.lock().map_err(|_| {
                            candle_core::Error::Msg("grouped experts: cache lock poisoned".into())
                        })?;
                        let recomputed;
                        let h = match cached.as_ref().map(|c| c.as_slice::<T>()) {
                            Some(h) => h?,
                            None => {
                                recomputed = grouped_forward(xv, w1v, w2v, &self.offsets, d).1;
                                &recomputed
                            }
                        };
                        Ok(grouped_backward(
                            xv,
                            w1v,
                            w2v,
                            h,
                            gv,
                            &self.offsets,
                            d,
                            wanted,
                        ))
                    })
                })
            })
        })?;
        let device = x.device();
        let to_tensor = |v: Option<Vec<T>>, shape: &Shape| {
            v.map(|v| Tensor::from_vec(v, shape, device)).transpose()
        };
        Ok((
            to_tensor(grads.dx, x.shape())?,
            to_tensor(grads.dw1, w1.shape())?,
            to_tensor(grads.dw2, w2.shape())?,
        ))
    }
}

impl CustomOp3 for GroupedSwiGlu {
    fn name(&self) -> &'static str {
        "r3-grouped-swiglu"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w1: &CpuStorage,
        w1l: &Layout,
        w2: &CpuStorage,
        w2l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, d) = self.dims(xl.shape(), w1l.shape(), w2l.shape())?;
        let out = match (x, w1, w2) {
            (CpuStorage::F32(x), CpuStorage::F32(w1), CpuStorage::F32(w2)) => self.fwd_typed(
                contiguous(x, xl, "x")?,
                contiguous(w1, w1l, "gate_up")?,
                contiguous(w2, w2l, "down")?,
                d,
                CpuStorage::F32,
            )?,
            (CpuStorage::F64(x), CpuStorage::F64(w1), CpuStorage::F64(w2)) => self.fwd_typed(
                contiguous(x, xl, "x")?,
                contiguous(w1, w1l, "gate_up")?,
                contiguous(w2, w2l, "down")?,
                d,
                CpuStorage::F64,
            )?,
            _ => candle_core::bail!("grouped experts: operands must all be f32 or all f64"),
        };
        Ok((out, Shape::from((rows, d.hidden))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_, d) = self.dims(x.shape(), w1.shape(), w2.shape())?;
        let wanted = Wanted {
            dx: x.track_op(),
            dw1: w1.track_op(),
            dw2: w2.track_op(),
        };
        match x.dtype() {
            candle_core::DType::F32 => self.bwd_typed::<f32>((x, w1, w2, grad), d, wanted),
            candle_core::DType::F64 => self.bwd_typed::<f64>((x, w1, w2, grad), d, wanted),
            dt => candle_core::bail!("grouped experts: no backward for {dt:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn rand_tensor(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let data: Vec<f64> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f64 / (1u64 << 31) as f64) - 0.5
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor")
    }

    /// The fused op and candle's composed ops agree on outputs and on all three gradients,
    /// including an expert with no rows.
    #[test]
    fn fused_matches_composed_ops() {
        let (e, h, i) = (5, 12, 7);
        let offsets = [0, 4, 4, 11, 12, 17];
        let rows = offsets[e];
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&rand_tensor(&[rows, h], 1).to_dtype(dtype).expect("x"))
                .expect("var");
            let gu = Var::from_tensor(&rand_tensor(&[e, 2 * i, h], 2).to_dtype(dtype).expect("w"))
                .expect("var");
            let dn = Var::from_tensor(&rand_tensor(&[e, h, i], 3).to_dtype(dtype).expect("w"))
                .expect("var");
            let probe = rand_tensor(&[rows, h], 4).to_dtype(dtype).expect("probe");
            let experts = RoutedExperts {
                gate_up: gu.as_tensor().clone(),
                down: dn.as_tensor().clone(),
                intermediate: i,
            };
            let fused = experts.forward(x.as_tensor(), &offsets).expect("fused");
            let composed = experts
                .forward_composed(x.as_tensor(), &offsets)
                .expect("composed");
            let gf = (&fused * &probe).expect("mul").sum_all().expect("sum");
            let gc = (&composed * &probe).expect("mul").sum_all().expect("sum");
            let gf = gf.backward().expect("bwd");
            let gc = gc.backward().expect("bwd");
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let max_diff = |a: &Tensor, b: &Tensor| {
                (a - b)
                    .expect("sub")
                    .abs()
                    .expect("abs")
                    .max_all()
                    .expect("max")
                    .to_dtype(DType::F64)
                    .expect("f64")
                    .to_scalar::<f64>()
                    .expect("scalar")
            };
            assert!(max_diff(&fused, &composed) < tol, "{dtype:?} outputs");
            for (name, v) in [("x", &x), ("gate_up", &gu), ("down", &dn)] {
                let a = gf.get(v.as_tensor()).expect("fused grad");
                let b = gc.get(v.as_tensor()).expect("composed grad");
                assert!(max_diff(a, b) < tol, "{dtype:?} grad of {name}");
            }
            // expert 1 has no rows: its weight gradients are exactly zero
            let dw = gf.get(gu.as_tensor()).expect("grad").get(1).expect("e1");
            assert_eq!(max_diff(&dw, &dw.zeros_like().expect("z")), 0.0);
        }
    }

    #[test]
    fn offsets_that_do_not_cover_the_rows_are_an_error() {
        let experts = RoutedExperts {
            gate_up: rand_tensor(&[2, 4, 3], 1),
            down: rand_tensor(&[2, 3, 2], 2),
            intermediate: 2,
        };
        let x = rand_tensor(&[5, 3], 3);
        for bad in [&[0, 2, 4][..], &[0, 5][..], &[1, 2, 5][..], &[0, 4, 3][..]] {
            let err = experts.forward(&x, bad).expect_err("bad offsets");
            assert!(err.to_string().contains("offsets"), "{err}");
        }
    }
}
