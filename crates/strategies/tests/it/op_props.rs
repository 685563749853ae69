//! Property test: for random ops, shapes, meshes and input placements, execute propagate()'s
//! redistribution plans with the reference executor, run the op locally on every rank (plain Rust
//! implementations), and check that the outputs, read through their output placements, equal the
//! single-device result.

use candle_dtensor_strategies::{
    local_indices, local_shape, propagate_with, BinaryOp, CollectiveKind, DTensorSpec,
    ExpandMethod, Op, Placement, ScalarOp, Step, UnaryOp,
};

use crate::common::exec::{apply_step, assemble, coords, materialize, same};
use crate::common::opgen::random_case;
use crate::common::{Arr, Rng};
use crate::plan_props::random_mesh;

fn binary(op: BinaryOp) -> fn(f64, f64) -> f64 {
    match op {
        BinaryOp::Add => |a, b| a + b,
        BinaryOp::Sub => |a, b| a - b,
        BinaryOp::Mul => |a, b| a * b,
        BinaryOp::Div => |a, b| a / b,
        BinaryOp::Maximum => f64::max,
        BinaryOp::Minimum => f64::min,
    }
}

fn unary(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sqr => x * x,
        other => panic!("unary {other} not in the reference executor"),
    }
}

/// Embedding / index_select with an owned-index mask: rows of `table` along `dim` hold the global
/// indices `owned` (None: all, in order); unowned ids give zeros.
fn lookup(table: &Arr, dim: usize, owned: Option<&[usize]>, ids: &[f64]) -> Arr {
    let pos: Vec<Option<usize>> = ids
        .iter()
        .map(|&id| {
            let id = id as usize;
            match owned {
                None => Some(id),
                Some(o) => o.iter().position(|&g| g == id),
            }
        })
        .collect();
    let mut shape = table.shape.clone();
    shape[dim] = ids.len();
    let mut j = vec![0; shape.len()];
    Arr::from_fn(&shape, |i| match pos[i[dim]] {
        Some(p) => {
            j.copy_from_slice(i);
            j[dim] = p;
            table.at(&j)
        }
        None => 0.0,
    })
}

/// The op on (local or global) arrays. `out_shape` is the (local) output shape for views;
/// `global` the global input shapes (a mean divides its local sum by the global count).
fn apply(
    op: &Op,
    x: &[Arr],
    out_shape: &[usize],
    owned: Option<&[usize]>,
    global: &[&[usize]],
) -> Arr {
    match op {
        Op::Matmul => x[0].matmul(&x[1]),
        Op::Linear { bias } => {
            let y = x[0].matmul(&x[1].transpose_last2());
            if *bias {
                y.broadcast_zip(&x[2], |a, b| a + b)
            } else {
                y
            }
        }
        Op::Binary(b) => x[0].broadcast_zip(&x[1], binary(*b)),
        Op::Unary(u) => x[0].map(|v| unary(*u, v)),
        Op::Affine { mul, add } => x[0].map(|v| v * mul.get() + add.get()),
        Op::ScalarOp(s, c) => {
            let c = c.get();
            match s {
                ScalarOp::Add => x[0].map(|v| v + c),
                ScalarOp::Mul => x[0].map(|v| v * c),
                ScalarOp::Maximum => x[0].map(|v| v.max(c)),
                other => panic!("{other} not in the reference executor"),
            }
        }
        Op::Mean { dims, keepdim } => {
            let all: Vec<usize> = (0..global[0].len()).collect();
            let reduced = if dims.is_empty() { &all[..] } else { &dims[..] };
            let count: usize = reduced.iter().map(|&d| global[0][d]).product();
            x[0].reduce(dims, *keepdim, "sum").map(|v| v / count as f64)
        }
        Op::Sum { dims, keepdim } | Op::Max { dims, keepdim } | Op::Min { dims, keepdim } => {
            let kind = match op {
                Op::Sum { .. } => "sum",
                Op::Max { .. } => "max",
                _ => "min",
            };
            x[0].reduce(dims, *keepdim, kind)
        }
        Op::Softmax { dim } => x[0].softmax(*dim),
        Op::Reshape { .. } | Op::Unsqueeze { .. } => x[0].reshape(out_shape),
        Op::Transpose { dim0, dim1 } => {
            let mut p: Vec<usize> = (0..x[0].shape.len()).collect();
            p.swap(*dim0, *dim1);
            x[0].permute(&p)
        }
        // A full-length narrow is the identity, and may be sharded: use the local length.
        Op::Narrow { dim, start, .. } => {
            x[0].select(*dim, &(*start..start + out_shape[*dim]).collect::<Vec<_>>())
        }
        Op::Cat { dim } => Arr::concat(x, *dim),
        Op::Embedding => {
            let ids = &x[0];
            let flat = lookup(&x[1], 0, owned, &ids.data);
            let mut shape = ids.shape.clone();
            shape.push(x[1].shape[1]);
            flat.reshape(&shape)
        }
        Op::IndexSelect { dim } => lookup(&x[0], *dim, owned, &x[1].data),
        other => panic!("{other} not in the reference executor"),
    }
}

pub fn values(rng: &mut Rng, spec: &DTensorSpec, bound: usize) -> Arr {
    if spec.dtype().is_int() {
        Arr::from_fn(spec.shape(), |_| rng.below(bound) as f64)
    } else {
        // Away from 0 so div stays tame; halves so sums are exact-ish.
        Arr::from_fn(spec.shape(), |_| {
            let v = 0.5 + (rng.below(8) as f64) / 2.0;
            if rng.chance(0.5) {
                v
            } else {
                -v
            }
        })
    }
}

/// Few ids into a table sharded on the indexed dim: the masked-partial and rma_get plans.
fn index_case(
    rng: &mut Rng,
    mesh: &candle_dtensor_strategies::MeshTopology,
) -> crate::common::opgen::Case {
    use candle_dtensor_strategies::{DType, Placements};
    let v = rng.range(12, 40);
    let d = rng.range(2, 5);
    let k = rng.range(1, 3);
    let sharded: Placements = (0..mesh.ndim())
        .map(|_| {
            if rng.chance(0.7) {
                Placement::Shard(0)
            } else {
                Placement::Replicate
            }
        })
        .collect();
    let repl: Placements = (0..mesh.ndim()).map(|_| Placement::Replicate).collect();
    if rng.chance(0.5) {
        crate::common::opgen::Case {
            op: Op::Embedding,
            specs: vec![
                DTensorSpec::new(&[k], DType::U32, &repl),
                DTensorSpec::new(&[v, d], DType::F32, &sharded),
            ],
            index_bound: v,
        }
    } else {
        crate::common::opgen::Case {
            op: Op::IndexSelect { dim: 0 },
            specs: vec![
                DTensorSpec::new(&[v, d], DType::F32, &sharded),
                DTensorSpec::new(&[k], DType::U32, &repl),
            ],
            index_bound: v,
        }
    }
}

/// What one end-to-end check saw.
#[derive(Default)]
pub struct Seen {
    pub redistributed: usize,
    pub partial_out: bool,
    pub masked: bool,
    pub rma: usize,
}

/// Propagates `op` on `specs`, executes the plans and the local op on every rank, and checks the
/// output against the single-device result. Returns the decision for further assertions.
pub fn check(
    label: &str,
    op: &Op,
    specs: &[DTensorSpec],
    mesh: &candle_dtensor_strategies::MeshTopology,
    method: ExpandMethod,
    rng: &mut Rng,
    index_bound: usize,
) -> (candle_dtensor_strategies::OpSharding, Seen) {
    let mut seen = Seen::default();
    let refs: Vec<&DTensorSpec> = specs.iter().collect();
    let s = propagate_with(op, &refs, mesh, method)
        .unwrap_or_else(|e| panic!("{label}: {op} {refs:?}: {e}"));
    let ms = mesh.shape().to_vec();
    let world: usize = ms.iter().product();
    let full: Vec<Arr> = specs
        .iter()
        .map(|sp| values(rng, sp, index_bound.max(1)))
        .collect();
    let ctx = || format!("{label}: {op} {refs:?} on {mesh} -> {:?}", s.input_specs);
    let mut locals: Vec<Vec<Arr>> = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let mut l = materialize(&full[i], &spec.placements, &ms, rng.next_u64());
        if let Some(plan) = &s.redistributions[i] {
            seen.redistributed += 1;
            for st in &plan.steps {
                apply_step(&mut l, st, &ms).unwrap();
            }
        }
        let back = assemble(&l, &s.input_specs[i].placements, &ms, spec.shape())
            .unwrap_or_else(|e| panic!("{}: input {i}: {e}", ctx()));
        assert!(same(&back, &full[i]), "{}: input {i} changed value", ctx());
        locals.push(l);
    }
    // Internal comms: rma_get fetches the selected rows from their owners, i.e. the op sees the
    // source gathered over those mesh dims (emulated innermost first); a softmax over a sharded
    // dim all_reduces its max and sum there, i.e. it sees that dim whole and keeps its chunk.
    let mut before = s.input_specs[0].placements.clone();
    let mut rechunk: Vec<usize> = Vec::new();
    for (m, comm) in s.internal.iter().rev() {
        match (op, comm.kind) {
            (_, CollectiveKind::RmaGet) => seen.rma += 1,
            (Op::Softmax { .. }, CollectiveKind::AllReduce) => {
                if rechunk.contains(m) {
                    continue;
                }
                rechunk.push(*m);
            }
            (_, k) => panic!("{}: internal {k} not emulated", ctx()),
        }
        let step = Step {
            mesh_dims: smallvec::smallvec![*m],
            from: before[*m],
            to: Placement::Replicate,
            kind: CollectiveKind::AllGather,
            logical_shape: s.input_specs[0].meta.shape.clone(),
            bytes: 0,
            est_us: 0.0,
            before: before.clone(),
            permute: false,
        };
        apply_step(&mut locals[0], &step, &ms).unwrap();
        before[*m] = Placement::Replicate;
    }
    let out = &s.output_specs[0];
    let global: Vec<&[usize]> = specs.iter().map(|s| s.shape()).collect();
    seen.masked = out
        .placements
        .iter()
        .any(|p| matches!(p, Placement::MaskPartial { .. }));
    seen.partial_out = out.placements.iter().any(|p| p.is_partial());
    let mut out_pl = out.placements.clone();
    for &m in &rechunk {
        out_pl[m] = Placement::Replicate;
    }
    let mut outs = Vec::with_capacity(world);
    for rank in 0..world {
        let coord = coords(&ms, rank);
        let args: Vec<Arr> = locals.iter().map(|l| l[rank].clone()).collect();
        let out_local = local_shape(out.shape(), &ms, &coord, &out_pl).unwrap();
        let owned = if seen.masked {
            let (t, dim) = match op {
                Op::Embedding => (1, 0),
                Op::IndexSelect { dim } => (0, *dim),
                _ => panic!("{}: masked output", ctx()),
            };
            Some(local_indices(
                specs[t].shape()[dim],
                &ms,
                &coord,
                &before_or(&s, t, &before),
                dim,
            ))
        } else {
            None
        };
        let y = apply(op, &args, &out_local, owned.as_deref(), &global);
        assert_eq!(
            y.shape,
            out_local.as_slice(),
            "{}: rank {rank} local output shape",
            ctx()
        );
        outs.push(y);
    }
    for &m in &rechunk {
        let step = Step {
            mesh_dims: smallvec::smallvec![m],
            from: Placement::Replicate,
            to: out.placements[m],
            kind: CollectiveKind::LocalChunk,
            logical_shape: out.meta.shape.clone(),
            bytes: 0,
            est_us: 0.0,
            before: out_pl.clone(),
            permute: false,
        };
        apply_step(&mut outs, &step, &ms).unwrap();
        out_pl[m] = out.placements[m];
    }
    let got = assemble(&outs, &out.placements, &ms, out.shape())
        .unwrap_or_else(|e| panic!("{}: output {}: {e}", ctx(), out));
    let want = apply(op, &full, out.shape(), None, &global);
    assert!(
        same(&got, &want),
        "{}: output {} wrong:\n got {:?}\nwant {:?}",
        ctx(),
        out,
        got.data,
        want.data
    );
    (s, seen)
}

fn before_or(
    s: &candle_dtensor_strategies::OpSharding,
    t: usize,
    gathered: &candle_dtensor_strategies::Placements,
) -> candle_dtensor_strategies::Placements {
    if t == 0 {
        gathered.clone()
    } else {
        s.input_specs[t].placements.clone()
    }
}

#[test]
fn propagated_ops_match_single_device() {
    let mut rng = Rng(0x0b5);
    let (mut redistributed, mut partial_out, mut masked, mut rma) = (0, 0, 0, 0);
    for case in 0..3000 {
        let mesh = random_mesh(&mut rng, 3);
        let mut c = random_case(&mut rng, &mesh, true);
        if case % 8 == 0 {
            c = index_case(&mut rng, &mesh);
        }
        let method = if case % 3 == 0 {
            ExpandMethod::Dijkstra
        } else {
            ExpandMethod::Auto
        };
        let (_, seen) = check(
            &format!("case {case}"),
            &c.op,
            &c.specs,
            &mesh,
            method,
            &mut rng,
            c.index_bound,
        );
        redistributed += seen.redistributed;
        partial_out += seen.partial_out as usize;
        masked += seen.masked as usize;
        rma += seen.rma;
    }
    assert!(
        redistributed > 600 && partial_out > 200 && masked > 40 && rma > 40,
        "{redistributed} {partial_out} {masked} {rma}"
    );
}
