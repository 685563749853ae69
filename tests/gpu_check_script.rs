//! scripts/gpu_check.sh fails when it should, on a machine without a GPU: a fake `nvidia-smi`
//! on PATH and a `--bin-dir` of fake binaries (small shell scripts printing what the real ones
//! print) dry-run its plumbing (`CDT_GPU_CHECK_DEVICE=cpu`). All fakes present and good: exit 0.
//! A train_gpt whose JSON lacks `max_rel_loss_diff`, a train_gpt whose own check exits 1, a
//! missing required binary, or a binary that exits 0 without its summary line: non-zero, the
//! step named in a FAIL row. A missing optional binary (nccl_bench): SKIP, still exit 0.
#![cfg(unix)]

mod common;

use common::Scratch;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn script(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The fake `nvidia-smi`: one GPU.
const NVIDIA_SMI: &str = r#"case "$*" in
  *-L*) echo "GPU 0: Fake GPU (UUID: GPU-00000000)" ;;
  *--query-gpu=name,*) echo "Fake GPU, 0.0, 9.0, 1024 MiB" ;;
  *--query-gpu=name*) echo "Fake GPU" ;;
  *) exit 1 ;;
esac
"#;

/// A fake train_gpt: its JSON summary as the real one prints it; `FAKE_TG` picks a fault for
/// the `--check` runs (`nofigure`: no max_rel_loss_diff; `nullfigure`: null; `exit1`: a figure
/// within tolerance but exit status 1, the real binary's failed check) or for `--count-kernels`
/// (`nokernels`: the counter's error instead of a count), or for every run (`nophases`: no GPU
/// phase times).
const TRAIN_GPT: &str = r#"check=0 count=0
for a in "$@"; do [ "$a" = --check ] && check=1; [ "$a" = --count-kernels ] && count=1; done
echo "train_gpt: some log line on stderr" >&2
gp='"gpu_phases":{"gpu_step_ms_median":1.25,"steps":8},'
[ "${FAKE_TG:-good}" = nophases ] && gp=''
if [ "$count" = 1 ]; then
  if [ "${FAKE_TG:-good}" = nokernels ]; then
    echo '{"final_loss":5.25,"gpu_phases":{"gpu_step_ms_median":1.25,"steps":8},"kernels":{"error":"kernel counting: cannot load CUPTI"},"step_ms_median":1.5,"tokens_per_s":1000.0}'
  else
    echo '{"final_loss":5.25,"gpu_phases":{"gpu_step_ms_median":1.25,"steps":8},"kernels":{"kernel_ms_per_step":1.1,"kernels_per_step":321,"step":7},"step_ms_median":1.5,"tokens_per_s":1000.0}'
  fi
  exit 0
fi
if [ "$check" = 0 ]; then
  echo '{"final_loss":5.25,'"$gp"'"step_ms_median":1.5,"tokens_per_s":1000.0,"check_passed":null}'
  exit 0
fi
case "${FAKE_TG:-good}" in
  nofigure) echo '{"final_loss":5.25,'"$gp"'"step_ms_median":1.5,"tokens_per_s":1000.0,"check_passed":true}' ;;
  nullfigure) echo '{"final_loss":5.25,'"$gp"'"max_rel_loss_diff":null,"step_ms_median":1.5,"tokens_per_s":1000.0,"check_passed":true}' ;;
  exit1) echo '{"final_loss":5.25,'"$gp"'"max_rel_loss_diff":1.0e-9,"step_ms_median":1.5,"tokens_per_s":1000.0,"check_passed":false}'
         echo "train_gpt: check failed: against the single-device reference: loss per step: element 1 is not finite" >&2
         exit 1 ;;
  *) echo '{"final_loss":5.25,'"$gp"'"max_rel_loss_diff":8.9e-8,"step_ms_median":1.5,"tokens_per_s":1000.0,"check_passed":true}' ;;
esac
"#;

/// Writes the fake binaries into `bin`.
fn fake_bins(bin: &Path) {
    std::fs::create_dir_all(bin).unwrap();
    script(&bin.join("train_gpt"), TRAIN_GPT);
    script(
        &bin.join("nccl_check"),
        "echo 'nccl_check: 12 collectives ok'\n",
    );
    script(
        &bin.join("nccl_local_cuda"),
        "echo 'nccl_local_cuda: 4 ranks ok'\n",
    );
    script(
        &bin.join("nccl_bench"),
        "echo '#  size  algbw  busbw'\necho 'peak busbw 1.0 GB/s'\n",
    );
    script(&bin.join("train_llama"), "echo 'check vs one device: ok'\n");
    script(
        &bin.join("adamw_bench"),
        "echo 'adamw_bench: gpt2 on \"cuda\": 124475904 parameters in 148 tensors'\necho '  fused AdamW 1.000 ms, copy of the same bytes 0.600 ms: 1.67x the floor (5800 GB/s copy, 3500 GB/s AdamW)'\n",
    );
    script(
        &bin.join("kernels_cuda_fused"),
        "echo 'ok   gelu F32 [3, 1]: max rel diff 0.00e0'\necho 'cuda_fused: 3 checks passed on Cuda'\n",
    );
    // dtrun runs the command after `--` (one rank).
    script(
        &bin.join("dtrun"),
        "while [ \"$#\" -gt 0 ] && [ \"$1\" != -- ]; do shift; done\nshift\nexec \"$@\"\n",
    );
}

/// What one run of the script printed and how it ended.
struct Run {
    code: Option<i32>,
    out: String,
}

/// Runs scripts/gpu_check.sh with the fakes, `FAKE_TG=mode`, killed after 120 s.
fn gpu_check(dir: &Scratch, bin: &Path, mode: &str) -> Run {
    gpu_check_env(dir, bin, mode, &[])
}

/// [`gpu_check`] with more environment variables.
fn gpu_check_env(dir: &Scratch, bin: &Path, mode: &str, env: &[(&str, &str)]) -> Run {
    let fake_path = dir.path("path");
    std::fs::create_dir_all(&fake_path).unwrap();
    script(&fake_path.join("nvidia-smi"), NVIDIA_SMI);
    let path = format!(
        "{}:{}",
        fake_path.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let log = dir.path(&format!("{mode}.out"));
    let out_file = std::fs::File::create(&log).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new("bash")
        .arg(root.join("scripts/gpu_check.sh"))
        .arg("--bin-dir")
        .arg(bin)
        .env("PATH", path)
        .env("CDT_GPU_CHECK_DEVICE", "cpu")
        .env("CDT_GPU_LOG_DIR", dir.path(&format!("logs-{mode}")))
        .env("FAKE_TG", mode)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(out_file.try_clone().unwrap())
        .stderr(out_file)
        .spawn()
        .expect("bash runs");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "gpu_check.sh ({mode}) did not end within 120 s:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Run {
        code: status.code(),
        out: std::fs::read_to_string(&log).unwrap(),
    }
}

/// The result column of step `id` in the table the script prints last.
fn result_of(run: &Run, id: &str) -> String {
    let table = run
        .out
        .rsplit_once("step   result")
        .unwrap_or_else(|| panic!("no result table in:\n{}", run.out))
        .1;
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(id))
        .unwrap_or_else(|| panic!("no row for step {id} in:\n{table}"))
        .to_string()
}

fn assert_row(run: &Run, id: &str, result: &str, needle: &str) {
    let row = result_of(run, id);
    assert!(
        row.split_whitespace().nth(1) == Some(result) && row.contains(needle),
        "step {id}: expected {result} with {needle:?}, got {row:?}\n{}",
        run.out
    );
}

#[test]
fn gpu_check_passes_only_with_every_required_binary_and_figure() {
    let dir = Scratch::new("all");
    let bin = dir.path("bin");
    fake_bins(&bin);

    // Everything there and good.
    let good = gpu_check(&dir, &bin, "good");
    assert_eq!(good.code, Some(0), "{}", good.out);
    for id in [
        "libs", "a1", "a2", "b", "b2", "k", "k2", "c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7",
        "c8", "c9", "c10", "c13", "c11", "e1", "e2", "d",
    ] {
        assert_row(&good, id, "PASS", "");
    }
    assert_row(&good, "c11", "PASS", "321 kernels in a step");
    // k2 runs after the training checks: a never-run kernel that hangs there cannot take
    // their budget.
    let table = good.out.rsplit_once("step   result").map_or("", |t| t.1);
    let at = |id: &str| {
        table
            .lines()
            .position(|l| l.split_whitespace().next() == Some(id))
            .unwrap_or_else(|| panic!("no row {id} in:\n{table}"))
    };
    assert!(at("k") < at("c0") && at("c11") < at("k2"), "{table}");
    assert_row(&good, "c12", "PASS", "1.67x the floor");
    assert_row(&good, "c1", "PASS", "max rel loss diff vs CPU 8.9e-8");
    let json = std::fs::read_to_string(dir.path("logs-good/gpu_check.json")).unwrap();
    assert!(
        json.contains("\"step\":\"c3\",\"result\":\"PASS\"") && json.contains("8.9e-8"),
        "{json}"
    );

    // A --check step whose JSON lacks the figure, or has it null.
    for mode in ["nofigure", "nullfigure"] {
        let r = gpu_check(&dir, &bin, mode);
        assert_eq!(r.code, Some(1), "{}", r.out);
        for id in ["c1", "c2", "c3", "c5", "c6", "c8", "c9", "c10", "c13"] {
            assert_row(&r, id, "FAIL", "max_rel_loss_diff missing");
        }
        // The steps without --check need no such figure.
        assert_row(&r, "c0", "PASS", "");
    }

    // On a CUDA device, a layout without GPU phase times (CUDA timing events) fails, whether
    // checked or not; with them every step passes.
    let cuda = [("CDT_GPU_CHECK_DEVICE", "cuda")];
    let r = gpu_check_env(&dir, &bin, "good", &cuda);
    assert_eq!(r.code, Some(0), "{}", r.out);
    let r = gpu_check_env(&dir, &bin, "nophases", &cuda);
    assert_eq!(r.code, Some(1), "{}", r.out);
    for id in ["c0", "c1", "c7", "c10", "c13"] {
        assert_row(&r, id, "FAIL", "gpu_phases missing");
    }
    assert_row(&r, "a1", "PASS", "");

    // No kernel count (CUPTI missing on the GPU machine): c11 fails, naming why.
    let r = gpu_check(&dir, &bin, "nokernels");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(&r, "c11", "FAIL", "cannot load CUPTI");
    assert_row(&r, "c0", "PASS", "");

    // train_gpt's own check failed (exit 1), whatever figure it printed.
    let r = gpu_check(&dir, &bin, "exit1");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(&r, "c2", "FAIL", "exit 1 (check failed)");
    assert_row(&r, "c2", "FAIL", "check_passed false");

    // A required binary missing: FAIL naming it (the launcher and the step using it).
    std::fs::remove_file(bin.join("nccl_local_cuda")).unwrap();
    let r = gpu_check(&dir, &bin, "good");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(&r, "b", "FAIL", "required binary missing: nccl_local_cuda");
    assert_row(&r, "a1", "PASS", "");
    fake_bins(&bin);
    std::fs::remove_file(bin.join("dtrun")).unwrap();
    let r = gpu_check(&dir, &bin, "good");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(&r, "a2", "FAIL", "required binary missing: dtrun");
    assert_row(&r, "c4", "FAIL", "required binary missing: dtrun");
    fake_bins(&bin);
    std::fs::remove_file(bin.join("train_gpt")).unwrap();
    let r = gpu_check(&dir, &bin, "good");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(&r, "c1", "FAIL", "required binary missing: train_gpt");
    assert_row(&r, "c4", "FAIL", "required binary missing: train_gpt");

    // A binary that exits 0 without the summary line its step looks for.
    fake_bins(&bin);
    script(&bin.join("nccl_check"), "echo 'nothing to see'\n");
    let r = gpu_check(&dir, &bin, "good");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(&r, "a1", "FAIL", "no line matching 'nccl_check:'");

    // The kernel test binary finding no GPU skips and exits 0: a FAIL here, not a pass.
    fake_bins(&bin);
    script(
        &bin.join("kernels_cuda_fused"),
        "echo 'cuda_fused: SKIPPED, no CUDA device: none'\n",
    );
    let r = gpu_check(&dir, &bin, "good");
    assert_eq!(r.code, Some(1), "{}", r.out);
    assert_row(
        &r,
        "k",
        "FAIL",
        "no line matching 'cuda_fused: [0-9]+ checks passed'",
    );

    // The optional benchmark missing: SKIP, and the check still passes.
    fake_bins(&bin);
    std::fs::remove_file(bin.join("nccl_bench")).unwrap();
    let r = gpu_check(&dir, &bin, "good");
    assert_eq!(r.code, Some(0), "{}", r.out);
    assert_row(&r, "d", "SKIP", "optional step: nccl_bench not built");
}

#[test]
fn a_spent_budget_skips_steps_and_still_writes_the_table_and_the_json() {
    let dir = Scratch::new("budget");
    let bin = dir.path("bin");
    fake_bins(&bin);
    // 1 s: under the 15 s a step needs to start, so every step after libs is left out.
    let r = gpu_check_env(&dir, &bin, "good", &[("CDT_GPU_CHECK_BUDGET", "1")]);
    assert_eq!(r.code, Some(3), "{}", r.out);
    for id in ["a1", "b", "k", "c0", "c11", "c12", "e1", "c4"] {
        assert_row(&r, id, "SKIP", "budget: ");
    }
    assert_row(&r, "libs", "PASS", "");
    let json = std::fs::read_to_string(dir.path("logs-good").join("gpu_check.json"))
        .expect("gpu_check.json written");
    assert!(
        json.contains("\"budget\":1") && json.contains("\"step\":\"c12\",\"result\":\"SKIP\""),
        "{json}"
    );
    // A budget that is not whole seconds is a usage error.
    let bad = gpu_check_env(&dir, &bin, "good", &[("CDT_GPU_CHECK_BUDGET", "5m")]);
    assert_eq!(bad.code, Some(2), "{}", bad.out);
}

/// The runtime-library search (scripts/lib/cuda_libs.sh, sourced by gpu_check.sh and
/// gpu_bench.sh) takes the major version the binaries link before any other: a directory
/// searched first that holds another CUDA release's libcublas (.so.12) does not shadow a later
/// one's .so.13; a library found only in another version is still linked (the binaries then
/// report it missing by name, through ldd).
#[test]
fn the_library_search_prefers_the_linked_major_versions() {
    let dir = Scratch::new("cuda_libs");
    let (old, new, out, bin) = (
        dir.path("old"),
        dir.path("new"),
        dir.path("out"),
        dir.path("bin"),
    );
    for d in [&old, &new, &out, &bin] {
        std::fs::create_dir_all(d).unwrap();
    }
    for (d, f) in [
        (&old, "libcublas.so.12"),
        (&new, "libcublas.so.13"),
        (&old, "libcuda.so.1"),
        (&old, "libcurand.so.9"),
    ] {
        std::fs::write(d.join(f), "").unwrap();
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/lib/cuda_libs.sh");
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -u; source '{}'; cdt_cuda_libs '{}' '{}' ''; echo \"$cuda_lib_path\"",
            lib.display(),
            out.display(),
            bin.display()
        ))
        .env(
            "CDT_CUDA_LIB_DIRS",
            format!("{}:{}", old.display(), new.display()),
        )
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let link = |name: &str| std::fs::read_link(out.join(name)).unwrap();
    assert_eq!(link("libcublas.so"), new.join("libcublas.so.13"));
    assert_eq!(link("libcuda.so"), old.join("libcuda.so.1"));
    assert_eq!(link("libcurand.so"), old.join("libcurand.so.9"));
    let path = String::from_utf8(o.stdout).unwrap();
    assert!(
        path.contains(new.to_str().unwrap()) && path.contains(old.to_str().unwrap()),
        "{path}"
    );
}
