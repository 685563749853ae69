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
