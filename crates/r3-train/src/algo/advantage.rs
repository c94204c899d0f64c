//! GRPO group-normalised advantages and dynamic sampling (dropping groups whose rewards
//! are all equal, which carry no learning signal).
//!
//! Rewards arrive flat, `[n_groups * group_size]`, with the `group_size` samples of one
//! prompt contiguous. These are per-sequence scalars, so they live on the host.

use crate::error::{Result, TrainError};
use serde::{Deserialize, Serialize};

/// How GRPO normalises rewards within a group.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GrpoOptions {
    /// Divide by the group's standard deviation (GRPO) or only subtract the mean (Dr. GRPO).
    pub norm_by_std: bool,
    /// Added to the standard deviation before dividing.
    pub eps: f32,
}

impl Default for GrpoOptions {
    fn default() -> Self {
        Self {
            norm_by_std: true,
            eps: 1e-6,
        }
    }
}

/// Summary of one advantage computation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdvantageMetrics {
    /// Mean reward over all samples.
    pub reward_mean: f32,
    /// Mean absolute advantage.
    pub adv_abs_mean: f32,
    /// Groups of several samples whose rewards are all equal (advantage 0 everywhere in
    /// them); a group of one is never uniform (see [`is_uniform`]).
    pub uniform_groups: usize,
}

/// Whether `group` carries no learning signal: several samples, every reward equal. A
/// group of one sample is not uniform: GRPO gives it its raw reward (mean 0, std 1), and
/// verl's DAPO filter keeps it (`std > 0 or len == 1`), so `rollout.group_size = 1` trains.
pub fn is_uniform(group: &[f32]) -> bool {
    group.len() > 1 && group.iter().all(|&r| r == group[0])
}

fn check_groups(rewards: &[f32], group_size: usize) -> Result<usize> {
    if group_size == 0 {
        return Err(TrainError::OutOfRange {
            name: "group_size",
            value: 0.0,
            expected: ">= 1",
        });
    }
    if !rewards.chunks_exact(group_size).remainder().is_empty() {
        return Err(TrainError::RaggedGroups {
            rewards: rewards.len(),
            group_size,
        });
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(TrainError::NonFiniteReward {
            index: i,
            value: rewards[i],
        });
    }
    Ok(rewards.len() / group_size)
}

/// GRPO advantages, `[n_groups * group_size]`: `(r - mean_g) / (std_g + eps)` with the
/// unbiased (n−1) standard deviation, or `r - mean_g` without `norm_by_std`.
/// A group of one sample gets its raw reward (mean 0, std 1), as in verl; a uniform group
/// gets 0 even with `eps = 0`.
pub fn grpo_advantages(
    rewards: &[f32],
    group_size: usize,
    opts: GrpoOptions,
) -> Result<(Vec<f32>, AdvantageMetrics)> {
    let n_groups = check_groups(rewards, group_size)?;
    let mut adv = Vec::with_capacity(rewards.len());
    let mut uniform_groups = 0;
    for group in rewards.chunks(group_size) {
        // A uniform group of several has no signal: exactly 0, where the f32 mean of equal
        // rewards such as 0.7 is a few ulps off them and the quotient of two such residues
        // is not small (16 × 0.7 gave every sample +0.106 at eps 1e-6).
        if is_uniform(group) {
            uniform_groups += 1;
            adv.extend(std::iter::repeat_n(0.0, group.len()));
            continue;
        }
        // In f64: the residues of a near-uniform group stay exact.
        let (mean, std) = if group.len() == 1 {
            (0.0, 1.0)
        } else {
            let n = group.len() as f64;
            let mean = group.iter().map(|&r| f64::from(r)).sum::<f64>() / n;
            let var = group
                .iter()
                .map(|&r| (f64::from(r) - mean).powi(2))
                .sum::<f64>()
                / (n - 1.0);
            (mean, var.sqrt())
        };
        // Past the uniform groups, std > 0 (a singleton's is 1): the quotient is finite.
        let denom = if opts.norm_by_std {
            std + f64::from(opts.eps)
        } else {
            1.0
        };
        adv.extend(
            group
                .iter()
                .map(|&r| ((f64::from(r) - mean) / denom) as f32),
        );
    }
    let count = rewards.len().max(1) as f32;
    let metrics = AdvantageMetrics {
        reward_mean: rewards.iter().sum::<f32>() / count,
        adv_abs_mean: adv.iter().map(|a| a.abs()).sum::<f32>() / count,
        uniform_groups,
    };
    debug_assert_eq!(adv.len(), n_groups * group_size);
    Ok((adv, metrics))
}

/// Which groups dynamic sampling keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupFilter {
    /// Indices of the kept groups, ascending.
    pub kept_groups: Vec<usize>,
    /// Number of groups dropped because all their rewards were equal.
    pub dropped_groups: usize,
    /// Samples per group.
    pub group_size: usize,
}

impl GroupFilter {
    /// Row (sample) indices of the kept groups, ascending.
    pub fn kept_rows(&self) -> Vec<usize> {
        self.kept_groups
            .iter()
            .flat_map(|g| g * self.group_size..(g + 1) * self.group_size)
            .collect()
    }

    /// Keeps the entries of a per-sample slice that belong to kept groups.
    pub fn select<T: Clone>(&self, per_sample: &[T]) -> Result<Vec<T>> {
        self.kept_rows()
            .into_iter()
            .map(|i| {
                per_sample.get(i).cloned().ok_or(TrainError::RowOutOfRange {
                    row: i,
                    len: per_sample.len(),
                })
            })
            .collect()
    }
}

/// Dynamic sampling (DAPO): drops every group of several samples whose rewards are all
/// exactly equal ([`is_uniform`]); groups of one sample are kept, as verl's DAPO filter does.
pub fn filter_uniform_groups(rewards: &[f32], group_size: usize) -> Result<GroupFilter> {
    check_groups(rewards, group_size)?;
    let mut kept_groups = Vec::new();
    let mut dropped_groups = 0;
    for (g, group) in rewards.chunks(group_size).enumerate() {
        if is_uniform(group) {
            dropped_groups += 1;
        } else {
            kept_groups.push(g);
        }
    }
    Ok(GroupFilter {
        kept_groups,
        dropped_groups,
        group_size,
    })
}
