//! Parameters: candle `Var`s holding this rank's piece, wrapped as DTensors.

use candle_core::{DType, Device, Var};
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::local_indices;

use crate::error::Result;
use crate::fsdp::Fsdp;
use crate::init::{piece, Init};

/// One parameter: its name, the `Var` an optimizer updates (this rank's piece), and the
/// DTensor view ops use (same storage, so gradients of the view are gradients of the var).
#[derive(Clone)]
pub struct Param {
    /// Dotted module path, e.g. `blocks.0.attn.qkv.weight`.
    pub name: String,
    /// This rank's piece.
    pub var: Var,
    /// The distributed view.
    pub tensor: DTensor,
    /// How it was initialised.
    pub init: Init,
    /// How many ranks hold an identical copy of `var` (for the global gradient norm).
    pub replicas: usize,
}

/// Creates and owns a model's parameters, initialised deterministically
/// ([`crate::init`]): the same `seed` gives the same global values on any mesh.
pub struct ParamStore {
    mesh: DeviceMesh,
    seed: u64,
    dtype: DType,
    params: Vec<Param>,
    fsdp: Option<(Fsdp, usize)>,
}

impl ParamStore {
    /// A store for parameters on `mesh`.
    pub fn new(mesh: &DeviceMesh, seed: u64, dtype: DType) -> Self {
        ParamStore {
            mesh: mesh.clone(),
            seed,
            dtype,
            params: Vec::new(),
            fsdp: None,
        }
    }

    /// Shards the parameters created from now on with `fsdp`, into `unit` (see
    /// [`ParamStore::set_unit`]).
    pub fn with_fsdp(mut self, fsdp: Fsdp, unit: usize) -> Self {
        self.fsdp = Some((fsdp, unit));
        self
    }

    /// The FSDP unit later parameters go into.
    pub fn set_unit(&mut self, unit: usize) {
        if let Some((_, u)) = &mut self.fsdp {
            *u = unit;
        }
    }

    /// The FSDP instance, if parameters are sharded.
    pub fn fsdp(&self) -> Option<&Fsdp> {
        self.fsdp.as_ref().map(|(f, _)| f)
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// Creates parameter `name` of global `shape` with `placements`.
    pub fn param(
        &mut self,
        name: &str,
        shape: &[usize],
        init: Init,
        placements: &[Placement],
    ) -> Result<DTensor> {
        let mesh_shape = self.mesh.shape();
        let coord = self.mesh.coordinate();
        let idx: Vec<Vec<usize>> = (0..shape.len())
            .map(|d| local_indices(shape[d], &mesh_shape, &coord, placements, d))
            .collect();
        let local = piece(init, self.seed, name, shape, &idx, self.dtype, &Device::Cpu)?;
        let replicated = |m: usize| placements[m] == Placement::Replicate;
        let (var, tensor, replicas) = match &self.fsdp {
            Some((fsdp, unit)) => {
                let (shard, full) = fsdp.add_param(*unit, &local)?;
                let managed = fsdp.managed_dims();
                let tensor = DTensor::from_local_with_shape(&full, &self.mesh, placements, shape)?
                    .with_managed_grad_dims(&managed);
                let shard_dim = fsdp.config().shard_dim;
                let replicas = (0..mesh_shape.len())
                    .filter(|&m| replicated(m) && m != shard_dim)
                    .map(|m| mesh_shape[m])
                    .product();
                (shard, tensor, replicas)
            }
            None => {
                let var = Var::from_tensor(&local)?;
                let tensor =
                    DTensor::from_local_with_shape(var.as_tensor(), &self.mesh, placements, shape)?;
                let replicas = (0..mesh_shape.len())
                    .filter(|&m| replicated(m))
                    .map(|m| mesh_shape[m])
                    .product();
                (var, tensor, replicas)
            }
        };
        self.params.push(Param {
            name: name.to_string(),
            var,
            tensor: tensor.clone(),
            init,
            replicas,
        });
        Ok(tensor)
    }

    /// The parameters, in creation order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The vars (for an optimizer). Empty pieces (an FSDP rank past the end of a small
    /// parameter's rows) are left out: there is nothing to update, and candle-nn optimizers
    /// reject them.
    pub fn vars(&self) -> Vec<Var> {
        self.params
            .iter()
            .filter(|p| p.var.elem_count() > 0)
            .map(|p| p.var.clone())
            .collect()
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Number of elements of all parameters (global).
    pub fn global_numel(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.tensor.shape().iter().product::<usize>())
            .sum()
    }

    /// Bytes of this rank's pieces.
    pub fn local_bytes(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes())
            .sum()
    }
}
