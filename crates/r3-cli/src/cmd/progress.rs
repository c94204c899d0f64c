//! Progress bars of the long-running commands (`pretrain`, `train`, `compare`) and the
//! RL-run observer that drives them. Lines that must survive a hidden bar (`--no-progress`,
//! stderr not a terminal) go through `tracing`, suspended around the bar.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use r3_train::rl::sampling::EvalResult;
use r3_train::{Observer, StepMetrics};

/// The bar layout of `pretrain` and `train`.
pub const STEP_TEMPLATE: &str = "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}";

/// A bar of `len` steps in `template`, hidden when `hidden`.
pub fn step_bar(len: u64, hidden: bool, template: &str) -> anyhow::Result<ProgressBar> {
    let bar = if hidden {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(len)
    };
    bar.set_style(ProgressStyle::with_template(template)?.progress_chars("=> "));
    Ok(bar)
}

/// Feeds an RL run's events to a bar: reward, k3 KL, the last eval accuracy and the step's
/// memory high-water mark.
pub struct RunProgress {
    /// The bar drawn.
    pub bar: ProgressBar,
    last_eval: Option<f64>,
}

impl RunProgress {
    /// Progress on `bar`.
    pub fn new(bar: ProgressBar) -> Self {
        Self {
            bar,
            last_eval: None,
        }
    }
}

impl Observer for RunProgress {
    fn started(&mut self, first: u64, last: u64) {
        self.bar.set_length(last);
        self.bar.set_position(first.saturating_sub(1));
    }

    fn evaluated(&mut self, step: u64, r: &EvalResult) {
        self.last_eval = Some(r.accuracy);
        self.bar
            .suspend(|| tracing::info!(step, accuracy = r.accuracy, held_out = r.n, "eval"));
    }

    fn step_done(&mut self, m: &StepMetrics) {
        self.bar.set_position(m.step);
        let k3 = m.k3_kl.map_or("-".to_string(), |v| format!("{v:.2e}"));
        let eval = self
            .last_eval
            .map_or("-".to_string(), |v| format!("{v:.3}"));
        let peak = m
            .peak_mib
            .map_or(String::new(), |p| format!(" peak {p:.0} MiB"));
        self.bar.set_message(format!(
            "reward {:.3} k3 {k3} eval {eval}{peak}{}",
            m.reward_mean,
            if m.skipped_update { " SKIPPED" } else { "" }
        ));
    }

    fn checkpointed(&mut self, step: u64, dir: &Path) {
        self.bar
            .suspend(|| tracing::info!(step, dir = %dir.display(), "checkpoint written"));
    }
}
