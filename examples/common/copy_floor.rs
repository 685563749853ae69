//! The copy floor of the benchmarks (`comm_bench`, `redistribute_bench`): the aggregate memcpy
//! rate of `n` threads copying at once, measured in the same run as the figures it calibrates.

use std::time::Instant;

/// The median of `v` (the upper one for an even count); 0 for an empty `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Aggregate memcpy rate (bytes/s) of `n` threads each copying `bytes` (at least 1 MiB)
/// concurrently into buffers already faulted in: the median of 5 rounds.
pub fn copy_rate(n: usize, bytes: usize) -> f64 {
    let bytes = bytes.max(1 << 20);
    let srcs: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; bytes]).collect();
    let mut dsts: Vec<Vec<u8>> = (0..n).map(|_| vec![1u8; bytes]).collect();
    let mut rates = Vec::new();
    for _ in 0..5 {
        let barrier = std::sync::Barrier::new(n);
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in srcs.iter().zip(dsts.iter_mut()) {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    dst.copy_from_slice(src);
                });
            }
        });
        rates.push((n * bytes) as f64 / t0.elapsed().as_secs_f64());
    }
    median(rates)
}
