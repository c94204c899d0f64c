//! `r3 bench routes`: for each route wire format, payload size (bytes per token) and decode
//! throughput (payload MB/s, tokens/s) on a synthetic seeded table, next to r3's own forms.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use r3_routing::wire::{binary, sglang, vllm, vllm_json, WireDtype, WireShape};
use r3_routing::{LayerLayout, LayerSpace, RouteTable};

use super::cpu_time::thread_cpu_ns;

/// Options of `r3 bench routes`.
#[derive(Debug, Args)]
pub struct BenchRoutesArgs {
    /// Tokens (rows) in the synthetic table.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Transformer layers (default: Qwen3-30B-A3B's 48).
    #[arg(long, default_value_t = 48)]
    pub num_layers: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Routed experts per layer.
    #[arg(long, default_value_t = 128)]
    pub num_experts: usize,
    /// Leading dense layers (DeepSeek style); decoders then check and drop them.
    #[arg(long, default_value_t = 0)]
    pub first_k_dense: usize,
    /// Seconds of decoding per format.
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Seed of the synthetic routes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// splitmix64: a tiny seeded generator, enough for synthetic routes.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A MoE-only table of distinct random experts per cell.
fn synthetic(a: &BenchRoutesArgs, layout: &LayerLayout) -> anyhow::Result<RouteTable> {
    let mut rng = SplitMix(a.seed);
    let moe = layout.moe_layers().to_vec();
    let mut t = RouteTable::missing(
        a.num_experts,
        a.top_k,
        LayerSpace::MoeOnly,
        moe.clone(),
        0,
        a.tokens,
    )?;
    let mut cell = Vec::with_capacity(a.top_k);
    for tok in 0..a.tokens {
        for c in 0..moe.len() {
            cell.clear();
            while cell.len() < a.top_k {
                let e = (rng.next() % a.num_experts as u64) as u32;
                if !cell.contains(&e) {
                    cell.push(e);
                }
            }
            t.set_cell(tok, c, &cell)?;
        }
    }
    Ok(t)
}

/// Mean wall time and mean on-CPU time (if measurable) of one decode.
struct Timing {
    wall: Duration,
    cpu: Option<Duration>,
}

/// Checks that `decode` gives back `expected`, then runs it repeatedly for about `seconds`
/// of wall time.
fn time_decode(
    seconds: f64,
    expected: &RouteTable,
    mut decode: impl FnMut() -> anyhow::Result<RouteTable>,
) -> anyhow::Result<Timing> {
    anyhow::ensure!(
        &decode()? == expected,
        "decoded table differs from the encoded one"
    );
    let budget = Duration::from_secs_f64(seconds.max(0.01));
    let cpu0 = thread_cpu_ns();
    let start = Instant::now();
    let mut runs = 0u32;
    while runs == 0 || start.elapsed() < budget {
        std::hint::black_box(decode()?);
        runs += 1;
    }
    let wall = start.elapsed() / runs;
    let cpu = match (cpu0, thread_cpu_ns()) {
        (Some(a), Some(b)) if b > a => Some(Duration::from_nanos((b - a) / u64::from(runs))),
        _ => None,
    };
    Ok(Timing { wall, cpu })
}

/// Runs the benchmark and prints one line per format.
pub fn run(a: BenchRoutesArgs) -> anyhow::Result<()> {
    let layout = LayerLayout::first_k_dense(a.num_layers, a.first_k_dense)?;
    let table = synthetic(&a, &layout)?;
    let l = a.num_layers;
    let shape = WireShape::new(l, a.top_k, a.num_experts).with_layout(layout.clone())?;
    let lay = Some(&layout);
    let mut rows: Vec<(String, usize, Timing)> = Vec::new();
    for dtype in [WireDtype::I32, WireDtype::U16, WireDtype::U8] {
        if dtype.max_id() < a.num_experts as i64 - 1 {
            continue;
        }
        let payload = sglang::encode_sglang(&table, dtype, l, lay)?;
        let dt = time_decode(a.seconds, &table, || {
            Ok(sglang::decode_sglang(&payload, dtype, &shape)?)
        })?;
        rows.push((format!("sglang base64 {}", dtype.name()), payload.len(), dt));
    }
    for dtype in [WireDtype::I32, WireDtype::U16, WireDtype::U8] {
        if dtype.max_id() < a.num_experts as i64 - 1 {
            continue;
        }
        let payload = vllm::encode_vllm(&table, dtype, 1, l, lay)?;
        let dt = time_decode(a.seconds, &table, || {
            Ok(vllm::decode_vllm(&payload, &shape)?)
        })?;
        rows.push((
            format!("vllm base64 npy {}", r3_routing::wire::npy::descr(dtype)),
            payload.len(),
            dt,
        ));
    }
    let payload = vllm_json::encode_vllm_json(&table, 0, l, lay)?.to_string();
    let dt = time_decode(a.seconds, &table, || {
        let v: serde_json::Value = serde_json::from_str(&payload)?;
        let mut ts = vllm_json::decode_vllm_json(&v, &shape)?;
        ts.pop().context("no choice decoded")
    })?;
    rows.push(("vllm-json nested".to_string(), payload.len(), dt));
    let payload = table.to_json_string();
    let dt = time_decode(a.seconds, &table, || {
        Ok(RouteTable::from_json_str(&payload)?)
    })?;
    rows.push(("r3 canonical json".to_string(), payload.len(), dt));
    let payload = binary::encode_binary(&table);
    let dt = time_decode(a.seconds, &table, || Ok(binary::decode_binary(&payload)?))?;
    rows.push(("r3-bin (compact binary)".to_string(), payload.len(), dt));

    let bin_bytes = rows.last().map_or(1, |r| r.1).max(1);
    println!(
        "routes bench: {} tokens x {} layers ({} MoE) x top_{} of {} experts, seed {}",
        a.tokens,
        l,
        layout.num_moe_layers(),
        a.top_k,
        a.num_experts,
        a.seed
    );
    println!(
        "{:<26} {:>10} {:>9} {:>9} {:>13} {:>13} {:>10}",
        "format", "bytes", "B/token", "x r3-bin", "MB/s (wall)", "MB/s (cpu)", "Mtok/s cpu"
    );
    for (name, bytes, t) in &rows {
        let mbps = |d: Duration| *bytes as f64 / d.as_secs_f64().max(1e-12) / 1e6;
        let cpu = t.cpu.unwrap_or(t.wall);
        println!(
            "{:<26} {:>10} {:>9.1} {:>9.2} {:>13.1} {:>13.1} {:>10.3}",
            name,
            bytes,
            *bytes as f64 / a.tokens.max(1) as f64,
            *bytes as f64 / bin_bytes as f64,
            mbps(t.wall),
            mbps(cpu),
            a.tokens as f64 / cpu.as_secs_f64().max(1e-12) / 1e6
        );
    }
    if rows.iter().any(|r| r.2.cpu.is_none()) {
        println!("(on-CPU time unavailable on this system: the cpu columns repeat wall time)");
    }
    Ok(())
}
