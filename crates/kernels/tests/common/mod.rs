//! Helpers of the fused-kernel and region tests: random inputs, an elementwise comparison, and
//! a fast implementation checked against its reference forward and backward.

use candle_core::{Device, Tensor, Var};

/// A fallible op on a list of inputs, as the tests write them.
pub type Op<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// Standard normal f32 values of `shape` on the CPU, times `scale`.
pub fn randn(shape: &[usize], scale: f64) -> Tensor {
    (Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap() * scale).unwrap()
}

/// Asserts that `a` and `b` have the same elements within `tol * (1 + |b|)`.
pub fn close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: fast {x} vs reference {y}"
        );
    }
}

/// Runs `f` forward and backward (against the upstream gradient `seed`) on fresh vars made from
/// `inputs` and returns the output and the input gradients.
fn run(inputs: &[Tensor], f: Op, seed: &Tensor) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts).unwrap();
    let g = y.mul(seed).unwrap().sum_all().unwrap().backward().unwrap();
    (y, vars.iter().map(|v| g.get(v).unwrap().clone()).collect())
}

/// Checks `fast` against the reference `slow` on `inputs`: outputs and input gradients (for
/// one random upstream gradient) within `tol`.
pub fn check(name: &str, inputs: &[Tensor], fast: Op, slow: Op, tol: f32) {
    let y = slow(inputs).unwrap();
    let seed = randn(y.dims(), 1.0);
    let (ya, ga) = run(inputs, fast, &seed);
    let (yb, gb) = run(inputs, slow, &seed);
    close(&ya, &yb, tol, &format!("{name} forward"));
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        close(a, b, tol, &format!("{name} grad {i}"));
    }
}

/// The f32 elements of `t` as bits (row-major), for comparisons to the bit.
#[allow(dead_code)] // not every test binary compares bits
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}
