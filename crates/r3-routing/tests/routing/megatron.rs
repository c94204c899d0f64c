//! Megatron-Core's layer and token split: the examples Megatron documents, partition
//! invariants over many configurations, and replay ids gathered from route tables.

use r3_routing::megatron::{
    rank_tokens, replay_ids, replay_ids_with_lens, LayoutLayer, Packing, Padding, PipelineLayout,
    PipelineSplit, TokenSlot, TokenSplit, MAX_BATCH_TOKENS, MAX_LAYOUT_CHARS,
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
    let r0 = rank_tokens(&[8], Packing::Thd, split(1, 0, 2, 0), Padding::Aligned).unwrap();
    let got: Vec<_> = positions(&r0).into_iter().map(|p| p.unwrap().1).collect();
    assert_eq!(got, vec![0, 1, 6, 7]);
    // Lengths 5 and 3 packed, sp 2: padded to 6 and 4 (multiples of 2), then halves.
    let sp1 = rank_tokens(&[5, 3], Packing::Thd, split(2, 1, 1, 0), Padding::Aligned).unwrap();
    assert_eq!(
        positions(&sp1),
        vec![None, Some((1, 0)), Some((1, 1)), Some((1, 2)), None]
    );
    // Padded batch: position-major ([seq, batch] hidden states), the short one padded.
    let b = rank_tokens(
        &[2, 3],
        Packing::Bshd,
        TokenSplit::single(),
        Padding::Aligned,
    )
    .unwrap();
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
                    let slots =
                        rank_tokens(&lens, packing, split(sp, s, cp, c), Padding::Aligned).unwrap();
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
    let r = replay_ids(
        &[&a, &b],
        &[3],
        Packing::Thd,
        TokenSplit::single(),
        Padding::Aligned,
    )
    .unwrap();
    assert_eq!((r.num_routers, r.num_tokens, r.top_k), (1, 5, 2));
    // Layer 3 only; each sequence's last token (the rank's tokens 2 and 4) replays the
    // filler (t·2 + j) mod 8: experts 4, 5 and 0, 1.
    assert_eq!(r.ids, vec![3, 4, 7, 0, 4, 5, 6, 5, 0, 1]);
}

#[test]
fn replay_refuses_missing_and_offset_routes_naming_them() {
    let mut a = table(&[[[1, 2], [3, 4]], [[5, 6], [7, 0]]], 0);
    a.clear_cell(1, 0).unwrap();
    let e = replay_ids(
        &[&a],
        &[1, 3],
        Packing::Thd,
        TokenSplit::single(),
        Padding::Aligned,
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("sequence 0") && msg.contains("token 1, layer 1"),
        "{msg}"
    );
    let late = table(&[[[1, 2], [3, 4]]], 4);
    let msg = replay_ids(
        &[&late],
        &[1],
        Packing::Thd,
        TokenSplit::single(),
        Padding::Aligned,
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("position"), "{msg}");
    let ok = table(&[[[1, 2], [3, 4]]], 0);
    let msg = replay_ids(
        &[&ok],
        &[2],
        Packing::Thd,
        TokenSplit::single(),
        Padding::Aligned,
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("layer 2"), "{msg}");
}

#[test]
fn filler_rows_are_distinct_and_spread_over_every_expert() {
    // Two sequences of 2 and 4 tokens (1 and 3 routed rows), sp 4: each padded to 4, every
    // rank holding 2 slots. The routed cells are [1, 2] everywhere, so only the filler can
    // reach other experts: the rank's t-th slot, if not routed, replays (2t, 2t + 1) mod 8.
    let a = table(&[[[1, 2], [1, 2]]], 0);
    let b = table(&[[[1, 2], [1, 2]]; 3], 0);
    let mut filler = Vec::new();
    for sp_rank in 0..4 {
        let sp = split(4, sp_rank, 1, 0);
        let r = replay_ids(&[&a, &b], &[1], Packing::Thd, sp, Padding::Aligned).unwrap();
        let slots = rank_tokens(&[2, 4], Packing::Thd, sp, Padding::Aligned).unwrap();
        for (t, (row, slot)) in r.ids.chunks(2).zip(&slots).enumerate() {
            if matches!(*slot, TokenSlot::Token { seq, pos } if pos + 1 < [2, 4][seq]) {
                assert_eq!(row, [1, 2]);
            } else {
                filler.push((sp_rank, t, row.to_vec()));
            }
        }
    }
    // Rank 0: a's last token; rank 1: two pads; rank 3: b's last token. Before, every one
    // of these rows was [0, 1].
    assert_eq!(
        filler,
        vec![
            (0, 1, vec![2, 3]),
            (1, 0, vec![0, 1]),
            (1, 1, vec![2, 3]),
            (3, 1, vec![2, 3])
        ]
    );
    // top_k close to num_experts (2 of 3) still gives distinct ids in each row: one routed
    // row [2, 0], then the last token and two pads of a batch padded to 4.
    let mut wide = RouteTable::missing(3, 2, LayerSpace::MoeOnly, vec![0], 0, 1).unwrap();
    wide.set_cell(0, 0, &[2, 0]).unwrap();
    let one = TokenSplit::single();
    let r = replay_ids(&[&wide], &[0], Packing::Bshd, one, Padding::SeqLen(4)).unwrap();
    assert_eq!(r.ids, vec![2, 0, 2, 0, 1, 2, 0, 1]);
    let e = replay_ids(&[&wide], &[0], Packing::Thd, one, Padding::SeqLen(4)).unwrap_err();
    assert!(e.to_string().contains("padded_len is for bshd"), "{e}");
}

#[test]
fn explicit_padding_is_followed_and_checked_against_the_sequences() {
    // thd: lengths 5 and 3 padded by the caller to 8 and 4 (more than the alignment 2 of sp 2).
    let cu = [0usize, 8, 12];
    let both: Vec<_> = (0..2)
        .flat_map(|r| {
            let sp = split(2, r, 1, 0);
            positions(&rank_tokens(&[5, 3], Packing::Thd, sp, Padding::CuSeqlens(&cu)).unwrap())
        })
        .collect();
    let mut want: Vec<Option<(usize, usize)>> = (0..5).map(|p| Some((0, p))).collect();
    want.extend([None, None, None]);
    want.extend((0..3).map(|p| Some((1, p))));
    want.push(None);
    assert_eq!(both, want);
    // cu_seqlens_padded equal to the inferred padding gives the same tokens.
    let lens = [9usize, 3, 14];
    for (sp, cp) in [(1, 2), (2, 2), (2, 1), (1, 3)] {
        let align = if cp > 1 { 2 * cp * sp } else { sp };
        let mut cu = vec![0usize];
        for n in lens {
            cu.push(cu.last().unwrap() + n.div_ceil(align) * align);
        }
        for (s, c) in (0..sp).flat_map(|s| (0..cp).map(move |c| (s, c))) {
            let ts = split(sp, s, cp, c);
            let inferred = rank_tokens(&lens, Packing::Thd, ts, Padding::Aligned).unwrap();
            let given = rank_tokens(&lens, Packing::Thd, ts, Padding::CuSeqlens(&cu)).unwrap();
            assert_eq!(inferred, given, "sp {sp} cp {cp}");
        }
    }
    // Megatron splits the packed tokens over sp as a whole: only the total must divide.
    let sp1 = split(2, 1, 1, 0);
    let halves = rank_tokens(&[5, 3], Packing::Thd, sp1, Padding::CuSeqlens(&[0, 5, 8]));
    assert_eq!(
        positions(&halves.unwrap()),
        vec![Some((0, 4)), Some((1, 0)), Some((1, 1)), Some((1, 2))]
    );
    // bshd: a longer padded batch adds pad positions.
    let b = rank_tokens(
        &[2, 3],
        Packing::Bshd,
        TokenSplit::single(),
        Padding::SeqLen(4),
    );
    let mut want = positions(
        &rank_tokens(
            &[2, 3],
            Packing::Bshd,
            TokenSplit::single(),
            Padding::Aligned,
        )
        .unwrap(),
    );
    want.extend([None, None]);
    assert_eq!(positions(&b.unwrap()), want);
    // 4 positions over cp 2 leave 2 per rank, which sp 2 splits.
    let b = rank_tokens(
        &[2, 3],
        Packing::Bshd,
        split(2, 1, 2, 1),
        Padding::SeqLen(4),
    );
    assert_eq!(b.unwrap().len(), 2);
    // Refusals name what is wrong.
    let (one, cp2, sp2) = (TokenSplit::single(), split(1, 0, 2, 0), split(2, 0, 1, 0));
    let (thd, bshd) = (Packing::Thd, Packing::Bshd);
    let cases: [(Packing, TokenSplit, Padding, &str); 10] = [
        (
            thd,
            one,
            Padding::CuSeqlens(&[0, 8]),
            "cu_seqlens_padded has 2 entries; 2 sequences need 3",
        ),
        (thd, one, Padding::CuSeqlens(&[1, 8, 12]), "starts at 1"),
        (
            thd,
            one,
            Padding::CuSeqlens(&[0, 8, 7]),
            "decreases at sequence 1",
        ),
        (
            thd,
            one,
            Padding::CuSeqlens(&[0, 4, 8]),
            "sequence 0 4 tokens, fewer than its 5",
        ),
        (
            thd,
            cp2,
            Padding::CuSeqlens(&[0, 6, 10]),
            "sequence 0 6 tokens, not a multiple of 2·cp = 4",
        ),
        (
            thd,
            sp2,
            Padding::CuSeqlens(&[0, 5, 9]),
            "9 tokens do not split evenly over sp 2",
        ),
        (
            bshd,
            one,
            Padding::CuSeqlens(&[0, 5, 8]),
            "cu_seqlens_padded is for packed (thd)",
        ),
        (
            bshd,
            one,
            Padding::SeqLen(4),
            "padded_len 4 is shorter than sequence 0's 5 tokens",
        ),
        (bshd, cp2, Padding::SeqLen(6), "padded_len 6 does not split"),
        (bshd, sp2, Padding::SeqLen(5), "padded_len 5 does not split"),
    ];
    for (packing, ts, padding, want) in cases {
        let msg = rank_tokens(&[5, 3], packing, ts, padding)
            .unwrap_err()
            .to_string();
        assert!(msg.contains(want), "{packing:?} {padding:?}: {msg}");
    }
}

#[test]
fn huge_arguments_are_refused_before_anything_is_built() {
    let one = TokenSplit::single();
    for packing in [Packing::Thd, Packing::Bshd] {
        let msg = rank_tokens(&[1_000_000_000_000_000], packing, one, Padding::Aligned)
            .unwrap_err()
            .to_string();
        assert!(msg.contains(&MAX_BATCH_TOKENS.to_string()), "{msg}");
        // Near usize::MAX, rounding up would overflow.
        assert!(rank_tokens(&[usize::MAX], packing, split(3, 0, 1, 0), Padding::Aligned).is_err());
        // Many sequences that each fit but together do not.
        let lens = vec![1 << 20; 1 << 7];
        assert!(rank_tokens(&lens, packing, one, Padding::Aligned).is_err());
    }
    let msg = rank_tokens(
        &[4],
        Packing::Thd,
        split(1, 0, usize::MAX / 2, 0),
        Padding::Aligned,
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("alignment exceeds"), "{msg}");
    assert!(rank_tokens(
        &[4],
        Packing::Thd,
        one,
        Padding::CuSeqlens(&[0, usize::MAX])
    )
    .is_err());
    assert!(rank_tokens(&[4], Packing::Bshd, one, Padding::SeqLen(usize::MAX)).is_err());
    let huge = PipelineSplit::new(1_000_000_000_000_000, 1);
    assert!(matches!(
        huge.local_layers(0, None),
        Err(RouteError::TooLarge {
            what: "num_layers",
            ..
        })
    ));
    assert!(PipelineSplit::new(usize::MAX, 2)
        .with_vp_size(Some(2))
        .local_layers(1, Some(1))
        .is_err());
}

/// The routed (sequence, position) of each row a rank's routers see, as (row, seq, pos):
/// every position but a sequence's last token (which no engine routes).
fn routed_rows(slots: &[TokenSlot], lens: &[usize]) -> Vec<(usize, usize, usize)> {
    slots
        .iter()
        .enumerate()
        .filter_map(|(row, s)| match *s {
            TokenSlot::Token { seq, pos } if pos + 1 < lens[seq] => Some((row, seq, pos)),
            _ => None,
        })
        .collect()
}

#[test]
fn slimes_packing_with_its_trailing_padding_segment() {
    // slime's get_batch: each sequence padded to a multiple of 2·cp (only with cp > 1) and
    // zigzag-split; the rank's packed tokens then padded to a multiple of tp · 128 (the
    // data_pad_size_multiplier), that tail recorded as one more cu_seqlens entry; all of it
    // times cp. Lengths 5 and 3. Expected rows worked by hand (and equal to what slime's own
    // prepare_routed_experts_for_routing_replay gives each rank):
    let lens = [5usize, 3];
    // tp = sp 2, cp 1: 8 tokens padded to 256, cu [0, 5, 8, 256]; sp rank 0 holds local
    // tokens 0..128: sequence 0 (rows 0-4, its last token at row 4), sequence 1 (rows 5-7).
    let cu = [0usize, 5, 8, 256];
    let r0 = rank_tokens(
        &lens,
        Packing::Thd,
        split(2, 0, 1, 0),
        Padding::CuSeqlensWithTail(&cu),
    );
    let r0 = r0.unwrap();
    assert_eq!(r0.len(), 128);
    let want = vec![
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 0, 3),
        (5, 1, 0),
        (6, 1, 1),
    ];
    assert_eq!(routed_rows(&r0, &lens), want);
    let r1 = rank_tokens(
        &lens,
        Packing::Thd,
        split(2, 1, 1, 0),
        Padding::CuSeqlensWithTail(&cu),
    );
    let r1 = r1.unwrap();
    assert_eq!((r1.len(), routed_rows(&r1, &lens)), (128, vec![]));
    // tp = sp 2, cp 2: sequences padded to 8 and 4 (chunks of 2 and 1); cp rank 0 keeps
    // chunks 0 and 3: positions 0 1 6 7 of sequence 0, 0 3 of sequence 1 — 6 tokens, padded
    // to 256 locally (250 of tail, 500 globally): cu [0, 8, 12, 512]. cp rank 1 keeps
    // chunks 1 and 2: positions 2 3 4 5 and 1 2.
    let cu = [0usize, 8, 12, 512];
    let expect = [
        ((0, 0), vec![(0, 0, 0), (1, 0, 1), (4, 1, 0)]),
        ((1, 0), vec![]),
        ((0, 1), vec![(0, 0, 2), (1, 0, 3), (4, 1, 1)]),
        ((1, 1), vec![]),
    ];
    for ((sp_rank, cp_rank), want) in expect {
        let ts = split(2, sp_rank, 2, cp_rank);
        let got = rank_tokens(&lens, Packing::Thd, ts, Padding::CuSeqlensWithTail(&cu)).unwrap();
        assert_eq!(got.len(), 128);
        assert_eq!(routed_rows(&got, &lens), want, "sp {sp_rank} cp {cp_rank}");
    }
    // tp 1, cp 2: the same split, 6 tokens padded to 128 (cu [0, 8, 12, 256]).
    let ts = split(1, 0, 2, 1);
    let got = rank_tokens(
        &lens,
        Packing::Thd,
        ts,
        Padding::CuSeqlensWithTail(&[0, 8, 12, 256]),
    );
    let got = got.unwrap();
    assert_eq!(got.len(), 128);
    assert_eq!(
        routed_rows(&got, &lens),
        vec![(0, 0, 2), (1, 0, 3), (4, 1, 1)]
    );
    // Without a tail (a multiplier the tokens already meet), the offsets are plain ones.
    let ts = split(2, 1, 2, 1);
    let got = rank_tokens(
        &lens,
        Packing::Thd,
        ts,
        Padding::CuSeqlensWithTail(&[0, 8, 12]),
    );
    assert_eq!(routed_rows(&got.unwrap(), &lens), vec![(1, 1, 1)]);
    // The tail is accepted only when asked for: offsets of verl (no tail) with a table
    // missing would otherwise read a real sequence as padding.
    let ts = split(1, 0, 2, 0);
    let msg = rank_tokens(
        &lens,
        Packing::Thd,
        ts,
        Padding::CuSeqlens(&[0, 8, 12, 256]),
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("has 4 entries; 2 sequences need 3"), "{msg}");
    let msg = rank_tokens(
        &lens,
        Packing::Thd,
        ts,
        Padding::CuSeqlensWithTail(&[0, 8, 12, 20, 24]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("need 3 (or 4 with a trailing padding segment)"),
        "{msg}"
    );
    // Each rank holds tail / cp of it: a tail cp does not divide is refused.
    let msg = rank_tokens(
        &lens,
        Packing::Thd,
        ts,
        Padding::CuSeqlensWithTail(&[0, 8, 12, 15]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("trailing padding segment has 3 tokens, not a multiple of cp = 2"),
        "{msg}"
    );
    let huge = [0usize, 8, 12, usize::MAX];
    assert!(rank_tokens(
        &lens,
        Packing::Thd,
        split(1, 0, 1, 0),
        Padding::CuSeqlensWithTail(&huge)
    )
    .unwrap_err()
    .to_string()
    .contains("trailing padding segment"));
}

#[test]
fn sequences_longer_than_their_routes_replay_filler_past_them() {
    // A verl rollout ended by its interaction: 9 attended tokens, routes for the first 6
    // positions (the engine's last call), 3 tokens appended after it.
    let rows: Vec<[[u32; 2]; 2]> = (0..6u32).map(|p| [[p, p + 1], [p + 1, 0]]).collect();
    let t = table(&rows, 0);
    let one = TokenSplit::single();
    let r =
        replay_ids_with_lens(&[&t], Some(&[9]), &[3], Packing::Thd, one, Padding::Aligned).unwrap();
    assert_eq!(r.num_tokens, 9);
    let mut want: Vec<i64> = (0..6).flat_map(|p| [p + 1, 0]).collect();
    // Tokens 6, 7 and 8 replay the filler (t·2 + j) mod 8.
    want.extend([4, 5, 6, 7, 0, 1]);
    assert_eq!(r.ids, want);
    // Without the lengths the sequence is rows + 1 = 7 tokens long.
    let r7 = replay_ids(&[&t], &[3], Packing::Thd, one, Padding::Aligned).unwrap();
    assert_eq!(r7.num_tokens, 7);
    // A length that cuts the routes short is refused, as is one per table missing.
    let e = replay_ids_with_lens(&[&t], Some(&[6]), &[3], Packing::Thd, one, Padding::Aligned);
    let msg = e.unwrap_err().to_string();
    assert!(
        msg.contains("seq_lens[0] = 6 is shorter than sequence 0's 6 routed rows + 1"),
        "{msg}"
    );
    let e = replay_ids_with_lens(
        &[&t],
        Some(&[9, 9]),
        &[3],
        Packing::Thd,
        one,
        Padding::Aligned,
    );
    assert!(e.unwrap_err().to_string().contains("seq_lens"));
}

/// A layout's stages as Megatron's one-letter string (E, t, m, L; `|` between stages).
fn letters(layout: &PipelineLayout) -> String {
    let stages: Vec<String> = layout
        .stages()
        .iter()
        .map(|stage| {
            stage
                .iter()
                .map(|l| match l {
                    LayoutLayer::Embedding => 'E',
                    LayoutLayer::Decoder => 't',
                    LayoutLayer::Mtp => 'm',
                    LayoutLayer::Loss => 'L',
                })
                .collect()
        })
        .collect();
    stages.join("|")
}

#[test]
fn layout_strings_unroll_as_megatrons_parser() {
    // parse_str_to_list's docstring: "Ettt|(tt|)*29,m|L" is
    // [["E","t","t","t"]] + [["t","t"]]*29 + [["m"],["L"]].
    let l = PipelineLayout::parse("Ettt|(tt|)*29,m|L").unwrap();
    let mut want = vec!["Ettt".to_string()];
    want.extend(std::iter::repeat_n("tt".to_string(), 29));
    want.extend(["m".to_string(), "L".to_string()]);
    assert_eq!(letters(&l), want.join("|"));
    // Its comments' unrolling rules, on layer letters: "xy(ab|cd|ef)*2,pq" ->
    // "xyab|cd|efab|cd|efpq", "(ab)*3" -> "ababab", "ab,(cd|)*2" -> "abcd|cd|",
    // "(|ab)*2,cd" -> "|ab|abcd", and x*n.
    for (text, unrolled) in [
        ("Et(t|tt|m)*2,tL", "Ett|tt|mt|tt|mtL"),
        ("(Et)*3", "EtEtEt"),
        ("Et,(tt|)*2", "Ettt|tt|"),
        ("(|Et)*2,tL", "|Et|EttL"),
        ("Et*3|t*2L", "Ettt|ttL"),
        ("Et*0|L", "E|L"),
        ("Et*02|L", "Ett|L"),
        ("", ""),
    ] {
        assert_eq!(
            letters(&PipelineLayout::parse(text).unwrap()),
            unrolled,
            "{text}"
        );
    }
    // What the regular expressions leave is an invalid layer character, as in Megatron:
    // nested parentheses, a repeat of a repeat, a count missing, a space, a lower-case e.
    for text in [
        "((tt)*2)*2",
        "t*2*3",
        "t*",
        "(tt)*",
        "E t|L",
        "et|L",
        "()*2",
    ] {
        let e = PipelineLayout::parse(text).unwrap_err().to_string();
        assert!(e.contains("invalid layer character"), "{text}: {e}");
    }
    // A count that would build a huge string is refused before it is built.
    for text in [
        "t*100000000000",
        "(tt|)*99999999999999999999999",
        "Et*65537L",
    ] {
        let e = PipelineLayout::parse(text).unwrap_err().to_string();
        assert!(e.contains(&MAX_LAYOUT_CHARS.to_string()), "{text}: {e}");
    }
    // Long runs of brackets or digits are read in one pass (no rescan per character).
    let started = std::time::Instant::now();
    for text in ["(".repeat(60_000), "1".repeat(60_000), "(t".repeat(30_000)] {
        assert!(PipelineLayout::parse(&text).is_err());
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(
        LayoutLayer::from_name(" Decoder ").unwrap(),
        LayoutLayer::Decoder
    );
    assert!(LayoutLayer::from_name("encoder")
        .unwrap_err()
        .to_string()
        .contains("not supported"));
    assert!(LayoutLayer::from_name("t")
        .unwrap_err()
        .to_string()
        .contains("not a layer type"));
}

fn with_layout(num_layers: usize, pp: usize, text: &str) -> PipelineSplit {
    PipelineSplit::new(num_layers, pp).with_layout(Some(PipelineLayout::parse(text).unwrap()))
}

#[test]
fn a_custom_layout_decides_the_chunks() {
    // pp 2 x vp 2 with the embedding and loss as stages' members: flat stages are
    // (pp 0, vp 0) "Et", (pp 1, vp 0) "tt", (pp 0, vp 1) "tt", (pp 1, vp 1) "tL"; the decoder
    // layers are numbered in that order: [0] [1 2] [3 4] [5].
    let s = with_layout(6, 2, "Et|tt|tt|tL");
    assert_eq!(
        chunks(&s.clone().with_vp_size(Some(2)), 0),
        vec![vec![0], vec![3, 4]]
    );
    assert_eq!(s.chunk_layers(1, Some(0)).unwrap(), 1..3);
    assert_eq!(s.chunk_layers(1, Some(1)).unwrap(), 5..6);
    // The virtual stages come from the layout: without vp_stage, every chunk in turn.
    assert_eq!(s.local_layers(0, None).unwrap(), vec![0, 3, 4]);
    assert_eq!(s.local_layers(1, None).unwrap(), vec![1, 2, 5]);
    // DeepSeek-V3-like: a standalone embedding stage, 4 layers per middle stage, an MTP
    // layer and the loss on the last stage (pp 4, no virtual stages).
    let d = with_layout(10, 4, "E|t*4|t*4|tt,m,L");
    assert_eq!(d.local_layers(0, None).unwrap(), Vec::<usize>::new());
    assert_eq!(d.local_layers(1, None).unwrap(), (0..4).collect::<Vec<_>>());
    assert_eq!(d.local_layers(3, None).unwrap(), vec![8, 9]);
    assert_eq!(d.layer_offset(3, Some(0)).unwrap(), 8);
    // One stage (pp 1): every layer.
    let one = with_layout(3, 1, "EtttL");
    assert_eq!(one.local_layers(0, None).unwrap(), vec![0, 1, 2]);
    // Every layer exactly once over the ranks, for layouts of every shape.
    for (layers, pp, text) in [
        (6, 2, "Et|tt|tt|tL"),
        (10, 4, "E|t*4|t*4|tt,m,L"),
        (15, 2, "Ett|(tt|)*6,tmL"),
        (5, 1, "Et*5L"),
        (7, 3, "Et||tt|t|ttt|L"),
    ] {
        let s = with_layout(layers, pp, text);
        let mut seen: Vec<usize> = (0..pp)
            .flat_map(|p| s.local_layers(p, None).unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..layers).collect::<Vec<_>>(), "{text}");
    }
}

#[test]
fn a_layout_megatron_would_refuse_is_refused() {
    let cases: [(PipelineSplit, &str); 10] = [
        (
            with_layout(6, 3, "Et|tt|tt|tL"),
            "4 stages, not a multiple of pp_size 3",
        ),
        (
            with_layout(7, 2, "Et|tt|tt|tL"),
            "6 decoder layers (t), but num_layers is 7",
        ),
        (with_layout(6, 2, "tt|tt|Et|tL"), "start with the embedding"),
        (with_layout(6, 2, "Et|tt|tL|tt"), "end with the loss"),
        (with_layout(6, 2, "Et|tE|tt|tL"), "each exactly once"),
        (
            with_layout(5, 2, "Et|tt|tm|tL"),
            "decoder layer after an MTP layer",
        ),
        (
            with_layout(6, 2, "Et|tt|tt|tL").with_vp_size(Some(4)),
            "vp_size 4 conflicts with pipeline_layout",
        ),
        (
            PipelineSplit {
                first_stage_layers: Some(1),
                ..with_layout(6, 2, "Et|tt|tt|tL")
            },
            "cannot be set with the other pipeline layout arguments",
        ),
        (
            PipelineSplit {
                account_for_loss: true,
                ..with_layout(6, 2, "Et|tt|tt|tL")
            },
            "cannot be set with the other pipeline layout arguments",
        ),
        (with_layout(4, 1, "Ett|ttL"), "pp_size 1 2 virtual stages"),
    ];
    for (split, want) in cases {
        let msg = split.local_layers(0, None).unwrap_err().to_string();
        assert!(msg.contains(want), "{:?}: {msg}", split.layout);
    }
    let s = with_layout(6, 2, "Et|tt|tt|tL");
    assert!(s
        .layer_offset(0, None)
        .unwrap_err()
        .to_string()
        .contains("vp_stage is required"));
    assert!(matches!(
        s.num_layers_to_build(0, Some(2)),
        Err(RouteError::OutOfRange {
            what: "vp_stage",
            ..
        })
    ));
    assert!(matches!(
        s.num_layers_to_build(2, Some(0)),
        Err(RouteError::OutOfRange {
            what: "pp_rank",
            ..
        })
    ));
    // The vp_size the layout implies is accepted when also given.
    assert_eq!(
        s.with_vp_size(Some(2)).local_layers(1, Some(0)).unwrap(),
        vec![1, 2]
    );
}

/// slime's `--allgather-cp` token order (`slime/backends/megatron_utils/data.py::get_batch`
/// and `cp_utils.py::prepare_routed_experts_for_routing_replay`), rebuilt by hand: the
/// sequences concatenated unpadded, the stream padded at its end to a multiple of
/// `cp · tp · mult`, `chunk(cp)[cp_rank]`, then the sequence-parallel split over tp.
/// Returns the rank's slots and slime's `cu_seqlens` (global offsets, the tail as one more
/// entry when there is one).
fn slime_allgather(
    lens: &[usize],
    tp: (usize, usize),
    cp: (usize, usize),
    mult: usize,
) -> (Vec<Option<(usize, usize)>>, Vec<usize>) {
    let mut stream: Vec<Option<(usize, usize)>> = Vec::new();
    let mut cu = vec![0usize];
    for (s, &n) in lens.iter().enumerate() {
        stream.extend((0..n).map(|p| Some((s, p))));
        cu.push(stream.len());
    }
    let global_pad_size = cp.0 * tp.0 * mult;
    let pad = (global_pad_size - stream.len() % global_pad_size) % global_pad_size;
    if pad != 0 {
        stream.extend(std::iter::repeat_n(None, pad));
        cu.push(stream.len());
    }
    let part = stream.len() / cp.0;
    let local = &stream[cp.1 * part..(cp.1 + 1) * part];
    let share = local.len() / tp.0;
    (local[tp.1 * share..(tp.1 + 1) * share].to_vec(), cu)
}

#[test]
fn contiguous_cp_is_slimes_allgather_order() {
    let lens = [5usize, 3];
    // By hand: 8 tokens over cp 2, no tail: rank 0 holds sequence 0's positions 0-3, rank 1
    // its position 4 and sequence 1.
    let r1 = rank_tokens(
        &lens,
        Packing::ThdContiguousCp,
        split(1, 0, 2, 1),
        Padding::Aligned,
    );
    assert_eq!(
        positions(&r1.unwrap()),
        vec![Some((0, 4)), Some((1, 0)), Some((1, 1)), Some((1, 2))]
    );
    for lens in [vec![5usize, 3], vec![9, 1, 14], vec![2]] {
        for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3), (4, 2)] {
            for mult in [1usize, 4, 128] {
                for (t, c) in (0..tp).flat_map(|t| (0..cp).map(move |c| (t, c))) {
                    let (want, cu) = slime_allgather(&lens, (tp, t), (cp, c), mult);
                    let ts = split(tp, t, cp, c);
                    let got = rank_tokens(
                        &lens,
                        Packing::ThdContiguousCp,
                        ts,
                        Padding::CuSeqlensWithTail(&cu),
                    );
                    let case = format!("{lens:?} tp {tp}/{t} cp {cp}/{c} mult {mult}");
                    assert_eq!(positions(&got.unwrap()), want, "{case}");
                    if mult == 1 {
                        // slime's padding with multiplier 1 is the inferred one.
                        let inferred =
                            rank_tokens(&lens, Packing::ThdContiguousCp, ts, Padding::Aligned);
                        assert_eq!(positions(&inferred.unwrap()), want, "{case}");
                    }
                }
            }
        }
    }
    // The zigzag thd order differs (cp rank 1 of 2 keeps sequence 0's positions 2-5).
    let zigzag = rank_tokens(&lens, Packing::Thd, split(1, 0, 2, 1), Padding::Aligned);
    assert_eq!(positions(&zigzag.unwrap())[0], Some((0, 2)));
    // Offsets without a tail need the stream to split over cp as a whole (a sequence need
    // not be a multiple of 2·cp), and over sp on each rank.
    let ok = rank_tokens(
        &lens,
        Packing::ThdContiguousCp,
        split(1, 0, 2, 0),
        Padding::CuSeqlens(&[0, 5, 8]),
    );
    assert_eq!(ok.unwrap().len(), 4);
    let e = rank_tokens(
        &lens,
        Packing::ThdContiguousCp,
        split(1, 0, 3, 0),
        Padding::CuSeqlens(&[0, 5, 8]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("stream's 8 tokens do not split evenly over cp 3"),
        "{e}"
    );
    let e = rank_tokens(
        &lens,
        Packing::ThdContiguousCp,
        split(3, 0, 2, 0),
        Padding::CuSeqlens(&[0, 5, 8]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("4 tokens do not split evenly over sp 3"), "{e}");
    for bad in [Padding::SeqLen(8), Padding::CuSeqlens(&[0, 4, 8])] {
        assert!(rank_tokens(&lens, Packing::ThdContiguousCp, split(1, 0, 2, 0), bad).is_err());
    }
    assert_eq!(
        Packing::parse("thd_contiguous_cp"),
        Some(Packing::ThdContiguousCp)
    );
}
