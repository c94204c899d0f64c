//! One arithmetic problem: drawing it, solving it step by step, and writing it as text.
//!
//! # Text format
//! The prompt is the expression followed by `=`, e.g. `12+7*3-4=`. The target (what the
//! model should write after the prompt, then `<eos>`) is the worked solution: one binary
//! step per operator, separated by `;`, then `#` and the final answer:
//!
//! ```text
//! 12+7*3-4=7*3=21;12+21=33;33-4=29#29
//! ```
//!
//! Steps follow the usual precedence: every `*` first, leftmost first, then `+`/`-` left to
//! right. Negative numbers (only with `allow_negative`) are written with a leading `-`,
//! e.g. `3-7=-4`. The alphabet is `0-9 + - * = ; #`: tiny and character-level friendly.

use crate::difficulty::{Difficulty, Op};
use crate::error::Result;
use rand::Rng;
use serde::{Deserialize, Serialize};

/// Draws tried before falling back to an all-addition expression when negatives are banned.
const NONNEGATIVE_ATTEMPTS: usize = 1000;

/// A problem with its prompt, worked solution and answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Problem {
    /// Expression followed by `=`, e.g. `12+7*3=`.
    pub prompt: String,
    /// Worked solution the model should produce, e.g. `7*3=21;12+21=33#33`.
    pub solution: String,
    /// The value of the expression.
    pub answer: i64,
}

/// An expression as operands and the operators between them (`ops.len() == operands.len() - 1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expression {
    /// Operand values, left to right.
    pub operands: Vec<i64>,
    /// Operators, left to right.
    pub ops: Vec<Op>,
}

/// One solution step `lhs op rhs = result`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Left operand.
    pub lhs: i64,
    /// Operator.
    pub op: Op,
    /// Right operand.
    pub rhs: i64,
    /// Result of the step.
    pub result: i64,
}

impl Expression {
    /// The expression as text, without `=`.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for (i, v) in self.operands.iter().enumerate() {
            if i > 0 {
                if let Some(op) = self.ops.get(i - 1) {
                    s.push(op.symbol());
                }
            }
            s.push_str(&v.to_string());
        }
        s
    }

    /// Solves with precedence (`*` first, then left to right), returning the steps, or
    /// `None` when an intermediate value overflows `i64`.
    pub fn solve(&self) -> Option<Vec<Step>> {
        let mut vals = self.operands.clone();
        let mut ops = self.ops.clone();
        let mut steps = Vec::with_capacity(ops.len());
        while let Some(i) = ops.iter().position(|&o| o == Op::Mul) {
            let (lhs, rhs) = (*vals.get(i)?, *vals.get(i + 1)?);
            let result = lhs.checked_mul(rhs)?;
            steps.push(Step {
                lhs,
                op: Op::Mul,
                rhs,
                result,
            });
            vals[i] = result;
            vals.remove(i + 1);
            ops.remove(i);
        }
        let mut acc = *vals.first()?;
        for (op, &rhs) in ops.iter().zip(vals.iter().skip(1)) {
            let result = match op {
                Op::Add => acc.checked_add(rhs)?,
                Op::Sub => acc.checked_sub(rhs)?,
                Op::Mul => acc.checked_mul(rhs)?,
            };
            steps.push(Step {
                lhs: acc,
                op: *op,
                rhs,
                result,
            });
            acc = result;
        }
        Some(steps)
    }
}

/// Writes steps in the solution format: `a*b=c;c+d=e#e`.
pub fn render_solution(steps: &[Step], answer: i64) -> String {
    let mut s = String::new();
    for (i, st) in steps.iter().enumerate() {
        if i > 0 {
            s.push(';');
        }
        s.push_str(&format!(
            "{}{}{}={}",
            st.lhs,
            st.op.symbol(),
            st.rhs,
            st.result
        ));
    }
    s.push('#');
    s.push_str(&answer.to_string());
    s
}

impl Problem {
    /// Builds the problem for an expression, or `None` if solving it overflows.
    pub fn from_expression(expr: &Expression) -> Option<Self> {
        let steps = expr.solve()?;
        let answer = match steps.last() {
            Some(s) => s.result,
            None => *expr.operands.first()?,
        };
        Some(Self {
            prompt: format!("{}=", expr.render()),
            solution: render_solution(&steps, answer),
            answer,
        })
    }

    /// Draws a problem of the given difficulty.
    pub fn generate<R: Rng + ?Sized>(difficulty: &Difficulty, rng: &mut R) -> Result<Self> {
        difficulty.validate()?;
        let mut last = None;
        for _ in 0..NONNEGATIVE_ATTEMPTS {
            let expr = draw_expression(difficulty, rng);
            let Some(problem) = Problem::from_expression(&expr) else {
                continue;
            };
            if difficulty.allow_negative || !has_negative(&expr) {
                return Ok(problem);
            }
            last = Some(expr);
        }
        // Rejection failed repeatedly (many `-`): keep the draw but make it all-addition,
        // which is never negative. Deterministic, so runs stay reproducible.
        let mut expr = last.unwrap_or_else(|| draw_expression(difficulty, rng));
        for op in expr.ops.iter_mut().filter(|o| **o == Op::Sub) {
            *op = Op::Add;
        }
        Problem::from_expression(&expr).ok_or_else(|| {
            crate::error::TaskError::InvalidDifficulty(
                "expressions overflow i64; lower max_digits or max_operands".to_string(),
            )
        })
    }

    /// The full training text: prompt followed by solution.
    pub fn full_text(&self) -> String {
        format!("{}{}", self.prompt, self.solution)
    }
}

fn has_negative(expr: &Expression) -> bool {
    expr.solve()
        .is_none_or(|steps| steps.iter().any(|s| s.result < 0))
}

fn draw_expression<R: Rng + ?Sized>(d: &Difficulty, rng: &mut R) -> Expression {
    let n = rng.random_range(d.min_operands..=d.max_operands);
    let ops: Vec<Op> = (0..n - 1)
        .map(|_| d.ops[rng.random_range(0..d.ops.len())])
        .collect();
    let operands = (0..n)
        .map(|i| {
            let next_to_mul = (i > 0 && ops[i - 1] == Op::Mul) || ops.get(i) == Some(&Op::Mul);
            let max_digits = if next_to_mul {
                d.max_mul_digits
            } else {
                d.max_digits
            };
            let digits = rng.random_range(1..=max_digits);
            let lo = if digits == 1 {
                0
            } else {
                10i64.pow(digits - 1)
            };
            rng.random_range(lo..10i64.pow(digits))
        })
        .collect();
    Expression { operands, ops }
}
