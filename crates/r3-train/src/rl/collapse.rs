//! Watches a run for collapse: a policy that earns no reward while its entropy has fallen
//! to almost nothing is stuck on one wrong answer (or its weights have blown up) and will
//! not recover by itself, so the run says so instead of training on silently.

use crate::rl::metrics_log::StepMetrics;

/// Entropy (nats per response token) below which sampling is practically greedy.
pub const ENTROPY_FLOOR: f64 = 0.05;
/// Consecutive collapsed steps before the warning.
pub const COLLAPSED_STEPS: u32 = 3;

/// Counts consecutive collapsed steps and warns once per collapse.
#[derive(Debug, Default, Clone)]
pub struct CollapseWatch {
    streak: u32,
}

/// Whether one step looks collapsed: no reward at all and (near-)zero entropy.
pub fn step_collapsed(m: &StepMetrics) -> bool {
    m.reward_mean <= 0.0 && m.entropy.is_some_and(|h| h < ENTROPY_FLOOR)
}

impl CollapseWatch {
    /// Records a step; returns true (and logs a warning) on the step that completes
    /// [`COLLAPSED_STEPS`] collapsed steps in a row.
    pub fn observe(&mut self, m: &StepMetrics) -> bool {
        if !step_collapsed(m) {
            self.streak = 0;
            return false;
        }
        self.streak += 1;
        let warn = self.streak == COLLAPSED_STEPS;
        if warn {
            tracing::warn!(
                step = m.step,
                reward_mean = m.reward_mean,
                entropy = ?m.entropy,
                steps = COLLAPSED_STEPS,
                "training collapsed: no reward and entropy near zero; check optim.lr and the weights"
            );
        }
        warn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, reward_mean: f64, entropy: f64) -> StepMetrics {
        StepMetrics {
            step,
            reward_mean,
            entropy: Some(entropy),
            ..StepMetrics::default()
        }
    }

    #[test]
    fn warns_once_after_consecutive_collapsed_steps_and_rearms_after_recovery() {
        let mut w = CollapseWatch::default();
        let warned: Vec<bool> = [
            step(1, 0.0, 0.01),
            step(2, 0.0, 0.0),
            step(3, 0.0, 0.001),
            step(4, 0.0, 0.0),
            step(5, 0.5, 0.0),
            step(6, 0.0, 0.01),
            step(7, 0.0, 0.01),
            step(8, 0.0, 0.01),
        ]
        .iter()
        .map(|m| w.observe(m))
        .collect();
        assert_eq!(
            warned,
            [false, false, true, false, false, false, false, true]
        );
    }

    #[test]
    fn a_rewarded_or_exploring_step_is_not_collapse() {
        assert!(!step_collapsed(&step(1, 0.1, 0.0)));
        assert!(!step_collapsed(&step(1, 0.0, 1.2)));
        assert!(step_collapsed(&step(1, 0.0, 0.0)));
    }
}
