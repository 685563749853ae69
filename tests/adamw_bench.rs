//! `examples/adamw_bench.rs` on the CPU: its parameter shapes are the model's (the count
//! train_gpt reports for the tiny and small presets, GPT-2 small's 124,475,904), and a run
//! reports finite times, the floor ratio and candle-nn's AdamW beside it.
// Both examples include examples/common/logging.rs as a module of their own.
#![allow(clippy::duplicate_mod)]
#[path = "../examples/adamw_bench.rs"]
#[allow(dead_code)]
mod adamw_bench;
#[path = "../examples/train_gpt.rs"]
#[allow(dead_code)]
mod train_gpt;

mod common;

use candle_dtensor::models::GptConfig;
use common::Scratch;
use std::ffi::OsString;

fn count(preset: &str) -> usize {
    adamw_bench::shapes(&GptConfig::preset(preset).unwrap())
        .iter()
        .map(|s| s.iter().product::<usize>())
        .sum()
}

#[test]
fn shapes_are_the_models_and_a_cpu_run_reports_the_floor_ratio() {
    // GPT-2 small with the vocabulary padded to 50304 and a tied head.
    assert_eq!(count("gpt2"), 124_475_904);
    let out = Scratch::new("adamw_bench");
    for preset in ["tiny", "small"] {
        let prefix = out.0.join(preset);
        let args: Vec<OsString> = [
            "train_gpt",
            "--steps",
            "1",
            "--json",
            "--mesh",
            "tp=1",
            "--no-fsdp",
            "--preset",
            preset,
            "--batch",
            "1",
            "--out",
        ]
        .iter()
        .map(OsString::from)
        .chain([prefix.into_os_string()])
        .collect();
        let a = train_gpt::parse_args(args).expect("parses");
        let s = match train_gpt::real_main(&a) {
            Ok(Some(s)) => s,
            Ok(None) => panic!("{preset}: no summary"),
            Err(train_gpt::Failure::Error(e)) => panic!("{preset}: {e}"),
            Err(train_gpt::Failure::Check(c)) => panic!("{preset}: {c:?}"),
        };
        assert_eq!(
            s["params"].as_u64(),
            Some(count(preset) as u64),
            "{preset}: the bench's shapes against train_gpt's model"
        );
    }
    let args = adamw_bench::Args {
        device: "cpu".into(),
        preset: "tiny".into(),
        reps: adamw_bench::device_timing::Reps {
            iters: 3,
            warmup: 1,
        },
        no_candle_nn: false,
        json: true,
    };
    let r = adamw_bench::run(&args).expect("runs on the CPU");
    assert_eq!(r["params"].as_u64(), Some(count("tiny") as u64));
    for key in [
        "ratio_to_floor",
        "copy_gbps",
        "fused_gbps",
        "candle_nn_over_fused",
    ] {
        let v = r[key].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v > 0.0, "{key} = {v} in {r}");
    }
    assert_eq!(r["fused_adamw_ms"]["n"].as_u64(), Some(3), "{r}");
    let bad = adamw_bench::Args {
        reps: adamw_bench::device_timing::Reps {
            iters: 0,
            warmup: 1,
        },
        ..args
    };
    assert!(adamw_bench::run(&bad).is_err(), "--iters 0 refused");
}
