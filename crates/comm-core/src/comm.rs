//! `Comm`: the communicator front every backend sits behind.
//!
//! The front owns what is common to all backends (torchcomms' `TorchComm`): the name, the
//! per-communicator sequence number, argument validation, hooks, the flight recorder, abort
//! hooks and `tracing` spans. It hands validated, contiguous inputs to a [`Backend`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Shape, Tensor};

use crate::agree::Agreement;
use crate::backend::{
    lookup_backend, Backend, Capabilities, Collective, CommOptions, FromCollectiveOutput,
};
use crate::cpu::kernels::data_addr;
use crate::error::{CommError, Result};
use crate::flight::{dump_on_failure, FlightRecorder};
use crate::hooks::{HookHandle, HookSet, OpRecord};
use crate::vocab::{dtype_supported, reduce_supported, OpCtx, OpName, P2POp, ReduceOp};
use crate::window::Window;
use crate::work::{Work, WorkState};

/// The least time an observer of a failure waits for another thread's abort hooks to finish.
const HOOK_WAIT_FLOOR: Duration = Duration::from_secs(5);

struct Inner {
    backend: Arc<dyn Backend>,
    name: Arc<str>,
    options: CommOptions,
    seq: AtomicU64,
    hooks: Arc<HookSet>,
    recorder: Option<FlightRecorder>,
}

/// The ops that share [`Comm::dense`].
#[derive(Clone, Copy)]
enum Dense {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
    AllToAll,
}

/// A communicator: one rank's handle of a group of ranks (torchcomms' `TorchComm`).
///
/// Ranks are communicator-relative. Every operation returns a [`Work`]; operations on one
/// communicator run in issue order, different communicators progress independently. Cloning a
/// `Comm` is cheap and yields a handle to the same communicator (same sequence, same hooks).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dtensor::comm::{LocalWorld, ReduceOp};
///
/// let sums = LocalWorld::run(4, |comm| {
///     let x = Tensor::full(comm.rank() as f32, 3, &Device::Cpu)?;
///     let y = comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
///     Ok::<_, candle_core::Error>(y.to_vec1::<f32>()?)
/// })?;
/// assert_eq!(sums[2], vec![6.0, 6.0, 6.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Comm {
    inner: Arc<Inner>,
    timeout: Duration,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("name", &self.inner.name)
            .field("backend", &self.inner.backend.backend_name())
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

/// Creates a communicator with the backend registered as `backend`.
///
/// For `"local"` this must run on a rank thread started by [`crate::LocalWorld`]; every rank of
/// the world must call it (it is collective, bounded by `options.bootstrap_timeout`).
pub fn new_comm(backend: &str, device: &Device, name: &str, options: CommOptions) -> Result<Comm> {
    let factory = lookup_backend(backend)?;
    let b = factory.create(device, name, &options)?;
    Ok(Comm::from_backend(b, name, options))
}

impl FlightRecorder {
    /// Records every operation of `comm` from now on. Returns the pre- and post-hook handles.
    pub fn attach(&self, comm: &Comm) -> (HookHandle, HookHandle) {
        let pre = comm.inner.hooks.add_pre(self.pre_hook());
        let post = comm.inner.hooks.add_post(self.post_hook());
        (pre, post)
    }
}

impl Comm {
    /// Wraps a backend object in the front.
    pub fn from_backend(backend: Arc<dyn Backend>, name: &str, options: CommOptions) -> Comm {
        let recorder = (options.flight_recorder_entries > 0)
            .then(|| FlightRecorder::new(options.flight_recorder_entries));
        let timeout = options.timeout;
        let comm = Comm {
            inner: Arc::new(Inner {
                backend,
                name: Arc::from(name),
                options,
                seq: AtomicU64::new(0),
                hooks: Arc::new(HookSet::default()),
                recorder,
            }),
            timeout,
        };
        if let Some(fr) = &comm.inner.recorder {
            // The handles are dropped on purpose: the recorder lives as long as the comm.
            let _ = fr.attach(&comm);
            let fr = fr.clone();
            let name = comm.inner.name.clone();
            let rank = comm.rank();
            let _ = comm.register_abort_hook(move |err| {
                dump_on_failure(&fr, &name, rank, &err.to_string());
            });
        }
        comm
    }

    /// This rank, relative to the communicator.
    pub fn rank(&self) -> usize {
        self.inner.backend.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.inner.backend.size()
    }

    /// The communicator's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The backend's registry name.
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.backend_name()
    }

    /// The device tensors must live on.
    pub fn device(&self) -> &Device {
        self.inner.backend.device()
    }

    /// What the backend supports.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.backend.capabilities()
    }

    /// The options the communicator was created with.
    pub fn options(&self) -> &CommOptions {
        &self.inner.options
    }

    /// The op timeout of this handle.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A handle to the same communicator whose operations use `timeout`.
    pub fn with_timeout(&self, timeout: Duration) -> Comm {
        Comm {
            inner: self.inner.clone(),
            timeout,
        }
    }

    /// The number of operations issued so far on this communicator by this rank.
    pub fn seq(&self) -> u64 {
        self.inner.seq.load(Ordering::Relaxed)
    }

    /// The built-in flight recorder, if enabled.
    pub fn flight_recorder(&self) -> Option<&FlightRecorder> {
        self.inner.recorder.as_ref()
    }

    /// Registers a hook run before every operation.
    pub fn register_pre_hook(&self, f: impl Fn(&OpRecord) + Send + Sync + 'static) -> HookHandle {
        self.inner.hooks.add_pre(Arc::new(f))
    }

    /// Registers a hook run after every operation was issued, with a view of its work.
    pub fn register_post_hook(
        &self,
        f: impl Fn(&OpRecord, &Arc<dyn WorkState>) + Send + Sync + 'static,
    ) -> HookHandle {
        self.inner.hooks.add_post(Arc::new(f))
    }

    /// Registers a hook run once when the communicator fails (abort, timeout, desync, peer
    /// failure). A panicking hook is caught and logged.
    pub fn register_abort_hook(
        &self,
        f: impl Fn(&CommError) + Send + Sync + 'static,
    ) -> HookHandle {
        self.inner.hooks.add_abort(Arc::new(f))
    }

    /// Fails every pending and future operation of this communicator, on every rank.
    /// Non-blocking and safe to call from any thread (a watchdog, a signal handler thread).
    pub fn abort(&self, reason: &str) {
        self.inner.backend.abort(reason);
        let ctx = self.ctx_with(OpName::Abort, self.seq());
        self.fail_once(&CommError::Aborted {
            ctx,
            reason: reason.to_string(),
        });
    }

    /// Whether the communicator has been aborted or has failed.
    pub fn is_aborted(&self) -> bool {
        self.inner.backend.is_aborted()
    }

    /// Operations issued and not yet finished on this rank.
    pub fn pending(&self) -> usize {
        self.inner.backend.pending()
    }

    /// Fires the abort hooks if `r` is a fatal error (for ops that bypass `issue`).
    pub(crate) fn observe<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if e.is_fatal() {
                self.fail_once(e);
            }
        }
        r
    }

    /// Runs the abort hooks once; returns after they have run, whichever thread runs them.
    fn fail_once(&self, err: &CommError) {
        self.inner
            .hooks
            .abort_once(err, self.timeout.max(HOOK_WAIT_FLOOR));
    }

    fn ctx_with(&self, op: OpName, seq: u64) -> OpCtx {
        OpCtx {
            op,
            comm: self.inner.name.clone(),
            rank: self.rank(),
            seq,
            timeout: self.timeout,
        }
    }

    /// Assigns the next sequence number to an `op`.
    pub(crate) fn next_ctx(&self, op: OpName) -> OpCtx {
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed) + 1;
        self.ctx_with(op, seq)
    }

    /// Checks device and dtype, and makes the tensor contiguous.
    pub(crate) fn prepare_input(&self, ctx: &OpCtx, t: &Tensor) -> Result<Tensor> {
        if !t.device().same_device(self.device()) {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "tensor is on {:?} but the communicator's backend \"{}\" runs on {:?}",
                    t.device().location(),
                    self.backend_name(),
                    self.device().location()
                ),
            ));
        }
        if !dtype_supported(t.dtype()) {
            return Err(CommError::UnsupportedDType {
                ctx: ctx.clone(),
                dtype: t.dtype(),
                reason: "collectives take f32, f64, bf16, f16, i64, u32 or u8".into(),
            });
        }
        t.contiguous().map_err(|e| CommError::candle(ctx, e))
    }

    fn check_rank(&self, ctx: &OpCtx, what: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "{what} rank {r} out of range for a communicator of size {}",
                    self.size()
                ),
            ));
        }
        Ok(())
    }

    fn check_reduce(&self, ctx: &OpCtx, op: ReduceOp, dtype: DType) -> Result<()> {
        if !reduce_supported(op, dtype) {
            return Err(CommError::UnsupportedDType {
                ctx: ctx.clone(),
                dtype,
                reason: format!("reduce op {op} is defined for floating-point dtypes only"),
            });
        }
        Ok(())
    }

    fn record(
        &self,
        ctx: &OpCtx,
        inputs: &[&Tensor],
        root: Option<usize>,
        peer: Option<usize>,
        reduce_op: Option<ReduceOp>,
    ) -> OpRecord {
        OpRecord {
            comm: ctx.comm.clone(),
            backend: self.backend_name(),
            rank: ctx.rank,
            size: self.size(),
            seq: ctx.seq,
            op: ctx.op,
            dtype: inputs.first().map(|t| t.dtype()),
            shapes: inputs.iter().map(|t| t.dims().to_vec()).collect(),
            bytes: inputs
                .iter()
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum(),
            root,
            peer,
            reduce_op,
        }
    }

    /// Common path of every Work-returning op: hooks, span, backend call, failure hooks.
    fn issue<T: Send + 'static>(
        &self,
        ctx: OpCtx,
        record: impl FnOnce(&OpCtx) -> OpRecord,
        call: impl FnOnce(OpCtx) -> Result<Work<T>>,
    ) -> Result<Work<T>> {
        let span = tracing::debug_span!(
            "comm_op",
            op = ctx.op.as_str(),
            comm = %ctx.comm,
            rank = ctx.rank,
            seq = ctx.seq
        );
        let _enter = span.enter();
        let rec = self.inner.hooks.has_op_hooks().then(|| record(&ctx));
        if let Some(r) = &rec {
            self.inner.hooks.run_pre(r);
        }
        let result = call(ctx);
        match &result {
            Ok(work) => {
                if let Some(r) = &rec {
                    self.inner.hooks.run_post(r, &work.state());
                }
                let me = self.clone();
                work.on_error(Box::new(move |e| {
                    if e.is_fatal() {
                        me.fail_once(e);
                    }
                }));
            }
            Err(e) if e.is_fatal() => self.fail_once(e),
            Err(_) => {}
        }
        result
    }

    /// Reduces `input` over all ranks with `op`; every rank receives the result.
    pub fn all_reduce(&self, input: &Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        self.dense(Dense::AllReduce(op), None, input)
    }

    /// Like [`Comm::all_reduce`], writing the result into `output` (same dtype and element
    /// count, contiguous; it may be `input` itself for an in-place all-reduce). The work returns
    /// `output`. Reusing outputs avoids allocating (and page-faulting) a buffer per call.
    pub fn all_reduce_into(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work<Tensor>> {
        self.dense(Dense::AllReduce(op), Some(output), input)
    }

    /// Starts `op` on the backend and reads its outcome back as `T`, the op's kind.
    fn run<T: FromCollectiveOutput + Send + 'static>(
        &self,
        ctx: OpCtx,
        op: Collective,
    ) -> Result<Work<T>> {
        let backend = self.inner.backend.backend_name();
        let at = ctx.clone();
        let work = self.inner.backend.collective(ctx, op)?;
        Ok(work.and_then(move |o| {
            T::from_outcome(o).map_err(|o| CommError::WrongOutcome {
                ctx: at,
                backend,
                got: o.kind(),
            })
        }))
    }

    /// The common path of the ops with one input and one output of a size the op defines
    /// (and of their `*_into` variants, which pass `output`).
    fn dense(&self, op: Dense, output: Option<&Tensor>, input: &Tensor) -> Result<Work<Tensor>> {
        let reduce = match op {
            Dense::AllReduce(r) | Dense::ReduceScatter(r) => Some(r),
            Dense::AllGather | Dense::AllToAll => None,
        };
        let ctx = self.next_ctx(match op {
            Dense::AllReduce(_) => OpName::AllReduce,
            Dense::AllGather => OpName::AllGatherSingle,
            Dense::ReduceScatter(_) => OpName::ReduceScatterSingle,
            Dense::AllToAll => OpName::AllToAllSingle,
        });
        let input = self.prepare_input(&ctx, input)?;
        if let Some(r) = reduce {
            self.check_reduce(&ctx, r, input.dtype())?;
        }
        let (n, elems) = (self.size(), input.elem_count());
        // The output's elements, whether it may be the input, whether dim 0 must divide by n.
        let (out_elems, may_alias, divisible) = match op {
            Dense::AllReduce(_) => (elems, true, false),
            Dense::AllGather => (elems * n, false, false),
            Dense::ReduceScatter(_) => (elems / n, false, true),
            Dense::AllToAll => (elems, false, true),
        };
        if divisible {
            self.check_divisible(&ctx, &input)?;
        }
        let output = self.prepare_output(&ctx, output, &input, out_elems, may_alias)?;
        self.issue(
            ctx,
            |c| self.record(c, &[&input], None, None, reduce),
            |c| {
                let input = input.clone();
                self.run(
                    c,
                    match op {
                        Dense::AllReduce(op) => Collective::AllReduce { input, op, output },
                        Dense::AllGather => Collective::AllGather { input, output },
                        Dense::ReduceScatter(op) => Collective::ReduceScatter { input, op, output },
                        Dense::AllToAll => Collective::AllToAll { input, output },
                    },
                )
            },
        )
    }

    /// Checks a caller-provided output, if any: same device and dtype as `input`, `elems`
    /// elements, contiguous, and (unless `may_alias`) not overlapping `input`.
    fn prepare_output(
        &self,
        ctx: &OpCtx,
        output: Option<&Tensor>,
        input: &Tensor,
        elems: usize,
        may_alias: bool,
    ) -> Result<Option<Tensor>> {
        let Some(output) = output else {
            return Ok(None);
        };
        if !output.device().same_device(self.device()) || output.dtype() != input.dtype() {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "output is {:?} on {:?} but the input is {:?} on {:?}",
                    output.dtype(),
                    output.device().location(),
                    input.dtype(),
                    input.device().location()
                ),
            ));
        }
        if output.elem_count() != elems {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "output shape {:?} holds {} elements but the result has {elems}",
                    output.dims(),
                    output.elem_count()
                ),
            ));
        }
        if !output.is_contiguous() {
            return Err(CommError::invalid(
                ctx,
                "the output tensor must be contiguous",
            ));
        }
        if !may_alias {
            if let (Some(a), Some(b)) = (data_addr(output), data_addr(input)) {
                let es = input.dtype().size_in_bytes();
                let (a_end, b_end) = (a + output.elem_count() * es, b + input.elem_count() * es);
                if a < b_end && b < a_end {
                    return Err(CommError::invalid(ctx, "the output overlaps the input"));
                }
            }
        }
        Ok(Some(output.clone()))
    }

    /// Concatenates every rank's `input` along dim 0 in rank order (`[d0, ..]` becomes
    /// `[size * d0, ..]`; a scalar becomes `[size]`). All ranks must pass the same shape.
    pub fn all_gather_single(&self, input: &Tensor) -> Result<Work<Tensor>> {
        self.dense(Dense::AllGather, None, input)
    }

    /// Like [`Comm::all_gather_single`], writing into `output` (`size` times the input's
    /// elements, same dtype, contiguous, not overlapping the input). The work returns `output`.
    pub fn all_gather_single_into(&self, output: &Tensor, input: &Tensor) -> Result<Work<Tensor>> {
        self.dense(Dense::AllGather, Some(output), input)
    }

    /// Reduces `input` over all ranks and gives rank r the r-th of `size` equal dim-0 chunks.
    /// `input.dim(0)` must be divisible by the communicator size.
    pub fn reduce_scatter_single(&self, input: &Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        self.dense(Dense::ReduceScatter(op), None, input)
    }

    /// Like [`Comm::reduce_scatter_single`], writing into `output` (the input's elements divided
    /// by `size`, same dtype, contiguous, not overlapping the input). The work returns `output`.
    pub fn reduce_scatter_single_into(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work<Tensor>> {
        self.dense(Dense::ReduceScatter(op), Some(output), input)
    }

    fn check_divisible(&self, ctx: &OpCtx, input: &Tensor) -> Result<()> {
        let d0 = input.dims().first().copied().unwrap_or(1);
        if input.rank() == 0 || d0 % self.size() != 0 {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "input shape {:?}: dim 0 must be divisible by the communicator size {}",
                    input.dims(),
                    self.size()
                ),
            ));
        }
        Ok(())
    }

    /// Splits `input` into `size` equal dim-0 chunks; chunk j goes to rank j, and rank r's output
    /// chunk j comes from rank j's chunk r.
    pub fn all_to_all_single(&self, input: &Tensor) -> Result<Work<Tensor>> {
        self.dense(Dense::AllToAll, None, input)
    }

    /// Like [`Comm::all_to_all_single`], writing into `output` (same element count and dtype,
    /// contiguous, not overlapping the input). The work returns `output`.
    pub fn all_to_all_single_into(&self, output: &Tensor, input: &Tensor) -> Result<Work<Tensor>> {
        self.dense(Dense::AllToAll, Some(output), input)
    }

    /// All-to-all with split sizes counted in dim-0 slices: `input_split_sizes[j]` slices go to
    /// rank j, `output_split_sizes[j]` slices come from rank j (so rank i's
    /// `input_split_sizes[j]` must equal rank j's `output_split_sizes[i]`; checked).
    pub fn all_to_all_v_single(
        &self,
        input: &Tensor,
        output_split_sizes: &[usize],
        input_split_sizes: &[usize],
    ) -> Result<Work<Tensor>> {
        let ctx = self.next_ctx(OpName::AllToAllVSingle);
        let input = self.prepare_input(&ctx, input)?;
        let d0 = if input.rank() == 0 {
            1
        } else {
            input.dim(0).unwrap_or(0)
        };
        self.check_v_splits(
            &ctx,
            output_split_sizes,
            input_split_sizes,
            d0,
            "dim-0 slices",
        )?;
        let (o, i) = (output_split_sizes.to_vec(), input_split_sizes.to_vec());
        self.issue(
            ctx,
            |c| self.record(c, &[&input], None, None, None),
            |c| {
                let op = Collective::AllToAllV {
                    input: input.clone(),
                    output_split_sizes: o,
                    input_split_sizes: i,
                };
                self.run(c, op)
            },
        )
    }

    /// [`Comm::all_to_all_v_single`] of `input`'s dim-0 rows `rows`, in that order (repeats
    /// allowed): the same result as `all_to_all_v_single(&input.index_select(rows, 0), ..)`,
    /// without building the permuted send buffer where the backend reads rows in place (the
    /// local backend on the CPU; others gather first). `input_split_sizes` counts rows of
    /// `rows`. The permutation of an MoE token dispatch fused into its exchange. The same
    /// collective as `all_to_all_v_single` (peers may call either; errors and the flight
    /// recorder name it so).
    pub fn all_to_all_v_rows(
        &self,
        input: &Tensor,
        rows: &Arc<Vec<u32>>,
        output_split_sizes: &[usize],
        input_split_sizes: &[usize],
    ) -> Result<Work<Tensor>> {
        let ctx = self.next_ctx(OpName::AllToAllVSingle);
        let input = self.prepare_input(&ctx, input)?;
        let d0 = input.dims().first().copied().ok_or_else(|| {
            CommError::invalid(
                &ctx,
                "all_to_all_v_rows takes a tensor of rows, not a scalar",
            )
        })?;
        if let Some(&bad) = rows.iter().find(|&&r| r as usize >= d0) {
            return Err(CommError::invalid(
                &ctx,
                format!("row {bad} is outside the input's {d0} rows"),
            ));
        }
        self.check_v_splits(
            &ctx,
            output_split_sizes,
            input_split_sizes,
            rows.len(),
            "rows",
        )?;
        let (o, i, rows) = (
            output_split_sizes.to_vec(),
            input_split_sizes.to_vec(),
            rows.clone(),
        );
        self.issue(
            ctx,
            |c| self.record(c, &[&input], None, None, None),
            |c| {
                let op = Collective::AllToAllVRows {
                    input: input.clone(),
                    rows,
                    output_split_sizes: o,
                    input_split_sizes: i,
                };
                self.run(c, op)
            },
        )
    }

    /// One split list entry per rank, and the input splits summing to the `have` slices sent.
    fn check_v_splits(
        &self,
        ctx: &OpCtx,
        output_split_sizes: &[usize],
        input_split_sizes: &[usize],
        have: usize,
        what: &str,
    ) -> Result<()> {
        let n = self.size();
        if output_split_sizes.len() != n || input_split_sizes.len() != n {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "split size lists must have one entry per rank ({n}); got {} output and {} input entries",
                    output_split_sizes.len(),
                    input_split_sizes.len()
                ),
            ));
        }
        let total: usize = input_split_sizes.iter().sum();
        if total != have {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "input split sizes {input_split_sizes:?} sum to {total} but the input has {have} {what}"
                ),
            ));
        }
        Ok(())
    }

    /// Every rank receives `root`'s tensor. On other ranks `tensor` gives the expected shape and
    /// dtype (checked against the root's).
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work<Tensor>> {
        let ctx = self.next_ctx(OpName::Broadcast);
        self.check_rank(&ctx, "root", root)?;
        let t = self.prepare_input(&ctx, tensor)?;
        self.issue(
            ctx,
            |c| self.record(c, &[&t], Some(root), None, None),
            |c| {
                let tensor = t.clone();
                self.run(c, Collective::Broadcast { tensor, root })
            },
        )
    }

    /// `root` receives the reduction of every rank's `input`; other ranks receive `None`.
    pub fn reduce(
        &self,
        input: &Tensor,
        root: usize,
        op: ReduceOp,
    ) -> Result<Work<Option<Tensor>>> {
        let ctx = self.next_ctx(OpName::Reduce);
        self.check_rank(&ctx, "root", root)?;
        let input = self.prepare_input(&ctx, input)?;
        self.check_reduce(&ctx, op, input.dtype())?;
        self.issue(
            ctx,
            |c| self.record(c, &[&input], Some(root), None, Some(op)),
            |c| {
                let input = input.clone();
                self.run(c, Collective::Reduce { input, root, op })
            },
        )
    }

    /// `root` receives every rank's `input` in rank order; other ranks receive `None`.
    /// Shapes may differ across ranks; dtypes may not.
    pub fn gather(&self, input: &Tensor, root: usize) -> Result<Work<Option<Vec<Tensor>>>> {
        let ctx = self.next_ctx(OpName::Gather);
        self.check_rank(&ctx, "root", root)?;
        let input = self.prepare_input(&ctx, input)?;
        self.issue(
            ctx,
            |c| self.record(c, &[&input], Some(root), None, None),
            |c| {
                let input = input.clone();
                self.run(c, Collective::Gather { input, root })
            },
        )
    }

    /// Rank r receives `inputs[r]` of `root`. `root` passes exactly `size` tensors of one dtype;
    /// the other ranks pass an empty slice.
    pub fn scatter(&self, inputs: &[Tensor], root: usize) -> Result<Work<Tensor>> {
        let ctx = self.next_ctx(OpName::Scatter);
        self.check_rank(&ctx, "root", root)?;
        let inputs = if self.rank() == root {
            if inputs.len() != self.size() {
                return Err(CommError::invalid(
                    &ctx,
                    format!(
                        "the root must pass one tensor per rank ({}); got {}",
                        self.size(),
                        inputs.len()
                    ),
                ));
            }
            let prepared = inputs
                .iter()
                .map(|t| self.prepare_input(&ctx, t))
                .collect::<Result<Vec<_>>>()?;
            if let Some(bad) = prepared.iter().find(|t| t.dtype() != prepared[0].dtype()) {
                return Err(CommError::invalid(
                    &ctx,
                    format!(
                        "scatter inputs must share one dtype; got {:?} and {:?}",
                        prepared[0].dtype(),
                        bad.dtype()
                    ),
                ));
            }
            prepared
        } else {
            if !inputs.is_empty() {
                return Err(CommError::invalid(
                    &ctx,
                    format!("only the root ({root}) passes scatter inputs"),
                ));
            }
            Vec::new()
        };
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let rec = self.record(&ctx, &refs, Some(root), None, None);
        self.issue(
            ctx,
            |_| rec,
            |c| self.run(c, Collective::Scatter { inputs, root }),
        )
    }

    /// Completes when every rank has reached the barrier.
    pub fn barrier(&self) -> Result<Work<()>> {
        let ctx = self.next_ctx(OpName::Barrier);
        self.issue(
            ctx,
            |c| self.record(c, &[], None, None, None),
            |c| self.run(c, Collective::Barrier),
        )
    }

    /// Sends `tensor` to `dst`. Sends are buffered: the work completes without waiting for the
    /// receiver, so send/recv pairs in any order cannot deadlock.
    pub fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        let ctx = self.next_ctx(OpName::Send);
        self.check_rank(&ctx, "destination", dst)?;
        let t = self.prepare_input(&ctx, tensor)?;
        let op = P2POp::Send {
            tensor: t.clone(),
            peer: dst,
        };
        let work = self.issue(
            ctx,
            |c| self.record(c, &[&t], None, Some(dst), None),
            |c| self.run(c, Collective::BatchP2p { ops: vec![op] }),
        )?;
        Ok(work.map_unit())
    }

    /// Receives a tensor of `shape` and `dtype` from `src` (matched in send order per pair).
    pub fn recv(&self, src: usize, shape: impl Into<Shape>, dtype: DType) -> Result<Work<Tensor>> {
        let ctx = self.next_ctx(OpName::Recv);
        self.check_rank(&ctx, "source", src)?;
        let shape = shape.into();
        if !dtype_supported(dtype) {
            return Err(CommError::UnsupportedDType {
                ctx,
                dtype,
                reason: "p2p takes f32, f64, bf16, f16, i64, u32 or u8".into(),
            });
        }
        let rec = OpRecord {
            shapes: vec![shape.dims().to_vec()],
            dtype: Some(dtype),
            bytes: shape.elem_count() * dtype.size_in_bytes(),
            ..self.record(&ctx, &[], None, Some(src), None)
        };
        let op = P2POp::Recv {
            peer: src,
            shape,
            dtype,
        };
        let work = self.issue(
            ctx,
            |_| rec,
            |c| self.run(c, Collective::BatchP2p { ops: vec![op] }),
        )?;
        Ok(work.map_first())
    }

    /// Runs sends and receives as one group; the output holds the received tensors in op order.
    pub fn batch_p2p(&self, ops: Vec<P2POp>) -> Result<Work<Vec<Tensor>>> {
        let ctx = self.next_ctx(OpName::BatchP2p);
        let mut prepared = Vec::with_capacity(ops.len());
        for op in ops {
            self.check_rank(&ctx, "peer", op.peer())?;
            prepared.push(match op {
                P2POp::Send { tensor, peer } => P2POp::Send {
                    tensor: self.prepare_input(&ctx, &tensor)?,
                    peer,
                },
                P2POp::Recv { peer, shape, dtype } => {
                    if !dtype_supported(dtype) {
                        return Err(CommError::UnsupportedDType {
                            ctx,
                            dtype,
                            reason: "p2p takes f32, f64, bf16, f16, i64, u32 or u8".into(),
                        });
                    }
                    P2POp::Recv { peer, shape, dtype }
                }
            });
        }
        let sends: Vec<&Tensor> = prepared
            .iter()
            .filter_map(|o| match o {
                P2POp::Send { tensor, .. } => Some(tensor),
                _ => None,
            })
            .collect();
        let rec = self.record(&ctx, &sends, None, None, None);
        self.issue(
            ctx,
            |_| rec,
            |c| self.run(c, Collective::BatchP2p { ops: prepared }),
        )
    }

    /// Splits this communicator. Collective over this communicator: every rank calls it, each
    /// passing the ranks (of this communicator) of its own new group, in the order that defines
    /// the new ranks; an empty list opts out and returns `None`.
    ///
    /// # Errors
    ///
    /// Ranks out of range or repeated, a non-empty list without the caller (reported by that
    /// rank alone; the others then time out waiting for it), or lists that disagree (a rank
    /// lists a peer that passed a different list): reported on every rank, so a split either
    /// succeeds everywhere or fails everywhere.
    ///
    /// # Blocking
    ///
    /// Waits for every rank of this communicator, bounded by the bootstrap timeout.
    pub fn split(&self, ranks: &[usize], name: &str) -> Result<Option<Comm>> {
        let ctx = self.next_ctx(OpName::Split);
        let ctx = OpCtx {
            timeout: self.inner.options.bootstrap_timeout,
            ..ctx
        };
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            self.check_rank(&ctx, "split", r)?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(CommError::invalid(
                    &ctx,
                    format!("rank {r} appears twice in split list {ranks:?}"),
                ));
            }
        }
        if !ranks.is_empty() && !seen[self.rank()] {
            return Err(CommError::invalid(
                &ctx,
                format!(
                    "split list {ranks:?} does not contain the caller (rank {}); pass an empty list to opt out",
                    self.rank()
                ),
            ));
        }
        let span =
            tracing::debug_span!("comm_split", comm = %self.name(), rank = self.rank(), new = name);
        let _e = span.enter();
        let child = self
            .inner
            .backend
            .split(ctx, ranks, name, &self.inner.options)
            .inspect_err(|e| {
                if e.is_fatal() {
                    self.fail_once(e)
                }
            })?;
        Ok(child.map(|b| Comm::from_backend(b, name, self.inner.options.clone())))
    }

    /// Rebuilds this communicator without `excluded` (ranks of this communicator), in place:
    /// collective over the other ranks, which get a new communicator of the same name with
    /// their ranks renumbered in order from 0. It works on a failed or aborted communicator
    /// (that is its point: the excluded ranks may be dead) and needs no store; this
    /// communicator is left as it is (a failed one stays failed; drop it). NCCL's
    /// `ncclCommShrink`; the excluded ranks do not call it.
    ///
    /// # Agreement
    ///
    /// Local and process backends: the callers first agree on who calls, with what (the
    /// protocol of [`Comm::agree`]), so every survivor reaches the same outcome: all get the
    /// new communicator, or all get the same error. A rank lost during the shrink (a second
    /// failure) makes every survivor report [`CommError::RanksLost`] naming it; shrinking
    /// again with it excluded too succeeds. If a member dies after the agreement, every
    /// survivor still gets the new communicator, whose first op then fails naming it. NCCL
    /// trusts the caller's list (`ncclCommShrink` cannot check it).
    ///
    /// # Errors
    ///
    /// An empty list, a rank out of range or listed twice, every rank, or the caller itself
    /// ([`CommError::InvalidArgument`] naming them): on the local and process backends on every
    /// caller (the lists go through the agreement; the wrong rank names its own mistake, the
    /// others each bad proposal), elsewhere on the calling rank. On every caller:
    /// [`CommError::ShrinkDisagree`] when they passed different lists (naming each rank's),
    /// [`CommError::RanksLost`] (also for a rank that never calls: it is silent past the
    /// bootstrap timeout). MPI: [`CommError::Unsupported`].
    ///
    /// # Blocking
    ///
    /// Until every surviving rank has called it, bounded by the bootstrap timeout per round.
    pub fn shrink(&self, excluded: &[usize]) -> Result<Comm> {
        let ctx = OpCtx {
            timeout: self.inner.options.bootstrap_timeout,
            ..self.next_ctx(OpName::Shrink)
        };
        let mut list = excluded.to_vec();
        list.sort_unstable();
        let bad = self.check_shrink_list(&ctx, excluded, &list);
        if let Some(e) = bad {
            // Backends that agree on the lists first take a bad one too, so that every caller
            // reports it (not just this rank, with its peers timing out on it).
            if !self.inner.backend.shrink_agrees_on_lists() {
                return Err(e);
            }
            tracing::warn!(comm = %self.name(), rank = self.rank(), error = %e, "shrink with a bad excluded list; the peers hear of it through the agreement");
            // This rank reports its own mistake whatever the agreed view holds.
            let _ = self
                .inner
                .backend
                .shrink(ctx, &list, self.name(), &self.inner.options);
            return Err(e);
        }
        let span = tracing::info_span!("comm_shrink", comm = %self.name(), rank = self.rank(), excluded = ?list);
        let _e = span.enter();
        let name = self.name().to_string();
        let child = self
            .inner
            .backend
            .shrink(ctx, &list, &name, &self.inner.options)?;
        tracing::info!(
            size = child.size(),
            rank = child.rank(),
            "communicator shrunk"
        );
        Ok(Comm::from_backend(child, &name, self.inner.options.clone()))
    }

    /// The first thing wrong with `excluded` (sorted: `list`) as a shrink list of this rank.
    fn check_shrink_list(
        &self,
        ctx: &OpCtx,
        excluded: &[usize],
        list: &[usize],
    ) -> Option<CommError> {
        for &r in list {
            if let Err(e) = self.check_rank(ctx, "excluded", r) {
                return Some(e);
            }
        }
        if let Some(w) = list.windows(2).find(|w| w[0] == w[1]) {
            return Some(CommError::invalid(
                ctx,
                format!(
                    "rank {} appears twice in the excluded ranks {excluded:?}",
                    w[0]
                ),
            ));
        }
        if list.is_empty() || list.len() >= self.size() {
            return Some(CommError::invalid(
                ctx,
                format!(
                    "shrink must exclude at least one rank and keep at least one; got {excluded:?} of {} ranks",
                    self.size()
                ),
            ));
        }
        if list.contains(&self.rank()) {
            return Some(CommError::invalid(
                ctx,
                format!(
                    "rank {} excludes itself ({excluded:?}); excluded ranks do not call shrink",
                    self.rank()
                ),
            ));
        }
        None
    }

    /// Fault-tolerant agreement: every live rank contributes `ok` (did its own work succeed?)
    /// and all of them return the same [`Agreement`]: `ok` when every contribution in the
    /// agreed view was `ok` and no rank was missing, and the ranks that were missing (lost, or
    /// silent past the op timeout). Works on a failed or aborted communicator (ULFM's
    /// `MPIX_Comm_agree`, with failure acknowledgement). A training step commits only when the
    /// agreement is `ok` (torchft's `should_commit`), so no survivor applies an update another
    /// one dropped. The protocol and its guarantee are in the crate's `agree` module:
    /// rotating-coordinator consensus, uniform when failures are detected accurately (closed
    /// connections are; timeouts are suspicions).
    ///
    /// # Errors
    ///
    /// [`CommError::Unsupported`] on the mpi and nccl backends.
    ///
    /// # Blocking
    ///
    /// `n + 1` message latencies among healthy ranks; a silent rank costs one op timeout.
    pub fn agree(&self, ok: bool) -> Result<Agreement> {
        let ctx = self.next_ctx(OpName::Agree);
        self.inner.backend.agree(ctx, ok)
    }

    /// Collective: allocates an RMA window of `bytes` bytes on every rank.
    ///
    /// # Errors
    ///
    /// [`CommError::Unsupported`] when the backend has no windows.
    pub fn new_window(&self, bytes: usize) -> Result<Window> {
        let ctx = self.next_ctx(OpName::NewWindow);
        let w = self.inner.backend.new_window(ctx, bytes)?;
        Ok(Window::new(w, self.clone()))
    }
}

impl Work<Vec<Tensor>> {
    fn map_unit(self) -> Work<()> {
        self.map(|_| ())
    }

    fn map_first(self) -> Work<Tensor> {
        let ctx = self.ctx().clone();
        self.and_then(move |mut v| {
            if v.is_empty() {
                Err(CommError::invalid(&ctx, "recv produced no tensor"))
            } else {
                Ok(v.swap_remove(0))
            }
        })
    }
}
