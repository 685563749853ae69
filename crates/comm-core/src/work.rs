//! `Work`: the handle of an asynchronous operation.
//!
//! A backend creates a [`Work`] and its [`WorkCompleter`] together; the completer moves to
//! whoever runs the operation (for the local backend, the communicator's progress thread).
//! Status goes `NotStarted -> InProgress -> {Completed, TimedOut, Error}` and never back.

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::vocab::OpCtx;

/// Extra time [`Work::wait`] allows beyond the operation's own timeout before it gives up on a
/// backend that never completed the work (a backend bug, not a slow peer: slow peers are the
/// backend's own timeout).
const WAIT_GRACE: Duration = Duration::from_secs(5);

/// The state of a [`Work`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkStatus {
    /// Queued behind earlier operations of the same communicator.
    NotStarted,
    /// Running.
    InProgress,
    /// Finished successfully.
    Completed,
    /// Finished because some ranks never arrived in time.
    TimedOut,
    /// Finished with an error (abort, desync, invalid argument, ...).
    Error,
}

impl WorkStatus {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => WorkStatus::NotStarted,
            1 => WorkStatus::InProgress,
            2 => WorkStatus::Completed,
            3 => WorkStatus::TimedOut,
            _ => WorkStatus::Error,
        }
    }

    /// Whether the work has finished (successfully or not).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            WorkStatus::Completed | WorkStatus::TimedOut | WorkStatus::Error
        )
    }

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkStatus::NotStarted => "not_started",
            WorkStatus::InProgress => "in_progress",
            WorkStatus::Completed => "completed",
            WorkStatus::TimedOut => "timed_out",
            WorkStatus::Error => "error",
        }
    }
}

impl fmt::Display for WorkStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What observers (hooks, the flight recorder) can see of a work without its result type.
pub trait WorkState: Send + Sync {
    /// The current status.
    fn status(&self) -> WorkStatus;
    /// When the operation was issued.
    fn issued_at(&self) -> Instant;
    /// When the backend started running it.
    fn started_at(&self) -> Option<Instant>;
    /// When it finished.
    fn finished_at(&self) -> Option<Instant>;
    /// The error message, if it failed.
    fn error(&self) -> Option<String>;
}

type CompletionCallback = Box<dyn FnOnce(&CommError) + Send>;
type AnyBox = Box<dyn Any + Send>;
type Mapper<T> = Box<dyn FnOnce(AnyBox) -> Result<T> + Send>;

struct Times {
    started: Option<Instant>,
    finished: Option<Instant>,
    error: Option<String>,
}

/// The untyped state shared by a work, its completer and observers. The result is stored
/// type-erased so that [`Work::map`] can change the output type without a second state.
struct Core {
    status: AtomicU8,
    issued: Instant,
    times: Mutex<Times>,
    result: Mutex<Option<Result<AnyBox>>>,
    cv: Condvar,
    /// Run once if the work fails (used by the front to fire abort hooks).
    on_error: Mutex<Option<CompletionCallback>>,
}

impl WorkState for Core {
    fn status(&self) -> WorkStatus {
        WorkStatus::from_u8(self.status.load(Ordering::Acquire))
    }
    fn issued_at(&self) -> Instant {
        self.issued
    }
    fn started_at(&self) -> Option<Instant> {
        self.times.lock().map(|t| t.started).unwrap_or(None)
    }
    fn finished_at(&self) -> Option<Instant> {
        self.times.lock().map(|t| t.finished).unwrap_or(None)
    }
    fn error(&self) -> Option<String> {
        self.times.lock().ok().and_then(|t| t.error.clone())
    }
}

/// Lets [`Work::wait`] run a queued operation on the waiting thread (see
/// [`Work::set_inline`]).
pub trait InlineRun: Send + Sync {
    /// Runs task `id` now, on the calling thread, if the backend can do so without breaking
    /// issue order; returns whether it ran.
    fn try_run(&self, id: u64) -> bool;
}

/// The handle of an issued operation. [`Work::wait`] returns its output.
///
/// Dropping a `Work` without waiting is allowed: the operation still runs (the peers need it).
#[must_use = "a Work must be waited on to get its result or error"]
pub struct Work<T> {
    core: Arc<Core>,
    ctx: OpCtx,
    /// Operations queued ahead of this one at issue time (each may take up to its timeout).
    ahead: u32,
    map: Mapper<T>,
    inline: Option<(Arc<dyn InlineRun>, u64)>,
}

/// The completing side of a [`Work`], owned by whoever runs the operation.
pub struct WorkCompleter<T> {
    core: Arc<Core>,
    _t: PhantomData<fn(T)>,
}

fn downcast<T: 'static>(b: AnyBox) -> Result<T> {
    match b.downcast::<T>() {
        Ok(t) => Ok(*t),
        // Unreachable by construction: a completer of `T` only stores `T`.
        Err(_) => Err(CommError::Unsupported {
            backend: "work".into(),
            op: "result of an unexpected type".into(),
        }),
    }
}

impl<T: Send + 'static> Work<T> {
    /// Creates a pending work and its completer. `ahead` is the number of operations queued
    /// before it on the same communicator (it widens the bound of [`Work::wait`]).
    pub fn pending(ctx: OpCtx, ahead: usize) -> (Work<T>, WorkCompleter<T>) {
        let core = Arc::new(Core {
            status: AtomicU8::new(WorkStatus::NotStarted as u8),
            issued: Instant::now(),
            times: Mutex::new(Times {
                started: None,
                finished: None,
                error: None,
            }),
            result: Mutex::new(None),
            cv: Condvar::new(),
            on_error: Mutex::new(None),
        });
        let work = Work {
            core: core.clone(),
            ctx,
            ahead: ahead.min(u32::MAX as usize) as u32,
            map: Box::new(downcast::<T>),
            inline: None,
        };
        (
            work,
            WorkCompleter {
                core,
                _t: PhantomData,
            },
        )
    }

    /// A work that is already complete with `result`.
    pub fn ready(ctx: OpCtx, result: Result<T>) -> Work<T> {
        let (work, completer) = Work::pending(ctx, 0);
        completer.start();
        completer.complete(result);
        work
    }

    /// Lets [`Work::wait`] run the operation on the waiting thread through `runner` when it
    /// has not started yet (task `id` of the backend's queue).
    pub fn set_inline(&mut self, runner: Arc<dyn InlineRun>, id: u64) {
        self.inline = Some((runner, id));
    }

    /// The current status.
    pub fn status(&self) -> WorkStatus {
        self.core.status()
    }

    /// Whether the work finished successfully.
    pub fn is_completed(&self) -> bool {
        self.status() == WorkStatus::Completed
    }

    /// The operation context (op, comm, rank, seq, timeout).
    pub fn ctx(&self) -> &OpCtx {
        &self.ctx
    }

    /// The per-communicator sequence number.
    pub fn seq(&self) -> u64 {
        self.ctx.seq
    }

    /// A type-erased view for observers.
    pub fn state(&self) -> Arc<dyn WorkState> {
        self.core.clone()
    }

    /// Registers `f` to run once if this work fails (immediately if it already failed). The
    /// front uses it to fire the abort hooks; a backend's tests may observe failures with it.
    pub fn on_error(&self, f: Box<dyn FnOnce(&CommError) + Send>) {
        let failed = {
            let mut slot = self.core.on_error.lock().unwrap_or_else(|e| e.into_inner());
            let result = self.core.result.lock().unwrap_or_else(|e| e.into_inner());
            match result.as_ref() {
                Some(Err(e)) => e.clone(),
                // A published value (see `WorkCompleter::publish`) may still fail later.
                Some(Ok(_)) if self.core.status() == WorkStatus::Completed => return,
                _ => {
                    *slot = Some(f);
                    return;
                }
            }
        };
        f(&failed);
    }

    /// Waits for the operation and returns its output.
    ///
    /// # Blocking
    ///
    /// Blocks the calling thread until the operation finishes. The backend enforces the op
    /// timeout (a collective some ranks never join ends with [`CommError::Timeout`]); as a
    /// safety net this call also gives up after the timeout of this op and of every op queued
    /// ahead of it, plus a grace period.
    pub fn wait(mut self) -> Result<T> {
        if let Some((runner, id)) = self.inline.take() {
            if self.status() == WorkStatus::NotStarted {
                runner.try_run(id);
            }
        }
        let per_op = self.ctx.timeout;
        let mut guard = self.core.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = guard.take() {
                drop(guard);
                return r.and_then(self.map);
            }
            let now = Instant::now();
            let deadline = match self.core.started_at() {
                Some(s) => s + per_op + WAIT_GRACE,
                None => self.core.issued + per_op * (self.ahead + 1) + WAIT_GRACE,
            };
            if now >= deadline {
                return Err(CommError::Timeout {
                    ctx: self.ctx.clone(),
                    timeout: deadline - self.core.issued,
                    missing: Vec::new(),
                });
            }
            let (g, _) = self
                .core
                .cv
                .wait_timeout(guard, (deadline - now).min(Duration::from_millis(500)))
                .unwrap_or_else(|e| e.into_inner());
            guard = g;
        }
    }

    /// Transforms the output of a successful work (applied when waited).
    pub fn map<U: Send + 'static>(self, f: impl FnOnce(T) -> U + Send + 'static) -> Work<U> {
        self.and_then(move |t| Ok(f(t)))
    }

    /// Transforms the output of a successful work with a fallible function.
    pub fn and_then<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        let prev = self.map;
        Work {
            core: self.core,
            ctx: self.ctx,
            ahead: self.ahead,
            map: Box::new(move |b| prev(b).and_then(f)),
            inline: self.inline,
        }
    }
}

impl<T> fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work")
            .field("ctx", &self.ctx)
            .field("status", &self.core.status())
            .finish()
    }
}

impl<T: Send + 'static> WorkCompleter<T> {
    /// Marks the work as running.
    pub fn start(&self) {
        if let Ok(mut t) = self.core.times.lock() {
            t.started = Some(Instant::now());
        }
        let _ = self.core.status.compare_exchange(
            WorkStatus::NotStarted as u8,
            WorkStatus::InProgress as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Finishes the work with `result` and wakes the waiter.
    pub fn complete(self, result: Result<T>) {
        let err = result.as_ref().err().cloned();
        let mut result = Some(result.map(|t| Box::new(t) as AnyBox));
        self.end(err, |r| *r = result.take());
    }

    /// Records the end (`err`: how it failed), lets `set` update the stored result, publishes
    /// the final status and runs the failure callback.
    fn end(self, err: Option<CommError>, set: impl FnOnce(&mut Option<Result<AnyBox>>)) {
        let status = match &err {
            None => WorkStatus::Completed,
            Some(CommError::Timeout { .. }) => WorkStatus::TimedOut,
            Some(_) => WorkStatus::Error,
        };
        if let Ok(mut t) = self.core.times.lock() {
            let now = Instant::now();
            t.started.get_or_insert(now);
            t.finished = Some(now);
            t.error = err.as_ref().map(|e| e.to_string());
        }
        // The failure callback (the communicator's abort hooks) runs before the waiter wakes,
        // so a failed `wait` returns after the hooks have run. The slot stays locked until the
        // result is stored: an `on_error` registered meanwhile then finds the error and runs
        // its callback itself instead of parking it where nobody would run it. The callback is
        // taken on success too and dropped here: it holds a handle of the communicator, and
        // observers (the flight recorder) keep this work's state alive, so a callback left in
        // place would keep the communicator, and its progress thread, alive forever.
        let mut slot = self.core.on_error.lock().unwrap_or_else(|e| e.into_inner());
        self.core.status.store(status as u8, Ordering::Release);
        if let (Some(cb), Some(e)) = (slot.take(), err) {
            cb(&e);
        }
        let mut r = self.core.result.lock().unwrap_or_else(|e| e.into_inner());
        set(&mut r);
        self.core.cv.notify_all();
        drop(r);
        drop(slot);
    }

    /// Hands `value` to the waiter before the operation has finished, for stream-ordered
    /// backends (NCCL): the value is safe to use by later work on the device, so
    /// [`Work::wait`] returns it at once, while the status stays `InProgress` until
    /// [`WorkCompleter::finish`] reports how the operation really ended. Calling it twice
    /// replaces a value nobody has taken yet.
    pub fn publish(&self, value: T) {
        self.start();
        let mut r = self.core.result.lock().unwrap_or_else(|e| e.into_inner());
        *r = Some(Ok(Box::new(value) as AnyBox));
        drop(r);
        self.core.cv.notify_all();
    }

    /// Ends a work whose value was [`published`](WorkCompleter::publish). `Ok` marks it
    /// completed. An error marks it timed out or failed, replaces the published value if the
    /// waiter has not taken it yet (so a later [`Work::wait`] returns the error), and runs the
    /// failure callback, as [`WorkCompleter::complete`] does.
    pub fn finish(self, outcome: Result<()>) {
        let err = outcome.err();
        let replace = err.clone();
        self.end(err, |r| {
            if let (Some(e), Some(_)) = (replace, r.as_ref()) {
                *r = Some(Err(e));
            }
        });
    }

    /// A type-erased view for observers.
    pub fn state(&self) -> Arc<dyn WorkState> {
        self.core.clone()
    }
}
