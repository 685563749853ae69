//! `examples/kit_backend.rs`: a backend written against the public kit alone passes the
//! conformance suite's basic cases on worlds of 1, 2 and 3 ranks.

#[path = "../examples/kit_backend.rs"]
mod kit_backend;

#[test]
fn a_backend_written_against_the_kit_passes_the_basic_conformance_cases() {
    if let Err(e) = kit_backend::check() {
        panic!("{e}");
    }
}
