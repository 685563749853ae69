//! `topk` along a whole dim: the values (a `gather`, so differentiable) and their indices
//! (`u32`), ordered, the lower index first on ties (the order is decided here, not by candle's
//! unstable sort, so every layout picks exactly the entries one device picks).

use std::cmp::Ordering;

use candle_core::{DType, Tensor};
use candle_dtensor_strategies::Op;

use crate::dispatch::prepare;
use crate::error::{Context, Result};
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

/// The indices (`u32`, along `dim`) of the `k` largest (or smallest) entries of every line of
/// `x` along `dim`, in order; ties keep the lower index first, NaN counts as the largest.
pub(crate) fn topk_indices(x: &Tensor, k: usize, dim: usize, largest: bool) -> CResult<Tensor> {
    let n = x.dim(dim)?;
    if k > n {
        return Err(candle_core::Error::Msg(format!(
            "topk: k = {k} but dim {dim} of {:?} has only {n} entries",
            x.dims()
        )));
    }
    let last = x.rank() - 1;
    let t = x.detach().transpose(dim, last)?.contiguous()?;
    let mut out_dims = t.dims().to_vec();
    out_dims[last] = k;
    let vals: Vec<f64> = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let lines = vals.len().checked_div(n).unwrap_or(0);
    let mut idx: Vec<u32> = Vec::with_capacity(lines * k);
    let mut order: Vec<usize> = (0..n).collect();
    for line in 0..lines {
        let row = &vals[line * n..(line + 1) * n];
        order.iter_mut().enumerate().for_each(|(i, o)| *o = i);
        let cmp = |a: &usize, b: &usize| -> Ordering {
            let by_value = if largest {
                row[*b].total_cmp(&row[*a])
            } else {
                row[*a].total_cmp(&row[*b])
            };
            by_value.then(a.cmp(b))
        };
        if k < n && k > 0 {
            order.select_nth_unstable_by(k - 1, cmp);
        }
        order[..k].sort_unstable_by(cmp);
        idx.extend(order[..k].iter().map(|&i| i as u32));
    }
    Tensor::from_vec(idx, out_dims, x.device())?
        .transpose(dim, last)?
        .contiguous()
}

impl DTensor {
    /// The `k` largest (`largest`) or smallest entries along `dim` and their indices (`u32`,
    /// positions along `dim`), in order; the lower index first on ties. Differentiable in the
    /// values (each selected entry gets its output's gradient). `dim` is gathered first when
    /// sharded; any other dim keeps its sharding (token routing of a mixture of experts: scores
    /// `[tokens, experts]` sharded over tokens, topk over experts, no communication).
    pub fn topk(&self, k: usize, dim: usize, largest: bool) -> Result<(DTensor, DTensor)> {
        let op = Op::TopK { k, dim, largest };
        let rank = self.mesh_rank();
        let p = prepare(&op, &[self])?;
        let x = &p.locals[0];
        let idx = topk_indices(x, k, dim, largest).ctx(op.name(), rank)?;
        let values = x.gather(&idx, dim).ctx(op.name(), rank)?;
        let mut outs = p.finish(&op, vec![values, idx])?.into_iter();
        match (outs.next(), outs.next()) {
            (Some(v), Some(i)) => Ok((v, i)),
            _ => Err(crate::error::invalid(
                op.name(),
                rank,
                "internal: topk has two outputs",
            )),
        }
    }
}

/// The sort family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    match op {
        Op::TopK { k, dim, largest } => {
            let (v, i) = x[0].topk(*k, *dim, *largest)?;
            Ok(vec![v, i])
        }
        _ => Err(super::wrong_family(op, x)),
    }
}

/// The sort family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    match op {
        Op::TopK { k, dim, largest } => {
            let idx = topk_indices(&inputs[0], *k, *dim, *largest)?;
            Ok(vec![inputs[0].gather(&idx, *dim)?, idx])
        }
        _ => Err(super::ref_wrong_family(op)),
    }
}
