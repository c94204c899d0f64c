//! Expert-load statistics against hand-computed values.

use r3_routing::load::max_violation;
use r3_routing::{expert_load, summed_expert_load, LayerSpace, RouteTable};

#[test]
fn hand_computed_load() {
    // layer 2: [0,1],[0,2],[0,3] → counts [3,1,1,1], mean 1.5, max 3 → violation 1.0
    // layer 5: [0,1],[2,3],missing → counts [1,1,1,1] → 0
    let t = RouteTable::from_flat(
        4,
        2,
        LayerSpace::MoeOnly,
        vec![2, 5],
        0,
        &[0, 1, 0, 1, 0, 2, 2, 3, 0, 3, -1, -1],
    )
    .unwrap();
    let load = expert_load(&t);
    assert_eq!(load.per_layer[0].counts, vec![3, 1, 1, 1]);
    assert_eq!(load.per_layer[0].layer, 2);
    assert!((load.per_layer[0].max_violation - 1.0).abs() < 1e-12);
    assert_eq!(load.per_layer[1].counts, vec![1, 1, 1, 1]);
    assert_eq!(load.per_layer[1].max_violation, 0.0);
    assert!((load.mean_max_violation - 0.5).abs() < 1e-12);
    assert!((load.max_max_violation - 1.0).abs() < 1e-12);
    assert_eq!(max_violation(&[]), 0.0);
    assert_eq!(max_violation(&[0, 0]), 0.0);
}

#[test]
fn summed_load_adds_tables_and_recomputes_the_violation() {
    // Layer 2 of table a: [0,1] → [1,1,0,0]; of table b: [0,2],[0,3] → [2,0,1,1].
    // Sum [3,1,1,1]: mean 1.5, max 3 → violation 1.0 (neither table's own violation).
    let a = RouteTable::from_flat(4, 2, LayerSpace::MoeOnly, vec![2], 0, &[0, 1]).unwrap();
    let b = RouteTable::from_flat(4, 2, LayerSpace::MoeOnly, vec![2], 0, &[0, 2, 0, 3]).unwrap();
    let sum = summed_expert_load(&[a.clone(), b]).unwrap();
    assert_eq!(sum.per_layer.len(), 1);
    assert_eq!(sum.per_layer[0].layer, 2);
    assert_eq!(sum.per_layer[0].counts, vec![3, 1, 1, 1]);
    assert!((sum.per_layer[0].max_violation - 1.0).abs() < 1e-12);
    assert!((sum.max_max_violation - 1.0).abs() < 1e-12);
    assert!(summed_expert_load(&[]).unwrap().per_layer.is_empty());
    // Tables of other layers or another expert count do not add up.
    let other_layer =
        RouteTable::from_flat(4, 2, LayerSpace::MoeOnly, vec![3], 0, &[0, 1]).unwrap();
    let err = summed_expert_load(&[a.clone(), other_layer]).unwrap_err();
    assert!(err.to_string().contains("MoE layers"), "{err}");
    let other_experts =
        RouteTable::from_flat(8, 2, LayerSpace::MoeOnly, vec![2], 0, &[0, 7]).unwrap();
    let err = summed_expert_load(&[a, other_experts]).unwrap_err();
    assert!(err.to_string().contains("num_experts"), "{err}");
}
