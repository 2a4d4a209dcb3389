//! The tests that measure memory, in a process of their own: it installs the counting
//! allocator, whose table of ledgers (one per rank of every run at once, 255 in all) the
//! other tests' runs do not share.

use switchyard_mem::Counting;

#[global_allocator]
static ALLOC: Counting<std::alloc::System> = Counting(std::alloc::System);

mod estimate;
mod memory;
