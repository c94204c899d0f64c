//! Divergence statistics against hand-computed values, and zero self-divergence.

use proptest::prelude::*;
use r3_routing::{divergence, summarize, LayerSpace, RouteTable};

use crate::common::{moe_table, spec_strategy};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn hand_computed_divergence() {
    let a = RouteTable::from_flat(
        8,
        2,
        LayerSpace::MoeOnly,
        vec![0, 1, 2],
        0,
        &[
            0, 1, 2, 3, 4, 5, /**/ 0, 1, 2, 3, 4, 5, /**/ 0, 1, 2, 3, 4, 5,
        ],
    )
    .unwrap();
    let b = RouteTable::from_flat(
        8,
        2,
        LayerSpace::MoeOnly,
        vec![0, 1, 2],
        0,
        // t0: same set in another order | overlap 1 | same
        // t1: overlap 0 | same set | missing (skipped)
        // t2: identical
        &[
            1, 0, 2, 6, 4, 5, /**/ 6, 7, 3, 2, -1, -1, /**/ 0, 1, 2, 3, 4, 5,
        ],
    )
    .unwrap();
    let d = divergence(&a, &b).unwrap();
    assert_eq!(
        (d.compared_routers, d.differing_routers, d.skipped_missing),
        (8, 2, 1)
    );
    assert!(close(d.router_diff_fraction, 0.25));
    assert_eq!((d.compared_tokens, d.differing_tokens), (3, 2));
    assert!(close(d.token_diff_fraction, 2.0 / 3.0));
    assert!(close(d.mean_diff_layers_per_token, 2.0 / 3.0));
    assert_eq!(d.diff_layers_histogram, vec![1, 2, 0, 0]);
    // overlaps: t0 2,1,2; t1 0,2; t2 2,2,2 → 13 / (2 * 8)
    assert!(close(d.mean_overlap, 13.0 / 16.0));
    let l0 = &d.per_layer[0];
    assert_eq!((l0.layer, l0.compared, l0.differing), (0, 3, 1));
    assert!(close(l0.diff_fraction, 1.0 / 3.0) && close(l0.mean_overlap, 4.0 / 6.0));
    assert!(close(d.per_layer[1].mean_overlap, 5.0 / 6.0));
    let l2 = &d.per_layer[2];
    assert_eq!((l2.compared, l2.differing), (2, 0));
    assert!(close(l2.mean_overlap, 1.0));
    // Symmetric.
    let r = divergence(&b, &a).unwrap();
    assert_eq!((r.differing_routers, r.differing_tokens), (2, 2));
    assert!(close(r.mean_overlap, d.mean_overlap));
}

#[test]
fn summary_pools_sequences() {
    let t =
        |ids: &[i64]| RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![0, 1], 0, ids).unwrap();
    // seq 1: 2 tokens, one differing layer on token 0. seq 2: 1 token, both layers differ.
    let d1 = divergence(&t(&[0, 1, 2, 3]), &t(&[1, 1, 2, 3])).unwrap();
    let d2 = divergence(&t(&[0, 1]), &t(&[2, 3])).unwrap();
    let s = summarize(&[d1, d2]);
    assert!(close(s.router_diff_fraction, 3.0 / 6.0));
    assert!(close(s.token_diff_fraction, 2.0 / 3.0));
    // per-sequence means 0.5 and 2.0
    assert!(close(s.mean_seq_diff_layers_per_token, 1.25));
    assert_eq!(s.diff_layers_histogram, vec![1, 1, 1]);
}

#[test]
fn divergence_needs_same_rows() {
    let a = RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![0], 0, &[1, 2]).unwrap();
    let b = RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![0], 1, &[1, 2]).unwrap();
    assert!(divergence(&a, &b).is_err());
    let c = RouteTable::from_flat(5, 1, LayerSpace::MoeOnly, vec![0], 0, &[1, 2]).unwrap();
    assert!(divergence(&a, &c).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn self_divergence_is_zero(spec in spec_strategy(30)) {
        let t = moe_table(&spec);
        let d = divergence(&t, &t).unwrap();
        prop_assert_eq!(d.differing_routers, 0);
        prop_assert_eq!(d.differing_tokens, 0);
        prop_assert_eq!(d.router_diff_fraction, 0.0);
        prop_assert_eq!(d.token_diff_fraction, 0.0);
        prop_assert_eq!(d.mean_diff_layers_per_token, 0.0);
        prop_assert_eq!(d.mean_overlap, 1.0);
        prop_assert_eq!(d.compared_routers, t.num_present());
        prop_assert_eq!(d.diff_layers_histogram[0], d.compared_tokens);
    }
}
