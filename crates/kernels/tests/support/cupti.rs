//! Shared by the CUPTI loading tests (each its own binary: the loader keeps its first result).

/// Whether a real CUPTI is on the loader's path under one of the fallback names: then counting
/// may start although the named library was not CUPTI.
#[allow(dead_code)] // not every test binary including this module asks
pub fn a_real_cupti_loads() -> bool {
    ["libcupti.so", "libcupti.so.13", "libcupti.so.12"]
        .iter()
        // SAFETY: loading CUPTI runs only its initialisers; the handle is dropped at once.
        .any(|n| unsafe { libloading::Library::new(*n) }.is_ok())
}

/// The stand-in CUPTI (`tests/support/fake_cupti.c`), compiled with the system C compiler into
/// this test target's scratch directory; its path.
#[allow(dead_code)] // not every test binary including this module builds the fake
pub fn build_fake() -> std::path::PathBuf {
    use std::path::PathBuf;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake_cupti");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    // One file per test binary: two binaries building it at once must not write one file.
    let exe = std::env::current_exe().expect("the test binary's path");
    let stem = exe
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let out = dir.join(format!("libfakecupti-{stem}.so"));
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/fake_cupti.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("{cc} could not run ({e}): a C compiler is needed"));
    assert!(status.success(), "{cc} failed on {}", src.display());
    out
}
