//! cumsum along `dim`.
//!
//! Rows: any other dim sharded (every line along `dim` is scanned on its own); `P(sum)` and
//! `P(avg)` pass through (a prefix sum is linear). `dim` itself must be whole (`R`): a shard's
//! prefix sums lack the earlier shards' totals.

use super::{check_dim, p, s};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::ReduceOp;
use crate::spec::TensorMeta;
use crate::strategy::StrategyRow;

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    let Op::Cumsum { dim } = op else {
        return Err(StrategyError::arg(op, "not a scan op"));
    };
    check_dim(op, *dim, x.ndim())?;
    if !x.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("needs a float input, got {x}"),
        ));
    }
    Ok(vec![x.clone()])
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let Op::Cumsum { dim } = op else {
        return Vec::new();
    };
    let mut rows: Vec<StrategyRow> = (0..inputs[0].ndim())
        .filter(|d| d != dim)
        .map(|d| StrategyRow::new(&[s(d)], &[s(d)]))
        .collect();
    for o in [ReduceOp::Sum, ReduceOp::Avg] {
        rows.push(StrategyRow::new(&[p(o)], &[p(o)]));
    }
    rows
}
