//! The flash-attention kernels reading and writing operands placed by `FaRows` instead of
//! contiguous `[BH, T, d]`: q, k and v as the three parts of one packed projection
//! `[B, T, H, 3, d]`, the output and its gradient as `[B, T, H, d]`, and dQ, dK, dV written
//! together into one packed gradient (what the CUDA op does to skip the unpacking and
//! transposing copies). Same bits as the contiguous launch, on the SIMT kernels (f32, bf16) and
//! the tensor-core ones; rows at a stride that is not a multiple of 8 elements (the copy paths
//! without 16-byte vectors); writes confined to their rows; and the placements a launch must
//! refuse.
mod common;
use candle_dtensor_kernels_emu::fused::{
    self, check_disjoint, Attn, Dt, FaBwdRows, FaKernels, FaRows, MAX_ROW_STRIDE,
};
use candle_dtensor_kernels_emu::{same_bits, Buf, Order, ORDERS};
use common::{as_dt, values};
use half::bf16;

/// `[B, T, H, d]` of a head-major `[B H, T, d]` (`parts` = 1), or part `part` of
/// `[B, T, H, parts, d]`: the index of element `e` of row `i` of head `bh` in the interleaved
/// buffer.
fn at(
    b_h: (usize, usize),
    t: usize,
    d: usize,
    (parts, part): (usize, usize),
    bh: usize,
    i: usize,
    e: usize,
) -> usize {
    let (_, h) = b_h;
    let (b, hh) = (bh / h, bh % h);
    (((b * t + i) * h + hh) * parts + part) * d + e
}

struct Case {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
    causal: bool,
}

/// The contiguous operands' values: q, k, v, the output gradient.
fn operands<T: Dt>(c: &Case, seed: u64) -> [Vec<T>; 4] {
    let n = c.b * c.h * c.t * c.d;
    [(2.0, 0), (2.0, 1), (1.0, 2), (1.0, 3)].map(|(s, i)| as_dt::<T>(&values(n, s, seed + i)).0)
}

/// Contiguous forward and backward: o, lse, dq, dk, dv.
fn contiguous<T: Dt>(
    c: &Case,
    kernels: FaKernels,
    order: Order,
    ops: &[Vec<T>; 4],
) -> (Vec<T>, Vec<f32>, [Vec<T>; 3]) {
    let bh = c.b * c.h;
    let n = bh * c.t * c.d;
    let shape = Attn {
        bh,
        tq: c.t,
        tk: c.t,
        d: c.d,
    };
    let scale = 1.0 / (c.d as f32).sqrt();
    let [q, k, v, g] = ops.each_ref().map(|x| Buf::from_slice("in", x));
    let nan = T::from_f32(f32::NAN);
    let mut o = Buf::filled("o", n, nan);
    let mut lse = Buf::filled("lse", bh * c.t, f32::NAN);
    fused::flash_attn_fwd(
        order, kernels, &q, &k, &v, &mut o, &mut lse, shape, scale, c.causal,
    )
    .unwrap();
    let [mut dq, mut dk, mut dv] = ["dq", "dk", "dv"].map(|w| Buf::filled(w, n, nan));
    fused::flash_attn_bwd(
        order, kernels, &q, &k, &v, &o, &lse, &g, &mut dq, &mut dk, &mut dv, shape, scale, c.causal,
    )
    .unwrap();
    (
        o.as_slice().to_vec(),
        lse.as_slice().to_vec(),
        [dq, dk, dv].map(|x| x.as_slice().to_vec()),
    )
}

/// Forward and backward on the packed projection: q, k, v read from one `[B, T, H, 3, d]`
/// buffer, o and d_o as `[B, T, H, d]`, dq, dk, dv written into one `[B, T, H, 3, d]`. Returns
/// o, lse and the packed gradient, as written.
fn packed<T: Dt>(
    c: &Case,
    kernels: FaKernels,
    order: Order,
    ops: &[Vec<T>; 4],
) -> (Vec<T>, Vec<f32>, Vec<T>) {
    let bh = c.b * c.h;
    let n = bh * c.t * c.d;
    let bhd = (c.b, c.h);
    let mut x = vec![T::from_f32(0.0); 3 * n];
    let mut g = vec![T::from_f32(0.0); n];
    for head in 0..bh {
        for i in 0..c.t {
            for e in 0..c.d {
                let src = (head * c.t + i) * c.d + e;
                for p in 0..3 {
                    x[at(bhd, c.t, c.d, (3, p), head, i, e)] = ops[p][src];
                }
                g[at(bhd, c.t, c.d, (1, 0), head, i, e)] = ops[3][src];
            }
        }
    }
    let shape = Attn {
        bh,
        tq: c.t,
        tk: c.t,
        d: c.d,
    };
    let scale = 1.0 / (c.d as f32).sqrt();
    let part = |p| FaRows::interleaved(c.t, c.h, 3, p, c.d);
    let out = FaRows::interleaved(c.t, c.h, 1, 0, c.d);
    let (xb, gb) = (Buf::from_slice("qkv", &x), Buf::from_slice("d_o", &g));
    let nan = T::from_f32(f32::NAN);
    let mut o = Buf::filled("o", n, nan);
    let mut lse = Buf::filled("lse", bh * c.t, f32::NAN);
    fused::flash_attn_fwd_rows(
        order,
        kernels,
        (&xb, &xb, &xb),
        &mut o,
        &mut lse,
        [part(0), part(1), part(2), out],
        shape,
        scale,
        c.causal,
    )
    .unwrap();
    let mut dx = Buf::filled("dqkv", 3 * n, nan);
    let rows = FaBwdRows {
        q: part(0),
        k: part(1),
        v: part(2),
        o: out,
        d_o: out,
        dq: part(0),
        dk: part(1),
        dv: part(2),
    };
    fused::flash_attn_bwd_rows(
        order,
        kernels,
        (&xb, &xb, &xb, &o, &lse, &gb),
        &mut dx,
        None,
        rows,
        shape,
        scale,
        c.causal,
    )
    .unwrap();
    (
        o.as_slice().to_vec(),
        lse.as_slice().to_vec(),
        dx.as_slice().to_vec(),
    )
}

fn check_packed<T: Dt>(c: &Case, kernels: FaKernels, seed: u64) {
    let what = format!(
        "{kernels:?} [{}] b {} h {} t {} d {} causal {}",
        T::NAME,
        c.b,
        c.h,
        c.t,
        c.d,
        c.causal
    );
    let ops = operands::<T>(c, seed);
    let (o_c, lse_c, [dq, dk, dv]) = contiguous(c, kernels, Order::Forward, &ops);
    for order in [ORDERS[0], ORDERS[2]] {
        let (o_p, lse_p, dx) = packed(c, kernels, order, &ops);
        assert!(same_bits(&lse_c, &lse_p), "{what} {order:?}: lse");
        let bhd = (c.b, c.h);
        for head in 0..c.b * c.h {
            for i in 0..c.t {
                for e in 0..c.d {
                    let src = (head * c.t + i) * c.d + e;
                    let o_at = at(bhd, c.t, c.d, (1, 0), head, i, e);
                    assert!(
                        same_bits(&o_c[src..=src], &o_p[o_at..=o_at]),
                        "{what} {order:?}: o of head {head} row {i} elem {e}"
                    );
                    for (p, (name, want)) in [("dq", &dq), ("dk", &dk), ("dv", &dv)]
                        .into_iter()
                        .enumerate()
                    {
                        let x = at(bhd, c.t, c.d, (3, p), head, i, e);
                        assert!(
                            same_bits(&want[src..=src], &dx[x..=x]),
                            "{what} {order:?}: {name} of head {head} row {i} elem {e}: {} vs {}",
                            dx[x].to_f32(),
                            want[src].to_f32()
                        );
                    }
                }
            }
        }
        // Every element of the packed gradient and of o written (no NaN fill left).
        assert!(
            dx.iter().chain(&o_p).all(|x| !x.to_f32().is_nan()),
            "{what}: an element left unwritten"
        );
    }
}

fn cases() -> Vec<Case> {
    vec![
        // Several batches and heads, a sequence past one tile and not a multiple of it.
        Case {
            b: 2,
            h: 3,
            t: 37,
            d: 64,
            causal: true,
        },
        Case {
            b: 1,
            h: 2,
            t: 70,
            d: 32,
            causal: false,
        },
        Case {
            b: 2,
            h: 1,
            t: 17,
            d: 48,
            causal: true,
        },
        Case {
            b: 1,
            h: 2,
            t: 20,
            d: 96,
            causal: true,
        },
        Case {
            b: 3,
            h: 1,
            t: 9,
            d: 128,
            causal: false,
        },
    ]
}

#[test]
fn a_packed_projection_gives_the_contiguous_bits_f32() {
    for (i, c) in cases().iter().enumerate() {
        check_packed::<f32>(c, FaKernels::Simt, 10 + i as u64);
    }
}

#[test]
fn a_packed_projection_gives_the_contiguous_bits_bf16() {
    for (i, c) in cases().iter().enumerate() {
        check_packed::<bf16>(c, FaKernels::Simt, 20 + i as u64);
        check_packed::<bf16>(c, FaKernels::TensorCores, 30 + i as u64);
    }
}

/// Rows `pad` elements apart beyond `d` and `off` elements into the buffer: a row stride that
/// is not a multiple of 8 elements, so the tensor-core kernels take their element-by-element
/// copies and stores.
fn padded(t: usize, d: usize, pad: usize, off: usize) -> FaRows {
    let st = d + pad;
    FaRows {
        off: off as i64,
        sb: (t * st) as i64,
        sh: 0,
        st: st as i64,
        heads: 1,
    }
}

/// The elements a buffer of [`padded`] rows needs.
fn buf_len(bh: usize, t: usize, d: usize, r: &FaRows) -> usize {
    r.off as usize + bh * t * r.st as usize + d
}

#[test]
fn rows_at_odd_strides_give_the_contiguous_bits_and_write_only_their_rows() {
    for (kernels, c) in [
        (
            FaKernels::TensorCores,
            Case {
                b: 2,
                h: 1,
                t: 37,
                d: 64,
                causal: true,
            },
        ),
        (
            FaKernels::Simt,
            Case {
                b: 1,
                h: 2,
                t: 33,
                d: 32,
                causal: false,
            },
        ),
    ] {
        let bh = c.b * c.h;
        let ops = operands::<bf16>(&c, 7);
        let (o_c, lse_c, grads_c) = contiguous(&c, kernels, Order::Forward, &ops);
        let r = padded(c.t, c.d, 3, 5);
        let len = buf_len(bh, c.t, c.d, &r);
        let sentinel = bf16::from_f32(-7.5);
        let spread = |x: &[bf16]| {
            let mut out = vec![sentinel; len];
            for head in 0..bh {
                for i in 0..c.t {
                    let at = r.off as usize + head * r.sb as usize + i * r.st as usize;
                    out[at..at + c.d].copy_from_slice(&x[(head * c.t + i) * c.d..][..c.d]);
                }
            }
            out
        };
        let gather = |x: &[bf16]| -> Vec<bf16> {
            (0..bh * c.t)
                .flat_map(|row| {
                    let at = r.off as usize + row * r.st as usize;
                    x[at..at + c.d].to_vec()
                })
                .collect()
        };
        let [q, k, v, g] = ops.each_ref().map(|x| Buf::from_slice("in", &spread(x)));
        let shape = Attn {
            bh,
            tq: c.t,
            tk: c.t,
            d: c.d,
        };
        let scale = 1.0 / (c.d as f32).sqrt();
        let mut o = Buf::from_slice("o", &vec![sentinel; len]);
        let mut lse = Buf::filled("lse", bh * c.t, f32::NAN);
        fused::flash_attn_fwd_rows(
            Order::Forward,
            kernels,
            (&q, &k, &v),
            &mut o,
            &mut lse,
            [r; 4],
            shape,
            scale,
            c.causal,
        )
        .unwrap();
        let mut dq = Buf::from_slice("dq", &vec![sentinel; len]);
        // dK and dV in one buffer: dV's rows after dK's.
        let dv_r = r.shifted(len);
        let mut dkv = Buf::from_slice("dkv", &vec![sentinel; 2 * len]);
        let rows = FaBwdRows {
            q: r,
            k: r,
            v: r,
            o: r,
            d_o: r,
            dq: r,
            dk: r,
            dv: dv_r,
        };
        fused::flash_attn_bwd_rows(
            Order::Forward,
            kernels,
            (&q, &k, &v, &o, &lse, &g),
            &mut dq,
            Some(&mut dkv),
            rows,
            shape,
            scale,
            c.causal,
        )
        .unwrap();
        let what = format!("{kernels:?} padded rows");
        assert!(same_bits(&lse_c, lse.as_slice()), "{what}: lse");
        assert!(same_bits(&o_c, &gather(o.as_slice())), "{what}: o");
        let (dks, dvs) = dkv.as_slice().split_at(len);
        for (name, want, got) in [
            ("dq", &grads_c[0], dq.as_slice()),
            ("dk", &grads_c[1], dks),
            ("dv", &grads_c[2], dvs),
        ] {
            assert!(same_bits(want, &gather(got)), "{what}: {name}");
        }
        // The padding between rows and before the first keeps its sentinel: every write is in
        // a row.
        for (name, buf) in [
            ("o", o.as_slice()),
            ("dq", dq.as_slice()),
            ("dk", dks),
            ("dv", dvs),
        ] {
            let mut in_row = vec![false; len];
            for row in 0..bh * c.t {
                let at = r.off as usize + row * r.st as usize;
                in_row[at..at + c.d].iter_mut().for_each(|x| *x = true);
            }
            assert!(
                buf.iter()
                    .zip(&in_row)
                    .all(|(x, &row)| row || x.to_bits() == sentinel.to_bits()),
                "{what}: {name} written outside its rows"
            );
        }
    }
}

#[test]
fn placements_out_of_bounds_or_overlapping_are_refused() {
    let (bh, t, d) = (4, 10, 32);
    // In bounds exactly, then one element short.
    let c = FaRows::contiguous(t, d);
    assert!(c.check_in("q", bh, t, d, bh * t * d).is_ok());
    let e = c.check_in("q", bh, t, d, bh * t * d - 1).unwrap_err();
    assert!(e.contains("reach element"), "{e}");
    // A packed part: its farthest row ends at the buffer's end only for v.
    let n = bh * t * d * 3;
    let part = |p| FaRows::interleaved(t, 2, 3, p, d);
    for p in 0..3 {
        assert!(part(p).check_in("qkv", bh, t, d, n).is_ok());
    }
    assert!(part(2).check_in("v", bh, t, d, n - 1).is_err());
    // Heads that do not divide bh; negative fields; overflow.
    assert!(part(0)
        .check_in("q", 3, t, d, n)
        .unwrap_err()
        .contains("batches of 2"));
    let neg = FaRows { st: -1, ..c };
    assert!(neg
        .check_in("q", bh, t, d, n)
        .unwrap_err()
        .contains("negative"));
    let wide = FaRows {
        st: MAX_ROW_STRIDE,
        ..c
    };
    assert!(wide
        .check_in("q", 1, 1, d, usize::MAX)
        .unwrap_err()
        .contains("row stride"));
    let huge = FaRows {
        sb: i64::MAX / 2,
        ..c
    };
    assert!(huge
        .check_in("q", bh, t, d, usize::MAX)
        .unwrap_err()
        .contains("overflow"));
    // Writes: the packed parts are apart; a part twice, rows closer than d, or two contiguous
    // operands at overlapping offsets are not.
    assert!(check_disjoint("g", &[part(0), part(1), part(2)], bh, t, d).is_ok());
    assert!(check_disjoint("g", &[part(0), part(0)], bh, t, d).is_err());
    let close = FaRows {
        st: (d - 1) as i64,
        ..c
    };
    assert!(check_disjoint("g", &[close], bh, t, d)
        .unwrap_err()
        .contains("overlap"));
    let shifted = c.shifted(bh * t * d - 1);
    assert!(check_disjoint("g", &[c, shifted], bh, t, d).is_err());
    assert!(check_disjoint("g", &[c, c.shifted(bh * t * d)], bh, t, d).is_ok());
    // Slots of a period that do not fit it: part offsets d/2 apart.
    let half = FaRows {
        off: (d / 2) as i64,
        ..part(0)
    };
    assert!(check_disjoint("g", &[part(0), half], bh, t, d).is_err());

    // The launchers refuse them before any launch.
    let shape = Attn {
        bh,
        tq: t,
        tk: t,
        d,
    };
    let x = Buf::from_slice("qkv", &vec![0f32; n]);
    let short = Buf::from_slice("qkv", &vec![0f32; n - 1]);
    let mut o = Buf::filled("o", bh * t * d, f32::NAN);
    let mut lse = Buf::filled("lse", bh * t, f32::NAN);
    let out = FaRows::interleaved(t, 2, 1, 0, d);
    // The SIMT forward on one buffer for q, k and v, and the backward into one packed gradient.
    let mut fwd = |qkv: &Buf<f32>, o_rows: FaRows| {
        fused::flash_attn_fwd_rows(
            Order::Forward,
            FaKernels::Simt,
            (qkv, qkv, qkv),
            &mut o,
            &mut lse,
            [part(0), part(1), part(2), o_rows],
            shape,
            1.0,
            true,
        )
        .map_err(|e| e.to_string())
    };
    let e = fwd(&short, out).unwrap_err();
    assert!(e.contains("v: rows"), "{e}");
    let e = fwd(&x, close).unwrap_err();
    assert!(e.contains("overlap"), "{e}");
    fwd(&x, out).unwrap();
    let mut dx = Buf::filled("dqkv", n, f32::NAN);
    let g = Buf::from_slice("g", &vec![0f32; bh * t * d]);
    let mut bwd = |rows: FaBwdRows, shape: Attn| {
        fused::flash_attn_bwd_rows(
            Order::Forward,
            FaKernels::Simt,
            (&x, &x, &x, &o, &lse, &g),
            &mut dx,
            None,
            rows,
            shape,
            1.0,
            true,
        )
        .map_err(|e| e.to_string())
    };
    let rows = FaBwdRows {
        q: part(0),
        k: part(1),
        v: part(2),
        o: out,
        d_o: out,
        dq: part(0),
        dk: part(0),
        dv: part(2),
    };
    let e = bwd(rows, shape).unwrap_err();
    assert!(e.contains("may overlap"), "{e}");
    // One buffer for all three gradients needs as many keys as queries.
    let rows = FaBwdRows {
        dk: part(1),
        ..rows
    };
    let e = bwd(rows, Attn { tk: t - 1, ..shape }).unwrap_err();
    assert!(e.contains("tq = tk"), "{e}");
}
