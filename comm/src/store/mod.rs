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
//! One job per file: the protocol below (`wire.rs`), the server (`server.rs`), the client
//! (`client.rs`), the namespaced view (`prefix.rs`) and the process's world store that the
//! `process` and `nccl` backends share (`world.rs`).
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

mod client;
mod prefix;
mod server;
#[cfg(test)]
mod tests;
mod wire;
mod world;

use std::time::Duration;

use crate::error::CommError;

pub use client::TcpStore;
pub use prefix::PrefixStore;
pub use server::TcpStoreServer;
pub(crate) use wire::read_full;
pub(crate) use world::world_store;

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
