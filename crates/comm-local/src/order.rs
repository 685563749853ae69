//! How the local backend orders its CUDA collectives' GPU work against the ranks' own streams
//! (`CDT_LOCAL_CUDA_ORDER`, read once per process).
//!
//! - `events` (the default): no host synchronisation. The issuing thread records an event on
//!   its stream; the progress threads' streams wait on every rank's event before reading, each
//!   records an event after its reads, the ranks exchange those, every progress stream waits
//!   on all of them before anything is released, and the caller's stream waits on its progress
//!   thread's final event when it waits on the work. As the NCCL backend orders its streams.
//! - `sync`: the first protocol (kept to rule the ordering out when a GPU run disagrees with
//!   the CPU): the issuer synchronizes its stream before queuing, each progress thread
//!   synchronizes after computing, and ranks depart together.

/// The ordering protocol of the local backend's CUDA collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CudaOrder {
    /// Ordered by CUDA events, no host synchronisation.
    Events,
    /// Synchronize the streams around each collective.
    Sync,
}

/// The environment variable that chooses the protocol.
pub(crate) const CUDA_ORDER_ENV: &str = "CDT_LOCAL_CUDA_ORDER";

impl CudaOrder {
    /// Parses a value of [`CUDA_ORDER_ENV`] (unset or empty: `events`).
    pub(crate) fn parse(value: Option<&str>) -> Result<CudaOrder, String> {
        match value.map(str::trim) {
            None | Some("") | Some("events") => Ok(CudaOrder::Events),
            Some("sync") => Ok(CudaOrder::Sync),
            Some(other) => Err(format!(
                "{CUDA_ORDER_ENV}={other:?}: expected `events` (the default) or `sync`"
            )),
        }
    }

    /// The process's protocol: [`CUDA_ORDER_ENV`] read once; a bad value is reported (once)
    /// and the default used.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn get() -> CudaOrder {
        static ORDER: std::sync::OnceLock<CudaOrder> = std::sync::OnceLock::new();
        *ORDER.get_or_init(|| {
            let value = std::env::var(CUDA_ORDER_ENV).ok();
            CudaOrder::parse(value.as_deref()).unwrap_or_else(|e| {
                tracing::warn!("{e}; using events");
                CudaOrder::Events
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_two_protocols_and_refuses_others_by_name() {
        assert_eq!(CudaOrder::parse(None), Ok(CudaOrder::Events));
        assert_eq!(CudaOrder::parse(Some("")), Ok(CudaOrder::Events));
        assert_eq!(CudaOrder::parse(Some(" events ")), Ok(CudaOrder::Events));
        assert_eq!(CudaOrder::parse(Some("sync")), Ok(CudaOrder::Sync));
        let e = CudaOrder::parse(Some("synchronous")).unwrap_err();
        assert!(
            e.contains(CUDA_ORDER_ENV) && e.contains("synchronous"),
            "{e}"
        );
    }
}
