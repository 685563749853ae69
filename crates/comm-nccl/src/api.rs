//! The seam between the backend and the NCCL library: [`NcclApi`], one method per raw call the
//! backend makes, with plain-Rust argument types.
//!
//! The real implementation (`driver.rs`, feature `nccl`) forwards to `cudarc::nccl::sys`; the mock
//! (`mock.rs`, tests only) records the calls and plays back scripted status codes, so bootstrap,
//! nonblocking polling, timeouts, abort and the call plans of every collective run without a GPU
//! (torchcomms' `NcclApi` / `NcclMock` split).
//!
//! Handles are addresses (`usize`, 0 = null) rather than raw pointers so that the types are
//! `Send` and comparable; only the real implementation turns them back into pointers.

use std::fmt;
use std::sync::atomic::AtomicUsize;

use super::config::RawConfig;

/// An `ncclResult_t`, kept as the raw number so a code from a newer library survives.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NcclCode(pub u32);

impl NcclCode {
    /// `ncclSuccess`.
    pub const SUCCESS: NcclCode = NcclCode(0);
    /// `ncclUnhandledCudaError`.
    pub const UNHANDLED_CUDA_ERROR: NcclCode = NcclCode(1);
    /// `ncclSystemError`.
    pub const SYSTEM_ERROR: NcclCode = NcclCode(2);
    /// `ncclInternalError`.
    pub const INTERNAL_ERROR: NcclCode = NcclCode(3);
    /// `ncclInvalidArgument`.
    pub const INVALID_ARGUMENT: NcclCode = NcclCode(4);
    /// `ncclInvalidUsage`.
    pub const INVALID_USAGE: NcclCode = NcclCode(5);
    /// `ncclRemoteError`: a peer failed (a lost process, a network error).
    pub const REMOTE_ERROR: NcclCode = NcclCode(6);
    /// `ncclInProgress`: a nonblocking call has not finished; poll `ncclCommGetAsyncError`.
    pub const IN_PROGRESS: NcclCode = NcclCode(7);
    /// `ncclTimeout` (NCCL 2.30).
    pub const TIMEOUT: NcclCode = NcclCode(8);
    /// Not an NCCL code: the function does not exist in the loaded library (too old).
    pub const UNAVAILABLE: NcclCode = NcclCode(u32::MAX);

    /// Whether the call succeeded.
    pub fn is_success(self) -> bool {
        self == NcclCode::SUCCESS
    }

    /// The `ncclResult_t` name (`ncclRemoteError`, ...).
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            8 => "ncclTimeout",
            u32::MAX => "unavailable in this NCCL",
            _ => "unknown ncclResult_t",
        }
    }
}

impl fmt::Debug for NcclCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Display for NcclCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// An `ncclComm_t` as an address (0 = null).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawComm(pub usize);

impl RawComm {
    /// Whether this is the null communicator.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// A `cudaStream_t` as an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawStream(pub usize);

/// An `ncclWindow_t` as an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawWindow(pub usize);

/// A device address.
pub type DevPtr = u64;

/// `ncclUniqueId`: 128 opaque bytes, created by rank 0 and handed to every rank.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({:02x?}..)", &self.0[..8])
    }
}

/// The `ncclDataType_t` values of the dtypes collectives take (the numbers are NCCL's; candle
/// has no i8, i32 or u64 tensors to move).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DataType {
    /// `ncclUint8`.
    Uint8 = 1,
    /// `ncclUint32`.
    Uint32 = 3,
    /// `ncclInt64`.
    Int64 = 4,
    /// `ncclFloat16`.
    Float16 = 6,
    /// `ncclFloat32`.
    Float32 = 7,
    /// `ncclFloat64`.
    Float64 = 8,
    /// `ncclBfloat16` (NCCL >= 2.10).
    Bfloat16 = 9,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Uint8 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Float64 => 8,
        }
    }
}

/// `ncclRedOp_t` values (the numbers are NCCL's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum RedOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclProd`.
    Prod = 1,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
    /// `ncclAvg` (NCCL >= 2.10, floating-point types).
    Avg = 4,
}

/// NCCL functions newer than the oldest supported library; [`NcclApi::has`] says whether the
/// loaded one exports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Optional {
    /// `ncclAlltoAll` (2.28.3).
    AllToAll,
    /// `ncclGather` (2.28.3).
    Gather,
    /// `ncclScatter` (2.28.3).
    Scatter,
    /// `ncclCommRevoke` (2.28.7).
    Revoke,
    /// `ncclCommShrink` (2.27.3).
    Shrink,
    /// `ncclCommWindowRegister` / `ncclCommWindowDeregister` (2.27).
    Window,
    /// `ncclPutSignal` (2.29).
    PutSignal,
    /// `ncclSignal` (2.29).
    Signal,
    /// `ncclWaitSignal` (2.29).
    WaitSignal,
}

impl Optional {
    /// The C symbol the real implementation looks up.
    pub fn symbol(self) -> &'static str {
        match self {
            Optional::AllToAll => "ncclAlltoAll",
            Optional::Gather => "ncclGather",
            Optional::Scatter => "ncclScatter",
            Optional::Revoke => "ncclCommRevoke",
            Optional::Shrink => "ncclCommShrink",
            Optional::Window => "ncclCommWindowRegister",
            Optional::PutSignal => "ncclPutSignal",
            Optional::Signal => "ncclSignal",
            Optional::WaitSignal => "ncclWaitSignal",
        }
    }
}

/// `NCCL_SHRINK_DEFAULT`: the parent is healthy and has no operation in flight (`nccl.h`).
pub const SHRINK_DEFAULT: i32 = 0x00;
/// `NCCL_SHRINK_ABORT`: the parent had an error; NCCL aborts its in-flight work first.
pub const SHRINK_ABORT: i32 = 0x01;

/// One enqueuing NCCL call (a collective, a point-to-point op or an RMA op). Counts are in
/// elements of `dt`; addresses are device addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `ncclAllReduce`.
    AllReduce {
        /// Input.
        send: DevPtr,
        /// Output (may equal `send`).
        recv: DevPtr,
        /// Elements.
        count: usize,
        /// Element type.
        dt: DataType,
        /// Reduction.
        op: RedOp,
    },
    /// `ncclAllGather`.
    AllGather {
        /// Input (`count` elements).
        send: DevPtr,
        /// Output (`count * nranks` elements).
        recv: DevPtr,
        /// Elements per rank.
        count: usize,
        /// Element type.
        dt: DataType,
    },
    /// `ncclReduceScatter`.
    ReduceScatter {
        /// Input (`count * nranks` elements).
        send: DevPtr,
        /// Output (`count` elements).
        recv: DevPtr,
        /// Elements per rank.
        count: usize,
        /// Element type.
        dt: DataType,
        /// Reduction.
        op: RedOp,
    },
    /// `ncclBroadcast`.
    Broadcast {
        /// Input (read on `root` only).
        send: DevPtr,
        /// Output.
        recv: DevPtr,
        /// Elements.
        count: usize,
        /// Element type.
        dt: DataType,
        /// The root rank.
        root: i32,
    },
    /// `ncclReduce`.
    Reduce {
        /// Input.
        send: DevPtr,
        /// Output (written on `root` only).
        recv: DevPtr,
        /// Elements.
        count: usize,
        /// Element type.
        dt: DataType,
        /// Reduction.
        op: RedOp,
        /// The root rank.
        root: i32,
    },
    /// `ncclSend`.
    Send {
        /// Data.
        buf: DevPtr,
        /// Elements.
        count: usize,
        /// Element type.
        dt: DataType,
        /// Destination rank.
        peer: i32,
    },
    /// `ncclRecv`.
    Recv {
        /// Destination buffer.
        buf: DevPtr,
        /// Elements.
        count: usize,
        /// Element type.
        dt: DataType,
        /// Source rank.
        peer: i32,
    },
    /// `ncclAlltoAll` (2.28.3).
    AllToAll {
        /// Input (`count * nranks` elements).
        send: DevPtr,
        /// Output (`count * nranks` elements).
        recv: DevPtr,
        /// Elements per peer.
        count: usize,
        /// Element type.
        dt: DataType,
    },
    /// `ncclGather` (2.28.3).
    Gather {
        /// Input (`count` elements).
        send: DevPtr,
        /// Output (`count * nranks` elements, root only).
        recv: DevPtr,
        /// Elements per rank.
        count: usize,
        /// Element type.
        dt: DataType,
        /// The root rank.
        root: i32,
    },
    /// `ncclScatter` (2.28.3).
    Scatter {
        /// Input (`count * nranks` elements, root only).
        send: DevPtr,
        /// Output (`count` elements).
        recv: DevPtr,
        /// Elements per rank.
        count: usize,
        /// Element type.
        dt: DataType,
        /// The root rank.
        root: i32,
    },
    /// `ncclPutSignal` (2.29): writes `count` elements into `peer`'s window at byte
    /// `offset` and signals it (signal index 0, context 0).
    PutSignal {
        /// Local data.
        buf: DevPtr,
        /// Elements.
        count: usize,
        /// Element type.
        dt: DataType,
        /// Target rank.
        peer: i32,
        /// The window.
        win: RawWindow,
        /// Byte offset in the peer's window.
        offset: usize,
    },
    /// `ncclSignal` (2.29) to `peer` (signal index 0, context 0).
    Signal {
        /// Target rank.
        peer: i32,
    },
    /// `ncclWaitSignal` (2.29): waits for `count` more signals from `peer`.
    WaitSignal {
        /// Source rank.
        peer: i32,
        /// How many signals.
        count: i32,
    },
}

impl Call {
    /// `ncclSend` of `count` elements of `dt` at `buf` to rank `peer`.
    pub fn send(buf: DevPtr, count: usize, dt: DataType, peer: usize) -> Call {
        let peer = peer as i32;
        Call::Send {
            buf,
            count,
            dt,
            peer,
        }
    }

    /// `ncclRecv` of `count` elements of `dt` into `buf` from rank `peer`.
    pub fn recv(buf: DevPtr, count: usize, dt: DataType, peer: usize) -> Call {
        let peer = peer as i32;
        Call::Recv {
            buf,
            count,
            dt,
            peer,
        }
    }

    /// The optional NCCL function this call needs, if any.
    pub fn requires(&self) -> Option<Optional> {
        match self {
            Call::AllToAll { .. } => Some(Optional::AllToAll),
            Call::Gather { .. } => Some(Optional::Gather),
            Call::Scatter { .. } => Some(Optional::Scatter),
            Call::PutSignal { .. } => Some(Optional::PutSignal),
            Call::Signal { .. } => Some(Optional::Signal),
            Call::WaitSignal { .. } => Some(Optional::WaitSignal),
            _ => None,
        }
    }

    /// The NCCL function name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Call::AllReduce { .. } => "ncclAllReduce",
            Call::AllGather { .. } => "ncclAllGather",
            Call::ReduceScatter { .. } => "ncclReduceScatter",
            Call::Broadcast { .. } => "ncclBroadcast",
            Call::Reduce { .. } => "ncclReduce",
            Call::Send { .. } => "ncclSend",
            Call::Recv { .. } => "ncclRecv",
            Call::AllToAll { .. } => "ncclAlltoAll",
            Call::Gather { .. } => "ncclGather",
            Call::Scatter { .. } => "ncclScatter",
            Call::PutSignal { .. } => "ncclPutSignal",
            Call::Signal { .. } => "ncclSignal",
            Call::WaitSignal { .. } => "ncclWaitSignal",
        }
    }
}

/// The raw NCCL calls the backend makes; see the module docs.
///
/// Thread safety (the contract every caller keeps, documented on `Core`): all calls on one
/// communicator are made under that communicator's issue lock, except `abort`/`revoke`, which
/// run at most once per communicator.
pub trait NcclApi: Send + Sync + 'static {
    /// `ncclGetVersion`.
    fn version(&self) -> Result<i32, NcclCode>;
    /// Whether the loaded library exports `f`.
    fn has(&self, f: Optional) -> bool;
    /// `ncclGetUniqueId`.
    fn unique_id(&self) -> Result<UniqueId, NcclCode>;
    /// `ncclCommInitRankConfig`, writing the new handle into `out` (a nonblocking
    /// communicator may fill it in after the call returns `ncclInProgress`).
    fn init_rank(
        &self,
        out: &AtomicUsize,
        nranks: i32,
        id: &UniqueId,
        rank: i32,
        config: &RawConfig,
    ) -> NcclCode;
    /// `ncclCommSplit`, writing the child handle into `out` (possibly later, see `init_rank`;
    /// it stays null for `NCCL_SPLIT_NOCOLOR`).
    fn split(
        &self,
        comm: RawComm,
        color: i32,
        key: i32,
        out: &AtomicUsize,
        config: &RawConfig,
    ) -> NcclCode;
    /// `ncclCommShrink(comm, excluded, n, out, config, flags)`, writing the child handle into
    /// `out` (possibly later, see `init_rank`); [`NcclCode::UNAVAILABLE`] when absent.
    fn shrink(
        &self,
        comm: RawComm,
        excluded: &[i32],
        out: &AtomicUsize,
        config: &RawConfig,
        flags: i32,
    ) -> NcclCode;
    /// `ncclCommGetAsyncError`: the communicator's state (`ncclInProgress` while a nonblocking
    /// call runs); a failure of the query itself is returned as the state.
    fn async_error(&self, comm: RawComm) -> NcclCode;
    /// `ncclCommAbort`.
    fn abort(&self, comm: RawComm) -> NcclCode;
    /// `ncclCommFinalize`.
    fn finalize(&self, comm: RawComm) -> NcclCode;
    /// `ncclCommDestroy`.
    fn destroy(&self, comm: RawComm) -> NcclCode;
    /// `ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT)`; [`NcclCode::UNAVAILABLE`] when absent.
    fn revoke(&self, comm: RawComm) -> NcclCode;
    /// `ncclCommCount`.
    fn count(&self, comm: RawComm) -> Result<i32, NcclCode>;
    /// `ncclCommUserRank`.
    fn user_rank(&self, comm: RawComm) -> Result<i32, NcclCode>;
    /// `ncclGetLastError` (empty when NCCL has nothing to say).
    fn last_error(&self, comm: RawComm) -> String;
    /// `ncclGroupStart`.
    fn group_start(&self) -> NcclCode;
    /// `ncclGroupEnd`.
    fn group_end(&self) -> NcclCode;
    /// Enqueues `call` on `stream`; [`NcclCode::UNAVAILABLE`] when the function is absent.
    fn enqueue(&self, call: &Call, comm: RawComm, stream: RawStream) -> NcclCode;
    /// `ncclMemAlloc` (VMM memory, as symmetric windows need).
    fn mem_alloc(&self, bytes: usize) -> Result<DevPtr, NcclCode>;
    /// `ncclMemFree`.
    fn mem_free(&self, ptr: DevPtr) -> NcclCode;
    /// `ncclCommWindowRegister(.., NCCL_WIN_COLL_SYMMETRIC)`, writing the window into `out`.
    fn window_register(
        &self,
        comm: RawComm,
        ptr: DevPtr,
        bytes: usize,
        out: &AtomicUsize,
    ) -> NcclCode;
    /// `ncclCommWindowDeregister`.
    fn window_deregister(&self, comm: RawComm, win: RawWindow) -> NcclCode;
}
