//! `train_gpt --check` and `--check-against`: checks that can fail. Runs of the example's own
//! `real_main` (tiny preset, a few steps on dp=2) pass against the single-device reference and
//! against their own loss CSV, and fail, with [`train_gpt::exit_code`] 1 and an error naming
//! what failed, when a NaN, an infinity, a changed value, a missing row or an extra row is
//! planted in the reference CSV. A malformed CSV is an error (exit code 2) naming file and line.
#[path = "../examples/train_gpt.rs"]
#[allow(dead_code)]
mod train_gpt;

mod common;

use common::Scratch;
use std::path::Path;

use candle_dtensor::kernels::compare::Mismatch;
use clap::Parser;
use train_gpt::{CheckError, Failure};

/// `real_main` sizes the gemm threads through a process environment variable: one run at a
/// time, so no other test thread reads the environment while it is written.
static RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

type Outcome = Result<Option<serde_json::Value>, Failure>;

fn real_main(extra: &[&str]) -> Outcome {
    let mut v = vec!["train_gpt"];
    v.extend_from_slice(extra);
    let args = train_gpt::Args::try_parse_from(v).unwrap();
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    train_gpt::real_main(&args)
}

/// A tiny run: 3 steps of the tiny preset, FSDP over dp=2, the held-out loss after steps 2
/// and 3, curves written to `out`.
fn tiny(out: &Path, extra: &[&str]) -> Outcome {
    tiny_steps(out, "3", extra)
}

/// [`tiny`] with `steps` steps in total.
fn tiny_steps(out: &Path, steps: &str, extra: &[&str]) -> Outcome {
    let mut v = vec![
        "--mesh",
        "dp=2",
        "--steps",
        steps,
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--json",
        "--timeout",
        "60",
        "--out",
        out.to_str().unwrap(),
    ];
    v.extend_from_slice(extra);
    real_main(&v)
}

/// The summary of a run that must have succeeded.
fn passed(o: Outcome) -> serde_json::Value {
    assert_eq!(train_gpt::exit_code(&o), 0, "{:?}", o.as_ref().err());
    let s = o.unwrap().unwrap();
    assert_eq!(s["check_passed"], true, "{s}");
    assert!(s["check_error"].is_null(), "{s}");
    s
}

/// The errors of a run whose check must have failed (exit code 1, summary with
/// `check_passed: false` and the error text).
fn failed(o: Outcome) -> (Vec<CheckError>, serde_json::Value) {
    assert_eq!(train_gpt::exit_code(&o), train_gpt::EXIT_CHECK_FAILED);
    match o {
        Err(Failure::Check(c)) => {
            let text = c.to_string();
            let s = *c.summary;
            assert_eq!(s["check_passed"], false, "{s}");
            assert_eq!(s["check_error"], text.as_str(), "{s}");
            assert!(!c.errors.is_empty());
            (c.errors, s)
        }
        other => panic!("expected a failed check, got {other:?}"),
    }
}

/// The mismatches of the losses (not the held-out losses) among `errors`.
fn loss_mismatch(errors: &[CheckError]) -> &Mismatch {
    errors
        .iter()
        .find_map(|e| match e {
            CheckError::Series { mismatch, .. } if mismatch.to_string().starts_with("loss") => {
                Some(mismatch)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no loss mismatch in {errors:?}"))
}

/// `csv` with the loss column of row `step` (0-based data rows) replaced by `value`.
fn with_loss(csv: &str, step: usize, value: &str) -> String {
    csv.lines()
        .enumerate()
        .map(|(i, l)| {
            if i == step + 1 {
                let c: Vec<&str> = l.split(',').collect();
                format!("{},{value},{}\n", c[0], c[2])
            } else {
                format!("{l}\n")
            }
        })
        .collect()
}

#[test]
fn check_and_check_against_pass_and_planted_failures_fail() {
    let dir = Scratch::new("planted");
    let rec = dir.path("rec");
    // --check: the FSDP run against one device.
    let s = passed(tiny(&rec, &["--check"]));
    let d = s["max_rel_loss_diff"].as_f64().unwrap();
    assert!(d <= 1e-4, "{d}");
    assert!(s["max_rel_eval_loss_diff"].as_f64().unwrap() <= 1e-4, "{s}");
    assert_eq!(s["check_tol"], 1e-4, "the default tolerance");
    let csv_path = rec.with_extension("csv");
    let csv = std::fs::read_to_string(&csv_path).unwrap();
    assert_eq!(csv.lines().count(), 4, "{csv}");

    // The same flags against the run's own CSV: equal, step by step (the same losses).
    let again = dir.path("again");
    let c = csv_path.to_str().unwrap();
    let s = passed(tiny(&again, &["--check-against", c]));
    assert_eq!(s["check_against"]["max_rel_loss_diff"], 0.0, "{s}");
    assert_eq!(s["check_against"]["max_rel_eval_loss_diff"], 0.0, "{s}");
    assert!(s["max_rel_loss_diff"].is_null(), "no --check: {s}");

    // Planted in the reference: each makes the check fail and says which.
    let plant = |name: &str, text: String| {
        let p = dir.path(name);
        std::fs::write(&p, text).unwrap();
        let o = tiny(&again, &["--check-against", p.to_str().unwrap()]);
        let (errors, s) = failed(o);
        assert!(
            errors.iter().all(|e| e.to_string().contains(name)),
            "names the file: {errors:?}"
        );
        (errors, s)
    };
    // A NaN loss.
    let (e, s) = plant("nan.csv", with_loss(&csv, 1, "NaN"));
    assert!(
        matches!(loss_mismatch(&e), Mismatch::NonFinite { index: 1, want, .. } if want.is_nan()),
        "{e:?}"
    );
    assert!(
        s["check_against"]["max_rel_loss_diff"].is_null(),
        "no figure for a NaN: {s}"
    );
    // An infinite loss.
    let (e, _) = plant("inf.csv", with_loss(&csv, 2, "inf"));
    assert!(
        matches!(loss_mismatch(&e), Mismatch::NonFinite { index: 2, .. }),
        "{e:?}"
    );
    // A value 1% off: past the tolerance, the figure says how far.
    let row0: f32 = csv
        .lines()
        .nth(1)
        .unwrap()
        .split(',')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let (e, s) = plant(
        "changed.csv",
        with_loss(&csv, 0, &(row0 * 1.01).to_string()),
    );
    match loss_mismatch(&e) {
        Mismatch::Tolerance {
            index, rel, tol, ..
        } => {
            assert_eq!((*index, *tol), (0, 1e-4));
            assert!((rel - 0.01 / 1.01).abs() < 1e-4, "{rel}");
        }
        other => panic!("expected a tolerance failure, got {other}"),
    }
    let figure = s["check_against"]["max_rel_loss_diff"].as_f64().unwrap();
    assert!(figure > 9e-3, "{figure}");
    // ... and passes when the tolerance allows it.
    let p = dir.path("changed.csv");
    passed(tiny(
        &again,
        &[
            "--check-against",
            p.to_str().unwrap(),
            "--check-tol",
            "0.02",
        ],
    ));
    // A truncated CSV: the recorded run was shorter (its last row, with an evaluation, gone).
    let short: String = csv.lines().take(3).map(|l| format!("{l}\n")).collect();
    let (e, _) = plant("short.csv", short);
    assert!(
        matches!(
            loss_mismatch(&e),
            Mismatch::Length {
                got: 3,
                want: 2,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.iter()
            .any(|e| matches!(e, CheckError::EvalSteps { got, want, .. } if got == &[2, 3] && want == &[2])),
        "{e:?}"
    );
    // An extra row: the recorded run was longer.
    let (e, _) = plant("long.csv", format!("{csv}3,{row0},\n"));
    assert!(
        matches!(
            loss_mismatch(&e),
            Mismatch::Length {
                got: 3,
                want: 4,
                ..
            }
        ),
        "{e:?}"
    );
    // A NaN held-out loss.
    let last = csv.lines().last().unwrap();
    let (step, loss) = {
        let c: Vec<&str> = last.split(',').collect();
        (c[0].to_string(), c[1].to_string())
    };
    let eval_nan = csv.replace(last, &format!("{step},{loss},NaN"));
    let (e, _) = plant("evalnan.csv", eval_nan);
    assert!(
        e.iter().any(|e| matches!(e, CheckError::Series { mismatch: Mismatch::NonFinite { what, index: 1, .. }, .. } if what == "held-out loss")),
        "{e:?}"
    );

    // A malformed file is an error (exit code 2) naming file and line, before any training.
    let bad = dir.path("bad.csv");
    std::fs::write(&bad, with_loss(&csv, 1, "5.x")).unwrap();
    let o = tiny(&again, &["--check-against", bad.to_str().unwrap()]);
    assert_eq!(train_gpt::exit_code(&o), train_gpt::EXIT_ERROR);
    let e = o.unwrap_err().to_string();
    assert!(
        e.contains("bad.csv") && e.contains("line 3") && e.contains("\"5.x\""),
        "{e}"
    );
}

/// A resumed run compares exactly the steps it ran: with the single-device reference's same
/// steps, and with a recorded run from step 0 (the rows before its checkpoint skipped).
#[test]
fn a_resumed_run_is_checked_on_the_steps_it_ran() {
    let dir = Scratch::new("resumed");
    let (ckpt, out) = (dir.path("ckpt"), dir.path("curves"));
    let whole = dir.path("whole");
    passed(tiny(&whole, &["--check"]));
    let ck = ckpt.to_str().unwrap();
    let first = tiny_steps(&out, "2", &["--save-dir", ck]).unwrap().unwrap();
    assert!(first["check_passed"].is_null(), "no check asked: {first}");
    let w = whole.with_extension("csv");
    let s = passed(tiny(
        &out,
        &[
            "--save-dir",
            ck,
            "--resume",
            "--check",
            "--check-against",
            w.to_str().unwrap(),
        ],
    ));
    assert_eq!(s["start_step"], 2);
    assert_eq!(s["losses"].as_array().unwrap().len(), 1);
    assert!(s["max_rel_loss_diff"].as_f64().unwrap() <= 1e-4, "{s}");
    // The resumed run's CSV (rows from step 2) cannot check a run from step 0.
    let resumed_csv = out.with_extension("csv");
    let (e, _) = failed(tiny(
        &dir.path("fresh"),
        &["--check-against", resumed_csv.to_str().unwrap()],
    ));
    assert!(
        matches!(
            &e[..],
            [CheckError::StartsLate {
                run_first: 0,
                reference_first: 2,
                ..
            }]
        ),
        "{e:?}"
    );
}

#[test]
fn the_comparison_counts_nan_length_and_eval_steps_as_failures() {
    use train_gpt::compare_losses;
    let l = [5.0f32, 4.0, 3.0];
    let ev = [(2usize, 4.5f32)];
    let ok = compare_losses("r", 0, (&l, &ev), (&l, &ev), 0.0);
    assert_eq!((ok.max_rel, ok.max_rel_eval), (Some(0.0), Some(0.0)));
    assert!(ok.errors.is_empty());
    // NaN on both sides is not "equal".
    let n = [5.0f32, f32::NAN, 3.0];
    let c = compare_losses("r", 0, (&n, &ev), (&n, &ev), 1.0);
    assert_eq!(c.max_rel, None);
    assert!(matches!(
        &c.errors[..],
        [CheckError::Series {
            mismatch: Mismatch::NonFinite { index: 1, .. },
            ..
        }]
    ));
    // A run that stopped early does not match the prefix it shares.
    let c = compare_losses("r", 4, (&l[..2], &[]), (&l, &[]), 1.0);
    assert!(
        matches!(&c.errors[..], [CheckError::Series { mismatch: Mismatch::Length { got: 2, want: 3, what }, .. }] if what.contains("from step 4")),
        "{c:?}"
    );
    assert_eq!(c.max_rel_eval, None, "no evaluations on either side");
    // Evaluations after other steps (or missing on one side) fail.
    let c = compare_losses("r", 0, (&l, &ev), (&l, &[(3, 4.5)]), 1.0);
    assert!(matches!(&c.errors[..], [CheckError::EvalSteps { .. }]));
    let c = compare_losses("r", 0, (&l, &ev), (&l, &[]), 1.0);
    assert!(matches!(&c.errors[..], [CheckError::EvalSteps { .. }]));
}

#[test]
fn loss_csvs_parse_strictly() {
    use train_gpt::{parse_curves_csv, LossCurves};
    let p = Path::new("rec.csv");
    let good = "step,loss,eval_loss\n4,5.5,\n5,5.25,5.125\n";
    assert_eq!(
        parse_curves_csv(p, good).unwrap(),
        LossCurves {
            first: 4,
            losses: vec![5.5, 5.25],
            eval_losses: vec![(6, 5.125)],
        }
    );
    // NaN and infinity parse, as the non-finite values the check fails on.
    let c = parse_curves_csv(p, "step,loss,eval_loss\n0,NaN,inf\n1,-inf,\n").unwrap();
    assert!(c.losses[0].is_nan() && c.losses[1] == f32::NEG_INFINITY);
    assert_eq!(c.eval_losses, vec![(1, f32::INFINITY)]);
    let header_only = parse_curves_csv(p, "step,loss,eval_loss\n").unwrap();
    assert!(header_only.losses.is_empty());
    for (text, needle) in [
        ("", "empty"),
        ("step,loss\n0,1,\n", "line 1: header"),
        ("step,loss,eval_loss\n0,1\n", "line 2: \"0,1\" has 2 fields"),
        (
            "step,loss,eval_loss\n0,1,,\n",
            "line 2: \"0,1,,\" has 4 fields",
        ),
        ("step,loss,eval_loss\n0,1,\n\n", "line 3: \"\" has 1 fields"),
        (
            "step,loss,eval_loss\n0,1,\n2,1,\n",
            "line 3: step 2, expected 1",
        ),
        ("step,loss,eval_loss\n-1,1,\n", "line 2: step \"-1\""),
        (
            "step,loss,eval_loss\n0,,\n",
            "line 2: loss \"\" is not a number",
        ),
        (
            "step,loss,eval_loss\n0, 1,\n",
            "line 2: loss \" 1\" is not a number",
        ),
        (
            "step,loss,eval_loss\n0,1,x\n",
            "line 2: eval_loss \"x\" is not a number",
        ),
    ] {
        let e = parse_curves_csv(p, text).unwrap_err();
        assert!(
            e.starts_with("rec.csv: ") && e.contains(needle),
            "{text:?}: {e}"
        );
    }
    let e = train_gpt::read_curves_csv(Path::new("/nonexistent/rec.csv")).unwrap_err();
    assert!(e.contains("--check-against /nonexistent/rec.csv"), "{e}");
}

/// `main` exits with [`train_gpt::exit_code`]: 0, 1 for a failed check, 2 for an error (the
/// script scripts/ci_process.sh runs the binary with planted failures and checks the same).
#[test]
fn exit_codes_tell_a_failed_check_from_an_error() {
    let ok: Outcome = Ok(None);
    assert_eq!(train_gpt::exit_code(&ok), 0);
    let e: Outcome = Err(Failure::Error("bad flag".into()));
    assert_eq!(train_gpt::exit_code(&e), 2);
    // Flags the check needs are refused before training (errors, not failed checks).
    let o = real_main(&["--steps", "1", "--check-tol", "1e-3"]);
    assert_eq!(train_gpt::exit_code(&o), 2);
    assert!(o
        .unwrap_err()
        .to_string()
        .contains("--check-tol needs --check"));
    let o = real_main(&["--steps", "1", "--check", "--check-tol=-1"]);
    assert!(o.unwrap_err().to_string().contains("--check-tol -1"));
    let o = real_main(&["--steps", "1", "--check", "--check-tol", "NaN"]);
    assert!(o.unwrap_err().to_string().contains("--check-tol NaN"));
    let o = real_main(&["--steps", "1", "--check-against", "/nonexistent/rec.csv"]);
    assert_eq!(train_gpt::exit_code(&o), 2);
}

/// The default tolerance follows the compute dtype: mixed precision is not what the f32
/// reference computes.
#[test]
fn the_default_tolerance_follows_mixed_precision() {
    let tol = |extra: &[&str]| {
        let mut v = vec!["train_gpt", "--check"];
        v.extend_from_slice(extra);
        train_gpt::check_tol(&train_gpt::Args::try_parse_from(v).unwrap()).unwrap()
    };
    assert_eq!(tol(&[]), 1e-4);
    assert_eq!(tol(&["--mixed-precision", "f32"]), 1e-4);
    assert_eq!(tol(&["--mixed-precision", "f16"]), 2e-3);
    assert_eq!(tol(&["--mixed-precision", "bf16"]), 2e-2);
    assert_eq!(
        tol(&["--mixed-precision", "bf16", "--check-tol", "0.5"]),
        0.5
    );
}
