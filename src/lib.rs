//! candle-dtensor: distributed tensors, tensor parallelism and FSDP for candle.
//!
//! This facade re-exports the layers of the project; see `docs/ARCHITECTURE.md`.

pub use candle_dtensor_comm as comm;
pub use candle_dtensor_core as dtensor;
pub use candle_dtensor_mesh as mesh;
pub use candle_dtensor_models as models;
pub use candle_dtensor_strategies as strategies;
