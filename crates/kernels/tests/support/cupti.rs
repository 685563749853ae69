//! Shared by the CUPTI loading tests (each its own binary: the loader keeps its first result).

/// Whether a real CUPTI is on the loader's path under one of the fallback names: then counting
/// may start although the named library was not CUPTI.
pub fn a_real_cupti_loads() -> bool {
    ["libcupti.so", "libcupti.so.13", "libcupti.so.12"]
        .iter()
        // SAFETY: loading CUPTI runs only its initialisers; the handle is dropped at once.
        .any(|n| unsafe { libloading::Library::new(*n) }.is_ok())
}
