//! The store's wire protocol (see the module docs of [`crate::store`]): constants, framing
//! and deadline-bound socket reads, and the bounded frame reading the `process` backend's
//! transport shares ([`read_growing`], [`FrameError`]).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(super) const MAGIC: u32 = 0x5354_4443;
/// 2: the handshake carries the token challenge-response ([`crate::auth`]).
pub(super) const VERSION: u8 = 2;
/// The largest request or response frame accepted at all (a VALUE response; requests have
/// tighter limits per op, see [`request_limit`]).
pub(super) const MAX_FRAME: usize = 256 << 20;
/// The longest key accepted.
pub(super) const MAX_KEY: usize = 4096;
/// The largest encoded key list (WAIT, CHECK, MISSING) accepted.
pub(super) const MAX_KEY_LIST: usize = 1 << 20;
/// The largest ERROR response accepted.
pub(super) const MAX_ERROR: usize = 64 << 10;
/// How often idle server threads look at the stop flag.
pub(super) const SERVER_TICK: Duration = Duration::from_millis(100);
/// Extra time a client allows the server beyond a WAIT's own timeout before giving up on it.
pub(super) const WAIT_SLACK: Duration = Duration::from_secs(5);
/// The first buffer a body whose length a peer declared gets; it then doubles only as bytes
/// arrive (see [`read_growing`]).
pub const FIRST_CHUNK: usize = 64 << 10;

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

/// A frame a peer sent that this end will not read: the connection it came on is closed.
/// Every variant names the peer (a rank and its address, or a store client's address), the
/// frame kind and the sizes.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The declared length is over what a frame of this kind may hold.
    #[error("{peer}: {kind} frame declares {len} bytes, over the {max}-byte limit of its kind; connection closed")]
    TooLarge {
        /// Who sent it.
        peer: String,
        /// The frame kind (`"HELLO"`, `"DATA"`, `"store SET request"`, ...).
        kind: String,
        /// The length the frame declared.
        len: u64,
        /// The limit for its kind.
        max: u64,
    },
    /// The frame's bytes do not decode (an unknown kind, a body that is not what its kind
    /// holds).
    #[error("{peer}: malformed {kind} frame of {len} bytes: {reason}; connection closed")]
    Malformed {
        /// Who sent it.
        peer: String,
        /// The frame kind as far as it was read.
        kind: String,
        /// The frame's declared length.
        len: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// The connection ended or failed inside a frame.
    #[error("{peer}: {kind} frame cut off after {got} of {len} bytes: {reason}")]
    Truncated {
        /// Who sent it.
        peer: String,
        /// The frame kind.
        kind: String,
        /// Bytes of the frame received.
        got: u64,
        /// The frame's declared length.
        len: u64,
        /// Why reading stopped.
        reason: String,
    },
}

impl FrameError {
    /// Whether reading stopped because this end is closing (not the peer's doing).
    pub fn is_closing(&self) -> bool {
        matches!(self, FrameError::Truncated { reason, .. } if reason == CLOSING)
    }
}

/// The reason [`read_full`]'s `Interrupted` (the stop flag) is reported with.
pub(crate) const CLOSING: &str = "closing";

/// A buffer [`read_growing`] can fill: `n` zero bytes, or `None` when they cannot be
/// allocated (a peer's frame must never abort the process).
pub trait Growable: Sized {
    /// A buffer of `n` zero bytes, or `None` when they cannot be allocated.
    fn zeroed(n: usize) -> Option<Self>;
    /// The buffer's bytes, to be written.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Grows to `n` bytes (at least the current length), keeping the content and zeroing only
    /// the new bytes; in place where the allocator can extend the block. `None`: no memory.
    fn grow(&mut self, n: usize) -> Option<()>;
}

/// The process backend's payloads (8-byte aligned, pooled).
impl Growable for crate::cpu::bytes::Bytes {
    fn zeroed(n: usize) -> Option<Self> {
        Self::try_zeroed(n)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        crate::cpu::bytes::Bytes::bytes_mut(self)
    }
    fn grow(&mut self, n: usize) -> Option<()> {
        self.try_grow(n)
    }
}

impl Growable for Vec<u8> {
    fn zeroed(n: usize) -> Option<Self> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).ok()?;
        v.resize(n, 0);
        Some(v)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
    fn grow(&mut self, n: usize) -> Option<()> {
        self.try_reserve_exact(n.checked_sub(self.len())?).ok()?;
        self.resize(n, 0);
        Some(())
    }
}

/// Reads a body of `len` bytes (a length the peer declared, already checked against its
/// kind's limit) into a buffer that grows only as bytes arrive: the first allocation is
/// `min(len, FIRST_CHUNK)`, and each later one `min(len, 2 x bytes received)`, so a peer that
/// declares a huge frame and sends little costs at most [`FIRST_CHUNK`], and no buffer is ever
/// larger than twice what arrived (or `FIRST_CHUNK`). `Err` carries the bytes received and
/// the I/O error (or `None`: the buffer could not be allocated).
pub fn read_growing<B: Growable, R: Read + ?Sized>(
    r: &mut R,
    len: usize,
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> Result<B, (usize, Option<std::io::Error>)> {
    let mut buf = B::zeroed(len.min(FIRST_CHUNK)).ok_or((0, None))?;
    let mut got = 0;
    loop {
        let cap = buf.bytes_mut().len();
        if let Err(e) = read_full_counted(r, &mut buf.bytes_mut()[got..cap], deadline, stop) {
            return Err((got + e.0, Some(e.1)));
        }
        got = cap;
        if got == len {
            return Ok(buf);
        }
        // Reallocation rather than a fresh zeroed buffer and a copy: the old bounded-wire
        // version zeroed about twice the frame and copied it once more, which made 16-64 MiB
        // transfers of the process backend 13-30% slower (mp_allreduce --bench, 2 ranks).
        buf.grow(len.min(got.saturating_mul(2)))
            .ok_or((got, None))?;
    }
}

/// Maps a [`read_growing`] failure to a [`FrameError`] (`peer`, `kind`, sizes).
pub fn growing_error(
    peer: &str,
    kind: &str,
    len: u64,
    (got, e): (usize, Option<std::io::Error>),
) -> FrameError {
    FrameError::Truncated {
        peer: peer.to_string(),
        kind: kind.to_string(),
        got: got as u64,
        len,
        reason: match e {
            None => format!("cannot allocate a buffer for {got} of {len} bytes"),
            Some(e) => io_words(&e),
        },
    }
}

/// What an I/O error inside a frame means, in words (`closing` for the stop flag).
pub fn io_words(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof => "the connection closed".into(),
        ErrorKind::Interrupted => CLOSING.into(),
        ErrorKind::TimedOut => "timed out".into(),
        _ => e.to_string(),
    }
}

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
        let b = self.bytes()?;
        if b.len() > MAX_KEY {
            return Err(format!(
                "key of {} bytes, over the {MAX_KEY}-byte limit",
                b.len()
            ));
        }
        String::from_utf8(b.to_vec()).map_err(|_| "key is not UTF-8".to_string())
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
/// and `stop` (then `Interrupted`); bytes read so far are kept.
pub fn read_full<R: Read + ?Sized>(
    s: &mut R,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> std::io::Result<()> {
    read_full_counted(s, buf, deadline, stop).map_err(|(_, e)| e)
}

/// [`read_full`], reporting on failure how many bytes had arrived.
pub fn read_full_counted<R: Read + ?Sized>(
    s: &mut R,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> Result<(), (usize, std::io::Error)> {
    let mut off = 0;
    while off < buf.len() {
        match s.read(&mut buf[off..]) {
            Ok(0) => return Err((off, ErrorKind::UnexpectedEof.into())),
            Ok(k) => off += k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err((off, ErrorKind::TimedOut.into()));
                }
                if stop.is_some_and(|f| f.load(Ordering::Relaxed)) {
                    return Err((off, ErrorKind::Interrupted.into()));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err((off, e)),
        }
    }
    Ok(())
}

/// How reading a store frame ended, when it did not yield one.
#[derive(Debug)]
pub(super) enum FrameEnd {
    /// Between frames: the peer closed, the stop flag, a timeout or an I/O error before the
    /// first byte of a frame.
    Boundary(std::io::Error),
    /// Inside or about a frame: the connection must be closed.
    Frame(FrameError),
}

/// The most a request body of `op` may hold (with a server whose values may be up to
/// `max_value` bytes), and the request's name; `None`: no such op.
pub(super) fn request_limit(op: u8, max_value: usize) -> Option<(usize, &'static str)> {
    let key = 4 + MAX_KEY;
    Some(match op {
        OP_SET => (key + 4 + max_value, "store SET request"),
        OP_GET => (key, "store GET request"),
        OP_ADD => (key + 8, "store ADD request"),
        OP_WAIT => (MAX_KEY_LIST + 8, "store WAIT request"),
        OP_CHECK => (MAX_KEY_LIST, "store CHECK request"),
        OP_DELETE => (key, "store DELETE request"),
        OP_PING => (0, "store PING request"),
        _ => return None,
    })
}

/// The most a response body of `status` may hold, and its name; `None`: no such status.
pub(super) fn response_limit(status: u8) -> Option<(usize, &'static str)> {
    Some(match status {
        ST_OK => (0, "store OK response"),
        ST_VALUE => (4 + MAX_FRAME, "store VALUE response"),
        ST_NOT_FOUND => (0, "store NOT_FOUND response"),
        ST_INT => (8, "store INT response"),
        ST_READY => (0, "store READY response"),
        ST_MISSING => (MAX_KEY_LIST, "store MISSING response"),
        ST_BOOL => (1, "store BOOL response"),
        ST_ERROR => (MAX_ERROR, "store ERROR response"),
        _ => return None,
    })
}

/// Reads one `len | tag | body` frame from `peer`: the tag must be one `limit` knows, and the
/// body no longer than `limit` allows for it; the body's buffer grows only as its bytes
/// arrive ([`read_growing`]).
pub(super) fn read_frame<R: Read + ?Sized>(
    s: &mut R,
    peer: &str,
    limit: impl Fn(u8) -> Option<(usize, &'static str)>,
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> Result<(u8, Vec<u8>), FrameEnd> {
    let mut head = [0u8; 5];
    match read_full_counted(s, &mut head[..4], deadline, stop) {
        Ok(()) => {}
        Err((0, e)) => return Err(FrameEnd::Boundary(e)),
        Err((got, e)) => {
            return Err(FrameEnd::Frame(FrameError::Truncated {
                peer: peer.to_string(),
                kind: "store frame length".into(),
                got: got as u64,
                len: 4,
                reason: io_words(&e),
            }))
        }
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as u64;
    if len == 0 {
        return Err(FrameEnd::Frame(FrameError::Malformed {
            peer: peer.to_string(),
            kind: "store frame".into(),
            len,
            reason: "an empty frame (no tag)".into(),
        }));
    }
    if let Err((_, e)) = read_full_counted(s, &mut head[4..], deadline, stop) {
        return Err(FrameEnd::Frame(FrameError::Truncated {
            peer: peer.to_string(),
            kind: "store frame".into(),
            got: 0,
            len,
            reason: io_words(&e),
        }));
    }
    let tag = head[4];
    let Some((max, kind)) = limit(tag) else {
        return Err(FrameEnd::Frame(FrameError::Malformed {
            peer: peer.to_string(),
            kind: format!("store frame tag {tag}"),
            len,
            reason: "unknown tag".into(),
        }));
    };
    let body_len = len - 1;
    if body_len > max as u64 {
        return Err(FrameEnd::Frame(FrameError::TooLarge {
            peer: peer.to_string(),
            kind: kind.into(),
            len: body_len,
            max: max as u64,
        }));
    }
    let body: Vec<u8> = read_growing(s, body_len as usize, deadline, stop)
        .map_err(|e| FrameEnd::Frame(growing_error(peer, kind, body_len, e)))?;
    Ok((tag, body))
}

pub(super) fn write_frame(s: &mut TcpStream, tag: u8, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(5 + body.len());
    buf.extend_from_slice(&((body.len() + 1) as u32).to_le_bytes());
    buf.push(tag);
    buf.extend_from_slice(body);
    s.write_all(&buf)
}

/// The first bytes of either side's handshake.
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
