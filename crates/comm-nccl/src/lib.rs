//! The `nccl` backend: one rank per GPU on NVIDIA's NCCL (cargo feature `nccl`).
//!
//! Registered as `"nccl"`. Start one process per GPU with `dtrun --nproc N -- prog` (or
//! torchrun, or mpirun with `MASTER_ADDR`/`MASTER_PORT` exported); each calls
//! `new_comm("nccl", &Device::new_cuda(local_rank)?, "world", options)`. Rank and size come
//! from the launcher's environment ([`candle_dtensor_comm_core::env`]); rank 0 hosts the rendezvous
//! [`store`](candle_dtensor_comm_core::store) on `MASTER_ADDR:MASTER_PORT` and publishes the `ncclUniqueId` there.
//! A world of one needs no store. `connect` (with the feature) builds a communicator from an
//! explicit rank, size and store instead. Without the feature, `new_comm("nccl", ..)` fails
//! with [`CommError::NotCompiled`](candle_dtensor_comm_core::CommError::NotCompiled).
//!
//! # Design
//!
//! - **Our own thin wrapper over `cudarc::nccl::sys`** (cudarc's safe `Comm` lacks split,
//!   abort, nonblocking init and all-to-all). Every NCCL call goes through the `NcclApi` trait
//!   (`api.rs`): the real implementation forwards to cudarc, a mock plays scripted codes in
//!   tests. Functions newer than NCCL 2.19 (`ncclAlltoAll`, `ncclGather`/`ncclScatter`,
//!   `ncclCommRevoke`, windows) are looked up by name at run time, never linked, and gated on
//!   `ncclGetVersion` (`version.rs`), so one binary runs on old and new libraries.
//! - **Nonblocking everything**: communicators are created with `blocking = 0`
//!   (`config.rs`: `NCCL_CONFIG_INITIALIZER` semantics, hints `nccl.*`); init, split, group
//!   ends and finalize are polled with `ncclCommGetAsyncError` under the bootstrap or op
//!   timeout, and aborted when it passes (`engine.rs`). A rank that never arrives is named
//!   (rank 0's unique id, or the store's `joined` keys: `bootstrap.rs`).
//! - **Streams, events, Work**: each communicator owns a CUDA stream. An operation waits on an
//!   event recorded on the caller's stream, runs as one NCCL group between a start and an end
//!   event, and returns a `Work` whose `wait()` makes the caller's stream wait on the end
//!   event: no CPU block. `barrier()` is the exception (its `wait()` returns when every rank
//!   arrived, as its contract says). The tensors an operation reads or writes are kept alive
//!   until its end event completes.
//! - **Watchdog**: one thread per communicator polls the events and `ncclCommGetAsyncError`;
//!   work stuck past its timeout (counted from its start event) fails with
//!   [`CommError::Timeout`](candle_dtensor_comm_core::CommError::Timeout), which fires the abort hooks (the
//!   flight-recorder dump), and the communicator is revoked (NCCL >= 2.28.7) and aborted.
//! - **Collectives** (`calls.rs`): `all_reduce`, `all_gather_single`, `reduce_scatter_single`,
//!   `broadcast` and `reduce` are the NCCL collectives; `all_to_all_single` is `ncclAlltoAll`
//!   (>= 2.28.3) or grouped send/recv; `all_to_all_v_single` and `batch_p2p` are grouped
//!   send/recv; `gather` and `scatter` exchange shapes first, then use `ncclGather` /
//!   `ncclScatter` (>= 2.28.3, equal shapes) or grouped send/recv; `barrier` is a one-element
//!   all-reduce. dtypes f32, f64, bf16, f16, i64, u32, u8; `avg` is `ncclAvg`.
//! - **Split**: the ranks first all-gather their group lists and check them as the local
//!   backend does (a split fails on all ranks or none), then `ncclCommSplit` with color = the
//!   group's smallest rank, key = the position in the list, `NCCL_SPLIT_NOCOLOR` for ranks
//!   passing an empty list.
//! - **Windows** (NCCL >= 2.29): `ncclMemAlloc` + `ncclCommWindowRegister` (symmetric); `put` is
//!   `ncclPutSignal` (NCCL has no put without a signal: each put also delivers one signal to its
//!   target), `signal` is `ncclSignal`, `wait_signal` is `ncclWaitSignal` (stream-ordered),
//!   `fence` is a barrier; `get` from a peer is unsupported (NCCL has no get), from this rank's
//!   own window it is a device copy.
//!
//! Sends are not buffered as in the CPU backends: a large `send` completes only once its
//! receiver posted the matching `recv`, so exchanges must be grouped in one `batch_p2p`.

#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

#[cfg(any(feature = "nccl", test))]
pub(crate) mod api;
#[cfg(any(feature = "nccl", test))]
pub(crate) mod bootstrap;
#[cfg(any(feature = "nccl", test))]
pub(crate) mod calls;
#[cfg(any(feature = "nccl", test))]
pub(crate) mod config;
#[cfg(any(feature = "nccl", test))]
pub(crate) mod engine;
#[cfg(any(feature = "nccl", test))]
pub(crate) mod errors;
#[cfg(test)]
pub(crate) mod mock;
#[cfg(test)]
mod tests;
#[cfg(any(feature = "nccl", test))]
pub(crate) mod version;

#[cfg(feature = "nccl")]
mod backend;
#[cfg(feature = "nccl")]
mod driver;
#[cfg(feature = "nccl")]
mod window;

use std::sync::Arc;

use candle_dtensor_comm_core::BackendFactory;

#[cfg(feature = "nccl")]
pub use backend::{connect, library_version};

/// The name this backend is registered under.
pub const NAME: &str = "nccl";

/// The factory registered as `"nccl"`.
#[cfg(feature = "nccl")]
pub fn factory() -> Arc<dyn BackendFactory> {
    Arc::new(NcclFactory)
}

/// The factory registered as `"nccl"` in builds without the feature: it says how to get it.
#[cfg(not(feature = "nccl"))]
pub fn factory() -> Arc<dyn BackendFactory> {
    Arc::new(candle_dtensor_comm_core::kit::NotCompiled("nccl"))
}

/// Creates world communicators of the `nccl` backend from the launcher's environment.
#[cfg(feature = "nccl")]
struct NcclFactory;

#[cfg(feature = "nccl")]
impl BackendFactory for NcclFactory {
    fn create(
        &self,
        device: &candle_core::Device,
        name: &str,
        options: &candle_dtensor_comm_core::CommOptions,
    ) -> candle_dtensor_comm_core::Result<Arc<dyn candle_dtensor_comm_core::Backend>> {
        backend::create_from_env(device, name, options)
    }
}
