//! `DeviceMesh`: an N-d, row-major layout of ranks with one eagerly split communicator per
//! mesh dim.
//!
//! # Overview
//!
//! [`DeviceMesh::new`] takes a root [`Comm`] and named dim sizes (`[("dp", 2), ("tp", 2)]`) and
//! splits one communicator per dim right away (torchcomms style: every rank calls
//! [`Comm::split`] once per dim with its own group). Afterwards [`DeviceMesh::comm`] hands out
//! the communicator of a dim, [`DeviceMesh::slice`] / [`DeviceMesh::dim`] build sub-meshes that
//! reuse those communicators, and [`DeviceMesh::flatten`] creates exactly one new communicator for
//! a set of dims (used to merge consecutive collectives, and by FSDP over several dims).
//! The rank arithmetic lives in [`grid`] as pure functions.
//!
//! ```
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::mesh::DeviceMesh;
//!
//! let coords = LocalWorld::run(4, |root| {
//!     let mesh = DeviceMesh::new(root, &[("dp", 2), ("tp", 2)])?;
//!     let tp = mesh.comm_by_name("tp")?;
//!     Ok::<_, candle_dtensor::mesh::MeshError>((mesh.coordinate().to_vec(), tp.rank(), tp.size()))
//! })?;
//! assert_eq!(coords[3], (vec![1, 1], 1, 2));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod grid;

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use candle_dtensor_comm::{Comm, CommError};
use smallvec::SmallVec;

use grid::{dim_group, group_index, unravel, Coord};

/// Errors of mesh construction and lookup.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum MeshError {
    /// The product of the dim sizes differs from the number of ranks.
    #[error("mesh {shape}: the product of the dim sizes is {product} but the communicator \"{comm}\" has {world} ranks")]
    ShapeMismatch {
        /// The requested shape, rendered.
        shape: String,
        /// The product of the sizes.
        product: usize,
        /// The communicator's size.
        world: usize,
        /// The communicator.
        comm: String,
    },
    /// Two dims share a name.
    #[error("mesh dim name \"{0}\" appears twice")]
    DuplicateDim(String),
    /// A dim name that the mesh does not have.
    #[error("unknown mesh dim \"{name}\"; mesh dims are {available:?}")]
    UnknownDim {
        /// The name asked for.
        name: String,
        /// The names the mesh has.
        available: Vec<String>,
    },
    /// A dim index out of range.
    #[error("mesh dim index {index} out of range for a {ndim}-d mesh")]
    DimOutOfRange {
        /// The index asked for.
        index: usize,
        /// The mesh's number of dims.
        ndim: usize,
    },
    /// A mesh needs at least one dim, each named and of size >= 1.
    #[error("invalid mesh: {0}")]
    Invalid(String),
    /// A communicator operation failed while building the mesh.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// `Result` with [`MeshError`].
pub type Result<T, E = MeshError> = std::result::Result<T, E>;

#[derive(Clone)]
struct Flattened {
    name: String,
    root_dims: Vec<usize>,
    comm: Comm,
}

struct Shared {
    root: Comm,
    shape: Vec<usize>,
    names: Vec<String>,
    coord: Coord,
    comms: Vec<Comm>,
    flattened: Mutex<Vec<Flattened>>,
}

#[derive(Clone)]
enum DimRef {
    Root(usize),
    Flat(Flattened),
}

/// An N-d mesh of ranks; see the crate docs. Cloning is cheap (shared state).
#[derive(Clone)]
pub struct DeviceMesh {
    shared: Arc<Shared>,
    dims: SmallVec<[DimRef; 4]>,
    /// Values upper layers cache per mesh handle ([`DeviceMesh::extension`]).
    ext: Extensions,
}

type Extensions = Arc<Mutex<Vec<Arc<dyn Any + Send + Sync>>>>;

impl DeviceMesh {
    /// Lays the ranks of `root` out row-major over `dims` and splits one communicator per dim.
    /// Collective over `root`: every rank calls it with the same dims.
    ///
    /// # Errors
    ///
    /// No dims, an empty or duplicate name, a zero size, a size product other than
    /// `root.size()`, or a failed split.
    pub fn new(root: Comm, dims: &[(&str, usize)]) -> Result<DeviceMesh> {
        if dims.is_empty() {
            return Err(MeshError::Invalid("a mesh needs at least one dim".into()));
        }
        for (i, (name, size)) in dims.iter().enumerate() {
            if name.is_empty() {
                return Err(MeshError::Invalid(format!(
                    "mesh dim {i} has an empty name"
                )));
            }
            if *size == 0 {
                return Err(MeshError::Invalid(format!(
                    "mesh dim \"{name}\" has size 0"
                )));
            }
            if dims[..i].iter().any(|(n, _)| n == name) {
                return Err(MeshError::DuplicateDim(name.to_string()));
            }
        }
        let shape: Vec<usize> = dims.iter().map(|(_, s)| *s).collect();
        let product: usize = shape.iter().product();
        if product != root.size() {
            return Err(MeshError::ShapeMismatch {
                shape: render(dims.iter().map(|(n, s)| (n.to_string(), *s))),
                product,
                world: root.size(),
                comm: root.name().to_string(),
            });
        }
        let coord = unravel(root.rank(), &shape);
        let mut comms = Vec::with_capacity(dims.len());
        for (d, (name, _)) in dims.iter().enumerate() {
            let group = dim_group(&coord, &shape, &[d]);
            let comm = root.split(&group, name)?.ok_or_else(|| {
                MeshError::Invalid(format!(
                    "split of mesh dim \"{name}\" returned no communicator"
                ))
            })?;
            comms.push(comm);
        }
        tracing::debug!(rank = root.rank(), mesh = %render(dims.iter().map(|(n, s)| (n.to_string(), *s))), "device mesh created");
        let shared = Arc::new(Shared {
            root,
            shape,
            names: dims.iter().map(|(n, _)| n.to_string()).collect(),
            coord,
            comms,
            flattened: Mutex::new(Vec::new()),
        });
        let dims = (0..dims.len()).map(DimRef::Root).collect();
        Ok(DeviceMesh {
            shared,
            dims,
            ext: Extensions::default(),
        })
    }

    /// The number of mesh dims.
    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    /// The size of each dim.
    pub fn shape(&self) -> Vec<usize> {
        (0..self.ndim()).map(|d| self.size_at(d)).collect()
    }

    /// The number of ranks in the mesh.
    pub fn num_ranks(&self) -> usize {
        self.shape().iter().product()
    }

    /// The dim names.
    pub fn dim_names(&self) -> Vec<&str> {
        self.dims
            .iter()
            .map(|d| match d {
                DimRef::Root(i) => self.shared.names[*i].as_str(),
                DimRef::Flat(f) => f.name.as_str(),
            })
            .collect()
    }

    /// The index of the dim called `name`.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.dim_names()
            .iter()
            .position(|n| *n == name)
            .ok_or_else(|| MeshError::UnknownDim {
                name: name.to_string(),
                available: self.dim_names().iter().map(|s| s.to_string()).collect(),
            })
    }

    fn check_dim(&self, d: usize) -> Result<()> {
        if d >= self.ndim() {
            return Err(MeshError::DimOutOfRange {
                index: d,
                ndim: self.ndim(),
            });
        }
        Ok(())
    }

    fn size_at(&self, d: usize) -> usize {
        match &self.dims[d] {
            DimRef::Root(i) => self.shared.shape[*i],
            DimRef::Flat(f) => f.root_dims.iter().map(|&i| self.shared.shape[i]).product(),
        }
    }

    /// The size of dim `d`.
    pub fn size(&self, d: usize) -> Result<usize> {
        self.check_dim(d)?;
        Ok(self.size_at(d))
    }

    /// This rank's coordinate in the mesh.
    pub fn coordinate(&self) -> Coord {
        (0..self.ndim())
            .map(|d| match &self.dims[d] {
                DimRef::Root(i) => self.shared.coord[*i],
                DimRef::Flat(f) => {
                    group_index(&self.shared.coord, &self.shared.shape, &f.root_dims)
                }
            })
            .collect()
    }

    /// The communicator of dim `d` (its rank is this rank's coordinate along `d`).
    pub fn comm(&self, d: usize) -> Result<&Comm> {
        self.check_dim(d)?;
        Ok(self.comm_at(d))
    }

    fn comm_at(&self, d: usize) -> &Comm {
        match &self.dims[d] {
            DimRef::Root(i) => &self.shared.comms[*i],
            DimRef::Flat(f) => &f.comm,
        }
    }

    /// The communicator of the dim called `name`.
    pub fn comm_by_name(&self, name: &str) -> Result<&Comm> {
        let d = self.dim_index(name)?;
        Ok(self.comm_at(d))
    }

    /// The communicator the mesh was built from (every rank of the root mesh).
    pub fn root_comm(&self) -> &Comm {
        &self.shared.root
    }

    /// This rank in the root communicator.
    pub fn rank(&self) -> usize {
        self.shared.root.rank()
    }

    /// The 1-D sub-mesh of the dim called `name` (reuses its communicator).
    pub fn dim(&self, name: &str) -> Result<DeviceMesh> {
        self.slice(&[name])
    }

    /// The sub-mesh of the named dims, in the order given (reuses their communicators).
    pub fn slice(&self, names: &[&str]) -> Result<DeviceMesh> {
        if names.is_empty() {
            return Err(MeshError::Invalid("slice needs at least one dim".into()));
        }
        let mut dims = SmallVec::new();
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(MeshError::DuplicateDim(n.to_string()));
            }
            dims.push(self.dims[self.dim_index(n)?].clone());
        }
        Ok(DeviceMesh {
            shared: self.shared.clone(),
            dims,
            ext: Extensions::default(),
        })
    }

    fn root_dims_of(&self, names: &[&str]) -> Result<Vec<usize>> {
        let mut out = Vec::new();
        for n in names {
            match &self.dims[self.dim_index(n)?] {
                DimRef::Root(i) => out.push(*i),
                DimRef::Flat(f) => out.extend(&f.root_dims),
            }
        }
        for (i, d) in out.iter().enumerate() {
            if out[..i].contains(d) {
                return Err(MeshError::DuplicateDim(self.shared.names[*d].clone()));
            }
        }
        Ok(out)
    }

    /// A 1-D mesh over the named dims flattened row-major (in the order given), with one new
    /// communicator called `name`. Collective over the root communicator: every rank of the
    /// root mesh calls it with the same arguments. Flattening the same dims again returns the
    /// existing communicator.
    ///
    /// # Errors
    ///
    /// Unknown or repeated dims, a `name` that is already a dim name, or a failed split.
    pub fn flatten(&self, names: &[&str], name: &str) -> Result<DeviceMesh> {
        let root_dims = self.root_dims_of(names)?;
        if self.shared.names.iter().any(|n| n == name) {
            return Err(MeshError::Invalid(format!(
                "cannot name a flattened dim \"{name}\": that is already a mesh dim"
            )));
        }
        let mut flats = self
            .shared
            .flattened
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(f) = flats.iter().find(|f| f.root_dims == root_dims) {
            return Ok(DeviceMesh {
                shared: self.shared.clone(),
                dims: SmallVec::from_elem(DimRef::Flat(f.clone()), 1),
                ext: Extensions::default(),
            });
        }
        if flats.iter().any(|f| f.name == name) {
            return Err(MeshError::Invalid(format!(
                "a flattened dim named \"{name}\" already exists over other dims"
            )));
        }
        let group = dim_group(&self.shared.coord, &self.shared.shape, &root_dims);
        let comm = self.shared.root.split(&group, name)?.ok_or_else(|| {
            MeshError::Invalid(format!(
                "split for flattened dim \"{name}\" returned no communicator"
            ))
        })?;
        let f = Flattened {
            name: name.to_string(),
            root_dims,
            comm,
        };
        flats.push(f.clone());
        Ok(DeviceMesh {
            shared: self.shared.clone(),
            dims: SmallVec::from_elem(DimRef::Flat(f), 1),
            ext: Extensions::default(),
        })
    }

    /// The flattened communicator over mesh dims `dims` (indices of this mesh, in order), if
    /// [`DeviceMesh::flatten`] created one.
    pub fn flattened_comm(&self, dims: &[usize]) -> Option<Comm> {
        let mut root_dims = Vec::new();
        for &d in dims {
            match self.dims.get(d)? {
                DimRef::Root(i) => root_dims.push(*i),
                DimRef::Flat(f) => root_dims.extend(&f.root_dims),
            }
        }
        let flats = self
            .shared
            .flattened
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        flats
            .iter()
            .find(|f| f.root_dims == root_dims)
            .map(|f| f.comm.clone())
    }

    /// Aborts every communicator of this mesh (the root, one per dim, the flattened ones):
    /// their pending and later operations fail at once, on this rank and (through the
    /// backend's failure notice) on the peers waiting for it. What a rank does when its step
    /// failed and it will abandon the mesh, so that no peer waits an op timeout for it.
    pub fn abort(&self, reason: &str) {
        self.shared.root.abort(reason);
        for c in &self.shared.comms {
            c.abort(reason);
        }
        let flats = self
            .shared
            .flattened
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for f in flats.iter() {
            f.comm.abort(reason);
        }
    }

    /// Groups of this mesh's dims (ascending indices) that have a flattened communicator.
    pub fn flattened_groups(&self) -> Vec<Vec<usize>> {
        let flats = self
            .shared
            .flattened
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for f in flats.iter() {
            let mine: Option<Vec<usize>> = f
                .root_dims
                .iter()
                .map(|rd| {
                    self.dims
                        .iter()
                        .position(|d| matches!(d, DimRef::Root(i) if i == rd))
                })
                .collect();
            if let Some(m) = mine {
                if m.len() > 1 && m.windows(2).all(|w| w[0] < w[1]) {
                    out.push(m);
                }
            }
        }
        out
    }

    /// The value of type `T` an upper layer cached on this mesh handle (and its clones) with
    /// [`DeviceMesh::set_extension`], if any. This is how the DTensor runtime keeps per-mesh
    /// state without a global registry.
    pub fn extension<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let ext = self.ext.lock().unwrap_or_else(|e| e.into_inner());
        ext.iter().find_map(|v| v.clone().downcast::<T>().ok())
    }

    /// Caches `value` on this mesh handle (replacing an earlier value of the same type). The
    /// value must not hold this `DeviceMesh` (that would be a reference cycle).
    pub fn set_extension<T: Any + Send + Sync>(&self, value: Arc<T>) {
        let mut ext = self.ext.lock().unwrap_or_else(|e| e.into_inner());
        ext.retain(|v| !v.is::<T>());
        ext.push(value);
    }

    /// Whether two handles describe the same mesh (same root state and dims).
    pub fn same_mesh(&self, other: &DeviceMesh) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared) && self.dim_names() == other.dim_names()
    }
}

fn render(dims: impl Iterator<Item = (String, usize)>) -> String {
    let parts: Vec<String> = dims.map(|(n, s)| format!("{n}={s}")).collect();
    format!("({})", parts.join(", "))
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = self.dim_names();
        let parts: Vec<String> = (0..self.ndim())
            .map(|d| format!("{}={}", names[d], self.size_at(d)))
            .collect();
        write!(f, "DeviceMesh({})", parts.join(", "))
    }
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{self} @ rank {} coord {:?}",
            self.rank(),
            self.coordinate().as_slice()
        )
    }
}
