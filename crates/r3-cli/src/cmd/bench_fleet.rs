//! `r3 bench fleet`: the same rollout batch through the in-process engine and through a
//! fleet of 1 and 2 local HTTP workers (in-process `r3 serve` servers on 127.0.0.1), and
//! what the HTTP round trips, JSON and the checked decoding cost per generated token as a
//! fraction of rollout time. On a machine with few cores the workers compete with each
//! other and with the client, so the fleet cannot be faster here. Prints figures; nothing
//! is asserted.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use r3_fleet::{Fleet, FleetConfig, ModelFacts};
use r3_model::Config;
use r3_rollout::{Dtype, Engine, EngineConfig, GenerateRequest, SamplingParams};
use r3_server::{build_app, serve, ServerConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Options of `r3 bench fleet`.
#[derive(Debug, Args)]
pub struct BenchFleetArgs {
    /// HF model directory (an MoE model).
    #[arg(long, default_value = "models/arith-moe")]
    pub model: PathBuf,
    /// Requests per batch (a trainer step's prompts × group size).
    #[arg(long, default_value_t = 256)]
    pub requests: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 24)]
    pub prompt_len: usize,
    /// Most generated tokens per request.
    #[arg(long, default_value_t = 40)]
    pub new_tokens: usize,
    /// Worker counts to run.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub workers: Vec<usize>,
    /// Matmul precision of engine and workers.
    #[arg(long, default_value = "f16")]
    pub dtype: String,
    /// Runs of each setting; the best is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Seed of prompts and sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Seeded random prompts, one request each, routes and log-probs asked for.
fn requests(a: &BenchFleetArgs, cfg: &Config, eos: &[u32]) -> Vec<GenerateRequest> {
    let mut rng = ChaCha8Rng::seed_from_u64(a.seed);
    (0..a.requests)
        .map(|i| {
            let prompt = (0..a.prompt_len)
                .map(|_| rng.random_range(3..cfg.vocab_size as u32))
                .collect();
            let sampling = SamplingParams {
                temperature: 1.0,
                max_new_tokens: a.new_tokens,
                stop_token_ids: eos.to_vec(),
                seed: a.seed.wrapping_add(i as u64),
                ..SamplingParams::default()
            };
            GenerateRequest::new(prompt, sampling)
        })
        .collect()
}

/// Local HTTP workers on one runtime; they stop when this is dropped.
struct LocalWorkers {
    urls: Vec<String>,
    _runtime: tokio::runtime::Runtime,
    _stop: Vec<tokio::sync::oneshot::Sender<()>>,
}

fn start_workers(
    a: &BenchFleetArgs,
    n: usize,
    engine_cfg: &EngineConfig,
) -> anyhow::Result<LocalWorkers> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut urls = Vec::new();
    let mut stop = Vec::new();
    for _ in 0..n {
        let engine = Engine::from_dir(&a.model, engine_cfg.clone())
            .with_context(|| format!("loading {}", a.model.display()))?;
        let app = build_app(engine, None, ServerConfig::default())?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        urls.push(format!("http://{}", listener.local_addr()?));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        runtime.spawn(async move {
            let shutdown = async {
                let _ = rx.await;
            };
            if let Err(e) = serve(listener, app.router, shutdown).await {
                tracing::warn!(error = %e, "bench worker stopped");
            }
        });
        stop.push(tx);
    }
    Ok(LocalWorkers {
        urls,
        _runtime: runtime,
        _stop: stop,
    })
}

/// Runs `r3 bench fleet`.
pub fn run(a: BenchFleetArgs) -> anyhow::Result<()> {
    let cfg = Config::from_file(&a.model.join("config.json"))?;
    let moe = cfg.moe.clone().context("the bench needs an MoE model")?;
    let dtype: Dtype = a.dtype.parse()?;
    let engine_cfg = EngineConfig {
        dtype,
        ..EngineConfig::default()
    };
    let mut engine = Engine::from_dir(&a.model, engine_cfg.clone())?;
    let reqs = requests(&a, &cfg, engine.eos_token_ids());
    let repeats = a.repeats.max(1);

    let mut engine_s = f64::INFINITY;
    let mut tokens = 0usize;
    for _ in 0..repeats {
        engine.flush_prefix_cache();
        let t = Instant::now();
        let out = engine.generate(reqs.clone())?;
        engine_s = engine_s.min(t.elapsed().as_secs_f64());
        tokens = out.iter().map(|r| r.output_ids.len()).sum();
    }
    println!(
        "fleet bench: {} requests x <= {} new tokens, prompt {}, {}",
        a.requests, a.new_tokens, a.prompt_len, a.dtype
    );
    println!(
        "  in-process engine: {:.3} s, {:.0} tokens/s ({tokens} tokens)",
        engine_s,
        tokens as f64 / engine_s
    );
    let facts = ModelFacts {
        vocab_size: cfg.vocab_size,
        layout: cfg.layout.clone(),
        top_k: moe.top_k,
        num_experts: moe.num_experts,
    };
    for &n in &a.workers {
        let workers = start_workers(&a, n, &engine_cfg)?;
        let fleet_cfg = FleetConfig {
            urls: workers.urls.clone(),
            max_in_flight: a.requests.max(1),
            request_timeout: Duration::from_secs(600),
            max_retries: 0,
            api_key: None,
            max_staleness: 0,
            partial: r3_fleet::PartialMode::Resume,
            merge: r3_routing::MergePolicy::KeepPerTokenOrigin,
        };
        let fleet = Fleet::new(fleet_cfg, facts.clone())?;
        let mut best = f64::INFINITY;
        let mut decode_s = 0.0;
        let mut best_stats = None;
        let mut fleet_tokens = 0usize;
        for round in 0..repeats {
            // A fresh load also empties the workers' prefix caches, as in the engine runs.
            fleet.sync(&a.model, round as u64)?;
            let t = Instant::now();
            let (out, stats) = fleet.generate(reqs.clone())?;
            let took = t.elapsed().as_secs_f64();
            if took < best {
                best = took;
                decode_s = stats.decode_s;
                best_stats = Some(stats);
            }
            fleet_tokens = out.iter().map(|r| r.output_ids.len()).sum();
        }
        let overhead = (best - engine_s).max(0.0);
        println!(
            "  fleet of {n}: {:.3} s, {:.0} tokens/s ({fleet_tokens} tokens); over the engine {:+.1} us/token = {:.1}% of rollout time",
            best,
            fleet_tokens as f64 / best,
            (best - engine_s) * 1e6 / fleet_tokens.max(1) as f64,
            100.0 * overhead / best
        );
        println!(
            "    reply checks + route decoding: {:.2} us/token = {:.2}% of the fleet's rollout time",
            decode_s * 1e6 / fleet_tokens.max(1) as f64,
            100.0 * decode_s / best
        );
        if let Some(frac) = best_stats.as_ref().and_then(|s| s.wire_overhead_frac()) {
            let s = best_stats
                .as_ref()
                .map(|s| (s.timed_request_s, s.server_s, s.encode_s));
            let (call, server, encode) = s.unwrap_or_default();
            let overhead = (call - server).max(0.0) + encode + decode_s;
            println!(
                "    HTTP + JSON + checks per request: {:.2} request-us/token = {:.2}% of request time \
                 (client call {:.3} s - worker e2e_latency {:.3} s + encode {:.4} s + decode {:.4} s, summed over requests)",
                overhead * 1e6 / fleet_tokens.max(1) as f64,
                100.0 * frac,
                call,
                server,
                encode,
                decode_s
            );
        }
    }
    println!("  (same machine: workers share its cores with each other and the client)");
    Ok(())
}
