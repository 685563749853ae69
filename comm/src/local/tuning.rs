//! Process tuning for CPU ranks: candle's worker pool, the threads of its matmuls and glibc's
//! allocator. Ranks of the local backend are threads of one process, so these settings decide
//! whether they help or block each other; one-rank-per-process runs (dtrun, mpirun) use
//! [`init_gemm_threads`] to share the host. Re-exported by the `candle-dtensor` facade.

/// Environment variable that sizes candle 0.11's elementwise CPU worker pool.
pub const CANDLE_NUM_THREADS_ENV: &str = "CANDLE_NUM_THREADS";

/// Environment variable that sizes rayon's global pool, which candle 0.11 also reads as the
/// number of threads of every CPU matmul (gemm).
pub const RAYON_NUM_THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// Turns off candle's elementwise CPU worker pool unless the user sized it
/// (`CANDLE_NUM_THREADS`), and says whether it did.
///
/// Ranks of the local backend are threads that already keep the cores busy. candle 0.11's
/// pool serializes every caller behind one lock and spin-waits at its barrier, so with several
/// rank threads they block each other (measured: a 4-rank tensor-parallel step spent ~40% of
/// its time spinning, and even one rank ran ~2x slower on a 2-core machine). The pool is
/// created on candle's first elementwise op, so call this at the very start of `main`, before
/// any candle op and before other threads start (it sets a process environment variable).
/// Matmuls have their own threads: see [`init_gemm_threads`].
pub fn init_cpu_threads() -> bool {
    if std::env::var_os(CANDLE_NUM_THREADS_ENV).is_some() {
        return false;
    }
    std::env::set_var(CANDLE_NUM_THREADS_ENV, "1");
    true
}

/// Sizes the threads of every CPU matmul for this process's share of the host, unless the
/// user set `RAYON_NUM_THREADS`; says whether it set it.
///
/// candle 0.11 gives every CPU matmul `RAYON_NUM_THREADS` threads (default: the physical
/// cores) from rayon's global pool, which all threads of a process share.
/// - Several rank threads in this process (`ranks_in_process > 1`, the local backend): one
///   gemm thread per rank. Ranks already occupy the cores; sharing the pool they queue behind
///   each other and sleep and wake per matmul (on the 2-core box 4-rank train_gpt layouts ran
///   10-17% faster with one thread per rank; BENCHMARKS.md).
/// - One rank per process, `ranks_on_host` processes on this host (dtrun, mpirun): the host's
///   logical CPUs divided among them, at least one, so the processes do not oversubscribe
///   the cores with their pools.
/// - A single rank alone on the host: left alone (it gains from every core; one gemm thread
///   made the single-device step 17% slower on the 2-core box).
///
/// candle reads the variable at every matmul; call this before the rank threads start.
pub fn init_gemm_threads(ranks_in_process: usize, ranks_on_host: usize) -> bool {
    if std::env::var_os(RAYON_NUM_THREADS_ENV).is_some() {
        return false;
    }
    let threads = if ranks_in_process > 1 {
        1
    } else if ranks_on_host > 1 {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cpus / ranks_on_host).max(1)
    } else {
        return false;
    };
    std::env::set_var(RAYON_NUM_THREADS_ENV, threads.to_string());
    true
}

/// Makes glibc's allocator keep and reuse the memory of freed activation-sized and
/// collective-output-sized buffers instead of returning it to the kernel after every free, and
/// says whether it did: [`crate::memory::reuse_large_buffers`] (which `LocalWorld::launch`
/// also runs).
///
/// A training step allocates and frees the same set of 0.1-64 MB tensors every step. With
/// glibc's defaults many of them are fresh `mmap`s or regrow the heap top, so every step pays
/// page faults and zeroing of new pages (~5% of a CPU step in a profile; measured on the tiny
/// GPT, one rank: 8% shorter steps with the first version of these settings; see
/// BENCHMARKS.md). Process-wide: call it at the start of `main`, before other threads start.
/// A no-op returning `false` off glibc, or when the user set `GLIBC_TUNABLES` or a
/// `MALLOC_*` variable.
pub fn init_cpu_allocator() -> bool {
    crate::memory::reuse_large_buffers()
}
