//! The training run shared by the `train_gpt` example and the tests: one rank's side of
//! training a [`Gpt`] on a corpus (synthetic by default, or any token stream, with an optional
//! held-out evaluation and text generation at the end) with AdamW ([`crate::optim::AdamW`], candle-nn's
//! math), with optional distributed checkpoints ([`crate::checkpoint`]) and resumption.
//!
//! Each step is [`crate::fit::Trainer`]'s (the library trainer any model uses): backward with
//! FSDP's reduction, the gradient norm and clipping, the scheduled rate, the optimizer step and
//! the [`StepInfo`]; this module adds what is specific to the GPT run: its data, held-out
//! evaluation, checkpoints, fault-tolerant recovery, MoE and collective reports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;

use candle_dtensor_comm::CommError;
use candle_dtensor_core::DTensorError;
use candle_dtensor_mesh::MeshError;
use candle_dtensor_models::gpt::{Gpt, GptConfig};
use candle_dtensor_models::ModelError;
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::pipeline::PipelineError;
use candle_dtensor_parallel::tp_plan::TpPlan;
use candle_dtensor_parallel::ParallelError;

use crate::checkpoint::{self, CheckpointError, StoreCheckpoint, Which};
use crate::data::Corpus;
use crate::fit::{Gradients, OptimizerKind, TrainVars, Trainer, TrainerConfig, TrainerError};
use crate::pipeline::{PipelineSpec, PipelineStepReport};
use crate::schedule::{LrSchedule, WeightDecay};

pub use crate::fit::{GpuPhases, StepInfo};

/// Why the GPT's training run stopped.
#[non_exhaustive]
#[derive(thiserror::Error)]
pub enum RunError {
    /// A bad configuration (mesh vs. model sizes, a setting the run cannot use, ...).
    #[error("config: {0}")]
    Config(String),
    /// Fault-tolerant training ([`TrainConfig::fault_tolerant`]) cannot go on: every replica
    /// lost a rank, or a step failed while no rank was lost.
    #[error("fault-tolerant training stops at step {step}: {reason} (lost world ranks {lost:?})")]
    Unrecoverable {
        /// The global step that failed.
        step: usize,
        /// The ranks of the original world that were lost so far.
        lost: Vec<usize>,
        /// Why the survivors cannot continue.
        reason: String,
    },
    /// The model, a DTensor op, a collective or a candle op failed (boxed: [`ModelError`] is
    /// large).
    #[error(transparent)]
    Model(Box<ModelError>),
    /// Sharding (FSDP / HSDP), a tensor-parallel plan or the expert-parallel dispatch failed
    /// (boxed: [`ParallelError`] is large).
    #[error(transparent)]
    Parallel(Box<ParallelError>),
    /// Saving or loading a checkpoint failed (boxed: the integrity errors carry paths and
    /// names).
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),
    /// Pipeline parallelism ([`TrainConfig::pipeline`]): a schedule whose rule fails, a stage
    /// split that cannot be made, or a failure while a schedule runs (boxed: large).
    #[error(transparent)]
    Pipeline(Box<PipelineError>),
    /// A combination of settings that is not implemented (e.g. pipeline parallelism with
    /// FSDP); refused before any step rather than run wrong.
    #[error("not supported: {0}")]
    Unsupported(String),
}

/// Debug prints the message, as [`ModelError`]'s does.
impl std::fmt::Debug for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `Result` with [`RunError`].
pub type Result<T, E = RunError> = std::result::Result<T, E>;

/// A model error that is a parallelism one ([`ModelError::Parallel`]) becomes
/// [`RunError::Parallel`].
impl From<ModelError> for RunError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Parallel(p) => RunError::Parallel(p),
            m => RunError::Model(Box::new(m)),
        }
    }
}

impl From<ParallelError> for RunError {
    fn from(e: ParallelError) -> Self {
        RunError::Parallel(Box::new(e))
    }
}

impl From<CheckpointError> for RunError {
    fn from(e: CheckpointError) -> Self {
        RunError::Checkpoint(Box::new(e))
    }
}

/// The library trainer's model, parallelism and checkpoint errors pass through; its other
/// errors (settings, parameters, schedule) are the run's configuration errors.
impl From<TrainerError> for RunError {
    fn from(e: TrainerError) -> Self {
        match e {
            TrainerError::Model(m) => (*m).into(),
            TrainerError::Parallel(p) => RunError::Parallel(p),
            TrainerError::Checkpoint(e) => RunError::Checkpoint(e),
            other => RunError::Config(other.to_string()),
        }
    }
}

/// Recovers a typed error carried through candle ops (FSDP's, a model's).
impl From<candle_core::Error> for RunError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::from(e).into()
    }
}

impl From<DTensorError> for RunError {
    fn from(e: DTensorError) -> Self {
        ModelError::from(e).into()
    }
}

impl From<MeshError> for RunError {
    fn from(e: MeshError) -> Self {
        ModelError::from(e).into()
    }
}

impl From<CommError> for RunError {
    fn from(e: CommError) -> Self {
        ModelError::from(e).into()
    }
}

/// What to train.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model; its [`GptConfig::precision`] is the run's precision policy (applied by
    /// [`train_rank`], reported in [`RankReport::precision`]).
    pub gpt: GptConfig,
    /// The tensor-parallel plan.
    pub plan: TpPlan,
    /// Global batch size (sequences per step, all micro-batches together).
    pub batch: usize,
    /// Gradient accumulation: each step's batch is split into this many micro-batches of
    /// `batch / grad_accum` sequences (the same sequences whatever the split), run forward and
    /// backward one after the other, then one optimizer update; the loss is the mean over all
    /// the step's tokens (see [`Trainer::forward_backward_accum`]). At least 1 and it divides
    /// `batch` (checked before any step, on every rank).
    pub grad_accum: usize,
    /// Steps to run.
    pub steps: usize,
    /// Seed of the parameters and the data.
    pub seed: u64,
    /// AdamW learning rate (the peak rate when [`TrainConfig::schedule`] is set).
    pub lr: f64,
    /// Learning-rate schedule (`None`: `lr` at every step). The optimizer's rate is set from
    /// it before every step, as a function of the step index alone, so a resumed run continues
    /// it exactly.
    pub schedule: Option<LrSchedule>,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// AdamW's first-moment decay (default 0.9, candle-nn's and PyTorch's).
    pub beta1: f64,
    /// AdamW's second-moment decay (default 0.999).
    pub beta2: f64,
    /// AdamW's denominator epsilon (default 1e-8).
    pub eps: f64,
    /// Which parameters the weight decay applies to (default: all, as candle-nn's AdamW).
    pub decay_policy: WeightDecay,
    /// Compute the global gradient norm every this many steps for [`StepInfo::grad_norm`]
    /// even without clipping (0: only when clipping, which computes it anyway).
    pub grad_norm_every: usize,
    /// Clip the global gradient norm to this value.
    pub clip: Option<f64>,
    /// Tokens in the synthetic corpus.
    pub corpus_tokens: usize,
    /// The training tokens (`None`: the synthetic corpus, [`TrainConfig::synthetic_corpus`]).
    /// Their vocabulary must fit the model's.
    pub data: Option<Arc<Corpus>>,
    /// Evaluate on held-out tokens during training.
    pub eval: Option<EvalSpec>,
    /// Generate tokens from the trained model at the end.
    pub sample: Option<SampleSpec>,
    /// Shard parameters, gradients and optimizer state with FSDP.
    pub fsdp: Option<FsdpSpec>,
    /// Plain SGD instead of AdamW (tests: SGD is sensitive to the gradient scale, which AdamW's
    /// normalisation would hide).
    pub sgd: bool,
    /// Directory of distributed checkpoints (`None`: no checkpoints).
    pub save_dir: Option<PathBuf>,
    /// Save a checkpoint every this many steps, and after the last step (0: only after the
    /// last step). Needs `save_dir`.
    pub save_every: usize,
    /// Resume from the latest complete checkpoint in `save_dir`: continue from its step up to
    /// `steps` (the total). Without a checkpoint there, start from step 0.
    pub resume: bool,
    /// Start from the parameters of a plain safetensors file (e.g. a consolidated
    /// checkpoint) instead of the seed's initialisation; not used when resuming from a
    /// checkpoint.
    pub init_from: Option<PathBuf>,
    /// Fault-tolerant HSDP: survive the loss of ranks of one replica group without a restart
    /// (see [`train_rank`]). Needs FSDP with a replicate dim; no held-out evaluation,
    /// checkpoints or mixture-of-experts blocks (their collectives are not covered).
    pub fault_tolerant: bool,
    /// Pipeline parallelism over the mesh's `pp` dim (needed when the mesh has one; see
    /// [`crate::pipeline`] for what it covers).
    pub pipeline: Option<PipelineSpec>,
}

/// Held-out evaluation: the mean loss over `batches` fixed batches of `corpus` (forward
/// only), after every `every` steps and after the last.
#[derive(Debug, Clone)]
pub struct EvalSpec {
    /// The held-out tokens.
    pub corpus: Arc<Corpus>,
    /// Evaluate after every this many steps (and after the last).
    pub every: usize,
    /// Batches (of the training batch size) per evaluation.
    pub batches: usize,
}

/// Text generation at the end of training: `tokens` new tokens after `prompt`, each predicted
/// from the last `seq_len` tokens (a sliding window).
#[derive(Debug, Clone)]
pub struct SampleSpec {
    /// The prompt (at least one token).
    pub prompt: Vec<u32>,
    /// How many tokens to generate.
    pub tokens: usize,
    /// 0: greedy (the most likely token, the lowest id among ties); above 0: sampled from
    /// `softmax(logits / temperature)` with a generator seeded by `seed` (the same choice on
    /// every rank).
    pub temperature: f64,
    /// Seed of the sampling.
    pub seed: u64,
}

/// FSDP settings by mesh dim name.
#[derive(Debug, Clone)]
pub struct FsdpSpec {
    /// Mesh dim the parameters are sharded over (`dp`, or `shard` for HSDP).
    pub shard: String,
    /// HSDP: mesh dim the shards are replicated over (`replicate`). With a `cp` mesh dim and
    /// no HSDP, FSDP reduces the gradients over `cp` the same way.
    pub replicate: Option<String>,
    /// A separate reduce-scatter communicator.
    pub separate_rs: bool,
    /// Mixed precision: dtype FSDP gathers the parameters in (f32 master shards and
    /// reduction). Storage and communication only: [`GptConfig::precision`] decides what each
    /// op computes in (norms, softmax and the loss in f32 either way; GEMMs in this dtype
    /// unless the policy says bf16).
    pub param_dtype: Option<DType>,
    /// Release non-root units' parameters after forward.
    pub reshard_after_forward: bool,
}

impl TrainConfig {
    /// The defaults of a preset: batch 8, AdamW lr 1e-3, weight decay 0.01, no clipping.
    pub fn new(gpt: GptConfig, plan: TpPlan) -> Self {
        TrainConfig {
            gpt,
            plan,
            batch: 8,
            grad_accum: 1,
            steps: 100,
            seed: 0,
            lr: 1e-3,
            schedule: None,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            decay_policy: WeightDecay::All,
            grad_norm_every: 0,
            clip: None,
            corpus_tokens: 1 << 18,
            data: None,
            eval: None,
            sample: None,
            fsdp: None,
            sgd: false,
            save_dir: None,
            save_every: 0,
            resume: false,
            init_from: None,
            fault_tolerant: false,
            pipeline: None,
        }
    }

    /// The synthetic corpus trained on when there is no [`TrainConfig::data`].
    pub fn synthetic_corpus(&self) -> Corpus {
        Corpus::synthetic(self.gpt.vocab, self.corpus_tokens, self.seed ^ 0xC0FFEE)
    }
}

/// What one rank saw.
#[derive(Debug, Clone, Default)]
pub struct RankReport {
    /// The first step this invocation ran (the checkpoint's step when resuming, else 0).
    pub start_step: usize,
    /// Global mean loss per step run in this invocation (steps `start_step..steps`).
    pub losses: Vec<f32>,
    /// The learning rate of each step run in this invocation (same steps as `losses`).
    pub lrs: Vec<f64>,
    /// Held-out loss after `n` steps, as `(n, loss)` ([`TrainConfig::eval`]).
    pub eval_losses: Vec<(usize, f32)>,
    /// The generated tokens ([`TrainConfig::sample`]), after the prompt.
    pub sample: Vec<u32>,
    /// Steps after which a checkpoint was saved.
    pub saved_steps: Vec<usize>,
    /// Wall time of each checkpoint save (ms).
    pub save_ms: Vec<f64>,
    /// Wall time per step (ms).
    pub step_ms: Vec<f64>,
    /// Device-to-host reads of each step run, on this rank ([`StepInfo::host_reads`], plus the
    /// MoE balancing loss's read): each a host synchronisation on a GPU.
    pub host_reads: Vec<usize>,
    /// Collectives issued in the last step by (kind, phase) -> count.
    pub collectives: BTreeMap<String, BTreeMap<String, usize>>,
    /// Bytes of this rank's parameter pieces.
    pub param_bytes: usize,
    /// Global parameter count.
    pub params: usize,
    /// Time the compute thread waited on collectives, per step (ms).
    pub exposed_comm_ms: Vec<f64>,
    /// Per step: milliseconds in forward (data to loss), backward (including FSDP's gradient
    /// reduction and clipping) and the optimizer step. With a pipeline, whose forwards and
    /// backwards interleave: the schedule, the gradients' reductions and norm, the optimizer.
    pub phase_ms: Vec<[f64; 3]>,
    /// GPU time of each step's phases, as `phase_ms` splits host time, from CUDA timing
    /// events ([`StepInfo::gpu_phases`]; empty on the CPU), pipelines included. Each names its
    /// step.
    pub gpu_phase_ms: Vec<GpuPhases>,
    /// Peak bytes held in parameters + gradients + optimizer state on this rank (counted from
    /// the tensors: shards, their gradients, AdamW's two moments, and FSDP's unsharded
    /// parameters and gradients in flight).
    pub param_grad_optim_bytes: usize,
    /// Peak activation memory of this rank: the most bytes the autograd graph of one of its
    /// losses kept for backward, over the steps (and micro-batches) measured: this run's first
    /// step and every step that is a multiple of [`GRAPH_SAMPLE_EVERY`]
    /// ([`candle_dtensor_core::debug::graph_bytes`]; what [`GptConfig::ac`] reduces).
    pub peak_activation_bytes: usize,
    /// (params + grads + optimizer state) / N + the largest unit's unsharded parameters, from
    /// the model's sizes (FSDP only; N = the shard group size).
    pub zero3_theory_bytes: Option<usize>,
    /// The largest single unsharded parameter (FSDP only): its gradient and its full value
    /// coexist for a moment at the end of its last consumer's backward, which the theory
    /// formula leaves out.
    pub largest_param_bytes: Option<usize>,
    /// Per step, with mixture-of-experts blocks ([`GptConfig::moe`]): what the layers
    /// measured, summed over them (empty without MoE blocks).
    pub moe: Vec<MoeStepReport>,
    /// This rank in the mesh it ended on (its rank in the original mesh unless replicas were
    /// dropped; fault-tolerant training).
    pub rank: usize,
    /// This rank stopped because its replica group was dropped (a rank of it was lost): its
    /// losses end at the failed step (fault-tolerant training).
    pub dropped: bool,
    /// Ranks of the original world that were dropped (the lost ones and their replica
    /// groups' other ranks), sorted (fault-tolerant training).
    pub lost_ranks: Vec<usize>,
    /// Each recovery from a lost replica group (fault-tolerant training).
    pub recoveries: Vec<Recovery>,
    /// Per step, with pipeline parallelism ([`TrainConfig::pipeline`]): the schedule's
    /// analytic bubble and the measured one (empty otherwise).
    pub pipeline: Vec<PipelineStepReport>,
    /// The precision policy the run applied ([`GptConfig::precision`]: requested, effective,
    /// and why they differ; `tf32` on the CPU runs as f32). Gradients are reduced in
    /// [`Precision::grad_reduce_dtype`](candle_dtensor_models::Precision::grad_reduce_dtype)
    /// (f32) under every policy.
    pub precision: Option<candle_dtensor_models::precision::Applied>,
}

/// One recovery of fault-tolerant training ([`TrainConfig::fault_tolerant`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// The global step that failed and was retried on the survivors.
    pub step: usize,
    /// The ranks the survivors agreed were lost (original world ranks).
    pub failed: Vec<usize>,
    /// The ranks dropped with them: every rank of their replica groups (original world ranks).
    pub dropped: Vec<usize>,
    /// From this rank detecting the failure (its step failed, or the agreement said a peer's
    /// did) to the retried step starting, ms: agreement, shrink, new mesh, rebuilt model and
    /// optimizer with the state copied over.
    pub recovery_ms: f64,
    /// From the failed step starting to the retried step starting, ms: also the wait that
    /// detected the failure (at most about one op timeout).
    pub stall_ms: f64,
    /// Replica groups left.
    pub replicas: usize,
}

/// One training step of the mixture-of-experts layers, summed over the layers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeStepReport {
    /// Dispatch time (count exchange, permutation, exchange; forward and the backward's
    /// reverse exchange), ms.
    pub dispatch_ms: f64,
    /// Combine time (reverse exchange and weighting; forward and backward), ms.
    pub combine_ms: f64,
    /// Fewest kept assignments of any expert of any layer (global batch).
    pub tokens_per_expert_min: usize,
    /// Most kept assignments of any expert of any layer.
    pub tokens_per_expert_max: usize,
    /// Assignments dropped by the capacity.
    pub dropped: usize,
    /// The load-balancing loss (included in the step's loss).
    pub aux_loss: f32,
}

/// What a rank trains with on one mesh. Fault-tolerant training builds a new one on the
/// survivors' mesh and copies the state over.
struct Setup {
    mesh: DeviceMesh,
    fsdp: Option<Fsdp>,
    gpt: Gpt,
    store: ParamStore,
    trainer: Trainer,
}

impl Setup {
    /// Builds the model (parameters from the seed), FSDP and the optimizer on `mesh`.
    fn build(mesh: DeviceMesh, cfg: &TrainConfig) -> Result<Setup> {
        let fsdp = match &cfg.fsdp {
            Some(spec) => {
                // The loss is a DTensor global mean: shard gradients are summed.
                let mut fc = FsdpConfig::new(mesh.dim_index(&spec.shard)?, GradReduce::Sum);
                // Context parallelism: parameters are replicated over `cp` and each cp rank's
                // gradient is a partial sum over its tokens. FSDP sums them over cp after the
                // reduce_scatter, as HSDP does over its replicate dim, so the gradient-sync
                // nodes dispatch would otherwise put on every full parameter (each holding a
                // copy of it until backward) are not needed.
                let cp = mesh
                    .dim_names()
                    .iter()
                    .position(|n| *n == "cp")
                    .filter(|&d| mesh.shape()[d] > 1);
                // The model's ring attention runs over cp too: the reductions get their own
                // communicator.
                fc.separate_replicate_group = spec.replicate.is_none() && cp.is_some();
                fc.replicate_dim = match (&spec.replicate, cp) {
                    (Some(r), None) => Some(mesh.dim_index(r)?),
                    (None, cp) => cp,
                    (Some(r), Some(_)) => {
                        return Err(RunError::Config(format!(
                            "FSDP reduces gradients over one replicate dim: HSDP's {r:?} and \
                             context parallelism's \"cp\" together are not supported"
                        )))
                    }
                };
                fc.separate_reduce_scatter_group = spec.separate_rs;
                fc.param_dtype = spec.param_dtype;
                fc.reshard_after_forward = spec.reshard_after_forward;
                Some(Fsdp::new(&mesh, fc)?)
            }
            None => None,
        };
        let (gpt, store) = Gpt::build(
            &cfg.gpt,
            &mesh,
            &cfg.plan,
            cfg.seed,
            DType::F32,
            fsdp.as_ref(),
        )?;
        // The step: the library trainer over the store's parameters (each with its replica
        // count, so the gradient norm is one device's).
        let trainer = Trainer::new(
            TrainVars::store(&store),
            TrainerConfig {
                lr: cfg.lr,
                schedule: cfg.schedule,
                optimizer: if cfg.sgd {
                    OptimizerKind::Sgd
                } else {
                    OptimizerKind::AdamW
                },
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
                decay_policy: cfg.decay_policy,
                clip: cfg.clip,
                grad_norm_every: cfg.grad_norm_every,
                tokens_per_step: cfg.batch * cfg.gpt.seq_len,
                grad_accum: cfg.grad_accum,
            },
        )?;
        Ok(Setup {
            mesh,
            fsdp,
            gpt,
            store,
            trainer,
        })
    }

    /// Copies `old`'s parameters (this rank's pieces) and optimizer state into this setup,
    /// built by the same code on a mesh where this rank holds pieces of the same shapes (the
    /// same coordinates on every dim but the replicate dim).
    fn adopt(&mut self, old: &Setup) -> Result<()> {
        let (ov, nv) = (old.store.vars(), self.store.vars());
        if ov.len() != nv.len() {
            return Err(RunError::Config(format!(
                "the rebuilt model has {} variables, the old one {}",
                nv.len(),
                ov.len()
            )));
        }
        for (i, (o, n)) in ov.iter().zip(&nv).enumerate() {
            if o.dims() != n.dims() || o.dtype() != n.dtype() {
                return Err(RunError::Config(format!(
                    "variable {i}: the rebuilt piece is {:?} {:?}, the old one {:?} {:?}",
                    n.dims(),
                    n.dtype(),
                    o.dims(),
                    o.dtype()
                )));
            }
            n.set(o.as_tensor())?;
        }
        self.trainer.set_steps_done(old.trainer.steps_done());
        match (old.trainer.adamw(), self.trainer.adamw_mut()) {
            (Some(o), Some(n)) => {
                n.set_step_count(o.step_count());
                for (ovar, nvar) in ov.iter().zip(&nv) {
                    if let Some((m, v)) = o.moments(ovar)? {
                        n.set_moments(nvar, &m, &v)?;
                    }
                }
            }
            (None, None) => {}
            _ => {
                return Err(RunError::Config(
                    "the rebuilt optimizer is of another kind".into(),
                ))
            }
        }
        Ok(())
    }
}

/// Forward, backward (with FSDP's gradient reduction) and clipping of step `step`: the
/// Steps between two measurements of the autograd graph's bytes
/// ([`TrainReport::peak_activation_bytes`]): the measurement walks the whole graph on the host,
/// a second walk besides backward's, which on a GPU delays the step's launches where the host
/// is the bottleneck (small models); the graph of a model's step is the same from step to step
/// but for the expert dispatch's sizes.
pub const GRAPH_SAMPLE_EVERY: usize = 16;

/// trainer's step before the optimizer's update. Also returns the most autograd-graph bytes
/// one of its losses kept on this rank ([`candle_dtensor_core::debug::graph_bytes`]) when
/// `measure_graph`, else 0 (see [`GRAPH_SAMPLE_EVERY`]).
fn forward_backward(
    s: &mut Setup,
    cfg: &TrainConfig,
    corpus: &Corpus,
    step: usize,
    measure_graph: bool,
) -> std::result::Result<(Gradients, usize), TrainerError> {
    let all_r = vec![Placement::Replicate; s.mesh.ndim()];
    let (gpt, mesh) = (&s.gpt, &s.mesh);
    s.trainer.set_steps_done(step);
    let graph = std::cell::Cell::new(0usize);
    // This rank's loss as the model returns it: its graph is what backward keeps.
    let measured = |loss: DTensor| -> candle_core::Result<DTensor> {
        if measure_graph {
            let b = candle_dtensor_core::debug::graph_bytes(loss.to_local());
            graph.set(graph.get().max(b));
        }
        Ok(loss)
    };
    if cfg.grad_accum <= 1 {
        let g = s.trainer.forward_backward_to_apply(&[1], |_| {
            let (x, y) = global_batch(gpt, mesh, corpus, step as u64, cfg.batch, cfg.seed)?;
            // Replicated: the loss is the global mean on every rank.
            Ok(measured(gpt.loss(&x, &y)?)?
                .redistribute(&all_r)?
                .to_local()
                .clone())
        })?;
        return Ok((g, graph.get()));
    }
    // Gradient accumulation: micro-batch i is rows [i * micro, (i + 1) * micro) of the step's
    // global batch, so the step trains on the same sequences whatever the split. Every
    // sequence has seq_len targets: each micro-batch holds micro * seq_len tokens (global).
    let micro = crate::fit::micro_batch_size(cfg.batch, cfg.grad_accum)?;
    let t = gpt.cfg.seq_len;
    let (xs, ys) = corpus.batch(step as u64, cfg.batch, t, cfg.seed);
    let tokens = vec![micro * t; cfg.grad_accum];
    let g = s.trainer.forward_backward_to_apply(&tokens, |i| {
        let rows = i * micro * t..(i + 1) * micro * t;
        let (x, y) = distribute_batch(gpt, mesh, &xs[rows.clone()], &ys[rows], micro)?;
        Ok(measured(gpt.loss(&x, &y)?)?
            .redistribute(&all_r)?
            .to_local()
            .clone())
    })?;
    Ok((g, graph.get()))
}

/// Where fault-tolerant training stands: the original world rank of each rank of the current
/// root communicator, and the ranks dropped so far.
struct FtState {
    orig: Vec<usize>,
    lost: Vec<usize>,
}

/// The outcome of a recovery on one rank.
enum Recovered {
    /// A survivor: the new setup (state copied over) and the ranks dropped.
    Survivor(Box<Setup>, Vec<usize>, Vec<usize>),
    /// This rank's replica group was dropped; the ranks dropped.
    Dropped(Vec<usize>, Vec<usize>),
}

/// After a failed step's agreement (`failed`: the ranks of the current root communicator it
/// found missing): drops every replica group with a lost rank, shrinks the root communicator
/// to the rest, builds the mesh with fewer replicas and the model on it, with `old`'s state.
/// Collective over the survivors (who all decided the same agreement, so all compute the
/// same excluded set); a rank of a dropped group returns [`Recovered::Dropped`] without
/// communicating.
fn recover(
    old: &Setup,
    cfg: &TrainConfig,
    rep_dim: usize,
    failed: &[usize],
    ft: &FtState,
    step: usize,
) -> Result<Recovered> {
    let shape = old.mesh.shape();
    let root = old.mesh.root_comm();
    let names: Vec<String> = old.mesh.dim_names().iter().map(|n| n.to_string()).collect();
    let rep_of = |r: usize| candle_dtensor_mesh::grid::unravel(r, &shape)[rep_dim];
    let mut failed: BTreeSet<usize> = failed.iter().copied().collect();
    // Each retry adds at least one rank to `failed` (a loss report naming no new rank is
    // returned as an error), so this ends.
    let (new_root, excluded) = loop {
        let lost_reps: BTreeSet<usize> = failed.iter().map(|&r| rep_of(r)).collect();
        let orig_of = |rs: &mut dyn Iterator<Item = usize>| -> Vec<usize> {
            rs.map(|r| ft.orig.get(r).copied().unwrap_or(r)).collect()
        };
        let excluded: Vec<usize> = (0..root.size())
            .filter(|&r| lost_reps.contains(&rep_of(r)))
            .collect();
        let failed_orig = orig_of(&mut failed.iter().copied());
        if lost_reps.len() >= shape[rep_dim] {
            let mut lost = ft.lost.clone();
            lost.extend(orig_of(&mut excluded.iter().copied()));
            lost.sort_unstable();
            return Err(RunError::Unrecoverable {
                step,
                lost,
                reason: format!(
                    "every replica group lost a rank (ranks {failed_orig:?} of the original world)"
                ),
            });
        }
        if excluded.contains(&root.rank()) {
            tracing::warn!(
                step,
                failed = ?failed_orig,
                "this rank's replica group lost a rank; it is dropped and stops"
            );
            return Ok(Recovered::Dropped(
                failed_orig,
                orig_of(&mut excluded.iter().copied()),
            ));
        }
        match root.shrink(&excluded) {
            Ok(c) => break (c, excluded),
            Err(e) => match &e {
                candle_dtensor_comm::CommError::RanksLost { lost, .. }
                    if lost.iter().any(|r| !failed.contains(r)) =>
                {
                    tracing::warn!(
                        step,
                        ?lost,
                        "more ranks lost during the shrink; dropping their replica groups too"
                    );
                    failed.extend(lost.iter().copied());
                }
                _ => return Err(e.into()),
            },
        }
    };
    let failed_orig: Vec<usize> = failed.iter().map(|&r| ft.orig[r]).collect();
    let dropped_orig: Vec<usize> = excluded.iter().map(|&r| ft.orig[r]).collect();
    let replicas = shape[rep_dim] - excluded.len() / (root.size() / shape[rep_dim]);
    let dims: Vec<(&str, usize)> = names
        .iter()
        .enumerate()
        .map(|(d, n)| (n.as_str(), if d == rep_dim { replicas } else { shape[d] }))
        .collect();
    let mesh = DeviceMesh::new(new_root, &dims)?;
    let mut new = Setup::build(mesh, cfg)?;
    new.adopt(old)?;
    Ok(Recovered::Survivor(
        Box::new(new),
        failed_orig,
        dropped_orig,
    ))
}

/// What the data stream depends on, saved with every checkpoint (`fingerprint`: the
/// corpus's).
pub(crate) fn checkpoint_extra(cfg: &TrainConfig, fingerprint: &str) -> serde_json::Value {
    serde_json::json!({
        "seed": cfg.seed,
        "batch": cfg.batch,
        "corpus_tokens": cfg.corpus_tokens,
        "data": match cfg.data {
            None => "synthetic corpus; batches are a function of (seed, step) only",
            Some(_) => "given tokens; batches are a function of (tokens, seed, step) only",
        },
        "data_fingerprint": fingerprint,
    })
}

/// Warns about every data setting a resumed checkpoint was saved with that differs now.
pub(crate) fn warn_data_changes(info: &crate::checkpoint::LoadInfo, extra: &serde_json::Value) {
    for key in ["seed", "batch", "corpus_tokens", "data_fingerprint"] {
        if info.extra.get(key) != extra.get(key) {
            tracing::warn!(
                key,
                saved = %info.extra.get(key).unwrap_or(&serde_json::Value::Null),
                now = %extra.get(key).unwrap_or(&serde_json::Value::Null),
                "resuming with a different data setting: the data stream differs"
            );
        }
    }
    tracing::info!(step = info.step, dir = %info.dir.display(), "resumed");
}

/// Trains on `mesh` (every rank of the mesh calls this) and reports per-step losses.
/// `on_step` runs after every step on this rank.
///
/// On a mesh with a `pp` dim the run is pipelined ([`crate::pipeline`]; it needs
/// [`TrainConfig::pipeline`] and covers only what that module says, refusing the rest before
/// any step).
///
/// # Fault tolerance
///
/// With [`TrainConfig::fault_tolerant`] (HSDP: FSDP with a replicate dim), every step ends
/// with [`candle_dtensor_comm::Comm::agree`] over the mesh's root communicator on whether
/// every rank's forward and backward succeeded; the optimizer steps only when they all did, so
/// no update is ever partially applied. A rank whose step failed (a lost peer, an op timeout)
/// aborts its mesh's communicators first, so that the peers waiting for it fail at once. When
/// the agreement reports lost ranks, every replica group holding one is dropped: its other
/// ranks return (with [`RankReport::dropped`]), and the survivors shrink the root
/// communicator to themselves, build the mesh with fewer replicas and the model on it, copy
/// their pre-step parameters and optimizer state over, and run the failed step again. The
/// global batch stays the same (spread over fewer ranks) and the loss is its mean, so the
/// gradient average is over the surviving replicas without a rescale, and the run continues
/// exactly as one started on the survivors from the state before the failed step.
pub fn train_rank(
    mesh: &DeviceMesh,
    cfg: &TrainConfig,
    on_step: impl FnMut(&StepInfo),
) -> Result<RankReport> {
    // The precision policy ([`GptConfig::precision`]): candle's process-global GEMM switches
    // (TF32 on CUDA, f32 accumulation for bf16) and the device check, before any op.
    let applied = cfg
        .gpt
        .precision
        .apply(mesh.root_comm().device())
        .map_err(RunError::from)?;
    // A `pp` dim: the pipelined run (which checks its own settings).
    let mut report = if candle_dtensor_parallel::tp_plan::MeshRoles::of(mesh)?
        .pp
        .is_some()
    {
        crate::pipeline::train_rank_pp(mesh, cfg, on_step)?
    } else {
        train_rank_spmd(mesh, cfg, on_step)?
    };
    report.precision = Some(applied);
    Ok(report)
}

/// [`train_rank`] without a `pp` mesh dim.
fn train_rank_spmd(
    mesh: &DeviceMesh,
    cfg: &TrainConfig,
    mut on_step: impl FnMut(&StepInfo),
) -> Result<RankReport> {
    if cfg.pipeline.is_some() {
        return Err(RunError::Config(
            "TrainConfig::pipeline needs a pp mesh dim".into(),
        ));
    }
    // Every rank checks the same settings: a bad split fails everywhere before any step.
    crate::fit::micro_batch_size(cfg.batch, cfg.grad_accum)?;
    let rep_dim = if cfg.fault_tolerant {
        let rep = cfg.fsdp.as_ref().and_then(|f| f.replicate.as_ref());
        let Some(rep) = rep else {
            return Err(RunError::Config(
                "fault-tolerant training needs HSDP (FSDP with a replicate mesh dim)".into(),
            ));
        };
        if cfg.eval.is_some() || cfg.save_dir.is_some() || cfg.gpt.moe.is_some() {
            return Err(RunError::Config(
                "fault-tolerant training does not cover held-out evaluation, checkpoints or \
                 mixture-of-experts blocks yet"
                    .into(),
            ));
        }
        Some(mesh.dim_index(rep)?)
    } else {
        None
    };
    let mut s = Setup::build(mesh.clone(), cfg)?;
    let corpus = match &cfg.data {
        Some(c) => c.clone(),
        None => Arc::new(cfg.synthetic_corpus()),
    };
    for (what, c) in std::iter::once(("training", &corpus))
        .chain(cfg.eval.iter().map(|e| ("held-out", &e.corpus)))
    {
        if c.vocab() > cfg.gpt.vocab {
            return Err(RunError::Config(format!(
                "the {what} tokens' vocabulary of {} exceeds the model's {}",
                c.vocab(),
                cfg.gpt.vocab
            )));
        }
    }
    let extra = checkpoint_extra(cfg, &corpus.fingerprint().to_string());
    if (cfg.resume || cfg.save_every > 0) && cfg.save_dir.is_none() {
        return Err(RunError::Config(
            "resume and save_every need a save_dir".into(),
        ));
    }
    let mut start = 0;
    let mut resumed = false;
    if let (true, Some(dir)) = (cfg.resume, &cfg.save_dir) {
        match checkpoint::load(dir, Which::Latest, &s.store, s.trainer.adamw_mut()) {
            Ok(info) => {
                start = info.step;
                resumed = true;
                warn_data_changes(&info, &extra);
            }
            Err(CheckpointError::NotFound { .. }) => {
                tracing::info!(dir = %dir.display(), "no checkpoint to resume; starting at step 0");
            }
            Err(e) => return Err(e.into()),
        }
    }
    if let (false, Some(path)) = (resumed, &cfg.init_from) {
        s.store.load_safetensors(path)?;
    }
    let mut report = RankReport {
        start_step: start,
        param_bytes: s.store.local_bytes(),
        params: s.store.global_numel(),
        rank: mesh.rank(),
        ..RankReport::default()
    };
    // Shards, their gradients and AdamW's two moments, all in the master dtype.
    let shard_bytes = s.store.local_bytes();
    let base_bytes = 4 * shard_bytes;
    if let Some(f) = &s.fsdp {
        let n = s.mesh.size(f.config().shard_dim)?;
        let tp_local: usize = s
            .store
            .params()
            .iter()
            .map(|p| p.tensor.to_local().elem_count() * 4)
            .sum();
        report.zero3_theory_bytes = Some(4 * tp_local / n + f.largest_unit_bytes());
        report.largest_param_bytes = Some(f.largest_param_bytes());
    }
    let mut ft = FtState {
        orig: (0..mesh.num_ranks()).collect(),
        lost: Vec::new(),
    };
    // A failure being recovered from: when this rank detected it, and when its step started.
    let mut fault: Option<(Instant, Instant)> = None;
    let _ = candle_dtensor_core::debug::take_comm_wait();
    // The setup's reads are not the first step's.
    let _ = candle_dtensor_kernels::storage::take_host_reads();
    let mut step = start;
    while step < cfg.steps {
        let t0 = Instant::now();
        let last = step + 1 == cfg.steps;
        let mode = last.then(CommDebugMode::start);
        let measure_graph = step == start || step.is_multiple_of(GRAPH_SAMPLE_EVERY);
        let res = forward_backward(&mut s, cfg, &corpus, step, measure_graph);
        let out = match rep_dim {
            None => res?,
            Some(rep_dim) => {
                if let Err(e) = &res {
                    // Peers waiting for this rank in a collective fail now, not after a timeout.
                    tracing::warn!(step, rank = s.mesh.rank(), error = %e, "step failed; agreeing with the others on who is lost");
                    fault.get_or_insert((Instant::now(), t0));
                    s.mesh
                        .abort(&format!("step {step} failed on this rank: {e}"));
                }
                let agreed = s.mesh.root_comm().agree(res.is_ok())?;
                match (agreed.ok, res) {
                    (true, Ok(out)) => out,
                    (_, res) => {
                        let (detected, failed_t0) = *fault.get_or_insert((Instant::now(), t0));
                        drop(res);
                        match recover(&s, cfg, rep_dim, &agreed.failed, &ft, step)? {
                            Recovered::Dropped(_failed, dropped) => {
                                report.dropped = true;
                                ft.lost.extend(dropped);
                                ft.lost.sort_unstable();
                                report.lost_ranks = ft.lost.clone();
                                return Ok(report);
                            }
                            Recovered::Survivor(new, failed, dropped) => {
                                let old = std::mem::replace(&mut s, *new);
                                ft.orig = (0..ft.orig.len())
                                    .filter(|r| !dropped.contains(&ft.orig[*r]))
                                    .map(|r| ft.orig[r])
                                    .collect();
                                ft.lost.extend(dropped.iter().copied());
                                ft.lost.sort_unstable();
                                drop(old);
                                let now = Instant::now();
                                let replicas = s.mesh.size(rep_dim)?;
                                let rec = Recovery {
                                    step,
                                    failed,
                                    dropped,
                                    recovery_ms: (now - detected).as_secs_f64() * 1e3,
                                    stall_ms: (now - failed_t0).as_secs_f64() * 1e3,
                                    replicas,
                                };
                                tracing::warn!(
                                    ?rec,
                                    "recovered: retrying the step on the surviving replicas"
                                );
                                report.recoveries.push(rec);
                                report.lost_ranks = ft.lost.clone();
                                report.rank = s.mesh.rank();
                                fault = None;
                                continue;
                            }
                        }
                    }
                }
            }
        };
        let (out, graph) = out;
        report.peak_activation_bytes = report.peak_activation_bytes.max(graph);
        let info = s.trainer.apply(out)?;
        report.lrs.push(info.lr);
        report.phase_ms.push(info.phase_ms);
        report.gpu_phase_ms.extend(info.gpu_phases);
        if let Some(mode) = mode {
            for ((phase, kind), n) in mode.counts() {
                let phase = match phase {
                    Phase::Forward => "forward",
                    Phase::Backward => "backward",
                };
                *report
                    .collectives
                    .entry(kind.to_string())
                    .or_default()
                    .entry(phase.to_string())
                    .or_insert(0) += n;
            }
        }
        let peak = s
            .trainer
            .last_fsdp_stats()
            .map_or(0, |st| st.peak_unsharded_bytes);
        report.exposed_comm_ms.push(info.exposed_comm_ms);
        let all_r = vec![Placement::Replicate; s.mesh.ndim()];
        if let Some(m) = moe_step(&s.gpt, &all_r)? {
            report.moe.push(m);
        }
        report
            .host_reads
            .push(info.host_reads + candle_dtensor_kernels::storage::take_host_reads());
        report.param_grad_optim_bytes = report.param_grad_optim_bytes.max(base_bytes + peak);
        report.losses.push(info.loss);
        report.step_ms.push(info.step_ms);
        on_step(&StepInfo {
            // Counted as the report counts it (shards, gradients and AdamW's two moments).
            peak_bytes: report.param_grad_optim_bytes,
            ..info
        });
        let done = step + 1;
        if let Some(e) = &cfg.eval {
            if (e.every > 0 && done % e.every == 0) || done == cfg.steps {
                report
                    .eval_losses
                    .push((done, evaluate(&s.gpt, &s.mesh, cfg, e)?));
                // Not part of the next step's measurements.
                let _ = candle_dtensor_core::debug::take_comm_wait();
                let _ = s.gpt.take_moe_stats();
                if let Some(f) = &s.fsdp {
                    f.take_stats();
                }
            }
        }
        if let Some(dir) = &cfg.save_dir {
            if (cfg.save_every > 0 && done % cfg.save_every == 0) || done == cfg.steps {
                let t0 = Instant::now();
                checkpoint::save(dir, done, &s.store, s.trainer.adamw(), &extra)?;
                report.save_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                report.saved_steps.push(done);
            }
        }
        step += 1;
    }
    // The last step's GPU times: one wait, after training.
    report.gpu_phase_ms.extend(s.trainer.last_gpu_phases());
    if let Some(spec) = &cfg.sample {
        report.sample = generate(&s.gpt, &s.mesh, cfg, spec, corpus.vocab())?;
    }
    Ok(report)
}

/// What the mixture-of-experts layers measured in the step just run (`None` without them).
/// Collective (the balancing loss is made Replicate).
fn moe_step(gpt: &Gpt, all_r: &[Placement]) -> Result<Option<MoeStepReport>> {
    let stats = gpt.take_moe_stats();
    if stats.is_empty() {
        return Ok(None);
    }
    let aux_loss = match gpt.last_aux_loss() {
        Some(a) => {
            candle_dtensor_kernels::storage::note_host_read();
            a.redistribute(all_r)?.to_local().to_scalar::<f32>()?
        }
        None => 0.0,
    };
    let per_expert = stats
        .iter()
        .flat_map(|s| s.tokens_per_expert.iter().copied());
    Ok(Some(MoeStepReport {
        dispatch_ms: stats.iter().map(|s| s.dispatch_ms).sum(),
        combine_ms: stats.iter().map(|s| s.combine_ms).sum(),
        tokens_per_expert_min: per_expert.clone().min().unwrap_or(0),
        tokens_per_expert_max: per_expert.max().unwrap_or(0),
        dropped: stats.iter().map(|s| s.dropped).sum(),
        aux_loss,
    }))
}

/// Seed of the held-out batches: the same batches at every evaluation.
const EVAL_SEED: u64 = 0xE7A1;

/// The global batch `(ids, targets)` of `corpus` for `index`, distributed as the model takes
/// it.
// `ModelError`, not `RunError`: `forward_backward`'s candle closure carries it, and the
// library trainer recovers it from candle's error.
#[allow(clippy::result_large_err)]
fn global_batch(
    gpt: &Gpt,
    mesh: &DeviceMesh,
    corpus: &Corpus,
    index: u64,
    batch: usize,
    seed: u64,
) -> Result<(DTensor, DTensor), ModelError> {
    let t = gpt.cfg.seq_len;
    let (x, y) = corpus.batch(index, batch, t, seed);
    distribute_batch(gpt, mesh, &x, &y, batch)
}

/// `batch` rows of `(ids, targets)`, distributed as the model takes them.
#[allow(clippy::result_large_err)]
fn distribute_batch(
    gpt: &Gpt,
    mesh: &DeviceMesh,
    x: &[u32],
    y: &[u32],
    batch: usize,
) -> Result<(DTensor, DTensor), ModelError> {
    let t = gpt.cfg.seq_len;
    let dev = mesh.root_comm().device();
    let placements = gpt.batch_placements();
    let x = Tensor::from_slice(x, (batch, t), dev)?;
    let y = Tensor::from_slice(y, (batch, t), dev)?;
    Ok((
        distribute_tensor(&x, mesh, &placements)?,
        distribute_tensor(&y, mesh, &placements)?,
    ))
}

/// The mean held-out loss over `e.batches` fixed batches (forward only; collective).
fn evaluate(gpt: &Gpt, mesh: &DeviceMesh, cfg: &TrainConfig, e: &EvalSpec) -> Result<f32> {
    let all_r = vec![Placement::Replicate; mesh.ndim()];
    let mut sum = 0.0;
    let n = e.batches.max(1);
    for k in 0..n {
        let (x, y) = global_batch(gpt, mesh, &e.corpus, k as u64, cfg.batch, EVAL_SEED)?;
        let loss = gpt.loss(&x, &y)?.redistribute(&all_r)?;
        sum += f64::from(loss.to_local().to_scalar::<f32>()?);
    }
    Ok((sum / n as f64) as f32)
}

/// A uniform number in `[0, 1)` from `(seed, i)` (splitmix64).
fn uniform(seed: u64, i: u64) -> f64 {
    let mut z = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for _ in 0..2 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
    }
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The next token from `logits` (the first `vocab` ids: the data's vocabulary), as
/// [`SampleSpec`] says.
fn choose(logits: &[f32], vocab: usize, spec: &SampleSpec, i: u64) -> u32 {
    let logits = &logits[..vocab.min(logits.len())];
    let best = logits
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |b, (k, &l)| {
            if l > b.1 {
                (k, l)
            } else {
                b
            }
        });
    if spec.temperature <= 0.0 {
        return best.0 as u32;
    }
    let max = f64::from(best.1);
    let w: Vec<f64> = logits
        .iter()
        .map(|&l| ((f64::from(l) - max) / spec.temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = uniform(spec.seed, i) * total;
    for (k, wk) in w.iter().enumerate() {
        if u < *wk {
            return k as u32;
        }
        u -= wk;
    }
    best.0 as u32
}

/// Generates `spec.tokens` tokens after `spec.prompt` (collective: every rank runs the same
/// forwards and picks the same tokens from the same gathered logits). The batch has one row per
/// data-parallel rank, all the same context.
fn generate(
    gpt: &Gpt,
    mesh: &DeviceMesh,
    cfg: &TrainConfig,
    spec: &SampleSpec,
    vocab: usize,
) -> Result<Vec<u32>> {
    if spec.prompt.is_empty() {
        return Err(RunError::Config(
            "sampling needs a prompt of at least one token".into(),
        ));
    }
    let placements = gpt.batch_placements();
    let mut rows = 1;
    for (d, p) in placements.iter().enumerate() {
        if *p == Placement::Shard(0) {
            rows *= mesh.size(d)?;
        }
    }
    let dev = mesh.root_comm().device();
    let mut ctx = spec.prompt.clone();
    let mut out = Vec::with_capacity(spec.tokens);
    for i in 0..spec.tokens {
        let window = &ctx[ctx.len().saturating_sub(cfg.gpt.seq_len)..];
        let t = window.len();
        let ids: Vec<u32> = (0..rows).flat_map(|_| window.iter().copied()).collect();
        let ids = distribute_tensor(&Tensor::from_vec(ids, (rows, t), dev)?, mesh, &placements)?;
        let logits = gpt.forward(&ids)?.full_tensor()?;
        let last = logits
            .get(0)?
            .get(t - 1)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let next = choose(&last, vocab, spec, i as u64);
        out.push(next);
        ctx.push(next);
    }
    Ok(out)
}
