//! The `r3 train` configuration: the TOML sections with their documented defaults and
//! derived settings (`train`), reading it from defaults, a file and `--set key=value`
//! overrides and checking it (`load`, `overrides`, `limits`), and saving it.

pub mod limits;
pub mod load;
pub mod overrides;
pub mod train;

pub use train::{
    attention_tiles, AlgoConfig, CheckpointConfig, DataConfig, EvalConfig, OptimConfig,
    RolloutBackend, RolloutConfig, RouterReplay, TaskConfig, TrainConfig,
    DEFAULT_ATTENTION_TILE_MIB, DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
};
