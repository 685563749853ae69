//! Op-generic entry points: run any compiler [`Op`] on DTensors ([`apply`]), or on plain candle
//! tensors on one device ([`reference_apply`], the ground truth tests and `explain --run`
//! compare against). Dropout uses seed 0 in both.

use candle_core::{DType, Tensor};
use candle_dtensor_strategies::{BinaryOp, CmpOp, Op, ScalarOp, UnaryOp};

use super::nn::reference;
use super::pointwise::dropout_mask_full;
use crate::error::{invalid, Result};
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

fn dims_or_all(dims: &[usize], rank: usize) -> Vec<usize> {
    if dims.is_empty() {
        (0..rank).collect()
    } else {
        dims.to_vec()
    }
}

fn arity(op: &Op, n: usize, want: &[usize], rank: usize) -> Result<()> {
    if !want.contains(&n) {
        return Err(invalid(
            op.name(),
            rank,
            format!("takes {want:?} inputs, got {n}"),
        ));
    }
    Ok(())
}

/// Runs `op` on DTensor `inputs` (in the compiler's input order).
pub fn apply(op: &Op, inputs: &[&DTensor]) -> Result<DTensor> {
    let rank = inputs.first().map_or(0, |x| x.mesh_rank());
    let x = *inputs
        .first()
        .ok_or_else(|| invalid(op.name(), rank, "needs at least one input"))?;
    let n = inputs.len();
    match op {
        Op::Matmul => {
            arity(op, n, &[2], rank)?;
            x.matmul(inputs[1])
        }
        Op::BroadcastMatmul => {
            arity(op, n, &[2], rank)?;
            x.broadcast_matmul(inputs[1])
        }
        Op::Linear { bias } => {
            arity(op, n, if *bias { &[3] } else { &[2] }, rank)?;
            x.linear(inputs[1], inputs.get(2).copied())
        }
        Op::Unary(u) => x.unary(*u),
        Op::Affine { mul, add } => x.affine(mul.get(), add.get()),
        Op::ScalarOp(s, v) => {
            let v = v.get();
            match s {
                ScalarOp::Add => x.add_scalar(v),
                ScalarOp::Sub => x.sub_scalar(v),
                ScalarOp::Mul => x.mul_scalar(v),
                ScalarOp::Div => x.div_scalar(v),
                ScalarOp::Pow => x.powf(v),
                ScalarOp::Maximum => x.maximum_scalar(v),
                ScalarOp::Minimum => x.minimum_scalar(v),
            }
        }
        Op::Binary(b) => {
            arity(op, n, &[2], rank)?;
            x.binary(*b, inputs[1])
        }
        Op::Cmp(c) => {
            arity(op, n, &[2], rank)?;
            x.cmp(*c, inputs[1])
        }
        Op::Sum { dims, keepdim } => x.sum(&dims_or_all(dims, x.rank()), *keepdim),
        Op::Mean { dims, keepdim } => x.mean(&dims_or_all(dims, x.rank()), *keepdim),
        Op::Max { dims, keepdim } => x.max(&dims_or_all(dims, x.rank()), *keepdim),
        Op::Min { dims, keepdim } => x.min(&dims_or_all(dims, x.rank()), *keepdim),
        Op::ArgMax { dim, keepdim } => x.argmax(*dim, *keepdim),
        Op::Softmax { dim } => x.softmax(*dim),
        Op::LogSoftmax { dim } => x.log_softmax(*dim),
        Op::LayerNorm { eps, affine, bias } => {
            let w = if *affine {
                inputs.get(1).copied()
            } else {
                None
            };
            let b = if *bias { inputs.get(2).copied() } else { None };
            x.layer_norm(w, b, eps.get())
        }
        Op::RmsNorm { eps } => {
            arity(op, n, &[2], rank)?;
            x.rms_norm(inputs[1], eps.get())
        }
        Op::Embedding => {
            arity(op, n, &[2], rank)?;
            x.embedding(inputs[1])
        }
        Op::CrossEntropy => {
            arity(op, n, &[2], rank)?;
            x.cross_entropy(inputs[1])
        }
        Op::Reshape { shape } => x.reshape(shape),
        Op::Transpose { dim0, dim1 } => x.transpose(*dim0, *dim1),
        Op::Permute { dims } => x.permute(dims),
        Op::Narrow { dim, start, len } => x.narrow(*dim, *start, *len),
        Op::Squeeze { dim } => x.squeeze(*dim),
        Op::Unsqueeze { dim } => x.unsqueeze(*dim),
        Op::BroadcastAs { shape } => x.broadcast_as(shape),
        Op::Flatten { start, end } => x.flatten(*start, *end),
        Op::Cat { dim } => DTensor::cat(inputs, *dim),
        Op::Stack { dim } => DTensor::stack(inputs, *dim),
        Op::Contiguous => x.contiguous(),
        Op::ToDType(d) => x.to_dtype(crate::convert::cdtype(*d)),
        Op::Where => {
            arity(op, n, &[3], rank)?;
            x.where_cond(inputs[1], inputs[2])
        }
        Op::MaskedFill { value } => {
            arity(op, n, &[2], rank)?;
            x.masked_fill(inputs[1], value.get())
        }
        Op::Dropout { p } => x.dropout(p.get(), 0),
        Op::Sdpa { causal, scale } => {
            arity(op, n, &[3], rank)?;
            x.sdpa(inputs[1], inputs[2], *causal, scale.map(|s| s.get()))
        }
        Op::PackedSdpa { causal, scale } => x.packed_sdpa(*causal, scale.map(|s| s.get())),
        Op::IndexSelect { dim } => {
            arity(op, n, &[2], rank)?;
            x.index_select(inputs[1], *dim)
        }
        Op::Gather { dim } => {
            arity(op, n, &[2], rank)?;
            x.gather(inputs[1], *dim)
        }
    }
}

fn unary_ref(u: UnaryOp, x: &Tensor) -> CResult<Tensor> {
    match u {
        UnaryOp::Neg => x.neg(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Relu => x.relu(),
        UnaryOp::Gelu => x.gelu(),
        UnaryOp::GeluErf => x.gelu_erf(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => (x.neg()?.exp()? + 1.0)?.recip(),
        UnaryOp::Silu => x.silu(),
        UnaryOp::Sqr => x.sqr(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Recip => x.recip(),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
    }
}

fn extreme_ref(x: &Tensor, dims: &[usize], keepdim: bool, max: bool) -> CResult<Tensor> {
    let mut r = x.clone();
    for &d in dims {
        r = if max {
            r.max_keepdim(d)?
        } else {
            r.min_keepdim(d)?
        };
    }
    if !keepdim {
        let mut s = dims.to_vec();
        s.sort_unstable_by(|a, b| b.cmp(a));
        for d in s {
            r = r.squeeze(d)?;
        }
    }
    Ok(r)
}

fn need(inputs: &[Tensor], n: usize, op: &Op) -> CResult<()> {
    if inputs.len() < n {
        return Err(candle_core::Error::Msg(format!(
            "{op}: needs {n} inputs, got {}",
            inputs.len()
        )));
    }
    Ok(())
}

/// Runs `op` on one device with plain candle ops: the single-device reference.
pub fn reference_apply(op: &Op, inputs: &[Tensor]) -> CResult<Tensor> {
    need(inputs, 1, op)?;
    let x = &inputs[0];
    Ok(match op {
        Op::Matmul => {
            need(inputs, 2, op)?;
            x.matmul(&inputs[1])?
        }
        Op::BroadcastMatmul => {
            need(inputs, 2, op)?;
            x.broadcast_matmul(&inputs[1])?
        }
        Op::Linear { bias } => {
            need(inputs, 2, op)?;
            let y = if x.rank() == 1 {
                x.unsqueeze(0)?.matmul(&inputs[1].t()?)?.squeeze(0)?
            } else {
                x.broadcast_matmul(&inputs[1].t()?)?
            };
            if *bias {
                need(inputs, 3, op)?;
                y.broadcast_add(&inputs[2])?
            } else {
                y
            }
        }
        Op::Unary(u) => unary_ref(*u, x)?,
        Op::Affine { mul, add } => x.affine(mul.get(), add.get())?,
        Op::ScalarOp(s, v) => {
            let v = v.get();
            match s {
                ScalarOp::Add => (x + v)?,
                ScalarOp::Sub => (x - v)?,
                ScalarOp::Mul => (x * v)?,
                ScalarOp::Div => (x / v)?,
                ScalarOp::Pow => x.powf(v)?,
                ScalarOp::Maximum => x.maximum(v)?,
                ScalarOp::Minimum => x.minimum(v)?,
            }
        }
        Op::Binary(b) => {
            need(inputs, 2, op)?;
            let y = &inputs[1];
            match b {
                BinaryOp::Add => x.broadcast_add(y)?,
                BinaryOp::Sub => x.broadcast_sub(y)?,
                BinaryOp::Mul => x.broadcast_mul(y)?,
                BinaryOp::Div => x.broadcast_div(y)?,
                BinaryOp::Maximum => x.broadcast_maximum(y)?,
                BinaryOp::Minimum => x.broadcast_minimum(y)?,
            }
        }
        Op::Cmp(c) => {
            need(inputs, 2, op)?;
            let y = &inputs[1];
            match c {
                CmpOp::Eq => x.broadcast_eq(y)?,
                CmpOp::Ne => x.broadcast_ne(y)?,
                CmpOp::Lt => x.broadcast_lt(y)?,
                CmpOp::Le => x.broadcast_le(y)?,
                CmpOp::Gt => x.broadcast_gt(y)?,
                CmpOp::Ge => x.broadcast_ge(y)?,
            }
        }
        Op::Sum { dims, keepdim } => {
            let d = dims_or_all(dims, x.rank());
            if *keepdim {
                x.sum_keepdim(d)?
            } else {
                x.sum(d)?
            }
        }
        Op::Mean { dims, keepdim } => {
            let d = dims_or_all(dims, x.rank());
            if *keepdim {
                x.mean_keepdim(d)?
            } else {
                x.mean(d)?
            }
        }
        Op::Max { dims, keepdim } => extreme_ref(x, &dims_or_all(dims, x.rank()), *keepdim, true)?,
        Op::Min { dims, keepdim } => extreme_ref(x, &dims_or_all(dims, x.rank()), *keepdim, false)?,
        Op::ArgMax { dim, keepdim } => {
            if *keepdim {
                x.argmax_keepdim(*dim)?
            } else {
                x.argmax(*dim)?
            }
        }
        Op::Softmax { dim } => reference::softmax(x, *dim)?,
        Op::LogSoftmax { dim } => reference::log_softmax(x, *dim)?,
        Op::LayerNorm { eps, affine, bias } => reference::layer_norm(
            x,
            if *affine { inputs.get(1) } else { None },
            if *bias { inputs.get(2) } else { None },
            eps.get(),
        )?,
        Op::RmsNorm { eps } => {
            need(inputs, 2, op)?;
            reference::rms_norm(x, &inputs[1], eps.get())?
        }
        Op::Embedding => {
            need(inputs, 2, op)?;
            let mut dims = x.dims().to_vec();
            dims.push(inputs[1].dim(1)?);
            inputs[1]
                .index_select(&x.flatten_all()?.to_dtype(DType::U32)?, 0)?
                .reshape(dims)?
        }
        Op::CrossEntropy => {
            need(inputs, 2, op)?;
            let lsm = reference::log_softmax(x, 1)?;
            lsm.gather(&inputs[1].to_dtype(DType::U32)?.unsqueeze(1)?, 1)?
                .neg()?
                .mean_all()?
        }
        Op::Reshape { shape } => x.reshape(shape.as_slice())?,
        Op::Transpose { dim0, dim1 } => x.transpose(*dim0, *dim1)?,
        Op::Permute { dims } => x.permute(dims.to_vec())?,
        Op::Narrow { dim, start, len } => x.narrow(*dim, *start, *len)?,
        Op::Squeeze { dim } => x.squeeze(*dim)?,
        Op::Unsqueeze { dim } => x.unsqueeze(*dim)?,
        Op::BroadcastAs { shape } => x.broadcast_as(shape.as_slice())?,
        Op::Flatten { start, end } => x.flatten(*start, *end)?,
        Op::Cat { dim } => Tensor::cat(inputs, *dim)?,
        Op::Stack { dim } => Tensor::stack(inputs, *dim)?,
        Op::Contiguous => x.contiguous()?,
        Op::ToDType(d) => x.to_dtype(crate::convert::cdtype(*d))?,
        Op::Where => {
            need(inputs, 3, op)?;
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
            need(inputs, 2, op)?;
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
        Op::Sdpa { causal, scale } => {
            need(inputs, 3, op)?;
            let d = x.dim(3)? as f64;
            let s = scale.map(|s| s.get()).unwrap_or(1.0 / d.sqrt());
            reference::sdpa(x, &inputs[1], &inputs[2], *causal, s)?
        }
        Op::PackedSdpa { causal, scale } => {
            let d = x.dim(4)? as f64;
            let s = scale.map(|s| s.get()).unwrap_or(1.0 / d.sqrt());
            reference::packed_sdpa(x, *causal, s)?
        }
        Op::IndexSelect { dim } => {
            need(inputs, 2, op)?;
            x.index_select(&inputs[1].to_dtype(DType::U32)?, *dim)?
        }
        Op::Gather { dim } => {
            need(inputs, 2, op)?;
            let idx = inputs[1].to_dtype(DType::U32)?;
            super::index::gather_source(x, &idx, *dim)?.gather(&idx, *dim)?
        }
    })
}
