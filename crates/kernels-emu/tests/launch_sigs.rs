//! The launchers' declarations (`crates/kernels/src/launch_sigs.rs`) against the kernels: the
//! emulator's build compiles one `static_assert` per kernel instantiation (`sigcheck.rs`), so a
//! build that passes has every declaration right. These tests show that the check can fail:
//! wrong declarations (a narrower integer, another element type, a missing parameter, a
//! written pointer declared as read) compiled against the same kernels fail, naming exactly the
//! kernels they break; and `cuda.rs` has no launch outside the declared launchers.

#[path = "../sigcheck.rs"]
#[allow(dead_code)]
mod sigcheck;

use std::path::{Path, PathBuf};
use std::process::Command;

use sigcheck::{cpp, instances, Decl, DECLS};

/// Compiles (syntax only) the kernels of the emulator's build followed by `checks`; returns
/// whether it compiled and the compiler's output.
fn compile_against_kernels(checks: &str, tag: &str) -> (bool, String) {
    let out = PathBuf::from(env!("CDT_EMU_OUT"));
    let emu = PathBuf::from(env!("CDT_EMU_DIR"));
    let mut kernels: Vec<PathBuf> = std::fs::read_dir(&out)
        .expect("the emulator build's instrumented kernel sources")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .filter(|p| p.file_name().is_some_and(|n| n != "selftest.cu"))
        .collect();
    kernels.sort();
    assert!(kernels.len() >= 8, "kernel sources: {kernels:?}");
    let mut tu = String::new();
    for k in &kernels {
        tu.push_str(&format!("#include \"{}\"\n", k.display()));
    }
    tu.push_str(checks);
    let dir = std::env::temp_dir().join(format!("cdt-launch-sigs-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let file = dir.join("check.cpp");
    std::fs::write(&file, tu).expect("write the check");
    let o = Command::new(env!("CDT_EMU_CXX"))
        .args(["-std=c++17", "-fsyntax-only", "-DCDT_EMU", "-include"])
        .arg(emu.join("cuda_emu.h"))
        .arg("-I")
        .arg(&emu)
        .arg("-I")
        .arg(&out)
        .arg(&file)
        .output()
        .expect("run the emulator build's C++ compiler");
    let _ = std::fs::remove_dir_all(&dir);
    let text =
        String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
    (o.status.success(), text)
}

/// `DECLS` with the declaration of `launcher` given `params` instead.
fn with_params(
    launcher: &str,
    params: &'static [(&'static str, &'static str, &'static str)],
) -> Vec<Decl> {
    let mut v = DECLS.to_vec();
    let d = v
        .iter_mut()
        .find(|d| d.launcher == launcher)
        .unwrap_or_else(|| panic!("no launcher {launcher}"));
    d.params = params;
    v
}

/// The kernel names whose static_assert failed, from the compiler's output.
fn failed_kernels(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let at = l.find("static assertion failed: ")?;
            let rest = &l[at + "static assertion failed: ".len()..];
            Some(rest.split(':').next()?.trim().to_string())
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn the_declarations_compile_against_the_kernels() {
    // The positive control of the test below: the same compilation with the real declarations
    // (which the emulator's build also compiles) passes, so a failure there is the mutation's.
    let (ok, text) = compile_against_kernels(&cpp(DECLS).expect("declarations"), "ok");
    assert!(ok, "the real declarations failed:\n{text}");
}

#[test]
fn wrong_declarations_fail_naming_exactly_the_kernels_they_break() {
    // Four launchers declared wrong, each in one way.
    let mut decls = with_params(
        "gelu_fwd",
        // `len` as an int: the kernel takes a long long.
        &[("x", "In", "T"), ("y", "Out", "T"), ("len", "i32", "")],
    );
    let norm: &'static [(&str, &str, &str)] = &[
        ("x", "In", "T"),
        ("w", "In", "T"),
        ("b", "Opt", "T"),
        // f32 whatever T: right for the f32 kernel only.
        ("y", "Out", "f32"),
        ("rows", "i64", ""),
        ("n", "i32", ""),
        ("eps", "f32", ""),
        ("center", "i32", ""),
    ];
    let emb: &'static [(&str, &str, &str)] = &[
        ("ids", "In", "u32"),
        ("n", "i32", ""),
        ("g", "In", "T"),
        ("dtable", "Out", "T"),
        // `vocab` missing.
        ("d", "i32", ""),
    ];
    let xent: &'static [(&str, &str, &str)] = &[
        ("x", "In", "T"),
        // The targets declared written.
        ("tgt", "Out", "I"),
        ("out", "Out", "f32"),
        ("rows", "i64", ""),
        ("n", "i32", ""),
        ("ignore", "i64", ""),
        ("has_ignore", "i32", ""),
    ];
    for (launcher, params) in [
        ("norm_fwd", norm),
        ("embedding_bwd", emb),
        ("xent_fwd", xent),
    ] {
        let d = decls
            .iter_mut()
            .find(|d| d.launcher == launcher)
            .unwrap_or_else(|| panic!("no launcher {launcher}"));
        d.params = params;
    }
    let (ok, text) = compile_against_kernels(&cpp(&decls).expect("declarations"), "bad");
    assert!(!ok, "wrong declarations compiled");
    let want: Vec<String> = [
        "cdt_embedding_bwd_bf16",
        "cdt_embedding_bwd_f32",
        "cdt_gelu_fwd_bf16",
        "cdt_gelu_fwd_f32",
        "cdt_norm_fwd_bf16",
        "cdt_xent_fwd_bf16_i64",
        "cdt_xent_fwd_bf16_u32",
        "cdt_xent_fwd_f32_i64",
        "cdt_xent_fwd_f32_u32",
    ]
    .map(String::from)
    .to_vec();
    assert_eq!(failed_kernels(&text), want, "compiler output:\n{text}");
}

#[test]
fn every_declared_instance_is_a_distinct_kernel() {
    let mut names = Vec::new();
    for d in DECLS {
        let inst = instances(d).unwrap_or_else(|e| panic!("{e}"));
        assert!(!inst.is_empty(), "{}: no instance", d.launcher);
        names.extend(inst.into_iter().map(|(n, _)| n));
    }
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n, "a kernel declared twice");
    // Spot checks of the expansion: placeholders of types and of values, a fixed name.
    for k in [
        "cdt_fa_bwd_dq_tc_bf16_d128",
        "cdt_fa_fwd_f32_d48",
        "cdt_xent_bwd_bf16_i64",
        "cdt_add_rows_bf16_f32",
        "cdt_adamw_f32",
    ] {
        assert!(names.iter().any(|x| x == k), "{k} not declared");
    }
    assert!(!names.iter().any(|x| x.starts_with("cdt_fa_fwd_tc_f32")));
}

#[test]
fn malformed_declarations_are_refused() {
    let base = DECLS
        .iter()
        .find(|d| d.launcher == "gelu_fwd")
        .copied()
        .expect("gelu_fwd");
    let no_domain = Decl {
        name: "cdt_gelu_fwd_{T}_{X}",
        ..base
    };
    assert!(instances(&no_domain).unwrap_err().contains("has no domain"));
    let bad_kind = Decl {
        params: &[("x", "Inn", "T")],
        ..base
    };
    assert!(instances(&bad_kind)
        .unwrap_err()
        .contains("unknown parameter kind `Inn`"));
    let bad_elem = Decl {
        params: &[("x", "In", "f16")],
        ..base
    };
    assert!(instances(&bad_elem)
        .unwrap_err()
        .contains("unknown element type `f16`"));
}

/// `crates/kernels/src/cuda.rs` without `//` comments.
fn cuda_rs_code() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/src/cuda.rs");
    std::fs::read_to_string(&path)
        .expect("read crates/kernels/src/cuda.rs")
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn cuda_rs_launches_only_through_the_declared_launchers() {
    // The launchers' macro is the one place that loads a kernel and pushes its arguments; a
    // launch written out elsewhere would bypass the declarations and their check.
    let code = cuda_rs_code();
    for needle in [".builder()", "get_or_load_custom_func(", ".launch(cfg)"] {
        assert_eq!(
            code.matches(needle).count(),
            1,
            "`{needle}` in cuda.rs outside the launchers' macro"
        );
    }
    // And every launcher cuda.rs calls is declared (the cuda build checks the arguments; this
    // runs in every build).
    let declared: Vec<&str> = DECLS.iter().map(|d| d.launcher).collect();
    let mut called = 0;
    for part in code.split("launch::").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() || name == "NAME" {
            continue;
        }
        assert!(
            declared.contains(&name.as_str()),
            "launch::{name} is not declared"
        );
        called += 1;
    }
    assert!(
        called >= 20,
        "only {called} launcher calls found in cuda.rs"
    );
}
