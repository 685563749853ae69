//! Bad input: typed errors that carry the op context; nothing hangs.

use std::sync::Arc;

use super::*;
use candle_dtensor_comm_core::{dtype_supported, P2POp, SUPPORTED_DTYPES};

/// Runs `f` on this rank (collecting its errors), checks it was quick, and that the
/// communicator is still usable afterwards (every error here is caught before anything is
/// issued, on every rank alike).
fn errors(
    cx: &Cx,
    f: impl Fn(&Comm) -> Vec<(&'static str, CommError)>,
) -> R<Vec<(&'static str, CommError)>> {
    let t0 = Instant::now();
    let errs = f(&cx.comm);
    cx.comm.barrier()?.wait()?;
    // Quick: an error that reached the peers (an op half issued) would leave the barrier to
    // time out. Bounded by the op timeout, not a fixed time, so load alone cannot fail it.
    assert_prompt(
        t0.elapsed(),
        cx.comm.timeout(),
        &format_args!("rank {}: bad input and a barrier", cx.rank()),
    );
    Ok(errs)
}

fn check_all(
    cx: &Cx,
    errs: &[(&'static str, CommError)],
    kind: fn(&CommError) -> bool,
    needles: &[String],
) {
    let rank = cx.rank();
    assert_eq!(errs.len(), needles.len());
    for ((op, e), needle) in errs.iter().zip(needles) {
        assert!(kind(e), "rank {rank}: unexpected kind: {e}");
        assert_ctx(e, op, cx.comm.name(), rank);
        assert!(
            e.to_string().contains(needle.as_str()),
            "rank {rank}: {e:?} lacks {needle:?}"
        );
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn t(n: usize) -> Tensor {
    Tensor::ones(n, DType::F32, &Device::Cpu).expect("a CPU tensor")
}

fn invalid(e: &CommError) -> bool {
    matches!(e, CommError::InvalidArgument { .. })
}

pub(super) fn ranks_out_of_range(cx: &Cx) -> R<()> {
    let n = cx.size();
    let errs = errors(cx, |c| {
        vec![
            (
                "broadcast",
                fails(c.broadcast(&t(2), n).map(drop), "broadcast"),
            ),
            (
                "reduce",
                fails(c.reduce(&t(2), n, ReduceOp::Sum).map(drop), "reduce"),
            ),
            ("gather", fails(c.gather(&t(2), n + 6).map(drop), "gather")),
            ("scatter", fails(c.scatter(&[], n).map(drop), "scatter")),
            ("send", fails(c.send(&t(2), n).map(drop), "send")),
            (
                "recv",
                fails(c.recv(n + 1, 2, DType::F32).map(drop), "recv"),
            ),
            (
                "batch_p2p",
                fails(
                    c.batch_p2p(vec![
                        P2POp::Send {
                            tensor: t(1),
                            peer: 0,
                        },
                        P2POp::Send {
                            tensor: t(1),
                            peer: n,
                        },
                    ])
                    .map(drop),
                    "batch",
                ),
            ),
        ]
    })?;
    check_all(
        cx,
        &errs,
        invalid,
        &[
            format!("root rank {n} out of range for a communicator of size {n}"),
            format!("root rank {n}"),
            format!("root rank {}", n + 6),
            format!("root rank {n}"),
            format!("destination rank {n}"),
            format!("source rank {}", n + 1),
            format!("peer rank {n}"),
        ],
    );
    Ok(())
}

pub(super) fn dim_0_must_divide(cx: &Cx) -> R<()> {
    let n = cx.size();
    let odd = 2 * n - 1; // never divisible by n >= 2
    let errs = errors(cx, |c| {
        let scalar = Tensor::new(1f32, &Device::Cpu).expect("a CPU tensor");
        vec![
            (
                "reduce_scatter_single",
                fails(
                    c.reduce_scatter_single(&t(odd), ReduceOp::Sum).map(drop),
                    "rs",
                ),
            ),
            (
                "reduce_scatter_single",
                fails(
                    c.reduce_scatter_single(&scalar, ReduceOp::Sum).map(drop),
                    "rs scalar",
                ),
            ),
            (
                "all_to_all_single",
                fails(c.all_to_all_single(&t(odd)).map(drop), "a2a"),
            ),
            (
                "all_to_all_single",
                fails(
                    c.all_to_all_single_into(&t(odd), &t(odd)).map(drop),
                    "a2a into",
                ),
            ),
        ]
    })?;
    check_all(
        cx,
        &errs,
        invalid,
        &[
            format!("divisible by the communicator size {n}"),
            "[]".to_string(),
            format!("[{odd}]"),
            format!("[{odd}]"),
        ],
    );
    Ok(())
}

pub(super) fn all_to_all_v_bad_lists(cx: &Cx) -> R<()> {
    let n = cx.size();
    let ones = vec![1; n];
    let short = vec![1; n.saturating_sub(1)];
    let long = vec![0; n + 1];
    let mut bad_sum = vec![1; n];
    bad_sum[n - 1] = 2;
    let errs = errors(cx, |c| {
        vec![
            (
                "all_to_all_v_single",
                fails(
                    c.all_to_all_v_single(&t(n), &short, &ones).map(drop),
                    "short out",
                ),
            ),
            (
                "all_to_all_v_single",
                fails(
                    c.all_to_all_v_single(&t(n), &ones, &long).map(drop),
                    "long in",
                ),
            ),
            (
                "all_to_all_v_single",
                fails(
                    c.all_to_all_v_single(&t(n), &ones, &bad_sum).map(drop),
                    "bad sum",
                ),
            ),
            (
                // The same collective on the wire: errors name it all_to_all_v_single.
                "all_to_all_v_single",
                fails(
                    c.all_to_all_v_rows(&t(n), &Arc::new(vec![0; n + 1]), &ones, &ones)
                        .map(drop),
                    "rows vs splits",
                ),
            ),
            (
                "all_to_all_v_single",
                fails(
                    c.all_to_all_v_rows(&t(n), &Arc::new(vec![n as u32; n]), &ones, &ones)
                        .map(drop),
                    "row out of range",
                ),
            ),
        ]
    })?;
    check_all(
        cx,
        &errs,
        invalid,
        &[
            format!("one entry per rank ({n}); got {} output", n - 1),
            format!("got {n} output and {} input", n + 1),
            format!("sum to {} but the input has {n}", n + 1),
            format!("sum to {n} but the input has {} rows", n + 1),
            format!("row {n} is outside the input's {n} rows"),
        ],
    );
    Ok(())
}

pub(super) fn all_to_all_v_inconsistent_lists(cx: &Cx) -> R<()> {
    // Every rank sends one row to every rank, except rank 0 sends two to rank 1, which expects
    // one. Only rank 1 sees a bad count on its own side; all must fail, at once.
    let (n, me) = (cx.size(), cx.rank());
    for large in [false, true] {
        let comm = cx.fresh(if large { "a2av-large" } else { "a2av-small" })?;
        let w = if large { 30_000 } else { 2 };
        let t0 = Instant::now();
        let mut ins = vec![1; n];
        if me == 0 {
            ins[1] = 2;
        }
        let rows: usize = ins.iter().sum();
        let x = Tensor::ones((rows, w), DType::F32, &Device::Cpu)?;
        let r = comm.all_to_all_v_single(&x, &vec![1; n], &ins)?.wait();
        let e = fails(r, "inconsistent splits");
        // At once on every rank, not after the op timeout (the bound is relative to it, so
        // load alone cannot fail it).
        assert_prompt(
            t0.elapsed(),
            comm.timeout(),
            &format_args!("large {large}, rank {me}: inconsistent splits"),
        );
        assert!(invalid(&e), "large {large}, rank {me}: {e}");
        assert_ctx(&e, "all_to_all_v_single", comm.name(), me);
        assert!(
            e.to_string().contains("rank 0 sends 2 slices to rank 1"),
            "rank {me}: {e}"
        );
    }
    Ok(())
}

pub(super) fn recv_of_another_shape_or_dtype(cx: &Cx) -> R<()> {
    let comm = &cx.comm;
    match cx.rank() {
        0 => {
            comm.send(&t(4), 1)?.wait()?;
            comm.send(&t(4), 1)?.wait()?;
            comm.send(&t(4), 1)?.wait()?;
        }
        1 => {
            let a = fails(comm.recv(0, 5, DType::F32)?.wait(), "shape");
            let b = fails(comm.recv(0, 4, DType::F64)?.wait(), "dtype");
            // Mismatches are not fatal: the next matching recv works.
            let ok = comm.recv(0, 4, DType::F32)?.wait()?;
            assert_eq!(ok.to_vec1::<f32>()?, vec![1.0; 4]);
            for (e, needles) in [a, b].iter().zip([["[5]", "[4]"], ["F64", "F32"]]) {
                assert!(invalid(e), "{e}");
                assert_ctx(e, "recv", comm.name(), 1);
                for n in needles {
                    assert!(e.to_string().contains(n), "{e} lacks {n}");
                }
            }
        }
        _ => {}
    }
    comm.barrier()?.wait()?;
    Ok(())
}

pub(super) fn unsupported_dtypes(cx: &Cx) -> R<()> {
    for dt in SUPPORTED_DTYPES {
        assert!(dtype_supported(dt), "{dt:?}");
    }
    for dt in [DType::I32, DType::I16, DType::F8E4M3] {
        assert!(!dtype_supported(dt), "{dt:?}");
    }
    let errs = errors(cx, |c| {
        let i32s = Tensor::zeros(4, DType::I32, &Device::Cpu).expect("a CPU tensor");
        let i16s = Tensor::zeros(4, DType::I16, &Device::Cpu).expect("a CPU tensor");
        let pieces = vec![i32s.clone(); c.size()];
        vec![
            (
                "all_reduce",
                fails(c.all_reduce(&i32s, ReduceOp::Sum).map(drop), "i32"),
            ),
            (
                "all_gather_single",
                fails(c.all_gather_single(&i16s).map(drop), "i16"),
            ),
            ("send", fails(c.send(&i32s, 0).map(drop), "send i32")),
            (
                "recv",
                fails(c.recv(0, 4, DType::I32).map(drop), "recv i32"),
            ),
            (
                "batch_p2p",
                fails(
                    c.batch_p2p(vec![P2POp::Recv {
                        peer: 0,
                        shape: 4.into(),
                        dtype: DType::I16,
                    }])
                    .map(drop),
                    "p2p",
                ),
            ),
            (
                "scatter",
                fails(c.scatter(&pieces, c.rank()).map(drop), "scatter"),
            ),
        ]
    })?;
    let is = |e: &CommError| matches!(e, CommError::UnsupportedDType { .. });
    check_all(
        cx,
        &errs,
        is,
        &strings(&["I32", "I16", "I32", "I32", "I16", "I32"]),
    );
    Ok(())
}

pub(super) fn bad_outputs_of_into_variants(cx: &Cx) -> R<()> {
    let n = cx.size();
    let errs = errors(cx, |c| {
        let x = Tensor::ones((4 * n, 2), DType::F32, &Device::Cpu).expect("a CPU tensor");
        let wrong_len = Tensor::zeros(8 * n - 1, DType::F32, &Device::Cpu).expect("a tensor");
        let wrong_dtype = Tensor::zeros(8 * n, DType::F64, &Device::Cpu).expect("a tensor");
        let strided = Tensor::zeros((2, 4 * n), DType::F32, &Device::Cpu)
            .and_then(|t| t.t())
            .expect("a tensor");
        let big = Tensor::zeros(8 * n * n, DType::F32, &Device::Cpu).expect("a tensor");
        let head = big
            .narrow(0, 0, 8 * n)
            .and_then(|h| h.reshape((4 * n, 2)))
            .expect("a view");
        vec![
            (
                "all_reduce",
                fails(
                    c.all_reduce_into(&wrong_len, &x, ReduceOp::Sum).map(drop),
                    "len",
                ),
            ),
            (
                "all_reduce",
                fails(
                    c.all_reduce_into(&wrong_dtype, &x, ReduceOp::Sum).map(drop),
                    "dtype",
                ),
            ),
            (
                "all_reduce",
                fails(
                    c.all_reduce_into(&strided, &x, ReduceOp::Sum).map(drop),
                    "strided",
                ),
            ),
            // The output overlaps the input (it starts where the input starts).
            (
                "all_gather_single",
                fails(c.all_gather_single_into(&big, &head).map(drop), "overlap"),
            ),
            (
                "reduce_scatter_single",
                fails(
                    c.reduce_scatter_single_into(&head, &head, ReduceOp::Sum)
                        .map(drop),
                    "alias",
                ),
            ),
            (
                "all_to_all_single",
                fails(c.all_to_all_single_into(&x, &x).map(drop), "alias"),
            ),
        ]
    })?;
    check_all(
        cx,
        &errs,
        invalid,
        &[
            format!("holds {} elements but the result has {}", 8 * n - 1, 8 * n),
            "F64".to_string(),
            "contiguous".to_string(),
            "overlaps".to_string(),
            if n > 1 {
                format!("holds {} elements but the result has {}", 8 * n, 8)
            } else {
                "overlaps".to_string() // one rank: the sizes agree, the aliasing does not
            },
            "overlaps".to_string(),
        ],
    );
    Ok(())
}

pub(super) fn bad_scatter_arguments(cx: &Cx) -> R<()> {
    let n = cx.size();
    let errs = errors(cx, |c| {
        let f = t(2);
        let d = Tensor::zeros(2, DType::F64, &Device::Cpu).expect("a CPU tensor");
        if c.rank() == 0 {
            let mut mixed = vec![f.clone(); n];
            mixed[n - 1] = d;
            vec![
                (
                    "scatter",
                    fails(c.scatter(std::slice::from_ref(&f), 0).map(drop), "too few"),
                ),
                (
                    "scatter",
                    fails(c.scatter(&mixed, 0).map(drop), "mixed dtypes"),
                ),
            ]
        } else {
            vec![
                (
                    "scatter",
                    fails(
                        c.scatter(std::slice::from_ref(&f), 0).map(drop),
                        "non-root inputs",
                    ),
                ),
                (
                    "scatter",
                    fails(
                        c.scatter(&vec![f.clone(); n], 0).map(drop),
                        "non-root inputs",
                    ),
                ),
            ]
        }
    })?;
    if cx.rank() == 0 {
        check_all(
            cx,
            &errs,
            invalid,
            &[
                format!("one tensor per rank ({n}); got 1"),
                "share one dtype".to_string(),
            ],
        );
    } else {
        for (op, e) in &errs {
            assert!(invalid(e), "{e}");
            assert_ctx(e, op, cx.comm.name(), cx.rank());
            assert!(
                e.to_string()
                    .contains("only the root (0) passes scatter inputs"),
                "{e}"
            );
        }
    }
    Ok(())
}

pub(super) fn non_contiguous_inputs(cx: &Cx) -> R<()> {
    let (n, comm) = (cx.size(), &cx.comm);
    let base = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
    let x = (base + cx.rank() as f64)?.t()?; // [3, 2], strided
    assert!(!x.is_contiguous());
    let y = out(&comm.all_reduce(&x, ReduceOp::Sum)?.wait()?)?;
    let g = out(&comm.all_gather_single(&x.narrow(0, 1, 1)?)?.wait()?)?;
    // x[i][j] = 3j + i + rank.
    let shift: f64 = (0..n).map(|r| r as f64).sum();
    let want_y: Vec<f64> = (0..3)
        .flat_map(|i| (0..2).map(move |j| n as f64 * (3 * j + i) as f64 + shift))
        .collect();
    let want_g: Vec<f64> = (0..n)
        .flat_map(|r| (0..2).map(move |j| (3 * j + 1 + r) as f64))
        .collect();
    assert_eq!(y, (vec![3, 2], want_y));
    assert_eq!(g, (vec![n, 2], want_g));
    Ok(())
}
