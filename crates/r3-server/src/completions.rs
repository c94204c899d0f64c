//! OpenAI `/v1/completions` (also streamed token by token, see [`super::sse`]): prompts as
//! text (encoded with the tokenizer's special tokens, as SGLang encodes them) or token ids, `n`
//! samples per prompt, stop strings and token ids, penalties, choices with text and token ids,
//! finish reasons, usage, and `logprobs` with up to [`MAX_LOGPROBS`] alternatives per token
//! and `text_offset` (OpenAI's and vLLM's offsets; SGLang sends -1). `echo: true` puts the
//! prompt before each choice's text as SGLang does (a text prompt as sent, token ids decoded
//! without special tokens) and, with `logprobs` > 0 (SGLang: not with 0), the prompt tokens'
//! log-probs before the output's (the first one null, as OpenAI).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::fields::{parse_body, token_list, token_prompts};
use super::openai::{
    choice_rids, closing_chunks, completion_tokens, finish_reason, matched_stop, respond,
    routes_ext, usage, AnswerHead, AnswerStream, SampleJobs, StreamOptions,
};
use super::openai_sampling::{OpenAiRoutes, OpenAiSampling};
use super::policy::COMPLETIONS;
use super::sse::ChunkBuilder;
use super::stop::{response_text, TextOptions};
use super::stream_text::stop_hold;
use super::worker::Finished;
use super::{read_body, AppState};
use r3_text::json_kind;

/// Most alternatives per token `logprobs` may ask for (OpenAI's own limit).
pub const MAX_LOGPROBS: u32 = 5;

/// The `/v1/completions` body, implemented fields only (the rest is screened by
/// [`COMPLETIONS`]).
#[derive(Debug, Deserialize)]
struct CompletionBody {
    /// A string, a list of strings, a list of token ids or a list of such lists.
    prompt: Value,
    /// Tokens to generate per choice (default 16, as OpenAI; 0 is refused, as SGLang's
    /// `CompletionRequest` refuses it).
    max_tokens: Option<usize>,
    /// Choices per prompt (default 1); choice `i` of a prompt samples with `seed + i`.
    n: Option<usize>,
    /// Log-probs of the sampled tokens plus this many alternatives (0..=MAX_LOGPROBS).
    logprobs: Option<u32>,
    /// The sampling fields shared with chat.
    #[serde(flatten)]
    sampling: OpenAiSampling,
    /// Prefix each choice with its prompt (text, tokens and, with `logprobs`, log-probs).
    echo: Option<bool>,
    /// Answer as server-sent events, chunks as tokens are produced (see [`OpenAiChunks`]).
    stream: Option<bool>,
    /// `include_usage` / `continuous_usage_stats` of a streamed answer.
    stream_options: Option<StreamOptions>,
    /// Client request id(s), usable with `/abort_request` (one string, or one per prompt).
    rid: Option<Value>,
    /// Put each prompt's ids in its choices (`prompt_token_ids`; `token_ids` always are).
    return_token_ids: Option<bool>,
    /// SGLang's `return_routed_experts` and `routed_experts_start_len`.
    #[serde(flatten)]
    routes: OpenAiRoutes,
}

/// `POST /v1/completions`.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: CompletionBody = COMPLETIONS.parse(parse_body::<Value>(&bytes)?)?;
    let top_n = match body.logprobs {
        None => None,
        Some(k) if k <= MAX_LOGPROBS => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "logprobs={k}: r3 returns at most {MAX_LOGPROBS} alternatives per token"
            )))
        }
    };
    if body.max_tokens == Some(0) {
        return Err(ApiError::bad_request("max_tokens must be positive"));
    }
    let (prompts, prompt_texts) = prompt_ids(&state, &body.prompt)?;
    let echo = body.echo.unwrap_or(false);
    // SGLang computes and reports the prompt's log-probs with `echo` only when `logprobs`
    // is truthy: not for `logprobs: 0`.
    let echo_logprobs = echo && top_n.is_some_and(|k| k > 0);
    let n = body.n.unwrap_or(1);
    if n == 0 {
        return Err(ApiError::bad_request("n must be at least 1"));
    }
    let total = prompts.len().saturating_mul(n);
    state.check_batch_size(total)?;
    let sampling = body.sampling.to_native(
        Some(body.max_tokens.unwrap_or(16)),
        body.sampling.stop_token_ids.clone(),
    );
    let rids = choice_rids(body.rid.as_ref(), prompts.len(), n)?;
    let opts = body
        .routes
        .sample_options(&state, top_n, echo_logprobs, &prompts)?;
    let mut samples = SampleJobs::with_capacity(total);
    for (p, input_ids) in prompts.iter().enumerate() {
        let at = |e: ApiError| {
            if prompts.len() > 1 {
                e.context(&format!("prompt {p}"))
            } else {
                e
            }
        };
        state.check_prompt(input_ids, "prompt").map_err(at)?;
        samples
            .push_samples(&state, &sampling, input_ids, &rids[p], &opts)
            .map_err(at)?;
    }
    let echoed = match (echo, state.text()) {
        (true, Some(codec)) => Some(echo_texts(codec, &prompts, prompt_texts)?),
        _ => None,
    };
    let reply = Reply {
        head: AnswerHead::new(&state, "cmpl"),
        prompts,
        n,
        echoed,
        echo_logprobs,
        top_n,
        streamed_ids: vec![StreamedIds::default(); samples.texts.len()],
        texts: samples.texts,
        prompt_ids: body.return_token_ids.unwrap_or(false),
        routes: opts.routes_from.is_some(),
        stream: body.stream_options.unwrap_or_default(),
    };
    let stream = body.stream.unwrap_or(false);
    let mut chunks = AnswerStream::new(&state, reply.texts.len(), reply);
    if stream {
        // The echoed prompt leaves with each choice's first text, as the choice's text
        // begins with it.
        for index in 0..chunks.reply.texts.len() {
            if let Some(prompt) = chunks.reply.echo_text(index) {
                let prompt = prompt.to_string();
                chunks.text.start_with(index, &prompt);
            }
        }
    }
    respond(&state, samples.jobs, stream, chunks, |chunks, results| {
        let reply = &chunks.reply;
        let choices = reply.choices(&state, &results)?;
        let prompt_tokens: usize = reply.prompts.iter().map(Vec::len).sum();
        let mut answer = reply.head.object("text_completion", json!(choices));
        answer["usage"] = usage(prompt_tokens, completion_tokens(&results));
        if reply.routes {
            if let Some(ext) = routes_ext(&state, &results)? {
                answer["sglext"] = ext;
            }
        }
        Ok(answer)
    })
    .await
}

/// What a completion answer is built from besides the engine's results.
struct Reply {
    head: AnswerHead,
    prompts: Vec<Vec<u32>>,
    n: usize,
    /// With `echo` (and a tokenizer), each prompt's text to put before its choices' text.
    echoed: Option<Vec<String>>,
    /// With `echo` and `logprobs` > 0: the prompt tokens lead the choices' log-probs.
    echo_logprobs: bool,
    top_n: Option<usize>,
    /// Text options of each choice.
    texts: Vec<TextOptions>,
    /// The token ids each streamed choice has sent and holds.
    streamed_ids: Vec<StreamedIds>,
    /// Each choice carries its prompt's ids (`return_token_ids`).
    prompt_ids: bool,
    /// Routes were asked for (`sglext`).
    routes: bool,
    /// What a streamed answer reports of its usage.
    stream: StreamOptions,
}

impl Reply {
    /// The prompt of choice `index` (choices run prompt by prompt, `n` each).
    fn prompt(&self, index: usize) -> &[u32] {
        self.prompts
            .get(index / self.n.max(1))
            .map_or(&[], Vec::as_slice)
    }

    /// The echoed text of choice `index`'s prompt, with `echo`.
    fn echo_text(&self, index: usize) -> Option<&str> {
        let texts = self.echoed.as_ref()?;
        texts.get(index / self.n.max(1)).map(String::as_str)
    }

    /// Every choice of a finished batch.
    fn choices(&self, state: &AppState, results: &[Finished]) -> Result<Vec<Value>, ApiError> {
        let mut choices = Vec::with_capacity(results.len());
        for (index, (f, text)) in results.iter().zip(&self.texts).enumerate() {
            let text = match state.text() {
                Some(codec) => response_text(
                    codec,
                    &f.result.output_ids,
                    &f.result.finish,
                    f.matched_stop.as_deref(),
                    text,
                )?,
                None => String::new(),
            };
            let echo = Echo {
                text: self.echo_text(index).unwrap_or_default(),
                logprobs: self.echo_logprobs.then(|| self.prompt(index)),
            };
            let mut c = choice(state, index, f, text, self.top_n, &echo)?;
            if self.prompt_ids {
                c["prompt_token_ids"] = json!(self.prompt(index));
            }
            choices.push(c);
        }
        Ok(choices)
    }

    /// One streamed chunk holding `choice`.
    fn chunk(&self, choice: Value) -> Value {
        self.head.object("text_completion", json!([choice]))
    }
}

/// The token ids of one streamed choice: those generated since its last chunk, and how many
/// its chunks carried.
#[derive(Debug, Clone, Default)]
struct StreamedIds {
    /// Generated, not sent yet (their text may be held back).
    unsent: Vec<u32>,
    /// Sent in the choice's chunks so far.
    sent: usize,
    /// A chunk of the choice has left (it carried `prompt_token_ids`).
    opened: bool,
}

/// The chunks of a streamed completion (OpenAI's format): each chunk carries the text added
/// since the previous one and the token ids generated since then (`token_ids`, as SGLang's
/// `_generate_completion_stream` slices `output_ids[n_prev_token_id:]`; r3 sends them
/// whether or not `return_token_ids` asks, as its choices always carry them), the first
/// chunk of a choice `prompt_token_ids` with `return_token_ids` (SGLang's `is_first_chunk`);
/// the last chunk of a choice carries the rest of its text and ids, its finish reason and
/// (with `logprobs`) all of its log-probs. The text and the ids of a choice's chunks
/// concatenate to the non-streamed choice's.
type OpenAiChunks = AnswerStream<Reply>;

impl ChunkBuilder for OpenAiChunks {
    fn opening(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn delta(&mut self, index: usize, tokens: &[u32]) -> Vec<Value> {
        let (Some(opts), Some(ids)) = (
            self.reply.texts.get(index),
            self.reply.streamed_ids.get_mut(index),
        ) else {
            return Vec::new();
        };
        ids.unsent.extend_from_slice(tokens);
        let (hold, state) = (stop_hold(opts), &self.state);
        let decode = |ids: &[u32]| state.text()?.decode(ids, opts.skip_special_tokens).ok();
        let Some(new) = self.text.advance(index, tokens, hold, decode) else {
            return Vec::new();
        };
        let token_ids = std::mem::take(&mut ids.unsent);
        ids.sent += token_ids.len();
        let mut choice = json!({"index": index, "text": new, "logprobs": null,
            "finish_reason": null, "token_ids": token_ids});
        if !std::mem::replace(&mut ids.opened, true) && self.reply.prompt_ids {
            choice["prompt_token_ids"] = json!(self.reply.prompt(index));
        }
        let mut chunk = self.reply.chunk(choice);
        if self.reply.stream.continuous() {
            let prompt = self.reply.prompt(index).len();
            chunk["usage"] = usage(prompt, self.text.tokens(index));
        }
        vec![chunk]
    }

    fn finish(&mut self, results: &[Finished]) -> Result<Vec<Value>, ApiError> {
        let choices = self.reply.choices(&self.state, results)?;
        let mut out: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, mut c)| {
                let full = c["text"].as_str().unwrap_or_default().to_string();
                c["text"] = Value::String(self.text.rest(index, &full).to_string());
                if let (Some(ids), Some(f)) =
                    (self.reply.streamed_ids.get(index), results.get(index))
                {
                    let all = &f.result.output_ids;
                    c["token_ids"] = json!(all.get(ids.sent..).unwrap_or_default());
                    if ids.opened {
                        // It left with the choice's first chunk.
                        if let Some(obj) = c.as_object_mut() {
                            obj.remove("prompt_token_ids");
                        }
                    }
                }
                let mut chunk = self.reply.chunk(c);
                if let (true, Some(f)) = (self.reply.stream.continuous(), results.get(index)) {
                    let prompt = self.reply.prompt(index).len();
                    chunk["usage"] = usage(prompt, f.result.output_ids.len());
                }
                chunk
            })
            .collect();
        let reply = &self.reply;
        let usage_now = reply.stream.include_usage().then(|| {
            let prompt_tokens: usize = reply.prompts.iter().map(Vec::len).sum();
            usage(prompt_tokens, completion_tokens(results))
        });
        out.extend(closing_chunks(
            &self.state,
            &reply.head,
            "text_completion",
            results,
            reply.routes,
            usage_now,
        )?);
        Ok(out)
    }
}

/// The echoed text of each prompt, as SGLang's `_prepare_echo_prompts` gives it: a text
/// prompt as it was sent, token ids decoded with special tokens skipped.
fn echo_texts(
    codec: &super::text::TextCodec,
    prompts: &[Vec<u32>],
    texts: Vec<Option<String>>,
) -> Result<Vec<String>, ApiError> {
    prompts
        .iter()
        .zip(texts)
        .map(|(ids, text)| match text {
            Some(t) => Ok(t),
            None => codec.decode(ids, true),
        })
        .collect()
}

/// The prompts as token ids, and the text of each one sent as text (None: sent as ids).
type Prompts = (Vec<Vec<u32>>, Vec<Option<String>>);

/// The prompts as token ids, whatever form they were sent in, and the text of each one sent
/// as text (encoded with the tokenizer's special tokens, as SGLang encodes a text prompt).
fn prompt_ids(state: &AppState, prompt: &Value) -> Result<Prompts, ApiError> {
    let needs_text = match prompt {
        Value::String(_) => true,
        Value::Array(items) => items.first().is_some_and(Value::is_string),
        _ => false,
    };
    if !needs_text {
        if !prompt.is_array() {
            return Err(ApiError::bad_request(format!(
                "prompt must be a string, a list of strings, a list of token ids or a list of such lists, got {}",
                json_kind(prompt)
            )));
        }
        let ids = token_prompts(prompt, "prompt")?.0;
        let texts = vec![None; ids.len()];
        return Ok((ids, texts));
    }
    let codec = state.text().ok_or_else(|| {
        ApiError::bad_request(
            "text prompts need a tokenizer.json in the model directory; send token ids",
        )
    })?;
    match prompt {
        Value::String(s) => Ok((vec![codec.encode_prompt(s)?], vec![Some(s.clone())])),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, t)| match t {
                Value::String(s) => Ok((codec.encode_prompt(s)?, Some(s.clone()))),
                Value::Array(_) => Ok((token_list(t, &format!("prompt[{i}]"))?, None)),
                other => Err(ApiError::bad_request(format!(
                    "prompt[{i}] must be a string, got {}",
                    json_kind(other)
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|pairs| pairs.into_iter().unzip()),
        _ => Err(ApiError::bad_request("prompt must be a string or a list")),
    }
}

/// The text of one token for `logprobs` (its decoded text; `token_id:N` without tokenizer).
pub(super) fn token_text(state: &AppState, id: u32) -> String {
    match state.text() {
        Some(codec) => codec
            .decode(&[id], false)
            .unwrap_or_else(|_| codec.token_str(id)),
        None => format!("token_id:{id}"),
    }
}

/// How many characters prompt token `id` adds to an echoed prompt: its text with special
/// tokens skipped, as [`echo_texts`] decodes token ids (0 without a tokenizer).
fn echoed_width(state: &AppState, id: u32) -> usize {
    state
        .text()
        .and_then(|codec| codec.decode(&[id], true).ok())
        .map_or(0, |t| t.chars().count())
}

/// What a choice echoes of its prompt.
struct Echo<'a> {
    /// The text put before the output ("" without `echo`).
    text: &'a str,
    /// The prompt tokens whose log-probs lead the output's (`echo` with `logprobs` > 0).
    logprobs: Option<&'a [u32]>,
}

/// One OpenAI choice, its prompt echoed as `echo` says.
fn choice(
    state: &AppState,
    index: usize,
    f: &Finished,
    text: String,
    top: Option<usize>,
    echo: &Echo<'_>,
) -> Result<Value, ApiError> {
    let r = &f.result;
    let prompt = echo.logprobs.unwrap_or_default();
    let text = format!("{}{text}", echo.text);
    let finish = finish_reason(&r.finish);
    let matched = matched_stop(f);
    let logprobs = match top {
        None => Value::Null,
        Some(k) => {
            let tokens: Vec<String> = prompt
                .iter()
                .chain(&r.output_ids)
                .map(|&id| token_text(state, id))
                .collect();
            // Offsets into the choice's text, by the running length of the token texts (as
            // OpenAI and vLLM give them; SGLang 0.5.23 sends -1 for each, "not supported
            // yet"). The output starts where the echoed text ends. The echoed prompt tokens
            // run by their text as echoed (special tokens skipped, so a bos the tokenizer
            // added sits where the next visible text starts), kept within the echoed text
            // (a text prompt is echoed as sent, which its tokens may not spell exactly).
            let echo_len = echo.text.chars().count();
            let mut running = 0;
            let text_offset: Vec<usize> = prompt
                .iter()
                .map(|&id| {
                    let at = running.min(echo_len);
                    running += echoed_width(state, id);
                    at
                })
                .chain(tokens[prompt.len()..].iter().scan(echo_len, |offset, t| {
                    let at = *offset;
                    *offset += t.chars().count();
                    Some(at)
                }))
                .collect();
            let alternatives = |pos: &Vec<(u32, f32)>| {
                let mut m = Map::new();
                for &(id, lp) in pos.iter().take(k) {
                    m.entry(token_text(state, id)).or_insert(json!(lp));
                }
                Value::Object(m)
            };
            // The echoed prompt: its first token has no log-prob (null), the rest come from
            // the engine's prompt log-probs (asked for from position 0).
            let (mut token_logprobs, mut prompt_tops) = (Vec::new(), Vec::new());
            if !prompt.is_empty() {
                let lp = r.prompt_logprobs.as_ref().ok_or_else(|| {
                    ApiError::internal("the engine returned no prompt log-probs for echo")
                })?;
                token_logprobs.push(Value::Null);
                prompt_tops.push(Value::Null);
                token_logprobs.extend(lp.logprobs.iter().map(|&v| json!(v)));
                prompt_tops.extend(lp.top_logprobs.iter().map(alternatives));
            }
            token_logprobs.extend(r.output_logprobs.iter().map(|&v| json!(v)));
            // `logprobs: 0` gives an empty list, as SGLang's `LogProbs` (no alternatives
            // were asked for, so none were computed).
            if k > 0 {
                prompt_tops.extend(r.output_top_logprobs.iter().map(alternatives));
            }
            let top_logprobs = Value::Array(prompt_tops);
            json!({
                "tokens": tokens,
                "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs,
                "text_offset": text_offset,
            })
        }
    };
    Ok(json!({
        "index": index,
        "text": text,
        "token_ids": r.output_ids,
        "logprobs": logprobs,
        "finish_reason": finish,
        "matched_stop": matched,
    }))
}
