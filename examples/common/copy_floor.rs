//! The copy floor of the benchmarks (`comm_bench`, `redistribute_bench`): the aggregate memcpy
//! rate of `n` threads copying at once, measured in the same run as the figures it calibrates.

use std::time::Instant;

/// The median of `v` (the upper one for an even count); 0 for an empty `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Aggregate memcpy rate (bytes/s) of `n` threads each copying `bytes` (at least 64 KiB)
/// concurrently into buffers already faulted in: the median of 9 rounds. The threads start
/// once and meet at a barrier before and after each round, so thread start-up is not timed.
pub fn copy_rate(n: usize, bytes: usize) -> f64 {
    let n = n.max(1);
    let bytes = bytes.max(64 << 10);
    // Never a zero fill: `vec![0u8; ..]` is a calloc whose untouched pages all map the
    // kernel's one shared zero page, which reads from cache and made thread 0's copy (a
    // quarter of a 4-thread floor) nearly free.
    let srcs: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 255) as u8 + 1; bytes]).collect();
    rounds(n, bytes, n * bytes, |i, dst| dst.copy_from_slice(&srcs[i]))
}

/// Aggregate memcpy rate (bytes/s) of all_gather's access pattern: each of `n` threads copies
/// the same `n` shared pieces of `bytes / n` (one per thread, real fills) into its own
/// `bytes`-long output, every thread starting at piece 0. Printed beside [`copy_rate`] as the
/// bound a receiver-copies gather can reach on this machine (the floor copies private buffers).
pub fn gather_rate(n: usize, bytes: usize) -> f64 {
    let n = n.max(1);
    let piece = (bytes / n).max(64 << 10);
    let pieces: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 255) as u8 + 1; piece]).collect();
    rounds(n, n * piece, n * n * piece, |_, dst| {
        for (r, p) in pieces.iter().enumerate() {
            dst[r * piece..(r + 1) * piece].copy_from_slice(p);
        }
    })
}

/// Runs `copy(i, dst)` on `n` threads, thread `i` with its own faulted-in `dst_bytes` output,
/// for 9 rounds between barriers; `moved` bytes per round over the median round time.
fn rounds(n: usize, dst_bytes: usize, moved: usize, copy: impl Fn(usize, &mut [u8]) + Sync) -> f64 {
    const ROUNDS: usize = 9;
    let mut dsts: Vec<Vec<u8>> = (0..n).map(|_| vec![1u8; dst_bytes]).collect();
    let barrier = std::sync::Barrier::new(n);
    let mut secs = Vec::with_capacity(ROUNDS);
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (i, dst) in dsts.iter_mut().enumerate() {
            let (barrier, copy) = (&barrier, &copy);
            handles.push(s.spawn(move || {
                let mut times = Vec::with_capacity(ROUNDS);
                for _ in 0..ROUNDS {
                    barrier.wait();
                    let t0 = Instant::now();
                    copy(i, dst);
                    barrier.wait();
                    if i == 0 {
                        times.push(t0.elapsed().as_secs_f64());
                    }
                }
                times
            }));
        }
        for h in handles {
            // A copy that panicked must not pass for a fast round.
            match h.join() {
                Ok(t) => secs.extend(t),
                Err(e) => std::panic::resume_unwind(e),
            }
        }
    });
    moved as f64 / median(secs).max(1e-9)
}
