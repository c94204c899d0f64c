//! Engine behaviour: batching invariance, prefix-cache hits, partial rollouts, weight sync,
//! expert placement and request validation — on the tiny oracle checkpoints in f32.

mod common;

use common::{engine, model_dir, MODELS};
use r3_rollout::{load_dir, Dtype, FinishReason, GenerateRequest, MergePolicy, SamplingParams};
use r3_routing::ExpertPlacement;

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed * 101 + 3) % 250 + 3)
        .collect()
}

fn sampled(seed: u64, n: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        max_new_tokens: n,
        seed,
        ..Default::default()
    }
}

#[test]
fn batched_equals_unbatched_in_f32() {
    for name in MODELS {
        let reqs: Vec<GenerateRequest> = (0..5)
            .map(|i| GenerateRequest::new(prompt(i, 5 + 7 * i as usize), sampled(i as u64, 9)))
            .collect();
        let mut e = engine(name, Dtype::F32, false);
        let batched = e.generate(reqs.clone()).unwrap();
        for (req, b) in reqs.into_iter().zip(&batched) {
            let mut e1 = engine(name, Dtype::F32, false);
            let single = e1.generate(vec![req]).unwrap().remove(0);
            assert_eq!(single.output_ids, b.output_ids, "{name}");
            for (x, y) in single.output_logprobs.iter().zip(&b.output_logprobs) {
                assert!((x - y).abs() < 1e-4, "{name}: logprob {x} vs {y}");
            }
            assert_eq!(single.routes, b.routes, "{name}");
        }
    }
}

#[test]
fn continuous_batching_admits_requests_between_steps() {
    let mut e = engine("qwen3_moe_tiny", Dtype::F32, false);
    let a = e
        .submit(GenerateRequest::new(
            prompt(1, 8),
            SamplingParams::greedy(6),
        ))
        .unwrap();
    e.step().unwrap();
    e.step().unwrap();
    let b = e
        .submit(GenerateRequest::new(
            prompt(2, 8),
            SamplingParams::greedy(6),
        ))
        .unwrap();
    let mut done = Vec::new();
    while e.has_work() {
        done.extend(e.step().unwrap());
    }
    let mut solo = engine("qwen3_moe_tiny", Dtype::F32, false);
    let want = solo
        .generate(vec![
            GenerateRequest::new(prompt(1, 8), SamplingParams::greedy(6)),
            GenerateRequest::new(prompt(2, 8), SamplingParams::greedy(6)),
        ])
        .unwrap();
    let got_a = done.iter().find(|r| r.id == a).unwrap();
    let got_b = done.iter().find(|r| r.id == b).unwrap();
    assert_eq!(got_a.output_ids, want[0].output_ids);
    assert_eq!(got_b.output_ids, want[1].output_ids);
}

#[test]
fn prefix_cache_hit_returns_the_cold_routes_and_logprobs() {
    for name in MODELS {
        let turn1 = prompt(3, 21);
        let mut warm = engine(name, Dtype::F32, true);
        let first = warm
            .generate(vec![GenerateRequest::new(
                turn1.clone(),
                SamplingParams::greedy(12),
            )])
            .unwrap()
            .remove(0);
        assert_eq!(first.cached_tokens, 0);
        // Second turn: the whole first conversation plus new user tokens.
        let mut turn2 = turn1.clone();
        turn2.extend(&first.output_ids);
        turn2.extend(prompt(9, 6));
        let req = GenerateRequest::new(turn2.clone(), SamplingParams::greedy(8));
        let hit = warm.generate(vec![req.clone()]).unwrap().remove(0);
        let full_blocks = (turn1.len() + first.output_ids.len() - 1) / 16 * 16;
        assert_eq!(hit.cached_tokens, full_blocks, "{name}");
        assert!(hit.cached_tokens > 0);
        let mut cold = engine(name, Dtype::F32, false);
        let want = cold.generate(vec![req]).unwrap().remove(0);
        assert_eq!(hit.output_ids, want.output_ids, "{name}");
        for (x, y) in hit.output_logprobs.iter().zip(&want.output_logprobs) {
            assert!((x - y).abs() < 1e-4, "{name}");
        }
        assert_eq!(hit.routes, want.routes, "{name}");
        // The cached rows are the very rows recorded in turn 1.
        let r1 = first.routes.unwrap();
        let r2 = hit.routes.unwrap();
        for t in 0..r1.num_tokens() {
            for c in 0..r1.num_columns() {
                assert_eq!(r1.experts(t, c), r2.experts(t, c));
            }
        }
    }
}

/// The samples of a group, submitted together, prefill their shared prompt once: one of
/// them computes it while the others wait in the queue, then they read its full blocks from
/// the prefix cache (`cached_tokens`), and every sample's tokens and routes equal what an
/// engine without a cache computes for it alone (log-probs within float rounding, as a
/// prefix-cache hit's). A request that asks for prompt log-probs computes its prompt itself.
#[test]
fn a_groups_samples_share_the_prompts_prefill() {
    for name in MODELS {
        let shared = prompt(5, 37);
        let group: Vec<GenerateRequest> = (0..4)
            .map(|j| GenerateRequest::new(shared.clone(), sampled(40 + j, 7)))
            .collect();
        let mut with_logits = GenerateRequest::new(shared.clone(), sampled(50, 3));
        with_logits.sampling.prompt_logprobs_from = Some(0);
        let mut reqs = group.clone();
        reqs.push(with_logits.clone());
        let mut e = engine(name, Dtype::F32, true);
        let ids: Vec<_> = reqs.into_iter().map(|r| e.submit(r).unwrap()).collect();
        let (mut done, mut steps) = (Vec::new(), 0);
        while e.has_work() {
            done.extend(e.step().unwrap());
            steps += 1;
        }
        // One step prefills the prompt, the next the waiting samples' last partial block,
        // then six more decode steps for their seven tokens: the waiting samples did not wait for
        // the first to finish.
        assert!(steps <= 8, "{name}: {steps} steps");
        let got: Vec<_> = ids
            .iter()
            .map(|id| done.iter().find(|r| r.id == *id).unwrap().clone())
            .collect();
        let full_blocks = (shared.len() - 1) / 16 * 16;
        let cached: Vec<usize> = got.iter().map(|r| r.cached_tokens).collect();
        assert_eq!(
            cached,
            vec![0, full_blocks, full_blocks, full_blocks, 0],
            "{name}"
        );
        let stats = e.prefix_cache_stats().expect("cache on");
        assert_eq!(stats.hit_blocks, 3 * (full_blocks / 16) as u64, "{name}");
        for (req, hit) in group.into_iter().chain([with_logits]).zip(&got) {
            let mut cold = engine(name, Dtype::F32, false);
            let want = cold.generate(vec![req]).unwrap().remove(0);
            assert_eq!(hit.output_ids, want.output_ids, "{name}");
            assert_eq!(hit.routes, want.routes, "{name}");
            for (x, y) in hit.output_logprobs.iter().zip(&want.output_logprobs) {
                assert!((x - y).abs() < 1e-4, "{name}: logprob {x} vs {y}");
            }
        }
    }
}

#[test]
fn routed_experts_start_len_returns_rows_from_that_position() {
    let mut e = engine("deepseek_v3_tiny", Dtype::F32, false);
    let p = prompt(4, 10);
    let full = e
        .generate(vec![GenerateRequest::new(
            p.clone(),
            SamplingParams::greedy(5),
        )])
        .unwrap()
        .remove(0);
    let mut req = GenerateRequest::new(p, SamplingParams::greedy(5));
    req.routed_experts_start_len = 7;
    let part = e.generate(vec![req]).unwrap().remove(0);
    let (a, b) = (full.routes.unwrap(), part.routes.unwrap());
    assert_eq!(b.start_pos(), 7);
    assert_eq!(b.num_tokens(), a.num_tokens() - 7);
    assert_eq!(a.slice_rows(7, a.num_tokens()).unwrap(), b);
    assert_eq!(
        a.layers(),
        &[1, 2, 3],
        "deepseek fixture: layer 0 is dense, MoE-only columns keep global ids"
    );
}

#[test]
fn abort_and_resume_continue_the_same_sequence() {
    let name = "qwen3_moe_tiny";
    let p = prompt(5, 12);
    let params = sampled(11, 14);
    let mut e = engine(name, Dtype::F32, true);
    let want = e
        .generate(vec![GenerateRequest::new(p.clone(), params.clone())])
        .unwrap()
        .remove(0);

    let mut e = engine(name, Dtype::F32, true);
    let id = e
        .submit(GenerateRequest::new(p.clone(), params.clone()))
        .unwrap();
    for _ in 0..6 {
        e.step().unwrap();
    }
    let partial = e.abort(id).unwrap().unwrap();
    assert!(!partial.output_ids.is_empty() && partial.output_ids.len() < 14);
    assert!(!e.has_work());
    for policy in [
        MergePolicy::KeepPerTokenOrigin,
        MergePolicy::ReplaceWithResumed,
    ] {
        let rid = e.resume(partial.clone(), policy).unwrap();
        let mut done = Vec::new();
        while e.has_work() {
            done.extend(e.step().unwrap());
        }
        let r = done.into_iter().find(|r| r.id == rid).unwrap();
        assert!(r.cached_tokens > 0, "resume reuses the aborted call's KV");
        assert_eq!(
            r.output_ids, want.output_ids,
            "same weights + carried RNG = same tokens"
        );
        assert_eq!(r.prompt_tokens, p.len());
        assert_eq!(r.output_logprobs.len(), want.output_logprobs.len());
        let routes = r.routes.unwrap();
        assert_eq!(
            routes.num_tokens(),
            p.len() + r.output_ids.len() - 1,
            "no duplicated rows"
        );
        assert_eq!(
            Some(routes),
            want.routes,
            "same weights: both policies give the uninterrupted routes"
        );
    }
}

#[test]
fn weight_update_bumps_version_invalidates_cache_and_changes_outputs() {
    let name = "qwen3_moe_tiny";
    let mut e = engine(name, Dtype::F32, true);
    let p = prompt(6, 40);
    let req = GenerateRequest::new(p.clone(), SamplingParams::greedy(6));
    let before = e.generate(vec![req.clone()]).unwrap().remove(0);
    assert_eq!(e.generate(vec![req.clone()]).unwrap()[0].cached_tokens, 32);
    // New weights: the same checkpoint with the lm_head scaled, as a trainer step would change it.
    let cfg = e.model_config().clone();
    let mut tensors = load_dir(&model_dir(name), &cfg).unwrap();
    let lm = tensors["lm_head.weight"].clone();
    tensors.insert("lm_head.weight".into(), (lm * -1.0).unwrap());
    assert_eq!(e.update_weights(&tensors).unwrap(), 1);
    let after = e.generate(vec![req.clone()]).unwrap().remove(0);
    assert_eq!(
        after.cached_tokens, 0,
        "cache invalidated by the new version"
    );
    assert_eq!(after.weight_version, 1);
    assert_ne!(after.output_ids, before.output_ids);
    assert!(after
        .routes
        .as_ref()
        .unwrap()
        .versions()
        .unwrap()
        .iter()
        .all(|&v| v == 1));
    // Back to the original weights from disk.
    assert_eq!(e.update_weights_from_dir(&model_dir(name)).unwrap(), 2);
    assert_eq!(
        e.generate(vec![req]).unwrap()[0].output_ids,
        before.output_ids
    );
}

#[test]
fn expert_placement_replicas_keep_logical_ids() {
    let name = "qwen3_moe_tiny";
    let req = GenerateRequest::new(prompt(7, 17), sampled(2, 8));
    let mut e = engine(name, Dtype::F32, false);
    let plain = e.generate(vec![req.clone()]).unwrap().remove(0);
    // 12 physical slots for 8 logical experts: experts 0..4 have two replicas.
    let slots: Vec<u32> = (0..8).chain([3, 2, 1, 0]).collect();
    e.set_expert_placement(Some(ExpertPlacement::new(8, slots).unwrap()))
        .unwrap();
    let placed = e.generate(vec![req]).unwrap().remove(0);
    assert_eq!(placed.output_ids, plain.output_ids);
    assert_eq!(
        placed.routes, plain.routes,
        "captured ids are logical, not slots"
    );
    assert!(e
        .set_expert_placement(Some(ExpertPlacement::identity(5)))
        .is_err());
}

#[test]
fn stop_tokens_and_bad_requests() {
    let mut e = engine("qwen3_moe_tiny", Dtype::F32, false);
    let p = prompt(8, 6);
    let free = e
        .generate(vec![GenerateRequest::new(
            p.clone(),
            SamplingParams::greedy(8),
        )])
        .unwrap()
        .remove(0);
    let stop = free.output_ids[2];
    let mut params = SamplingParams::greedy(8);
    params.stop_token_ids = vec![stop];
    let r = e
        .generate(vec![GenerateRequest::new(p.clone(), params)])
        .unwrap()
        .remove(0);
    let first = free.output_ids.iter().position(|&t| t == stop).unwrap();
    assert_eq!(r.output_ids, free.output_ids[..=first]);
    assert_eq!(r.finish, FinishReason::Stop { token: stop });
    assert_eq!(free.finish, FinishReason::Length);

    for (bad, what) in [
        (
            GenerateRequest::new(vec![], SamplingParams::greedy(2)),
            "empty",
        ),
        (
            GenerateRequest::new(vec![1, 999], SamplingParams::greedy(2)),
            "input_ids[1] = 999",
        ),
        (
            GenerateRequest::new(vec![1; 200], SamplingParams::greedy(2)),
            "max_position_embeddings",
        ),
        (
            GenerateRequest::new(
                p.clone(),
                SamplingParams {
                    top_p: 0.0,
                    ..SamplingParams::greedy(2)
                },
            ),
            "top_p",
        ),
    ] {
        let err = e.submit(bad).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
    }
    assert!(!e.has_work(), "rejected requests leave nothing behind");
}

#[test]
fn capture_work_is_timed_only_when_routes_are_captured() {
    let reqs = |capture: bool| -> Vec<GenerateRequest> {
        (0..3)
            .map(|i| GenerateRequest {
                return_routes: capture,
                ..GenerateRequest::new(prompt(i, 6), sampled(i as u64, 5))
            })
            .collect()
    };
    let mut off = engine("qwen3_moe_tiny", Dtype::F32, false);
    let out = off.generate(reqs(false)).unwrap();
    assert!(out.iter().all(|r| r.routes.is_none()));
    assert_eq!(
        off.capture_seconds(),
        0.0,
        "capture off must do no capture work"
    );
    let mut on = engine("qwen3_moe_tiny", Dtype::F32, false);
    let out = on.generate(reqs(true)).unwrap();
    assert!(out.iter().all(|r| r.routes.is_some()));
    assert!(on.capture_seconds() > 0.0);
}

/// The calls the tests below make, on either engine.
trait Calls {
    fn submit(&mut self, req: GenerateRequest) -> Result<u64, r3_rollout::RolloutError>;
    fn step(&mut self) -> Result<Vec<r3_rollout::GenerateResult>, r3_rollout::RolloutError>;
    fn abort(&mut self, id: u64) -> Option<r3_rollout::PartialRollout>;
    fn resume(&mut self, p: r3_rollout::PartialRollout) -> u64 {
        self.try_resume(p, MergePolicy::KeepPerTokenOrigin)
            .expect("resume")
    }
    fn try_resume(
        &mut self,
        p: r3_rollout::PartialRollout,
        policy: MergePolicy,
    ) -> Result<u64, r3_rollout::RolloutError>;
    fn has_work(&self) -> bool;
    /// Steps until no request is left; what finished, in step order.
    fn run_to_end(&mut self) -> Vec<r3_rollout::GenerateResult> {
        let mut done = Vec::new();
        while self.has_work() {
            done.extend(self.step().expect("step"));
        }
        done
    }
    fn generate(
        &mut self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<r3_rollout::GenerateResult>, r3_rollout::RolloutError>;
}

macro_rules! calls_of {
    ($engine:ty) => {
        impl Calls for $engine {
            fn submit(&mut self, req: GenerateRequest) -> Result<u64, r3_rollout::RolloutError> {
                <$engine>::submit(self, req)
            }
            fn step(
                &mut self,
            ) -> Result<Vec<r3_rollout::GenerateResult>, r3_rollout::RolloutError> {
                <$engine>::step(self)
            }
            fn abort(&mut self, id: u64) -> Option<r3_rollout::PartialRollout> {
                <$engine>::abort(self, id).expect("abort")
            }
            fn try_resume(
                &mut self,
                p: r3_rollout::PartialRollout,
                policy: MergePolicy,
            ) -> Result<u64, r3_rollout::RolloutError> {
                <$engine>::resume(self, p, policy)
            }
            fn has_work(&self) -> bool {
                <$engine>::has_work(self)
            }
            fn generate(
                &mut self,
                reqs: Vec<GenerateRequest>,
            ) -> Result<Vec<r3_rollout::GenerateResult>, r3_rollout::RolloutError> {
                <$engine>::generate(self, reqs)
            }
        }
    };
}
calls_of!(r3_rollout::Engine);
calls_of!(r3_rollout::DeviceEngine);

/// Both engines over `name`, each feeding a prefill at most 4 positions a step and without
/// a prefix cache (so a resumed request's prefill takes several steps).
fn both_engines(name: &str) -> Vec<(&'static str, Box<dyn Calls>)> {
    let cpu = r3_rollout::Engine::from_dir(
        &model_dir(name),
        r3_rollout::EngineConfig {
            dtype: Dtype::F32,
            max_batch_tokens: 4,
            max_prefill_tokens: Some(4),
            prefix_cache: false,
            ..r3_rollout::EngineConfig::default()
        },
    )
    .expect("cpu engine");
    let device = r3_rollout::DeviceEngine::from_dir(
        &model_dir(name),
        r3_rollout::DeviceEngineConfig {
            max_prefill_tokens: Some(4),
            prefix_cache: false,
            ..r3_rollout::DeviceEngineConfig::default()
        },
    )
    .expect("device engine");
    vec![("cpu", Box::new(cpu)), ("device", Box::new(device))]
}

/// A resumed request aborted before it samples — waiting, or part way through the prefill
/// of its prompt (the first call's prompt and output) — hands back what the first call
/// made, tokens, log-probs and routes as they were; resumed again it finishes as the
/// uninterrupted request does. On both engines.
#[test]
fn a_resumed_request_aborted_before_it_samples_returns_the_first_calls_partial() {
    let name = "qwen3_moe_tiny";
    let (p, params) = (prompt(5, 12), sampled(11, 14));
    let want = engine(name, Dtype::F32, false)
        .generate(vec![GenerateRequest::new(p.clone(), params.clone())])
        .expect("uninterrupted")
        .remove(0);
    for (which, mut e) in both_engines(name) {
        let id = e
            .submit(GenerateRequest::new(p.clone(), params.clone()))
            .expect("submit");
        for _ in 0..8 {
            e.step().expect("step");
        }
        let first = e.abort(id).expect("running");
        assert!(!first.output_ids.is_empty(), "{which}: tokens made");
        for steps in [0, 2] {
            let rid = e.resume(first.clone());
            // The first call's prompt and output, 18 positions at 4 a step: still
            // prefilling after 2.
            for _ in 0..steps {
                assert!(e.step().expect("step").is_empty(), "{which}");
            }
            let again = e.abort(rid).expect("queued or prefilling");
            assert_eq!(
                again.output_ids, first.output_ids,
                "{which} after {steps} steps"
            );
            assert_eq!(again.output_logprobs, first.output_logprobs, "{which}");
            assert_eq!(again.routes, first.routes, "{which}: routes");
            assert!(!e.has_work(), "{which}");
        }
        let rid = e.resume(first);
        let done = e.run_to_end();
        let r = done.into_iter().find(|r| r.id == rid).expect("finished");
        assert_eq!(r.output_ids, want.output_ids, "{which}");
        assert_eq!(r.routes, want.routes, "{which}");
    }
}

/// A `generate` that fails (its second request refused) leaves none of its requests behind:
/// the engine has no work, and the next call's request runs alone, as on a fresh engine.
#[test]
fn a_failed_generate_leaves_no_request_behind() {
    let name = "qwen3_moe_tiny";
    let good = GenerateRequest::new(prompt(2, 9), sampled(3, 6));
    let bad = GenerateRequest::new(Vec::new(), sampled(4, 6));
    let next = GenerateRequest::new(prompt(7, 5), sampled(8, 6));
    for ((which, mut e), (_, mut fresh)) in both_engines(name).into_iter().zip(both_engines(name)) {
        assert!(
            e.generate(vec![good.clone(), bad.clone()]).is_err(),
            "{which}"
        );
        assert!(
            !e.has_work(),
            "{which}: the refused call's requests are gone"
        );
        let got = e.generate(vec![next.clone()]).expect("next call").remove(0);
        let want = fresh.generate(vec![next.clone()]).expect("fresh").remove(0);
        assert_eq!(got.output_ids, want.output_ids, "{which}");
        assert_eq!(got.output_logprobs, want.output_logprobs, "{which}");
    }
}

/// A partial rollout whose routes cannot merge with its continuation's is refused by
/// `resume`, naming why, on both engines, and leaves no work behind: routes of another
/// shape (top-k 1), rows past the positions the call fed, and — replacing — a
/// continuation whose routes would start after them, or — keeping each token's origin —
/// one whose routes would start past their end. The partial as the engine made it resumes.
#[test]
fn a_partial_whose_routes_cannot_merge_is_refused_at_resume() {
    let name = "qwen3_moe_tiny";
    let (p, params) = (prompt(5, 12), sampled(11, 14));
    for (which, mut e) in both_engines(name) {
        let id = e
            .submit(GenerateRequest {
                routed_experts_start_len: 4,
                ..GenerateRequest::new(p.clone(), params.clone())
            })
            .expect("submit");
        for _ in 0..8 {
            e.step().expect("step");
        }
        let first = e.abort(id).expect("running");
        let table = first.routes.clone().expect("routes");
        assert_eq!(table.start_pos(), 4, "{which}");
        let fed = p.len() + first.output_ids.len();
        let with_routes = |t: r3_routing::RouteTable| r3_rollout::PartialRollout {
            routes: Some(t),
            ..first.clone()
        };
        let rebuilt = |top_k: usize, start: usize, rows: usize| {
            r3_routing::RouteTable::from_flat_values(
                table.num_experts(),
                top_k,
                table.space(),
                table.layers().to_vec(),
                start,
                // Experts 1..=top_k in every cell (0 reads as a missing cell).
                &(0..rows * table.layers().len() * top_k)
                    .map(|i| (i % top_k) as u16 + 1)
                    .collect::<Vec<_>>(),
            )
            .expect("table")
        };
        let later_start = r3_rollout::PartialRollout {
            request: GenerateRequest {
                routed_experts_start_len: 6,
                ..first.request.clone()
            },
            ..first.clone()
        };
        let past_end = r3_rollout::PartialRollout {
            request: GenerateRequest {
                routed_experts_start_len: table.end_pos() + 1,
                ..first.request.clone()
            },
            ..first.clone()
        };
        let cases = [
            (
                with_routes(rebuilt(1, 4, 3)),
                MergePolicy::KeepPerTokenOrigin,
                "top_k",
            ),
            (
                with_routes(rebuilt(2, 4, fed - 3)),
                MergePolicy::KeepPerTokenOrigin,
                "reach past",
            ),
            (later_start, MergePolicy::ReplaceWithResumed, "replacing"),
            (past_end.clone(), MergePolicy::KeepPerTokenOrigin, "a gap"),
            (past_end, MergePolicy::PreferResumedFromItsStart, "a gap"),
        ];
        for (partial, policy, what) in cases {
            let err = e.try_resume(partial, policy).expect_err(what).to_string();
            assert!(err.contains(what), "{which}: {err}");
            assert!(!e.has_work(), "{which}: {what}");
        }
        let rid = e.resume(first);
        let done = e.run_to_end();
        assert!(done.iter().any(|r| r.id == rid), "{which}");
    }
}

/// A request that captures routes from position 4 on, aborted before it samples — while
/// waiting, or after a first prefill step of 4 positions — hands back nothing made (no
/// routes: the continuation captures them itself), resumes under either policy, and
/// finishes as the uninterrupted request does. On both engines.
#[test]
fn a_request_aborted_before_it_samples_resumes_with_its_own_routes() {
    let name = "qwen3_moe_tiny";
    let req = GenerateRequest {
        routed_experts_start_len: 4,
        ..GenerateRequest::new(prompt(5, 12), sampled(11, 6))
    };
    let want = engine(name, Dtype::F32, false)
        .generate(vec![req.clone()])
        .expect("uninterrupted")
        .remove(0);
    for (which, mut e) in both_engines(name) {
        for (steps, policy) in [
            (0, MergePolicy::KeepPerTokenOrigin),
            (1, MergePolicy::ReplaceWithResumed),
        ] {
            let id = e.submit(req.clone()).expect("submit");
            for _ in 0..steps {
                e.step().expect("step");
            }
            let partial = e.abort(id).expect("queued or prefilling");
            assert!(partial.output_ids.is_empty(), "{which}");
            assert_eq!(partial.routes, None, "{which} after {steps} steps");
            let rid = e.try_resume(partial, policy).expect("resumes");
            let done = e.run_to_end();
            let r = done.into_iter().find(|r| r.id == rid).expect("finished");
            assert_eq!(r.output_ids, want.output_ids, "{which} after {steps} steps");
            assert_eq!(r.routes, want.routes, "{which} after {steps} steps");
        }
    }
}

/// A CPU engine over `name` with a pool of exactly `blocks` KV blocks of 4 positions and
/// the prefix cache on.
fn small_pool_engine(name: &str, blocks: usize) -> r3_rollout::Engine {
    let cfg = r3_model::Config::from_file(&model_dir(name).join("config.json")).expect("config");
    let tensors = load_dir(&model_dir(name), &cfg).expect("tensors");
    let model = r3_rollout::model::InferenceModel::new(cfg, &tensors, Dtype::F32).expect("model");
    let block_bytes = r3_rollout::KvPool::block_bytes_of(&model.kv_layout(4), Dtype::F32);
    r3_rollout::Engine::from_dir(
        &model_dir(name),
        r3_rollout::EngineConfig {
            dtype: Dtype::F32,
            block_size: 4,
            kv_cache_bytes: blocks * block_bytes,
            prefix_cache: true,
            prefix_cache_bytes: 1 << 30,
            ..r3_rollout::EngineConfig::default()
        },
    )
    .expect("engine")
}

/// A request refused at admission holds none of the cached blocks it would start from: a
/// running request can then grow into the whole pool, and both finish. (A refused request
/// that kept its cached prefix held those blocks while it waited, the running request could
/// never get them, and the step failed with the KV cache exhausted.)
#[test]
fn a_refused_admission_holds_no_cached_blocks() {
    let name = "qwen3_moe_tiny";
    let mut e = small_pool_engine(name, 8);
    let shared = prompt(3, 12);
    // Three full blocks of `shared` go to the cache.
    e.generate(vec![GenerateRequest::new(
        shared.clone(),
        SamplingParams::greedy(1),
    )])
    .expect("first call");
    assert_eq!(e.prefix_cache_stats().expect("cache on").cached_blocks, 3);
    // A: 4 + 27 tokens, 30 positions fed: the whole pool of 8 blocks by its end.
    let a = e
        .submit(GenerateRequest::new(
            prompt(9, 4),
            SamplingParams::greedy(27),
        ))
        .expect("a");
    e.step().expect("a's prefill");
    // B starts with the cached blocks but does not fit beside A.
    let mut b_prompt = shared.clone();
    b_prompt.extend(prompt(11, 16));
    let b = e
        .submit(GenerateRequest::new(b_prompt, SamplingParams::greedy(1)))
        .expect("b");
    let mut done = Vec::new();
    while e.has_work() {
        done.extend(e.step().expect("no step runs out of KV"));
    }
    let a = done.iter().find(|r| r.id == a).expect("a finished");
    assert_eq!(a.output_ids.len(), 27);
    let b = done.iter().find(|r| r.id == b).expect("b finished");
    assert_eq!(b.output_ids.len(), 1);
}

/// Making room evicts only the cached blocks no request holds: a refused admission beside
/// running requests that share a cached prompt keeps that prompt's blocks in the cache
/// (evicting them would free nothing).
#[test]
fn eviction_keeps_the_cached_blocks_running_requests_hold() {
    let name = "qwen3_moe_tiny";
    let mut e = small_pool_engine(name, 8);
    let shared = prompt(4, 9);
    // Two samples of one prompt: the first prefills it (3 blocks, its 2 full ones cached
    // at once), the second reads those.
    for seed in 0..2 {
        e.submit(GenerateRequest::new(shared.clone(), sampled(seed, 8)))
            .expect("sample");
    }
    e.step().expect("first sample's prefill");
    assert_eq!(e.prefix_cache_stats().expect("cache on").cached_blocks, 2);
    // 20 prompt positions, 5 blocks and a decode block: more than the 5 left.
    e.submit(GenerateRequest::new(
        prompt(12, 20),
        SamplingParams::greedy(2),
    ))
    .expect("third");
    e.step().expect("second sample admitted, the third refused");
    assert_eq!(e.queue_lengths(), (1, 2));
    let stats = e.prefix_cache_stats().expect("cache on");
    assert_eq!(stats.cached_blocks, 2, "the shared prompt stays cached");
    assert_eq!(stats.evicted_blocks, 0);
    while e.has_work() {
        e.step().expect("step");
    }
}

/// A resumed request continues as the uninterrupted one does under the same weights: the
/// frequency and presence penalties count the earlier call's output too (it is the tail of
/// the continuation's prompt), and `min_new_tokens` counts what that call generated (its
/// continuation was refused as asking for more than its `max_new_tokens` left). On both
/// engines.
#[test]
fn a_resumed_request_keeps_its_penalties_and_minimum_length() {
    let name = "qwen3_moe_tiny";
    let p = prompt(5, 12);
    let penalized = SamplingParams {
        frequency_penalty: 1.0,
        presence_penalty: 0.5,
        ..SamplingParams::greedy(14)
    };
    for ((which, mut e), (_, mut fresh)) in both_engines(name).into_iter().zip(both_engines(name)) {
        let free = fresh
            .generate(vec![GenerateRequest::new(
                p.clone(),
                SamplingParams::greedy(12),
            )])
            .expect("free")
            .remove(0);
        // Stops masked until 10 tokens, the free run's second token a stop after them.
        let minimum = SamplingParams {
            min_new_tokens: 10,
            stop_token_ids: vec![free.output_ids[1]],
            ..SamplingParams::greedy(12)
        };
        for params in [penalized.clone(), minimum] {
            let want = fresh
                .generate(vec![GenerateRequest::new(p.clone(), params.clone())])
                .expect("uninterrupted")
                .remove(0);
            let id = e
                .submit(GenerateRequest::new(p.clone(), params.clone()))
                .expect("submit");
            // Three steps of prefill (4 positions a step), the first token at the third,
            // then three decode steps.
            for _ in 0..6 {
                e.step().expect("step");
            }
            let partial = e.abort(id).expect("running");
            assert_eq!(partial.output_ids.len(), 4, "{which}");
            let rid = e.resume(partial);
            let r = e
                .run_to_end()
                .into_iter()
                .find(|r| r.id == rid)
                .expect("finished");
            assert_eq!(r.output_ids, want.output_ids, "{which} {params:?}");
            assert_eq!(r.finish, want.finish, "{which}");
            assert_eq!(r.output_logprobs.len(), want.output_logprobs.len());
            for (x, y) in r.output_logprobs.iter().zip(&want.output_logprobs) {
                assert!((x - y).abs() < 1e-4, "{which}: logprob {x} vs {y}");
            }
        }
    }
}

/// A `max_new_tokens` that overflows a position count beside the prompt (`usize::MAX`) is
/// refused, naming it, and one just short of that is refused by the budgets, on both
/// engines, with nothing queued: the sums had wrapped and passed the KV checks. The device
/// engine without an activation bound checks its KV budget without wrapping too.
#[test]
fn a_max_new_tokens_near_usize_max_is_refused() {
    let name = "qwen3_moe_tiny";
    let p = prompt(1, 5);
    let unbounded = r3_rollout::DeviceEngine::from_dir(
        &model_dir(name),
        r3_rollout::DeviceEngineConfig {
            activation_bytes: usize::MAX,
            ..r3_rollout::DeviceEngineConfig::default()
        },
    )
    .expect("device engine");
    let mut engines = both_engines(name);
    engines.push(("device, no activation bound", Box::new(unbounded)));
    for (which, mut e) in engines {
        let err = e
            .submit(GenerateRequest::new(
                p.clone(),
                SamplingParams::greedy(usize::MAX),
            ))
            .expect_err("overflowing max_new_tokens")
            .to_string();
        assert!(err.contains("max_new_tokens"), "{which}: {err}");
        for new in [usize::MAX - p.len(), usize::MAX / 2] {
            assert!(
                e.submit(GenerateRequest::new(p.clone(), SamplingParams::greedy(new)))
                    .is_err(),
                "{which}: {new}"
            );
        }
        assert!(!e.has_work(), "{which}");
    }
}

/// `max_new_tokens` 0 is SGLang's prompt-only request: it finishes at the end of its
/// prefill without sampling (finish reason length, no output token), with the prompt
/// log-probs and the prompt's routes a one-token request gets. On both engines.
#[test]
fn max_new_tokens_zero_finishes_at_the_prefill_without_a_token() {
    let name = "qwen3_moe_tiny";
    for (which, mut e) in both_engines(name) {
        let mut none = GenerateRequest::new(prompt(2, 9), SamplingParams::greedy(0));
        none.sampling.prompt_logprobs_from = Some(0);
        none.return_routes = true;
        let mut one = none.clone();
        one.sampling.max_new_tokens = 1;
        let got = e.generate(vec![none]).expect("prompt only").remove(0);
        let want = e.generate(vec![one]).expect("one token").remove(0);
        assert!(got.output_ids.is_empty(), "{which}: {:?}", got.output_ids);
        assert!(got.output_logprobs.is_empty(), "{which}");
        assert_eq!(got.finish, FinishReason::Length, "{which}");
        assert_eq!(got.prompt_tokens, 9, "{which}");
        assert_eq!(got.prompt_logprobs, want.prompt_logprobs, "{which}");
        assert_eq!(got.routes, want.routes, "{which}");
        assert!(!e.has_work(), "{which}");
    }
}

/// Eviction to admit a request spares the cached blocks the request's own peek found: with
/// a pool too small for it beside the cache, admitting a request that starts with a cached
/// prompt evicts other cached blocks (here an unrelated prompt's, used after that prompt),
/// not the prefix it is about to read. It starts from that prefix (`cached_tokens`, the
/// cache's hits) and returns the tokens and routes an engine without a cache computes. (Plain
/// least-recently-used eviction took the shared prompt's blocks, the oldest, first, and the
/// request recomputed its whole prompt.)
#[test]
fn admission_eviction_spares_the_prefix_it_peeked() {
    for name in MODELS {
        // 8 blocks of 4 positions.
        let mut e = small_pool_engine(name, 8);
        let shared = prompt(3, 12);
        let other = prompt(7, 12);
        // Three full blocks of `shared` go to the cache, then three of `other` (used later,
        // so `shared`'s are the least recently used): 6 of the 8 blocks cached, 2 free.
        for p in [&shared, &other] {
            e.generate(vec![GenerateRequest::new(
                p.clone(),
                SamplingParams::greedy(1),
            )])
            .expect("warm-up call");
        }
        let stats = e.prefix_cache_stats().expect("cache on");
        assert_eq!(stats.cached_blocks, 6, "{name}");
        // 28 prompt tokens (7 blocks), the first 12 cached: 4 blocks to allocate, 2 free,
        // so admission evicts 2 cached blocks, which `other` alone can give.
        let mut long = shared.clone();
        long.extend(prompt(11, 16));
        let req = GenerateRequest::new(long, SamplingParams::greedy(2));
        let hits_before = stats.hit_blocks;
        let got = e.generate(vec![req.clone()]).expect("third call").remove(0);
        assert_eq!(
            got.cached_tokens, 12,
            "{name}: the peeked prefix stayed cached"
        );
        let stats = e.prefix_cache_stats().expect("cache on");
        assert_eq!(stats.hit_blocks - hits_before, 3, "{name}");
        let mut cold = engine(name, Dtype::F32, false);
        let want = cold.generate(vec![req]).expect("cold").remove(0);
        assert_eq!(got.output_ids, want.output_ids, "{name}");
        assert_eq!(got.routes, want.routes, "{name}");
        for (x, y) in got.output_logprobs.iter().zip(&want.output_logprobs) {
            assert!((x - y).abs() < 1e-4, "{name}: logprob {x} vs {y}");
        }
    }
}
