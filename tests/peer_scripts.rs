//! The checks of the GPU benchmark's Python driver and report (`scripts/peers/test_gpu_bench.py`,
//! standard library only: a fake train_gpt, attn_bench and python stand in for the real ones),
//! run with the workspace's tests so that a change to either script is held to them.
mod common;

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_gpu_benchmark_driver_and_report_pass_their_checks() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = common::Scratch::new("peer_scripts");
    let log = dir.0.join("test_gpu_bench.log");
    let out = File::create(&log).expect("creates the log");
    let err = out.try_clone().expect("shares the log");
    let mut child = Command::new("python3")
        .arg(format!("{root}/scripts/peers/test_gpu_bench.py"))
        .current_dir(root)
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("python3 runs (the checks need only its standard library)");
    // Bounded: the checks take a few seconds (one of them waits out a 3 s timeout).
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().expect("waits on python3") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("scripts/peers/test_gpu_bench.py ran past 300 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "scripts/peers/test_gpu_bench.py failed:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}
