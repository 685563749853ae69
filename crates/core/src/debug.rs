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
    /// What the communicator's modeled link (`comm::link`, `link.*` hints) says the collective
    /// takes, in microseconds; `None` where the communicator has no link model or the op is
    /// not one the model paces.
    pub modeled_us: Option<f64>,
    /// How long this rank was blocked waiting for the collective, in microseconds, where the
    /// runtime waited for it right away (`None` for collectives waited for elsewhere, such as
    /// FSDP's prefetched gathers). With a link model on the local backend it is at least the
    /// modeled time minus what overlapped before the wait.
    pub waited_us: Option<f64>,
}

#[derive(Default)]
struct State {
    recorders: Vec<(u64, Arc<Mutex<Vec<CollectiveRecord>>>)>,
    /// Where the last [`record_on`] record sits in each recorder, until the next wait.
    pending: Vec<(Arc<Mutex<Vec<CollectiveRecord>>>, usize)>,
    labels: Vec<String>,
    backward: usize,
    next_id: u64,
    override_label: Vec<Option<Arc<str>>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
    static COMM_WAIT: std::cell::Cell<std::time::Duration> = const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// Adds time this thread spent blocked waiting for a collective (and, when the last record
/// was made by [`record_on`], sets that record's `waited_us`).
pub fn add_comm_wait(d: std::time::Duration) {
    COMM_WAIT.with(|w| w.set(w.get() + d));
    let _ = STATE.try_with(|s| {
        for (r, i) in s.borrow_mut().pending.drain(..) {
            if let Ok(mut r) = r.lock() {
                if let Some(rec) = r.get_mut(i) {
                    rec.waited_us = Some(d.as_secs_f64() * 1e6);
                }
            }
        }
    });
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

    /// Summed modeled and waited time (ms) of the records that have them: `(modeled, waited)`,
    /// each `None` when no record has it.
    pub fn modeled_vs_waited_ms(&self) -> (Option<f64>, Option<f64>) {
        sum_times(&self.records())
    }

    /// A readable table: label, phase, kind, count, bytes, and where known the modeled time
    /// (the link model) next to the time this rank waited, in ms.
    pub fn table(&self) -> String {
        let mut rows: BTreeMap<(String, Phase, &'static str), Vec<CollectiveRecord>> =
            BTreeMap::new();
        for r in self.records() {
            let label = r.label.clone().unwrap_or_else(|| "-".to_string());
            rows.entry((label, r.phase, r.kind)).or_default().push(r);
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<32} {:<9} {:<16} {:>6} {:>12} {:>11} {:>10}",
            "label", "phase", "collective", "count", "bytes", "modeled ms", "waited ms"
        );
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
        for ((label, phase, kind), recs) in rows {
            let phase = match phase {
                Phase::Forward => "forward",
                Phase::Backward => "backward",
            };
            let bytes: u64 = recs.iter().map(|r| r.bytes).sum();
            let (modeled, waited) = sum_times(&recs);
            let _ = writeln!(
                out,
                "{label:<32} {phase:<9} {kind:<16} {:>6} {bytes:>12} {:>11} {:>10}",
                recs.len(),
                ms(modeled),
                ms(waited)
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

fn sum_times(recs: &[CollectiveRecord]) -> (Option<f64>, Option<f64>) {
    let sum = |f: fn(&CollectiveRecord) -> Option<f64>| {
        recs.iter()
            .filter_map(f)
            .fold(None, |a: Option<f64>, v| Some(a.unwrap_or(0.0) + v / 1e3))
    };
    (sum(|r| r.modeled_us), sum(|r| r.waited_us))
}

/// The op the link model paces for a record's kind.
fn link_op(kind: &str) -> Option<candle_dtensor_comm::OpName> {
    use candle_dtensor_comm::OpName;
    Some(match kind {
        "all_gather" => OpName::AllGatherSingle,
        "reduce_scatter" => OpName::ReduceScatterSingle,
        "all_reduce" => OpName::AllReduce,
        "all_to_all" => OpName::AllToAllSingle,
        "all_to_all_v" => OpName::AllToAllVSingle,
        "broadcast" => OpName::Broadcast,
        _ => return None,
    })
}

/// Records a collective with every active recorder of this thread (for layers that issue
/// collectives themselves, such as FSDP).
pub fn record(kind: &'static str, mesh_dim: &str, bytes: u64) {
    push(kind, mesh_dim, bytes, None, false)
}

/// Records a collective about to run on `comm` and waited for right away: the record gets the
/// modeled time of `comm`'s link (if it has one) and, from the next [`add_comm_wait`] on this
/// thread, the time waited.
pub fn record_on(kind: &'static str, comm: &candle_dtensor_comm::Comm, mesh_dim: &str, bytes: u64) {
    let active = STATE.with(|s| !s.borrow().recorders.is_empty());
    if !active {
        return;
    }
    let modeled = link_op(kind).and_then(|op| {
        let link =
            candle_dtensor_comm::link::LinkModel::from_hints(&comm.options().hints, comm.name())
                .ok()
                .flatten()?;
        link.time(op, bytes as usize, comm.size())
    });
    push(
        kind,
        mesh_dim,
        bytes,
        modeled.map(|d| d.as_secs_f64() * 1e6),
        true,
    )
}

fn push(kind: &'static str, mesh_dim: &str, bytes: u64, modeled_us: Option<f64>, wait: bool) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.pending.clear();
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
            modeled_us,
            waited_us: None,
        };
        let mut pending = Vec::new();
        for (_, r) in &s.recorders {
            if let Ok(mut v) = r.lock() {
                v.push(rec.clone());
                if wait {
                    pending.push((r.clone(), v.len() - 1));
                }
            }
        }
        s.pending = pending;
    })
}

/// Bytes the autograd graph behind `t` keeps alive for the backward pass: the distinct
/// storages of the tensors that lead to `t` and track gradients, parameters (variables) and
/// views of them excluded, `t` included. This is the activation memory of a step at the end of its forward
/// pass, where it peaks: what activation checkpointing and context parallelism shrink.
///
/// Views share their storage and count once. Counted too: the pre-activation a linear-GELU
/// node keeps (`kernels::region::node_held_bytes`; the linear's output in the plain pair's
/// graph). Not counted: other tensors a custom op's backward keeps in its own closure (the
/// runtime's collectives keep shapes only; context-parallel attention keeps the log-sum-exp,
/// one float per query row and head; a mixed-precision linear its operands cast to bf16),
/// inputs that track no gradient (token ids), memory freed before the graph was built, and
/// released storages (`kernels::storage::release`: FSDP's resharded full parameters).
/// On a DTensor pass its local piece: `graph_bytes(&loss.to_local())` is this rank's share.
pub fn graph_bytes(t: &candle_core::Tensor) -> usize {
    // A storage's extent, as far as the nodes that use it reach (the whole storage whenever
    // the tensor that owns it is in the graph, as a view's base is).
    let nodes = t.sorted_nodes();
    let key = |n: &candle_core::Tensor| {
        let (storage, _) = n.storage_and_layout();
        &*storage as *const candle_core::Storage as usize
    };
    // Views of parameters (a narrowed embedding table) share the parameter's storage.
    let params: std::collections::HashSet<usize> = nodes
        .iter()
        .filter(|n| n.is_variable())
        .map(|n| key(n))
        .collect();
    let mut extent: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    // What nodes keep outside the graph that the graph's own tensors used to hold (a
    // linear-GELU node's pre-activation).
    let mut held = 0;
    for n in nodes {
        // A released storage (FSDP's full parameters between their unit's forward and
        // backward) holds nothing: counting its shape would charge the parameters as
        // activations.
        if n.is_variable() || candle_dtensor_kernels::storage::is_released(n) {
            continue;
        }
        let key = key(n);
        if params.contains(&key) {
            continue;
        }
        let (_, layout) = n.storage_and_layout();
        let reach = (layout.start_offset() + n.elem_count()) * n.dtype().size_in_bytes();
        let e = extent.entry(key).or_insert(0);
        *e = (*e).max(reach);
        held += candle_dtensor_kernels::region::node_held_bytes(n);
    }
    extent.values().sum::<usize>() + held
}

#[cfg(test)]
mod graph_bytes_tests {
    use candle_core::{Device, Tensor, Var};

    #[test]
    fn counts_kept_activations_once_and_not_parameters() -> candle_core::Result<()> {
        let w = Var::from_tensor(&Tensor::ones(100, candle_core::DType::F32, &Device::Cpu)?)?;
        let data = Tensor::ones(100, candle_core::DType::F32, &Device::Cpu)?;
        let y = (w.as_tensor() * 2.0)?; // 400 B
        let z = y.exp()?; // 400 B
        let v = z.narrow(0, 10, 50)?; // a view of z: no new storage
        let wv = w.as_tensor().narrow(0, 0, 10)?; // a view of the parameter: not activation
        let loss = (v.sum_all()? + data.sum_all()?)?; // 4 B (the data's sum tracks nothing)
        let loss = (loss + wv.sum_all()?)?; // 4 + 4 B
        assert_eq!(super::graph_bytes(&loss), 400 + 400 + 4 + 4 + 4 + 4);
        // Nothing tracks gradients: no graph.
        assert_eq!(super::graph_bytes(&data.exp()?.sum_all()?), 0);
        // A released storage (FSDP's resharded full parameters) holds nothing.
        let full = (w.as_tensor() * 1.0)?; // 400 B, a graph node
        let out = full.exp()?.sum_all()?; // 400 + 4 B
        assert_eq!(super::graph_bytes(&out), 400 + 400 + 4);
        candle_dtensor_kernels::storage::release(&full, "full")
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!(super::graph_bytes(&out), 400 + 4);
        Ok(())
    }
}
