//! The fleet client against a real r3 server (in-process, 127.0.0.1) and a fake worker
//! that answers with a corrupted copy of the real server's reply: wrong row count, an
//! expert id out of range, a stale weight version, truncated base64, a log-prob for
//! another token, HTTP 500. Each is refused with an error naming the problem; with a good
//! worker beside it the request is retried there and the result equals the good
//! worker's; alone, the bad worker makes the batch fail, never a wrong route table (an HTTP
//! 500 asked twice is the request's fault and the worker stays up).

use std::time::Duration;

use axum::http::StatusCode;
use base64::Engine as _;
use r3_fleet::wire::{decode_reply, generate_body};
use r3_fleet::{Fleet, FleetConfig, FleetError};
use r3_rollout::{Engine, EngineConfig, GenerateRequest, SamplingParams};
use serde_json::{json, Value};

mod common;
#[path = "common/fake.rs"]
mod fake;
use common::{facts, model_dir, Server};

fn request() -> GenerateRequest {
    let sampling = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 8,
        stop_token_ids: vec![2],
        seed: 11,
        ..SamplingParams::default()
    };
    GenerateRequest::new(vec![1, 5, 9, 4, 12, 3], sampling)
}

fn fake_server(status: StatusCode, reply: Value) -> Server {
    fake::start(status, reply).0
}

fn fleet(urls: Vec<String>, max_staleness: u64) -> Fleet {
    let cfg = FleetConfig {
        urls,
        max_in_flight: 4,
        request_timeout: Duration::from_secs(30),
        max_retries: 2,
        api_key: None,
        max_staleness,
        partial: r3_fleet::PartialMode::Resume,
        merge: r3_routing::MergePolicy::KeepPerTokenOrigin,
    };
    Fleet::new(cfg, facts()).expect("fleet")
}

/// The real server's reply to [`request`] at weight version 1.
fn genuine_reply(real: &Server) -> Value {
    let f = fleet(vec![real.url.clone()], 0);
    f.sync(&model_dir(), 1).expect("sync real server");
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = r3_fleet::http::JsonClient::new(None);
    client_rt
        .block_on(client.post(
            &format!("{}/generate", real.url),
            &generate_body(&request(), "genuine"),
            Duration::from_secs(30),
        ))
        .expect("genuine reply")
}

fn b64_bytes(reply: &Value) -> Vec<u8> {
    let s = reply["meta_info"]["routed_experts"]
        .as_str()
        .expect("routes");
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

fn with_routes(reply: &Value, bytes: &[u8]) -> Value {
    let mut v = reply.clone();
    v["meta_info"]["routed_experts"] =
        Value::String(base64::engine::general_purpose::STANDARD.encode(bytes));
    v
}

/// Corrupted copies of `good`, each with the words its error must contain.
fn corruptions(good: &Value) -> Vec<(&'static str, Value, &'static str)> {
    let f = facts();
    let row = f.layout.num_hidden_layers() * f.top_k * 4;
    let bytes = b64_bytes(good);
    let mut out = Vec::new();
    out.push((
        "one row short",
        with_routes(good, &bytes[..bytes.len() - row]),
        "rows",
    ));
    let mut big = bytes.clone();
    big[..4].copy_from_slice(&(f.num_experts as i32).to_le_bytes());
    out.push((
        "expert id out of range",
        with_routes(good, &big),
        "routed_experts",
    ));
    let mut truncated = good.clone();
    let s = good["meta_info"]["routed_experts"]
        .as_str()
        .expect("routes");
    truncated["meta_info"]["routed_experts"] = Value::String(s[..s.len() - 3].to_string());
    out.push(("truncated base64", truncated, "routed_experts"));
    let mut lp = good.clone();
    lp["meta_info"]["output_token_logprobs"][0][1] = json!(22);
    if good["output_ids"][0] == json!(22) {
        lp["meta_info"]["output_token_logprobs"][0][1] = json!(21);
    }
    out.push(("log-prob of another token", lp, "output_token_logprobs[0]"));
    let mut stale = good.clone();
    stale["meta_info"]["weight_version"] = json!("0");
    out.push(("stale weight version", stale, "weight version 0"));
    let mut vocab = good.clone();
    vocab["output_ids"][0] = json!(f.vocab_size);
    out.push(("token id out of the vocabulary", vocab, "output_ids[0]"));
    out
}

#[test]
fn the_genuine_reply_decodes_to_the_engines_routes() {
    let real = Server::real();
    let good = genuine_reply(&real);
    let reply = decode_reply("real", &good, &request(), &facts()).expect("decode");
    let r = &reply.result;
    assert_eq!(reply.version, 1);
    let table = r.routes.as_ref().expect("routes");
    assert_eq!(
        table.num_tokens(),
        request().input_ids.len() + r.output_ids.len() - 1
    );
    assert_eq!(r.output_logprobs.len(), r.output_ids.len());
    // The same request to the in-process engine gives the same tokens and routes.
    let mut engine = Engine::from_dir(&model_dir(), EngineConfig::default()).expect("engine");
    let want = engine.generate(vec![request()]).expect("engine").remove(0);
    assert_eq!(want.output_ids, r.output_ids);
    let want_routes = want.routes.expect("engine routes");
    for t in 0..table.num_tokens() {
        for c in 0..table.num_columns() {
            assert_eq!(
                want_routes.experts(t, c),
                table.experts(t, c),
                "row {t} col {c}"
            );
        }
    }
}

#[test]
fn every_corrupted_reply_is_refused_with_a_reason() {
    let real = Server::real();
    let good = genuine_reply(&real);
    for (what, bad, words) in corruptions(&good) {
        let err = match decode_reply("fake", &bad, &request(), &facts()) {
            Ok(r) if what == "stale weight version" => {
                // Decoding is fine; the fleet's version check refuses it (below).
                assert_eq!(r.version, 0);
                continue;
            }
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(words), "{what}: {err}");
    }
}

#[test]
fn a_bad_worker_is_retried_on_a_good_one_and_alone_fails_the_batch() {
    let real = Server::real();
    let good = genuine_reply(&real);
    let mut cases = corruptions(&good);
    cases.push((
        "HTTP 500",
        json!({"error": {"message": "boom"}}),
        "HTTP 500",
    ));
    for (what, bad, words) in cases {
        let status = if what == "HTTP 500" {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::OK
        };
        let fake = fake_server(status, bad);
        // Fake first: ties in load go to the lowest index, so it gets the first attempt.
        let f = fleet(vec![fake.url.clone(), real.url.clone()], 0);
        f.sync(&model_dir(), 1).expect("sync");
        let (results, stats) = f.generate(vec![request()]).expect(what);
        assert_eq!(results.len(), 1, "{what}");
        assert_eq!(stats.retries, 1, "{what}");
        assert_eq!(stats.workers_up, 1, "{what}: the bad worker is out");
        let want = decode_reply("real", &good, &request(), &facts()).expect("good");
        assert_eq!(results[0].output_ids, want.result.output_ids, "{what}");
        assert_eq!(results[0].routes, want.result.routes, "{what}");

        let alone = fleet(vec![fake.url.clone()], 0);
        alone.sync(&model_dir(), 1).expect("sync");
        let err = alone.generate(vec![request()]).expect_err(what);
        let text = err.to_string();
        let FleetError::Batch(batch) = err else {
            panic!("{what}: not a batch error: {text}");
        };
        assert!(batch.results[0].is_none(), "{what}");
        // An HTTP error from the only worker is asked again rather than taking it out; the
        // same answer twice is the request's fault and the worker stays up. A reply failing
        // a check (the worker's bug more likely) or a stale one takes it out: nothing is left.
        if what != "HTTP 500" {
            assert!(
                matches!(
                    batch.failures[..],
                    [(
                        0,
                        FleetError::NoWorkers { .. } | FleetError::RetriesExhausted { .. }
                    )]
                ),
                "{what}: {text}"
            );
        } else {
            assert!(
                matches!(batch.failures[..], [(0, FleetError::RequestFailed { .. })]),
                "{what}: {text}"
            );
            assert_eq!(batch.stats.retries, 1, "{what}: asked twice");
            assert_eq!(alone.workers_up(), 1, "{what}: the only worker stays up");
        }
        assert!(text.contains(words), "{what}: {text}");
    }
}

/// The only worker answers a 5xx once, then the request's reply: asked again rather than
/// taken out, it serves the request (before, the batch failed with no worker left).
#[test]
fn the_only_worker_is_asked_again_after_a_5xx() {
    let real = Server::real();
    let good = genuine_reply(&real);
    let (server, fake) = fake::start(StatusCode::OK, good.clone());
    fake.answer_once(
        StatusCode::INTERNAL_SERVER_ERROR,
        json!({"error": {"message": "boom"}}),
    );
    let alone = fleet(vec![server.url.clone()], 0);
    alone.sync(&model_dir(), 1).expect("sync");
    let (results, stats) = alone
        .generate(vec![request()])
        .expect("served on the second try");
    assert_eq!((stats.retries, stats.workers_up), (1, 1), "{stats:?}");
    let want = decode_reply("real", &good, &request(), &facts()).expect("good");
    assert_eq!(results[0].output_ids, want.result.output_ids);
    assert_eq!(results[0].routes, want.result.routes);
}

/// A reply that passes every check of its own but cannot complete the request: marked
/// `abort` after its last token (so nothing is left to generate) with one route row short.
/// It counts as that worker's bad reply: the request is retried, from its prompt, on the
/// good worker, and the batch keeps going.
#[test]
fn pieces_that_cannot_be_merged_are_a_bad_reply_retried_elsewhere() {
    let real = Server::real();
    let good = genuine_reply(&real);
    let f = facts();
    let row = f.layout.num_hidden_layers() * f.top_k * 4;
    let bytes = b64_bytes(&good);
    let mut short = with_routes(&good, &bytes[..bytes.len() - row]);
    short["meta_info"]["finish_reason"] = json!({"type": "abort", "message": "cut"});
    let fake = fake_server(StatusCode::OK, short);
    let fleet = fleet(vec![fake.url.clone(), real.url.clone()], 0);
    fleet.sync(&model_dir(), 1).expect("sync");
    let (results, stats) = fleet
        .generate(vec![request()])
        .expect("retried on the good worker");
    assert_eq!((stats.retries, stats.workers_up), (1, 1), "{stats:?}");
    let want = decode_reply("real", &good, &request(), &facts()).expect("good");
    assert_eq!(results[0].output_ids, want.result.output_ids);
    assert_eq!(results[0].routes, want.result.routes);
    let down = fleet.pool().down_summary();
    assert!(down.contains("routes end at position"), "{down}");
}

#[test]
fn a_reply_within_max_staleness_is_accepted_and_counted() {
    let real = Server::real();
    let good = genuine_reply(&real);
    let mut old = good.clone();
    old["meta_info"]["weight_version"] = json!("1");
    let fake = fake_server(StatusCode::OK, old);
    let f = fleet(vec![fake.url.clone()], 1);
    f.sync(&model_dir(), 2).expect("sync");
    let (results, stats) = f.generate(vec![request(), request()]).expect("stale ok");
    assert_eq!(results.len(), 2);
    assert_eq!((stats.stale, stats.retries), (2, 0));
    assert_eq!(stats.stale_frac(), 1.0);
    let table = results[0].routes.as_ref().expect("routes");
    assert!(
        table.versions().is_some_and(|v| v.iter().all(|&x| x == 1)),
        "rows keep their version"
    );
}

#[test]
fn no_reachable_worker_is_one_clear_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let f = fleet(vec![format!("http://127.0.0.1:{port}")], 0);
    let err = f.sync(&model_dir(), 1).expect_err("nothing listens");
    let text = err.to_string();
    assert!(matches!(err, FleetError::NoWorkers { .. }), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
}
