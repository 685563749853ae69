//! The sharding compiler of candle-dtensor: pure, synchronous, no candle and no communication.
//!
//! # Overview
//! * [`Placement`] says how a tensor lives on ONE mesh dim (`S(0)`, `SS(0,2)`, `R`, `P(sum)`,
//!   `MP(0,512)`); a [`DTensorSpec`] is a global [`TensorMeta`] plus one placement per mesh dim.
//! * [`layout`] computes local shapes and offsets exactly as `torch.chunk` (uneven and empty
//!   shards included).
//! * [`MeshTopology`] carries the mesh dims and their alpha-beta link costs; [`cost`] prices
//!   collectives with nccl-tests factors.
//! * [`plan_redistribute`] plans any placements -> any placements as ordered [`Step`]s.
//! * [`Op`] + [`single_dim_strategies`] give each op's valid placements for one mesh dim; the
//!   expander picks one row per mesh dim at minimum cost, and [`ShardingPropagator`] caches the
//!   resulting [`OpSharding`] (`global_propagator()` is the instance the runtime uses).
//! * [`explain`] reports a decision as a table or JSON.
//!
//! # What the runtime must do with a decision
//! * Run each input's [`RedistributePlan`] step by step ([`Step::kind`] on [`Step::mesh_dims`]),
//!   then the op on local tensors, then perform the op's [`OpSharding::internal`] comms inside it.
//! * Collective groups: the ranks that differ only in `mesh_dims`, ordered row-major over those
//!   dims ascending (a merged step's flattened communicator). all_gather concatenates in that order
//!   (padding every piece to `ceil(L/n)` of [`Step::logical_shape_at`] and unpadding), reduce_scatter
//!   and all_to_all hand out `torch.chunk` pieces in that order. When [`Step::permute`] is set (a
//!   lone `StridedShard`) the gathered pieces are reordered, or the chunk selected, by
//!   [`strided_indices`].
//! * `Replicate -> P(sum)` divides by the group size; `-> P(avg|max|min)` keeps the value.
//! * A tensor `Partial` on several mesh dims means "reduce the innermost mesh dim first"; plans
//!   never reorder non-commuting reductions.
//! * `MaskPartial`: the op wrote zeros in the rows whose source index the rank does not own
//!   ([`local_indices`] of the source dim); it reduces like `P(sum)` and may be relabelled
//!   `P(sum)` ([`CollectiveKind::Noop`]).
//! * Steps of kind `Noop` (size-1 mesh dims, relabels) only change the placement label.
//! * Size arguments are local: `reshape` / `broadcast_as` / `narrow` run with the output's local
//!   shape ([`local_shape`] of the output spec); a `narrow` on a sharded dim only occurs when it
//!   is the identity.
//! * Row-parallel `linear` with a bias: the bias is made `P(sum)` by a local partition (`b/n`),
//!   so the output `P(sum)` adds it once.
//! * `mean` and `cross_entropy` over sharded rows give `P(sum)`: the local sum over the GLOBAL
//!   count.
//! * Internal comms are the op's own collectives (loss-parallel cross-entropy, softmax over a
//!   sharded dim, `rma_get`): run exactly those, in any order within the op.
//!
//! ```
//! use candle_dtensor::strategies::*;
//! let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
//! // Row-parallel matmul: x sharded on its columns, w on its rows -> a partial sum.
//! let x = DTensorSpec::new(&[64, 32], DType::F32, &parse_placements("S(0),S(1)").unwrap());
//! let w = DTensorSpec::new(&[32, 64], DType::F32, &parse_placements("R,S(0)").unwrap());
//! let s = global_propagator().propagate(&Op::Matmul, &[&x, &w], &mesh).unwrap();
//! assert_eq!(format_placements(&s.output_specs[0].placements), "S(0),P(sum)");
//! assert_eq!(s.cost_us, 0.0);
//! // Reducing it is one all_reduce over tp.
//! let plan = plan_redistribute(&s.output_specs[0], &parse_placements("S(0),R").unwrap(), &mesh).unwrap();
//! assert_eq!(plan.steps[0].kind, CollectiveKind::AllReduce);
//! ```

#![deny(missing_docs)]

pub mod cost;
mod error;
mod expand;
mod explain;
pub mod layout;
mod mesh;
mod op;
mod ops;
mod placement;
mod plan;
mod propagate;
mod spec;
mod strategy;
mod transition;

pub use cost::{collective_cost_us, wire_bytes, CollectiveKind};
pub use error::{Result, StrategyError};
pub use expand::{ExpandMethod, PRODUCT_LIMIT};
pub use explain::{
    build_op, explain, parse_dims, parse_shape, parse_shapes, resolve, CollectiveReport,
    ExplainReport, ExplainRequest, ResolvedRequest,
};
pub use layout::{
    local_indices, local_shape, local_shape_and_offset, pad_amount, padded_chunk_size, padded_size,
    shard_size_and_offset, strided_indices,
};
pub use mesh::{
    MeshDim, MeshTopology, DEFAULT_DEVICES_PER_HOST, DEFAULT_LAUNCH_US, INTER_NODE_BANDWIDTH_GBPS,
    INTER_NODE_LATENCY_US, INTRA_NODE_BANDWIDTH_GBPS, INTRA_NODE_LATENCY_US, MAX_MESH_DIMS,
};
pub use op::{
    normalize_dim, BinaryOp, CmpOp, Dims, Family, InputKind, Monotonicity, Op, OpArgs, OpDecl,
    Scalar, ScalarOp, UnaryOp,
};
pub use placement::{
    format_placements, parse_placements, parse_placements_with_ndim, partials_replicated,
    Placement, Placements, ReduceOp,
};
pub use plan::{plan_redistribute, RedistributePlan, Step};
pub use propagate::{
    global_propagator, propagate_pinned_with, propagate_with, OpSharding, ShardingPropagator,
    MAX_CACHE_ENTRIES,
};
pub use spec::{shape_str, validate_placements, DTensorSpec, DType, Shape, TensorMeta};
pub use strategy::{single_dim_strategies, InternalComm, StrategyRow, TensorRef};
