//! SGLang's native `/generate`: request parsing and validation, and the response with
//! `output_ids`, `text` (when the model has a tokenizer), and `meta_info` (token counts, cached
//! tokens, finish reason, weight version, `output_token_logprobs`, `output_top_logprobs`,
//! `routed_experts` base64 + `routed_experts_dtype`).
//!
//! With `stream: true` chunks leave as tokens are produced ([`super::sse`]): SGLang's
//! cumulative `text` / `output_ids` per step, then the complete response of each request.
//!
//! `sampling_params.n = k` runs every prompt k times in SGLang's order, prompt by prompt
//! (p0 s0, p0 s1, …, p1 s0, …: its tokenizer manager expands a batch so); the response is
//! then a list even for one prompt, streamed chunks carry that position as `index`. With a
//! client seed, sample `i` of a prompt uses `seed + i`.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use r3_routing::wire::sglang::{encode_sglang, SGLANG_DTYPES};
use r3_routing::wire::WireDtype;
use r3_routing::RouteTable;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{parse_body, per_request, text_prompts, token_prompts};
use super::policy::{GENERATE, SAMPLING};
use super::sampling::SamplingBody;
use super::sse::{event_stream, stream_jobs, ChunkBuilder};
use super::stop::{response_text, TextOptions};
use super::stream_text::StreamedText;
use super::worker::{Finished, Job};
use super::{read_body, AppState};
use r3_rollout::request::{FinishReason, GenerateRequest, GenerateResult};

/// The `/generate` body, implemented fields only (the rest is screened by [`GENERATE`]).
#[derive(Debug, Deserialize)]
struct GenerateBody {
    /// A string or a list of strings (needs `tokenizer.json` in the model directory).
    text: Option<Value>,
    /// Token ids: one list or a batch of lists.
    input_ids: Option<Value>,
    /// One object for all prompts or one per prompt.
    sampling_params: Option<Value>,
    /// Return `output_token_logprobs` (bool or one per prompt).
    return_logprob: Option<Value>,
    /// First prompt position of `input_token_logprobs` (with `return_logprob`); -1 or null
    /// means the last prompt token only (SGLang's default), so no prompt log-prob is computed.
    logprob_start_len: Option<Value>,
    /// Alternatives per output position in `output_top_logprobs` (number or one per prompt).
    top_logprobs_num: Option<Value>,
    /// Put each token's text in the log-prob entries.
    return_text_in_logprobs: Option<bool>,
    /// Return `routed_experts` (bool or one per prompt).
    return_routed_experts: Option<Value>,
    /// First position whose routes are returned (number or one per prompt).
    routed_experts_start_len: Option<Value>,
    /// Wire dtype of `routed_experts`: `int32` (default), `uint16` or `uint8`.
    routed_experts_dtype: Option<String>,
    /// Client request id(s), usable with `/abort_request`.
    rid: Option<Value>,
    /// Answer as server-sent events (see [`super::sse`]).
    stream: Option<bool>,
}

/// Most alternatives per position `top_logprobs_num` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What to put in one response besides the engine result (also what a chat choice's
/// `meta_info` is built from).
#[derive(Debug, Clone)]
pub(super) struct ResponseSpec {
    /// `meta_info.id`.
    pub rid: String,
    /// Report output (and prompt) log-probs.
    pub return_logprob: bool,
    /// The prompt, kept to label `input_token_logprobs` (only with `return_logprob`).
    pub prompt_ids: Vec<u32>,
    /// Alternatives per position (0: no `*_top_logprobs`).
    pub top_logprobs: usize,
    /// Put each token's text in the log-prob entries.
    pub text_in_logprobs: bool,
    /// Report `routed_experts`.
    pub return_routes: bool,
    /// Their wire dtype.
    pub dtype: WireDtype,
    /// Stop strings and special-token handling of the text.
    pub text: TextOptions,
    /// `max_new_tokens: 0` (SGLang's prompt-only request: `select` scoring, reference
    /// log-probs): the engine samples one token, which the answer leaves out.
    pub prompt_only: bool,
}

/// One entry of the response: a job to run, or an answer known without running one.
enum Planned {
    Run(Box<(Job, ResponseSpec)>),
    Answer(Value),
}

/// `POST /generate`.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let bytes = read_body(body, state.limits().max_body_bytes)?;
    let body: GenerateBody = GENERATE.parse(parse_body::<Value>(&bytes)?)?;
    let stream = body.stream.unwrap_or(false);
    let (plan, is_batch) = plan(&state, body, stream)?;
    let jobs: Vec<Job> = plan
        .iter()
        .filter_map(|p| match p {
            Planned::Run(run) => Some(run.0.clone()),
            Planned::Answer(_) => None,
        })
        .collect();
    if stream && !jobs.is_empty() {
        let runs = jobs.len();
        let chunks = SglangChunks {
            state: state.clone(),
            plan,
            is_batch,
            started,
            so_far: vec![Vec::new(); runs],
            text: StreamedText::new(runs),
        };
        return stream_jobs(state.handle(), jobs, chunks).await;
    }
    let finished = if jobs.is_empty() {
        Vec::new()
    } else {
        state.handle().generate(jobs).await?
    };
    let latency = started.elapsed().as_secs_f64();
    let mut out = Vec::with_capacity(plan.len());
    let mut finished = finished.into_iter();
    for p in &plan {
        match p {
            Planned::Answer(v) => out.push(v.clone()),
            Planned::Run(run) => {
                let f = finished
                    .next()
                    .ok_or_else(|| ApiError::internal("the engine returned too few results"))?;
                out.push(response_for(&state, &f, &run.1, latency)?);
            }
        }
    }
    if stream {
        // Only answers known without the engine: SGLang tags each chunk of a batch with
        // its index.
        if is_batch {
            for (i, v) in out.iter_mut().enumerate() {
                v["index"] = Value::from(i);
            }
        }
        return Ok(event_stream(&out));
    }
    if is_batch {
        Ok(Json(Value::Array(out)).into_response())
    } else {
        out.pop()
            .map(|v| Json(v).into_response())
            .ok_or_else(|| ApiError::internal("the engine returned no result"))
    }
}

/// The chunks of a streamed `/generate` (SGLang's format: each chunk carries the cumulative
/// `text` and `output_ids`; the last chunk of a request is its complete response).
struct SglangChunks {
    state: AppState,
    plan: Vec<Planned>,
    is_batch: bool,
    started: Instant,
    /// Tokens streamed so far per job.
    so_far: Vec<Vec<u32>>,
    /// The text decoded so far per job, incrementally (its cumulative `text`).
    text: StreamedText,
}

impl SglangChunks {
    /// Plan index and spec of job `job`.
    fn run(&self, job: usize) -> Option<(usize, &Job, &ResponseSpec)> {
        self.plan
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Planned::Run(run) => Some((i, &run.0, &run.1)),
                Planned::Answer(_) => None,
            })
            .nth(job)
    }

    fn tag(&self, mut v: Value, index: usize) -> Value {
        if self.is_batch {
            v["index"] = Value::from(index);
        }
        v
    }
}

impl ChunkBuilder for SglangChunks {
    fn opening(&mut self) -> Vec<Value> {
        self.plan
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Planned::Answer(v) => Some(self.tag(v.clone(), i)),
                Planned::Run(_) => None,
            })
            .collect()
    }

    fn delta(&mut self, index: usize, tokens: &[u32]) -> Vec<Value> {
        let Some((at, job, spec)) = self.run(index) else {
            return Vec::new();
        };
        if spec.prompt_only {
            return Vec::new();
        }
        let (prompt_tokens, rid) = (job.request.input_ids.len(), spec.rid.clone());
        let skip_special_tokens = spec.text.skip_special_tokens;
        let Some(cum) = self.so_far.get_mut(index) else {
            return Vec::new();
        };
        cum.extend_from_slice(tokens);
        let mut chunk = json!({
            "output_ids": cum,
            "meta_info": {
                "id": rid,
                "finish_reason": null,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": cum.len(),
                "weight_version": self.state.handle().stats().weight_version,
            },
        });
        if let Some(codec) = self.state.text() {
            // SGLang's detokenizer: the text so far, a character still split across tokens
            // left for a later chunk; no stop string held back, as SGLang holds none.
            let decode = |ids: &[u32]| codec.decode(ids, skip_special_tokens).ok();
            let _ = self.text.advance(index, tokens, 0, decode);
            chunk["text"] = Value::String(self.text.sent(index).to_string());
        }
        vec![self.tag(chunk, at)]
    }

    fn finish(&mut self, results: &[Finished]) -> Result<Vec<Value>, ApiError> {
        let latency = self.started.elapsed().as_secs_f64();
        let mut out = Vec::with_capacity(results.len());
        for (job, f) in results.iter().enumerate() {
            let (at, _, spec) = self
                .run(job)
                .ok_or_else(|| ApiError::internal("the engine returned too many results"))?;
            let v = response_for(&self.state, f, spec, latency)?;
            out.push(self.tag(v, at));
        }
        Ok(out)
    }
}

/// Screens and parses `sampling_params`: absent, one object, or one per prompt. An explicit
/// `"max_new_tokens": null` asks for no cap of the client's own (SGLang's `SamplingParams`
/// then holds None, which its scheduler turns into the rest of the context).
pub fn sampling_bodies(v: Option<&Value>, n: usize) -> Result<Vec<SamplingBody>, ApiError> {
    let parse = |item: &Value| -> Result<SamplingBody, ApiError> {
        let mut body: SamplingBody = SAMPLING.parse(item.clone())?;
        body.rest_of_context = item.get("max_new_tokens") == Some(&Value::Null);
        Ok(body)
    };
    match v {
        None | Some(Value::Null) => Ok(vec![SamplingBody::default(); n]),
        Some(Value::Array(items)) => {
            if items.len() != n {
                return Err(ApiError::bad_request(format!(
                    "sampling_params has {} entries but the request has {n} prompts",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    parse(item).map_err(|e| e.context(&format!("sampling_params[{i}]")))
                })
                .collect()
        }
        Some(one) => Ok(vec![parse(one)?; n]),
    }
}

/// The prompts as token ids, and whether they came as a batch.
fn prompt_ids(state: &AppState, body: &GenerateBody) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    match (&body.input_ids, &body.text) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "give either input_ids or text, not both",
        )),
        (None, None) => Err(ApiError::bad_request("missing input_ids (or text)")),
        (Some(ids), None) => token_prompts(ids, "input_ids"),
        (None, Some(text)) => {
            let codec = state.text().ok_or_else(|| {
                ApiError::bad_request(
                    "text prompts need a tokenizer.json in the model directory; send input_ids",
                )
            })?;
            let (texts, is_batch) = text_prompts(text, "text")?;
            let ids = texts
                .iter()
                .map(|t| codec.encode_prompt(t))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((ids, is_batch))
        }
    }
}

/// Validates the body and turns it into engine jobs (one per prompt and sample, prompt by
/// prompt). A start past the prompt (`logprob_start_len` with `return_logprob`,
/// `routed_experts_start_len` with routes) is SGLang's abort with status 400: a 400 answer,
/// or with `stream` an abort chunk in its place.
fn plan(
    state: &AppState,
    body: GenerateBody,
    stream: bool,
) -> Result<(Vec<Planned>, bool), ApiError> {
    let (prompts, batch_input) = prompt_ids(state, &body)?;
    let n = prompts.len();
    let sampling = sampling_bodies(body.sampling_params.as_ref(), n)?;
    let samples = sampling
        .first()
        .map(SamplingBody::samples)
        .transpose()?
        .unwrap_or(1);
    for (i, s) in sampling.iter().enumerate() {
        if s.samples()? != samples {
            return Err(ApiError::bad_request(format!(
                "sampling_params[{i}].n differs from sampling_params[0].n; give one n for all"
            )));
        }
    }
    state.check_batch_size(n.saturating_mul(samples))?;
    let is_batch = batch_input || samples > 1;
    let logprob = per_request(body.return_logprob.as_ref(), "return_logprob", n, false)?;
    let top = per_request(
        body.top_logprobs_num.as_ref(),
        "top_logprobs_num",
        n,
        0usize,
    )?;
    let prompt_lp = per_request(
        body.logprob_start_len.as_ref(),
        "logprob_start_len",
        n,
        -1i64,
    )?;
    // SGLang reads `logprob_start_len` and `top_logprobs_num` only with `return_logprob`.
    let asked = |i: &usize| logprob.get(*i).copied().unwrap_or(false);
    if let Some(s) = (0..n).filter(asked).map(|i| prompt_lp[i]).find(|&s| s < -1) {
        return Err(ApiError::bad_request(format!(
            "logprob_start_len must be -1 (last prompt token only) or a prompt position >= 0, got {s}"
        )));
    }
    if let Some(t) = (0..n)
        .filter(asked)
        .map(|i| top[i])
        .find(|&t| t > MAX_TOP_LOGPROBS)
    {
        return Err(ApiError::bad_request(format!(
            "top_logprobs_num {t} is above r3's limit of {MAX_TOP_LOGPROBS}"
        )));
    }
    let by_default = state.config().return_routed_experts_by_default;
    let routes = per_request(
        body.return_routed_experts.as_ref(),
        "return_routed_experts",
        n,
        by_default,
    )?;
    let routes: Vec<bool> = routes.into_iter().map(|r| r || by_default).collect();
    let start_len = per_request(
        body.routed_experts_start_len.as_ref(),
        "routed_experts_start_len",
        n,
        0usize,
    )?;
    let rids = rids(body.rid.as_ref(), n, samples, is_batch)?;
    let dtype = routes_dtype(state, body.routed_experts_dtype.as_deref())?;
    let moe = !state.summary().layout.moe_layers().is_empty();
    if routes.iter().any(|&r| r) && !moe && !by_default {
        return Err(ApiError::bad_request(
            "return_routed_experts: the served model has no MoE layers",
        ));
    }
    let mut plan = Vec::with_capacity(n * samples);
    for (i, input_ids) in prompts.iter().enumerate() {
        for k in 0..samples {
            let at = |e: ApiError| {
                if is_batch {
                    e.context(&format!("prompt {i}"))
                } else {
                    e
                }
            };
            state.check_prompt(input_ids, "input_ids").map_err(at)?;
            // SGLang answers `max_new_tokens: 0` with the prompt's log-probs and no output;
            // the engine always samples, so one token is sampled and left out of the answer.
            let prompt_only = sampling[i].max_new_tokens == Some(0);
            let one_token;
            let sampling_i = if prompt_only {
                // SGLang's `verify` refuses a `min_new_tokens` above the 0 asked for.
                sampling[i].check_min_new_tokens().map_err(at)?;
                one_token = SamplingBody {
                    max_new_tokens: Some(1),
                    min_new_tokens: None,
                    ..sampling[i].clone()
                };
                &one_token
            } else {
                &sampling[i]
            };
            let (params, text, stop) = state.prepare(sampling_i, input_ids.len(), k).map_err(at)?;
            let rid = rids[i * samples + k]
                .clone()
                .unwrap_or_else(|| state.next_rid());
            let return_routes = routes[i] && moe;
            if let Some(message) = start_past_prompt(
                logprob[i].then_some(prompt_lp[i]),
                return_routes.then_some(start_len[i]),
                input_ids.len(),
            ) {
                if !stream {
                    return Err(at(ApiError::bad_request(message)));
                }
                let version = state.handle().stats().weight_version;
                plan.push(Planned::Answer(aborted_answer(
                    &rid,
                    &message,
                    input_ids.len(),
                    version,
                )));
                continue;
            }
            let mut params = params;
            // Without `return_logprob` SGLang ignores `top_logprobs_num`: none are computed.
            params.top_logprobs = if logprob[i] { top[i] } else { 0 };
            // SGLang reports the prompt from `logprob_start_len` (-1: its last token only;
            // the prompt's length: none, here its last token as for -1).
            params.prompt_logprobs_from = logprob[i].then(|| {
                usize::try_from(prompt_lp[i])
                    .unwrap_or(usize::MAX)
                    .min(input_ids.len() - 1)
            });
            let spec = ResponseSpec {
                rid: rid.clone(),
                return_logprob: logprob[i],
                prompt_ids: if logprob[i] {
                    input_ids.clone()
                } else {
                    Vec::new()
                },
                top_logprobs: if logprob[i] { top[i] } else { 0 },
                text_in_logprobs: body.return_text_in_logprobs.unwrap_or(false),
                return_routes,
                dtype,
                text,
                prompt_only,
            };
            let job = Job {
                rid,
                request: GenerateRequest {
                    input_ids: input_ids.clone(),
                    sampling: params,
                    return_routes,
                    // Read only with routes, as SGLang checks it only then.
                    routed_experts_start_len: if return_routes { start_len[i] } else { 0 },
                },
                stop,
            };
            plan.push(Planned::Run(Box::new((job, spec))));
        }
    }
    Ok((plan, is_batch))
}

/// A server-made request id: a random UUID v4 as 32 hex digits, SGLang's
/// `uuid.uuid4().hex`. It comes from the OS-seeded thread RNG, not from the server's seeded
/// stream: an id names a request and picks nothing that is sampled, and a counter (`r3-N`)
/// named requests a client could name too (its own `r3-5`, or a rid it kept from before the
/// server restarted and the counter with it), so `/abort_request` could end another
/// client's request, or a client's own rid be refused as already in flight.
pub fn fresh_rid() -> String {
    let bits: u128 = rand::random();
    // The version (4) and variant (10) bits of a UUID v4.
    let bits = (bits & !(0xF << 76)) | (0x4 << 76);
    let bits = (bits & !(0x3 << 62)) | (0x2 << 62);
    format!("{bits:032x}")
}

/// Client rids per expanded request (`samples` of each of `n` prompts, prompt by prompt):
/// one string for a batch becomes `rid_j` (`j` the position in that order); a list (one per
/// prompt) gets `_k` for sample `k > 0`.
pub(super) fn rids(
    v: Option<&Value>,
    n: usize,
    samples: usize,
    is_batch: bool,
) -> Result<Vec<Option<String>>, ApiError> {
    let total = n * samples;
    match v {
        None | Some(Value::Null) => Ok(vec![None; total]),
        Some(Value::String(s)) if !is_batch => Ok(vec![Some(s.clone())]),
        Some(Value::String(s)) => Ok((0..total).map(|j| Some(format!("{s}_{j}"))).collect()),
        Some(list) => {
            let per: Vec<Option<String>> = per_request(Some(list), "rid", n, None)?;
            Ok(per
                .iter()
                .flat_map(|r| {
                    (0..samples).map(move |k| {
                        r.as_ref().map(|r| {
                            if k == 0 {
                                r.clone()
                            } else {
                                format!("{r}_{k}")
                            }
                        })
                    })
                })
                .collect())
        }
    }
}

/// Why a request is refused for a start past its `prompt`-token prompt, as SGLang's scheduler
/// checks: `logprob_start_len` (given only with `return_logprob`) above the prompt's length,
/// `routed_experts_start_len` (given only with routes) above it.
pub(super) fn start_past_prompt(
    logprob_start: Option<i64>,
    routes_start: Option<usize>,
    prompt: usize,
) -> Option<String> {
    if let Some(s) = logprob_start.filter(|&s| usize::try_from(s).is_ok_and(|s| s > prompt)) {
        return Some(format!(
            "logprob_start_len={s} is higher than the number of input tokens ({prompt}); use a smaller logprob_start_len"
        ));
    }
    routes_start.filter(|&s| s > prompt).map(|s| {
        format!(
            "routed_experts_start_len={s} is higher than the number of input tokens ({prompt}); use a smaller routed_experts_start_len"
        )
    })
}

/// The chunk a refused streamed request gets in place of its answer (SGLang streams the abort
/// it finishes the request with): nothing generated, finish reason `abort` with `message`.
fn aborted_answer(rid: &str, message: &str, prompt: usize, weight_version: String) -> Value {
    json!({
        "output_ids": [],
        "text": "",
        "meta_info": {
            "id": rid,
            "finish_reason": {
                "type": "abort",
                "message": message,
                "status_code": 400,
            },
            "prompt_tokens": prompt,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": weight_version,
        },
    })
}

/// The wire dtype asked for, checked against SGLang's set and the model's expert count.
fn routes_dtype(state: &AppState, name: Option<&str>) -> Result<WireDtype, ApiError> {
    let dtype = match name {
        None => WireDtype::I32,
        Some(s) => WireDtype::parse(s)
            .filter(|d| SGLANG_DTYPES.contains(d))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "routed_experts_dtype {s:?} is not one of int32, uint16, uint8"
                ))
            })?,
    };
    let experts = state.summary().num_experts as i64;
    if experts > dtype.max_id() + 1 {
        return Err(ApiError::bad_request(format!(
            "routed_experts_dtype {} cannot hold expert ids up to {}",
            dtype.name(),
            experts - 1
        )));
    }
    Ok(dtype)
}

/// SGLang's `finish_reason` object.
pub fn sglang_finish_reason(f: &Finished) -> Value {
    let completion = f.result.output_ids.len();
    match f.result.finish {
        FinishReason::Length => json!({"type": "length", "length": completion}),
        FinishReason::Stop { token } => json!({"type": "stop", "matched": token}),
        FinishReason::StopString => json!({"type": "stop", "matched": f.matched_stop}),
        FinishReason::Abort => json!({"type": "abort", "message": "aborted by request"}),
    }
}

/// `[logprob, token id, text or null]`, SGLang's log-prob entry.
fn logprob_entry(state: &AppState, lp: f32, id: u32, with_text: bool) -> Value {
    let text = match (with_text, state.text()) {
        (true, Some(codec)) => Value::String(codec.decode(&[id], false).unwrap_or_default()),
        _ => Value::Null,
    };
    json!([lp, id, text])
}

/// SGLang's `input_token_logprobs` (`[logprob, id, text]` from the reported start to the
/// prompt's end, the first logprob null: nothing scores the first reported token) and
/// `input_top_logprobs` (null at the first entry, then the alternatives per position).
fn prompt_logprob_entries(
    state: &AppState,
    r: &GenerateResult,
    spec: &ResponseSpec,
) -> (Value, Value) {
    let Some(p) = r.prompt_logprobs.as_ref() else {
        return (json!([]), json!([]));
    };
    let with_text = spec.text_in_logprobs;
    let ids = spec.prompt_ids.get(p.start..).unwrap_or_default();
    let mut lps = Vec::with_capacity(ids.len());
    let mut tops = Vec::with_capacity(ids.len());
    for (j, &id) in ids.iter().enumerate() {
        if j == 0 {
            let text = logprob_entry(state, 0.0, id, with_text)[2].take();
            lps.push(json!([null, id, text]));
            tops.push(Value::Null);
            continue;
        }
        // Fewer log-probs than positions only when the request was aborted mid-prefill.
        let Some(&lp) = p.logprobs.get(j - 1) else {
            break;
        };
        lps.push(logprob_entry(state, lp, id, with_text));
        if let Some(pos) = p.top_logprobs.get(j - 1) {
            tops.push(Value::Array(
                pos.iter()
                    .map(|&(t, lp)| logprob_entry(state, lp, t, with_text))
                    .collect(),
            ));
        }
    }
    (Value::Array(lps), Value::Array(tops))
}

/// One response object.
fn response_for(
    state: &AppState,
    f: &Finished,
    spec: &ResponseSpec,
    latency: f64,
) -> Result<Value, ApiError> {
    let trimmed;
    let f = if spec.prompt_only {
        trimmed = without_output(f)?;
        &trimmed
    } else {
        f
    };
    let r = &f.result;
    let meta = meta_info(state, f, spec, latency)?;
    let mut out = json!({"output_ids": r.output_ids, "meta_info": meta});
    if let Some(codec) = state.text() {
        out["text"] = Value::String(response_text(
            codec,
            &r.output_ids,
            &r.finish,
            f.matched_stop.as_deref(),
            &spec.text,
        )?);
    }
    Ok(out)
}

/// SGLang's `meta_info` of one finished request (`/generate`'s, and a chat choice's with
/// `return_meta_info`).
pub(super) fn meta_info(
    state: &AppState,
    f: &Finished,
    spec: &ResponseSpec,
    latency: f64,
) -> Result<Value, ApiError> {
    let r = &f.result;
    let mut meta = json!({
        "id": spec.rid,
        "finish_reason": sglang_finish_reason(f),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.output_ids.len(),
        "cached_tokens": r.cached_tokens,
        "weight_version": f.weight_version,
        "e2e_latency": latency,
    });
    if spec.return_logprob {
        let lps: Vec<Value> = r
            .output_logprobs
            .iter()
            .zip(&r.output_ids)
            .map(|(&lp, &id)| logprob_entry(state, lp, id, spec.text_in_logprobs))
            .collect();
        meta["output_token_logprobs"] = Value::Array(lps);
        let (input_lps, input_tops) = prompt_logprob_entries(state, r, spec);
        meta["input_token_logprobs"] = input_lps;
        if spec.top_logprobs > 0 {
            meta["input_top_logprobs"] = input_tops;
            let tops: Vec<Value> = r
                .output_top_logprobs
                .iter()
                .map(|pos| {
                    Value::Array(
                        pos.iter()
                            .map(|&(id, lp)| logprob_entry(state, lp, id, spec.text_in_logprobs))
                            .collect(),
                    )
                })
                .collect();
            meta["output_top_logprobs"] = Value::Array(tops);
        }
    }
    if spec.return_routes {
        routes_meta(state, r, spec, &mut meta)?;
    }
    Ok(meta)
}

/// A prompt-only answer: the sampled token, its log-probs and its routing row left out
/// (routes then cover `prompt - 1` positions, as `prompt + completion - 1` says).
pub(super) fn without_output(f: &Finished) -> Result<Finished, ApiError> {
    let mut f = f.clone();
    let r = &mut f.result;
    r.output_ids.clear();
    r.output_logprobs.clear();
    r.output_top_logprobs.clear();
    if r.finish != FinishReason::Abort {
        r.finish = FinishReason::Length;
    }
    f.matched_stop = None;
    if let Some(t) = r.routes.as_ref() {
        let keep = (r.prompt_tokens.saturating_sub(1))
            .saturating_sub(t.start_pos())
            .min(t.num_tokens());
        let sliced = t
            .slice_rows(0, keep)
            .map_err(|e| ApiError::internal(format!("trimming routed_experts: {e}")))?;
        r.routes = Some(sliced);
    }
    Ok(f)
}

/// `routed_experts` (base64), its dtype and start in `meta`.
fn routes_meta(
    state: &AppState,
    r: &GenerateResult,
    spec: &ResponseSpec,
    meta: &mut Value,
) -> Result<(), ApiError> {
    let Some(table) = r.routes.as_ref() else {
        if r.finish == FinishReason::Abort {
            // Aborted before any position was captured.
            meta["routed_experts"] = Value::Null;
            return Ok(());
        }
        return Err(ApiError::internal(
            "the engine returned no routes although asked to",
        ));
    };
    meta["routed_experts"] = Value::String(encode_routes(state, table, spec.dtype)?);
    meta["routed_experts_dtype"] = Value::String(spec.dtype.name().to_string());
    meta["routed_experts_start_len"] = json!(table.start_pos());
    Ok(())
}

/// `routed_experts` of one request as SGLang sends it: base64 of its rows × all layers ×
/// `top_k`, in `dtype`.
pub(super) fn encode_routes(
    state: &AppState,
    table: &RouteTable,
    dtype: WireDtype,
) -> Result<String, ApiError> {
    let layout = &state.summary().layout;
    encode_sglang(table, dtype, layout.num_hidden_layers(), Some(layout))
        .map_err(|e| ApiError::internal(format!("encoding routed_experts: {e}")))
}
