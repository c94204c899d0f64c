//! OpenAI `/v1/chat/completions`: `messages` rendered through the model's chat template
//! (`add_generation_prompt`, default true, and `chat_template_kwargs` such as
//! `enable_thinking`), tokenized without added special tokens, then sampled like
//! `/v1/completions`; the model's stop ids (eos and `generation_config.json`'s) end a turn.
//! `logprobs: true` (with `top_logprobs` up to [`MAX_TOP_LOGPROBS`] alternatives) answers
//! OpenAI's `choices[].logprobs.content[]`, one entry per generated token. `stream: true`
//! answers token by token: a `chat.completion.chunk` with the role per choice, then the new
//! content as it is produced, and a last chunk per choice with the rest of its content, its
//! finish reason and its log-probs; then `[DONE]`. The content of a choice's chunks
//! concatenates to the non-streamed content.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use r3_text::{ChatMessage, RenderOptions};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::completions::token_text;
use super::error::ApiError;
use super::fields::parse_body;
use super::generate::MAX_TOP_LOGPROBS;
use super::openai::{
    completion_tokens, finish_reason, respond, usage, AnswerHead, AnswerStream, SampleJobs,
};
use super::openai_sampling::OpenAiSampling;
use super::policy::FieldRule::{Ignored, Implemented, NeutralOnly};
use super::policy::Schema;
use super::sse::ChunkBuilder;
use super::stop::{response_text, TextOptions};
use super::stream_text::stop_hold;
use super::worker::Finished;
use super::{read_body, AppState};
use r3_rollout::request::{FinishReason, GenerateResult};
use r3_text::json_kind;

/// OpenAI's chat completions request plus the SGLang / vLLM extensions r3 implements.
pub static CHAT: Schema = Schema {
    name: "chat/completions",
    fields: &[
        ("model", Ignored),
        ("messages", Implemented),
        ("add_generation_prompt", Implemented),
        ("chat_template_kwargs", Implemented),
        ("max_tokens", Implemented),
        ("max_completion_tokens", Implemented),
        ("temperature", Implemented),
        ("top_p", Implemented),
        ("top_k", Implemented),
        ("min_p", Implemented),
        ("min_tokens", Implemented),
        ("n", Implemented),
        ("seed", Implemented),
        ("stop", Implemented),
        ("stop_token_ids", Implemented),
        ("no_stop_trim", Implemented),
        ("ignore_eos", Implemented),
        ("skip_special_tokens", Implemented),
        ("frequency_penalty", Implemented),
        ("presence_penalty", Implemented),
        ("repetition_penalty", Implemented),
        ("logit_bias", Implemented),
        ("stream", Implemented),
        ("stream_options", Ignored),
        ("user", Ignored),
        ("rid", Ignored),
        ("separate_reasoning", Ignored),
        ("logprobs", Implemented),
        ("top_logprobs", Implemented),
        ("tools", NeutralOnly(&[])),
        ("tool_choice", NeutralOnly(&["\"none\"", "\"auto\""])),
        ("parallel_tool_calls", Ignored),
        ("response_format", NeutralOnly(&[])),
        ("continue_final_message", NeutralOnly(&[])),
        ("return_routed_experts", NeutralOnly(&[])),
    ],
};

/// The `/v1/chat/completions` body, implemented fields only.
#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<Value>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    n: Option<usize>,
    #[serde(flatten)]
    sampling: OpenAiSampling,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    stream: Option<bool>,
}

/// One OpenAI message as a template message: `content` a string, a list of text parts
/// (joined), or null / absent (`none` to the template, as transformers passes it); other
/// fields are passed to the template as they are.
pub fn chat_message(v: &Value, i: usize) -> Result<ChatMessage, ApiError> {
    let field = |name: &str| format!("messages[{i}].{name}");
    let Value::Object(obj) = v else {
        return Err(ApiError::bad_request(format!(
            "messages[{i}] must be an object, got {}",
            json_kind(v)
        )));
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) => r.clone(),
        _ => {
            return Err(ApiError::bad_request(format!(
                "{} must be a string",
                field("role")
            )))
        }
    };
    let content = match obj.get("content") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "{}[{j}]: r3 accepts only {{\"type\": \"text\", \"text\": ...}} parts",
                            field("content")
                        )))
                    }
                }
            }
            Some(text)
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "{} must be a string or a list of text parts, got {}",
                field("content"),
                json_kind(other)
            )))
        }
    };
    let extra = obj
        .iter()
        .filter(|(k, _)| k.as_str() != "role" && k.as_str() != "content")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(ChatMessage {
        role,
        content,
        extra,
    })
}

/// `POST /v1/chat/completions`.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: ChatBody = CHAT.parse(parse_body::<Value>(&bytes)?)?;
    let codec = state.text().ok_or_else(|| {
        ApiError::bad_request(
            "chat messages need a tokenizer.json and a chat template in the model directory; send token ids to /generate",
        )
    })?;
    if body.messages.is_empty() {
        return Err(ApiError::bad_request("messages is empty"));
    }
    let messages = body
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(m, i))
        .collect::<Result<Vec<_>, _>>()?;
    let opts = RenderOptions {
        add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
        kwargs: body.chat_template_kwargs.clone().unwrap_or_default(),
        ..RenderOptions::default()
    };
    let prompt = codec.render_chat(&messages, &opts)?;
    let input_ids = codec.encode(&prompt)?;
    state.check_prompt(&input_ids, "rendered messages")?;
    let n = body.n.unwrap_or(1);
    if n == 0 {
        return Err(ApiError::bad_request("n must be at least 1"));
    }
    state.check_batch_size(n)?;
    // A chat turn ends at the model's stop ids (e.g. `<|im_end|>`), beside the client's own,
    // unless `ignore_eos` asks to generate past them (as SGLang's `ignore_eos` does).
    let mut stop_ids = body.sampling.stop_token_ids.clone().unwrap_or_default();
    if !body.sampling.ignore_eos.unwrap_or(false) {
        stop_ids.extend(codec.tokenizer().stop_token_ids().iter().copied());
    }
    let max_new_tokens = body
        .max_completion_tokens
        .or(body.max_tokens)
        .unwrap_or(state.limits().default_max_new_tokens);
    let sampling = body
        .sampling
        .to_native(max_new_tokens, Some(stop_ids), || state.next_seed());
    let top_n = logprobs_asked(body.logprobs, body.top_logprobs)?;
    let mut samples = SampleJobs::with_capacity(n);
    samples.push_samples(&state, &sampling, &input_ids, n, top_n, false)?;
    let reply = ChatReply {
        head: AnswerHead::new(&state, "chatcmpl"),
        top_n,
        texts: samples.texts,
    };
    let chunks = AnswerStream::new(&state, reply.texts.len(), reply);
    let stream = body.stream.unwrap_or(false);
    respond(&state, samples.jobs, stream, chunks, |chunks, results| {
        let reply = &chunks.reply;
        let mut choices = Vec::with_capacity(results.len());
        for (index, f) in results.iter().enumerate() {
            let c = reply.choice(&state, index, f)?;
            choices.push(json!({"index": index,
                "message": {"role": "assistant", "content": c.content},
                "finish_reason": c.finish, "token_ids": f.result.output_ids, "logprobs": c.logprobs}));
        }
        let mut answer = reply.head.object("chat.completion", json!(choices));
        answer["usage"] = usage(input_ids.len(), completion_tokens(&results));
        answer["prompt_token_ids"] = json!(input_ids);
        Ok(answer)
    })
    .await
}

/// Alternatives per token asked for by OpenAI's `logprobs` / `top_logprobs` (None: no
/// log-probs); `top_logprobs` needs `logprobs: true`, as OpenAI's API says.
fn logprobs_asked(logprobs: Option<bool>, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (false, None | Some(0)) => Ok(None),
        (false, Some(k)) => Err(ApiError::bad_request(format!(
            "top_logprobs={k} needs logprobs: true"
        ))),
        (true, Some(k)) if k > MAX_TOP_LOGPROBS => Err(ApiError::bad_request(format!(
            "top_logprobs={k}: r3 returns at most {MAX_TOP_LOGPROBS} alternatives per token"
        ))),
        (true, k) => Ok(Some(k.unwrap_or(0))),
    }
}

/// What a chat answer is built from besides the engine's results.
struct ChatReply {
    head: AnswerHead,
    /// Alternatives per token when log-probs were asked for.
    top_n: Option<usize>,
    /// Text options of each choice.
    texts: Vec<TextOptions>,
}

/// The parts of one finished choice.
struct ChatChoice {
    content: String,
    finish: &'static str,
    logprobs: Value,
}

impl ChatReply {
    /// Content, finish reason and log-probs of choice `index`.
    fn choice(&self, state: &AppState, index: usize, f: &Finished) -> Result<ChatChoice, ApiError> {
        let r = &f.result;
        let content = match (state.text(), self.texts.get(index)) {
            (Some(codec), Some(opts)) => response_text(
                codec,
                &r.output_ids,
                &r.finish,
                f.matched_stop.as_deref(),
                opts,
            )?,
            _ => String::new(),
        };
        let finish = finish_reason(&r.finish);
        let logprobs = match self.top_n {
            None => Value::Null,
            Some(k) => json!({"content": logprob_content(state, r, k), "refusal": null}),
        };
        Ok(ChatChoice {
            content,
            finish,
            logprobs,
        })
    }

    /// One streamed chunk holding `choice`.
    fn chunk(&self, choice: Value) -> Value {
        self.head.object("chat.completion.chunk", json!([choice]))
    }
}

/// One token in OpenAI's chat log-prob format.
fn token_entry(state: &AppState, id: u32, logprob: f32) -> Value {
    let token = token_text(state, id);
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
}

/// `logprobs.content`: one entry per generated token, with its `k` best alternatives.
fn logprob_content(state: &AppState, r: &GenerateResult, k: usize) -> Vec<Value> {
    r.output_ids
        .iter()
        .zip(&r.output_logprobs)
        .enumerate()
        .map(|(j, (&id, &lp))| {
            let top: Vec<Value> = r
                .output_top_logprobs
                .get(j)
                .map(|pos| {
                    pos.iter()
                        .take(k)
                        .map(|&(t, l)| token_entry(state, t, l))
                        .collect()
                })
                .unwrap_or_default();
            let mut e = token_entry(state, id, lp);
            e["top_logprobs"] = Value::Array(top);
            e
        })
        .collect()
}

/// The chunks of a streamed chat answer (OpenAI's format): the role first, then the
/// content as it becomes final, then per choice the rest with its finish reason and
/// log-probs.
type ChatChunks = AnswerStream<ChatReply>;

impl ChunkBuilder for ChatChunks {
    fn opening(&mut self) -> Vec<Value> {
        (0..self.reply.texts.len())
            .map(|index| {
                self.reply.chunk(json!({"index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null}))
            })
            .collect()
    }

    fn delta(&mut self, index: usize, tokens: &[u32]) -> Vec<Value> {
        let Some(opts) = self.reply.texts.get(index) else {
            return Vec::new();
        };
        let (hold, state) = (stop_hold(opts), &self.state);
        let render =
            |ids: &[u32]| response_text(state.text()?, ids, &FinishReason::Length, None, opts).ok();
        let Some(new) = self.text.advance(index, tokens, hold, render) else {
            return Vec::new();
        };
        vec![self
            .reply
            .chunk(json!({"index": index, "delta": {"content": new},
            "logprobs": null, "finish_reason": null}))]
    }

    fn finish(&mut self, results: &[Finished]) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::with_capacity(results.len());
        for (index, f) in results.iter().enumerate() {
            let c = self.reply.choice(&self.state, index, f)?;
            let rest = self.text.rest(index, &c.content);
            out.push(
                self.reply
                    .chunk(json!({"index": index, "delta": {"content": rest},
                "logprobs": c.logprobs, "finish_reason": c.finish})),
            );
        }
        Ok(out)
    }
}
