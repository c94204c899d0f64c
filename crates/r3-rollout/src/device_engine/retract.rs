//! Retract (SGLang's `/pause_generation` mode `retract`): running rows sent back to the front
//! of the queue with their keys and values dropped, holding everything else they made —
//! generated tokens, log-probs, captured route rows with their weight versions, prompt
//! log-probs, the sampler stream. When admitted again a row is prefilled over all its tokens
//! (from the prefix cache where it holds them, in chunks where one step would exceed the
//! activation budget), captures route rows only past the ones it holds, and goes on sampling
//! from its stream: under the same weights it finishes as it would have without the
//! retract; after a weight update its later tokens are the new weights', as on the CPU
//! engine.

use super::batch::Row;
use super::DeviceEngine;

impl DeviceEngine {
    /// Sends every running row back to the front of the queue — the running batch's rows in
    /// batch order, then those of a prefill running in chunks — releasing their keys and
    /// values; returns how many went back. Any row can be admitted again: one whose prefill
    /// over all its tokens would alone exceed the activation budget is fed in chunks.
    pub fn retract_all(&mut self) -> usize {
        let mut back = Vec::new();
        for batch in [self.running.take(), self.prefilling.take()]
            .into_iter()
            .flatten()
        {
            // Their fed positions go to the prefix cache first, as an abort's do: continued
            // under the same weights, their prefill reads them back instead of computing
            // them.
            for (b, row) in batch.rows.iter().enumerate() {
                self.offer_or_warn(row, &batch.cache, b);
            }
            back.extend(batch.rows);
        }
        let n = back.len();
        for row in back.into_iter().rev() {
            self.queue_front(row);
        }
        n
    }

    /// Puts `row` at the front of the queue without its keys and values, holding what it
    /// recorded (a row caught between the chunks of its prefill, its chunks' route rows and
    /// prompt log-probs, as the CPU engine's retract keeps them).
    fn queue_front(&mut self, mut row: Row) {
        row.pad = 0;
        row.cached = 0;
        row.held = 0;
        self.waiting.push_front(row);
    }
}
