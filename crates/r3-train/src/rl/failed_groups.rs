//! Rollout requests a fleet could not serve for their own fault (r3-fleet's
//! [`FleetError::RequestFailed`]: a worker answered 400 / 413 / 422, or two workers gave the
//! same answer): the group of such a request (every sample of its prompt, since GRPO's
//! advantages need the whole group) is dropped from the step, as dynamic sampling drops a
//! uniform group, and the step trains on the others (`rollout.failed_groups`,
//! `rollout.failed_requests`). A failure that is not the request's own (worker faults out of
//! retries, no worker left) still fails the step, and so does a step whose every group
//! failed.

use r3_fleet::error::BatchFailure;
use r3_fleet::{FleetError, RolloutStats};
use r3_rollout::GenerateResult;

use crate::error::{Result, TrainError};
use crate::rl::prompt_source::PromptItem;
use crate::rl::sampling::check_count;

/// One request's outcome in a step's rollout round: its result, or the fleet's error for a
/// request that failed for its own fault (its group is dropped).
pub type RequestOutcome = std::result::Result<GenerateResult, FleetError>;

/// Failures named in the step's warning; the rest are counted.
const NAMED_FAILURES: usize = 3;

/// The groups a step dropped because requests of theirs failed, over every rollout round.
#[derive(Debug, Default)]
pub struct FailedGroups {
    /// Groups dropped.
    pub groups: usize,
    /// Requests that failed in them (a group's other requests finished but are dropped with
    /// it).
    pub requests: usize,
    /// The first failures: rollout round, the group's index in that round, the error.
    pub first: Vec<(u64, usize, FleetError)>,
}

impl FailedGroups {
    /// One warning line for the step (nothing when no group failed): the counts and the
    /// first few failures, each with the worker's message.
    pub fn warn(&self, step: u64) {
        if self.groups == 0 {
            return;
        }
        tracing::warn!(
            step,
            groups = self.groups,
            requests = self.requests,
            "dropped {} rollout group(s): request(s) of theirs failed for their own fault; {}",
            self.groups,
            self.describe()
        );
    }

    /// The first failures in words (`round r, group g: error; ...; and N more`).
    pub fn describe(&self) -> String {
        let mut text = self
            .first
            .iter()
            .map(|(round, group, e)| format!("round {round}, group {group}: {e}"))
            .collect::<Vec<_>>()
            .join("; ");
        let more = self.requests.saturating_sub(self.first.len());
        if more > 0 {
            text.push_str(&format!("; and {more} more failed request(s)"));
        }
        text
    }

    /// The step's error when it is left with no group at all because of these failures.
    pub fn into_error(mut self, step: u64) -> TrainError {
        let first = match self.first.is_empty() {
            true => FleetError::Config("no failure was recorded".into()),
            false => self.first.remove(0).2,
        };
        TrainError::AllRolloutGroupsFailed {
            step,
            groups: self.groups,
            requests: self.requests,
            source: Box::new(first),
        }
    }
}

/// The outcomes of a fleet's batch, refused as a whole (the step fails with the fleet's
/// [`FleetError::Batch`], naming each failure and holding the finished results, as before)
/// when any request failed for a reason that is not its own: a worker fault out of retries,
/// no worker left. Otherwise they come back as they are, failed requests included.
pub fn refuse_fleet_failures(
    outcomes: Vec<RequestOutcome>,
    stats: RolloutStats,
) -> Result<Vec<RequestOutcome>> {
    let droppable = |o: &RequestOutcome| o.as_ref().err().is_none_or(|e| e.is_request_failure());
    if outcomes.iter().all(droppable) {
        return Ok(outcomes);
    }
    Err(TrainError::Fleet(FleetError::Batch(Box::new(
        BatchFailure::from_outcomes(outcomes, stats),
    ))))
}

/// Splits rollout round `round`'s outcomes (`group` per prompt of `items`, group-major) into
/// the prompts and results of the groups whose every request finished, in their order (so
/// each keeps its requests' seeds), and counts the others into `failed`.
pub fn drop_failed_groups(
    items: Vec<PromptItem>,
    outcomes: Vec<RequestOutcome>,
    group: usize,
    round: u64,
    failed: &mut FailedGroups,
) -> Result<(Vec<PromptItem>, Vec<GenerateResult>)> {
    check_count(outcomes.len(), items.len() * group)?;
    let mut kept_items = Vec::with_capacity(items.len());
    let mut results = Vec::with_capacity(outcomes.len());
    let mut outcomes = outcomes.into_iter();
    for (g, item) in items.into_iter().enumerate() {
        let mut finished = Vec::with_capacity(group);
        let mut errors = Vec::new();
        for outcome in outcomes.by_ref().take(group) {
            match outcome {
                Ok(r) => finished.push(r),
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            kept_items.push(item);
            results.extend(finished);
            continue;
        }
        failed.groups += 1;
        failed.requests += errors.len();
        for e in errors {
            if failed.first.len() < NAMED_FAILURES {
                failed.first.push((round, g, e));
            }
        }
    }
    Ok((kept_items, results))
}

#[cfg(test)]
mod tests {
    use super::*;
    use r3_rollout::FinishReason;

    fn item(id: u32) -> PromptItem {
        PromptItem {
            text: String::new(),
            ids: vec![1, id],
            ground_truth: serde_json::Value::String(String::new()),
            data_source: String::new(),
            extra_info: serde_json::Value::Null,
        }
    }

    fn ok(id: u64) -> RequestOutcome {
        Ok(GenerateResult {
            id,
            prompt_tokens: 2,
            output_ids: vec![5],
            output_logprobs: vec![-0.5],
            output_top_logprobs: Vec::new(),
            prompt_logprobs: None,
            routes: None,
            finish: FinishReason::Length,
            cached_tokens: 0,
            weight_version: 0,
        })
    }

    fn refused(request: usize) -> RequestOutcome {
        Err(FleetError::RequestFailed {
            request,
            why: "the worker refused it".into(),
            error: Box::new(FleetError::Status {
                url: "http://w".into(),
                status: 400,
                body: "prompt too long".into(),
            }),
        })
    }

    fn no_workers() -> RequestOutcome {
        Err(FleetError::NoWorkers {
            total: 1,
            detail: "http://w: connection refused".into(),
        })
    }

    /// Group 1 of three (two samples each) has one refused request: it is dropped whole,
    /// the others keep their order and results; the counts and the named failure follow.
    #[test]
    fn a_failed_requests_group_is_dropped_and_the_others_keep_their_order() {
        let outcomes = vec![ok(0), ok(1), ok(2), refused(3), ok(4), ok(5)];
        let mut failed = FailedGroups::default();
        let (items, results) = drop_failed_groups(
            vec![item(10), item(11), item(12)],
            outcomes,
            2,
            0,
            &mut failed,
        )
        .expect("split");
        let ids: Vec<u32> = items.iter().map(|i| i.ids[1]).collect();
        assert_eq!(ids, [10, 12]);
        let result_ids: Vec<u64> = results.iter().map(|r| r.id).collect();
        assert_eq!(result_ids, [0, 1, 4, 5]);
        assert_eq!((failed.groups, failed.requests), (1, 1));
        let text = failed.describe();
        assert!(
            text.contains("round 0, group 1") && text.contains("prompt too long"),
            "{text}"
        );
        let e = failed.into_error(7).to_string();
        assert!(e.contains("step 7") && e.contains("prompt too long"), "{e}");
    }

    /// Every failure the fleet put on a request of its own passes; one that is about the
    /// fleet (no worker left) refuses the whole batch with the fleet's batch error.
    #[test]
    fn only_requests_own_failures_are_droppable() {
        let kept = refuse_fleet_failures(vec![ok(0), refused(1)], RolloutStats::default())
            .expect("a request's own failure");
        assert_eq!(kept.len(), 2);
        let err = refuse_fleet_failures(
            vec![ok(0), refused(1), no_workers()],
            RolloutStats::default(),
        )
        .expect_err("the fleet is down");
        let TrainError::Fleet(FleetError::Batch(batch)) = &err else {
            panic!("not a batch error: {err}");
        };
        assert_eq!(batch.failures.len(), 2);
        assert!(err.to_string().contains("no rollout worker left"), "{err}");
    }

    #[test]
    fn a_count_that_does_not_match_the_groups_is_an_error() {
        let mut failed = FailedGroups::default();
        assert!(drop_failed_groups(vec![item(1)], vec![ok(0)], 2, 0, &mut failed).is_err());
    }
}
