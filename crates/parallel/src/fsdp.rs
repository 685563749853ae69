//! FSDP (ZeRO-3) for candle: parameters, gradients and optimizer state live as dim-0 shards;
//! a unit's full parameters exist only while the unit computes.
//!
//! # How it works on candle
//!
//! - Each parameter has a *shard* `Var` (this rank's torch.chunk rows of dim 0, in the master
//!   dtype; the optimizer updates only these) and a *full* tensor, a graph node over the shard
//!   created once ([`Unshard`]). The full tensor starts with its initial value (so a module
//!   that reads a parameter while it is built sees it); its storage is released after its
//!   unit's forward and refilled in place before use, so every view the model keeps of it sees
//!   the refill. A released full tensor holds the storage seam's placeholder, which every candle
//!   op refuses with a typed error: using it outside its unit can never read freed memory
//!   (`candle_dtensor_kernels::storage`, "the released-storage invariant").
//! - Forward ([`Fsdp::pre_forward`] / [`Fsdp::post_forward`], or [`Fsdp::forward`] around a
//!   closure): one flat all_gather per unit (every parameter's padded shard packed into one
//!   buffer), the next unit's gather issued ahead (prefetch), storage freed after the unit
//!   (`reshard_after_forward`), and an identity node on the unit's output whose backward
//!   re-gathers the unit and prefetches the previous one (the pre-backward hook; candle runs it
//!   before every node inside the unit).
//! - Units nobody drives (no wrapper calls their hooks, e.g. the per-layer units of a
//!   candle-transformers model whose blocks cannot be wrapped) are gathered by the first driven
//!   unit's forward and released as their gradients complete in backward: their gradient
//!   reduction still overlaps the rest of the backward, but their forward saves no memory.
//! - Backward: each full parameter's node runs once, after all its consumers, with its complete
//!   gradient; it stashes it and returns nothing. When a unit's last gradient arrives, one flat
//!   reduce_scatter is issued asynchronously (on its own communicator with
//!   `separate_reduce_scatter_group`, so it overlaps the next all_gather instead of queueing
//!   behind it) and the unit's storage is released. [`Fsdp::finish_backward`] (or
//!   [`Fsdp::backward`], which also runs `loss.backward()`) waits for the reductions (HSDP: then
//!   all_reduces over the replicate dim) and puts each shard's gradient into the `GradStore`,
//!   where candle-nn optimizers find it. A parameter that got a gradient on no rank gets none
//!   (as on one device); they are reported once ([`Fsdp::params_without_grad`]).
//! - Gradient accumulation ([`Fsdp::set_requires_gradient_sync`], FSDP2's name): with sync
//!   off, a backward adds each parameter's complete (unsharded) gradient into an f32
//!   accumulator of this rank and issues no reduction; the next backward with sync on adds the
//!   accumulators into its gradients, so each unit is reduce-scattered (HSDP: all-reduced) ONCE
//!   per optimizer step whatever the number of micro-batches. The price is memory: the
//!   accumulators hold one unsharded gradient of every parameter between micro-batches (counted
//!   in [`FsdpStats::peak_unsharded_bytes`]), as PyTorch's `no_sync`.
//! - Mixed precision: full parameters (and so the compute) in `param_dtype`, shards and the
//!   gradient reduction in f32.
//!
//! Gradient scaling is chosen explicitly ([`GradReduce`]): a DTensor loss is already the global
//! mean (its backward scales each rank's contribution), so its shards' gradients are the SUM of
//! the contributions; plain candle code whose loss is each rank's local mean averages
//! (PyTorch's default).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{CustomOp1, DType, Layout, Shape, Tensor, Var};
use candle_dtensor_comm::{Comm, ReduceOp, Work};
use candle_dtensor_core::debug;
use candle_dtensor_kernels::storage::{self, DeviceStorage};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::shard_size_and_offset;

use crate::error::{ParallelError, Result};

/// How shard gradients are combined across the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradReduce {
    /// Sum the contributions: for DTensor losses, which are global means already.
    Sum,
    /// Average: for losses that are each rank's local mean (plain candle code).
    Avg,
}

/// The gradient-presence flags [`Fsdp::finish_backward_deferred`] leaves for the caller to
/// read (with its own values, in one host read) and pass to [`Fsdp::apply_grad_flags`].
#[derive(Debug)]
#[must_use = "pass the flags to Fsdp::apply_grad_flags before the optimizer step"]
pub struct PendingGradFlags {
    flags: Option<Tensor>,
    /// (unit, its parameter count), in flag order.
    units: Vec<(usize, usize)>,
}

impl PendingGradFlags {
    /// One f32 per parameter of the reduced units (> 0: some rank had a gradient), on the
    /// device; `None` when no unit was reduced.
    pub fn flags(&self) -> Option<&Tensor> {
        self.flags.as_ref()
    }
}

/// FSDP settings.
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// Mesh dim the parameters are sharded over.
    pub shard_dim: usize,
    /// HSDP: mesh dim over which the shards are replicated (gradients all-reduced over it after
    /// the reduce_scatter).
    pub replicate_dim: Option<usize>,
    /// Run the replicate-dim all_reduces on a communicator split from that dim's, for a
    /// replicate dim the model also communicates over (context parallelism's `cp`): the
    /// reductions start as their reduce_scatters finish, a moment that differs between ranks,
    /// so on a shared communicator they would interleave with the model's own ops in a
    /// different order on each rank.
    pub separate_replicate_group: bool,
    /// Release non-root units' full parameters after their forward (re-gathered in backward).
    pub reshard_after_forward: bool,
    /// Give reduce_scatter its own communicator so it overlaps all_gathers.
    pub separate_reduce_scatter_group: bool,
    /// Compute dtype of the full parameters (`None`: the master dtype).
    pub param_dtype: Option<DType>,
    /// Issue the next unit's all_gather before it is needed.
    pub prefetch: bool,
    /// How gradients are combined: chosen by the caller, there is no default (a wrong choice
    /// scales every gradient by the number of ranks).
    pub grad_reduce: GradReduce,
}

impl FsdpConfig {
    /// Sharding over mesh dim `shard_dim`, gradients combined by `grad_reduce`
    /// ([`GradReduce::Sum`] for DTensor losses, [`GradReduce::Avg`] for plain candle losses
    /// that are each rank's local mean). Defaults: reshard after forward, prefetch, no separate
    /// reduce-scatter group, no mixed precision.
    pub fn new(shard_dim: usize, grad_reduce: GradReduce) -> Self {
        FsdpConfig {
            shard_dim,
            replicate_dim: None,
            separate_replicate_group: false,
            reshard_after_forward: true,
            separate_reduce_scatter_group: false,
            param_dtype: None,
            prefetch: true,
            grad_reduce,
        }
    }
}

/// What FSDP measured since the last [`Fsdp::take_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FsdpStats {
    /// Time the compute thread spent waiting for FSDP's collectives (ms).
    pub exposed_comm_ms: f64,
    /// Peak bytes of unsharded parameters and unreduced gradients held at once.
    pub peak_unsharded_bytes: usize,
    /// all_gathers issued (one per unit and direction).
    pub all_gathers: usize,
    /// reduce_scatters issued (one per unit).
    pub reduce_scatters: usize,
}

/// One parameter of a unit.
struct UParam {
    name: String,
    /// Full (TP-local) shape.
    shape: Vec<usize>,
    rows: usize,
    row: usize,
    /// Elements of this parameter in a rank's block (padded rows x row).
    padded: usize,
    /// Offset in a rank's block (elements).
    offset: usize,
    shard: Var,
    full: Tensor,
}

#[derive(Default)]
struct UnitState {
    unsharded: bool,
    pending_ag: Option<Work<Tensor>>,
    /// This rank's complete gradient of each parameter, once its backward ran.
    grads: Vec<Option<Tensor>>,
    /// Gradients accumulated (f32, unsharded) by backwards run with gradient sync off.
    accum: Vec<Option<Tensor>>,
    reducing: bool,
}

struct Unit {
    name: String,
    params: Vec<UParam>,
    block: usize,
    /// Release the full parameters after this unit's forward (re-gathered before backward).
    reshard_after_forward: bool,
    /// A wrapper calls this unit's forward hooks. Undriven units are gathered by the first
    /// driven unit's forward (see the module docs).
    driven: bool,
    state: UnitState,
}

/// A unit's gradient reduction in flight: the reduce_scatter over the shard dim, then (HSDP)
/// the all_reduce of its result over the replicate dim.
enum Reduction {
    Scatter(Work<Tensor>),
    Replicate(Work<Tensor>),
}

struct Run {
    units: Vec<Unit>,
    pending_rs: Vec<(usize, Reduction)>,
    stats: FsdpStats,
    unsharded_bytes: usize,
    /// A backward stashed gradients that [`Fsdp::finish_backward`] has not reduced yet.
    backward_open: bool,
    /// Whether a backward reduces the gradients ([`Fsdp::set_requires_gradient_sync`]).
    sync: bool,
    /// Accumulators hold gradients of backwards run without sync, not reduced yet.
    accumulated: bool,
    /// Parameters of undriven units that got a gradient this step (for the one-time warning).
    undriven_used: BTreeSet<String>,
    warned_undriven: bool,
    /// Parameters that got a gradient on no rank in the last backward.
    without_grad: Vec<String>,
    warned_without_grad: bool,
}

struct Inner {
    cfg: FsdpConfig,
    shard: Comm,
    rs: Comm,
    replicate: Option<Comm>,
    dim_name: String,
    run: Mutex<Run>,
}

/// An FSDP instance shared by a model's parameters and its training loop; see the module docs.
#[derive(Clone)]
pub struct Fsdp {
    inner: Arc<Inner>,
}

/// Rank `rank`'s rows of a parameter with `rows` rows sharded over `ranks` ranks:
/// `(count, offset)`, torch.chunk as [`Fsdp::add_param`] cuts them (an empty shard reports
/// `(0, rows)`). For layouts that shard parameters by FSDP's rule without an [`Fsdp`] (the
/// pipeline trainer's stages, which stay gathered for a whole step).
pub fn chunk_rows(rows: usize, ranks: usize, rank: usize) -> (usize, usize) {
    shard_size_and_offset(rows, ranks, rank)
}

fn check_float(name: &str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(ParallelError::Config(format!(
            "FSDP parameter {name}: parameters must be floating point, got {dtype:?}"
        )))
    }
}

/// The full parameter as a graph node over its shard: born holding its initial value; its
/// backward hands the complete gradient to FSDP and returns nothing for the shard (FSDP puts
/// the reduced shard gradient into the `GradStore` itself).
struct Unshard {
    fsdp: Weak<Inner>,
    unit: usize,
    param: usize,
    initial: Mutex<Option<Tensor>>,
}

impl Unshard {
    fn forward<S: DeviceStorage>(&self, _s: &S, _l: &Layout) -> candle_core::Result<(S, Shape)> {
        let value = self
            .initial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("fsdp-unshard: already built".into()))?;
        Ok((storage::output_of::<S>(&value)?, value.shape().clone()))
    }
}

impl CustomOp1 for Unshard {
    fn name(&self) -> &'static str {
        "fsdp-unshard"
    }

    candle_dtensor_kernels::device_fwd1!(forward);

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        in_unit_backward(&self.fsdp, self.unit, |f| {
            f.stash_grad(self.unit, self.param, grad)
        })?;
        Ok(None)
    }
}

/// Identity whose backward re-gathers a unit (and prefetches the previous one).
struct PreBackward {
    fsdp: Weak<Inner>,
    unit: usize,
}

impl PreBackward {
    fn forward<S: DeviceStorage>(&self, s: &S, l: &Layout) -> candle_core::Result<(S, Shape)> {
        Ok((storage::owned_copy(s, l)?, l.shape().clone()))
    }
}

impl CustomOp1 for PreBackward {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    candle_dtensor_kernels::device_fwd1!(forward);

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        in_unit_backward(&self.fsdp, self.unit, |f| {
            f.unshard(self.unit)?;
            if f.inner.cfg.prefetch {
                if let Some(prev) = f.previous_regathered(self.unit) {
                    f.start_gather(prev)?;
                }
            }
            Ok(())
        })?;
        Ok(Some(grad.clone()))
    }
}

/// Runs `job` on the wrapper a backward node of `unit` belongs to, inside that unit's backward
/// span; nothing when the wrapper is gone (a graph that outlived its model).
fn in_unit_backward(
    fsdp: &Weak<Inner>,
    unit: usize,
    job: impl FnOnce(&Fsdp) -> Result<()>,
) -> candle_core::Result<()> {
    if let Some(inner) = fsdp.upgrade() {
        let f = Fsdp { inner };
        let _b = debug::enter_backward(Some(&f.unit_name(unit)));
        job(&f).map_err(candle_core::Error::from)?;
    }
    Ok(())
}

/// Releases a full parameter's storage; returns the bytes freed (0 if already released).
fn release(p: &UParam) -> Result<usize> {
    Ok(storage::release(&p.full, &p.name)?)
}

/// Whether `e` (or an error it wraps) is candle refusing a released storage's placeholder.
pub(crate) fn is_released_use(e: &candle_core::Error) -> bool {
    use candle_core::Error as E;
    let released = storage::RELEASED_DTYPE;
    match e {
        E::DTypeMismatchBinaryOp { lhs, rhs, .. } => *lhs == released || *rhs == released,
        E::UnsupportedDTypeForOp(d, _) => *d == released,
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } => is_released_use(inner),
        E::WithPath { inner, .. } => is_released_use(inner),
        E::Msg(m) => m.contains("storage has been released"),
        _ => false,
    }
}

impl Fsdp {
    /// Creates FSDP over `mesh` (splits a reduce-scatter communicator when configured;
    /// collective over the mesh).
    ///
    /// # Errors
    ///
    /// Mesh dims out of range, or a failed split.
    pub fn new(mesh: &DeviceMesh, cfg: FsdpConfig) -> Result<Fsdp> {
        let shard = mesh.comm(cfg.shard_dim)?.clone();
        let names = mesh.dim_names();
        let dim_name = names[cfg.shard_dim].to_string();
        let replicate = match cfg.replicate_dim {
            Some(d) if d == cfg.shard_dim => {
                return Err(ParallelError::Config(format!(
                    "FSDP: the replicate dim {d} is also the shard dim"
                )))
            }
            Some(d) if cfg.separate_replicate_group => {
                let c = mesh.comm(d)?;
                let ranks: Vec<usize> = (0..c.size()).collect();
                Some(
                    c.split(&ranks, &format!("{}_grad", c.name()))?
                        .ok_or_else(|| {
                            ParallelError::Config(
                                "replicate-group split returned no communicator".into(),
                            )
                        })?,
                )
            }
            Some(d) => Some(mesh.comm(d)?.clone()),
            None => None,
        };
        let rs = if cfg.separate_reduce_scatter_group {
            let ranks: Vec<usize> = (0..shard.size()).collect();
            shard
                .split(&ranks, &format!("{}_rs", shard.name()))?
                .ok_or_else(|| {
                    ParallelError::Config("reduce-scatter split returned no communicator".into())
                })?
        } else {
            shard.clone()
        };
        Ok(Fsdp {
            inner: Arc::new(Inner {
                cfg,
                shard,
                rs,
                replicate,
                dim_name,
                run: Mutex::new(Run {
                    units: Vec::new(),
                    pending_rs: Vec::new(),
                    stats: FsdpStats::default(),
                    unsharded_bytes: 0,
                    backward_open: false,
                    sync: true,
                    accumulated: false,
                    undriven_used: BTreeSet::new(),
                    warned_undriven: false,
                    without_grad: Vec::new(),
                    warned_without_grad: false,
                }),
            }),
        })
    }

    /// The device of the shard communicator, where parameters and gradients live.
    pub fn device(&self) -> candle_core::Device {
        self.inner.shard.device().clone()
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.inner.cfg
    }

    /// Mesh dims whose gradient reduction FSDP performs (shard, and replicate for HSDP).
    pub fn managed_dims(&self) -> Vec<usize> {
        let mut d = vec![self.inner.cfg.shard_dim];
        d.extend(self.inner.cfg.replicate_dim);
        d
    }

    fn run(&self) -> MutexGuard<'_, Run> {
        self.inner.run.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a new unit (e.g. one transformer block) whose forward hooks the caller runs
    /// ([`Fsdp::pre_forward`] / [`Fsdp::post_forward`] or [`Fsdp::forward`]) and returns its
    /// index. Units are numbered in forward order (prefetching follows it). `last` marks the
    /// unit that runs last in forward and first in backward (e.g. the final norm and head): it
    /// is kept after its forward, as re-gathering it right away would be wasted work.
    pub fn add_unit(&self, name: &str, last: bool) -> usize {
        self.push_unit(name, last, true)
    }

    /// Starts a unit no wrapper drives yet (see [`Fsdp::set_driven`]); used by
    /// [`crate::fsdp_vb::FsdpVarMap`], whose modules are wrapped after they are built.
    pub fn add_undriven_unit(&self, name: &str, last: bool) -> usize {
        self.push_unit(name, last, false)
    }

    fn push_unit(&self, name: &str, last: bool, driven: bool) -> usize {
        let mut run = self.run();
        let reshard = self.inner.cfg.reshard_after_forward && !last;
        run.units.push(Unit {
            name: name.to_string(),
            params: Vec::new(),
            block: 0,
            reshard_after_forward: reshard,
            driven,
            state: UnitState::default(),
        });
        run.units.len() - 1
    }

    /// Declares that a wrapper runs `unit`'s forward hooks from now on.
    ///
    /// # Errors
    ///
    /// No such unit.
    pub fn set_driven(&self, unit: usize) -> Result<()> {
        let mut run = self.run();
        let u = run
            .units
            .get_mut(unit)
            .ok_or_else(|| ParallelError::Config(format!("FSDP unit {unit} does not exist")))?;
        u.driven = true;
        Ok(())
    }

    /// The index of the unit called `name`.
    pub fn unit_index(&self, name: &str) -> Option<usize> {
        self.run().units.iter().position(|u| u.name == name)
    }

    /// The name of every unit, in forward order.
    pub fn unit_names(&self) -> Vec<String> {
        self.run().units.iter().map(|u| u.name.clone()).collect()
    }

    /// Shards `full` (this rank's whole, e.g. tensor-parallel-local, parameter `name`) into
    /// `unit` and returns `(shard var, full tensor)`. The full tensor starts holding `full`
    /// (in the compute dtype), so it can be read while a model is built; FSDP releases it after
    /// its unit's first forward (or [`Fsdp::reshard_all`]).
    pub fn add_param(&self, unit: usize, name: &str, full: &Tensor) -> Result<(Var, Tensor)> {
        check_float(name, full.dtype())?;
        let n = self.inner.shard.size();
        let coord = self.inner.shard.rank();
        let shape = full.dims().to_vec();
        let rows = shape.first().copied().unwrap_or(1);
        let row: usize = shape.iter().skip(1).product();
        let (my_rows, my_off) = shard_size_and_offset(rows, n, coord);
        let f = rows.div_ceil(n.max(1));
        let flat = full.flatten_all()?;
        let shard = flat.narrow(0, my_off * row, my_rows * row)?;
        let mut shard_shape = shape.clone();
        if let Some(s0) = shard_shape.first_mut() {
            *s0 = my_rows;
        } else {
            shard_shape = vec![my_rows];
        }
        let shard = Var::from_tensor(&shard.reshape(shard_shape)?.contiguous()?)?;
        let dtype = self.inner.cfg.param_dtype.unwrap_or(full.dtype());
        check_float(name, dtype)?;
        let initial = full.to_dtype(dtype)?.contiguous()?;
        let mut run = self.run();
        let u = run
            .units
            .get_mut(unit)
            .ok_or_else(|| ParallelError::Config(format!("FSDP unit {unit} does not exist")))?;
        let param = u.params.len();
        let node = Unshard {
            fsdp: Arc::downgrade(&self.inner),
            unit,
            param,
            initial: Mutex::new(Some(initial)),
        };
        let full_t = shard.as_tensor().apply_op1(node)?;
        let offset = u.block;
        u.block += f * row;
        u.params.push(UParam {
            name: name.to_string(),
            shape,
            rows,
            row,
            padded: f * row,
            offset,
            shard: shard.clone(),
            full: full_t.clone(),
        });
        u.state.grads.push(None);
        u.state.accum.push(None);
        u.state.unsharded = true;
        let held = storage::held_bytes(&full_t);
        run.unsharded_bytes += held;
        Ok((shard, full_t))
    }

    /// This rank's rows of a parameter with `rows` rows (dim 0 of its tensor-parallel-local
    /// piece): `(count, offset)`, torch.chunk over the shard group as [`Fsdp::add_param`] cuts
    /// them. An empty shard reports `(0, rows)`.
    pub fn shard_rows(&self, rows: usize) -> (usize, usize) {
        shard_size_and_offset(rows, self.inner.shard.size(), self.inner.shard.rank())
    }

    /// Number of units.
    pub fn num_units(&self) -> usize {
        self.run().units.len()
    }

    /// Every parameter's name with its shard var, in creation order (empty shards included).
    pub fn named_shards(&self) -> Vec<(String, Var)> {
        self.run()
            .units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| (p.name.clone(), p.shard.clone())))
            .collect()
    }

    /// Bytes of unsharded parameter storage currently held by unit `unit` (0 when released).
    pub fn unit_allocated_bytes(&self, unit: usize) -> usize {
        let run = self.run();
        run.units
            .get(unit)
            .map(|u| u.params.iter().map(|p| storage::held_bytes(&p.full)).sum())
            .unwrap_or(0)
    }

    /// Bytes of the largest single unsharded parameter (compute dtype).
    pub fn largest_param_bytes(&self) -> usize {
        self.run()
            .units
            .iter()
            .flat_map(|u| {
                u.params
                    .iter()
                    .map(|p| p.rows * p.row * p.full.dtype().size_in_bytes())
            })
            .max()
            .unwrap_or(0)
    }

    /// Bytes of the largest unit's unsharded parameters (compute dtype).
    pub fn largest_unit_bytes(&self) -> usize {
        let dtype_bytes = |p: &UParam| p.full.dtype().size_in_bytes();
        self.run()
            .units
            .iter()
            .map(|u| {
                u.params
                    .iter()
                    .map(|p| p.rows * p.row * dtype_bytes(p))
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// Issues the all_gather of `unit` if it is neither unsharded nor in flight.
    fn start_gather(&self, unit: usize) -> Result<()> {
        let mut run = self.run();
        let Some(u) = run.units.get_mut(unit) else {
            return Ok(());
        };
        if u.state.unsharded || u.state.pending_ag.is_some() || u.params.is_empty() {
            return Ok(());
        }
        let dtype = u.params[0].full.dtype();
        let mut parts = Vec::with_capacity(2 * u.params.len());
        for p in &u.params {
            let s = p
                .shard
                .as_tensor()
                .detach()
                .flatten_all()?
                .to_dtype(dtype)?;
            let pad = p.padded - s.elem_count();
            parts.push(s);
            if pad > 0 {
                parts.push(Tensor::zeros(pad, dtype, p.full.device())?);
            }
        }
        let send = Tensor::cat(&parts, 0)?;
        let bytes = send.elem_count() * dtype.size_in_bytes() * self.inner.shard.size();
        debug::record("all_gather", &self.inner.dim_name, bytes as u64);
        u.state.pending_ag = Some(self.inner.shard.all_gather_single(&send)?);
        run.stats.all_gathers += 1;
        Ok(())
    }

    /// Makes `unit`'s full parameters available (waiting for a prefetched gather).
    fn unshard(&self, unit: usize) -> Result<()> {
        self.start_gather(unit)?;
        let (work, n, block) = {
            let mut run = self.run();
            let Some(u) = run.units.get_mut(unit) else {
                return Ok(());
            };
            if u.state.unsharded {
                return Ok(());
            }
            match u.state.pending_ag.take() {
                Some(w) => (w, self.inner.shard.size(), u.block),
                None => return Ok(()),
            }
        };
        let t0 = Instant::now();
        let gathered = work.wait()?;
        let waited = t0.elapsed().as_secs_f64() * 1e3;
        let mut run = self.run();
        run.stats.exposed_comm_ms += waited;
        let mut added = 0;
        let u = &mut run.units[unit];
        for p in &u.params {
            let segs: Vec<(usize, usize)> = (0..n)
                .map(|r| {
                    let (s, _) = shard_size_and_offset(p.rows, n, r);
                    (r * block + p.offset, s * p.row)
                })
                .collect();
            let before = storage::held_bytes(&p.full);
            storage::refill_from_segments(&p.full, &gathered, &segs)?;
            added += storage::held_bytes(&p.full).saturating_sub(before);
        }
        u.state.unsharded = true;
        run.unsharded_bytes += added;
        run.stats.peak_unsharded_bytes = run.stats.peak_unsharded_bytes.max(run.unsharded_bytes);
        Ok(())
    }

    /// Releases `unit`'s full parameter storage (parameters already released are skipped).
    fn reshard(&self, unit: usize) -> Result<()> {
        let mut run = self.run();
        let Some(u) = run.units.get_mut(unit) else {
            return Ok(());
        };
        let mut freed = 0;
        for p in &u.params {
            freed += release(p)?;
        }
        u.state.unsharded = false;
        run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed);
        Ok(())
    }

    /// Releases every unit's full parameters (e.g. right after building a model whose forward
    /// drives every unit, so no unit stays gathered until its first use).
    ///
    /// # Errors
    ///
    /// A failed release.
    pub fn reshard_all(&self) -> Result<()> {
        for unit in 0..self.num_units() {
            self.reshard(unit)?;
        }
        self.run().stats.peak_unsharded_bytes = 0;
        Ok(())
    }

    /// Gathers every unit no wrapper drives (collective over the shard group, in unit order):
    /// what their modules read outside any FSDP hook. Called by the first driven forward of a
    /// step and by [`FsdpOptimizer::step`].
    ///
    /// # Errors
    ///
    /// A failed collective.
    pub fn gather_undriven(&self) -> Result<()> {
        let undriven: Vec<usize> = self
            .run()
            .units
            .iter()
            .enumerate()
            .filter(|(_, u)| !u.driven && !u.state.unsharded && !u.params.is_empty())
            .map(|(i, _)| i)
            .collect();
        for &u in &undriven {
            self.start_gather(u)?;
        }
        for &u in &undriven {
            self.unshard(u)?;
        }
        Ok(())
    }

    /// Gradient accumulation: with `sync` off, every following backward only adds each
    /// parameter's unsharded gradient into a per-rank f32 accumulator (no collective); the next
    /// backward with `sync` on (the step's last micro-batch) adds the accumulators into its
    /// gradients and reduces each unit once, and [`Fsdp::finish_backward`] puts the shard
    /// gradients of the whole step into the `GradStore`. FSDP2's `set_requires_gradient_sync`;
    /// on by default. Forwards are allowed between such backwards (the parameters did not
    /// change); an [`FsdpOptimizer`] step is refused while accumulated gradients are unreduced.
    /// [`Fsdp::finish_backward`] called with sync off reduces what was accumulated.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.run().sync = sync;
    }

    /// Whether backwards reduce the gradients (see [`Fsdp::set_requires_gradient_sync`]).
    pub fn requires_gradient_sync(&self) -> bool {
        self.run().sync
    }

    /// Whether gradients accumulated with sync off wait for their reduction.
    pub fn has_accumulated_grads(&self) -> bool {
        self.run().accumulated
    }

    fn check_no_open_backward(&self, what: &str) -> Result<()> {
        if self.run().backward_open {
            return Err(ParallelError::Config(format!(
                "FSDP: {what} while the previous backward's gradients were never reduced: call \
                 `fsdp.backward(&loss)` (or `finish_backward(&mut grads)` after `loss.backward()`) \
                 before the optimizer step"
            )));
        }
        Ok(())
    }

    /// Before `unit`'s forward: gather it (or wait for its prefetch) and prefetch the next one.
    /// The first forward of a step also gathers every unit no wrapper drives.
    ///
    /// # Errors
    ///
    /// The previous backward was never finished ([`Fsdp::finish_backward`]), or a collective
    /// failed.
    pub fn pre_forward(&self, unit: usize) -> Result<()> {
        self.check_no_open_backward("a forward started")?;
        let _g = debug::label(&self.unit_name(unit));
        self.gather_undriven()?;
        self.unshard(unit)?;
        if self.inner.cfg.prefetch {
            let next = {
                let run = self.run();
                (unit + 1..run.units.len()).find(|&i| run.units[i].driven)
            };
            if let Some(next) = next {
                self.start_gather(next)?;
            }
        }
        Ok(())
    }

    /// The unit before `unit` whose backward re-gathers it (driven and resharded after its
    /// forward): the one worth prefetching. A gather of any other unit would not be consumed
    /// in this backward and would hold values from before the optimizer step.
    fn previous_regathered(&self, unit: usize) -> Option<usize> {
        let run = self.run();
        (0..unit)
            .rev()
            .find(|&i| run.units[i].driven && run.units[i].reshard_after_forward)
    }

    fn unit_name(&self, unit: usize) -> String {
        self.run()
            .units
            .get(unit)
            .map(|u| format!("fsdp.{}", u.name))
            .unwrap_or_default()
    }

    /// After `unit`'s forward: release its parameters (unless it is the last unit or
    /// `reshard_after_forward` is off) and return `out` behind an identity whose backward
    /// re-gathers the unit before any of its backward ops run.
    pub fn post_forward(&self, unit: usize, out: &Tensor) -> Result<Tensor> {
        let reshard = self
            .run()
            .units
            .get(unit)
            .is_some_and(|u| u.reshard_after_forward);
        if !reshard {
            return Ok(out.clone());
        }
        self.reshard(unit)?;
        if !out.track_op() {
            return Ok(out.clone());
        }
        Ok(out.apply_op1(PreBackward {
            fsdp: Arc::downgrade(&self.inner),
            unit,
        })?)
    }

    /// Runs `f` as `unit`'s forward: [`Fsdp::pre_forward`], `f`, [`Fsdp::post_forward`] on
    /// its output. A candle error inside `f` caused by a released parameter (one used outside
    /// its own unit) becomes [`ParallelError::ReleasedParameter`], naming what is released.
    ///
    /// # Errors
    ///
    /// As [`Fsdp::pre_forward`], `f`'s own errors, and the case above.
    pub fn forward(
        &self,
        unit: usize,
        f: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        self.pre_forward(unit)?;
        let y = match f() {
            Ok(y) => y,
            Err(e) if is_released_use(&e) => return Err(self.released_error(unit, &e)),
            Err(e) => return Err(e.into()),
        };
        self.post_forward(unit, &y)
    }

    fn released_error(&self, unit: usize, e: &candle_core::Error) -> ParallelError {
        let run = self.run();
        let released: Vec<String> = run
            .units
            .iter()
            .flat_map(|u| u.params.iter())
            .filter(|p| storage::is_released(&p.full))
            .map(|p| p.name.clone())
            .collect();
        ParallelError::ReleasedParameter {
            unit: run
                .units
                .get(unit)
                .map(|u| u.name.clone())
                .unwrap_or_default(),
            released,
            candle: e.to_string(),
        }
    }

    /// Called by a full parameter's backward with its complete gradient.
    fn stash_grad(&self, unit: usize, param: usize, grad: &Tensor) -> Result<()> {
        let complete = {
            let mut run = self.run();
            let sync = run.sync;
            let acc_bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
            let prior = run.units[unit].state.accum[param].take();
            let freed_acc = prior.as_ref().map_or(0, acc_bytes);
            let (grad, extra) = match (sync, prior) {
                // The step's last micro-batch: its gradient plus what the others accumulated.
                (true, Some(acc)) => {
                    let g = (acc + grad.to_dtype(DType::F32)?)?;
                    let b = acc_bytes(&g);
                    (g, b)
                }
                (true, None) => (grad.clone(), acc_bytes(grad)),
                (false, prior) => {
                    let g = grad.to_dtype(DType::F32)?;
                    let g = match prior {
                        Some(acc) => (acc + g)?,
                        None => g,
                    };
                    let b = acc_bytes(&g);
                    (g, b)
                }
            };
            run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed_acc) + extra;
            run.stats.peak_unsharded_bytes =
                run.stats.peak_unsharded_bytes.max(run.unsharded_bytes);
            if !sync {
                // Accumulate only: no reduction until a backward with sync on.
                run.accumulated = true;
                let u = &mut run.units[unit];
                u.state.accum[param] = Some(grad);
                let freed = release(&u.params[param])?;
                u.state.unsharded = false;
                let undriven = (!u.driven).then(|| u.params[param].name.clone());
                run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed);
                if let Some(name) = undriven {
                    run.undriven_used.insert(name);
                }
                return Ok(());
            }
            run.backward_open = true;
            let u = &mut run.units[unit];
            u.state.grads[param] = Some(grad);
            // Every consumer of this parameter has run its backward (candle calls a node's
            // backward after all of them): its full storage can go now, not at the unit's end.
            let freed = release(&u.params[param])?;
            u.state.unsharded = false;
            let complete = u.state.grads.iter().all(Option::is_some);
            let undriven = (!u.driven).then(|| u.params[param].name.clone());
            run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed);
            if let Some(name) = undriven {
                run.undriven_used.insert(name);
            }
            complete
        };
        if complete {
            self.reduce_unit(unit)?;
        }
        Ok(())
    }

    /// Issues the reduce_scatter of `unit`'s stashed gradients. Each rank's block carries, after
    /// its gradient rows, one flag per parameter (1 where this rank had a gradient), so the
    /// reduction tells every rank which parameters got a gradient anywhere at no extra cost.
    /// Missing gradients count as zero in the sum.
    fn reduce_unit(&self, unit: usize) -> Result<()> {
        let n = self.inner.shard.size();
        let had: Vec<bool>;
        let (send, grad_bytes) = {
            let mut run = self.run();
            let u = &mut run.units[unit];
            if u.state.reducing || u.params.is_empty() {
                return Ok(());
            }
            u.state.reducing = true;
            let mut grad_bytes = 0;
            // A gradient accumulated by an earlier micro-batch counts as one: it is reduced
            // with this step's gradients.
            for (g, acc) in u.state.grads.iter_mut().zip(u.state.accum.iter_mut()) {
                if g.is_none() {
                    *g = acc.take();
                }
            }
            had = u.state.grads.iter().map(Option::is_some).collect();
            let device = u.params[0].full.device().clone();
            let flags: Vec<f32> = had.iter().map(|&h| f32::from(u8::from(h))).collect();
            let flags = Tensor::from_vec(flags, u.params.len(), &device)?;
            // Rank-major: for each rank r, every parameter's rows of r padded to its block,
            // then the flags.
            let mut parts: Vec<Tensor> = Vec::with_capacity(n * (u.params.len() * 2 + 1));
            let grads: Vec<Tensor> = u
                .params
                .iter()
                .zip(u.state.grads.iter_mut())
                .map(|(p, g)| {
                    let g = match g.take() {
                        Some(g) => {
                            grad_bytes += g.elem_count() * g.dtype().size_in_bytes();
                            g
                        }
                        None => Tensor::zeros(p.shape.as_slice(), DType::F32, p.full.device())?,
                    };
                    g.to_dtype(DType::F32)?.flatten_all()
                })
                .collect::<candle_core::Result<_>>()?;
            for r in 0..n {
                for (p, g) in u.params.iter().zip(&grads) {
                    let (s, off) = shard_size_and_offset(p.rows, n, r);
                    parts.push(g.narrow(0, off * p.row, s * p.row)?);
                    let pad = p.padded - s * p.row;
                    if pad > 0 {
                        parts.push(Tensor::zeros(pad, DType::F32, g.device())?);
                    }
                }
                parts.push(flags.clone());
            }
            (Tensor::cat(&parts, 0)?, grad_bytes)
        };
        let op = self.grad_reduce_op();
        debug::record(
            "reduce_scatter",
            &self.inner.dim_name,
            (send.elem_count() * 4) as u64,
        );
        let work = self.inner.rs.reduce_scatter_single(&send, op)?;
        {
            let mut run = self.run();
            run.stats.reduce_scatters += 1;
            run.unsharded_bytes = run.unsharded_bytes.saturating_sub(grad_bytes);
            run.pending_rs.push((unit, Reduction::Scatter(work)));
        }
        self.start_replicate_reductions(false)?;
        // Release what this rank's backward used; a parameter nobody computed a gradient for
        // keeps its (still current) values until `finish_backward` knows that for all ranks.
        let mut run = self.run();
        let mut freed = 0;
        let u = &mut run.units[unit];
        for (p, &had) in u.params.iter().zip(&had) {
            if had {
                freed += release(p)?;
            }
        }
        u.state.unsharded = u.params.iter().all(|p| !storage::is_released(&p.full));
        run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed);
        Ok(())
    }

    fn grad_reduce_op(&self) -> ReduceOp {
        match self.inner.cfg.grad_reduce {
            GradReduce::Sum => ReduceOp::Sum,
            GradReduce::Avg => ReduceOp::Avg,
        }
    }

    /// HSDP: issues the replicate-dim all_reduce of every unit whose reduce_scatter finished
    /// (all of them, waiting in issue order, when `wait` is set), so the all_reduces run on
    /// their own communicator while backward continues, instead of one after another at the end.
    fn start_replicate_reductions(&self, wait: bool) -> Result<()> {
        let Some(rep) = &self.inner.replicate else {
            return Ok(());
        };
        let op = self.grad_reduce_op();
        let pending = std::mem::take(&mut self.run().pending_rs);
        let mut next = Vec::with_capacity(pending.len());
        let mut waited = 0.0;
        let mut failed = None;
        for (unit, r) in pending {
            match r {
                Reduction::Scatter(work) if failed.is_none() && (wait || work.is_completed()) => {
                    let t0 = Instant::now();
                    let reduced = work.wait();
                    waited += t0.elapsed().as_secs_f64() * 1e3;
                    match reduced.and_then(|t| {
                        debug::record("all_reduce", rep.name(), (t.elem_count() * 4) as u64);
                        rep.all_reduce(&t, op)
                    }) {
                        Ok(w) => next.push((unit, Reduction::Replicate(w))),
                        Err(e) => failed = Some(e),
                    }
                }
                other => next.push((unit, other)),
            }
        }
        let mut run = self.run();
        run.stats.exposed_comm_ms += waited;
        // Reductions issued meanwhile (none today: one compute thread) stay behind ours.
        next.append(&mut run.pending_rs);
        run.pending_rs = next;
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// After `loss.backward()`: reduces every unit whose gradients are not all in, waits for
    /// the reductions (HSDP: all_reduce over the replicate dim), and puts each shard's gradient
    /// into `grads`. A parameter that got a gradient on no rank gets none (candle-nn optimizers
    /// then skip it, as on one device); those are reported once. One host read (the
    /// gradient-presence flags of every unit); [`Fsdp::finish_backward_deferred`] and
    /// [`Fsdp::apply_grad_flags`] let a caller read them together with its own values.
    ///
    /// # Errors
    ///
    /// A failed collective.
    pub fn finish_backward(&self, grads: &mut GradStore) -> Result<()> {
        let pending = self.finish_backward_deferred(grads)?;
        let flags = match pending.flags() {
            Some(t) => {
                candle_dtensor_kernels::storage::note_host_read();
                t.to_vec1::<f32>()?
            }
            None => Vec::new(),
        };
        self.apply_grad_flags(grads, pending, &flags)
    }

    /// [`Fsdp::finish_backward`] without its host read: every reduced shard gradient goes into
    /// `grads`, including those of parameters that got a gradient on no rank (zeros, which
    /// add nothing to a norm and stay zero under clipping). The returned flags, read on the
    /// host by the caller (with whatever else it reads), go to [`Fsdp::apply_grad_flags`]
    /// before the optimizer step, which takes those gradients out again.
    ///
    /// # Errors
    ///
    /// A failed collective.
    pub fn finish_backward_deferred(&self, grads: &mut GradStore) -> Result<PendingGradFlags> {
        let units = self.num_units();
        for unit in 0..units {
            let needs = {
                let run = self.run();
                let u = &run.units[unit];
                !u.state.reducing && !u.params.is_empty()
            };
            // (reduce_unit also takes the accumulators of gradient accumulation.)
            if needs {
                self.reduce_unit(unit)?;
            }
        }
        self.start_replicate_reductions(true)?;
        // A gather still in flight holds values from before the coming optimizer step: finish
        // it (every rank issued it) and drop it.
        let stale: Vec<Work<Tensor>> = self
            .run()
            .units
            .iter_mut()
            .filter_map(|u| u.state.pending_ag.take())
            .collect();
        for w in stale {
            w.wait()?;
        }
        let pending = std::mem::take(&mut self.run().pending_rs);
        let mut reduced_units = Vec::with_capacity(pending.len());
        for (unit, r) in pending {
            let t0 = Instant::now();
            let reduced = match r {
                Reduction::Scatter(work) | Reduction::Replicate(work) => work.wait()?,
            };
            self.run().stats.exposed_comm_ms += t0.elapsed().as_secs_f64() * 1e3;
            reduced_units.push((unit, reduced));
        }
        // Every unit's gradient-presence flags in one tensor (one read, not one per unit).
        let run = self.run();
        let slices = reduced_units
            .iter()
            .map(|(unit, reduced)| {
                let u = &run.units[*unit];
                reduced.narrow(0, u.block, u.params.len())
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flags = if slices.is_empty() {
            None
        } else {
            Some(Tensor::cat(&slices, 0)?.to_dtype(DType::F32)?)
        };
        let mut units = Vec::with_capacity(reduced_units.len());
        for (unit, reduced) in reduced_units {
            let u = &run.units[unit];
            for p in &u.params {
                let len = p.shard.elem_count();
                if len == 0 {
                    continue;
                }
                let g = reduced
                    .narrow(0, p.offset, len)?
                    .reshape(p.shard.shape())?
                    .to_dtype(p.shard.dtype())?;
                grads.insert(&p.shard, g);
            }
            units.push((unit, u.params.len()));
        }
        Ok(PendingGradFlags { flags, units })
    }

    /// Completes [`Fsdp::finish_backward_deferred`] with its flags read on the host (`flags`:
    /// [`PendingGradFlags::flags`] as f32 values, empty when it had none): the gradients of
    /// parameters that got one on no rank leave `grads` again, and the others' unsharded
    /// values are released.
    ///
    /// # Errors
    ///
    /// `flags` does not have one value per parameter of the reduced units.
    pub fn apply_grad_flags(
        &self,
        grads: &mut GradStore,
        pending: PendingGradFlags,
        flags: &[f32],
    ) -> Result<()> {
        let want: usize = pending.units.iter().map(|&(_, n)| n).sum();
        if flags.len() != want {
            return Err(ParallelError::Config(format!(
                "FSDP: {} gradient-presence flags given for {want} parameters of {} reduced units",
                flags.len(),
                pending.units.len()
            )));
        }
        let mut without = Vec::new();
        let mut at = 0;
        for (unit, n) in pending.units {
            let mut run = self.run();
            let mut freed = 0;
            let u = &mut run.units[unit];
            for (p, &flag) in u.params.iter().zip(&flags[at..at + n]) {
                if flag <= 0.0 {
                    grads.remove(&p.shard);
                    without.push(p.name.clone());
                    continue;
                }
                // Another rank's gradient changes this shard at the next step: values this
                // rank still holds unsharded would be stale.
                freed += release(p)?;
            }
            at += n;
            u.state.reducing = false;
            u.state.unsharded = u.params.iter().all(|p| !storage::is_released(&p.full));
            run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed);
        }
        self.report(without);
        Ok(())
    }

    /// `loss.backward()` and [`Fsdp::finish_backward`] in one call: the gradients of every
    /// parameter (reduced shards for FSDP's, local ones for the rest).
    ///
    /// # Errors
    ///
    /// A failed backward or collective.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut grads = loss.backward()?;
        self.finish_backward(&mut grads)?;
        Ok(grads)
    }

    /// The one-time warnings of a finished backward.
    fn report(&self, without: Vec<String>) {
        let mut run = self.run();
        run.backward_open = false;
        run.accumulated = false;
        if !without.is_empty() && !run.warned_without_grad {
            run.warned_without_grad = true;
            tracing::warn!(
                params = %without.join(", "),
                "FSDP: {} parameter(s) got no gradient on any rank and get none (as on one \
                 device). If they should train, the graph was cut: candle-nn's fused \
                 `ops::rms_norm`, `ops::layer_norm`, `ops::softmax_last_dim`, \
                 `rotary_emb::rope*` and `ops::sdpa` (used by `RmsNorm`/`LayerNorm::forward` \
                 and candle-transformers models) have no backward (candle#2168, #3011); use \
                 the differentiable drop-ins of `candle_dtensor::nn`",
                without.len()
            );
        }
        run.without_grad = without;
        if !run.undriven_used.is_empty() && !run.warned_undriven {
            run.warned_undriven = true;
            let names: Vec<String> = std::mem::take(&mut run.undriven_used).into_iter().collect();
            tracing::warn!(
                params = %names.join(", "),
                "FSDP: parameters were used outside any wrapped forward. They are released \
                 after each backward and gathered again only by a wrapped forward \
                 (`FsdpVarMap::wrap`, `Fsdp::forward`) or an `FsdpOptimizer` step; otherwise \
                 their next use fails. Their forward saves no memory: wrap the modules that \
                 use them"
            );
        }
        run.undriven_used.clear();
    }

    /// Parameters that got a gradient on no rank in the last backward.
    pub fn params_without_grad(&self) -> Vec<String> {
        self.run().without_grad.clone()
    }

    /// Returns and resets the statistics.
    pub fn take_stats(&self) -> FsdpStats {
        std::mem::take(&mut self.run().stats)
    }

    /// Wraps `opt` so that each step checks the gradients were reduced and then gathers the
    /// units no wrapper drives (see [`FsdpOptimizer`]).
    pub fn optimizer<O: candle_nn::Optimizer>(&self, opt: O) -> FsdpOptimizer<O> {
        FsdpOptimizer {
            inner: opt,
            fsdp: self.clone(),
        }
    }
}

/// A candle-nn optimizer stepping FSDP shards: [`FsdpOptimizer::step`] refuses gradients that
/// FSDP has not reduced (a forgotten `finish_backward` would otherwise leave the optimizer
/// doing nothing), and after the step gathers every unit no wrapper drives, so plain candle
/// modules used outside any wrapper see the updated parameters at their next use.
pub struct FsdpOptimizer<O> {
    inner: O,
    fsdp: Fsdp,
}

impl<O: candle_nn::Optimizer> FsdpOptimizer<O> {
    /// One step on `grads` (from [`Fsdp::backward`] or `finish_backward`).
    ///
    /// # Errors
    ///
    /// Unreduced gradients, or the optimizer's or a collective's failure.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.fsdp.check_no_open_backward("an optimizer step")?;
        if self.fsdp.has_accumulated_grads() {
            return Err(ParallelError::Config(
                "FSDP: an optimizer step while gradients accumulated with gradient sync off \
                 were never reduced: run the step's last backward with \
                 `set_requires_gradient_sync(true)` and `finish_backward`"
                    .into(),
            ));
        }
        self.inner.step(grads)?;
        self.fsdp.gather_undriven()
    }

    /// [`Fsdp::backward`] then [`FsdpOptimizer::step`].
    ///
    /// # Errors
    ///
    /// As both.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = self.fsdp.backward(loss)?;
        self.step(&grads)
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutably (e.g. to change its learning rate).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }
}
