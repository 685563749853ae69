//! Timing of device work for the kernel benchmarks (`adamw_bench`, `attn_bench`): GPU time
//! between CUDA timing events (`kernels::profile::Mark`) on CUDA, wall time after a device
//! synchronisation elsewhere; summaries as median, p10 and p90.

use std::time::Instant;

use candle_core::Device;
use candle_dtensor::kernels::profile::{Mark, Stamp};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// How many times a benchmark repeats each timed call (`--iters`, `--warmup`), flattened into
/// each benchmark's own flags.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct Reps {
    /// Measured repetitions of each kind.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Repetitions of each kind before measuring.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
}

impl Reps {
    /// An error unless at least one repetition is measured.
    pub fn check(&self) -> R<()> {
        if self.iters == 0 {
            return Err("--iters must be at least 1".into());
        }
        Ok(())
    }
}

/// Median, p10 and p90 (nearest rank) of `ms`.
pub fn stats(ms: &[f64]) -> serde_json::Value {
    let mut v = ms.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
    serde_json::json!({ "median": at(0.5), "p10": at(0.1), "p90": at(0.9), "n": v.len() })
}

/// The median of `ms` (NaN for none).
pub fn median(ms: &[f64]) -> f64 {
    if ms.is_empty() {
        return f64::NAN;
    }
    stats(ms)["median"].as_f64().unwrap_or(f64::NAN)
}

/// Milliseconds of each of `reps.iters` calls of `f` after `reps.warmup`: GPU time between
/// timing marks around each call on CUDA (the device synchronized between calls), wall time
/// otherwise.
pub fn time(dev: &Device, reps: Reps, mut f: impl FnMut() -> R<()>) -> R<Vec<f64>> {
    let Reps { iters, warmup } = reps;
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut marks = Vec::new();
    let mut wall = Vec::new();
    let mut start = Mark::record(dev)?;
    for _ in 0..iters {
        let t = Instant::now();
        f()?;
        match start.take() {
            Some(s) => {
                let end = Mark::record(dev)?.ok_or("a CUDA device gave no timing mark")?;
                marks.push((s, end));
                // Each call starts on an idle device, as the PyTorch side of gpu_bench measures
                // (events around the call, then a synchronisation): its launch latency is in its
                // time instead of hidden behind the previous call's queued work.
                dev.synchronize()?;
                start = Mark::record(dev)?;
            }
            None => {
                dev.synchronize()?;
                wall.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    if marks.is_empty() {
        return Ok(wall);
    }
    if let Some((_, last)) = marks.last() {
        last.wait()?;
    }
    marks
        .iter()
        .map(|(a, b)| {
            b.ms_since(a)?
                .ok_or_else(|| "a timing mark unread after waiting".into())
        })
        .collect()
}
