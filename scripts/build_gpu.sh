#!/usr/bin/env bash
# Builds the binaries scripts/gpu_check.sh runs, on a machine WITHOUT a GPU, so a GPU machine
# only runs them (its minutes are scarce; a build there takes longer than the whole check).
# Besides the examples and dtrun: kernels_cuda_fused, the test binary of
# crates/kernels/tests/cuda_fused.rs (the fused CUDA kernels against their CPU references).
#
#   scripts/build_gpu.sh              # -> target/gpu/bin/ (stripped) and target/gpu/gpu_bins.tar.xz
#   CUDA_COMPUTE_CAP=80 scripts/build_gpu.sh   # another GPU generation (default 90: H100/H200)
#
# How it links without CUDA: candle's `cuda` feature links libcuda, libnccl, libcublas,
# libcublasLt, libcurand and libnvrtc dynamically. The libraries are compiled first (nothing is
# linked yet), the symbols they import from each CUDA library are read with `nm`, and a stub
# shared library per CUDA library is generated that defines exactly those symbols, with the
# real library's soname (libcuda.so.1, libnccl.so.2, libcublas.so.13, ...). The binaries link
# against the stubs and load the real libraries on the GPU machine (the NVIDIA driver's
# libcuda, the CUDA 13 libraries cuBLAS / cuRAND / NVRTC, NCCL 2.x; the CUDA runtime,
# libcudart.so.13, travels in the bin directory); `gpu_check.sh` reports any it cannot find.
#
# Toolkit: the pip CUDA 13.0 wheels (scripts/setup_cuda.sh with CDT_CUDA_VERSION=13.0.88 in
# .cuda-13.0/): candle's kernels are PTX, and PTX of the oldest CUDA 13 nvcc loads on every
# CUDA 13 driver (newer PTX does not load on older drivers). Debug info is not built and
# symbols are stripped, so the binaries are quick to copy (the tarball is what travels; the
# PTX compresses well). dtrun needs no CUDA and is built without the features.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
t0=$(date +%s)

export CDT_CUDA_VERSION="${CDT_CUDA_VERSION:-13.0.88}"
export CDT_CUDA_DIR="${CDT_CUDA_DIR:-$root/.cuda-13.0}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
eval "$(scripts/setup_cuda.sh)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/gpu}"
export CARGO_PROFILE_RELEASE_DEBUG=0
export CARGO_PROFILE_RELEASE_STRIP=symbols
out="$CARGO_TARGET_DIR/bin"
stubs="$CARGO_TARGET_DIR/stubs"
examples=(nccl_check nccl_bench nccl_local_cuda train_gpt train_llama adamw_bench attn_bench)

echo "== 1/4 libraries with --features nccl,cuda (nvcc $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*'), sm_$CUDA_COMPUTE_CAP)"
cargo build --release --features nccl,cuda --lib

echo "== 2/4 stub CUDA libraries from the symbols the libraries import"
rm -rf "$stubs" && mkdir -p "$stubs"
# Every rlib of the build (cudarc's bindings, candle's CUDA backend, ours).
mapfile -t rlibs < <(ls "$CARGO_TARGET_DIR"/release/deps/*.rlib)
nm -u --format=just-symbols "${rlibs[@]}" 2>/dev/null | sed 's/@.*//' | sort -u > "$stubs/imports.txt"
stub() { # library soname symbol-regex
    local lib="$1" soname="$2" re="$3"
    grep -E "$re" "$stubs/imports.txt" | awk '{print "void " $1 "(void) {}"}' > "$stubs/$lib.c" || true
    if [[ ! -s "$stubs/$lib.c" ]]; then
        echo "/* no symbols imported from lib$lib */" > "$stubs/$lib.c"
    fi
    gcc -shared -fPIC -o "$stubs/lib$lib.so" -Wl,-soname,"$soname" "$stubs/$lib.c"
    echo "   lib$lib.so ($soname): $(grep -c '^void' "$stubs/$lib.c" || true) symbols"
}
stub cuda libcuda.so.1 '^cu[A-Z]'
stub nccl libnccl.so.2 '^nccl'
stub cublasLt libcublasLt.so.13 '^cublasLt'
stub cublas libcublas.so.13 '^cublas([^L]|L[^t])'
stub curand libcurand.so.10 '^curand'
stub nvrtc libnvrtc.so.13 '^nvrtc'
# candle's kernels (libmoe.a) link the CUDA runtime; the pip toolkit has the real one, which is
# small and travels with the binaries.
cudart="$(ls "$CUDA_HOME"/lib/libcudart.so.[0-9]* | head -n 1)"
ln -sf "$cudart" "$stubs/libcudart.so"
echo "   libcudart.so -> $cudart"

echo "== 3/4 binaries against the stubs"
args=()
for e in "${examples[@]}"; do args+=(--example "$e"); done
LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" \
    cargo build --release --features nccl,cuda "${args[@]}"
# The fused-kernel test binary (cargo names it with a hash; the path is in its JSON messages).
kernels_test=$(LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" \
    cargo test --release -p candle-dtensor-kernels --features cuda --test cuda_fused --no-run \
    --message-format=json | sed -n 's/.*"executable":"\([^"]*cuda_fused[^"]*\)".*/\1/p' | tail -n 1)
[[ -n "$kernels_test" ]] || { echo "build_gpu.sh: no cuda_fused test executable" >&2; exit 1; }
# dtrun launches processes; it has no CUDA dependency.
cargo build --release -p dtrun

echo "== 4/4 $out and the tarball"
rm -rf "$out" && mkdir -p "$out"
for e in "${examples[@]}"; do cp "$CARGO_TARGET_DIR/release/examples/$e" "$out/"; done
cp "$kernels_test" "$out/kernels_cuda_fused"
cp "$CARGO_TARGET_DIR/release/dtrun" "$out/"
cp "$cudart" "$out/"
{
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
    echo "nvcc=$CDT_CUDA_VERSION"
    echo "compute_cap=$CUDA_COMPUTE_CAP"
} > "$out/BUILD_INFO"
# One xz stream with a dictionary larger than the whole tar (466 MB at f607f3f): the binaries
# share most of their bytes (candle's PTX, the Rust libraries), which a 64 MiB window (-9's)
# cannot see across files. 54.7 MB -> 13.6 MB; compressing takes about 4 minutes and 5 GiB,
# unpacking 512 MiB.
tar -C "$CARGO_TARGET_DIR" -cf - bin | xz -9 --lzma2=preset=9,dict=512MiB -T1 \
    > "$CARGO_TARGET_DIR/gpu_bins.tar.xz.tmp"
mv "$CARGO_TARGET_DIR/gpu_bins.tar.xz.tmp" "$CARGO_TARGET_DIR/gpu_bins.tar.xz"
du -sh "$out" "$CARGO_TARGET_DIR/gpu_bins.tar.xz"
ls -l "$out"
echo "== build_gpu.sh: done in $(( $(date +%s) - t0 )) s; then, here: scripts/gpu_session.sh --prepare"
echo "   (it checks what travels and prints the device call: scripts/gpu_session.sh --out \"\$OUT\")"
