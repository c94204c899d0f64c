//! The training forward and backward on another device against the CPU reference: the HF
//! oracle fixtures, logits, recorded routes, replay (the same `ReplayProof` for the same
//! tables), token log-probs, entropy and the gradient of every parameter, for every family's
//! tiny config.
//!
//! Off the CPU every custom op takes its composed-candle path (dispatch on the tensor's
//! device), so with `--features cuda` (`scripts/cuda/check.sh` on the GPU machine) these
//! tests compare the composed GPU path with the fused CPU ops. Without the feature (CI) the
//! same comparisons run with a second CPU model built from the same seed: there they demand
//! bit-identical results (the engine is deterministic) and keep the harness the GPU run
//! depends on checked.
//!
//! Fixtures are found relative to the working directory (the crate folder under `cargo test`
//! and under check.sh), so the test binary can run on a machine without the source tree.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{
    covering_tables, probe, sequences, sorted_experts, tiny_config, tiny_weights, FAMILIES,
};
use r3_model::narrow_grads::backward_narrowing;
use r3_model::precision::WeightGradients;
use r3_model::token_stats::{entropy, token_log_probs};
use r3_model::{
    Batch, Config, ForwardOutput, HeadPositions, Model, ReplayRoutes, Routing, Weights,
};
use r3_routing::{LayerSpace, RouteTable};
use r3_test_support::bits;
use serde_json::Value;

/// How close the other device must come to the CPU.
#[derive(Debug, Clone, Copy)]
struct Tolerance {
    /// Largest |Δ| of logits, log-probs and entropies.
    values: f32,
    /// Largest |Δ| of a parameter's gradient relative to its largest |gradient|.
    gradients: f32,
}

/// f32 on a GPU: the bounds (logits within 1e-4 of HF's, gradients within 1e-4
/// relative of the CPU's).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const GPU_F32: Tolerance = Tolerance {
    values: 1e-4,
    gradients: 1e-4,
};

/// A second CPU model: the same ops in the same order, so the same bits.
const SAME_BITS: Tolerance = Tolerance {
    values: 0.0,
    gradients: 0.0,
};

/// Every tensor of `weights` copied to `device`.
fn on_device(weights: &Weights, device: &Device) -> Weights {
    Weights::from_map(
        weights
            .tensors()
            .iter()
            .map(|(k, t)| (k.clone(), t.to_device(device).expect("to device")))
            .collect(),
    )
}

fn max_abs(t: &Tensor) -> f32 {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.abs())
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.max(0))
        .and_then(|t| t.to_scalar::<f32>())
        .expect("max |x|")
}

/// max |a − b| with `b` brought to `a`'s device (the CPU).
fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let b = b.to_device(a.device()).expect("to cpu");
    max_abs(&(a - b).expect("sub"))
}

/// What one device computed for one family: forward outputs and the gradient of a loss
/// that goes through the logits, the token log-probs and the entropy.
struct Run {
    recorded: ForwardOutput,
    replayed: Option<ForwardOutput>,
    logp: Tensor,
    entropy: Tensor,
    grads: Vec<(String, Tensor)>,
}

/// Every variable's gradient in `grads`, sorted by name (a missing one fails the test).
fn named_gradients(
    varmap: &candle_nn::VarMap,
    grads: &candle_core::backprop::GradStore,
    device: &Device,
) -> Vec<(String, Tensor)> {
    common::sorted_vars(varmap.data())
        .into_iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name} on {device:?}"));
            (name, g.clone())
        })
        .collect()
}

/// Record forward (no graph), then a replayed (or, dense, native) forward with backward.
fn run(
    cfg: &Config,
    weights: Weights,
    device: &Device,
    lengths: &[usize],
    replay: Option<&ReplayRoutes>,
) -> Run {
    let (varmap, weights) = weights.into_trainable(cfg).expect("trainable");
    let model = Model::new(cfg, &weights).expect("model");
    assert!(model.device().same_device(device), "model on {device:?}");
    let seqs = sequences(lengths, cfg.vocab_size, 3);
    let batch = Batch::new(&seqs, 0, device).expect("batch");
    // A dense model has no routes to record.
    let first = match cfg.moe {
        Some(_) => Routing::Record,
        None => Routing::Native,
    };
    let recorded = model.forward(&batch, first).expect("record forward");
    let routing = match replay {
        Some(r) => Routing::Replay(r),
        None => Routing::Native,
    };
    let out = model.forward(&batch, routing).expect("training forward");
    let t = batch.seq_len();
    let logits = out.logits.narrow(1, 0, t - 1).expect("narrow");
    let targets = batch.input_ids().narrow(1, 1, t - 1).expect("targets");
    let logp = token_log_probs(&logits, &targets).expect("log-probs");
    let ent = entropy(&logits).expect("entropy");
    let loss = (out.logits.clone() * probe(lengths, cfg.vocab_size, device))
        .and_then(|l| l.sum_all())
        .and_then(|l| l + logp.sum_all()?)
        .and_then(|l| l + (ent.sum_all()? * 0.1)?)
        .expect("loss");
    let grads = loss.backward().expect("backward");
    let named = named_gradients(&varmap, &grads, device);
    Run {
        recorded,
        replayed: replay.map(|_| out),
        logp,
        entropy: ent,
        grads: named,
    }
}

/// One family on `device` against the CPU.
fn compare_family(family: &str, device: &Device, tol: Tolerance) {
    let cfg = tiny_config(family);
    let lengths = [7, 4, 1];
    let tables = cfg
        .moe
        .as_ref()
        .map(|_| ReplayRoutes::new(covering_tables(&cfg, &lengths), &cfg.layout).expect("tables"));
    let cpu = run(
        &cfg,
        tiny_weights(&cfg, 5, DType::F32),
        &Device::Cpu,
        &lengths,
        tables.as_ref(),
    );
    let weights = on_device(&tiny_weights(&cfg, 5, DType::F32), device);
    let other = run(&cfg, weights, device, &lengths, tables.as_ref());

    let d = max_diff(&cpu.recorded.logits, &other.recorded.logits);
    assert!(d <= tol.values, "{family}: record logits max |Δ| = {d}");
    // The router's choices are ids: equal, not close.
    assert_eq!(
        cpu.recorded.routes, other.recorded.routes,
        "{family}: recorded routes differ"
    );
    if let (Some(c), Some(o)) = (&cpu.replayed, &other.replayed) {
        let d = max_diff(&c.logits, &o.logits);
        assert!(d <= tol.values, "{family}: replay logits max |Δ| = {d}");
        assert!(c.replay.is_some(), "{family}: CPU replay gave no proof");
        assert_eq!(c.replay, o.replay, "{family}: replay proofs differ");
    }
    for (what, a, b) in [
        ("log-probs", &cpu.logp, &other.logp),
        ("entropy", &cpu.entropy, &other.entropy),
    ] {
        let d = max_diff(a, b);
        assert!(d <= tol.values, "{family}: {what} max |Δ| = {d}");
    }
    assert_eq!(cpu.grads.len(), other.grads.len(), "{family}: parameters");
    for ((name, gc), (name2, go)) in cpu.grads.iter().zip(&other.grads) {
        assert_eq!(name, name2);
        assert!(
            go.device().same_device(device),
            "{family}: {name} grad device"
        );
        let scale = max_abs(gc);
        let d = max_diff(gc, go);
        assert!(
            d <= tol.gradients * scale,
            "{family}: gradient of {name}: max |Δ| = {d}, max |g| = {scale}"
        );
    }
}

/// Three samples of one prompt, two of another that begins alike, and one alone (shorter
/// than `common::grouped_sequences`: the f32 tolerance below was set on these).
fn grouped_sequences(vocab: usize) -> Vec<Vec<u32>> {
    let v = |x: u32| x % vocab as u32;
    let prompt: Vec<u32> = (0..6).map(|i| v(3 + 5 * i)).collect();
    let other: Vec<u32> = prompt[..2].iter().copied().chain([v(29), v(30)]).collect();
    let with = |p: &[u32], r: &[u32]| -> Vec<u32> { p.iter().chain(r).copied().collect() };
    vec![
        with(&prompt, &[v(1), v(2), v(4)]),
        with(&prompt, &[v(9)]),
        with(&other, &[v(11), v(12)]),
        with(&prompt, &[v(1), v(5), v(6)]),
        vec![v(21), v(22), v(23)],
        with(&other, &[v(13)]),
    ]
}

/// Logits of the real positions, recorded routes and every parameter's gradient (of a loss
/// through the logits) of a Record forward over [`grouped_sequences`] on `device`.
fn grouped_run(
    family: &str,
    device: &Device,
    share: bool,
) -> (Vec<f32>, ForwardOutput, Vec<(String, Tensor)>) {
    let cfg = tiny_config(family);
    let weights = on_device(&tiny_weights(&cfg, 5, DType::F32), device);
    let (varmap, weights) = weights.into_trainable(&cfg).expect("trainable");
    let model = Model::new(&cfg, &weights).expect("model");
    let seqs = grouped_sequences(cfg.vocab_size);
    let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let batch = Batch::new(&seqs, 0, device)
        .expect("batch")
        .sharing_prefixes(share);
    let routing = match cfg.moe {
        Some(_) => Routing::Record,
        None => Routing::Native,
    };
    let out = model.forward(&batch, routing).expect("forward");
    assert_eq!(
        out.shared_positions() > 0,
        share,
        "{family}: shared positions"
    );
    let loss = (out.logits.clone() * probe(&lengths, cfg.vocab_size, device))
        .and_then(|l| l.sum_all())
        .expect("loss");
    let grads = loss.backward().expect("backward");
    let named = named_gradients(&varmap, &grads, device);
    let t = out.logits.dim(1).expect("positions");
    let all = out
        .logits
        .to_device(&Device::Cpu)
        .and_then(|l| l.flatten_all())
        .and_then(|l| l.to_vec1::<f32>())
        .expect("logits");
    let v = cfg.vocab_size;
    let real = lengths
        .iter()
        .enumerate()
        .flat_map(|(b, &len)| all[b * t * v..(b * t + len) * v].to_vec())
        .collect();
    (real, out, named)
}

/// A forward sharing prefixes (`Batch::sharing_prefixes`) on `device` against the CPU's
/// unshared one: logits of real positions, recorded routes, every gradient.
fn shared_prefixes_match_unshared(device: &Device, tol: Tolerance) {
    for family in ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"] {
        let (want, want_out, want_grads) = grouped_run(family, &Device::Cpu, false);
        let (got, got_out, got_grads) = grouped_run(family, device, true);
        let d = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= tol.values, "{family}: logits max |Δ| = {d}");
        assert_eq!(want_out.routes, got_out.routes, "{family}: recorded routes");
        for ((name, gw), (_, gg)) in want_grads.iter().zip(&got_grads) {
            let (scale, d) = (max_abs(gw), max_diff(gw, gg));
            assert!(
                d <= tol.gradients * scale,
                "{family}: gradient of {name}: max |Δ| = {d}, max |g| = {scale}"
            );
        }
    }
}

/// f32 on the CPU, shared against unshared: the same values in another summation order.
const SHARED_ON_THE_CPU: Tolerance = Tolerance {
    values: 1e-5,
    gradients: 1e-5,
};

/// The HF oracle fixtures (tests/fixtures, from `scripts/oracle/make_oracle.py`) on
/// `device`: logits and per-layer top-k sets of the native forward, and logits under the
/// oracle's forced routing.
fn check_oracle((name, references): (&str, &str), device: &Device, tol: f32) {
    let dir = Path::new("tests/fixtures");
    let text = std::fs::read_to_string(dir.join(references))
        .expect("tests/fixtures' reference outputs (run from the crate folder)");
    let all: Value = serde_json::from_str(&text).expect("reference json");
    let ids: Vec<u32> = all["input_ids"][0]
        .as_array()
        .expect("input_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let reference = &all[name];
    let cfg = Config::from_file(&dir.join(name).join("config.json")).expect("config");
    let weights = Weights::load(&dir.join(name), &cfg, device).expect("weights");
    let model = Model::new(&cfg, &weights).expect("model");
    let batch = Batch::new(std::slice::from_ref(&ids), 0, device).expect("batch");
    let out = model.forward(&batch, Routing::Record).expect("forward");
    let logits = out.logits.squeeze(0).expect("squeeze");
    let d = max_diff(&matrix(&reference["logits"]), &logits);
    assert!(d < tol, "{name} on {device:?}: max |Δlogit| = {d}");
    let table = &out.routes.expect("routes")[0];
    let layers = reference["moe_layers"].as_object().expect("moe_layers");
    for (column, layer) in cfg.layout.moe_layers().iter().enumerate() {
        let sets = layers[&layer.to_string()]["topk_idx_sorted"]
            .as_array()
            .expect("topk");
        for (t, set) in sets.iter().enumerate().take(ids.len()) {
            let got = sorted_experts(table, t, column);
            let want: Vec<u64> = set
                .as_array()
                .expect("set")
                .iter()
                .map(|v| v.as_u64().expect("id"))
                .collect();
            assert_eq!(got, want, "{name}: layer {layer}, token {t}");
        }
    }

    // Forced routing: the oracle's `forced_topk_idx` replayed, every token.
    let forced = &reference["routing_replay"];
    let columns: Vec<Vec<u32>> = cfg
        .layout
        .moe_layers()
        .iter()
        .map(|layer| {
            forced["forced_topk_idx"][layer.to_string()]
                .as_array()
                .expect("forced ids")
                .iter()
                .take(ids.len())
                .flat_map(|row| {
                    row.as_array()
                        .expect("row")
                        .iter()
                        .map(|v| v.as_u64().expect("id") as u32)
                        .collect::<Vec<_>>()
                })
                .collect()
        })
        .collect();
    let table = RouteTable::from_columns(
        cfg.num_experts(),
        cfg.top_k(),
        LayerSpace::MoeOnly,
        cfg.layout.moe_layers().to_vec(),
        0,
        &columns,
    )
    .expect("forced table");
    let routes = ReplayRoutes::new(vec![table], &cfg.layout).expect("replay routes");
    let out = model
        .forward(&batch, Routing::Replay(&routes))
        .expect("replay forward");
    let d = max_diff(
        &matrix(&forced["logits"]),
        &out.logits.squeeze(0).expect("squeeze"),
    );
    assert!(d < tol, "{name} on {device:?}: replay max |Δlogit| = {d}");
    let proof = out.replay.expect("replay proof");
    let n_moe = cfg.layout.moe_layers().len();
    assert_eq!(proof.replayed_cells, vec![ids.len(); n_moe], "{name}");
    let want_differing =
        common::tokens_differing_from_native(forced, cfg.layout.moe_layers(), ids.len());
    assert_eq!(proof.differs_from_native, want_differing, "{name}");
}

/// A `[rows, width]` JSON matrix as a CPU tensor.
fn matrix(v: &Value) -> Tensor {
    let rows: Vec<Vec<f32>> = v
        .as_array()
        .expect("matrix")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("number") as f32)
                .collect()
        })
        .collect();
    let shape = (rows.len(), rows.first().map_or(0, Vec::len));
    let flat: Vec<f32> = rows.into_iter().flatten().collect();
    Tensor::from_vec(flat, shape, &Device::Cpu).expect("reference tensor")
}

/// The MoE oracle fixtures and the reference file holding each one's HF outputs (the dense
/// ones have no routes to check here; `hf_oracle.rs` checks their logits).
const ORACLES: [(&str, &str); 6] = [
    ("qwen3_moe_tiny", "reference_outputs.json"),
    ("deepseek_v3_tiny", "reference_outputs.json"),
    ("qwen2_moe_tiny", "reference_outputs_families.json"),
    ("mixtral_tiny", "reference_outputs_families.json"),
    ("olmoe_tiny", "reference_outputs_families.json"),
    ("deepseek_v3_yarn_tiny", "reference_outputs_families.json"),
];

/// Every variable's gradient as bits, by name (a variable without one fails).
fn gradient_bits(
    varmap: &candle_nn::VarMap,
    grads: &candle_core::backprop::GradStore,
) -> Vec<(String, Vec<u32>)> {
    let mut named: Vec<(String, Vec<u32>)> = varmap
        .data()
        .lock()
        .expect("vars")
        .iter()
        .map(|(name, var)| {
            let grad = grads.get(var.as_tensor()).expect("gradient");
            (name.clone(), bits(grad))
        })
        .collect();
    named.sort();
    named
}

/// The names of the variables whose gradient `grads` holds in a 16-bit dtype.
fn narrow_gradients(
    varmap: &candle_nn::VarMap,
    grads: &candle_core::backprop::GradStore,
) -> Vec<String> {
    let mut names: Vec<String> = varmap
        .data()
        .lock()
        .expect("vars")
        .iter()
        .filter(|(_, var)| {
            grads
                .get(var.as_tensor())
                .is_some_and(|g| matches!(g.dtype(), DType::BF16 | DType::F16))
        })
        .map(|(name, _)| name.clone())
        .collect();
    names.sort();
    names
}

/// `model`'s logits over `batch` (replaying `tables` where there are some, else routed
/// natively) and every variable's gradient of `Σ logits · probe`, as bits.
fn logits_and_gradient_bits(
    model: &Model,
    batch: &Batch,
    tables: Option<&ReplayRoutes>,
    lengths: &[usize],
    varmap: &candle_nn::VarMap,
) -> (Vec<u32>, Vec<(String, Vec<u32>)>) {
    let routing = match tables {
        Some(t) => Routing::Replay(t),
        None => Routing::Native,
    };
    let logits = model.forward(batch, routing).expect("forward").logits;
    let probe = probe(lengths, model.config().vocab_size, logits.device());
    let grads = (&logits * probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    (bits(&logits), gradient_bits(varmap, &grads))
}

/// A mixed-precision model that reads held 16-bit copies of its weights
/// (`Weights::hold_narrow_copies`) computes on `device` bit for bit what it computes casting
/// (on the CPU: rounding) every weight at every use — the logits of a replayed forward, the
/// gradient of every parameter, and the logits of a forward with nothing differentiated — for
/// every family, in bf16 and f16: a copy holds exactly the cast's values. On a GPU this is
/// where the copies are read in place of the casts (the GEMMs' operands), so it is the test
/// of the trainer's `narrow_weight_copies`.
fn held_copies_give_the_same_bits(device: &Device) {
    use r3_model::Precision;
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let lengths = [6, 4];
        let batch = Batch::new(&sequences(&lengths, cfg.vocab_size, 3), 0, device).expect("batch");
        let tables = cfg.moe.as_ref().map(|_| {
            ReplayRoutes::new(covering_tables(&cfg, &lengths), &cfg.layout).expect("covered")
        });
        for (precision, narrow) in [
            (Precision::Bf16 { router_f32: false }, DType::BF16),
            (Precision::F16 { router_f32: true }, DType::F16),
        ] {
            let run = |held: bool| {
                let (varmap, mut weights) = on_device(&tiny_weights(&cfg, 5, DType::F32), device)
                    .into_trainable(&cfg)
                    .expect("trainable");
                if held {
                    let copies = weights.hold_narrow_copies(&cfg, narrow).expect("copies");
                    assert!(!copies.is_empty(), "{family}");
                }
                let model = Model::with_precision(&cfg, &weights, precision).expect("model");
                let (logits, named) =
                    logits_and_gradient_bits(&model, &batch, tables.as_ref(), &lengths, &varmap);
                let frozen = Model::with_precision(&cfg, &weights.detached(), precision)
                    .expect("frozen model");
                let native = frozen
                    .forward(&batch, Routing::Native)
                    .expect("forward")
                    .logits;
                (logits, named, bits(&native))
            };
            let (cast, held) = (run(false), run(true));
            assert!(cast.0 == held.0, "{family} {narrow:?}: logits");
            for ((name, a), (_, b)) in cast.1.iter().zip(&held.1) {
                assert!(a == b, "{family} {narrow:?}: gradient of {name}");
            }
            assert!(
                cast.2 == held.2,
                "{family} {narrow:?}: logits of the frozen model"
            );
        }
    }
}

/// Selective recomputation (`Model::set_selective_recompute`: each GQA layer's q and k
/// heads, per-head norm, rotation and rounding, run again in the backward) gives on `device`
/// the same logits and every parameter's gradient bit for bit: every family, f32, bf16 and
/// f16, replayed routing where the family has experts. On a GPU the heads run candle's rope
/// kernel after a contiguous copy and r3's norm and rounding kernels, once more in the
/// backward.
fn selective_recompute_gives_the_same_bits(device: &Device) {
    use r3_model::Precision;
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let lengths = [6, 4];
        let batch = Batch::new(&sequences(&lengths, cfg.vocab_size, 3), 0, device).expect("batch");
        let tables = cfg.moe.as_ref().map(|_| {
            ReplayRoutes::new(covering_tables(&cfg, &lengths), &cfg.layout).expect("covered")
        });
        for precision in [
            Precision::F32,
            Precision::Bf16 { router_f32: false },
            Precision::F16 { router_f32: true },
        ] {
            let run = |selective: bool| {
                let (varmap, weights) = on_device(&tiny_weights(&cfg, 7, DType::F32), device)
                    .into_trainable(&cfg)
                    .expect("trainable");
                let mut model = Model::with_precision(&cfg, &weights, precision).expect("model");
                model.set_selective_recompute(selective);
                logits_and_gradient_bits(&model, &batch, tables.as_ref(), &lengths, &varmap)
            };
            let (chain, selective) = (run(false), run(true));
            assert!(chain.0 == selective.0, "{family} {precision:?}: logits");
            assert_eq!(chain.1.len(), selective.1.len(), "{family}: gradients");
            for ((name, a), (_, b)) in chain.1.iter().zip(&selective.1) {
                assert!(a == b, "{family} {precision:?}: gradient of {name}");
            }
        }
    }
}

/// A recomputing forward (activation checkpointing) gives the plain forward's logits and
/// routes, and its layer-by-layer backward every parameter's gradient, to the bit: every
/// family, f32 / bf16 with held weight copies / f16, Native, Record and Replay routing, and a
/// tied embedding (whose gradient sums the head's part and the embedding's). In bf16 and f16
/// the backward run again keeping the gradients narrow (`LayerRecompute::keep_gradients_narrow`),
/// and the plain one (`narrow_grads::backward_narrowing`), give the same bits widened, with
/// the gradients they should narrow held in 16 bits. The same of a batch sharing
/// prefixes, whose layers keep and run again their computed rows.
fn recomputed_layers_give_the_same_bits(device: &Device) {
    use r3_model::Precision;
    let mut configs: Vec<(String, Config)> = FAMILIES
        .iter()
        .map(|f| (f.to_string(), tiny_config(f)))
        .collect();
    let mut tied = common::tiny_json("qwen3_moe");
    tied["tie_word_embeddings"] = serde_json::json!(true);
    configs.push((
        "qwen3_moe tied".into(),
        Config::from_value(tied).expect("tied config"),
    ));
    for ((family, cfg), share) in configs.iter().flat_map(|c| [(c, false), (c, true)]) {
        // Shared: a batch whose sequences share prefixes, each layer's kept input its
        // computed rows.
        let seqs = match share {
            false => sequences(&[6, 4], cfg.vocab_size, 3),
            true => common::grouped_sequences(cfg.vocab_size),
        };
        let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
        let batch = Batch::new(&seqs, 0, device)
            .expect("batch")
            .sharing_prefixes(share);
        let tables = cfg.moe.as_ref().map(|_| {
            ReplayRoutes::new(covering_tables(cfg, &lengths), &cfg.layout).expect("covered")
        });
        for (precision, copies, mode) in [
            (Precision::F32, None, 0),
            (Precision::F32, None, 2),
            (Precision::Bf16 { router_f32: false }, Some(DType::BF16), 2),
            (Precision::F16 { router_f32: true }, None, 1),
        ] {
            let what = format!("{family} {precision:?} mode {mode}, shared {share}");
            let run = |recompute: bool, narrow_grads: bool| {
                let (varmap, mut weights) = on_device(&tiny_weights(cfg, 5, DType::F32), device)
                    .into_trainable(cfg)
                    .expect("trainable");
                if let Some(narrow) = copies {
                    weights.hold_narrow_copies(cfg, narrow).expect("copies");
                }
                let mut model = Model::with_precision(cfg, &weights, precision).expect("model");
                if narrow_grads {
                    // Every rounded weight's gradient comes back in 16 bits as written.
                    model.set_weight_gradients(WeightGradients::Narrow);
                }
                let routing = match (&tables, mode) {
                    (Some(t), 2) => Routing::Replay(t),
                    (Some(_), 1) => Routing::Record,
                    _ => Routing::Native,
                };
                let vars = varmap.all_vars();
                let loss_of = |out: &ForwardOutput| {
                    (&out.logits * probe(&lengths, cfg.vocab_size, device))
                        .and_then(|l| l.sum_all())
                        .expect("loss")
                };
                let (out, grads) = if recompute {
                    let (out, mut layers) = model
                        .forward_recomputing(&batch, routing, HeadPositions::From(0))
                        .expect("recomputing forward");
                    if narrow_grads {
                        let narrow = precision.narrow_dtype().expect("a 16-bit precision");
                        layers = layers.keep_gradients_narrow(narrow);
                    }
                    let grads = layers.backward(loss_of(&out), &vars).expect("backward");
                    (out, grads)
                } else {
                    let out = model.forward(&batch, routing).expect("forward");
                    let loss = loss_of(&out);
                    let grads = match precision.narrow_dtype().filter(|_| narrow_grads) {
                        Some(narrow) => backward_narrowing(&loss, narrow),
                        None => loss.backward().map_err(Into::into),
                    }
                    .expect("backward");
                    (out, grads)
                };
                // Under replay the covering tables may give a prompt's samples different
                // experts at every position: there it may share nothing.
                let replayed = matches!(routing, Routing::Replay(_));
                assert!(
                    (out.shared_positions() > 0) == share || (share && replayed),
                    "{what}: {} shared positions",
                    out.shared_positions()
                );
                let named = gradient_bits(&varmap, &grads);
                let proof = out.replay.as_ref().map(|p| format!("{p:?}"));
                let routes = out.routes.as_ref().map(|r| format!("{r:?}"));
                let narrow = narrow_gradients(&varmap, &grads);
                (bits(&out.logits), named, routes, proof, narrow)
            };
            let plain = run(false, false);
            let mut runs = vec![("recomputed", run(true, false))];
            if precision.narrow_dtype().is_some() {
                runs.push(("recomputed, gradients kept narrow", run(true, true)));
                runs.push(("gradients kept narrow", run(false, true)));
            }
            for (how, recomputed) in &runs {
                let what = format!("{what}, {how}");
                assert!(plain.0 == recomputed.0, "{what}: logits");
                assert_eq!(plain.1.len(), recomputed.1.len(), "{what}");
                // Widened, a gradient kept narrow has every bit of the f32 one.
                for ((name, a), (_, b)) in plain.1.iter().zip(&recomputed.1) {
                    assert!(a == b, "{what}: gradient of {name}");
                }
                assert_eq!(plain.2, recomputed.2, "{what}: recorded routes");
                assert_eq!(plain.3, recomputed.3, "{what}: replay proof");
            }
            assert!(
                plain.4.is_empty() && runs[0].1 .4.is_empty(),
                "{what}: unasked narrowing"
            );
            // Kept narrow: on the CPU every gradient but an f32 router's and a tied
            // embedding's (the sum of the head's part and the embedding's is not a 16-bit
            // value); on any device every projection's and the head's (the weight matrices,
            // where the memory is: their gradients come out of 16-bit GEMMs on a GPU).
            for (kept, router_f32) in runs[1..].iter().filter_map(|(_, run)| match precision {
                Precision::Bf16 { router_f32 } | Precision::F16 { router_f32 } => {
                    Some((run, router_f32))
                }
                Precision::F32 => None,
            }) {
                let f32_router = |name: &str| router_f32 && name.ends_with(".gate.weight");
                // A tied embedding's gradient, or one of a token read at several positions
                // (the grouped batch's), is a sum of 16-bit values.
                let tied = |name: &str| {
                    (share || family.ends_with("tied")) && name == "model.embed_tokens.weight"
                };
                let matrix = |name: &str| name.contains("proj") || name == "lm_head.weight";
                let wide: Vec<&String> = plain
                    .1
                    .iter()
                    .map(|(name, _)| name)
                    .filter(|name| !kept.4.contains(name))
                    .collect();
                let allowed = |name: &str| {
                    f32_router(name) || tied(name) || (!device.is_cpu() && !matrix(name))
                };
                assert!(
                    wide.iter().all(|name| allowed(name)),
                    "{what}: gradients left f32: {wide:?}"
                );
            }
        }
    }
}

#[test]
fn recomputed_layers_give_the_same_bits_on_the_cpu() {
    recomputed_layers_give_the_same_bits(&Device::Cpu);
}

/// A loss that does not read the recomputing forward's logits has no gradient to run the
/// layers back from: an error that says so, not a store of zeros.
#[test]
fn a_loss_beside_the_recomputed_logits_is_refused() {
    let cfg = tiny_config("qwen3_moe");
    let (varmap, weights) = tiny_weights(&cfg, 5, DType::F32)
        .into_trainable(&cfg)
        .expect("trainable");
    let model = Model::new(&cfg, &weights).expect("model");
    let batch = Batch::new(&sequences(&[5], cfg.vocab_size, 1), 0, &Device::Cpu).expect("batch");
    let (_, layers) = model
        .forward_recomputing(&batch, Routing::Native, HeadPositions::From(0))
        .expect("forward");
    let vars = varmap.all_vars();
    let unrelated = vars[0]
        .as_tensor()
        .sum_all()
        .expect("a loss of one weight alone");
    let err = layers
        .backward(unrelated, &vars)
        .expect_err("no gradient at the last layer's output");
    assert!(
        err.to_string()
            .contains("does not depend on the recomputing forward's logits"),
        "{err}"
    );
}

#[test]
fn selective_recomputation_gives_the_same_bits_on_the_cpu() {
    selective_recompute_gives_the_same_bits(&Device::Cpu);
}

#[test]
fn held_weight_copies_give_the_same_bits_on_the_cpu() {
    held_copies_give_the_same_bits(&Device::Cpu);
}

#[test]
fn a_forward_sharing_prefixes_matches_the_unshared_one_on_the_cpu() {
    shared_prefixes_match_unshared(&Device::Cpu, SHARED_ON_THE_CPU);
}

#[test]
fn a_second_cpu_model_gives_the_same_bits() {
    for family in FAMILIES {
        compare_family(family, &Device::Cpu, SAME_BITS);
    }
}

#[test]
fn oracle_fixtures_on_the_cpu() {
    for name in ORACLES {
        check_oracle(name, &Device::Cpu, 1e-4);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::common::{causal, grouped_router, softmax_router, tied_logits};
    use super::*;
    use r3_model::layers::moe::route_rows::{read_choice, route_rows};
    use r3_model::Precision;

    /// A host tensor of `shape` with values in [-1, 1], a fixed pattern of `seed`.
    fn seeded(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|i| (((i + 31 * seed) * 7919) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).expect("seeded")
    }

    fn gpu() -> Device {
        r3_model::DeviceSpec::Cuda { ordinal: 0 }
            .open()
            .expect("a CUDA GPU (these tests run on the GPU machine)")
    }

    /// `r3_narrow_exact_*` keeps a gradient in bf16 / f16 exactly where the CPU's pass does,
    /// with the same bits: 16-bit values (one chunk and many), one value off a 16-bit grid,
    /// a NaN, f16's range and subnormals.
    #[test]
    fn gradients_kept_narrow_on_cuda_as_on_the_cpu() {
        use r3_model::narrow_grads::narrow_where_exact;
        let device = gpu();
        let grid = seeded(&[3, 70_001], 4)
            .to_dtype(DType::BF16)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("bf16 values");
        let with = |i: usize, v: f32| {
            let mut values = grid
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values");
            values[i] = v;
            Tensor::from_vec(values, grid.dims(), &Device::Cpu).expect("tensor")
        };
        let cases = [
            grid.clone(),
            with(200_000, 1.0 + 2f32.powi(-12)),
            with(5, f32::NAN),
            with(77, 70_000.0),
            with(9, 2f32.powi(-24)),
            seeded(&[5], 1),
        ];
        for (c, host) in cases.iter().enumerate() {
            for narrow in [DType::BF16, DType::F16] {
                let want = narrow_where_exact(host, narrow).expect("host");
                let got = narrow_where_exact(&host.to_device(&device).expect("upload"), narrow)
                    .expect("gpu");
                assert_eq!(got.dtype(), want.dtype(), "case {c} {narrow:?}");
                assert!(bits(&got) == bits(&want), "case {c} {narrow:?}: values");
            }
        }
    }

    /// Off the CPU a backward keeping gradients narrow checks only large f32 gradients
    /// (`keep_narrow`: each check's verdict is a read-back): one under
    /// `DEVICE_CHECK_MIN_VALUES` values stays f32 though bf16 holds it, one at the bound is
    /// narrowed, one already in bf16 is kept as it is.
    #[test]
    fn small_gradients_stay_f32_unchecked_on_cuda() {
        use r3_model::narrow_grads::{keep_narrow, DEVICE_CHECK_MIN_VALUES};
        let device = gpu();
        let exact = |n: usize| {
            seeded(&[n], 7)
                .to_dtype(DType::BF16)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_device(&device))
                .expect("bf16 values")
        };
        let small = keep_narrow(&exact(DEVICE_CHECK_MIN_VALUES - 1), DType::BF16).expect("small");
        assert_eq!(small.dtype(), DType::F32);
        let large = keep_narrow(&exact(DEVICE_CHECK_MIN_VALUES), DType::BF16).expect("large");
        assert_eq!(large.dtype(), DType::BF16);
        let already = exact(8).to_dtype(DType::BF16).expect("bf16");
        assert_eq!(
            keep_narrow(&already, DType::BF16).expect("kept").dtype(),
            DType::BF16
        );
    }

    #[test]
    fn every_family_on_cuda_matches_the_cpu() {
        let device = gpu();
        for family in FAMILIES {
            compare_family(family, &device, GPU_F32);
        }
    }

    #[test]
    fn a_forward_sharing_prefixes_on_cuda_matches_the_cpus_unshared_one() {
        shared_prefixes_match_unshared(&gpu(), GPU_F32);
    }

    #[test]
    fn held_weight_copies_give_the_same_bits_on_cuda() {
        held_copies_give_the_same_bits(&gpu());
    }

    /// A training forward's attention in blocks of query rows (`Model::set_score_tiles`: a
    /// row a block, runs of three positions, whole groups) gives on the GPU the logits of one
    /// product within 1e-5 and every parameter's gradient within 1e-4 of its largest: every
    /// family, f32, replayed routing where the family has experts.
    #[test]
    fn attention_in_row_blocks_gives_the_whole_products_on_cuda() {
        use r3_model::layers::attention::ScoreTiles;
        let device = gpu();
        let values = |b: &[u32]| b.iter().map(|&x| f32::from_bits(x)).collect::<Vec<_>>();
        let largest_diff = |a: &[u32], b: &[u32]| {
            let (a, b) = (values(a), values(b));
            let scale = a
                .iter()
                .fold(0f32, |m, x| m.max(x.abs()))
                .max(f32::MIN_POSITIVE);
            let diff = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            (diff, diff / scale)
        };
        for family in FAMILIES {
            let cfg = tiny_config(family);
            let lengths = [6, 4];
            let batch =
                Batch::new(&sequences(&lengths, cfg.vocab_size, 3), 0, &device).expect("batch");
            let tables = cfg.moe.as_ref().map(|_| {
                ReplayRoutes::new(covering_tables(&cfg, &lengths), &cfg.layout).expect("covered")
            });
            let run = |tiles: ScoreTiles| {
                let (varmap, weights) = on_device(&tiny_weights(&cfg, 7, DType::F32), &device)
                    .into_trainable(&cfg)
                    .expect("trainable");
                let mut model = Model::new(&cfg, &weights).expect("model");
                model.set_score_tiles(tiles);
                logits_and_gradient_bits(&model, &batch, tables.as_ref(), &lengths, &varmap)
            };
            let whole = run(ScoreTiles::WHOLE);
            // A query row's scores: 2 sequences × the key/value heads × 6 slots.
            let kv = match cfg.attention {
                r3_model::AttentionConfig::Gqa { num_kv_heads, .. } => num_kv_heads,
                r3_model::AttentionConfig::Mla { .. } => cfg.num_attention_heads,
            };
            let row = 2 * kv * 6;
            for max in [1, 3 * row, 6 * row] {
                let blocks = run(ScoreTiles::at_most(max));
                let (logits, _) = largest_diff(&whole.0, &blocks.0);
                assert!(
                    logits <= 1e-5,
                    "{family} at most {max}: logits differ by {logits}"
                );
                for ((name, a), (_, b)) in whole.1.iter().zip(&blocks.1) {
                    let (_, relative) = largest_diff(a, b);
                    assert!(
                        relative <= 1e-4,
                        "{family} at most {max}: gradient of {name} differs by {relative}"
                    );
                }
            }
        }
    }

    #[test]
    fn selective_recomputation_gives_the_same_bits_on_cuda() {
        selective_recompute_gives_the_same_bits(&gpu());
    }

    #[test]
    fn recomputed_layers_give_the_same_bits_on_cuda() {
        recomputed_layers_give_the_same_bits(&gpu());
    }

    /// The device's memory high-water mark counts a tensor while it is held, and a reset
    /// after it went starts the mark below it.
    #[test]
    fn the_device_memory_peak_follows_the_tensors_held() {
        use r3_model::device::{device_memory_peak, reset_device_memory_peak};
        let device = gpu();
        reset_device_memory_peak(&device).expect("reset");
        let big = Tensor::zeros((16, 1 << 20), DType::F32, &device).expect("64 MiB");
        let with = device_memory_peak(&device)
            .expect("peak")
            .expect("a GPU's peak");
        assert!(with >= 64 << 20, "{with} bytes with a 64 MiB tensor held");
        drop(big);
        reset_device_memory_peak(&device).expect("reset");
        let small = Tensor::zeros(1024, DType::F32, &device).expect("4 KiB");
        let without = device_memory_peak(&device)
            .expect("peak")
            .expect("a GPU's peak");
        assert!(
            without < with,
            "{without} bytes after it went, {with} with it"
        );
        drop(small);
    }

    #[test]
    fn oracle_fixtures_on_cuda() {
        let device = gpu();
        for name in ORACLES {
            check_oracle(name, &device, 1e-4);
        }
    }

    /// Copies from the GPU through page-locked memory read back the tensor's values: sizes
    /// growing past the buffer and shrinking back, a strided view, a bf16 tensor, and a copy
    /// queued right behind the kernel that writes its values.
    #[test]
    fn host_staging_copies_gpu_tensors_exactly() {
        let device = gpu();
        let mut staging = r3_model::HostStaging::new();
        for (rows, cols) in [(2usize, 5usize), (64, 1000), (300, 3001), (3, 7)] {
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 7.0 - 50.0)
                .collect();
            let t = Tensor::from_vec(values.clone(), (rows, cols), &device).expect("t");
            assert_eq!(staging.copy_f32(&t).expect("copy"), values.as_slice());
            // Written by a kernel just queued: the copy waits for it.
            let doubled = (&t * 2.0).expect("double");
            let want: Vec<f32> = values.iter().map(|v| v * 2.0).collect();
            assert_eq!(staging.copy_f32(&doubled).expect("after"), want.as_slice());
            let strided = t.t().expect("transpose");
            let want: Vec<f32> = strided
                .to_device(&Device::Cpu)
                .and_then(|s| s.contiguous())
                .and_then(|s| s.flatten_all())
                .and_then(|s| s.to_vec1())
                .expect("want");
            assert_eq!(
                staging.copy_f32(&strided).expect("strided"),
                want.as_slice()
            );
            let half = t.to_dtype(DType::BF16).expect("bf16");
            let want: Vec<f32> = half
                .to_device(&Device::Cpu)
                .and_then(|s| s.to_dtype(DType::F32))
                .and_then(|s| s.flatten_all())
                .and_then(|s| s.to_vec1())
                .expect("widened");
            assert_eq!(staging.copy_f32(&half).expect("bf16"), want.as_slice());
        }
    }

    /// The router's top-k on the GPU (r3's kernel) chooses exactly what the host selection
    /// chooses, ties to the lower index and −0 below +0 included, rows narrower and wider
    /// than a block's threads.
    #[test]
    fn the_top_k_on_cuda_is_the_host_selection() {
        let device = gpu();
        for (experts, top_k) in [(8usize, 2usize), (128, 8), (3000, 6)] {
            let router = softmax_router(experts, top_k, true);
            let rows = 37;
            let logits = tied_logits(rows, experts);
            let want = router.select_rows(&logits, None).expect("host");
            let t = Tensor::from_vec(logits, (rows, experts), &device).expect("logits");
            let got = route_rows(&router, &t, None)
                .and_then(|choice| Ok(choice.ids.flatten_all()?.to_vec1::<u32>()?))
                .expect("on the GPU");
            assert_eq!(got, want, "{experts} experts, top-{top_k}");
            // A native training layer's read: the host's ids, and the same on the GPU.
            let choice = read_choice(&router, &t, None, false).expect("read");
            let (host, on_device) = (choice.ids, choice.on_device);
            assert_eq!(host, want, "{experts} experts, top-{top_k} read");
            let on_device = on_device
                .flatten_all()
                .and_then(|t| t.to_vec1::<u32>())
                .expect("device ids");
            assert_eq!(on_device, want, "{experts} experts, top-{top_k} on the GPU");
        }
        // A non-finite row read from the GPU's choice is the host's error.
        let router = softmax_router(8, 2, true);
        let mut logits = tied_logits(6, 8);
        logits[4 * 8 + 5] = f32::NAN;
        let want = router.select_rows(&logits, None).expect_err("host");
        let t = Tensor::from_vec(logits, (6, 8), &device).expect("logits");
        let got = read_choice(&router, &t, None, false).expect_err("GPU");
        assert_eq!(got.to_string(), want.to_string());
    }

    /// A softmax router's choice on the GPU (`r3_route_softmax_f32`: top-k, gates, finiteness
    /// in one kernel) equals the CPU's (the host selection and weighing): the same experts,
    /// gates within 1e-6, renormalised or not, a row with a NaN flagged on both.
    #[test]
    fn the_routers_choice_on_cuda_is_the_cpus() {
        let device = gpu();
        for (experts, top_k, norm) in [(8usize, 2usize, true), (128, 8, true), (60, 4, false)] {
            let router = softmax_router(experts, top_k, norm);
            let rows = 33;
            let mut logits = tied_logits(rows, experts);
            logits[7 * experts + 3] = f32::NAN;
            let host = Tensor::from_vec(logits, (rows, experts), &Device::Cpu).expect("logits");
            let want = route_rows(&router, &host, None).expect("cpu");
            let got =
                route_rows(&router, &host.to_device(&device).expect("gpu"), None).expect("gpu");
            let ids = |t: &Tensor| {
                t.flatten_all()
                    .and_then(|t| t.to_vec1::<u32>())
                    .expect("ids")
            };
            let flags = |t: &Tensor| t.to_vec1::<f32>().expect("flags");
            let (got_ids, want_ids) = (ids(&got.ids), ids(&want.ids));
            let (got_flags, want_flags) = (flags(&got.finite), flags(&want.finite));
            assert_eq!(got_flags, want_flags, "{experts} experts: flags");
            for r in (0..rows).filter(|&r| want_flags[r] == 1.0) {
                let row = r * top_k..(r + 1) * top_k;
                assert_eq!(
                    got_ids[row.clone()],
                    want_ids[row],
                    "{experts} experts, row {r}"
                );
            }
            assert!(
                max_diff(&got.gates, &want.gates) < 1e-6,
                "{experts} experts: gates"
            );
        }
    }

    /// A DeepSeek-V3 router's choice on the GPU (`r3_route_grouped_f32`: sigmoid scores with
    /// the bias, the groups' two best, the kept groups, the top-k, the gates) equals the
    /// CPU's (the host selection and weighing) bit for bit, ids and gates: its sigmoid is
    /// `math.rs`'s `fast_exp` in the same operations. Tied groups and experts, biases that
    /// leave kept scores below the dropped groups' zeros, no bias, rows renormalised or not,
    /// 256 experts in 8 groups (DeepSeek-V3's), a row with a NaN flagged on both.
    #[test]
    fn the_grouped_routers_choice_on_cuda_is_the_cpus_bit_for_bit() {
        let device = gpu();
        for (experts, n_group, topk_group, top_k, norm) in [
            (8usize, 4usize, 2usize, 2usize, true),
            (64, 8, 3, 6, false),
            (256, 8, 4, 8, true),
            (96, 32, 5, 4, true),
            (128, 64, 7, 8, true),
        ] {
            let router = grouped_router(experts, n_group, topk_group, top_k, norm);
            let rows = 41;
            let mut logits = tied_logits(rows, experts);
            // Wide logits too: the sigmoid's clamp and its tails.
            for (i, l) in logits.iter_mut().enumerate().filter(|(i, _)| i % 11 == 4) {
                *l = ((i * 37) % 200) as f32 - 100.0;
            }
            logits[7 * experts + 3] = f32::NAN;
            let host = Tensor::from_vec(logits, (rows, experts), &Device::Cpu).expect("logits");
            let mixed: Vec<f32> = (0..experts)
                .map(|e| ((e % 5) as f32 - 3.0) * 0.25)
                .collect();
            for bias in [Some(mixed), None, Some(vec![-1.5f32; experts])] {
                let b = bias
                    .as_ref()
                    .map(|b| Tensor::from_vec(b.clone(), experts, &Device::Cpu).expect("bias"));
                let b_gpu = b
                    .as_ref()
                    .map(|b| b.to_device(&device).expect("bias on the GPU"));
                let want = route_rows(&router, &host, b.as_ref()).expect("cpu");
                let got = route_rows(
                    &router,
                    &host.to_device(&device).expect("gpu"),
                    b_gpu.as_ref(),
                )
                .expect("gpu");
                let what = format!(
                    "{experts} experts, {n_group} groups, bias {}",
                    bias.is_some()
                );
                let flags = |t: &Tensor| t.to_vec1::<f32>().expect("flags");
                let want_flags = flags(&want.finite);
                assert_eq!(flags(&got.finite), want_flags, "{what}: flags");
                let values = |t: &Tensor| {
                    t.to_dtype(candle_core::DType::F32)
                        .and_then(|t| t.flatten_all())
                        .and_then(|t| t.to_vec1::<f32>())
                        .expect("values")
                };
                let (got_ids, want_ids) = (values(&got.ids), values(&want.ids));
                let (got_gates, want_gates) = (values(&got.gates), values(&want.gates));
                for r in (0..rows).filter(|&r| want_flags[r] == 1.0) {
                    let row = r * top_k..(r + 1) * top_k;
                    assert_eq!(
                        got_ids[row.clone()],
                        want_ids[row.clone()],
                        "{what}, row {r}"
                    );
                    let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got_gates[row.clone()]),
                        bits(&want_gates[row]),
                        "{what}, row {r}: gates"
                    );
                }
                assert_eq!(
                    &got_gates[7 * top_k..8 * top_k],
                    vec![0.0; top_k].as_slice()
                );
            }
        }
    }

    /// Steps routed on the GPU (top-k, gates and the experts' pointer GEMMs without the host)
    /// give the steps routed on the host: the same experts at every slot, logits within
    /// 1e-4 in f32 (5e-2 in bf16), for every family whose routers allow it, a prefill then
    /// decode steps.
    #[test]
    fn steps_routed_on_cuda_equal_steps_routed_on_the_host() {
        use r3_model::model::decode::{ScoreTiles, Step, StepMask, StepRouting};
        let device = gpu();
        let mut checked = 0;
        // bf16: the device-routed layer rounds its output in the combine's kernel and the
        // norms round in theirs, where host routing rounds after them.
        let bf16 = Precision::Bf16 { router_f32: false };
        for (family, precision) in FAMILIES
            .iter()
            .flat_map(|f| [(*f, Precision::F32), (*f, bf16)])
        {
            let cfg = tiny_config(family);
            let weights = on_device(&tiny_weights(&cfg, 11, DType::F32), &device);
            let model = Model::with_precision(&cfg, &weights, precision).expect("model");
            if cfg.moe.is_none() || !model.routes_on_device() {
                continue;
            }
            checked += 1;
            let tol = if precision == bf16 { 5e-2 } else { 1e-4 };
            let tokens = sequences(&[12], cfg.vocab_size, 2).remove(0);
            let mut caches = [model.kv_cache(), model.kv_cache()];
            let places = [StepRouting::Host, StepRouting::Device];
            let mut first = 0;
            for time in [5usize, 1, 1, 1, 1, 1, 1, 1] {
                let positions: Vec<u32> = (first..first + time).map(|p| p as u32).collect();
                let mask = causal(first, time, None);
                let mut outs = Vec::new();
                for (cache, routing) in caches.iter_mut().zip(places) {
                    let step = Step {
                        tokens: &tokens[first..first + time],
                        positions: &positions,
                        mask: StepMask::Additive(&mask),
                        batch: 1,
                        time,
                        all_logits: false,
                        routing,
                        score_tiles: ScoreTiles::WHOLE,
                    };
                    outs.push(model.forward_step(&step, cache).expect("step"));
                }
                assert_eq!(
                    outs[0].routes, outs[1].routes,
                    "{family} {precision:?}: routes at {first}"
                );
                let d = max_diff(&outs[0].logits, &outs[1].logits);
                assert!(
                    d < tol,
                    "{family} {precision:?}: logits at {first} differ by {d}"
                );
                first += time;
            }
        }
        assert!(
            checked >= 8,
            "{checked} families × precisions routed on the GPU"
        );
    }

    /// A step's mask built on the GPU from each query row's seen slots is the mask's values
    /// copied from the host, bit for bit, and a step given the runs (the decode kernel reads
    /// them) computes what the step given the copied values computes (the composed
    /// attention) within 1e-4 of the logits' scale: a prefill of 6 then decode steps of two
    /// rows, each query row seeing two runs of slots (one the run of slots up to its own, cut
    /// by a window), every family, f32.
    #[test]
    fn a_mask_built_on_cuda_from_seen_slots_is_the_copied_mask() {
        use r3_model::model::decode::{ScoreTiles, SeenSlots, Step, StepMask, StepRouting};
        let device = gpu();
        // Row b's query in slot q: slot b (a held prefix's) and the three slots up to q.
        let seen_by = |b: usize, q: usize| match q <= b {
            true => SeenSlots::run(q..q + 1),
            false => SeenSlots::runs(b..b + 1, q.saturating_sub(2).max(b + 1)..q + 1),
        };
        for family in FAMILIES {
            let cfg = tiny_config(family);
            let weights = on_device(&tiny_weights(&cfg, 12, DType::F32), &device);
            let model = Model::new(&cfg, &weights).expect("model");
            let tokens = sequences(&[10, 10], cfg.vocab_size, 4);
            let mut caches = [model.kv_cache(), model.kv_cache()];
            let mut first = 0;
            for time in [6usize, 1, 1, 1, 1] {
                let slots = first + time;
                let fed: Vec<u32> = (0..2)
                    .flat_map(|b| tokens[b][first..slots].to_vec())
                    .collect();
                let positions: Vec<u32> = (0..2)
                    .flat_map(|_| (first..slots).map(|p| p as u32))
                    .collect();
                let seen: Vec<SeenSlots> = (0..2)
                    .flat_map(|b| (first..slots).map(move |q| seen_by(b, q)))
                    .collect();
                let dense: Vec<f32> = seen
                    .iter()
                    .flat_map(|row| {
                        (0..slots).map(|k| match row.sees(k) {
                            true => 0.0,
                            false => f32::NEG_INFINITY,
                        })
                    })
                    .collect();
                let masks = [StepMask::Additive(&dense), StepMask::Seen(&seen)];
                let built = masks.map(|m| {
                    let mask = m
                        .additive((2, time, slots), &device, DType::F32)
                        .expect("mask");
                    bits(&mask)
                });
                assert!(built[0] == built[1], "{family}: the mask at {first}");
                let mut logits = Vec::new();
                for (cache, mask) in caches.iter_mut().zip(masks) {
                    let step = Step {
                        tokens: &fed,
                        positions: &positions,
                        mask,
                        batch: 2,
                        time,
                        all_logits: true,
                        routing: StepRouting::Host,
                        score_tiles: ScoreTiles::WHOLE,
                    };
                    let out = model.forward_step(&step, cache).expect("step").logits;
                    logits.push(out.to_device(&Device::Cpu).expect("to host"));
                }
                let scale = logits[0]
                    .abs()
                    .and_then(|x| x.max_all())
                    .and_then(|x| x.to_scalar::<f32>())
                    .expect("scale");
                let d = max_diff(&logits[0], &logits[1]);
                assert!(
                    d <= 1e-4 * scale.max(1.0),
                    "{family}: logits at {first}: {d}"
                );
                first += time;
            }
        }
    }

    /// The decode kernel on the GPU (`attend_cached` over each query row's runs of seen
    /// slots, a mask that must not be built) equals the CPU's composed attention over the
    /// additive mask of the same runs within 1e-5 (of values of order 1): keys and values of
    /// different widths (MLA's shape), 700 slots over several chunks of the block's threads
    /// and 1,500 over three spans (one starting in the gap between a row's runs), a row
    /// left-padded past half its slots, a step of one query and of four, grouped queries.
    #[test]
    fn the_decode_attention_on_cuda_is_the_cpus() {
        use r3_model::layers::attention::{attend_additive, attend_cached, CacheMask, ScoreTiles};
        let device = gpu();
        let (b, kv, groups, dq, dv) = (2, 3, 2, 24, 40);
        for (s, t) in [(700usize, 1usize), (700, 4), (1500, 1)] {
            let q = seeded(&[b, kv, groups * t, dq], 1);
            let k = seeded(&[b, kv, s, dq], 2);
            let v = seeded(&[b, kv, s, dv], 3);
            // Row 0 sees a fifteenth of the slots and, past a gap, from three fifths up to its
            // causal end; row 1 from half its slots.
            let runs: Vec<u32> = (0..b * t)
                .flat_map(|row| {
                    let end = (s - t + row % t + 1) as u32;
                    match row / t {
                        0 => [0, (s / 15) as u32, (3 * s / 5) as u32, end],
                        _ => [(s / 2) as u32, end, 0, 0],
                    }
                })
                .collect();
            let mask: Vec<f32> = (0..b * t * s)
                .map(|i| {
                    let (r, j) = (&runs[(i / s) * 4..(i / s) * 4 + 4], (i % s) as u32);
                    match (r[0] <= j && j < r[1]) || (r[2] <= j && j < r[3]) {
                        true => 0.0,
                        false => f32::NEG_INFINITY,
                    }
                })
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, 1, t, s), &Device::Cpu).expect("mask");
            let on = |x: &Tensor| x.to_device(&device).expect("to gpu");
            let seen = Tensor::from_vec(runs, (b * t, 4), &device).expect("runs");
            let runs = CacheMask::from_seen(seen, || {
                Err(r3_model::ModelError::Input(
                    "the kernel builds no mask".into(),
                ))
            });
            let got = attend_cached(
                &on(&q),
                &on(&k),
                &on(&v),
                &runs,
                0.2,
                groups,
                ScoreTiles::DEFAULT,
            )
            .expect("the decode kernel")
            .to_device(&Device::Cpu)
            .expect("back");
            let want = attend_additive(&q, &k, &v, &mask, 0.2, groups).expect("cpu");
            let d = max_diff(&got, &want);
            assert!(
                d <= 1e-5,
                "{s} slots, t {t}: the GPU's attention differs by {d}"
            );
        }
    }

    /// Attention in query tiles on the GPU (whole sequences, runs of positions, one position)
    /// equals the CPU's whole product within 1e-5 (the composed GEMMs and softmax, tile by
    /// tile): a prefill of 9 positions over 300 cached slots and over 9,000, and of 48
    /// positions over 300, grouped queries, a mask per sequence and one shared by the
    /// batch.
    #[test]
    fn attention_in_score_tiles_on_cuda_is_the_cpus_whole_product() {
        for (cached, t) in [(300, 9), (9_000, 9), (300, 48)] {
            tiles_on_cuda_are_the_cpus_whole_product(cached, t);
        }
    }

    fn tiles_on_cuda_are_the_cpus_whole_product(cached: usize, t: usize) {
        use r3_model::layers::attention::{attend_additive, attend_tiled, ScoreTiles};
        let device = gpu();
        let (b, kv, groups, d) = (3, 2, 4, 32);
        let s = cached + t;
        let q = seeded(&[b, kv, groups * t, d], 4);
        let k = seeded(&[b, kv, s, d], 5);
        let v = seeded(&[b, kv, s, d], 6);
        let mask: Vec<f32> = (0..b * t * s)
            .map(|i| match (i % s) <= cached + (i / s) % t {
                true => 0.0,
                false => f32::NEG_INFINITY,
            })
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, t, s), &Device::Cpu).expect("mask");
        let want = attend_additive(&q, &k, &v, &mask, 0.2, groups).expect("cpu");
        let on = |x: &Tensor| x.to_device(&device).expect("to gpu");
        let heads = kv * groups;
        for max in [1, 2 * heads * s, heads * s * t, usize::MAX] {
            let got = attend_tiled(
                &on(&q),
                &on(&k),
                &on(&v),
                &on(&mask),
                0.2,
                groups,
                ScoreTiles::at_most(max),
            )
            .expect("gpu")
            .to_device(&Device::Cpu)
            .expect("back");
            let diff = max_diff(&got, &want);
            assert!(
                diff <= 1e-5,
                "{cached} cached, at most {max}: the GPU's tiles differ by {diff}"
            );
        }
        // The first sequence's mask rows shared by the batch.
        let shared = mask.narrow(0, 0, 1).expect("one row");
        let want = attend_additive(&q, &k, &v, &shared, 0.2, groups).expect("cpu");
        let got = attend_tiled(
            &on(&q),
            &on(&k),
            &on(&v),
            &on(&shared),
            0.2,
            groups,
            ScoreTiles::at_most(2 * heads * s),
        )
        .expect("gpu")
        .to_device(&Device::Cpu)
        .expect("back");
        let diff = max_diff(&got, &want);
        assert!(diff <= 1e-5, "{cached} cached, a shared mask: {diff}");
    }

    /// The greedy reduction on the GPU equals the CPU's: the same largest value and first
    /// column on every row (planted ties at three columns, a row of equal values, `−∞`
    /// entries), the log-sum-exp within 1e-5 relative (the CPU sums in f64, the GPU in f32 in
    /// its block's order: about 1e-7 apart over 151,936 terms), NaN
    /// where a row holds a NaN or `+∞`, no column for a row of `−∞`; over a 151,936-token
    /// vocabulary and a short one.
    #[test]
    fn the_greedy_reduction_on_cuda_is_the_cpus() {
        use r3_model::greedy_rows::greedy_rows;
        let device = gpu();
        for vocab in [151_936usize, 40] {
            let rows = 9;
            let mut v: Vec<f32> = (0..rows * vocab)
                .map(|i| (((i * 7919) % 4001) as f32 / 400.0) - 5.0)
                .collect();
            for c in [vocab - 1, 7, vocab / 2] {
                v[vocab + c] = 11.0;
            }
            v[2 * vocab..3 * vocab].fill(0.5);
            for c in (0..vocab).step_by(3) {
                v[3 * vocab + c] = f32::NEG_INFINITY;
            }
            v[4 * vocab + 17] = f32::NAN;
            v[5 * vocab + 3] = f32::INFINITY;
            v[6 * vocab..7 * vocab].fill(f32::NEG_INFINITY);
            let cpu = Tensor::from_vec(v, (rows, vocab), &Device::Cpu).expect("logits");
            let on = |d: &Device| {
                greedy_rows(&cpu.to_device(d).expect("to device"))
                    .and_then(|t| Ok(t.to_vec2::<f32>()?))
                    .expect("greedy rows")
            };
            let (got, want) = (on(&device), on(&Device::Cpu));
            for r in 0..rows {
                let (g, w) = (&got[r], &want[r]);
                assert_eq!(
                    g[0].to_bits(),
                    w[0].to_bits(),
                    "vocab {vocab} row {r} largest"
                );
                assert_eq!(g[2], w[2], "vocab {vocab} row {r} first column");
                if w[1].is_nan() {
                    assert!(g[1].is_nan(), "vocab {vocab} row {r}: {g:?}");
                } else {
                    let tol = 1e-5 * w[1].abs().max(1.0);
                    assert!(
                        (g[1] - w[1]).abs() <= tol,
                        "vocab {vocab} row {r}: {g:?} {w:?}"
                    );
                }
            }
            assert_eq!(got[1][2], 7.0);
            assert_eq!(got[6][2], vocab as f32);
        }
    }

    /// An opened GPU gives its buffers no use-tracking events (the device is opened with
    /// them off), and a whole forward and backward leaves its context on one stream per
    /// thread: the condition under which cudarc would never have used those events.
    #[test]
    fn the_gpu_context_stays_on_one_stream_without_tracking_events() {
        let device = gpu();
        let Device::Cuda(cuda) = &device else {
            panic!("opened `cuda:0` as {device:?}");
        };
        assert!(!cuda.is_event_tracking(), "event tracking left on");
        compare_family(FAMILIES[0], &device, GPU_F32);
        assert!(
            !cuda.cuda_stream().context().is_in_multi_stream_mode(),
            "something made a second stream on the training engine's context"
        );
    }

    /// A layer's KV cache on the GPU: each step's keys and values written in place into its
    /// buffers read back as the concatenation of everything appended (exactly), and the
    /// composed attention over the cache's strided views — read in place by cuBLAS with the
    /// buffer's batch stride, nothing copied — equals the attention over contiguous copies on
    /// the GPU and over the same values on the CPU.
    #[test]
    fn a_kv_cache_attends_in_place_on_cuda() {
        use r3_model::layers::attention::{attend_additive, LayerKv};
        let device = gpu();
        let (b, kv, groups, d) = (3, 2, 4, 16);
        let mut cache = LayerKv::default();
        let (mut all_k, mut all_v): (Vec<Tensor>, Vec<Tensor>) = (Vec::new(), Vec::new());
        for (step, t) in std::iter::once(9)
            .chain(std::iter::repeat_n(1, 20))
            .enumerate()
        {
            let k = seeded(&[b, kv, t, d], 2 * step);
            let v = seeded(&[b, kv, t, d], 2 * step + 1);
            let (gk, gv) = cache
                .append(
                    &k.to_device(&device).expect("k"),
                    &v.to_device(&device).expect("v"),
                )
                .expect("append");
            all_k.push(k);
            all_v.push(v);
            let want_k = Tensor::cat(&all_k.iter().collect::<Vec<_>>(), 2).expect("k");
            let want_v = Tensor::cat(&all_v.iter().collect::<Vec<_>>(), 2).expect("v");
            let back = |t: &Tensor| t.to_device(&Device::Cpu).expect("to host");
            assert_eq!(max_diff(&back(&gk), &want_k), 0.0, "keys after step {step}");
            assert_eq!(
                max_diff(&back(&gv), &want_v),
                0.0,
                "values after step {step}"
            );
            let s = want_k.dim(2).expect("slots");
            let mask: Vec<f32> = (0..b * s)
                .map(|i| if i % 5 == 2 { f32::NEG_INFINITY } else { 0.0 })
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, 1, 1, s), &Device::Cpu).expect("mask");
            let q = seeded(&[b, kv, groups, d], 100 + step);
            let scale = 0.25;
            let on_gpu = |t: &Tensor| t.to_device(&device).expect("to gpu");
            let got = attend_additive(&on_gpu(&q), &gk, &gv, &on_gpu(&mask), scale, groups)
                .expect("over the views");
            let copied = attend_additive(
                &on_gpu(&q),
                &gk.contiguous().expect("k"),
                &gv.contiguous().expect("v"),
                &on_gpu(&mask),
                scale,
                groups,
            )
            .expect("over copies");
            let cpu = attend_additive(&q, &want_k, &want_v, &mask, scale, groups).expect("cpu");
            assert!(
                max_diff(&back(&got), &back(&copied)) <= 1e-6,
                "step {step}: views against copies on the GPU"
            );
            assert!(
                max_diff(&back(&got), &cpu) <= 1e-5,
                "step {step}: the GPU against the CPU"
            );
            // A view of a longer buffer is strided; the step that fills the buffer to its
            // capacity views all of it, which is contiguous.
            if step > 0 && cache.len() < cache.capacity() {
                assert!(
                    !gk.is_contiguous(),
                    "step {step}: a view of a longer buffer"
                );
            }
        }
    }

    /// A 16-bit KV cache on the GPU (`LayerKv::holding`, as the device engine keeps a bf16 /
    /// f16 forward's keys and values) attends as the f32 cache of the same values, bit for
    /// bit, through the decode kernel reading each row's runs of seen slots (`attend_cached`
    /// with a `CacheMask` of runs whose additive form is never built: `r3_attend_group_bf16` /
    /// `_f16` widen exactly what `_f32` reads, and the spans' merge is the same): a decode
    /// step of 1,280 query rows over 300 slots (one span, past the old one-kernel bound of
    /// 1,024 rows) and one sequence over 9,000 slots (split into spans), rows left-padded and
    /// with a gap between their runs; both within 1e-5 of the CPU's composed attention over
    /// the additive mask of the same runs.
    #[test]
    fn a_sixteen_bit_kv_cache_attends_as_the_f32_one_on_cuda() {
        use r3_model::layers::attention::ScoreTiles;
        use r3_model::layers::attention::{attend_additive, attend_cached, CacheMask, LayerKv};
        let device = gpu();
        let (kv, groups, d) = (2, 8, 64);
        for (b, s) in [(80usize, 300usize), (1, 9000)] {
            // Row i: left padding of i % 50 slots, a gap of 3 slots past a fifth of the rest.
            let runs: Vec<[u32; 4]> = (0..b)
                .map(|i| {
                    let pad = (i % 50) as u32;
                    let cut = pad + (s as u32 - pad) / 5;
                    [pad, cut, cut + 3, s as u32]
                })
                .collect();
            let mask: Vec<f32> = runs
                .iter()
                .flat_map(|r| {
                    (0..s as u32).map(move |j| {
                        match (r[0] <= j && j < r[1]) || (r[2] <= j && j < r[3]) {
                            true => 0.0,
                            false => f32::NEG_INFINITY,
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, 1, 1, s), &Device::Cpu).expect("mask");
            let bounds: Vec<u32> = runs.iter().flatten().copied().collect();
            let bounds = Tensor::from_vec(bounds, (b, 4), &device).expect("runs");
            let q = seeded(&[b, kv, groups, d], 7);
            let on_gpu = |t: &Tensor| t.to_device(&device).expect("to gpu");
            let back = |t: &Tensor| t.to_device(&Device::Cpu).expect("to host");
            for dtype in [DType::BF16, DType::F16] {
                // Values of the 16-bit float, as the forward rounds them.
                let exact = |seed| {
                    seeded(&[b, kv, s, d], seed)
                        .to_dtype(dtype)
                        .and_then(|t| t.to_dtype(DType::F32))
                        .expect("16-bit values")
                };
                let (k, v) = (exact(1), exact(2));
                let attend = |held: DType| {
                    let mut cache = LayerKv::holding(held);
                    let (gk, gv) = cache.append(&on_gpu(&k), &on_gpu(&v)).expect("append");
                    assert_eq!(gk.dtype(), held);
                    let runs = CacheMask::from_seen(bounds.clone(), || {
                        Err(r3_model::ModelError::Input(
                            "the kernel builds no mask".into(),
                        ))
                    });
                    let (q, tiles) = (on_gpu(&q), ScoreTiles::DEFAULT);
                    let out = attend_cached(&q, &gk, &gv, &runs, 0.125, groups, tiles)
                        .expect("the decode kernel");
                    assert!(!runs.is_built());
                    back(&out)
                };
                let (narrow, wide) = (attend(dtype), attend(DType::F32));
                let cpu = attend_additive(&q, &k, &v, &mask, 0.125, groups).expect("cpu");
                let diff = max_diff(&narrow, &wide);
                println!("{dtype:?} b {b} s {s}: 16-bit against f32 cache {diff:e}");
                assert_eq!(diff, 0.0, "{dtype:?} b {b} s {s}: the kernel's bits");
                assert!(
                    max_diff(&narrow, &cpu) <= 1e-5,
                    "{dtype:?} b {b} s {s}: the CPU"
                );
            }
        }
    }

    /// Reads and transfers of views (the vendored candle's patch: a view holding at most
    /// half its buffer is copied into a storage of its own first, so only its elements
    /// cross): narrows at and off the buffer's start, most of the buffer (moved whole), a
    /// row, one element, a strided column, a transposed and a broadcast view, moved to the host by `to_device` (and host views up
    /// and back) in f32, bf16 and u32, read in place by `to_vec1/2/3` and `to_scalar` in f32
    /// and u32 — every value the CPU's.
    #[test]
    fn views_of_gpu_buffers_read_and_move_as_their_values() {
        let device = gpu();
        let host = Tensor::arange(0u32, 6 * 5 * 4, &Device::Cpu)
            .and_then(|t| t.reshape((6, 5, 4)))
            .expect("values");
        type View = fn(&Tensor) -> candle_core::Result<Tensor>;
        let views: [(&str, View); 9] = [
            ("narrow at the start", |t| t.narrow(0, 0, 2)),
            ("narrow off the start", |t| t.narrow(0, 3, 2)),
            ("most of the buffer", |t| t.narrow(0, 1, 5)),
            ("a row", |t| t.get(4)),
            ("one element's row", |t| t.get(5)?.get(4)?.narrow(0, 2, 1)),
            ("a strided column", |t| t.narrow(2, 1, 1)),
            ("transposed", |t| t.transpose(0, 2)),
            ("broadcast", |t| {
                t.get(1)?.unsqueeze(0)?.broadcast_as((3, 5, 4))
            }),
            ("whole", |t| Ok(t.clone())),
        ];
        let mut reads = 0;
        for dtype in [DType::F32, DType::BF16, DType::U32] {
            let cpu = host.to_dtype(dtype).expect("cast");
            let on_gpu = cpu.to_device(&device).expect("upload");
            for (name, view) in views {
                let (want, got) = (view(&cpu).expect("cpu view"), view(&on_gpu).expect("view"));
                let case = format!("{dtype:?} {name}");
                let back = got.to_device(&Device::Cpu).expect("to the host");
                assert_eq!(back.dims(), want.dims(), "{case}");
                assert_eq!(bits(&back), bits(&want), "{case}: to_device");
                let round_trip = want
                    .to_device(&device)
                    .and_then(|t| t.to_device(&Device::Cpu))
                    .expect("a host view up and back");
                assert_eq!(
                    bits(&round_trip),
                    bits(&want),
                    "{case}: a host view uploaded"
                );
                // Read in place, in the view's own dtype.
                macro_rules! reads_as_the_cpu {
                    ($t:ty) => {{
                        match got.rank() {
                            3 => assert_eq!(
                                got.to_vec3::<$t>().expect("gpu"),
                                want.to_vec3::<$t>().expect("cpu"),
                                "{case}: to_vec3"
                            ),
                            2 => assert_eq!(
                                got.to_vec2::<$t>().expect("gpu"),
                                want.to_vec2::<$t>().expect("cpu"),
                                "{case}: to_vec2"
                            ),
                            1 => assert_eq!(
                                got.to_vec1::<$t>().expect("gpu"),
                                want.to_vec1::<$t>().expect("cpu"),
                                "{case}: to_vec1"
                            ),
                            rank => panic!("{case}: rank {rank}"),
                        }
                        if got.elem_count() == 1 {
                            let scalar = |t: &Tensor| t.flatten_all()?.get(0)?.to_scalar::<$t>();
                            assert_eq!(
                                scalar(&got).expect("gpu"),
                                scalar(&want).expect("cpu"),
                                "{case}: to_scalar"
                            );
                        }
                        reads += 1;
                    }};
                }
                match dtype {
                    DType::F32 => reads_as_the_cpu!(f32),
                    DType::U32 => reads_as_the_cpu!(u32),
                    _ => {}
                }
            }
        }
        assert_eq!(
            reads,
            2 * views.len(),
            "every f32 and u32 view read in place"
        );
    }
}
