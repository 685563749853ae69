//! The fused f32 kernels match the candle-primitive reference, forward and backward.
use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_kernels::{fused, nn::reference};

fn close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: fused {x} vs reference {y}"
        );
    }
}

/// Runs `f` forward and backward (against a random upstream gradient) on fresh vars and returns
/// the output and the input gradients.
fn run(
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    seed_grad: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts).unwrap();
    let g = y
        .mul(seed_grad)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    (y, vars.iter().map(|v| g.get(v).unwrap().clone()).collect())
}

fn check(
    name: &str,
    inputs: &[Tensor],
    fast: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    slow: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    tol: f32,
) {
    let y = slow(inputs).unwrap();
    let seed = Tensor::randn(0f32, 1., y.shape(), &Device::Cpu).unwrap();
    let (ya, ga) = run(inputs, fast, &seed);
    let (yb, gb) = run(inputs, slow, &seed);
    close(&ya, &yb, tol, &format!("{name} forward"));
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        close(a, b, tol, &format!("{name} grad {i}"));
    }
}

fn randn(shape: &[usize], scale: f64) -> Tensor {
    (Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap() * scale).unwrap()
}

#[test]
fn gelu_matches_candle() {
    check(
        "gelu",
        &[randn(&[3, 7, 33], 3.0)],
        &|t| fused::gelu(&t[0]),
        &|t| reference::gelu(&t[0]),
        2e-5,
    );
    // Large magnitudes saturate cleanly.
    check(
        "gelu",
        &[randn(&[64], 40.0)],
        &|t| fused::gelu(&t[0]),
        &|t| reference::gelu(&t[0]),
        2e-5,
    );
}

#[test]
fn softmax_and_log_softmax_match() {
    for shape in [vec![5, 17], vec![2, 3, 4, 9], vec![1, 1]] {
        let x = randn(&shape, 4.0);
        let last = shape.len() - 1;
        check(
            "softmax",
            std::slice::from_ref(&x),
            &|t| fused::softmax_last(&t[0]),
            &|t| reference::softmax(&t[0], last),
            1e-5,
        );
        check(
            "log_softmax",
            &[x],
            &|t| fused::log_softmax_last(&t[0]),
            &|t| reference::log_softmax(&t[0], last),
            1e-5,
        );
    }
    // Non-contiguous input.
    let x = randn(&[6, 4], 2.0).t().unwrap();
    check(
        "softmax (transposed input)",
        &[x],
        &|t| fused::softmax_last(&t[0]),
        &|t| reference::softmax(&t[0], 1),
        1e-5,
    );
}

#[test]
fn causal_scaled_softmax_matches_masked_reference() {
    for (t, s) in [(5, 5), (3, 7)] {
        let x = randn(&[2, 3, t, s], 3.0);
        let mask: Vec<u8> = (0..t)
            .flat_map(|i| (0..s).map(move |j| u8::from(j + t > i + s)))
            .collect();
        let mask = Tensor::from_vec(mask, (t, s), &Device::Cpu).unwrap();
        check(
            "causal softmax",
            &[x],
            &|v| fused::scaled_causal_softmax(&v[0], 0.5, true),
            &|v| {
                let a = (&v[0] * 0.5)?;
                let ninf = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)?.broadcast_as(a.shape())?;
                let a = mask.broadcast_as(a.shape())?.where_cond(&ninf, &a)?;
                reference::softmax(&a, 3)
            },
            1e-5,
        );
    }
}

#[test]
fn norms_match() {
    let x = randn(&[4, 6, 32], 2.0);
    let w = (randn(&[32], 0.3) + 1.0).unwrap();
    let b = randn(&[32], 0.3);
    check(
        "layer_norm",
        &[x.clone(), w.clone(), b.clone()],
        &|t| fused::layer_norm(&t[0], &t[1], Some(&t[2]), 1e-5),
        &|t| reference::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
        2e-5,
    );
    check(
        "layer_norm (no bias)",
        &[x.clone(), w.clone()],
        &|t| fused::layer_norm(&t[0], &t[1], None, 1e-5),
        &|t| reference::layer_norm(&t[0], Some(&t[1]), None, 1e-5),
        2e-5,
    );
    check(
        "rms_norm",
        &[x, w],
        &|t| fused::rms_norm(&t[0], &t[1], 1e-6),
        &|t| reference::rms_norm(&t[0], &t[1], 1e-6),
        2e-5,
    );
    let _ = DType::F32;
}
