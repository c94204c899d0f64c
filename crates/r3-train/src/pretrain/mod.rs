//! Supervised pretraining of the base models (`r3 pretrain`): its configuration
//! (`config`), the model's shape and the HF `config.json` it writes (`shape`, with the
//! DeepSeek-V3 keys in `deepseek`), the corpora it trains on (`corpus`), the aux-loss-free
//! expert balance of DeepSeek-V3 models (`expert_balance`), and the run itself (`run`).

pub mod config;
pub mod corpus;
pub mod deepseek;
pub mod expert_balance;
pub mod run;
pub mod shape;
