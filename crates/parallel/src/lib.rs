//! How a model is spread over ranks: fully sharded data parallelism, tensor parallelism and
//! expert parallelism, for any candle model and for the DTensor models of
//! candle-dtensor-models.
//!
//! # What lives here
//!
//! - [`fsdp`]: FSDP / HSDP for any candle model (per-unit all-gather before use, release after,
//!   reduce-scatter of gradients, replicas over a second mesh dim); [`fsdp_vb`] builds a
//!   candle-nn model's parameters sharded from the start through a `VarBuilder`
//!   ([`fsdp_vb::FsdpVarMap`]).
//! - [`params`]: the parameters of a DTensor model ([`ParamStore`], [`Param`], [`VarBox`]),
//!   created on a mesh by name, shape and placements and handed to FSDP.
//! - [`tp_plan`]: tensor-parallel plans ([`TpPlan`] maps module names to [`ParallelStyle`]s)
//!   and the mesh dim roles ([`MeshRoles`]); the styles only declare placements and boundary
//!   layouts, the compiler derives every collective.
//! - [`tp_nn`]: tensor parallelism for candle-nn code: column / row-parallel linears and a
//!   vocab-parallel embedding on plain tensors (Megatron's collectives), built from a
//!   `VarBuilder`; composable with FSDP ([`fsdp_vb`]).
//! - [`init`]: a counter-based initialiser keyed by global index, so any mesh holds exactly
//!   the single-device parameters for a seed (used by [`params`], [`fsdp_vb`] and [`tp_nn`]).
//! - [`moe`]: expert parallelism over the mesh dim `ep`: the settings ([`MoeConfig`]), the
//!   communicators ([`MoeGroups`]), top-k routing tables and the token dispatch / combine over
//!   all_to_all_v or RMA windows.
//!
//! - [`pipeline`]: pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B,
//!   ZB-H1) with validation and a bubble simulator, and one executor running any schedule
//!   over point-to-point transfers.
//!
//! Context parallelism will live here too.
//!
//! # What does not
//!
//! The layers and models themselves (the GPT, its blocks, the mixture-of-experts layer built
//! on [`moe`], candle-nn drop-ins) are candle-dtensor-models'; optimizers, schedules, the
//! training loop, data and checkpoints are candle-dtensor-train's. This crate depends on
//! neither.

mod error;
pub mod fsdp;
pub mod fsdp_vb;
pub mod init;
pub mod moe;
pub mod params;
pub mod pipeline;
pub mod tp_nn;
pub mod tp_plan;

pub use error::{ParallelError, Result};
pub use moe::{DispatchKind, MoeConfig, MoeError, MoeGroups, MoeStats};
pub use params::{Param, ParamStore, VarBox};
pub use tp_plan::{MeshRoles, ParallelStyle, TpPlan};
