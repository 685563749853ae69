//! candle-dtensor: distributed tensors, tensor parallelism and FSDP for candle.
//!
//! This facade re-exports the layers of the project; see `docs/ARCHITECTURE.md`. The `dtrun`
//! launcher is its own binary package (`cargo build --release -p dtrun`).

pub use candle_dtensor_comm as comm;
pub use candle_dtensor_core as dtensor;
pub use candle_dtensor_mesh as mesh;
pub use candle_dtensor_models as models;
pub use candle_dtensor_strategies as strategies;

/// Process tuning for CPU ranks (call at the start of `main`); defined next to the local
/// backend they tune, in [`comm::local`].
pub use candle_dtensor_comm::local::{
    init_cpu_allocator, init_cpu_threads, init_gemm_threads, CANDLE_NUM_THREADS_ENV,
    RAYON_NUM_THREADS_ENV,
};
