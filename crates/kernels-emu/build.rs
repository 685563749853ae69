//! Compiles the CUDA execution-model emulator (`emu/emu.cpp`) and the launch shims
//! (`emu/shims.cpp`, which include the kernels' own `.cu` sources from `crates/kernels/cuda`,
//! unchanged) as C++17 into one static library.
use std::path::PathBuf;

fn main() {
    let dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let emu = dir.join("emu");
    let cuda = dir.join("../kernels/cuda");
    println!("cargo:rerun-if-changed={}", emu.display());
    println!("cargo:rerun-if-changed={}", cuda.display());
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include(&emu)
        .include(&cuda)
        .define("CDT_EMU", None)
        .flag("-include")
        .flag(emu.join("cuda_emu.h").to_str().expect("a UTF-8 path"))
        // The kernels' own warnings are nvcc's business; the emulator's are ours.
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        // `#pragma unroll` is nvcc's; g++ ignores it.
        .flag_if_supported("-Wno-unknown-pragmas")
        .opt_level(2)
        // No multiply-add contraction: a kernel's `a * b + c` rounds twice here as nvcc's
        // `__fmul_rn`/`__fadd_rn` do (nvcc does contract plain `a * b + c`: tolerances cover it).
        .flag_if_supported("-ffp-contract=off")
        // CUDA code reads and writes one buffer through several types (16-byte vector copies
        // of bf16 tiles); nvcc allows it, so the host compiler must not assume otherwise.
        .flag_if_supported("-fno-strict-aliasing")
        .file(emu.join("emu.cpp"))
        .file(emu.join("shims.cpp"))
        .compile("cdt_kernels_emu");
}
