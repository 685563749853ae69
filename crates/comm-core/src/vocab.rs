//! Small value types shared by every backend: reduce ops, op names, op contexts, dtype support.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;

/// How a reducing collective combines the ranks' values (the sharding compiler's `Partial`
/// reductions are the same type). Half-precision inputs (`f16`, `bf16`) are accumulated in
/// `f32` and rounded once; `Avg` is defined for floating-point dtypes only ([`reduce_supported`]).
pub use candle_dtensor_types::ReduceOp;

/// Whether collectives define `op` on `dtype` (`Avg` on floating-point dtypes only).
pub fn reduce_supported(op: ReduceOp, dtype: DType) -> bool {
    !op.float_only() || dtype.is_float()
}

/// The name of a communicator operation, as torchcomms spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum OpName {
    AllReduce,
    AllGatherSingle,
    ReduceScatterSingle,
    AllToAllSingle,
    AllToAllVSingle,
    Broadcast,
    Reduce,
    Gather,
    Scatter,
    Barrier,
    Send,
    Recv,
    BatchP2p,
    Split,
    Shrink,
    Agree,
    NewComm,
    NewWindow,
    WindowPut,
    WindowGet,
    WindowSignal,
    WindowWaitSignal,
    WindowFence,
    Abort,
}

impl OpName {
    /// The snake_case name (`all_gather_single`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            OpName::AllReduce => "all_reduce",
            OpName::AllGatherSingle => "all_gather_single",
            OpName::ReduceScatterSingle => "reduce_scatter_single",
            OpName::AllToAllSingle => "all_to_all_single",
            OpName::AllToAllVSingle => "all_to_all_v_single",
            OpName::Broadcast => "broadcast",
            OpName::Reduce => "reduce",
            OpName::Gather => "gather",
            OpName::Scatter => "scatter",
            OpName::Barrier => "barrier",
            OpName::Send => "send",
            OpName::Recv => "recv",
            OpName::BatchP2p => "batch_p2p",
            OpName::Split => "split",
            OpName::Shrink => "shrink",
            OpName::Agree => "agree",
            OpName::NewComm => "new_comm",
            OpName::NewWindow => "new_window",
            OpName::WindowPut => "window_put",
            OpName::WindowGet => "window_get",
            OpName::WindowSignal => "window_signal",
            OpName::WindowWaitSignal => "window_wait_signal",
            OpName::WindowFence => "window_fence",
            OpName::Abort => "abort",
        }
    }

    /// Whether every rank of the communicator takes part (as opposed to point-to-point or
    /// one-sided operations).
    pub fn is_collective(self) -> bool {
        !matches!(
            self,
            OpName::Send
                | OpName::Recv
                | OpName::BatchP2p
                | OpName::WindowPut
                | OpName::WindowGet
                | OpName::WindowSignal
                | OpName::WindowWaitSignal
        )
    }
}

impl fmt::Display for OpName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where an operation runs: which op, on which communicator, as which rank, at which sequence
/// number. Every error of an operation carries one, so messages read
/// `all_reduce (comm "tp", rank 1, seq 41): ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpCtx {
    /// The operation.
    pub op: OpName,
    /// The communicator's name.
    pub comm: Arc<str>,
    /// The caller's rank in that communicator.
    pub rank: usize,
    /// The per-communicator sequence number of this operation (counts every op issued on the
    /// communicator by this rank, starting at 1).
    pub seq: u64,
    /// The timeout this operation runs under.
    pub timeout: Duration,
}

impl OpCtx {
    /// The context of creating communicator `name` (`new_comm`, seq 0) as `rank`, bounded by
    /// the bootstrap `timeout`.
    pub fn bootstrap(name: &str, rank: usize, timeout: Duration) -> OpCtx {
        OpCtx {
            op: OpName::NewComm,
            comm: Arc::from(name),
            rank,
            seq: 0,
            timeout,
        }
    }
}

impl fmt::Display for OpCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (comm \"{}\", rank {}, seq {})",
            self.op, self.comm, self.rank, self.seq
        )
    }
}

/// The dtypes collectives accept.
pub const SUPPORTED_DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::U32,
    DType::U8,
];

/// Whether collectives accept `dtype`.
pub fn dtype_supported(dtype: DType) -> bool {
    SUPPORTED_DTYPES.contains(&dtype)
}

/// One operation of a batched point-to-point group ([`crate::Comm::batch_p2p`]).
#[derive(Debug, Clone)]
pub enum P2POp {
    /// Send `tensor` to `peer`.
    Send {
        /// The data to send.
        tensor: candle_core::Tensor,
        /// The destination rank (communicator-relative).
        peer: usize,
    },
    /// Receive a tensor of `shape` and `dtype` from `peer`.
    Recv {
        /// The source rank (communicator-relative).
        peer: usize,
        /// The expected shape.
        shape: candle_core::Shape,
        /// The expected dtype.
        dtype: DType,
    },
}

impl P2POp {
    /// The peer rank of this operation.
    pub fn peer(&self) -> usize {
        match self {
            P2POp::Send { peer, .. } | P2POp::Recv { peer, .. } => *peer,
        }
    }
}
