//! `r3 routes ...`: decode wire payloads (stdin) to canonical JSON, encode canonical JSON to
//! a wire format, diff two route tables, and print expert-load statistics.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use r3_routing::wire::{binary, sglang, vllm, vllm_json, WireDtype, WireShape};
use r3_routing::{divergence, expert_load, LayerLayout, RouteTable};
use serde_json::Value;

/// Route subcommands.
#[derive(Debug, Subcommand)]
pub enum RoutesCommand {
    /// Read a payload on stdin, validate it and print canonical r3 JSON.
    Decode(DecodeArgs),
    /// Read canonical r3 JSON on stdin and write it in a wire format.
    Encode(EncodeArgs),
    /// Print divergence statistics (JSON) between two canonical route files.
    Diff(DiffArgs),
    /// Print per-layer expert-load statistics (JSON) of a canonical route file.
    Load(LoadArgs),
}

/// Wire formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// SGLang: base64 flat little-endian (bare string or a response with meta_info).
    Sglang,
    /// vLLM >= 0.22: base64 .npy (bare string or JSON with routed_experts).
    Vllm,
    /// vLLM 0.21: nested JSON prompt_routed_experts + choices[].routed_experts.
    VllmJson,
    /// r3 canonical JSON.
    R3,
    /// r3 compact binary (raw bytes).
    R3Bin,
}

/// The model facts a wire payload is read against.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Transformer layers on the wire (num_hidden_layers, dense layers included).
    #[arg(long)]
    pub num_layers: Option<usize>,
    /// Experts per token per layer.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Routed (logical) experts per MoE layer.
    #[arg(long)]
    pub num_experts: Option<usize>,
    /// The first N layers are dense (DeepSeek first_k_dense_replace): output MoE-only.
    #[arg(long, conflicts_with = "moe_layers")]
    pub first_k_dense: Option<usize>,
    /// Explicit comma-separated MoE layer indices: output MoE-only.
    #[arg(long, value_delimiter = ',')]
    pub moe_layers: Option<Vec<usize>>,
}

impl ModelArgs {
    fn layout(&self, num_layers: usize) -> anyhow::Result<Option<LayerLayout>> {
        Ok(match (&self.first_k_dense, &self.moe_layers) {
            (Some(k), _) => Some(LayerLayout::first_k_dense(num_layers, *k)?),
            (None, Some(m)) => Some(LayerLayout::new(num_layers, m.clone())?),
            (None, None) => None,
        })
    }

    fn wire_shape(&self, start_len: usize) -> anyhow::Result<WireShape> {
        let need = |v: Option<usize>, name: &str| {
            v.with_context(|| format!("--{name} is required for this format"))
        };
        let l = need(self.num_layers, "num-layers")?;
        let mut shape = WireShape::new(
            l,
            need(self.top_k, "top-k")?,
            need(self.num_experts, "num-experts")?,
        )
        .with_start_len(start_len);
        if let Some(layout) = self.layout(l)? {
            shape = shape.with_layout(layout)?;
        }
        Ok(shape)
    }
}

/// Options of `r3 routes decode`.
#[derive(Debug, Args)]
pub struct DecodeArgs {
    /// Payload format on stdin.
    #[arg(long, value_enum)]
    pub format: Format,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Element dtype of a bare SGLang payload (int32 | uint16 | uint8; default int32).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Position of the first row (tokens not captured at the start).
    #[arg(long, default_value_t = 0)]
    pub start_len: usize,
    /// Which choice of a vLLM response (vllm, vllm-json) to print; needed when it has several.
    #[arg(long)]
    pub choice: Option<usize>,
    /// Pretty-print the JSON.
    #[arg(long)]
    pub pretty: bool,
}

/// Options of `r3 routes encode`.
#[derive(Debug, Args)]
pub struct EncodeArgs {
    /// Output format.
    #[arg(long, value_enum)]
    pub format: Format,
    /// Layers to write (defaults to the table's columns for an all-layers table).
    #[arg(long)]
    pub num_layers: Option<usize>,
    /// The first N layers are dense (needed to write a MoE-only table).
    #[arg(long, conflicts_with = "moe_layers")]
    pub first_k_dense: Option<usize>,
    /// Explicit comma-separated MoE layer indices.
    #[arg(long, value_delimiter = ',')]
    pub moe_layers: Option<Vec<usize>>,
    /// Element dtype for sglang / vllm (default int32).
    #[arg(long, default_value = "int32")]
    pub dtype: String,
    /// NPY format version for vllm (1, 2 or 3).
    #[arg(long, default_value_t = 1)]
    pub npy_version: u8,
    /// Rows that belong to the prompt (vllm-json prompt_routed_experts).
    #[arg(long, default_value_t = 0)]
    pub prompt_rows: usize,
}

/// Options of `r3 routes diff`.
#[derive(Debug, Args)]
pub struct DiffArgs {
    /// First canonical route file.
    pub a: PathBuf,
    /// Second canonical route file.
    pub b: PathBuf,
}

/// Options of `r3 routes load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Canonical route file.
    pub file: PathBuf,
}

/// Runs one route subcommand.
pub fn run(command: RoutesCommand) -> anyhow::Result<()> {
    match command {
        RoutesCommand::Decode(a) => decode(a),
        RoutesCommand::Encode(a) => encode(a),
        RoutesCommand::Diff(a) => diff(a),
        RoutesCommand::Load(a) => load(a),
    }
}

fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    std::io::stdin()
        .read_to_end(&mut buf)
        .context("reading stdin")?;
    Ok(buf)
}

fn utf8(bytes: Vec<u8>) -> anyhow::Result<String> {
    String::from_utf8(bytes).context("stdin is not UTF-8 text")
}

fn parse_dtype(name: &str) -> anyhow::Result<WireDtype> {
    WireDtype::parse(name)
        .with_context(|| format!("unknown dtype {name:?} (int32, int16, uint16, uint8)"))
}

fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    if a.dtype.is_some() && a.format != Format::Sglang {
        bail!("--dtype applies to --format sglang only (the other formats carry their dtype)");
    }
    if a.choice.is_some() && !matches!(a.format, Format::Vllm | Format::VllmJson) {
        bail!("--choice applies to --format vllm and vllm-json only (the others hold one table)");
    }
    let input = read_stdin()?;
    let table = match a.format {
        Format::Sglang => {
            let shape = a.model.wire_shape(a.start_len)?;
            let text = utf8(input)?;
            let trimmed = text.trim();
            if trimmed.starts_with('{') {
                let mut v: Value =
                    serde_json::from_str(trimmed).context("sglang payload is not valid JSON")?;
                if let Some(d) = &a.dtype {
                    apply_dtype_flag(&mut v, d)?;
                }
                sglang::decode_sglang_response(&v, &shape)?
            } else {
                let dtype = parse_dtype(a.dtype.as_deref().unwrap_or("int32"))?;
                sglang::decode_sglang(trimmed.trim_matches('"'), dtype, &shape)?
            }
        }
        Format::Vllm => {
            let (text, shape) = (utf8(input)?, a.model.wire_shape(a.start_len)?);
            match a.choice {
                // Without --choice a response of several choices is refused, not read as 0.
                None => vllm::decode_vllm_payload(&text, &shape)?,
                Some(choice) => vllm::decode_vllm_choice(&text, choice, &shape)?,
            }
        }
        Format::VllmJson => {
            let v: Value = serde_json::from_str(&utf8(input)?)
                .context("vllm-json payload is not valid JSON")?;
            let mut tables = vllm_json::decode_vllm_json(&v, &a.model.wire_shape(a.start_len)?)?;
            let n = tables.len();
            let choice = match a.choice {
                Some(c) if c >= n => bail!("--choice {c} but the payload has {n} choice(s)"),
                Some(c) => c,
                None if n > 1 => bail!("the payload has {n} choices: name one with --choice"),
                None => 0,
            };
            tables.swap_remove(choice)
        }
        Format::R3 => self_describing(RouteTable::from_json_str(&utf8(input)?)?, &a.model)?,
        Format::R3Bin => self_describing(binary::decode_binary(&input)?, &a.model)?,
    };
    tracing::debug!(
        rows = table.num_tokens(),
        columns = table.num_columns(),
        start = table.start_pos(),
        space = table.space().as_str(),
        "decoded routes"
    );
    let v = table.to_json();
    let text = if a.pretty {
        serde_json::to_string_pretty(&v)?
    } else {
        v.to_string()
    };
    println!("{text}");
    Ok(())
}

/// A `--dtype` flag next to a JSON response: fill in a missing dtype, refuse a conflicting one.
fn apply_dtype_flag(v: &mut Value, flag: &str) -> anyhow::Result<()> {
    let flag_dtype = parse_dtype(flag)?;
    let meta = match v.get_mut("meta_info") {
        Some(m) => m,
        None => v,
    };
    let obj = meta
        .as_object_mut()
        .context("sglang meta_info is not an object")?;
    match obj.get("routed_experts_dtype").and_then(Value::as_str) {
        Some(s) if WireDtype::parse(s) != Some(flag_dtype) => {
            bail!("--dtype {flag} conflicts with routed_experts_dtype {s:?} in the payload")
        }
        Some(_) => {}
        None => {
            obj.insert(
                "routed_experts_dtype".into(),
                Value::from(flag_dtype.name()),
            );
        }
    }
    Ok(())
}

/// For self-describing formats, model flags are checks (and a layout converts to MoE-only).
fn self_describing(table: RouteTable, m: &ModelArgs) -> anyhow::Result<RouteTable> {
    if let Some(e) = m.num_experts.filter(|&e| e != table.num_experts()) {
        bail!(
            "--num-experts {e} but the table has {} experts",
            table.num_experts()
        );
    }
    if let Some(k) = m.top_k.filter(|&k| k != table.top_k()) {
        bail!("--top-k {k} but the table has top_k {}", table.top_k());
    }
    let Some(l) = m.num_layers else {
        if m.first_k_dense.is_some() || m.moe_layers.is_some() {
            bail!("--num-layers is required with a layer layout");
        }
        return Ok(table);
    };
    match m.layout(l)? {
        Some(layout) => Ok(table.to_moe_only(&layout)?),
        None if table.num_columns() != l && table.space() == r3_routing::LayerSpace::AllLayers => {
            bail!(
                "--num-layers {l} but the table has {} layers",
                table.num_columns()
            )
        }
        None => Ok(table),
    }
}

fn encode(a: EncodeArgs) -> anyhow::Result<()> {
    let table = RouteTable::from_json_str(&utf8(read_stdin()?)?)?;
    let mut out = std::io::stdout().lock();
    match a.format {
        Format::R3 => return Ok(writeln!(out, "{}", table.to_json())?),
        Format::R3Bin => return Ok(out.write_all(&binary::encode_binary(&table))?),
        Format::Sglang | Format::Vllm | Format::VllmJson => {}
    }
    let num_layers = match (a.num_layers, table.space()) {
        (Some(l), _) => l,
        (None, r3_routing::LayerSpace::AllLayers) => table.num_columns(),
        (None, r3_routing::LayerSpace::MoeOnly) => {
            bail!("--num-layers is required to write a MoE-only table in all-layers wire form")
        }
    };
    let layout = match (a.first_k_dense, &a.moe_layers) {
        (Some(k), _) => Some(LayerLayout::first_k_dense(num_layers, k)?),
        (None, Some(m)) => Some(LayerLayout::new(num_layers, m.clone())?),
        (None, None) => implied_layout(&table, num_layers)?,
    };
    let dtype = parse_dtype(&a.dtype)?;
    let text = match a.format {
        Format::Sglang => sglang::encode_sglang(&table, dtype, num_layers, layout.as_ref())?,
        Format::Vllm => {
            vllm::encode_vllm(&table, dtype, a.npy_version, num_layers, layout.as_ref())?
        }
        _ => vllm_json::encode_vllm_json(&table, a.prompt_rows, num_layers, layout.as_ref())?
            .to_string(),
    };
    writeln!(out, "{text}")?;
    Ok(())
}

/// The layout a MoE-only table states by itself: when its layers are exactly
/// `0..num_layers`, every layer is MoE and no `--first-k-dense` / `--moe-layers` is needed.
/// Any other MoE-only table (or an all-layers one, which needs none) states none.
fn implied_layout(table: &RouteTable, num_layers: usize) -> anyhow::Result<Option<LayerLayout>> {
    let all_moe = table.space() == r3_routing::LayerSpace::MoeOnly
        && table.layers().iter().copied().eq(0..num_layers);
    Ok(if all_moe {
        Some(LayerLayout::first_k_dense(num_layers, 0)?)
    } else {
        None
    })
}

fn read_table(path: &PathBuf) -> anyhow::Result<RouteTable> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    RouteTable::from_json_str(&text).with_context(|| format!("{}", path.display()))
}

fn diff(a: DiffArgs) -> anyhow::Result<()> {
    let (ta, tb) = (read_table(&a.a)?, read_table(&a.b)?);
    let d = divergence(&ta, &tb)?;
    println!("{}", serde_json::to_string_pretty(&d)?);
    Ok(())
}

fn load(a: LoadArgs) -> anyhow::Result<()> {
    let t = read_table(&a.file)?;
    println!("{}", serde_json::to_string_pretty(&expert_load(&t))?);
    Ok(())
}
