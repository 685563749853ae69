#!/usr/bin/env bash
# Installs what the `mpi` feature needs on Debian/Ubuntu: Open MPI (headers, mpicc, mpirun) and
# libclang (the `mpi` crate generates its bindings with bindgen). Installs only packages that
# are missing, non-interactively; needs root (or sudo) when something is missing.
# Usage: scripts/setup_mpi.sh   (idempotent; prints the Open MPI version at the end)
set -euo pipefail

PACKAGES=(libopenmpi-dev openmpi-bin libclang-dev pkg-config)

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup_mpi.sh: missing ${missing[*]} and no apt-get; install Open MPI and libclang by hand" >&2
        exit 1
    fi
    SUDO=""
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then
            SUDO="sudo"
        else
            echo "setup_mpi.sh: missing ${missing[*]}; run as root (or install sudo)" >&2
            exit 1
        fi
    fi
    echo "setup_mpi.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Bounded: a stuck mirror must not hang CI forever.
    timeout 600 $SUDO apt-get update -qq
    timeout 1200 $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    echo "setup_mpi.sh: mpirun/mpicc not on PATH after installing" >&2
    exit 1
fi
echo "setup_mpi.sh: $(mpirun --version 2>/dev/null | head -n 1)"
