//! The one error type of r3-train: the pure training pieces, the configuration, the RL
//! loop, pretraining and checkpoints. Each variant names what is wrong in its fields; a
//! failure in another crate or in the OS is kept as the `source`.

use std::path::PathBuf;

use candle_core::DType;

/// Everything that can stop training or reject its inputs.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The training model failed.
    #[error("training model: {0}")]
    Model(#[from] r3_model::ModelError),
    /// `train.device` names no device, or one this build or machine cannot open.
    #[error("train.device: {0}")]
    Device(#[from] r3_model::DeviceError),
    /// The rollout engine failed.
    #[error("rollout engine: {0}")]
    Rollout(#[from] r3_rollout::RolloutError),
    /// The task (problems, tokenizer, reward) failed.
    #[error("task: {0}")]
    Task(#[from] r3_tasks::TaskError),
    /// The rollout fleet failed (no worker left, a request out of attempts, a sync).
    #[error("rollout fleet: {0}")]
    Fleet(#[from] r3_fleet::FleetError),
    /// Route tables or routing statistics failed.
    #[error("routes: {0}")]
    Route(#[from] r3_routing::RouteError),
    /// Tokenizing, decoding or rendering a chat template failed.
    #[error("text: {0}")]
    Text(#[from] r3_text::TextError),
    /// A model directory's tokenizer or chat template could not be loaded.
    #[error("tokenizer / chat template of {dir}: {source}")]
    ModelText {
        /// The model directory.
        dir: PathBuf,
        /// What r3-text reported.
        source: r3_text::TextError,
    },
    /// Text with a character no token of the vocabulary covers (it would be dropped).
    #[error("the tokenizer cannot spell {ch:?} (character {index} of {text:?}): it is outside its alphabet")]
    UnspellableText {
        /// The character.
        ch: char,
        /// Its byte offset in the text.
        index: usize,
        /// The text.
        text: String,
    },

    /// A tensor whose shape does not fit the others.
    #[error("{what} has shape {got:?}, expected {expected}")]
    Shape {
        /// Which input.
        what: String,
        /// Its shape.
        got: Vec<usize>,
        /// The shape it needs (dims or a pattern such as `[B, T]`).
        expected: String,
    },
    /// A tensor that is not f32 (the training engine is f32).
    #[error("{what} has dtype {got:?}, expected f32")]
    Dtype {
        /// Which input.
        what: &'static str,
        /// Its dtype.
        got: DType,
    },
    /// Two collections that must have one entry per item differ in length.
    #[error("{what}: {got} entries, expected {expected}")]
    Length {
        /// What was counted.
        what: String,
        /// Entries given.
        got: usize,
        /// Entries needed.
        expected: usize,
    },
    /// A row index past the end of a batch.
    #[error("row {row} of a batch of {len}")]
    RowOutOfRange {
        /// The index asked for.
        row: usize,
        /// Rows there are.
        len: usize,
    },
    /// A numeric argument outside its valid range.
    #[error("{name} = {value} must be {expected}")]
    OutOfRange {
        /// The argument.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The valid range, e.g. `> 0`.
        expected: &'static str,
    },
    /// Rewards that do not split into whole groups.
    #[error("{rewards} rewards do not split into groups of {group_size}")]
    RaggedGroups {
        /// Rewards given.
        rewards: usize,
        /// The group size.
        group_size: usize,
    },
    /// A NaN or infinite reward.
    #[error("reward {index} is not finite ({value})")]
    NonFiniteReward {
        /// Its position.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A PPO clip range outside `0 <= low < 1`, `high >= 0`.
    #[error("clip range needs 0 <= eps_low < 1 and eps_high >= 0, got low {low}, high {high}")]
    ClipRange {
        /// `ε_low`.
        low: f64,
        /// `ε_high`.
        high: f64,
    },
    /// A sequence whose prompt is empty or leaves no response.
    #[error("sequence {sequence}: prompt of {prompt_len} tokens in a sequence of {len} (need 1 <= prompt < len)")]
    PromptLength {
        /// The sequence.
        sequence: usize,
        /// Its prompt length.
        prompt_len: usize,
        /// Its total length.
        len: usize,
    },
    /// A variable given twice to the optimiser.
    #[error("variable `{name}` given twice to AdamW")]
    DuplicateVariable {
        /// Its name.
        name: String,
    },
    /// Optimiser state without the moment of a variable.
    #[error("optimiser state lacks `{key}`")]
    MissingOptimizerState {
        /// The missing tensor name.
        key: String,
    },

    /// A config key that does not exist.
    #[error("unknown config key `{key}` (known keys here: {known})")]
    UnknownConfigKey {
        /// The dotted key as written.
        key: String,
        /// The keys that exist at that level.
        known: String,
    },
    /// A `--set` override that is not `key=value` or whose value has the wrong type.
    #[error("override `{text}`: {reason}")]
    BadOverride {
        /// The override as given.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A config value that is well typed but makes no sense.
    #[error("config: {field}: {reason}")]
    InvalidConfig {
        /// The dotted field (or section).
        field: &'static str,
        /// What it must be.
        reason: String,
    },
    /// A config (file, text or the layered values) that does not parse as the config.
    #[error("config {origin}: {source}")]
    ConfigParse {
        /// The file, or what was parsed.
        origin: String,
        /// The TOML error.
        source: Box<toml::de::Error>,
    },
    /// A config that cannot be written as TOML.
    #[error("serialising the config: {0}")]
    ConfigSerialize(#[source] Box<toml::ser::Error>),
    /// An unknown `router_replay` name.
    #[error("router replay `{0}` is none of `disabled`, `R2`, `R3`")]
    UnknownReplayMode(String),
    /// The rollout precision could not be parsed.
    #[error("rollout.dtype `{text}`: {source}")]
    RolloutDtype {
        /// The value as written.
        text: String,
        /// Why the engine rejected it.
        source: Box<r3_rollout::RolloutError>,
    },

    /// A rollout came from weights older than `rollout.max_staleness` allows.
    #[error("step {step}: a rollout came from weight version {version}, {age} versions behind the trainer's {policy} (rollout.max_staleness = {max})")]
    StaleRollout {
        /// The step it was for.
        step: u64,
        /// Oldest weight version in the batch.
        version: u64,
        /// The trainer's weight version.
        policy: u64,
        /// How far behind.
        age: u64,
        /// The allowed age.
        max: u64,
    },

    /// Every group of a step was dropped because requests of theirs failed for their own
    /// fault (a fleet's 400 / 413 / 422, or the same answer from two workers): nothing is
    /// left to train on.
    #[error("step {step}: every rollout group failed ({groups} groups dropped, {requests} requests failed for their own fault, over every rollout round); the first: {source}")]
    AllRolloutGroupsFailed {
        /// The step.
        step: u64,
        /// Groups dropped.
        groups: usize,
        /// Requests that failed.
        requests: usize,
        /// The first failure, with the worker's message.
        source: Box<r3_fleet::FleetError>,
    },

    /// A phase of a training step ran the GPU out of memory: the step, the phase and the
    /// settings that lower its memory are named beside the driver's error.
    #[error(
        "step {step}, {phase}: the GPU ran out of memory (lower {}): {source}",
        .phase.memory_settings()
    )]
    OutOfMemory {
        /// The step.
        step: u64,
        /// `rollout`, `update` or `weight sync`.
        phase: StepPhase,
        /// The error as it came.
        source: Box<TrainError>,
    },
    /// The engine answered a different number of requests than it was given.
    #[error("engine returned {got} results for {expected} requests")]
    EngineResults {
        /// Results returned.
        got: usize,
        /// Requests sent.
        expected: usize,
    },
    /// R3 needs the rollout routes of every trajectory and one came without.
    #[error("trajectory {trajectory} has no rollout routes (R3 needs the engine to return them)")]
    MissingRolloutRoutes {
        /// The trajectory.
        trajectory: usize,
    },
    /// Rollout routes that do not cover rows `[0, len − 1)` of their trajectory.
    #[error("trajectory {trajectory}: rollout routes cover {rows} rows from position {start}, expected {expected} from 0")]
    MisalignedRolloutRoutes {
        /// The trajectory.
        trajectory: usize,
        /// First position of the routes.
        start: usize,
        /// Rows of the routes.
        rows: usize,
        /// Rows the trajectory needs (`len − 1`).
        expected: usize,
    },
    /// A replay pass did not use exactly the given experts on every cell.
    #[error("replay not verified ({mode} {pass} pass): {replayed} of {expected} (token, layer) cells were replayed")]
    ReplayNotVerified {
        /// The replay mode's name (`R2` or `R3`).
        mode: &'static str,
        /// `old-logp` or `update`.
        pass: &'static str,
        /// Cells replayed.
        replayed: usize,
        /// Cells the tables provide.
        expected: usize,
    },
    /// An evaluation over no problems.
    #[error("evaluation set is empty")]
    EmptyEvalSet,
    /// A pretraining batch with an empty row.
    #[error("a pretraining batch has an empty row")]
    EmptyPretrainRow,
    /// The training-problem stream ran out.
    #[error("problem stream ended")]
    ProblemStreamEnded,
    /// The variable map's lock was poisoned by a panic elsewhere.
    #[error("VarMap lock poisoned")]
    LockPoisoned,

    /// A run directory that already holds a run.
    #[error("run directory {path} already holds a run; resume it or choose another run_dir")]
    RunExists {
        /// The run directory.
        path: PathBuf,
    },
    /// An output directory path without a final name.
    #[error("out_dir `{path}` has no name")]
    UnnamedOutDir {
        /// The path.
        path: PathBuf,
    },
    /// A model or checkpoint directory whose weights could not be loaded.
    #[error("loading {path}: {source}")]
    Load {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: Box<TrainError>,
    },
    /// A checkpoint written by a different format version.
    #[error("checkpoint {path}: format {found} (this build reads {supported})")]
    CheckpointFormat {
        /// The state file.
        path: PathBuf,
        /// Its format.
        found: u32,
        /// The format this build reads.
        supported: u32,
    },
    /// A checkpoint of a run with another seed.
    #[error("checkpoint {path}: seed {checkpoint} differs from config seed {config}")]
    CheckpointSeed {
        /// The checkpoint.
        path: PathBuf,
        /// Its seed.
        checkpoint: u64,
        /// The config's seed.
        config: u64,
    },
    /// The rollout engine produced a NaN or infinite log-prob.
    #[error("rollout request {request}, response token {token}: log-prob {value} is not finite; {location}")]
    NonFiniteRollout {
        /// Index of the request in its batch.
        request: usize,
        /// Index of the response token.
        token: usize,
        /// The log-prob.
        value: f32,
        /// Where a diagnostic re-run of the sequence first saw a non-finite value.
        location: String,
    },
    /// A checkpoint refused because a weight is NaN or infinite (never written).
    #[error("checkpoint {path} not written: {count} non-finite values in `{variable}`")]
    NonFiniteWeights {
        /// The checkpoint directory it would have been.
        path: PathBuf,
        /// The first variable with a non-finite value.
        variable: String,
        /// How many of its values are non-finite.
        count: usize,
    },
    /// A checkpoint whose manifest is missing, unreadable or does not match its files.
    #[error("checkpoint {path}: {reason}")]
    CheckpointManifest {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Checkpoints exist but none is complete and verified.
    #[error("no usable checkpoint in {path}: {reasons}")]
    NoVerifiedCheckpoint {
        /// The checkpoints directory.
        path: PathBuf,
        /// Why each was skipped, newest first.
        reasons: String,
    },
    /// A checkpoint's optimiser moments that could not be read.
    #[error("checkpoint {path}: {source}")]
    CheckpointTensors {
        /// The safetensors file.
        path: PathBuf,
        /// Why (boxed: keeps every `Result` of the crate small).
        source: Box<candle_core::Error>,
    },
    /// The stream position of a checkpoint is not a number.
    #[error("trainer_state.json: stream_word_pos `{text}`: {source}")]
    StreamPosition {
        /// The value as written.
        text: String,
        /// The parse error.
        source: std::num::ParseIntError,
    },
    /// JSON that could not be written or read.
    #[error("{what}: {source}")]
    Json {
        /// What was (de)serialised, e.g. a file.
        what: String,
        /// The serde error.
        source: serde_json::Error,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
}

/// The phases of a training step, for its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    /// Generating the step's rollouts.
    Rollout,
    /// The policy update (old log-probs, forward, backward, optimiser).
    Update,
    /// Sending the new weights to the rollout engine.
    WeightSync,
}

impl std::fmt::Display for StepPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StepPhase::Rollout => "rollout",
            StepPhase::Update => "update",
            StepPhase::WeightSync => "weight sync",
        })
    }
}

impl StepPhase {
    /// The settings that lower this phase's memory.
    fn memory_settings(self) -> &'static str {
        match self {
            StepPhase::Rollout => "rollout.prompts_per_step or rollout.group_size",
            StepPhase::Update => {
                "algo.max_tokens_per_micro_batch or algo.attention_tile_mib, or turn on \
                 algo.gradient_checkpointing"
            }
            StepPhase::WeightSync => "the rollout engine's budgets, or run it on another device",
        }
    }

    /// `e` as this phase's [`TrainError::OutOfMemory`] where it is a device allocation that
    /// failed (CUDA's `CUDA_ERROR_OUT_OF_MEMORY`, as candle and the rollout engine word
    /// it), else `e` as it came; one already labelled keeps its step and phase (a rollout
    /// drawn ahead fails inside the update that it runs beside).
    pub fn out_of_memory_in(self, step: u64, e: TrainError) -> TrainError {
        if matches!(e, TrainError::OutOfMemory { .. })
            || !r3_model::device::reads_as_out_of_memory(&e)
        {
            return e;
        }
        TrainError::OutOfMemory {
            step,
            phase: self,
            source: Box::new(e),
        }
    }
}

impl TrainError {
    /// An IO error tagged with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> TrainError {
        let path = path.into();
        move |source| TrainError::Io { path, source }
    }

    /// A TOML error of the config `origin` (a file, `text`, the layered `values`).
    pub fn config_parse(origin: impl Into<String>) -> impl FnOnce(toml::de::Error) -> TrainError {
        let origin = origin.into();
        move |source| TrainError::ConfigParse {
            origin,
            source: Box::new(source),
        }
    }

    /// A config that could not be written as TOML.
    pub fn config_serialize(source: toml::ser::Error) -> TrainError {
        TrainError::ConfigSerialize(Box::new(source))
    }

    /// A JSON error tagged with what was being (de)serialised.
    pub fn json(what: impl Into<String>) -> impl FnOnce(serde_json::Error) -> TrainError {
        let what = what.into();
        move |source| TrainError::Json { what, source }
    }

    /// A shape error for `what` with shape `got` where `expected` was needed.
    pub(crate) fn shape(
        what: impl Into<String>,
        got: &[usize],
        expected: impl Into<String>,
    ) -> Self {
        TrainError::Shape {
            what: what.into(),
            got: got.to_vec(),
            expected: expected.into(),
        }
    }
}

/// Result alias for r3-train.
pub type Result<T> = std::result::Result<T, TrainError>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A device allocation that failed becomes the phase's out-of-memory error naming the
    /// step, the phase and the settings that lower it, its source kept; any other error
    /// passes as it came.
    #[test]
    fn an_out_of_memory_error_names_its_step_phase_and_settings() {
        let oom = TrainError::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ));
        let e = StepPhase::Update.out_of_memory_in(7, oom);
        let text = e.to_string();
        assert!(matches!(
            e,
            TrainError::OutOfMemory {
                step: 7,
                phase: StepPhase::Update,
                ..
            }
        ));
        assert!(
            text.starts_with("step 7, update: the GPU ran out of memory")
                && text.contains("algo.max_tokens_per_micro_batch")
                && text.contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "{text}"
        );
        let other = TrainError::UnknownReplayMode("R4".into());
        let e = StepPhase::Rollout.out_of_memory_in(7, other);
        assert!(matches!(e, TrainError::UnknownReplayMode(_)), "{e}");
        // A rollout drawn ahead for step 8 that ran out of memory during step 7's update
        // stays step 8's rollout.
        let ahead = StepPhase::Rollout.out_of_memory_in(
            8,
            TrainError::Candle(candle_core::Error::Msg("out of memory".into())),
        );
        let e = StepPhase::Update.out_of_memory_in(7, ahead);
        assert!(
            matches!(
                &e,
                TrainError::OutOfMemory {
                    step: 8,
                    phase: StepPhase::Rollout,
                    source,
                } if !matches!(**source, TrainError::OutOfMemory { .. })
            ),
            "{e}"
        );
    }
}
