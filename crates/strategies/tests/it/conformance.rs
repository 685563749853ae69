//! PyTorch DTensor conformance cases (reference/dtensor.md §8), ported at the strategy/plan
//! level. See strategies/CONFORMANCE.md for the table.

use candle_dtensor_strategies::{
    local_shape_and_offset, parse_placements, propagate_with, CollectiveKind, DTensorSpec, DType,
    ExpandMethod, MeshTopology, Op, Placement,
};

use crate::common::Rng;
use crate::op_props::check;
use crate::plans::run;

fn spec(shape: &[usize], p: &str) -> DTensorSpec {
    DTensorSpec::new(shape, DType::F32, &parse_placements(p).unwrap())
}

fn comm_kinds(p: &candle_dtensor_strategies::RedistributePlan) -> Vec<CollectiveKind> {
    p.communication_steps().map(|s| s.kind).collect()
}

#[test]
fn case_01_to_04_forward_collective_counts() {
    let mesh = MeshTopology::parse("x=4").unwrap();
    for shape in [[12, 3], [13, 3], [14, 3]] {
        assert_eq!(
            comm_kinds(&run(&shape, "S(0)", "R", &mesh)),
            [CollectiveKind::AllGather]
        );
        assert_eq!(
            comm_kinds(&run(&[shape[1], shape[0]], "S(1)", "R", &mesh)),
            [CollectiveKind::AllGather]
        );
        assert!(comm_kinds(&run(&shape, "R", "S(0)", &mesh)).is_empty());
    }
    assert_eq!(
        comm_kinds(&run(&[12, 3], "P(sum)", "R", &mesh)),
        [CollectiveKind::AllReduce]
    );
    assert!(run(&[12, 3], "P(sum)", "P(sum)", &mesh).steps.is_empty());
}

#[test]
fn case_07_uneven_round_trip() {
    let mesh = MeshTopology::parse("x=4").unwrap();
    let sizes: Vec<usize> = (0..4)
        .map(|r| {
            local_shape_and_offset(&[5, 10], &[4], &[r], &[Placement::Shard(0)])
                .unwrap()
                .0[0]
        })
        .collect();
    assert_eq!(sizes, [2, 2, 1, 0]);
    run(&[5, 10], "R", "S(0)", &mesh);
    let back = run(&[5, 10], "S(0)", "R", &mesh);
    assert_eq!(
        back.steps[0].logical_shape.as_slice(),
        &[5, 10],
        "final shape (5, 10), issue #103306"
    );
}

#[test]
fn case_10_flattened_gather_of_uneven_dims() {
    // PR #194457: (5,3) [S0,S0] -> [R,R] on 2x2 with a flattened mesh must give rows 0..4 exactly.
    let mesh = MeshTopology::parse("dp=2,tp=2")
        .unwrap()
        .with_flattened(&[0, 1])
        .unwrap();
    let p = run(&[5, 3], "S(0),S(0)", "R,R", &mesh);
    assert_eq!(p.steps.len(), 2, "not merged: {p}");
    assert_eq!(run(&[8, 3], "S(0),S(0)", "R,R", &mesh).steps.len(), 1);
}

#[test]
fn case_11_cat_on_a_2x2x2_mesh() {
    let mesh = MeshTopology::parse("a=2,b=2,c=2").unwrap();
    let op = Op::Cat { dim: 0 };
    let s = propagate_with(
        &op,
        &[
            &spec(&[8, 8, 8], "R,R,S(1)"),
            &spec(&[8, 8, 8], "S(1),S(1),S(1)"),
        ],
        &mesh,
        ExpandMethod::Product,
    )
    .unwrap();
    assert_eq!(
        s.output_specs[0].to_string(),
        "[16, 8, 8] f32 S(1),S(1),S(1)"
    );
    // The first input must un-shard mesh dim c before the outer dims can chunk tensor dim 1
    // (nesting), so one all_gather is priced where PyTorch's per-dim cost sees only local chunks.
    let plan = s.redistributions[0].as_ref().unwrap();
    assert_eq!(comm_kinds(plan), [CollectiveKind::AllGather]);
    assert!(s.redistributions[1].is_none());
    let s = propagate_with(
        &op,
        &[
            &spec(&[8, 8, 8], "P(sum),R,S(1)"),
            &spec(&[8, 8, 8], "P(sum),S(1),S(1)"),
        ],
        &mesh,
        ExpandMethod::Product,
    )
    .unwrap();
    assert_eq!(
        s.output_specs[0].to_string(),
        "[16, 8, 8] f32 P(sum),S(1),S(1)"
    );
}

#[test]
fn case_13_dijkstra_equals_full_expansion_for_mm() {
    for m in ["x=4", "dp=2,tp=2", "a=2,b=2,c=2"] {
        let mesh = MeshTopology::parse(m).unwrap();
        let n = mesh.ndim();
        let opts = ["R", "S(0)", "S(1)", "P(sum)"];
        let mut rng = Rng(13);
        for _ in 0..40 {
            let pick = |rng: &mut Rng| {
                (0..n)
                    .map(|_| *rng.pick(&opts))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let (xp, wp) = (pick(&mut rng), pick(&mut rng));
            let x = spec(&[64, 32], &xp);
            let w = spec(&[32, 64], &wp);
            let a = propagate_with(&Op::Matmul, &[&x, &w], &mesh, ExpandMethod::Product).unwrap();
            let b = propagate_with(&Op::Matmul, &[&x, &w], &mesh, ExpandMethod::Dijkstra).unwrap();
            assert!(
                (a.cost_us - b.cost_us).abs() <= 1e-9 * a.cost_us.max(1.0),
                "{m} {xp} x {wp}"
            );
        }
    }
}

#[test]
fn case_14_mm_s0_s0_picks_the_contraction() {
    // PR #177798: PyTorch's Dijkstra picks S(1) x S(0) -> P(sum) (an all_to_all of x) over
    // S(0) x R (an all_gather of w). We price the all_to_all for what it moves (a quarter of x's
    // local piece here) instead of as an all_gather + 1.0, and reach the same choice.
    let mesh = MeshTopology::parse("x=4").unwrap();
    let s = propagate_with(
        &Op::Matmul,
        &[&spec(&[64, 32], "S(0)"), &spec(&[32, 64], "S(0)")],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert_eq!(s.input_specs[0].to_string(), "[64, 32] f32 S(1)");
    assert_eq!(s.input_specs[1].to_string(), "[32, 64] f32 S(0)");
    assert_eq!(s.output_specs[0].to_string(), "[64, 64] f32 P(sum)");
    let plan = s.redistributions[0].as_ref().unwrap();
    assert_eq!(comm_kinds(plan), [CollectiveKind::AllToAll]);
}

#[test]
fn case_16_softmax_off_the_sharded_dim() {
    let mesh = MeshTopology::parse("x=4").unwrap();
    let mut rng = Rng(16);
    for dim in 0..3 {
        for shard in 0..3 {
            let x = spec(&[8, 12, 16], &format!("S({shard})"));
            let (s, _) = check(
                "case 16",
                &Op::Softmax { dim },
                &[x],
                &mesh,
                ExpandMethod::Auto,
                &mut rng,
                1,
            );
            let chosen = s.input_specs[0].placements[0];
            assert!(
                !chosen.shards(dim),
                "softmax dim {dim}: input stays sharded on it"
            );
            assert_eq!(
                s.redistributions[0].is_some(),
                shard == dim,
                "dim {dim} shard {shard}"
            );
        }
    }
}

#[test]
fn case_17_sharded_view_redistributes() {
    // Issue #179502: x [12, 8] S(1) viewed as (16, 6) must not silently reinterpret local data.
    let mesh = MeshTopology::parse("x=4").unwrap();
    let mut rng = Rng(17);
    let op = Op::Reshape {
        shape: smallvec::smallvec![16, 6],
    };
    let (s, seen) = check(
        "case 17",
        &op,
        &[spec(&[12, 8], "S(1)")],
        &mesh,
        ExpandMethod::Auto,
        &mut rng,
        1,
    );
    assert_eq!(seen.redistributed, 1);
    assert_eq!(
        s.input_specs[0].to_string(),
        "[12, 8] f32 S(0)",
        "{:?}",
        s.redistributions
    );
    assert_eq!(s.output_specs[0].to_string(), "[16, 6] f32 S(0)");
}

#[test]
fn case_19_loss_parallel() {
    // Realistic sizes: the class-sharded logits stay put; three all_reduces of N values run
    // inside the op.
    let mesh = MeshTopology::parse("tp=8").unwrap();
    let logits = spec(&[4096, 32000], "S(1)");
    let target = DTensorSpec::new(&[4096], DType::I64, &[Placement::Replicate]);
    let s = propagate_with(
        &Op::CrossEntropy,
        &[&logits, &target],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert!(!s.needs_redistribute(), "no vocab gather");
    assert_eq!(s.output_specs[0].to_string(), "[] f32 R");
    assert_eq!(s.internal.len(), 3);
    assert!(s
        .internal
        .iter()
        .all(|(m, c)| *m == 0 && c.kind == CollectiveKind::AllReduce && c.bytes == 4096 * 4));
    // The reference's tiny (4, 16) logits: moving 256 bytes once is cheaper than three
    // all_reduces, and the cost model says so: one all_to_all to the batch-sharded row (a mean
    // over the global N, so 4 rows on 8 ranks are fine), output a partial sum.
    let tiny = spec(&[4, 16], "S(1)");
    let t4 = DTensorSpec::new(&[4], DType::I64, &[Placement::Replicate]);
    let s = propagate_with(&Op::CrossEntropy, &[&tiny, &t4], &mesh, ExpandMethod::Auto).unwrap();
    assert_eq!(
        comm_kinds(s.redistributions[0].as_ref().unwrap()),
        [CollectiveKind::AllToAll]
    );
    assert_eq!(s.output_specs[0].to_string(), "[] f32 P(sum)");
    assert!(s.internal.is_empty());
    // On a 2-d mesh with the batch sharded by dp, the internal all_reduces shrink accordingly.
    let mesh2 = MeshTopology::parse("dp=2,tp=8").unwrap();
    let logits = spec(&[4096, 32000], "S(0),S(1)");
    let target = DTensorSpec::new(&[4096], DType::I64, &parse_placements("S(0),R").unwrap());
    let s = propagate_with(
        &Op::CrossEntropy,
        &[&logits, &target],
        &mesh2,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert!(!s.needs_redistribute());
    assert_eq!(s.output_specs[0].to_string(), "[] f32 P(sum),R");
    assert!(s
        .internal
        .iter()
        .all(|(m, c)| *m == 1 && c.bytes == 4096 * 4 / 2));
}
