//! How one MoE layer's routed rows reach their experts: the `(row, slot)` pairs of the
//! chosen ids sorted by expert (a counting sort on the host), each expert's span of that
//! order, and the way back from a pair to its place in it.

use crate::error::{ModelError, Result};

/// The `[rows · top_k]` routing choices of one layer, grouped by expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    top_k: usize,
    /// slot `r · top_k + j` of each place in expert order
    slots: Vec<u32>,
    /// `E + 1` offsets: expert `e` owns places `offsets[e]..offsets[e + 1]`
    offsets: Vec<usize>,
    /// place in expert order of each slot (the inverse of `slots`)
    places: Vec<u32>,
}

impl Dispatch {
    /// Groups `ids` (`[rows · top_k]`, row-major) over `num_experts` experts; an id out of
    /// range is an error naming it.
    pub fn new(ids: &[u32], top_k: usize, num_experts: usize) -> Result<Self> {
        if top_k == 0 || !ids.len().is_multiple_of(top_k) {
            return Err(ModelError::Input(format!(
                "{} routed ids do not form rows of top-{top_k}",
                ids.len()
            )));
        }
        let mut counts = vec![0usize; num_experts];
        for &id in ids {
            let count = counts.get_mut(id as usize).ok_or_else(|| {
                ModelError::Input(format!(
                    "expert id {id} out of range for {num_experts} experts"
                ))
            })?;
            *count += 1;
        }
        let mut offsets = Vec::with_capacity(num_experts + 1);
        offsets.push(0);
        for c in &counts {
            offsets.push(offsets[offsets.len() - 1] + c);
        }
        let mut fill = offsets.clone();
        let mut slots = vec![0u32; ids.len()];
        let mut places = vec![0u32; ids.len()];
        for (slot, &id) in ids.iter().enumerate() {
            let place = fill[id as usize];
            fill[id as usize] += 1;
            slots[place] = slot as u32;
            places[slot] = place as u32;
        }
        Ok(Dispatch {
            top_k,
            slots,
            offsets,
            places,
        })
    }

    /// Routed rows.
    pub fn rows(&self) -> usize {
        self.slots.len() / self.top_k
    }

    /// Experts per row.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Slot `r · top_k + j` of each place in expert order.
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// `E + 1` offsets into the expert order.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Place in expert order of each slot.
    pub fn places(&self) -> &[u32] {
        &self.places
    }

    /// The row each place in expert order came from.
    pub fn source_rows(&self) -> Vec<u32> {
        let k = self.top_k as u32;
        self.slots.iter().map(|&s| s / k).collect()
    }

    /// For each row, the sorted experts this grouping sends it to (read back from the
    /// expert spans, so it checks the grouping against the ids it was built from).
    pub fn experts_of_rows(&self) -> Vec<Vec<u32>> {
        let mut per_row = vec![Vec::with_capacity(self.top_k); self.rows()];
        for (expert, span) in self.offsets.windows(2).enumerate() {
            for &slot in &self.slots[span[0]..span[1]] {
                per_row[slot as usize / self.top_k].push(expert as u32);
            }
        }
        for r in &mut per_row {
            r.sort_unstable();
        }
        per_row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_by_expert_and_inverts() {
        // rows: [2, 0], [1, 2], [0, 2]
        let ids = [2, 0, 1, 2, 0, 2];
        let d = Dispatch::new(&ids, 2, 4).expect("dispatch");
        assert_eq!(d.rows(), 3);
        assert_eq!(d.offsets(), &[0, 2, 3, 6, 6]);
        // expert 0 gets slots 1 and 4, expert 1 slot 2, expert 2 slots 0, 3, 5
        assert_eq!(d.slots(), &[1, 4, 2, 0, 3, 5]);
        assert_eq!(d.source_rows(), vec![0, 2, 1, 0, 1, 2]);
        for (slot, &place) in d.places().iter().enumerate() {
            assert_eq!(d.slots()[place as usize] as usize, slot);
        }
        assert_eq!(
            d.experts_of_rows(),
            vec![vec![0, 2], vec![1, 2], vec![0, 2]]
        );
    }

    #[test]
    fn bad_ids_are_named() {
        let err = Dispatch::new(&[0, 5], 2, 4).expect_err("out of range");
        assert!(err.to_string().contains("expert id 5"), "{err}");
        let err = Dispatch::new(&[0, 1, 2], 2, 4).expect_err("ragged");
        assert!(err.to_string().contains("top-2"), "{err}");
    }
}
