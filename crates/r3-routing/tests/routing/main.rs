//! Integration tests of r3-routing, one binary with a module per concern.

mod common;

mod align;
mod canonical;
mod divergence;
mod fuzz;
mod hf_config;
mod layout;
mod limits;
mod load;
mod megatron;
mod mismatch;
mod placement;
mod roundtrip;
mod sentinel;
mod table;
mod wire_checks;
