//! Pre-, post- and abort hooks of a communicator.
//!
//! A pre-hook sees every operation before it is handed to the backend, a post-hook right after,
//! with a view of its [`Work`](crate::Work) state; abort hooks run once when the communicator
//! fails (explicit abort, a timeout, a desync, a peer failure). Hooks run on the thread that
//! issues the operation (abort hooks: on whichever thread observes the failure first), so they
//! must be cheap and must not issue operations on the same communicator. Every other thread
//! that observes the failure (a failed [`Work::wait`](crate::Work::wait), an explicit abort)
//! returns only after the abort hooks have finished.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::ThreadId;
use std::time::Duration;

use candle_core::DType;

use crate::error::CommError;
use crate::vocab::{OpName, ReduceOp};
use crate::work::WorkState;

/// What hooks see of an operation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpRecord {
    /// The communicator's name.
    pub comm: Arc<str>,
    /// The backend's name.
    pub backend: &'static str,
    /// The issuing rank.
    pub rank: usize,
    /// The communicator size.
    pub size: usize,
    /// The per-communicator sequence number.
    pub seq: u64,
    /// The operation.
    pub op: OpName,
    /// The dtype of the data, if any.
    #[serde(serialize_with = "crate::desc::dtype_name::serialize")]
    pub dtype: Option<DType>,
    /// The shapes of the input tensors.
    pub shapes: Vec<Vec<usize>>,
    /// Input bytes on this rank.
    pub bytes: usize,
    /// The root rank (broadcast, reduce, gather, scatter).
    pub root: Option<usize>,
    /// The peer rank (send, recv, window ops).
    pub peer: Option<usize>,
    /// The reduction (all_reduce, reduce, reduce_scatter).
    pub reduce_op: Option<ReduceOp>,
}

/// Called before an operation is handed to the backend.
pub type PreHook = dyn Fn(&OpRecord) + Send + Sync;
/// Called after an operation was handed to the backend, with a view of its work.
pub type PostHook = dyn Fn(&OpRecord, &Arc<dyn WorkState>) + Send + Sync;
/// Called once when the communicator fails.
pub type AbortHook = dyn Fn(&CommError) + Send + Sync;

type List<H> = RwLock<Vec<(u64, Arc<H>)>>;

#[derive(Default)]
pub(crate) struct HookSet {
    next_id: AtomicU64,
    any_op_hook: AtomicBool,
    pre: List<PreHook>,
    post: List<PostHook>,
    abort: List<AbortHook>,
    fired: Mutex<Fired>,
    fired_cv: Condvar,
}

/// Where the once-only run of the abort hooks stands.
#[derive(Default)]
enum Fired {
    #[default]
    No,
    Running(ThreadId),
    Done,
}

/// The hooks of `list` now (so none runs under its lock).
fn snapshot<H: ?Sized>(list: &List<H>) -> Vec<Arc<H>> {
    list.read()
        .map(|v| v.iter().map(|(_, h)| h.clone()).collect())
        .unwrap_or_default()
}

fn retain_others<H: ?Sized>(list: &List<H>, id: u64) {
    list.write()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(i, _)| *i != id)
}

#[derive(Clone, Copy)]
enum Kind {
    Pre,
    Post,
    Abort,
}

/// Removes a registered hook with [`HookHandle::remove`]. Dropping the handle keeps the hook.
#[must_use = "keep the handle to remove the hook later"]
pub struct HookHandle {
    id: u64,
    kind: Kind,
    set: Weak<HookSet>,
}

impl HookHandle {
    /// Unregisters the hook. Does nothing if the communicator is gone.
    pub fn remove(self) {
        if let Some(set) = self.set.upgrade() {
            set.remove(self.kind, self.id);
        }
    }
}

impl HookSet {
    pub(crate) fn has_op_hooks(&self) -> bool {
        self.any_op_hook.load(Ordering::Acquire)
    }

    fn refresh(&self) {
        let any = !self.pre.read().map(|v| v.is_empty()).unwrap_or(true)
            || !self.post.read().map(|v| v.is_empty()).unwrap_or(true);
        self.any_op_hook.store(any, Ordering::Release);
    }

    fn add<H: ?Sized>(self: &Arc<Self>, list: &List<H>, kind: Kind, f: Arc<H>) -> HookHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        list.write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, f));
        self.refresh();
        HookHandle {
            id,
            kind,
            set: Arc::downgrade(self),
        }
    }

    pub(crate) fn add_pre(self: &Arc<Self>, f: Arc<PreHook>) -> HookHandle {
        self.add(&self.pre, Kind::Pre, f)
    }

    pub(crate) fn add_post(self: &Arc<Self>, f: Arc<PostHook>) -> HookHandle {
        self.add(&self.post, Kind::Post, f)
    }

    pub(crate) fn add_abort(self: &Arc<Self>, f: Arc<AbortHook>) -> HookHandle {
        self.add(&self.abort, Kind::Abort, f)
    }

    fn remove(&self, kind: Kind, id: u64) {
        match kind {
            Kind::Pre => retain_others(&self.pre, id),
            Kind::Post => retain_others(&self.post, id),
            Kind::Abort => retain_others(&self.abort, id),
        }
        self.refresh();
    }

    pub(crate) fn run_pre(&self, rec: &OpRecord) {
        for h in snapshot(&self.pre) {
            h(rec);
        }
    }

    pub(crate) fn run_post(&self, rec: &OpRecord, work: &Arc<dyn WorkState>) {
        for h in snapshot(&self.post) {
            h(rec, work);
        }
    }

    /// Runs the abort hooks for the first failure observed; later calls return once that run
    /// has finished, so whoever observes a failure sees the hooks' effects. A call from a hook
    /// itself (the running thread) returns at once, and a hook that runs longer than `bound`
    /// releases the other callers with a warning rather than hanging them.
    pub(crate) fn abort_once(&self, err: &CommError, bound: Duration) {
        let me = std::thread::current().id();
        let mut fired = self.fired.lock().unwrap_or_else(|e| e.into_inner());
        match *fired {
            Fired::Done => {}
            Fired::Running(t) if t == me => {}
            Fired::Running(_) => {
                let (fired, wait) = self
                    .fired_cv
                    .wait_timeout_while(fired, bound, |f| matches!(f, Fired::Running(_)))
                    .unwrap_or_else(|e| e.into_inner());
                drop(fired);
                if wait.timed_out() {
                    tracing::warn!(
                        error = %err,
                        bound_ms = bound.as_millis() as u64,
                        "abort hooks still running; not waiting longer for them"
                    );
                }
            }
            Fired::No => {
                *fired = Fired::Running(me);
                drop(fired);
                self.run_abort(err);
                *self.fired.lock().unwrap_or_else(|e| e.into_inner()) = Fired::Done;
                self.fired_cv.notify_all();
            }
        }
    }

    /// Runs the abort hooks; a panicking hook is caught and logged so the others still run.
    fn run_abort(&self, err: &CommError) {
        for h in snapshot(&self.abort) {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(err)));
            if r.is_err() {
                tracing::error!(error = %err, "an abort hook panicked");
            }
        }
    }
}
