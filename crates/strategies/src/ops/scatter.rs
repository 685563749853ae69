//! Writes at indices: `scatter_add(x, index, src, dim)` and `index_put(x, indices, values,
//! dim)` (`index_add` when accumulating). Inputs `[x, index, src/values]`.
//!
//! Rows, one justification each:
//! * another dim `d` sharded alike on `x` and the updates (sizes equal there): every line along
//!   `dim` is updated on its own (`scatter_add`'s index is sharded too; `index_put`'s 1-d
//!   indices stay `R`).
//! * `x` sharded on `dim`, updates `R`: each rank applies the updates whose index it owns (the
//!   others are masked out): `[S(dim), S(dim), R, R]`. The token-routing combine of a mixture
//!   of experts, with the output sharded over tokens.
//! * the updates sharded on their update dim (float, and for `index_put` only when
//!   accumulating): each rank adds its share of the updates into a `P(sum)` summand of `x`
//!   (a replicated `x` is partitioned locally, `x/n`, so it is counted once):
//!   `[P(sum), P(sum), S(dim), S(dim)]`.
//! * linearity (float): `out` is linear in `(x, updates)` jointly (a write zeroes the written
//!   rows of `x`, the same rows on every rank): `P(sum)` and `P(avg)` on both pass through.

use smallvec::SmallVec;

use super::{check_dim, expect_int, expect_same_dtype, s, PAVG, PSUM, R};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::Placement;
use crate::spec::{shape_str, TensorMeta};
use crate::strategy::StrategyRow;

fn dim_of(op: &Op) -> Result<usize> {
    match op {
        Op::ScatterAdd { dim } | Op::IndexPut { dim, .. } => Ok(*dim),
        _ => Err(StrategyError::arg(op, "not a scatter op")),
    }
}

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let (x, idx, upd) = (inputs[0], inputs[1], inputs[2]);
    let dim = dim_of(op)?;
    check_dim(op, dim, x.ndim())?;
    expect_int(op, "index", idx)?;
    expect_same_dtype(op, x, upd)?;
    let bad = |what: String| {
        Err(StrategyError::shape(
            op,
            format!(
                "{what}: x {}, index {}, {} {}",
                shape_str(&x.shape),
                shape_str(&idx.shape),
                if matches!(op, Op::ScatterAdd { .. }) {
                    "src"
                } else {
                    "values"
                },
                shape_str(&upd.shape)
            ),
        ))
    };
    if upd.ndim() != x.ndim() || (0..x.ndim()).any(|d| d != dim && upd.shape[d] != x.shape[d]) {
        return bad(format!("the updates must have x's shape off dim {dim}"));
    }
    match op {
        Op::ScatterAdd { .. } if idx.shape != upd.shape => {
            bad("index and src must have the same shape".into())
        }
        Op::IndexPut { .. } if idx.ndim() != 1 || idx.shape[0] != upd.shape[dim] => bad(format!(
            "indices must be 1-d with one entry per row of the values along dim {dim}"
        )),
        _ => Ok(vec![x.clone()]),
    }
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let Ok(dim) = dim_of(op) else {
        return Vec::new();
    };
    let x = inputs[0];
    let scatter = matches!(op, Op::ScatterAdd { .. });
    let mut rows = Vec::new();
    for d in (0..x.ndim()).filter(|&d| d != dim) {
        let idx = if scatter { s(d) } else { R };
        rows.push(StrategyRow::new(&[s(d)], &[s(d), idx, s(d)]));
    }
    rows.push(StrategyRow::new(&[s(dim)], &[s(dim), R, R]).no_strided());
    if x.dtype.is_float() {
        let accumulate = scatter
            || matches!(
                op,
                Op::IndexPut {
                    accumulate: true,
                    ..
                }
            );
        if accumulate {
            let idx = if scatter { s(dim) } else { s(0) };
            rows.push(StrategyRow::new(&[PSUM], &[PSUM, idx, s(dim)]));
        }
        for o in [PSUM, PAVG] {
            let ins: SmallVec<[Placement; 4]> = smallvec::smallvec![o, R, o];
            rows.push(StrategyRow::new(&[o], &ins));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use crate::ops::table_of as table;
    use crate::{DType, Op, TensorMeta};

    #[test]
    fn scatter_rows() {
        let f = |s: &[usize]| TensorMeta::new(s, DType::F32);
        let i = |s: &[usize]| TensorMeta::new(s, DType::I64);
        assert_eq!(
            table(
                &Op::ScatterAdd { dim: 0 },
                &[f(&[6, 4]), i(&[3, 4]), f(&[3, 4])]
            ),
            [
                "S(1) <- S(1), S(1), S(1)",
                "S(0) <- S(0), R, R",
                "P(sum) <- P(sum), S(0), S(0)",
                "P(sum) <- P(sum), R, P(sum)",
                "P(avg) <- P(avg), R, P(avg)"
            ]
        );
        let put = Op::IndexPut {
            dim: 1,
            accumulate: false,
        };
        assert_eq!(
            table(&put, &[f(&[4, 6]), i(&[2]), f(&[4, 2])]),
            [
                "S(0) <- S(0), R, S(0)",
                "S(1) <- S(1), R, R",
                "P(sum) <- P(sum), R, P(sum)",
                "P(avg) <- P(avg), R, P(avg)"
            ]
        );
        let e = put
            .output_metas(&[&f(&[4, 6]), &i(&[3]), &f(&[4, 2])])
            .unwrap_err();
        assert!(
            e.to_string().starts_with("index_put: indices must be 1-d"),
            "{e}"
        );
    }
}
