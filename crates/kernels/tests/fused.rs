//! The fused f32 kernels match the candle-primitive reference, forward and backward.
mod common;

use candle_core::{DType, Device, Tensor};
use candle_dtensor_kernels::{autodiff::reference, fused};
use common::{check, randn};

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
