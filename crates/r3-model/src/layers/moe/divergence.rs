//! A replay's routing divergence in one MoE layer: how many forced rows' experts (as a set)
//! differ from the router's own top-k, each counted once per position it stands for.
//!
//! Where the host reads the router's logits anyway (a layer that routes some rows itself,
//! or a router that selects only on the host) the count is taken there
//! ([`Divergence::Counted`]). Where every row is forced and the router selects on the device,
//! the count is taken where the logits are and read with every other layer's at the end of
//! the forward ([`Divergence::OnDevice`], [`resolve`]): on a GPU a replayed layer then never
//! waits for its logits' copy between the router and the experts, so the host queues a whole
//! replayed forward without waiting once (its routes are known before it starts).

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::layers::moe::route_rows::{chosen_ids, non_finite_row};
use crate::router::Router;

/// One layer's count of forced rows whose experts differ from its router's own choice.
#[derive(Debug, Clone)]
pub enum Divergence {
    /// Counted on the host.
    Counted(usize),
    /// Counted where the logits are, not yet read.
    OnDevice {
        /// `[2]` u32: the count, and the first row whose logits are not all finite (`rows`
        /// where every row's are).
        counts: Tensor,
        /// `[1, E]`: that row's logits (row `rows − 1`'s where all are finite), read only to
        /// name a non-finite score as the host's selection would. One row, not the layer's
        /// logits: every replayed layer's record lives until the forward's end.
        first_bad: Tensor,
        /// The layer's routed rows.
        rows: usize,
    },
}

impl Divergence {
    /// The count of forced rows `forced` `[rows, k]` (u32, every row forced) whose experts
    /// differ from `router`'s own top-k over `logits` `[rows, E]`, each row counted
    /// `copies[r]` times (once without), computed where the logits are; `bias` is a
    /// DeepSeek-V3 router's score correction. The router must select on the device
    /// ([`Router::selects_on_device`]).
    pub fn on_device(
        router: &Router,
        logits: &Tensor,
        forced: &Tensor,
        copies: Option<&[u32]>,
        bias: Option<&Tensor>,
    ) -> Result<Self> {
        let logits = logits.detach();
        let (rows, k) = forced.dims2()?;
        if logits.dim(0)? != rows || k != router.top_k {
            return Err(ModelError::Input(format!(
                "divergence: {} rows of logits for {rows} forced rows of {k} experts (top-{})",
                logits.dim(0)?,
                router.top_k
            )));
        }
        if rows == 0 {
            return Ok(Divergence::Counted(0));
        }
        let (ids, finite) = chosen_ids(router, &logits, bias)?;
        // A row's experts are distinct on both sides (the tables' rows are checked for it),
        // so its experts are the same set exactly when all k of its own are among the
        // forced ones.
        let shared = ids
            .unsqueeze(2)?
            .broadcast_eq(&forced.unsqueeze(1)?)?
            .to_dtype(DType::U32)?
            .sum((1, 2))?;
        let differs = shared.lt(k as f64)?.to_dtype(DType::U32)?;
        let differs = match copies {
            Some(copies) => {
                if copies.len() != rows {
                    return Err(ModelError::Input(format!(
                        "divergence: {} copies for {rows} rows",
                        copies.len()
                    )));
                }
                (differs * Tensor::from_slice(copies, rows, logits.device())?)?
            }
            None => differs,
        };
        // The first row with a non-finite logit, as one minimum: a finite row's key is
        // `rows + r`, another's `r`, so the least key is the first bad row, or `rows` + 0.
        let device = logits.device();
        let order = Tensor::arange(0u32, rows as u32, device)?;
        let finite = finite.to_dtype(DType::U32)?;
        let keys = ((finite * rows as f64)? + order)?;
        let first = keys.min_keepdim(0)?;
        let row = first.minimum((rows - 1) as f64)?;
        let first_bad = logits.index_select(&row, 0)?;
        let counts = Tensor::cat(&[&differs.sum_keepdim(0)?, &first], 0)?;
        Ok(Divergence::OnDevice {
            counts,
            first_bad,
            rows,
        })
    }
}

/// Every layer's count, the ones on the device read in one copy (on a GPU one wait at the
/// end of the forward instead of one per layer). A layer whose logits were not finite is the
/// error the host's selection gives for them.
pub fn resolve(layers: &[Divergence]) -> Result<Vec<usize>> {
    let pending: Vec<&Tensor> = layers
        .iter()
        .filter_map(|d| match d {
            Divergence::OnDevice { counts, .. } => Some(counts),
            Divergence::Counted(_) => None,
        })
        .collect();
    let read: Vec<u32> = match pending.is_empty() {
        true => Vec::new(),
        false => Tensor::cat(&pending, 0)?.to_vec1::<u32>()?,
    };
    let mut next = read.chunks(2);
    let mut out = Vec::with_capacity(layers.len());
    for layer in layers {
        match layer {
            Divergence::Counted(n) => out.push(*n),
            Divergence::OnDevice {
                first_bad, rows, ..
            } => {
                let Some(&[count, first]) = next.next() else {
                    return Err(ModelError::Input(
                        "divergence: a layer's count was not read".into(),
                    ));
                };
                if (first as usize) < *rows {
                    // The host's selection names the first bad row and its first bad expert.
                    let row = first_bad
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    return Err(non_finite_row(first as usize, &row));
                }
                out.push(count as usize);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterKind;
    use crate::routing_mode::same_experts;
    use crate::test_util::seeded_tensor;
    use candle_core::Device;

    const ROUTER: Router = Router {
        kind: RouterKind::Softmax {
            norm_topk_prob: true,
        },
        num_experts: 8,
        top_k: 3,
    };

    /// The host's count: the router's own top-k over the logits, each forced row whose
    /// experts differ as a set counted `copies[r]` times.
    fn host_count(logits: &[f32], forced: &[u32], copies: Option<&[u32]>) -> usize {
        let native = ROUTER.select_rows(logits, None).expect("native");
        let k = ROUTER.top_k;
        native
            .chunks(k)
            .zip(forced.chunks(k))
            .enumerate()
            .filter(|(_, (own, given))| !same_experts(given, own))
            .map(|(r, _)| copies.map_or(1, |c| c[r] as usize))
            .sum()
    }

    /// Forced rows that are the router's own choice (in another order too) count nothing;
    /// rows with one or all experts changed count once, or once per position they stand
    /// for: the count on the device equals the host's, with and without copies, and the
    /// layers' counts come back in layer order beside counts taken on the host.
    #[test]
    fn the_device_count_is_the_hosts() {
        let rows = 40;
        let logits = seeded_tensor(&[rows, 8], 5, DType::F32);
        let host = logits
            .flatten_all()
            .and_then(|l| l.to_vec1::<f32>())
            .expect("host");
        let mut forced = ROUTER.select_rows(&host, None).expect("native");
        forced.swap(3, 5); // row 1 reordered: the same experts
        for r in [2usize, 7, 11, 30] {
            // One expert replaced by one the row did not choose.
            let row = &mut forced[r * 3..r * 3 + 3];
            let spare = (0..8).find(|e| !row.contains(e)).expect("spare");
            row[1] = spare;
        }
        forced[39 * 3..].copy_from_slice(&[7, 6, 5]);
        let copies: Vec<u32> = (0..rows as u32).map(|r| 1 + r % 4).collect();
        let ids = Tensor::from_slice(&forced, (rows, 3), &Device::Cpu).expect("ids");
        let plain = Divergence::on_device(&ROUTER, &logits, &ids, None, None).expect("count");
        let weighted =
            Divergence::on_device(&ROUTER, &logits, &ids, Some(&copies), None).expect("count");
        let want = host_count(&host, &forced, None);
        assert!((4..=5).contains(&want), "{want}");
        let got = resolve(&[Divergence::Counted(17), plain, weighted]).expect("resolve");
        assert_eq!(
            got,
            vec![17, want, host_count(&host, &forced, Some(&copies))]
        );
        let same = Tensor::from_slice(
            &ROUTER.select_rows(&host, None).expect("native"),
            (rows, 3),
            &Device::Cpu,
        )
        .expect("ids");
        let none = Divergence::on_device(&ROUTER, &logits, &same, None, None).expect("count");
        assert_eq!(resolve(&[none]).expect("resolve"), vec![0]);
    }

    /// A non-finite router score is the host selection's error, naming the first bad row and
    /// its first bad expert; forced rows of another width or count are refused.
    #[test]
    fn a_non_finite_score_and_a_misfit_are_errors() {
        let mut values = seeded_tensor(&[6, 8], 9, DType::F32)
            .flatten_all()
            .and_then(|l| l.to_vec1::<f32>())
            .expect("values");
        // The first bad row's first bad expert is named, as the host names it.
        values[4 * 8 + 2] = f32::NAN;
        values[4 * 8 + 6] = f32::INFINITY;
        values[5 * 8] = f32::NEG_INFINITY;
        let logits = Tensor::from_vec(values, (6, 8), &Device::Cpu).expect("logits");
        let ids = Tensor::from_vec(
            (0..18u32).map(|i| i % 8).collect::<Vec<_>>(),
            (6, 3),
            &Device::Cpu,
        )
        .expect("ids");
        let count = Divergence::on_device(&ROUTER, &logits, &ids, None, None).expect("queued");
        match resolve(&[count]) {
            Err(ModelError::NonFiniteScore { row, expert, .. }) => {
                assert_eq!((row, expert), (4, 2))
            }
            other => panic!("{other:?}"),
        }
        let narrow = ids.narrow(1, 0, 2).expect("narrow");
        assert!(Divergence::on_device(&ROUTER, &logits, &narrow, None, None).is_err());
        let short = ids.narrow(0, 0, 5).expect("short");
        assert!(Divergence::on_device(&ROUTER, &logits, &short, None, None).is_err());
        let copies = [1u32; 5];
        assert!(Divergence::on_device(&ROUTER, &logits, &ids, Some(&copies), None).is_err());
    }
}
