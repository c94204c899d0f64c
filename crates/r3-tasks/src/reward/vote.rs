//! The answer a response votes for in a majority vote (`maj@k`), in a canonical form so
//! that answers the reward judges equal vote together: `math` — the extracted final answer
//! as an exact rational `num/den` when it is a number (`1,000`, `1000.0` and `$1000` are one
//! vote), else as normalised text; `exact` — the trimmed response; `arith` — the integer
//! after the first `#`.

use crate::math_answer::{extract_math_answer, normalise_text, parse_number};
use crate::reward::extract_answer;

/// The `math` reward's answer of `response`, canonical; `None` when it has none.
pub fn math_vote_key(response: &str) -> Option<String> {
    let (answer, _) = extract_math_answer(response)?;
    Some(match parse_number(&answer) {
        Some(r) => format!("{}/{}", r.num, r.den),
        None => normalise_text(&answer),
    })
}

/// The `exact` reward's answer: the trimmed response (an empty one votes for nothing).
pub fn exact_vote_key(response: &str) -> Option<String> {
    let t = response.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// The `arith` reward's answer: the integer after the first `#`.
pub fn arith_vote_key(response: &str) -> Option<String> {
    extract_answer(response).map(|a| a.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::answers::math_reward;

    #[test]
    fn equal_answers_vote_together() {
        let a = math_vote_key("so 1,000 apples\n#### 1,000").unwrap();
        let b = math_vote_key("#### 1000.0").unwrap();
        let c = math_vote_key("the answer is \\boxed{1000}").unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_ne!(a, math_vote_key("#### 100").unwrap());
        assert_eq!(math_vote_key("no number here"), None);
        // A key agrees with the reward: equal keys, equal verdicts.
        for r in ["#### 1,000", "#### 1000.0", "\\boxed{1000}"] {
            assert_eq!(math_reward(r, "1000"), 1.0);
        }
        assert_eq!(arith_vote_key("3*4=12#12"), Some("12".into()));
        assert_eq!(arith_vote_key("12"), None);
        assert_eq!(exact_vote_key("  yes "), Some("yes".into()));
        assert_eq!(exact_vote_key("  "), None);
    }

    #[test]
    fn a_hashes_line_with_words_votes_for_its_number() {
        let key = math_vote_key("#### 42 dollars").unwrap();
        assert_eq!(key, "42/1");
        for r in [
            "#### 42 apples.",
            "\\boxed{42}",
            "The answer is 42 dollars.",
        ] {
            assert_eq!(math_vote_key(r).as_deref(), Some(key.as_str()), "{r:?}");
        }
        assert_eq!(math_vote_key("#### 50%"), math_vote_key("\\boxed{50\\%}"));
        assert_ne!(math_vote_key("#### 4 5"), math_vote_key("#### 45"));
        assert_ne!(math_vote_key("\\boxed{3 1/2}"), math_vote_key("#### 15.5"));
        // equal keys, equal verdicts
        for r in ["#### 42 dollars", "#### 42 apples.", "\\boxed{42}"] {
            assert_eq!(math_reward(r, "42"), 1.0, "{r:?}");
        }
    }
}
