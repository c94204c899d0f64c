//! The token embedding lookup `out[p] = table[ids[p]]` with a backward that sums each
//! vocabulary row's uses in one parallel pass: `d table[v] = Σ_{p : ids[p] = v} d out[p]`,
//! positions added in order, every row of the table's gradient written once (zeros for
//! tokens the batch does not use), from a host-built table of each token's positions.
//!
//! A bf16 table (a trainer holding its weights in bf16 with no f32 master:
//! `train.master_weights = "bf16"`) gives its rows widened to f32, the residual stream's
//! dtype, and takes its gradient summed in f32 and rounded to bf16 once, as torch's
//! embedding backward does.
//!
//! candle's `index_select` has `index_add` as its backward, which on a GPU runs one thread
//! per column walking every id: 2.5 ms of a mid training step on an H200, one block busy
//! and the rest of the GPU idle. (The row gather `GatherRows` does not fit here: its fan-in
//! table is as wide as the most frequent token's count for every vocabulary row.)

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::device::row_ops_run_on;
use crate::error::{ModelError, Result};
use crate::host::contiguous;
use crate::math::StdFloat;

/// The dtype of the rows [`embedding_rows`] gives from a table of `table` dtype: f32 for a
/// bf16 table (widened: the residual stream stays f32), the table's own otherwise. What a
/// forward builds its activations' tables (RoPE's, the attention mask) in.
pub fn rows_dtype(table: DType) -> DType {
    match table {
        DType::BF16 => DType::F32,
        other => other,
    }
}

/// Rows `ids` of `table` `[V, H]` (`ids` the same on the host and as a u32 tensor on the
/// table's device), differentiable in `table` by `EmbeddingRows`; candle's `index_select`
/// where the op does not apply (another device or dtype, or no gradient wanted). A bf16
/// table's rows come back widened to f32 (exact).
pub fn embedding_rows(table: &Tensor, ids: &Tensor, host_ids: &[u32]) -> Result<Tensor> {
    let bf16_table =
        table.dtype() == DType::BF16 && (table.device().is_cpu() || table.device().is_cuda());
    let (vocab, _) = table.dims2()?;
    if ids.elem_count() != host_ids.len() {
        return Err(ModelError::Input(format!(
            "embedding: {} ids on the device, {} on the host",
            ids.elem_count(),
            host_ids.len()
        )));
    }
    if !table.track_op() || !(row_ops_run_on(table) || bf16_table) || host_ids.is_empty() {
        return Ok(table
            .index_select(ids, 0)?
            .to_dtype(rows_dtype(table.dtype()))?);
    }
    let mut offsets = vec![0u32; vocab + 1];
    for &id in host_ids {
        let slot = offsets.get_mut(id as usize + 1).ok_or_else(|| {
            ModelError::Input(format!("embedding: token id {id} past a {vocab}-row table"))
        })?;
        *slot += 1;
    }
    for v in 0..vocab {
        offsets[v + 1] += offsets[v];
    }
    // Each token's positions, ascending (a counting sort).
    let mut filled = offsets.clone();
    let mut order = vec![0u32; host_ids.len()];
    for (p, &id) in host_ids.iter().enumerate() {
        order[filled[id as usize] as usize] = p as u32;
        filled[id as usize] += 1;
    }
    let device = table.device();
    let op = EmbeddingRows {
        offsets: Tensor::from_vec(offsets, vocab + 1, device)?,
        order: Tensor::from_vec(order, host_ids.len(), device)?,
        host_len: host_ids.len(),
    };
    Ok(table.apply_op2(&ids.flatten_all()?, op)?)
}

/// Looked-up `rows` of `shape` (contiguous) widened to f32 where the table is bf16; as they
/// are otherwise.
fn rows_in_f32<S: candle_core::backend::BackendStorage>(
    rows: S,
    shape: &Shape,
) -> candle_core::Result<S> {
    match rows_dtype(rows.dtype()) {
        wider if wider != rows.dtype() => rows.to_dtype(&Layout::contiguous(shape), wider),
        _ => Ok(rows),
    }
}

/// The lookup op `(table, ids) → rows`, holding each token's positions for its backward.
#[derive(Debug, Clone)]
struct EmbeddingRows {
    /// `[V + 1]`: token `v`'s positions are `order[offsets[v]..offsets[v + 1]]`.
    offsets: Tensor,
    /// `[N]` positions grouped by token, ascending within a token.
    order: Tensor,
    host_len: usize,
}

impl CustomOp2 for EmbeddingRows {
    fn name(&self) -> &'static str {
        "r3-embedding-rows"
    }

    fn cpu_fwd(
        &self,
        table: &CpuStorage,
        tl: &Layout,
        ids: &CpuStorage,
        il: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let shape = Shape::from((self.host_len, tl.shape().dims()[1]));
        let out = rows_in_f32(table.index_select(ids, tl, il, 0)?, &shape)?;
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        table: &candle_core::CudaStorage,
        tl: &Layout,
        ids: &candle_core::CudaStorage,
        il: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let shape = Shape::from((self.host_len, tl.shape().dims()[1]));
        let out = rows_in_f32(table.index_select(ids, tl, il, 0)?, &shape)?;
        Ok((out, shape))
    }

    fn bwd(
        &self,
        table: &Tensor,
        _ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let rows = TableGradient {
            vocab: table.dim(0)?,
        };
        let d = grad.apply_op3_no_bwd(&self.offsets, &self.order, &rows)?;
        // A bf16 table's gradient: each row's f32 sum rounded to bf16 once.
        let d = match table.dtype() {
            DType::BF16 => d.to_dtype(DType::BF16)?,
            _ => d,
        };
        Ok((Some(d), None))
    }
}

/// `(d out [N, H], offsets, order) → d table [V, H]` (f32 or f64, as the rows): each vocabulary row the sum of its
/// positions' gradient rows, in position order, zeros for unused tokens.
#[derive(Debug, Clone, Copy)]
struct TableGradient {
    vocab: usize,
}

/// [`TableGradient`]'s CPU implementation (the kernel `r3_embedding_grad_f32` does the same).
fn table_gradient_rows<T: StdFloat>(
    grad: &[T],
    offsets: &[u32],
    order: &[u32],
    h: usize,
) -> Vec<T> {
    let vocab = offsets.len() - 1;
    let mut d = vec![T::ZERO; vocab * h];
    for (v, dst) in d.chunks_mut(h).enumerate() {
        for &p in &order[offsets[v] as usize..offsets[v + 1] as usize] {
            for (a, &g) in dst.iter_mut().zip(&grad[p as usize * h..][..h]) {
                *a = *a + g;
            }
        }
    }
    d
}

impl candle_core::CustomOp3 for TableGradient {
    fn name(&self) -> &'static str {
        "r3-embedding-grad"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        o: &CpuStorage,
        ol: &Layout,
        r: &CpuStorage,
        rl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let h = gl.shape().dims().last().copied().unwrap_or(1).max(1);
        let (offsets, order) = match (o, r) {
            (CpuStorage::U32(o), CpuStorage::U32(r)) => (
                contiguous(o, ol, "token offsets")?,
                contiguous(r, rl, "token positions")?,
            ),
            _ => candle_core::bail!("embedding: token offsets and positions must be u32"),
        };
        let d = match g {
            CpuStorage::F32(g) => CpuStorage::F32(table_gradient_rows(
                contiguous(g, gl, "embedding gradient")?,
                offsets,
                order,
                h,
            )),
            CpuStorage::F64(g) => CpuStorage::F64(table_gradient_rows(
                contiguous(g, gl, "embedding gradient")?,
                offsets,
                order,
                h,
            )),
            _ => candle_core::bail!("embedding: gradient must be f32 or f64"),
        };
        Ok((d, Shape::from((self.vocab, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        o: &candle_core::CudaStorage,
        ol: &Layout,
        r: &candle_core::CudaStorage,
        rl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let h = gl.shape().dims().last().copied().unwrap_or(1).max(1);
        // Block `v` writes vocabulary row `v` (zeros for an unused token).
        let d = cuda::launch_f32!(
            cuda::device(g),
            "r3_embedding_grad_f32",
            self.vocab * h,
            cuda::per_row(self.vocab, cuda::row_threads(h))?,
            [
                cuda::view::<f32>(g, gl, "embedding gradient")?,
                cuda::view::<u32>(o, ol, "token offsets")?,
                cuda::view::<u32>(r, rl, "token positions")?
            ],
            [h as u32]
        );
        Ok((d, Shape::from((self.vocab, h))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, seeded_tensor};
    use candle_core::{DType, Device, Var};

    /// Value and table gradient equal candle's `index_select` and its `index_add` backward
    /// bit for bit (positions summed in the same order), with repeated and unused tokens.
    #[test]
    fn equals_index_select_and_its_backward() {
        let ids = [3u32, 0, 3, 5, 1, 3, 0, 5];
        for dtype in [DType::F64, DType::F32] {
            let table = Var::from_tensor(&seeded_tensor(&[7, 4], 1, dtype)).expect("table");
            let ids_t = Tensor::new(&ids, &Device::Cpu).expect("ids");
            let probe = seeded_tensor(&[ids.len(), 4], 2, dtype);
            let want = table.as_tensor().index_select(&ids_t, 0).expect("select");
            let got = embedding_rows(table.as_tensor(), &ids_t, &ids).expect("rows");
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?} value");
            let grad = |y: &Tensor| {
                let g = (y * &probe)
                    .and_then(|l| l.sum_all())
                    .and_then(|l| l.backward())
                    .expect("backward");
                g.get(table.as_tensor()).expect("grad").clone()
            };
            assert_eq!(
                max_abs_diff(&grad(&got), &grad(&want)),
                0.0,
                "{dtype:?} grad"
            );
        }
    }

    /// A bf16 table gives its rows widened to f32 (the f32 table's rows at the same values)
    /// and its gradient as the f32 table's, each row's f32 sum rounded to bf16 once: checked
    /// against the f32 table's gradient rounded by hand, with repeated tokens whose sums the
    /// rounding changes.
    #[test]
    fn a_bf16_table_gives_f32_rows_and_its_gradient_rounded_once() {
        let ids = [3u32, 0, 3, 5, 1, 3, 0, 5];
        let wide = seeded_tensor(&[7, 4], 1, DType::F32)
            .to_dtype(DType::BF16)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("bf16 values");
        let narrow = Var::from_tensor(&wide.to_dtype(DType::BF16).expect("bf16")).expect("var");
        let wide = Var::from_tensor(&wide).expect("var");
        let ids_t = Tensor::new(&ids, &Device::Cpu).expect("ids");
        let probe = seeded_tensor(&[ids.len(), 4], 2, DType::F32);
        let run = |table: &Var| {
            let rows = embedding_rows(table.as_tensor(), &ids_t, &ids).expect("rows");
            assert_eq!(rows.dtype(), DType::F32);
            let g = (&rows * &probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward");
            let grad = g.get(table.as_tensor()).expect("grad").clone();
            (rows, grad)
        };
        let (wide_rows, wide_grad) = run(&wide);
        let (narrow_rows, narrow_grad) = run(&narrow);
        assert_eq!(max_abs_diff(&wide_rows, &narrow_rows), 0.0, "rows");
        assert_eq!(narrow_grad.dtype(), DType::BF16);
        let by_hand = wide_grad.to_dtype(DType::BF16).expect("rounded");
        let bits = |t: &Tensor| -> Vec<u16> {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<half::bf16>())
                .expect("values")
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(&narrow_grad), bits(&by_hand));
        let exact = wide_grad
            .to_dtype(DType::BF16)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("round trip");
        assert!(
            max_abs_diff(&exact, &wide_grad) > 0.0,
            "some row's sum needs the rounding (else the check shows nothing)"
        );
        // Without a gradient wanted, the rows alone, widened.
        let plain = embedding_rows(&narrow.as_tensor().detach(), &ids_t, &ids).expect("rows");
        assert_eq!(max_abs_diff(&plain, &wide_rows), 0.0);
        // `rows_dtype` (what a forward builds its RoPE tables and mask in) says so of every
        // table's rows, with and without a gradient wanted.
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let table = Var::from_tensor(&seeded_tensor(&[7, 4], 3, dtype)).expect("table");
            for t in [table.as_tensor().clone(), table.as_tensor().detach()] {
                let rows = embedding_rows(&t, &ids_t, &ids).expect("rows");
                assert_eq!(rows.dtype(), rows_dtype(dtype), "{dtype:?} table");
            }
        }
    }

    #[test]
    fn ids_past_the_table_and_mismatched_ids_are_errors() {
        let table = Var::from_tensor(&seeded_tensor(&[4, 2], 1, DType::F32)).expect("table");
        let ids = Tensor::new(&[1u32, 4], &Device::Cpu).expect("ids");
        let err = embedding_rows(table.as_tensor(), &ids, &[1, 4]).expect_err("id 4");
        assert!(
            err.to_string().contains("token id 4 past a 4-row table"),
            "{err}"
        );
        let err = embedding_rows(table.as_tensor(), &ids, &[1]).expect_err("lengths");
        assert!(
            err.to_string()
                .contains("2 ids on the device, 1 on the host"),
            "{err}"
        );
    }
}
