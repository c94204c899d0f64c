//! Aborting a request of the device engine: taking its row out of whichever batch holds it
//! (the running batch, or the prefill running in chunks) or out of the queue, its fed
//! positions offered to the prefix cache first, and what it made so far handed back as a
//! [`PartialRollout`] that [`DeviceEngine::resume`] continues.

use std::time::Instant;

use super::batch::Row;
use super::{ids_of, requests_failed, route_table, trim, DeviceEngine, Running};
use crate::error::RolloutError;
use crate::request::{PartialRollout, RequestId};

/// Which of the engine's batches (see [`DeviceEngine::abort`]).
#[derive(Debug, Clone, Copy)]
enum Batch {
    /// The running batch.
    Running,
    /// The batch whose prefill runs in chunks.
    Prefilling,
}

impl DeviceEngine {
    /// Stops a request; what it produced so far (resumable with [`DeviceEngine::resume`]),
    /// or None if the id is unknown or finished.
    pub fn abort(&mut self, id: RequestId) -> Result<Option<PartialRollout>, RolloutError> {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            return match self.waiting.remove(i) {
                Some(row) => self.partial_unsampled(row).map(Some),
                None => Ok(None),
            };
        }
        // A row whose prefill runs in chunks has sampled nothing since its admission.
        if let Some(row) = self.take_row(Batch::Prefilling, id)? {
            return self.partial_unsampled(row).map(Some);
        }
        match self.take_row(Batch::Running, id)? {
            Some(row) => self.partial(row).map(Some),
            None => Ok(None),
        }
    }

    /// The batch `which` names.
    fn batch_mut(&mut self, which: Batch) -> &mut Option<Running> {
        match which {
            Batch::Running => &mut self.running,
            Batch::Prefilling => &mut self.prefilling,
        }
    }

    /// Takes the row of request `id` out of batch `which` (None if it has none), its fed
    /// positions offered to the prefix cache first, so a resume under the same weights does
    /// not feed them again. A failed move of the batch's cache drops the batch: its
    /// requests fail, named.
    fn take_row(&mut self, which: Batch, id: RequestId) -> Result<Option<Row>, RolloutError> {
        let Some(mut batch) = self.batch_mut(which).take() else {
            return Ok(None);
        };
        let Some(i) = batch.rows.iter().position(|r| r.id == id) else {
            *self.batch_mut(which) = Some(batch);
            return Ok(None);
        };
        self.offer_or_warn(&batch.rows[i], &batch.cache, i);
        let ids = ids_of(&batch.rows);
        let row = batch.swap_remove(i).map_err(|e| requests_failed(ids, e))?;
        if !batch.rows.is_empty() {
            if let Err(e) = trim(&mut batch) {
                // The batch is dropped: its requests and the aborted one fail, named.
                let mut ids = ids_of(&batch.rows);
                ids.push(row.id);
                return Err(requests_failed(ids, e));
            }
            *self.batch_mut(which) = Some(batch);
        }
        Ok(Some(row))
    }

    /// What an aborted row that has sampled nothing since it was queued holds: a retracted
    /// row what it made before (its keys and values are gone already), a resumed request the
    /// call it continues, a new one nothing.
    fn partial_unsampled(&mut self, row: Row) -> Result<PartialRollout, RolloutError> {
        if row.was_fed() {
            return self.partial(row);
        }
        if let Some(resume) = row.resume {
            return Ok(resume.earlier);
        }
        Ok(PartialRollout::unsampled(
            row.request,
            row.rng,
            self.version,
        ))
    }

    /// What an aborted row made so far, as [`DeviceEngine::resume`] takes it.
    fn partial(&mut self, mut row: Row) -> Result<PartialRollout, RolloutError> {
        let request = match &row.resume {
            Some(r) => r.earlier.request.clone(),
            None => row.request.clone(),
        };
        let rng = row.rng.clone();
        let started = Instant::now();
        let routes = route_table(&self.geo, &mut row)?;
        if row.capture {
            self.capture_time += started.elapsed();
        }
        let result = self.result(row, routes)?;
        Ok(PartialRollout::from_result(
            request,
            result,
            rng,
            self.version,
        ))
    }
}
