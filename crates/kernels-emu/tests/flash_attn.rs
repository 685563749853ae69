//! The flash-attention kernels of `crates/kernels/cuda/flash_attn.cu` under the emulator,
//! against candle's reference attention (`reference::sdpa`: the full score matrix, a -inf
//! mask, softmax), forward and backward, f32 and bf16, every head dim built, causal and not,
//! fewer queries than keys, lengths that are not multiples of the 32-row tiles. Each case runs
//! under every fiber order and must give the same bits.
mod common;
use candle_core::{Device, Tensor, Var};
use candle_dtensor_kernels::autodiff::reference;
use candle_dtensor_kernels::compare::{max_rel_diff, nan_max};
use candle_dtensor_kernels_emu::fused::{self, Attn, Dt, FaKernels, FA_HEAD_DIMS};
use candle_dtensor_kernels_emu::{count_banks, same_bits, BankStats, Buf, Order, ORDERS};
use common::{as_dt, values};
use half::bf16;

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[track_caller]
fn close<T: Dt>(what: &str, got: &[T], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        assert!(
            g.is_finite(),
            "{what} [{}]: element {i} is {g} (reference {w})",
            T::NAME
        );
        let err = (g - w).abs() - rtol * w.abs();
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= atol,
        "{what} [{}]: element {i}: {} vs reference {} (beyond {atol} + {rtol} |ref|)",
        T::NAME,
        got[i].to_f32(),
        want[i]
    );
}

struct Case {
    bh: usize,
    tq: usize,
    tk: usize,
    d: usize,
    causal: bool,
}

/// Reference forward and backward on the f32 values of the inputs: o, dq, dk, dv.
fn reference(c: &Case, q: &[f32], k: &[f32], v: &[f32], g: &[f32], scale: f32) -> [Vec<f32>; 4] {
    let t = |x: &[f32], n: usize| {
        Var::from_tensor(&Tensor::from_vec(x.to_vec(), (c.bh, 1, n, c.d), &Device::Cpu).unwrap())
            .unwrap()
    };
    let (qv, kv, vv) = (t(q, c.tq), t(k, c.tk), t(v, c.tk));
    let o = reference::sdpa(
        qv.as_tensor(),
        kv.as_tensor(),
        vv.as_tensor(),
        c.causal,
        scale.into(),
    )
    .unwrap();
    let gt = Tensor::from_vec(g.to_vec(), (c.bh, 1, c.tq, c.d), &Device::Cpu).unwrap();
    let grads = (&o * gt).unwrap().sum_all().unwrap().backward().unwrap();
    let gr = |x: &Var| flat(grads.get(x.as_tensor()).unwrap());
    [flat(&o), gr(&qv), gr(&kv), gr(&vv)]
}

/// Forward and backward of `c` on `kernels` against the reference, under every fiber order
/// (the same bits each time); a query that sees no key gets exactly zero output and gradient.
fn run_case<T: Dt>(c: &Case, seed: u64, kernels: FaKernels) {
    run_case_placed(c, seed, kernels, Buf::<T>::from_slice);
}

/// The forward's lse per query row (`[bh, tq]`): log of the sum of exp(scale q.k) over the keys
/// the row sees, -inf for a row that sees none.
fn reference_lse(c: &Case, q: &[f32], k: &[f32], scale: f32) -> Vec<f32> {
    let shift = c.tk as i64 - c.tq as i64;
    let mut out = Vec::with_capacity(c.bh * c.tq);
    for h in 0..c.bh {
        for i in 0..c.tq {
            let qi = &q[(h * c.tq + i) * c.d..][..c.d];
            let s: Vec<f64> = (0..c.tk)
                .filter(|&j| !c.causal || j as i64 <= i as i64 + shift)
                .map(|j| {
                    let kj = &k[(h * c.tk + j) * c.d..][..c.d];
                    f64::from(scale)
                        * qi.iter()
                            .zip(kj)
                            .map(|(a, b)| f64::from(a * b))
                            .sum::<f64>()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, nan_max);
            out.push(if s.is_empty() {
                f32::NEG_INFINITY
            } else {
                (m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()) as f32
            });
        }
    }
    out
}

/// As [`run_case`], with q and v (inputs) and o and dq (outputs) placed by `place` (k, d_o,
/// dk and dv as usual), so that one launch reads and writes aligned and misaligned buffers.
fn run_case_placed<T: Dt>(
    c: &Case,
    seed: u64,
    kernels: FaKernels,
    place: fn(&'static str, &[T]) -> Buf<T>,
) {
    let (nq, nk) = (c.bh * c.tq * c.d, c.bh * c.tk * c.d);
    let scale = 1.0 / (c.d as f32).sqrt();
    let (q, qf) = as_dt::<T>(&values(nq, 2.0, seed));
    let (k, kf) = as_dt::<T>(&values(nk, 2.0, seed + 1));
    let (v, vf) = as_dt::<T>(&values(nk, 1.0, seed + 2));
    let (g, gf) = as_dt::<T>(&values(nq, 1.0, seed + 3));
    let [want_o, want_dq, want_dk, want_dv] = reference(c, &qf, &kf, &vf, &gf, scale);
    let shape = Attn {
        bh: c.bh,
        tq: c.tq,
        tk: c.tk,
        d: c.d,
    };
    let what = format!(
        "{kernels:?}: bh {} tq {} tk {} d {} causal {}",
        c.bh, c.tq, c.tk, c.d, c.causal
    );
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for order in ORDERS {
        let (qb, kb, vb, gb) = (
            place("q", &q),
            Buf::from_slice("k", &k),
            place("v", &v),
            Buf::from_slice("d_o", &g),
        );
        let nan = T::from_f32(f32::NAN);
        let mut o = place("o", &vec![nan; nq]);
        let mut lse = Buf::filled("lse", c.bh * c.tq, f32::NAN);
        fused::flash_attn_fwd(
            order, kernels, &qb, &kb, &vb, &mut o, &mut lse, shape, scale, c.causal,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (mut dq, mut dk, mut dv) = (
            place("dq", &vec![nan; nq]),
            Buf::filled("dk", nk, nan),
            Buf::filled("dv", nk, nan),
        );
        fused::flash_attn_bwd(
            order, kernels, &qb, &kb, &vb, &o, &lse, &gb, &mut dq, &mut dk, &mut dv, shape, scale,
            c.causal,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        lses.push(lse.as_slice().to_vec());
        outs.push([o, dq, dk, dv].map(|b| b.as_slice().to_vec()));
    }
    for (order, lse) in ORDERS.iter().zip(&lses).skip(1) {
        assert!(
            same_bits(&lses[0], lse),
            "{what} lse [{}]: {order:?} differs from Forward",
            T::NAME
        );
    }
    for (order, out) in ORDERS.iter().zip(&outs).skip(1) {
        for (name, (a, b)) in ["o", "dq", "dk", "dv"].iter().zip(outs[0].iter().zip(out)) {
            assert!(
                same_bits(a, b),
                "{what} {name} [{}]: {order:?} differs from Forward",
                T::NAME
            );
        }
    }
    // f32: summation order only. bf16: the inputs are the same bf16 values on both sides, so
    // the difference is the output's rounding (2^-8 relative) on values of magnitude ~1 and
    // the gradients' sums over up to 100 terms.
    let (atol, rtol) = if T::NAME == "bf16" {
        (2e-2, 1e-2)
    } else {
        (2e-5, 1e-4)
    };
    let [o, dq, dk, dv] = &outs[0];
    close(&format!("{what} o"), o, &want_o, atol, rtol);
    // lse: f32 on both sides (of the same rounded inputs); -inf exactly where a row sees no key.
    for (i, (got, want)) in lses[0]
        .iter()
        .zip(reference_lse(c, &qf, &kf, scale))
        .enumerate()
    {
        let ok = if want == f32::NEG_INFINITY {
            *got == f32::NEG_INFINITY
        } else {
            (got - want).abs() <= 1e-4 + 1e-4 * want.abs()
        };
        assert!(
            ok,
            "{what} lse [{}] row {i}: {got} vs reference {want}",
            T::NAME
        );
    }
    close(&format!("{what} dq"), dq, &want_dq, atol, rtol);
    close(&format!("{what} dk"), dk, &want_dk, atol, rtol);
    close(&format!("{what} dv"), dv, &want_dv, atol, rtol);
    if c.causal && c.tq > c.tk {
        // Queries [0, tq - tk) of every head see no key.
        let blind = (c.tq - c.tk) * c.d;
        for h in 0..c.bh {
            let rows = h * c.tq * c.d..h * c.tq * c.d + blind;
            assert!(
                o[rows.clone()]
                    .iter()
                    .chain(&dq[rows])
                    .all(|x| x.to_f32() == 0.0),
                "{what}: a query that sees no key has an output or a gradient"
            );
        }
    }
}

fn cases() -> Vec<Case> {
    vec![
        // One tile, every head dim, causal.
        Case {
            bh: 2,
            tq: 33,
            tk: 33,
            d: 32,
            causal: true,
        },
        Case {
            bh: 1,
            tq: 40,
            tk: 40,
            d: 48,
            causal: true,
        },
        Case {
            bh: 3,
            tq: 70,
            tk: 70,
            d: 64,
            causal: true,
        },
        Case {
            bh: 1,
            tq: 45,
            tk: 45,
            d: 96,
            causal: false,
        },
        Case {
            bh: 1,
            tq: 64,
            tk: 64,
            d: 128,
            causal: true,
        },
        // Fewer queries than keys (bottom-right causal alignment), several key tiles.
        Case {
            bh: 2,
            tq: 17,
            tk: 75,
            d: 64,
            causal: true,
        },
        Case {
            bh: 1,
            tq: 5,
            tk: 100,
            d: 32,
            causal: false,
        },
        // One token.
        Case {
            bh: 1,
            tq: 1,
            tk: 1,
            d: 64,
            causal: true,
        },
    ]
}

#[test]
fn flash_attention_f32_matches_the_reference() {
    for (i, c) in cases().iter().enumerate() {
        run_case::<f32>(c, 10 * i as u64 + 1, FaKernels::Simt);
    }
}

#[test]
fn flash_attention_bf16_matches_the_reference() {
    for (i, c) in cases().iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        run_case::<bf16>(c, 10 * i as u64 + 5, FaKernels::Simt);
    }
}

#[test]
fn queries_that_see_no_key_get_zero_and_no_gradient() {
    // tq > tk, causal: query i sees keys j <= i - 3; queries 0..3 see none.
    let c = Case {
        bh: 1,
        tq: 8,
        tk: 5,
        d: 32,
        causal: true,
    };
    let (nq, nk) = (c.tq * c.d, c.tk * c.d);
    let shape = Attn {
        bh: 1,
        tq: c.tq,
        tk: c.tk,
        d: c.d,
    };
    let (q, k, v) = (values(nq, 1.0, 1), values(nk, 1.0, 2), values(nk, 1.0, 3));
    let (qb, kb, vb) = (
        Buf::from_slice("q", &q),
        Buf::from_slice("k", &k),
        Buf::from_slice("v", &v),
    );
    let mut o = Buf::filled("o", nq, f32::NAN);
    let mut lse = Buf::filled("lse", c.tq, f32::NAN);
    fused::flash_attn_fwd(
        Order::Forward,
        FaKernels::Simt,
        &qb,
        &kb,
        &vb,
        &mut o,
        &mut lse,
        shape,
        0.5,
        true,
    )
    .unwrap();
    assert!(o.as_slice()[..3 * c.d].iter().all(|&x| x == 0.0));
    assert!(lse.as_slice()[..3].iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(
        o.as_slice()[3 * c.d..].iter().all(|x| x.is_finite())
            && lse.as_slice()[3..].iter().all(|x| x.is_finite())
    );
    let gb = Buf::from_slice("d_o", &values(nq, 1.0, 4));
    let (mut dq, mut dk, mut dv) = (
        Buf::filled("dq", nq, f32::NAN),
        Buf::filled("dk", nk, f32::NAN),
        Buf::filled("dv", nk, f32::NAN),
    );
    fused::flash_attn_bwd(
        Order::Forward,
        FaKernels::Simt,
        &qb,
        &kb,
        &vb,
        &o,
        &lse,
        &gb,
        &mut dq,
        &mut dk,
        &mut dv,
        shape,
        0.5,
        true,
    )
    .unwrap();
    assert!(dq.as_slice()[..3 * c.d].iter().all(|&x| x == 0.0));
    for b in [&dq, &dk, &dv] {
        assert!(b.as_slice().iter().all(|x| x.is_finite()));
    }
}

#[test]
fn unsupported_head_dims_and_short_buffers_are_refused() {
    // The forward on `kernels` over f32 buffers of `len` elements (lse of bh tq), its error.
    let refused = |kernels: FaKernels, shape: Attn, len: usize| {
        let b = Buf::filled("x", len, 0.0f32);
        let mut o = Buf::filled("o", len, 0.0f32);
        let mut lse = Buf::filled("lse", shape.bh * shape.tq, 0.0f32);
        fused::flash_attn_fwd(
            Order::Forward,
            kernels,
            &b,
            &b,
            &b,
            &mut o,
            &mut lse,
            shape,
            1.0,
            true,
        )
        .unwrap_err()
        .to_string()
    };
    let one = |d| Attn {
        bh: 1,
        tq: 4,
        tk: 4,
        d,
    };
    let e = refused(FaKernels::Simt, one(40), 4 * 40);
    assert!(
        e.contains("head dim 40") && e.contains(&format!("{FA_HEAD_DIMS:?}")),
        "{e}"
    );
    // Two heads over buffers for one.
    let two = Attn { bh: 2, ..one(32) };
    let e = refused(FaKernels::Simt, two, 4 * 32);
    assert!(e.contains("flash_attn_fwd"), "{e}");
    // The tensor-core kernels take bf16 only.
    let e = refused(FaKernels::TensorCores, two, 2 * 4 * 32);
    assert!(e.contains("take bf16, not f32"), "{e}");
}

/// The CUDA op launches the tensor-core kernels with the warps these tests run them under.
#[test]
fn the_cuda_op_launches_the_tensor_core_kernels_as_tested_here() {
    assert_eq!(
        candle_dtensor_kernels::flash::TENSOR_CORE_FWD_WARPS,
        fused::FA_TC_FWD_WARPS
    );
    assert_eq!(
        candle_dtensor_kernels::flash::TENSOR_CORE_BWD_WARPS,
        fused::FA_TC_BWD_WARPS
    );
    assert_eq!(candle_dtensor_kernels::flash::HEAD_DIMS, FA_HEAD_DIMS);
}

/// The cases of the tensor-core kernels: [`cases`], queries that see no key, several blocks (128
/// queries a forward block, 64 rows a backward one), warps whose queries end before a causal
/// key tile (they skip it) or lie past tq, several key and query tiles, ragged last tiles.
fn tensor_core_cases() -> Vec<Case> {
    let mut all = cases();
    all.push(Case {
        bh: 1,
        tq: 8,
        tk: 5,
        d: 32,
        causal: true,
    });
    all.push(Case {
        bh: 2,
        tq: 150,
        tk: 150,
        d: 64,
        causal: true,
    });
    all.push(Case {
        bh: 1,
        tq: 70,
        tk: 97,
        d: 128,
        causal: true,
    });
    all.push(Case {
        bh: 1,
        tq: 81,
        tk: 50,
        d: 96,
        causal: false,
    });
    all.push(Case {
        bh: 1,
        tq: 260,
        tk: 260,
        d: 48,
        causal: true,
    });
    all
}

/// The tensor-core kernels (`cdt_fa_*_tc_bf16_*`, warp matrix products under the emulator's
/// `mma.h`) on every case, as the SIMT ones: the same bits under every fiber order (a tile read
/// before its lanes stored it would differ), output and gradients within bf16 tolerance of
/// the reference (P and dS are rounded to bf16 for their products).
#[test]
fn tensor_core_kernels_match_the_reference() {
    for (i, c) in tensor_core_cases().iter().enumerate() {
        run_case::<bf16>(c, 100 + 10 * i as u64, FaKernels::TensorCores);
    }
}

/// At lengths GPT-2 uses (512 keys at d = 64, 256 at d = 128), the tensor-core kernels' error
/// against the f32 reference, relative to the largest reference value (as the GPU check
/// measures it), stays near the SIMT kernels' (about 2-4e-3 for both here): rounding P and dS
/// to bf16 must not grow with the number of keys summed.
#[test]
fn tensor_cores_stay_accurate_over_long_sequences() {
    for (t, d) in [(512usize, 64usize), (256, 128)] {
        let n = t * d;
        let scale = 1.0 / (d as f32).sqrt();
        let (q, qf) = as_dt::<bf16>(&values(n, 2.0, 1));
        let (k, kf) = as_dt::<bf16>(&values(n, 2.0, 2));
        let (v, vf) = as_dt::<bf16>(&values(n, 1.0, 3));
        let (g, gf) = as_dt::<bf16>(&values(n, 1.0, 4));
        let c = Case {
            bh: 1,
            tq: t,
            tk: t,
            d,
            causal: true,
        };
        let want = reference(&c, &qf, &kf, &vf, &gf, scale);
        let shape = Attn {
            bh: 1,
            tq: t,
            tk: t,
            d,
        };
        let (qb, kb, vb, gb) = (
            Buf::from_slice("q", &q),
            Buf::from_slice("k", &k),
            Buf::from_slice("v", &v),
            Buf::from_slice("d_o", &g),
        );
        let nan = bf16::from_f32(f32::NAN);
        let mut o = Buf::filled("o", n, nan);
        let mut lse = Buf::filled("lse", t, f32::NAN);
        let (mut dq, mut dk, mut dv) = (
            Buf::filled("dq", n, nan),
            Buf::filled("dk", n, nan),
            Buf::filled("dv", n, nan),
        );
        let (o_, tc) = (Order::Forward, FaKernels::TensorCores);
        fused::flash_attn_fwd(o_, tc, &qb, &kb, &vb, &mut o, &mut lse, shape, scale, true).unwrap();
        fused::flash_attn_bwd(
            o_, tc, &qb, &kb, &vb, &o, &lse, &gb, &mut dq, &mut dk, &mut dv, shape, scale, true,
        )
        .unwrap();
        let f = |b: &Buf<bf16>| -> Vec<f32> { b.as_slice().iter().map(|x| x.to_f32()).collect() };
        for (name, (got, want)) in ["o", "dq", "dk", "dv"]
            .iter()
            .zip([f(&o), f(&dq), f(&dk), f(&dv)].iter().zip(&want))
        {
            // The project's NaN-propagating measure (`f32::max` in a fold would drop a NaN).
            let as_t = |v: &[f32]| Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap();
            let r = max_rel_diff(&as_t(got), &as_t(want)).unwrap();
            assert!(
                r <= 1e-2,
                "t {t} d {d} {name}: max rel diff {r:e} > 1e-2 (NaN fails too)"
            );
        }
    }
}

/// The tensor-core kernels read their tiles with 16-byte vector loads when a pointer allows
/// it and element by element when it does not (a tensor whose storage offset is not a
/// multiple of 8 elements), and write two bf16 a store where the output allows it: the same
/// results either way, here with q, v, o and dq one element past a 16-byte boundary and k,
/// d_o, dk and dv aligned in the same launches.
#[test]
fn tensor_core_kernels_read_misaligned_inputs() {
    let probe = Buf::<bf16>::misaligned("probe", &[bf16::ZERO; 8]);
    assert!(!probe.is_aligned_16(), "the misaligned buffer is aligned");
    assert!(Buf::from_slice("probe", &[bf16::ZERO; 8]).is_aligned_16());
    for (i, c) in tensor_core_cases()
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 3 == 0)
    {
        run_case_placed::<bf16>(
            c,
            700 + 10 * i as u64,
            FaKernels::TensorCores,
            Buf::misaligned,
        );
    }
}

/// Forward and backward of the tensor-core kernels on a causal case with several tiles each
/// way, counting the shared-memory bank wavefronts of their warp matrix operations.
fn tc_bank_stats(d: usize) -> (BankStats, BankStats) {
    let (t, bh) = (150usize, 2usize);
    let n = bh * t * d;
    let scale = 1.0 / (d as f32).sqrt();
    let x = |seed| Buf::from_slice("x", &as_dt::<bf16>(&values(n, 1.0, seed)).0);
    let (qb, kb, vb, gb) = (x(1), x(2), x(3), x(4));
    let shape = Attn {
        bh,
        tq: t,
        tk: t,
        d,
    };
    let nan = bf16::from_f32(f32::NAN);
    let mut o = Buf::filled("o", n, nan);
    let mut lse = Buf::filled("lse", bh * t, f32::NAN);
    let (o_, tc) = (Order::Forward, FaKernels::TensorCores);
    let ((), fwd) = count_banks(|| {
        fused::flash_attn_fwd(o_, tc, &qb, &kb, &vb, &mut o, &mut lse, shape, scale, true).unwrap()
    });
    let (mut dq, mut dk, mut dv) = (
        Buf::filled("dq", n, nan),
        Buf::filled("dk", n, nan),
        Buf::filled("dv", n, nan),
    );
    let ((), bwd) = count_banks(|| {
        fused::flash_attn_bwd(
            o_, tc, &qb, &kb, &vb, &o, &lse, &gb, &mut dq, &mut dk, &mut dv, shape, scale, true,
        )
        .unwrap()
    });
    (fwd, bwd)
}

/// The tensor-core kernels' `ldmatrix` loads from shared memory are free of bank conflicts in
/// the emulator's model ([`count_banks`]): the tiles' rows are padded so that the 8 rows one
/// load phase reads fall into different banks (unpadded, a 64- or 128-wide head puts all 8 in
/// the same banks: 8 wavefronts a load).
#[test]
fn tensor_core_tiles_are_read_without_bank_conflicts() {
    let all: Vec<_> = FA_HEAD_DIMS
        .iter()
        .map(|&d| (d, tc_bank_stats(d)))
        .collect();
    // Every head dim's figures, in any failure's message.
    let summary: String = all
        .iter()
        .map(|(d, (fwd, bwd))| {
            format!(
                "\n  d {d}: forward {:.2}-way, backward {:.2}-way",
                fwd.ways(),
                bwd.ways()
            )
        })
        .collect();
    for &(d, (fwd, bwd)) in &all {
        for (what, st) in [("forward", fwd), ("backward", bwd)] {
            assert!(st.requests > 0, "{what} d {d}: nothing counted: {st:?}");
            assert_eq!(
                st.wavefronts,
                st.requests,
                "d {d}: the {what}'s loads conflict ({:.2}-way){summary}",
                st.ways()
            );
        }
    }
}
