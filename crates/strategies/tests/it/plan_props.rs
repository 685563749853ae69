//! Property test: for random shapes (sizes 1..9, uneven), meshes (1-D to 3-D, sizes 1-4, random
//! links and flattened groups) and placements, the planned steps executed by the reference
//! executor reproduce exactly the target layout.

use candle_dtensor_strategies::{
    plan_redistribute, DTensorSpec, DType, MeshTopology, Placement, Placements, ReduceOp,
    StrategyError,
};

use crate::common::exec::{apply_step, assemble, materialize, same};
use crate::common::{Arr, Rng};

pub fn random_mesh(rng: &mut Rng, max_ndim: usize) -> MeshTopology {
    let ndim = rng.range(1, max_ndim);
    let names = ["a", "b", "c", "d"];
    let dims: Vec<(&str, usize)> = (0..ndim).map(|i| (names[i], rng.range(1, 4))).collect();
    let mut mesh = MeshTopology::new(&dims).unwrap();
    for d in 0..ndim {
        if rng.chance(0.3) {
            mesh = mesh.with_link(d, 0.1 + rng.unit() * 5.0, 1.0 + rng.unit() * 100.0);
        }
    }
    if ndim >= 2 && rng.chance(0.4) {
        let a = rng.below(ndim - 1);
        let b = rng.range(a + 1, ndim - 1);
        mesh = mesh.with_flattened(&[a, b]).unwrap();
        if ndim == 3 && rng.chance(0.3) {
            mesh = mesh.with_flattened(&[0, 1, 2]).unwrap();
        }
    }
    mesh
}

pub fn random_shape(rng: &mut Rng, max_nd: usize) -> Vec<usize> {
    let nd = rng.range(1, max_nd);
    (0..nd).map(|_| rng.range(1, 9)).collect()
}

pub fn random_placement(rng: &mut Rng, ndim: usize, partial: bool) -> Placement {
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    let x = rng.unit();
    if x < 0.3 {
        Placement::Replicate
    } else if x < 0.65 || !partial {
        Placement::Shard(rng.below(ndim))
    } else if x < 0.88 {
        Placement::Partial(*rng.pick(&ops))
    } else if x < 0.95 {
        Placement::StridedShard {
            dim: rng.below(ndim),
            split_factor: rng.range(1, 3),
        }
    } else if x < 0.98 {
        Placement::MaskPartial { dim: 0, size: 7 }
    } else {
        Placement::Partial(ReduceOp::Product)
    }
}

fn expected_unsupported(src: &[Placement], dst: &[Placement], mesh: &MeshTopology) -> bool {
    src.iter().zip(dst).enumerate().any(|(m, (a, b))| {
        mesh.dim_size(m) > 1
            && a != b
            && match b {
                Placement::Partial(ReduceOp::Product) => true,
                Placement::MaskPartial { .. } => true,
                Placement::Partial(_) => a.is_shard(),
                _ => false,
            }
    }) || src
        .iter()
        .chain(dst)
        .any(|p| *p == Placement::Partial(ReduceOp::Product))
}

#[test]
fn random_plans_reproduce_the_target_layout() {
    let mut rng = Rng(0x5eed);
    let (mut ok, mut errors, mut merged, mut comm_steps) = (0, 0, 0, 0);
    for case in 0..8000 {
        let mesh = random_mesh(&mut rng, 3);
        let mut shape = random_shape(&mut rng, 3);
        let mut src: Placements = (0..mesh.ndim())
            .map(|_| random_placement(&mut rng, shape.len(), true))
            .collect();
        let mut dst: Placements = (0..mesh.ndim())
            .map(|_| random_placement(&mut rng, shape.len(), true))
            .collect();
        if let Some(g) = mesh.flattened.first().filter(|_| rng.chance(0.5)) {
            // Merge-friendly: one placement over the whole flattened group, evenly divisible dims.
            for d in shape.iter_mut() {
                *d = *rng.pick(&[4, 8, 12, 6]);
            }
            let (a, b) = (
                random_placement(&mut rng, shape.len(), true),
                random_placement(&mut rng, shape.len(), true),
            );
            for &m in g {
                src[m] = a;
                dst[m] = if rng.chance(0.5) {
                    Placement::Replicate
                } else {
                    b
                };
            }
        }
        let spec = DTensorSpec::new(&shape, DType::F32, &src);
        let plan = match plan_redistribute(&spec, &dst, &mesh) {
            Ok(p) => p,
            Err(StrategyError::UnsupportedTransition { .. })
                if expected_unsupported(&src, &dst, &mesh) =>
            {
                errors += 1;
                continue;
            }
            Err(e) => panic!("case {case}: {spec} -> {dst:?} on {mesh}: unexpected error {e}"),
        };
        let mesh_shape = mesh.shape().to_vec();
        let full = Arr::from_fn(&shape, |_| (rng.unit() * 16.0 - 8.0).round() / 2.0);
        let mut locals = materialize(&full, &src, &mesh_shape, case as u64);
        let mut cur = src.clone();
        for s in &plan.steps {
            assert_eq!(s.before, cur, "case {case}: step.before");
            apply_step(&mut locals, s, &mesh_shape).unwrap();
            cur = s.after();
            merged += (s.mesh_dims.len() > 1) as usize;
            comm_steps += s.kind.is_communication() as usize;
        }
        assert_eq!(cur, dst, "case {case}: plan does not end at dst");
        let got = assemble(&locals, &dst, &mesh_shape, &shape).unwrap_or_else(|e| {
            panic!("case {case}: {spec} -> {:?} on {mesh} via {plan}: {e}", dst)
        });
        assert!(
            same(&got, &full),
            "case {case}: {spec} -> {dst:?} on {mesh} via {plan}: wrong values"
        );
        ok += 1;
    }
    assert!(
        ok > 6000 && errors > 100 && merged > 50 && comm_steps > 5000,
        "{ok} {errors} {merged} {comm_steps}"
    );
}

#[test]
fn materialize_assemble_round_trip() {
    let mut rng = Rng(7);
    for case in 0..500 {
        let mesh = random_mesh(&mut rng, 3);
        let shape = random_shape(&mut rng, 3);
        let pl: Placements = (0..mesh.ndim())
            .map(|_| random_placement(&mut rng, shape.len(), true))
            .collect();
        let full = Arr::from_fn(&shape, |_| rng.unit());
        let ms = mesh.shape().to_vec();
        let locals = materialize(&full, &pl, &ms, case);
        let back = assemble(&locals, &pl, &ms, &shape).unwrap();
        assert!(same(&back, &full), "case {case}");
    }
}
