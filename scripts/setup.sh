#!/usr/bin/env bash
# Installs what building and testing candle-dtensor needs on a fresh machine, and checks every
# tool the scripts of .ci/run use. The default build needs a Rust toolchain (at least the
# workspace's rust-version) with rustfmt and clippy, and a C linker; the CI scripts need the
# tools below. Optional backends install their own extras: scripts/setup_mpi.sh (Open MPI,
# libclang: scripts/ci_mpi.sh runs it) and scripts/setup_cuda.sh (the pip CUDA toolkit:
# scripts/ci_nccl_check.sh runs it). A missing tool is installed with apt-get (Debian/Ubuntu,
# as root or through sudo, as scripts/setup_mpi.sh does); elsewhere the script stops, naming
# the tool and the scripts that need it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup.sh: cargo not found: install Rust from https://rustup.rs" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
    rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

# The toolchain is at least the workspace's rust-version (cargo would refuse to build otherwise).
msrv=$(sed -n 's/^rust-version = "\([0-9.]*\)"$/\1/p' Cargo.toml | head -n 1)
rustc_version=$(rustc --version | awk '{ print $2 }')
if [[ -n "$msrv" && "$(printf '%s\n%s\n' "$msrv" "${rustc_version%%-*}" | sort -V | head -n 1)" != "$msrv" ]]; then
    echo "setup.sh: rustc $rustc_version is older than the workspace's rust-version $msrv: run \`rustup update\`" >&2
    exit 1
fi

# tool | Debian package | who needs it. `python3 -m pip` stands for pip.
TOOLS=(
    "cc|gcc libc6-dev|cargo (the linker of every build)"
    "c++|g++|cargo test (crates/kernels-emu compiles the CUDA C kernels as C++ for the CPU emulator)"
    "python3|python3|scripts/ci_process.sh, scripts/check_msrv.sh, scripts/build_release.sh, scripts/setup_cuda.sh"
    "pip|python3-pip|scripts/setup_cuda.sh (ci_nccl_check.sh), scripts/build_release.sh (pip install --target)"
    "objdump|binutils|scripts/check_glibc.sh"
    "awk|mawk|scripts/ci_mpi.sh, scripts/ci_nccl_check.sh, scripts/check_glibc.sh"
    "sed|sed|scripts/ci_process.sh, scripts/ci_mpi.sh, scripts/ci_nccl_check.sh"
    "grep|grep|scripts/ci_mpi.sh, scripts/ci_nccl_check.sh, scripts/setup_mpi.sh"
    "tar|tar|scripts/ci_nccl_check.sh (unpacks candle-kernels' .crate)"
    "gzip|gzip|scripts/ci_nccl_check.sh (tar -z)"
    "timeout|coreutils|scripts/ci_mpi.sh, scripts/setup_mpi.sh, scripts/setup_cuda.sh, scripts/build_release.sh"
    "sha256sum|coreutils|scripts/setup_cuda.sh"
    "sort|coreutils|scripts/check_glibc.sh, scripts/setup.sh (sort -V)"
    "paste|coreutils|scripts/ci_mpi.sh"
    "mktemp|coreutils|scripts/ci_process.sh, scripts/ci_mpi.sh, scripts/check_msrv.sh"
)

have() {
    if [[ "$1" == pip ]]; then
        command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1
    else
        command -v "$1" >/dev/null 2>&1
    fi
}

missing() {
    local entry
    for entry in "${TOOLS[@]}"; do
        IFS='|' read -r tool pkgs users <<<"$entry"
        have "$tool" || echo "$tool|$pkgs|$users"
    done
}

absent=$(missing)
if [[ -n "$absent" ]]; then
    while IFS='|' read -r tool pkgs users; do
        echo "setup.sh: $tool not found (Debian package: $pkgs); needed by $users" >&2
    done <<<"$absent"
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup.sh: no apt-get here: install the tools above by hand" >&2
        exit 1
    fi
    SUDO=""
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then
            SUDO="sudo"
        else
            echo "setup.sh: run as root (or install sudo) to install the tools above" >&2
            exit 1
        fi
    fi
    read -r -a packages <<<"$(cut -d'|' -f2 <<<"$absent" | tr '\n' ' ')"
    echo "setup.sh: installing ${packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Bounded: a stuck mirror must not hang CI forever.
    timeout 600 $SUDO apt-get update -qq
    timeout 1200 $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}"
    still=$(missing)
    if [[ -n "$still" ]]; then
        while IFS='|' read -r tool pkgs users; do
            echo "setup.sh: $tool still not found after installing $pkgs; needed by $users" >&2
        done <<<"$still"
        exit 1
    fi
fi
cargo --version
