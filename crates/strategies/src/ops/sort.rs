//! topk along `dim` -> values and indices (`u32`, positions along `dim`).
//!
//! Rows `[values, indices, x]`: any other dim sharded alike on both outputs (each row of `dim`
//! is selected on its own). `dim` itself must be whole (`R`): the k largest of a shard are not
//! the k largest of the tensor, and indices are positions in the whole dim. No Partial rows:
//! the top k of summands are not the summands of the top k.

use super::{check_dim, meta, s};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::spec::{shape_str, DType, TensorMeta};
use crate::strategy::StrategyRow;

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    let Op::TopK { k, dim, .. } = op else {
        return Err(StrategyError::arg(op, "not a sort op"));
    };
    check_dim(op, *dim, x.ndim())?;
    if *k > x.shape[*dim] {
        return Err(StrategyError::arg(
            op,
            format!(
                "k = {k} but dim {dim} of {} has only {} entries",
                shape_str(&x.shape),
                x.shape[*dim]
            ),
        ));
    }
    let mut out = x.shape.clone();
    out[*dim] = *k;
    Ok(vec![meta(&out, x.dtype), meta(&out, DType::U32)])
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let Op::TopK { dim, .. } = op else {
        return Vec::new();
    };
    (0..inputs[0].ndim())
        .filter(|d| d != dim)
        .map(|d| StrategyRow::new(&[s(d), s(d)], &[s(d)]))
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::{single_dim_strategies, DType, Op, TensorMeta};

    #[test]
    fn topk_keeps_other_dims_sharded() {
        let x = TensorMeta::new(&[4, 9, 3], DType::F32);
        let op = Op::TopK {
            k: 2,
            dim: 1,
            largest: true,
        };
        let t: Vec<String> = single_dim_strategies(&op, &[&x])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(t, ["S(0),S(0) <- S(0)", "S(2),S(2) <- S(2)"]);
        let outs = op.output_metas(&[&x]).unwrap();
        assert_eq!(
            (outs[0].shape.as_slice(), outs[1].dtype),
            (&[4, 2, 3][..], DType::U32)
        );
        let too_many = Op::TopK {
            k: 10,
            dim: 1,
            largest: false,
        };
        assert!(too_many
            .output_metas(&[&x])
            .unwrap_err()
            .to_string()
            .contains("k = 10"));
    }
}
