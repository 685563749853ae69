#!/usr/bin/env bash
# Installs what building and testing candle-dtensor needs on a fresh machine.
# The default build needs only a Rust toolchain with rustfmt and clippy; optional backends
# (MPI, NCCL) install their own extras in scripts/setup_mpi.sh / scripts/setup_cuda.sh.
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found: install Rust from https://rustup.rs" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
    rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi
cargo --version
