//! softmax / log_softmax: shard any dim but the normalized one; and the normalized dim itself
//! without moving the data (loss-parallel style): each rank takes its local max and sum of
//! exponentials, and two small all_reduces (max, then sum) of the reduced shape give the global
//! ones (`[S(d), S(d)]` with two internal all_reduces; no other mesh dim may shard `d`, so one
//! axis reduces). layer_norm / rms_norm: shard leading dims; weight and bias replicated.
//! Weight/bias GRADIENTS come out `P(sum)`; that is the runtime's gradient rule, not a forward row.

use super::{check_dim, expect_same_dtype, s, R};
use crate::cost::CollectiveKind;
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::Placement;
use crate::spec::{shape_str, TensorMeta};
use crate::strategy::{StrategyRow, TensorRef};

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    if !x.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("needs a float input, got {}", x.dtype),
        ));
    }
    match op {
        Op::Softmax { dim } | Op::LogSoftmax { dim } => check_dim(op, *dim, x.ndim())?,
        _ => {
            if x.ndim() == 0 {
                return Err(StrategyError::shape(op, "needs at least a 1-d input"));
            }
            let last = x.shape[x.ndim() - 1];
            for (i, w) in inputs.iter().enumerate().skip(1) {
                expect_same_dtype(op, x, w)?;
                if w.shape.as_slice() != [last] {
                    return Err(StrategyError::shape(
                        op,
                        format!(
                            "input {i} must be [{last}] (the normalized dim of {}), got {}",
                            shape_str(&x.shape),
                            shape_str(&w.shape)
                        ),
                    ));
                }
            }
            if let Op::LayerNorm {
                affine: false,
                bias: true,
                ..
            } = op
            {
                return Err(StrategyError::arg(op, "bias requires affine"));
            }
        }
    }
    Ok(vec![x.clone()])
}

pub(super) fn rows(op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let nd = inputs[0].ndim();
    let n_in = inputs.len();
    let mut rows = Vec::new();
    match op {
        Op::Softmax { dim } | Op::LogSoftmax { dim } => {
            for d in (0..nd).filter(|d| d != dim) {
                rows.push(StrategyRow::new(&[s(d)], &[s(d)]));
            }
            let x = inputs[0];
            let reduced = x.numel() / x.shape[*dim].max(1);
            let bytes = (reduced * x.dtype.size_in_bytes()) as u64;
            rows.push(
                StrategyRow::new(&[s(*dim)], &[s(*dim)])
                    .with_internal(CollectiveKind::AllReduce, bytes, TensorRef::Input(0))
                    .with_internal(CollectiveKind::AllReduce, bytes, TensorRef::Input(0))
                    .sole(TensorRef::Input(0), *dim),
            );
        }
        _ => {
            for d in 0..nd.saturating_sub(1) {
                let mut ins: Vec<Placement> = vec![R; n_in];
                ins[0] = s(d);
                rows.push(StrategyRow::new(&[s(d)], &ins));
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use crate::op::Op;
    use crate::{single_dim_strategies, DType, TensorMeta};

    #[test]
    fn softmax_and_norms() {
        let x = TensorMeta::new(&[8, 12, 16], DType::F32);
        let t: Vec<String> = single_dim_strategies(&Op::Softmax { dim: 1 }, &[&x])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            t,
            [
                "S(0) <- S(0)",
                "S(2) <- S(2)",
                "S(1) <- S(1) [+all_reduce 512 B] [+all_reduce 512 B]"
            ]
        );
        let w = TensorMeta::new(&[16], DType::F32);
        let op = Op::LayerNorm {
            eps: 1e-5.into(),
            affine: true,
            bias: true,
        };
        let t: Vec<String> = single_dim_strategies(&op, &[&x, &w, &w])
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(t, ["S(0) <- S(0), R, R", "S(1) <- S(1), R, R"]);
        let bad = TensorMeta::new(&[12], DType::F32);
        assert!(Op::RmsNorm { eps: 1e-5.into() }
            .output_metas(&[&x, &bad])
            .is_err());
    }
}
