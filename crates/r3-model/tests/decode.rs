//! Incremental decoding over a KV cache (`Model::forward_step`) against the full forward of
//! the same model: a prefill of part of a sequence then one token per step must give, at
//! every step, the full forward's logits of that position and the experts its `Record`
//! routing chose, on every family's tiny config (GQA with q/k norms, MLA, dense, shared
//! experts, grouped sigmoid routers). Caches left-padded, joined into one batch and trimmed
//! again (the device engine's continuous admission) decode each sequence as it decodes
//! alone. A broken step, join or trim is refused, naming what is wrong.

mod common;

use candle_core::{DType, Device};
use common::{causal, sequences, sorted_experts, tiny_config, tiny_model, tiny_weights, FAMILIES};
use r3_model::model::decode::{KvCache, ScoreTiles, SeenSlots, Step, StepMask, StepRouting};
use r3_model::{AttentionConfig, Batch, Model, ModelError, Routing, Weights};

/// Feeds `tokens[first..first + time]` of one sequence; its logits rows (every slot's with
/// `all_logits`, else the last) and routes.
fn feed(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    (first, time): (usize, usize),
    all_logits: bool,
) -> (Vec<f32>, Vec<Vec<u32>>) {
    feed_routed(
        model,
        cache,
        tokens,
        (first, time),
        all_logits,
        StepRouting::Host,
    )
}

/// [`feed`] with the MoE layers choosing their experts where `routing` says.
fn feed_routed(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    (first, time): (usize, usize),
    all_logits: bool,
    routing: StepRouting,
) -> (Vec<f32>, Vec<Vec<u32>>) {
    let positions: Vec<u32> = (first..first + time).map(|p| p as u32).collect();
    let window = match model.config().attention {
        AttentionConfig::Gqa { sliding_window, .. } => sliding_window,
        AttentionConfig::Mla { .. } => None,
    };
    let mask = causal(first, time, window);
    let step = Step {
        tokens: &tokens[first..first + time],
        positions: &positions,
        mask: StepMask::Additive(&mask),
        batch: 1,
        time,
        all_logits,
        routing,
        score_tiles: ScoreTiles::WHOLE,
    };
    let out = model.forward_step(&step, cache).expect("step");
    let logits = out
        .logits
        .flatten_all()
        .and_then(|l| l.to_vec1::<f32>())
        .expect("logits");
    (logits, out.routes)
}

#[test]
fn prefill_then_decode_equals_the_full_forward() {
    steps_equal_the_full_forward(StepRouting::Host);
}

/// Routed on the device (top-k, gates and gathered experts without the host, the routes
/// copied once a step), every family gives the full forward's logits and experts: each
/// family's routers choose on the device, DeepSeek-V3's grouped selection with its score
/// bias included (a router that does not fit the kernels is refused in `tests/router.rs`).
#[test]
fn device_routed_steps_equal_the_full_forward() {
    for family in FAMILIES {
        let (_, model) = tiny_model(family, 11);
        assert!(model.routes_on_device(), "{family} routes on the host only");
    }
    steps_equal_the_full_forward(StepRouting::Device);
}

/// One sequence's first step over an empty cache, feeding all of `tokens`.
fn first_step(
    model: &Model,
    tokens: &[u32],
    routing: StepRouting,
) -> r3_model::Result<r3_model::model::decode::StepOutput> {
    let time = tokens.len();
    let positions: Vec<u32> = (0..time as u32).collect();
    let mask = causal(0, time, None);
    let step = Step {
        tokens,
        positions: &positions,
        mask: StepMask::Additive(&mask),
        batch: 1,
        time,
        all_logits: false,
        routing,
        score_tiles: ScoreTiles::WHOLE,
    };
    model.forward_step(&step, &mut model.kv_cache())
}

/// Prefill then decode steps, routed as `routing` says, against the full forward: every
/// slot's logits within 1e-4 and its experts those the full forward recorded.
fn steps_equal_the_full_forward(routing: StepRouting) {
    for family in FAMILIES {
        let (cfg, model) = tiny_model(family, 11);
        if routing == StepRouting::Device && !model.routes_on_device() {
            continue;
        }
        let tokens = sequences(&[12], cfg.vocab_size, 2).remove(0);
        let full = model
            .forward(
                &Batch::new(std::slice::from_ref(&tokens), 0, &Device::Cpu).expect("batch"),
                match cfg.moe {
                    Some(_) => Routing::Record,
                    None => Routing::Native,
                },
            )
            .expect("forward");
        let want = full.logits.to_vec3::<f32>().expect("logits").remove(0);
        let table = full.routes.as_ref().map(|t| &t[0]);
        let k = cfg.top_k();
        let mut cache = model.kv_cache();
        let prefill = 5;
        let mut worst = 0f32;
        let mut check =
            |pos: usize, logits: &[f32], routes: &[Vec<u32>], time: usize, row: usize| {
                let diff = logits
                    .iter()
                    .zip(&want[pos])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst = worst.max(diff);
                assert!(
                    diff < 1e-4,
                    "{family}: position {pos} logits differ by {diff}"
                );
                if let Some(table) = table {
                    assert_eq!(routes.len(), table.num_columns(), "{family}");
                    for (c, ids) in routes.iter().enumerate() {
                        assert_eq!(ids.len(), time * k, "{family}: column {c}");
                        let mut got: Vec<u64> = ids[row * k..(row + 1) * k]
                            .iter()
                            .map(|&e| e as u64)
                            .collect();
                        got.sort_unstable();
                        assert_eq!(
                            got,
                            sorted_experts(table, pos, c),
                            "{family} pos {pos} col {c}"
                        );
                    }
                } else {
                    assert!(routes.is_empty(), "{family}: a dense model routes nothing");
                }
            };
        // The prefill returns every slot's logits; each must be the full forward's row.
        let (logits, routes) =
            feed_routed(&model, &mut cache, &tokens, (0, prefill), true, routing);
        let vocab = cfg.vocab_size;
        assert_eq!(logits.len(), prefill * vocab, "{family}: all prefill rows");
        for row in 0..prefill {
            check(
                row,
                &logits[row * vocab..(row + 1) * vocab],
                &routes,
                prefill,
                row,
            );
        }
        for pos in prefill..tokens.len() {
            let (logits, routes) =
                feed_routed(&model, &mut cache, &tokens, (pos, 1), false, routing);
            check(pos, &logits, &routes, 1, 0);
        }
        assert_eq!(cache.slots(), tokens.len());
        println!("{family} ({routing:?}): max |step logits − full forward| = {worst:.2e}");
    }
}

#[test]
fn a_malformed_step_is_refused_naming_it() {
    let (cfg, model) = tiny_model("qwen3_moe", 1);
    let mut cache = model.kv_cache();
    let bad_token = [cfg.vocab_size as u32];
    let err = model
        .forward_step(
            &Step {
                tokens: &bad_token,
                positions: &[0],
                mask: StepMask::Additive(&[0.0]),
                batch: 1,
                time: 1,
                all_logits: false,
                routing: StepRouting::Host,
                score_tiles: ScoreTiles::WHOLE,
            },
            &mut cache,
        )
        .expect_err("token outside the vocabulary");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let err = model
        .forward_step(
            &Step {
                tokens: &[1, 2],
                positions: &[0, 1],
                mask: StepMask::Additive(&[0.0]),
                batch: 1,
                time: 2,
                all_logits: false,
                routing: StepRouting::Host,
                score_tiles: ScoreTiles::WHOLE,
            },
            &mut cache,
        )
        .expect_err("short mask");
    assert!(err.to_string().contains("mask values"), "{err}");
    assert_eq!(cache.slots(), 0, "a refused step caches nothing");
}

/// Logits rows of a step's output, `[batch · rows, vocab]` flattened per row.
fn logit_rows(out: &r3_model::model::decode::StepOutput) -> Vec<Vec<f32>> {
    let (b, r, v) = out.logits.dims3().expect("logits shape");
    let flat = out
        .logits
        .flatten_all()
        .and_then(|l| l.to_vec1::<f32>())
        .expect("logits");
    (0..b * r)
        .map(|i| flat[i * v..(i + 1) * v].to_vec())
        .collect()
}

#[test]
fn caches_padded_joined_and_trimmed_decode_as_each_alone() {
    for family in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let (cfg, model) = tiny_model(family, 5);
        let seqs = sequences(&[7, 4], cfg.vocab_size, 9);
        let (a, b) = (&seqs[0], &seqs[1]);
        let mut cache_a = model.kv_cache();
        let mut cache_b = model.kv_cache();
        feed(&model, &mut cache_a, a, (0, 6), false);
        feed(&model, &mut cache_b, b, (0, 3), false);
        // Each sequence's next step alone.
        let (want_a, routes_a) = feed(
            &model,
            &mut cache_a.try_clone().expect("copy"),
            a,
            (6, 1),
            false,
        );
        let (want_b, routes_b) = feed(
            &model,
            &mut cache_b.try_clone().expect("copy"),
            b,
            (3, 1),
            false,
        );

        // b padded in front to a's 6 slots and joined below a: one step for both.
        let mut joined = cache_a.try_clone().expect("copy");
        let mut padded = cache_b.try_clone().expect("copy");
        padded.pad_front(3).expect("pad");
        assert_eq!(padded.slots(), 6);
        joined.append_rows(&padded).expect("join");
        let window = match cfg.attention {
            AttentionConfig::Gqa { sliding_window, .. } => sliding_window,
            AttentionConfig::Mla { .. } => None,
        };
        let mut mask = causal(6, 1, window);
        // Row b: its slot p sits at 3 + p; the padding slots 0..3 are hidden.
        mask.extend((0..7).map(|j| {
            let visible = j >= 3 && window.is_none_or(|w| 6 - j < w);
            if visible {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        }));
        let out = model
            .forward_step(
                &Step {
                    tokens: &[a[6], b[3]],
                    positions: &[6, 3],
                    mask: StepMask::Additive(&mask),
                    batch: 2,
                    time: 1,
                    all_logits: false,
                    routing: StepRouting::Host,
                    score_tiles: ScoreTiles::WHOLE,
                },
                &mut joined,
            )
            .expect("joined step");
        let rows = logit_rows(&out);
        let k = cfg.top_k();
        for (row, (want, want_routes)) in [(&want_a, &routes_a), (&want_b, &routes_b)]
            .into_iter()
            .enumerate()
        {
            let diff = rows[row]
                .iter()
                .zip(want)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{family} row {row}: logits differ by {diff}");
            for (c, ids) in out.routes.iter().enumerate() {
                assert_eq!(
                    &ids[row * k..(row + 1) * k],
                    &want_routes[c][..],
                    "{family} row {row} column {c}"
                );
            }
        }

        // Padding dropped again: b alone decodes as before.
        padded.drop_front(3).expect("trim");
        assert_eq!(padded.slots(), 3);
        let (again, _) = feed(&model, &mut padded, b, (3, 1), false);
        assert_eq!(again, want_b, "{family}: trimmed cache");

        // Mismatched joins and over-long trims are refused, naming the sizes.
        let err = cache_a.append_rows(&cache_b).expect_err("6 slots and 3");
        assert!(err.to_string().contains("slots"), "{err}");
        let err = cache_b.drop_front(4).expect_err("only 3 slots");
        assert!(err.to_string().contains("holding 3"), "{err}");
    }
}

/// A step whose attention runs in query tiles (`Step::score_tiles`: one position of one
/// sequence a tile, two positions, whole sequences) computes what the whole step computes,
/// bit for bit on the CPU: the prefill's logits at every slot, its routes, and the cache the
/// next decode step reads; so does its mask built on the device from each query row's seen
/// slots (`StepMask::Seen`). Every family, two left-padded sequences.
#[test]
fn a_step_in_score_tiles_equals_the_whole_step() {
    for family in FAMILIES {
        let (cfg, model) = tiny_model(family, 13);
        let seqs = sequences(&[9, 5], cfg.vocab_size, 3);
        let (time, pads) = (9, [0, 4]);
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut mask = Vec::new();
        let mut seen = Vec::new();
        for (seq, pad) in seqs.iter().zip(pads) {
            tokens.extend((0..pad).map(|_| seq[0]).chain(seq.iter().copied()));
            positions.extend((0..time).map(|i: usize| i.saturating_sub(pad) as u32));
            for i in 0..time {
                // Padding queries see their own slot only (no row fully masked).
                mask.extend((0..time).map(|j| {
                    let seen = (j >= pad && j <= i) || (i < pad && j == i);
                    if seen {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                }));
                seen.push(match i < pad {
                    true => SeenSlots::run(i..i + 1),
                    false => SeenSlots::run(pad..i + 1),
                });
            }
        }
        let run = |tiles: ScoreTiles, mask: StepMask| {
            let mut cache = model.kv_cache();
            let prefill = model
                .forward_step(
                    &Step {
                        tokens: &tokens,
                        positions: &positions,
                        mask,
                        batch: 2,
                        time,
                        all_logits: true,
                        routing: StepRouting::Host,
                        score_tiles: tiles,
                    },
                    &mut cache,
                )
                .expect("prefill");
            let next: Vec<f32> = (0..2).flat_map(|_| vec![0.0; time + 1]).collect();
            let decode = model
                .forward_step(
                    &Step {
                        tokens: &[seqs[0][1], seqs[1][1]],
                        positions: &[9, 5],
                        mask: StepMask::Additive(&next),
                        batch: 2,
                        time: 1,
                        all_logits: false,
                        routing: StepRouting::Host,
                        score_tiles: ScoreTiles::WHOLE,
                    },
                    &mut cache,
                )
                .expect("decode");
            let bits = |rows: Vec<Vec<f32>>| -> Vec<u32> {
                rows.into_iter().flatten().map(f32::to_bits).collect()
            };
            (
                bits(logit_rows(&prefill)),
                prefill.routes,
                bits(logit_rows(&decode)),
            )
        };
        let whole = run(ScoreTiles::WHOLE, StepMask::Additive(&mask));
        let heads = cfg.num_attention_heads;
        // The mask built on the device from each row's seen slots is the same mask.
        let built = run(ScoreTiles::WHOLE, StepMask::Seen(&seen));
        assert!(built == whole, "{family}: the mask from seen slots");
        for max in [1, 2 * heads * time, heads * time * time] {
            let tiled = run(ScoreTiles::at_most(max), StepMask::Seen(&seen));
            assert!(tiled.0 == whole.0, "{family} at most {max}: prefill logits");
            assert_eq!(tiled.1, whole.1, "{family} at most {max}: routes");
            assert!(tiled.2 == whole.2, "{family} at most {max}: the next step");
        }
    }
}

/// A sequence's slots taken out of a batch in blocks (`KvCache::row_slots`), joined again
/// (`RowKv::concat`) and put in front of a new batch (`Model::kv_cache_from`) decode as the
/// cache they came from, bit for bit; a shorter prefix right-aligned beside them, its gap
/// moved to the front (`KvCache::permute_slots`), decodes as it does alone. What the device
/// engine's prefix cache does with a hit.
#[test]
fn slots_taken_out_and_put_back_decode_as_the_original_cache() {
    use r3_model::model::decode::RowKv;
    for family in ["qwen3_moe", "deepseek_v3"] {
        let (cfg, model) = tiny_model(family, 7);
        let a = sequences(&[10], cfg.vocab_size, 4).remove(0);
        // a's first 8 positions in row 1 of a two-row batch (row 0 another sequence).
        let other = sequences(&[8], cfg.vocab_size, 5).remove(0);
        let mut batch = model.kv_cache();
        feed(&model, &mut batch, &other, (0, 8), false);
        let mut alone = model.kv_cache();
        feed(&model, &mut alone, &a, (0, 8), false);
        batch.append_rows(&alone).expect("join");
        let (want, want_routes) = feed(
            &model,
            &mut alone.try_clone().expect("copy"),
            &a,
            (8, 2),
            false,
        );

        let blocks: Vec<RowKv> = [0, 4]
            .iter()
            .map(|&s| batch.row_slots(1, s, 4).expect("slots"))
            .collect();
        let joined = RowKv::concat(&[&blocks[0], &blocks[1]]).expect("concat");
        assert_eq!(joined.slots(), 8);
        assert_eq!(joined.bytes(), 2 * blocks[0].bytes());
        let mut rebuilt = model
            .kv_cache_from(&[Some(&joined)], DType::F32)
            .expect("cache");
        assert_eq!(rebuilt.slots(), 8);
        let (got, routes) = feed(&model, &mut rebuilt, &a, (8, 2), false);
        assert_eq!(got, want, "{family}: logits from the rebuilt cache");
        assert_eq!(routes, want_routes, "{family}: routes");

        // Row 0 the first 6 positions (two zero slots in front), row 1 nothing; row 0's
        // zero slots moved behind its positions, then a[6..8] fed into slots 8, 9.
        let six = batch.row_slots(1, 0, 6).expect("slots");
        let mut mixed = model
            .kv_cache_from(&[Some(&six), Some(&joined), None], DType::F32)
            .expect("cache");
        assert_eq!((mixed.slots(), mixed.rows().expect("rows")), (8, 3));
        let mut order: Vec<u32> = (2..8).chain(0..2).collect();
        order.extend(0..8);
        order.extend(0..8);
        mixed.permute_slots(&order).expect("permute");
        mixed.keep_rows(&[0]).expect("row 0");
        let mask: Vec<f32> = (0..2)
            .flat_map(|q| {
                (0..10).map(move |k| {
                    if k < 6 || (8..=8 + q).contains(&k) {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let out = model
            .forward_step(
                &Step {
                    tokens: &a[6..8],
                    positions: &[6, 7],
                    mask: StepMask::Additive(&mask),
                    batch: 1,
                    time: 2,
                    all_logits: false,
                    routing: StepRouting::Host,
                    score_tiles: ScoreTiles::WHOLE,
                },
                &mut mixed,
            )
            .expect("step");
        let mut six_alone = model.kv_cache();
        feed(&model, &mut six_alone, &a, (0, 6), false);
        let (want6, routes6) = feed(&model, &mut six_alone, &a, (6, 2), false);
        let got6 = logit_rows(&out).remove(0);
        let diff = got6
            .iter()
            .zip(&want6)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 1e-5,
            "{family}: logits after the gap differ by {diff}"
        );
        assert_eq!(out.routes, routes6, "{family}: routes after the gap");

        // Out-of-range asks are refused, naming the sizes.
        let err = batch.row_slots(2, 0, 4).expect_err("row 2 of 2");
        assert!(err.to_string().contains("2 rows"), "{err}");
        let err = batch.permute_slots(&[0; 3]).expect_err("short order");
        assert!(err.to_string().contains("3 entries"), "{err}");
    }
}

/// Router logits that overflow are the selection's error routed either way: on the device
/// the step's one check finds the layer, and the host's selection names the row and expert.
#[test]
fn non_finite_router_logits_are_refused_naming_them_routed_either_way() {
    let cfg = tiny_config("qwen3_moe");
    let mut map = tiny_weights(&cfg, 11, DType::F32).into_map();
    let gate = map
        .keys()
        .find(|k| k.ends_with("mlp.gate.weight"))
        .cloned()
        .expect("a router weight");
    let huge = (map[&gate].ones_like().expect("ones") * 1e38).expect("scale");
    map.insert(gate.clone(), huge);
    let model = Model::new(&cfg, &Weights::from_map(map)).expect("model");
    let tokens = sequences(&[4], cfg.vocab_size, 2).remove(0);
    for routing in [StepRouting::Host, StepRouting::Device] {
        match first_step(&model, &tokens, routing) {
            Err(ModelError::NonFiniteScore { row, expert, value }) => {
                assert!(!value.is_finite(), "{routing:?}: {value}");
                assert!(row < 4 && expert < cfg.num_experts(), "{routing:?}");
            }
            other => panic!("{routing:?} ({gate}): expected NonFiniteScore, got {other:?}"),
        }
    }
}
