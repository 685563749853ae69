//! DTensor ops by family. Each method propagates placements with the compiler, redistributes
//! its inputs, runs the local candle op on the local pieces, and wraps the result.

pub mod generic;
mod index;
mod matrix;
mod misc;
pub mod neural;
pub mod pointwise;
mod reduction;
mod scan;
mod scatter;
mod sort;
mod view;

use candle_dtensor_strategies::layout::local_shape;
use smallvec::SmallVec;

use crate::dispatch::Prepared;

/// The local dims of output `k` of a prepared op at this rank's coordinate.
pub(crate) fn local_dims(p: &Prepared, k: usize) -> candle_core::Result<SmallVec<[usize; 6]>> {
    let spec = &p.sharding.output_specs[k];
    let ctx = p.ctx();
    local_shape(&spec.meta.shape, &ctx.shape, &ctx.coord, &spec.placements)
        .map(|s| s.into_iter().collect())
        .map_err(candle_core::Error::wrap)
}

/// The error of a family's `apply` handed an op of another family (a registry bug).
pub(crate) fn wrong_family(
    op: &candle_dtensor_strategies::Op,
    x: &[&crate::DTensor],
) -> crate::DTensorError {
    let rank = x.first().map_or(0, |t| t.mesh_rank());
    crate::error::invalid(
        op.name(),
        rank,
        format!(
            "internal: dispatched to the wrong family (declared {:?})",
            op.family()
        ),
    )
}

/// [`wrong_family`] for the single-device references.
pub(crate) fn ref_wrong_family(op: &candle_dtensor_strategies::Op) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: internal: dispatched to the wrong family (declared {:?})",
        op.family()
    ))
}
