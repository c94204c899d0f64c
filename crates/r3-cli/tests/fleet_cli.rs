//! `r3 train` with `rollout.backend = "sglang"` against `r3 serve` workers started here on
//! 127.0.0.1: the per-step metrics equal those of the in-process engine with the same
//! seeds, every worker ends at the last weight version, and a worker killed in the middle
//! of a run (synchronous or with `rollout.async`) costs retries but no trajectory;
//! restarted, it rejoins at the current version; an async run killed and resumed samples
//! the batch it had drawn ahead again, as a synchronous resume would.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use r3_test_support::Scratch;
use r3_train::rl::metrics_log::is_measurement;
use serde_json::Value;

/// A copy of the shipped model under `root` (workers may only load weights under the
/// served model's parent, so model and sync directory share one root).
fn model_copy(root: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/arith-moe");
    let dst = root.join("model");
    std::fs::create_dir_all(&dst).expect("model dir");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy model file");
    }
    dst
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// One blocking HTTP/1.1 GET; `None` when nothing answers.
fn http_get(port: u16, path: &str) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1;
    Some((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// An `r3 serve` worker process, killed on drop.
struct Worker {
    child: Child,
    port: u16,
}

impl Worker {
    fn start(model: &Path, port: u16) -> Self {
        Self::start_with(model, port, &[])
    }

    /// [`Worker::start`] with more `r3 serve` arguments.
    fn start_with(model: &Path, port: u16, extra: &[&str]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_r3"))
            .args(["serve", "--model"])
            .arg(model)
            .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn r3 serve");
        let w = Worker { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(port, "/health").map(|r| r.0) != Some(200) {
            assert!(
                Instant::now() < deadline,
                "r3 serve on {port} did not come up"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        w
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn weight_version(&self) -> Option<String> {
        http_get(self.port, "/get_weight_version")
            .and_then(|(_, v)| v["weight_version"].as_str().map(String::from))
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `r3 train` settings shared by the engine and fleet runs: 3 small steps, no eval or
/// checkpoints.
fn train_args(model: &Path, run: &Path, extra: &[String]) -> Vec<String> {
    let mut args: Vec<String> = vec!["train".into(), "--no-progress".into()];
    for s in [
        format!("model_dir={}", model.display()),
        format!("run_dir={}", run.display()),
        "steps=3".into(),
        "seed=7".into(),
        "rollout.prompts_per_step=6".into(),
        "rollout.group_size=4".into(),
        "rollout.max_new_tokens=16".into(),
        "eval.every=0".into(),
        "checkpoint.every=0".into(),
    ]
    .into_iter()
    .chain(extra.iter().cloned())
    {
        args.push("--set".into());
        args.push(s);
    }
    args
}

/// One-step off-policy rollout (`rollout.async` needs `max_staleness` >= 1).
const ASYNC_SETTINGS: [&str; 2] = ["rollout.async=true", "rollout.max_staleness=1"];

fn fleet_settings(root: &Path, urls: &[String]) -> Vec<String> {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    vec![
        "rollout.backend=sglang".into(),
        format!("rollout.urls=[{}]", list.join(", ")),
        format!("rollout.sync_dir={}", root.join("sync").display()),
        "rollout.request_timeout_s=60".into(),
    ]
}

/// A scratch directory named `name` with a copy of the model, and two `r3 serve` workers
/// on free ports serving it (and their URLs).
fn fleet_setup(name: &str) -> (Scratch, PathBuf, [Worker; 2], Vec<String>) {
    let scratch = Scratch::new(name);
    let model = model_copy(&scratch.0);
    let workers = [
        Worker::start(&model, free_port()),
        Worker::start(&model, free_port()),
    ];
    let urls = workers.iter().map(Worker::url).collect();
    (scratch, model, workers, urls)
}

/// Every worker reports weight version `version`.
fn assert_versions(workers: &[Worker], version: usize) {
    for w in workers {
        let got = w.weight_version();
        assert_eq!(got, Some(version.to_string()), "{}", w.url());
    }
}

/// `r3` with `args` in the background, its stderr to `log`.
fn spawn_train(args: &[String], log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("spawn r3 train")
}

fn train(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_r3"))
        .args(args)
        .output()
        .expect("run r3 train")
}

fn metrics(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line"))
        .collect()
}

fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "r3 train failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn two_workers_reach_the_engines_metrics_and_end_at_the_last_version() {
    let (scratch, model, workers, urls) = fleet_setup("same");
    let root = &scratch.0;

    // Held-out evaluation before step 1 and after step 3, 3 samples per prompt: the fleet run
    // evaluates on its workers (it holds no engine), the engine run in process.
    // (eval.size stays the default: the held-out set shapes the arithmetic training stream,
    // which the async run below, without an eval, must share.)
    let eval = [
        "eval.every=3".to_string(),
        "eval.samples_per_prompt=3".into(),
    ];
    let engine_run = root.join("engine");
    assert_ok(&train(&train_args(&model, &engine_run, &eval)));
    let fleet_run = root.join("fleet");
    let mut settings = fleet_settings(root, &urls);
    settings.push("checkpoint.every=2".into());
    settings.extend(eval);
    let out = train(&train_args(&model, &fleet_run, &settings));
    assert_ok(&out);

    let (want, got) = (metrics(&engine_run), metrics(&fleet_run));
    assert_eq!((want.len(), got.len()), (3, 3));
    let evals = |run: &Path| std::fs::read_to_string(run.join("eval.jsonl")).expect("eval.jsonl");
    assert_eq!(
        evals(&engine_run).lines().count(),
        2,
        "evals at steps 0 and 3"
    );
    assert_eq!(evals(&fleet_run), evals(&engine_run));
    assert!(
        evals(&engine_run).contains("\"samples_per_prompt\":3"),
        "k = 3 estimates logged"
    );
    for (w, g) in want.iter().zip(&got) {
        let step = &g["step"];
        // Every non-timing metric is bit-identical: each request carries its own seed and
        // a worker's tokens, log-probs and routes do not depend on what it batches with.
        for (key, value) in w.as_object().expect("metrics object") {
            if is_measurement(key) {
                continue;
            }
            if key.starts_with("rollout.") {
                assert!(value.is_null(), "step {step}: the engine run has no {key}");
                continue;
            }
            assert_eq!(value, &g[key], "step {step}: {key}");
        }
        assert_eq!(g["replay.verified_frac"], 1.0, "step {step}");
        assert!(g["mismatch.k3_kl"].is_f64(), "step {step}: k3 measured");
        assert_eq!(g["rollout.retries"], 0, "step {step}");
        assert_eq!(g["rollout.workers_up"], 2, "step {step}");
        assert_eq!(g["rollout.stale_frac"], 0.0, "step {step}");
    }
    assert_versions(&workers, 3);
    // Old sync directories are pruned: the newest two remain.
    let mut kept: Vec<String> = std::fs::read_dir(root.join("sync"))
        .expect("sync dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, vec!["step_2", "step_3"]);

    // One-step off-policy: step 1 is the synchronous step; the batches of steps 2 and 3
    // come from the weights one version behind the trainer's.
    let async_run = root.join("async");
    let mut settings = fleet_settings(root, &urls);
    settings.extend(ASYNC_SETTINGS.map(String::from));
    settings.extend([
        format!("rollout.sync_dir={}", root.join("sync-async").display()),
        "checkpoint.every=2".into(),
    ]);
    assert_ok(&train(&train_args(&model, &async_run, &settings)));
    let overlapped = metrics(&async_run);
    assert_eq!(overlapped.len(), 3);
    let (sync1, async1) = (&got[0], &overlapped[0]);
    for (key, value) in sync1.as_object().expect("metrics object") {
        if !is_measurement(key) {
            assert_eq!(value, &async1[key], "async step 1: {key}");
        }
    }
    assert!(async1.get("time.rollout_ahead_s").is_none());
    for m in &overlapped[1..] {
        let step = &m["step"];
        assert_eq!(m["rollout.stale_frac"], 1.0, "async step {step}");
        assert_eq!(m["replay.verified_frac"], 1.0, "async step {step}");
        assert!(
            m["time.rollout_ahead_s"].as_f64().is_some_and(|s| s > 0.0),
            "async step {step}: the batch was generated ahead"
        );
    }
    // Step 2's batch is step 2's prompts and seeds on the base weights, not step 2 of the
    // synchronous run (which sampled on version 1).
    assert_ne!(
        overlapped[1]["mismatch.k3_kl"], got[1]["mismatch.k3_kl"],
        "async step 2 trained on the same batch as the synchronous run"
    );
    // The checkpoint after step 2 records the prompt stream before step 3's prompts, which
    // were drawn ahead: the same state as the synchronous run's, so a resume redraws them.
    let state = |run: &Path| -> Value {
        let path = run.join("checkpoints/step_2/trainer_state.json");
        serde_json::from_str(&std::fs::read_to_string(&path).expect("trainer_state.json"))
            .expect("state json")
    };
    assert_eq!(state(&async_run), state(&fleet_run));
    assert_versions(&workers, 3);
}

/// Lines in the run's `metrics.jsonl` (0 while it does not exist).
fn steps_logged(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// Requests waiting for a running slot on the worker at `port` (0 when it does not answer).
fn waiting_requests(port: u16) -> u64 {
    http_get(port, "/v1/loads")
        .and_then(|(_, v)| v["loads"][0]["num_waiting_reqs"].as_u64())
        .unwrap_or(0)
}

#[test]
fn a_worker_killed_mid_run_costs_retries_not_trajectories_and_rejoins() {
    worker_killed_mid_run(false);
}

#[test]
fn a_worker_killed_mid_async_run_costs_retries_not_trajectories_and_rejoins() {
    worker_killed_mid_run(true);
}

/// Kills worker 1 while it runs requests of a 10-step run, restarts it, and checks that
/// the run lost no trajectory, retried, and took the worker back.
fn worker_killed_mid_run(rollout_ahead: bool) {
    let (scratch, model, mut workers, urls) =
        fleet_setup(if rollout_ahead { "kill-async" } else { "kill" });
    // Worker 1 runs one request at a time, so that requests queue behind it: killed while
    // some wait, it takes several requests' time with it whatever instant the kill lands
    // (with every request running at once, a batch could finish between the check and the
    // kill on a loaded machine, and then nothing was in flight to retry).
    let port = workers[1].port;
    workers[1].kill();
    workers[1] = Worker::start_with(&model, port, &["--max-running", "1"]);
    let root = &scratch.0;
    let run = root.join("run");
    // Enough steps after the kill that some start after the restarted worker is up (with
    // 10, a run on 2 cores had logged 8 by the time the worker answered again).
    let steps = 16;
    let mut settings = fleet_settings(root, &urls);
    settings.extend([
        format!("steps={steps}"),
        "rollout.prompts_per_step=16".into(),
        "rollout.max_new_tokens=40".into(),
    ]);
    if rollout_ahead {
        settings.extend(ASYNC_SETTINGS.map(String::from));
    }
    let mut child = spawn_train(
        &train_args(&model, &run, &settings),
        &root.join("train.log"),
    );
    // Kill worker 1 while requests wait behind its running one, once step 1 is logged
    // (step 2's batch, or with the rollout ahead step 3's).
    let deadline = Instant::now() + Duration::from_secs(300);
    while steps_logged(&run) < 1 || waiting_requests(workers[1].port) < 2 {
        assert!(
            Instant::now() < deadline,
            "no requests queued on worker 1 after step 1"
        );
        assert!(
            steps_logged(&run) < steps,
            "the run ended before worker 1 could be killed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let killed_port = workers[1].port;
    workers[1].kill();
    // Back after a moment, with the base weights: the next sync or probe must bring it to
    // the trainer's version before it gets requests again.
    std::thread::sleep(Duration::from_millis(300));
    workers[1] = Worker::start(&model, killed_port);
    // Steps after the one under way now start with worker 1 answering `/health`.
    let logged_at_restart = steps_logged(&run);
    let status = child.wait().expect("wait r3 train");
    let stderr = std::fs::read_to_string(root.join("train.log")).unwrap_or_default();
    assert!(status.success(), "r3 train failed:\n{stderr}");

    let lines = metrics(&run);
    assert_eq!(lines.len(), steps);
    let retries: u64 = lines
        .iter()
        .map(|m| m["rollout.retries"].as_u64().expect("retries"))
        .sum();
    let up: Vec<u64> = lines
        .iter()
        .map(|m| m["rollout.workers_up"].as_u64().expect("workers_up"))
        .collect();
    eprintln!("retries {retries}, workers up per step {up:?}, {logged_at_restart} steps logged at the restart");
    assert_eq!(up[0], 2);
    assert!(retries > 0, "requests to the killed worker were retried");
    // Step `logged_at_restart + 1` was under way at the restart; every later one began
    // with worker 1 up, so it rejoined by then at the latest. With the rollout ahead, a
    // step's batch was generated during the step before it.
    let after = logged_at_restart + 1 + usize::from(rollout_ahead);
    assert!(
        after < steps,
        "the run ended before the restarted worker was up ({logged_at_restart} of {steps} steps logged)"
    );
    for (i, &n) in up.iter().enumerate().skip(after) {
        assert_eq!(n, 2, "step {}: the restarted worker rejoined", i + 1);
    }
    for m in &lines {
        assert_eq!(m["replay.verified_frac"], 1.0);
        // Every step trained on exactly prompts x group trajectories: the groups add up.
        let groups =
            m["groups_kept"].as_u64().unwrap_or(0) + m["groups_dropped"].as_u64().unwrap_or(0);
        assert_eq!(groups, 16, "step {}", m["step"]);
    }
    assert_versions(&workers, steps);
}

/// A recursive copy of `src` to `dst`.
fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("create copy dir");
    for entry in std::fs::read_dir(src).expect("read dir") {
        let entry = entry.expect("dir entry");
        let to = dst.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).expect("copy file");
        }
    }
}

/// The metrics of `line` without timings, for comparing two runs' steps.
fn untimed(line: &Value) -> serde_json::Map<String, Value> {
    let mut m = line.as_object().expect("metrics object").clone();
    m.retain(|k, _| !is_measurement(k));
    m
}

#[test]
fn an_async_run_killed_and_resumed_samples_its_next_batch_again() {
    let (scratch, model, workers, urls) = fleet_setup("resume-async");
    let root = &scratch.0;
    let run = root.join("run");
    let steps = 8;
    let mut settings = fleet_settings(root, &urls);
    settings.extend([format!("steps={steps}"), "checkpoint.every=2".into()]);
    settings.extend(ASYNC_SETTINGS.map(String::from));
    let mut child = spawn_train(
        &train_args(&model, &run, &settings),
        &root.join("train.log"),
    );
    // SIGKILL once step 3 is logged: the checkpoint of step 2 exists, and the batch of the
    // step after the newest checkpoint has been generated ahead (or is being generated).
    let deadline = Instant::now() + Duration::from_secs(300);
    while steps_logged(&run) < 3 {
        assert!(Instant::now() < deadline, "step 3 never finished");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        child.try_wait().expect("poll r3 train").is_none(),
        "the run ended before it could be killed"
    );
    child.kill().expect("kill r3 train");
    let _ = child.wait();
    let before = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics");
    let newest = std::fs::read_dir(run.join("checkpoints"))
        .expect("checkpoints")
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            name.strip_prefix("step_")?.parse::<usize>().ok()
        })
        .max()
        .expect("a checkpoint before the kill");
    assert!(
        newest >= 2 && newest + 2 <= steps,
        "newest checkpoint {newest}"
    );

    // The same killed run resumed once as it was (async) and once synchronously.
    let sync_run = root.join("run-sync");
    copy_dir(&run, &sync_run);
    let cfg_path = sync_run.join("config.toml");
    let cfg = std::fs::read_to_string(&cfg_path).expect("config.toml");
    assert!(cfg.contains("async = true"), "config.toml:\n{cfg}");
    std::fs::write(&cfg_path, cfg.replace("async = true", "async = false")).expect("write cfg");
    for dir in [&run, &sync_run] {
        let mut args = vec![
            "train".to_string(),
            "--no-progress".into(),
            "--resume".into(),
        ];
        args.push(dir.display().to_string());
        assert_ok(&train(&args));
    }
    let (resumed, synced) = (metrics(&run), metrics(&sync_run));
    for lines in [&resumed, &synced] {
        let numbers: Vec<u64> = lines
            .iter()
            .map(|m| m["step"].as_u64().expect("step"))
            .collect();
        assert_eq!(
            numbers,
            (1..=steps as u64).collect::<Vec<_>>(),
            "each step once"
        );
    }
    // What the checkpoint covers is kept as it was written.
    let kept: Vec<&str> = before.lines().take(newest).collect();
    let now = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics");
    assert_eq!(now.lines().take(newest).collect::<Vec<_>>(), kept);
    // The first step after the resume samples afresh on the checkpoint's weights: exactly
    // the synchronous resume's step. Later steps are one version behind again.
    let first = newest; // index of step newest + 1
    assert_eq!(resumed[first]["rollout.stale_frac"], 0.0);
    assert_eq!(untimed(&resumed[first]), untimed(&synced[first]));
    for m in &resumed[first + 1..] {
        let step = &m["step"];
        assert_eq!(m["rollout.stale_frac"], 1.0, "step {step}");
        assert_eq!(m["replay.verified_frac"], 1.0, "step {step}");
    }
    assert_ne!(
        resumed[first + 1]["mismatch.k3_kl"],
        synced[first + 1]["mismatch.k3_kl"],
        "the step after was generated ahead, on older weights than the synchronous run's"
    );
    assert_versions(&workers, steps);
}
