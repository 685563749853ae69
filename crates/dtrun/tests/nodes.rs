//! dtrun across nodes, with both "nodes" on this host (loopback): the ranks' environment, a
//! failure on one node stopping the other, and bad input refused on every node.
//! (scripts/ci_nodes.sh runs the same across two network namespaces, with train_gpt.)

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One node's dtrun: `--nnodes nnodes --node-rank rank` plus `extra`, running `sh -c script`.
fn node(port: u16, nnodes: u32, rank: u32, extra: &[&str], token: &str, script: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_dtrun"))
        .args([
            "--nnodes",
            &nnodes.to_string(),
            "--node-rank",
            &rank.to_string(),
        ])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .args(["--timeout", "60", "--rdzv-timeout", "10"])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .env("CDT_JOB_TOKEN", token)
        .env_remove("CDT_INSECURE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dtrun starts")
}

fn finish(c: Child) -> (Output, String, String) {
    let o = c.wait_with_output().expect("dtrun ends");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, out, err)
}

#[test]
fn two_nodes_give_their_ranks_the_global_environment() {
    let port = free_port();
    let script = "echo R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK GW=$GROUP_WORLD_SIZE M=$MASTER_ADDR T=${#CDT_JOB_TOKEN}";
    let n0 = node(port, 2, 0, &["--nproc-per-node", "2"], TOKEN, script);
    let n1 = node(port, 2, 1, &["--nproc-per-node", "2"], TOKEN, script);
    let (o0, out0, err0) = finish(n0);
    let (o1, out1, err1) = finish(n1);
    assert!(o0.status.success(), "node 0: {err0}");
    assert!(o1.status.success(), "node 1: {err1}");
    for (r, out) in [(0, &out0), (1, &out0), (2, &out1), (3, &out1)] {
        let want = format!(
            "[rank {r}] R={r} W=4 L={} LW=2 G={} GW=2 M=127.0.0.1 T={}",
            r % 2,
            r / 2,
            TOKEN.len()
        );
        assert!(out.contains(&want), "no {want:?} in {out}");
    }
}

#[test]
fn a_rank_killed_on_node_1_stops_node_0_naming_node_and_rank() {
    let port = free_port();
    let script = "if [ \"$RANK\" = 3 ]; then sleep 1; kill -9 $$; fi; exec sleep 30";
    let t0 = Instant::now();
    let n0 = node(port, 2, 0, &["--nproc-per-node", "2"], TOKEN, script);
    let n1 = node(port, 2, 1, &["--nproc-per-node", "2"], TOKEN, script);
    let (o0, _, err0) = finish(n0);
    let (o1, _, err1) = finish(n1);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "took {took:?}: {err0}\n{err1}"
    );
    for (o, err) in [(&o0, &err0), (&o1, &err1)] {
        assert_eq!(o.status.code(), Some(137), "{err}");
        assert!(
            err.contains("job failed on")
                && err.contains("node 1 rank 3 (local rank 1) failed: killed by signal 9"),
            "{err}"
        );
    }
    assert!(err0.contains("the job is stopping"), "{err0}");
}

#[test]
fn nodes_that_disagree_or_are_out_of_range_fail_on_every_node() {
    // --nproc-per-node differs.
    let port = free_port();
    let n0 = node(port, 2, 0, &["--nproc-per-node", "2"], TOKEN, "true");
    let n1 = node(port, 2, 1, &["--nproc-per-node", "3"], TOKEN, "true");
    for (o, _, err) in [finish(n0), finish(n1)] {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("the nodes disagree on --nproc-per-node")
                && err.contains("has 2")
                && err.contains("has 3"),
            "{err}"
        );
    }
    // --node-rank out of range.
    let port = free_port();
    let n0 = node(port, 2, 0, &["--nproc-per-node", "1"], TOKEN, "true");
    let n1 = node(port, 2, 2, &["--nproc-per-node", "1"], TOKEN, "true");
    for (o, _, err) in [finish(n0), finish(n1)] {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("--node-rank 2 is out of range for --nnodes 2"),
            "{err}"
        );
    }
    // Another token: node 1 is refused at once, node 0 gives up at --rdzv-timeout.
    let port = free_port();
    let n0 = node(port, 2, 0, &["--rdzv-timeout", "3"], TOKEN, "true");
    let n1 = node(
        port,
        2,
        1,
        &["--rdzv-timeout", "3"],
        "fedcba9876543210fedcba9876543210",
        "true",
    );
    let (o1, _, err1) = finish(n1);
    let (o0, _, err0) = finish(n0);
    assert_eq!(o1.status.code(), Some(2), "{err1}");
    assert!(err1.contains("refused this node's job token"), "{err1}");
    assert_ne!(o0.status.code(), Some(0), "{err0}");
    assert!(err0.contains("only 1 of 2 nodes"), "{err0}");
}

#[test]
fn a_multi_node_job_without_a_token_or_port_does_not_start() {
    let o = Command::new(env!("CARGO_BIN_EXE_dtrun"))
        .args(["--nnodes", "2", "--node-rank", "1", "--master-port", "1"])
        .args(["--", "true"])
        .env_remove("CDT_JOB_TOKEN")
        .output()
        .expect("dtrun runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("needs a job token"), "{err}");
    let o = Command::new(env!("CARGO_BIN_EXE_dtrun"))
        .args(["--nnodes", "2", "--", "true"])
        .output()
        .expect("dtrun runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("needs --master-port"), "{err}");
}

/// SIGKILLs node `victim`'s dtrun two seconds in; the other dtrun must stop its ranks and fail
/// within `within`, saying `says`.
fn kill_a_dtrun(victim: u32, within: Duration, says: &str) {
    let port = free_port();
    let n0 = node(
        port,
        2,
        0,
        &["--nproc-per-node", "1"],
        TOKEN,
        "exec sleep 60",
    );
    let n1 = node(
        port,
        2,
        1,
        &["--nproc-per-node", "1"],
        TOKEN,
        "exec sleep 60",
    );
    std::thread::sleep(Duration::from_secs(2));
    let t0 = Instant::now();
    let (mut dead, other) = if victim == 0 { (n0, n1) } else { (n1, n0) };
    dead.kill().expect("SIGKILL");
    let _ = dead.wait();
    let (o, _, err) = finish(other);
    let took = t0.elapsed();
    assert!(took < within, "took {took:?}: {err}");
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(err.contains(says), "{err}");
}

#[test]
fn a_lost_node_0_dtrun_stops_node_1() {
    kill_a_dtrun(0, Duration::from_secs(20), "lost node 0's dtrun");
}

#[test]
fn a_lost_node_1_dtrun_stops_node_0_after_the_heartbeat_timeout() {
    kill_a_dtrun(
        1,
        Duration::from_secs(25),
        "node 1's dtrun stopped answering",
    );
}
