//! all_gather / all_reduce bandwidth sweep on the `nccl` backend, printed as nccl-tests does
//! (feature `nccl`, one GPU per rank).
//!
//! ```text
//! target/release/examples/nccl_bench                       # a world of one
//! target/release/dtrun --nproc 8 -- target/release/examples/nccl_bench --max-bytes 1G
//! ```
//!
//! For each size (doubling from `--min-bytes` to `--max-bytes`) it warms up, then issues
//! `--iters` operations back to back on the communicator's stream (the `Work`s are
//! stream-ordered, so the CPU only enqueues) and synchronizes once: time = elapsed / iters, as
//! nccl-tests measures. S is the all_reduce buffer and the all_gather *output* (nccl-tests'
//! definition); algbw = S / time (GB/s, 1e9), busbw = algbw x 2(n-1)/n for all_reduce and
//! x (n-1)/n for all_gather (0 on a world of one, where nothing crosses a link). Every rank
//! measures; rank 0 prints the table (and `--json` a line with every row).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::env::LaunchEnv;
use candle_dtensor::comm::{nccl, new_comm, Comm, CommOptions, ReduceOp};
use candle_dtensor::kernels::compare::nan_max;
use clap::Parser;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
struct Args {
    /// The smallest size in bytes (suffixes K, M, G allowed).
    #[arg(long, default_value = "8")]
    min_bytes: String,
    /// The largest size in bytes (suffixes K, M, G allowed).
    #[arg(long, default_value = "256M")]
    max_bytes: String,
    /// Timed iterations per size (large sizes use fewer, never below 5).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Op timeout in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Print one JSON line with every row.
    #[arg(long)]
    json: bool,
}

fn bytes(s: &str) -> R<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num.parse::<usize>()? * mul)
}

struct Row {
    op: &'static str,
    size: usize,
    count: usize,
    us: f64,
    algbw: f64,
    busbw: f64,
}

fn measure(c: &Comm, dev: &Device, op: &'static str, size: usize, args: &Args) -> R<Row> {
    let n = c.size();
    // S: the all_reduce buffer; the all_gather output (each rank sends S / n).
    let count = match op {
        "all_reduce" => (size / 4).max(1),
        _ => (size / 4 / n).max(1),
    };
    let x = Tensor::ones(count, DType::F32, dev)?;
    let out = match op {
        "all_reduce" => x.clone(),
        _ => Tensor::zeros(count * n, DType::F32, dev)?,
    };
    let run = || -> R<()> {
        // wait() only orders the caller's stream: nothing blocks here.
        match op {
            "all_reduce" => drop(c.all_reduce_into(&out, &out, ReduceOp::Sum)?.wait()?),
            _ => drop(c.all_gather_single_into(&out, &x)?.wait()?),
        }
        Ok(())
    };
    for _ in 0..args.warmup {
        run()?;
    }
    dev.synchronize()?;
    c.barrier()?.wait()?;
    let s_bytes = match op {
        "all_reduce" => count * 4,
        _ => count * 4 * n,
    };
    let iters = if s_bytes >= 64 << 20 {
        args.iters.clamp(5, 10)
    } else {
        args.iters.max(5)
    };
    let t0 = Instant::now();
    for _ in 0..iters {
        run()?;
    }
    dev.synchronize()?;
    let dt = t0.elapsed().as_secs_f64() / iters as f64;
    let nf = n as f64;
    let factor = match op {
        "all_reduce" => 2.0 * (nf - 1.0) / nf,
        _ => (nf - 1.0) / nf,
    };
    let algbw = s_bytes as f64 / dt / 1e9;
    Ok(Row {
        op,
        size: s_bytes,
        count: match op {
            "all_reduce" => count,
            _ => count * n,
        },
        us: dt * 1e6,
        algbw,
        busbw: algbw * factor,
    })
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("nccl_bench: error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> R<()> {
    let t = Duration::from_secs(args.timeout);
    let options = CommOptions::default()
        .with_timeout(t)
        .with_bootstrap_timeout(t);
    let launched = LaunchEnv::is_launched();
    let gpus = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map_err(|e| format!("no CUDA device: {e}"))? as usize;
    let local = if launched {
        LaunchEnv::from_env()?.local_index()
    } else {
        0
    };
    let dev = Device::new_cuda(local % gpus.max(1))?;
    let c = if launched {
        new_comm("nccl", &dev, "bench", options)?
    } else {
        nccl::connect(&dev, 0, 1, None, "bench", options)?
    };
    let (lo, hi) = (bytes(&args.min_bytes)?, bytes(&args.max_bytes)?);
    let mut rows = Vec::new();
    for op in ["all_gather", "all_reduce"] {
        let mut size = lo.max(4);
        while size <= hi {
            rows.push(measure(&c, &dev, op, size, args)?);
            size *= 2;
        }
    }
    if c.rank() == 0 {
        println!(
            "# nccl_bench: NCCL {}, {} ranks, float32, out-of-place all_gather, in-place all_reduce",
            nccl::library_version()?,
            c.size()
        );
        println!(
            "# {:>10} {:>12} {:>12} {:>10} {:>10} {:>10}",
            "op", "size (B)", "count", "time (us)", "algbw GB/s", "busbw GB/s"
        );
        for r in &rows {
            println!(
                "  {:>10} {:>12} {:>12} {:>10.1} {:>10.2} {:>10.2}",
                r.op, r.size, r.count, r.us, r.algbw, r.busbw
            );
        }
        for op in ["all_gather", "all_reduce"] {
            let best = rows
                .iter()
                .filter(|r| r.op == op)
                .map(|r| r.busbw)
                .fold(0.0, nan_max);
            let peak_alg = rows
                .iter()
                .filter(|r| r.op == op)
                .map(|r| r.algbw)
                .fold(0.0, nan_max);
            println!("# {op}: peak algbw {peak_alg:.2} GB/s, peak busbw {best:.2} GB/s");
        }
        if args.json {
            let v = serde_json::json!({
                "bench": "nccl_bench",
                "world": c.size(),
                "rows": rows.iter().map(|r| serde_json::json!({
                    "op": r.op, "bytes": r.size, "us": r.us, "algbw": r.algbw, "busbw": r.busbw,
                })).collect::<Vec<_>>(),
            });
            println!("{v}");
        }
    }
    Ok(())
}
