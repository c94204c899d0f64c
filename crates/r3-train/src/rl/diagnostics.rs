//! Training–inference diagnostics of one step, built on r3-routing's plain-slice metrics:
//! the log-prob mismatch between the rollout engine and the training engine at the old
//! weights, the routing divergence between rollout routes and the routes the training
//! engine chose, and the replay verification fraction.

use r3_model::ReplayProof;
use r3_routing::{divergence, mismatch_metrics, summarize, MismatchMetrics, RouteTable};

use crate::config::train::RouterReplay;
use crate::error::{Result, TrainError};

/// Mismatch of training vs rollout log-probs over the response tokens where both are
/// finite, and how many were not; `None` when no token is left. A NaN or infinite training
/// log-prob (a forward that overflowed in 16 bits) skips its update as a non-finite loss;
/// the step goes on and reports the mismatch of the rest, not an error.
pub fn logp_mismatch(
    train_logp: &[Vec<f32>],
    rollout_logp: &[Vec<f32>],
) -> Result<(Option<MismatchMetrics>, usize)> {
    if train_logp.len() != rollout_logp.len() {
        return Err(TrainError::Length {
            what: "rollout log-prob rows (one per training row)".into(),
            got: rollout_logp.len(),
            expected: train_logp.len(),
        });
    }
    let mut train = Vec::new();
    let mut rollout = Vec::new();
    let mut non_finite = 0;
    for (row, (t, r)) in train_logp.iter().zip(rollout_logp).enumerate() {
        if t.len() != r.len() {
            return Err(TrainError::Length {
                what: format!("rollout log-probs of row {row} (one per response token)"),
                got: r.len(),
                expected: t.len(),
            });
        }
        for (&a, &b) in t.iter().zip(r) {
            if a.is_finite() && b.is_finite() {
                train.push(a);
                rollout.push(b);
            } else {
                non_finite += 1;
            }
        }
    }
    if non_finite > 0 {
        tracing::warn!(
            tokens = non_finite,
            "non-finite log-probs left out of the mismatch statistics"
        );
    }
    if train.is_empty() {
        return Ok((None, non_finite));
    }
    Ok((Some(mismatch_metrics(&train, &rollout, None)?), non_finite))
}

/// Routing divergence between the rollout's routes and the routes a training forward
/// chose (router fraction, token fraction), compared on the rows both cover.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteDivergence {
    /// Fraction of (token, MoE layer) routers whose expert sets differ.
    pub router_frac: f64,
    /// Fraction of tokens with a differing expert set in at least one MoE layer.
    pub token_frac: Option<f64>,
}

/// Divergence between rollout tables and recorded training tables (one per sequence,
/// compared over the rows both cover: the same `len − 1` where the training forward fed the
/// rollout's positions).
pub fn recorded_divergence(
    rollout: &[RouteTable],
    recorded: &[RouteTable],
) -> Result<RouteDivergence> {
    if rollout.len() != recorded.len() {
        return Err(TrainError::Length {
            what: "recorded route tables (one per rollout table)".into(),
            got: recorded.len(),
            expected: rollout.len(),
        });
    }
    let per_seq = rollout
        .iter()
        .zip(recorded)
        .map(|(r, t)| {
            let rows = r.num_tokens().min(t.num_tokens());
            let a = r.slice_rows(0, rows)?;
            let b = t.slice_rows(0, rows)?;
            divergence(&a, &b)
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let s = summarize(&per_seq);
    Ok(RouteDivergence {
        router_frac: s.router_diff_fraction,
        token_frac: Some(s.token_diff_fraction),
    })
}

/// Router-level divergence read from a replay proof: replayed cells whose given experts
/// differ from the forward's own top-k (token level is not in the proof).
pub fn proof_divergence(proof: &ReplayProof) -> RouteDivergence {
    let replayed = proof.total_replayed();
    let differs: usize = proof.differs_from_native.iter().sum();
    RouteDivergence {
        router_frac: if replayed == 0 {
            0.0
        } else {
            differs as f64 / replayed as f64
        },
        token_frac: None,
    }
}

/// Checks a replay proof against the tables that were replayed and returns the verified
/// fraction (replayed cells / cells the tables provide). Anything short of every cell is
/// an error: a replay that silently fell back to native routing is a bug. So is a cell the
/// forward routed natively: a training forward feeds exactly the positions the tables
/// cover (a table a row short would leave the last prediction to the router).
pub fn verify_proof(
    proof: &ReplayProof,
    tables: &[RouteTable],
    mode: RouterReplay,
    pass: &'static str,
) -> Result<f64> {
    let layers = proof.layers.len();
    let expected: usize = tables.iter().map(|t| t.num_tokens() * layers).sum();
    let replayed = proof.total_replayed();
    let native: usize = proof.native_cells.iter().sum();
    if expected == 0 || replayed != expected || native != 0 {
        return Err(TrainError::ReplayNotVerified {
            mode: mode.as_str(),
            pass,
            replayed,
            // Cells routed natively were the forward's to replay too.
            expected: expected.max(replayed + native),
        });
    }
    Ok(replayed as f64 / expected as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use r3_routing::LayerSpace;

    /// A table of `rows` tokens over 2 MoE layers, top-1 of 4 experts.
    fn table(rows: usize) -> RouteTable {
        let ids: Vec<i64> = (0..rows * 2).map(|i| (i % 4) as i64).collect();
        RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![1, 2], 0, &ids).expect("table")
    }

    fn proof(replayed: usize, native: usize) -> ReplayProof {
        ReplayProof {
            layers: vec![1, 2],
            replayed_cells: vec![replayed; 2],
            native_cells: vec![native; 2],
            differs_from_native: vec![0; 2],
            native_final_position: vec![native > 0],
        }
    }

    /// Every cell of the tables replayed and none routed natively verifies (fraction 1); a
    /// cell short, or a fed position left to the router (a table a row short of the
    /// forward), is an error naming the cells.
    #[test]
    fn a_proof_verifies_only_when_every_fed_cell_was_replayed() {
        let tables = [table(5)];
        let ok = verify_proof(&proof(5, 0), &tables, RouterReplay::R3, "update");
        assert_eq!(ok.expect("verified"), 1.0);
        let short = verify_proof(&proof(4, 0), &tables, RouterReplay::R3, "update");
        let e = short.expect_err("short").to_string();
        assert!(e.contains("8 of 10"), "{e}");
        let native = verify_proof(&proof(5, 1), &tables, RouterReplay::R2, "old-logp");
        let e = native.expect_err("a native cell").to_string();
        assert!(e.contains("10 of 12") && e.contains("R2 old-logp"), "{e}");
    }

    /// A NaN or infinite training log-prob is left out of the mismatch and counted (it had
    /// failed the whole step after its update was skipped); the rest give the statistics
    /// they give alone; no finite token at all is no statistics, not an error.
    #[test]
    fn non_finite_log_probs_are_counted_out_of_the_mismatch() {
        let train = [vec![-0.5, f32::NAN], vec![-1.0, f32::NEG_INFINITY, -2.0]];
        let rollout = [vec![-0.4, -0.3], vec![-1.2, -0.1, -2.0]];
        let (m, non_finite) = logp_mismatch(&train, &rollout).expect("mismatch");
        assert_eq!(non_finite, 2);
        let alone = mismatch_metrics(&[-0.5, -1.0, -2.0], &[-0.4, -1.2, -2.0], None).expect("m");
        assert_eq!(m, Some(alone));
        let (m, non_finite) = logp_mismatch(&[vec![f32::NAN]], &[vec![-0.1]]).expect("none");
        assert_eq!((m, non_finite), (None, 1));
        let ragged = logp_mismatch(&[vec![-0.1, -0.2]], &[vec![-0.1]]);
        assert!(ragged.expect_err("ragged").to_string().contains("row 0"));
    }
}
