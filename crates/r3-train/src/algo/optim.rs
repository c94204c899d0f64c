//! AdamW with bias correction and decoupled weight decay, over named variables, with
//! state that can be exported and restored (for checkpoints and `--resume`).
//!
//! Update per parameter θ with gradient g at step t (1-based), as PyTorch's AdamW:
//! `θ ← θ·(1 − lr·wd)`, `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
//! `θ ← θ − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + eps)`.
//! A variable without a gradient in a step is left alone entirely: no decay, no moment
//! update. The policy's routed experts are fused into one variable per layer, so an expert no
//! token was routed to is not such a variable: its slice has an all-zero gradient and gets
//! what a zero gradient gets (moment decay, weight decay, the step of its old moments), as
//! PyTorch's AdamW does for a fused expert tensor (`tests/every_param_updated.rs`). An update that would make any parameter or
//! moment NaN or infinite is not applied at all (see [`AdamW::step`]).
//!
//! On the CPU each parameter tensor is updated by one fused pass (see [`AdamW::step_scaled`]
//! and `algo/fused_optim.rs`), bit-identical to the composed candle ops that any other device
//! takes.
//!
//! A variable is f32, or bf16 for weights held without an f32 master copy
//! (`train.master_weights = "bf16"`): its moments are still f32 and its update is computed in
//! f32 from the widened weight, then rounded to bf16 stochastically (seeded by
//! [`AdamW::set_rounding_seed`], the step and the variable: `r3_model::stochastic_round`), so
//! that updates smaller than half a bf16 step still move the weight in expectation.

use crate::algo::fused_optim::{
    adamw_pass, commit_into, AdamWConstants, FusedOutputs, HostFloats, StagedChecks, StagedUpdate,
};
use crate::error::{Result, TrainError};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use r3_model::cast16::cast16_into;
use r3_model::narrow_grads::in_dtype_of;
use r3_model::optim_pass::{adamw_pass_on_device, swap_staged_into, StagedOnDevice};
use r3_model::stochastic_round::{moment_rounding_keys, rounding_key, stochastic_round_bf16};
use r3_model::weights::check_narrow_copy;
use r3_model::WeightPrecision;
use rayon::prelude::*;
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

impl AdamWParams {
    /// The bias corrections `(1 − β1ᵗ, 1 − β2ᵗ)` of step `t` (1-based).
    pub fn bias_corrections(&self, t: u64) -> (f64, f64) {
        (
            1.0 - self.beta1.powf(t as f64),
            1.0 - self.beta2.powf(t as f64),
        )
    }
}

/// How [`AdamW::step`] computes the update of a tensor the fused pass can take (a CPU f32 or
/// bf16 tensor); every other tensor takes the composed ops. Both give bit-identical results;
/// the choice exists so tests and `r3 bench optim` can compare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdamWKernel {
    /// One fused pass per tensor (the default).
    #[default]
    Fused,
    /// candle's composed elementwise ops (about a dozen passes over the parameters).
    Composed,
}

/// How [`AdamW::step`] keeps the guard's promise that a step is applied whole or not at all.
/// Both give bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpdateStaging {
    /// Every tensor's new θ, m and v are computed and checked, then all committed: the
    /// fastest, holding a staged copy of the parameters and both moments (12 bytes a
    /// parameter) until the commit (the default).
    #[default]
    WholeStep,
    /// Every tensor's update is computed and checked and let go; when all pass, each is
    /// computed again and committed at once: twice the optimiser's arithmetic, one tensor's
    /// staged values at a time (a model that barely fits beside its optimiser state).
    TensorByTensor,
}

/// What one step's every tensor pass shares: the step `t` (1-based), the learning rate and
/// the gradient-clip factor (`None` when not clipped).
#[derive(Debug, Clone, Copy)]
pub struct UpdateAt {
    /// The step, 1-based.
    pub t: u64,
    /// The learning rate.
    pub lr: f64,
    /// The gradient-clip factor, `None` when not clipped.
    pub grad_scale: Option<f32>,
    /// The run's seed of the stochastic rounding of bf16 variables.
    pub rounding_seed: u64,
}

/// One slot's update, computed but not committed.
enum Staged {
    Fused(StagedUpdate),
    /// The fused pass on a GPU; its checks are read from the device once for all tensors.
    OnDevice(StagedOnDevice, StagedChecks),
    Composed {
        m: Tensor,
        v: Tensor,
        new: Tensor,
        checks: StagedChecks,
    },
}

impl Staged {
    fn checks(&self) -> StagedChecks {
        match self {
            Staged::Fused(u) => u.checks,
            Staged::OnDevice(_, checks) => *checks,
            Staged::Composed { checks, .. } => *checks,
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
    /// The variable's held 16-bit copy, rewritten after each update of the variable
    /// ([`AdamW::hold_narrow_copies`]).
    copy: Option<Var>,
}

impl Slot {
    /// Rewrites the held copy (if any) from the variable's current values, in place.
    fn refresh_copy(&self) -> Result<()> {
        if let Some(copy) = &self.copy {
            // One pass into the copy's own storage (no new buffer, no second copy).
            cast16_into(self.var.as_tensor(), copy.as_tensor())?;
        }
        Ok(())
    }
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

/// Whether every element of `t` is finite, by the composed path's test: the sum of finite
/// values is finite, and one NaN or infinity makes it NaN or infinite. The sum can also
/// overflow on finite values near the type's maximum (no sane weight, but then a false skip);
/// the fused pass checks each element instead. One pass, no copy to the host.
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
    kernel: AdamWKernel,
    staging: UpdateStaging,
    /// The seed of the stochastic rounding of bf16 variables' updates.
    rounding_seed: u64,
    /// The dtype the moments are kept in: f32, or bf16 (`optim.moments_dtype`).
    moments: DType,
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
                if !matches!(var.dtype(), DType::F32 | DType::BF16) {
                    return Err(TrainError::InvalidConfig {
                        field: "optimiser variables",
                        reason: format!(
                            "{name} is {:?}: AdamW updates f32 variables, or bf16 ones held \
                             without an f32 master (train.master_weights = \"bf16\")",
                            var.dtype()
                        ),
                    });
                }
                // The moments are f32 for a bf16 variable too.
                let zeros = Tensor::zeros(var.shape(), DType::F32, var.device())?;
                Ok(Slot {
                    decay: decay(&name, &var),
                    name,
                    m: zeros.clone(),
                    v: zeros,
                    var,
                    copy: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            params,
            step: 0,
            precision: WeightPrecision::F32,
            kernel: AdamWKernel::default(),
            staging: UpdateStaging::default(),
            rounding_seed: 0,
            moments: DType::F32,
        })
    }

    /// Keeps both moments of every variable in `dtype`: f32 (the default) or bf16 (half their
    /// memory, 4 bytes a parameter instead of 8; each step computes them in f32 from their
    /// widened values and rounds them to bf16 stochastically, as bf16 weights are, so the
    /// second moment's small steps are not lost). Moments already held are converted (exact
    /// to f32; rounded to nearest to bf16); any other dtype is refused.
    pub fn set_moment_dtype(&mut self, dtype: DType) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(TrainError::InvalidConfig {
                field: "optim.moments_dtype",
                reason: format!("{dtype:?}: AdamW keeps its moments in f32 or bf16"),
            });
        }
        for slot in &mut self.slots {
            slot.m = slot.m.to_dtype(dtype)?;
            slot.v = slot.v.to_dtype(dtype)?;
        }
        self.moments = dtype;
        Ok(())
    }

    /// The dtype the moments are kept in.
    pub fn moment_dtype(&self) -> DType {
        self.moments
    }

    /// Seeds the stochastic rounding of bf16 variables' updates (the run's seed; 0 until set):
    /// each step's draws for each variable come from this seed, the step and the variable's
    /// place in the name order, so a run, and a run resumed from its checkpoint, rounds the
    /// same way.
    pub fn set_rounding_seed(&mut self, seed: u64) {
        self.rounding_seed = seed;
    }

    /// The seed of the stochastic roundings ([`AdamW::set_rounding_seed`]), which a
    /// gradient summed over micro-batches in bf16 draws from too.
    pub fn rounding_seed(&self) -> u64 {
        self.rounding_seed
    }

    /// How many variables are held in bf16 (no f32 master: their updates are rounded
    /// stochastically).
    pub fn bf16_variables(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.var.dtype() == DType::BF16)
            .count()
    }

    /// Refuses (skips) any update that would leave a parameter past the finite range of
    /// `precision` — the precision the weights are served in, so that no checkpoint or weight
    /// sync holds a value its engine would turn into ±inf. f32 (the default) only refuses
    /// non-finite values.
    pub fn set_weight_precision(&mut self, precision: WeightPrecision) {
        self.precision = precision;
    }

    /// The precision every weight is kept within (see [`AdamW::set_weight_precision`]).
    pub fn weight_precision(&self) -> WeightPrecision {
        self.precision
    }

    /// Chooses how tensors the fused pass can take are updated (results are bit-identical
    /// either way; [`AdamWKernel::Fused`] is the default).
    pub fn set_kernel(&mut self, kernel: AdamWKernel) {
        self.kernel = kernel;
    }

    /// Chooses how a step is staged before it is committed (bit-identical results;
    /// [`UpdateStaging::WholeStep`] is the default).
    pub fn set_staging(&mut self, staging: UpdateStaging) {
        self.staging = staging;
    }

    /// Holds 16-bit copies of variables (`Weights::hold_narrow_copies`: each named as its
    /// variable, of its shape, in bf16 or f16): each is rewritten from its variable now and
    /// after every update that changes it, in the update's commit, so a forward that reads
    /// the copies always reads the current weights rounded (Megatron's bf16 model parameters
    /// refreshed from its fp32 main parameters). A name that is not a variable here, or a
    /// copy of another shape or of a dtype other than bf16 / f16, is refused and nothing is
    /// held.
    pub fn hold_narrow_copies(&mut self, copies: Vec<(String, Var)>) -> Result<()> {
        let mut placed = Vec::with_capacity(copies.len());
        for (name, copy) in copies {
            let i = self
                .slots
                .binary_search_by(|s| s.name.as_str().cmp(&name))
                .map_err(|_| TrainError::InvalidConfig {
                    field: "narrow weight copies",
                    reason: format!("{name} is not a variable of the optimiser"),
                })?;
            check_narrow_copy(self.slots[i].var.as_tensor(), copy.as_tensor(), None).map_err(
                |e| TrainError::InvalidConfig {
                    field: "narrow weight copies",
                    reason: format!("{name}: {e}"),
                },
            )?;
            placed.push((i, copy));
        }
        for (i, copy) in placed {
            self.slots[i].copy = Some(copy);
            self.slots[i].refresh_copy()?;
        }
        Ok(())
    }

    /// How many variables have a held 16-bit copy.
    pub fn narrow_copies_held(&self) -> usize {
        self.slots.iter().filter(|s| s.copy.is_some()).count()
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
    /// every new value is computed into scratch buffers and checked there (all tensors'
    /// at once, or one tensor's at a time and then again: [`AdamW::set_staging`]), and the
    /// variables, moments and step count change only when all pass.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<AdamWStep> {
        self.step_scaled(grads, lr, None)
    }

    /// [`AdamW::step`] on the gradients multiplied by `grad_scale` (the gradient-clip factor,
    /// `None` when not clipped), folded into the update's pass instead of a pass of its own:
    /// the result is bit for bit that of scaling each gradient by `affine(scale, 0)` first.
    ///
    /// A CPU f32 or bf16 tensor takes the fused pass ([`AdamWKernel::Fused`]): one read of θ,
    /// g, m, v, one write of the staged θ, m, v, the guard's checks in the same pass, tensors
    /// and chunks of big tensors in parallel on the rayon pool. Its finiteness check is per element; the
    /// composed path's is the finiteness of the tensor's sum, which also fails on finite values
    /// whose sum overflows (a false skip the fused check does not make). Committing swaps the
    /// staged buffers in, copying nothing. Any other tensor (another device or dtype) takes the
    /// composed candle ops. A gradient a backward kept in 16 bits (`r3_model::narrow_grads`)
    /// is widened to its variable's dtype for its own tensor's pass only.
    pub fn step_scaled(
        &mut self,
        grads: &GradStore,
        lr: f64,
        grad_scale: Option<f32>,
    ) -> Result<AdamWStep> {
        let t = self.step + 1;
        let at = UpdateAt {
            t,
            lr,
            grad_scale,
            rounding_seed: self.rounding_seed,
        };
        let with_grads: Vec<(usize, Tensor)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| grads.get(s.var.as_tensor()).map(|g| (i, g.detach())))
            .collect();
        if self.staging == UpdateStaging::TensorByTensor {
            return self.step_tensor_by_tensor(with_grads, at);
        }
        // On the calling thread: which tensors take the fused pass, and their output buffers
        // (allocated here, not on the pool's threads, so they come from one heap and reuse
        // the buffers the last step freed).
        let plans: Vec<Option<FusedOutputs>> = with_grads
            .iter()
            .map(|(i, g)| self.fused_outputs(*i, g))
            .collect();
        let fused: Vec<Option<StagedUpdate>> = plans
            .into_par_iter()
            .zip(with_grads.par_iter())
            .map(|(plan, (i, g))| match plan {
                Some(out) => self.fused_update(*i, g, at, out),
                None => Ok(None),
            })
            .collect::<Result<_>>()?;
        let mut staged = Vec::with_capacity(with_grads.len());
        for ((i, g), fused) in with_grads.into_iter().zip(fused) {
            let stage = match fused {
                Some(update) => Staged::Fused(update),
                None => self.staged_elsewhere(i, &g, at)?,
            };
            staged.push((i, stage));
        }
        read_device_checks(&mut staged)?;
        if let Some(refused) = self.verdict(staged.iter().map(|(i, s)| (*i, s.checks()))) {
            return Ok(refused);
        }
        for (i, stage) in staged {
            self.commit(i, stage)?;
        }
        self.step = t;
        Ok(AdamWStep::Applied)
    }

    /// [`UpdateStaging::TensorByTensor`]: each tensor's update computed, checked and let go
    /// (a GPU's checks read back in one copy at the end); when every one passes, each computed
    /// again, by the same arithmetic, and committed at once.
    fn step_tensor_by_tensor(
        &mut self,
        with_grads: Vec<(usize, Tensor)>,
        at: UpdateAt,
    ) -> Result<AdamWStep> {
        let mut checks = Vec::with_capacity(with_grads.len());
        let mut on_device = Vec::new();
        for (i, g) in &with_grads {
            match self.stage_one(*i, g, at)? {
                Staged::OnDevice(update, _) => {
                    on_device.push((checks.len(), update.maxima));
                    checks.push((*i, StagedChecks::ALL_GOOD));
                }
                other => checks.push((*i, other.checks())),
            }
        }
        let maxima: Vec<Tensor> = on_device.iter().map(|(_, m)| m.clone()).collect();
        for ((at, _), read) in on_device.iter().zip(read_maxima(&maxima)?) {
            checks[*at].1 = read;
        }
        if let Some(refused) = self.verdict(checks.into_iter()) {
            return Ok(refused);
        }
        for (i, g) in &with_grads {
            let stage = self.stage_one(*i, g, at)?;
            self.commit(*i, stage)?;
        }
        self.step = at.t;
        Ok(AdamWStep::Applied)
    }

    /// Slot `i`'s update from its gradient `g` (widened first where a backward kept it in 16
    /// bits), computed into new buffers: the fused pass for a CPU f32 or bf16 tensor (chunks in
    /// parallel), the GPU's fused pass, or the composed ops, as in a whole step.
    fn stage_one(&self, i: usize, g: &Tensor, at: UpdateAt) -> Result<Staged> {
        if let Some(out) = self.fused_outputs(i, g) {
            if let Some(update) = self.fused_update(i, g, at, out)? {
                return Ok(Staged::Fused(update));
            }
        }
        self.staged_elsewhere(i, g, at)
    }

    /// The output buffers of slot `i`'s update where it takes the CPU's fused pass (the
    /// fused kernel chosen, the variable and its moments contiguous f32 or bf16 on the CPU,
    /// the gradient `g` on the CPU with as many values); `None` where not.
    fn fused_outputs(&self, i: usize, g: &Tensor) -> Option<FusedOutputs> {
        let slot = &self.slots[i];
        let n = slot.var.elem_count();
        let takes = self.kernel == AdamWKernel::Fused
            && [slot.var.as_tensor(), &slot.m, &slot.v]
                .into_iter()
                .all(|t| HostFloats::of(t).is_some_and(|h| h.slice().len() == n))
            && g.device().is_cpu()
            && g.elem_count() == n;
        takes
            .then(|| FusedOutputs::new(n, slot.var.dtype(), slot.m.dtype()))
            .flatten()
    }

    /// The CPU's fused pass of slot `i` into `out`, its gradient `g` widened first where a
    /// backward kept it in 16 bits (one tensor at a time); `None` where a view is not a
    /// contiguous f32 one.
    fn fused_update(
        &self,
        i: usize,
        g: &Tensor,
        at: UpdateAt,
        out: FusedOutputs,
    ) -> Result<Option<StagedUpdate>> {
        let slot = &self.slots[i];
        // A gradient kept in 16 bits is read as it is, each value widened by the pass.
        let g = match g.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => g.contiguous()?,
            _ => in_dtype_of(g, slot.var.as_tensor())?.contiguous()?,
        };
        let views = (
            HostFloats::of(slot.var.as_tensor()),
            HostFloats::of(&g),
            HostFloats::of(&slot.m),
            HostFloats::of(&slot.v),
        );
        let (Some(theta), Some(g), Some(m), Some(v)) = views else {
            return Ok(None);
        };
        let (theta, g, m, v) = (theta.slice(), g.slice(), m.slice(), v.slice());
        if g.len() != theta.len() {
            return Ok(None);
        }
        let k = adamw_constants(&self.params, at, i, slot.decay);
        Ok(adamw_pass(&k, (theta, g, m, v), out))
    }

    /// Slot `i`'s update off the CPU's fused pass: the GPU's fused pass (which reads a
    /// gradient kept in 16 bits as it is, widening each value as it reads it), else the
    /// composed ops, the gradient widened for this tensor only where a backward kept it in
    /// 16 bits.
    fn staged_elsewhere(&self, i: usize, g: &Tensor, at: UpdateAt) -> Result<Staged> {
        let slot = &self.slots[i];
        let k = adamw_constants(&self.params, at, i, slot.decay);
        if let Some(update) = self.on_device(slot, g, &k)? {
            return Ok(Staged::OnDevice(update, StagedChecks::ALL_GOOD));
        }
        let g = in_dtype_of(g, slot.var.as_tensor())?;
        self.composed(i, &g, at)
    }

    /// The guard's verdict on staged updates' checks: the refusal of the first that would
    /// leave a parameter or moment non-finite, or a parameter past the weight precision's
    /// range; `None` when every one passes.
    fn verdict(&self, checks: impl Iterator<Item = (usize, StagedChecks)>) -> Option<AdamWStep> {
        for (i, checks) in checks {
            let name = &self.slots[i].name;
            for (what, ok) in [
                ("parameter", checks.param_finite),
                ("first moment", checks.m_finite),
                ("second moment", checks.v_finite),
            ] {
                if !ok {
                    return Some(AdamWStep::NonFinite {
                        variable: name.clone(),
                        what,
                    });
                }
            }
            let value = f64::from(checks.max_abs);
            if self.precision != WeightPrecision::F32 && !self.precision.holds(value) {
                return Some(AdamWStep::OutOfRange {
                    variable: name.clone(),
                    value,
                    precision: self.precision,
                });
            }
        }
        None
    }

    /// Writes slot `i`'s staged update into its variable and moments (and its 16-bit copy).
    fn commit(&mut self, i: usize, stage: Staged) -> Result<()> {
        let slot = &mut self.slots[i];
        match stage {
            Staged::Fused(StagedUpdate { theta, m, v, .. }) => {
                let shape = slot.var.shape().clone();
                commit_into(&slot.var, theta)?;
                slot.m = m.into_tensor(&shape)?;
                slot.v = v.into_tensor(&shape)?;
            }
            Staged::OnDevice(
                StagedOnDevice {
                    theta, m, v, copy, ..
                },
                _,
            ) => {
                // The staged buffers become the variable's and its copy's (no copy) where
                // they can; the pass wrote the copy's values already.
                if let Some(theta) = swap_staged_into(slot.var.as_tensor(), theta)? {
                    slot.var.set(&theta)?;
                }
                slot.m = m;
                slot.v = v;
                if let (Some(staged), Some(held)) = (copy, &slot.copy) {
                    if let Some(staged) = swap_staged_into(held.as_tensor(), staged)? {
                        held.set(&staged)?;
                    }
                    return Ok(());
                }
            }
            Staged::Composed { m, v, new, .. } => {
                slot.var.set(&new)?;
                slot.m = m;
                slot.v = v;
            }
        }
        slot.refresh_copy()?;
        Ok(())
    }

    /// The fused pass of one slot's update on its GPU (`None` off a GPU, for a tensor that
    /// is not f32, or when [`AdamWKernel::Composed`] is chosen).
    fn on_device(
        &self,
        slot: &Slot,
        g: &Tensor,
        k: &AdamWConstants,
    ) -> Result<Option<StagedOnDevice>> {
        if self.kernel != AdamWKernel::Fused {
            return Ok(None);
        }
        Ok(adamw_pass_on_device(
            slot.var.as_tensor(),
            g,
            &slot.m,
            &slot.v,
            k,
            slot.copy.as_ref().map(|c| c.dtype()),
        )?)
    }

    /// The composed candle ops of one slot's update (any device), with their checks.
    fn composed(&self, i: usize, g: &Tensor, at: UpdateAt) -> Result<Staged> {
        let AdamWParams {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.params;
        let UpdateAt {
            t,
            lr,
            grad_scale,
            rounding_seed,
        } = at;
        let (bc1, bc2) = self.params.bias_corrections(t);
        let slot = &self.slots[i];
        let g = match grad_scale {
            Some(s) => g.affine(f64::from(s), 0.0)?,
            None => g.clone(),
        };
        // Moments kept in bf16 are computed from their widened values and rounded
        // stochastically (exact no-ops in f32).
        let [m_key, v_key] = moment_rounding_keys(rounding_seed, t, i as u64);
        let kept = |x: Tensor, key: u64| -> Result<Tensor> {
            Ok(match slot.m.dtype() {
                DType::BF16 => stochastic_round_bf16(&x, key)?,
                _ => x,
            })
        };
        let m = kept(
            slot.m
                .to_dtype(DType::F32)?
                .affine(beta1, 0.0)?
                .add(&g.affine(1.0 - beta1, 0.0)?)?,
            m_key,
        )?;
        let v = kept(
            slot.v
                .to_dtype(DType::F32)?
                .affine(beta2, 0.0)?
                .add(&g.sqr()?.affine(1.0 - beta2, 0.0)?)?,
            v_key,
        )?;
        let (m_wide, v_wide) = (m.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
        let m_hat = m_wide.affine(1.0 / bc1, 0.0)?;
        let denom = v_wide.affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, eps)?;
        // A bf16 variable's update is computed from its widened values (exact).
        let theta = slot.var.as_detached_tensor().to_dtype(DType::F32)?;
        let decayed = if slot.decay && weight_decay != 0.0 {
            theta.affine(1.0 - lr * weight_decay, 0.0)?
        } else {
            theta
        };
        let new = decayed.sub(&m_hat.div(&denom)?.affine(lr, 0.0)?)?;
        let new = match slot.var.dtype() {
            DType::BF16 => stochastic_round_bf16(&new, rounding_key(rounding_seed, t, i as u64))?,
            _ => new,
        };
        let checks = StagedChecks {
            param_finite: all_finite(&new)?,
            m_finite: all_finite(&m)?,
            v_finite: all_finite(&v)?,
            max_abs: if self.precision != WeightPrecision::F32 {
                max_abs(&new)? as f32
            } else {
                0.0
            },
        };
        Ok(Staged::Composed { m, v, new, checks })
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
                // Moments are f32 whatever the variable's dtype.
                Ok(t.to_dtype(s.m.dtype())?.to_device(s.var.device())?)
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

/// The checks of every update staged on a GPU, read from the devices in one copy (each
/// tensor's three maxima side by side), in place of their placeholders.
fn read_device_checks(staged: &mut [(usize, Staged)]) -> Result<()> {
    let maxima: Vec<Tensor> = staged
        .iter()
        .filter_map(|(_, s)| match s {
            Staged::OnDevice(u, _) => Some(u.maxima.clone()),
            _ => None,
        })
        .collect();
    let on_device = staged.iter_mut().filter_map(|(_, s)| match s {
        Staged::OnDevice(_, checks) => Some(checks),
        _ => None,
    });
    // `read_maxima` gives one check per maxima tensor, in order.
    for (checks, read) in on_device.zip(read_maxima(&maxima)?) {
        *checks = read;
    }
    Ok(())
}

/// The checks of GPU passes from their `[3]` maxima tensors, read in one copy (nothing read
/// when there are none).
fn read_maxima(maxima: &[Tensor]) -> Result<Vec<StagedChecks>> {
    if maxima.is_empty() {
        return Ok(Vec::new());
    }
    let bits = Tensor::cat(maxima, 0)?.to_vec1::<u32>()?;
    let checks: Vec<StagedChecks> = bits
        .chunks_exact(3)
        .map(|r| StagedChecks::from_maxima([r[0], r[1], r[2]]))
        .collect();
    if checks.len() != maxima.len() {
        return Err(TrainError::Candle(candle_core::Error::Msg(
            "optimiser: fewer device checks read back than updates staged".into(),
        )));
    }
    Ok(checks)
}

/// The fused passes' constants of step `at.t` (1-based) of `params` at learning rate `at.lr`
/// for the variable in slot `slot` (its rounding keys); `decay` says whether this tensor is
/// decayed. What the CPU pass and the GPU kernels (`r3_adamw_*`) both receive. Made here,
/// beside the parameters they come from, so the passes do not depend back on this file.
pub fn adamw_constants(
    params: &AdamWParams,
    at: UpdateAt,
    slot: usize,
    decay: bool,
) -> AdamWConstants {
    let UpdateAt {
        t,
        lr,
        grad_scale,
        rounding_seed,
    } = at;
    let (bc1, bc2) = params.bias_corrections(t);
    AdamWConstants {
        beta1: params.beta1 as f32,
        one_minus_beta1: (1.0 - params.beta1) as f32,
        beta2: params.beta2 as f32,
        one_minus_beta2: (1.0 - params.beta2) as f32,
        inv_bc1: (1.0 / bc1) as f32,
        inv_bc2: (1.0 / bc2) as f32,
        eps: params.eps as f32,
        lr: lr as f32,
        decay: (decay && params.weight_decay != 0.0)
            .then_some((1.0 - lr * params.weight_decay) as f32),
        grad_scale,
        rounding_key: rounding_key(rounding_seed, t, slot as u64),
        moment_keys: moment_rounding_keys(rounding_seed, t, slot as u64),
    }
}
