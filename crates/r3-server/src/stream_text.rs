//! The text of OpenAI-format streams (`/v1/completions`, `/v1/chat/completions`): per
//! choice the tokens generated so far and the text already sent, so that each chunk carries
//! only text that can no longer change and the chunks concatenate to the non-streamed text.

use super::stop::TextOptions;

/// Tokens and sent text of every choice of one streamed answer.
#[derive(Debug, Default)]
pub struct StreamedText {
    /// Text sent so far per choice.
    sent: Vec<String>,
    /// Tokens generated so far per choice.
    so_far: Vec<Vec<u32>>,
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
            sent: vec![String::new(); choices],
            so_far: vec![Vec::new(); choices],
        }
    }

    /// Adds `tokens` to choice `index` and returns the text that became safe to send, if any.
    /// `render` is the choice's whole text for the tokens so far; its last `hold` characters
    /// and a trailing incomplete UTF-8 character (decoded as U+FFFD) are held back.
    pub fn advance(
        &mut self,
        index: usize,
        tokens: &[u32],
        hold: usize,
        render: impl FnOnce(&[u32]) -> Option<String>,
    ) -> Option<String> {
        let cum = self.so_far.get_mut(index)?;
        cum.extend_from_slice(tokens);
        let text = render(cum)?;
        let mut stable: Vec<char> = text.chars().collect();
        stable.truncate(stable.len().saturating_sub(hold));
        while stable.last() == Some(&char::REPLACEMENT_CHARACTER) {
            stable.pop();
        }
        let stable: String = stable.into_iter().collect();
        let sent = self.sent.get_mut(index)?;
        let new = stable.strip_prefix(sent.as_str())?.to_string();
        if new.is_empty() {
            return None;
        }
        sent.push_str(&new);
        Some(new)
    }

    /// Tokens choice `index` has generated so far.
    pub fn tokens(&self, index: usize) -> usize {
        self.so_far.get(index).map_or(0, Vec::len)
    }

    /// The part of `full` (choice `index`'s final text) not sent yet; all of it, with a
    /// warning, if what was sent is not its prefix.
    pub fn rest<'a>(&self, index: usize, full: &'a str) -> &'a str {
        let sent = self.sent.get(index).map_or("", String::as_str);
        full.strip_prefix(sent).unwrap_or_else(|| {
            tracing::warn!(index, "streamed text is not a prefix of the final text");
            full
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_concatenate_to_the_final_text_and_hold_back_a_possible_stop() {
        let words = |ids: &[u32]| {
            Some(
                ids.iter()
                    .map(|i| format!("w{i}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        };
        let mut s = StreamedText::new(1);
        let mut sent = String::new();
        for t in [1u32, 2, 3] {
            if let Some(d) = s.advance(0, &[t], 2, words) {
                sent.push_str(&d);
            }
        }
        // "w1 w2 w3" minus the 2 held characters.
        assert_eq!(sent, "w1 w2 ");
        assert_eq!(s.rest(0, "w1 w2 w3"), "w3");
        assert_eq!(s.rest(0, "other"), "other");
        assert_eq!(s.advance(5, &[1], 0, words), None);
    }

    #[test]
    fn an_incomplete_character_is_held_back() {
        let mut s = StreamedText::new(1);
        let d = s.advance(0, &[1], 0, |_| Some("ab\u{FFFD}".to_string()));
        assert_eq!(d.as_deref(), Some("ab"));
        assert_eq!(
            s.advance(0, &[2], 0, |_| Some("abé".to_string()))
                .as_deref(),
            Some("é")
        );
    }
}
