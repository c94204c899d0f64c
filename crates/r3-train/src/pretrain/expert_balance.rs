//! Expert balance of the pretraining forward (its per-layer loads summed over a batch by
//! r3-routing's `summed_expert_load`): the normalised entropy of a load (1 = every expert
//! equally loaded), and DeepSeek-V3's auxiliary-loss-free balancing, which moves each
//! layer's `e_score_correction_bias` by a fixed step against the sign of the load error
//! instead of adding a balance term to the loss.

use r3_routing::LayerLoad;

use crate::error::{Result, TrainError};
use crate::policy::trainable::TrainablePolicy;

/// Entropy of the load distribution divided by `ln(num_experts)`: 1 when every expert gets
/// the same share, 0 when one expert takes everything (0 for no assignments).
pub fn normalised_entropy(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 || counts.len() < 2 {
        return 0.0;
    }
    let h: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            -p * p.ln()
        })
        .sum();
    h / (counts.len() as f64).ln()
}

/// The bias after one aux-loss-free step: `bias[e] + rate · sign(mean − counts[e])`
/// (unchanged where the load equals the mean).
pub fn balanced_bias(bias: &[f32], counts: &[u64], rate: f64) -> Vec<f32> {
    let mean = counts.iter().sum::<u64>() as f64 / counts.len().max(1) as f64;
    bias.iter()
        .zip(counts)
        .map(|(&b, &c)| {
            let err = mean - c as f64;
            let step = if err > 0.0 {
                rate
            } else if err < 0.0 {
                -rate
            } else {
                0.0
            };
            (f64::from(b) + step) as f32
        })
        .collect()
}

/// Name of layer `layer`'s DeepSeek selection bias.
pub fn score_bias_name(layer: usize) -> String {
    format!(
        "{}.mlp.{}",
        r3_model::spec::layer_prefix(layer),
        r3_model::spec::SCORE_BIAS
    )
}

/// Applies [`balanced_bias`] to every MoE layer's `e_score_correction_bias` of `policy`.
pub fn update_score_bias(
    policy: &mut TrainablePolicy,
    loads: &[LayerLoad],
    rate: f64,
) -> Result<()> {
    for load in loads {
        let name = score_bias_name(load.layer);
        let bias = policy.buffer(&name)?;
        if bias.len() != load.counts.len() {
            return Err(TrainError::Length {
                what: format!("{name} entries (one per expert)"),
                got: bias.len(),
                expected: load.counts.len(),
            });
        }
        policy.set_buffer(&name, balanced_bias(&bias, &load.counts, rate))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_is_one_for_uniform_and_zero_for_one_expert() {
        assert!((normalised_entropy(&[5, 5, 5, 5]) - 1.0).abs() < 1e-12);
        assert_eq!(normalised_entropy(&[9, 0, 0, 0]), 0.0);
        // Two of four experts equally loaded: ln 2 / ln 4 = 1/2.
        assert!((normalised_entropy(&[3, 3, 0, 0]) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn bias_moves_against_the_load_error() {
        // mean load 4: under-loaded experts go up, over-loaded down, exact mean stays.
        let b = balanced_bias(&[0.0, 0.5, -0.5, 1.0], &[1, 4, 8, 3], 0.25);
        assert_eq!(b, vec![0.25, 0.5, -0.75, 1.25]);
    }
}
