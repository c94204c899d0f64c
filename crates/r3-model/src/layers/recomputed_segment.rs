//! A segment of cheap ops over one or a few tensors (a per-head norm, a transpose, a rotation,
//! a rounding) as one op of the graph whose backward runs the segment again.
//!
//! candle keeps every op's input until the backward, so a chain of ops over one tensor keeps
//! a copy of it per op: an attention layer's queries were kept as the projection's output,
//! the per-head norm's output, its transposed copy (the rotation reads it contiguous) and the
//! unrounded rotation, four `[tokens, heads · head_dim]` f32 tensors where the rounded
//! rotation (the attention's input) is what a backward reads next (on the 30B-A3B shape at 8
//! × 512 tokens, ≈ 0.2 GB a layer for queries and keys). As one op the graph keeps the
//! segment's inputs alone; its backward runs the segment on them again, tracked, and takes
//! the gradients from the segment's own rules, seeded with the gradient at its output
//! (`Tensor::backward_from`, the vendored candle's): the same ops forward and backward, so
//! the same values and gradients bit for bit, for one more forward of the segment (what
//! Megatron-LM calls selective recomputation).

use std::sync::Arc;

use candle_core::{CustomOp1, CustomOp2, CustomOp3, Tensor, Var};

use super::precomputed::{precomputed_fwd, Precomputed};
use crate::error::{ModelError, Result};

/// A segment of ops from its inputs to its output. What it reads besides its inputs is a
/// constant to it: a variable it reads must be one of its inputs, or its gradient through the
/// segment is lost.
pub type Segment = Arc<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// `segment(inputs)`, differentiable in each input that is, the graph keeping the inputs
/// alone (module doc). One to three inputs; with nothing to differentiate, the segment's
/// value as it is.
pub fn recomputed_segment(inputs: &[&Tensor], segment: Segment) -> Result<Tensor> {
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let value = segment(&detached)?;
    if !inputs.iter().any(|t| t.track_op()) {
        return Ok(value);
    }
    let value = Precomputed::new(value);
    Ok(match inputs {
        [a] => a.apply_op1(RecomputedSegment::<1> { value, segment })?,
        [a, b] => a.apply_op2(b, RecomputedSegment::<2> { value, segment })?,
        [a, b, c] => a.apply_op3(b, c, RecomputedSegment::<3> { value, segment })?,
        _ => {
            return Err(ModelError::Input(format!(
                "a recomputed segment takes one to three inputs, not {}",
                inputs.len()
            )))
        }
    })
}

/// The op over `N` inputs: its value precomputed, its backward the segment run again.
struct RecomputedSegment<const N: usize> {
    value: Precomputed,
    segment: Segment,
}

impl<const N: usize> RecomputedSegment<N> {
    /// The gradients at `args` (None for one that is not differentiated) for the gradient
    /// `grad` at the output: the segment run again on leaves holding the args' values, its
    /// backward seeded with `grad`.
    fn grads(&self, args: &[&Tensor], grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let leaves = args
            .iter()
            .map(|a| match a.track_op() {
                true => Var::from_tensor(&a.detach()).map(|v| v.as_tensor().clone()),
                false => Ok(a.detach()),
            })
            .collect::<candle_core::Result<Vec<Tensor>>>()?;
        let out = (self.segment)(&leaves)
            .map_err(|e| candle_core::Error::Msg(format!("recomputed segment: {e}")))?;
        let store = out.backward_from(grad)?;
        Ok(args
            .iter()
            .zip(&leaves)
            .map(|(a, leaf)| match a.track_op() {
                true => store.get(leaf).cloned(),
                false => None,
            })
            .collect())
    }
}

impl CustomOp1 for RecomputedSegment<1> {
    fn name(&self) -> &'static str {
        "r3-recomputed-segment"
    }

    precomputed_fwd!(1);

    fn bwd(&self, a: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(self.grads(&[a], grad)?.remove(0))
    }
}

impl CustomOp2 for RecomputedSegment<2> {
    fn name(&self) -> &'static str {
        "r3-recomputed-segment"
    }

    precomputed_fwd!(2);

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for RecomputedSegment<3> {
    fn name(&self) -> &'static str {
        "r3-recomputed-segment"
    }

    precomputed_fwd!(3);

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{f64_bits, seeded_tensor};
    use candle_core::DType;

    /// A chain of a product with a weight, a transpose, an exponential and a sum with a
    /// second input, as three segments (one, two and three inputs) and as the plain chain:
    /// the same value and the same gradients of every input bit for bit, an input not
    /// differentiated getting none.
    #[test]
    fn a_segment_gives_the_chains_values_and_gradients_bit_for_bit() {
        let x = Var::from_tensor(&seeded_tensor(&[3, 4], 1, DType::F32)).expect("x");
        let w = Var::from_tensor(&seeded_tensor(&[4], 2, DType::F32)).expect("w");
        let c = seeded_tensor(&[4, 3], 3, DType::F32);
        let probe = seeded_tensor(&[4, 3], 4, DType::F32);
        let chain = |x: &Tensor, w: &Tensor, c: &Tensor| -> Result<Tensor> {
            let y = x.broadcast_mul(w)?.t()?.exp()?;
            Ok((y * c)?.tanh()?)
        };
        let plain = chain(x.as_tensor(), w.as_tensor(), &c).expect("plain");
        let grads = |y: &Tensor| {
            (y * &probe)
                .and_then(|l| l.sum_all())
                .and_then(|l| l.backward())
                .expect("backward")
        };
        let want = grads(&plain);
        let of = |inputs: &[&Tensor], segment: Segment| {
            recomputed_segment(inputs, segment).expect("segment")
        };
        let three = of(
            &[x.as_tensor(), w.as_tensor(), &c],
            Arc::new(move |t: &[Tensor]| chain(&t[0], &t[1], &t[2])),
        );
        let (wc, cc) = (w.as_tensor().detach(), c.clone());
        let one = of(
            &[x.as_tensor()],
            Arc::new(move |t: &[Tensor]| chain(&t[0], &wc, &cc)),
        );
        let cc = c.clone();
        let two = of(
            &[x.as_tensor(), w.as_tensor()],
            Arc::new(move |t: &[Tensor]| chain(&t[0], &t[1], &cc)),
        );
        for (name, y, has_w) in [
            ("one", &one, false),
            ("two", &two, true),
            ("three", &three, true),
        ] {
            assert_eq!(f64_bits(y), f64_bits(&plain), "{name}: value");
            let got = grads(y);
            assert_eq!(
                f64_bits(got.get(x.as_tensor()).expect("dx")),
                f64_bits(want.get(x.as_tensor()).expect("dx")),
                "{name}: dx"
            );
            match has_w {
                true => assert_eq!(
                    f64_bits(got.get(w.as_tensor()).expect("dw")),
                    f64_bits(want.get(w.as_tensor()).expect("dw")),
                    "{name}: dw"
                ),
                // w read by the segment as a constant: no gradient reaches it through the op
                false => assert!(got.get(w.as_tensor()).is_none(), "{name}: dw"),
            }
            assert!(got.get(&c).is_none(), "{name}: c is no variable");
        }
        let four = recomputed_segment(
            &[x.as_tensor(), w.as_tensor(), &c, &c],
            Arc::new(|t: &[Tensor]| Ok(t[0].clone())),
        );
        assert!(four.is_err(), "four inputs");
    }
}
