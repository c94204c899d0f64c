//! How many tokens a generating request may hold in flight, read from its JSON body before
//! the handler runs: for each prompt, its tokens plus `n` × the tokens it may generate
//! (`max_new_tokens` clipped as the engine clips it: by the server's `--max-new-tokens` and
//! by the context left after the prompt). Chat requests count the tokens of their messages'
//! text (the chat template's few framing tokens are not counted). A body that is not valid
//! JSON counts 0 tokens: its handler refuses it with a precise 4xx anyway.

use serde_json::Value;

use super::text::TextCodec;
use super::ServerLimits;

/// The generating endpoints whose requests the limits count.
pub const GENERATING_PATHS: &[&str] = &["/generate", "/v1/completions", "/v1/chat/completions"];

/// What the count needs besides the body.
#[derive(Clone, Copy)]
pub struct TokenContext<'a> {
    /// The tokenizer (text prompts count their tokens; without one, their bytes).
    pub text: Option<&'a TextCodec>,
    /// The server's request limits (`max_new_tokens` cap and default).
    pub limits: &'a ServerLimits,
    /// The model's context (`max_position_embeddings`).
    pub context: usize,
}

impl TokenContext<'_> {
    /// Tokens of one text prompt (with the special tokens a prompt's encoding adds).
    fn text_tokens(&self, s: &str) -> usize {
        self.tokens_of(s, TextCodec::encode_prompt)
    }

    /// Tokens of one chat message's text (encoded as the rendered template is, without
    /// added special tokens).
    fn message_tokens(&self, s: &str) -> usize {
        self.tokens_of(s, TextCodec::encode)
    }

    /// Tokens of `s` as `encode` encodes it.
    fn tokens_of(
        &self,
        s: &str,
        encode: fn(&TextCodec, &str) -> Result<Vec<u32>, super::error::ApiError>,
    ) -> usize {
        match self.text.map(|codec| encode(codec, s)) {
            Some(Ok(ids)) => ids.len(),
            // No tokenizer (the handler refuses text) or a text it cannot encode: bytes
            // bound the token count of byte-level tokenizers from above.
            _ => s.len(),
        }
    }

    /// Tokens of one prompt and its `n` samples of at most `max_new` new tokens each.
    fn sequence_tokens(&self, prompt: usize, n: usize, max_new: usize) -> usize {
        let room = self.context.saturating_sub(prompt).max(1);
        let new = max_new.max(1).min(self.limits.max_new_tokens).min(room);
        prompt.saturating_add(n.saturating_mul(new))
    }
}

/// Tokens the request to `path` with `body` may hold in flight (0 for other paths).
pub fn tokens_in_flight(path: &str, body: &Value, ctx: &TokenContext<'_>) -> usize {
    match path {
        "/generate" => generate_tokens(body, ctx),
        "/v1/completions" => completion_tokens(body, ctx),
        "/v1/chat/completions" => chat_tokens(body, ctx),
        _ => 0,
    }
}

/// A non-negative integer field, or None.
fn count(v: &Value, field: &str) -> Option<usize> {
    v.get(field)
        .and_then(Value::as_u64)
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// Prompt lengths of SGLang's `input_ids` / OpenAI's `prompt`: a string, a list of strings,
/// a list of ids, or a list of id lists.
fn prompt_lengths(v: &Value, ctx: &TokenContext<'_>) -> Vec<usize> {
    match v {
        Value::String(s) => vec![ctx.text_tokens(s)],
        Value::Array(items) if items.iter().all(Value::is_number) => vec![items.len()],
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => ctx.text_tokens(s),
                Value::Array(ids) => ids.len(),
                _ => 0,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// SGLang `/generate`: `input_ids` or `text`, `sampling_params` one object or one per prompt.
fn generate_tokens(body: &Value, ctx: &TokenContext<'_>) -> usize {
    let prompts = match (body.get("input_ids"), body.get("text")) {
        (Some(ids), _) if !ids.is_null() => prompt_lengths(ids, ctx),
        (_, Some(text)) => prompt_lengths(text, ctx),
        _ => Vec::new(),
    };
    let sampling = body.get("sampling_params");
    let default_new = ctx.limits.default_max_new_tokens;
    prompts
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let sp = match sampling {
                Some(Value::Array(items)) => items.get(i),
                other => other,
            };
            let n = sp.and_then(|s| count(s, "n")).unwrap_or(1);
            // An explicit null asks for the rest of the context (SGLang's None).
            let new = match sp.and_then(|s| s.get("max_new_tokens")) {
                Some(Value::Null) => usize::MAX,
                _ => sp
                    .and_then(|s| count(s, "max_new_tokens"))
                    .unwrap_or(default_new),
            };
            ctx.sequence_tokens(len, n, new)
        })
        .fold(0usize, usize::saturating_add)
}

/// OpenAI `/v1/completions`: `prompt`, `max_tokens` (OpenAI's default 16), `n`.
fn completion_tokens(body: &Value, ctx: &TokenContext<'_>) -> usize {
    let prompts = body
        .get("prompt")
        .map(|p| prompt_lengths(p, ctx))
        .unwrap_or_default();
    let n = count(body, "n").unwrap_or(1);
    let new = count(body, "max_tokens").unwrap_or(16);
    prompts
        .iter()
        .map(|&len| ctx.sequence_tokens(len, n, new))
        .fold(0usize, usize::saturating_add)
}

/// OpenAI `/v1/chat/completions`: `input_ids`, else the text of `messages` (string contents
/// and text parts); `max_completion_tokens` or `max_tokens` (none: the rest of the context);
/// `n`.
fn chat_tokens(body: &Value, ctx: &TokenContext<'_>) -> usize {
    let n = count(body, "n").unwrap_or(1);
    let new = count(body, "max_completion_tokens")
        .or_else(|| count(body, "max_tokens"))
        .unwrap_or(usize::MAX);
    if let Some(ids) = body.get("input_ids").and_then(Value::as_array) {
        return ctx.sequence_tokens(ids.len(), n, new);
    }
    let mut prompt = 0usize;
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match m.get("content") {
            Some(Value::String(s)) => prompt = prompt.saturating_add(ctx.message_tokens(s)),
            Some(Value::Array(parts)) => {
                for text in parts.iter().filter_map(|p| p.get("text")?.as_str()) {
                    prompt = prompt.saturating_add(ctx.message_tokens(text));
                }
            }
            _ => {}
        }
    }
    ctx.sequence_tokens(prompt, n, new)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ctx(limits: &ServerLimits) -> TokenContext<'_> {
        TokenContext {
            text: None,
            limits,
            context: 100,
        }
    }

    #[test]
    fn generate_counts_prompts_plus_n_times_clipped_new_tokens() {
        let limits = ServerLimits {
            max_new_tokens: 50,
            default_max_new_tokens: 7,
            ..ServerLimits::default()
        };
        let c = ctx(&limits);
        // One prompt of 3 ids, n = 4, 10 new tokens: 3 + 4 * 10.
        let one =
            json!({"input_ids": [1, 2, 3], "sampling_params": {"n": 4, "max_new_tokens": 10}});
        assert_eq!(tokens_in_flight("/generate", &one, &c), 43);
        // A batch with per-prompt params; the second asks for 1000, clipped to the server's
        // 50; the first uses the default 7: (2 + 7) + (5 + 50).
        let batch = json!({"input_ids": [[1, 2], [1, 2, 3, 4, 5]],
                           "sampling_params": [{}, {"max_new_tokens": 1000}]});
        assert_eq!(tokens_in_flight("/generate", &batch, &c), 64);
        // Context left bounds the new tokens: 90 + (100 - 90).
        let long = json!({"input_ids": vec![1; 90], "sampling_params": {"max_new_tokens": 40}});
        assert_eq!(tokens_in_flight("/generate", &long, &c), 100);
        // Text without a tokenizer counts its bytes: "hello" 5 + 7.
        assert_eq!(
            tokens_in_flight("/generate", &json!({"text": "hello"}), &c),
            12
        );
    }

    #[test]
    fn openai_bodies_use_their_defaults() {
        let limits = ServerLimits {
            default_max_new_tokens: 30,
            ..ServerLimits::default()
        };
        let c = ctx(&limits);
        // Completions default max_tokens 16, two prompts, n = 2: 2 * (4 + 2 * 16).
        let comp = json!({"prompt": [[1, 2, 3, 4], [5, 6, 7, 8]], "n": 2});
        assert_eq!(tokens_in_flight("/v1/completions", &comp, &c), 72);
        // Chat: "abc" + "de" = 5 bytes, max_completion_tokens wins over max_tokens.
        let chat = json!({"messages": [{"role": "user", "content": "abc"},
                                       {"role": "user", "content": [{"type": "text", "text": "de"}]}],
                          "max_tokens": 9, "max_completion_tokens": 3});
        assert_eq!(tokens_in_flight("/v1/chat/completions", &chat, &c), 8);
        assert_eq!(tokens_in_flight("/health", &chat, &c), 0);
    }

    /// No client cap (chat without `max_tokens`, `/generate` with `"max_new_tokens": null`)
    /// counts what the server's cap and the context leave; chat's `input_ids` are its prompt.
    #[test]
    fn no_client_cap_counts_the_servers() {
        let limits = ServerLimits {
            max_new_tokens: 50,
            default_max_new_tokens: 7,
            ..ServerLimits::default()
        };
        let c = ctx(&limits);
        let chat = json!({"messages": [{"role": "user", "content": "abcdefgh"}],
                          "input_ids": [1, 2, 3]});
        assert_eq!(tokens_in_flight("/v1/chat/completions", &chat, &c), 53);
        let null = json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": null}});
        assert_eq!(tokens_in_flight("/generate", &null, &c), 52);
    }
}
