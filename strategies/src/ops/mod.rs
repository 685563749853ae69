//! Op families: shape inference and single-dim strategy rows, one file per family.
//! The op -> family registry is one `match` ([`output_metas`], [`rows`]).

mod attention;
mod embedding;
mod index;
mod loss;
mod matrix;
mod misc;
mod norm;
mod pointwise;
mod reduction;
mod view;

use smallvec::SmallVec;

use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::{Placement, ReduceOp};
use crate::spec::{shape_str, DType, Shape, TensorMeta};
use crate::strategy::StrategyRow;

pub(crate) const R: Placement = Placement::Replicate;
pub(crate) const PSUM: Placement = Placement::Partial(ReduceOp::Sum);
pub(crate) const PAVG: Placement = Placement::Partial(ReduceOp::Avg);
pub(crate) const PMAX: Placement = Placement::Partial(ReduceOp::Max);
pub(crate) const PMIN: Placement = Placement::Partial(ReduceOp::Min);

pub(crate) fn s(d: usize) -> Placement {
    Placement::Shard(d)
}

pub(crate) fn p(op: ReduceOp) -> Placement {
    Placement::Partial(op)
}

/// Output metas of `op` (the registry).
pub(crate) fn output_metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    if let Some(n) = op.num_inputs() {
        expect_inputs(op, inputs, n)?;
    } else if inputs.is_empty() {
        return Err(StrategyError::arg(op, "needs at least one input"));
    }
    let out = match op {
        Op::Matmul | Op::BroadcastMatmul | Op::Linear { .. } => matrix::metas(op, inputs)?,
        Op::Unary(_) | Op::Affine { .. } | Op::ScalarOp(..) | Op::Binary(_) | Op::Cmp(_) => {
            pointwise::metas(op, inputs)?
        }
        Op::Sum { .. } | Op::Mean { .. } | Op::Max { .. } | Op::Min { .. } | Op::ArgMax { .. } => {
            reduction::metas(op, inputs)?
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            norm::metas(op, inputs)?
        }
        Op::Embedding => embedding::metas(op, inputs)?,
        Op::CrossEntropy => loss::metas(op, inputs)?,
        Op::IndexSelect { .. } | Op::Gather { .. } => index::metas(op, inputs)?,
        Op::Sdpa { .. } => attention::metas(op, inputs)?,
        Op::PackedSdpa { .. } => attention::packed_metas(op, inputs)?,
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Permute { .. }
        | Op::Narrow { .. }
        | Op::Squeeze { .. }
        | Op::Unsqueeze { .. }
        | Op::BroadcastAs { .. }
        | Op::Flatten { .. } => view::metas(op, inputs)?,
        Op::Cat { .. }
        | Op::Stack { .. }
        | Op::Contiguous
        | Op::ToDType(_)
        | Op::Where
        | Op::MaskedFill { .. }
        | Op::Dropout { .. } => misc::metas(op, inputs)?,
    };
    Ok(out)
}

/// Single-dim rows of `op` (inputs already validated by [`output_metas`]).
pub(crate) fn rows(
    op: &Op,
    inputs: &[&TensorMeta],
    outs: &[TensorMeta],
) -> Result<Vec<StrategyRow>> {
    Ok(match op {
        Op::Matmul | Op::BroadcastMatmul | Op::Linear { .. } => matrix::rows(op, inputs, outs),
        Op::Unary(_) | Op::Affine { .. } | Op::ScalarOp(..) | Op::Binary(_) | Op::Cmp(_) => {
            pointwise::rows(op, inputs, outs)
        }
        Op::Sum { .. } | Op::Mean { .. } | Op::Max { .. } | Op::Min { .. } | Op::ArgMax { .. } => {
            reduction::rows(op, inputs)
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            norm::rows(op, inputs)
        }
        Op::Embedding => embedding::rows(inputs),
        Op::CrossEntropy => loss::rows(inputs),
        Op::IndexSelect { .. } | Op::Gather { .. } => index::rows(op, inputs, outs),
        Op::Sdpa { .. } => attention::rows(),
        Op::PackedSdpa { .. } => attention::packed_rows(),
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Permute { .. }
        | Op::Narrow { .. }
        | Op::Squeeze { .. }
        | Op::Unsqueeze { .. }
        | Op::BroadcastAs { .. }
        | Op::Flatten { .. } => view::rows(op, inputs, outs)?,
        Op::Cat { .. }
        | Op::Stack { .. }
        | Op::Contiguous
        | Op::ToDType(_)
        | Op::Where
        | Op::MaskedFill { .. }
        | Op::Dropout { .. } => misc::rows(op, inputs, outs),
    })
}

pub(crate) fn expect_inputs(op: &Op, inputs: &[&TensorMeta], n: usize) -> Result<()> {
    if inputs.len() != n {
        return Err(StrategyError::arg(
            op,
            format!("expects {n} inputs, got {}", inputs.len()),
        ));
    }
    Ok(())
}

pub(crate) fn check_dim(op: &Op, dim: usize, ndim: usize) -> Result<()> {
    if dim >= ndim {
        return Err(StrategyError::arg(
            op,
            format!("dim {dim} out of range for a {ndim}-d tensor"),
        ));
    }
    Ok(())
}

pub(crate) fn expect_int(op: &Op, what: &str, m: &TensorMeta) -> Result<()> {
    if !m.dtype.is_int() {
        return Err(StrategyError::shape(
            op,
            format!("{what} must be an integer tensor, got {}", m.dtype),
        ));
    }
    Ok(())
}

pub(crate) fn expect_same_dtype(op: &Op, a: &TensorMeta, b: &TensorMeta) -> Result<()> {
    if a.dtype != b.dtype {
        return Err(StrategyError::shape(
            op,
            format!("dtypes differ: {} vs {}", a.dtype, b.dtype),
        ));
    }
    Ok(())
}

/// Numpy broadcasting of several shapes (right-aligned; sizes equal or 1).
pub(crate) fn broadcast_shapes(op: &Op, shapes: &[&[usize]]) -> Result<Shape> {
    let nd = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out: Shape = smallvec::smallvec![1; nd];
    for sh in shapes {
        let off = nd - sh.len();
        for (i, &d) in sh.iter().enumerate() {
            let o = &mut out[off + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                let all: Vec<String> = shapes.iter().map(|s| shape_str(s)).collect();
                return Err(StrategyError::shape(
                    op,
                    format!("shapes do not broadcast: {}", all.join(" vs ")),
                ));
            }
        }
    }
    Ok(out)
}

/// Input dim feeding output dim `i` without broadcasting (`None`: the input is broadcast there).
pub(crate) fn bcast_map(out: &[usize], input: &[usize], i: usize) -> Option<usize> {
    let off = out.len().checked_sub(input.len())?;
    let d = i.checked_sub(off)?;
    (input[d] == out[i]).then_some(d)
}

/// Pointwise shard rows: for each output dim, shard it on every non-broadcast input (broadcast
/// inputs stay `R`). Rows where no input is sharded are skipped (the local op could not produce a
/// chunk).
pub(crate) fn pointwise_shard_rows(
    out: &[usize],
    ins: &[&[usize]],
    n_out: usize,
) -> Vec<StrategyRow> {
    let mut rows = Vec::new();
    for i in 0..out.len() {
        let inputs: SmallVec<[Placement; 4]> = ins
            .iter()
            .map(|sh| bcast_map(out, sh, i).map(s).unwrap_or(R))
            .collect();
        if inputs.iter().all(|p| p.is_replicate()) {
            continue;
        }
        rows.push(StrategyRow::new(&vec![s(i); n_out], &inputs));
    }
    rows
}

pub(crate) fn meta(shape: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(shape, dtype)
}
