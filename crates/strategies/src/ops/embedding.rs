//! embedding: inputs `ids [..]` (integer), `weight [V, D]` -> `[.., D]`.
//!
//! Rows `[out, ids, weight]`: batch `[S(i), S(i), R]` for each ids dim; column-parallel
//! `[S(last), R, S(1)]`; vocab-parallel `[MP(0,V), R, S(0)]` — each rank looks up only the ids it
//! owns (others give zero rows) and the output is a masked partial sum.

use super::{expect_int, meta, s, R};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::Placement;
use crate::spec::{shape_str, TensorMeta};
use crate::strategy::StrategyRow;

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let (ids, w) = (inputs[0], inputs[1]);
    expect_int(op, "ids", ids)?;
    if w.ndim() != 2 {
        return Err(StrategyError::shape(
            op,
            format!("weight must be [V, D], got {}", shape_str(&w.shape)),
        ));
    }
    let mut out = ids.shape.clone();
    out.push(w.shape[1]);
    Ok(vec![meta(&out, w.dtype)])
}

pub(super) fn rows(_op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let (ids, w) = (inputs[0], inputs[1]);
    let nd = ids.ndim();
    let mut rows: Vec<StrategyRow> = (0..nd)
        .map(|i| StrategyRow::new(&[s(i)], &[s(i), R]))
        .collect();
    rows.push(StrategyRow::new(&[s(nd)], &[R, s(1)]));
    rows.push(
        StrategyRow::new(
            &[Placement::MaskPartial {
                dim: 0,
                size: w.shape[0],
            }],
            &[R, s(0)],
        )
        .no_strided(),
    );
    rows
}

#[cfg(test)]
mod tests {
    use crate::{single_dim_strategies, DType, Op, TensorMeta};

    #[test]
    fn embedding_table() {
        let ids = TensorMeta::new(&[4, 16], DType::U32);
        let w = TensorMeta::new(&[512, 64], DType::F32);
        let t: Vec<String> = single_dim_strategies(&Op::Embedding, &[&ids, &w])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            t,
            [
                "S(0) <- S(0), R",
                "S(1) <- S(1), R",
                "S(2) <- R, S(1)",
                "MP(0,512) <- R, S(0)"
            ]
        );
        assert!(Op::Embedding.output_metas(&[&w, &w]).is_err());
    }
}
