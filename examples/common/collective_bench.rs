//! Shared by the collective benchmarks (`comm_bench`, `mpi_bench`): buffer sizes, the ops
//! and their nccl-tests conventions (S, bus bandwidth factors).

use candle_core::Tensor;
use candle_dtensor::comm::{Comm, ReduceOp};

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
