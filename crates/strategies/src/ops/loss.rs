//! cross_entropy: `logits [.., C]`, `targets [..]` (integer, the logits' leading dims) -> scalar
//! mean loss over every row, in the logits' dtype, or f32 for half-precision (bf16, f16) logits
//! (autocast's: the loss computed in f32). `[N, C]` is the common case; a language model's
//! `[B, T, V]` logits need no flattening reshape (whose backward would add a gradient of the
//! logits' size).
//!
//! Rows `[out, logits, targets]`:
//! * rows: `[P(sum), S(d), S(d)]` for each leading dim `d`: each rank sums its rows' losses
//!   and divides by the GLOBAL row count (the mean is a sum over it), so uneven and empty
//!   shards move no logits, and a batch and a sequence sharded by different mesh dims need no
//!   merge;
//! * loss-parallel (class dim sharded, `torch.distributed.tensor.parallel.loss_parallel`):
//!   `[R, S(last), R]`; the local op runs three all_reduces of one value a row itself (max,
//!   sum of exps, target logit via a masked partial), reported as `internal` comms.

use super::{expect_int, meta, s, PSUM, R};
use crate::cost::CollectiveKind;
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::spec::{shape_str, DType, TensorMeta};
use crate::strategy::{StrategyRow, TensorRef};

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let (logits, targets) = (inputs[0], inputs[1]);
    expect_int(op, "targets", targets)?;
    let nd = logits.ndim();
    if nd == 0 || !logits.dtype.is_float() {
        return Err(StrategyError::shape(
            op,
            format!("logits must be float [.., C], got {}", logits),
        ));
    }
    if targets.shape.as_slice() != &logits.shape[..nd - 1] {
        return Err(StrategyError::shape(
            op,
            format!(
                "targets must be the logits' leading dims {}, got {}",
                shape_str(&logits.shape[..nd - 1]),
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
    let classes = logits.ndim() - 1;
    let n_rows: usize = logits.shape[..classes].iter().product();
    // Half-precision logits are reduced in f32 (the loss is computed in f32).
    let reduced = match logits.dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    };
    let n_bytes = (n_rows * reduced.size_in_bytes()) as u64;
    let mut rows: Vec<StrategyRow> = (0..classes)
        .map(|d| StrategyRow::new(&[PSUM], &[s(d), s(d)]))
        .collect();
    let mut lp = StrategyRow::new(&[R], &[s(classes), R]).no_strided();
    for _ in 0..3 {
        lp = lp.with_internal(CollectiveKind::AllReduce, n_bytes, TensorRef::Input(0));
    }
    rows.push(lp);
    rows
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
        // [B, T, V] logits: a row for each leading dim; the internal all_reduces carry one
        // value a row, in f32 for bf16 logits (6 rows: 24 bytes).
        let l = TensorMeta::new(&[2, 3, 16], DType::BF16);
        let t = TensorMeta::new(&[2, 3], DType::U32);
        let rows = single_dim_strategies(&Op::CrossEntropy, &[&l, &t]).unwrap();
        let shown: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            shown,
            [
                "P(sum) <- S(0), S(0)",
                "P(sum) <- S(1), S(1)",
                "R <- S(2), R [+all_reduce 24 B] [+all_reduce 24 B] [+all_reduce 24 B]"
            ]
        );
        // A single row of logits [C] against a scalar target.
        let l = TensorMeta::new(&[16], DType::F32);
        let t = TensorMeta::new(&[], DType::I64);
        let rows = single_dim_strategies(&Op::CrossEntropy, &[&l, &t]).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].internal[0].bytes, 4);
        // Targets that are not the leading dims, and scalar logits, are refused by name.
        let t = TensorMeta::new(&[2], DType::I64);
        let l3 = TensorMeta::new(&[2, 3, 16], DType::F32);
        let e = single_dim_strategies(&Op::CrossEntropy, &[&l3, &t]).unwrap_err();
        assert!(e.to_string().contains("leading dims [2, 3]"), "{e}");
        let l0 = TensorMeta::new(&[], DType::F32);
        let t0 = TensorMeta::new(&[], DType::I64);
        let e = single_dim_strategies(&Op::CrossEntropy, &[&l0, &t0]).unwrap_err();
        assert!(e.to_string().contains("[.., C]"), "{e}");
    }
}
