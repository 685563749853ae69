//! The device-independent core of one NCCL communicator: issuing grouped calls on the comm
//! stream, polling nonblocking calls, tracking in-flight work with start/end events, the
//! watchdog, abort and teardown.
//!
//! It talks to NCCL through [`NcclApi`] and to the GPU through [`Streams`] / [`Event`], so all of
//! it runs in unit tests with the mock library and fake events (`mock.rs`).
//!
//! # Threads and the NCCL thread-safety contract
//!
//! Every NCCL call on a communicator is made while holding its *issue lock* (`Core::state`):
//! by the thread issuing an operation, by the watchdog (async-error polling, abort, teardown)
//! or by split / window creation. NCCL requires that calls on one communicator are not made
//! concurrently; the lock is what makes `Core` (and the raw `ncclComm_t` inside) `Send + Sync`.
//! The issue path holds the lock only while enqueuing (NCCL calls on a nonblocking communicator
//! return at once; the remaining wait is our own polling loop, which checks the abort flag).
//!
//! # Work
//!
//! An operation is enqueued on the communicator's own stream after an event recorded on the
//! caller's stream (so it sees everything the caller enqueued before), between a `start` and an
//! `end` event. Its [`Work`] gets the output at once ([`WorkCompleter::publish`]): `wait()` then
//! only makes the caller's stream wait on `end` (stream-ordered, no CPU block, as in torchcomms).
//! The watchdog thread polls the events: `end` complete finishes the work (status `Completed`)
//! and releases the tensors the operation reads or writes (kept alive until then); a work whose
//! `start` completed more than its timeout ago without its `end` fails with
//! [`CommError::Timeout`], which fires the communicator's abort hooks (the flight-recorder dump)
//! and aborts the communicator. The watchdog also polls `ncclCommGetAsyncError` (a peer that
//! died shows up there as `ncclRemoteError` or `ncclSystemError`).
//!
//! # Abort
//!
//! [`Core::abort`] never blocks: it records the failure, fails every pending work on the CPU side
//! and asks the watchdog to call `ncclCommRevoke` (NCCL >= 2.28.7) and `ncclCommAbort`. Tensors
//! of failed work stay alive until their events complete (an aborted communicator's kernels
//! exit), so no memory is freed under a running kernel.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::api::{Call, NcclApi, NcclCode, RawComm, RawStream, SHRINK_ABORT, SHRINK_DEFAULT};
use super::config::ConfigSpec;
use super::version::Gates;
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{Work, WorkCompleter};

/// How long shutdown waits for the events of failed work before leaking its tensors.
const ZOMBIE_GRACE: Duration = Duration::from_secs(10);
/// The watchdog's period while work is in flight.
const BUSY_TICK: Duration = Duration::from_millis(2);
/// The watchdog's period while idle (async-error polling only).
const IDLE_TICK: Duration = Duration::from_millis(200);

/// A recorded point on a stream.
pub trait Event: Send + Sync + 'static {
    /// Whether the work recorded before it has finished (`cuEventQuery`).
    ///
    /// # Errors
    ///
    /// A CUDA error (the context is broken).
    fn query(&self) -> std::result::Result<bool, String>;
    /// For downcasting to the real event type.
    fn as_any(&self) -> &dyn Any;
}

/// The streams of one communicator: its own stream, and the calling thread's current stream.
pub trait Streams: Send + Sync + 'static {
    /// Makes the device's context current on the calling thread (NCCL and CUDA calls need it).
    ///
    /// # Errors
    ///
    /// A CUDA error.
    fn bind(&self) -> std::result::Result<(), String>;
    /// The communicator's stream, as NCCL takes it.
    fn comm_stream(&self) -> RawStream;
    /// Orders the communicator's stream after everything the calling thread has enqueued.
    ///
    /// # Errors
    ///
    /// A CUDA error.
    fn comm_after_caller(&self) -> std::result::Result<(), String>;
    /// Records an event on the communicator's stream.
    ///
    /// # Errors
    ///
    /// A CUDA error.
    fn record(&self) -> std::result::Result<Arc<dyn Event>, String>;
    /// Orders the calling thread's stream after `event`.
    ///
    /// # Errors
    ///
    /// A CUDA error.
    fn caller_after(&self, event: &dyn Event) -> std::result::Result<(), String>;
    /// Hands the device memory that the allocator keeps cached but unused back to the driver.
    /// Called before NCCL creates a communicator (init, split, shrink), whose buffers NCCL
    /// allocates outside that cache: a pool that keeps what a training step freed
    /// (`kernels::storage::retain_freed_memory`) could otherwise leave too little for a
    /// communicator made mid-run, such as the one a shrink after a lost replica makes.
    ///
    /// # Errors
    ///
    /// A CUDA error (the caller logs it and goes on: NCCL may still find the memory).
    fn release_cached_memory(&self) -> std::result::Result<(), String>;
}

/// [`Streams::release_cached_memory`] before a communicator is made; a failure is logged, not
/// returned (NCCL may still find the memory it needs).
fn release_before_new_comm(streams: &dyn Streams, comm: &str, rank: usize) {
    if let Err(e) = streams.release_cached_memory() {
        tracing::warn!(comm, rank, error = %e, "could not release cached device memory before creating a communicator");
    }
}

/// How a work reports its output.
pub enum Delivery<T> {
    /// Stream-ordered: `wait()` returns the output at once (collectives, p2p).
    Published(T),
    /// Host-blocking: `wait()` returns `T` once the device finished (barrier, and the small
    /// exchanges whose results the host reads).
    Blocking(T),
}

type Finish = Box<dyn FnOnce(Result<()>) + Send>;
type OnStart = Box<dyn FnOnce() + Send>;

/// One operation in flight on the communicator's stream.
struct Pending {
    ctx: OpCtx,
    start: Arc<dyn Event>,
    end: Arc<dyn Event>,
    /// When the watchdog first saw `start` complete: the timeout clock starts there.
    started: Option<Instant>,
    on_start: Option<OnStart>,
    /// Reports the outcome; `None` once reported (a failed work waiting for its events).
    finish: Option<Finish>,
    /// Buffers the operation reads or writes, released (dropped) when `end` completes.
    _keep: Box<dyn Any + Send>,
}

/// The issue lock's contents.
pub(crate) struct CommState {
    /// The raw communicator.
    pub raw: RawComm,
    /// Aborted or destroyed: no NCCL call may use `raw` any more.
    pub torn_down: bool,
    /// `ncclCommRevoke` was called (a failed communicator kept for a shrink).
    pub revoked: bool,
}

/// The outcome of polling a nonblocking call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// The communicator left `ncclInProgress` with success.
    Ok,
    /// It left it with an error.
    Failed(NcclCode),
    /// The deadline passed first.
    TimedOut,
    /// Someone asked for an abort meanwhile.
    AbortRequested,
}

/// Polls `ncclCommGetAsyncError` on `comm` until it leaves `ncclInProgress`, `deadline` passes
/// or `abort` is set. Backs off from 10 µs to 1 ms (a collective's enqueue takes microseconds,
/// an init seconds).
pub fn wait_ready(
    api: &dyn NcclApi,
    comm: RawComm,
    deadline: Instant,
    abort: Option<&AtomicBool>,
) -> Ready {
    let mut nap = Duration::from_micros(10);
    loop {
        let state = api.async_error(comm);
        if state.is_success() {
            return Ready::Ok;
        }
        if state != NcclCode::IN_PROGRESS {
            return Ready::Failed(state);
        }
        if abort.is_some_and(|a| a.load(Ordering::Acquire)) {
            return Ready::AbortRequested;
        }
        let now = Instant::now();
        if now >= deadline {
            return Ready::TimedOut;
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

/// Waits until NCCL has written a handle into `out` (nonblocking init and split fill it in
/// asynchronously on some versions, NVIDIA/nccl#1472).
pub fn wait_handle(out: &AtomicUsize, deadline: Instant) -> Option<RawComm> {
    loop {
        let v = out.load(Ordering::Acquire);
        if v != 0 {
            return Some(RawComm(v));
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `ncclGetLastError` appended to a message, when NCCL has something to say.
pub fn detail(api: &dyn NcclApi, comm: RawComm) -> String {
    let e = api.last_error(comm);
    if e.trim().is_empty() {
        String::new()
    } else {
        format!(" ({})", e.trim())
    }
}

/// Creates a communicator with nonblocking `ncclCommInitRankConfig`, polled under
/// `ctx.timeout` (the bootstrap timeout). `missing` names the ranks that have not joined, for
/// the timeout error (from the store; empty when unknown).
///
/// # Errors
///
/// [`CommError::Bootstrap`] naming the rank and the NCCL code; [`CommError::Timeout`] naming
/// the ranks that never joined and how long this rank waited (the half-made communicator is
/// aborted).
pub fn init_comm(
    api: &dyn NcclApi,
    streams: &dyn Streams,
    args: &InitArgs<'_>,
    missing: &dyn Fn() -> Vec<usize>,
) -> Result<RawComm> {
    let InitArgs {
        id,
        rank,
        size,
        spec,
        ctx,
    } = *args;
    let boot = |reason: String| CommError::Bootstrap {
        comm: ctx.comm.to_string(),
        reason: format!("rank {rank}: {reason}"),
    };
    streams.bind().map_err(|e| boot(format!("CUDA: {e}")))?;
    release_before_new_comm(streams, &ctx.comm, rank);
    let deadline = Instant::now() + ctx.timeout;
    // Boxed and leaked on the timeout paths: NCCL may still write the handle after we gave up.
    let out = Box::new(AtomicUsize::new(0));
    let config = spec.raw();
    let code = api.init_rank(&out, size as i32, id, rank as i32, &config);
    if !code.is_success() && code != NcclCode::IN_PROGRESS {
        let raw = RawComm(out.load(Ordering::Acquire));
        let why = detail(api, raw);
        if !raw.is_null() {
            api.abort(raw);
        }
        return Err(boot(format!(
            "ncclCommInitRankConfig({size} ranks) failed: {code}{why}"
        )));
    }
    let timed_out = |raw: Option<RawComm>| {
        if let Some(raw) = raw {
            api.abort(raw);
        }
        CommError::Timeout {
            ctx: ctx.clone(),
            timeout: ctx.timeout,
            missing: missing(),
        }
    };
    let Some(raw) = wait_handle(&out, deadline) else {
        Box::leak(out);
        return Err(timed_out(None));
    };
    match wait_ready(api, raw, deadline, None) {
        Ready::Ok => {}
        Ready::TimedOut | Ready::AbortRequested => return Err(timed_out(Some(raw))),
        Ready::Failed(c) => {
            let why = detail(api, raw);
            api.abort(raw);
            return Err(boot(format!(
                "ncclCommInitRankConfig({size} ranks) failed: {c}{why}"
            )));
        }
    }
    check_shape(api, raw, rank, size).map_err(|e| {
        api.abort(raw);
        boot(e)
    })?;
    Ok(raw)
}

/// The arguments of [`init_comm`].
#[derive(Clone, Copy)]
pub struct InitArgs<'a> {
    /// The unique id every rank got from rank 0.
    pub id: &'a super::api::UniqueId,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The configuration (must outlive the call).
    pub spec: &'a ConfigSpec,
    /// The `new_comm` context, with the bootstrap timeout.
    pub ctx: &'a OpCtx,
}

/// Who a communicator is: name, rank, size and its bootstrap timeout.
#[derive(Debug, Clone)]
pub struct Ident {
    /// The communicator's name.
    pub name: Arc<str>,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The bootstrap timeout (split, windows, teardown).
    pub bootstrap_timeout: Duration,
}

/// Checks that NCCL agrees on this rank's rank and size.
fn check_shape(
    api: &dyn NcclApi,
    raw: RawComm,
    rank: usize,
    size: usize,
) -> std::result::Result<(), String> {
    let n = api
        .count(raw)
        .map_err(|c| format!("ncclCommCount failed: {c}"))?;
    let r = api
        .user_rank(raw)
        .map_err(|c| format!("ncclCommUserRank failed: {c}"))?;
    if n as usize != size || r as usize != rank {
        return Err(format!(
            "NCCL made this rank {r} of {n}, but it should be rank {rank} of {size} (do the \
             ranks disagree about the communicator?)"
        ));
    }
    Ok(())
}

/// The device-independent state of one communicator; see the module docs.
pub struct Core {
    /// The NCCL library.
    pub api: Arc<dyn NcclApi>,
    /// The device side.
    pub streams: Arc<dyn Streams>,
    /// What the library can do.
    pub gates: Gates,
    /// The communicator's name.
    pub name: Arc<str>,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The bootstrap timeout (split, windows, teardown).
    pub bootstrap_timeout: Duration,
    state: Mutex<CommState>,
    abort_requested: AtomicBool,
    failure: Mutex<Option<String>>,
    queue: Mutex<VecDeque<Pending>>,
    cv: Condvar,
    shutdown: AtomicBool,
    /// A failure revokes the communicator and keeps it for `shrink` instead of aborting it.
    keep_for_shrink: AtomicBool,
}

impl Core {
    /// Wraps an initialized communicator.
    pub fn new(
        api: Arc<dyn NcclApi>,
        streams: Arc<dyn Streams>,
        gates: Gates,
        raw: RawComm,
        ident: Ident,
    ) -> Arc<Core> {
        Arc::new(Core {
            api,
            streams,
            gates,
            name: ident.name,
            rank: ident.rank,
            size: ident.size,
            bootstrap_timeout: ident.bootstrap_timeout,
            state: Mutex::new(CommState {
                raw,
                torn_down: false,
                revoked: false,
            }),
            abort_requested: AtomicBool::new(false),
            failure: Mutex::new(None),
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            keep_for_shrink: AtomicBool::new(false),
        })
    }

    /// Hint `nccl.shrinkable`: keep a failed communicator (revoked, not aborted) for
    /// [`Core::shrink`]. Only where NCCL can revoke it (2.28.7) and shrink it (2.27.3): without
    /// a revoke, its kernels would spin on a dead peer until the drop. Returns whether it holds.
    pub fn set_shrinkable(&self, on: bool) -> bool {
        let on = on && self.gates.shrink && self.gates.revoke;
        self.keep_for_shrink.store(on, Ordering::Release);
        on
    }

    /// Starts the watchdog thread (it holds the core until teardown is done).
    ///
    /// # Errors
    ///
    /// [`CommError::Bootstrap`] if the thread cannot start.
    pub fn spawn_watchdog(self: &Arc<Self>) -> Result<()> {
        let core = self.clone();
        std::thread::Builder::new()
            .name(format!("cdt-nccl-{}-r{}", self.name, self.rank))
            .spawn(move || core.watchdog())
            .map(|_| ())
            .map_err(|e| CommError::Bootstrap {
                comm: self.name.to_string(),
                reason: format!("rank {}: could not start the watchdog: {e}", self.rank),
            })
    }

    /// The issue lock.
    pub(crate) fn lock(&self) -> MutexGuard<'_, CommState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<Pending>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the communicator is unusable, if it is.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether abort was requested (or the communicator failed).
    pub fn abort_requested(&self) -> &AtomicBool {
        &self.abort_requested
    }

    /// Operations whose outcome is not known yet.
    pub fn pending(&self) -> usize {
        self.queue().iter().filter(|p| p.finish.is_some()).count()
    }

    /// Fails with [`CommError::Aborted`] when the communicator is unusable.
    pub fn check_healthy(&self, ctx: &OpCtx) -> Result<()> {
        match self.failure() {
            Some(reason) => Err(CommError::Aborted {
                ctx: ctx.clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Enqueues `calls` as one NCCL group on the communicator's stream and returns the work.
    /// `keep` holds every buffer the calls touch; it is released when the device is done.
    ///
    /// # Errors
    ///
    /// [`CommError::Aborted`] on a failed communicator or when NCCL rejects the group (the
    /// communicator is then aborted: a group some ranks enqueued and others did not cannot be
    /// recovered); [`CommError::Timeout`] when the group stays `ncclInProgress` past the op
    /// timeout; [`CommError::Unsupported`] for a function this NCCL lacks (not fatal).
    pub fn issue<T: Send + 'static>(
        self: &Arc<Self>,
        ctx: OpCtx,
        calls: Vec<Call>,
        delivery: Delivery<T>,
        keep: Box<dyn Any + Send>,
    ) -> Result<Work<T>> {
        if calls.is_empty() {
            // Nothing moves (zero elements): done as soon as issued.
            self.check_healthy(&ctx)?;
            let value = match delivery {
                Delivery::Published(v) | Delivery::Blocking(v) => v,
            };
            return Ok(Work::ready(ctx, Ok(value)));
        }
        let st = self.lock();
        self.check_healthy(&ctx)?;
        if st.torn_down {
            return Err(CommError::Aborted {
                ctx,
                reason: "the communicator was torn down".into(),
            });
        }
        let device = |what: &str, e: String| {
            let reason = format!("CUDA error while {what}: {e}");
            CommError::Aborted {
                ctx: ctx.clone(),
                reason,
            }
        };
        self.streams
            .bind()
            .and_then(|()| self.streams.comm_after_caller())
            .map_err(|e| device("ordering the comm stream after the caller", e))?;
        let start = self
            .streams
            .record()
            .map_err(|e| device("recording the start event", e))?;
        self.enqueue_group(&st, &ctx, &calls)?;
        let end = match self.streams.record() {
            Ok(e) => e,
            Err(e) => {
                drop(st);
                let err = device("recording the end event", e);
                self.fail(None, err.to_string());
                return Err(err);
            }
        };
        let ahead = self.pending();
        let (work, completer) = Work::<T>::pending(ctx.clone(), ahead);
        let (finish, on_start): (Finish, Option<OnStart>) = match delivery {
            Delivery::Published(value) => {
                completer.publish(value);
                (Box::new(move |r| completer.finish(r)), None)
            }
            Delivery::Blocking(value) => blocking_hooks(completer, value),
        };
        self.queue().push_back(Pending {
            ctx,
            start,
            end: end.clone(),
            started: None,
            on_start,
            finish: Some(finish),
            _keep: keep,
        });
        drop(st);
        self.cv.notify_all();
        let streams = self.streams.clone();
        let wctx = work.ctx().clone();
        Ok(work.and_then(move |v| {
            streams
                .caller_after(&*end)
                .map_err(|e| CommError::Aborted {
                    ctx: wctx,
                    reason: format!("CUDA error making the caller's stream wait: {e}"),
                })?;
            Ok(v)
        }))
    }

    /// `ncclGroupStart`, the calls, `ncclGroupEnd`, and the poll of a nonblocking group end.
    fn enqueue_group(&self, st: &CommState, ctx: &OpCtx, calls: &[Call]) -> Result<()> {
        let api = &*self.api;
        let stream = self.streams.comm_stream();
        // A function this library lacks: refuse before anything of the group is enqueued.
        if let Some(f) = calls
            .iter()
            .filter_map(Call::requires)
            .find(|f| !api.has(*f))
        {
            return Err(CommError::Unsupported {
                backend: "nccl".into(),
                op: format!(
                    "{ctx}: {} (NCCL {} does not export it)",
                    f.symbol(),
                    self.gates.version
                ),
            });
        }
        let code = api.group_start();
        if !code.is_success() {
            return Err(self.fatal(ctx, "ncclGroupStart", code, st.raw));
        }
        let mut failed: Option<(&'static str, NcclCode)> = None;
        for call in calls {
            let code = api.enqueue(call, st.raw, stream);
            if !code.is_success() && code != NcclCode::IN_PROGRESS {
                failed = Some((call.name(), code));
                break;
            }
        }
        // The group must be closed even after a failed call (NCCL's group state is per thread);
        // NCCL then launches nothing of it.
        let end = api.group_end();
        if let Some((name, code)) = failed {
            if code == NcclCode::UNAVAILABLE {
                return Err(CommError::Unsupported {
                    backend: "nccl".into(),
                    op: format!(
                        "{ctx}: {name} (NCCL {} does not export it)",
                        self.gates.version
                    ),
                });
            }
            return Err(self.fatal(ctx, name, code, st.raw));
        }
        if end.is_success() {
            return Ok(());
        }
        if end != NcclCode::IN_PROGRESS {
            return Err(self.fatal(ctx, "ncclGroupEnd", end, st.raw));
        }
        let deadline = Instant::now() + ctx.timeout;
        match wait_ready(api, st.raw, deadline, Some(&self.abort_requested)) {
            Ready::Ok => Ok(()),
            Ready::Failed(c) => Err(self.fatal(ctx, "ncclGroupEnd", c, st.raw)),
            Ready::AbortRequested => Err(CommError::Aborted {
                ctx: ctx.clone(),
                reason: self
                    .failure()
                    .unwrap_or_else(|| "the communicator is being aborted".into()),
            }),
            Ready::TimedOut => {
                let err = CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing: Vec::new(),
                };
                self.fail(
                    None,
                    format!(
                        "{ctx}: NCCL did not finish enqueuing within {:?}",
                        ctx.timeout
                    ),
                );
                Err(err)
            }
        }
    }

    /// `ncclCommSplit` with `(color, key)` (nonblocking, polled under `ctx.timeout`, the
    /// bootstrap timeout): polls the parent until it leaves `ncclInProgress`, then waits for the
    /// child handle and polls the child (PyTorch's `NCCLComm::split` does the same, because
    /// NCCL fills the child handle in asynchronously, NVIDIA/nccl#1472). Returns `None` for
    /// `NCCL_SPLIT_NOCOLOR`. Checks that NCCL made this rank `key` of `expected` ranks.
    ///
    /// # Errors
    ///
    /// [`CommError::Timeout`] or [`CommError::Bootstrap`]; either way the parent is failed and
    /// aborted too (peers may be stuck in the split, which only an abort releases).
    pub fn split(
        &self,
        ctx: &OpCtx,
        color: i32,
        key: i32,
        expected: usize,
        spec: &ConfigSpec,
    ) -> Result<Option<RawComm>> {
        let st = self.lock();
        self.check_healthy(ctx)?;
        let api = &*self.api;
        let fail_parent = |err: CommError| {
            self.fail(None, format!("split into \"{}\" failed: {err}", ctx.comm));
            err
        };
        let boot = |call: &str, code: NcclCode, raw: RawComm| {
            super::errors::bootstrap_error(&self.name, self.rank, call, code, &detail(api, raw))
        };
        let timed_out = || CommError::Timeout {
            ctx: ctx.clone(),
            timeout: ctx.timeout,
            missing: Vec::new(),
        };
        self.streams.bind().map_err(|e| {
            fail_parent(CommError::Bootstrap {
                comm: self.name.to_string(),
                reason: format!("rank {}: CUDA: {e}", self.rank),
            })
        })?;
        release_before_new_comm(&*self.streams, &ctx.comm, self.rank);
        let deadline = Instant::now() + ctx.timeout;
        let out = Box::new(AtomicUsize::new(0));
        let config = spec.raw();
        let code = api.split(st.raw, color, key, &out, &config);
        if !code.is_success() && code != NcclCode::IN_PROGRESS {
            Box::leak(out);
            return Err(fail_parent(boot("ncclCommSplit", code, st.raw)));
        }
        match wait_ready(api, st.raw, deadline, Some(&self.abort_requested)) {
            Ready::Ok => {}
            Ready::Failed(c) => {
                Box::leak(out);
                return Err(fail_parent(boot("ncclCommSplit", c, st.raw)));
            }
            Ready::TimedOut | Ready::AbortRequested => {
                Box::leak(out);
                return Err(fail_parent(timed_out()));
            }
        }
        if color < 0 {
            return Ok(None);
        }
        let Some(child) = wait_handle(&out, deadline) else {
            Box::leak(out);
            return Err(fail_parent(timed_out()));
        };
        drop(st);
        match wait_ready(api, child, deadline, None) {
            Ready::Ok => {}
            Ready::Failed(c) => {
                let e = boot("ncclCommSplit (child)", c, child);
                api.abort(child);
                return Err(fail_parent(e));
            }
            Ready::TimedOut | Ready::AbortRequested => {
                api.abort(child);
                return Err(fail_parent(timed_out()));
            }
        }
        if let Err(e) = check_shape(api, child, key as usize, expected) {
            api.abort(child);
            return Err(fail_parent(CommError::Bootstrap {
                comm: ctx.comm.to_string(),
                reason: format!("rank {}: {e}", self.rank),
            }));
        }
        Ok(Some(child))
    }

    /// Maps an NCCL failure during an operation, fails the communicator and returns the error.
    fn fatal(&self, ctx: &OpCtx, call: &str, code: NcclCode, raw: RawComm) -> CommError {
        let why = detail(&*self.api, raw);
        let err = super::errors::op_error(ctx, call, code, &why);
        self.fail(None, err.to_string());
        err
    }

    /// Marks the communicator failed (the first reason wins), fails every pending work (the one
    /// with sequence `first.0` with `first.1`, the others with [`CommError::Aborted`]) and asks
    /// the watchdog to abort the NCCL communicator. Never blocks on NCCL.
    pub fn fail(&self, first: Option<(u64, CommError)>, reason: String) {
        let reason = {
            let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            f.get_or_insert(reason).clone()
        };
        self.abort_requested.store(true, Ordering::Release);
        let finishers: Vec<(Finish, Result<()>)> = {
            let mut q = self.queue();
            q.iter_mut()
                .filter_map(|p| {
                    let f = p.finish.take()?;
                    let err = match &first {
                        Some((seq, e)) if *seq == p.ctx.seq => e.clone(),
                        _ => CommError::Aborted {
                            ctx: p.ctx.clone(),
                            reason: reason.clone(),
                        },
                    };
                    Some((f, Err(err)))
                })
                .collect()
        };
        for (f, r) in finishers {
            f(r);
        }
        self.cv.notify_all();
    }

    /// Fails the communicator with `reason` (see [`Core::fail`]). Non-blocking, thread-safe.
    pub fn abort(&self, reason: &str) {
        tracing::warn!(comm = %self.name, rank = self.rank, reason, "aborting the NCCL communicator");
        self.fail(None, format!("aborted by rank {}: {reason}", self.rank));
    }

    /// Asks the watchdog to tear the communicator down once its work has drained.
    pub fn request_shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    /// One watchdog round at time `now` (the loop calls it with the clock; tests call it with a
    /// fake one): finishes completed work, times out stuck work, polls the async error, and
    /// aborts the NCCL communicator if requested. Returns whether work is still in flight.
    pub fn poll_once(&self, now: Instant) -> bool {
        // (the work that failed and its error, if one did; the communicator's failure reason)
        let mut failure: Option<(Option<(u64, CommError)>, String)> = None;
        let mut done: Vec<(Finish, Result<()>)> = Vec::new();
        let mut started: Vec<OnStart> = Vec::new();
        let busy = {
            let mut q = self.queue();
            q.retain_mut(|p| match p.end.query() {
                Ok(true) => {
                    if let Some(s) = p.on_start.take() {
                        started.push(s);
                    }
                    if let Some(f) = p.finish.take() {
                        done.push((f, Ok(())));
                    }
                    false
                }
                Ok(false) => {
                    if p.finish.is_none() || failure.is_some() {
                        return true;
                    }
                    if p.started.is_none() {
                        match p.start.query() {
                            Ok(true) => {
                                p.started = Some(now);
                                if let Some(s) = p.on_start.take() {
                                    started.push(s);
                                }
                            }
                            Ok(false) => {}
                            Err(e) => failure = Some(device_failure(&p.ctx, &e)),
                        }
                    }
                    if let Some(s) = p.started {
                        let waited = now.saturating_duration_since(s);
                        if waited > p.ctx.timeout {
                            let err = CommError::Timeout {
                                ctx: p.ctx.clone(),
                                timeout: p.ctx.timeout,
                                missing: Vec::new(),
                            };
                            let reason = format!(
                                "{} timed out on the GPU after {:?} (watchdog); the communicator was aborted",
                                p.ctx, p.ctx.timeout
                            );
                            failure = Some((Some((p.ctx.seq, err)), reason));
                        }
                    }
                    true
                }
                Err(e) => {
                    if p.finish.is_some() && failure.is_none() {
                        failure = Some(device_failure(&p.ctx, &e));
                    }
                    true
                }
            });
            q.iter().any(|p| p.finish.is_some())
        };
        for s in started {
            s();
        }
        for (f, r) in done {
            f(r);
        }
        if failure.is_none() && self.failure().is_none() {
            if let Ok(st) = self.state.try_lock() {
                if !st.torn_down {
                    let code = self.api.async_error(st.raw);
                    if !code.is_success() && code != NcclCode::IN_PROGRESS {
                        let why = detail(&*self.api, st.raw);
                        failure = Some((
                            None,
                            format!(
                                "NCCL reported {code} for comm \"{}\" on rank {}{why} (a peer failed or the network broke); the communicator was aborted",
                                self.name, self.rank
                            ),
                        ));
                    }
                }
            }
        }
        if let Some((first, reason)) = failure {
            tracing::error!(comm = %self.name, rank = self.rank, %reason, in_flight = ?self.describe_pending(), "NCCL watchdog: communicator failed");
            self.fail(first, reason);
        }
        if self.abort_requested.load(Ordering::Acquire) {
            let mut st = self.lock();
            if self.keep_for_shrink.load(Ordering::Acquire) {
                self.revoke_locked(&mut st);
            } else {
                self.teardown_locked(&mut st, false);
            }
        }
        busy
    }

    /// Revokes the communicator once (stops its in-flight kernels; the handle stays valid for
    /// a shrink or an abort). Called with the issue lock held.
    fn revoke_locked(&self, st: &mut CommState) {
        if st.torn_down || st.revoked || st.raw.is_null() || !self.gates.revoke {
            return;
        }
        st.revoked = true;
        let api = &*self.api;
        if let Err(e) = self.streams.bind() {
            tracing::warn!(comm = %self.name, rank = self.rank, error = %e, "could not bind the CUDA context to revoke");
        }
        let code = api.revoke(st.raw);
        if code == NcclCode::IN_PROGRESS {
            let _ = wait_ready(api, st.raw, Instant::now() + Duration::from_secs(5), None);
        }
    }

    /// `ncclCommShrink` without `excluded` (sorted ranks of this communicator): the child in
    /// which this rank is `rank` of `expected`. `NCCL_SHRINK_ABORT` when this communicator has
    /// failed (it must have been kept: hint `nccl.shrinkable`), `NCCL_SHRINK_DEFAULT` when it
    /// is healthy and idle. Polled under `ctx.timeout` (the bootstrap timeout). The parent is
    /// left as it is: its owner drops it (and a failed one is then aborted, never destroyed).
    ///
    /// # Errors
    ///
    /// [`CommError::Unsupported`] before NCCL 2.27.3; [`CommError::Aborted`] when the failed
    /// parent was already aborted; [`CommError::InvalidArgument`] for a healthy parent with
    /// work in flight (NCCL would deadlock); [`CommError::Bootstrap`] / [`CommError::Timeout`]
    /// when NCCL fails or never finishes (the child is aborted).
    pub fn shrink(
        &self,
        ctx: &OpCtx,
        excluded: &[usize],
        rank: usize,
        expected: usize,
        spec: &ConfigSpec,
    ) -> Result<RawComm> {
        if !self.gates.shrink {
            return Err(CommError::Unsupported {
                backend: "nccl".into(),
                op: format!(
                    "{} (ncclCommShrink needs NCCL >= 2.27.3; this is {})",
                    ctx.op, self.gates.version
                ),
            });
        }
        let st = self.lock();
        let failed = self.failure();
        if st.torn_down {
            return Err(CommError::Aborted {
                ctx: ctx.clone(),
                reason: format!(
                    "the communicator was already aborted ({}), and ncclCommShrink needs its \
                     handle: create it with hint nccl.shrinkable=1 (NCCL >= 2.28.7) to keep a \
                     failed communicator for a shrink",
                    failed.unwrap_or_default()
                ),
            });
        }
        let flags = if failed.is_some() || self.abort_requested.load(Ordering::Acquire) {
            SHRINK_ABORT
        } else {
            let pending = self.pending();
            if pending > 0 {
                return Err(CommError::invalid(
                    ctx,
                    format!(
                        "{pending} operation(s) in flight: a healthy communicator is shrunk \
                         only when idle (NCCL_SHRINK_DEFAULT would deadlock); wait for them"
                    ),
                ));
            }
            SHRINK_DEFAULT
        };
        let api = &*self.api;
        self.streams.bind().map_err(|e| CommError::Bootstrap {
            comm: self.name.to_string(),
            reason: format!("rank {}: CUDA: {e}", self.rank),
        })?;
        release_before_new_comm(&*self.streams, &ctx.comm, self.rank);
        let boot = |code: NcclCode, raw: RawComm| {
            super::errors::bootstrap_error(
                &self.name,
                self.rank,
                "ncclCommShrink",
                code,
                &detail(api, raw),
            )
        };
        let timed_out = || CommError::Timeout {
            ctx: ctx.clone(),
            timeout: ctx.timeout,
            missing: Vec::new(),
        };
        let deadline = Instant::now() + ctx.timeout;
        let out = Box::new(AtomicUsize::new(0));
        let list: Vec<i32> = excluded.iter().map(|&r| r as i32).collect();
        let config = spec.raw();
        let code = api.shrink(st.raw, &list, &out, &config, flags);
        if !code.is_success() && code != NcclCode::IN_PROGRESS {
            Box::leak(out);
            return Err(boot(code, st.raw));
        }
        let Some(child) = wait_handle(&out, deadline) else {
            Box::leak(out);
            return Err(timed_out());
        };
        drop(st);
        match wait_ready(api, child, deadline, None) {
            Ready::Ok => {}
            Ready::Failed(c) => {
                let e = boot(c, child);
                api.abort(child);
                return Err(e);
            }
            Ready::TimedOut | Ready::AbortRequested => {
                api.abort(child);
                return Err(timed_out());
            }
        }
        if let Err(e) = check_shape(api, child, rank, expected) {
            api.abort(child);
            return Err(CommError::Bootstrap {
                comm: ctx.comm.to_string(),
                reason: format!("rank {}: {e}", self.rank),
            });
        }
        tracing::info!(comm = %self.name, rank = self.rank, ?excluded, abort = flags == SHRINK_ABORT, "ncclCommShrink done");
        Ok(child)
    }

    /// The in-flight operations, for the failure log.
    fn describe_pending(&self) -> Vec<String> {
        self.queue()
            .iter()
            .map(|p| {
                format!(
                    "{}: {}",
                    p.ctx,
                    match (p.finish.is_some(), p.started) {
                        (false, _) => "failed, waiting for the device",
                        (true, Some(_)) => "running",
                        (true, None) => "queued on the device",
                    }
                )
            })
            .collect()
    }

    /// Revokes (NCCL >= 2.28.7) and aborts the communicator, or, when `graceful` and healthy,
    /// finalizes and destroys it. Idempotent; called with the issue lock held.
    pub(crate) fn teardown_locked(&self, st: &mut CommState, graceful: bool) {
        if st.torn_down || st.raw.is_null() {
            st.torn_down = true;
            return;
        }
        st.torn_down = true;
        let api = &*self.api;
        if let Err(e) = self.streams.bind() {
            tracing::warn!(comm = %self.name, rank = self.rank, error = %e, "could not bind the CUDA context for teardown");
        }
        let healthy = self.failure().is_none() && !self.abort_requested.load(Ordering::Acquire);
        if graceful && healthy {
            let code = api.finalize(st.raw);
            let finalized = code.is_success()
                || (code == NcclCode::IN_PROGRESS
                    && wait_ready(api, st.raw, Instant::now() + self.bootstrap_timeout, None)
                        == Ready::Ok);
            if finalized {
                let code = api.destroy(st.raw);
                if !code.is_success() {
                    tracing::warn!(comm = %self.name, rank = self.rank, %code, "ncclCommDestroy failed");
                }
                return;
            }
            tracing::warn!(comm = %self.name, rank = self.rank, %code, "ncclCommFinalize did not complete; aborting instead");
        }
        if self.gates.revoke && !st.revoked {
            // Stops in-flight kernels first (NCCL >= 2.28.7); abort then frees everything.
            // Never finalize after revoke (NCCL forbids it), only abort.
            let code = api.revoke(st.raw);
            if code == NcclCode::IN_PROGRESS {
                let _ = wait_ready(api, st.raw, Instant::now() + Duration::from_secs(5), None);
            }
        }
        let code = api.abort(st.raw);
        if !code.is_success() {
            tracing::warn!(comm = %self.name, rank = self.rank, %code, "ncclCommAbort failed");
        }
    }

    /// The watchdog thread: [`Core::poll_once`] in a loop; after a shutdown request and once
    /// the work has drained, finalizes and destroys (or aborts) the communicator and exits.
    fn watchdog(self: Arc<Self>) {
        if let Err(e) = self.streams.bind() {
            tracing::error!(comm = %self.name, rank = self.rank, error = %e, "NCCL watchdog cannot bind the CUDA context");
        }
        let mut zombies_since: Option<Instant> = None;
        loop {
            let busy = self.poll_once(Instant::now());
            if self.shutdown.load(Ordering::Acquire) && !busy {
                let left = self.queue().len();
                if left == 0 {
                    break;
                }
                // Failed work whose kernels have not exited: give them a grace period.
                let since = *zombies_since.get_or_insert_with(Instant::now);
                if since.elapsed() > ZOMBIE_GRACE {
                    tracing::error!(comm = %self.name, rank = self.rank, left, "device work of a failed NCCL communicator never completed; leaking its buffers");
                    let q = std::mem::take(&mut *self.queue());
                    std::mem::forget(q);
                    break;
                }
            }
            let q = self.queue();
            let tick = if q.is_empty() { IDLE_TICK } else { BUSY_TICK };
            if !self.shutdown.load(Ordering::Acquire) || !q.is_empty() {
                let _ = self.cv.wait_timeout(q, tick);
            }
        }
        let mut st = self.lock();
        self.teardown_locked(&mut st, true);
    }
}

fn device_failure(ctx: &OpCtx, e: &str) -> (Option<(u64, CommError)>, String) {
    let reason = format!(
        "{ctx}: CUDA error while polling the operation's events: {e}; the communicator was aborted"
    );
    let err = CommError::Aborted {
        ctx: ctx.clone(),
        reason: reason.clone(),
    };
    (Some((ctx.seq, err)), reason)
}

/// The start and finish hooks of a host-blocking work: it becomes `InProgress` when the device
/// starts it and completes (with `value`) when the device is done.
fn blocking_hooks<T: Send + 'static>(
    completer: WorkCompleter<T>,
    value: T,
) -> (Finish, Option<OnStart>) {
    let slot = Arc::new(Mutex::new(Some(completer)));
    let s2 = slot.clone();
    let on_start: OnStart = Box::new(move || {
        if let Some(c) = s2.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            c.start();
        }
    });
    let finish: Finish = Box::new(move |r| {
        if let Some(c) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
            c.complete(r.map(|()| value));
        }
    });
    (finish, Some(on_start))
}
