//! `examples/attn_bench.rs` on the CPU: its shapes parse and are refused when malformed, the
//! FLOP count is FlashAttention's, and a run reports finite times and rates for each shape with
//! the kernels it ran named.
#[path = "../examples/attn_bench.rs"]
#[allow(dead_code)]
mod attn_bench;

#[test]
fn shapes_parse_and_a_cpu_run_reports_every_shape() {
    assert_eq!(
        attn_bench::parse_shapes(attn_bench::DEFAULT_SHAPES).unwrap(),
        vec![[8, 12, 1024, 64], [8, 16, 1024, 64], [4, 8, 2048, 128]]
    );
    for bad in ["1,2,3", "1,2,3,x", "0,1,1,64", "1,2,3,4,5"] {
        assert!(attn_bench::parse_shapes(bad).is_err(), "`{bad}` accepted");
    }
    // GPT-2 small's attention at batch 8: 4 x 96 heads x 1024^2 x 64, halved when causal.
    let full = 4.0 * 96.0 * 1024.0 * 1024.0 * 64.0;
    assert_eq!(attn_bench::forward_flops([8, 12, 1024, 64], false), full);
    assert_eq!(
        attn_bench::forward_flops([8, 12, 1024, 64], true),
        full / 2.0
    );

    let args = attn_bench::Args {
        device: "cpu".into(),
        shapes: "1,2,33,16;2,1,8,32".into(),
        dtype: "f32".into(),
        no_causal: false,
        reps: attn_bench::device_timing::Reps {
            iters: 3,
            warmup: 1,
        },
        json: true,
    };
    let r = attn_bench::run(&args).expect("runs on the CPU");
    assert_eq!(r["kernels"], "composition", "{r}");
    let cases = r["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2, "{r}");
    for c in cases {
        for key in [
            "forward_ms",
            "packed_forward_ms",
            "packed_forward_backward_ms",
        ] {
            assert_eq!(c[key]["n"].as_u64(), Some(3), "{key} in {c}");
        }
        for key in ["forward_tflops", "forward_backward_tflops"] {
            let v = c[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{key} = {v} in {c}");
        }
    }
    for bad in [
        attn_bench::Args {
            reps: attn_bench::device_timing::Reps {
                iters: 0,
                warmup: 1,
            },
            ..args.clone()
        },
        attn_bench::Args {
            dtype: "f16".into(),
            ..args.clone()
        },
        attn_bench::Args {
            shapes: ";".into(),
            ..args.clone()
        },
    ] {
        assert!(attn_bench::run(&bad).is_err(), "{bad:?} accepted");
    }
}
