//! SGLang's native `/generate` as the trainer speaks it: the request body of one engine
//! request, and the checked decoding of the reply into the engine's [`GenerateResult`].
//!
//! A reply is trusted only after every check passes: the token counts match the request,
//! every id is in the vocabulary, each log-prob entry names its output token, and
//! `routed_experts` decodes (r3-routing's SGLang codec with the model's layer layout: ids
//! in range, dense columns empty) to exactly `prompt + output − 1 − start_len` rows. A
//! reply that fails any check is an error, never a silently replayed route table.

use r3_rollout::{FinishReason, GenerateRequest, GenerateResult};
use r3_routing::wire::sglang::decode_sglang_response;
use serde_json::{json, Value};

use crate::config::ModelFacts;
use crate::error::{FleetError, Result};

/// The `/generate` body of one request: token prompt, the sampling parameters the
/// in-process engine would use (seed included), log-probs and routes asked for.
/// `ignore_eos` travels as SGLang's flag: a worker (SGLang or r3) then ends the request at
/// no stop id, the ones sent included, and still masks them until `min_new_tokens`, as the
/// in-process engine does.
pub fn generate_body(req: &GenerateRequest, rid: &str) -> Value {
    let s = &req.sampling;
    // SGLang writes "no top-k cut" as -1; the engine as 0.
    let top_k = if s.top_k == 0 { -1 } else { s.top_k as i64 };
    let mut sampling = json!({
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": top_k,
        "min_p": s.min_p,
        "max_new_tokens": s.max_new_tokens,
        "min_new_tokens": s.min_new_tokens,
        "stop_token_ids": s.stop_token_ids,
        "ignore_eos": s.ignore_eos,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "sampling_seed": s.seed,
    });
    if !s.logit_bias.is_empty() {
        let bias: serde_json::Map<String, Value> = s
            .logit_bias
            .iter()
            .map(|&(t, b)| (t.to_string(), json!(b)))
            .collect();
        sampling["logit_bias"] = Value::Object(bias);
    }
    json!({
        "rid": rid,
        "input_ids": req.input_ids,
        "sampling_params": sampling,
        "return_logprob": true,
        "logprob_start_len": -1,
        "return_routed_experts": req.return_routes,
        "routed_experts_start_len": req.routed_experts_start_len,
    })
}

/// A checked reply: the engine-shaped result and the weight version it came from.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Tokens, log-probs, finish reason and routes (versions set to the reply's).
    pub result: GenerateResult,
    /// `meta_info.weight_version` as a number.
    pub version: u64,
}

/// Parses a weight version label (`"3"`); r3 trainers label versions by step number.
pub fn parse_version(v: &Value) -> Option<u64> {
    match v {
        Value::String(s) => s.trim().parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// Decodes and checks the reply to `req` from `url`.
pub fn decode_reply(
    url: &str,
    reply: &Value,
    req: &GenerateRequest,
    model: &ModelFacts,
) -> Result<Reply> {
    let bad = |reason: String| FleetError::BadReply {
        url: url.to_string(),
        reason,
    };
    let reply = match reply {
        Value::Array(items) if items.len() == 1 => &items[0],
        Value::Array(items) => {
            return Err(bad(format!("{} results for one prompt", items.len())));
        }
        other => other,
    };
    let meta = reply
        .get("meta_info")
        .ok_or_else(|| bad("no meta_info".into()))?;
    let output_ids = token_ids(reply.get("output_ids"), model.vocab_size).map_err(&bad)?;
    let finish = finish_reason(meta.get("finish_reason"), &output_ids, req).map_err(&bad)?;
    if output_ids.len() > req.sampling.max_new_tokens {
        return Err(bad(format!(
            "{} output tokens, max_new_tokens is {}",
            output_ids.len(),
            req.sampling.max_new_tokens
        )));
    }
    let count = |name: &str| meta.get(name).and_then(Value::as_u64).map(|n| n as usize);
    if count("prompt_tokens") != Some(req.input_ids.len()) {
        return Err(bad(format!(
            "prompt_tokens {:?}, the prompt has {} tokens",
            meta.get("prompt_tokens"),
            req.input_ids.len()
        )));
    }
    if count("completion_tokens") != Some(output_ids.len()) {
        return Err(bad(format!(
            "completion_tokens {:?}, output_ids has {}",
            meta.get("completion_tokens"),
            output_ids.len()
        )));
    }
    let output_logprobs = logprobs(meta.get("output_token_logprobs"), &output_ids).map_err(&bad)?;
    let version = meta
        .get("weight_version")
        .and_then(parse_version)
        .ok_or_else(|| {
            bad(format!(
                "meta_info.weight_version {:?} is not a step number",
                meta.get("weight_version")
            ))
        })?;
    let routes = if req.return_routes {
        decode_routes(meta, req, output_ids.len(), finish, model, version).map_err(&bad)?
    } else {
        None
    };
    Ok(Reply {
        result: GenerateResult {
            id: 0,
            prompt_tokens: req.input_ids.len(),
            output_ids,
            output_logprobs,
            output_top_logprobs: Vec::new(),
            finish,
            cached_tokens: count("cached_tokens").unwrap_or(0),
            routes,
            weight_version: version,
            prompt_logprobs: None,
        },
        version,
    })
}

/// The reply's route table: exactly `prompt + output − 1 − start_len` rows from
/// `start_len`, or for an aborted request the rows fed before the abort (none, when the
/// worker sent `null`), never more.
fn decode_routes(
    meta: &Value,
    req: &GenerateRequest,
    outputs: usize,
    finish: FinishReason,
    model: &ModelFacts,
    version: u64,
) -> std::result::Result<Option<r3_routing::RouteTable>, String> {
    let start = req.routed_experts_start_len;
    let total = req.input_ids.len() + outputs;
    let expected = total
        .checked_sub(1 + start)
        .ok_or_else(|| format!("routed_experts_start_len {start} past the sequence"))?;
    let shape = model.wire_shape(start).map_err(|e| e.to_string())?;
    let aborted = finish == FinishReason::Abort;
    let mut table = if aborted {
        match meta.get("routed_experts") {
            None | Some(Value::Null) => return Ok(None),
            // The token counts give the full length; an aborted piece has fewer rows.
            Some(payload) => {
                let only_routes = json!({
                    "routed_experts": payload,
                    "routed_experts_dtype": meta.get("routed_experts_dtype").cloned().unwrap_or(Value::Null),
                });
                decode_sglang_response(&only_routes, &shape)
            }
        }
    } else {
        decode_sglang_response(meta, &shape)
    }
    .map_err(|e| format!("routed_experts: {e}"))?;
    let rows_ok = if aborted {
        table.num_tokens() <= expected
    } else {
        table.num_tokens() == expected
    };
    if !rows_ok || table.start_pos() != start {
        return Err(format!(
            "routed_experts has {} rows from position {}, expected {}{expected} (tokens {total} - 1 - start_len {start})",
            table.num_tokens(),
            table.start_pos(),
            if aborted { "at most " } else { "" },
        ));
    }
    table.set_version_all(version);
    Ok(Some(table))
}

/// `output_ids`: a list of ids below the vocabulary size.
fn token_ids(v: Option<&Value>, vocab: usize) -> std::result::Result<Vec<u32>, String> {
    let items = v
        .and_then(Value::as_array)
        .ok_or("output_ids is missing or not a list")?;
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64()
                .filter(|&t| (t as usize) < vocab)
                .map(|t| t as u32)
                .ok_or_else(|| format!("output_ids[{i}] = {t} is not a token id below {vocab}"))
        })
        .collect()
}

/// The finish reason, consistent with the output: `stop` ends with a requested stop id, and
/// a request that ignores its stop ids (`ignore_eos`) cannot end with one.
fn finish_reason(
    v: Option<&Value>,
    output: &[u32],
    req: &GenerateRequest,
) -> std::result::Result<FinishReason, String> {
    let kind = v
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .ok_or("meta_info.finish_reason.type is missing")?;
    match kind {
        "stop" => {
            let last = *output.last().ok_or("finish `stop` with no output token")?;
            if req.sampling.ignore_eos {
                return Err(format!(
                    "finish `stop` at token {last}, but the request sets ignore_eos: no stop \
                     id may end it"
                ));
            }
            if !req.sampling.stops_at(last) {
                return Err(format!(
                    "finish `stop` but the last token {last} is not a requested stop id"
                ));
            }
            Ok(FinishReason::Stop { token: last })
        }
        // The server may clip the budget to the context left, so fewer tokens are fine.
        "length" => Ok(FinishReason::Length),
        "abort" => Ok(FinishReason::Abort),
        other => Err(format!("unknown finish reason {other:?}")),
    }
}

/// `output_token_logprobs`: one `[logprob, id, text]` per output token, id matching.
fn logprobs(v: Option<&Value>, output: &[u32]) -> std::result::Result<Vec<f32>, String> {
    let items = v
        .and_then(Value::as_array)
        .ok_or("meta_info.output_token_logprobs is missing")?;
    if items.len() != output.len() {
        return Err(format!(
            "{} output_token_logprobs for {} output tokens",
            items.len(),
            output.len()
        ));
    }
    items
        .iter()
        .zip(output)
        .enumerate()
        .map(|(i, (e, &id))| {
            let lp = e.get(0).and_then(Value::as_f64);
            let tid = e.get(1).and_then(Value::as_u64);
            match (lp, tid) {
                (Some(lp), Some(t)) if t == u64::from(id) && lp.is_finite() && lp <= 1e-6 => {
                    Ok(lp as f32)
                }
                _ => Err(format!(
                    "output_token_logprobs[{i}] = {e} is not [logprob <= 0, {id}, ..]"
                )),
            }
        })
        .collect()
}
