//! Redistribution: round trips between every pair of placements (`S(d)` for each dim,
//! `SS(d,sf)`, `R`, `P(sum|avg|max|min)`) on 1-D, 2-D and 3-D meshes with uneven shapes,
//! forward values and backward gradients; `S -> P` is a typed error; the StridedShard layout
//! tables; PyTorch's failing cases (#179502 sharded view, #194457 flattened all_gather, #103306
//! uneven round trip, nested uneven sharding) and the conformance cases of
//! `reference/dtensor.md` section 8 with their CommDebugMode counts; `redistribute_async`.
//!
//! Gradient of a redistribution (PyTorch's normalization, in local-autograd terms): the local
//! gradient of a Shard/Replicate source is its piece of the full gradient; of a `P(sum)` source
//! the replicated full gradient; of `P(avg)` that over n; of `P(max)`/`P(min)` the full
//! gradient masked to the rank holding the extreme; read as a DTensor (`DTensor::grad`) the
//! gradient of the value. Every pair also checks that the collectives that ran are the planned
//! ones (kind and mesh dim). Tolerance: f32 relative 1e-5.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{distribute_tensor, DTensor, DTensorError, Placement, ReduceOp};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::{local_indices, local_shape, local_shape_and_offset};
use candle_dtensor_strategies::{format_placements, parse_placements};
use common::*;

use Placement::{Replicate as Rep, Shard as S};

fn p(s: &str) -> Vec<Placement> {
    parse_placements(s).unwrap().to_vec()
}

fn ss(dim: usize, split_factor: usize) -> Placement {
    Placement::StridedShard { dim, split_factor }
}

/// Whether `src -> dst` must be refused: Shard/StridedShard to Partial on a mesh dim of size > 1.
fn refused(src: &[Placement], dst: &[Placement], mesh: &[usize]) -> bool {
    src.iter()
        .zip(dst)
        .zip(mesh)
        .any(|((a, b), &n)| n > 1 && a.is_shard() && b.is_partial())
}

/// One prepared redistribution case.
struct Pair {
    desc: String,
    src: Vec<Placement>,
    dst: Vec<Placement>,
    full: Tensor,
    weight: Tensor,
    pieces: Vec<Tensor>,
    grads: Vec<Tensor>,
    refuse: bool,
    asynchronous: bool,
}

fn pair(
    rng: &mut Rng,
    shape: &[usize],
    src: Vec<Placement>,
    dst: Vec<Placement>,
    mesh: &[usize],
) -> Pair {
    let full = tensor(rng, shape, Domain::Normal);
    let weight = tensor(rng, shape, Domain::Normal);
    let (pieces, factors) = make_pieces(rng, &full, &src, mesh, false);
    let world: usize = mesh.iter().product();
    let grads = (0..world)
        .map(|r| {
            let g = weight.mul(&factors[r]).unwrap();
            shard_piece(&g, &src, mesh, &coord_of(r, mesh))
        })
        .collect();
    Pair {
        desc: format!(
            "{shape:?} [{}] -> [{}] on mesh {mesh:?}",
            format_placements(&src),
            format_placements(&dst)
        ),
        refuse: refused(&src, &dst, mesh),
        asynchronous: rng.chance(0.25),
        src,
        dst,
        full,
        weight,
        pieces,
        grads,
    }
}

fn run_pair(mesh: &DeviceMesh, c: &Pair, fails: &mut Vec<String>) -> R<()> {
    let rank = mesh.rank();
    let shape = mesh.shape();
    let coord = coord_of(rank, &shape);
    let var = Var::from_tensor(&c.pieces[rank])?;
    let x = DTensor::from_local_with_shape(var.as_tensor(), mesh, &c.src, c.full.dims())?;
    let ctx = candle_dtensor_core::MeshCtx::of(mesh)?;
    let planned = candle_dtensor_strategies::plan_redistribute(x.spec(), &c.dst, ctx.topology())
        .map(|p| {
            let mut v = plan_collectives(&p, ctx.topology());
            v.sort();
            v
        })
        .ok();
    let mode = CommDebugMode::start();
    let y = if c.asynchronous {
        x.redistribute_async(&c.dst).wait()
    } else {
        x.redistribute(&c.dst)
    };
    // The async form runs on a helper thread, which this thread's recorder does not see.
    let executed = (!c.asynchronous).then(|| executed_collectives(&mode));
    drop(mode);
    let mut fail = |what: String| fails.push(format!("rank {rank}: {}: {what}", c.desc));
    if let (Some(planned), Some(executed), Ok(_)) = (&planned, &executed, &y) {
        if planned != executed {
            fail(format!(
                "planned collectives {planned:?} but executed {executed:?}"
            ));
        }
    }
    let y = match (y, c.refuse) {
        (Err(DTensorError::Strategy { op, source, .. }), true) => {
            let m = source.to_string();
            if op != "redistribute" || !m.contains("Partial") {
                fail(format!("refused with an unclear error: {op}: {m}"));
            }
            return Ok(());
        }
        (Err(e), true) => {
            fail(format!("refused, but not with a typed compiler error: {e}"));
            return Ok(());
        }
        (Err(e), false) => return Err(e.into()),
        (Ok(_), true) => {
            fail("Shard -> Partial was not refused".into());
            return Ok(());
        }
        (Ok(y), false) => y,
    };
    if y.placements() != c.dst.as_slice() || y.shape() != c.full.dims() {
        fail(format!(
            "result is [{}] {:?}",
            format_placements(y.placements()),
            y.shape()
        ));
        return Ok(());
    }
    let want_local = local_shape(c.full.dims(), &shape, &coord, &c.dst)?;
    if y.to_local().dims() != want_local.as_slice() {
        fail(format!(
            "local piece {:?}, expected {:?}",
            y.to_local().dims(),
            want_local.as_slice()
        ));
        return Ok(());
    }
    let partial_dst = c.dst.iter().any(|p| p.is_partial());
    if !partial_dst {
        // The local piece itself is this rank's piece of the value.
        if let Err(e) = close(
            y.to_local(),
            &shard_piece(&c.full, &c.dst, &shape, &coord),
            TOL,
        ) {
            fail(format!("local piece: {e}"));
        }
    }
    let full = y.full_tensor()?;
    if let Err(e) = close(&full, &c.full, TOL) {
        fail(format!("value: {e}"));
    }
    let loss = if partial_dst {
        full.mul(&c.weight)?.sum_all()?
    } else {
        let w = shard_piece(&c.weight, &c.dst, &shape, &coord);
        y.to_local().mul(&w)?.sum_all()?
    };
    let grads = loss.backward()?;
    let got = match grads.get(var.as_tensor()) {
        Some(g) => g.clone(),
        None => var.as_tensor().zeros_like()?,
    };
    if let Err(e) = close(&got, &c.grads[rank], TOL) {
        fail(format!("gradient of the source piece: {e}"));
    }
    // Read as a DTensor, the source's gradient is the gradient of its value (the loss weights),
    // whatever the source placements, with truthful placements.
    match x.grad(&grads)? {
        Some(g) => {
            check_grad_layout(&g, mesh, &mut |w| fail(format!("source grad: {w}")));
            if let Err(e) = close(&g.full_tensor()?, &c.weight, TOL) {
                fail(format!(
                    "source grad as a DTensor [{}]: {e}",
                    format_placements(g.placements())
                ));
            }
        }
        None => fail("no gradient for the source".into()),
    }
    Ok(())
}

fn run_pairs(mesh: &[usize], pairs: &[Pair]) -> Vec<String> {
    run_pairs_flat(mesh, &[], pairs)
}

/// [`run_pairs`] with flattened communicators over each group of mesh dim names in `flats`.
fn run_pairs_flat(mesh: &[usize], flats: &[&[&str]], pairs: &[Pair]) -> Vec<String> {
    let res = on_mesh(mesh, |m| {
        for (i, names) in flats.iter().enumerate() {
            m.flatten(names, &format!("flat{i}"))?;
        }
        let mut fails = Vec::new();
        for c in pairs {
            run_pair(&m, c, &mut fails).map_err(|e| format!("{}: {e}", c.desc))?;
        }
        Ok(fails)
    });
    match res {
        Ok(v) => v.into_iter().flatten().collect(),
        Err(e) => vec![format!("world on mesh {mesh:?}: {e}")],
    }
}

/// The placement pool of one mesh dim for a 2-d tensor.
fn pool() -> Vec<Placement> {
    vec![
        S(0),
        S(1),
        Rep,
        Placement::Partial(ReduceOp::Sum),
        Placement::Partial(ReduceOp::Avg),
        Placement::Partial(ReduceOp::Max),
        Placement::Partial(ReduceOp::Min),
        ss(0, 2),
        ss(1, 3),
    ]
}

fn uneven_shape(rng: &mut Rng) -> Vec<usize> {
    vec![rng.pick(&[3, 5, 7, 9, 13]), rng.pick(&[1, 2, 6, 10])]
}

#[test]
fn every_pair_on_1d_meshes() {
    let mut fails = Vec::new();
    for n in 1..=8 {
        let mesh = [n];
        let mut rng = Rng::for_name("pairs-1d", n as u64);
        let mut pairs = Vec::new();
        for _ in 0..sweep_scale() {
            for a in pool() {
                for b in pool() {
                    let shape = uneven_shape(&mut rng);
                    pairs.push(pair(&mut rng, &shape, vec![a], vec![b], &mesh));
                }
            }
        }
        fails.extend(run_pairs(&mesh, &pairs));
    }
    assert_no_failures("1-d pairs", &fails);
}

/// Shard-to-shard on even shapes takes the all_to_all path whose result is the received
/// buffer itself (no unpacking): a size-1 dim before the gathered one, 2-D and 3-D pieces,
/// values and gradients, 1-D and 2-D meshes. The shapes with a last dim of 1024 have runs of
/// at least 1 KiB per destination, so the backend reads them in place (an all-to-all of rows,
/// no packed send buffer); the small ones pack.
#[test]
fn even_shard_to_shard_pairs() {
    let mut fails = Vec::new();
    for mesh in [&[2][..], &[4], &[2, 2]] {
        let mut rng = Rng::for_name("even-s2s", mesh.iter().product::<usize>() as u64);
        let mut pairs = Vec::new();
        let shapes = [
            &[8, 12][..],
            &[4, 8, 4],
            &[1, 8, 4],
            &[8, 1024],
            &[4, 8, 1024],
            &[1, 8, 1024],
        ];
        for shape in shapes {
            for (a, b) in [(0, 1), (1, 0), (0, shape.len() - 1), (1, 2 % shape.len())] {
                if a == b {
                    continue;
                }
                let mut src = vec![Rep; mesh.len()];
                let mut dst = vec![Rep; mesh.len()];
                src[mesh.len() - 1] = S(a);
                dst[mesh.len() - 1] = S(b);
                pairs.push(pair(&mut rng, shape, src, dst, mesh));
            }
        }
        fails.extend(run_pairs(mesh, &pairs));
    }
    assert_no_failures("even shard-to-shard pairs", &fails);
}

/// Gathering a dim with outer dims before it, on even shapes: the gathered pieces are
/// interleaved by one transposed copy (no zero-filled output). 2-D and 3-D tensors, the
/// gathered dim in the middle and last, values and gradients; 1-D meshes and the 2x2
/// `[S(0),S(1)] -> [R,R]` of the benchmark.
#[test]
fn even_gathers_behind_outer_dims() {
    let mut fails = Vec::new();
    for mesh in [&[2][..], &[4]] {
        let mut rng = Rng::for_name("even-gather", mesh[0] as u64);
        let mut pairs = Vec::new();
        for (shape, d) in [(&[8, 12][..], 1), (&[4, 8, 4], 1), (&[4, 8, 4], 2)] {
            pairs.push(pair(&mut rng, shape, vec![S(d)], vec![Rep], mesh));
        }
        fails.extend(run_pairs(mesh, &pairs));
    }
    let mut rng = Rng::for_name("even-gather-2x2", 4);
    let pairs = [&[8, 12][..], &[4, 8, 4]]
        .into_iter()
        .map(|shape| pair(&mut rng, shape, vec![S(0), S(1)], vec![Rep, Rep], &[2, 2]))
        .collect::<Vec<_>>();
    fails.extend(run_pairs(&[2, 2], &pairs));
    assert_no_failures("even gathers behind outer dims", &fails);
}

/// Every pair of placement lists would be 81^2 (2-D) or 729^2 (3-D) per mesh: for every mesh
/// dim, every pair of placements on it with random placements elsewhere, plus random pairs of
/// lists (eight times as many with `CDT_FULL_SWEEP=1`).
#[test]
fn pairs_on_2d_and_3d_meshes() {
    let mut fails = Vec::new();
    for mesh in [&[2, 2][..], &[2, 3], &[2, 2, 2]] {
        let mut rng = Rng::for_name("pairs-nd", mesh.iter().product::<usize>() as u64);
        let pool = pool();
        let mut pairs = Vec::new();
        // One mesh dim changes, the others hold a random placement.
        for m in 0..mesh.len() {
            for a in &pool {
                for b in &pool {
                    let base: Vec<Placement> = (0..mesh.len()).map(|_| rng.pick(&pool)).collect();
                    let (mut src, mut dst) = (base.clone(), base);
                    src[m] = *a;
                    dst[m] = *b;
                    let shape = uneven_shape(&mut rng);
                    pairs.push(pair(&mut rng, &shape, src, dst, mesh));
                }
            }
        }
        for _ in 0..150 * sweep_scale() {
            let src: Vec<Placement> = (0..mesh.len()).map(|_| rng.pick(&pool)).collect();
            let dst: Vec<Placement> = (0..mesh.len()).map(|_| rng.pick(&pool)).collect();
            let shape = uneven_shape(&mut rng);
            pairs.push(pair(&mut rng, &shape, src, dst, mesh));
        }
        fails.extend(run_pairs(mesh, &pairs));
    }
    assert_no_failures("n-d pairs", &fails);
}

/// With flattened communicators present the planner merges consecutive same-kind collectives
/// onto them when the sizes divide evenly: random pairs on even and uneven shapes.
#[test]
fn pairs_with_flattened_communicators() {
    let mut fails = Vec::new();
    let setups: [(&[usize], &[&[&str]]); 2] = [
        (&[2, 2], &[&["a", "b"]]),
        (&[2, 2, 2], &[&["b", "c"], &["a", "b", "c"]]),
    ];
    for (mesh, flats) in setups {
        let mut rng = Rng::for_name("pairs-flat", mesh.len() as u64);
        let pool = pool();
        let mut pairs = Vec::new();
        for _ in 0..120 * sweep_scale() {
            // Half the time one placement on every mesh dim: what merged collectives need.
            let pick = |rng: &mut Rng| -> Vec<Placement> {
                if rng.chance(0.5) {
                    vec![rng.pick(&pool); mesh.len()]
                } else {
                    (0..mesh.len()).map(|_| rng.pick(&pool)).collect()
                }
            };
            let src = pick(&mut rng);
            let dst = pick(&mut rng);
            let shape = if rng.chance(0.5) {
                vec![rng.pick(&[8, 16, 24]), rng.pick(&[8, 16])]
            } else {
                uneven_shape(&mut rng)
            };
            pairs.push(pair(&mut rng, &shape, src, dst, mesh));
        }
        fails.extend(run_pairs_flat(mesh, flats, &pairs));
    }
    assert_no_failures("pairs with flattened communicators", &fails);
}

/// Runs `f` on a mesh and returns rank 0's result after checking that every rank agrees.
fn each_rank<T: Send + PartialEq + std::fmt::Debug>(
    mesh: &[usize],
    f: impl Fn(DeviceMesh) -> R<T> + Send + Sync,
) -> Vec<T> {
    on_mesh(mesh, f).unwrap_or_else(|e| panic!("mesh {mesh:?}: {e}"))
}

fn counts(mode: &CommDebugMode, phase: Phase) -> Vec<(&'static str, usize)> {
    let mut v: Vec<(&'static str, usize)> = mode
        .counts()
        .into_iter()
        .filter(|((ph, _), _)| *ph == phase)
        .map(|((_, k), c)| (k, c))
        .collect();
    v.sort();
    v
}

/// `torch.chunk(x, n, d)[i]` (empty past the last non-empty chunk; candle's own `chunk` splits
/// like numpy's `array_split` instead).
fn torch_chunk(x: &Tensor, n: usize, d: usize, i: usize) -> Tensor {
    let (size, off) =
        candle_dtensor_strategies::layout::shard_size_and_offset(x.dim(d).unwrap(), n, i);
    x.narrow(d, if size == 0 { 0 } else { off }, size).unwrap()
}

fn arange(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::arange(0f32, n as f32, &Device::Cpu)
        .unwrap()
        .reshape(shape)
        .unwrap()
}

/// Conformance 1 and 2 (world 4): S -> R is one all_gather forward and no comms backward (the
/// gradient comes back as the local chunk); R -> S is local forward and one all_gather backward.
#[test]
fn conformance_s_to_r_and_r_to_s() {
    for (shape, d) in [
        ([12, 3], 0),
        ([13, 3], 0),
        ([14, 3], 0),
        ([3, 12], 1),
        ([3, 13], 1),
        ([3, 14], 1),
    ] {
        let x = arange(&shape);
        let res = each_rank(&[4], |mesh| {
            // S -> R
            let xd = distribute_tensor(&x, &mesh, &[S(d)])?;
            let v = Var::from_tensor(xd.to_local())?;
            let xd = DTensor::from_local_with_shape(v.as_tensor(), &mesh, &[S(d)], &shape)?;
            let mode = CommDebugMode::start();
            let y = xd.redistribute(&[Rep])?;
            let fwd = counts(&mode, Phase::Forward);
            let g = y.to_local().sum_all()?.backward()?;
            let bwd = counts(&mode, Phase::Backward);
            let grad = g.get(v.as_tensor()).cloned().ok_or("no grad")?;
            let ok_full = close(y.to_local(), &x, 0.0).is_ok();
            let ok_grad = close(&grad, &v.as_tensor().ones_like()?, 0.0).is_ok();
            drop(mode);
            // R -> S
            let xr = distribute_tensor(&x, &mesh, &[Rep])?;
            let v2 = Var::from_tensor(xr.to_local())?;
            let xr = DTensor::from_local(v2.as_tensor(), &mesh, &[Rep])?;
            let mode = CommDebugMode::start();
            let s = xr.redistribute(&[S(d)])?;
            let fwd2 = counts(&mode, Phase::Forward);
            let ok_chunk = close(s.to_local(), &torch_chunk(&x, 4, d, mesh.rank()), 0.0).is_ok();
            let g2 = s.to_local().sum_all()?.backward()?;
            let bwd2 = counts(&mode, Phase::Backward);
            let grad2 = g2.get(v2.as_tensor()).cloned().ok_or("no grad")?;
            let ok_grad2 = close(&grad2, &x.ones_like()?, 0.0).is_ok();
            Ok((fwd, bwd, ok_full, ok_grad, fwd2, bwd2, ok_chunk, ok_grad2))
        });
        for r in res {
            assert_eq!(r.0, vec![("all_gather", 1)], "{shape:?} S({d})->R forward");
            assert_eq!(r.1, vec![], "{shape:?} S({d})->R backward");
            assert!(r.2 && r.3, "{shape:?} S({d})->R values/grad");
            assert_eq!(r.4, vec![], "{shape:?} R->S({d}) forward");
            assert_eq!(r.5, vec![("all_gather", 1)], "{shape:?} R->S({d}) backward");
            assert!(r.6 && r.7, "{shape:?} R->S({d}) values/grad");
        }
    }
}

/// Conformance 3 and 4: P -> R is one all_reduce forward (value 4 * ones) and no comms
/// backward (gradient ones); P -> P is a no-op both ways.
#[test]
fn conformance_partial() {
    let res = each_rank(&[4], |mesh| {
        let ones = Tensor::ones((12, 3), DType::F32, &Device::Cpu)?;
        let v = Var::from_tensor(&ones)?;
        let x = DTensor::from_local(v.as_tensor(), &mesh, &p("P(sum)"))?;
        let mode = CommDebugMode::start();
        let y = x.redistribute(&[Rep])?;
        let fwd = counts(&mode, Phase::Forward);
        let g = y.to_local().sum_all()?.backward()?;
        let bwd = counts(&mode, Phase::Backward);
        let ok_val = close(y.to_local(), &(ones.clone() * 4.0)?, 0.0).is_ok();
        let ok_grad = close(g.get(v.as_tensor()).ok_or("no grad")?, &ones, 0.0).is_ok();
        drop(mode);
        let mode = CommDebugMode::start();
        let z = x.redistribute(&p("P(sum)"))?;
        let g = z.to_local().sum_all()?.backward()?;
        let all = mode.records().len();
        let ok_noop = close(z.to_local(), &ones, 0.0).is_ok()
            && close(g.get(v.as_tensor()).ok_or("no grad")?, &ones, 0.0).is_ok();
        Ok((fwd, bwd, ok_val, ok_grad, all, ok_noop))
    });
    for r in res {
        assert_eq!(r.0, vec![("all_reduce", 1)]);
        assert_eq!(r.1, vec![]);
        assert!(r.2 && r.3, "P->R value / grad");
        assert_eq!(r.4, 0, "P->P must not communicate");
        assert!(r.5, "P->P value / grad");
    }
}

/// Conformance 6 (the dtype part): a cast of a replicated tensor communicates nothing either
/// way and the gradient comes back in the original dtype.
#[test]
fn conformance_cast_keeps_grad_dtype() {
    let res = each_rank(&[4], |mesh| {
        let x = arange(&[4, 3]);
        let v = Var::from_tensor(&x)?;
        let xd = DTensor::from_local(v.as_tensor(), &mesh, &[Rep])?;
        let mode = CommDebugMode::start();
        let y = xd.to_dtype(DType::BF16)?;
        let g = y.to_local().sum_all()?.backward()?;
        let grad = g.get(v.as_tensor()).ok_or("no grad")?;
        Ok((
            mode.records().len(),
            y.dtype(),
            grad.dtype(),
            close(grad, &x.ones_like()?, 0.0).is_ok(),
        ))
    });
    for r in res {
        assert_eq!(r, (0, DType::BF16, DType::F32, true));
    }
}

/// Conformance 7 / PyTorch #103306: (5, 10) R -> S(0) -> R keeps the shape; local sizes
/// [2, 2, 1, 0].
#[test]
fn uneven_round_trip_keeps_shape() {
    let x = arange(&[5, 10]);
    let res = each_rank(&[4], |mesh| {
        let r = distribute_tensor(&x, &mesh, &[Rep])?;
        let s = r.redistribute(&[S(0)])?;
        let back = s.redistribute(&[Rep])?;
        Ok((
            s.to_local().dim(0)?,
            back.shape().to_vec(),
            close(back.to_local(), &x, 0.0).is_ok(),
        ))
    });
    let rows: Vec<usize> = res.iter().map(|r| r.0).collect();
    assert_eq!(rows, vec![2, 2, 1, 0]);
    for r in res {
        assert_eq!(r.1, vec![5, 10]);
        assert!(r.2);
    }
}

/// PyTorch #179502: a view of [12, 8] S(1) as (16, 6) is numerically right (the input is
/// redistributed first), forward and backward.
#[test]
fn sharded_view_is_redistributed() {
    let x = arange(&[12, 8]);
    let w = tensor(&mut Rng::new(7), &[16, 6], Domain::Normal);
    let want = x.reshape((16, 6)).unwrap();
    let res = each_rank(&[4], |mesh| {
        let xd = distribute_tensor(&x, &mesh, &[S(1)])?;
        let v = Var::from_tensor(xd.to_local())?;
        let xd = DTensor::from_local_with_shape(v.as_tensor(), &mesh, &[S(1)], &[12, 8])?;
        let mode = CommDebugMode::start();
        let y = xd.reshape(&[16, 6])?;
        let comms = mode.records().len();
        let full = y.full_tensor()?;
        let g = full.mul(&w)?.sum_all()?.backward()?;
        let grad = g.get(v.as_tensor()).ok_or("no grad")?.clone();
        let want_grad = torch_chunk(&w.reshape((12, 8))?, 4, 1, mesh.rank());
        Ok((
            comms,
            close(&full, &want, 0.0).is_ok(),
            close(&grad, &want_grad, TOL).is_ok(),
        ))
    });
    for r in res {
        assert!(r.0 >= 1, "the view must redistribute its input");
        assert!(r.1 && r.2, "values {} grads {}", r.1, r.2);
    }
}

/// PyTorch #194457: [5, 3] `[S(0), S(0)] -> [R, R]` on 2x2 with a flattened communicator
/// present must not merge the two all_gathers (5 rows do not divide by 4); [8, 3] does merge,
/// and so does `[P(sum), P(sum)] -> [R, R]`.
#[test]
fn flattened_gather_only_when_even() {
    let res = each_rank(&[2, 2], |mesh| {
        mesh.flatten(&["a", "b"], "ab")?;
        let x = DTensor::from_local(&arange(&[6, 3]), &mesh, &p("P(sum),P(sum)"))?;
        let mode = CommDebugMode::start();
        let y = x.redistribute(&[Rep, Rep])?;
        let kinds: Vec<String> = mode
            .records()
            .iter()
            .map(|r| format!("{} {}", r.kind, r.mesh_dim))
            .collect();
        Ok((
            kinds,
            close(y.to_local(), &(arange(&[6, 3]) * 4.0)?, 0.0).is_ok(),
        ))
    });
    for r in res {
        assert_eq!(
            r,
            (vec!["all_reduce a+b".to_string()], true),
            "merged all_reduce"
        );
    }
    for (rows, merged) in [(5usize, false), (8, true), (7, false)] {
        let x = arange(&[rows, 3]);
        let res = each_rank(&[2, 2], |mesh| {
            mesh.flatten(&["a", "b"], "ab")?;
            let xd = distribute_tensor(&x, &mesh, &[S(0), S(0)])?;
            let v = Var::from_tensor(xd.to_local())?;
            let xd =
                DTensor::from_local_with_shape(v.as_tensor(), &mesh, &[S(0), S(0)], &[rows, 3])?;
            let mode = CommDebugMode::start();
            let y = xd.redistribute(&[Rep, Rep])?;
            let gathers: Vec<String> = mode
                .records()
                .iter()
                .filter(|r| r.phase == Phase::Forward)
                .map(|r| format!("{} {}", r.kind, r.mesh_dim))
                .collect();
            let g = y.to_local().sum_all()?.backward()?;
            let grad = g.get(v.as_tensor()).ok_or("no grad")?;
            Ok((
                gathers,
                close(y.to_local(), &x, 0.0).is_ok(),
                close(grad, &v.as_tensor().ones_like()?, 0.0).is_ok(),
            ))
        });
        for r in res {
            assert!(r.1 && r.2, "[{rows}, 3]: values {} grads {}", r.1, r.2);
            if merged {
                assert_eq!(r.0, vec!["all_gather a+b".to_string()], "[{rows}, 3]");
            } else {
                assert_eq!(r.0.len(), 2, "[{rows}, 3]: {:?}", r.0);
                assert!(
                    r.0.iter().all(|g| !g.contains('+')),
                    "[{rows}, 3]: {:?}",
                    r.0
                );
            }
        }
    }
}

/// Uneven nested sharding of one dim on 2x3 (`[S(0), S(0)]`): every target, values and grads.
#[test]
fn nested_uneven_sharding_on_2x3() {
    let mesh = [2, 3];
    let mut rng = Rng::new(42);
    let mut pairs = Vec::new();
    for rows in [5, 7, 11, 13] {
        for dst in [
            "R,R",
            "R,S(0)",
            "S(0),R",
            "S(1),S(0)",
            "S(0),S(1)",
            "S(1),R",
            "P(sum),R",
        ] {
            pairs.push(pair(&mut rng, &[rows, 4], p("S(0),S(0)"), p(dst), &mesh));
            pairs.push(pair(&mut rng, &[rows, 4], p(dst), p("S(0),S(0)"), &mesh));
        }
    }
    assert_no_failures("nested uneven", &run_pairs(&mesh, &pairs));
}

/// The StridedShard layout table: [15, 5] on mesh (4, 2) with `[SS(0, sf=2), S(0)]` gives dim-0
/// sizes [2,2,2,2,2,2,2,1] and offsets [0,8,2,10,4,12,6,14]; the pieces hold exactly those rows,
/// and redistributing to R, to `[R, S(0)]` and back is exact, forward and backward.
#[test]
fn strided_shard_table_and_round_trips() {
    let x = arange(&[15, 5]);
    let placements = [ss(0, 2), S(0)];
    let res = each_rank(&[4, 2], |mesh| {
        let d = distribute_tensor(&x, &mesh, &placements)?;
        let coord = mesh.coordinate();
        let (_, off) = local_shape_and_offset(&[15, 5], &[4, 2], &coord, &placements)?;
        let rows = local_indices(15, &[4, 2], &coord, &placements, 0);
        let ids = Tensor::new(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            &Device::Cpu,
        )?;
        let held = close(d.to_local(), &x.index_select(&ids, 0)?, 0.0).is_ok();
        Ok((d.to_local().dim(0)?, off[0], held))
    });
    let sizes: Vec<usize> = res.iter().map(|r| r.0).collect();
    let offs: Vec<usize> = res.iter().map(|r| r.1).collect();
    assert_eq!(sizes, vec![2, 2, 2, 2, 2, 2, 2, 1]);
    assert_eq!(offs, vec![0, 8, 2, 10, 4, 12, 6, 14]);
    assert!(res.iter().all(|r| r.2), "pieces hold their strided rows");

    let mut rng = Rng::new(3);
    let mut pairs = Vec::new();
    for shape in [[15, 5], [16, 5], [9, 3]] {
        for dst in [
            "R,R",
            "R,S(0)",
            "S(0),S(0)",
            "S(1),R",
            "P(sum),R",
            "SS(0,2),R",
        ] {
            let src = vec![ss(0, 2), S(0)];
            pairs.push(pair(&mut rng, &shape, src.clone(), p(dst), &[4, 2]));
            if !dst.contains('P') {
                pairs.push(pair(&mut rng, &shape, p(dst), src, &[4, 2]));
            }
        }
    }
    assert_no_failures("strided round trips", &run_pairs(&[4, 2], &pairs));
}

/// A lone StridedShard: the gather reorders by the strided indices (the docstring example, 9
/// rows, sf 2, 4 ranks hold [0,1,5], [2,3,6], [4,7], [8]); one all_gather forward, none backward;
/// R -> SS is local forward and one all_gather backward.
#[test]
fn lone_strided_shard_gather_and_select() {
    let x = arange(&[9, 2]);
    let res = each_rank(&[4], |mesh| {
        let d = distribute_tensor(&x, &mesh, &[ss(0, 2)])?;
        let held: Vec<f32> = d.to_local().narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        let v = Var::from_tensor(d.to_local())?;
        let d = DTensor::from_local_with_shape(v.as_tensor(), &mesh, &[ss(0, 2)], &[9, 2])?;
        let mode = CommDebugMode::start();
        let y = d.redistribute(&[Rep])?;
        let fwd = counts(&mode, Phase::Forward);
        let g = y.to_local().sum_all()?.backward()?;
        let bwd = counts(&mode, Phase::Backward);
        let ok = close(y.to_local(), &x, 0.0).is_ok()
            && close(
                g.get(v.as_tensor()).ok_or("no grad")?,
                &v.as_tensor().ones_like()?,
                0.0,
            )
            .is_ok();
        drop(mode);
        let r = distribute_tensor(&x, &mesh, &[Rep])?;
        let v2 = Var::from_tensor(r.to_local())?;
        let r = DTensor::from_local(v2.as_tensor(), &mesh, &[Rep])?;
        let mode = CommDebugMode::start();
        let s = r.redistribute(&[ss(0, 2)])?;
        let fwd2 = counts(&mode, Phase::Forward);
        let g2 = s.to_local().sum_all()?.backward()?;
        let bwd2 = counts(&mode, Phase::Backward);
        let ok2 = close(s.to_local(), d.to_local(), 0.0).is_ok()
            && close(
                g2.get(v2.as_tensor()).ok_or("no grad")?,
                &x.ones_like()?,
                0.0,
            )
            .is_ok();
        Ok((held, fwd, bwd, ok, fwd2, bwd2, ok2))
    });
    let held: Vec<Vec<f32>> = res.iter().map(|r| r.0.clone()).collect();
    let want: Vec<Vec<f32>> = [&[0usize, 1, 5][..], &[2, 3, 6], &[4, 7], &[8]]
        .iter()
        .map(|rows| rows.iter().map(|&r| (2 * r) as f32).collect())
        .collect();
    assert_eq!(held, want);
    for r in res {
        assert_eq!(r.1, vec![("all_gather", 1)]);
        assert_eq!(r.2, vec![]);
        assert!(r.3, "SS -> R values / grads");
        assert_eq!(r.4, vec![]);
        assert_eq!(r.5, vec![("all_gather", 1)]);
        assert!(r.6, "R -> SS values / grads");
    }
}

/// The gradient placement rule through a strided gather: an `SS(0,2)` input of a matmul whose
/// output is sharded on the same mesh dim gets its gradient reduce-scattered back into the
/// strided layout (fused all_gather / reduce_scatter), and equals the single-device gradient.
#[test]
fn strided_gather_fused_with_grad_sync() {
    let mut rng = Rng::new(11);
    let xf = tensor(&mut rng, &[9, 6], Domain::Normal);
    // w much larger than x, so the compiler moves x (gathers it) rather than w.
    let wf = tensor(&mut rng, &[6, 40], Domain::Normal);
    let gw = tensor(&mut rng, &[9, 40], Domain::Normal);
    let (vx, vw) = (
        Var::from_tensor(&xf).unwrap(),
        Var::from_tensor(&wf).unwrap(),
    );
    let yref = vx.matmul(vw.as_tensor()).unwrap();
    let g = yref
        .mul(&gw)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (gx, gwt) = (
        g.get(vx.as_tensor()).unwrap().clone(),
        g.get(vw.as_tensor()).unwrap().clone(),
    );
    let res = each_rank(&[4], |mesh| {
        // x is strided-sharded on rows, w column-sharded: the compiler gathers x (it must be R
        // for the column-parallel row), so x's gradient is a per-rank partial sum.
        let xd = distribute_tensor(&xf, &mesh, &[ss(0, 2)])?;
        let v = Var::from_tensor(xd.to_local())?;
        let xd = DTensor::from_local_with_shape(v.as_tensor(), &mesh, &[ss(0, 2)], &[9, 6])?;
        let wd = distribute_tensor(&wf, &mesh, &[S(1)])?;
        let v2 = Var::from_tensor(wd.to_local())?;
        let wd = DTensor::from_local_with_shape(v2.as_tensor(), &mesh, &[S(1)], &[6, 40])?;
        let mode = CommDebugMode::start();
        let y = xd.matmul(&wd)?;
        let fwd = counts(&mode, Phase::Forward);
        drop(mode);
        let full = y.full_tensor()?;
        let mode = CommDebugMode::start();
        let grads = full.mul(&gw)?.sum_all()?.backward()?;
        let rs = mode.count("reduce_scatter", Phase::Backward);
        let gx_local = grads.get(v.as_tensor()).ok_or("no grad")?.clone();
        let gw_local = grads.get(v2.as_tensor()).ok_or("no grad")?.clone();
        let coord = mesh.coordinate();
        let want_x = shard_piece(&gx, &[ss(0, 2)], &[4], &coord);
        let want_w = shard_piece(&gwt, &[S(1)], &[4], &coord);
        Ok((
            fwd,
            rs,
            close(&full, &yref, TOL).map_err(|e| e.to_string()),
            close(&gx_local, &want_x, TOL).map_err(|e| e.to_string()),
            close(&gw_local, &want_w, TOL).map_err(|e| e.to_string()),
        ))
    });
    for r in res {
        assert_eq!(r.0, vec![("all_gather", 1)], "x is gathered once");
        assert_eq!(r.1, 1, "x's gradient is reduce-scattered once");
        assert_eq!((r.2, r.3, r.4), (Ok(()), Ok(()), Ok(())));
    }
}

/// `redistribute_async` gives the same values and gradients as the blocking form (it is also
/// used at random by the pair tests) and can overlap local work.
#[test]
fn redistribute_async_matches() {
    let x = arange(&[7, 5]);
    let res = each_rank(&[2, 3], |mesh| {
        let d = distribute_tensor(&x, &mesh, &[S(0), S(1)])?;
        let v = Var::from_tensor(d.to_local())?;
        let d = DTensor::from_local_with_shape(v.as_tensor(), &mesh, &[S(0), S(1)], &[7, 5])?;
        let h = d.redistribute_async(&[S(1), Rep]);
        let local_work = d.to_local().sqr()?.sum_all()?;
        let a = h.wait()?;
        let b = d.redistribute(&[S(1), Rep])?;
        let same = close(a.to_local(), b.to_local(), 0.0).is_ok();
        let full = a.full_tensor()?;
        let g = (full.sum_all()? + local_work)?.backward()?;
        let grad = g.get(v.as_tensor()).ok_or("no grad")?;
        // d(sum(x) + sum(x_local^2)) = 1 + 2 x_local
        let want = (d.to_local().affine(2.0, 1.0))?;
        Ok((
            same,
            close(&full, &x, 0.0).is_ok(),
            close(grad, &want, TOL).is_ok(),
        ))
    });
    for r in res {
        assert_eq!(r, (true, true, true));
    }
}

/// `redistribute_async` whose caller dropped its own handle to the source before `wait` (the
/// helper hands the source back, so that on CUDA it is freed on the caller's stream after the
/// wait): still the blocking form's values, and a failing redistribution still reports.
#[test]
fn redistribute_async_outlives_the_callers_handle() {
    let x = arange(&[7, 5]);
    let res = each_rank(&[2, 3], |mesh| {
        let want = distribute_tensor(&x, &mesh, &[S(0), S(1)])?.redistribute(&[S(1), Rep])?;
        let h = distribute_tensor(&x, &mesh, &[S(0), S(1)])?.redistribute_async(&[S(1), Rep]);
        let a = h.wait()?;
        // Shard -> Partial is refused: the error comes back through `wait`.
        let bad = distribute_tensor(&x, &mesh, &[S(0), S(1)])?
            .redistribute_async(&[S(0), Placement::Partial(ReduceOp::Sum)])
            .wait()
            .is_err();
        Ok((close(a.to_local(), want.to_local(), 0.0).is_ok(), bad))
    });
    for r in res {
        assert_eq!(r, (true, true));
    }
}

/// The gradient of a Partial leaf read as a DTensor (docs/ARCHITECTURE.md, "Gradients of
/// Partial values"): its `full_tensor()` is the gradient of the value (here the loss weights)
/// and its placements say how it is held: `P(sum)` and `P(avg)` mesh dims come back
/// `Replicate` (every rank holds the gradient), `P(max)`/`P(min)` come back `P(sum)` (the
/// owners of the extreme hold it). Summands are distinct; `P(product)` is a typed error.
#[test]
fn partial_leaf_gradients_follow_the_rule() {
    let cases: [(&[usize], &str, &str); 6] = [
        (&[4], "P(sum)", "R"),
        (&[3], "P(avg)", "R"),
        (&[4], "P(max)", "P(sum)"),
        (&[3], "P(min)", "P(sum)"),
        (&[2, 2], "P(max),P(avg)", "P(sum),R"),
        (&[2, 3], "S(1),P(min)", "S(1),P(sum)"),
    ];
    for (mesh, src, want) in cases {
        let mut rng = Rng::for_name("partial-leaf", mesh.len() as u64);
        let full = tensor(&mut rng, &[5, 7], Domain::Normal);
        let weight = tensor(&mut rng, &[5, 7], Domain::Normal);
        let (pieces, _) = make_pieces(&mut rng, &full, &p(src), mesh, false);
        let res = each_rank(mesh, |m| {
            let v = Var::from_tensor(&pieces[m.rank()])?;
            let x = DTensor::from_local_with_shape(v.as_tensor(), &m, &p(src), &[5, 7])?;
            let w = distribute_tensor(&weight, &m, &all_r(m.ndim()))?;
            let loss = x.redistribute(&all_r(m.ndim()))?.mul(&w)?.sum_all()?;
            let g = x.grad(&loss.backward()?)?.ok_or("no gradient")?;
            let ok = close(&g.full_tensor()?, &weight, TOL).is_ok();
            Ok((format_placements(g.placements()), ok))
        });
        for (placements, ok) in res {
            assert_eq!(placements, want, "{src} on {mesh:?}");
            assert!(ok, "{src} on {mesh:?}: full_tensor() of the gradient");
        }
    }
    let res = each_rank(&[2], |m| {
        let x = DTensor::from_local(
            &Tensor::ones((2, 3), DType::F32, &Device::Cpu)?,
            &m,
            &p("P(product)"),
        )?;
        let v = Var::from_tensor(x.to_local())?;
        let x = DTensor::from_local(v.as_tensor(), &m, &p("P(product)"))?;
        let loss = x.redistribute(&[Rep])?.sum_all()?;
        let e = x.grad(&loss.backward()?).err().map(|e| e.to_string());
        Ok(e.unwrap_or_default())
    });
    for e in res {
        assert!(
            e.contains("grad") && e.contains("P(product)") && e.contains("rank"),
            "{e}"
        );
    }
}
