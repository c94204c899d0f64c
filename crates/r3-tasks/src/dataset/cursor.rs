//! Walking a dataset epoch by epoch: every epoch visits each row once, in file order or in
//! a permutation seeded from the run seed and the epoch number, and the position (epoch,
//! index within the epoch) is all a checkpoint needs to continue where the run stopped.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Where a run is in its dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DatasetPosition {
    /// Epochs completed.
    pub epoch: u64,
    /// Rows of the current epoch already taken.
    pub index: usize,
}

/// Seeded epoch order over `len` rows.
#[derive(Debug, Clone)]
pub struct DatasetCursor {
    len: usize,
    shuffle: bool,
    seed: u64,
    order: Vec<usize>,
    pos: DatasetPosition,
}

impl DatasetCursor {
    /// A cursor at `pos` over `len` rows (`len >= 1`).
    pub fn new(len: usize, shuffle: bool, seed: u64, pos: DatasetPosition) -> Self {
        let mut c = Self {
            len,
            shuffle,
            seed,
            order: Vec::new(),
            pos,
        };
        c.order = c.epoch_order(pos.epoch);
        c
    }

    /// The row order of epoch `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            // One independent stream per epoch, so an epoch's order does not depend on how
            // many rows earlier epochs consumed.
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
            rng.set_stream(epoch);
            order.shuffle(&mut rng);
        }
        order
    }

    /// The current position.
    pub fn position(&self) -> DatasetPosition {
        self.pos
    }

    /// The next `n` row indices, rolling into the next epoch when this one runs out.
    pub fn take(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        if self.len == 0 {
            return out;
        }
        while out.len() < n {
            if self.pos.index >= self.len {
                self.pos = DatasetPosition {
                    epoch: self.pos.epoch + 1,
                    index: 0,
                };
                self.order = self.epoch_order(self.pos.epoch);
            }
            out.push(self.order[self.pos.index]);
            self.pos.index += 1;
        }
        out
    }
}
