//! The multi-tensor AdamW step and the global gradient norm on the CPU: AdamW bitwise equal to
//! candle-nn's `AdamW` (decay on and off, several steps, clipping by the device coefficient),
//! and the refusals of bad operands.
#[allow(dead_code)] // this binary uses `bits` only
mod common;
use common::bits;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_kernels::multi_tensor::{adamw_step, grad_norm_clip, scale_grads, AdamWStep};
use candle_nn::Optimizer;

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

const SIZES: [usize; 4] = [7, 0, 33, 1000];

/// `steps` of ours and of candle-nn on the same parameters and gradients; with `clip`, both
/// step on gradients scaled by the clip coefficient (ours inside the update, candle-nn's on
/// gradients scaled beforehand).
fn run(weight_decay: f64, decay: bool, clip: Option<f64>, steps: usize) {
    let dev = Device::Cpu;
    let params = candle_nn::ParamsAdamW {
        lr: 0.01,
        beta1: 0.8,
        beta2: 0.95,
        eps: 1e-6,
        weight_decay,
    };
    let init: Vec<Tensor> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| Tensor::from_vec(values(n, i as u64, 2.0), n, &dev).unwrap())
        .collect();
    let ours: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let theirs: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let zeros = || -> Vec<Tensor> {
        SIZES
            .iter()
            .map(|&n| Tensor::zeros(n, DType::F32, &dev).unwrap())
            .collect()
    };
    let (m, v) = (zeros(), zeros());
    // A parameter without decay steps as candle-nn with weight_decay 0.
    let their_params = candle_nn::ParamsAdamW {
        weight_decay: if decay { weight_decay } else { 0.0 },
        ..params.clone()
    };
    let mut opt = candle_nn::AdamW::new(theirs.clone(), their_params).unwrap();
    for t in 1..=steps {
        let grads: Vec<Tensor> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| Tensor::from_vec(values(n, (100 * t + i) as u64, 3.0), n, &dev).unwrap())
            .collect();
        let norm_clip = clip.map(|c| grad_norm_clip(&grads, Some(c)).unwrap());
        let params_t: Vec<Tensor> = ours.iter().map(|v| v.as_tensor().clone()).collect();
        adamw_step(
            &params_t,
            &grads,
            &m,
            &v,
            &vec![decay; SIZES.len()],
            &AdamWStep {
                lr: params.lr,
                beta1: params.beta1,
                beta2: params.beta2,
                eps: params.eps,
                weight_decay,
                t,
            },
            norm_clip.as_ref(),
        )
        .unwrap();
        let their_grads = match &norm_clip {
            Some(nc) => scale_grads(&grads, nc).unwrap(),
            None => grads.clone(),
        };
        // An empty store (candle has no public constructor): a throwaway var's, removed.
        let tmp = Var::zeros(1, DType::F32, &dev).unwrap();
        let mut store = tmp.as_tensor().sum_all().unwrap().backward().unwrap();
        store.remove(tmp.as_tensor());
        // candle-nn cannot step an empty var (its update is the same empty storage): the empty
        // parameter is ours alone, and stays empty.
        for (var, g) in theirs.iter().zip(&their_grads) {
            if var.elem_count() > 0 {
                store.insert(var.as_tensor(), g.clone());
            }
        }
        opt.step(&store).unwrap();
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(
                bits(a.as_tensor()),
                bits(b.as_tensor()),
                "step {t}, parameter {i} (decay {decay}, wd {weight_decay}, clip {clip:?})"
            );
        }
    }
}

#[test]
fn adamw_step_is_bitwise_candle_nn() {
    run(0.1, true, None, 4);
    // Decay off: candle-nn with weight_decay 0, whatever the configured decay.
    run(0.0, false, None, 3);
    run(0.1, false, None, 2);
}

#[test]
fn adamw_step_clips_with_the_coefficient() {
    // A maximum well below the gradients' norm (the coefficient is < 1) and one above it.
    run(0.1, true, Some(0.5), 3);
    run(0.1, true, Some(1e6), 2);
}

#[test]
fn adamw_step_refuses_bad_operands() {
    let dev = Device::Cpu;
    let t = |n: usize| Tensor::zeros(n, DType::F32, &dev).unwrap();
    let step = AdamWStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
        t: 1,
    };
    let (p, g, m, v) = (t(4), t(4), t(4), t(4));
    // Lists of different lengths.
    let e = adamw_step(
        std::slice::from_ref(&p),
        &[],
        std::slice::from_ref(&m),
        std::slice::from_ref(&v),
        &[true],
        &step,
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("1 parameters, 0 gradients"), "{e}");
    // A gradient of another length.
    let e = adamw_step(
        std::slice::from_ref(&p),
        &[t(3)],
        std::slice::from_ref(&m),
        std::slice::from_ref(&v),
        &[true],
        &step,
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("its gradient [3]"), "{e}");
    // The same storage twice: a parameter as its own moment, and a gradient that is the
    // parameter itself (written while read).
    for (what, grad, moment) in [("moment", &g, &p), ("gradient", &p, &m)] {
        let e = adamw_step(
            std::slice::from_ref(&p),
            std::slice::from_ref(grad),
            std::slice::from_ref(moment),
            std::slice::from_ref(&v),
            &[true],
            &step,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("shares a storage"), "{what}: {e}");
    }
    // Another dtype.
    let h = p.to_dtype(DType::F64).unwrap();
    let e = adamw_step(
        &[h],
        std::slice::from_ref(&g),
        std::slice::from_ref(&m),
        std::slice::from_ref(&v),
        &[true],
        &step,
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("adamw") && e.to_string().contains("F64"),
        "{e}"
    );
    // A parameter that is a view at an offset (it could not be updated in place).
    let big = t(8);
    let view = big.narrow(0, 4, 4).unwrap();
    let e = adamw_step(&[view], &[g], &[m], &[v], &[true], &step, None).unwrap_err();
    assert!(e.to_string().contains("must be contiguous"), "{e}");
}

/// Gradients are only read, so they may be views of one buffer (FSDP hands out a unit's shard
/// gradients so): the step and the norm over such views equal those over separate copies.
#[test]
fn gradients_may_be_views_of_one_buffer() {
    let dev = Device::Cpu;
    let buf = Tensor::from_vec(values(30, 5, 1.0), 30, &dev).unwrap();
    let views = [
        buf.narrow(0, 0, 12).unwrap().reshape((3, 4)).unwrap(),
        buf.narrow(0, 12, 18).unwrap(),
    ];
    let copies: Vec<Tensor> = views.iter().map(|g| g.copy().unwrap()).collect();
    let step = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 1,
    };
    let run = |grads: &[Tensor]| -> Vec<Vec<f32>> {
        let params: Vec<Tensor> = grads
            .iter()
            .enumerate()
            .map(|(i, g)| {
                Tensor::from_vec(values(g.elem_count(), 9 + i as u64, 1.0), g.shape(), &dev)
                    .unwrap()
            })
            .collect();
        let zeros = |t: &Tensor| t.zeros_like().unwrap();
        let m: Vec<Tensor> = params.iter().map(zeros).collect();
        let v: Vec<Tensor> = params.iter().map(zeros).collect();
        adamw_step(&params, grads, &m, &v, &[true, false], &step, None).unwrap();
        params
            .iter()
            .map(|p| p.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    assert_eq!(run(&views), run(&copies));
    let norm = |g: &[Tensor]| {
        grad_norm_clip(g, Some(1.0))
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(norm(&views), norm(&copies));
}
