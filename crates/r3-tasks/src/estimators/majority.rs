//! Majority vote over the extracted answers of one prompt's samples (`maj@k`).
//!
//! Tie rule: among the answers given most often, the one whose first occurrence comes first
//! in sample order wins (what Python's `Counter.most_common` returns, so verl's `maj@N`
//! agrees). Samples without an extracted answer do not vote; when none has one, there is no
//! majority and the prompt counts as wrong.

use std::collections::HashMap;

/// Index of the first sample carrying the winning answer; `None` when no sample has one.
pub fn majority_index(answers: &[Option<String>]) -> Option<usize> {
    // answer -> (count, first index)
    let mut tally: HashMap<&str, (usize, usize)> = HashMap::new();
    for (i, a) in answers.iter().enumerate() {
        if let Some(a) = a {
            tally.entry(a.as_str()).or_insert((0, i)).0 += 1;
        }
    }
    tally
        .values()
        .max_by(|(ca, ia), (cb, ib)| ca.cmp(cb).then(ib.cmp(ia)))
        .map(|&(_, first)| first)
}

/// Whether the majority answer is correct: `correct[i]` of [`majority_index`]; false when
/// no sample has an answer. `answers` and `correct` describe the same samples in order.
pub fn majority_correct(answers: &[Option<String>], correct: &[bool]) -> bool {
    majority_index(answers).is_some_and(|i| correct.get(i).copied().unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[Option<&str>]) -> Vec<Option<String>> {
        v.iter().map(|a| a.map(str::to_string)).collect()
    }

    #[test]
    fn plain_majority() {
        let a = s(&[Some("3"), Some("5"), Some("5"), None, Some("3"), Some("5")]);
        assert_eq!(majority_index(&a), Some(1));
        assert!(majority_correct(
            &a,
            &[false, true, true, false, false, true]
        ));
        assert!(!majority_correct(
            &a,
            &[true, false, false, false, true, false]
        ));
    }

    #[test]
    fn ties_go_to_the_first_seen_answer() {
        // "7" and "9" twice each; "9" appears first.
        let a = s(&[None, Some("9"), Some("7"), Some("7"), Some("9")]);
        assert_eq!(majority_index(&a), Some(1));
        let b = s(&[Some("7"), Some("9"), Some("9"), Some("7")]);
        assert_eq!(majority_index(&b), Some(0));
        // Missing answers do not vote, even when they are the most common outcome.
        let c = s(&[None, None, None, Some("4")]);
        assert_eq!(majority_index(&c), Some(3));
        assert_eq!(majority_index(&s(&[None, None])), None);
        assert!(!majority_correct(&s(&[None, None]), &[true, true]));
    }
}
