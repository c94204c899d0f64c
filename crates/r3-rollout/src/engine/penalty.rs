//! Logit adjustments that depend on the sequence so far, applied before sampling with
//! SGLang's formulas and in its order: frequency penalty, min-new-tokens, presence penalty,
//! repetition penalty, then `logit_bias`. The reported log-prob is taken from the row so
//! adjusted (`next_token::sampled_row`), as SGLang takes it from the logits after its
//! penalties and `apply_logits_bias`.

use std::collections::HashMap;

use crate::sampler::SamplingParams;

/// Adjusts one row of logits in place for a sequence with `output` so far (the prompt plays
/// no part: SGLang's penalizers count output tokens only), of which the last `generated`
/// tokens are this call's (all of them but for a resumed request,
/// whose `min_new_tokens` is what the earlier call left: it counts this call's alone).
///
/// - frequency: `l[t] -= frequency_penalty * count(t in output)`
/// - min-new-tokens: `l[t] = -inf` for every stop id while `generated < min_new_tokens`
///   (`ignore_eos` too, as SGLang's penalizer)
/// - presence: `l[t] -= presence_penalty` if `t` occurs in the output
/// - repetition (`r`): for `t` in the output, `l[t] = l[t] / r` if `l[t] > 0`, else `l[t] * r`
///   (SGLang's `BatchedRepetitionPenalizer`, which cumulates output tokens only)
/// - bias: `l[t] += logit_bias[t]`
pub fn adjust_logits(
    logits: &mut [f32],
    params: &SamplingParams,
    output: &[u32],
    generated: usize,
) {
    let vocab = logits.len();
    let in_vocab = |t: u32| (t as usize) < vocab;
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in output.iter().filter(|&&t| in_vocab(t)) {
            *counts.entry(t).or_insert(0) += 1;
        }
        for (&t, &c) in &counts {
            logits[t as usize] -= params.frequency_penalty * c as f32;
        }
        if generated < params.min_new_tokens {
            mask_stops(logits, params);
        }
        for &t in counts.keys() {
            logits[t as usize] -= params.presence_penalty;
        }
    } else if generated < params.min_new_tokens {
        mask_stops(logits, params);
    }
    if params.repetition_penalty != 1.0 {
        let r = params.repetition_penalty;
        let mut seen = vec![false; vocab];
        for &t in output.iter().filter(|&&t| in_vocab(t)) {
            if !std::mem::replace(&mut seen[t as usize], true) {
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    for &(t, b) in params.logit_bias.iter().filter(|(t, _)| in_vocab(*t)) {
        logits[t as usize] += b;
    }
}

/// Makes every stop id unsampleable.
fn mask_stops(logits: &mut [f32], params: &SamplingParams) {
    for &t in &params.stop_token_ids {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-computed case: logits [2, -1, 0.5, 3, 1], output [0, 3, 0, 1].
    #[test]
    fn penalties_follow_sglangs_formulas() {
        let params = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            repetition_penalty: 2.0,
            logit_bias: vec![(2, 1.0)],
            ..Default::default()
        };
        let mut l = [2.0f32, -1.0, 0.5, 3.0, 1.0];
        adjust_logits(&mut l, &params, &[0, 3, 0, 1], 4);
        // token 0: output twice: 2 - 0.5*2 - 0.25 = 0.75 > 0 -> 0.75 / 2 = 0.375
        // token 1: output once: -1 - 0.5 - 0.25 = -1.75 <= 0 -> -1.75 * 2 = -3.5
        // token 2: untouched by penalties, bias +1 -> 1.5
        // token 3: output once: 3 - 0.5 - 0.25 = 2.25 -> 1.125
        // token 4: not in the output: 1
        assert_eq!(l, [0.375, -3.5, 1.5, 1.125, 1.0]);
    }

    #[test]
    fn min_new_tokens_masks_stop_ids_until_reached() {
        let params = SamplingParams {
            min_new_tokens: 2,
            stop_token_ids: vec![1, 3],
            ..Default::default()
        };
        assert!(params.adjusts_logits(1));
        assert!(!params.adjusts_logits(2));
        let mut l = [0.0f32; 4];
        adjust_logits(&mut l, &params, &[0], 1);
        assert_eq!(l, [0.0, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY]);
        let mut l = [0.0f32; 4];
        adjust_logits(&mut l, &params, &[0, 2], 2);
        assert_eq!(l, [0.0; 4]);
        // A resumed call's minimum counts its own tokens only (the first output token here
        // is the earlier call's, which its `min_new_tokens` already took off).
        let mut l = [0.0f32; 4];
        adjust_logits(&mut l, &params, &[0, 2], 1);
        assert_eq!(l, [0.0, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY]);
        // `ignore_eos` keeps the stop ids from ending the request, not from being masked:
        // SGLang's min-new-tokens penalizer masks them whatever the flag says.
        let ignoring = SamplingParams {
            ignore_eos: true,
            ..params
        };
        let mut l = [0.0f32; 4];
        adjust_logits(&mut l, &ignoring, &[0], 1);
        assert_eq!(l, [0.0, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn neutral_values_change_nothing() {
        let params = SamplingParams::default();
        assert!(!params.adjusts_logits(0));
        let mut l = [0.3f32, -0.7, 1.1];
        adjust_logits(&mut l, &params, &[2, 2], 2);
        assert_eq!(l, [0.3, -0.7, 1.1]);
    }
}
