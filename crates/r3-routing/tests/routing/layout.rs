//! LayerLayout from HF config rules.

use r3_routing::{LayerLayout, LayoutRules};

#[test]
fn deepseek_first_k_dense() {
    let rules = LayoutRules {
        first_k_dense_replace: 3,
        ..LayoutRules::all_moe(8, 64)
    };
    let l = LayerLayout::from_rules(&rules).unwrap();
    assert_eq!(l.moe_layers(), &[3, 4, 5, 6, 7]);
    assert_eq!(
        (l.moe_column(3), l.moe_column(2), l.moe_column(8)),
        (Some(0), None, None)
    );
    assert!(!l.is_moe(0) && l.is_moe(7));
}

#[test]
fn deepseek_moe_layer_freq() {
    let rules = LayoutRules {
        first_k_dense_replace: 1,
        moe_layer_freq: 2,
        ..LayoutRules::all_moe(8, 64)
    };
    assert_eq!(
        LayerLayout::from_rules(&rules).unwrap().moe_layers(),
        &[2, 4, 6]
    );
}

#[test]
fn qwen_sparse_step_and_mlp_only() {
    let rules = LayoutRules {
        decoder_sparse_step: 2,
        mlp_only_layers: vec![3],
        ..LayoutRules::all_moe(8, 60)
    };
    // (i+1) % 2 == 0 → 1, 3, 5, 7; 3 is forced dense.
    let l = LayerLayout::from_rules(&rules).unwrap();
    assert_eq!(l.moe_layers(), &[1, 5, 7]);
    assert_eq!(l.moe_column(5), Some(1));
}

#[test]
fn dense_model_and_bad_rules() {
    let dense = LayerLayout::from_rules(&LayoutRules::all_moe(4, 0)).unwrap();
    assert!(dense.moe_layers().is_empty());
    let zero_step = LayoutRules {
        decoder_sparse_step: 0,
        ..LayoutRules::all_moe(4, 8)
    };
    assert!(LayerLayout::from_rules(&zero_step).is_err());
    let bad_mlp = LayoutRules {
        mlp_only_layers: vec![9],
        ..LayoutRules::all_moe(4, 8)
    };
    assert!(LayerLayout::from_rules(&bad_mlp).is_err());
    assert!(LayerLayout::new(4, vec![1, 1]).is_err());
    assert!(LayerLayout::new(4, vec![4]).is_err());
    assert!(LayerLayout::first_k_dense(4, 5).is_err());
    assert_eq!(
        LayerLayout::new(4, vec![3, 1]).unwrap().moe_layers(),
        &[1, 3]
    );
}
