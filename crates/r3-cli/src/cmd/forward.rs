//! `r3 forward`: one training-engine forward pass (f32, or its mixed bf16 / f16 forward)
//! over a token sequence, printing
//! the logits and the routes (recorded, or replayed from a canonical route JSON file).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use r3_model::{
    Batch, Config, DeviceSpec, LoadOptions, Model, Precision, ReplayRoutes, Routing, Weights,
};
use r3_routing::RouteTable;
use serde_json::{json, Value};

/// Options of `r3 forward`.
#[derive(Debug, Args)]
pub struct ForwardArgs {
    /// Checkpoint directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated token ids, e.g. `1,17,42`.
    #[arg(long, value_delimiter = ',', required = true)]
    pub input_ids: Vec<u32>,
    /// Replay these routes (canonical route JSON, one table for the sequence, covering
    /// all tokens or all but the last) instead of routing natively.
    #[arg(long)]
    pub replay: Option<PathBuf>,
    /// Write the JSON result here instead of stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Precision of the forward: f32 (the default, reproduces HF), or the training engine's
    /// mixed bf16 / f16 forward (matmuls and activations rounded to it). The weights must lie
    /// in its finite range.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Load weights holding NaN or inf, or values past the `--dtype` range, instead of
    /// refusing them (for inspecting a broken checkpoint).
    #[arg(long)]
    pub allow_non_finite_weights: bool,
    /// Where the forward runs: `cpu`, `cuda` or `cuda:N` (a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

/// The forward's precision named by `--dtype`.
fn precision(dtype: &str) -> anyhow::Result<Precision> {
    Ok(match dtype {
        "f32" | "float32" => Precision::F32,
        "bf16" | "bfloat16" => Precision::Bf16 { router_f32: false },
        "f16" | "float16" => Precision::F16 { router_f32: false },
        other => anyhow::bail!("unknown --dtype {other:?}: expected f32, bf16 or f16"),
    })
}

/// Reads one route table from canonical JSON (an object, or an array holding one object).
fn read_routes(path: &PathBuf) -> anyhow::Result<RouteTable> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let table = match &value {
        Value::Array(items) if items.len() == 1 => &items[0],
        Value::Array(items) => anyhow::bail!(
            "{}: expected one route table for one sequence, found {}",
            path.display(),
            items.len()
        ),
        other => other,
    };
    RouteTable::from_json(table).with_context(|| format!("route table in {}", path.display()))
}

/// Runs `r3 forward`.
pub fn run(args: ForwardArgs) -> anyhow::Result<()> {
    let device = args.device.open()?;
    let cfg = Config::from_file(&args.model.join("config.json"))
        .with_context(|| format!("config of {}", args.model.display()))?;
    super::model_tokenizer(&args.model, cfg.vocab_size)?;
    let precision = precision(&args.dtype)?;
    let load = LoadOptions {
        allow_non_finite: args.allow_non_finite_weights,
        precision: precision.weight_precision(),
        narrow_masters: None,
    };
    let weights = Weights::load_with(&args.model, &cfg, &device, &load)
        .with_context(|| format!("weights of {}", args.model.display()))?;
    let model = Model::with_precision(&cfg, &weights, precision)?;
    let batch = Batch::new(std::slice::from_ref(&args.input_ids), 0, &device)?;

    let replayed = args.replay.as_ref().map(read_routes).transpose()?;
    let replay_input = replayed
        .as_ref()
        .map(|t| ReplayRoutes::new(vec![t.clone()], &cfg.layout))
        .transpose()?;
    let dense = cfg.moe.is_none();
    let routing = match (&replay_input, dense) {
        (Some(_), true) => anyhow::bail!("--replay given, but the model is dense"),
        (Some(routes), false) => Routing::Replay(routes),
        (None, true) => Routing::Native,
        (None, false) => Routing::Record,
    };
    let out = model.forward(&batch, routing)?;
    let logits = out.logits.squeeze(0)?.to_vec2::<f32>()?;

    let routes = match (&out.routes, &replayed) {
        (Some(tables), _) => tables
            .first()
            .map(RouteTable::to_json)
            .unwrap_or(Value::Null),
        (None, Some(table)) => table.to_moe_only(&cfg.layout)?.to_json(),
        (None, None) => Value::Null,
    };
    let mut result = json!({ "logits": logits, "routes": routes });
    if let Some(proof) = &out.replay {
        result["replay"] = json!({
            "layers": proof.layers,
            "replayed_cells": proof.replayed_cells,
            "native_cells": proof.native_cells,
            "differs_from_native": proof.differs_from_native,
            "native_final_position": proof.native_final_position,
        });
    }
    let text = serde_json::to_string(&result)?;
    match &args.out {
        Some(path) => {
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?
        }
        None => println!("{text}"),
    }
    Ok(())
}
