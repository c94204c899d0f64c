//! Integration tests of r3-routing, one binary with a module per concern.

mod common;

mod align;
mod canonical;
mod divergence;
mod fuzz;
mod layout;
mod limits;
mod load;
mod mismatch;
mod placement;
mod roundtrip;
mod sentinel;
mod table;
