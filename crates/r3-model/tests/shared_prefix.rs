//! A batch whose sequences share prefixes (a GRPO group's prompt) computed once
//! (`Batch::sharing_prefixes`) gives the unshared forward's logits, recorded routes, replay
//! proof and every parameter's gradient, to float rounding (f64 here), while computing fewer
//! rows. GQA and MLA attention alike.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{grouped_sequences, probe, sorted_vars, tiny_config, tiny_weights};
use r3_model::{Batch, Config, ForwardOutput, Model, ReplayRoutes, Routing};

/// The families: GQA, and MLA with a low-rank query (deepseek_v3) and without (moonlight).
const FAMILIES: [&str; 7] = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3",
    "deepseek_v3",
    "moonlight",
];

fn lengths(seqs: &[Vec<u32>]) -> Vec<usize> {
    seqs.iter().map(Vec::len).collect()
}

/// The loss Σ logits · probe over real positions and every variable's gradient.
fn loss_and_grads(
    vars: &[(String, Var)],
    out: &ForwardOutput,
    probe: &Tensor,
) -> (f64, Vec<Vec<f64>>) {
    let loss = (&out.logits * probe).expect("mul").sum_all().expect("sum");
    let grads = loss.backward().expect("backward");
    let values = vars
        .iter()
        .map(|(name, v)| {
            grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name} has no gradient"))
                .flatten_all()
                .and_then(|t| t.to_vec1::<f64>())
                .expect("values")
        })
        .collect();
    (loss.to_scalar::<f64>().expect("loss"), values)
}

/// The logits of real positions only (padding holds garbage in either forward).
fn real_logits(out: &ForwardOutput, lens: &[usize], cfg: &Config) -> Vec<f64> {
    let all = out
        .logits
        .flatten_all()
        .and_then(|t| t.to_vec1::<f64>())
        .expect("logits");
    let t = out.logits.dim(1).expect("positions");
    let v = cfg.vocab_size;
    lens.iter()
        .enumerate()
        .flat_map(|(b, &len)| all[(b * t) * v..(b * t + len) * v].to_vec())
        .collect()
}

/// Every variable's gradient of `a` within 1e-9 of `b`'s (`what` names the case).
fn assert_grads_close(what: &str, vars: &[(String, Var)], a: &[Vec<f64>], b: &[Vec<f64>]) {
    for ((name, _), (x, y)) in vars.iter().zip(a.iter().zip(b)) {
        let d = max_diff(x, y);
        assert!(d < 1e-9, "{what}: {name}'s gradient differs by {d}");
    }
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn model_of(family: &str, seed: u64) -> (Config, Model, Vec<(String, Var)>) {
    let cfg = tiny_config(family);
    let (varmap, weights) = tiny_weights(&cfg, seed, DType::F64)
        .into_trainable(&cfg)
        .expect("trainable");
    let model = Model::new(&cfg, &weights).expect("model");
    (cfg, model, sorted_vars(varmap.data()))
}

#[test]
fn a_shared_prefix_forward_equals_the_unshared_one_in_every_family() {
    for family in FAMILIES {
        let (cfg, model, vars) = model_of(family, 11);
        let seqs = grouped_sequences(cfg.vocab_size);
        let lens = lengths(&seqs);
        let probe = probe(&lens, cfg.vocab_size, &Device::Cpu)
            .to_dtype(DType::F64)
            .expect("probe");
        let plain = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        let shared = plain.clone().sharing_prefixes(true);
        let routing = match cfg.moe.is_some() {
            true => Routing::Record,
            false => Routing::Native,
        };
        let a = model.forward(&plain, routing).expect("unshared");
        let b = model.forward(&shared, routing).expect("shared");
        // 6 sequences padded to 11 positions, 43 real ones. Shared: sample 1 its prompt's
        // 6 with sample 0; sample 2 the 2 positions prompt b begins with; sample 3 its
        // prompt and its first response token (7) with sample 0; sample 5 prompt b (5) with
        // sample 2; sample 4 nothing.
        let real: usize = lens.iter().sum();
        assert_eq!((real, a.shared_positions()), (43, 0), "{family}");
        assert_eq!(b.shared_positions(), 6 + 2 + 7 + 5, "{family}");
        let d = max_diff(&real_logits(&a, &lens, &cfg), &real_logits(&b, &lens, &cfg));
        assert!(d < 1e-10, "{family}: logits differ by {d}");
        assert_eq!(a.routes, b.routes, "{family}: recorded routes");
        let (la, ga) = loss_and_grads(&vars, &a, &probe);
        let (lb, gb) = loss_and_grads(&vars, &b, &probe);
        assert!((la - lb).abs() < 1e-9, "{family}: loss {la} against {lb}");
        assert_grads_close(family, &vars, &ga, &gb);
    }
}

#[test]
fn a_replayed_shared_forward_proves_and_counts_as_the_unshared_one() {
    let (cfg, model, vars) = model_of("qwen3_moe", 11);
    // Routes recorded by other weights, so some replayed rows differ from the router's own
    // choice and the divergence count means something.
    let (_, other, _) = model_of("qwen3_moe", 12);
    let seqs = grouped_sequences(cfg.vocab_size);
    let lens = lengths(&seqs);
    let plain = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
    let recorded = other
        .forward(&plain, Routing::Record)
        .expect("record")
        .routes
        .expect("routes");
    // `len − 1` rows: the final positions route natively, as a rollout's tables do.
    let tables: Vec<_> = recorded
        .iter()
        .zip(&lens)
        .map(|(t, &len)| t.slice_rows(0, len - 1).expect("slice"))
        .collect();
    let routes = ReplayRoutes::new(tables, &cfg.layout).expect("covered");
    let probe = probe(&lens, cfg.vocab_size, &Device::Cpu)
        .to_dtype(DType::F64)
        .expect("probe");
    let a = model
        .forward(&plain, Routing::Replay(&routes))
        .expect("unshared");
    let b = model
        .forward(
            &plain.clone().sharing_prefixes(true),
            Routing::Replay(&routes),
        )
        .expect("shared");
    assert!(b.shared_positions() > 0);
    let (pa, pb) = (
        a.replay.clone().expect("proof"),
        b.replay.clone().expect("proof"),
    );
    assert!(pa.differs_from_native.iter().sum::<usize>() > 0, "{pa:?}");
    assert_eq!(pa, pb);
    let d = max_diff(&real_logits(&a, &lens, &cfg), &real_logits(&b, &lens, &cfg));
    assert!(d < 1e-10, "logits differ by {d}");
    let (_, ga) = loss_and_grads(&vars, &a, &probe);
    let (_, gb) = loss_and_grads(&vars, &b, &probe);
    assert_grads_close("replay", &vars, &ga, &gb);
}

#[test]
fn replayed_routes_that_differ_between_samples_keep_their_positions_apart() {
    let (cfg, model, _) = model_of("qwen3_moe", 11);
    let seqs = grouped_sequences(cfg.vocab_size);
    let lens = lengths(&seqs);
    let plain = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
    // Covering tables cycle the experts row by row: samples of one prompt get different
    // experts at the same positions, so those positions cannot share.
    let routes =
        ReplayRoutes::new(common::covering_tables(&cfg, &lens), &cfg.layout).expect("covered");
    let a = model
        .forward(&plain, Routing::Replay(&routes))
        .expect("unshared");
    let b = model
        .forward(&plain.sharing_prefixes(true), Routing::Replay(&routes))
        .expect("shared");
    assert_eq!(a.replay, b.replay);
    let d = max_diff(&real_logits(&a, &lens, &cfg), &real_logits(&b, &lens, &cfg));
    assert!(d < 1e-10, "logits differ by {d}");
}

/// Logits from a later position (`forward_logits_from`, as a policy's scoring asks): the
/// shared forward's head reads each distinct row once and gathers its logits to the
/// positions, and gives the unshared forward's logits and gradients, from a position inside
/// the shared prompts (2) and from one past every prompt (7).
#[test]
fn shared_logits_from_a_later_position_equal_the_unshared_ones() {
    for family in ["qwen3_moe", "deepseek_v3"] {
        let (cfg, model, vars) = model_of(family, 11);
        let seqs = grouped_sequences(cfg.vocab_size);
        let lens = lengths(&seqs);
        let plain = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
        for from in [2, 7] {
            let run = |batch: &Batch| {
                let out = model
                    .forward_logits_from(batch, Routing::Record, from)
                    .expect("forward");
                let probe = probe(&lens, cfg.vocab_size, &Device::Cpu)
                    .to_dtype(DType::F64)
                    .and_then(|p| p.narrow(1, from, p.dim(1)? - from))
                    .expect("probe");
                let (_, grads) = loss_and_grads(&vars, &out, &probe);
                let all = out
                    .logits
                    .flatten_all()
                    .and_then(|l| l.to_vec1::<f64>())
                    .expect("logits");
                let width = out.logits.dim(1).expect("width");
                let v = cfg.vocab_size;
                // Real positions only: padding's logits are garbage in either forward.
                let real: Vec<f64> = lens
                    .iter()
                    .enumerate()
                    .flat_map(|(b, &len)| {
                        all[b * width * v..(b * width + len.saturating_sub(from)) * v].to_vec()
                    })
                    .collect();
                (real, grads, out.shared_positions())
            };
            let (a, ga, none) = run(&plain);
            let (b, gb, shared) = run(&plain.clone().sharing_prefixes(true));
            assert_eq!((none, shared), (0, 20), "{family} from {from}");
            let d = max_diff(&a, &b);
            assert!(d < 1e-10, "{family} from {from}: logits differ by {d}");
            assert_grads_close(&format!("{family} from {from}"), &vars, &ga, &gb);
        }
    }
}

/// Two samples of one prompt whose responses differ from their first token: of the head's
/// 14 positions (from the prompt's last on) one repeats another's row, under the quarter
/// at which the head runs once per distinct row, so it runs per position
/// (`SharedLen::head` 0) and still gives the unshared logits and gradients; the grouped batch
/// (padding and responses that begin alike) runs it per distinct row: of its head
/// positions, every shared one and every padding slot reads a row another computed first.
#[test]
fn the_head_runs_per_distinct_row_only_where_a_quarter_repeat() {
    let (cfg, model, vars) = model_of("qwen3_moe", 11);
    let v = |x: u32| x % cfg.vocab_size as u32;
    let prompt = [v(3), v(8), v(13)];
    let seqs: Vec<Vec<u32>> = [[1u32, 2, 4, 5, 6, 7], [9, 10, 11, 12, 14, 15]]
        .iter()
        .map(|r| {
            prompt
                .iter()
                .copied()
                .chain(r.iter().map(|&x| v(x)))
                .collect()
        })
        .collect();
    let lens = lengths(&seqs);
    let plain = Batch::new(&seqs, 0, &Device::Cpu).expect("batch");
    let from = 2;
    let probe = probe(&lens, cfg.vocab_size, &Device::Cpu)
        .to_dtype(DType::F64)
        .and_then(|p| p.narrow(1, from, p.dim(1)? - from))
        .expect("probe");
    let a = model
        .forward_logits_from(&plain, Routing::Record, from)
        .expect("unshared");
    let b = model
        .forward_logits_from(&plain.clone().sharing_prefixes(true), Routing::Record, from)
        .expect("shared");
    let heads: Vec<(usize, usize)> = b
        .shared_lens
        .iter()
        .map(|s| (s.positions, s.head))
        .collect();
    assert_eq!(heads, vec![(0, 0), (3, 0)], "per position");
    let values = |out: &ForwardOutput| {
        out.logits
            .flatten_all()
            .and_then(|l| l.to_vec1::<f64>())
            .expect("logits")
    };
    let d = max_diff(&values(&a), &values(&b));
    assert!(d < 1e-10, "logits differ by {d}");
    let (_, ga) = loss_and_grads(&vars, &a, &probe);
    let (_, gb) = loss_and_grads(&vars, &b, &probe);
    assert_grads_close("per position", &vars, &ga, &gb);

    let grouped = Batch::new(&grouped_sequences(cfg.vocab_size), 0, &Device::Cpu)
        .expect("batch")
        .sharing_prefixes(true);
    let out = model.forward(&grouped, Routing::Record).expect("grouped");
    assert!(out.shared_positions() > 0);
    let t = grouped.seq_len();
    let padding: usize = grouped.lengths().iter().map(|&len| t - len).sum();
    let reused: usize = out.shared_lens.iter().map(|s| s.head).sum();
    assert_eq!(
        reused,
        out.shared_positions() + padding,
        "per distinct row: {:?}",
        out.shared_lens
    );
}
