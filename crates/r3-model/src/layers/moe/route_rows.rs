//! A router's whole choice where its logits are, as one op: each row's top-k (the host
//! selection's order, ties to the lower index), their gates (the host's `Router::weigh_row`
//! formulas) and whether every logit was finite. A step routed on the device runs it once a
//! MoE layer (for a softmax router, composed, it was five kernels — top-k, softmax, gather,
//! sum, divide — and a sixth for the finiteness probe), and a training layer reads its ids
//! alone ([`read_choice`]) instead of copying the logits to rank them on the host. On the CPU
//! it is the host selection itself (`Router::select_row`, `Router::weigh_row`); on a GPU r3's
//! kernels `r3_route_softmax_f32` (the same formulas, its sums in a block's order) and
//! `r3_route_grouped_f32` (DeepSeek-V3's grouped sigmoid selection with its score bias, the
//! host's arithmetic bit for bit).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::config::RouterKind;
use crate::error::{ModelError, Result};
use crate::host::contiguous;
use crate::router::Router;

/// What a router chose for `rows` rows, on the logits' device.
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

/// The choice of `router` (one that selects on the device, [`Router::selects_on_device`])
/// over `logits` `[rows, E]`; `bias` `[E]` is a DeepSeek-V3 router's score correction (a
/// softmax router takes none).
pub fn route_rows(router: &Router, logits: &Tensor, bias: Option<&Tensor>) -> Result<DeviceChoice> {
    let (rows, _) = logits.dims2()?;
    let packed = packed_choice(router, logits, bias, true)?;
    let (k, slots) = (router.top_k, rows * router.top_k);
    Ok(DeviceChoice {
        gates: packed_gates(&packed, rows, k)?,
        ids: packed_ids(&packed, rows, k)?,
        finite: packed_finite(&packed, rows, k)?,
        record: packed.narrow(0, slots, slots + rows)?,
    })
}

/// [`route_rows`]' ids `[rows, k]` (u32) and finiteness flags `[rows]` (f32) alone, on the
/// logits' device: the CPU then skips the gates (a replay's divergence count reads none).
pub(crate) fn chosen_ids(
    router: &Router,
    logits: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (rows, _) = logits.dims2()?;
    let packed = packed_choice(router, logits, bias, false)?;
    let k = router.top_k;
    Ok((
        packed_ids(&packed, rows, k)?,
        packed_finite(&packed, rows, k)?,
    ))
}

/// The `[rows, k]` u32 ids of an op's packed output (exact in f32).
fn packed_ids(packed: &Tensor, rows: usize, k: usize) -> Result<Tensor> {
    Ok(packed
        .narrow(0, rows * k, rows * k)?
        .to_dtype(DType::U32)?
        .reshape((rows, k))?)
}

/// The `[rows]` f32 finiteness flags of an op's packed output.
fn packed_finite(packed: &Tensor, rows: usize, k: usize) -> Result<Tensor> {
    Ok(packed.narrow(0, 2 * rows * k, rows)?)
}

/// The length of the ops' packed output for `rows` rows of `cols` logits choosing `k`
/// (`[gates | ids | finite]`), refused where a GPU kernel's 32-bit sizes cannot hold it.
#[cfg(feature = "cuda")]
fn packed_len(rows: usize, cols: usize, k: usize) -> candle_core::Result<usize> {
    let len = 2 * rows * k + rows;
    let fits = |v: usize| u32::try_from(v).is_ok();
    if !(fits(cols) && fits(rows) && fits(len)) {
        candle_core::bail!("routing rows: {rows} rows of {cols} exceed a 32-bit size");
    }
    Ok(len)
}

/// The `[rows, k]` f32 gates of an op's packed output.
fn packed_gates(packed: &Tensor, rows: usize, k: usize) -> Result<Tensor> {
    Ok(packed.narrow(0, 0, rows * k)?.reshape((rows, k))?)
}

/// The op's output for `router` over `logits` (checked against the router), its gates
/// computed where `gates` says (a GPU computes them anyway).
fn packed_choice(
    router: &Router,
    logits: &Tensor,
    bias: Option<&Tensor>,
    gates: bool,
) -> Result<Tensor> {
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
    if rows == 0 {
        // No launch for no rows (a GPU's grid of zero blocks is an error).
        return Ok(Tensor::zeros(0, DType::F32, logits.device())?);
    }
    let logits = logits.detach().to_dtype(DType::F32)?.contiguous()?;
    Ok(match router.kind {
        RouterKind::Softmax { .. } => {
            if bias.is_some() {
                return Err(ModelError::Input(
                    "a softmax router takes no score bias".into(),
                ));
            }
            logits.apply_op1_no_bwd(&RouteSoftmax {
                router: *router,
                gates,
            })?
        }
        RouterKind::GroupedSigmoid { .. } => {
            // No bias: zeros, which leave every (positive) sigmoid score as it is.
            let bias = match bias {
                Some(b) => b.detach().to_dtype(DType::F32)?.contiguous()?,
                None => Tensor::zeros(e, DType::F32, logits.device())?,
            };
            if bias.dims() != [e] {
                return Err(ModelError::Input(format!(
                    "a score bias of shape {:?} for {e} experts",
                    bias.dims()
                )));
            }
            logits.apply_op2_no_bwd(
                &bias,
                &RouteGrouped {
                    router: *router,
                    gates,
                },
            )?
        }
    })
}

/// A choice made where the logits are and read back for the host ([`read_choice`]).
#[derive(Debug)]
pub struct ReadChoice {
    /// `[rows · k]` experts, best first, on the host.
    pub ids: Vec<u32>,
    /// The same `[rows, k]` u32 on the logits' device.
    pub on_device: Tensor,
    /// `[rows, k]` f32 gates on the logits' device (`Router::weigh_row`'s formulas), where
    /// asked for.
    pub gates: Option<Tensor>,
}

/// The experts `router` (one that selects on the device) chooses over `logits` `[rows, E]`
/// with the score correction `bias` (DeepSeek-V3's, else None), chosen where the logits are
/// and read to the host in one copy of `rows · (k + 1)` values (the host's selection copies
/// all `rows · E` logits, then ranks them on the host while a GPU idles): the host ids
/// `[rows · k]` in selection order, the same ids on the logits' device, and there too the
/// gates where `gates` asks for them. A row with a non-finite logit is the host selection's
/// error: its first such row and, in it, its first such expert.
pub fn read_choice(
    router: &Router,
    logits: &Tensor,
    bias: Option<&Tensor>,
    gates: bool,
) -> Result<ReadChoice> {
    let (rows, _) = logits.dims2()?;
    let k = router.top_k;
    // Without gates the CPU's op skips them.
    let packed = packed_choice(router, logits, bias, gates)?;
    if rows == 0 {
        let none = |dtype| Tensor::zeros((0, k), dtype, logits.device());
        return Ok(ReadChoice {
            ids: Vec::new(),
            on_device: none(DType::U32)?,
            gates: if gates { Some(none(DType::F32)?) } else { None },
        });
    }
    let slots = rows * k;
    // A view of the packed output holding more than half its buffer, so the vendored candle
    // copies the whole buffer to the host (the gates too: `2k + 1` values a row, 17/128 of
    // the logits' bytes at top-8 of 128) rather than queue a copy kernel for the view.
    let record = packed.narrow(0, slots, slots + rows)?.to_vec1::<f32>()?;
    let (ids, finite) = record.split_at(slots);
    if let Some(row) = finite.iter().position(|&f| f == 0.0) {
        let values = logits.get(row)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        return Err(non_finite_row(row, &values));
    }
    Ok(ReadChoice {
        ids: ids.iter().map(|&id| id as u32).collect(),
        on_device: packed_ids(&packed, rows, k)?,
        gates: match gates {
            true => Some(packed_gates(&packed, rows, k)?),
            false => None,
        },
    })
}

/// The ops' CPU form: each row of `logits` (`rows × cols`, contiguous) chosen by the host's
/// selection with `bias` and, where `gates`, weighed by the host's formula, rows in
/// parallel, packed as the kernels pack it; a row with a non-finite logit is flagged, not
/// chosen.
fn host_choice(
    router: &Router,
    logits: &[f32],
    bias: Option<&[f32]>,
    rows: usize,
    cols: usize,
    gates: bool,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let k = router.top_k;
    let mut packed = vec![0f32; 2 * rows * k + rows];
    let (weights, rest) = packed.split_at_mut(rows * k);
    let (ids, finite) = rest.split_at_mut(rows * k);
    let mut chosen = vec![0u32; rows * k];
    weights
        .par_chunks_mut(k)
        .zip(chosen.par_chunks_mut(k))
        .zip(finite.par_iter_mut())
        .zip(logits.par_chunks(cols.max(1)))
        .enumerate()
        .try_for_each(|(r, (((g, c), f), row))| -> candle_core::Result<()> {
            if row.iter().all(|v| v.is_finite()) {
                let failed = |e: ModelError| candle_core::Error::Msg(e.to_string());
                router.select_row(r, row, bias, c).map_err(failed)?;
                if gates {
                    router.weigh_row(row, c, g).map_err(failed)?;
                }
                *f = 1.0;
            }
            Ok(())
        })?;
    for (id, &c) in ids.iter_mut().zip(&chosen) {
        *id = c as f32;
    }
    Ok((CpuStorage::F32(packed), Shape::from(2 * rows * k + rows)))
}

/// The host selection's error for the router logits `values` of row `row`, found not all
/// finite where they were chosen: its first non-finite expert.
pub(crate) fn non_finite_row(row: usize, values: &[f32]) -> ModelError {
    match values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        Some((expert, &value)) => ModelError::NonFiniteScore { row, expert, value },
        None => ModelError::Input(format!(
            "router row {row} was flagged not finite, but its logits are"
        )),
    }
}

/// The op: `[rows, E]` logits → `[gates (rows·k) | ids as f32 (rows·k) | finite (rows)]`
/// for a softmax router's top-k.
#[derive(Debug, Clone, Copy)]
struct RouteSoftmax {
    router: Router,
    /// Whether the gates are wanted: without, the CPU leaves them zero (the selection alone
    /// is the host's cost a native training layer waits for).
    gates: bool,
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
        host_choice(&self.router, logits, None, rows, cols, self.gates)
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
        let len = packed_len(rows, cols, k)?;
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

/// The op for a DeepSeek-V3 router: `[rows, E]` logits and the `[E]` score bias → the same
/// packed layout as [`RouteSoftmax`]'s. On the CPU the host's selection (`Router::select_row`
/// with the bias) and weighing; on a GPU r3's kernel `r3_route_grouped_f32` (the same
/// arithmetic in the same order, its sigmoid `math.rs`'s `fast_exp` bit for bit).
#[derive(Debug, Clone, Copy)]
struct RouteGrouped {
    router: Router,
    /// As [`RouteSoftmax`]'s.
    gates: bool,
}

impl CustomOp2 for RouteGrouped {
    fn name(&self) -> &'static str {
        "route-grouped-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
        bias_storage: &CpuStorage,
        bias_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = layout.shape().dims2()?;
        let (logits, bias) = match (storage, bias_storage) {
            (CpuStorage::F32(v), CpuStorage::F32(b)) => (
                contiguous(v, layout, "router logits")?,
                contiguous(b, bias_layout, "score bias")?,
            ),
            _ => candle_core::bail!("routing rows takes f32 logits and bias"),
        };
        host_choice(&self.router, logits, Some(bias), rows, cols, self.gates)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
        bias_storage: &candle_core::CudaStorage,
        bias_layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        let (rows, cols) = layout.shape().dims2()?;
        let k = self.router.top_k;
        let RouterKind::GroupedSigmoid {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } = self.router.kind
        else {
            candle_core::bail!("the grouped routing kernel takes a grouped sigmoid router");
        };
        // Every group needs a thread of its own for its two best (at most 64 groups).
        let threads = crate::launch_shape::route_grouped_threads(cols, n_group);
        let len = packed_len(rows, cols, k)?;
        let out = cuda::launch_f32!(
            cuda::device(storage),
            "r3_route_grouped_f32",
            len,
            cuda::per_row(rows, threads)?,
            [
                cuda::view::<f32>(storage, layout, "router logits")?,
                cuda::view::<f32>(bias_storage, bias_layout, "score bias")?
            ],
            [
                rows as u32,
                cols as u32,
                k as u32,
                n_group as u32,
                topk_group as u32,
                u32::from(norm_topk_prob),
                routed_scaling_factor as f32
            ]
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
            let choice = route_rows(&router, &t, None).expect("route");
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

    /// Logits of another width, or no expert to choose, are refused (a DeepSeek-V3 score
    /// bias of another length is refused in `tests/router.rs`).
    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let t = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).expect("logits");
        assert!(route_rows(&softmax_router(6, 2, true), &t, None).is_err());
        assert!(route_rows(&softmax_router(8, 0, true), &t, None).is_err());
        assert!(route_rows(&softmax_router(8, 2, true), &t, None).is_ok());
    }
}
