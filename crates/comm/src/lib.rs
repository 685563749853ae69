//! Communicators for candle-dtensor, shaped like torchcomms.
//!
//! This crate is the front the rest of the workspace and users depend on. It re-exports
//! everything of `candle-dtensor-comm-core` (the [`Comm`] front, the [`Backend`] seam, [`Work`],
//! hooks, the flight recorder, windows, and the backend [`kit`]) at the same paths, the
//! built-in backends as modules ([`local`], [`process`], [`mpi`], [`nccl`]) and, with feature
//! `conformance`, the conformance suite as `conformance`; and it registers the built-in
//! backends ([`register_builtin_backends`], which [`new_comm`] calls first).
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

use std::sync::Once;

pub use candle_dtensor_comm_core::*;

#[cfg(feature = "conformance")]
pub use candle_dtensor_comm_conformance as conformance;
pub use candle_dtensor_comm_local as local;
pub use candle_dtensor_comm_mpi as mpi;
pub use candle_dtensor_comm_nccl as nccl;
pub use candle_dtensor_comm_process as process;

pub use local::{LocalWorld, LocalWorldError};

/// Registers the built-in backends (`local`, `mpi`, `nccl`, `process`) with the registry of
/// `candle-dtensor-comm-core`. Idempotent (the first call does the work) and cheap after it;
/// [`new_comm`] calls it, so code that only creates communicators never needs to. A factory
/// registered under a built-in name before the first call stays (the built-ins only fill
/// names nobody took); one registered after replaces the built-in, as [`register_backend`]
/// always does. `mpi` and `nccl` are registered in every build: without their cargo feature
/// their factory fails with [`CommError::NotCompiled`] naming the feature.
pub fn register_builtin_backends() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        register_backend_if_absent(local::NAME, local::factory());
        register_backend_if_absent(mpi::NAME, mpi::factory());
        register_backend_if_absent(nccl::NAME, nccl::factory());
        register_backend_if_absent(process::NAME, process::factory());
    });
}

/// Creates a communicator with the backend registered as `backend`, after registering the
/// built-in ones ([`register_builtin_backends`]).
///
/// For `"local"` this must run on a rank thread started by [`LocalWorld`]; every rank of the
/// world must call it (it is collective, bounded by `options.bootstrap_timeout`).
///
/// # Errors
///
/// [`CommError::UnknownBackend`] listing the registered names when none is registered as
/// `backend`; otherwise whatever the backend's factory reports (a bootstrap failure, a
/// timeout, [`CommError::NotCompiled`]).
pub fn new_comm(
    backend: &str,
    device: &candle_core::Device,
    name: &str,
    options: CommOptions,
) -> Result<Comm> {
    register_builtin_backends();
    candle_dtensor_comm_core::new_comm(backend, device, name, options)
}

/// The names of the registered backends, the built-in ones included (they are registered
/// first).
pub fn registered_backends() -> Vec<String> {
    register_builtin_backends();
    candle_dtensor_comm_core::registered_backends()
}
