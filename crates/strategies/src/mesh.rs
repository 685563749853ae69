//! [`MeshTopology`]: mesh dims with names, sizes and alpha-beta link costs, plus the groups of
//! mesh dims that have a flattened communicator.

use std::hash::{Hash, Hasher};

use rustc_hash::FxHasher;
use smallvec::SmallVec;

use crate::error::{Result, StrategyError};
use crate::spec::Shape;

/// Largest mesh the compiler accepts (the planner's state keys pack 4 bits per mesh dim).
pub const MAX_MESH_DIMS: usize = 8;

/// Per-collective fixed cost (kernel launch + synchronisation) used by default, in µs.
/// PyTorch's cost model uses the same constant (`_collective_utils.py`: `6.6 + ...`).
pub const DEFAULT_LAUNCH_US: f64 = 6.6;
/// Default intra-node per-hop latency (µs), as PyTorch `MeshTopoInfo`.
pub const INTRA_NODE_LATENCY_US: f64 = 0.6;
/// Default intra-node bandwidth (GB/s, 1 GB = 1e9 bytes), as PyTorch `MeshTopoInfo` (NVLink-like).
pub const INTRA_NODE_BANDWIDTH_GBPS: f64 = 87.7;
/// Default inter-node per-hop latency (µs), as PyTorch `MeshTopoInfo`.
pub const INTER_NODE_LATENCY_US: f64 = 2.7;
/// Default inter-node bandwidth (GB/s): PyTorch scales the intra-node figure by 0.22.
pub const INTER_NODE_BANDWIDTH_GBPS: f64 = 87.7 * 0.22;
/// Devices per host assumed by [`MeshTopology::new`].
pub const DEFAULT_DEVICES_PER_HOST: usize = 8;

/// One mesh dim and the cost of communicating over it.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshDim {
    /// Dim name (`"dp"`, `"tp"`, ...).
    pub name: String,
    /// Number of ranks along the dim.
    pub size: usize,
    /// Latency per ring step (µs).
    pub latency_us: f64,
    /// Link bandwidth in GB/s (1e9 bytes per second).
    pub bandwidth_gbps: f64,
    /// Fixed cost per collective (launch + sync), µs.
    pub launch_us: f64,
}

/// The device mesh as the sharding compiler sees it: dim sizes, names, link costs and the
/// flattened communicators that exist.
///
/// Construct with [`MeshTopology::new`] / [`MeshTopology::parse`] and the `with_*` builders: they
/// keep the fingerprint (used in propagation cache keys) up to date. After editing the public
/// fields directly, call [`MeshTopology::refresh`].
#[derive(Clone, Debug, PartialEq)]
pub struct MeshTopology {
    /// Mesh dims, outermost first.
    pub dims: Vec<MeshDim>,
    /// Groups of mesh dims (ascending) that have a flattened communicator.
    pub flattened: Vec<SmallVec<[usize; 4]>>,
    /// Whether the communicators support one-sided gets (`rma_get` strategies are only
    /// offered when they do; the process and MPI backends do not).
    pub rma_get: bool,
    fingerprint: u64,
}

impl MeshTopology {
    /// Builds a mesh from `(name, size)` pairs, outermost first.
    ///
    /// Default costs follow PyTorch's `MeshTopoInfo`: walking the dims from innermost to outermost
    /// with a running product of sizes, dims are intra-node (0.6 µs, 87.7 GB/s) until the product
    /// exceeds 8 devices per host, inter-node (2.7 µs, 19.3 GB/s) from then on. Every collective
    /// also pays [`DEFAULT_LAUNCH_US`].
    ///
    /// # Errors
    /// [`StrategyError::Mesh`] for no dims, more than [`crate::MAX_MESH_DIMS`], a size of 0, or
    /// an empty or duplicate name.
    pub fn new(dims: &[(&str, usize)]) -> Result<Self> {
        Self::with_host_size(dims, DEFAULT_DEVICES_PER_HOST)
    }

    /// Like [`MeshTopology::new`] with `devices_per_host` devices per node.
    ///
    /// # Errors
    /// As [`MeshTopology::new`].
    pub fn with_host_size(dims: &[(&str, usize)], devices_per_host: usize) -> Result<Self> {
        if dims.is_empty() {
            return Err(StrategyError::mesh("a mesh needs at least one dim"));
        }
        if dims.len() > MAX_MESH_DIMS {
            return Err(StrategyError::mesh(format!(
                "{} mesh dims; at most {} are supported",
                dims.len(),
                MAX_MESH_DIMS
            )));
        }
        for (i, (name, size)) in dims.iter().enumerate() {
            if name.is_empty() {
                return Err(StrategyError::mesh(format!(
                    "mesh dim {i} has an empty name"
                )));
            }
            if *size == 0 {
                return Err(StrategyError::mesh(format!("mesh dim {name:?} has size 0")));
            }
            if dims[..i].iter().any(|(n, _)| n == name) {
                return Err(StrategyError::mesh(format!(
                    "duplicate mesh dim name {name:?}"
                )));
            }
        }
        let mut out: Vec<MeshDim> = Vec::with_capacity(dims.len());
        let mut running = 1usize;
        let mut inter = vec![false; dims.len()];
        for (i, (_, size)) in dims.iter().enumerate().rev() {
            running = running.saturating_mul(*size);
            inter[i] = running > devices_per_host.max(1);
        }
        for (i, (name, size)) in dims.iter().enumerate() {
            let (latency_us, bandwidth_gbps) = if inter[i] {
                (INTER_NODE_LATENCY_US, INTER_NODE_BANDWIDTH_GBPS)
            } else {
                (INTRA_NODE_LATENCY_US, INTRA_NODE_BANDWIDTH_GBPS)
            };
            out.push(MeshDim {
                name: name.to_string(),
                size: *size,
                latency_us,
                bandwidth_gbps,
                launch_us: DEFAULT_LAUNCH_US,
            });
        }
        let mut mesh = MeshTopology {
            dims: out,
            flattened: Vec::new(),
            rma_get: true,
            fingerprint: 0,
        };
        mesh.refresh();
        Ok(mesh)
    }

    /// Parses `"dp=2,tp=2"` (whitespace tolerated).
    ///
    /// # Errors
    /// [`StrategyError::Parse`] on malformed text, or the errors of [`MeshTopology::new`].
    pub fn parse(s: &str) -> Result<Self> {
        let mut dims: Vec<(String, usize)> = Vec::new();
        if s.trim().is_empty() {
            return Err(StrategyError::parse(
                "mesh",
                s,
                "empty mesh (expected e.g. dp=2,tp=2)",
            ));
        }
        for part in s.split(',') {
            let (name, size) = part.split_once('=').ok_or_else(|| {
                StrategyError::parse("mesh", s, format!("{:?} is not NAME=SIZE", part.trim()))
            })?;
            let size: usize = size.trim().parse().map_err(|_| {
                StrategyError::parse("mesh", s, format!("{:?} is not a size", size.trim()))
            })?;
            dims.push((name.trim().to_string(), size));
        }
        let refs: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        Self::new(&refs)
    }

    /// Sets the latency (µs per ring step) and bandwidth (GB/s) of mesh dim `dim`; an out-of-range
    /// `dim` is ignored.
    pub fn with_link(mut self, dim: usize, latency_us: f64, bandwidth_gbps: f64) -> Self {
        if let Some(d) = self.dims.get_mut(dim) {
            d.latency_us = latency_us;
            d.bandwidth_gbps = bandwidth_gbps;
        }
        self.refresh();
        self
    }

    /// Sets the fixed per-collective cost (µs) of mesh dim `dim`; an out-of-range `dim` is ignored.
    pub fn with_launch(mut self, dim: usize, launch_us: f64) -> Self {
        if let Some(d) = self.dims.get_mut(dim) {
            d.launch_us = launch_us;
        }
        self.refresh();
        self
    }

    /// Declares that the mesh dims `dims` have a flattened communicator (the planner may then
    /// merge consecutive same-kind collectives over them into one).
    ///
    /// # Errors
    /// [`StrategyError::Mesh`] for fewer than two dims, an out-of-range or repeated dim.
    pub fn with_flattened(mut self, dims: &[usize]) -> Result<Self> {
        let mut g: SmallVec<[usize; 4]> = SmallVec::from_slice(dims);
        g.sort_unstable();
        if g.len() < 2 {
            return Err(StrategyError::mesh(
                "a flattened group needs at least two mesh dims",
            ));
        }
        if g.windows(2).any(|w| w[0] == w[1]) || g.iter().any(|&d| d >= self.dims.len()) {
            return Err(StrategyError::mesh(format!(
                "invalid flattened group {dims:?} for a {}-d mesh",
                self.dims.len()
            )));
        }
        if !self.flattened.contains(&g) {
            self.flattened.push(g);
        }
        self.refresh();
        Ok(self)
    }

    /// Like [`MeshTopology::with_flattened`] with dim names.
    ///
    /// # Errors
    /// Unknown names, or the errors of [`MeshTopology::with_flattened`].
    pub fn with_flattened_names(self, names: &[&str]) -> Result<Self> {
        let dims = names
            .iter()
            .map(|n| self.dim_index(n))
            .collect::<Result<Vec<_>>>()?;
        self.with_flattened(&dims)
    }

    /// The same mesh with one-sided gets supported or not (see [`MeshTopology::rma_get`]).
    pub fn with_rma_get(mut self, supported: bool) -> Self {
        self.rma_get = supported;
        self.refresh();
        self
    }

    /// Recomputes the fingerprint after the public fields were edited directly.
    pub fn refresh(&mut self) {
        self.fingerprint = self.compute_fingerprint();
    }

    fn compute_fingerprint(&self) -> u64 {
        let mut h = FxHasher::default();
        self.dims.len().hash(&mut h);
        for d in &self.dims {
            d.name.hash(&mut h);
            d.size.hash(&mut h);
            d.latency_us.to_bits().hash(&mut h);
            d.bandwidth_gbps.to_bits().hash(&mut h);
            d.launch_us.to_bits().hash(&mut h);
        }
        self.flattened.hash(&mut h);
        self.rma_get.hash(&mut h);
        h.finish()
    }

    /// Hash of everything (sizes, names, costs, flattened groups); part of propagation cache keys.
    pub fn fingerprint(&self) -> u64 {
        debug_assert_eq!(
            self.fingerprint,
            self.compute_fingerprint(),
            "MeshTopology fields were edited without calling refresh()"
        );
        self.fingerprint
    }

    /// Sizes of the mesh dims.
    pub fn shape(&self) -> Shape {
        self.dims.iter().map(|d| d.size).collect()
    }

    /// Number of mesh dims.
    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    /// Number of ranks (product of the dim sizes).
    pub fn size(&self) -> usize {
        self.dims.iter().map(|d| d.size).product()
    }

    /// Size of mesh dim `dim` (1 for an out-of-range dim).
    pub fn dim_size(&self, dim: usize) -> usize {
        self.dims.get(dim).map(|d| d.size).unwrap_or(1)
    }

    /// Index of the mesh dim called `name`.
    ///
    /// # Errors
    /// [`StrategyError::Mesh`] listing the known names.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.dims
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.dims.iter().map(|d| d.name.as_str()).collect();
                StrategyError::mesh(format!(
                    "unknown mesh dim {name:?}; mesh dims are {names:?}"
                ))
            })
    }

    /// Whether `dims` (ascending) has a flattened communicator.
    pub fn has_flattened(&self, dims: &[usize]) -> bool {
        self.flattened.iter().any(|g| g.as_slice() == dims)
    }

    /// The link of a (flattened) group: size = product, latency and launch = the worst of the
    /// dims, bandwidth = the slowest. For one dim, that dim.
    pub fn group_link(&self, dims: &[usize]) -> MeshDim {
        let mut out = MeshDim {
            name: self.group_name(dims),
            size: 1,
            latency_us: 0.0,
            bandwidth_gbps: f64::INFINITY,
            launch_us: 0.0,
        };
        for &d in dims {
            if let Some(md) = self.dims.get(d) {
                out.size *= md.size;
                out.latency_us = out.latency_us.max(md.latency_us);
                out.bandwidth_gbps = out.bandwidth_gbps.min(md.bandwidth_gbps);
                out.launch_us = out.launch_us.max(md.launch_us);
            }
        }
        out
    }

    /// Name of a group of mesh dims: `"tp"` or `"dp+tp"`.
    pub fn group_name(&self, dims: &[usize]) -> String {
        let names: Vec<&str> = dims
            .iter()
            .map(|&d| self.dims.get(d).map(|m| m.name.as_str()).unwrap_or("?"))
            .collect();
        names.join("+")
    }
}

impl std::fmt::Display for MeshTopology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={}", d.name, d.size)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_pytorch() {
        let m = MeshTopology::new(&[("dp", 4), ("tp", 8)]).unwrap();
        assert_eq!(m.dims[1].bandwidth_gbps, INTRA_NODE_BANDWIDTH_GBPS);
        assert_eq!(m.dims[0].bandwidth_gbps, INTER_NODE_BANDWIDTH_GBPS);
        assert_eq!(m.size(), 32);
        let small = MeshTopology::parse("dp=2, tp=2").unwrap();
        assert!(small
            .dims
            .iter()
            .all(|d| d.latency_us == INTRA_NODE_LATENCY_US));
        assert_eq!(small.to_string(), "dp=2,tp=2");
    }

    #[test]
    fn errors() {
        assert!(MeshTopology::new(&[]).is_err());
        assert!(MeshTopology::new(&[("a", 0)]).is_err());
        assert!(MeshTopology::new(&[("a", 2), ("a", 2)]).is_err());
        assert!(MeshTopology::parse("dp2").is_err());
        assert!(MeshTopology::parse("dp=x").is_err());
        let m = MeshTopology::parse("dp=2,tp=2").unwrap();
        let e = m.dim_index("tpp").unwrap_err().to_string();
        assert!(e.contains("\"dp\", \"tp\""), "{e}");
        assert!(m.clone().with_flattened(&[0]).is_err());
        assert!(m.clone().with_flattened(&[0, 2]).is_err());
    }

    #[test]
    fn fingerprint_tracks_everything() {
        let a = MeshTopology::parse("dp=2,tp=2").unwrap();
        let b = a.clone().with_flattened(&[0, 1]).unwrap();
        let c = a.clone().with_link(0, 1.0, 10.0);
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(
            a.fingerprint(),
            MeshTopology::parse("dp=2,tp=2").unwrap().fingerprint()
        );
        assert!(b.has_flattened(&[0, 1]));
        assert_eq!(b.group_link(&[0, 1]).size, 4);
        assert_eq!(b.group_name(&[0, 1]), "dp+tp");
    }
}
