//! Test support shared by the store's tests and the process backend's tests (which include
//! this file with `#[path]`): the warnings every thread logs, and the largest single
//! allocation a closure makes on its thread. A test-only file, never compiled into a library.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write as _;
use std::sync::{Mutex, Once};

use tracing::field::{Field, Visit};
use tracing::span;

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records every `warn` and `error` event of every thread as `message field=value ...`.
struct Recorder;

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={:?} ", f.name(), v);
    }
}

impl tracing::Subscriber for Recorder {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut f = Fields(String::new());
        e.record(&mut f);
        LOG.lock().unwrap_or_else(|e| e.into_inner()).push(f.0);
    }
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

/// Installs the recorder as the process's subscriber (once).
pub(crate) fn capture_warnings() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        tracing::subscriber::set_global_default(Recorder)
            .expect("no other global subscriber in the comm lib tests");
    });
}

/// The warnings recorded so far that contain every string of `all`.
pub(crate) fn warnings_with(all: &[&str]) -> Vec<String> {
    LOG.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|w| all.iter().all(|s| w.contains(s)))
        .cloned()
        .collect()
}

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
        }
    });
}

/// The system allocator, noting the size of every allocation a thread makes while armed.
struct Counting;

// SAFETY: every method passes its arguments unchanged to `System`, which upholds the
// `GlobalAlloc` contract; `note` only touches const-initialised thread-local `Cell`s
// without destructors (no allocation, no re-entry) and ignores a thread being torn down.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System` (every allocation here does) with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        // SAFETY: as `dealloc`, with the caller's new size.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the largest single allocation (or reallocation)
/// it made on this thread, in bytes.
pub(crate) fn peak_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    PEAK.with(|p| p.set(0));
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    (r, PEAK.with(|p| p.get()))
}

/// A seeded generator (SplitMix64): the fuzz tests are the same on every run.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Up to `max - 1` random bytes.
    pub(crate) fn upto(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max) as usize;
        self.bytes(n)
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}
