//! Writes at indices: `scatter_add`, `index_put` and `index_add` (`index_put` accumulating),
//! along a dim that may be sharded on the destination (each rank applies the updates whose
//! index it owns) or on the updates (each rank adds its share into a `P(sum)` summand).
//!
//! Both are built on candle's `index_add`, whose gradients are right: candle 0.11's own
//! `scatter_add` backward masks the gradient of the destination at the scattered positions
//! (the rule of `scatter`, which overwrites), so it is not used on the training path.

use candle_core::{DType, Tensor};
use candle_dtensor_strategies::layout::local_shape_and_offset;
use candle_dtensor_strategies::Op;

use crate::dispatch::{run1, Prepared};
use crate::error::Result;
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

use crate::error::local_error as msg;

/// `(offset, length)` along `dim` of the rows of `x` this rank owns when the destination is
/// sharded on `dim` (over mesh dims of size > 1), `None` when it holds the whole dim.
fn owned_rows(p: &Prepared, dim: usize) -> CResult<Option<(usize, usize)>> {
    let spec = &p.sharding.input_specs[0];
    let ctx = p.ctx();
    let sharded = spec
        .placements
        .iter()
        .enumerate()
        .any(|(m, pl)| pl.shards(dim) && ctx.shape[m] > 1);
    if !sharded {
        return Ok(None);
    }
    let (shape, off) =
        local_shape_and_offset(&spec.meta.shape, &ctx.shape, &ctx.coord, &spec.placements)
            .map_err(candle_core::Error::wrap)?;
    Ok(Some((off[dim], shape[dim])))
}

/// The index values as `u64`, checked against `bound` (the global size of the written dim).
fn index_values(index: &Tensor, bound: usize, op: &str) -> CResult<Vec<u64>> {
    let v: Vec<i64> = crate::storage::ids_as("scatter index", index, DType::I64)?
        .flatten_all()?
        .to_vec1()?;
    v.iter()
        .map(|&i| {
            if i < 0 || i as usize >= bound {
                Err(msg(format!(
                    "{op}: index {i} out of range for a dim of size {bound}"
                )))
            } else {
                Ok(i as u64)
            }
        })
        .collect()
}

/// Local positions of global indices for rows `owned` (`(off, len)`; `None`: all), with the
/// mask of those that fall in them (out-of-range ones point at row 0 and are masked).
fn localize(ids: &[u64], owned: Option<(usize, usize)>) -> (Vec<u32>, Vec<bool>) {
    ids.iter()
        .map(|&g| match owned {
            None => (g as u32, true),
            Some((off, len)) => {
                let g = g as usize;
                if g >= off && g < off + len {
                    ((g - off) as u32, true)
                } else {
                    (0, false)
                }
            }
        })
        .unzip()
}

/// `updates` times a 0/1 `mask` laid out along `dim` (one entry per index) or elementwise.
fn masked(updates: &Tensor, mask: &[bool], mask_shape: &[usize]) -> CResult<Tensor> {
    if mask.iter().all(|&m| m) {
        return Ok(updates.clone());
    }
    let m: Vec<u8> = mask.iter().map(|&b| u8::from(b)).collect();
    let m = Tensor::from_vec(m, mask_shape, updates.device())?.to_dtype(updates.dtype())?;
    updates.broadcast_mul(&m)
}

/// `x` with `src` added at `index` along `dim` (`index`, `src` of one shape, equal to `x` off
/// `dim`; global index values, this rank owning rows `owned` of `x`): a flattened `index_add`.
/// `bound` is the global size of `dim`.
pub(crate) fn scatter_add_local(
    x: &Tensor,
    index: &Tensor,
    src: &Tensor,
    dim: usize,
    bound: usize,
    owned: Option<(usize, usize)>,
) -> CResult<Tensor> {
    let ids = index_values(index, bound, "scatter_add")?;
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    if ids.is_empty() {
        // No updates here; the updates stay in the graph (their adjoint collectives run on
        // every rank).
        return x.broadcast_add(&crate::node::graph_zeros(src, &[])?);
    }
    let (local, keep) = localize(&ids, owned);
    let xd = x.dims();
    let strides: Vec<usize> = (0..xd.len())
        .map(|d| xd[d + 1..].iter().product())
        .collect();
    let sd = src.dims();
    let mut lin = Vec::with_capacity(local.len());
    let mut pos = vec![0usize; sd.len()];
    for &l in &local {
        let mut at = 0usize;
        for (d, &i) in pos.iter().enumerate() {
            at += if d == dim { l as usize } else { i } * strides[d];
        }
        lin.push(at as u32);
        for d in (0..pos.len()).rev() {
            pos[d] += 1;
            if pos[d] < sd[d] {
                break;
            }
            pos[d] = 0;
        }
    }
    let lin = Tensor::from_vec(lin, local.len(), x.device())?;
    let src = masked(src, &keep, sd)?.flatten_all()?;
    x.flatten_all()?.index_add(&lin, &src, 0)?.reshape(xd)
}

/// `x` with rows `indices` along `dim` replaced by (`accumulate`: added to) the rows of
/// `values`; repeated indices add their rows in both modes. Global index values, this rank
/// owning rows `owned` of `x`; `bound` is the global size of `dim`.
pub(crate) fn index_put_local(
    x: &Tensor,
    indices: &Tensor,
    values: &Tensor,
    dim: usize,
    accumulate: bool,
    bound: usize,
    owned: Option<(usize, usize)>,
) -> CResult<Tensor> {
    let op = if accumulate { "index_add" } else { "index_put" };
    let ids = index_values(indices, bound, op)?;
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    if ids.is_empty() {
        return x.broadcast_add(&crate::node::graph_zeros(values, &[])?);
    }
    let (local, keep) = localize(&ids, owned);
    let mut mshape = vec![1usize; values.rank()];
    mshape[dim] = ids.len();
    let vals = masked(values, &keep, &mshape)?;
    let lids = Tensor::from_vec(local.clone(), local.len(), x.device())?;
    if accumulate {
        return x.index_add(&lids, &vals, dim);
    }
    // Zero the written rows, then add the values there.
    let rows = x.dim(dim)?;
    let mut written = vec![0u8; rows];
    for (&l, &k) in local.iter().zip(&keep) {
        if k {
            written[l as usize] = 1;
        }
    }
    let mut wshape = vec![1usize; x.rank()];
    wshape[dim] = rows;
    let kept = Tensor::from_vec(written, wshape, x.device())?
        .to_dtype(x.dtype())?
        .affine(-1.0, 1.0)?;
    x.broadcast_mul(&kept)?
        .add(&x.zeros_like()?.index_add(&lids, &vals, dim)?)
}

impl DTensor {
    /// `out = self` with `src` added at `index` along `dim` (`out[.., index[i], ..] += src[i]`
    /// for `dim` 0); `index` (integer) and `src` have one shape, equal to `self`'s off `dim`.
    /// With `self` sharded on `dim` each rank adds the updates whose index it owns; with the
    /// updates sharded on `dim` each rank adds its share into a `P(sum)` output.
    pub fn scatter_add(&self, index: &DTensor, src: &DTensor, dim: usize) -> Result<DTensor> {
        let bound = self.shape().get(dim).copied().unwrap_or(0);
        run1(&Op::ScatterAdd { dim }, &[self, index, src], |p| {
            let owned = owned_rows(p, dim)?;
            scatter_add_local(&p.locals[0], &p.locals[1], &p.locals[2], dim, bound, owned)
        })
    }

    /// `out = self` with rows `indices` (1-d integer) along `dim` replaced by the rows of
    /// `values` (`self`'s shape with `indices.len()` rows on `dim`), or added to them when
    /// `accumulate` (then also [`DTensor::index_add`]). Repeated indices add their rows.
    pub fn index_put(
        &self,
        indices: &DTensor,
        values: &DTensor,
        dim: usize,
        accumulate: bool,
    ) -> Result<DTensor> {
        let bound = self.shape().get(dim).copied().unwrap_or(0);
        run1(
            &Op::IndexPut { dim, accumulate },
            &[self, indices, values],
            |p| {
                let owned = owned_rows(p, dim)?;
                index_put_local(
                    &p.locals[0],
                    &p.locals[1],
                    &p.locals[2],
                    dim,
                    accumulate,
                    bound,
                    owned,
                )
            },
        )
    }

    /// `out = self` with the rows of `values` added at rows `indices` along `dim` (the
    /// mixture-of-experts combine: `out.index_add(token_ids, weighted_expert_out, 0)`).
    pub fn index_add(&self, indices: &DTensor, values: &DTensor, dim: usize) -> Result<DTensor> {
        self.index_put(indices, values, dim, true)
    }
}

/// The scatter family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    Ok(vec![match op {
        Op::ScatterAdd { dim } => x[0].scatter_add(x[1], x[2], *dim)?,
        Op::IndexPut { dim, accumulate } => x[0].index_put(x[1], x[2], *dim, *accumulate)?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

/// The scatter family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    let (x, i, u) = (&inputs[0], &inputs[1], &inputs[2]);
    Ok(vec![match op {
        Op::ScatterAdd { dim } => scatter_add_local(x, i, u, *dim, x.dim(*dim)?, None)?,
        Op::IndexPut { dim, accumulate } => {
            index_put_local(x, i, u, *dim, *accumulate, x.dim(*dim)?, None)?
        }
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
