//! Pipeline parallelism: schedules as data, a simulator, and one executor.
//!
//! - [`actions`]: a [`Schedule`] is, per rank, the ordered list of compute [`Action`]s
//!   (`Forward`, `Backward`, or zero-bubble's `BackwardInput` / `BackwardWeight`) on
//!   micro-batches and model chunks. Generators: GPipe, 1F1B, Megatron's interleaved 1F1B,
//!   ZB-H1, ZB-V (two chunks per rank placed in a V). Transfers are implied, not listed (see
//!   [`actions`]).
//! - [`sim`]: unit-time simulation of the lists ([`CostModel`]) and the bubble fraction.
//! - [`stages`]: layers into stages, balanced by parameter count or explicit.
//! - [`timed`]: a stage of modelled action times, for measuring schedules ([`TimedStage`]).
//! - [`executor`]: the [`Stage`] trait (one rank's chunks: forward, backward, or zero-bubble's
//!   split backward) and [`run_schedule`], which runs any schedule over point-to-point
//!   transfers ([`PipeComms`]: one communicator per stream, [`PipeComms::for_schedule`] the
//!   ones a schedule uses) and measures busy and idle time ([`PipelineReport`]).
pub mod actions;
pub mod error;
pub mod executor;
pub mod sim;
pub mod stages;
pub mod timed;

pub use actions::{Action, Schedule, ScheduleKind};
pub use error::{PipelineError, ScheduleError, StageError};
pub use executor::{run_schedule, PipeComms, PipelineReport, Stage, StepTime};
pub use sim::{CostModel, Slot, Timeline};
pub use stages::{split_balanced, split_explicit};
pub use timed::TimedStage;

#[cfg(test)]
mod tests;
