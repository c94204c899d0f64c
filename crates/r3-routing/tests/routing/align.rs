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

/// slime's merge of a resumed call's routes (`slime/utils/types.py`, `_apply_meta_info`):
/// `torch.cat([existing[:routed_experts_start_len], routed_experts])`, refusing
/// `existing.shape[0] < routed_experts_start_len`, and taking the new rows alone when
/// `routed_experts_start_len == 0`. slime's tables start at position 0, so `existing[:s]` are
/// positions 0..s. Rebuilt here on the rows' expert ids (position * 10 + salt).
fn slime_merge(existing: &[i64], start_len: usize, new: &[i64]) -> Option<Vec<i64>> {
    if start_len == 0 {
        return Some(new.to_vec());
    }
    if existing.len() < start_len {
        return None;
    }
    Some([&existing[..start_len], new].concat())
}

fn ids_of(t: &RouteTable) -> Vec<i64> {
    (0..t.num_tokens())
        .map(|p| i64::from(t.experts(p, 0).unwrap()[0]))
        .collect()
}

#[test]
fn prefer_resumed_from_its_start_is_slimes_merge() {
    let policy = MergePolicy::PreferResumedFromItsStart;
    // The review's case: the earlier call captured rows [0, 10), the resumed call
    // (routed_experts_start_len 6) rows [6, 14). slime takes rows 6-9 from the resumed call.
    let earlier = rows(0, 10, 1, 1);
    let resumed = rows(6, 14, 2, 2);
    let merged = merge_resumed(&earlier, &resumed, policy).unwrap();
    let want = slime_merge(&ids_of(&earlier), 6, &ids_of(&resumed)).unwrap();
    assert_eq!((merged.start_pos(), ids_of(&merged)), (0, want));
    assert_eq!(
        merged.versions().unwrap(),
        &[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    );
    assert_eq!(merged.experts(6, 0), Some(vec![62])); // the resumed call's row, not 61
    check_covers_sequence(&merged, 15).unwrap();
    // Neither older policy gives slime's table: one keeps rows 6-9 of the earlier call, the
    // other refuses a resumed table that starts later.
    let kept = merge_resumed(&earlier, &resumed, MergePolicy::KeepPerTokenOrigin).unwrap();
    assert_eq!(kept.experts(6, 0), Some(vec![61]));
    assert!(merge_resumed(&earlier, &resumed, MergePolicy::ReplaceWithResumed).is_err());
    // Every start slime accepts, against slime's rule: 0 (the new rows alone), inside the
    // earlier rows, and right at their end (a plain concatenation).
    for start in [0usize, 1, 5, 9, 10] {
        let resumed = rows(start, 14, 2, 2);
        let merged = merge_resumed(&earlier, &resumed, policy).unwrap();
        let want = slime_merge(&ids_of(&earlier), start, &ids_of(&resumed)).unwrap();
        assert_eq!(
            (merged.start_pos(), ids_of(&merged)),
            (0, want),
            "start {start}"
        );
    }
    // slime refuses a start past the existing rows; so does r3 (a gap).
    assert_eq!(slime_merge(&ids_of(&earlier), 11, &[]), None);
    let e = merge_resumed(&earlier, &rows(11, 14, 2, 2), policy).unwrap_err();
    assert!(e.to_string().contains("a gap"), "{e}");
    // Rows lost (a resumed call ending before the earlier one) and shapes are refused too.
    assert!(merge_resumed(&earlier, &rows(6, 9, 2, 2), policy).is_err());
    // An earlier table that starts late (positions 2..10): resumed from 6, positions 2..6
    // stay; resumed from 0, the resumed table covers it whole.
    let late = rows(2, 10, 1, 1);
    let merged = merge_resumed(&late, &rows(6, 14, 2, 2), policy).unwrap();
    assert_eq!((merged.start_pos(), merged.num_tokens()), (2, 12));
    assert_eq!(merged.versions().unwrap()[..5], [1, 1, 1, 1, 2]);
    assert_eq!(
        merge_resumed(&late, &rows(0, 14, 2, 2), policy).unwrap(),
        rows(0, 14, 2, 2)
    );
}
