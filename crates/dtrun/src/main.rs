//! `dtrun`: starts the ranks of a multi-process job on this host: the whole job, or one node
//! of a job across nodes (torchrun's static rendezvous).
//!
//! ```text
//! dtrun --nproc 4 [--master-port P] [--timeout S] [--grace S] [--max-restarts N] [--allow-failures K] [--insecure] -- CMD ARGS...
//! dtrun --nnodes N --node-rank R --nproc-per-node G --master-addr HOST --master-port P
//!       [--token-file PATH | CDT_JOB_TOKEN=...] [--rdzv-timeout S] [the flags above] -- CMD ARGS...
//! ```
//!
//! Across nodes (`--nnodes` > 1; `--nproc` is `--nproc-per-node` of a 1-node job), one dtrun
//! runs on each node with the same settings but its own `--node-rank`; its ranks get
//! `RANK = R * G + LOCAL_RANK`, `WORLD_SIZE = N * G`, `LOCAL_WORLD_SIZE = G`, `GROUP_RANK = R`,
//! `GROUP_WORLD_SIZE = N` and `MASTER_ADDR = HOST`. Node 0's dtrun hosts a control store on
//! port P of every interface, which all dtruns join; rank 0 (on node 0) hosts the ranks' store
//! at `HOST:MASTER_PORT`, a port node 0's dtrun picks per start. The nodes share the job token
//! (`CDT_JOB_TOKEN` or `--token-file`; without one a multi-node dtrun refuses to start, unless
//! `--insecure`), check each other's settings at join, and fail as one: a rank's failure on any
//! node stops every node's ranks, and every dtrun names the node and rank. `--max-restarts`
//! restarts every node together; `--allow-failures K` counts failures job-wide. How: the
//! `nodes` module's doc.
//!
//! Each rank runs `CMD ARGS...` with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR` and `MASTER_PORT` set (what torchrun sets; the `process` backend reads them),
//! `TORCHELASTIC_RESTART_COUNT` and `TORCHELASTIC_MAX_RESTARTS` (as torchrun does), and
//! `CDT_JOB_TOKEN`: a fresh random secret per start, which every connection of the `process`
//! backend's mesh must prove it holds (a process of another job, or anything else that reaches
//! the ports, is turned away), the rendezvous store included. `--insecure` runs the ranks
//! without a token instead (`CDT_INSECURE=1`: the store then serves other hosts
//! unauthenticated, and every rank warns).
//! Every line a rank prints is forwarded with a `[rank r] ` prefix (stdout to stdout, stderr
//! to stderr). When a rank exits non-zero or is killed, dtrun sends SIGTERM to the others,
//! SIGKILL after the grace period, and exits non-zero naming the rank that failed first and
//! how (exit status or signal). With `--allow-failures K` the first K failures are reported
//! and the others run on; the job's exit code is then the survivors'.
//! `RUST_LOG` (default `warn`) sets what dtrun's own `tracing` subscriber prints; the ranks
//! inherit it (the examples read it the same way, and prefix their lines with `rank=<r>`).
//!
//! # What dtrun guarantees about processes (Linux)
//!
//! - Each rank is the leader of its own process group; signals go to the whole group, so a
//!   rank's own children are stopped with it, and when a rank exits its group is SIGKILLed
//!   (nothing it spawned outlives it).
//! - dtrun exits only after every rank was reaped.
//! - SIGINT, SIGTERM or SIGHUP to dtrun: the ranks get SIGTERM, then SIGKILL after the grace
//!   period; dtrun exits with 128 + the signal number.
//! - SIGKILL to dtrun (which cannot be caught): every rank gets SIGKILL from the kernel
//!   (`PR_SET_PDEATHSIG`). Processes a rank started get it only if they are in that rank's
//!   group and die with it; a program that double-forks or starts a new session escapes, as
//!   under any launcher.
//! - `--timeout S` bounds the whole job (every start together): then the ranks are stopped as
//!   above and dtrun exits 124.
//! - `--max-restarts N`: when a rank fails, the job is stopped as above and started again (at
//!   most N times), with the same command and environment, a new store port (unless
//!   `--master-port` fixes it), a new token (across nodes: the shared one) and
//!   `TORCHELASTIC_RESTART_COUNT` one higher; the
//!   program resumes from its checkpoint if it can. A job stopped by a signal to dtrun or by
//!   `--timeout` is not restarted.
//!
//! Exit status: 0 when every rank exits 0; the first failed rank's exit code (128 + signal
//! when it was killed); 124 on `--timeout`; 2 for usage errors; 127 if a rank cannot start.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;

mod nodes;
use nodes::{Cluster, NodeError};
use std::str::FromStr;

/// Command line of dtrun.
#[derive(Parser, Debug)]
#[command(
    name = "dtrun",
    args_override_self = true,
    about = "Start the ranks of a multi-process candle-dtensor job on this host (one node of it)",
    after_help = "Example: dtrun --nproc 4 -- target/release/examples/train_gpt --backend process --mesh dp=2,tp=2"
)]
struct Args {
    /// Number of ranks (processes) to start on this node (`--nproc` is the same flag).
    #[arg(long = "nproc-per-node", visible_alias = "nproc", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nproc: u32,
    /// Number of nodes (hosts) of the job, each running one dtrun with the same settings
    /// but its own `--node-rank`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nnodes: u32,
    /// This node's index, 0..nnodes (node 0 hosts the control store; its rank 0 the ranks'
    /// store). Ranks get `RANK = node_rank * nproc_per_node + local rank`.
    #[arg(long, default_value_t = 0)]
    node_rank: u32,
    /// Address of node 0, reachable from every node (MASTER_ADDR). One node: the address
    /// of rank 0's rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// One node: port of the rendezvous store (MASTER_PORT); default: a free port. Several
    /// nodes (required): the port of node 0's control store, which every dtrun joins (the
    /// ranks' store gets a free port node 0 picks).
    #[arg(long)]
    master_port: Option<u16>,
    /// A file whose first line is the job token (instead of `CDT_JOB_TOKEN`): with several
    /// nodes, every node must hold the same one. One node: used instead of a fresh token.
    #[arg(long)]
    token_file: Option<std::path::PathBuf>,
    /// Several nodes: how long the nodes wait for each other at join (seconds).
    #[arg(long, default_value_t = 60.0)]
    rdzv_timeout: f64,
    /// Stop the job (exit 124) if it runs longer than this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 3.0)]
    grace: f64,
    /// Restart the whole job up to this many times when a rank fails (torchrun's
    /// `--max-restarts`).
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Let the other ranks run on when up to this many ranks fail (exit non-zero or are
    /// killed): the job's exit code is then the survivors' (0 when they all end well); one
    /// failure more stops the job as without it. For fault-tolerant training
    /// (`train_gpt --fault-tolerant`), whose survivors continue without the lost ranks.
    #[arg(long, default_value_t = 0)]
    allow_failures: u32,
    /// Run without a job token: the ranks get no `CDT_JOB_TOKEN` and `CDT_INSECURE=1`, so
    /// the rendezvous store serves other hosts unauthenticated and anything that reaches the
    /// ports can join the mesh or read and replace the store's keys (every rank warns). For
    /// jobs that processes not started by this dtrun must join; never on an untrusted network.
    #[arg(long)]
    insecure: bool,
    /// The program to run and its arguments (after `--`).
    #[arg(last = true, required = true, num_args = 1..)]
    cmd: Vec<String>,
}

/// The last signal dtrun received (0: none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    // Async-signal-safe: one atomic store.
    SIGNALLED.store(sig, Ordering::SeqCst);
}

#[cfg(unix)]
fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe; the
        // function pointer cast is the form `signal` expects.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

#[cfg(not(unix))]
fn install_signal_handlers() {}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => "signal",
    }
}

/// How a rank ended, in words, and the exit code dtrun passes on.
fn describe(status: &ExitStatus) -> (String, i32) {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return (
                format!("killed by signal {sig} ({})", signal_name(sig)),
                128 + sig,
            );
        }
    }
    match status.code() {
        Some(c) => (format!("exit status {c}"), c),
        None => ("ended abnormally".to_string(), 1),
    }
}

/// The signal that ended a process, if one did.
fn signal_of(status: &ExitStatus) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

/// Whether `status` is a death by a signal dtrun did not send: anything but SIGTERM, and
/// SIGKILL only before dtrun escalated to it (`stopping` = (deadline, SIGKILL sent)).
fn killed_from_outside(status: &ExitStatus, stopping: Option<(Instant, bool)>) -> bool {
    match signal_of(status) {
        None => false,
        Some(SIGTERM) => false,
        Some(SIGKILL) => !matches!(stopping, Some((_, true))),
        Some(_) => true,
    }
}

/// Sends `sig` to the process group led by `pid` (the rank and whatever it started).
#[cfg(unix)]
fn signal_group(pid: u32, sig: i32) {
    // SAFETY: `kill` has no memory-safety preconditions; a negative pid names a process group.
    unsafe {
        libc::kill(-(pid as libc::pid_t), sig);
    }
}

#[cfg(not(unix))]
fn signal_group(_pid: u32, _sig: i32) {}

#[cfg(unix)]
const SIGTERM: i32 = libc::SIGTERM;
#[cfg(unix)]
const SIGKILL: i32 = libc::SIGKILL;
#[cfg(not(unix))]
const SIGTERM: i32 = 15;
#[cfg(not(unix))]
const SIGKILL: i32 = 9;

/// Makes the child lead its own process group and die with dtrun.
#[cfg(unix)]
fn isolate(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only calls
    // async-signal-safe functions (setpgid, prctl, getppid, raise).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // dtrun may have died between fork and prctl.
                if libc::getppid() != parent {
                    libc::raise(libc::SIGKILL);
                }
            }
            let _ = parent;
            Ok(())
        });
    }
}

#[cfg(not(unix))]
fn isolate(_cmd: &mut Command) {}

/// Copies `src` line by line to stdout or stderr with the rank prefix.
fn forward(rank: usize, src: impl Read, to_stderr: bool) {
    let mut r = BufReader::new(src);
    let mut line = Vec::new();
    let prefix = format!("[rank {rank}] ");
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let mut buf = Vec::with_capacity(prefix.len() + line.len());
                buf.extend_from_slice(prefix.as_bytes());
                buf.extend_from_slice(&line);
                // One write under the lock: lines of different ranks never interleave. A closed
                // stdout (dtrun piped into `head`) must not stop us reaping the ranks.
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&buf)
                } else {
                    std::io::stdout().lock().write_all(&buf)
                };
            }
            Err(_) => return,
        }
    }
}

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "dtrun: {msg}");
}

fn free_port(addr: &str) -> Result<u16, String> {
    std::net::TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port on {addr}: {e}"))
}

enum Event {
    Exited(usize, ExitStatus),
    WaitFailed(usize, String),
    /// Another node stopped the job, with why.
    Remote(String),
    /// Node 0's dtrun (its control store) stopped answering, with why.
    ControlLost(String),
}

fn main() {
    init_logging();
    let args = Args::parse();
    std::process::exit(run(args));
}

/// A `tracing` subscriber (`RUST_LOG` if set, else `warn`; plain text on stderr): the control
/// store's warnings across nodes (a connection refused for a wrong token, an insecure store)
/// and dtrun's own (`RUST_LOG=dtrun=info` shows the rendezvous). `RUST_LOG` reaches the ranks
/// through their inherited environment either way. (dtrun's own messages are `dtrun: ...`
/// lines; the ranks' output, their warnings included, is forwarded with the `[rank r] ` prefix.)
fn init_logging() {
    use tracing_subscriber::filter::{EnvFilter, LevelFilter};
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::WARN.into())
        .from_env_lossy();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// The environment variable with the job's token (`candle_dtensor_comm::auth::TOKEN_ENV`).
const TOKEN_ENV: &str = "CDT_JOB_TOKEN";

/// The variable that lets a store without a token serve other hosts
/// (`candle_dtensor_comm::auth::INSECURE_ENV`).
const INSECURE_ENV: &str = "CDT_INSECURE";

/// A fresh random token (hex of 32 bytes from the OS).
fn new_token() -> Result<String, String> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| format!("no randomness for the job token: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// How one start of the job ended.
struct Ended {
    code: i32,
    /// A rank failed (not a signal to dtrun, not the job timeout, not a rank that could not
    /// start): the case `--max-restarts` restarts.
    rank_failed: bool,
}

/// Joins the other nodes (`--nnodes` > 1); `Ok(None)` on one node. `Err` is the exit code.
fn join_nodes(args: &Args) -> Result<(Option<Cluster>, Option<String>), i32> {
    let shared = match &args.token_file {
        Some(p) if args.nnodes == 1 && !args.insecure => match nodes::shared_token(Some(p)) {
            Ok(t) => Some(t),
            Err(e) => {
                say(&e.to_string());
                return Err(2);
            }
        },
        _ => None,
    };
    if args.nnodes == 1 {
        if args.node_rank != 0 {
            say(&format!(
                "--node-rank {} is out of range for --nnodes 1",
                args.node_rank
            ));
            return Err(2);
        }
        return Ok((None, shared));
    }
    let Some(port) = args.master_port else {
        say("--nnodes > 1 needs --master-port: the port of node 0's control store, the same on every node");
        return Err(2);
    };
    let token = if args.insecure {
        say("--insecure: the nodes and ranks run without a job token; anything that reaches the stores or the mesh ports can join the job or read and replace its keys");
        None
    } else {
        match nodes::shared_token(args.token_file.as_deref()) {
            Ok(t) => Some(t),
            Err(e) => {
                say(&format!("node {}: {e}", args.node_rank));
                return Err(2);
            }
        }
    };
    if args.node_rank >= args.nnodes {
        // Still join: node 0 names this node to every node.
        say(&format!(
            "node {}: --node-rank {} is out of range for --nnodes {}; joining to tell the other nodes",
            args.node_rank, args.node_rank, args.nnodes
        ));
    }
    if std::net::IpAddr::from_str(&args.master_addr).is_ok_and(|ip| ip.is_loopback()) {
        tracing::warn!(master_addr = %args.master_addr, "--nnodes > 1 with a loopback --master-addr: only nodes on this host can join");
    }
    let me = nodes::settings(args.node_rank, args.nnodes, args.nproc);
    let rdzv = Duration::from_secs_f64(args.rdzv_timeout.clamp(0.1, 86_400.0));
    match Cluster::join(
        &me,
        &args.master_addr,
        port,
        token.as_deref(),
        args.insecure,
        rdzv,
    ) {
        Ok(c) => {
            if args.node_rank >= args.nnodes {
                return Err(2);
            }
            Ok((Some(c), token))
        }
        Err(e) => {
            say(&format!("node {}: {e}", args.node_rank));
            Err(match e {
                NodeError::Config(_) => 2,
                NodeError::Rendezvous(_) => 1,
            })
        }
    }
}

fn run(args: Args) -> i32 {
    install_signal_handlers();
    let job_deadline = args
        .timeout
        .map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)));
    let (cluster, shared_token) = match join_nodes(&args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut restart = 0;
    let mut last_port = None;
    loop {
        let ended = run_once(
            &args,
            restart,
            job_deadline,
            &mut last_port,
            cluster.as_ref(),
            shared_token.as_deref(),
        );
        if ended.code == 0 || !ended.rank_failed || restart >= args.max_restarts {
            if restart > 0 {
                say(&format!(
                    "the job ended with code {} after {restart} restart(s)",
                    ended.code
                ));
            }
            return ended.code;
        }
        restart += 1;
        say(&format!(
            "restarting the job ({restart} of at most {} restarts)",
            args.max_restarts
        ));
    }
}

fn run_once(
    args: &Args,
    restart: u32,
    job_deadline: Option<Instant>,
    last_port: &mut Option<u16>,
    cluster: Option<&Cluster>,
    shared_token: Option<&str>,
) -> Ended {
    let failed_to_start = |code| Ended {
        code,
        rank_failed: false,
    };
    let n = args.nproc as usize;
    // This node's first global rank, and the world.
    let (rank0, world) = match cluster {
        Some(c) => (c.node_rank as usize * n, c.nnodes as usize * n),
        None => (0, n),
    };
    // A rank in messages: its global rank, with the node and local rank across nodes.
    let name = |r: usize| match cluster {
        Some(c) => format!("node {} rank {} (local rank {r})", c.node_rank, rank0 + r),
        None => format!("rank {r}"),
    };
    let token = if let Some(t) = shared_token {
        Some(t.to_string())
    } else if args.insecure {
        if cluster.is_none() {
            say("--insecure: the ranks run without a job token; anything that reaches the store or the mesh ports can join the job or read and replace its keys");
        }
        None
    } else {
        match new_token() {
            Ok(t) => Some(t),
            Err(e) => {
                say(&e);
                return failed_to_start(2);
            }
        }
    };
    // A restart gets another port than the start before it (the kernel may hand the one
    // just released out again; a straggler of the failed start must not reach the new
    // store): a few tries, then whatever it gives.
    let prev = *last_port;
    let pick = || {
        (0..8)
            .map(|_| free_port(&args.master_addr))
            .find(|p| p.as_ref().map_or(true, |p| Some(*p) != prev))
            .unwrap_or_else(|| free_port(&args.master_addr))
    };
    let port = match (cluster, args.master_port) {
        (Some(c), _) => {
            let rdzv = Duration::from_secs_f64(args.rdzv_timeout.clamp(0.1, 86_400.0));
            match c.world_port(restart, pick, rdzv) {
                Ok(p) => p,
                Err(e) => {
                    say(&format!("node {}: {e}", c.node_rank));
                    return failed_to_start(1);
                }
            }
        }
        (None, Some(p)) => p,
        (None, None) => match pick() {
            Ok(p) => p,
            Err(e) => {
                say(&e);
                return failed_to_start(2);
            }
        },
    };
    *last_port = Some(port);
    let grace = Duration::from_secs_f64(args.grace.max(0.0));
    let (tx, rx) = mpsc::channel::<Event>();
    let mut pids: Vec<u32> = Vec::with_capacity(n);
    let mut outputs = Vec::new();
    let mut spawn_error = None;
    for rank in 0..n {
        let mut cmd = Command::new(&args.cmd[0]);
        cmd.args(&args.cmd[1..])
            .env("RANK", (rank0 + rank).to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", cluster.map_or(0, |c| c.node_rank).to_string())
            .env(
                "GROUP_WORLD_SIZE",
                cluster.map_or(1, |c| c.nnodes).to_string(),
            )
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", args.max_restarts.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match &token {
            Some(t) => cmd.env(TOKEN_ENV, t).env_remove(INSECURE_ENV),
            None => cmd.env_remove(TOKEN_ENV).env(INSECURE_ENV, "1"),
        };
        isolate(&mut cmd);
        let mut child: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                spawn_error = Some(format!(
                    "cannot start {} ({}): {e}",
                    name(rank),
                    args.cmd[0]
                ));
                break;
            }
        };
        pids.push(child.id());
        let global = rank0 + rank;
        if let Some(out) = child.stdout.take() {
            outputs.push(std::thread::spawn(move || forward(global, out, false)));
        }
        if let Some(err) = child.stderr.take() {
            outputs.push(std::thread::spawn(move || forward(global, err, true)));
        }
        let tx = tx.clone();
        let pid = child.id();
        std::thread::spawn(move || {
            let ev = match child.wait() {
                Ok(st) => {
                    // Whatever the rank started dies with it.
                    signal_group(pid, SIGKILL);
                    Event::Exited(rank, st)
                }
                Err(e) => Event::WaitFailed(rank, e.to_string()),
            };
            let _ = tx.send(ev);
        });
    }
    let _watcher = cluster.map(|c| c.watch(restart, tx.clone(), Event::Remote, Event::ControlLost));
    drop(tx);
    // Tells the other nodes why this node stops the job.
    let post = |killed: bool, code: i32, what: String| {
        if let Some(c) = cluster {
            c.post_failure(
                restart,
                &nodes::Report {
                    killed,
                    code,
                    what,
                    seq: 0,
                },
            );
        }
    };
    // Why another node stopped the job, if it did.
    let mut remote_stop: Option<String> = None;
    // Node 0's dtrun is gone: there is no one to record this node's end with.
    let mut control_lost = false;

    let started = pids.len();
    let mut exited = vec![false; started];
    let mut statuses: Vec<Option<String>> = vec![None; started];
    let mut first_failure: Option<(usize, String, i32)> = None;
    // Whether the first failure was a plain non-zero exit (not a signal).
    let mut first_failure_was_exit = false;
    // Ranks whose failure --allow-failures let the others run on after.
    let mut tolerated: Vec<usize> = Vec::new();
    let mut code = 0;
    let mut stopping: Option<(Instant, bool)> = None; // (SIGKILL deadline, SIGKILL sent)
    let stop = |pids: &[u32], exited: &[bool], sig: i32| {
        for (r, &pid) in pids.iter().enumerate() {
            if !exited[r] {
                signal_group(pid, sig);
            }
        }
    };
    if let Some(e) = spawn_error {
        say(&e);
        post(false, 127, e);
        code = 127;
        stop(&pids, &exited, SIGTERM);
        stopping = Some((Instant::now() + grace, false));
    }
    let mut remaining = started;
    while remaining > 0 {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(Event::Exited(rank, st)) => {
                remaining -= 1;
                exited[rank] = true;
                let (what, c) = describe(&st);
                statuses[rank] = Some(what.clone());
                let failed_now = !st.success() && first_failure.is_none() && stopping.is_none();
                let tolerate = failed_now
                    && args.allow_failures > 0
                    && match cluster {
                        // Counted job-wide, across the nodes.
                        Some(c) => c
                            .count_failure(restart)
                            .is_ok_and(|k| k <= i64::from(args.allow_failures)),
                        None => tolerated.len() < args.allow_failures as usize,
                    };
                if tolerate {
                    tolerated.push(rank);
                    let others = exited.iter().filter(|e| !**e).count();
                    say(&format!(
                        "{} (pid {}) failed: {what}; failure {} of at most {} allowed \
                         (--allow-failures{}): the other {others} rank(s) run on",
                        name(rank),
                        pids[rank],
                        tolerated.len(),
                        args.allow_failures,
                        if cluster.is_some() {
                            ", this node's count"
                        } else {
                            ""
                        }
                    ));
                } else if failed_now {
                    let others = exited.iter().filter(|e| !**e).count();
                    say(&format!(
                        "{} (pid {}) failed: {what}; stopping the other {others} rank(s)",
                        name(rank),
                        pids[rank]
                    ));
                    post(
                        killed_from_outside(&st, None),
                        if c == 0 { 1 } else { c },
                        format!("{} failed: {what}", name(rank)),
                    );
                    first_failure = Some((rank, what, c));
                    stop(&pids, &exited, SIGTERM);
                    stopping = Some((Instant::now() + grace, false));
                } else if killed_from_outside(&st, stopping)
                    && (first_failure_was_exit || first_failure.is_none())
                {
                    // Peers of a killed rank exit with an error naming it within milliseconds,
                    // and their exits can be reaped first, on this node or on another (whose
                    // stop then reaches this node before the death does). A death by a signal
                    // dtrun has not sent yet (SIGTERM is dtrun's; SIGKILL only after the grace
                    // period) is the cause, not a consequence: report it as the first failure.
                    say(&format!(
                        "{} (pid {}) was {what} (not by dtrun): the likely cause",
                        name(rank),
                        pids[rank]
                    ));
                    post(true, c, format!("{} failed: {what}", name(rank)));
                    first_failure = Some((rank, what, c));
                }
                if first_failure.as_ref().is_some_and(|f| f.0 == rank) {
                    first_failure_was_exit = signal_of(&st).is_none();
                }
            }
            Ok(Event::WaitFailed(rank, e)) => {
                remaining -= 1;
                exited[rank] = true;
                statuses[rank] = Some(format!("could not be waited for: {e}"));
                if first_failure.is_none() {
                    first_failure = Some((rank, format!("could not be waited for: {e}"), 1));
                }
            }
            Ok(ev @ (Event::Remote(_) | Event::ControlLost(_))) => {
                let (why, lost) = match ev {
                    Event::ControlLost(why) => (why, true),
                    Event::Remote(why) => (why, false),
                    _ => (String::new(), false),
                };
                control_lost |= lost;
                if stopping.is_none() && remote_stop.is_none() {
                    say(&format!(
                        "node {}: the job is stopping: {why}; stopping this node's {remaining} rank(s)",
                        cluster.map_or(0, |c| c.node_rank)
                    ));
                    stop(&pids, &exited, SIGTERM);
                    stopping = Some((Instant::now() + grace, false));
                }
                remote_stop.get_or_insert(why);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let sig = SIGNALLED.swap(0, Ordering::SeqCst);
        if sig != 0 && code == 0 {
            say(&format!(
                "received {}; stopping {remaining} rank(s)",
                signal_name(sig)
            ));
            code = 128 + sig;
            post(
                false,
                code,
                format!(
                    "node {}'s dtrun received {}",
                    cluster.map_or(0, |c| c.node_rank),
                    signal_name(sig)
                ),
            );
            stop(&pids, &exited, SIGTERM);
            stopping.get_or_insert((Instant::now() + grace, false));
        }
        if let Some(d) = job_deadline {
            if Instant::now() >= d && stopping.is_none() && code == 0 {
                let running: Vec<usize> = (0..started).filter(|&r| !exited[r]).collect();
                say(&format!(
                    "timed out after {:.1}s; ranks {running:?} still running; stopping them",
                    args.timeout.unwrap_or(0.0)
                ));
                code = 124;
                post(
                    false,
                    code,
                    format!(
                        "node {} reached --timeout",
                        cluster.map_or(0, |c| c.node_rank)
                    ),
                );
                stop(&pids, &exited, SIGTERM);
                stopping = Some((Instant::now() + grace, false));
            }
        }
        if let Some((kill_at, false)) = stopping {
            if Instant::now() >= kill_at {
                stop(&pids, &exited, SIGKILL);
                stopping = Some((kill_at, true));
            }
        }
    }
    // The output threads end when the ranks' pipes close; do not wait forever for a stray
    // process that inherited one.
    let t0 = Instant::now();
    for h in outputs {
        while !h.is_finished() && t0.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
    if !tolerated.is_empty() && first_failure.is_none() && code == 0 {
        say(&format!(
            "ranks {tolerated:?} failed (allowed by --allow-failures {}); the other ranks ended well: {}",
            args.allow_failures,
            statuses
                .iter()
                .enumerate()
                .map(|(r, s)| format!("rank {r}: {}", s.as_deref().unwrap_or("unknown")))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let rank_failed = first_failure.is_some() && code == 0;
    let node = cluster.map(|c| format!("node {}: ", c.node_rank));
    if let Some((rank, what, c)) = first_failure {
        let others: Vec<String> = statuses
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != rank)
            .map(|(r, s)| format!("rank {}: {}", rank0 + r, s.as_deref().unwrap_or("unknown")))
            .collect();
        say(&format!(
            "{}{} failed first ({what}); {}",
            node.as_deref().unwrap_or("job failed: "),
            name(rank),
            others.join(", ")
        ));
        if code == 0 {
            code = if c == 0 { 1 } else { c };
        }
    }
    let Some(c) = cluster else {
        return Ended { code, rank_failed };
    };
    drop(_watcher);
    if control_lost {
        say(&format!(
            "node {}: job failed: {}",
            c.node_rank,
            remote_stop.as_deref().unwrap_or("lost node 0's dtrun")
        ));
        return Ended {
            code: if code == 0 { 1 } else { code },
            rank_failed: false,
        };
    }
    let mine = nodes::NodeEnd {
        code,
        // A node stopped for another node's failure, or that ended well, does not stand in the
        // way of a restart; one stopped by a signal or by --timeout does.
        restartable: rank_failed || code == 0,
    };
    match c.finish(restart, &mine, job_deadline) {
        Ok((ends, mut reports)) => {
            let failed = ends.iter().any(|e| e.code != 0) || !reports.is_empty();
            if !failed {
                return Ended {
                    code: 0,
                    rank_failed: false,
                };
            }
            // The likely cause first: a rank killed by a signal nobody sent, then the order
            // in which the nodes reported.
            reports.sort_by_key(|(_, r)| (!r.killed, r.seq));
            let job_code = reports
                .first()
                .map(|(_, r)| r.code)
                .or_else(|| ends.iter().map(|e| e.code).find(|&c| c != 0))
                .filter(|&c| c != 0)
                .unwrap_or(1);
            let text: Vec<String> = reports.iter().map(|(_, r)| r.what.clone()).collect();
            say(&format!(
                "job failed on {} node(s): {}{}",
                ends.iter().filter(|e| e.code != 0).count().max(1),
                text.first().map_or("(no node said why)", |s| s.as_str()),
                if text.len() > 1 {
                    format!(" (first); then: {}", text[1..].join("; "))
                } else {
                    String::new()
                }
            ));
            Ended {
                code: job_code,
                rank_failed: ends.iter().all(|e| e.restartable),
            }
        }
        Err(e) => {
            say(&format!("node {}: {e}", c.node_rank));
            Ended {
                code: if code == 0 { 1 } else { code },
                rank_failed: false,
            }
        }
    }
}
