//! Plain candle-nn / candle-transformers code under FSDP, as a new user writes it: every misuse
//! of issue 12 either works as on one device or fails with a typed error, and nothing reads a
//! released parameter.
use std::borrow::Borrow;
use std::collections::HashMap;
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_dtensor_comm::{LocalWorld, ReduceOp};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::fsdp_vb::{reference_var_builder, FsdpVarMap, ROOT_UNIT};
use candle_dtensor_parallel::ParallelError;
use candle_nn::{ModuleT, Optimizer, VarBuilder, VarMap};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEED: u64 = 5;
const ROWS: usize = 8;

fn world(n: usize) -> LocalWorld {
    LocalWorld::new(n).with_timeout(Duration::from_secs(30))
}

/// Runs `f` on every rank of an `n`-rank data-parallel FSDP world (no wrap policy, gradients
/// averaged), each with its rank, mesh, FSDP and a fresh parameter map seeded with `SEED`; the
/// results in rank order.
fn on_fsdp_world<T: Send>(
    n: usize,
    f: impl Fn(usize, &DeviceMesh, &Fsdp, FsdpVarMap) -> R<T> + Send + Sync,
) -> Vec<T> {
    world(n)
        .launch(|comm| -> R<_> {
            let rank = comm.rank();
            let mesh = DeviceMesh::new(comm, &[("dp", n)])?;
            let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
            let map = FsdpVarMap::new(&fsdp, SEED);
            f(rank, &mesh, &fsdp, map)
        })
        .unwrap()
}

/// This rank's loss averaged over the world: the loss one device sees for the whole batch.
fn world_loss(mesh: &DeviceMesh, loss: &Tensor) -> R<f32> {
    let g = mesh
        .root_comm()
        .all_reduce(&loss.reshape(1)?, ReduceOp::Avg)?
        .wait()?;
    Ok(g.to_vec1::<f32>()?[0])
}

/// A batch of `ROWS` rows of `d` features and integer class targets, distinct values.
fn batch(step: usize, d: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..ROWS * d)
        .map(|i| (((i + 7 * step) * 37 % 23) as f32 / 11.0) - 1.0)
        .collect();
    let y: Vec<u32> = (0..ROWS).map(|i| ((i + step) % 3) as u32).collect();
    (
        Tensor::from_vec(x, (ROWS, d), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, ROWS, &Device::Cpu).unwrap(),
    )
}

/// This rank's rows of a batch (torch.chunk over the world).
fn my_rows(t: &Tensor, rank: usize, n: usize) -> Tensor {
    let per = ROWS / n;
    t.narrow(0, rank * per, per).unwrap()
}

/// The full value of every FSDP parameter (shards gathered in rank order), on rank 0.
fn full_values(map: &FsdpVarMap, mesh: &DeviceMesh) -> R<Option<HashMap<String, Vec<f32>>>> {
    let mut out = HashMap::new();
    for (name, shard) in map.named_vars() {
        let flat = shard.as_tensor().flatten_all()?;
        if let Some(parts) = mesh.root_comm().gather(&flat, 0)?.wait()? {
            out.insert(name, Tensor::cat(&parts, 0)?.to_vec1::<f32>()?);
        }
    }
    Ok((mesh.root_comm().rank() == 0).then_some(out))
}

/// The value of every parameter of a one-device map, flattened.
fn one_device_values(map: &VarMap) -> HashMap<String, Vec<f32>> {
    let data = map.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect()
}

/// The names of `vars` that `has_grad` accepts, sorted.
fn names_with_grad<K: Into<String>, V: Borrow<Var>>(
    vars: impl IntoIterator<Item = (K, V)>,
    has_grad: impl Fn(&Var) -> bool,
) -> Vec<String> {
    let mut names: Vec<String> = vars
        .into_iter()
        .filter(|(_, v)| has_grad(v.borrow()))
        .map(|(k, _)| k.into())
        .collect();
    names.sort();
    names
}

/// Whether `grads` holds a gradient for a parameter.
fn in_grads(grads: &GradStore) -> impl Fn(&Var) -> bool + '_ {
    |v| grads.get(v.as_tensor()).is_some()
}

fn assert_close(a: &[f32], b: &[f32], rel: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    // f32::max keeps an infinity, which would make every finite difference pass (a NaN in
    // `a` or `b` fails the comparison below).
    assert!(scale.is_finite(), "{what}: the reference is not finite");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= rel * scale,
            "{what}[{i}]: {x} vs one device {y}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Trigger 1: candle_nn::linear through the FSDP VarBuilder, forward without any wrap.

fn mlp(vb: VarBuilder) -> candle_core::Result<(candle_nn::Linear, candle_nn::Linear)> {
    Ok((
        candle_nn::linear(6, 10, vb.pp("l1"))?,
        candle_nn::linear(10, 3, vb.pp("l2"))?,
    ))
}

fn mlp_loss(
    l: &(candle_nn::Linear, candle_nn::Linear),
    x: &Tensor,
    y: &Tensor,
) -> candle_core::Result<Tensor> {
    let h = l.0.forward(x)?.relu()?;
    candle_nn::loss::cross_entropy(&l.1.forward(&h)?, y)
}

/// Losses and final parameters of the model `build` makes, trained with optimizer `O` (set up
/// by `config`) on one device for `steps` batches of 6 features.
fn train_one_device<M, O: Optimizer>(
    steps: usize,
    config: O::Config,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
    loss_of: impl Fn(&M, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let m = build(vb).unwrap();
    let mut opt = O::new(map.all_vars(), config).unwrap();
    let mut losses = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(step, 6);
        let loss = loss_of(&m, &x, &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    (losses, one_device_values(&map))
}

/// A world's losses and the parameters rank 0 gathered, within 1e-5 of one device's.
fn assert_trained_as_one_device(
    (losses, params): (&[f32], &Option<HashMap<String, Vec<f32>>>),
    (ref_losses, ref_params): (&[f32], &HashMap<String, Vec<f32>>),
    what: &str,
) {
    assert_close(losses, ref_losses, 1e-5, &format!("{what} losses"));
    for (name, want) in ref_params {
        let got = &params.as_ref().unwrap()[name];
        assert_close(got, want, 1e-5, &format!("{what} {name}"));
    }
}

#[test]
fn unwrapped_module_with_fsdp_optimizer_trains_as_on_one_device() {
    let (ref_losses, ref_params) = train_one_device::<_, candle_nn::SGD>(4, 0.2, mlp, mlp_loss);
    for n in [2usize, 4] {
        let out = on_fsdp_world(n, |rank, mesh, fsdp, map| {
            let l = mlp(map.var_builder(DType::F32))?;
            // No wrap anywhere: FSDP's optimizer gathers the parameters after each step.
            let mut opt = fsdp.optimizer(candle_nn::SGD::new(map.all_vars(), 0.2)?);
            let mut losses = Vec::new();
            for step in 0..4 {
                let (x, y) = batch(step, 6);
                let loss = mlp_loss(&l, &my_rows(&x, rank, n), &my_rows(&y, rank, n))?;
                losses.push(world_loss(mesh, &loss)?);
                opt.backward_step(&loss)?;
            }
            Ok((losses, full_values(&map, mesh)?))
        });
        let (losses, params) = &out[0];
        assert_trained_as_one_device(
            (losses, params),
            (&ref_losses, &ref_params),
            &format!("world {n}"),
        );
    }
}

#[test]
fn unwrapped_module_with_a_plain_optimizer_fails_typed_on_its_next_use() {
    let out = on_fsdp_world(2, |rank, _, fsdp, map| {
        let l = mlp(map.var_builder(DType::F32))?;
        let mut opt = candle_nn::SGD::new(map.all_vars(), 0.2)?;
        let (x, y) = batch(0, 6);
        let (x, y) = (my_rows(&x, rank, 2), my_rows(&y, rank, 2));
        // The first step works: the parameters hold their initial values.
        let loss = mlp_loss(&l, &x, &y)?;
        let grads = fsdp.backward(&loss)?;
        opt.step(&grads)?;
        // Backward released them; a plain optimizer does not gather them again, so the next
        // use is refused by candle (the storage seam's placeholder), not a read of freed
        // memory.
        let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            mlp_loss(&l, &x, &y).map(|_| ())
        }));
        Ok(match second {
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(())) => "succeeded".to_string(),
            Err(_) => "panicked".to_string(),
        })
    });
    for e in out {
        assert!(e.contains("F4") || e.contains("released"), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Trigger 2: one wrap key over an HF-style model with two top-level prefixes.

struct HfStyle {
    embed: candle_nn::Linear,
    layers: Vec<candle_nn::Linear>,
    lm_head: candle_nn::Linear,
}

impl HfStyle {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let m = vb.pp("model");
        Ok(HfStyle {
            embed: candle_nn::linear(6, 12, m.pp("embed"))?,
            layers: (0..3)
                .map(|i| candle_nn::linear(12, 12, m.pp(format!("layers.{i}"))))
                .collect::<candle_core::Result<_>>()?,
            lm_head: candle_nn::linear_no_bias(12, 3, vb.pp("lm_head"))?,
        })
    }

    fn layer(&self, i: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        (self.layers[i].forward(x)?.tanh()? + x)?.affine(0.5, 0.0)
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.embed.forward(x)?;
        for i in 0..self.layers.len() {
            h = self.layer(i, &h)?;
        }
        self.lm_head.forward(&h)
    }
}

/// How the FSDP run drives its units.
#[derive(Clone, Copy, Debug)]
enum Drive {
    /// `map.wrap("model", model)`: the whole model behind the key of one of its prefixes.
    OneKey,
    /// Units by pattern, the whole forward run as the root unit.
    PatternsRoot,
    /// Units by pattern, each layer wrapped by the user's own forward (ZeRO-3 release).
    PatternsPerLayer,
}

#[test]
fn hf_style_models_train_as_on_one_device_however_units_are_driven() {
    let (ref_losses, ref_params) = train_one_device::<_, candle_nn::AdamW>(
        3,
        candle_nn::ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
        HfStyle::new,
        |m, x, y| candle_nn::loss::cross_entropy(&m.forward(x)?, y),
    );
    for drive in [Drive::OneKey, Drive::PatternsRoot, Drive::PatternsPerLayer] {
        let out = on_fsdp_world(2, |rank, mesh, fsdp, map| {
            let map = match drive {
                Drive::OneKey => map,
                _ => map.with_units(&["model.layers.{i}"])?,
            };
            let m = HfStyle::new(map.var_builder(DType::F32))?;
            let units: Vec<String> = map.units().into_iter().map(|(k, _)| k).collect();
            let mut opt = candle_nn::AdamW::new_lr(map.all_vars(), 0.01)?;
            let mut losses = Vec::new();
            let mut released_between = true;
            for step in 0..3 {
                let (x, y) = batch(step, 6);
                let (x, y) = (my_rows(&x, rank, 2), my_rows(&y, rank, 2));
                let logits = match drive {
                    Drive::OneKey => map.forward("model", || m.forward(&x))?,
                    Drive::PatternsRoot => map.forward(ROOT_UNIT, || m.forward(&x))?,
                    Drive::PatternsPerLayer => map.forward(ROOT_UNIT, || {
                        let mut h = m.embed.forward(&x)?;
                        for i in 0..3 {
                            let key = format!("model.layers.{i}");
                            h = map.forward(&key, || m.layer(i, &h))?;
                            let u = fsdp.unit_index(&key).unwrap();
                            released_between &= fsdp.unit_allocated_bytes(u) == 0;
                        }
                        m.lm_head.forward(&h)
                    })?,
                };
                let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
                losses.push(world_loss(mesh, &loss)?);
                let grads = fsdp.backward(&loss)?;
                opt.step(&grads)?;
            }
            Ok((losses, full_values(&map, mesh)?, units, released_between))
        });
        let (losses, params, units, released) = &out[0];
        assert_trained_as_one_device(
            (losses, params),
            (&ref_losses, &ref_params),
            &format!("{drive:?}"),
        );
        match drive {
            Drive::OneKey => assert_eq!(units, &["model", "lm_head"]),
            _ => assert_eq!(
                units,
                &["root", "model.layers.0", "model.layers.1", "model.layers.2"]
            ),
        }
        if matches!(drive, Drive::PatternsPerLayer) {
            assert!(released, "wrapped layers are released after their forward");
        }
    }
}

#[test]
fn a_weight_shared_across_units_is_a_typed_error_naming_what_is_released() {
    let out = on_fsdp_world(2, |_, _, _, map| {
        let vb = map.var_builder(DType::F32);
        let a = candle_nn::linear(4, 4, vb.pp("a"))?;
        // "b" reuses a's weight (a tied head), but lives in another unit.
        let b = candle_nn::Linear::new(a.weight().clone(), None);
        let _b_unit = candle_nn::linear(4, 4, vb.pp("b"))?;
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
        let h = map.forward("a", || a.forward(&x))?; // releases a's weight after
        let err = map.forward("b", || b.forward(&h)).err();
        Ok(err.map(|e| match e {
            ParallelError::ReleasedParameter { unit, released, .. } => (unit, released),
            other => (format!("unexpected: {other}"), Vec::new()),
        }))
    });
    for e in out {
        let (unit, released) = e.expect("the shared weight is released");
        assert_eq!(unit, "b");
        assert!(released.contains(&"a.weight".to_string()), "{released:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Gradients as on one device: a parameter whose gradient candle-nn's fused rms_norm cuts.

struct Cut {
    inp: candle_nn::Linear,
    norm: candle_nn::RmsNorm,
    out: candle_nn::Linear,
}

impl Cut {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Cut {
            inp: candle_nn::linear(6, 8, vb.pp("inp"))?,
            norm: candle_nn::rms_norm(8, 1e-5, vb.pp("norm"))?,
            out: candle_nn::linear(8, 3, vb.pp("out"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // candle-nn's RmsNorm takes its fused, backward-less kernel on a contiguous input:
        // inp and norm get no gradient on one device.
        self.out.forward(&self.norm.forward(&self.inp.forward(x)?)?)
    }
}

#[test]
fn parameters_cut_from_the_graph_get_no_gradient_as_on_one_device() {
    // One device: which parameters have a gradient, and the values after AdamW with decay.
    let (ref_map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let m = Cut::new(vb).unwrap();
    let params = candle_nn::ParamsAdamW {
        lr: 0.05,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(ref_map.all_vars(), params.clone()).unwrap();
    let (x, y) = batch(0, 6);
    let loss = candle_nn::loss::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
    let grads = loss.backward().unwrap();
    let with_grad = names_with_grad(ref_map.data().lock().unwrap().iter(), in_grads(&grads));
    assert_eq!(
        with_grad,
        ["out.bias", "out.weight"],
        "candle-nn cuts the rest"
    );
    opt.step(&grads).unwrap();
    let ref_values = one_device_values(&ref_map);

    let out = on_fsdp_world(2, |rank, mesh, fsdp, map| {
        let map = map.with_units(&[])?;
        let m = Cut::new(map.var_builder(DType::F32))?;
        let mut opt = candle_nn::AdamW::new(map.all_vars(), params.clone())?;
        let logits = map.forward(ROOT_UNIT, || m.forward(&my_rows(&x, rank, 2)))?;
        let loss = candle_nn::loss::cross_entropy(&logits, &my_rows(&y, rank, 2))?;
        let grads = fsdp.backward(&loss)?;
        let have = names_with_grad(map.named_vars(), in_grads(&grads));
        let mut without = fsdp.params_without_grad();
        without.sort();
        opt.step(&grads)?;
        Ok((have, without, full_values(&map, mesh)?))
    });
    for (rank, (have, without, _)) in out.iter().enumerate() {
        // Shards of out.bias (3 rows over 2 ranks) are uneven but both non-empty.
        assert_eq!(have, &["out.bias", "out.weight"], "rank {rank}");
        assert_eq!(
            without,
            &["inp.bias", "inp.weight", "norm.weight"],
            "rank {rank}"
        );
    }
    // Weight decay left the cut parameters alone, as on one device.
    let values = out[0].2.as_ref().unwrap();
    for (name, want) in &ref_values {
        assert_close(&values[name], want, 1e-5, name);
    }
}

// ---------------------------------------------------------------------------------------------
// Build-time reads, forgotten reductions.

#[test]
fn modules_that_read_parameters_while_built_see_their_initial_values() {
    let out = on_fsdp_world(2, |_, _, _, map| {
        // batch_norm copies its running statistics into Vars of its own at build time.
        let bn = candle_nn::batch_norm(5, 1e-5, map.var_builder(DType::F32).pp("bn"))?;
        let mean = bn.running_mean().to_vec1::<f32>()?;
        let var = bn.running_var().to_vec1::<f32>()?;
        let x = Tensor::ones((3, 5), DType::F32, &Device::Cpu)?;
        let y = map.forward("bn", || bn.forward_t(&x, false))?;
        Ok((mean, var, y.to_vec2::<f32>()?))
    });
    for (mean, var, y) in out {
        assert_eq!(mean, vec![0.0; 5]);
        assert_eq!(var, vec![1.0; 5]);
        for row in y {
            for v in row {
                assert!((v - 1.0).abs() < 1e-4, "{v}");
            }
        }
    }
}

#[test]
fn llama2_c_built_as_candle_s_training_example_builds_it_trains_as_on_one_device() {
    use candle_transformers::models::llama2_c::{Cache, Config, Llama};
    let cfg = Config {
        dim: 16,
        hidden_dim: 24,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 2,
        vocab_size: 11,
        seq_len: 6,
        norm_eps: 1e-5,
    };
    let ids = |step: usize| -> (Tensor, Tensor) {
        let v: Vec<u32> = (0..4 * 7)
            .map(|i| ((i * 5 + step * 3) % 11) as u32)
            .collect();
        let t = Tensor::from_vec(v, (4, 7), &Device::Cpu).unwrap();
        (t.narrow(1, 0, 6).unwrap(), t.narrow(1, 1, 6).unwrap())
    };
    let loss_of = |logits: &Tensor, y: &Tensor| -> candle_core::Result<Tensor> {
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &y.flatten_all()?)
    };
    // One device, as candle's llama2-c training example: the cache reads `rot.*` at build.
    let (ref_map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let mut cache = Cache::new(false, &cfg, vb.pp("rot")).unwrap();
    let model = Llama::load(vb, cfg.clone()).unwrap();
    let mut opt = candle_nn::SGD::new(ref_map.all_vars(), 0.5).unwrap();
    let mut ref_losses = Vec::new();
    let mut ref_with_grad = Vec::new();
    for step in 0..3 {
        let (x, y) = ids(step);
        let loss = loss_of(&model.forward(&x, 0, &mut cache).unwrap(), &y).unwrap();
        ref_losses.push(loss.to_scalar::<f32>().unwrap());
        let grads = loss.backward().unwrap();
        if step == 0 {
            ref_with_grad =
                names_with_grad(ref_map.data().lock().unwrap().iter(), in_grads(&grads));
        }
        opt.step(&grads).unwrap();
    }
    let out = on_fsdp_world(2, |rank, mesh, fsdp, map| {
        let map = map.with_units(&["model.layers.{i}"])?;
        let vb = map.var_builder(DType::F32);
        let mut cache = Cache::new(false, &cfg, vb.pp("rot"))?;
        let model = Llama::load(vb, cfg.clone())?;
        let mut opt = candle_nn::SGD::new(map.all_vars(), 0.5)?;
        let mut losses = Vec::new();
        let mut with_grad = Vec::new();
        for step in 0..3 {
            let (x, y) = ids(step);
            let (x, y) = (x.narrow(0, 2 * rank, 2)?, y.narrow(0, 2 * rank, 2)?);
            let logits = map.forward(ROOT_UNIT, || model.forward(&x, 0, &mut cache))?;
            let loss = loss_of(&logits, &y)?;
            losses.push(world_loss(mesh, &loss)?);
            let grads = fsdp.backward(&loss)?;
            if step == 0 {
                with_grad = names_with_grad(map.named_vars(), |v| {
                    grads.get(v.as_tensor()).is_some() || v.elem_count() == 0
                });
            }
            opt.step(&grads)?;
        }
        Ok((losses, with_grad, fsdp.params_without_grad().len()))
    });
    let (losses, with_grad, _) = &out[0];
    assert_close(losses, &ref_losses, 1e-5, "llama2_c losses");
    // Empty shards count as "has a gradient" on this rank only if one device has one; the
    // comparison uses rank 0, whose shards are all non-empty at these sizes.
    assert_eq!(with_grad, &ref_with_grad);
    assert!(out[0].2 > 0, "the cut parameters are reported");
}

#[test]
fn a_forgotten_reduction_is_an_error_not_a_silent_no_op() {
    let out = on_fsdp_world(2, |_, _, fsdp, map| {
        let l = map.wrap(
            "l",
            candle_nn::linear(4, 2, map.var_builder(DType::F32).pp("l"))?,
        )?;
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
        let mut opt = fsdp.optimizer(candle_nn::SGD::new(map.all_vars(), 0.1)?);
        let loss = l.forward(&x)?.sum(D::Minus1)?.mean_all()?;
        let grads = loss.backward()?; // candle's own backward: FSDP has not reduced anything
        let step_err = opt.step(&grads).err().map(|e| e.to_string());
        let fwd_err = l.forward(&x).err().map(|e| e.to_string());
        // Finishing the backward makes both work again.
        let mut grads = grads;
        fsdp.finish_backward(&mut grads)?;
        opt.step(&grads)?;
        l.forward(&x)?;
        Ok((step_err, fwd_err))
    });
    for (s, f) in out {
        let s = s.expect("step refused");
        let f = f.expect("forward refused");
        assert!(s.contains("never reduced"), "{s}");
        assert!(f.contains("never reduced"), "{f}");
    }
}

#[test]
fn a_var_builder_on_another_device_or_a_parameter_requested_twice_is_an_error() {
    let out = on_fsdp_world(2, |_, _, fsdp, map| {
        let vb = map.var_builder(DType::F32);
        candle_nn::linear(2, 2, vb.pp("a"))?;
        let twice = candle_nn::linear(2, 2, vb.pp("a"))
            .err()
            .map(|e| e.to_string());
        let no_unit = map.wrap("nope", ()).err().map(|e| e.to_string());
        let bad_pattern = FsdpVarMap::new(fsdp, SEED)
            .with_units(&["a..{i}"])
            .err()
            .map(|e| e.to_string());
        let int_param = vb
            .get_with_hints_dtype(3, "ids", candle_nn::Init::Const(0.), DType::U32)
            .err()
            .map(|e| e.to_string());
        Ok((twice, no_unit, bad_pattern, int_param))
    });
    for (twice, no_unit, bad, int) in out {
        assert!(twice.unwrap().contains("requested twice"));
        assert!(no_unit.unwrap().contains("no FSDP unit \"nope\""));
        assert!(bad.unwrap().contains("empty segment"));
        assert!(int.unwrap().contains("floating point"));
    }
    let _ = Var::new(&[0f32], &Device::Cpu);
}

#[test]
fn a_step_on_gradients_accumulated_without_sync_is_an_error() {
    let out = on_fsdp_world(2, |_, _, fsdp, map| {
        let l = map.wrap(
            "l",
            candle_nn::linear(4, 2, map.var_builder(DType::F32).pp("l"))?,
        )?;
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
        let mut opt = fsdp.optimizer(candle_nn::SGD::new(map.all_vars(), 0.1)?);
        // A micro-batch with gradient sync off: accumulated, not reduced.
        fsdp.set_requires_gradient_sync(false);
        let loss = l.forward(&x)?.sum(D::Minus1)?.mean_all()?;
        let grads = loss.backward()?;
        let accumulated = fsdp.has_accumulated_grads();
        let step_err = opt.step(&grads).err().map(|e| e.to_string());
        // The step's last micro-batch reduces what was accumulated; the step then runs.
        fsdp.set_requires_gradient_sync(true);
        let loss = l.forward(&x)?.sum(D::Minus1)?.mean_all()?;
        let grads = fsdp.backward(&loss)?;
        let after = fsdp.has_accumulated_grads();
        opt.step(&grads)?;
        Ok((accumulated, step_err, after))
    });
    for (accumulated, step_err, after) in out {
        assert!(accumulated, "sync off accumulates");
        let s = step_err.expect("a step on unreduced accumulated gradients is refused");
        assert!(
            s.contains("never reduced") && s.contains("set_requires_gradient_sync"),
            "{s}"
        );
        assert!(!after, "the synced backward reduced the accumulators");
    }
}
