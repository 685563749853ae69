//! Process tuning for CPU ranks: candle's worker pool, the threads of its matmuls and glibc's
//! allocator. Ranks of the local backend are threads of one process, so these settings decide
//! whether they help or block each other; one-rank-per-process runs (dtrun, mpirun) use
//! [`init_gemm_threads`] to share the host. Re-exported by the `candle-dtensor` facade.
//!
//! # Call before any other thread exists
//!
//! candle 0.11 has no API for either pool's size: it reads `CANDLE_NUM_THREADS` when its
//! elementwise pool starts and `RAYON_NUM_THREADS` at every CPU matmul
//! (`candle_core::utils::get_num_threads`), so the only way to size them is the process
//! environment. Writing the environment (`setenv`) while another thread may read it (`getenv`,
//! which glibc and other C libraries call without Rust's environment lock) is undefined
//! behaviour. So [`init_cpu_threads`] and [`init_gemm_threads`] write it only while the calling
//! thread is the process's only thread, and otherwise refuse: they return
//! [`Tuned::Refused`] and log a warning naming the variable, leaving the environment as it was.
//! Call them first thing in `main` (or set the variables in the shell, which always wins).
//!
//! How the threads are counted: on Linux and Android, the entries of `/proc/self/task` (one
//! per thread of the process). Elsewhere the count is not available, so the functions always
//! refuse ([`Tuned::Refused`] with `threads: None`): set the variables in the shell there.

/// Environment variable that sizes candle 0.11's elementwise CPU worker pool.
pub const CANDLE_NUM_THREADS_ENV: &str = "CANDLE_NUM_THREADS";

/// Environment variable that sizes rayon's global pool, which candle 0.11 also reads as the
/// number of threads of every CPU matmul (gemm).
pub const RAYON_NUM_THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// What [`init_cpu_threads`] or [`init_gemm_threads`] did with its environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tuned {
    /// Set the variable to this many threads.
    Set(usize),
    /// The user had set the variable: left as it was.
    UserSet,
    /// Nothing to set for this layout (a single rank alone on its host keeps every core).
    NotNeeded,
    /// Not set, because other threads exist that may read the environment while it changes
    /// (see the [module docs](self)): the process had `threads` threads (`None`: the platform
    /// cannot count them). Call the function before any thread starts, or set the variable in
    /// the shell.
    Refused {
        /// The process's threads when it refused, the caller included.
        threads: Option<usize>,
    },
}

impl Tuned {
    /// Whether the variable was set by this call.
    pub fn is_set(&self) -> bool {
        matches!(self, Tuned::Set(_))
    }
}

/// Turns off candle's elementwise CPU worker pool unless the user sized it
/// (`CANDLE_NUM_THREADS`), and says what it did.
///
/// Ranks of the local backend are threads that already keep the cores busy. candle 0.11's
/// pool serializes every caller behind one lock and spin-waits at its barrier, so with several
/// rank threads they block each other (measured: a 4-rank tensor-parallel step spent ~40% of
/// its time spinning, and even one rank ran ~2x slower on a 2-core machine). The pool is
/// created on candle's first elementwise op, so call this at the very start of `main`, before
/// any candle op and before any other thread starts: once another thread exists it refuses
/// ([`Tuned::Refused`], see the [module docs](self)). Matmuls have their own threads: see
/// [`init_gemm_threads`].
pub fn init_cpu_threads() -> Tuned {
    if std::env::var_os(CANDLE_NUM_THREADS_ENV).is_some() {
        return Tuned::UserSet;
    }
    set_while_alone(CANDLE_NUM_THREADS_ENV, 1)
}

/// Sizes the threads of every CPU matmul for this process's share of the host, unless the
/// user set `RAYON_NUM_THREADS`; says what it did.
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
/// - A single rank alone on the host: left alone ([`Tuned::NotNeeded`]; it gains from every
///   core: one gemm thread made the single-device step 17% slower on the 2-core box).
///
/// candle reads the variable at every matmul, so it must be set before any thread exists: call
/// this at the start of `main`, before the rank threads, a CUDA context or a first matmul
/// (rayon's pool) start threads; afterwards it refuses ([`Tuned::Refused`], see the
/// [module docs](self)).
pub fn init_gemm_threads(ranks_in_process: usize, ranks_on_host: usize) -> Tuned {
    if std::env::var_os(RAYON_NUM_THREADS_ENV).is_some() {
        return Tuned::UserSet;
    }
    let threads = if ranks_in_process > 1 {
        1
    } else if ranks_on_host > 1 {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cpus / ranks_on_host).max(1)
    } else {
        return Tuned::NotNeeded;
    };
    set_while_alone(RAYON_NUM_THREADS_ENV, threads)
}

/// Sets `var` to `threads` if the calling thread is the process's only thread; otherwise
/// leaves the environment alone, warns and says why.
fn set_while_alone(var: &'static str, threads: usize) -> Tuned {
    match process_threads() {
        Some(1) => {
            // Invariant of `set_var` (an `unsafe fn` from edition 2024 on): no other thread
            // reads or writes the environment during the call. It holds: the count says this
            // thread is the process's only one, and no thread can start before `set_var`
            // returns, since only a thread of this process could start one and this thread is
            // busy here. (`tuning::tests` and `tests/tuning_alone.rs` try it with a second
            // thread alive and see the refusal.)
            std::env::set_var(var, threads.to_string());
            tracing::debug!(variable = var, threads, "set while the only thread");
            Tuned::Set(threads)
        }
        counted => {
            tracing::warn!(
                variable = var,
                value = threads,
                process_threads = ?counted,
                "not setting {var}={threads}: other threads may read the environment while it \
                 changes (the process has {}); call candle_dtensor::init_cpu_threads / \
                 init_gemm_threads first thing in main, or set {var} in the shell",
                counted.map_or_else(|| "an unknown number of threads".to_string(), |n| format!("{n} threads"))
            );
            Tuned::Refused { threads: counted }
        }
    }
}

/// The number of threads of this process, the caller included; `None` where it cannot be
/// counted (no `/proc`, or a platform other than Linux and Android).
fn process_threads() -> Option<usize> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // One entry per thread of the process ("self" is the thread group, whichever thread
        // reads it).
        let dir = std::fs::read_dir("/proc/self/task").ok()?;
        let mut n = 0usize;
        for entry in dir {
            entry.ok()?;
            n += 1;
        }
        (n > 0).then_some(n)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        None
    }
}

/// Makes glibc's allocator keep and reuse the memory of freed activation-sized and
/// collective-output-sized buffers instead of returning it to the kernel after every free, and
/// says whether it did: [`candle_dtensor_comm_core::memory::reuse_large_buffers`] (which `LocalWorld::launch`
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
    candle_dtensor_comm_core::memory::reuse_large_buffers()
}

#[cfg(test)]
mod tests {
    //! libtest runs every test on a worker thread, so these see the refusal; the success path
    //! (the only thread) is `tests/tuning_alone.rs`, a test without libtest's harness.

    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A thread that stays alive until the returned sender is dropped (at most 60 s), and
    /// its kernel thread id (Linux and Android; empty elsewhere).
    fn second_thread() -> (mpsc::Sender<()>, std::thread::JoinHandle<()>, String) {
        let (tx, rx) = mpsc::channel::<()>();
        let (tid_tx, tid_rx) = mpsc::channel::<String>();
        let h = std::thread::spawn(move || {
            #[cfg(any(target_os = "linux", target_os = "android"))]
            // SAFETY: the gettid system call has no arguments and no preconditions; it returns
            // the calling thread's id. (Through `syscall`: glibc's `gettid` wrapper needs 2.30.)
            let tid = unsafe { libc::syscall(libc::SYS_gettid) }.to_string();
            #[cfg(not(any(target_os = "linux", target_os = "android")))]
            let tid = String::new();
            let _ = tid_tx.send(tid);
            let _ = rx.recv_timeout(Duration::from_secs(60));
        });
        let tid = tid_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the thread started");
        (tx, h, tid)
    }

    #[test]
    fn counts_the_threads_of_the_process() {
        let (tx, h, tid) = second_thread();
        let during = process_threads();
        let listed = std::path::Path::new(&format!("/proc/self/task/{tid}")).exists();
        drop(tx);
        h.join().expect("no panic");
        if cfg!(any(target_os = "linux", target_os = "android")) {
            // The spawned thread is one of the entries counted, next to this test's thread and
            // libtest's main thread (other tests' threads come and go meanwhile).
            assert!(listed, "thread {tid} not in /proc/self/task");
            assert!(during.is_some_and(|n| n >= 3), "{during:?}");
        } else {
            assert_eq!(during, None);
        }
    }

    fn assert_refused(got: Tuned, what: &str) {
        match got {
            Tuned::Refused { threads } => {
                if cfg!(any(target_os = "linux", target_os = "android")) {
                    // This thread, the spawned one and libtest's main thread.
                    assert!(threads.is_some_and(|n| n >= 3), "{what}: {threads:?}");
                } else {
                    assert_eq!(threads, None, "{what}");
                }
            }
            other => panic!("{what}: set with another thread alive: {other:?}"),
        }
    }

    #[test]
    fn refuses_to_write_the_environment_while_another_thread_exists() {
        // A variable nothing else reads or writes, so the test owns it.
        const VAR: &str = "CDT_TUNING_TEST_NEVER_SET";
        let (tx, h, _) = second_thread();
        let got = set_while_alone(VAR, 3);
        drop(tx);
        h.join().expect("no panic");
        assert_refused(got, VAR);
        assert_eq!(std::env::var_os(VAR), None, "the environment changed");
    }

    #[test]
    fn the_public_functions_refuse_too_and_leave_the_environment_as_it_was() {
        let (tx, h, _) = second_thread();
        let cpu_before = std::env::var_os(CANDLE_NUM_THREADS_ENV);
        let gemm_before = std::env::var_os(RAYON_NUM_THREADS_ENV);
        let cpu = init_cpu_threads();
        let gemm = init_gemm_threads(4, 4);
        let one_rank_alone = init_gemm_threads(1, 1);
        drop(tx);
        h.join().expect("no panic");
        // `cargo test` sets CANDLE_NUM_THREADS (.cargo/config.toml); a user may set either.
        for (name, got, before) in [
            (CANDLE_NUM_THREADS_ENV, cpu, &cpu_before),
            (RAYON_NUM_THREADS_ENV, gemm, &gemm_before),
        ] {
            if before.is_some() {
                assert_eq!(got, Tuned::UserSet, "{name}");
            } else {
                assert_refused(got, name);
            }
            assert_eq!(&std::env::var_os(name), before, "{name} changed");
        }
        // A single rank alone on its host needs nothing, threads or not.
        if gemm_before.is_none() {
            assert_eq!(one_rank_alone, Tuned::NotNeeded);
        }
    }
}
