//! Host memory for large collective outputs.
//!
//! A fresh output of tens of MiB is a new anonymous mapping (glibc serves requests over its
//! mmap threshold with `mmap` and unmaps them on free, and a rank thread's arena cannot hold a
//! 64 MiB block at all), so every call pays one page fault per 4 KiB page, and the kernel's
//! zeroing of it, while the collective writes it, with four ranks faulting at once on a shared
//! address space. Outputs handed to candle cannot be recycled by the communicator (candle
//! frees them through the global allocator, with no hook to give them back), so this module
//! does two things, both for every user of the CPU backends:
//!
//! - [`reuse_large_buffers`] (run by `LocalWorld::launch`, and by `init_cpu_allocator`) makes
//!   glibc keep freed large blocks and hand them out again: one arena for all threads, an mmap
//!   threshold above the largest output and a trim threshold that keeps up to
//!   [`retained_max_bytes`] of free heap (the cap, half the machine's memory; [`stats`] shows
//!   what the heap holds, [`release_free_memory`] gives it back).
//! - buffers of [`HUGE_PAGE_MIN_BYTES`] or more that must be fresh anyway are marked for
//!   transparent huge pages (`madvise(MADV_HUGEPAGE)`, Linux; elsewhere, or with THP `never`,
//!   a no-op): one fault per 2 MiB.
//!
//! Outputs a collective overwrites completely are never zero-filled first (the backends'
//! `OutBuf`, and [`uninit_vec`]). docs/ARCHITECTURE.md ("Large outputs") has the measurements
//! behind the choice.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Buffers of at least this many bytes are advised for transparent huge pages.
pub const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

const HUGE_PAGE: usize = 2 << 20;

static HUGE_PAGES: AtomicBool = AtomicBool::new(true);
static ADVISED_BUFFERS: AtomicU64 = AtomicU64::new(0);
static ADVISED_BYTES: AtomicU64 = AtomicU64::new(0);

/// What this process advised so far and what glibc's heap holds (observable, e.g. in a
/// benchmark's output).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// Buffers marked for huge pages.
    pub huge_page_buffers: u64,
    /// Bytes of whole 2 MiB pages inside them that the kernel was asked to back with huge pages.
    pub huge_page_bytes: u64,
    /// Whether [`reuse_large_buffers`] tuned glibc's allocator in this process.
    pub reuse_large_buffers: bool,
    /// Bytes of glibc's heaps (all arenas; `mallinfo2().arena`), 0 off glibc.
    pub heap_bytes: u64,
    /// Free bytes kept inside them for reuse (`mallinfo2().fordblks`), 0 off glibc.
    pub heap_free_bytes: u64,
    /// Bytes in blocks glibc mapped separately (`mallinfo2().hblkhd`), 0 off glibc.
    pub mmapped_bytes: u64,
    /// The cap on free heap kept for reuse ([`retained_max_bytes`]).
    pub retained_max_bytes: u64,
    /// Times the top of the heap was trimmed to the cap, or released by
    /// [`release_free_memory`].
    pub trims: u64,
}

/// The counters of [`MemoryStats`] since the process started, and the heap as it is now.
pub fn stats() -> MemoryStats {
    let (heap_bytes, heap_free_bytes, mmapped_bytes) = heap_info();
    MemoryStats {
        huge_page_buffers: ADVISED_BUFFERS.load(Ordering::Relaxed),
        huge_page_bytes: ADVISED_BYTES.load(Ordering::Relaxed),
        reuse_large_buffers: REUSE.get().copied().unwrap_or(false),
        heap_bytes,
        heap_free_bytes,
        mmapped_bytes,
        retained_max_bytes: retained_max_bytes() as u64,
        trims: TRIMS.load(Ordering::Relaxed),
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_info() -> (u64, u64, u64) {
    // SAFETY: mallinfo2 only reads the allocator's statistics (under its locks).
    let m = unsafe { libc::mallinfo2() };
    (m.arena as u64, m.fordblks as u64, m.hblkhd as u64)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_info() -> (u64, u64, u64) {
    (0, 0, 0)
}

/// The least free memory glibc keeps at the top of its heap for reuse once
/// [`reuse_large_buffers`] ran, whatever the machine (see [`retained_max_bytes`]).
pub const RETAINED_MIN_BYTES: usize = 1 << 30;

/// The most free memory kept at the top of glibc's heap for reuse once [`reuse_large_buffers`]
/// ran; more is returned to the kernel. Half the machine's physical memory, at least
/// [`RETAINED_MIN_BYTES`] (1 GiB where the size is unknown).
///
/// Why so much: an MoE dispatch of 262,144 tokens x 256 dims x top-2 per rank on 4 ranks frees
/// and reallocates ~7 GiB per step; with a 1-3 GiB cap the top of the heap is trimmed and
/// faulted back every step and the dispatch + combine ran at 0.14-0.18 of the all_to_all floor,
/// with 8 GiB at 0.33 (moe_bench, same machine, BENCHMARKS.md). The heap never holds more than
/// the process's own peak; [`release_free_memory`] gives the free part back on demand.
/// [`set_retained_max_bytes`] changes it (e.g. to leave memory to another process).
pub fn retained_max_bytes() -> usize {
    match CAP.load(Ordering::Relaxed) {
        0 => (physical_memory_bytes() / 2).max(RETAINED_MIN_BYTES),
        cap => cap,
    }
}

/// Sets the cap of [`retained_max_bytes`] for this process (0 restores the default) and
/// returns the previous one; it takes effect at the next large allocation (the cap is
/// checked then, whatever was allocated since the last check).
pub fn set_retained_max_bytes(bytes: usize) -> usize {
    let previous = retained_max_bytes();
    CAP.store(bytes, Ordering::Relaxed);
    SINCE_CHECK.store(usize::MAX / 2, Ordering::Relaxed);
    previous
}

/// The cap set by [`set_retained_max_bytes`]; 0 = the default.
static CAP: AtomicUsize = AtomicUsize::new(0);

#[cfg(unix)]
fn physical_memory_bytes() -> usize {
    // SAFETY: sysconf only reads system constants.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (usize::try_from(pages), usize::try_from(page)) {
        (Ok(p), Ok(s)) => p.saturating_mul(s),
        _ => 0,
    }
}

#[cfg(not(unix))]
fn physical_memory_bytes() -> usize {
    0
}

/// Blocks below this size come from glibc's heap (reusable) once [`reuse_large_buffers`] ran
/// (its `M_MMAP_THRESHOLD`); larger ones stay separate mappings, advised for huge pages.
pub const HEAP_BLOCK_MAX_BYTES: usize = 1 << 30;

/// Set when [`reuse_large_buffers`] turned glibc's own trimming off (its threshold is an `int`,
/// at most 2 GiB, and fixed once set): [`enforce_retention_cap`] then trims to the cap at each
/// large allocation.
static TRIM_BY_US: AtomicBool = AtomicBool::new(false);
static TRIMS: AtomicU64 = AtomicU64::new(0);

/// Environment variables through which a user tunes glibc's allocator; when any is set,
/// [`reuse_large_buffers`] leaves the allocator alone.
const MALLOC_ENV: [&str; 5] = [
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
];

static REUSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Makes glibc keep freed large blocks (collective outputs, activations) and hand them out
/// again instead of unmapping them and faulting fresh zeroed pages on the next call; runs
/// once per process and says whether the allocator is tuned.
///
/// Settings: `M_ARENA_MAX` 1 (a thread's own arena is at most 64 MiB and cannot hold a 64 MiB
/// block, so rank threads would `mmap` it whatever the threshold), `M_MMAP_THRESHOLD`
/// [`HEAP_BLOCK_MAX_BYTES`] (falling back to 32 MiB where glibc refuses more), a trim threshold
/// of [`retained_max_bytes`] (the cap on what is kept: glibc's `M_TRIM_THRESHOLD` is turned off
/// and the top of the heap is trimmed to the cap, checked once per quarter of the cap of large
/// allocations) and `M_TOP_PAD` 64 MiB. Measured
/// (comm_bench, 64 MiB, world 4, same run): all_gather with fresh outputs at 0.86 of the copy
/// floor instead of 0.45. Process-wide and permanent; threads already attached to an arena
/// keep it, so this runs before the rank threads start (`LocalWorld::launch` calls it). A
/// no-op returning `false` off glibc, or when the user set `GLIBC_TUNABLES` or a `MALLOC_*`
/// variable.
pub fn reuse_large_buffers() -> bool {
    *REUSE.get_or_init(|| {
        if MALLOC_ENV.iter().any(|v| std::env::var_os(v).is_some()) {
            return false;
        }
        let tuned = tune_glibc_malloc();
        tracing::debug!(tuned, "glibc allocator tuned to reuse large buffers");
        tuned
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_glibc_malloc() -> bool {
    const MIB: libc::c_int = 1 << 20;
    let set = |param: libc::c_int, value: libc::c_int| {
        // SAFETY: mallopt only changes allocator parameters; glibc serializes it with
        // allocations.
        unsafe { libc::mallopt(param, value) == 1 }
    };
    let threshold = libc::c_int::try_from(HEAP_BLOCK_MAX_BYTES).unwrap_or(32 * MIB);
    // Older glibc caps the mmap threshold at 32 MiB (HEAP_MAX_SIZE / 2).
    let mmap_ok = set(libc::M_MMAP_THRESHOLD, threshold) || set(libc::M_MMAP_THRESHOLD, 32 * MIB);
    // glibc's trim threshold is set to "never" (-1 reads as SIZE_MAX: the cap is usually over
    // what its `int` holds, and can change) and `enforce_retention_cap` trims the top of the
    // heap down to the cap.
    let trim_ok = set(libc::M_TRIM_THRESHOLD, -1);
    TRIM_BY_US.store(trim_ok, Ordering::Relaxed);
    // The three thresholds only help together (a trim threshold alone disables the dynamic
    // mmap threshold): all are set, and the result says whether all took.
    let rest = [
        set(libc::M_ARENA_MAX, 1),
        trim_ok,
        set(libc::M_TOP_PAD, 64 * MIB),
    ];
    mmap_ok && rest.iter().all(|&ok| ok)
}

/// Bytes of large allocations through [`vec_with_capacity`] since the cap was last checked.
static SINCE_CHECK: AtomicUsize = AtomicUsize::new(0);

/// Where glibc cannot hold the cap itself: when the free block at the top of the heap has grown
/// past [`retained_max_bytes`], returns what is above the cap to the kernel. Looked at from
/// [`vec_with_capacity`] (every large collective output) once per quarter of the cap of such
/// allocations: reading the top's size (`mallinfo2`) walks every free chunk, 4.8 us with 753
/// of them but 24 ms with 100,000 (measured here), too much for every large output.
fn enforce_retention_cap(bytes: usize) {
    if !TRIM_BY_US.load(Ordering::Relaxed) {
        return;
    }
    let cap = retained_max_bytes();
    let since = SINCE_CHECK.fetch_add(bytes, Ordering::Relaxed) + bytes;
    if since < cap / 4 {
        return;
    }
    SINCE_CHECK.store(0, Ordering::Relaxed);
    trim_if_top_over(cap);
}

/// Trims the top of the heap down to `cap` when it holds more; says whether it did.
fn trim_if_top_over(cap: usize) -> bool {
    if top_free_bytes() <= cap {
        return false;
    }
    trim_top(cap);
    TRIMS.fetch_add(1, Ordering::Relaxed);
    true
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn top_free_bytes() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's statistics (under its locks).
    unsafe { libc::mallinfo2() }.keepcost
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn top_free_bytes() -> usize {
    0
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_top(keep: usize) {
    // SAFETY: malloc_trim only returns free pages to the kernel (under the allocator's locks);
    // no live allocation changes.
    unsafe { libc::malloc_trim(keep) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_top(_: usize) {}

/// Returns the free memory glibc's heap keeps for reuse to the kernel now (`malloc_trim(0)`),
/// e.g. after training, before a memory-hungry phase; the next large buffers fault again.
/// A no-op off glibc.
pub fn release_free_memory() {
    trim_top(0);
    TRIMS.fetch_add(1, Ordering::Relaxed);
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_glibc_malloc() -> bool {
    false
}

/// Turns the huge-page advice of large collective outputs on (the default) or off, process-wide,
/// and returns the previous setting (benchmarks compare both in one run).
pub fn set_huge_pages(enabled: bool) -> bool {
    HUGE_PAGES.swap(enabled, Ordering::Relaxed)
}

/// Asks the kernel to back the whole 2 MiB pages inside `[ptr, ptr + len)` with transparent
/// huge pages when they are first touched. Advice only: the contents and the mapping of the
/// range never change, so any address is harmless (an unmapped one is refused by the kernel).
/// Returns whether advice was given (ranges under [`HUGE_PAGE_MIN_BYTES`] are left alone).
pub fn advise_huge_pages(ptr: *const u8, len: usize) -> bool {
    if len < HUGE_PAGE_MIN_BYTES || !HUGE_PAGES.load(Ordering::Relaxed) {
        return false;
    }
    let start = (ptr as usize).div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let end = (ptr as usize).saturating_add(len) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: MADV_HUGEPAGE changes only the kernel's paging policy of the (page-aligned)
        // range, never its contents or mapping; a range outside our mappings is an error return.
        let rc =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            return false;
        }
        ADVISED_BUFFERS.fetch_add(1, Ordering::Relaxed);
        ADVISED_BYTES.fetch_add((end - start) as u64, Ordering::Relaxed);
        true
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// An empty `Vec` with room for `elems` elements, advised for huge pages when large.
pub fn vec_with_capacity<T>(elems: usize) -> Vec<T> {
    let bytes = elems.saturating_mul(std::mem::size_of::<T>());
    if bytes >= HUGE_PAGE_MIN_BYTES {
        enforce_retention_cap(bytes);
    }
    let v = Vec::<T>::with_capacity(elems);
    advise_huge_pages(v.as_ptr().cast(), v.capacity() * std::mem::size_of::<T>());
    v
}

/// A `Vec` of `elems` elements whose memory was never written (no zero-fill pass), advised for
/// huge pages when large.
///
/// # Safety
///
/// `T` must be a plain numeric type (every bit pattern valid, no drop glue), and the caller
/// must write every element before any is read, or drop the `Vec` unread: in particular it may
/// hand the `Vec` to no one (a tensor, a slice) before it is fully written.
pub unsafe fn uninit_vec<T: Copy>(elems: usize) -> Vec<T> {
    let mut v = vec_with_capacity::<T>(elems);
    // SAFETY: capacity is `elems`; the elements are initialised before use (the contract).
    unsafe { v.set_len(elems) };
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_is_decided_once_and_reported() {
        let first = reuse_large_buffers();
        assert_eq!(reuse_large_buffers(), first);
        assert_eq!(stats().reuse_large_buffers, first);
        // A large block freed and allocated again works either way (contents are ours).
        let mut v = vec_with_capacity::<u8>(HUGE_PAGE_MIN_BYTES * 2);
        v.resize(HUGE_PAGE_MIN_BYTES * 2, 3);
        drop(v);
        let w = vec![5u8; HUGE_PAGE_MIN_BYTES * 2];
        assert!(w.iter().all(|&x| x == 5));
    }

    #[test]
    fn the_retention_cap_follows_the_machine_unless_set() {
        let cap = retained_max_bytes();
        assert!(cap >= RETAINED_MIN_BYTES);
        assert!(cap >= physical_memory_bytes() / 2);
        assert_eq!(stats().retained_max_bytes, cap as u64);
        // The trim itself is tested in comm/tests/memory_cap.rs (its own process: which arena
        // a test thread of this binary allocates from is not under the test's control).
    }

    #[test]
    fn small_ranges_are_left_alone_and_large_ones_counted() {
        let v = vec![0u8; 4096];
        assert!(!advise_huge_pages(v.as_ptr(), v.len()));
        let before = stats();
        let big = vec_with_capacity::<f32>(HUGE_PAGE_MIN_BYTES);
        assert!(big.capacity() >= HUGE_PAGE_MIN_BYTES);
        let after = stats();
        // Kernels without THP refuse the advice; then nothing is counted.
        assert!(after.huge_page_bytes >= before.huge_page_bytes);
        // Advice never changes contents.
        let mut w = vec![7u32; HUGE_PAGE_MIN_BYTES];
        advise_huge_pages(w.as_ptr().cast(), w.len() * 4);
        w[12345] = 1;
        assert_eq!(w.iter().filter(|&&x| x == 7).count(), w.len() - 1);
        // A range outside any mapping is refused, not a crash.
        assert!(!advise_huge_pages(
            std::ptr::null(),
            HUGE_PAGE_MIN_BYTES * 4
        ));
    }
}
