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
    /// Where `var`'s elements sit in the global tensor: one box for every placement this crate
    /// builds (tensor-parallel `Shard` pieces, composed with FSDP's row shard), several for
    /// `StridedShard`, none for an empty piece. Checkpoints save and load these regions.
    pub boxes: Vec<VarBox>,
    /// Whether this rank writes `var` into checkpoints: replicas write once, from the rank
    /// whose coordinate is 0 on every mesh dim over which `var` is replicated (every dim with
    /// a non-sharding placement, except FSDP's shard dim).
    pub writer: bool,
}

/// A box of a parameter: `shape` elements starting at `global_offset` in the global tensor,
/// stored starting at `local_offset` in the rank's `var` (row-major; both offsets per dim).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VarBox {
    /// Offset of the box in the rank's var, per dim.
    pub local_offset: Vec<usize>,
    /// Offset of the box in the global tensor, per dim.
    pub global_offset: Vec<usize>,
    /// Extent of the box, per dim.
    pub shape: Vec<usize>,
}

impl VarBox {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The boxes of this rank's var of a parameter whose (tensor-parallel) piece holds the global
/// indices `idx[d]` along dim `d`: the whole piece, or with `fsdp` this rank's torch.chunk rows
/// of dim 0 of it, as [`Fsdp::add_param`] cuts them (a scalar: rank 0 of the shard group holds
/// it). One rule for [`ParamStore`] and the library trainer's parameters.
pub fn fsdp_boxes(idx: &[Vec<usize>], fsdp: Option<&Fsdp>) -> Vec<VarBox> {
    match fsdp {
        Some(f) if !idx.is_empty() => {
            let (n, off) = f.shard_rows(idx[0].len());
            let mut v = idx.to_vec();
            v[0] = idx[0]
                .get(off..off + n)
                .map(<[usize]>::to_vec)
                .unwrap_or_default();
            boxes_of(&v)
        }
        Some(f) if f.shard_rows(1).0 == 1 => boxes_of(idx),
        Some(_) => Vec::new(),
        None => boxes_of(idx),
    }
}

/// The boxes covering a piece whose elements along dim `d` are the global indices
/// `indices[d]` (in local order): the product of each dim's runs of consecutive indices.
pub fn boxes_of(indices: &[Vec<usize>]) -> Vec<VarBox> {
    // Runs per dim: (local start, global start, length).
    let runs: Vec<Vec<(usize, usize, usize)>> = indices
        .iter()
        .map(|idx| {
            let mut out: Vec<(usize, usize, usize)> = Vec::new();
            for (l, &g) in idx.iter().enumerate() {
                match out.last_mut() {
                    Some((_, gs, n)) if *gs + *n == g => *n += 1,
                    _ => out.push((l, g, 1)),
                }
            }
            out
        })
        .collect();
    if runs.iter().any(Vec::is_empty) {
        return Vec::new();
    }
    let mut boxes = vec![VarBox {
        local_offset: Vec::new(),
        global_offset: Vec::new(),
        shape: Vec::new(),
    }];
    for dim_runs in &runs {
        boxes = boxes
            .into_iter()
            .flat_map(|b| {
                dim_runs.iter().map(move |&(l, g, n)| {
                    let mut b = b.clone();
                    b.local_offset.push(l);
                    b.global_offset.push(g);
                    b.shape.push(n);
                    b
                })
            })
            .collect();
    }
    boxes
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
        // Generated on the host (the counter-based init is a CPU loop), then moved.
        let local = piece(init, self.seed, name, shape, &idx, self.dtype, &Device::Cpu)?
            .to_device(self.mesh.root_comm().device())?;
        let replicated = |m: usize| placements[m] == Placement::Replicate;
        // Mesh dims over which the var is an identical copy (for the checkpoint writer).
        let copy_dim = |m: usize| {
            !placements[m].is_shard()
                && self
                    .fsdp
                    .as_ref()
                    .is_none_or(|(f, _)| f.config().shard_dim != m)
        };
        let writer = (0..mesh_shape.len()).all(|m| !copy_dim(m) || coord[m] == 0);
        let boxes = fsdp_boxes(&idx, self.fsdp.as_ref().map(|(f, _)| f));
        let (var, tensor, replicas) = match &self.fsdp {
            Some((fsdp, unit)) => {
                let (shard, full) = fsdp.add_param(*unit, name, &local)?;
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
            boxes,
            writer,
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
