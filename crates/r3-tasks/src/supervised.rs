//! Seeded batches of `<bos> prompt solution <eos>` sequences for supervised pretraining.

use crate::error::{Result, TaskError};
use crate::task::{ArithmeticTask, TrainStream};
use crate::tokenizer::{CharTokenizer, BOS_ID, EOS_ID, PAD_ID};
use serde::{Deserialize, Serialize};

/// Which target positions carry loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossOn {
    /// Every real token (prompt characters, solution and `<eos>`).
    All,
    /// Only the solution and `<eos>` (what the model will have to generate).
    Solution,
}

/// One batch of next-token training data, row-major `[batch_size, seq_len]`.
///
/// Row `b` position `t` feeds `input_ids[b*seq_len+t]` and predicts `target_ids[b*seq_len+t]`;
/// `loss_mask` is 1.0 where that prediction counts and 0.0 on padding (and on the prompt
/// with [`LossOn::Solution`]). Padding uses `<pad>` in both ids.
#[derive(Debug, Clone, PartialEq)]
pub struct SupervisedBatch {
    /// Rows in the batch.
    pub batch_size: usize,
    /// Positions per row.
    pub seq_len: usize,
    /// Inputs, `[batch_size * seq_len]`.
    pub input_ids: Vec<u32>,
    /// Next-token targets, `[batch_size * seq_len]`.
    pub target_ids: Vec<u32>,
    /// 1.0 where the target counts toward the loss, `[batch_size * seq_len]`.
    pub loss_mask: Vec<f32>,
}

/// Infinite, seeded iterator of [`SupervisedBatch`]es drawn from the training stream.
#[derive(Debug)]
pub struct SupervisedBatches<'a> {
    tokenizer: &'a CharTokenizer,
    stream: TrainStream<'a>,
    batch_size: usize,
    seq_len: Option<usize>,
    loss_on: LossOn,
}

impl<'a> SupervisedBatches<'a> {
    /// Batches of `batch_size` rows; `seq_len` fixes the row length (a longer sequence is an
    /// error) or, when `None`, rows are padded to the longest sequence of the batch.
    pub fn new(
        task: &'a ArithmeticTask,
        tokenizer: &'a CharTokenizer,
        seed: u64,
        batch_size: usize,
        seq_len: Option<usize>,
        loss_on: LossOn,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(TaskError::EmptyBatch);
        }
        Ok(Self {
            tokenizer,
            stream: task.train_stream(seed),
            batch_size,
            seq_len,
            loss_on,
        })
    }

    fn next_batch(&mut self) -> Result<SupervisedBatch> {
        // (full token sequence, number of prompt tokens after <bos>, prompt text)
        let mut rows = Vec::with_capacity(self.batch_size);
        for _ in 0..self.batch_size {
            let p = self.stream.next_problem()?;
            let prompt = self.tokenizer.encode(&p.prompt)?;
            let mut seq = vec![BOS_ID];
            seq.extend_from_slice(&prompt);
            seq.extend(self.tokenizer.encode(&p.solution)?);
            seq.push(EOS_ID);
            rows.push((seq, prompt.len(), p.prompt));
        }
        let longest = rows.iter().map(|(s, _, _)| s.len() - 1).max().unwrap_or(0);
        let seq_len = self.seq_len.unwrap_or(longest);
        let n = self.batch_size * seq_len;
        let mut batch = SupervisedBatch {
            batch_size: self.batch_size,
            seq_len,
            input_ids: vec![PAD_ID; n],
            target_ids: vec![PAD_ID; n],
            loss_mask: vec![0.0; n],
        };
        for (b, (seq, prompt_len, prompt)) in rows.into_iter().enumerate() {
            let len = seq.len() - 1;
            if len > seq_len {
                return Err(TaskError::SequenceTooLong {
                    len,
                    seq_len,
                    prompt,
                });
            }
            let first_counted = match self.loss_on {
                LossOn::All => 0,
                LossOn::Solution => prompt_len,
            };
            let row = b * seq_len;
            for t in 0..len {
                batch.input_ids[row + t] = seq[t];
                batch.target_ids[row + t] = seq[t + 1];
                if t >= first_counted {
                    batch.loss_mask[row + t] = 1.0;
                }
            }
        }
        Ok(batch)
    }
}

impl Iterator for SupervisedBatches<'_> {
    type Item = Result<SupervisedBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        Some(self.next_batch())
    }
}
