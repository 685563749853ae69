//! `CommDebugMode`: count the collectives DTensor code issues.
//!
//! A [`CommDebugMode`] records, while alive, every collective the runtime issues on the current
//! thread (a rank), forward and backward separately, with its kind, mesh dim, bytes and the user
//! label active when the forward op ran ([`label`]). Collectives issued by backward passes carry
//! the label of the forward op they belong to.
//!
//! ```
//! use candle_dtensor::dtensor::debug::{label, CommDebugMode, Phase};
//! let mode = CommDebugMode::start();
//! {
//!     let _l = label("block0.mlp");
//!     // ... DTensor ops ...
//! }
//! assert_eq!(mode.count("all_reduce", Phase::Forward), 0);
//! ```

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Issued while running forward ops.
    Forward,
    /// Issued by a backward pass.
    Backward,
}

/// One recorded collective.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CollectiveRecord {
    /// `all_gather`, `all_reduce`, `reduce_scatter`, `all_to_all`, `rma_get`, ...
    pub kind: &'static str,
    /// Forward or backward.
    pub phase: Phase,
    /// The label active when the forward op ran (nested labels joined with `.`).
    pub label: Option<String>,
    /// The mesh dim name(s) the collective ran over (`dp+tp` when merged).
    pub mesh_dim: String,
    /// Bytes of the collective per rank (nccl-tests convention: the gathered output, the
    /// unreduced input, the all-reduced buffer, the all-to-all buffer).
    pub bytes: u64,
}

#[derive(Default)]
struct State {
    recorders: Vec<(u64, Arc<Mutex<Vec<CollectiveRecord>>>)>,
    labels: Vec<String>,
    backward: usize,
    next_id: u64,
    override_label: Vec<Option<Arc<str>>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
    static COMM_WAIT: std::cell::Cell<std::time::Duration> = const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// Adds time this thread spent blocked waiting for a collective.
pub fn add_comm_wait(d: std::time::Duration) {
    COMM_WAIT.with(|w| w.set(w.get() + d));
}

/// Returns and resets the time this thread spent blocked on collectives (the runtime's own
/// collectives and whatever other layers report with [`add_comm_wait`]).
pub fn take_comm_wait() -> std::time::Duration {
    COMM_WAIT.with(|w| w.replace(std::time::Duration::ZERO))
}

/// Records collectives while alive (on the current thread); see the module docs.
pub struct CommDebugMode {
    id: u64,
    records: Arc<Mutex<Vec<CollectiveRecord>>>,
}

impl CommDebugMode {
    /// Starts recording on the current thread. Recording stops when the value is dropped.
    pub fn start() -> Self {
        let records = Arc::new(Mutex::new(Vec::new()));
        let id = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.next_id += 1;
            let id = s.next_id;
            s.recorders.push((id, records.clone()));
            id
        });
        CommDebugMode { id, records }
    }

    /// Every record so far, in issue order.
    pub fn records(&self) -> Vec<CollectiveRecord> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Forgets the records so far.
    pub fn clear(&self) {
        if let Ok(mut r) = self.records.lock() {
            r.clear();
        }
    }

    /// How many collectives of `kind` ran in `phase`.
    pub fn count(&self, kind: &str, phase: Phase) -> usize {
        self.records()
            .iter()
            .filter(|r| r.kind == kind && r.phase == phase)
            .count()
    }

    /// Counts by (phase, kind).
    pub fn counts(&self) -> BTreeMap<(Phase, &'static str), usize> {
        let mut m = BTreeMap::new();
        for r in self.records() {
            *m.entry((r.phase, r.kind)).or_insert(0) += 1;
        }
        m
    }

    /// Counts by (label, phase, kind).
    pub fn counts_by_label(&self) -> BTreeMap<(String, Phase, &'static str), usize> {
        let mut m = BTreeMap::new();
        for r in self.records() {
            let label = r.label.clone().unwrap_or_else(|| "-".to_string());
            *m.entry((label, r.phase, r.kind)).or_insert(0) += 1;
        }
        m
    }

    /// Total bytes of every recorded collective.
    pub fn total_bytes(&self) -> u64 {
        self.records().iter().map(|r| r.bytes).sum()
    }

    /// A readable table: label, phase, kind, count, bytes.
    pub fn table(&self) -> String {
        let mut rows: BTreeMap<(String, Phase, &'static str), (usize, u64)> = BTreeMap::new();
        for r in self.records() {
            let label = r.label.clone().unwrap_or_else(|| "-".to_string());
            let e = rows.entry((label, r.phase, r.kind)).or_insert((0, 0));
            e.0 += 1;
            e.1 += r.bytes;
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<32} {:<9} {:<16} {:>6} {:>12}",
            "label", "phase", "collective", "count", "bytes"
        );
        for ((label, phase, kind), (count, bytes)) in rows {
            let phase = match phase {
                Phase::Forward => "forward",
                Phase::Backward => "backward",
            };
            let _ = writeln!(
                out,
                "{label:<32} {phase:<9} {kind:<16} {count:>6} {bytes:>12}"
            );
        }
        out
    }
}

impl Drop for CommDebugMode {
    fn drop(&mut self) {
        let id = self.id;
        let _ = STATE.try_with(|s| s.borrow_mut().recorders.retain(|(i, _)| *i != id));
    }
}

/// Pops its label when dropped.
pub struct LabelGuard(());

impl Drop for LabelGuard {
    fn drop(&mut self) {
        let _ = STATE.try_with(|s| s.borrow_mut().labels.pop());
    }
}

/// Labels the collectives issued (and, for their backward, caused) until the guard drops.
/// Labels nest: `label("block0")` then `label("mlp")` records `block0.mlp`.
pub fn label(name: &str) -> LabelGuard {
    STATE.with(|s| s.borrow_mut().labels.push(name.to_string()));
    LabelGuard(())
}

/// The label active now (`None` when no recorder is running, to keep the hot path cheap).
pub(crate) fn current_label() -> Option<Arc<str>> {
    STATE.with(|s| {
        let s = s.borrow();
        if s.recorders.is_empty() {
            return None;
        }
        if let Some(Some(l)) = s.override_label.last() {
            return Some(l.clone());
        }
        (!s.labels.is_empty()).then(|| Arc::from(s.labels.join(".")))
    })
}

/// Marks the current thread as running a backward pass (with the forward op's label) until
/// the guard drops; see [`enter_backward`].
pub struct BackwardGuard(());

impl Drop for BackwardGuard {
    fn drop(&mut self) {
        let _ = STATE.try_with(|s| {
            let mut s = s.borrow_mut();
            s.backward = s.backward.saturating_sub(1);
            s.override_label.pop();
        });
    }
}

/// Marks the current thread as running a backward pass until the guard drops, so collectives
/// recorded meanwhile count as backward (for layers whose own graph nodes issue collectives in
/// their backward, such as FSDP), labelled `label` when given.
pub fn enter_backward(label: Option<&str>) -> BackwardGuard {
    enter_backward_labeled(label.map(Arc::from))
}

pub(crate) fn enter_backward_labeled(label: Option<Arc<str>>) -> BackwardGuard {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.backward += 1;
        s.override_label.push(label);
    });
    BackwardGuard(())
}

/// Records a collective with every active recorder of this thread (for layers that issue
/// collectives themselves, such as FSDP).
pub fn record(kind: &'static str, mesh_dim: &str, bytes: u64) {
    STATE.with(|s| {
        let s = s.borrow();
        if s.recorders.is_empty() {
            return;
        }
        let phase = if s.backward > 0 {
            Phase::Backward
        } else {
            Phase::Forward
        };
        let label = match s.override_label.last() {
            Some(l) => l.as_ref().map(|l| l.to_string()),
            None => (!s.labels.is_empty()).then(|| s.labels.join(".")),
        };
        let rec = CollectiveRecord {
            kind,
            phase,
            label,
            mesh_dim: mesh_dim.to_string(),
            bytes,
        };
        for (_, r) in &s.recorders {
            if let Ok(mut r) = r.lock() {
                r.push(rec.clone());
            }
        }
    })
}
