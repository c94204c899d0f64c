//! What OpenAI's `/v1/completions` and `/v1/chat/completions` handlers share once a body is
//! read: the engine jobs of a request's samples, the answer's `created` time and finish
//! reasons, and the answer itself, streamed as server-sent events or built in one piece once
//! every job has finished. One place, so the two endpoints sample and answer alike.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::{IntoResponse, Response};
use axum::Json;
use r3_rollout::request::{FinishReason, GenerateRequest};
use r3_routing::wire::WireDtype;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::generate::{encode_routes, rids};
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

    /// Adds one sample of `input_ids` per entry of `rids` (sample `i` seeded as
    /// [`AppState::prepare`] says; a None rid gets a server one), each as `opts` asks.
    pub fn push_samples(
        &mut self,
        state: &AppState,
        sampling: &SamplingBody,
        input_ids: &[u32],
        rids: &[Option<String>],
        opts: &SampleOptions,
    ) -> Result<(), ApiError> {
        for (i, rid) in rids.iter().enumerate() {
            let (mut params, text, stop) = state.prepare(sampling, input_ids.len(), i)?;
            params.top_logprobs = opts.top_n.unwrap_or(0);
            if opts.prompt_logprobs {
                params.prompt_logprobs_from = Some(0);
            }
            self.texts.push(text);
            self.jobs.push(Job {
                rid: rid.clone().unwrap_or_else(|| state.next_rid()),
                request: GenerateRequest {
                    input_ids: input_ids.to_vec(),
                    sampling: params,
                    return_routes: opts.routes_from.is_some(),
                    routed_experts_start_len: opts.routes_from.unwrap_or(0),
                },
                stop,
            });
        }
        Ok(())
    }
}

/// What every sample of an OpenAI request reports besides its tokens (built by
/// [`super::openai_sampling::OpenAiRoutes::sample_options`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleOptions {
    /// Alternatives per token when log-probs are asked for.
    pub top_n: Option<usize>,
    /// The prompt's log-probs from its first token (`echo` with `logprobs`).
    pub prompt_logprobs: bool,
    /// Routes from this prompt position (`return_routed_experts`).
    pub routes_from: Option<usize>,
}

/// The client rids of `prompts` prompts × `n` choices, in choice order (SGLang's `rid`: one
/// string, or one per prompt), as `/generate` expands them.
pub fn choice_rids(
    rid: Option<&Value>,
    prompts: usize,
    n: usize,
) -> Result<Vec<Vec<Option<String>>>, ApiError> {
    let flat = rids(rid, prompts, n, prompts > 1 || n > 1)?;
    Ok(flat.chunks(n.max(1)).map(<[_]>::to_vec).collect())
}

/// OpenAI's `stream_options` (SGLang's `StreamOptions`).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct StreamOptions {
    /// A last chunk with no choices and the answer's `usage`, before `[DONE]`.
    pub include_usage: Option<bool>,
    /// `usage` (so far, of the chunk's choice) on every content chunk.
    pub continuous_usage_stats: Option<bool>,
}

impl StreamOptions {
    /// Whether the final usage chunk is asked for.
    pub fn include_usage(&self) -> bool {
        self.include_usage.unwrap_or(false)
    }

    /// Whether every content chunk carries its choice's usage so far.
    pub fn continuous(&self) -> bool {
        self.continuous_usage_stats.unwrap_or(false)
    }
}

/// `matched_stop` of an OpenAI choice, as SGLang fills it from its finish reason: the stop
/// id or the stop string that ended it, else null.
pub fn matched_stop(f: &Finished) -> Value {
    match f.result.finish {
        FinishReason::Stop { token } => json!(token),
        FinishReason::StopString => json!(f.matched_stop),
        _ => Value::Null,
    }
}

/// SGLang's response-level `sglext` with `routed_experts` (base64 int32, of the first choice,
/// as SGLang takes it from its first result), when routes were asked for.
pub fn routes_ext(state: &AppState, results: &[Finished]) -> Result<Option<Value>, ApiError> {
    let Some(first) = results.first() else {
        return Ok(None);
    };
    let Some(table) = first.result.routes.as_ref() else {
        return Ok(None);
    };
    let b64 = encode_routes(state, table, WireDtype::I32)?;
    Ok(Some(json!({"routed_experts": b64})))
}

/// The chunks that close a streamed OpenAI answer after its choices' last chunks, as SGLang
/// sends them: `sglext` (routes) with no choices, then with `include_usage` the `usage`
/// with no choices.
pub fn closing_chunks(
    state: &AppState,
    head: &AnswerHead,
    object: &str,
    results: &[Finished],
    routes: bool,
    usage_now: Option<Value>,
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if routes {
        if let Some(ext) = routes_ext(state, results)? {
            let mut chunk = head.object(object, json!([]));
            chunk["sglext"] = ext;
            out.push(chunk);
        }
    }
    if let Some(u) = usage_now {
        let mut chunk = head.object(object, json!([]));
        chunk["usage"] = u;
        out.push(chunk);
    }
    Ok(out)
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
