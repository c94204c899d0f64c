//! Aligning route rows with tokens. Row `i` of a table is the routing of the token at
//! absolute position `start_pos + i` when it was fed to the model; the last token of a
//! sequence is never fed, so a full sequence of `n` tokens has `n - 1 - start_len` rows.
//! Also merging the routes of a partial rollout that was aborted and resumed, with an
//! explicit policy — never a blind concatenation that duplicates prompt routes (verl #6029).

use serde::{Deserialize, Serialize};

use crate::{RouteError, RouteTable};

/// Rows a wire payload carries for a sequence of `total_tokens` tokens whose first
/// `start_len` positions were not captured: `total_tokens - 1 - start_len`.
pub fn expected_rows(total_tokens: usize, start_len: usize) -> Result<usize, RouteError> {
    total_tokens
        .checked_sub(1)
        .and_then(|n| n.checked_sub(start_len))
        .ok_or_else(|| RouteError::Misaligned {
            what: "routes",
            rows: start_len..start_len,
            against: 0..total_tokens.saturating_sub(1),
            rule:
                "they must start within the positions the sequence feeds (all but its last token)",
        })
}

/// Checks that `table` covers positions `[start_pos, total_tokens - 1)` exactly (every fed
/// token, not the last one).
pub fn check_covers_sequence(table: &RouteTable, total_tokens: usize) -> Result<(), RouteError> {
    let expected = expected_rows(total_tokens, table.start_pos())?;
    if table.num_tokens() != expected {
        return Err(RouteError::Misaligned {
            what: "route table rows",
            rows: table.start_pos()..table.end_pos(),
            against: table.start_pos()..table.start_pos() + expected,
            rule: "they must cover every fed position of the sequence (tokens - 1 - start rows)",
        });
    }
    Ok(())
}

/// How to combine the routes of an aborted call with those of the resumed call, which
/// re-processed prompt + already generated tokens and reports routes for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MergePolicy {
    /// Take the resumed call's full-sequence routes: every row then comes from one weight
    /// version (the newest), matching the weights the trainer replays with (verl #6029).
    ReplaceWithResumed,
    /// Keep each token's routes from the call that generated it: rows of the earlier call
    /// stay, the resumed call contributes only rows past its end (verl #6046).
    KeepPerTokenOrigin,
    /// slime's merge (`Sample._apply_meta_info` in `slime/utils/types.py`:
    /// `torch.cat([existing[:routed_experts_start_len], routed_experts])`): the earlier
    /// call's rows before the resumed call's first row stay, and every row from the resumed
    /// call's start on is the resumed call's, including rows the earlier call also holds.
    /// A resumed table starting at or before the earlier one's start replaces it whole
    /// (slime's `routed_experts_start_len == 0`).
    PreferResumedFromItsStart,
}

/// Merges the routes of an aborted call (`earlier`) with those of the resumed call.
/// The resumed table must cover at least everything `earlier` covered past its own start and
/// must not leave a gap; shapes and spaces must agree; per-row weight versions are kept.
pub fn merge_resumed(
    earlier: &RouteTable,
    resumed: &RouteTable,
    policy: MergePolicy,
) -> Result<RouteTable, RouteError> {
    earlier.check_same_shape(resumed)?;
    if resumed.end_pos() < earlier.end_pos() {
        return Err(RouteError::Misaligned {
            what: "resumed routes",
            rows: resumed.start_pos()..resumed.end_pos(),
            against: earlier.start_pos()..earlier.end_pos(),
            rule: "they end before the earlier call's end: rows would be lost",
        });
    }
    match policy {
        MergePolicy::ReplaceWithResumed => {
            if resumed.start_pos() > earlier.start_pos() {
                return Err(RouteError::Misaligned {
                    what: "resumed routes",
                    rows: resumed.start_pos()..resumed.end_pos(),
                    against: earlier.start_pos()..earlier.end_pos(),
                    rule: "they start after the earlier call's start: replacing would lose rows \
                           (use keep_per_token_origin for incremental routes)",
                });
            }
            Ok(resumed.clone())
        }
        MergePolicy::KeepPerTokenOrigin => {
            if resumed.start_pos() > earlier.end_pos() {
                return Err(RouteError::Misaligned {
                    what: "resumed routes",
                    rows: resumed.start_pos()..resumed.end_pos(),
                    against: earlier.start_pos()..earlier.end_pos(),
                    rule: "they start past the earlier call's end: a gap",
                });
            }
            let mut out = if resumed.start_pos() < earlier.start_pos() {
                // The resumed call also covers positions the earlier call never captured.
                let mut head = resumed.slice_rows(0, earlier.start_pos() - resumed.start_pos())?;
                head.append(earlier)?;
                head
            } else {
                earlier.clone()
            };
            let tail_from = earlier.end_pos() - resumed.start_pos();
            let tail = resumed.slice_rows(tail_from, resumed.num_tokens())?;
            out.append(&tail)?;
            Ok(out)
        }
        MergePolicy::PreferResumedFromItsStart => {
            // slime refuses "existing routed experts shorter than routed_experts_start_len":
            // the resumed rows must start within or right after the earlier ones.
            if resumed.start_pos() > earlier.end_pos() {
                return Err(RouteError::Misaligned {
                    what: "resumed routes",
                    rows: resumed.start_pos()..resumed.end_pos(),
                    against: earlier.start_pos()..earlier.end_pos(),
                    rule: "they start past the earlier call's end: a gap",
                });
            }
            if resumed.start_pos() <= earlier.start_pos() {
                return Ok(resumed.clone());
            }
            // existing[:start_len]: the earlier rows before the resumed call's first row.
            let mut out = earlier.slice_rows(0, resumed.start_pos() - earlier.start_pos())?;
            out.append(resumed)?;
            Ok(out)
        }
    }
}
