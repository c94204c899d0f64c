//! A decode step's attention mask, as the caller gives it: the additive values themselves,
//! or for each query row the runs of cache slots it sees, from which the additive mask is
//! built where the step runs. A step's mask has `batch · time · slots` values: built on the
//! host and copied over, at a batch of 256 decoding over 32 k slots that is 8 M floats a
//! step (milliseconds of host work and a 32 MB copy, every step), and a 20 k-token prefill's
//! is 1.6 GB. The runs are 16 bytes a row, and the decode kernel reads them as they are: the
//! additive mask is built from them only for a layer that composes its attention.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::layers::attention::CacheMask;

/// The cache slots one query row of a step sees: the slots of two half-open runs, either
/// of which may be empty. A row of a padded batch that holds cached positions, a gap of
/// padding and then its fed positions sees a run of each; a decoding row, one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SeenSlots {
    runs: [(u32, u32); 2],
}

impl SeenSlots {
    /// The slots `slots` (empty where `start ≥ end`).
    pub fn run(slots: Range<usize>) -> Self {
        Self::runs(slots, 0..0)
    }

    /// The slots of `first` and of `second` (each empty where its `start ≥ end`).
    pub fn runs(first: Range<usize>, second: Range<usize>) -> Self {
        let pair = |r: Range<usize>| {
            let end = r.end.min(u32::MAX as usize) as u32;
            (r.start.min(r.end).min(u32::MAX as usize) as u32, end)
        };
        Self {
            runs: [pair(first), pair(second)],
        }
    }

    /// The two runs as `[from, to, from, to]` (what the decode kernel reads per query row).
    pub fn bounds(&self) -> [u32; 4] {
        let [(a, b), (c, d)] = self.runs;
        [a, b, c, d]
    }

    /// Whether the row sees slot `slot`.
    pub fn sees(&self, slot: usize) -> bool {
        self.runs
            .iter()
            .any(|&(from, to)| (from as usize..to as usize).contains(&slot))
    }

    /// Slots seen, over both runs (a slot in both counted twice).
    fn count(&self) -> usize {
        self.runs
            .iter()
            .map(|&(from, to)| (to - from) as usize)
            .sum()
    }

    /// One past the last slot either run holds (0 where both are empty).
    fn end(&self) -> usize {
        self.runs
            .iter()
            .filter(|&&(from, to)| to > from)
            .map(|&(_, to)| to as usize)
            .max()
            .unwrap_or(0)
    }
}

/// A step's attention mask.
#[derive(Debug, Clone, Copy)]
pub enum StepMask<'a> {
    /// `[batch, time, slots + time]` additive values: 0 where a query sees a key, −∞ where
    /// it does not; every query row must see at least one key.
    Additive(&'a [f32]),
    /// `[batch · time]` query rows' seen slots (each at least one, all below `slots + time`):
    /// the additive mask is built from them on the step's device.
    Seen(&'a [SeenSlots]),
}

impl<'a> StepMask<'a> {
    /// The step's mask as its attention layers read it ([`CacheMask`]): for seen slots, the
    /// runs on `device` (u32 `[batch · time, 4]`: what the decode kernel reads) and the
    /// additive mask built from them where a layer composes; for additive values, those.
    /// An error names what does not fit the step's shape.
    pub(crate) fn cache_mask(
        self,
        shape: (usize, usize, usize),
        device: &Device,
        dtype: DType,
    ) -> Result<CacheMask<'a>> {
        // Checked before any layer runs (a layer that composes builds the mask after the
        // layers before it appended their keys: refused there, the cache would be torn).
        check_mask_size(shape)?;
        Ok(match self {
            StepMask::Additive(_) => CacheMask::from_additive(self.additive(shape, device, dtype)?),
            StepMask::Seen(seen) => {
                let bounds = seen_bounds(seen, shape, device)?;
                let runs = bounds.clone();
                let device = device.clone();
                CacheMask::from_seen(bounds, move || {
                    additive_from_bounds(&runs, shape, &device, dtype)
                })
            }
        })
    }

    /// The `[batch, 1, 1, time, slots]` additive mask on `device` in `dtype` (0 and −∞ are
    /// exact in every float dtype), or an error naming what does not fit the step's shape.
    pub fn additive(
        self,
        shape: (usize, usize, usize),
        device: &Device,
        dtype: DType,
    ) -> Result<Tensor> {
        let (batch, time, slots) = shape;
        let rows = batch * time;
        check_mask_size(shape)?;
        match self {
            StepMask::Additive(values) => {
                if values.len() != rows * slots {
                    return Err(ModelError::Input(format!(
                        "a step of {batch}×{time} over {slots} slots got {} mask values",
                        values.len()
                    )));
                }
                let dims = (batch, 1, 1, time, slots);
                Ok(Tensor::from_slice(values, dims, device)?.to_dtype(dtype)?)
            }
            StepMask::Seen(seen) => {
                additive_from_bounds(&seen_bounds(seen, shape, device)?, shape, device, dtype)
            }
        }
    }
}

/// Errors where a step's mask would pass the 2³² − 1 elements candle's GPU kernels index
/// with 32 bits.
fn check_mask_size((batch, time, slots): (usize, usize, usize)) -> Result<()> {
    let values = (batch * time).saturating_mul(slots);
    if values > u32::MAX as usize {
        return Err(ModelError::Input(format!(
            "a step of {batch}×{time} over {slots} slots: its mask's {values} values are past \
             the 2³² − 1 a tensor may hold on a GPU (feed the prompt in chunks)"
        )));
    }
    Ok(())
}

/// Each query row's two runs, u32 `[batch · time, 4]` on `device` (`from, to, from, to`),
/// after checking that every row sees at least one of the `slots` slots and none past them.
fn seen_bounds(
    seen: &[SeenSlots],
    (batch, time, slots): (usize, usize, usize),
    device: &Device,
) -> Result<Tensor> {
    let rows = batch * time;
    if seen.len() != rows {
        return Err(ModelError::Input(format!(
            "a step of {batch}×{time} got {} rows of seen slots",
            seen.len()
        )));
    }
    if let Some((row, s)) = seen
        .iter()
        .enumerate()
        .find(|(_, s)| s.end() > slots || s.count() == 0)
    {
        return Err(ModelError::Input(format!(
            "query row {row} of the step sees slots {:?}: rows must see at least one of the \
             {slots} slots, and none past them",
            s.runs
        )));
    }
    let bounds: Vec<u32> = seen.iter().flat_map(SeenSlots::bounds).collect();
    Ok(Tensor::from_vec(bounds, (rows, 4), device)?)
}

/// The `[batch, 1, 1, time, slots]` additive mask of checked runs `bounds` ([`seen_bounds`])
/// in `dtype`, built where they are: 0 inside either run, −∞ elsewhere.
fn additive_from_bounds(
    bounds: &Tensor,
    shape: (usize, usize, usize),
    device: &Device,
    dtype: DType,
) -> Result<Tensor> {
    check_mask_size(shape)?;
    let (batch, time, slots) = shape;
    let dims = (batch, 1, 1, time, slots);
    let keys = Tensor::arange(0u32, slots as u32, device)?.reshape((1, slots))?;
    let inside = |from: usize| -> Result<Tensor> {
        let lo = bounds.narrow(1, from, 1)?;
        let hi = bounds.narrow(1, from + 1, 1)?;
        Ok((keys.broadcast_ge(&lo)? * keys.broadcast_lt(&hi)?)?)
    };
    let seen = inside(0)?.maximum(&inside(2)?)?.reshape(dims)?;
    // Chosen into the mask's dtype at once: one byte a value besides the mask.
    let scalar = |v: f32| -> Result<Tensor> {
        Ok(Tensor::new(v, device)?
            .to_dtype(dtype)?
            .broadcast_as(dims)?)
    };
    Ok(seen.where_cond(&scalar(0.0)?, &scalar(f32::NEG_INFINITY)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seen slots give the additive mask a dense build of the same rows gives, value for
    /// value: runs side by side, apart, overlapping, one empty, both touching the ends.
    #[test]
    fn seen_slots_give_the_additive_values() {
        let slots = 9;
        let rows = [
            SeenSlots::run(0..1),
            SeenSlots::run(3..9),
            SeenSlots::runs(1..3, 5..8),
            SeenSlots::runs(2..6, 4..9),
            SeenSlots::runs(4..4, 8..9),
            SeenSlots::runs(0..2, 2..4),
        ];
        let dense: Vec<f32> = rows
            .iter()
            .flat_map(|r| {
                (0..slots).map(|k| match r.sees(k) {
                    true => 0.0,
                    false => f32::NEG_INFINITY,
                })
            })
            .collect();
        // By hand: row 2 sees 1, 2, 5, 6, 7.
        let row2: Vec<bool> = dense[2 * slots..3 * slots]
            .iter()
            .map(|&v| v == 0.0)
            .collect();
        let want = [false, true, true, false, false, true, true, true, false];
        assert_eq!(row2, want);
        for dtype in [DType::F32, DType::BF16] {
            let got = StepMask::Seen(&rows)
                .additive((2, 3, slots), &Device::Cpu, dtype)
                .expect("built");
            let want = StepMask::Additive(&dense)
                .additive((2, 3, slots), &Device::Cpu, dtype)
                .expect("dense");
            assert_eq!(got.dims(), &[2, 1, 1, 3, slots]);
            assert_eq!(got.dtype(), dtype);
            let values = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("values")
            };
            assert_eq!(values(&got), values(&want), "{dtype:?}");
        }
    }

    /// Rows that see nothing, see past the slots, or are too few or too many are refused,
    /// naming the row or the counts.
    #[test]
    fn seen_slots_that_do_not_fit_the_step_are_refused() {
        let shape = (1, 2, 5);
        let refuse = |rows: &[SeenSlots]| {
            StepMask::Seen(rows)
                .additive(shape, &Device::Cpu, DType::F32)
                .expect_err("refused")
                .to_string()
        };
        #[allow(clippy::reversed_empty_ranges)] // A reversed run is empty, as documented.
        let err = refuse(&[SeenSlots::run(0..1), SeenSlots::runs(3..3, 4..2)]);
        assert!(err.contains("query row 1"), "{err}");
        let err = refuse(&[SeenSlots::run(0..6), SeenSlots::run(0..1)]);
        assert!(
            err.contains("query row 0") && err.contains("5 slots"),
            "{err}"
        );
        let err = refuse(&[SeenSlots::run(0..1)]);
        assert!(err.contains("got 1 rows"), "{err}");
        let huge = StepMask::Seen(&[])
            .additive((2, 50_000, 50_000), &Device::Cpu, DType::F32)
            .expect_err("past 32 bits")
            .to_string();
        assert!(huge.contains("5000000000 values"), "{huge}");
        let err = StepMask::Additive(&[0.0; 9])
            .additive(shape, &Device::Cpu, DType::F32)
            .expect_err("short")
            .to_string();
        assert!(err.contains("9 mask values"), "{err}");
    }
}
