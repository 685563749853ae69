//! A training loop for your own model: [`Trainer`] takes the parameters of any candle-nn model
//! (plain on one device, FSDP-sharded through an [`FsdpVarMap`], tensor-parallel through
//! [`tp_nn`](candle_dtensor_parallel::tp_nn), or a [`ParamStore`] of DTensor parameters) and runs the step around the
//! user's forward: backward with FSDP's gradient reduction, the global gradient norm and
//! clipping, the learning rate of an [`LrSchedule`], the AdamW step (weight decay per
//! [`WeightDecay`]), and a [`StepInfo`] per step (loss, rate, gradient norm, phase times,
//! exposed communication, memory). [`Trainer::fit`] is the whole loop with data and periodic
//! evaluation.
//!
//! A user-written candle-nn model trained under FSDP over two ranks, with warmup, cosine decay
//! and clipping (the README's example):
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::mesh::DeviceMesh;
//! use candle_dtensor::parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
//! use candle_dtensor::parallel::fsdp_vb::FsdpVarMap;
//! use candle_dtensor::train::fit::{FitOptions, TrainVars, Trainer, TrainerConfig};
//! use candle_dtensor::train::schedule::{Decay, LrSchedule};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!     LocalWorld::run(2, |comm| {
//!         let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
//!         // FSDP over dp; each rank's loss is the mean over its rows of the batch: average.
//!         let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
//!         let map = FsdpVarMap::new(&fsdp, 0);
//!         let vars = TrainVars::fsdp(&mesh, &fsdp, &map, DType::F32);
//!         let vb = vars.var_builder()?;
//!         // The user's model: plain candle-nn layers, each one FSDP unit.
//!         let l1 = map.wrap("l1", candle_nn::linear(8, 32, vb.pp("l1"))?)?;
//!         let l2 = map.wrap("l2", candle_nn::linear(32, 1, vb.pp("l2"))?)?;
//!         let schedule = LrSchedule::new(3e-2, 5, Decay::Cosine, 40, 1e-3)?; // warmup, cosine
//!         let cfg = TrainerConfig { schedule: Some(schedule), clip: Some(1.0), ..Default::default() };
//!         let mut trainer = Trainer::new(vars, cfg)?;
//!         // This rank's 4 rows of the batch, and the target y = sum(x).
//!         let x = (Tensor::arange(0f32, 32.0, &Device::Cpu)? + 32.0 * mesh.rank() as f64)?;
//!         let x = (x * 0.37)?.sin()?.reshape((4, 8))?;
//!         let y = x.sum_keepdim(1)?;
//!         let report = trainer.fit(
//!             40,
//!             |_step| Ok((x.clone(), y.clone())),
//!             |(x, y)| candle_nn::loss::mse(&l2.forward(&l1.forward(x)?.relu()?)?, y),
//!             FitOptions::new().on_step(|s| assert!(s.grad_norm.is_some())), // clipping: a norm
//!         )?;
//!         let losses = report.losses(); // every step's global mean loss, the same on each rank
//!         assert!(losses[39] < 0.2 * losses[0], "{losses:?}");
//!         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//!     })?;
//!     Ok(())
//! }
//! ```
//!
//! # Parameters ([`TrainVars`])
//!
//! Build the model through [`TrainVars::var_builder`]: it records, for every parameter, its
//! name and global shape, and, for a tensor-parallel piece ([`PieceRequest`](candle_dtensor_parallel::init::PieceRequest), made
//! by [`tp_nn`](candle_dtensor_parallel::tp_nn)'s layers), which elements of the global parameter the rank holds.
//! [`Trainer::new`] then works out, with two all_gathers (the counts, then the keys), how many
//! ranks hold an identical copy of each rank's variable: FSDP shards of one piece are disjoint
//! (summed), a parameter replicated over a mesh dim (HSDP's `replicate`, a norm's weight under
//! tensor parallelism) is counted once. So the gradient norm is exactly one device's, on any mesh.
//!
//! # The loss and the gradients
//!
//! The forward closure returns this rank's loss (one element). With FSDP and
//! [`GradReduce::Avg`] (plain candle code: each rank's loss is the mean over its rows) the
//! shard gradients are averaged by FSDP and the reported loss is averaged over FSDP's data
//! dims (shard, then replicate); with [`GradReduce::Sum`] (DTensor losses, already global) it
//! is read as it is. Without FSDP the gradients are used as they are: one device, or tensor
//! parallelism where every rank computes the whole loss (there is no plain data parallelism
//! without FSDP here).
//!
//! # Gradient accumulation
//!
//! [`Trainer::step_accum`] / [`Trainer::forward_backward_accum`] (and [`Trainer::fit_accum`]
//! with [`TrainerConfig::grad_accum`]) split a step's batch into `K` micro-batches, run
//! forward and backward on each in turn and make one optimizer update. The step's loss is the
//! mean over ALL its tokens whatever `K` is: micro-batch `i`'s mean loss is scaled by its
//! share of the step's tokens, `tokens[i] / sum(tokens)` (not by `1 / K`, which is wrong as
//! soon as micro-batches hold different numbers of real tokens), so the same tokens split any
//! way give the same gradients and loss as one batch. FSDP's reduce-scatter (and HSDP's
//! all-reduce) runs once per step: the first `K - 1` backwards only accumulate each rank's
//! unsharded gradients ([`Fsdp::set_requires_gradient_sync`]), which costs one unsharded
//! gradient of the model in memory between micro-batches.
//!
//! # Checkpoints
//!
//! [`Trainer::save`] writes the parameters and AdamW's state (moments, step count) in
//! [`crate::checkpoint`]'s distributed format, the one a [`ParamStore`] writes: every rank
//! writes the boxes of the global parameters it holds (one rank per identical copy: the lowest
//! of the ranks [`Trainer::new`] found holding it), rank 0 the manifest, last. The boxes come
//! from what [`TrainVars::var_builder`] recorded (global shape, tensor-parallel piece) and
//! FSDP's torch.chunk rows of dim 0. [`Trainer::load`] and [`Trainer::resume`] read a
//! checkpoint of any layout into this one (FSDP `dp=2` saved, one device or `dp=4` resumed)
//! and continue at its step; [`FitOptions::checkpoint`] makes [`Trainer::fit`] save every N
//! steps and continue from the latest complete checkpoint. A corrupt or missing file is a
//! [`TrainerError::Checkpoint`] naming it (every chunk has a CRC-32).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_dtensor_comm::{CommError, ReduceOp, Work};
use candle_dtensor_kernels::multi_tensor::grad_norm_clip;
use candle_dtensor_kernels::profile::{Mark, Phases};
use candle_dtensor_mesh::{DeviceMesh, MeshError};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};

use candle_dtensor_models::ModelError;
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpStats, GradReduce};
use candle_dtensor_parallel::fsdp_vb::FsdpVarMap;
use candle_dtensor_parallel::init::{take_piece, with_piece};
use candle_dtensor_parallel::params::{boxes_of, fsdp_boxes, ParamStore, VarBox};
use candle_dtensor_parallel::ParallelError;

use crate::checkpoint::{
    self, CheckpointError, CheckpointVar, LoadInfo, SaveInfo, StoreCheckpoint, Which,
};
use crate::optim::AdamW;
use crate::schedule::{Decay, LrSchedule, ScheduleError, WeightDecay};

/// Why a [`Trainer`] cannot be built or cannot train.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// The learning-rate schedule breaks one of its rules (e.g. warmup longer than the run).
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A setting breaks a rule.
    #[error("trainer: {field} = {value} breaks the rule: {rule}")]
    Config {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: String,
        /// The rule.
        rule: &'static str,
    },
    /// The parameters cannot be trained as given (created outside the tracking
    /// `VarBuilder`, ranks holding different parameters, no parameters).
    #[error("trainer: parameters: {0}")]
    Params(String),
    /// Sharding (FSDP), a tensor-parallel layer, a collective or a candle op failed (boxed:
    /// [`ParallelError`] is large).
    #[error(transparent)]
    Parallel(Box<ParallelError>),
    /// A DTensor model's own forward failed (e.g. the GPT's; boxed: [`ModelError`] is large).
    #[error(transparent)]
    Model(Box<ModelError>),
    /// Saving or loading a checkpoint failed (a missing or corrupt file, another model's
    /// checkpoint, ...): the error names the file and the tensor.
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),
}

impl From<CheckpointError> for TrainerError {
    fn from(e: CheckpointError) -> Self {
        TrainerError::Checkpoint(Box::new(e))
    }
}

impl From<ParallelError> for TrainerError {
    fn from(e: ParallelError) -> Self {
        TrainerError::Parallel(Box::new(e))
    }
}

/// A model error that is a parallelism one ([`ModelError::Parallel`]) becomes
/// [`TrainerError::Parallel`].
impl From<ModelError> for TrainerError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Parallel(p) => TrainerError::Parallel(p),
            m => TrainerError::Model(Box::new(m)),
        }
    }
}

/// Recovers a typed error carried through candle ops (FSDP's, a model's).
impl From<candle_core::Error> for TrainerError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::from(e).into()
    }
}

impl From<CommError> for TrainerError {
    fn from(e: CommError) -> Self {
        ParallelError::from(e).into()
    }
}

impl From<MeshError> for TrainerError {
    fn from(e: MeshError) -> Self {
        ParallelError::from(e).into()
    }
}

/// `Result` with [`TrainerError`].
pub type Result<T, E = TrainerError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------
// Parameters.

/// One parameter a [`Trainer`] optimizes.
#[derive(Debug, Clone)]
pub struct TrainParam {
    /// The parameter's name (`l1.weight`).
    pub name: String,
    /// What the optimizer updates: this rank's FSDP shard, tensor-parallel piece, or the whole
    /// parameter (possibly empty: an FSDP rank past the end of a small parameter's rows).
    pub var: Var,
    /// The shape of the whole (single-device) parameter, for the weight-decay policy.
    pub global_dims: Vec<usize>,
    /// How many ranks hold an identical copy of `var` (1 on one device): its squared norm is
    /// divided by this in the global gradient norm.
    pub copies: usize,
}

/// What [`TrainVars::var_builder`] saw of one parameter.
#[derive(Debug, Clone)]
struct Created {
    name: String,
    global: Vec<usize>,
    /// The global indices per dim of a tensor-parallel piece (`None`: the whole parameter).
    piece: Option<Vec<Vec<usize>>>,
}

type Log = Arc<Mutex<Vec<Created>>>;

fn lock(log: &Log) -> std::sync::MutexGuard<'_, Vec<Created>> {
    log.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `VarBuilder` backend that records what it creates, then lets `inner` create it.
struct Tracking {
    inner: VarBuilder<'static>,
    log: Log,
}

impl SimpleBackend for Tracking {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        // A tensor-parallel layer's request for its piece: note it, and hand it on.
        let piece = take_piece(s.dims());
        let prefix = self.inner.prefix();
        let created = Created {
            // The name the inner builder's backend sees.
            name: if prefix.is_empty() {
                name.to_string()
            } else {
                format!("{prefix}.{name}")
            },
            global: piece
                .as_ref()
                .map_or_else(|| s.dims().to_vec(), |p| p.global.clone()),
            piece: piece.as_ref().map(|p| p.indices.clone()),
        };
        let t = match piece {
            Some(p) => with_piece(p, || self.inner.get_with_hints_dtype(s, name, h, dtype))?,
            None => self.inner.get_with_hints_dtype(s, name, h, dtype)?,
        };
        let mut log = lock(&self.log);
        if !log.iter().any(|c| c.name == created.name) {
            log.push(created);
        }
        Ok(t)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.inner.get_unchecked_dtype(name, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

enum Source {
    Fsdp {
        mesh: DeviceMesh,
        fsdp: Fsdp,
        map: FsdpVarMap,
        dtype: DType,
    },
    Local {
        mesh: Option<DeviceMesh>,
        map: VarMap,
        vb: VarBuilder<'static>,
    },
    Given {
        mesh: Option<DeviceMesh>,
        fsdp: Option<Fsdp>,
        params: Vec<TrainParam>,
        /// Their checkpoint view, when known (a [`ParamStore`]'s).
        ckpt: Option<Vec<CheckpointVar>>,
    },
}

/// What [`TrainVars::resolve`] works out.
struct Resolved {
    mesh: Option<DeviceMesh>,
    fsdp: Option<Fsdp>,
    params: Vec<TrainParam>,
    /// The checkpoint view of `params` (same order), when the global boxes are known.
    ckpt: Option<Vec<CheckpointVar>>,
}

/// The parameters a [`Trainer`] trains, and the `VarBuilder` the model is built from (see the
/// module docs).
pub struct TrainVars {
    source: Source,
    log: Log,
}

impl TrainVars {
    /// Parameters created by `map` (FSDP shards over `fsdp`, on `mesh`) in `dtype`. Build the
    /// model from [`TrainVars::var_builder`]; wrap its modules with `map` as usual.
    pub fn fsdp(mesh: &DeviceMesh, fsdp: &Fsdp, map: &FsdpVarMap, dtype: DType) -> TrainVars {
        TrainVars {
            source: Source::Fsdp {
                mesh: mesh.clone(),
                fsdp: fsdp.clone(),
                map: map.clone(),
                dtype,
            },
            log: Log::default(),
        }
    }

    /// Parameters held whole (or as tensor-parallel pieces) in `map`, created through `vb`
    /// (e.g. the pair [`reference_var_builder`](candle_dtensor_parallel::fsdp_vb::reference_var_builder) returns, or
    /// `VarBuilder::from_varmap(&map, ..)`). `mesh`: `None` on one device; with tensor
    /// parallelism, the mesh whose ranks share the model.
    pub fn local(mesh: Option<&DeviceMesh>, map: &VarMap, vb: VarBuilder<'static>) -> TrainVars {
        TrainVars {
            source: Source::Local {
                mesh: mesh.cloned(),
                map: map.clone(),
                vb,
            },
            log: Log::default(),
        }
    }

    /// The parameters of a [`ParamStore`] (DTensor models such as [`Gpt`](candle_dtensor_models::Gpt); FSDP when
    /// the store shards with it). The store created them: [`TrainVars::var_builder`] is an
    /// error.
    pub fn store(store: &ParamStore) -> TrainVars {
        let params = store
            .params()
            .iter()
            .map(|p| TrainParam {
                name: p.name.clone(),
                var: p.var.clone(),
                global_dims: p.tensor.shape().to_vec(),
                copies: p.replicas.max(1),
            })
            .collect();
        TrainVars {
            source: Source::Given {
                mesh: Some(store.mesh().clone()),
                fsdp: store.fsdp().cloned(),
                params,
                ckpt: Some(store.checkpoint_vars()),
            },
            log: Log::default(),
        }
    }

    /// Parameters described by the caller: `copies` as [`TrainParam::copies`] says, the
    /// gradients reduced by `fsdp` when given. Their global boxes are unknown: such a trainer
    /// has no checkpoints ([`Trainer::save`] is an error).
    pub fn given(mesh: Option<&DeviceMesh>, fsdp: Option<&Fsdp>, params: Vec<TrainParam>) -> Self {
        TrainVars {
            source: Source::Given {
                mesh: mesh.cloned(),
                fsdp: fsdp.cloned(),
                params,
                ckpt: None,
            },
            log: Log::default(),
        }
    }

    /// The `VarBuilder` to build the model from: the map's (FSDP) or the given one, recording
    /// each parameter's global shape and tensor-parallel piece for the gradient norm.
    ///
    /// # Errors
    ///
    /// [`TrainerError::Params`] for [`TrainVars::store`] and [`TrainVars::given`], whose
    /// parameters exist already.
    pub fn var_builder(&self) -> Result<VarBuilder<'static>> {
        let inner = match &self.source {
            Source::Fsdp { map, dtype, .. } => map.var_builder(*dtype),
            Source::Local { vb, .. } => vb.clone(),
            Source::Given { .. } => {
                return Err(TrainerError::Params(
                    "these parameters exist already (a ParamStore or a given list); there is \
                     no VarBuilder to build a model from"
                        .into(),
                ))
            }
        };
        let (dtype, device) = (inner.dtype(), inner.device().clone());
        Ok(VarBuilder::from_backend(
            Box::new(Tracking {
                inner,
                log: self.log.clone(),
            }),
            dtype,
            device,
        ))
    }

    /// The parameters, with the copies of each worked out (collective over the mesh for
    /// tracked parameters).
    fn resolve(self) -> Result<Resolved> {
        let log = lock(&self.log).clone();
        let find = |name: &str| log.iter().find(|c| c.name == name);
        match self.source {
            Source::Given {
                mesh,
                fsdp,
                params,
                ckpt,
            } => Ok(Resolved {
                mesh,
                fsdp,
                params,
                ckpt,
            }),
            Source::Fsdp {
                mesh, fsdp, map, ..
            } => {
                let named = map.named_vars();
                untracked(named.iter().map(|(n, _)| n.as_str()), &log)?;
                let shards = fsdp.named_shards();
                if let Some((name, _)) = named.iter().find(|(n, v)| {
                    !shards
                        .iter()
                        .any(|(sn, sv)| sn == n && sv.as_tensor().id() == v.as_tensor().id())
                }) {
                    return Err(TrainerError::Params(format!(
                        "parameter {name} of the FsdpVarMap is not sharded by the Fsdp given \
                         (the map was made from another Fsdp)"
                    )));
                }
                let shard_coord = mesh.coordinate()[fsdp.config().shard_dim];
                let keys: Vec<(u64, u64)> = named
                    .iter()
                    .filter_map(|(n, _)| find(n))
                    .map(|c| keys_of(c, Some(shard_coord)))
                    .collect();
                let copies = copies_of(&mesh, &keys)?;
                let (params, ckpt) = tracked(named, &copies, &log, Some(&fsdp))?;
                Ok(Resolved {
                    mesh: Some(mesh),
                    fsdp: Some(fsdp),
                    params,
                    ckpt: Some(ckpt),
                })
            }
            Source::Local { mesh, map, .. } => {
                let mut named: Vec<(String, Var)> = map
                    .data()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                named.sort_by(|a, b| a.0.cmp(&b.0));
                let Some(mesh) = mesh else {
                    // One device: every parameter whole, held once, written by this process.
                    let mut params = Vec::with_capacity(named.len());
                    let mut ckpt = Vec::with_capacity(named.len());
                    for (name, var) in named {
                        let global_dims =
                            find(&name).map_or_else(|| var.dims().to_vec(), |c| c.global.clone());
                        let idx: Vec<Vec<usize>> =
                            var.dims().iter().map(|&n| (0..n).collect()).collect();
                        ckpt.push(CheckpointVar {
                            name: name.clone(),
                            var: var.clone(),
                            global_dims: global_dims.clone(),
                            boxes: boxes_of(&idx),
                            writer: true,
                        });
                        params.push(TrainParam {
                            global_dims,
                            name,
                            var,
                            copies: 1,
                        });
                    }
                    return Ok(Resolved {
                        mesh: None,
                        fsdp: None,
                        params,
                        ckpt: Some(ckpt),
                    });
                };
                untracked(named.iter().map(|(n, _)| n.as_str()), &log)?;
                let keys: Vec<(u64, u64)> = named
                    .iter()
                    .filter_map(|(n, _)| find(n))
                    .map(|c| keys_of(c, None))
                    .collect();
                let copies = copies_of(&mesh, &keys)?;
                let (params, ckpt) = tracked(named, &copies, &log, None)?;
                Ok(Resolved {
                    mesh: Some(mesh),
                    fsdp: None,
                    params,
                    ckpt: Some(ckpt),
                })
            }
        }
    }
}

/// The parameters of `named` (all tracked), with their copies and writers, and their
/// checkpoint view.
fn tracked(
    named: Vec<(String, Var)>,
    copies: &[Holding],
    log: &[Created],
    fsdp: Option<&Fsdp>,
) -> Result<(Vec<TrainParam>, Vec<CheckpointVar>)> {
    let mut params = Vec::with_capacity(named.len());
    let mut ckpt = Vec::with_capacity(named.len());
    for ((name, var), h) in named.into_iter().zip(copies) {
        let Some(c) = log.iter().find(|c| c.name == name) else {
            continue;
        };
        let boxes = boxes_for(c, fsdp);
        let held: usize = boxes.iter().map(VarBox::numel).sum();
        if held != var.elem_count() {
            return Err(TrainerError::Params(format!(
                "parameter {name}: this rank's var has {} elements but its place in the \
                 global {:?} has {held}",
                var.elem_count(),
                c.global
            )));
        }
        ckpt.push(CheckpointVar {
            name: name.clone(),
            var: var.clone(),
            global_dims: c.global.clone(),
            boxes,
            writer: h.writer,
        });
        params.push(TrainParam {
            global_dims: c.global.clone(),
            name,
            var,
            copies: h.copies,
        });
    }
    Ok((params, ckpt))
}

/// Where this rank's var of `c` sits in the global parameter: its tensor-parallel piece (or
/// the whole parameter), cut as [`ParamStore`]'s vars are ([`fsdp_boxes`]).
fn boxes_for(c: &Created, fsdp: Option<&Fsdp>) -> Vec<VarBox> {
    let idx: Vec<Vec<usize>> = c
        .piece
        .clone()
        .unwrap_or_else(|| c.global.iter().map(|&n| (0..n).collect()).collect());
    fsdp_boxes(&idx, fsdp)
}

/// An error naming the parameters of `names` that the tracking `VarBuilder` did not create.
fn untracked<'a>(names: impl Iterator<Item = &'a str>, log: &[Created]) -> Result<()> {
    let missing: Vec<&str> = names
        .filter(|n| !log.iter().any(|c| c.name == *n))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(TrainerError::Params(format!(
        "{} parameter(s) were created outside TrainVars::var_builder ({}{}): their global \
         shape and tensor-parallel piece are unknown, so the gradient norm cannot count them; \
         build the whole model from TrainVars::var_builder",
        missing.len(),
        missing[..missing.len().min(5)].join(", "),
        if missing.len() > 5 { ", ..." } else { "" }
    )))
}

/// FNV-1a, 64 bits: a hash that is the same in every process.
fn fnv(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= u64::from(*b);
        *h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
}

const FNV_START: u64 = 0xCBF2_9CE4_8422_2325;

/// `(name key, holding key)` of a created parameter: equal holding keys on two ranks mean
/// identical variables (the same piece, and the same FSDP shard of it).
fn keys_of(c: &Created, shard_coord: Option<usize>) -> (u64, u64) {
    let mut name = FNV_START;
    fnv(&mut name, c.name.as_bytes());
    let mut hold = name;
    for d in &c.global {
        fnv(&mut hold, &(*d as u64).to_le_bytes());
    }
    match &c.piece {
        None => fnv(&mut hold, b"whole"),
        Some(idx) => {
            for (d, ix) in idx.iter().enumerate() {
                fnv(&mut hold, &(d as u64).to_le_bytes());
                for i in ix {
                    fnv(&mut hold, &(*i as u64).to_le_bytes());
                }
            }
        }
    }
    if let Some(s) = shard_coord {
        fnv(&mut hold, b"shard");
        fnv(&mut hold, &(s as u64).to_le_bytes());
    }
    (name, hold)
}

/// How this rank holds one parameter's variable.
#[derive(Debug, Clone, Copy)]
struct Holding {
    /// Ranks holding an identical variable (this one included).
    copies: usize,
    /// Whether this rank is the lowest of them: the one that writes it into checkpoints.
    writer: bool,
}

/// How many ranks of `mesh` hold the same variable as this rank, per parameter, and whether
/// this rank is the lowest of them (an all_gather of the key counts, then of the keys; exact
/// integers: 52-bit keys travel as f64).
fn copies_of(mesh: &DeviceMesh, keys: &[(u64, u64)]) -> Result<Vec<Holding>> {
    let root = mesh.root_comm();
    let n = root.size();
    let me = root.rank();
    if n == 1 {
        return Ok(vec![
            Holding {
                copies: 1,
                writer: true,
            };
            keys.len()
        ]);
    }
    let dev = root.device();
    let to_f = |k: u64| (k >> 12) as f64;
    let count = Tensor::new(&[keys.len() as f64], dev)?;
    let counts = root.all_gather_single(&count)?.wait()?.to_vec1::<f64>()?;
    if counts.iter().any(|&c| c != keys.len() as f64) {
        return Err(TrainerError::Params(format!(
            "the ranks hold different numbers of parameters: {:?} (by rank)",
            counts.iter().map(|&c| c as usize).collect::<Vec<_>>()
        )));
    }
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let mine: Vec<f64> = keys.iter().flat_map(|&(a, b)| [to_f(a), to_f(b)]).collect();
    let all = root
        .all_gather_single(&Tensor::from_vec(mine.clone(), mine.len(), dev)?)?
        .wait()?
        .to_vec1::<f64>()?;
    let per = mine.len();
    let mut copies = vec![
        Holding {
            copies: 0,
            writer: true,
        };
        keys.len()
    ];
    for r in 0..n {
        let theirs = &all[r * per..(r + 1) * per];
        for (i, c) in copies.iter_mut().enumerate() {
            if theirs[2 * i] != mine[2 * i] {
                return Err(TrainerError::Params(format!(
                    "rank {r}'s parameter {i} has another name than this rank's (the ranks \
                     created their parameters in different orders or with different names)"
                )));
            }
            if theirs[2 * i + 1] == mine[2 * i + 1] {
                c.copies += 1;
                if r < me {
                    c.writer = false;
                }
            }
        }
    }
    Ok(copies)
}

// ---------------------------------------------------------------------------------------------
// Configuration and records.

/// Which optimizer steps the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// AdamW with candle-nn's math ([`crate::optim::AdamW`]).
    #[default]
    AdamW,
    /// Plain SGD (`candle_nn::SGD`): sensitive to the gradient scale, for exact comparisons.
    Sgd,
}

/// How a [`Trainer`] steps. [`TrainerConfig::default`]: AdamW with candle-nn's defaults
/// (lr 1e-3, betas 0.9 / 0.999, eps 1e-8, weight decay 0.01 on every parameter), no schedule,
/// no clipping.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerConfig {
    /// The learning rate at every step (ignored when `schedule` is set: its rates are used).
    pub lr: f64,
    /// The learning-rate schedule: the rate of step `k` is `schedule.lr_at(k)`, a function of
    /// the step index alone, so a run resumed at step `k` ([`Trainer::set_steps_done`])
    /// continues it exactly.
    pub schedule: Option<LrSchedule>,
    /// AdamW or SGD.
    pub optimizer: OptimizerKind,
    /// AdamW's beta1.
    pub beta1: f64,
    /// AdamW's beta2.
    pub beta2: f64,
    /// AdamW's eps.
    pub eps: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Which parameters decay (by name and global shape).
    pub decay_policy: WeightDecay,
    /// Scale the gradients so that their global norm is at most this.
    pub clip: Option<f64>,
    /// Without clipping, compute the global gradient norm every this many steps for
    /// [`StepInfo::grad_norm`] (0: never; it costs one all_reduce and one host read).
    pub grad_norm_every: usize,
    /// Tokens (or samples) per global step, reported in [`StepInfo::tokens`] (all
    /// micro-batches of the step together).
    pub tokens_per_step: usize,
    /// Gradient accumulation: micro-batches per optimizer step for [`Trainer::fit_accum`]
    /// (at least 1; default 1). [`Trainer::step_accum`] takes the count from its argument.
    pub grad_accum: usize,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        let p = ParamsAdamW::default();
        TrainerConfig {
            lr: p.lr,
            schedule: None,
            optimizer: OptimizerKind::AdamW,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            weight_decay: p.weight_decay,
            decay_policy: WeightDecay::All,
            clip: None,
            grad_norm_every: 0,
            tokens_per_step: 0,
            grad_accum: 1,
        }
    }
}

/// A loss must be one value.
fn check_loss(loss: &Tensor) -> Result<()> {
    if loss.elem_count() != 1 {
        return Err(bad(
            "loss",
            format!("a tensor of shape {:?}", loss.dims()),
            "the forward returns one value (this rank's mean loss)",
        ));
    }
    Ok(())
}

fn bad(field: &'static str, value: impl std::fmt::Display, rule: &'static str) -> TrainerError {
    TrainerError::Config {
        field,
        value: value.to_string(),
        rule,
    }
}

impl TrainerConfig {
    /// Checks every setting (and the schedule's rules, whose fields are public).
    ///
    /// # Errors
    ///
    /// [`TrainerError::Config`] naming the setting, its value and the rule, or
    /// [`TrainerError::Schedule`].
    pub fn validate(&self) -> Result<()> {
        let finite_nonneg = |v: f64| v.is_finite() && v >= 0.0;
        if !finite_nonneg(self.lr) {
            return Err(bad("lr", self.lr, "a finite number >= 0"));
        }
        if let Some(s) = &self.schedule {
            LrSchedule::new(s.lr, s.warmup, s.decay, s.steps, s.min_lr)?;
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return Err(bad("beta1", self.beta1, "0 <= beta1 < 1"));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return Err(bad("beta2", self.beta2, "0 <= beta2 < 1"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(bad("eps", self.eps, "a finite number > 0"));
        }
        if !finite_nonneg(self.weight_decay) {
            return Err(bad(
                "weight_decay",
                self.weight_decay,
                "a finite number >= 0",
            ));
        }
        if let Some(c) = self.clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(bad("clip", c, "a finite number > 0"));
            }
        }
        if self.grad_accum == 0 {
            return Err(bad(
                "grad_accum",
                0,
                "at least 1 micro-batch per optimizer step",
            ));
        }
        Ok(())
    }
}

/// The micro-batch size of gradient accumulation: `batch / grad_accum`, checked. Every rank
/// computes the same answer from the same settings, so a bad setting fails on every rank
/// before any step runs.
///
/// # Errors
///
/// [`TrainerError::Config`] naming `grad_accum`, both values and the rule, when `grad_accum`
/// is 0 or does not divide `batch`.
pub fn micro_batch_size(batch: usize, grad_accum: usize) -> Result<usize> {
    if grad_accum == 0 || !batch.is_multiple_of(grad_accum) {
        return Err(bad(
            "grad_accum",
            format!("{grad_accum} (global batch {batch})"),
            "grad_accum >= 1 and it divides the global batch: each optimizer step runs \
             grad_accum micro-batches of batch / grad_accum sequences",
        ));
    }
    Ok(batch / grad_accum)
}

/// One finished step.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    /// 0-based global step index (a resumed run starts at the checkpoint's step).
    pub step: usize,
    /// The global mean loss of the step.
    pub loss: f32,
    /// Wall time of the step (ms).
    pub step_ms: f64,
    /// Global tokens per step ([`TrainerConfig::tokens_per_step`]; all micro-batches).
    pub tokens: usize,
    /// Micro-batches run forward and backward before this step's one optimizer update
    /// (gradient accumulation; 1 without).
    pub micro_batches: usize,
    /// The learning rate the step used.
    pub lr: f64,
    /// The global gradient norm before clipping (computed when clipping, or when
    /// [`TrainerConfig::grad_norm_every`] asks for it on this step; `None` otherwise, since it
    /// costs one all_reduce and, on a GPU, one host read).
    pub grad_norm: Option<f64>,
    /// Milliseconds in forward (data to loss), backward (including FSDP's gradient reduction
    /// and clipping) and the optimizer step.
    pub phase_ms: [f64; 3],
    /// Milliseconds the compute thread waited on collectives in the step.
    pub exposed_comm_ms: f64,
    /// Peak bytes in parameters, gradients and optimizer state on this rank so far (this
    /// rank's variables, their gradients and optimizer state, plus FSDP's unsharded parameters
    /// and gradients in flight).
    pub peak_bytes: usize,
    /// Device-to-host reads this rank's step made (`kernels::storage::note_host_read`: the
    /// loss with the gradient norm, FSDP's gradient-presence flags, ...): each is a host
    /// synchronisation on a GPU. Not counted: reads inside candle's own ops and a backend's
    /// synchronisations inside its collectives.
    pub host_reads: usize,
    /// GPU time of the phases of the *previous* step (CUDA timing events on this rank's
    /// stream; `None` on the CPU and on the first step). One step late, because reading it
    /// now would wait for this step's optimizer; [`Trainer::last_gpu_phases`] gives the last
    /// step's at the end.
    pub gpu_phases: Option<GpuPhases>,
}

/// GPU milliseconds of one step's phases, split as [`StepInfo::phase_ms`] splits host time
/// (forward, backward with the gradient reduction and clipping, optimizer), measured between
/// CUDA timing events on the rank's stream: what the GPU spent, not what the host took to
/// queue it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuPhases {
    /// The step measured.
    pub step: usize,
    /// Forward, backward, optimizer (ms).
    pub phase_ms: [f64; 3],
}

/// The GPU timing marks of one step, kept until they can be read without waiting.
pub(crate) type StepMarks = Phases<Mark>;

/// Records a timing mark on `device` (`None` on the CPU). A failure to record only turns the
/// step's GPU times off (logged): timing never fails a step.
pub(crate) fn gpu_mark(device: &Device) -> Option<Mark> {
    match Mark::record(device) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "no GPU timing mark for this step");
            None
        }
    }
}

/// Records a mark on `device` into a timed step's `marks` with `put` (one of [`Phases`]'
/// setters); nothing when the step is not timed (the CPU, or its first mark failed).
pub(crate) fn gpu_mark_into(
    marks: &mut Option<StepMarks>,
    device: &Device,
    put: fn(&mut StepMarks, Mark),
) {
    if let Some(m) = marks.as_mut() {
        if let Some(s) = gpu_mark(device) {
            put(m, s);
        }
    }
}

/// Reads and forgets a pending step's GPU times (the step and its marks); `wait` first waits
/// for them (a host synchronisation), else a step whose marks the device has not reached yet
/// gives `None`. A failure to read only loses that step's times (logged).
pub(crate) fn take_gpu_phases(
    pending: &mut Option<(usize, StepMarks)>,
    wait: bool,
) -> Option<GpuPhases> {
    let (step, marks) = pending.take()?;
    let read = (|| {
        if wait {
            if let Some(end) = marks.end() {
                end.wait()?;
            }
        }
        marks.ms()
    })();
    match read {
        Ok(Some(phase_ms)) => Some(GpuPhases { step, phase_ms }),
        Ok(None) => {
            tracing::debug!(step, "GPU times not complete yet; skipped");
            None
        }
        Err(e) => {
            tracing::warn!(step, error = %e, "GPU times unreadable");
            None
        }
    }
}

/// The gradients of one step, reduced (and clipped), before the optimizer step:
/// [`Trainer::forward_backward`]'s result, for [`Trainer::apply`].
pub struct Gradients {
    grads: GradStore,
    /// The clip coefficient (f64 `[1]` on the device) not yet applied to `grads`: set only by
    /// the trainer's own steps ([`Trainer::step`], the run loop), which hand these gradients
    /// straight to [`Trainer::apply`], where AdamW multiplies them as it reads them. Gradients
    /// a caller sees ([`Trainer::forward_backward`]) are clipped already, and this is `None`.
    clip: Option<Tensor>,
    loss: f32,
    grad_norm: Option<f64>,
    clipped: bool,
    step: usize,
    micro_batches: usize,
    t0: Instant,
    /// Time in the forwards (all micro-batches).
    fwd: std::time::Duration,
    t_bwd: Instant,
    /// GPU timing marks of the step so far (CUDA only).
    marks: Option<StepMarks>,
}

impl Gradients {
    /// The gradients: FSDP's reduced shard gradients, or the local ones.
    pub fn grads(&self) -> &GradStore {
        &self.grads
    }

    /// The global mean loss.
    pub fn loss(&self) -> f32 {
        self.loss
    }

    /// The global gradient norm before clipping, when computed.
    pub fn grad_norm(&self) -> Option<f64> {
        self.grad_norm
    }

    /// Whether clipping scaled the gradients.
    pub fn clipped(&self) -> bool {
        self.clipped
    }

    /// Micro-batches these gradients were accumulated over (1 without accumulation).
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }
}

/// What [`Trainer::fit`] saw.
#[derive(Debug, Clone, Default)]
pub struct FitReport {
    /// Every step run, in order.
    pub steps: Vec<StepInfo>,
    /// Held-out loss after `n` steps, as `(n, loss)`.
    pub eval_losses: Vec<(usize, f32)>,
    /// The checkpoint step the run continued from ([`FitOptions::checkpoint`]).
    pub resumed_from: Option<usize>,
    /// The steps saved as checkpoints.
    pub saved: Vec<usize>,
}

impl FitReport {
    /// The loss of every step run.
    pub fn losses(&self) -> Vec<f32> {
        self.steps.iter().map(|s| s.loss).collect()
    }
}

/// An evaluation closure: this rank's held-out loss (one element).
type EvalFn<'a> = Box<dyn FnMut() -> candle_core::Result<Tensor> + 'a>;

/// A per-step callback.
type OnStep<'a> = Box<dyn FnMut(&StepInfo) + 'a>;

/// Options of [`Trainer::fit`].
#[derive(Default)]
pub struct FitOptions<'a> {
    eval: Option<(usize, EvalFn<'a>)>,
    on_step: Option<OnStep<'a>>,
    checkpoint: Option<(PathBuf, usize)>,
}

impl<'a> FitOptions<'a> {
    /// No evaluation, no callback.
    pub fn new() -> Self {
        Self::default()
    }

    /// After every `every` steps (and after the last), run `eval` (a forward only, returning
    /// this rank's held-out loss) and record the global mean in [`FitReport::eval_losses`].
    pub fn eval_every(
        mut self,
        every: usize,
        eval: impl FnMut() -> candle_core::Result<Tensor> + 'a,
    ) -> Self {
        self.eval = Some((every, Box::new(eval)));
        self
    }

    /// Checkpoints under `dir` ([`Trainer::save`]) after every `every` steps and after the
    /// last; before the first step, continue from the latest complete checkpoint under `dir`
    /// when it is later than [`Trainer::steps_done`] ([`Trainer::load`], any layout saved
    /// it). The schedule continues exactly: a rate is a function of the step. `dir` must be
    /// the same directory on every rank (shared).
    pub fn checkpoint(mut self, dir: impl Into<PathBuf>, every: usize) -> Self {
        self.checkpoint = Some((dir.into(), every));
        self
    }

    /// Call `f` after every step.
    pub fn on_step(mut self, f: impl FnMut(&StepInfo) + 'a) -> Self {
        self.on_step = Some(Box::new(f));
        self
    }
}

// ---------------------------------------------------------------------------------------------
// The trainer.

enum Opt {
    AdamW(AdamW),
    Sgd(candle_nn::SGD),
}

impl Opt {
    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Opt::AdamW(o) => o.set_learning_rate(lr),
            Opt::Sgd(o) => o.set_learning_rate(lr),
        }
    }

    /// One update; `clip`: a clip coefficient not yet applied to `grads` (only AdamW's steps
    /// are given one: [`Trainer::forward_backward_to_apply`]).
    fn step(&mut self, grads: &GradStore, clip: Option<&Tensor>) -> candle_core::Result<()> {
        match (self, clip) {
            (Opt::AdamW(o), clip) => o.step_clipped(grads, clip),
            (Opt::Sgd(o), None) => o.step(grads),
            (Opt::Sgd(_), Some(_)) => Err(candle_core::Error::Msg(
                "internal: SGD was given gradients whose clipping was deferred".into(),
            )),
        }
    }
}

/// A one-micro-batch step's forward as the accumulating loop's `forward(i)`.
fn one_micro_batch(
    forward: impl FnOnce() -> candle_core::Result<Tensor>,
) -> impl FnMut(usize) -> candle_core::Result<Tensor> {
    let mut forward = Some(forward);
    move |_| match forward.take() {
        Some(f) => f(),
        None => Err(candle_core::Error::Msg(
            "internal: the forward of a one-micro-batch step ran twice".into(),
        )),
    }
}

/// A reduction of the loss in flight.
enum LossRead {
    /// Read as it is.
    Local(Tensor),
    /// Averaged over the shard communicator, then (HSDP) the replicate one.
    Avg(Work<Tensor>, Option<candle_dtensor_comm::Comm>),
}

impl LossRead {
    /// The loss and, when given, `extra`'s one f64 value, in one host read.
    fn read_with(self, extra: Option<&Tensor>) -> Result<(f32, Option<f64>)> {
        let (loss, extra, _) = self.read_all(extra, None)?;
        Ok((loss, extra))
    }

    /// The loss, `extra`'s one f64 value and `flags`' f32 values (FSDP's gradient-presence
    /// flags), in one host read.
    fn read_all(
        self,
        extra: Option<&Tensor>,
        flags: Option<&Tensor>,
    ) -> Result<(f32, Option<f64>, Vec<f32>)> {
        let Some(flags) = flags else {
            let (loss, extra) = self.read_one(extra)?;
            return Ok((loss, extra, Vec::new()));
        };
        candle_dtensor_kernels::storage::note_host_read();
        let t = self.reduced()?;
        let mut parts = vec![t.to_dtype(DType::F64)?.reshape(1)?];
        if let Some(x) = extra {
            parts.push(x.to_dtype(DType::F64)?.reshape(1)?);
        }
        let n = flags.elem_count();
        parts.push(flags.to_dtype(DType::F64)?.reshape(n)?);
        let all = Tensor::cat(&parts, 0)?.to_vec1::<f64>()?;
        let k = 1 + usize::from(extra.is_some());
        // f32 -> f64 -> f32 is exact: each value reads as it would alone.
        Ok((
            all[0] as f32,
            extra.map(|_| all[1]),
            all[k..].iter().map(|&v| v as f32).collect(),
        ))
    }

    /// The loss tensor, its reduction finished.
    fn reduced(self) -> Result<Tensor> {
        Ok(match self {
            LossRead::Local(t) => t,
            LossRead::Avg(work, replicate) => {
                let t = work.wait()?;
                match replicate {
                    Some(c) => c.all_reduce(&t, ReduceOp::Avg)?.wait()?,
                    None => t,
                }
            }
        })
    }

    /// The loss and, when given, `extra`'s one f64 value, in one host read.
    fn read_one(self, extra: Option<&Tensor>) -> Result<(f32, Option<f64>)> {
        candle_dtensor_kernels::storage::note_host_read();
        let t = self.reduced()?;
        match extra {
            None => Ok((t.to_vec1::<f32>()?[0], None)),
            Some(x) => {
                // f32 -> f64 -> f32 is exact: the loss reads as it would alone.
                let both = Tensor::cat(&[&t.to_dtype(DType::F64)?.reshape(1)?, &x.reshape(1)?], 0)?
                    .to_vec1::<f64>()?;
                Ok((both[0] as f32, Some(both[1])))
            }
        }
    }
}

/// A gradient's sum of squares in f64, `[]` (an f64 copy of the gradient, squared and summed):
/// the CPU path of the global norm, and the CUDA path's for gradients the multi-tensor kernel
/// does not take.
fn sum_sq_f64(g: &Tensor) -> candle_core::Result<Tensor> {
    g.to_dtype(DType::F64)?.sqr()?.sum_all()
}

/// How [`local_sq_fused`] covers a list of gradients: `groups` (indices with one copies count
/// and one dtype, f32 or bf16: one multi-tensor launch pair each, in first-seen order; views
/// of one buffer, as FSDP's shard gradients of a unit are, included) and `single` (another
/// dtype). Empty gradients are in neither.
#[derive(Debug, PartialEq)]
struct NormPlan {
    groups: Vec<((usize, DType), Vec<usize>)>,
    single: Vec<usize>,
}

fn norm_plan(grads: &[(Tensor, usize)]) -> NormPlan {
    let mut plan = NormPlan {
        groups: Vec::new(),
        single: Vec::new(),
    };
    for (i, (g, copies)) in grads.iter().enumerate() {
        if g.elem_count() == 0 {
            continue;
        }
        if !matches!(g.dtype(), DType::F32 | DType::BF16) {
            plan.single.push(i);
            continue;
        }
        let key = (*copies, g.dtype());
        match plan.groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(i),
            None => plan.groups.push((key, vec![i])),
        }
    }
    plan
}

/// The sum over `grads` of each gradient's sum of squares divided by its copies, f64 `[1]` on
/// `device`, through the multi-tensor norm kernel (`kernels::multi_tensor::grad_norm_clip`: two
/// launches per [`norm_plan`] group, f32 sums, as PyTorch's foreach norm) instead of an f64 copy
/// of every gradient and about five launches each (740 a GPT-2 step). No host read.
pub(crate) fn local_sq_fused(grads: &[(Tensor, usize)], device: &Device) -> Result<Tensor> {
    let plan = norm_plan(grads);
    let mut total = Tensor::zeros(1, DType::F64, device)?;
    for ((copies, _), idx) in &plan.groups {
        let gs: Vec<Tensor> = idx.iter().map(|&i| grads[i].0.clone()).collect();
        let norm = grad_norm_clip(&gs, None)?
            .narrow(0, 0, 1)?
            .to_dtype(DType::F64)?;
        total = (total + (norm.sqr()? / *copies as f64)?)?;
    }
    for &i in &plan.single {
        let (g, copies) = &grads[i];
        total = (total + (sum_sq_f64(g)?.reshape(1)? / *copies as f64)?)?;
    }
    Ok(total)
}

/// The training step around a user's forward (see the module docs).
pub struct Trainer {
    params: Vec<TrainParam>,
    /// Per parameter, `copies` as an f64 scalar on the parameters' device.
    divisors: Vec<Tensor>,
    mesh: Option<DeviceMesh>,
    fsdp: Option<Fsdp>,
    device: Device,
    opt: Opt,
    cfg: TrainerConfig,
    step: usize,
    state_bytes: usize,
    peak_bytes: usize,
    last_fsdp: Option<FsdpStats>,
    /// The parameters as checkpoints see them (`None`: [`TrainVars::given`]).
    ckpt: Option<Vec<CheckpointVar>>,
    /// The last applied step's GPU timing marks, read one step later.
    pending_gpu: Option<(usize, StepMarks)>,
}

impl Trainer {
    /// A trainer of `vars` (after the model is built from [`TrainVars::var_builder`]).
    /// Collective over the mesh (two all_gathers) when the parameters were tracked on one.
    ///
    /// # Errors
    ///
    /// A setting or the schedule breaks a rule ([`TrainerConfig::validate`]), parameters
    /// created outside the tracking `VarBuilder` or different on the ranks, no parameters, or
    /// a failed collective.
    pub fn new(vars: TrainVars, cfg: TrainerConfig) -> Result<Trainer> {
        cfg.validate()?;
        let Resolved {
            mesh,
            fsdp,
            params,
            ckpt,
        } = vars.resolve()?;
        if params.is_empty() {
            return Err(TrainerError::Params(
                "no parameters: build the model from TrainVars::var_builder before \
                 Trainer::new"
                    .into(),
            ));
        }
        let device = params[0].var.device().clone();
        let divisors = params
            .iter()
            .map(|p| Tensor::new(p.copies as f64, &device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let vars: Vec<Var> = params
            .iter()
            .filter(|p| p.var.elem_count() > 0)
            .map(|p| p.var.clone())
            .collect();
        let lr = cfg.schedule.map_or(cfg.lr, |s| s.lr_at(0));
        let (opt, moments) = match cfg.optimizer {
            OptimizerKind::AdamW => {
                let mut opt = AdamW::new(
                    vars,
                    ParamsAdamW {
                        lr,
                        beta1: cfg.beta1,
                        beta2: cfg.beta2,
                        eps: cfg.eps,
                        weight_decay: cfg.weight_decay,
                    },
                )?;
                for p in &params {
                    opt.set_decay(&p.var, cfg.decay_policy.decays(&p.name, &p.global_dims));
                }
                (Opt::AdamW(opt), 2)
            }
            OptimizerKind::Sgd => (Opt::Sgd(candle_nn::SGD::new(vars, lr)?), 0),
        };
        let var_bytes: usize = params
            .iter()
            .map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes())
            .sum();
        // Not part of the first step's measurements.
        let _ = candle_dtensor_core::debug::take_comm_wait();
        Ok(Trainer {
            params,
            divisors,
            mesh,
            fsdp,
            device,
            opt,
            cfg,
            step: 0,
            state_bytes: var_bytes * (2 + moments),
            peak_bytes: 0,
            last_fsdp: None,
            ckpt,
            pending_gpu: None,
        })
    }

    /// The parameters trained, with the copies of each.
    pub fn params(&self) -> &[TrainParam] {
        &self.params
    }

    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// Steps applied so far: the index of the next step.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// Continue at step `n` (after loading a checkpoint of step `n`): the schedule's rate of
    /// the next step is `lr_at(n)`.
    pub fn set_steps_done(&mut self, n: usize) {
        self.step = n;
    }

    /// The learning rate of step `step`.
    pub fn lr_at(&self, step: usize) -> f64 {
        self.cfg.schedule.map_or(self.cfg.lr, |s| s.lr_at(step))
    }

    /// The AdamW optimizer (for its state, e.g. checkpoints); `None` with SGD.
    pub fn adamw(&self) -> Option<&AdamW> {
        match &self.opt {
            Opt::AdamW(o) => Some(o),
            Opt::Sgd(_) => None,
        }
    }

    /// The AdamW optimizer, mutably (loading a checkpoint); `None` with SGD.
    pub fn adamw_mut(&mut self) -> Option<&mut AdamW> {
        match &mut self.opt {
            Opt::AdamW(o) => Some(o),
            Opt::Sgd(_) => None,
        }
    }

    /// The parameters as checkpoints see them: each var's name, global shape, boxes of the
    /// global parameter and whether this rank writes it. `None` for [`TrainVars::given`].
    pub fn checkpoint_vars(&self) -> Option<&[CheckpointVar]> {
        self.ckpt.as_deref()
    }

    fn ckpt_vars(&self) -> Result<&[CheckpointVar]> {
        self.ckpt.as_deref().ok_or_else(|| {
            TrainerError::Params(
                "checkpoints need each parameter's place in the global tensor, which \
                 TrainVars::given does not describe; use TrainVars::fsdp, ::local or ::store"
                    .into(),
            )
        })
    }

    /// Saves the parameters and the optimizer's state (AdamW's moments and step count) as
    /// step [`Trainer::steps_done`] under `root`, in [`crate::checkpoint`]'s distributed
    /// format (every rank writes its own boxes, once per identical copy; rank 0 writes the
    /// manifest last), with caller data `extra`. Any layout loads it ([`Trainer::load`]).
    /// Collective: every rank calls it.
    ///
    /// # Errors
    ///
    /// [`TrainerError::Checkpoint`] (any rank's I/O error; no manifest is written then), or
    /// [`TrainerError::Params`] for a trainer of [`TrainVars::given`].
    pub fn save(&self, root: &Path, extra: &serde_json::Value) -> Result<SaveInfo> {
        let vars = self.ckpt_vars()?;
        let info = checkpoint::save_vars(
            root,
            self.step,
            self.mesh.as_ref(),
            vars,
            self.adamw(),
            extra,
        )?;
        tracing::info!(step = self.step, dir = %info.dir.display(), "checkpoint saved");
        Ok(info)
    }

    /// Loads checkpoint `which` under `root` (saved by any layout: resharded to this one) into
    /// the parameters and the optimizer's state, and continues at its step (the schedule's
    /// next rate is `lr_at(step)`). Collective.
    ///
    /// # Errors
    ///
    /// [`TrainerError::Checkpoint`]: no such checkpoint, a missing or corrupt file (named), a
    /// checksum mismatch, another model's shapes, dtypes or parameters. Nothing changes then.
    pub fn load(&mut self, root: &Path, which: Which) -> Result<LoadInfo> {
        let vars = self.ckpt_vars()?.to_vec();
        let mesh = self.mesh.clone();
        let opt = match &mut self.opt {
            Opt::AdamW(o) => Some(o),
            Opt::Sgd(_) => None,
        };
        let info = checkpoint::load_vars(root, which, mesh.as_ref(), &vars, opt)?;
        if let Some(f) = &self.fsdp {
            // Full parameters still gathered (initial values) are stale: the next forward
            // gathers the loaded shards.
            f.reshard_all()?;
        }
        self.step = info.step;
        tracing::info!(step = info.step, dir = %info.dir.display(), "checkpoint loaded");
        Ok(info)
    }

    /// Loads the latest complete checkpoint under `root` ([`Trainer::load`]), if there is
    /// one: `None` when `root` holds none (a fresh run). Collective.
    ///
    /// # Errors
    ///
    /// As [`Trainer::load`].
    pub fn resume(&mut self, root: &Path) -> Result<Option<LoadInfo>> {
        match self.load(root, Which::Latest) {
            Ok(info) => Ok(Some(info)),
            Err(TrainerError::Checkpoint(e))
                if matches!(*e, CheckpointError::NotFound { step: None, .. }) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// What FSDP measured in the last step (`None` without FSDP or before a step).
    pub fn last_fsdp_stats(&self) -> Option<FsdpStats> {
        self.last_fsdp
    }

    /// Starts reading `loss` as its global mean.
    fn start_loss(&self, loss: &Tensor) -> Result<LossRead> {
        check_loss(loss)?;
        let value = loss.detach().to_dtype(DType::F32)?.reshape(1)?;
        match (&self.fsdp, &self.mesh) {
            (Some(f), Some(mesh)) if f.config().grad_reduce == GradReduce::Avg => {
                let c = f.config();
                let work = mesh.comm(c.shard_dim)?.all_reduce(&value, ReduceOp::Avg)?;
                let replicate = match c.replicate_dim {
                    Some(d) => Some(mesh.comm(d)?.clone()),
                    None => None,
                };
                Ok(LossRead::Avg(work, replicate))
            }
            _ => Ok(LossRead::Local(value)),
        }
    }

    /// The global L2 norm of the gradients in `grads`, exactly as on one device (one
    /// all_reduce over the mesh, one host read). Collective: every rank calls it.
    ///
    /// # Errors
    ///
    /// A failed op or collective.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        candle_dtensor_kernels::storage::note_host_read();
        Ok(self.grad_norm_sq(grads)?.to_vec1::<f64>()?[0].sqrt())
    }

    /// The global sum of squares of the gradients (f64 `[1]` on the parameters' device, after
    /// the all_reduce over the mesh): [`Trainer::grad_norm`] without its host read.
    fn grad_norm_sq(&self, grads: &GradStore) -> Result<Tensor> {
        let local = if self.device.is_cuda() && candle_dtensor_kernels::fused::cuda_enabled() {
            let present: Vec<(Tensor, usize)> = self
                .params
                .iter()
                .filter_map(|p| grads.get(&p.var).map(|g| (g.clone(), p.copies)))
                .collect();
            local_sq_fused(&present, &self.device)?
        } else {
            let mut local: Option<Tensor> = None;
            for (p, div) in self.params.iter().zip(&self.divisors) {
                let Some(g) = grads.get(&p.var) else { continue };
                let sq = sum_sq_f64(g)?.broadcast_div(div)?;
                local = Some(match local {
                    None => sq,
                    Some(acc) => (acc + sq)?,
                });
            }
            match local {
                Some(t) => t.reshape(1)?,
                None => Tensor::zeros(1, DType::F64, &self.device)?,
            }
        };
        Ok(match &self.mesh {
            Some(m) if m.num_ranks() > 1 => {
                m.root_comm().all_reduce(&local, ReduceOp::Sum)?.wait()?
            }
            _ => local,
        })
    }

    /// Scales every gradient so that the global norm is at most `max_norm`, on the device: the
    /// factor `max_norm / (norm + 1e-6)` where the norm exceeds `max_norm`, else 1 (so an
    /// unclipped gradient is unchanged, bit for bit), computed and applied without a host read.
    /// Returns the global sum of squares before clipping (read with the loss) and, with
    /// `defer`, the factor (f64 `[1]`) instead of scaling the gradients (the optimizer applies
    /// it). Collective.
    fn clip(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        defer: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let sq = self.grad_norm_sq(grads)?;
        let norm = sq.sqrt()?;
        let over = norm.gt(max_norm)?;
        let dev = norm.device().clone();
        // max_norm / (norm + 1e-6): one division, as the host computed it.
        let factor = Tensor::full(max_norm, 1, &dev)?.div(&(norm + 1e-6)?)?;
        let one = Tensor::ones(1, DType::F64, &dev)?;
        let factor = over.where_cond(&factor, &one)?;
        if defer {
            return Ok((sq, Some(factor)));
        }
        let mut cast: Vec<(DType, Tensor)> = Vec::new();
        for p in &self.params {
            if let Some(g) = grads.get(&p.var) {
                // The factor in the gradient's dtype, cast once per dtype (f64 -> f32 as the
                // scalar `affine` the host path used).
                let f = match cast.iter().find(|(d, _)| *d == g.dtype()) {
                    Some((_, f)) => f.clone(),
                    None => {
                        // A scalar: a rank-0 gradient keeps its shape.
                        let f = factor.to_dtype(g.dtype())?.reshape(())?;
                        cast.push((g.dtype(), f.clone()));
                        f
                    }
                };
                let scaled = g.broadcast_mul(&f)?;
                grads.insert(&p.var, scaled);
            }
        }
        Ok((sq, None))
    }

    /// Forward (`forward`: this rank's loss), backward, FSDP's gradient reduction, the
    /// gradient norm and clipping: everything of a step before the optimizer's update, which
    /// [`Trainer::apply`] makes. Collective.
    ///
    /// # Errors
    ///
    /// The forward's error, a loss of more than one element, a failed backward or collective.
    pub fn forward_backward(
        &mut self,
        forward: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> Result<Gradients> {
        self.forward_backward_accum(&[1], one_micro_batch(forward))
    }

    /// Gradient accumulation: [`Trainer::forward_backward`] over `tokens.len()` micro-batches
    /// run one after the other, giving the gradients of the step's whole batch for ONE
    /// optimizer update ([`Trainer::apply`]). Collective.
    ///
    /// `forward(i)` returns micro-batch `i`'s loss, the mean over its own tokens (as the
    /// forward of [`Trainer::forward_backward`] does for a whole batch), and `tokens[i]` is that
    /// micro-batch's token count (global, over the data-parallel ranks, for a DTensor loss
    /// that is a global mean; this rank's with [`GradReduce::Avg`], whose ranks hold equal
    /// counts). **The loss is normalised as the mean over all tokens of the step, whatever
    /// the split**: micro-batch `i`'s loss is scaled by `tokens[i] / sum(tokens)` before its
    /// backward (not by `1 / K`), so micro-batches of unequal token counts (padding, masked
    /// tokens) weigh what they would in one large batch, and the gradients and the reported
    /// loss equal those of one batch of all the tokens (up to floating-point summation order).
    ///
    /// Reductions happen once per step, not per micro-batch: FSDP units run the first
    /// `K - 1` backwards with gradient sync off ([`Fsdp::set_requires_gradient_sync`]), adding
    /// their unsharded gradients into per-rank accumulators, and reduce-scatter (HSDP: then
    /// all-reduce) each unit once in the last backward; the loss is read (and averaged over
    /// ranks with [`GradReduce::Avg`]) once, the gradient norm and clipping run once on the
    /// accumulated gradients. Gradients a DTensor op reduces inside its own backward (the
    /// gradient rule's all_reduce of a replicated parameter without FSDP, tensor-parallel
    /// norms) are reduced in each micro-batch's backward. With one micro-batch this is exactly
    /// [`Trainer::forward_backward`].
    ///
    /// # Errors
    ///
    /// No micro-batch, or a total of 0 tokens ([`TrainerError::Config`]); any forward's error,
    /// a loss of more than one element, a failed backward or collective. After an error the
    /// FSDP accumulators may hold a partial step: rebuild or call
    /// [`Fsdp::finish_backward`] before going on.
    pub fn forward_backward_accum(
        &mut self,
        tokens: &[usize],
        forward: impl FnMut(usize) -> candle_core::Result<Tensor>,
    ) -> Result<Gradients> {
        self.forward_backward_steps(tokens, forward, false)
    }

    /// [`Trainer::forward_backward_accum`] for a step whose gradients go straight to
    /// [`Trainer::apply`], unseen: clipping, when configured, is left to the optimizer's update
    /// (AdamW; one pass over the gradients and, on CUDA, one launch per parameter fewer),
    /// with the same results.
    pub(crate) fn forward_backward_to_apply(
        &mut self,
        tokens: &[usize],
        forward: impl FnMut(usize) -> candle_core::Result<Tensor>,
    ) -> Result<Gradients> {
        let defer = matches!(self.opt, Opt::AdamW(_));
        self.forward_backward_steps(tokens, forward, defer)
    }

    /// The body of the two above; `defer_clip`: leave the clip coefficient to `apply`.
    fn forward_backward_steps(
        &mut self,
        tokens: &[usize],
        mut forward: impl FnMut(usize) -> candle_core::Result<Tensor>,
        defer_clip: bool,
    ) -> Result<Gradients> {
        let k = tokens.len();
        let total: usize = tokens.iter().sum();
        if k == 0 || total == 0 {
            return Err(bad(
                "micro-batch tokens",
                format!("{tokens:?}"),
                "at least one micro-batch and more than 0 tokens in the step",
            ));
        }
        let t0 = Instant::now();
        let mut marks = gpu_mark(&self.device).map(Phases::new);
        let mut fwd = std::time::Duration::ZERO;
        let mut acc: Option<(GradStore, Tensor)> = None;
        for (i, &n) in tokens.iter().enumerate() {
            let last = i + 1 == k;
            if let Some(f) = &self.fsdp {
                // Reduce only in the last micro-batch's backward.
                f.set_requires_gradient_sync(last);
            }
            let res = self.micro_step(
                &mut forward,
                (i, k),
                n as f64 / total as f64,
                &mut fwd,
                &mut marks,
            );
            let (g, l) = match res {
                Ok(x) => x,
                Err(e) => {
                    if let Some(f) = &self.fsdp {
                        f.set_requires_gradient_sync(true);
                    }
                    return Err(e);
                }
            };
            acc = Some(match acc {
                None => (g, l),
                Some((mut sum, sum_l)) => {
                    let mut g = g;
                    for p in &self.params {
                        if let Some(gi) = g.remove(&p.var) {
                            let total = match sum.get(&p.var) {
                                Some(a) => (a + gi)?,
                                None => gi,
                            };
                            sum.insert(&p.var, total);
                        }
                    }
                    (sum, (sum_l + l)?)
                }
            });
        }
        let Some((mut grads, loss)) = acc else {
            return Err(bad("micro-batch tokens", "[]", "at least one micro-batch"));
        };
        let read = self.start_loss(&loss)?;
        // FSDP's gradient-presence flags are read with the loss (one host read per step); until
        // then every reduced shard gradient is in `grads`, zeros where no rank had one.
        let flags = match &self.fsdp {
            Some(f) => Some(f.finish_backward_deferred(&mut grads)?),
            None => None,
        };
        // The norm (and clipping) stay on the device; the sum of squares is read with the loss,
        // in one host read.
        let mut clip = None;
        let norm_sq = match self.cfg.clip {
            Some(c) => {
                let (sq, factor) = self.clip(&mut grads, c, defer_clip)?;
                clip = factor;
                Some(sq)
            }
            None if self.cfg.grad_norm_every > 0
                && self.step.is_multiple_of(self.cfg.grad_norm_every) =>
            {
                Some(self.grad_norm_sq(&grads)?)
            }
            None => None,
        };
        let t_bwd = Instant::now();
        gpu_mark_into(&mut marks, &self.device, StepMarks::backward_end);
        let (loss, norm_sq, flag_values) =
            read.read_all(norm_sq.as_ref(), flags.as_ref().and_then(|p| p.flags()))?;
        if let (Some(f), Some(p)) = (&self.fsdp, flags) {
            f.apply_grad_flags(&mut grads, p, &flag_values)?;
        }
        let grad_norm = norm_sq.map(f64::sqrt);
        let clipped = matches!((self.cfg.clip, grad_norm), (Some(c), Some(n)) if n > c);
        Ok(Gradients {
            grads,
            clip,
            loss,
            grad_norm,
            clipped,
            step: self.step,
            micro_batches: k,
            t0,
            fwd,
            t_bwd,
            marks,
        })
    }

    /// Micro-batch `i` of `k`: its forward, the loss scaled by `weight` (its share of the
    /// step's tokens; unscaled when `k == 1`), its backward. Returns the gradients and the
    /// scaled loss (detached).
    fn micro_step(
        &self,
        forward: &mut impl FnMut(usize) -> candle_core::Result<Tensor>,
        (i, k): (usize, usize),
        weight: f64,
        fwd: &mut std::time::Duration,
        marks: &mut Option<StepMarks>,
    ) -> Result<(GradStore, Tensor)> {
        let t = Instant::now();
        gpu_mark_into(marks, &self.device, StepMarks::forward_start);
        let loss = forward(i)?;
        gpu_mark_into(marks, &self.device, StepMarks::forward_end);
        *fwd += t.elapsed();
        check_loss(&loss)?;
        let loss = if k == 1 {
            loss
        } else {
            loss.affine(weight, 0.0)?
        };
        let value = loss.detach().to_dtype(DType::F32)?.reshape(1)?;
        Ok((loss.backward()?, value))
    }

    /// The optimizer step on `g` at the schedule's rate, and the step's record.
    ///
    /// # Errors
    ///
    /// `g` is from another step, or the optimizer or a collective failed.
    pub fn apply(&mut self, g: Gradients) -> Result<StepInfo> {
        if g.step != self.step {
            return Err(bad(
                "gradients",
                format!("of step {}", g.step),
                "apply the gradients of the current step (Trainer::steps_done)",
            ));
        }
        let lr = self.lr_at(self.step);
        self.opt.set_learning_rate(lr);
        // The optimizer's GPU phase starts here, not at the backward's end: the device is idle
        // in between while the host reads the loss back.
        let mut marks = g.marks;
        gpu_mark_into(&mut marks, &self.device, StepMarks::optimizer_start);
        self.opt.step(&g.grads, g.clip.as_ref())?;
        if let Some(f) = &self.fsdp {
            // Units no wrapper drives see the updated parameters at their next use.
            f.gather_undriven()?;
        }
        let t_opt = Instant::now();
        gpu_mark_into(&mut marks, &self.device, StepMarks::optimizer_end);
        // The previous step's marks: complete since this step's loss read (same stream).
        let gpu_phases = self.take_gpu_phases(false);
        self.pending_gpu = marks.map(|m| (self.step, m));
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let fwd_ms = g.fwd.as_secs_f64() * 1e3;
        let phase_ms = [fwd_ms, ms(g.t0, g.t_bwd) - fwd_ms, ms(g.t_bwd, t_opt)];
        let step_ms = g.t0.elapsed().as_secs_f64() * 1e3;
        let mut exposed = candle_dtensor_core::debug::take_comm_wait().as_secs_f64() * 1e3;
        let mut unsharded = 0;
        if let Some(f) = &self.fsdp {
            let st = f.take_stats();
            exposed += st.exposed_comm_ms;
            unsharded = st.peak_unsharded_bytes;
            self.last_fsdp = Some(st);
        }
        self.peak_bytes = self.peak_bytes.max(self.state_bytes + unsharded);
        let info = StepInfo {
            step: self.step,
            loss: g.loss,
            step_ms,
            tokens: self.cfg.tokens_per_step,
            micro_batches: g.micro_batches,
            lr,
            grad_norm: g.grad_norm,
            phase_ms,
            exposed_comm_ms: exposed,
            peak_bytes: self.peak_bytes,
            host_reads: candle_dtensor_kernels::storage::take_host_reads(),
            gpu_phases,
        };
        self.step += 1;
        Ok(info)
    }

    /// The GPU phase times of the last applied step, waiting for its optimizer step to finish
    /// on the device (a host synchronisation: call it once, after training). `None` on the
    /// CPU, before the first step, or when already taken.
    pub fn last_gpu_phases(&mut self) -> Option<GpuPhases> {
        self.take_gpu_phases(true)
    }

    /// Reads and forgets the pending step's GPU times; `wait` first waits for them.
    fn take_gpu_phases(&mut self, wait: bool) -> Option<GpuPhases> {
        take_gpu_phases(&mut self.pending_gpu, wait)
    }

    /// One whole step: [`Trainer::forward_backward`] then [`Trainer::apply`].
    ///
    /// # Errors
    ///
    /// As both.
    pub fn step(
        &mut self,
        forward: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> Result<StepInfo> {
        let g = self.forward_backward_to_apply(&[1], one_micro_batch(forward))?;
        self.apply(g)
    }

    /// One whole step with gradient accumulation: [`Trainer::forward_backward_accum`] over
    /// the micro-batches (`tokens[i]`: micro-batch `i`'s token count; `forward(i)`: its mean
    /// loss), then [`Trainer::apply`]: one optimizer update.
    ///
    /// # Errors
    ///
    /// As both.
    pub fn step_accum(
        &mut self,
        tokens: &[usize],
        forward: impl FnMut(usize) -> candle_core::Result<Tensor>,
    ) -> Result<StepInfo> {
        let g = self.forward_backward_to_apply(tokens, forward)?;
        self.apply(g)
    }

    /// The global mean of the loss `forward` returns (a forward only: no gradients, no
    /// update). Collective.
    ///
    /// # Errors
    ///
    /// The forward's error, a loss of more than one element, a failed collective.
    pub fn eval(&mut self, forward: impl FnOnce() -> candle_core::Result<Tensor>) -> Result<f32> {
        let loss = forward()?;
        let (v, _) = self.start_loss(&loss)?.read_with(None)?;
        // Not part of the next step's measurements.
        let _ = candle_dtensor_core::debug::take_comm_wait();
        let _ = candle_dtensor_kernels::storage::take_host_reads();
        if let Some(f) = &self.fsdp {
            f.take_stats();
        }
        Ok(v)
    }

    /// Trains up to step `steps` (from [`Trainer::steps_done`]): for each step `k`, `data(k)`
    /// gives the batch (this rank's rows of it) and `loss(&batch)` this rank's loss; then
    /// backward, reduction, clipping, the scheduled rate and the optimizer step. With
    /// [`FitOptions::eval_every`], evaluates after every `every` steps and after the last.
    /// Collective.
    ///
    /// # Errors
    ///
    /// Before any step: a schedule whose warmup exceeds `steps`
    /// ([`ScheduleError::WarmupTooLong`]), an evaluation or checkpoint period of 0, a
    /// checkpoint that cannot be loaded ([`TrainerError::Checkpoint`]). Then any step's error,
    /// or a failed save.
    pub fn fit<B>(
        &mut self,
        steps: usize,
        mut data: impl FnMut(usize) -> candle_core::Result<B>,
        loss: impl FnMut(&B) -> candle_core::Result<Tensor>,
        opts: FitOptions<'_>,
    ) -> Result<FitReport> {
        if self.cfg.grad_accum != 1 {
            return Err(bad(
                "grad_accum",
                self.cfg.grad_accum,
                "Trainer::fit takes one batch per step (grad_accum = 1); with gradient \
                 accumulation use Trainer::fit_accum, whose data closure gives each micro-batch",
            ));
        }
        self.fit_accum(steps, |k, _| data(k), |_| 1, loss, opts)
    }

    /// [`Trainer::fit`] with gradient accumulation over [`TrainerConfig::grad_accum`] (`K`)
    /// micro-batches per step: `data(k, i)` gives micro-batch `i` of step `k` (this rank's
    /// rows of it), `tokens(&batch)` its token count (as [`Trainer::forward_backward_accum`]
    /// takes it; the loss of a step is the mean over all its tokens), `loss(&batch)` its mean
    /// loss. One optimizer update per step. Collective.
    ///
    /// # Errors
    ///
    /// As [`Trainer::fit`].
    pub fn fit_accum<B>(
        &mut self,
        steps: usize,
        mut data: impl FnMut(usize, usize) -> candle_core::Result<B>,
        mut tokens: impl FnMut(&B) -> usize,
        mut loss: impl FnMut(&B) -> candle_core::Result<Tensor>,
        mut opts: FitOptions<'_>,
    ) -> Result<FitReport> {
        let micro = self.cfg.grad_accum;
        if micro == 0 {
            return Err(bad(
                "grad_accum",
                0,
                "at least 1 micro-batch per optimizer step",
            ));
        }
        if let Some(s) = &self.cfg.schedule {
            if s.warmup > steps {
                return Err(ScheduleError::WarmupTooLong {
                    warmup: s.warmup,
                    steps,
                }
                .into());
            }
            if s.decay != Decay::Constant && s.steps != steps {
                tracing::warn!(
                    schedule_steps = s.steps,
                    steps,
                    "the schedule's decay is planned for another number of steps than this run"
                );
            }
        }
        if let Some((0, _)) = &opts.eval {
            return Err(bad("eval every", 0, "evaluate every 1 or more steps"));
        }
        if let Some((_, 0)) = &opts.checkpoint {
            return Err(bad("checkpoint every", 0, "save every 1 or more steps"));
        }
        let mut report = FitReport::default();
        if let Some((dir, _)) = &opts.checkpoint {
            self.ckpt_vars()?;
            // A later complete checkpoint than where this trainer stands: continue from it. The
            // ranks agree on it first: a rank that saw another step (a directory that is not
            // shared) or could not read it would otherwise skip the collective load the others
            // enter, and the job would hang instead of failing.
            let seen = checkpoint::latest_step(dir);
            let mine = match &seen {
                Ok(Some(step)) => *step as f64,
                Ok(None) => -1.0,
                Err(_) => -2.0,
            };
            let all = match &self.mesh {
                Some(mesh) => {
                    let root = mesh.root_comm();
                    let t = Tensor::new(&[mine], root.device())?;
                    root.all_gather_single(&t)?.wait()?.to_vec1::<f64>()?
                }
                None => vec![mine],
            };
            let latest = seen?;
            if all.iter().any(|&v| v != mine) {
                return Err(TrainerError::Params(format!(
                    "the ranks disagree on the latest complete checkpoint in {} (by rank, -1: \
                     none, -2: unreadable): {all:?}; the checkpoint directory must be shared",
                    dir.display()
                )));
            }
            if let Some(latest) = latest {
                if latest > self.step {
                    self.load(dir, Which::Step(latest))?;
                    report.resumed_from = Some(latest);
                }
            }
        }
        while self.step < steps {
            let k = self.step;
            let info = if micro == 1 {
                self.step(|| loss(&data(k, 0)?))?
            } else {
                let batches = (0..micro)
                    .map(|i| data(k, i))
                    .collect::<candle_core::Result<Vec<B>>>()?;
                let counts: Vec<usize> = batches.iter().map(&mut tokens).collect();
                self.step_accum(&counts, |i| loss(&batches[i]))?
            };
            if let Some(f) = &mut opts.on_step {
                f(&info);
            }
            report.steps.push(info);
            let done = k + 1;
            if let Some((every, eval)) = &mut opts.eval {
                if done.is_multiple_of(*every) || done == steps {
                    let l = self.eval(eval)?;
                    report.eval_losses.push((done, l));
                }
            }
            if let Some((dir, every)) = &opts.checkpoint {
                if done.is_multiple_of(*every) || done == steps {
                    self.save(dir, &serde_json::Value::Null)?;
                    report.saved.push(done);
                }
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grad(n: usize, seed: f32, dtype: DType) -> Tensor {
        let v: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
        Tensor::from_vec(v, n, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// The gradients of the tests: copies 1, 2 and 4, f32, bf16 and f64, an empty one, and two
    /// views of one storage.
    fn mixed() -> Vec<(Tensor, usize)> {
        let shared = grad(40, 9.0, DType::F32);
        vec![
            (grad(33, 1.0, DType::F32), 1),
            (grad(7, 2.0, DType::BF16), 2),
            (grad(50, 3.0, DType::F32), 4),
            (grad(12, 4.0, DType::F64), 1),
            (grad(0, 5.0, DType::F32), 1),
            (grad(21, 6.0, DType::F32), 1),
            (shared.narrow(0, 0, 25).unwrap(), 1),
            (shared.narrow(0, 25, 15).unwrap(), 2),
            (grad(9, 7.0, DType::BF16), 2),
        ]
    }

    #[test]
    fn the_norm_plan_groups_by_copies_and_dtype_views_of_one_buffer_included() {
        let plan = norm_plan(&mixed());
        assert_eq!(
            plan,
            NormPlan {
                groups: vec![
                    ((1, DType::F32), vec![0, 5, 6]),
                    ((2, DType::BF16), vec![1, 8]),
                    ((4, DType::F32), vec![2]),
                    ((2, DType::F32), vec![7]),
                ],
                single: vec![3],
            }
        );
    }

    #[test]
    fn the_fused_sum_of_squares_is_the_per_gradient_one() {
        let grads = mixed();
        let fused = local_sq_fused(&grads, &Device::Cpu).unwrap();
        assert_eq!(fused.dims(), [1]);
        let got = fused.to_vec1::<f64>().unwrap()[0];
        let want: f64 = grads
            .iter()
            .map(|(g, c)| sum_sq_f64(g).unwrap().to_scalar::<f64>().unwrap() / *c as f64)
            .sum();
        assert!(want > 1.0, "{want}");
        // The kernel's norm is f32.
        assert!(
            approx::relative_eq!(got, want, max_relative = 1e-6),
            "{got} vs {want}"
        );
        // No gradient at all: zero.
        let none = local_sq_fused(&[], &Device::Cpu).unwrap();
        assert_eq!(none.to_vec1::<f64>().unwrap(), [0.0]);
    }

    #[test]
    fn a_nan_gradient_makes_the_fused_sum_nan() {
        let mut grads = mixed();
        let mut v = vec![0.5f32; 10];
        v[3] = f32::NAN;
        grads.push((Tensor::from_vec(v, 10, &Device::Cpu).unwrap(), 1));
        let got = local_sq_fused(&grads, &Device::Cpu)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[0];
        assert!(got.is_nan(), "{got}");
    }
}
