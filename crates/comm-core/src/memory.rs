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
//! `OutBuf`). docs/ARCHITECTURE.md ("Large outputs") has the measurements behind the choice.
//!
//! glibc's heap statistics come from `mallinfo2`, which glibc added in 2.33. It is looked up
//! at run time (once), not linked, so the binaries also load on older glibc (2.28: RHEL 8);
//! there `mallinfo` is read instead ([`HeapStatsSource`]), and glibc's own trim threshold holds
//! the retention cap (see [`reuse_large_buffers`]).

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
    /// Where the three heap figures below come from, and how far they can be trusted.
    pub heap_stats: HeapStatsSource,
    /// Bytes of glibc's heaps (all arenas; `mallinfo2().arena`), 0 when `heap_stats` is
    /// `Unavailable`.
    pub heap_bytes: u64,
    /// Free bytes kept inside them for reuse (`mallinfo2().fordblks`), 0 when unavailable.
    pub heap_free_bytes: u64,
    /// Bytes in blocks glibc mapped separately (`mallinfo2().hblkhd`), 0 when unavailable.
    pub mmapped_bytes: u64,
    /// The cap on free heap kept for reuse ([`retained_max_bytes`]).
    pub retained_max_bytes: u64,
    /// Times the top of the heap was trimmed to the cap, or released by
    /// [`release_free_memory`].
    pub trims: u64,
}

/// Which glibc call [`MemoryStats`]' heap figures were read with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeapStatsSource {
    /// `mallinfo2` (glibc 2.33 and later): exact 64-bit sizes.
    Mallinfo2,
    /// `mallinfo` (glibc before 2.33, whose `mallinfo2` is missing). Its fields are C `int`s
    /// into which glibc stores the `size_t` sizes truncated to 32 bits, so a heap past 2 GiB
    /// reads negative. They are read back as unsigned 32-bit numbers: exact below 4 GiB, the
    /// true size modulo 4 GiB above it (a 5 GiB heap reads as 1 GiB).
    Mallinfo,
    /// Neither (not glibc, or a C library without either symbol): the figures are 0.
    #[default]
    Unavailable,
}

/// The counters of [`MemoryStats`] since the process started, and the heap as it is now.
pub fn stats() -> MemoryStats {
    let (heap_stats, heap) = match heap_info() {
        Some((source, h)) => (source, h),
        None => (HeapStatsSource::Unavailable, HeapInfo::default()),
    };
    MemoryStats {
        huge_page_buffers: ADVISED_BUFFERS.load(Ordering::Relaxed),
        huge_page_bytes: ADVISED_BYTES.load(Ordering::Relaxed),
        reuse_large_buffers: REUSE.get().copied().unwrap_or(false),
        heap_stats,
        heap_bytes: heap.arena,
        heap_free_bytes: heap.fordblks,
        mmapped_bytes: heap.hblkhd,
        retained_max_bytes: retained_max_bytes() as u64,
        trims: TRIMS.load(Ordering::Relaxed),
    }
}

/// The fields of glibc's `mallinfo2`/`mallinfo` this module reads, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct HeapInfo {
    /// Bytes of the heaps (all arenas).
    arena: u64,
    /// Free bytes inside them.
    fordblks: u64,
    /// Bytes in separately mapped blocks.
    hblkhd: u64,
    /// The free block at the top of the main heap (what `malloc_trim` can give back).
    keepcost: u64,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_info() -> Option<(HeapStatsSource, HeapInfo)> {
    glibc::read(glibc::reader())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_info() -> Option<(HeapStatsSource, HeapInfo)> {
    None
}

/// glibc's heap statistics, looked up by name at run time. Linking `mallinfo2` would make every
/// binary need `GLIBC_2.33` and refuse to load on older systems (RHEL 8 has 2.28); `mallinfo`
/// is looked up the same way (glibc may one day keep it for old binaries only).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use super::{HeapInfo, HeapStatsSource};
    use std::ffi::CStr;
    use std::sync::OnceLock;

    /// glibc's `struct mallinfo2 mallinfo2(void)`.
    pub(super) type Mallinfo2Fn = unsafe extern "C" fn() -> libc::mallinfo2;
    /// glibc's `struct mallinfo mallinfo(void)`.
    pub(super) type MallinfoFn = unsafe extern "C" fn() -> libc::mallinfo;

    /// The call that reads the statistics in this process.
    #[derive(Clone, Copy, Debug)]
    pub(super) enum Reader {
        Mallinfo2(Mallinfo2Fn),
        Mallinfo(MallinfoFn),
        Unavailable,
    }

    static READER: OnceLock<Reader> = OnceLock::new();

    /// The reader of this process: resolved on first use, then cached.
    pub(super) fn reader() -> Reader {
        *READER.get_or_init(|| {
            let reader = choose(lookup_mallinfo2(), lookup_mallinfo());
            tracing::debug!(?reader, "glibc heap statistics");
            reader
        })
    }

    /// `mallinfo2` where the C library has it, else `mallinfo`, else nothing.
    pub(super) fn choose(m2: Option<Mallinfo2Fn>, m1: Option<MallinfoFn>) -> Reader {
        match (m2, m1) {
            (Some(f), _) => Reader::Mallinfo2(f),
            (None, Some(f)) => Reader::Mallinfo(f),
            (None, None) => Reader::Unavailable,
        }
    }

    /// The address of `name` in the process's global symbol scope, if any object defines it.
    pub(super) fn lookup(name: &CStr) -> Option<*mut libc::c_void> {
        // SAFETY: `name` is NUL-terminated (a `CStr`) and lives across the call; dlsym with
        // RTLD_DEFAULT only searches the symbol tables of the objects already loaded and
        // returns null when none defines the name.
        let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    }

    pub(super) fn lookup_mallinfo2() -> Option<Mallinfo2Fn> {
        let sym = lookup(c"mallinfo2")?;
        // SAFETY: a function named `mallinfo2` in the global scope is glibc's (or a malloc
        // replacement's that exports the same ABI, as replacements must for the symbol to
        // mean anything): `struct mallinfo2 mallinfo2(void)`, whose layout is
        // `libc::mallinfo2`. A data pointer and a function pointer have the same size and
        // representation on every target glibc runs on (POSIX requires it of dlsym).
        Some(unsafe { std::mem::transmute::<*mut libc::c_void, Mallinfo2Fn>(sym) })
    }

    pub(super) fn lookup_mallinfo() -> Option<MallinfoFn> {
        let sym = lookup(c"mallinfo")?;
        // SAFETY: as for `mallinfo2`: glibc's `struct mallinfo mallinfo(void)`, whose layout is
        // `libc::mallinfo`, and a function pointer is a data pointer's size.
        Some(unsafe { std::mem::transmute::<*mut libc::c_void, MallinfoFn>(sym) })
    }

    /// Reads the statistics with `reader`; `None` when it is `Unavailable`.
    pub(super) fn read(reader: Reader) -> Option<(HeapStatsSource, HeapInfo)> {
        match reader {
            Reader::Mallinfo2(f) => {
                // SAFETY: `f` is `mallinfo2` (see `lookup_mallinfo2`): it takes no arguments
                // and only reads the allocator's statistics, under the allocator's locks.
                let m = unsafe { f() };
                Some((HeapStatsSource::Mallinfo2, from_mallinfo2(&m)))
            }
            Reader::Mallinfo(f) => {
                // SAFETY: `f` is `mallinfo` (see `lookup_mallinfo`): no arguments, reads the
                // statistics under the allocator's locks.
                let m = unsafe { f() };
                Some((HeapStatsSource::Mallinfo, from_mallinfo(&m)))
            }
            Reader::Unavailable => None,
        }
    }

    fn from_mallinfo2(m: &libc::mallinfo2) -> HeapInfo {
        HeapInfo {
            arena: m.arena as u64,
            fordblks: m.fordblks as u64,
            hblkhd: m.hblkhd as u64,
            keepcost: m.keepcost as u64,
        }
    }

    /// `mallinfo`'s `int` fields hold glibc's sizes truncated to 32 bits; their bits read as
    /// unsigned are exact below 4 GiB and the size modulo 4 GiB above ([`HeapStatsSource`]).
    pub(super) fn from_mallinfo(m: &libc::mallinfo) -> HeapInfo {
        let bytes = |field: libc::c_int| u64::from(field as u32);
        HeapInfo {
            arena: bytes(m.arena),
            fordblks: bytes(m.fordblks),
            hblkhd: bytes(m.hblkhd),
            keepcost: bytes(m.keepcost),
        }
    }

    /// Whether this process reads exact sizes (`mallinfo2`): what trimming the heap to a cap
    /// above 4 GiB from the top's size needs.
    pub(super) fn exact_sizes() -> bool {
        matches!(reader(), Reader::Mallinfo2(_))
    }
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
    if REUSE.get() == Some(&true) && !TRIM_BY_US.load(Ordering::Relaxed) {
        // glibc before 2.33: glibc's own threshold holds the cap (see `tune_glibc_malloc`).
        set_glibc_trim_threshold(retained_max_bytes());
    }
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
/// large allocation. Left unset where only `mallinfo` reports the heap (glibc before 2.33):
/// its sizes wrap at 4 GiB, too little to compare the top of the heap with a cap of half the
/// machine, so glibc's own threshold holds the cap there, clamped to 2 GiB.
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
/// allocations) and `M_TOP_PAD` 64 MiB. On glibc before 2.33 (no `mallinfo2`, whose exact sizes
/// that check reads) glibc's own `M_TRIM_THRESHOLD` holds the cap instead, clamped to its
/// `int` (just under 2 GiB; [`set_retained_max_bytes`] sets it again), and glibc trims the top
/// down to the 64 MiB pad when it grows past it: the cap holds, at the cost of refaulting
/// more of a workload that churns more than 2 GiB per step. Measured
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
    // heap down to the cap, where `mallinfo2` gives the top's exact size; elsewhere glibc's
    // threshold is the cap, clamped to its `int`.
    let trim_ok = if glibc::exact_sizes() {
        let ok = set(libc::M_TRIM_THRESHOLD, -1);
        TRIM_BY_US.store(ok, Ordering::Relaxed);
        ok
    } else {
        set_glibc_trim_threshold(retained_max_bytes())
    };
    // The three thresholds only help together (a trim threshold alone disables the dynamic
    // mmap threshold): all are set, and the result says whether all took.
    let rest = [
        set(libc::M_ARENA_MAX, 1),
        trim_ok,
        set(libc::M_TOP_PAD, 64 * MIB),
    ];
    mmap_ok && rest.iter().all(|&ok| ok)
}

/// Sets glibc's own `M_TRIM_THRESHOLD` to `bytes`, clamped to the `int` it takes; says whether
/// glibc took it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_glibc_trim_threshold(bytes: usize) -> bool {
    let threshold = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only changes an allocator parameter; glibc serializes it with allocations.
    unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, threshold) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_glibc_trim_threshold(_: usize) -> bool {
    false
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

/// The free block at the top of the heap; 0 where it cannot be read. Only called where
/// [`TRIM_BY_US`] is set, which needs exact sizes (`mallinfo2`).
fn top_free_bytes() -> usize {
    heap_info().map_or(0, |(_, h)| {
        usize::try_from(h.keepcost).unwrap_or(usize::MAX)
    })
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
        // The trim itself is tested in crates/comm-core/tests/memory_cap.rs (its own process: which arena
        // a test thread of this binary allocates from is not under the test's control).
    }

    /// glibc's version as (major, minor), from `gnu_get_libc_version` (in every glibc).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_version() -> (u32, u32) {
        // SAFETY: gnu_get_libc_version takes no arguments and returns a pointer to a static
        // NUL-terminated string.
        let v = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
        let v = v.to_str().expect("glibc's version is ASCII");
        let mut parts = v
            .split('.')
            .map(|p| p.parse::<u32>().expect("numeric version"));
        (parts.next().expect("major"), parts.next().expect("minor"))
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn heap_statistics_come_from_mallinfo2_where_glibc_has_it() {
        let expected = if glibc_version() >= (2, 33) {
            HeapStatsSource::Mallinfo2
        } else {
            HeapStatsSource::Mallinfo
        };
        let s = stats();
        assert_eq!(s.heap_stats, expected, "glibc {:?}", glibc_version());
        assert_eq!(glibc::exact_sizes(), expected == HeapStatsSource::Mallinfo2);
        // This process has allocated (the test harness alone does), so the heap is not empty.
        assert!(s.heap_bytes > 0, "{s:?}");
        assert!(s.heap_free_bytes <= s.heap_bytes, "{s:?}");
    }

    /// The fallback of glibc before 2.33, taken here by withholding `mallinfo2`.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn without_mallinfo2_the_heap_is_read_with_mallinfo_or_marked_unavailable() {
        let m1 = glibc::lookup_mallinfo().expect("glibc exports mallinfo");
        let reader = glibc::choose(None, Some(m1));
        assert!(matches!(reader, glibc::Reader::Mallinfo(_)), "{reader:?}");
        let (source, h) = glibc::read(reader).expect("mallinfo reads the heap");
        assert_eq!(source, HeapStatsSource::Mallinfo);
        // One snapshot (this test binary's heap is far below 4 GiB, so nothing wraps): the
        // heap exists, its free bytes are inside it, and the top block is among them.
        assert!(h.arena > 0, "{h:?}");
        assert!(h.keepcost <= h.fordblks && h.fordblks <= h.arena, "{h:?}");

        let none = glibc::choose(None, None);
        assert!(matches!(none, glibc::Reader::Unavailable));
        assert_eq!(glibc::read(none), None);
        // A name no loaded object defines resolves to nothing rather than to a bad pointer.
        assert!(glibc::lookup(c"cdt_no_such_symbol_mallinfo3").is_none());
    }

    /// The two function pointers made from dlsym's addresses have the signatures and struct
    /// layouts their SAFETY comments claim: `mallinfo` must report `mallinfo2`'s sizes
    /// truncated to 32 bits, field for field. Other test threads allocate meanwhile, so a
    /// reading counts only when `mallinfo2` saw the same heap before and after it.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn mallinfo_and_mallinfo2_agree_through_their_resolved_pointers() {
        let Some(m2) = glibc::lookup_mallinfo2() else {
            assert!(
                glibc_version() < (2, 33),
                "glibc {:?} has mallinfo2",
                glibc_version()
            );
            return;
        };
        let m1 = glibc::lookup_mallinfo().expect("glibc exports mallinfo");
        let read = |r| glibc::read(r).expect("readable").1;
        let truncated = |h: HeapInfo| HeapInfo {
            arena: h.arena & 0xffff_ffff,
            fordblks: h.fordblks & 0xffff_ffff,
            hblkhd: h.hblkhd & 0xffff_ffff,
            keepcost: h.keepcost & 0xffff_ffff,
        };
        let mut last = None;
        for _ in 0..1000 {
            let before = read(glibc::Reader::Mallinfo2(m2));
            let old = read(glibc::Reader::Mallinfo(m1));
            let after = read(glibc::Reader::Mallinfo2(m2));
            if before == after {
                assert_eq!(old, truncated(before), "mallinfo vs mallinfo2");
                return;
            }
            last = Some((before, after));
        }
        panic!("the heap changed during every one of 1000 readings: {last:?}");
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn mallinfo_sizes_past_2_gib_read_as_unsigned_32_bits() {
        // glibc stores size_t sizes into mallinfo's ints truncated: 3 GiB reads as a negative
        // int, 4 GiB - 1 as -1, 5 GiB as 1 GiB.
        let m = libc::mallinfo {
            arena: (3u32 << 30) as libc::c_int,
            ordblks: 0,
            smblks: 0,
            hblks: 0,
            hblkhd: -1,
            usmblks: 0,
            fsmblks: 0,
            uordblks: 0,
            fordblks: ((5u64 << 30) as u32) as libc::c_int,
            keepcost: i32::MAX,
        };
        assert!(m.arena < 0);
        let h = glibc::from_mallinfo(&m);
        assert_eq!(h.arena, 3 << 30);
        assert_eq!(h.hblkhd, (1 << 32) - 1);
        assert_eq!(h.fordblks, 1 << 30, "5 GiB reads modulo 4 GiB");
        assert_eq!(h.keepcost, (1 << 31) - 1);
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
