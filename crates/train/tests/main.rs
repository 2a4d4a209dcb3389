//! The integration tests of switchyard-train, in one test binary: each file of `tests/`
//! is a module here (one build and one link instead of one per file; run one file's tests
//! with `cargo test -p switchyard-train --test train parity::`). The two that measure
//! memory are the other binary, `tests/measured.rs`.

mod common;

mod checkpoint;
mod checkpoint_dir;
mod data;
mod dropout;
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
