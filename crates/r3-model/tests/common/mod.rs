//! Tiny configs of every supported family and helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device};
use r3_model::{Config, Model, RandomInit, Weights};
use r3_routing::{LayerSpace, RouteTable};

/// A tiny config.json of `family` (dims small enough for finite differences).
pub fn tiny_json(family: &str) -> serde_json::Value {
    let mut v = serde_json::json!({
        "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": false, "rope_theta": 10000.0
    });
    let extra = match family {
        "qwen3_moe" => serde_json::json!({"model_type": "qwen3_moe", "head_dim": 8,
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
        "qwen2_moe" => serde_json::json!({"model_type": "qwen2_moe", "num_experts": 6,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": false,
            "shared_expert_intermediate_size": 12, "decoder_sparse_step": 1,
            "use_sliding_window": false, "sliding_window": 4}),
        "mixtral" => serde_json::json!({"model_type": "mixtral", "num_local_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 8, "sliding_window": 5}),
        "olmoe" => serde_json::json!({"model_type": "olmoe", "num_experts": 6,
            "num_experts_per_tok": 3, "intermediate_size": 8, "norm_topk_prob": false,
            "clip_qkv": 6.0}),
        "deepseek_v3" => serde_json::json!({"model_type": "deepseek_v3", "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
            "norm_topk_prob": true, "q_lora_rank": 12, "kv_lora_rank": 8,
            "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6,
            "num_key_value_heads": 4, "rope_interleave": true}),
        "moonlight" => serde_json::json!({"model_type": "deepseek_v3", "n_routed_experts": 8,
            "num_experts_per_tok": 3, "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "n_shared_experts": 2, "routed_scaling_factor": 2.446,
            "norm_topk_prob": true, "q_lora_rank": null, "kv_lora_rank": 8,
            "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
            "num_key_value_heads": 4, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
        "qwen3" => serde_json::json!({"model_type": "qwen3", "head_dim": 8}),
        other => panic!("unknown test family {other}"),
    };
    for (k, val) in extra.as_object().expect("object") {
        v[k] = val.clone();
    }
    v
}

/// Every family with a tiny config.
pub const FAMILIES: [&str; 7] = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "moonlight",
    "qwen3",
];

/// A fixed projection of the logits so the loss reaches every output (zero on padding).
pub fn probe(lengths: &[usize], vocab: usize, device: &Device) -> candle_core::Tensor {
    let t = lengths.iter().copied().max().unwrap_or(0);
    let data: Vec<f32> = lengths
        .iter()
        .enumerate()
        .flat_map(|(b, &len)| {
            (0..t).flat_map(move |i| {
                (0..vocab).map(move |j| match i < len {
                    true => ((b * 31 + i * 17 + j * 7) % 23) as f32 / 23.0 - 0.5,
                    false => 0.0,
                })
            })
        })
        .collect();
    candle_core::Tensor::from_vec(data, (lengths.len(), t, vocab), device).expect("probe")
}

/// Parsed tiny config.
pub fn tiny_config(family: &str) -> Config {
    Config::from_value(tiny_json(family)).expect("tiny config")
}

/// Seeded random weights in `dtype`.
pub fn tiny_weights(cfg: &Config, seed: u64, dtype: DType) -> Weights {
    let mut init = RandomInit::new(seed);
    init.std = 0.3;
    init.router_std = 1.0;
    Weights::random(cfg, &init, &Device::Cpu)
        .expect("random weights")
        .to_dtype(dtype)
        .expect("dtype")
}

/// Model of `family` with seeded random f32 weights.
pub fn tiny_model(family: &str, seed: u64) -> (Config, Model) {
    let cfg = tiny_config(family);
    let w = tiny_weights(&cfg, seed, DType::F32);
    let model = Model::new(&cfg, &w).expect("model");
    (cfg, model)
}

/// Deterministic token sequences of the given lengths.
pub fn sequences(lengths: &[usize], vocab: usize, seed: u32) -> Vec<Vec<u32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            (0..len)
                .map(|i| (i as u32 * 7 + b as u32 * 13 + seed * 5 + 1) % vocab as u32)
                .collect()
        })
        .collect()
}

/// Three samples of one prompt, two of another prompt that begins alike, and one sequence
/// alone: a batch whose sequences share prefixes (`Batch::sharing_prefixes`).
pub fn grouped_sequences(vocab: usize) -> Vec<Vec<u32>> {
    let v = |x: u32| x % vocab as u32;
    let prompt_a: Vec<u32> = (0..6).map(|i| v(3 + 5 * i)).collect();
    let mut prompt_b = prompt_a[..2].to_vec();
    prompt_b.extend([v(29), v(30), v(7)]);
    let with = |p: &[u32], r: &[u32]| -> Vec<u32> { p.iter().chain(r).copied().collect() };
    vec![
        with(&prompt_a, &[v(1), v(2), v(4)]),
        with(&prompt_a, &[v(9)]),
        with(&prompt_b, &[v(11), v(12)]),
        with(&prompt_a, &[v(1), v(5), v(6), v(8), v(10)]),
        vec![v(21), v(22), v(23)],
        with(&prompt_b, &[v(13)]),
    ]
}

/// A varmap's variables (`VarMap::data`) with their names, sorted by name.
pub fn sorted_vars(
    vars: &std::sync::Mutex<std::collections::HashMap<String, candle_core::Var>>,
) -> Vec<(String, candle_core::Var)> {
    let data = vars.lock().expect("lock");
    let mut v: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Tables whose cells cycle through all experts, so every expert gets rows.
pub fn covering_tables(cfg: &Config, lengths: &[usize]) -> Vec<RouteTable> {
    let (e, k) = (cfg.num_experts(), cfg.top_k());
    let mut row = 0;
    lengths
        .iter()
        .map(|&len| {
            let columns: Vec<Vec<u32>> = cfg
                .layout
                .moe_layers()
                .iter()
                .map(|_| {
                    (0..len)
                        .flat_map(|t| (0..k).map(move |j| (((row + t) * k + j) % e) as u32))
                        .collect()
                })
                .collect();
            row += len;
            RouteTable::from_columns(
                e,
                k,
                LayerSpace::MoeOnly,
                cfg.layout.moe_layers().to_vec(),
                0,
                &columns,
            )
            .expect("table")
        })
        .collect()
}

/// The experts of cell (`token`, `column`) of `table`, sorted (the HF oracle's
/// `topk_idx_sorted` form).
pub fn sorted_experts(table: &RouteTable, token: usize, column: usize) -> Vec<u64> {
    let mut got: Vec<u64> = table
        .experts(token, column)
        .expect("cell")
        .iter()
        .map(|&e| e as u64)
        .collect();
    got.sort_unstable();
    got
}

/// A softmax router of `experts` experts choosing `top_k`, renormalised iff `norm`.
pub fn softmax_router(experts: usize, top_k: usize, norm: bool) -> r3_model::Router {
    r3_model::Router {
        kind: r3_model::RouterKind::Softmax {
            norm_topk_prob: norm,
        },
        num_experts: experts,
        top_k,
    }
}

/// A DeepSeek-V3 router of `experts` experts in `n_group` groups keeping `topk_group`,
/// choosing `top_k`, renormalised iff `norm`, its gates scaled by 2.5.
pub fn grouped_router(
    experts: usize,
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    norm: bool,
) -> r3_model::Router {
    r3_model::Router {
        kind: r3_model::RouterKind::GroupedSigmoid {
            n_group,
            topk_group,
            norm_topk_prob: norm,
            routed_scaling_factor: 2.5,
        },
        num_experts: experts,
        top_k,
    }
}

/// `rows` rows of `experts` router logits with planted ties: many equal values, and −0
/// beside +0 (which `f32::total_cmp` orders).
pub fn tied_logits(rows: usize, experts: usize) -> Vec<f32> {
    (0..rows * experts)
        .map(|i| match i % 7 {
            0 => 0.0,
            1 => -0.0,
            _ => ((i * 7919) % 13) as f32 / 4.0 - 1.5,
        })
        .collect()
}

/// The additive causal mask `[time, first + time]` of `time` query slots after `first`
/// cached ones (0 where a query sees a key, −∞ where not), within `window` when given.
pub fn causal(first: usize, time: usize, window: Option<usize>) -> Vec<f32> {
    let s = first + time;
    (0..time)
        .flat_map(|i| {
            let q = first + i;
            (0..s).map(move |j| {
                if j <= q && window.is_none_or(|w| q - j < w) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect()
}

/// Per MoE layer in `layers`, the tokens whose forced set differs from HF's own choice
/// there, as the oracle's `routing_replay.tokens_differing_from_native` counts them (the
/// oracle shifts every expert by one; past the first MoE layer the router sees the replayed
/// state, where its own choice may equal a shifted set); `all` where the fixture predates
/// the count (the first two fixtures, in which every cell differs).
pub fn tokens_differing_from_native(
    replay: &serde_json::Value,
    layers: &[usize],
    all: usize,
) -> Vec<usize> {
    let counts = &replay["tokens_differing_from_native"];
    layers
        .iter()
        .map(|layer| match counts.get(layer.to_string()) {
            Some(v) => v.as_u64().expect("count") as usize,
            None => all,
        })
        .collect()
}
