//! The pipeline's errors: schedules that break a rule, stage splits that cannot be made, and
//! failures while a schedule runs.

use candle_dtensor_comm::CommError;

use super::actions::Action;

/// A schedule that cannot run: its parameters break the generator's rule, its action lists are
/// malformed, or its dependencies cannot be satisfied. Every variant names the schedule, `p`
/// (stages, one per rank), `m` (micro-batches) and `v` (model chunks per rank).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// The parameters break a rule of the schedule (e.g. interleaved 1F1B needs `m % p == 0`).
    #[error("schedule {schedule} (p={p}, m={m}, v={v}): {rule}")]
    Rule {
        /// The schedule's name.
        schedule: String,
        /// Pipeline stages (ranks).
        p: usize,
        /// Micro-batches.
        m: usize,
        /// Model chunks per rank.
        v: usize,
        /// The rule broken, with the values that break it.
        rule: String,
    },
    /// A rank's action list is malformed: an action missing or repeated, out of range, or a
    /// backward before its forward on the same stage.
    #[error("schedule {schedule} (p={p}, m={m}, v={v}): rank {rank}: {problem}")]
    Order {
        /// The schedule's name.
        schedule: String,
        /// Pipeline stages (ranks).
        p: usize,
        /// Micro-batches.
        m: usize,
        /// Model chunks per rank.
        v: usize,
        /// The rank whose list is wrong.
        rank: usize,
        /// What is wrong.
        problem: String,
    },
    /// A schedule name no generator answers to (`--pp-schedule`).
    #[error("unknown pipeline schedule {name:?}: known are {}", known.join(", "))]
    Unknown {
        /// The name given.
        name: String,
        /// The names a generator answers to.
        known: Vec<&'static str>,
    },
    /// Simulating the action lists got stuck: every rank's next action waits for one that
    /// never runs (the lists would deadlock if executed).
    #[error(
        "schedule {schedule} (p={p}, m={m}, v={v}): deadlock: every rank waits; next actions: {}",
        waiting.iter().map(|(r, a)| format!("rank {r}: {a}")).collect::<Vec<_>>().join(", ")
    )]
    Deadlock {
        /// The schedule's name.
        schedule: String,
        /// Pipeline stages (ranks).
        p: usize,
        /// Micro-batches.
        m: usize,
        /// Model chunks per rank.
        v: usize,
        /// Each unfinished rank and the action it is stuck at.
        waiting: Vec<(usize, Action)>,
    },
}

/// Errors of the pipeline: schedules, stage splits and the executor.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The schedule cannot run.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// Layers cannot be split into the stages asked for.
    #[error("stage split of {layers} layers into {stages} stages: {rule}")]
    Split {
        /// Layers in the model.
        layers: usize,
        /// Stages asked for.
        stages: usize,
        /// The rule broken, with the values that break it.
        rule: String,
    },
    /// The stage, schedule and communicator disagree (ranks, chunks per rank).
    #[error("pipeline setup: {0}")]
    Setup(String),
    /// A stage's forward or backward failed.
    #[error("rank {rank}: {action} failed: {source}")]
    Stage {
        /// The rank whose stage failed.
        rank: usize,
        /// The action that failed.
        action: Action,
        /// The stage's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A point-to-point transfer failed (timeout, peer failure, shape mismatch).
    #[error("rank {rank}: transfer for {action}: {source}")]
    Comm {
        /// The rank that saw the failure.
        rank: usize,
        /// The action the transfer belongs to.
        action: Action,
        /// The communicator's error.
        source: Box<CommError>,
    },
    /// Setting up the point-to-point communicators failed.
    #[error("pipeline communicators: {0}")]
    CommSetup(Box<CommError>),
}

impl From<CommError> for PipelineError {
    fn from(e: CommError) -> Self {
        PipelineError::CommSetup(Box::new(e))
    }
}

/// The error type a [`Stage`](super::Stage) returns: any error (candle's, DTensor's, ...).
pub type StageError = Box<dyn std::error::Error + Send + Sync>;
