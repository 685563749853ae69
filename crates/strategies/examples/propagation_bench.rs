//! Sharding-propagation benchmark: cached propagation, cold propagation on a 131,072-rank 4-D
//! mesh, and redistribution planning. Reports medians.
//!
//! ```text
//! cargo run --release -p candle-dtensor-strategies --example propagation_bench [-- --json]
//! ```
#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::time::Instant;

use candle_dtensor_strategies::{
    parse_placements, plan_redistribute, propagate_with, BinaryOp, DTensorSpec, DType,
    ExpandMethod, MeshTopology, Op, ShardingPropagator,
};

struct Result {
    name: &'static str,
    median_ns: f64,
    samples: usize,
    per_sample: usize,
    note: String,
}

fn spec(shape: &[usize], p: &str) -> DTensorSpec {
    DTensorSpec::new(
        shape,
        DType::BF16,
        &parse_placements(p).expect("placements"),
    )
}

/// Median over `samples` of the mean time of `per_sample` calls.
fn measure(samples: usize, per_sample: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..per_sample.min(1000) {
        f();
    }
    let mut t: Vec<f64> = (0..samples)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..per_sample {
                f();
            }
            start.elapsed().as_nanos() as f64 / per_sample as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let mut out: Vec<Result> = Vec::new();

    let mesh2 = MeshTopology::parse("dp=2,tp=4").expect("mesh");
    let prop = ShardingPropagator::new();
    let x = spec(&[4096, 1024], "S(0),R");
    let w = spec(&[1024, 4096], "R,S(1)");
    let r = prop.propagate(&Op::Matmul, &[&x, &w], &mesh2).expect("mm");
    out.push(Result {
        name: "cached_mm_2d",
        median_ns: measure(21, 100_000, || {
            black_box(
                prop.propagate(black_box(&Op::Matmul), &[&x, &w], &mesh2)
                    .expect("mm"),
            );
        }),
        samples: 21,
        per_sample: 100_000,
        note: format!("mesh dp=2,tp=4; out {}", r.output_specs[0]),
    });
    let a = spec(&[4096, 1024], "S(0),S(1)");
    let b = spec(&[1024], "R,S(0)");
    let add = Op::Binary(BinaryOp::Add);
    let r = prop.propagate(&add, &[&a, &b], &mesh2).expect("add");
    out.push(Result {
        name: "cached_add_2d",
        median_ns: measure(21, 100_000, || {
            black_box(
                prop.propagate(black_box(&add), &[&a, &b], &mesh2)
                    .expect("add"),
            );
        }),
        samples: 21,
        per_sample: 100_000,
        note: format!("broadcast add; out {}", r.output_specs[0]),
    });

    let mesh4 = MeshTopology::parse("pp=8,dp=16,cp=32,tp=32").expect("mesh");
    let mm = |x: &str, w: &str| vec![spec(&[8192, 4096], x), spec(&[4096, 16384], w)];
    let cold: Vec<(&'static str, Op, Vec<DTensorSpec>, ExpandMethod)> = vec![
        (
            "cold_mm_4d_in_place",
            Op::Matmul,
            mm("S(0),S(0),R,R", "R,R,R,S(1)"),
            ExpandMethod::Auto,
        ),
        (
            "cold_mm_4d_mismatch",
            Op::Matmul,
            mm("S(0),S(0),R,S(1)", "R,R,R,S(1)"),
            ExpandMethod::Auto,
        ),
        (
            "cold_mm_4d_mismatch_dijkstra",
            Op::Matmul,
            mm("S(0),S(0),R,S(1)", "R,R,R,S(1)"),
            ExpandMethod::Dijkstra,
        ),
        (
            "cold_mm_4d_partial_input",
            Op::Matmul,
            mm("P(sum),S(0),R,R", "R,R,S(0),S(1)"),
            ExpandMethod::Auto,
        ),
        (
            "cold_mm_4d_mostly_replicated",
            Op::Matmul,
            mm("R,R,R,S(1)", "R,R,R,S(1)"),
            ExpandMethod::Auto,
        ),
        (
            "cold_mm_4d_mostly_replicated_dijkstra",
            Op::Matmul,
            mm("R,R,R,S(1)", "R,R,R,S(1)"),
            ExpandMethod::Dijkstra,
        ),
        (
            "cold_add_bias_4d",
            Op::Binary(BinaryOp::Add),
            vec![
                spec(&[64, 4096, 4096], "R,R,R,S(2)"),
                spec(&[4096], "R,R,R,R"),
            ],
            ExpandMethod::Auto,
        ),
        (
            "cold_softmax_4d_sharded_dim",
            Op::Softmax { dim: 2 },
            vec![spec(&[64, 4096, 4096], "R,S(0),S(1),S(2)")],
            ExpandMethod::Auto,
        ),
        (
            "cold_reshape_4d_three_collectives",
            Op::Reshape {
                shape: smallvec::smallvec![64 * 4096, 4096],
            },
            vec![spec(&[64, 4096, 4096], "S(0),S(1),S(1),S(2)")],
            ExpandMethod::Auto,
        ),
    ];
    for (name, op, specs, method) in cold {
        let refs: Vec<&DTensorSpec> = specs.iter().collect();
        let r = propagate_with(&op, &refs, &mesh4, method).expect("cold 4d");
        let chosen: Vec<String> = r.input_specs.iter().map(|s| s.to_string()).collect();
        let given: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        let iters = 3;
        out.push(Result {
            name,
            median_ns: measure(31, iters, || {
                black_box(propagate_with(black_box(&op), &refs, &mesh4, method).expect("cold"));
            }),
            samples: 31,
            per_sample: iters,
            note: format!(
                "{op} on 8x16x32x32 (131072 ranks), {method:?}; {} -> chosen {} -> out {}; {:.1} us comm",
                given.join(" / "),
                chosen.join(" / "),
                r.output_specs[0],
                r.cost_us
            ),
        });
    }

    let plans: [(&'static str, &str, &[usize], &str, &str); 3] = [
        (
            "plan_nested_2d",
            "dp=2,tp=4",
            &[4096, 1024],
            "S(0),S(0)",
            "R,S(0)",
        ),
        (
            "plan_rs_2d",
            "dp=2,tp=4",
            &[4096, 1024],
            "P(sum),P(sum)",
            "S(0),S(0)",
        ),
        (
            "plan_4d",
            "pp=8,dp=16,cp=32,tp=32",
            &[8192, 4096],
            "S(0),S(1),P(sum),S(0)",
            "R,R,R,R",
        ),
    ];
    for (name, m, shape, src, dst) in plans {
        let mesh = MeshTopology::parse(m).expect("mesh");
        let s = spec(shape, src);
        let d = parse_placements(dst).expect("dst");
        let p = plan_redistribute(&s, &d, &mesh).expect("plan");
        out.push(Result {
            name,
            median_ns: measure(21, 200, || {
                black_box(plan_redistribute(black_box(&s), &d, &mesh).expect("plan"));
            }),
            samples: 21,
            per_sample: 200,
            note: format!("{m}: {p}"),
        });
    }

    for r in &out {
        if json {
            let v = serde_json::json!({
                "bench": r.name, "median_ns": (r.median_ns * 10.0).round() / 10.0,
                "median_us": (r.median_ns / 100.0).round() / 10.0,
                "samples": r.samples, "calls_per_sample": r.per_sample, "note": r.note,
            });
            println!("{v}");
        } else {
            println!("{:<30} {:>12.1} ns  ({})", r.name, r.median_ns, r.note);
        }
    }
}
