//! Math-answer extraction and equivalence on a table of tricky completions, checked against
//! answers worked out by hand.

use r3_tasks::{extract_math_answer, math_equal, parse_number, AnswerSource, Rational};

fn r(num: i128, den: i128) -> Option<Rational> {
    Rational::new(num, den)
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
        ("50%", None),
        ("abc", None),
        ("--3", None),
        ("1234567890123456789012345678901234", None),
    ];
    for (text, want) in cases {
        assert_eq!(parse_number(text), *want, "{text:?}");
    }
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
    ];
    for (a, b) in equal {
        assert!(math_equal(a, b), "{a:?} should equal {b:?}");
    }
    let different = [
        ("18.01", "18"),
        ("1/3", "0.33"),
        ("-5", "5"),
        ("50%", "50"),
        ("north", "east"),
        ("", "0"),
    ];
    for (a, b) in different {
        assert!(!math_equal(a, b), "{a:?} should differ from {b:?}");
    }
}
