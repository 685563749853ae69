//! Op-generic entry points: run any compiler [`Op`] on DTensors ([`apply`], [`apply_all`]), or
//! on plain candle tensors on one device ([`reference_apply`], [`reference_apply_all`]: the
//! ground truth tests and `explain --run` compare against). Dropout uses seed 0 in both.
//!
//! Both dispatch on the op's family as the op table declares it (`Op::family`); each family
//! module implements `apply` (the DTensor method) and `single_device` (plain candle) for its ops.

use candle_core::Tensor;
use candle_dtensor_strategies::{Family, Op};

use crate::error::{invalid, Result};
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

/// Calls family module function `$f(op, inputs)` of `op`'s declared family (every family
/// module has `apply`, on DTensors, and `single_device`, its plain-candle reference). The
/// norm, embedding, loss and attention families share `nn`.
macro_rules! by_family {
    ($op:expr, $f:ident, $inputs:expr) => {
        match $op.family() {
            Family::Matrix => super::matrix::$f($op, $inputs),
            Family::Pointwise => super::pointwise::$f($op, $inputs),
            Family::Reduction => super::reduction::$f($op, $inputs),
            Family::Norm | Family::Embedding | Family::Loss | Family::Attention => {
                super::neural::$f($op, $inputs)
            }
            Family::Index => super::index::$f($op, $inputs),
            Family::View => super::view::$f($op, $inputs),
            Family::Misc => super::misc::$f($op, $inputs),
            Family::Scatter => super::scatter::$f($op, $inputs),
            Family::Sort => super::sort::$f($op, $inputs),
            Family::Scan => super::scan::$f($op, $inputs),
        }
    };
}

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
    by_family!(op, apply, inputs)
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
    by_family!(op, single_device, inputs)
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
