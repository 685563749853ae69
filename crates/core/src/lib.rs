//! DTensor: candle tensors with placements on a [`DeviceMesh`](candle_dtensor_mesh::DeviceMesh).
//!
//! # Overview
//!
//! - [`DTensor`] = this rank's local piece (a candle `Tensor`) + a spec (placements
//!   `Shard(d)` / `Replicate` / `Partial(op)` per mesh dim, global shape, dtype). Build one with
//!   [`distribute_tensor`] (from a full tensor) or [`DTensor::from_local`] (from local pieces,
//!   uneven shards with torch.chunk semantics).
//! - Ops are methods (`matmul`, `add`, `sum`, `softmax`, `reshape`, `embedding`,
//!   `cross_entropy`, ...). Each one asks the sharding compiler (cached) where its inputs must be,
//!   redistributes them with differentiable collectives, runs the local candle op and wraps the
//!   result. Unsupported combinations are typed errors, never a silent full gather.
//! - Autograd is candle's: every collective is a graph node whose backward is its adjoint, and
//!   the gradient placement rule inserts the backward all_reduce (or fuses it into a
//!   reduce_scatter) where a replicated input feeds a sharded or partial output. So
//!   `loss.backward()` gives every rank the local pieces of the single-device gradients.
//! - [`debug::CommDebugMode`] counts the collectives, forward and backward, by label.
//! - [`functional`]: the same differentiable collectives on plain candle tensors over a
//!   [`functional::Group`] (Megatron's `f` / `g`, all_gather, reduce_scatter, the
//!   vocab-parallel lookup), for tensor parallelism in ordinary candle-nn code.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::dtensor::{distribute_tensor, Placement};
//! use candle_dtensor::mesh::DeviceMesh;
//!
//! let out = LocalWorld::run(2, |comm| {
//!     let mesh = DeviceMesh::new(comm, &[("tp", 2)])?;
//!     let x = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((2, 4))?;
//!     let w = Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?;
//!     let x = distribute_tensor(&x, &mesh, &[Placement::Replicate])?;
//!     let w = distribute_tensor(&w, &mesh, &[Placement::Shard(1)])?;
//!     let y = x.matmul(&w)?; // column-parallel: no communication, output Shard(1)
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(y.full_tensor()?.to_vec2::<f32>()?)
//! })?;
//! assert_eq!(out[0], vec![vec![6.0, 6.0, 6.0], vec![22.0, 22.0, 22.0]]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod collectives;
mod convert;
pub mod cp;
pub mod debug;
mod dispatch;
mod error;
pub mod functional;
mod mesh_ctx;
mod node;
pub mod ops;
mod redistribute;
mod tensor;

pub(crate) use candle_dtensor_kernels::storage;
pub use candle_dtensor_kernels::{fused, region};

pub use candle_dtensor_strategies::{
    format_placements, parse_placements, Placement, Placements, ReduceOp,
};
pub use error::{into_candle, typed_in_candle, CollectiveError, DTensorError, Result};
pub use fused::gelu as gelu_local;
pub use mesh_ctx::MeshCtx;
pub use ops::generic::{apply, apply_all, reference_apply, reference_apply_all};
pub use ops::neural::{
    layer_norm_local, log_softmax_local, reference, rms_norm_local, sdpa_local, softmax_local,
};
pub use ops::pointwise::dropout_mask_full;
pub use tensor::{distribute_tensor, distribute_tensor_from, DTensor, RedistributeHandle};
