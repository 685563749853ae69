//! Op dispatch: propagate (cached) -> redistribute inputs -> local candle op -> output spec.
//!
//! [`prepare`] asks the compiler where every input must be and brings the local pieces there,
//! applying the gradient placement rule: on a mesh dim where an input is Replicate but an output
//! is Shard or Partial, each rank's local gradient of that input is only a partial sum, so the
//! input is wrapped in an identity-forward / all_reduce-backward op (fused with the input's own
//! all_gather into all_gather-forward / reduce_scatter-backward when dispatch just gathered it).
//! This is where Megatron's f/g and FSDP's reduce-scatter come from, derived rather than placed.

use std::sync::Arc;

use candle_core::Tensor;
use candle_dtensor_strategies::{global_propagator, DTensorSpec, Op, OpSharding, Placement};
use smallvec::SmallVec;

use crate::error::{Context, Result};
use crate::mesh_ctx::MeshCtx;
use crate::redistribute::{execute, grad_sync_only, GradMask};
use crate::tensor::{mesh_mismatch, DTensor};

/// Inputs brought to the placements the op needs.
pub(crate) struct Prepared {
    pub locals: SmallVec<[Tensor; 4]>,
    pub sharding: Arc<OpSharding>,
    first: DTensor,
    /// Mesh dims whose gradient every input's owner reduces itself: an op on such tensors only
    /// (e.g. a view of an FSDP parameter) passes the property to its output.
    managed: SmallVec<[usize; 4]>,
}

/// The mesh dims on which the input of spec `target` needs the gradient sync (see the module
/// docs). Dims of one rank (`mesh_shape[m] == 1`: `dp=1`, a tensor-parallel job's trivial
/// data-parallel dim) are left out: the all_reduce of one rank's gradient is that gradient, and
/// the sync's graph node would cost a copy of the input forward and an edge backward (every
/// parameter, every use). All ranks of a mesh see the same sizes, so their graphs stay alike.
fn grad_mask(target: &DTensorSpec, sharding: &OpSharding, mesh_shape: &[usize]) -> GradMask {
    let mut mask = GradMask::new();
    for (m, p) in target.placements.iter().enumerate() {
        if *p == Placement::Replicate
            && mesh_shape.get(m).is_some_and(|&n| n > 1)
            && sharding.output_specs.iter().any(|o| {
                o.meta.dtype.is_float()
                    && o.placements
                        .get(m)
                        .is_some_and(|q| *q != Placement::Replicate)
            })
        {
            mask.push(m);
        }
    }
    mask
}

/// Fails with a typed error naming the input when its storage has been released (an owner
/// such as an FSDP unit freed it between uses; see the storage seam's invariant). candle would
/// refuse the op too, but with an error that names neither the tensor nor the op's inputs.
fn check_alive(op: &Op, x: &DTensor) -> Result<()> {
    let t = x.to_local();
    if !crate::storage::is_released(t) {
        return Ok(());
    }
    let name = crate::storage::released_name(t)
        .map(|n| format!(" `{n}`"))
        .unwrap_or_default();
    Err(crate::error::invalid(
        op.name(),
        x.mesh_rank(),
        format!(
            "input{name} {} has released storage: its owner (e.g. an FSDP unit between its forward and backward) freed it between uses; use it where its owner has gathered it",
            x.spec()
        ),
    ))
}

/// Propagates `op` over `inputs` and redistributes them; see the module docs.
pub(crate) fn prepare(op: &Op, inputs: &[&DTensor]) -> Result<Prepared> {
    prepare_with(op, inputs, &[])
}

/// Like [`prepare`], with `layouts[i]` (when given) pinning the placements input `i` must have
/// for the op: the compiler chooses among strategies that keep them, and dispatch brings the
/// input there itself, so the gradient rule can fuse its all_gather with the gradient sync
/// (Megatron's all_gather-forward / reduce_scatter-backward for sequence-parallel inputs).
pub(crate) fn prepare_with(
    op: &Op,
    inputs: &[&DTensor],
    layouts: &[Option<&[Placement]>],
) -> Result<Prepared> {
    let first = inputs[0];
    let rank = first.mesh_rank();
    for x in &inputs[1..] {
        if !Arc::ptr_eq(x.ctx(), first.ctx()) && !x.mesh().same_mesh(first.mesh()) {
            return Err(mesh_mismatch(op.name(), first, x));
        }
    }
    let specs: SmallVec<[&DTensorSpec; 4]> = inputs.iter().map(|x| x.spec()).collect();
    let sharding = global_propagator()
        .propagate_pinned(op, &specs, first.ctx().topology(), layouts)
        .map_err(|source| crate::error::DTensorError::Strategy {
            op: op.name().to_string(),
            rank,
            inputs: format!(
                ", inputs {}",
                specs
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            source: Box::new(source),
        })?;
    let mut locals = SmallVec::with_capacity(inputs.len());
    let mesh_shape = &first.ctx().shape;
    for (i, x) in inputs.iter().enumerate() {
        check_alive(op, x)?;
        let mask = if x.to_local().track_op() {
            let mut m = grad_mask(&sharding.input_specs[i], &sharding, mesh_shape);
            m.retain(|d| !x.managed_grad_dims().contains(d));
            m
        } else {
            GradMask::new()
        };
        let local = match (&sharding.redistributions[i], mask.is_empty()) {
            (None, true) => x.to_local().clone(),
            (None, false) => grad_sync_only(x, &mask).ctx(op.name(), rank)?,
            (Some(plan), _) => execute(x, plan, &mask).ctx(op.name(), rank)?,
        };
        locals.push(local);
    }
    let mut managed: SmallVec<[usize; 4]> = first.managed_grad_dims().iter().copied().collect();
    for x in &inputs[1..] {
        managed.retain(|d| x.managed_grad_dims().contains(d));
    }
    Ok(Prepared {
        locals,
        sharding,
        first: first.clone(),
        managed,
    })
}

impl Prepared {
    /// The mesh context of the inputs.
    pub(crate) fn ctx(&self) -> &Arc<MeshCtx> {
        self.first.ctx()
    }

    /// The first input (for mesh and rank).
    pub(crate) fn first(&self) -> &DTensor {
        &self.first
    }

    /// Wraps the local outputs with the compiler's output specs.
    pub(crate) fn finish(&self, op: &Op, outs: Vec<Tensor>) -> Result<Vec<DTensor>> {
        let rank = self.first.mesh_rank();
        if outs.len() != self.sharding.output_specs.len() {
            return Err(crate::error::invalid(
                op.name(),
                rank,
                format!(
                    "local op produced {} outputs, expected {}",
                    outs.len(),
                    self.sharding.output_specs.len()
                ),
            ));
        }
        let ctx = self.first.ctx();
        let mut res = Vec::with_capacity(outs.len());
        for (local, spec) in outs.into_iter().zip(&self.sharding.output_specs) {
            let local = crate::node::keep_inputs(local, &self.locals).ctx(op.name(), rank)?;
            if cfg!(debug_assertions) {
                let expect = candle_dtensor_strategies::layout::local_shape(
                    &spec.meta.shape,
                    &ctx.shape,
                    &ctx.coord,
                    &spec.placements,
                )
                .ctx(op.name(), rank)?;
                if expect.as_slice() != local.dims() {
                    return Err(crate::error::invalid(
                        op.name(),
                        rank,
                        format!(
                            "internal: local output {:?} does not match {spec} (expected {:?})",
                            local.dims(),
                            expect.as_slice()
                        ),
                    ));
                }
            }
            let out =
                DTensor::from_parts(local, spec.clone(), self.first.mesh().clone(), ctx.clone());
            res.push(if self.managed.is_empty() {
                out
            } else {
                out.with_managed_grad_dims(&self.managed)
            });
        }
        Ok(res)
    }

    /// Wraps a single local output.
    pub(crate) fn finish1(&self, op: &Op, out: Tensor) -> Result<DTensor> {
        let mut v = self.finish(op, vec![out])?;
        Ok(v.remove(0))
    }
}

/// The common path of single-output ops: prepare, run `local` on the local pieces, finish.
pub(crate) fn run1(
    op: &Op,
    inputs: &[&DTensor],
    local: impl FnOnce(&Prepared) -> candle_core::Result<Tensor>,
) -> Result<DTensor> {
    run1_with(op, inputs, &[], local)
}

/// [`run1`] with input layouts fixed by the caller (see [`prepare_with`]).
pub(crate) fn run1_with(
    op: &Op,
    inputs: &[&DTensor],
    layouts: &[Option<&[Placement]>],
    local: impl FnOnce(&Prepared) -> candle_core::Result<Tensor>,
) -> Result<DTensor> {
    let p = prepare_with(op, inputs, layouts)?;
    let out = local(&p).ctx(op.name(), p.first.mesh_rank())?;
    p.finish1(op, out)
}
