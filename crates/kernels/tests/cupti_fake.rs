//! `profile::cupti` against a stand-in CUPTI (tests/support/fake_cupti.c, compiled here with the
//! system C compiler): loading, the buffer round trip, counting, and the bounds checks against
//! a library that misbehaves. One test function: CUPTI's state is process-global.

use candle_dtensor_kernels::profile::cupti::{KernelCount, KernelCounter, KernelTime};
use candle_dtensor_kernels::profile::ProfileError;

#[path = "support/cupti.rs"]
mod support;
use support::build_fake;

type Run = unsafe extern "C" fn(i32);

#[test]
fn counts_kernels_through_cupti_and_survives_a_misbehaving_library() {
    // Named before the first load: the loader keeps its result for the process.
    let lib = build_fake();
    // SAFETY: no other thread of this test binary reads the environment now.
    unsafe { std::env::set_var("CDT_CUPTI_LIB", &lib) };

    // SAFETY: the fake library's initialisers do nothing; `fake_run` and `fake_mode` take an
    // int, as declared.
    let fake = unsafe { libloading::Library::new(&lib) }.expect("the fake loads");
    let run: Run = unsafe { *fake.get(b"fake_run\0").expect("fake_run") };
    let mode: Run = unsafe { *fake.get(b"fake_mode\0").expect("fake_mode") };

    let counter = KernelCounter::start().expect("counting starts on the fake");
    assert!(
        matches!(KernelCounter::start(), Err(ProfileError::Busy)),
        "a second counter while one is on"
    );
    // SAFETY: plain calls into the fake.
    unsafe { run(7) };
    let c = counter.take().expect("flush");
    assert_eq!(
        c,
        KernelCount {
            kernels: 7,
            busy_ns: 7 * 250,
            dropped: 0,
            malformed: 0,
            by_name: [("gemm", 3), ("(unnamed)", 2), ("softmax", 2)]
                .map(|(name, count)| KernelTime {
                    name: name.into(),
                    count,
                    busy_ns: count * 250
                })
                .to_vec(),
        },
        "seven kernel records of 250 ns, named gemm, softmax, none in turn, most time first \
         (ties by name); the memcpy record is not a kernel"
    );
    assert_eq!(
        counter.take().unwrap(),
        KernelCount::default(),
        "counts start afresh"
    );

    // A record pointer past the valid bytes: not read, reported.
    unsafe {
        mode(1);
        run(3);
    }
    let c = counter.take().unwrap();
    assert_eq!((c.kernels, c.malformed), (0, 1), "{c:?}");
    // The last kernel record cut short: the whole ones count, the cut one is reported.
    unsafe {
        mode(2);
        run(4);
    }
    let c = counter.take().unwrap();
    assert_eq!((c.kernels, c.busy_ns, c.malformed), (3, 750, 1), "{c:?}");
    let named: u64 = c.by_name.iter().map(|k| k.count).sum();
    assert_eq!(named, 3, "only whole records are named: {:?}", c.by_name);
    // Dropped records are reported.
    unsafe {
        mode(3);
        run(2);
    }
    let c = counter.take().unwrap();
    assert_eq!((c.kernels, c.dropped, c.malformed), (2, 5, 0), "{c:?}");
    // An error from the iteration stops the buffer and is reported.
    unsafe {
        mode(4);
        run(2);
    }
    let c = counter.take().unwrap();
    assert_eq!(c.malformed, 1, "{c:?}");
    // A buffer this client never supplied: not read, not freed, reported.
    unsafe {
        mode(5);
        run(3);
    }
    let c = counter.take().unwrap();
    assert_eq!((c.kernels, c.malformed), (0, 1), "{c:?}");
    // An iteration that hands back an earlier record: stops, reported (no endless loop).
    unsafe {
        mode(6);
        run(3);
    }
    let c = counter.take().unwrap();
    assert_eq!((c.kernels, c.malformed), (0, 1), "{c:?}");
    unsafe { mode(0) };
    // Counting goes on after both.
    unsafe { run(2) };
    assert_eq!(counter.take().unwrap().kernels, 2);

    // Dropping the counter turns the records off; a new one can start.
    drop(counter);
    let enabled: unsafe extern "C" fn() -> i32 = unsafe { *fake.get(b"fake_enabled\0").unwrap() };
    assert_eq!(
        unsafe { enabled() },
        0,
        "records off after the counter is dropped"
    );
    let again = KernelCounter::start().expect("a new counter after the first was dropped");
    unsafe { run(1) };
    assert_eq!(again.take().unwrap().kernels, 1);
}
