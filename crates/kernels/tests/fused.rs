//! The fused f32 kernels match the candle-primitive reference, forward and backward.
mod common;

use candle_core::{DType, Device, Tensor};
use candle_dtensor_kernels::{autodiff::reference, fused};
use common::{bits, check, randn};

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

/// A bf16 CPU GELU is the f32 kernel between casts: forward and backward each rounded once to
/// bf16 (as the CUDA kernel computes bf16), bit for bit.
#[test]
fn bf16_gelu_on_the_cpu_rounds_once() {
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).and_then(|t| t.to_dtype(DType::F32));
    check(
        "gelu bf16",
        &[randn(&[4, 33], 3.0)],
        &|t| fused::gelu(&t[0].to_dtype(DType::BF16)?)?.to_dtype(DType::F32),
        // The same ops on values rounded to bf16 where the bf16 path rounds: the input, the
        // output and (the casts' backward) the upstream gradient and the input gradient.
        &|t| bf(&fused::gelu(&bf(&t[0])?)?),
        0.0,
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

/// The reference per-row cross-entropy: `-log_softmax(x)[i, t_i]`, 0 where `t_i` is the ignore
/// index (gathered at class 0 there and masked).
fn ce_reference(x: &Tensor, targets: &[i64], ignore: Option<i64>) -> candle_core::Result<Tensor> {
    let dev = x.device();
    let idx: Vec<u32> = targets
        .iter()
        .map(|&t| if Some(t) == ignore { 0 } else { t as u32 })
        .collect();
    let keep: Vec<f32> = targets
        .iter()
        .map(|&t| if Some(t) == ignore { 0.0 } else { 1.0 })
        .collect();
    let n = targets.len();
    let idx = Tensor::from_vec(idx, (n, 1), dev)?;
    let keep = Tensor::from_vec(keep, n, dev)?;
    reference::log_softmax(x, 1)?
        .gather(&idx, 1)?
        .squeeze(1)?
        .neg()?
        .mul(&keep)
}

/// Class ids in `0..c` (a fixed pseudo-random walk), with every `ignore_every`-th row `-1`.
fn class_ids(n: usize, c: usize, ignore_every: Option<usize>) -> Vec<i64> {
    (0..n)
        .map(|i| match ignore_every {
            Some(k) if i % k == 1 => -1,
            _ => ((i * 2_654_435_761usize + 7) % c) as i64,
        })
        .collect()
}

#[test]
fn cross_entropy_rows_matches_log_softmax_gather() {
    // Uneven vocabularies and row counts, one class, a vocabulary past one block of threads.
    for (n, c) in [(1, 1), (3, 7), (5, 33), (17, 1000), (2, 4097), (4, 31)] {
        let x = randn(&[n, c], 3.0);
        let ids = class_ids(n, c, None);
        for dtype in [DType::U32, DType::I64] {
            let t = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            check(
                &format!("cross_entropy_rows [{n}, {c}] {dtype:?} targets"),
                std::slice::from_ref(&x),
                &|v| fused::cross_entropy_rows(&v[0], &t, None),
                &|v| ce_reference(&v[0], &ids, None),
                1e-5,
            );
        }
    }
}

#[test]
fn cross_entropy_rows_ignores_the_ignore_index() {
    let (n, c) = (9, 50);
    let x = randn(&[n, c], 2.0);
    let ids = class_ids(n, c, Some(3));
    let t = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    check(
        "cross_entropy_rows with ignore_index -1",
        std::slice::from_ref(&x),
        &|v| fused::cross_entropy_rows(&v[0], &t, Some(-1)),
        &|v| ce_reference(&v[0], &ids, Some(-1)),
        1e-5,
    );
    // The ignored rows: loss 0 and a zero gradient row, exactly.
    let var = candle_core::Var::from_tensor(&x).unwrap();
    let loss = fused::cross_entropy_rows(var.as_tensor(), &t, Some(-1)).unwrap();
    let grads = loss.sum_all().unwrap().backward().unwrap();
    let dx = grads.get(&var).unwrap();
    let losses: Vec<f32> = loss.to_vec1().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        if id == -1 {
            assert_eq!(losses[i], 0.0, "row {i}");
            let row: Vec<f32> = dx.get(i).unwrap().to_vec1().unwrap();
            assert!(row.iter().all(|&v| v == 0.0), "row {i}: {row:?}");
        } else {
            assert!(losses[i] > 0.0, "row {i}: {}", losses[i]);
        }
    }
}

#[test]
fn cross_entropy_mean_is_the_mean_of_the_rows() {
    let (n, c) = (6, 13);
    let x = randn(&[n, c], 2.0);
    let t = Tensor::new(class_ids(n, c, None).as_slice(), &Device::Cpu).unwrap();
    let mean = fused::cross_entropy(&x, &t).unwrap();
    let rows = fused::cross_entropy_rows(&x, &t, None).unwrap();
    let want = rows.mean_all().unwrap();
    let d = candle_dtensor_kernels::compare::max_abs_diff(&mean, &want).unwrap();
    assert!(d < 1e-6, "{d}");
}

/// Logits `[B, T, C]` (no reshape before the node) give the bits of the same rows as `[B T, C]`:
/// the per-row losses, the mean, a rank's share of a larger mean, and their gradients.
#[test]
fn cross_entropy_takes_leading_dims_as_rows() {
    let (b, t, c) = (2, 3, 11);
    let x3 = randn(&[b, t, c], 2.0);
    let x2 = x3.reshape((b * t, c)).unwrap();
    let ids = class_ids(b * t, c, None);
    let (t2, t3) = (
        Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(),
        Tensor::from_vec(ids.clone(), (b, t), &Device::Cpu).unwrap(),
    );
    type Loss = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;
    let cases: [(&str, Loss); 3] = [
        ("rows", |x, t| {
            fused::cross_entropy_rows(x, t, None)?.sum_all()
        }),
        ("mean", |x, t| fused::cross_entropy(x, t)),
        ("share of 10 rows", |x, t| {
            fused::cross_entropy_share(x, t, 10)
        }),
    ];
    for (what, f) in cases {
        let (v2, v3) = (
            candle_core::Var::from_tensor(&x2).unwrap(),
            candle_core::Var::from_tensor(&x3).unwrap(),
        );
        let (l2, l3) = (
            f(v2.as_tensor(), &t2).unwrap(),
            f(v3.as_tensor(), &t3).unwrap(),
        );
        assert_eq!(bits(&l2), bits(&l3), "{what}: loss");
        let (g2, g3) = (l2.backward().unwrap(), l3.backward().unwrap());
        let (g2, g3) = (
            g2.get(v2.as_tensor()).unwrap(),
            g3.get(v3.as_tensor()).unwrap(),
        );
        assert_eq!(
            g3.dims(),
            [b, t, c],
            "{what}: the gradient has the logits' shape"
        );
        assert_eq!(bits(g2), bits(g3), "{what}: gradient");
    }
    // The share: the mean times rows / global rows.
    let share = fused::cross_entropy_share(&x3, &t3, 10).unwrap();
    let mean = fused::cross_entropy(&x3, &t3).unwrap();
    let want = mean.affine(6.0 / 10.0, 0.0).unwrap();
    assert_eq!(bits(&share), bits(&want));
}

#[test]
fn cross_entropy_rows_refuses_bad_input() {
    let x = randn(&[3, 5], 1.0);
    let ok = Tensor::new(&[0u32, 4, 2], &Device::Cpu).unwrap();
    // A target outside the classes (not the ignore index).
    let far = Tensor::new(&[0i64, 5, 2], &Device::Cpu).unwrap();
    let e = fused::cross_entropy_rows(&x, &far, None).unwrap_err();
    assert!(e.to_string().contains("class id 5 outside 0..5"), "{e}");
    let neg = Tensor::new(&[0i64, -1, 2], &Device::Cpu).unwrap();
    assert!(fused::cross_entropy_rows(&x, &neg, None).is_err());
    assert!(fused::cross_entropy_rows(&x, &neg, Some(-1)).is_ok());
    // Targets that do not match the rows; logits without classes.
    let two = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
    let e = fused::cross_entropy_rows(&x, &two, None).unwrap_err();
    assert!(e.to_string().contains("targets of shape [2]"), "{e}");
    let none = Tensor::zeros((3, 0), DType::F32, &Device::Cpu).unwrap();
    let e = fused::cross_entropy_rows(&none, &ok, None).unwrap_err();
    assert!(e.to_string().contains("no classes"), "{e}");
    // A dtype the CPU kernel does not take: a typed error naming op, dtype and shape.
    let h = x.to_dtype(DType::BF16).unwrap();
    let e = fused::cross_entropy_rows(&h, &ok, None).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("cross_entropy") && msg.contains("BF16") && msg.contains("[3, 5]"),
        "{msg}"
    );
    // Other integer targets are converted; non-contiguous logits are made contiguous.
    let t32 = Tensor::new(&[0i64, 4, 2], &Device::Cpu)
        .unwrap()
        .to_dtype(DType::U8)
        .unwrap();
    let a = fused::cross_entropy_rows(&x, &t32, None).unwrap();
    let b = fused::cross_entropy_rows(&x, &ok, None).unwrap();
    assert_eq!(
        candle_dtensor_kernels::compare::max_abs_diff(&a, &b).unwrap(),
        0.0
    );
    let xt = randn(&[5, 3], 1.0).t().unwrap();
    let c = fused::cross_entropy_rows(&xt, &ok, None).unwrap();
    let want = ce_reference(&xt, &[0, 4, 2], None).unwrap();
    assert!(candle_dtensor_kernels::compare::max_abs_diff(&c, &want).unwrap() < 1e-5);
}

#[test]
fn cross_entropy_rows_of_no_rows() {
    let x =
        candle_core::Var::from_tensor(&Tensor::zeros((0, 7), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
    let t = Tensor::zeros(0, DType::U32, &Device::Cpu).unwrap();
    let loss = fused::cross_entropy_rows(x.as_tensor(), &t, None).unwrap();
    assert_eq!(loss.dims(), &[0]);
    let grads = loss.sum_all().unwrap().backward().unwrap();
    assert_eq!(grads.get(&x).unwrap().dims(), &[0, 7]);
}
