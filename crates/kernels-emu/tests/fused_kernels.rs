//! The fused CUDA kernels of `crates/kernels/cuda`, run under the emulator, against the
//! candle-primitive reference compositions the CPU kernels are tested against
//! (`candle_dtensor_kernels::autodiff::reference`), forward and backward, f32 and bf16, odd row
//! lengths, several block sizes and grids smaller than the rows (the grid-stride loops). Each
//! case runs under every fiber order and must give the same bits: a missing barrier shows.
//! NaN anywhere a reference value is finite fails.
mod common;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_dtensor_kernels::autodiff::reference;
use candle_dtensor_kernels_emu::fused::{self, Dt, Index, Rows};
use candle_dtensor_kernels_emu::{same_bits, Buf, Launch, Order, ORDERS};
use common::{as_dt, values};
use half::bf16;

fn tol<T: Dt>() -> (f32, f32) {
    // (absolute, relative): f32 is reassociation and libm-vs-reference error; bf16 is one
    // rounding of the output (2^-8 relative) plus the f32 error.
    if T::NAME == "bf16" {
        (2e-2, 1.6e-2)
    } else {
        (2e-5, 2e-5)
    }
}

#[track_caller]
fn close<T: Dt>(what: &str, got: &[T], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (atol, rtol) = tol::<T>();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        assert!(
            g.is_finite() == w.is_finite() && (g == *w || (g - w).abs() <= atol + rtol * w.abs()),
            "{what} [{}]: element {i}: {g} vs reference {w}",
            T::NAME
        );
    }
}

/// Runs `f` under every order; the outputs must be the same bits. Returns the first.
fn every_order<T: Dt>(what: &str, mut f: impl FnMut(Order) -> Vec<T>) -> Vec<T> {
    let outs: Vec<Vec<T>> = ORDERS.iter().map(|&o| f(o)).collect();
    for (o, out) in ORDERS.iter().zip(&outs).skip(1) {
        assert!(
            same_bits(&outs[0], out),
            "{what} [{}]: {o:?} differs from Forward",
            T::NAME
        );
    }
    outs.into_iter().next().unwrap_or_default()
}

fn tensor(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

const LENS: [usize; 6] = [1, 31, 33, 64, 1000, 4097];

/// Launches of the row kernels: one warp and one block for all rows, several warps and fewer
/// blocks than rows (the grid-stride loop), and (for few rows: a 1024-thread block costs the
/// emulator about 1024 fiber switches per barrier) the largest block.
fn row_launches(rows: usize) -> Vec<Launch> {
    let mut v = vec![Launch::linear(1, 32, 0), Launch::linear(2, 128, 0)];
    if rows <= 3 {
        v.push(Launch::linear(2, 1024, 0));
    }
    v
}

fn gelu_case<T: Dt>() {
    for (i, &len) in LENS.iter().enumerate() {
        let (x, xf) = as_dt::<T>(&values(len, 6.0, i as u64 + 1));
        let (g, gf) = as_dt::<T>(&values(len, 1.0, i as u64 + 100));
        let xv = Var::from_tensor(&tensor(&xf, &[len])).unwrap();
        let y = reference::gelu(xv.as_tensor()).unwrap();
        let grads = (&y * tensor(&gf, &[len]))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (want_y, want_dx) = (flat(&y), flat(grads.get(xv.as_tensor()).unwrap()));
        for l in [
            Launch::linear(1, 32, 0),
            Launch::linear(3, 128, 0),
            Launch::linear(64, 256, 0),
        ] {
            let y = every_order("gelu_fwd", |o| {
                let mut y = Buf::filled("y", len, T::from_f32(f32::NAN));
                fused::gelu_fwd(&l, o, &Buf::from_slice("x", &x), &mut y).unwrap();
                y.as_slice().to_vec()
            });
            close(&format!("gelu_fwd len {len} {l:?}"), &y, &want_y);
            let dx = every_order("gelu_bwd", |o| {
                let mut dx = Buf::filled("dx", len, T::from_f32(f32::NAN));
                fused::gelu_bwd(
                    &l,
                    o,
                    &Buf::from_slice("x", &x),
                    &Buf::from_slice("g", &g),
                    &mut dx,
                )
                .unwrap();
                dx.as_slice().to_vec()
            });
            close(&format!("gelu_bwd len {len} {l:?}"), &dx, &want_dx);
        }
    }
}

#[test]
fn gelu_f32_and_bf16() {
    gelu_case::<f32>();
    gelu_case::<bf16>();
}

fn norm_case<T: Dt>(center: bool, bias: bool) {
    let eps = 1e-5f32;
    for (i, &(rows, n)) in [
        (1usize, 1usize),
        (3, 31),
        (5, 33),
        (9, 64),
        (2, 1000),
        (1, 4097),
        (17, 40),
    ]
    .iter()
    .enumerate()
    {
        let seed = i as u64 * 10 + u64::from(center) * 3 + u64::from(bias);
        let (x, xf) = as_dt::<T>(&values(rows * n, 3.0, seed + 1));
        // Rows with a large common offset: the two-pass variance must not cancel.
        let (x, xf) = if i == 3 {
            as_dt::<T>(&xf.iter().map(|v| v + 100.0).collect::<Vec<_>>())
        } else {
            (x, xf)
        };
        let (w, wf) = as_dt::<T>(&values(n, 1.5, seed + 2));
        let (b, bf) = as_dt::<T>(&values(n, 0.5, seed + 3));
        let (g, gf) = as_dt::<T>(&values(rows * n, 1.0, seed + 4));
        let xv = Var::from_tensor(&tensor(&xf, &[rows, n])).unwrap();
        let wv = Var::from_tensor(&tensor(&wf, &[n])).unwrap();
        let bv = Var::from_tensor(&tensor(&bf, &[n])).unwrap();
        let y = if center {
            reference::layer_norm(
                xv.as_tensor(),
                Some(wv.as_tensor()),
                bias.then(|| bv.as_tensor()),
                eps.into(),
            )
        } else {
            let y = reference::rms_norm(xv.as_tensor(), wv.as_tensor(), eps.into()).unwrap();
            if bias {
                y.broadcast_add(bv.as_tensor())
            } else {
                Ok(y)
            }
        }
        .unwrap();
        let grads = (&y * tensor(&gf, &[rows, n]))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let want_y = flat(&y);
        let want_dx = flat(grads.get(xv.as_tensor()).unwrap());
        let want_dw = flat(grads.get(wv.as_tensor()).unwrap());
        let want_db = if bias {
            flat(grads.get(bv.as_tensor()).unwrap())
        } else {
            flat(&tensor(&gf, &[rows, n]).sum(0).unwrap())
        };
        let shape = Rows { rows, n };
        let what = format!("norm center {center} bias {bias} rows {rows} n {n}");
        for l in row_launches(rows) {
            let y = every_order("norm_fwd", |o| {
                let mut y = Buf::filled("y", rows * n, T::from_f32(f32::NAN));
                let bb = Buf::from_slice("b", &b);
                fused::norm_fwd(
                    &l,
                    o,
                    &Buf::from_slice("x", &x),
                    &Buf::from_slice("w", &w),
                    bias.then_some(&bb),
                    &mut y,
                    shape,
                    eps,
                    center,
                )
                .unwrap();
                y.as_slice().to_vec()
            });
            close(&format!("{what} fwd {l:?}"), &y, &want_y);
            let chunk_counts: &[u32] = if l.block.0 == 32 { &[1, 3] } else { &[2] };
            for &chunks in chunk_counts {
                let partial = Launch {
                    grid: (n.div_ceil(32) as u32, chunks, 1),
                    block: (32, 8, 1),
                    shared_bytes: 0,
                };
                let fin = Launch::linear(2, 64, 0);
                let both = every_order("norm_bwd", |o| {
                    let mut dx = Buf::filled("dx", rows * n, T::from_f32(f32::NAN));
                    let mut wb = Buf::filled("wb", 2 * n, T::from_f32(f32::NAN));
                    fused::norm_bwd(
                        [&l, &partial, &fin],
                        o,
                        &Buf::from_slice("x", &x),
                        &Buf::from_slice("w", &w),
                        &Buf::from_slice("g", &g),
                        &mut dx,
                        &mut wb,
                        shape,
                        eps,
                        center,
                    )
                    .unwrap();
                    let mut v = dx.as_slice().to_vec();
                    v.extend_from_slice(wb.as_slice());
                    v
                });
                let (dx, wb) = both.split_at(rows * n);
                close(&format!("{what} dx {l:?}"), dx, &want_dx);
                // The weight and bias gradients sum over rows: the tolerance grows with them.
                let scale = (rows as f32).sqrt();
                let relax = |v: &[f32]| -> Vec<f32> { v.to_vec() };
                let (dw, db) = wb.split_at(n);
                let (atol, rtol) = tol::<T>();
                for (name, got, want) in [("dw", dw, relax(&want_dw)), ("db", db, relax(&want_db))]
                {
                    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                        let g = g.to_f32();
                        assert!(
                            g.is_finite() && (g - w).abs() <= (atol + rtol * w.abs()) * scale * 4.0,
                            "{what} {name} chunks {chunks} [{}]: column {j}: {g} vs {w}",
                            T::NAME
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn layer_norm_f32_and_bf16() {
    for bias in [true, false] {
        norm_case::<f32>(true, bias);
        norm_case::<bf16>(true, bias);
    }
}

#[test]
fn rms_norm_f32_and_bf16() {
    norm_case::<f32>(false, false);
    norm_case::<bf16>(false, false);
}

/// softmax(scale * x) with the causal mask of rows `[.., t, n]`: key j is kept for query i when
/// j <= i + n - t.
fn softmax_reference(x: &Tensor, t: usize, scale: f32, causal: bool) -> Tensor {
    let (rows, n) = x.dims2().unwrap();
    let s = (x * f64::from(scale)).unwrap();
    let s = if causal {
        let mask: Vec<f32> = (0..rows)
            .flat_map(|r| {
                (0..n).map(move |j| {
                    if j + t > r % t + n {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        (s + tensor(&mask, &[rows, n])).unwrap()
    } else {
        s
    };
    reference::softmax(&s, 1).unwrap()
}

fn softmax_case<T: Dt>() {
    // (rows, n, t, causal, log): t divides rows; causal rows keep at least one key (t <= n).
    let cases = [
        (4usize, 1usize, 1usize, false, false),
        (6, 31, 3, true, false),
        (8, 33, 8, true, false),
        (5, 1000, 5, false, false),
        (2, 4097, 2, true, false),
        (7, 33, 1, false, true),
        (3, 1000, 1, false, true),
    ];
    for (i, &(rows, n, t, causal, log)) in cases.iter().enumerate() {
        let scale = if log { 1.0 } else { 0.37 };
        let (x, xf) = as_dt::<T>(&values(rows * n, 8.0, i as u64 + 7));
        let (g, gf) = as_dt::<T>(&values(rows * n, 1.0, i as u64 + 70));
        let xv = Var::from_tensor(&tensor(&xf, &[rows, n])).unwrap();
        let y = if log {
            reference::log_softmax(xv.as_tensor(), 1).unwrap()
        } else {
            softmax_reference(xv.as_tensor(), t, scale, causal)
        };
        let grads = (&y * tensor(&gf, &[rows, n]))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let want_y = flat(&y);
        let want_dx = flat(grads.get(xv.as_tensor()).unwrap());
        let shape = Rows { rows, n };
        let what = format!("softmax rows {rows} n {n} t {t} causal {causal} log {log}");
        for l in row_launches(rows) {
            let y = every_order("softmax_fwd", |o| {
                let mut y = Buf::filled("y", rows * n, T::from_f32(f32::NAN));
                fused::softmax_fwd(
                    &l,
                    o,
                    &Buf::from_slice("x", &x),
                    &mut y,
                    shape,
                    t,
                    scale,
                    causal,
                    log,
                )
                .unwrap();
                y.as_slice().to_vec()
            });
            close(&format!("{what} fwd {l:?}"), &y, &want_y);
            // The backward takes the kernel's own output (what the op saves).
            let dx = every_order("softmax_bwd", |o| {
                let mut dx = Buf::filled("dx", rows * n, T::from_f32(f32::NAN));
                fused::softmax_bwd(
                    &l,
                    o,
                    &Buf::from_slice("y", &y),
                    &Buf::from_slice("g", &g),
                    &mut dx,
                    shape,
                    scale,
                    log,
                )
                .unwrap();
                dx.as_slice().to_vec()
            });
            close(&format!("{what} bwd {l:?}"), &dx, &want_dx);
        }
    }
}

#[test]
fn softmax_causal_and_log_softmax_f32_and_bf16() {
    softmax_case::<f32>();
    softmax_case::<bf16>();
}

fn xent_case<T: Dt, I: Index<T> + Copy>(to_index: impl Fn(i64) -> I, ignore: Option<i64>) {
    for (i, &(rows, n)) in [(3usize, 1usize), (4, 31), (5, 1000), (2, 4097), (3, 50304)]
        .iter()
        .enumerate()
    {
        let (x, xf) = as_dt::<T>(&values(rows * n, 10.0, i as u64 + 11));
        let classes: Vec<i64> = (0..rows)
            .map(|r| match (r, ignore) {
                (1, Some(ig)) => ig,
                _ => ((r * 7919 + i) % n) as i64,
            })
            .collect();
        let tgt: Vec<I> = classes.iter().map(|&c| to_index(c)).collect();
        let up: Vec<f32> = values(rows, 1.0, i as u64 + 500);
        // Reference: loss_r = logsumexp(x_r) - x_r[c_r]; d loss_r / d x_r = softmax - onehot.
        let xt = tensor(&xf, &[rows, n]);
        let lse = flat(
            &xt.exp()
                .unwrap()
                .sum_keepdim(D::Minus1)
                .unwrap()
                .log()
                .unwrap(),
        );
        let xv = Var::from_tensor(&xt).unwrap();
        let ls = reference::log_softmax(xv.as_tensor(), 1).unwrap();
        let mut want_loss = Vec::new();
        let mut picks = Vec::new();
        for (r, &c) in classes.iter().enumerate() {
            if Some(c) == ignore {
                want_loss.push(0.0);
                continue;
            }
            let v = ls.get(r).unwrap().get(c as usize).unwrap();
            want_loss.push(-v.to_scalar::<f32>().unwrap());
            picks.push((v * -f64::from(up[r])).unwrap());
        }
        let total = Tensor::stack(&picks, 0).unwrap().sum_all().unwrap();
        let want_dx = flat(total.backward().unwrap().get(xv.as_tensor()).unwrap());
        // Large-magnitude logsumexps: compare the loss with an absolute tolerance scaled to
        // the logits' range as well.
        let shape = Rows { rows, n };
        let what = format!("xent rows {rows} n {n} ignore {ignore:?}");
        for l in row_launches(rows) {
            let out = every_order::<f32>("xent_fwd", |o| {
                let mut out = Buf::filled("out", 2 * rows, f32::NAN);
                fused::xent_fwd(
                    &l,
                    o,
                    &Buf::from_slice("x", &x),
                    &Buf::from_slice("tgt", &tgt),
                    &mut out,
                    shape,
                    ignore,
                )
                .unwrap();
                out.as_slice().to_vec()
            });
            let losses: Vec<f32> = out.iter().step_by(2).copied().collect();
            let lses: Vec<f32> = out.iter().skip(1).step_by(2).copied().collect();
            close::<f32>(&format!("{what} loss {l:?}"), &losses, &want_loss);
            close::<f32>(&format!("{what} lse {l:?}"), &lses, &lse);
            let lg: Vec<f32> = lses.iter().zip(&up).flat_map(|(&s, &u)| [s, u]).collect();
            let dx = every_order("xent_bwd", |o| {
                let mut dx = Buf::filled("dx", rows * n, T::from_f32(f32::NAN));
                fused::xent_bwd(
                    &l,
                    o,
                    &Buf::from_slice("x", &x),
                    &Buf::from_slice("tgt", &tgt),
                    &Buf::from_slice("lg", &lg),
                    &mut dx,
                    shape,
                    ignore,
                )
                .unwrap();
                dx.as_slice().to_vec()
            });
            close(&format!("{what} dx {l:?}"), &dx, &want_dx);
        }
    }
}

#[test]
fn cross_entropy_f32_and_bf16_u32_and_i64_targets() {
    xent_case::<f32, u32>(|c| c as u32, None);
    xent_case::<f32, i64>(|c| c, Some(-100));
    xent_case::<bf16, u32>(|c| c as u32, None);
    xent_case::<bf16, i64>(|c| c, Some(-100));
}

#[test]
fn cross_entropy_out_of_range_target_is_nan_not_a_number() {
    let (rows, n) = (2usize, 10usize);
    let x = Buf::from_slice("x", &values(rows * n, 1.0, 3));
    let tgt = Buf::from_slice("tgt", &[3u32, 10]);
    let mut out = Buf::filled("out", 2 * rows, 0.0f32);
    fused::xent_fwd(
        &Launch::linear(1, 64, 0),
        Order::Forward,
        &x,
        &tgt,
        &mut out,
        Rows { rows, n },
        None,
    )
    .unwrap();
    assert!(
        out.as_slice()[0].is_finite() && out.as_slice()[2].is_nan(),
        "{:?}",
        out.as_slice()
    );
}

#[test]
fn the_wrappers_refuse_buffers_too_small_for_the_shape() {
    let x = Buf::from_slice("x", &[0.0f32; 10]);
    let mut y = Buf::filled("y", 9, 0.0f32);
    let e = fused::gelu_fwd(&Launch::linear(1, 32, 0), Order::Forward, &x, &mut y).unwrap_err();
    assert!(
        e.to_string().contains("gelu_fwd") && e.to_string().contains("9 elements"),
        "{e}"
    );
    let e = fused::softmax_fwd(
        &Launch::linear(1, 32, 0),
        Order::Forward,
        &x,
        &mut Buf::filled("y", 10, 0.0f32),
        Rows { rows: 2, n: 5 },
        0,
        1.0,
        true,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("t = 0"), "{e}");
}

#[test]
fn a_block_size_the_reductions_do_not_support_is_reported_not_computed() {
    // block_sum needs whole warps: 48 threads leave a partial warp whose shuffles read lanes
    // no thread runs.
    let x = Buf::from_slice("x", &values(4 * 40, 1.0, 9));
    let mut y = Buf::filled("y", 4 * 40, 0.0f32);
    let e = fused::softmax_fwd(
        &Launch::linear(2, 48, 0),
        Order::Forward,
        &x,
        &mut y,
        Rows { rows: 4, n: 40 },
        1,
        1.0,
        false,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("warp shuffle reads lane"), "{e}");
}
