//! View and shape ops: reshape, transpose, permute, narrow, squeeze, unsqueeze, broadcast_as,
//! flatten, cat, stack. They never communicate on their own: when a view cannot keep the
//! current sharding (a flattened dim sharded on a later input dim, a narrow across shards), the
//! compiler plans the redistribution first and says so.

use candle_core::Tensor;
use candle_dtensor_strategies::{Dims, Op, Shape};

use super::local_dims;
use crate::dispatch::{prepare, run1};
use crate::error::{invalid, Context, Result};
use crate::tensor::{mesh_mismatch, DTensor};

impl DTensor {
    /// Reshapes to `shape` (same number of elements).
    pub fn reshape(&self, shape: &[usize]) -> Result<DTensor> {
        let op = Op::Reshape {
            shape: Shape::from_slice(shape),
        };
        run1(&op, &[self], |p| {
            let dims = local_dims(p, 0)?;
            p.locals[0].reshape(dims.as_slice())
        })
    }

    /// Swaps two dims.
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<DTensor> {
        run1(&Op::Transpose { dim0, dim1 }, &[self], |p| {
            p.locals[0].transpose(dim0, dim1)
        })
    }

    /// The matrix transpose of the last two dims.
    pub fn t(&self) -> Result<DTensor> {
        let n = self.rank();
        if n < 2 {
            return Err(invalid(
                "t",
                self.mesh_rank(),
                format!("needs 2 dims, got {:?}", self.shape()),
            ));
        }
        self.transpose(n - 2, n - 1)
    }

    /// Reorders dims (`dims[i]` is the source of output dim `i`).
    pub fn permute(&self, dims: &[usize]) -> Result<DTensor> {
        let d: Vec<usize> = dims.to_vec();
        run1(
            &Op::Permute {
                dims: Dims::from_slice(dims),
            },
            &[self],
            move |p| p.locals[0].permute(d),
        )
    }

    /// `len` elements of `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<DTensor> {
        let identity = self
            .shape()
            .get(dim)
            .is_some_and(|&n| start == 0 && len == n);
        run1(&Op::Narrow { dim, start, len }, &[self], |p| {
            if identity {
                // The only narrow the compiler lets through on a sharded dim: the local piece
                // (possibly shorter than `len`, or empty) stays as it is.
                return Ok(p.locals[0].clone());
            }
            crate::storage::narrow(&p.locals[0], dim, start, len)
        })
    }

    /// Removes a size-1 dim.
    pub fn squeeze(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::Squeeze { dim }, &[self], |p| p.locals[0].squeeze(dim))
    }

    /// Inserts a size-1 dim.
    pub fn unsqueeze(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::Unsqueeze { dim }, &[self], |p| {
            p.locals[0].unsqueeze(dim)
        })
    }

    /// Broadcasts to `shape` (numpy rules).
    pub fn broadcast_as(&self, shape: &[usize]) -> Result<DTensor> {
        let op = Op::BroadcastAs {
            shape: Shape::from_slice(shape),
        };
        run1(&op, &[self], |p| {
            let dims = local_dims(p, 0)?;
            p.locals[0].broadcast_as(dims.as_slice())
        })
    }

    /// Merges dims `start..=end` into one.
    pub fn flatten(&self, start: usize, end: usize) -> Result<DTensor> {
        run1(&Op::Flatten { start, end }, &[self], |p| {
            let dims = local_dims(p, 0)?;
            p.locals[0].reshape(dims.as_slice())
        })
    }

    /// Splits `dim` into consecutive pieces of `sizes` (summing to its size). Other dims keep
    /// their sharding; a `StridedShard(dim, k)` input split into its `k` equal parts gives
    /// `Shard(dim)` pieces without communication (a fused QKV projection sharded head by head).
    pub fn split(&self, sizes: &[usize], dim: usize) -> Result<Vec<DTensor>> {
        let op = Op::Split {
            dim,
            sizes: Shape::from_slice(sizes),
        };
        let rank = self.mesh_rank();
        let p = prepare(&op, &[self])?;
        let mut outs = Vec::with_capacity(sizes.len());
        let mut at = 0usize;
        for k in 0..sizes.len() {
            let len = local_dims(&p, k).ctx(op.name(), rank)?[dim];
            outs.push(crate::storage::narrow(&p.locals[0], dim, at, len).ctx(op.name(), rank)?);
            at += len;
        }
        p.finish(&op, outs)
    }

    /// The slices of `dim` (which is gathered first when sharded), without that dim.
    pub fn unbind(&self, dim: usize) -> Result<Vec<DTensor>> {
        let op = Op::Unbind { dim };
        let rank = self.mesh_rank();
        let p = prepare(&op, &[self])?;
        let outs = (0..p.sharding.output_specs.len())
            .map(|i| crate::storage::narrow(&p.locals[0], dim, i, 1)?.squeeze(dim))
            .collect::<candle_core::Result<Vec<_>>>()
            .ctx(op.name(), rank)?;
        p.finish(&op, outs)
    }

    /// Concatenates along `dim`.
    pub fn cat(tensors: &[&DTensor], dim: usize) -> Result<DTensor> {
        Self::join(tensors, Op::Cat { dim }, |ts| Tensor::cat(ts, dim))
    }

    /// Stacks along a new dim `dim`.
    pub fn stack(tensors: &[&DTensor], dim: usize) -> Result<DTensor> {
        Self::join(tensors, Op::Stack { dim }, |ts| Tensor::stack(ts, dim))
    }

    fn join(
        tensors: &[&DTensor],
        op: Op,
        f: impl FnOnce(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<DTensor> {
        let first = tensors
            .first()
            .ok_or_else(|| invalid(op.name(), usize::MAX, "needs at least one tensor"))?;
        if let Some(other) = tensors.iter().find(|t| !t.mesh().same_mesh(first.mesh())) {
            return Err(mesh_mismatch(op.name(), first, other));
        }
        let p = prepare(&op, tensors)?;
        let out = f(&p.locals).ctx(op.name(), first.mesh_rank())?;
        p.finish1(&op, out)
    }
}

/// The view family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    let a = x[0];
    Ok(vec![match op {
        Op::Reshape { shape } => a.reshape(shape)?,
        Op::Transpose { dim0, dim1 } => a.transpose(*dim0, *dim1)?,
        Op::Permute { dims } => a.permute(dims)?,
        Op::Narrow { dim, start, len } => a.narrow(*dim, *start, *len)?,
        Op::Squeeze { dim } => a.squeeze(*dim)?,
        Op::Unsqueeze { dim } => a.unsqueeze(*dim)?,
        Op::BroadcastAs { shape } => a.broadcast_as(shape)?,
        Op::Flatten { start, end } => a.flatten(*start, *end)?,
        Op::Split { dim, sizes } => return a.split(sizes, *dim),
        Op::Unbind { dim } => return a.unbind(*dim),
        _ => return Err(super::wrong_family(op, x)),
    }])
}

/// The view family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    let x = &inputs[0];
    Ok(vec![match op {
        Op::Reshape { shape } => x.reshape(shape.as_slice())?,
        Op::Transpose { dim0, dim1 } => x.transpose(*dim0, *dim1)?,
        Op::Permute { dims } => x.permute(dims.to_vec())?,
        Op::Narrow { dim, start, len } => x.narrow(*dim, *start, *len)?,
        Op::Squeeze { dim } => x.squeeze(*dim)?,
        Op::Unsqueeze { dim } => x.unsqueeze(*dim)?,
        Op::BroadcastAs { shape } => x.broadcast_as(shape.as_slice())?,
        Op::Flatten { start, end } => x.flatten(*start, *end)?,
        Op::Split { dim, sizes } => {
            let mut at = 0;
            return sizes
                .iter()
                .map(|&n| {
                    let piece = x.narrow(*dim, at, n);
                    at += n;
                    piece
                })
                .collect();
        }
        Op::Unbind { dim } => {
            return (0..x.dim(*dim)?)
                .map(|i| x.narrow(*dim, i, 1)?.squeeze(*dim))
                .collect()
        }
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
