//! The redistribute executor: walks a compiler plan step by step on this rank's local piece.
//!
//! Each step runs one differentiable collective (or local op) from [`crate::collectives`] over
//! the step's mesh dim (or the flattened communicator of merged dims), with padding computed from
//! the logical shape this rank's group sees. When the dispatcher asks for a gradient sync on some
//! mesh dims (the input is Replicate there but the op's output is not), an all_gather that is the
//! last step on those dims is fused with it: all_gather forward, reduce_scatter backward (half
//! the bytes of chunk + all_reduce). Dims left over get an identity / all_reduce-backward op.

use candle_core::Tensor;
use candle_dtensor_comm::ReduceOp;
use candle_dtensor_strategies::{CollectiveKind, Placement, RedistributePlan};
use smallvec::SmallVec;

use crate::collectives::{self, GatherGrad};
use crate::tensor::DTensor;

/// Mesh dims on which an input needs its gradient all-reduced.
pub(crate) type GradMask = SmallVec<[usize; 4]>;

type CResult<T> = candle_core::Result<T>;

/// Runs `plan` on `x`'s local piece, then applies the gradient sync of `grad_mask`.
pub(crate) fn execute(
    x: &DTensor,
    plan: &RedistributePlan,
    grad_mask: &GradMask,
) -> CResult<Tensor> {
    let ctx = x.ctx();
    let mesh = x.mesh();
    let global = x.shape();
    let mut t = x.to_local().clone();
    let mut pending: GradMask = grad_mask.clone();
    for (i, step) in plan.steps.iter().enumerate() {
        if step.kind == CollectiveKind::Noop {
            continue;
        }
        let axis = ctx
            .axis(mesh, &step.mesh_dims)
            .map_err(candle_core::Error::from)?;
        let logical = step
            .logical_shape_at(global, &ctx.shape, &ctx.coord)
            .map_err(candle_core::Error::wrap)?;
        // Fuse an all_gather with the gradient sync when it is the last step touching its dims.
        let gather_grad = |pending: &mut GradMask| {
            let last = !plan.steps[i + 1..]
                .iter()
                .any(|s| s.mesh_dims.iter().any(|m| step.mesh_dims.contains(m)));
            let fuse = last && step.mesh_dims.iter().all(|m| pending.contains(m));
            if fuse {
                pending.retain(|m| !step.mesh_dims.contains(m));
                GatherGrad::ReduceScatter
            } else {
                GatherGrad::Chunk
            }
        };
        t = match (step.kind, step.from, step.to) {
            (CollectiveKind::LocalChunk, Placement::Replicate, Placement::Shard(d)) => {
                collectives::chunk(&t, &axis, d)?
            }
            (CollectiveKind::LocalPartition, Placement::Replicate, Placement::Partial(op)) => {
                collectives::partition(&t, &axis, op)?
            }
            (CollectiveKind::AllGather, Placement::Shard(d), Placement::Replicate) => {
                let grad = gather_grad(&mut pending);
                collectives::all_gather(&t, &axis, d, logical[d], grad)?
            }
            // StridedShard: a lone one reorders by strided indices (`permute`); under later
            // plain shards whose sizes multiply to the split factor (the FSDP-after-TP fast
            // path, even sizes only) each piece is a plain chunk of the logical piece.
            (
                CollectiveKind::AllGather,
                Placement::StridedShard { dim, split_factor },
                Placement::Replicate,
            ) => {
                let grad = gather_grad(&mut pending);
                if step.permute {
                    collectives::strided_all_gather(
                        &t,
                        &axis,
                        dim,
                        logical[dim],
                        split_factor,
                        grad,
                    )?
                } else {
                    collectives::all_gather(&t, &axis, dim, logical[dim], grad)?
                }
            }
            (
                CollectiveKind::LocalChunk,
                Placement::Replicate,
                Placement::StridedShard { dim, split_factor },
            ) => {
                if step.permute {
                    collectives::strided_chunk(&t, &axis, dim, split_factor)?
                } else {
                    collectives::chunk(&t, &axis, dim)?
                }
            }
            (CollectiveKind::AllReduce, Placement::Partial(op), Placement::Replicate) => {
                collectives::all_reduce(&t, &axis, op)?
            }
            (CollectiveKind::AllReduce, Placement::MaskPartial { .. }, Placement::Replicate) => {
                collectives::all_reduce(&t, &axis, ReduceOp::Sum)?
            }
            (CollectiveKind::ReduceScatter, from, Placement::Shard(d)) => {
                let op = match from {
                    Placement::Partial(op) => op,
                    Placement::MaskPartial { .. } => ReduceOp::Sum,
                    other => {
                        return Err(collectives::refuse(
                            &axis,
                            "redistribute",
                            &t,
                            format!("{plan}: reduce_scatter from {other}"),
                        ))
                    }
                };
                if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
                    // The planner sends max/min/product through Replicate (all_reduce + local
                    // chunk): executing anything else here would not be the plan.
                    return Err(collectives::refuse(
                        &axis,
                        "redistribute",
                        &t,
                        format!("{plan}: reduce_scatter of a Partial({op:?}) value is not a planned step"),
                    ));
                }
                collectives::reduce_scatter(&t, &axis, d, logical[d], op)?
            }
            (CollectiveKind::AllToAll, Placement::Shard(i), Placement::Shard(j)) => {
                collectives::all_to_all(&t, &axis, i, j, logical[i], logical[j])?
            }
            (kind, from, to) => {
                return Err(collectives::refuse(
                    &axis,
                    "redistribute",
                    &t,
                    format!("{plan}: the executor has no rule for {kind} {from} -> {to}"),
                ))
            }
        };
    }
    if !pending.is_empty() && t.track_op() {
        let axes = pending
            .iter()
            .map(|&m| ctx.axis(mesh, &[m]))
            .collect::<crate::error::Result<Vec<_>>>()
            .map_err(candle_core::Error::from)?;
        t = collectives::grad_sync(&t, axes)?;
    }
    Ok(t)
}

/// Applies only the gradient sync of `mask` to `x`'s local piece (no redistribution needed).
pub(crate) fn grad_sync_only(x: &DTensor, mask: &GradMask) -> CResult<Tensor> {
    let ctx = x.ctx();
    let axes = mask
        .iter()
        .map(|&m| ctx.axis(x.mesh(), &[m]))
        .collect::<crate::error::Result<Vec<_>>>()
        .map_err(candle_core::Error::from)?;
    collectives::grad_sync(x.to_local(), axes)
}
