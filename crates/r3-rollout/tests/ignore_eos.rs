//! `ignore_eos` on both engines, as SGLang 0.5.23 reads it
//! (python/sglang/srt/managers/schedule_batch.py, `Req._check_token_based_finish`: `if
//! self.sampling_params.ignore_eos: return False` before any stop id is looked at;
//! sampling/penaltylib/min_new_tokens.py masks `stop_token_ids` and the eos ids whatever the
//! flag says): no stop id ends the request, the client's own included, and `min_new_tokens`
//! still keeps them from being sampled.

mod common;

use common::{model_dir, DEVICE};
use r3_rollout::{
    DeviceEngine, DeviceEngineConfig, Engine, EngineConfig, FinishReason, GenerateRequest,
    GenerateResult, SamplingParams,
};

const MODEL: &str = "qwen3_moe_tiny";
const PROMPT: [u32; 5] = [17, 203, 88, 5, 141];
const NEW: usize = 8;

/// The engines compared: the CPU engine and the device engine.
const ENGINES: [&str; 2] = ["cpu", "device"];

/// One request's result on engine `which` (each run on a fresh engine).
fn run(which: &str, params: &SamplingParams) -> GenerateResult {
    let req = vec![GenerateRequest::new(PROMPT.to_vec(), params.clone())];
    let results = match which {
        "cpu" => Engine::from_dir(
            &model_dir(MODEL),
            EngineConfig {
                prefix_cache: false,
                ..EngineConfig::default()
            },
        )
        .expect("cpu engine")
        .generate(req),
        _ => DeviceEngine::from_dir(
            &model_dir(MODEL),
            DeviceEngineConfig {
                device: DEVICE,
                prefix_cache: false,
                ..DeviceEngineConfig::default()
            },
        )
        .expect("device engine")
        .generate(req),
    };
    results.expect("generates").remove(0)
}

/// A greedy run stopping at the free run's second token ends there without `ignore_eos`;
/// with it, it runs to its budget with the free run's tokens (the stop id is no longer a
/// finish, and nothing else changed). Before, the engines stopped at an explicit stop id
/// under `ignore_eos` (the server merely left the model's eos ids out of the list).
#[test]
fn ignore_eos_runs_past_the_clients_stop_ids() {
    for which in ENGINES {
        let free = run(which, &SamplingParams::greedy(NEW));
        assert_eq!(free.output_ids.len(), NEW, "{which}");
        let stop = free.output_ids[1];
        let end = free.output_ids.iter().position(|&t| t == stop).expect("in") + 1;
        let stopping = SamplingParams {
            stop_token_ids: vec![stop],
            ..SamplingParams::greedy(NEW)
        };
        let r = run(which, &stopping);
        assert_eq!(r.output_ids, free.output_ids[..end], "{which}");
        assert_eq!(r.finish, FinishReason::Stop { token: stop }, "{which}");
        let ignoring = SamplingParams {
            ignore_eos: true,
            ..stopping
        };
        let r = run(which, &ignoring);
        assert_eq!(r.output_ids, free.output_ids, "{which}");
        assert_eq!(r.finish, FinishReason::Length, "{which}");
    }
}

/// Under `ignore_eos` the stop ids are still masked until `min_new_tokens`: with every token
/// of the free greedy run's first four a stop id and a minimum of 4, none of the first four
/// tokens is one of them (the engines sample elsewhere), and the request still runs to its
/// budget.
#[test]
fn ignore_eos_still_masks_stop_ids_until_min_new_tokens() {
    for which in ENGINES {
        let free = run(which, &SamplingParams::greedy(NEW));
        let stops: Vec<u32> = free.output_ids[..4].to_vec();
        let params = SamplingParams {
            stop_token_ids: stops.clone(),
            min_new_tokens: 4,
            ignore_eos: true,
            ..SamplingParams::greedy(NEW)
        };
        let r = run(which, &params);
        assert_eq!(r.output_ids.len(), NEW, "{which}");
        assert_eq!(r.finish, FinishReason::Length, "{which}");
        assert!(
            r.output_ids[..4].iter().all(|t| !stops.contains(t)),
            "{which}: {:?} samples a masked stop id among {stops:?}",
            r.output_ids
        );
    }
}
