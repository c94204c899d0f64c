//! [`ExpertPlacement`]: the EPLB map from physical expert slots to logical experts. Engines
//! that replicate hot experts execute on physical slots; replay needs logical ids (the
//! physical-vs-logical bug of vLLM #33013), so physical tables are converted here, checked.

use crate::{DecodeLimits, RouteError, RouteTable};

/// Physical slot → logical expert map (EPLB). Every logical expert has at least one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlacement {
    num_logical: usize,
    slot_to_logical: Vec<u32>,
}

impl ExpertPlacement {
    /// Builds a placement; `slot_to_logical[s]` is the logical expert of physical slot `s`.
    /// Errors if a logical id is out of range, a logical expert has no slot, or a count is
    /// above [`DecodeLimits`].
    pub fn new(num_logical: usize, slot_to_logical: Vec<u32>) -> Result<Self, RouteError> {
        DecodeLimits::check(
            "num_logical experts",
            num_logical,
            DecodeLimits::MAX_EXPERTS,
        )?;
        DecodeLimits::check(
            "physical slots",
            slot_to_logical.len(),
            DecodeLimits::MAX_SLOTS,
        )?;
        let mut covered = vec![false; num_logical];
        for (slot, &l) in slot_to_logical.iter().enumerate() {
            let c = covered.get_mut(l as usize).ok_or_else(|| {
                RouteError::Layout(format!(
                    "physical slot {slot} maps to logical expert {l}, not below {num_logical}"
                ))
            })?;
            *c = true;
        }
        if let Some(missing) = covered.iter().position(|&c| !c) {
            return Err(RouteError::Layout(format!(
                "logical expert {missing} has no physical slot"
            )));
        }
        Ok(ExpertPlacement {
            num_logical,
            slot_to_logical,
        })
    }

    /// The identity placement (no replication).
    pub fn identity(num_experts: usize) -> Self {
        ExpertPlacement {
            num_logical: num_experts,
            slot_to_logical: (0..num_experts as u32).collect(),
        }
    }

    /// Number of logical experts.
    pub fn num_logical(&self) -> usize {
        self.num_logical
    }

    /// Number of physical slots.
    pub fn num_slots(&self) -> usize {
        self.slot_to_logical.len()
    }

    /// Logical expert of a physical slot, None when out of range.
    pub fn logical(&self, slot: usize) -> Option<u32> {
        self.slot_to_logical.get(slot).copied()
    }

    /// Converts flat physical ids (token-major `[tokens, columns, top_k]`, -1 = missing) to
    /// logical ids; out-of-range slots are errors naming token and layer.
    pub fn flat_to_logical(
        &self,
        ids: &[i64],
        columns_layers: &[usize],
        top_k: usize,
        start_pos: usize,
    ) -> Result<Vec<i64>, RouteError> {
        let row = columns_layers.len().max(1) * top_k.max(1);
        ids.iter()
            .enumerate()
            .map(|(i, &v)| {
                if v < 0 {
                    return Ok(v);
                }
                match usize::try_from(v).ok().and_then(|s| self.logical(s)) {
                    Some(l) => Ok(i64::from(l)),
                    None => Err(RouteError::PhysicalOutOfRange {
                        token: start_pos.saturating_add(i / row),
                        layer: columns_layers
                            .get((i % row) / top_k.max(1))
                            .copied()
                            .unwrap_or(0),
                        value: v,
                        num_slots: self.num_slots(),
                    }),
                }
            })
            .collect()
    }

    /// Converts a table of physical slot ids (`num_experts` = number of slots) to logical ids.
    /// Two slots of the same logical expert in one cell is an error (a real top-k picks
    /// distinct logical experts).
    pub fn to_logical(&self, physical: &RouteTable) -> Result<RouteTable, RouteError> {
        if physical.num_experts() != self.num_slots() {
            return Err(RouteError::shape(
                "num_experts (physical table vs placement slots)",
                physical.num_experts(),
                self.num_slots(),
            ));
        }
        let cols = physical.num_columns();
        let k = physical.top_k();
        let mut flat = Vec::with_capacity(physical.num_tokens() * cols * k);
        for t in 0..physical.num_tokens() {
            for c in 0..cols {
                match physical.experts(t, c) {
                    Some(ids) => flat.extend(ids.iter().map(|&s| i64::from(s))),
                    None => flat.extend(std::iter::repeat_n(-1i64, k)),
                }
            }
        }
        let logical = self.flat_to_logical(&flat, physical.layers(), k, physical.start_pos())?;
        let mut out = RouteTable::from_flat(
            self.num_logical,
            k,
            physical.space(),
            physical.layers().to_vec(),
            physical.start_pos(),
            &logical,
        )?;
        if let Some(v) = physical.versions() {
            out.set_versions(v.to_vec())?;
        }
        Ok(out)
    }
}
