//! The device engine's memory plan: what one forward step needs on the device beyond the
//! weights and the batch's KV cache, estimated from the step's shape before it runs, so
//! admission can refuse or hold back a request instead of letting the device run out.
//!
//! The estimate counts what is alive at the peak of one step, in f32 (4 bytes, an upper
//! bound in bf16 / f16, whose activations are f32 math rounded at the same points), for a
//! step of `rows` sequences feeding `time` tokens each over `slots` cache slots (the cache's
//! slots after the step) with `logit_positions` positions per row sent through the LM head
//! (1, or `time` when prompt log-probs are asked), its attention in the query tiles
//! [`score_tiles`] gives (`tile_rows` sequences × `tile_time` positions):
//!
//! ```text
//! bytes = 4 · ( 3 · tile_rows · heads · tile_time · slots   attention scores, masked scores, probabilities (one tile)
//!             + rows · time · slots                         the step's mask
//!             + 3 · rows · logit_positions · vocab          logits and two more of their size
//!             + rows · time · (8·hidden + 4·q_width + 4·ffn_width + experts)   hidden states, q/k/v and the attention's output, feed-forward, router
//!             + rows · capacity(slots) · layer_kv )         one layer's keys and values regrown as a step outgrows their buffer
//! ```
//!
//! The last term also bounds what a 16-bit cache adds: its regrowth takes half as many
//! bytes, and where the composed attention runs (not the decode kernel, which reads the
//! 16-bit values in place) one layer's keys and values widened to f32, `rows · slots ·
//! layer_kv` floats, alive after the regrowth's old buffer is gone. Not counted: the decode
//! kernel's span states where it splits a small batch's keys (`rows · kv_heads · spans ·
//! groups · (v_width + 2)` floats, under 1 MB at batch 1).
//!
//! The tiles keep the scores within a quarter of the activation budget (they would hold
//! `rows · heads · time · slots` in one product: gigabytes for a long prompt's prefill, or
//! a large batch decoding at long context); what then grows with the prompt squared is the
//! mask, a `heads`-th of one untiled score tensor (built on the device from each row's seen
//! slots: a byte an element of comparisons beside it while it is built, before anything
//! score-sized lives; a step the GPU's decode kernel takes in every layer builds none, and
//! holds no scores either, so the estimate is an upper bound there). The logits' two companions are the greedy picks' shifted and exponentiated rows
//! (`greedy.rs`), or the rows copied out for the host and their f32 cast. `q_width` is
//! `heads ×` the query head width, `ffn_width` the widest feed-forward a token
//! passes (the dense MLP, or top-k experts plus the shared one), `layer_kv` one slot's keys
//! and values in one layer, `capacity(n)` the slots a cache buffer holding `n` may have room
//! for (`r3_model::layers::attention::kv_capacity_for`: an eighth more, at least 16; the KV
//! budget counts the batch's cache the same way). It is an estimate of the largest live set, not a measurement:
//! the allocator's pools and kernels' workspaces come on top, which is what the headroom
//! between the budgets and the device's memory is for.

use r3_model::layers::attention::{kv_capacity_for, ScoreTiles, MAX_TENSOR_ELEMENTS};
use r3_model::{AttentionConfig, Config, SharedExpert};

/// The shape of one forward step of the device engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences in the step.
    pub rows: usize,
    /// Tokens fed per sequence (the longest uncached prompt tail in a prefill, 1 in decode).
    pub time: usize,
    /// Cache slots per sequence once the step's keys are appended.
    pub slots: usize,
    /// Positions per sequence whose logits are computed (1, or `time` for prompt log-probs).
    pub logit_positions: usize,
}

/// Floats of keys and values one cache slot holds in one layer: GQA's key and value heads,
/// or MLA's expanded per-head keys (no-RoPE and RoPE parts) and values.
pub fn layer_kv_floats(cfg: &Config) -> usize {
    match cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            ..
        } => 2 * num_kv_heads * head_dim,
        AttentionConfig::Mla {
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            ..
        } => cfg.num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim),
    }
}

/// The query tiles a step's attention runs in under an activation budget of `budget` bytes:
/// its three score-sized f32 tensors within a quarter of the budget.
pub fn score_tiles(budget: usize) -> ScoreTiles {
    ScoreTiles::at_most(budget / (4 * 3 * 4))
}

/// Bytes of activations the step `shape` holds at its peak on the device, its attention in
/// the query tiles `tiles` allows (the module doc gives the formula); `usize::MAX` (no
/// budget takes it) where its mask or its logits would have more than
/// [`MAX_TENSOR_ELEMENTS`] elements.
pub fn step_activation_bytes(cfg: &Config, shape: StepShape, tiles: ScoreTiles) -> usize {
    let heads = cfg.num_attention_heads;
    let q_head = match cfg.attention {
        AttentionConfig::Gqa { head_dim, .. } => head_dim,
        AttentionConfig::Mla {
            qk_nope_head_dim,
            qk_rope_head_dim,
            ..
        } => qk_nope_head_dim + qk_rope_head_dim,
    };
    let layer_kv = layer_kv_floats(cfg);
    let (experts, routed) = match &cfg.moe {
        Some(m) => {
            let shared = match m.shared {
                SharedExpert::None => 0,
                SharedExpert::Plain { intermediate_size }
                | SharedExpert::Gated { intermediate_size } => intermediate_size,
            };
            (m.num_experts, m.top_k * m.expert_intermediate_size + shared)
        }
        None => (0, 0),
    };
    let ffn_width = cfg.intermediate_size.max(routed);
    let StepShape {
        rows,
        time,
        slots,
        logit_positions,
    } = shape;
    let mask = rows.saturating_mul(time).saturating_mul(slots);
    let logits = rows
        .saturating_mul(logit_positions)
        .saturating_mul(cfg.vocab_size);
    if mask.max(logits) > MAX_TENSOR_ELEMENTS {
        return usize::MAX;
    }
    let per_token = 8 * cfg.hidden_size + 4 * heads * q_head + 4 * ffn_width + experts;
    let floats = 3 * tiles.scores(rows, heads, time, slots)
        + mask
        + 3 * logits
        + rows * time * per_token
        + rows * kv_capacity_for(slots) * layer_kv;
    floats.saturating_mul(4)
}

/// How a lone sequence's prefill is cut into steps: each step's activations within
/// `budget` bytes and its positions within `cap` (the device engine's `activation_bytes`
/// and `max_prefill_tokens`).
#[derive(Debug, Clone, Copy)]
pub struct PrefillLimits {
    /// Bytes of activations one step may hold.
    pub budget: usize,
    /// Positions one step may feed (None: no cap but the budget).
    pub cap: Option<usize>,
    /// Positions before which every position a step feeds goes through the LM head (the
    /// prompt log-probs still to compute): a chunk starting before it sends all of its own.
    pub logits_until: usize,
}

/// The most positions (at least 1, at most `rest` and the cap) one sequence feeds in a
/// prefill step over a cache of `first` slots within `limits`: `rest` where the whole rest
/// fits, else the chunk of the prefill that does. The step's mask (and its scores, past a
/// tile) grow with the slots it reaches, so the later chunks of one prompt are shorter.
pub fn prefill_chunk(cfg: &Config, limits: PrefillLimits, first: usize, rest: usize) -> usize {
    let rest = rest.min(limits.cap.unwrap_or(rest).max(1));
    let (budget, all_logits) = (limits.budget, first < limits.logits_until);
    let fits = |time: usize| {
        let shape = StepShape {
            rows: 1,
            time,
            slots: first + time,
            logit_positions: if all_logits { time } else { 1 },
        };
        step_activation_bytes(cfg, shape, score_tiles(budget)) <= budget
    };
    if fits(rest) {
        return rest;
    }
    // The step's bytes grow with its tokens: the largest that fits lies in [lo, hi).
    let (mut lo, mut hi) = (1, rest);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Steps a lone sequence's prefill of `rest` positions over `first` cached ones takes in
/// chunks of [`prefill_chunk`] (1 where the whole rest fits).
pub fn prefill_steps(
    cfg: &Config,
    limits: PrefillLimits,
    mut first: usize,
    mut rest: usize,
) -> usize {
    let mut steps = 0;
    while rest > 0 {
        let t = prefill_chunk(cfg, limits, first, rest);
        (first, rest, steps) = (first + t, rest - t, steps + 1);
    }
    steps.max(1)
}

/// Mebibytes, for messages.
pub(crate) fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A small Qwen3-MoE config (2 layers of 8 experts, top-2, vocabulary 1,000).
    pub(crate) fn qwen_tiny() -> Config {
        Config::from_value(serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": false,
        }))
        .expect("config")
    }

    #[test]
    fn the_estimate_is_the_documented_formula() {
        let cfg = qwen_tiny();
        let shape = StepShape {
            rows: 3,
            time: 10,
            slots: 12,
            logit_positions: 1,
        };
        // per token: 8·64 + 4·4·16 + 4·max(64, 2·32) + 8 = 512 + 256 + 256 + 8
        let per_token = 1032;
        // 12 slots live in a buffer with room for 12 + 16; the mask is 3 · 10 · 12.
        let rest = 3 * 10 * 12 + 3 * 3 * 1000 + 3 * 10 * per_token + 3 * 28 * 64;
        let want = 4 * (3 * 3 * 4 * 10 * 12 + rest);
        let bytes = |shape| step_activation_bytes(&cfg, shape, ScoreTiles::WHOLE);
        assert_eq!(bytes(shape), want);
        // In tiles of one sequence's 4 · 10 · 12 scores, or of 3 of its positions.
        let one_row = ScoreTiles::at_most(4 * 10 * 12 + 47);
        assert_eq!(
            step_activation_bytes(&cfg, shape, one_row),
            4 * (3 * 4 * 10 * 12 + rest)
        );
        let three = ScoreTiles::at_most(3 * 4 * 12);
        assert_eq!(
            step_activation_bytes(&cfg, shape, three),
            4 * (3 * 4 * 3 * 12 + rest)
        );
        // A step whose mask or logits would pass 2³² − 1 elements fits no budget.
        let long = StepShape {
            rows: 1,
            time: 70_000,
            slots: 70_000,
            logit_positions: 1,
        };
        assert_eq!(bytes(long), usize::MAX);
        assert!(
            bytes(StepShape {
                time: 60_000,
                slots: 60_000,
                ..long
            }) < usize::MAX
        );
        // 5 M positions' logits over the 1,000-token vocabulary.
        let logits = StepShape {
            rows: 1,
            time: 1,
            slots: 1,
            logit_positions: 5_000_000,
        };
        assert_eq!(bytes(logits), usize::MAX);
        // The tiles hold a quarter of the budget at most.
        let budget = 1 << 20;
        let tile = score_tiles(budget).tile(3, 4, 10, 4000);
        assert!(3 * 4 * tile.rows * 4 * tile.times * 4000 <= budget / 4);
        assert!(
            3 * 4 * tile.rows * 4 * (tile.times + 1) * 4000 > budget / 4,
            "{tile:?}"
        );
        // Prompt log-probs send every position through the head: the logits term grows by
        // `time`; ten times the tokens over ten times the slots costs more than ten times as
        // much (the scores grow with the prompt squared).
        let all = StepShape {
            logit_positions: 10,
            ..shape
        };
        assert_eq!(bytes(all) - bytes(shape), 4 * 3 * 3 * 9 * 1000);
        let long = StepShape {
            time: 100,
            slots: 100,
            ..shape
        };
        assert!(bytes(long) > 10 * bytes(shape));
    }

    /// A chunk is the longest step within the budget: one more token exceeds it; over more
    /// cache slots it is shorter; a rest that fits whole is fed whole.
    #[test]
    fn a_prefill_chunk_is_the_longest_step_that_fits() {
        let cfg = qwen_tiny();
        // The budget of 100 positions in one untiled step; in tiles, more fit.
        let whole = StepShape {
            rows: 1,
            time: 100,
            slots: 100,
            logit_positions: 1,
        };
        let budget = step_activation_bytes(&cfg, whole, ScoreTiles::WHOLE);
        let bytes = |first: usize, time: usize, all: bool| {
            let logit_positions = if all { time } else { 1 };
            let shape = StepShape {
                rows: 1,
                time,
                slots: first + time,
                logit_positions,
            };
            step_activation_bytes(&cfg, shape, score_tiles(budget))
        };
        let limits = |all_logits: bool| PrefillLimits {
            budget,
            cap: None,
            logits_until: if all_logits { usize::MAX } else { 0 },
        };
        for (first, all) in [(0, false), (0, true), (300, false), (300, true)] {
            let chunk = prefill_chunk(&cfg, limits(all), first, 1000);
            assert!(bytes(first, chunk, all) <= budget, "{first} {all}: {chunk}");
            assert!(
                bytes(first, chunk + 1, all) > budget,
                "{first} {all}: {chunk} + 1"
            );
        }
        let from_0 = prefill_chunk(&cfg, limits(false), 0, 1000);
        assert!((100..1000).contains(&from_0), "{from_0}");
        let at_300 = prefill_chunk(&cfg, limits(false), 300, 1000);
        assert!(at_300 < from_0);
        assert!(prefill_chunk(&cfg, limits(true), 0, 1000) < from_0);
        assert_eq!(
            prefill_chunk(&cfg, limits(false), 0, 60),
            60,
            "the whole rest fits"
        );
        let tiny = PrefillLimits {
            budget: 1,
            ..limits(false)
        };
        assert_eq!(prefill_chunk(&cfg, tiny, 0, 60), 1, "at least one token");
        // A cap between the chunks the budget cuts at slot 300 and at slot 0.
        let cap = (at_300 + from_0) / 2;
        let capped = PrefillLimits {
            cap: Some(cap),
            ..limits(false)
        };
        assert_eq!(
            prefill_chunk(&cfg, capped, 0, 1000),
            cap,
            "the cap binds first"
        );
        assert_eq!(
            prefill_chunk(&cfg, capped, 300, 1000),
            at_300,
            "the budget binds"
        );
        // 100 positions in chunks of at most 40 where the budget takes them all: 40, 40, 20.
        let roomy = PrefillLimits {
            budget: usize::MAX,
            cap: Some(40),
            ..limits(false)
        };
        assert_eq!(prefill_steps(&cfg, roomy, 0, 100), 3);
        assert_eq!(prefill_steps(&cfg, roomy, 7, 40), 1);
        assert_eq!(
            prefill_steps(&cfg, limits(false), 0, 0),
            1,
            "a step samples even so"
        );
        // Over the budget alone: as many steps as the chunks it takes one after another.
        let (mut first, mut steps) = (0, 0);
        while first < 1000 {
            first += prefill_chunk(&cfg, limits(false), first, 1000 - first);
            steps += 1;
        }
        assert_eq!(prefill_steps(&cfg, limits(false), 0, 1000), steps);
        assert!(steps > 10, "{steps}");
        // Prompt log-probs up to position 400: the chunks before it send every position
        // through the head, the ones after are as long as without.
        let until = PrefillLimits {
            logits_until: 400,
            ..limits(false)
        };
        assert_eq!(
            prefill_chunk(&cfg, until, 0, 1000),
            prefill_chunk(&cfg, limits(true), 0, 1000)
        );
        assert_eq!(
            prefill_chunk(&cfg, until, 400, 600),
            prefill_chunk(&cfg, limits(false), 400, 600)
        );
        let with = prefill_steps(&cfg, until, 0, 1000);
        assert!(with > steps && with < prefill_steps(&cfg, limits(true), 0, 1000));
    }
}
