//! A stage whose actions take modelled times: each action sleeps for its [`CostModel`] cost
//! in units of a given duration (divided by the schedule's chunks per rank, as the cost model
//! counts a rank's whole share of the model). It computes nothing, so a run measures what the
//! schedule and the executor cost on a machine whose stages are exactly balanced: the bubble
//! `examples/pipeline_bench.rs` holds against the simulator, and the executor's overhead on
//! top of it (transfers, thread wake-ups, sleep overshoot).

use std::time::Duration;

use candle_core::{DType, Device, Shape, Tensor};

use super::error::{PipelineError, StageError};
use super::executor::Stage;
use super::sim::CostModel;

/// A [`Stage`] that sleeps for its modelled action times and passes a one-element activation.
#[derive(Debug, Clone)]
pub struct TimedStage {
    cost: CostModel,
    unit: Duration,
    chunks: u32,
}

impl TimedStage {
    /// Actions take `cost` units of `unit` each, split over `chunks` chunks per rank (the
    /// schedule's virtual stages, [`Schedule::chunks`](super::Schedule::chunks)).
    ///
    /// # Errors
    ///
    /// [`PipelineError::Setup`] for a cost that is negative, NaN or infinite
    /// ([`CostModel::check`]).
    pub fn new(cost: CostModel, unit: Duration, chunks: usize) -> Result<Self, PipelineError> {
        cost.check().map_err(PipelineError::Setup)?;
        Ok(TimedStage {
            cost,
            unit,
            chunks: u32::try_from(chunks.max(1)).unwrap_or(u32::MAX),
        })
    }

    fn take(&self, units: f64) -> Result<Tensor, StageError> {
        // `units` is one of the checked costs: finite and >= 0.
        std::thread::sleep(self.unit.mul_f64(units) / self.chunks);
        Ok(Tensor::zeros(1, DType::F32, &Device::Cpu)?)
    }
}

impl Stage for TimedStage {
    fn forward(&mut self, _: usize, _: usize, _: Option<Tensor>) -> Result<Tensor, StageError> {
        self.take(self.cost.forward)
    }

    fn backward(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        self.take(self.cost.backward).map(Some)
    }

    fn backward_input(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        self.take(self.cost.backward_input).map(Some)
    }

    fn backward_weight(&mut self, _: usize, _: usize) -> Result<(), StageError> {
        self.take(self.cost.backward_weight).map(|_| ())
    }

    fn input_shape(&self, _: usize, _: usize) -> Result<(Shape, DType), StageError> {
        Ok((1.into(), DType::F32))
    }

    fn output_shape(&self, _: usize, _: usize) -> Result<(Shape, DType), StageError> {
        Ok((1.into(), DType::F32))
    }
}
