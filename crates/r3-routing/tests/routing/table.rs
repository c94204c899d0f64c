//! RouteTable construction, validation errors, slicing, appending and versions.

use r3_routing::{LayerLayout, LayerSpace, RouteError, RouteTable};

fn moe(layers: Vec<usize>, start: usize, ids: &[i64]) -> Result<RouteTable, RouteError> {
    RouteTable::from_flat(8, 2, LayerSpace::MoeOnly, layers, start, ids)
}

#[test]
fn from_flat_marks_negative_cells_missing() {
    let t = moe(vec![1, 3], 10, &[0, 1, -1, -1, 2, 3, 4, 5]).unwrap();
    assert_eq!((t.num_tokens(), t.num_columns(), t.start_pos()), (2, 2, 10));
    assert!(t.is_present(0, 0) && !t.is_present(0, 1));
    assert_eq!(t.experts(0, 1), None);
    assert_eq!(t.experts(1, 1), Some(vec![4, 5]));
    let err = t.column_ids(1).unwrap_err();
    assert_eq!(
        err,
        RouteError::MissingRoute {
            token: 10,
            layer: 3
        }
    );
    assert_eq!(t.column_ids(0).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(t.column_ids_range(1, 1, 2).unwrap(), vec![4, 5]);
}

#[test]
fn from_columns_matches_from_flat() {
    let cols = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
    let a = RouteTable::from_columns(8, 2, LayerSpace::MoeOnly, vec![1, 3], 0, &cols).unwrap();
    let b = moe(vec![1, 3], 0, &[0, 1, 4, 5, 2, 3, 6, 7]).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.column_ids(1).unwrap(), cols[1]);
}

#[test]
fn out_of_range_id_names_token_layer_value() {
    let err = moe(vec![2, 5], 4, &[0, 1, 2, 3, 6, 7, 1, 8]).unwrap_err();
    assert_eq!(
        err,
        RouteError::ExpertOutOfRange {
            token: 5,
            layer: 5,
            value: 8,
            num_experts: 8
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("token 5") && msg.contains("layer 5") && msg.contains('8'),
        "{msg}"
    );
}

#[test]
fn duplicate_expert_in_a_row_is_an_error() {
    let err = moe(vec![0], 0, &[3, 3]).unwrap_err();
    assert_eq!(
        err,
        RouteError::DuplicateExpert {
            token: 0,
            layer: 0,
            expert: 3
        }
    );
}

#[test]
fn all_zero_row_is_never_expert_zero() {
    let err = moe(vec![0], 7, &[0, 0]).unwrap_err();
    assert_eq!(
        err,
        RouteError::ZeroCell {
            token: 7,
            layer: 0,
            top_k: 2
        }
    );
}

#[test]
fn partially_missing_cell_is_an_error() {
    let err = moe(vec![0], 0, &[-1, 3]).unwrap_err();
    assert_eq!(
        err,
        RouteError::PartiallyMissing {
            token: 0,
            layer: 0,
            value: -1
        }
    );
}

#[test]
fn wrong_lengths_are_errors() {
    assert!(matches!(
        moe(vec![0, 1], 0, &[0, 1, 2]),
        Err(RouteError::Ragged {
            len: 3,
            unit: 4,
            ..
        })
    ));
    let cols = vec![vec![0, 1], vec![0, 1, 2, 3]];
    assert!(matches!(
        RouteTable::from_columns(8, 2, LayerSpace::MoeOnly, vec![0, 1], 0, &cols),
        Err(RouteError::Length { .. })
    ));
    assert!(matches!(
        RouteTable::from_columns(8, 2, LayerSpace::MoeOnly, vec![0, 1, 2], 0, &cols),
        Err(RouteError::Length { .. })
    ));
    let mut t = moe(vec![0], 0, &[0, 1]).unwrap();
    assert!(matches!(
        t.set_cell(0, 0, &[1]),
        Err(RouteError::Length { .. })
    ));
    assert!(matches!(
        t.set_versions(vec![1, 2]),
        Err(RouteError::Length { .. })
    ));
}

#[test]
fn bad_headers_are_errors() {
    assert!(RouteTable::from_flat(0, 1, LayerSpace::MoeOnly, vec![0], 0, &[]).is_err());
    assert!(RouteTable::from_flat(4, 5, LayerSpace::MoeOnly, vec![0], 0, &[]).is_err());
    assert!(RouteTable::from_flat(4, 0, LayerSpace::MoeOnly, vec![0], 0, &[]).is_err());
    assert!(RouteTable::from_flat(70_000, 1, LayerSpace::MoeOnly, vec![0], 0, &[]).is_err());
    // Column layers must ascend; all-layers columns must be 0..L.
    assert!(RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![2, 1], 0, &[]).is_err());
    assert!(RouteTable::from_flat(4, 1, LayerSpace::AllLayers, vec![1, 2], 0, &[]).is_err());
}

#[test]
fn u16_storage_above_256_experts() {
    let t = RouteTable::from_flat(1000, 2, LayerSpace::MoeOnly, vec![0], 0, &[999, 300]).unwrap();
    assert_eq!(t.experts(0, 0), Some(vec![999, 300]));
    let small = RouteTable::from_flat(256, 2, LayerSpace::MoeOnly, vec![0], 0, &[255, 0]).unwrap();
    assert_eq!(small.experts(0, 0), Some(vec![255, 0]));
}

#[test]
fn slice_and_append_restore_the_table() {
    let ids: Vec<i64> = vec![0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4];
    let mut t = moe(vec![1, 3], 5, &ids).unwrap();
    t.set_versions(vec![1, 1, 2]).unwrap();
    let mut head = t.slice_rows(0, 1).unwrap();
    let tail = t.slice_rows(1, 3).unwrap();
    assert_eq!(
        (tail.start_pos(), tail.versions()),
        (6, Some(&[1u64, 2][..]))
    );
    head.append(&tail).unwrap();
    assert_eq!(head, t);
    assert!(t.slice_rows(2, 4).is_err());
    assert!(t.slice_rows(2, 1).is_err());
}

#[test]
fn misaligned_append_is_an_error() {
    let mut a = moe(vec![0], 0, &[0, 1, 2, 3]).unwrap();
    // Full-sequence routes of a resumed call start at 0 again: a blind concat must fail.
    let again = moe(vec![0], 0, &[0, 1, 2, 3, 4, 5]).unwrap();
    assert!(matches!(
        a.append(&again),
        Err(RouteError::Misaligned { .. })
    ));
    let gap = moe(vec![0], 3, &[4, 5]).unwrap();
    assert!(matches!(a.append(&gap), Err(RouteError::Misaligned { .. })));
    let other_layers = moe(vec![1], 2, &[4, 5]).unwrap();
    assert!(matches!(
        a.append(&other_layers),
        Err(RouteError::Shape { .. })
    ));
    let ok = moe(vec![0], 2, &[4, 5]).unwrap();
    a.append(&ok).unwrap();
    assert_eq!(a.num_tokens(), 3);
}

#[test]
fn to_moe_only_rejects_nonzero_dense_column() {
    let layout = LayerLayout::first_k_dense(3, 1).unwrap();
    let all = RouteTable::from_flat(
        8,
        2,
        LayerSpace::AllLayers,
        vec![0, 1, 2],
        0,
        &[4, 5, 0, 1, 2, 3],
    )
    .unwrap();
    let err = all.to_moe_only(&layout).unwrap_err();
    assert_eq!(
        err,
        RouteError::DenseColumnNotEmpty {
            token: 0,
            layer: 0,
            value: 4
        }
    );
    let ok = RouteTable::from_flat(
        8,
        2,
        LayerSpace::AllLayers,
        vec![0, 1, 2],
        0,
        &[-1, -1, 0, 1, 2, 3],
    )
    .unwrap();
    let m = ok.to_moe_only(&layout).unwrap();
    assert_eq!(m.layers(), &[1, 2]);
    assert_eq!(m.experts(0, 0), Some(vec![0, 1]));
    assert_eq!(m.experts(0, 1), Some(vec![2, 3]));
    // Back to all layers, the dense column is missing (not zero).
    let back = m.to_all_layers(&layout).unwrap();
    assert!(!back.is_present(0, 0));
    assert_eq!(back.experts(0, 2), Some(vec![2, 3]));
}

#[test]
fn space_conversion_checks_layer_count() {
    let layout = LayerLayout::first_k_dense(4, 1).unwrap();
    let all3 =
        RouteTable::from_flat(8, 1, LayerSpace::AllLayers, vec![0, 1, 2], 0, &[1, 2, 3]).unwrap();
    assert!(matches!(
        all3.to_moe_only(&layout),
        Err(RouteError::Shape { .. })
    ));
    let wrong_moe = moe(vec![0, 1, 2], 0, &[0, 1, 2, 3, 4, 5]).unwrap();
    assert!(matches!(
        wrong_moe.to_all_layers(&layout),
        Err(RouteError::Shape { .. })
    ));
}

#[test]
fn set_and_clear_cells() {
    let mut t = RouteTable::missing(16, 2, LayerSpace::MoeOnly, vec![3], 0, 2).unwrap();
    assert_eq!(t.num_present(), 0);
    t.set_cell(1, 0, &[9, 4]).unwrap();
    assert_eq!(t.experts(1, 0), Some(vec![9, 4]));
    assert!(t.set_cell(2, 0, &[1, 2]).is_err());
    assert!(t.set_cell(0, 1, &[1, 2]).is_err());
    assert_eq!(
        t.set_cell(0, 0, &[16, 2]).unwrap_err(),
        RouteError::ExpertOutOfRange {
            token: 0,
            layer: 3,
            value: 16,
            num_experts: 16
        }
    );
    t.clear_cell(1, 0).unwrap();
    assert_eq!(
        t,
        RouteTable::missing(16, 2, LayerSpace::MoeOnly, vec![3], 0, 2).unwrap()
    );
}

/// Every column written in one row-major pass equals `column_ids_range` per column, on
/// generated tables of u8 and u16 ids over row ranges; `columns_equal` accepts exactly what
/// was written and rejects one changed id (and the same experts in another order); a
/// missing cell is the error `column_ids_range` names, and wrong destinations are errors.
#[test]
fn columns_at_once_equal_columns_one_by_one() {
    use crate::common::{moe_table, Spec};
    for (num_experts, seed) in [(64, 1u64), (300, 2)] {
        let spec = Spec {
            num_experts,
            top_k: 3,
            num_layers: 5,
            first_k_dense: 1,
            tokens: 37,
            start_pos: 4,
            missing_pct: 0,
            seed,
        };
        let t = moe_table(&spec);
        let (k, cols) = (t.top_k(), t.num_columns());
        for (from, to) in [(0, t.num_tokens()), (5, 19), (7, 7)] {
            let want: Vec<Vec<u32>> = (0..cols)
                .map(|c| t.column_ids_range(c, from, to).expect("column"))
                .collect();
            let mut got: Vec<Vec<u32>> =
                (0..cols).map(|_| vec![u32::MAX; (to - from) * k]).collect();
            let mut dst: Vec<&mut [u32]> = got.iter_mut().map(|c| c.as_mut_slice()).collect();
            t.write_columns(from, to, &mut dst).expect("write");
            assert_eq!(got, want, "{num_experts} experts, rows {from}..{to}");
            let views: Vec<&[u32]> = got.iter().map(|c| c.as_slice()).collect();
            assert!(t.columns_equal(from, to, &views).expect("equal"));
            if to > from {
                let mut changed = got.clone();
                changed[cols - 1][0] = (changed[cols - 1][0] + 1) % num_experts as u32;
                let views: Vec<&[u32]> = changed.iter().map(|c| c.as_slice()).collect();
                assert!(!t.columns_equal(from, to, &views).expect("changed"));
                let mut swapped = got.clone();
                swapped[0].swap(0, 1);
                let views: Vec<&[u32]> = swapped.iter().map(|c| c.as_slice()).collect();
                assert!(!t.columns_equal(from, to, &views).expect("reordered"));
            }
        }
        let mut short = vec![vec![0u32; 2]; cols];
        let mut dst: Vec<&mut [u32]> = short.iter_mut().map(|c| c.as_mut_slice()).collect();
        assert!(
            t.write_columns(0, 5, &mut dst).is_err(),
            "short destinations"
        );
        let mut few = vec![vec![0u32; 5 * k]; cols - 1];
        let mut dst: Vec<&mut [u32]> = few.iter_mut().map(|c| c.as_mut_slice()).collect();
        assert!(t.write_columns(0, 5, &mut dst).is_err(), "a column short");
    }
    let gap = RouteTable::from_flat(
        8,
        2,
        LayerSpace::MoeOnly,
        vec![1, 3],
        10,
        &[0, 1, -1, -1, 2, 3, 4, 5],
    )
    .expect("table");
    let mut cols = vec![vec![0u32; 4]; 2];
    let mut dst: Vec<&mut [u32]> = cols.iter_mut().map(|c| c.as_mut_slice()).collect();
    assert_eq!(
        gap.write_columns(0, 2, &mut dst).unwrap_err(),
        RouteError::MissingRoute {
            token: 10,
            layer: 3
        }
    );
}
