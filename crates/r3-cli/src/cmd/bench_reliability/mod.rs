//! `r3 bench reliability`: the longer reliability suite a user runs against the real
//! binaries. It starts `r3 serve` and `r3 train` itself as child processes and runs five
//! parts, each in its own file: (a) [`load`], many concurrent clients with every answer
//! checked against a single-client reference; (b) [`slowloris`], hundreds of stalled
//! connections while real clients are served; (c) [`weights`], weight swaps under load,
//! answers checked against the weights their version names; (d) [`kill_resume`], a training
//! run SIGKILLed and resumed, compared bit for bit with an uninterrupted one; (e) [`flood`],
//! more idle connections than the server's connection limit, kept up, while real clients
//! are served. Prints the figures of each part; the quick checks of the same properties are
//! `cargo test`.

mod flood;
mod kill_resume;
mod load;
mod server;
mod slowloris;
mod traffic;
mod weights;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use r3_fleet::http::JsonClient;

use server::{r3_binary, ServerProcess};
use traffic::{reference, request_pool};

/// Options of `r3 bench reliability`.
#[derive(Debug, Args)]
pub struct BenchReliabilityArgs {
    /// HF model directory served and trained (copied into the work directory).
    #[arg(long, default_value = "models/arith-moe")]
    pub model: PathBuf,
    /// Wall time of parts (a)–(c) together, split evenly; (e) runs one such share on top,
    /// (d) its kills.
    #[arg(long, default_value_t = 3.0)]
    pub minutes: f64,
    /// Concurrent clients of the load part.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Stalled connections of the slowloris part (a third each idle, half-header, half-body).
    #[arg(long, default_value_t = 300)]
    pub slow_connections: usize,
    /// Idle connections the flood part keeps open (reopened when the server closes them),
    /// from several loopback addresses.
    #[arg(long, default_value_t = 1100)]
    pub flood_connections: usize,
    /// `--max-connections` of the flood part's server (its default).
    #[arg(long, default_value_t = 512)]
    pub flood_max_connections: usize,
    /// Real clients served during the slowloris, weight-update and flood parts.
    #[arg(long, default_value_t = 16)]
    pub side_clients: usize,
    /// Seconds between weight swaps in part (c).
    #[arg(long, default_value_t = 1.0)]
    pub swap_every_secs: f64,
    /// SIGKILLs of the training run in part (d).
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// Training steps of part (d).
    #[arg(long, default_value_t = 10)]
    pub train_steps: usize,
    /// Requests in the pool (each has one right answer per weights).
    #[arg(long, default_value_t = 64)]
    pub pool: usize,
    /// Seed of prompts, client choices and kill times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Parts to run, among load, slowloris, weights, kill, flood.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "load,slowloris,weights,kill,flood"
    )]
    pub parts: Vec<String>,
    /// The `r3` binary to start (default: this one).
    #[arg(long)]
    pub r3: Option<PathBuf>,
    /// Scratch directory (default: a fresh one under the system temp directory); kept
    /// afterwards with the server and training logs.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// Runs `r3 bench reliability`.
pub fn run(a: BenchReliabilityArgs) -> anyhow::Result<()> {
    let r3 = r3_binary(a.r3.as_deref())?;
    let work = match &a.work_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("r3-reliability-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let work = work.canonicalize()?;
    let model = a
        .model
        .canonicalize()
        .with_context(|| format!("model directory {}", a.model.display()))?;
    println!(
        "r3 bench reliability: binary {}, work dir {}",
        r3.display(),
        work.display()
    );
    let wants = |p: &str| a.parts.iter().any(|x| x == p);

    let server_parts = ["load", "slowloris", "weights", "flood"];
    if server_parts.iter().any(|p| wants(p)) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the client runtime")?;
        runtime.block_on(serve_parts(&a, &r3, &model, &work))?;
    }
    if wants("kill") {
        let f = kill_resume::run(&r3, &model, &work, a.train_steps, a.kills, a.seed)?;
        println!(
            "(d) kill/resume: {} steps, {} SIGKILLs, {} failed resumes; final weights and \
             optimiser {} the uninterrupted run's; lines torn {}, lost {}, duplicated {}, \
             differing {} (uninterrupted run {:.1} s)",
            f.steps,
            f.kills,
            f.resume_failures,
            if f.weights_identical {
                "identical to"
            } else {
                "DIFFERENT from"
            },
            f.torn_lines,
            f.lost_lines,
            f.duplicate_lines,
            f.differing_lines,
            f.reference_s
        );
    }
    Ok(())
}

/// Parts (a)–(c) against one `r3 serve` child with short connection timeouts (so the
/// slowloris part sees them act).
async fn serve_parts(
    a: &BenchReliabilityArgs,
    r3: &std::path::Path,
    model: &std::path::Path,
    work: &std::path::Path,
) -> anyhow::Result<()> {
    let dir_a = work.join("weights-a");
    let dir_b = work.join("weights-b");
    weights::write_weights(model, &dir_a, false, a.seed)?;
    weights::write_weights(model, &dir_b, true, a.seed)?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
    let vocab = config["vocab_size"]
        .as_u64()
        .context("config.json has no vocab_size")? as usize;
    let extra: Vec<String> = [
        "--header-timeout-secs",
        "10",
        "--body-timeout-secs",
        "10",
        "--max-connections",
        "1000",
    ]
    .map(String::from)
    .to_vec();
    let server = ServerProcess::start(r3, &dir_a, work, &work.join("serve.log"), &extra).await?;
    let client = JsonClient::new(None);
    let url = server.url("/generate");
    let pool = Arc::new(request_pool(a.pool, vocab, a.seed));
    let reference = reference(&client, &url, &pool).await?;
    let wants = |p: &str| a.parts.iter().any(|x| x == p);
    let share = Duration::from_secs_f64((a.minutes * 60.0 / 3.0).max(1.0));

    if wants("load") {
        let f = load::run(
            &client,
            &url,
            Arc::clone(&pool),
            &reference,
            a.clients,
            share,
            a.seed,
        )
        .await;
        println!(
            "(a) load: {} clients, {} requests, {} failures, {} mismatches, p50 {:.0} ms, \
             p99 {:.0} ms",
            f.clients, f.sent, f.failures, f.mismatches, f.p50_ms, f.p99_ms
        );
    }
    if wants("slowloris") {
        let f = slowloris::run(
            &client,
            &server.addr(),
            &url,
            Arc::clone(&pool),
            &reference,
            a.slow_connections,
            a.side_clients,
            share,
            a.seed + 1,
        )
        .await;
        println!(
            "(b) slowloris: {} stalled connections ({} could not connect), {} closed by the \
             server's timeouts; {} clients sent {} requests, {} failures, {} mismatches, \
             p50 {:.0} ms, p99 {:.0} ms",
            f.opened,
            f.connect_failures,
            f.closed_by_server,
            f.clients,
            f.sent,
            f.failures,
            f.mismatches,
            f.p50_ms,
            f.p99_ms
        );
    }
    if wants("weights") {
        let f = weights::run(
            &client,
            &server.base,
            Arc::clone(&pool),
            &dir_a,
            &dir_b,
            a.side_clients,
            share,
            Duration::from_secs_f64(a.swap_every_secs.max(0.05)),
            a.seed + 2,
        )
        .await?;
        println!(
            "(c) weight updates: {} swaps ({} failed), {} of {} pool answers differ between \
             the two weights; {} requests, {} failures, {} aborted by a swap, {} complete \
             answers checked, {} inconsistent with their weight_version, p50 {:.0} ms, p99 \
             {:.0} ms",
            f.updates,
            f.update_failures,
            f.differing_references,
            pool.len(),
            f.sent,
            f.failures,
            f.aborted,
            f.checked,
            f.mismatches,
            f.p50_ms,
            f.p99_ms
        );
    }
    if wants("flood") {
        // Its own server at the flood limit, with a header timeout longer than the part, so
        // every flood socket the server closes is closed to make room.
        let header_secs = (share.as_secs() + 60).to_string();
        let limit = a.flood_max_connections.to_string();
        let extra: Vec<String> = [
            "--max-connections",
            &limit,
            "--header-timeout-secs",
            &header_secs,
        ]
        .map(String::from)
        .to_vec();
        let flood_server =
            ServerProcess::start(r3, &dir_a, work, &work.join("serve-flood.log"), &extra).await?;
        let addr = flood_server
            .addr()
            .parse()
            .context("the flood server's address")?;
        let f = flood::run(
            &client,
            addr,
            &flood_server.url("/generate"),
            Arc::clone(&pool),
            &reference,
            a.flood_connections,
            a.side_clients,
            share,
            a.seed + 3,
        )
        .await;
        println!(
            "(e) flood: {} idle sockets from {} loopback addresses kept against \
             --max-connections {} ({} connects, {} failed, {} closed by the server to make \
             room); {} clients sent {} requests, {} failures, {} mismatches, p50 {:.0} ms, \
             p99 {:.0} ms",
            f.sockets,
            flood::FLOOD_SOURCES,
            a.flood_max_connections,
            f.opened,
            f.connect_failures,
            f.closed_by_server,
            f.clients,
            f.sent,
            f.failures,
            f.mismatches,
            f.p50_ms,
            f.p99_ms
        );
    }
    Ok(())
}
