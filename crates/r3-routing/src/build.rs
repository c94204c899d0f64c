//! Building and validating [`RouteTable`]s: every present cell holds `top_k` distinct ids in
//! `[0, num_experts)`; a cell of all -1 (the only missing sentinel) is "missing"; any other
//! negative id is an error; a table has at least one column; lengths match the shape.
//! Errors name the absolute token position, the global layer and the value.

use crate::table::{IdStore, MAX_EXPERTS};
use crate::{DecodeLimits, LayerSpace, RouteError, RouteTable};

/// Checks the expert count and top_k of a table against each other and the limits.
pub(crate) fn check_counts(num_experts: usize, top_k: usize) -> Result<(), RouteError> {
    if num_experts == 0 || num_experts > MAX_EXPERTS {
        return Err(RouteError::Argument(format!(
            "num_experts {num_experts} must be in [1, {MAX_EXPERTS}]"
        )));
    }
    if top_k == 0 || top_k > num_experts {
        return Err(RouteError::Argument(format!(
            "top_k {top_k} must be in [1, num_experts = {num_experts}]"
        )));
    }
    DecodeLimits::check("top_k", top_k, DecodeLimits::MAX_TOP_K)
}

/// Checks the parts of a table that do not depend on the ids.
pub(crate) fn check_header(
    num_experts: usize,
    top_k: usize,
    space: LayerSpace,
    layers: &[usize],
) -> Result<(), RouteError> {
    check_counts(num_experts, top_k)?;
    if layers.is_empty() {
        return Err(RouteError::Layout(
            "a route table needs at least one column (layer)".into(),
        ));
    }
    DecodeLimits::check_layers("columns (layers)", layers.len())?;
    for w in layers.windows(2) {
        if w[0] >= w[1] {
            return Err(RouteError::Layout(format!(
                "column layers must be strictly ascending, got {} then {}",
                w[0], w[1]
            )));
        }
    }
    if let Some(&last) = layers.last() {
        DecodeLimits::check("column layer index", last, DecodeLimits::MAX_LAYERS - 1)?;
    }
    if space == LayerSpace::AllLayers {
        if let Some((c, &l)) = layers.iter().enumerate().find(|(c, &l)| *c != l) {
            return Err(RouteError::Layout(format!(
                "all-layers table: column {c} must be layer {c}, got layer {l}"
            )));
        }
    }
    Ok(())
}

fn checked_len(parts: &[usize], what: &str) -> Result<usize, RouteError> {
    parts.iter().try_fold(1usize, |acc, &p| {
        acc.checked_mul(p).ok_or_else(|| RouteError::Overflow {
            what: format!("{what} size"),
        })
    })
}

/// Validates one cell. Returns `Ok(true)` for a present route, `Ok(false)` for a missing one
/// (every id -1, the only sentinel for "not captured").
pub(crate) fn check_cell(
    vals: &[i64],
    num_experts: usize,
    token: usize,
    layer: usize,
) -> Result<bool, RouteError> {
    if let Some(&value) = vals.iter().find(|&&v| v < -1) {
        return Err(RouteError::NegativeId {
            token,
            layer,
            value,
        });
    }
    let negatives = vals.iter().filter(|&&v| v < 0).count();
    if negatives == vals.len() {
        return Ok(false);
    }
    if negatives > 0 {
        let value = vals.iter().copied().find(|&v| v < 0).unwrap_or(-1);
        return Err(RouteError::PartiallyMissing {
            token,
            layer,
            value,
        });
    }
    if let Some(&value) = vals.iter().find(|&&v| v as u64 >= num_experts as u64) {
        return Err(RouteError::ExpertOutOfRange {
            token,
            layer,
            value,
            num_experts,
        });
    }
    if vals.len() > 1 && vals.iter().all(|&v| v == 0) {
        return Err(RouteError::ZeroCell {
            token,
            layer,
            top_k: vals.len(),
        });
    }
    for (i, &a) in vals.iter().enumerate() {
        if vals[i + 1..].contains(&a) {
            return Err(RouteError::DuplicateExpert {
                token,
                layer,
                expert: a as u32,
            });
        }
    }
    Ok(true)
}

/// The fast validity check of a cell: one stamp per expert id, so a cell's ids are checked
/// for range and duplicates in one pass of O(top_k) with nothing to clear between cells.
/// Anything it does not accept goes to [`check_cell`], which produces the precise error (or
/// accepts an all-missing cell).
struct SeenSet {
    /// `stamp[e]` = the number of the last cell in which expert `e` was seen.
    stamp: Vec<u32>,
    /// The number of the current cell (starts at 1; 0 is "never").
    current: u32,
}

impl SeenSet {
    fn new(num_experts: usize) -> Self {
        SeenSet {
            stamp: vec![0; num_experts],
            current: 0,
        }
    }

    /// True iff every id is in `[0, num_experts)` and all are distinct.
    #[inline]
    fn is_valid_route(&mut self, vals: &[i64]) -> bool {
        self.current = match self.current.checked_add(1) {
            Some(c) => c,
            None => {
                self.stamp.fill(0);
                1
            }
        };
        for &v in vals {
            let Some(s) = usize::try_from(v).ok().and_then(|i| self.stamp.get_mut(i)) else {
                return false;
            };
            if *s == self.current {
                return false;
            }
            *s = self.current;
        }
        true
    }
}

/// The storage width of ids (u8 or u16), written from checked values.
trait IdSlot: Copy {
    /// `v` has been checked to lie in `[0, num_experts)`, which picked the width.
    fn from_checked(v: i64) -> Self;
}

impl IdSlot for u8 {
    #[inline]
    fn from_checked(v: i64) -> Self {
        v as u8
    }
}

impl IdSlot for u16 {
    #[inline]
    fn from_checked(v: i64) -> Self {
        v as u16
    }
}

/// The cell loop of [`RouteTable::from_cells`] for one storage width (matched once, not per
/// id).
#[allow(clippy::too_many_arguments)]
fn fill_cells<S: IdSlot>(
    ids: &mut [S],
    present: &mut [bool],
    layers: &[usize],
    num_experts: usize,
    top_k: usize,
    start_pos: usize,
    mut fill: impl FnMut(usize, &mut [i64]),
) -> Result<(), RouteError> {
    let cols = layers.len();
    let mut buf = vec![0i64; top_k];
    let mut seen = SeenSet::new(num_experts);
    for (cell, (out, mark)) in ids
        .chunks_exact_mut(top_k)
        .zip(present.iter_mut())
        .enumerate()
    {
        fill(cell, &mut buf);
        let ok = seen.is_valid_route(&buf)
            || check_cell(
                &buf,
                num_experts,
                start_pos + cell / cols,
                layers[cell % cols],
            )?;
        if ok {
            *mark = true;
            for (o, &v) in out.iter_mut().zip(&buf) {
                *o = S::from_checked(v);
            }
        }
    }
    Ok(())
}

impl RouteTable {
    /// A table of `num_tokens` rows whose cells are all missing, to be filled with
    /// [`RouteTable::set_cell`] (how an engine records routes as it goes).
    pub fn missing(
        num_experts: usize,
        top_k: usize,
        space: LayerSpace,
        layers: Vec<usize>,
        start_pos: usize,
        num_tokens: usize,
    ) -> Result<RouteTable, RouteError> {
        check_header(num_experts, top_k, space, &layers)?;
        DecodeLimits::check_tokens("num_tokens", num_tokens)?;
        if start_pos.checked_add(num_tokens).is_none() {
            return Err(RouteError::Overflow {
                what: format!("start_pos {start_pos} + {num_tokens} rows"),
            });
        }
        let cells = checked_len(&[num_tokens, layers.len()], "route table")?;
        let len = DecodeLimits::id_count(num_tokens, layers.len(), top_k)?;
        Ok(RouteTable {
            num_experts,
            top_k,
            space,
            layers,
            start_pos,
            num_tokens,
            ids: IdStore::zeros(num_experts, len),
            present: vec![false; cells],
            versions: None,
        })
    }

    /// Builds a table cell by cell: `fill(cell, buf)` writes the `top_k` values of cell
    /// `token * columns + column`; all-(-1) cells become missing, others are validated.
    pub(crate) fn from_cells(
        num_experts: usize,
        top_k: usize,
        space: LayerSpace,
        layers: Vec<usize>,
        start_pos: usize,
        num_tokens: usize,
        fill: impl FnMut(usize, &mut [i64]),
    ) -> Result<RouteTable, RouteError> {
        let mut t = RouteTable::missing(num_experts, top_k, space, layers, start_pos, num_tokens)?;
        let (layers, present) = (&t.layers, &mut t.present);
        match &mut t.ids {
            IdStore::U8(ids) => {
                fill_cells(ids, present, layers, num_experts, top_k, start_pos, fill)?
            }
            IdStore::U16(ids) => {
                fill_cells(ids, present, layers, num_experts, top_k, start_pos, fill)?
            }
        }
        Ok(t)
    }

    /// Builds a table from a flat token-major accessor `get(i)` over
    /// `[num_tokens * columns * top_k]` values; all-(-1) cells become missing.
    pub(crate) fn from_fn(
        num_experts: usize,
        top_k: usize,
        space: LayerSpace,
        layers: Vec<usize>,
        start_pos: usize,
        num_tokens: usize,
        get: impl Fn(usize) -> i64,
    ) -> Result<RouteTable, RouteError> {
        RouteTable::from_cells(
            num_experts,
            top_k,
            space,
            layers,
            start_pos,
            num_tokens,
            |cell, buf| {
                let base = cell * buf.len();
                for (k, b) in buf.iter_mut().enumerate() {
                    *b = get(base + k);
                }
            },
        )
    }

    /// Builds from token-major flat ids `[tokens * columns * top_k]`; a cell whose ids are all
    /// negative (-1) is marked missing. Validates ids and lengths.
    pub fn from_flat(
        num_experts: usize,
        top_k: usize,
        space: LayerSpace,
        layers: Vec<usize>,
        start_pos: usize,
        ids: &[i64],
    ) -> Result<RouteTable, RouteError> {
        RouteTable::from_flat_values(num_experts, top_k, space, layers, start_pos, ids)
    }

    /// [`RouteTable::from_flat`] over ids of any integer type, read in place (a numpy array's
    /// buffer as the Python binding hands it over).
    pub fn from_flat_values<T: Copy + Into<i64>>(
        num_experts: usize,
        top_k: usize,
        space: LayerSpace,
        layers: Vec<usize>,
        start_pos: usize,
        ids: &[T],
    ) -> Result<RouteTable, RouteError> {
        check_header(num_experts, top_k, space, &layers)?;
        let row = layers.len() * top_k;
        let num_tokens = if row == 0 {
            if !ids.is_empty() {
                return Err(RouteError::length(
                    "ids for a table with no columns",
                    0,
                    ids.len(),
                ));
            }
            0
        } else {
            if !ids.len().is_multiple_of(row) {
                return Err(RouteError::Ragged {
                    what: "flat ids in rows of columns x top_k",
                    len: ids.len(),
                    unit: row,
                });
            }
            ids.len() / row
        };
        RouteTable::from_fn(
            num_experts,
            top_k,
            space,
            layers,
            start_pos,
            num_tokens,
            |i| ids[i].into(),
        )
    }

    /// Builds from per-column flat ids: `columns[c]` has `num_tokens * top_k` ids
    /// (token-major), all cells present. `layers[c]` is the global layer of column c.
    pub fn from_columns(
        num_experts: usize,
        top_k: usize,
        space: LayerSpace,
        layers: Vec<usize>,
        start_pos: usize,
        columns: &[Vec<u32>],
    ) -> Result<RouteTable, RouteError> {
        check_header(num_experts, top_k, space, &layers)?;
        if columns.len() != layers.len() {
            return Err(RouteError::length("columns", layers.len(), columns.len()));
        }
        let len = columns.first().map_or(0, Vec::len);
        if !len.is_multiple_of(top_k) {
            return Err(RouteError::Ragged {
                what: "column 0 in cells of top_k",
                len,
                unit: top_k,
            });
        }
        if let Some((c, col)) = columns.iter().enumerate().find(|(_, c)| c.len() != len) {
            return Err(RouteError::length(
                format!("ids in column {c}"),
                len,
                col.len(),
            ));
        }
        let num_tokens = len / top_k;
        let cols = layers.len();
        let mut t = RouteTable::missing(num_experts, top_k, space, layers, start_pos, num_tokens)?;
        let mut ids = vec![0u32; top_k];
        for tok in 0..num_tokens {
            for (c, col) in columns.iter().enumerate() {
                ids.copy_from_slice(&col[tok * top_k..(tok + 1) * top_k]);
                t.set_cell(tok, c, &ids)?;
                debug_assert!(t.present[tok * cols + c]);
            }
        }
        Ok(t)
    }

    /// Writes the route of one cell (row relative to `start_pos`), validating the ids.
    pub fn set_cell(&mut self, token: usize, column: usize, ids: &[u32]) -> Result<(), RouteError> {
        let layer = self.check_cell_pos(token, column)?;
        if ids.len() != self.top_k {
            return Err(RouteError::length(
                format!("ids for token {}, layer {layer}", self.start_pos + token),
                self.top_k,
                ids.len(),
            ));
        }
        let vals: Vec<i64> = ids.iter().map(|&v| i64::from(v)).collect();
        if !check_cell(&vals, self.num_experts, self.start_pos + token, layer)? {
            return Err(RouteError::MissingRoute {
                token: self.start_pos + token,
                layer,
            });
        }
        let cell = self.cell_index(token, column);
        self.present[cell] = true;
        for (k, &v) in ids.iter().enumerate() {
            self.ids.set(cell * self.top_k + k, v as u16);
        }
        Ok(())
    }

    /// Marks one cell missing.
    pub fn clear_cell(&mut self, token: usize, column: usize) -> Result<(), RouteError> {
        self.check_cell_pos(token, column)?;
        let cell = self.cell_index(token, column);
        self.present[cell] = false;
        for k in 0..self.top_k {
            self.ids.set(cell * self.top_k + k, 0);
        }
        Ok(())
    }

    fn check_cell_pos(&self, token: usize, column: usize) -> Result<usize, RouteError> {
        if token >= self.num_tokens {
            return Err(RouteError::OutOfRange {
                what: "row",
                index: token,
                len: self.num_tokens,
            });
        }
        self.layers
            .get(column)
            .copied()
            .ok_or(RouteError::OutOfRange {
                what: "column",
                index: column,
                len: self.layers.len(),
            })
    }
}
