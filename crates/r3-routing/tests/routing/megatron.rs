//! Megatron-Core's layer and token split: the examples Megatron documents, partition
//! invariants over many configurations, and replay ids gathered from route tables.

use r3_routing::megatron::{
    rank_tokens, replay_ids, Packing, PipelineSplit, TokenSlot, TokenSplit,
};
use r3_routing::{LayerSpace, RouteError, RouteTable};

fn chunks(split: &PipelineSplit, pp_rank: usize) -> Vec<Vec<usize>> {
    let vp = split.vp_size.unwrap_or(1);
    (0..vp)
        .map(|s| {
            let stage = split.vp_size.map(|_| s);
            split.chunk_layers(pp_rank, stage).unwrap().collect()
        })
        .collect()
}

#[test]
fn interleaved_examples_from_megatrons_docstring() {
    // "With 8 layers, 2 stages, and 4 model chunks: Stage 0: [0] [2] [4] [6]; Stage 1: [1]
    // [3] [5] [7]"; with 2 virtual stages: "Stage 0: [0, 1] [4, 5]; Stage 1: [2, 3] [6, 7]".
    let four = PipelineSplit::new(8, 2).with_vp_size(Some(4));
    assert_eq!(chunks(&four, 0), vec![vec![0], vec![2], vec![4], vec![6]]);
    assert_eq!(chunks(&four, 1), vec![vec![1], vec![3], vec![5], vec![7]]);
    let two = PipelineSplit::new(8, 2).with_vp_size(Some(2));
    assert_eq!(chunks(&two, 0), vec![vec![0, 1], vec![4, 5]]);
    assert_eq!(chunks(&two, 1), vec![vec![2, 3], vec![6, 7]]);
    // Every chunk of a rank in construction order when no vp_stage is named.
    assert_eq!(two.local_layers(1, None).unwrap(), vec![2, 3, 6, 7]);
}

fn configurations() -> Vec<PipelineSplit> {
    let mut out = Vec::new();
    for (layers, pp) in [(8, 1), (8, 2), (12, 4), (6, 3), (16, 4)] {
        out.push(PipelineSplit::new(layers, pp));
        for vp in [2, 4] {
            let s = PipelineSplit::new(layers, pp).with_vp_size(Some(vp));
            if pp > 1 && (layers / pp) % vp == 0 {
                out.push(s);
            }
        }
    }
    // Uneven first / last stages.
    for (layers, pp, first, last, vp) in [
        (10, 4, Some(1), Some(3), None),
        (10, 3, Some(2), None, None),
        (9, 3, None, Some(1), None),
        (12, 4, Some(2), Some(2), Some(2)),
        (7, 2, Some(3), Some(4), None),
    ] {
        out.push(PipelineSplit {
            first_stage_layers: first,
            last_stage_layers: last,
            ..PipelineSplit::new(layers, pp).with_vp_size(vp)
        });
    }
    // The embedding and loss counted as layers.
    for (layers, pp, emb, loss, vp) in [
        (7, 4, true, false, None),
        (6, 4, true, true, None),
        (7, 2, false, true, None),
        (6, 2, true, true, Some(2)),
    ] {
        out.push(PipelineSplit {
            account_for_embedding: emb,
            account_for_loss: loss,
            ..PipelineSplit::new(layers, pp).with_vp_size(vp)
        });
    }
    out
}

#[test]
fn chunks_partition_the_layers() {
    for split in configurations() {
        let mut seen = Vec::new();
        for pp_rank in 0..split.pp_size {
            for chunk in chunks(&split, pp_rank) {
                seen.extend(chunk);
            }
        }
        seen.sort_unstable();
        let all: Vec<usize> = (0..split.num_layers).collect();
        assert_eq!(seen, all, "{split:?}");
    }
}

#[test]
fn bad_ranks_and_splits_are_refused() {
    let s = PipelineSplit::new(8, 2);
    assert!(matches!(
        s.layer_offset(2, None),
        Err(RouteError::OutOfRange {
            what: "pp_rank",
            ..
        })
    ));
    let v = PipelineSplit::new(8, 2).with_vp_size(Some(2));
    assert!(v.layer_offset(0, Some(2)).is_err());
    assert!(v.num_layers_to_build(0, None).is_err());
    assert!(PipelineSplit::new(9, 2)
        .num_layers_to_build(0, None)
        .is_err());
    let too_many = PipelineSplit {
        first_stage_layers: Some(6),
        last_stage_layers: Some(6),
        ..PipelineSplit::new(8, 3)
    };
    assert!(too_many.num_layers_to_build(1, None).is_err());
}

fn split(sp_size: usize, sp_rank: usize, cp_size: usize, cp_rank: usize) -> TokenSplit {
    TokenSplit {
        sp_size,
        sp_rank,
        cp_size,
        cp_rank,
    }
}

fn positions(slots: &[TokenSlot]) -> Vec<Option<(usize, usize)>> {
    slots
        .iter()
        .map(|s| match *s {
            TokenSlot::Token { seq, pos } => Some((seq, pos)),
            TokenSlot::Pad => None,
        })
        .collect()
}

#[test]
fn zigzag_and_position_major_orders_by_hand() {
    // One sequence of 8, cp 2: 4 chunks of 2, rank 0 keeps chunks 0 and 3.
    let r0 = rank_tokens(&[8], Packing::Thd, split(1, 0, 2, 0)).unwrap();
    let got: Vec<_> = positions(&r0).into_iter().map(|p| p.unwrap().1).collect();
    assert_eq!(got, vec![0, 1, 6, 7]);
    // Lengths 5 and 3 packed, sp 2: padded to 6 and 4 (multiples of 2), then halves.
    let sp1 = rank_tokens(&[5, 3], Packing::Thd, split(2, 1, 1, 0)).unwrap();
    assert_eq!(
        positions(&sp1),
        vec![None, Some((1, 0)), Some((1, 1)), Some((1, 2)), None]
    );
    // Padded batch: position-major ([seq, batch] hidden states), the short one padded.
    let b = rank_tokens(&[2, 3], Packing::Bshd, TokenSplit::single()).unwrap();
    assert_eq!(
        positions(&b),
        vec![
            Some((0, 0)),
            Some((1, 0)),
            Some((0, 1)),
            Some((1, 1)),
            None,
            Some((1, 2))
        ]
    );
}

#[test]
fn ranks_cover_every_token_once_with_equal_shares() {
    let lens = [7usize, 1, 12, 5];
    for packing in [Packing::Thd, Packing::Bshd] {
        for (sp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 3), (2, 3)] {
            let mut seen = Vec::new();
            let mut sizes = Vec::new();
            for s in 0..sp {
                for c in 0..cp {
                    let slots = rank_tokens(&lens, packing, split(sp, s, cp, c)).unwrap();
                    sizes.push(slots.len());
                    seen.extend(positions(&slots).into_iter().flatten());
                }
            }
            seen.sort_unstable();
            let mut all: Vec<(usize, usize)> = Vec::new();
            for (seq, &n) in lens.iter().enumerate() {
                all.extend((0..n).map(|p| (seq, p)));
            }
            all.sort_unstable();
            assert_eq!(seen, all, "{packing:?} sp {sp} cp {cp}");
            assert!(sizes.windows(2).all(|w| w[0] == w[1]), "{sizes:?}");
        }
    }
}

fn table(rows: &[[[u32; 2]; 2]], start_pos: usize) -> RouteTable {
    let mut t =
        RouteTable::missing(8, 2, LayerSpace::MoeOnly, vec![1, 3], start_pos, rows.len()).unwrap();
    for (tok, row) in rows.iter().enumerate() {
        for (c, cell) in row.iter().enumerate() {
            t.set_cell(tok, c, cell).unwrap();
        }
    }
    t
}

#[test]
fn replay_ids_follow_the_rank_order_router_major() {
    // Sequence 0: 3 tokens (2 routed rows); sequence 1: 2 tokens (1 routed row).
    let a = table(&[[[1, 2], [3, 4]], [[5, 6], [7, 0]]], 0);
    let b = table(&[[[2, 7], [6, 5]]], 0);
    let r = replay_ids(&[&a, &b], &[3], Packing::Thd, TokenSplit::single()).unwrap();
    assert_eq!((r.num_routers, r.num_tokens, r.top_k), (1, 5, 2));
    // Layer 3 only; each sequence's last token replays the filler 0, 1.
    assert_eq!(r.ids, vec![3, 4, 7, 0, 0, 1, 6, 5, 0, 1]);
}

#[test]
fn replay_refuses_missing_and_offset_routes_naming_them() {
    let mut a = table(&[[[1, 2], [3, 4]], [[5, 6], [7, 0]]], 0);
    a.clear_cell(1, 0).unwrap();
    let e = replay_ids(&[&a], &[1, 3], Packing::Thd, TokenSplit::single()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("sequence 0") && msg.contains("token 1, layer 1"),
        "{msg}"
    );
    let late = table(&[[[1, 2], [3, 4]]], 4);
    let msg = replay_ids(&[&late], &[1], Packing::Thd, TokenSplit::single())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("position"), "{msg}");
    let ok = table(&[[[1, 2], [3, 4]]], 0);
    let msg = replay_ids(&[&ok], &[2], Packing::Thd, TokenSplit::single())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("layer 2"), "{msg}");
}
