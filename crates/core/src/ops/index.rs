//! Index ops along a possibly sharded dim: `index_select` and `gather`.
//!
//! When the source is sharded on the indexed dim, the compiler picks one of three plans by cost:
//! all_gather the source first (an ordinary redistribution), a masked local select whose output
//! is a `MaskPartial` (one all_reduce when someone needs it replicated), or `rma_get`: every rank
//! fetches just the selected rows from their owners through a one-sided window. The backward of
//! the rma plan needs no communication: the output gradient is replicated, so every owner adds
//! the gradient of its own rows locally.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_dtensor_strategies::layout::shard_size_and_offset;
use candle_dtensor_strategies::{Op, Placement};

use super::neural::local_ids;
use crate::collectives::{fill_from, Axis};
use crate::dispatch::{run1, Prepared};
use crate::error::Result;
use crate::node::node;
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

use crate::error::local_error as msg;

/// How the chosen strategy treats the indexed dim of the source.
enum Plan {
    /// The source is whole on the indexed dim: plain local op.
    Local,
    /// Masked local op; output MaskPartial. (offset, length) of this rank's rows.
    Masked(usize, usize),
    /// One-sided fetch of the selected rows over `axis`; `l` is the indexed dim's length as
    /// that axis sees it.
    Rma(Axis, usize),
}

fn plan(p: &Prepared, dim: usize) -> CResult<Plan> {
    let src = &p.sharding.input_specs[0];
    let out = &p.sharding.output_specs[0];
    let ctx = p.ctx();
    // Mesh dims of size 1 hold the whole dim: nothing to mask or fetch there.
    let mesh_dims: Vec<usize> = (0..src.placements.len())
        .filter(|&m| src.placements[m].shard_dim() == Some(dim) && ctx.shape[m] > 1)
        .collect();
    if mesh_dims.is_empty() {
        return Ok(Plan::Local);
    }
    let (shape, off) = candle_dtensor_strategies::layout::local_shape_and_offset(
        &src.meta.shape,
        &ctx.shape,
        &ctx.coord,
        &src.placements,
    )
    .map_err(candle_core::Error::wrap)?;
    if mesh_dims
        .iter()
        .all(|&m| matches!(out.placements[m], Placement::MaskPartial { .. }))
    {
        return Ok(Plan::Masked(off[dim], shape[dim]));
    }
    match mesh_dims.as_slice() {
        [m] if out.placements[*m] == Placement::Replicate => {
            let axis = ctx
                .axis(p.first().mesh(), &[*m])
                .map_err(candle_core::Error::from)?;
            // The length of `dim` as mesh dim m sees it: the source under its placements with
            // mesh dim m made Replicate.
            let mut pl = src.placements.clone();
            pl[*m] = Placement::Replicate;
            let logical = candle_dtensor_strategies::layout::local_shape(
                &src.meta.shape,
                &ctx.shape,
                &ctx.coord,
                &pl,
            )
            .map_err(candle_core::Error::wrap)?;
            Ok(Plan::Rma(axis, logical[dim]))
        }
        _ => Err(msg(format!(
            "index op: no executor for source {} with output {} on the indexed dim",
            src, out
        ))),
    }
}

/// Fetches rows `wanted` (sorted, unique, global along the axis' view of dim 0 of `t`) of the
/// dim-0-sharded tensor whose local piece is `t`, from their owners, through an RMA window.
/// Collective over `ax` (every rank creates the window and fences).
fn rma_rows(ax: &Axis, t: &Tensor, l: usize, wanted: &[usize]) -> CResult<Tensor> {
    let n = ax.n;
    let row: usize = t.dims()[1..].iter().product();
    let full = l.div_ceil(n.max(1));
    let es = t.dtype().size_in_bytes();
    let window = ax.comm.new_window(full * row * es)?;
    if t.elem_count() > 0 {
        window.put(&t.contiguous()?.flatten_all()?, ax.coord, 0)?;
    }
    window.fence()?;
    // Group runs of consecutive rows on the same owner into one get each.
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < wanted.len() {
        let g = wanted[i];
        let owner = (g / full.max(1)).min(n - 1);
        let (_, off) = shard_size_and_offset(l, n, owner);
        let mut j = i + 1;
        while j < wanted.len() && wanted[j] == wanted[j - 1] + 1 && wanted[j] / full.max(1) == owner
        {
            j += 1;
        }
        let count = j - i;
        let got = window.get(owner, (g - off) * row, count * row, t.dtype())?;
        pieces.push(got);
        i = j;
    }
    window.fence()?;
    // One record per op, as the plan has one `rma_get` (however many runs of rows it took).
    crate::debug::record("rma_get", &ax.name, (wanted.len() * row * es) as u64);
    let mut dims = t.dims().to_vec();
    dims[0] = wanted.len();
    if pieces.is_empty() {
        return Tensor::zeros(dims, t.dtype(), t.device());
    }
    Tensor::cat(&pieces, 0)?.reshape(dims)
}

/// The rma plan for both ops: fetch the rows the (replicated) indices name, then run `select`
/// on the compact table with indices remapped to it. The backward masks the replicated output
/// gradient to this rank's own rows (`inside` reshaped to `mask_shape`) and adds it into them
/// with `scatter_back(source, local ids, masked gradient)`.
#[allow(clippy::too_many_arguments)]
fn rma_select(
    src: &Tensor,
    ids: &Tensor,
    dim: usize,
    ax: Axis,
    l: usize,
    out_dims: Vec<usize>,
    mask_shape: Vec<usize>,
    select: impl Fn(&Tensor, &Tensor) -> CResult<Tensor>,
    scatter_back: crate::node::Backward,
) -> CResult<Tensor> {
    let id_vals: Vec<u32> = crate::storage::ids_as("gather or index_select ids", ids, DType::U32)?
        .flatten_all()?
        .to_vec1()?;
    let mut unique: BTreeMap<usize, u32> = BTreeMap::new();
    for &v in &id_vals {
        if v as usize >= l {
            return Err(msg(format!("index {v} out of range for a dim of size {l}")));
        }
        unique.insert(v as usize, 0);
    }
    for (pos, v) in unique.values_mut().enumerate() {
        *v = pos as u32;
    }
    let wanted: Vec<usize> = unique.keys().copied().collect();
    let src_t = src.transpose(0, dim)?.contiguous()?;
    let table = rma_rows(&ax, &src_t, l, &wanted)?
        .transpose(0, dim)?
        .contiguous()?;
    let remapped: Vec<u32> = id_vals.iter().map(|v| unique[&(*v as usize)]).collect();
    let remapped = Tensor::from_vec(remapped, ids.dims(), ids.device())?;
    let value = select(&table, &remapped)?;
    if !src.track_op() {
        return Ok(value);
    }
    let (_, off) = shard_size_and_offset(l, ax.n, ax.coord);
    let local_len = src.dim(dim)?;
    let ids_c = ids.clone();
    let y = node(
        src,
        "rma_get",
        out_dims,
        Arc::new(move |arg, _res, g| {
            if local_len == 0 {
                // This rank owns no rows: nothing to add into (candle refuses to scatter into
                // an empty dim even with a zero gradient).
                return arg.zeros_like();
            }
            let (local, inside) = local_ids(&ids_c, off, local_len)?;
            let mask = inside.reshape(mask_shape.as_slice())?.to_dtype(g.dtype())?;
            scatter_back(arg, &local, &g.broadcast_mul(&mask)?)
        }),
    )?;
    fill_from(&y, &value)?;
    Ok(y)
}

/// `src` cut to `idx`'s extent on every dim but `dim`. `out[.., j, ..]` only reads
/// `src[.., j, ..]` for `j` below the index's size there, and candle's `gather` is wrong for an
/// index smaller than the source off the gather dim (it walks the source with the index's
/// strides) and its backward refuses it.
pub(crate) fn gather_source(src: &Tensor, idx: &Tensor, dim: usize) -> CResult<Tensor> {
    let mut s = src.clone();
    for d in 0..src.rank().min(idx.rank()) {
        let n = idx.dim(d)?;
        if d != dim && n < s.dim(d)? {
            s = crate::storage::narrow(&s, d, 0, n)?.contiguous()?;
        }
    }
    Ok(s)
}

impl DTensor {
    /// Selects entries of `self` along `dim` at the 1-D integer `ids`.
    pub fn index_select(&self, ids: &DTensor, dim: usize) -> Result<DTensor> {
        run1(&Op::IndexSelect { dim }, &[self, ids], |p| {
            let (src, idx) = (&p.locals[0], &p.locals[1]);
            let idx_u = crate::storage::ids_as("index_select", idx, DType::U32)?;
            match plan(p, dim)? {
                Plan::Local => src.index_select(&idx_u, dim),
                Plan::Masked(off, len) => {
                    let mut out_dims = src.dims().to_vec();
                    out_dims[dim] = idx.dim(0)?;
                    if len == 0 {
                        return crate::node::graph_zeros(src, &out_dims);
                    }
                    let (local, inside) = local_ids(idx, off, len)?;
                    let sel = src.index_select(&local, dim)?;
                    let mut mshape = vec![1; sel.rank()];
                    mshape[dim] = idx.dim(0)?;
                    sel.broadcast_mul(&inside.to_dtype(sel.dtype())?.reshape(mshape)?)
                }
                Plan::Rma(ax, l) => {
                    let mut out_dims = src.dims().to_vec();
                    out_dims[dim] = idx.dim(0)?;
                    let mut mask_shape = vec![1; src.rank()];
                    mask_shape[dim] = idx.dim(0)?;
                    rma_select(
                        src,
                        idx,
                        dim,
                        ax,
                        l,
                        out_dims,
                        mask_shape,
                        |table, ids| table.index_select(ids, dim),
                        Arc::new(move |arg, local, g| arg.zeros_like()?.index_add(local, g, dim)),
                    )
                }
            }
        })
    }

    /// `out[i][j] = self[index[i][j]][j]` (for `dim` 0; likewise for other dims), with an
    /// integer `index` of the same rank.
    pub fn gather(&self, index: &DTensor, dim: usize) -> Result<DTensor> {
        run1(&Op::Gather { dim }, &[self, index], |p| {
            let idx = &p.locals[1];
            let src = &gather_source(&p.locals[0], idx, dim)?;
            match plan(p, dim)? {
                Plan::Local => src.gather(&crate::storage::ids_as("gather", idx, DType::U32)?, dim),
                Plan::Masked(off, len) => {
                    if len == 0 {
                        return crate::node::graph_zeros(src, idx.dims());
                    }
                    let (local, inside) = local_ids(idx, off, len)?;
                    src.gather(&local, dim)?.mul(&inside.to_dtype(src.dtype())?)
                }
                Plan::Rma(ax, l) => rma_select(
                    src,
                    idx,
                    dim,
                    ax,
                    l,
                    idx.dims().to_vec(),
                    idx.dims().to_vec(),
                    |table, ids| table.gather(ids, dim),
                    Arc::new(move |arg, local, g| arg.zeros_like()?.scatter_add(local, g, dim)),
                ),
            }
        })
    }
}

/// The index family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    Ok(vec![match op {
        Op::IndexSelect { dim } => x[0].index_select(x[1], *dim)?,
        Op::Gather { dim } => x[0].gather(x[1], *dim)?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

/// The index family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    let x = &inputs[0];
    Ok(vec![match op {
        Op::IndexSelect { dim } => x.index_select(&inputs[1].to_dtype(DType::U32)?, *dim)?,
        Op::Gather { dim } => {
            let idx = inputs[1].to_dtype(DType::U32)?;
            gather_source(x, &idx, *dim)?.gather(&idx, *dim)?
        }
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
