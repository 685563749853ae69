//! Collective latency and bandwidth of the `mpi` backend, reported like `comm_bench` (the local
//! backend's) so the two compare side by side on one machine.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_bench
//! mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/mpi_bench -- \
//!     --size 4,64MiB --ops all_reduce,all_gather,reduce_scatter,all_to_all
//! ```
//!
//! Sizes are the nccl-tests buffer size S of f32 data. Sizes up to 64 KiB are timed as
//! back-to-back ops (latency), larger ones one op at a time between barriers; each iteration
//! counts the slowest rank. Rank 0 prints `op`, `bytes`, `median_ms`, `algbw_gbps` (S / t) and
//! `busbw_gbps` (algbw x 2(n-1)/n for all_reduce, x (n-1)/n for the others), one JSON object
//! per line with `--json`.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::{new_comm, CommOptions};
use clap::Parser;

#[path = "common/collective_bench.rs"]
mod collective_bench;
use collective_bench::{buffer_elems, time_op, BenchArgs, Op, Timing};

#[derive(Parser, Debug)]
#[command(about = "Collective bandwidth of the mpi backend (run under mpirun)")]
struct Args {
    #[command(flatten)]
    bench: BenchArgs,
    /// Back-to-back ops per latency sample.
    #[arg(long, default_value_t = 200)]
    batch: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[derive(serde::Serialize)]
struct Row {
    backend: &'static str,
    op: &'static str,
    world: usize,
    bytes: usize,
    median_ms: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    timing: &'static str,
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    if let Err(e) = real_main() {
        eprintln!("mpi_bench: error: {e}");
        std::process::exit(2);
    }
}

fn real_main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (sizes, ops) = args.bench.sizes_and_ops()?;
    let options = CommOptions::default().with_timeout(Duration::from_secs(120));
    let comm = new_comm("mpi", &Device::Cpu, "bench", options)?;
    let n = comm.size();
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let elems = buffer_elems(bytes, n);
        let timing = Timing::for_elems(elems, args.batch, args.bench.iters);
        for &op in &ops {
            if op != Op::AllReduce && !elems.is_multiple_of(n) {
                continue;
            }
            let x = Tensor::ones(op.input_elems(elems, n), DType::F32, &Device::Cpu)?;
            let o = Tensor::zeros(op.output_elems(elems, n), DType::F32, &Device::Cpu)?;
            let t = median(time_op(&comm, op, &x, Some(&o), timing)?);
            let s = (elems * 4) as f64;
            rows.push(Row {
                backend: "mpi",
                op: op.name(),
                world: n,
                bytes: elems * 4,
                median_ms: t * 1e3,
                algbw_gbps: s / t / 1e9,
                busbw_gbps: s / t / 1e9 * op.bus_factor(n),
                timing: timing.name(),
            });
        }
    }
    if comm.rank() != 0 {
        return Ok(());
    }
    if args.bench.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "mpi backend, {n} processes ({})",
        candle_dtensor::comm::mpi::info().map_or("MPI".into(), |i| format!(
            "{}, {}",
            i.library, i.thread_level
        ))
    );
    println!(
        "{:<16} {:>12} {:>11} {:>11} {:>11}",
        "op", "bytes", "median_ms", "algbw_GB/s", "busbw_GB/s"
    );
    for r in &rows {
        println!(
            "{:<16} {:>12} {:>11.4} {:>11.3} {:>11.3}",
            r.op, r.bytes, r.median_ms, r.algbw_gbps, r.busbw_gbps
        );
    }
    Ok(())
}
