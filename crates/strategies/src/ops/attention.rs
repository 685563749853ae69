//! Scaled dot-product attention `q [B, H, T, d]`, `k [B, H, S, d]`, `v [B, H, S, dv]` ->
//! `[B, H, T, dv]`: shard the batch or the heads on all four tensors alike. The packed form
//! `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` shards the batch (dim 0) or the heads (dim 2).

use super::{expect_same_dtype, meta, s};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::spec::TensorMeta;
use crate::strategy::StrategyRow;

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    if matches!(op, Op::PackedSdpa { .. }) {
        return packed_metas(op, inputs);
    }
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    expect_same_dtype(op, q, k)?;
    expect_same_dtype(op, q, v)?;
    let ok = q.ndim() == 4
        && k.ndim() == 4
        && v.ndim() == 4
        && q.shape[..2] == k.shape[..2]
        && q.shape[..2] == v.shape[..2]
        && q.shape[3] == k.shape[3]
        && k.shape[2] == v.shape[2];
    if !ok || !q.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("expects float q [B,H,T,d], k [B,H,S,d], v [B,H,S,dv], got {q}, {k}, {v}"),
        ));
    }
    let out = [q.shape[0], q.shape[1], q.shape[2], v.shape[3]];
    Ok(vec![meta(&out, q.dtype)])
}

pub(super) fn rows(op: &Op, _inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    if matches!(op, Op::PackedSdpa { .. }) {
        return packed_rows();
    }
    (0..2)
        .map(|d| StrategyRow::new(&[s(d)], &[s(d), s(d), s(d)]))
        .collect()
}

fn packed_metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    if x.ndim() != 5 || x.shape[3] != 3 || !x.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("expects a float packed qkv [B, T, H, 3, d], got {x}"),
        ));
    }
    let out = [x.shape[0], x.shape[1], x.shape[2], x.shape[4]];
    Ok(vec![meta(&out, x.dtype)])
}

fn packed_rows() -> Vec<StrategyRow> {
    // Batch or heads; the sequence dim needs every key, and q/k/v (dim 3) belong together.
    [0, 2]
        .into_iter()
        .map(|d| StrategyRow::new(&[s(d)], &[s(d)]))
        .collect()
}
