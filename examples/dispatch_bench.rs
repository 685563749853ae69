//! Dispatch overhead of DTensor ops: the time of a DTensor op minus the same local candle op,
//! with the sharding decision cached (every iteration after the first hits the cache).
//!
//! ```text
//! cargo run --release --example dispatch_bench -- --json
//! ```
//!
//! Prints `op`, `shape`, `placements`, `candle_us`, `dtensor_us`, `overhead_us` (medians over
//! repeated batches, measured side by side in one run). Inputs do not require gradients, so no
//! autograd bookkeeping is included on either side.
#![allow(clippy::print_stdout)]

use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_dtensor::comm::LocalWorld;
use candle_dtensor::dtensor::{distribute_tensor, Placement};
use candle_dtensor::mesh::DeviceMesh;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "DTensor dispatch overhead")]
struct Args {
    /// Ranks (threads); each measures its own ops.
    #[arg(long, default_value_t = 1)]
    world: usize,
    /// Ops per timed batch.
    #[arg(long, default_value_t = 20_000)]
    iters: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 15)]
    batches: usize,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    shape: String,
    placements: String,
    world: usize,
    candle_us: f64,
    dtensor_us: f64,
    overhead_us: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(
    batches: usize,
    iters: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    for _ in 0..iters / 10 {
        f()?;
    }
    let mut per = Vec::with_capacity(batches);
    for _ in 0..batches {
        let t0 = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        per.push(t0.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    Ok(median(per))
}

type Bench = Box<dyn Fn(&DeviceMesh) -> candle_core::Result<(f64, f64)> + Send + Sync>;

#[path = "common/logging.rs"]
mod logging;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    let args = Args::parse();
    let (b, it) = (args.batches, args.iters);
    let cases: Vec<(&'static str, &'static str, Bench)> = vec![
        (
            "add",
            "S(0)",
            Box::new(move |mesh| {
                let a = Tensor::randn(0f32, 1., (8, 8), &Device::Cpu)?;
                let x = distribute_tensor(&a, mesh, &[Placement::Shard(0)])?;
                let y = distribute_tensor(&a, mesh, &[Placement::Shard(0)])?;
                let (lx, ly) = (x.to_local().clone(), y.to_local().clone());
                let c = time(b, it, || lx.add(&ly).map(|_| ()))?;
                let d = time(b, it, || x.add(&y).map(|_| ()).map_err(Into::into))?;
                Ok((c, d))
            }),
        ),
        (
            "matmul",
            "S(0) x R",
            Box::new(move |mesh| {
                let a = Tensor::randn(0f32, 1., (8, 8), &Device::Cpu)?;
                let x = distribute_tensor(&a, mesh, &[Placement::Shard(0)])?;
                let w = distribute_tensor(&a, mesh, &[Placement::Replicate])?;
                let (lx, lw) = (x.to_local().clone(), w.to_local().clone());
                let c = time(b, it, || lx.matmul(&lw).map(|_| ()))?;
                let d = time(b, it, || x.matmul(&w).map(|_| ()).map_err(Into::into))?;
                Ok((c, d))
            }),
        ),
    ];
    let mut rows = Vec::new();
    for (op, placements, case) in &cases {
        let res = LocalWorld::run(args.world, |comm| {
            let mesh = DeviceMesh::new(comm, &[("dp", args.world)])?;
            let (c, d) = case(&mesh)?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((c, d))
        })?;
        let (c, d) = res[0];
        rows.push(Row {
            op,
            shape: "8x8".into(),
            placements: placements.to_string(),
            world: args.world,
            candle_us: c,
            dtensor_us: d,
            overhead_us: d - c,
        });
    }
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!(
            "{:<8} {:<6} {:<10} {:>10} {:>11} {:>12}",
            "op", "shape", "placements", "candle_us", "dtensor_us", "overhead_us"
        );
        for r in &rows {
            println!(
                "{:<8} {:<6} {:<10} {:>10.3} {:>11.3} {:>12.3}",
                r.op, r.shape, r.placements, r.candle_us, r.dtensor_us, r.overhead_us
            );
        }
    }
    Ok(())
}
