#!/usr/bin/env bash
# Provides a CUDA toolchain for building the `cuda` / `nccl` features (DESIGN.md §8) and prints
# the environment to use it:
#
#   eval "$(scripts/setup_cuda.sh)"                 # pip toolkit under .cuda/ (the CI default)
#   eval "$(scripts/setup_cuda.sh --system)"        # an installed toolkit (nvcc on PATH, CUDA_HOME
#                                                   # or /usr/local/cuda): a GPU box's own, whose
#                                                   # nvcc matches its driver
#   eval "$(scripts/setup_cuda.sh --auto)"          # --system if an nvcc is found, else pip
#   scripts/setup_cuda.sh --with-nccl               # also the NCCL wheel (headers + libnccl.so.2,
#                                                   # 305 MB), for running on a GPU box with pip
#
# The pip toolkit is the CUDA 13 wheels of DESIGN.md §8 (nvcc, cudart, crt, nvvm, cccl: 127 MB
# download, ~345 MB on disk), installed with `pip install --target` into $CDT_CUDA_DIR (default
# <repo>/.cuda, git-ignored). They merge into one toolkit tree, <dir>/nvidia/cu13, which becomes
# CUDA_HOME. Idempotent: a stamp naming the package set skips pip when it is already there (a
# second run takes well under a second). Progress goes to stderr; stdout carries only the
# `export` lines, so `eval "$(...)"` works.
#
# Printed: CUDA_HOME, PATH (+ $CUDA_HOME/bin), CUDA_COMPUTE_CAP (kept if set, else from nvidia-smi
# when a GPU is visible, else 80: enough for a compile check), CDT_CUDA_LIB_DIRS (the directories
# holding the toolkit's and NCCL's shared libraries, for gpu_check.sh to link and run against).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${CDT_CUDA_DIR:-$ROOT/.cuda}"
# The versions DESIGN.md §8 names (verified on PyPI: `pip download --no-deps`). There is no
# 13.4.x cccl; pip resolves the newest (13.3.5.0.6 when this was written).
# CDT_CUDA_VERSION picks another release of the same wheels (scripts/build_gpu.sh uses 13.0.88:
# its PTX then loads on every CUDA 13 driver); use its own CDT_CUDA_DIR.
CUDA_VERSION="${CDT_CUDA_VERSION:-13.4.92}"
PACKAGES=(
    "nvidia-cuda-nvcc==$CUDA_VERSION"
    "nvidia-cuda-runtime==$CUDA_VERSION"
    "nvidia-cuda-crt==$CUDA_VERSION"
    "nvidia-nvvm==$CUDA_VERSION"
    nvidia-cuda-cccl
)
NCCL_PACKAGE=nvidia-nccl-cu13

mode=pip
with_nccl=0
for arg in "$@"; do
    case "$arg" in
        --system) mode=system ;;
        --auto) mode=auto ;;
        --pip) mode=pip ;;
        --with-nccl) with_nccl=1 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "setup_cuda.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "setup_cuda.sh: $*" >&2; }

find_system_nvcc() {
    local c
    for c in "${CUDA_HOME:-}/bin/nvcc" "$(command -v nvcc 2>/dev/null || true)" /usr/local/cuda/bin/nvcc; do
        if [[ -n "$c" && -x "$c" && "$c" != "$DIR/"* ]]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

install_pip() {
    local pkgs=("${PACKAGES[@]}")
    ((with_nccl)) && pkgs+=("$NCCL_PACKAGE")
    local stamp="$DIR/.installed-$(printf '%s\n' "${pkgs[@]}" | sha256sum | cut -c1-16)"
    if [[ -f "$stamp" && -x "$DIR/nvidia/cu13/bin/nvcc" ]]; then
        log "pip toolkit already installed in $DIR"
        return 0
    fi
    local py
    py="$(command -v python3 || command -v python || true)"
    if [[ -z "$py" ]]; then
        log "python3 not found: install Python 3 with pip, or use --system with an installed toolkit"
        exit 1
    fi
    mkdir -p "$DIR"
    log "installing ${pkgs[*]} into $DIR (pip --target)"
    # Bounded: a stuck index must not hang CI forever. --no-deps: the list is complete, and no
    # dependency resolution can pull in a second toolkit.
    timeout 1200 "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
        --upgrade --target "$DIR" "${pkgs[@]}" >&2
    if [[ ! -x "$DIR/nvidia/cu13/bin/nvcc" ]]; then
        log "pip finished but $DIR/nvidia/cu13/bin/nvcc is missing"
        exit 1
    fi
    rm -f "$DIR"/.installed-*
    touch "$stamp"
}

cuda_home=""
case "$mode" in
    system|auto)
        if nvcc_path="$(find_system_nvcc)"; then
            cuda_home="$(cd "$(dirname "$nvcc_path")/.." && pwd)"
            log "using the installed toolkit at $cuda_home"
        elif [[ "$mode" == system ]]; then
            log "no installed nvcc found (looked at \$CUDA_HOME/bin, PATH, /usr/local/cuda/bin)"
            exit 1
        fi
        ;;
esac
if [[ -z "$cuda_home" ]]; then
    install_pip
    cuda_home="$DIR/nvidia/cu13"
elif ((with_nccl)); then
    install_pip
fi

if ! "$cuda_home/bin/nvcc" --version >/dev/null 2>&1; then
    log "$cuda_home/bin/nvcc does not run"
    exit 1
fi
log "$("$cuda_home/bin/nvcc" --version | tail -n 2 | head -n 1)"

cap="${CUDA_COMPUTE_CAP:-}"
if [[ -z "$cap" ]] && command -v nvidia-smi >/dev/null 2>&1; then
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .' || true)"
fi
cap="${cap:-80}"

# Shared-library directories: the toolkit's, the NCCL wheel's, and those of any pip `nvidia-*`
# packages of the current Python (a GPU box often has cuBLAS/cuRAND/NVRTC/NCCL only that way).
lib_dirs=("$cuda_home/lib64" "$cuda_home/lib" "$DIR/nvidia/nccl/lib")
if py="$(command -v python3 2>/dev/null)"; then
    while IFS= read -r d; do
        [[ -n "$d" ]] && lib_dirs+=("$d")
    done < <("$py" - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
seen = set()
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        if d not in seen:
            seen.add(d)
            print(d)
PY
)
fi
existing=()
for d in "${lib_dirs[@]}"; do
    [[ -d "$d" ]] && existing+=("$d")
done

printf 'export CUDA_HOME=%q\n' "$cuda_home"
printf 'export PATH=%q:"$PATH"\n' "$cuda_home/bin"
printf 'export CUDA_COMPUTE_CAP=%q\n' "$cap"
printf 'export CDT_CUDA_LIB_DIRS=%q\n' "$(IFS=:; echo "${existing[*]}")"
