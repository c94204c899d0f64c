//! OpenAI `/v1/chat/completions`: `messages` rendered through the model's chat template
//! (`add_generation_prompt`, default true, and `chat_template_kwargs` such as
//! `enable_thinking`), tokenized without added special tokens, then sampled like
//! `/v1/completions`; the model's stop ids (eos and `generation_config.json`'s) end a turn, and
//! the sampling values a request leaves unset come from `generation_config.json` with
//! `--sampling-defaults model` (SGLang's default; [`super::generation::SamplingDefaults`]).
//! `logprobs: true` (with `top_logprobs` up to [`MAX_TOP_LOGPROBS`] alternatives) answers
//! OpenAI's `choices[].logprobs.content[]`, one entry per generated token. `stream: true`
//! answers token by token: a `chat.completion.chunk` with the role per choice, then the new
//! content as it is produced, and a last chunk per choice with the rest of its content, its
//! finish reason and its log-probs; then `[DONE]`. The content of a choice's chunks
//! concatenates to the non-streamed content.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use r3_text::{ChatMessage, RenderOptions};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::completions::token_text;
use super::error::ApiError;
use super::fields::{parse_body, token_list};
use super::generate::{meta_info, without_output, ResponseSpec, MAX_TOP_LOGPROBS};
use super::openai::{
    choice_rids, closing_chunks, completion_tokens, finish_reason, matched_stop, respond,
    routes_ext, usage, AnswerHead, AnswerStream, SampleJobs, StreamOptions,
};
use super::openai_sampling::{OpenAiRoutes, OpenAiSampling};
use super::policy::FieldRule::{Ignored, Implemented, NeutralOnly};
use super::policy::Schema;
use super::sse::ChunkBuilder;
use super::stop::{response_text, TextOptions};
use super::stream_text::stop_hold;
use super::worker::Finished;
use super::{read_body, AppState};
use r3_rollout::request::GenerateResult;
use r3_routing::wire::WireDtype;
use r3_text::json_kind;

/// OpenAI's chat completions request plus the SGLang extensions of its
/// `ChatCompletionRequest` (python/sglang/srt/entrypoints/openai/protocol.py) and vLLM's
/// `add_generation_prompt`.
pub static CHAT: Schema = Schema {
    name: "chat/completions",
    fields: &[
        ("model", Ignored),
        ("messages", Implemented),
        ("add_generation_prompt", Implemented),
        ("chat_template_kwargs", Implemented),
        ("reasoning_effort", Implemented),
        ("input_ids", Implemented),
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
        ("stream_options", Implemented),
        ("logprobs", Implemented),
        ("top_logprobs", Implemented),
        ("rid", Implemented),
        ("return_meta_info", Implemented),
        ("return_prompt_token_ids", Implemented),
        ("return_routed_experts", Implemented),
        ("routed_experts_start_len", Implemented),
        ("return_token_ids", Ignored),
        ("user", Ignored),
        ("separate_reasoning", Ignored),
        ("stream_reasoning", Ignored),
        ("parallel_tool_calls", Ignored),
        ("task", Ignored),
        ("session_id", Ignored),
        ("custom_params", Ignored),
        ("extra_key", Ignored),
        ("cache_salt", Ignored),
        ("ngram_corpus_id", Ignored),
        ("priority", Ignored),
        ("tools", NeutralOnly(&[])),
        ("tool_choice", NeutralOnly(&["\"none\"", "\"auto\""])),
        ("response_format", NeutralOnly(&[])),
        ("continue_final_message", NeutralOnly(&[])),
        ("reasoning", NeutralOnly(&[])),
        ("return_hidden_states", NeutralOnly(&[])),
        ("return_cached_tokens_details", NeutralOnly(&[])),
        ("regex", NeutralOnly(&[])),
        ("ebnf", NeutralOnly(&[])),
        ("stop_regex", NeutralOnly(&[])),
        ("lora_path", NeutralOnly(&[])),
        ("session_params", NeutralOnly(&[])),
        ("max_dynamic_patch", NeutralOnly(&[])),
        ("min_dynamic_patch", NeutralOnly(&[])),
        ("use_audio_in_video", NeutralOnly(&[])),
        ("images_config", NeutralOnly(&[])),
        ("custom_logit_processor", NeutralOnly(&[])),
        ("bootstrap_host", NeutralOnly(&[])),
        ("bootstrap_port", NeutralOnly(&[])),
        ("bootstrap_room", NeutralOnly(&[])),
        ("routed_dp_rank", NeutralOnly(&[])),
        ("disagg_prefill_dp_rank", NeutralOnly(&[])),
        ("data_parallel_rank", NeutralOnly(&[])),
    ],
};

/// Names `chat_template_kwargs` may not use: transformers 5.25's `apply_chat_template`
/// parameters that SGLang 0.5.23 also passes or that change the rendering (with `self`),
/// `render_jinja_template`'s `conversations` and the template's own `messages`. SGLang
/// spreads the kwargs into `apply_chat_template(messages, tokenize=False,
/// add_generation_prompt=…, tools=…, return_dict=False, **kwargs)`, so most of these raise
/// "got multiple values" there (a 400); `chat_template`, `continue_final_message`,
/// `sanitize_control_tokens` and `return_assistant_tokens_mask` would change what
/// `apply_chat_template` does, which r3 does not do. r3 would otherwise have taken them
/// silently as template variables (a `{"tools": ...}` passing r3's refusal of `tools`).
const APPLY_CHAT_TEMPLATE_ARGS: &[&str] = &[
    "self",
    "conversation",
    "conversations",
    "messages",
    "tools",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "return_dict",
    "return_assistant_tokens_mask",
];

/// `apply_chat_template` parameters that only shape its tokenisation: under SGLang's
/// `tokenize=False` they change nothing and never reach the template, so r3 drops them
/// (`documents`, the other parameter, reaches the template as a variable in both).
const TOKENIZE_ONLY_ARGS: &[&str] = &[
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "tokenizer_kwargs",
];

/// The `/v1/chat/completions` body, implemented fields only.
#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<Value>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    /// SGLang's reasoning switch: anything but `"none"` sets the template's `thinking` and
    /// `enable_thinking` (unless `chat_template_kwargs` sets them).
    reasoning_effort: Option<Value>,
    /// The prompt's ids, used instead of the rendered messages (SGLang: "bypasses chat
    /// template tokenization entirely"; miles' session router sends them).
    input_ids: Option<Value>,
    /// OpenAI's older cap on the tokens generated (0: a prompt-only answer, as SGLang).
    max_tokens: Option<usize>,
    /// OpenAI's cap on the tokens generated, taken over `max_tokens` when above 0.
    max_completion_tokens: Option<usize>,
    n: Option<usize>,
    #[serde(flatten)]
    sampling: OpenAiSampling,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Client request id, usable with `/abort_request` (`rid_k` per choice when `n > 1`).
    rid: Option<Value>,
    /// Each choice carries `/generate`'s `meta_info` (not with `stream`, as SGLang).
    return_meta_info: Option<bool>,
    /// Each choice carries the prompt's ids (not with `stream`, as SGLang).
    return_prompt_token_ids: Option<bool>,
    /// SGLang's `return_routed_experts` and `routed_experts_start_len`.
    #[serde(flatten)]
    routes: OpenAiRoutes,
}

/// One OpenAI message as a template message: `content` a string, a list of text parts
/// (`text` or `input_text`, joined with a space as SGLang's `process_content_for_template_format`
/// does for a template it detects as taking string content; r3 has no list content to hand
/// a template that loops over the parts), or null / absent (`""`, as SGLang 0.5.23's `_apply_jinja_template` sets
/// `msg_dict["content"] = ""` before rendering: r3-text would leave a null key out, as
/// transformers 5.24+ does, and a template testing `content is defined` would then differ);
/// other fields are passed to the template as they are.
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
        None | Some(Value::Null) => Some(String::new()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text" | "input_text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "{}[{j}]: r3 accepts only {{\"type\": \"text\" or \"input_text\", \"text\": ...}} parts",
                            field("content")
                        )))
                    }
                }
            }
            // SGLang: `" ".join(text_parts) if text_parts else ""`.
            Some(texts.join(" "))
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
    let started = Instant::now();
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
    let stream = body.stream.unwrap_or(false);
    if stream {
        // SGLang refuses these with `stream` too: its chunks have no place for them.
        for (field, asked) in [
            ("return_meta_info", body.return_meta_info),
            ("return_prompt_token_ids", body.return_prompt_token_ids),
        ] {
            if asked.unwrap_or(false) {
                return Err(ApiError::bad_request(format!(
                    "{field} is not supported with stream: true"
                )));
            }
        }
    }
    let messages = body
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(m, i))
        .collect::<Result<Vec<_>, _>>()?;
    let input_ids = match &body.input_ids {
        Some(ids) if !ids.is_null() => {
            let ids = token_list(ids, "input_ids")?;
            state.check_prompt(&ids, "input_ids")?;
            ids
        }
        _ => {
            let opts = RenderOptions {
                add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
                kwargs: template_kwargs(&body)?,
                ..RenderOptions::default()
            };
            let prompt = codec.render_chat(&messages, &opts)?;
            let ids = codec.encode(&prompt)?;
            state.check_prompt(&ids, "rendered messages")?;
            ids
        }
    };
    let n = body.n.unwrap_or(1);
    if n == 0 {
        return Err(ApiError::bad_request("n must be at least 1"));
    }
    state.check_batch_size(n)?;
    // A chat turn ends at the model's stop ids (e.g. `<|im_end|>`), beside the client's own,
    // unless `ignore_eos` (`AppState::prepare` adds them, as on every endpoint). Unset
    // sampling values take the model's generation_config.json ones (`--sampling-defaults
    // model`, SGLang's default), on chat alone as in SGLang.
    let sampling = state.config().generation.chat_defaults.fill(&body.sampling);
    // SGLang's `to_sampling_params` takes `max_completion_tokens or max_tokens` (Python's
    // `or`: a `max_completion_tokens` of 0 falls through to `max_tokens`). Neither: no
    // `max_new_tokens`, the rest of the context. 0: its prefill-only request, answered with
    // no output and finish `length` (the engine samples one token, which the answer leaves
    // out, as `/generate` does for `max_new_tokens: 0`).
    let max_new_tokens = match body.max_completion_tokens {
        Some(n) if n > 0 => Some(n),
        _ => body.max_tokens,
    };
    let prompt_only = max_new_tokens == Some(0);
    let mut sampling = sampling.to_native(max_new_tokens, sampling.stop_token_ids.clone());
    if prompt_only {
        // SGLang's `verify` refuses a `min_tokens` above the 0 asked for.
        sampling.check_min_new_tokens()?;
        sampling.max_new_tokens = Some(1);
        sampling.min_new_tokens = None;
    }
    let top_n = logprobs_asked(body.logprobs, body.top_logprobs)?;
    let prompts = [input_ids];
    let opts = body.routes.sample_options(&state, top_n, false, &prompts)?;
    let [input_ids] = prompts;
    let rids = choice_rids(body.rid.as_ref(), 1, n)?;
    let mut samples = SampleJobs::with_capacity(n);
    samples.push_samples(&state, &sampling, &input_ids, &rids[0], &opts)?;
    let specs: Vec<ResponseSpec> = samples
        .jobs
        .iter()
        .zip(&samples.texts)
        .map(|(job, text)| ResponseSpec {
            rid: job.rid.clone(),
            return_logprob: top_n.is_some(),
            prompt_ids: input_ids.clone(),
            top_logprobs: top_n.unwrap_or(0),
            // SGLang's chat asks its engine for the token texts.
            text_in_logprobs: true,
            return_routes: job.request.return_routes,
            dtype: WireDtype::I32,
            text: text.clone(),
            prompt_only,
        })
        .collect();
    let reply = ChatReply {
        head: AnswerHead::new(&state, "chatcmpl"),
        prompt_only,
        top_n,
        texts: samples.texts,
        prompt_len: input_ids.len(),
        routes: opts.routes_from.is_some(),
        stream: body.stream_options.unwrap_or_default(),
    };
    let chunks = AnswerStream::new(&state, reply.texts.len(), reply);
    let meta = body.return_meta_info.unwrap_or(false);
    let prompt_ids = body.return_prompt_token_ids.unwrap_or(false);
    respond(&state, samples.jobs, stream, chunks, |chunks, results| {
        let reply = &chunks.reply;
        let results = reply.settle(results)?;
        let latency = started.elapsed().as_secs_f64();
        let mut choices = Vec::with_capacity(results.len());
        for ((index, f), spec) in results.iter().enumerate().zip(&specs) {
            let c = reply.choice(&state, index, f)?;
            let mut choice = json!({"index": index,
                "message": {"role": "assistant", "content": c.content},
                "finish_reason": c.finish, "matched_stop": matched_stop(f),
                "token_ids": f.result.output_ids, "logprobs": c.logprobs});
            if prompt_ids {
                choice["prompt_token_ids"] = json!(input_ids);
            }
            if meta {
                choice["meta_info"] = meta_info(&state, f, spec, latency)?;
            }
            choices.push(choice);
        }
        let mut answer = reply.head.object("chat.completion", json!(choices));
        answer["usage"] = usage(input_ids.len(), completion_tokens(&results));
        answer["prompt_token_ids"] = json!(input_ids);
        if let Some(first) = results.first() {
            answer["metadata"] = json!({"weight_version": first.weight_version});
        }
        if reply.routes {
            if let Some(ext) = routes_ext(&state, &results)? {
                answer["sglext"] = ext;
            }
        }
        Ok(answer)
    })
    .await
}

/// The template's keyword arguments: `chat_template_kwargs`, and SGLang's
/// `reasoning_effort` setting `thinking` / `enable_thinking` (to `effort != "none"`) where
/// those do not.
fn template_kwargs(body: &ChatBody) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = body.chat_template_kwargs.clone().unwrap_or_default();
    kwargs.retain(|k, _| !TOKENIZE_ONLY_ARGS.contains(&k.as_str()));
    if let Some(key) = kwargs
        .keys()
        .find(|k| APPLY_CHAT_TEMPLATE_ARGS.contains(&k.as_str()))
    {
        return Err(ApiError::bad_request(format!(
            "chat_template_kwargs.{key} names an argument of apply_chat_template itself, not a template variable (transformers raises \"got multiple values\" for it)"
        )));
    }
    let thinking = match &body.reasoning_effort {
        None | Some(Value::Null) => return Ok(kwargs),
        Some(Value::String(s)) => match s.as_str() {
            "none" => false,
            "minimal" | "low" | "medium" | "high" | "xhigh" | "max" => true,
            other => {
                return Err(ApiError::bad_request(format!(
                    "reasoning_effort {other:?} is not one of none, minimal, low, medium, high, xhigh, max or a number in [0, 0.99]"
                )))
            }
        },
        Some(Value::Number(x)) if x.as_f64().is_some_and(|x| (0.0..=0.99).contains(&x)) => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "reasoning_effort must be a level name or a number in [0, 0.99], got {}",
                json_kind(other)
            )))
        }
    };
    for key in ["thinking", "enable_thinking"] {
        kwargs
            .entry(key.to_string())
            .or_insert(Value::Bool(thinking));
    }
    Ok(kwargs)
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
    /// `max_tokens: 0`: each choice's one sampled token is left out of the answer.
    prompt_only: bool,
    /// Alternatives per token when log-probs were asked for.
    top_n: Option<usize>,
    /// Text options of each choice.
    texts: Vec<TextOptions>,
    /// Tokens of the prompt (usage).
    prompt_len: usize,
    /// Routes were asked for (`sglext`).
    routes: bool,
    /// What a streamed answer reports of its usage.
    stream: StreamOptions,
}

/// The parts of one finished choice.
struct ChatChoice {
    content: String,
    finish: &'static str,
    logprobs: Value,
}

impl ChatReply {
    /// The results as the answer reports them: a prompt-only request's without the token
    /// the engine sampled (its log-probs and routing row too).
    fn settle(&self, results: Vec<Finished>) -> Result<Vec<Finished>, ApiError> {
        if !self.prompt_only {
            return Ok(results);
        }
        results.iter().map(without_output).collect()
    }

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
        if self.reply.prompt_only {
            return Vec::new();
        }
        let (hold, state) = (stop_hold(opts), &self.state);
        let decode = |ids: &[u32]| state.text()?.decode(ids, opts.skip_special_tokens).ok();
        let Some(new) = self.text.advance(index, tokens, hold, decode) else {
            return Vec::new();
        };
        let mut chunk = self
            .reply
            .chunk(json!({"index": index, "delta": {"content": new},
            "logprobs": null, "finish_reason": null}));
        if self.reply.stream.continuous() {
            chunk["usage"] = usage(self.reply.prompt_len, self.text.tokens(index));
        }
        vec![chunk]
    }

    fn finish(&mut self, results: &[Finished]) -> Result<Vec<Value>, ApiError> {
        let settled = self.reply.settle(results.to_vec())?;
        let results = settled.as_slice();
        let mut out = Vec::with_capacity(results.len());
        for (index, f) in results.iter().enumerate() {
            let c = self.reply.choice(&self.state, index, f)?;
            let rest = self.text.rest(index, &c.content);
            let mut chunk = self.reply.chunk(json!({"index": index, "delta": {"content": rest},
                "logprobs": c.logprobs, "finish_reason": c.finish, "matched_stop": matched_stop(f)}));
            if self.reply.stream.continuous() {
                chunk["usage"] = usage(self.reply.prompt_len, f.result.output_ids.len());
            }
            out.push(chunk);
        }
        let reply = &self.reply;
        let usage_now = reply
            .stream
            .include_usage()
            .then(|| usage(reply.prompt_len, completion_tokens(results)));
        out.extend(closing_chunks(
            &self.state,
            &reply.head,
            "chat.completion.chunk",
            results,
            reply.routes,
            usage_now,
        )?);
        Ok(out)
    }
}
