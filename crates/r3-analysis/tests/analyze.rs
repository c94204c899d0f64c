//! The mismatch analysis end to end on the tiny HF-oracle Qwen3-MoE checkpoint: R3 replays the
//! rollout routes exactly, its k3 KL is at most the native one, every summary number the tests can
//! recompute from the raw per-token log-probs (samples.jsonl) agrees, every field is present
//! and every figure listed as written is a PNG.

use std::path::{Path, PathBuf};

use r3_analysis::mismatch::{run_analysis, AnalysisSummary, AnalyzeOptions, SUMMARY_JSON};
use r3_analysis::AnalysisError;
use r3_test_support::Scratch;
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_tiny")
}

/// The options the tests use: 6 prompts of up to 10 new tokens, 4 sequences per call, seed 5.
fn options(out: &Path) -> AnalyzeOptions {
    AnalyzeOptions {
        model: fixture(),
        dense_model: None,
        prompts: 6,
        level: 3,
        max_new_tokens: 10,
        temperature: 1.0,
        micro_batch: 4,
        max_tokens_per_micro_batch: 0,
        seed: 5,
        rollout_dtype: r3_rollout::Dtype::F16,
        rollout_router_dtype: r3_rollout::RouterDtype::Model,
        train_precision: r3_model::Precision::F32,
        rollout_device: r3_rollout::RolloutDevice::Cpu,
        train_device: r3_model::DeviceSpec::Cpu,
        out: out.to_path_buf(),
        command: "analyze test".into(),
    }
}

fn analyze(opts: &AnalyzeOptions) -> Result<AnalysisSummary, AnalysisError> {
    run_analysis(opts)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("parse json")
}

fn f(v: &Value, pointer: &str) -> f64 {
    v.pointer(pointer)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{pointer} is not a number"))
}

fn u(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{pointer} is not an unsigned integer"))
}

/// k3 KL and F(2) computed here from raw log-probs, independently of r3-routing.
fn k3_and_f2(train: &[f64], rollout: &[f64]) -> (f64, f64) {
    let n = train.len() as f64;
    let mut k3 = 0.0;
    let mut extreme = 0.0;
    for (t, r) in train.iter().zip(rollout) {
        let ratio = (t - r).exp();
        k3 += ratio - 1.0 - (t - r);
        if ratio.max(1.0 / ratio) > 2.0 {
            extreme += 1.0;
        }
    }
    (k3 / n, extreme / n)
}

fn column(samples: &[Value], key: &str) -> Vec<f64> {
    samples
        .iter()
        .flat_map(|s| {
            s[key]
                .as_array()
                .unwrap_or_else(|| panic!("{key} missing"))
                .iter()
                .map(|x| x.as_f64().expect("number"))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn analyze_tiny_moe_end_to_end() {
    let out = Scratch::new("analyze-e2e");
    let summary = analyze(&options(&out)).expect("analysis");
    let s = read_json(&out.join(SUMMARY_JSON));
    assert_eq!(
        s["moe"]["native"]["metrics"]["k3_kl"].as_f64(),
        Some(summary.moe.native.metrics.k3_kl),
        "summary.json holds the returned summary"
    );

    // Every section and field the schema promises.
    for pointer in [
        "/version",
        "/command",
        "/seed",
        "/model/num_experts",
        "/model/top_k",
        "/model/moe_layers",
        "/prompts/kind",
        "/rollout/dtype",
        "/rollout/samples",
        "/rollout/response_tokens",
        "/training_engine",
        "/moe/native/metrics/k3_kl",
        "/moe/native/metrics/extreme_frac_tau2",
        "/moe/native/metrics/prob_diff_mean",
        "/moe/native/f_tau",
        "/moe/native/bitwise_identical",
        "/moe/r3/metrics/k3_kl",
        "/moe/r3/f_tau",
        "/moe/k3_kl_reduction_factor",
        "/moe/routing_divergence/summary/router_diff_fraction",
        "/moe/routing_divergence/summary/token_diff_fraction",
        "/moe/routing_divergence/summary/mean_seq_diff_layers_per_token",
        "/moe/routing_divergence/router_level",
        "/moe/routing_divergence/token_level",
        "/moe/routing_divergence/per_sequence_mean",
        "/moe/routing_divergence/per_sequence_histogram/edges",
        "/moe/routing_divergence/per_layer",
        "/moe/r3_routing/differing_routers",
        "/dense/source/kind",
        "/dense/native/metrics/k3_kl",
        "/dense/response_tokens",
        "/repeat_identical/mismatch/bitwise_identical",
        "/repeat_identical/description",
        "/repeat_rebatched/mismatch/metrics/k3_kl",
        "/repeat_rebatched/routing_divergence/summary/router_diff_fraction",
        "/paper/k3_kl_moe",
        "/figures",
        "/timings/rollout_s",
    ] {
        assert!(s.pointer(pointer).is_some(), "summary.json lacks {pointer}");
    }
    assert_eq!(
        s["prompts"]["kind"], "random_tokens",
        "the oracle model has no r3 tokenizer"
    );
    assert_eq!(s["rollout"]["dtype"], "f16");
    assert_eq!(s["dense"]["source"]["kind"], "random_init");

    // R3 replays exactly the rollout routes, for every router they cover.
    let routers = u(&s, "/moe/r3_routing/rollout_routers");
    assert!(routers > 0);
    assert_eq!(u(&s, "/moe/r3_routing/differing_routers"), 0);
    assert_eq!(u(&s, "/moe/r3_routing/totals/replayed_cells"), routers);
    assert_eq!(s["moe"]["r3_routing"]["all_replayed"], true);
    // Routers: rows (prompt + output - 1 per sample) x MoE layers.
    let layers = s["model"]["moe_layers"].as_array().expect("layers").len() as u64;
    // Scoring feeds prompt + output but the last token (which predicts nothing and which
    // the rollout never routed): the rollout's positions, every one replayed.
    assert_eq!(u(&s, "/moe/r3_routing/totals/native_cells"), 0);
    assert_eq!(routers, u(&s, "/rollout/routed_positions") * layers);

    // R3 does not increase the mismatch.
    let native_kl = f(&s, "/moe/native/metrics/k3_kl");
    let r3_kl = f(&s, "/moe/r3/metrics/k3_kl");
    assert!(r3_kl <= native_kl, "R3 k3 KL {r3_kl} > native {native_kl}");

    // The divergence histograms account for every router and every routed position.
    let router_level: Vec<u64> = s["moe"]["routing_divergence"]["router_level"]
        .as_array()
        .expect("router_level")
        .iter()
        .map(|x| x.as_u64().expect("count"))
        .collect();
    assert_eq!(router_level.len() as u64, u(&s, "/model/top_k") + 1);
    assert_eq!(router_level.iter().sum::<u64>(), routers);
    let differing = routers - router_level[0];
    let frac = f(&s, "/moe/routing_divergence/summary/router_diff_fraction");
    assert!((frac - differing as f64 / routers as f64).abs() < 1e-12);
    let token_level: u64 = s["moe"]["routing_divergence"]["token_level"]
        .as_array()
        .expect("token_level")
        .iter()
        .map(|x| x.as_u64().expect("count"))
        .sum();
    assert_eq!(token_level, u(&s, "/rollout/routed_positions"));
    let per_seq = s["moe"]["routing_divergence"]["per_sequence_mean"]
        .as_array()
        .expect("per_sequence_mean");
    assert_eq!(per_seq.len() as u64, u(&s, "/rollout/samples"));

    // Recompute the headline numbers from the raw per-token log-probs.
    let samples: Vec<Value> = std::fs::read_to_string(out.join("samples.jsonl"))
        .expect("samples.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("sample line"))
        .collect();
    assert_eq!(samples.len() as u64, u(&s, "/rollout/samples"));
    let rollout = column(&samples, "rollout_logp");
    let native = column(&samples, "train_native_logp");
    let r3 = column(&samples, "train_r3_logp");
    assert_eq!(rollout.len() as u64, u(&s, "/rollout/response_tokens"));
    let (k3, f2) = k3_and_f2(&native, &rollout);
    assert!(
        (k3 - native_kl).abs() <= 1e-9 + 1e-6 * native_kl,
        "native k3 {k3} vs {native_kl}"
    );
    assert!((f2 - f(&s, "/moe/native/metrics/extreme_frac_tau2")).abs() < 1e-12);
    let (k3, _) = k3_and_f2(&r3, &rollout);
    assert!(
        (k3 - r3_kl).abs() <= 1e-9 + 1e-6 * r3_kl,
        "R3 k3 {k3} vs {r3_kl}"
    );
    // Rollout log-probs are log-probabilities; sampled tokens are never impossible.
    assert!(rollout.iter().all(|&l| l <= 0.0 && l.is_finite()));

    // Every figure listed as written is a PNG on disk; the core ones are written.
    let figures = s["figures"].as_object().expect("figures");
    for key in [
        "fig2a_moe_native",
        "fig2b_moe_r3",
        "fig2c_dense",
        "fig3a_router_level",
        "fig3b_token_level",
        "fig3c_sequence_level",
        "fig4_two_passes",
    ] {
        assert!(
            figures[key].get("written").is_some(),
            "{key}: {:?}",
            figures[key]
        );
    }
    for (key, status) in figures {
        if let Some(file) = status.get("written").and_then(Value::as_str) {
            let bytes =
                std::fs::read(out.join(file)).unwrap_or_else(|_| panic!("{key}: {file} missing"));
            assert!(
                bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
                "{key}: {file} is not a PNG"
            );
        } else {
            assert!(
                status.get("skipped").is_some(),
                "{key}: neither written nor skipped"
            );
        }
    }
    let md = std::fs::read_to_string(out.join("summary.md")).expect("summary.md");
    assert!(md.contains("k3 KL, MoE + R3"));
    // The direction the estimator measures, and the temperature it compares at.
    assert!(
        md.contains("k3 KL estimates KL(π_rollout ‖ π_train)"),
        "{md}"
    );
    assert!(md.contains("raw temperature-1 distributions"), "{md}");

    // Same seed, same numbers.
    let again = Scratch::new("analyze-e2e-again");
    analyze(&options(&again)).expect("second analysis");
    let s2 = read_json(&again.join(SUMMARY_JSON));
    assert_eq!(
        s["moe"]["native"]["metrics"],
        s2["moe"]["native"]["metrics"]
    );
    assert_eq!(
        s["moe"]["routing_divergence"]["router_level"],
        s2["moe"]["routing_divergence"]["router_level"]
    );
}

#[test]
fn analyze_rejects_bad_input_naming_it() {
    let out = Scratch::new("analyze-bad");
    let no_prompts = AnalyzeOptions {
        prompts: 0,
        ..options(&out)
    };
    let err = analyze(&no_prompts).expect_err("0 prompts").to_string();
    assert!(err.contains("--prompts must be at least 1"), "error: {err}");

    let missing = AnalyzeOptions {
        model: out.join("nowhere"),
        ..options(&out)
    };
    let err = analyze(&missing).expect_err("missing model").to_string();
    assert!(err.contains("config.json"), "error: {err}");

    let dense_as_moe = AnalyzeOptions {
        dense_model: Some(fixture()),
        ..options(&out)
    };
    let err = analyze(&dense_as_moe)
        .expect_err("MoE as dense")
        .to_string();
    assert!(err.contains("is an MoE model"), "error: {err}");
}

/// Every number of two summaries, leaf by leaf: integers, booleans and strings equal,
/// floats within `tol` (absolute); `skip` names keys not compared (timings, the command,
/// the device names).
fn assert_close(a: &Value, b: &Value, path: &str, tol: f64, skip: &[&str]) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys.into_iter().filter(|k| !skip.contains(&k.as_str())) {
                let (va, vb) = (&x[k.as_str()], &y[k.as_str()]);
                assert_close(va, vb, &format!("{path}/{k}"), tol, skip);
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{path}: lengths");
            for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                assert_close(va, vb, &format!("{path}/{i}"), tol, skip);
            }
        }
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            assert!((x - y).abs() <= tol, "{path}: {x} vs {y} (tolerance {tol})");
        }
        _ => assert_eq!(a, b, "{path}"),
    }
}

/// `--device cpu-candle` against the CPU engine, both in f32 (the precision in which the two
/// engines compute the same function; in f16 / bf16 they round at different points by
/// design): the same sampled tokens and routes, rollout log-probs within 1e-5, so the
/// training passes (on the CPU both times) are bit for bit the same and every summary number
/// agrees within 1e-5.
#[test]
fn analyze_on_the_device_engine_equals_the_cpu_engine_in_f32() {
    let scratch = Scratch::new("analyze-device");
    let run = |device: &str| {
        let out = scratch.path().join(device);
        let opts = AnalyzeOptions {
            rollout_dtype: r3_rollout::Dtype::F32,
            rollout_device: device.parse().expect("device"),
            ..options(&out)
        };
        analyze(&opts).expect("analysis");
        let summary = read_json(&out.join(SUMMARY_JSON));
        let samples: Vec<Value> = std::fs::read_to_string(out.join("samples.jsonl"))
            .expect("samples")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json line"))
            .collect();
        (summary, samples)
    };
    let (cpu, cpu_samples) = run("cpu");
    let (dev, dev_samples) = run("cpu-candle");
    assert_eq!(dev["rollout"]["device"], "cpu-candle");
    assert_eq!(cpu_samples.len(), dev_samples.len());
    let mut worst = 0.0f64;
    for (c, d) in cpu_samples.iter().zip(&dev_samples) {
        assert_eq!(c["prompt"], d["prompt"]);
        assert_eq!(c["output"], d["output"], "sampled tokens");
        for key in ["train_native_logp", "train_r3_logp"] {
            assert_eq!(
                c[key], d[key],
                "{key}: the same tokens and routes on the CPU trainer"
            );
        }
        for (x, y) in column(std::slice::from_ref(c), "rollout_logp")
            .into_iter()
            .zip(column(std::slice::from_ref(d), "rollout_logp"))
        {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst <= 1e-5, "rollout log-probs differ by {worst}");
    // Routes: the divergence sections compare the rollout routes with the training pass's,
    // so equal integers there (cells, tokens, per layer) are equal rollout routes. The count
    // of log-probs bitwise different from the rollout's is not compared: the two engines'
    // f32 sums round apart in the last bits, which is what the 1e-5 allows.
    assert_close(
        &cpu,
        &dev,
        "",
        1e-5,
        &[
            "timings",
            "command",
            "device",
            "figures",
            "differing_tokens",
            "bitwise_identical",
        ],
    );
    // The training passes compared with each other do not involve the rollout engine.
    for key in ["repeat_identical", "repeat_rebatched"] {
        assert_eq!(cpu[key], dev[key], "{key}");
    }
}

/// A `cuda` rollout or training device in a build (or on a machine) without CUDA is the
/// device error naming what is missing, never a silent CPU run.
#[test]
fn analyze_on_cuda_without_cuda_is_refused() {
    if candle_core::utils::cuda_is_available() {
        return;
    }
    let scratch = Scratch::new("analyze-cuda");
    let rollout = AnalyzeOptions {
        rollout_device: "cuda".parse().expect("device"),
        ..options(scratch.path())
    };
    let err = analyze(&rollout).expect_err("no CUDA in this build");
    assert!(err.to_string().contains("scripts/cuda/build.sh"), "{err}");
    let train = AnalyzeOptions {
        train_device: r3_model::DeviceSpec::Cuda { ordinal: 0 },
        ..options(scratch.path())
    };
    let err = analyze(&train).expect_err("no CUDA in this build");
    assert!(err.to_string().contains("scripts/cuda/build.sh"), "{err}");
    assert!(
        !scratch.path().join(SUMMARY_JSON).exists(),
        "nothing was written"
    );
}
