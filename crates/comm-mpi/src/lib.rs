//! The `mpi` backend: one rank per process, on an MPI library (cargo feature `mpi`).
//!
//! Registered as `"mpi"`. Start the processes with `mpirun` (Open MPI:
//! `mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/...`); each calls
//! `new_comm("mpi", &Device::Cpu, "world", options)` and gets a communicator over all of
//! `MPI_COMM_WORLD` (creating it again gives an independent one, an `MPI_Comm_idup`).
//! Without the feature, `new_comm("mpi", ..)` fails with [`CommError::NotCompiled`](candle_dtensor_comm_core::CommError::NotCompiled).
//!
//! # Design
//!
//! - **One progress thread per process owns every MPI call** (see `engine.rs`). It
//!   initializes MPI with the highest thread level the library gives (it asks for
//!   `MPI_THREAD_MULTIPLE`; `FUNNELED` is enough, since no other thread calls MPI). Ops of
//!   one communicator run in issue order; every collective is a nonblocking MPI call
//!   (`MPI_Iallgather(v)`, `MPI_Ialltoall(v)`, `MPI_Ibcast`, `MPI_Igatherv`,
//!   `MPI_Isend`/`MPI_Irecv`, `MPI_Comm_idup`) tested by that thread, so communicators
//!   progress independently and a slow one never stalls another. The one blocking call,
//!   `MPI_Comm_split`, is made once every member has joined the split's descriptor exchange.
//! - **A descriptor exchange precedes every collective**: each rank sends every peer what it
//!   issued (op, dtype, shape, root, reduce op, split list, split sizes), point to point. It
//!   gives the local backend's semantics where MPI has none: desync detection naming both
//!   sides, timeouts naming the ranks that never arrived, `split` and `all_to_all_v` lists
//!   checked on every rank (and no MPI call with mismatched sizes, which MPI leaves
//!   undefined).
//! - **Reductions use our kernels, not MPI ops**: small inputs are all-gathered and reduced
//!   locally, large ones exchanged by chunks (all-to-all), reduced, and all-gathered (the data
//!   volume of a ring all-reduce). The reduction order is the rank order, half types
//!   accumulate in `f32` and round once, so results are bitwise equal to the local backend's
//!   for every dtype and op (MPI has no `bf16`/`f16` types).
//! - **Sends are buffered** as in the local backend: the input is copied, the send's work
//!   completes at once, and the progress thread finishes the `MPI_Isend` in the background.
//!   Every input is copied when the op is issued (the caller may then change or drop its
//!   tensor); outputs are written by MPI into fresh buffers that become the result tensors.
//! - **Timeouts and aborts**: an op not done within its timeout fails with `Timeout` (naming
//!   the ranks whose descriptor never came; an MPI collective already in flight cannot tell,
//!   then the list is empty) and fails its communicator: MPI cannot cancel a collective, so
//!   its buffers stay owned by a zombie until MPI lets go of them. `abort()` fails the
//!   communicator at once on this rank and sends a notice to every peer, whose pending and
//!   later ops then fail with `Aborted` naming the rank and reason (timeouts are told the same
//!   way). Fail-stop for the whole job instead (`MPI_Abort` on `MPI_COMM_WORLD`, as Gloo and
//!   torchcomms' `abort_process_on_timeout_or_error` do) with the hint
//!   `mpi.abort_process=true` or `CDT_MPI_ABORT_PROCESS=1`.
//! - **Exit**: MPI is finalized from an `atexit` handler (bounded wait, 60 s by default,
//!   `CDT_MPI_FINALIZE_TIMEOUT_S`); a process with collectives still in flight skips it.
//!   Communicators are never freed (MPI would reuse their context ids for messages still in
//!   flight to them).
//! - No RMA windows (`Capabilities::rma_*` are false; `new_window` is `Unsupported`).

// Pure encoding logic, so its unit tests run in every test build (no MPI needed).
#[cfg(feature = "mpi")]
mod engine;
#[cfg(any(feature = "mpi", test))]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod framing;
#[cfg(feature = "mpi")]
mod ops;
#[cfg(feature = "mpi")]
mod raw;

use std::sync::Arc;

use candle_dtensor_comm_core::BackendFactory;

#[cfg(feature = "mpi")]
pub use engine::MpiInfo;

/// The name this backend is registered under.
pub const NAME: &str = "mpi";

/// The factory registered as `"mpi"`.
#[cfg(feature = "mpi")]
pub fn factory() -> Arc<dyn BackendFactory> {
    Arc::new(MpiFactory)
}

/// The factory registered as `"mpi"` in builds without the feature: it says how to get it.
#[cfg(not(feature = "mpi"))]
pub fn factory() -> Arc<dyn BackendFactory> {
    Arc::new(candle_dtensor_comm_core::kit::NotCompiled("mpi"))
}

/// Creates world communicators of the `mpi` backend.
#[cfg(feature = "mpi")]
struct MpiFactory;

/// Why `shrink` and `agree` are not available on MPI.
#[cfg(feature = "mpi")]
fn no_recovery(ctx: &candle_dtensor_comm_core::OpCtx) -> candle_dtensor_comm_core::CommError {
    candle_dtensor_comm_core::CommError::Unsupported {
        backend: "mpi".into(),
        op: format!(
            "{} (standard MPI cannot go on after a process failure: that needs ULFM's \
             MPIX_Comm_shrink / MPIX_Comm_agree, which Open MPI and MPICH ship only as \
             extensions; restart the job instead: dtrun or mpirun with a checkpoint)",
            ctx.op
        ),
    }
}

/// What the MPI library of this process provides, once the backend started it (the first
/// `new_comm("mpi", ..)`); `None` before.
#[cfg(feature = "mpi")]
pub fn info() -> Option<MpiInfo> {
    engine::Engine::running().map(|e| e.info.clone())
}

#[cfg(feature = "mpi")]
mod imp {
    use std::sync::Arc;

    use candle_core::Device;

    use super::engine::{Body, CommShared, Engine, Job, ABORT_PROCESS_HINT};
    use super::ops::{self, Input, P2P};
    use super::MpiFactory;
    use candle_dtensor_comm_core::kit::desc::Failure;
    use candle_dtensor_comm_core::Work;
    use candle_dtensor_comm_core::{
        Backend, BackendFactory, Capabilities, Collective, CollectiveOutput, CommOptions,
    };
    use candle_dtensor_comm_core::{CommError, Result};
    use candle_dtensor_comm_core::{OpCtx, P2POp};

    /// One rank of one MPI communicator.
    pub(super) struct MpiBackend {
        engine: Arc<Engine>,
        shared: Arc<CommShared>,
        device: Device,
    }

    impl MpiBackend {
        fn new(engine: Arc<Engine>, shared: Arc<CommShared>) -> Arc<MpiBackend> {
            Arc::new(MpiBackend {
                engine,
                shared,
                device: Device::Cpu,
            })
        }

        /// Queues `body` on this communicator.
        fn run<B: Body>(&self, ctx: OpCtx, collective: bool, body: B) -> Result<Work<B::Out>> {
            run_on(&self.engine, &self.shared, ctx, collective, body)
        }

        /// Queues collective `body`, its output read as the [`Backend::collective`] answer.
        fn start<B: Body>(&self, ctx: OpCtx, body: B) -> Result<Work<CollectiveOutput>>
        where
            B::Out: Into<CollectiveOutput>,
        {
            self.run(ctx, true, body).map(Work::outcome)
        }
    }

    fn run_on<B: Body>(
        engine: &Arc<Engine>,
        shared: &Arc<CommShared>,
        ctx: OpCtx,
        collective: bool,
        body: B,
    ) -> Result<Work<B::Out>> {
        let (work, completer) = Work::pending(ctx.clone(), shared.pending());
        engine.submit(shared, Box::new(Job::new(ctx, collective, body, completer)));
        Ok(work)
    }

    impl Drop for MpiBackend {
        fn drop(&mut self) {
            // Queued ops still run (peers need them); the communicator is freed when idle.
            self.engine.dropped(&self.shared);
        }
    }

    /// One send or receive as the MPI engine moves it.
    fn p2p(ctx: &OpCtx, op: P2POp) -> Result<P2P> {
        Ok(match op {
            P2POp::Send { tensor, peer } => P2P::Send(Input::of(ctx, &tensor)?, peer),
            P2POp::Recv { peer, shape, dtype } => {
                if shape.rank() > super::framing::MAX_DIMS {
                    return Err(CommError::invalid(
                        ctx,
                        format!(
                            "the mpi backend moves tensors of at most {} dims",
                            super::framing::MAX_DIMS
                        ),
                    ));
                }
                P2P::Recv(peer, shape.dims().to_vec(), dtype)
            }
        })
    }

    impl Backend for MpiBackend {
        fn backend_name(&self) -> &'static str {
            "mpi"
        }

        fn rank(&self) -> usize {
            self.shared.rank
        }

        fn size(&self) -> usize {
            self.shared.size
        }

        fn device(&self) -> &Device {
            &self.device
        }

        fn capabilities(&self) -> Capabilities {
            Capabilities {
                shrink: false,
                ..candle_dtensor_comm_core::kit::cpu::capabilities(false)
            }
        }

        fn collective(&self, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>> {
            match op {
                Collective::AllReduce { input, op, output } => {
                    let x = Input::of(&ctx, &input)?;
                    self.start(ctx, ops::AllReduce::new(x, op, output))
                }
                Collective::AllGather { input, output } => {
                    let x = Input::of(&ctx, &input)?;
                    self.start(ctx, ops::Exchange1::all_gather(x, output))
                }
                Collective::ReduceScatter { input, op, output } => {
                    let x = Input::of(&ctx, &input)?;
                    self.start(ctx, ops::ReduceScatter::new(x, op, output))
                }
                Collective::AllToAll { input, output } => {
                    let x = Input::of(&ctx, &input)?;
                    self.start(ctx, ops::Exchange1::all_to_all(x, output))
                }
                Collective::AllToAllV {
                    input,
                    output_split_sizes,
                    input_split_sizes,
                } => {
                    let x = Input::of(&ctx, &input)?;
                    let body = ops::AllToAllV::new(x, output_split_sizes, input_split_sizes);
                    self.start(ctx, body)
                }
                rows @ Collective::AllToAllVRows { .. } => {
                    let op = rows.gather_rows(&ctx)?;
                    self.collective(ctx, op)
                }
                Collective::Broadcast { tensor, root } => {
                    let x = Input::of(&ctx, &tensor)?;
                    self.start(ctx, ops::Broadcast::new(x, tensor, root))
                }
                Collective::Reduce { input, root, op } => {
                    let x = Input::of(&ctx, &input)?;
                    self.start(ctx, ops::Reduce::new(x, root, op))
                }
                Collective::Gather { input, root } => {
                    let x = Input::of(&ctx, &input)?;
                    self.start(ctx, ops::Gather::new(x, root))
                }
                Collective::Scatter { inputs, root } => {
                    let pieces = inputs
                        .iter()
                        .map(|t| Input::of(&ctx, t))
                        .collect::<Result<Vec<_>>>()?;
                    self.start(ctx, ops::Scatter::new(pieces, root))
                }
                Collective::Barrier => self.start(ctx, ops::Barrier),
                Collective::BatchP2p { ops: ops_in } => {
                    let batch = ops_in
                        .into_iter()
                        .map(|op| p2p(&ctx, op))
                        .collect::<Result<Vec<_>>>()?;
                    self.run(ctx, false, ops::BatchP2p::new(batch))
                        .map(Work::outcome)
                }
            }
        }

        fn split(
            &self,
            ctx: OpCtx,
            ranks: &[usize],
            _name: &str,
            _options: &CommOptions,
        ) -> Result<Option<Arc<dyn Backend>>> {
            let engine = self.engine.clone();
            let make = Box::new(move |shared: Arc<CommShared>| {
                MpiBackend::new(engine.clone(), shared) as Arc<dyn Backend>
            });
            self.run(ctx, true, ops::Split::new(ranks.to_vec(), make))?
                .wait()
        }

        fn shrink(
            &self,
            ctx: OpCtx,
            _excluded: &[usize],
            _name: &str,
            _options: &CommOptions,
        ) -> Result<Arc<dyn Backend>> {
            Err(super::no_recovery(&ctx))
        }

        fn agree(&self, ctx: OpCtx, _ok: bool) -> Result<candle_dtensor_comm_core::Agreement> {
            Err(super::no_recovery(&ctx))
        }

        fn abort(&self, reason: &str) {
            let f = Failure::aborted(self.shared.rank, reason);
            self.engine.fail(&self.shared, f);
        }

        fn is_aborted(&self) -> bool {
            self.shared.failure().is_some()
        }

        fn pending(&self) -> usize {
            self.shared.pending()
        }
    }

    impl BackendFactory for MpiFactory {
        fn create(
            &self,
            device: &Device,
            name: &str,
            options: &CommOptions,
        ) -> Result<Arc<dyn Backend>> {
            candle_dtensor_comm_core::kit::cpu::require_cpu(device, "mpi", name)?;
            if options
                .hints
                .get("mpi.abort_process")
                .is_some_and(|v| v == "true" || v == "1")
            {
                ABORT_PROCESS_HINT.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let engine =
                Engine::get(options.bootstrap_timeout).map_err(|reason| CommError::Bootstrap {
                    comm: name.to_string(),
                    reason,
                })?;
            let ctx = OpCtx::bootstrap(name, engine.info.rank, options.bootstrap_timeout);
            let boot = engine.bootstrap.clone();
            let shared = run_on(&engine, &boot, ctx, true, ops::NewComm::new(name))?.wait()?;
            Ok(MpiBackend::new(engine, shared))
        }
    }
}
