//! What OpenAI's `/v1/completions` and `/v1/chat/completions` handlers share once a body is
//! read: the engine jobs of a request's samples, the answer's `created` time and finish
//! reasons, and the answer itself, streamed as server-sent events or built in one piece once
//! every job has finished. One place, so the two endpoints sample and answer alike.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::{IntoResponse, Response};
use axum::Json;
use r3_rollout::request::{FinishReason, GenerateRequest};
use serde_json::{json, Value};

use super::error::ApiError;
use super::sampling::SamplingBody;
use super::sse::{stream_jobs, ChunkBuilder};
use super::stop::TextOptions;
use super::stream_text::StreamedText;
use super::worker::{Finished, Job};
use super::AppState;

/// The engine jobs of one request and the text options of each, in choice order.
#[derive(Default)]
pub struct SampleJobs {
    /// One job per choice.
    pub jobs: Vec<Job>,
    /// The text options of each job (stop strings, special tokens).
    pub texts: Vec<TextOptions>,
}

impl SampleJobs {
    /// Room for `n` choices.
    pub fn with_capacity(n: usize) -> Self {
        SampleJobs {
            jobs: Vec::with_capacity(n),
            texts: Vec::with_capacity(n),
        }
    }

    /// Adds `n` samples of `input_ids` (sample `i` seeded as [`AppState::prepare`] says),
    /// each reporting `top_n` alternatives per token when log-probs are asked for and, with
    /// `prompt_logprobs`, the prompt's log-probs from its first token.
    pub fn push_samples(
        &mut self,
        state: &AppState,
        sampling: &SamplingBody,
        input_ids: &[u32],
        n: usize,
        top_n: Option<usize>,
        prompt_logprobs: bool,
    ) -> Result<(), ApiError> {
        for i in 0..n {
            let (mut params, text, stop) = state.prepare(sampling, input_ids.len(), i)?;
            params.top_logprobs = top_n.unwrap_or(0);
            if prompt_logprobs {
                params.prompt_logprobs_from = Some(0);
            }
            self.texts.push(text);
            self.jobs.push(Job {
                rid: state.next_rid(),
                request: GenerateRequest {
                    input_ids: input_ids.to_vec(),
                    sampling: params,
                    return_routes: false,
                    routed_experts_start_len: 0,
                },
                stop,
            });
        }
        Ok(())
    }
}

/// What every object of one answer carries: its id, creation time and model name.
pub struct AnswerHead {
    /// `<prefix>-<server rid>`.
    pub id: String,
    /// Seconds since the Unix epoch when the answer was begun.
    pub created: u64,
    /// The served model's name.
    pub model: String,
}

impl AnswerHead {
    /// A fresh head whose id starts with `prefix` (`cmpl`, `chatcmpl`).
    pub fn new(state: &AppState, prefix: &str) -> Self {
        AnswerHead {
            id: format!("{prefix}-{}", state.next_rid()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: state.config().served_model_name.clone(),
        }
    }

    /// An answer object of kind `object` (`text_completion`, `chat.completion.chunk`, …)
    /// holding `choices`.
    pub fn object(&self, object: &str, choices: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created,
               "model": self.model, "choices": choices})
    }
}

/// An answer under way: what it is built from (`reply`, one type per endpoint) and the text
/// its streamed chunks have carried so far. Each endpoint's [`ChunkBuilder`] is
/// `AnswerStream<its reply>`.
pub struct AnswerStream<R> {
    /// The server, for the tokenizer.
    pub state: AppState,
    /// What the answer is built from besides the engine's results.
    pub reply: R,
    /// The text sent so far per choice.
    pub text: StreamedText,
}

impl<R> AnswerStream<R> {
    /// The answer of `choices` choices built from `reply`, nothing sent yet.
    pub fn new(state: &AppState, choices: usize, reply: R) -> Self {
        AnswerStream {
            state: state.clone(),
            reply,
            text: StreamedText::new(choices),
        }
    }
}

/// OpenAI's `usage` of an answer.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Generated tokens of all `results`.
pub fn completion_tokens(results: &[Finished]) -> usize {
    results.iter().map(|f| f.result.output_ids.len()).sum()
}

/// OpenAI's `finish_reason` of a finished choice.
pub fn finish_reason(finish: &FinishReason) -> &'static str {
    match finish {
        FinishReason::Length => "length",
        FinishReason::Stop { .. } | FinishReason::StopString => "stop",
        FinishReason::Abort => "abort",
    }
}

/// Runs `jobs` and answers: with `stream`, as server-sent events built by `chunks`;
/// otherwise as the JSON object `answer` builds from `chunks` (which holds what the reply
/// is made of) and the finished jobs.
pub async fn respond<C: ChunkBuilder>(
    state: &AppState,
    jobs: Vec<Job>,
    stream: bool,
    chunks: C,
    answer: impl FnOnce(C, Vec<Finished>) -> Result<Value, ApiError>,
) -> Result<Response, ApiError> {
    if stream {
        return stream_jobs(state.handle(), jobs, chunks).await;
    }
    let results = state.handle().generate(jobs).await?;
    Ok(Json(answer(chunks, results)?).into_response())
}
