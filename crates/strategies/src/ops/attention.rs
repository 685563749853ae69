//! Scaled dot-product attention `q [B, H, T, d]`, `k [B, H, S, d]`, `v [B, H, S, dv]` ->
//! `[B, H, T, dv]`: shard the batch or the heads on all four tensors alike. The packed form
//! `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` shards the batch (dim 0) or the heads (dim 2). The
//! flat form `qkv [B, T, 3 H d]` -> `[B, T, H d]` shards the batch or, between whole heads
//! only, the features (dim 2).

use super::{expect_same_dtype, meta, s};
use crate::cost::CollectiveKind;
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::spec::TensorMeta;
use crate::strategy::{StrategyRow, TensorRef};

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    match op {
        Op::PackedSdpa { .. } => return packed_metas(op, inputs),
        Op::FlatSdpa { heads, .. } => return flat_metas(op, inputs[0], *heads),
        _ => {}
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

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    match op {
        Op::PackedSdpa { .. } => return packed_rows(inputs[0]),
        Op::FlatSdpa { heads, .. } => return flat_rows(inputs[0], *heads),
        _ => {}
    }
    let mut rows: Vec<StrategyRow> = (0..2)
        .map(|d| StrategyRow::new(&[s(d)], &[s(d), s(d), s(d)]))
        .collect();
    let bytes = |t: &TensorMeta| (t.numel() * t.dtype.size_in_bytes()) as u64;
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let o = bytes(q) / q.shape[3].max(1) as u64 * v.shape[3] as u64;
    rows.extend(context_parallel_rows(
        &[s(2)],
        &[s(2), s(2), s(2)],
        3,
        2,
        1,
        bytes(k) + bytes(v),
        [bytes(q), bytes(k), bytes(v), o],
    ));
    rows
}

/// Context parallelism: the sequence dim (`seq` of every input) sharded. Two rows with the
/// same placements, told apart by their internal comms (which the runtime reads back to run
/// the chosen one, `candle_dtensor_core::cp`):
/// * KV exchange: ring attention (or all-gather K/V), a ring exchange of K and V (`kv` bytes,
///   priced as the all_gather that moves the same bytes in as many steps);
/// * all-to-all (Ulysses): sequence-to-heads all_to_alls of q, k, v and heads-to-sequence of
///   the output (`a2a` bytes, global; each buffer is one rank's piece).
///
/// Both need every rank to hold part of the sequence, and no other mesh dim may also shard it
/// (the ring's positions are those of one dim); all-to-all needs the mesh dim to divide the
/// (local) heads.
fn context_parallel_rows(
    outs: &[crate::Placement],
    ins: &[crate::Placement],
    n_inputs: usize,
    seq: usize,
    heads: usize,
    kv: u64,
    a2a: [u64; 4],
) -> Vec<StrategyRow> {
    let seal = |mut r: StrategyRow| {
        for i in 0..n_inputs {
            r = r.sole(TensorRef::Input(i), seq);
        }
        r.nonempty(TensorRef::Input(0), seq).no_strided()
    };
    let exchange = seal(StrategyRow::new(outs, ins).with_internal(
        CollectiveKind::RingExchange,
        kv,
        TensorRef::Input(0),
    ));
    let mut ulysses = StrategyRow::new(outs, ins);
    for b in a2a {
        ulysses = ulysses.with_internal_piece(CollectiveKind::AllToAll, b, TensorRef::Input(0));
    }
    vec![exchange, seal(ulysses).divides(TensorRef::Input(0), heads)]
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

fn packed_rows(x: &TensorMeta) -> Vec<StrategyRow> {
    // Batch or heads; q/k/v (dim 3) belong together; the sequence (dim 1) by context
    // parallelism.
    let mut rows: Vec<StrategyRow> = [0, 2]
        .into_iter()
        .map(|d| StrategyRow::new(&[s(d)], &[s(d)]))
        .collect();
    let third = (x.numel() * x.dtype.size_in_bytes()) as u64 / 3;
    rows.extend(context_parallel_rows(
        &[s(1)],
        &[s(1)],
        1,
        1,
        2,
        2 * third,
        [third, third, third, third],
    ));
    rows
}

fn flat_metas(op: &Op, x: &TensorMeta, heads: usize) -> Result<Vec<TensorMeta>> {
    let ok =
        x.ndim() == 3 && heads > 0 && x.shape[2] > 0 && x.shape[2] % heads.saturating_mul(3) == 0;
    if !ok || !x.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("expects a float flat qkv [B, T, 3 x {heads} heads x d] (d > 0), got {x}"),
        ));
    }
    let out = [x.shape[0], x.shape[1], x.shape[2] / 3];
    Ok(vec![meta(&out, x.dtype)])
}

fn flat_rows(x: &TensorMeta, heads: usize) -> Vec<StrategyRow> {
    // The batch; or the features between whole heads: every piece of the projection whole
    // heads' q, k, v (3 d each), every piece of the output the same heads (d each), which
    // even pieces of both guarantee. No context-parallel rows: a sequence shard of the flat
    // form is gathered (`packed_sdpa` has them).
    let d = x.shape[2] / (3 * heads);
    let (i, o) = (TensorRef::Input(0), TensorRef::Output(0));
    vec![
        StrategyRow::new(&[s(0)], &[s(0)]),
        StrategyRow::new(&[s(2)], &[s(2)])
            .even(i, 2)
            .even(o, 2)
            .multiple_of(i, 2, 3 * d)
            .multiple_of(o, 2, d)
            .no_strided(),
    ]
}
