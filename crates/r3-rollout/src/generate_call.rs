//! The blocking `generate` call both engines offer: submit every request, step until each
//! has finished, hand the results back in request order — and on an error (a request
//! refused, a step failed) abort the call's requests still queued or running, since left
//! behind they would join (and change the batches of) the next call.

use std::collections::HashMap;

use crate::error::RolloutError;
use crate::request::{GenerateRequest, GenerateResult, RequestId};

/// What [`generate_all`] needs of an engine.
pub(crate) trait StepEngine {
    /// Validates and queues a request.
    fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, RolloutError>;
    /// Runs one step; returns the requests that finished in it.
    fn step(&mut self) -> Result<Vec<GenerateResult>, RolloutError>;
    /// Whether any request is queued, running or holds a result.
    fn has_work(&self) -> bool;
    /// Aborts each of `ids` still queued or running (and drops results held for them),
    /// logging an abort that fails.
    fn abort_all_of(&mut self, ids: &[RequestId]);
}

/// Submits `reqs` to `engine` and steps it until they finish; results in request order.
pub(crate) fn generate_all<E: StepEngine>(
    engine: &mut E,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<GenerateResult>, RolloutError> {
    let mut ids = Vec::with_capacity(reqs.len());
    for r in reqs {
        match engine.submit(r) {
            Ok(id) => ids.push(id),
            Err(e) => {
                engine.abort_all_of(&ids);
                return Err(e);
            }
        }
    }
    let mut done: HashMap<RequestId, GenerateResult> = HashMap::new();
    while ids.iter().any(|id| !done.contains_key(id)) {
        if !engine.has_work() {
            return Err(RolloutError::InvalidRequest(
                "requests vanished before finishing (aborted?)".into(),
            ));
        }
        match engine.step() {
            Ok(results) => done.extend(results.into_iter().map(|r| (r.id, r))),
            Err(e) => {
                let left: Vec<RequestId> = ids
                    .iter()
                    .copied()
                    .filter(|id| !done.contains_key(id))
                    .collect();
                engine.abort_all_of(&left);
                return Err(e);
            }
        }
    }
    Ok(ids.iter().filter_map(|id| done.remove(id)).collect())
}
