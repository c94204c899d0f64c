//! tokens-1 rows, start_len, and partial-rollout resume merging (verl #6029 / #6046).

use r3_routing::{
    check_covers_sequence, expected_rows, merge_resumed, LayerSpace, MergePolicy, RouteError,
    RouteTable,
};

/// Rows [start, end) of one MoE layer, top-1, expert id = position * 10 + `salt` (mod 64),
/// weight version `version` on every row.
fn rows(start: usize, end: usize, salt: i64, version: u64) -> RouteTable {
    let ids: Vec<i64> = (start..end).map(|p| (p as i64 * 10 + salt) % 64).collect();
    let mut t = RouteTable::from_flat(64, 1, LayerSpace::MoeOnly, vec![0], start, &ids).unwrap();
    t.set_version_all(version);
    t
}

#[test]
fn tokens_minus_one_rows() {
    assert_eq!(expected_rows(10, 0).unwrap(), 9);
    assert_eq!(expected_rows(10, 4).unwrap(), 5);
    assert!(expected_rows(0, 0).is_err());
    assert!(expected_rows(5, 5).is_err());
    let t = rows(2, 9, 0, 0);
    check_covers_sequence(&t, 10).unwrap();
    // A table that also has a row for the last token is one row too many.
    assert!(check_covers_sequence(&t, 9).is_err());
}

/// Prompt of 3 tokens; call 1 (weights v1) generated A B C → 6 tokens, rows for 0..5.
/// Resumed call (weights v2) re-read all 6 and generated D E → 8 tokens, rows for 0..7.
#[test]
fn resume_policies() {
    let earlier = rows(0, 5, 1, 1);
    let resumed = rows(0, 7, 2, 2);

    let replaced = merge_resumed(&earlier, &resumed, MergePolicy::ReplaceWithResumed).unwrap();
    assert_eq!(replaced, resumed);
    check_covers_sequence(&replaced, 8).unwrap();

    let kept = merge_resumed(&earlier, &resumed, MergePolicy::KeepPerTokenOrigin).unwrap();
    check_covers_sequence(&kept, 8).unwrap();
    assert_eq!(kept.versions().unwrap(), &[1, 1, 1, 1, 1, 2, 2]);
    // Position 4 (token B fed in call 1) keeps call 1's route; position 5 (C, first fed by
    // the resumed call) comes from the resumed call.
    assert_eq!(kept.experts(4, 0), Some(vec![41]));
    assert_eq!(kept.experts(5, 0), Some(vec![52]));

    // The blind concatenation that duplicated prompt routes is refused.
    let mut blind = earlier.clone();
    assert!(matches!(
        blind.append(&resumed),
        Err(RouteError::Misaligned { .. })
    ));
}

#[test]
fn resume_with_incremental_routes() {
    // An engine that only reports the new rows: keep-per-token works, replace would lose rows.
    let earlier = rows(0, 5, 1, 1);
    let new_only = rows(5, 7, 2, 2);
    let kept = merge_resumed(&earlier, &new_only, MergePolicy::KeepPerTokenOrigin).unwrap();
    assert_eq!((kept.start_pos(), kept.num_tokens()), (0, 7));
    assert!(matches!(
        merge_resumed(&earlier, &new_only, MergePolicy::ReplaceWithResumed),
        Err(RouteError::Misaligned { .. })
    ));
}

#[test]
fn resume_errors() {
    let earlier = rows(0, 5, 1, 1);
    // Gap between the calls.
    assert!(merge_resumed(&earlier, &rows(6, 8, 2, 2), MergePolicy::KeepPerTokenOrigin).is_err());
    // Resumed call ends before the earlier one: rows would be lost.
    for p in [
        MergePolicy::KeepPerTokenOrigin,
        MergePolicy::ReplaceWithResumed,
    ] {
        assert!(merge_resumed(&earlier, &rows(0, 4, 2, 2), p).is_err());
    }
    // Different shapes.
    let other = RouteTable::from_flat(64, 1, LayerSpace::MoeOnly, vec![1], 0, &[1; 7]).unwrap();
    assert!(matches!(
        merge_resumed(&earlier, &other, MergePolicy::ReplaceWithResumed),
        Err(RouteError::Shape { .. })
    ));
}

#[test]
fn keep_per_token_fills_positions_the_earlier_call_did_not_capture() {
    let earlier = rows(2, 5, 1, 1);
    let resumed = rows(0, 7, 2, 2);
    let kept = merge_resumed(&earlier, &resumed, MergePolicy::KeepPerTokenOrigin).unwrap();
    assert_eq!(kept.start_pos(), 0);
    assert_eq!(kept.versions().unwrap(), &[2, 2, 1, 1, 1, 2, 2]);
}
