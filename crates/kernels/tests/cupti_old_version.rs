//! A CUPTI whose API version is not one whose kernel records are known to carry a name at the
//! offset read (`cuptiGetVersion` outside CUDA 10.0-13.x): kernels are counted and timed, and
//! no name is read. Its own test binary: the loader keeps its first result for the process.

use candle_dtensor_kernels::profile::cupti::KernelCounter;

#[path = "support/cupti.rs"]
mod support;

#[test]
fn names_are_read_only_for_known_record_layouts() {
    let lib = support::build_fake();
    // SAFETY: the only test of this binary; no other thread reads the environment now.
    unsafe {
        std::env::set_var("CDT_CUPTI_LIB", &lib);
        // CUDA 9's CUPTI (API version 11): kernel records older than CUpti_ActivityKernel4.
        std::env::set_var("FAKE_CUPTI_VERSION", "11");
    }
    // SAFETY: the fake's initialisers do nothing; `fake_run` takes an int.
    let fake = unsafe { libloading::Library::new(&lib) }.expect("the fake loads");
    let run: unsafe extern "C" fn(i32) = unsafe { *fake.get(b"fake_run\0").expect("fake_run") };
    let counter = KernelCounter::start().expect("counting starts on the fake");
    // SAFETY: a plain call into the fake.
    unsafe { run(5) };
    let c = counter.take().expect("flush");
    assert_eq!((c.kernels, c.busy_ns, c.malformed), (5, 1250, 0), "{c:?}");
    assert!(c.by_name.is_empty(), "names read: {:?}", c.by_name);
}
