//! Shared by the collective benchmarks (`comm_bench`, `mpi_bench`): buffer sizes, the ops
//! and their nccl-tests conventions (S, bus bandwidth factors), and how an op is timed.

use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_dtensor::comm::{Comm, ReduceOp};

/// The flags both collective benchmarks take.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Buffer sizes S, comma separated (e.g. 4,1MiB,64MiB; suffixes B, KiB, MiB, GiB).
    #[arg(long, default_value = "4,64MiB")]
    pub size: String,
    /// Ops, comma separated: all_reduce, all_gather, reduce_scatter, all_to_all.
    #[arg(
        long,
        default_value = "all_reduce,all_gather,reduce_scatter,all_to_all"
    )]
    pub ops: String,
    /// Timed iterations for bandwidth sizes.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl BenchArgs {
    /// The buffer sizes of `--size` and the ops of `--ops`.
    pub fn sizes_and_ops(&self) -> Result<(Vec<usize>, Vec<Op>), String> {
        let sizes = self
            .size
            .split(',')
            .map(parse_size)
            .collect::<Result<_, _>>()?;
        let ops = self
            .ops
            .split(',')
            .map(Op::parse)
            .collect::<Result<_, _>>()?;
        Ok((sizes, ops))
    }
}

/// The f32 elements of a buffer of `bytes` on `n` ranks: at least one, and rounded down to a
/// multiple of `n` when there are that many, so every op divides them.
pub fn buffer_elems(bytes: usize, n: usize) -> usize {
    let elems = (bytes / 4).max(1);
    if elems >= n {
        elems / n * n
    } else {
        elems
    }
}

/// How a buffer size is timed: up to 64 KiB as back-to-back ops (latency), larger ones one op
/// at a time (bandwidth).
#[derive(Clone, Copy, Debug)]
pub enum Timing {
    /// Ten samples of `batch` back-to-back ops.
    Latency { batch: usize },
    /// `iters` samples of one op.
    Bandwidth { iters: usize },
}

impl Timing {
    /// The timing of a buffer of `elems` f32 elements (`batch` and `iters` at least 1).
    pub fn for_elems(elems: usize, batch: usize, iters: usize) -> Timing {
        if elems * 4 <= 64 * 1024 {
            Timing::Latency {
                batch: batch.max(1),
            }
        } else {
            Timing::Bandwidth {
                iters: iters.max(1),
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Timing::Latency { .. } => "latency",
            Timing::Bandwidth { .. } => "bandwidth",
        }
    }
}

/// Times `op` on `x` (into `out` when given) after two warm-up runs, every sample starting at a
/// barrier: the seconds per op of each sample, the slowest rank's (it decides).
pub fn time_op(
    comm: &Comm,
    op: Op,
    x: &Tensor,
    out: Option<&Tensor>,
    timing: Timing,
) -> candle_core::Result<Vec<f64>> {
    for _ in 0..2 {
        op.run(comm, x, out)?;
    }
    let (samples, batch) = match timing {
        Timing::Latency { batch } => (10, batch),
        Timing::Bandwidth { iters } => (iters, 1),
    };
    let mut times = Vec::new();
    for _ in 0..samples {
        comm.barrier()?.wait()?;
        let t0 = Instant::now();
        for _ in 0..batch {
            op.run(comm, x, out)?;
        }
        times.push(t0.elapsed().as_secs_f64() / batch as f64);
    }
    let t = Tensor::new(times.as_slice(), &Device::Cpu)?;
    comm.all_reduce(&t, ReduceOp::Max)?.wait()?.to_vec1::<f64>()
}

/// Parses a buffer size: a byte count with an optional `B`, `KiB`, `MiB` or `GiB` suffix.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("GiB") {
        (n, 1usize << 30)
    } else if let Some(n) = s.strip_suffix("MiB") {
        (n, 1 << 20)
    } else if let Some(n) = s.strip_suffix("KiB") {
        (n, 1 << 10)
    } else if let Some(n) = s.strip_suffix('B') {
        (n, 1)
    } else {
        (s, 1)
    };
    let n: usize = num
        .trim()
        .parse()
        .map_err(|_| format!("bad size {s:?} (use e.g. 4, 1MiB, 64MiB)"))?;
    Ok(n * mult)
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
}

impl Op {
    pub fn parse(s: &str) -> Result<Op, String> {
        Ok(match s.trim() {
            "all_reduce" => Op::AllReduce,
            "all_gather" => Op::AllGather,
            "reduce_scatter" => Op::ReduceScatter,
            "all_to_all" => Op::AllToAll,
            other => {
                return Err(format!(
                "unknown op {other:?}; ops are all_reduce, all_gather, reduce_scatter, all_to_all"
            ))
            }
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllToAll => "all_to_all",
        }
    }
    /// nccl-tests bus bandwidth factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }
    /// Elements of the per-rank input for a buffer of `elems` (nccl-tests S).
    pub fn input_elems(self, elems: usize, n: usize) -> usize {
        match self {
            Op::AllGather => elems / n,
            _ => elems,
        }
    }
    /// Elements of the per-rank output.
    pub fn output_elems(self, elems: usize, n: usize) -> usize {
        match self {
            Op::ReduceScatter => elems / n,
            _ => elems,
        }
    }
    /// Runs the op, into `out` when given (preallocated, as nccl-tests measure), else into a
    /// fresh tensor.
    pub fn run(self, comm: &Comm, x: &Tensor, out: Option<&Tensor>) -> candle_core::Result<Tensor> {
        Ok(match (self, out) {
            (Op::AllReduce, None) => comm.all_reduce(x, ReduceOp::Sum)?.wait()?,
            (Op::AllGather, None) => comm.all_gather_single(x)?.wait()?,
            (Op::ReduceScatter, None) => comm.reduce_scatter_single(x, ReduceOp::Sum)?.wait()?,
            (Op::AllToAll, None) => comm.all_to_all_single(x)?.wait()?,
            (Op::AllReduce, Some(o)) => comm.all_reduce_into(o, x, ReduceOp::Sum)?.wait()?,
            (Op::AllGather, Some(o)) => comm.all_gather_single_into(o, x)?.wait()?,
            (Op::ReduceScatter, Some(o)) => comm
                .reduce_scatter_single_into(o, x, ReduceOp::Sum)?
                .wait()?,
            (Op::AllToAll, Some(o)) => comm.all_to_all_single_into(o, x)?.wait()?,
        })
    }
}
