//! The arithmetic task: a fixed held-out eval set and a seeded training stream kept
//! disjoint from it by filtering.

use crate::difficulty::Difficulty;
use crate::error::{Result, TaskError};
use crate::problem::Problem;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;

/// Draws per wanted eval problem before the eval set is declared impossible to fill.
const EVAL_DRAWS_PER_PROBLEM: usize = 50;
/// Consecutive eval-set hits before training sampling gives up.
const TRAIN_REJECT_LIMIT: usize = 10_000;

/// A difficulty plus its held-out eval set.
#[derive(Debug, Clone)]
pub struct ArithmeticTask {
    difficulty: Difficulty,
    eval: Vec<Problem>,
    eval_prompts: HashSet<String>,
}

impl ArithmeticTask {
    /// Builds the task; the eval set is `eval_size` distinct problems drawn from `eval_seed`.
    pub fn new(difficulty: Difficulty, eval_size: usize, eval_seed: u64) -> Result<Self> {
        difficulty.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(eval_seed);
        let mut eval = Vec::with_capacity(eval_size);
        let mut eval_prompts = HashSet::with_capacity(eval_size);
        let attempts = eval_size.saturating_mul(EVAL_DRAWS_PER_PROBLEM).max(1000);
        for _ in 0..attempts {
            if eval.len() == eval_size {
                break;
            }
            let p = Problem::generate(&difficulty, &mut rng)?;
            if eval_prompts.insert(p.prompt.clone()) {
                eval.push(p);
            }
        }
        if eval.len() < eval_size {
            return Err(TaskError::EvalSetTooLarge {
                wanted: eval_size,
                got: eval.len(),
                attempts,
            });
        }
        Ok(Self {
            difficulty,
            eval,
            eval_prompts,
        })
    }

    /// The difficulty problems are drawn at.
    pub fn difficulty(&self) -> &Difficulty {
        &self.difficulty
    }

    /// The held-out eval problems, in a fixed order.
    pub fn eval_set(&self) -> &[Problem] {
        &self.eval
    }

    /// Whether a prompt belongs to the eval set.
    pub fn is_eval_prompt(&self, prompt: &str) -> bool {
        self.eval_prompts.contains(prompt)
    }

    /// Draws one training problem (never an eval problem).
    pub fn sample_train<R: rand::Rng + ?Sized>(&self, rng: &mut R) -> Result<Problem> {
        for _ in 0..TRAIN_REJECT_LIMIT {
            let p = Problem::generate(&self.difficulty, rng)?;
            if !self.eval_prompts.contains(&p.prompt) {
                return Ok(p);
            }
        }
        Err(TaskError::TrainSpaceExhausted {
            attempts: TRAIN_REJECT_LIMIT,
        })
    }

    /// A seeded stream of training problems.
    pub fn train_stream(&self, seed: u64) -> TrainStream<'_> {
        TrainStream {
            task: self,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

/// Seeded source of training problems for one run.
#[derive(Debug, Clone)]
pub struct TrainStream<'a> {
    task: &'a ArithmeticTask,
    rng: ChaCha8Rng,
}

impl TrainStream<'_> {
    /// Next training problem.
    pub fn next_problem(&mut self) -> Result<Problem> {
        self.task.sample_train(&mut self.rng)
    }

    /// The next `n` training problems (e.g. the prompts of one RL step).
    pub fn take_problems(&mut self, n: usize) -> Result<Vec<Problem>> {
        (0..n).map(|_| self.next_problem()).collect()
    }

    /// The RNG state word position, for checkpointing a run mid-stream.
    pub fn word_pos(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Restores a position saved with [`TrainStream::word_pos`].
    pub fn set_word_pos(&mut self, pos: u128) {
        self.rng.set_word_pos(pos);
    }
}
