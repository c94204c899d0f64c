//! A softmax router's whole choice where its logits are, as one op: each row's top-k (the host
//! selection's order, ties to the lower index), their gates (`softmax(logits)[id]`,
//! renormalised over the k when the config says) and whether every logit was finite. A step
//! routed on the device runs it once a MoE layer; composed, it was five kernels (top-k,
//! softmax, gather, sum, divide) and a sixth for the finiteness probe. On the CPU it is the
//! host selection itself (`Router::select_row`, `Router::weigh_row`, the gates the host-routed
//! step uploads), on a GPU r3's kernel `r3_route_softmax_f32` (the same formulas, its sums in
//! a block's order).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::host::contiguous;
use crate::router::Router;

/// What a softmax router chose for `rows` rows, on the logits' device.
#[derive(Debug)]
pub struct DeviceChoice {
    /// `[rows, k]` f32 gates.
    pub gates: Tensor,
    /// `[rows, k]` u32 experts, best first.
    pub ids: Tensor,
    /// `[rows]` f32: 1 where every logit of the row is finite, 0 where one is not (that
    /// row's gates are zero and its ids meaningless: the host's selection names it).
    pub finite: Tensor,
    /// `[rows · k + rows]` f32, contiguous: the ids (exact in f32) then the finiteness flags,
    /// what a step copies to the host (one copy for both, one slice of the op's output).
    pub record: Tensor,
}

/// The choice of `router` (a softmax router that selects on the device) over `logits`
/// `[rows, E]`.
pub fn route_softmax_rows(router: &Router, logits: &Tensor) -> Result<DeviceChoice> {
    let (rows, e) = logits.dims2()?;
    let k = router.top_k;
    if !router.selects_on_device() {
        return Err(ModelError::Input(format!(
            "the {:?} top-{k} router of {} experts chooses its experts on the host",
            router.kind, router.num_experts
        )));
    }
    if e != router.num_experts {
        return Err(ModelError::Input(format!(
            "router logits of {e} experts for a router of {}",
            router.num_experts
        )));
    }
    let op = RouteSoftmax { router: *router };
    let packed = logits
        .to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&op)?;
    let slots = rows * k;
    Ok(DeviceChoice {
        gates: packed.narrow(0, 0, slots)?.reshape((rows, k))?,
        ids: packed
            .narrow(0, slots, slots)?
            .to_dtype(DType::U32)?
            .reshape((rows, k))?,
        finite: packed.narrow(0, 2 * slots, rows)?,
        record: packed.narrow(0, slots, slots + rows)?,
    })
}

/// The op: `[rows, E]` logits → `[gates (rows·k) | ids as f32 (rows·k) | finite (rows)]`
/// for a softmax router's top-k.
#[derive(Debug, Clone, Copy)]
struct RouteSoftmax {
    router: Router,
}

impl CustomOp1 for RouteSoftmax {
    fn name(&self) -> &'static str {
        "route-softmax-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = layout.shape().dims2()?;
        let logits = match storage {
            CpuStorage::F32(v) => contiguous(v, layout, "router logits")?,
            _ => candle_core::bail!("routing rows takes f32 logits"),
        };
        let k = self.router.top_k;
        let mut packed = vec![0f32; 2 * rows * k + rows];
        let (gates, rest) = packed.split_at_mut(rows * k);
        let (ids, finite) = rest.split_at_mut(rows * k);
        let mut chosen = vec![0u32; rows * k];
        gates
            .par_chunks_mut(k)
            .zip(chosen.par_chunks_mut(k))
            .zip(finite.par_iter_mut())
            .zip(logits.par_chunks(cols.max(1)))
            .enumerate()
            .try_for_each(|(r, (((g, c), f), row))| -> candle_core::Result<()> {
                if row.iter().all(|v| v.is_finite()) {
                    let failed = |e: ModelError| candle_core::Error::Msg(e.to_string());
                    self.router.select_row(r, row, None, c).map_err(failed)?;
                    self.router.weigh_row(row, c, g).map_err(failed)?;
                    *f = 1.0;
                }
                Ok(())
            })?;
        for (id, &c) in ids.iter_mut().zip(&chosen) {
            *id = c as f32;
        }
        Ok((CpuStorage::F32(packed), Shape::from(2 * rows * k + rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (rows, cols) = layout.shape().dims2()?;
        let k = self.router.top_k;
        let norm = matches!(
            self.router.kind,
            crate::config::RouterKind::Softmax {
                norm_topk_prob: true
            }
        );
        let fits = |v: usize| u32::try_from(v).is_ok();
        if !(fits(cols) && fits(rows) && fits(2 * rows * k + rows)) {
            candle_core::bail!("routing rows: {rows} rows of {cols} exceed a 32-bit size");
        }
        let len = 2 * rows * k + rows;
        let out = cuda::launch_f32!(
            cuda::device(storage),
            "r3_route_softmax_f32",
            len,
            cuda::per_row(rows, cuda::row_threads(cols))?,
            [cuda::view::<f32>(storage, layout, "router logits")?],
            [rows as u32, cols as u32, k as u32, u32::from(norm)]
        );
        Ok((out, Shape::from(len)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterKind;
    use candle_core::Device;

    fn softmax_router(experts: usize, top_k: usize, norm: bool) -> Router {
        Router {
            kind: RouterKind::Softmax {
                norm_topk_prob: norm,
            },
            num_experts: experts,
            top_k,
        }
    }

    /// On the CPU the op is the host's selection and weighing, bit for bit, with planted
    /// ties, renormalised or not; a row with a non-finite logit is flagged with zero gates.
    #[test]
    fn the_choice_is_the_hosts_selection_and_gates() {
        for norm in [true, false] {
            let (rows, e, k) = (9, 12, 3);
            let router = softmax_router(e, k, norm);
            let mut logits: Vec<f32> = (0..rows * e)
                .map(|i| ((i * 7919) % 13) as f32 / 4.0 - 1.5)
                .collect();
            logits[5 * e + 4] = f32::NAN;
            let t = Tensor::from_vec(logits.clone(), (rows, e), &Device::Cpu).expect("logits");
            let choice = route_softmax_rows(&router, &t).expect("route");
            let ids = choice.ids.flatten_all().and_then(|t| t.to_vec1::<u32>());
            let gates = choice.gates.flatten_all().and_then(|t| t.to_vec1::<f32>());
            let finite = choice.finite.to_vec1::<f32>().expect("finite");
            let (ids, gates) = (ids.expect("ids"), gates.expect("gates"));
            for r in 0..rows {
                let row = &logits[r * e..(r + 1) * e];
                if r == 5 {
                    assert_eq!(finite[r], 0.0, "row 5 holds a NaN");
                    assert_eq!(&gates[r * k..(r + 1) * k], &[0.0; 3]);
                    continue;
                }
                let mut want_ids = vec![0u32; k];
                router
                    .select_row(r, row, None, &mut want_ids)
                    .expect("select");
                let mut want_gates = vec![0f32; k];
                router
                    .weigh_row(row, &want_ids, &mut want_gates)
                    .expect("weigh");
                assert_eq!(&ids[r * k..(r + 1) * k], want_ids.as_slice(), "row {r}");
                assert_eq!(&gates[r * k..(r + 1) * k], want_gates.as_slice(), "row {r}");
                assert_eq!(finite[r], 1.0);
            }
        }
    }

    /// Logits of another width, or no expert to choose, are refused (DeepSeek-V3's grouped
    /// router is refused in `tests/router.rs`).
    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let t = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).expect("logits");
        assert!(route_softmax_rows(&softmax_router(6, 2, true), &t).is_err());
        assert!(route_softmax_rows(&softmax_router(8, 0, true), &t).is_err());
        assert!(route_softmax_rows(&softmax_router(8, 2, true), &t).is_ok());
    }
}
