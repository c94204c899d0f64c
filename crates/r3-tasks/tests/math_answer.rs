//! Math-answer extraction and equivalence on a table of tricky completions, checked against
//! answers worked out by hand.

use r3_tasks::{extract_math_answer, math_equal, parse_number, AnswerSource, Rational};

fn r(num: i128, den: i128) -> Option<Rational> {
    Rational::new(num, den)
}

/// Each text parses to its number (`None`: no number); every mismatch is reported.
fn parses(cases: &[(&str, Option<Rational>)]) {
    let wrong: Vec<_> = cases
        .iter()
        .map(|(text, want)| (text, parse_number(text), want))
        .filter(|(_, got, want)| got != *want)
        .collect();
    assert!(wrong.is_empty(), "(text, got, want): {wrong:?}");
}

/// Each text's extracted answer is `want`, found by `source`; every mismatch is reported.
fn extracts(cases: &[(&str, &str)], source: AnswerSource) {
    let wrong: Vec<_> = cases
        .iter()
        .map(|(text, want)| (text, extract_math_answer(text), want))
        .filter(|(_, got, want)| *got != Some((want.to_string(), source)))
        .collect();
    assert!(wrong.is_empty(), "(text, got, want): {wrong:?}");
}

#[test]
fn extraction_prefers_boxed_then_hashes_then_last_number() {
    let cases: &[(&str, Option<(&str, AnswerSource)>)] = &[
        (
            "so the answer is \\boxed{42}.",
            Some(("42", AnswerSource::Boxed)),
        ),
        // nested braces inside the box, and an earlier box that is not the final one
        (
            "\\boxed{1} then \\boxed{\\frac{3}{4}}",
            Some(("\\frac{3}{4}", AnswerSource::Boxed)),
        ),
        ("\\fbox{7}", Some(("7", AnswerSource::Boxed))),
        (
            "He has 3 apples.\n#### 1,234\n",
            Some(("1,234", AnswerSource::Hashes)),
        ),
        ("#### 5 then #### -12", Some(("-12", AnswerSource::Hashes))),
        (
            "2 + 3 = 5, so she pays $12.50.",
            Some(("12.50", AnswerSource::LastNumber)),
        ),
        ("total: -7", Some(("-7", AnswerSource::LastNumber))),
        (
            "it costs 1,500 dollars",
            Some(("1,500", AnswerSource::LastNumber)),
        ),
        ("no digits at all", None),
        // an empty #### line falls back to the last number
        ("I think 9\n####\n", Some(("9", AnswerSource::LastNumber))),
        // an unbalanced box is no answer; the last number is
        ("\\boxed{12", Some(("12", AnswerSource::LastNumber))),
    ];
    for (text, want) in cases {
        let got = extract_math_answer(text);
        let got = got.as_ref().map(|(s, src)| (s.as_str(), *src));
        assert_eq!(got, *want, "{text:?}");
    }
}

#[test]
fn numbers_parse_to_exact_rationals() {
    let cases: &[(&str, Option<Rational>)] = &[
        ("42", r(42, 1)),
        ("42.0", r(42, 1)),
        ("42.", r(42, 1)),
        ("1,234", r(1234, 1)),
        ("1,234,567.5", r(2_469_135, 2)),
        ("$18", r(18, 1)),
        ("\\$18", r(18, 1)),
        ("-3.50", r(-7, 2)),
        ("0.125", r(1, 8)),
        ("7/8", r(7, 8)),
        ("14/16", r(7, 8)),
        ("\\frac{3}{4}", r(3, 4)),
        ("\\dfrac{6}{8}", r(3, 4)),
        ("-\\frac{1}{2}", r(-1, 2)),
        ("\\text{ 5 }", r(5, 1)),
        ("= 10", r(10, 1)),
        ("12,34", None),
        ("1/0", None),
        // a trailing percent sign is dropped, as GSM8K's scorers drop it
        ("50%", r(50, 1)),
        ("abc", None),
        ("--3", None),
        ("1234567890123456789012345678901234", None),
    ];
    parses(cases);
}

#[test]
fn equality_is_numeric_when_both_sides_are_numbers_else_textual() {
    let equal = [
        ("1,000", "1000"),
        ("18.0", "18"),
        ("$18.00", "18"),
        ("\\frac{1}{2}", "0.5"),
        ("2/4", "1/2"),
        ("-0.75", "-\\frac{3}{4}"),
        ("Yes", "yes"),
        ("\\text{east}", "east"),
        ("50%", "50"),
    ];
    for (a, b) in equal {
        assert!(math_equal(a, b), "{a:?} should equal {b:?}");
    }
    let different = [
        ("18.01", "18"),
        ("1/3", "0.33"),
        ("-5", "5"),
        ("50%", "0.5"),
        ("north", "east"),
        ("", "0"),
    ];
    for (a, b) in different {
        assert!(!math_equal(a, b), "{a:?} should differ from {b:?}");
    }
}

/// `(response, truth, reward)` rows through the `math` reward; every mismatch is reported.
fn rewards(cases: &[(&str, &str, f32)]) {
    let wrong: Vec<_> = cases
        .iter()
        .map(|(response, truth, want)| {
            let got = r3_tasks::reward::answers::math_reward(response, truth);
            (response, truth, got, want)
        })
        .filter(|(_, _, got, want)| got != *want)
        .collect();
    assert!(wrong.is_empty(), "(response, truth, got, want): {wrong:?}");
}

#[test]
fn a_hashes_line_gives_its_leading_number() {
    let cases: &[(&str, &str)] = &[
        ("#### 42 dollars", "42"),
        ("#### 42 apples.", "42"),
        ("#### 18 (she keeps the rest)", "18"),
        ("#### $1,234.50 in total", "$1,234.50"),
        ("#### **42**", "42"),
        ("#### **42** dollars.", "42"),
        ("#### = 7 cookies", "7"),
        ("#### 3 1/2 cups", "3 1/2"),
        ("#### 1 000 000 people", "1 000 000"),
        // GSM8K's scorer reads the first of two numbers too
        ("#### 4 5", "4"),
        // a number that starts an expression, or no leading number: the whole line
        ("#### 5 + 3 = 8", "5 + 3 = 8"),
        ("#### 5x + 3", "5x + 3"),
        ("#### 5 - 3", "5 - 3"),
        ("#### east", "east"),
        ("#### The answer is 42", "The answer is 42"),
    ];
    extracts(cases, AnswerSource::Hashes);
    rewards(&[
        ("#### 42 dollars", "42", 1.0),
        ("#### 42 apples.", "42", 1.0),
        ("#### 18 (she keeps the rest)", "18", 1.0),
        ("The answer is 42 dollars.", "42", 1.0),
        ("#### 5 + 3 = 8", "5", 0.0),
        ("#### 5x", "5", 0.0),
        ("#### 4 5", "45", 0.0),
    ]);
}

#[test]
fn a_trailing_percent_sign_is_one_rule_everywhere() {
    rewards(&[
        ("#### 50%", "50", 1.0),
        ("#### 50 %", "50", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("The rate is 50%.", "50", 1.0),
        ("#### 50%", "50%", 1.0),
        ("#### 50%", "0.5", 0.0),
        ("#### 50%", "5", 0.0),
    ]);
}

#[test]
fn spaces_between_digits_never_merge_numbers() {
    let cases: &[(&str, Option<Rational>)] = &[
        ("3 1/2", r(7, 2)),
        ("-3 1/2", r(-7, 2)),
        ("3 100/200", r(7, 2)),
        ("4 5", None),
        ("3 5/2", None),
        ("1/2 3", None),
        ("3 0/2", None),
        ("1 000 000", r(1_000_000, 1)),
        ("12 345.5", r(24_691, 2)),
        ("1\\,000", r(1000, 1)),
        ("1 00", None),
        ("1234 567", None),
        ("1.5 000", None),
        ("1 000 00", None),
    ];
    parses(cases);
    rewards(&[
        ("\\boxed{3 1/2}", "15.5", 0.0),
        ("\\boxed{3 1/2}", "3.5", 1.0),
        ("#### 4 5", "45", 0.0),
    ]);
}

#[test]
fn a_hyphen_between_numbers_is_no_minus_sign() {
    let cases: &[(&str, &str)] = &[
        ("The years 1990-2000", "2000"),
        ("5-3", "3"),
        ("-4", "-4"),
        ("the result is \u{2212}5", "-5"),
        ("x = -5", "-5"),
        ("so x=-5", "-5"),
        ("(\u{2212}5)", "-5"),
        ("she owes $-5", "-5"),
        ("answer:-2", "-2"),
    ];
    extracts(cases, AnswerSource::LastNumber);
    assert_eq!(parse_number("\u{2212}5"), r(-5, 1));
    rewards(&[
        ("The years 1990-2000", "2000", 1.0),
        ("The years 1990-2000", "-2000", 0.0),
        ("#### \u{2212}5", "-5", 1.0),
        ("\\boxed{\u{2212}\\frac{1}{2}}", "-0.5", 1.0),
    ]);
}

#[test]
fn latex_forms_of_numbers_are_read_and_nothing_else_is() {
    let equal = [
        ("1{,}000", "1000"),
        ("1{,}000{,}000", "1000000"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("5\\text{ cm}", "5"),
        ("5 \\mbox{ cm}", "5"),
        ("\\frac12\\text{ cup}", "0.5"),
        ("\\left(1,2\\right)", "(1,2)"),
        ("\\left[ 0, 1 \\right)", "[0,1)"),
        ("\\dfrac12", "1/2"),
        ("\\frac 3 4", "0.75"),
        ("-\\tfrac{1}2", "-0.5"),
        ("x=5", "5"),
        ("x = 5", "5"),
        ("y_1=5", "5"),
        ("n_{0} = \\frac{1}{2}", "0.5"),
        ("2.5e3", "2500"),
        ("1E-2", "0.01"),
    ];
    for (a, b) in equal {
        assert!(math_equal(a, b), "{a:?} should equal {b:?}");
    }
    let different = [
        ("\\frac123", "1/2"),
        ("\\frac123", "1/23"),
        ("\\frac{12}{3}", "1/23"),
        ("2x=5", "5"),
        ("xy=5", "5"),
        ("x=5,y=3", "5"),
        ("x=y=5", "5"),
        ("1{,}00", "100"),
        ("5\\text{ cm}^2", "5"),
        ("\\text{cm}5", "5"),
        ("\\left(3\\right)", "3"),
        ("\\leftarrow", "arrow"),
        ("\\rightarrow", "arrow"),
        ("90^\\circ", "91"),
        ("e5", "5"),
        ("5e", "5"),
        ("2.5e3", "2.5"),
    ];
    for (a, b) in different {
        assert!(!math_equal(a, b), "{a:?} should differ from {b:?}");
    }
}

#[test]
fn exponents_are_exact_and_bounded() {
    let cases: &[(&str, Option<Rational>)] = &[
        ("1e21", r(1_000_000_000_000_000_000_000, 1)),
        ("2.5E3", r(2500, 1)),
        ("1e-3", r(1, 1000)),
        ("-1.5e+2", r(-150, 1)),
        (".5e1", r(5, 1)),
        ("1,000e3", None),
        ("1e", None),
        ("e3", None),
        ("1e2.5", None),
        ("1e999", None),
        ("9e38", None),
    ];
    parses(cases);
}

#[test]
fn a_number_that_starts_an_expression_in_words_is_no_answer() {
    let cases: &[(&str, &str)] = &[
        ("#### 5 x 3 = 15", "5 x 3 = 15"),
        ("#### 5 x 3", "5 x 3"),
        ("#### 5 X 3", "5 X 3"),
        ("#### 5 \u{d7} 3", "5 \u{d7} 3"),
        ("#### 5 times 3", "5 times 3"),
        ("#### 5 plus 3", "5 plus 3"),
        ("#### 5 minus 3", "5 minus 3"),
        ("#### 6 divided by 2", "6 divided by 2"),
        ("#### 6 over 2", "6 over 2"),
        ("#### 15 apples = 3 bags", "15 apples = 3 bags"),
        // a word that merely starts so, or no number after the word: the leading number
        ("#### 12 xylophones", "12"),
        ("#### 3 times over", "3"),
    ];
    extracts(cases, AnswerSource::Hashes);
    rewards(&[
        ("#### 5 x 3 = 15", "5", 0.0),
        ("#### 5 x 3 = 15", "15", 0.0),
        ("#### 5 times 3", "5", 0.0),
        ("#### 6 divided by 2", "6", 0.0),
        ("#### 42 dollars", "42", 1.0),
        ("#### 18 (she keeps the rest)", "18", 1.0),
    ]);
}

#[test]
fn more_than_one_assignment_or_value_is_no_answer() {
    rewards(&[
        ("#### x=5, y=7", "5", 0.0),
        ("#### x = 5, y = 7", "5", 0.0),
        ("#### x=5, 7", "5", 0.0),
        ("#### 5, 7", "5", 0.0),
        ("\\boxed{x=5, y=7}", "5", 0.0),
        ("\\boxed{x=5,y=3}", "5", 0.0),
        ("\\boxed{x=5, 700}", "5700", 0.0),
        ("\\boxed{x=5, 700}", "5", 0.0),
        // one assignment, or one value and words after a comma, still counts
        ("#### x=5", "5", 1.0),
        ("\\boxed{x=5}", "5", 1.0),
        ("\\boxed{x = 1,000}", "1000", 1.0),
        ("#### 42, which she keeps", "42", 1.0),
    ]);
}

#[test]
fn a_space_after_a_comma_separates_numbers() {
    parses(&[
        ("12, 345", None),
        ("2, 100", None),
        ("1,  000", None),
        ("x=5, 700", None),
        ("1,000", r(1000, 1)),
        ("1 000", r(1000, 1)),
        ("1 000 000", r(1_000_000, 1)),
        ("3 1/2", r(7, 2)),
    ]);
    rewards(&[
        ("#### 12, 345", "12345", 0.0),
        ("#### 12, 345", "12", 0.0),
        ("\\boxed{2, 100}", "2100", 0.0),
        ("\\boxed{2, 100}", "2,100", 0.0),
        ("\\boxed{2, 100}", "2, 100", 1.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### 1 000 000", "1000000", 1.0),
    ]);
}

/// Symbolic (MATH-style) answers written two ways score 1, and vote together, after the
/// normalisations of verl's MATH scorer. verl's own verdict on each pair, from
/// `compute_score(response, truth)` of `verl/utils/reward_score/math_reward.py` at
/// volcengine/verl@b178a3cd, run standalone in python3 (2026-12-08): 1.0 for every pair
/// below. r3 scored each 0.0 before `normalise_text` applied them.
#[test]
fn symbolic_answers_are_normalised_as_verl_math_does() {
    let cases = [
        ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{\\tfrac{\\pi}{4}}", "\\frac{\\pi}{4}"),
        ("\\boxed{\\dfrac{5}{\\sqrt{2}}}", "\\frac{5}{\\sqrt{2}}"),
        (
            "\\boxed{\\left( \\dfrac{1}{2}, 3 \\right)}",
            "\\left( \\frac{1}{2}, 3 \\right)",
        ),
        ("\\boxed{\\sqrt{2}}", "\\sqrt2"),
        ("\\boxed{3\\sqrt{5}}", "3\\sqrt5"),
        ("\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{\\frac{1}{2}, 3}", "\\frac12,3"),
        ("\\boxed{\\frac1{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{x = \\frac{\\pi}{4}}", "\\frac{\\pi}{4}"),
        ("\\boxed{y = 2x + 3}", "2x+3"),
        // verl's remove_right_units: a trailing `\text{ unit}`
        ("\\boxed{5\\sqrt{2}\\text{ cm}}", "5\\sqrt{2}"),
        // every `\%` dropped, not only a trailing one
        ("\\boxed{(50\\%, 20\\%)}", "(50, 20)"),
        // ` .5` reads as ` 0.5`
        ("\\boxed{(1, .5)}", "(1, 0.5)"),
        // `\\` reads as `\`
        ("\\boxed{\\\\frac{\\pi}{4}}", "\\frac{\\pi}{4}"),
    ];
    symbolic_pairs_agree(&cases);
}

/// Forms TeX reads as the same answer where verl's string rules do not (verl gives 0.0 for
/// each, same source as above: `\sqrt 3` becomes `\sqrt{}3`, `\frac\pi4` becomes
/// `\frac{\}{p}i4`, `{42}` keeps its braces); r3 gave 0.0 before too.
#[test]
fn tex_arguments_and_groups_read_as_tex_reads_them() {
    symbolic_pairs_agree(&[
        ("\\boxed{\\sqrt 3}", "\\sqrt{3}"),
        ("\\boxed{\\frac\\pi4}", "\\frac{\\pi}{4}"),
        ("\\boxed{\\frac \\pi 4}", "\\frac{\\pi}{4}"),
        ("\\boxed{\\sqrt[3]2}", "\\sqrt[3]{2}"),
        ("\\boxed{{42}}", "42"),
        ("\\boxed{{\\frac{1}{2}}}", "0.5"),
    ]);
}

/// Each `(response, truth)` scores 1 and votes as `\boxed{truth}` does.
fn symbolic_pairs_agree(cases: &[(&str, &str)]) {
    use r3_tasks::reward::answers::math_reward;
    use r3_tasks::reward::vote::math_vote_key;
    let wrong: Vec<_> = cases
        .iter()
        .filter(|(response, truth)| {
            math_reward(response, truth) != 1.0
                || math_vote_key(response) != math_vote_key(&format!("\\boxed{{{truth}}}"))
        })
        .collect();
    assert!(wrong.is_empty(), "(response, truth) not equal: {wrong:?}");
}

/// Different answers stay different after the normalisation (verl gives 0.0 for each too,
/// same source as above).
#[test]
fn normalising_symbolic_answers_keeps_different_answers_apart() {
    rewards(&[
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("\\boxed{x = 2}", "3", 0.0),
        ("\\boxed{x = \\frac{\\pi}{4}}", "\\frac{\\pi}{3}", 0.0),
        ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
        // TeX reads `\sqrt32` as `\sqrt{3}2`
        ("\\boxed{\\sqrt{32}}", "\\sqrt32", 0.0),
        ("\\boxed{2x = 6}", "6", 0.0),
        ("\\boxed{x = y = \\pi}", "\\pi", 0.0),
        ("\\boxed{\\frac{1}{2}, 3}", "\\frac12,4", 0.0),
        ("\\boxed{\\dfrac{\\pi}{4}}", "\\frac{\\pi}{4}", 1.0),
    ]);
    use r3_tasks::reward::vote::math_vote_key;
    assert_ne!(
        math_vote_key("\\boxed{\\frac{\\sqrt{3}}{2}}"),
        math_vote_key("\\boxed{\\frac{\\sqrt{2}}{2}}")
    );
}
