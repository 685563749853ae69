//! Without a CUPTI library, kernel counting is off with a typed error naming what was tried.

use candle_dtensor_kernels::profile::cupti::KernelCounter;
use candle_dtensor_kernels::profile::ProfileError;

#[path = "support/cupti.rs"]
mod support;

#[test]
fn a_missing_library_is_a_typed_error_naming_the_candidates() {
    let bogus = "/nonexistent/libcupti-for-a-test.so";
    // SAFETY: no other thread of this test binary reads the environment now.
    unsafe { std::env::set_var("CDT_CUPTI_LIB", bogus) };
    match KernelCounter::start() {
        Err(ProfileError::NoCupti { tried, message }) => {
            assert!(tried.starts_with(bogus), "the named library first: {tried}");
            assert!(tried.contains("libcupti.so"), "{tried}");
            assert!(!message.is_empty());
        }
        // A machine with a real CUPTI on the loader's path: the fallback names loaded it.
        Ok(_) => assert!(
            support::a_real_cupti_loads(),
            "counting started although no CUPTI can be loaded"
        ),
        Err(other) => panic!("expected NoCupti, got {other}"),
    }
}
