//! The tests that measure memory, in a process of their own: it installs the counting
//! allocator, whose table of ledgers (one per rank of every run at once, 255 in all) the
//! other tests' runs do not share.

use switchyard_mem::Counting;

#[global_allocator]
static ALLOC: Counting<std::alloc::System> = Counting(std::alloc::System);

mod estimate;
mod memory;

/// Held by each test for its whole run, so that the tests run one at a time and what a
/// rank measures depends on nothing another test's workers do meanwhile. (Run two at a
/// time, `the_overlapped_all_reduce_is_predicted_by_category` failed once in six runs of
/// this binary, and never alone; the counting allocator records the split of a peak by
/// category best-effort while a rank's threads allocate at once.) One at a time costs
/// about 10 s of the binary's 100 on two cores: each run has workers on every core.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed while holding it poisons nothing the next one reads.
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}
