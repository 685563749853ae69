//! `--count-kernels`: the kernels one training step launches, counted by CUPTI
//! (`kernels::profile::cupti`) over the run's last step, which follows at least one other
//! (warm-up: allocation, cuBLAS heuristics, PTX loads). Only that step pays CUPTI's per-kernel
//! record and the two device synchronisations around it; every step before runs as without
//! the option.

use candle_core::Device;
use candle_dtensor::kernels::profile::cupti::{KernelCount, KernelCounter};

/// Kernel names kept in the summary (most GPU time first).
const TOP: usize = 30;

/// Counts rank 0's last step; started and read from its step callback.
#[derive(Debug)]
pub(crate) struct KernelWindow {
    /// The run's last step index + 1.
    total: usize,
    counter: Option<KernelCounter>,
    outcome: Option<Result<KernelCount, String>>,
}

impl KernelWindow {
    pub(crate) fn new(total: usize) -> Self {
        KernelWindow {
            total,
            counter: None,
            outcome: None,
        }
    }

    /// After step `step`, on rank 0's thread with its `device` (a CUDA device synchronizes
    /// the calling thread's stream).
    pub(crate) fn on_step(&mut self, step: usize, device: &Device) {
        if self.outcome.is_some() {
            return;
        }
        if step + 2 == self.total {
            // Everything before the last step finishes before counting starts.
            self.outcome = sync(device).err().map(Err);
            if self.outcome.is_none() {
                match KernelCounter::start() {
                    Ok(c) => self.counter = Some(c),
                    Err(e) => self.outcome = Some(Err(e.to_string())),
                }
            }
        } else if step + 1 == self.total {
            let counted = match self.counter.take() {
                Some(c) => sync(device).and_then(|()| c.take().map_err(|e| e.to_string())),
                None => Err("the last step ran without a step before it in this run: \
                             kernels are counted over the last step after at least one other"
                    .into()),
            };
            self.outcome = Some(counted);
        }
    }

    /// The summary's `kernels` object: the last step's count, or why there is none.
    pub(crate) fn summary(&self, ranks_in_process: usize) -> serde_json::Value {
        match &self.outcome {
            Some(Ok(c)) => serde_json::json!({
                "step": self.total.saturating_sub(1),
                "kernels_per_step": c.kernels,
                "kernel_ms_per_step": c.busy_ns as f64 / 1e6,
                "ranks_in_process": ranks_in_process,
                "dropped_records": c.dropped,
                "malformed_records": c.malformed,
                // Where the step's GPU time went: the kernels by name, most time first (empty
                // where this CUPTI's records are not known to carry names).
                "top": c.by_name.iter().take(TOP).map(|k| serde_json::json!({
                    "name": k.name,
                    "count": k.count,
                    "ms": k.busy_ns as f64 / 1e6,
                })).collect::<Vec<_>>(),
            }),
            Some(Err(e)) => serde_json::json!({ "error": e }),
            None => serde_json::json!({ "error": "the run ended before its last step" }),
        }
    }
}

fn sync(device: &Device) -> Result<(), String> {
    device
        .synchronize()
        .map_err(|e| format!("synchronizing the device: {e}"))
}
