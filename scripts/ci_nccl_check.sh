#!/usr/bin/env bash
# CI check of the GPU code on a machine without a GPU (DESIGN.md §8): installs the pip CUDA 13
# toolkit (scripts/setup_cuda.sh), then type-checks and lints the workspace with the `nccl`
# and `cuda` features, every target included (clippy type-checks everything `cargo check`
# would, so one pass does both).
#
#   scripts/ci_nccl_check.sh
#
# Uses its own target directory ($CARGO_TARGET_DIR, default target/nccl) so the default build's
# cache stays untouched. The first run installs the toolkit and compiles candle's CUDA kernels with nvcc:
# 9.5 min in all from empty caches on the 2-core build machine; later runs take seconds to a
# minute.
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

echo "== cargo clippy --workspace --features nccl,cuda --all-targets -- -D warnings"
cargo clippy --workspace --features nccl,cuda --all-targets -- -D warnings

echo "== default build has no CUDA"
if cargo tree --workspace -e normal --prefix none | grep -q '^cudarc '; then
    echo "ci_nccl_check.sh: cudarc is in the default dependency tree" >&2
    exit 1
fi

echo "== ci_nccl_check.sh: done in $(( $(date +%s) - t0 )) s"
