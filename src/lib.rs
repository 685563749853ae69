// The README is the crate's front page, and its Rust example a doctest.
#![doc = include_str!("../README.md")]

pub use candle_dtensor_comm as comm;
pub use candle_dtensor_core as dtensor;
pub use candle_dtensor_kernels as kernels;
pub use candle_dtensor_mesh as mesh;
pub use candle_dtensor_models as models;
/// The differentiable drop-ins for candle-nn's fused ops ([`models::dropins`]).
pub use candle_dtensor_models::dropins as nn;
pub use candle_dtensor_parallel as parallel;
pub use candle_dtensor_strategies as strategies;
pub use candle_dtensor_train as train;

pub mod prelude;

/// Process tuning for CPU ranks (call at the start of `main`); defined next to the local
/// backend they tune, in [`comm::local`].
pub use candle_dtensor_comm::local::{
    init_cpu_allocator, init_cpu_threads, init_gemm_threads, Tuned, CANDLE_NUM_THREADS_ENV,
    RAYON_NUM_THREADS_ENV,
};
