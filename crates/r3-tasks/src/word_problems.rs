//! GSM8K-format word problems: seeded multi-step problems about money, distance, time and
//! counts, each with a worked solution in GSM8K's style (one line per step with `<<a*b=c>>`
//! calculator annotations, then `#### N`) and its integer answer; and the rows of a train /
//! validation dataset in verl's schema built from them (validation questions never appear in
//! training).

use std::collections::HashSet;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use crate::dataset::{ChatMessage, DatasetRow, Prompt};

/// `data_source` of the generated rows.
pub const DATA_SOURCE: &str = "r3/gsm8k-style";
/// The instruction verl's GSM8K preprocessing appends to every question.
pub const INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";
/// Draws per wanted row before the question space is declared exhausted.
const DRAWS_PER_ROW: usize = 50;

/// One word problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WordProblem {
    /// The question.
    pub question: String,
    /// The worked solution, ending in `#### <answer>`.
    pub solution: String,
    /// The final answer.
    pub answer: i64,
}

const NAMES: [&str; 12] = [
    "Natalia", "Tom", "Aisha", "Marco", "Lena", "Ravi", "Sofia", "Ken", "Maya", "Omar", "Julia",
    "Pedro",
];
const ITEMS: [(&str, &str); 8] = [
    ("notebook", "notebooks"),
    ("apple", "apples"),
    ("pencil", "pencils"),
    ("ticket", "tickets"),
    ("cookie", "cookies"),
    ("sticker", "stickers"),
    ("marble", "marbles"),
    ("card", "cards"),
];
const VEHICLES: [&str; 4] = ["train", "bus", "car", "truck"];
const BAKED: [&str; 4] = ["muffins", "cupcakes", "rolls", "pies"];

fn pick<'a, T, R: Rng + ?Sized>(rng: &mut R, xs: &'a [T]) -> &'a T {
    &xs[rng.random_range(0..xs.len())]
}

/// A step line `text a op b = <<a op b=c>>c unit.`
fn step(text: &str, a: i64, op: char, b: i64, c: i64, tail: &str) -> String {
    format!("{text}{a} {op} {b} = <<{a}{op}{b}={c}>>{c}{tail}")
}

impl WordProblem {
    /// Draws one problem (one of five templates, each two or three steps).
    pub fn generate<R: Rng + ?Sized>(rng: &mut R) -> Self {
        let name = *pick(rng, &NAMES);
        let drawn = match rng.random_range(0..5u32) {
            0 => {
                let (_, many) = *pick(rng, &ITEMS);
                let (_, many2) = *pick(rng, &ITEMS);
                let (a, p) = (rng.random_range(2..=12i64), rng.random_range(1..=9i64));
                let (b, q) = (rng.random_range(2..=12i64), rng.random_range(2..=15i64));
                let (x, y) = (a * p, b * q);
                let many2 = if many2 == many { "erasers" } else { many2 };
                WordProblem {
                    question: format!(
                        "{name} buys {a} {many} at ${p} each and {b} {many2} at ${q} each. How many dollars does {name} spend in total?"
                    ),
                    solution: [
                        step(&format!("The {many} cost "), a, '*', p, x, " dollars."),
                        step(&format!("The {many2} cost "), b, '*', q, y, " dollars."),
                        step("In total that is ", x, '+', y, x + y, " dollars."),
                    ]
                    .join("\n"),
                    answer: x + y,
                }
            }
            1 => {
                let v = *pick(rng, &VEHICLES);
                let (s1, h1) = (rng.random_range(3..=12i64) * 10, rng.random_range(2..=6i64));
                let (s2, h2) = (rng.random_range(3..=12i64) * 10, rng.random_range(1..=5i64));
                let (d1, d2) = (s1 * h1, s2 * h2);
                WordProblem {
                    question: format!(
                        "A {v} travels at {s1} km per hour for {h1} hours, then at {s2} km per hour for {h2} hours. How many kilometers does it travel in all?"
                    ),
                    solution: [
                        step("First it covers ", s1, '*', h1, d1, " km."),
                        step("Then it covers ", s2, '*', h2, d2, " km."),
                        step("Altogether it travels ", d1, '+', d2, d1 + d2, " km."),
                    ]
                    .join("\n"),
                    answer: d1 + d2,
                }
            }
            2 => {
                let (_, many) = *pick(rng, &ITEMS);
                let (k, f) = (rng.random_range(2..=6i64), rng.random_range(2..=5i64));
                let given = k * f;
                let n = given + rng.random_range(1..=30i64);
                let m = rng.random_range(3..=20i64);
                let left = n - given;
                WordProblem {
                    question: format!(
                        "{name} has {n} {many}. {name} gives {k} {many} to each of {f} friends and then buys {m} more. How many {many} does {name} have now?"
                    ),
                    solution: [
                        step("The friends get ", k, '*', f, given, &format!(" {many}.")),
                        step(&format!("{name} keeps "), n, '-', given, left, &format!(" {many}.")),
                        step("After buying more, that is ", left, '+', m, left + m, &format!(" {many}.")),
                    ]
                    .join("\n"),
                    answer: left + m,
                }
            }
            3 => {
                let (w, weeks) = (rng.random_range(3..=25i64), rng.random_range(4..=12i64));
                let saved = w * weeks;
                let spent = rng.random_range(1..saved);
                WordProblem {
                    question: format!(
                        "{name} saves ${w} every week for {weeks} weeks and then spends ${spent} on a gift. How many dollars does {name} have left?"
                    ),
                    solution: [
                        step(&format!("{name} saves "), w, '*', weeks, saved, " dollars."),
                        step("After the gift, ", saved, '-', spent, saved - spent, " dollars are left."),
                    ]
                    .join("\n"),
                    answer: saved - spent,
                }
            }
            _ => {
                let b = *pick(rng, &BAKED);
                let (trays, per) = (rng.random_range(2..=8i64), rng.random_range(4..=12i64));
                let made = trays * per;
                let per_box = rng.random_range(2..=6i64);
                let boxes = rng.random_range(1..=(made - 1) / per_box);
                let packed = boxes * per_box;
                let sold = made - packed;
                WordProblem {
                    question: format!(
                        "A baker makes {trays} trays of {b} with {per} {b} on each tray. She sells {sold} of them and packs the rest into boxes of {per_box}. How many boxes does she fill?"
                    ),
                    solution: [
                        step("She makes ", trays, '*', per, made, &format!(" {b}.")),
                        step("After selling, ", made, '-', sold, packed, &format!(" {b} are left.")),
                        step("They fill ", packed, '/', per_box, boxes, " boxes."),
                    ]
                    .join("\n"),
                    answer: boxes,
                }
            }
        };
        drawn.finish()
    }

    fn finish(mut self) -> Self {
        self.solution = format!("{}\n#### {}", self.solution, self.answer);
        self
    }

    /// The problem as a dataset row in verl's schema (chat prompt with verl's GSM8K
    /// instruction; the solution kept in `extra_info.answer`).
    pub fn to_row(&self, split: &str, index: usize) -> DatasetRow {
        DatasetRow {
            prompt: Prompt::Messages(vec![ChatMessage {
                role: "user".into(),
                content: format!("{} {INSTRUCTION}", self.question),
            }]),
            ground_truth: Value::String(self.answer.to_string()),
            data_source: DATA_SOURCE.into(),
            extra_info: json!({
                "split": split,
                "index": index as i64,
                "question": self.question,
                "answer": self.solution,
            }),
        }
    }
}

/// A train and a validation split of distinct problems (no validation question in train),
/// drawn from `seed`. `None` when the question space cannot fill them.
pub fn gsm8k_style_splits(
    train: usize,
    val: usize,
    seed: u64,
) -> Option<(Vec<DatasetRow>, Vec<DatasetRow>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut seen = HashSet::new();
    let mut draw = |n: usize, split: &str| -> Option<Vec<DatasetRow>> {
        let mut rows = Vec::with_capacity(n);
        for _ in 0..n.saturating_mul(DRAWS_PER_ROW).max(100) {
            if rows.len() == n {
                break;
            }
            let p = WordProblem::generate(&mut rng);
            if seen.insert(p.question.clone()) {
                rows.push(p.to_row(split, rows.len()));
            }
        }
        (rows.len() == n).then_some(rows)
    };
    let val_rows = draw(val, "test")?;
    let train_rows = draw(train, "train")?;
    Some((train_rows, val_rows))
}
