//! Reductions over dims (with keepdim): sum, mean, max, min, prod, norm, logsumexp, var, std;
//! argmax, argmin.
//!
//! For each input dim `d`: reduced -> `[P(op), S(d)]`, kept -> `[S(d'), S(d)]` (`d'` shifted
//! when `!keepdim`). A mean is a sum divided by the GLOBAL count: `mean` over a sharded dim is
//! `[P(sum), S(d)]`, each rank dividing its local sum by the global number of reduced elements,
//! so uneven (even empty) shards need no data movement (the mean of uneven shards' means would
//! be wrong, PyTorch #162692; PyTorch forces even shards instead). `max`/`min -> P(max|min)`
//! require non-empty shards (a max over nothing has no value); `prod -> P(product)` (the product
//! over nothing is 1). `norm`: `p = 1` is a sum (`P(sum)`), `p = inf` a max (`P(max)`); other `p`,
//! `logsumexp`, `var` and `std` over a sharded dim reduce inside the op and come out `R`: local
//! sums of `|x|^p` and one all_reduce; a max and a sum of shifted exponentials, two all_reduces;
//! a sum (for the mean) and a sum of squared deviations, two all_reduces (all of the output's
//! size). Linear reductions pass `P(sum)` and `P(avg)` through; max/min/prod pass their own
//! partial through. `argmax`/`argmin` shard only kept dims (indices are positions in the whole
//! dim).

use super::{check_dim, meta, p, s, PAVG, PMAX, PMIN, PSUM, R};
use crate::cost::CollectiveKind;
use crate::error::Result;
use crate::op::{Dims, Op};
use crate::placement::ReduceOp;
use crate::spec::{DType, Shape, TensorMeta};
use crate::strategy::{StrategyRow, TensorRef};

fn reduced_dims(dims: &Dims, ndim: usize) -> Dims {
    if dims.is_empty() {
        (0..ndim).collect()
    } else {
        dims.clone()
    }
}

fn out_shape(shape: &[usize], reduced: &Dims, keepdim: bool) -> Shape {
    let mut out = Shape::new();
    for (d, &n) in shape.iter().enumerate() {
        if reduced.contains(&d) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(n);
        }
    }
    out
}

fn parts(op: &Op) -> (Dims, bool) {
    match op {
        Op::Sum { dims, keepdim }
        | Op::Mean { dims, keepdim }
        | Op::Max { dims, keepdim }
        | Op::Min { dims, keepdim }
        | Op::Prod { dims, keepdim }
        | Op::Norm { dims, keepdim, .. }
        | Op::LogSumExp { dims, keepdim }
        | Op::Var { dims, keepdim, .. }
        | Op::Std { dims, keepdim, .. } => (dims.clone(), *keepdim),
        Op::ArgMax { dim, keepdim } | Op::ArgMin { dim, keepdim } => {
            (smallvec::smallvec![*dim], *keepdim)
        }
        _ => (Dims::new(), false),
    }
}

/// How a sharded reduced dim reduces: into a Partial, or inside the op (`n` all_reduces of the
/// output's size, the output `R`), or not at all (arg-reductions).
enum Sharded {
    Partial(ReduceOp),
    Internal(usize),
    No,
}

fn sharded(op: &Op) -> Sharded {
    match op {
        Op::Sum { .. } | Op::Mean { .. } => Sharded::Partial(ReduceOp::Sum),
        Op::Max { .. } => Sharded::Partial(ReduceOp::Max),
        Op::Min { .. } => Sharded::Partial(ReduceOp::Min),
        Op::Prod { .. } => Sharded::Partial(ReduceOp::Product),
        Op::Norm { p, .. } if p.get() == 1.0 => Sharded::Partial(ReduceOp::Sum),
        Op::Norm { p, .. } if p.get() == f64::INFINITY => Sharded::Partial(ReduceOp::Max),
        Op::Norm { .. } => Sharded::Internal(1),
        Op::LogSumExp { .. } | Op::Var { .. } | Op::Std { .. } => Sharded::Internal(2),
        _ => Sharded::No,
    }
}

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    let (dims, keepdim) = parts(op);
    for (i, &d) in dims.iter().enumerate() {
        check_dim(op, d, x.ndim())?;
        if dims[..i].contains(&d) {
            return Err(crate::StrategyError::arg(op, format!("dim {d} repeated")));
        }
    }
    let reduced = reduced_dims(&dims, x.ndim());
    let dtype = if matches!(op, Op::ArgMax { .. } | Op::ArgMin { .. }) {
        DType::U32
    } else {
        x.dtype
    };
    let float_only = matches!(
        op,
        Op::Mean { .. } | Op::Norm { .. } | Op::LogSumExp { .. } | Op::Var { .. } | Op::Std { .. }
    );
    if float_only && !x.dtype.is_float() {
        return Err(crate::StrategyError::shape(
            op,
            format!("needs a float input, got {}", x.dtype),
        ));
    }
    if let Op::Norm { p, .. } = op {
        if p.get().is_nan() || p.get() <= 0.0 {
            return Err(crate::StrategyError::arg(
                op,
                format!("p = {p}: the order must be > 0 (inf allowed)"),
            ));
        }
    }
    Ok(vec![meta(&out_shape(&x.shape, &reduced, keepdim), dtype)])
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let x = inputs[0];
    let (dims, keepdim) = parts(op);
    let reduced = reduced_dims(&dims, x.ndim());
    let how = sharded(op);
    let out_bytes = outs[0].bytes();
    let mut rows = Vec::new();
    let mut kept = 0usize;
    for d in 0..x.ndim() {
        if reduced.contains(&d) {
            match how {
                Sharded::Partial(rop) => {
                    let mut row = StrategyRow::new(&[p(rop)], &[s(d)]);
                    if matches!(rop, ReduceOp::Max | ReduceOp::Min) {
                        row = row.nonempty(TensorRef::Input(0), d);
                    }
                    rows.push(row);
                }
                Sharded::Internal(n) => {
                    let mut row = StrategyRow::new(&[R], &[s(d)]);
                    for _ in 0..n {
                        row = row.with_internal(
                            CollectiveKind::AllReduce,
                            out_bytes,
                            TensorRef::Output(0),
                        );
                    }
                    rows.push(row);
                }
                Sharded::No => {}
            }
            if keepdim {
                kept += 1;
            }
        } else {
            rows.push(StrategyRow::new(&[s(kept)], &[s(d)]));
            kept += 1;
        }
    }
    match op {
        Op::Sum { .. } | Op::Mean { .. } => {
            rows.push(StrategyRow::new(&[PSUM], &[PSUM]));
            rows.push(StrategyRow::new(&[PAVG], &[PAVG]));
        }
        Op::Max { .. } => rows.push(StrategyRow::new(&[PMAX], &[PMAX])),
        Op::Min { .. } => rows.push(StrategyRow::new(&[PMIN], &[PMIN])),
        Op::Prod { .. } => rows.push(StrategyRow::new(
            &[p(ReduceOp::Product)],
            &[p(ReduceOp::Product)],
        )),
        _ => {}
    }
    rows
}

#[cfg(test)]
mod tests {
    use crate::op::Op;
    use crate::ops::f32_table;
    use crate::{single_dim_strategies, DType, TensorMeta};

    fn table(op: &Op, shape: &[usize]) -> Vec<String> {
        f32_table(op, &[shape])
    }

    #[test]
    fn sum_and_mean() {
        let op = Op::Sum {
            dims: smallvec::smallvec![1],
            keepdim: false,
        };
        assert_eq!(
            table(&op, &[4, 6, 8]),
            [
                "S(0) <- S(0)",
                "P(sum) <- S(1)",
                "S(1) <- S(2)",
                "P(sum) <- P(sum)",
                "P(avg) <- P(avg)"
            ]
        );
        let op = Op::Mean {
            dims: smallvec::smallvec![1],
            keepdim: true,
        };
        assert_eq!(table(&op, &[4, 6, 8])[1], "P(sum) <- S(1)");
        assert_eq!(table(&op, &[4, 6, 8])[2], "S(2) <- S(2)");
        let m = TensorMeta::new(&[4, 6, 8], DType::F32);
        let rows = single_dim_strategies(&op, &[&m]).unwrap();
        assert!(
            rows[1].requires_even.is_empty(),
            "a mean divides by the global count"
        );
        let all = Op::Sum {
            dims: smallvec::smallvec![],
            keepdim: false,
        };
        assert_eq!(all.output_metas(&[&m]).unwrap()[0].shape.len(), 0);
    }

    #[test]
    fn argmax_shards_kept_dims_only() {
        let op = Op::ArgMax {
            dim: 0,
            keepdim: false,
        };
        assert_eq!(table(&op, &[4, 6]), ["S(0) <- S(1)"]);
    }
}
