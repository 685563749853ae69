//! Strategy tables per op family, and a smoke test over every op name.

use candle_dtensor_strategies::{
    build_op, parse_shape, propagate_with, single_dim_strategies, DTensorSpec, DType, ExpandMethod,
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
    assert_eq!(t, ["S(0) <- S(0), S(0), S(0)", "S(1) <- S(1), S(1), S(1)"]);
    let t = table(
        &Op::PackedSdpa {
            causal: true,
            scale: None,
        },
        &[(&[2, 8, 4, 3, 16], F)],
    );
    assert_eq!(t, ["S(0) <- S(0)", "S(2) <- S(2)"]);
    let t = table(&Op::CrossEntropy, &[(&[4, 16], F), (&[4], DType::I64)]);
    assert_eq!(
        t,
        [
            "P(avg) <- S(0), S(0)",
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

#[test]
fn every_op_name_builds_and_propagates() {
    let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
    for name in Op::known_names() {
        let (shapes, dims, to_shape): (&str, Option<&str>, Option<&str>) = match name {
            "matmul" | "broadcast_matmul" => ("4x6,6x8", None, None),
            "linear" => ("4x6,8x6,8", None, None),
            "embedding" => ("4:u32,10x6", None, None),
            "cross_entropy" => ("4x6,4:i64", None, None),
            "index_select" => ("10x6,3:u32", None, None),
            "gather" => ("4x6,4x2:i64", Some("1"), None),
            "reshape" => ("4x6", None, Some("2x12")),
            "broadcast_as" => ("1x6", None, Some("4x6")),
            "narrow" => ("4x6", Some("1,2,3"), None),
            "squeeze" => ("4x1x6", Some("1"), None),
            "permute" => ("4x6", Some("1,0"), None),
            "sdpa" => ("2x4x8x16,2x4x8x16,2x4x8x16", None, None),
            "packed_sdpa" => ("2x8x4x3x16", None, None),
            "layer_norm" => ("4x6,6,6", None, None),
            "rms_norm" => ("4x6,6", None, None),
            "where" => ("4x6:u8,4x6,4x6", None, None),
            "masked_fill" => ("4x6,4x6:u8", None, None),
            "cat" | "stack" => ("4x6,4x6", None, None),
            "to_dtype" => ("4x6", None, None),
            n if [
                "add", "sub", "mul", "div", "maximum", "minimum", "eq", "ne", "lt", "le", "gt",
                "ge",
            ]
            .contains(&n) =>
            {
                ("4x6,6", None, None)
            }
            _ => ("4x6", None, None),
        };
        let req = ExplainRequest {
            mesh: "dp=2,tp=2".into(),
            op: name.into(),
            shapes: shapes.into(),
            placements: String::new(),
            dims: dims.map(str::to_string),
            to_shape: to_shape.map(str::to_string),
            to_dtype: Some("bf16".into()),
            ..Default::default()
        };
        let parsed = candle_dtensor_strategies::parse_shapes(shapes).unwrap();
        let shape_list: Vec<_> = parsed.iter().map(|p| p.0.clone()).collect();
        let op = build_op(&req, &shape_list).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(op.to_string(), name);
        let specs: Vec<DTensorSpec> = parsed
            .iter()
            .enumerate()
            .map(|(i, (s, dt))| {
                let dtype = dt.unwrap_or(F);
                let p = if i == 0 && !s.is_empty() {
                    Placement::Shard(0)
                } else {
                    Placement::Replicate
                };
                DTensorSpec::new(s, dtype, &[p, Placement::Replicate])
            })
            .collect();
        let refs: Vec<&DTensorSpec> = specs.iter().collect();
        let s = propagate_with(&op, &refs, &mesh, ExpandMethod::Auto)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.input_specs.len(), specs.len());
        assert_eq!(parse_shape("4x6").unwrap().as_slice(), &[4, 6]);
    }
}
