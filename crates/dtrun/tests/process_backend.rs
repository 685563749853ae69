//! Multi-process tests: the `process` backend with one rank per process, started by `dtrun`.
//!
//! The ranks are this very test binary: `dtrun -- <this binary> worker --exact` runs only the
//! `worker` test, which reads its role from `CDT_MP_ROLE` (and does nothing without it, so a
//! plain `cargo test` run passes it by). No other binary has to be built first, so
//! `cargo test -p dtrun --test process_backend` works on its own.
//!
//! - `conformance_*`: the backend-neutral suite (collectives x dtypes x sizes, splits) on
//!   2 and 4 processes;
//! - `kill_9_*`: a rank SIGKILLed mid-collective; every other rank fails promptly naming it,
//!   and dtrun names it;
//! - `a_rank_that_never_starts_*`: the bootstrap timeout names it;
//! - `an_unreachable_store_*`: a clear error, fast;
//! - `dtrun_*`: exit codes, prefixes, the job timeout.
//!
//! Everything runs on 127.0.0.1 with timeouts of a few seconds; dtrun's own `--timeout` bounds
//! every launch.
// The ranks talk to the test through their output, which dtrun prefixes and forwards.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::conformance::{run as conform, Selection};
use candle_dtensor_comm::{new_comm, CommError, CommOptions, ReduceOp};

const ROLE: &str = "CDT_MP_ROLE";

/// Runs `n` copies of this binary's `worker` test under dtrun with `role`.
fn launch(n: usize, role: &str, dtrun_args: &[&str]) -> (Output, Duration) {
    let exe = std::env::current_exe().expect("test binary path");
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_dtrun"))
        .args(["--nproc", &n.to_string(), "--timeout", "60", "--grace", "5"])
        .args(dtrun_args)
        .arg("--")
        .arg(exe)
        .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("dtrun runs");
    (out, t0.elapsed())
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The lines rank `r` printed (dtrun prefixes them).
fn lines_of(s: &str, r: usize) -> Vec<&str> {
    let p = format!("[rank {r}] ");
    s.lines()
        .filter_map(|l| l.strip_prefix(p.as_str()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The ranks' side.
// ---------------------------------------------------------------------------------------------

#[test]
fn worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return; // not launched by one of the tests below
    };
    let code = match run_role(&role) {
        Ok(()) => 0,
        Err((code, msg)) => {
            eprintln!("worker error: {msg}");
            code
        }
    };
    std::process::exit(code);
}

fn opts(op_s: f64, boot_s: f64) -> CommOptions {
    CommOptions::default()
        .with_timeout(Duration::from_secs_f64(op_s))
        .with_bootstrap_timeout(Duration::from_secs_f64(boot_s))
}

fn env_rank() -> usize {
    std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// dtrun stops the other ranks (SIGTERM) once one fails; the fault tests ignore that so they
/// see every rank end on its own, with its own error (dtrun's SIGKILL after the grace period
/// still bounds them).
fn ignore_sigterm() {
    // SAFETY: ignoring a signal has no memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
}

fn run_role(role: &str) -> Result<(), (i32, String)> {
    let fail = |code: i32| move |e: CommError| (code, e.to_string());
    match role {
        "conformance" => {
            // Long timeouts, which nothing that passes waits out: the suite bounds its "fails
            // fast" checks relative to them, so load cannot fail them. The split a rank never
            // joins waits out the bootstrap timeout, so it runs on a communicator of its own
            // with a short one (under the op timeout: it must end before the verdict's op).
            const REJECTING: &str = "split::rank_rejecting_its_list";
            let world =
                new_comm("process", &Device::Cpu, "world", opts(30.0, 30.0)).map_err(fail(1))?;
            let sel = Selection::only(&["collectives", "split"]).excluding(&[REJECTING]);
            let report = conform(&world, &sel).map_err(|e| (1, e.to_string()))?;
            if world.rank() == 0 {
                println!("{report}");
            }
            let quick =
                new_comm("process", &Device::Cpu, "quick", opts(10.0, 2.0)).map_err(fail(1))?;
            conform(&quick, &Selection::only(&[REJECTING])).map_err(|e| (1, e.to_string()))?;
            Ok(())
        }
        "kill" => {
            ignore_sigterm();
            let world =
                new_comm("process", &Device::Cpu, "world", opts(60.0, 10.0)).map_err(fail(1))?;
            let me = world.rank();
            if me == 2 {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    // SAFETY: kill/getpid have no memory-safety preconditions.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                });
            }
            let x =
                Tensor::ones(1 << 20, DType::F32, &Device::Cpu).map_err(|e| (1, e.to_string()))?;
            let t0 = Instant::now();
            for i in 0..100_000 {
                if let Err(e) = world.all_reduce(&x, ReduceOp::Sum).and_then(|w| w.wait()) {
                    let took = t0.elapsed();
                    println!("rank {me} failed at iteration {i} after {took:?}");
                    return Err((3, e.to_string()));
                }
            }
            Err((1, "the loop ended without noticing the kill".into()))
        }
        "skip" => {
            let n: usize = std::env::var("WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            if env_rank() == n - 1 {
                return Ok(()); // never starts its communicator
            }
            ignore_sigterm();
            match new_comm("process", &Device::Cpu, "world", opts(60.0, 1.5)) {
                Ok(_) => Err((1, "bootstrap succeeded without the last rank".into())),
                Err(e) => Err((4, e.to_string())),
            }
        }
        "unreachable" => match new_comm("process", &Device::Cpu, "world", opts(60.0, 1.0)) {
            Ok(_) => Err((1, "connected to a store that does not exist".into())),
            Err(e @ CommError::Bootstrap { .. }) => Err((5, e.to_string())),
            Err(e) => Err((1, format!("wrong error kind: {e}"))),
        },
        "exit7" => {
            println!("hello from rank {}", env_rank());
            if env_rank() == 1 {
                std::thread::sleep(Duration::from_millis(200));
                return Err((7, "rank 1 gives up".into()));
            }
            std::thread::sleep(Duration::from_secs(30));
            Ok(())
        }
        "insecure" => {
            // Under `dtrun --insecure`: no token, CDT_INSECURE=1, and the job still works (on
            // this host the store serves loopback either way).
            println!(
                "token {:?} insecure {:?}",
                std::env::var("CDT_JOB_TOKEN").ok(),
                std::env::var("CDT_INSECURE").ok()
            );
            let world =
                new_comm("process", &Device::Cpu, "world", opts(10.0, 5.0)).map_err(fail(1))?;
            let x = Tensor::new(&[world.rank() as f64 + 0.5], &Device::Cpu)
                .map_err(|e| (1, e.to_string()))?;
            let s = world
                .all_reduce(&x, ReduceOp::Sum)
                .and_then(|w| w.wait())
                .map_err(fail(3))?
                .to_vec1::<f64>()
                .map_err(|e| (1, e.to_string()))?[0];
            println!("insecure sum {s}");
            Ok(())
        }
        "restart" => {
            // First start: rank 1 SIGKILLs itself after one collective, the others fail on the
            // next one. The restarted job (a new store port, a new token) completes.
            let count = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
            let token = std::env::var("CDT_JOB_TOKEN").unwrap_or_default();
            let world =
                new_comm("process", &Device::Cpu, "world", opts(10.0, 5.0)).map_err(fail(1))?;
            let me = world.rank();
            let x =
                Tensor::new(&[me as f64 + 0.5], &Device::Cpu).map_err(|e| (1, e.to_string()))?;
            for step in 0..2 {
                let s = world
                    .all_reduce(&x, ReduceOp::Sum)
                    .and_then(|w| w.wait())
                    .map_err(fail(3))?
                    .to_vec1::<f64>()
                    .map_err(|e| (1, e.to_string()))?[0];
                println!(
                    "start {count} step {step} sum {s} port {} token {}",
                    std::env::var("MASTER_PORT").unwrap_or_default(),
                    &token[..token.len().min(8)]
                );
                if count == "0" && me == 1 {
                    // SAFETY: kill/getpid have no memory-safety preconditions.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            }
            Ok(())
        }
        "survive" => {
            // Rank 1 SIGKILLs itself; the others finish after it and end well.
            if env_rank() == 1 {
                std::thread::sleep(Duration::from_millis(200));
                // SAFETY: kill/getpid have no memory-safety preconditions.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(1200));
            println!("rank {} ran on", env_rank());
            Ok(())
        }
        "twofail" => {
            // Ranks 1 and 2 fail one after the other; rank 0 would run for 30 s.
            match env_rank() {
                1 => {
                    std::thread::sleep(Duration::from_millis(200));
                    Err((7, "rank 1 gives up".into()))
                }
                2 => {
                    std::thread::sleep(Duration::from_millis(600));
                    Err((8, "rank 2 gives up".into()))
                }
                _ => {
                    std::thread::sleep(Duration::from_secs(30));
                    Ok(())
                }
            }
        }
        "sleep" => {
            std::thread::sleep(Duration::from_secs(30));
            Ok(())
        }
        other => Err((2, format!("unknown role {other}"))),
    }
}

// ---------------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------------

#[test]
fn conformance_collectives_and_splits_on_2_and_4_processes() {
    for n in [2, 4] {
        let (o, took) = launch(n, "conformance", &[]);
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "{n} processes: {}\n{out}\n{err}",
            o.status
        );
        let summary = lines_of(&out, 0)
            .into_iter()
            .find_map(|l| l.find("conformance backend \"process\"").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("no summary from rank 0:\n{out}\n{err}"));
        assert!(
            summary.contains(&format!("{n} ranks")) && summary.contains(" 0 failed"),
            "{summary}"
        );
        eprintln!("{n} processes: {summary} (launch took {took:?})");
    }
}

#[test]
fn kill_9_of_a_rank_mid_collective_fails_every_peer_promptly_naming_it() {
    let (o, took) = launch(4, "kill", &[]);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}\n{err}");
    assert_eq!(
        o.status.code(),
        Some(128 + 9),
        "dtrun passes on the SIGKILL\n{err}"
    );
    // Op timeout 60 s: ending in a third of it means the loss was detected, not timed out,
    // and leaves load (four processes starting on a small machine) a wide margin.
    assert!(took < Duration::from_secs(20), "took {took:?}\n{err}");
    assert!(
        err.contains("dtrun: rank 2 (pid") && err.contains("killed by signal 9 (SIGKILL)"),
        "dtrun must name rank 2 and the signal:\n{err}"
    );
    assert!(err.contains("rank 2 failed first"), "{err}");
    for r in [0, 1, 3] {
        let msgs = lines_of(&err, r).join("\n");
        assert!(
            msgs.contains("worker error: all_reduce (comm \"world\", rank")
                && msgs.contains("peer rank 2 was lost"),
            "rank {r} must fail its op naming rank 2:\n{msgs}\n--- all:\n{err}"
        );
        assert!(
            err.contains(&format!("rank {r}: exit status 3")),
            "rank {r} ends on its own:\n{err}"
        );
    }
}

#[test]
fn a_rank_that_never_starts_is_named_by_the_bootstrap_timeout() {
    let (o, took) = launch(4, "skip", &[]);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}\n{err}");
    // After the 1.5 s bootstrap timeout, not the 60 s op timeout (a third of it: a wide margin
    // for load).
    assert!(took < Duration::from_secs(20), "took {took:?}\n{err}");
    for r in 0..3 {
        let msgs = lines_of(&err, r).join("\n");
        // Rank 0 hosts the store and may give up first: the others then name rank 3 while
        // reporting the store's end.
        assert!(
            msgs.contains("waiting for ranks [3]")
                && (msgs.contains("new_comm (comm \"world\", rank")
                    || msgs.contains("bootstrap of comm \"world\"")),
            "rank {r} must name rank 3:\n{msgs}\n--- all:\n{err}"
        );
    }
    assert!(err.contains("rank 3: exit status 0"), "{err}");
}

#[test]
fn an_unreachable_store_is_a_clear_error_not_a_hang() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let t0 = Instant::now();
    let o = Command::new(std::env::current_exe().expect("test binary"))
        .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "unreachable")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .output()
        .expect("runs");
    let took = t0.elapsed();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(5), "{out}\n{err}");
    // After the 1 s store timeout, not the 60 s op timeout (a third of it: a wide margin for
    // load).
    assert!(took < Duration::from_secs(20), "{took:?}");
    let want = format!("store at 127.0.0.1:{port} unreachable after 1s");
    assert!(
        err.contains(&want) && err.contains("bootstrap of comm \"world\""),
        "{err}"
    );
}

#[test]
fn dtrun_prefixes_lines_stops_the_others_and_passes_on_the_exit_code() {
    let (o, took) = launch(3, "exit7", &["--grace", "1"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(7), "{out}\n{err}");
    // The others were stopped, not left to end their 30 s (half of it: a wide margin for load).
    assert!(took < Duration::from_secs(15), "{took:?}");
    for r in 0..3 {
        let hello = format!("hello from rank {r}");
        assert!(
            lines_of(&out, r).iter().any(|l| l.contains(&hello)),
            "rank {r}'s stdout is prefixed:\n{out}"
        );
    }
    assert!(
        lines_of(&err, 1)
            .iter()
            .any(|l| l.contains("rank 1 gives up")),
        "{err}"
    );
    assert!(
        err.contains("dtrun: rank 1 (pid") && err.contains("exit status 7"),
        "{err}"
    );
    assert!(
        err.contains("rank 0: killed by signal 15 (SIGTERM)"),
        "{err}"
    );
}

#[test]
fn dtrun_max_restarts_restarts_a_failed_job_with_a_new_port_and_token() {
    let (o, _) = launch(3, "restart", &["--max-restarts", "2", "--grace", "1"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        err.contains("restarting the job (1 of at most 2 restarts)"),
        "{err}"
    );
    assert!(
        !err.contains("(2 of at most"),
        "one restart was enough: {err}"
    );
    let field = |l: &str, k: &str| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.iter().position(|x| *x == k).map(|i| w[i + 1].to_string())
    };
    // What each rank printed, without libtest's "test worker ... " prefix.
    let printed: Vec<Vec<&str>> = (0..3)
        .map(|r| {
            lines_of(&out, r)
                .into_iter()
                .filter_map(|l| l.find("start ").map(|i| &l[i..]))
                .collect()
        })
        .collect();
    let of = |r: usize, start: &str, k: &str| {
        printed[r]
            .iter()
            .find(|l| l.starts_with(&format!("start {start} ")))
            .and_then(|l| field(l, k))
    };
    // The first start: rank 1 printed its step 0 and then killed itself, so its line is there;
    // the others may have been stopped between their step-0 all_reduce and their print.
    let (p0, t0) = (of(1, "0", "port"), of(1, "0", "token"));
    assert!(
        p0.is_some() && t0.as_ref().is_some_and(|t| t.len() == 8),
        "{out}"
    );
    for r in [0, 2] {
        if let Some(p) = of(r, "0", "port") {
            assert_eq!(Some(p), p0, "rank {r}: one store port per start: {out}");
            assert_eq!(
                of(r, "0", "token"),
                t0,
                "rank {r}: one token per start: {out}"
            );
        }
    }
    for (r, lines) in printed.iter().enumerate() {
        // Every rank completed both steps of the second start, with the right sum.
        for step in 0..2 {
            assert!(
                lines
                    .iter()
                    .any(|l| l.starts_with(&format!("start 1 step {step} sum 4.5 "))),
                "rank {r}:\n{out}"
            );
        }
        let (p1, t1) = (of(r, "1", "port"), of(r, "1", "token"));
        assert!(
            p1.is_some() && p1 != p0,
            "rank {r}: a new store port: {out}"
        );
        assert!(
            t1.as_ref().is_some_and(|t| t.len() == 8) && t1 != t0,
            "rank {r}: a new token: {out}"
        );
        assert_eq!(
            (&p1, &t1),
            (&of(0, "1", "port"), &of(0, "1", "token")),
            "rank {r}: one port and token per start: {out}"
        );
    }
}

/// `--insecure`: the ranks get no token and `CDT_INSECURE=1`, dtrun says so, and the job
/// runs; without it every rank has a token and no `CDT_INSECURE`, even when dtrun's own
/// environment sets it.
#[test]
fn dtrun_insecure_runs_the_ranks_without_a_token() {
    let (o, _) = launch(2, "insecure", &["--insecure"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        err.contains("--insecure: the ranks run without a job token"),
        "{err}"
    );
    for r in 0..2 {
        let lines = lines_of(&out, r).join("\n");
        assert!(
            lines.contains("token None insecure Some(\"1\")"),
            "rank {r}: {out}"
        );
        assert!(lines.contains("insecure sum 2"), "rank {r}: {out}");
    }
    let exe = std::env::current_exe().expect("test binary path");
    let o = Command::new(env!("CARGO_BIN_EXE_dtrun"))
        .args(["--nproc", "2", "--timeout", "60", "--"])
        .arg(exe)
        .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "insecure")
        .env("CDT_INSECURE", "1")
        .output()
        .expect("dtrun runs");
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    for r in 0..2 {
        let lines = lines_of(&out, r).join("\n");
        assert!(
            lines.contains("token Some(") && lines.contains("insecure None"),
            "rank {r}: {out}"
        );
    }
}

#[test]
fn dtrun_max_restarts_gives_up_after_n_restarts() {
    let (o, _) = launch(2, "exit7", &["--max-restarts", "1", "--grace", "1"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(7), "{err}");
    assert!(
        err.contains("restarting the job (1 of at most 1 restarts)"),
        "{err}"
    );
    assert!(
        err.contains("ended with code 7 after 1 restart(s)"),
        "{err}"
    );
}

#[test]
fn dtrun_timeout_stops_the_job() {
    let (o, took) = launch(2, "sleep", &["--timeout", "1", "--grace", "1"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(124), "{err}");
    // Stopped at the 1 s job timeout, not left to end their 30 s (half of it: a wide margin for
    // load).
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(
        err.contains("timed out after 1.0s; ranks [0, 1] still running"),
        "{err}"
    );
}

#[test]
fn dtrun_without_a_command_is_a_usage_error() {
    let o = Command::new(env!("CARGO_BIN_EXE_dtrun"))
        .args(["--nproc", "2"])
        .output()
        .expect("runs");
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn dtrun_allow_failures_lets_the_others_run_on_and_exits_with_theirs() {
    let (o, _) = launch(3, "survive", &["--allow-failures", "1", "--grace", "1"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        err.contains("rank 1") && err.contains("failure 1 of at most 1 allowed"),
        "{err}"
    );
    for r in [0, 2] {
        let ran_on = format!("rank {r} ran on");
        assert!(
            lines_of(&out, r).iter().any(|l| l.ends_with(&ran_on)),
            "{out}"
        );
    }
}

#[test]
fn dtrun_allow_failures_stops_the_job_at_one_failure_more() {
    let (o, took) = launch(3, "twofail", &["--allow-failures", "1", "--grace", "1"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(8), "{err}");
    // Rank 0 was stopped, not left to end its 30 s (half of it: a wide margin for load).
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(err.contains("failure 1 of at most 1 allowed"), "{err}");
    assert!(err.contains("rank 2 (pid"), "{err}");
    assert!(err.contains("job failed: rank 2 failed first"), "{err}");
}
