//! EPLB placement: physical → logical conversion and its errors.

use r3_routing::{ExpertPlacement, LayerSpace, RouteError, RouteTable};

fn placement() -> ExpertPlacement {
    // 6 physical slots for 4 logical experts; experts 0 and 1 are replicated.
    ExpertPlacement::new(4, vec![0, 1, 2, 3, 0, 1]).unwrap()
}

#[test]
fn physical_table_to_logical() {
    let phys = RouteTable::from_flat(
        6,
        2,
        LayerSpace::MoeOnly,
        vec![1, 2],
        7,
        &[4, 2, 5, 3, -1, -1, 1, 0],
    )
    .unwrap();
    let logical = placement().to_logical(&phys).unwrap();
    assert_eq!(logical.num_experts(), 4);
    assert_eq!(logical.experts(0, 0), Some(vec![0, 2]));
    assert_eq!(logical.experts(0, 1), Some(vec![1, 3]));
    assert!(!logical.is_present(1, 0));
    assert_eq!(logical.start_pos(), 7);
}

#[test]
fn physical_id_out_of_range_is_an_error() {
    let err = placement()
        .flat_to_logical(&[0, 1, 2, 6], &[3, 4], 2, 10)
        .unwrap_err();
    assert_eq!(
        err,
        RouteError::PhysicalOutOfRange {
            token: 10,
            layer: 4,
            value: 6,
            num_slots: 6
        }
    );
    // A table declared with the logical count cannot be read as physical.
    let t = RouteTable::from_flat(4, 1, LayerSpace::MoeOnly, vec![0], 0, &[3]).unwrap();
    assert!(matches!(
        placement().to_logical(&t),
        Err(RouteError::Shape { .. })
    ));
}

#[test]
fn two_replicas_of_one_expert_in_a_row_is_an_error() {
    let phys = RouteTable::from_flat(6, 2, LayerSpace::MoeOnly, vec![0], 0, &[1, 5]).unwrap();
    assert_eq!(
        placement().to_logical(&phys).unwrap_err(),
        RouteError::DuplicateExpert {
            token: 0,
            layer: 0,
            expert: 1
        }
    );
}

#[test]
fn bad_placements() {
    assert!(ExpertPlacement::new(4, vec![0, 1, 2]).is_err()); // expert 3 has no slot
    assert!(ExpertPlacement::new(4, vec![0, 1, 2, 3, 4]).is_err()); // logical 4 out of range
    let id = ExpertPlacement::identity(3);
    assert_eq!(
        (id.num_slots(), id.logical(2), id.logical(3)),
        (3, Some(2), None)
    );
}
