//! Shared helpers: a seeded generator of valid route tables and proptest strategies.

use proptest::prelude::*;
use r3_routing::{LayerLayout, LayerSpace, RouteTable};

/// splitmix64, so generated tables depend only on the seed.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Parameters of a generated table.
#[derive(Debug, Clone)]
pub struct Spec {
    pub num_experts: usize,
    pub top_k: usize,
    pub num_layers: usize,
    pub first_k_dense: usize,
    pub tokens: usize,
    pub start_pos: usize,
    /// Percentage of cells left missing.
    pub missing_pct: usize,
    pub seed: u64,
}

/// Distinct random experts for one cell; never all zeros.
pub fn random_cell(rng: &mut SplitMix, num_experts: usize, top_k: usize) -> Vec<u32> {
    let mut cell: Vec<u32> = Vec::with_capacity(top_k);
    while cell.len() < top_k {
        let e = rng.below(num_experts) as u32;
        if !cell.contains(&e) {
            cell.push(e);
        }
    }
    cell
}

/// A MoE-only table following `spec`'s layout (first_k_dense dense layers).
pub fn moe_table(spec: &Spec) -> RouteTable {
    let layout = layout_of(spec);
    let mut rng = SplitMix(spec.seed);
    let mut t = RouteTable::missing(
        spec.num_experts,
        spec.top_k,
        LayerSpace::MoeOnly,
        layout.moe_layers().to_vec(),
        spec.start_pos,
        spec.tokens,
    )
    .expect("valid spec");
    for tok in 0..spec.tokens {
        for c in 0..layout.num_moe_layers() {
            if rng.below(100) < spec.missing_pct {
                continue;
            }
            let cell = random_cell(&mut rng, spec.num_experts, spec.top_k);
            t.set_cell(tok, c, &cell).expect("valid cell");
        }
    }
    t
}

/// An all-layers table (every column MoE), same generator.
pub fn all_layers_table(spec: &Spec) -> RouteTable {
    let spec = Spec {
        first_k_dense: 0,
        ..spec.clone()
    };
    let t = moe_table(&spec);
    t.to_all_layers(&LayerLayout::all_moe(spec.num_layers))
        .expect("all-MoE layout")
}

pub fn layout_of(spec: &Spec) -> LayerLayout {
    LayerLayout::first_k_dense(spec.num_layers, spec.first_k_dense).expect("valid layout")
}

/// Specs covering u8 and u16 storage, dense prefixes, missing cells and offsets.
pub fn spec_strategy(max_missing_pct: usize) -> impl Strategy<Value = Spec> {
    (
        prop_oneof![2usize..=16, 200usize..=300, Just(256usize), Just(257usize)],
        1usize..=4,
        1usize..=6,
        0usize..=2,
        0usize..=12,
        0usize..=5,
        0usize..=max_missing_pct,
        any::<u64>(),
    )
        .prop_map(|(e, k, l, dense, tokens, start, miss, seed)| Spec {
            num_experts: e,
            top_k: k.min(e),
            num_layers: l + dense,
            first_k_dense: dense,
            tokens,
            start_pos: start,
            missing_pct: miss,
            seed,
        })
}
