//! The per-communicator progress queue of the local and process backends: ops run one at a time
//! in issue order on a progress thread, or on the thread that waits for them when they are next
//! in line and nothing runs (saves two thread hand-offs per small op). Ops on one communicator
//! are ordered; ops on different communicators (different queues and threads) overlap. An idle
//! progress thread sleeps on a condvar: nothing spins.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{CommError, Result};
use crate::vocab::OpCtx;
use crate::work::{InlineRun, Work};

type Task = Box<dyn FnOnce() + Send>;

struct QueueState {
    tasks: VecDeque<(u64, Task)>,
    next_task: u64,
    running: bool,
    shutdown: bool,
    next_coll: u64,
}

/// One communicator's queue of ops (one per rank and communicator).
pub struct Queue {
    state: Mutex<QueueState>,
    cv: Condvar,
}

/// The message of a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

impl Queue {
    /// An empty queue.
    pub fn new() -> Arc<Queue> {
        Arc::new(Queue {
            state: Mutex::new(QueueState {
                tasks: VecDeque::new(),
                next_task: 0,
                running: false,
                shutdown: false,
                next_coll: 0,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the progress thread of rank `rank` of communicator `name`; it runs tasks until
    /// [`Queue::shutdown`] and drained, then `on_exit`.
    pub fn spawn(
        self: &Arc<Self>,
        name: &str,
        rank: usize,
        on_exit: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        let q = self.clone();
        std::thread::Builder::new()
            .name(format!("cdt-{name}-r{rank}"))
            .spawn(move || q.run(on_exit))
            .map(drop)
            .map_err(|e| CommError::Bootstrap {
                comm: name.to_string(),
                reason: format!("could not start the progress thread: {e}"),
            })
    }

    fn run(self: Arc<Self>, on_exit: impl FnOnce()) {
        loop {
            let task = {
                let mut q = self.lock();
                loop {
                    // `running` may be set by a waiter running the head task inline.
                    if !q.running {
                        if let Some((_, t)) = q.tasks.pop_front() {
                            q.running = true;
                            break Some(t);
                        }
                        if q.shutdown {
                            break None;
                        }
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some(task) = task else { break };
            task();
            self.lock().running = false;
            self.cv.notify_all();
        }
        on_exit();
    }

    /// Refuses new ops; the progress thread drains what is queued (peers may need it) and
    /// exits. Returns whether an op is running right now.
    pub fn shutdown(&self) -> bool {
        let mut q = self.lock();
        q.shutdown = true;
        let running = q.running;
        drop(q);
        self.cv.notify_all();
        running
    }

    /// Ops queued or running.
    pub fn pending(&self) -> usize {
        let q = self.lock();
        q.tasks.len() + usize::from(q.running)
    }

    /// Queues `body` as the next op. `collective` ops take the next collective index (passed
    /// to `body`; `u64::MAX` for the others). A panicking body fails its work with the error
    /// `on_panic` makes of the panic message (after failing the communicator, typically).
    pub fn submit<T: Send + 'static>(
        self: &Arc<Self>,
        ctx: OpCtx,
        collective: bool,
        body: impl FnOnce(&OpCtx, u64) -> Result<T> + Send + 'static,
        on_panic: impl FnOnce(&OpCtx, u64, String) -> CommError + Send + 'static,
    ) -> Result<Work<T>> {
        let mut q = self.lock();
        if q.shutdown {
            return Err(CommError::Aborted {
                ctx,
                reason: "the communicator was dropped".into(),
            });
        }
        let coll = if collective {
            q.next_coll += 1;
            q.next_coll - 1
        } else {
            u64::MAX
        };
        let ahead = q.tasks.len() + usize::from(q.running);
        let id = q.next_task;
        q.next_task += 1;
        let (mut work, completer) = Work::pending(ctx.clone(), ahead);
        work.set_inline(self.clone(), id);
        q.tasks.push_back((
            id,
            Box::new(move || {
                completer.start();
                let r = catch_unwind(AssertUnwindSafe(|| body(&ctx, coll))).unwrap_or_else(|p| {
                    let reason = format!("internal panic in {}: {}", ctx.op, panic_message(&*p));
                    tracing::error!(%ctx, %reason, "comm op panicked");
                    Err(on_panic(&ctx, coll, reason))
                });
                completer.complete(r);
            }),
        ));
        drop(q);
        self.cv.notify_one();
        Ok(work)
    }
}

impl InlineRun for Queue {
    /// Runs task `id` on the calling thread if it is next in line and nothing is running:
    /// a caller that waits right after issuing saves two thread hand-offs (the latency of small
    /// collectives is dominated by them on a loaded machine), and issue order is kept.
    fn try_run(&self, id: u64) -> bool {
        let task = {
            let mut q = self.lock();
            if q.running || q.tasks.front().map(|(i, _)| *i) != Some(id) {
                return false;
            }
            q.running = true;
            q.tasks.pop_front().map(|(_, t)| t)
        };
        if let Some(t) = task {
            t();
        }
        self.lock().running = false;
        self.cv.notify_all();
        true
    }
}
