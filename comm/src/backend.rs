//! The seam between the [`crate::Comm`] front and a transport.
//!
//! A backend implements [`Backend`]: one object per rank and communicator, bound to one device.
//! The front validates arguments, assigns sequence numbers, fires hooks, feeds the flight
//! recorder and opens tracing spans; backends see none of that and only move data.
//! Optional operations (windows) default to [`CommError::Unsupported`] and are advertised by
//! [`Backend::capabilities`]. Backends register a [`BackendFactory`] by name so
//! [`crate::new_comm`] can create them; crates outside this one may register their own.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use candle_core::{DType, Device, Shape, Tensor};

use crate::agree::Agreement;
use crate::error::{CommError, Result};
use crate::types::{OpCtx, P2POp, ReduceOp};
use crate::window::WindowBackend;
use crate::work::Work;

/// What a backend can do beyond the required collectives.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Capabilities {
    /// One-sided `put` into a peer's window.
    pub rma_put: bool,
    /// One-sided `get` from a peer's window (NCCL has none).
    pub rma_get: bool,
    /// `signal` / `wait_signal` on windows.
    pub rma_signal: bool,
    /// `abort()` fails pending work without blocking.
    pub abort: bool,
    /// [`crate::Comm::shrink`] rebuilds the communicator without excluded (possibly dead) ranks.
    pub shrink: bool,
    /// The dtypes its collectives accept.
    pub dtypes: Vec<String>,
}

/// Communicator-wide options.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// How long one operation may wait for its peers.
    pub timeout: Duration,
    /// How long creating a communicator (rendezvous, split) may wait for its peers. Kept
    /// separate from `timeout` (torchcomms#873: one short timeout for both made bootstrap flaky).
    pub bootstrap_timeout: Duration,
    /// Entries kept by the built-in flight recorder (0 disables it).
    pub flight_recorder_entries: usize,
    /// Free-form backend hints.
    pub hints: BTreeMap<String, String>,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(300),
            bootstrap_timeout: Duration::from_secs(120),
            flight_recorder_entries: 256,
            hints: BTreeMap::new(),
        }
    }
}

impl CommOptions {
    /// Sets the op timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the bootstrap timeout.
    pub fn with_bootstrap_timeout(mut self, timeout: Duration) -> Self {
        self.bootstrap_timeout = timeout;
        self
    }

    /// Adds a hint.
    pub fn with_hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }
}

/// A transport for one rank of one communicator.
///
/// Contract:
/// - Ranks are communicator-relative. All ranks issue collectives in the same order; the front
///   guarantees arguments are valid for this rank (ranks in range, dtypes supported, inputs
///   contiguous on [`Backend::device`]).
/// - Operations on one backend object execute in issue order; different backend objects (other
///   communicators) progress independently.
/// - Every returned [`Work`] completes within `ctx.timeout` of starting, with
///   [`CommError::Timeout`] naming the missing ranks when peers never arrive.
/// - `abort` never blocks and fails all pending work.
pub trait Backend: Send + Sync + 'static {
    /// The backend's registry name (`"local"`, `"nccl"`, ...).
    fn backend_name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// The device tensors must live on.
    fn device(&self) -> &Device;
    /// What the backend supports.
    fn capabilities(&self) -> Capabilities;

    /// Reduces `input` across ranks; every rank gets the result. When `output` is given (same
    /// dtype and element count, contiguous; it may be `input` itself) the result is written
    /// into it and it is returned; otherwise a new tensor is returned. The same holds for the
    /// `output` of the next three ops (which must not alias `input`).
    fn all_reduce(
        &self,
        ctx: OpCtx,
        input: Tensor,
        op: ReduceOp,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>>;
    /// Concatenates every rank's `input` along dim 0 (in rank order).
    fn all_gather_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>>;
    /// Reduces `input` across ranks and gives rank r the r-th dim-0 chunk.
    fn reduce_scatter_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        op: ReduceOp,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>>;
    /// Rank r's output chunk j (dim 0) is rank j's input chunk r.
    fn all_to_all_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>>;
    /// Like `all_to_all_single` with per-peer dim-0 split sizes.
    fn all_to_all_v_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        output_split_sizes: Vec<usize>,
        input_split_sizes: Vec<usize>,
    ) -> Result<Work<Tensor>>;
    /// [`Backend::all_to_all_v_single`] of `input`'s dim-0 rows `rows`, in that order (repeats
    /// allowed; validated by the front: in range, as many as `input_split_sizes` sums to). A
    /// backend that can read the rows in place (the local backend on the CPU) never builds
    /// the permuted send buffer; this default gathers it, then exchanges.
    fn all_to_all_v_rows(
        &self,
        ctx: OpCtx,
        input: Tensor,
        rows: Arc<Vec<u32>>,
        output_split_sizes: Vec<usize>,
        input_split_sizes: Vec<usize>,
    ) -> Result<Work<Tensor>> {
        gather_then_exchange(
            self,
            ctx,
            input,
            &rows,
            output_split_sizes,
            input_split_sizes,
        )
    }
    /// Every rank gets `root`'s tensor (`tensor` gives shape and dtype on other ranks).
    fn broadcast(&self, ctx: OpCtx, tensor: Tensor, root: usize) -> Result<Work<Tensor>>;
    /// `root` gets the reduction of every rank's `input`; others get `None`.
    fn reduce(
        &self,
        ctx: OpCtx,
        input: Tensor,
        root: usize,
        op: ReduceOp,
    ) -> Result<Work<Option<Tensor>>>;
    /// `root` gets every rank's `input` in rank order; others get `None`.
    fn gather(&self, ctx: OpCtx, input: Tensor, root: usize) -> Result<Work<Option<Vec<Tensor>>>>;
    /// Rank r gets `inputs[r]` of `root` (`inputs` is empty on other ranks).
    fn scatter(&self, ctx: OpCtx, inputs: Vec<Tensor>, root: usize) -> Result<Work<Tensor>>;
    /// Returns when every rank has reached it.
    fn barrier(&self, ctx: OpCtx) -> Result<Work<()>>;
    /// Runs sends and receives as one group (sends never wait for their receiver, so groups in
    /// any order cannot deadlock); the output holds the received tensors in op order.
    fn batch_p2p(&self, ctx: OpCtx, ops: Vec<P2POp>) -> Result<Work<Vec<Tensor>>>;
    /// Collective over this communicator: every rank passes the list of ranks of its own new
    /// group (validated by the front), or an empty list to opt out.
    fn split(
        &self,
        ctx: OpCtx,
        ranks: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Option<Arc<dyn Backend>>>;

    /// Collective over the ranks not in `excluded` (sorted; validated by the front: non-empty,
    /// in range, without this rank, unless [`Backend::shrink_agrees_on_lists`]): a new communicator of those ranks, in order, renumbered
    /// from 0, built without the excluded ranks and whether or not this communicator has
    /// failed. The survivors agree on the outcome ([`crate::Comm::shrink`] states the contract).
    fn shrink(
        &self,
        ctx: OpCtx,
        excluded: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        let _ = (excluded, name, options);
        Err(CommError::Unsupported {
            backend: self.backend_name().to_string(),
            op: ctx.op.to_string(),
        })
    }

    /// Whether [`Backend::shrink`] agrees on every caller's list before acting on it (it then
    /// takes bad lists too, and every caller reports them); otherwise the front rejects a bad
    /// list on the calling rank alone.
    fn shrink_agrees_on_lists(&self) -> bool {
        false
    }

    /// Fault-tolerant agreement over the live ranks, failed communicator or not
    /// ([`crate::Comm::agree`] states the contract).
    fn agree(&self, ctx: OpCtx, ok: bool) -> Result<Agreement> {
        let _ = ok;
        Err(CommError::Unsupported {
            backend: self.backend_name().to_string(),
            op: ctx.op.to_string(),
        })
    }

    /// Collective: allocates a `bytes`-sized RMA window on every rank.
    fn new_window(&self, ctx: OpCtx, bytes: usize) -> Result<Arc<dyn WindowBackend>> {
        let _ = bytes;
        Err(CommError::Unsupported {
            backend: self.backend_name().to_string(),
            op: ctx.op.to_string(),
        })
    }

    /// Fails all pending and future work with `reason`. Never blocks; safe from any thread.
    fn abort(&self, reason: &str);
    /// Whether the communicator was aborted (or failed).
    fn is_aborted(&self) -> bool;
    /// Number of operations queued and not yet finished.
    fn pending(&self) -> usize {
        0
    }
}

/// Creates backends for [`crate::new_comm`].
pub trait BackendFactory: Send + Sync + 'static {
    /// Creates this rank's backend for a new communicator named `name` on `device`.
    fn create(
        &self,
        device: &Device,
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>>;
}

impl<F> BackendFactory for F
where
    F: Fn(&Device, &str, &CommOptions) -> Result<Arc<dyn Backend>> + Send + Sync + 'static,
{
    fn create(
        &self,
        device: &Device,
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        self(device, name, options)
    }
}

/// The factory of a backend this build leaves out: `new_comm` names the cargo feature (the
/// backend's own name) that adds it.
pub(crate) struct NotCompiled(pub(crate) &'static str);

impl BackendFactory for NotCompiled {
    fn create(&self, _: &Device, _: &str, _: &CommOptions) -> Result<Arc<dyn Backend>> {
        Err(CommError::NotCompiled {
            backend: self.0.into(),
            feature: self.0.into(),
        })
    }
}

type Registry = RwLock<BTreeMap<String, Arc<dyn BackendFactory>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut m: BTreeMap<String, Arc<dyn BackendFactory>> = BTreeMap::new();
        m.insert(
            "local".to_string(),
            Arc::new(crate::local::LocalFactory) as Arc<dyn BackendFactory>,
        );
        m.insert("mpi".to_string(), crate::mpi::factory()); // NotCompiled without feature `mpi`
        m.insert("nccl".to_string(), crate::nccl::factory()); // NotCompiled without feature `nccl`
        m.insert(
            "process".to_string(),
            Arc::new(crate::process::ProcessFactory) as Arc<dyn BackendFactory>,
        );
        RwLock::new(m)
    })
}

/// Registers a backend factory under `name` (replacing any earlier one of that name).
///
/// This is how a crate outside candle-dtensor plugs in its own transport.
pub fn register_backend(name: &str, factory: Arc<dyn BackendFactory>) {
    registry()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), factory);
}

/// The names of the registered backends.
pub fn registered_backends() -> Vec<String> {
    registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .cloned()
        .collect()
}

pub(crate) fn lookup_backend(name: &str) -> Result<Arc<dyn BackendFactory>> {
    let reg = registry().read().unwrap_or_else(|e| e.into_inner());
    reg.get(name)
        .cloned()
        .ok_or_else(|| CommError::UnknownBackend {
            name: name.to_string(),
            available: reg.keys().cloned().collect(),
        })
}

/// Checks that a caller's `*_into` output `t` can hold a result of `dtype` and `shape` (the
/// front checked it against the input; a backend checks it against what it computed).
pub(crate) fn check_output(ctx: &OpCtx, t: &Tensor, dtype: DType, shape: &Shape) -> Result<()> {
    if t.dtype() == dtype && t.elem_count() == shape.elem_count() {
        return Ok(());
    }
    Err(CommError::invalid(
        ctx,
        format!(
            "output is {:?} {:?} but the result is {:?} {:?}",
            t.dims(),
            t.dtype(),
            shape.dims(),
            dtype
        ),
    ))
}

/// The dtypes the built-in backends accept, rendered for [`Capabilities::dtypes`].
pub(crate) fn dtype_names(dtypes: &[DType]) -> Vec<String> {
    dtypes.iter().map(|d| d.as_str().to_string()).collect()
}

/// [`Backend::all_to_all_v_rows`] for a backend that cannot read rows in place: `input`'s
/// dim-0 rows `rows` gathered into one contiguous tensor (any device), then exchanged.
pub(crate) fn gather_then_exchange<B: Backend + ?Sized>(
    backend: &B,
    ctx: OpCtx,
    input: Tensor,
    rows: &[u32],
    output_split_sizes: Vec<usize>,
    input_split_sizes: Vec<usize>,
) -> Result<Work<Tensor>> {
    let ids = Tensor::from_slice(rows, rows.len(), input.device())
        .map_err(|e| CommError::candle(&ctx, e))?;
    let send = input
        .contiguous()
        .and_then(|x| x.index_select(&ids, 0))
        .map_err(|e| CommError::candle(&ctx, e))?;
    backend.all_to_all_v_single(ctx, send, output_split_sizes, input_split_sizes)
}
