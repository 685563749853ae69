//! [`TcpStoreServer`]: the keys, a listener thread and one thread per client connection (at
//! most [`StoreConfig::max_connections`] of them), each authenticated before it is served.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::wire::*;
use super::{StoreConfig, StoreError, STORE_ROLES};
use crate::auth::{accept_challenge, Token, NONCE};

#[derive(Default)]
pub(super) struct Keys {
    map: HashMap<String, Vec<u8>>,
    /// Bytes of every key and value held.
    total: usize,
}

impl Keys {
    /// Replaces `key`'s value, within the store's total; `Err` names the sizes.
    fn put(&mut self, key: String, value: Vec<u8>, max_total: usize) -> Result<(), String> {
        let old = self.map.get(&key).map_or(0, |v| key.len() + v.len());
        let new = key.len() + value.len();
        let total = self.total - old + new;
        if new > old && total > max_total {
            return Err(format!(
                "storing {new} bytes under {key:?} would bring the store to {total} bytes, over its limit of {max_total}"
            ));
        }
        self.total = total;
        self.map.insert(key, value);
        Ok(())
    }

    fn remove(&mut self, key: &str) -> bool {
        match self.map.remove(key) {
            Some(v) => {
                self.total -= key.len() + v.len();
                true
            }
            None => false,
        }
    }
}

struct ServerShared {
    keys: Mutex<Keys>,
    cv: Condvar,
    stop: AtomicBool,
    cfg: StoreConfig,
    /// The token connections must prove (the empty token without one).
    token: Token,
    /// Connection threads alive now, and those of them still in the handshake.
    live: AtomicUsize,
    handshaking: AtomicUsize,
}

impl ServerShared {
    fn lock(&self) -> MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn counter(&self, c: Count) -> &AtomicUsize {
        match c {
            Count::Live => &self.live,
            Count::Handshaking => &self.handshaking,
        }
    }
}

/// Which connection count a [`Slot`] holds a place in.
#[derive(Clone, Copy)]
enum Count {
    Live,
    Handshaking,
}

/// A place in one of the server's connection counts, given back when dropped.
struct Slot(Arc<ServerShared>, Count);

impl Slot {
    /// Takes a place in `count` of `sh`, or `None` when all `max` are taken.
    fn take(sh: &Arc<ServerShared>, count: Count, max: usize) -> Option<Slot> {
        sh.counter(count)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(sh.clone(), count))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.counter(self.1).fetch_sub(1, Ordering::AcqRel);
    }
}

/// The server side of the store: a listener thread plus one thread per client connection.
///
/// Every connection must prove the job's token ([`StoreConfig`]; by default the token of
/// `CDT_JOB_TOKEN`) before any request is served. Without a token it serves only this host
/// (loopback, or a peer connecting from the address it reached), unless
/// [`StoreConfig::insecure`] is set. Connections, pending handshakes, value sizes and the
/// bytes stored are capped; a refused connection is logged (`warn`, naming the peer and why)
/// and closed, and nothing else changes.
///
/// Dropping the server stops it: the listener and idle connection threads exit within about
/// 100 ms, and clients then see their requests fail.
pub struct TcpStoreServer {
    addr: SocketAddr,
    shared: Arc<ServerShared>,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpStoreServer {
    /// Listens on `addr` (`"127.0.0.1:0"` picks a free port; see [`TcpStoreServer::local_addr`])
    /// with [`StoreConfig::from_env`].
    ///
    /// # Errors
    ///
    /// [`StoreError::Bind`] if the address does not resolve or is in use.
    pub fn bind(addr: &str) -> Result<TcpStoreServer, StoreError> {
        TcpStoreServer::bind_with(addr, StoreConfig::from_env())
    }

    /// Listens on `addr` with `cfg` (token, limits, `insecure`).
    ///
    /// # Errors
    ///
    /// [`StoreError::Bind`] if the address does not resolve or is in use, or a limit is zero.
    pub fn bind_with(addr: &str, cfg: StoreConfig) -> Result<TcpStoreServer, StoreError> {
        let bind_err = |reason: String| StoreError::Bind {
            addr: addr.to_string(),
            reason,
        };
        if cfg.max_connections == 0 || cfg.max_handshakes == 0 {
            return Err(bind_err(format!(
                "max_connections ({}) and max_handshakes ({}) must be at least 1",
                cfg.max_connections, cfg.max_handshakes
            )));
        }
        let addrs = resolve(addr).map_err(bind_err)?;
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| bind_err(e.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| bind_err(e.to_string()))?;
        let local = listener.local_addr().map_err(|e| bind_err(e.to_string()))?;
        if cfg.token.is_none() && cfg.insecure {
            tracing::warn!(addr = %local, "store server is insecure: no job token, and it serves every host that reaches it (anyone can read or replace its keys)");
        }
        let shared = Arc::new(ServerShared {
            keys: Mutex::new(Keys::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            token: cfg.token.clone().unwrap_or_else(|| Token::new(&[])),
            cfg,
            live: AtomicUsize::new(0),
            handshaking: AtomicUsize::new(0),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("cdt-store-srv".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| bind_err(format!("cannot start the listener thread: {e}")))?;
        tracing::debug!(addr = %local, "store server listening");
        Ok(TcpStoreServer {
            addr: local,
            shared,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The number of keys currently stored.
    pub fn num_keys(&self) -> usize {
        self.shared.lock().map.len()
    }

    /// The bytes of every key and value stored now.
    pub fn stored_bytes(&self) -> usize {
        self.shared.lock().total
    }

    /// Connection threads alive now (served or in their handshake).
    pub fn connections(&self) -> usize {
        self.shared.live.load(Ordering::Acquire)
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.cv.notify_all();
    }
}

/// Whether `peer` is on this host: loopback, or connecting from the very address it reached
/// (`local`), which only this host's own sockets can do.
fn same_host(peer: IpAddr, local: Option<IpAddr>) -> bool {
    let canon = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    let peer = canon(peer);
    peer.is_loopback() || local.map(canon) == Some(peer)
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => admit(stream, peer, &shared),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => {
                tracing::warn!(error = %e, "store server: accept failed");
                std::thread::sleep(SERVER_TICK);
            }
        }
    }
}

/// Starts serving a new connection, or refuses it (logged) when it may not be served.
fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<ServerShared>) {
    let cfg = &shared.cfg;
    if cfg.token.is_none()
        && !cfg.insecure
        && !same_host(peer.ip(), stream.local_addr().ok().map(|a| a.ip()))
    {
        tracing::warn!(%peer, "store connection refused: it comes from another host, and a store without a job token (CDT_JOB_TOKEN) serves only this host unless insecure (CDT_INSECURE=1, dtrun --insecure)");
        return;
    }
    let Some(live) = Slot::take(shared, Count::Live, cfg.max_connections) else {
        tracing::warn!(%peer, max = cfg.max_connections, "store connection refused: the server has its maximum number of connections");
        return;
    };
    let Some(handshaking) = Slot::take(shared, Count::Handshaking, cfg.max_handshakes) else {
        tracing::warn!(%peer, max = cfg.max_handshakes, "store connection refused: too many connections are in their handshake");
        return;
    };
    let sh = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("cdt-store-conn".into())
        .spawn(move || {
            let _live = live;
            serve(stream, peer, &sh, handshaking);
        });
    // A thread that could not start dropped its closure, and the slots with it.
    if let Err(e) = spawned {
        tracing::warn!(%peer, error = %e, "store connection refused: cannot start a connection thread");
    }
}

/// The server's half of the handshake: `MAGIC | VERSION | nonce` from the client, then the
/// challenge-response over the token ([`crate::auth`]), all within the handshake timeout.
fn handshake(s: &mut TcpStream, sh: &ServerShared) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(SERVER_TICK))?;
    s.set_write_timeout(Some(sh.cfg.handshake_timeout))?;
    let deadline = Instant::now() + sh.cfg.handshake_timeout;
    let mut hello = [0u8; 5 + NONCE];
    read_full(s, &mut hello, Some(deadline), Some(&sh.stop))?;
    if hello[..5] != handshake_bytes() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not a candle-dtensor store client (or another protocol version)",
        ));
    }
    accept_challenge(
        s,
        &sh.token,
        &STORE_ROLES,
        &handshake_bytes(),
        &[b"cdt-store"],
        &hello[5..],
        deadline,
    )
}

fn serve(mut s: TcpStream, peer: SocketAddr, sh: &ServerShared, handshaking: Slot) {
    if let Err(e) = handshake(&mut s, sh) {
        let why = match e.kind() {
            ErrorKind::PermissionDenied => "it failed the token check".to_string(),
            ErrorKind::TimedOut => format!(
                "no complete handshake within {:?}",
                sh.cfg.handshake_timeout
            ),
            ErrorKind::Interrupted => return, // the server is stopping
            ErrorKind::UnexpectedEof => "it closed the connection in the handshake".to_string(),
            _ => e.to_string(),
        };
        tracing::warn!(%peer, reason = %why, "store connection refused");
        return;
    }
    drop(handshaking);
    let name = format!("store client {peer}");
    let max_value = sh.cfg.max_value_bytes;
    loop {
        let (op, body) = match read_frame(
            &mut s,
            &name,
            |op| request_limit(op, max_value),
            None,
            Some(&sh.stop),
        ) {
            Ok(f) => f,
            Err(FrameEnd::Boundary(e)) => {
                tracing::debug!(%peer, error = %e, "store connection ended");
                return;
            }
            Err(FrameEnd::Frame(e)) => {
                if !e.is_closing() {
                    tracing::warn!(%peer, error = %e, "store connection closed: bad request frame");
                }
                return;
            }
        };
        let (status, out) = match handle(sh, op, &body) {
            Ok(r) => r,
            Err(msg) => {
                let mut b = Vec::new();
                // Cut to the frame's limit at a character boundary (the client reads it as
                // UTF-8).
                let mut n = msg.len().min(MAX_ERROR - 4);
                while !msg.is_char_boundary(n) {
                    n -= 1;
                }
                put_bytes(&mut b, &msg.as_bytes()[..n]);
                (ST_ERROR, b)
            }
        };
        if let Err(e) = write_frame(&mut s, status, &out) {
            tracing::debug!(%peer, error = %e, "store connection ended");
            return;
        }
    }
}

/// Serves one request (the connection is authenticated). `Err`: an ERROR response.
pub(super) fn handle_request(
    sh_keys: &Mutex<Keys>,
    cv: &Condvar,
    stop: &AtomicBool,
    cfg: &StoreConfig,
    op: u8,
    body: &[u8],
) -> Result<(u8, Vec<u8>), String> {
    let lock = || sh_keys.lock().unwrap_or_else(|e| e.into_inner());
    let mut b = Body { b: body };
    let mut out = Vec::new();
    match op {
        OP_SET => {
            let key = b.string()?;
            let value = b.bytes()?;
            if value.len() > cfg.max_value_bytes {
                return Err(format!(
                    "a value of {} bytes for {key:?} is over the store's {}-byte limit",
                    value.len(),
                    cfg.max_value_bytes
                ));
            }
            lock().put(key, value.to_vec(), cfg.max_total_bytes)?;
            cv.notify_all();
            Ok((ST_OK, out))
        }
        OP_GET => {
            let key = b.string()?;
            match lock().map.get(&key) {
                Some(v) => {
                    put_bytes(&mut out, v);
                    Ok((ST_VALUE, out))
                }
                None => Ok((ST_NOT_FOUND, out)),
            }
        }
        OP_ADD => {
            let key = b.string()?;
            let delta = b.i64()?;
            let mut keys = lock();
            let cur = match keys.map.get(&key) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| format!("value of {key:?} is not a counter"))?,
            };
            let new = cur.wrapping_add(delta);
            keys.put(key, new.to_string().into_bytes(), cfg.max_total_bytes)?;
            drop(keys);
            cv.notify_all();
            out.extend_from_slice(&new.to_le_bytes());
            Ok((ST_INT, out))
        }
        OP_WAIT | OP_CHECK => {
            let keys = b.keys()?;
            let deadline = if op == OP_WAIT {
                Instant::now() + Duration::from_millis(b.u64()?.min(u32::MAX as u64 * 1000))
            } else {
                Instant::now()
            };
            let mut g = lock();
            loop {
                let missing: Vec<&String> =
                    keys.iter().filter(|k| !g.map.contains_key(*k)).collect();
                if missing.is_empty() {
                    return Ok((ST_READY, out));
                }
                let now = Instant::now();
                if now >= deadline || stop.load(Ordering::Relaxed) {
                    let m: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
                    put_keys(&mut out, &m);
                    return Ok((ST_MISSING, out));
                }
                let (ng, _) = cv
                    .wait_timeout(g, (deadline - now).min(SERVER_TICK))
                    .unwrap_or_else(|e| e.into_inner());
                g = ng;
            }
        }
        OP_DELETE => {
            let key = b.string()?;
            let existed = lock().remove(&key);
            out.push(u8::from(existed));
            Ok((ST_BOOL, out))
        }
        OP_PING => Ok((ST_OK, out)),
        other => Err(format!("unknown request {other}")),
    }
}

fn handle(sh: &ServerShared, op: u8, body: &[u8]) -> Result<(u8, Vec<u8>), String> {
    handle_request(&sh.keys, &sh.cv, &sh.stop, &sh.cfg, op, body)
}

/// A fresh key table with `cfg`'s limits, for the protocol fuzz test (which drives
/// [`handle_request`] without sockets).
#[cfg(test)]
pub(super) fn test_table() -> (Mutex<Keys>, Condvar, AtomicBool) {
    (
        Mutex::new(Keys::default()),
        Condvar::new(),
        AtomicBool::new(false),
    )
}

/// Bytes a test table holds.
#[cfg(test)]
pub(super) fn test_total(k: &Mutex<Keys>) -> usize {
    k.lock().unwrap_or_else(|e| e.into_inner()).total
}

#[cfg(test)]
pub(super) fn same_host_for_test(peer: IpAddr, local: Option<IpAddr>) -> bool {
    same_host(peer, local)
}
