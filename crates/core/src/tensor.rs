//! `DTensor`: a candle tensor (this rank's local piece) plus its placements on a mesh.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_dtensor_kernels::storage::StreamPoint;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::{local_shape, shard_size_and_offset, strided_indices};
use candle_dtensor_strategies::{
    format_placements, plan_redistribute, DTensorSpec, Placement, Placements, ReduceOp,
};
use smallvec::SmallVec;

use crate::collectives;
use crate::convert::sdtype;
use crate::error::{invalid, Context, DTensorError, Result};
use crate::mesh_ctx::MeshCtx;
use crate::redistribute::{execute, GradMask};

struct Inner {
    local: Tensor,
    spec: DTensorSpec,
    mesh: DeviceMesh,
    ctx: Arc<MeshCtx>,
    /// Mesh dims on which the owner of this (leaf) tensor reduces its gradient itself.
    managed: SmallVec<[usize; 4]>,
}

/// A distributed tensor: this rank's local piece (a candle [`Tensor`]) plus its placements on a
/// [`DeviceMesh`] and its global shape.
///
/// Ops on DTensors (see the methods in this crate's `ops` modules) decide where collectives go
/// with the sharding compiler, run the local candle op, and stay differentiable with candle's
/// autograd: `loss.backward()` yields, on every rank, the local pieces of the single-device
/// gradients. Cloning is cheap.
#[derive(Clone)]
pub struct DTensor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DTensor({} on {}, local {:?})",
            self.inner.spec,
            self.inner.mesh,
            self.inner.local.dims()
        )
    }
}

fn check_placements(
    op: &str,
    rank: usize,
    placements: &[Placement],
    ndim: usize,
    mesh: &DeviceMesh,
) -> Result<()> {
    if placements.len() != mesh.ndim() {
        return Err(invalid(
            op,
            rank,
            format!(
                "{} placements ({}) for a {}-d mesh {mesh}",
                placements.len(),
                format_placements(placements),
                mesh.ndim()
            ),
        ));
    }
    for p in placements {
        if let Some(d) = p.shard_dim() {
            if d >= ndim {
                return Err(invalid(
                    op,
                    rank,
                    format!("{p} on a {ndim}-d tensor: shard dim out of range"),
                ));
            }
        }
    }
    Ok(())
}

/// The local piece must live where the mesh's communicators move data.
fn check_device(op: &str, rank: usize, local: &Tensor, mesh: &DeviceMesh) -> Result<()> {
    let dev = mesh.root_comm().device();
    if local.device().same_device(dev) {
        return Ok(());
    }
    Err(invalid(
        op,
        rank,
        format!(
            "local piece on {:?}, but this rank's mesh communicators are on {:?}",
            local.device().location(),
            dev.location()
        ),
    ))
}

fn spec_for(
    op: &str,
    rank: usize,
    shape: &[usize],
    dtype: DType,
    placements: &[Placement],
) -> Result<DTensorSpec> {
    let d = sdtype(dtype).ok_or_else(|| {
        invalid(
            op,
            rank,
            format!(
                "dtype {dtype:?} is not supported by DTensor (f32, f64, bf16, f16, i64, u32, u8)"
            ),
        )
    })?;
    Ok(DTensorSpec::new(shape, d, placements))
}

impl DTensor {
    /// Wraps a local piece whose spec the caller guarantees.
    pub(crate) fn from_parts(
        local: Tensor,
        spec: DTensorSpec,
        mesh: DeviceMesh,
        ctx: Arc<MeshCtx>,
    ) -> DTensor {
        DTensor {
            inner: Arc::new(Inner {
                local,
                spec,
                mesh,
                ctx,
                managed: SmallVec::new(),
            }),
        }
    }

    /// Builds a DTensor from this rank's local piece, assuming even sharding: the global size of
    /// a sharded dim is the local size times the number of shards. Use
    /// [`DTensor::from_local_with_shape`] for uneven pieces.
    ///
    /// The result shares `local`'s graph: gradients flow back to it.
    pub fn from_local(
        local: &Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<DTensor> {
        let ctx = MeshCtx::of(mesh)?;
        let rank = ctx.rank();
        check_placements("from_local", rank, placements, local.rank(), mesh)?;
        let mut global = local.dims().to_vec();
        for (m, p) in placements.iter().enumerate() {
            if let Some(d) = p.shard_dim() {
                global[d] *= ctx.shape[m];
            }
        }
        Self::from_local_with_shape(local, mesh, placements, &global)
    }

    /// Builds a DTensor from this rank's local piece of a tensor of shape `global` (torch.chunk
    /// layout, so uneven and empty pieces are fine).
    ///
    /// # Errors
    ///
    /// `local`'s shape differs from this rank's piece of `global` under `placements`.
    pub fn from_local_with_shape(
        local: &Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
        global: &[usize],
    ) -> Result<DTensor> {
        let ctx = MeshCtx::of(mesh)?;
        let rank = ctx.rank();
        check_placements("from_local", rank, placements, global.len(), mesh)?;
        check_device("from_local", rank, local, mesh)?;
        let spec = spec_for("from_local", rank, global, local.dtype(), placements)?;
        let expect =
            local_shape(global, &ctx.shape, &ctx.coord, placements).ctx("from_local", rank)?;
        if expect.as_slice() != local.dims() {
            return Err(invalid(
                "from_local",
                rank,
                format!(
                    "local piece {:?} at mesh coordinate {:?} does not match {} of global {:?} (expected {:?})",
                    local.dims(),
                    ctx.coord.as_slice(),
                    format_placements(placements),
                    global,
                    expect.as_slice()
                ),
            ));
        }
        Ok(Self::from_parts(local.clone(), spec, mesh.clone(), ctx))
    }

    /// Like [`DTensor::from_local_with_shape`] (or [`DTensor::from_local`] when `global` is
    /// `None`), and also checks across ranks that every rank's piece fits, so a rank whose piece
    /// is off is named instead of producing a wrong result later. Collective over the mesh.
    ///
    /// Without `global`, the global shape is the one (inferred from some rank's piece as
    /// [`DTensor::from_local`] does) that the most ranks' pieces fit; every rank then reports the
    /// same offending ranks.
    ///
    /// # Errors
    ///
    /// A piece (of any rank) that does not fit the global shape under `placements`, or invalid
    /// placements; every rank returns the error.
    pub fn from_local_checked(
        local: &Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
        global: Option<&[usize]>,
    ) -> Result<DTensor> {
        const MAX_DIMS: usize = 8;
        let ctx = MeshCtx::of(mesh)?;
        let rank = ctx.rank();
        let op = "from_local";
        let ndim = global.map_or(local.rank(), |g| g.len());
        check_placements(op, rank, placements, ndim, mesh)?;
        if local.rank() > MAX_DIMS {
            return Err(invalid(
                op,
                rank,
                "pieces of more than 8 dims are not supported",
            ));
        }
        let root = mesh.root_comm();
        // Every rank's (number of dims, dims...) as u32, padded to 9 entries.
        let mut mine = vec![u32::MAX; MAX_DIMS + 1];
        mine[0] = local.rank() as u32;
        for (i, &d) in local.dims().iter().enumerate() {
            mine[i + 1] = d as u32;
        }
        let t = Tensor::new(mine.as_slice(), root.device()).ctx(op, rank)?;
        let all = root
            .all_gather_single(&t)
            .and_then(|w| w.wait())
            .ctx(op, rank)?
            .to_vec1::<u32>()
            .ctx(op, rank)?;
        let mesh_shape = mesh.shape();
        let pieces: Vec<Vec<usize>> = (0..root.size())
            .map(|r| {
                let row = &all[r * (MAX_DIMS + 1)..(r + 1) * (MAX_DIMS + 1)];
                let nd = (row[0] as usize).min(MAX_DIMS);
                row[1..1 + nd].iter().map(|&d| d as usize).collect()
            })
            .collect();
        // Candidate global shapes: the given one, or each rank's inference.
        let candidates: Vec<Vec<usize>> = match global {
            Some(g) => vec![g.to_vec()],
            None => {
                let mut c: Vec<Vec<usize>> = Vec::new();
                for dims in &pieces {
                    let mut g = dims.clone();
                    for (m, p) in placements.iter().enumerate() {
                        if let Some(d) = p.shard_dim() {
                            if d < g.len() && m < mesh_shape.len() {
                                g[d] *= mesh_shape[m];
                            }
                        }
                    }
                    if !c.contains(&g) {
                        c.push(g);
                    }
                }
                c
            }
        };
        let misfits = |g: &[usize]| -> Vec<usize> {
            (0..pieces.len())
                .filter(|&r| {
                    let coord = candle_dtensor_mesh::grid::unravel(r, &mesh_shape);
                    local_shape(g, &mesh_shape, &coord, placements)
                        .map(|e| e.as_slice() != pieces[r].as_slice())
                        .unwrap_or(true)
                })
                .collect()
        };
        let (best, bad) = candidates
            .iter()
            .map(|g| (g, misfits(g)))
            .min_by_key(|(_, bad)| bad.len())
            .ok_or_else(|| invalid(op, rank, "no global shape to check against"))?;
        if let Some(&r) = bad.first() {
            let coord = candle_dtensor_mesh::grid::unravel(r, &mesh_shape);
            let expect = local_shape(best, &mesh_shape, &coord, placements)
                .map(|e| format!("{:?}", e.as_slice()))
                .unwrap_or_else(|e| e.to_string());
            let more = if bad.len() > 1 {
                format!(" (and {} more: ranks {:?})", bad.len() - 1, &bad[1..])
            } else {
                String::new()
            };
            return Err(invalid(
                op,
                rank,
                format!(
                    "rank {r} (mesh coordinate {:?}) holds a piece of shape {:?}, which does not fit {} of global {:?} (expected {expect}){more}",
                    coord.as_slice(),
                    pieces[r],
                    format_placements(placements),
                    best
                ),
            ));
        }
        Self::from_local_with_shape(local, mesh, placements, best)
    }

    /// This rank's local piece.
    pub fn to_local(&self) -> &Tensor {
        &self.inner.local
    }

    /// The placements, one per mesh dim.
    pub fn placements(&self) -> &[Placement] {
        &self.inner.spec.placements
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.inner.mesh
    }

    /// The compiler's spec (placements, global shape, dtype).
    pub fn spec(&self) -> &DTensorSpec {
        &self.inner.spec
    }

    pub(crate) fn ctx(&self) -> &Arc<MeshCtx> {
        &self.inner.ctx
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.inner.spec.meta.shape
    }

    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    /// The global size of dim `d`.
    pub fn dim(&self, d: usize) -> Result<usize> {
        self.shape().get(d).copied().ok_or_else(|| {
            invalid(
                "dim",
                self.mesh_rank(),
                format!("dim {d} out of range for shape {:?}", self.shape()),
            )
        })
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.inner.local.dtype()
    }

    /// The device of the local piece.
    pub fn device(&self) -> &Device {
        self.inner.local.device()
    }

    /// This rank in the mesh's root communicator (for messages).
    pub fn mesh_rank(&self) -> usize {
        self.inner.ctx.rank()
    }

    /// A DTensor with the same spec whose local piece is cut from the graph.
    pub fn detach(&self) -> DTensor {
        Self::from_parts(
            self.inner.local.detach(),
            self.inner.spec.clone(),
            self.inner.mesh.clone(),
            self.inner.ctx.clone(),
        )
    }

    /// `self` with its spec's dtype set to `dtype`, the local piece unchanged: for an op whose
    /// sharding strategies want its inputs in one dtype while its local computation takes
    /// (or makes) another itself (`linear_with_layout_to`: a bf16 activation and f32
    /// weights). Placements, shape and managed gradient dims are kept.
    pub(crate) fn relabelled(&self, dtype: DType) -> Result<DTensor> {
        let target = crate::convert::sdtype(dtype).ok_or_else(|| {
            crate::error::invalid(
                "relabel",
                self.mesh_rank(),
                format!("unsupported dtype {dtype:?}"),
            )
        })?;
        let mut spec = self.inner.spec.clone();
        spec.meta.dtype = target;
        Ok(DTensor {
            inner: Arc::new(Inner {
                local: self.inner.local.clone(),
                spec,
                mesh: self.inner.mesh.clone(),
                ctx: self.inner.ctx.clone(),
                managed: self.inner.managed.clone(),
            }),
        })
    }

    /// Gradient ownership: marks mesh dims on which whoever owns this tensor reduces its
    /// gradient itself (FSDP reduce-scatters the gradients of the parameters it gathered), so
    /// dispatch must not add its own gradient all_reduce there. Only for leaves such as
    /// parameters. The contract: an op whose inputs ALL carry dim `m` passes `m` on (views of a
    /// parameter); [`DTensor::redistribute`] passes on the dims whose placement it leaves
    /// unchanged; `detach` and gradients carry none (they have no gradient of their own to
    /// reduce).
    pub fn with_managed_grad_dims(&self, dims: &[usize]) -> DTensor {
        DTensor {
            inner: Arc::new(Inner {
                local: self.inner.local.clone(),
                spec: self.inner.spec.clone(),
                mesh: self.inner.mesh.clone(),
                ctx: self.inner.ctx.clone(),
                managed: dims.iter().copied().collect(),
            }),
        }
    }

    /// Mesh dims whose gradient reduction the owner handles (see
    /// [`DTensor::with_managed_grad_dims`]).
    pub fn managed_grad_dims(&self) -> &[usize] {
        &self.inner.managed
    }

    /// Redistributes to `placements` (differentiable; [`DTensor::grad`] reads a Partial
    /// source's gradient as the gradient of its value, Replicate where every rank holds it, as
    /// PyTorch's `Redistribute.backward` gives it).
    ///
    /// # Errors
    ///
    /// Wrong number of placements, a shard dim out of range, or an unsupported transition
    /// (`Shard -> Partial`).
    pub fn redistribute(&self, placements: &[Placement]) -> Result<DTensor> {
        let rank = self.mesh_rank();
        check_placements("redistribute", rank, placements, self.rank(), self.mesh())?;
        if placements == self.placements() {
            return Ok(self.clone());
        }
        let plan = plan_redistribute(&self.inner.spec, placements, &self.inner.ctx.topo)
            .ctx("redistribute", rank)?;
        let local = execute(self, &plan, &GradMask::new()).ctx("redistribute", rank)?;
        let mut spec = self.inner.spec.clone();
        spec.placements = placements.iter().copied().collect();
        let out = Self::from_parts(local, spec, self.inner.mesh.clone(), self.inner.ctx.clone());
        // Gradient ownership survives on the dims this redistribution leaves alone: losing it
        // would let a later op all_reduce a gradient its owner reduces too (doubling it).
        let kept: SmallVec<[usize; 4]> = self
            .managed_grad_dims()
            .iter()
            .copied()
            .filter(|&m| self.placements()[m] == placements[m])
            .collect();
        Ok(if kept.is_empty() {
            out
        } else {
            out.with_managed_grad_dims(&kept)
        })
    }

    /// Starts [`DTensor::redistribute`] on a helper thread; [`RedistributeHandle::wait`] joins it.
    /// Useful to overlap a redistribution with unrelated local compute.
    ///
    /// On CUDA the helper thread's work runs on its own stream (candle's per-thread stream), so
    /// it is ordered on the device after the work this thread queued before the call (the
    /// kernels making `self`), and `wait` orders this thread's later work after the helper's
    /// (the collectives and copies writing the result), with events: no host synchronisation.
    /// Collectives issued meanwhile from this thread and the helper may meet in different
    /// orders on different ranks: issue none on the same communicators until `wait`.
    pub fn redistribute_async(&self, placements: &[Placement]) -> RedistributeHandle {
        let this = self.clone();
        let placements: Placements = placements.iter().copied().collect();
        let rank = self.mesh_rank();
        let start = StreamPoint::record(self.device()).ctx("redistribute_async", rank);
        let handle = std::thread::Builder::new()
            .name("dtensor-redistribute".into())
            .spawn(move || {
                let out = start.and_then(|start| {
                    if let Some(point) = start {
                        point
                            .order_after(this.device())
                            .ctx("redistribute_async", rank)?;
                    }
                    this.redistribute(&placements)
                });
                // After the helper's work, failed or not: `wait` orders the caller after it
                // before the source can be freed on the caller's stream.
                let done = StreamPoint::record(this.device()).ctx("redistribute_async", rank);
                Redistributed {
                    source: this,
                    out,
                    done,
                }
            });
        RedistributeHandle {
            handle: handle.map_err(|e| e.to_string()),
            rank,
        }
    }

    /// The full tensor on every rank (differentiable).
    pub fn full_tensor(&self) -> Result<Tensor> {
        let all_r: Placements = SmallVec::from_elem(Placement::Replicate, self.mesh().ndim());
        Ok(self.redistribute(&all_r)?.inner.local.clone())
    }

    /// Runs candle's backward pass from this value. A non-Replicate value is made Replicate
    /// first, so every rank seeds the true gradient (a `P(sum)` data-parallel mean gives the
    /// global gradient, not n times it). Call it on every rank.
    pub fn backward(&self) -> Result<GradStore> {
        let rank = self.mesh_rank();
        let full = if self.placements().iter().all(|p| p.is_replicate()) {
            self.inner.local.clone()
        } else {
            self.full_tensor()?
        };
        full.backward().ctx("backward", rank)
    }

    /// This DTensor's gradient in `grads` (for leaves such as parameters), as a DTensor whose
    /// `full_tensor()` is the single-device gradient of the logical tensor, whatever `self`'s
    /// placements, with placements that say how it is held (docs/ARCHITECTURE.md, "Gradients
    /// of Partial values"). `None` when `self` got no gradient.
    ///
    /// Shard and Replicate mesh dims keep their placement. On a Partial mesh dim the local
    /// gradient candle computed is the derivative with respect to this rank's summand, which
    /// is turned into the gradient of the value without communication:
    /// * `P(sum)`, `MaskPartial`: every rank already holds the gradient: `Replicate`.
    /// * `P(avg)`: every rank holds it divided by n: multiplied by n, `Replicate` (PyTorch's
    ///   `Redistribute.backward` gives every Partial source a Replicate gradient too).
    /// * `P(max)`, `P(min)`: the ranks holding the extreme hold the gradient (split among ties),
    ///   the others zeros; these pieces sum to it: `P(sum)`, which `full_tensor()` or a
    ///   redistribution to `Replicate` reduces with one all_reduce.
    ///
    /// # Errors
    /// A `P(product)` mesh dim: its summands' gradients are the value's gradient times the
    /// other summands, which a rank does not have; redistribute such a leaf first.
    pub fn grad(&self, grads: &GradStore) -> Result<Option<DTensor>> {
        let Some(g) = grads.get(&self.inner.local) else {
            return Ok(None);
        };
        let mut spec = self.inner.spec.clone();
        let mut scale = 1.0f64;
        for (m, p) in spec.placements.iter_mut().enumerate() {
            *p = match *p {
                Placement::Partial(ReduceOp::Sum) | Placement::MaskPartial { .. } => {
                    Placement::Replicate
                }
                Placement::Partial(ReduceOp::Avg) => {
                    scale *= self.inner.ctx.shape[m] as f64;
                    Placement::Replicate
                }
                Placement::Partial(ReduceOp::Max | ReduceOp::Min) => {
                    Placement::Partial(ReduceOp::Sum)
                }
                Placement::Partial(ReduceOp::Product) => {
                    return Err(invalid(
                        "grad",
                        self.mesh_rank(),
                        format!(
                            "the gradient of a {} value (P(product) on mesh dim {m}) is not held by any rank; redistribute it before the backward pass",
                            self.inner.spec
                        ),
                    ))
                }
                other => other,
            };
        }
        let local = if scale == 1.0 {
            g.clone()
        } else {
            g.affine(scale, 0.0).ctx("grad", self.mesh_rank())?
        };
        Ok(Some(Self::from_parts(
            local,
            spec,
            self.inner.mesh.clone(),
            self.inner.ctx.clone(),
        )))
    }
}

/// What the helper thread of [`DTensor::redistribute_async`] returns: the result, on CUDA the
/// point after the helper's work on its stream, and the source itself. The source comes back
/// so that, if the caller dropped its own handle meanwhile, its storage is freed on the
/// caller's thread once the caller's stream waits for that point: freed on the helper's
/// thread, it would go on the helper's stream, unordered with the caller's later work that
/// still reads it.
struct Redistributed {
    source: DTensor,
    out: Result<DTensor>,
    done: Result<Option<StreamPoint>>,
}

/// The result of [`DTensor::redistribute_async`].
pub struct RedistributeHandle {
    handle: std::result::Result<std::thread::JoinHandle<Redistributed>, String>,
    rank: usize,
}

impl RedistributeHandle {
    /// Waits for the redistribution; on CUDA, this thread's later work is ordered after it on
    /// the device.
    ///
    /// # Blocking
    ///
    /// Blocks until the helper thread finishes; every collective on it is bounded by its
    /// communicator's timeout.
    pub fn wait(self) -> Result<DTensor> {
        let r = match self.handle {
            Ok(h) => h.join().map_err(|_| {
                invalid(
                    "redistribute_async",
                    self.rank,
                    "the helper thread panicked",
                )
            })?,
            Err(e) => {
                return Err(invalid(
                    "redistribute_async",
                    self.rank,
                    format!("could not start a thread: {e}"),
                ))
            }
        };
        let Redistributed { source, out, done } = r;
        let ordered = match done? {
            Some(done) => done
                .order_after(source.device())
                .ctx("redistribute_async", self.rank),
            None => Ok(()),
        };
        // Dropped here, after the wait above: see `Redistributed`.
        drop(source);
        ordered?;
        out
    }
}

/// This rank's piece of `full` under `placements` (every rank passes the same full tensor).
/// Partial placements split the value (`sum`: divided by the mesh dim size). The result is a
/// leaf: it does not share `full`'s graph, and lives on the device of the mesh's communicators
/// (`full` is moved there first, as PyTorch's `distribute_tensor` does).
pub fn distribute_tensor(
    full: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
) -> Result<DTensor> {
    let ctx = MeshCtx::of(mesh)?;
    let rank = ctx.rank();
    check_placements("distribute_tensor", rank, placements, full.rank(), mesh)?;
    let spec = spec_for(
        "distribute_tensor",
        rank,
        full.dims(),
        full.dtype(),
        placements,
    )?;
    // As PyTorch's distribute_tensor: the value moves to the mesh's device.
    let mut x = full
        .detach()
        .to_device(mesh.root_comm().device())
        .ctx("distribute_tensor", rank)?;
    for (m, p) in placements.iter().enumerate() {
        let (n, c) = (ctx.shape[m], ctx.coord[m]);
        x = match *p {
            Placement::Shard(d) => {
                let (s, off) =
                    shard_size_and_offset(x.dim(d).ctx("distribute_tensor", rank)?, n, c);
                crate::storage::narrow(&x, d, off, s).ctx("distribute_tensor", rank)?
            }
            Placement::StridedShard { dim, split_factor } => {
                let len = x.dim(dim).ctx("distribute_tensor", rank)?;
                let idx: Vec<u32> = strided_indices(len, split_factor, n, c)
                    .iter()
                    .map(|&i| i as u32)
                    .collect();
                let idx = Tensor::new(idx.as_slice(), x.device()).ctx("distribute_tensor", rank)?;
                x.contiguous()
                    .and_then(|c| c.index_select(&idx, dim))
                    .ctx("distribute_tensor", rank)?
            }
            Placement::Partial(op) => {
                let axis = ctx.axis(mesh, &[m])?;
                collectives::partition(&x, &axis, op).ctx("distribute_tensor", rank)?
            }
            Placement::MaskPartial { .. } => {
                return Err(invalid(
                    "distribute_tensor",
                    rank,
                    "a MaskPartial placement cannot be created from a full tensor",
                ))
            }
            Placement::Replicate => x,
        };
    }
    let x = x.contiguous().ctx("distribute_tensor", rank)?;
    Ok(DTensor::from_parts(x, spec, mesh.clone(), ctx))
}

/// Like [`distribute_tensor`], with the full tensor present only on `src` (a rank of the mesh's
/// root communicator); it is broadcast first. Collective over the mesh.
pub fn distribute_tensor_from(
    full: Option<&Tensor>,
    src: usize,
    mesh: &DeviceMesh,
    placements: &[Placement],
) -> Result<DTensor> {
    let ctx = MeshCtx::of(mesh)?;
    let rank = ctx.rank();
    let root = mesh.root_comm();
    let op = "distribute_tensor";
    // Header: [ndim, dtype code, dims...] as u64, fixed length so every rank can post it. The
    // dtype code indexes the dtypes a broadcast can carry.
    let dtypes = candle_dtensor_comm::SUPPORTED_DTYPES;
    let mut header = vec![0i64; 10];
    if root.rank() == src {
        let t = full.ok_or_else(|| {
            invalid(
                op,
                rank,
                format!("rank {src} is the source but passed no tensor"),
            )
        })?;
        if t.rank() > 8 {
            return Err(invalid(
                op,
                rank,
                "tensors of more than 8 dims are not supported",
            ));
        }
        header[0] = t.rank() as i64;
        header[1] =
            dtypes.iter().position(|d| *d == t.dtype()).ok_or_else(|| {
                invalid(op, rank, format!("dtype {:?} is not supported", t.dtype()))
            })? as i64;
        for (i, &d) in t.dims().iter().enumerate() {
            header[2 + i] = d as i64;
        }
    }
    let h = Tensor::new(header.as_slice(), root.device()).ctx(op, rank)?;
    let h = root
        .broadcast(&h, src)
        .and_then(|w| w.wait())
        .ctx(op, rank)?;
    let h = h.to_vec1::<i64>().ctx(op, rank)?;
    let ndim = h[0] as usize;
    let dtype = *dtypes
        .get(h[1] as usize)
        .ok_or_else(|| invalid(op, rank, "bad dtype code in header"))?;
    let dims: Vec<usize> = h[2..2 + ndim.min(8)].iter().map(|&d| d as usize).collect();
    let data = match (root.rank() == src, full) {
        (true, Some(t)) => t.detach().contiguous().ctx(op, rank)?,
        _ => Tensor::zeros(dims.as_slice(), dtype, root.device()).ctx(op, rank)?,
    };
    let data = root
        .broadcast(&data, src)
        .and_then(|w| w.wait())
        .ctx(op, rank)?;
    distribute_tensor(&data, mesh, placements)
}

impl From<DTensor> for Tensor {
    fn from(d: DTensor) -> Tensor {
        d.inner.local.clone()
    }
}

impl AsRef<Tensor> for DTensor {
    fn as_ref(&self) -> &Tensor {
        &self.inner.local
    }
}

/// Convenience: the error of an op on DTensors on different meshes.
pub(crate) fn mesh_mismatch(op: &str, a: &DTensor, b: &DTensor) -> DTensorError {
    DTensorError::MeshMismatch {
        op: op.to_string(),
        rank: a.mesh_rank(),
        a: format!("{} on {}", a.spec(), a.mesh()),
        b: format!("{} on {}", b.spec(), b.mesh()),
    }
}
