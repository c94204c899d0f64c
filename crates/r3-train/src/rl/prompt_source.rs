//! Where a run's prompts come from: the built-in arithmetic task (the zero-setup default,
//! a seeded stream of generated problems) or a user dataset in verl's schema walked epoch by
//! epoch. Both hand the step the same [`PromptItem`]s: the prompt's text and token ids, plus
//! what the reward needs (ground truth, data source, extra info).
//!
//! Dataset prompts are rendered and encoded once at load; a prompt longer than
//! `data.max_prompt_length` tokens is dropped and counted, never truncated.

use r3_tasks::{
    load_dataset_for, ArithmeticTask, DatasetCursor, DatasetPosition, DatasetRow, GroundTruthUse,
    Problem, Prompt,
};
use r3_text::ChatMessage;
use serde_json::Value;

use crate::policy::model_text::ModelText;

use crate::config::train::{DataConfig, TrainConfig};
use crate::error::{Result, TrainError};

/// One prompt of a step, ready for the engine and the reward.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptItem {
    /// The prompt text as the model sees it (chat template applied when configured).
    pub text: String,
    /// Its token ids (`<bos>` first where the tokenizer has one).
    pub ids: Vec<u32>,
    /// The reference answer as the dataset holds it (any JSON value a `command` verifier
    /// reads; the built-in task's answer as a string).
    pub ground_truth: Value,
    /// The row's data source (`arith` for the built-in task).
    pub data_source: String,
    /// The row's extra info (`null` for the built-in task).
    pub extra_info: Value,
}

/// Data source name of the built-in task's prompts.
pub const ARITH_SOURCE: &str = "arith";

/// Renders a dataset prompt as text: through the model's chat template (with an
/// assistant-turn header, `data.system_prompt` first) when `data.apply_chat_template`,
/// otherwise the plain text (messages joined by newlines) after `system_prompt` and a newline.
pub fn render_prompt(text: &ModelText, prompt: &Prompt, data: &DataConfig) -> Result<String> {
    if data.apply_chat_template {
        let messages: Vec<ChatMessage> = prompt
            .messages()
            .into_iter()
            .map(|m| ChatMessage::new(m.role, m.content))
            .collect();
        return text.render_chat(&messages, &data.system_prompt);
    }
    let plain = prompt.plain_text();
    Ok(if data.system_prompt.is_empty() {
        plain
    } else {
        format!("{}\n{plain}", data.system_prompt)
    })
}

/// Encodes a rendered prompt into the ids a rollout starts from: a templated prompt as
/// transformers does (no special tokens added), a plain one with `<bos>` first. The one
/// place prompt text meets the tokenizer.
pub fn encode_prompt(text: &ModelText, rendered: &str, data: &DataConfig) -> Result<Vec<u32>> {
    if data.apply_chat_template {
        text.encode_rendered(rendered)
    } else {
        text.encode_plain(rendered)
    }
}

/// The built-in task's problem as a prompt item (plain text, `<bos>` first).
pub fn arith_item(text: &ModelText, p: &Problem) -> Result<PromptItem> {
    Ok(PromptItem {
        ids: text.encode_plain(&p.prompt)?,
        text: p.prompt.clone(),
        ground_truth: Value::String(p.answer.to_string()),
        data_source: ARITH_SOURCE.into(),
        extra_info: Value::Null,
    })
}

/// A dataset row rendered and encoded.
pub fn dataset_item(text: &ModelText, row: &DatasetRow, data: &DataConfig) -> Result<PromptItem> {
    let rendered = render_prompt(text, &row.prompt, data)?;
    Ok(PromptItem {
        ids: encode_prompt(text, &rendered, data)?,
        text: rendered,
        ground_truth: row.ground_truth.clone(),
        data_source: row.data_source.clone(),
        extra_info: row.extra_info.clone(),
    })
}

/// Dataset rows that fit `max_prompt_length`, and how many did not.
#[derive(Debug, Clone)]
pub struct LoadedSplit {
    /// Rows kept, in file order.
    pub items: Vec<PromptItem>,
    /// Rows dropped for an overlong prompt.
    pub filtered: usize,
}

/// The most tokens a dataset prompt may hold: `data.max_prompt_length` (0: no limit of its
/// own), and at most `prompt_room`, the most a prompt may hold for the rollout engine to
/// generate after it within the model's context. Longer prompts are dropped at load.
pub fn prompt_limit(data: &DataConfig, prompt_room: usize) -> usize {
    match data.max_prompt_length {
        0 => prompt_room,
        n => n.min(prompt_room),
    }
}

/// Loads, renders and encodes `files`, dropping (and counting) overlong prompts: longer
/// than [`prompt_limit`] (the engine would refuse a prompt without room to generate and
/// fail the whole step). Every ground truth must be what `truth` says the reward needs.
pub fn load_split(
    files: &[std::path::PathBuf],
    tokenizer: &ModelText,
    data: &DataConfig,
    prompt_room: usize,
    split: &str,
    truth: GroundTruthUse,
) -> Result<LoadedSplit> {
    let longest = prompt_limit(data, prompt_room);
    let rows = load_dataset_for(files, &data.prompt_key, truth)?;
    let total = rows.len();
    let mut items = Vec::with_capacity(total);
    for row in &rows {
        let item = dataset_item(tokenizer, row, data)?;
        if item.ids.len() <= longest {
            items.push(item);
        }
    }
    let filtered = total - items.len();
    if filtered > 0 {
        tracing::warn!(
            split,
            filtered,
            total,
            max_prompt_length = data.max_prompt_length,
            prompt_room,
            "dropped prompts longer than data.max_prompt_length or the model's context \
             (never truncated)"
        );
    }
    if items.is_empty() {
        return Err(TrainError::InvalidConfig {
            field: "data.max_prompt_length",
            reason: format!(
                "every one of the {total} {split} prompts is longer than {longest} tokens \
                 (data.max_prompt_length {}; the model's context leaves the rollout engine \
                 room for prompts of at most {prompt_room})",
                data.max_prompt_length
            ),
        });
    }
    Ok(LoadedSplit { items, filtered })
}

/// Refuses a run whose `data.total_epochs` hold fewer prompts than one step takes: it would
/// run no step at all and exit as if it had trained (verl asserts "Train dataloader is
/// empty!" there). r3's steps run across epoch boundaries, so the epochs fill
/// `rows × epochs / prompts_per_step` whole steps.
fn check_epochs_fill_a_step(cfg: &TrainConfig, train: &LoadedSplit) -> Result<()> {
    let rows = train.items.len();
    let epochs = cfg.data.total_epochs;
    if epochs == 0 || cfg.steps == 0 || cfg.total_steps(Some(rows)) > 0 {
        return Ok(());
    }
    let per_step = cfg.rollout.prompts_per_step;
    let dropped = match train.filtered {
        0 => String::new(),
        n => format!(" ({n} more dropped as too long)"),
    };
    Err(TrainError::InvalidConfig {
        field: "data.total_epochs",
        reason: format!(
            "{rows} training prompts{dropped} × {epochs} epochs = {} prompts, fewer than the \
             {per_step} of one step (rollout.prompts_per_step): no step could run; raise \
             data.total_epochs to {} or more, set it to 0 (as many epochs as `steps` needs) or \
             lower rollout.prompts_per_step",
            rows as u64 * epochs,
            per_step.div_ceil(rows.max(1)),
        ),
    })
}

/// The prompts of a run.
#[derive(Debug)]
pub enum PromptSource {
    /// The built-in arithmetic task: its eval set and the word position of the seeded
    /// training stream.
    Arithmetic {
        /// The task with its held-out eval set.
        task: ArithmeticTask,
        /// Word position of the training stream's RNG.
        stream_pos: u128,
    },
    /// A user dataset.
    Dataset {
        /// Training prompts that fit.
        train: LoadedSplit,
        /// Validation prompts (the first `eval.size`, or all when 0).
        val: Vec<PromptItem>,
        /// Where the run is in the training prompts.
        cursor: DatasetCursor,
    },
}

impl PromptSource {
    /// The source `cfg` describes: the arithmetic task when `data.train_files` is empty.
    /// `stream_pos` / `position` resume a checkpoint (None = the start).
    pub fn new(
        cfg: &TrainConfig,
        tokenizer: &ModelText,
        prompt_room: usize,
        stream_pos: Option<u128>,
        position: Option<DatasetPosition>,
    ) -> Result<Self> {
        let data = &cfg.data;
        if data.train_files.is_empty() {
            let task = ArithmeticTask::new(
                r3_tasks::Difficulty::level(cfg.task.difficulty)?,
                cfg.eval.size,
                cfg.eval.seed,
            )?;
            let stream_pos = stream_pos.unwrap_or_else(|| task.train_stream(cfg.seed).word_pos());
            return Ok(PromptSource::Arithmetic { task, stream_pos });
        }
        let truth = cfg.reward.ground_truth_use();
        let train = load_split(
            &data.train_files,
            tokenizer,
            data,
            prompt_room,
            "train",
            truth,
        )?;
        check_epochs_fill_a_step(cfg, &train)?;
        let mut val = if data.val_files.is_empty() {
            Vec::new()
        } else {
            load_split(&data.val_files, tokenizer, data, prompt_room, "val", truth)?.items
        };
        if cfg.eval.size > 0 {
            val.truncate(cfg.eval.size);
        }
        tracing::info!(
            train = train.items.len(),
            train_filtered = train.filtered,
            val = val.len(),
            "dataset loaded"
        );
        let cursor = DatasetCursor::new(
            train.items.len(),
            data.shuffle,
            cfg.seed,
            position.unwrap_or_default(),
        );
        Ok(PromptSource::Dataset { train, val, cursor })
    }

    /// The next `n` training prompts.
    pub fn next_items(
        &mut self,
        n: usize,
        seed: u64,
        tokenizer: &ModelText,
    ) -> Result<Vec<PromptItem>> {
        match self {
            PromptSource::Arithmetic { task, stream_pos } => {
                let mut stream = task.train_stream(seed);
                stream.set_word_pos(*stream_pos);
                let problems = stream.take_problems(n)?;
                *stream_pos = stream.word_pos();
                problems.iter().map(|p| arith_item(tokenizer, p)).collect()
            }
            PromptSource::Dataset { train, cursor, .. } => Ok(cursor
                .take(n)
                .into_iter()
                .map(|i| train.items[i].clone())
                .collect()),
        }
    }

    /// The held-out prompts.
    pub fn eval_items(&self, tokenizer: &ModelText) -> Result<Vec<PromptItem>> {
        match self {
            PromptSource::Arithmetic { task, .. } => task
                .eval_set()
                .iter()
                .map(|p| arith_item(tokenizer, p))
                .collect(),
            PromptSource::Dataset { val, .. } => Ok(val.clone()),
        }
    }

    /// The arithmetic stream position (0 for a dataset).
    pub fn stream_pos(&self) -> u128 {
        match self {
            PromptSource::Arithmetic { stream_pos, .. } => *stream_pos,
            PromptSource::Dataset { .. } => 0,
        }
    }

    /// The dataset position (None for the arithmetic task).
    pub fn dataset_position(&self) -> Option<DatasetPosition> {
        match self {
            PromptSource::Arithmetic { .. } => None,
            PromptSource::Dataset { cursor, .. } => Some(cursor.position()),
        }
    }

    /// Training prompts dropped for length (0 for the arithmetic task).
    pub fn filtered(&self) -> usize {
        match self {
            PromptSource::Arithmetic { .. } => 0,
            PromptSource::Dataset { train, .. } => train.filtered,
        }
    }
}
