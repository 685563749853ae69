#!/usr/bin/env bash
# The GPU benchmark: train_gpt side by side with its PyTorch twin on the same GPU, in one
# prepared command (issue 33, items 5 and 6). Nothing is built or downloaded here.
#
#   scripts/gpu_bench.sh --bin-dir target/gpu/bin                 # the matrix, at most 8 minutes
#   scripts/gpu_bench.sh --bin-dir target/gpu/bin --real-text     # and the real run, same budget
#   scripts/gpu_bench.sh --bin-dir target/gpu/bin --no-matrix --real-text   # only the real run
#   scripts/gpu_bench.sh --bin-dir target/gpu/bin --quick         # a smoke run, at most 4 minutes
#   scripts/gpu_bench.sh --bin target/debug/examples/train_gpt --device cpu --quick --presets tiny
#
# Options of this script (the rest go to scripts/peers/gpu_bench.py; see its --help):
#   --bin-dir DIR   prebuilt binaries (scripts/build_gpu.sh): DIR/train_gpt or DIR/examples/train_gpt
#   --bin-tar TAR   the same as a tarball (target/gpu/gpu_bins.tar.xz)
#   --bin PATH      a train_gpt binary
#   --python PY     python with torch (default: python3 when it imports torch, else
#                   target/peers-venv/bin/python of scripts/peers/setup_torch.sh)
#   --device D      cuda (default) or cpu (a dry run of the whole pipeline without a GPU)
#   --out DIR       output folder (default target/gpu_bench; git-ignored)
#   --quick         3 + 5 steps per run, presets small and gpt2, real run 40 steps, attention at one
#                   shape, budget 240 s
#
# What runs, in priority order (the issue's targets first), each a separate process under its
# own timeout, while the --budget (default 480 s) lasts: a bf16 / tf32 / f32 GEMM rate
# (8192^3 torch.matmul, CUDA events); attention alone, bf16 and causal, forward and forward +
# backward: attn_bench (from the binaries' folder) beside torch's scaled_dot_product_attention
# at GPT-2 small's and medium's shapes and a 128-wide head (--no-attention leaves it out); then
# for presets {small, gpt2, gpt2-medium} x precisions
# {f32, tf32, bf16}: train_gpt --device cuda --precision P --preset X --batch 8 --seq-len T,
# the twin in eager mode (SDPA attention) and the twin under torch.compile, 5 warm-up + 30
# measured steps each; with --real-text the nanoGPT-shaped byte model (6 layers, 6 heads, 384
# wide, 256 tokens, batch 64, 500 steps, held-out loss every 100) ours vs the twin from the same
# initial parameters on the text scripts/real_text.sh fetches (target/real_text/shakespeare.txt,
# checked against real_text.sh's SHA-256; fetch it on a machine with a network,
# `scripts/real_text.sh --fetch-only`, and carry it).
# A run that fails, runs out of memory or times out is recorded with its error; the rest go on.
# Budget (guesses for one H100/H200, not measurements): the matrix without torch.compile about
# 5 minutes, torch.compile 20-90 s per run of compiling; the priority order (gpu_bench.py's
# `priority`) runs the GEMM rate, then every target that needs only ours and eager (gpt2 bf16,
# small f32, gpt2 f32 and tf32, gpt2-medium bf16 ours), the real run, gpt2 bf16 under
# torch.compile, the attention comparison, then the rest.
#
# Writes into --out: gpu_bench.json (every run: command, status, error, per-step times, peak
# memory, losses; the GEMM rates; the real run; GPU, date, commit), table.md (the Markdown of
# scripts/peers/gpu_bench_report.py: ours vs eager vs compile, ratios, MFU, the targets) and
# logs/. Exit status: 0 when the JSON and table were written (whatever the runs did), 1 when
# the benchmark could not start, 2 on a usage error.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bin="" bin_dir="" bin_tar="" python="" device=cuda out=target/gpu_bench quick=0
rest=()
while (($#)); do
    case "$1" in
        --bin-dir) bin_dir="$2"; shift ;;
        --bin-tar) bin_tar="$2"; shift ;;
        --bin) bin="$2"; shift ;;
        --python) python="$2"; shift ;;
        --device) device="$2"; shift ;;
        --out) out="$2"; shift ;;
        --quick) quick=1 ;;
        -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
        *) rest+=("$1") ;;
    esac
    shift
done
say() { echo "gpu_bench.sh: $*" >&2; }

if [[ -n "$bin_tar" ]]; then
    tmpbin="$(mktemp -d)"
    trap 'rm -rf "$tmpbin"' EXIT
    tar -C "$tmpbin" -xJf "$bin_tar" || { say "cannot unpack $bin_tar"; exit 1; }
    bin_dir="$tmpbin/bin"
fi
if [[ -z "$bin" ]]; then
    [[ -n "$bin_dir" ]] || { say "name the binaries: --bin-dir DIR, --bin-tar TAR or --bin PATH"; exit 2; }
    bin="$bin_dir/train_gpt"
    [[ -x "$bin" ]] || bin="$bin_dir/examples/train_gpt"
fi
[[ -x "$bin" ]] || { say "train_gpt not found or not executable: $bin"; exit 1; }
bin_dir="$(cd "$(dirname "$bin")" && pwd)"
bin="$bin_dir/$(basename "$bin")"

if [[ -z "$python" ]]; then
    if python3 -c 'import torch' >/dev/null 2>&1; then
        python="$(command -v python3)"
    elif [[ -x target/peers-venv/bin/python ]]; then
        python="$root/target/peers-venv/bin/python"
    else
        say "no python with torch (pass --python, or run scripts/peers/setup_torch.sh)"; exit 1
    fi
fi
"$python" -c 'import torch' 2>/dev/null || { say "$python cannot import torch"; exit 1; }

gpu_name=cpu
ours_ld=""
if [[ "$device" == cuda* ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        say "no GPU visible (nvidia-smi -L failed); --device cpu dry-runs the pipeline"
        exit 1
    fi
    gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader | sed 's/^/gpu: /' >&2
    # train_gpt's runtime libraries, found as scripts/gpu_check.sh finds them (unversioned
    # names for cudarc's loader; the pip wheels of torch's python; the CUDA runtime that travels
    # with prebuilt binaries). Set for train_gpt only, so that torch loads its own as usual.
    libdir="$(mktemp -d)"
    trap 'rm -rf "$libdir" ${tmpbin:+"$tmpbin"}' EXIT
    # shellcheck source=lib/cuda_libs.sh
    source "$root/scripts/lib/cuda_libs.sh"
    cdt_cuda_libs "$libdir" "$bin_dir" "$python"
    ours_ld="$cuda_lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    missing="$(LD_LIBRARY_PATH="$ours_ld" ldd "$bin" 2>&1 | awk '/not found/ {print $1}' | paste -sd, -)"
    [[ -n "$missing" ]] && say "warning: train_gpt's libraries not found: $missing (its runs will fail)"
fi

commit="$(git rev-parse --short HEAD 2>/dev/null || true)"
if [[ -n "$commit" ]]; then
    git diff --quiet HEAD -- 2>/dev/null || commit="$commit+dirty"
fi
built=""
[[ -f "$bin_dir/BUILD_INFO" ]] && built="$(paste -sd' ' "$bin_dir/BUILD_INFO")"
if [[ -z "$commit" ]]; then
    commit="$(sed -n 's/^commit=//p' "$bin_dir/BUILD_INFO" 2>/dev/null | head -n 1)"
    commit="${commit:+$commit (of the binaries)}"
fi
text_sha="$(sed -n 's/^TEXT_SHA256=//p' scripts/real_text.sh | head -n 1)"

quick_args=()
if ((quick)); then
    quick_args=(--steps 5 --warmup 3 --presets small,gpt2 --real-steps 40 --real-eval-every 20
                --real-eval-batches 2 --budget 240 --attn-iters 5)
    # Attention at GPT-2 small's shape on a GPU; a small one for a dry run on the CPU.
    if [[ "$device" == cuda* ]]; then quick_args+=(--attn-shapes "8,12,1024,64")
    else quick_args+=(--attn-shapes "1,2,128,64"); fi
fi
say "train_gpt: $bin${built:+ ($built)}; python: $python; device: $device ($gpu_name); out: $out"
CDT_OURS_LD_LIBRARY_PATH="$ours_ld" "$python" scripts/peers/gpu_bench.py \
    --train-gpt "$bin" --python "$python" --device "$device" --out "$out" \
    --gpu-name "$gpu_name" --commit "${commit:-unknown}" --binaries "$built" --text-sha256 "$text_sha" \
    ${quick_args[@]+"${quick_args[@]}"} ${rest[@]+"${rest[@]}"}
rc=$?
((rc == 0)) || { say "the driver failed (exit $rc)"; exit 1; }
