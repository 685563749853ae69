//! FSDP (ZeRO-3) for candle: parameters, gradients and optimizer state live as dim-0 shards;
//! a unit's full parameters exist only while the unit computes.
//!
//! # How it works on candle
//!
//! - Each parameter has a *shard* `Var` (this rank's torch.chunk rows of dim 0, in the master
//!   dtype; the optimizer updates only these) and a *full* tensor, a graph node over the shard
//!   created once ([`Unshard`]). The full tensor's storage is released after the unit's forward
//!   and refilled in place before use, so every view the model keeps of it sees the refill.
//! - Forward ([`Fsdp::pre_forward`] / [`Fsdp::post_forward`]): one flat all_gather per unit
//!   (every parameter's padded shard packed into one buffer), the next unit's gather issued
//!   ahead (prefetch), storage freed after the unit (`reshard_after_forward`), and an identity
//!   node on the unit's output whose backward re-gathers the unit and prefetches the previous
//!   one (the pre-backward hook; candle runs it before every node inside the unit).
//! - Backward: each full parameter's node runs once, after all its consumers, with its complete
//!   gradient; it stashes it and returns nothing. When a unit's last gradient arrives, one flat
//!   reduce_scatter is issued asynchronously (on its own communicator with
//!   `separate_reduce_scatter_group`, so it overlaps the next all_gather instead of queueing
//!   behind it) and the unit's storage is released. [`Fsdp::finish_backward`] waits for the
//!   reductions (HSDP: then all_reduces over the replicate dim) and puts each shard's gradient
//!   into the `GradStore`, where candle-nn optimizers find it.
//! - Mixed precision: full parameters (and so the compute) in `param_dtype`, shards and the
//!   gradient reduction in f32.
//!
//! Gradient scaling: a DTensor loss is already the global mean (its backward scales each rank's
//! contribution), so the shards' gradients are the SUM of the contributions
//! ([`GradReduce::Sum`]); plain candle code whose loss is each rank's local mean uses
//! [`GradReduce::Avg`] (PyTorch's default).

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, Var};
use candle_dtensor_comm::{Comm, ReduceOp, Work};
use candle_dtensor_core::debug;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::shard_size_and_offset;

use crate::error::{ModelError, Result};

/// How shard gradients are combined across the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradReduce {
    /// Sum the contributions: for DTensor losses, which are global means already.
    Sum,
    /// Average: for losses that are each rank's local mean (plain candle code).
    Avg,
}

/// FSDP settings.
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// Mesh dim the parameters are sharded over.
    pub shard_dim: usize,
    /// HSDP: mesh dim over which the shards are replicated (gradients all-reduced over it after
    /// the reduce_scatter).
    pub replicate_dim: Option<usize>,
    /// Release non-root units' full parameters after their forward (re-gathered in backward).
    pub reshard_after_forward: bool,
    /// Give reduce_scatter its own communicator so it overlaps all_gathers.
    pub separate_reduce_scatter_group: bool,
    /// Compute dtype of the full parameters (`None`: the master dtype).
    pub param_dtype: Option<DType>,
    /// Issue the next unit's all_gather before it is needed.
    pub prefetch: bool,
    /// How gradients are combined.
    pub grad_reduce: GradReduce,
}

impl FsdpConfig {
    /// Defaults: reshard after forward, prefetch, no separate reduce-scatter group, no mixed
    /// precision, summed gradients.
    pub fn new(shard_dim: usize) -> Self {
        FsdpConfig {
            shard_dim,
            replicate_dim: None,
            reshard_after_forward: true,
            separate_reduce_scatter_group: false,
            param_dtype: None,
            prefetch: true,
            grad_reduce: GradReduce::Sum,
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
    grads: Vec<Option<Tensor>>,
    reducing: bool,
}

struct Unit {
    name: String,
    params: Vec<UParam>,
    block: usize,
    /// Release the full parameters after this unit's forward (re-gathered before backward).
    reshard_after_forward: bool,
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

fn msg(s: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(s.into())
}

fn storage_of(dtype: DType, n: usize) -> candle_core::Result<CpuStorage> {
    use half::{bf16, f16};
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(vec![0f32; n]),
        DType::F64 => CpuStorage::F64(vec![0f64; n]),
        DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
        DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
        other => {
            return Err(msg(format!(
                "FSDP parameters must be floating point, got {other:?}"
            )))
        }
    })
}

/// The full parameter as a graph node over its shard: born with released storage; its
/// backward hands the complete gradient to FSDP and returns nothing for the shard (FSDP puts
/// the reduced shard gradient into the `GradStore` itself).
struct Unshard {
    fsdp: Weak<Inner>,
    unit: usize,
    param: usize,
    shape: Shape,
    dtype: DType,
}

impl CustomOp1 for Unshard {
    fn name(&self) -> &'static str {
        "fsdp-unshard"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((storage_of(self.dtype, 0)?, self.shape.clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        if let Some(inner) = self.fsdp.upgrade() {
            let f = Fsdp { inner };
            let _b = debug::enter_backward(Some(&f.unit_name(self.unit)));
            f.stash_grad(self.unit, self.param, grad)
                .map_err(candle_core::Error::wrap)?;
        }
        Ok(None)
    }
}

/// Identity whose backward re-gathers a unit (and prefetches the previous one).
struct PreBackward {
    fsdp: Weak<Inner>,
    unit: usize,
}

impl CustomOp1 for PreBackward {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let mut out = storage_of(s.dtype(), l.shape().elem_count())?;
        s.copy_strided_src(&mut out, 0, l)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        if let Some(inner) = self.fsdp.upgrade() {
            let f = Fsdp { inner };
            let _b = debug::enter_backward(Some(&f.unit_name(self.unit)));
            f.unshard(self.unit).map_err(candle_core::Error::wrap)?;
            if self.unit > 0 && f.inner.cfg.prefetch {
                f.start_gather(self.unit - 1)
                    .map_err(candle_core::Error::wrap)?;
            }
        }
        Ok(Some(grad.clone()))
    }
}

/// Releases a full parameter's storage; returns the bytes freed (0 if already released).
fn release(p: &UParam) -> candle_core::Result<usize> {
    let held = cpu_len(&p.full) * p.full.dtype().size_in_bytes();
    if held > 0 {
        set_storage(&p.full, storage_of(p.full.dtype(), 0)?)?;
    }
    Ok(held)
}

/// Swaps a tensor's storage for another (release: an empty one; refill: the gathered data).
struct SetStorage(Mutex<Option<CpuStorage>>);

impl candle_core::InplaceOp1 for SetStorage {
    fn name(&self) -> &'static str {
        "fsdp-set-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        let new = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| msg("storage already used"))?;
        *storage = new;
        Ok(())
    }
}

fn set_storage(t: &Tensor, s: CpuStorage) -> candle_core::Result<()> {
    t.inplace_op1(&SetStorage(Mutex::new(Some(s))))
}

fn cpu_len(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(c) => match c {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            _ => 0,
        },
        _ => 0,
    }
}

/// Concatenates, for each rank's segment `(start, len)` of `src` (a contiguous tensor), the
/// elements into a new storage of `dtype` (= `src`'s).
fn gather_segments(src: &Tensor, segs: &[(usize, usize)]) -> candle_core::Result<CpuStorage> {
    let (s, layout) = src.storage_and_layout();
    let base = layout
        .contiguous_offsets()
        .ok_or_else(|| msg("expected a contiguous buffer"))?
        .0;
    macro_rules! seg {
        ($v:expr, $variant:ident) => {{
            let total: usize = segs.iter().map(|s| s.1).sum();
            let mut out = Vec::with_capacity(total);
            for &(a, n) in segs {
                out.extend_from_slice(&$v[base + a..base + a + n]);
            }
            CpuStorage::$variant(out)
        }};
    }
    Ok(match &*s {
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => seg!(v, F32),
        candle_core::Storage::Cpu(CpuStorage::F64(v)) => seg!(v, F64),
        candle_core::Storage::Cpu(CpuStorage::BF16(v)) => seg!(v, BF16),
        candle_core::Storage::Cpu(CpuStorage::F16(v)) => seg!(v, F16),
        _ => return Err(msg("FSDP buffers must be floating point CPU tensors")),
    })
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
            Some(d) => Some(mesh.comm(d)?.clone()),
            None => None,
        };
        let rs = if cfg.separate_reduce_scatter_group {
            let ranks: Vec<usize> = (0..shard.size()).collect();
            shard
                .split(&ranks, &format!("{}_rs", shard.name()))?
                .ok_or_else(|| {
                    ModelError::Config("reduce-scatter split returned no communicator".into())
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
                }),
            }),
        })
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

    /// Starts a new unit (e.g. one transformer block) and returns its index. Units are
    /// numbered in forward order (prefetching follows it). `last` marks the unit that runs last
    /// in forward and first in backward (e.g. the final norm and head): it is kept after its
    /// forward, as re-gathering it right away would be wasted work.
    pub fn add_unit(&self, name: &str, last: bool) -> usize {
        let mut run = self.run();
        let reshard = self.inner.cfg.reshard_after_forward && !last;
        run.units.push(Unit {
            name: name.to_string(),
            params: Vec::new(),
            block: 0,
            reshard_after_forward: reshard,
            state: UnitState::default(),
        });
        run.units.len() - 1
    }

    /// Shards `full` (this rank's whole, e.g. tensor-parallel-local, parameter) into `unit` and
    /// returns `(shard var, full tensor)`. The full tensor starts released.
    pub fn add_param(&self, unit: usize, full: &Tensor) -> Result<(Var, Tensor)> {
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
        let mut run = self.run();
        let u = run
            .units
            .get_mut(unit)
            .ok_or_else(|| ModelError::Config(format!("FSDP unit {unit} does not exist")))?;
        let param = u.params.len();
        let node = Unshard {
            fsdp: Arc::downgrade(&self.inner),
            unit,
            param,
            shape: Shape::from_dims(&shape),
            dtype,
        };
        let full_t = shard.as_tensor().apply_op1(node)?;
        let offset = u.block;
        u.block += f * row;
        u.params.push(UParam {
            shape,
            rows,
            row,
            padded: f * row,
            offset,
            shard: shard.clone(),
            full: full_t.clone(),
        });
        u.state.grads.push(None);
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

    /// Bytes of unsharded parameter storage currently held by unit `unit` (0 when released).
    pub fn unit_allocated_bytes(&self, unit: usize) -> usize {
        let run = self.run();
        run.units
            .get(unit)
            .map(|u| {
                u.params
                    .iter()
                    .map(|p| cpu_len(&p.full) * p.full.dtype().size_in_bytes())
                    .sum()
            })
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
            let storage = gather_segments(&gathered, &segs)?;
            set_storage(&p.full, storage)?;
            added += p.rows * p.row * p.full.dtype().size_in_bytes();
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

    /// Before `unit`'s forward: gather it (or wait for its prefetch) and prefetch the next one.
    pub fn pre_forward(&self, unit: usize) -> Result<()> {
        let _g = debug::label(&self.unit_name(unit));
        self.unshard(unit)?;
        if self.inner.cfg.prefetch && unit + 1 < self.num_units() {
            self.start_gather(unit + 1)?;
        }
        Ok(())
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

    /// Called by a full parameter's backward with its complete gradient.
    fn stash_grad(&self, unit: usize, param: usize, grad: &Tensor) -> Result<()> {
        let complete = {
            let mut run = self.run();
            let extra = grad.elem_count() * grad.dtype().size_in_bytes();
            run.unsharded_bytes += extra;
            run.stats.peak_unsharded_bytes =
                run.stats.peak_unsharded_bytes.max(run.unsharded_bytes);
            let u = &mut run.units[unit];
            u.state.grads[param] = Some(grad.clone());
            // Every consumer of this parameter has run its backward (candle calls a node's
            // backward after all of them): its full storage can go now, not at the unit's end.
            let freed = release(&u.params[param])?;
            let complete = u.state.grads.iter().all(Option::is_some);
            run.unsharded_bytes = run.unsharded_bytes.saturating_sub(freed);
            complete
        };
        if complete {
            self.reduce_unit(unit)?;
        }
        Ok(())
    }

    /// Issues the reduce_scatter of `unit`'s stashed gradients (missing ones count as zero)
    /// and releases its storage.
    fn reduce_unit(&self, unit: usize) -> Result<()> {
        let n = self.inner.shard.size();
        let (send, grad_bytes) = {
            let mut run = self.run();
            let u = &mut run.units[unit];
            if u.state.reducing || u.params.is_empty() {
                return Ok(());
            }
            u.state.reducing = true;
            let mut grad_bytes = 0;
            // Rank-major: for each rank r, every parameter's rows of r padded to its block.
            let mut parts: Vec<Tensor> = Vec::with_capacity(n * u.params.len() * 2);
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
            }
            (Tensor::cat(&parts, 0)?, grad_bytes)
        };
        let op = match self.inner.cfg.grad_reduce {
            GradReduce::Sum => ReduceOp::Sum,
            GradReduce::Avg => ReduceOp::Avg,
        };
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
        self.reshard(unit)
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

    /// After `loss.backward()`: reduces every unit whose gradients are not all in (unused
    /// parameters get zero), waits for the reductions (HSDP: all_reduce over the replicate
    /// dim), and puts each shard's gradient into `grads`.
    pub fn finish_backward(&self, grads: &mut GradStore) -> Result<()> {
        let units = self.num_units();
        for unit in 0..units {
            let needs = {
                let run = self.run();
                let u = &run.units[unit];
                !u.state.reducing && !u.params.is_empty()
            };
            if needs {
                self.reduce_unit(unit)?;
            }
        }
        self.start_replicate_reductions(true)?;
        let pending = std::mem::take(&mut self.run().pending_rs);
        for (unit, r) in pending {
            let t0 = Instant::now();
            let reduced = match r {
                Reduction::Scatter(work) | Reduction::Replicate(work) => work.wait()?,
            };
            let waited = t0.elapsed().as_secs_f64() * 1e3;
            let mut run = self.run();
            run.stats.exposed_comm_ms += waited;
            let u = &mut run.units[unit];
            for p in &u.params {
                let len = p.shard.elem_count();
                let g = reduced
                    .narrow(0, p.offset, len)?
                    .reshape(p.shard.shape())?
                    .to_dtype(p.shard.dtype())?;
                grads.insert(&p.shard, g);
            }
            u.state.reducing = false;
        }
        Ok(())
    }

    /// Returns and resets the statistics.
    pub fn take_stats(&self) -> FsdpStats {
        std::mem::take(&mut self.run().stats)
    }
}
