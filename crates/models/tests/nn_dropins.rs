//! The differentiable drop-ins of `models::dropins` (`candle_dtensor::nn`) against candle-nn: the same values as candle-nn's
//! fused ops (which give no gradient), and the same values and gradients as candle's
//! primitive compositions, for f32 (the fused kernels) and f64 (the compositions).
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_dtensor_models::dropins as nn;
use candle_nn::{VarBuilder, VarMap};

fn values(dims: &[usize], salt: usize, dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7 + salt * 13 + 3) % 23) as f32 - 11.0) / 6.0)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let (a, b) = (a.to_vec1::<f64>().unwrap(), b.to_vec1::<f64>().unwrap());
    let scale = b.iter().fold(1.0f64, |m, y| m.max(y.abs()));
    // f64::max keeps an infinity, which would make every finite difference pass (a NaN in
    // `a` or `b` fails the comparison below).
    assert!(scale.is_finite(), "{what}: the reference is not finite");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}: element {i}: {x} vs {y}"
        );
    }
}

/// Runs `f` on fresh leaves made from `inputs` and returns its output and each input's
/// gradient of `sum(f(..) * c)` (None where no gradient arrived).
fn run(
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> (Tensor, Vec<Option<Tensor>>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts).unwrap();
    let c = values(y.dims(), 99, y.dtype());
    let grads = (&y * c).unwrap().sum_all().unwrap().backward().unwrap();
    let g = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).cloned())
        .collect();
    (y, g)
}

fn same_as_composition(
    what: &str,
    inputs: &[Tensor],
    ours: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) {
    let tol = if inputs[0].dtype() == DType::F64 {
        1e-12
    } else {
        1e-5
    };
    let (y, g) = run(inputs, ours);
    let (yr, gr) = run(inputs, reference);
    close(&y, &yr, tol, &format!("{what}: value"));
    for (k, (a, b)) in g.iter().zip(&gr).enumerate() {
        let b = b
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: reference input {k} has no grad"));
        let a = a
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: input {k} has no gradient"));
        close(a, b, tol, &format!("{what}: gradient of input {k}"));
    }
}

/// candle-nn's fused op: the same value, no gradient for its input.
fn fused_cuts_the_graph(
    what: &str,
    inputs: &[Tensor],
    ours: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    fused: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) {
    let (y, _) = run(inputs, ours);
    let (yf, gf) = run(inputs, fused);
    close(
        &y,
        &yf,
        1e-5,
        &format!("{what}: value vs candle-nn's fused op"),
    );
    assert!(
        gf.iter().all(Option::is_none),
        "{what}: candle-nn's fused op now has a backward; the drop-in may no longer be needed"
    );
}

const X: [usize; 3] = [2, 3, 8];

#[test]
fn ops_match_candle_nn() {
    for dtype in [DType::F32, DType::F64] {
        let x = values(&X, 0, dtype);
        let w = values(&[8], 1, dtype);
        let b = values(&[8], 2, dtype);
        let what = format!("{dtype:?}");
        same_as_composition(
            &format!("rms_norm {what}"),
            &[x.clone(), w.clone()],
            |t| nn::ops::rms_norm(&t[0], &t[1], 1e-5),
            |t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5),
        );
        same_as_composition(
            &format!("layer_norm {what}"),
            &[x.clone(), w.clone(), b.clone()],
            |t| nn::ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            |t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5),
        );
        same_as_composition(
            &format!("softmax_last_dim {what}"),
            std::slice::from_ref(&x),
            |t| nn::ops::softmax_last_dim(&t[0]),
            |t| candle_nn::ops::softmax(&t[0], D::Minus1),
        );
    }
    let x = values(&X, 0, DType::F32);
    let w = values(&[8], 1, DType::F32);
    let b = values(&[8], 2, DType::F32);
    fused_cuts_the_graph(
        "rms_norm",
        &[x.clone(), w.clone()],
        |t| nn::ops::rms_norm(&t[0], &t[1], 1e-5),
        |t| candle_nn::ops::rms_norm(&t[0], &t[1], 1e-5),
    );
    fused_cuts_the_graph(
        "layer_norm",
        &[x.clone(), w, b],
        |t| nn::ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        |t| candle_nn::ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
    );
    fused_cuts_the_graph(
        "softmax_last_dim",
        &[x],
        |t| nn::ops::softmax_last_dim(&t[0]),
        candle_nn_softmax_last_dim,
    );
}

fn candle_nn_softmax_last_dim(t: &[Tensor]) -> candle_core::Result<Tensor> {
    candle_nn::ops::softmax_last_dim(&t[0])
}

#[test]
fn rope_matches_candle_nn() {
    // x [B, H, T, D], cos/sin [T', D/2] with T' > T.
    let x = values(&[2, 3, 5, 8], 0, DType::F32);
    let cos = values(&[7, 4], 1, DType::F32).cos().unwrap();
    let sin = values(&[7, 4], 1, DType::F32).sin().unwrap();
    for (name, interleaved) in [("rope", false), ("rope_i", true)] {
        let ours = |t: &[Tensor]| {
            if interleaved {
                nn::rotary_emb::rope_i(&t[0], &t[1], &t[2])
            } else {
                nn::rotary_emb::rope(&t[0], &t[1], &t[2])
            }
        };
        same_as_composition(name, &[x.clone(), cos.clone(), sin.clone()], ours, |t| {
            if interleaved {
                candle_nn::rotary_emb::rope_i_slow(&t[0], &t[1], &t[2])
            } else {
                candle_nn::rotary_emb::rope_slow(&t[0], &t[1], &t[2])
            }
        });
        let (c5, s5) = (cos.narrow(0, 0, 5).unwrap(), sin.narrow(0, 0, 5).unwrap());
        fused_cuts_the_graph(name, &[x.clone(), c5, s5], ours, |t| {
            if interleaved {
                candle_nn::rotary_emb::rope_i(&t[0], &t[1], &t[2])
            } else {
                candle_nn::rotary_emb::rope(&t[0], &t[1], &t[2])
            }
        });
        // Per-batch tables [B, T, D/2]: each batch row as the 2-D case.
        let cos3 = values(&[2, 5, 4], 3, DType::F32).cos().unwrap();
        let sin3 = values(&[2, 5, 4], 3, DType::F32).sin().unwrap();
        same_as_composition(
            &format!("{name} per batch"),
            &[x.clone(), cos3.clone(), sin3.clone()],
            ours,
            |t| {
                let rows = (0..2)
                    .map(|b| {
                        let xb = t[0].narrow(0, b, 1)?;
                        let (cb, sb) = (t[1].get(b)?, t[2].get(b)?);
                        if interleaved {
                            candle_nn::rotary_emb::rope_i_slow(&xb, &cb, &sb)
                        } else {
                            candle_nn::rotary_emb::rope_slow(&xb, &cb, &sb)
                        }
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)
            },
        );
        let bad = values(&[5, 3], 0, DType::F32);
        let e = ours(&[x.clone(), bad.clone(), bad])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope"), "{e}");
    }
}

/// The names a builder creates, sorted.
fn names(map: &VarMap) -> Vec<String> {
    let mut n: Vec<String> = map.data().lock().unwrap().keys().cloned().collect();
    n.sort();
    n
}

#[test]
fn modules_have_candle_nn_names_values_and_gradients() {
    let x = values(&X, 0, DType::F32);
    let configs = [
        candle_nn::LayerNormConfig::from(1e-5),
        candle_nn::LayerNormConfig {
            eps: 1e-6,
            remove_mean: true,
            affine: false,
        },
        candle_nn::LayerNormConfig {
            eps: 1e-6,
            remove_mean: false,
            affine: true,
        },
    ];
    for cfg in configs {
        let what = format!("{cfg:?}");
        let ours_map = VarMap::new();
        let vb = VarBuilder::from_varmap(&ours_map, DType::F32, &Device::Cpu);
        let ours = nn::layer_norm(8, cfg, vb.pp("ln")).unwrap();
        let their_map = VarMap::new();
        let tvb = VarBuilder::from_varmap(&their_map, DType::F32, &Device::Cpu);
        candle_nn::layer_norm(8, cfg, tvb.pp("ln")).unwrap();
        assert_eq!(names(&ours_map), names(&their_map), "{what}");
        // Non-default parameters; candle-nn's module reads the same vars.
        for (i, (_, v)) in ours_map.data().lock().unwrap().iter().enumerate() {
            v.set(&values(&[8], 10 + i, DType::F32)).unwrap();
        }
        let theirs = candle_nn::layer_norm(8, cfg, vb.pp("ln")).unwrap();
        let y = ours.forward(&x).unwrap();
        close(&y, &theirs.forward(&x).unwrap(), 1e-5, &what);
        // Value and gradients (input and every parameter) against the primitive
        // composition on copies of the same values.
        let c = values(&X, 99, DType::F32);
        let xv = Var::from_tensor(&x).unwrap();
        let loss = (ours.forward(xv.as_tensor()).unwrap() * &c).unwrap();
        let grads = loss.sum_all().unwrap().backward().unwrap();
        let wv = Var::from_tensor(ours.weight()).unwrap();
        let bv = ours.bias().map(|b| Var::from_tensor(b).unwrap());
        let xr = Var::from_tensor(&x).unwrap();
        let eps = cfg.eps as f32;
        let yr = match (cfg.remove_mean, &bv) {
            (true, Some(b)) => {
                candle_nn::ops::layer_norm_slow(xr.as_tensor(), wv.as_tensor(), b.as_tensor(), eps)
            }
            (true, None) => {
                let zeros = wv.as_tensor().zeros_like().unwrap();
                candle_nn::ops::layer_norm_slow(xr.as_tensor(), wv.as_tensor(), &zeros, eps)
            }
            (false, b) => {
                let y = candle_nn::ops::rms_norm_slow(xr.as_tensor(), wv.as_tensor(), eps).unwrap();
                match b {
                    Some(b) => y.broadcast_add(b.as_tensor()),
                    None => Ok(y),
                }
            }
        }
        .unwrap();
        close(&y, &yr, 1e-5, &format!("{what}: value vs composition"));
        let gr = (&yr * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let pairs = [
            (grads.get(xv.as_tensor()), gr.get(xr.as_tensor()), "x"),
            (grads.get(ours.weight()), gr.get(wv.as_tensor()), "weight"),
        ];
        for (a, b, n) in pairs {
            close(
                a.unwrap(),
                b.unwrap(),
                1e-5,
                &format!("{what}: gradient of {n}"),
            );
        }
        if let (Some(b), Some(bv)) = (ours.bias(), &bv) {
            let (a, w) = (grads.get(b).unwrap(), gr.get(bv.as_tensor()).unwrap());
            close(a, w, 1e-5, &format!("{what}: gradient of bias"));
        }
    }
    let ours_map = VarMap::new();
    let vb = VarBuilder::from_varmap(&ours_map, DType::F32, &Device::Cpu);
    let ours = nn::rms_norm(8, 1e-6, vb.pp("norm")).unwrap();
    let their_map = VarMap::new();
    let tvb = VarBuilder::from_varmap(&their_map, DType::F32, &Device::Cpu);
    candle_nn::rms_norm(8, 1e-6, tvb.pp("norm")).unwrap();
    assert_eq!(names(&ours_map), names(&their_map));
    let theirs = candle_nn::rms_norm(8, 1e-6, vb.pp("norm")).unwrap();
    close(
        &ours.forward(&x).unwrap(),
        &theirs.forward(&x).unwrap(),
        1e-5,
        "rms_norm module",
    );
    let xv = Var::from_tensor(&x).unwrap();
    // The gradients of the sum of a module's output on `xv`.
    let grads_of = |m: &dyn Module| {
        let y = m.forward(xv.as_tensor()).unwrap();
        y.sum_all().unwrap().backward().unwrap()
    };
    let g = grads_of(&ours);
    assert!(g.get(xv.as_tensor()).is_some() && g.get(ours.weight()).is_some());
    let g = grads_of(&theirs);
    assert!(
        g.get(xv.as_tensor()).is_none() && g.get(theirs.weight()).is_none(),
        "candle-nn's RmsNorm now has a backward"
    );
}
