//! [`TcpStore`]: a client of a [`TcpStoreServer`](super::TcpStoreServer), with a small pool of
//! connections.

use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wire::*;
use super::{Store, StoreConfig, StoreError, STORE_ROLES};
use crate::auth::{dial_challenge, nonce, Token};

/// A client of a [`TcpStoreServer`].
///
/// Thread-safe: concurrent requests use separate connections from a small pool (a `wait` on
/// one thread never delays a `set` on another).
pub struct TcpStore {
    addr: String,
    addrs: Vec<SocketAddr>,
    timeout: Duration,
    pool: Mutex<Vec<TcpStream>>,
    /// The job's token, proved on every connection.
    token: Token,
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
        TcpStore::connect_with(addr, timeout, &StoreConfig::from_env())
    }

    /// [`TcpStore::connect`] proving `cfg`'s token (its limits are the server's business).
    ///
    /// # Errors
    ///
    /// [`StoreError::Unreachable`] naming `addr` and `timeout`; [`StoreError::Denied`] (at
    /// once, no retry) when the server and this client hold different tokens.
    pub fn connect_with(
        addr: &str,
        timeout: Duration,
        cfg: &StoreConfig,
    ) -> Result<TcpStore, StoreError> {
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
            token: cfg.token(),
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
                    Ok(mut s) => match self.validate(&mut s, deadline) {
                        Ok(()) => return Ok(s),
                        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                            return Err(StoreError::Denied {
                                addr: self.addr.clone(),
                                reason: format!("{a}: {e}"),
                            })
                        }
                        Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                            last = format!(
                                "{a}: the server closed the connection in the handshake (a \
                                 store without a job token serves only its own host unless \
                                 insecure; its log says why)"
                            )
                        }
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

    /// The client's half of the handshake: hello and nonce, then the challenge-response.
    fn validate(&self, s: &mut TcpStream, deadline: Instant) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        s.set_read_timeout(Some(left.min(Duration::from_secs(1))))?;
        s.set_write_timeout(Some(left))?;
        let nonce_c = nonce()?;
        let mut hello = handshake_bytes().to_vec();
        hello.extend_from_slice(&nonce_c);
        s.write_all(&hello)?;
        let check = |h: &[u8]| {
            if h != handshake_bytes() {
                return Err(std::io::Error::new(
                    ErrorKind::InvalidData,
                    "the peer answered but is not a candle-dtensor store (or another protocol version)",
                ));
            }
            Ok(())
        };
        dial_challenge(
            s,
            &self.token,
            &STORE_ROLES,
            5,
            check,
            &[b"cdt-store"],
            &nonce_c,
            Instant::now() + left.max(Duration::from_millis(500)),
        )
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
            s.set_write_timeout(Some(limit.max(Duration::from_millis(100))))
                .map_err(FrameEnd::Boundary)?;
            write_frame(&mut s, op, body).map_err(FrameEnd::Boundary)?;
            let peer = format!("store server {}", self.addr);
            read_frame(&mut s, &peer, response_limit, Some(deadline), None)
        })();
        match r {
            Ok((status, out)) => {
                self.release(s);
                if status == ST_ERROR {
                    // An error message is not a key: it may name a key of up to MAX_KEY bytes
                    // and be cut by the server, so read it whole and lossily.
                    let msg = Body { b: &out }
                        .bytes()
                        .map(|b| String::from_utf8_lossy(b).into_owned())
                        .unwrap_or_else(|_| "unreadable error".into());
                    return Err(self.io(op_name, format!("server error: {msg}")));
                }
                Ok((status, out))
            }
            Err(FrameEnd::Frame(error)) => Err(StoreError::Frame {
                addr: self.addr.clone(),
                op: op_name,
                error: Box::new(error),
            }),
            Err(FrameEnd::Boundary(e)) => Err(self.io(
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
