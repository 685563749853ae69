//! The flight recorder: a ring buffer of the last N operations of a communicator.
//!
//! Each entry holds the op, its seq, shapes, dtype, bytes and the live state of its work
//! (issued / started / finished times, status, error). When a collective hangs or fails, the dump
//! says which op each rank was on and which ones never started — the question NCCL watchdog
//! timeouts leave open (pytorch#118369). A communicator built with
//! [`CommOptions::flight_recorder_entries`](crate::CommOptions) > 0 attaches one automatically and
//! dumps it when the communicator fails: to the `tracing` log, and to
//! `$CANDLE_DTENSOR_FR_DUMP_DIR/fr_<comm>_rank<r>.json` when that variable is set.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::hooks::{OpRecord, PostHook, PreHook};
use crate::work::{WorkState, WorkStatus};

struct Entry {
    record: OpRecord,
    issued_unix_us: u128,
    work: Option<Arc<dyn WorkState>>,
}

struct State {
    capacity: usize,
    entries: VecDeque<Entry>,
    dropped: u64,
}

/// A ring buffer of recent operations; see the module docs.
#[derive(Clone)]
pub struct FlightRecorder {
    state: Arc<Mutex<State>>,
    epoch: Instant,
    epoch_unix_us: u128,
}

/// One recorded operation, as dumped.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FlightEntry {
    /// What was issued.
    #[serde(flatten)]
    pub record: OpRecord,
    /// The work's status at dump time.
    pub state: WorkStatus,
    /// Issue time, microseconds since the Unix epoch.
    pub issued_unix_us: u128,
    /// Microseconds from issue to start (None: not started).
    pub queued_us: Option<u128>,
    /// Microseconds from start to finish (None: not finished).
    pub duration_us: Option<u128>,
    /// The error, if the work failed.
    pub error: Option<String>,
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` operations.
    pub fn new(capacity: usize) -> Self {
        let epoch_unix_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros())
            .unwrap_or(0);
        FlightRecorder {
            state: Arc::new(Mutex::new(State {
                capacity: capacity.max(1),
                entries: VecDeque::new(),
                dropped: 0,
            })),
            epoch: Instant::now(),
            epoch_unix_us,
        }
    }

    /// The pre-hook that records each operation as it is issued. [`Comm`](crate::Comm)
    /// attaches it (with [`FlightRecorder::post_hook`]) through `FlightRecorder::attach`, so
    /// the recorder depends on the hooks only, never on the communicator.
    pub fn pre_hook(&self) -> Arc<PreHook> {
        let state = self.clone();
        Arc::new(move |rec: &OpRecord| state.push(rec.clone()))
    }

    /// The post-hook that gives each recorded operation a view of its work's live state.
    pub fn post_hook(&self) -> Arc<PostHook> {
        let state = self.clone();
        Arc::new(move |rec: &OpRecord, work: &Arc<dyn WorkState>| state.set_work(rec, work))
    }

    fn push(&self, record: OpRecord) {
        let issued_unix_us = self.epoch_unix_us + self.epoch.elapsed().as_micros();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.entries.len() == s.capacity {
            s.entries.pop_front();
            s.dropped += 1;
        }
        s.entries.push_back(Entry {
            record,
            issued_unix_us,
            work: None,
        });
    }

    fn set_work(&self, rec: &OpRecord, work: &Arc<dyn WorkState>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = s
            .entries
            .iter_mut()
            .rev()
            .find(|e| e.record.seq == rec.seq && e.record.comm == rec.comm)
        {
            e.work = Some(work.clone());
        }
    }

    /// The number of entries held.
    pub fn len(&self) -> usize {
        self.state
            .lock()
            .map(|s| s.entries.len())
            .unwrap_or_default()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every entry.
    pub fn reset(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.entries.clear();
            s.dropped = 0;
        }
    }

    /// The entries, oldest first; completed ones only if `include_completed`.
    pub fn entries(&self, include_completed: bool) -> Vec<FlightEntry> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.entries
            .iter()
            .filter_map(|e| {
                let (state, queued, dur, error) = match &e.work {
                    Some(w) => {
                        let st = w.status();
                        let started = w.started_at();
                        let finished = w.finished_at();
                        (
                            st,
                            started.map(|t| t.duration_since(w.issued_at()).as_micros()),
                            match (started, finished) {
                                (Some(a), Some(b)) => Some(b.duration_since(a).as_micros()),
                                _ => None,
                            },
                            w.error(),
                        )
                    }
                    // The backend refused the op before creating work.
                    None => (WorkStatus::Error, None, None, None),
                };
                if !include_completed && state == WorkStatus::Completed {
                    return None;
                }
                Some(FlightEntry {
                    record: e.record.clone(),
                    state,
                    issued_unix_us: e.issued_unix_us,
                    queued_us: queued,
                    duration_us: dur,
                    error,
                })
            })
            .collect()
    }

    /// The dump as a JSON value: `{"entries": [...], "dropped": n}`.
    pub fn dump_json(&self, include_completed: bool) -> serde_json::Value {
        let dropped = self.state.lock().map(|s| s.dropped).unwrap_or_default();
        serde_json::json!({
            "entries": self.entries(include_completed),
            "dropped": dropped,
        })
    }

    /// Writes the dump to `path`.
    pub fn dump_file(&self, path: &Path, include_completed: bool) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(&self.dump_json(include_completed))
            .map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }
}

/// The environment variable naming the directory automatic dumps go to.
pub const FR_DUMP_DIR_ENV: &str = "CANDLE_DTENSOR_FR_DUMP_DIR";

/// Dumps `fr` for `comm` after a failure: to the log and, if configured, to a file.
pub(crate) fn dump_on_failure(fr: &FlightRecorder, comm: &str, rank: usize, why: &str) {
    let json = fr.dump_json(true);
    tracing::error!(comm, rank, reason = why, flight_recorder = %json, "communicator failed; flight recorder dump");
    if let Ok(dir) = std::env::var(FR_DUMP_DIR_ENV) {
        let safe: String = comm
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = Path::new(&dir).join(format!("fr_{safe}_rank{rank}.json"));
        if let Err(e) = fr.dump_file(&path, true) {
            tracing::error!(path = %path.display(), error = %e, "could not write the flight recorder dump");
        }
    }
}
