//! A library that loads but is not CUPTI is passed over for the next candidate, and named with
//! the function it lacks. Its own test binary: the loader keeps its first result for the
//! process, and the environment is set before any thread reads it.

use candle_dtensor_kernels::profile::cupti::KernelCounter;
use candle_dtensor_kernels::profile::ProfileError;

#[path = "support/cupti.rs"]
mod support;

#[test]
fn a_library_without_the_functions_is_passed_over_and_named() {
    // The C library: always there, never CUPTI.
    // SAFETY: the only test of this binary; no other thread reads the environment now.
    unsafe { std::env::set_var("CDT_CUPTI_LIB", "libc.so.6") };
    match KernelCounter::start() {
        Err(ProfileError::NoCupti { tried, message }) => {
            assert!(tried.starts_with("libc.so.6, libcupti.so"), "{tried}");
            assert!(
                message.starts_with("libc.so.6: ") && message.contains("cuptiActivity"),
                "the C library named with the function it lacks: {message}"
            );
            assert!(
                message.contains("; libcupti.so"),
                "the next candidate was tried: {message}"
            );
        }
        // A machine with a real CUPTI on the loader's path: a later candidate loaded it.
        Ok(_) => assert!(
            support::a_real_cupti_loads(),
            "counting started although no CUPTI can be loaded"
        ),
        Err(other) => panic!("expected NoCupti, got {other}"),
    }
}
