//! Answer extraction and exact-match reward.

use r3_tasks::{extract_answer, judge, RewardConfig, Verdict};

#[test]
fn extracts_the_number_after_the_first_hash() {
    assert_eq!(extract_answer("7*3=21;12+21=33#33"), Some(33));
    assert_eq!(extract_answer("3-7=-4#-4"), Some(-4));
    assert_eq!(extract_answer("#0"), Some(0));
    assert_eq!(extract_answer("#007"), Some(7));
    assert_eq!(extract_answer("1+1=2#2;junk#5"), Some(2), "first # wins");
    assert_eq!(extract_answer("#12abc"), Some(12), "trailing text ignored");
    assert_eq!(
        extract_answer("é漢#7\n"),
        Some(7),
        "non-ascii before is fine"
    );
    assert_eq!(
        extract_answer("#999999999999999999"),
        Some(999_999_999_999_999_999)
    );
}

#[test]
fn garbage_gives_none() {
    for s in [
        "",
        "33",
        "7*3=21",
        "#",
        "#-",
        "#--3",
        "# 5",
        "#+5",
        "#a1",
        "#9999999999999999999", // 19 digits: refused, never overflows
        "#99999999999999999999999999999999",
        "#漢",
    ] {
        assert_eq!(extract_answer(s), None, "{s:?}");
    }
}

#[test]
fn verdicts_and_rewards() {
    assert_eq!(judge("1+2=3#3", 3), Verdict::Correct);
    assert_eq!(judge("1+2=4#4", 3), Verdict::Wrong);
    assert_eq!(judge("1+2=3", 3), Verdict::Unparsed);
    let exact = RewardConfig::default();
    assert_eq!(exact.score("1+2=3#3", 3), 1.0);
    assert_eq!(exact.score("1+2=4#4", 3), 0.0);
    assert_eq!(exact.score("zzz", 3), 0.0);
    let partial = RewardConfig { format_reward: 0.1 };
    assert_eq!(partial.score("1+2=3#3", 3), 1.0);
    assert_eq!(partial.score("1+2=4#4", 3), 0.1);
    assert_eq!(partial.score("zzz", 3), 0.0);
}
