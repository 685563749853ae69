//! Neural-network ops with tested backward passes: softmax, log_softmax, layer_norm, rms_norm,
//! scaled dot-product attention, embedding (incl. vocab-parallel), cross-entropy (incl.
//! loss-parallel over a class-sharded input).
//!
//! Everything is built from candle primitives that have gradients. candle-nn's fused
//! `softmax_last_dim`, `layer_norm`, `rms_norm` and `sdpa` run without a backward and silently
//! cut the graph (candle#2168, #3011), so they are never used here.

use candle_core::{DType, Tensor, D};

use candle_dtensor_strategies::layout::local_shape_and_offset;
use candle_dtensor_strategies::{DTensorSpec, Op, Placement};

pub use candle_dtensor_kernels::nn::{
    layer_norm_local, log_softmax_local, packed_sdpa_local, reference, rms_norm_local, sdpa_local,
    softmax_local,
};

use crate::collectives::{self, Axis};
use crate::dispatch::{run1, run1_with, Prepared};
use crate::error::{invalid, Result};
use crate::fused;
use crate::tensor::DTensor;
use candle_dtensor_comm::ReduceOp;

type CResult<T> = candle_core::Result<T>;

/// Mesh dims on which `spec` shards tensor dim `dim`, and this rank's (offset, size) of it.
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
        .filter(|(_, pl)| pl.shard_dim() == Some(dim))
        .map(|(m, _)| m)
        .collect();
    let (shape, off) =
        local_shape_and_offset(&spec.meta.shape, &ctx.shape, &ctx.coord, &spec.placements)
            .map_err(candle_core::Error::wrap)?;
    Ok((dims, off[dim], shape[dim]))
}

fn axes(p: &Prepared, dims: &[usize]) -> CResult<Vec<Axis>> {
    dims.iter()
        .map(|&m| {
            p.ctx()
                .axis(p.first().mesh(), &[m])
                .map_err(candle_core::Error::wrap)
        })
        .collect()
}

/// `(ids - off)` where `off <= ids < off + len`, else 0, as u32; and the in-range mask (f32).
pub(crate) fn local_ids(ids: &Tensor, off: usize, len: usize) -> CResult<(Tensor, Tensor)> {
    let ids = ids.to_dtype(DType::I64)?;
    let lo = ids.ge(off as f64)?;
    let hi = ids.lt((off + len) as f64)?;
    let inside = lo.mul(&hi)?;
    let shifted = ids.affine(1.0, -(off as f64))?;
    let zeros = shifted.zeros_like()?;
    let local = inside.where_cond(&shifted, &zeros)?.to_dtype(DType::U32)?;
    Ok((local, inside.to_dtype(DType::F32)?))
}

impl DTensor {
    /// Softmax over `dim`.
    pub fn softmax(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::Softmax { dim }, &[self], |p| {
            softmax_local(&p.locals[0], dim)
        })
    }

    /// Log-softmax over `dim`.
    pub fn log_softmax(&self, dim: usize) -> Result<DTensor> {
        run1(&Op::LogSoftmax { dim }, &[self], |p| {
            log_softmax_local(&p.locals[0], dim)
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
        run1(&op, &[self, k, v], |p| {
            sdpa_local(&p.locals[0], &p.locals[1], &p.locals[2], causal, s)
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
        run1(&op, &[self], |p| packed_sdpa_local(&p.locals[0], causal, s))
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
                    return w
                        .index_select(&ids.flatten_all()?.to_dtype(DType::U32)?, 0)?
                        .reshape(out_dims);
                }
                if rows == 0 {
                    // No rows here: zeros that stay in the graph, so every rank runs the same
                    // backward collectives.
                    return crate::node::graph_zeros(w, &out_dims);
                }
                let (local, inside) = local_ids(ids, off, rows)?;
                let looked = w
                    .index_select(&local.flatten_all()?, 0)?
                    .reshape(out_dims)?;
                looked.broadcast_mul(&inside.to_dtype(w.dtype())?.unsqueeze(D::Minus1)?)
            },
        )
    }

    /// Mean cross-entropy of `self` (logits `[N, C]`) against integer `targets [N]`.
    ///
    /// With the logits sharded on the class dim this is loss-parallel: three all_reduces of N
    /// values (max, sum of exponentials, target logit) and no gather of the classes; the
    /// backward needs no communication at all.
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
            let (cdims, off, cols) = sharded_range(p, &p.sharding.input_specs[0], 1)?;
            if cdims.is_empty() {
                if fused::applies(x) && x.track_op() && x.dim(0)? > 0 && x.dim(1)? > 0 {
                    return fused::cross_entropy(x, t);
                }
                let lsm = log_softmax_local(x, 1)?;
                let picked = lsm.gather(&t.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?;
                return picked.neg()?.mean_all();
            }
            let ax = axes(p, &cdims)?;
            let n = x.dim(0)?;
            // Global row max (no gradient needed: the loss is shift-invariant).
            let mut m = if cols == 0 {
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
                let z = crate::node::graph_zeros(x, &[n, 1])?;
                (z.clone(), z)
            } else if fused::applies(x) && x.track_op() && n > 0 {
                let (local, inside) = local_ids(t, off, cols)?;
                (
                    fused::sum_exp_shifted(x, &m)?,
                    fused::pick_masked(x, &local, &inside)?,
                )
            } else {
                let e = x.broadcast_sub(&m)?.exp()?;
                let (local, inside) = local_ids(t, off, cols)?;
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
            lse.sub(&picked)?.mean_all()
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
