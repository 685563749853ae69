//! What the runtime needs of a mesh, computed once per mesh: the compiler's
//! [`MeshTopology`], this rank's coordinate, and an [`Axis`] per mesh dim (and per flattened
//! group, created on demand from the mesh's flattened communicators).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_dtensor_mesh::grid::group_index;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::MeshTopology;
use smallvec::SmallVec;

use crate::collectives::Axis;
use crate::error::{Context, Result};

/// The runtime's view of a [`DeviceMesh`]. It is cached on the mesh, so it must not hold the
/// mesh itself (that would be a reference cycle keeping the communicators alive).
pub struct MeshCtx {
    pub(crate) topo: MeshTopology,
    pub(crate) rank: usize,
    pub(crate) names: Vec<String>,
    flattened: usize,
    pub(crate) coord: SmallVec<[usize; 4]>,
    pub(crate) shape: SmallVec<[usize; 4]>,
    pub(crate) axes: Vec<Axis>,
    merged: Mutex<HashMap<Vec<usize>, Axis>>,
}

impl MeshCtx {
    /// The context of `mesh` (cached on the mesh; rebuilt when the mesh gained flattened
    /// communicators since).
    pub fn of(mesh: &DeviceMesh) -> Result<Arc<MeshCtx>> {
        let groups = mesh.flattened_groups().len();
        if let Some(ctx) = mesh.extension::<MeshCtx>() {
            if ctx.flattened == groups {
                return Ok(ctx);
            }
        }
        let ctx = Arc::new(MeshCtx::build(mesh)?);
        mesh.set_extension(ctx.clone());
        Ok(ctx)
    }

    fn build(mesh: &DeviceMesh) -> Result<MeshCtx> {
        let names = mesh.dim_names();
        let shape: SmallVec<[usize; 4]> = mesh.shape().into_iter().collect();
        let dims: Vec<(&str, usize)> = names.iter().copied().zip(shape.iter().copied()).collect();
        let rank = mesh.rank();
        let mut topo = MeshTopology::new(&dims).ctx("device_mesh", rank)?;
        let groups = mesh.flattened_groups();
        for g in &groups {
            topo = topo.with_flattened(g).ctx("device_mesh", rank)?;
        }
        // One-sided gets only where every mesh dim's communicator offers them.
        let mut rma = true;
        for d in 0..names.len() {
            rma &= mesh.comm(d)?.capabilities().rma_get;
        }
        let mut topo = topo.with_rma_get(rma);
        // A mesh dim whose communicator runs over a modeled link (`comm::link` hints) is
        // priced as that link: its alpha per collective, its bandwidth per rank.
        for d in 0..names.len() {
            let comm = mesh.comm(d)?;
            if let Ok(Some(link)) =
                candle_dtensor_comm::link::LinkModel::from_hints(&comm.options().hints, comm.name())
            {
                topo = topo
                    .with_link(d, 0.0, link.gbps)
                    .with_launch(d, link.alpha_us);
            }
        }
        let coord = mesh.coordinate();
        let mut axes = Vec::with_capacity(dims.len());
        for (d, name) in names.iter().enumerate() {
            axes.push(Axis {
                comm: mesh.comm(d)?.clone(),
                n: shape[d],
                coord: coord[d],
                name: Arc::from(*name),
            });
        }
        Ok(MeshCtx {
            topo,
            rank,
            names: names.iter().map(|s| s.to_string()).collect(),
            flattened: groups.len(),
            coord,
            shape,
            axes,
            merged: Mutex::new(HashMap::new()),
        })
    }

    /// The cost-model view of the mesh.
    pub fn topology(&self) -> &MeshTopology {
        &self.topo
    }

    /// This rank in the mesh's root communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The axis of one mesh dim, or of several merged dims (their flattened communicator of
    /// `mesh`, which must be the mesh this context belongs to).
    pub(crate) fn axis(&self, mesh: &DeviceMesh, dims: &[usize]) -> Result<Axis> {
        if let [d] = dims {
            return Ok(self.axes[*d].clone());
        }
        let mut merged = self.merged.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = merged.get(dims) {
            return Ok(a.clone());
        }
        let comm = mesh.flattened_comm(dims).ok_or_else(|| {
            crate::error::invalid(
                "redistribute",
                self.rank(),
                format!("the plan merges mesh dims {dims:?} but the mesh has no flattened communicator for them"),
            )
        })?;
        let name: Vec<&str> = dims.iter().map(|&d| self.names[d].as_str()).collect();
        let axis = Axis {
            n: comm.size(),
            coord: group_index(&self.coord, &self.shape, dims),
            comm,
            name: Arc::from(name.join("+")),
        };
        merged.insert(dims.to_vec(), axis.clone());
        Ok(axis)
    }
}
