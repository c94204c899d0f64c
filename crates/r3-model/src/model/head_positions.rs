//! Which positions of a batch the vocabulary head projects, and how per-position values
//! computed for those positions alone are laid back over the padded batch.
//!
//! A policy's loss reads the predictions of its response tokens only. Heading every padded
//! slot from the shortest prompt on also projects the longer prompts' positions and every
//! padding slot; at a real vocabulary (151,936 columns) those rows are the largest tensors of
//! a step (the logits and their gradient, `[rows, vocab]` f32 each) and a tenth of its
//! matrix work. [`HeadPositions::Spans`] asks for each sequence's own positions only.

use std::ops::Range;

use candle_core::Tensor;

use crate::error::{ModelError, Result};
use crate::layers::gather_rows::GatherRows;

/// The positions whose next-token logits a forward returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadPositions {
    /// Positions `from..T` of every sequence, padding included: logits
    /// `[B, T − from, vocab]` (HF's `logits_to_keep`).
    From(usize),
    /// Per sequence, the positions of its range, within its real tokens: logits
    /// `[P, vocab]`, one row per position, sequence after sequence, P the ranges' total
    /// length (a policy's scoring: the predictions of the response tokens).
    Spans(Vec<Range<usize>>),
}

impl HeadPositions {
    /// Refuses positions past their sequence (`Spans`) or past the batch of `t` positions
    /// (`From`).
    pub(crate) fn check(&self, lengths: &[usize], t: usize) -> Result<()> {
        match self {
            HeadPositions::From(from) => check_from(*from, t),
            HeadPositions::Spans(spans) => check_spans(spans, lengths),
        }
    }

    /// The slots `b·T + p` of the padded `[B, T]` batch whose logits this asks for, in the
    /// logits' row order; refused as [`HeadPositions::check`] refuses.
    pub(crate) fn slots(&self, lengths: &[usize], t: usize) -> Result<Vec<u32>> {
        self.check(lengths, t)?;
        let slot = |b: usize, p: usize| (b * t + p) as u32;
        Ok(match self {
            HeadPositions::From(from) => (0..lengths.len())
                .flat_map(|b| (*from..t).map(move |p| slot(b, p)))
                .collect(),
            HeadPositions::Spans(spans) => spans
                .iter()
                .enumerate()
                .flat_map(|(b, span)| span.clone().map(move |p| slot(b, p)))
                .collect(),
        })
    }
}

/// Refuses logits from position `from` of a batch of `t` positions unless one is left.
fn check_from(from: usize, t: usize) -> Result<()> {
    match from < t {
        true => Ok(()),
        false => Err(ModelError::Input(format!(
            "logits from position {from}: the batch has {t} positions"
        ))),
    }
}

/// Refuses `got` values of `what` where there are `want` rows.
pub(crate) fn check_rows(what: &str, got: usize, want: usize) -> Result<()> {
    match got == want {
        true => Ok(()),
        false => Err(ModelError::Input(format!(
            "{what}: {got} for {want} head rows"
        ))),
    }
}

/// Refuses `spans` unless there is one per sequence, each within its sequence's `lengths`.
fn check_spans(spans: &[Range<usize>], lengths: &[usize]) -> Result<()> {
    if spans.len() != lengths.len() {
        return Err(ModelError::Input(format!(
            "head positions: {} ranges for a batch of {} sequences",
            spans.len(),
            lengths.len()
        )));
    }
    match spans
        .iter()
        .zip(lengths)
        .enumerate()
        .find(|(_, (span, &len))| span.start > span.end || span.end > len)
    {
        Some((b, (span, len))) => Err(ModelError::Input(format!(
            "head positions: sequence {b}'s range {span:?} is not within its {len} tokens"
        ))),
        None => Ok(()),
    }
}

/// `[B, width, …]` from `values` (`[P, …]`, one row per position of `spans`, sequence after
/// sequence): each row at its sequence's position, zeros elsewhere; differentiable in
/// `values` (each position's gradient read back from its slot).
pub fn spread_over_spans(values: &Tensor, spans: &[Range<usize>], width: usize) -> Result<Tensor> {
    let p: usize = spans.iter().map(|s| s.len()).sum();
    let dims = values.dims();
    if dims.first() != Some(&p) {
        return Err(ModelError::Input(format!(
            "spread: values {dims:?} for {p} positions"
        )));
    }
    if let Some((b, span)) = spans.iter().enumerate().find(|(_, s)| s.end > width) {
        return Err(ModelError::Input(format!(
            "spread: sequence {b}'s range {span:?} past {width} columns"
        )));
    }
    // Row `p` of the source is the zero every other slot reads (it takes no gradient).
    let mut ids = vec![p as u32; spans.len() * width];
    let mut next = 0u32;
    for (b, span) in spans.iter().enumerate() {
        for at in span.clone() {
            ids[b * width + at] = next;
            next += 1;
        }
    }
    let mut zero_row = vec![1];
    zero_row.extend_from_slice(&dims[1..]);
    let zero = Tensor::zeros(zero_row, values.dtype(), values.device())?;
    let source = Tensor::cat(&[values, &zero], 0)?;
    let spread = GatherRows::new(ids, p + 1, p)?.apply(&source)?;
    let mut out = vec![spans.len(), width];
    out.extend_from_slice(&dims[1..]);
    Ok(spread.reshape(out)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn slots_follow_the_ranges_sequence_after_sequence() {
        let spans = HeadPositions::Spans(vec![2..4, 0..0, 1..3]);
        assert_eq!(spans.slots(&[4, 2, 5], 6).expect("slots"), [2, 3, 13, 14]);
        let from = HeadPositions::From(4);
        assert_eq!(from.slots(&[4, 6], 6).expect("slots"), [4, 5, 10, 11]);
    }

    #[test]
    fn positions_past_a_sequence_are_refused_by_name() {
        let err = HeadPositions::Spans(vec![0..2, 1..4])
            .slots(&[3, 3], 5)
            .expect_err("past the second sequence");
        assert!(err.to_string().contains("sequence 1's range 1..4"), "{err}");
        let one_range = vec![0..2; 1];
        let err = HeadPositions::Spans(one_range)
            .slots(&[3, 3], 5)
            .expect_err("one range short");
        assert!(
            err.to_string().contains("1 ranges for a batch of 2"),
            "{err}"
        );
        let err = HeadPositions::From(5)
            .slots(&[3, 3], 5)
            .expect_err("no position left");
        assert!(err.to_string().contains("logits from position 5"), "{err}");
    }

    /// Hand-placed values, zeros elsewhere; each value's gradient is its slot's.
    #[test]
    fn spread_places_each_value_and_reads_its_gradient_back() {
        let dev = Device::Cpu;
        let values = Var::new(&[1f32, 2., 3., 4.], &dev).expect("values");
        let spans = [1..3, 0..0, 0..2];
        let spread = spread_over_spans(values.as_tensor(), &spans, 3).expect("spread");
        assert_eq!(
            spread.to_vec2::<f32>().expect("rows"),
            [[0., 1., 2.], [0., 0., 0.], [3., 4., 0.]]
        );
        let weights = Tensor::new(&[[9f32, 10., 11.], [12., 13., 14.], [15., 16., 17.]], &dev)
            .expect("weights");
        let grads = (spread * weights)
            .expect("product")
            .sum_all()
            .expect("sum")
            .backward()
            .expect("backward");
        let grad = grads.get(values.as_tensor()).expect("gradient");
        assert_eq!(grad.to_vec1::<f32>().expect("grad"), [10., 11., 15., 16.]);
        let err = spread_over_spans(values.as_tensor(), &[0..3, 0..2], 3).expect_err("5 of 4");
        assert!(err.to_string().contains("for 5 positions"), "{err}");
        let err = spread_over_spans(values.as_tensor(), &[0..4, 0..0], 3).expect_err("too wide");
        assert!(err.to_string().contains("past 3 columns"), "{err}");
    }
}
