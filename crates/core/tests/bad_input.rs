//! Bad input gives typed `DTensorError`s whose message names the op, the rank and the
//! placements, on every rank, never a panic and never a wrong result: DTensors on different
//! meshes, wrong placement counts, shard dims out of range, local pieces that do not form the
//! stated global shape (`from_local_checked` names the offending rank), shapes an op cannot
//! take, `Shard -> Partial`; and a fuzz over random (mostly invalid) shapes: every op either
//! errors like single-device candle does or returns its result.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::Comm;
use candle_dtensor_core::{
    apply, apply_all, distribute_tensor, reference_apply, DTensor, DTensorError,
};
use candle_dtensor_core::{Placement, ReduceOp};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::{format_placements, parse_placements, Op};
use common::*;

use Placement::{Replicate as Rep, Shard as S};

fn p(s: &str) -> Vec<Placement> {
    parse_placements(s).unwrap().to_vec()
}

fn zeros(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap()
}

/// Zeros of `shape` and `dtype` distributed on `mesh` with placements `pl`.
fn zeros_on(
    mesh: &DeviceMesh,
    shape: &[usize],
    dtype: DType,
    pl: &str,
) -> Result<DTensor, DTensorError> {
    let t = Tensor::zeros(shape, dtype, &Device::Cpu).unwrap();
    distribute_tensor(&t, mesh, &p(pl))
}

/// Checks that `r` is an error whose message names `op`, this rank and every string in `also`.
fn expect_err<T>(
    r: Result<T, DTensorError>,
    op: &str,
    rank: usize,
    also: &[&str],
    what: &str,
) -> Result<DTensorError, String> {
    let e = match r {
        Ok(_) => return Err(format!("{what}: accepted")),
        Err(e) => e,
    };
    let m = e.to_string();
    let mut missing: Vec<&str> = Vec::new();
    if !m.starts_with(op) && !m.contains(&format!("{op} ")) {
        missing.push(op);
    }
    let r = format!("rank {rank}");
    if !m.contains(&r) {
        missing.push(&r);
    }
    for a in also {
        if !m.contains(a) {
            missing.push(a);
        }
    }
    if !missing.is_empty() {
        return Err(format!("{what}: message {m:?} lacks {missing:?}"));
    }
    Ok(e)
}

/// [`expect_err`], and the error must be of a kind `kind` accepts (else the problem says
/// `wrong`); the problem, if any.
fn expect_kind<T>(
    r: Result<T, DTensorError>,
    (op, rank, also, what): (&str, usize, &[&str], &str),
    kind: impl Fn(&DTensorError) -> bool,
    wrong: &str,
) -> Option<String> {
    match expect_err(r, op, rank, also, what) {
        Ok(e) if kind(&e) => None,
        Ok(e) => Some(format!("{what}: {wrong}: {e}")),
        Err(e) => Some(e),
    }
}

/// Runs `f` on every rank of `mesh`; each rank returns its list of problems, and there must be
/// none.
fn check_on(mesh: &[usize], what: &str, f: impl Fn(DeviceMesh) -> R<Vec<String>> + Send + Sync) {
    let problems: Vec<String> = on_mesh(mesh, f)
        .unwrap_or_else(|e| panic!("{what} on mesh {mesh:?}: {e}"))
        .into_iter()
        .flatten()
        .collect();
    assert_no_failures(what, &problems);
}

/// [`check_on`] for tests that build their meshes themselves from each rank's communicator.
fn check_on_world(n: usize, what: &str, f: impl Fn(Comm) -> R<Vec<String>> + Send + Sync) {
    let problems: Vec<String> = world(n)
        .launch(f)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .into_iter()
        .flatten()
        .collect();
    assert_no_failures(what, &problems);
}

#[test]
fn different_meshes_are_refused() {
    let dims = mesh_dims(&[2, 2]);
    check_on_world(4, "different meshes", |comm: Comm| {
        let m1 = DeviceMesh::new(comm.clone(), &dims)?;
        // Same shape and names, but another mesh (its own communicators).
        let m2 = DeviceMesh::new(comm.clone(), &dims)?;
        let m3 = DeviceMesh::new(comm, &[("x", 4)])?;
        let rank = m1.rank();
        let mut bad = Vec::new();
        let a = distribute_tensor(&zeros(&[4, 4]), &m1, &p("S(0),R"))?;
        let b = distribute_tensor(&zeros(&[4, 4]), &m2, &p("R,S(1)"))?;
        let c = distribute_tensor(&zeros(&[4, 4]), &m3, &p("S(1)"))?;
        let cond = zeros_on(&m1, &[4, 4], DType::U8, "R,R")?;
        let cases: Vec<(&str, Result<DTensor, DTensorError>, &str)> = vec![
            ("add", a.add(&b), "R,S(1)"),
            ("matmul", a.matmul(&c), "S(1)"),
            ("cat", DTensor::cat(&[&a, &b], 0), "R,S(1)"),
            ("stack", DTensor::stack(&[&a, &c], 0), "S(1)"),
            ("where", cond.where_cond(&b, &a), "R,S(1)"),
            ("linear", a.linear(&a, Some(&c)), "S(1)"),
        ];
        for (op, r, pl) in cases {
            let first = if op == "where" { "R,R" } else { "S(0),R" };
            bad.extend(expect_kind(
                r,
                (op, rank, &[first, pl], op),
                |e| matches!(e, DTensorError::MeshMismatch { .. }),
                "not a MeshMismatch",
            ));
        }
        Ok(bad)
    });
}

#[test]
fn placement_count_and_shard_dim() {
    check_on(&[2, 2], "placement count and shard dim", |mesh| {
        let rank = mesh.rank();
        let mut bad = Vec::new();
        let t = zeros(&[4, 6]);
        let x = distribute_tensor(&t, &mesh, &p("S(0),S(1)"))?;
        let checks: Vec<(&str, Result<DTensor, DTensorError>, Vec<&str>)> = vec![
            (
                "from_local",
                DTensor::from_local(&t, &mesh, &p("S(0)")),
                vec!["S(0)", "2-d mesh"],
            ),
            (
                "distribute_tensor",
                distribute_tensor(&t, &mesh, &p("S(0),R,R")),
                vec!["S(0),R,R", "2-d mesh"],
            ),
            (
                "redistribute",
                x.redistribute(&p("R")),
                vec!["R", "2-d mesh"],
            ),
            (
                "from_local",
                DTensor::from_local(&t, &mesh, &p("S(2),R")),
                vec!["S(2)", "out of range"],
            ),
            (
                "distribute_tensor",
                distribute_tensor(&t, &mesh, &p("R,S(5)")),
                vec!["S(5)", "out of range"],
            ),
            (
                "redistribute",
                x.redistribute(&p("S(3),R")),
                vec!["S(3)", "out of range"],
            ),
            (
                "from_local",
                DTensor::from_local_with_shape(&t, &mesh, &p("R,R"), &[4]),
                vec!["R,R"],
            ),
        ];
        for (op, r, also) in checks {
            if let Err(e) = expect_err(r, op, rank, &also, op) {
                bad.push(e);
            }
        }
        Ok(bad)
    });
}

#[test]
fn pieces_that_do_not_form_the_global_shape() {
    check_on(&[4], "pieces that do not form the global shape", |mesh| {
        let rank = mesh.rank();
        let mut bad = Vec::new();
        // [10, 3] S(0) on 4 ranks: pieces of 3, 3, 3, 1 rows. Rank 2 holds 2 rows instead.
        let rows = [3, 3, 2, 1][rank];
        let piece = zeros(&[rows, 3]);
        let mine = DTensor::from_local_with_shape(&piece, &mesh, &[S(0)], &[10, 3]);
        if rank == 2 {
            if let Err(e) = expect_err(
                mine,
                "from_local",
                rank,
                &["[2, 3]", "S(0)", "[3, 3]"],
                "own piece",
            ) {
                bad.push(e);
            }
        } else if mine.is_err() {
            bad.push(format!("rank {rank}: a fitting piece was refused"));
        }
        // The checked form: every rank names rank 2.
        let checked = DTensor::from_local_checked(&piece, &mesh, &[S(0)], Some(&[10, 3]));
        if let Err(e) = expect_err(
            checked,
            "from_local",
            rank,
            &["rank 2 ", "S(0)", "[10, 3]"],
            "checked",
        ) {
            bad.push(e);
        }
        // Without a global shape, the shape most pieces agree on is the reference ([12, 3]
        // from the 3-row pieces): ranks 2 and 3 are named, on every rank.
        let checked = DTensor::from_local_checked(&piece, &mesh, &[S(0)], None);
        if let Err(e) = expect_err(
            checked,
            "from_local",
            rank,
            &["rank 2 ", "ranks [3]", "[12, 3]"],
            "checked, inferred",
        ) {
            bad.push(e);
        }
        // Replicate pieces that disagree: rank 1's has another shape.
        let rp = zeros(if rank == 1 { &[4, 2] } else { &[4, 3] });
        let checked = DTensor::from_local_checked(&rp, &mesh, &[Rep], None);
        if let Err(e) = expect_err(
            checked,
            "from_local",
            rank,
            &["rank 1 ", "[4, 2]", "R"],
            "replicas",
        ) {
            bad.push(e);
        }
        // Good uneven pieces pass, and the result is right.
        let full = Tensor::arange(0f32, 30., &Device::Cpu)?.reshape((10, 3))?;
        let (n, off) = [(3, 0), (3, 3), (3, 6), (1, 9)][rank];
        let good =
            DTensor::from_local_checked(&full.narrow(0, off, n)?, &mesh, &[S(0)], Some(&[10, 3]))?;
        if close(&good.full_tensor()?, &full, 0.0).is_err() {
            bad.push(format!(
                "rank {rank}: checked uneven pieces assemble wrongly"
            ));
        }
        Ok(bad)
    });
}

#[test]
fn shard_to_partial_is_a_typed_error() {
    check_on(&[2, 3], "shard to partial", |mesh| {
        let rank = mesh.rank();
        let mut bad = Vec::new();
        let x = distribute_tensor(&zeros(&[5, 7]), &mesh, &p("S(0),S(1)"))?;
        for dst in ["P(sum),S(1)", "S(0),P(avg)", "P(max),R", "R,P(min)"] {
            bad.extend(expect_kind(
                x.redistribute(&p(dst)),
                ("redistribute", rank, &["S(0),S(1)", dst, "Partial"], dst),
                |e| matches!(e, DTensorError::Strategy { .. }),
                "not a compiler error",
            ));
        }
        // A size-1 mesh dim only relabels: allowed.
        Ok(bad)
    });
}

#[test]
fn shapes_an_op_cannot_take() {
    check_on(&[2, 2], "shapes an op cannot take", |mesh| {
        let rank = mesh.rank();
        let mut bad = Vec::new();
        let f = |shape: &[usize], pl: &str| zeros_on(&mesh, shape, DType::F32, pl);
        let ids = |shape: &[usize], pl: &str| zeros_on(&mesh, shape, DType::U32, pl);
        let a = f(&[4, 5], "S(0),R")?;
        let b = f(&[6, 3], "R,S(1)")?;
        let c = f(&[3, 5], "R,R")?;
        let v = f(&[5], "R,R")?;
        let q3 = f(&[2, 4, 3], "S(0),R")?;
        let cases: Vec<(&str, Result<DTensor, DTensorError>)> = vec![
            ("matmul", a.matmul(&b)),
            ("add", a.add(&c)),
            ("reshape", a.reshape(&[3, 7])),
            ("squeeze", a.squeeze(0)),
            ("narrow", a.narrow(1, 3, 4)),
            ("transpose", a.transpose(0, 2)),
            ("permute", a.permute(&[0, 0])),
            ("broadcast_as", a.broadcast_as(&[4, 6])),
            ("flatten", a.flatten(1, 0)),
            ("cat", DTensor::cat(&[&a, &b], 0)),
            ("stack", DTensor::stack(&[&a, &c], 0)),
            ("softmax", a.softmax(2)),
            ("sum", a.sum(&[2], false)),
            ("max", a.max(&[0, 0], true)),
            ("embedding", a.embedding(&b)),
            ("embedding", ids(&[4], "S(0),R")?.embedding(&v)),
            ("cross_entropy", a.cross_entropy(&ids(&[3], "R,R")?)),
            ("index_select", a.index_select(&ids(&[2, 2], "R,R")?, 0)),
            ("gather", a.gather(&ids(&[4], "R,R")?, 0)),
            ("linear", a.linear(&c, Some(&v))),
            (
                "layer_norm",
                a.layer_norm(Some(&f(&[4], "R,R")?), None, 1e-5),
            ),
            ("rms_norm", a.rms_norm(&c, 1e-5)),
            ("sdpa", q3.sdpa(&q3, &q3, false, None)),
            ("dropout", a.dropout(1.5, 0)),
            ("where", a.where_cond(&a, &a)),
            ("masked_fill", a.masked_fill(&ids(&[3, 5], "R,R")?, 0.0)),
            ("matmul", apply(&Op::Matmul, &[&a])),
        ];
        for (op, r) in cases {
            bad.extend(expect_kind(
                r,
                (op, rank, &[], op),
                |e| {
                    matches!(
                        e,
                        DTensorError::Strategy { .. } | DTensorError::Invalid { .. }
                    )
                },
                "unexpected kind of error",
            ));
        }
        // A compiler error lists the inputs' shapes and placements.
        let e = a
            .matmul(&b)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        for want in [
            "[4, 5] f32 S(0),R",
            "[6, 3] f32 R,S(1)",
            "inner dims differ",
        ] {
            if !e.contains(want) {
                bad.push(format!("matmul error {e:?} lacks {want:?}"));
            }
        }
        Ok(bad)
    });
}

/// Ops the fuzz draws, with how many inputs they take.
fn fuzz_op(rng: &mut Rng) -> (Op, usize) {
    use candle_dtensor_strategies::{BinaryOp, UnaryOp};
    let d = rng.below(4);
    let d2 = rng.below(4);
    let shape: Vec<usize> = (0..rng.below(4)).map(|_| rng.range(1, 6)).collect();
    match rng.below(17) {
        0 => (Op::Matmul, 2),
        1 => (Op::BroadcastMatmul, 2),
        2 => (
            Op::Linear {
                bias: rng.chance(0.5),
            },
            2 + rng.below(2),
        ),
        3 => (Op::Binary(rng.pick(BinaryOp::ALL)), 2),
        4 => (Op::Unary(rng.pick(UnaryOp::ALL)), 1),
        5 => (
            Op::Sum {
                dims: smallvec::smallvec![d],
                keepdim: rng.chance(0.5),
            },
            1,
        ),
        6 => (
            Op::Max {
                dims: smallvec::smallvec![d, d2],
                keepdim: rng.chance(0.5),
            },
            1,
        ),
        7 => (Op::Softmax { dim: d }, 1),
        8 => (
            Op::Reshape {
                shape: shape.into_iter().collect(),
            },
            1,
        ),
        9 => (Op::Transpose { dim0: d, dim1: d2 }, 1),
        10 => (
            Op::Narrow {
                dim: d,
                start: rng.below(3),
                len: rng.below(4),
            },
            1,
        ),
        11 => (Op::Squeeze { dim: d }, 1),
        12 => (Op::Unsqueeze { dim: d }, 1),
        13 => (
            Op::BroadcastAs {
                shape: shape.into_iter().collect(),
            },
            1,
        ),
        14 => (Op::Cat { dim: d }, 2),
        15 => (Op::Flatten { start: d, end: d2 }, 1),
        _ => (
            Op::LayerNorm {
                eps: 1e-5.into(),
                affine: true,
                bias: false,
            },
            2,
        ),
    }
}

/// Random ops on random shapes (most of them invalid): the DTensor op must fail exactly when the
/// single-device op fails, with a typed error, and otherwise return the single-device result.
/// A panic anywhere fails the world and the test.
#[test]
fn fuzz_random_shapes() {
    let n_cases = 120 * sweep_scale();
    for mesh in [&[3][..], &[2, 2]] {
        let mut rng = Rng::for_name("fuzz", mesh.len() as u64);
        let mut cases = Vec::new();
        for _ in 0..n_cases {
            let (op, n_in) = fuzz_op(&mut rng);
            let inputs: Vec<Tensor> = (0..n_in)
                .map(|_| {
                    let nd = rng.range(1, 3);
                    let shape: Vec<usize> = (0..nd).map(|_| rng.range(1, 5)).collect();
                    tensor(&mut rng, &shape, Domain::Normal)
                })
                .collect();
            // Single-device candle, shielded from its own panics on nonsense shapes.
            let reference = catch_unwind(AssertUnwindSafe(|| reference_apply(&op, &inputs)));
            let reference = match reference {
                Ok(r) => r.ok(),
                Err(_) => None,
            };
            let placements: Vec<Vec<Placement>> = inputs
                .iter()
                .map(|t| random_placements(&mut rng, t.rank(), mesh.len(), &[ReduceOp::Sum]))
                .collect();
            cases.push((op, inputs, placements, reference));
        }
        check_on(mesh, "fuzz", |m| {
            let mut bad = Vec::new();
            let mut computed = 0usize;
            let rank = m.rank();
            for (op, inputs, placements, reference) in &cases {
                let desc = format!(
                    "{op:?} on {:?}",
                    inputs
                        .iter()
                        .zip(placements)
                        .map(|(t, p)| format!("{:?} {}", t.dims(), format_placements(p)))
                        .collect::<Vec<_>>()
                );
                let ds: Vec<DTensor> = inputs
                    .iter()
                    .zip(placements)
                    .map(|(t, p)| distribute_tensor(t, &m, p))
                    .collect::<Result<_, _>>()?;
                let refs: Vec<&DTensor> = ds.iter().collect();
                match (apply(op, &refs), reference) {
                    (Ok(y), Some(want)) => {
                        computed += 1;
                        if let Err(e) = close(&y.full_tensor()?, want, TOL) {
                            bad.push(format!("rank {rank}: {desc}: {e}"));
                        }
                    }
                    (Ok(y), None) => bad.push(format!(
                        "rank {rank}: {desc}: accepted (shape {:?}) but single-device candle refuses it",
                        y.shape()
                    )),
                    // The compiler may be stricter than candle on purpose (`squeeze` of a dim
                    // that is not 1, norm weights that are not `[D]`): a typed refusal is fine.
                    // A local candle failure after the compiler accepted is not.
                    (Err(e), Some(_))
                        if !matches!(e, DTensorError::Strategy { .. } | DTensorError::Invalid { .. }) =>
                    {
                        bad.push(format!("rank {rank}: {desc}: refused but candle computes it: {e}"))
                    }
                    (Err(e), _) => {
                        let m = e.to_string();
                        if !m.contains(&format!("rank {rank}")) || !m.contains(op.name()) {
                            bad.push(format!("rank {rank}: {desc}: unclear error {m:?}"));
                        }
                    }
                }
            }
            // The fuzz must also run valid ops, not only refuse invalid ones.
            if computed * 5 < cases.len() {
                bad.push(format!(
                    "only {computed} of {} cases were valid",
                    cases.len()
                ));
            }
            Ok(bad)
        });
    }
}

/// The ops of issue 14 item 9 refuse bad input with typed errors naming the op, the rank and
/// the inputs' shapes and placements: wrong arity, dims out of range, shapes that do not fit,
/// arguments the op cannot take, inputs on different meshes.
#[test]
fn new_ops_refuse_bad_input() {
    use candle_dtensor_strategies::Shape;
    let dims = mesh_dims(&[2, 2]);
    check_on_world(4, "new ops' bad input", |comm: Comm| {
        let mesh = DeviceMesh::new(comm.clone(), &dims)?;
        let other = DeviceMesh::new(comm, &dims)?;
        let rank = mesh.rank();
        let f = |shape: &[usize], pl: &str| zeros_on(&mesh, shape, DType::F32, pl);
        let ids = |shape: &[usize], pl: &str| zeros_on(&mesh, shape, DType::I64, pl);
        let x = f(&[4, 5], "S(0),R")?;
        let x3 = f(&[2, 4, 3], "R,S(1)")?;
        let elsewhere = distribute_tensor(&zeros(&[4, 5]), &other, &p("R,R"))?;
        let first = "[4, 5] f32 S(0),R";
        let sh = |v: &[usize]| -> Shape { v.iter().copied().collect() };
        type Outs = Result<Vec<DTensor>, DTensorError>;
        let cases: Vec<(&str, Outs, Vec<&str>)> = vec![
            (
                "norm",
                x.norm(2.0, &[2], false).map(|t| vec![t]),
                vec![first, "dim 2"],
            ),
            (
                "norm",
                x.norm(-1.0, &[1], false).map(|t| vec![t]),
                vec![first, "p = -1"],
            ),
            (
                "norm",
                ids(&[4], "R,R")?.norm(2.0, &[0], false).map(|t| vec![t]),
                vec!["float"],
            ),
            (
                "logsumexp",
                x.logsumexp(&[0, 0], false).map(|t| vec![t]),
                vec![first, "repeated"],
            ),
            (
                "var",
                x.var(&[3], false, 1).map(|t| vec![t]),
                vec![first, "dim 3"],
            ),
            (
                "std",
                x.std(&[5], true, 0).map(|t| vec![t]),
                vec![first, "dim 5"],
            ),
            (
                "prod",
                x.prod(&[2], false).map(|t| vec![t]),
                vec![first, "dim 2"],
            ),
            (
                "argmin",
                x.argmin(4, false).map(|t| vec![t]),
                vec![first, "dim 4"],
            ),
            ("split", x.split(&[2, 2], 1), vec![first, "do not add up"]),
            ("split", x.split(&[4], 2), vec![first, "out of range"]),
            ("unbind", x.unbind(2), vec![first, "out of range"]),
            (
                "topk",
                x.topk(6, 1, true).map(|(a, b)| vec![a, b]),
                vec![first, "k = 6"],
            ),
            (
                "topk",
                x.topk(1, 2, false).map(|(a, b)| vec![a, b]),
                vec![first, "out of range"],
            ),
            (
                "scatter_add",
                x.scatter_add(&ids(&[2, 4], "R,R")?, &f(&[2, 5], "R,R")?, 0)
                    .map(|t| vec![t]),
                vec![first, "[2, 4] i64 R,R", "same shape"],
            ),
            (
                "scatter_add",
                x.scatter_add(&f(&[2, 5], "R,R")?, &f(&[2, 5], "R,R")?, 0)
                    .map(|t| vec![t]),
                vec![first, "integer"],
            ),
            (
                "index_put",
                x.index_put(&ids(&[3], "R,R")?, &f(&[2, 5], "R,R")?, 0, false)
                    .map(|t| vec![t]),
                vec![first, "[2, 5] f32 R,R", "indices must be 1-d"],
            ),
            (
                "index_add",
                x.index_add(&ids(&[2], "R,R")?, &f(&[2, 4], "R,R")?, 0)
                    .map(|t| vec![t]),
                vec![first, "x's shape off dim 0"],
            ),
            (
                "baddbmm",
                f(&[4], "R,R")?.baddbmm(&x3, &x3, 1.0, 1.0).map(|t| vec![t]),
                vec!["[2, 4, 3] f32 R,S(1)", "expects float a"],
            ),
            (
                "cumsum",
                x.cumsum(2).map(|t| vec![t]),
                vec![first, "out of range"],
            ),
            (
                "cumsum",
                ids(&[4], "R,R")?.cumsum(0).map(|t| vec![t]),
                vec!["float"],
            ),
            (
                "pad",
                x.pad(3, 1, 1, 0.0).map(|t| vec![t]),
                vec![first, "out of range"],
            ),
            (
                "scatter_add",
                x.scatter_add(&ids(&[2, 5], "R,R")?, &elsewhere, 0)
                    .map(|t| vec![t]),
                vec![first, "different meshes"],
            ),
            (
                "baddbmm",
                apply_all(
                    &Op::Baddbmm {
                        alpha: 1.0.into(),
                        beta: 1.0.into(),
                    },
                    &[&x, &x],
                ),
                vec!["takes 3 inputs, got 2"],
            ),
            (
                "topk",
                apply_all(
                    &Op::TopK {
                        k: 1,
                        dim: 0,
                        largest: true,
                    },
                    &[&x, &x],
                ),
                vec!["takes 1 inputs, got 2"],
            ),
            (
                "split",
                apply(
                    &Op::Split {
                        dim: 0,
                        sizes: sh(&[2, 2]),
                    },
                    &[&x],
                )
                .map(|t| vec![t]),
                vec!["2 outputs"],
            ),
        ];
        let mut bad = Vec::new();
        for (op, r, also) in cases {
            bad.extend(expect_kind(
                r,
                (op, rank, &also, op),
                |e| {
                    matches!(
                        e,
                        DTensorError::Strategy { .. }
                            | DTensorError::Invalid { .. }
                            | DTensorError::MeshMismatch { .. }
                    )
                },
                "unexpected kind of error",
            ));
        }
        Ok(bad)
    });
}

/// Unary maps candle has no integer form of (its kernels `todo!()` there: a panic reachable
/// from safe code) are refused on integer DTensors with a typed error naming the op, the rank
/// and the input; the maps candle computes on integers (relu, gelu, gelu_erf, silu, abs) give
/// its single-device result.
#[test]
fn unary_maps_without_an_integer_form_refuse_integers() {
    use candle_dtensor_strategies::UnaryOp;
    let data = Tensor::new(&[1u32, 2, 3, 4], &Device::Cpu).unwrap();
    check_on(&[2], "integer unary", |m| {
        let x = distribute_tensor(&data, &m, &p("S(0)"))?;
        let mut bad = Vec::new();
        for u in UnaryOp::ALL.iter().copied() {
            let what = format!("{u} of u32");
            let got = x.unary(u);
            if u.float_only() {
                let also = ["[4] u32 S(0)", "needs a float input"];
                if let Err(e) = expect_err(got, u.name(), m.rank(), &also, &what) {
                    bad.push(e);
                }
                continue;
            }
            match got.and_then(|y| y.full_tensor()) {
                Ok(y) => {
                    let want = reference_apply(&Op::Unary(u), std::slice::from_ref(&data))?;
                    if y.to_vec1::<u32>()? != want.to_vec1::<u32>()? {
                        bad.push(format!("{what}: not the single-device result"));
                    }
                }
                Err(e) => bad.push(format!("{what}: refused: {e}")),
            }
        }
        Ok(bad)
    });
}
