//! The accounting of `r3 bench step`: the phases of an RL step as the bench names them,
//! each phase's matrix work and memory traffic counted from the config and the step's own
//! lengths, the two limits of the machine a phase runs on (GEMM peak, streaming bandwidth)
//! and the roofline they give, and the table's rows (medians, shares, the share of the limit
//! reached). A phase whose machine was not measured (a fleet's rollout, weights crossing
//! between two devices) has no limit: unknown, never a guess.

use std::ops::Range;

use r3_model::{Config, SharedLen};
use r3_train::rl::micro_batches::pack_rows;
use r3_train::rl::step::StepTrace;
use r3_train::StepMetrics;

use super::matmul_work::{flops_per_token, generation_flops_after, head_macs, MachineLimits};

/// The phases of a step as the bench names them, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Rollout,
    OldLogp,
    UpdateForward,
    UpdateBackward,
    Optimiser,
    WeightSync,
    Other,
}

pub(crate) const PHASES: [Phase; 7] = [
    Phase::Rollout,
    Phase::OldLogp,
    Phase::UpdateForward,
    Phase::UpdateBackward,
    Phase::Optimiser,
    Phase::WeightSync,
    Phase::Other,
];

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Rollout => "rollout+capture",
            Phase::OldLogp => "old log-probs",
            Phase::UpdateForward => "update forward",
            Phase::UpdateBackward => "update backward",
            Phase::Optimiser => "optimiser",
            Phase::WeightSync => "weight sync",
            Phase::Other => "other",
        }
    }

    /// Seconds of this phase in a step's metrics line; `Other` is the rest of `wall_s`.
    pub(crate) fn seconds(self, m: &StepMetrics, wall_s: f64) -> f64 {
        match self {
            Phase::Rollout => m.rollout_s,
            Phase::OldLogp => m.old_logp_s,
            Phase::UpdateForward => m.update_forward_s,
            Phase::UpdateBackward => m.update_backward_s,
            Phase::Optimiser => m.update_optim_s,
            Phase::WeightSync => m.sync_s,
            Phase::Other => {
                let named = m.rollout_s
                    + m.old_logp_s
                    + m.update_forward_s
                    + m.update_backward_s
                    + m.update_optim_s
                    + m.sync_s;
                (wall_s - named).max(0.0)
            }
        }
    }

    /// The memory high-water mark of the part of the step this phase is in (the update's
    /// forward, backward and optimiser share the update's mark).
    pub(crate) fn peak_mib(self, m: &StepMetrics) -> Option<f64> {
        match self {
            Phase::Rollout => m.rollout_peak_mib,
            Phase::OldLogp => m.old_logp_peak_mib,
            Phase::UpdateForward | Phase::UpdateBackward | Phase::Optimiser => m.update_peak_mib,
            Phase::WeightSync => m.sync_peak_mib,
            Phase::Other => None,
        }
    }
}

/// The matrix work and the memory traffic of a phase.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Work {
    /// Multiply-add FLOPs (2 per MAC); `None` for a phase without matrix work (the
    /// optimiser, the weight sync, a pass the step did not run).
    pub(crate) flops: Option<f64>,
    /// Bytes the phase must at least move between memory and the cores.
    pub(crate) bytes: f64,
}

/// Fewest seconds `machine` needs for `w` (the roofline, [`MachineLimits::step_seconds`]):
/// its FLOPs at the GEMM peak or its bytes at the bandwidth, whichever takes longer; the
/// bytes alone where it does no counted matrix work.
pub(crate) fn limit_seconds(machine: &MachineLimits, w: Work) -> f64 {
    machine.step_seconds(w.flops.unwrap_or(0.0), w.bytes)
}

/// Each value's share of their sum, in percent (all 0 for a zero sum).
pub(crate) fn shares_percent(values: &[f64]) -> Vec<f64> {
    let total: f64 = values.iter().sum();
    values
        .iter()
        .map(|v| if total > 0.0 { 100.0 * v / total } else { 0.0 })
        .collect()
}

/// The median (the mean of the middle two for an even count); 0 for none.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// FLOPs of a training forward over one sequence of `len` tokens: every position through
/// the model, attending over the positions before it, and the positions of `head` through
/// the vocabulary head (`0..len`: all of them, as a whole forward; a policy's scoring heads
/// the predictions of its response tokens, `prompt_len − 1 .. len − 1`).
pub(crate) fn training_forward_flops(cfg: &Config, len: usize, head: Range<usize>) -> f64 {
    (0..len)
        .map(|p| flops_per_token(cfg, p + 1, head.contains(&p)))
        .sum()
}

/// Sums `f` (of a sequence's length and prompt length) over `rows` of the step's sequences.
pub(crate) fn sum_rows(
    trace: &StepTrace,
    rows: impl Iterator<Item = usize>,
    f: impl Fn(usize, usize) -> f64,
) -> f64 {
    rows.map(|r| f(trace.sequences[r].len(), trace.prompt_lens[r]))
        .sum()
}

/// How the trainer packs an update's sequences into micro-batches (`algo.*`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MicroBatching {
    /// `algo.max_tokens_per_micro_batch` (0: one micro-batch).
    pub(crate) max_tokens: usize,
    /// `algo.share_prefixes` (packs by token order).
    pub(crate) share_prefixes: bool,
}

impl MicroBatching {
    /// Whether the update of `rows` of `trace` ran in several micro-batches: the trainer's
    /// own packing ([`pack_rows`]) of those sequences.
    fn summed(&self, trace: &StepTrace, rows: &[usize]) -> bool {
        let sequences: Vec<Vec<u32>> = rows.iter().map(|&r| trace.sequences[r].clone()).collect();
        pack_rows(&sequences, self.max_tokens, self.share_prefixes).len() > 1
    }
}

/// What the bench knows of the model trained and of how the trainer holds it.
pub(crate) struct ModelFacts<'a> {
    pub(crate) cfg: &'a Config,
    /// Trainable parameters.
    pub(crate) params: f64,
    /// Bytes per weight of the rollout engine's precision.
    pub(crate) rollout_weight_bytes: f64,
    /// Bytes of weights one training forward reads (each matrix in the format its GEMMs
    /// read: f32 masters, or a 16-bit copy or 16-bit weights where the trainer holds them).
    pub(crate) forward_weight_bytes: f64,
    /// Bytes one optimiser step moves (the gradient norm's read, then AdamW's pass) after
    /// an update of one micro-batch.
    pub(crate) optimiser_bytes: f64,
    /// The same after an update of several micro-batches, whose gradient sums can be wider
    /// than one backward's gradients (f32 sums of bf16 gradients).
    pub(crate) summed_optimiser_bytes: f64,
    /// How the trainer splits an update into micro-batches, to tell which updates summed.
    pub(crate) micro_batches: MicroBatching,
    /// Bytes the weight sync moves (the trainer's weights read once, written at the
    /// rollout's precision).
    pub(crate) sync_bytes: f64,
    /// Whether the trainer's attention runs the queries of positions another sequence
    /// computed (`algo.share_prefixes`): a GPU's does, in the padded layout; the CPU's op
    /// skips them.
    pub(crate) shared_queries_run: bool,
}

/// Bytes of weights the rollout engine reads over the step: the whole model per forward,
/// the routed experts only in the expected share a forward of `tokens` tokens hits (with
/// routing uniform over the experts). The first forward is the prefill of every prompt
/// (less what the engine read from its prefix cache), then one per new token of the
/// longest response, over the sequences still generating (all at once: the step's sequences
/// fit the engine's running batch).
pub(crate) fn rollout_bytes(model: &ModelFacts<'_>, trace: &StepTrace) -> f64 {
    let cfg = model.cfg;
    let (experts, miss) = match &cfg.moe {
        Some(moe) => {
            let layers = (0..cfg.num_hidden_layers)
                .filter(|&l| cfg.is_moe_layer(l))
                .count();
            let per_expert = 3.0 * (cfg.hidden_size * moe.expert_intermediate_size) as f64;
            let experts = (layers * moe.num_experts) as f64 * per_expert;
            (experts, 1.0 - moe.top_k as f64 / moe.num_experts as f64)
        }
        None => (0.0, 1.0),
    };
    let dense = model.params - experts;
    let responses: Vec<usize> = (0..trace.sequences.len())
        .map(|r| trace.sequences[r].len() - trace.prompt_lens[r])
        .collect();
    let longest = responses.iter().copied().max().unwrap_or(0);
    (0..longest)
        .map(|j| match j {
            0 => (0..trace.prompt_lens.len())
                .map(|r| trace.prompt_lens[r] - cached(trace, r))
                .sum::<usize>(),
            _ => responses.iter().filter(|&&n| n > j).count(),
        })
        .map(|tokens| {
            let hit = 1.0 - miss.powi(i32::try_from(tokens).unwrap_or(i32::MAX));
            (dense + experts * hit) * model.rollout_weight_bytes
        })
        .sum()
}

/// Prompt tokens of sequence `r` its rollout read from the prefix cache (none where the
/// trace does not say), at most all but the prompt's last.
fn cached(trace: &StepTrace, r: usize) -> usize {
    let prompt = trace.prompt_lens[r];
    trace
        .cached_tokens
        .get(r)
        .map_or(0, |&c| c.min(prompt.saturating_sub(1)))
}

/// The work of each phase of one step, from what it ran: the sequences of its trace (their
/// prompts and responses), the updates it applied, and whether it had an old-log-prob pass.
pub(crate) fn step_work(model: &ModelFacts<'_>, trace: &StepTrace, old_pass: bool) -> [Work; 7] {
    let cfg = model.cfg;
    let n = trace.sequences.len();
    let weights = model.forward_weight_bytes;
    // The scoring feeds each sequence but its last token, and its head runs over each row's
    // response predictions only.
    let scored = |len: usize, prompt_len: usize| {
        let fed = len.saturating_sub(1);
        training_forward_flops(cfg, fed, prompt_len.saturating_sub(1)..fed)
    };
    // A sequence's leading positions computed for another sequence (`algo.share_prefixes`)
    // ran no layer for it: not its projections, routers and experts, nor (on the CPU) its
    // queries' attention (a GPU's attention runs them: context 0 leaves that work counted).
    // Where the head ran once per distinct row, the head rows it read that another position
    // computed first did not run for it either.
    let not_run = |lens: &[SharedLen]| -> f64 {
        lens.iter()
            .map(|shared| {
                let layers: f64 = (0..shared.positions)
                    .map(|p| match model.shared_queries_run {
                        true => flops_per_token(cfg, 0, false),
                        false => flops_per_token(cfg, p + 1, false),
                    })
                    .sum();
                layers + 2.0 * shared.head as f64 * head_macs(cfg)
            })
            .sum()
    };
    let unshared = |flops: f64, lens: &[SharedLen]| flops - not_run(lens);
    let all_forward = unshared(sum_rows(trace, 0..n, scored), &trace.old_shared_lens);
    let update_rows = trace
        .updates
        .iter()
        .flat_map(|(rows, _)| rows.iter().copied());
    let update_forward = unshared(
        sum_rows(trace, update_rows, scored),
        &trace.update_shared_lens,
    );
    let updates = trace.updates.len() as f64;
    let optimiser: f64 = trace
        .updates
        .iter()
        .map(|(rows, _)| match model.micro_batches.summed(trace, rows) {
            true => model.summed_optimiser_bytes,
            false => model.optimiser_bytes,
        })
        .sum();
    let mut work = [Work::default(); 7];
    for (slot, phase) in work.iter_mut().zip(PHASES) {
        *slot = match phase {
            // A prompt's positions read from the prefix cache were not computed.
            Phase::Rollout => Work {
                flops: Some(
                    (0..n)
                        .map(|r| {
                            let (len, prompt) = (trace.sequences[r].len(), trace.prompt_lens[r]);
                            generation_flops_after(cfg, cached(trace, r), prompt, len - prompt)
                        })
                        .sum(),
                ),
                bytes: rollout_bytes(model, trace),
            },
            Phase::OldLogp if old_pass => Work {
                flops: Some(all_forward),
                bytes: weights,
            },
            Phase::UpdateForward => Work {
                flops: Some(update_forward),
                bytes: updates * weights,
            },
            // Backward ≈ 2 × forward: the gradients of the activations and of the weights.
            Phase::UpdateBackward => Work {
                flops: Some(2.0 * update_forward),
                bytes: updates * 2.0 * weights,
            },
            // The gradient norm and AdamW: parameter, gradient (or its sum over the update's
            // micro-batches) and moments read, parameter and moments written, per update, no
            // matrix work.
            Phase::Optimiser => Work {
                flops: None,
                bytes: optimiser,
            },
            // The trainer's weights are read once and written at the rollout precision: the
            // trainer vouches for their range (checked at start, kept by the guarded update,
            // `HeldTensors`), so the engine does not scan them again.
            Phase::WeightSync => Work {
                flops: None,
                bytes: model.sync_bytes,
            },
            Phase::OldLogp | Phase::Other => Work::default(),
        };
    }
    work
}

/// One measured step.
pub(crate) struct Sample {
    pub(crate) wall_s: f64,
    pub(crate) seconds: [f64; 7],
    pub(crate) work: [Work; 7],
    pub(crate) metrics: StepMetrics,
    pub(crate) tokens: usize,
    pub(crate) sequences: usize,
    /// Prompt tokens of the step, and of those the ones the rollout read from the prefix
    /// cache.
    pub(crate) prompt_tokens: (usize, usize),
    /// Positions the update forwards computed once for several sequences.
    pub(crate) shared_positions: usize,
}

/// The bench's result for one phase (or the whole step).
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) name: &'static str,
    pub(crate) seconds: f64,
    pub(crate) share_pct: f64,
    pub(crate) flops: Option<f64>,
    pub(crate) bytes: f64,
    /// Fewest seconds the phase's machine needs for its work; `None` where that machine
    /// was not measured.
    pub(crate) limit_s: Option<f64>,
    pub(crate) peak_mib: Option<f64>,
}

impl Row {
    /// The share of the machine's limit the phase reaches (limit time over its time).
    pub(crate) fn of_limit_pct(&self) -> Option<f64> {
        self.limit_s
            .filter(|&l| self.seconds > 0.0 && l > 0.0)
            .map(|l| 100.0 * l / self.seconds)
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "phase": self.name,
            "seconds": self.seconds,
            "share_pct": self.share_pct,
            "gflop": self.flops.map(|f| f / 1e9),
            "gbytes": self.bytes / 1e9,
            "limit_s": self.limit_s,
            "of_limit_pct": self.of_limit_pct(),
            "peak_mib": self.peak_mib,
        })
    }
}

/// The limit of `work` on `machine`: none where the machine is unknown, unless there is
/// no work to limit (no time is the fewest for nothing).
fn limit_on(machine: Option<&MachineLimits>, work: Work) -> Option<f64> {
    match machine {
        Some(m) => Some(limit_seconds(m, work)),
        None if work.bytes == 0.0 && work.flops.unwrap_or(0.0) == 0.0 => Some(0.0),
        None => None,
    }
}

/// The table's rows from the measured steps: medians of time and work per phase, each held
/// to the machine it ran on (`machines`, in [`PHASES`] order; `None`: not measured), shares
/// of their sum, and the highest memory mark seen.
pub(crate) fn summarise(
    samples: &[Sample],
    machines: &[Option<MachineLimits>; PHASES.len()],
) -> (Vec<Row>, Row) {
    let times: Vec<f64> = (0..PHASES.len())
        .map(|i| median(&samples.iter().map(|s| s.seconds[i]).collect::<Vec<_>>()))
        .collect();
    let shares = shares_percent(&times);
    let max_of = |v: Vec<Option<f64>>| v.into_iter().flatten().reduce(f64::max);
    let rows: Vec<Row> = PHASES
        .iter()
        .enumerate()
        .map(|(i, &phase)| {
            let flops: Option<Vec<f64>> = samples.iter().map(|s| s.work[i].flops).collect();
            let work = Work {
                flops: flops.map(|f| median(&f)),
                bytes: median(&samples.iter().map(|s| s.work[i].bytes).collect::<Vec<_>>()),
            };
            Row {
                name: phase.name(),
                seconds: times[i],
                share_pct: shares[i],
                flops: work.flops,
                bytes: work.bytes,
                limit_s: limit_on(machines[i].as_ref(), work),
                peak_mib: max_of(samples.iter().map(|s| phase.peak_mib(&s.metrics)).collect()),
            }
        })
        .collect();
    let step = Row {
        name: "step",
        seconds: rows.iter().map(|r| r.seconds).sum(),
        share_pct: shares.iter().sum(),
        // Counted where the rollout's is (the same attention counts every phase's).
        flops: rows[0]
            .flops
            .map(|_| rows.iter().filter_map(|r| r.flops).sum()),
        bytes: rows.iter().map(|r| r.bytes).sum(),
        // Known only where every phase's is.
        limit_s: rows.iter().map(|r| r.limit_s).sum(),
        peak_mib: max_of(samples.iter().map(|s| s.metrics.peak_mib).collect()),
    };
    (rows, step)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cmd::matmul_work::tests::tiny;

    #[test]
    fn the_roofline_is_the_lower_of_compute_and_bandwidth() {
        let m = MachineLimits {
            peak_gflops: 100.0,
            bandwidth_gbs: 10.0,
        };
        let low = Work {
            flops: Some(1e9),
            bytes: 1e9,
        };
        let high = Work {
            flops: Some(100e9),
            bytes: 1e9,
        };
        // 1 FLOP/byte: bandwidth-bound (its bytes at 10 GB/s); 100 FLOP/byte: compute-bound
        // (its FLOPs at 100 GFLOP/s).
        assert_eq!(limit_seconds(&m, low), 1e9 / (m.bandwidth_gbs * 1e9));
        assert_eq!(limit_seconds(&m, high), 100e9 / (m.peak_gflops * 1e9));
        assert_eq!(limit_seconds(&m, low), 0.1, "1 GB at 10 GB/s");
        assert_eq!(limit_seconds(&m, high), 1.0, "100 GFLOP at 100 GFLOP/s");
        // the same as the larger of the two times, as a roofline must be
        for w in [low, high] {
            let f = w.flops.expect("counted");
            assert_eq!(
                limit_seconds(&m, w),
                (f / (m.peak_gflops * 1e9)).max(w.bytes / (m.bandwidth_gbs * 1e9))
            );
        }
        // no matrix work: the bytes at the bandwidth; no bytes: the FLOPs at the peak
        let optimiser = Work {
            flops: None,
            bytes: 28e9,
        };
        assert_eq!(limit_seconds(&m, optimiser), 2.8);
        let pure = Work {
            flops: Some(50e9),
            bytes: 0.0,
        };
        assert_eq!(limit_seconds(&m, pure), 0.5);
    }

    /// Each phase is held to its own machine: the rollout to a GPU's (here 1,000 GFLOP/s,
    /// 1,000 GB/s), the update to the CPU's (100 GFLOP/s, 10 GB/s); a phase with work on an
    /// unmeasured machine has no limit, and then neither has the step.
    #[test]
    fn each_phase_is_held_to_its_own_machine() {
        let gpu = MachineLimits {
            peak_gflops: 1000.0,
            bandwidth_gbs: 1000.0,
        };
        let cpu = MachineLimits {
            peak_gflops: 100.0,
            bandwidth_gbs: 10.0,
        };
        let mut work = [Work::default(); 7];
        // rollout: 100 GFLOP over 1 GB (compute-bound on the GPU: 0.1 s)
        work[0] = Work {
            flops: Some(100e9),
            bytes: 1e9,
        };
        // update forward: 10 GFLOP over 0.1 GB (compute-bound on the CPU: 0.1 s)
        work[2] = Work {
            flops: Some(10e9),
            bytes: 0.1e9,
        };
        // weight sync: 1 GB, no matrix work
        work[5] = Work {
            flops: None,
            bytes: 1e9,
        };
        let sample = Sample {
            wall_s: 1.0,
            seconds: [0.2, 0.0, 0.4, 0.0, 0.0, 0.4, 0.0],
            work,
            metrics: StepMetrics::default(),
            tokens: 10,
            sequences: 1,
            prompt_tokens: (5, 0),
            shared_positions: 0,
        };
        let mut machines = [None; PHASES.len()];
        machines[0] = Some(gpu);
        machines[1] = Some(cpu);
        machines[2] = Some(cpu);
        machines[5] = Some(cpu);
        let (rows, step) = summarise(std::slice::from_ref(&sample), &machines);
        assert_eq!(rows[0].limit_s, Some(0.1));
        assert_eq!(rows[0].of_limit_pct(), Some(50.0), "0.1 s of 0.2 s");
        assert_eq!(rows[2].limit_s, Some(0.1));
        assert_eq!(rows[5].limit_s, Some(0.1), "1 GB at 10 GB/s");
        // no work and no machine: nothing to wait for
        assert_eq!(rows[6].limit_s, Some(0.0));
        assert_eq!(rows[1].limit_s, Some(0.0), "no old pass ran");
        let sum = step.limit_s.expect("every phase's limit known");
        assert!(
            (sum - 0.3).abs() < 1e-12,
            "the phases' limits add up: {sum}"
        );
        // The sync between two devices: no machine measured, so no limit for it or the step.
        machines[5] = None;
        let (rows, step) = summarise(std::slice::from_ref(&sample), &machines);
        assert_eq!(rows[5].limit_s, None);
        assert_eq!(rows[5].of_limit_pct(), None);
        assert_eq!(step.limit_s, None);
        assert_eq!(rows[0].limit_s, Some(0.1), "the others keep theirs");
        // The better of two readings of one machine counts, limit by limit.
        let slow = MachineLimits {
            peak_gflops: 150.0,
            bandwidth_gbs: 5.0,
        };
        assert_eq!(
            cpu.highest(slow),
            MachineLimits {
                peak_gflops: 150.0,
                bandwidth_gbs: 10.0
            }
        );
    }

    #[test]
    fn shares_add_up_and_the_median_takes_the_middle() {
        let s = shares_percent(&[1.0, 3.0, 0.0, 4.0]);
        assert_eq!(s, vec![12.5, 37.5, 0.0, 50.0]);
        assert_eq!(s.iter().sum::<f64>(), 100.0);
        assert_eq!(shares_percent(&[0.0, 0.0]), vec![0.0, 0.0]);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    /// Facts of a model with round byte counts, trained on the CPU.
    fn by_hand_facts(cfg: &Config, max_tokens: usize, share_prefixes: bool) -> ModelFacts<'_> {
        ModelFacts {
            cfg,
            params: 1000.0,
            rollout_weight_bytes: 2.0,
            forward_weight_bytes: 4000.0,
            optimiser_bytes: 32_000.0,
            summed_optimiser_bytes: 48_000.0,
            micro_batches: MicroBatching {
                max_tokens,
                share_prefixes,
            },
            sync_bytes: 6000.0,
            shared_queries_run: false,
        }
    }

    /// By hand on matmul_work's tiny config: per token 2 · (48 projection MACs + 2·4·ctx
    /// attention + 144 experts and router + 40 head) FLOPs.
    #[test]
    fn a_step_counts_its_work_by_hand() {
        let cfg = tiny();
        let per = |ctx: f64| 2.0 * (48.0 + 8.0 * ctx + 144.0 + 40.0);
        // one sequence of 2 prompt + 1 response tokens, one update, an old pass
        let trace = StepTrace {
            sequences: vec![vec![1, 2, 3]],
            prompt_lens: vec![2],
            updates: vec![(vec![0], None)],
            ..StepTrace::default()
        };
        let facts = by_hand_facts(&cfg, 0, false);
        let w = step_work(&facts, &trace, true);
        // positions 0 and 1 fed (the last token predicts nothing: never fed), the head at
        // position 1 only (the prompt's last, predicting the response)
        let forward = per(1.0) - 2.0 * 40.0 + per(2.0);
        assert_eq!(
            w[1].flops,
            Some(forward),
            "old pass: two positions, the head on one"
        );
        assert_eq!(w[2].flops, Some(forward), "update forward");
        assert_eq!(w[3].flops, Some(2.0 * forward), "backward = 2 × forward");
        // rollout: prefill of 2 (head on the last only), then no decode step for 1 token
        let prefill = per(1.0) - 2.0 * 40.0 + per(2.0);
        assert_eq!(w[0].flops, Some(prefill));
        // One forward (the prefill of 2 tokens): 360 expert weights (6 experts of 3·4·5),
        // of which 2 tokens top-2 of 6 hit 1 − (4/6)² = 5/9; 640 others, all in f16.
        assert!(
            (w[0].bytes - (640.0 + 200.0) * 2.0).abs() < 1e-9,
            "{}",
            w[0].bytes
        );
        assert_eq!(w[1].bytes, 4000.0, "old pass: the weights read once");
        assert_eq!(w[3].bytes, 8000.0, "backward: twice");
        assert_eq!(w[4].bytes, 32_000.0, "one update's optimiser step");
        assert_eq!(w[4].flops, None);
        assert_eq!(w[5].bytes, 6000.0, "one sync");
        assert_eq!(w[6], Work::default());
        // no old pass: no work there
        assert_eq!(step_work(&facts, &trace, false)[1], Work::default());
        // The prompt's first position read from the prefix cache: the prefill computes the
        // second alone (attending to both), and its one forward of 1 token hits
        // 1 − 4/6 = 1/3 of the expert weights.
        let cached = StepTrace {
            cached_tokens: vec![1],
            ..trace
        };
        let w = step_work(&facts, &cached, true);
        assert_eq!(w[0].flops, Some(per(2.0)));
        assert!(
            (w[0].bytes - (640.0 + 120.0) * 2.0).abs() < 1e-9,
            "{}",
            w[0].bytes
        );
        // The first position of the update's and of the old pass's sequence computed for
        // another sequence (a shared prefix): its projections, its attention over its one
        // visible key and its feed-forward (48 + 8 + 144 multiply-adds) are not the step's
        // work; the head's (40 from the row's first prediction on) still is.
        let one = SharedLen {
            positions: 1,
            head: 0,
        };
        let shared = StepTrace {
            update_shared_lens: vec![one],
            old_shared_lens: vec![one],
            ..cached.clone()
        };
        let w = step_work(&facts, &shared, true);
        let not_run = 2.0 * (48.0 + 8.0 + 144.0);
        assert_eq!(w[1].flops, Some(forward - not_run), "old pass");
        assert_eq!(w[2].flops, Some(forward - not_run), "update forward");
        assert_eq!(w[3].flops, Some(2.0 * (forward - not_run)));
        // Two positions shared, one head row computed for the other sequence: the layers
        // of positions 0 and 1 (attention over 1 and 2 keys) are not the step's work, nor
        // the head at position 1 (the prompt's last, the row's first prediction, the one
        // its head read); position 0 never ran the head.
        let two = SharedLen {
            positions: 2,
            head: 1,
        };
        let shared = StepTrace {
            update_shared_lens: vec![two],
            old_shared_lens: vec![SharedLen::default()],
            ..cached
        };
        let w = step_work(&facts, &shared, true);
        let not_run = 2.0 * (48.0 + 8.0 + 144.0) + 2.0 * (48.0 + 16.0 + 144.0) + 2.0 * 40.0;
        assert_eq!(w[1].flops, Some(forward), "old pass: nothing shared");
        assert_eq!(w[2].flops, Some(forward - not_run), "update forward");
        // A GPU's attention runs the shared positions' queries (over 1 and 2 keys) in the
        // padded layout: that work stays counted.
        let gpu = ModelFacts {
            shared_queries_run: true,
            ..facts
        };
        let w = step_work(&gpu, &shared, true);
        assert_eq!(
            w[2].flops,
            Some(forward - not_run + 2.0 * (8.0 + 16.0)),
            "update forward on a GPU"
        );
    }

    /// The optimiser's bytes follow each update's micro-batches, packed as the trainer packs
    /// them: one update of two 3-token sequences within a budget of 6 tokens (one
    /// micro-batch) reads the gradients, within 3 (two micro-batches) their sums; two
    /// updates of one sequence each, one micro-batch each.
    #[test]
    fn the_optimisers_bytes_follow_the_updates_micro_batches() {
        let cfg = tiny();
        let trace = |updates: Vec<Vec<usize>>| StepTrace {
            sequences: vec![vec![1, 2, 3], vec![1, 2, 4]],
            prompt_lens: vec![2, 2],
            updates: updates.into_iter().map(|rows| (rows, None)).collect(),
            ..StepTrace::default()
        };

        for share in [false, true] {
            let one_update = trace(vec![vec![0, 1]]);
            let optimiser = |max_tokens, t: &StepTrace| {
                step_work(&by_hand_facts(&cfg, max_tokens, share), t, false)[4].bytes
            };
            assert_eq!(optimiser(6, &one_update), 32_000.0, "one micro-batch");
            assert_eq!(optimiser(0, &one_update), 32_000.0, "no budget");
            assert_eq!(optimiser(3, &one_update), 48_000.0, "two micro-batches");
            let two_updates = trace(vec![vec![0], vec![1]]);
            assert_eq!(
                optimiser(3, &two_updates),
                64_000.0,
                "two updates of one each"
            );
        }
    }
}
