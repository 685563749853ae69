//! The mixed-precision policy (`GptConfig::precision`, `precision::scope`): what each op
//! computes in, read from the values and from the autograd graph, on one device and in every
//! layout the GPT runs (data parallel, FSDP with f32 and bf16 parameters, tensor + sequence
//! parallel, context parallel, expert parallel, a pipeline stage).
//!
//! - The linear's GEMM is candle's bf16 product (operands cast to bf16, f32 out), not the f32
//!   one; without the policy it is the f32 one, bit for bit. Most linears are one graph node
//!   (`region::linear_in`) whose bf16 operands live inside it: the graph count adds 3 (two
//!   operands and the product, as the plain composition shows them) per such node.
//! - Norms compute in f32 even on bf16 inputs (FSDP's bf16 parameters); attention's softmax and
//!   the loss in f32: no reduction over a last dim of size 1 (a norm's or softmax's statistics,
//!   the loss's log-sum-exp) is bf16 anywhere in the graph, while the GEMMs' operands and
//!   products are.
//! - The master weights' gradients are f32 in every layout.
//!
//! Tolerances: a layout's bf16 loss against one device's bf16 loss, relative 5e-3 (each GEMM
//! output is rounded to bf16, 2^-9 relative; layouts round different partial sums, e.g. tensor
//! parallelism's row-parallel pieces, and context parallelism's ring computes attention's
//! blocks in f32; the loss is a mean over 64 tokens, so such roundings average out to ~1e-4);
//! bf16 against f32, relative 5e-3 and not equal.
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::layers::{Builder, LayerNorm, Linear};
use candle_dtensor_models::precision::{self, Precision};
use candle_dtensor_models::{Gpt, GptConfig, GptStage, StageInput};
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::moe::MoeConfig;
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::tp_plan::MeshRoles;
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::data::Corpus;

use common::{micro_gpt, R};

/// What the graph behind a loss holds: bf16 tensors in all, and the shapes of bf16 tensors
/// whose last dim is 1 (a reduction's statistics); and the mixed-precision linear nodes built
/// for it (`region::take_linear_in_nodes`).
#[derive(Debug, Default)]
struct GraphDtypes {
    bf16: usize,
    bf16_reductions: Vec<Vec<usize>>,
    linear_in_nodes: usize,
}

impl GraphDtypes {
    /// bf16 GEMM tensors: those in the graph, and 3 for each one-node linear.
    fn gemm_bf16(&self) -> usize {
        self.bf16 + 3 * self.linear_in_nodes
    }
}

fn graph_dtypes(loss: &Tensor) -> GraphDtypes {
    let mut g = GraphDtypes::default();
    for t in loss.sorted_nodes() {
        if t.dtype() == DType::BF16 {
            g.bf16 += 1;
            if t.dims().last() == Some(&1) {
                g.bf16_reductions.push(t.dims().to_vec());
            }
        }
    }
    g
}

/// One rank's view of a forward + backward.
#[derive(Debug)]
struct Run {
    loss: f32,
    graph: GraphDtypes,
    /// Dtypes of the master weights' gradients.
    grad_dtypes: Vec<DType>,
    logits_dtype: DType,
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    One,
    Dp2,
    Fsdp2 {
        bf16_params: bool,
    },
    Tp2Sp,
    Cp2,
    Ep2Moe,
    /// The mixture-of-experts GPT on one device (ep = 1).
    OneMoe,
    /// The GPT as one pipeline stage (`GptStage`: the stage code path).
    Stage,
}

fn cfg_for(layout: Layout, p: Precision) -> GptConfig {
    let mut c = GptConfig {
        precision: p,
        ..micro_gpt()
    };
    if let Layout::Ep2Moe | Layout::OneMoe = layout {
        c.moe = Some("experts=4,top_k=2".parse::<MoeConfig>().unwrap());
    }
    c
}

/// A forward and backward of the loss of one batch (8 sequences of 16 tokens) under `layout`.
fn run(layout: Layout, p: Precision) -> Run {
    let cfg = cfg_for(layout, p);
    let (world, dims, plan): (usize, Vec<(&str, usize)>, TpPlan) = match layout {
        Layout::One | Layout::Stage => (1, vec![("dp", 1)], TpPlan::gpt(false)),
        Layout::Dp2 | Layout::Fsdp2 { .. } => (2, vec![("dp", 2)], TpPlan::gpt(false)),
        Layout::Tp2Sp => (2, vec![("tp", 2)], TpPlan::gpt(true)),
        Layout::Cp2 => (2, vec![("cp", 2)], TpPlan::gpt(false)),
        Layout::Ep2Moe => (2, vec![("ep", 2)], TpPlan::gpt(false)),
        Layout::OneMoe => (1, vec![("ep", 1)], TpPlan::gpt(false)),
    };
    let corpus = Corpus::synthetic(cfg.vocab, 4096, 5);
    LocalWorld::new(world)
        .with_timeout(Duration::from_secs(120))
        .launch(|comm| -> R<Run> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            if let Layout::Stage = layout {
                let mut store = ParamStore::new(&mesh, 7, DType::F32);
                let stage = GptStage::new(&cfg, &mesh, &plan, 0, 1, 0..cfg.n_layers, &mut store)?;
                let (x, y) = corpus.batch(0, 8, 16, 11);
                let rep = vec![Placement::Replicate; mesh.ndim()];
                let x = Tensor::from_vec(x, (8, 16), &Device::Cpu)?;
                let y = Tensor::from_vec(y, (8, 16), &Device::Cpu)?;
                let x = candle_dtensor_core::distribute_tensor(&x, &mesh, &rep)?;
                let y = candle_dtensor_core::distribute_tensor(&y, &mesh, &rep)?;
                candle_dtensor_core::region::take_linear_in_nodes();
                let logits = stage.forward(StageInput::Ids(&x))?;
                let loss = stage.loss(&logits, &y)?;
                return finish(&loss, logits.dtype(), &store, None);
            }
            let fsdp = match layout {
                Layout::Fsdp2 { bf16_params } => {
                    let mut fc = FsdpConfig::new(0, GradReduce::Sum);
                    fc.param_dtype = bf16_params.then_some(DType::BF16);
                    Some(Fsdp::new(&mesh, fc)?)
                }
                _ => None,
            };
            let (gpt, store) = Gpt::build(&cfg, &mesh, &plan, 7, DType::F32, fsdp.as_ref())?;
            let (x, y) = common::gpt_batch(&corpus, 0, (8, 16, 11), &gpt, &mesh)?;
            let logits_dtype = gpt.forward(&x)?.dtype();
            candle_dtensor_core::region::take_linear_in_nodes();
            let loss = gpt.loss(&x, &y)?;
            finish(&loss, logits_dtype, &store, fsdp.as_ref())
        })
        .unwrap()
        .into_iter()
        .next()
        .unwrap()
}

fn finish(loss: &DTensor, logits_dtype: DType, store: &ParamStore, fsdp: Option<&Fsdp>) -> R<Run> {
    assert_eq!(loss.dtype(), DType::F32, "the loss computes in f32");
    let mut graph = graph_dtypes(loss.to_local());
    graph.linear_in_nodes = candle_dtensor_core::region::take_linear_in_nodes();
    let full = loss.redistribute(&vec![Placement::Replicate; loss.mesh().ndim()])?;
    let mut grads = full.to_local().backward()?;
    if let Some(f) = fsdp {
        // FSDP's reduce-scatter of the full gradients into the shards' (f32) ones.
        f.finish_backward(&mut grads)?;
    }
    let grad_dtypes = store
        .vars()
        .iter()
        .filter_map(|v| grads.get(v.as_tensor()).map(|g| g.dtype()))
        .collect();
    Ok(Run {
        loss: full.to_local().to_dtype(DType::F32)?.to_scalar::<f32>()?,
        graph,
        grad_dtypes,
        logits_dtype,
    })
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs()
}

/// Every layout: the bf16 GEMMs are in the graph (3 bf16 tensors, operands and product, per
/// GEMM: 4 linears and 2 attention products per block and the head; at least as many as on
/// one device, so no layout's code path skips one), no bf16 reduction statistics, f32
/// logits, loss and master gradients; the loss is one device's bf16 loss. Under f32 no tensor
/// is bf16.
#[test]
fn every_layout_runs_gemms_in_bf16_and_the_rest_in_f32() {
    let one_bf16 = run(Layout::One, Precision::Bf16);
    let one_f32 = run(Layout::One, Precision::F32);
    assert_eq!(one_f32.graph.gemm_bf16(), 0, "{:?}", one_f32.graph);
    assert_ne!(one_bf16.loss, one_f32.loss, "bf16 must change the rounding");
    assert!(rel(one_bf16.loss, one_f32.loss) < 5e-3);
    let gemms = micro_gpt().n_layers * 6 + 1;
    assert!(
        one_bf16.graph.gemm_bf16() >= 3 * gemms,
        "{:?}",
        one_bf16.graph
    );
    // The block's four linears are one node each.
    assert!(
        one_bf16.graph.linear_in_nodes >= 4 * micro_gpt().n_layers,
        "{:?}",
        one_bf16.graph
    );
    let moe_one = run(Layout::OneMoe, Precision::Bf16);
    // Every block's MLP is a mixture of experts: two expert GEMMs per block in place of the
    // dense MLP's two (the router stays f32).
    assert!(
        moe_one.graph.gemm_bf16() >= 3 * gemms,
        "{:?}",
        moe_one.graph
    );
    for layout in [
        Layout::One,
        Layout::Dp2,
        Layout::Fsdp2 { bf16_params: false },
        Layout::Fsdp2 { bf16_params: true },
        Layout::Tp2Sp,
        Layout::Cp2,
        Layout::Ep2Moe,
        Layout::Stage,
    ] {
        let r = run(layout, Precision::Bf16);
        let one = if let Layout::Ep2Moe = layout {
            &moe_one
        } else {
            &one_bf16
        };
        assert!(
            r.graph.gemm_bf16() >= one.graph.gemm_bf16(),
            "{layout:?}: {:?}, on one device {:?}",
            r.graph,
            one.graph
        );
        assert!(
            r.graph.bf16_reductions.is_empty(),
            "{layout:?}: bf16 statistics {:?} (norm / softmax / loss not in f32)",
            r.graph.bf16_reductions
        );
        assert_eq!(r.logits_dtype, DType::F32, "{layout:?}");
        assert!(!r.grad_dtypes.is_empty(), "{layout:?}: no gradients");
        assert!(
            r.grad_dtypes.iter().all(|d| *d == DType::F32),
            "{layout:?}: master gradients {:?}",
            r.grad_dtypes
        );
        assert!(
            rel(r.loss, one.loss) < 5e-3,
            "{layout:?}: {} vs one device {}",
            r.loss,
            one.loss
        );
    }
}

/// Layers on one device: the linear's product is candle's bf16 product under the policy and
/// the f32 one without it (bit for bit); a norm on a bf16 input computes in f32.
#[test]
fn the_linear_runs_in_bf16_and_the_norm_in_f32() {
    LocalWorld::new(1)
        .launch(|comm| -> R<()> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            let mut store = ParamStore::new(&mesh, 3, DType::F32);
            let mut b = Builder {
                store: &mut store,
                roles: MeshRoles::of(&mesh)?,
                plan: TpPlan::new(),
            };
            let lin = Linear::new(&mut b, "fc", 16, 8, true, 0.5)?;
            let ln = LayerNorm::new(&mut b, "ln", 16, true, 1e-5)?;
            let rep = vec![Placement::Replicate; 1];
            let xs: Vec<f32> = (0..48).map(|i| (i as f32 * 0.37).sin() * 1.3).collect();
            let x = Tensor::from_vec(xs, (3, 16), &Device::Cpu)?;
            let xd = DTensor::from_local(&x, &mesh, &rep)?;
            let (w, bias) = (
                lin.weight.to_local().clone(),
                lin.bias.as_ref().ok_or("bias")?.to_local().clone(),
            );
            let f32_product = x.matmul(&w.t()?)?.broadcast_add(&bias)?;
            let bf16_product = x
                .to_dtype(DType::BF16)?
                .matmul(&w.to_dtype(DType::BF16)?.t()?)?
                .to_dtype(DType::F32)?
                .broadcast_add(&bias)?;
            let diff = |a: &Tensor, b: &Tensor| -> R<f32> {
                Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
            };
            assert!(diff(&f32_product, &bf16_product)? > 1e-4);
            let plain = lin.forward(&xd)?;
            assert_eq!(diff(plain.to_local(), &f32_product)?, 0.0);
            {
                let _f32 = precision::scope(Precision::F32, DType::F32);
                assert_eq!(diff(lin.forward(&xd)?.to_local(), &f32_product)?, 0.0);
            }
            let _bf16 = precision::scope(Precision::Bf16, DType::F32);
            let y = lin.forward(&xd)?;
            assert_eq!(y.dtype(), DType::F32);
            assert!(diff(y.to_local(), &bf16_product)? <= 1e-6);
            // The norm on a bf16 input (FSDP's bf16 activations): f32 out, the f32 norm of it.
            let xb = DTensor::from_local(&x.to_dtype(DType::BF16)?, &mesh, &rep)?;
            let n = ln.forward(&xb)?;
            assert_eq!(n.dtype(), DType::F32);
            let want = {
                let _none = precision::scope(Precision::F32, DType::F32);
                ln.forward(&DTensor::from_local(
                    &x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
                    &mesh,
                    &rep,
                )?)?
            };
            assert_eq!(diff(n.to_local(), want.to_local())?, 0.0);
            Ok(())
        })
        .unwrap();
}

/// The dense MLP with a bf16 hidden activation (`Mlp::forward_with`, what `forward` picks under
/// the bf16 policy on CUDA: autocast's data flow): `fc1`'s bf16 product plus its f32 bias
/// rounded to bf16, GELU in f32 arithmetic on it, rounded to bf16, `fc2` reading that and
/// writing f32, as one device's composition computes it. Without a policy f32 throughout; on
/// the CPU `forward` keeps the hidden activation f32 under the bf16 policy too.
#[test]
fn the_mlp_hands_bf16_activations_between_its_linears() {
    use candle_dtensor_models::layers::Mlp;
    const BF: DType = DType::BF16;
    LocalWorld::new(1)
        .launch(|comm| -> R<()> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            let mut store = ParamStore::new(&mesh, 5, DType::F32);
            let mut b = Builder {
                store: &mut store,
                roles: MeshRoles::of(&mesh)?,
                plan: TpPlan::new(),
            };
            let mlp = Mlp::new(&mut b, "mlp", 16, 40, false, 0.5, 0.5)?;
            // Non-zero biases: a bf16 product plus a zero bias would need no rounding.
            for (name, n) in [("mlp.fc1.bias", 40), ("mlp.fc2.bias", 16)] {
                let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.61).cos() * 0.3).collect();
                store
                    .get(name)
                    .ok_or("no bias")?
                    .var
                    .set(&Tensor::from_vec(v, n, &Device::Cpu)?)?;
            }
            let rep = vec![Placement::Replicate; 1];
            let xs: Vec<f32> = (0..48).map(|i| (i as f32 * 0.37).sin() * 1.3).collect();
            let x = Tensor::from_vec(xs, (3, 16), &Device::Cpu)?;
            let xd = DTensor::from_local(&x, &mesh, &rep)?;
            let local = |l: &Linear| -> R<(Tensor, Tensor)> {
                Ok((
                    l.weight.to_local().clone(),
                    l.bias.as_ref().ok_or("bias")?.to_local().clone(),
                ))
            };
            let ((w1, b1), (w2, b2)) = (local(&mlp.fc1)?, local(&mlp.fc2)?);
            let gelu = candle_dtensor_core::gelu_local;
            let want_f32 = {
                let h = gelu(&x.matmul(&w1.t()?)?.broadcast_add(&b1)?)?;
                h.matmul(&w2.t()?)?.broadcast_add(&b2)?
            };
            let want_bf16 = {
                let h = x
                    .to_dtype(BF)?
                    .matmul(&w1.to_dtype(BF)?.t()?)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&b1)?
                    .to_dtype(BF)?;
                let h = gelu(&h.to_dtype(DType::F32)?)?.to_dtype(BF)?;
                h.matmul(&w2.to_dtype(BF)?.t()?)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&b2)?
            };
            let diff = |a: &Tensor, b: &Tensor| -> R<f32> {
                Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
            };
            assert!(diff(&want_f32, &want_bf16)? > 1e-3);
            let plain = mlp.forward(&xd)?;
            assert_eq!(plain.dtype(), DType::F32);
            assert!(diff(plain.to_local(), &want_f32)? <= 1e-6);
            let _bf16 = precision::scope(Precision::Bf16, DType::F32);
            // On the CPU `forward` keeps the hidden activation in f32: the bf16 GEMMs of
            // `linear_in` around an f32 GELU.
            let want_cpu = {
                let h = x
                    .to_dtype(BF)?
                    .matmul(&w1.to_dtype(BF)?.t()?)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&b1)?;
                gelu(&h)?
                    .to_dtype(BF)?
                    .matmul(&w2.to_dtype(BF)?.t()?)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&b2)?
            };
            assert!(diff(&want_cpu, &want_bf16)? > 0.0);
            assert!(diff(mlp.forward(&xd)?.to_local(), &want_cpu)? <= 1e-6);
            let y = mlp.forward_with(&xd, Some(BF))?;
            assert_eq!(y.dtype(), DType::F32);
            assert!(diff(y.to_local(), &want_bf16)? <= 1e-6);
            // The hidden activation in the graph is bf16: GELU's output, [3, 40].
            let hidden_bf16 = y
                .to_local()
                .sum_all()?
                .sorted_nodes()
                .iter()
                .filter(|t| t.dtype() == BF && t.dims() == [3, 40])
                .count();
            assert!(hidden_bf16 >= 1, "no bf16 hidden activation in the graph");
            Ok(())
        })
        .unwrap();
}

/// Under the bf16 policy a linear whose f32 weight FSDP manages (`managed_grad_dims`: released
/// after the unit's forward, gathered again before its backward) keeps no bf16 cast of it: the
/// backward casts the weight as its storage holds it then. Here the storage is released and
/// refilled with other values between the forward and the backward; the input gradient shows
/// which weight the backward used: the refilled one for a managed weight, the forward's (the
/// kept cast) for an unmanaged one. The output is the forward's either way.
#[test]
fn a_gathered_weight_is_cast_again_in_the_backward() {
    use candle_core::Var;
    use candle_dtensor_kernels::storage;
    LocalWorld::new(1)
        .launch(|comm| -> R<()> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            let rep = vec![Placement::Replicate; 1];
            let xs: Vec<f32> = (0..48).map(|i| (i as f32 * 0.37).sin() * 1.3).collect();
            let x = Tensor::from_vec(xs, (3, 16), &Device::Cpu)?;
            // sum(x W^T)'s input gradient with the bf16 product: ones @ bf16(W), a bf16 GEMM.
            let dx_for = |w: &Tensor| -> R<Tensor> {
                Ok(Tensor::ones((3, 8), DType::BF16, &Device::Cpu)?
                    .matmul(&w.to_dtype(DType::BF16)?)?
                    .to_dtype(DType::F32)?)
            };
            let mut dxs = Vec::new();
            for managed in [false, true] {
                let mut store = ParamStore::new(&mesh, 3, DType::F32);
                let mut b = Builder {
                    store: &mut store,
                    roles: MeshRoles::of(&mesh)?,
                    plan: TpPlan::new(),
                };
                let mut lin = Linear::new(&mut b, "fc", 16, 8, false, 0.5)?;
                if managed {
                    lin.weight = lin.weight.with_managed_grad_dims(&[0]);
                }
                let w_a = lin.weight.to_local().copy()?;
                let w_b = (&w_a * -1.75)?;
                let xv = Var::from_tensor(&x)?;
                let xd = DTensor::from_local(xv.as_tensor(), &mesh, &rep)?;
                let y = {
                    let _bf16 = precision::scope(Precision::Bf16, DType::F32);
                    lin.forward(&xd)?
                };
                storage::release(lin.weight.to_local(), "fc.weight")?;
                storage::refill(lin.weight.to_local(), &w_b)?;
                let grads = y.to_local().sum_all()?.backward()?;
                let dx = grads.get(xv.as_tensor()).ok_or("no input gradient")?;
                let want = dx_for(if managed { &w_b } else { &w_a })?;
                let d = (dx - &want)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert!(d <= 1e-5, "managed {managed}: dx off by {d}");
                dxs.push(dx.clone());
            }
            let d = (&dxs[0] - &dxs[1])?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(d > 1e-3, "the refilled weight must change the gradient");
            Ok(())
        })
        .unwrap();
}
