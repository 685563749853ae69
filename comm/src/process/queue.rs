//! The per-communicator progress queue (the local backend's design): ops run one at a time in
//! issue order on a progress thread, or on the thread that waits for them when they are next in
//! line and nothing runs (saves two thread hand-offs per small op).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::work::InlineRun;

pub(crate) type Task = Box<dyn FnOnce() + Send>;

pub(crate) struct QueueState {
    pub tasks: VecDeque<(u64, Task)>,
    pub next_task: u64,
    pub running: bool,
    pub shutdown: bool,
    pub next_coll: u64,
}

pub(crate) struct Queue {
    state: Mutex<QueueState>,
    pub cv: Condvar,
}

impl Queue {
    pub(crate) fn new() -> Arc<Queue> {
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

    pub(crate) fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The progress loop: runs tasks until shut down and drained, then `on_exit`.
    pub(crate) fn run(self: Arc<Self>, on_exit: impl FnOnce()) {
        loop {
            let task = {
                let mut q = self.lock();
                loop {
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
}

impl InlineRun for Queue {
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
