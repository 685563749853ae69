//! Reductions: sum / mean / max / min over dims (with keepdim), argmax.
//!
//! For each input dim `d`: reduced -> `[P(op), S(d)]`, kept -> `[S(d'), S(d)]` (`d'` shifted
//! when `!keepdim`). A mean is a sum divided by the GLOBAL count: `mean` over a sharded dim is
//! `[P(sum), S(d)]`, each rank dividing its local sum by the global number of reduced elements,
//! so uneven (even empty) shards need no data movement (the mean of uneven shards' means would
//! be wrong, PyTorch #162692; PyTorch forces even shards instead). `max`/`min -> P(max|min)`
//! require non-empty shards (a max over nothing has no value). Linear reductions pass `P(sum)`
//! and `P(avg)` through; max/min pass their own partial through. `argmax` shards only kept dims
//! (indices are local).

use super::{check_dim, meta, p, s, PAVG, PMAX, PMIN, PSUM};
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
        | Op::Min { dims, keepdim } => (dims.clone(), *keepdim),
        Op::ArgMax { dim, keepdim } => (smallvec::smallvec![*dim], *keepdim),
        _ => (Dims::new(), false),
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
    let dtype = if matches!(op, Op::ArgMax { .. }) {
        DType::U32
    } else {
        x.dtype
    };
    if matches!(op, Op::Mean { .. }) && !x.dtype.is_float() {
        return Err(crate::StrategyError::shape(
            op,
            format!("mean needs a float input, got {}", x.dtype),
        ));
    }
    Ok(vec![meta(&out_shape(&x.shape, &reduced, keepdim), dtype)])
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let x = inputs[0];
    let (dims, keepdim) = parts(op);
    let reduced = reduced_dims(&dims, x.ndim());
    let reduce_op = match op {
        Op::Sum { .. } | Op::Mean { .. } => Some(ReduceOp::Sum),
        Op::Max { .. } => Some(ReduceOp::Max),
        Op::Min { .. } => Some(ReduceOp::Min),
        _ => None, // argmax
    };
    let mut rows = Vec::new();
    let mut kept = 0usize;
    for d in 0..x.ndim() {
        if reduced.contains(&d) {
            if let Some(rop) = reduce_op {
                let mut row = StrategyRow::new(&[p(rop)], &[s(d)]);
                if matches!(rop, ReduceOp::Max | ReduceOp::Min) {
                    row = row.nonempty(TensorRef::Input(0), d);
                }
                rows.push(row);
            }
            if keepdim {
                kept += 1;
            }
        } else {
            rows.push(StrategyRow::new(&[s(kept)], &[s(d)]));
            kept += 1;
        }
    }
    match reduce_op {
        Some(ReduceOp::Sum) | Some(ReduceOp::Avg) => {
            rows.push(StrategyRow::new(&[PSUM], &[PSUM]));
            rows.push(StrategyRow::new(&[PAVG], &[PAVG]));
        }
        Some(ReduceOp::Max) => rows.push(StrategyRow::new(&[PMAX], &[PMAX])),
        Some(ReduceOp::Min) => rows.push(StrategyRow::new(&[PMIN], &[PMIN])),
        _ => {}
    }
    rows
}

#[cfg(test)]
mod tests {
    use crate::op::Op;
    use crate::{single_dim_strategies, DType, TensorMeta};

    fn table(op: &Op, shape: &[usize]) -> Vec<String> {
        let m = TensorMeta::new(shape, DType::F32);
        single_dim_strategies(op, &[&m])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect()
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
