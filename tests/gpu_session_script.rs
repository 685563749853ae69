//! scripts/gpu_session.sh, the one-command GPU run, brings back what the device tool can
//! return (at most 8 files of at most 16 MiB each, no deeper than 2 folders under $OUT)
//! whatever its two scripts do, on a machine without a GPU: the script is copied into a
//! scratch tree beside fake `gpu_check.sh` and `gpu_bench.sh` (which write what the real
//! ones write: their JSON, a table, many logs, one log too large to come back) and a
//! tarball of fake binaries, which it must unpack first. Also: a check script that hangs is
//! cut at its budget's outer limit and the benchmark still runs; the text is unpacked from
//! its `.xz`.
#![cfg(unix)]

mod common;

use common::Scratch;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn script(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, format!("#!/bin/bash\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The fake gpu_check.sh: its JSON and per-step logs into $CDT_GPU_LOG_DIR (`FAKE_CHECK=hang`:
/// it never ends).
const CHECK: &str = r#"[ "${FAKE_CHECK:-}" = hang ] && exec sleep 600
[ -x target/gpu/bin/train_gpt ] || { echo "no binaries" >&2; exit 1; }
d="$CDT_GPU_LOG_DIR"; mkdir -p "$d"
for i in $(seq 1 20); do echo "step $i log" > "$d/step_$i.log"; done
echo '{"gpu":"Fake GPU","seconds":12,"budget":5,"steps":[{"step":"k","result":"PASS","seconds":3,"detail":"cuda_fused: 42 checks passed"},{"step":"c1","result":"FAIL","seconds":4,"detail":"max rel loss diff 1e-2"}]}' > "$d/gpu_check.json"
echo "gpu_check table printed"
exit 1
"#;

/// The fake gpu_bench.sh: gpu_bench.json, table.md, logs/ with many files and a 5 MB one,
/// and the real run's 6 MB initial parameters, into --out.
const BENCH: &str = r#"out=""
while (($#)); do [ "$1" = --out ] && out="$2"; shift; done
[ -f target/real_text/shakespeare.txt ] || { echo "no text" >&2; exit 1; }
mkdir -p "$out/logs" "$out/real_text"
for i in $(seq 1 40); do echo "run $i" > "$out/logs/run_$i.log"; done
head -c 5000000 /dev/zero > "$out/logs/huge.log"
head -c 6000000 /dev/zero > "$out/real_text/init.safetensors"
echo '{"runs":[]}' > "$out/gpu_bench.json"
printf '# GPU benchmark\n\n| preset | ours |\n|---|---|\n| gpt2 | 1.00x |\n' > "$out/table.md"
"#;

/// A scratch tree: the script under test, the fakes, a tarball of fake binaries, the text
/// as `.xz` only.
fn tree(dir: &Scratch) -> PathBuf {
    let root = dir.path("repo");
    let scripts = root.join("scripts");
    std::fs::create_dir_all(&scripts).unwrap();
    let real = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_session.sh");
    std::fs::copy(&real, scripts.join("gpu_session.sh")).unwrap();
    script(&scripts.join("gpu_check.sh"), CHECK);
    script(&scripts.join("gpu_bench.sh"), BENCH);
    let stage = dir.path("stage");
    script(&stage.join("bin/train_gpt"), "echo fake\n");
    std::fs::write(stage.join("bin/BUILD_INFO"), "commit=abc1234\n").unwrap();
    std::fs::create_dir_all(root.join("target/gpu")).unwrap();
    run_ok(
        Command::new("tar")
            .arg("-C")
            .arg(&stage)
            .arg("-cJf")
            .arg(root.join("target/gpu/gpu_bins.tar.xz"))
            .arg("bin"),
    );
    let text = root.join("target/real_text/shakespeare.txt");
    std::fs::create_dir_all(text.parent().unwrap()).unwrap();
    std::fs::write(&text, "To be, or not to be\n".repeat(100)).unwrap();
    run_ok(Command::new("xz").arg("-z").arg(&text));
    assert!(!text.exists() && text.with_extension("txt.xz").exists());
    root
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {out:?}");
}

struct Run {
    code: Option<i32>,
    out: String,
    secs: f64,
}

fn session(root: &Path, out: &Path, env: &[(&str, &str)]) -> Run {
    let t0 = Instant::now();
    let mut cmd = Command::new("bash");
    cmd.arg(root.join("scripts/gpu_session.sh"))
        .arg("--out")
        .arg(out)
        .arg("--work")
        .arg(out.with_extension("work"))
        .args(["--check-budget", "5", "--bench-budget", "5"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    // Bounded: the script's own outer limits are 30 + 45 s with these budgets.
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("gpu_session.sh ran past 240 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let o = child.wait_with_output().unwrap();
    Run {
        code: status.code(),
        out: format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        secs: t0.elapsed().as_secs_f64(),
    }
}

/// What the device tool would bring back from `out`: the files, each checked against its
/// limits.
fn returned(out: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(out).unwrap() {
        let e = e.unwrap();
        let meta = e.metadata().unwrap();
        assert!(meta.is_file(), "{:?} is not a plain file", e.path());
        assert!(meta.len() <= 16 << 20, "{:?} is over 16 MiB", e.path());
        names.push(e.file_name().into_string().unwrap());
    }
    names.sort();
    assert!(names.len() <= 8, "{} files: {names:?}", names.len());
    names
}

fn listing(tgz: &Path) -> String {
    let o = Command::new("tar").arg("-tzf").arg(tgz).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn the_session_returns_its_results_in_a_few_files_whatever_the_steps_did() {
    let dir = Scratch::new("gpu_session");
    let root = tree(&dir);
    let out = dir.path("out");
    let r = session(&root, &out, &[]);
    assert_eq!(r.code, Some(0), "{}", r.out);
    assert_eq!(
        returned(&out),
        [
            "gpu_bench.json",
            "gpu_check.json",
            "logs.tgz",
            "session.log",
            "table.md"
        ]
    );
    // The binaries and the text were unpacked before the scripts ran (they check).
    assert!(root.join("target/gpu/bin/train_gpt").exists());
    assert!(root.join("target/real_text/shakespeare.txt").exists());
    assert!(r.out.contains("binaries: commit=abc1234"), "{}", r.out);
    // Every small log came back inside logs.tgz; the large ones are named, not packed.
    let list = listing(&out.join("logs.tgz"));
    for want in [
        "check/step_20.log",
        "bench/logs/run_40.log",
        "bench/table.md",
    ] {
        assert!(list.lines().any(|l| l == want), "{want} not in:\n{list}");
    }
    assert!(
        !list.contains("huge.log") && !list.contains("init.safetensors"),
        "{list}"
    );
    assert!(
        r.out.contains("left out of logs.tgz (over 4 MB)"),
        "{}",
        r.out
    );
    // The tail carries the check's rows and the table.
    let tail = &r.out[r.out.len().saturating_sub(1500)..];
    assert!(tail.contains("c1     FAIL"), "{tail}");
    assert!(tail.contains("| gpt2 | 1.00x |"), "{tail}");
    // session.log holds the same output.
    let log = std::fs::read_to_string(out.join("session.log")).unwrap();
    assert!(log.contains("gpu_check table printed"), "{log}");
}

#[test]
fn a_hanging_check_is_cut_at_its_outer_limit_and_the_benchmark_still_runs() {
    let dir = Scratch::new("gpu_session_hang");
    let root = tree(&dir);
    let out = dir.path("out");
    let r = session(&root, &out, &[("FAKE_CHECK", "hang")]);
    assert_eq!(r.code, Some(0), "{}", r.out);
    // The check's outer limit: its budget (5 s) + 25 s.
    assert!(r.secs < 120.0, "took {} s:\n{}", r.secs, r.out);
    assert!(r.out.contains("gpu_check.sh exit 124"), "{}", r.out);
    let names = returned(&out);
    assert!(
        names.contains(&"gpu_bench.json".to_string())
            && !names.contains(&"gpu_check.json".to_string()),
        "{names:?}"
    );
}
