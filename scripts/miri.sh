#!/usr/bin/env bash
# The kernels' unit tests under Miri (an interpreter that flags undefined behaviour:
# out-of-bounds pointers, overlapping `&mut` borrows across threads, reads of
# uninitialised memory). Miri runs only the portable paths (no AVX-512 under
# `cfg(miri)`); the tests shrink their shapes under it. Installs a nightly toolchain
# with Miri the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal --component miri,rust-src
fi
cargo +nightly miri setup
# Two "CPUs", so the tests' two-thread pools interleave their tasks. Tree Borrows, not
# Stacked Borrows: rayon's crossbeam-epoch breaks a Stacked Borrows rule on its own
# (in its intrusive list, whatever the kernels do).
# rayon's pool threads outlive the tests (-Zmiri-ignore-leaks), and crossbeam turns
# integers into pointers (-Zmiri-permissive-provenance, which silences the warning).
export MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-num-cpus=2 -Zmiri-tree-borrows -Zmiri-ignore-leaks -Zmiri-permissive-provenance"
# Its own target directory: Miri's builds never mix with the stable ones.
cargo +nightly miri test -p switchyard-ops --lib --target-dir target/miri "$@"
# The counting allocator: its header arithmetic and cross-thread frees.
cargo +nightly miri test -p switchyard-mem --lib --target-dir target/miri
