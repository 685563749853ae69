use candle_dtensor_strategies::{
    parse_placements, propagate_with, CollectiveKind, DTensorSpec, DType, ExpandMethod,
    MeshTopology, Op, ShardingPropagator, StrategyError,
};

use crate::common::opgen::random_case;
use crate::common::Rng;
use crate::plan_props::random_mesh;

fn spec(shape: &[usize], dtype: DType, p: &str) -> DTensorSpec {
    DTensorSpec::new(shape, dtype, &parse_placements(p).unwrap())
}

#[test]
fn dijkstra_and_product_find_the_same_minimum() {
    let mut rng = Rng(0xd1e);
    let mut compared = 0;
    let mut nonzero = 0;
    for case in 0..1500 {
        let mesh = random_mesh(&mut rng, 3);
        let c = random_case(&mut rng, &mesh, true);
        let refs: Vec<&DTensorSpec> = c.specs.iter().collect();
        let a = propagate_with(&c.op, &refs, &mesh, ExpandMethod::Product);
        let b = propagate_with(&c.op, &refs, &mesh, ExpandMethod::Dijkstra);
        match (a, b) {
            (Ok(a), Ok(b)) => {
                let (ca, cb) = (a.cost_us + a.deferred_us, b.cost_us + b.deferred_us);
                assert!(
                    (ca - cb).abs() <= 1e-6 * ca.abs().max(1.0),
                    "case {case}: {} {:?} on {mesh}: product {ca} ({:?}) vs dijkstra {cb} ({:?})",
                    c.op,
                    c.specs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                    a.input_specs
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>(),
                    b.input_specs
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>(),
                );
                compared += 1;
                nonzero += (ca > 0.0) as usize;
            }
            (Err(a), Err(b)) => assert_eq!(a, b, "case {case}"),
            (a, b) => panic!(
                "case {case}: {} product {:?} vs dijkstra {:?}",
                c.op,
                a.err(),
                b.err()
            ),
        }
    }
    assert!(compared > 1300 && nonzero > 400, "{compared} {nonzero}");
}

#[test]
fn mm_on_a_2x2_mesh_dijkstra_matches_full_expansion() {
    // dtensor.md §8 case 13: mm (64,32)@(32,64) over several placements.
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    let ps = [
        "R,R",
        "S(0),R",
        "S(1),S(0)",
        "P(sum),R",
        "R,S(1)",
        "S(0),S(1)",
        "S(1),S(1)",
    ];
    for xp in ps {
        for wp in ps {
            let x = spec(&[64, 32], DType::F32, xp);
            let w = spec(&[32, 64], DType::F32, wp);
            let a = propagate_with(&Op::Matmul, &[&x, &w], &mesh, ExpandMethod::Product).unwrap();
            let b = propagate_with(&Op::Matmul, &[&x, &w], &mesh, ExpandMethod::Dijkstra).unwrap();
            assert!(
                (a.cost_us - b.cost_us).abs() < 1e-9,
                "{xp} x {wp}: {} vs {}",
                a.cost_us,
                b.cost_us
            );
        }
    }
}

#[test]
fn index_select_plans_compete_by_cost() {
    let mesh = MeshTopology::parse("tp=4").unwrap();
    let op = Op::IndexSelect { dim: 0 };
    let table = spec(&[65536, 256], DType::F32, "S(0)");
    // Few rows of a big table: one-sided gets of just those rows.
    let few = spec(&[64], DType::U32, "R");
    let s = propagate_with(&op, &[&table, &few], &mesh, ExpandMethod::Auto).unwrap();
    assert_eq!(s.internal.len(), 1, "{s:?}");
    assert_eq!(s.internal[0].1.kind, CollectiveKind::RmaGet);
    assert_eq!(s.output_specs[0].to_string(), "[64, 256] f32 R");
    assert!(!s.needs_redistribute());
    // (Nearly) all rows of a 1-d table: gather the table.
    let table1 = spec(&[65536], DType::F32, "S(0)");
    let most = spec(&[60000], DType::U32, "R");
    let s = propagate_with(&op, &[&table1, &most], &mesh, ExpandMethod::Auto).unwrap();
    assert!(s.internal.is_empty(), "{s:?}");
    let plan = s.redistributions[0].as_ref().expect("table all_gather");
    assert_eq!(plan.steps[0].kind, CollectiveKind::AllGather);
    // With a second dim, re-sharding the table on it (all_to_all, a quarter of the bytes) beats
    // all three.
    let all = spec(&[65536], DType::U32, "R");
    let s = propagate_with(&op, &[&table, &all], &mesh, ExpandMethod::Auto).unwrap();
    assert!(s.internal.is_empty());
    assert_eq!(
        s.redistributions[0].as_ref().unwrap().steps[0].kind,
        CollectiveKind::AllToAll
    );
    assert_eq!(s.output_specs[0].to_string(), "[65536, 256] f32 S(1)");
    // Without the rma row the masked partial would win over the gather for few rows:
    // its later all_reduce is priced in deferred_us.
    let emb_ids = spec(&[64], DType::U32, "R");
    let emb_w = spec(&[65536, 256], DType::F32, "S(0)");
    let s = propagate_with(
        &Op::Embedding,
        &[&emb_ids, &emb_w],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert_eq!(s.output_specs[0].to_string(), "[64, 256] f32 MP(0,65536)");
    assert!(s.deferred_us > 0.0 && s.cost_us == 0.0);
}

/// A mean is a sum over the global count: even or uneven (even empty) shards give a free
/// `P(sum)` (PyTorch #162692 came from averaging uneven shards' means), and so does a
/// cross-entropy over unevenly batch-sharded logits (no logits move).
#[test]
fn means_of_uneven_shards_are_free_partial_sums() {
    let mesh = MeshTopology::parse("x=4").unwrap();
    let op = Op::Mean {
        dims: smallvec::smallvec![0],
        keepdim: false,
    };
    for rows in [8, 7, 3] {
        let x = spec(&[rows, 3], DType::F32, "S(0)");
        let s = propagate_with(&op, &[&x], &mesh, ExpandMethod::Auto).unwrap();
        assert_eq!(
            s.output_specs[0].to_string(),
            "[3] f32 P(sum)",
            "{rows} rows"
        );
        assert_eq!(s.cost_us, 0.0);
    }
    let mesh = MeshTopology::parse("dp=2,tp=4").unwrap();
    let logits = spec(&[8191, 50304], DType::F32, "S(0),S(0)");
    let targets = spec(&[8191], DType::I64, "S(0),S(0)");
    let s = propagate_with(
        &Op::CrossEntropy,
        &[&logits, &targets],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert_eq!(s.output_specs[0].to_string(), "[] f32 P(sum),P(sum)");
    assert!(!s.needs_redistribute() && s.cost_us == 0.0);
}

#[test]
fn max_needs_nonempty_shards() {
    let mesh = MeshTopology::parse("x=4").unwrap();
    let op = Op::Max {
        dims: smallvec::smallvec![0],
        keepdim: false,
    };
    let s = propagate_with(
        &op,
        &[&spec(&[6, 3], DType::F32, "S(0)")],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert_ne!(
        s.output_specs[0].placements[0].to_string(),
        "P(max)",
        "rank 3 holds no row of 6"
    );
    let s = propagate_with(
        &op,
        &[&spec(&[7, 3], DType::F32, "S(0)")],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert_eq!(s.output_specs[0].placements[0].to_string(), "P(max)");
}

#[test]
fn typed_errors_name_op_placements_and_reason() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    let p = ShardingPropagator::new();
    let x = spec(&[8, 16], DType::F32, "S(0),R");
    let w = spec(&[12, 4], DType::F32, "R,R");
    let e = p.propagate(&Op::Matmul, &[&x, &w], &mesh).unwrap_err();
    assert_eq!(
        e.to_string(),
        "matmul: inner dims differ: [8, 16] x [12, 4]"
    );
    let bad = spec(&[4, 8], DType::F32, "S(3),R");
    let e = p
        .propagate(
            &Op::Unary(candle_dtensor_strategies::UnaryOp::Exp),
            &[&bad],
            &mesh,
        )
        .unwrap_err();
    assert_eq!(e.to_string(), "exp: S(3) on a 2-d tensor [4, 8]");
    let short = spec(&[4, 8], DType::F32, "S(0)");
    let e = p.propagate(&Op::Contiguous, &[&short], &mesh).unwrap_err();
    assert!(
        matches!(
            e,
            StrategyError::PlacementCount {
                expected: 2,
                got: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "contiguous: 1 placements (S(0)) for a 2-d mesh"
    );
    let e = p.propagate(&Op::Matmul, &[&x], &mesh).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("matmul: invalid argument: expects 2 inputs"),
        "{e}"
    );
    assert_eq!(p.cache_len(), 0, "errors are not cached");
}

#[test]
fn cache_hits_and_keys() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    let p = ShardingPropagator::new();
    let x = spec(&[8, 16], DType::F32, "S(0),R");
    let w = spec(&[16, 4], DType::F32, "R,S(1)");
    let a = p.propagate(&Op::Matmul, &[&x, &w], &mesh).unwrap();
    let b = p.propagate(&Op::Matmul, &[&x, &w], &mesh).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(p.cache_len(), 1);
    let other = mesh.clone().with_link(0, 1.0, 1.0);
    p.propagate(&Op::Matmul, &[&x, &w], &other).unwrap();
    let w2 = spec(&[16, 4], DType::F32, "R,R");
    p.propagate(&Op::Matmul, &[&x, &w2], &mesh).unwrap();
    assert_eq!(p.cache_len(), 3, "mesh and specs are part of the key");
    p.clear();
    assert_eq!(p.cache_len(), 0);
    // Shared across threads.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    p.propagate(&Op::Matmul, &[&x, &w], &mesh).unwrap();
                }
            });
        }
    });
    assert_eq!(p.cache_len(), 1);
}

#[test]
fn size_one_mesh_dims_are_free() {
    let mesh = MeshTopology::parse("dp=1,tp=4").unwrap();
    let x = spec(&[8, 16], DType::F32, "S(0),S(1)");
    let w = spec(&[16, 4], DType::F32, "S(1),S(0)");
    let s = propagate_with(&Op::Matmul, &[&x, &w], &mesh, ExpandMethod::Auto).unwrap();
    assert_eq!(s.cost_us, 0.0);
    assert_eq!(s.output_specs[0].placements[1].to_string(), "P(sum)");
}

/// A pin wins over placements that already fit: `x S(0)` fits matmul's batch row for free, but
/// pinned to `R` it must be gathered (the search's keep-the-current-placements seed used to
/// ignore pins).
#[test]
fn pins_win_over_current_placements() {
    let mesh = MeshTopology::parse("tp=4").unwrap();
    let x = spec(&[64, 32], DType::F32, "S(0)");
    let w = spec(&[32, 16], DType::F32, "R");
    let pin = parse_placements("R").unwrap();
    let s = candle_dtensor_strategies::propagate_pinned_with(
        &Op::Matmul,
        &[&x, &w],
        &mesh,
        ExpandMethod::Auto,
        &[Some(&pin), None],
    )
    .unwrap();
    assert_eq!(s.input_specs[0].placements.as_slice(), pin.as_slice());
    assert!(s.cost_us > 0.0);
}

/// Backends without one-sided gets (process, MPI): the `rma_get` plan is never offered, the
/// masked partial (or a redistribution) takes its place.
#[test]
fn no_rma_plans_without_one_sided_gets() {
    let mesh = MeshTopology::parse("tp=4").unwrap().with_rma_get(false);
    let table = spec(&[65536, 256], DType::F32, "S(0)");
    let few = spec(&[64], DType::U32, "R");
    let op = Op::IndexSelect { dim: 0 };
    let s = propagate_with(&op, &[&table, &few], &mesh, ExpandMethod::Auto).unwrap();
    assert!(s.internal.is_empty(), "{s:?}");
    assert_eq!(s.output_specs[0].to_string(), "[64, 256] f32 MP(0,65536)");
    let idx = spec(&[3, 256], DType::U32, "R");
    let s = propagate_with(
        &Op::Gather { dim: 0 },
        &[&table, &idx],
        &mesh,
        ExpandMethod::Auto,
    )
    .unwrap();
    assert!(s
        .internal
        .iter()
        .all(|(_, c)| c.kind != CollectiveKind::RmaGet));
}
