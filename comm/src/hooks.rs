//! Pre-, post- and abort hooks of a communicator.
//!
//! A pre-hook sees every operation before it is handed to the backend, a post-hook right after,
//! with a view of its [`Work`](crate::Work) state; abort hooks run once when the communicator
//! fails (explicit abort, a timeout, a desync, a peer failure). Hooks run on the thread that
//! issues the operation (abort hooks: on whichever thread observes the failure), so they must
//! be cheap and must not issue operations on the same communicator.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use candle_core::DType;

use crate::error::CommError;
use crate::types::{OpName, ReduceOp};
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
    #[serde(serialize_with = "ser_dtype")]
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

fn ser_dtype<S: serde::Serializer>(d: &Option<DType>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(d.as_str()),
        None => s.serialize_none(),
    }
}

/// Called before an operation is handed to the backend.
pub type PreHook = dyn Fn(&OpRecord) + Send + Sync;
/// Called after an operation was handed to the backend, with a view of its work.
pub type PostHook = dyn Fn(&OpRecord, &Arc<dyn WorkState>) + Send + Sync;
/// Called once when the communicator fails.
pub type AbortHook = dyn Fn(&CommError) + Send + Sync;

#[derive(Default)]
pub(crate) struct HookSet {
    next_id: AtomicU64,
    any_op_hook: AtomicBool,
    pre: RwLock<Vec<(u64, Arc<PreHook>)>>,
    post: RwLock<Vec<(u64, Arc<PostHook>)>>,
    abort: RwLock<Vec<(u64, Arc<AbortHook>)>>,
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

    pub(crate) fn add_pre(self: &Arc<Self>, f: Arc<PreHook>) -> HookHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.pre
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, f));
        self.refresh();
        HookHandle {
            id,
            kind: Kind::Pre,
            set: Arc::downgrade(self),
        }
    }

    pub(crate) fn add_post(self: &Arc<Self>, f: Arc<PostHook>) -> HookHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.post
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, f));
        self.refresh();
        HookHandle {
            id,
            kind: Kind::Post,
            set: Arc::downgrade(self),
        }
    }

    pub(crate) fn add_abort(self: &Arc<Self>, f: Arc<AbortHook>) -> HookHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.abort
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, f));
        HookHandle {
            id,
            kind: Kind::Abort,
            set: Arc::downgrade(self),
        }
    }

    fn remove(&self, kind: Kind, id: u64) {
        match kind {
            Kind::Pre => self
                .pre
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(i, _)| *i != id),
            Kind::Post => self
                .post
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(i, _)| *i != id),
            Kind::Abort => self
                .abort
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(i, _)| *i != id),
        }
        self.refresh();
    }

    pub(crate) fn run_pre(&self, rec: &OpRecord) {
        let hooks: Vec<Arc<PreHook>> = self
            .pre
            .read()
            .map(|v| v.iter().map(|(_, h)| h.clone()).collect())
            .unwrap_or_default();
        for h in hooks {
            h(rec);
        }
    }

    pub(crate) fn run_post(&self, rec: &OpRecord, work: &Arc<dyn WorkState>) {
        let hooks: Vec<Arc<PostHook>> = self
            .post
            .read()
            .map(|v| v.iter().map(|(_, h)| h.clone()).collect())
            .unwrap_or_default();
        for h in hooks {
            h(rec, work);
        }
    }

    /// Runs the abort hooks; a panicking hook is caught and logged so the others still run.
    pub(crate) fn run_abort(&self, err: &CommError) {
        let hooks: Vec<Arc<AbortHook>> = self
            .abort
            .read()
            .map(|v| v.iter().map(|(_, h)| h.clone()).collect())
            .unwrap_or_default();
        for h in hooks {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(err)));
            if r.is_err() {
                tracing::error!(error = %err, "an abort hook panicked");
            }
        }
    }
}
