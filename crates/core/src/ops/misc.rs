//! The misc family's dispatch: cat, stack, contiguous, to_dtype, where, masked_fill, dropout
//! (the DTensor methods live with the views and the elementwise ops).

use candle_core::Tensor;
use candle_dtensor_strategies::Op;

use super::pointwise::dropout_mask_full;
use crate::convert::cdtype;
use crate::error::Result;
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

/// `x` with `before` and `after` entries of `value` around `dim`.
fn pad_local(x: &Tensor, dim: usize, before: usize, after: usize, value: f64) -> CResult<Tensor> {
    let fill = |n: usize| -> CResult<Tensor> {
        let mut shape = x.dims().to_vec();
        shape[dim] = n;
        Tensor::full(value, shape, x.device())?.to_dtype(x.dtype())
    };
    let mut parts = Vec::with_capacity(3);
    if before > 0 {
        parts.push(fill(before)?);
    }
    parts.push(x.clone());
    if after > 0 {
        parts.push(fill(after)?);
    }
    if parts.len() == 1 {
        return Ok(x.clone());
    }
    Tensor::cat(&parts, dim)
}

impl DTensor {
    /// Pads `dim` with `before` and `after` entries of `value` (the dim is gathered first when
    /// sharded; other dims keep their sharding; `P(avg|max|min)` pass, `P(sum)` for `value == 0`).
    pub fn pad(&self, dim: usize, before: usize, after: usize, value: f64) -> Result<DTensor> {
        let op = Op::Pad {
            dim,
            before,
            after,
            value: value.into(),
        };
        crate::dispatch::run1(&op, &[self], |p| {
            pad_local(&p.locals[0], dim, before, after, value)
        })
    }
}

/// The misc family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    let a = x[0];
    Ok(vec![match op {
        Op::Cat { dim } => DTensor::cat(x, *dim)?,
        Op::Stack { dim } => DTensor::stack(x, *dim)?,
        Op::Contiguous => a.contiguous()?,
        Op::ToDType(d) => a.to_dtype(cdtype(*d))?,
        Op::Where => a.where_cond(x[1], x[2])?,
        Op::MaskedFill { value } => a.masked_fill(x[1], value.get())?,
        Op::Dropout { p } => a.dropout(p.get(), 0)?,
        Op::Pad {
            dim,
            before,
            after,
            value,
        } => a.pad(*dim, *before, *after, value.get())?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

/// The misc family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    let x = &inputs[0];
    Ok(vec![match op {
        Op::Cat { dim } => Tensor::cat(inputs, *dim)?,
        Op::Stack { dim } => Tensor::stack(inputs, *dim)?,
        Op::Contiguous => x.contiguous()?,
        Op::ToDType(d) => x.to_dtype(cdtype(*d))?,
        Op::Where => {
            let shape = x
                .shape()
                .broadcast_shape_binary_op(inputs[1].shape(), "where")?;
            let shape = shape.broadcast_shape_binary_op(inputs[2].shape(), "where")?;
            x.broadcast_as(shape.dims())?.where_cond(
                &inputs[1].broadcast_as(shape.dims())?,
                &inputs[2].broadcast_as(shape.dims())?,
            )?
        }
        Op::MaskedFill { value } => {
            let m = inputs[1].broadcast_as(x.dims())?;
            let v = Tensor::full(value.get(), x.dims(), x.device())?.to_dtype(x.dtype())?;
            m.where_cond(&v, x)?
        }
        Op::Dropout { p } => {
            let p = p.get();
            let keep = Tensor::from_vec(dropout_mask_full(x.dims(), p, 0), x.dims(), x.device())?
                .to_dtype(x.dtype())?;
            x.mul(&keep)?.affine(1.0 / (1.0 - p), 0.0)?
        }
        Op::Pad {
            dim,
            before,
            after,
            value,
        } => pad_local(x, *dim, *before, *after, value.get())?,
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
