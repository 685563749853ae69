//! Logs a user sees: the examples' subscriber (examples/common/logging.rs, which every
//! example's `main` installs) puts the library's warnings on stderr, `RUST_LOG` (default
//! `warn`) chooses which, and each line names the rank.
//!
//! - `an_insecure_job_warns_on_every_rank`: `dtrun --insecure` over ranks that install it (this
//!   test binary, as in tests/process_backend.rs): the store's and the world's "insecure"
//!   warnings and the missing job token's reach dtrun's stderr, on every rank, with the rank;
//!   `RUST_LOG=error` silences them and the job still works.
//! - the other tests build the subscriber in-process, writing to a buffer: the default level,
//!   `RUST_LOG` and the rank label; and (in a child process) which variables the rank is read
//!   from.
#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../../../examples/common/logging.rs"]
mod logging;

use std::io::Write;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{Device, Tensor};
use candle_dtensor_comm::{new_comm, CommOptions, ReduceOp};

const ROLE: &str = "CDT_LOG_ROLE";

/// The ranks' side: install the examples' subscriber, form the world, one all-reduce (role
/// `insecure`); or print what `rank_from_env` reads (role `rank`).
#[test]
fn worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return; // not launched by a test below
    };
    if role == "rank" {
        println!("rank: {:?}", logging::rank_from_env());
        std::process::exit(0);
    }
    assert_eq!(role, "insecure", "unknown role");
    logging::init_logging();
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(10))
        .with_bootstrap_timeout(Duration::from_secs(10));
    let code = match (|| -> Result<f64, Box<dyn std::error::Error>> {
        let world = new_comm("process", &Device::Cpu, "world", opts)?;
        let x = Tensor::new(&[world.rank() as f64 + 0.5], &Device::Cpu)?;
        Ok(world
            .all_reduce(&x, ReduceOp::Sum)?
            .wait()?
            .to_vec1::<f64>()?[0])
    })() {
        Ok(s) => {
            println!("sum {s}");
            0
        }
        Err(e) => {
            eprintln!("worker error: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// `dtrun --nproc 2 --insecure` over the worker with `RUST_LOG` as given (`None`: unset).
fn insecure_job(rust_log: Option<&str>) -> (Output, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dtrun"));
    cmd.args([
        "--nproc",
        "2",
        "--timeout",
        "60",
        "--grace",
        "5",
        "--insecure",
    ])
    .arg("--")
    .arg(std::env::current_exe().expect("test binary path"))
    .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
    .env(ROLE, "insecure")
    .env("RUST_BACKTRACE", "0");
    match rust_log {
        Some(l) => cmd.env("RUST_LOG", l),
        None => cmd.env_remove("RUST_LOG"),
    };
    let o = cmd.output().expect("dtrun runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, out, err)
}

/// Whether rank `r` printed the all-reduce's sum (after libtest's "test worker ... ").
fn summed(out: &str, r: usize) -> bool {
    let p = format!("[rank {r}] ");
    out.lines()
        .any(|l| l.starts_with(&p) && l.ends_with("sum 2"))
}

#[test]
fn an_insecure_job_warns_on_every_rank() {
    let (o, out, err) = insecure_job(None);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    for r in 0..2 {
        // dtrun's prefix, then the subscriber's line: time, rank, level, target, message.
        let warned = err.lines().any(|l| {
            l.starts_with(&format!("[rank {r}] "))
                && l.contains(&format!(
                    " rank={r}  WARN candle_dtensor_comm_core::store::world: "
                ))
                && l.contains("CDT_INSECURE is set")
        });
        assert!(warned, "rank {r} did not warn about CDT_INSECURE:\n{err}");
        let no_token = err.lines().any(|l| {
            l.starts_with(&format!("[rank {r}] "))
                && l.contains(" WARN candle_dtensor_comm_core::auth: CDT_JOB_TOKEN is not set")
        });
        assert!(
            no_token,
            "rank {r} did not warn about the job token:\n{err}"
        );
        assert!(summed(&out, r), "{out}");
    }
    let served = err.lines().any(|l| {
        l.starts_with("[rank 0] ")
            && l.contains(" WARN candle_dtensor_comm_core::store::server: store server is insecure")
    });
    assert!(served, "rank 0's store did not warn:\n{err}");

    let (o, out, err) = insecure_job(Some("error"));
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        !err.contains("WARN"),
        "RUST_LOG=error printed a warning:\n{err}"
    );
    assert!(!err.contains("CDT_INSECURE is set"), "{err}");
    for r in 0..2 {
        assert!(summed(&out, r), "{out}");
    }
}

/// A writer the subscriber can write to and the test can read.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the examples' subscriber, built with `spec` and `rank`, prints for one event of each
/// level (target `cdt_log_test`).
fn logged(spec: &str, rank: Option<&str>) -> String {
    let buf = Buf::default();
    let w = buf.clone();
    let sub = logging::subscriber(spec, rank, move || w.clone());
    tracing::subscriber::with_default(sub, || {
        tracing::error!(target: "cdt_log_test", "an error");
        tracing::warn!(target: "cdt_log_test", peer = "10.0.0.2:1234", "a warning");
        tracing::info!(target: "cdt_log_test", "some info");
        tracing::debug!(target: "cdt_log_test", "a debug line");
    });
    let v = buf.0.lock().unwrap().clone();
    String::from_utf8(v).unwrap()
}

#[test]
fn warn_by_default_with_target_and_rank() {
    let s = logged("", Some("3"));
    assert!(
        s.contains(" rank=3  WARN cdt_log_test: a warning peer=\"10.0.0.2:1234\""),
        "{s}"
    );
    assert!(s.contains(" rank=3 ERROR cdt_log_test: an error"), "{s}");
    assert!(
        !s.contains("some info") && !s.contains("a debug line"),
        "{s}"
    );
    assert!(!s.contains('\x1b'), "colours in {s:?}");
    assert_eq!(s.lines().count(), 2, "{s}");
}

#[test]
fn rust_log_chooses_the_level() {
    let s = logged("error", None);
    assert!(s.contains("ERROR cdt_log_test: an error"), "{s}");
    assert!(!s.contains("a warning"), "{s}");
    assert!(!s.contains("rank="), "no rank, no label: {s}");

    let s = logged("debug", Some("0"));
    for m in ["an error", "a warning", "some info", "a debug line"] {
        assert!(s.contains(m), "{m} missing: {s}");
    }

    // A target of its own turns the others off; an invalid directive is ignored.
    let s = logged("cdt_log_test=info,not a directive", None);
    assert!(
        s.contains("some info") && !s.contains("a debug line"),
        "{s}"
    );
    let s = logged("other_crate=debug", None);
    assert!(s.is_empty(), "{s}");
}

/// `rank_from_env` in a child process (this binary's worker) with these variables set and the
/// other rank variables unset.
fn rank_with(set: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
    cmd.args(["worker", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "rank");
    for v in logging::RANK_VARS {
        cmd.env_remove(v);
    }
    for (k, v) in set {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("the worker runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}");
    // libtest's "test worker ... " comes first on the line.
    let line = out
        .lines()
        .find_map(|l| l.split_once("rank: ").map(|(_, r)| r));
    line.unwrap_or_else(|| panic!("no rank line: {out}"))
        .to_string()
}

#[test]
fn the_rank_comes_from_the_launchers_variables() {
    assert_eq!(rank_with(&[]), "None");
    assert_eq!(
        rank_with(&[("RANK", "2"), ("SLURM_PROCID", "5")]),
        "Some(\"2\")"
    );
    assert_eq!(rank_with(&[("SLURM_PROCID", "5")]), "Some(\"5\")");
    assert_eq!(rank_with(&[("OMPI_COMM_WORLD_RANK", "7")]), "Some(\"7\")");
    // Not a number: the next variable that holds one.
    assert_eq!(
        rank_with(&[("RANK", "x"), ("PMI_RANK", "1")]),
        "Some(\"1\")"
    );
}
