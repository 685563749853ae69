//! A small TCP key-value store for rendezvous (torch's `TCPStore`, Gloo's `rendezvous::Store`).
//!
//! # Overview
//!
//! - [`TcpStoreServer`] holds the keys. In a multi-process run rank 0 hosts it on
//!   `MASTER_ADDR:MASTER_PORT`; it serves each client connection on its own thread, at most
//!   [`StoreConfig::max_connections`] of them, each only after it proved the job's token.
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
//! One job per file: the protocol below (`wire.rs`), the server (`server.rs`), the client
//! (`client.rs`), the namespaced view (`prefix.rs`) and the process's world store that the
//! `process` and `nccl` backends share (`world.rs`).
//!
//! # Wire protocol
//!
//! All integers are little-endian. `bytes` is a `u32` length followed by that many bytes; a
//! `key` is `bytes` holding UTF-8; `keys` is a `u32` count followed by that many `key`s.
//!
//! 1. Handshake: on connect the client sends `MAGIC: u32 = 0x5354_4443` ("CDTS"),
//!    `VERSION: u8 = 2` and a 16-byte nonce; the server answers with the same five bytes, its
//!    own nonce and its proof, the client sends its proof, and the server acknowledges it
//!    with one byte `1` (the mesh's challenge-response, [`crate::auth`], with roles of its own:
//!    HMAC-SHA256 of the job token over the role, `"cdt-store"` and both nonces). Anything
//!    else closes the connection (so a client that reached some other service says so
//!    instead of hanging); a handshake not complete within [`StoreConfig::handshake_timeout`]
//!    is closed too. Refusals are logged by the server (`warn`, the peer's address and why).
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
//! reads `b"3"`.
//!
//! Frames are bounded per kind: a request body may hold at most what its op needs (a key of
//! at most 4 KiB, a value of at most [`StoreConfig::max_value_bytes`], a key list of at most
//! 1 MiB; PING nothing), a response at most what its status carries (VALUE up to 256 MiB).
//! A frame over its kind's limit, with an unknown tag, or cut off closes the connection with
//! a [`FrameError`] naming the peer, the kind and the sizes; a body's buffer grows only as its
//! bytes arrive (at most twice what arrived, or 64 KiB), never from the declared length alone.
//! SETs past [`StoreConfig::max_total_bytes`] stored are refused (an ERROR response).
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

mod client;
mod prefix;
#[cfg(test)]
mod security_tests;
mod server;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
mod wire;
mod world;

use std::time::Duration;

use crate::auth::{Roles, Token, INSECURE_ENV};
use crate::error::CommError;

/// The store's challenge-response roles ([`crate::auth`]): the mesh's proofs are no use here.
pub(crate) const STORE_ROLES: Roles = Roles {
    dial: "cdt-store-client",
    accept: "cdt-store-server",
};

/// How a store server and its clients authenticate, and the server's limits.
///
/// [`StoreConfig::from_env`] (what [`TcpStoreServer::bind`], [`TcpStore::connect`] and the
/// world store of `new_comm` use) takes the token from `CDT_JOB_TOKEN` and `insecure` from
/// `CDT_INSECURE=1`. With a token, every connection proves it before anything is served, so
/// only the job's ranks can read or replace keys (among them NCCL's unique id and the mesh's
/// addresses). Without one, the server serves only this host unless `insecure` is set.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct StoreConfig {
    token: Option<Token>,
    /// Without a token, serve peers on other hosts too (unauthenticated: anyone who reaches
    /// the port can read and replace keys). No effect with a token.
    pub insecure: bool,
    /// The most connections served at once (each has a thread); more are refused.
    pub max_connections: usize,
    /// The most connections in their handshake at once; more are refused.
    pub max_handshakes: usize,
    /// How long a connection may take to complete its handshake.
    pub handshake_timeout: Duration,
    /// The largest value a SET may store.
    pub max_value_bytes: usize,
    /// The most bytes of keys and values the server holds.
    pub max_total_bytes: usize,
}

impl Default for StoreConfig {
    /// No token, not insecure, and the default limits: 4096 connections, 128 in their
    /// handshake, 5 s to complete it, values up to 16 MiB, 256 MiB stored.
    fn default() -> Self {
        StoreConfig {
            token: None,
            insecure: false,
            max_connections: 4096,
            max_handshakes: 128,
            handshake_timeout: Duration::from_secs(5),
            max_value_bytes: 16 << 20,
            max_total_bytes: 256 << 20,
        }
    }
}

impl StoreConfig {
    /// The defaults with the token of `CDT_JOB_TOKEN` (if set) and `insecure` when
    /// `CDT_INSECURE` is `1`.
    pub fn from_env() -> Self {
        StoreConfig {
            token: Token::from_env_quiet(),
            insecure: std::env::var(INSECURE_ENV).is_ok_and(|v| v == "1"),
            ..StoreConfig::default()
        }
    }

    /// Uses `token` as the job's secret (an empty one means no token).
    pub fn with_token(mut self, token: &[u8]) -> Self {
        self.token = (!token.is_empty()).then(|| Token::new(token));
        self
    }

    /// Sets [`StoreConfig::insecure`].
    pub fn insecure(mut self, yes: bool) -> Self {
        self.insecure = yes;
        self
    }

    /// Whether connections are authenticated with a token.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The token connections prove (the empty token without one).
    pub(crate) fn token(&self) -> Token {
        self.token.clone().unwrap_or_else(|| Token::new(&[]))
    }
}

pub use client::TcpStore;
pub use prefix::PrefixStore;
pub use server::TcpStoreServer;
pub use wire::read_full;
pub use wire::FrameError;
pub use wire::FIRST_CHUNK;
pub use wire::{growing_error, io_words, read_full_counted, read_growing, Growable};
pub use world::world_store;

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
    /// The store failed our token check, or we failed its: a store of another job, or a
    /// wrong `CDT_JOB_TOKEN`.
    #[error("store at {addr}: authentication failed: {reason}")]
    Denied {
        /// The store address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The server sent a frame this client will not read (the connection was closed).
    #[error("store at {addr}: {op}: {error}")]
    Frame {
        /// The store address.
        addr: String,
        /// The request.
        op: &'static str,
        /// The frame and what is wrong with it.
        error: Box<FrameError>,
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
