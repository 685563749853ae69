//! Compiles the fused CUDA kernels (`cuda/*.cu`) to PTX with nvcc when the `cuda` feature is
//! on, and writes `$OUT_DIR/ptx.rs`: one `pub const NAME: &str` per kernel file, its PTX text
//! embedded with `include_str!` (`src/cuda.rs` loads it into candle's CUDA device at first
//! use). Without the feature this does nothing, so the default build needs no CUDA toolkit.
//!
//! nvcc: `$CUDA_HOME/bin/nvcc` when CUDA_HOME is set, else `nvcc` on PATH
//! (`eval "$(scripts/setup_cuda.sh)"` provides both). Architecture: `compute_$CUDA_COMPUTE_CAP`
//! (default 80): PTX only, which the driver compiles for the GPU it runs on (sm_90 included).
//! docs/ARCHITECTURE.md ("Fused CUDA kernels") says why nvcc at build time rather than NVRTC.

// A build script talks to cargo on stdout (`cargo::` lines) and reports errors on stderr.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(e) = build() {
        // A build script reports a failure by exiting non-zero; the message is what cargo shows.
        eprintln!("error: candle-dtensor-kernels (feature `cuda`): {e}");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC_CCBIN");
    let dir = PathBuf::from(env("CARGO_MANIFEST_DIR")?).join("cuda");
    let out = PathBuf::from(env("OUT_DIR")?);
    println!("cargo::rerun-if-changed={}", dir.display());

    let nvcc = match std::env::var_os("CUDA_HOME") {
        Some(home) => Path::new(&home).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    if cap.is_empty() {
        return Err("CUDA_COMPUTE_CAP must be a compute capability such as 80 or 90".into());
    }

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    sources.sort();
    for p in &sources {
        println!("cargo::rerun-if-changed={}", p.display());
    }
    let mut consts = String::new();
    for src in sources
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
    {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| format!("{}: not a UTF-8 file name", src.display()))?;
        let ptx = out.join(format!("{stem}.ptx"));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("--ptx")
            .arg(format!("-arch=compute_{cap}"))
            .arg("-O3")
            .arg("-std=c++17")
            .arg("-I")
            .arg(&dir)
            .arg("-o")
            .arg(&ptx)
            .arg(src);
        if let Some(ccbin) = std::env::var_os("NVCC_CCBIN") {
            cmd.arg("-ccbin").arg(ccbin);
        }
        let status = cmd.output().map_err(|e| {
            format!(
                "cannot run {} ({e}): the `cuda` feature compiles crates/kernels/cuda/*.cu with \
                 nvcc; install a CUDA toolkit or run `eval \"$(scripts/setup_cuda.sh)\"` \
                 (it sets CUDA_HOME and PATH)",
                nvcc.display()
            )
        })?;
        if !status.status.success() {
            return Err(format!(
                "nvcc failed on {} ({}):\n{}{}",
                src.display(),
                status.status,
                String::from_utf8_lossy(&status.stdout),
                String::from_utf8_lossy(&status.stderr)
            ));
        }
        consts.push_str(&format!(
            "/// PTX of `cuda/{stem}.cu` (compute_{cap}).\npub const {}: &str = include_str!({:?});\n",
            stem.to_uppercase(),
            ptx.display().to_string()
        ));
    }
    std::fs::write(out.join("ptx.rs"), consts).map_err(|e| format!("writing ptx.rs: {e}"))
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set (cargo sets it for build scripts)"))
}
