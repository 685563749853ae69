#!/usr/bin/env bash
# Creates the Python environment of the PyTorch peers (scripts/peers/*.py): a venv with pinned
# torch, numpy and safetensors from PyPI.
#
# Usage: scripts/peers/setup_torch.sh [--venv DIR]
#
#   --venv DIR   where the venv goes (default: target/peers-venv; target/ is git-ignored)
#
# Prints the venv's python on the last line of stdout. Idempotent: a venv that already imports
# the pinned versions is left as it is (nothing downloaded). torch from PyPI brings its CUDA
# libraries (a few GB, about two minutes here); PyPI has no CPU-only build of torch, and the
# same venv then also runs the twin with --device cuda on a machine with a GPU. On a machine
# where torch is already installed and nothing can be downloaded (the GPU machine), skip this
# script and run the twin with that python (the twin needs torch only: it writes and reads
# safetensors files by hand; numpy and safetensors here serve checks of those files).
set -euo pipefail

TORCH_VERSION=2.11.0   # the version the project's GPU machine has (issue 33)
NUMPY_VERSION=2.2.6
SAFETENSORS_VERSION=0.6.2

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$root/target/peers-venv"
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="$2"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "setup_torch.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

py="$venv/bin/python"
want="torch==$TORCH_VERSION numpy==$NUMPY_VERSION safetensors==$SAFETENSORS_VERSION"
have() {
    [ -x "$py" ] && "$py" - "$TORCH_VERSION" "$NUMPY_VERSION" "$SAFETENSORS_VERSION" <<'EOF' 2>/dev/null
import sys
import numpy, safetensors, torch
got = (torch.__version__.split("+")[0], numpy.__version__, safetensors.__version__)
sys.exit(0 if got == tuple(sys.argv[1:4]) else 1)
EOF
}

if have; then
    echo "setup_torch.sh: $venv already has $want" >&2
else
    command -v python3 >/dev/null || { echo "setup_torch.sh: python3 not found" >&2; exit 1; }
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
        echo "setup_torch.sh: python3 lacks venv/ensurepip; installing python3-venv" >&2
        apt-get install -y python3-venv >&2
    fi
    mkdir -p "$(dirname "$venv")"
    [ -x "$py" ] || python3 -m venv "$venv"
    "$py" -m pip install --quiet --upgrade pip >&2
    # shellcheck disable=SC2086
    "$py" -m pip install --quiet $want >&2
    have || { echo "setup_torch.sh: $venv does not import $want after installing" >&2; exit 1; }
    echo "setup_torch.sh: installed $want in $venv" >&2
fi
echo "$py"
