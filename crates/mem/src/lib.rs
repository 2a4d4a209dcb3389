//! # switchyard-mem: memory you can see
//!
//! A counting global allocator, [`Counting`], that attributes every live byte to a
//! *ledger* (one per rank) and a [`Category`] (parameters, gradients, optimizer state,
//! activations, communication buffers, the rest), so a training report can show what
//! each rank actually holds, at its peak and by category, instead of an estimate.
//!
//! * A [`Ledger`] is a slot in a fixed table of counters. A thread charges its
//!   allocations to a ledger while it has [`Ledger::enter`]ed it (the launcher does this
//!   for a rank's thread and the threads of its compute pool); other threads charge the
//!   process's untracked ledger.
//! * [`scope`] sets the category of this thread's allocations until the guard drops
//!   (the trainer wraps building parameters, the optimizer step, the pipeline's forward
//!   passes, and so on).
//! * Every allocation carries a small header with its ledger and category, so a buffer
//!   freed on another thread (a tensor sent to another rank) is taken off the ledger
//!   that allocated it.
//!
//! Measuring needs the binary to install the allocator
//! (`#[global_allocator] static A: Counting<System> = Counting(System);`; the
//! `switchyard` binary's `switchyard::Allocator` is `Counting<MiMalloc>`). Without it the
//! ledgers stay at zero and [`is_counting`] says so.
//!
//! The table of counters is the one piece of process-wide state in switchyard: a global
//! allocator has no other place to count. Ledgers are handed out and given back, never
//! shared between jobs, so concurrent jobs (parallel tests) measure separately.
//!
//! Invariant: no candle, no threads of its own; nothing here allocates.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU32, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

/// What a byte is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Parameters,
    Gradients,
    Optimizer,
    /// What the pipeline stashes between a microbatch's forward and backward passes,
    /// and what the ops save for their backward.
    Activations,
    /// Communication buffers.
    Comm,
    /// Everything else (workspace, data, the report).
    Other,
}

impl Category {
    pub const ALL: [Category; 6] = [
        Category::Parameters,
        Category::Gradients,
        Category::Optimizer,
        Category::Activations,
        Category::Comm,
        Category::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Comm => "comm",
            Category::Other => "other",
        }
    }
}

const N_CAT: usize = Category::ALL.len();
/// Ledger 0 is the process's untracked memory; the others are handed out.
const SLOTS: usize = 256;

struct Slot {
    in_use: AtomicBool,
    /// Bumped when the slot is handed out, so frees of an earlier owner's memory are
    /// not charged to the next one.
    generation: AtomicU32,
    live: [AtomicIsize; N_CAT],
    total: AtomicIsize,
    peak: AtomicIsize,
    at_peak: [AtomicIsize; N_CAT],
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicIsize = AtomicIsize::new(0);

impl Slot {
    const fn new() -> Slot {
        Slot {
            in_use: AtomicBool::new(false),
            generation: AtomicU32::new(0),
            live: [ZERO; N_CAT],
            total: ZERO,
            peak: ZERO,
            at_peak: [ZERO; N_CAT],
        }
    }

    fn charge(&self, cat: usize, bytes: isize) {
        self.live[cat].fetch_add(bytes, Relaxed);
        let total = self.total.fetch_add(bytes, Relaxed) + bytes;
        if bytes > 0 && total > self.peak.load(Relaxed) {
            self.peak.fetch_max(total, Relaxed);
            // Best effort under concurrency: the split of the newest peak.
            for (p, l) in self.at_peak.iter().zip(&self.live) {
                p.store(l.load(Relaxed), Relaxed);
            }
        }
    }
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot::new();
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
static COUNTING: AtomicBool = AtomicBool::new(false);

/// This thread's ledger (slot and generation) and category, packed: slot in bits 0–7,
/// category in bits 8–15, generation in bits 16–31 (the low 16 bits of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tag(u32);

impl Tag {
    const UNTRACKED: Tag = Tag((Category::Other as u32) << 8);
    fn new(slot: usize, generation: u32, cat: Category) -> Tag {
        Tag(slot as u32 | (cat as u32) << 8 | (generation & 0xffff) << 16)
    }
    fn slot(self) -> usize {
        (self.0 & 0xff) as usize
    }
    fn category(self) -> usize {
        ((self.0 >> 8) & 0xff) as usize
    }
    fn generation(self) -> u32 {
        self.0 >> 16
    }
    fn with_category(self, cat: Category) -> Tag {
        Tag(self.0 & !0xff00 | (cat as u32) << 8)
    }
}

thread_local! {
    // A `Cell` of a `Copy` type with a const initialiser: no destructor, so it can be
    // read from the allocator at any point of a thread's life.
    static TAG: Cell<Tag> = const { Cell::new(Tag::UNTRACKED) };
}

fn current_tag() -> Tag {
    TAG.try_with(Cell::get).unwrap_or(Tag::UNTRACKED)
}

fn set_tag(t: Tag) {
    let _ = TAG.try_with(|c| c.set(t));
}

fn charge(tag: Tag, bytes: isize) {
    // The untracked ledger (slot 0) is never read: not counting it spares every thread
    // outside a rank (a planner's pool, say) the contended atomics.
    if tag.slot() == 0 {
        return;
    }
    let slot = &TABLE[tag.slot()];
    if slot.generation.load(Relaxed) & 0xffff != tag.generation() {
        return; // memory of an earlier owner of the slot
    }
    slot.charge(tag.category(), bytes);
}

/// Whether the process's global allocator is [`Counting`] (it has counted something).
pub fn is_counting() -> bool {
    COUNTING.load(Relaxed)
}

/// A global allocator that counts every allocation of `A` against the allocating
/// thread's ledger and category.
pub struct Counting<A>(pub A);

/// Room for the header in front of an allocation of `layout`: at least 8 bytes for the
/// tag, and a multiple of the alignment so the returned pointer keeps it.
fn header(layout: Layout) -> usize {
    layout.align().max(8)
}

// SAFETY: every block handed out is `inner.alloc`'s block shifted by `header(layout)`
// bytes, inside it and aligned as `layout` asks (the header is a multiple of the
// alignment, and the inner block is allocated with the same alignment); `dealloc`
// recovers the inner block and its layout from the same arithmetic, so `A` gets back
// exactly what it handed out. The tag is written into the header, which belongs to the
// inner block and is never handed out.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let h = header(layout);
        let Some(size) = layout.size().checked_add(h) else {
            return std::ptr::null_mut();
        };
        let Ok(inner) = Layout::from_size_align(size, layout.align()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `inner` has a non-zero size (h ≥ 8).
        let base = unsafe { self.0.alloc(inner) };
        if base.is_null() {
            return base;
        }
        let tag = current_tag();
        // SAFETY: `base + h` is inside the block (size = layout.size() + h), and the
        // 4 bytes before it are in the header (h ≥ 8), aligned to 4 (h is a multiple
        // of the alignment, which is at least 1; write_unaligned needs no alignment).
        let user = unsafe { base.add(h) };
        unsafe { (user.sub(4) as *mut u32).write_unaligned(tag.0) };
        COUNTING.store(true, Relaxed);
        charge(tag, layout.size() as isize);
        user
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let h = header(layout);
        // SAFETY: `ptr` came from `alloc` with this layout (GlobalAlloc's contract), so
        // the tag sits in the 4 bytes before it and the inner block starts `h` before.
        let tag = Tag(unsafe { (ptr.sub(4) as *const u32).read_unaligned() });
        charge(tag, -(layout.size() as isize));
        let base = unsafe { ptr.sub(h) };
        // SAFETY: the same size and alignment `alloc` gave the inner allocator.
        let inner = unsafe { Layout::from_size_align_unchecked(layout.size() + h, layout.align()) };
        unsafe { self.0.dealloc(base, inner) }
    }
}

/// What a ledger holds, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Live now.
    pub live: usize,
    /// The most live at once since the ledger was handed out (or [`Ledger::reset_peak`]).
    pub peak: usize,
    /// Live now, by [`Category::ALL`].
    pub live_by_category: [usize; N_CAT],
    /// The split of the peak, by [`Category::ALL`].
    pub peak_by_category: [usize; N_CAT],
}

impl Usage {
    /// `(category, bytes)` of the peak, largest first.
    pub fn peak_split(&self) -> Vec<(Category, usize)> {
        let mut v: Vec<_> = Category::ALL
            .iter()
            .copied()
            .zip(self.peak_by_category)
            .collect();
        v.sort_by_key(|c| std::cmp::Reverse(c.1));
        v
    }
}

fn clamp(v: isize) -> usize {
    v.max(0) as usize
}

/// One rank's counters. Handed out by [`Ledger::new`], given back when dropped.
#[derive(Debug)]
pub struct Ledger {
    slot: usize,
    generation: u32,
}

/// What a thread needs to charge a [`Ledger`]: cheap to copy into a pool's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerId {
    slot: usize,
    generation: u32,
}

impl Ledger {
    /// A fresh ledger at zero, or `None` when all of them are in use.
    pub fn new() -> Option<Ledger> {
        for (slot, s) in TABLE.iter().enumerate().skip(1) {
            if s.in_use
                .compare_exchange(false, true, Relaxed, Relaxed)
                .is_ok()
            {
                let generation = s.generation.fetch_add(1, Relaxed).wrapping_add(1);
                for a in s.live.iter().chain(&s.at_peak) {
                    a.store(0, Relaxed);
                }
                s.total.store(0, Relaxed);
                s.peak.store(0, Relaxed);
                return Some(Ledger { slot, generation });
            }
        }
        None
    }

    pub fn id(&self) -> LedgerId {
        LedgerId {
            slot: self.slot,
            generation: self.generation,
        }
    }

    /// Charges this thread's allocations to the ledger (as [`Category::Other`]) until the
    /// guard drops.
    pub fn enter(&self) -> Entered {
        self.id().enter()
    }

    pub fn usage(&self) -> Usage {
        usage_of(self.slot)
    }

    /// Starts a new peak from what is live now.
    pub fn reset_peak(&self) {
        let s = &TABLE[self.slot];
        s.peak.store(s.total.load(Relaxed), Relaxed);
        for (p, l) in s.at_peak.iter().zip(&s.live) {
            p.store(l.load(Relaxed), Relaxed);
        }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        TABLE[self.slot].in_use.store(false, Relaxed);
    }
}

impl LedgerId {
    /// See [`Ledger::enter`].
    pub fn enter(self) -> Entered {
        let before = current_tag();
        set_tag(Tag::new(self.slot, self.generation, Category::Other));
        Entered { before }
    }
}

fn usage_of(slot: usize) -> Usage {
    let s = &TABLE[slot];
    let each = |a: &[AtomicIsize; N_CAT]| std::array::from_fn(|i| clamp(a[i].load(Relaxed)));
    Usage {
        live: clamp(s.total.load(Relaxed)),
        peak: clamp(s.peak.load(Relaxed)),
        live_by_category: each(&s.live),
        peak_by_category: each(&s.at_peak),
    }
}

/// The usage of the ledger this thread charges, if it charges one.
pub fn this_ledger() -> Option<Usage> {
    let t = current_tag();
    (t.slot() != 0).then(|| usage_of(t.slot()))
}

/// The ledger this thread charges, if it charges one: for a thread that works for the
/// same rank (a communication thread), to [`LedgerId::enter`] it.
pub fn current_ledger() -> Option<LedgerId> {
    let t = current_tag();
    (t.slot() != 0).then(|| LedgerId {
        slot: t.slot(),
        generation: t.generation(),
    })
}

/// Restores the thread's previous ledger when dropped.
#[must_use = "the ledger is left when the guard drops"]
pub struct Entered {
    before: Tag,
}

impl Drop for Entered {
    fn drop(&mut self) {
        set_tag(self.before);
    }
}

/// Charges this thread's allocations to `cat` until the guard drops.
pub fn scope(cat: Category) -> Scope {
    let before = current_tag();
    set_tag(before.with_category(cat));
    Scope { before }
}

/// Restores the thread's previous category when dropped.
#[must_use = "the category is reset when the guard drops"]
pub struct Scope {
    before: Tag,
}

impl Drop for Scope {
    fn drop(&mut self) {
        set_tag(self.before);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[global_allocator]
    static A: Counting<std::alloc::System> = Counting(std::alloc::System);

    #[test]
    fn bytes_are_charged_to_the_ledger_and_category_that_allocated_them() {
        let ledger = Ledger::new().unwrap();
        let (a, b) = {
            let _in = ledger.enter();
            let a = vec![0u8; 1000];
            let _p = scope(Category::Parameters);
            let b = vec![0u64; 500];
            (a, b)
        };
        let u = ledger.usage();
        assert_eq!(u.live_by_category[Category::Other as usize], 1000);
        assert_eq!(u.live_by_category[Category::Parameters as usize], 4000);
        assert_eq!(u.live, 5000);
        // Outside the ledger: not charged.
        let c = vec![0u8; 7777];
        assert_eq!(ledger.usage().live, 5000);
        // Freed on this (untracked) thread: taken off the ledger that allocated it.
        drop(a);
        assert_eq!(ledger.usage().live, 4000);
        let b = std::thread::spawn(move || b).join().unwrap();
        drop(b);
        let u = ledger.usage();
        assert_eq!((u.live, u.peak), (0, 5000));
        assert_eq!(u.peak_by_category[Category::Parameters as usize], 4000);
        assert!(is_counting());
        drop(c);
    }

    #[test]
    fn another_threads_allocations_follow_its_own_ledger() {
        let (l1, l2) = (Ledger::new().unwrap(), Ledger::new().unwrap());
        let id2 = l2.id();
        let v = {
            let _in = l1.enter();
            vec![1u8; 300]
        };
        // Spawning allocates on this thread, which now charges no ledger.
        std::thread::scope(|s| {
            s.spawn(move || {
                let _in = id2.enter();
                let w = vec![0u8; 200];
                drop(w);
            });
        });
        assert_eq!(l1.usage().live, 300);
        assert_eq!((l2.usage().live, l2.usage().peak), (0, 200));
        drop(v);
        l1.reset_peak();
        assert_eq!(l1.usage().peak, 0);
    }

    #[test]
    fn a_helper_thread_charges_the_ledger_its_spawner_charges() {
        let l = Ledger::new().unwrap();
        assert_eq!(current_ledger(), None, "an untracked thread");
        let id = {
            let _in = l.enter();
            current_ledger().expect("inside the ledger")
        };
        std::thread::spawn(move || {
            let _in = id.enter();
            drop(vec![0u8; 4096]);
        })
        .join()
        .unwrap();
        assert_eq!((l.usage().live, l.usage().peak), (0, 4096));
    }

    #[test]
    fn a_ledger_given_back_does_not_inherit_frees_of_its_last_owner() {
        let l = Ledger::new().unwrap();
        let slot = l.slot;
        let kept = {
            let _in = l.enter();
            vec![0u8; 1234]
        };
        drop(l);
        // Take ledgers until the same slot comes back.
        let mut held = Vec::new();
        let again = loop {
            let n = Ledger::new().unwrap();
            if n.slot == slot {
                break n;
            }
            held.push(n);
        };
        drop(kept);
        assert_eq!(again.usage().live, 0);
    }

    #[test]
    fn large_alignments_are_kept() {
        let ledger = Ledger::new().unwrap();
        let _in = ledger.enter();
        #[repr(align(64))]
        struct Wide(#[allow(dead_code)] [u8; 64]);
        let v: Vec<Wide> = (0..3).map(|_| Wide([0; 64])).collect();
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(ledger.usage().live, 192);
    }
}
