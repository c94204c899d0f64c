//! Part (c), weight updates under load: the server swaps between two weight directories (A,
//! the model; B, the model with seeded noise on every weight) with `abort_all_requests`
//! while clients keep sending requests. Every complete answer must equal the reference
//! answer of the weights its `meta_info.weight_version` names; an aborted answer must be a
//! prefix of one of the two references.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use r3_fleet::http::JsonClient;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::traffic::{reference, run_clients, Answer};

/// Figures of the weight-update part.
#[derive(Debug, Clone)]
pub struct WeightsFigures {
    /// Weight updates done.
    pub updates: usize,
    /// Weight updates refused or failed.
    pub update_failures: usize,
    /// Pool requests whose reference answers differ between A and B (the check's power).
    pub differing_references: usize,
    /// Requests sent.
    pub sent: usize,
    /// Requests without a valid answer.
    pub failures: usize,
    /// Answers aborted by a swap.
    pub aborted: usize,
    /// Complete answers checked against the reference of their version.
    pub checked: usize,
    /// Answers inconsistent with their weight version.
    pub mismatches: usize,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
}

/// Copies the model directory `from` to `to` (config, tokenizer, weights), multiplying every
/// float weight by `1 + 0.3 u`, `u` uniform in [-1, 1] from `seed` (`noise` false: a copy).
pub fn write_weights(from: &Path, to: &Path, noise: bool, seed: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let is_weights = name.to_string_lossy().ends_with(".safetensors");
        if !entry.file_type()?.is_file() || (noise && is_weights) {
            continue;
        }
        std::fs::copy(entry.path(), to.join(&name))
            .with_context(|| format!("copying {}", entry.path().display()))?;
    }
    if !noise {
        return Ok(());
    }
    let src = from.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&src, &Device::Cpu)
        .with_context(|| format!("reading {}", src.display()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for name in names {
        let t = &tensors[name];
        let dtype = t.dtype();
        if !dtype.is_float() {
            out.insert(name.clone(), t.clone());
            continue;
        }
        let scale: Vec<f32> = (0..t.elem_count())
            .map(|_| 1.0 + 0.3 * rng.random_range(-1.0f32..=1.0))
            .collect();
        let scale = Tensor::from_vec(scale, t.shape(), &Device::Cpu)?;
        let noisy = t.to_dtype(DType::F32)?.mul(&scale)?.to_dtype(dtype)?;
        out.insert(name.clone(), noisy);
    }
    candle_core::safetensors::save(&out, to.join("model.safetensors"))
        .context("writing the noisy weights")?;
    Ok(())
}

/// Loads `dir` into the server as `version`, aborting requests in flight.
async fn update(client: &JsonClient, base: &str, dir: &Path, version: &str) -> anyhow::Result<()> {
    let body = json!({
        "model_path": dir.display().to_string(),
        "abort_all_requests": true,
        "weight_version": version,
    });
    let url = format!("{base}/update_weights_from_disk");
    let reply = client.post(&url, &body, Duration::from_secs(120)).await?;
    anyhow::ensure!(reply["success"] == true, "update refused: {reply}");
    Ok(())
}

/// Runs the part: references for A (`dir_a`, served at start) and B, then `clients`
/// clients for `duration` while the weights swap every `every`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    client: &JsonClient,
    base: &str,
    pool: Arc<Vec<Value>>,
    dir_a: &Path,
    dir_b: &Path,
    clients: usize,
    duration: Duration,
    every: Duration,
    seed: u64,
) -> anyhow::Result<WeightsFigures> {
    let url = format!("{base}/generate");
    update(client, base, dir_a, "a-ref").await?;
    let ref_a = reference(client, &url, &pool).await?;
    update(client, base, dir_b, "b-ref").await?;
    let ref_b = reference(client, &url, &pool).await?;
    let differing_references = ref_a
        .iter()
        .zip(&ref_b)
        .filter(|(a, b)| a.tokens != b.tokens)
        .count();

    let updater = {
        let client = client.clone();
        let base = base.to_string();
        let (dir_a, dir_b) = (dir_a.to_path_buf(), dir_b.to_path_buf());
        tokio::spawn(async move {
            let deadline = Instant::now() + duration;
            let (mut done, mut failed) = (0usize, 0usize);
            let mut k = 0usize;
            while Instant::now() < deadline {
                tokio::time::sleep(every).await;
                k += 1;
                let (dir, label) = if k % 2 == 1 {
                    (&dir_a, format!("a-{k}"))
                } else {
                    (&dir_b, format!("b-{k}"))
                };
                match update(&client, &base, dir, &label).await {
                    Ok(()) => done += 1,
                    Err(e) => {
                        tracing::warn!(error = %e, "weight update failed");
                        failed += 1;
                    }
                }
            }
            (done, failed)
        })
    };
    let t = run_clients(client, &url, Arc::clone(&pool), clients, duration, seed).await;
    let (updates, update_failures) = updater.await.unwrap_or((0, 1));

    let (mut aborted, mut checked, mut mismatches) = (0, 0, 0);
    for (i, a) in &t.answers {
        let want: &Answer = if a.version.starts_with('a') {
            &ref_a[*i]
        } else {
            &ref_b[*i]
        };
        if a.aborted {
            aborted += 1;
            let prefix_of = |r: &Answer| r.tokens.starts_with(&a.tokens);
            if !prefix_of(&ref_a[*i]) && !prefix_of(&ref_b[*i]) {
                mismatches += 1;
            }
        } else {
            checked += 1;
            if a.tokens != want.tokens {
                mismatches += 1;
            }
        }
    }
    Ok(WeightsFigures {
        updates,
        update_failures,
        differing_references,
        sent: t.sent,
        failures: t.failures,
        aborted,
        checked,
        mismatches,
        p50_ms: t.quantile_ms(0.5),
        p99_ms: t.quantile_ms(0.99),
    })
}
