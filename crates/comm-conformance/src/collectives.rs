//! Every collective against a reference computed on the rank itself.

use super::*;

/// How a case calls the op: plain, `*_into` a fresh output, or in place.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    Plain,
    Into,
    InPlace,
}

#[derive(Debug)]
struct RedCase {
    dt: DType,
    op: ReduceOp,
    class: usize,
    salt: usize,
    variant: Variant,
}

/// dtype x op (where defined) x size class, sampled; the variant rotates with the world.
fn red_cases(cx: &Cx, variants: &[Variant]) -> Vec<RedCase> {
    let n = cx.size();
    let mut v = Vec::new();
    for (a, &dt) in DTYPES.iter().enumerate() {
        for (b, &op) in REDUCE_OPS.iter().enumerate() {
            if !candle_dtensor_comm_core::reduce_supported(op, dt) {
                continue;
            }
            for class in 0..CLASSES {
                if cx.sampled(a, b, class) {
                    v.push(RedCase {
                        dt,
                        op,
                        class,
                        salt: a * 5 + b,
                        variant: variants[(n + a + b + class) % variants.len()],
                    });
                }
            }
        }
    }
    v
}

#[derive(Debug)]
struct CopyCase {
    dt: DType,
    class: usize,
    salt: usize,
    variant: Variant,
}

fn copy_cases(cx: &Cx, variants: &[Variant]) -> Vec<CopyCase> {
    let n = cx.size();
    let mut v = Vec::new();
    for (a, &dt) in DTYPES.iter().enumerate() {
        for class in 0..CLASSES {
            if cx.sampled(a, 0, class) {
                v.push(CopyCase {
                    dt,
                    class,
                    salt: a,
                    variant: variants[(n + a + class) % variants.len()],
                });
            }
        }
    }
    v
}

fn elems(shape: &[usize]) -> usize {
    shape.iter().product()
}

pub(super) fn all_reduce(cx: &Cx) -> R<()> {
    sweep(
        cx,
        red_cases(cx, &[Variant::Plain, Variant::Into, Variant::InPlace]),
        |comm, c| {
            let shape = flat_shape(c.class);
            let vals = red_vals(comm.rank(), elems(&shape), c.dt, c.op, c.salt);
            let x = tensor(&vals, &shape, c.dt)?;
            let y = match c.variant {
                Variant::Plain => comm.all_reduce(&x, c.op)?.wait()?,
                Variant::Into => {
                    let o = Tensor::zeros(shape.as_slice(), c.dt, &Device::Cpu)?;
                    let r = comm.all_reduce_into(&o, &x, c.op)?.wait()?;
                    assert_eq!(out(&r)?, out(&o)?, "{c:?}: the work returns the output");
                    // The input is untouched.
                    assert_eq!(out(&x)?.1, vals, "{c:?}: input changed");
                    o
                }
                Variant::InPlace => {
                    comm.all_reduce_into(&x, &x, c.op)?.wait()?;
                    x
                }
            };
            Ok(vec![out(&y)?])
        },
        |n, _, c| {
            let shape = flat_shape(c.class);
            let ins: Vec<_> = (0..n)
                .map(|r| red_vals(r, elems(&shape), c.dt, c.op, c.salt))
                .collect();
            vec![(shape, reduce_ref(c.op, c.dt, &ins))]
        },
    )
}

pub(super) fn all_reduce_in_place_large(cx: &Cx) -> R<()> {
    // A large path that reads peers' inputs and then overwrites the caller's: pin the in-place
    // variant there, with an element count that does not divide by most world sizes.
    let (n, me, comm) = (cx.size(), cx.rank(), &cx.comm);
    let len = LARGE_ELEMS + 5;
    let vals = red_vals(me, len, DType::F32, ReduceOp::Sum, 1);
    let x = tensor(&vals, &[len], DType::F32)?;
    comm.all_reduce_into(&x, &x, ReduceOp::Sum)?.wait()?;
    // Twice in a row on the same buffer.
    comm.all_reduce_into(&x, &x, ReduceOp::Max)?.wait()?;
    let ins: Vec<_> = (0..n)
        .map(|r| red_vals(r, len, DType::F32, ReduceOp::Sum, 1))
        .collect();
    let want = (vec![len], reduce_ref(ReduceOp::Sum, DType::F32, &ins));
    check(n, me, &"in-place sum then max", &[out(&x)?], &[want]);
    Ok(())
}

pub(super) fn reduce_scatter_single(cx: &Cx) -> R<()> {
    sweep(
        cx,
        red_cases(cx, &[Variant::Plain, Variant::Into]),
        |comm, c| {
            let shape = div_shape(c.class, comm.size());
            let vals = red_vals(comm.rank(), elems(&shape), c.dt, c.op, c.salt);
            let x = tensor(&vals, &shape, c.dt)?;
            let y = match c.variant {
                Variant::Into => {
                    let o = Tensor::zeros(elems(&shape) / comm.size(), c.dt, &Device::Cpu)?;
                    comm.reduce_scatter_single_into(&o, &x, c.op)?.wait()?;
                    let mut d = shape.clone();
                    d[0] /= comm.size();
                    o.reshape(d)?
                }
                _ => comm.reduce_scatter_single(&x, c.op)?.wait()?,
            };
            Ok(vec![out(&y)?])
        },
        |n, r, c| {
            let shape = div_shape(c.class, n);
            let ins: Vec<_> = (0..n)
                .map(|r| red_vals(r, elems(&shape), c.dt, c.op, c.salt))
                .collect();
            let full = reduce_ref(c.op, c.dt, &ins);
            let chunk = full.len() / n;
            let mut d = shape.clone();
            d[0] /= n;
            vec![(d, full[r * chunk..(r + 1) * chunk].to_vec())]
        },
    )
}

pub(super) fn all_gather_single(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain, Variant::Into]),
        |comm, c| {
            let shape = flat_shape(c.class);
            let x = tensor(&copy_vals(comm.rank(), elems(&shape), c.salt), &shape, c.dt)?;
            let y = match c.variant {
                Variant::Into => {
                    let mut d = shape.clone();
                    d[0] *= comm.size();
                    let o = Tensor::zeros(d, c.dt, &Device::Cpu)?;
                    let r = comm.all_gather_single_into(&o, &x)?.wait()?;
                    assert_eq!(out(&r)?, out(&o)?, "{c:?}: the work returns the output");
                    o
                }
                _ => comm.all_gather_single(&x)?.wait()?,
            };
            Ok(vec![out(&y)?])
        },
        |n, _, c| {
            let shape = flat_shape(c.class);
            let mut d = shape.clone();
            d[0] *= n;
            let all: Vec<f64> = (0..n)
                .flat_map(|r| copy_vals(r, elems(&shape), c.salt))
                .collect();
            vec![(d, all)]
        },
    )
}

pub(super) fn all_gather_single_of_a_scalar(cx: &Cx) -> R<()> {
    let n = cx.size();
    let x = Tensor::new(cx.rank() as i64 * 3, &Device::Cpu)?;
    let got = out(&cx.comm.all_gather_single(&x)?.wait()?)?;
    let want = (vec![n], (0..n).map(|r| (r * 3) as f64).collect::<Vec<_>>());
    assert_eq!(got, want, "rank {}: a scalar stacks to [n]", cx.rank());
    Ok(())
}

pub(super) fn all_to_all_single(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain, Variant::Into]),
        |comm, c| {
            let shape = div_shape(c.class, comm.size());
            let x = tensor(&copy_vals(comm.rank(), elems(&shape), c.salt), &shape, c.dt)?;
            let y = match c.variant {
                Variant::Into => {
                    let o = Tensor::zeros(shape.as_slice(), c.dt, &Device::Cpu)?;
                    comm.all_to_all_single_into(&o, &x)?.wait()?;
                    o
                }
                _ => comm.all_to_all_single(&x)?.wait()?,
            };
            Ok(vec![out(&y)?])
        },
        |n, r, c| {
            let shape = div_shape(c.class, n);
            let chunk = elems(&shape) / n;
            let v = (0..n)
                .flat_map(|j| {
                    copy_vals(j, elems(&shape), c.salt)[r * chunk..(r + 1) * chunk].to_vec()
                })
                .collect();
            vec![(shape.clone(), v)]
        },
    )
}

/// Rows rank `i` sends to rank `j` in the all_to_all_v sweep (zero for some pairs).
fn v_split(i: usize, j: usize, class: usize) -> usize {
    if class == ZERO {
        0
    } else {
        (i + 2 * j + 1) % 4
    }
}

/// Row width of an all_to_all_v size class (large: > 64 KiB per rank in every dtype).
fn v_width(class: usize, n: usize) -> usize {
    match class {
        0 => 3,
        1 => 1,
        2 => 13,
        3 => 100,
        _ if n < 4 => LARGE_ELEMS,
        _ => 20_000,
    }
}

pub(super) fn all_to_all_v_single(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let (n, me) = (comm.size(), comm.rank());
            let w = v_width(c.class, n);
            let ins: Vec<usize> = (0..n).map(|j| v_split(me, j, c.class)).collect();
            let outs: Vec<usize> = (0..n).map(|j| v_split(j, me, c.class)).collect();
            let rows: usize = ins.iter().sum();
            let x = tensor(&copy_vals(me, rows * w, c.salt), &[rows, w], c.dt)?;
            let y = comm.all_to_all_v_single(&x, &outs, &ins)?.wait()?;
            Ok(vec![out(&y)?])
        },
        |n, r, c| {
            let w = v_width(c.class, n);
            let mut v = Vec::new();
            for j in 0..n {
                let rows_j: usize = (0..n).map(|k| v_split(j, k, c.class)).sum();
                let data = copy_vals(j, rows_j * w, c.salt);
                let start: usize = (0..r).map(|k| v_split(j, k, c.class)).sum();
                let len = v_split(j, r, c.class);
                v.extend_from_slice(&data[start * w..(start + len) * w]);
            }
            vec![(vec![v.len() / w, w], v)]
        },
    )
}

/// The row of rank `j`'s source that its `r`-th sent row is, in [`all_to_all_v_rows`]: a
/// permutation with repeats over `src` rows.
fn v_row(j: usize, r: usize, src: usize, salt: usize) -> usize {
    (r * 7 + j + salt) % src
}

/// `all_to_all_v_rows` (the send rows read in place from a larger source) gives what
/// `all_to_all_v_single` of the gathered rows gives; odd ranks send the gathered tensor
/// through `all_to_all_v_single`, so the two forms also meet in one collective.
pub(super) fn all_to_all_v_rows(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let (n, me) = (comm.size(), comm.rank());
            let w = v_width(c.class, n);
            let ins: Vec<usize> = (0..n).map(|j| v_split(me, j, c.class)).collect();
            let outs: Vec<usize> = (0..n).map(|j| v_split(j, me, c.class)).collect();
            let rows: usize = ins.iter().sum();
            let src = rows + 2;
            let x = tensor(&copy_vals(me, src * w, c.salt), &[src, w], c.dt)?;
            let ids: Vec<u32> = (0..rows)
                .map(|r| v_row(me, r, src, c.salt) as u32)
                .collect();
            let y = if me % 2 == 0 {
                comm.all_to_all_v_rows(&x, &std::sync::Arc::new(ids), &outs, &ins)?
                    .wait()?
            } else {
                let ids = Tensor::from_slice(ids.as_slice(), rows, &Device::Cpu)?;
                let sent = x.index_select(&ids, 0)?;
                comm.all_to_all_v_single(&sent, &outs, &ins)?.wait()?
            };
            Ok(vec![out(&y)?])
        },
        |n, r, c| {
            let w = v_width(c.class, n);
            let mut v = Vec::new();
            for j in 0..n {
                let rows_j: usize = (0..n).map(|k| v_split(j, k, c.class)).sum();
                let src = rows_j + 2;
                let data = copy_vals(j, src * w, c.salt);
                let start: usize = (0..r).map(|k| v_split(j, k, c.class)).sum();
                for q in start..start + v_split(j, r, c.class) {
                    let row = v_row(j, q, src, c.salt);
                    v.extend_from_slice(&data[row * w..(row + 1) * w]);
                }
            }
            vec![(vec![v.len() / w, w], v)]
        },
    )
}

pub(super) fn broadcast(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let shape = flat_shape(c.class);
            let root = (c.salt + c.class) % comm.size();
            let x = if comm.rank() == root {
                tensor(&copy_vals(root, elems(&shape), c.salt), &shape, c.dt)?
            } else {
                Tensor::zeros(shape.as_slice(), c.dt, &Device::Cpu)?
            };
            Ok(vec![out(&comm.broadcast(&x, root)?.wait()?)?])
        },
        |n, _, c| {
            let shape = flat_shape(c.class);
            let root = (c.salt + c.class) % n;
            vec![(shape.clone(), copy_vals(root, elems(&shape), c.salt))]
        },
    )
}

pub(super) fn reduce(cx: &Cx) -> R<()> {
    sweep(
        cx,
        red_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let shape = flat_shape(c.class);
            let root = (c.salt + c.class) % comm.size();
            let vals = red_vals(comm.rank(), elems(&shape), c.dt, c.op, c.salt);
            let x = tensor(&vals, &shape, c.dt)?;
            let y = comm.reduce(&x, root, c.op)?.wait()?;
            assert_eq!(
                y.is_some(),
                comm.rank() == root,
                "{c:?}: only the root gets it"
            );
            y.iter().map(out).collect()
        },
        |n, r, c| {
            let shape = flat_shape(c.class);
            if r != (c.salt + c.class) % n {
                return vec![];
            }
            let ins: Vec<_> = (0..n)
                .map(|r| red_vals(r, elems(&shape), c.dt, c.op, c.salt))
                .collect();
            vec![(shape.clone(), reduce_ref(c.op, c.dt, &ins))]
        },
    )
}

/// Gather and scatter pieces differ in dim 0 per rank (rank 0's zero-class piece is empty).
fn ragged(class: usize, r: usize) -> Vec<usize> {
    let mut s = flat_shape(class);
    s[0] += r;
    s
}

pub(super) fn gather(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let root = (c.salt + c.class) % comm.size();
            let shape = ragged(c.class, comm.rank());
            let x = tensor(&copy_vals(comm.rank(), elems(&shape), c.salt), &shape, c.dt)?;
            let y = comm.gather(&x, root)?.wait()?;
            assert_eq!(
                y.is_some(),
                comm.rank() == root,
                "{c:?}: only the root gets it"
            );
            y.unwrap_or_default().iter().map(out).collect()
        },
        |n, r, c| {
            if r != (c.salt + c.class) % n {
                return vec![];
            }
            (0..n)
                .map(|j| {
                    let s = ragged(c.class, j);
                    let v = copy_vals(j, elems(&s), c.salt);
                    (s, v)
                })
                .collect()
        },
    )
}

pub(super) fn scatter(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let root = (c.salt + c.class) % comm.size();
            let pieces = if comm.rank() == root {
                (0..comm.size())
                    .map(|j| {
                        let s = ragged(c.class, j);
                        tensor(&copy_vals(100 + j, elems(&s), c.salt), &s, c.dt)
                    })
                    .collect::<R<Vec<_>>>()?
            } else {
                vec![]
            };
            Ok(vec![out(&comm.scatter(&pieces, root)?.wait()?)?])
        },
        |_, r, c| {
            let s = ragged(c.class, r);
            let v = copy_vals(100 + r, elems(&s), c.salt);
            vec![(s, v)]
        },
    )
}

pub(super) fn send_recv_ring(cx: &Cx) -> R<()> {
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let (n, me) = (comm.size(), comm.rank());
            let shape = flat_shape(c.class);
            let x = tensor(&copy_vals(me, elems(&shape), c.salt), &shape, c.dt)?;
            // Sends are buffered, so everyone sending first cannot deadlock.
            comm.send(&x, (me + 1) % n)?.wait()?;
            let y = comm
                .recv((me + n - 1) % n, shape.as_slice(), c.dt)?
                .wait()?;
            Ok(vec![out(&y)?])
        },
        |n, r, c| {
            let shape = flat_shape(c.class);
            let from = (r + n - 1) % n;
            vec![(shape.clone(), copy_vals(from, elems(&shape), c.salt))]
        },
    )
}

pub(super) fn batch_p2p_all_pairs(cx: &Cx) -> R<()> {
    use candle_dtensor_comm_core::P2POp;
    // Piece sent from i to j: its shape and data depend on both.
    fn piece(class: usize, i: usize, j: usize) -> Vec<usize> {
        let mut s = flat_shape(class);
        if class != ZERO {
            s[0] += (i + j) % 3;
        }
        s
    }
    sweep(
        cx,
        copy_cases(cx, &[Variant::Plain]),
        |comm, c| {
            let (n, me) = (comm.size(), comm.rank());
            let mut ops = Vec::new();
            // Receives before sends and in a rank-dependent order: the group must not care.
            for k in 0..n {
                let j = (me + k) % n;
                ops.push(P2POp::Recv {
                    peer: j,
                    shape: piece(c.class, j, me).into(),
                    dtype: c.dt,
                });
            }
            for j in 0..n {
                let s = piece(c.class, me, j);
                let data = copy_vals(me * 8 + j, elems(&s), c.salt);
                ops.push(P2POp::Send {
                    tensor: tensor(&data, &s, c.dt)?,
                    peer: j,
                });
            }
            let got = comm.batch_p2p(ops)?.wait()?;
            got.iter().map(out).collect()
        },
        |n, me, c| {
            (0..n)
                .map(|k| {
                    let j = (me + k) % n;
                    let s = piece(c.class, j, me);
                    let v = copy_vals(j * 8 + me, elems(&s), c.salt);
                    (s, v)
                })
                .collect()
        },
    )
}

pub(super) fn barrier_holds_every_rank(cx: &Cx) -> R<()> {
    // The last rank arrives at each barrier `LATE` after the others; nobody may leave before it.
    // No clock is shared between ranks (they may be processes), so each rank times its own
    // wait, measured from leaving the previous barrier (ranks leave a barrier together, within
    // `SLACK`). A rank descheduled between leaving one barrier and reading the clock (a loaded
    // machine) measures that much less, so the slack is large: a rank that leaves early still
    // measures next to nothing against the 40 ms it must wait at least.
    const LATE: Duration = Duration::from_millis(100);
    const SLACK: Duration = Duration::from_millis(60);
    let comm = &cx.comm;
    let late = cx.rank() + 1 == cx.size();
    comm.barrier()?.wait()?;
    for k in 0..3 {
        let t0 = Instant::now();
        if late {
            std::thread::sleep(LATE);
        }
        comm.barrier()?.wait()?;
        let waited = t0.elapsed();
        assert!(
            waited + SLACK >= LATE,
            "world {}, rank {}: left barrier {k} after {waited:?}, before the last rank arrived",
            cx.size(),
            cx.rank()
        );
    }
    Ok(())
}

pub(super) fn many_ops_in_flight(cx: &Cx) -> R<()> {
    // Async use: issue a mix of ops without waiting, then wait in reverse order.
    let (n, me, comm) = (cx.size(), cx.rank(), &cx.comm);
    let mut reduces = Vec::new();
    let mut gathers = Vec::new();
    for k in 0..6usize {
        let len = if k % 2 == 0 { 7 } else { LARGE_ELEMS };
        let x = tensor(&vec![(me + k) as f64; len], &[len], DType::F32)?;
        reduces.push(comm.all_reduce(&x, ReduceOp::Sum)?);
        let g = Tensor::new(&[(me * 10 + k) as u32], &Device::Cpu)?;
        gathers.push(comm.all_gather_single(&g)?);
    }
    let b = comm.barrier()?;
    b.wait()?;
    let mut i = 0;
    while let (Some(r), Some(g)) = (reduces.pop(), gathers.pop()) {
        let k = 5 - i;
        let seq = (r.seq(), g.seq());
        assert_eq!(seq, (2 * k as u64 + 1, 2 * k as u64 + 2), "rank {me}");
        let r = r.wait()?;
        let g = g.wait()?.to_vec1::<u32>()?;
        let (mx, mn) = (r.max(0)?.to_scalar::<f32>()?, r.min(0)?.to_scalar::<f32>()?);
        let want = (0..n).map(|r| (r + k) as f32).sum::<f32>();
        assert_eq!((mx, mn), (want, want), "world {n}, rank {me}, op {k}");
        let wg: Vec<u32> = (0..n).map(|r| (r * 10 + k) as u32).collect();
        assert_eq!(g, wg, "world {n}, rank {me}, op {k}");
        i += 1;
    }
    Ok(())
}

pub(super) fn avg_on_integers(cx: &Cx) -> R<()> {
    let (comm, rank) = (&cx.comm, cx.rank());
    let mut errs = Vec::new();
    for dt in [DType::I64, DType::U32, DType::U8] {
        let x = Tensor::zeros(4, dt, &Device::Cpu)?;
        errs.push(fails(
            comm.all_reduce(&x, ReduceOp::Avg).map(|_| ()),
            "all_reduce avg",
        ));
        errs.push(fails(
            comm.reduce(&x, 0, ReduceOp::Avg).map(|_| ()),
            "reduce avg",
        ));
        errs.push(fails(
            comm.reduce_scatter_single(&x, ReduceOp::Avg).map(|_| ()),
            "reduce_scatter avg",
        ));
    }
    for e in &errs {
        assert!(
            matches!(e, CommError::UnsupportedDType { .. }),
            "rank {rank}: {e}"
        );
        assert!(e.to_string().contains("avg"), "{e}");
        assert_eq!(e.ctx().map(|c| c.rank), Some(rank), "{e}");
    }
    // The comm is still fine afterwards.
    let y = comm
        .all_reduce(&Tensor::new(&[1i64], &Device::Cpu)?, ReduceOp::Sum)?
        .wait()?;
    assert_eq!(y.to_vec1::<i64>()?, vec![cx.size() as i64]);
    Ok(())
}
