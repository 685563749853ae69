//! cross_entropy: `logits [N, C]`, `targets [N]` (integer) -> scalar mean loss, in the logits'
//! dtype, or f32 for half-precision (bf16, f16) logits (autocast's: the loss computed in f32).
//!
//! Rows `[out, logits, targets]`:
//! * batch: `[P(sum), S(0), S(0)]`: each rank sums its rows' losses and divides by the GLOBAL N
//!   (the mean is a sum over the global count), so uneven and empty batch shards move no logits.
//! * loss-parallel (class dim sharded, `torch.distributed.tensor.parallel.loss_parallel`):
//!   `[R, S(1), R]`; the local op runs three all_reduces of N values itself (max, sum of exps,
//!   target logit via a masked partial), reported as `internal` comms.

use super::{expect_int, meta, s, PSUM, R};
use crate::cost::CollectiveKind;
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::spec::{shape_str, DType, TensorMeta};
use crate::strategy::{StrategyRow, TensorRef};

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let (logits, targets) = (inputs[0], inputs[1]);
    expect_int(op, "targets", targets)?;
    if logits.ndim() != 2 || !logits.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("logits must be float [N, C], got {}", logits),
        ));
    }
    if targets.shape.as_slice() != [logits.shape[0]] {
        return Err(StrategyError::shape(
            op,
            format!(
                "targets must be [{}], got {}",
                logits.shape[0],
                shape_str(&targets.shape)
            ),
        ));
    }
    let out = match logits.dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    };
    Ok(vec![meta(&[], out)])
}

pub(super) fn rows(_op: &Op, inputs: &[&TensorMeta], _outs: &[TensorMeta]) -> Vec<StrategyRow> {
    let logits = inputs[0];
    let n_bytes = (logits.shape[0] * logits.dtype.size_in_bytes()) as u64;
    let mut lp = StrategyRow::new(&[R], &[s(1), R]).no_strided();
    for _ in 0..3 {
        lp = lp.with_internal(CollectiveKind::AllReduce, n_bytes, TensorRef::Input(0));
    }
    vec![StrategyRow::new(&[PSUM], &[s(0), s(0)]), lp]
}

#[cfg(test)]
mod tests {
    use crate::{single_dim_strategies, DType, Op, TensorMeta};

    #[test]
    fn loss_rows() {
        let l = TensorMeta::new(&[4, 16], DType::F32);
        let t = TensorMeta::new(&[4], DType::I64);
        let rows = single_dim_strategies(&Op::CrossEntropy, &[&l, &t]).unwrap();
        assert_eq!(rows[0].to_string(), "P(sum) <- S(0), S(0)");
        assert_eq!(rows[1].internal.len(), 3);
        assert_eq!(rows[1].internal[0].bytes, 16);
    }
}
