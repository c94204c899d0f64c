//! `r3 data`: inspecting and making RL datasets. `show` prints, for the first rows of a
//! config's training data (or the built-in task's problems), the prompt rendered as the
//! trainer renders it (the model's chat template when `data.apply_chat_template`), its token
//! ids from the model's tokenizer, the ground truth and the reward of a given response, so
//! a template and a reward can be checked before a run; a row the trainer would drop as too
//! long is printed with `kept: false` beside the limit it passes. `generate` writes the GSM8K-format
//! word-problem dataset in verl's schema as JSONL and Parquet.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use r3_model::Config as ModelConfig;
use r3_tasks::dataset::jsonl::to_jsonl;
use r3_tasks::dataset::write_parquet;
use r3_tasks::{gsm8k_style_splits, load_dataset_for, Reward, RewardInput};
use r3_train::rl::prompt_source::{encode_prompt, prompt_limit, render_prompt, PromptSource};
use r3_train::ModelText;
use serde_json::{json, Value};

use super::train::resolve_config;

/// `r3 data` subcommands.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Print the first rows as the trainer sees them: prompt text, token ids, ground truth,
    /// whether the trainer keeps the row (`kept: false`: dropped as longer than
    /// `prompt_limit` tokens), and the reward of `--response` (JSON, one object per line).
    Show(ShowArgs),
    /// Write the GSM8K-format word-problem dataset (train / val, JSONL and Parquet).
    Generate(GenerateArgs),
}

/// Arguments of `r3 data show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Training config (its `[data]`, `[reward]` and `model_dir`); without it the built-in
    /// default experiment.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config key (repeatable), as in `r3 train`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Rows to print.
    #[arg(long, default_value_t = 3)]
    pub n: usize,
    /// A response to score against every row (omitted: no reward is computed).
    #[arg(long)]
    pub response: Option<String>,
    /// Show the validation files instead of the training files.
    #[arg(long)]
    pub val: bool,
}

/// Arguments of `r3 data generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Output directory (`train.jsonl`, `train.parquet`, `val.jsonl`, `val.parquet`).
    #[arg(long)]
    pub out: PathBuf,
    /// Training rows.
    #[arg(long, default_value_t = 2000)]
    pub train: usize,
    /// Validation rows (no question shared with training).
    #[arg(long, default_value_t = 200)]
    pub val: usize,
    /// Seed of the problems.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs an `r3 data` subcommand.
pub fn run(c: DataCommand) -> anyhow::Result<()> {
    match c {
        DataCommand::Show(a) => show(a),
        DataCommand::Generate(a) => generate(a),
    }
}

/// A row as `show` prints it, before the reward.
struct Shown {
    text: String,
    ids: Result<Vec<u32>, String>,
    ground_truth: Value,
    data_source: String,
    extra_info: Value,
    /// Whether training keeps the row (`None`: its prompt could not be encoded).
    kept: Option<bool>,
}

fn show(a: ShowArgs) -> anyhow::Result<()> {
    let cfg = resolve_config(a.config.as_deref(), &a.set)?;
    let tokenizer = ModelText::from_model_dir(&cfg.model_dir)
        .with_context(|| format!("loading the tokenizer of {}", cfg.model_dir.display()))?;
    // The longest prompt training keeps (None: the built-in task, nothing dropped).
    let mut limit = None;
    let rows: Vec<Shown> = if cfg.uses_dataset() {
        let config = cfg.model_dir.join("config.json");
        let model = ModelConfig::from_file(&config).with_context(|| {
            format!(
                "reading {} (its max_position_embeddings bounds the prompts training keeps)",
                config.display()
            )
        })?;
        let longest = prompt_limit(&cfg.data, cfg.prompt_room(model.max_position_embeddings));
        limit = Some(longest);
        let files = if a.val {
            &cfg.data.val_files
        } else {
            &cfg.data.train_files
        };
        let truth = cfg.reward.ground_truth_use();
        let mut rows = load_dataset_for(files, &cfg.data.prompt_key, truth)?;
        rows.truncate(a.n);
        rows.into_iter()
            .map(|r| {
                let text = render_prompt(&tokenizer, &r.prompt, &cfg.data)?;
                let ids = encode_prompt(&tokenizer, &text, &cfg.data).map_err(|e| e.to_string());
                Ok(Shown {
                    kept: ids.as_ref().ok().map(|ids| ids.len() <= longest),
                    text,
                    ids,
                    ground_truth: r.ground_truth,
                    data_source: r.data_source,
                    extra_info: r.extra_info,
                })
            })
            .collect::<anyhow::Result<_>>()?
    } else {
        // The built-in task's prompts: no dataset to hold to the model's context.
        let mut source = PromptSource::new(&cfg, &tokenizer, usize::MAX, None, None)?;
        let items = if a.val {
            let mut v = source.eval_items(&tokenizer)?;
            v.truncate(a.n);
            v
        } else {
            source.next_items(a.n, cfg.seed, &tokenizer)?
        };
        items
            .into_iter()
            .map(|i| Shown {
                text: i.text,
                ids: Ok(i.ids),
                ground_truth: i.ground_truth,
                data_source: i.data_source,
                extra_info: i.extra_info,
                kept: Some(true),
            })
            .collect()
    };
    let scores = match &a.response {
        Some(response) => {
            let reward = Reward::from_spec(&cfg.reward, cfg.task.format_reward as f32);
            let inputs: Vec<RewardInput<'_>> = rows
                .iter()
                .map(|r| RewardInput {
                    prompt: &r.text,
                    response,
                    ground_truth: &r.ground_truth,
                    data_source: &r.data_source,
                    extra_info: &r.extra_info,
                })
                .collect();
            Some(reward.score_batch(&inputs)?)
        }
        None => None,
    };
    for (i, r) in rows.iter().enumerate() {
        let score = scores.as_ref().map(|s| s[i]);
        let (ids, error) = match &r.ids {
            Ok(ids) => (Some(ids), None),
            Err(e) => (None, Some(e)),
        };
        println!(
            "{}",
            json!({
                "row": i,
                "data_source": r.data_source,
                "chat_template": cfg.data.apply_chat_template && cfg.uses_dataset(),
                "prompt_text": r.text,
                "token_ids": ids,
                "num_tokens": ids.map(Vec::len),
                "encode_error": error,
                "kept": r.kept,
                "prompt_limit": limit,
                "ground_truth": r.ground_truth,
                "extra_info": r.extra_info,
                "response": a.response,
                "reward": score.map(|s| s.reward),
                "correct": score.map(|s| s.correct),
            })
        );
    }
    Ok(())
}

fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let (train, val) = gsm8k_style_splits(a.train, a.val, a.seed).with_context(|| {
        format!(
            "could not draw {} distinct problems from the word-problem space",
            a.train + a.val
        )
    })?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut files = Vec::new();
    for (name, rows) in [("train", &train), ("val", &val)] {
        let jsonl = a.out.join(format!("{name}.jsonl"));
        std::fs::write(&jsonl, to_jsonl(rows, "prompt"))
            .with_context(|| format!("writing {}", jsonl.display()))?;
        let parquet = a.out.join(format!("{name}.parquet"));
        write_parquet(&parquet, rows, "prompt")?;
        files.push(jsonl);
        files.push(parquet);
    }
    println!(
        "{}",
        json!({ "train": train.len(), "val": val.len(), "seed": a.seed, "files": files })
    );
    Ok(())
}
