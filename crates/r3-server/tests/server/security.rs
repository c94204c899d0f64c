//! Who may call the server (over the fake engine): bearer keys at two levels as SGLang has
//! them, cross-site requests refused (Origin, Host), JSON-only POST bodies, and weight
//! updates only from directories under the weights root with one refusal message.

use std::path::PathBuf;

use r3_server::{build_app, SecurityConfig, ServerConfig};
use serde_json::json;

use crate::fake::FakeEngine;
use crate::support::{request_with, scratch_dir, Reply, TestServer};

const API_KEY: &str = "user-secret";
const ADMIN_KEY: &str = "admin-secret";
const GENERATE: &[u8] = br#"{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}"#;

fn server(security: SecurityConfig, weights_root: Option<PathBuf>) -> TestServer {
    let config = ServerConfig {
        model_name: "fake".into(),
        security,
        weights_root,
        ..ServerConfig::default()
    };
    TestServer::start(build_app(FakeEngine::new(0), None, config).expect("app builds"))
}

fn keyed() -> TestServer {
    server(
        SecurityConfig {
            api_key: Some(API_KEY.into()),
            admin_api_key: Some(ADMIN_KEY.into()),
            ..SecurityConfig::default()
        },
        None,
    )
}

fn post(s: &TestServer, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    request_with(s.addr, "POST", path, headers, body)
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

#[test]
fn missing_or_wrong_bearer_is_refused_and_the_right_one_accepted() {
    let s = keyed();
    let wrong = bearer("nope");
    let admin = bearer(ADMIN_KEY);
    for headers in [
        vec![JSON],
        vec![JSON, ("Authorization", wrong.as_str())],
        vec![JSON, ("Authorization", API_KEY)],
        // The admin key does not open user endpoints (SGLang's rule).
        vec![JSON, ("Authorization", admin.as_str())],
    ] {
        let r = post(&s, "/generate", &headers, GENERATE);
        assert_eq!(r.status, 401, "{headers:?}: {}", r.text);
        let r = request_with(s.addr, "GET", "/get_server_info", &headers, b"");
        assert_eq!(r.status, 401, "{headers:?}: {}", r.text);
    }
    let good = bearer(API_KEY);
    let r = post(
        &s,
        "/generate",
        &[JSON, ("Authorization", good.as_str())],
        GENERATE,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    // Scheme names are case-insensitive.
    let lower = format!("bearer {API_KEY}");
    let r = request_with(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", lower.as_str())],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.text);
    // Liveness probes need no key.
    assert_eq!(request_with(s.addr, "GET", "/health", &[], b"").status, 200);
}

#[test]
fn control_endpoints_need_the_admin_key() {
    let s = keyed();
    let user = bearer(API_KEY);
    let admin = bearer(ADMIN_KEY);
    let dir = crate::support::fixture("qwen3_moe_tiny");
    let update = json!({ "model_path": dir }).to_string();
    let calls: [(&str, &[u8]); 5] = [
        ("/update_weights_from_disk", update.as_bytes()),
        ("/abort_request", br#"{"abort_all": true}"#),
        ("/pause_generation", br#"{"mode": "in_place"}"#),
        ("/continue_generation", b""),
        ("/flush_cache", b""),
    ];
    for (path, body) in calls {
        let r = post(&s, path, &[JSON, ("Authorization", user.as_str())], body);
        assert_eq!(r.status, 401, "{path} with the user key: {}", r.text);
        let r = post(&s, path, &[JSON], body);
        assert_eq!(r.status, 401, "{path} without a key: {}", r.text);
        let r = post(&s, path, &[JSON, ("Authorization", admin.as_str())], body);
        assert_eq!(r.status, 200, "{path} with the admin key: {}", r.text);
    }
    // Without an admin key the user key opens them (SGLang's rule).
    let user_only = server(
        SecurityConfig {
            api_key: Some(API_KEY.into()),
            ..SecurityConfig::default()
        },
        None,
    );
    let r = post(
        &user_only,
        "/flush_cache",
        &[("Authorization", user.as_str())],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.text);
}

#[test]
fn cross_origin_requests_are_refused_unless_listed() {
    let s = server(
        SecurityConfig {
            allowed_origins: vec!["http://localhost:3000".into()],
            ..SecurityConfig::default()
        },
        None,
    );
    // What a page on another site makes a browser send: a "simple" text/plain POST.
    let evil = ("Origin", "http://evil.example");
    let r = post(
        &s,
        "/abort_request",
        &[evil, ("Content-Type", "text/plain")],
        br#"{"abort_all": true}"#,
    );
    assert_eq!(r.status, 403, "{}", r.text);
    let r = post(&s, "/generate", &[evil, JSON], GENERATE);
    assert_eq!(r.status, 403, "{}", r.text);
    let r = post(
        &s,
        "/generate",
        &[("Origin", "http://localhost:3000"), JSON],
        GENERATE,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    // Non-browser clients send no Origin and are served.
    assert_eq!(post(&s, "/generate", &[JSON], GENERATE).status, 200);
}

#[test]
fn dns_rebinding_hosts_are_refused() {
    let s = server(
        SecurityConfig {
            allowed_hosts: vec!["rollout.internal".into()],
            ..SecurityConfig::default()
        },
        None,
    );
    let port = s.addr.port();
    let evil = format!("attacker.example:{port}");
    let r = post(&s, "/generate", &[("Host", evil.as_str()), JSON], GENERATE);
    assert_eq!(r.status, 403, "{}", r.text);
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("rollout.internal:{port}"),
    ] {
        let r = post(&s, "/generate", &[("Host", host.as_str()), JSON], GENERATE);
        assert_eq!(r.status, 200, "{host}: {}", r.text);
    }
}

#[test]
fn post_bodies_must_be_json() {
    let s = server(SecurityConfig::default(), None);
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ] {
        let r = post(&s, "/generate", &[("Content-Type", ct)], GENERATE);
        assert_eq!(r.status, 415, "{ct}: {}", r.text);
    }
    let r = post(&s, "/generate", &[], GENERATE);
    assert_eq!(r.status, 415, "no Content-Type: {}", r.text);
    // What openai, requests `json=` and aiohttp `json=` send.
    for ct in ["application/json", "application/json; charset=utf-8"] {
        let r = post(&s, "/generate", &[("Content-Type", ct)], GENERATE);
        assert_eq!(r.status, 200, "{ct}: {}", r.text);
    }
    // A POST without a body (AReaL's `/continue_generation`) needs no Content-Type.
    assert_eq!(post(&s, "/continue_generation", &[], b"").status, 200);
}

#[test]
fn weight_updates_only_under_the_weights_root_with_one_message() {
    let root = scratch_dir("weights-root");
    let inside = root.join("step_1");
    std::fs::create_dir_all(&inside).expect("mkdir");
    let fixture = crate::support::fixture("qwen3_moe_tiny");
    std::fs::copy(
        fixture.join("model.safetensors"),
        inside.join("model.safetensors"),
    )
    .expect("copy weights");
    std::fs::write(root.join("a_file"), b"x").expect("write");
    let escape = root.join("escape");
    #[cfg(unix)]
    std::os::unix::fs::symlink(&fixture, &escape).expect("symlink");
    let s = server(SecurityConfig::default(), Some(root.clone()));
    let mut refused = Vec::new();
    for path in [
        fixture.clone(),
        PathBuf::from("/etc"),
        root.join("no_such_dir"),
        root.join("a_file"),
        root.join("step_1/../../"),
        escape,
    ] {
        let r = s.post("/update_weights_from_disk", &json!({ "model_path": path }));
        assert_eq!(r.status, 400, "{}: {}", path.display(), r.text);
        refused.push(r.error_message());
    }
    assert!(
        refused.iter().all(|m| m == &refused[0]),
        "one message for every refused path: {refused:?}"
    );
    assert!(
        !refused[0].contains(&*root.to_string_lossy()),
        "{}",
        refused[0]
    );
    let r = s.post(
        "/update_weights_from_disk",
        &json!({ "model_path": inside }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["weight_version"], "1");
    let _ = std::fs::remove_dir_all(&root);
}
