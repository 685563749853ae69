//! Full-mesh bootstrap of a process communicator through the store (Gloo's
//! `connectFullMesh`).
//!
//! Every rank binds a listener on an ephemeral port and publishes `"<ip>:<port>"` under
//! `"<ns>/addr/<rank>"`, then waits for every rank's key: a rank that never starts is named
//! here. Rank i dials every rank j < i and accepts one connection from every rank j > i (both
//! at once, so the chain of dials cannot serialize). A dialer sends
//! `MAGIC: u32 | VERSION: u8 | ns: u32 len + bytes | rank: u32 | size: u32`; the acceptor checks
//! the namespace, size and rank (strays and duplicates are dropped, not trusted) and answers
//! `MAGIC: u32 | rank: u32`. Everything is bounded by the bootstrap deadline.

use std::io::{ErrorKind, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::store::{read_full, Store, StoreError};
use crate::types::OpCtx;

const MAGIC: u32 = 0x4d54_4443; // "CDTM"
const VERSION: u8 = 1;

/// Where and as whom to connect.
pub(crate) struct MeshSpec<'a> {
    /// The store, already namespaced for this communicator.
    pub store: &'a dyn Store,
    /// The namespace string (checked in the handshake).
    pub ns: &'a str,
    pub rank: usize,
    pub size: usize,
    /// The address peers dial to reach this rank.
    pub ip: IpAddr,
    /// The context errors are reported in (`new_comm` or `split`), with the bootstrap timeout.
    pub ctx: &'a OpCtx,
    pub deadline: Instant,
    /// Maps a rank of the new communicator to the rank errors should name.
    pub name_rank: &'a (dyn Fn(usize) -> usize + Sync),
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

/// Connects rank `spec.rank` to every other rank; returns the streams indexed by peer rank.
pub(crate) fn connect_mesh(spec: &MeshSpec) -> Result<Vec<Option<TcpStream>>> {
    let (rank, size) = (spec.rank, spec.size);
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    if size == 1 {
        return Ok(streams);
    }
    let listener = TcpListener::bind(SocketAddr::new(spec.ip, 0))
        .map_err(|e| boot(spec, format!("cannot listen on {}: {e}", spec.ip)))?;
    let local = listener
        .local_addr()
        .map_err(|e| boot(spec, format!("listener address: {e}")))?;
    spec.store
        .set(&format!("addr/{rank}"), local.to_string().as_bytes())
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
        match spec.store.wait(&refs, left.min(Duration::from_millis(250))) {
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
    let mut addrs = Vec::with_capacity(rank);
    for r in 0..rank {
        let v = spec
            .store
            .get(&format!("addr/{r}"))
            .map_err(|e| boot(spec, e.to_string()))?;
        let a: SocketAddr = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| boot(spec, format!("rank {r} published a bad address {v:?}")))?;
        addrs.push(a);
    }
    let (accepted, dialed) = std::thread::scope(|s| {
        let acc = s.spawn(|| accept_all(spec, &listener));
        let dialed: Result<Vec<TcpStream>> = addrs
            .iter()
            .enumerate()
            .map(|(r, a)| dial(spec, r, *a))
            .collect();
        let accepted = acc
            .join()
            .unwrap_or_else(|_| Err(boot(spec, "the accept thread panicked".into())));
        (accepted, dialed)
    });
    for (r, s) in dialed?.into_iter().enumerate() {
        streams[r] = Some(s);
    }
    for (r, s) in accepted? {
        streams[r] = Some(s);
    }
    Ok(streams)
}

fn dial(spec: &MeshSpec, peer: usize, addr: SocketAddr) -> Result<TcpStream> {
    let mut last = String::new();
    while Instant::now() < spec.deadline {
        let left = spec.deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(10), Duration::from_secs(2)),
        ) {
            Ok(mut s) => match handshake_dial(spec, &mut s) {
                Ok(()) => return Ok(s),
                Err(e) if e.kind() == ErrorKind::TimedOut => return Err(timeout(spec, [peer])),
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

fn handshake_dial(spec: &MeshSpec, s: &mut TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut m = Vec::new();
    m.extend_from_slice(&MAGIC.to_le_bytes());
    m.push(VERSION);
    m.extend_from_slice(&(spec.ns.len() as u32).to_le_bytes());
    m.extend_from_slice(spec.ns.as_bytes());
    m.extend_from_slice(&(spec.rank as u32).to_le_bytes());
    m.extend_from_slice(&(spec.size as u32).to_le_bytes());
    s.write_all(&m)?;
    let mut ack = [0u8; 8];
    read_full(s, &mut ack, Some(spec.deadline), None)?;
    if ack[..4] != MAGIC.to_le_bytes() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "bad handshake answer",
        ));
    }
    Ok(())
}

/// Accepts the connections of every rank above this one.
fn accept_all(spec: &MeshSpec, listener: &TcpListener) -> Result<Vec<(usize, TcpStream)>> {
    let expected = spec.size - spec.rank - 1;
    let mut got: Vec<(usize, TcpStream)> = Vec::with_capacity(expected);
    if expected == 0 {
        return Ok(got);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| boot(spec, format!("listener: {e}")))?;
    while got.len() < expected {
        if Instant::now() >= spec.deadline {
            let missing = (spec.rank + 1..spec.size).filter(|r| got.iter().all(|(g, _)| g != r));
            return Err(timeout(spec, missing));
        }
        match listener.accept() {
            Ok((mut s, from)) => match handshake_accept(spec, &mut s) {
                Ok(r) if got.iter().any(|(g, _)| *g == r) => {
                    tracing::warn!(%from, rank = r, "duplicate mesh connection dropped");
                }
                Ok(r) => got.push((r, s)),
                Err(e) => tracing::warn!(%from, error = %e, "stray connection dropped"),
            },
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => return Err(boot(spec, format!("accept: {e}"))),
        }
    }
    Ok(got)
}

fn handshake_accept(spec: &MeshSpec, s: &mut TcpStream) -> std::io::Result<usize> {
    let bad = |m: String| std::io::Error::new(ErrorKind::InvalidData, m);
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    // A stray connection gets at most 2 s to identify itself.
    let deadline = spec.deadline.min(Instant::now() + Duration::from_secs(2));
    let mut head = [0u8; 9];
    read_full(s, &mut head, Some(deadline), None)?;
    if head[..4] != MAGIC.to_le_bytes() || head[4] != VERSION {
        return Err(bad("not a candle-dtensor mesh handshake".into()));
    }
    let ns_len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if ns_len > 4096 {
        return Err(bad(format!("namespace of {ns_len} bytes")));
    }
    let mut rest = vec![0u8; ns_len + 8];
    read_full(s, &mut rest, Some(deadline), None)?;
    let ns = &rest[..ns_len];
    let r = u32::from_le_bytes([
        rest[ns_len],
        rest[ns_len + 1],
        rest[ns_len + 2],
        rest[ns_len + 3],
    ]) as usize;
    let n = u32::from_le_bytes([
        rest[ns_len + 4],
        rest[ns_len + 5],
        rest[ns_len + 6],
        rest[ns_len + 7],
    ]) as usize;
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
    let mut ack = Vec::with_capacity(8);
    ack.extend_from_slice(&MAGIC.to_le_bytes());
    ack.extend_from_slice(&(spec.rank as u32).to_le_bytes());
    s.write_all(&ack)?;
    Ok(r)
}
