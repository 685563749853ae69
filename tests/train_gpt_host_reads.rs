//! `train_gpt --json` counts the device-to-host reads of every step on rank 0
//! (`host_reads_per_step`, issue 33 item 4): each is a host synchronisation on a GPU. Exactly
//! one per step where the trainer reads only the loss, the gradient norm riding along
//! (clipping included: the norm and the clip factor stay on the device), FSDP's
//! gradient-presence flags of every unit riding along too; one more for the MoE balancing loss,
//! and two per MoE layer (its expert ids and the gathered expert counts: the routing is
//! planned on the host). Tiny preset (one block: three FSDP units, one MoE layer), 3 steps on
//! the CPU.
#[path = "../examples/train_gpt.rs"]
#[allow(dead_code)]
mod train_gpt;

mod common;

use common::Scratch;
use std::ffi::OsString;

/// `real_main` sizes the gemm threads through a process environment variable: one run at a
/// time.
static RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn reads(out: &Scratch, extra: &[&str]) -> Vec<u64> {
    let prefix = out.0.join("run");
    let args: Vec<OsString> = ["train_gpt", "--steps", "3", "--json", "--timeout", "120"]
        .iter()
        .copied()
        .chain(["--out", prefix.to_str().unwrap()])
        .chain(extra.iter().copied())
        .map(OsString::from)
        .collect();
    let a = train_gpt::parse_args(args).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    let summary = match train_gpt::real_main(&a) {
        Ok(Some(s)) => s,
        Ok(None) => panic!("{extra:?}: no summary"),
        Err(e) => panic!("{extra:?}: {e}"),
    };
    summary["host_reads_per_step"]
        .as_array()
        .unwrap_or_else(|| panic!("{extra:?}: no host_reads_per_step in {summary}"))
        .iter()
        .map(|v| v.as_u64().expect("a count"))
        .collect()
}

#[test]
fn one_host_read_per_step_with_or_without_fsdp_and_the_moe_reads_counted() {
    let out = Scratch::new("host_reads");
    for (extra, want) in [
        (&["--mesh", "tp=1", "--no-fsdp"][..], 1),
        (&["--mesh", "tp=1", "--no-fsdp", "--clip", "0.5"][..], 1),
        (&["--mesh", "tp=2", "--no-fsdp", "--clip", "0.5"][..], 1),
        (&["--mesh", "dp=2", "--clip", "0.5"][..], 1),
        (&["--mesh", "dp=2,tp=2"][..], 1),
        (&["--mesh", "replicate=2,shard=2", "--hsdp"][..], 1),
        (
            &["--mesh", "ep=2", "--no-fsdp", "--moe", "experts=4,top_k=2"][..],
            1 + 1 + 2,
        ),
    ] {
        assert_eq!(reads(&out, extra), vec![want; 3], "{extra:?}");
    }
}

/// The GPU-side counters of issue 33 item 4 on the CPU: no GPU phase times and no kernel
/// counting (which refuses the CPU before training, by name), never made-up figures.
#[test]
fn gpu_counters_are_absent_or_refused_on_the_cpu() {
    let out = Scratch::new("gpu_counters");
    let prefix = out.0.join("run");
    let args = |extra: &[&str]| -> Vec<OsString> {
        [
            "train_gpt",
            "--steps",
            "3",
            "--json",
            "--mesh",
            "tp=1",
            "--no-fsdp",
        ]
        .iter()
        .copied()
        .chain(["--out", prefix.to_str().unwrap()])
        .chain(extra.iter().copied())
        .map(OsString::from)
        .collect()
    };
    let _one = RUN.lock().unwrap_or_else(|e| e.into_inner());
    let a = train_gpt::parse_args(args(&["--count-kernels"])).expect("the flag parses");
    match train_gpt::real_main(&a) {
        Err(train_gpt::Failure::Error(e)) => assert!(
            e.contains("--count-kernels needs --device cuda"),
            "unexpected error: {e}"
        ),
        Err(train_gpt::Failure::Check(c)) => panic!("a check failure: {c:?}"),
        Ok(s) => panic!("--count-kernels ran on the CPU: {s:?}"),
    }
    let a = train_gpt::parse_args(args(&[])).expect("parses");
    let s = train_gpt::real_main(&a)
        .expect("trains")
        .expect("a summary");
    assert!(s.get("gpu_phases").is_none(), "GPU times on the CPU: {s}");
    assert_eq!(
        s["phase_split"],
        serde_json::json!(["forward", "backward", "optimizer"]),
        "{s}"
    );
    assert!(
        s.get("kernels").is_none(),
        "a kernel count without the flag: {s}"
    );
    assert!(s["final_loss"].as_f64().is_some_and(f64::is_finite), "{s}");
}
