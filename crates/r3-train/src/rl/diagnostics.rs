//! Training–inference diagnostics of one step, built on r3-routing's plain-slice metrics:
//! the log-prob mismatch between the rollout engine and the training engine at the old
//! weights, the routing divergence between rollout routes and the routes the training
//! engine chose, and the replay verification fraction.

use r3_model::ReplayProof;
use r3_routing::{divergence, mismatch_metrics, summarize, MismatchMetrics, RouteTable};

use crate::config::train::RouterReplay;
use crate::error::{Result, TrainError};

/// Mismatch of training vs rollout log-probs over all response tokens; `None` when there
/// are no response tokens.
pub fn logp_mismatch(
    train_logp: &[Vec<f32>],
    rollout_logp: &[Vec<f32>],
) -> Result<Option<MismatchMetrics>> {
    if train_logp.len() != rollout_logp.len() {
        return Err(TrainError::Length {
            what: "rollout log-prob rows (one per training row)".into(),
            got: rollout_logp.len(),
            expected: train_logp.len(),
        });
    }
    let train: Vec<f32> = train_logp.iter().flatten().copied().collect();
    let rollout: Vec<f32> = rollout_logp.iter().flatten().copied().collect();
    if train.is_empty() {
        return Ok(None);
    }
    Ok(Some(mismatch_metrics(&train, &rollout, None)?))
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
}
