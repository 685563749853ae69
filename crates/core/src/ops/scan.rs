//! `cumsum` along a whole dim (other dims sharded, Partial sums pass through).

use candle_core::Tensor;
use candle_dtensor_strategies::Op;

use crate::dispatch::run1;
use crate::error::Result;
use crate::tensor::DTensor;

impl DTensor {
    /// Cumulative sum along `dim` (gathered first when sharded; other dims keep their
    /// sharding, `P(sum)`/`P(avg)` pass through).
    pub fn cumsum(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::Cumsum { dim }, &[self], |p| p.locals[0].cumsum(dim))
    }
}

/// The scan family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    match op {
        Op::Cumsum { dim } => Ok(vec![x[0].cumsum(*dim)?]),
        _ => Err(super::wrong_family(op, x)),
    }
}

/// The scan family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    match op {
        Op::Cumsum { dim } => Ok(vec![inputs[0].cumsum(*dim)?]),
        _ => Err(super::ref_wrong_family(op)),
    }
}
