//! The word-problem pretraining corpus: an endless seeded stream of r3-tasks GSM8K-format
//! problems that skips every question of the excluded datasets (the RL validation set), the
//! byte-level BPE tokenizer with a ChatML template trained on it, and the next-token batches:
//! the question rendered with the chat template exactly as the RL prompt is rendered, then
//! the worked answer and `<|im_end|>`, the loss on the answer only.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use r3_tasks::{load_dataset, WordProblem};
use r3_text::{
    train_bpe, write_tokenizer_config, BpeTrainSpec, ChatMessage, ChatTemplate, SpecialTokens,
    TextTokenizer, CHATML_TEMPLATE,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, TrainError};
use crate::policy::model_text::ModelText;
use crate::pretrain::config::TokenizerSpec;

/// Padding token of the BPE (id 0).
pub const PAD_TOKEN: &str = "<|endoftext|>";
/// Start of a chat turn (id 1).
pub const TURN_START: &str = "<|im_start|>";
/// End of a chat turn and the eos of generation (id 2).
pub const TURN_END: &str = "<|im_end|>";

/// Draws before the stream gives up finding a question outside the excluded set.
const MAX_SKIPS_PER_PROBLEM: usize = 10_000;

/// The special tokens of the BPE as `tokenizer_config.json` declares them: no `<bos>`
/// (ChatML, as Qwen), eos `<|im_end|>`, pad `<|endoftext|>`.
pub fn bpe_special_tokens() -> SpecialTokens {
    SpecialTokens {
        bos: None,
        eos: Some(TURN_END.into()),
        pad: Some(PAD_TOKEN.into()),
        unk: None,
        add_bos_token: Some(false),
        add_eos_token: Some(false),
    }
}

/// The prompt texts (messages joined as plain text) of the datasets in `files`.
pub fn excluded_prompts(files: &[PathBuf]) -> Result<HashSet<String>> {
    if files.is_empty() {
        return Ok(HashSet::new());
    }
    Ok(load_dataset(files, "prompt")?
        .into_iter()
        .map(|r| r.prompt.plain_text())
        .collect())
}

/// Seeded word problems whose prompt is not in an excluded set.
#[derive(Debug)]
pub struct WordProblemStream {
    rng: ChaCha8Rng,
    exclude: HashSet<String>,
    /// Draws skipped because their question is excluded.
    pub skipped: u64,
}

impl WordProblemStream {
    /// The stream of seed `seed`, never yielding a prompt of `exclude`.
    pub fn new(seed: u64, exclude: HashSet<String>) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            exclude,
            skipped: 0,
        }
    }

    /// The next problem outside the excluded set.
    pub fn next_problem(&mut self) -> Result<WordProblem> {
        for _ in 0..MAX_SKIPS_PER_PROBLEM {
            let p = WordProblem::generate(&mut self.rng);
            if !self
                .exclude
                .contains(&p.to_row("train", 0).prompt.plain_text())
            {
                return Ok(p);
            }
            self.skipped += 1;
        }
        Err(TrainError::ProblemStreamEnded)
    }
}

/// The problem's question as RL chat messages (the dataset row's prompt).
pub fn prompt_messages(p: &WordProblem) -> Vec<ChatMessage> {
    p.to_row("train", 0)
        .prompt
        .messages()
        .into_iter()
        .map(|m| ChatMessage::new(m.role, m.content))
        .collect()
}

/// The text the model must produce: the worked answer, then `<|im_end|>`.
pub fn answer_text(p: &WordProblem) -> String {
    format!("{}{TURN_END}", p.solution)
}

/// Trains the BPE on the first `spec.train_texts` problems of `stream` (rendered prompt +
/// answer) and wraps it with its ChatML template.
pub fn train_word_problem_tokenizer(
    stream: &mut WordProblemStream,
    spec: &TokenizerSpec,
    system_prompt: &str,
) -> Result<ModelText> {
    let special = bpe_special_tokens();
    let template = ChatTemplate::new(CHATML_TEMPLATE, special.clone())?;
    let opts = r3_text::RenderOptions {
        add_generation_prompt: true,
        system_prompt: (!system_prompt.is_empty()).then(|| system_prompt.to_string()),
        ..Default::default()
    };
    let mut texts = Vec::with_capacity(spec.train_texts);
    for _ in 0..spec.train_texts {
        let p = stream.next_problem()?;
        texts.push(template.render(&prompt_messages(&p), &opts)? + &answer_text(&p));
    }
    let bpe = BpeTrainSpec {
        vocab_size: spec.vocab_size,
        min_frequency: spec.min_frequency,
        special_tokens: vec![PAD_TOKEN.into(), TURN_START.into(), TURN_END.into()],
    };
    let tokenizer = TextTokenizer::from_tokenizer(train_bpe(&texts, &bpe)?, special)?;
    Ok(ModelText::from_parts(tokenizer, Some(template)))
}

/// Writes `tokenizer.json` and `tokenizer_config.json` (special tokens, ChatML template).
pub fn write_word_problem_tokenizer(text: &ModelText, dir: &Path) -> Result<()> {
    let path = dir.join("tokenizer.json");
    text.tokenizer()
        .inner()
        .save(&path, true)
        .map_err(|source| r3_text::TextError::Tokenizers {
            action: "writing tokenizer.json",
            source,
        })?;
    write_tokenizer_config(dir, &bpe_special_tokens(), Some(CHATML_TEMPLATE))?;
    Ok(())
}

/// One training example: prompt ids (the rendered chat prompt) and answer ids.
pub fn example(
    text: &ModelText,
    p: &WordProblem,
    system_prompt: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let prompt = text.render_chat(&prompt_messages(p), system_prompt)?;
    Ok((
        text.encode_rendered(&prompt)?,
        text.encode_rendered(&answer_text(p))?,
    ))
}

/// The batch of `examples` as the pretraining loss wants it: input sequences (prompt + answer
/// minus the last token), next-token targets `[B, T]` and a mask `[B, T]` that is 1 exactly
/// where the target is an answer token.
pub fn batch_tensors(examples: &[(Vec<u32>, Vec<u32>)]) -> Result<(Vec<Vec<u32>>, Tensor, Tensor)> {
    let mut seqs = Vec::with_capacity(examples.len());
    let mut rows = Vec::with_capacity(examples.len());
    for (prompt, answer) in examples {
        let full: Vec<u32> = prompt.iter().chain(answer).copied().collect();
        if prompt.is_empty() || answer.is_empty() {
            return Err(TrainError::EmptyPretrainRow);
        }
        let input = full[..full.len() - 1].to_vec();
        let targets = full[1..].to_vec();
        // Target i is token i + 1: an answer token from position prompt.len() − 1 on.
        let mask: Vec<f32> = (0..targets.len())
            .map(|i| f32::from(u8::from(i + 1 >= prompt.len())))
            .collect();
        seqs.push(input);
        rows.push((targets, mask));
    }
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let n = seqs.len();
    let mut targets = vec![0u32; n * longest];
    let mut mask = vec![0f32; n * longest];
    for (i, (t, m)) in rows.iter().enumerate() {
        targets[i * longest..i * longest + t.len()].copy_from_slice(t);
        mask[i * longest..i * longest + m.len()].copy_from_slice(m);
    }
    Ok((
        seqs,
        Tensor::from_vec(targets, (n, longest), &Device::Cpu)?,
        Tensor::from_vec(mask, (n, longest), &Device::Cpu)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_covers_exactly_the_answer_targets() {
        let ex = vec![(vec![5, 6, 7], vec![8, 9]), (vec![5], vec![8, 9, 10])];
        let (seqs, targets, mask) = batch_tensors(&ex).expect("batch");
        assert_eq!(seqs, vec![vec![5, 6, 7, 8], vec![5, 8, 9]]);
        let t: Vec<Vec<u32>> = targets.to_vec2().expect("targets");
        let m: Vec<Vec<f32>> = mask.to_vec2().expect("mask");
        assert_eq!(t, vec![vec![6, 7, 8, 9], vec![8, 9, 10, 0]]);
        // Row 0 predicts 6, 7 (prompt) then 8, 9 (answer); row 1 predicts only answer tokens.
        assert_eq!(m, vec![vec![0.0, 0.0, 1.0, 1.0], vec![1.0, 1.0, 1.0, 0.0]]);
    }

    #[test]
    fn the_stream_skips_excluded_prompts() {
        let mut first = WordProblemStream::new(7, HashSet::new());
        let a = first.next_problem().expect("a");
        let b = first.next_problem().expect("b");
        let exclude: HashSet<String> = [a.to_row("test", 0).prompt.plain_text()].into();
        let mut stream = WordProblemStream::new(7, exclude);
        assert_eq!(stream.next_problem().expect("next"), b);
        assert_eq!(stream.skipped, 1);
    }
}
