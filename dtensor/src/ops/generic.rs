//! Op-generic entry points: run any compiler [`Op`] on DTensors ([`apply`], [`apply_all`]), or
//! on plain candle tensors on one device ([`reference_apply`], [`reference_apply_all`]: the
//! ground truth tests and `explain --run` compare against). Dropout uses seed 0 in both.
//!
//! Both dispatch on the op's family as the op table declares it (`Op::family`); each family
//! module implements `apply` (the DTensor method) and `reference` (plain candle) for its ops.

use candle_core::Tensor;
use candle_dtensor_strategies::{Family, Op};

use crate::error::{invalid, Result};
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

/// The op table's arity of `op`, checked against `n` inputs.
fn check_arity(op: &Op, n: usize) -> std::result::Result<(), String> {
    match op.num_inputs() {
        Some(want) if want != n => Err(format!("takes {want} inputs, got {n}")),
        None if n == 0 => Err("needs at least one input".into()),
        _ => Ok(()),
    }
}

/// Runs `op` on DTensor `inputs` (in the compiler's input order) and returns its outputs.
///
/// # Errors
/// A wrong number of inputs, and every error of the op itself.
pub fn apply_all(op: &Op, inputs: &[&DTensor]) -> Result<Vec<DTensor>> {
    let rank = inputs.first().map_or(0, |x| x.mesh_rank());
    check_arity(op, inputs.len()).map_err(|m| invalid(op.name(), rank, m))?;
    match op.family() {
        Family::Matrix => super::matrix::apply(op, inputs),
        Family::Pointwise => super::pointwise::apply(op, inputs),
        Family::Reduction => super::reduction::apply(op, inputs),
        Family::Norm | Family::Embedding | Family::Loss | Family::Attention => {
            super::nn::apply(op, inputs)
        }
        Family::Index => super::index::apply(op, inputs),
        Family::View => super::view::apply(op, inputs),
        Family::Misc => super::misc::apply(op, inputs),
        Family::Scatter => super::scatter::apply(op, inputs),
        Family::Sort => super::sort::apply(op, inputs),
        Family::Scan => super::scan::apply(op, inputs),
    }
}

/// Runs a single-output `op` on DTensor `inputs` (see [`apply_all`]).
///
/// # Errors
/// As [`apply_all`], and an op with several outputs.
pub fn apply(op: &Op, inputs: &[&DTensor]) -> Result<DTensor> {
    let rank = inputs.first().map_or(0, |x| x.mesh_rank());
    single(apply_all(op, inputs)?)
        .map_err(|n| invalid(op.name(), rank, format!("has {n} outputs; use apply_all")))
}

/// Runs `op` on one device with plain candle ops: the single-device reference, all outputs.
///
/// # Errors
/// A wrong number of inputs, and candle's errors.
pub fn reference_apply_all(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    check_arity(op, inputs.len()).map_err(|m| candle_core::Error::Msg(format!("{op}: {m}")))?;
    match op.family() {
        Family::Matrix => super::matrix::reference(op, inputs),
        Family::Pointwise => super::pointwise::reference(op, inputs),
        Family::Reduction => super::reduction::reference(op, inputs),
        Family::Norm | Family::Embedding | Family::Loss | Family::Attention => {
            super::nn::reference_op(op, inputs)
        }
        Family::Index => super::index::reference(op, inputs),
        Family::View => super::view::reference(op, inputs),
        Family::Misc => super::misc::reference(op, inputs),
        Family::Scatter => super::scatter::reference(op, inputs),
        Family::Sort => super::sort::reference(op, inputs),
        Family::Scan => super::scan::reference(op, inputs),
    }
}

/// Runs a single-output `op` on one device (see [`reference_apply_all`]).
///
/// # Errors
/// As [`reference_apply_all`], and an op with several outputs.
pub fn reference_apply(op: &Op, inputs: &[Tensor]) -> CResult<Tensor> {
    single(reference_apply_all(op, inputs)?).map_err(|n| {
        candle_core::Error::Msg(format!("{op}: has {n} outputs; use reference_apply_all"))
    })
}

fn single<T>(mut v: Vec<T>) -> std::result::Result<T, usize> {
    if v.len() == 1 {
        Ok(v.remove(0))
    } else {
        Err(v.len())
    }
}

/// `dims`, or every dim of a rank-`rank` tensor when empty (the compiler's "all dims").
pub(crate) fn dims_or_all(dims: &[usize], rank: usize) -> Vec<usize> {
    if dims.is_empty() {
        (0..rank).collect()
    } else {
        dims.to_vec()
    }
}
