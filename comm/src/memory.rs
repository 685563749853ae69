//! Host memory for large collective outputs.
//!
//! A fresh output of tens of MiB is a new anonymous mapping (glibc serves requests over its
//! mmap threshold, at most 32 MiB, with `mmap`, and a rank thread's arena cannot hold a 64 MiB
//! block at all), so every call pays one page fault per 4 KiB page while the collective
//! writes it, with four ranks faulting at once on a shared address space. Outputs handed to
//! candle cannot be recycled by the communicator (candle frees them through the global
//! allocator, with no hook to give them back), so this module makes fresh memory cheap
//! instead: buffers of [`HUGE_PAGE_MIN_BYTES`] or more are marked for transparent huge pages
//! (`madvise(MADV_HUGEPAGE)`, Linux; elsewhere, or with THP `never`, a no-op), one fault per
//! 2 MiB; and outputs a collective overwrites completely are never zero-filled first
//! ([`uninit_vec`]). docs/ARCHITECTURE.md ("Large outputs") has the measurements behind the
//! choice, and [`stats`] counts what was advised.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Buffers of at least this many bytes are advised for transparent huge pages.
pub const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

const HUGE_PAGE: usize = 2 << 20;

static HUGE_PAGES: AtomicBool = AtomicBool::new(true);
static ADVISED_BUFFERS: AtomicU64 = AtomicU64::new(0);
static ADVISED_BYTES: AtomicU64 = AtomicU64::new(0);

/// What this process advised so far (observable, e.g. in a benchmark's output).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// Buffers marked for huge pages.
    pub huge_page_buffers: u64,
    /// Bytes of whole 2 MiB pages inside them that the kernel was asked to back with huge pages.
    pub huge_page_bytes: u64,
}

/// The counters of [`MemoryStats`] since the process started.
pub fn stats() -> MemoryStats {
    MemoryStats {
        huge_page_buffers: ADVISED_BUFFERS.load(Ordering::Relaxed),
        huge_page_bytes: ADVISED_BYTES.load(Ordering::Relaxed),
    }
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
