//! The closed rendezvous: authentication, refusals and their logs, limits, and a fuzz of the
//! store's frame decoder and request handling.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::server::{handle_request, same_host_for_test, test_table, test_total};
use super::test_support::{capture_warnings, peak_alloc, warnings_with, Rng};
use super::wire::*;
use super::*;
use crate::auth::{dial_challenge, nonce};

const TOKEN: &[u8] = b"the job's secret";

fn cfg() -> StoreConfig {
    let mut c = StoreConfig::default().with_token(TOKEN);
    c.handshake_timeout = Duration::from_millis(400);
    c
}

/// Reads until the peer closes (Ok(bytes read)) or `limit` passes (Err).
fn until_closed(s: &mut TcpStream, limit: Duration) -> Result<usize, String> {
    s.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 256];
    let mut n = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(n),
            Err(e) => return Err(format!("still open after {limit:?}: {e}")),
        }
    }
}

/// A raw connection that completes the handshake with `token`.
fn raw_authenticated(addr: &str, token: &[u8]) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    let n = nonce()?;
    let mut hello = handshake_bytes().to_vec();
    hello.extend_from_slice(&n);
    s.write_all(&hello)?;
    let check = |h: &[u8]| {
        assert_eq!(h, handshake_bytes());
        Ok(())
    };
    dial_challenge(
        &mut s,
        &crate::auth::Token::new(token),
        &STORE_ROLES,
        5,
        check,
        &[b"cdt-store"],
        &n,
        Instant::now() + Duration::from_secs(10),
    )?;
    Ok(s)
}

/// Every way in without the token is refused and logged naming the peer and why, while a job
/// of authenticated clients runs on the same server without a single failed request.
#[test]
fn connections_without_the_token_are_refused_logged_and_the_job_goes_on() {
    capture_warnings();
    let server = TcpStoreServer::bind_with("127.0.0.1:0", cfg()).unwrap();
    let addr = server.local_addr().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    // The job: two authenticated clients setting, adding and reading all along.
    let job: Vec<_> = (0..2)
        .map(|r| {
            let (addr, stop, done) = (addr.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || -> Result<(), StoreError> {
                let s = TcpStore::connect_with(&addr, Duration::from_secs(10), &cfg())?;
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    s.set(&format!("r{r}/k"), &i.to_le_bytes())?;
                    assert_eq!(s.get(&format!("r{r}/k"))?, i.to_le_bytes());
                    s.add("count", 1)?;
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            })
        })
        .collect();

    // 1. A client with no token, 2. one with a wrong token: refused at once, typed.
    for c in [
        StoreConfig::default(),
        StoreConfig::default().with_token(b"a guess"),
    ] {
        let t0 = Instant::now();
        match TcpStore::connect_with(&addr, Duration::from_secs(10), &c) {
            Err(StoreError::Denied { addr: a, reason }) => {
                assert_eq!(a, addr);
                assert!(reason.contains("token"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
    // 3. Garbage instead of a hello: closed.
    let mut g = TcpStream::connect(&addr).unwrap();
    let g_addr = g.local_addr().unwrap().to_string();
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    until_closed(&mut g, Duration::from_secs(10)).unwrap();
    // 4. A connection that never says anything: closed after the handshake timeout.
    let mut idle = TcpStream::connect(&addr).unwrap();
    let idle_addr = idle.local_addr().unwrap().to_string();
    let t0 = Instant::now();
    until_closed(&mut idle, Duration::from_secs(10)).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    // 5. A right hello, then a proof of the wrong token: never acknowledged.
    let mut liar = TcpStream::connect(&addr).unwrap();
    let liar_addr = liar.local_addr().unwrap().to_string();
    let n = nonce().unwrap();
    let mut hello = handshake_bytes().to_vec();
    hello.extend_from_slice(&n);
    liar.write_all(&hello).unwrap();
    let mut answer = [0u8; 5 + crate::auth::NONCE + crate::auth::PROOF];
    liar.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    liar.read_exact(&mut answer).unwrap();
    let parts: [&[u8]; 3] = [b"cdt-store", &n, &answer[5..5 + crate::auth::NONCE]];
    let proof = crate::auth::Token::new(b"a guess").prove(STORE_ROLES.dial, &parts);
    liar.write_all(&proof).unwrap();
    assert_eq!(
        until_closed(&mut liar, Duration::from_secs(10)),
        Ok(0),
        "acknowledged"
    );
    // 6. An authenticated connection that declares a 4 GiB SET: closed, nothing allocated.
    let mut big = raw_authenticated(&addr, TOKEN).unwrap();
    let big_addr = big.local_addr().unwrap().to_string();
    big.write_all(&[0xff, 0xff, 0xff, 0xff, OP_SET]).unwrap();
    until_closed(&mut big, Duration::from_secs(10)).unwrap();

    // The job went on.
    let before = done.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    for j in job {
        j.join().unwrap().expect("the job's requests all succeeded");
    }
    assert!(done.load(Ordering::Relaxed) > before, "the job stalled");
    let server_log = |who: &str, why: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while warnings_with(&[who, why]).is_empty() {
            assert!(
                Instant::now() < deadline,
                "no warning naming {who} and {why:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    server_log(&g_addr, "not a candle-dtensor store client");
    server_log(&idle_addr, "no complete handshake within");
    server_log(
        &big_addr,
        "store SET request frame declares 4294967294 bytes",
    );
    server_log(&liar_addr, "it failed the token check");
    // The two clients that found the server's proof wrong hung up in the handshake.
    assert!(
        warnings_with(&[
            "store connection refused",
            "closed the connection in the handshake"
        ])
        .len()
            >= 2
    );
    assert_eq!(server.num_keys(), 3);
}

#[test]
fn values_and_total_bytes_are_capped() {
    let mut c = cfg();
    c.max_value_bytes = 1000;
    c.max_total_bytes = 5000;
    let server = TcpStoreServer::bind_with("127.0.0.1:0", c.clone()).unwrap();
    let s = TcpStore::connect_with(
        &server.local_addr().to_string(),
        Duration::from_secs(10),
        &c,
    )
    .unwrap();
    let e = s.set("v", &[1u8; 1001]).unwrap_err();
    assert!(
        e.to_string().contains("1001 bytes") && e.to_string().contains("1000-byte"),
        "{e}"
    );
    // The same refusal under a long multi-byte key: the error names the key, so it is longer
    // than a key may be and is cut by the server; it still reaches the client readable.
    let long = "é".repeat(2040); // 4,080 bytes: a key may be 4,096
    assert!(long.len() <= MAX_KEY);
    let e = s.set(&long, &[1u8; 1001]).unwrap_err().to_string();
    assert!(
        e.contains("server error: a value of 1001 bytes"),
        "{}",
        e.chars().take(200).collect::<String>()
    );
    for i in 0..4 {
        s.set(&format!("k{i}"), &[0u8; 1000]).unwrap();
    }
    assert_eq!(server.stored_bytes(), 4 * 1002);
    let e = s.set("k4", &[0u8; 1000]).unwrap_err();
    assert!(e.to_string().contains("over its limit of 5000"), "{e}");
    // Replacing a value with a smaller one, and deleting, make room again.
    s.set("k0", b"x").unwrap();
    assert!(s.delete("k1").unwrap());
    s.set("k4", &[0u8; 1000]).unwrap();
    assert_eq!(server.stored_bytes(), 3 + 3 * 1002);
    // A frame far over the limit closes the connection (the client reconnects for the next).
    let e = s.set("huge", &[0u8; 10_000]).unwrap_err();
    assert!(matches!(e, StoreError::Io { .. }), "{e}");
    s.ping().unwrap();
}

#[test]
fn connections_and_handshakes_are_capped() {
    capture_warnings();
    let mut c = cfg();
    c.max_connections = 3;
    c.max_handshakes = 1;
    c.handshake_timeout = Duration::from_millis(600);
    let server = TcpStoreServer::bind_with("127.0.0.1:0", c.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let mut idle = TcpStream::connect(&addr).unwrap();
    // Until the server took `idle` in, a second connection could still get the slot.
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.connections() < 1 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut second = TcpStream::connect(&addr).unwrap();
    let second_addr = second.local_addr().unwrap().to_string();
    until_closed(&mut second, Duration::from_secs(10)).unwrap();
    assert!(
        !warnings_with(&[&second_addr, "too many connections are in their handshake"]).is_empty()
    );
    until_closed(&mut idle, Duration::from_secs(10)).unwrap();
    drop(server);
    // Served connections count toward max_connections: 3 clients fill it, a 4th is refused.
    c.max_handshakes = 3;
    let server = TcpStoreServer::bind_with("127.0.0.1:0", c.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let clients: Vec<TcpStream> = (0..3)
        .map(|_| raw_authenticated(&addr, TOKEN).unwrap())
        .collect();
    let mut fourth = TcpStream::connect(&addr).unwrap();
    let fourth_addr = fourth.local_addr().unwrap().to_string();
    until_closed(&mut fourth, Duration::from_secs(10)).unwrap();
    assert!(!warnings_with(&[&fourth_addr, "maximum number of connections"]).is_empty());
    drop(clients);
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.connections() > 0 {
        assert!(Instant::now() < deadline, "{}", server.connections());
        std::thread::sleep(Duration::from_millis(10));
    }
    TcpStore::connect_with(&addr, Duration::from_secs(10), &c)
        .unwrap()
        .ping()
        .unwrap();
}

#[test]
fn without_a_token_only_this_host_is_served() {
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let here = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    let there = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
    assert!(same_host_for_test(lo, Some(here)));
    assert!(same_host_for_test(
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 9)),
        None
    ));
    assert!(same_host_for_test(here, Some(here)));
    assert!(!same_host_for_test(there, Some(here)));
    assert!(!same_host_for_test(there, None));
    let mapped = IpAddr::V6(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
    assert!(same_host_for_test(mapped, Some(here)));
    assert!(same_host_for_test(IpAddr::V6(Ipv6Addr::LOCALHOST), None));
    assert!(!StoreConfig::default().has_token());
    assert!(StoreConfig::default().with_token(b"t").has_token());
    assert!(!StoreConfig::default().with_token(b"").has_token());
    // Loopback without a token still works (tests, single-host runs without a launcher).
    let c = StoreConfig::default();
    let server = TcpStoreServer::bind_with("127.0.0.1:0", c.clone()).unwrap();
    let s = TcpStore::connect_with(
        &server.local_addr().to_string(),
        Duration::from_secs(10),
        &c,
    )
    .unwrap();
    s.set("a", b"b").unwrap();
    // A client holding a token does not trust a server without one.
    let e = TcpStore::connect_with(
        &server.local_addr().to_string(),
        Duration::from_secs(10),
        &StoreConfig::default().with_token(TOKEN),
    )
    .unwrap_err();
    assert!(matches!(e, StoreError::Denied { .. }), "{e}");
}

/// A request or response frame: a tag, a body, a declared length (maybe a lie), and whether
/// it is well formed.
fn random_frame(
    rng: &mut Rng,
    tags: u8,
    max_body: impl Fn(u8) -> Option<usize>,
) -> (Vec<u8>, bool) {
    let tag = match rng.below(10) {
        0 => rng.next() as u8,
        _ => rng.below(tags as u64 + 1) as u8,
    };
    let mut body = Vec::new();
    match rng.below(4) {
        // A plausible body: a key, maybe a value or a delta.
        0 | 1 => {
            let key = rng.upto(12);
            put_bytes(&mut body, &key);
            if rng.below(2) == 0 {
                let v = rng.upto(300);
                put_bytes(&mut body, &v);
            } else {
                body.extend_from_slice(&rng.next().to_le_bytes());
            }
        }
        2 => body = rng.upto(64),
        // A key list whose count lies.
        _ => {
            body.extend_from_slice(&(rng.next() as u32).to_le_bytes());
            body.extend_from_slice(&rng.upto(40));
        }
    }
    let exact = body.len() as u64 + 1;
    let declared: u64 = match rng.below(8) {
        0 => u32::MAX as u64,
        1 => rng.next() as u32 as u64,
        2 => exact + 1 + rng.below(100_000),
        3 => 0,
        4 => (max_body(tag).unwrap_or(0) as u64 + 2).min(u32::MAX as u64),
        _ => exact,
    };
    let mut f = (declared as u32).to_le_bytes().to_vec();
    f.push(tag);
    f.extend_from_slice(&body);
    let ok = declared == exact && max_body(tag).is_some_and(|m| body.len() <= m);
    (f, ok)
}

/// 10,000 random request frames into the server's decoder and request handling, and 10,000
/// random response frames into the client's decoder: nothing panics, every bad frame ends
/// with a typed error naming the peer, and no allocation is larger than twice the bytes the
/// frames really hold (or the first 64 KiB chunk), whatever length they declare.
#[test]
#[allow(clippy::print_stderr)] // what it measured, in the test's output
fn ten_thousand_random_store_frames_never_allocate_from_declared_lengths() {
    let mut rng = Rng(0x34_5702e);
    let c = StoreConfig {
        max_value_bytes: 256,
        max_total_bytes: 4096,
        ..StoreConfig::default()
    };
    let (mut frames, mut typed, mut max_peak, mut max_declared) = (0u64, 0u64, 0usize, 0u64);
    let t0 = Instant::now();
    for case in 0..20_000u32 {
        let server_side = case % 2 == 0;
        let mut stream = Vec::new();
        let mut all_ok = true;
        for _ in 0..1 + rng.below(3) {
            frames += 1;
            let (f, ok) = if server_side {
                random_frame(&mut rng, OP_PING, |op| {
                    request_limit(op, c.max_value_bytes).map(|l| l.0)
                })
            } else {
                random_frame(&mut rng, ST_ERROR, |st| response_limit(st).map(|l| l.0))
            };
            max_declared = max_declared.max(u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as u64);
            stream.extend_from_slice(&f);
            if !ok {
                all_ok = false;
                break;
            }
        }
        let limit_known = |tag: u8| {
            if server_side {
                request_limit(tag, c.max_value_bytes)
            } else {
                response_limit(tag)
            }
        };
        let (table, cv, stop) = test_table();
        stop.store(true, Ordering::Relaxed); // a WAIT answers at once
        let (end, peak) = peak_alloc(|| {
            let mut r = &stream[..];
            loop {
                match read_frame(&mut r, "store peer fuzz", limit_known, None, None) {
                    Ok((tag, body)) => {
                        if server_side {
                            let _ = handle_request(&table, &cv, &stop, &c, tag, &body);
                        } else {
                            let mut b = Body { b: &body };
                            let _ = match tag {
                                ST_VALUE | ST_ERROR => b.bytes().map(|_| ()),
                                ST_INT => b.i64().map(|_| ()),
                                ST_MISSING => b.keys().map(|_| ()),
                                ST_BOOL => b.u8().map(|_| ()),
                                _ => Ok(()),
                            };
                        }
                    }
                    Err(e) => break e,
                }
            }
        });
        assert!(test_total(&table) <= c.max_total_bytes);
        match end {
            FrameEnd::Boundary(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                assert!(all_ok, "case {case}: a bad frame was read as good");
            }
            FrameEnd::Frame(e) => {
                assert!(!all_ok, "case {case}: good frames refused: {e}");
                assert!(e.to_string().contains("store peer fuzz"), "{e}");
                typed += 1;
            }
        }
        let bound = (2 * stream.len()).max(FIRST_CHUNK);
        assert!(
            peak <= bound,
            "case {case}: allocated {peak} bytes for {} bytes of frames",
            stream.len()
        );
        max_peak = max_peak.max(peak);
    }
    eprintln!(
        "store fuzz: {frames} frames in 20000 streams, {typed} closed with a typed error, \
         largest declared length {max_declared}, largest allocation {max_peak} bytes, {:?}",
        t0.elapsed()
    );
    assert!(typed > 5_000 && max_declared >= u32::MAX as u64 - 1);
}
