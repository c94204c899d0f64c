//! The backward of a recomputing forward ([`Model::forward_recomputing`], activation
//! checkpointing): the forward kept each decoder layer's input and the experts each MoE layer
//! dispatched, and dropped every layer's graph. The backward runs from the loss to the last
//! layer's output, then layer by layer from the top: the layer runs again on its kept input
//! with the experts it dispatched forced on its rows (so a recomputed router cannot choose
//! differently, whatever its logits' rounding: the R3 replay, applied to the model's own
//! routes), and its graph is differentiated from the gradient of its output and dropped
//! before the layer below runs. The gradients are the ones the whole forward's graph gives:
//! each weight's gradient comes from the one layer that reads it, and the gradient at each
//! layer's output is the same sum of the same terms.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Shape, Tensor, TensorId, Var};

use super::{LayerContext, Model, MoeRecord};
use crate::error::{ModelError, Result};
use crate::narrow_grads::keep_narrow;
use crate::routing_mode::LayerPlan;

/// What a recomputing forward keeps for its backward.
pub(super) struct RecomputeInputs {
    /// The last layer's output as a variable: where the logits' graph starts.
    pub top: Var,
    /// Each decoder layer's input (`[B, T, H]`, or `[N, H]` computed rows of a batch
    /// sharing prefixes), detached.
    pub inputs: Vec<Tensor>,
    /// Per MoE layer, the `[rows · top_k]` experts its rows were dispatched to.
    pub dispatched: Vec<Vec<u32>>,
    /// The computed rows' token ids on the device (the embedding's backward reads them
    /// again).
    pub ids: Tensor,
    /// The shape the embedding gave them (the first layer's input's).
    pub embedded_shape: Shape,
    /// The same ids on the host.
    pub host_ids: Vec<u32>,
    /// The forward's rotary tables, attention mask, routed rows and shared slots.
    pub ctx: LayerContext,
}

/// The layers of a recomputing forward, waiting for the loss: [`LayerRecompute::backward`]
/// gives every weight's gradient.
pub struct LayerRecompute<'m> {
    model: &'m Model,
    kept: RecomputeInputs,
    /// The 16-bit dtype the variables' gradients are kept in where it holds them exactly.
    narrow_grads: Option<DType>,
}

impl std::fmt::Debug for LayerRecompute<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerRecompute")
            .field("layers", &self.kept.inputs.len())
            .finish()
    }
}

impl<'m> LayerRecompute<'m> {
    /// What `model`'s recomputing forward kept, waiting for the loss.
    pub(super) fn new(model: &'m Model, kept: RecomputeInputs) -> Self {
        LayerRecompute {
            model,
            kept,
            narrow_grads: None,
        }
    }

    /// Keeps each variable's gradient in `narrow` (bf16 or f16) where that dtype holds it
    /// exactly ([`keep_narrow`]: a 16-bit forward's weight gradients are 16-bit values), as
    /// each layer's backward delivers it: 2 bytes a parameter instead of 4 for the rest of
    /// the backward and after it. Readers widen them ([`in_dtype_of`]).
    ///
    /// [`in_dtype_of`]: crate::narrow_grads::in_dtype_of
    pub fn keep_gradients_narrow(mut self, narrow: DType) -> Self {
        self.narrow_grads = Some(narrow);
        self
    }

    /// The gradients of `loss` (a scalar computed from the recomputing forward's logits) for
    /// `vars`, the model's variables: the loss's own backward down to the last layer's
    /// output, then each layer run again and differentiated, from the top. The store holds
    /// what `loss.backward()` over [`Model::forward`]'s graph holds for `vars`, detached (in
    /// 16 bits where [`LayerRecompute::keep_gradients_narrow`] asked for it and they hold it
    /// exactly), and nothing else: the gradients of the loss's other tensors (the logits')
    /// are let go before the layers run again. A tied embedding's two parts (the head's and
    /// the lookup's) are summed in its own dtype, as one backward's store sums them.
    pub fn backward<'v>(
        self,
        loss: Tensor,
        vars: impl IntoIterator<Item = &'v Var>,
    ) -> Result<GradStore> {
        let mut grads = GradStore::default();
        self.backward_each(loss, vars, |var, gradient| {
            grads.insert(var, gradient);
            Ok(())
        })?;
        Ok(grads)
    }

    /// [`LayerRecompute::backward`] handing each variable's gradient to `each` as it is
    /// complete — the loss's own backward's (the head and final norm), then each layer's as
    /// it runs again, then the embedding's — instead of keeping a store of them:
    /// `each(var, gradient)` gets the variable (one of `vars`) and its gradient, detached
    /// (kept in 16 bits where asked and exact), once. A tied embedding's part from the head
    /// waits for the lookup's part and the two are handed as their sum, in the order and
    /// dtype one backward's store adds them. A caller summing gradients over micro-batches
    /// adds each to its sums and lets it go, so no second set of gradients stands beside
    /// the sums.
    pub fn backward_each<'v>(
        self,
        loss: Tensor,
        vars: impl IntoIterator<Item = &'v Var>,
        mut each: impl FnMut(&Tensor, Tensor) -> Result<()>,
    ) -> Result<()> {
        let vars: HashMap<TensorId, Tensor> = vars
            .into_iter()
            .map(|v| (v.as_tensor().id(), v.as_tensor().clone()))
            .collect();
        let (model, kept, narrow) = (self.model, self.kept, self.narrow_grads);
        let mut top = loss.backward()?;
        // The loss is taken, not borrowed, so its graph goes here: the head's (the `[P, V]`
        // logits and what the loss computed from them, 6–10 GB at 10 k tokens of a 151,936
        // vocabulary in f32) stood through every layer's recompute below, where this
        // backward's memory peaks.
        drop(loss);
        let mut grad = top.remove(kept.top.as_tensor()).ok_or_else(|| {
            ModelError::Input("the loss does not depend on the recomputing forward's logits".into())
        })?;
        // The head's part of a tied embedding, held until the lookup's part comes.
        let tied = model.embed.id();
        let mut held: Option<(Tensor, Tensor)> = None;
        hand_parts(&top, &vars, narrow, &mut |var, part| {
            if var.id() == tied {
                held = Some((var.clone(), part));
                Ok(())
            } else {
                each(var, part)
            }
        })?;
        drop(top);
        let forced: Vec<LayerPlan> = kept
            .dispatched
            .into_iter()
            .map(|ids| LayerPlan {
                forced: vec![true; kept.ctx.rows.host.len()],
                ids,
                count_differences: false,
                copies: None,
            })
            .collect();
        let ctx = kept.ctx;
        // Each layer's input is let go once its layer has run again.
        let mut inputs = kept.inputs;
        for (i, layer) in model.layers.iter().enumerate().rev() {
            let input = inputs.pop().ok_or_else(|| {
                ModelError::Input(format!("no kept input for layer {i} to run again"))
            })?;
            let input = Var::from_tensor(&input)?;
            let mut moe = MoeRecord::default();
            let output = model.layer_forward(
                i,
                layer,
                input.as_tensor().clone(),
                &ctx,
                Some(&forced),
                &mut moe,
            )?;
            let local = seeded_backward(&output, &grad)?;
            grad = take_grad(&local, input.as_tensor(), i)?;
            hand_parts(&local, &vars, narrow, &mut each)?;
        }
        let embedded = model.embed_tokens(&kept.ids, &kept.host_ids, &kept.embedded_shape)?;
        if embedded.track_op() {
            let local = seeded_backward(&embedded, &grad)?;
            hand_parts(&local, &vars, narrow, &mut |var, part| match held.take() {
                Some((held_var, first)) if held_var.id() == var.id() => {
                    each(var, add_parts(&first, &part, var.dtype(), narrow)?)
                }
                other => {
                    held = other;
                    each(var, part)
                }
            })?;
        }
        // A head part whose lookup part never came (the embedding not differentiated).
        if let Some((var, part)) = held {
            each(&var, part)?;
        }
        Ok(())
    }
}

/// `first + second` in `dtype` (each part widened or narrowed to it), kept in `narrow`
/// where that holds the sum exactly, detached: how one backward's store adds a weight's two
/// gradient parts.
fn add_parts(
    first: &Tensor,
    second: &Tensor,
    dtype: DType,
    narrow: Option<DType>,
) -> Result<Tensor> {
    let sum = first.to_dtype(dtype)?.add(&second.to_dtype(dtype)?)?;
    Ok(match narrow {
        Some(narrow) => keep_narrow(&sum, narrow)?,
        None => sum.detach(),
    })
}

/// The backward of `output`'s graph from the gradient `grad` of `output`: of
/// `Σ output ⊙ grad`, whose gradient at `output` is `grad` exactly (`1 · grad`).
fn seeded_backward(output: &Tensor, grad: &Tensor) -> Result<GradStore> {
    Ok(output.mul(grad)?.sum_all()?.backward()?)
}

/// The gradient `local` holds for the recomputed input of layer `i`.
fn take_grad(local: &GradStore, input: &Tensor, i: usize) -> Result<Tensor> {
    local.get(input).cloned().ok_or_else(|| {
        ModelError::Input(format!(
            "layer {i}'s recomputed output does not depend on its input"
        ))
    })
}

/// Hands each gradient `local` holds for one of `vars` to `each`, detached (a gradient from a
/// backward still records the ops that made it, which would keep the layer's activations
/// alive) and kept in `narrow` where that holds it exactly.
fn hand_parts(
    local: &GradStore,
    vars: &HashMap<TensorId, Tensor>,
    narrow: Option<DType>,
    each: &mut dyn FnMut(&Tensor, Tensor) -> Result<()>,
) -> Result<()> {
    for id in local.get_ids() {
        let (Some(var), Some(part)) = (vars.get(id), local.get_id(*id)) else {
            continue;
        };
        let part = match narrow {
            Some(narrow) => keep_narrow(part, narrow)?,
            None => part.detach(),
        };
        each(var, part)?;
    }
    Ok(())
}
