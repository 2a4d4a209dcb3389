//! The integration tests of switchyard-train, in one test binary: each file of `tests/`
//! is a module here (one build and one link instead of one per file; run one file's tests
//! with `cargo test -p switchyard-train --test train parity::`).
//!
//! The binary installs the counting allocator, so every run's report measures each
//! rank's memory (`estimate` and `memory` compare it with the prediction); concurrent
//! tests measure on ledgers of their own.

use switchyard_mem::Counting;

#[global_allocator]
static ALLOC: Counting<std::alloc::System> = Counting(std::alloc::System);

mod common;

mod checkpoint;
mod checkpoint_dir;
mod data;
mod estimate;
mod memory;
mod moe;
mod no_gpt;
mod overlap;
mod parity;
mod parity_mlp;
mod precision;
mod recompute;
mod sequence_parallel;
mod train;
mod zero;
mod zero_thread;
