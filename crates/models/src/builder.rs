//! What the layers of [`crate::layers`] and [`crate::moe_layer`] need while being built: the
//! parameter store, the mesh roles and the tensor-parallel plan.

use candle_dtensor_core::Placement;
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::tp_plan::{MeshRoles, TpPlan};

use crate::error::{ModelError, Result};

/// What layers need while being built: the parameter store, the mesh roles and the plan.
pub struct Builder<'a> {
    /// Where parameters are created.
    pub store: &'a mut ParamStore,
    /// Mesh dim roles.
    pub roles: MeshRoles,
    /// The tensor-parallel plan.
    pub plan: TpPlan,
}

impl Builder<'_> {
    pub(crate) fn tp_size(&self) -> usize {
        self.roles
            .tp
            .and_then(|t| self.store.mesh().size(t).ok())
            .unwrap_or(1)
    }

    /// Placements of a parameter: `on_tp` on the tensor-parallel dim, Replicate elsewhere.
    pub(crate) fn param_placements(&self, on_tp: Placement) -> Vec<Placement> {
        self.roles.placements(on_tp, Placement::Replicate).to_vec()
    }

    pub(crate) fn check_divisible(&self, what: &str, n: usize) -> Result<()> {
        let tp = self.tp_size();
        if n % tp != 0 {
            return Err(ModelError::Config(format!(
                "{what} ({n}) is not divisible by the tensor-parallel size {tp}"
            )));
        }
        Ok(())
    }
}
