//! What a training script needs, in one import:
//!
//! ```
//! use candle_dtensor::prelude::*;
//! ```
//!
//! Ranks and meshes ([`LocalWorld`], [`DeviceMesh`]), DTensors ([`DTensor`],
//! [`distribute_tensor`], [`Placement`], [`CommDebugMode`]), parameters and optimizers
//! ([`ParamStore`], [`Init`], [`AdamW`] and candle-nn's [`Optimizer`] / [`ParamsAdamW`]), the
//! project's model ([`Gpt`], [`GptConfig`], [`TpPlan`]), FSDP for any candle model ([`Fsdp`],
//! [`FsdpConfig`], [`GradReduce`], [`FsdpVarMap`], [`reference_var_builder`]) and tensor
//! parallelism for candle-nn code ([`ColumnParallelLinear`], [`RowParallelLinear`],
//! [`VocabParallelEmbedding`] over a [`Group`]). The differentiable drop-ins for candle-nn's
//! norms are not here, as their names are candle-nn's: import them from [`crate::nn`].

pub use candle_dtensor_comm::{Comm, LocalWorld};
pub use candle_dtensor_core::debug::{label, CommDebugMode, Phase};
pub use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
pub use candle_dtensor_mesh::DeviceMesh;
pub use candle_dtensor_models::{Gpt, GptConfig, ModelError};
pub use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, FsdpOptimizer, GradReduce};
pub use candle_dtensor_parallel::fsdp_vb::{
    reference_var_builder, FsdpModule, FsdpVarMap, ROOT_UNIT,
};
pub use candle_dtensor_parallel::init::Init;
pub use candle_dtensor_parallel::tp_nn::{
    column_parallel_linear, column_parallel_linear_no_bias, row_parallel_linear,
    row_parallel_linear_no_bias, vocab_parallel_embedding, ColumnParallelLinear, Group,
    RowParallelLinear, TpLinearConfig, VocabParallelEmbedding,
};
pub use candle_dtensor_parallel::{MeshRoles, ParallelStyle, ParamStore, TpPlan};
pub use candle_dtensor_train::optim::AdamW;
pub use candle_nn::{Optimizer, ParamsAdamW};
