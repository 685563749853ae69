//! train_gpt's job files, model shapes, optimizer and schedule flags, metrics and bad input
//! (issue 37, items 1-4 and "Bad input"), through the example's own `parse_args` and
//! `real_main`: every flag has a job-file key; every file in examples/configs parses, prints a
//! resolved job that reads back to the same job, and trains; `--print-config` fed back with
//! `--config` gives bit-identical losses; the shape flags build the model they say (parameter
//! count as built); the metrics log has one sane line per logged step with the schedule's
//! rates; a resumed run continues the schedule exactly; and bad input (unknown keys, wrong
//! types, shapes, schedules, a checkpoint of another model) fails before training, naming the
//! key or flag, the value and the rule.
#[path = "../examples/train_gpt.rs"]
#[allow(dead_code)]
mod train_gpt;

mod common;

use common::Scratch;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use candle_dtensor::train::schedule::{Decay, LrSchedule};
use clap::CommandFactory;
use train_gpt::{Args, Failure};

/// `real_main` sizes the gemm threads through a process environment variable: one run at a
/// time, so no other test thread reads the environment while it is written.
static RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn argv(args: &[&str]) -> Vec<OsString> {
    std::iter::once("train_gpt")
        .chain(args.iter().copied())
        .map(OsString::from)
        .collect()
}

/// The arguments as the binary reads them (job file, then the command line).
fn parse(args: &[&str]) -> Result<Args, String> {
    train_gpt::parse_args(argv(args)).map_err(|e| e.to_string())
}

fn run_args(a: &Args) -> Result<Option<serde_json::Value>, Failure> {
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    train_gpt::real_main(a)
}

/// A run that must succeed: its summary.
fn ok(args: &[&str]) -> serde_json::Value {
    let a = parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    match run_args(&a) {
        Ok(Some(s)) => s,
        other => panic!("{args:?}: {other:?}"),
    }
}

/// A run that must fail with an error (exit status 2) before training: its message. `out` is
/// the run's --out prefix: no loss CSV may have been written.
fn refused(args: &[&str], out: &Path) -> String {
    let e = match parse(args) {
        Err(e) => e,
        Ok(a) => {
            let r = run_args(&a);
            assert_eq!(
                train_gpt::exit_code(&r),
                train_gpt::EXIT_ERROR,
                "{args:?}: expected an error, got {r:?}"
            );
            r.unwrap_err().to_string()
        }
    };
    assert!(
        !out.with_extension("csv").exists(),
        "{args:?}: failed after training (a loss CSV was written): {e}"
    );
    e
}

/// `a` then `b`.
fn cat<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    a.iter().chain(b).copied().collect()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// The lines of a metrics file as JSON objects.
fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[test]
fn every_flag_has_a_job_file_key() {
    let (missing, stray) = train_gpt::job::coverage(&Args::command(), train_gpt::SECTIONS);
    assert!(missing.is_empty(), "flags without a section: {missing:?}");
    assert!(stray.is_empty(), "listed but not flags: {stray:?}");
    // The shape, optimizer, schedule and metrics flags are there, in their sections.
    let job = parse(&[]).unwrap().job.unwrap();
    for line in [
        "[model]\npreset = \"tiny\"\n# layers = (not set)\n",
        "decay-params = \"matrices\"\nbeta1 = 0.9\nbeta2 = 0.999\n",
        "[lr_schedule]\nwarmup = 0\nlr-decay = \"none\"\nmin-lr = 0\n",
        "log-every = 1\n",
    ] {
        assert!(job.contains(line), "{line:?} not in\n{job}");
    }
}

/// The example job files: each parses, its resolved job reads back to the same job (a fixed
/// point), and each trains for a step (the real-text one on a small file given on the command
/// line, overriding the file's `data`).
#[test]
fn example_configs_parse_round_trip_and_train() {
    let dir = Scratch::new("examples");
    let text: String = (0..400)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog. "))
        .collect();
    let input = dir.file("input.txt", &text);
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&configs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    for layout in [
        "single_device",
        "fsdp",
        "fsdp_tp",
        "hsdp",
        "tp_sp",
        "moe",
        "real_text",
    ] {
        assert!(names.iter().any(|n| n == layout), "{layout}.toml missing");
    }
    for f in &files {
        let name = f.file_stem().unwrap().to_string_lossy().into_owned();
        let a = parse(&["--config", f.to_str().unwrap()]).unwrap_or_else(|e| panic!("{e}"));
        let job = a.job.clone().unwrap();
        let printed = dir.file(&format!("{name}.printed.toml"), &job);
        let b = parse(&["--config", printed.to_str().unwrap()]).unwrap();
        assert_eq!(b.job.as_ref(), Some(&job), "{name}: not a fixed point");
        let bare = |mut x: Args| {
            x.config = None;
            x.job = None;
            format!("{x:?}")
        };
        assert_eq!(
            bare(b),
            bare(a),
            "{name}: the printed job reads back to other arguments"
        );
        // It trains (one step; the real-text job's schedule keeps its length).
        let out = dir.s(&format!("{name}-out"));
        let mut v = vec![
            "--config",
            f.to_str().unwrap(),
            "--steps",
            "1",
            "--schedule-steps",
            "1000",
            "--eval-batches",
            "1",
            "--sample",
            "0",
            "--json",
            "--out",
            &out,
        ];
        if name == "real_text" {
            v.extend_from_slice(&["--data", input.to_str().unwrap()]);
        }
        let s = ok(&v);
        assert!(s["final_loss"].as_f64().unwrap().is_finite(), "{name}: {s}");
    }
}

/// `--print-config` output fed back with `--config` is the same run: the same resolved job
/// and bit-identical losses and learning rates.
#[test]
fn print_config_fed_back_gives_bit_identical_losses() {
    let dir = Scratch::new("roundtrip");
    let out = dir.s("curves");
    let a = parse(&[
        "--mesh",
        "dp=2",
        "--steps",
        "3",
        "--layers",
        "2",
        "--width",
        "64",
        "--heads",
        "4",
        "--seq-len",
        "32",
        "--warmup",
        "2",
        "--schedule-steps",
        "6",
        "--lr-decay",
        "cosine",
        "--min-lr",
        "1e-4",
        "--weight-decay",
        "0.1",
        "--beta2",
        "0.95",
        "--json",
        "--out",
        &out,
    ])
    .unwrap();
    // --print-config prints the resolved job and trains nothing.
    let mut p = a.clone();
    p.print_config = true;
    assert!(matches!(run_args(&p), Ok(None)));
    assert_eq!(train_gpt::print_config_text(&p), a.job.clone().unwrap());
    assert!(!Path::new(&out).with_extension("csv").exists());
    let first = run_args(&a).unwrap().unwrap();
    // The run keeps its resolved job next to its outputs.
    let kept = std::fs::read_to_string(Path::new(&out).with_extension("job.toml")).unwrap();
    assert_eq!(Some(&kept), a.job.as_ref());
    assert_eq!(first["job"], format!("{out}.job.toml"));
    let b = parse(&[
        "--config",
        Path::new(&out).with_extension("job.toml").to_str().unwrap(),
    ])
    .unwrap();
    // The same arguments (values may print differently: `1e-4` read back from TOML prints
    // `0.0001`), and the re-read job is a fixed point.
    let bare = |x: &Args| {
        let mut x = x.clone();
        x.config = None;
        x.job = None;
        format!("{x:?}")
    };
    assert_eq!(bare(&b), bare(&a));
    let again = dir.file("again.toml", b.job.as_ref().unwrap());
    let c = parse(&["--config", again.to_str().unwrap()]).unwrap();
    assert_eq!(c.job, b.job, "the re-read job prints the same");
    let second = run_args(&b).unwrap().unwrap();
    assert_eq!(second["losses"], first["losses"], "bit-identical losses");
    assert_eq!(second["lrs"], first["lrs"]);
    let lrs = floats(&first["lrs"]);
    assert_eq!(lrs.len(), 3);
    let sched = LrSchedule::new(1e-3, 2, Decay::Cosine, 6, 1e-4).unwrap();
    assert_eq!(lrs, (0..3).map(|i| sched.lr_at(i)).collect::<Vec<_>>());
    assert!(lrs[0] < lrs[1], "warmup: {lrs:?}");
    // A flag after --config overrides the file.
    let c = parse(&[
        "--config",
        Path::new(&out).with_extension("job.toml").to_str().unwrap(),
        "--layers",
        "3",
    ])
    .unwrap();
    assert!(c.job.unwrap().contains("layers = 3\n"));
}

/// The shape flags override the preset's fields, the summary says what was built, and the
/// parameter count computed from the shape (the MFU's N, the resume check's shapes) is the
/// built model's.
#[test]
fn shape_flags_build_the_model_they_say() {
    let dir = Scratch::new("shapes");
    let out = dir.s("curves");
    let common = [
        "--steps",
        "1",
        "--json",
        "--out",
        &out,
        "--mesh",
        "dp=2,tp=2",
    ];
    let with = |extra: &[&'static str]| {
        let mut v = common.to_vec();
        v.extend_from_slice(extra);
        ok(&v)
    };
    let s = with(&[
        "--layers",
        "2",
        "--heads",
        "8",
        "--width",
        "64",
        "--mlp-ratio",
        "2",
        "--vocab",
        "96",
        "--seq-len",
        "32",
        "--tied",
    ]);
    let m = &s["model"];
    assert_eq!(
        (
            &m["layers"],
            &m["heads"],
            &m["width"],
            &m["mlp_ratio"],
            &m["vocab"],
            &m["seq_len"],
            &m["tied"]
        ),
        (
            &2.into(),
            &8.into(),
            &64.into(),
            &2.into(),
            &96.into(),
            &32.into(),
            &true.into()
        ),
        "{m}"
    );
    // tok 96x64 + pos 32x64 + 2 blocks x (2 norms 256 + qkv 64x192+192 + proj 64x64+64
    // + fc1 64x128+128 + fc2 128x64+64) + ln_f 128; tied: no head.
    let block = 256 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64);
    let want = 96 * 64 + 32 * 64 + 2 * block + 128;
    assert_eq!(s["params"], want, "{s}");
    assert_eq!(m["params"], s["params"]);
    // Untied adds the head; the preset's other fields stay.
    let u = with(&["--untied", "--preset", "small", "--layers", "1"]);
    assert_eq!(u["model"]["width"], 384);
    assert_eq!(u["model"]["params"], u["params"], "{u}");
    // Mixture-of-experts blocks: every expert counts, top_k of them per token.
    let e = with(&[
        "--moe",
        "experts=4,top_k=1",
        "--mesh",
        "dp=2,ep=2",
        "--layers",
        "2",
    ]);
    assert_eq!(e["model"]["params"], e["params"], "{e}");
    let (total, active) = (
        e["model"]["params"].as_f64().unwrap(),
        e["model"]["active_params"].as_f64().unwrap(),
    );
    assert!(active < total * 0.75, "{active} of {total}");
    // The FLOPs per token: 6 N + 12 L T D.
    let f = with(&[
        "--layers",
        "2",
        "--width",
        "64",
        "--heads",
        "4",
        "--seq-len",
        "32",
    ]);
    let n = f["params"].as_f64().unwrap();
    assert_eq!(
        f["flops_per_token"].as_f64().unwrap(),
        6.0 * n + 12.0 * 2.0 * 32.0 * 64.0
    );
}

/// The optimizer flags reach AdamW: each changes the losses after the first step from the
/// defaults' (the betas from the third: Adam's first, bias-corrected update is `g / |g|`
/// whatever they are), and `--decay-params` picks which parameters decay.
#[test]
fn optimizer_flags_reach_adamw() {
    let dir = Scratch::new("optimizer");
    let out = dir.s("curves");
    let run = |extra: &[&str]| {
        let mut v = vec![
            "--mesh",
            "dp=2",
            "--steps",
            "3",
            "--seq-len",
            "32",
            "--json",
            "--out",
            &out,
        ];
        v.extend_from_slice(extra);
        floats(&ok(&v)["losses"])
    };
    let base = run(&["--weight-decay", "0.5"]);
    for flags in [
        &["--weight-decay", "0.5", "--decay-params", "all"][..],
        &["--weight-decay", "0.4"],
        &["--weight-decay", "0.5", "--beta1", "0.5"],
        &["--weight-decay", "0.5", "--beta2", "0.9"],
        &["--weight-decay", "0.5", "--eps", "1e-3"],
        &["--weight-decay", "0.5", "--lr", "2e-3"],
    ] {
        let l = run(flags);
        assert_eq!(
            l[0], base[0],
            "{flags:?}: the first loss is before any update"
        );
        assert_ne!(l[1..], base[1..], "{flags:?} did not change the updates");
    }
    // Embeddings decay with matrices+embeddings only (a large decay: the embeddings' updates
    // are small next to the norms').
    let m = run(&["--weight-decay", "100"]);
    let e = run(&[
        "--weight-decay",
        "100",
        "--decay-params",
        "matrices+embeddings",
    ]);
    assert_ne!(m[1..], e[1..], "matrices+embeddings decays like matrices");
}

/// The metrics log: one line per step of a 4-step run, finite and sane, the learning rate the
/// schedule's, the held-out loss on the steps it was measured after; `--log-every 2` logs
/// steps 0, 2, 4 (and the last); the SVG draws the rate.
#[test]
fn metrics_log_every_step_with_the_schedule() {
    let dir = Scratch::new("metrics");
    let out = dir.s("curves");
    let s = ok(&[
        "--mesh",
        "dp=2",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--lr-decay",
        "cosine",
        "--min-lr",
        "1e-4",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--peak-tflops",
        "1",
        "--json",
        "--out",
        &out,
    ]);
    let path = Path::new(&out).with_extension("metrics.jsonl");
    assert_eq!(s["metrics"], path.to_str().unwrap());
    let lines = metrics(&path);
    assert_eq!(lines.len(), 4, "{lines:?}");
    let sched = LrSchedule::new(1e-3, 2, Decay::Cosine, 4, 1e-4).unwrap();
    let losses = floats(&s["losses"]);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i, "{l}");
        assert_eq!(l["loss"].as_f64().unwrap(), losses[i], "{l}");
        assert_eq!(l["lr"].as_f64().unwrap(), sched.lr_at(i), "{l}");
        let g = l["grad_norm"].as_f64().unwrap();
        assert!(g.is_finite() && g > 0.0 && g < 1e3, "{l}");
        let tps = l["tokens_per_s"].as_f64().unwrap();
        assert!(tps.is_finite() && tps > 0.0, "{l}");
        let mfu = l["mfu"].as_f64().unwrap();
        assert!(mfu > 0.0 && mfu < 1.0, "{l}");
        let fpt = s["flops_per_token"].as_f64().unwrap();
        assert!((mfu - fpt * tps / (1e12 * 2.0)).abs() <= 1e-9 * mfu.abs().max(1e-30));
        let ms = l["step_ms"].as_f64().unwrap();
        let phases: f64 = ["forward_ms", "backward_ms", "optimizer_ms"]
            .iter()
            .map(|k| l[k].as_f64().unwrap())
            .inspect(|v| assert!(*v >= 0.0, "{l}"))
            .sum();
        assert!(phases <= ms * 1.001 + 1e-6 && ms > 0.0, "{l}");
        assert!(l["exposed_comm_ms"].as_f64().unwrap() >= 0.0, "{l}");
        assert!(l["peak_bytes"].as_u64().unwrap() > 0, "{l}");
        // Held out after 2 and 4 steps: on the lines of steps 1 and 3.
        assert_eq!(l["eval_loss"].is_null(), i % 2 == 0, "{l}");
    }
    let evals = s["eval_losses"].as_array().unwrap();
    assert_eq!(lines[3]["eval_loss"], evals[1][1]);
    // The rate is drawn (a third curve) when it changes.
    let svg = std::fs::read_to_string(Path::new(&out).with_extension("svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 3, "{svg}");
    assert!(svg.contains("learning rate"));
    // Every second step (and the last), and --metrics names the file; a constant rate is
    // text in the SVG, not a curve; no --peak-tflops: MFU null.
    let named = dir.s("named.jsonl");
    ok(&[
        "--mesh",
        "dp=2",
        "--steps",
        "6",
        "--log-every",
        "2",
        "--metrics",
        &named,
        "--json",
        "--out",
        &out,
    ]);
    let lines = metrics(Path::new(&named));
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 2, 4, 5]);
    assert!(lines[..3]
        .iter()
        .all(|l| l["grad_norm"].as_f64().unwrap() > 0.0));
    assert!(lines.iter().all(|l| l["mfu"].is_null() && l["lr"] == 1e-3));
    let svg = std::fs::read_to_string(Path::new(&out).with_extension("svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 1, "{svg}");
    assert!(
        svg.contains("learning rate: 1.000e-3 at every step"),
        "{svg}"
    );
    // --log-every 0: no metrics file.
    let none = dir.s("none");
    let s = ok(&[
        "--mesh",
        "dp=2",
        "--steps",
        "1",
        "--log-every",
        "0",
        "--json",
        "--out",
        &none,
    ]);
    assert!(s["metrics"].is_null());
    assert!(!Path::new(&none).with_extension("metrics.jsonl").exists());
}

/// A run stopped after 6 of 12 steps (`--schedule-steps 12`) and resumed with `--steps 12`
/// uses the learning rates of the uninterrupted 12-step run at every step, and ends with its
/// losses.
#[test]
fn a_resumed_run_continues_the_schedule_exactly() {
    let dir = Scratch::new("resume");
    let (ckpt, out) = (dir.s("ckpt"), dir.s("curves"));
    let common = [
        "--mesh",
        "dp=2",
        "--layers",
        "1",
        "--seq-len",
        "32",
        "--warmup",
        "3",
        "--lr-decay",
        "cosine",
        "--min-lr",
        "1e-4",
        "--json",
        "--out",
        &out,
    ];
    let with = |extra: &[&str]| {
        let mut v = common.to_vec();
        v.extend_from_slice(extra);
        ok(&v)
    };
    let whole = with(&["--steps", "12"]);
    let first = with(&[
        "--steps",
        "6",
        "--schedule-steps",
        "12",
        "--save-dir",
        &ckpt,
        "--save-every",
        "3",
    ]);
    let resumed = with(&["--steps", "12", "--save-dir", &ckpt, "--resume"]);
    assert_eq!(resumed["start_step"], 6);
    let (w, a, b) = (
        floats(&whole["lrs"]),
        floats(&first["lrs"]),
        floats(&resumed["lrs"]),
    );
    assert_eq!(a, w[..6], "the first part's rates");
    assert_eq!(b, w[6..], "the resumed part's rates");
    let sched = LrSchedule::new(1e-3, 3, Decay::Cosine, 12, 1e-4).unwrap();
    assert_eq!(w, (0..12).map(|i| sched.lr_at(i)).collect::<Vec<_>>());
    let (lw, lr) = (floats(&whole["losses"]), floats(&resumed["losses"]));
    for (x, y) in lr.iter().zip(&lw[6..]) {
        assert!((x - y).abs() <= 1e-4 * y.abs(), "{lr:?} vs {lw:?}");
    }
    // The metrics of the resumed run start at its first step.
    let lines = metrics(&Path::new(&out).with_extension("metrics.jsonl"));
    assert_eq!(lines[0]["step"], 6);
    assert_eq!(lines[0]["lr"].as_f64().unwrap(), w[6]);
}

/// Bad input in a job file: unknown and misspelt keys, keys in the wrong section, values of
/// the wrong type, named by key (and the closest known key).
#[test]
fn bad_job_files_name_the_key() {
    let dir = Scratch::new("badfiles");
    let out = dir.path("curves");
    let err = |text: &str| {
        let f = dir.file("bad.toml", text);
        refused(&["--config", f.to_str().unwrap()], &out)
    };
    let e = err("[optimizer]\nwieght-decay = 0.1\n");
    assert!(
        e.contains("unknown key `optimizer.wieght-decay`")
            && e.contains("did you mean `optimizer.weight-decay`"),
        "{e}"
    );
    let e = err("[lr_schedule]\nwarmpu = 10\n");
    assert!(e.contains("did you mean `lr_schedule.warmup`"), "{e}");
    let e = err("[optimizer]\nwarmup = 10\n");
    assert!(
        e.contains("`optimizer.warmup`") && e.contains("belongs in section [lr_schedule]"),
        "{e}"
    );
    let e = err("[model]\nlayers = \"four\"\n");
    assert!(
        e.contains("key `model.layers`") && e.contains("four"),
        "{e}"
    );
    let e = err("[model]\ntied = 1\n");
    assert!(
        e.contains("`model.tied`") && e.contains("true or false"),
        "{e}"
    );
    let e = err("[lr_schedule]\nmin-lr = true\n");
    assert!(e.contains("`lr_schedule.min-lr`"), "{e}");
    let e = err("[model]\nlayers = -2\n");
    assert!(e.contains("key `model.layers`"), "{e}");
    let e = err("[modle]\nlayers = 2\n");
    assert!(e.contains("unknown section `[modle]`"), "{e}");
}

/// Bad model shapes, optimizer settings and schedules: errors before training that name the
/// flag (or the model field), the value and the rule.
#[test]
fn bad_shapes_and_schedules_are_refused_before_training() {
    let dir = Scratch::new("badflags");
    let out = dir.path("curves");
    let o = out.to_str().unwrap();
    let err = |extra: &[&str]| {
        let mut v = vec!["--steps", "5", "--json", "--out", o];
        v.extend_from_slice(extra);
        refused(&v, &out)
    };
    let e = err(&["--width", "100", "--heads", "3", "--mesh", "tp=1"]);
    assert!(
        e.contains("--width 100")
            && e.contains("width 100 is not divisible by the 3 heads")
            && e.contains("rule: width % heads == 0"),
        "{e}"
    );
    let e = err(&[
        "--width",
        "96",
        "--heads",
        "3",
        "--mesh",
        "tp=2",
        "--no-fsdp",
    ]);
    assert!(
        e.contains("tp=2") && e.contains("3 attention heads") && e.contains("heads % tp == 0"),
        "{e}"
    );
    let e = err(&["--vocab", "511", "--mesh", "tp=2", "--no-fsdp"]);
    assert!(
        e.contains("vocabulary of 511") && e.contains("vocab % tp == 0"),
        "{e}"
    );
    let e = err(&["--layers", "0"]);
    assert!(e.contains("--layers 0") && e.contains("at least 1"), "{e}");
    let e = err(&["--seq-len", "0"]);
    assert!(e.contains("seq_len = 0") && e.contains("at least 1"), "{e}");
    let e = err(&["--warmup", "10"]);
    assert!(
        e.contains("--warmup 10")
            && e.contains("warmup of 10 steps exceeds the 5 steps")
            && e.contains("rule: warmup <= steps"),
        "{e}"
    );
    let e = err(&["--schedule-steps", "3"]);
    assert!(
        e.contains("--schedule-steps 3") && e.contains("--schedule-steps >= --steps"),
        "{e}"
    );
    let e = err(&["--lr-decay", "cosinus"]);
    assert!(e.contains("--lr-decay") && e.contains("cosinus"), "{e}");
    let e = err(&["--lr-decay", "cosine", "--min-lr", "0.01"]);
    assert!(e.contains("min_lr 0.01 exceeds the peak lr 0.001"), "{e}");
    let e = err(&["--decay-params", "norms"]);
    assert!(e.contains("--decay-params") && e.contains("norms"), "{e}");
    let e = err(&["--beta1", "1"]);
    assert!(
        e.contains("--beta1 1") && e.contains("0 <= beta < 1"),
        "{e}"
    );
    let e = err(&["--eps", "0"]);
    assert!(e.contains("--eps 0"), "{e}");
    let e = err(&["--weight-decay=-0.1"]);
    assert!(e.contains("--weight-decay -0.1"), "{e}");
    let e = err(&["--preset", "gpt3"]);
    assert!(e.contains("--preset") && e.contains("gpt2-medium"), "{e}");
    let e = err(&["--log-every", "0", "--metrics", "m.jsonl"]);
    assert!(
        e.contains("--metrics m.jsonl") && e.contains("--log-every"),
        "{e}"
    );
    // A vocabulary too small for the data.
    let input = dir.file("input.txt", &"some text. ".repeat(300));
    let e = err(&["--data", input.to_str().unwrap(), "--vocab", "100"]);
    assert!(
        e.contains("--vocab 100") && e.contains("data's vocabulary"),
        "{e}"
    );
}

/// `--resume` with another model shape than the checkpoint's is an error naming the flag and
/// both values before training (without the check: a different --layers failed inside the
/// ranks naming a checkpoint tensor, and a different --heads resumed silently); the same
/// shape resumes.
#[test]
fn resuming_another_model_shape_is_refused() {
    let dir = Scratch::new("reshape");
    let (ckpt, out) = (dir.s("ckpt"), dir.path("curves"));
    let o = out.to_str().unwrap();
    let base = [
        "--mesh",
        "dp=2",
        "--seq-len",
        "32",
        "--json",
        "--out",
        o,
        "--save-dir",
        &ckpt,
    ];
    let with = |extra: &[&'static str]| cat(&base, extra);
    ok(&with(&["--steps", "2"]));
    std::fs::remove_file(out.with_extension("csv")).unwrap();
    for (flags, needle) in [
        (
            &["--layers", "2"][..],
            "--layers: 1 in the checkpoint, 2 in this run",
        ),
        (
            &["--width", "128"],
            "--width: 256 in the checkpoint, 128 in this run",
        ),
        (
            &["--heads", "8"],
            "--heads: 4 in the checkpoint, 8 in this run",
        ),
        (
            &["--seq-len", "64"],
            "--seq-len: 32 in the checkpoint, 64 in this run",
        ),
        (
            &["--tied"],
            "--tied/--untied: untied in the checkpoint, tied in this run",
        ),
        (
            &["--mlp-ratio", "2"],
            "--mlp-ratio: 4 in the checkpoint, 2 in this run",
        ),
        (
            &["--vocab", "256"],
            "--vocab: 512 in the checkpoint, 256 in this run",
        ),
    ] {
        let mut v = with(&["--steps", "4", "--resume"]);
        v.extend_from_slice(flags);
        let e = refused(&v, &out);
        assert!(
            e.contains(needle) && e.contains("rule: a resumed run trains the checkpoint's model"),
            "{flags:?}: {e}"
        );
        assert!(e.contains("step 2"), "{e}");
    }
    // Nothing was trained or saved by the refused runs; the same shape resumes.
    let steps = candle_dtensor::train::checkpoint::complete_steps(Path::new(&ckpt)).unwrap();
    assert_eq!(steps, [2]);
    let s = ok(&with(&["--steps", "4", "--resume"]));
    assert_eq!(s["start_step"], 2);
}

/// `--ac` (issue 35, item 5): `full` and `selective` give the default's losses (FSDP x TP)
/// with less peak activation memory in the summary (`full` least); an unknown mode is
/// refused before training, naming the flag, the value and the choices.
#[test]
fn ac_flag_keeps_the_losses_and_cuts_activation_bytes() {
    let dir = Scratch::new("ac");
    let out = dir.path("curves");
    let o = out.to_str().unwrap();
    let run = |ac: &str| {
        let s = ok(&[
            "--mesh",
            "dp=2,tp=2",
            "--preset",
            "small",
            "--steps",
            "2",
            "--seq-len",
            "64",
            "--ac",
            ac,
            "--json",
            "--out",
            o,
        ]);
        assert_eq!(s["ac"], ac);
        let bytes = s["peak_activation_bytes"].as_u64().unwrap();
        (floats(&s["losses"]), bytes)
    };
    let (none, none_b) = run("none");
    for ac in ["full", "selective"] {
        let (l, b) = run(ac);
        assert_eq!(l, none, "--ac {ac}: losses");
        assert!(b < none_b, "--ac {ac}: {b} activation bytes, none {none_b}");
        if ac == "full" {
            assert!(3 * b <= none_b, "full {b}, none {none_b}");
        }
    }
    let bad = dir.path("refused");
    let b = bad.to_str().unwrap();
    let e = refused(
        &["--ac", "half", "--steps", "1", "--json", "--out", b],
        &bad,
    );
    assert!(
        e.contains("--ac") && e.contains("\"half\"") && e.contains("none, full, selective"),
        "{e}"
    );
}

/// `--mesh ..,cp=N` (issue 36): context parallelism over FSDP (dp=2 x cp=2) and TP (tp=2 x
/// cp=2, with and without sequence parallelism) matches the single-device model step by step (`--check`), with less activation
/// memory per rank than the same batch without cp at 1024 tokens (at 128 the copy of every
/// cp-replicated parameter that its gradient-sync node holds, a constant, outweighs the
/// halved activations); a sequence shorter than cp is refused
/// before training, naming the flags, the values and the rule.
#[test]
fn cp_mesh_matches_one_device_and_holds_less() {
    let dir = Scratch::new("cp");
    let out = dir.path("curves");
    let o = out.to_str().unwrap();
    let run = |mesh: &str, extra: &[&str]| {
        let s = ok(&cat(
            &[
                "--mesh",
                mesh,
                "--preset",
                "tiny",
                "--steps",
                "2",
                "--batch",
                "2",
                "--seq-len",
                "1024",
                "--json",
                "--out",
                o,
            ],
            extra,
        ));
        assert_eq!(s["mesh"], mesh);
        s
    };
    let base = run("dp=2", &[]);
    // With sequence parallelism the sequence is sharded over tp too: attention is planned by
    // the compiler (the ring needs cp to be the only dim sharding the sequence).
    let s = run("tp=2,cp=2", &["--check", "--sp", "--no-fsdp"]);
    assert_eq!(s["check_passed"], true, "tp=2,cp=2 --sp: {s}");
    for mesh in ["dp=2,cp=2", "tp=2,cp=2"] {
        let s = run(mesh, &["--check"]);
        assert_eq!(s["check_passed"], true, "{mesh}: {s}");
        if mesh == "dp=2,cp=2" {
            let (b, base_b) = (
                s["peak_activation_bytes"].as_u64().unwrap(),
                base["peak_activation_bytes"].as_u64().unwrap(),
            );
            assert!(
                b < base_b,
                "{mesh}: {b} activation bytes, dp=2 alone {base_b}"
            );
        }
    }
    let bad = dir.path("refused");
    let b = bad.to_str().unwrap();
    let e = refused(
        &[
            "--mesh",
            "cp=4",
            "--seq-len",
            "3",
            "--steps",
            "1",
            "--json",
            "--out",
            b,
        ],
        &bad,
    );
    assert!(
        e.contains("--mesh cp=4") && e.contains("--seq-len 3") && e.contains("seq-len >= cp"),
        "{e}"
    );
}
