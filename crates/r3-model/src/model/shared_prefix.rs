//! Prefixes a training batch's sequences hold alike, computed once.
//!
//! A GRPO step scores every prompt's group of samples together, and each sample repeats its
//! prompt: on gsm8k-style's step half the scored positions are prompt positions, each
//! computed eight times. Under causal attention a position's state depends only on the
//! tokens up to it, so two sequences that begin with the same tokens (and, under replay, the
//! same replayed experts) hold the same states there. A [`SharedPrefixes`] maps every real
//! position of a right-padded batch to one computed row; the per-token work (norms,
//! projections, routers, experts) runs once per computed row, and attention, which needs
//! each sequence's keys in place, reads them gathered back into the padded layout
//! ([`crate::layers::gather_rows::GatherRows`], whose backward sums each row's uses).
//! The values are the unshared forward's to float rounding; the gradient of a shared row is
//! the sum of its sequences' gradients, added in one pass.

use crate::routing_mode::ReplayPlan;

/// The computed rows of a batch whose sequences share prefixes: which real position each row
/// stands for, and where each position's state lies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPrefixes {
    /// Per computed row, the real position it is computed at (sequence-major index over the
    /// batch's real tokens, `offsets[b] + p`).
    owner_token: Vec<u32>,
    /// Per real position (sequence-major), the computed row holding its state.
    row_of_token: Vec<u32>,
    /// Per slot `b·T + p` of the padded `[B, T]` batch, its computed row (padding slots
    /// read row 0: masked as keys, their outputs unread).
    row_of_slot: Vec<u32>,
    /// Per computed row, the slot of the position it is computed at.
    slot_of_row: Vec<u32>,
    /// Per computed row, how many real positions it stands for.
    copies: Vec<u32>,
    /// Per sequence, how many of its leading positions another sequence's rows stand for.
    shared_lens: Vec<usize>,
}

impl SharedPrefixes {
    /// The sharing of `sequences` (padded to `t` positions): taken in token order, each
    /// sequence shares the positions it holds alike with the one before it, up to one
    /// before the shorter one's end (a final position never shares; under replay it is
    /// often routed natively). In token order that neighbour agrees with it in tokens
    /// longest of all the sequences before it, so one comparison a sequence finds its
    /// longest share. Under `plan` (a replay), positions share only where every MoE layer
    /// forces the same experts in the same order (a farther sequence agreeing longer in its
    /// experts too is not looked for: what is not shared is computed, never wrong). None when nothing is shared, so a batch without common prefixes
    /// runs the unshared forward unchanged.
    pub(crate) fn find(
        sequences: &[Vec<u32>],
        t: usize,
        plan: Option<&ReplayPlan>,
    ) -> Option<Self> {
        let mut offsets = Vec::with_capacity(sequences.len());
        let total = sequences.iter().fold(0, |at, s| {
            offsets.push(at);
            at + s.len()
        });
        let mut order: Vec<usize> = (0..sequences.len()).collect();
        order.sort_by(|&a, &b| sequences[a].cmp(&sequences[b]).then(a.cmp(&b)));
        let mut row_of_token = vec![0u32; total];
        let mut owner_token = Vec::with_capacity(total);
        let mut slot_of_row = Vec::with_capacity(total);
        let mut copies: Vec<u32> = Vec::with_capacity(total);
        let mut shared_lens = vec![0; sequences.len()];
        let mut previous: Option<usize> = None;
        for &b in &order {
            let shared = previous.map_or(0, |a| agreeing(sequences, &offsets, (a, b), plan));
            shared_lens[b] = shared;
            for p in 0..sequences[b].len() {
                let token = offsets[b] + p;
                match previous.filter(|_| p < shared) {
                    Some(a) => {
                        let row = row_of_token[offsets[a] + p];
                        row_of_token[token] = row;
                        copies[row as usize] += 1;
                    }
                    None => {
                        row_of_token[token] = owner_token.len() as u32;
                        owner_token.push(token as u32);
                        slot_of_row.push((b * t + p) as u32);
                        copies.push(1);
                    }
                }
            }
            previous = Some(b);
        }
        if owner_token.len() == total {
            return None;
        }
        let mut row_of_slot = vec![0u32; sequences.len() * t];
        for (b, seq) in sequences.iter().enumerate() {
            let slots = &mut row_of_slot[b * t..b * t + seq.len()];
            slots.copy_from_slice(&row_of_token[offsets[b]..offsets[b] + seq.len()]);
        }
        Some(SharedPrefixes {
            owner_token,
            row_of_token,
            row_of_slot,
            slot_of_row,
            copies,
            shared_lens,
        })
    }

    /// Per sequence, how many of its leading positions another sequence's rows stand for:
    /// its first position whose output is its own.
    pub fn shared_lens(&self) -> &[usize] {
        &self.shared_lens
    }

    /// How many rows are computed.
    pub fn rows(&self) -> usize {
        self.owner_token.len()
    }

    /// Per computed row, the real position (sequence-major) it is computed at.
    pub fn owner_tokens(&self) -> &[u32] {
        &self.owner_token
    }

    /// Per real position (sequence-major), its computed row.
    pub fn row_of_token(&self) -> &[u32] {
        &self.row_of_token
    }

    /// Per slot of the padded batch, its computed row.
    pub fn row_of_slot(&self) -> &[u32] {
        &self.row_of_slot
    }

    /// Per computed row, its slot in the padded batch.
    pub fn slot_of_row(&self) -> &[u32] {
        &self.slot_of_row
    }

    /// Per computed row, how many real positions it stands for.
    pub fn copies(&self) -> &[u32] {
        &self.copies
    }

    /// The rows the vocabulary head reads for the slots `slots` (`b·t + p`) of the padded
    /// `(B, t)` batch: each distinct computed row once, in order of first use, and per slot
    /// its index among them. Positions a row stands for in several sequences (and padding,
    /// which reads row 0) are one head row.
    pub fn head_rows(&self, slots: &[u32], t: usize) -> HeadRows {
        let mut index = vec![u32::MAX; self.rows()];
        let mut rows = Vec::new();
        let mut reused = vec![0; self.shared_lens.len()];
        let of_position = slots
            .iter()
            .map(|&slot| {
                let row = self.row_of_slot[slot as usize];
                let at = &mut index[row as usize];
                match *at == u32::MAX {
                    true => {
                        *at = rows.len() as u32;
                        rows.push(row);
                    }
                    false => reused[slot as usize / t] += 1,
                }
                *at
            })
            .collect();
        HeadRows {
            rows,
            of_position,
            reused,
        }
    }

    /// `[rows · top_k]` per-row ids (one MoE layer's dispatch over the computed rows) spread
    /// over every real position.
    pub fn spread_ids(&self, ids: &[u32], top_k: usize) -> Vec<u32> {
        self.row_of_token
            .iter()
            .flat_map(|&r| &ids[r as usize * top_k..(r as usize + 1) * top_k])
            .copied()
            .collect()
    }
}

/// The vocabulary head's rows of a batch sharing prefixes ([`SharedPrefixes::head_rows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadRows {
    /// The distinct computed rows the head reads, in order of first use.
    pub rows: Vec<u32>,
    /// Per head slot, its index in `rows`.
    pub of_position: Vec<u32>,
    /// Per sequence, how many of its head slots read a row an earlier slot read first.
    pub reused: Vec<usize>,
}

/// How many leading positions sequences `a` and `b` may share: equal tokens, below both
/// sequences' final positions, and under a replay `plan` the same forced experts in every
/// MoE layer.
fn agreeing(
    sequences: &[Vec<u32>],
    offsets: &[usize],
    (a, b): (usize, usize),
    plan: Option<&ReplayPlan>,
) -> usize {
    let (sa, sb) = (&sequences[a], &sequences[b]);
    let cap = sa.len().min(sb.len()).saturating_sub(1);
    let mut p = 0;
    while p < cap
        && sa[p] == sb[p]
        && plan.is_none_or(|pl| same_plan_rows(pl, offsets[a] + p, offsets[b] + p))
    {
        p += 1;
    }
    p
}

/// Whether real rows `i` and `j` are forced alike in every layer of `plan`.
fn same_plan_rows(plan: &ReplayPlan, i: usize, j: usize) -> bool {
    plan.layers.iter().all(|layer| {
        let k = layer.ids.len() / layer.forced.len().max(1);
        layer.forced[i] == layer.forced[j]
            && (!layer.forced[i] || layer.ids[i * k..(i + 1) * k] == layer.ids[j * k..(j + 1) * k])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing_mode::LayerPlan;

    #[test]
    fn a_group_shares_its_prompt_and_nothing_past_it() {
        // Two samples of prompt [5, 6, 7], one of another prompt that begins alike.
        let seqs = vec![vec![5, 6, 7, 1, 2], vec![5, 6, 7, 3], vec![5, 9, 8]];
        let s = SharedPrefixes::find(&seqs, 5, None).expect("shares");
        // Rows: seq 0's five, seq 1's position 3, seq 2's positions 1 and 2.
        assert_eq!(s.owner_tokens(), &[0, 1, 2, 3, 4, 8, 10, 11]);
        assert_eq!(s.row_of_token(), &[0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 6, 7]);
        assert_eq!(s.copies(), &[3, 2, 2, 1, 1, 1, 1, 1]);
        assert_eq!(
            s.row_of_slot(),
            &[0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 0, 6, 7, 0, 0]
        );
        assert_eq!(s.slot_of_row(), &[0, 1, 2, 3, 4, 8, 11, 12]);
        assert_eq!(s.shared_lens(), &[0, 3, 1]);
        assert_eq!(s.row_of_token().len(), 12);
        assert_eq!(
            s.spread_ids(&[10, 11, 12, 13, 14, 15, 16, 17], 1),
            vec![10, 11, 12, 13, 14, 10, 11, 12, 15, 10, 16, 17]
        );
        // The head from position 2: slots (0, 2..5) rows 2, 3, 4; (1, 2..5) rows 2, 5, 0
        // (padding); (2, 2..5) rows 7, 0, 0. Distinct in order of first use: 2, 3, 4, 5,
        // 0, 7; reused: one slot of sequence 1 (row 2), two of sequence 2 (row 0).
        assert_eq!(
            s.head_rows(&[2, 3, 4, 7, 8, 9, 12, 13, 14], 5),
            HeadRows {
                rows: vec![2, 3, 4, 5, 0, 7],
                of_position: vec![0, 1, 2, 0, 3, 4, 5, 4, 4],
                reused: vec![0, 1, 2],
            }
        );
        // The predictions of the first two sequences' responses (after the prompt [5, 6,
        // 7]): slots 2, 3 and 7, whose rows 2, 3, 2 share the prompt's last.
        assert_eq!(
            s.head_rows(&[2, 3, 7], 5),
            HeadRows {
                rows: vec![2, 3],
                of_position: vec![0, 1, 0],
                reused: vec![0, 1, 0],
            }
        );
    }

    #[test]
    fn sequences_share_with_their_neighbour_in_token_order() {
        // Token order: 1, 3, 0, 2. Sequence 3 shares 3 positions with 1, sequence 2 two
        // with 0; 0 and 3 share nothing.
        let seqs = vec![
            vec![9, 1, 2],
            vec![1, 2, 3, 4],
            vec![9, 1, 5],
            vec![1, 2, 3, 7],
        ];
        let s = SharedPrefixes::find(&seqs, 4, None).expect("shares");
        assert_eq!(
            s.row_of_token(),
            &[5, 6, 7, 0, 1, 2, 3, 5, 6, 8, 0, 1, 2, 4]
        );
        assert_eq!(s.owner_tokens(), &[3, 4, 5, 6, 13, 0, 1, 2, 9]);
        assert_eq!(s.copies(), &[2, 2, 2, 1, 1, 2, 2, 1, 1]);
        assert_eq!(s.slot_of_row(), &[4, 5, 6, 7, 15, 0, 1, 2, 10]);
        assert_eq!(s.shared_lens(), &[0, 0, 2, 3]);
    }

    #[test]
    fn a_final_position_is_never_shared_and_distinct_sequences_share_nothing() {
        // Identical sequences share all but their final position.
        let seqs = vec![vec![1, 2, 3], vec![1, 2, 3]];
        let s = SharedPrefixes::find(&seqs, 3, None).expect("shares");
        assert_eq!(s.row_of_token(), &[0, 1, 2, 0, 1, 3]);
        assert!(SharedPrefixes::find(&[vec![1, 2], vec![2, 2]], 2, None).is_none());
        assert!(SharedPrefixes::find(&[vec![1, 2, 3]], 3, None).is_none());
    }

    #[test]
    fn under_replay_positions_share_only_where_the_forced_experts_agree() {
        let seqs = vec![vec![1, 2, 3, 4], vec![1, 2, 3, 5]];
        // One MoE layer, top-1: the sequences agree at positions 0 and 2, not at 1.
        let plan = ReplayPlan {
            layers: vec![LayerPlan {
                ids: vec![0, 1, 2, 3, 0, 7, 2, 3],
                forced: vec![true, true, true, false, true, true, true, false],
                count_differences: true,
                copies: None,
            }],
            native_final_position: vec![true, true],
            tables: Vec::new(),
        };
        let s = SharedPrefixes::find(&seqs, 4, Some(&plan)).expect("shares position 0");
        assert_eq!(s.row_of_token(), &[0, 1, 2, 3, 0, 4, 5, 6]);
    }
}
