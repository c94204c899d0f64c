//! Safe weight updates over the real engine and the tiny HF checkpoint: a FIFO named
//! `model.safetensors` is refused at once and never blocks generation, a NaN tensor is
//! refused with its name, a file whose size disagrees with its header is refused, and
//! `abort_all_requests` aborts only once the new weights are in place.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{Device, Tensor};
use r3_rollout::{Dtype, Engine, EngineConfig};
use r3_server::{build_app, ServerConfig};
use serde_json::json;

use crate::support::{fixture, scratch_dir, TestServer};

const MODEL: &str = "qwen3_moe_tiny";

fn server(root: &Path) -> TestServer {
    let cfg = EngineConfig {
        dtype: Dtype::F32,
        kv_cache_bytes: 32 << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::from_dir(&fixture(MODEL), cfg).expect("engine loads the fixture");
    let config = ServerConfig {
        weights_root: Some(root.to_path_buf()),
        ..ServerConfig::default()
    };
    TestServer::start(build_app(engine, None, config).expect("app builds"))
}

/// A copy of the fixture's config in `dir` (weights written by the caller).
fn model_dir(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(fixture(MODEL).join("config.json"), dir.join("config.json")).expect("copy");
    dir
}

fn fixture_tensors() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(MODEL).join("model.safetensors"), &Device::Cpu)
        .expect("fixture weights")
}

/// A checkpoint equal to the fixture but for `name`, whose value at flat index 1 is NaN.
fn nan_dir(root: &Path, name: &str) -> PathBuf {
    let dir = model_dir(root, "nan");
    let mut tensors = fixture_tensors();
    let t = tensors.get(name).expect("tensor exists");
    let mut values = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 values");
    values[1] = f32::NAN;
    let bad = Tensor::from_vec(values, t.dims(), &Device::Cpu).expect("tensor");
    tensors.insert(name.to_string(), bad);
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    dir
}

fn generate(s: &TestServer, max_new: usize) -> crate::support::Reply {
    s.post(
        "/generate",
        &json!({"input_ids": [3, 4, 5],
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": true,
                                    "temperature": 0.0}}),
    )
}

#[cfg(unix)]
#[test]
fn a_fifo_weight_file_is_refused_and_generation_goes_on() {
    let root = scratch_dir("fifo-weights");
    let dir = model_dir(&root, "fifo");
    let status = std::process::Command::new("mkfifo")
        .arg(dir.join("model.safetensors"))
        .status()
        .expect("run mkfifo");
    assert!(status.success());
    let s = server(&root);
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = s.addr;
    let body = json!({ "model_path": dir }).to_string();
    std::thread::spawn(move || {
        let r = crate::support::request(addr, "POST", "/update_weights_from_disk", body.as_bytes());
        let _ = tx.send(r);
    });
    let r = generate(&s, 4);
    assert_eq!(r.status, 200, "{}", r.text);
    let update = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the update answers instead of blocking on the FIFO");
    assert_eq!(update.status, 400, "{}", update.text);
    assert!(
        update.error_message().contains("not a regular file"),
        "{}",
        update.text
    );
    assert_eq!(
        generate(&s, 4).body["meta_info"]["weight_version"],
        "default"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_nan_tensor_is_refused_with_its_name() {
    let root = scratch_dir("nan-weights");
    let dir = nan_dir(&root, "model.norm.weight");
    let s = server(&root);
    let before = generate(&s, 6);
    let r = s.post("/update_weights_from_disk", &json!({ "model_path": dir }));
    assert_eq!(r.status, 400, "{}", r.text);
    let msg = r.error_message();
    assert!(
        msg.contains("model.norm.weight") && msg.contains("non-finite"),
        "{msg}"
    );
    // SGLang's failure body, which its clients read, beside r3's error.
    assert_eq!(r.body["success"], false, "{}", r.text);
    assert_eq!(r.body["message"], msg.as_str());
    assert_eq!(r.body["num_paused_requests"], 0);
    // The old weights keep serving, unchanged.
    let after = generate(&s, 6);
    assert_eq!(after.body["output_ids"], before.body["output_ids"]);
    assert_eq!(after.body["meta_info"]["weight_version"], "default");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_file_whose_size_disagrees_with_its_header_is_refused() {
    let root = scratch_dir("short-weights");
    let dir = model_dir(&root, "short");
    let bytes = std::fs::read(fixture(MODEL).join("model.safetensors")).expect("read");
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() - 4]).expect("write");
    let s = server(&root);
    let r = s.post("/update_weights_from_disk", &json!({ "model_path": dir }));
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error_message().contains("truncated"), "{}", r.text);
    let _ = std::fs::remove_dir_all(&root);
}

/// A request held in flight by a pause: a refused update with `abort_all_requests` leaves it
/// running; an accepted one aborts it after the swap, under the old version label.
#[test]
fn abort_all_requests_aborts_only_after_the_new_weights_are_ready() {
    let root = scratch_dir("abort-order");
    let bad = nan_dir(&root, "lm_head.weight");
    let good = model_dir(&root, "good");
    std::fs::copy(
        fixture(MODEL).join("model.safetensors"),
        good.join("model.safetensors"),
    )
    .expect("copy weights");
    let s = server(&root);
    let paused = s.post("/pause_generation", &json!({"mode": "in_place"}));
    assert_eq!(paused.status, 200, "{}", paused.text);
    let addr = s.addr;
    let waiting = std::thread::spawn(move || {
        let body = json!({"input_ids": [3, 4, 5], "rid": "held",
                          "sampling_params": {"max_new_tokens": 8, "ignore_eos": true}});
        crate::support::request(addr, "POST", "/generate", body.to_string().as_bytes())
    });
    let in_flight = || s.get("/v1/loads").body["loads"][0]["num_total_reqs"].clone();
    for _ in 0..200 {
        if in_flight() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(in_flight(), 1, "the request is held by the pause");
    let r = s.post(
        "/update_weights_from_disk",
        &json!({"model_path": bad, "abort_all_requests": true}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(in_flight(), 1, "a refused update aborts nothing");
    let r = s.post(
        "/update_weights_from_disk",
        &json!({"model_path": good, "abort_all_requests": true, "weight_version": "v2"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let held = waiting.join().expect("client thread");
    assert_eq!(held.status, 200, "{}", held.text);
    assert_eq!(held.body["meta_info"]["finish_reason"]["type"], "abort");
    assert_eq!(held.body["meta_info"]["weight_version"], "default");
    assert_eq!(
        s.get("/get_weight_version").body["weight_version"],
        "v2",
        "visible at the swap"
    );
    assert_eq!(s.raw("POST", "/continue_generation", b"").status, 200);
    assert_eq!(generate(&s, 2).body["meta_info"]["weight_version"], "v2");
    let _ = std::fs::remove_dir_all(&root);
}
