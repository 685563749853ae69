//! candle-dtensor: distributed tensors, tensor parallelism and FSDP for candle.
//!
//! This facade re-exports the layers of the project; see `docs/ARCHITECTURE.md`.

pub use candle_dtensor_comm as comm;
pub use candle_dtensor_core as dtensor;
pub use candle_dtensor_mesh as mesh;
pub use candle_dtensor_models as models;
pub use candle_dtensor_strategies as strategies;

/// Environment variable that sizes candle 0.11's elementwise CPU worker pool.
pub const CANDLE_NUM_THREADS_ENV: &str = "CANDLE_NUM_THREADS";

/// Turns off candle's elementwise CPU worker pool unless the user sized it
/// (`CANDLE_NUM_THREADS`), and says whether it did.
///
/// Ranks of the local backend are threads that already keep the cores busy. candle 0.11's
/// pool serializes every caller behind one lock and spin-waits at its barrier, so with several
/// rank threads they block each other (measured: a 4-rank tensor-parallel step spent ~40% of
/// its time spinning, and even one rank ran ~2x slower on a 2-core machine). gemm keeps its
/// own threading. The pool is created on candle's first elementwise op, so call this at the
/// very start of `main`, before any candle op and before other threads start (it sets a
/// process environment variable).
pub fn init_cpu_threads() -> bool {
    if std::env::var_os(CANDLE_NUM_THREADS_ENV).is_some() {
        return false;
    }
    std::env::set_var(CANDLE_NUM_THREADS_ENV, "1");
    true
}
