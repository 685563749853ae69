//! The cap on free heap kept for reuse (`memory::retained_max_bytes`) is enforced: a freed
//! large block stays for reuse while it fits under the cap, and the next large allocation
//! trims what exceeds it. A test without libtest's harness (`harness = false`): the
//! allocator is tuned on the main thread before any other thread exists, so every
//! allocation below comes from glibc's main heap, where trimming applies.

// A harness-less test reports on stdout, as libtest would.
#![allow(clippy::print_stdout)]

use candle_dtensor_comm_core::memory;

const MIB: usize = 1 << 20;

fn main() {
    if !memory::reuse_large_buffers() || !cfg!(all(target_os = "linux", target_env = "gnu")) {
        println!("memory_cap: allocator not tunable here (not glibc, or MALLOC_* set): skipped");
        return;
    }
    let default_cap = memory::retained_max_bytes();
    assert!(default_cap >= memory::RETAINED_MIN_BYTES);
    // glibc before 2.33 (no mallinfo2) refuses an mmap threshold above 32 MiB, and holds the
    // cap with its own trim threshold instead of ours (memory.rs, `TRIM_BY_US`): blocks of
    // 24 MiB stay in its heap there, and our trim counter never moves.
    let exact = memory::stats().heap_stats == memory::HeapStatsSource::Mallinfo2;
    let block = if exact { 256 * MIB } else { 24 * MIB };

    // Under a generous cap a freed block stays in the heap and is reused: no trim.
    let before = memory::stats();
    for _ in 0..3 {
        let mut v = memory::vec_with_capacity::<u8>(block);
        v.resize(block, 1);
        assert_eq!(v[block - 1], 1);
    }
    let kept = memory::stats();
    assert_eq!(kept.trims, before.trims, "no trim under the default cap");
    assert!(
        kept.heap_free_bytes >= block as u64,
        "the freed block is kept for reuse: {kept:?}"
    );
    if !exact {
        println!(
            "memory_cap: ok for reuse ({:?}); the cap is glibc's own trim threshold on this \
             glibc, so our trimming is not exercised",
            kept.heap_stats
        );
        return;
    }

    // Lower the cap: the next large allocation gives back what exceeds it.
    assert_eq!(memory::set_retained_max_bytes(64 * MIB), default_cap);
    assert_eq!(memory::retained_max_bytes(), 64 * MIB);
    let w = memory::vec_with_capacity::<u8>(8 * MIB);
    let trimmed = memory::stats();
    assert_eq!(trimmed.trims, kept.trims + 1, "one trim: {trimmed:?}");
    assert!(
        trimmed.heap_bytes + (128 * MIB) as u64 <= kept.heap_bytes,
        "the heap shrank by the freed block: {kept:?} -> {trimmed:?}"
    );
    drop(w);

    // Back to the default; memory given back and taken again reads as written.
    memory::set_retained_max_bytes(0);
    assert_eq!(memory::retained_max_bytes(), default_cap);
    memory::release_free_memory();
    let z = vec![9u16; 64 * MIB];
    assert!(z.iter().all(|&x| x == 9));
    println!("memory_cap: ok (default cap {} MiB)", default_cap / MIB);
}
