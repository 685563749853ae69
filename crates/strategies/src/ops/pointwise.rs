//! Elementwise ops: unary maps, affine, scalar ops, broadcasting binary ops and comparisons.
//!
//! Shard rows: every output dim may be sharded, with every non-broadcast input sharded alike
//! (uneven shards are fine). Partial rows, one justification each:
//! * linear maps (`neg`, `x*c`, `x/c`, `affine` without offset): `f(Σx) = Σf(x)` keeps `P(sum)`, `P(avg)`.
//! * any affine `x*c+b`: `avg(x*c+b) = avg(x)*c+b` keeps `P(avg)`.
//! * non-decreasing maps: `f(max x) = max f(x)` keeps `P(max)`/`P(min)`; non-increasing swap them.
//! * add: `P(s)+P(s)`, `P(a)+P(a)`, `P(a)+R`, `R+P(a)`, `P(max)+R`, `P(min)+R` (and mirrored);
//!   never `P(sum)+R` (R would be added n times).
//! * sub: as add, with `R-P(max)->P(min)` and `R-P(min)->P(max)`.
//! * mul: `P(s|a)*R`, `R*P(s|a)`; div: numerator only.
//! * maximum: `P(max),P(max)->P(max)`; `P(max|min),R` (max with a constant is non-decreasing);
//!   minimum mirrored.
//! * comparisons: shard-only (the result of comparing summands means nothing).

use super::{
    broadcast_shapes, expect_same_dtype, meta, pointwise_shard_rows, PAVG, PMAX, PMIN, PSUM, R,
};
use crate::error::{Result, StrategyError};
use crate::op::{BinaryOp, Monotonicity, Op, ScalarOp};
use crate::placement::{Placement, ReduceOp};
use crate::spec::{DType, TensorMeta};
use crate::strategy::StrategyRow;

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    match op {
        Op::Binary(_) | Op::Cmp(_) => {
            let (a, b) = (inputs[0], inputs[1]);
            expect_same_dtype(op, a, b)?;
            let shape = broadcast_shapes(op, &[&a.shape, &b.shape])?;
            let dtype = if matches!(op, Op::Cmp(_)) {
                DType::U8
            } else {
                a.dtype
            };
            Ok(vec![meta(&shape, dtype)])
        }
        Op::Unary(u) if u.float_only() && !inputs[0].dtype.is_float() => Err(StrategyError::shape(
            op,
            format!("needs a float input, got {}", inputs[0]),
        )),
        _ => Ok(vec![inputs[0].clone()]),
    }
}

fn unary_partials(
    linear: bool,
    keeps_avg: bool,
    mono: Monotonicity,
) -> Vec<(Placement, Placement)> {
    let mut v = Vec::new();
    if linear {
        v.push((PSUM, PSUM));
    }
    if linear || keeps_avg {
        v.push((PAVG, PAVG));
    }
    match mono {
        Monotonicity::NonDecreasing => {
            v.push((PMAX, PMAX));
            v.push((PMIN, PMIN));
        }
        Monotonicity::NonIncreasing => {
            v.push((PMIN, PMAX));
            v.push((PMAX, PMIN));
        }
        Monotonicity::None => {}
    }
    v
}

fn sign_mono(c: f64) -> Monotonicity {
    if c >= 0.0 {
        Monotonicity::NonDecreasing
    } else if c < 0.0 {
        Monotonicity::NonIncreasing
    } else {
        Monotonicity::None // NaN
    }
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let out = &outs[0].shape;
    let shapes: Vec<&[usize]> = inputs.iter().map(|m| m.shape.as_slice()).collect();
    let mut rows = pointwise_shard_rows(out, &shapes, 1);
    let unary: Vec<(Placement, Placement)> = match op {
        Op::Unary(u) => unary_partials(u.is_linear(), false, u.monotonicity()),
        Op::Affine { mul, add } => unary_partials(
            add.get() == 0.0 && mul.get().is_finite(),
            mul.get().is_finite(),
            sign_mono(mul.get()),
        ),
        Op::ScalarOp(sop, c) => {
            let c = c.get();
            match sop {
                ScalarOp::Add | ScalarOp::Sub => {
                    unary_partials(false, c.is_finite(), Monotonicity::NonDecreasing)
                }
                ScalarOp::Mul => unary_partials(c.is_finite(), c.is_finite(), sign_mono(c)),
                ScalarOp::Div => {
                    let ok = c.is_finite() && c != 0.0;
                    unary_partials(ok, ok, if ok { sign_mono(c) } else { Monotonicity::None })
                }
                ScalarOp::Maximum | ScalarOp::Minimum => {
                    unary_partials(false, false, Monotonicity::NonDecreasing)
                }
                ScalarOp::Pow => Vec::new(),
            }
        }
        Op::Binary(b) => {
            for (o, x, y) in binary_partials(*b) {
                rows.push(StrategyRow::new(&[o], &[x, y]));
            }
            Vec::new()
        }
        _ => Vec::new(),
    };
    for (i, o) in unary {
        rows.push(StrategyRow::new(&[o], &[i]));
    }
    rows
}

fn binary_partials(b: BinaryOp) -> Vec<(Placement, Placement, Placement)> {
    let pp = |op: ReduceOp| Placement::Partial(op);
    match b {
        BinaryOp::Add => vec![
            (PSUM, PSUM, PSUM),
            (PAVG, PAVG, PAVG),
            (PAVG, PAVG, R),
            (PAVG, R, PAVG),
            (PMAX, PMAX, R),
            (PMAX, R, PMAX),
            (PMIN, PMIN, R),
            (PMIN, R, PMIN),
        ],
        BinaryOp::Sub => vec![
            (PSUM, PSUM, PSUM),
            (PAVG, PAVG, PAVG),
            (PAVG, PAVG, R),
            (PAVG, R, PAVG),
            (PMAX, PMAX, R),
            (PMIN, R, PMAX),
            (PMIN, PMIN, R),
            (PMAX, R, PMIN),
        ],
        BinaryOp::Mul => vec![
            (PSUM, PSUM, R),
            (PSUM, R, PSUM),
            (PAVG, PAVG, R),
            (PAVG, R, PAVG),
        ],
        BinaryOp::Div => vec![(PSUM, PSUM, R), (PAVG, PAVG, R)],
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let (same, other) = if b == BinaryOp::Maximum {
                (ReduceOp::Max, ReduceOp::Min)
            } else {
                (ReduceOp::Min, ReduceOp::Max)
            };
            vec![
                (pp(same), pp(same), pp(same)),
                (pp(same), pp(same), R),
                (pp(same), R, pp(same)),
                (pp(other), pp(other), R),
                (pp(other), R, pp(other)),
            ]
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::op::{BinaryOp, CmpOp, Op, UnaryOp};
    use crate::ops::f32_table as table;
    use crate::{DType, TensorMeta};

    #[test]
    fn add_with_broadcasting() {
        let t = table(&Op::Binary(BinaryOp::Add), &[&[4, 8], &[1, 8]]);
        assert_eq!(&t[..2], &["S(0) <- S(0), R", "S(1) <- S(1), S(1)"]);
        assert!(t.contains(&"P(avg) <- P(avg), R".to_string()));
        assert!(!t.iter().any(|r| r == "P(sum) <- P(sum), R"));
        let t = table(&Op::Binary(BinaryOp::Add), &[&[8], &[4, 8]]);
        assert_eq!(&t[..2], &["S(0) <- R, S(0)", "S(1) <- S(0), S(1)"]);
    }

    #[test]
    fn unary_tags() {
        let t = table(&Op::Unary(UnaryOp::Neg), &[&[4]]);
        assert_eq!(
            t,
            [
                "S(0) <- S(0)",
                "P(sum) <- P(sum)",
                "P(avg) <- P(avg)",
                "P(max) <- P(min)",
                "P(min) <- P(max)"
            ]
        );
        let t = table(&Op::Unary(UnaryOp::Exp), &[&[4]]);
        assert_eq!(t, ["S(0) <- S(0)", "P(max) <- P(max)", "P(min) <- P(min)"]);
        assert_eq!(table(&Op::Unary(UnaryOp::Gelu), &[&[4]]), ["S(0) <- S(0)"]);
        let t = table(
            &Op::Affine {
                mul: (-2.0).into(),
                add: 1.0.into(),
            },
            &[&[4]],
        );
        assert_eq!(
            t,
            [
                "S(0) <- S(0)",
                "P(avg) <- P(avg)",
                "P(max) <- P(min)",
                "P(min) <- P(max)"
            ]
        );
    }

    #[test]
    fn cmp_is_shard_only() {
        let t = table(&Op::Cmp(CmpOp::Lt), &[&[4, 2], &[4, 2]]);
        assert_eq!(t, ["S(0) <- S(0), S(0)", "S(1) <- S(1), S(1)"]);
        let m = TensorMeta::new(&[4], DType::F32);
        assert_eq!(
            Op::Cmp(CmpOp::Lt).output_metas(&[&m, &m]).unwrap()[0].dtype,
            DType::U8
        );
    }
}
