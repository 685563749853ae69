//! The models: DTensor-native layers, a GPT (optionally with mixture-of-experts blocks), and
//! differentiable drop-ins for candle-nn's fused ops.
//!
//! # What lives here
//!
//! - [`layers`]: `Linear`, `Embedding`, `LayerNorm`, `RmsNorm`, `Attention`, `Mlp`, `Block`,
//!   written as for one device on DTensor ops, built through a [`builder::Builder`] (parameter
//!   store, mesh roles, tensor-parallel plan).
//! - [`Gpt`]: token + position embedding, pre-norm blocks, final norm, tied or untied head;
//!   optionally mixture-of-experts blocks ([`moe_layer`]: router, experts and balancing loss,
//!   whose tokens travel through candle-dtensor-parallel's expert-parallel dispatch).
//! - [`precision`]: mixed precision as a policy ([`Precision`]: f32, tf32, bf16) that the layers
//!   apply op by op; it travels on [`GptConfig::precision`].
//! - [`checkpoint`](mod@checkpoint): activation checkpointing (recompute a block's forward in backward
//!   instead of keeping its activations; [`AcMode`] picks the GPT's blocks).
//! - [`dropins`]: differentiable drop-ins for candle-nn's fused norms, softmax and rotary
//!   embeddings, which cut the autograd graph (candle#2168, #3011); the facade exports them as
//!   `candle_dtensor::nn`.
//!
//! # What does not
//!
//! How a model is spread over ranks (FSDP / HSDP, tensor-parallel plans and the candle-nn TP
//! layers, deterministic init, expert-parallel dispatch) is candle-dtensor-parallel's, which
//! this crate builds on. Training (optimizer, schedules, the trainers, data, checkpoints) is
//! candle-dtensor-train's, which builds on this one.

pub mod builder;
pub mod checkpoint;
pub mod dropins;
mod error;
pub mod gpt;
pub mod gpt_pp;
pub mod layers;
pub mod moe_layer;
pub mod precision;

pub use checkpoint::{checkpoint, AcMode};
pub use error::{ModelError, Result};
pub use gpt::{Gpt, GptConfig, NormKind};
pub use gpt_pp::{GptStage, StageInput};
pub use moe_layer::MoeLayer;
pub use precision::Precision;
