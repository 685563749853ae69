#!/usr/bin/env bash
# CI check of the GPU code on a machine without a GPU (DESIGN.md §8): installs the pip CUDA 13
# toolkit (scripts/setup_cuda.sh), then type-checks and lints the workspace with the `nccl`
# and `cuda` features, every target included (clippy type-checks everything `cargo check`
# would, so one pass does both).
#
#   scripts/ci_nccl_check.sh
#
# Uses its own target directory ($CARGO_TARGET_DIR, default target/nccl) so the default build's
# cache stays untouched.
#
# candle's kernels are not compiled here. candle-kernels' build script runs nvcc over every
# kernel file (PTX for the elementwise, reduce, indexing ... modules, and machine code for the MoE
# kernels); from empty caches that took most of this stage's 1,109 s in a clean-clone CI run
# here, for PTX text a type check never reads. So the check patches in a build-free copy of the
# same candle-kernels release: its Rust sources as published (taken from cargo's own download of
# the crate at check time, nothing vendored), with a build script that writes the `ptx` module's
# constants as empty strings. Every Rust item candle-core and this workspace use is the
# release's own, so the type check and lints are those of the real build; only the PTX text
# differs, and a check never links or runs. `scripts/build_gpu.sh` builds the real kernels for
# the GPU binaries. `CDT_NCCL_CHECK_REAL_KERNELS=1` runs the check against the real kernels.
# Cargo.lock is restored after the patched run (the patch rewrites it).
#
# Not run here: `cargo test --features nccl`. candle's `cuda` feature links the CUDA libraries
# dynamically (libcuda, libnccl, libcublas, libcublasLt, libcurand, libnvrtc), so a test binary
# cannot even be linked without them, let alone loaded without libcuda. The NCCL backend's
# GPU-free logic (config, error mapping, version gates, plans, split colors, the Work state
# machine, the watchdog with a fake clock, bootstrap through the store, init/split/abort
# against a mock NCCL) is compiled for the crate's unit tests without the feature, so the
# plain `cargo test --workspace` of .ci/run already runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

t0=$(date +%s)
eval "$(scripts/setup_cuda.sh)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/nccl}"

patch=()
if [[ "${CDT_NCCL_CHECK_REAL_KERNELS:-0}" != 1 ]]; then
    version=$(awk '/^name = "candle-kernels"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock)
    [[ -n "$version" ]] || { echo "ci_nccl_check.sh: candle-kernels is not in Cargo.lock" >&2; exit 1; }
    cargo fetch --quiet
    crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/candle-kernels-"$version".crate 2>/dev/null | head -1)
    [[ -n "$crate" ]] || { echo "ci_nccl_check.sh: cargo fetch left no candle-kernels-$version.crate" >&2; exit 1; }
    stub="$CARGO_TARGET_DIR/candle-kernels-check"
    rm -rf "$stub" && mkdir -p "$stub"
    tar -xzf "$crate" -C "$stub" --strip-components=1 "candle-kernels-$version/src"
    # The release's ptx module names, from the `mdl!(NAME, Id)` lines of its lib.rs.
    names=$(sed -n 's/^mdl!(\([A-Z_0-9]*\),.*/\1/p' "$stub/src/lib.rs")
    [[ -n "$names" ]] || { echo "ci_nccl_check.sh: no mdl!() modules in candle-kernels $version's lib.rs" >&2; exit 1; }
    cat > "$stub/Cargo.toml" <<TOML
[package]
name = "candle-kernels"
version = "$version"
edition = "2021"
build = "build.rs"
[workspace]
[lib]
path = "src/lib.rs"
# The crate tests cfg values its own build script sets; as a path dependency
# its lints would be reported here.
[lints.rust]
unexpected_cfgs = "allow"
TOML
    {
        echo '// Written by scripts/ci_nccl_check.sh: the ptx module of a type check, empty PTX text.'
        echo 'fn main() {'
        echo '    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));'
        echo '    let consts = ['
        for n in $names; do echo "        \"$n\","; done
        echo '    ];'
        echo '    let text: String = consts.iter().map(|c| format!("pub const {c}: &str = \"\";\n")).collect();'
        echo '    std::fs::write(out.join("ptx.rs"), text).expect("write ptx.rs");'
        echo '}'
    } > "$stub/build.rs"
    cp Cargo.lock "$CARGO_TARGET_DIR/Cargo.lock.orig"
    trap 'cp "$CARGO_TARGET_DIR/Cargo.lock.orig" Cargo.lock' EXIT
    patch=(--config "patch.crates-io.candle-kernels.path=\"$stub\"")
    echo "== candle-kernels $version patched with its build-free copy ($stub)"
fi

echo "== cargo clippy --workspace --features nccl,cuda --all-targets -- -D warnings"
cargo clippy "${patch[@]}" --workspace --features nccl,cuda --all-targets -- -D warnings

echo "== default build has no CUDA"
# grep reads all of cargo tree's output (no -q): under pipefail an early exit would leave cargo
# a broken pipe and the pipeline read as "not found".
if cargo tree --workspace -e normal --prefix none | grep '^cudarc ' >/dev/null; then
    echo "ci_nccl_check.sh: cudarc is in the default dependency tree" >&2
    exit 1
fi

echo "== ci_nccl_check.sh: done in $(( $(date +%s) - t0 )) s"
