//! Difficulty of the arithmetic task: how many operands, how many digits, which operators.

use crate::error::{Result, TaskError};
use serde::{Deserialize, Serialize};

/// A binary operator that problems may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// Addition, `+`.
    Add,
    /// Subtraction, `-`.
    Sub,
    /// Multiplication, `*` (binds tighter than `+` and `-`).
    Mul,
}

impl Op {
    /// The character that writes this operator.
    pub fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
        }
    }
}

/// Shape of the problems one difficulty produces.
///
/// Operands have a uniformly drawn digit count in `1..=max_digits` (so small numbers are
/// common), except operands next to a `*`, which have at most `max_mul_digits` digits so
/// products stay short.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Difficulty {
    /// Fewest operands in an expression (at least 2).
    pub min_operands: usize,
    /// Most operands in an expression.
    pub max_operands: usize,
    /// Most decimal digits of an operand (1..=6).
    pub max_digits: u32,
    /// Most digits of an operand adjacent to `*` (1..=max_digits).
    pub max_mul_digits: u32,
    /// Operators to draw from (non-empty, no repeats needed).
    pub ops: Vec<Op>,
    /// Whether intermediate results and the answer may be negative.
    pub allow_negative: bool,
}

/// Highest preset level.
pub const MAX_LEVEL: u32 = 5;

impl Difficulty {
    /// A preset: 1 = two 1–2 digit operands with `+ -`; each level adds operands, digits
    /// and `*`, up to 5 = 4–6 operands of up to 4 digits. Results never go negative.
    pub fn level(level: u32) -> Result<Self> {
        use Op::*;
        let (min_operands, max_operands, max_digits, max_mul_digits, ops) = match level {
            1 => (2, 2, 2, 1, vec![Add, Sub]),
            2 => (2, 3, 2, 1, vec![Add, Sub, Mul]),
            3 => (3, 4, 3, 1, vec![Add, Sub, Mul]),
            4 => (3, 5, 3, 2, vec![Add, Sub, Mul]),
            5 => (4, 6, 4, 2, vec![Add, Sub, Mul]),
            _ => {
                return Err(TaskError::UnknownLevel {
                    level,
                    max: MAX_LEVEL,
                })
            }
        };
        Ok(Self {
            min_operands,
            max_operands,
            max_digits,
            max_mul_digits,
            ops,
            allow_negative: false,
        })
    }

    /// Checks that the fields describe a non-empty, overflow-safe problem space.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TaskError::InvalidDifficulty(m));
        if self.min_operands < 2 {
            return bad(format!("min_operands {} < 2", self.min_operands));
        }
        if self.max_operands < self.min_operands {
            return bad(format!(
                "max_operands {} < min_operands {}",
                self.max_operands, self.min_operands
            ));
        }
        if self.max_operands > 12 {
            return bad(format!("max_operands {} > 12", self.max_operands));
        }
        if !(1..=6).contains(&self.max_digits) {
            return bad(format!("max_digits {} not in 1..=6", self.max_digits));
        }
        if !(1..=self.max_digits).contains(&self.max_mul_digits) {
            return bad(format!(
                "max_mul_digits {} not in 1..=max_digits ({})",
                self.max_mul_digits, self.max_digits
            ));
        }
        if self.ops.is_empty() {
            return bad("ops is empty".to_string());
        }
        Ok(())
    }
}
