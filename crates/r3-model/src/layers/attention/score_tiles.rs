//! The bound on how many attention scores one product of queries and keys may hold, and
//! how a step's queries are cut to keep within it: into tiles of sequences and positions
//! (a decode step over a KV cache, `tiles.rs`) or into blocks of query rows (a
//! differentiated forward, `recompute.rs`).

/// Most elements one tensor may have on a GPU: candle's kernels index a tensor's elements
/// with 32 bits. No bound lets a product of scores past it.
pub const MAX_TENSOR_ELEMENTS: usize = u32::MAX as usize;

/// The most attention scores one product of queries and keys may hold at once (elements of
/// `[rows, heads, times, slots]`); a step's attention cuts its queries into tiles that fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoreTiles {
    max_scores: usize,
}

impl Default for ScoreTiles {
    /// [`ScoreTiles::DEFAULT`].
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A block of a differentiated attention's query rows (`[B, KV, G·T, D]`, rows ordered
/// group, then time): whole groups' rows, or a run of one group's positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowBlock {
    /// Its first row.
    pub first: usize,
    /// Its rows.
    pub rows: usize,
    /// Groups it spans (1 for a run of positions).
    pub groups: usize,
    /// Its first query position.
    pub first_time: usize,
    /// Query positions of each of its groups.
    pub times: usize,
}

/// The sequences and query positions one tile of a step's attention takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoreTile {
    /// Sequences of the batch in one tile.
    pub rows: usize,
    /// Query positions of each sequence in one tile.
    pub times: usize,
}

impl ScoreTiles {
    /// No bound but [`MAX_TENSOR_ELEMENTS`]: one product a layer.
    pub const WHOLE: ScoreTiles = ScoreTiles {
        max_scores: usize::MAX,
    };

    /// 2²⁸ scores (1 GiB in f32) a product: what an attention layer holds unless told
    /// otherwise (`algo.attention_tile_mib`'s default).
    pub const DEFAULT: ScoreTiles = ScoreTiles {
        max_scores: 1 << 28,
    };

    /// At most `max_scores` elements a product (at least one query row of one sequence, over
    /// all its heads and slots, however many that is).
    pub fn at_most(max_scores: usize) -> Self {
        Self {
            max_scores: max_scores.max(1),
        }
    }

    /// The bound a product keeps to: the one asked, within [`MAX_TENSOR_ELEMENTS`].
    fn bound(self) -> usize {
        self.max_scores.min(MAX_TENSOR_ELEMENTS)
    }

    /// The bound asked, in elements.
    pub fn max_scores(self) -> usize {
        self.max_scores
    }

    /// The tile a step of `batch` sequences × `heads` query heads × `time` queries over
    /// `slots` keys is cut into: whole sequences where one fits (as many as fit), else one
    /// sequence's queries in runs of as many positions as fit (at least one).
    pub fn tile(self, batch: usize, heads: usize, time: usize, slots: usize) -> ScoreTile {
        let per_query = heads.saturating_mul(slots).max(1);
        let per_row = per_query.saturating_mul(time.max(1));
        let bound = self.bound();
        if per_row <= bound {
            ScoreTile {
                rows: (bound / per_row).clamp(1, batch.max(1)),
                times: time,
            }
        } else {
            ScoreTile {
                rows: 1,
                times: (bound / per_query).clamp(1, time.max(1)),
            }
        }
    }

    /// The blocks `q` `[B, KV, G·T, D]` (`outer` = B · KV) over `slots` keys is cut into:
    /// the whole where it fits (or holds no row), else as many whole groups as fit, else runs
    /// of as many positions of one group as fit (at least one), in row order.
    pub fn row_blocks(
        self,
        outer: usize,
        groups: usize,
        time: usize,
        slots: usize,
    ) -> Vec<RowBlock> {
        let fit = (self.bound() / outer.saturating_mul(slots).max(1)).max(1);
        if fit >= groups * time {
            let all = RowBlock {
                first: 0,
                rows: groups * time,
                groups,
                first_time: 0,
                times: time,
            };
            return vec![all];
        }
        if fit >= time {
            let per = fit / time;
            return (0..groups)
                .step_by(per)
                .map(|g| RowBlock {
                    first: g * time,
                    rows: per.min(groups - g) * time,
                    groups: per.min(groups - g),
                    first_time: 0,
                    times: time,
                })
                .collect();
        }
        (0..groups)
            .flat_map(|g| {
                (0..time).step_by(fit).map(move |t0| RowBlock {
                    first: g * time + t0,
                    rows: fit.min(time - t0),
                    groups: 1,
                    first_time: t0,
                    times: fit.min(time - t0),
                })
            })
            .collect()
    }

    /// Elements of the largest tile's scores for such a step (what the memory plans count).
    pub fn scores(self, batch: usize, heads: usize, time: usize, slots: usize) -> usize {
        let tile = self.tile(batch, heads, time, slots);
        tile.rows
            .saturating_mul(heads)
            .saturating_mul(tile.times)
            .saturating_mul(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles of whole sequences while one fits, else runs of positions of one sequence;
    /// never empty, never more than the step.
    #[test]
    fn a_tile_is_the_most_that_fits() {
        let whole = ScoreTiles::WHOLE.tile(4, 8, 10, 100);
        assert_eq!(whole, ScoreTile { rows: 4, times: 10 });
        // One sequence is 8 · 10 · 100 = 8,000 scores.
        let two = ScoreTiles::at_most(16_000 + 7_999).tile(4, 8, 10, 100);
        assert_eq!(two, ScoreTile { rows: 2, times: 10 });
        let three_positions = ScoreTiles::at_most(3 * 800 + 799).tile(4, 8, 10, 100);
        assert_eq!(three_positions, ScoreTile { rows: 1, times: 3 });
        let least = ScoreTiles::at_most(1).tile(4, 8, 10, 100);
        assert_eq!(least, ScoreTile { rows: 1, times: 1 });
        assert_eq!(ScoreTiles::at_most(1).scores(4, 8, 10, 100), 800);
        assert_eq!(ScoreTiles::at_most(16_000).scores(4, 8, 10, 100), 16_000);
        assert_eq!(ScoreTiles::WHOLE.scores(4, 8, 10, 100), 32_000);
        // No bound lets a product pass 2³² − 1 elements: 100 k positions over 100 k slots
        // of one head go 42,949 positions a tile.
        let huge = ScoreTiles::WHOLE.tile(1, 1, 100_000, 100_000);
        assert_eq!(
            huge,
            ScoreTile {
                rows: 1,
                times: 42_949
            }
        );
        let blocks = ScoreTiles::WHOLE.row_blocks(1, 1, 100_000, 100_000);
        assert_eq!(blocks.len(), 3);
        assert_eq!(ScoreTiles::default(), ScoreTiles::at_most(1 << 28));
    }

    /// Row blocks cover every row once, in order, each within the bound where one row is.
    #[test]
    fn row_blocks_cover_the_rows_in_order() {
        let (outer, groups, time, slots) = (6, 4, 10, 50);
        for max in [1, 299, 300, 2_999, 3_000, 6_000, 11_999, 12_000, usize::MAX] {
            let blocks = ScoreTiles::at_most(max).row_blocks(outer, groups, time, slots);
            let mut next = 0;
            for b in &blocks {
                assert_eq!(b.first, next, "at most {max}");
                assert_eq!(b.rows, b.groups * b.times);
                assert_eq!(b.first % time, b.first_time);
                assert!(b.first_time + b.times <= time && b.rows > 0);
                assert!(
                    b.rows * outer * slots <= max.max(outer * slots),
                    "at most {max}"
                );
                next += b.rows;
            }
            assert_eq!(next, groups * time, "at most {max}");
        }
        let whole = |max| ScoreTiles::at_most(max).row_blocks(outer, groups, time, slots);
        assert_eq!(whole(12_000).len(), 1);
        // Two whole groups a block; three positions of one group a block.
        assert_eq!(whole(6_000 + 2_999).len(), 2);
        assert_eq!(whole(900 + 299).len(), 4 * 4);
    }
}
