//! index_select / gather along `dim`.
//!
//! Non-indexed dims pass sharding through; sharding the index tensor shards the output. On the
//! indexed dim of the source three plans compete by cost:
//! (a) the all-Replicate row: the expander all_gathers the source (`S(dim) -> R`);
//! (b) `[MP(dim, size), S(dim), R]`: each rank selects the rows it owns, the output is a masked
//!     partial sum (priced by the expander with the all_reduce that will materialize it);
//! (c) `[R, S(dim), R]` with an internal `rma_get` of the selected rows from their owners.
//! (c) wins when few rows of a big table are selected, (a) when (nearly) all are.

use super::{check_dim, expect_int, meta, s, R};
use crate::cost::CollectiveKind;
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::Placement;
use crate::spec::{shape_str, TensorMeta};
use crate::strategy::{StrategyRow, TensorRef};

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let (src, idx) = (inputs[0], inputs[1]);
    expect_int(op, "index", idx)?;
    match op {
        Op::IndexSelect { dim } => {
            check_dim(op, *dim, src.ndim())?;
            if idx.ndim() != 1 {
                return Err(StrategyError::shape(
                    op,
                    format!("ids must be 1-d, got {}", shape_str(&idx.shape)),
                ));
            }
            let mut out = src.shape.clone();
            out[*dim] = idx.shape[0];
            Ok(vec![meta(&out, src.dtype)])
        }
        Op::Gather { dim } => {
            check_dim(op, *dim, src.ndim())?;
            if idx.ndim() != src.ndim()
                || idx
                    .shape
                    .iter()
                    .zip(&src.shape)
                    .enumerate()
                    .any(|(d, (i, s))| d != *dim && i > s)
            {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "index {} must have the rank of src {} and no larger non-gather dims",
                        shape_str(&idx.shape),
                        shape_str(&src.shape)
                    ),
                ));
            }
            Ok(vec![meta(&idx.shape, src.dtype)])
        }
        _ => Err(StrategyError::arg(op, "not an index op")),
    }
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let (src, idx) = (inputs[0], inputs[1]);
    let out = &outs[0];
    let dim = match op {
        Op::IndexSelect { dim } | Op::Gather { dim } => *dim,
        _ => return Vec::new(),
    };
    let mut rows = Vec::new();
    match op {
        Op::IndexSelect { .. } => {
            for d in (0..src.ndim()).filter(|&d| d != dim) {
                rows.push(StrategyRow::new(&[s(d)], &[s(d), R]));
            }
            rows.push(StrategyRow::new(&[s(dim)], &[R, s(0)]));
        }
        _ => {
            // Off the gather dim, `out[.., j, ..]` reads `src[.., j, ..]`: the source must be
            // sharded like the index there (a replicated source would be read at local
            // positions), which needs equal sizes.
            for d in (0..src.ndim()).filter(|&d| d != dim && src.shape[d] == idx.shape[d]) {
                rows.push(StrategyRow::new(&[s(d)], &[s(d), s(d)]));
            }
            // On the gather dim the index rows are independent lookups into the whole source.
            rows.push(StrategyRow::new(&[s(dim)], &[R, s(dim)]));
        }
    }
    let size = src.shape[dim];
    rows.push(StrategyRow::new(&[Placement::MaskPartial { dim, size }], &[s(dim), R]).no_strided());
    // The runtime fetches from the owners along this row's mesh dim only: no other mesh dim
    // may cut the indexed dim (nested `rma_get`, or `rma_get` next to a masked select, have no
    // executor).
    rows.push(
        StrategyRow::new(&[R], &[s(dim), R])
            .with_internal(CollectiveKind::RmaGet, out.bytes(), TensorRef::Output(0))
            .sole(TensorRef::Input(0), dim)
            .no_strided(),
    );
    rows
}

#[cfg(test)]
mod tests {
    use crate::{single_dim_strategies, DType, Op, TensorMeta};

    #[test]
    fn index_select_rows() {
        let src = TensorMeta::new(&[100, 8], DType::F32);
        let ids = TensorMeta::new(&[10], DType::U32);
        let t: Vec<String> = single_dim_strategies(&Op::IndexSelect { dim: 0 }, &[&src, &ids])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            t,
            [
                "S(1) <- S(1), R",
                "S(0) <- R, S(0)",
                "MP(0,100) <- S(0), R",
                "R <- S(0), R [+rma_get 320 B]"
            ]
        );
    }

    #[test]
    fn gather_rows() {
        // A sharded index off the gather dim needs the source sharded alike: `R, S(1)` would
        // read source column j_local instead of j.
        let src = TensorMeta::new(&[6, 4], DType::F32);
        let idx = TensorMeta::new(&[3, 4], DType::U32);
        let t: Vec<String> = single_dim_strategies(&Op::Gather { dim: 0 }, &[&src, &idx])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            t,
            [
                "S(1) <- S(1), S(1)",
                "S(0) <- R, S(0)",
                "MP(0,6) <- S(0), R",
                "R <- S(0), R [+rma_get 48 B]"
            ]
        );
    }
}
