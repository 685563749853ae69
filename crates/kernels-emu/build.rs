//! Compiles the CUDA execution-model emulator (`emu/emu.cpp`) and the launch shims
//! (`emu/shims.cpp`, which include the kernels' own `.cu` sources from `crates/kernels/cuda`)
//! as C++17 into one static library. The sources are compiled as written, with one addition
//! per line that declares `__shared__` arrays (see [`instrument`]).
use std::path::{Path, PathBuf};

#[path = "sigcheck.rs"]
#[allow(dead_code)]
mod sigcheck;

/// `src` with a call to `emu::fresh_shared` for each array a line declares `__shared__`,
/// appended to that line (line numbers stay the kernel's): the emulator fills the array with
/// 0xFF bytes when the first thread of a block reaches it, so a read before the block's first
/// write shows (as NaN for floats) instead of the previous block's values.
///
/// # Panics
///
/// A `__shared__` declaration without its `;` on the same line (not written in these sources;
/// the build would otherwise miss it).
fn instrument(src: &str, file: &str) -> String {
    let mut out = String::with_capacity(src.len() + 1024);
    for (i, line) in src.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let at = code.find("__shared__");
        let Some(at) = at.filter(|_| !code.trim_start().starts_with('#')) else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let decl = &code[at + "__shared__".len()..];
        let end = decl.find(';').unwrap_or_else(|| {
            panic!(
                "{file}:{}: a __shared__ declaration must end on its line",
                i + 1
            )
        });
        let decl = &decl[..end];
        // Declarators: split at commas outside brackets; each one's name is the last
        // identifier before its first `[` (the type and `__align__(n)` come before it in the
        // first one).
        let mut calls = String::new();
        let mut depth = 0i32;
        let mut start = 0;
        let bytes = decl.as_bytes();
        for k in 0..=bytes.len() {
            let c = bytes.get(k).copied().unwrap_or(b',');
            match c {
                b'[' | b'(' => depth += 1,
                b']' | b')' => depth -= 1,
                b',' if depth == 0 => {
                    let d = &decl[start..k.min(decl.len())];
                    let head = d.split('[').next().unwrap_or(d);
                    let name = head
                        .rsplit(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                        .find(|t| !t.is_empty())
                        .unwrap_or_else(|| panic!("{file}:{}: no name in `{d}`", i + 1));
                    calls.push_str(&format!(" ::emu::fresh_shared({name}, sizeof({name}));"));
                    start = k + 1;
                }
                _ => {}
            }
        }
        // Right after the declaration's `;`: before a trailing comment or a macro body's
        // continuation backslash.
        let semi = at + "__shared__".len() + end + 1;
        out.push_str(&line[..semi]);
        out.push_str(&calls);
        out.push_str(&line[semi..]);
        out.push('\n');
    }
    out
}

/// Copies the kernel sources of `from` into `to`, instrumented ([`instrument`]).
fn instrumented_copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the instrumented sources' directory");
    let entries = std::fs::read_dir(from).expect("read a kernel source directory");
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let ext = path.extension().and_then(|e| e.to_str());
        if !matches!(ext, Some("cu" | "cuh")) {
            continue;
        }
        let name = path
            .file_name()
            .expect("a file name")
            .to_string_lossy()
            .into_owned();
        let src = std::fs::read_to_string(&path).expect("read a kernel source");
        std::fs::write(to.join(&name), instrument(&src, &name))
            .expect("write an instrumented kernel source");
    }
}

fn main() {
    let dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let emu = dir.join("emu");
    let cuda = dir.join("../kernels/cuda");
    println!("cargo:rerun-if-changed={}", emu.display());
    println!("cargo:rerun-if-changed={}", cuda.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("cuda");
    instrumented_copy(&cuda, &out);
    // The emulator's own test kernels (`selftest.cu`), instrumented the same way.
    instrumented_copy(&emu.join("selftest"), &out);
    // The launchers' declarations as static_asserts on the kernels' parameters, which
    // `shims.cpp` includes after the kernels (see sigcheck.rs).
    let sigs = dir.join("../kernels/src/launch_sigs.rs");
    println!("cargo:rerun-if-changed={}", sigs.display());
    println!(
        "cargo:rerun-if-changed={}",
        dir.join("sigcheck.rs").display()
    );
    let checks =
        sigcheck::cpp(sigcheck::DECLS).unwrap_or_else(|e| panic!("{}: {e}", sigs.display()));
    std::fs::write(out.join("launch_sigs.inc"), checks).expect("write launch_sigs.inc");
    // The compiler and include paths, for tests/launch_sigs.rs to compile wrong declarations.
    let mut build = cc_build(&emu, &out);
    let cxx = build.get_compiler();
    println!("cargo:rustc-env=CDT_EMU_CXX={}", cxx.path().display());
    println!("cargo:rustc-env=CDT_EMU_DIR={}", emu.display());
    println!("cargo:rustc-env=CDT_EMU_OUT={}", out.display());
    build
        .file(emu.join("emu.cpp"))
        .file(emu.join("shims.cpp"))
        .compile("cdt_kernels_emu");
}

/// The emulator's C++ build: the kernels as `shims.cpp` includes them, under `cuda_emu.h`.
fn cc_build(emu: &Path, out: &Path) -> cc::Build {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .include(emu)
        .include(out)
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
        // Frame pointers: `warp_barrier_aligned` tells where a lane stands by walking its
        // frames' return addresses (emu.cpp `call_site`).
        .flag("-fno-omit-frame-pointer")
        // CUDA code reads and writes one buffer through several types (16-byte vector copies
        // of bf16 tiles); nvcc allows it, so the host compiler must not assume otherwise.
        .flag_if_supported("-fno-strict-aliasing");
    build
}
