//! What trains: DTensor-native layers, a GPT, tensor-parallel plans, deterministic init and
//! training utilities.
//!
//! # Overview
//!
//! - [`layers`]: `Linear`, `Embedding`, `LayerNorm`, `RmsNorm`, `Attention`, `Mlp`, `Block`,
//!   written as for one device on DTensor ops.
//! - [`TpPlan`] maps module names to [`ParallelStyle`]s (column / row parallel, sequence
//!   parallel, vocab-parallel embedding; loss-parallel cross-entropy); the styles only declare
//!   placements and boundary layouts, the compiler derives every collective.
//! - [`Gpt`]: token + position embedding, pre-norm blocks, final norm, tied or untied head;
//!   optionally mixture-of-experts blocks ([`moe`]: top-k routing, expert parallelism over the
//!   mesh dim `ep` with token dispatch over all_to_all_v or RMA windows).
//! - [`nn`]: differentiable drop-ins for candle-nn's fused norms, softmax and rotary
//!   embeddings, which cut the autograd graph (candle#2168, #3011).
//! - [`tp_nn`]: tensor parallelism for candle-nn code: column / row-parallel linears and a
//!   vocab-parallel embedding on plain tensors (Megatron's collectives), built from a
//!   `VarBuilder`; composable with FSDP ([`fsdp_vb`]).
//! - [`init`]: a counter-based initialiser keyed by global index, so any mesh holds exactly
//!   the single-device parameters for a seed.
//! - [`fit`]: the training step and loop for any model ([`fit::Trainer`]): a user's candle-nn
//!   forward under FSDP / tensor parallelism, with FSDP's reduction, the global gradient norm
//!   and clipping, the learning-rate schedule, AdamW and per-step metrics. [`trainer`]: the
//!   GPT's training run on top of it (data, evaluation, checkpoints, fault tolerance).
//! - [`data`]: a synthetic corpus and token streams.
//! - [`optim`]: AdamW with candle-nn's exact math in one fused pass, its state accessible,
//!   weight decay per parameter; [`schedule`]: warmup and cosine / linear learning-rate
//!   decay, and which parameters decay.
//! - [`checkpoint`]: distributed checkpoints (every rank writes its pieces, one manifest) that
//!   load into any layout, consolidate into one plain safetensors file, and verify checksums.

pub mod checkpoint;
pub mod data;
pub mod device;
mod error;
pub mod fit;
pub mod fsdp;
pub mod fsdp_vb;
pub mod gpt;
pub mod init;
pub mod layers;
pub mod moe;
pub mod nn;
pub mod optim;
pub mod params;
pub mod plan;
pub mod schedule;
pub mod tp_nn;
pub mod trainer;

pub use error::{ModelError, Result};
pub use gpt::{Gpt, GptConfig, NormKind};
pub use moe::{DispatchKind, MoeConfig, MoeError, MoeLayer, MoeStats};
pub use params::{Param, ParamStore, VarBox};
pub use plan::{MeshRoles, ParallelStyle, TpPlan};
