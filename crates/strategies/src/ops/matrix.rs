//! matmul / broadcast_matmul / linear / baddbmm: rows from one einsum-style generator (baddbmm's
//! bias mapped from the output like a broadcasting add, PyTorch's addmm).
//!
//! Each einsum index gives one row: an index kept in the output shards the output and every
//! input that has it (`S·R→S` for the lhs free dim, `R·S→S` for the rhs free dim,
//! `S(b)·S(b)→S(b)` for batch dims); a contracted index gives `S(k)·S(k)→P(sum)` when every input
//! has it. Linearity adds `P·R→P` and `R·P→P` for `sum` and `avg`.
//!
//! `linear` with a bias: a partial output needs a partial bias, or the bias would be added n
//! times. The contracted (row-parallel) row is `[P(sum)] <- [S(k), S(1), P(sum)]`: the expander
//! makes a replicated bias `P(sum)` with a free local partition (`b/n` on every rank, PyTorch's
//! `_partition_value`), so `Σ_r (x_r w_r^T + b/n) = x w^T + b` costs no communication. The
//! linearity rows pair a `P(sum)` activation or weight with a `P(sum)` bias, and a `P(avg)`
//! one with an `R` (`avg_r(x_r w^T + b) = x w^T + b`) or `P(avg)` bias.

use smallvec::SmallVec;

use super::{broadcast_shapes, expect_same_dtype, meta, p, s, R};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::{Placement, ReduceOp};
use crate::spec::{shape_str, Shape, TensorMeta};
use crate::strategy::StrategyRow;

fn baddbmm_metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let (bias, a, b) = (inputs[0], inputs[1], inputs[2]);
    expect_same_dtype(op, a, b)?;
    expect_same_dtype(op, a, bias)?;
    let ok = a.dtype.is_float()
        && a.ndim() == 3
        && b.ndim() == 3
        && a.shape[0] == b.shape[0]
        && a.shape[2] == b.shape[1];
    if !ok {
        return Err(StrategyError::shape(
            op,
            format!(
                "expects float a [B, n, k] and b [B, k, m], got {} and {}",
                shape_str(&a.shape),
                shape_str(&b.shape)
            ),
        ));
    }
    let out = [a.shape[0], a.shape[1], b.shape[2]];
    let fits = broadcast_shapes(op, &[&bias.shape, &out])?;
    if fits.as_slice() != out {
        return Err(StrategyError::shape(
            op,
            format!(
                "bias {} does not broadcast to {}",
                shape_str(&bias.shape),
                shape_str(&out)
            ),
        ));
    }
    Ok(vec![meta(&out, a.dtype)])
}

/// `beta * bias + alpha * (a @ b)`: the bmm rows with the bias sharded where it has the output
/// dim (R where it broadcasts); the contraction `[P(sum), P(sum), S(2), S(1)]` with the bias
/// joining as a partial (a free local partition of a replicated one); linearity with the bias
/// partial alike (`P(avg)` also with a replicated bias).
fn baddbmm_rows(inputs: &[&TensorMeta], outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let bias = &inputs[0].shape;
    let out = &outs[0].shape;
    let bias_at = |o: usize| super::bcast_map(out, bias, o).map(s).unwrap_or(R);
    let mut rows = vec![
        StrategyRow::new(&[s(0)], &[bias_at(0), s(0), s(0)]),
        StrategyRow::new(&[s(1)], &[bias_at(1), s(1), R]),
        StrategyRow::new(&[s(2)], &[bias_at(2), R, s(2)]),
        StrategyRow::new(&[p(ReduceOp::Sum)], &[p(ReduceOp::Sum), s(2), s(1)]),
    ];
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        rows.push(StrategyRow::new(&[p(op)], &[p(op), p(op), R]));
        rows.push(StrategyRow::new(&[p(op)], &[p(op), R, p(op)]));
    }
    rows.push(StrategyRow::new(
        &[p(ReduceOp::Avg)],
        &[R, p(ReduceOp::Avg), R],
    ));
    rows.push(StrategyRow::new(
        &[p(ReduceOp::Avg)],
        &[R, R, p(ReduceOp::Avg)],
    ));
    rows
}

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    if matches!(op, Op::Baddbmm { .. }) {
        return baddbmm_metas(op, inputs);
    }
    let (x, w) = (inputs[0], inputs[1]);
    expect_same_dtype(op, x, w)?;
    if !x.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("needs float inputs, got {}", x.dtype),
        ));
    }
    let (xs, ws) = (&x.shape, &w.shape);
    match op {
        Op::Linear { bias } => {
            if xs.is_empty() || ws.len() != 2 {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "expects x [.., in] and w [out, in], got {} and {}",
                        shape_str(xs),
                        shape_str(ws)
                    ),
                ));
            }
            if xs[xs.len() - 1] != ws[1] {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "in features differ: x {} vs w {}",
                        shape_str(xs),
                        shape_str(ws)
                    ),
                ));
            }
            if *bias {
                let b = inputs[2];
                expect_same_dtype(op, x, b)?;
                if b.shape.as_slice() != [ws[0]] {
                    return Err(StrategyError::shape(
                        op,
                        format!("bias must be [{}], got {}", ws[0], shape_str(&b.shape)),
                    ));
                }
            }
            let mut out = xs.clone();
            let last = out.len() - 1;
            out[last] = ws[0];
            Ok(vec![meta(&out, x.dtype)])
        }
        _ => {
            if xs.len() < 2 || ws.len() < 2 {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "needs >= 2-d inputs, got {} x {}",
                        shape_str(xs),
                        shape_str(ws)
                    ),
                ));
            }
            let (xn, wn) = (xs.len(), ws.len());
            if xs[xn - 1] != ws[wn - 2] {
                return Err(StrategyError::shape(
                    op,
                    format!("inner dims differ: {} x {}", shape_str(xs), shape_str(ws)),
                ));
            }
            let batch: Shape = if matches!(op, Op::Matmul) {
                if xs[..xn - 2] != ws[..wn - 2] {
                    return Err(StrategyError::shape(
                        op,
                        format!(
                            "batch dims differ: {} x {} (use broadcast_matmul)",
                            shape_str(xs),
                            shape_str(ws)
                        ),
                    ));
                }
                Shape::from_slice(&xs[..xn - 2])
            } else {
                broadcast_shapes(op, &[&xs[..xn - 2], &ws[..wn - 2]])?
            };
            let mut out = batch;
            out.push(xs[xn - 2]);
            out.push(ws[wn - 1]);
            Ok(vec![meta(&out, x.dtype)])
        }
    }
}

/// One einsum index: its dim in the output (if kept) and in each input (if present and not
/// broadcast).
struct Index {
    out: Option<usize>,
    ins: SmallVec<[Option<usize>; 3]>,
}

fn einsum_rows(indices: &[Index], n_in: usize) -> Vec<StrategyRow> {
    let mut rows = Vec::new();
    for idx in indices {
        let ins: SmallVec<[Placement; 4]> =
            (0..n_in).map(|i| idx.ins[i].map(s).unwrap_or(R)).collect();
        match idx.out {
            Some(o) => {
                if ins.iter().any(|p| p.is_shard()) {
                    rows.push(StrategyRow::new(&[s(o)], &ins));
                }
            }
            None => {
                if idx.ins.iter().all(|d| d.is_some()) {
                    rows.push(StrategyRow::new(&[p(ReduceOp::Sum)], &ins));
                }
            }
        }
    }
    rows
}

fn linearity_rows(n_in: usize, linear_inputs: &[usize], ops: &[ReduceOp]) -> Vec<StrategyRow> {
    let mut rows = Vec::new();
    for &op in ops {
        for &i in linear_inputs {
            let mut ins: SmallVec<[Placement; 4]> = smallvec::smallvec![R; n_in];
            ins[i] = p(op);
            rows.push(StrategyRow::new(&[p(op)], &ins));
        }
    }
    rows
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], outs: &[TensorMeta]) -> Vec<StrategyRow> {
    if matches!(op, Op::Baddbmm { .. }) {
        return baddbmm_rows(inputs, outs);
    }
    let (xs, ws) = (&inputs[0].shape, &inputs[1].shape);
    let out = &outs[0].shape;
    let (xn, wn, on) = (xs.len(), ws.len(), out.len());
    let mut idx: Vec<Index> = Vec::new();
    match op {
        Op::Linear { bias } => {
            let n_in = 2 + *bias as usize;
            let mk = |out: Option<usize>, x: Option<usize>, w: Option<usize>, b: Option<usize>| {
                let mut ins: SmallVec<[Option<usize>; 3]> = smallvec::smallvec![x, w];
                if *bias {
                    ins.push(b);
                }
                Index { out, ins }
            };
            for d in 0..xn - 1 {
                idx.push(mk(Some(d), Some(d), None, None));
            }
            idx.push(mk(Some(on - 1), None, Some(0), Some(0)));
            idx.push(mk(None, Some(xn - 1), Some(1), None));
            let mut rows = einsum_rows(&idx, n_in);
            if *bias {
                // The contraction row: the bias joins the partial sum as a partial itself.
                rows.push(StrategyRow::new(
                    &[p(ReduceOp::Sum)],
                    &[s(xn - 1), s(1), p(ReduceOp::Sum)],
                ));
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    for i in 0..2 {
                        let mut ins: SmallVec<[Placement; 4]> = smallvec::smallvec![R; 3];
                        ins[i] = p(op);
                        ins[2] = p(op);
                        rows.push(StrategyRow::new(&[p(op)], &ins));
                    }
                }
                rows.extend(linearity_rows(n_in, &[0, 1], &[ReduceOp::Avg]));
            } else {
                rows.extend(linearity_rows(
                    n_in,
                    &[0, 1],
                    &[ReduceOp::Sum, ReduceOp::Avg],
                ));
            }
            rows
        }
        _ => {
            // Batch dims, right-aligned to the output batch; a broadcast input stays R.
            let nb = on - 2;
            for b in 0..nb {
                let map = |shape: &[usize], n: usize| -> Option<usize> {
                    let off = nb.checked_sub(n - 2)?;
                    let d = b.checked_sub(off)?;
                    (shape[d] == out[b]).then_some(d)
                };
                idx.push(Index {
                    out: Some(b),
                    ins: smallvec::smallvec![map(xs, xn), map(ws, wn)],
                });
            }
            idx.push(Index {
                out: Some(on - 2),
                ins: smallvec::smallvec![Some(xn - 2), None],
            });
            idx.push(Index {
                out: Some(on - 1),
                ins: smallvec::smallvec![None, Some(wn - 1)],
            });
            idx.push(Index {
                out: None,
                ins: smallvec::smallvec![Some(xn - 1), Some(wn - 2)],
            });
            let mut rows = einsum_rows(&idx, 2);
            rows.extend(linearity_rows(2, &[0, 1], &[ReduceOp::Sum, ReduceOp::Avg]));
            rows
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ops::f32_table as table;
    use crate::{DType, Op, TensorMeta};

    #[test]
    fn bmm_and_broadcast_batch() {
        let t = table(&Op::Matmul, &[&[4, 8, 16], &[4, 16, 2]]);
        assert_eq!(t[0], "S(0) <- S(0), S(0)");
        let t = table(&Op::BroadcastMatmul, &[&[4, 8, 16], &[16, 2]]);
        assert_eq!(t[0], "S(0) <- S(0), R");
        assert_eq!(t[3], "P(sum) <- S(2), S(0)");
    }

    #[test]
    fn linear_rows() {
        let t = table(&Op::Linear { bias: true }, &[&[8, 4, 16], &[32, 16], &[32]]);
        assert_eq!(
            t,
            vec![
                "S(0) <- S(0), R, R",
                "S(1) <- S(1), R, R",
                "S(2) <- R, S(0), S(0)",
                "P(sum) <- S(2), S(1), P(sum)",
                "P(sum) <- P(sum), R, P(sum)",
                "P(sum) <- R, P(sum), P(sum)",
                "P(avg) <- P(avg), R, P(avg)",
                "P(avg) <- R, P(avg), P(avg)",
                "P(avg) <- P(avg), R, R",
                "P(avg) <- R, P(avg), R",
            ]
        );
        let t = table(&Op::Linear { bias: false }, &[&[8, 16], &[32, 16]]);
        assert!(t.contains(&"P(sum) <- S(1), S(1)".to_string()), "{t:?}");
    }

    #[test]
    fn shape_errors() {
        let x = TensorMeta::new(&[8, 16], DType::F32);
        let w = TensorMeta::new(&[12, 4], DType::F32);
        let e = Op::Matmul.output_metas(&[&x, &w]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "matmul: inner dims differ: [8, 16] x [12, 4]"
        );
    }
}
