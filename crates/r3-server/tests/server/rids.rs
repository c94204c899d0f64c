//! Request ids: a server-made rid (for a request that sends none) is a random UUID v4 in hex,
//! as SGLang's `uuid.uuid4().hex`, so no client rid and no rid of an earlier run of the server
//! names it; and a client rid already in flight is refused, as SGLang's tokenizer manager
//! refuses it ("Duplicate request ID detected").

use std::time::Duration;

use serde_json::{json, Value};

use crate::fake_http::fake_server;
use crate::support::TestServer;

/// Whether `rid` reads as a UUID v4 in 32 lowercase hex digits.
fn is_uuid4_hex(rid: &Value) -> bool {
    let Some(rid) = rid.as_str() else {
        return false;
    };
    rid.len() == 32
        && rid.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && rid.as_bytes()[12] == b'4'
        && matches!(rid.as_bytes()[16], b'8' | b'9' | b'a' | b'b')
}

/// Waits until `n` requests are in flight; false if that never happens.
fn wait_in_flight(server: &TestServer, n: u64) -> bool {
    (0..500).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        server.get("/v1/loads").body["loads"][0]["num_total_reqs"] == n
    })
}

/// The server used to name requests `r3-0`, `r3-1`, …: a client's own `r3-0` then aborted
/// another client's request, and was refused while that request ran.
#[test]
fn a_client_rid_never_names_a_server_made_one() {
    // min_batch 2 holds the lone request in flight until a second one arrives.
    let server = fake_server(2);
    std::thread::scope(|s| {
        let held = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4}}),
            )
        });
        assert!(wait_in_flight(&server, 1), "the request never ran");
        let a = server.post("/abort_request", &json!({"rid": "r3-0"}));
        assert_eq!(a.status, 200, "{}", a.text);
        assert_eq!(
            a.body["aborted"], 0,
            "the client's r3-0 aborted another request"
        );
        // The client's own r3-0 runs beside it (and releases the held request).
        let own = server.post(
            "/generate",
            &json!({"input_ids": [5, 6], "rid": "r3-0", "sampling_params": {"max_new_tokens": 4}}),
        );
        assert_eq!(own.status, 200, "{}", own.text);
        assert_eq!(own.body["meta_info"]["id"], "r3-0");
        let held = held.join().expect("client thread");
        assert_eq!(held.status, 200, "{}", held.text);
        assert_eq!(held.body["meta_info"]["finish_reason"]["type"], "length");
        let rid = &held.body["meta_info"]["id"];
        assert!(is_uuid4_hex(rid), "server-made rid {rid}");
    });
}

/// A restarted server must not hand out the rids of its earlier run (a client may still hold
/// them); nor may two requests, or two answers' OpenAI ids, share one.
#[test]
fn server_made_rids_differ_across_requests_and_restarts() {
    let mut rids = Vec::new();
    let mut answer_ids = Vec::new();
    for _run in 0..2 {
        let server = fake_server(0);
        for _ in 0..3 {
            let r = server.post(
                "/generate",
                &json!({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}),
            );
            assert_eq!(r.status, 200, "{}", r.text);
            rids.push(r.body["meta_info"]["id"].clone());
            let c = server.post(
                "/v1/completions",
                &json!({"prompt": [3, 4], "max_tokens": 2}),
            );
            assert_eq!(c.status, 200, "{}", c.text);
            answer_ids.push(c.body["id"].clone());
        }
    }
    for rid in &rids {
        assert!(is_uuid4_hex(rid), "server-made rid {rid}");
    }
    for id in &answer_ids {
        let hex = id.as_str().and_then(|s| s.strip_prefix("cmpl-"));
        assert!(
            hex.is_some_and(|h| is_uuid4_hex(&json!(h))),
            "answer id {id}"
        );
    }
    let all: std::collections::HashSet<String> = rids
        .iter()
        .chain(&answer_ids)
        .map(|v| v.to_string())
        .collect();
    assert_eq!(
        all.len(),
        rids.len() + answer_ids.len(),
        "a rid repeats: {rids:?} {answer_ids:?}"
    );
}

/// SGLang's tokenizer manager refuses a request whose rid is already in flight ("Duplicate
/// request ID detected", a 400); the running request is untouched.
#[test]
fn a_rid_in_flight_is_refused() {
    let server = fake_server(2);
    std::thread::scope(|s| {
        let first = s.spawn(|| {
            server.post(
                "/generate",
                &json!({"input_ids": [3, 4], "rid": "dup", "sampling_params": {"max_new_tokens": 20}}),
            )
        });
        assert!(wait_in_flight(&server, 1), "the request never ran");
        let again = server.post(
            "/generate",
            &json!({"input_ids": [5, 6], "rid": "dup", "sampling_params": {"max_new_tokens": 2}}),
        );
        assert_eq!(again.status, 400, "{}", again.text);
        assert!(again.text.contains("already in flight"), "{}", again.text);
        let a = server.post("/abort_request", &json!({"rid": "dup"}));
        assert_eq!(a.body["aborted"], 1, "{}", a.text);
        let first = first.join().expect("client thread");
        assert_eq!(first.status, 200, "{}", first.text);
        assert_eq!(first.body["meta_info"]["id"], "dup");
        assert_eq!(first.body["meta_info"]["finish_reason"]["type"], "abort");
    });
}
