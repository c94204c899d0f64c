//! `ignore_eos` over the fleet's wire, against the real r3 server: the flag travels in the
//! `/generate` body, so a worker runs past the stop ids sent (SGLang's
//! `Req._check_token_based_finish` returns at once under `ignore_eos`) and the fleet's
//! result is the in-process engine's; a worker that stops at one anyway is refused.

use std::time::Duration;

use r3_fleet::wire::{decode_reply, generate_body};
use r3_fleet::{Fleet, FleetConfig};
use r3_rollout::{Engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams};

mod common;
use common::{facts, model_dir, Server};

const PROMPT: [u32; 6] = [1, 5, 9, 4, 12, 3];
const NEW: usize = 8;

/// A greedy request of [`NEW`] tokens stopping at `stop`.
fn request(stop: u32, ignore_eos: bool) -> GenerateRequest {
    let sampling = SamplingParams {
        stop_token_ids: vec![stop],
        ignore_eos,
        ..SamplingParams::greedy(NEW)
    };
    GenerateRequest::new(PROMPT.to_vec(), sampling)
}

/// The in-process engine's result for `req`.
fn in_process(req: GenerateRequest) -> r3_rollout::GenerateResult {
    let mut engine = Engine::from_dir(&model_dir(), EngineConfig::default()).expect("engine");
    engine.generate(vec![req]).expect("engine").remove(0)
}

fn fleet(url: &str) -> Fleet {
    let cfg = FleetConfig {
        urls: vec![url.to_string()],
        max_in_flight: 4,
        request_timeout: Duration::from_secs(30),
        max_retries: 0,
        api_key: None,
        max_staleness: 0,
        partial: r3_fleet::PartialMode::Resume,
        merge: r3_routing::MergePolicy::KeepPerTokenOrigin,
    };
    let f = Fleet::new(cfg, facts()).expect("fleet");
    f.sync(&model_dir(), 1).expect("sync");
    f
}

/// The greedy run's second token as an explicit stop id: without `ignore_eos` the worker and
/// the engine stop there; with it both run to the budget with the same tokens. Before, the
/// body carried no `ignore_eos` and the worker stopped where the engine would not.
#[test]
fn ignore_eos_reaches_the_worker_and_agrees_with_the_engine() {
    let free = in_process(GenerateRequest::new(
        PROMPT.to_vec(),
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(NEW)
        },
    ));
    assert_eq!(free.output_ids.len(), NEW);
    let stop = free.output_ids[1];
    let real = Server::real();
    let f = fleet(&real.url);
    let (stopped, _) = f.generate(vec![request(stop, false)]).expect("fleet");
    let want = in_process(request(stop, false));
    assert_eq!(stopped[0].output_ids, want.output_ids);
    assert_eq!(stopped[0].finish, FinishReason::Stop { token: stop });
    let (ran, _) = f.generate(vec![request(stop, true)]).expect("fleet");
    let want = in_process(request(stop, true));
    assert_eq!(want.output_ids, free.output_ids);
    assert_eq!(ran[0].output_ids, want.output_ids);
    assert_eq!(ran[0].finish, FinishReason::Length);
    assert_eq!(want.finish, FinishReason::Length);
    let body = generate_body(&request(stop, true), "r");
    assert_eq!(body["sampling_params"]["ignore_eos"], true);
}

/// A reply that ends in `stop` for a request under `ignore_eos` is a worker fault, whatever
/// its last token: the worker stopped where it was told not to.
#[test]
fn a_stop_finish_under_ignore_eos_is_refused() {
    let free = in_process(GenerateRequest::new(
        PROMPT.to_vec(),
        SamplingParams::greedy(NEW),
    ));
    let stop = free.output_ids[1];
    let reply = serde_json::json!({
        "output_ids": free.output_ids[..2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": stop},
            "prompt_tokens": PROMPT.len(),
            "completion_tokens": 2,
            "weight_version": "1",
            "output_token_logprobs": [[-0.5, free.output_ids[0], null], [-0.5, stop, null]],
        },
    });
    // Without routes: the reply is built by hand.
    let without_routes = |ignore_eos: bool| GenerateRequest {
        return_routes: false,
        ..request(stop, ignore_eos)
    };
    decode_reply("w", &reply, &without_routes(false), &facts()).expect("a requested stop");
    let err = decode_reply("w", &reply, &without_routes(true), &facts())
        .expect_err("stopped under ignore_eos")
        .to_string();
    assert!(err.contains("ignore_eos"), "{err}");
}
