//! Gradient ownership (`with_managed_grad_dims`) follows its contract through views and
//! redistributions: a tensor whose owner reduces its gradient on a mesh dim never gets a
//! gradient all_reduce there from dispatch, however it reaches the op.
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor::comm::LocalWorld;
use candle_dtensor::dtensor::debug::{CommDebugMode, Phase};
use candle_dtensor::dtensor::{DTensor, Placement};
use candle_dtensor::mesh::DeviceMesh;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Backward all_reduces over `dp` when a (dp-Replicate, tp-Shard(0)) weight, made Replicate on
/// tp by `redistribute` (and viewed), multiplies a batch sharded on dp.
fn backward_dp_all_reduces(managed: bool) -> Vec<usize> {
    LocalWorld::new(4)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm| -> R<usize> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2), ("tp", 2)])?;
            let w_local = Var::from_tensor(&Tensor::ones((2, 3), DType::F32, &Device::Cpu)?)?;
            let w = DTensor::from_local_with_shape(
                w_local.as_tensor(),
                &mesh,
                &[Placement::Replicate, Placement::Shard(0)],
                &[4, 3],
            )?;
            let w = if managed {
                w.with_managed_grad_dims(&[0])
            } else {
                w
            };
            let x = DTensor::from_local_with_shape(
                &Tensor::ones((3, 4), DType::F32, &Device::Cpu)?,
                &mesh,
                &[Placement::Shard(0), Placement::Replicate],
                &[6, 4],
            )?;
            let w_full = w.redistribute(&[Placement::Replicate, Placement::Replicate])?;
            assert_eq!(w_full.managed_grad_dims().is_empty(), !managed);
            let y = x.matmul(&w_full.reshape(&[4, 3])?)?;
            let loss = y.sum_all()?;
            let mode = CommDebugMode::start();
            loss.backward()?;
            Ok(mode
                .records()
                .iter()
                .filter(|r| {
                    r.phase == Phase::Backward && r.kind == "all_reduce" && r.mesh_dim == "dp"
                })
                .count())
        })
        .unwrap()
}

#[test]
fn ownership_survives_redistribute_and_views() {
    // Without an owner, dispatch all-reduces the weight's gradient over dp.
    assert!(backward_dp_all_reduces(false).iter().all(|&n| n >= 1));
    // With one, nothing over dp: the owner reduces it.
    assert!(backward_dp_all_reduces(true).iter().all(|&n| n == 0));
}
