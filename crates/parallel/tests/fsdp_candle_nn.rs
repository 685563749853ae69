//! FSDP on an unmodified candle-nn MLP built through a VarBuilder, against the same MLP
//! trained on one device; and FSDP really releases unsharded storage between uses.
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::{distribute_tensor, Placement};
use candle_dtensor_kernels::compare::compare_series_f32;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{Gpt, GptConfig};
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::fsdp_vb::{initial_value, FsdpVarMap};
use candle_dtensor_parallel::TpPlan;
use candle_nn::{Optimizer, VarBuilder, VarMap};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEED: u64 = 11;
const STEPS: usize = 6;

fn data() -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..8 * 4)
        .map(|i| ((i * 37 % 17) as f32 / 8.0) - 1.0)
        .collect();
    let y: Vec<f32> = (0..8 * 3)
        .map(|i| ((i * 13 % 7) as f32 / 3.0) - 1.0)
        .collect();
    (
        Tensor::from_vec(x, (8, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (8, 3), &Device::Cpu).unwrap(),
    )
}

/// The MLP, written once as plain candle-nn code.
fn mlp(
    vb: VarBuilder,
) -> candle_core::Result<(candle_nn::Linear, candle_nn::Linear, candle_nn::Linear)> {
    Ok((
        candle_nn::linear(4, 16, vb.pp("l1"))?,
        candle_nn::linear(16, 16, vb.pp("l2"))?,
        candle_nn::linear(16, 3, vb.pp("l3"))?,
    ))
}

fn single_device() -> (Vec<f32>, Vec<Vec<f32>>) {
    // A plain VarMap holding the same initial values the FSDP backend creates.
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let (l1, l2, l3) = mlp(vb).unwrap();
    {
        let data = map.data().lock().unwrap();
        for (name, var) in data.iter() {
            // candle-nn's linear: Kaiming-normal weights, uniform(+-1/sqrt(fan_in)) biases.
            let init = if name.ends_with("weight") {
                candle_nn::init::DEFAULT_KAIMING_NORMAL
            } else {
                let fan_in = if name.starts_with("l1") { 4.0 } else { 16.0 };
                let bound = 1.0 / f64::sqrt(fan_in);
                candle_nn::Init::Uniform {
                    lo: -bound,
                    up: bound,
                }
            };
            var.set(&initial_value(init, SEED, name, var.shape(), DType::F32).unwrap())
                .unwrap();
        }
    }
    let mut opt = candle_nn::SGD::new(map.all_vars(), 0.1).unwrap();
    let (x, y) = data();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let h = l1.forward(&x).unwrap().relu().unwrap();
        let h = l2.forward(&h).unwrap().relu().unwrap();
        let out = l3.forward(&h).unwrap();
        let loss = candle_nn::loss::mse(&out, &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    let w = l1.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (losses, vec![w])
}

#[test]
fn candle_nn_mlp_under_fsdp_matches_one_device() {
    let (ref_losses, ref_params) = single_device();
    for world in [2usize, 4] {
        let out = LocalWorld::new(world)
            .with_timeout(Duration::from_secs(20))
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &[("dp", world)])?;
                // Each rank's loss is its local mean.
                let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
                let map = FsdpVarMap::new(&fsdp, SEED);
                let (l1, l2, l3) = mlp(map.var_builder(DType::F32))?;
                let (l1, l2, l3) = (
                    map.wrap("l1", l1)?,
                    map.wrap("l2", l2)?,
                    map.wrap("l3", l3)?,
                );
                let mut opt = candle_nn::SGD::new(map.all_vars(), 0.1)?;
                let (x, y) = data();
                // This rank's rows of the batch.
                let x = distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?
                    .to_local()
                    .clone();
                let y = distribute_tensor(&y, &mesh, &[Placement::Shard(0)])?
                    .to_local()
                    .clone();
                let mut losses = Vec::new();
                for _ in 0..STEPS {
                    let h = l1.forward(&x)?.relu()?;
                    let h = l2.forward(&h)?.relu()?;
                    let out = l3.forward(&h)?;
                    // Unsharded storage of the first units is released after their forward.
                    assert_eq!(fsdp.unit_allocated_bytes(l1.unit()), 0);
                    let loss = candle_nn::loss::mse(&out, &y)?;
                    let global = mesh
                        .root_comm()
                        .all_reduce(&loss.reshape(1)?, candle_dtensor_comm::ReduceOp::Avg)?
                        .wait()?;
                    losses.push(global.to_vec1::<f32>()?[0]);
                    let mut grads = loss.backward()?;
                    fsdp.finish_backward(&mut grads)?;
                    opt.step(&grads)?;
                    // After backward every unit is released again.
                    for u in [l1.unit(), l2.unit(), l3.unit()] {
                        assert_eq!(
                            fsdp.unit_allocated_bytes(u),
                            0,
                            "unit {u} still holds storage"
                        );
                    }
                }
                // Reassemble l1.weight from its shards.
                let shard = map.var("l1.weight").unwrap();
                let full = mesh.root_comm().gather(&shard.flatten_all()?, 0)?.wait()?;
                let w = match full {
                    Some(parts) => Some(Tensor::cat(&parts, 0)?.to_vec1::<f32>()?),
                    None => None,
                };
                Ok((losses, w))
            })
            .unwrap();
        let (losses, w) = &out[0];
        // Same step count and every loss finite (a zip would compare the shorter prefix).
        if let Err(e) = compare_series_f32("loss", losses, &ref_losses) {
            panic!("world {world}: {e}");
        }
        for (a, b) in losses.iter().zip(&ref_losses) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "world {world}: {losses:?} vs {ref_losses:?}"
            );
        }
        let w = w.as_ref().unwrap();
        if let Err(e) = compare_series_f32("l1.weight", w, &ref_params[0]) {
            panic!("world {world}: {e}");
        }
        for (a, b) in w.iter().zip(&ref_params[0]) {
            assert!(
                (a - b).abs() <= 1e-5,
                "world {world}: l1.weight differs: {a} vs {b}"
            );
        }
    }
}

#[test]
fn released_parameters_give_a_typed_error_not_a_panic() {
    let out = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
            let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Sum))?;
            let cfg = GptConfig {
                vocab: 32,
                d_model: 16,
                n_heads: 2,
                n_layers: 1,
                seq_len: 8,
                ..GptConfig::tiny()
            };
            let (gpt, _) = Gpt::build(&cfg, &mesh, &TpPlan::new(), 1, DType::F32, Some(&fsdp))?;
            // Outside the unit's forward the block's weights hold no storage.
            let w = &gpt.blocks[0].mlp.dense().unwrap().fc1.weight;
            let x = distribute_tensor(
                &Tensor::ones((2, 16), DType::F32, &Device::Cpu)?,
                &mesh,
                &[Placement::Replicate],
            )?;
            let err = x.linear(w, None).err().map(|e| e.to_string());
            Ok(err)
        })
        .unwrap();
    for e in out {
        let e = e.expect("using a released parameter must fail");
        assert!(
            e.contains("linear") && e.contains("released storage"),
            "{e}"
        );
    }
}
