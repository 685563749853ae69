//! The core of candle-dtensor's communicators: the [`Comm`] front, the [`Backend`] seam and its
//! registry, [`Work`], hooks, the [`FlightRecorder`], RMA [`Window`]s, and the kit backends are
//! written with. It holds no backend: the built-in ones (`local`, `process`, `mpi`, `nccl`) are
//! crates of their own, and `candle-dtensor-comm` (the crate users and the rest of the
//! workspace depend on) re-exports this crate and registers them.
//!
//! # Layout
//!
//! - The front: [`Comm`] (one rank's handle of a group: collectives, point-to-point, `split`,
//!   `shrink`, `agree`, windows), [`Work`], the hooks ([`OpRecord`], [`HookHandle`]) and the
//!   [`FlightRecorder`] (which depends on the hooks only; [`Comm`] attaches it).
//! - The seam: [`Backend`], [`BackendFactory`], [`register_backend`], [`new_comm`],
//!   [`Capabilities`], [`Collective`], [`CommOptions`]; the operation vocabulary ([`OpName`],
//!   [`OpCtx`], [`P2POp`], [`ReduceOp`], the supported dtypes) and [`CommError`].
//! - The kit, for backend authors ([`kit`]): [`kit::cpu`] (the per-communicator op queue,
//!   reduction kernels over byte buffers, pooled byte buffers, delivering a result to the
//!   caller), [`kit::desc`] (op descriptors, desync rules, failures, split checks),
//!   [`kit::agree`] (fault-tolerant agreement for `agree` and `shrink`), plus the modules users
//!   see too, re-exported in [`kit`] and public at the top level: [`store`] (the rendezvous
//!   store), [`env`] (the launcher's environment), [`auth`] (the job token and handshake),
//!   [`link`] (modelled link speeds) and [`memory`] (allocator tuning).
//!
//! # Registration
//!
//! [`new_comm`] looks the backend up by name among the factories registered with
//! [`register_backend`]. This crate registers none: `candle_dtensor_comm::new_comm` registers
//! the built-in backends first (`candle_dtensor_comm::register_builtin_backends`), and a
//! backend crate of its own registers itself the same way.
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

pub mod auth;
mod backend;
mod comm;
pub mod env;
mod error;
mod flight;
mod hooks;
pub mod kit;
pub mod link;
pub mod memory;
pub mod store;
mod vocab;
mod window;
mod work;

// The kit's modules under their short names, for this crate's own paths (`crate::cpu::...`).
use kit::{agree, cpu, desc};

pub use agree::Agreement;
pub use backend::{
    register_backend, register_backend_if_absent, registered_backends, Backend, BackendFactory,
    Capabilities, Collective, CollectiveOutput, CommOptions,
};
pub use comm::{new_comm, Comm};
pub use error::{CommError, Result};
pub use flight::{FlightEntry, FlightRecorder, FR_DUMP_DIR_ENV};
pub use hooks::{AbortHook, HookHandle, OpRecord, PostHook, PreHook};
pub use vocab::{
    dtype_supported, reduce_supported, OpCtx, OpName, P2POp, ReduceOp, SUPPORTED_DTYPES,
};
pub use window::{Window, WindowBackend};
pub use work::{InlineRun, Work, WorkCompleter, WorkState, WorkStatus};
