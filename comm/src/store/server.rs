//! [`TcpStoreServer`]: the keys, a listener thread and one thread per client connection.

use std::collections::HashMap;
use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::wire::*;
use super::StoreError;

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
