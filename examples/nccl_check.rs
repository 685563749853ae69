//! Every collective of the `nccl` backend against values computed on the host (feature `nccl`,
//! needs a GPU per rank).
//!
//! ```text
//! cargo build --release --features nccl --example nccl_check && cargo build --release -p dtrun
//! target/release/examples/nccl_check                          # a world of one, no launcher
//! target/release/dtrun --nproc 2 -- target/release/examples/nccl_check   # one GPU per rank
//! ```
//!
//! Without a launcher environment (`RANK` unset) it runs a world of one through
//! `nccl::connect`; under `dtrun` / torchrun every rank uses GPU `LOCAL_RANK` (or `RANK`) modulo
//! the GPU count and calls `new_comm("nccl", ..)`. Checked: `all_reduce` (every op, dtypes
//! f32/f64/bf16/f16/i64/u32/u8, 0/1/odd/1M elements, in place), `all_gather_single`,
//! `reduce_scatter_single`, `all_to_all_single`, `all_to_all_v_single`, `broadcast`, `reduce`,
//! `gather` (uneven shapes), `scatter`, `barrier`, `batch_p2p` (a ring), `split` and a
//! collective on the child, a `Work` reaching `Completed` after `wait()` returned, windows when
//! NCCL has them, and `abort` failing later work. Each rank prints one line per case and a
//! summary; `--json` adds one machine-readable line. The exit status is non-zero if a case
//! failed on this rank.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::env::LaunchEnv;
use candle_dtensor::comm::{
    nccl, new_comm, Comm, CommError, CommOptions, P2POp, ReduceOp, WorkStatus,
};
use candle_dtensor::kernels::compare::compare_series;
use clap::Parser;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
struct Args {
    /// Op and bootstrap timeout in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Print one JSON summary line.
    #[arg(long)]
    json: bool,
}

/// Host values of rank `r`'s input of length `len` (distinct per rank and element).
fn vals(r: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((r * 7 + i * 3) % 11) as f64 + 1.0)
        .collect()
}

fn tensor(v: &[f64], dt: DType, dev: &Device) -> R<Tensor> {
    Ok(Tensor::new(v, &Device::Cpu)?.to_dtype(dt)?.to_device(dev)?)
}

fn host(t: &Tensor) -> R<Vec<f64>> {
    Ok(t.flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?)
}

fn close(dt: DType, got: &[f64], want: &[f64]) -> Result<(), String> {
    // Lengths equal and every value finite: `(g - w).abs() > tol` is false for a NaN, which
    // passed.
    compare_series("result", got, want).map_err(|e| e.to_string())?;
    let tol = match dt {
        DType::BF16 => 2e-2,
        DType::F16 => 2e-3,
        DType::F32 => 1e-5,
        _ => 1e-12,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (g - w).abs() > tol * w.abs().max(1.0) {
            return Err(format!("element {i}: got {g}, want {w}"));
        }
    }
    Ok(())
}

fn reduce_host(op: ReduceOp, n: usize, len: usize, dt: DType) -> Vec<f64> {
    let round = |x: f64| match dt {
        DType::U8 => (x as u64 % 256) as f64,
        _ => x,
    };
    // Each rank's input once: indexing `vals(r, len)` per element made this quadratic (a 1M
    // element case spent minutes here, which read as an NCCL hang on the first GPU run).
    let inputs: Vec<Vec<f64>> = (0..n).map(|r| vals(r, len)).collect();
    (0..len)
        .map(|i| {
            let xs: Vec<f64> = inputs.iter().map(|v| v[i]).collect();
            round(match op {
                ReduceOp::Sum => xs.iter().sum(),
                ReduceOp::Avg => xs.iter().sum::<f64>() / n as f64,
                ReduceOp::Max => xs.iter().cloned().fold(f64::MIN, f64::max),
                ReduceOp::Min => xs.iter().cloned().fold(f64::MAX, f64::min),
                ReduceOp::Product => xs.iter().product(),
            })
        })
        .collect()
}

struct Cases {
    rank: usize,
    results: Vec<(String, Result<(), String>)>,
}

impl Cases {
    fn run(&mut self, name: &str, f: impl FnOnce() -> R<()>) {
        let t0 = Instant::now();
        let r = f().map_err(|e| e.to_string());
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match &r {
            Ok(()) => println!("[rank {}] PASS {name} ({ms:.1} ms)", self.rank),
            Err(e) => println!("[rank {}] FAIL {name}: {e}", self.rank),
        }
        self.results.push((name.to_string(), r));
    }
}

fn check(c: &Comm, cases: &mut Cases, dev: &Device) {
    let (n, me) = (c.size(), c.rank());
    for (dt, op, len) in [
        (DType::F32, ReduceOp::Sum, 1_000_003usize),
        (DType::F32, ReduceOp::Avg, 17),
        (DType::F64, ReduceOp::Min, 5),
        (DType::BF16, ReduceOp::Max, 4096),
        (DType::F16, ReduceOp::Sum, 33),
        (DType::I64, ReduceOp::Product, 9),
        (DType::U32, ReduceOp::Sum, 1),
        (DType::U8, ReduceOp::Sum, 300),
        (DType::F32, ReduceOp::Sum, 0),
    ] {
        cases.run(&format!("all_reduce {op} {dt:?} x{len}"), || {
            let x = tensor(&vals(me, len), dt, dev)?;
            let y = c.all_reduce(&x, op)?.wait()?;
            close(dt, &host(&y)?, &reduce_host(op, n, len, dt))?;
            Ok(())
        });
    }
    cases.run("all_reduce_into in place", || {
        let x = tensor(&vals(me, 64), DType::F32, dev)?;
        let y = c.all_reduce_into(&x, &x, ReduceOp::Sum)?.wait()?;
        close(
            DType::F32,
            &host(&y)?,
            &reduce_host(ReduceOp::Sum, n, 64, DType::F32),
        )?;
        close(
            DType::F32,
            &host(&x)?,
            &reduce_host(ReduceOp::Sum, n, 64, DType::F32),
        )?;
        Ok(())
    });
    cases.run("work completes after a stream-ordered wait", || {
        let x = tensor(&vals(me, 1 << 16), DType::F32, dev)?;
        let w = c.all_reduce(&x, ReduceOp::Sum)?;
        let state = w.state();
        let y = w.wait()?;
        let _ = host(&y)?; // synchronizes the caller's stream
        let t0 = Instant::now();
        while state.status() != WorkStatus::Completed {
            if t0.elapsed() > Duration::from_secs(5) {
                return Err(
                    format!("status still {} 5 s after the data arrived", state.status()).into(),
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    });
    cases.run("all_gather_single f16", || {
        let x = tensor(&vals(me, 6), DType::F16, dev)?.reshape((2, 3))?;
        let y = c.all_gather_single(&x)?.wait()?;
        if y.dims() != [2 * n, 3] {
            return Err(format!("shape {:?}", y.dims()).into());
        }
        let want: Vec<f64> = (0..n).flat_map(|r| vals(r, 6)).collect();
        close(DType::F16, &host(&y)?, &want)?;
        Ok(())
    });
    cases.run("reduce_scatter_single f32", || {
        let len = 4 * n;
        let x = tensor(&vals(me, len), DType::F32, dev)?;
        let y = c.reduce_scatter_single(&x, ReduceOp::Sum)?.wait()?;
        let all = reduce_host(ReduceOp::Sum, n, len, DType::F32);
        close(DType::F32, &host(&y)?, &all[me * 4..(me + 1) * 4])?;
        Ok(())
    });
    cases.run("all_to_all_single u32", || {
        let len = 3 * n;
        let x = tensor(&vals(me, len), DType::U32, dev)?;
        let y = c.all_to_all_single(&x)?.wait()?;
        let want: Vec<f64> = (0..n)
            .flat_map(|j| vals(j, len)[me * 3..(me + 1) * 3].to_vec())
            .collect();
        close(DType::U32, &host(&y)?, &want)?;
        Ok(())
    });
    cases.run("all_to_all_v_single", || {
        // Rank i sends (i + j) % 3 rows of 2 to rank j.
        let rows = |i: usize, j: usize| (i + j) % 3;
        let input_splits: Vec<usize> = (0..n).map(|j| rows(me, j)).collect();
        let output_splits: Vec<usize> = (0..n).map(|i| rows(i, me)).collect();
        let total_in: usize = input_splits.iter().sum();
        let x = tensor(&vals(me, total_in * 2), DType::F32, dev)?.reshape((total_in, 2))?;
        let y = c
            .all_to_all_v_single(&x, &output_splits, &input_splits)?
            .wait()?;
        let mut want = Vec::new();
        for i in 0..n {
            let start: usize = (0..me).map(|j| rows(i, j)).sum();
            want.extend_from_slice(
                &vals(i, 2 * (0..n).map(|j| rows(i, j)).sum::<usize>())
                    [start * 2..(start + rows(i, me)) * 2],
            );
        }
        close(DType::F32, &host(&y)?, &want)?;
        Ok(())
    });
    cases.run("broadcast f64 from the last rank", || {
        let x = tensor(&vals(me, 10), DType::F64, dev)?;
        let y = c.broadcast(&x, n - 1)?.wait()?;
        close(DType::F64, &host(&y)?, &vals(n - 1, 10))?;
        Ok(())
    });
    cases.run("reduce max to rank 0", || {
        let x = tensor(&vals(me, 12), DType::F32, dev)?;
        let y = c.reduce(&x, 0, ReduceOp::Max)?.wait()?;
        match (me, y) {
            (0, Some(y)) => close(
                DType::F32,
                &host(&y)?,
                &reduce_host(ReduceOp::Max, n, 12, DType::F32),
            )?,
            (0, None) => return Err("the root got nothing".into()),
            (_, Some(_)) => return Err("a non-root got a result".into()),
            (_, None) => {}
        }
        Ok(())
    });
    cases.run("gather uneven shapes to rank 0", || {
        let x = tensor(&vals(me, me + 1), DType::BF16, dev)?;
        let y = c.gather(&x, 0)?.wait()?;
        if let Some(pieces) = y {
            for (r, p) in pieces.iter().enumerate() {
                close(DType::BF16, &host(p)?, &vals(r, r + 1))?;
            }
        }
        Ok(())
    });
    cases.run("scatter from rank 0", || {
        let inputs: Vec<Tensor> = if me == 0 {
            (0..n)
                .map(|r| tensor(&vals(r, 5), DType::I64, dev))
                .collect::<R<_>>()?
        } else {
            Vec::new()
        };
        let y = c.scatter(&inputs, 0)?.wait()?;
        close(DType::I64, &host(&y)?, &vals(me, 5))?;
        Ok(())
    });
    cases.run("barrier", || Ok(c.barrier()?.wait()?));
    cases.run("batch_p2p ring", || {
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let x = tensor(&vals(me, 7), DType::F32, dev)?;
        let got = c
            .batch_p2p(vec![
                P2POp::Send {
                    tensor: x,
                    peer: next,
                },
                P2POp::Recv {
                    peer: prev,
                    shape: 7.into(),
                    dtype: DType::F32,
                },
            ])?
            .wait()?;
        close(DType::F32, &host(&got[0])?, &vals(prev, 7))?;
        Ok(())
    });
    cases.run("split by parity and all_reduce on the child", || {
        let group: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
        let child = c
            .split(&group, "parity")?
            .ok_or("a member got no communicator")?;
        if child.size() != group.len() || group[child.rank()] != me {
            return Err(format!("child rank {} of {}", child.rank(), child.size()).into());
        }
        let x = tensor(&[me as f64], DType::F32, dev)?;
        let y = child.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        close(
            DType::F32,
            &host(&y)?,
            &[group.iter().sum::<usize>() as f64],
        )?;
        let none = c.split(&[], "nobody")?;
        if none.is_some() {
            return Err("an empty list returned a communicator".into());
        }
        Ok(())
    });
    if c.capabilities().rma_put {
        cases.run("window put + signal to the next rank", || {
            let w = c.new_window(4096)?;
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            w.put(&tensor(&vals(me, 8), DType::F32, dev)?, next, 4)?;
            w.wait_signal(prev)?; // the put's own signal
            let got = w.get(me, 4, 8, DType::F32)?;
            close(DType::F32, &host(&got)?, &vals(prev, 8))?;
            match w.get(next, 0, 1, DType::F32) {
                Err(CommError::Unsupported { .. }) => {}
                other => return Err(format!("get from a peer: {other:?}").into()),
            }
            w.fence()?;
            Ok(())
        });
    } else {
        println!("[rank {me}] SKIP windows (NCCL < 2.29 or no symmetric memory)");
    }
    cases.run("abort fails later work", || {
        let all: Vec<usize> = (0..n).collect();
        let child = c.split(&all, "doomed")?.ok_or("no communicator")?;
        child.barrier()?.wait()?;
        child.abort("nccl_check");
        let x = tensor(&[1.0], DType::F32, dev)?;
        match child.all_reduce(&x, ReduceOp::Sum).and_then(|w| w.wait()) {
            Err(e) if e.is_fatal() => Ok(()),
            other => Err(format!("expected an abort error, got {other:?}").into()),
        }
    });
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("nccl_check: error: {e}");
            std::process::exit(2);
        }
    }
}

fn run(args: &Args) -> R<bool> {
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
    let t0 = Instant::now();
    let world = if launched {
        new_comm("nccl", &dev, "world", options)?
    } else {
        nccl::connect(&dev, 0, 1, None, "world", options)?
    };
    let boot_ms = t0.elapsed().as_secs_f64() * 1e3;
    let version = nccl::library_version()?;
    println!(
        "[rank {}] NCCL {version}, world of {} on GPU {} of {gpus}, bootstrap {boot_ms:.0} ms",
        world.rank(),
        world.size(),
        local % gpus.max(1)
    );
    let mut cases = Cases {
        rank: world.rank(),
        results: Vec::new(),
    };
    check(&world, &mut cases, &dev);
    let failed: Vec<&String> = cases
        .results
        .iter()
        .filter(|r| r.1.is_err())
        .map(|r| &r.0)
        .collect();
    let passed = cases.results.len() - failed.len();
    println!(
        "[rank {}] nccl_check: {passed} passed, {} failed{}",
        world.rank(),
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(": {failed:?}")
        }
    );
    if args.json {
        let v = serde_json::json!({
            "check": "nccl_check",
            "rank": world.rank(),
            "world": world.size(),
            "nccl": version.to_string(),
            "bootstrap_ms": boot_ms,
            "passed": passed,
            "failed": failed,
        });
        println!("{v}");
    }
    Ok(failed.is_empty())
}
