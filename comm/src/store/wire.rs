//! The store's wire protocol (see the module docs of [`crate::store`]): constants, framing
//! and deadline-bound socket reads.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(super) const MAGIC: u32 = 0x5354_4443;
pub(super) const VERSION: u8 = 1;
/// The largest request or response frame accepted.
pub(super) const MAX_FRAME: usize = 256 << 20;
/// How often idle server threads look at the stop flag.
pub(super) const SERVER_TICK: Duration = Duration::from_millis(100);
/// Extra time a client allows the server beyond a WAIT's own timeout before giving up on it.
pub(super) const WAIT_SLACK: Duration = Duration::from_secs(5);

pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_ADD: u8 = 3;
pub(super) const OP_WAIT: u8 = 4;
pub(super) const OP_CHECK: u8 = 5;
pub(super) const OP_DELETE: u8 = 6;
pub(super) const OP_PING: u8 = 7;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_VALUE: u8 = 1;
pub(super) const ST_NOT_FOUND: u8 = 2;
pub(super) const ST_INT: u8 = 3;
pub(super) const ST_READY: u8 = 4;
pub(super) const ST_MISSING: u8 = 5;
pub(super) const ST_BOOL: u8 = 6;
pub(super) const ST_ERROR: u8 = 7;

pub(super) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

pub(super) fn put_keys(buf: &mut Vec<u8>, keys: &[&str]) {
    buf.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_bytes(buf, k.as_bytes());
    }
}

/// A cursor over a received frame body.
pub(super) struct Body<'a> {
    pub(super) b: &'a [u8],
}

impl<'a> Body<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
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
    pub(super) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u32(&mut self) -> Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    pub(super) fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn i64(&mut self) -> Result<i64, String> {
        Ok(self.u64()? as i64)
    }
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(super) fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "key is not UTF-8".to_string())
    }
    pub(super) fn keys(&mut self) -> Result<Vec<String>, String> {
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
pub(super) fn read_frame(
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

pub(super) fn write_frame(s: &mut TcpStream, tag: u8, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(5 + body.len());
    buf.extend_from_slice(&((body.len() + 1) as u32).to_le_bytes());
    buf.push(tag);
    buf.extend_from_slice(body);
    s.write_all(&buf)
}

pub(super) fn handshake_bytes() -> [u8; 5] {
    let mut h = [0u8; 5];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = VERSION;
    h
}

pub(super) fn resolve(addr: &str) -> Result<Vec<SocketAddr>, String> {
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
