//! Majority vote over the extracted answers of one prompt's samples (`maj@k`).
//!
//! Every sample votes, as in verl and lighteval: a sample without an extracted answer votes
//! for "no answer" (verl's math reward extracts `"[INVALID]"` for it, and `calc_maj_val`
//! counts that key like any other; lighteval's `MajAtN` takes `max(all_answers,
//! key=all_answers.count)` over all `n` predictions). When "no answer" wins, the prompt
//! counts as wrong. Tie rule: among the votes cast most often, the one whose first occurrence
//! comes first in sample order wins, and its value is that first sample's (verl's
//! `max(vote2cnt, key=vote2cnt.get)` over insertion order and `vote2vals[maj_vote][0]`,
//! lighteval's `max` over the list).

use std::collections::HashMap;

/// Index of the first sample of the winning vote (a sample without an answer when "no
/// answer" wins); `None` only when there are no samples.
pub fn majority_index(answers: &[Option<String>]) -> Option<usize> {
    // vote (None: no answer) -> (count, first index)
    let mut tally: HashMap<Option<&str>, (usize, usize)> = HashMap::new();
    for (i, a) in answers.iter().enumerate() {
        tally.entry(a.as_deref()).or_insert((0, i)).0 += 1;
    }
    tally
        .values()
        .max_by(|(ca, ia), (cb, ib)| ca.cmp(cb).then(ib.cmp(ia)))
        .map(|&(_, first)| first)
}

/// Whether the majority answer is correct: `correct[i]` of [`majority_index`]; false when
/// "no answer" wins or there are no samples. `answers` and `correct` describe the same
/// samples in order.
pub fn majority_correct(answers: &[Option<String>], correct: &[bool]) -> bool {
    majority_index(answers)
        .is_some_and(|i| answers[i].is_some() && correct.get(i).copied().unwrap_or(false))
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
    fn ties_go_to_the_first_seen_vote() {
        // "7" and "9" twice each; "9" appears first (the one None is a third, smaller vote).
        let a = s(&[None, Some("9"), Some("7"), Some("7"), Some("9")]);
        assert_eq!(majority_index(&a), Some(1));
        let b = s(&[Some("7"), Some("9"), Some("9"), Some("7")]);
        assert_eq!(majority_index(&b), Some(0));
        // "no answer" ties with "4" and came first: it wins, the prompt is wrong.
        let c = s(&[None, Some("4"), Some("4"), None]);
        assert_eq!(majority_index(&c), Some(0));
        assert!(!majority_correct(&c, &[false, true, true, false]));
        assert_eq!(majority_index(&[]), None);
    }

    #[test]
    fn missing_answers_vote_as_in_verl_and_lighteval() {
        // verl: vote2cnt {"[INVALID]": 3, "4": 1} -> "[INVALID]", val 0; lighteval the same.
        let c = s(&[None, None, None, Some("4")]);
        assert_eq!(majority_index(&c), Some(0));
        assert!(!majority_correct(&c, &[false, false, false, true]));
        // A minority of missing answers changes nothing.
        let d = s(&[None, Some("4"), None, Some("4"), Some("4")]);
        assert_eq!(majority_index(&d), Some(1));
        assert!(majority_correct(&d, &[false, true, false, true, true]));
        // Only missing answers: "no answer" wins, wrong whatever `correct` says.
        assert_eq!(majority_index(&s(&[None, None])), Some(0));
        assert!(!majority_correct(&s(&[None, None]), &[true, true]));
    }
}
