//! Each row's `k` largest values as a device op: the router's top-k where its logits are, so
//! a step routed on the device never copies them to the host. Ties go to the lower index and
//! values are ordered as `f32::total_cmp` orders them, on the CPU through the host
//! selection's own function (`router::top_k_desc`) and on a GPU through r3's kernel
//! (`r3_top_k_f32`, the same integer key), so both choose exactly the experts the host
//! selection chooses (candle's arg-sort on a GPU is a bitonic network, which may order equal
//! logits either way: bf16 router logits tie often).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::host::contiguous;
use crate::router::top_k_desc;

/// `[rows, k]` u32 indices of each row's `k` largest values of `x` `[rows, cols]` (f32),
/// largest first, ties to the lower index; not differentiable (indices).
pub(crate) fn top_k_rows(x: &Tensor, k: usize) -> Result<Tensor> {
    let (_, cols) = x.dims2()?;
    if k == 0 || k > cols || x.dtype() != DType::F32 {
        return Err(ModelError::Input(format!(
            "top-{k} of {:?} rows of {cols} ({:?}): k must be in 1..={cols}, the rows f32",
            x.dims(),
            x.dtype()
        )));
    }
    Ok(x.contiguous()?.apply_op1_no_bwd(&TopK { k })?)
}

/// The op: `k` per row.
#[derive(Debug, Clone, Copy)]
struct TopK {
    k: usize,
}

impl CustomOp1 for TopK {
    fn name(&self) -> &'static str {
        "top-k-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = layout.shape().dims2()?;
        let values = match storage {
            CpuStorage::F32(v) => contiguous(v, layout, "top-k rows")?,
            _ => candle_core::bail!("top-k rows take f32"),
        };
        let k = self.k;
        let mut ids = vec![0u32; rows * k];
        if cols > 0 {
            ids.par_chunks_mut(k)
                .zip(values.par_chunks(cols))
                .for_each(|(out, row)| top_k_desc(row, k, out));
        }
        Ok((CpuStorage::U32(ids), Shape::from((rows, k))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (rows, cols) = layout.shape().dims2()?;
        let fits = |v: usize| u32::try_from(v).is_ok();
        if !(fits(cols) && fits(self.k) && fits(rows)) {
            candle_core::bail!("top-k rows: {rows} rows of {cols} exceed a 32-bit size");
        }
        let out = cuda::launch_typed!(
            cuda::device(storage),
            "r3_top_k_f32",
            u32,
            rows * self.k,
            cuda::per_row(rows, cuda::row_threads(cols))?,
            [cuda::view::<f32>(storage, layout, "top-k rows")?],
            [cols as u32, self.k as u32]
        );
        Ok((out, Shape::from((rows, self.k))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The host selection's own order: largest first, equal values to the lower index, −0
    /// below +0 (`total_cmp`), on rows with planted ties.
    #[test]
    fn rows_take_their_largest_ties_to_the_lower_index() {
        let rows = [
            [0.5f32, 2.0, -1.0, 2.0, 0.0, 3.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [-0.0, 0.0, -3.0, -0.0, -2.0, 0.0],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let x = Tensor::from_vec(flat, (3, 6), &Device::Cpu).expect("rows");
        let ids = top_k_rows(&x, 3)
            .and_then(|t| Ok(t.to_vec2::<u32>()?))
            .expect("top-k");
        assert_eq!(ids, vec![vec![5, 1, 3], vec![0, 1, 2], vec![1, 5, 0]]);
    }

    #[test]
    fn a_k_past_the_row_or_other_dtypes_are_refused() {
        let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).expect("rows");
        for k in [0, 5] {
            let err = top_k_rows(&x, k).expect_err("k out of range");
            assert!(err.to_string().contains("k must be in 1..=4"), "{err}");
        }
        let half = x.to_dtype(DType::BF16).expect("bf16");
        assert!(top_k_rows(&half, 2).is_err());
    }
}
