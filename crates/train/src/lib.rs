//! Training: the optimizer, learning-rate schedules, the training loop for any model, the
//! GPT's training run, data and distributed checkpoints.
//!
//! # What lives here
//!
//! - [`optim`]: AdamW with candle-nn's exact math in one fused pass, its state accessible,
//!   weight decay per parameter; [`schedule`]: warmup and cosine / linear learning-rate
//!   decay, and which parameters decay.
//! - [`fit`]: the training step and loop for any model ([`fit::Trainer`]): a user's candle-nn
//!   forward under FSDP / tensor parallelism, with FSDP's reduction, the global gradient norm
//!   and clipping, the learning-rate schedule, AdamW and per-step metrics.
//! - [`trainer`]: the GPT's training run on top of it (data, evaluation, checkpoints, fault
//!   tolerance), shared by the `train_gpt` example and the tests.
//! - [`pipeline`]: the GPT over a `pp` mesh dim (pipeline stages run by any schedule of
//!   candle-dtensor-parallel's executor, optionally replicated over `dp`).
//! - [`data`]: a synthetic corpus and token streams.
//! - [`checkpoint`]: distributed checkpoints (every rank writes its pieces, one manifest) that
//!   load into any layout, consolidate into one plain safetensors file, and verify checksums.
//! - [`device`]: which device a rank computes on (`cpu`, `cuda`, `cuda:N`), a setting of a
//!   training job (`--device`); the libraries below never pick a device themselves.
//!
//! # What does not
//!
//! How parameters are sharded and exchanged (FSDP / HSDP, tensor and expert parallelism,
//! deterministic init, [`ParamStore`](candle_dtensor_parallel::ParamStore)) is
//! candle-dtensor-parallel's; the layers and the GPT are candle-dtensor-models'. This crate
//! builds on both and neither depends on it.

pub mod checkpoint;
pub mod data;
pub mod device;
pub mod fit;
pub mod optim;
pub mod pipeline;
pub mod schedule;
pub mod trainer;

pub use checkpoint::{CheckpointError, StoreCheckpoint};
pub use fit::{Trainer, TrainerError};
pub use trainer::RunError;
