//! The conformance suite against the in-process backend at world sizes 1, 2, 3, 4 and 8.

use switchyard_comm::{conformance, local};

fn run(n: usize) {
    local::launch(n, |comm| conformance::run_all(&*comm))
        .unwrap_or_else(|e| panic!("world size {n}: {e}"));
}

#[test]
fn world_of_1() {
    run(1);
}

#[test]
fn world_of_2() {
    run(2);
}

#[test]
fn world_of_3() {
    run(3);
}

#[test]
fn world_of_4() {
    run(4);
}

#[test]
fn world_of_8() {
    run(8);
}
