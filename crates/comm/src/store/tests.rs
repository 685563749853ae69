//! The store's tests: requests, waits and timeouts, prefixes, unreachable or wrong servers.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

/// The default timeout of [`pair`]'s client. Long: nothing that passes waits it out, so the
/// timing checks below can bound "did not wait it out" at a third of it, far above what load
/// does, and still fail when it is waited out.
const LONG: Duration = Duration::from_secs(60);

fn pair() -> (TcpStoreServer, Arc<TcpStore>) {
    let server = TcpStoreServer::bind("127.0.0.1:0").expect("bind");
    let client = TcpStore::connect(&server.local_addr().to_string(), LONG).expect("connect");
    (server, Arc::new(client))
}

#[test]
fn set_get_add_check_delete() {
    let (server, s) = pair();
    s.set("a", b"1").unwrap();
    s.set("a", b"hello").unwrap();
    assert_eq!(s.get("a").unwrap(), b"hello");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");
    assert_eq!(s.add("c", 5).unwrap(), 5);
    assert_eq!(s.add("c", -7).unwrap(), -2);
    assert_eq!(s.get("c").unwrap(), b"-2");
    assert_eq!(s.check(&["a", "zz", "c", "yy"]).unwrap(), vec!["zz", "yy"]);
    assert!(s.delete("a").unwrap());
    assert!(!s.delete("a").unwrap());
    assert_eq!(s.check(&["a"]).unwrap(), vec!["a"]);
    match s.add("empty", 1) {
        Err(StoreError::Refused { key, op, .. }) => {
            assert_eq!((key.as_str(), op), ("empty", "add"))
        }
        other => panic!("{other:?}"),
    }
    s.ping().unwrap();
    assert_eq!(server.num_keys(), 2);
}

#[test]
fn large_values_round_trip() {
    let (_server, s) = pair();
    let v: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    s.set("big", &v).unwrap();
    assert_eq!(s.get("big").unwrap(), v);
}

#[test]
fn wait_blocks_until_another_client_sets_the_keys() {
    let (server, s) = pair();
    let other = TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5))
        .expect("connect");
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        other.set("x", b"1").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        other.add("y", 1).unwrap();
    });
    let t0 = Instant::now();
    s.wait(&["x", "y"], LONG).unwrap();
    let took = t0.elapsed();
    // Not before the keys were set (a lower bound: load only adds), and when they were, not at
    // the wait's timeout (a third of it: far above what load adds).
    assert!(took >= Duration::from_millis(140), "{took:?}");
    assert!(took < LONG / 3, "{took:?}");
    t.join().unwrap();
}

#[test]
fn wait_and_get_time_out_naming_the_missing_keys() {
    let (server, s) = pair();
    s.set("here", b"").unwrap();
    let t0 = Instant::now();
    match s.wait(&["here", "gone", "also"], Duration::from_millis(200)) {
        Err(StoreError::Timeout {
            missing, timeout, ..
        }) => {
            assert_eq!(missing, vec!["gone", "also"]);
            assert_eq!(timeout, Duration::from_millis(200));
        }
        other => panic!("{other:?}"),
    }
    let took = t0.elapsed();
    // The wait's own 200 ms were honoured: not less (a lower bound: load only adds), and not
    // the client's long default (a third of it: far above what load adds).
    assert!(
        took >= Duration::from_millis(190) && took < LONG / 3,
        "{took:?}"
    );
    let short =
        TcpStore::connect(&server.local_addr().to_string(), Duration::from_millis(150)).unwrap();
    let e = short.get("never").unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("never"), "{e}");
}

#[test]
fn prefixes_namespace_keys_and_errors() {
    let (_server, s) = pair();
    let a = PrefixStore::new("a", s.clone());
    let b = PrefixStore::new("b", s.clone());
    a.set("k", b"A").unwrap();
    b.set("k", b"B").unwrap();
    assert_eq!(a.get("k").unwrap(), b"A");
    assert_eq!(b.get("k").unwrap(), b"B");
    assert_eq!(s.get("a/k").unwrap(), b"A");
    let nested = PrefixStore::new("n", Arc::new(a.clone()));
    nested.set("x", b"1").unwrap();
    assert_eq!(s.get("a/n/x").unwrap(), b"1");
    match a.wait(&["k", "missing"], Duration::from_millis(50)) {
        Err(StoreError::Timeout { missing, .. }) => assert_eq!(missing, vec!["missing"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(nested.check(&["x", "y"]).unwrap(), vec!["y"]);
}

#[test]
fn an_unreachable_store_fails_fast_naming_address_and_timeout() {
    // A port that was free a moment ago: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let e = TcpStore::connect(&addr, Duration::from_millis(300)).unwrap_err();
    let took = t0.elapsed();
    // Connect retries refused connections until its 300 ms are up, then stops: a generous
    // bound on that (load only adds), not a tight one.
    assert!(took < Duration::from_secs(20), "{took:?}");
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Unreachable { .. }), "{msg}");
    assert!(msg.contains(&addr) && msg.contains("300ms"), "{msg}");
    let c: CommError = e.into();
    assert!(matches!(c, CommError::Bootstrap { .. }), "{c}");
}

#[test]
fn a_listener_that_is_not_a_store_is_reported_not_waited_on() {
    // Accepts connections but never answers the handshake, holding them until the test is done
    // (at most a minute): connect must give up after its own 400 ms, not when the peer closes.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (done, wait_done) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let held: Vec<_> = l.incoming().take(1).collect();
        let _ = wait_done.recv_timeout(LONG);
        drop(held);
    });
    let t0 = Instant::now();
    let e = TcpStore::connect(&addr, Duration::from_millis(400)).unwrap_err();
    let took = t0.elapsed();
    drop(done);
    t.join().unwrap();
    // Waiting for the peer to close takes the minute; a third of it is far above what load adds.
    assert!(took < LONG / 3, "{took:?}");
    assert!(matches!(e, StoreError::Unreachable { .. }), "{e}");
}

#[test]
fn a_stopped_server_makes_requests_fail_not_hang() {
    let (server, s) = pair();
    s.set("k", b"v").unwrap();
    drop(server);
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    assert!(s.set("k2", b"v").is_err());
    // Fails at once, not after the client's long timeout (a third of it: far above what load
    // adds).
    assert!(t0.elapsed() < LONG / 3, "{:?}", t0.elapsed());
}

/// Test support shared with the process backend's tests: the warnings every thread logs, and
/// the largest single allocation a closure makes on its thread.
pub(crate) mod support {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;
    use std::fmt::Write as _;
    use std::sync::{Mutex, Once};

    use tracing::field::{Field, Visit};
    use tracing::span;

    static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

    /// Records every `warn` and `error` event of every thread as `message field=value ...`.
    struct Recorder;

    struct Fields(String);

    impl Visit for Fields {
        fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
            let _ = write!(self.0, "{}={:?} ", f.name(), v);
        }
    }

    impl tracing::Subscriber for Recorder {
        fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
            *m.level() <= tracing::Level::WARN
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, e: &tracing::Event<'_>) {
            let mut f = Fields(String::new());
            e.record(&mut f);
            LOG.lock().unwrap_or_else(|e| e.into_inner()).push(f.0);
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }

    /// Installs the recorder as the process's subscriber (once).
    pub(crate) fn capture_warnings() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            tracing::subscriber::set_global_default(Recorder)
                .expect("no other global subscriber in the comm lib tests");
        });
    }

    /// The warnings recorded so far that contain every string of `all`.
    pub(crate) fn warnings_with(all: &[&str]) -> Vec<String> {
        LOG.lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| all.iter().all(|s| w.contains(s)))
            .cloned()
            .collect()
    }

    thread_local! {
        static ARMED: Cell<bool> = const { Cell::new(false) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    fn note(size: usize) {
        let _ = ARMED.try_with(|a| {
            if a.get() {
                let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
            }
        });
    }

    /// The system allocator, noting the size of every allocation a thread makes while armed.
    struct Counting;

    // SAFETY: every method passes its arguments unchanged to `System`, which upholds the
    // `GlobalAlloc` contract; `note` only touches const-initialised thread-local `Cell`s
    // without destructors (no allocation, no re-entry) and ignores a thread being torn down.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            note(l.size());
            // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
            unsafe { System.alloc(l) }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            note(l.size());
            // SAFETY: as `alloc`.
            unsafe { System.alloc_zeroed(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            // SAFETY: `p` came from `System` (every allocation here does) with layout `l`.
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            note(new);
            // SAFETY: as `dealloc`, with the caller's new size.
            unsafe { System.realloc(p, l, new) }
        }
    }

    #[global_allocator]
    static ALLOC: Counting = Counting;

    /// Runs `f` and returns its result with the largest single allocation (or reallocation)
    /// it made on this thread, in bytes.
    pub(crate) fn peak_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
        PEAK.with(|p| p.set(0));
        ARMED.with(|a| a.set(true));
        let r = f();
        ARMED.with(|a| a.set(false));
        (r, PEAK.with(|p| p.get()))
    }

    /// A seeded generator (SplitMix64): the fuzz tests are the same on every run.
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// Up to `max - 1` random bytes.
        pub(crate) fn upto(&mut self, max: u64) -> Vec<u8> {
            let n = self.below(max) as usize;
            self.bytes(n)
        }
        pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }
}
