//! Op families: shape inference and single-dim strategy rows, one file per family.
//! Each op's family is declared in the op table (`op.rs`); the registries here ([`output_metas`],
//! [`rows`]) dispatch on the family, so adding an op to a family touches only the
//! table and that family's file.

mod attention;
mod embedding;
mod index;
mod loss;
mod matrix;
mod misc;
mod norm;
mod pointwise;
mod reduction;
mod scan;
mod scatter;
mod sort;
mod view;

use smallvec::SmallVec;

use crate::error::{Result, StrategyError};
use crate::op::{Family, Op};
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

/// The families' unit tests: `op`'s single-dim strategy rows on inputs `metas`, rendered.
#[cfg(test)]
pub(crate) fn table_of(op: &Op, metas: &[TensorMeta]) -> Vec<String> {
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    crate::single_dim_strategies(op, &refs)
        .unwrap()
        .iter()
        .map(|r| r.to_string())
        .collect()
}

/// [`table_of`] f32 inputs of `shapes`.
#[cfg(test)]
pub(crate) fn f32_table(op: &Op, shapes: &[&[usize]]) -> Vec<String> {
    let metas: Vec<TensorMeta> = shapes
        .iter()
        .map(|s| TensorMeta::new(s, DType::F32))
        .collect();
    table_of(op, &metas)
}

/// Output metas of `op`: checks the arity declared in the op table, then the op's family.
pub(crate) fn output_metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    if let Some(n) = op.num_inputs() {
        expect_inputs(op, inputs, n)?;
    } else if inputs.is_empty() {
        return Err(StrategyError::arg(op, "needs at least one input"));
    }
    match op.family() {
        Family::Matrix => matrix::metas(op, inputs),
        Family::Pointwise => pointwise::metas(op, inputs),
        Family::Reduction => reduction::metas(op, inputs),
        Family::Norm => norm::metas(op, inputs),
        Family::Embedding => embedding::metas(op, inputs),
        Family::Loss => loss::metas(op, inputs),
        Family::Index => index::metas(op, inputs),
        Family::Attention => attention::metas(op, inputs),
        Family::View => view::metas(op, inputs),
        Family::Misc => misc::metas(op, inputs),
        Family::Scatter => scatter::metas(op, inputs),
        Family::Sort => sort::metas(op, inputs),
        Family::Scan => scan::metas(op, inputs),
    }
}

/// Single-dim rows of `op` (inputs already validated by [`output_metas`]), from its family.
pub(crate) fn rows(
    op: &Op,
    inputs: &[&TensorMeta],
    outs: &[TensorMeta],
) -> Result<Vec<StrategyRow>> {
    Ok(match op.family() {
        Family::Matrix => matrix::rows(op, inputs, outs),
        Family::Pointwise => pointwise::rows(op, inputs, outs),
        Family::Reduction => reduction::rows(op, inputs, outs),
        Family::Norm => norm::rows(op, inputs, outs),
        Family::Embedding => embedding::rows(op, inputs, outs),
        Family::Loss => loss::rows(op, inputs, outs),
        Family::Index => index::rows(op, inputs, outs),
        Family::Attention => attention::rows(op, inputs, outs),
        Family::View => view::rows(op, inputs, outs)?,
        Family::Misc => misc::rows(op, inputs, outs),
        Family::Scatter => scatter::rows(op, inputs, outs),
        Family::Sort => sort::rows(op, inputs, outs),
        Family::Scan => scan::rows(op, inputs, outs),
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
