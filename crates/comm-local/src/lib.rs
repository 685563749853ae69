//! The `local` backend: N ranks as threads of one process, collectives through shared memory.
//!
//! [`LocalWorld::run`] starts one thread per rank, hands each a world [`Comm`], and returns every
//! rank's result. Data moves by ranks copying straight from their peers' buffers (like NVLink
//! peer access): no serialization and no funnel through one thread. Each communicator has one
//! progress thread per rank, so operations on different communicators really overlap.
//!
//! A rank that panics or returns an error fails every communicator of the world at once, so its
//! peers' pending and future operations end promptly instead of waiting for the timeout, and the
//! launcher reports the rank that failed first and why.

mod backend;
#[cfg(any(feature = "cuda", test))]
mod bounded;
#[cfg(feature = "cuda")]
mod cuda;
mod group;
mod order;
mod tuning;
mod window;

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;

use backend::LocalBackend;
use candle_dtensor_comm_core::kit::cpu::queue::panic_message;
use candle_dtensor_comm_core::Comm;
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::{Backend, BackendFactory, Collective, CommOptions};
use candle_dtensor_comm_core::{CommError, Result};
use group::{GroupKey, World};
pub use tuning::{
    init_cpu_allocator, init_cpu_threads, init_gemm_threads, Tuned, CANDLE_NUM_THREADS_ENV,
    RAYON_NUM_THREADS_ENV,
};

/// The name this backend is registered under.
pub const NAME: &str = "local";

/// The factory behind `new_comm("local", ...)` (see [`LocalWorld`]): what
/// `candle_dtensor_comm::register_builtin_backends` registers as [`NAME`].
pub fn factory() -> Arc<dyn BackendFactory> {
    Arc::new(LocalFactory)
}

/// Registers [`factory`] as [`NAME`] unless a factory of that name is registered already, so
/// `new_comm("local", ..)` on a rank thread works with this crate alone. Idempotent;
/// [`LocalWorld`] calls it before starting the rank threads.
pub fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        candle_dtensor_comm_core::register_backend_if_absent(NAME, factory());
    });
}

/// Stack size of rank threads: candle's backward pass recurses over the graph depth.
const RANK_STACK_BYTES: usize = 64 << 20;

/// Why a local launch failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LocalWorldError {
    /// A rank returned an error or panicked. `rank` is the first one to fail (the root cause);
    /// `failures` lists every failing rank with its message (later ones usually report the
    /// abort the first failure caused).
    #[error("local world of {world} ranks: rank {rank} failed: {reason}")]
    RankFailed {
        /// World size.
        world: usize,
        /// The first rank that failed.
        rank: usize,
        /// Its error or panic message.
        reason: String,
        /// Every failing rank and its message, in rank order.
        failures: Vec<(usize, String)>,
    },
    /// The launch itself could not start.
    #[error("local world: {0}")]
    Launch(String),
}

/// Launches N ranks as threads; see the module docs.
///
/// ```
/// use candle_dtensor::comm::LocalWorld;
/// use std::time::Duration;
///
/// let ranks = LocalWorld::new(3)
///     .with_timeout(Duration::from_secs(10))
///     .launch(|comm| Ok::<_, candle_dtensor::comm::CommError>((comm.rank(), comm.size())))?;
/// assert_eq!(ranks, vec![(0, 3), (1, 3), (2, 3)]);
/// # Ok::<(), candle_dtensor::comm::LocalWorldError>(())
/// ```
#[derive(Debug, Clone)]
pub struct LocalWorld {
    size: usize,
    options: CommOptions,
    name: String,
    elastic: bool,
}

thread_local! {
    static RANK_CTX: RefCell<Option<RankCtx>> = const { RefCell::new(None) };
}

#[derive(Clone)]
struct RankCtx {
    world: Arc<World>,
    rank: usize,
    new_comm_counts: HashMap<String, u64>,
}

impl LocalWorld {
    /// A world of `size` ranks with default options.
    pub fn new(size: usize) -> Self {
        LocalWorld {
            size,
            options: CommOptions::default(),
            name: "world".to_string(),
            elastic: false,
        }
    }

    /// Elastic worlds: a rank that fails (returns an error or panics) fails only the
    /// communicators it belongs to, and the other ranks go on (they can [`Comm::agree`] and
    /// [`Comm::shrink`] around it); use [`LocalWorld::launch_each`] to get every rank's outcome.
    /// Default: off (the first failure fails every communicator of the world).
    pub fn elastic(mut self, on: bool) -> Self {
        self.elastic = on;
        self
    }

    /// Sets the options of the world communicator (and of communicators split from it).
    pub fn with_options(mut self, options: CommOptions) -> Self {
        self.options = options;
        self
    }

    /// Sets the op timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = timeout;
        self
    }

    /// Sets the bootstrap timeout.
    pub fn with_bootstrap_timeout(mut self, timeout: Duration) -> Self {
        self.options.bootstrap_timeout = timeout;
        self
    }

    /// Names the world communicator (default `"world"`).
    pub fn with_name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// `LocalWorld::new(n).launch(f)`.
    pub fn run<T, E, F>(n: usize, f: F) -> std::result::Result<Vec<T>, LocalWorldError>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(Comm) -> std::result::Result<T, E> + Send + Sync,
    {
        LocalWorld::new(n).launch(f)
    }

    /// Runs `f` on every rank (one thread each, given the world communicator) and returns the
    /// results in rank order.
    ///
    /// # Errors
    ///
    /// [`LocalWorldError::RankFailed`] if any rank returns an error or panics; the first failure
    /// also fails every communicator of the world, so the other ranks stop promptly.
    pub fn launch<T, E, F>(&self, f: F) -> std::result::Result<Vec<T>, LocalWorldError>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(Comm) -> std::result::Result<T, E> + Send + Sync,
    {
        let (world, outcomes) = self.run_ranks(f)?;
        let failures: Vec<(usize, String)> = outcomes
            .iter()
            .enumerate()
            .filter_map(|(r, o)| o.as_ref().err().map(|e| (r, e.clone())))
            .collect();
        if failures.is_empty() {
            return Ok(outcomes.into_iter().filter_map(|o| o.ok()).collect());
        }
        let first = world
            .first_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let (rank, reason) = first.unwrap_or_else(|| failures[0].clone());
        Err(LocalWorldError::RankFailed {
            world: self.size,
            rank,
            reason,
            failures,
        })
    }

    /// Like [`LocalWorld::launch`], returning every rank's outcome (its value, or its error or
    /// panic message) in rank order: what an [elastic](LocalWorld::elastic) world's survivors
    /// computed while some ranks failed.
    ///
    /// # Errors
    ///
    /// [`LocalWorldError::Launch`] for a world of no ranks.
    pub fn launch_each<T, E, F>(
        &self,
        f: F,
    ) -> std::result::Result<Vec<std::result::Result<T, String>>, LocalWorldError>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(Comm) -> std::result::Result<T, E> + Send + Sync,
    {
        Ok(self.run_ranks(f)?.1)
    }

    /// Runs `f` on one thread per rank; returns the world and the outcomes in rank order.
    #[allow(clippy::type_complexity)]
    fn run_ranks<T, E, F>(
        &self,
        f: F,
    ) -> std::result::Result<(Arc<World>, Vec<std::result::Result<T, String>>), LocalWorldError>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(Comm) -> std::result::Result<T, E> + Send + Sync,
    {
        if self.size == 0 {
            return Err(LocalWorldError::Launch(
                "a world needs at least one rank".into(),
            ));
        }
        warn_about_candle_pool(self.size);
        register();
        // Before the rank threads start: they must share the arena that keeps large blocks.
        candle_dtensor_comm_core::memory::reuse_large_buffers();
        let world = World::new(self.size, self.elastic);
        let group = world.new_group((0..self.size).collect());
        let f = &f;
        let outcomes: Vec<std::result::Result<T, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.size)
                .map(|rank| {
                    let world = world.clone();
                    let group = group.clone();
                    let options = self.options.clone();
                    let name = self.name.clone();
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .stack_size(RANK_STACK_BYTES)
                        .spawn_scoped(s, move || {
                            let outcome = run_rank(&world, group, rank, &name, options, f);
                            match &outcome {
                                Err(reason) => world.fail(rank, reason.clone()),
                                Ok(_) => world.returned(rank),
                            }
                            RANK_CTX.with(|c| c.borrow_mut().take());
                            outcome
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        Err(format!("rank thread panicked: {}", panic_message(&*p)))
                    }),
                    Err(e) => {
                        let reason = format!("could not start rank thread {rank}: {e}");
                        world.fail(rank, reason.clone());
                        Err(reason)
                    }
                })
                .collect()
        });
        Ok((world, outcomes))
    }
}

fn run_rank<T, E, F>(
    world: &Arc<World>,
    group: Arc<group::Group>,
    rank: usize,
    name: &str,
    options: CommOptions,
    f: &F,
) -> std::result::Result<T, String>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(Comm) -> std::result::Result<T, E>,
{
    RANK_CTX.with(|c| {
        *c.borrow_mut() = Some(RankCtx {
            world: world.clone(),
            rank,
            new_comm_counts: HashMap::new(),
        })
    });
    let backend = LocalBackend::new(group, rank, name).map_err(|e| e.to_string())?;
    backend.set_link(&options, name, None)?;
    let comm = Comm::from_backend(backend, name, options);
    match catch_unwind(AssertUnwindSafe(|| f(comm))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.into().to_string()),
        Err(p) => Err(format!("panicked: {}", panic_message(&*p))),
    }
}

/// The factory behind `new_comm("local", ...)`: a new communicator over every rank of the
/// calling thread's local world. Collective: every rank calls it with the same name.
pub(crate) struct LocalFactory;

impl BackendFactory for LocalFactory {
    fn create(
        &self,
        device: &Device,
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        // CUDA tensors need feature `cuda` (ranks as threads sharing GPUs: `cuda.rs`).
        let supported = device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda());
        if !supported {
            return Err(CommError::Bootstrap {
                comm: name.to_string(),
                reason: format!(
                    "the local backend runs on the CPU{}; got {:?}",
                    if cfg!(feature = "cuda") {
                        " or CUDA devices"
                    } else {
                        " (CUDA devices need cargo feature `cuda`)"
                    },
                    device.location()
                ),
            });
        }
        let ctx = RANK_CTX
            .with(|c| {
                let mut c = c.borrow_mut();
                c.as_mut().map(|ctx| {
                    let count = ctx.new_comm_counts.entry(name.to_string()).or_insert(0);
                    *count += 1;
                    (ctx.world.clone(), ctx.rank, *count)
                })
            })
            .ok_or_else(|| CommError::Bootstrap {
                comm: name.to_string(),
                reason: "new_comm(\"local\") must be called on a rank thread started by LocalWorld"
                    .into(),
            })?;
        let (world, rank, index) = ctx;
        let size = world.size;
        let group = world.rendezvous(
            GroupKey::NewComm {
                name: name.to_string(),
                index,
            },
            || (0..size).collect(),
        );
        let backend = LocalBackend::with_device(group, rank, name, device.clone())?;
        backend
            .set_link(options, name, None)
            .map_err(|reason| CommError::Bootstrap {
                comm: name.to_string(),
                reason,
            })?;
        // Bootstrap: every rank must arrive within the bootstrap timeout.
        let ctx = OpCtx::bootstrap(name, rank, options.bootstrap_timeout);
        backend.collective(ctx, Collective::Barrier)?.wait()?;
        Ok(backend)
    }
}

/// Warns once when several rank threads will share candle's elementwise worker pool, which
/// serializes its callers and spin-waits (see [`init_cpu_threads`]).
fn warn_about_candle_pool(ranks: usize) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if ranks > 1 && std::env::var_os(CANDLE_NUM_THREADS_ENV).is_none() {
        WARNED.call_once(|| {
            tracing::warn!(
                ranks,
                "CANDLE_NUM_THREADS is not set: candle's CPU worker pool serializes the rank \
                 threads and spin-waits; set CANDLE_NUM_THREADS=1 or call \
                 candle_dtensor::init_cpu_threads() at the start of main"
            );
        });
    }
}
