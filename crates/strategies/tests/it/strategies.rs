//! Strategy tables per op family, and a smoke test over every op name.

use candle_dtensor_strategies::{
    parse_shape, propagate_with, resolve, single_dim_strategies, DTensorSpec, DType, ExpandMethod,
    ExplainRequest, MeshTopology, Op, Placement, TensorMeta,
};

fn table(op: &Op, metas: &[(&[usize], DType)]) -> Vec<String> {
    let metas: Vec<TensorMeta> = metas.iter().map(|(s, d)| TensorMeta::new(s, *d)).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    single_dim_strategies(op, &refs)
        .unwrap()
        .iter()
        .map(|r| r.to_string())
        .collect()
}

const F: DType = DType::F32;

#[test]
fn matmul_family() {
    assert_eq!(
        table(&Op::Matmul, &[(&[64, 32], F), (&[32, 16], F)]),
        [
            "S(0) <- S(0), R",
            "S(1) <- R, S(1)",
            "P(sum) <- S(1), S(0)",
            "P(sum) <- P(sum), R",
            "P(sum) <- R, P(sum)",
            "P(avg) <- P(avg), R",
            "P(avg) <- R, P(avg)"
        ]
    );
}

#[test]
fn pointwise_family_with_broadcasting() {
    let t = table(
        &Op::Binary(candle_dtensor_strategies::BinaryOp::Mul),
        &[(&[4, 8], F), (&[8], F)],
    );
    assert_eq!(
        t,
        [
            "S(0) <- S(0), R",
            "S(1) <- S(1), S(0)",
            "P(sum) <- P(sum), R",
            "P(sum) <- R, P(sum)",
            "P(avg) <- P(avg), R",
            "P(avg) <- R, P(avg)"
        ]
    );
    let t = table(
        &Op::Binary(candle_dtensor_strategies::BinaryOp::Div),
        &[(&[4], F), (&[4], F)],
    );
    assert_eq!(
        t,
        [
            "S(0) <- S(0), S(0)",
            "P(sum) <- P(sum), R",
            "P(avg) <- P(avg), R"
        ],
        "div: numerator only"
    );
}

#[test]
fn norms_attention_loss_index() {
    let t = table(
        &Op::RmsNorm { eps: 1e-6.into() },
        &[(&[2, 3, 8], F), (&[8], F)],
    );
    assert_eq!(t, ["S(0) <- S(0), R", "S(1) <- S(1), R"]);
    let q: &[usize] = &[2, 4, 8, 16];
    let t = table(
        &Op::Sdpa {
            causal: true,
            scale: None,
        },
        &[(q, F), (q, F), (q, F)],
    );
    // Batch, heads, and the sequence (context parallelism): the KV exchange (a ring exchange
    // of K and V) and the all-to-all to the heads (four per-piece all_to_alls).
    assert_eq!(
        t,
        [
            "S(0) <- S(0), S(0), S(0)",
            "S(1) <- S(1), S(1), S(1)",
            "S(2) <- S(2), S(2), S(2) [+ring_exchange 8192 B]",
            "S(2) <- S(2), S(2), S(2) [+all_to_all 4096 B] [+all_to_all 4096 B] [+all_to_all 4096 B] \
             [+all_to_all 4096 B]"
        ]
    );
    let t = table(
        &Op::PackedSdpa {
            causal: true,
            scale: None,
        },
        &[(&[2, 8, 4, 3, 16], F)],
    );
    assert_eq!(
        t,
        [
            "S(0) <- S(0)",
            "S(2) <- S(2)",
            "S(1) <- S(1) [+ring_exchange 8192 B]",
            "S(1) <- S(1) [+all_to_all 4096 B] [+all_to_all 4096 B] [+all_to_all 4096 B] \
             [+all_to_all 4096 B]"
        ]
    );
    // The flat projection: the batch, or the features between whole heads (the row carries
    // the requirement; the expander checks it on the whole mesh below).
    let flat = |heads| Op::FlatSdpa {
        heads,
        causal: true,
        scale: None,
    };
    assert_eq!(
        table(&flat(4), &[(&[2, 8, 48], F)]),
        ["S(0) <- S(0)", "S(2) <- S(2)"]
    );
    let choose = |heads: usize, mesh: &str, shape: &[usize], given: &str| {
        let topo = MeshTopology::parse(mesh).unwrap();
        let pl = candle_dtensor_strategies::parse_placements(given).unwrap();
        let x = DTensorSpec::new(shape, F, &pl);
        let s = propagate_with(&flat(heads), &[&x], &topo, ExpandMethod::Auto).unwrap();
        (
            candle_dtensor_strategies::format_placements(&s.input_specs[0].placements),
            candle_dtensor_strategies::format_placements(&s.output_specs[0].placements),
        )
    };
    // Whole heads on each rank: kept (one mesh dim, two nested ones).
    assert_eq!(
        choose(4, "tp=2", &[2, 8, 48], "S(2)"),
        ("S(2)".into(), "S(2)".into())
    );
    assert_eq!(
        choose(4, "dp=2,tp=2", &[2, 8, 48], "S(2),S(2)"),
        ("S(2),S(2)".into(), "S(2),S(2)".into())
    );
    // 3 heads on 2 ranks (18 features, 9 each: half a head) and 2 heads on 4 ranks: the
    // features cannot stay sharded, on either tensor.
    for (heads, mesh, shape) in [(3, "tp=2", [2, 8, 18]), (2, "tp=4", [4, 8, 24])] {
        let (i, o) = choose(heads, mesh, &shape, "S(2)");
        assert!(
            !i.contains("S(2)") && !o.contains("S(2)"),
            "{heads} heads on {mesh}: {i} -> {o}"
        );
    }
    let t = table(&Op::CrossEntropy, &[(&[4, 16], F), (&[4], DType::I64)]);
    assert_eq!(
        t,
        [
            "P(sum) <- S(0), S(0)",
            "R <- S(1), R [+all_reduce 16 B] [+all_reduce 16 B] [+all_reduce 16 B]"
        ]
    );
    let t = table(
        &Op::Gather { dim: 1 },
        &[(&[4, 6], F), (&[4, 2], DType::I64)],
    );
    assert_eq!(
        t,
        [
            // Not "S(0) <- R, S(0)": off the gather dim the source must be sharded like the
            // index (a replicated source would be read at local positions).
            "S(0) <- S(0), S(0)",
            "S(1) <- R, S(1)",
            "MP(1,6) <- S(1), R",
            "R <- S(1), R [+rma_get 32 B]"
        ]
    );
    let t = table(&Op::Where, &[(&[4, 1], DType::U8), (&[4, 3], F), (&[3], F)]);
    assert_eq!(t, ["S(0) <- S(0), S(0), R", "S(1) <- R, S(1), S(0)"]);
}

/// The op table's contract ("Adding an op" in docs/ARCHITECTURE.md): every declared name parses
/// from its declaration's example into an op of that name, family and arity, whose shapes and
/// rows the compiler computes and whose sharding it propagates (first input sharded on dim 0).
#[test]
fn every_declared_op_parses_and_propagates() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    let mut seen = 0;
    for decl in Op::declarations() {
        for name in decl.names {
            let req = ExplainRequest {
                mesh: "dp=2,tp=2".into(),
                op: name.to_string(),
                ..Default::default()
            }
            .with_example(decl.example)
            .unwrap_or_else(|e| panic!("{name}: example {:?}: {e}", decl.example));
            let resolved = resolve(&req).unwrap_or_else(|e| panic!("{name}: {e}"));
            let op = resolved.op.expect("an op");
            assert!(decl.names.contains(&op.name()), "{name} parsed as {op}");
            assert_eq!(op.family(), decl.family, "{name}");
            if let Some(n) = op.num_inputs() {
                assert_eq!(n, resolved.specs.len(), "{name}: arity vs example");
            }
            let specs: Vec<DTensorSpec> = resolved
                .specs
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let p = if i == 0 && !s.shape().is_empty() {
                        Placement::Shard(0)
                    } else {
                        Placement::Replicate
                    };
                    DTensorSpec::new(s.shape(), s.dtype(), &[p, Placement::Replicate])
                })
                .collect();
            let metas: Vec<&TensorMeta> = specs.iter().map(|s| &s.meta).collect();
            single_dim_strategies(&op, &metas).unwrap_or_else(|e| panic!("{name}: {e}"));
            let refs: Vec<&DTensorSpec> = specs.iter().collect();
            let s = propagate_with(&op, &refs, &mesh, ExpandMethod::Auto)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(s.input_specs.len(), specs.len());
            seen += 1;
        }
    }
    assert_eq!(seen, Op::known_names().len());
    assert!(Op::parse("no_such_op", &Default::default()).is_err());
    assert_eq!(parse_shape("4x6").unwrap().as_slice(), &[4, 6]);
}
