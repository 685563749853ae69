//! Differentiable collectives on plain candle tensors, for tensor parallelism in ordinary
//! candle / candle-nn code (no DTensor).
//!
//! Each function takes this rank's tensor and a [`Group`] (one communicator, e.g. the `tp` dim
//! of a mesh) and records a graph node whose backward is the adjoint collective, so
//! `loss.backward()` runs the backward collectives in the right places. They are Megatron-LM's
//! "mappings":
//!
//! | function | forward | backward | Megatron |
//! |---|---|---|---|
//! | [`copy_to_group`] | identity | all_reduce(sum) | `f`, `copy_to_tensor_model_parallel_region` |
//! | [`reduce_from_group`] | all_reduce(sum) | identity | `g`, `reduce_from_tensor_model_parallel_region` |
//! | [`scatter_to_group`] | keep this rank's chunk | all_gather | `scatter_to_tensor_model_parallel_region` |
//! | [`all_gather`] ([`GatherBackward::Chunk`]) | all_gather | keep this rank's chunk | `gather_from_tensor_model_parallel_region` |
//! | [`all_gather`] ([`GatherBackward::ReduceScatter`]) | all_gather | reduce_scatter | `gather_from_sequence_parallel_region` |
//! | [`reduce_scatter`] | reduce_scatter(sum) | all_gather | `reduce_scatter_to_sequence_parallel_region` |
//! | [`vocab_parallel_embedding`] | masked lookup in this rank's rows, all_reduce | lookup's gradient, local | `VocabParallelEmbedding` |
//!
//! Chunks follow torch.chunk (`ceil(len / n)` rows per rank, the last ones smaller or empty;
//! [`Group::chunk`]); the collectives pad and unpad uneven pieces. Every rank of the group must
//! call the same functions in the same order (they are collectives), and so must its backward:
//! ranks running the same model code build the same graph, which candle walks in the same
//! order. [`crate::debug::CommDebugMode`] records each collective under the group's name.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::dtensor::functional::{copy_to_group, reduce_from_group, Group};
//!
//! // A Megatron MLP on 2 ranks: each holds half of w1's columns and half of w2's rows.
//! let out = LocalWorld::run(2, |comm| {
//!     let tp = Group::new(&comm);
//!     let x = Var::from_tensor(&Tensor::ones((3, 4), DType::F32, &Device::Cpu)?)?;
//!     let w1 = Var::from_tensor(&Tensor::ones((4, 8 / 2), DType::F32, &Device::Cpu)?)?;
//!     let w2 = Var::from_tensor(&Tensor::ones((8 / 2, 4), DType::F32, &Device::Cpu)?)?;
//!     let h = copy_to_group(x.as_tensor(), &tp)?.matmul(w1.as_tensor())?.relu()?;
//!     let y = reduce_from_group(&h.matmul(w2.as_tensor())?, &tp)?; // sums the two halves
//!     let grads = y.sum_all()?.backward()?; // x's gradient is all-reduced by copy_to_group
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
//!         y.to_vec2::<f32>()?[0][0],
//!         grads.get(x.as_tensor()).map(|g| g.to_vec2::<f32>()).transpose()?,
//!     ))
//! })?;
//! assert_eq!(out[0].0, 32.0); // 4 inputs x 8 hidden units, each 1
//! assert_eq!(out[0].1.as_ref().unwrap()[0][0], 32.0);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use std::sync::Arc;

use candle_core::Tensor;
use candle_dtensor_comm::Comm;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::shard_size_and_offset;

use crate::collectives::{self, Axis, GatherGrad};
use crate::error::{invalid, Context, Result};
use crate::mesh_ctx::MeshCtx;
use crate::ReduceOp;

/// The ranks a functional collective runs over: one communicator and this rank's place in it.
/// Cheap to clone.
#[derive(Clone)]
pub struct Group {
    axis: Axis,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group({}: rank {} of {})",
            self.axis.name, self.axis.coord, self.axis.n
        )
    }
}

impl Group {
    /// The group of every rank of `comm` (recorded under the communicator's name).
    pub fn new(comm: &Comm) -> Group {
        Group {
            axis: Axis {
                comm: comm.clone(),
                n: comm.size(),
                coord: comm.rank(),
                name: Arc::from(comm.name()),
            },
        }
    }

    /// The group of mesh dim `dim` of `mesh` (this rank and the ranks that differ from it only
    /// on that dim), recorded under the dim's name, as DTensor ops are.
    ///
    /// # Errors
    ///
    /// No such dim.
    pub fn from_mesh(mesh: &DeviceMesh, dim: &str) -> Result<Group> {
        let d = mesh.dim_index(dim)?;
        let ctx = MeshCtx::of(mesh)?;
        Ok(Group {
            axis: ctx.axes[d].clone(),
        })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.axis.n
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.axis.coord
    }

    /// The name collectives are recorded under.
    pub fn name(&self) -> &str {
        &self.axis.name
    }

    /// The communicator.
    pub fn comm(&self) -> &Comm {
        &self.axis.comm
    }

    /// `(size, offset)` of this rank's torch.chunk piece of `len` rows.
    pub fn chunk(&self, len: usize) -> (usize, usize) {
        shard_size_and_offset(len, self.axis.n, self.axis.coord)
    }

    /// `(size, offset)` of rank `rank`'s torch.chunk piece of `len` rows.
    pub fn chunk_of(&self, len: usize, rank: usize) -> (usize, usize) {
        shard_size_and_offset(len, self.axis.n, rank)
    }

    fn op(&self, op: &str) -> String {
        format!("functional::{op} (group {})", self.axis.name)
    }
}

/// What the backward of [`all_gather`] does with the gradient of the gathered tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherBackward {
    /// The gathered tensor feeds the same computation on every rank (its gradient is the same
    /// everywhere): keep this rank's chunk. Megatron's `gather_from_tensor_model_parallel_region`.
    Chunk,
    /// The gathered tensor feeds a per-rank computation whose gradients are partial sums (e.g.
    /// a column-parallel linear under sequence parallelism): reduce_scatter them. Megatron's
    /// `gather_from_sequence_parallel_region`.
    ReduceScatter,
}

/// Megatron's `f`: identity forward, all_reduce(sum) of the gradient backward. Put it where a
/// replicated value enters rank-local computation (the input of a column-parallel linear).
///
/// # Errors
///
/// A failed candle op.
pub fn copy_to_group(x: &Tensor, g: &Group) -> Result<Tensor> {
    collectives::grad_sync(x, vec![g.axis.clone()]).ctx(&g.op("copy_to_group"), g.rank())
}

/// Megatron's `g`: all_reduce(sum) forward, identity backward. Put it where per-rank partial
/// sums become the replicated value (the output of a row-parallel linear).
///
/// # Errors
///
/// A failed collective.
pub fn reduce_from_group(x: &Tensor, g: &Group) -> Result<Tensor> {
    all_reduce(x, g, ReduceOp::Sum)
}

/// Differentiable all_reduce with `op`: backward is the identity for `Sum`, divides by the
/// group size for `Avg`, and sends the gradient to the ranks holding the extreme (split among
/// ties) for `Max`/`Min`.
///
/// # Errors
///
/// A failed collective.
pub fn all_reduce(x: &Tensor, g: &Group, op: ReduceOp) -> Result<Tensor> {
    collectives::all_reduce(x, &g.axis, op).ctx(&g.op("all_reduce"), g.rank())
}

/// Concatenates every rank's piece of dim `dim` (global length `len`, torch.chunk pieces;
/// this rank's piece must have `g.chunk(len).0` rows). Backward: see [`GatherBackward`].
///
/// # Errors
///
/// A piece of the wrong size, `dim` out of range, or a failed collective.
pub fn all_gather(
    x: &Tensor,
    g: &Group,
    dim: usize,
    len: usize,
    backward: GatherBackward,
) -> Result<Tensor> {
    let grad = match backward {
        GatherBackward::Chunk => GatherGrad::Chunk,
        GatherBackward::ReduceScatter => GatherGrad::ReduceScatter,
    };
    collectives::all_gather(x, &g.axis, dim, len, grad).ctx(&g.op("all_gather"), g.rank())
}

/// Sums `x` over the group and keeps this rank's torch.chunk piece of dim `dim`; backward
/// all_gathers the gradient.
///
/// # Errors
///
/// `dim` out of range, or a failed collective.
pub fn reduce_scatter(x: &Tensor, g: &Group, dim: usize) -> Result<Tensor> {
    let op = g.op("reduce_scatter");
    let len = x.dim(dim).ctx(&op, g.rank())?;
    collectives::reduce_scatter(x, &g.axis, dim, len, ReduceOp::Sum).ctx(&op, g.rank())
}

/// Keeps this rank's torch.chunk piece of dim `dim` of a replicated `x` (no communication);
/// backward all_gathers the gradient.
///
/// # Errors
///
/// `dim` out of range, or a failed collective (backward).
pub fn scatter_to_group(x: &Tensor, g: &Group, dim: usize) -> Result<Tensor> {
    collectives::chunk(x, &g.axis, dim).ctx(&g.op("scatter_to_group"), g.rank())
}

/// The lookup of a vocab-parallel embedding: `weight` holds this rank's torch.chunk rows of a
/// `[vocab, hidden]` table; ids outside them give zeros, and the all_reduce sums the ranks'
/// rows into the full lookup `[ids.., hidden]` (replicated). Backward needs no communication:
/// each rank's rows get the gradient of the ids they hold.
///
/// # Errors
///
/// A table piece with the wrong number of rows, non-integer ids, or a failed collective.
pub fn vocab_parallel_embedding(
    ids: &Tensor,
    weight: &Tensor,
    vocab: usize,
    g: &Group,
) -> Result<Tensor> {
    let op = g.op("vocab_parallel_embedding");
    let (rows, off) = g.chunk(vocab);
    let (have, hidden) = weight.dims2().ctx(&op, g.rank())?;
    if have != rows {
        return Err(invalid(
            &op,
            g.rank(),
            format!(
                "the table piece has {have} rows; rank {} of {} holds rows {off}..{} of a vocab \
                 of {vocab}",
                g.rank(),
                g.size(),
                off + rows
            ),
        ));
    }
    if ids.dtype().is_float() {
        return Err(invalid(
            &op,
            g.rank(),
            format!("ids must be integers, got {:?}", ids.dtype()),
        ));
    }
    let mut out_dims = ids.dims().to_vec();
    out_dims.push(hidden);
    let local = (|| {
        if rows == 0 {
            // No rows here: zeros that stay in the graph of the (empty) table.
            return crate::node::graph_zeros(weight, &out_dims);
        }
        let (local, inside) = crate::ops::nn::local_ids(ids, off, rows)?;
        let looked = weight
            .index_select(&local.flatten_all()?, 0)?
            .reshape(out_dims.as_slice())?;
        looked.broadcast_mul(
            &inside
                .to_dtype(weight.dtype())?
                .unsqueeze(candle_core::D::Minus1)?,
        )
    })()
    .ctx(&op, g.rank())?;
    reduce_from_group(&local, g)
}
