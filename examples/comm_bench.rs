//! Collective bandwidth and latency of the local backend, reported like nccl-tests.
//!
//! ```text
//! cargo run --release --example comm_bench -- --world 4 --size 64MiB \
//!     --ops all_reduce,all_gather,reduce_scatter,all_to_all --json
//! ```
//!
//! For each op and size it prints `op`, `world`, `bytes` (the nccl-tests buffer size S),
//! `median_ms`, `algbw_gbps` (S / t), `busbw_gbps` (algbw x 2(n-1)/n for all_reduce, x (n-1)/n
//! for the others), `floor_ms` and `efficiency` (= floor_ms / median_ms). `floor_ms` is the time
//! the bytes that must cross between ranks (all_reduce 2(n-1)/n S per rank, the others (n-1)/n S
//! per rank, summed over ranks) take at the aggregate copy rate of n threads each running memcpy
//! concurrently, measured in the same run: the figure calibrates to the machine it runs on.
//! Sizes up to 64 KiB are timed as back-to-back ops (latency); larger ones one op at a time
//! between barriers.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::LocalWorld;
use clap::Parser;

#[path = "common/collective_bench.rs"]
mod collective_bench;
use collective_bench::{buffer_elems, time_op, BenchArgs, Op, Timing};
#[path = "common/copy_floor.rs"]
mod copy_floor;
use copy_floor::{copy_rate, gather_rate, median};

#[derive(Parser, Debug)]
#[command(about = "Collective bandwidth of the local backend (nccl-tests style)")]
struct Args {
    /// Number of ranks (threads).
    #[arg(long, default_value_t = 4)]
    world: usize,
    #[command(flatten)]
    bench: BenchArgs,
    /// Output buffers, comma separated: `into` (preallocated and reused, as nccl-tests measure),
    /// `alloc` (a fresh output tensor per call, the allocating API), `alloc-4k` (the same with
    /// the huge-page advice of `comm::memory` turned off, for comparison), or `both`
    /// (= `into,alloc`).
    #[arg(long, default_value = "both")]
    mode: String,
}

#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    world: usize,
    bytes: usize,
    dtype: &'static str,
    median_ms: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    floor_ms: f64,
    efficiency: f64,
    copy_rate_gbps: f64,
    timing: &'static str,
    output: &'static str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Into,
    Alloc,
    Alloc4k,
}

impl Output {
    fn name(self) -> &'static str {
        match self {
            Output::Into => "into",
            Output::Alloc => "alloc",
            Output::Alloc4k => "alloc-4k",
        }
    }
}

#[path = "common/logging.rs"]
mod logging;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    // Before any thread starts (LocalWorld::launch also runs it, but threads that exited
    // before, like the copy-floor threads, leave arenas that new threads would take over).
    candle_dtensor::init_cpu_allocator();
    let args = Args::parse();
    if args.world == 0 {
        return Err("--world must be at least 1".into());
    }
    let (sizes, ops) = args.bench.sizes_and_ops()?;
    let n = args.world;
    let mut modes: Vec<Output> = Vec::new();
    for m in args.mode.split(',') {
        match m.trim() {
            "into" => modes.push(Output::Into),
            "alloc" => modes.push(Output::Alloc),
            "alloc-4k" => modes.push(Output::Alloc4k),
            "both" => modes.extend([Output::Into, Output::Alloc]),
            other => {
                return Err(format!(
                    "--mode takes into, alloc, alloc-4k or both (comma separated); got {other:?}"
                )
                .into())
            }
        }
    }
    let max_bytes = sizes.iter().copied().max().unwrap_or(0);
    let rate = copy_rate(n, max_bytes);
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let elems = buffer_elems(bytes, n);
        let timing = Timing::for_elems(elems, 200, args.bench.iters);
        for (&op, &mode) in ops.iter().flat_map(|o| modes.iter().map(move |m| (o, m))) {
            if op != Op::AllReduce && !elems.is_multiple_of(n) {
                continue;
            }
            let into = mode == Output::Into;
            candle_dtensor::comm::memory::set_huge_pages(mode != Output::Alloc4k);
            let times = LocalWorld::new(n)
                .with_timeout(Duration::from_secs(120))
                .launch(|comm| {
                    let x = Tensor::ones(op.input_elems(elems, n), DType::F32, &Device::Cpu)?;
                    let out = Tensor::zeros(op.output_elems(elems, n), DType::F32, &Device::Cpu)?;
                    time_op(&comm, op, &x, into.then_some(&out), timing)
                })?;
            let t = median(times[0].clone());
            let s = (elems * 4) as f64;
            let crossing = s * op.bus_factor(n) * n as f64;
            let floor = crossing / rate;
            rows.push(Row {
                op: op.name(),
                world: n,
                bytes: elems * 4,
                dtype: "f32",
                median_ms: t * 1e3,
                algbw_gbps: s / t / 1e9,
                busbw_gbps: s / t / 1e9 * op.bus_factor(n),
                floor_ms: floor * 1e3,
                efficiency: if t > 0.0 { floor / t } else { 0.0 },
                copy_rate_gbps: rate / 1e9,
                timing: timing.name(),
                output: mode.name(),
            });
        }
    }
    let memory = candle_dtensor::comm::memory::stats();
    if args.bench.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        println!("{}", serde_json::json!({ "memory": memory }));
    } else {
        println!(
            "world {n}, aggregate memcpy rate of {n} threads: {:.2} GB/s",
            rate / 1e9
        );
        let g = gather_rate(n, max_bytes);
        println!(
            "the same bytes in all_gather's pattern (shared pieces into each thread's output): \
             {:.2} GB/s ({:.2} of the floor's rate)",
            g / 1e9,
            g / rate.max(1e-9)
        );
        println!(
            "{:<16} {:>8} {:>12} {:>11} {:>11} {:>11} {:>10} {:>10}",
            "op",
            "output",
            "bytes",
            "median_ms",
            "algbw_GB/s",
            "busbw_GB/s",
            "floor_ms",
            "efficiency"
        );
        for r in &rows {
            println!(
                "{:<16} {:>8} {:>12} {:>11.4} {:>11.3} {:>11.3} {:>10.3} {:>10.2}",
                r.op,
                r.output,
                r.bytes,
                r.median_ms,
                r.algbw_gbps,
                r.busbw_gbps,
                r.floor_ms,
                r.efficiency
            );
        }
        println!("memory: {}", serde_json::to_string(&memory)?);
    }
    Ok(())
}
