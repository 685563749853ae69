//! Training the GPT over a `pp` mesh dim: pipeline parallelism with any schedule of
//! [`candle_dtensor_parallel::pipeline`] (GPipe, 1F1B, interleaved 1F1B), optionally
//! replicated over a `dp` dim (plain data parallelism of whole pipelines).
//!
//! # A step
//!
//! The model is split into `p v` stages ([`GptStage`]; `v` chunks per rank for interleaved
//! schedules): the blocks by [`split_balanced`] on their parameter counts (or
//! [`PipelineSpec::split`]), the embeddings on the first stage, the final norm, head and loss
//! on the last. Each rank builds only its stages' parameters (equal to the one-device model's
//! of the same seed) on a one-rank sub-mesh. A step is one [`run_schedule`] over `M`
//! micro-batches: pipeline replica `d` of `dp` takes rows `[d B / dp, (d + 1) B / dp)` of the
//! step's global batch of `B` sequences (the rows the one-device run trains on), micro-batch
//! `i` the `i`-th run of `B / (dp M)` of them. With a tied head the last stage holds a copy of
//! the token table (`GptStage`), kept equal to the first stage's: after the dp reduction the
//! two copies' gradients are summed over a two-rank communicator of pipeline ranks 0 and
//! `p - 1` (the one-device model's gradient of the shared table), and both take the same
//! AdamW update; the gradient norm and the parameter count count the table once. The stages accumulate their parameter gradients
//! over the micro-batches; then the gradients are summed over `dp` (one all_reduce per step),
//! the global gradient norm is taken (one all_reduce over `pp`) when clipping or asked for,
//! and AdamW (as [`crate::fit::Trainer`] sets it up) steps each stage's own parameters.
//!
//! **The loss is normalised as the mean over all tokens of the step**: the last stage scales
//! each micro-batch's mean cross-entropy by its share of the step's tokens
//! (`B / (dp M)` rows of `B`), so the micro-batch losses of all replicas add up to the mean over
//! the global batch, and the gradients are those of one batch of all the tokens (up to
//! floating-point summation order).
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
//! # Checkpoints
//!
//! `save_dir` / `resume` write and read the format of every other layout: each rank saves its
//! stages' parameters and AdamW moments under their one-device names (the first data-parallel
//! replica writes; the tied head's copy on the last stage is not written twice), so a run saved
//! on `pp=2` resumes on `pp=4`, on `dp=2` without a pipeline, and back.
//!
//! # Not covered
//!
//! Refused before any step ([`RunError::Unsupported`]): zero-bubble schedules (a GPT stage
//! cannot split its backward into input and weight gradients: candle's autograd computes both
//! operands' gradients of a matmul together, so `BackwardInput` alone cannot be had without
//! hand-written backwards of attention and the norms), FSDP, sequence / context / expert
//! parallelism and mesh dims other than `pp`, `dp` and `tp`, a tied head with one pipeline
//! rank and several chunks (both copies would be on one rank),
//! held-out evaluation, sampling, SGD, fault tolerance, and
//! [`GptStage::check_config`]'s refusal (MoE blocks).

use std::collections::HashMap;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_dtensor_comm::{Comm, ReduceOp};
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{GptStage, StageInput};
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::pipeline::{
    run_schedule, split_balanced, split_explicit, CostModel, PipeComms, PipelineError, Schedule,
    ScheduleKind, Stage, StageError,
};
use candle_dtensor_parallel::tp_plan::{MeshRoles, TpPlan};
use candle_nn::{Optimizer, ParamsAdamW};

use crate::checkpoint::{self, CheckpointError, CheckpointVar, StoreCheckpoint, Which};
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
    /// This rank's own measured bubble (`1 - busy / wall`).
    pub rank_bubble: f64,
}

/// The checked layout of a pipelined run on one rank.
struct Layout {
    p: usize,
    pp_rank: usize,
    dp: usize,
    dp_rank: usize,
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
    if let Some(other) = names.iter().find(|n| !["pp", "dp", "tp"].contains(n)) {
        return Err(unsupported(format!(
            "pipeline parallelism with mesh dim {other:?} (mesh dims {names:?}): only pp, dp \
             (data-parallel replicas of the pipeline) and tp (tensor parallelism inside each \
             stage) are implemented"
        )));
    }
    if roles.tp.is_some() && cfg.plan.sequence_parallel {
        return Err(unsupported(
            "pipeline parallelism with sequence parallelism".to_string(),
        ));
    }
    let refusals: [(bool, &str); 7] = [
        (cfg.fsdp.is_some(), "FSDP"),
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
    let dp = match dp_dim {
        Some(d) => mesh.size(d)?,
        None => 1,
    };
    let m = spec.micro_batches;
    if m == 0 || !cfg.batch.is_multiple_of(dp * m) {
        return Err(RunError::Config(format!(
            "micro-batches {m} with batch {} and dp {dp}: the rule is micro-batches >= 1 and \
             dp x micro-batches divides the batch (each pipeline replica runs micro-batches of \
             batch / (dp x micro-batches) sequences)",
            cfg.batch
        )));
    }
    let schedule = Schedule::generate(spec.schedule, p, m, spec.chunks)
        .map_err(|e| RunError::Pipeline(Box::new(e.into())))?;
    if schedule.splits_backward() {
        return Err(unsupported(format!(
            "schedule {} for the GPT: its stages cannot split backward into input and weight \
             gradients (candle's autograd computes both operands' gradients of a matmul \
             together)",
            schedule.kind()
        )));
    }
    let stages = schedule.stages();
    if cfg.gpt.tied && p == 1 && stages > 1 {
        return Err(unsupported(format!(
            "a tied head with pp=1 and {stages} chunks (the first and the last stage would hold \
             two copies of the token table on one rank)"
        )));
    }
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
    Ok(Layout {
        p,
        pp_rank: coord[pp_dim],
        dp,
        dp_rank: dp_dim.map_or(0, |d| coord[d]),
        pp_dim,
        dp_dim,
        schedule,
        ranges,
        rows: cfg.batch / (dp * m),
    })
}

/// What a chunk's forward keeps for its backward: the input as a `Var` (not on the first
/// stage) and the output (the scaled loss on the last stage).
struct Saved {
    input: Option<Var>,
    out: Tensor,
}

/// One rank's chunks of the GPT as an executor [`Stage`].
struct GptPipeStage<'a> {
    parts: &'a [GptStage],
    /// Per chunk: the indices of its parameters in `vars`.
    owned: &'a [std::ops::Range<usize>],
    vars: &'a [Var],
    mesh: &'a DeviceMesh,
    ids: Vec<Tensor>,
    targets: Vec<Tensor>,
    /// Each micro-batch's share of the step's tokens.
    weight: f64,
    shape: Shape,
    saved: HashMap<(usize, usize), Saved>,
    /// Accumulated gradient of each var.
    grads: Vec<Option<Tensor>>,
    /// The most autograd-graph bytes one chunk's output kept for backward.
    graph_bytes: usize,
}

impl GptPipeStage<'_> {
    fn part(&self, chunk: usize) -> Result<&GptStage, StageError> {
        self.parts
            .get(chunk)
            .ok_or_else(|| format!("chunk {chunk} is not on this rank").into())
    }

    fn local(&self, t: &Tensor) -> Result<DTensor, StageError> {
        Ok(DTensor::from_local(t, self.mesh, &[Placement::Replicate])?)
    }
}

impl Stage for GptPipeStage<'_> {
    fn forward(
        &mut self,
        chunk: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Tensor, StageError> {
        let part = self.part(chunk)?;
        let (h, var) = match input {
            None => {
                let ids = self.ids.get(mb).ok_or("micro-batch out of range")?;
                let ids = self.local(ids)?;
                (part.forward(StageInput::Ids(&ids))?, None)
            }
            Some(t) => {
                let v = Var::from_tensor(&t)?;
                let x = self.local(v.as_tensor())?;
                (part.forward(StageInput::Hidden(&x))?, Some(v))
            }
        };
        let out = if part.is_last() {
            let y = self.targets.get(mb).ok_or("micro-batch out of range")?;
            let y = self.local(y)?;
            part.loss(&h, &y)?.to_local().affine(self.weight, 0.0)?
        } else {
            h.to_local().clone()
        };
        self.graph_bytes = self
            .graph_bytes
            .max(candle_dtensor_core::debug::graph_bytes(&out));
        self.saved.insert(
            (chunk, mb),
            Saved {
                input: var,
                out: out.clone(),
            },
        );
        Ok(out)
    }

    fn backward(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        let saved = self.saved.remove(&(chunk, mb)).ok_or_else(|| {
            format!("backward of micro-batch {mb} chunk {chunk} before its forward")
        })?;
        let store = match grad_out {
            None => saved.out.backward()?,
            Some(g) => (saved.out * g)?.sum_all()?.backward()?,
        };
        let owned = self.owned.get(chunk).cloned().unwrap_or(0..0);
        for i in owned {
            let var = &self.vars[i];
            let Some(g) = store.get(var.as_tensor()) else {
                continue;
            };
            self.grads[i] = Some(match self.grads[i].take() {
                Some(acc) => (acc + g)?,
                None => g.clone(),
            });
        }
        Ok(saved.input.and_then(|v| store.get(v.as_tensor()).cloned()))
    }

    fn input_shape(&self, _chunk: usize, _mb: usize) -> Result<(Shape, DType), StageError> {
        Ok((self.shape.clone(), DType::F32))
    }

    fn output_shape(&self, _chunk: usize, _mb: usize) -> Result<(Shape, DType), StageError> {
        Ok((self.shape.clone(), DType::F32))
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

/// A scalar summed over `comm`.
fn sum_over(comm: &Comm, x: f64, dev: &Device, op: ReduceOp) -> Result<f64, RunError> {
    let t = Tensor::new(&[x], dev)?;
    let t = if comm.size() > 1 {
        comm.all_reduce(&t, op)?.wait()?
    } else {
        t
    };
    Ok(t.to_vec1::<f64>()?[0])
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
    // The stages run on a mesh of this rank alone, or of its tensor-parallel group (the
    // mesh's `tp` dim); dp replicas are reduced by hand.
    let has_tp = mesh.dim_names().contains(&"tp");
    let solo = if has_tp {
        mesh.slice(&["tp"])?
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
    let (p, v) = (lay.p, lay.schedule.chunks());
    let stages = p * v;
    let mut store = ParamStore::new(&solo, cfg.seed, DType::F32);
    let mut parts = Vec::with_capacity(v);
    let mut owned = Vec::with_capacity(v);
    for c in 0..v {
        let s = c * p + lay.pp_rank;
        let before = store.params().len();
        parts.push(GptStage::new(
            &cfg.gpt,
            &solo,
            &plan,
            s,
            stages,
            lay.ranges[s].clone(),
            &mut store,
        )?);
        owned.push(before..store.params().len());
    }
    let vars: Vec<Var> = store.params().iter().map(|p| p.var.clone()).collect();
    let mut opt = AdamW::new(
        vars.clone(),
        ParamsAdamW {
            lr: cfg.schedule.map_or(cfg.lr, |s| s.lr_at(0)),
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        },
    )?;
    for prm in store.params() {
        opt.set_decay(
            &prm.var,
            cfg.decay_policy.decays(&prm.name, prm.tensor.shape()),
        );
    }
    let pp_comm = mesh.comm(lay.pp_dim)?.clone();
    let tp_comm = if has_tp {
        Some(mesh.comm_by_name("tp")?.clone())
    } else {
        None
    };
    let tp_size = tp_comm.as_ref().map_or(1, Comm::size);
    let dp_comm = match lay.dp_dim {
        Some(d) => Some(mesh.comm(d)?.clone()),
        None => None,
    };
    let comms = PipeComms::new(&pp_comm).map_err(|e| RunError::Pipeline(Box::new(e)))?;
    // A tied head: the token table's copies on pipeline ranks 0 and p - 1 (collective over pp).
    let tied = if cfg.gpt.tied && p > 1 {
        let ends = [0, p - 1];
        let mine: &[usize] = if ends.contains(&lay.pp_rank) {
            &ends
        } else {
            &[]
        };
        let comm = pp_comm.split(mine, &format!("{}.pp_tied", pp_comm.name()))?;
        match comm {
            Some(c) => {
                let idx = store
                    .params()
                    .iter()
                    .position(|q| q.name == "tok_emb.weight")
                    .ok_or_else(|| {
                        RunError::Config(format!(
                            "pipeline rank {}: no token table for the tied head",
                            lay.pp_rank
                        ))
                    })?;
                // The last stage's copy is not counted again (norm, parameter count).
                Some((c, idx, lay.pp_rank == p - 1))
            }
            None => None,
        }
    } else {
        None
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
    let copy = match &tied {
        Some((_, idx, true)) => store.params()[*idx].var.elem_count(),
        _ => 0,
    };
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
    let ckpt_vars: Vec<CheckpointVar> = store
        .checkpoint_vars()
        .into_iter()
        .enumerate()
        .map(|(i, mut v)| {
            let tied_copy = matches!(&tied, Some((_, idx, true)) if *idx == i);
            v.writer = v.writer && lay.dp_rank == 0 && !tied_copy;
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
    let mut report = RankReport {
        start_step: start,
        param_bytes: store.local_bytes(),
        // This rank's parameters, their gradients and AdamW's two moments (f32), as the
        // GPT run counts them without FSDP.
        param_grad_optim_bytes: 4 * store.local_bytes(),
        params,
        rank: mesh.rank(),
        ..RankReport::default()
    };
    for step in start..cfg.steps {
        let t0 = Instant::now();
        let (xs, ys) = corpus.batch(step as u64, cfg.batch, t, cfg.seed);
        let first_row = lay.dp_rank * cfg.batch / lay.dp;
        let mb_rows = |all: &[u32], i: usize| -> candle_core::Result<Tensor> {
            let start = (first_row + i * lay.rows) * t;
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
            ids,
            targets,
            weight: lay.rows as f64 / cfg.batch as f64,
            shape: (lay.rows, t, cfg.gpt.d_model).into(),
            saved: HashMap::new(),
            grads: vec![None; vars.len()],
            graph_bytes: 0,
        };
        let run = run_schedule(&mut stage, &lay.schedule, &comms)
            .map_err(|e| RunError::Pipeline(Box::new(e)))?;
        let fwd_bwd = t0.elapsed();
        report.peak_activation_bytes = report.peak_activation_bytes.max(stage.graph_bytes);
        let mut grads = Vec::with_capacity(vars.len());
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
        // Data-parallel replicas of the pipeline: one all_reduce of every gradient per step.
        if let Some(dc) = dp_comm.as_ref().filter(|c| c.size() > 1) {
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
        // The tied table: the sum of both copies' gradients on both.
        if let Some((c, idx, _)) = &tied {
            grads[*idx] = c.all_reduce(&grads[*idx], ReduceOp::Sum)?.wait()?;
        }
        // The global gradient norm: every stage's parameters are distinct (the tied copy
        // counted once), and the dp replicas hold the same sums, so the squares add up over
        // the pipeline.
        let want_norm = cfg.clip.is_some()
            || (cfg.grad_norm_every > 0 && step.is_multiple_of(cfg.grad_norm_every));
        let grad_norm = if want_norm {
            // Over tp: a sharded parameter's squares add up over the tp ranks; a replicated
            // one's are the same on each, so each rank counts 1/tp of them.
            let mut sq = 0.0f64;
            for (i, g) in grads.iter().enumerate() {
                if matches!(&tied, Some((_, idx, true)) if *idx == i) {
                    continue;
                }
                let share = if store.params()[i]
                    .tensor
                    .placements()
                    .iter()
                    .any(|p| p.is_shard())
                {
                    1.0
                } else {
                    1.0 / tp_size as f64
                };
                sq += share
                    * g.to_dtype(DType::F64)?
                        .sqr()?
                        .sum_all()?
                        .to_scalar::<f64>()?;
            }
            if let Some(tc) = tp_comm.as_ref() {
                sq = sum_over(tc, sq, &dev, ReduceOp::Sum)?;
            }
            Some(sum_over(&pp_comm, sq, &dev, ReduceOp::Sum)?.sqrt())
        } else {
            None
        };
        if let (Some(max), Some(norm)) = (cfg.clip, grad_norm) {
            if norm > max {
                // As the library trainer clips.
                let scale = max / (norm + 1e-6);
                for g in grads.iter_mut() {
                    *g = g.affine(scale, 0.0)?;
                }
            }
        }
        let lr = cfg.schedule.map_or(cfg.lr, |s| s.lr_at(step));
        opt.set_learning_rate(lr);
        let t_bwd = Instant::now();
        opt.step(&grad_store(&vars, grads, &dev)?)?;
        let t_opt = Instant::now();
        // The step's loss: the last stages' scaled micro-batch losses summed over the world
        // (the tp ranks of a last stage hold the same loss: the first of them counts it).
        let mut local = 0.0f64;
        if holds_last && tp_comm.as_ref().is_none_or(|c| c.rank() == 0) {
            for (_, l) in &run.losses {
                local += f64::from(l.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            }
        }
        let loss = sum_over(mesh.root_comm(), local, &dev, ReduceOp::Sum)? as f32;
        let busy = sum_over(&pp_comm, run.busy.as_secs_f64(), &dev, ReduceOp::Sum)?;
        let wall = sum_over(&pp_comm, run.wall.as_secs_f64(), &dev, ReduceOp::Max)?;
        let measured = if wall > 0.0 {
            1.0 - busy / (p as f64 * wall)
        } else {
            0.0
        };
        report.pipeline.push(PipelineStepReport {
            analytic_bubble: analytic,
            measured_bubble: measured,
            rank_bubble: run.bubble_fraction(),
        });
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let step_ms = ms(t0.elapsed());
        report.losses.push(loss);
        report.lrs.push(lr);
        report.step_ms.push(step_ms);
        report
            .phase_ms
            .push([ms(fwd_bwd), ms(t_bwd - t0) - ms(fwd_bwd), ms(t_opt - t_bwd)]);
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
    Ok(report)
}
