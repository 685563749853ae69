//! The rendezvous of a new NCCL communicator through the store (torchcomms'
//! `TorchCommNCCLBootstrap`): rank 0 creates the `ncclUniqueId` and publishes it under
//! `"<ns>/id"`; the other ranks wait for it, bounded by the bootstrap timeout (a rank 0 that
//! never starts is named). Every rank also sets `"<ns>/joined/<rank>"` before calling
//! `ncclCommInitRankConfig`, so an init that times out can name the ranks that never joined
//! (NCCL itself cannot).

use std::time::{Duration, Instant};

use super::api::{NcclApi, UniqueId};
use candle_dtensor_comm_core::store::{Store, StoreError};
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::{CommError, Result};

fn boot(ctx: &OpCtx, reason: String) -> CommError {
    CommError::Bootstrap {
        comm: ctx.comm.to_string(),
        reason: format!("rank {}: {reason}", ctx.rank),
    }
}

/// Rank 0 creates and publishes the unique id; the others wait for it (up to `ctx.timeout`).
///
/// # Errors
///
/// [`CommError::Timeout`] naming rank 0 when the id never appears; [`CommError::Bootstrap`]
/// for store or NCCL failures and malformed ids.
pub fn exchange_unique_id(
    store: &dyn Store,
    ns: &str,
    api: &dyn NcclApi,
    ctx: &OpCtx,
) -> Result<UniqueId> {
    let key = format!("{ns}/id");
    if ctx.rank == 0 {
        let id = api
            .unique_id()
            .map_err(|c| boot(ctx, format!("ncclGetUniqueId failed: {c}")))?;
        store
            .set(&key, &id.0)
            .map_err(|e| boot(ctx, format!("publishing the NCCL unique id: {e}")))?;
        return Ok(id);
    }
    let deadline = Instant::now() + ctx.timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Waited for in slices, so a deadline is honoured even if the store is slow to answer.
        match store.wait(&[&key], left.min(Duration::from_millis(500))) {
            Ok(()) => break,
            Err(StoreError::Timeout { .. }) if Instant::now() < deadline => {}
            Err(StoreError::Timeout { .. }) => {
                return Err(CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing: vec![0],
                })
            }
            Err(e) => {
                return Err(boot(
                    ctx,
                    format!("waiting for rank 0's NCCL unique id: {e}"),
                ))
            }
        }
    }
    let bytes = store
        .get(&key)
        .map_err(|e| boot(ctx, format!("reading the NCCL unique id: {e}")))?;
    let id: [u8; 128] = bytes.as_slice().try_into().map_err(|_| {
        boot(
            ctx,
            format!(
                "the NCCL unique id under {key:?} has {} bytes, expected 128",
                bytes.len()
            ),
        )
    })?;
    Ok(UniqueId(id))
}

/// Marks this rank as having reached `ncclCommInitRankConfig`.
///
/// # Errors
///
/// [`CommError::Bootstrap`] when the store fails.
pub fn mark_joined(store: &dyn Store, ns: &str, ctx: &OpCtx) -> Result<()> {
    store
        .set(&format!("{ns}/joined/{}", ctx.rank), b"1")
        .map_err(|e| boot(ctx, format!("store: {e}")))
}

/// The ranks that have not marked themselves joined (empty if the store cannot tell).
pub fn missing_ranks(store: &dyn Store, ns: &str, size: usize) -> Vec<usize> {
    let keys: Vec<String> = (0..size).map(|r| format!("{ns}/joined/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.check(&refs) {
        Ok(missing) => {
            let mut ranks: Vec<usize> = missing
                .iter()
                .filter_map(|k| k.rsplit('/').next().and_then(|r| r.parse().ok()))
                .collect();
            ranks.sort_unstable();
            ranks
        }
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::MockApi;
    use candle_dtensor_comm_core::store::{TcpStore, TcpStoreServer};

    fn ctx(rank: usize, timeout: Duration) -> OpCtx {
        OpCtx::bootstrap("world", rank, timeout)
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let api = MockApi::new();
        let ids: Vec<UniqueId> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .rev()
                .map(|rank| {
                    let (addr, api) = (addr.clone(), &api);
                    s.spawn(move || {
                        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
                        let c = ctx(rank, Duration::from_secs(10));
                        mark_joined(&store, "cdt/nccl/world/1", &c).unwrap();
                        exchange_unique_id(&store, "cdt/nccl/world/1", api, &c).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.iter().all(|id| *id == ids[0]));
        assert_eq!(ids[0], api.unique_id().unwrap());
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        assert!(missing_ranks(&store, "cdt/nccl/world/1", 3).is_empty());
        assert_eq!(missing_ranks(&store, "cdt/nccl/world/1", 5), vec![3, 4]);
    }

    #[test]
    fn a_missing_rank_zero_is_named_after_the_timeout() {
        let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        // The store's own timeout is long: waiting it out instead of the op's 300 ms fails the
        // bound below, a third of it, which is far above what load adds to 300 ms.
        let store_timeout = Duration::from_secs(60);
        let store = TcpStore::connect(&server.local_addr().to_string(), store_timeout).unwrap();
        let t0 = Instant::now();
        let e = exchange_unique_id(
            &store,
            "ns",
            &MockApi::new(),
            &ctx(2, Duration::from_millis(300)),
        )
        .unwrap_err();
        assert!(
            t0.elapsed() < store_timeout / 3,
            "bounded by the op's timeout, not the store's: {:?}",
            t0.elapsed()
        );
        match e {
            CommError::Timeout { missing, ctx, .. } => {
                assert_eq!(missing, vec![0]);
                assert_eq!(ctx.rank, 2);
            }
            other => panic!("expected a timeout, got {other}"),
        }
    }

    #[test]
    fn a_malformed_id_is_reported() {
        let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        let store =
            TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
        store.set("ns/id", b"short").unwrap();
        let e = exchange_unique_id(
            &store,
            "ns",
            &MockApi::new(),
            &ctx(1, Duration::from_secs(2)),
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("5 bytes, expected 128") && m.contains("rank 1"),
            "{m}"
        );
    }
}
