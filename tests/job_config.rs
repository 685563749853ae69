//! Job files (examples/common/job.rs) on a small command of the same kinds of flags as
//! train_gpt's: the file read, the command line overriding it, the resolved job round-tripping,
//! and every kind of bad input named by key.
#[path = "../examples/common/job.rs"]
#[allow(dead_code)]
mod job;

mod common;

use common::Scratch;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::{CommandFactory, Parser};
use job::{JobError, Sections};

#[derive(Parser, Debug, Clone, PartialEq)]
struct Args {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    print_config: bool,
    #[arg(long, default_value = "dp=2,tp=2")]
    mesh: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long)]
    clip: Option<f64>,
    #[arg(long, overrides_with = "no_fsdp")]
    fsdp: bool,
    #[arg(long, overrides_with = "fsdp")]
    no_fsdp: bool,
    #[arg(long)]
    sp: bool,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    link: Vec<String>,
}

const SECTIONS: Sections = &[
    ("model", &["layers"]),
    ("optimizer", &["lr", "clip"]),
    ("training", &["batch"]),
    ("parallelism", &["mesh", "fsdp", "no-fsdp", "sp", "link"]),
];

fn argv(args: &[&str]) -> Vec<OsString> {
    std::iter::once("prog")
        .chain(args.iter().copied())
        .map(OsString::from)
        .collect()
}

fn parse(args: &[&str]) -> Result<Args, JobError> {
    job::parse::<Args>(SECTIONS, argv(args)).map(|(a, _)| a)
}

#[test]
fn every_flag_has_a_key() {
    let (missing, stray) = job::coverage(&Args::command(), SECTIONS);
    assert!(missing.is_empty(), "flags without a section: {missing:?}");
    assert!(stray.is_empty(), "listed but not flags: {stray:?}");
    // And the check can fail.
    let (missing, stray) = job::coverage(&Args::command(), &[("model", &["layers", "depth"])]);
    assert!(missing.contains(&"batch".to_string()));
    assert_eq!(stray, ["model.depth"]);
}

#[test]
fn the_file_is_read_and_flags_override_it() {
    let s = Scratch::new("override");
    let f = s.file(
        "job.toml",
        "[model]\nlayers = 6\n[optimizer]\nlr = 3e-4\nclip = 1\n[training]\nbatch = 32\n\
         [parallelism]\nmesh = \"dp=4\"\nno-fsdp = true\nsp = false\nlink = [\"dp=ib\", \"tp=nvlink\"]\n",
    );
    let f = f.to_str().unwrap();
    let a = parse(&["--config", f]).unwrap();
    assert_eq!(a.layers, Some(6));
    assert_eq!(a.lr, 3e-4);
    assert_eq!(a.clip, Some(1.0));
    assert_eq!(a.batch, 32);
    assert_eq!(a.mesh, "dp=4");
    assert!(a.no_fsdp && !a.fsdp && !a.sp);
    assert_eq!(a.link, ["dp=ib", "tp=nvlink"]);
    // The command line wins, wherever --config stands.
    let b = parse(&["--batch", "4", "--config", f, "--lr=1e-2", "--fsdp"]).unwrap();
    assert_eq!((b.batch, b.lr, b.layers), (4, 1e-2, Some(6)));
    assert!(b.fsdp && !b.no_fsdp, "--fsdp overrides the file's no-fsdp");
    // No file: plain flags.
    assert_eq!(parse(&["--batch", "2"]).unwrap().batch, 2);
}

#[test]
fn the_resolved_job_round_trips() {
    let s = Scratch::new("roundtrip");
    let f = s.file("job.toml", "[model]\nlayers = 3\n[training]\nbatch = 5\n");
    let argv1 = argv(&[
        "--config",
        f.to_str().unwrap(),
        "--lr",
        "0.02",
        "--no-fsdp",
        "--mesh",
        "tp=4",
        "--link",
        "tp=2us:5GBps",
    ]);
    let (a, m) = job::parse::<Args>(SECTIONS, argv1).unwrap();
    let text = job::resolved(&Args::command(), SECTIONS, &m);
    assert!(text.contains("[model]\nlayers = 3\n"), "{text}");
    assert!(text.contains("# clip = (not set)"), "{text}");
    assert!(text.contains("mesh = \"tp=4\""), "{text}");
    let g = s.file("resolved.toml", &text);
    let (b, m2) = job::parse::<Args>(SECTIONS, argv(&["--config", g.to_str().unwrap()])).unwrap();
    assert_eq!(
        Args {
            config: None,
            ..b.clone()
        },
        Args { config: None, ..a }
    );
    // Printing the re-read job gives the same text: a fixed point.
    assert_eq!(job::resolved(&Args::command(), SECTIONS, &m2), text);
}

#[test]
fn bad_files_name_the_key() {
    let s = Scratch::new("bad");
    let err = |text: &str| -> String {
        let f = s.file("bad.toml", text);
        parse(&["--config", f.to_str().unwrap()])
            .unwrap_err()
            .to_string()
    };
    let e = err("[optimizer]\nrl = 1e-3\n");
    assert!(
        e.contains("unknown key `optimizer.rl`") && e.contains("did you mean `optimizer.lr`"),
        "{e}"
    );
    let e = err("[training]\nbath = 8\n");
    assert!(e.contains("did you mean `training.batch`"), "{e}");
    let e = err("[model]\nbatch = 8\n");
    assert!(
        e.contains("`model.batch`") && e.contains("belongs in section [training]"),
        "{e}"
    );
    let e = err("batch = 8\n");
    assert!(e.contains("belongs in section [training]"), "{e}");
    let e = err("[optimiser]\nlr = 1e-3\n");
    assert!(e.contains("unknown section `[optimiser]`"), "{e}");
    let e = err("[training]\nbatch = \"eight\"\n");
    assert!(
        e.contains("key `training.batch`") && e.contains("eight"),
        "{e}"
    );
    let e = err("[training]\nbatch = -3\n");
    assert!(e.contains("key `training.batch`"), "{e}");
    let e = err("[parallelism]\nsp = \"yes\"\n");
    assert!(
        e.contains("`parallelism.sp`") && e.contains("true or false"),
        "{e}"
    );
    let e = err("[optimizer]\nlr = true\n");
    assert!(
        e.contains("`optimizer.lr`") && e.contains("only switches"),
        "{e}"
    );
    let e = err("[optimizer\nlr = 1\n");
    assert!(e.contains("not a valid TOML file"), "{e}");
    let missing = s.0.join("nope.toml");
    let e = parse(&["--config", missing.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.toml"), "{e}");
    // A bad value on the command line is clap's own error, not blamed on the file.
    let f = s.file("ok.toml", "[training]\nbatch = 8\n");
    let e = parse(&["--config", f.to_str().unwrap(), "--lr", "fast"])
        .unwrap_err()
        .to_string();
    assert!(!e.contains("ok.toml") && e.contains("fast"), "{e}");
}
