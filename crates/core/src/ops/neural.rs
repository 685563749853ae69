//! Neural-network ops with tested backward passes: softmax, log_softmax, layer_norm, rms_norm,
//! scaled dot-product attention, embedding (incl. vocab-parallel), cross-entropy (incl.
//! loss-parallel over a class-sharded input).
//!
//! Everything is built from candle primitives that have gradients. candle-nn's fused
//! `softmax_last_dim`, `layer_norm`, `rms_norm` and `sdpa` run without a backward and silently
//! cut the graph (candle#2168, #3011), so they are never used here.

use candle_core::{DType, Tensor};

use candle_dtensor_strategies::layout::local_shape_and_offset;
use candle_dtensor_strategies::{DTensorSpec, Op, Placement};

pub use candle_dtensor_kernels::autodiff::{
    layer_norm_local, log_softmax_local, packed_sdpa_local, packed_sdpa_local_flat, reference,
    rms_norm_local, sdpa_local, softmax_local,
};

use crate::collectives::{self, Axis};
use crate::dispatch::{run1, run1_with, Prepared};
use crate::error::{invalid, Result};
use crate::fused;
use crate::tensor::DTensor;
use candle_dtensor_comm::ReduceOp;

type CResult<T> = candle_core::Result<T>;

/// Which context-parallel strategy the compiler chose for an attention op.
#[derive(Clone, Copy)]
enum CpKind {
    KvExchange,
    AllToAll,
}

impl CpKind {
    #[allow(clippy::too_many_arguments)]
    fn run(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        ax: &Axis,
        t: usize,
        causal: bool,
        scale: f64,
    ) -> CResult<Tensor> {
        match self {
            CpKind::KvExchange => crate::cp::kv_exchange(q, k, v, ax, t, causal, scale),
            CpKind::AllToAll => crate::cp::all_to_all_heads(q, k, v, ax, t, causal, scale),
        }
    }
}

/// The context-parallel mesh dim of an attention op whose first input has its sequence at
/// `seq` (the compiler allows at most one mesh dim of size > 1 to shard it): its axis, the
/// global sequence length and the strategy (read back from the row's internal comms).
fn context_parallel(p: &Prepared, seq: usize) -> CResult<Option<(Axis, usize, CpKind)>> {
    let ctx = p.ctx();
    let spec = &p.sharding.input_specs[0];
    let Some(m) = (0..spec.placements.len())
        .find(|&m| spec.placements[m].shard_dim() == Some(seq) && ctx.shape[m] > 1)
    else {
        return Ok(None);
    };
    let kind = if p
        .sharding
        .internal
        .iter()
        .any(|(d, c)| *d == m && c.kind == candle_dtensor_strategies::CollectiveKind::AllToAll)
    {
        CpKind::AllToAll
    } else {
        CpKind::KvExchange
    };
    let ax = ctx.axis(p.first().mesh(), &[m])?;
    Ok(Some((ax, spec.meta.shape[seq], kind)))
}

/// Mesh dims (of size > 1: a group of one communicates nothing) on which `spec` shards tensor
/// dim `dim`, and this rank's (offset, size) of it.
fn sharded_range(
    p: &Prepared,
    spec: &DTensorSpec,
    dim: usize,
) -> CResult<(Vec<usize>, usize, usize)> {
    let ctx = p.ctx();
    let dims: Vec<usize> = spec
        .placements
        .iter()
        .enumerate()
        .filter(|(m, pl)| pl.shard_dim() == Some(dim) && ctx.shape[*m] > 1)
        .map(|(m, _)| m)
        .collect();
    let (shape, off) =
        local_shape_and_offset(&spec.meta.shape, &ctx.shape, &ctx.coord, &spec.placements)
            .map_err(candle_core::Error::wrap)?;
    Ok((dims, off[dim], shape[dim]))
}

/// Causal attention on a packed `[B, T, H, 3, d]` projection whose sequence is stored in the
/// load-balanced context-parallel order (`cp::layout_scope`), with the mask of the global
/// positions: `[B, T, H, d]`. `None` outside that order, or where the stored-order path does
/// not apply (then the plain local attention is right).
fn stored_order_packed(packed: &Tensor, causal: bool, scale: f64) -> CResult<Option<Tensor>> {
    if !(causal && crate::cp::current_layout().0 == crate::cp::SeqLayout::LoadBalanced) {
        return Ok(None);
    }
    let part = |i: usize| packed.narrow(3, i, 1)?.squeeze(3)?.transpose(1, 2);
    crate::cp::stored_order_attention(&part(0)?, &part(1)?, &part(2)?, causal, scale)?
        .map(|y| y.transpose(1, 2))
        .transpose()
}

fn axes(p: &Prepared, dims: &[usize]) -> CResult<Vec<Axis>> {
    dims.iter()
        .map(|&m| {
            p.ctx()
                .axis(p.first().mesh(), &[m])
                .map_err(candle_core::Error::from)
        })
        .collect()
}

/// Softmax (or log-softmax) of the prepared input over `dim`. When the chosen layout shards
/// `dim`, each rank reduces its piece and two all_reduces over those mesh dims finish the job:
/// the max (no gradient: softmax is shift-invariant) and the sum of exponentials. The sum feeds
/// every rank's (sharded) output, so its gradient is a per-rank partial sum: it is all-reduced
/// in backward (`grad_sync`).
fn normalize(p: &Prepared, dim: usize, log: bool) -> CResult<Tensor> {
    let x = &p.locals[0];
    let ctx = p.ctx();
    let mesh_dims: Vec<usize> = p.sharding.input_specs[0]
        .placements
        .iter()
        .enumerate()
        .filter(|(m, pl)| pl.shards(dim) && ctx.shape[*m] > 1)
        .map(|(m, _)| m)
        .collect();
    if mesh_dims.is_empty() {
        return if log {
            log_softmax_local(x, dim)
        } else {
            softmax_local(x, dim)
        };
    }
    let ax = axes(p, &mesh_dims)?;
    let mut m = if x.elem_count() == 0 {
        let mut d = x.dims().to_vec();
        d[dim] = 1;
        Tensor::full(f32::NEG_INFINITY, d, x.device())?.to_dtype(x.dtype())?
    } else {
        x.max_keepdim(dim)?.detach()
    };
    for a in &ax {
        m = collectives::all_reduce_raw(&m, a, ReduceOp::Max, None)?;
    }
    let shifted = x.broadcast_sub(&m)?;
    let e = shifted.exp()?;
    let mut s = e.sum_keepdim(dim)?;
    for a in &ax {
        s = collectives::all_reduce(&s, a, ReduceOp::Sum)?;
    }
    let s = collectives::grad_sync(&s, ax)?;
    if log {
        shifted.broadcast_sub(&s.log()?)
    } else {
        e.broadcast_div(&s)
    }
}

/// `(ids - off)` where `off <= ids < off + len`, else `other`, as u32; and the in-range mask
/// (u8). The two forms below choose `other`.
fn shift_into(ids: &Tensor, off: usize, len: usize, other: i64) -> CResult<(Tensor, Tensor)> {
    let ids = crate::storage::ids_as(
        "sharded lookup (embedding, index_select, gather, cross_entropy)",
        ids,
        DType::I64,
    )?;
    let inside = ids.ge(off as f64)?.mul(&ids.lt((off + len) as f64)?)?;
    let shifted = ids.affine(1.0, -(off as f64))?;
    let other = Tensor::full(other, ids.shape(), ids.device())?;
    let local = inside.where_cond(&shifted, &other)?.to_dtype(DType::U32)?;
    Ok((local, inside))
}

/// `(ids - off)` where `off <= ids < off + len`, else 0, as u32; and the in-range mask (f32).
pub(crate) fn local_ids(ids: &Tensor, off: usize, len: usize) -> CResult<(Tensor, Tensor)> {
    let (local, inside) = shift_into(ids, off, len, 0)?;
    Ok((local, inside.to_dtype(DType::F32)?))
}

/// The ids in `[off, off + len)` shifted to `[0, len)` as u32, every other id `u32::MAX`: the
/// id candle's `index_select` reads as a zero row and whose gradient its `index_add` (and the
/// CUDA embedding backward) skips.
pub(crate) fn shard_ids(ids: &Tensor, off: usize, len: usize) -> CResult<Tensor> {
    Ok(shift_into(ids, off, len, i64::from(u32::MAX))?.0)
}

impl DTensor {
    /// Softmax over `dim`. Over a sharded `dim` the data stays put: the global max and sum of
    /// exponentials come from two small all_reduces of the reduced shape.
    pub fn softmax(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::Softmax { dim }, &[self], |p| normalize(p, dim, false))
    }

    /// Log-softmax over `dim` (over a sharded `dim` as [`DTensor::softmax`]).
    pub fn log_softmax(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::LogSoftmax { dim }, &[self], |p| {
            normalize(p, dim, true)
        })
    }

    /// Layer norm over the last dim with optional weight and bias.
    pub fn layer_norm(
        &self,
        w: Option<&DTensor>,
        b: Option<&DTensor>,
        eps: f64,
    ) -> Result<DTensor> {
        if b.is_some() && w.is_none() {
            return Err(invalid(
                "layer_norm",
                self.mesh_rank(),
                "a bias needs a weight",
            ));
        }
        let op = Op::LayerNorm {
            eps: eps.into(),
            affine: w.is_some(),
            bias: b.is_some(),
        };
        let mut ins: Vec<&DTensor> = vec![self];
        ins.extend(w);
        ins.extend(b);
        run1(&op, &ins, |p| {
            layer_norm_local(&p.locals[0], p.locals.get(1), p.locals.get(2), eps)
        })
    }

    /// RMS norm over the last dim.
    pub fn rms_norm(&self, w: &DTensor, eps: f64) -> Result<DTensor> {
        run1(&Op::RmsNorm { eps: eps.into() }, &[self, w], |p| {
            rms_norm_local(&p.locals[0], &p.locals[1], eps)
        })
    }

    /// Scaled dot-product attention: `self` is `q [B, H, T, d]`; `k [B, H, S, d]`,
    /// `v [B, H, S, dv]`. `scale` defaults to `1/sqrt(d)`.
    pub fn sdpa(
        &self,
        k: &DTensor,
        v: &DTensor,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<DTensor> {
        let d = *self.shape().last().unwrap_or(&1);
        let s = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let op = Op::Sdpa {
            causal,
            scale: scale.map(Into::into),
        };
        run1(&op, &[self, k, v], |p| match context_parallel(p, 2)? {
            Some((ax, t, cp)) => {
                cp.run(&p.locals[0], &p.locals[1], &p.locals[2], &ax, t, causal, s)
            }
            None => {
                let (q, k, v) = (&p.locals[0], &p.locals[1], &p.locals[2]);
                match crate::cp::stored_order_attention(q, k, v, causal, s)? {
                    Some(y) => Ok(y),
                    None => sdpa_local(q, k, v, causal, s),
                }
            }
        })
    }

    /// Attention on a packed projection: `self` is `qkv [B, T, H, 3, d]` (each head's q, k, v
    /// side by side, as `qkv_linear(x).reshape([B, T, H, 3, d])` gives for a QKV weight laid out
    /// head by head); the output is `[B, T, H, d]`. Shardable on the batch or the heads; one
    /// graph node for f32 on the CPU instead of the split, transpose and merge views.
    pub fn packed_sdpa(&self, causal: bool, scale: Option<f64>) -> Result<DTensor> {
        let d = *self.shape().last().unwrap_or(&1);
        let s = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let op = Op::PackedSdpa {
            causal,
            scale: scale.map(Into::into),
        };
        run1(&op, &[self], |p| {
            // [B, T, H, 3, d] -> q, k, v [B, H, T, d]; the output back to [B, T, H, d].
            let x = &p.locals[0];
            let part = |i: usize| x.narrow(3, i, 1)?.squeeze(3)?.transpose(1, 2);
            match context_parallel(p, 1)? {
                Some((ax, t, cp)) => cp
                    .run(&part(0)?, &part(1)?, &part(2)?, &ax, t, causal, s)?
                    .transpose(1, 2),
                None => match stored_order_packed(x, causal, s)? {
                    Some(y) => Ok(y),
                    None => packed_sdpa_local(x, causal, s),
                },
            }
        })
    }

    /// Attention on the flat projection: `self` is `qkv [B, T, 3 H d]` as a fused QKV linear
    /// makes it, laid out head by head (head `h`'s q, k, v at features `[3 h d, 3 (h + 1) d)`:
    /// `[B, T, H, 3, d]` flattened), with `heads` = H; the output is `[B, T, H d]`. What
    /// `qkv.reshape([B, T, H, 3, d]).packed_sdpa(..).reshape([B, T, H d])` computes, without
    /// the two reshapes, whose backward edges each zero-fill and add a gradient of their size.
    /// On CUDA one flash-attention node reads the projection in place.
    ///
    /// Shardable on the batch, or on the features between whole heads (the ranks sharing
    /// them divide `heads`): a column-parallel QKV linear's output as it is. A sequence shard
    /// is gathered (context parallelism: [`DTensor::packed_sdpa`]).
    pub fn flat_sdpa(&self, heads: usize, causal: bool, scale: Option<f64>) -> Result<DTensor> {
        let width = *self.shape().last().unwrap_or(&0);
        let d = width
            .checked_div(heads.saturating_mul(3))
            .unwrap_or(0)
            .max(1);
        let s = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let op = Op::FlatSdpa {
            heads,
            causal,
            scale: scale.map(Into::into),
        };
        run1(&op, &[self], |p| {
            let x = &p.locals[0];
            // Whole heads here: the strategies shard the features only between heads.
            let (b, t, local_heads) = (x.dim(0)?, x.dim(1)?, x.dim(2)? / (3 * d));
            // The load-balanced sequence order needs its stored-order mask (as `packed_sdpa`).
            if causal && crate::cp::current_layout().0 == crate::cp::SeqLayout::LoadBalanced {
                let packed = x.reshape((b, t, local_heads, 3, d))?;
                if let Some(y) = stored_order_packed(&packed, causal, s)? {
                    return y.reshape((b, t, local_heads * d));
                }
            }
            packed_sdpa_local_flat(x, local_heads, causal, s)
        })
    }

    /// Embedding lookup: `self` is the integer ids `[..]`, `weight` is `[V, D]`; the output is
    /// `[.., D]`. With the table sharded on the vocab dim (vocab-parallel), each rank looks up
    /// the ids it owns and the output is a masked partial sum (one all_reduce when needed).
    pub fn embedding(&self, weight: &DTensor) -> Result<DTensor> {
        self.embedding_with_layout(weight, None)
    }

    /// [`DTensor::embedding`] with the table's placements for the lookup fixed by the caller
    /// (a vocab-parallel style pins the table to its own `Shard(0)`, so the compiler cannot
    /// choose to move the table instead).
    pub fn embedding_with_layout(
        &self,
        weight: &DTensor,
        weight_layout: Option<&[Placement]>,
    ) -> Result<DTensor> {
        run1_with(
            &Op::Embedding,
            &[self, weight],
            &[None, weight_layout],
            |p| {
                let (ids, w) = (&p.locals[0], &p.locals[1]);
                let (vdims, off, rows) = sharded_range(p, &p.sharding.input_specs[1], 0)?;
                let mut out_dims = ids.dims().to_vec();
                out_dims.push(w.dim(1)?);
                if vdims.is_empty() {
                    // On CUDA one node whose backward is the embedding kernel.
                    return crate::fused::embedding(
                        w,
                        &crate::storage::ids_as("embedding", ids, DType::U32)?,
                    )?
                    .reshape(out_dims);
                }
                if rows == 0 {
                    // No rows here: zeros that stay in the graph, so every rank runs the same
                    // backward collectives.
                    return crate::node::graph_zeros(w, &out_dims);
                }
                // Ids of other shards look up u32::MAX: a zero row, skipped by the backward
                // (no mask multiply, and no block of the CUDA embedding backward summing every
                // other shard's position into one row).
                crate::fused::embedding(w, &shard_ids(ids, off, rows)?)?.reshape(out_dims)
            },
        )
    }

    /// Mean cross-entropy of `self` (logits `[.., C]`: `[N, C]`, or a language model's
    /// `[B, T, V]` as its head makes them) against integer `targets` (the logits' leading dims,
    /// one class id a row), over every row, in the logits' dtype, or in f32 for bf16 / f16
    /// logits (as autocast computes the loss: the fused node reads them and computes in f32;
    /// elsewhere they are cast to f32 first).
    ///
    /// With the logits sharded on the class dim this is loss-parallel: three all_reduces of
    /// one value a row (max, sum of exponentials, target logit) and no gather of the classes;
    /// the backward needs no communication at all. With the rows sharded on any leading dims
    /// (the batch, the sequence, evenly or not) each rank divides the sum of its rows' losses
    /// by the global row count: a free partial sum. Logits with leading dims need no flattening
    /// reshape, whose backward would zero-fill and add a gradient of the logits' size.
    pub fn cross_entropy(&self, targets: &DTensor) -> Result<DTensor> {
        self.cross_entropy_with_layout(targets, None)
    }

    /// [`DTensor::cross_entropy`] with the logits' placements fixed by the caller (pass their
    /// current, class-sharded placements to force the loss-parallel plan).
    pub fn cross_entropy_with_layout(
        &self,
        targets: &DTensor,
        logits_layout: Option<&[Placement]>,
    ) -> Result<DTensor> {
        run1_with(&Op::CrossEntropy, &[self, targets], &[logits_layout], |p| {
            let (x, t) = (&p.locals[0], &p.locals[1]);
            let global = &p.sharding.input_specs[0].meta.shape;
            let classes = global.len() - 1;
            // The mean is over every GLOBAL row: local rows' losses summed, over that count.
            let global_n: usize = global[..classes].iter().product();
            let over_n = |sum: Tensor| sum.affine(1.0 / global_n as f64, 0.0);
            let (cdims, off, cols) = sharded_range(p, &p.sharding.input_specs[0], classes)?;
            let n: usize = x.dims()[..classes].iter().product();
            if cdims.is_empty() {
                // The fused node: f32 on the CPU, f32/bf16 on CUDA (no host read of the
                // targets or the loss there), on the logits' own layout (any leading dims);
                // bf16 logits give their f32 per-row losses' f32 mean.
                // (Rows of logits, `[.., C]` with leading dims: the CUDA node takes no `[C]`.)
                let rows = classes >= 1;
                if rows && fused::cross_entropy_applies(x) && x.track_op() && n > 0 && cols > 0 {
                    return fused::cross_entropy_share(x, t, global_n);
                }
            }
            // Half-precision logits outside the fused node: the loss computed in f32.
            let x = match x.dtype() {
                DType::BF16 | DType::F16 => x.to_dtype(DType::F32)?,
                _ => x.clone(),
            };
            if cdims.is_empty() {
                if n == 0 {
                    // No rows here: a zero that stays in the graph, so every rank runs the
                    // same backward.
                    return crate::node::graph_zeros(&x, &[]);
                }
                let lsm = log_softmax_local(&x, classes)?;
                let t = crate::storage::ids_as("cross_entropy", t, DType::U32)?;
                let picked = lsm.gather(&t.unsqueeze(classes)?, classes)?;
                return over_n(picked.neg()?.sum_all()?);
            }
            // Loss-parallel: rows as `[n, cols]` (a view of this rank's class shard).
            let x = x.reshape((n, cols))?;
            let t = t.reshape(n)?;
            let ax = axes(p, &cdims)?;
            // Global row max (no gradient needed: the loss is shift-invariant).
            let mut m = if cols == 0 || n == 0 {
                Tensor::full(f32::NEG_INFINITY, (n, 1), x.device())?.to_dtype(x.dtype())?
            } else {
                x.max_keepdim(1)?.detach()
            };
            for a in &ax {
                m = collectives::all_reduce_raw(&m, a, ReduceOp::Max, None)?;
            }
            // Local sum of exponentials and the target logit where this rank owns the target;
            // an empty piece contributes zeros that stay in the graph, so every rank runs the
            // same backward collectives.
            let (mut s_all, mut picked) = if cols == 0 {
                let z = crate::node::graph_zeros(&x, &[n, 1])?;
                (z.clone(), z)
            } else if fused::applies(&x) && x.track_op() && n > 0 {
                let (local, inside) = local_ids(&t, off, cols)?;
                (
                    fused::sum_exp_shifted(&x, &m)?,
                    fused::pick_masked(&x, &local, &inside)?,
                )
            } else {
                let e = x.broadcast_sub(&m)?.exp()?;
                let (local, inside) = local_ids(&t, off, cols)?;
                let picked = x
                    .gather(&local.unsqueeze(1)?, 1)?
                    .broadcast_mul(&inside.to_dtype(x.dtype())?.unsqueeze(1)?)?;
                (e.sum_keepdim(1)?, picked)
            };
            for a in &ax {
                s_all = collectives::all_reduce(&s_all, a, ReduceOp::Sum)?;
                picked = collectives::all_reduce(&picked, a, ReduceOp::Sum)?;
            }
            let lse = (s_all.log()? + m)?;
            over_n(lse.sub(&picked)?.sum_all()?)
        })
    }

    /// Whether `self` is sharded on tensor dim `dim` on some mesh dim.
    pub fn is_sharded_on(&self, dim: usize) -> bool {
        self.placements().iter().any(|p| match p {
            Placement::Shard(d) => *d == dim,
            Placement::StridedShard { dim: d, .. } => *d == dim,
            _ => false,
        })
    }
}

/// The norm, embedding, loss and attention families on DTensors (dispatched by
/// [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    let a = x[0];
    Ok(vec![match op {
        Op::Softmax { dim } => a.softmax(*dim)?,
        Op::LogSoftmax { dim } => a.log_softmax(*dim)?,
        Op::LayerNorm { eps, .. } => {
            a.layer_norm(x.get(1).copied(), x.get(2).copied(), eps.get())?
        }
        Op::RmsNorm { eps } => a.rms_norm(x[1], eps.get())?,
        Op::Embedding => a.embedding(x[1])?,
        Op::CrossEntropy => a.cross_entropy(x[1])?,
        Op::Sdpa { causal, scale } => a.sdpa(x[1], x[2], *causal, scale.map(|s| s.get()))?,
        Op::PackedSdpa { causal, scale } => a.packed_sdpa(*causal, scale.map(|s| s.get()))?,
        Op::FlatSdpa {
            heads,
            causal,
            scale,
        } => a.flat_sdpa(*heads, *causal, scale.map(|s| s.get()))?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

/// The norm, embedding, loss and attention families on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    let x = &inputs[0];
    Ok(vec![match op {
        Op::Softmax { dim } => reference::softmax(x, *dim)?,
        Op::LogSoftmax { dim } => reference::log_softmax(x, *dim)?,
        Op::LayerNorm { eps, .. } => {
            reference::layer_norm(x, inputs.get(1), inputs.get(2), eps.get())?
        }
        Op::RmsNorm { eps } => reference::rms_norm(x, &inputs[1], eps.get())?,
        Op::Embedding => {
            let mut dims = x.dims().to_vec();
            dims.push(inputs[1].dim(1)?);
            inputs[1]
                .index_select(&x.flatten_all()?.to_dtype(DType::U32)?, 0)?
                .reshape(dims)?
        }
        Op::CrossEntropy => {
            let Some(c) = x.rank().checked_sub(1) else {
                candle_core::bail!("cross_entropy: logits must be [.., C], got a scalar")
            };
            let lsm = reference::log_softmax(x, c)?;
            lsm.gather(&inputs[1].to_dtype(DType::U32)?.unsqueeze(c)?, c)?
                .neg()?
                .mean_all()?
        }
        Op::Sdpa { causal, scale } => {
            let d = x.dim(3)? as f64;
            let s = scale.map(|s| s.get()).unwrap_or(1.0 / d.sqrt());
            reference::sdpa(x, &inputs[1], &inputs[2], *causal, s)?
        }
        Op::PackedSdpa { causal, scale } => {
            let d = x.dim(4)? as f64;
            let s = scale.map(|s| s.get()).unwrap_or(1.0 / d.sqrt());
            reference::packed_sdpa(x, *causal, s)?
        }
        Op::FlatSdpa {
            heads,
            causal,
            scale,
        } => {
            let (b, t, w) = x.dims3()?;
            let d = match w.checked_div(heads.saturating_mul(3)) {
                Some(d) if d > 0 && w % (3 * heads) == 0 => d,
                _ => candle_core::bail!(
                    "flat_sdpa: qkv {:?} is not [B, T, 3 x {heads} x d]",
                    x.dims()
                ),
            };
            let s = scale.map(|s| s.get()).unwrap_or(1.0 / (d as f64).sqrt());
            reference::packed_sdpa(&x.reshape((b, t, *heads, 3, d))?, *causal, s)?.reshape((
                b,
                t,
                heads * d,
            ))?
        }
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
