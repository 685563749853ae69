//! A small TCP key-value store for rendezvous (torch's `TCPStore`, Gloo's `rendezvous::Store`).
//!
//! # Overview
//!
//! - [`TcpStoreServer`] holds the keys. In a multi-process run rank 0 hosts it on
//!   `MASTER_ADDR:MASTER_PORT`; it serves each client connection on its own thread.
//! - [`TcpStore`] is a client: [`Store::set`], [`Store::get`] (waits for the key),
//!   [`Store::wait`] (several keys, with a timeout), [`Store::add`] (an atomic counter),
//!   [`Store::check`] (which keys are missing, without waiting) and [`Store::delete`].
//! - [`PrefixStore`] namespaces keys (`"<prefix>/<key>"`), so each communicator and each split
//!   rendezvous under keys of its own.
//!
//! Every blocking call is bounded by a timeout: connecting retries until the connect timeout
//! and then fails with [`StoreError::Unreachable`] naming the address and the timeout; `wait`
//! and `get` fail with [`StoreError::Timeout`] naming the keys still missing; every socket read
//! and write has a deadline. Nothing in this module can hang.
//!
//! # Wire protocol
//!
//! All integers are little-endian. `bytes` is a `u32` length followed by that many bytes; a
//! `key` is `bytes` holding UTF-8; `keys` is a `u32` count followed by that many `key`s.
//!
//! 1. Handshake: on connect the client sends `MAGIC: u32 = 0x5354_4443` ("CDTS") and
//!    `VERSION: u8 = 1`; the server answers with the same five bytes. Anything else closes the
//!    connection (so a client that reached some other service says so instead of hanging).
//! 2. Then requests and responses alternate on the connection. A request is a frame
//!    `len: u32 | op: u8 | body` where `len` counts `op` and `body`:
//!
//!    | op | name | body | response |
//!    |---|---|---|---|
//!    | 1 | SET | `key`, value `bytes` | OK |
//!    | 2 | GET | `key` | VALUE `bytes`, or NOT_FOUND |
//!    | 3 | ADD | `key`, delta `i64` | INT `i64` (the new value), or ERROR |
//!    | 4 | WAIT | `keys`, timeout in ms `u64` | READY, or MISSING `keys` after the timeout |
//!    | 5 | CHECK | `keys` | READY, or MISSING `keys` |
//!    | 6 | DELETE | `key` | BOOL `u8` (whether it existed) |
//!    | 7 | PING | (empty) | OK |
//!
//! 3. A response is a frame `len: u32 | status: u8 | body` with status OK = 0, VALUE = 1
//!    (`bytes`), NOT_FOUND = 2, INT = 3 (`i64`), READY = 4, MISSING = 5 (`keys`), BOOL = 6
//!    (`u8`), ERROR = 7 (`bytes`, a UTF-8 message).
//!
//! Counters ([`Store::add`]) are stored as decimal ASCII, as torch does, so `get` of a counter
//! reads `b"3"`. Frames over 256 MiB are refused (a garbage length must not allocate).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use candle_dtensor::comm::store::{PrefixStore, Store, TcpStore, TcpStoreServer};
//!
//! let server = TcpStoreServer::bind("127.0.0.1:0")?;
//! let store = Arc::new(TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5))?);
//! let ns = PrefixStore::new("job1", store.clone());
//! ns.set("ready", b"yes")?;
//! assert_eq!(store.get("job1/ready")?, b"yes");
//! assert_eq!(ns.add("count", 2)?, 2);
//! ns.wait(&["ready", "count"], Duration::from_secs(1))?;
//! # Ok::<(), candle_dtensor::comm::store::StoreError>(())
//! ```

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::CommError;

const MAGIC: u32 = 0x5354_4443;
const VERSION: u8 = 1;
/// The largest request or response frame accepted.
const MAX_FRAME: usize = 256 << 20;
/// How often idle server threads look at the stop flag.
const SERVER_TICK: Duration = Duration::from_millis(100);
/// Extra time a client allows the server beyond a WAIT's own timeout before giving up on it.
const WAIT_SLACK: Duration = Duration::from_secs(5);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_CHECK: u8 = 5;
const OP_DELETE: u8 = 6;
const OP_PING: u8 = 7;

const ST_OK: u8 = 0;
const ST_VALUE: u8 = 1;
const ST_NOT_FOUND: u8 = 2;
const ST_INT: u8 = 3;
const ST_READY: u8 = 4;
const ST_MISSING: u8 = 5;
const ST_BOOL: u8 = 6;
const ST_ERROR: u8 = 7;

/// What can go wrong talking to a store.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// No store answered at `addr` within `timeout` (connection refused, unroutable, or not a
    /// store).
    #[error("store at {addr} unreachable after {timeout:?}: {reason}")]
    Unreachable {
        /// The address tried.
        addr: String,
        /// How long the client kept trying.
        timeout: Duration,
        /// The last error seen.
        reason: String,
    },
    /// The server could not listen on `addr`.
    #[error("store server cannot listen on {addr}: {reason}")]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// `wait` (or `get`) ran out of time; `missing` are the keys that never appeared.
    #[error("store at {addr}: timed out after {timeout:?} waiting for keys {missing:?}")]
    Timeout {
        /// The store address.
        addr: String,
        /// The timeout.
        timeout: Duration,
        /// The keys still missing (as the caller named them).
        missing: Vec<String>,
    },
    /// A request failed on an established connection (I/O error, closed connection, a
    /// malformed response).
    #[error("store at {addr}: {op}: {reason}")]
    Io {
        /// The store address.
        addr: String,
        /// The request (`set`, `get`, ...).
        op: &'static str,
        /// What happened.
        reason: String,
    },
    /// The server refused the request (e.g. `add` on a value that is not a counter).
    #[error("store at {addr}: {op} of key {key:?}: {reason}")]
    Refused {
        /// The store address.
        addr: String,
        /// The request.
        op: &'static str,
        /// The key.
        key: String,
        /// The server's message.
        reason: String,
    },
}

impl From<StoreError> for CommError {
    fn from(e: StoreError) -> Self {
        CommError::Bootstrap {
            comm: "store".to_string(),
            reason: e.to_string(),
        }
    }
}

/// The store operations every implementation provides. Keys are UTF-8 strings.
pub trait Store: Send + Sync {
    /// Sets `key` to `value` (replacing any earlier value) and wakes its waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Returns the value of `key`, waiting for it up to the store's default timeout.
    ///
    /// # Errors
    ///
    /// [`StoreError::Timeout`] if the key does not appear in time.
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError>;
    /// Waits until every key in `keys` exists.
    ///
    /// # Errors
    ///
    /// [`StoreError::Timeout`] naming the missing keys after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;
    /// Returns the keys of `keys` that do not exist now (never waits).
    fn check(&self, keys: &[&str]) -> Result<Vec<String>, StoreError>;
    /// Adds `delta` to the counter `key` (created at 0) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool, StoreError>;
    /// The default timeout of [`Store::get`].
    fn timeout(&self) -> Duration;
    /// The address of the server behind this store (for messages).
    fn addr(&self) -> String;
}

// ---------------------------------------------------------------------------------------------
// Framing helpers
// ---------------------------------------------------------------------------------------------

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

fn put_keys(buf: &mut Vec<u8>, keys: &[&str]) {
    buf.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_bytes(buf, k.as_bytes());
    }
}

/// A cursor over a received frame body.
struct Body<'a> {
    b: &'a [u8],
}

impl<'a> Body<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!(
                "truncated frame: needed {n} more bytes, {} left",
                self.b.len()
            ));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn i64(&mut self) -> Result<i64, String> {
        Ok(self.u64()? as i64)
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "key is not UTF-8".to_string())
    }
    fn keys(&mut self) -> Result<Vec<String>, String> {
        let n = self.u32()? as usize;
        if n > self.b.len() / 4 {
            return Err(format!("implausible key count {n}"));
        }
        (0..n).map(|_| self.string()).collect()
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`. Read timeouts only re-check the deadline
/// and `stop`; bytes read so far are kept.
pub(crate) fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match s.read(&mut buf[off..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(k) => off += k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(ErrorKind::TimedOut.into());
                }
                if stop.is_some_and(|f| f.load(Ordering::Relaxed)) {
                    return Err(ErrorKind::Interrupted.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one `len | tag | body` frame.
fn read_frame(
    s: &mut TcpStream,
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> std::io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    read_full(s, &mut len, deadline, stop)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("bad frame length {len}"),
        ));
    }
    let mut body = vec![0u8; len];
    read_full(s, &mut body, deadline, stop)?;
    let tag = body[0];
    body.remove(0);
    Ok((tag, body))
}

fn write_frame(s: &mut TcpStream, tag: u8, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(5 + body.len());
    buf.extend_from_slice(&((body.len() + 1) as u32).to_le_bytes());
    buf.push(tag);
    buf.extend_from_slice(body);
    s.write_all(&buf)
}

fn handshake_bytes() -> [u8; 5] {
    let mut h = [0u8; 5];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = VERSION;
    h
}

fn resolve(addr: &str) -> Result<Vec<SocketAddr>, String> {
    addr.to_socket_addrs()
        .map(|a| a.collect::<Vec<_>>())
        .map_err(|e| format!("cannot resolve {addr}: {e}"))
        .and_then(|v| {
            if v.is_empty() {
                Err(format!("{addr} resolves to no address"))
            } else {
                Ok(v)
            }
        })
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Keys {
    map: HashMap<String, Vec<u8>>,
}

struct ServerShared {
    keys: Mutex<Keys>,
    cv: Condvar,
    stop: AtomicBool,
}

impl ServerShared {
    fn lock(&self) -> MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The server side of the store: a listener thread plus one thread per client connection.
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
    /// Listens on `addr` (`"127.0.0.1:0"` picks a free port; see [`TcpStoreServer::local_addr`]).
    ///
    /// # Errors
    ///
    /// [`StoreError::Bind`] if the address does not resolve or is in use.
    pub fn bind(addr: &str) -> Result<TcpStoreServer, StoreError> {
        let bind_err = |reason: String| StoreError::Bind {
            addr: addr.to_string(),
            reason,
        };
        let addrs = resolve(addr).map_err(bind_err)?;
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| bind_err(e.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| bind_err(e.to_string()))?;
        let local = listener.local_addr().map_err(|e| bind_err(e.to_string()))?;
        let shared = Arc::new(ServerShared {
            keys: Mutex::new(Keys::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
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
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.cv.notify_all();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let sh = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("cdt-store-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve(stream, &sh) {
                            tracing::debug!(%peer, error = %e, "store connection ended");
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "store server: cannot start a connection thread");
                }
            }
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

fn serve(mut s: TcpStream, sh: &ServerShared) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(SERVER_TICK))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut hello = [0u8; 5];
    read_full(
        &mut s,
        &mut hello,
        Some(Instant::now() + Duration::from_secs(10)),
        Some(&sh.stop),
    )?;
    if hello != handshake_bytes() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not a candle-dtensor store client",
        ));
    }
    s.write_all(&handshake_bytes())?;
    loop {
        let (op, body) = read_frame(&mut s, None, Some(&sh.stop))?;
        let (status, out) = match handle(sh, op, &body) {
            Ok(r) => r,
            Err(msg) => {
                let mut b = Vec::new();
                put_bytes(&mut b, msg.as_bytes());
                (ST_ERROR, b)
            }
        };
        write_frame(&mut s, status, &out)?;
    }
}

fn handle(sh: &ServerShared, op: u8, body: &[u8]) -> Result<(u8, Vec<u8>), String> {
    let mut b = Body { b: body };
    let mut out = Vec::new();
    match op {
        OP_SET => {
            let key = b.string()?;
            let value = b.bytes()?.to_vec();
            sh.lock().map.insert(key, value);
            sh.cv.notify_all();
            Ok((ST_OK, out))
        }
        OP_GET => {
            let key = b.string()?;
            match sh.lock().map.get(&key) {
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
            let mut keys = sh.lock();
            let cur = match keys.map.get(&key) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| format!("value of {key:?} is not a counter"))?,
            };
            let new = cur.wrapping_add(delta);
            keys.map.insert(key, new.to_string().into_bytes());
            drop(keys);
            sh.cv.notify_all();
            out.extend_from_slice(&new.to_le_bytes());
            Ok((ST_INT, out))
        }
        OP_WAIT | OP_CHECK => {
            let keys = b.keys()?;
            let deadline = if op == OP_WAIT {
                Instant::now() + Duration::from_millis(b.u64()?)
            } else {
                Instant::now()
            };
            let mut g = sh.lock();
            loop {
                let missing: Vec<&String> =
                    keys.iter().filter(|k| !g.map.contains_key(*k)).collect();
                if missing.is_empty() {
                    return Ok((ST_READY, out));
                }
                let now = Instant::now();
                if now >= deadline || sh.stop.load(Ordering::Relaxed) {
                    let m: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
                    put_keys(&mut out, &m);
                    return Ok((ST_MISSING, out));
                }
                let (ng, _) = sh
                    .cv
                    .wait_timeout(g, (deadline - now).min(SERVER_TICK))
                    .unwrap_or_else(|e| e.into_inner());
                g = ng;
            }
        }
        OP_DELETE => {
            let key = b.string()?;
            let existed = sh.lock().map.remove(&key).is_some();
            out.push(u8::from(existed));
            Ok((ST_BOOL, out))
        }
        OP_PING => Ok((ST_OK, out)),
        other => Err(format!("unknown request {other}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// A client of a [`TcpStoreServer`].
///
/// Thread-safe: concurrent requests use separate connections from a small pool (a `wait` on
/// one thread never delays a `set` on another).
pub struct TcpStore {
    addr: String,
    addrs: Vec<SocketAddr>,
    timeout: Duration,
    pool: Mutex<Vec<TcpStream>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl TcpStore {
    /// Connects to the server at `addr` (`host:port`), retrying refused connections (the
    /// server may not be up yet) until `timeout` has passed. `timeout` is also the default
    /// timeout of [`Store::get`] and of each request.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unreachable`] naming `addr` and `timeout`.
    ///
    /// # Blocking
    ///
    /// Up to `timeout`.
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore, StoreError> {
        let unreachable = |reason: String| StoreError::Unreachable {
            addr: addr.to_string(),
            timeout,
            reason,
        };
        let addrs = resolve(addr).map_err(unreachable)?;
        let store = TcpStore {
            addr: addr.to_string(),
            addrs,
            timeout,
            pool: Mutex::new(Vec::new()),
        };
        let conn = store.open(Instant::now() + timeout)?;
        store.release(conn);
        Ok(store)
    }

    /// The local address of a connection to the server: the interface this host uses to reach
    /// it (what peers on other hosts can dial back).
    pub fn local_ip(&self) -> Result<std::net::IpAddr, StoreError> {
        let conn = self.acquire("local_ip")?;
        let ip = conn.local_addr().map(|a| a.ip());
        self.release(conn);
        ip.map_err(|e| self.io("local_ip", e.to_string()))
    }

    fn io(&self, op: &'static str, reason: String) -> StoreError {
        StoreError::Io {
            addr: self.addr.clone(),
            op,
            reason,
        }
    }

    /// Opens a validated connection, retrying until `deadline`.
    fn open(&self, deadline: Instant) -> Result<TcpStream, StoreError> {
        let mut last = String::from("no attempt made");
        loop {
            for a in &self.addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt = left.clamp(Duration::from_millis(10), Duration::from_secs(2));
                match TcpStream::connect_timeout(a, attempt) {
                    Ok(mut s) => match Self::validate(&mut s, deadline) {
                        Ok(()) => return Ok(s),
                        Err(e) => last = format!("{a}: {e}"),
                    },
                    Err(e) => last = format!("{a}: {e}"),
                }
            }
            if Instant::now() >= deadline {
                return Err(StoreError::Unreachable {
                    addr: self.addr.clone(),
                    timeout: self.timeout,
                    reason: last,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn validate(s: &mut TcpStream, deadline: Instant) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        s.set_read_timeout(Some(left.min(Duration::from_secs(1))))?;
        s.set_write_timeout(Some(left))?;
        s.write_all(&handshake_bytes())?;
        let mut h = [0u8; 5];
        read_full(
            s,
            &mut h,
            Some(Instant::now() + left.max(Duration::from_millis(500))),
            None,
        )?;
        if h != handshake_bytes() {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                "the peer answered but is not a candle-dtensor store",
            ));
        }
        Ok(())
    }

    fn acquire(&self, _op: &'static str) -> Result<TcpStream, StoreError> {
        let pooled = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match pooled {
            Some(s) => Ok(s),
            None => self.open(Instant::now() + self.timeout),
        }
    }

    fn release(&self, s: TcpStream) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < 8 {
            pool.push(s);
        }
    }

    /// Sends one request and reads its response within `limit`. A connection that failed is
    /// dropped (not returned to the pool).
    fn request(
        &self,
        op_name: &'static str,
        op: u8,
        body: &[u8],
        limit: Duration,
    ) -> Result<(u8, Vec<u8>), StoreError> {
        let mut s = self.acquire(op_name)?;
        let deadline = Instant::now() + limit;
        let r = (|| {
            s.set_write_timeout(Some(limit.max(Duration::from_millis(100))))?;
            write_frame(&mut s, op, body)?;
            read_frame(&mut s, Some(deadline), None)
        })();
        match r {
            Ok((status, out)) => {
                self.release(s);
                if status == ST_ERROR {
                    let msg = Body { b: &out }
                        .string()
                        .unwrap_or_else(|_| "unreadable error".into());
                    return Err(self.io(op_name, format!("server error: {msg}")));
                }
                Ok((status, out))
            }
            Err(e) => Err(self.io(
                op_name,
                if e.kind() == ErrorKind::TimedOut {
                    format!("no response within {limit:?}")
                } else if e.kind() == ErrorKind::UnexpectedEof {
                    "the server closed the connection (is rank 0 still running?)".into()
                } else {
                    e.to_string()
                },
            )),
        }
    }

    fn unexpected(&self, op: &'static str, status: u8) -> StoreError {
        self.io(op, format!("unexpected response status {status}"))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut b = Vec::with_capacity(key.len() + value.len() + 8);
        put_bytes(&mut b, key.as_bytes());
        put_bytes(&mut b, value);
        match self.request("set", OP_SET, &b, self.timeout)? {
            (ST_OK, _) => Ok(()),
            (s, _) => Err(self.unexpected("set", s)),
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], self.timeout)?;
        let mut b = Vec::new();
        put_bytes(&mut b, key.as_bytes());
        match self.request("get", OP_GET, &b, self.timeout)? {
            (ST_VALUE, out) => Body { b: &out }
                .bytes()
                .map(|v| v.to_vec())
                .map_err(|e| self.io("get", e)),
            // Deleted between the wait and the get.
            (ST_NOT_FOUND, _) => Err(StoreError::Timeout {
                addr: self.addr.clone(),
                timeout: self.timeout,
                missing: vec![key.to_string()],
            }),
            (s, _) => Err(self.unexpected("get", s)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let mut b = Vec::new();
        put_keys(&mut b, keys);
        b.extend_from_slice(&(timeout.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        match self.request("wait", OP_WAIT, &b, timeout + WAIT_SLACK)? {
            (ST_READY, _) => Ok(()),
            (ST_MISSING, out) => Err(StoreError::Timeout {
                addr: self.addr.clone(),
                timeout,
                missing: Body { b: &out }.keys().map_err(|e| self.io("wait", e))?,
            }),
            (s, _) => Err(self.unexpected("wait", s)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<Vec<String>, StoreError> {
        let mut b = Vec::new();
        put_keys(&mut b, keys);
        match self.request("check", OP_CHECK, &b, self.timeout)? {
            (ST_READY, _) => Ok(Vec::new()),
            (ST_MISSING, out) => Body { b: &out }.keys().map_err(|e| self.io("check", e)),
            (s, _) => Err(self.unexpected("check", s)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut b = Vec::new();
        put_bytes(&mut b, key.as_bytes());
        b.extend_from_slice(&delta.to_le_bytes());
        match self.request("add", OP_ADD, &b, self.timeout) {
            Ok((ST_INT, out)) => Body { b: &out }.i64().map_err(|e| self.io("add", e)),
            Ok((s, _)) => Err(self.unexpected("add", s)),
            Err(StoreError::Io { reason, .. }) if reason.starts_with("server error: ") => {
                Err(StoreError::Refused {
                    addr: self.addr.clone(),
                    op: "add",
                    key: key.to_string(),
                    reason: reason["server error: ".len()..].to_string(),
                })
            }
            Err(e) => Err(e),
        }
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut b = Vec::new();
        put_bytes(&mut b, key.as_bytes());
        match self.request("delete", OP_DELETE, &b, self.timeout)? {
            (ST_BOOL, out) => Body { b: &out }
                .u8()
                .map(|v| v != 0)
                .map_err(|e| self.io("delete", e)),
            (s, _) => Err(self.unexpected("delete", s)),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn addr(&self) -> String {
        self.addr.clone()
    }
}

impl TcpStore {
    /// Round-trips an empty request (a liveness check).
    pub fn ping(&self) -> Result<(), StoreError> {
        match self.request("ping", OP_PING, &[], self.timeout)? {
            (ST_OK, _) => Ok(()),
            (s, _) => Err(self.unexpected("ping", s)),
        }
    }
}

/// A view of a store whose keys are `"<prefix>/<key>"` (Gloo's and torch's `PrefixStore`).
/// Errors name keys without the prefix.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .field("addr", &self.inner.addr())
            .finish()
    }
}

impl PrefixStore {
    /// Namespaces `inner` under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, k: &str) -> String {
        format!("{}/{k}", self.prefix)
    }

    fn strip(&self, e: StoreError) -> StoreError {
        let p = format!("{}/", self.prefix);
        match e {
            StoreError::Timeout {
                addr,
                timeout,
                missing,
            } => StoreError::Timeout {
                addr,
                timeout,
                missing: missing
                    .into_iter()
                    .map(|k| k.strip_prefix(&p).map(str::to_string).unwrap_or(k))
                    .collect(),
            },
            other => other,
        }
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(&self.key(key)).map_err(|e| self.strip(e))
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout).map_err(|e| self.strip(e))
    }
    fn check(&self, keys: &[&str]) -> Result<Vec<String>, StoreError> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let p = format!("{}/", self.prefix);
        Ok(self
            .inner
            .check(&refs)?
            .into_iter()
            .map(|k| k.strip_prefix(&p).map(str::to_string).unwrap_or(k))
            .collect())
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(&self.key(key), delta)
    }
    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(&self.key(key))
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn addr(&self) -> String {
        self.inner.addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (TcpStoreServer, Arc<TcpStore>) {
        let server = TcpStoreServer::bind("127.0.0.1:0").expect("bind");
        let client = TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5))
            .expect("connect");
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
        s.wait(&["x", "y"], Duration::from_secs(5)).unwrap();
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(140), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
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
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_secs(2),
            "{took:?}"
        );
        let short = TcpStore::connect(&server.local_addr().to_string(), Duration::from_millis(150))
            .unwrap();
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
        assert!(took < Duration::from_secs(2), "{took:?}");
        let msg = e.to_string();
        assert!(matches!(e, StoreError::Unreachable { .. }), "{msg}");
        assert!(msg.contains(&addr) && msg.contains("300ms"), "{msg}");
        let c: CommError = e.into();
        assert!(matches!(c, CommError::Bootstrap { .. }), "{c}");
    }

    #[test]
    fn a_listener_that_is_not_a_store_is_reported_not_waited_on() {
        // Accepts connections but never answers the handshake.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let held: Vec<_> = l.incoming().take(1).collect();
            std::thread::sleep(Duration::from_millis(800));
            drop(held);
        });
        let t0 = Instant::now();
        let e = TcpStore::connect(&addr, Duration::from_millis(400)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        assert!(matches!(e, StoreError::Unreachable { .. }), "{e}");
        t.join().unwrap();
    }

    #[test]
    fn a_stopped_server_makes_requests_fail_not_hang() {
        let (server, s) = pair();
        s.set("k", b"v").unwrap();
        drop(server);
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        assert!(s.set("k2", b"v").is_err());
        assert!(t0.elapsed() < Duration::from_secs(7), "{:?}", t0.elapsed());
    }
}
