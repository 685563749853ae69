//! Fused regions (linear, attention core) match candle's own ops, forward and backward.
mod common;

use candle_core::{Device, Tensor, Var};
use candle_dtensor_kernels::{autodiff::reference, region};
use common::{check, close};

const TOL: f32 = 2e-5;

fn randn(shape: &[usize]) -> Tensor {
    common::randn(shape, 1.0)
}

#[test]
fn linear_matches() {
    for xs in [vec![5, 7], vec![2, 3, 7]] {
        let (x, w, b) = (randn(&xs), randn(&[4, 7]), randn(&[4]));
        check(
            "linear+bias",
            &[x.clone(), w.clone(), b],
            &|t| region::linear(&t[0], &t[1], Some(&t[2])),
            &|t| t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2]),
            TOL,
        );
        check(
            "linear",
            &[x, w],
            &|t| region::linear(&t[0], &t[1], None),
            &|t| t[0].broadcast_matmul(&t[1].t()?),
            TOL,
        );
    }
    // A transposed (non-contiguous) input.
    let x = randn(&[7, 5]).t().unwrap();
    check(
        "linear (transposed x)",
        &[x, randn(&[3, 7])],
        &|t| region::linear(&t[0], &t[1], None),
        &|t| t[0].matmul(&t[1].t()?),
        TOL,
    );
}

/// The CPU linear with a bias (one gemm accumulating into rows that start as the bias) against
/// the matmul-then-add composition, forward and every gradient: one output, a sum long enough
/// for gemm to split it into blocks, 3-D inputs, a strided weight (which takes the plain path),
/// and empty operands.
#[test]
fn linear_bias_matches_on_the_cpu() {
    let composed = |t: &[Tensor]| t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2]);
    // Empty operands take the plain path (`linear_applies`; `fused::linear_bias`'s own empty
    // cases are unit-tested beside it). Forward only: candle's backward gives an empty
    // operand no gradient, the composition's included.
    for (xs, out) in [(vec![0, 7], 4), (vec![5, 0], 4)] {
        let inner = *xs.last().unwrap();
        let (x, w, b) = (randn(&xs), randn(&[out, inner]), randn(&[out]));
        // Tracked, as in training (the one-node path applies to tracked inputs).
        let v = |t: &Tensor| Var::from_tensor(t).unwrap().as_tensor().clone();
        let y = region::linear(&v(&x), &v(&w), Some(&v(&b))).unwrap();
        let want = composed(&[x, w, b]).unwrap();
        assert_eq!(y.dims(), want.dims());
        close(&y, &want, 0.0, &format!("linear+bias {xs:?} -> {out}"));
    }
    for (xs, out) in [
        (vec![5, 7], 1),
        (vec![3, 1300], 9),
        (vec![2, 3, 33], 17),
        (vec![1, 1], 1),
    ] {
        let inner = *xs.last().unwrap();
        let (x, w, b) = (randn(&xs), randn(&[out, inner]), randn(&[out]));
        check(
            &format!("linear+bias {xs:?} -> {out}"),
            &[x, w, b],
            &|t| region::linear(&t[0], &t[1], Some(&t[2])),
            &composed,
            TOL,
        );
    }
    // Exactly the bias where the sum is empty.
    let b = randn(&[4]);
    let y = region::linear(&randn(&[3, 0]), &randn(&[4, 0]), Some(&b)).unwrap();
    close(
        &y,
        &b.unsqueeze(0).unwrap().repeat((3, 1)).unwrap(),
        0.0,
        "empty sum",
    );
    // A strided weight.
    let w = randn(&[7, 4]).t().unwrap();
    check(
        "linear+bias (transposed w)",
        &[randn(&[5, 7]), w, randn(&[4])],
        &|t| region::linear(&t[0], &t[1], Some(&t[2])),
        &composed,
        TOL,
    );
}

/// The mixed-precision linear (bf16 operands, f32 output and bias) as one node gives what the
/// plain composition (casts around the bf16 product, the bias added in f32) gives, forward and
/// every gradient; where it does not apply it is that composition.
#[test]
fn linear_in_matches_the_cast_composition() {
    use candle_core::DType;
    let plain = |t: &[Tensor], bias: bool| -> candle_core::Result<Tensor> {
        let y = t[0]
            .to_dtype(DType::BF16)?
            .broadcast_matmul(&t[1].to_dtype(DType::BF16)?.t()?)?
            .to_dtype(DType::F32)?;
        if bias {
            y.broadcast_add(&t[2])
        } else {
            Ok(y)
        }
    };
    for xs in [vec![5, 7], vec![2, 3, 7], vec![1, 4, 33]] {
        let inner = xs[xs.len() - 1];
        let (x, w, b) = (randn(&xs), randn(&[6, inner]), randn(&[6]));
        assert!(region::linear_in_applies(
            &Var::from_tensor(&x).unwrap(),
            &w,
            None,
            DType::BF16
        ));
        check(
            &format!("linear_in+bias {xs:?}"),
            &[x.clone(), w.clone(), b],
            &|t| region::linear_in(&t[0], &t[1], Some(&t[2]), DType::BF16),
            &|t| plain(t, true),
            1e-6,
        );
        check(
            &format!("linear_in {xs:?}"),
            &[x, w],
            &|t| region::linear_in(&t[0], &t[1], None, DType::BF16),
            &|t| plain(t, false),
            1e-6,
        );
    }
    // Not applicable: untracked inputs, a compute dtype equal to x's, inside a splittable
    // forward (whose linears defer their weight gradients).
    let (x, w) = (randn(&[3, 4]), randn(&[2, 4]));
    assert!(!region::linear_in_applies(&x, &w, None, DType::BF16));
    let xv = Var::from_tensor(&x).unwrap();
    assert!(!region::linear_in_applies(&xv, &w, None, DType::F32));
    assert!(!region::splittable_forward(|| region::linear_in_applies(
        &xv,
        &w,
        None,
        DType::BF16
    )));
    let y = region::linear_in(&x, &w, None, DType::BF16).unwrap();
    let want = plain(&[x, w], false).unwrap();
    close(&y, &want, 0.0, "linear_in (plain)");
}

/// The linear of bf16 activations (`linear_to`: x in bf16 or f32, w and b f32, the output in
/// bf16 or f32) as one node gives what the plain composition gives (casts around the bf16
/// product, the bias added in f32, the sum rounded once to the output's dtype), forward and
/// every gradient; where it does not apply it is that composition.
#[test]
fn linear_to_matches_the_cast_composition() {
    use candle_core::DType;
    const BF: DType = DType::BF16;
    let plain = |x: &Tensor, w: &Tensor, b: Option<&Tensor>, out: DType| {
        let y = x
            .to_dtype(BF)?
            .broadcast_matmul(&w.to_dtype(BF)?.t()?)?
            .to_dtype(DType::F32)?;
        let y = match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        y.to_dtype(out)
    };
    // The weight in f32 (master weights) or already in bf16 (FSDP's gathered parameters,
    // taken as they are, with an f32 bias).
    let cases = [
        (BF, DType::F32, DType::F32),
        (DType::F32, BF, DType::F32),
        (BF, BF, DType::F32),
        (DType::F32, DType::F32, DType::F32),
        (DType::F32, DType::F32, BF),
        (BF, DType::F32, BF),
        (DType::F32, BF, BF),
        (BF, BF, BF),
    ];
    for (x_dt, out, w_dt) in cases {
        for xs in [vec![5, 7], vec![2, 3, 7], vec![1, 4, 33]] {
            let inner = xs[xs.len() - 1];
            let (x, w, b) = (randn(&xs), randn(&[6, inner]), randn(&[6]));
            let what = format!("linear_to x {x_dt:?} w {w_dt:?} -> {out:?} {xs:?}");
            check(
                &format!("{what} +bias"),
                &[x.clone(), w.clone(), b],
                &|t| {
                    let (x, w) = (t[0].to_dtype(x_dt)?, t[1].to_dtype(w_dt)?);
                    region::linear_to(&x, &w, Some(&t[2]), BF, out)?.to_dtype(DType::F32)
                },
                &|t| {
                    let (x, w) = (t[0].to_dtype(x_dt)?, t[1].to_dtype(w_dt)?);
                    plain(&x, &w, Some(&t[2]), out)?.to_dtype(DType::F32)
                },
                1e-6,
            );
            check(
                &what,
                &[x, w],
                &|t| {
                    let (x, w) = (t[0].to_dtype(x_dt)?, t[1].to_dtype(w_dt)?);
                    region::linear_to(&x, &w, None, BF, out)?.to_dtype(DType::F32)
                },
                &|t| {
                    let (x, w) = (t[0].to_dtype(x_dt)?, t[1].to_dtype(w_dt)?);
                    plain(&x, &w, None, out)?.to_dtype(DType::F32)
                },
                1e-6,
            );
        }
    }
    // The node applies to a bf16 x with f32 weights; to a weight already in the compute dtype
    // only where x or the output is not (then with a bias of any float dtype); not to a bias in
    // another dtype than an f32 weight's.
    let (x, w, b) = (randn(&[3, 4]), randn(&[2, 4]), randn(&[2]));
    let xv = Var::from_tensor(&x).unwrap();
    let xb = xv.to_dtype(BF).unwrap();
    let wb = w.to_dtype(BF).unwrap();
    assert!(region::linear_to_applies(&xb, &w, Some(&b), BF, BF));
    assert!(!region::linear_to_applies(&xb, &wb, None, BF, BF));
    assert!(region::linear_to_applies(&xb, &wb, Some(&b), BF, BF));
    assert!(!region::linear_to_applies(
        &xb,
        &wb,
        Some(&b.to_dtype(BF).unwrap()),
        BF,
        BF
    ));
    assert!(region::linear_to_applies(
        &xb,
        &wb,
        Some(&b),
        BF,
        DType::F32
    ));
    assert!(region::linear_to_applies(&xv, &wb, Some(&b), BF, BF));
    assert!(!region::linear_to_applies(
        &xv,
        &w,
        Some(&b.to_dtype(BF).unwrap()),
        BF,
        BF
    ));
    // FSDP's case as one node: a bf16 activation in, a bf16 weight as it is, the f32 output.
    let _ = region::take_linear_in_nodes();
    let y = region::linear_to(&xb, &wb, Some(&b), BF, DType::F32).unwrap();
    assert_eq!((region::take_linear_in_nodes(), y.dtype()), (1, DType::F32));
    // Not applicable (untracked): the composition.
    let y = region::linear_to(&x.to_dtype(BF).unwrap(), &w, Some(&b), BF, BF).unwrap();
    let want = plain(&x.to_dtype(BF).unwrap(), &w, Some(&b), BF).unwrap();
    close(
        &y.to_dtype(DType::F32).unwrap(),
        &want.to_dtype(DType::F32).unwrap(),
        0.0,
        "linear_to (plain)",
    );
}

/// A linear and its GELU as one node (`linear_gelu`, `linear_gelu_to`) give exactly what the
/// linear node followed by the fused GELU gives, forward and every gradient (tolerance 0: a
/// zero gradient may differ only in sign, which `==` ignores), for each dtype case of the
/// model's MLP (f32; a bf16 GEMM with an f32 or a bf16 output; a bf16 input), with and without
/// a bias, 2-D and 3-D; the graph holds one node fewer (no pre-activation); and where the node
/// does not apply (untracked operands) it is that pair.
#[test]
fn linear_gelu_is_the_linear_then_gelu_in_one_node() {
    use candle_core::DType;
    use candle_dtensor_kernels::fused::gelu;
    const BF: DType = DType::BF16;
    const F32: DType = DType::F32;
    type F = Box<dyn Fn(&[Tensor], bool) -> candle_core::Result<Tensor>>;
    // (name, op(inputs, with bias)): the fused op if `fused`, else the pair.
    let op = |fused: bool, case: &'static str| -> F {
        Box::new(move |t: &[Tensor], bias: bool| {
            let b = if bias { Some(&t[2]) } else { None };
            let y = match (case, fused) {
                ("f32", true) => region::linear_gelu(&t[0], &t[1], b)?,
                ("f32", false) => gelu(&region::linear(&t[0], &t[1], b)?)?,
                ("bf16 gemm -> f32", true) => region::linear_gelu_to(&t[0], &t[1], b, BF, F32)?,
                ("bf16 gemm -> f32", false) => gelu(&region::linear_to(&t[0], &t[1], b, BF, F32)?)?,
                ("bf16 gemm -> bf16", true) => region::linear_gelu_to(&t[0], &t[1], b, BF, BF)?,
                ("bf16 gemm -> bf16", false) => gelu(&region::linear_to(&t[0], &t[1], b, BF, BF)?)?,
                (_, true) => region::linear_gelu_to(&t[0].to_dtype(BF)?, &t[1], b, BF, BF)?,
                (_, false) => gelu(&region::linear_to(&t[0].to_dtype(BF)?, &t[1], b, BF, BF)?)?,
            };
            y.to_dtype(F32)
        })
    };
    for case in ["f32", "bf16 gemm -> f32", "bf16 gemm -> bf16", "bf16 x"] {
        let (fused, pair) = (op(true, case), op(false, case));
        for xs in [vec![5, 7], vec![2, 3, 7]] {
            let (x, w, b) = (randn(&xs), randn(&[6, 7]), randn(&[6]));
            for bias in [true, false] {
                let inputs = if bias {
                    vec![x.clone(), w.clone(), b.clone()]
                } else {
                    vec![x.clone(), w.clone()]
                };
                check(
                    &format!("linear_gelu {case} {xs:?} bias {bias}"),
                    &inputs,
                    &|t| fused(t, bias),
                    &|t| pair(t, bias),
                    0.0,
                );
            }
            // Fewer nodes: the pre-activation is not in the graph (and on the CPU a bf16
            // GELU's casts to and from its f32 kernel are not either).
            let vars: Vec<Var> = [&x, &w, &b]
                .iter()
                .map(|t| Var::from_tensor(t).unwrap())
                .collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let nodes = |f: &F| {
                f(&ts, true)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .sorted_nodes()
                    .len()
            };
            let fewer = if case.ends_with("f32") { 1 } else { 3 };
            assert_eq!(
                nodes(&fused) + fewer,
                nodes(&pair),
                "{case} {xs:?}: the fused graph should lack the pre-activation"
            );
        }
    }
    // Untracked operands: no node, the pair's values.
    let (x, w, b) = (randn(&[4, 5]), randn(&[3, 5]), randn(&[3]));
    let fused = region::linear_gelu(&x, &w, Some(&b)).unwrap();
    let pair = gelu(&region::linear(&x, &w, Some(&b)).unwrap()).unwrap();
    close(&fused, &pair, 0.0, "untracked linear_gelu");
}

#[test]
fn sdpa_matches() {
    for causal in [false, true] {
        for (t, s) in [(6, 6), (3, 5)] {
            let (q, k, v) = (
                randn(&[2, 3, t, 4]),
                randn(&[2, 3, s, 4]),
                randn(&[2, 3, s, 5]),
            );
            check(
                &format!("sdpa causal={causal} t={t} s={s}"),
                &[q, k, v],
                &|x| region::sdpa(&x[0], &x[1], &x[2], causal, 0.5),
                &|x| reference::sdpa(&x[0], &x[1], &x[2], causal, 0.5),
                TOL,
            );
        }
    }
}

#[test]
fn packed_sdpa_on_the_flat_projection_matches() {
    use candle_dtensor_kernels::autodiff::packed_sdpa_local_flat;
    for causal in [false, true] {
        // [B, T, 3 H d] with H = 3 heads of d = 4.
        check(
            &format!("packed_sdpa_local_flat causal={causal}"),
            &[randn(&[2, 5, 36])],
            &|x| packed_sdpa_local_flat(&x[0], 3, causal, 0.5),
            &|x| {
                reference::packed_sdpa(&x[0].reshape((2, 5, 3, 3, 4))?, causal, 0.5)?
                    .reshape((2, 5, 12))
            },
            TOL,
        );
    }
    // A width that is not 3 heads of whole head dims, no heads, another rank: typed errors.
    let x = randn(&[2, 5, 36]);
    for (x, heads) in [(&x, 5), (&x, 0), (&randn(&[5, 36]), 3)] {
        let e = packed_sdpa_local_flat(x, heads, true, 0.5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("packed_sdpa_flat") && e.contains("heads"), "{e}");
    }
}

/// The packed attention kernel against the reference composition, forward and every gradient,
/// on both layouts: one token, sequences shorter than, equal to and past one or two blocks of
/// 64 queries (uneven), one and several heads and batches, head dims 1 to 32, causal or not,
/// and a scale other than 1/sqrt(d).
///
/// Tolerance 5e-5 (the file's is 2e-5): the inputs are random on every run, and the kernel and
/// the reference add the same f32 terms in different orders, an input gradient summing over up
/// to 130 keys and 32 dims; a CI rehearsal of 2026-12-07 saw 2.02e-5 there (a gradient of -0.012
/// from terms of order one). A wrong mask, scale or block boundary is off by 1e-2 or more.
#[test]
fn packed_sdpa_matches_the_reference_across_blocks_heads_and_dims() {
    use candle_dtensor_kernels::autodiff::packed_sdpa_local_flat;
    const TOL: f32 = 5e-5;
    for (b, t, h, d) in [
        (1, 1, 1, 1),
        (2, 5, 3, 4),
        (1, 64, 2, 8),
        (2, 65, 1, 5),
        (1, 130, 2, 32),
        (3, 7, 5, 2),
    ] {
        for causal in [false, true] {
            let what = format!("b {b} t {t} h {h} d {d} causal {causal}");
            let x = common::randn(&[b, t, h, 3, d], 1.5);
            check(
                &format!("packed_sdpa {what}"),
                std::slice::from_ref(&x),
                &|x| region::packed_sdpa(&x[0], causal, 0.3),
                &|x| reference::packed_sdpa(&x[0], causal, 0.3),
                TOL,
            );
            check(
                &format!("packed_sdpa_local_flat {what}"),
                &[x.reshape((b, t, 3 * h * d)).unwrap()],
                &|x| packed_sdpa_local_flat(&x[0], h, causal, 0.3),
                &|x| {
                    reference::packed_sdpa(&x[0].reshape((b, t, h, 3, d))?, causal, 0.3)?.reshape((
                        b,
                        t,
                        h * d,
                    ))
                },
                TOL,
            );
        }
    }
    // An input that tracks no gradient (the node is skipped): the same values.
    let x = randn(&[2, 70, 3, 3, 4]);
    let y = region::packed_sdpa(&x, true, 0.5).unwrap();
    let r = reference::packed_sdpa(&x, true, 0.5).unwrap();
    close(&y, &r, TOL, "untracked packed_sdpa");
}

/// Empty pieces (no tokens, no batch, head dim 0) give empty or zero results of the right
/// shape, and a scale that is not positive takes the reference path (the kernel's softmax
/// needs `scale > 0`).
#[test]
fn packed_sdpa_handles_empty_shapes_and_non_positive_scales() {
    for dims in [[0usize, 4, 2, 3, 4], [2, 0, 2, 3, 4], [2, 4, 2, 3, 0]] {
        let x = Tensor::zeros(&dims, candle_core::DType::F32, &Device::Cpu).unwrap();
        let y = region::packed_sdpa(&x, true, 0.5).unwrap();
        assert_eq!(y.dims(), &[dims[0], dims[1], dims[2], dims[4]]);
    }
    let x = randn(&[2, 6, 2, 3, 4]);
    for scale in [-0.5f32, 0.0] {
        let y = region::packed_sdpa(&x, true, scale).unwrap();
        let r = reference::packed_sdpa(&x, true, f64::from(scale)).unwrap();
        close(&y, &r, TOL, &format!("packed_sdpa scale {scale}"));
    }
}

#[test]
fn add_rows_matches_broadcast_add() {
    use candle_dtensor_kernels::fused;
    // (x shape, b shape): a bias, a position table, the swapped order, a scalar-like row and an
    // equal-shape add (not fused).
    let cases: [(&[usize], &[usize]); 5] = [
        (&[6, 5], &[5]),
        (&[2, 3, 4], &[3, 4]),
        (&[4], &[3, 4]),
        (&[3, 1], &[1]),
        (&[2, 3], &[2, 3]),
    ];
    for (xs, bs) in cases {
        check(
            &format!("add {xs:?} + {bs:?}"),
            &[randn(xs), randn(bs)],
            &|t| fused::add(&t[0], &t[1]),
            &|t| t[0].broadcast_add(&t[1]),
            TOL,
        );
    }
    // A transposed input and an untracked bias.
    let x = Var::from_tensor(&randn(&[5, 4]).t().unwrap()).unwrap();
    let b = randn(&[5]);
    let y = fused::add(x.as_tensor(), &b).unwrap();
    close(
        &y,
        &x.as_tensor().broadcast_add(&b).unwrap(),
        TOL,
        "transposed x",
    );
    let g = y.sum_all().unwrap().backward().unwrap();
    close(
        g.get(&x).unwrap(),
        &Tensor::ones((4, 5), candle_core::DType::F32, &Device::Cpu).unwrap(),
        TOL,
        "transposed x grad",
    );
}

#[test]
fn row_sum_matches_candle() {
    use candle_dtensor_kernels::fused;
    for (rows, n) in [(1, 7), (9, 3), (128, 64), (0, 4)] {
        let g = randn(&[rows, n]);
        close(
            &fused::row_sum(&g, n).unwrap(),
            &g.sum(0).unwrap(),
            TOL,
            &format!("row_sum {rows}x{n}"),
        );
    }
}

/// The reference gradients of `sum(r * (x @ w'^T + b))` with `w' = w * scale`, from candle's
/// own ops: (dx, dw, db).
fn linear_reference(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor, scale: f64) -> [Tensor; 3] {
    let (x, w, b) = (
        Var::from_tensor(x).unwrap(),
        Var::from_tensor(w).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let wc = w.as_tensor().affine(scale, 0.0).unwrap();
    let y = x
        .as_tensor()
        .broadcast_matmul(&wc.t().unwrap())
        .unwrap()
        .broadcast_add(b.as_tensor())
        .unwrap();
    let store = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
    [x, w, b].map(|v| store.get(v.as_tensor()).unwrap().clone())
}

#[test]
fn deferred_weight_grads_are_the_backwards_dw() {
    let (x0, w0, b0, r) = (
        randn(&[2, 3, 7]),
        randn(&[4, 7]),
        randn(&[4]),
        randn(&[2, 3, 4]),
    );
    // scale 1: the weight is the variable itself; scale 2: a computed weight (as a cast
    // parameter is), whose gradient reaches the variable through a backward of sum(w' * dW).
    for scale in [1.0, 2.0] {
        let [dx_ref, dw_ref, db_ref] = linear_reference(&x0, &w0, &b0, &r, scale);
        let (x, w, b) = (
            Var::from_tensor(&x0).unwrap(),
            Var::from_tensor(&w0).unwrap(),
            Var::from_tensor(&b0).unwrap(),
        );
        let wc = if scale == 1.0 {
            w.as_tensor().clone()
        } else {
            w.as_tensor().affine(scale, 0.0).unwrap()
        };
        let y =
            region::splittable_forward(|| region::linear(x.as_tensor(), &wc, Some(b.as_tensor())))
                .unwrap();
        let loss = (y * &r).unwrap().sum_all().unwrap();
        let (store, deferred) = region::defer_weight_grads(|| loss.backward());
        let store = store.unwrap();
        close(
            store.get(x.as_tensor()).unwrap(),
            &dx_ref,
            TOL,
            "dx under deferral",
        );
        close(
            store.get(b.as_tensor()).unwrap(),
            &db_ref,
            TOL,
            "db under deferral",
        );
        match store.get(w.as_tensor()) {
            // A variable weight gets nothing in the input-gradient pass.
            None => assert_eq!(scale, 1.0, "a computed weight must get zeros"),
            // A computed one gets zeros (candle's backward needs a gradient on every node).
            Some(g) => {
                assert_eq!(scale, 2.0, "a variable weight must get no gradient");
                let zero = g
                    .abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(zero, 0.0, "the deferred weight got a non-zero gradient");
            }
        }
        assert_eq!(
            deferred.len(),
            1,
            "one linear, one deferred weight gradient"
        );
        let d = &deferred[0];
        assert_eq!(
            d.weight().id(),
            wc.id(),
            "the deferred weight is the node's"
        );
        let dw = d.grad().unwrap();
        if scale == 1.0 {
            close(&dw, &dw_ref, TOL, "deferred dW");
        } else {
            let through = (d.weight() * &dw)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            close(
                through.get(w.as_tensor()).unwrap(),
                &dw_ref,
                TOL,
                "deferred dW through the computed weight's graph",
            );
        }
    }
}

#[test]
fn deferral_scopes_nest_and_end_even_on_panic() {
    let (x0, w0) = (randn(&[5, 7]), randn(&[4, 7]));
    let run = || {
        let (x, w) = (
            Var::from_tensor(&x0).unwrap(),
            Var::from_tensor(&w0).unwrap(),
        );
        let y = region::linear(x.as_tensor(), w.as_tensor(), None).unwrap();
        (w, y.sum_all().unwrap())
    };
    // Nested: the inner scope takes its own backward's deferral, the outer keeps its own.
    let (outer_w, outer_loss) = run();
    let ((), outer) = region::defer_weight_grads(|| {
        let (_, inner_loss) = run();
        let (_, inner) = region::defer_weight_grads(|| inner_loss.backward().unwrap());
        assert_eq!(inner.len(), 1, "the inner scope's own deferral");
        let store = outer_loss.backward().unwrap();
        assert!(
            store.get(outer_w.as_tensor()).is_none(),
            "deferred in the outer scope"
        );
    });
    assert_eq!(
        outer.len(),
        1,
        "the outer scope's own deferral, not the inner's"
    );
    // A panic inside a scope ends it: the next backward computes dW in place.
    let caught = std::panic::catch_unwind(|| {
        region::defer_weight_grads(|| panic!("inside the scope"));
    });
    assert!(caught.is_err());
    let (w, loss) = run();
    let store = loss.backward().unwrap();
    assert!(
        store.get(w.as_tensor()).is_some(),
        "a scope left by a panic still deferred the weight gradient"
    );
}

/// Under `recast_weights` the mixed-precision node keeps no cast of its weight: the backward
/// casts the weight operand as its storage holds it then. FSDP releases a gathered weight after
/// the forward and refills it before the backward; here the refill puts other values in, so
/// the input gradient shows which weight the backward multiplied by: the kept cast (the old
/// values) without recast, the refilled values with it. The weight and bias gradients do not
/// depend on the weight and are the same either way; the output is made in the forward.
#[test]
fn recast_weights_casts_the_weight_again_in_the_backward() {
    use candle_core::DType;
    use candle_dtensor_kernels::storage;
    const BF: DType = DType::BF16;
    let (x, w_a, w_b, b) = (
        randn(&[2, 5, 7]),
        randn(&[6, 7]),
        randn(&[6, 7]),
        randn(&[6]),
    );
    // One device's input gradient of sum(x W^T + b) with the bf16 product, for weight `w`.
    let dx_for = |w: &Tensor| {
        let xv = Var::from_tensor(&x).unwrap();
        let y = xv
            .to_dtype(BF)
            .unwrap()
            .broadcast_matmul(&w.to_dtype(BF).unwrap().t().unwrap())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        g.get(&xv).unwrap().clone()
    };
    let (dx_a, dx_b) = (dx_for(&w_a), dx_for(&w_b));
    let mut others = Vec::new();
    for recast in [false, true] {
        let xv = Var::from_tensor(&x).unwrap();
        let wv = Var::from_tensor(&w_a).unwrap();
        let bv = Var::from_tensor(&b).unwrap();
        let _ = region::take_linear_in_nodes();
        let y = region::recast_weights(recast, || {
            region::linear_in(xv.as_tensor(), wv.as_tensor(), Some(bv.as_tensor()), BF)
        })
        .unwrap();
        assert_eq!(
            region::take_linear_in_nodes(),
            1,
            "recast {recast}: one node"
        );
        storage::release(wv.as_tensor(), "w").unwrap();
        storage::refill(wv.as_tensor(), &w_b).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        let dx = g.get(&xv).unwrap();
        let want = if recast { &dx_b } else { &dx_a };
        close(dx, want, 1e-6, &format!("recast {recast}: dx"));
        others.push((g.get(&wv).unwrap().clone(), g.get(&bv).unwrap().clone()));
    }
    close(&others[1].0, &others[0].0, 0.0, "dw");
    close(&others[1].1, &others[0].1, 0.0, "db");
    // The setting is scoped: outside it the node keeps its cast again.
    let xv = Var::from_tensor(&x).unwrap();
    let wv = Var::from_tensor(&w_a).unwrap();
    let y = region::linear_in(xv.as_tensor(), wv.as_tensor(), None, BF).unwrap();
    storage::refill(wv.as_tensor(), &w_b).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    close(g.get(&xv).unwrap(), &dx_a, 1e-6, "after the scope: dx");
}
