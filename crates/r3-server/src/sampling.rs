//! Sampling parameters as clients send them (SGLang `sampling_params`, OpenAI fields) and
//! their checked conversion to the engine's [`SamplingParams`] plus the server-side text
//! options (stop strings, trimming, special tokens), with the server's limits.
//!
//! `max_new_tokens` rule: the engine generates at most
//! `min(max_new_tokens, server --max-new-tokens, max_position_embeddings - prompt tokens)`
//! tokens; a request that asks for more is clipped, not refused, and ends with
//! `finish_reason: length` when it reaches the clipped budget.

use std::collections::BTreeMap;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::stop::TextOptions;
use super::ServerLimits;
use r3_rollout::sampler::{LogprobScale, SamplingParams, GREEDY_TEMPERATURE};

/// SGLang's `sampling_params` object, implemented fields only (the rest is screened by
/// [`super::policy::SAMPLING`]).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingBody {
    /// Softmax temperature (default 1; 0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass in (0, 1] (default 1 = off).
    pub top_p: Option<f32>,
    /// Top-k cut; -1 = off (0 is refused, as SGLang refuses it).
    pub top_k: Option<i64>,
    /// Drop tokens below `min_p` × the top probability (default 0 = off).
    pub min_p: Option<f32>,
    /// Tokens to generate at most (default: the server's `default_max_new_tokens`).
    pub max_new_tokens: Option<usize>,
    /// No `max_new_tokens` cap of the client's own: an explicit `"max_new_tokens": null` on
    /// `/generate`, a chat request without `max_tokens` (SGLang's scheduler then allows the
    /// rest of the context). The server's `--max-new-tokens` still bounds it.
    #[serde(skip)]
    pub rest_of_context: bool,
    /// Stop ids cannot be sampled before this many tokens.
    pub min_new_tokens: Option<usize>,
    /// Generation stops after one of these ids (it is part of the output).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Generation stops once the output text contains one of these strings.
    pub stop: Option<Value>,
    /// Keep the matched stop string (or stop token) in the returned text.
    pub no_stop_trim: Option<bool>,
    /// No stop id ends the request, the model's eos ids and the request's own
    /// `stop_token_ids` alike (SGLang's `ignore_eos`); `min_new_tokens` still masks them and
    /// stop strings still apply.
    pub ignore_eos: Option<bool>,
    /// `l -= frequency_penalty × count in output` (in [-2, 2]).
    pub frequency_penalty: Option<f32>,
    /// `l -= presence_penalty` for tokens in the output (in [-2, 2]).
    pub presence_penalty: Option<f32>,
    /// Divides positive / multiplies negative logits of seen tokens (in (0, 2], 1 = off).
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, OpenAI style) -> bias added to its logit.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Samples per prompt (default 1).
    pub n: Option<usize>,
    /// Seed of this request's sampler (default: derived from the server seed); a negative
    /// one is taken as SGLang takes it ([`deserialize_seed`]).
    #[serde(default, deserialize_with = "deserialize_seed")]
    pub seed: Option<u64>,
    /// SGLang's name for `seed`.
    #[serde(default, deserialize_with = "deserialize_seed")]
    pub sampling_seed: Option<u64>,
    /// Skip special tokens when decoding text (default true).
    pub skip_special_tokens: Option<bool>,
}

/// What a conversion needs to know besides the body.
#[derive(Debug, Clone, Copy)]
pub struct ParamContext<'a> {
    /// The server's limits.
    pub limits: &'a ServerLimits,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// The model's context.
    pub max_position_embeddings: usize,
    /// The model's stop ids (its eos ids, [`super::generation::model_stop_ids`]), added to
    /// the request's own (under `ignore_eos` they end nothing but are still masked until
    /// `min_new_tokens`).
    pub eos: &'a [u32],
    /// Prompt length (the context left bounds `max_new_tokens`).
    pub prompt_len: usize,
    /// Seed used when the body gives none.
    pub default_seed: u64,
}

impl SamplingBody {
    /// Samples per prompt asked for (`n`, default 1; 0 is refused).
    pub fn samples(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(0) => Err(ApiError::bad_request("n must be at least 1")),
            Some(n) => Ok(n),
        }
    }

    /// SGLang's `verify`: `min_new_tokens` may not exceed the client's own `max_new_tokens`
    /// (a 400; the server's clipping of `max_new_tokens` clips `min_new_tokens` with it).
    pub fn check_min_new_tokens(&self) -> Result<(), ApiError> {
        match (self.min_new_tokens, self.max_new_tokens) {
            (Some(min), Some(max)) if min > max => Err(ApiError::bad_request(format!(
                "min_new_tokens must be in [0, max_new_tokens({max})], got {min}"
            ))),
            _ => Ok(()),
        }
    }

    /// Whether a seed was given.
    pub fn has_seed(&self) -> bool {
        self.seed.is_some() || self.sampling_seed.is_some()
    }

    /// Checks every field against the limits and the model; errors name the field.
    pub fn to_params(
        &self,
        ctx: &ParamContext<'_>,
    ) -> Result<(SamplingParams, TextOptions), ApiError> {
        let temperature = self.temperature.unwrap_or(1.0);
        let top_p = self.top_p.unwrap_or(1.0);
        // SGLang's `__post_init__` makes a temperature in [0, 1e-6) greedy (top_k = 1) before
        // `verify` looks at top_k, so such a request's top_k is never checked: an
        // out-of-range one is no cut here (the pick is the argmax either way).
        let greedy = (0.0..GREEDY_TEMPERATURE).contains(&temperature);
        // SGLang's `verify`: -1 or a count; 0 is refused rather than read as "off".
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(_) if greedy => 0,
            Some(k) => {
                return Err(ApiError::bad_request(format!(
                    "top_k must be -1 (disable) or at least 1, got {k}"
                )))
            }
        };
        self.check_min_new_tokens()?;
        let requested = match (self.max_new_tokens, self.rest_of_context) {
            (Some(n), _) => n,
            (None, true) => usize::MAX,
            (None, false) => ctx.limits.default_max_new_tokens,
        };
        if requested == 0 {
            return Err(ApiError::bad_request(
                "max_new_tokens must be at least 1 (r3 does not return prompt-only results)",
            ));
        }
        let room = ctx
            .max_position_embeddings
            .saturating_sub(ctx.prompt_len)
            .max(1);
        let max_new_tokens = requested.min(ctx.limits.max_new_tokens).min(room);
        let min_new_tokens = self.min_new_tokens.unwrap_or(0).min(max_new_tokens);
        let mut stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if let Some(t) = stop_token_ids
            .iter()
            .find(|&&t| t as usize >= ctx.vocab_size)
        {
            return Err(ApiError::bad_request(format!(
                "stop_token_ids contains {t}, which is not below the vocabulary size {}",
                ctx.vocab_size
            )));
        }
        // The model's stop ids join the request's own whatever `ignore_eos` says: SGLang's
        // min-new-tokens penalizer masks the eos ids under it too
        // (sampling/penaltylib/min_new_tokens.py), and its token-based finish check returns
        // before it looks at any stop id (`Req._check_token_based_finish`), which the engine
        // does with `SamplingParams::ignore_eos`.
        for &e in ctx.eos {
            if !stop_token_ids.contains(&e) {
                stop_token_ids.push(e);
            }
        }
        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let t = key
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < ctx.vocab_size)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "logit_bias key {key:?} is not a token id below the vocabulary size {}",
                        ctx.vocab_size
                    ))
                })?;
            if bias != 0.0 {
                logit_bias.push((t, bias));
            }
        }
        let seed = match (self.seed, self.sampling_seed) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::bad_request(format!(
                    "seed {a} and sampling_seed {b} disagree; give one"
                )))
            }
            (Some(s), _) | (None, Some(s)) => s,
            (None, None) => ctx.default_seed,
        };
        let params = SamplingParams {
            temperature,
            top_p,
            top_k,
            max_new_tokens,
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            seed,
            min_p: self.min_p.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            min_new_tokens,
            logit_bias,
            top_logprobs: 0,
            prompt_logprobs_from: None,
            // SGLang's default; `ServerConfig::return_original_logprob` makes it Raw.
            logprob_scale: LogprobScale::Sampling,
        };
        params
            .validate()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let text = TextOptions {
            stop: stop_strings(self.stop.as_ref())?,
            no_stop_trim: self.no_stop_trim.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
        };
        Ok((params, text))
    }
}

/// A seed as SGLang takes `sampling_seed` (and OpenAI's `seed`): an integer in
/// `[-2^63, 2^63)`, a negative one reinterpreted as its 64-bit two's complement (SGLang's
/// `seed.to(torch.uint64)` before hashing), so distinct seeds stay distinct. r3's own seeds up
/// to `2^64 - 1` (what r3's fleet sends) are taken too. Null is no seed.
pub fn deserialize_seed<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct SeedVisitor;
    impl<'de> Visitor<'de> for SeedVisitor {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an integer seed in [-2^63, 2^64) or null")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            // Two's complement, as torch's int64 -> uint64 conversion.
            Ok(Some(v as u64))
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_any(SeedVisitor)
        }
    }
    d.deserialize_option(SeedVisitor)
}

/// `stop`: null, one string or a list of strings (empty strings dropped).
fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::bad_request(format!("stop[{i}] must be a string, got {s}"))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "stop must be a string or a list of strings, got {other}"
            )))
        }
    };
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> ServerLimits {
        ServerLimits {
            max_new_tokens: 100,
            default_max_new_tokens: 16,
            ..ServerLimits::default()
        }
    }

    fn convert(body: &SamplingBody, prompt_len: usize) -> Result<SamplingParams, ApiError> {
        let l = limits();
        let ctx = ParamContext {
            limits: &l,
            vocab_size: 10,
            max_position_embeddings: 64,
            eos: &[2],
            prompt_len,
            default_seed: 7,
        };
        body.to_params(&ctx).map(|p| p.0)
    }

    #[test]
    fn defaults_and_eos() {
        let p = convert(&SamplingBody::default(), 4).expect("valid");
        assert_eq!((p.temperature, p.top_p, p.top_k), (1.0, 1.0, 0));
        assert_eq!((p.max_new_tokens, p.seed), (16, 7));
        assert_eq!(p.stop_token_ids, vec![2]);
        let body = SamplingBody {
            ignore_eos: Some(true),
            top_k: Some(-1),
            ..Default::default()
        };
        let p = convert(&body, 4).expect("valid");
        // Under `ignore_eos` the eos still joins the stop ids (min_new_tokens masks it) and
        // the engine lets none of them end the request.
        assert_eq!(p.stop_token_ids, vec![2]);
        assert!(p.ignore_eos);
        assert_eq!(p.top_k, 0);
    }

    #[test]
    fn max_new_tokens_is_clipped_to_the_limit_and_the_context() {
        let ask = |n: usize, prompt: usize| {
            let body = SamplingBody {
                max_new_tokens: Some(n),
                min_new_tokens: Some(n),
                ..Default::default()
            };
            let p = convert(&body, prompt).expect("clipped, not refused");
            (p.max_new_tokens, p.min_new_tokens)
        };
        assert_eq!(ask(10, 4), (10, 10));
        // AReaL's default 16384 with a 4-token prompt: the 64-token context leaves 60.
        assert_eq!(ask(16384, 4), (60, 60));
        let l = ServerLimits {
            max_new_tokens: 8,
            ..limits()
        };
        let ctx = ParamContext {
            limits: &l,
            vocab_size: 10,
            max_position_embeddings: 64,
            eos: &[],
            prompt_len: 4,
            default_seed: 0,
        };
        let body = SamplingBody {
            max_new_tokens: Some(50),
            ..Default::default()
        };
        // The server limit (8) binds before the context (60) does.
        assert_eq!(body.to_params(&ctx).expect("clipped").0.max_new_tokens, 8);
    }

    #[test]
    fn sampling_fields_reach_the_engine() {
        let body: SamplingBody = serde_json::from_value(json!({
            "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": -0.5,
            "repetition_penalty": 1.2, "logit_bias": {"3": 1.5, "4": 0.0},
            "stop": ["a", ""], "no_stop_trim": true, "skip_special_tokens": false,
        }))
        .expect("body");
        let l = limits();
        let ctx = ParamContext {
            limits: &l,
            vocab_size: 10,
            max_position_embeddings: 64,
            eos: &[],
            prompt_len: 1,
            default_seed: 0,
        };
        let (p, text) = body.to_params(&ctx).expect("valid");
        assert_eq!(
            (p.min_p, p.frequency_penalty, p.presence_penalty),
            (0.1, 0.5, -0.5)
        );
        assert_eq!(p.repetition_penalty, 1.2);
        assert_eq!(p.logit_bias, vec![(3, 1.5)]);
        assert_eq!(text.stop, vec!["a".to_string()]);
        assert!(text.no_stop_trim && !text.skip_special_tokens);
    }

    /// A negative seed is SGLang's: its 64-bit two's complement (torch's int64 -> uint64),
    /// so -1 samples as `u64::MAX` does; r3's own seeds past `i64::MAX` still parse.
    #[test]
    fn negative_seeds_are_their_twos_complement() {
        let seed = |v: Value| {
            let body: SamplingBody = serde_json::from_value(v).expect("body");
            convert(&body, 1).expect("valid").seed
        };
        assert_eq!(seed(json!({"sampling_seed": -1})), u64::MAX);
        assert_eq!(seed(json!({"seed": i64::MIN})), 1 << 63);
        assert_eq!(seed(json!({"seed": u64::MAX})), u64::MAX);
        assert_eq!(seed(json!({"seed": null})), 7);
        let body: OpenAiBody = serde_json::from_value(json!({"seed": -2})).expect("body");
        assert_eq!(body.sampling.seed, Some(u64::MAX - 1));
    }

    /// An OpenAI body holding the shared sampling fields.
    #[derive(Deserialize)]
    struct OpenAiBody {
        #[serde(flatten)]
        sampling: crate::openai_sampling::OpenAiSampling,
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (json!({"temperature": -1.0}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"top_k": -3}), "top_k"),
            (
                json!({"top_k": 0}),
                "top_k must be -1 (disable) or at least 1, got 0",
            ),
            (
                json!({"max_new_tokens": 4, "min_new_tokens": 5}),
                "min_new_tokens must be in [0, max_new_tokens(4)], got 5",
            ),
            (json!({"max_new_tokens": 0}), "max_new_tokens"),
            (json!({"stop_token_ids": [10]}), "stop_token_ids"),
            (json!({"seed": 1, "sampling_seed": 2}), "disagree"),
            (json!({"min_p": 2.0}), "min_p"),
            (json!({"frequency_penalty": 3.0}), "frequency_penalty"),
            (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
            (json!({"logit_bias": {"x": 1.0}}), "logit_bias"),
            (json!({"stop": [1]}), "stop[0]"),
        ];
        for (body, needle) in cases {
            let body: SamplingBody = serde_json::from_value(body).expect("body");
            let err = convert(&body, 1).expect_err("invalid");
            assert!(err.status.is_client_error());
            assert!(
                err.message.contains(needle),
                "{needle:?} not in {:?}",
                err.message
            );
        }
    }
}
