//! The world store of this process: the rendezvous every launcher-started backend (`process`,
//! `nccl`) uses, at `MASTER_ADDR:MASTER_PORT`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::{StoreConfig, TcpStore, TcpStoreServer};
use crate::env::LaunchEnv;
use crate::error::{CommError, Result};

/// Created by the first `new_comm` that needs it and kept for the life of the process (rank 0
/// serves it to every other rank), whichever backends use it.
struct WorldStore {
    addr: String,
    _server: Option<TcpStoreServer>,
    client: Arc<TcpStore>,
}

/// The world store, and how many communicators of each (backend, name) `new_comm` created.
type WorldState = (Option<WorldStore>, HashMap<(String, String), u64>);

/// This process's client of the world store (connecting within `timeout`, and on rank 0
/// serving it first; both with [`StoreConfig::from_env`]: the job token of `CDT_JOB_TOKEN`,
/// `insecure` from `CDT_INSECURE=1`, warned about on every rank), and the index (1, 2, ...) of this creation of a `backend` communicator
/// named `name`, from which the backend makes the namespace of its rendezvous.
///
/// # Errors
///
/// [`CommError::Bootstrap`] naming the rank: a bad `MASTER_ADDR`/`MASTER_PORT`, a port rank 0
/// cannot listen on, a store that does not answer, or an address other than the one this
/// process already rendezvoused through.
pub fn world_store(
    env: &LaunchEnv,
    timeout: Duration,
    backend: &str,
    name: &str,
) -> Result<(Arc<TcpStore>, u64)> {
    static WORLD: OnceLock<Mutex<WorldState>> = OnceLock::new();
    let boot = |rank: usize, reason: String| CommError::Bootstrap {
        comm: name.to_string(),
        reason: format!("rank {rank}: {reason}"),
    };
    let addr = env
        .store_addr()
        .map_err(|e| boot(env.rank, e.to_string()))?;
    let mut g = WORLD
        .get_or_init(|| Mutex::new((None, HashMap::new())))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let client = match &g.0 {
        Some(w) if w.addr == addr => w.client.clone(),
        Some(w) => {
            return Err(boot(
                env.rank,
                format!(
                    "this process already rendezvoused through the store at {}; MASTER_ADDR/MASTER_PORT now say {addr}",
                    w.addr
                ),
            ))
        }
        None => {
            let cfg = StoreConfig::from_env();
            // With a token, `insecure` changes nothing (every connection still proves it).
            if cfg.insecure && !cfg.has_token() {
                tracing::warn!(
                    rank = env.rank,
                    store = %addr,
                    "{} is set and there is no job token: the rendezvous store serves other hosts \
                     unauthenticated (anyone who reaches it can read or replace its keys)",
                    crate::auth::INSECURE_ENV
                );
            }
            let server = if env.rank == 0 {
                Some(TcpStoreServer::bind_with(&addr, cfg.clone()).map_err(|e| {
                    boot(0, format!("{e} (another job may already serve a store there)"))
                })?)
            } else {
                None
            };
            let client = Arc::new(
                TcpStore::connect_with(&addr, timeout, &cfg)
                    .map_err(|e| boot(env.rank, e.to_string()))?,
            );
            g.0 = Some(WorldStore {
                addr,
                _server: server,
                client: client.clone(),
            });
            client
        }
    };
    let count =
        g.1.entry((backend.to_string(), name.to_string()))
            .or_insert(0);
    *count += 1;
    Ok((client, *count))
}
