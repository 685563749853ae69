//! Training the GPT over a `pp` mesh dim: pipeline parallelism with any schedule of
//! [`candle_dtensor_parallel::pipeline`] (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and
//! ZB-V), optionally replicated over a `dp` dim (plain data parallelism of whole pipelines, or
//! FSDP: each stage's parameters sharded over `dp`), with tensor parallelism (`tp`) or
//! mixture-of-experts blocks and expert parallelism (`ep`) inside the stages.
//!
//! # A step
//!
//! The model is split into `p v` stages ([`GptStage`]; `v` chunks per rank for interleaved
//! schedules): the blocks by [`split_balanced`] on their parameter counts (or
//! [`PipelineSpec::split`]), the embeddings on the first stage, the final norm, head and loss
//! on the last. Each rank builds only its stages' parameters (equal to the one-device model's
//! of the same seed) on its stage mesh: a one-rank sub-mesh, or its `tp` or `ep` group. A step
//! is one [`run_schedule`] over `M` micro-batches: micro-batch `i` is rows
//! `[i B / M, (i + 1) B / M)` of the step's global batch of `B` sequences (gradient
//! accumulation's micro-batch `i`, the rows the one-device run trains on), split over the
//! `D = dp x ep` data-parallel ranks of a stage (raveled in mesh order, as the one-device
//! model's data dims shard a batch): each rank runs `B / (D M)` of its rows. With a tied head
//! the last stage holds a copy of the token table (`GptStage`), kept equal to the first
//! stage's: after the dp reduction the two copies' gradients are summed (the one-device
//! model's gradient of the shared table) over a two-rank communicator of the pipeline ranks
//! holding the first and the last stage (0 and `p - 1` for looped chunks), or in place where
//! one rank holds both (ZB-V's V puts them on rank 0; one rank with several chunks), and both
//! take the same AdamW update; the gradient norm and the parameter count
//! count the table once. The stages accumulate their parameter gradients over the
//! micro-batches; then the gradients are summed over `dp` (one all_reduce per step; with FSDP
//! reduce-scattered, see below), the global gradient norm is taken (one all_reduce over `pp`)
//! when clipping or asked for, and AdamW (as [`crate::fit::Trainer`] sets it up) steps each
//! stage's own parameters.
//!
//! **The loss is normalised as the mean over all tokens of the step**: the last stage scales
//! each micro-batch's mean cross-entropy (over its stage mesh's rows: `ep B / (D M)` of them)
//! by its share of the step's tokens (`ep B / (D M)` rows of `B`), so the micro-batch losses of
//! all replicas add up to the mean over the global batch, and the gradients are those of one
//! batch of all the tokens (up to floating-point summation order). Mixture-of-experts blocks'
//! balancing losses are scaled by the same share, on whichever stage the block is (see below).
//!
//! # Tensor parallelism inside the stages
//!
//! With a `tp` mesh dim each stage runs on its rank's tensor-parallel group with the
//! [`TrainConfig`]'s plan (without sequence parallelism): the hidden states between stages are
//! replicated over `tp`, so every tensor-parallel rank exchanges the whole activation with its
//! counterpart in the next stage (one pipeline per tp coordinate, `pp`'s communicator). The
//! global gradient norm sums a sharded parameter's squares over `tp` and counts a replicated
//! one once; the step's loss is counted by the first tp rank of the last stage.
//!
//! # Mixture of experts and expert parallelism inside the stages
//!
//! With [`GptConfig::moe`](candle_dtensor_models::GptConfig::moe) the stages hold the
//! one-device model's MoE blocks (`GptStage::with_moe`). With an `ep` mesh dim each stage runs
//! on its rank's ep group (one pipeline per dp x ep coordinate, `pp`'s communicator): the
//! micro-batch's rows are `Shard(0)` over `ep`, the experts `Shard(0)` over `ep` (torch.chunk,
//! as without a pipeline), everything else replicated over it; the hidden states between stages
//! are each rank's own rows. One set of MoE communicators serves all of a rank's chunks, built
//! on the `dp` x `ep` sub-mesh of its stage: each forward's count exchange (and so the
//! capacity admission and the balancing loss's assignment fractions `f_i`) spans the whole
//! micro-batch over every data-parallel rank, the dispatch and combine run over `ep`, exactly
//! as one micro-batch of the layout without a pipeline under gradient accumulation; so a
//! pipelined run equals `dp x ep` without a pipeline accumulating the same `M` micro-batches
//! (one device with `grad_accum = M`), the balancing loss included. Each stage's balancing
//! loss (its blocks' sum, the router probabilities' mean over the ep group's rows) is scaled by
//! the micro-batch's share like the cross-entropy: summed over the dp replicas it is the
//! micro-batch's loss (linear in the probabilities' mean), summed over the micro-batches the
//! accumulated one. A non-last stage adds it to its backward's seed (with the gradient from the
//! next stage) and to the step's reported loss; the last stage's is part of its loss output.
//!
//! Gradients are reduced as without a pipeline: a replicated parameter's over `ep` in each
//! micro-batch's backward (the dispatch rule's all_reduce, as on any DTensor mesh) and over
//! `dp` by the step's reduction; an expert's only over `dp` (its tokens came to it over `ep`);
//! the layers add no dp all_reduce of their own (`MoeLayer::without_grad_sync`). FSDP over `dp`
//! shards each rank's ep-local pieces (experts included) as any stage parameter. The global
//! gradient norm counts an expert's squares on its ep rank and a replicated parameter's once
//! (1/ep on each ep rank, summed over `ep`). Checkpoints write the experts' ep shards under
//! their one-device names (every ep rank its rows, replicated parameters from ep rank 0), so a
//! run saved on `ep=2 x pp=2` resumes on `ep=2` without a pipeline, and back. The step's
//! [`RankReport::moe`] holds the balancing loss (summed over the micro-batches and stages), the
//! drops and kept assignments per expert (the last micro-batch's) over the pipeline, and this
//! rank's dispatch and combine times.
//!
//! Without MoE blocks an `ep` dim is one more data dim of the stages (as without a pipeline).
//!
//! # Zero-bubble schedules: the backward split in two
//!
//! A zero-bubble schedule (ZB-H1, ZB-V) runs each micro-batch's backward as two actions: `B`, the
//! input gradient the previous stage waits for, and `W`, the weight gradients, which nobody
//! waits for and which fill what would be bubbles. A GPT stage splits it at its GEMMs, where
//! the work is: every linear (attention's QKV and output projections, the MLP's two, the LM
//! head, the MoE router, in every precision and tensor-parallel layout) is one graph node
//! ([`region::linear`]) whose backward computes `dx = g W` and the bias gradient, and, inside
//! [`region::defer_weight_grads`], leaves `dW = g^T x` undone and hands back its operands. `B`
//! is the stage's backward in that scope; `W` computes the deferred GEMMs and adds each to its
//! parameter (directly when the linear saw the parameter itself, through the weight's graph
//! otherwise: a backward of `sum(W' * dW)` over a cast parameter, say). What is not a GEMM of
//! a linear (norms' and embeddings' gradients, attention's core, the MoE experts' grouped
//! GEMMs) stays in `B`, so `W` is a little under half of a dense stage's backward (the
//! linears' dW is half of their backward; attention's core, a share growing with the sequence
//! length, is all in `B`; measured on the small preset, `W` takes about 0.7 of `B`'s time), and
//! none of an expert's. The forwards of such a schedule record every linear as a node on every
//! device ([`region::splittable_forward`]; on CUDA linears are plain candle ops otherwise).
//! Memory: each linear's input and output gradient `g` are held from `B` until `W` (ZB-H1
//! keeps at most `p` micro-batches waiting for `W`, ZB-V `2 p` chunk micro-batches);
//! `peak_activation_bytes` does not count them, [`PipelineStepReport::peak_deferred_bytes`]
//! does. With FSDP a chunk's reduce_scatter is issued after its last `W`.
//!
//! # FSDP over `dp`
//!
//! With [`TrainConfig::fsdp`] (sharding over `dp`), each rank keeps its stages' parameters as
//! f32 dim-0 shards over its `dp` group (torch.chunk rows of the tensor-parallel-local piece,
//! [`candle_dtensor_parallel::fsdp`]'s rule): the master copies AdamW steps, with their
//! moments. Each chunk of the rank is one unit, like torchtitan's pipeline FSDP:
//!
//! - at the start of a step one all_gather per chunk (over `dp`, all issued before the first
//!   is waited for) refills the chunk's full parameters in place, in the compute dtype;
//! - the full parameters stay gathered for all the step's micro-batches (no re-gather per
//!   micro-batch), and each micro-batch's gradients are summed into one f32 full gradient per
//!   parameter;
//! - after the chunk's last backward of the step (its `M`-th: every forward of the chunk
//!   precedes its backward, so nothing of the chunk runs again this step) one reduce_scatter
//!   (sum over `dp`, f32) is issued asynchronously, so it overlaps the rest of the schedule,
//!   and the chunk's full parameters are released (the storage seam's release, as FSDP's);
//! - after the schedule the reductions are waited for; the tied table's shard gradients are
//!   summed between the first and the last stage (the two ranks share their dp coordinate, so
//!   their shards hold the same rows), the norm's squares add up over `dp` too, and AdamW
//!   steps the shards.
//!
//! So FSDP's collectives run once per step per chunk whatever `M` is (`RankReport::collectives`
//! counts them). **Memory**: between steps a rank holds only its shards (f32), their
//! gradients and AdamW's moments (1/dp of its stages); during a step it also holds every full
//! parameter of its chunks (compute dtype) and one f32 full gradient of each, from the
//! chunk's first backward until its reduce_scatter: what plain dp holds, so FSDP inside a
//! pipeline saves the optimizer state and the parameters' memory between steps, not the peak
//! of a step (torchtitan's choice for pipelines, where re-gathering per micro-batch would
//! multiply the all_gathers by `M`). `reshard_after_forward` does not apply (the chunk stays
//! gathered until its last backward); `separate_rs` gives the reduce_scatters their own
//! communicator split from `dp`'s.
//!
//! Mixed precision (`param_dtype`, e.g. bf16): the full parameters are gathered in
//! `param_dtype`; as without a pipeline, that is storage and communication only: the
//! activations, the hidden states and their gradients sent between stages, the shards, the
//! accumulated gradients, the reduction, the loss and AdamW stay f32 (bf16 parameters cast up
//! where the precision policy computes in f32; `--precision bf16` makes the GEMMs bf16).
//!
//! # Checkpoints
//!
//! `save_dir` / `resume` write and read the format of every other layout: each rank saves its
//! stages' parameters and AdamW moments under their one-device names (the first data-parallel
//! replica writes, or with FSDP every dp rank its shard's rows; the tied head's copy on the
//! last stage is not written twice), so a run saved on `pp=2` resumes on `pp=4`, on `dp=2`
//! without a pipeline, and back, and one saved with FSDP on `dp=2 x pp=2` resumes on FSDP
//! `dp=2`, on `pp=4`, and back.
//!
//! # Not covered
//!
//! Refused before any step ([`RunError::Unsupported`]): HSDP and FSDP over a dim other than
//! `dp`, sequence and context parallelism and mesh dims other than `pp`, `dp`, `tp` and `ep`,
//! `ep` and `tp` together, MoE blocks with a `tp` dim (the MoE communicators would span
//! `dp` x `tp` while the stage's tensors live on `tp`), held-out evaluation, sampling, SGD, fault
//! tolerance and gradient accumulation on top of the micro-batches. MoE settings no layout can
//! run (more ep ranks than experts, `top_k` above the experts) are refused by the MoE
//! communicators before any step, on every rank.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, TensorId, Var};
use candle_dtensor_comm::{Comm, ReduceOp, Work};
use candle_dtensor_core::debug::{self, CommDebugMode, Phase};
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_kernels::profile::Phases;
use candle_dtensor_kernels::region::{self, DeferredWeightGrad};
use candle_dtensor_kernels::storage;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{GptStage, StageInput};
use candle_dtensor_parallel::fsdp::chunk_rows;
use candle_dtensor_parallel::moe::MoeGroups;
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::pipeline::{
    run_schedule, split_balanced, split_explicit, Action, CostModel, PipeComms, PipelineError,
    Schedule, ScheduleKind, Stage, StageError,
};
use candle_dtensor_parallel::tp_plan::{MeshRoles, TpPlan};
use candle_nn::{Optimizer, ParamsAdamW};

use crate::checkpoint::{self, CheckpointError, CheckpointVar, StoreCheckpoint, Which};
use crate::fit::{gpu_mark, gpu_mark_into, take_gpu_phases, StepMarks};
use crate::optim::AdamW;
use crate::trainer::{RankReport, RunError, StepInfo, TrainConfig};

/// How to pipeline the GPT over the mesh's `pp` dim ([`TrainConfig::pipeline`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSpec {
    /// Micro-batches per step (`M`): each pipeline replica's share of the batch is split into
    /// `M` micro-batches of equal size.
    pub micro_batches: usize,
    /// The schedule's generator.
    pub schedule: ScheduleKind,
    /// Model chunks per rank (`v`; interleaved 1F1B only, 1 otherwise).
    pub chunks: usize,
    /// Blocks per stage, in stage order (`None`: balanced by parameter count).
    pub split: Option<Vec<usize>>,
}

impl PipelineSpec {
    /// `micro_batches` micro-batches under `schedule`, one chunk per rank, balanced split.
    pub fn new(schedule: ScheduleKind, micro_batches: usize) -> Self {
        PipelineSpec {
            micro_batches,
            schedule,
            chunks: 1,
            split: None,
        }
    }
}

/// What one pipelined step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineStepReport {
    /// The schedule's bubble fraction from its unit-time simulation (forward 1, backward 2).
    pub analytic_bubble: f64,
    /// The measured bubble of this rank's pipeline: `1 - sum(busy) / (p * max(wall))` over its
    /// `p` stage ranks ([`candle_dtensor_parallel::pipeline::PipelineReport::combined_bubble`]).
    pub measured_bubble: f64,
    /// The schedule's bubble simulated with this step's mean action times over the pipeline
    /// ([`PipelineStepReport::action_ms`]) instead of unit times: what the model's real
    /// forward / backward / `I` / `W` proportions imply on balanced stages with free
    /// transfers. `measured_bubble` above it is the stages' imbalance, the transfers and the
    /// executor's own cost.
    pub modelled_bubble: f64,
    /// Mean time of one action (ms) over the pipeline's ranks this step: forward, full
    /// backward, `I`, `W` (0 for a kind the schedule does not run).
    pub action_ms: [f64; 4],
    /// This rank's own measured bubble (`1 - busy / wall`).
    pub rank_bubble: f64,
    /// Zero-bubble schedules: the linears' weight-gradient GEMMs this rank's `B` actions
    /// deferred to its `W` actions (0 for schedules that do not split the backward).
    pub deferred_weight_grads: usize,
    /// This rank's time in `W` actions (ms; 0 without a split backward).
    pub weight_grad_ms: f64,
    /// The most bytes the deferred weight gradients' operands (each linear's input and output
    /// gradient, from `B` to `W`) held at once on this rank this step: zero-bubble's memory on
    /// top of the activations.
    pub peak_deferred_bytes: usize,
}

/// The checked layout of a pipelined run on one rank.
struct Layout {
    p: usize,
    pp_rank: usize,
    dp_rank: usize,
    /// The `ep` dim's size (1 without one).
    ep: usize,
    /// This rank's index among the `dp x ep` data-parallel ranks of its stage.
    data_rank: usize,
    pp_dim: usize,
    dp_dim: Option<usize>,
    schedule: Schedule,
    ranges: Vec<std::ops::Range<usize>>,
    rows: usize,
}

fn unsupported(what: impl Into<String>) -> RunError {
    RunError::Unsupported(what.into())
}

/// Checks every setting before anything is built (the same on every rank).
fn check(mesh: &DeviceMesh, cfg: &TrainConfig, counts: &[usize]) -> Result<Layout, RunError> {
    let roles = MeshRoles::of(mesh)?;
    let Some(pp_dim) = roles.pp else {
        return Err(RunError::Config(
            "pipeline training needs a pp mesh dim".into(),
        ));
    };
    let Some(spec) = &cfg.pipeline else {
        return Err(RunError::Config(
            "a pp mesh dim needs TrainConfig::pipeline (micro-batches and schedule)".into(),
        ));
    };
    let names = mesh.dim_names();
    if let Some(other) = names.iter().find(|n| !["pp", "dp", "tp", "ep"].contains(n)) {
        return Err(unsupported(format!(
            "pipeline parallelism with mesh dim {other:?} (mesh dims {names:?}): only pp, dp \
             (data-parallel replicas of the pipeline), tp (tensor parallelism inside each \
             stage) and ep (experts sharded inside each stage, a data dim otherwise) are \
             implemented"
        )));
    }
    if roles.ep.is_some() && roles.tp.is_some() {
        return Err(unsupported(format!(
            "pipeline parallelism with both an ep and a tp mesh dim (mesh dims {names:?}): a \
             stage runs on its rank's ep group or on its tp group, not on both"
        )));
    }
    if roles.tp.is_some() && GptStage::has_moe(&cfg.gpt) {
        return Err(unsupported(format!(
            "pipeline parallelism with mixture-of-experts blocks and a tp mesh dim (mesh dims \
             {names:?}): the MoE blocks of a stage run on dp and ep only"
        )));
    }
    if roles.tp.is_some() && cfg.plan.sequence_parallel {
        return Err(unsupported(
            "pipeline parallelism with sequence parallelism".to_string(),
        ));
    }
    let refusals: [(bool, &str); 6] = [
        (cfg.init_from.is_some(), "initialising from a file"),
        (cfg.eval.is_some(), "held-out evaluation"),
        (cfg.sample.is_some(), "sampling"),
        (cfg.sgd, "SGD"),
        (cfg.fault_tolerant, "fault-tolerant training"),
        (
            cfg.grad_accum > 1,
            "gradient accumulation (the pipeline's micro-batches are the accumulation)",
        ),
    ];
    if let Some((_, what)) = refusals.iter().find(|(on, _)| *on) {
        return Err(unsupported(format!("pipeline parallelism with {what}")));
    }
    GptStage::check_config(&cfg.gpt)?;
    let p = mesh.size(pp_dim)?;
    let dp_dim = names.iter().position(|n| *n == "dp");
    if let Some(f) = &cfg.fsdp {
        if let Some(r) = &f.replicate {
            return Err(unsupported(format!(
                "pipeline parallelism with HSDP (FSDP replicated over {r:?}): the stages are \
                 sharded over the dp mesh dim only"
            )));
        }
        if f.shard != "dp" || dp_dim.is_none() {
            return Err(unsupported(format!(
                "pipeline parallelism with FSDP over {:?} (mesh dims {names:?}): the stages are \
                 sharded over the mesh's dp dim (FsdpSpec::shard \"dp\")",
                f.shard
            )));
        }
        if let Some(dt) = f.param_dtype.filter(|d| !d.is_float()) {
            return Err(RunError::Config(format!(
                "FSDP param_dtype {dt:?}: the compute dtype must be floating point"
            )));
        }
    }
    let dp = match dp_dim {
        Some(d) => mesh.size(d)?,
        None => 1,
    };
    let ep = match roles.ep {
        Some(d) => mesh.size(d)?,
        None => 1,
    };
    let m = spec.micro_batches;
    if m == 0 || !cfg.batch.is_multiple_of(dp * ep * m) {
        let (what, rule) = if ep > 1 {
            (format!("dp {dp} and ep {ep}"), "dp x ep x micro-batches")
        } else {
            (format!("dp {dp}"), "dp x micro-batches")
        };
        return Err(RunError::Config(format!(
            "micro-batches {m} with batch {} and {what}: the rule is micro-batches >= 1 and \
             {rule} divides the batch (each pipeline replica runs micro-batches of batch / \
             ({rule}) sequences)",
            cfg.batch
        )));
    }
    let schedule = Schedule::generate(spec.schedule, p, m, spec.chunks)
        .map_err(|e| RunError::Pipeline(Box::new(e.into())))?;
    let stages = schedule.stages();
    let ranges = match &spec.split {
        Some(sizes) => {
            if sizes.len() != stages {
                return Err(RunError::Pipeline(Box::new(PipelineError::Split {
                    layers: cfg.gpt.n_layers,
                    stages,
                    rule: format!(
                        "{} stage sizes {sizes:?} given for {stages} stages (pp {p} x chunks {})",
                        sizes.len(),
                        spec.chunks
                    ),
                })));
            }
            split_explicit(cfg.gpt.n_layers, sizes)
        }
        None => split_balanced(counts, stages),
    }
    .map_err(|e| RunError::Pipeline(Box::new(e)))?;
    let coord = mesh.coordinate();
    // This rank's place among the data-parallel ranks of its stage (dp and ep, raveled in
    // mesh order: the order in which the one-device model's data dims shard the batch).
    let shape = mesh.shape();
    let data_rank = names
        .iter()
        .enumerate()
        .filter(|(_, n)| ["dp", "ep"].contains(n))
        .fold(0, |r, (d, _)| r * shape[d] + coord[d]);
    Ok(Layout {
        p,
        pp_rank: coord[pp_dim],
        dp_rank: dp_dim.map_or(0, |d| coord[d]),
        ep,
        data_rank,
        pp_dim,
        dp_dim,
        schedule,
        ranges,
        rows: cfg.batch / (dp * ep * m),
    })
}

/// A tied head's token table and its copy on the last stage, kept equal: their gradients are
/// summed after the step's dp reduction, and the copy is not counted again (norm, parameter
/// count, checkpoint).
enum Tied {
    /// On two pipeline ranks: a two-rank communicator of them; `idx` is this rank's table
    /// (`copy`: the last stage's).
    Ranks { comm: Comm, idx: usize, copy: bool },
    /// Both on this rank (ZB-V's V, or one pipeline rank with several chunks).
    Local { table: usize, copy: usize },
}

impl Tied {
    /// Whether parameter `i` of this rank is the last stage's copy.
    fn is_copy(&self, i: usize) -> bool {
        match *self {
            Tied::Ranks { idx, copy, .. } => copy && idx == i,
            Tied::Local { copy, .. } => copy == i,
        }
    }
}

/// What a chunk's forward keeps for its backward: the input as a `Var` (not on the first
/// stage) and the output (the scaled loss on the last stage).
struct Saved {
    input: Option<Var>,
    out: Tensor,
    /// A non-last chunk's scaled load-balancing loss (the last chunk's is in `out`).
    aux: Option<Tensor>,
}

/// One rank's chunks of the GPT as an executor [`Stage`].
struct GptPipeStage<'a> {
    parts: &'a [GptStage],
    /// Per chunk: the indices of its parameters in `vars`.
    owned: &'a [std::ops::Range<usize>],
    vars: &'a [Var],
    mesh: &'a DeviceMesh,
    /// The placements of a micro-batch on `mesh`: `Shard(0)` over `ep`, Replicate otherwise.
    batch_pl: &'a [Placement],
    ids: Vec<Tensor>,
    targets: Vec<Tensor>,
    /// Each micro-batch's share of the step's tokens (of the rows of the stage mesh's batch:
    /// `ep` ranks' rows together).
    weight: f64,
    /// The scaled load-balancing losses of the step's forwards (detached), each with whether
    /// it came from a last chunk (whose loss output already holds it).
    aux_losses: Vec<(bool, Tensor)>,
    shape: Shape,
    saved: HashMap<(usize, usize), Saved>,
    /// Accumulated gradient of each var.
    grads: Vec<Option<Tensor>>,
    /// The most autograd-graph bytes one chunk's output kept for backward.
    graph_bytes: usize,
    /// The dtype of the hidden states between stages (f32: the master dtype, whatever FSDP's
    /// param_dtype).
    act_dtype: DType,
    /// FSDP over dp: a chunk's gradients are reduce-scattered after its last backward.
    fsdp: Option<&'a StageFsdp>,
    /// Backwards run per chunk this step.
    backwards: Vec<usize>,
    /// Micro-batches per step (a chunk's last backward is its `micro_batches`-th).
    micro_batches: usize,
    /// FSDP: the chunks' reduce_scatters in flight.
    reducing: Vec<(usize, Work<Tensor>)>,
    /// The schedule splits backward (zero-bubble): forwards record every linear as a node
    /// whose weight gradient `backward_input` can defer.
    split: bool,
    /// Zero-bubble: the weight gradients `backward_input` deferred, per (chunk, micro-batch).
    deferred: HashMap<(usize, usize), Vec<DeferredWeightGrad>>,
    /// The index in `vars` of each parameter tensor.
    var_index: &'a HashMap<TensorId, usize>,
    /// Weight gradients deferred this step.
    deferred_count: usize,
    /// Bytes the deferred weight gradients hold now, and the most this step.
    deferred_bytes: usize,
    peak_deferred_bytes: usize,
}

impl<'a> GptPipeStage<'a> {
    fn part(&self, chunk: usize) -> Result<&'a GptStage, StageError> {
        self.parts
            .get(chunk)
            .ok_or_else(|| format!("chunk {chunk} is not on this rank").into())
    }

    fn local(&self, t: &Tensor) -> Result<DTensor, StageError> {
        Ok(DTensor::from_local(t, self.mesh, self.batch_pl)?)
    }

    /// The forward of [`Stage::forward`]: keeps what the backward needs in `saved`.
    fn forward_graph(
        &mut self,
        chunk: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Tensor, StageError> {
        let part = self.part(chunk)?;
        let ((h, aux), var) = match input {
            None => {
                let ids = self.ids.get(mb).ok_or("micro-batch out of range")?;
                let ids = self.local(ids)?;
                (part.forward_aux(StageInput::Ids(&ids))?, None)
            }
            Some(t) => {
                let v = Var::from_tensor(&t)?;
                let x = self.local(v.as_tensor())?;
                (part.forward_aux(StageInput::Hidden(&x))?, Some(v))
            }
        };
        // The MoE blocks' balancing loss, scaled like the cross-entropy: its share of the
        // step's tokens.
        let aux = aux.map(|a| self.scaled(&a)).transpose()?;
        if let Some(a) = &aux {
            self.aux_losses.push((part.is_last(), a.detach()));
        }
        let (out, aux) = if part.is_last() {
            let y = self.targets.get(mb).ok_or("micro-batch out of range")?;
            let y = self.local(y)?;
            let ce = self.scaled(&part.loss(&h, &y)?)?;
            match aux {
                Some(a) => ((ce + a)?, None),
                None => (ce, None),
            }
        } else {
            (h.to_local().clone(), aux)
        };
        self.graph_bytes = self
            .graph_bytes
            .max(candle_dtensor_core::debug::graph_bytes(&out));
        self.saved.insert(
            (chunk, mb),
            Saved {
                input: var,
                out: out.clone(),
                aux,
            },
        );
        Ok(out)
    }

    /// The backward of `mb` through `chunk` from the saved forward: accumulates the parameters'
    /// gradients and returns the input gradient. With `split` (zero-bubble's `B`) the linears'
    /// weight gradients are left out and returned, for [`Stage::backward_weight`].
    fn run_backward(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
        split: bool,
    ) -> Result<(Option<Tensor>, Vec<DeferredWeightGrad>), StageError> {
        let saved = self.saved.remove(&(chunk, mb)).ok_or_else(|| {
            format!("backward of micro-batch {mb} chunk {chunk} before its forward")
        })?;
        let out = saved.out;
        let backward = move || -> candle_core::Result<GradStore> {
            match (grad_out, saved.aux) {
                (None, _) => out.backward(),
                (Some(g), None) => (out * g)?.sum_all()?.backward(),
                // The chunk's balancing loss joins the gradient from the next stage.
                (Some(g), Some(a)) => {
                    let s = (out * g)?.sum_all()?.to_dtype(a.dtype())?;
                    (s + a)?.backward()
                }
            }
        };
        let (store, deferred) = if split {
            region::defer_weight_grads(backward)
        } else {
            (backward(), Vec::new())
        };
        let store = store?;
        for i in self.owned.get(chunk).cloned().unwrap_or(0..0) {
            if let Some(g) = store.get(self.vars[i].as_tensor()) {
                self.accumulate(i, g)?;
            }
        }
        let input_grad = saved.input.and_then(|v| store.get(v.as_tensor()).cloned());
        Ok((input_grad, deferred))
    }

    /// Adds `g` to parameter `i`'s gradient over the step (in f32 under FSDP: the reduction's
    /// dtype, whatever the compute dtype).
    fn accumulate(&mut self, i: usize, g: &Tensor) -> Result<(), StageError> {
        let g = match self.fsdp {
            Some(_) => g.to_dtype(DType::F32)?,
            None => g.clone(),
        };
        let slot = self
            .grads
            .get_mut(i)
            .ok_or_else(|| format!("pipeline stage: no parameter {i}"))?;
        *slot = Some(match slot.take() {
            Some(acc) => (acc + g)?,
            None => g,
        });
        Ok(())
    }

    /// One more micro-batch's gradients of `chunk` are complete (after its full backward, or
    /// its weight gradients under a zero-bubble schedule). With FSDP, the chunk's last one of
    /// the step issues its reduce_scatter.
    fn chunk_backward_done(&mut self, chunk: usize) -> Result<(), StageError> {
        let Some(f) = self.fsdp else {
            return Ok(());
        };
        let done = self
            .backwards
            .get_mut(chunk)
            .ok_or_else(|| format!("chunk {chunk} is not on this rank"))?;
        *done += 1;
        if *done == self.micro_batches {
            let grads = self
                .owned
                .get(chunk)
                .cloned()
                .unwrap_or(0..0)
                .map(|i| {
                    self.grads[i].take().ok_or_else(|| {
                        format!("pipeline stage: no gradient for parameter {i} of chunk {chunk}")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let work = f.reduce_scatter(chunk, &grads, self.vars)?;
            self.reducing.push((chunk, work));
        }
        Ok(())
    }

    /// A scalar DTensor of the stage mesh (a loss) as this rank's local value scaled by the
    /// micro-batch's share of the step's tokens.
    fn scaled(&self, x: &DTensor) -> Result<Tensor, StageError> {
        let all_r = vec![Placement::Replicate; self.mesh.ndim()];
        Ok(x.redistribute(&all_r)?
            .to_local()
            .to_dtype(DType::F32)?
            .affine(self.weight, 0.0)?)
    }
}

impl Stage for GptPipeStage<'_> {
    fn forward(
        &mut self,
        chunk: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Tensor, StageError> {
        if self.split {
            region::splittable_forward(|| self.forward_graph(chunk, mb, input))
        } else {
            self.forward_graph(chunk, mb, input)
        }
    }

    fn backward(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        let (input_grad, _) = self.run_backward(chunk, mb, grad_out, false)?;
        self.chunk_backward_done(chunk)?;
        Ok(input_grad)
    }

    fn backward_input(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        let (input_grad, deferred) = self.run_backward(chunk, mb, grad_out, true)?;
        self.deferred_count += deferred.len();
        self.deferred_bytes += deferred
            .iter()
            .map(DeferredWeightGrad::held_bytes)
            .sum::<usize>();
        self.peak_deferred_bytes = self.peak_deferred_bytes.max(self.deferred_bytes);
        self.deferred.insert((chunk, mb), deferred);
        Ok(input_grad)
    }

    fn backward_weight(&mut self, chunk: usize, mb: usize) -> Result<(), StageError> {
        let deferred = self.deferred.remove(&(chunk, mb)).ok_or_else(|| {
            format!("weight gradients of micro-batch {mb} chunk {chunk} before its input gradients")
        })?;
        // Each deferred GEMM's dW goes to its parameter: directly when the linear saw the
        // parameter itself, through the weight's graph (a cast, a redistribution) otherwise.
        let mut through: Option<Tensor> = None;
        self.deferred_bytes = self
            .deferred_bytes
            .saturating_sub(deferred.iter().map(DeferredWeightGrad::held_bytes).sum());
        for d in deferred {
            let dw = d.grad()?;
            match self.var_index.get(&d.weight().id()) {
                Some(&i) => self.accumulate(i, &dw)?,
                None => {
                    let term = (d.weight() * dw)?.sum_all()?.to_dtype(DType::F32)?;
                    through = Some(match through {
                        Some(acc) => (acc + term)?,
                        None => term,
                    });
                }
            }
        }
        if let Some(t) = through {
            let store = t.backward()?;
            for i in self.owned.get(chunk).cloned().unwrap_or(0..0) {
                if let Some(g) = store.get(self.vars[i].as_tensor()) {
                    self.accumulate(i, g)?;
                }
            }
        }
        self.chunk_backward_done(chunk)
    }

    fn input_shape(&self, _chunk: usize, _mb: usize) -> Result<(Shape, DType), StageError> {
        Ok((self.shape.clone(), self.act_dtype))
    }

    fn output_shape(&self, _chunk: usize, _mb: usize) -> Result<(Shape, DType), StageError> {
        Ok((self.shape.clone(), self.act_dtype))
    }
}

/// A gradient store holding only `grads` for `vars` (candle has no public empty store: one
/// from the backward of a scratch scalar, whose own entry the optimizer never reads).
fn grad_store(vars: &[Var], grads: Vec<Tensor>, dev: &Device) -> candle_core::Result<GradStore> {
    let scratch = Var::zeros((), DType::F32, dev)?;
    let mut store = scratch.as_tensor().backward()?;
    for (v, g) in vars.iter().zip(grads) {
        store.insert(v.as_tensor(), g);
    }
    Ok(store)
}

// === FSDP of the stages over dp ===

/// One parameter of a rank's stages, sharded over `dp` by FSDP's rule (torch.chunk rows of
/// dim 0 of its tensor-parallel-local piece).
struct ShardParam {
    /// Its index in the rank's full (compute-dtype) vars.
    var: usize,
    name: String,
    /// Rows (dim 0; 1 for a scalar) and elements per row.
    rows: usize,
    row: usize,
    /// Elements of this parameter in a rank's block of a collective (padded rows x row).
    padded: usize,
    /// Its offset in a rank's block (elements).
    offset: usize,
    /// This rank's rows in f32: the master copy AdamW steps.
    shard: Var,
}

/// One chunk's parameters: gathered by one all_gather, reduced by one reduce_scatter per step.
struct ShardUnit {
    params: Vec<ShardParam>,
    /// Elements of one rank's block.
    block: usize,
}

/// FSDP over `dp` of one rank's pipeline stages (see the module docs): each chunk is a unit
/// whose full parameters are gathered at the start of a step and released after the chunk's
/// last backward, when its gradients (summed over the step's micro-batches) are
/// reduce-scattered.
struct StageFsdp {
    /// The dp communicator (all_gathers).
    dp: Comm,
    /// The reduce_scatters' communicator: dp's, or its own split of it
    /// ([`crate::trainer::FsdpSpec::separate_rs`]).
    rs: Comm,
    units: Vec<ShardUnit>,
}

impl StageFsdp {
    /// Shards `initial[i]` (the f32 value of parameter `names[i]`; chunk `c` owns the
    /// consecutive indices `owned[c]`) over `dp`.
    fn new(
        dp: Comm,
        rs: Comm,
        owned: &[std::ops::Range<usize>],
        names: &[String],
        initial: &[Tensor],
    ) -> Result<StageFsdp, RunError> {
        let (n, me) = (dp.size(), dp.rank());
        let mut units = Vec::with_capacity(owned.len());
        let mut next = 0;
        for range in owned {
            if range.start != next {
                return Err(RunError::Config(format!(
                    "pipeline FSDP: chunk parameters {range:?} do not follow {next}"
                )));
            }
            next = range.end;
            let mut params = Vec::with_capacity(range.len());
            let mut block = 0;
            for i in range.clone() {
                let full = initial.get(i).ok_or_else(|| {
                    RunError::Config(format!("pipeline FSDP: no initial value of parameter {i}"))
                })?;
                let dims = full.dims();
                let rows = dims.first().copied().unwrap_or(1);
                let row: usize = dims.iter().skip(1).product();
                let (mine, off) = chunk_rows(rows, n, me);
                let mut shape = dims.to_vec();
                match shape.first_mut() {
                    Some(s0) => *s0 = mine,
                    None => shape = vec![mine],
                }
                let shard = full
                    .detach()
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .narrow(0, off * row, mine * row)?
                    .reshape(shape)?
                    .contiguous()?;
                let padded = rows.div_ceil(n.max(1)) * row;
                params.push(ShardParam {
                    var: i,
                    name: names.get(i).cloned().unwrap_or_default(),
                    rows,
                    row,
                    padded,
                    offset: block,
                    shard: Var::from_tensor(&shard)?,
                });
                block += padded;
            }
            units.push(ShardUnit { params, block });
        }
        Ok(StageFsdp { dp, rs, units })
    }

    /// Every parameter's shard, indexed like the rank's vars.
    fn shards(&self) -> Vec<Var> {
        self.units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.shard.clone()))
            .collect()
    }

    /// Bytes of this rank's shards.
    fn shard_bytes(&self) -> usize {
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| p.shard.elem_count() * p.shard.dtype().size_in_bytes())
            .sum()
    }

    /// The checkpoint entries of the shards: `full` (the stage store's entries, indexed like
    /// the vars) with each var replaced by its shard and its boxes cut to the shard's rows.
    fn checkpoint_vars(&self, full: Vec<CheckpointVar>) -> Vec<CheckpointVar> {
        let (n, me) = (self.dp.size(), self.dp.rank());
        full.into_iter()
            .zip(self.units.iter().flat_map(|u| &u.params))
            .map(|(mut v, p)| {
                let (mine, off) = chunk_rows(p.rows, n, me);
                v.boxes = v
                    .boxes
                    .iter()
                    .filter_map(|b| {
                        let (Some(&lo), Some(&len)) = (b.local_offset.first(), b.shape.first())
                        else {
                            // A scalar: the first shard holds it.
                            return (mine > 0).then(|| b.clone());
                        };
                        let (a, z) = (lo.max(off), (lo + len).min(off + mine));
                        (a < z).then(|| {
                            let mut c = b.clone();
                            c.local_offset[0] = a - off;
                            c.global_offset[0] += a - lo;
                            c.shape[0] = z - a;
                            c
                        })
                    })
                    .collect();
                v.var = p.shard.clone();
                v
            })
            .collect()
    }

    /// Releases every full parameter's storage (until the next [`StageFsdp::gather`]).
    fn release_all(&self, vars: &[Var]) -> Result<usize, RunError> {
        let mut freed = 0;
        for p in self.units.iter().flat_map(|u| &u.params) {
            freed += storage::release(vars[p.var].as_tensor(), &p.name)?;
        }
        Ok(freed)
    }

    /// The start of a step: one all_gather of every chunk's shards over `dp` (all issued, then
    /// waited for), each full parameter refilled in place (in its compute dtype), so the
    /// stages' modules see the values of the last optimizer step.
    fn gather(&self, vars: &[Var]) -> Result<(), RunError> {
        let n = self.dp.size();
        let mut works = Vec::with_capacity(self.units.len());
        for u in &self.units {
            let Some(first) = u.params.first() else {
                works.push(None);
                continue;
            };
            let dtype = vars[first.var].dtype();
            let dev = vars[first.var].device();
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
                    parts.push(Tensor::zeros(pad, dtype, dev)?);
                }
            }
            let send = Tensor::cat(&parts, 0)?;
            let bytes = send.elem_count() * dtype.size_in_bytes() * n;
            debug::record("all_gather", "dp", bytes as u64);
            works.push(Some(self.dp.all_gather_single(&send)?));
        }
        for (u, w) in self.units.iter().zip(works) {
            let Some(w) = w else { continue };
            let gathered = w.wait()?;
            for p in &u.params {
                let segs: Vec<(usize, usize)> = (0..n)
                    .map(|r| (r * u.block + p.offset, chunk_rows(p.rows, n, r).0 * p.row))
                    .collect();
                storage::refill_from_segments(vars[p.var].as_tensor(), &gathered, &segs)?;
            }
        }
        Ok(())
    }

    /// After chunk `unit`'s last backward of the step: issues the reduce_scatter (summed over
    /// `dp`, in f32) of `grads`, its parameters' complete gradients summed over the step's
    /// micro-batches, and releases the chunk's full parameters (nothing of the chunk runs
    /// again this step).
    fn reduce_scatter(
        &self,
        unit: usize,
        grads: &[Tensor],
        vars: &[Var],
    ) -> Result<Work<Tensor>, RunError> {
        let n = self.rs.size();
        let u = self.units.get(unit).ok_or_else(|| {
            RunError::Config(format!("pipeline FSDP: chunk {unit} is not on this rank"))
        })?;
        let flat = grads
            .iter()
            .map(|g| g.to_dtype(DType::F32)?.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut parts = Vec::with_capacity(n * u.params.len() * 2);
        // Rank-major: rank r's rows of every parameter, each padded to its block.
        for r in 0..n {
            for (p, g) in u.params.iter().zip(&flat) {
                let (s, off) = chunk_rows(p.rows, n, r);
                parts.push(g.narrow(0, off * p.row, s * p.row)?);
                let pad = p.padded - s * p.row;
                if pad > 0 {
                    parts.push(Tensor::zeros(pad, DType::F32, g.device())?);
                }
            }
        }
        let send = Tensor::cat(&parts, 0)?;
        let work = {
            let _b = debug::enter_backward(Some(&format!("pp.chunk{unit}")));
            debug::record("reduce_scatter", "dp", (send.elem_count() * 4) as u64);
            self.rs.reduce_scatter_single(&send, ReduceOp::Sum)?
        };
        for p in &u.params {
            storage::release(vars[p.var].as_tensor(), &p.name)?;
        }
        Ok(work)
    }

    /// Waits for the step's reduce_scatters (one per chunk) and returns every parameter's
    /// shard gradient, indexed like the vars.
    fn finish(&self, works: Vec<(usize, Work<Tensor>)>) -> Result<Vec<Tensor>, RunError> {
        let mut out: Vec<Option<Tensor>> =
            vec![None; self.units.iter().map(|u| u.params.len()).sum()];
        for (unit, w) in works {
            let reduced = w.wait()?;
            for p in &self.units[unit].params {
                let g = reduced
                    .narrow(0, p.offset, p.shard.elem_count())?
                    .reshape(p.shard.shape())?;
                out[p.var] = Some(g);
            }
        }
        let names = self.units.iter().flat_map(|u| &u.params).map(|p| &p.name);
        out.into_iter()
            .zip(names)
            .map(|(g, name)| {
                g.ok_or_else(|| {
                    RunError::Config(format!(
                        "pipeline FSDP: the gradient of {name} was not reduced this step (its \
                         chunk ran fewer backwards than micro-batches)"
                    ))
                })
            })
            .collect()
    }
}

/// What the rank's mixture-of-experts layers measured in the step just run (each layer's
/// statistics taken, so they restart every step), as the layout without a pipeline reports
/// it: the dispatch and combine times of this rank's layers, the fewest and most kept
/// assignments of any expert of any layer in its last micro-batch (over the pipeline), the
/// drops (over the pipeline: each stage's layers see the whole micro-batch's counts) and the
/// step's balancing loss (`aux`: this rank's counted share, summed over the world).
fn moe_step(
    parts: &[GptStage],
    aux: f64,
    mesh: &DeviceMesh,
    pp: &Comm,
    dev: &Device,
) -> Result<crate::trainer::MoeStepReport, RunError> {
    let stats: Vec<_> = parts
        .iter()
        .flat_map(GptStage::moe_layers)
        .map(|l| l.take_stats())
        .collect();
    let per_expert = stats
        .iter()
        .flat_map(|s| s.tokens_per_expert.iter().copied());
    let min = per_expert.clone().min().map_or(f64::INFINITY, |x| x as f64);
    let max = per_expert.max().map_or(0.0, |x| x as f64);
    let dropped: usize = stats.iter().map(|s| s.dropped).sum();
    Ok(crate::trainer::MoeStepReport {
        dispatch_ms: stats.iter().map(|s| s.dispatch_ms).sum(),
        combine_ms: stats.iter().map(|s| s.combine_ms).sum(),
        tokens_per_expert_min: sum_over(pp, min, dev, ReduceOp::Min)? as usize,
        tokens_per_expert_max: sum_over(pp, max, dev, ReduceOp::Max)? as usize,
        dropped: sum_over(pp, dropped as f64, dev, ReduceOp::Sum)? as usize,
        aux_loss: sum_over(mesh.root_comm(), aux, dev, ReduceOp::Sum)? as f32,
    })
}

/// A scalar over `comm` (`op`: summed, or its min or max).
fn sum_over(comm: &Comm, x: f64, dev: &Device, op: ReduceOp) -> Result<f64, RunError> {
    Ok(reduce_over(comm, &[x], dev, op)?[0])
}

/// `xs` reduced elementwise over `comm` (one all_reduce, one host read).
fn reduce_over(comm: &Comm, xs: &[f64], dev: &Device, op: ReduceOp) -> Result<Vec<f64>, RunError> {
    let t = Tensor::new(xs, dev)?;
    let t = if comm.size() > 1 {
        comm.all_reduce(&t, op)?.wait()?
    } else {
        t
    };
    candle_dtensor_kernels::storage::note_host_read();
    Ok(t.to_vec1::<f64>()?)
}

/// [`crate::trainer::train_rank`] on a mesh with a `pp` dim; see the module docs.
///
/// # Errors
///
/// Every setting is checked before anything runs, the same on every rank:
/// [`RunError::Unsupported`] for what is not implemented, [`RunError::Config`] for
/// micro-batches that do not divide the batch, [`RunError::Pipeline`] for a schedule whose
/// rule fails (interleaved 1F1B needs `M % p == 0`) or a split leaving a stage empty (more
/// stages than blocks). Then a failed op, transfer or collective.
pub(crate) fn train_rank_pp(
    mesh: &DeviceMesh,
    cfg: &TrainConfig,
    mut on_step: impl FnMut(&StepInfo),
) -> Result<RankReport, RunError> {
    // The stages run on a mesh of this rank alone, of its tensor-parallel group (the mesh's
    // `tp` dim) or of its expert-parallel group (`ep`); dp replicas are reduced by hand.
    let names = mesh.dim_names();
    let has_tp = names.contains(&"tp");
    let has_ep = names.contains(&"ep");
    let solo = if has_tp {
        mesh.slice(&["tp"])?
    } else if has_ep {
        mesh.slice(&["ep"])?
    } else {
        let me = mesh.root_comm().rank();
        let groups: Vec<usize> = vec![me];
        let solo = mesh
            .root_comm()
            .split(&groups, &format!("{}.pp_stage", mesh.root_comm().name()))?
            .ok_or_else(|| RunError::Config("the stage communicator split returned none".into()))?;
        DeviceMesh::new(solo, &[("dp", 1)])?
    };
    let plan = if has_tp {
        cfg.plan.clone()
    } else {
        TpPlan::new()
    };
    let counts = GptStage::block_param_counts(&cfg.gpt, &solo)?;
    let lay = check(mesh, cfg, &counts)?;
    // Mixture-of-experts blocks: one set of communicators for all of the rank's chunks, on
    // the mesh of the stage's data-parallel ranks (dp x ep): each micro-batch's count
    // exchange, capacity and balancing-loss fractions span every data-parallel rank, as one
    // micro-batch of the layout without a pipeline (gradient accumulation) spans them.
    // Collective over the world (every rank builds it, whether its chunks hold MoE blocks or
    // not).
    let moe_groups = match cfg.gpt.moe.as_ref().filter(|_| GptStage::has_moe(&cfg.gpt)) {
        Some(m) => {
            let data: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| ["dp", "ep"].contains(n))
                .collect();
            let gm = if data.is_empty() {
                solo.clone()
            } else {
                mesh.slice(&data)?
            };
            let hidden = m.expert_hidden(cfg.gpt.mlp_ratio * cfg.gpt.d_model);
            Some(MoeGroups::new(&gm, m, cfg.gpt.d_model, hidden)?)
        }
        None => None,
    };
    // A micro-batch on the stage mesh: its rows sharded over ep (the ep group's rows form the
    // stage's batch), replicated over tp.
    let batch_pl: Vec<Placement> = solo
        .dim_names()
        .iter()
        .map(|n| {
            if *n == "ep" {
                Placement::Shard(0)
            } else {
                Placement::Replicate
            }
        })
        .collect();
    let (p, v) = (lay.p, lay.schedule.chunks());
    let stages = p * v;
    // This rank's chunks, their parameters in a store of `dtype` (chunk c owning the
    // parameters `owned[c]`).
    let build = |dtype: DType| -> Result<_, RunError> {
        let mut store = ParamStore::new(&solo, cfg.seed, dtype);
        let mut parts = Vec::with_capacity(v);
        let mut owned = Vec::with_capacity(v);
        for c in 0..v {
            let s = lay.schedule.stage_of(lay.pp_rank, c);
            let before = store.params().len();
            parts.push(GptStage::with_moe(
                &cfg.gpt,
                &solo,
                &plan,
                s,
                stages,
                lay.ranges[s].clone(),
                &mut store,
                moe_groups.as_ref(),
            )?);
            owned.push(before..store.params().len());
        }
        Ok((store, parts, owned))
    };
    // FSDP's mixed precision: the stages' full parameters in `param_dtype`; the master
    // shards, their gradients and the reduction stay f32.
    let act_dtype = cfg
        .fsdp
        .as_ref()
        .and_then(|f| f.param_dtype)
        .unwrap_or(DType::F32);
    let (store, mut parts, owned) = build(act_dtype)?;
    // The activations (and the hidden states between stages) stay in the f32 of the master
    // shards, as in the model without a pipeline: FSDP's param_dtype is storage and
    // communication only, its gathered parameters are cast up where the policy computes in f32.
    for part in &mut parts {
        part.set_master_dtype(DType::F32);
    }
    let vars: Vec<Var> = store.params().iter().map(|p| p.var.clone()).collect();
    let dp_comm = match lay.dp_dim {
        Some(d) => Some(mesh.comm(d)?.clone()),
        None => None,
    };
    let fsdp = match (&cfg.fsdp, &dp_comm) {
        (Some(spec), Some(dc)) => {
            // The initial values in f32 (the one-device model's; the compute store rounds
            // them to param_dtype).
            let initial: Vec<Tensor> = if act_dtype == DType::F32 {
                vars.iter().map(|v| v.as_tensor().clone()).collect()
            } else {
                let (f32_store, _, _) = build(DType::F32)?;
                f32_store
                    .params()
                    .iter()
                    .map(|p| p.var.as_tensor().clone())
                    .collect()
            };
            let rs = if spec.separate_rs {
                let ranks: Vec<usize> = (0..dc.size()).collect();
                dc.split(&ranks, &format!("{}_rs", dc.name()))?
                    .ok_or_else(|| {
                        RunError::Config("the reduce-scatter split returned none".into())
                    })?
            } else {
                dc.clone()
            };
            let names: Vec<String> = store.params().iter().map(|p| p.name.clone()).collect();
            let f = StageFsdp::new(dc.clone(), rs, &owned, &names, &initial)?;
            // Sharded until the first step's gather.
            f.release_all(&vars)?;
            Some(f)
        }
        (Some(_), None) => {
            return Err(RunError::Config("pipeline FSDP needs a dp mesh dim".into()))
        }
        (None, _) => None,
    };
    // What AdamW steps: the f32 shards with FSDP, the stages' parameters without.
    let opt_vars: Vec<Var> = match &fsdp {
        Some(f) => f.shards(),
        None => vars.clone(),
    };
    let mut opt = AdamW::new(
        // candle-nn-style optimizers refuse empty vars (a shard past a small parameter's rows).
        opt_vars
            .iter()
            .filter(|t| t.elem_count() > 0)
            .cloned()
            .collect(),
        ParamsAdamW {
            lr: cfg.schedule.map_or(cfg.lr, |s| s.lr_at(0)),
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        },
    )?;
    for (prm, target) in store.params().iter().zip(&opt_vars) {
        opt.set_decay(
            target,
            cfg.decay_policy.decays(&prm.name, prm.tensor.shape()),
        );
    }
    let pp_comm = mesh.comm(lay.pp_dim)?.clone();
    // The stage mesh's group (tp or ep), whose ranks hold one stage's pieces together.
    let stage_comm = match (has_tp, has_ep) {
        (true, _) => Some(mesh.comm_by_name("tp")?.clone()),
        (_, true) => Some(mesh.comm_by_name("ep")?.clone()),
        _ => None,
    };
    let stage_size = stage_comm.as_ref().map_or(1, Comm::size);
    // The first rank of the stage group counts the stage's (replicated) losses.
    let counts_loss = stage_comm.as_ref().is_none_or(|c| c.rank() == 0);
    let comms = PipeComms::for_schedule(&pp_comm, &lay.schedule)
        .map_err(|e| RunError::Pipeline(Box::new(e)))?;
    // A tied head: the token table of the first stage and its copy on the last.
    let (first_rank, first_chunk) = lay.schedule.place_of(0);
    let (last_rank, last_chunk) = lay.schedule.place_of(stages - 1);
    let table_in = |chunk: usize| -> Result<usize, RunError> {
        owned
            .get(chunk)
            .cloned()
            .unwrap_or(0..0)
            .find(|&i| store.params()[i].name == "tok_emb.weight")
            .ok_or_else(|| {
                RunError::Config(format!(
                    "pipeline rank {}: no token table for the tied head in chunk {chunk}",
                    lay.pp_rank
                ))
            })
    };
    let tied = if !cfg.gpt.tied || stages == 1 {
        None
    } else if first_rank == last_rank {
        // Both on this rank (ZB-V's V, or one rank with several chunks): summed in place.
        (lay.pp_rank == first_rank)
            .then(|| -> Result<_, RunError> {
                Ok(Tied::Local {
                    table: table_in(first_chunk)?,
                    copy: table_in(last_chunk)?,
                })
            })
            .transpose()?
    } else {
        // On two pipeline ranks: summed over a two-rank communicator (collective over pp).
        let ends = [first_rank, last_rank];
        let mine: &[usize] = if ends.contains(&lay.pp_rank) {
            &ends
        } else {
            &[]
        };
        match pp_comm.split(mine, &format!("{}.pp_tied", pp_comm.name()))? {
            Some(comm) => {
                let copy = lay.pp_rank == last_rank;
                let idx = table_in(if copy { last_chunk } else { first_chunk })?;
                Some(Tied::Ranks { comm, idx, copy })
            }
            None => None,
        }
    };
    let dev = solo.root_comm().device().clone();
    let corpus = match &cfg.data {
        Some(c) => c.clone(),
        None => std::sync::Arc::new(cfg.synthetic_corpus()),
    };
    if corpus.vocab() > cfg.gpt.vocab {
        return Err(RunError::Config(format!(
            "the training tokens' vocabulary of {} exceeds the model's {}",
            corpus.vocab(),
            cfg.gpt.vocab
        )));
    }
    let analytic = lay
        .schedule
        .bubble_fraction_with(&CostModel::default())
        .map_err(|e| RunError::Pipeline(Box::new(e.into())))?;
    let holds_last = parts.iter().any(GptStage::is_last);
    let t = cfg.gpt.seq_len;
    let m = lay.schedule.micro_batches();
    // The model's parameter count: the stages hold distinct parameters.
    let copy = (0..store.params().len())
        .filter(|&i| tied.as_ref().is_some_and(|t| t.is_copy(i)))
        .map(|i| store.params()[i].var.elem_count())
        .sum::<usize>();
    let params = sum_over(
        &pp_comm,
        (store.global_numel() - copy) as f64,
        &dev,
        ReduceOp::Sum,
    )? as usize;
    // Checkpoints: every rank saves its stages' parameters (and moments) under their
    // one-device names, written by the first data-parallel replica; the tied head's copy on
    // the last stage is not written again (after the step's sync it equals the first
    // stage's). The format is the one every layout reads, so a run saved on pp=2 resumes on
    // pp=4, on dp=2 without a pipeline, and back.
    if (cfg.resume || cfg.save_every > 0) && cfg.save_dir.is_none() {
        return Err(RunError::Config(
            "resume and save_every need a save_dir".into(),
        ));
    }
    // With FSDP the shards are saved (every data-parallel rank writes its rows).
    let full_vars = store.checkpoint_vars();
    let sharded = fsdp.is_some();
    let ckpt_vars: Vec<CheckpointVar> = match &fsdp {
        Some(f) => f.checkpoint_vars(full_vars),
        None => full_vars,
    }
    .into_iter()
    .enumerate()
    .map(|(i, mut v)| {
        let tied_copy = tied.as_ref().is_some_and(|t| t.is_copy(i));
        v.writer = v.writer && (sharded || lay.dp_rank == 0) && !tied_copy;
        v
    })
    .collect();
    let extra = crate::trainer::checkpoint_extra(cfg, &corpus.fingerprint().to_string());
    let mut start = 0;
    if let (true, Some(dir)) = (cfg.resume, &cfg.save_dir) {
        match checkpoint::load_vars(dir, Which::Latest, Some(mesh), &ckpt_vars, Some(&mut opt)) {
            Ok(info) => {
                start = info.step;
                crate::trainer::warn_data_changes(&info, &extra);
            }
            Err(CheckpointError::NotFound { .. }) => {
                tracing::info!(dir = %dir.display(), "no checkpoint to resume; starting at step 0");
            }
            Err(e) => return Err(e.into()),
        }
    }
    let (param_bytes, param_grad_optim_bytes) = match &fsdp {
        // The f32 shards, their gradients and AdamW's two moments, plus what a step holds
        // unsharded: the full parameters (compute dtype) and their f32 gradients summed over
        // the micro-batches (both kept until the chunk's last backward).
        Some(f) => {
            let full: usize = vars.iter().map(|v| v.elem_count()).sum();
            (
                f.shard_bytes(),
                4 * f.shard_bytes() + store.local_bytes() + 4 * full,
            )
        }
        // This rank's parameters, their gradients and AdamW's two moments (f32), as the
        // GPT run counts them without FSDP.
        None => (store.local_bytes(), 4 * store.local_bytes()),
    };
    let mut report = RankReport {
        start_step: start,
        param_bytes,
        param_grad_optim_bytes,
        params,
        rank: mesh.rank(),
        ..RankReport::default()
    };
    // The setup's reads are not the first step's.
    let _ = candle_dtensor_kernels::storage::take_host_reads();
    // Where a deferred weight gradient's weight is a parameter itself: its index in `vars`.
    let var_index: HashMap<TensorId, usize> = vars
        .iter()
        .enumerate()
        .map(|(i, v)| (v.as_tensor().id(), i))
        .collect();
    // The last step's GPU timing marks, read one step later (as the trainer's).
    let mut pending_gpu: Option<(usize, StepMarks)> = None;
    for step in start..cfg.steps {
        // The collectives of the last step, in the report (as the other layouts count them).
        let mode = (step + 1 == cfg.steps).then(CommDebugMode::start);
        let t0 = Instant::now();
        // GPU time split as the host time is: the schedule (its forwards and backwards
        // interleave, so they are one span, reported as the first phase), the reductions and
        // the gradient norm, the optimizer.
        let mut marks = gpu_mark(&dev).map(Phases::new);
        gpu_mark_into(&mut marks, &dev, StepMarks::forward_start);
        if let Some(f) = &fsdp {
            f.gather(&vars)?;
        }
        let (xs, ys) = corpus.batch(step as u64, cfg.batch, t, cfg.seed);
        // Micro-batch i is rows [i B / M, (i + 1) B / M) of the step's batch (gradient
        // accumulation's micro-batch i), split over the stage's dp x ep data-parallel ranks.
        let mb_rows = |all: &[u32], i: usize| -> candle_core::Result<Tensor> {
            let start = (i * cfg.batch / m + lay.data_rank * lay.rows) * t;
            let rows = &all[start..start + lay.rows * t];
            Tensor::from_slice(rows, (lay.rows, t), &dev)
        };
        let ids = (0..m)
            .map(|i| mb_rows(&xs, i))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let targets = (0..m)
            .map(|i| mb_rows(&ys, i))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut stage = GptPipeStage {
            parts: &parts,
            owned: &owned,
            vars: &vars,
            mesh: &solo,
            batch_pl: &batch_pl,
            ids,
            targets,
            weight: (lay.rows * lay.ep) as f64 / cfg.batch as f64,
            aux_losses: Vec::new(),
            shape: (lay.rows, t, cfg.gpt.d_model).into(),
            saved: HashMap::new(),
            grads: vec![None; vars.len()],
            graph_bytes: 0,
            act_dtype: DType::F32,
            fsdp: fsdp.as_ref(),
            backwards: vec![0; v],
            micro_batches: m,
            reducing: Vec::new(),
            split: lay.schedule.splits_backward(),
            deferred: HashMap::new(),
            var_index: &var_index,
            deferred_count: 0,
            deferred_bytes: 0,
            peak_deferred_bytes: 0,
        };
        let run = run_schedule(&mut stage, &lay.schedule, &comms)
            .map_err(|e| RunError::Pipeline(Box::new(e)))?;
        let fwd_bwd = t0.elapsed();
        gpu_mark_into(&mut marks, &dev, StepMarks::forward_end);
        let deferred_weight_grads = stage.deferred_count;
        let peak_deferred_bytes = stage.peak_deferred_bytes;
        // This rank's busy time and, per kind of action (F, B, I, W), its time and count.
        let mut sums = [0.0f64; 9];
        sums[0] = run.busy.as_secs_f64();
        for st in &run.steps {
            let k = match st.action {
                Action::Forward { .. } => 0,
                Action::Backward { .. } => 1,
                Action::BackwardInput { .. } => 2,
                Action::BackwardWeight { .. } => 3,
            };
            sums[1 + 2 * k] += (st.end - st.start).as_secs_f64();
            sums[2 + 2 * k] += 1.0;
        }
        let weight_grad_ms = sums[7] * 1e3;
        report.peak_activation_bytes = report.peak_activation_bytes.max(stage.graph_bytes);
        let mut grads = Vec::with_capacity(vars.len());
        if let Some(f) = &fsdp {
            // One reduce_scatter per chunk, issued after its last backward: the shards'
            // gradients summed over dp.
            grads = f.finish(std::mem::take(&mut stage.reducing))?;
        } else {
            for (i, g) in stage.grads.into_iter().enumerate() {
                match g {
                    Some(g) => grads.push(g),
                    None => {
                        return Err(RunError::Config(format!(
                            "pipeline stage: no gradient for parameter {}",
                            store.params()[i].name
                        )))
                    }
                }
            }
        }
        // Data-parallel replicas of the pipeline: one all_reduce of every gradient per step.
        if let Some(dc) = dp_comm.as_ref().filter(|c| c.size() > 1 && fsdp.is_none()) {
            let flat = grads
                .iter()
                .map(|g| g.flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            let summed = dc
                .all_reduce(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)?
                .wait()?;
            let mut off = 0;
            for g in grads.iter_mut() {
                let n = g.elem_count();
                *g = summed.narrow(0, off, n)?.reshape(g.shape())?;
                off += n;
            }
        }
        // The tied table: the sum of both copies' gradients on both (with FSDP, of the two
        // copies' shards of the same rows: the two ranks share their dp coordinate).
        match &tied {
            Some(Tied::Ranks { comm, idx, .. }) if grads[*idx].elem_count() > 0 => {
                grads[*idx] = comm.all_reduce(&grads[*idx], ReduceOp::Sum)?.wait()?;
            }
            Some(Tied::Local { table, copy }) => {
                let sum = (&grads[*table] + &grads[*copy])?;
                grads[*copy] = sum.clone();
                grads[*table] = sum;
            }
            _ => {}
        }
        // The global gradient norm: every stage's parameters are distinct (the tied copy
        // counted once), and the dp replicas hold the same sums, so the squares add up over
        // the pipeline.
        let want_norm = cfg.clip.is_some()
            || (cfg.grad_norm_every > 0 && step.is_multiple_of(cfg.grad_norm_every));
        let grad_norm = if want_norm {
            // Over the stage group (tp or ep): a sharded parameter's squares (tp's pieces, ep's
            // experts) add up over its ranks; a replicated one's are the same on each, so each
            // rank counts 1/size of them.
            let counted = grads.iter().enumerate().filter_map(|(i, g)| {
                if tied.as_ref().is_some_and(|t| t.is_copy(i)) {
                    return None;
                }
                let sharded = store.params()[i]
                    .tensor
                    .placements()
                    .iter()
                    .any(|p| p.is_shard());
                Some((g, if sharded { 1 } else { stage_size }))
            });
            let mut sq = 0.0f64;
            if dev.is_cuda() && candle_dtensor_kernels::fused::cuda_enabled() {
                // The multi-tensor norm kernel and one host read, instead of one per parameter.
                let present: Vec<(Tensor, usize)> =
                    counted.map(|(g, copies)| (g.clone(), copies)).collect();
                candle_dtensor_kernels::storage::note_host_read();
                sq = crate::fit::local_sq_fused(&present, &dev)?.to_vec1::<f64>()?[0];
            } else {
                for (g, copies) in counted {
                    candle_dtensor_kernels::storage::note_host_read();
                    sq += (1.0 / copies as f64)
                        * g.to_dtype(DType::F64)?
                            .sqr()?
                            .sum_all()?
                            .to_scalar::<f64>()?;
                }
            }
            if let Some(tc) = stage_comm.as_ref() {
                sq = sum_over(tc, sq, &dev, ReduceOp::Sum)?;
            }
            // FSDP: the dp ranks hold disjoint rows.
            if let (Some(_), Some(dc)) = (&fsdp, &dp_comm) {
                sq = sum_over(dc, sq, &dev, ReduceOp::Sum)?;
            }
            Some(sum_over(&pp_comm, sq, &dev, ReduceOp::Sum)?.sqrt())
        } else {
            None
        };
        // As the library trainer clips, inside AdamW's update: the coefficient multiplies each
        // gradient as the update reads it, instead of a scaled copy of every gradient first.
        let clip = match (cfg.clip, grad_norm) {
            (Some(max), Some(norm)) if norm > max => {
                Some(Tensor::new(&[max / (norm + 1e-6)], &dev)?)
            }
            _ => None,
        };
        let lr = cfg.schedule.map_or(cfg.lr, |s| s.lr_at(step));
        opt.set_learning_rate(lr);
        gpu_mark_into(&mut marks, &dev, StepMarks::backward_end);
        let t_bwd = Instant::now();
        opt.step_clipped(&grad_store(&opt_vars, grads, &dev)?, clip.as_ref())?;
        let t_opt = Instant::now();
        gpu_mark_into(&mut marks, &dev, StepMarks::optimizer_end);
        // The previous step's times: complete by now on its stream (every step reads its
        // gradient norm or loss back), else skipped rather than waited for.
        let gpu_phases = take_gpu_phases(&mut pending_gpu, false);
        pending_gpu = marks.map(|m| (step, m));
        report.gpu_phase_ms.extend(gpu_phases);
        // The step's loss: the last stages' scaled micro-batch losses and the other stages'
        // scaled balancing losses, summed over the world (the ranks of a stage group hold the
        // same losses: the first of them counts them).
        let mut local = 0.0f64;
        let mut aux_local = 0.0f64;
        if counts_loss {
            if holds_last {
                for (_, l) in &run.losses {
                    candle_dtensor_kernels::storage::note_host_read();
                    local += f64::from(l.to_dtype(DType::F32)?.to_scalar::<f32>()?);
                }
            }
            for (last, a) in &stage.aux_losses {
                candle_dtensor_kernels::storage::note_host_read();
                let a = f64::from(a.to_scalar::<f32>()?);
                aux_local += a;
                if !last {
                    local += a;
                }
            }
        }
        let loss = sum_over(mesh.root_comm(), local, &dev, ReduceOp::Sum)? as f32;
        if moe_groups.is_some() {
            report
                .moe
                .push(moe_step(&parts, aux_local, mesh, &pp_comm, &dev)?);
        }
        // The busy time and the per-kind action times and counts over the pipeline: the
        // schedule simulated with these mean costs is the bubble this model's actions imply
        // (the unit-time analytic one assumes F = I = W = B / 2).
        let sums = reduce_over(&pp_comm, &sums, &dev, ReduceOp::Sum)?;
        let busy = sums[0];
        let wall = sum_over(&pp_comm, run.wall.as_secs_f64(), &dev, ReduceOp::Max)?;
        let measured = if wall > 0.0 {
            1.0 - busy / (p as f64 * wall)
        } else {
            0.0
        };
        // The cost model's costs are per rank's share (an action on one of v chunks costs
        // 1/v of it).
        let mean = |k: usize| {
            let n = sums[2 + 2 * k];
            if n > 0.0 {
                sums[1 + 2 * k] / n * v as f64
            } else {
                0.0
            }
        };
        let costs = CostModel {
            forward: mean(0),
            backward: mean(1),
            backward_input: mean(2),
            backward_weight: mean(3),
            p2p: 0.0,
        };
        let modelled = lay
            .schedule
            .bubble_fraction_with(&costs)
            .map_err(|e| RunError::Pipeline(Box::new(e.into())))?;
        report.pipeline.push(PipelineStepReport {
            analytic_bubble: analytic,
            measured_bubble: measured,
            modelled_bubble: modelled,
            action_ms: [mean(0), mean(1), mean(2), mean(3)].map(|c| c * 1e3 / v as f64),
            rank_bubble: run.bubble_fraction(),
            deferred_weight_grads,
            weight_grad_ms,
            peak_deferred_bytes,
        });
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let step_ms = ms(t0.elapsed());
        report.losses.push(loss);
        report.lrs.push(lr);
        report.step_ms.push(step_ms);
        let host_reads = candle_dtensor_kernels::storage::take_host_reads();
        report.host_reads.push(host_reads);
        report
            .phase_ms
            .push([ms(fwd_bwd), ms(t_bwd - t0) - ms(fwd_bwd), ms(t_opt - t_bwd)]);
        if let Some(mode) = mode {
            report.collectives.clear();
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
        on_step(&StepInfo {
            step,
            loss,
            step_ms,
            tokens: cfg.batch * t,
            micro_batches: m,
            lr,
            grad_norm,
            phase_ms: [ms(fwd_bwd), ms(t_bwd - t0) - ms(fwd_bwd), ms(t_opt - t_bwd)],
            exposed_comm_ms: 0.0,
            peak_bytes: report.param_grad_optim_bytes,
            host_reads,
            gpu_phases,
        });
        if let Some(dir) = &cfg.save_dir {
            let done = step + 1;
            if (cfg.save_every > 0 && done.is_multiple_of(cfg.save_every)) || done == cfg.steps {
                let t0 = Instant::now();
                checkpoint::save_vars(dir, done, Some(mesh), &ckpt_vars, Some(&opt), &extra)?;
                report.save_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                report.saved_steps.push(done);
            }
        }
    }
    // The last step's GPU times: one wait, after training.
    report
        .gpu_phase_ms
        .extend(take_gpu_phases(&mut pending_gpu, true));
    Ok(report)
}
