//! AdamW with bias correction and decoupled weight decay, over named variables, with
//! state that can be exported and restored (for checkpoints and `--resume`).
//!
//! Update per parameter θ with gradient g at step t (1-based), as PyTorch's AdamW:
//! `θ ← θ·(1 − lr·wd)`, `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
//! `θ ← θ − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + eps)`.
//! A parameter without a gradient in a step (e.g. an expert no token was routed to) is left
//! alone entirely: no decay, no moment update. An update that would make any parameter or
//! moment NaN or infinite is not applied at all (see [`AdamW::step`]).

use crate::error::{Result, TrainError};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use r3_model::WeightPrecision;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// AdamW hyper-parameters (the learning rate is passed per step, from the schedule).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWParams {
    /// First-moment decay β1.
    pub beta1: f64,
    /// Second-moment decay β2.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, applied to parameters chosen by the decay rule.
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The usual decay rule: decay matrices (rank ≥ 2), not norm scales or biases.
pub fn decay_matrices_only(_name: &str, var: &Var) -> bool {
    var.rank() >= 2
}

#[derive(Debug)]
struct Slot {
    name: String,
    var: Var,
    decay: bool,
    m: Tensor,
    v: Tensor,
}

/// What [`AdamW::step`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum AdamWStep {
    /// Every variable with a gradient was updated.
    Applied,
    /// Nothing changed: the update would have made `what` of `variable` NaN or infinite.
    NonFinite {
        /// The first variable found non-finite.
        variable: String,
        /// `parameter`, `first moment` or `second moment`.
        what: &'static str,
    },
    /// Nothing changed: the update would have left a parameter of `variable` past the finite
    /// range of the precision the weights are served in (see [`AdamW::set_weight_precision`]).
    OutOfRange {
        /// The first variable found out of range.
        variable: String,
        /// Its largest magnitude after the update.
        value: f64,
        /// The precision that cannot hold it.
        precision: WeightPrecision,
    },
}

/// Whether every element of `t` is finite: the sum of finite values is finite (barring an
/// overflow of values near the type's maximum, which is no sane weight either), and one
/// NaN or infinity makes it NaN or infinite. One pass, no copy to the host.
fn all_finite(t: &Tensor) -> Result<bool> {
    let sum = t.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok(sum.is_finite())
}

/// The largest magnitude in `t`.
fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.abs()?
        .max_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?)
}

/// AdamW over a fixed, name-sorted list of variables.
#[derive(Debug)]
pub struct AdamW {
    slots: Vec<Slot>,
    params: AdamWParams,
    step: u64,
    /// Every parameter must stay within this precision's finite range.
    precision: WeightPrecision,
}

impl AdamW {
    /// Creates the optimiser; `decay(name, var)` says which variables get weight decay.
    pub fn new(
        mut vars: Vec<(String, Var)>,
        params: AdamWParams,
        decay: impl Fn(&str, &Var) -> bool,
    ) -> Result<Self> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = vars.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(TrainError::DuplicateVariable {
                name: w[0].0.clone(),
            });
        }
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                let zeros = var.as_tensor().zeros_like()?;
                Ok(Slot {
                    decay: decay(&name, &var),
                    name,
                    m: zeros.clone(),
                    v: zeros,
                    var,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            params,
            step: 0,
            precision: WeightPrecision::F32,
        })
    }

    /// Refuses (skips) any update that would leave a parameter past the finite range of
    /// `precision` — the precision the weights are served in, so that no checkpoint or weight
    /// sync holds a value its engine would turn into ±inf. f32 (the default) only refuses
    /// non-finite values.
    pub fn set_weight_precision(&mut self, precision: WeightPrecision) {
        self.precision = precision;
    }

    /// Completed update steps.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The variables, sorted by name.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    /// Applies one update with learning rate `lr`, or none at all when it would leave a
    /// parameter or moment NaN or infinite, or a parameter past the weight precision's range:
    /// every new value is computed into scratch tensors and checked there, and the variables,
    /// moments and step count change only when all pass.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<AdamWStep> {
        let AdamWParams {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.params;
        let t = self.step + 1;
        let bc1 = 1.0 - beta1.powf(t as f64);
        let bc2 = 1.0 - beta2.powf(t as f64);
        let mut staged = Vec::with_capacity(self.slots.len());
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(g) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            let g = g.detach();
            let m = slot
                .m
                .affine(beta1, 0.0)?
                .add(&g.affine(1.0 - beta1, 0.0)?)?;
            let v = slot
                .v
                .affine(beta2, 0.0)?
                .add(&g.sqr()?.affine(1.0 - beta2, 0.0)?)?;
            let m_hat = m.affine(1.0 / bc1, 0.0)?;
            let denom = v.affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, eps)?;
            let theta = slot.var.as_detached_tensor();
            let decayed = if slot.decay && weight_decay != 0.0 {
                theta.affine(1.0 - lr * weight_decay, 0.0)?
            } else {
                theta
            };
            let new = decayed.sub(&m_hat.div(&denom)?.affine(lr, 0.0)?)?;
            for (what, tensor) in [
                ("parameter", &new),
                ("first moment", &m),
                ("second moment", &v),
            ] {
                if !all_finite(tensor)? {
                    return Ok(AdamWStep::NonFinite {
                        variable: slot.name.clone(),
                        what,
                    });
                }
            }
            if self.precision != WeightPrecision::F32 {
                let value = max_abs(&new)?;
                if !self.precision.holds(value) {
                    return Ok(AdamWStep::OutOfRange {
                        variable: slot.name.clone(),
                        value,
                        precision: self.precision,
                    });
                }
            }
            staged.push((i, m, v, new));
        }
        for (i, m, v, new) in staged {
            let slot = &mut self.slots[i];
            slot.var.set(&new)?;
            slot.m = m;
            slot.v = v;
        }
        self.step = t;
        Ok(AdamWStep::Applied)
    }

    /// The moment tensors, named `adamw.m.<var>` and `adamw.v.<var>`.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        self.slots
            .iter()
            .flat_map(|s| {
                [
                    (format!("adamw.m.{}", s.name), s.m.clone()),
                    (format!("adamw.v.{}", s.name), s.v.clone()),
                ]
            })
            .collect()
    }

    /// Restores moments saved by [`AdamW::state_tensors`] and the step count; every
    /// variable must be present with its own shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        let mut restored = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let get = |kind: &str| -> Result<Tensor> {
                let key = format!("adamw.{kind}.{}", s.name);
                let t = state
                    .get(&key)
                    .ok_or_else(|| TrainError::MissingOptimizerState { key: key.clone() })?;
                if t.dims() != s.var.dims() {
                    return Err(TrainError::shape(
                        format!("optimiser state `{key}`"),
                        t.dims(),
                        format!("{:?} (the variable's)", s.var.dims()),
                    ));
                }
                Ok(t.to_dtype(s.var.dtype())?.to_device(s.var.device())?)
            };
            restored.push((get("m")?, get("v")?));
        }
        for (slot, (m, v)) in self.slots.iter_mut().zip(restored) {
            slot.m = m;
            slot.v = v;
        }
        self.step = step;
        Ok(())
    }
}
