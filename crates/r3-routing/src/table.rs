//! [`RouteTable`]: logical expert ids `[tokens, columns, top_k]` in compact storage, with the
//! layer space and global layer of every column, the absolute position of row 0, an explicit
//! presence mark per (token, column) cell and optional per-row weight versions.
//! Construction and validation live in `build.rs`; space conversion in `space.rs`.

use crate::{LayerSpace, RouteError};

/// Largest expert count a table can hold (ids are stored as u16).
pub const MAX_EXPERTS: usize = 1 << 16;

/// Compact id storage: u8 when `num_experts <= 256`, else u16. Missing cells hold 0 and are
/// never read without checking the presence mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum IdStore {
    U8(Vec<u8>),
    U16(Vec<u16>),
}

impl IdStore {
    pub(crate) fn zeros(num_experts: usize, len: usize) -> Self {
        if num_experts <= 256 {
            IdStore::U8(vec![0; len])
        } else {
            IdStore::U16(vec![0; len])
        }
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> u16 {
        match self {
            IdStore::U8(v) => u16::from(v[i]),
            IdStore::U16(v) => v[i],
        }
    }

    /// `id` has been checked `< num_experts`, which picked the variant, so it fits.
    #[inline]
    pub(crate) fn set(&mut self, i: usize, id: u16) {
        match self {
            IdStore::U8(v) => v[i] = id as u8,
            IdStore::U16(v) => v[i] = id,
        }
    }

    fn slice(&self, from: usize, to: usize) -> Self {
        match self {
            IdStore::U8(v) => IdStore::U8(v[from..to].to_vec()),
            IdStore::U16(v) => IdStore::U16(v[from..to].to_vec()),
        }
    }

    fn extend(&mut self, other: &IdStore) {
        match (self, other) {
            (IdStore::U8(a), IdStore::U8(b)) => a.extend_from_slice(b),
            (IdStore::U16(a), IdStore::U16(b)) => a.extend_from_slice(b),
            // Same num_experts always picks the same variant; callers check that first.
            (a, b) => {
                let n = b.len();
                for i in 0..n {
                    let id = b.get(i);
                    match a {
                        IdStore::U8(v) => v.push(id as u8),
                        IdStore::U16(v) => v.push(id),
                    }
                }
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            IdStore::U8(v) => v.len(),
            IdStore::U16(v) => v.len(),
        }
    }
}

/// Logical expert ids for `[tokens, columns, top_k]`; see the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable {
    pub(crate) num_experts: usize,
    pub(crate) top_k: usize,
    pub(crate) space: LayerSpace,
    /// Global layer index of each column, strictly ascending.
    pub(crate) layers: Vec<usize>,
    pub(crate) start_pos: usize,
    pub(crate) num_tokens: usize,
    /// `[num_tokens * columns * top_k]`, token-major.
    pub(crate) ids: IdStore,
    /// `[num_tokens * columns]`: whether the cell holds a route.
    pub(crate) present: Vec<bool>,
    /// Weight version that produced each row, if known.
    pub(crate) versions: Option<Vec<u64>>,
}

impl RouteTable {
    /// Number of rows (tokens).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Number of layer columns.
    pub fn num_columns(&self) -> usize {
        self.layers.len()
    }

    /// Experts chosen per (token, layer).
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Number of (logical) experts ids range over.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// The layer space of the columns.
    pub fn space(&self) -> LayerSpace {
        self.space
    }

    /// Global layer index of each column.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Absolute token position of row 0.
    pub fn start_pos(&self) -> usize {
        self.start_pos
    }

    /// Absolute position one past the last row.
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.num_tokens
    }

    /// Column of global layer `layer`, if the table has one.
    pub fn column_of_layer(&self, layer: usize) -> Option<usize> {
        self.layers.binary_search(&layer).ok()
    }

    #[inline]
    pub(crate) fn cell_index(&self, token: usize, column: usize) -> usize {
        token * self.layers.len() + column
    }

    /// Whether cell (row `token`, `column`) holds a route; false when out of range.
    pub fn is_present(&self, token: usize, column: usize) -> bool {
        token < self.num_tokens
            && column < self.layers.len()
            && self.present[self.cell_index(token, column)]
    }

    /// Number of present cells.
    pub fn num_present(&self) -> usize {
        self.present.iter().filter(|&&p| p).count()
    }

    /// Ids of one cell (row index relative to `start_pos`); None if missing or out of range.
    pub fn experts(&self, token: usize, column: usize) -> Option<Vec<u16>> {
        if !self.is_present(token, column) {
            return None;
        }
        let base = self.cell_index(token, column) * self.top_k;
        Some((base..base + self.top_k).map(|i| self.ids.get(i)).collect())
    }

    /// Id `k` of a present cell without allocating; None if missing or out of range.
    #[inline]
    pub fn expert_at(&self, token: usize, column: usize, k: usize) -> Option<u16> {
        if k >= self.top_k || !self.is_present(token, column) {
            return None;
        }
        Some(
            self.ids
                .get(self.cell_index(token, column) * self.top_k + k),
        )
    }

    /// All rows of one column as flat u32 `[num_tokens * top_k]`.
    pub fn column_ids(&self, column: usize) -> Result<Vec<u32>, RouteError> {
        self.column_ids_range(column, 0, self.num_tokens)
    }

    /// Rows `[from, to)` of one column as flat u32; errors name the first missing cell.
    pub fn column_ids_range(
        &self,
        column: usize,
        from: usize,
        to: usize,
    ) -> Result<Vec<u32>, RouteError> {
        if column >= self.layers.len() {
            return Err(RouteError::OutOfRange {
                what: "column",
                index: column,
                len: self.layers.len(),
            });
        }
        self.check_row_range(from, to)?;
        let mut out = Vec::with_capacity((to - from) * self.top_k);
        for t in from..to {
            let base = self.present_cell(t, column)? * self.top_k;
            out.extend((base..base + self.top_k).map(|i| u32::from(self.ids.get(i))));
        }
        Ok(out)
    }

    /// Rows `[from, to)` of every column at once: `columns[c]` gets column `c`'s
    /// `(to − from) · top_k` ids in row order (what [`RouteTable::column_ids_range`] gives
    /// each column), read in one pass over the token-major cells instead of one strided pass
    /// per column. Errors name the first missing cell in row order, or a destination of
    /// another length or count.
    pub fn write_columns(
        &self,
        from: usize,
        to: usize,
        columns: &mut [&mut [u32]],
    ) -> Result<(), RouteError> {
        self.check_row_range(from, to)?;
        self.check_destinations(from, to, columns.iter().map(|c| c.len()))?;
        let k = self.top_k;
        for t in from..to {
            for (c, column) in columns.iter_mut().enumerate() {
                let cell = self.present_cell(t, c)?;
                let dst = &mut column[(t - from) * k..(t - from + 1) * k];
                for (e, d) in dst.iter_mut().enumerate() {
                    *d = u32::from(self.ids.get(cell * k + e));
                }
            }
        }
        Ok(())
    }

    /// Whether rows `[from, to)` of every column hold exactly `columns[c]`'s ids in the same
    /// order (`columns[c]` laid out as [`RouteTable::write_columns`] writes it), in one pass
    /// over the token-major cells. Errors as `write_columns`.
    pub fn columns_equal(
        &self,
        from: usize,
        to: usize,
        columns: &[&[u32]],
    ) -> Result<bool, RouteError> {
        self.check_row_range(from, to)?;
        self.check_destinations(from, to, columns.iter().map(|c| c.len()))?;
        let k = self.top_k;
        for t in from..to {
            for (c, column) in columns.iter().enumerate() {
                let cell = self.present_cell(t, c)?;
                let want = &column[(t - from) * k..(t - from + 1) * k];
                let same = want
                    .iter()
                    .enumerate()
                    .all(|(e, &w)| u32::from(self.ids.get(cell * k + e)) == w);
                if !same {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// The cell index of (row `t`, `column`), or the error naming it as missing.
    fn present_cell(&self, t: usize, column: usize) -> Result<usize, RouteError> {
        let cell = self.cell_index(t, column);
        if self.present[cell] {
            Ok(cell)
        } else {
            Err(RouteError::MissingRoute {
                token: self.start_pos + t,
                layer: self.layers[column],
            })
        }
    }

    /// That `lens` are one per column, each `(to − from) · top_k` long.
    fn check_destinations(
        &self,
        from: usize,
        to: usize,
        lens: impl ExactSizeIterator<Item = usize>,
    ) -> Result<(), RouteError> {
        let want = (to - from) * self.top_k;
        if lens.len() != self.layers.len() {
            return Err(RouteError::Argument(format!(
                "{} column destinations for a table of {} columns",
                lens.len(),
                self.layers.len()
            )));
        }
        for (c, len) in lens.enumerate() {
            if len != want {
                return Err(RouteError::Argument(format!(
                    "column {c}'s destination holds {len} ids for {} rows of top-{}",
                    to - from,
                    self.top_k
                )));
            }
        }
        Ok(())
    }

    fn check_row_range(&self, from: usize, to: usize) -> Result<(), RouteError> {
        if from > to {
            return Err(RouteError::Argument(format!(
                "row range [{from}, {to}) is reversed"
            )));
        }
        if to > self.num_tokens {
            return Err(RouteError::OutOfRange {
                what: "row range end",
                index: to,
                len: self.num_tokens,
            });
        }
        Ok(())
    }

    /// Rows `[from, to)` as a new table (start_pos adjusted, versions kept).
    pub fn slice_rows(&self, from: usize, to: usize) -> Result<RouteTable, RouteError> {
        self.check_row_range(from, to)?;
        let cols = self.layers.len();
        Ok(RouteTable {
            num_experts: self.num_experts,
            top_k: self.top_k,
            space: self.space,
            layers: self.layers.clone(),
            start_pos: self.start_pos + from,
            num_tokens: to - from,
            ids: self
                .ids
                .slice(from * cols * self.top_k, to * cols * self.top_k),
            present: self.present[from * cols..to * cols].to_vec(),
            versions: self.versions.as_ref().map(|v| v[from..to].to_vec()),
        })
    }

    /// Checks that `other` has the same experts, top_k, space and layers.
    pub fn check_same_shape(&self, other: &RouteTable) -> Result<(), RouteError> {
        if self.num_experts != other.num_experts {
            return Err(RouteError::shape(
                "num_experts",
                self.num_experts,
                other.num_experts,
            ));
        }
        if self.top_k != other.top_k {
            return Err(RouteError::shape("top_k", self.top_k, other.top_k));
        }
        if self.space != other.space {
            return Err(RouteError::shape(
                "layer_space",
                self.space.as_str(),
                other.space.as_str(),
            ));
        }
        if self.layers != other.layers {
            return Err(RouteError::layers_shape(
                "layers",
                &self.layers,
                &other.layers,
            ));
        }
        Ok(())
    }

    /// Appends the rows of `other`, which must start exactly at `self.end_pos()`.
    pub fn append(&mut self, other: &RouteTable) -> Result<(), RouteError> {
        self.check_same_shape(other)?;
        if other.start_pos != self.end_pos() {
            return Err(RouteError::Misaligned {
                what: "appended rows",
                rows: other.start_pos..other.end_pos(),
                against: self.start_pos..self.end_pos(),
                rule: "they must start where the table ends",
            });
        }
        let versions = match (&self.versions, &other.versions) {
            (Some(a), Some(b)) => Some([a.as_slice(), b.as_slice()].concat()),
            (None, None) => None,
            (_, b) if self.num_tokens == 0 => b.clone(),
            (a, _) if other.num_tokens == 0 => a.clone(),
            _ => {
                let side = |v: &Option<Vec<u64>>| if v.is_some() { "present" } else { "absent" };
                return Err(RouteError::shape(
                    "weight versions",
                    side(&self.versions),
                    side(&other.versions),
                ));
            }
        };
        self.ids.extend(&other.ids);
        self.present.extend_from_slice(&other.present);
        self.num_tokens += other.num_tokens;
        self.versions = versions;
        debug_assert_eq!(
            self.ids.len(),
            self.num_tokens * self.layers.len() * self.top_k
        );
        Ok(())
    }

    /// Sets the weight version of every row (length must equal `num_tokens`).
    pub fn set_versions(&mut self, v: Vec<u64>) -> Result<(), RouteError> {
        if v.len() != self.num_tokens {
            return Err(RouteError::length(
                "weight versions",
                self.num_tokens,
                v.len(),
            ));
        }
        self.versions = Some(v);
        Ok(())
    }

    /// Sets the same weight version on every row.
    pub fn set_version_all(&mut self, version: u64) {
        self.versions = Some(vec![version; self.num_tokens]);
    }

    /// Weight version per row, if known.
    pub fn versions(&self) -> Option<&[u64]> {
        self.versions.as_deref()
    }
}
