//! Multi-process collectives and DTensor ops on the `process` backend, one rank per process.
//!
//! ```text
//! cargo build --release -p dtrun && cargo build --release --example mp_allreduce
//! target/release/dtrun --nproc 4 -- target/release/examples/mp_allreduce
//! target/release/dtrun --nproc 4 -- target/release/examples/mp_allreduce --bench
//! ```
//!
//! Every rank creates the world communicator with `new_comm("process", ...)` (rank, size and the
//! store address come from dtrun's environment), checks a few collectives, builds a
//! `DeviceMesh` and runs column- and row-parallel DTensor matmuls against the single-device
//! result. With `--bench`, rank 0 also prints all_reduce / all_gather latency and bandwidth
//! as nccl-tests does (S = the all_reduce buffer or the all_gather output; algbw = S / time;
//! busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather), comparable with
//! `comm_bench`'s figures for the local backend.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::{new_comm, Comm, CommOptions, ReduceOp};
use candle_dtensor::dtensor::{distribute_tensor, Placement};
use candle_dtensor::kernels::compare::max_abs_diff;
use candle_dtensor::mesh::DeviceMesh;
use clap::Parser;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
struct Args {
    /// Also measure all_reduce / all_gather latency and bandwidth.
    #[arg(long)]
    bench: bool,
    /// Op timeout in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

fn check_collectives(c: &Comm) -> R<()> {
    let (me, n) = (c.rank() as f32, c.size() as f32);
    let x = Tensor::full(me + 1.0, (3, 5), &Device::Cpu)?;
    let s = c.all_reduce(&x, ReduceOp::Sum)?.wait()?;
    let want = n * (n + 1.0) / 2.0;
    assert!(
        s.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|&v| v == want),
        "all_reduce"
    );
    let g = c.all_gather_single(&x)?.wait()?;
    assert_eq!(g.dims(), &[3 * c.size(), 5], "all_gather_single");
    let rows = g.sum(1)?.to_vec1::<f32>()?;
    for (i, v) in rows.iter().enumerate() {
        assert_eq!(
            *v,
            5.0 * ((i / 3) as f32 + 1.0),
            "all_gather_single row {i}"
        );
    }
    let big = Tensor::arange(0f32, (c.size() * 100_000) as f32, &Device::Cpu)?;
    let rs = c.reduce_scatter_single(&big, ReduceOp::Max)?.wait()?;
    let first = rs.get(0)?.to_scalar::<f32>()?;
    assert_eq!(first, (c.rank() * 100_000) as f32, "reduce_scatter_single");
    let b = c
        .broadcast(&Tensor::full(me, 4, &Device::Cpu)?, c.size() - 1)?
        .wait()?;
    assert_eq!(b.to_vec1::<f32>()?, vec![n - 1.0; 4], "broadcast");
    c.barrier()?.wait()?;
    Ok(())
}

fn check_dtensor(mesh: &DeviceMesh) -> R<()> {
    let dev = Device::Cpu;
    let x = Tensor::arange(0f32, 48., &dev)?
        .reshape((6, 8))?
        .affine(0.1, -1.0)?;
    let w = Tensor::arange(0f32, 80., &dev)?
        .reshape((8, 10))?
        .affine(0.05, 0.3)?;
    let want = x.matmul(&w)?;
    let tp = mesh.dim("tp")?;
    // Column parallel: x replicated, w split by columns; then gathered.
    let xd = distribute_tensor(&x, &tp, &[Placement::Replicate])?;
    let wd = distribute_tensor(&w, &tp, &[Placement::Shard(1)])?;
    let col = xd.matmul(&wd)?.full_tensor()?;
    // Row parallel: x split by columns, w by rows: a partial sum, all-reduced.
    let xr = distribute_tensor(&x, &tp, &[Placement::Shard(1)])?;
    let wr = distribute_tensor(&w, &tp, &[Placement::Shard(0)])?;
    let row = xr.matmul(&wr)?.redistribute(&[Placement::Replicate])?;
    for (what, got) in [
        ("column-parallel", col),
        ("row-parallel", row.to_local().clone()),
    ] {
        // NaN-propagating (candle's max_all drops NaN, so a NaN result read as a match); a NaN
        // diff fails the `<`.
        let diff = max_abs_diff(&got, &want)?;
        assert!(
            diff < 1e-4,
            "{what} matmul differs from one device by {diff}"
        );
    }
    // A 2-D placement over the whole mesh: rows over the first dim, columns over tp.
    let names = mesh.dim_names();
    if names.len() == 2 {
        let xd = distribute_tensor(&x, mesh, &[Placement::Shard(0), Placement::Shard(1)])?;
        let back = xd.full_tensor()?;
        let diff = max_abs_diff(&back, &x)?;
        assert_eq!(diff, 0.0, "2-D shard round trip");
    }
    Ok(())
}

fn bench(c: &Comm) -> R<()> {
    let n = c.size() as f64;
    let mut rows = Vec::new();
    for &(op, bytes) in &[
        ("all_reduce", 4usize),
        ("all_reduce", 64 << 10),
        ("all_reduce", 1 << 20),
        ("all_reduce", 16 << 20),
        ("all_reduce", 64 << 20),
        ("all_gather", 16 << 10),
        ("all_gather", 256 << 10),
        ("all_gather", 4 << 20),
        ("all_gather", 16 << 20),
    ] {
        let elems = (bytes / 4).max(1);
        let x = Tensor::ones(elems, DType::F32, &Device::Cpu)?;
        let out = if op == "all_reduce" {
            x.clone()
        } else {
            Tensor::zeros(elems * c.size(), DType::F32, &Device::Cpu)?
        };
        let run = || -> R<()> {
            if op == "all_reduce" {
                c.all_reduce_into(&out, &out, ReduceOp::Sum)?.wait()?;
            } else {
                c.all_gather_single_into(&out, &x)?.wait()?;
            }
            Ok(())
        };
        run()?; // warm up (connections, pages)
        let iters = if bytes <= 64 << 10 {
            200
        } else if bytes <= 1 << 20 {
            40
        } else {
            5
        };
        c.barrier()?.wait()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            run()?;
        }
        let dt = t0.elapsed().as_secs_f64() / iters as f64;
        // nccl-tests' S: the all_reduce buffer, the all_gather output.
        let s_bytes = if op == "all_reduce" {
            elems * 4
        } else {
            elems * 4 * c.size()
        };
        let factor = if op == "all_reduce" {
            2.0 * (n - 1.0) / n
        } else {
            (n - 1.0) / n
        };
        let algbw = s_bytes as f64 / dt / 1e9;
        rows.push(format!(
            "{op:>10} S={s_bytes:>10} B  {:>9.1} us  algbw {algbw:>7.3} GB/s  busbw {:>7.3} GB/s",
            dt * 1e6,
            algbw * factor
        ));
    }
    if c.rank() == 0 {
        println!("process backend, {} ranks on loopback:", c.size());
        for r in rows {
            println!("{r}");
        }
    }
    Ok(())
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("mp_allreduce: error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> R<()> {
    let options = CommOptions::default()
        .with_timeout(Duration::from_secs(args.timeout))
        .with_bootstrap_timeout(Duration::from_secs(args.timeout));
    let t0 = Instant::now();
    let world = new_comm("process", &Device::Cpu, "world", options)?;
    let boot = t0.elapsed();
    check_collectives(&world)?;
    let n = world.size();
    let dims: Vec<(&str, usize)> = if n >= 4 && n % 2 == 0 {
        vec![("dp", n / 2), ("tp", 2)]
    } else {
        vec![("tp", n)]
    };
    let mesh = DeviceMesh::new(world.clone(), &dims)?;
    check_dtensor(&mesh)?;
    if args.bench {
        bench(&world)?;
    }
    world.barrier()?.wait()?;
    if world.rank() == 0 {
        println!(
            "mp_allreduce: {n} ranks, mesh {dims:?}: collectives and DTensor matmuls match one device (bootstrap {:.1} ms)",
            boot.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
