# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh: finds the CUDA runtime libraries a
# prebuilt binary needs on a GPU machine.
#
#   cdt_cuda_libs LIBDIR BINDIR PYTHON
#
# Links each of libcuda, libnccl, libcublas, libcublasLt, libcurand, libnvrtc, libcudart and
# libcupti (optional: `train_gpt --count-kernels` loads it at run time) under its unversioned
# name in LIBDIR (cudarc's loader asks for e.g. `libnccl.so`), the first copy of the major
# version the binaries link (libcuda.so.1, libnccl.so.2, libcurand.so.10, the others .so.13)
# before any other version, searching $CDT_CUDA_LIB_DIRS,
# $CUDA_HOME/lib64, CUPTI's extras/CUPTI/lib64, the usual system directories and the `nvidia/*/lib`
# directories of PYTHON's pip wheels (PYTHON may be empty: no wheel search). Sets `cuda_lib_path`
# to LIBDIR, BINDIR when it carries a libcudart (scripts/build_gpu.sh ships the runtime the
# binaries were linked with), and every directory a library was found in, `:`-joined without
# repeats, for LD_LIBRARY_PATH.
cdt_cuda_libs() {
    local libdir="$1" bindir="$2" py="$3" d f lib
    local search=() extra=() found=()
    IFS=: read -r -a extra <<< "${CDT_CUDA_LIB_DIRS:-}"
    search+=("${extra[@]}" "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64
             "${CUDA_HOME:-/usr/local/cuda}/extras/CUPTI/lib64" /usr/local/cuda/extras/CUPTI/lib64
             /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib)
    if [[ -n "$py" ]]; then
        while IFS= read -r d; do [[ -n "$d" ]] && search+=("$d"); done < <("$py" -c '
import glob, os, site
roots = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)' 2>/dev/null || true)
    fi
    # Each library with the major version the binaries were linked against first (a
    # /usr/local/cuda of another CUDA release must not shadow the wheels' CUDA 13 libraries),
    # then any version.
    local spec ver pass
    for spec in cuda:1 nccl:2 cublas:13 cublasLt:13 curand:10 nvrtc:13 cudart:13 cupti:13; do
        lib="${spec%%:*}" ver="${spec#*:}"
        f=""
        for pass in exact any; do
            for d in "${search[@]}"; do
                [[ -d "$d" ]] || continue
                if [[ "$pass" == exact ]]; then
                    f="$(ls -1 "$d"/lib"$lib".so."$ver" "$d"/lib"$lib".so."$ver".* 2>/dev/null | head -n 1 || true)"
                else
                    f="$(ls -1 "$d"/lib"$lib".so "$d"/lib"$lib".so.[0-9]* 2>/dev/null | head -n 1 || true)"
                fi
                if [[ -n "$f" ]]; then
                    ln -sf "$f" "$libdir/lib$lib.so"
                    found+=("$d")
                    break 2
                fi
            done
        done
    done
    ls "$bindir"/libcudart.so.* >/dev/null 2>&1 && found=("$(cd "$bindir" && pwd)" "${found[@]}")
    cuda_lib_path="$(printf '%s\n' "$libdir" "${found[@]}" | awk 'NF && !seen[$0]++' | paste -sd: -)"
}
