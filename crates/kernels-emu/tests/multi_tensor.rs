//! The multi-tensor kernels of `crates/kernels/cuda/multi_tensor.cu` under the emulator: the
//! global gradient norm and clip coefficient against an f64 sum, and the one-launch AdamW step
//! bit for bit against `multi_tensor::adamw_reference` (itself bitwise candle-nn's AdamW), over
//! tables of tensors of odd and empty lengths with chunks that cross tensor boundaries, under
//! every fiber order.
mod common;
use candle_dtensor_kernels::multi_tensor::{adamw_reference, AdamWStep};
use candle_dtensor_kernels_emu::multi::{self, SumsqDt};
use candle_dtensor_kernels_emu::{same_bits, Buf, ORDERS};
use common::values;
use half::bf16;

const LENS: [usize; 7] = [5, 0, 1000, 33, 0, 4097, 1];

fn norm_case<T: SumsqDt>() {
    let data: Vec<Vec<T>> = LENS
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            values(n, 3.0, i as u64 + 1)
                .iter()
                .map(|&x| T::from_f32(x))
                .collect()
        })
        .collect();
    let want: f64 = data
        .iter()
        .flatten()
        .map(|x| f64::from(x.to_f32()).powi(2))
        .sum::<f64>()
        .sqrt();
    for (chunk, threads) in [(7usize, 32u32), (1000, 64), (8192, 1024)] {
        for max_norm in [0.0f32, 1.0, 1e9] {
            let outs: Vec<[f32; 2]> = ORDERS
                .iter()
                .map(|&o| {
                    let bufs: Vec<Buf<T>> = data.iter().map(|d| Buf::from_slice("g", d)).collect();
                    multi::grad_norm(o, &bufs, max_norm, chunk, threads).unwrap()
                })
                .collect();
            for o in &outs[1..] {
                assert!(
                    same_bits(o, &outs[0]),
                    "{}: order dependence {outs:?}",
                    T::NAME
                );
            }
            let [norm, coef] = outs[0];
            assert!(
                (f64::from(norm) - want).abs() <= 1e-5 * want,
                "{} chunk {chunk}: norm {norm} vs {want}",
                T::NAME
            );
            let want_coef = if max_norm > 0.0 {
                (f64::from(max_norm) / (f64::from(norm) + 1e-6)).min(1.0)
            } else {
                1.0
            };
            assert!(
                (f64::from(coef) - want_coef).abs() <= 1e-6 * want_coef,
                "{coef} vs {want_coef}"
            );
        }
    }
}

#[test]
fn global_norm_and_clip_coefficient_f32_and_bf16() {
    norm_case::<f32>();
    norm_case::<bf16>();
}

#[test]
fn the_norm_of_nothing_is_zero_and_does_not_clip() {
    let none: Vec<Buf<f32>> = vec![Buf::from_slice("g", &[]), Buf::from_slice("g", &[])];
    assert_eq!(
        multi::grad_norm(ORDERS[0], &none, 1.0, 8192, 1024).unwrap(),
        [0.0, 1.0]
    );
}

#[test]
fn adamw_step_is_bitwise_the_cpu_optimizer() {
    let step = AdamWStep {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 3,
    };
    for decay in [true, false] {
        for coef in [None, Some(0.37f32)] {
            for (chunk, threads) in [(7usize, 32u32), (600, 128), (8192, 1024)] {
                let init = |seed: u64, scale: f32| -> Vec<Vec<f32>> {
                    LENS.iter()
                        .enumerate()
                        .map(|(i, &n)| values(n, scale, seed * 100 + i as u64))
                        .collect()
                };
                let (p0, g, m0, v0) = (init(1, 1.0), init(2, 0.5), init(3, 0.1), init(4, 0.01));
                let v0: Vec<Vec<f32>> = v0
                    .iter()
                    .map(|v| v.iter().map(|x| x.abs()).collect())
                    .collect();
                // The reference.
                let (mut pr, mut mr, mut vr) = (p0.clone(), m0.clone(), v0.clone());
                for i in 0..LENS.len() {
                    adamw_reference(
                        &mut pr[i], &g[i], &mut mr[i], &mut vr[i], &step, decay, coef,
                    );
                }
                for order in ORDERS {
                    let mk = |v: &Vec<Vec<f32>>, name| -> Vec<Buf<f32>> {
                        v.iter().map(|x| Buf::from_slice(name, x)).collect()
                    };
                    let (mut p, gb, mut m, mut v) =
                        (mk(&p0, "p"), mk(&g, "g"), mk(&m0, "m"), mk(&v0, "v"));
                    multi::adamw(
                        order,
                        &mut p,
                        &gb,
                        &mut m,
                        &mut v,
                        step.consts(decay),
                        coef,
                        chunk,
                        threads,
                    )
                    .unwrap();
                    for i in 0..LENS.len() {
                        for (name, got, want) in [
                            ("p", &p[i], &pr[i]),
                            ("m", &m[i], &mr[i]),
                            ("v", &v[i], &vr[i]),
                        ] {
                            assert!(
                                same_bits(got.as_slice(), want),
                                "decay {decay} coef {coef:?} chunk {chunk} {order:?}: {name}[{i}] differs from the CPU step"
                            );
                        }
                    }
                }
            }
        }
    }
}
