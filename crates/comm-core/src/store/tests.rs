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
