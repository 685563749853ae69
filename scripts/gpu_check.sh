#!/usr/bin/env bash
# The GPU check: one command on a machine with NVIDIA GPUs, under 8 minutes.
#
#   scripts/gpu_check.sh            # build + every step below, a table last
#   scripts/gpu_check.sh --no-build # reuse the binaries of a previous run
#
# Steps (each bounded by a timeout; a failing step does not stop the others):
#   build   cargo build --release --features nccl,cuda (nccl_check, nccl_bench, nccl_local_cuda,
#           train_gpt, dtrun); CUDA_COMPUTE_CAP from nvidia-smi
#   a1      nccl_check: every collective of the nccl backend, a world of one, no launcher
#   a2      dtrun --nproc <GPUs> -- nccl_check (one rank per GPU; --nproc 1 on a single GPU)
#   b       nccl_local_cuda: the local backend with 4 ranks on the GPUs (threads), collectives
#           and DTensor matmuls against one device
#   c       train_gpt --device cuda for a few steps, if train_gpt has a --device option
#   d       nccl_bench: all_gather / all_reduce sweep with algbw/busbw like nccl-tests
#
# Toolkit: the machine's own (nvcc matching its driver: PTX from a newer nvcc does not load on
# an older driver) when one is installed, else the pip wheels of scripts/setup_cuda.sh.
# Libraries: candle links libcuda, libnccl, libcublas, libcublasLt, libcurand and libnvrtc;
# pip and driver packages often ship only versioned names (libnccl.so.2, libcuda.so.1), so
# unversioned symlinks are made in a temporary directory on LIBRARY_PATH and LD_LIBRARY_PATH
# (cudarc also looks for libnccl.so, not libnccl.so.2).
# Logs: $CDT_GPU_LOG_DIR (default target/gpu_check/), one file per step.
set -uo pipefail
cd "$(dirname "$0")/.."

build=1
for arg in "$@"; do
    case "$arg" in
        --no-build) build=0 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done

t_start=$(date +%s)
logdir="${CDT_GPU_LOG_DIR:-target/gpu_check}"
mkdir -p "$logdir"
declare -a rows=()
add_row() { rows+=("$(printf '%-6s %-9s %6ss  %s' "$1" "$2" "$3" "$4")"); }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check.sh: no GPU visible (nvidia-smi -L failed)" >&2
    exit 1
fi
ngpu=$(nvidia-smi -L | grep -c '^GPU ')
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader | sed 's/^/gpu: /'

if ! env_lines="$(scripts/setup_cuda.sh --auto)"; then
    echo "gpu_check.sh: no CUDA toolkit (see scripts/setup_cuda.sh)" >&2
    exit 1
fi
eval "$env_lines"
echo "toolkit: $CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')), CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"

# Unversioned library names for the linker and for cudarc's loader.
libdir="$(mktemp -d)"
trap 'rm -rf "$libdir"' EXIT
search=()
IFS=: read -r -a extra <<< "${CDT_CUDA_LIB_DIRS:-}"
search+=("${extra[@]}" "$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME/lib64/stubs" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib)
missing_libs=()
for lib in cuda nccl cublas cublasLt curand nvrtc cudart; do
    found=""
    for d in "${search[@]}"; do
        [[ -d "$d" ]] || continue
        f="$(ls -1 "$d"/lib"$lib".so "$d"/lib"$lib".so.[0-9]* 2>/dev/null | head -n 1 || true)"
        if [[ -n "$f" ]]; then found="$f"; break; fi
    done
    if [[ -z "$found" ]]; then
        found="$(ldconfig -p 2>/dev/null | awk -v n="lib$lib.so" '$1 ~ "^"n {print $NF; exit}')"
    fi
    if [[ -n "$found" ]]; then
        ln -sf "$found" "$libdir/lib$lib.so"
    else
        missing_libs+=("lib$lib.so")
    fi
done
if ((${#missing_libs[@]})); then
    echo "gpu_check.sh: warning: not found: ${missing_libs[*]} (pip install nvidia-cublas nvidia-curand nvidia-cuda-nvrtc nvidia-nccl-cu13, or scripts/setup_cuda.sh --with-nccl)" >&2
fi
export LIBRARY_PATH="$libdir${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$libdir${CDT_CUDA_LIB_DIRS:+:$CDT_CUDA_LIB_DIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

bin=target/release
step() { # name timeout-seconds log command...
    local name="$1" limit="$2" log="$3"
    shift 3
    local t0 rc
    t0=$(date +%s)
    echo "== $name: $*"
    timeout --kill-after=10 "$limit" "$@" > "$logdir/$log" 2>&1
    rc=$?
    tail -n 15 "$logdir/$log"
    last_secs=$(( $(date +%s) - t0 ))
    return $rc
}

if ((build)); then
    if ! command -v cargo >/dev/null 2>&1; then
        echo "gpu_check.sh: cargo not found; install Rust, or build elsewhere and run with --no-build" >&2
        exit 1
    fi
    # dtrun is its own package (no features): a second cargo call, under the same time limit.
    if step build 420 build.log bash -c 'cargo build --release --features nccl,cuda \
        --example nccl_check --example nccl_bench --example nccl_local_cuda \
        --example train_gpt && cargo build --release -p dtrun'; then
        add_row build PASS "$last_secs" "release build, features nccl,cuda"
    else
        add_row build FAIL "$last_secs" "see $logdir/build.log"
    fi
fi

run_step() { # id summary-grep timeout log command...
    local id="$1" pat="$2" limit="$3" log="$4"
    shift 4
    if [[ ! -x "$1" ]]; then
        add_row "$id" SKIP 0 "$1 not built"
        return
    fi
    if step "$id" "$limit" "$log" "$@"; then
        add_row "$id" PASS "$last_secs" "$(grep -E "$pat" "$logdir/$log" | tail -n 1 | cut -c1-90)"
    else
        add_row "$id" FAIL "$last_secs" "exit $?; $(grep -E 'FAIL|error' "$logdir/$log" | head -n 1 | cut -c1-80)"
    fi
}

run_step a1 'nccl_check:' 120 a1_nccl_check.log "$bin/examples/nccl_check" --timeout 60
run_step a2 'nccl_check:' 150 a2_nccl_check_dtrun.log "$bin/dtrun" --nproc "$ngpu" --timeout 140 -- \
    "$bin/examples/nccl_check" --timeout 60
run_step b 'nccl_local_cuda:' 150 b_local_cuda.log "$bin/examples/nccl_local_cuda" --ranks 4 --timeout 60
if [[ -x "$bin/examples/train_gpt" ]] && "$bin/examples/train_gpt" --help 2>/dev/null | grep -q -- '--device'; then
    run_step c 'loss|step' 180 c_train_gpt.log "$bin/examples/train_gpt" --device cuda --steps 5 --json
else
    add_row c SKIP 0 "train_gpt has no --device option (see docs/ARCHITECTURE.md, NCCL backend)"
fi
if ((ngpu > 1)); then
    run_step d 'peak busbw' 180 d_nccl_bench.log "$bin/dtrun" --nproc "$ngpu" --timeout 170 -- \
        "$bin/examples/nccl_bench" --max-bytes 256M
else
    run_step d 'peak' 180 d_nccl_bench.log "$bin/examples/nccl_bench" --max-bytes 256M
fi
if [[ -f "$logdir/d_nccl_bench.log" ]]; then
    echo "== bandwidth (rank 0)"
    grep -E '^(\[rank 0\] )?(#|  +all_)' "$logdir/d_nccl_bench.log" | sed 's/^\[rank 0\] //'
fi

echo
echo "== gpu_check: $ngpu GPU(s), $(( $(date +%s) - t_start )) s total, logs in $logdir"
printf '%-6s %-9s %7s  %s\n' step result time detail
for r in "${rows[@]}"; do echo "$r"; done
if printf '%s\n' "${rows[@]}" | grep -q ' FAIL '; then
    exit 1
fi
