//! Full-mesh bootstrap of a process communicator (Gloo's `connectFullMesh`), authenticated.
//!
//! Every rank binds a listener on an ephemeral port ([`bind`]). A `new_comm` publishes
//! `"<ip>:<port>"` under `"<ns>/addr/<rank>"` in the store and waits for every rank's key: a
//! rank that never starts is named here ([`addresses_from_store`]); a split or a shrink learns
//! its peers' addresses over the parent communicator instead, so neither needs the store (whose
//! host, rank 0, may be the rank that died). Then rank i dials every rank j < i and accepts one
//! connection from every rank j > i (both at once, so the chain of dials cannot serialize):
//! [`connect`].
//!
//! The handshake (all integers little-endian):
//!
//! 1. dialer: `MAGIC: u32 | VERSION: u8 | ns: u32 len + bytes | rank: u32 | size: u32 | nonce_d`
//! 2. acceptor (after checking namespace, size and rank; strays and duplicates are dropped):
//!    `MAGIC: u32 | rank: u32 | nonce_a | proof("accept")`
//! 3. dialer (after checking the proof): `proof("dial")`
//! 4. acceptor (after checking it): `1: u8`
//!
//! A proof is HMAC-SHA256 of the job token over the role, the namespace, both ranks, the size
//! and both nonces ([`candle_dtensor_comm_core::auth`]): the token never travels, a proof is good for one
//! connection only, and one role's proof is no use for the other. A connection that fails
//! the check is dropped and logged; the bootstrap goes on waiting for the real peer. Everything
//! is bounded by the bootstrap deadline.

use std::io::{ErrorKind, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use candle_dtensor_comm_core::auth::{
    accept_challenge, dial_challenge, nonce, Roles, Token, NONCE,
};
use candle_dtensor_comm_core::store::{read_full, Store, StoreError};
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::{CommError, Result};

const MAGIC: u32 = 0x4d54_4443; // "CDTM"
const VERSION: u8 = 2;

/// Who connects to whom, and how to name ranks in errors.
pub(crate) struct MeshSpec<'a> {
    /// The namespace string (checked in the handshake and in the proofs).
    pub ns: &'a str,
    pub rank: usize,
    pub size: usize,
    /// The job's secret.
    pub token: &'a Token,
    /// The context errors are reported in (`new_comm`, `split` or `shrink`), with the
    /// bootstrap timeout.
    pub ctx: &'a OpCtx,
    pub deadline: Instant,
    /// Maps a rank of the new communicator to the rank errors should name.
    pub name_rank: &'a (dyn Fn(usize) -> usize + Sync),
    /// Shrink: a peer this returns `Some(why)` for is known dead (the parent lost it), and
    /// one that cannot be reached is not an error: [`connect`] reports both as lost instead.
    pub tolerate: Option<&'a (dyn Fn(usize) -> Option<String> + Sync)>,
}

fn boot(spec: &MeshSpec, reason: String) -> CommError {
    CommError::Bootstrap {
        comm: spec.ctx.comm.to_string(),
        reason: format!("rank {}: {reason}", spec.rank),
    }
}

fn timeout(spec: &MeshSpec, missing: impl IntoIterator<Item = usize>) -> CommError {
    let mut missing: Vec<usize> = missing.into_iter().map(|r| (spec.name_rank)(r)).collect();
    missing.sort_unstable();
    CommError::Timeout {
        ctx: spec.ctx.clone(),
        timeout: spec.ctx.timeout,
        missing,
    }
}

/// A listener on an ephemeral port of `ip`, and its address.
pub(crate) fn bind(ip: IpAddr, comm: &str) -> Result<(TcpListener, SocketAddr)> {
    let err = |reason: String| CommError::Bootstrap {
        comm: comm.to_string(),
        reason,
    };
    let l = TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| err(format!("cannot listen on {ip}: {e}")))?;
    let a = l
        .local_addr()
        .map_err(|e| err(format!("listener address: {e}")))?;
    Ok((l, a))
}

/// Publishes `mine` under `addr/<rank>` of `store` (namespaced for this communicator) and
/// returns every rank's address, once all are there.
pub(crate) fn addresses_from_store(
    spec: &MeshSpec,
    store: &dyn Store,
    mine: SocketAddr,
) -> Result<Vec<SocketAddr>> {
    let (rank, size) = (spec.rank, spec.size);
    store
        .set(&format!("addr/{rank}"), mine.to_string().as_bytes())
        .map_err(|e| boot(spec, e.to_string()))?;
    let keys: Vec<String> = (0..size).map(|r| format!("addr/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    // Waited for in slices, so that if the store goes away (rank 0, its host, gave up first)
    // the error still names the ranks that had not shown up.
    let ranks_of = |missing: &[String]| -> Vec<usize> {
        missing
            .iter()
            .filter_map(|k| k.strip_prefix("addr/").and_then(|r| r.parse().ok()))
            .collect()
    };
    let mut last_missing: Option<Vec<usize>> = None;
    loop {
        let left = spec.deadline.saturating_duration_since(Instant::now());
        match store.wait(&refs, left.min(Duration::from_millis(250))) {
            Ok(()) => break,
            Err(StoreError::Timeout { missing, .. }) => {
                let m = ranks_of(&missing);
                if Instant::now() >= spec.deadline {
                    return Err(timeout(spec, m));
                }
                last_missing = Some(m);
            }
            Err(e) => {
                return Err(boot(
                    spec,
                    match last_missing {
                        Some(m) => {
                            let mut m: Vec<usize> =
                                m.into_iter().map(|r| (spec.name_rank)(r)).collect();
                            m.sort_unstable();
                            format!(
                                "the store failed while waiting for ranks {m:?} to show up: {e}"
                            )
                        }
                        None => e.to_string(),
                    },
                ))
            }
        }
    }
    (0..size)
        .map(|r| {
            let v = store
                .get(&format!("addr/{r}"))
                .map_err(|e| boot(spec, e.to_string()))?;
            parse_addr(&v)
                .ok_or_else(|| boot(spec, format!("rank {r} published a bad address {v:?}")))
        })
        .collect()
}

/// Parses a published `"<ip>:<port>"`.
pub(crate) fn parse_addr(v: &[u8]) -> Option<SocketAddr> {
    std::str::from_utf8(v).ok().and_then(|s| s.parse().ok())
}

/// The streams of a connected mesh, indexed by peer rank (`None` at this rank and at lost
/// peers), and the peers found lost (only with [`MeshSpec::tolerate`]).
pub(crate) type Mesh = (Vec<Option<TcpStream>>, Vec<(usize, String)>);

/// Connects rank `spec.rank` to every other rank, dialing the lower ones at `addrs[r]`
/// (`addrs` holds every rank's address; only the lower ones are used) and accepting the
/// higher ones on `listener`.
pub(crate) fn connect(
    spec: &MeshSpec,
    listener: &TcpListener,
    addrs: &[SocketAddr],
) -> Result<Mesh> {
    let (rank, size) = (spec.rank, spec.size);
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let mut lost = Vec::new();
    if size == 1 {
        return Ok((streams, lost));
    }
    let (accepted, dialed) = std::thread::scope(|s| {
        let acc = s.spawn(|| accept_all(spec, listener));
        let dialed: Vec<(usize, Result<TcpStream>)> =
            (0..rank).map(|r| (r, dial(spec, r, addrs[r]))).collect();
        let accepted = acc
            .join()
            .unwrap_or_else(|_| Err(boot(spec, "the accept thread panicked".into())));
        (accepted, dialed)
    });
    for (r, s) in dialed {
        match (s, spec.tolerate) {
            (Ok(s), _) => streams[r] = Some(s),
            (Err(e), Some(_)) => lost.push((r, format!("could not connect to it: {e}"))),
            (Err(e), None) => return Err(e),
        }
    }
    let (got, missing) = accepted?;
    for (r, s) in got {
        streams[r] = Some(s);
    }
    for (r, why) in missing {
        lost.push((r, why));
    }
    lost.sort();
    Ok((streams, lost))
}

fn dial(spec: &MeshSpec, peer: usize, addr: SocketAddr) -> Result<TcpStream> {
    let mut last = String::new();
    while Instant::now() < spec.deadline {
        if let Some(why) = spec.tolerate.and_then(|t| t(peer)) {
            return Err(boot(spec, why));
        }
        let left = spec.deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(10), Duration::from_secs(2)),
        ) {
            Ok(mut s) => match handshake_dial(spec, peer, &mut s) {
                Ok(()) => return Ok(s),
                Err(e) if e.kind() == ErrorKind::TimedOut => return Err(timeout(spec, [peer])),
                Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                    tracing::warn!(%addr, error = %e, "mesh peer failed the token check");
                    last = e.to_string();
                }
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if last.is_empty() {
        Err(timeout(spec, [peer]))
    } else {
        Err(boot(
            spec,
            format!(
                "cannot connect to rank {} at {addr}: {last}",
                (spec.name_rank)(peer)
            ),
        ))
    }
}

fn bad(m: impl Into<String>) -> std::io::Error {
    std::io::Error::new(ErrorKind::InvalidData, m.into())
}

fn denied(m: impl Into<String>) -> std::io::Error {
    std::io::Error::new(ErrorKind::PermissionDenied, m.into())
}

/// What a proof covers besides the two nonces.
fn context<'a>(
    spec: &'a MeshSpec,
    dialer: &'a [u8; 4],
    acceptor: &'a [u8; 4],
    size: &'a [u8; 4],
) -> [&'a [u8]; 4] {
    [spec.ns.as_bytes(), dialer, acceptor, size]
}

/// The mesh's challenge-response roles ([`candle_dtensor_comm_core::auth`]).
const MESH_ROLES: Roles = Roles {
    dial: "cdt-mesh-dial",
    accept: "cdt-mesh-accept",
};

fn handshake_dial(spec: &MeshSpec, peer: usize, s: &mut TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let nonce_d = nonce()?;
    let mut m = Vec::new();
    m.extend_from_slice(&MAGIC.to_le_bytes());
    m.push(VERSION);
    m.extend_from_slice(&(spec.ns.len() as u32).to_le_bytes());
    m.extend_from_slice(spec.ns.as_bytes());
    m.extend_from_slice(&(spec.rank as u32).to_le_bytes());
    m.extend_from_slice(&(spec.size as u32).to_le_bytes());
    m.extend_from_slice(&nonce_d);
    s.write_all(&m)?;
    let (d, a, n) = (
        (spec.rank as u32).to_le_bytes(),
        (peer as u32).to_le_bytes(),
        (spec.size as u32).to_le_bytes(),
    );
    let check = |prefix: &[u8]| {
        if prefix[..4] != MAGIC.to_le_bytes() {
            return Err(bad("bad handshake answer"));
        }
        if prefix[4..8] != a {
            return Err(bad("the answer comes from another rank"));
        }
        Ok(())
    };
    dial_challenge(
        s,
        spec.token,
        &MESH_ROLES,
        8,
        check,
        &context(spec, &d, &a, &n),
        &nonce_d,
        spec.deadline,
    )
}

/// The connections of every rank above this one, and (with [`MeshSpec::tolerate`]) the ranks
/// found lost or never seen by the deadline.
#[allow(clippy::type_complexity)]
fn accept_all(
    spec: &MeshSpec,
    listener: &TcpListener,
) -> Result<(Vec<(usize, TcpStream)>, Vec<(usize, String)>)> {
    let expected = spec.size - spec.rank - 1;
    let mut got: Vec<(usize, TcpStream)> = Vec::with_capacity(expected);
    let mut lost: Vec<(usize, String)> = Vec::new();
    if expected == 0 {
        return Ok((got, lost));
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| boot(spec, format!("listener: {e}")))?;
    let waiting = |got: &[(usize, TcpStream)], lost: &[(usize, String)]| {
        (spec.rank + 1..spec.size)
            .filter(|r| got.iter().all(|(g, _)| g != r) && lost.iter().all(|(l, _)| l != r))
            .collect::<Vec<usize>>()
    };
    loop {
        let pending = waiting(&got, &lost);
        if pending.is_empty() {
            return Ok((got, lost));
        }
        if let Some(t) = spec.tolerate {
            for r in &pending {
                if let Some(why) = t(*r) {
                    lost.push((*r, why));
                }
            }
        }
        if Instant::now() >= spec.deadline {
            let pending = waiting(&got, &lost);
            if spec.tolerate.is_some() {
                lost.extend(
                    pending
                        .into_iter()
                        .map(|r| (r, "it never connected".into())),
                );
                return Ok((got, lost));
            }
            return Err(timeout(spec, pending));
        }
        match listener.accept() {
            Ok((mut s, from)) => match handshake_accept(spec, &mut s) {
                Ok(r) if got.iter().any(|(g, _)| *g == r) => {
                    tracing::warn!(%from, rank = r, "duplicate mesh connection dropped");
                }
                Ok(r) => got.push((r, s)),
                Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                    tracing::warn!(%from, comm = %spec.ctx.comm, error = %e, "connection failed the token check; dropped");
                }
                Err(e) => tracing::warn!(%from, error = %e, "stray connection dropped"),
            },
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => return Err(boot(spec, format!("accept: {e}"))),
        }
    }
}

fn handshake_accept(spec: &MeshSpec, s: &mut TcpStream) -> std::io::Result<usize> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    // A stray connection gets at most 2 s to identify itself.
    let deadline = spec.deadline.min(Instant::now() + Duration::from_secs(2));
    let mut head = [0u8; 9];
    read_full(s, &mut head, Some(deadline), None)?;
    if head[..4] != MAGIC.to_le_bytes() || head[4] != VERSION {
        return Err(bad("not a candle-dtensor mesh handshake"));
    }
    let ns_len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if ns_len > 4096 {
        return Err(bad(format!("namespace of {ns_len} bytes")));
    }
    let mut rest = vec![0u8; ns_len + 8 + NONCE];
    read_full(s, &mut rest, Some(deadline), None)?;
    let ns = &rest[..ns_len];
    let word = |o: usize| u32::from_le_bytes([rest[o], rest[o + 1], rest[o + 2], rest[o + 3]]);
    let (r, n) = (word(ns_len) as usize, word(ns_len + 4) as usize);
    if ns != spec.ns.as_bytes() {
        return Err(bad(format!(
            "handshake for communicator {:?}, this is {:?}",
            String::from_utf8_lossy(ns),
            spec.ns
        )));
    }
    if n != spec.size || r <= spec.rank || r >= spec.size {
        return Err(bad(format!("handshake from rank {r} of {n}")));
    }
    let nonce_d = &rest[ns_len + 8..];
    let (d, a, sz) = (
        (r as u32).to_le_bytes(),
        (spec.rank as u32).to_le_bytes(),
        (spec.size as u32).to_le_bytes(),
    );
    let mut prefix = [0u8; 8];
    prefix[..4].copy_from_slice(&MAGIC.to_le_bytes());
    prefix[4..].copy_from_slice(&a);
    accept_challenge(
        s,
        spec.token,
        &MESH_ROLES,
        &prefix,
        &context(spec, &d, &a, &sz),
        nonce_d,
        deadline,
    )
    .map_err(|e| {
        if e.kind() == ErrorKind::PermissionDenied {
            denied(format!(
                "a connection claiming rank {r} failed the token check"
            ))
        } else {
            e
        }
    })?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_dtensor_comm_core::auth::PROOF;

    fn spec<'a>(
        ns: &'a str,
        rank: usize,
        token: &'a Token,
        ctx: &'a OpCtx,
        name_rank: &'a (dyn Fn(usize) -> usize + Sync),
    ) -> MeshSpec<'a> {
        MeshSpec {
            ns,
            rank,
            size: 2,
            token,
            ctx,
            deadline: Instant::now() + Duration::from_secs(10),
            name_rank,
            tolerate: None,
        }
    }

    /// An intruder that knows the namespace and the ranks but not the token, and answers the
    /// challenge with a proof of its own token, is dropped (never acked) while rank 0's
    /// bootstrap goes on; the real rank 1 connects after it, and the stream rank 0 gets is
    /// rank 1's. The intruder never learns the token: what it saw was a nonce and a proof.
    #[test]
    fn a_connection_with_a_wrong_token_is_dropped_and_the_real_peer_gets_in() {
        intruder_is_dropped_and_the_real_peer_gets_in(Token::new(b"a guess"));
    }

    /// The same with an intruder that has no token at all (the empty one).
    #[test]
    fn a_connection_without_a_token_is_dropped_and_the_real_peer_gets_in() {
        intruder_is_dropped_and_the_real_peer_gets_in(Token::new(&[]));
    }

    /// An intruder holding `wrong` is refused and logged (`warn` naming its address), and the
    /// job's bootstrap goes on and completes.
    fn intruder_is_dropped_and_the_real_peer_gets_in(wrong: Token) {
        crate::test_support::capture_warnings();
        let good = Token::new(b"the job's token");
        let ctx = OpCtx::bootstrap("tok", 0, Duration::from_secs(10));
        let names = |r: usize| r;
        let ns = "test/tok";
        let (l0, a0) = bind(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), "tok").unwrap();
        let (l1, a1) = bind(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), "tok").unwrap();
        let addrs = [a0, a1];
        let (intruder_done_tx, intruder_done) = std::sync::mpsc::channel::<()>();
        let (mesh0, answer) = std::thread::scope(|s| {
            let h0 = s.spawn(|| connect(&spec(ns, 0, &good, &ctx, &names), &l0, &addrs));
            // The intruder: a well-formed hello claiming rank 1, then the proof of its token.
            let intruder = s.spawn(|| -> std::io::Result<(Vec<u8>, SocketAddr)> {
                let mut st = TcpStream::connect(a0)?;
                let me = st.local_addr()?;
                st.set_read_timeout(Some(Duration::from_secs(5)))?;
                let nonce_d = nonce()?;
                let mut m = Vec::new();
                m.extend_from_slice(&MAGIC.to_le_bytes());
                m.push(VERSION);
                m.extend_from_slice(&(ns.len() as u32).to_le_bytes());
                m.extend_from_slice(ns.as_bytes());
                m.extend_from_slice(&1u32.to_le_bytes());
                m.extend_from_slice(&2u32.to_le_bytes());
                m.extend_from_slice(&nonce_d);
                st.write_all(&m)?;
                let mut ack = [0u8; 8 + NONCE + PROOF];
                std::io::Read::read_exact(&mut st, &mut ack)?;
                let sp = spec(ns, 1, &wrong, &ctx, &names);
                let (d, a, n) = (1u32.to_le_bytes(), 0u32.to_le_bytes(), 2u32.to_le_bytes());
                let mut parts = context(&sp, &d, &a, &n).to_vec();
                parts.push(&nonce_d);
                parts.push(&ack[8..8 + NONCE]);
                st.write_all(&wrong.prove(MESH_ROLES.dial, &parts))?;
                // What comes back: nothing (the connection is closed), not the `1` of success.
                let mut rest = Vec::new();
                let _ = std::io::Read::read_to_end(&mut st, &mut rest);
                let _ = intruder_done_tx.send(());
                Ok((rest, me))
            });
            let (good, ctx, names, l1, addrs) = (&good, &ctx, &names, &l1, &addrs);
            let h1 = s.spawn(move || {
                // The real rank 1 comes after the intruder was turned away.
                let _ = intruder_done.recv_timeout(Duration::from_secs(10));
                let (mut streams, lost) = connect(&spec(ns, 1, good, ctx, names), l1, addrs)?;
                assert!(lost.is_empty());
                let s0 = streams[0].as_mut().expect("rank 0's stream");
                s0.write_all(b"from rank 1")
                    .map_err(|e| boot_err(e.to_string()))?;
                Ok::<_, CommError>(())
            });
            let answer = intruder.join().unwrap();
            h1.join().unwrap().expect("rank 1 connects");
            (h0.join().unwrap(), answer)
        });
        let (answer, intruder) = answer.expect("the intruder got as far as sending its proof");
        assert!(answer.is_empty(), "the intruder was acked: {answer:?}");
        let logged =
            crate::test_support::warnings_with(&[&intruder.to_string(), "failed the token check"]);
        assert!(
            !logged.is_empty(),
            "no warning names the intruder {intruder}"
        );
        let (mut streams, lost) = mesh0.expect("rank 0's bootstrap went on");
        assert!(lost.is_empty());
        let mut got = [0u8; 11];
        let s1 = streams[1].as_mut().expect("rank 1's stream");
        read_full(
            s1,
            &mut got,
            Some(Instant::now() + Duration::from_secs(5)),
            None,
        )
        .unwrap();
        assert_eq!(&got, b"from rank 1");
    }

    fn boot_err(reason: String) -> CommError {
        CommError::Bootstrap {
            comm: "tok".into(),
            reason,
        }
    }
}
