#!/usr/bin/env bash
# A static profile of the fused CUDA kernels, without a GPU: compiles a kernel source to a cubin
# for one architecture with the pip CUDA toolkit, and prints per kernel what ptxas used
# (registers, shared memory, spills) and the machine instructions by kind that matter for
# speed (tensor-core HMMA, shared LDS/LDSM/STS, generic LD, global LDG/STG, asynchronous
# copies LDGSTS and their DEPBAR waits, barriers), read from `cuobjdump -sass`. It is how
# docs/ARCHITECTURE.md's figures for the tensor-core attention were read (no spills, LDSM
# per HMMA); it says nothing of the time a kernel takes.
#
#   scripts/kernel_profile.sh                          # flash_attn.cu, the _tc_ kernels, sm_90
#   scripts/kernel_profile.sh --arch 80 --filter 'cdt_fa_fwd_'
#   scripts/kernel_profile.sh --source crates/kernels/cuda/norm.cu --filter cdt_norm
#
# Needs the toolkit of scripts/setup_cuda.sh (installed on first use, as CI's CUDA stage does)
# and cuobjdump with the nvdisasm it runs, which that toolkit lacks: the `nvidia-cuda-cuobjdump`
# and `nvidia-cuda-nvdisasm` wheels are installed with pip into $CDT_CUDA_TOOLS (default
# .cuda-tools/, git-ignored) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

src=crates/kernels/cuda/flash_attn.cu arch=90 filter='_tc_'
while (($#)); do
    case "$1" in
        --source) src="$2"; shift ;;
        --arch) arch="$2"; shift ;;
        --filter) filter="$2"; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "kernel_profile.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ -f "$src" ]] || { echo "kernel_profile.sh: no source $src" >&2; exit 2; }
[[ "$arch" =~ ^[0-9]+$ ]] || { echo "kernel_profile.sh: --arch takes a number such as 80 or 90" >&2; exit 2; }

eval "$(scripts/setup_cuda.sh)"
tools="${CDT_CUDA_TOOLS:-$PWD/.cuda-tools}"
cuobjdump="$tools/nvidia/cu13/bin/cuobjdump"
if [[ ! -x "$cuobjdump" || ! -x "$tools/nvidia/cu13/bin/nvdisasm" ]]; then
    echo "kernel_profile.sh: installing cuobjdump and nvdisasm (pip wheels) into $tools" >&2
    python3 -m pip install --quiet --no-deps --upgrade --target "$tools" \
        nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
fi
[[ -x "$cuobjdump" ]] || { echo "kernel_profile.sh: no cuobjdump at $cuobjdump after pip" >&2; exit 1; }
export PATH="$tools/nvidia/cu13/bin:$PATH"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$CUDA_HOME/bin/nvcc" -cubin -arch="sm_$arch" -O3 -std=c++17 -I "$(dirname "$src")" \
    -Xptxas -v -o "$work/k.cubin" "$src" 2> "$work/ptxas.txt"
"$cuobjdump" -sass "$work/k.cubin" > "$work/k.sass"

# ptxas -v prints, per entry: "Compiling entry function 'NAME' for 'sm_XX'", a line of stack
# and spill bytes, then "Used N registers, ... bytes smem".
awk -v filter="$filter" '
    /Compiling entry function/ { name = $0; sub(/.*function \047/, "", name); sub(/\047.*/, "", name); next }
    /bytes stack frame/ { spill[name] = $0; sub(/^ */, "", spill[name]); next }
    /Used [0-9]+ registers/ {
        if (name ~ filter) {
            regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
            smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
            printf "%s\t%s\t%s\t%s\n", name, regs, smem, spill[name]
        }
    }' "$work/ptxas.txt" | sort > "$work/usage.tsv"
[[ -s "$work/usage.tsv" ]] || { echo "kernel_profile.sh: no kernel of $src matches '$filter'" >&2; exit 1; }

echo "# $src, sm_$arch ($("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*'))"
while IFS=$'\t' read -r name regs smem spill; do
    echo "$name: $regs registers, $smem B static shared memory; $spill"
    awk -v f="$name" '/Function : /{ p = ($3 == f) } p' "$work/k.sass" \
        | grep -oE '^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T] )?[A-Z0-9]+(\.[A-Z0-9_]+)*' \
        | awk '{ print $NF }' \
        | grep -E '^(HMMA|LDSM|LDS|STS|LD|ST|LDG|STG|LDGSTS|LDGDEPBAR|DEPBAR|BAR|SHFL)(\.|$)' \
        | sort | uniq -c | sort -rn | awk '{ printf "  %s %s", $2, $1 } END { print "" }'
done < "$work/usage.tsv"
