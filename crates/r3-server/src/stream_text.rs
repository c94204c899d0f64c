//! The text of streamed answers (`/generate`, `/v1/completions`, `/v1/chat/completions`),
//! decoded incrementally as HF tokenizers' `DecodeStream` and SGLang's detokenizer manager do:
//! each step decodes only a short window of tokens, not the whole output so far, so a stream
//! of L tokens costs O(L) decoding rather than O(L²) (RL outputs run to tens of thousands of
//! tokens). Each piece of text leaves once it can no longer change, so the pieces concatenate
//! to the non-streamed text.

use super::stop::TextOptions;

/// The incremental decoder of one output. `window` starts at the prefix offset: the tokens of
/// the last piece of text emitted (decoding context, so that a decoder that joins tokens with
/// spaces or strips the first token's leading space decodes the new tokens as the whole output
/// would), then, from the read offset `read`, the tokens whose text is not emitted yet.
///
/// A piece is emitted once the window's text extends the context's text and does not end in
/// U+FFFD: a character whose UTF-8 bytes are split across tokens decodes as U+FFFD until its
/// last byte arrives. Since the read offset then falls where the decoded text ends with a
/// whole character, decoding from it gives the same text as decoding from the start (for the
/// byte-level, byte-fallback, word-level and metaspace decoders HF models use).
#[derive(Debug, Default, Clone)]
pub struct DecodeStream {
    /// Tokens from the prefix offset on.
    window: Vec<u32>,
    /// Start of the tokens not emitted yet, within `window`.
    read: usize,
    /// The text of `window[..read]`.
    prefix_text: String,
    /// Tokens pushed in all.
    total: usize,
}

impl DecodeStream {
    /// A decoder that has seen no token.
    pub fn new() -> Self {
        DecodeStream::default()
    }

    /// Adds `tokens` and returns the text that became final, if any. `decode` decodes a slice
    /// of tokens (None: it cannot, and nothing is emitted); it sees only the window, at most
    /// the last piece's tokens, those waiting for a character to complete and `tokens`.
    pub fn push(
        &mut self,
        tokens: &[u32],
        mut decode: impl FnMut(&[u32]) -> Option<String>,
    ) -> Option<String> {
        self.total += tokens.len();
        self.window.extend_from_slice(tokens);
        if self.window.len() == self.read {
            return None;
        }
        let text = decode(&self.window)?;
        if text.len() <= self.prefix_text.len() || text.ends_with(char::REPLACEMENT_CHARACTER) {
            return None;
        }
        // A decoder whose text of the window does not extend the context's (HF's
        // `InvalidPrefix`) waits for more tokens rather than emit text that could change.
        let new = text.strip_prefix(self.prefix_text.as_str())?.to_string();
        let prefix_text = decode(&self.window[self.read..])?;
        self.window.drain(..self.read);
        self.read = self.window.len();
        self.prefix_text = prefix_text;
        Some(new)
    }

    /// Tokens pushed so far.
    pub fn tokens(&self) -> usize {
        self.total
    }

    /// Tokens the next `push` decodes besides its own: the window so far.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }
}

/// The text of one streamed choice: its decoder, the text decoded but held back, and the
/// text sent.
#[derive(Debug, Default, Clone)]
struct ChoiceText {
    decoder: DecodeStream,
    /// Decoded text not sent yet: the end of the text, where a stop string may begin.
    held: String,
    /// Text sent so far.
    sent: String,
}

/// Decoders and sent text of every choice of one streamed answer.
#[derive(Debug, Default)]
pub struct StreamedText {
    choices: Vec<ChoiceText>,
}

/// Characters to hold back at the end of a choice's text: a stop string may begin there
/// (it is trimmed from the text once completed).
pub fn stop_hold(opts: &TextOptions) -> usize {
    opts.stop
        .iter()
        .map(|s| s.chars().count().saturating_sub(1))
        .max()
        .unwrap_or(0)
}

impl StreamedText {
    /// Nothing sent yet for `choices` choices.
    pub fn new(choices: usize) -> Self {
        StreamedText {
            choices: vec![ChoiceText::default(); choices],
        }
    }

    /// Puts `text` before choice `index`'s output (`echo`'s prompt); it leaves with the
    /// choice's first text.
    pub fn start_with(&mut self, index: usize, text: &str) {
        if let Some(c) = self.choices.get_mut(index) {
            c.held.insert_str(0, text);
        }
    }

    /// Adds `tokens` to choice `index` and returns the text that became safe to send, if any:
    /// decoded as [`DecodeStream::push`] says (`decode` decodes a window of tokens), all but
    /// the last `hold` characters.
    pub fn advance(
        &mut self,
        index: usize,
        tokens: &[u32],
        hold: usize,
        decode: impl FnMut(&[u32]) -> Option<String>,
    ) -> Option<String> {
        let c = self.choices.get_mut(index)?;
        if let Some(new) = c.decoder.push(tokens, decode) {
            c.held.push_str(&new);
        }
        let keep_from = match hold {
            0 => c.held.len(),
            _ => c
                .held
                .char_indices()
                .rev()
                .nth(hold - 1)
                .map_or(0, |(at, _)| at),
        };
        if keep_from == 0 {
            return None;
        }
        let out: String = c.held.drain(..keep_from).collect();
        c.sent.push_str(&out);
        Some(out)
    }

    /// Tokens choice `index` has generated so far.
    pub fn tokens(&self, index: usize) -> usize {
        self.choices.get(index).map_or(0, |c| c.decoder.tokens())
    }

    /// The text choice `index` has sent so far.
    pub fn sent(&self, index: usize) -> &str {
        self.choices.get(index).map_or("", |c| c.sent.as_str())
    }

    /// The part of `full` (choice `index`'s final text) not sent yet; all of it, with a
    /// warning, if what was sent is not its prefix.
    pub fn rest<'a>(&self, index: usize, full: &'a str) -> &'a str {
        full.strip_prefix(self.sent(index)).unwrap_or_else(|| {
            tracing::warn!(index, "streamed text is not a prefix of the final text");
            full
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level decoder: ids as `w<i>` joined by spaces (HF's default without a decoder).
    fn words(ids: &[u32]) -> Option<String> {
        Some(
            ids.iter()
                .map(|i| format!("w{i}"))
                .collect::<Vec<_>>()
                .join(" "),
        )
    }

    #[test]
    fn deltas_concatenate_to_the_final_text_and_hold_back_a_possible_stop() {
        let mut s = StreamedText::new(1);
        let mut sent = String::new();
        for t in [1u32, 2, 3] {
            if let Some(d) = s.advance(0, &[t], 2, words) {
                sent.push_str(&d);
            }
        }
        // "w1 w2 w3" minus the 2 held characters.
        assert_eq!(sent, "w1 w2 ");
        assert_eq!(s.sent(0), "w1 w2 ");
        assert_eq!(s.tokens(0), 3);
        assert_eq!(s.rest(0, "w1 w2 w3"), "w3");
        assert_eq!(s.rest(0, "other"), "other");
        assert_eq!(s.advance(5, &[1], 0, words), None);
    }

    #[test]
    fn an_incomplete_character_waits_for_its_last_byte() {
        // Token 1 holds the first byte of "é", token 2 the second.
        let decode = |ids: &[u32]| {
            Some(match ids {
                [1] => "ab\u{FFFD}".to_string(),
                [1, 2] => "abé".to_string(),
                _ => return None,
            })
        };
        let mut s = StreamedText::new(1);
        assert_eq!(s.advance(0, &[1], 0, decode), None);
        assert_eq!(s.advance(0, &[2], 0, decode).as_deref(), Some("abé"));
    }

    #[test]
    fn the_echoed_prompt_leaves_first_and_counts_toward_the_hold() {
        let mut s = StreamedText::new(1);
        s.start_with(0, "p ");
        assert_eq!(s.advance(0, &[1], 1, words).as_deref(), Some("p w"));
        assert_eq!(s.rest(0, "p w1"), "1");
    }

    #[test]
    fn the_window_keeps_only_the_last_piece_and_what_waits() {
        let mut d = DecodeStream::new();
        for t in 0..100u32 {
            let _ = d.push(&[t], words);
        }
        // The last piece's one token: the window does not grow with the output.
        assert_eq!(d.window_len(), 1);
        assert_eq!(d.tokens(), 100);
    }
}
