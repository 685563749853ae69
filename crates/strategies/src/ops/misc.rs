//! pad (the padded dim must be `R`; other dims shard; `P(avg|max|min)` pass, `P(sum)` only for
//! a zero fill), cat / stack (the cat dim must be `R`), contiguous and to_dtype (every placement passes;
//! to_dtype keeps sum/avg/product partials only when casting to a float type, since rounding
//! summands to integers changes their sum), where / masked_fill / dropout (sharded only: a fill
//! value or a dropout mask applied to each summand of a partial sum would be wrong).

use smallvec::SmallVec;

use super::{
    broadcast_shapes, check_dim, expect_int, expect_same_dtype, meta, p, pointwise_shard_rows, s,
};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::{Placement, ReduceOp};
use crate::spec::{shape_str, TensorMeta};
use crate::strategy::StrategyRow;

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    match op {
        Op::Cat { dim } | Op::Stack { dim } => {
            let stack = matches!(op, Op::Stack { .. });
            check_dim(op, *dim, x.ndim() + stack as usize)?;
            let mut cat_len = 0usize;
            for m in inputs {
                expect_same_dtype(op, x, m)?;
                let same = m.ndim() == x.ndim()
                    && m.shape
                        .iter()
                        .zip(&x.shape)
                        .enumerate()
                        .all(|(d, (a, b))| a == b || (!stack && d == *dim));
                if !same {
                    return Err(StrategyError::shape(
                        op,
                        format!(
                            "input shapes do not fit: {} vs {}",
                            shape_str(&x.shape),
                            shape_str(&m.shape)
                        ),
                    ));
                }
                if !stack {
                    cat_len += m.shape[*dim];
                }
            }
            let mut out = x.shape.clone();
            if stack {
                out.insert(*dim, inputs.len());
            } else {
                out[*dim] = cat_len;
            }
            Ok(vec![meta(&out, x.dtype)])
        }
        Op::ToDType(dt) => Ok(vec![meta(&x.shape, *dt)]),
        Op::Where => {
            let (c, a, b) = (inputs[0], inputs[1], inputs[2]);
            expect_int(op, "cond", c)?;
            expect_same_dtype(op, a, b)?;
            let shape = broadcast_shapes(op, &[&c.shape, &a.shape, &b.shape])?;
            Ok(vec![meta(&shape, a.dtype)])
        }
        Op::MaskedFill { .. } => {
            let mask = inputs[1];
            expect_int(op, "mask", mask)?;
            let shape = broadcast_shapes(op, &[&x.shape, &mask.shape])?;
            if shape != x.shape {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "mask {} does not broadcast to {}",
                        shape_str(&mask.shape),
                        shape_str(&x.shape)
                    ),
                ));
            }
            Ok(vec![x.clone()])
        }
        Op::Dropout { p } => {
            if !(0.0..1.0).contains(&p.get()) {
                return Err(StrategyError::arg(op, format!("p = {p} is not in [0, 1)")));
            }
            Ok(vec![x.clone()])
        }
        Op::Pad {
            dim, before, after, ..
        } => {
            check_dim(op, *dim, x.ndim())?;
            let mut out = x.shape.clone();
            out[*dim] += before + after;
            Ok(vec![meta(&out, x.dtype)])
        }
        _ => Ok(vec![x.clone()]),
    }
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let n = inputs.len();
    let nd = inputs[0].ndim();
    let all = |pl: Placement| -> SmallVec<[Placement; 4]> { smallvec::smallvec![pl; n] };
    let mut rows = Vec::new();
    let partials = |ops: &[ReduceOp], rows: &mut Vec<StrategyRow>| {
        for &o in ops {
            rows.push(StrategyRow::new(&[p(o)], &all(p(o))));
        }
    };
    match op {
        Op::Cat { dim } => {
            for d in (0..nd).filter(|d| d != dim) {
                rows.push(StrategyRow::new(&[s(d)], &all(s(d))));
            }
            partials(&ReduceOp::ALL, &mut rows);
        }
        Op::Stack { dim } => {
            for d in 0..nd {
                let o = if d < *dim { d } else { d + 1 };
                rows.push(StrategyRow::new(&[s(o)], &all(s(d))));
            }
            partials(&ReduceOp::ALL, &mut rows);
        }
        Op::Contiguous | Op::ToDType(_) => {
            for d in 0..nd {
                rows.push(StrategyRow::new(&[s(d)], &[s(d)]));
            }
            let keep_linear = match op {
                Op::ToDType(dt) => dt.is_float(),
                _ => true,
            };
            let ops: &[ReduceOp] = if keep_linear {
                &ReduceOp::ALL
            } else {
                &[ReduceOp::Max, ReduceOp::Min]
            };
            partials(ops, &mut rows);
        }
        Op::Dropout { .. } => {
            for d in 0..nd {
                rows.push(StrategyRow::new(&[s(d)], &[s(d)]));
            }
        }
        Op::Pad { dim, value, .. } => {
            for d in (0..nd).filter(|d| d != dim) {
                rows.push(StrategyRow::new(&[s(d)], &[s(d)]));
            }
            // pad(x_r, v) reduces to pad(x, v) for avg/max/min with any v, for sum with v = 0.
            let mut ops = vec![ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
            if value.get() == 0.0 {
                ops.insert(0, ReduceOp::Sum);
            }
            partials(&ops, &mut rows);
        }
        _ => {
            // where / masked_fill: pointwise over the broadcast inputs.
            let shapes: Vec<&[usize]> = inputs.iter().map(|m| m.shape.as_slice()).collect();
            rows = pointwise_shard_rows(&outs[0].shape, &shapes, 1);
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use crate::{single_dim_strategies, DType, Op, TensorMeta};

    #[test]
    fn cat_and_casts() {
        let a = TensorMeta::new(&[2, 3], DType::F32);
        let b = TensorMeta::new(&[4, 3], DType::F32);
        let rows = single_dim_strategies(&Op::Cat { dim: 0 }, &[&a, &b]).unwrap();
        assert_eq!(rows[0].to_string(), "S(1) <- S(1), S(1)");
        assert_eq!(
            Op::Cat { dim: 0 }.output_metas(&[&a, &b]).unwrap()[0]
                .shape
                .as_slice(),
            &[6, 3]
        );
        assert!(Op::Stack { dim: 0 }.output_metas(&[&a, &b]).is_err());
        let rows = single_dim_strategies(&Op::ToDType(DType::I64), &[&a]).unwrap();
        assert!(rows.iter().all(|r| r.to_string() != "P(sum) <- P(sum)"));
        let rows = single_dim_strategies(&Op::ToDType(DType::BF16), &[&a]).unwrap();
        assert!(rows.iter().any(|r| r.to_string() == "P(sum) <- P(sum)"));
    }
}
