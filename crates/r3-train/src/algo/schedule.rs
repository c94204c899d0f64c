//! Learning-rate schedule: linear warm-up, then constant or cosine decay.

use serde::{Deserialize, Serialize};

/// Shape of the schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrDecay {
    /// Stay at the peak rate.
    #[default]
    Constant,
    /// Cosine from the peak down to `peak · min_lr_ratio` at the last step.
    Cosine,
}

/// A learning-rate schedule over `total_steps` optimiser steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub peak_lr: f64,
    /// Steps of linear warm-up (0 = none).
    pub warmup_steps: u64,
    /// Total optimiser steps (for cosine).
    pub total_steps: u64,
    /// What happens after warm-up.
    pub decay: LrDecay,
    /// Final rate as a fraction of the peak (cosine only).
    pub min_lr_ratio: f64,
}

impl LrSchedule {
    /// Learning rate for 0-based optimiser step `step`: `peak·(step+1)/warmup` during
    /// warm-up, then constant or cosine.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.decay {
            LrDecay::Constant => self.peak_lr,
            LrDecay::Cosine => {
                let span = self
                    .total_steps
                    .saturating_sub(self.warmup_steps)
                    .saturating_sub(1)
                    .max(1);
                let done = (step - self.warmup_steps).min(span) as f64 / span as f64;
                let min = self.peak_lr * self.min_lr_ratio;
                min + (self.peak_lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * done).cos())
            }
        }
    }
}
