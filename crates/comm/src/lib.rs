//! Communicators for candle-dtensor, shaped like torchcomms.
//!
//! # Overview
//!
//! - [`Comm`] is one rank's handle of a group of ranks: communicator-relative `rank()` /
//!   `size()`, collectives on candle [`Tensor`](candle_core::Tensor)s (`all_reduce`,
//!   `all_gather_single`, `reduce_scatter_single`, `all_to_all_single`, `all_to_all_v_single`,
//!   `broadcast`, `reduce`, `gather`, `scatter`, `barrier`), point-to-point `send` / `recv` /
//!   `batch_p2p`, `split`, and one-sided RMA [`Window`]s. No global state: everything hangs off
//!   the objects.
//! - Every operation returns a [`Work`] (status, `wait()` bounded by the timeout,
//!   `is_completed()`). Operations on one communicator run in issue order; different
//!   communicators progress independently (the basis of overlapping reduce-scatter with
//!   all-gather in FSDP).
//! - Reliability is built in: separate bootstrap and op timeouts, `Timeout` errors naming the
//!   missing ranks and the seq, non-blocking thread-safe `abort()`, desync detection, pre/post/
//!   abort hooks, a [`FlightRecorder`] dumped on failure, a `tracing` span per op.
//! - Backends implement [`Backend`] and register a [`BackendFactory`] by name
//!   ([`register_backend`], [`new_comm`]). The built-in `local` backend runs N ranks as threads
//!   of one process ([`LocalWorld`]).
//! - Multi-process runs: the built-in `process` backend runs each rank as its own process over
//!   TCP ([`process`]), started by the `dtrun` launcher; ranks find each other through a
//!   rendezvous [`store`] hosted by rank 0, reading rank and size from the launcher's
//!   environment ([`env`](mod@env)).
//! - GPUs: the `nccl` backend (cargo feature `nccl`) runs one rank per GPU on NCCL, with
//!   nonblocking init, stream-ordered [`Work`], a watchdog and split ([`nccl`]); with feature
//!   `cuda` the `local` backend also moves CUDA tensors (ranks as threads sharing GPUs).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_dtensor::comm::LocalWorld;
//!
//! let out = LocalWorld::run(2, |comm| {
//!     let x = Tensor::new(&[comm.rank() as f32], &Device::Cpu)?;
//!     let all = comm.all_gather_single(&x)?.wait()?;
//!     Ok::<_, candle_core::Error>(all.to_vec1::<f32>()?)
//! })?;
//! assert_eq!(out, vec![vec![0.0, 1.0], vec![0.0, 1.0]]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod agree;
pub mod auth;
mod backend;
mod comm;
#[cfg(feature = "conformance")]
pub mod conformance;
mod cpu;
mod desc;
pub mod env;
mod error;
mod flight;
mod hooks;
pub mod link;
pub mod local;
pub mod memory;
pub mod mpi;
pub mod nccl;
pub mod process;
pub mod store;
mod types;
mod window;
mod work;

pub use agree::Agreement;
pub use backend::{
    register_backend, registered_backends, Backend, BackendFactory, Capabilities, Collective,
    CollectiveOutput, CommOptions,
};
pub use comm::{new_comm, Comm};
pub use error::{CommError, Result};
pub use flight::{FlightEntry, FlightRecorder, FR_DUMP_DIR_ENV};
pub use hooks::{AbortHook, HookHandle, OpRecord, PostHook, PreHook};
pub use local::{LocalWorld, LocalWorldError};
pub use types::{
    dtype_supported, reduce_supported, OpCtx, OpName, P2POp, ReduceOp, SUPPORTED_DTYPES,
};
pub use window::{Window, WindowBackend};
pub use work::{InlineRun, Work, WorkCompleter, WorkState, WorkStatus};
