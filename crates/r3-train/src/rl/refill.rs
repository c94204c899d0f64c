//! DAPO's dynamic sampling with refill (`algo.sampling_rounds` > 1): a step draws rollout
//! rounds until it holds `rollout.prompts_per_step` groups whose rewards differ (a uniform
//! group has no advantage to learn from), so the batch keeps its size where drop-only
//! dynamic sampling shrinks it.

use crate::algo::advantage::filter_uniform_groups;
use crate::error::Result;
use crate::rl::sampling::Trajectory;

/// What dynamic sampling with refill drew in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplingRounds {
    /// Rollout rounds drawn (the first included).
    pub rounds: usize,
    /// Groups sampled over those rounds.
    pub groups_drawn: usize,
    /// Of those, the groups whose rewards were all equal.
    pub groups_uniform: usize,
}

/// The step's groups after refill: `first` is the first round's scored trajectories
/// (group-major, `group` per prompt); `next_round(r)` samples and scores round `r` (1, 2,
/// ...) of fresh prompts, or gives None where no prompts are left to draw. Rounds are
/// drawn, at most `max_rounds` in all, until `want` groups with differing rewards are in
/// hand; the batch is the first `want` of them in the order drawn, renumbered group-major.
/// A round may bring fewer than `want` groups (those whose fleet requests failed are
/// dropped before; `rl/failed_groups.rs`): the rounds after refill them as they refill
/// uniform groups. Where no round kept a group, the first round that brought any is the
/// batch as it came (its update has nothing to learn from and is skipped).
pub fn fill_groups(
    first: Vec<Trajectory>,
    group: usize,
    want: usize,
    max_rounds: usize,
    mut next_round: impl FnMut(u64) -> Result<Option<Vec<Trajectory>>>,
) -> Result<(Vec<Trajectory>, SamplingRounds)> {
    let mut drawn = SamplingRounds::default();
    let mut kept: Vec<Trajectory> = Vec::new();
    let mut first = Some(first);
    let mut none_kept = None;
    for round in 0..max_rounds.max(1) as u64 {
        let trajs = match first.take() {
            Some(trajs) => trajs,
            None => match next_round(round)? {
                Some(trajs) => trajs,
                None => break,
            },
        };
        let rewards: Vec<f32> = trajs.iter().map(|t| t.reward).collect();
        let filter = filter_uniform_groups(&rewards, group)?;
        drawn.rounds += 1;
        drawn.groups_drawn += trajs.len() / group;
        drawn.groups_uniform += filter.dropped_groups;
        // The fallback batch is the first round that brought any group: round 0 unless every
        // group of it failed at the fleet (dropped before they came here).
        if none_kept.is_none() && kept.is_empty() && filter.kept_groups.is_empty() {
            if !trajs.is_empty() {
                none_kept = Some(trajs);
            }
        } else {
            let mut trajs: Vec<Option<Trajectory>> = trajs.into_iter().map(Some).collect();
            kept.extend(
                filter
                    .kept_rows()
                    .into_iter()
                    .filter_map(|r| trajs[r].take()),
            );
        }
        if kept.len() >= want * group {
            break;
        }
    }
    if let (true, Some(first)) = (kept.is_empty(), none_kept) {
        return Ok((first, drawn));
    }
    kept.truncate(want * group);
    for (n, t) in kept.iter_mut().enumerate() {
        t.group = n / group;
    }
    Ok((kept, drawn))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::sampling::RolloutSample;

    /// A trajectory of group `group` with reward `reward`; its prompt names the round and
    /// the group it was drawn in (`[round, group]`), to follow it into the batch.
    fn traj(round: u32, group: usize, reward: f32) -> Trajectory {
        Trajectory {
            group,
            sample: RolloutSample {
                prompt_ids: vec![round, group as u32],
                response_ids: vec![5, 2],
                rollout_logp: vec![-0.1, -0.2],
                routes: None,
                cached_tokens: 0,
            },
            stopped: true,
            weight_version: 0,
            completion: String::new(),
            reward,
            correct: reward > 0.5,
        }
    }

    /// Groups of two: `rewards[g]` the two rewards of group g of round `round`.
    fn round(round: u32, rewards: &[[f32; 2]]) -> Vec<Trajectory> {
        rewards
            .iter()
            .enumerate()
            .flat_map(|(g, r)| r.iter().map(move |&x| traj(round, g, x)))
            .collect()
    }

    fn origins(batch: &[Trajectory]) -> Vec<(usize, Vec<u32>)> {
        batch
            .iter()
            .map(|t| (t.group, t.sample.prompt_ids.clone()))
            .collect()
    }

    /// Three groups wanted: round 0 keeps one (groups 0 and 2 uniform), round 1 keeps one,
    /// round 2 keeps two of which the first fills the batch; round 3 is never drawn.
    #[test]
    fn rounds_are_drawn_until_the_groups_are_filled() {
        let mut asked = Vec::new();
        let mut next = |r: u64| {
            asked.push(r);
            Ok(Some(match r {
                1 => round(1, &[[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]),
                2 => round(2, &[[0.0, 1.0], [0.5, 0.0], [0.0, 0.0]]),
                _ => round(9, &[[0.0, 1.0]; 3]),
            }))
        };
        let first = round(0, &[[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]);
        let (batch, drawn) = fill_groups(first, 2, 3, 8, &mut next).expect("filled");
        assert_eq!(asked, [1, 2]);
        assert_eq!(
            drawn,
            SamplingRounds {
                rounds: 3,
                groups_drawn: 9,
                groups_uniform: 5,
            }
        );
        let want = [
            (0, vec![0, 1]),
            (0, vec![0, 1]),
            (1, vec![1, 1]),
            (1, vec![1, 1]),
            (2, vec![2, 0]),
            (2, vec![2, 0]),
        ];
        assert_eq!(origins(&batch), want);
        assert_eq!(batch[0].reward, 0.0);
        assert_eq!(batch[1].reward, 1.0);
    }

    /// Rounds that bring fewer groups (their failed fleet requests' groups dropped before)
    /// are refilled like uniform ones; a first round that lost every group leaves the
    /// fallback batch to the first round that brought any.
    #[test]
    fn groups_lost_to_failed_requests_are_refilled() {
        // Two groups wanted; round 0 lost one of its two groups, the other differing.
        let short = round(0, &[[0.0, 1.0]]);
        let (batch, drawn) = fill_groups(short, 2, 2, 3, |r| {
            Ok(Some(round(r as u32, &[[1.0, 0.0], [0.0, 1.0]])))
        })
        .expect("batch");
        assert_eq!(
            origins(&batch),
            [
                (0, vec![0, 0]),
                (0, vec![0, 0]),
                (1, vec![1, 0]),
                (1, vec![1, 0])
            ]
        );
        assert_eq!((drawn.rounds, drawn.groups_drawn), (2, 3));
        // Round 0 lost every group and round 1 is uniform: round 1 is the batch as it came.
        let (batch, drawn) = fill_groups(Vec::new(), 2, 2, 2, |r| {
            Ok(Some(round(r as u32, &[[1.0, 1.0], [0.0, 0.0]])))
        })
        .expect("batch");
        assert_eq!(
            origins(&batch),
            origins(&round(1, &[[1.0, 1.0], [0.0, 0.0]]))
        );
        assert_eq!((drawn.rounds, drawn.groups_drawn), (2, 2));
        // Every round lost every group: nothing (the trainer names the failure).
        let (batch, _) = fill_groups(Vec::new(), 2, 2, 2, |_| Ok(Some(Vec::new()))).expect("batch");
        assert!(batch.is_empty());
    }

    /// Out of rounds: the groups kept so far are the batch (smaller); none kept in any
    /// round: the first round as it came.
    #[test]
    fn out_of_rounds_the_batch_is_what_was_kept_or_the_first_round() {
        let uniform = |r: u32| round(r, &[[1.0, 1.0], [0.0, 0.0]]);
        let (batch, drawn) = fill_groups(uniform(0), 2, 2, 3, |r| {
            Ok(Some(match r {
                1 => round(1, &[[0.0, 0.0], [0.0, 1.0]]),
                _ => uniform(r as u32),
            }))
        })
        .expect("batch");
        assert_eq!(origins(&batch), [(0, vec![1, 1]), (0, vec![1, 1])]);
        assert_eq!((drawn.rounds, drawn.groups_uniform), (3, 5));
        let (batch, drawn) =
            fill_groups(uniform(0), 2, 2, 3, |r| Ok(Some(uniform(r as u32)))).expect("batch");
        assert_eq!(origins(&batch), origins(&uniform(0)));
        assert_eq!(
            (drawn.rounds, drawn.groups_drawn, drawn.groups_uniform),
            (3, 6, 6)
        );
        // A first round that fills the batch draws no other.
        let full = round(0, &[[0.0, 1.0], [1.0, 0.0]]);
        let (batch, drawn) =
            fill_groups(full.clone(), 2, 2, 3, |_| panic!("no refill")).expect("batch");
        assert_eq!(origins(&batch), origins(&full));
        assert_eq!(drawn.rounds, 1);
        // No prompts left after round 1: the rounds end there.
        let (batch, drawn) = fill_groups(uniform(0), 2, 2, 8, |r| {
            Ok((r == 1).then(|| round(1, &[[0.0, 1.0], [1.0, 1.0]])))
        })
        .expect("batch");
        assert_eq!(origins(&batch), [(0, vec![1, 0]), (0, vec![1, 0])]);
        assert_eq!(drawn.rounds, 2);
    }
}
