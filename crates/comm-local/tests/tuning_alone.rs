//! `init_cpu_threads` and `init_gemm_threads` write the environment only while the caller is
//! the process's only thread. A test without libtest's harness (`harness = false`), so `main`
//! starts as the only thread, as a program's `main` does: it sees the variables set there,
//! then starts a second thread and sees both functions refuse and the environment unchanged,
//! then sets them again once that thread has ended.

// A harness-less test reports on stdout, as libtest would.
#![allow(clippy::print_stdout)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_dtensor_comm_local::{
    init_cpu_threads, init_gemm_threads, Tuned, CANDLE_NUM_THREADS_ENV, RAYON_NUM_THREADS_ENV,
};

/// The process's threads (entries of `/proc/self/task`), `None` where that is not available.
fn threads() -> Option<usize> {
    std::fs::read_dir("/proc/self/task")
        .ok()
        .map(|d| d.filter(|e| e.is_ok()).count())
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Clears both variables. Only called while `main` is the only thread (asserted), which is
/// what makes writing the environment sound here too.
fn clear() {
    assert_eq!(threads(), Some(1), "clear() with other threads alive");
    std::env::remove_var(CANDLE_NUM_THREADS_ENV);
    std::env::remove_var(RAYON_NUM_THREADS_ENV);
}

fn main() {
    if !cfg!(any(target_os = "linux", target_os = "android")) {
        // No thread count here: the functions always refuse, and say they could not count.
        assert_eq!(init_gemm_threads(4, 4), Tuned::Refused { threads: None });
        println!("tuning_alone: no thread count on this platform: refusal checked");
        return;
    }
    assert_eq!(threads(), Some(1), "main starts as the only thread");
    // `cargo test` sets CANDLE_NUM_THREADS (.cargo/config.toml): start from a clean slate.
    clear();

    // Alone: both variables are set, and a value already there (the user's) is kept.
    assert_eq!(init_cpu_threads(), Tuned::Set(1));
    assert_eq!(var(CANDLE_NUM_THREADS_ENV).as_deref(), Some("1"));
    assert_eq!(init_cpu_threads(), Tuned::UserSet);
    assert_eq!(init_gemm_threads(1, 1), Tuned::NotNeeded);
    assert_eq!(var(RAYON_NUM_THREADS_ENV), None);
    assert_eq!(init_gemm_threads(4, 4), Tuned::Set(1));
    assert_eq!(var(RAYON_NUM_THREADS_ENV).as_deref(), Some("1"));
    assert_eq!(init_gemm_threads(1, 2), Tuned::UserSet);
    std::env::remove_var(RAYON_NUM_THREADS_ENV); // still the only thread
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = (cpus / 2).max(1);
    assert_eq!(init_gemm_threads(1, 2), Tuned::Set(share));
    assert_eq!(var(RAYON_NUM_THREADS_ENV), Some(share.to_string()));

    // A second thread alive: both refuse, naming two threads, and the environment stays.
    clear();
    let (tx, rx) = mpsc::channel::<()>();
    let other = std::thread::spawn(move || {
        let _ = rx.recv_timeout(Duration::from_secs(60));
    });
    assert_eq!(threads(), Some(2));
    let refused = Tuned::Refused { threads: Some(2) };
    assert_eq!(init_cpu_threads(), refused);
    assert_eq!(init_gemm_threads(4, 4), refused);
    assert_eq!(init_gemm_threads(1, 2), refused);
    assert_eq!(init_gemm_threads(1, 1), Tuned::NotNeeded);
    assert_eq!(
        var(CANDLE_NUM_THREADS_ENV),
        None,
        "changed with a thread alive"
    );
    assert_eq!(
        var(RAYON_NUM_THREADS_ENV),
        None,
        "changed with a thread alive"
    );

    // Once it has ended (its task may linger a moment after join), alone again: set again.
    drop(tx);
    other.join().expect("no panic");
    let t0 = Instant::now();
    while threads() != Some(1) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(threads(), Some(1), "the second thread never went away");
    assert_eq!(init_cpu_threads(), Tuned::Set(1));
    assert_eq!(init_gemm_threads(4, 4), Tuned::Set(1));
    println!("tuning_alone: set while alone, refused with a second thread: ok");
}
