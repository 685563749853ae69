//! Conformance and fault suite of the comm crate, run against the `local` backend.
//!
//! One binary, one module per area (ripgrep's `tests/tests.rs` layout):
//!
//! - `collectives`: every op and its `*_into` variant × dtypes × world sizes 1..=8 × size
//!   classes (zero-length, one element, uneven, small = the eager path, large = the direct
//!   shared-memory path), checked against a one-thread reference computed here;
//! - `split`: raw `Comm::split` into rows, columns and nested groups, non-members, bad lists;
//! - `overlap`: an op on one comm completes while another comm waits for a late rank;
//! - `faults`: panicking and failing ranks, skipped collectives, desync, abort, dropped work,
//!   no thread left behind;
//! - `hooks`: pre/post/abort hooks and the flight recorder;
//! - `registry`: a backend defined here, registered and created through `new_comm`;
//! - `rma`: windows (put/get/signal/wait_signal/fence);
//! - `bad_input`: typed errors carrying the op context, and nothing hangs.
//!
//! Every world runs with op and bootstrap timeouts of a few seconds at most; fault tests use
//! a few hundred milliseconds. The collective sweep samples the large size class; set
//! `CDT_FULL_SWEEP=1` to run it at every world size.

use std::error::Error;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::{Comm, CommError, LocalWorld, ReduceOp};

type R<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// A tensor as the tests compare it: its dims and its values widened to `f64`.
type Out = (Vec<usize>, Vec<f64>);

const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::U32,
    DType::U8,
];

const REDUCE_OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

/// Size classes: zero-length, one element, uneven, small (< 64 KiB per rank: the eager path),
/// large (> 64 KiB per rank for every dtype, u8 included: the direct shared-memory path).
const ZERO: usize = 0;
const LARGE: usize = 4;
const CLASSES: usize = 5;
const LARGE_ELEMS: usize = 70_000;

/// The world sizes every sweep runs on.
const WORLDS: std::ops::RangeInclusive<usize> = 1..=8;

fn world(n: usize) -> LocalWorld {
    LocalWorld::new(n)
        .with_timeout(Duration::from_secs(5))
        .with_bootstrap_timeout(Duration::from_secs(5))
}

/// A world whose ops time out after `ms` milliseconds (fault tests).
fn short_world(n: usize, ms: u64) -> LocalWorld {
    LocalWorld::new(n)
        .with_timeout(Duration::from_millis(ms))
        .with_bootstrap_timeout(Duration::from_millis(ms.max(500)))
}

/// Runs `f` on every rank of a world of `n`; panics with the launcher's report on failure.
fn launch<T: Send>(n: usize, f: impl Fn(Comm) -> R<T> + Send + Sync) -> Vec<T> {
    world(n).launch(f).unwrap_or_else(|e| panic!("{e}"))
}

/// The shape of a size class for ops without a divisibility rule.
fn flat_shape(class: usize) -> Vec<usize> {
    match class {
        0 => vec![0],
        1 => vec![1],
        2 => vec![13],
        3 => vec![25, 40],
        _ => vec![LARGE_ELEMS],
    }
}

/// The shape of a size class for ops whose dim 0 must divide by the world size `n`.
fn div_shape(class: usize, n: usize) -> Vec<usize> {
    match class {
        0 => vec![0, 3],
        1 => vec![n],
        2 => vec![13 * n],
        3 => vec![4 * n, 50],
        _ => vec![n, LARGE_ELEMS.div_ceil(n)],
    }
}

/// Set to run the full sweep (every size class at every world size), as torchcomms'
/// `is_full_sweep()` does; the default is the quick, sampled sweep.
const FULL_SWEEP_ENV: &str = "CDT_FULL_SWEEP";

/// Keeps the matrix affordable: every small class always, the large class for about a third
/// of the worlds of each (dtype, op) pair, rotating so each pair gets it at several worlds.
fn sampled(n: usize, a: usize, b: usize, class: usize) -> bool {
    class != LARGE || (n + a + b) % 3 == 0 || std::env::var_os(FULL_SWEEP_ENV).is_some()
}

fn is_signed(dt: DType) -> bool {
    !matches!(dt, DType::U32 | DType::U8)
}

/// Data for reductions: small integers, exact in every dtype and free of overflow for up to 8
/// ranks, so sums, products, maxima and minima must match the reference bit for bit.
fn red_vals(rank: usize, len: usize, dt: DType, op: ReduceOp, salt: usize) -> Vec<f64> {
    (0..len)
        .map(|i| {
            if op == ReduceOp::Product {
                let m = if (rank + i + salt) % 3 == 0 { 2.0 } else { 1.0 };
                if is_signed(dt) && (rank + 2 * i + salt) % 5 == 0 {
                    -m
                } else {
                    m
                }
            } else {
                let b = ((rank * 7 + i * 3 + salt) % 16) as f64;
                if is_signed(dt) {
                    b - 8.0
                } else {
                    b
                }
            }
        })
        .collect()
}

/// Data for copying ops: distinct per rank and index, exact in every dtype (< 256).
fn copy_vals(rank: usize, len: usize, salt: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7 + salt) % 251) as f64)
        .collect()
}

fn tensor(vals: &[f64], shape: &[usize], dt: DType) -> R<Tensor> {
    Ok(Tensor::from_vec(vals.to_vec(), shape, &Device::Cpu)?.to_dtype(dt)?)
}

fn out(t: &Tensor) -> R<Out> {
    Ok((
        t.dims().to_vec(),
        t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
    ))
}

/// The reduction of `ins` (one vector per rank) as the backend defines it: in rank order, `Avg`
/// divides in the accumulator type (f64 for f64, f32 otherwise) and rounds once.
fn reduce_ref(op: ReduceOp, dt: DType, ins: &[Vec<f64>]) -> Vec<f64> {
    let n = ins.len();
    (0..ins[0].len())
        .map(|i| {
            let mut acc = ins[0][i];
            for x in &ins[1..] {
                let x = x[i];
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Product => acc * x,
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                };
            }
            if op != ReduceOp::Avg {
                return acc;
            }
            let q = acc as f32 / n as f32;
            match dt {
                DType::F64 => acc / n as f64,
                DType::F32 => q as f64,
                DType::BF16 => half::bf16::from_f32(q).to_f64(),
                DType::F16 => half::f16::from_f32(q).to_f64(),
                _ => unreachable!("avg is rejected for {dt:?}"),
            }
        })
        .collect()
}

/// Compares one rank's outputs for one case with the reference, naming the first difference.
fn check(n: usize, rank: usize, case: &dyn Debug, got: &[Out], want: &[Out]) {
    assert_eq!(
        got.len(),
        want.len(),
        "world {n}, rank {rank}, {case:?}: {} outputs, expected {}",
        got.len(),
        want.len()
    );
    for (k, ((gd, gv), (wd, wv))) in got.iter().zip(want).enumerate() {
        assert_eq!(gd, wd, "world {n}, rank {rank}, {case:?}, output {k}: dims");
        assert_eq!(
            gv.len(),
            wv.len(),
            "world {n}, rank {rank}, {case:?}, output {k}: element count"
        );
        if let Some(i) = (0..gv.len()).find(|&i| gv[i].to_bits() != wv[i].to_bits()) {
            panic!(
                "world {n}, rank {rank}, {case:?}, output {k}: element {i} is {} but the reference says {}",
                gv[i], wv[i]
            );
        }
    }
}

/// Runs `body` for every case on every rank of each world size in `worlds` (one launch per
/// world), then checks every rank's outputs against `reference(n, case)` (indexed by rank).
fn sweep<C: Debug + Sync>(
    worlds: impl IntoIterator<Item = usize>,
    cases: impl Fn(usize) -> Vec<C>,
    body: impl Fn(&Comm, &C) -> R<Vec<Out>> + Sync,
    reference: impl Fn(usize, &C) -> Vec<Vec<Out>>,
) {
    for n in worlds {
        let cs = cases(n);
        let got = launch(n, |comm| {
            cs.iter()
                .map(|c| body(&comm, c))
                .collect::<R<Vec<Vec<Out>>>>()
        });
        for (ci, c) in cs.iter().enumerate() {
            let want = reference(n, c);
            for (rank, g) in got.iter().enumerate() {
                check(n, rank, c, &g[ci], &want[rank]);
            }
        }
    }
}

/// The error of an op that must fail (issue or wait).
fn fails<T: Debug>(r: Result<T, CommError>, what: &str) -> CommError {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => e,
    }
}

/// Asserts `e` carries the op context `op`, `comm`, `rank` and that its message leads with it.
fn assert_ctx(e: &CommError, op: &str, comm: &str, rank: usize) {
    let ctx = e
        .ctx()
        .unwrap_or_else(|| panic!("error without op context: {e}"));
    assert_eq!(ctx.op.as_str(), op, "{e}");
    assert_eq!(&*ctx.comm, comm, "{e}");
    assert_eq!(ctx.rank, rank, "{e}");
    let msg = e.to_string();
    let lead = format!("{op} (comm \"{comm}\", rank {rank}, seq ");
    assert!(
        msg.starts_with(&lead),
        "{msg:?} does not start with {lead:?}"
    );
}

/// Polls `f` until it holds or `limit` passes.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------------
// Every collective against a one-thread reference.
// ---------------------------------------------------------------------------------------------
mod collectives {
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

    /// dtype × op (where defined) × size class, sampled; the variant rotates with the world.
    fn red_cases(n: usize, variants: &[Variant]) -> Vec<RedCase> {
        let mut v = Vec::new();
        for (a, &dt) in DTYPES.iter().enumerate() {
            for (b, &op) in REDUCE_OPS.iter().enumerate() {
                if !op.supports(dt) {
                    continue;
                }
                for class in 0..CLASSES {
                    if sampled(n, a, b, class) {
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

    fn copy_cases(n: usize, variants: &[Variant]) -> Vec<CopyCase> {
        let mut v = Vec::new();
        for (a, &dt) in DTYPES.iter().enumerate() {
            for class in 0..CLASSES {
                if sampled(n, a, 0, class) {
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

    #[test]
    fn all_reduce() {
        sweep(
            WORLDS,
            |n| red_cases(n, &[Variant::Plain, Variant::Into, Variant::InPlace]),
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
            |n, c| {
                let shape = flat_shape(c.class);
                let ins: Vec<_> = (0..n)
                    .map(|r| red_vals(r, elems(&shape), c.dt, c.op, c.salt))
                    .collect();
                vec![vec![(shape, reduce_ref(c.op, c.dt, &ins))]; n]
            },
        );
    }

    #[test]
    fn all_reduce_in_place_large_keeps_every_rank_consistent() {
        // The large path reads peers' inputs and then overwrites the caller's: pin the in-place
        // variant there at an odd world size with an uneven element count.
        for n in [3, 8] {
            let len = LARGE_ELEMS + 5;
            let got = launch(n, |comm| {
                let vals = red_vals(comm.rank(), len, DType::F32, ReduceOp::Sum, 1);
                let x = tensor(&vals, &[len], DType::F32)?;
                comm.all_reduce_into(&x, &x, ReduceOp::Sum)?.wait()?;
                // Twice in a row on the same buffer.
                comm.all_reduce_into(&x, &x, ReduceOp::Max)?.wait()?;
                out(&x)
            });
            let ins: Vec<_> = (0..n)
                .map(|r| red_vals(r, len, DType::F32, ReduceOp::Sum, 1))
                .collect();
            let sum = reduce_ref(ReduceOp::Sum, DType::F32, &ins);
            let want = (vec![len], sum);
            for (r, g) in got.iter().enumerate() {
                check(
                    n,
                    r,
                    &"in-place sum then max",
                    std::slice::from_ref(g),
                    std::slice::from_ref(&want),
                );
            }
        }
    }

    #[test]
    fn reduce_scatter_single() {
        sweep(
            WORLDS,
            |n| red_cases(n, &[Variant::Plain, Variant::Into]),
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
            |n, c| {
                let shape = div_shape(c.class, n);
                let ins: Vec<_> = (0..n)
                    .map(|r| red_vals(r, elems(&shape), c.dt, c.op, c.salt))
                    .collect();
                let full = reduce_ref(c.op, c.dt, &ins);
                let chunk = full.len() / n;
                let mut d = shape.clone();
                d[0] /= n;
                (0..n)
                    .map(|r| vec![(d.clone(), full[r * chunk..(r + 1) * chunk].to_vec())])
                    .collect()
            },
        );
    }

    #[test]
    fn all_gather_single() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain, Variant::Into]),
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
            |n, c| {
                let shape = flat_shape(c.class);
                let mut d = shape.clone();
                d[0] *= n;
                let all: Vec<f64> = (0..n)
                    .flat_map(|r| copy_vals(r, elems(&shape), c.salt))
                    .collect();
                vec![vec![(d, all)]; n]
            },
        );
    }

    #[test]
    fn all_gather_single_of_a_scalar_stacks_ranks() {
        for n in [1, 3] {
            let got = launch(n, |comm| {
                let x = Tensor::new(comm.rank() as i64 * 3, &Device::Cpu)?;
                out(&comm.all_gather_single(&x)?.wait()?)
            });
            let want = (vec![n], (0..n).map(|r| (r * 3) as f64).collect::<Vec<_>>());
            assert!(got.iter().all(|g| *g == want), "{got:?}");
        }
    }

    #[test]
    fn all_to_all_single() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain, Variant::Into]),
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
            |n, c| {
                let shape = div_shape(c.class, n);
                let ins: Vec<_> = (0..n)
                    .map(|r| copy_vals(r, elems(&shape), c.salt))
                    .collect();
                let chunk = elems(&shape) / n;
                (0..n)
                    .map(|r| {
                        let v = (0..n)
                            .flat_map(|j| ins[j][r * chunk..(r + 1) * chunk].to_vec())
                            .collect();
                        vec![(shape.clone(), v)]
                    })
                    .collect()
            },
        );
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

    #[test]
    fn all_to_all_v_single() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain]),
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
            |n, c| {
                let w = v_width(c.class, n);
                (0..n)
                    .map(|r| {
                        let mut v = Vec::new();
                        for j in 0..n {
                            let rows_j: usize = (0..n).map(|k| v_split(j, k, c.class)).sum();
                            let data = copy_vals(j, rows_j * w, c.salt);
                            let start: usize = (0..r).map(|k| v_split(j, k, c.class)).sum();
                            let len = v_split(j, r, c.class);
                            v.extend_from_slice(&data[start * w..(start + len) * w]);
                        }
                        vec![(vec![v.len() / w, w], v)]
                    })
                    .collect()
            },
        );
    }

    #[test]
    fn broadcast() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain]),
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
            |n, c| {
                let shape = flat_shape(c.class);
                let root = (c.salt + c.class) % n;
                vec![vec![(shape.clone(), copy_vals(root, elems(&shape), c.salt))]; n]
            },
        );
    }

    #[test]
    fn reduce() {
        sweep(
            WORLDS,
            |n| red_cases(n, &[Variant::Plain]),
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
            |n, c| {
                let shape = flat_shape(c.class);
                let root = (c.salt + c.class) % n;
                let ins: Vec<_> = (0..n)
                    .map(|r| red_vals(r, elems(&shape), c.dt, c.op, c.salt))
                    .collect();
                let red = reduce_ref(c.op, c.dt, &ins);
                (0..n)
                    .map(|r| {
                        if r == root {
                            vec![(shape.clone(), red.clone())]
                        } else {
                            vec![]
                        }
                    })
                    .collect()
            },
        );
    }

    /// Gather and scatter pieces differ in dim 0 per rank (rank 0's zero-class piece is empty).
    fn ragged(class: usize, r: usize) -> Vec<usize> {
        let mut s = flat_shape(class);
        s[0] += r;
        s
    }

    #[test]
    fn gather() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain]),
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
            |n, c| {
                let root = (c.salt + c.class) % n;
                (0..n)
                    .map(|r| {
                        if r != root {
                            return vec![];
                        }
                        (0..n)
                            .map(|j| {
                                let s = ragged(c.class, j);
                                let v = copy_vals(j, elems(&s), c.salt);
                                (s, v)
                            })
                            .collect()
                    })
                    .collect()
            },
        );
    }

    #[test]
    fn scatter() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain]),
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
            |n, c| {
                (0..n)
                    .map(|r| {
                        let s = ragged(c.class, r);
                        let v = copy_vals(100 + r, elems(&s), c.salt);
                        vec![(s, v)]
                    })
                    .collect()
            },
        );
    }

    #[test]
    fn send_recv_ring() {
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain]),
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
            |n, c| {
                let shape = flat_shape(c.class);
                (0..n)
                    .map(|r| {
                        let from = (r + n - 1) % n;
                        vec![(shape.clone(), copy_vals(from, elems(&shape), c.salt))]
                    })
                    .collect()
            },
        );
    }

    #[test]
    fn batch_p2p_all_pairs() {
        use candle_dtensor_comm::P2POp;
        // Piece sent from i to j: its shape and data depend on both.
        fn piece(class: usize, i: usize, j: usize) -> Vec<usize> {
            let mut s = flat_shape(class);
            if class != ZERO {
                s[0] += (i + j) % 3;
            }
            s
        }
        sweep(
            WORLDS,
            |n| copy_cases(n, &[Variant::Plain]),
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
            |n, c| {
                (0..n)
                    .map(|me| {
                        (0..n)
                            .map(|k| {
                                let j = (me + k) % n;
                                let s = piece(c.class, j, me);
                                let v = copy_vals(j * 8 + me, elems(&s), c.salt);
                                (s, v)
                            })
                            .collect()
                    })
                    .collect()
            },
        );
    }

    #[test]
    fn barrier_holds_every_rank_until_the_last_arrives() {
        for n in [1, 2, 5, 8] {
            // One clock for every rank: the last rank arrives at barrier k only after
            // 30 * (k + 1) ms, so nobody may leave barrier k before that.
            let t0 = Instant::now();
            let floor = |k: usize| Duration::from_millis(30 * (k as u64 + 1));
            let got = launch(n, |comm| {
                let late = comm.rank() + 1 == comm.size();
                let mut left = Vec::new();
                for k in 0..3 {
                    if late {
                        std::thread::sleep(floor(k).saturating_sub(t0.elapsed()));
                    }
                    comm.barrier()?.wait()?;
                    left.push(t0.elapsed());
                }
                Ok(left)
            });
            for (rank, left) in got.iter().enumerate() {
                for (k, t) in left.iter().enumerate() {
                    assert!(
                        *t >= floor(k),
                        "world {n}, rank {rank} left barrier {k} at {t:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn many_ops_in_flight_complete_in_issue_order() {
        // Async use: issue a mix of ops without waiting, then wait in reverse order.
        for n in [2, 5] {
            let got = launch(n, |comm| {
                let me = comm.rank();
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
                let mut outs = Vec::new();
                b.wait()?;
                while let (Some(r), Some(g)) = (reduces.pop(), gathers.pop()) {
                    let seq = (r.seq(), g.seq());
                    let r = r.wait()?;
                    let g = g.wait()?.to_vec1::<u32>()?;
                    outs.push((
                        seq,
                        r.max(0)?.to_scalar::<f32>()?,
                        r.min(0)?.to_scalar::<f32>()?,
                        g,
                    ));
                }
                Ok(outs)
            });
            for (rank, outs) in got.iter().enumerate() {
                for (i, (seq, mx, mn, g)) in outs.iter().enumerate() {
                    let k = 5 - i;
                    assert_eq!(*seq, (2 * k as u64 + 1, 2 * k as u64 + 2), "rank {rank}");
                    let want = (0..n).map(|r| (r + k) as f32).sum::<f32>();
                    assert_eq!((*mx, *mn), (want, want), "world {n}, rank {rank}, op {k}");
                    let wg: Vec<u32> = (0..n).map(|r| (r * 10 + k) as u32).collect();
                    assert_eq!(g, &wg, "world {n}, rank {rank}, op {k}");
                }
            }
        }
    }

    #[test]
    fn avg_on_integers_is_a_typed_error() {
        let got = launch(2, |comm| {
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
            // The comm is still fine afterwards.
            let y = comm
                .all_reduce(&Tensor::new(&[1i64], &Device::Cpu)?, ReduceOp::Sum)?
                .wait()?;
            Ok((errs, y.to_vec1::<i64>()?, comm.rank()))
        });
        for (errs, y, rank) in got {
            assert_eq!(y, vec![2]);
            for e in &errs {
                assert!(
                    matches!(e, CommError::UnsupportedDType { .. }),
                    "rank {rank}: {e}"
                );
                assert!(e.to_string().contains("avg"), "{e}");
                assert_eq!(e.ctx().map(|c| c.rank), Some(rank), "{e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Comm::split: sub-communicators, non-members, bad lists.
// ---------------------------------------------------------------------------------------------
mod split {
    use super::*;

    /// All-gathers each rank's world rank over `c`, and all-reduces (sums) it.
    fn members_of(c: &Comm, world_rank: usize) -> R<(Vec<u32>, f64)> {
        let x = Tensor::new(&[world_rank as u32], &Device::Cpu)?;
        let g = c.all_gather_single(&x)?.wait()?.to_vec1::<u32>()?;
        let s = c
            .all_reduce(
                &Tensor::new(&[world_rank as f64], &Device::Cpu)?,
                ReduceOp::Sum,
            )?
            .wait()?
            .to_vec1::<f64>()?[0];
        Ok((g, s))
    }

    #[test]
    fn rows_and_columns_of_a_2x3_world() {
        let got = launch(6, |comm| {
            let r = comm.rank();
            let (row, col) = (r / 3, r % 3);
            let row_list: Vec<usize> = (0..3).map(|c| row * 3 + c).collect();
            let col_list: Vec<usize> = (0..2).map(|x| x * 3 + col).collect();
            let rows = comm.split(&row_list, "row")?.expect("a member");
            let cols = comm.split(&col_list, "col")?.expect("a member");
            assert_eq!((rows.rank(), rows.size(), rows.name()), (col, 3, "row"));
            assert_eq!((cols.rank(), cols.size(), cols.name()), (row, 2, "col"));
            // The sub-comms and the parent interleave freely.
            let a = members_of(&rows, r)?;
            let w = members_of(&comm, r)?;
            let b = members_of(&cols, r)?;
            Ok((a, b, w))
        });
        for (r, (rows, cols, w)) in got.into_iter().enumerate() {
            let row: Vec<u32> = (0..3).map(|c| (r / 3 * 3 + c) as u32).collect();
            let col: Vec<u32> = (0..2).map(|x| (x * 3 + r % 3) as u32).collect();
            let sum = |v: &[u32]| v.iter().map(|&x| x as f64).sum::<f64>();
            assert_eq!(rows, (row.clone(), sum(&row)), "rank {r}");
            assert_eq!(cols, (col.clone(), sum(&col)), "rank {r}");
            assert_eq!(w, ((0..6).collect(), 15.0), "rank {r}");
        }
    }

    #[test]
    fn the_list_order_defines_the_new_ranks() {
        let order = [3usize, 1, 0, 2];
        let got = launch(4, |comm| {
            let c = comm.split(&order, "perm")?.expect("a member");
            Ok((c.rank(), members_of(&c, comm.rank())?.0))
        });
        for (r, (new_rank, g)) in got.into_iter().enumerate() {
            assert_eq!(order[new_rank], r);
            assert_eq!(g, vec![3, 1, 0, 2]);
        }
    }

    #[test]
    fn non_members_get_none_and_members_work() {
        let got = launch(5, |comm| {
            let list: &[usize] = if comm.rank() % 2 == 0 {
                &[4, 0, 2]
            } else {
                &[]
            };
            let sub = comm.split(list, "evens")?;
            let res = match &sub {
                Some(c) => Some((c.rank(), c.size(), members_of(c, comm.rank())?.0)),
                None => None,
            };
            // The parent is unaffected.
            comm.barrier()?.wait()?;
            Ok(res)
        });
        for (r, g) in got.into_iter().enumerate() {
            if r % 2 == 1 {
                assert_eq!(g, None, "rank {r}");
            } else {
                let new = [4, 0, 2].iter().position(|&x| x == r).unwrap();
                assert_eq!(g, Some((new, 3, vec![4, 0, 2])), "rank {r}");
            }
        }
    }

    #[test]
    fn nested_splits_into_a_3d_layout() {
        // 8 = 2 x 2 x 2 via split of a split of a split; each level reduces over its group.
        let got = launch(8, |comm| {
            let r = comm.rank();
            let half: Vec<usize> = (0..4).map(|i| r / 4 * 4 + i).collect();
            let h = comm.split(&half, "half")?.expect("member");
            let hr = h.rank();
            let quarter: Vec<usize> = (0..2).map(|i| hr / 2 * 2 + i).collect();
            let q = h.split(&quarter, "quarter")?.expect("member");
            // Single-rank groups: each rank alone.
            let solo = q.split(&[q.rank()], "solo")?.expect("member");
            Ok((
                members_of(&h, r)?.0,
                members_of(&q, r)?.0,
                members_of(&solo, r)?.0,
            ))
        });
        for (r, (h, q, s)) in got.into_iter().enumerate() {
            let hw: Vec<u32> = (0..4).map(|i| (r / 4 * 4 + i) as u32).collect();
            let qw: Vec<u32> = (0..2).map(|i| (r / 2 * 2 + i) as u32).collect();
            assert_eq!((h, q, s), (hw, qw, vec![r as u32]), "rank {r}");
        }
    }

    #[test]
    fn new_comm_splits_are_independent_of_their_parent_seq() {
        // Two splits with the same name at different points give different comms.
        let got = launch(4, |comm| {
            let a = comm.split(&[0, 1, 2, 3], "dup")?.expect("member");
            comm.barrier()?.wait()?;
            let b = comm.split(&[3, 2, 1, 0], "dup")?.expect("member");
            Ok((a.rank(), b.rank(), members_of(&b, comm.rank())?.0))
        });
        for (r, (a, b, g)) in got.into_iter().enumerate() {
            assert_eq!((a, b, g), (r, 3 - r, vec![3, 2, 1, 0]));
        }
    }

    fn bad_split(
        n: usize,
        list: impl Fn(usize) -> Vec<usize> + Sync,
    ) -> Vec<Result<bool, CommError>> {
        let t0 = Instant::now();
        let got = short_world(n, 2000)
            .launch(|comm| {
                let r = comm.split(&list(comm.rank()), "bad").map(|c| c.is_some());
                Ok::<_, CommError>(r)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            t0.elapsed() < Duration::from_millis(1500),
            "took {:?}",
            t0.elapsed()
        );
        got
    }

    fn assert_invalid(r: &Result<bool, CommError>, rank: usize, needle: &str) {
        match r {
            Err(e @ CommError::InvalidArgument { .. }) => {
                assert_ctx(e, "split", "world", rank);
                assert!(e.to_string().contains(needle), "rank {rank}: {e}");
            }
            other => panic!("rank {rank}: expected InvalidArgument with {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn out_of_range_duplicate_and_missing_caller_are_invalid_everywhere() {
        for r in bad_split(3, |_| vec![0, 1, 3]).iter().enumerate() {
            assert_invalid(r.1, r.0, "rank 3 out of range");
        }
        for r in bad_split(3, |me| vec![me, me]).iter().enumerate() {
            assert_invalid(r.1, r.0, "appears twice");
        }
        for r in bad_split(3, |me| vec![(me + 1) % 3]).iter().enumerate() {
            assert_invalid(r.1, r.0, "does not contain the caller");
        }
    }

    #[test]
    fn members_that_disagree_fail_on_every_rank() {
        // Same members, different order.
        let got = bad_split(4, |me| match me {
            0 => vec![0, 1],
            1 => vec![1, 0],
            _ => vec![2, 3],
        });
        for (rank, r) in got.iter().enumerate() {
            assert_invalid(r, rank, "split lists disagree");
        }
        // Rank 0 claims rank 1, but rank 1 formed a group with rank 2: rank 1 (and 2) must hear
        // of it too, not walk away with a communicator rank 0 thinks it shares.
        let got = bad_split(4, |me| match me {
            0 => vec![0, 1],
            1 | 2 => vec![1, 2],
            _ => vec![],
        });
        for (rank, r) in got.iter().enumerate() {
            assert_invalid(r, rank, "split lists disagree");
        }
        // A member that opts out while another lists it.
        let got = bad_split(2, |me| if me == 0 { vec![0, 1] } else { vec![] });
        for (rank, r) in got.iter().enumerate() {
            assert_invalid(r, rank, "split lists disagree");
        }
    }

    #[test]
    fn a_rank_that_rejects_its_own_list_leaves_the_others_with_a_timeout() {
        // Rank 0's list is invalid locally, so it never joins; the others must not hang.
        let t0 = Instant::now();
        let got = short_world(3, 300)
            .launch(|comm| {
                let list = if comm.rank() == 0 {
                    vec![0, 7]
                } else {
                    vec![0, 1, 2]
                };
                Ok::<_, CommError>(comm.split(&list, "half").map(|c| c.is_some()))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let took = t0.elapsed();
        assert!(took < Duration::from_millis(2000), "took {took:?}");
        assert!(
            matches!(got[0], Err(CommError::InvalidArgument { .. })),
            "{:?}",
            got[0]
        );
        for (rank, r) in got.iter().enumerate().skip(1) {
            match r {
                Err(CommError::Timeout { missing, ctx, .. }) => {
                    assert_eq!(missing, &vec![0], "rank {rank}");
                    assert_eq!(ctx.op.as_str(), "split");
                }
                other => panic!("rank {rank}: expected a timeout naming rank 0, got {other:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Different communicators progress independently.
// ---------------------------------------------------------------------------------------------
mod overlap {
    use super::*;

    #[test]
    fn an_op_on_comm_b_completes_while_comm_a_waits_for_a_late_rank() {
        let got = launch(4, |comm| {
            let b = comm.split(&[0, 1, 2, 3], "b")?.expect("member");
            let x = Tensor::ones(1024, DType::F32, &Device::Cpu)?;
            if comm.rank() == 1 {
                // Joins B at once, A only after 300 ms.
                b.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                std::thread::sleep(Duration::from_millis(300));
                comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                return Ok(None);
            }
            let t0 = Instant::now();
            let a = comm.all_reduce(&x, ReduceOp::Sum)?;
            let yb = b.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            let t_b = t0.elapsed();
            let a_done_at_b = a.is_completed();
            let ya = a.wait()?;
            let t_a = t0.elapsed();
            let sums = (
                ya.sum_all()?.to_scalar::<f32>()?,
                yb.sum_all()?.to_scalar::<f32>()?,
            );
            Ok(Some((t_b, t_a, a_done_at_b, sums)))
        });
        for (rank, g) in got.into_iter().enumerate() {
            let Some((t_b, t_a, a_done_at_b, sums)) = g else {
                continue;
            };
            assert!(
                !a_done_at_b,
                "rank {rank}: A finished before B ({t_b:?}, {t_a:?})"
            );
            assert!(t_b < t_a, "rank {rank}: B at {t_b:?}, A at {t_a:?}");
            assert!(
                t_a >= Duration::from_millis(250),
                "rank {rank}: A at {t_a:?}"
            );
            assert!(
                t_a - t_b >= Duration::from_millis(150),
                "rank {rank}: B {t_b:?} A {t_a:?}"
            );
            assert_eq!(sums, (4096.0, 4096.0), "rank {rank}");
        }
    }

    #[test]
    fn two_splits_overlap_a_large_all_gather_with_a_reduce_scatter() {
        // FSDP's pattern: an all-gather on one comm and a reduce-scatter on another, in flight
        // together, both large (direct path), both correct.
        let n = 4;
        let got = launch(n, |comm| {
            let ag = comm.split(&[0, 1, 2, 3], "ag")?.expect("member");
            let rs = comm.split(&[0, 1, 2, 3], "rs")?.expect("member");
            let me = comm.rank();
            let a = tensor(&copy_vals(me, LARGE_ELEMS, 0), &[LARGE_ELEMS], DType::F32)?;
            let r = tensor(
                &red_vals(me, 4 * LARGE_ELEMS, DType::F32, ReduceOp::Sum, 0),
                &[4 * LARGE_ELEMS],
                DType::F32,
            )?;
            let w1 = ag.all_gather_single(&a)?;
            let w2 = rs.reduce_scatter_single(&r, ReduceOp::Sum)?;
            Ok((out(&w2.wait()?)?, out(&w1.wait()?)?))
        });
        let gathered: Vec<f64> = (0..n).flat_map(|r| copy_vals(r, LARGE_ELEMS, 0)).collect();
        let ins: Vec<_> = (0..n)
            .map(|r| red_vals(r, 4 * LARGE_ELEMS, DType::F32, ReduceOp::Sum, 0))
            .collect();
        let red = reduce_ref(ReduceOp::Sum, DType::F32, &ins);
        for (rank, (rs, ag)) in got.iter().enumerate() {
            let want_rs = (
                vec![LARGE_ELEMS],
                red[rank * LARGE_ELEMS..(rank + 1) * LARGE_ELEMS].to_vec(),
            );
            check(
                n,
                rank,
                &"overlapped rs",
                std::slice::from_ref(rs),
                &[want_rs],
            );
            let want_ag = (vec![n * LARGE_ELEMS], gathered.clone());
            check(
                n,
                rank,
                &"overlapped ag",
                std::slice::from_ref(ag),
                &[want_ag],
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Faults: failing ranks, missing ranks, desync, abort, dropped work, no thread left behind.
// ---------------------------------------------------------------------------------------------
mod faults {
    use super::*;
    use candle_dtensor_comm::LocalWorldError;
    use std::sync::Mutex;

    /// What a surviving peer saw: its rank, the pending op's error and how long it took, and
    /// a later op's error and how long that took.
    type PeerSeen = (usize, CommError, Duration, CommError, Duration);

    /// Launches a world of 4 (op timeout 3 s) where rank 2 fails via `fail` after 100 ms while
    /// the others sit in an all_reduce; returns the launcher error and, per surviving rank, the
    /// error of the pending op, how long it took, and how long a later op took to fail.
    fn rank_two_fails(fail: impl Fn() -> R<()> + Sync) -> (LocalWorldError, Vec<PeerSeen>) {
        let seen = Mutex::new(Vec::new());
        let res = LocalWorld::new(4)
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                if comm.rank() == 2 {
                    std::thread::sleep(Duration::from_millis(100));
                    fail()?;
                    return Ok(());
                }
                let x = Tensor::ones(8, DType::F32, &Device::Cpu)?;
                let t0 = Instant::now();
                let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "pending op");
                let took = t0.elapsed();
                let t1 = Instant::now();
                let later = fails(comm.barrier().and_then(|w| w.wait()), "later op");
                seen.lock()
                    .unwrap()
                    .push((comm.rank(), e, took, later, t1.elapsed()));
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
            .expect_err("rank 2 failed, so the launch fails");
        let mut seen = seen.into_inner().unwrap();
        seen.sort_by_key(|s| s.0);
        (res, seen)
    }

    fn check_peers(seen: &[PeerSeen], needle: &str) {
        assert_eq!(seen.len(), 3, "{seen:?}");
        for (rank, e, took, later, later_took) in seen {
            assert!(matches!(e, CommError::Aborted { .. }), "rank {rank}: {e}");
            assert_ctx(e, "all_reduce", "world", *rank);
            let msg = e.to_string();
            assert!(
                msg.contains("rank 2") && msg.contains(needle),
                "rank {rank}: {msg}"
            );
            assert!(
                *took < Duration::from_millis(1500),
                "rank {rank}: failed after {took:?}"
            );
            assert!(
                matches!(later, CommError::Aborted { .. }),
                "rank {rank}: {later}"
            );
            assert!(
                *later_took < Duration::from_millis(200),
                "rank {rank}: {later_took:?}"
            );
        }
    }

    #[test]
    fn a_panicking_rank_fails_its_peers_promptly_and_is_reported() {
        let (err, seen) = rank_two_fails(|| panic!("boom on purpose"));
        match &err {
            LocalWorldError::RankFailed {
                world,
                rank,
                reason,
                failures,
            } => {
                assert_eq!((*world, *rank), (4, 2), "{err}");
                assert!(
                    reason.contains("panicked") && reason.contains("boom on purpose"),
                    "{err}"
                );
                assert_eq!(failures.len(), 1, "{failures:?}");
                assert_eq!(failures[0].0, 2);
            }
            other => panic!("{other}"),
        }
        assert!(err.to_string().contains("rank 2 failed"), "{err}");
        check_peers(&seen, "boom on purpose");
    }

    #[test]
    fn a_rank_returning_an_error_fails_its_peers_promptly_and_is_reported() {
        let (err, seen) = rank_two_fails(|| Err("rank two gave up".into()));
        match &err {
            LocalWorldError::RankFailed { rank, reason, .. } => {
                assert_eq!(*rank, 2, "{err}");
                assert!(reason.contains("rank two gave up"), "{err}");
            }
            other => panic!("{other}"),
        }
        check_peers(&seen, "rank two gave up");
    }

    #[test]
    fn peers_failing_in_turn_still_report_the_first_failure() {
        // Every survivor propagates its abort error; the launcher names the root cause.
        let err = LocalWorld::new(3)
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                if comm.rank() == 1 {
                    return Err::<(), Box<dyn Error + Send + Sync>>("root cause".into());
                }
                comm.barrier()?.wait()?;
                Ok(())
            })
            .expect_err("rank 1 failed");
        match err {
            LocalWorldError::RankFailed {
                rank,
                reason,
                failures,
                ..
            } => {
                assert_eq!((rank, reason.as_str()), (1, "root cause"));
                assert_eq!(
                    failures.iter().map(|f| f.0).collect::<Vec<_>>(),
                    vec![0, 1, 2]
                );
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_world_of_zero_ranks_is_a_launch_error() {
        let e = LocalWorld::new(0)
            .launch(|_| Ok::<_, CommError>(()))
            .unwrap_err();
        assert!(matches!(e, LocalWorldError::Launch(_)), "{e}");
    }

    #[test]
    fn a_skipped_collective_times_out_naming_the_missing_rank_seq_and_op() {
        let got = short_world(3, 400)
            .launch(|comm| {
                comm.barrier()?.wait()?; // seq 1
                if comm.rank() == 2 {
                    return Ok(None); // skips the all_reduce
                }
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                let t0 = Instant::now();
                let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "skipped"); // seq 2
                let took = t0.elapsed();
                let t1 = Instant::now();
                let later = fails(comm.barrier().and_then(|w| w.wait()), "after timeout");
                Ok::<_, Box<dyn Error + Send + Sync>>(Some((e, took, later, t1.elapsed())))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        for (rank, g) in got.into_iter().enumerate().take(2) {
            let (e, took, later, later_took) = g.expect("ranks 0 and 1 report");
            match &e {
                CommError::Timeout { ctx, missing, .. } => {
                    assert_eq!(missing, &vec![2], "rank {rank}: {e}");
                    assert_eq!((ctx.seq, ctx.op.as_str()), (2, "all_reduce"), "{e}");
                }
                other => panic!("rank {rank}: expected a timeout, got {other}"),
            }
            let msg = e.to_string();
            assert!(msg.contains("seq 2") && msg.contains("[2]"), "{msg}");
            assert!(took >= Duration::from_millis(380), "rank {rank}: {took:?}");
            assert!(took < Duration::from_millis(2000), "rank {rank}: {took:?}");
            // The comm is unusable afterwards, and says why, at once.
            assert!(matches!(later, CommError::Aborted { .. }), "{later}");
            assert!(later.to_string().contains("timed out"), "{later}");
            assert!(later_took < Duration::from_millis(200), "{later_took:?}");
        }
    }

    #[test]
    fn a_recv_without_a_send_times_out_naming_the_source() {
        let got = short_world(2, 300)
            .launch(|comm| {
                if comm.rank() == 0 {
                    return Ok(None);
                }
                let e = fails(comm.recv(0, 4, DType::F32)?.wait(), "recv");
                Ok::<_, Box<dyn Error + Send + Sync>>(Some(e))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        match &got[1] {
            Some(e @ CommError::Timeout { missing, .. }) => {
                assert_eq!(missing, &vec![0], "{e}");
                assert_ctx(e, "recv", "world", 1);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Runs a world of 3 where rank 2 issues `odd` and the others `even` at the same point;
    /// returns every rank's error.
    fn desync(
        even: impl Fn(&Comm) -> Result<(), CommError> + Sync,
        odd: impl Fn(&Comm) -> Result<(), CommError> + Sync,
    ) -> Vec<CommError> {
        let t0 = Instant::now();
        let got = short_world(3, 3000)
            .launch(|comm| {
                comm.barrier()?.wait()?;
                let r = if comm.rank() == 2 {
                    odd(&comm)
                } else {
                    even(&comm)
                };
                Ok::<_, CommError>(fails(r, "desynced op"))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            t0.elapsed() < Duration::from_millis(1500),
            "took {:?}",
            t0.elapsed()
        );
        got
    }

    fn check_desync(errs: &[CommError], even: &str, odd: &str) {
        for (rank, e) in errs.iter().enumerate() {
            match e {
                CommError::Desync {
                    ctx,
                    collective,
                    rank_a,
                    op_a,
                    rank_b,
                    op_b,
                } => {
                    assert_eq!(ctx.rank, rank, "{e}");
                    assert_eq!(ctx.seq, 2, "{e}");
                    assert_eq!(*collective, 1, "{e}");
                    // One side is rank 2 with `odd`, the other a peer with `even`.
                    let sides = [(*rank_a, &**op_a), (*rank_b, &**op_b)];
                    let (theirs, ours) = if sides[0].0 == 2 {
                        (sides[0], sides[1])
                    } else {
                        (sides[1], sides[0])
                    };
                    assert_eq!(theirs.0, 2, "{e}");
                    assert!(ours.0 < 2, "{e}");
                    assert!(
                        theirs.1.contains(odd),
                        "rank 2 side {:?} lacks {odd:?}: {e}",
                        theirs.1
                    );
                    assert!(
                        ours.1.contains(even),
                        "peer side {:?} lacks {even:?}: {e}",
                        ours.1
                    );
                }
                other => panic!("rank {rank}: expected a desync, got {other}"),
            }
        }
    }

    fn f32s(n: usize) -> Tensor {
        Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn desync_different_ops() {
        let errs = desync(
            |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
            |c| c.all_gather_single(&f32s(4))?.wait().map(drop),
        );
        check_desync(&errs, "all_reduce", "all_gather_single");
    }

    #[test]
    fn desync_different_dtypes() {
        let errs = desync(
            |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
            |c| {
                let x = Tensor::ones(4, DType::F64, &Device::Cpu).unwrap();
                c.all_reduce(&x, ReduceOp::Sum)?.wait().map(drop)
            },
        );
        check_desync(&errs, "f32", "f64");
    }

    #[test]
    fn desync_different_sizes() {
        let errs = desync(
            |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
            |c| c.all_reduce(&f32s(5), ReduceOp::Sum)?.wait().map(drop),
        );
        check_desync(&errs, "[4]", "[5]");
        // Small on some ranks, large (the other data path) on another.
        let errs = desync(
            |c| c.all_gather_single(&f32s(4))?.wait().map(drop),
            |c| c.all_gather_single(&f32s(LARGE_ELEMS))?.wait().map(drop),
        );
        check_desync(&errs, "[4]", "[70000]");
    }

    #[test]
    fn desync_different_reduce_ops_and_roots() {
        let errs = desync(
            |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
            |c| c.all_reduce(&f32s(4), ReduceOp::Max)?.wait().map(drop),
        );
        check_desync(&errs, "sum", "max");
        let errs = desync(
            |c| c.broadcast(&f32s(4), 0)?.wait().map(drop),
            |c| c.broadcast(&f32s(4), 1)?.wait().map(drop),
        );
        check_desync(&errs, "root 0", "root 1");
    }

    #[test]
    fn abort_from_another_thread_fails_pending_and_later_ops_fast() {
        let got = LocalWorld::new(3)
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                let watchdog = (comm.rank() == 0).then(|| {
                    let c = comm.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(150));
                        c.abort("operator pulled the plug");
                    })
                });
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                let t0 = Instant::now();
                // Rank 2 joins late: the abort lands while ranks 0 and 1 wait.
                if comm.rank() == 2 {
                    std::thread::sleep(Duration::from_millis(400));
                }
                let pending = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "pending");
                let took = t0.elapsed();
                let t1 = Instant::now();
                let later: Vec<CommError> = vec![
                    fails(comm.barrier().and_then(|w| w.wait()), "barrier"),
                    fails(
                        comm.all_gather_single(&x).and_then(|w| w.wait()),
                        "all_gather",
                    ),
                    fails(comm.send(&x, 0).and_then(|w| w.wait()), "send after abort"),
                    fails(comm.recv(0, 4, DType::F32).and_then(|w| w.wait()), "recv"),
                    fails(comm.split(&[0, 1, 2], "child"), "split after abort"),
                ];
                let later_took = t1.elapsed();
                if let Some(w) = watchdog {
                    w.join().map_err(|_| "watchdog panicked")?;
                }
                Ok::<_, Box<dyn Error + Send + Sync>>((
                    pending,
                    took,
                    later,
                    later_took,
                    comm.is_aborted(),
                ))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        for (rank, (pending, took, later, later_took, aborted)) in got.into_iter().enumerate() {
            assert!(aborted, "rank {rank}");
            assert!(
                matches!(pending, CommError::Aborted { .. }),
                "rank {rank}: {pending}"
            );
            assert_ctx(&pending, "all_reduce", "world", rank);
            let msg = pending.to_string();
            assert!(
                msg.contains("aborted by rank 0") && msg.contains("operator pulled the plug"),
                "{msg}"
            );
            if rank < 2 {
                assert!(took < Duration::from_millis(1000), "rank {rank}: {took:?}");
            }
            for e in &later {
                assert!(e.is_fatal(), "rank {rank}: later op failed with {e}");
                assert!(
                    e.to_string().contains("operator pulled the plug"),
                    "rank {rank}: {e}"
                );
            }
            assert!(
                later_took < Duration::from_millis(300),
                "rank {rank}: {later_took:?}"
            );
        }
    }

    #[test]
    fn abort_of_an_idle_comm_is_immediate_and_idempotent() {
        launch(2, |comm| {
            let t0 = Instant::now();
            comm.abort("first");
            comm.abort("second");
            assert!(t0.elapsed() < Duration::from_millis(100));
            assert!(comm.is_aborted());
            let e = fails(comm.barrier().and_then(|w| w.wait()), "after abort");
            // The first reason wins on every rank.
            assert!(e.to_string().contains("first"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn a_dropped_work_does_not_break_later_ops() {
        let n = 4;
        let got = launch(n, |comm| {
            let me = comm.rank() as f64;
            let small = tensor(&[me; 5], &[5], DType::F32)?;
            let large = tensor(&vec![me; LARGE_ELEMS], &[LARGE_ELEMS], DType::F32)?;
            drop(comm.all_reduce(&small, ReduceOp::Sum)?);
            drop(comm.all_gather_single(&large)?);
            drop(comm.reduce_scatter_single(&large, ReduceOp::Sum)?);
            // The caller's input may go away right after issuing; the op still runs.
            drop(large);
            drop(comm.send(&small, (comm.rank() + 1) % comm.size())?);
            let y = comm.all_reduce(&small, ReduceOp::Max)?.wait()?;
            let r = comm
                .recv((comm.rank() + comm.size() - 1) % comm.size(), 5, DType::F32)?
                .wait()?;
            comm.barrier()?.wait()?;
            // The progress thread clears its "running" mark just after completing the work, so
            // `pending()` may count the barrier for a moment after `wait()` returned.
            let drained = eventually(Duration::from_secs(1), || comm.pending() == 0);
            Ok((out(&y)?.1, out(&r)?.1, drained))
        });
        for (rank, (y, r, drained)) in got.into_iter().enumerate() {
            assert_eq!(y, vec![(n - 1) as f64; 5], "rank {rank}");
            assert_eq!(r, vec![((rank + n - 1) % n) as f64; 5], "rank {rank}");
            assert!(drained, "rank {rank}: ops still pending");
        }
    }

    /// Threads of this process whose name starts with `prefix` (Linux names are 15 bytes).
    #[cfg(target_os = "linux")]
    fn threads_named(prefix: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                    .filter(|c| c.starts_with(prefix))
                    .count()
            })
            .unwrap_or(0)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn no_progress_thread_outlives_its_world() {
        // Progress threads are named "cdt-<comm>-r<rank>". After the launch returns, every
        // communicator is gone, so every progress thread must exit, including after failures.
        let ok = LocalWorld::new(3)
            .with_name("leakok")
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                let sub = comm.split(&[0, 1, 2], "leaksub")?.expect("member");
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                for _ in 0..3 {
                    comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                    sub.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                }
                let w = comm.new_window(16)?;
                w.fence()?;
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            });
        ok.unwrap_or_else(|e| panic!("{e}"));
        let failed = LocalWorld::new(3)
            .with_name("leakbad")
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                if comm.rank() == 1 {
                    return Err::<(), Box<dyn Error + Send + Sync>>("leaving".into());
                }
                comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                Ok(())
            });
        assert!(failed.is_err());
        for prefix in ["cdt-leakok-", "cdt-leaksub-", "cdt-leakbad-"] {
            assert!(
                eventually(Duration::from_secs(3), || threads_named(prefix) == 0),
                "{} progress threads named {prefix}* still run after their world ended",
                threads_named(prefix)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pre/post/abort hooks and the flight recorder.
// ---------------------------------------------------------------------------------------------
mod hooks {
    use super::*;
    use candle_dtensor_comm::{
        CommOptions, FlightRecorder, OpName, OpRecord, WorkState, WorkStatus,
    };
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// What the post-hook saw: seq and work state.
    type Seen = Arc<Mutex<Vec<(u64, Arc<dyn WorkState>)>>>;
    /// The fields of an op record a test checks.
    type RecordView = (
        OpName,
        Vec<Vec<usize>>,
        Option<DType>,
        Option<usize>,
        Option<usize>,
        Option<ReduceOp>,
        usize,
    );

    #[test]
    fn pre_and_post_hooks_see_every_op_with_increasing_seq() {
        let got = launch(2, |comm| {
            let pre: Arc<Mutex<Vec<OpRecord>>> = Arc::default();
            let post: Seen = Arc::default();
            let p = pre.clone();
            let h_pre = comm.register_pre_hook(move |rec| p.lock().unwrap().push(rec.clone()));
            let q = post.clone();
            let h_post =
                comm.register_post_hook(move |rec, w| q.lock().unwrap().push((rec.seq, w.clone())));
            let peer = 1 - comm.rank();
            let cpu = &Device::Cpu;
            comm.all_reduce(&Tensor::ones(3, DType::F32, cpu)?, ReduceOp::Sum)?
                .wait()?;
            comm.all_gather_single(&Tensor::ones((2, 2), DType::BF16, cpu)?)?
                .wait()?;
            comm.broadcast(&Tensor::zeros(5, DType::U8, cpu)?, 1)?
                .wait()?;
            comm.barrier()?.wait()?;
            comm.send(&Tensor::zeros(2, DType::I64, cpu)?, peer)?
                .wait()?;
            comm.recv(peer, 2, DType::I64)?.wait()?;
            comm.reduce_scatter_single(&Tensor::ones(4, DType::F64, cpu)?, ReduceOp::Max)?
                .wait()?;
            h_pre.remove();
            h_post.remove();
            comm.barrier()?.wait()?; // seq 8: after removal, seen by nobody
            let pre = pre.lock().unwrap().clone();
            let post = post.lock().unwrap().clone();
            Ok((pre, post, comm.seq()))
        });
        for (rank, (pre, post, seq)) in got.into_iter().enumerate() {
            assert_eq!(seq, 8, "rank {rank}");
            let peer = 1 - rank;
            let want: Vec<RecordView> = vec![
                (
                    OpName::AllReduce,
                    vec![vec![3]],
                    Some(DType::F32),
                    None,
                    None,
                    Some(ReduceOp::Sum),
                    12,
                ),
                (
                    OpName::AllGatherSingle,
                    vec![vec![2, 2]],
                    Some(DType::BF16),
                    None,
                    None,
                    None,
                    8,
                ),
                (
                    OpName::Broadcast,
                    vec![vec![5]],
                    Some(DType::U8),
                    Some(1),
                    None,
                    None,
                    5,
                ),
                (OpName::Barrier, vec![], None, None, None, None, 0),
                (
                    OpName::Send,
                    vec![vec![2]],
                    Some(DType::I64),
                    None,
                    Some(peer),
                    None,
                    16,
                ),
                (
                    OpName::Recv,
                    vec![vec![2]],
                    Some(DType::I64),
                    None,
                    Some(peer),
                    None,
                    16,
                ),
                (
                    OpName::ReduceScatterSingle,
                    vec![vec![4]],
                    Some(DType::F64),
                    None,
                    None,
                    Some(ReduceOp::Max),
                    32,
                ),
            ];
            assert_eq!(pre.len(), want.len(), "rank {rank}: {pre:?}");
            for (i, (rec, w)) in pre.iter().zip(&want).enumerate() {
                assert_eq!(rec.seq, i as u64 + 1, "rank {rank}: {rec:?}");
                let got = (
                    rec.op,
                    rec.shapes.clone(),
                    rec.dtype,
                    rec.root,
                    rec.peer,
                    rec.reduce_op,
                    rec.bytes,
                );
                assert_eq!(&got, w, "rank {rank}, seq {}", rec.seq);
                assert_eq!(
                    (&*rec.comm, rec.backend, rec.rank, rec.size),
                    ("world", "local", rank, 2)
                );
            }
            assert_eq!(
                post.iter().map(|p| p.0).collect::<Vec<_>>(),
                (1..=7).collect::<Vec<_>>()
            );
            for (seq, w) in &post {
                assert_eq!(w.status(), WorkStatus::Completed, "rank {rank}, seq {seq}");
                let (s, f) = (w.started_at().unwrap(), w.finished_at().unwrap());
                assert!(w.issued_at() <= s && s <= f, "rank {rank}, seq {seq}");
                assert_eq!(w.error(), None);
            }
        }
    }

    #[test]
    fn abort_hooks_fire_once_on_timeout() {
        let got = short_world(2, 300)
            .launch(|comm| {
                let count = Arc::new(AtomicUsize::new(0));
                let first: Arc<Mutex<Option<String>>> = Arc::default();
                let (c, f) = (count.clone(), first.clone());
                let _keep = comm.register_abort_hook(move |e| {
                    c.fetch_add(1, Ordering::SeqCst);
                    f.lock().unwrap().get_or_insert_with(|| e.to_string());
                });
                let removed = Arc::new(AtomicUsize::new(0));
                let r = removed.clone();
                comm.register_abort_hook(move |_| {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .remove();
                comm.barrier()?.wait()?;
                if comm.rank() == 1 {
                    return Ok(None);
                }
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "timeout");
                let fired = eventually(Duration::from_secs(1), || count.load(Ordering::SeqCst) > 0);
                for _ in 0..3 {
                    let _ = comm.barrier().and_then(|w| w.wait());
                }
                std::thread::sleep(Duration::from_millis(50));
                let msg = first.lock().unwrap().clone();
                Ok::<_, Box<dyn Error + Send + Sync>>(Some((
                    e,
                    fired,
                    count.load(Ordering::SeqCst),
                    msg,
                    removed.load(Ordering::SeqCst),
                )))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let (e, fired, count, msg, removed) = got[0].clone().expect("rank 0 reports");
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        assert!(fired, "the abort hook never ran");
        assert_eq!(count, 1, "abort hooks run once per communicator");
        assert_eq!(msg, Some(e.to_string()));
        assert_eq!(removed, 0, "a removed abort hook ran");
    }

    #[test]
    fn abort_hooks_fire_once_on_abort() {
        launch(1, |comm| {
            let count = Arc::new(AtomicUsize::new(0));
            let c = count.clone();
            let _keep = comm.register_abort_hook(move |e| {
                assert!(e.to_string().contains("stop now"), "{e}");
                c.fetch_add(1, Ordering::SeqCst);
            });
            comm.abort("stop now");
            assert_eq!(
                count.load(Ordering::SeqCst),
                1,
                "abort runs the hooks at once"
            );
            comm.abort("stop again");
            let _ = comm.barrier().and_then(|w| w.wait());
            assert_eq!(count.load(Ordering::SeqCst), 1);
            Ok(())
        });
    }

    fn entries(d: &serde_json::Value) -> Vec<serde_json::Value> {
        d["entries"].as_array().expect("entries").clone()
    }

    #[test]
    fn flight_recorder_shows_completed_timed_out_and_not_started_ops() {
        let got = short_world(2, 400)
            .with_name("frtest")
            .launch(|comm| {
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                comm.all_reduce(&x, ReduceOp::Sum)?.wait()?; // seq 1
                comm.all_gather_single(&x)?.wait()?; // seq 2
                if comm.rank() == 1 {
                    return Ok(None);
                }
                let fr = comm.flight_recorder().expect("on by default").clone();
                let w1 = comm.all_reduce(&x, ReduceOp::Sum)?; // seq 3: rank 1 never comes
                let w2 = comm.barrier()?; // seq 4
                let w3 = comm.all_gather_single(&x)?; // seq 5
                let during = fr.dump_json(true);
                let e = fails(w1.wait(), "seq 3");
                let _ = w2.wait();
                let _ = w3.wait();
                Ok::<_, Box<dyn Error + Send + Sync>>(Some((
                    during,
                    fr.dump_json(true),
                    fr.dump_json(false),
                    e,
                )))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let (during, after, failed_only, e) = got[0].clone().expect("rank 0 reports");
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        let d = entries(&during);
        assert_eq!(d.len(), 5, "{during}");
        for (i, (op, state)) in [
            ("all_reduce", "completed"),
            ("all_gather_single", "completed"),
        ]
        .iter()
        .enumerate()
        {
            assert_eq!(d[i]["op"], *op, "{during}");
            assert_eq!(d[i]["state"], *state, "{during}");
            assert_eq!(d[i]["seq"], i + 1, "{during}");
            assert_eq!(d[i]["comm"], "frtest");
            assert_eq!(d[i]["dtype"], "f32");
            assert_eq!(d[i]["shapes"], serde_json::json!([[4]]));
            assert!(d[i]["duration_us"].is_u64(), "{during}");
        }
        let s = d[2]["state"].as_str().unwrap();
        assert!(s == "in_progress" || s == "not_started", "{during}");
        assert_eq!(d[3]["state"], "not_started", "{during}");
        assert_eq!(d[3]["op"], "barrier");
        assert_eq!(d[4]["state"], "not_started", "{during}");
        assert!(d[4]["queued_us"].is_null(), "{during}");

        let a = entries(&after);
        assert_eq!(a[2]["state"], "timed_out", "{after}");
        assert!(
            a[2]["error"].as_str().unwrap().contains("timed out"),
            "{after}"
        );
        assert_eq!(a[3]["state"], "error", "{after}");
        assert_eq!(a[4]["state"], "error", "{after}");
        let f: Vec<_> = entries(&failed_only)
            .iter()
            .map(|e| e["seq"].clone())
            .collect();
        assert_eq!(f, vec![3, 4, 5], "{failed_only}");
    }

    #[test]
    fn flight_recorder_is_a_ring_and_can_be_disabled_or_attached() {
        let opts = |entries| CommOptions {
            flight_recorder_entries: entries,
            ..CommOptions::default()
                .with_timeout(Duration::from_secs(3))
                .with_bootstrap_timeout(Duration::from_secs(3))
        };
        LocalWorld::new(2)
            .with_options(opts(3))
            .launch(|comm| {
                for _ in 0..5 {
                    comm.barrier()?.wait()?;
                }
                let fr = comm.flight_recorder().expect("enabled");
                assert_eq!(fr.len(), 3);
                let d = fr.dump_json(true);
                assert_eq!(d["dropped"], 2, "{d}");
                let seqs: Vec<_> = entries(&d).iter().map(|e| e["seq"].clone()).collect();
                assert_eq!(seqs, vec![3, 4, 5], "{d}");
                fr.reset();
                assert!(fr.is_empty());
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
        LocalWorld::new(2)
            .with_options(opts(0))
            .launch(|comm| {
                assert!(comm.flight_recorder().is_none());
                // One attached by hand records until its hooks are removed.
                let fr = FlightRecorder::new(8);
                let (pre, post) = fr.attach(&comm);
                comm.barrier()?.wait()?;
                comm.barrier()?.wait()?;
                pre.remove();
                post.remove();
                comm.barrier()?.wait()?;
                assert_eq!(fr.len(), 2);
                let e = fr.entries(true);
                assert!(e.iter().all(|e| e.state == WorkStatus::Completed), "{e:?}");
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// The backend registry: a backend defined here, plugged in through new_comm.
// ---------------------------------------------------------------------------------------------
mod registry {
    use super::*;
    use candle_dtensor_comm::{
        new_comm, register_backend, registered_backends, Backend, Capabilities, CommOptions, OpCtx,
        P2POp, Work,
    };
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// A world-size-1 backend: every collective returns (a copy of) its input. Its works
    /// complete on a helper thread a little later, like a real asynchronous transport.
    struct Solo {
        device: Device,
        aborted: AtomicBool,
        mailbox: Mutex<VecDeque<Tensor>>,
        alive: Arc<AtomicUsize>,
    }

    impl Solo {
        fn backend(alive: Arc<AtomicUsize>) -> Arc<dyn Backend> {
            alive.fetch_add(1, Ordering::SeqCst);
            Arc::new(Solo {
                device: Device::Cpu,
                aborted: AtomicBool::new(false),
                mailbox: Mutex::new(VecDeque::new()),
                alive,
            })
        }

        fn done<T: Send + 'static>(
            &self,
            ctx: OpCtx,
            r: candle_dtensor_comm::Result<T>,
        ) -> candle_dtensor_comm::Result<Work<T>> {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted {
                    ctx,
                    reason: "solo aborted".into(),
                });
            }
            let (work, completer) = Work::pending(ctx, 0);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                completer.start();
                completer.complete(r);
            });
            Ok(work)
        }
    }

    impl Drop for Solo {
        fn drop(&mut self) {
            self.alive.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn copy_to(
        ctx: &OpCtx,
        input: &Tensor,
        output: Option<Tensor>,
    ) -> candle_dtensor_comm::Result<Tensor> {
        let wrap = |e: candle_core::Error| CommError::Candle {
            ctx: ctx.clone(),
            message: e.to_string(),
        };
        match output {
            None => input.copy().map_err(wrap),
            Some(o) => {
                o.slice_set(&input.reshape(o.dims()).map_err(wrap)?, 0, 0)
                    .map_err(wrap)?;
                Ok(o)
            }
        }
    }

    type Res<T> = candle_dtensor_comm::Result<Work<T>>;

    impl Backend for Solo {
        fn backend_name(&self) -> &'static str {
            "solo"
        }
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            1
        }
        fn device(&self) -> &Device {
            &self.device
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                dtypes: vec!["f32".into()],
                ..Capabilities::default()
            }
        }
        fn all_reduce(&self, ctx: OpCtx, x: Tensor, _: ReduceOp, o: Option<Tensor>) -> Res<Tensor> {
            let r = copy_to(&ctx, &x, o);
            self.done(ctx, r)
        }
        fn all_gather_single(&self, ctx: OpCtx, x: Tensor, o: Option<Tensor>) -> Res<Tensor> {
            let x = if x.rank() == 0 {
                x.reshape(1).unwrap()
            } else {
                x
            };
            let r = copy_to(&ctx, &x, o);
            self.done(ctx, r)
        }
        fn reduce_scatter_single(
            &self,
            ctx: OpCtx,
            x: Tensor,
            _: ReduceOp,
            o: Option<Tensor>,
        ) -> Res<Tensor> {
            let r = copy_to(&ctx, &x, o);
            self.done(ctx, r)
        }
        fn all_to_all_single(&self, ctx: OpCtx, x: Tensor, o: Option<Tensor>) -> Res<Tensor> {
            let r = copy_to(&ctx, &x, o);
            self.done(ctx, r)
        }
        fn all_to_all_v_single(
            &self,
            ctx: OpCtx,
            x: Tensor,
            _: Vec<usize>,
            _: Vec<usize>,
        ) -> Res<Tensor> {
            let r = copy_to(&ctx, &x, None);
            self.done(ctx, r)
        }
        fn broadcast(&self, ctx: OpCtx, t: Tensor, _: usize) -> Res<Tensor> {
            self.done(ctx, Ok(t))
        }
        fn reduce(&self, ctx: OpCtx, x: Tensor, _: usize, _: ReduceOp) -> Res<Option<Tensor>> {
            self.done(ctx, Ok(Some(x)))
        }
        fn gather(&self, ctx: OpCtx, x: Tensor, _: usize) -> Res<Option<Vec<Tensor>>> {
            self.done(ctx, Ok(Some(vec![x])))
        }
        fn scatter(&self, ctx: OpCtx, mut xs: Vec<Tensor>, _: usize) -> Res<Tensor> {
            let x = xs.remove(0);
            self.done(ctx, Ok(x))
        }
        fn barrier(&self, ctx: OpCtx) -> Res<()> {
            self.done(ctx, Ok(()))
        }
        fn batch_p2p(&self, ctx: OpCtx, ops: Vec<P2POp>) -> Res<Vec<Tensor>> {
            let mut mail = self.mailbox.lock().unwrap();
            let mut got = Vec::new();
            for op in &ops {
                if let P2POp::Send { tensor, .. } = op {
                    mail.push_back(tensor.clone());
                }
            }
            for op in ops {
                if let P2POp::Recv { .. } = op {
                    got.push(mail.pop_front());
                }
            }
            drop(mail);
            let r = got
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing: vec![0],
                });
            self.done(ctx, r)
        }
        fn split(
            &self,
            _: OpCtx,
            ranks: &[usize],
            _: &str,
            _: &CommOptions,
        ) -> candle_dtensor_comm::Result<Option<Arc<dyn Backend>>> {
            Ok((!ranks.is_empty()).then(|| Solo::backend(self.alive.clone())))
        }
        fn abort(&self, _: &str) {
            self.aborted.store(true, Ordering::SeqCst);
        }
        fn is_aborted(&self) -> bool {
            self.aborted.load(Ordering::SeqCst)
        }
    }

    fn register_solo(name: &str) -> Arc<AtomicUsize> {
        let alive = Arc::new(AtomicUsize::new(0));
        let a = alive.clone();
        register_backend(
            name,
            Arc::new(
                move |_: &Device,
                      _: &str,
                      _: &CommOptions|
                      -> candle_dtensor_comm::Result<Arc<dyn Backend>> {
                    Ok(Solo::backend(a.clone()))
                },
            ),
        );
        alive
    }

    fn opts() -> CommOptions {
        CommOptions::default()
            .with_timeout(Duration::from_secs(2))
            .with_bootstrap_timeout(Duration::from_secs(2))
            .with_hint("solo.flavour", "vanilla")
    }

    #[test]
    fn a_backend_defined_outside_the_crate_runs_behind_the_front() -> R<()> {
        let _alive = register_solo("solo");
        assert!(registered_backends().contains(&"solo".to_string()));
        let comm = new_comm("solo", &Device::Cpu, "solo0", opts())?;
        assert_eq!(
            (comm.backend_name(), comm.rank(), comm.size(), comm.name()),
            ("solo", 0, 1, "solo0")
        );
        assert_eq!(
            comm.options().hints.get("solo.flavour").map(String::as_str),
            Some("vanilla")
        );
        assert!(!comm.capabilities().rma_put);
        let x = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
        let seen = Arc::new(AtomicUsize::new(0));
        let s = seen.clone();
        let _h = comm.register_pre_hook(move |_| {
            s.fetch_add(1, Ordering::SeqCst);
        });
        let w = comm.all_reduce(&x, ReduceOp::Sum)?;
        assert_eq!(w.seq(), 1);
        assert_eq!(w.wait()?.to_vec1::<f32>()?, vec![1., 2., 3., 4.]);
        let o = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
        comm.all_reduce_into(&o, &x, ReduceOp::Max)?.wait()?;
        assert_eq!(o.to_vec1::<f32>()?, vec![1., 2., 3., 4.]);
        assert_eq!(comm.all_gather_single(&x)?.wait()?.dims(), &[4]);
        assert_eq!(
            comm.reduce(&x, 0, ReduceOp::Sum)?
                .wait()?
                .map(|t| t.dims().to_vec()),
            Some(vec![4])
        );
        comm.send(&x, 0)?.wait()?;
        assert_eq!(
            comm.recv(0, 4, DType::F32)?.wait()?.to_vec1::<f32>()?,
            vec![1., 2., 3., 4.]
        );
        comm.barrier()?.wait()?;
        assert_eq!(
            seen.load(Ordering::SeqCst),
            7,
            "the front runs hooks for every backend"
        );
        // The front still validates for it.
        let e = fails(comm.broadcast(&x, 1).map(drop), "root out of range");
        assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
        // Optional ops default to Unsupported, naming backend and op.
        let e = fails(comm.new_window(64).map(drop), "window");
        assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
        assert!(
            e.to_string().contains("new_window") && e.to_string().contains("solo"),
            "{e}"
        );
        let sub = comm.split(&[0], "solo-sub")?.expect("member");
        assert_eq!(sub.all_reduce(&x, ReduceOp::Sum)?.wait()?.dims(), &[4]);
        assert!(comm.split(&[], "none")?.is_none());
        comm.abort("done");
        assert!(comm.is_aborted());
        Ok(())
    }

    #[test]
    fn dropping_a_comm_drops_its_backend() -> R<()> {
        // The front's bookkeeping (hooks, flight recorder, work callbacks) must not keep a
        // communicator alive after its last handle is gone.
        let alive = register_solo("solo-drop");
        let comm = new_comm("solo-drop", &Device::Cpu, "d", opts())?;
        let sub = comm.split(&[0], "d2")?.expect("member");
        let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        for c in [&comm, &sub] {
            c.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            drop(c.barrier()?);
        }
        assert_eq!(alive.load(Ordering::SeqCst), 2);
        drop(comm);
        drop(sub);
        assert!(
            eventually(Duration::from_secs(2), || alive.load(Ordering::SeqCst) == 0),
            "{} solo backends still alive",
            alive.load(Ordering::SeqCst)
        );
        Ok(())
    }

    #[test]
    fn unknown_backends_list_the_registered_ones() {
        let e = fails(
            new_comm("nccl-typo", &Device::Cpu, "x", opts()).map(drop),
            "unknown",
        );
        match &e {
            CommError::UnknownBackend { name, available } => {
                assert_eq!(name, "nccl-typo");
                assert!(available.contains(&"local".to_string()), "{e}");
            }
            other => panic!("{other}"),
        }
        assert!(
            e.to_string().contains("registered backends") && e.to_string().contains("\"local\""),
            "{e}"
        );
    }

    #[test]
    fn new_comm_local_outside_a_local_world_is_a_bootstrap_error() {
        let e = fails(
            new_comm("local", &Device::Cpu, "lonely", opts()).map(drop),
            "outside",
        );
        assert!(matches!(e, CommError::Bootstrap { .. }), "{e}");
        assert!(
            e.to_string().contains("lonely") && e.to_string().contains("LocalWorld"),
            "{e}"
        );
    }

    #[test]
    fn new_comm_local_inside_a_local_world_is_a_fresh_world_comm() {
        let got = launch(3, |comm| {
            let a = new_comm("local", &Device::Cpu, "side", opts())?;
            let b = new_comm("local", &Device::Cpu, "side", opts())?;
            assert_eq!((a.rank(), a.size(), a.name()), (comm.rank(), 3, "side"));
            // Independent of each other and of the world comm: different issue orders.
            let x = Tensor::new(&[comm.rank() as u32 + 1], &Device::Cpu)?;
            let wb = b.all_reduce(&x, ReduceOp::Product)?;
            let wa = a.all_reduce(&x, ReduceOp::Sum)?;
            let ww = comm.all_reduce(&x, ReduceOp::Max)?;
            Ok((
                wa.wait()?.to_vec1::<u32>()?,
                wb.wait()?.to_vec1::<u32>()?,
                ww.wait()?.to_vec1::<u32>()?,
            ))
        });
        for g in got {
            assert_eq!(g, (vec![6], vec![6], vec![3]));
        }
    }

    #[test]
    fn new_comm_local_that_a_rank_skips_times_out_in_bootstrap() {
        let got = short_world(2, 300)
            .launch(|comm| {
                if comm.rank() == 1 {
                    return Ok(None);
                }
                let o = CommOptions::default().with_bootstrap_timeout(Duration::from_millis(300));
                Ok::<_, CommError>(Some(fails(
                    new_comm("local", &Device::Cpu, "skipped", o).map(drop),
                    "bootstrap",
                )))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        match &got[0] {
            Some(e @ CommError::Timeout { missing, ctx, .. }) => {
                assert_eq!(missing, &vec![1], "{e}");
                assert_eq!(ctx.op.as_str(), "new_comm", "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One-sided RMA windows.
// ---------------------------------------------------------------------------------------------
mod rma {
    use super::*;

    #[test]
    fn capabilities_of_the_local_backend() {
        launch(1, |comm| {
            let c = comm.capabilities();
            assert!(c.rma_put && c.rma_get && c.rma_signal && c.abort, "{c:?}");
            assert_eq!(c.dtypes.len(), 7, "{c:?}");
            Ok(())
        });
    }

    #[test]
    fn ring_put_signal_get_fence() {
        for n in [1, 2, 3, 5] {
            let got = launch(n, |comm| {
                let (me, n) = (comm.rank(), comm.size());
                let (right, left) = ((me + 1) % n, (me + n - 1) % n);
                let w = comm.new_window(64 * 4)?;
                assert_eq!(w.size_bytes(), 256);
                assert_eq!(w.comm().name(), "world");
                let mine: Vec<f32> = (0..8).map(|i| (me * 100 + i) as f32).collect();
                // Put at element 8 (bytes 32..64) of the right neighbour's window, then signal.
                w.put(&Tensor::new(mine.as_slice(), &Device::Cpu)?, right, 8)?;
                w.signal(right)?;
                w.wait_signal(left)?;
                let from_left = w.get(me, 8, 8, DType::F32)?.to_vec1::<f32>()?;
                // After a fence every put is visible to everyone: read the right neighbour's.
                w.fence()?;
                let at_right = w.get(right, 8, 8, DType::F32)?.to_vec1::<f32>()?;
                // The untouched head of the window is still zero, in any dtype.
                let head = w.get(left, 0, 32, DType::U8)?.to_vec1::<u8>()?;
                // Other dtypes at their own element offsets: u8 at byte 200, i64 at byte 16.
                w.put(&Tensor::new(&[me as u8 + 1, 7], &Device::Cpu)?, left, 200)?;
                w.put(&Tensor::new(&[-(me as i64)], &Device::Cpu)?, left, 2)?;
                w.fence()?;
                let bytes = w.get(me, 200, 2, DType::U8)?.to_vec1::<u8>()?;
                let long = w.get(me, 2, 1, DType::I64)?.to_vec1::<i64>()?;
                w.fence()?;
                Ok((from_left, at_right, head, bytes, long))
            });
            for (me, (from_left, at_right, head, bytes, long)) in got.into_iter().enumerate() {
                let left = (me + n - 1) % n;
                let right = (me + 1) % n;
                let want = |r: usize| (0..8).map(|i| (r * 100 + i) as f32).collect::<Vec<_>>();
                assert_eq!(from_left, want(left), "world {n}, rank {me}");
                assert_eq!(at_right, want(me), "world {n}, rank {me}");
                assert_eq!(head[..16], [0u8; 16], "world {n}, rank {me}");
                assert_eq!(bytes, vec![right as u8 + 1, 7], "world {n}, rank {me}");
                assert_eq!(long, vec![-(right as i64)], "world {n}, rank {me}");
            }
        }
    }

    #[test]
    fn signals_count_and_a_missing_one_times_out_naming_the_peer() {
        let got = launch(2, |comm| {
            // Window ops run under the timeout of the handle the window was made from: a
            // short one for the wait that must time out, the world's for the fences.
            let short = comm
                .with_timeout(Duration::from_millis(300))
                .new_window(16)?;
            let w = comm.new_window(16)?;
            if comm.rank() == 1 {
                short.signal(0)?;
                short.signal(0)?;
            }
            w.fence()?;
            let mut res = None;
            if comm.rank() == 0 {
                short.wait_signal(1)?;
                short.wait_signal(1)?;
                let t0 = Instant::now();
                let e = fails(short.wait_signal(1), "third wait");
                res = Some((e, t0.elapsed()));
            }
            // A timed-out wait breaks the communicator, like a missed collective: later ops
            // fail fast on every rank instead of hanging.
            let after = w.fence();
            let after_failed = matches!(after, Err(CommError::Aborted { .. }));
            Ok(res.map(|r| (r, after_failed)).or(Some((
                (
                    CommError::Unsupported {
                        backend: String::new(),
                        op: String::new(),
                    },
                    Duration::ZERO,
                ),
                after_failed,
            ))))
        });
        assert!(
            got.iter().all(|g| g.as_ref().is_some_and(|(_, f)| *f)),
            "later ops must fail fast"
        );
        let got: Vec<_> = got.into_iter().map(|g| g.map(|(r, _)| r)).collect();
        let (e, took) = got[0].clone().expect("rank 0 reports");
        match &e {
            CommError::Timeout { missing, .. } => assert_eq!(missing, &vec![1], "{e}"),
            other => panic!("{other}"),
        }
        assert_ctx(&e, "window_wait_signal", "world", 0);
        assert!(
            took >= Duration::from_millis(280) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[test]
    fn out_of_range_accesses_are_invalid_arguments() {
        launch(2, |comm| {
            let me = comm.rank();
            let w = comm.new_window(64)?; // 16 f32
            let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
            let errs = vec![
                ("window_put", fails(w.put(&x, 1, 13), "put past the end")),
                ("window_put", fails(w.put(&x, 2, 0), "put to rank 2")),
                (
                    "window_get",
                    fails(w.get(0, 15, 2, DType::F32), "get past the end"),
                ),
                (
                    "window_get",
                    fails(w.get(0, usize::MAX, 2, DType::F32), "overflowing offset"),
                ),
                (
                    "window_get",
                    fails(w.get(5, 0, 1, DType::F32), "get from rank 5"),
                ),
                ("window_signal", fails(w.signal(2), "signal rank 2")),
                (
                    "window_wait_signal",
                    fails(w.wait_signal(3), "wait on rank 3"),
                ),
            ];
            for (op, e) in &errs {
                assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
                assert_ctx(e, op, "world", me);
            }
            assert!(
                errs[0].1.to_string().contains("64-byte window"),
                "{}",
                errs[0].1
            );
            // Exactly the end is fine.
            w.put(&x, 1 - me, 12)?;
            w.fence()?;
            assert_eq!(
                w.get(me, 12, 4, DType::F32)?.to_vec1::<f32>()?,
                vec![1.0; 4]
            );
            let e = fails(w.get(me, 0, 1, DType::I32), "i32 get");
            assert!(matches!(e, CommError::UnsupportedDType { .. }), "{e}");
            Ok(())
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: typed errors that carry the op context; nothing hangs.
// ---------------------------------------------------------------------------------------------
mod bad_input {
    use super::*;
    use candle_dtensor_comm::{dtype_supported, P2POp, SUPPORTED_DTYPES};

    /// Runs `f` on every rank of a world of `n` (short timeouts), collecting each rank's
    /// errors, and checks the world is still usable afterwards (every error here is caught
    /// before anything is issued, on every rank alike).
    fn errors(
        n: usize,
        f: impl Fn(&Comm) -> Vec<(&'static str, CommError)> + Sync,
    ) -> Vec<Vec<(&'static str, CommError)>> {
        let t0 = Instant::now();
        let got = short_world(n, 1000)
            .launch(|comm| {
                let errs = f(&comm);
                comm.barrier()?.wait()?;
                Ok::<_, CommError>(errs)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            t0.elapsed() < Duration::from_millis(900),
            "took {:?}",
            t0.elapsed()
        );
        got
    }

    fn check_all(
        got: &[Vec<(&'static str, CommError)>],
        kind: fn(&CommError) -> bool,
        needles: &[&str],
    ) {
        for (rank, errs) in got.iter().enumerate() {
            assert_eq!(errs.len(), needles.len());
            for ((op, e), needle) in errs.iter().zip(needles) {
                assert!(kind(e), "rank {rank}: unexpected kind: {e}");
                assert_ctx(e, op, "world", rank);
                assert!(
                    e.to_string().contains(needle),
                    "rank {rank}: {e:?} lacks {needle:?}"
                );
            }
        }
    }

    fn t(n: usize) -> Tensor {
        Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn ranks_out_of_range() {
        let got = errors(3, |c| {
            vec![
                (
                    "broadcast",
                    fails(c.broadcast(&t(2), 3).map(drop), "broadcast"),
                ),
                (
                    "reduce",
                    fails(c.reduce(&t(2), 3, ReduceOp::Sum).map(drop), "reduce"),
                ),
                ("gather", fails(c.gather(&t(2), 9).map(drop), "gather")),
                ("scatter", fails(c.scatter(&[], 3).map(drop), "scatter")),
                ("send", fails(c.send(&t(2), 3).map(drop), "send")),
                ("recv", fails(c.recv(4, 2, DType::F32).map(drop), "recv")),
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
                                peer: 3,
                            },
                        ])
                        .map(drop),
                        "batch",
                    ),
                ),
            ]
        });
        let is = |e: &CommError| matches!(e, CommError::InvalidArgument { .. });
        check_all(
            &got,
            is,
            &[
                "root rank 3 out of range for a communicator of size 3",
                "root rank 3",
                "root rank 9",
                "root rank 3",
                "destination rank 3",
                "source rank 4",
                "peer rank 3",
            ],
        );
    }

    #[test]
    fn dim_0_must_divide_by_the_world_size() {
        let got = errors(3, |c| {
            let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
            vec![
                (
                    "reduce_scatter_single",
                    fails(
                        c.reduce_scatter_single(&t(4), ReduceOp::Sum).map(drop),
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
                    fails(c.all_to_all_single(&t(5)).map(drop), "a2a"),
                ),
                (
                    "all_to_all_single",
                    fails(c.all_to_all_single_into(&t(5), &t(5)).map(drop), "a2a into"),
                ),
            ]
        });
        let is = |e: &CommError| matches!(e, CommError::InvalidArgument { .. });
        check_all(
            &got,
            is,
            &["divisible by the communicator size 3", "[]", "[5]", "[5]"],
        );
    }

    #[test]
    fn all_to_all_v_split_lists_of_the_wrong_length_or_sum() {
        let got = errors(3, |c| {
            vec![
                (
                    "all_to_all_v_single",
                    fails(
                        c.all_to_all_v_single(&t(3), &[1, 1], &[1, 1, 1]).map(drop),
                        "short out",
                    ),
                ),
                (
                    "all_to_all_v_single",
                    fails(
                        c.all_to_all_v_single(&t(3), &[1, 1, 1], &[1, 1, 1, 0])
                            .map(drop),
                        "long in",
                    ),
                ),
                (
                    "all_to_all_v_single",
                    fails(
                        c.all_to_all_v_single(&t(3), &[1, 1, 1], &[1, 1, 2])
                            .map(drop),
                        "bad sum",
                    ),
                ),
            ]
        });
        let is = |e: &CommError| matches!(e, CommError::InvalidArgument { .. });
        check_all(
            &got,
            is,
            &[
                "one entry per rank (3); got 2 output",
                "got 3 output and 4 input",
                "sum to 4 but the input has 3",
            ],
        );
    }

    #[test]
    fn all_to_all_v_split_lists_inconsistent_across_ranks_fail_on_every_rank() {
        // Every rank sends one row to every rank, except rank 0 sends two to rank 1, which
        // expects one. Only rank 1 sees a bad count on its own side; all must fail, at once.
        for large in [false, true] {
            let w = if large { 30_000 } else { 2 };
            let t0 = Instant::now();
            let got = short_world(3, 2000)
                .launch(|comm| {
                    let ins = if comm.rank() == 0 {
                        vec![1, 2, 1]
                    } else {
                        vec![1, 1, 1]
                    };
                    let rows: usize = ins.iter().sum();
                    let x = Tensor::ones((rows, w), DType::F32, &Device::Cpu)?;
                    let r = comm.all_to_all_v_single(&x, &[1, 1, 1], &ins)?.wait();
                    Ok::<_, Box<dyn Error + Send + Sync>>(fails(r, "inconsistent splits"))
                })
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                t0.elapsed() < Duration::from_millis(1500),
                "took {:?}",
                t0.elapsed()
            );
            for (rank, e) in got.iter().enumerate() {
                assert!(
                    matches!(e, CommError::InvalidArgument { .. }),
                    "large {large}, rank {rank}: {e}"
                );
                assert_ctx(e, "all_to_all_v_single", "world", rank);
                assert!(
                    e.to_string().contains("rank 0 sends 2 slices to rank 1"),
                    "rank {rank}: {e}"
                );
            }
        }
    }

    #[test]
    fn recv_of_a_different_shape_or_dtype_than_sent() {
        let got = short_world(2, 1000)
            .launch(|comm| {
                if comm.rank() == 0 {
                    comm.send(&t(4), 1)?.wait()?;
                    comm.send(&t(4), 1)?.wait()?;
                    comm.send(&t(4), 1)?.wait()?;
                    return Ok(vec![]);
                }
                let a = fails(comm.recv(0, 5, DType::F32)?.wait(), "shape");
                let b = fails(comm.recv(0, 4, DType::F64)?.wait(), "dtype");
                // Mismatches are not fatal: the next matching recv works.
                let ok = comm.recv(0, 4, DType::F32)?.wait()?;
                assert_eq!(ok.to_vec1::<f32>()?, vec![1.0; 4]);
                Ok::<_, Box<dyn Error + Send + Sync>>(vec![a, b])
            })
            .unwrap_or_else(|e| panic!("{e}"));
        for (e, needles) in got[1].iter().zip([["[5]", "[4]"], ["F64", "F32"]]) {
            assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
            assert_ctx(e, "recv", "world", 1);
            for n in needles {
                assert!(e.to_string().contains(n), "{e} lacks {n}");
            }
        }
    }

    #[test]
    fn unsupported_dtypes_are_typed_errors() {
        for dt in SUPPORTED_DTYPES {
            assert!(dtype_supported(dt), "{dt:?}");
        }
        assert_eq!(SUPPORTED_DTYPES.len(), DTYPES.len());
        for dt in [DType::I32, DType::I16, DType::F8E4M3] {
            assert!(!dtype_supported(dt), "{dt:?}");
        }
        let got = errors(2, |c| {
            let i32s = Tensor::zeros(4, DType::I32, &Device::Cpu).unwrap();
            let i16s = Tensor::zeros(4, DType::I16, &Device::Cpu).unwrap();
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
                    fails(
                        c.scatter(&[i32s.clone(), i32s.clone()], c.rank()).map(drop),
                        "scatter",
                    ),
                ),
            ]
        });
        let is = |e: &CommError| matches!(e, CommError::UnsupportedDType { .. });
        check_all(&got, is, &["I32", "I16", "I32", "I32", "I16", "I32"]);
    }

    #[test]
    fn bad_outputs_of_the_into_variants() {
        let got = errors(2, |c| {
            let x = Tensor::ones((4, 2), DType::F32, &Device::Cpu).unwrap();
            let wrong_len = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
            let wrong_dtype = Tensor::zeros(8, DType::F64, &Device::Cpu).unwrap();
            let strided = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)
                .unwrap()
                .t()
                .unwrap();
            let big = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
            let head = big.narrow(0, 0, 8).unwrap().reshape((4, 2)).unwrap();
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
        });
        let is = |e: &CommError| matches!(e, CommError::InvalidArgument { .. });
        check_all(
            &got,
            is,
            &[
                "holds 7 elements but the result has 8",
                "F64",
                "contiguous",
                "overlaps",
                "holds 8 elements but the result has 4",
                "overlaps",
            ],
        );
    }

    #[test]
    fn bad_scatter_arguments() {
        let got = errors(2, |c| {
            let f = t(2);
            let d = Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
            if c.rank() == 0 {
                vec![
                    (
                        "scatter",
                        fails(c.scatter(std::slice::from_ref(&f), 0).map(drop), "too few"),
                    ),
                    (
                        "scatter",
                        fails(c.scatter(&[f.clone(), d], 0).map(drop), "mixed dtypes"),
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
                            c.scatter(&[f.clone(), f.clone()], 0).map(drop),
                            "non-root inputs",
                        ),
                    ),
                ]
            }
        });
        let is = |e: &CommError| matches!(e, CommError::InvalidArgument { .. });
        check_all(
            &got[..1],
            is,
            &["one tensor per rank (2); got 1", "share one dtype"],
        );
        for (op, e) in &got[1] {
            assert!(is(e), "{e}");
            assert_ctx(e, op, "world", 1);
            assert!(
                e.to_string()
                    .contains("only the root (0) passes scatter inputs"),
                "{e}"
            );
        }
    }

    #[test]
    fn non_contiguous_inputs_are_fine() {
        let got = launch(3, |comm| {
            let base = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
            let x = (base + comm.rank() as f64)?.t()?; // [3, 2], strided
            assert!(!x.is_contiguous());
            let y = comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            let g = comm.all_gather_single(&x.narrow(0, 1, 1)?)?.wait()?;
            Ok((out(&y)?, out(&g)?))
        });
        for (y, g) in got {
            assert_eq!(y, (vec![3, 2], vec![3.0, 12.0, 6.0, 15.0, 9.0, 18.0]));
            assert_eq!(g, (vec![3, 2], vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]));
        }
    }
}
