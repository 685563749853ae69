//! Fused regions (linear, attention core) match candle's own ops, forward and backward.
use candle_core::{Device, Tensor, Var};
use candle_dtensor_kernels::{nn::reference, region};

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap()
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

fn grads(
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Tensor,
    seed: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let g = y.mul(seed).unwrap().sum_all().unwrap().backward().unwrap();
    (y, vars.iter().map(|v| g.get(v).unwrap().clone()).collect())
}

fn check(
    name: &str,
    inputs: &[Tensor],
    fast: &dyn Fn(&[Tensor]) -> Tensor,
    slow: &dyn Fn(&[Tensor]) -> Tensor,
) {
    let seed = randn(slow(inputs).dims());
    let (ya, ga) = grads(inputs, fast, &seed);
    let (yb, gb) = grads(inputs, slow, &seed);
    close(&ya, &yb, &format!("{name} forward"));
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        close(a, b, &format!("{name} grad {i}"));
    }
}

#[test]
fn linear_matches() {
    for xs in [vec![5, 7], vec![2, 3, 7]] {
        let (x, w, b) = (randn(&xs), randn(&[4, 7]), randn(&[4]));
        check(
            "linear+bias",
            &[x.clone(), w.clone(), b],
            &|t| region::linear(&t[0], &t[1], Some(&t[2])).unwrap(),
            &|t| {
                t[0].broadcast_matmul(&t[1].t().unwrap())
                    .unwrap()
                    .broadcast_add(&t[2])
                    .unwrap()
            },
        );
        check(
            "linear",
            &[x, w],
            &|t| region::linear(&t[0], &t[1], None).unwrap(),
            &|t| t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap(),
        );
    }
    // A transposed (non-contiguous) input.
    let x = randn(&[7, 5]).t().unwrap();
    check(
        "linear (transposed x)",
        &[x, randn(&[3, 7])],
        &|t| region::linear(&t[0], &t[1], None).unwrap(),
        &|t| t[0].matmul(&t[1].t().unwrap()).unwrap(),
    );
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
                &|x| region::sdpa(&x[0], &x[1], &x[2], causal, 0.5).unwrap(),
                &|x| reference::sdpa(&x[0], &x[1], &x[2], causal, 0.5).unwrap(),
            );
        }
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
            &|t| fused::add(&t[0], &t[1]).unwrap(),
            &|t| t[0].broadcast_add(&t[1]).unwrap(),
        );
    }
    // A transposed input and an untracked bias.
    let x = Var::from_tensor(&randn(&[5, 4]).t().unwrap()).unwrap();
    let b = randn(&[5]);
    let y = fused::add(x.as_tensor(), &b).unwrap();
    close(
        &y,
        &x.as_tensor().broadcast_add(&b).unwrap(),
        "transposed x",
    );
    let g = y.sum_all().unwrap().backward().unwrap();
    close(
        g.get(&x).unwrap(),
        &Tensor::ones((4, 5), candle_core::DType::F32, &Device::Cpu).unwrap(),
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
            &format!("row_sum {rows}x{n}"),
        );
    }
}
