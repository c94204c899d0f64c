//! HTTP server tests: the server runs in-process on an ephemeral port and is exercised with
//! a raw HTTP client. `fake_*` tests use a deterministic fake engine (HTTP layer, batching,
//! validation); `engine` tests serve the tiny HF oracle model with the real engine.

#![recursion_limit = "512"]
mod chat;
mod chat_engine;
mod client_gone;
mod clients;
mod connections;
mod device_engine;
mod engine;
mod fake;
mod fake_http;
mod gated;
mod held_updates;
mod limits;
mod logprob_scale;
mod malformed;
mod paced;
mod rids;
mod security;
mod sglang_parity;
mod streaming;
mod support;
mod weights_update;
