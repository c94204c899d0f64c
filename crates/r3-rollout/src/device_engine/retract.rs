//! Retract (SGLang's `/pause_generation` mode `retract`): running rows sent back to the front
//! of the queue with their keys and values dropped, holding everything else they made —
//! generated tokens, log-probs, captured route rows with their weight versions, prompt
//! log-probs, the sampler stream. When admitted again a row is prefilled over all its tokens
//! (from the prefix cache where it holds them), captures route rows only past the ones it
//! holds, and goes on sampling from its stream: under the same weights it finishes as it
//! would have without the retract; after a weight update its later tokens are the new
//! weights', as on the CPU engine.

use super::batch::Row;
use super::memory::{step_activation_bytes, StepShape};
use super::{ids_of, requests_failed, trim, DeviceEngine};
use crate::error::RolloutError;

impl DeviceEngine {
    /// Sends every running row back to the front of the queue, in batch order, releasing
    /// the batch's keys and values; returns how many went back. A row whose prefill over all
    /// its tokens would alone need more than the activation budget cannot be admitted again
    /// and stays running where it is (logged). A failed move of a cache row fails the
    /// batch's requests, named, as a failed step does.
    pub fn retract_all(&mut self) -> Result<usize, RolloutError> {
        let Some(mut running) = self.running.take() else {
            return Ok(0);
        };
        let back: Vec<bool> = running.rows.iter().map(|r| self.refills(r)).collect();
        // Their fed positions go to the prefix cache first, as an abort's do: continued
        // under the same weights, their prefill reads them back instead of computing them.
        for (b, row) in running.rows.iter().enumerate().filter(|&(b, _)| back[b]) {
            self.offer_or_warn(row, &running.cache, b);
        }
        let mut retracted = Vec::new();
        if back.iter().all(|&b| b) {
            retracted = std::mem::take(&mut running.rows);
        } else {
            // From the last, so the row moved into each place is one that stays.
            for i in (0..back.len()).rev().filter(|&i| back[i]) {
                match running.swap_remove(i) {
                    Ok(row) => retracted.push(row),
                    Err(e) => {
                        // The batch is dropped, its requests failed by name; the rows
                        // already out of it are whole and wait.
                        retracted.reverse();
                        self.queue_front(retracted);
                        return Err(requests_failed(ids_of(&running.rows), e));
                    }
                }
            }
            retracted.reverse();
            let kept = running.rows.len();
            tracing::warn!(
                kept,
                "retract: rows whose prefill over all their tokens exceeds the activation \
                 budget stay running"
            );
            if let Err(e) = trim(&mut running) {
                self.queue_front(retracted);
                return Err(requests_failed(ids_of(&running.rows), e));
            }
            self.running = Some(running);
        }
        let n = retracted.len();
        self.queue_front(retracted);
        Ok(n)
    }

    /// Puts `rows` at the front of the queue, in their order, each without keys and values.
    fn queue_front(&mut self, rows: Vec<Row>) {
        for mut row in rows.into_iter().rev() {
            row.pad = 0;
            row.cached = 0;
            self.waiting.push_front(row);
        }
    }

    /// Whether `row`'s prefill over all its tokens, alone, fits the activation budget.
    fn refills(&self, row: &Row) -> bool {
        let len = row.tokens.len();
        let prefill = StepShape {
            rows: 1,
            time: len,
            slots: len,
            logit_positions: if row.asks_prompt_logprobs() { len } else { 1 },
        };
        step_activation_bytes(&self.model_cfg, prefill) <= self.cfg.activation_bytes
    }
}
