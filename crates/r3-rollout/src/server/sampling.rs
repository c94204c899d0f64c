//! Sampling parameters as clients send them (SGLang `sampling_params`, OpenAI fields) and
//! their checked conversion to the engine's [`SamplingParams`], with the server's limits.

use serde::Deserialize;

use super::error::ApiError;
use super::ServerLimits;
use crate::sampler::SamplingParams;

/// SGLang's `sampling_params` object (fields not listed are refused by name).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingBody {
    /// Softmax temperature (default 1; 0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass in (0, 1] (default 1 = off).
    pub top_p: Option<f32>,
    /// Top-k cut; -1 or 0 = off (SGLang uses -1).
    pub top_k: Option<i64>,
    /// Tokens to generate at most (default: the server's `default_max_new_tokens`).
    pub max_new_tokens: Option<usize>,
    /// Generation stops after one of these ids (it is part of the output).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Do not stop at the model's `eos_token_id`.
    pub ignore_eos: Option<bool>,
    /// Seed of this request's sampler (default: derived from the server seed).
    pub seed: Option<u64>,
    /// SGLang's name for `seed`.
    pub sampling_seed: Option<u64>,
    /// Accepted for compatibility; only `true` (the default) is supported.
    pub skip_special_tokens: Option<bool>,
}

impl SamplingBody {
    /// Checks every field against the limits and the model; `eos` joins the stop ids unless
    /// `ignore_eos`. Errors name the field.
    pub fn to_params(
        &self,
        limits: &ServerLimits,
        vocab_size: usize,
        eos: &[u32],
        default_seed: u64,
    ) -> Result<SamplingParams, ApiError> {
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(ApiError::bad_request(format!(
                "temperature must be a finite number >= 0, got {temperature}"
            )));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad_request(format!(
                "top_p must be in (0, 1], got {top_p}"
            )));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k)
                .map_err(|_| ApiError::bad_request(format!("top_k {k} is too large")))?,
            Some(k) => {
                return Err(ApiError::bad_request(format!(
                    "top_k must be -1 (off) or a positive count, got {k}"
                )))
            }
        };
        let max_new_tokens = self.max_new_tokens.unwrap_or(limits.default_max_new_tokens);
        if max_new_tokens == 0 {
            return Err(ApiError::bad_request("max_new_tokens must be at least 1"));
        }
        if max_new_tokens > limits.max_new_tokens {
            return Err(ApiError::bad_request(format!(
                "max_new_tokens {max_new_tokens} exceeds the server limit {}",
                limits.max_new_tokens
            )));
        }
        let mut stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if let Some(t) = stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ApiError::bad_request(format!(
                "stop_token_ids contains {t}, which is not below the vocabulary size {vocab_size}"
            )));
        }
        if !self.ignore_eos.unwrap_or(false) {
            for &e in eos {
                if !stop_token_ids.contains(&e) {
                    stop_token_ids.push(e);
                }
            }
        }
        if self.skip_special_tokens == Some(false) {
            return Err(ApiError::bad_request(
                "skip_special_tokens=false is not supported (special tokens are always skipped in text)",
            ));
        }
        let seed = match (self.seed, self.sampling_seed) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::bad_request(format!(
                    "seed {a} and sampling_seed {b} disagree; give one"
                )))
            }
            (Some(s), _) | (None, Some(s)) => s,
            (None, None) => default_seed,
        };
        Ok(SamplingParams {
            temperature,
            top_p,
            top_k,
            max_new_tokens,
            stop_token_ids,
            seed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ServerLimits {
        ServerLimits {
            max_new_tokens: 100,
            default_max_new_tokens: 16,
            ..ServerLimits::default()
        }
    }

    #[test]
    fn defaults_and_eos() {
        let p = SamplingBody::default()
            .to_params(&limits(), 10, &[2], 7)
            .expect("valid");
        assert_eq!((p.temperature, p.top_p, p.top_k), (1.0, 1.0, 0));
        assert_eq!((p.max_new_tokens, p.seed), (16, 7));
        assert_eq!(p.stop_token_ids, vec![2]);
        let body = SamplingBody {
            ignore_eos: Some(true),
            top_k: Some(-1),
            ..Default::default()
        };
        let p = body.to_params(&limits(), 10, &[2], 7).expect("valid");
        assert!(p.stop_token_ids.is_empty());
        assert_eq!(p.top_k, 0);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (
                SamplingBody {
                    temperature: Some(-1.0),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingBody {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingBody {
                    top_k: Some(-3),
                    ..Default::default()
                },
                "top_k",
            ),
            (
                SamplingBody {
                    max_new_tokens: Some(0),
                    ..Default::default()
                },
                "max_new_tokens",
            ),
            (
                SamplingBody {
                    max_new_tokens: Some(101),
                    ..Default::default()
                },
                "server limit",
            ),
            (
                SamplingBody {
                    stop_token_ids: Some(vec![10]),
                    ..Default::default()
                },
                "stop_token_ids",
            ),
            (
                SamplingBody {
                    seed: Some(1),
                    sampling_seed: Some(2),
                    ..Default::default()
                },
                "disagree",
            ),
        ];
        for (body, needle) in cases {
            let err = body.to_params(&limits(), 10, &[], 0).expect_err("invalid");
            assert!(err.status.is_client_error());
            assert!(
                err.message.contains(needle),
                "{needle:?} not in {:?}",
                err.message
            );
        }
    }
}
