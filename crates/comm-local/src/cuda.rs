//! The local backend on CUDA tensors (cargo feature `cuda`): ranks are threads sharing one or
//! several GPUs, and collectives are candle ops on the peers' tensors (device-to-device copies,
//! reductions on the GPU).
//!
//! The slot protocol is the CPU one (`group.rs`: arrive with a descriptor, read the peers'
//! posts, depart), with the ordering CUDA needs because candle's default stream is per thread:
//! the issuer's stream, its progress thread's and every peer's progress thread's are different
//! streams. Two protocols (`order.rs`, `CDT_LOCAL_CUDA_ORDER`):
//!
//! - **events** (default), no host synchronisation:
//!   1. the issuing thread records an event on its stream when it queues the op (`issue`);
//!   2. each progress thread posts it with its input; after the arrival its stream waits on
//!      every rank's event (inputs complete), then computes;
//!   3. it records an event after its reads, the ranks exchange those in a second rendezvous
//!      (`Group::arrive_late`), and its stream waits on all of them, so nothing it does later
//!      (an `*_into` write that may alias its input, a release) precedes a peer's read;
//!   4. it records the op's final event; the caller's stream waits on it in `Work::wait`, so
//!      the caller's next use (or change) of the input or result follows every read and write;
//!   5. the rank's own tensors of the op (its input, its result, its sends and received
//!      messages) stay referenced in its [`Retirement`] until that final event has completed
//!      on the GPU, and are released there only on the caller's thread (when it queues an op
//!      or waits on one), so a free lands on the caller's stream, after the caller's own later
//!      work; a peer's input is kept by its owner, whose final event follows every read of it.
//!      A work should be waited on the thread that queued it: the waiting thread's stream is
//!      the one made to wait for the op.
//! - **sync**, the first protocol: the issuer synchronizes its stream before queuing, each
//!   progress thread synchronizes after computing, and every rank departs only when all have.
//!
//! Results are fresh tensors; an `*_into` output is written after every rank's reads, so it
//! may alias the input. Reductions run in rank order, half types in `f32`, `avg` divides once
//! at the end, as on the CPU (NaN propagation in `max`/`min` follows candle's CUDA kernels).
//! Reading a peer's tensor copies only the elements of its view (`on`), never the whole
//! storage behind a narrowed view.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use candle_core::{DType, Device, Shape, Tensor};

use super::backend::{barrier, link_size, Core, Exec};
use super::bounded;
use super::group::{Message, Post};
use super::order::CudaOrder;
use candle_dtensor_comm_core::kit::desc::{check_recv, OpDesc, ShapeRule};
use candle_dtensor_comm_core::{Collective, CollectiveOutput, Work};
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, OpName, P2POp, ReduceOp};

fn candle(ctx: &OpCtx) -> impl Fn(candle_core::Error) -> CommError + '_ {
    move |e| CommError::candle(ctx, e)
}

fn input_of<'a>(ctx: &OpCtx, posts: &'a [Post], r: usize) -> Result<&'a Tensor> {
    posts[r]
        .input
        .as_ref()
        .ok_or_else(|| CommError::invalid(ctx, format!("rank {r} posted no input")))
}

/// `t` on `dev`, without a copy when it already is (for reading). A peer's tensor is another
/// candle device (each rank thread opens its own): candle's `to_device` (like `copy`) copies
/// the whole storage behind a view, so a view smaller than its storage (a peer's chunk of a
/// reduce_scatter or all_to_all input) on the same GPU is first compacted alone
/// (`force_contiguous`: this thread's stream, which every rank thread's device on that GPU
/// shares through the primary context, so it is ordered like the copy after it). On another
/// GPU the compaction would run on this thread's stream in the peer's context, which the
/// ready events did not order: there the whole storage is copied on `dev`'s stream and the
/// view taken on the copy.
fn on(ctx: &OpCtx, t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.device().same_device(dev) {
        return Ok(t.clone());
    }
    let t = if covers_storage(t) || t.device().location() != dev.location() {
        t.clone()
    } else {
        t.force_contiguous().map_err(candle(ctx))?
    };
    t.to_device(dev).map_err(candle(ctx))
}

/// The pieces joined along dim 0 into a buffer of the result's own. candle's `cat` of one
/// piece returns that piece, which [`on`] may have passed through uncopied: the caller's input,
/// a peer's input on the same device, or a view into either (an all_to_all_v where one source
/// sends rows). A collective's result must not share a storage with an input (the CPU path
/// always builds a fresh one, and in-place writers such as `storage::fill_from` rely on it),
/// so one piece is copied.
fn cat_fresh(ctx: &OpCtx, ts: &[Tensor]) -> Result<Tensor> {
    match ts {
        [one] => one.force_contiguous().map_err(candle(ctx)),
        _ => Tensor::cat(ts, 0).map_err(candle(ctx)),
    }
}

/// Whether `t` is a contiguous view of all of its storage (so moving the storage moves only
/// `t`'s elements).
fn covers_storage(t: &Tensor) -> bool {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else {
        return false;
    };
    let len = match &cs.slice {
        S::U8(s) => s.len(),
        S::U32(s) => s.len(),
        S::I16(s) => s.len(),
        S::I32(s) => s.len(),
        S::I64(s) => s.len(),
        S::BF16(s) => s.len(),
        S::F16(s) => s.len(),
        S::F32(s) => s.len(),
        S::F64(s) => s.len(),
        #[allow(unreachable_patterns)]
        _ => return false,
    };
    layout.is_contiguous() && layout.start_offset() == 0 && t.elem_count() == len
}

/// A copy of `t` on `dev` that shares no storage with `t`.
fn own_copy(ctx: &OpCtx, t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.elem_count() == 0 {
        // Not a view of `t`: a peer's empty piece is a view of that peer's whole buffer,
        // which the result would keep alive and, as its last holder, free on this rank's
        // stream, unordered with the peer's own later use of it.
        return fresh_empty(ctx, t.shape(), t.dtype(), dev);
    }
    if t.device().same_device(dev) {
        // Exactly `t`'s elements (`copy` would clone the whole storage behind a view).
        t.force_contiguous().map_err(candle(ctx))
    } else {
        on(ctx, t, dev)
    }
}

/// A zero-element tensor of `shape` that allocates nothing (a view of `like`).
fn empty(ctx: &OpCtx, shape: &Shape, dtype: DType, like: &Tensor) -> Result<Tensor> {
    debug_assert_eq!(shape.elem_count(), 0);
    debug_assert_eq!(dtype, like.dtype());
    like.flatten_all()
        .and_then(|t| t.narrow(0, 0, 0))
        .and_then(|t| t.reshape(shape.clone()))
        .map_err(candle(ctx))
}

/// A zero-element tensor of `shape` on `dev` with a storage of its own (one element: a
/// zero-byte device allocation is refused by some drivers).
fn fresh_empty(ctx: &OpCtx, shape: &Shape, dtype: DType, dev: &Device) -> Result<Tensor> {
    debug_assert_eq!(shape.elem_count(), 0);
    Tensor::zeros(1, dtype, dev)
        .and_then(|t| t.narrow(0, 0, 0))
        .and_then(|t| t.reshape(shape.clone()))
        .map_err(candle(ctx))
}

/// `[d0, ..]` as is, a scalar as `[1]`.
fn at_least_1d(ctx: &OpCtx, t: &Tensor) -> Result<Tensor> {
    if t.rank() == 0 {
        t.reshape(1).map_err(candle(ctx))
    } else {
        Ok(t.clone())
    }
}

/// Reduces `ts` (same shape and dtype, on one device) in rank order.
fn reduce_tensors(ctx: &OpCtx, ts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let dtype = ts[0].dtype();
    let half = matches!(dtype, DType::BF16 | DType::F16);
    let up = |t: &Tensor| {
        if half {
            t.to_dtype(DType::F32)
        } else {
            Ok(t.clone())
        }
    };
    let mut acc = up(&ts[0]).map_err(candle(ctx))?;
    for t in &ts[1..] {
        let t = up(t).map_err(candle(ctx))?;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.add(&t),
            ReduceOp::Product => acc.mul(&t),
            ReduceOp::Max => acc.maximum(&t),
            ReduceOp::Min => acc.minimum(&t),
        }
        .map_err(candle(ctx))?;
    }
    if op == ReduceOp::Avg {
        let n = Tensor::new(ts.len() as f64, acc.device())
            .and_then(|n| n.to_dtype(acc.dtype()))
            .map_err(candle(ctx))?;
        acc = acc.broadcast_div(&n).map_err(candle(ctx))?;
    }
    if half {
        acc = acc.to_dtype(dtype).map_err(candle(ctx))?;
    } else if ts.len() == 1 && op != ReduceOp::Avg {
        // A world of one: the result must not share the input's storage.
        acc = acc.copy().map_err(candle(ctx))?;
    }
    Ok(acc)
}

/// Waits on the host for the work this thread queued on `dev` (the `sync` protocol), at most
/// the op's timeout: an event after that work, polled (`Device::synchronize` would wait without
/// a bound on a GPU that never finishes).
fn sync(ctx: &OpCtx, dev: &Device) -> Result<()> {
    let ev = record(ctx, dev)?;
    let mut failed = None;
    let done = bounded::poll_until(ctx.timeout, || match ev.try_is_complete() {
        Ok(done) => done,
        Err(e) => {
            failed = Some(e);
            true
        }
    });
    if let Some(e) = failed {
        return Err(driver(ctx, "waiting for the stream")(e));
    }
    if !done {
        return Err(CommError::Aborted {
            ctx: ctx.clone(),
            reason: format!(
                "the GPU did not finish this rank's queued work within {:?}",
                ctx.timeout
            ),
        });
    }
    Ok(())
}

type Event = Arc<CudaEvent>;

fn driver<'a>(ctx: &'a OpCtx, what: &'static str) -> impl Fn(DriverError) -> CommError + 'a {
    move |e| CommError::Aborted {
        ctx: ctx.clone(),
        reason: format!("CUDA error {what}: {e}"),
    }
}

/// This thread's stream on `dev` (candle's per-thread default stream).
fn stream(ctx: &OpCtx, dev: &Device) -> Result<Arc<CudaStream>> {
    match dev {
        Device::Cuda(d) => Ok(d.cuda_stream()),
        _ => Err(CommError::invalid(
            ctx,
            "the local CUDA path got a non-CUDA device",
        )),
    }
}

/// An event after the work queued so far on this thread's stream.
fn record(ctx: &OpCtx, dev: &Device) -> Result<Event> {
    stream(ctx, dev)?
        .record_event(None)
        .map(Arc::new)
        .map_err(driver(ctx, "recording an event"))
}

/// Makes this thread's stream wait (on the GPU) for each event.
fn wait_for<'a>(
    ctx: &OpCtx,
    dev: &Device,
    events: impl IntoIterator<Item = &'a Event>,
) -> Result<()> {
    let s = stream(ctx, dev)?;
    for ev in events {
        s.wait(ev)
            .map_err(driver(ctx, "making a stream wait for an event"))?;
    }
    Ok(())
}

/// Waits on the host for everything queued on every stream of `dev`'s context: the fallback
/// where an event could not be recorded or exchanged. At most the op's timeout: a GPU that has
/// not finished by then fails the op (its work is not known to be done).
fn sync_all(ctx: &OpCtx, dev: &Device) -> Result<()> {
    let r = sync_all_within(ctx, dev);
    if r.is_err() {
        // The op's tensors may still be in use on the GPU: `run` leaks them.
        UNDRAINED.with(|u| u.set(true));
    }
    r
}

fn sync_all_within(ctx: &OpCtx, dev: &Device) -> Result<()> {
    let context = stream(ctx, dev)?.context().clone();
    let (tx, rx) = std::sync::mpsc::channel();
    if !bounded::run_within(ctx.timeout, move || {
        let _ = tx.send(context.synchronize());
    }) {
        return Err(CommError::Aborted {
            ctx: ctx.clone(),
            reason: format!(
                "the GPU did not finish its queued work within {:?} (synchronizing the context)",
                ctx.timeout
            ),
        });
    }
    match rx.try_recv() {
        Ok(r) => r.map_err(driver(ctx, "synchronizing the context")),
        Err(_) => Err(CommError::Aborted {
            ctx: ctx.clone(),
            reason: "the context synchronisation gave no result".into(),
        }),
    }
}

/// The issuing thread's side of queuing an op on a CUDA rank (`Core::submit`): under `events`
/// an event after the work producing the inputs; under `sync` the stream drained.
pub(crate) fn issue(ctx: &OpCtx, dev: &Device) -> Result<Option<Event>> {
    match CudaOrder::get() {
        CudaOrder::Events => record(ctx, dev).map(Some),
        CudaOrder::Sync => sync(ctx, dev).map(|()| None),
    }
}

/// The tensors an op still references, until its final event completed.
struct Retired {
    done: Event,
    /// The context of `done` (synchronized before a communicator's remaining entries go).
    context: Arc<CudaContext>,
    /// The op's timeout: how long a host wait for `done` may take.
    timeout: std::time::Duration,
    /// Held only for their references: dropped after `done` completed.
    _keep: Vec<Tensor>,
}

/// At most this many ops' tensors wait for their final events on one rank of a communicator;
/// past it the oldest is waited for on the host (a bound on the memory held, not a normal
/// path).
const MAX_RETIRED: usize = 256;

/// One CUDA rank's retired ops, oldest first (`Core::retired`): released once their final
/// events completed, checked without waiting when the rank's caller queues an op and after
/// each wait on a work, always on a caller's thread. That matters: a release frees memory on
/// the releasing thread's stream (cudarc frees with `cuMemFreeAsync` on candle's per-thread
/// stream), and only the caller's stream is ordered after the caller's own later work on a
/// result or an input whose last reference it has since dropped; the pool may hand memory
/// freed on an idle progress stream to the next allocation at once. The entries hold this
/// rank's own tensors only (its input, its result, its sends and the messages it received):
/// a peer's input is kept by that peer, whose final event follows every rank's reads of it.
/// Whatever remains when the communicator goes is released after its contexts synchronized.
/// Every host wait here is bounded by the op's timeout (`bounded`); past it the entry's tensors
/// are leaked rather than freed while the GPU may still use them.
#[derive(Default)]
pub(crate) struct Retirement(Mutex<VecDeque<Retired>>);

impl Retirement {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Retired>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, r: Retired) {
        self.lock().push_back(r);
    }

    /// Releases the ops whose final events completed (no waiting), and waits for the oldest
    /// while more than [`MAX_RETIRED`] are held. The lock is not held during that wait: the
    /// progress thread pushes the next op's entry meanwhile.
    fn reap(&self) {
        loop {
            let mut q = self.lock();
            let Some(front) = q.front() else {
                return;
            };
            // A GPU in error completes nothing; its tensors are released (waiting would
            // return the error at once).
            if front.done.try_is_complete().unwrap_or(true) {
                q.pop_front();
                continue;
            }
            if q.len() <= MAX_RETIRED {
                return;
            }
            let (ev, limit) = (front.done.clone(), front.timeout);
            drop(q);
            let completed = bounded::poll_until(limit, || ev.try_is_complete().unwrap_or(true));
            let mut q = self.lock();
            // Another caller thread may have reaped it meanwhile.
            if !q.front().is_some_and(|f| Arc::ptr_eq(&f.done, &ev)) {
                continue;
            }
            if completed {
                q.pop_front();
            } else {
                tracing::error!(
                    held = q.len(),
                    limit = ?limit,
                    "a retired op's final event did not complete in time: its tensors are \
                     leaked, not released"
                );
                std::mem::forget(q.pop_front());
            }
        }
    }
}

impl Drop for Retirement {
    fn drop(&mut self) {
        let q = std::mem::take(self.0.get_mut().unwrap_or_else(|e| e.into_inner()));
        // Whichever thread drops the communicator releases these: every stream of their
        // contexts (the callers' included) is drained first. A failed synchronisation leaves
        // a GPU in error; the tensors are released either way.
        if q.is_empty() {
            return;
        }
        let mut contexts: Vec<Arc<CudaContext>> = Vec::new();
        for r in &q {
            if !contexts.iter().any(|c| Arc::ptr_eq(c, &r.context)) {
                contexts.push(r.context.clone());
            }
        }
        let limit = q.iter().map(|r| r.timeout).max().unwrap_or_default();
        let drained = bounded::run_within(limit, move || {
            for c in &contexts {
                let _ = c.synchronize();
            }
        });
        if drained {
            drop(q);
        } else {
            tracing::error!(
                held = q.len(),
                limit = ?limit,
                "the GPU did not drain when a communicator went: its ops' tensors are leaked, \
                 not released"
            );
            std::mem::forget(q);
        }
    }
}

thread_local! {
    /// The tensors of the op running on this progress thread (`exchange`, `batch_p2p`).
    static TOUCHED: RefCell<Vec<Tensor>> = const { RefCell::new(Vec::new()) };
    /// A host drain (`sync_all`) of the op running on this progress thread failed or timed out,
    /// or a peer failed between the two exchanges (`exchange`): what was to complete may still
    /// run on the GPU, or a peer may still read this rank's input, so the op's tensors are
    /// leaked rather than retired (a retirement's final event does not cover a peer's reads).
    static UNDRAINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Keeps `t` referenced until the running op's final event completes.
fn touch(t: &Tensor) {
    TOUCHED.with(|k| k.borrow_mut().push(t.clone()));
}

fn touch_posts(posts: &[Post]) {
    for p in posts {
        if let Some(t) = &p.input {
            touch(t);
        }
        for t in &p.inputs {
            touch(t);
        }
    }
}

/// The protocol every CUDA collective follows (see the module docs): post, arrive, compute
/// from the posts on this rank's stream, and leave so that no rank's later use of an input
/// precedes a peer's read of it. `dev` is this rank's device.
fn exchange<R>(
    e: &Exec,
    dev: &Device,
    desc: OpDesc,
    post: Post,
    compute: impl FnOnce(&[Post]) -> Result<R>,
) -> Result<R> {
    if CudaOrder::get() == CudaOrder::Sync {
        let posts = e.arrive(desc, post)?;
        let out = compute(&posts).and_then(|r| sync(e.ctx, dev).map(|()| r));
        drop(posts);
        let departed = e.depart(true);
        let out = out?;
        departed?;
        return Ok(out);
    }
    let ctx = e.ctx;
    let post = Post {
        ready: e.ready.clone(),
        ..post
    };
    let posts = e.arrive(desc, post)?;
    // This rank's own post only: each peer keeps its own (see `Retirement`).
    touch_posts(posts.get(e.rank..=e.rank).unwrap_or_default());
    let out = wait_for(ctx, dev, posts.iter().filter_map(|p| p.ready.as_ref()))
        .and_then(|()| compute(&posts));
    drop(posts);
    // This rank's reads of its peers' inputs are done after `read`; where it cannot be
    // recorded, they are made complete on the host instead (and no event is posted).
    let read = match record(ctx, dev) {
        Ok(ev) => Ok(Some(ev)),
        Err(err) => sync_all(ctx, dev).and(Err(err)),
    };
    let late = e.group.arrive_late(
        ctx,
        e.coll,
        e.rank,
        Post {
            ready: read.as_ref().ok().cloned().flatten(),
            ..Post::default()
        },
        e.deadline,
    );
    let waited = match &late {
        Ok(reads) => wait_for(ctx, dev, reads.iter().filter_map(|p| p.ready.as_ref())),
        // A peer failed or timed out between the two exchanges: its reads are not ordered
        // by an event; every stream of the context is drained instead. That covers only the
        // reads already queued in this context: a slower peer may still queue its reads of
        // this rank's input (or, on another GPU, run them in its own context), so the op's
        // tensors are leaked rather than released (`run`).
        Err(_) => {
            UNDRAINED.with(|u| u.set(true));
            sync_all(ctx, dev)
        }
    };
    let departed = e.depart(false);
    let out = out?;
    read?;
    late?;
    waited?;
    departed?;
    Ok(out)
}

/// `t` posted for the peers to read, detached from candle's autograd graph: a peer's result
/// built from it (a copy, a sum, a `cat`) would otherwise record an op on it and so hold this
/// rank's tensor and everything behind it in this rank's graph, and its last handle could then
/// go on the peer's thread, freeing this rank's memory on the peer's stream. (The CPU path's
/// results are detached copies too.)
fn post(t: &Tensor) -> Post {
    Post {
        input: Some(t.detach()),
        ..Post::default()
    }
}

/// Writes `result` into the caller's `output` (after the departure, so it may alias the input).
fn deliver(ctx: &OpCtx, result: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let Some(out) = output else {
        return Ok(result);
    };
    if out.elem_count() != result.elem_count() || out.dtype() != result.dtype() {
        return Err(CommError::invalid(
            ctx,
            format!(
                "output is {:?} {:?} but the result is {:?} {:?}",
                out.dims(),
                out.dtype(),
                result.dims(),
                result.dtype()
            ),
        ));
    }
    if out.elem_count() > 0 {
        // Both flattened: `slice_set` needs a dim 0, which a scalar (a loss, a grad norm) lacks.
        // The front checked that `out` is contiguous, so its flattened view shares its storage.
        let dst = out.flatten_all().map_err(candle(ctx))?;
        let src = result.flatten_all().map_err(candle(ctx))?;
        dst.slice_set(&src, 0, 0).map_err(candle(ctx))?;
        if CudaOrder::get() == CudaOrder::Sync {
            sync(ctx, out.device())?;
        }
    }
    Ok(out)
}

/// Queues collective `op` on a CUDA rank (`LocalBackend::collective`): the progress thread
/// runs it, and waiting on the work makes the waiting thread's stream wait for the op's final
/// event (under `events`).
pub(crate) fn submit(core: &Core, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>> {
    let device = core.device().clone();
    let bytes = link_size(&op, core.group.size());
    let collective = !matches!(op, Collective::BatchP2p { .. });
    // On the caller's thread (see `Retirement`): what earlier ops left, once complete.
    core.retired.reap();
    let (dev, retired) = (device.clone(), core.retired.clone());
    let body = move |e: &Exec| run(e, op, &dev, &retired);
    let work = match bytes {
        Some(b) => core.submit_paced(ctx.clone(), b, body)?,
        None => core.submit(ctx.clone(), collective, body)?,
    };
    let retired = core.retired.clone();
    Ok(work.and_then(move |(out, done)| {
        if let Some(done) = done {
            wait_for(&ctx, &device, [&done])?;
        }
        retired.reap();
        Ok(out)
    }))
}

/// The tensors of a result, kept with the op until its final event completed.
fn output_tensors(out: &CollectiveOutput) -> Vec<Tensor> {
    match out {
        CollectiveOutput::Tensor(t) | CollectiveOutput::Rooted(Some(t)) => vec![t.clone()],
        CollectiveOutput::Gathered(Some(ts)) | CollectiveOutput::Received(ts) => ts.clone(),
        CollectiveOutput::Rooted(None)
        | CollectiveOutput::Gathered(None)
        | CollectiveOutput::Done => Vec::new(),
    }
}

/// Runs `op` on the progress thread; under `events` also returns the op's final event on this
/// thread's stream, and keeps every tensor it touched referenced until that event completed.
fn run(
    e: &Exec,
    op: Collective,
    dev: &Device,
    retired: &Retirement,
) -> Result<(CollectiveOutput, Option<Event>)> {
    if CudaOrder::get() == CudaOrder::Sync {
        return run_op(e, op, dev).map(|o| (o, None));
    }
    TOUCHED.with(|k| k.borrow_mut().clear());
    // The op's own tensors (an `*_into` output, a send) are the issuer's: every path uses
    // them after this wait. (A failure here is a GPU in error; the op still runs, so that the
    // peers fail with it rather than wait for this rank.)
    let ready = wait_for(e.ctx, dev, e.ready.iter());
    UNDRAINED.with(|u| u.set(false));
    let out = run_op(e, op, dev).and_then(|o| ready.map(|()| o));
    let mut keep = TOUCHED.with(|k| std::mem::take(&mut *k.borrow_mut()));
    if let Ok(o) = &out {
        keep.extend(output_tensors(o));
    }
    if UNDRAINED.with(|u| u.replace(false)) {
        // Nothing says the GPU, or every peer, is done with these.
        tracing::error!(rank = e.rank, op = ?e.ctx.op, "the op's tensors may still be in use on the GPU; leaked, not released");
        std::mem::forget(keep);
        return out.map(|o| (o, None));
    }
    match record(e.ctx, dev).and_then(|done| Ok((done, stream(e.ctx, dev)?))) {
        Ok((done, s)) => {
            if out.is_err() {
                // A failed op gives its caller no event to wait for, and the caller may write
                // its input at once, while the peers (which may have succeeded) still read it:
                // `done` follows their reads, so the host waits for it (bounded) first.
                let ev = done.clone();
                if !bounded::poll_until(e.ctx.timeout, || ev.try_is_complete().unwrap_or(true)) {
                    tracing::error!(rank = e.rank, op = ?e.ctx.op, "a failed op's final event did not complete in time; its tensors are leaked, not released");
                    std::mem::forget(keep);
                    return out.map(|o| (o, None));
                }
            }
            retired.push(Retired {
                done: done.clone(),
                context: s.context().clone(),
                timeout: e.ctx.timeout,
                _keep: keep,
            });
            out.map(|o| (o, Some(done)))
        }
        Err(err) => {
            // No final event: finish everything on the host before releasing anything; the
            // caller then has nothing to wait for.
            tracing::warn!(rank = e.rank, op = ?e.ctx.op, error = %err, "no final event; drained the GPU");
            let drained = sync_all(e.ctx, dev);
            if drained.is_ok() {
                drop(keep);
            } else {
                // Not known to be done on the GPU: leaked, never freed under it.
                UNDRAINED.with(|u| u.set(false));
                std::mem::forget(keep);
            }
            let o = out?;
            drained?;
            Ok((o, None))
        }
    }
}

/// Runs `op` on CUDA tensors (`AllToAllVRows` normally arrives gathered: the backend gathers
/// the rows on the GPU before queuing the exchange).
fn run_op(e: &Exec, op: Collective, dev: &Device) -> Result<CollectiveOutput> {
    Ok(match op {
        Collective::AllReduce { input, op, output } => all_reduce(e, input, op, output)?.into(),
        Collective::AllGather { input, output } => all_gather(e, input, output)?.into(),
        Collective::ReduceScatter { input, op, output } => {
            reduce_scatter(e, input, op, output)?.into()
        }
        Collective::AllToAll { input, output } => all_to_all(e, input, output)?.into(),
        Collective::AllToAllV {
            input,
            output_split_sizes: o,
            input_split_sizes: i,
        } => all_to_all_v(e, input, o, i)?.into(),
        rows @ Collective::AllToAllVRows { .. } => return run_op(e, rows.gather_rows(e.ctx)?, dev),
        Collective::Broadcast { tensor, root } => broadcast(e, tensor, root)?.into(),
        Collective::Reduce { input, root, op } => reduce(e, input, root, op)?.into(),
        Collective::Gather { input, root } => gather(e, input, root)?.into(),
        Collective::Scatter { inputs, root } => scatter(e, inputs, root, dev)?.into(),
        Collective::Barrier => barrier(e)?.into(),
        Collective::BatchP2p { ops } => batch_p2p(e, ops, dev)?.into(),
    })
}

pub(crate) fn all_reduce(
    e: &Exec,
    input: Tensor,
    op: ReduceOp,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let desc = OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::AllReduce, &input)
    };
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            return empty(ctx, input.shape(), input.dtype(), &input);
        }
        let ts = (0..posts.len())
            .map(|r| on(ctx, input_of(ctx, posts, r)?, &dev))
            .collect::<Result<Vec<_>>>()?;
        reduce_tensors(ctx, &ts, op)
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn all_gather(e: &Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let n = e.group.size();
    let mut dims = input.dims().to_vec();
    match dims.first_mut() {
        Some(d0) => *d0 *= n,
        None => dims.push(n),
    }
    let desc = OpDesc::tensor(OpName::AllGatherSingle, &input);
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            return empty(ctx, &Shape::from_dims(&dims), input.dtype(), &input);
        }
        let ts = (0..n)
            .map(|r| on(ctx, &at_least_1d(ctx, input_of(ctx, posts, r)?)?, &dev))
            .collect::<Result<Vec<_>>>()?;
        cat_fresh(ctx, &ts)
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn reduce_scatter(
    e: &Exec,
    input: Tensor,
    op: ReduceOp,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let n = e.group.size();
    let rank = e.rank;
    let chunk = input.dims()[0] / n;
    let desc = OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::ReduceScatterSingle, &input)
    };
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            let mut dims = input.dims().to_vec();
            dims[0] = chunk;
            return empty(ctx, &Shape::from_dims(&dims), input.dtype(), &input);
        }
        let ts = (0..n)
            .map(|r| {
                let t = input_of(ctx, posts, r)?
                    .narrow(0, rank * chunk, chunk)
                    .map_err(candle(ctx))?;
                on(ctx, &t, &dev)
            })
            .collect::<Result<Vec<_>>>()?;
        reduce_tensors(ctx, &ts, op)
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn all_to_all(e: &Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let n = e.group.size();
    let rank = e.rank;
    let chunk = input.dims()[0] / n;
    let desc = OpDesc::tensor(OpName::AllToAllSingle, &input);
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            return empty(ctx, input.shape(), input.dtype(), &input);
        }
        let ts = (0..n)
            .map(|j| {
                let t = input_of(ctx, posts, j)?
                    .narrow(0, rank * chunk, chunk)
                    .map_err(candle(ctx))?;
                on(ctx, &t, &dev)
            })
            .collect::<Result<Vec<_>>>()?;
        cat_fresh(ctx, &ts)
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn all_to_all_v(
    e: &Exec,
    input: Tensor,
    out_splits: Vec<usize>,
    in_splits: Vec<usize>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let input = at_least_1d(ctx, &input)?;
    let rows: Vec<usize> = input.dims().iter().skip(1).copied().collect();
    let desc = OpDesc {
        rule: ShapeRule::Rows,
        ..OpDesc::tensor(OpName::AllToAllVSingle, &input)
    };
    let p = Post {
        input: Some(input.detach()),
        splits: Some((out_splits.clone(), in_splits)),
        ..Post::default()
    };
    let total: usize = out_splits.iter().sum();
    let mut out_dims = vec![total];
    out_dims.extend(rows);
    exchange(e, &dev, desc, p, |posts| {
        e.group.check_split_sizes(ctx, e.coll, posts)?;
        let shape = Shape::from_dims(&out_dims);
        if shape.elem_count() == 0 {
            return empty(ctx, &shape, input.dtype(), &input);
        }
        let mut ts = Vec::new();
        for (j, p) in posts.iter().enumerate() {
            let len = out_splits[j];
            if len == 0 {
                continue;
            }
            let splits = p.splits.as_ref().map(|s| &s.1[..]).unwrap_or(&[]);
            let start: usize = splits[..e.rank].iter().sum();
            let t = input_of(ctx, posts, j)?
                .narrow(0, start, len)
                .map_err(candle(ctx))?;
            ts.push(on(ctx, &t, &dev)?);
        }
        cat_fresh(ctx, &ts)
    })
}

pub(crate) fn broadcast(e: &Exec, tensor: Tensor, root: usize) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = tensor.device().clone();
    let desc = OpDesc {
        root: Some(root),
        ..OpDesc::tensor(OpName::Broadcast, &tensor)
    };
    let mine = if e.rank == root {
        post(&tensor)
    } else {
        Post::default()
    };
    let is_root = e.rank == root;
    exchange(e, &dev, desc, mine, |posts| {
        if is_root {
            return Ok(tensor.clone());
        }
        own_copy(ctx, input_of(ctx, posts, root)?, &dev)
    })
}

pub(crate) fn reduce(e: &Exec, input: Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let desc = OpDesc {
        root: Some(root),
        reduce: Some(op),
        ..OpDesc::tensor(OpName::Reduce, &input)
    };
    let is_root = e.rank == root;
    exchange(e, &dev, desc, post(&input), |posts| {
        if !is_root {
            return Ok(None);
        }
        if input.elem_count() == 0 {
            return empty(ctx, input.shape(), input.dtype(), &input).map(Some);
        }
        let ts = (0..posts.len())
            .map(|r| on(ctx, input_of(ctx, posts, r)?, &dev))
            .collect::<Result<Vec<_>>>()?;
        reduce_tensors(ctx, &ts, op).map(Some)
    })
}

pub(crate) fn gather(e: &Exec, input: Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let desc = OpDesc {
        root: Some(root),
        rule: ShapeRule::Any,
        ..OpDesc::tensor(OpName::Gather, &input)
    };
    let is_root = e.rank == root;
    exchange(e, &dev, desc, post(&input), |posts| {
        if !is_root {
            return Ok(None);
        }
        (0..posts.len())
            .map(|r| own_copy(ctx, input_of(ctx, posts, r)?, &dev))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    })
}

pub(crate) fn scatter(e: &Exec, inputs: Vec<Tensor>, root: usize, dev: &Device) -> Result<Tensor> {
    let ctx = e.ctx;
    let desc = OpDesc {
        root: Some(root),
        ..OpDesc::new(OpName::Scatter)
    };
    let mine = if e.rank == root {
        Post {
            // Detached, as `post` does.
            inputs: inputs.iter().map(Tensor::detach).collect(),
            ..Post::default()
        }
    } else {
        Post::default()
    };
    let rank = e.rank;
    exchange(e, dev, desc, mine, |posts| {
        let src = posts[root].inputs.get(rank).ok_or_else(|| {
            CommError::invalid(ctx, format!("root {root} posted no piece for rank {rank}"))
        })?;
        own_copy(ctx, src, dev)
    })
}

pub(crate) fn batch_p2p(e: &Exec, ops: Vec<P2POp>, dev: &Device) -> Result<Vec<Tensor>> {
    let ctx = e.ctx;
    if let Some(f) = e.group.failure() {
        return Err(f.to_error(ctx, None));
    }
    let events = CudaOrder::get() == CudaOrder::Events;
    // Sends are detached copies (the sender never waits), complete before they are read:
    // under `events` the receiver's stream waits for `ready`, else the copies are finished
    // before they are posted.
    let mut sends = Vec::new();
    for op in &ops {
        if let P2POp::Send { tensor, peer } = op {
            // Detached, as `post` does: the receiver's copy must not hold the sender's graph.
            let copy = own_copy(ctx, &tensor.detach(), tensor.device())?;
            if events {
                touch(tensor);
                touch(&copy);
            }
            sends.push((*peer, copy));
        }
    }
    let ready = match (sends.is_empty(), events) {
        (true, _) => None,
        (false, true) => Some(record(ctx, dev)?),
        (false, false) => {
            sync(ctx, dev)?;
            None
        }
    };
    for (peer, copy) in sends {
        let mut m = Message::new(copy);
        m.ready = ready.clone();
        e.group.post_message(e.rank, peer, m);
    }
    let mut received = Vec::new();
    for op in ops {
        if let P2POp::Recv { peer, shape, dtype } = op {
            let m = e.group.take_message(ctx, peer, e.rank, e.deadline)?;
            check_recv(
                peer,
                (shape.dims(), dtype),
                (m.tensor.dims(), m.tensor.dtype()),
            )
            .map_err(|e| CommError::invalid(ctx, e))?;
            if let Some(r) = &m.ready {
                wait_for(ctx, dev, [r])?;
            }
            if events {
                touch(&m.tensor);
            }
            // The message is a detached copy nobody else holds: moved, not copied, when it is
            // already on this device.
            received.push(on(ctx, &m.tensor, dev)?);
        }
    }
    if !events && !received.is_empty() {
        sync(ctx, dev)?;
    }
    Ok(received)
}
