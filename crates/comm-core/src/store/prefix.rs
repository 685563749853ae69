//! [`PrefixStore`]: a namespaced view of another store.

use std::sync::Arc;
use std::time::Duration;

use super::{Store, StoreError};

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
