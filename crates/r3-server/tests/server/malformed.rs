//! Every class of bad request gets a 4xx with a JSON message naming the problem, and the
//! server keeps serving: a good request right after each bad one succeeds.

use serde_json::json;

use crate::fake;
use crate::fake_http::fake_server;
use crate::support::{ids, TestServer};

fn good_request_still_works(server: &TestServer, after: &str) {
    let r = server.post(
        "/generate",
        &json!({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "seed": 9}}),
    );
    assert_eq!(r.status, 200, "good request after {after}: {}", r.text);
    assert_eq!(
        ids(&r.body["output_ids"]),
        fake::expected(&[3, 4], 2, &[fake::EOS], 9).0
    );
}

#[test]
fn each_malformed_request_class_gets_a_4xx_and_the_server_keeps_serving() {
    let server = fake_server(0);
    let oversize = format!("{{\"input_ids\": [{}]}}", vec!["1"; 4000].join(","));
    let raw_cases: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        (
            "POST",
            "/generate",
            b"{\"input_ids\": [1, 2".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "POST",
            "/generate",
            b"\xff\xfe{}".to_vec(),
            400,
            "malformed JSON",
        ),
        ("POST", "/generate", b"".to_vec(), 400, "empty"),
        ("POST", "/generate", b"[1, 2]".to_vec(), 400, "JSON object"),
        (
            "POST",
            "/generate",
            oversize.into_bytes(),
            413,
            "larger than 4096 bytes",
        ),
        (
            "GET",
            "/no/such/endpoint",
            Vec::new(),
            404,
            "no such endpoint",
        ),
    ];
    for (method, path, body, status, needle) in raw_cases {
        let r = server.raw(method, path, &body);
        assert_eq!(r.status, status, "{method} {path}: {}", r.text);
        assert!(
            r.error_message().contains(needle),
            "{needle:?} not in {}",
            r.text
        );
        good_request_still_works(&server, needle);
    }
    let json_cases = vec![
        ("/generate", json!({}), 400, "missing input_ids"),
        (
            "/generate",
            json!({"input_ids": "1 2 3"}),
            400,
            "list of token ids",
        ),
        (
            "/generate",
            json!({"input_ids": [1, -2]}),
            400,
            "input_ids[1]",
        ),
        (
            "/generate",
            json!({"input_ids": [1, 2.5]}),
            400,
            "input_ids[1]",
        ),
        (
            "/generate",
            json!({"input_ids": [1, 64]}),
            400,
            "out of the vocabulary",
        ),
        (
            "/generate",
            json!({"input_ids": [[1], [2, 999]]}),
            400,
            "prompt 1",
        ),
        (
            "/generate",
            json!({"input_ids": []}),
            400,
            "input_ids is empty",
        ),
        (
            "/generate",
            json!({"input_ids": [[1], []]}),
            400,
            "input_ids is empty",
        ),
        (
            "/generate",
            json!({"input_ids": vec![1; fake::MAX_POS]}),
            400,
            "max_position_embeddings",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "lora_path": "adapters/a"}),
            400,
            "generate.lora_path",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"temperature": "hot"}}),
            400,
            "sampling_params.temperature: invalid type",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"regex": "a+"}}),
            400,
            "sampling_params.regex",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"temperature": -1.0}}),
            400,
            "temperature",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"top_p": 1.5}}),
            400,
            "top_p",
        ),
        (
            "/generate",
            // 0 is SGLang's prompt-only request (clients.rs); a negative budget is malformed.
            json!({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}),
            400,
            "integer `-1`",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"stop_token_ids": [70]}}),
            400,
            "stop_token_ids",
        ),
        (
            "/generate",
            json!({"input_ids": [[1], [2]], "sampling_params": [{}]}),
            400,
            "1 entries",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "return_logprob": "yes"}),
            400,
            "return_logprob",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "routed_experts_dtype": "float32"}),
            400,
            "routed_experts_dtype",
        ),
        ("/generate", json!({"text": "hello"}), 400, "tokenizer.json"),
        (
            "/generate",
            json!({"text": "hello", "input_ids": [1]}),
            400,
            "not both",
        ),
        (
            "/generate",
            json!({"input_ids": vec![vec![1]; 9]}),
            413,
            "limit is 8",
        ),
        (
            "/generate",
            json!({"input_ids": [[1], [2]], "rid": ["same", "same"]}),
            400,
            "rid",
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 2}),
            400,
            "missing field `prompt`",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "logprobs": 6}),
            400,
            "logprobs=6",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "n": 0}),
            400,
            "n must be",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "n": 9}),
            413,
            "limit is 8",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "suffix": "x"}),
            400,
            "completions.suffix",
        ),
        (
            "/v1/completions",
            json!({"prompt": {"a": 1}}),
            400,
            "prompt must be",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi"}),
            400,
            "tokenizer.json",
        ),
        (
            "/update_weights_from_disk",
            json!({}),
            400,
            "missing field `model_path`",
        ),
        (
            "/update_weights_from_disk",
            json!({"model_path": "/no/such/dir"}),
            400,
            "not a weight directory",
        ),
        (
            "/update_weights_from_disk",
            json!({"model_path": "/tmp", "load_format": "gguf"}),
            400,
            "load_format",
        ),
        ("/abort_request", json!({}), 400, "missing rid"),
    ];
    for (path, body, status, needle) in json_cases {
        let r = server.post(path, &body);
        assert_eq!(r.status, status, "{path} {body}: {}", r.text);
        assert!(
            r.error_message().contains(needle),
            "{path} {body}: {needle:?} not in {}",
            r.text
        );
        good_request_still_works(&server, needle);
    }
    assert_eq!(server.get("/health").status, 200);
}
