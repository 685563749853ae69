use candle_dtensor_strategies::{
    parse_placements, plan_redistribute, CollectiveKind, DTensorSpec, DType, MeshTopology,
    Placement, RedistributePlan, StrategyError,
};

use crate::common::exec::{apply_step, assemble, materialize, same};
use crate::common::{Arr, Rng};

pub fn plan(
    shape: &[usize],
    src: &str,
    dst: &str,
    mesh: &MeshTopology,
) -> Result<RedistributePlan, StrategyError> {
    let s = DTensorSpec::new(shape, DType::F32, &parse_placements(src).unwrap());
    plan_redistribute(&s, &parse_placements(dst).unwrap(), mesh)
}

/// Plans and executes; checks that every rank ends with exactly the target layout.
pub fn run(shape: &[usize], src: &str, dst: &str, mesh: &MeshTopology) -> RedistributePlan {
    let p = plan(shape, src, dst, mesh).unwrap_or_else(|e| panic!("{src} -> {dst}: {e}"));
    let mesh_shape = mesh.shape().to_vec();
    let mut rng = Rng(shape.iter().sum::<usize>() as u64 * 31 + 7);
    let full = Arr::from_fn(shape, |_| (rng.unit() * 20.0 - 10.0).round() / 4.0);
    let mut locals = materialize(&full, &p.src, &mesh_shape, 99);
    for s in &p.steps {
        apply_step(&mut locals, s, &mesh_shape).unwrap();
    }
    let got = assemble(&locals, &p.dst, &mesh_shape, shape)
        .unwrap_or_else(|e| panic!("{src} -> {dst} via {p}: {e}"));
    assert!(same(&got, &full), "{src} -> {dst} via {p}: wrong values");
    p
}

fn kinds(p: &RedistributePlan) -> Vec<CollectiveKind> {
    p.steps.iter().map(|s| s.kind).collect()
}

#[test]
fn every_single_dim_transition() {
    use CollectiveKind::*;
    let mesh = MeshTopology::parse("x=4").unwrap();
    for shape in [[12, 3], [13, 3], [14, 3], [3, 13]] {
        let cases: &[(&str, &str, &[CollectiveKind])] = &[
            ("S(0)", "R", &[AllGather]),
            ("S(1)", "R", &[AllGather]),
            ("R", "S(0)", &[LocalChunk]),
            ("P(sum)", "R", &[AllReduce]),
            ("P(max)", "R", &[AllReduce]),
            ("P(sum)", "S(0)", &[ReduceScatter]),
            ("P(avg)", "S(1)", &[ReduceScatter]),
            ("S(0)", "S(1)", &[AllToAll]),
            ("S(1)", "S(0)", &[AllToAll]),
            ("R", "P(sum)", &[LocalPartition]),
            ("R", "P(avg)", &[LocalPartition]),
            ("R", "P(max)", &[LocalPartition]),
            ("R", "P(min)", &[LocalPartition]),
            ("P(sum)", "P(max)", &[AllReduce, LocalPartition]),
            ("P(min)", "P(avg)", &[AllReduce, LocalPartition]),
            ("P(product)", "R", &[AllReduce]),
            ("MP(0,7)", "R", &[AllReduce]),
            ("MP(0,7)", "S(1)", &[ReduceScatter]),
            ("MP(0,7)", "P(sum)", &[Noop]),
            ("SS(0,2)", "R", &[AllGather]),
            ("R", "SS(0,2)", &[LocalChunk]),
            ("SS(0,2)", "S(0)", &[AllGather, LocalChunk]),
            ("P(sum)", "P(sum)", &[]),
        ];
        for (src, dst, want) in cases {
            let p = run(&shape, src, dst, &mesh);
            assert_eq!(kinds(&p), *want, "{shape:?} {src} -> {dst}: {p}");
        }
    }
}

#[test]
fn strided_gathers_permute() {
    let mesh = MeshTopology::parse("x=4").unwrap();
    let p = run(&[9, 2], "SS(0,2)", "R", &mesh);
    assert!(
        p.steps[0].permute,
        "a lone StridedShard gather reorders by strided indices"
    );
}

#[test]
fn unsupported_transitions_are_typed_errors() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    for (src, dst) in [
        ("S(0),R", "P(sum),R"),
        ("R,R", "R,MP(0,4)"),
        ("R,R", "P(product),R"),
        ("R,S(1)", "R,P(avg)"),
    ] {
        match plan(&[4, 4], src, dst, &mesh) {
            Err(StrategyError::UnsupportedTransition { .. }) => {}
            other => panic!("{src} -> {dst}: {other:?}"),
        }
    }
    let e = plan(&[4, 4], "S(0),R", "P(sum),R", &mesh)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("redistribute S(0),R -> P(sum),R: mesh dim 0: Shard -> Partial"),
        "{e}"
    );
    // On a size-1 mesh dim every change is a relabel.
    let one = MeshTopology::parse("dp=1,tp=2").unwrap();
    let p = run(&[4, 4], "S(0),R", "P(sum),R", &one);
    assert_eq!(kinds(&p), [CollectiveKind::Noop]);
    assert!(matches!(
        plan(&[4, 4], "S(2),R", "R,R", &mesh),
        Err(StrategyError::ShardDimOutOfRange { .. })
    ));
    assert!(matches!(
        plan(&[4, 4], "R", "R,R", &mesh),
        Err(StrategyError::PlacementCount { .. })
    ));
}

#[test]
fn nested_sharding_is_unsharded_innermost_first() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    let p = run(&[8, 4], "S(0),S(0)", "R,S(0)", &mesh);
    assert_eq!(p.to_string(), "S(0),S(0) -> S(0),R -> R,R -> R,S(0)");
    let p = run(&[8, 4], "S(0),S(0)", "R,R", &mesh);
    assert_eq!(p.to_string(), "S(0),S(0) -> S(0),R -> R,R");
    let p = run(&[7, 4], "S(0),S(1)", "S(1),S(0)", &mesh);
    assert_eq!(
        kinds(&p),
        [
            CollectiveKind::AllGather,
            CollectiveKind::AllToAll,
            CollectiveKind::LocalChunk
        ],
        "{p}"
    );
    let p = run(&[8, 4], "P(sum),P(sum)", "S(0),S(0)", &mesh);
    assert_eq!(
        p.to_string(),
        "P(sum),P(sum) -> S(0),P(sum) -> S(0),S(0)",
        "two reduce_scatters, outer first"
    );
    run(&[5, 3], "R,S(0)", "S(0),S(0)", &mesh);
    run(&[5, 3], "S(0),R", "R,S(0)", &mesh);
    run(
        &[6, 5, 3],
        "S(1),S(1),S(1)",
        "R,S(1),S(0)",
        &MeshTopology::parse("a=2,b=3,c=2").unwrap(),
    );
}

#[test]
fn logical_shape_and_bytes() {
    let mesh = MeshTopology::parse("dp=2,tp=4").unwrap();
    let p = run(&[10, 8], "S(1),S(0)", "S(1),R", &mesh);
    let s = &p.steps[0];
    assert_eq!(
        s.logical_shape.as_slice(),
        &[10, 4],
        "tp sees the dp-local columns, all rows"
    );
    assert_eq!(s.bytes, 12 * 4 * 4, "rows padded to ceil(10/4)*4");
    let per_rank = s.logical_shape_at(&[10, 8], &[2, 4], &[1, 3]).unwrap();
    assert_eq!(per_rank.as_slice(), &[10, 4]);
}

#[test]
fn mixed_partials_reduce_innermost_first() {
    let mesh = MeshTopology::parse("dp=2,tp=3").unwrap();
    let p = run(&[4, 3], "P(max),P(sum)", "R,P(sum)", &mesh);
    assert_eq!(
        p.to_string(),
        "P(max),P(sum) -> P(max),R -> R,R -> R,P(sum)"
    );
    run(&[4, 3], "P(sum),P(max)", "R,R", &mesh);
    run(&[4, 3], "P(sum),P(avg)", "R,P(avg)", &mesh);
    run(&[4, 3], "R,P(max)", "P(sum),P(max)", &mesh);
}

#[test]
fn flattened_merge_needs_even_division() {
    // PyTorch #194457: a merged all_gather of an uneven (5,3) [S0,S0] corrupts data.
    let mesh = MeshTopology::parse("dp=2,tp=2")
        .unwrap()
        .with_flattened(&[0, 1])
        .unwrap();
    let p = run(&[5, 3], "S(0),S(0)", "R,R", &mesh);
    assert_eq!(
        kinds(&p),
        [CollectiveKind::AllGather, CollectiveKind::AllGather],
        "{p}"
    );
    let p = run(&[8, 3], "S(0),S(0)", "R,R", &mesh);
    assert_eq!(p.steps.len(), 1, "{p}");
    assert_eq!(p.steps[0].mesh_dims.as_slice(), &[0, 1]);
    let p = run(&[8, 3], "P(sum),P(sum)", "R,R", &mesh);
    assert_eq!(
        (p.steps.len(), p.steps[0].kind),
        (1, CollectiveKind::AllReduce)
    );
    let p = run(&[8, 3], "P(sum),P(sum)", "S(0),S(0)", &mesh);
    assert_eq!(
        (p.steps.len(), p.steps[0].kind),
        (1, CollectiveKind::ReduceScatter)
    );
    let p = run(&[8, 3], "P(sum),P(max)", "R,R", &mesh);
    assert_eq!(p.steps.len(), 2, "different reduce ops never merge");
    // Without a flattened communicator: two steps.
    let plain = MeshTopology::parse("dp=2,tp=2").unwrap();
    assert_eq!(run(&[8, 3], "S(0),S(0)", "R,R", &plain).steps.len(), 2);
}

#[test]
fn plan_display_and_cost() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    let p = plan(&[8, 4], "S(0),P(sum)", "R,R", &mesh).unwrap();
    let total: f64 = p.steps.iter().map(|s| s.est_us).sum();
    assert!((p.est_us - total).abs() < 1e-9);
    assert!(p.to_string().starts_with("S(0),P(sum) -> "));
    assert!(p.to_string().ends_with("-> R,R"));
    let js = serde_json::to_value(&p).unwrap();
    assert_eq!(js["steps"][0]["kind"], "all_reduce");
    assert_eq!(js["src"], "S(0),P(sum)");
    assert!(matches!(p.steps[0].to, Placement::Replicate));
}

/// `P(max|min|product) -> S` is planned as what runs: an all_reduce, then a local chunk (a
/// reduce_scatter of a non-linear reduction has no adjoint the runtime could run), and priced
/// as such; `P(sum|avg) -> S` stays one reduce_scatter.
#[test]
fn nonlinear_partial_to_shard_goes_through_replicate() {
    let mesh = MeshTopology::parse("tp=4").unwrap();
    for op in ["max", "min", "product"] {
        let p = run(&[12, 3], &format!("P({op})"), "S(0)", &mesh);
        assert_eq!(
            kinds(&p),
            [CollectiveKind::AllReduce, CollectiveKind::LocalChunk],
            "P({op})"
        );
        let ar = plan(&[12, 3], &format!("P({op})"), "R", &mesh).unwrap();
        assert_eq!(p.est_us, ar.est_us, "priced as the all_reduce it runs");
    }
    for op in ["sum", "avg"] {
        let p = run(&[13, 3], &format!("P({op})"), "S(0)", &mesh);
        assert_eq!(kinds(&p), [CollectiveKind::ReduceScatter], "P({op})");
    }
}
