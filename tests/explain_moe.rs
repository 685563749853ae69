//! `explain --op moe`: the planned collectives of an MoE layer (count exchange, dispatch and
//! combine both ways, gradient reductions) equal what CommDebugMode records when the layer runs
//! forward and backward, on 1-D, 2-D and 3-D meshes, uneven expert shards and both
//! transports; and the plan's bytes are the ones a dropless layer must move.

#[path = "../examples/common/explain_moe.rs"]
mod explain_moe;

#[test]
fn the_moe_plan_is_what_runs() {
    for (mesh, moe, shapes) in [
        ("ep=4", "experts=8,top_k=2", "4x16x32"),
        ("ep=3", "experts=4,top_k=2", "3x5x8"),
        ("dp=2,ep=2", "experts=6,top_k=1,dispatch=rma", "4x8x16"),
        ("dp=2,ep=2,tp=2", "experts=5,top_k=2", "4x4x8"),
    ] {
        let r = explain_moe::report(mesh, moe, shapes, true, 3).unwrap();
        assert_eq!(r["run"]["matches_plan"], true, "{mesh} {moe}: {r}");
    }
}

#[test]
fn the_plan_moves_every_assignment_once_each_way() {
    // 4x16 tokens, top-2, dim 32 f32: 4*16*2 rows of 128 B through dispatch and combine, in
    // each direction; the count exchange gathers 4 ranks x (2 + 2*8) u32 on each of 4 ranks.
    let r = explain_moe::report("ep=4", "experts=8,top_k=2", "4x16x32", false, 0).unwrap();
    let planned = r["planned"].as_array().unwrap();
    let bytes = |label: &str, phase: &str| {
        planned
            .iter()
            .find(|e| e["label"] == label && e["phase"] == phase)
            .map(|e| e["bytes"].as_u64().unwrap())
    };
    for label in ["moe.dispatch", "moe.combine"] {
        for phase in ["forward", "backward"] {
            assert_eq!(
                bytes(label, phase),
                Some(4 * 16 * 2 * 128),
                "{label} {phase}"
            );
        }
    }
    assert_eq!(bytes("moe.counts", "forward"), Some(4 * 4 * 18 * 4));
    assert!(r.get("run").is_none());
    // A capacity factor makes the plan inexact: refused, as are malformed shapes.
    assert!(explain_moe::report(
        "ep=4",
        "experts=8,top_k=2,capacity=1.0",
        "4x16x32",
        false,
        0
    )
    .is_err());
    assert!(explain_moe::report("ep=4", "experts=8,top_k=2", "4x16", false, 0).is_err());
}
