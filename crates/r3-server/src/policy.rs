//! The field policy of every request body: which fields r3 implements, which it accepts only
//! at a neutral value (a value that asks for nothing r3 lacks), and which it ignores. Clients
//! such as SGLang's, slime's, AReaL's, verl's and sglang-router send their whole schema with
//! harmless defaults, so a field is refused (400 naming it) only when its value asks for
//! behaviour r3 does not have; fields no schema knows are ignored with a `debug` log.

use r3_text::json_kind;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::ApiError;

/// How the server treats one field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldRule {
    /// Parsed and acted on.
    Implemented,
    /// Accepted at a neutral value: null, false, 0, "", [], {} (or lists/objects of those),
    /// or one of the listed JSON literals (the field's documented default). Anything else is
    /// refused with a 400 naming the field.
    NeutralOnly(&'static [&'static str]),
    /// Accepted whatever the value; it does not change what r3 generates (metadata, routing
    /// hints, logging switches).
    Ignored,
}

use FieldRule::{Ignored, Implemented, NeutralOnly};

/// The fields of one request object.
#[derive(Debug)]
pub struct Schema {
    /// Name used in messages (e.g. `sampling_params`).
    pub name: &'static str,
    /// Every known field and its rule.
    pub fields: &'static [(&'static str, FieldRule)],
}

impl Schema {
    /// The rule of `field`, if the schema knows it.
    pub fn rule(&self, field: &str) -> Option<FieldRule> {
        self.fields
            .iter()
            .find(|(name, _)| *name == field)
            .map(|(_, r)| *r)
    }

    /// Keeps only the implemented fields of `obj`: checks neutral-only ones, drops ignored
    /// and unknown ones (unknown: with a `debug` log).
    pub fn screen(&self, obj: &mut Map<String, Value>) -> Result<(), ApiError> {
        let keys: Vec<String> = obj.keys().cloned().collect();
        for key in keys {
            match self.rule(&key) {
                Some(Implemented) => {}
                Some(Ignored) => {
                    obj.remove(&key);
                }
                Some(NeutralOnly(defaults)) => {
                    let value = obj.remove(&key).unwrap_or(Value::Null);
                    if !is_neutral(&value, defaults) {
                        return Err(ApiError::bad_request(format!(
                            "{}.{key} = {}: r3 does not implement this field; it accepts it only at a neutral value (null, false, 0, empty{})",
                            self.name,
                            short(&value),
                            if defaults.is_empty() {
                                String::new()
                            } else {
                                format!(" or {}", defaults.join(" / "))
                            }
                        )));
                    }
                }
                None => {
                    tracing::debug!(schema = self.name, field = %key, "ignoring an unknown field");
                    obj.remove(&key);
                }
            }
        }
        Ok(())
    }

    /// Screens a JSON object and parses what is left into `T`.
    pub fn parse<T: DeserializeOwned>(&self, value: Value) -> Result<T, ApiError> {
        let Value::Object(mut obj) = value else {
            return Err(ApiError::bad_request(format!(
                "{} must be a JSON object, got {}",
                self.name,
                json_kind(&value)
            )));
        };
        self.screen(&mut obj)?;
        super::fields::from_value_at(Value::Object(obj), self.name)
    }
}

/// Whether `v` asks for nothing: null, false, 0, "", an empty or all-neutral list or object,
/// or equal to one of `defaults` (JSON literals).
pub fn is_neutral(v: &Value, defaults: &[&str]) -> bool {
    let plain = match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(items) => items.iter().all(|x| is_neutral(x, defaults)),
        Value::Object(map) => map.values().all(|x| is_neutral(x, defaults)),
    };
    plain
        || defaults
            .iter()
            .any(|d| serde_json::from_str::<Value>(d).is_ok_and(|d| same_value(&d, v)))
}

/// JSON equality that treats 1 and 1.0 alike.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// A value for a message, cut to a readable length.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        let cut = (0..=80).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        format!("{}…", &s[..cut])
    } else {
        s
    }
}

/// SGLang's `GenerateReqInput` (python/sglang/srt/managers/io_struct.py) plus r3's
/// `routed_experts_dtype` and the `model` field sglang-router adds.
pub static GENERATE: Schema = Schema {
    name: "generate",
    fields: &[
        ("text", Implemented),
        ("input_ids", Implemented),
        ("sampling_params", Implemented),
        ("rid", Implemented),
        ("return_logprob", Implemented),
        ("logprob_start_len", Implemented),
        ("top_logprobs_num", Implemented),
        ("return_text_in_logprobs", Implemented),
        ("stream", Implemented),
        ("return_routed_experts", Implemented),
        ("routed_experts_start_len", Implemented),
        ("routed_experts_dtype", Implemented),
        ("session_id", Ignored),
        ("input_embeds", NeutralOnly(&[])),
        ("image_data", NeutralOnly(&[])),
        ("video_data", NeutralOnly(&[])),
        ("audio_data", NeutralOnly(&[])),
        ("mm_hashes", NeutralOnly(&[])),
        ("mm_content_hashes", NeutralOnly(&[])),
        ("use_audio_in_video", NeutralOnly(&[])),
        ("video_config", NeutralOnly(&[])),
        ("token_ids_logprob", NeutralOnly(&[])),
        ("return_sampling_mask", NeutralOnly(&[])),
        ("return_flat_raw_top_logprobs", NeutralOnly(&[])),
        ("return_flat_raw_top_logprobs_b64", NeutralOnly(&[])),
        ("log_metrics", Ignored),
        ("return_hidden_states", NeutralOnly(&[])),
        ("return_indexer_topk", NeutralOnly(&[])),
        ("modalities", NeutralOnly(&[])),
        ("session_params", NeutralOnly(&[])),
        ("lora_path", NeutralOnly(&[])),
        ("lora_id", NeutralOnly(&[])),
        ("custom_logit_processor", NeutralOnly(&[])),
        ("positional_embed_overrides", NeutralOnly(&[])),
        ("bootstrap_host", NeutralOnly(&[])),
        ("bootstrap_port", NeutralOnly(&[])),
        ("bootstrap_room", NeutralOnly(&[])),
        ("bootstrap_pair_key", NeutralOnly(&[])),
        ("decode_tp_size", NeutralOnly(&[])),
        ("routed_dp_rank", NeutralOnly(&[])),
        ("data_parallel_rank", NeutralOnly(&[])),
        ("disagg_prefill_dp_rank", NeutralOnly(&[])),
        ("kv_router_hint", Ignored),
        ("routing_key", Ignored),
        ("conversation_id", Ignored),
        ("http_worker_ipc", Ignored),
        ("background", NeutralOnly(&[])),
        ("require_reasoning", NeutralOnly(&[])),
        ("max_thinking_tokens", NeutralOnly(&[])),
        ("priority", Ignored),
        ("extra_key", Ignored),
        ("no_logs", Ignored),
        ("custom_labels", Ignored),
        ("return_bytes", NeutralOnly(&[])),
        ("return_entropy", NeutralOnly(&[])),
        ("return_prompt_token_ids", NeutralOnly(&[])),
        ("external_trace_header", Ignored),
        ("received_time", Ignored),
        ("need_wait_for_mm_inputs", NeutralOnly(&[])),
        ("num_items_assigned", NeutralOnly(&[])),
        ("encoder_urls", NeutralOnly(&[])),
        ("max_dynamic_patch", NeutralOnly(&[])),
        ("min_dynamic_patch", NeutralOnly(&[])),
        ("image_max_dynamic_patch", NeutralOnly(&[])),
        ("video_max_dynamic_patch", NeutralOnly(&[])),
        ("images_config", NeutralOnly(&[])),
        ("multi_item_delimiter_indices", NeutralOnly(&[])),
        ("cache_salt", Ignored),
        ("model", Ignored),
    ],
};

/// SGLang's `SamplingParams` (python/sglang/srt/sampling/sampling_params.py) plus r3's
/// `seed` and SGLang's `beam_width`.
pub static SAMPLING: Schema = Schema {
    name: "sampling_params",
    fields: &[
        ("max_new_tokens", Implemented),
        ("stop", Implemented),
        ("stop_token_ids", Implemented),
        ("stop_regex", NeutralOnly(&[])),
        ("temperature", Implemented),
        ("top_p", Implemented),
        ("top_k", Implemented),
        ("min_p", Implemented),
        ("frequency_penalty", Implemented),
        ("presence_penalty", Implemented),
        ("repetition_penalty", Implemented),
        ("min_new_tokens", Implemented),
        ("n", Implemented),
        ("json_schema", NeutralOnly(&[])),
        ("regex", NeutralOnly(&[])),
        ("ebnf", NeutralOnly(&[])),
        ("structural_tag", NeutralOnly(&[])),
        ("ignore_eos", Implemented),
        ("skip_special_tokens", Implemented),
        ("spaces_between_special_tokens", Ignored),
        ("no_stop_trim", Implemented),
        ("custom_params", Ignored),
        ("stream_interval", Ignored),
        ("logit_bias", Implemented),
        ("sampling_seed", Implemented),
        ("seed", Implemented),
        ("beam_width", NeutralOnly(&["1"])),
    ],
};

/// OpenAI's completions request plus the SGLang extensions its `CompletionRequest` accepts.
pub static COMPLETIONS: Schema = Schema {
    name: "completions",
    fields: &[
        ("model", Ignored),
        ("prompt", Implemented),
        ("best_of", NeutralOnly(&["1"])),
        ("echo", Implemented),
        ("frequency_penalty", Implemented),
        ("presence_penalty", Implemented),
        ("logit_bias", Implemented),
        ("logprobs", Implemented),
        ("max_tokens", Implemented),
        ("n", Implemented),
        ("seed", Implemented),
        ("stop", Implemented),
        ("stream", Implemented),
        ("stream_options", Implemented),
        ("suffix", NeutralOnly(&[])),
        ("temperature", Implemented),
        ("top_p", Implemented),
        ("user", Ignored),
        ("top_k", Implemented),
        ("min_p", Implemented),
        ("min_tokens", Implemented),
        ("repetition_penalty", Implemented),
        ("stop_token_ids", Implemented),
        ("no_stop_trim", Implemented),
        ("ignore_eos", Implemented),
        ("skip_special_tokens", Implemented),
        ("spaces_between_special_tokens", Ignored),
        ("continue_final_message", NeutralOnly(&[])),
        ("lora_path", NeutralOnly(&[])),
        ("session_params", NeutralOnly(&[])),
        ("response_format", NeutralOnly(&[])),
        ("regex", NeutralOnly(&[])),
        ("json_schema", NeutralOnly(&[])),
        ("ebnf", NeutralOnly(&[])),
        ("return_hidden_states", NeutralOnly(&[])),
        ("return_routed_experts", Implemented),
        ("routed_experts_start_len", Implemented),
        ("return_cached_tokens_details", NeutralOnly(&[])),
        ("return_token_ids", Implemented),
        ("stop_regex", NeutralOnly(&[])),
        ("session_id", Ignored),
        ("custom_params", Ignored),
        ("custom_logit_processor", NeutralOnly(&[])),
        ("images_config", NeutralOnly(&[])),
        ("rid", Implemented),
        ("extra_key", Ignored),
        ("cache_salt", Ignored),
        ("ngram_corpus_id", Ignored),
        ("priority", Ignored),
        ("custom_labels", Ignored),
        ("bootstrap_host", NeutralOnly(&[])),
        ("bootstrap_port", NeutralOnly(&[])),
        ("bootstrap_room", NeutralOnly(&[])),
        ("data_parallel_rank", NeutralOnly(&[])),
        ("routed_dp_rank", NeutralOnly(&[])),
        ("disagg_prefill_dp_rank", NeutralOnly(&[])),
    ],
};

/// SGLang's `UpdateWeightFromDiskReqInput`.
pub static UPDATE_WEIGHTS: Schema = Schema {
    name: "update_weights_from_disk",
    fields: &[
        ("model_path", Implemented),
        ("load_format", Implemented),
        ("abort_all_requests", Implemented),
        ("weight_version", Implemented),
        ("flush_cache", Ignored),
        ("is_async", NeutralOnly(&[])),
        ("torch_empty_cache", Ignored),
        ("keep_pause", Ignored),
        ("recapture_cuda_graph", Ignored),
        ("token_step", Ignored),
        ("manifest", NeutralOnly(&[])),
        ("rid", Ignored),
        ("http_worker_ipc", Ignored),
    ],
};

#[cfg(test)]
mod tests {
    use super::super::chat::CHAT;
    use super::*;
    use serde_json::json;

    #[test]
    fn neutral_values() {
        for v in [
            json!(null),
            json!(false),
            json!(0),
            json!(0.0),
            json!(""),
            json!([]),
            json!({}),
            json!([null, []]),
            json!({"a": 0}),
        ] {
            assert!(is_neutral(&v, &[]), "{v}");
        }
        for v in [
            json!(true),
            json!(1),
            json!("x"),
            json!(["img"]),
            json!({"a": 1}),
        ] {
            assert!(!is_neutral(&v, &[]), "{v}");
        }
        assert!(is_neutral(&json!(-1), &["-1"]));
        assert!(is_neutral(&json!(1.0), &["1"]));
        assert!(!is_neutral(&json!(2), &["1"]));
    }

    #[test]
    fn screening_keeps_implemented_drops_the_rest_and_names_refused_fields() {
        let mut obj = json!({
            "text": "hi",
            "image_data": [],
            "log_metrics": true,
            "no_such_field": 3,
            "return_entropy": false,
        });
        let map = obj.as_object_mut().expect("object");
        GENERATE.screen(map).expect("neutral values pass");
        assert_eq!(map.keys().collect::<Vec<_>>(), vec!["text"]);
        let mut obj = json!({"lora_path": "adapters/a"});
        let err = GENERATE
            .screen(obj.as_object_mut().expect("object"))
            .expect_err("a LoRA asks for behaviour r3 lacks");
        assert_eq!(err.status.as_u16(), 400);
        assert!(
            err.message.contains("generate.lora_path"),
            "{}",
            err.message
        );
    }

    #[test]
    fn every_schema_lists_each_field_once() {
        for schema in [&GENERATE, &SAMPLING, &COMPLETIONS, &CHAT, &UPDATE_WEIGHTS] {
            let mut names: Vec<&str> = schema.fields.iter().map(|f| f.0).collect();
            names.sort_unstable();
            let n = names.len();
            names.dedup();
            assert_eq!(names.len(), n, "{} repeats a field", schema.name);
        }
    }

    /// The field table of `docs/serving.md` says of every field what this module does with it.
    #[test]
    fn serving_doc_table_matches_the_schemas() {
        let page = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/serving.md"),
        )
        .expect("docs/serving.md in the repository");
        let lines: Vec<&str> = page.lines().collect();
        for schema in [&GENERATE, &SAMPLING, &COMPLETIONS, &CHAT, &UPDATE_WEIGHTS] {
            let head = format!("| `{}` | implemented |", schema.name);
            let at = lines
                .iter()
                .position(|l| l.starts_with(&head))
                .unwrap_or_else(|| panic!("docs/serving.md has no row {head}"));
            for (field, rule) in schema.fields {
                let row = match rule {
                    Implemented => lines[at],
                    NeutralOnly(_) => lines[at + 1],
                    Ignored => lines[at + 2],
                };
                assert!(
                    row.contains(&format!("`{field}`")),
                    "docs/serving.md: {}.{field} is not in its row: {row}",
                    schema.name
                );
            }
        }
    }
}
