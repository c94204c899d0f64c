//! Stop strings and the text a response carries: matching the output text against a
//! request's stop strings after every engine step (as HF `generate`'s stop-string criterion
//! and SGLang do: generation ends at the first token whose text completes a stop string), and
//! trimming the matched stop string or stop token from the returned text (SGLang's
//! detokenizer `trim_matched_stop`).

use std::sync::Arc;

use super::error::ApiError;
use super::text::TextCodec;
use r3_rollout::request::FinishReason;

/// Per-request text options (SGLang `stop`, `no_stop_trim`, `skip_special_tokens`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextOptions {
    /// Stop strings (non-empty).
    pub stop: Vec<String>,
    /// Keep the matched stop string / stop token in the text.
    pub no_stop_trim: bool,
    /// Skip special tokens when decoding.
    pub skip_special_tokens: bool,
}

impl Default for TextOptions {
    fn default() -> Self {
        TextOptions {
            stop: Vec::new(),
            no_stop_trim: false,
            skip_special_tokens: true,
        }
    }
}

/// Checks a running request's output against its stop strings, in the output's text with
/// its special tokens kept whatever the request's `skip_special_tokens` (SGLang's
/// `Req.tail_str` decodes so), so a stop string such as `"<|endoftext|>"` matches that token.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    codec: Arc<TextCodec>,
    stop: Vec<String>,
    /// Tokens of output text to decode per check: a stop string completed by the newest token
    /// lies within its byte length in tokens (every token is at least one byte), plus one.
    tail: usize,
}

impl StopMatcher {
    /// A matcher for `opts`, or None when it has no stop strings.
    pub fn new(codec: Arc<TextCodec>, opts: &TextOptions) -> Option<Self> {
        if opts.stop.is_empty() {
            return None;
        }
        let tail = opts.stop.iter().map(String::len).max().unwrap_or(0) + 1;
        Some(StopMatcher {
            codec,
            stop: opts.stop.clone(),
            tail,
        })
    }

    /// The stop string the text of `output` contains near its end, if any.
    pub fn check(&self, output: &[u32]) -> Option<String> {
        let from = output.len().saturating_sub(self.tail);
        let text = self.codec.decode(&output[from..], false).ok()?;
        self.stop
            .iter()
            .find(|s| text.contains(s.as_str()))
            .cloned()
    }
}

/// The response text of `output_ids`: decoded with the request's options, cut before the
/// matched stop string (after it with `no_stop_trim`), or without the final stop token unless
/// `no_stop_trim`; a matched string the text does not hold (a special token skipped) leaves
/// it whole, as SGLang's `trim_matched_stop`.
pub fn response_text(
    codec: &TextCodec,
    output_ids: &[u32],
    finish: &FinishReason,
    matched: Option<&str>,
    opts: &TextOptions,
) -> Result<String, ApiError> {
    let ids = match finish {
        FinishReason::Stop { .. } if !opts.no_stop_trim && !output_ids.is_empty() => {
            &output_ids[..output_ids.len() - 1]
        }
        _ => output_ids,
    };
    let text = codec.decode(ids, opts.skip_special_tokens)?;
    let Some(s) = matched else {
        return Ok(text);
    };
    Ok(match text.find(s) {
        Some(at) if opts.no_stop_trim => text[..at + s.len()].to_string(),
        Some(at) => text[..at].to_string(),
        None => text,
    })
}
