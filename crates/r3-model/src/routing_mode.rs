//! Routing modes of the forward pass and replay verification: the covered route tables a
//! replay takes ([`ReplayRoutes`], where the coverage invariant is checked once), turning
//! them into per-layer forced ids, building recorded tables, and the proof that a replayed
//! forward used exactly the given experts.

use std::sync::Arc;

use r3_routing::{LayerLayout, LayerSpace, RouteTable};
use rayon::prelude::*;

use crate::error::{ModelError, Result};

/// How the MoE layers choose experts in one forward call.
#[derive(Debug, Clone, Copy)]
pub enum Routing<'a> {
    /// Each router picks its own top-k.
    Native,
    /// Native routing, and the chosen ids are returned as one [`RouteTable`] per sequence.
    Record,
    /// Use the given ids (one table per sequence, MoE-only or all-layer space, `start_pos`
    /// 0, covering all `len` tokens or the first `len − 1`); gates are still computed from
    /// this forward's router logits. A table with `len − 1` rows leaves the final position
    /// (whose output predicts nothing) to native routing; the proof reports it.
    Replay(&'a ReplayRoutes),
}

/// Route tables in which every row has a route in every MoE layer: the only input
/// [`Routing::Replay`] takes, so a replayed forward never meets a missing cell.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayRoutes {
    tables: Vec<RouteTable>,
}

impl ReplayRoutes {
    /// Checks that every row of every table has a present cell in every column of a MoE
    /// layer of `layout` (an all-layer table leaves its dense layers' columns empty).
    pub fn new(tables: Vec<RouteTable>, layout: &LayerLayout) -> Result<Self> {
        for (b, table) in tables.iter().enumerate() {
            let moe_columns: Vec<usize> = (0..table.num_columns())
                .filter(|&c| layout.is_moe(table.layers()[c]))
                .collect();
            let missing = (0..table.num_tokens())
                .flat_map(|t| moe_columns.iter().map(move |&c| (t, c)))
                .find(|&(t, c)| !table.is_present(t, c));
            let Some((t, c)) = missing else {
                continue;
            };
            return Err(mismatch(
                b,
                format!(
                    "row {t} has no route for layer {} (replay needs every cell)",
                    table.layers()[c]
                ),
            ));
        }
        Ok(ReplayRoutes { tables })
    }

    /// The tables, one per sequence.
    pub fn tables(&self) -> &[RouteTable] {
        &self.tables
    }

    /// The tables of sequences `rows`, in that order (still covered: no check needed).
    pub fn select(&self, rows: &[usize]) -> Result<ReplayRoutes> {
        let tables = rows
            .iter()
            .map(|&r| {
                self.tables.get(r).cloned().ok_or_else(|| {
                    ModelError::Input(format!(
                        "replay row {r} of {} route tables",
                        self.tables.len()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ReplayRoutes { tables })
    }

    /// The tables, one per sequence.
    pub fn into_tables(self) -> Vec<RouteTable> {
        self.tables
    }
}

/// Evidence that a replayed forward used the given experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayProof {
    /// global index of each MoE layer
    pub layers: Vec<usize>,
    /// per MoE layer: (token, layer) cells whose experts came from the tables
    pub replayed_cells: Vec<usize>,
    /// per MoE layer: cells routed natively (final positions of `len − 1`-row tables)
    pub native_cells: Vec<usize>,
    /// per MoE layer: replayed cells whose expert set differs from this forward's own top-k
    pub differs_from_native: Vec<usize>,
    /// per sequence: whether its final position was routed natively
    pub native_final_position: Vec<bool>,
}

impl ReplayProof {
    /// Total replayed cells over all layers.
    pub fn total_replayed(&self) -> usize {
        self.replayed_cells.iter().sum()
    }
}

/// Forced ids of one MoE layer over the flattened real rows of the batch.
#[derive(Debug, Clone)]
pub(crate) struct LayerPlan {
    /// `[rows * top_k]` ids (meaningful where `forced`)
    pub ids: Vec<u32>,
    /// `[rows]` whether the row's ids come from a table
    pub forced: Vec<bool>,
    /// Whether the layer also routes natively, to count the forced rows whose experts differ
    /// from its router's own choice (a replay's routing divergence). Without it, and with
    /// every row forced, the router's logits serve the gates alone and never go to the host.
    pub count_differences: bool,
    /// Per row, how many real positions it stands for (rows computed once for several
    /// sequences: [`crate::model::shared_prefix::SharedPrefixes`]); None: one each. A
    /// differing row counts once per position, as the unshared forward counts it.
    pub copies: Option<Arc<Vec<u32>>>,
}

/// Forced ids for every MoE layer, plus which sequences route their final position natively.
#[derive(Debug, Clone)]
pub(crate) struct ReplayPlan {
    pub layers: Vec<LayerPlan>,
    pub native_final_position: Vec<bool>,
    /// tables converted to the MoE-only space (for verification)
    pub tables: Vec<RouteTable>,
}

impl ReplayPlan {
    /// The plan over computed rows standing for real rows `owners` (sequence-major indices
    /// into this plan's rows), row `r` for `copies[r]` real positions.
    pub(crate) fn for_rows(&self, owners: &[u32], copies: Arc<Vec<u32>>) -> ReplayPlan {
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let k = layer.ids.len() / layer.forced.len().max(1);
                LayerPlan {
                    ids: owners
                        .iter()
                        .flat_map(|&o| &layer.ids[o as usize * k..(o as usize + 1) * k])
                        .copied()
                        .collect(),
                    forced: owners.iter().map(|&o| layer.forced[o as usize]).collect(),
                    count_differences: layer.count_differences,
                    copies: Some(copies.clone()),
                }
            })
            .collect();
        ReplayPlan {
            layers,
            native_final_position: self.native_final_position.clone(),
            tables: Vec::new(),
        }
    }
}

/// What a table must fit.
pub(crate) struct ModelShape<'a> {
    pub layout: &'a LayerLayout,
    pub num_experts: usize,
    pub top_k: usize,
}

fn mismatch(sequence: usize, msg: impl Into<String>) -> ModelError {
    ModelError::RouteMismatch {
        sequence,
        msg: msg.into(),
    }
}

/// Checks each table against the model and the sequence lengths and lays its ids out per
/// layer over the batch's real rows (row order: sequence-major, `offsets[b] + t`).
pub(crate) fn plan_replay(
    routes: &ReplayRoutes,
    lengths: &[usize],
    shape: &ModelShape<'_>,
) -> Result<ReplayPlan> {
    let tables = routes.tables();
    if tables.len() != lengths.len() {
        return Err(ModelError::Input(format!(
            "replay got {} route tables for a batch of {} sequences",
            tables.len(),
            lengths.len()
        )));
    }
    let k = shape.top_k;
    let moe_layers = shape.layout.moe_layers();
    let total: usize = lengths.iter().sum();
    let mut layers: Vec<LayerPlan> = moe_layers
        .iter()
        .map(|_| LayerPlan {
            ids: vec![0; total * k],
            forced: vec![false; total],
            count_differences: true,
            copies: None,
        })
        .collect();
    let mut native_final_position = Vec::with_capacity(tables.len());
    let mut converted = Vec::with_capacity(tables.len());
    // Each table's first batch row and its row count.
    let mut placed = Vec::with_capacity(tables.len());
    let mut offset = 0;
    for (b, (table, &len)) in tables.iter().zip(lengths).enumerate() {
        let table = match table.space() {
            LayerSpace::MoeOnly => table.clone(),
            LayerSpace::AllLayers => table
                .to_moe_only(shape.layout)
                .map_err(|e| mismatch(b, e.to_string()))?,
        };
        if table.layers() != moe_layers {
            return Err(mismatch(
                b,
                format!(
                    "table layers {:?} are not the model's MoE layers {:?}",
                    table.layers(),
                    moe_layers
                ),
            ));
        }
        if table.num_experts() != shape.num_experts || table.top_k() != k {
            return Err(mismatch(
                b,
                format!(
                    "table has {} experts / top-{}, model has {} / top-{k}",
                    table.num_experts(),
                    table.top_k(),
                    shape.num_experts
                ),
            ));
        }
        if table.start_pos() != 0 {
            return Err(mismatch(
                b,
                format!(
                    "table starts at position {}, the forward starts at 0",
                    table.start_pos()
                ),
            ));
        }
        let rows = table.num_tokens();
        if rows != len && rows + 1 != len {
            return Err(mismatch(
                b,
                format!(
                    "table has {rows} rows for a sequence of {len} tokens (need {len} or {})",
                    len.saturating_sub(1)
                ),
            ));
        }
        native_final_position.push(rows + 1 == len);
        placed.push((offset, rows));
        converted.push(table);
        offset += len;
    }
    // Every cell is present (`ReplayRoutes`). Each table writes its rows of every layer in
    // one pass over its token-major cells, the tables side by side (a GPU waits on this host
    // work at the start of a replayed forward; a pass per layer read each table strided).
    let mut per_table: Vec<Vec<&mut [u32]>> = placed.iter().map(|_| Vec::new()).collect();
    for plan in &mut layers {
        let mut rest: &mut [u32] = &mut plan.ids;
        let mut at = 0;
        for (&(offset, rows), columns) in placed.iter().zip(per_table.iter_mut()) {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((offset - at) * k);
            let (rows_ids, tail) = tail.split_at_mut(rows * k);
            columns.push(rows_ids);
            rest = tail;
            at = offset + rows;
        }
        for &(offset, rows) in &placed {
            plan.forced[offset..offset + rows].fill(true);
        }
    }
    per_table
        .par_iter_mut()
        .zip(converted.par_iter())
        .try_for_each(|(columns, table)| -> Result<()> {
            table.write_columns(0, table.num_tokens(), columns)?;
            Ok(())
        })?;
    Ok(ReplayPlan {
        layers,
        native_final_position,
        tables: converted,
    })
}

/// Whether two rows of expert ids hold the same experts in any order (as multisets). Equal
/// rows (the common case: a replayed row is dispatched as given) answer at once; otherwise
/// both are sorted on the stack up to top-16, so the per-row checks of replay allocate
/// nothing (they ran once per token, layer and step).
pub(crate) fn same_experts(a: &[u32], b: &[u32]) -> bool {
    const ON_STACK: usize = 16;
    if a == b {
        return true;
    }
    if a.len() != b.len() {
        return false;
    }
    if a.len() <= ON_STACK {
        let (mut x, mut y) = ([0u32; ON_STACK], [0u32; ON_STACK]);
        let (x, y) = (&mut x[..a.len()], &mut y[..b.len()]);
        x.copy_from_slice(a);
        y.copy_from_slice(b);
        x.sort_unstable();
        y.sort_unstable();
        return x == y;
    }
    let (mut x, mut y) = (a.to_vec(), b.to_vec());
    x.sort_unstable();
    y.sort_unstable();
    x == y
}

/// Checks that every replayed cell used exactly the table's experts (as sets) and builds
/// the proof. `used[c]` is `[rows * top_k]` ids as dispatched in MoE layer column `c`.
pub(crate) fn verify_replay(
    plan: &ReplayPlan,
    used: &[Vec<u32>],
    differs: &[usize],
    lengths: &[usize],
    layout: &LayerLayout,
    top_k: usize,
) -> Result<ReplayProof> {
    let layers = layout.moe_layers().to_vec();
    if let Some((replayed, native)) = exactly_as_tables(plan, used, lengths, top_k) {
        return Ok(ReplayProof {
            replayed_cells: vec![replayed; layers.len()],
            native_cells: vec![native; layers.len()],
            layers,
            differs_from_native: differs.to_vec(),
            native_final_position: plan.native_final_position.clone(),
        });
    }
    // The layers are checked side by side (a GPU waits on this host work at the end of a
    // replayed forward); an error names the first bad cell in layer order.
    let counted: Vec<Result<(usize, usize)>> = layers
        .par_iter()
        .enumerate()
        .map(|(c, &layer)| verify_layer(plan, used, lengths, c, layer, top_k))
        .collect();
    let mut replayed_cells = Vec::with_capacity(layers.len());
    let mut native_cells = Vec::with_capacity(layers.len());
    for result in counted {
        let (replayed, native) = result?;
        replayed_cells.push(replayed);
        native_cells.push(native);
    }
    Ok(ReplayProof {
        layers,
        replayed_cells,
        native_cells,
        differs_from_native: differs.to_vec(),
        native_final_position: plan.native_final_position.clone(),
    })
}

/// [`verify_replay`]'s common case in one pass over each table's token-major cells, the
/// tables side by side: when every replayed cell of every layer was dispatched with exactly
/// the table's experts in the table's order (a replayed row is dispatched as given), the
/// replayed and native cell counts of each layer (the same for all); None otherwise (the
/// same experts in another order, a wrong cell, a missing record), which the per-layer
/// check then answers, naming the first bad cell.
fn exactly_as_tables(
    plan: &ReplayPlan,
    used: &[Vec<u32>],
    lengths: &[usize],
    top_k: usize,
) -> Option<(usize, usize)> {
    let mut spans = Vec::with_capacity(lengths.len());
    let (mut offset, mut replayed, mut native) = (0, 0, 0);
    for (table, &len) in plan.tables.iter().zip(lengths) {
        let rows = table.num_tokens().min(len);
        spans.push((offset, rows));
        replayed += rows;
        native += len - rows;
        offset += len;
    }
    if plan.tables.len() != lengths.len() || used.len() != plan.layers.len() {
        return None;
    }
    let exact = plan
        .tables
        .par_iter()
        .zip(&spans)
        .all(|(table, &(offset, rows))| {
            let columns: Option<Vec<&[u32]>> = used
                .iter()
                .map(|u| u.get(offset * top_k..(offset + rows) * top_k))
                .collect();
            columns.is_some_and(|columns| table.columns_equal(0, rows, &columns) == Ok(true))
        });
    exact.then_some((replayed, native))
}

/// [`verify_replay`] of MoE layer column `c` (model layer `layer`): its replayed and native
/// cell counts, or the first cell whose experts differ from the table's.
fn verify_layer(
    plan: &ReplayPlan,
    used: &[Vec<u32>],
    lengths: &[usize],
    c: usize,
    layer: usize,
    top_k: usize,
) -> Result<(usize, usize)> {
    let used = used
        .get(c)
        .ok_or_else(|| ModelError::Input(format!("no dispatch record for MoE layer {layer}")))?;
    let (mut replayed, mut native) = (0, 0);
    let mut offset = 0;
    for (b, (table, &len)) in plan.tables.iter().zip(lengths).enumerate() {
        // The table covers its rows (`ReplayRoutes`); rows past it route natively.
        let rows = table.num_tokens().min(len);
        native += len - rows;
        let column = table
            .column_ids_range(c, 0, rows)
            .map_err(|e| mismatch(b, e.to_string()))?;
        for t in 0..rows {
            let row = offset + t;
            let given = column.get(t * top_k..(t + 1) * top_k).unwrap_or(&[]);
            let got = used.get(row * top_k..(row + 1) * top_k).unwrap_or(&[]);
            if given.len() != top_k || !same_experts(given, got) {
                let (mut given, mut got) = (given.to_vec(), got.to_vec());
                given.sort_unstable();
                got.sort_unstable();
                return Err(ModelError::ReplayNotHonoured {
                    layer,
                    sequence: b,
                    token: t,
                    used: got,
                    given,
                });
            }
            replayed += 1;
        }
        offset += len;
    }
    Ok((replayed, native))
}

/// One MoE-only [`RouteTable`] per sequence from per-layer dispatched ids over real rows.
pub(crate) fn record_tables(
    used: &[Vec<u32>],
    lengths: &[usize],
    layout: &LayerLayout,
    num_experts: usize,
    top_k: usize,
) -> Result<Vec<RouteTable>> {
    let mut tables = Vec::with_capacity(lengths.len());
    let mut offset = 0;
    for &len in lengths {
        let columns: Vec<Vec<u32>> = used
            .iter()
            .map(|ids| ids[offset * top_k..(offset + len) * top_k].to_vec())
            .collect();
        tables.push(RouteTable::from_columns(
            num_experts,
            top_k,
            LayerSpace::MoeOnly,
            layout.moe_layers().to_vec(),
            0,
            &columns,
        )?);
        offset += len;
    }
    Ok(tables)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proof accepts dispatched rows that hold the table's experts in another order and
    /// refuses a row with another expert, naming its layer, sequence and token.
    #[test]
    fn verification_names_the_first_cell_not_honoured() {
        let layout = LayerLayout::all_moe(2);
        // one sequence of 3 tokens, top-2 of 4 experts, two MoE layers
        let columns = vec![vec![0, 1, 2, 3, 1, 2], vec![3, 0, 0, 2, 1, 3]];
        let table = RouteTable::from_columns(4, 2, LayerSpace::MoeOnly, vec![0, 1], 0, &columns)
            .expect("table");
        let routes = ReplayRoutes::new(vec![table], &layout).expect("routes");
        let shape = ModelShape {
            layout: &layout,
            num_experts: 4,
            top_k: 2,
        };
        let plan = plan_replay(&routes, &[3], &shape).expect("plan");
        let permuted = vec![vec![1, 0, 3, 2, 2, 1], vec![0, 3, 2, 0, 3, 1]];
        let proof = verify_replay(&plan, &permuted, &[0, 0], &[3], &layout, 2).expect("proof");
        assert_eq!(proof.replayed_cells, vec![3, 3]);
        let mut wrong = permuted.clone();
        wrong[1][5] = 0; // layer 1, token 2: experts {3, 0} where the table says {1, 3}
        match verify_replay(&plan, &wrong, &[0, 0], &[3], &layout, 2) {
            Err(ModelError::ReplayNotHonoured {
                layer,
                sequence,
                token,
                used,
                given,
            }) => {
                assert_eq!((layer, sequence, token), (1, 0, 2));
                assert_eq!((used, given), (vec![0, 3], vec![1, 3]));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Rows hold the same experts in any order, as multisets; longer than the stack's 16 too.
    #[test]
    fn same_experts_compares_rows_as_multisets() {
        assert!(same_experts(&[3, 1, 7], &[3, 1, 7]));
        assert!(same_experts(&[3, 1, 7], &[7, 3, 1]));
        assert!(!same_experts(&[3, 1, 7], &[3, 1, 6]));
        assert!(!same_experts(&[3, 3, 1], &[3, 1, 1]));
        assert!(!same_experts(&[3, 1], &[3, 1, 7]));
        let long: Vec<u32> = (0..20).collect();
        let reversed: Vec<u32> = (0..20).rev().collect();
        assert!(same_experts(&long, &reversed));
        assert!(!same_experts(&long, &(1..21).collect::<Vec<u32>>()));
    }
}
