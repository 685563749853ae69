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
use crate::vocab::{OpCtx, P2POp, ReduceOp};
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

/// One collective as the front hands it to [`Backend::collective`], with arguments validated
/// for this rank. When an `output` is given (same dtype and element count as the result,
/// contiguous; for `AllReduce` it may be `input` itself, for the others it does not overlap
/// `input`) the result is written into it and it is returned; otherwise a new tensor is.
#[derive(Debug)]
pub enum Collective {
    /// Reduces `input` across ranks; every rank gets the result.
    AllReduce {
        /// This rank's summand.
        input: Tensor,
        /// How to combine.
        op: ReduceOp,
        /// Where to write the result, if given.
        output: Option<Tensor>,
    },
    /// Concatenates every rank's `input` along dim 0 (in rank order; a scalar becomes `[n]`).
    AllGather {
        /// This rank's piece.
        input: Tensor,
        /// Where to write the result, if given.
        output: Option<Tensor>,
    },
    /// Reduces `input` across ranks and gives rank r the r-th dim-0 chunk.
    ReduceScatter {
        /// This rank's summand (dim 0 divisible by the size).
        input: Tensor,
        /// How to combine.
        op: ReduceOp,
        /// Where to write the result, if given.
        output: Option<Tensor>,
    },
    /// Rank r's output chunk j (dim 0) is rank j's input chunk r.
    AllToAll {
        /// This rank's chunks (dim 0 divisible by the size).
        input: Tensor,
        /// Where to write the result, if given.
        output: Option<Tensor>,
    },
    /// Like `AllToAll` with per-peer dim-0 split sizes.
    AllToAllV {
        /// This rank's pieces, back to back on dim 0.
        input: Tensor,
        /// Dim-0 slices received from each rank.
        output_split_sizes: Vec<usize>,
        /// Dim-0 slices sent to each rank (summing to `input`'s dim 0).
        input_split_sizes: Vec<usize>,
    },
    /// `AllToAllV` of `input`'s dim-0 rows `rows`, in that order (repeats allowed; in range,
    /// as many as `input_split_sizes` sums to). A backend that reads the rows in place (the
    /// local backend on the CPU) never builds the permuted send buffer; others answer with
    /// [`Collective::gather_rows`] first.
    AllToAllVRows {
        /// The rows to pick from.
        input: Tensor,
        /// Which rows, in send order.
        rows: Arc<Vec<u32>>,
        /// Dim-0 slices received from each rank.
        output_split_sizes: Vec<usize>,
        /// Rows of `rows` sent to each rank.
        input_split_sizes: Vec<usize>,
    },
    /// Every rank gets `root`'s tensor (`tensor` gives shape and dtype on other ranks).
    Broadcast {
        /// The root's data; elsewhere the shape and dtype to expect.
        tensor: Tensor,
        /// The sending rank.
        root: usize,
    },
    /// `root` gets the reduction of every rank's `input`; others get `None`.
    Reduce {
        /// This rank's summand.
        input: Tensor,
        /// The receiving rank.
        root: usize,
        /// How to combine.
        op: ReduceOp,
    },
    /// `root` gets every rank's `input` in rank order; others get `None`.
    Gather {
        /// This rank's piece (shapes may differ across ranks).
        input: Tensor,
        /// The receiving rank.
        root: usize,
    },
    /// Rank r gets `inputs[r]` of `root` (`inputs` is empty on other ranks).
    Scatter {
        /// The root's pieces, one per rank.
        inputs: Vec<Tensor>,
        /// The sending rank.
        root: usize,
    },
    /// Returns when every rank has reached it.
    Barrier,
    /// Sends and receives as one group (sends never wait for their receiver, so groups in
    /// any order cannot deadlock); the outcome holds the received tensors in op order.
    BatchP2p {
        /// The sends and receives.
        ops: Vec<P2POp>,
    },
}

impl Collective {
    /// The data an `AllToAllVRows` sends, gathered into one contiguous tensor on `input`'s
    /// device, as the `AllToAllV` of the same exchange (any other op is returned as it is):
    /// how a backend that cannot read rows in place answers it.
    pub fn gather_rows(self, ctx: &OpCtx) -> Result<Collective> {
        let Collective::AllToAllVRows {
            input,
            rows,
            output_split_sizes,
            input_split_sizes,
        } = self
        else {
            return Ok(self);
        };
        let ids = Tensor::from_slice(&rows[..], rows.len(), input.device())
            .map_err(|e| CommError::candle(ctx, e))?;
        let input = input
            .contiguous()
            .and_then(|x| x.index_select(&ids, 0))
            .map_err(|e| CommError::candle(ctx, e))?;
        Ok(Collective::AllToAllV {
            input,
            output_split_sizes,
            input_split_sizes,
        })
    }
}

/// What a [`Collective`] yields. Each op has one kind: `Tensor` for the dense ops, `Broadcast`
/// and `Scatter`; `Rooted` for `Reduce`; `Gathered` for `Gather`; `Received` for `BatchP2p`;
/// `Done` for `Barrier`. A backend builds it with `From` (or [`Work::outcome`]); the front
/// turns another kind than the op's into [`CommError::WrongOutcome`].
#[derive(Debug)]
pub enum CollectiveOutput {
    /// One tensor.
    Tensor(Tensor),
    /// The root's tensor; `None` elsewhere.
    Rooted(Option<Tensor>),
    /// The root's pieces in rank order; `None` elsewhere.
    Gathered(Option<Vec<Tensor>>),
    /// The received tensors, in op order.
    Received(Vec<Tensor>),
    /// Nothing but completion.
    Done,
}

impl CollectiveOutput {
    /// The kind's name, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            CollectiveOutput::Tensor(_) => "a tensor",
            CollectiveOutput::Rooted(_) => "a root's tensor",
            CollectiveOutput::Gathered(_) => "a root's pieces",
            CollectiveOutput::Received(_) => "received tensors",
            CollectiveOutput::Done => "completion alone",
        }
    }
}

/// A value one kind of [`CollectiveOutput`] carries, read back by the front.
pub(crate) trait FromCollectiveOutput: Sized {
    fn from_outcome(o: CollectiveOutput) -> std::result::Result<Self, CollectiveOutput>;
}

macro_rules! outcome_kind {
    ($t:ty, $v:ident) => {
        impl From<$t> for CollectiveOutput {
            fn from(v: $t) -> CollectiveOutput {
                CollectiveOutput::$v(v)
            }
        }
        impl FromCollectiveOutput for $t {
            fn from_outcome(o: CollectiveOutput) -> std::result::Result<Self, CollectiveOutput> {
                match o {
                    CollectiveOutput::$v(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
    };
}
outcome_kind!(Tensor, Tensor);
outcome_kind!(Option<Tensor>, Rooted);
outcome_kind!(Option<Vec<Tensor>>, Gathered);
outcome_kind!(Vec<Tensor>, Received);

impl From<()> for CollectiveOutput {
    fn from(_: ()) -> CollectiveOutput {
        CollectiveOutput::Done
    }
}

impl FromCollectiveOutput for () {
    fn from_outcome(o: CollectiveOutput) -> std::result::Result<Self, CollectiveOutput> {
        match o {
            CollectiveOutput::Done => Ok(()),
            other => Err(other),
        }
    }
}

impl<T: Into<CollectiveOutput> + Send + 'static> Work<T> {
    /// This work's output as a [`CollectiveOutput`]: what [`Backend::collective`] returns.
    pub fn outcome(self) -> Work<CollectiveOutput> {
        self.map(Into::into)
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

    /// Starts `op` (see [`Collective`] for what each does); the work yields the [`CollectiveOutput`]
    /// of the op's kind ([`CollectiveOutput`] names which). One method for every collective: the
    /// front builds the descriptor, validates it and reads the outcome back as the caller's
    /// type, so a backend writes one `match` arm per op and nothing else.
    fn collective(&self, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>>;
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
/// backend's own name) that adds it ([`CommError::NotCompiled`]). The `mpi` and `nccl` crates
/// register one of these when built without their feature.
#[derive(Debug, Clone, Copy)]
pub struct NotCompiled(pub &'static str);

impl BackendFactory for NotCompiled {
    fn create(&self, _: &Device, _: &str, _: &CommOptions) -> Result<Arc<dyn Backend>> {
        Err(CommError::NotCompiled {
            backend: self.0.into(),
            feature: self.0.into(),
        })
    }
}

type Registry = RwLock<BTreeMap<String, Arc<dyn BackendFactory>>>;

/// The registry starts empty: the built-in backends live in crates of their own, and
/// `candle_dtensor_comm::register_builtin_backends` registers them.
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| RwLock::new(BTreeMap::new()))
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

/// Registers `factory` under `name` unless a factory of that name is registered already;
/// returns whether it did. How the built-in backends register themselves, so that a factory
/// a user registered first under a built-in name stays.
pub fn register_backend_if_absent(name: &str, factory: Arc<dyn BackendFactory>) -> bool {
    let mut reg = registry().write().unwrap_or_else(|e| e.into_inner());
    if reg.contains_key(name) {
        return false;
    }
    reg.insert(name.to_string(), factory);
    true
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
///
/// # Errors
///
/// [`CommError::InvalidArgument`] naming both when it cannot.
pub fn check_output(ctx: &OpCtx, t: &Tensor, dtype: DType, shape: &Shape) -> Result<()> {
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
pub fn dtype_names(dtypes: &[DType]) -> Vec<String> {
    dtypes.iter().map(|d| d.as_str().to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_name_lists_the_registered_ones_and_who_registers_the_built_ins() {
        register_backend(
            "core-test-unknown",
            Arc::new(NotCompiled("core-test-unknown")),
        );
        let e = crate::new_comm("no-such-backend", &Device::Cpu, "x", CommOptions::default())
            .map(drop)
            .unwrap_err();
        match &e {
            CommError::UnknownBackend { name, available } => {
                assert_eq!(name, "no-such-backend");
                assert!(available.contains(&"core-test-unknown".to_string()), "{e}");
            }
            other => panic!("{other}"),
        }
        let m = e.to_string();
        assert!(
            m.contains("candle_dtensor_comm") && m.contains("register_builtin_backends"),
            "{m}"
        );
    }

    #[test]
    fn register_if_absent_keeps_the_factory_registered_first() {
        let first: Arc<dyn BackendFactory> = Arc::new(NotCompiled("first"));
        assert!(register_backend_if_absent("core-test-absent", first));
        assert!(!register_backend_if_absent(
            "core-test-absent",
            Arc::new(NotCompiled("second"))
        ));
        let Err(CommError::NotCompiled { backend, .. }) = crate::new_comm(
            "core-test-absent",
            &Device::Cpu,
            "x",
            CommOptions::default(),
        ) else {
            panic!("the registered factory refuses");
        };
        assert_eq!(backend, "first");
    }
}
