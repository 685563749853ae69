use candle_dtensor_strategies::{explain, ExplainRequest, StrategyError};

fn req(mesh: &str, op: &str, shapes: &str, placements: &str) -> ExplainRequest {
    ExplainRequest {
        mesh: mesh.into(),
        op: op.into(),
        shapes: shapes.into(),
        placements: placements.into(),
        ..Default::default()
    }
}

#[test]
fn matmul_report_json() {
    let r = explain(&req("dp=2,tp=2", "matmul", "64x32,32x64", "S(0),R;R,S(1)")).unwrap();
    let js = serde_json::to_value(&r).unwrap();
    assert_eq!(js["op"], "matmul");
    assert_eq!(js["mesh"], "dp=2,tp=2");
    assert_eq!(js["inputs"], serde_json::json!(["S(0),R", "R,S(1)"]));
    assert_eq!(js["chosen_inputs"], serde_json::json!(["S(0),R", "R,S(1)"]));
    assert_eq!(js["output"], "S(0),S(1)");
    assert_eq!(js["collectives"], serde_json::json!([]));
    assert_eq!(js["est_us_total"], 0.0);
}

#[test]
fn collectives_name_mesh_dims() {
    let r = explain(&req("dp=2,tp=2", "sum", "8x6", "S(0),S(1)")).unwrap();
    assert_eq!(r.output, "P(sum),P(sum)");
    let mut q = req("dp=2,tp=2", "redistribute", "8x3", "S(0),S(0)");
    q.to = Some("R,R".into());
    q.flatten = vec!["dp,tp".into()];
    let r = explain(&q).unwrap();
    assert_eq!(r.collectives.len(), 1);
    assert_eq!(r.collectives[0].mesh_dim, "dp+tp");
    let js = serde_json::to_value(&r).unwrap();
    assert_eq!(js["collectives"][0]["kind"], "all_gather");
    assert_eq!(js["collectives"][0]["bytes"], 96);
    let text = r.to_string();
    assert!(
        text.contains("all_gather") && text.contains("dp+tp"),
        "{text}"
    );
}

#[test]
fn view_report_shows_the_redistribution() {
    let mut q = req("tp=4", "reshape", "12x8", "S(1)");
    q.to_shape = Some("16x6".into());
    let r = explain(&q).unwrap();
    assert_eq!(r.chosen_inputs, ["S(0)"]);
    assert_eq!(r.plans, ["S(1) -> S(0)"]);
    assert_eq!(r.collectives[0].kind.name(), "all_to_all");
}

#[test]
fn bad_input_is_a_clear_error() {
    let e = explain(&req("dp=2,tp=2", "frob", "4x4", "")).unwrap_err();
    assert!(matches!(e, StrategyError::UnknownOp { .. }));
    assert!(e.to_string().contains("known ops: abs, add"), "{e}");
    let e = explain(&req("dp=2,tp=2", "matmul", "8x16,12x4", "")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "matmul: inner dims differ: [8, 16] x [12, 4]"
    );
    let e = explain(&req("dp=2,tp=2", "add", "4x4,4", "S(0);Q(1)")).unwrap_err();
    assert!(e.to_string().contains("\"Q(1)\""), "{e}");
    let e = explain(&req("dp=2,tp=2", "add", "4x4,4", "S(0),R")).unwrap_err();
    assert!(
        e.to_string().contains("1 placement lists for 2 shapes"),
        "{e}"
    );
    let e = explain(&req("dp=2,tp=2", "add", "4xq,4", "")).unwrap_err();
    assert!(
        matches!(e, StrategyError::Parse { what: "shape", .. }),
        "{e}"
    );
    let e = explain(&req("dp=2", "softmax", "4x4", "S(2)")).unwrap_err();
    assert_eq!(e.to_string(), "softmax: S(2) on a 2-d tensor [4, 4]");
    let e = explain(&req("dp=0", "softmax", "4x4", "")).unwrap_err();
    assert!(matches!(e, StrategyError::Mesh { .. }));
}

#[test]
fn negative_dims_and_placements() {
    let mut q = req("tp=4", "softmax", "8x6", "S(-2)");
    q.dims = Some("-1".into());
    let r = explain(&q).unwrap();
    assert_eq!(r.output, "S(0)");
}
