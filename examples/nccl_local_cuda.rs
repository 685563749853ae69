//! The local backend on CUDA tensors: N ranks as threads sharing the GPUs, collectives and
//! DTensor ops against single-device results (feature `cuda`).
//!
//! ```text
//! cargo build --release --features cuda --example nccl_local_cuda
//! target/release/examples/nccl_local_cuda --ranks 4          # 4 ranks on however many GPUs
//! ```
//!
//! Rank r uses GPU r modulo the GPU count (`--gpus` caps it). Each rank creates a CUDA
//! communicator with `new_comm("local", &Device::Cuda(..), ..)` and checks: `all_reduce`
//! (sum/avg/max, f32/bf16/i64, in place), `all_gather_single`, `reduce_scatter_single`,
//! `all_to_all_single`, `all_to_all_v_single`, `broadcast`, `reduce`, `gather`, `scatter`,
//! `batch_p2p`, `split`, then DTensor column- and row-parallel matmuls on a `DeviceMesh`, a
//! shard round trip and `redistribute_async` (its helper thread's stream ordered both ways),
//! all against the same computation on one device. Prints PASS/FAIL per case
//! and area (`comm`, `dtensor`); `--json` adds a summary line. Exits non-zero when a `comm`
//! case fails (and, with `--strict`, when a `dtensor` case does).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::Mutex;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::{new_comm, Comm, CommOptions, LocalWorld, P2POp, ReduceOp};
use candle_dtensor::dtensor::{distribute_tensor, Placement};
use candle_dtensor::kernels::compare::max_abs_diff;
use candle_dtensor::mesh::DeviceMesh;
use clap::Parser;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
struct Args {
    /// Ranks (threads).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Use at most this many GPUs (default: all).
    #[arg(long)]
    gpus: Option<usize>,
    /// Op timeout in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Fail on DTensor cases too.
    #[arg(long)]
    strict: bool,
    /// Print one JSON summary line.
    #[arg(long)]
    json: bool,
}

fn vals(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((r * 5 + i * 3) % 13) as f32 - 4.0)
        .collect()
}

/// `t` flattened, on the host, in f32 (the i64 and bf16 cases compare as f32).
fn host(t: &Tensor) -> R<Tensor> {
    Ok(t.flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?)
}

/// `max |got - want|` over the flattened tensors (the kernels' `max_abs_diff`: NaN when either
/// has a NaN, infinite when either has an infinity; an error when the lengths differ).
fn max_diff(got: &Tensor, want: &Tensor) -> R<f64> {
    Ok(max_abs_diff(&host(got)?, &host(want)?)?)
}

/// Fails unless `got` is within `tol` of `want` everywhere; a NaN difference fails (`d > tol`
/// alone would be false for it).
fn expect(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> R<()> {
    let d = max_diff(got, want).map_err(|e| format!("{what}: {e}"))?;
    if d.is_nan() || d > tol {
        return Err(format!("{what}: differs from one device by {d} (tolerance {tol})").into());
    }
    Ok(())
}

type Log = Mutex<Vec<(usize, &'static str, String, Result<(), String>)>>;

fn case(log: &Log, rank: usize, area: &'static str, name: &str, f: impl FnOnce() -> R<()>) {
    let r = f().map_err(|e| e.to_string());
    log.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((rank, area, name.to_string(), r));
}

fn comm_cases(c: &Comm, dev: &Device, log: &Log) {
    let (n, me) = (c.size(), c.rank());
    let cpu = Device::Cpu;
    let all = |len: usize| -> R<Vec<Tensor>> {
        (0..n)
            .map(|r| Ok(Tensor::new(vals(r, len), &cpu)?))
            .collect()
    };
    let mine = |len: usize| -> R<Tensor> { Ok(Tensor::new(vals(me, len), dev)?) };
    case(log, me, "comm", "all_reduce sum f32", || {
        let y = c.all_reduce(&mine(1000)?, ReduceOp::Sum)?.wait()?;
        let want = all(1000)?
            .iter()
            .try_fold(Tensor::zeros(1000, DType::F32, &cpu)?, |a, t| a.add(t))?;
        expect("all_reduce", &y, &want, 1e-5)
    });
    case(log, me, "comm", "all_reduce avg bf16", || {
        let x = mine(64)?.to_dtype(DType::BF16)?;
        let y = c.all_reduce(&x, ReduceOp::Avg)?.wait()?;
        let sum = all(64)?
            .iter()
            .try_fold(Tensor::zeros(64, DType::F32, &cpu)?, |a, t| a.add(t))?;
        let want = (sum / n as f64)?;
        expect("all_reduce avg", &y, &want, 5e-2)
    });
    case(log, me, "comm", "all_reduce max i64 in place", || {
        let x = mine(9)?.to_dtype(DType::I64)?;
        c.all_reduce_into(&x, &x, ReduceOp::Max)?.wait()?;
        let want = all(9)?
            .iter()
            .skip(1)
            .try_fold(all(9)?[0].clone(), |a, t| a.maximum(t))?;
        expect("all_reduce max", &x, &want.to_dtype(DType::I64)?, 0.0)
    });
    case(
        log,
        me,
        "comm",
        "all_reduce sum of a scalar in place",
        || {
            // A 0-d tensor (a loss): `slice_set` cannot index it (the first GPU run's FSDP failure).
            let x = Tensor::new(me as f32 + 1.5, dev)?;
            c.all_reduce_into(&x, &x, ReduceOp::Sum)?.wait()?;
            let want: f32 = (0..n).map(|r| r as f32 + 1.5).sum();
            expect("all_reduce scalar", &x, &Tensor::new(want, &cpu)?, 1e-6)
        },
    );
    case(log, me, "comm", "all_gather_single", || {
        let y = c.all_gather_single(&mine(6)?.reshape((2, 3))?)?.wait()?;
        let want = Tensor::cat(&all(6)?, 0)?;
        expect("all_gather", &y, &want, 0.0)
    });
    case(log, me, "comm", "reduce_scatter_single", || {
        let len = 4 * n;
        let y = c
            .reduce_scatter_single(&mine(len)?, ReduceOp::Sum)?
            .wait()?;
        let sum = all(len)?
            .iter()
            .try_fold(Tensor::zeros(len, DType::F32, &cpu)?, |a, t| a.add(t))?;
        expect("reduce_scatter", &y, &sum.narrow(0, 4 * me, 4)?, 1e-5)
    });
    case(log, me, "comm", "all_to_all_single", || {
        let y = c.all_to_all_single(&mine(2 * n)?)?.wait()?;
        let want = Tensor::cat(
            &all(2 * n)?
                .iter()
                .map(|t| t.narrow(0, 2 * me, 2))
                .collect::<candle_core::Result<Vec<_>>>()?,
            0,
        )?;
        expect("all_to_all", &y, &want, 0.0)
    });
    case(log, me, "comm", "all_to_all_v_single", || {
        let rows = |i: usize, j: usize| (i + 2 * j) % 3;
        let ins: Vec<usize> = (0..n).map(|j| rows(me, j)).collect();
        let outs: Vec<usize> = (0..n).map(|i| rows(i, me)).collect();
        let tot: usize = ins.iter().sum();
        let x = Tensor::new(vals(me, tot * 2), dev)?.reshape((tot, 2))?;
        let y = c.all_to_all_v_single(&x, &outs, &ins)?.wait()?;
        let mut want = Vec::new();
        for i in 0..n {
            let ti: usize = (0..n).map(|j| rows(i, j)).sum();
            let start: usize = (0..me).map(|j| rows(i, j)).sum();
            want.extend_from_slice(&vals(i, ti * 2)[start * 2..(start + rows(i, me)) * 2]);
        }
        expect("all_to_all_v", &y, &Tensor::new(want, &cpu)?, 0.0)
    });
    case(
        log,
        me,
        "comm",
        "broadcast / reduce / gather / scatter",
        || {
            let b = c.broadcast(&mine(5)?, n - 1)?.wait()?;
            expect("broadcast", &b, &Tensor::new(vals(n - 1, 5), &cpu)?, 0.0)?;
            let r = c.reduce(&mine(5)?, 0, ReduceOp::Min)?.wait()?;
            if me == 0 {
                let want = all(5)?
                    .iter()
                    .skip(1)
                    .try_fold(all(5)?[0].clone(), |a, t| a.minimum(t))?;
                expect("reduce", &r.ok_or("root got nothing")?, &want, 0.0)?;
            }
            let g = c.gather(&mine(me + 1)?, 0)?.wait()?;
            if let Some(pieces) = g {
                for (r, p) in pieces.iter().enumerate() {
                    expect("gather", p, &Tensor::new(vals(r, r + 1), &cpu)?, 0.0)?;
                }
            }
            let ins = if me == 0 {
                (0..n)
                    .map(|r| Ok(Tensor::new(vals(r, 3), dev)?))
                    .collect::<R<Vec<_>>>()?
            } else {
                Vec::new()
            };
            let s = c.scatter(&ins, 0)?.wait()?;
            expect("scatter", &s, &Tensor::new(vals(me, 3), &cpu)?, 0.0)
        },
    );
    case(log, me, "comm", "batch_p2p ring", || {
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let got = c
            .batch_p2p(vec![
                P2POp::Send {
                    tensor: mine(4)?,
                    peer: next,
                },
                P2POp::Recv {
                    peer: prev,
                    shape: 4.into(),
                    dtype: DType::F32,
                },
            ])?
            .wait()?;
        expect("p2p", &got[0], &Tensor::new(vals(prev, 4), &cpu)?, 0.0)
    });
    case(log, me, "comm", "split + all_reduce", || {
        let group: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
        let child = c.split(&group, "parity")?.ok_or("no child")?;
        let y = child
            .all_reduce(&Tensor::new(&[me as f32], dev)?, ReduceOp::Sum)?
            .wait()?;
        let want = group.iter().sum::<usize>() as f32;
        expect("split", &y, &Tensor::new(&[want], &cpu)?, 0.0)
    });
}

/// The cross-stream ordering of the local CUDA path (`CDT_LOCAL_CUDA_ORDER`): inputs whose
/// producing kernels are still queued when the op is issued, an input overwritten the moment
/// the wait returns, and works dropped unwaited while their kernels may still run, each on
/// 16 MiB per rank so the kernels take long enough for a missing order to show.
fn ordering_cases(c: &Comm, dev: &Device, log: &Log) {
    let (n, me) = (c.size(), c.rank());
    let len = 1 << 22;
    let cpu = Device::Cpu;
    let sum_of = |len: usize| -> R<Tensor> {
        let mut acc = vec![0f32; len];
        for r in 0..n {
            for (a, v) in acc.iter_mut().zip(vals(r, len)) {
                *a += v;
            }
        }
        Ok(Tensor::new(acc, &cpu)?)
    };
    // `vals` times 2 then halved, 20 times: exact, and 40 kernels still queued at the issue.
    let produced = |r: usize| -> R<Tensor> {
        let mut x = Tensor::new(vals(r, len), dev)?;
        for _ in 0..20 {
            x = ((x * 2.0)? * 0.5)?;
        }
        Ok(x)
    };
    case(
        log,
        me,
        "comm",
        "ordering: inputs still being produced",
        || {
            let y = c.all_reduce(&produced(me)?, ReduceOp::Sum)?.wait()?;
            expect(
                "all_reduce of just-produced inputs",
                &y,
                &sum_of(len)?,
                1e-4,
            )?;
            let y = c
                .reduce_scatter_single(&produced(me)?, ReduceOp::Sum)?
                .wait()?;
            let chunk = len / n;
            expect(
                "reduce_scatter of just-produced inputs",
                &y,
                &sum_of(len)?.narrow(0, me * chunk, chunk)?,
                1e-4,
            )
        },
    );
    case(
        log,
        me,
        "comm",
        "ordering: input overwritten after the wait",
        || {
            let want = sum_of(len)?;
            for _ in 0..3 {
                let x = produced(me)?;
                let y = c.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                // Peers must have read x before this write lands.
                x.slice_set(&Tensor::zeros(len, DType::F32, dev)?, 0, 0)?;
                expect("all_reduce, then its input zeroed", &y, &want, 1e-4)?;
            }
            // In place: the output aliases the input and is written after every read.
            let x = produced(me)?;
            c.all_reduce_into(&x, &x, ReduceOp::Sum)?.wait()?;
            expect("all_reduce_into in place", &x, &want, 1e-4)
        },
    );
    case(
        log,
        me,
        "comm",
        "ordering: works dropped without waiting",
        || {
            for _ in 0..4 {
                // Results and inputs released while their kernels may run; their memory must not
                // be reused under them.
                drop(c.all_reduce(&produced(me)?, ReduceOp::Sum)?);
                drop(c.all_gather_single(&produced(me)?.narrow(0, 0, 1 << 16)?)?);
            }
            let ones = Tensor::ones(len, DType::F32, dev)?;
            let y = c.all_reduce(&ones, ReduceOp::Sum)?.wait()?;
            expect(
                "all_reduce after dropped works",
                &y,
                &Tensor::full(n as f32, len, &cpu)?,
                0.0,
            )
        },
    );
}

fn dtensor_cases(c: &Comm, dev: &Device, log: &Log) {
    let me = c.rank();
    let x = Tensor::arange(0f32, 48., &Device::Cpu)
        .and_then(|t| t.reshape((6, 8)))
        .and_then(|t| t.affine(0.1, -1.0));
    let w = Tensor::arange(0f32, 80., &Device::Cpu)
        .and_then(|t| t.reshape((8, 10)))
        .and_then(|t| t.affine(0.05, 0.3));
    let (x, w) = match (x, w) {
        (Ok(x), Ok(w)) => (x, w),
        (Err(e), _) | (_, Err(e)) => {
            // Logged, so `--strict` fails on it instead of passing with no dtensor case run.
            case(log, me, "dtensor", "inputs", || Err(e.to_string().into()));
            return;
        }
    };
    let mesh = match DeviceMesh::new(c.clone(), &[("tp", c.size())]) {
        Ok(m) => m,
        Err(e) => {
            case(log, me, "dtensor", "DeviceMesh on CUDA", || {
                Err(e.to_string().into())
            });
            return;
        }
    };
    case(log, me, "dtensor", "column-parallel matmul", || {
        let (xg, wg) = (x.to_device(dev)?, w.to_device(dev)?);
        let want = xg.matmul(&wg)?;
        let xd = distribute_tensor(&xg, &mesh, &[Placement::Replicate])?;
        let wd = distribute_tensor(&wg, &mesh, &[Placement::Shard(1)])?;
        expect(
            "column-parallel",
            &xd.matmul(&wd)?.full_tensor()?,
            &want,
            1e-4,
        )
    });
    case(
        log,
        me,
        "dtensor",
        "row-parallel matmul (partial -> replicate)",
        || {
            let (xg, wg) = (x.to_device(dev)?, w.to_device(dev)?);
            let want = xg.matmul(&wg)?;
            let xr = distribute_tensor(&xg, &mesh, &[Placement::Shard(1)])?;
            let wr = distribute_tensor(&wg, &mesh, &[Placement::Shard(0)])?;
            let y = xr.matmul(&wr)?.redistribute(&[Placement::Replicate])?;
            expect("row-parallel", y.to_local(), &want, 1e-4)
        },
    );
    case(log, me, "dtensor", "shard round trip", || {
        let xg = x.to_device(dev)?;
        let xd = distribute_tensor(&xg, &mesh, &[Placement::Shard(0)])?;
        expect("round trip", &xd.full_tensor()?, &xg, 0.0)
    });
    case(
        log,
        me,
        "dtensor",
        "redistribute_async ordered after the caller's kernels and before its later ones",
        || {
            // The helper thread's work runs on its own stream. Its input comes from a chain of
            // large matmuls queued just before the call (tens of ms of GPU work), and the
            // result is read at once on this thread: an unordered helper would gather the
            // shards before they exist, or this thread would read the result before the
            // gather wrote it. Every element is exactly scale * 2^-12 (sums of powers of
            // two); a second scale makes a stale buffer from the first round show.
            let n = 4096;
            let a = Tensor::ones((n, n), DType::F32, dev)?.affine(1.0 / n as f64, 0.0)?;
            for scale in [1.0, 3.0] {
                let mut x = a.clone();
                for _ in 0..8 {
                    x = x.matmul(&a)?;
                }
                let xd = distribute_tensor(&x.affine(scale, 0.0)?, &mesh, &[Placement::Shard(0)])?;
                let y = xd.redistribute_async(&[Placement::Replicate]).wait()?;
                let got = y.to_local().affine(1.0, 0.0)?;
                let want = Tensor::full((scale / 4096.0) as f32, (n, n), dev)?;
                expect("redistribute_async", &got, &want, 0.0)?;
            }
            Ok(())
        },
    );
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
            eprintln!("nccl_local_cuda: error: {e}");
            std::process::exit(2);
        }
    }
}

fn run(args: &Args) -> R<bool> {
    let found = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map_err(|e| format!("no CUDA device: {e}"))? as usize;
    let gpus = args.gpus.unwrap_or(found).clamp(1, found.max(1));
    let log: Log = Mutex::new(Vec::new());
    let t = Duration::from_secs(args.timeout);
    LocalWorld::new(args.ranks)
        .with_timeout(t)
        .with_bootstrap_timeout(t)
        .launch(|world| -> R<()> {
            let dev = Device::new_cuda(world.rank() % gpus)?;
            let options = CommOptions::default()
                .with_timeout(t)
                .with_bootstrap_timeout(t);
            let c = new_comm("local", &dev, "cuda", options)?;
            comm_cases(&c, &dev, &log);
            ordering_cases(&c, &dev, &log);
            dtensor_cases(&c, &dev, &log);
            Ok(())
        })?;
    let log = log.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut fatal = false;
    for area in ["comm", "dtensor"] {
        let mut names: Vec<&String> = log.iter().filter(|l| l.1 == area).map(|l| &l.2).collect();
        names.sort();
        names.dedup();
        for name in names {
            let fails: Vec<String> = log
                .iter()
                .filter(|l| l.1 == area && &l.2 == name)
                .filter_map(|l| l.3.as_ref().err().map(|e| format!("rank {}: {e}", l.0)))
                .collect();
            if fails.is_empty() {
                println!("PASS {area}: {name}");
            } else {
                println!("FAIL {area}: {name}: {}", fails[0]);
                fatal |= area == "comm" || args.strict;
            }
        }
    }
    let failed = log.iter().filter(|l| l.3.is_err()).count();
    println!(
        "nccl_local_cuda: {} ranks on {gpus} GPU(s): {} rank-cases passed, {failed} failed",
        args.ranks,
        log.len() - failed
    );
    if args.json {
        let dt_fail = log
            .iter()
            .filter(|l| l.1 == "dtensor" && l.3.is_err())
            .count();
        let v = serde_json::json!({
            "check": "nccl_local_cuda",
            "ranks": args.ranks,
            "gpus": gpus,
            "comm_failed": failed - dt_fail,
            "dtensor_failed": dt_fail,
        });
        println!("{v}");
    }
    Ok(!fatal)
}
