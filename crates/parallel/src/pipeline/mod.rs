//! Pipeline parallelism: schedules as data, a simulator, and one executor.
//!
//! - [`schedule`]: a [`Schedule`] is, per rank, the ordered list of compute [`Action`]s
//!   (`Forward`, `Backward`, or zero-bubble's `BackwardInput` / `BackwardWeight`) on
//!   micro-batches and model chunks. Generators: GPipe, 1F1B, Megatron's interleaved 1F1B,
//!   ZB-H1. Transfers are implied, not listed (see [`schedule`]).
//! - [`sim`]: unit-time simulation of the lists ([`CostModel`]) and the bubble fraction.
pub mod error;
pub mod schedule;
pub mod sim;

pub use error::{PipelineError, ScheduleError, StageError};
pub use schedule::{Action, Schedule, ScheduleKind};
pub use sim::{CostModel, Slot, Timeline};

#[cfg(test)]
mod tests;
