//! Shared by `examples/train_llama.rs` and `tests/llama.rs`: a llama-architecture model written
//! as a user writes one (candle-nn layers, `candle_dtensor::nn`'s differentiable drop-ins, and
//! optionally `candle_dtensor::parallel::tp_nn`'s tensor-parallel layers), candle-transformers'
//! own llama, and their training: on one device a hand-written candle-nn loop (the reference),
//! as one rank of FSDP (x TP) the library trainer (`candle_dtensor::train::fit::Trainer`),
//! recording losses and every gradient so the two can be compared.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use candle_core::{DType, Device, Module, Tensor};
use candle_dtensor::kernels::compare::{
    abs_sum, compare_series_f32, max_abs_diff, nan_max, Mismatch, SeriesDiff,
};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::nn::{ops, rms_norm, rotary_emb, RmsNorm};
use candle_dtensor::parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor::parallel::fsdp_vb::{reference_var_builder, FsdpVarMap, ROOT_UNIT};
use candle_dtensor::parallel::tp_nn::{self, Group, TpLinearConfig};
use candle_dtensor::strategies::layout::shard_size_and_offset;
use candle_dtensor::train::data::Corpus;
use candle_dtensor::train::fit::{TrainVars, Trainer, TrainerConfig};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};

/// Boxed error of a run.
pub type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Model sizes (shared by both models; no grouped-query attention).
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Vocabulary.
    pub vocab: usize,
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Longest sequence.
    pub max_seq: usize,
}

impl Sizes {
    /// A tiny llama: vocab 64, width 32, 4 heads, MLP 64, 2 blocks.
    pub fn tiny() -> Self {
        Sizes {
            vocab: 64,
            hidden: 32,
            intermediate: 64,
            layers: 2,
            heads: 4,
            max_seq: 64,
        }
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

const EPS: f64 = 1e-5;
const ROPE_THETA: f32 = 10_000.0;

/// candle-transformers' llama config for `s`.
pub fn transformers_config(s: &Sizes) -> candle_transformers::models::llama::Config {
    candle_transformers::models::llama::Config {
        hidden_size: s.hidden,
        intermediate_size: s.intermediate,
        vocab_size: s.vocab,
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: s.heads,
        use_flash_attn: false,
        rms_norm_eps: EPS,
        rope_theta: ROPE_THETA,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: s.max_seq,
        tie_word_embeddings: false,
    }
}

// ---------------------------------------------------------------------------------------------
// The user's own llama.

/// Global ranges (per dim) of a rank's piece of each parameter, by name (absent: the whole).
pub type Pieces = HashMap<String, Vec<Range<usize>>>;

struct Attention {
    q: Box<dyn Module>,
    k: Box<dyn Module>,
    v: Box<dyn Module>,
    o: Box<dyn Module>,
    heads: usize,
    head_dim: usize,
}

struct Block {
    input_layernorm: RmsNorm,
    attn: Attention,
    post_attention_layernorm: RmsNorm,
    gate: Box<dyn Module>,
    up: Box<dyn Module>,
    down: Box<dyn Module>,
}

/// A llama written with candle-nn's `linear_no_bias` / `embedding` (or the tensor-parallel
/// `tp_nn` layers) and `candle_dtensor::nn`'s `rms_norm`, `softmax_last_dim` and `rope`: every
/// parameter gets its gradient. Parameter names are the Hugging Face ones, as in
/// candle-transformers (`model.layers.{i}.self_attn.q_proj.weight`, ...).
pub struct OwnLlama {
    embed: Box<dyn Module>,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Box<dyn Module>,
    cos: Tensor,
    sin: Tensor,
    /// This rank's pieces of the tensor-parallel parameters.
    pub pieces: Pieces,
}

/// Builds linears either as candle-nn's or split over a tensor-parallel group, recording the
/// pieces.
struct Linears<'a> {
    tp: Option<&'a Group>,
    pieces: Pieces,
}

/// How a linear's weight is split under tensor parallelism.
#[derive(Clone, Copy)]
enum Split {
    /// By output features (column-parallel).
    Outputs,
    /// By input features (row-parallel).
    Inputs,
}

/// A layer and the global ranges of its weight this rank holds.
type SplitLayer = (Box<dyn Module>, Vec<Range<usize>>);

impl Linears<'_> {
    /// The layer `whole` builds on one device, or under TP the piece `split` builds (recorded
    /// under `<prefix>.weight`).
    fn layer<'v>(
        &mut self,
        vb: VarBuilder<'v>,
        whole: impl FnOnce(VarBuilder<'v>) -> candle_core::Result<Box<dyn Module>>,
        split: impl FnOnce(&Group, VarBuilder<'v>) -> candle_core::Result<SplitLayer>,
    ) -> candle_core::Result<Box<dyn Module>> {
        let Some(tp) = self.tp else {
            return whole(vb);
        };
        let name = format!("{}.weight", vb.prefix());
        let (layer, piece) = split(tp, vb)?;
        self.pieces.insert(name, piece);
        Ok(layer)
    }

    /// `linear_no_bias(i, o)`, split in blocks of `block` under TP.
    fn linear(
        &mut self,
        split: Split,
        i: usize,
        o: usize,
        block: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Box<dyn Module>> {
        self.layer(
            vb,
            |vb| Ok(Box::new(candle_nn::linear_no_bias(i, o, vb)?)),
            |tp, vb| {
                let cfg = TpLinearConfig { bias: false, block };
                Ok(match split {
                    Split::Outputs => {
                        let l = tp_nn::ColumnParallelLinear::new(i, o, cfg, tp, vb)?;
                        let piece = vec![l.out_range(), 0..i];
                        (Box::new(l), piece)
                    }
                    Split::Inputs => {
                        let l = tp_nn::RowParallelLinear::new(i, o, cfg, tp, vb)?;
                        let piece = vec![0..o, l.in_range()];
                        (Box::new(l), piece)
                    }
                })
            },
        )
    }

    /// `embedding(vocab, hidden)`, split by vocabulary rows under TP.
    fn embedding(
        &mut self,
        vocab: usize,
        hidden: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Box<dyn Module>> {
        self.layer(
            vb,
            |vb| Ok(Box::new(candle_nn::embedding(vocab, hidden, vb)?)),
            |tp, vb| {
                let e = tp_nn::vocab_parallel_embedding(vocab, hidden, tp, vb)?;
                let piece = vec![e.vocab_range(), 0..hidden];
                Ok((Box::new(e), piece))
            },
        )
    }

    /// The LM head `linear_no_bias(hidden, vocab)`, split by vocabulary rows under TP with its
    /// output gathered.
    fn lm_head(
        &mut self,
        hidden: usize,
        vocab: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Box<dyn Module>> {
        self.layer(
            vb,
            |vb| Ok(Box::new(candle_nn::linear_no_bias(hidden, vocab, vb)?)),
            |tp, vb| {
                let h = tp_nn::column_parallel_linear_no_bias(hidden, vocab, tp, vb)?
                    .with_gather_output(true);
                let piece = vec![h.out_range(), 0..hidden];
                Ok((Box::new(h), piece))
            },
        )
    }
}

impl OwnLlama {
    /// Builds the model from `vb`; with `tp`, the attention (by heads), the MLP, the embedding
    /// (by vocabulary rows) and the LM head (output gathered) are split over that group.
    pub fn new(s: &Sizes, vb: VarBuilder, tp: Option<&Group>) -> candle_core::Result<Self> {
        let hd = s.head_dim();
        let mut lin = Linears {
            tp,
            pieces: Pieces::new(),
        };
        let m = vb.pp("model");
        let embed = lin.embedding(s.vocab, s.hidden, m.pp("embed_tokens"))?;
        let mut blocks = Vec::with_capacity(s.layers);
        let mut heads = s.heads;
        for i in 0..s.layers {
            let b = m.pp(format!("layers.{i}"));
            let a = b.pp("self_attn");
            let q = lin.linear(Split::Outputs, s.hidden, s.hidden, hd, a.pp("q_proj"))?;
            let k = lin.linear(Split::Outputs, s.hidden, s.hidden, hd, a.pp("k_proj"))?;
            let v = lin.linear(Split::Outputs, s.hidden, s.hidden, hd, a.pp("v_proj"))?;
            let o = lin.linear(Split::Inputs, s.hidden, s.hidden, hd, a.pp("o_proj"))?;
            if let Some(r) = lin.pieces.get(&format!("{}.q_proj.weight", a.prefix())) {
                heads = r[0].len() / hd;
            }
            let mlp = b.pp("mlp");
            blocks.push(Block {
                input_layernorm: rms_norm(s.hidden, EPS, b.pp("input_layernorm"))?,
                attn: Attention {
                    q,
                    k,
                    v,
                    o,
                    heads,
                    head_dim: hd,
                },
                post_attention_layernorm: rms_norm(
                    s.hidden,
                    EPS,
                    b.pp("post_attention_layernorm"),
                )?,
                gate: lin.linear(
                    Split::Outputs,
                    s.hidden,
                    s.intermediate,
                    1,
                    mlp.pp("gate_proj"),
                )?,
                up: lin.linear(
                    Split::Outputs,
                    s.hidden,
                    s.intermediate,
                    1,
                    mlp.pp("up_proj"),
                )?,
                down: lin.linear(
                    Split::Inputs,
                    s.intermediate,
                    s.hidden,
                    1,
                    mlp.pp("down_proj"),
                )?,
            });
        }
        let norm = rms_norm(s.hidden, EPS, m.pp("norm"))?;
        let lm_head = lin.lm_head(s.hidden, s.vocab, vb.pp("lm_head"))?;
        // Rotary tables: position p, frequency theta^(-2j/d).
        let inv: Vec<f32> = (0..hd / 2)
            .map(|j| ROPE_THETA.powf(-((2 * j) as f32) / hd as f32))
            .collect();
        let angles: Vec<f32> = (0..s.max_seq)
            .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (s.max_seq, hd / 2), vb.device())?;
        Ok(OwnLlama {
            embed,
            blocks,
            norm,
            lm_head,
            cos: angles.cos()?,
            sin: angles.sin()?,
            pieces: lin.pieces,
        })
    }

    fn block(&self, b: &Block, x: &Tensor) -> candle_core::Result<Tensor> {
        let (bs, t, _) = x.dims3()?;
        let a = &b.attn;
        let h = b.input_layernorm.forward(x)?;
        let heads = |y: Tensor| -> candle_core::Result<Tensor> {
            y.reshape((bs, t, a.heads, a.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (cos, sin) = (self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?);
        let q = rotary_emb::rope(&heads(a.q.forward(&h)?)?, &cos, &sin)?;
        let k = rotary_emb::rope(&heads(a.k.forward(&h)?)?, &cos, &sin)?;
        let v = heads(a.v.forward(&h)?)?;
        let scores = (q.matmul(&k.t()?)? / (a.head_dim as f64).sqrt())?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?;
        let att = ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((bs, t, a.heads * a.head_dim))?;
        let x = (x + a.o.forward(&y)?)?;
        let h = b.post_attention_layernorm.forward(&x)?;
        let mlp = (b.gate.forward(&h)?.silu()? * b.up.forward(&h)?)?;
        x + b.down.forward(&mlp)?
    }

    /// Logits `[B, T, vocab]` of token ids `[B, T]`. With `fsdp`, the forward runs as the
    /// root unit and each block as its own unit (released after its forward, re-gathered for
    /// its backward).
    pub fn forward(&self, ids: &Tensor, fsdp: Option<&FsdpVarMap>) -> candle_core::Result<Tensor> {
        let body = || -> candle_core::Result<Tensor> {
            let mut x = self.embed.forward(ids)?;
            for (i, b) in self.blocks.iter().enumerate() {
                x = match fsdp {
                    Some(map) => map.forward(&format!("model.layers.{i}"), || self.block(b, &x))?,
                    None => self.block(b, &x)?,
                };
            }
            self.lm_head.forward(&self.norm.forward(&x)?)
        };
        match fsdp {
            Some(map) => Ok(map.forward(ROOT_UNIT, body)?),
            None => body(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One training loop for both models, on one device or as one rank.

/// Which model trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `candle_transformers::models::llama::Llama`, unmodified: its loss is on the last
    /// position (its forward returns only those logits).
    Transformers,
    /// [`OwnLlama`]: the loss is on every position.
    Own,
}

/// What to train.
#[derive(Debug, Clone)]
pub struct Run {
    /// The model.
    pub arch: Arch,
    /// Its sizes.
    pub sizes: Sizes,
    /// Steps.
    pub steps: usize,
    /// Global batch (sequences per step).
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Seed of the parameters and the data.
    pub seed: u64,
    /// Keep every step's gradients in the report (on the host, for [`compare`]); off, a rank
    /// copies nothing off its device.
    pub keep_grads: bool,
}

/// What a run saw (on a rank: its shards).
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Global mean loss per step.
    pub losses: Vec<f32>,
    /// Per step, the gradient of every parameter that got one (this rank's shard); empty
    /// unless [`Run::keep_grads`].
    pub grads: Vec<BTreeMap<String, Tensor>>,
    /// Global ranges of this rank's tensor-parallel pieces (absent: the whole parameter).
    pub pieces: Pieces,
    /// FSDP group size and this rank's index in it (`(1, 0)` on one device).
    pub dp: (usize, usize),
    /// Every parameter name.
    pub params: Vec<String>,
    /// What FSDP reported without a gradient in the last step.
    pub without_grad: Vec<String>,
    /// The FSDP units.
    pub units: Vec<String>,
}

/// The global batch of `step`: ids and next-token targets `[batch, seq]`.
fn batch(run: &Run, corpus: &Corpus, step: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let (x, y) = corpus.batch(step as u64, run.batch, run.seq, run.seed);
    Ok((
        Tensor::from_vec(x, (run.batch, run.seq), &Device::Cpu)?,
        Tensor::from_vec(y, (run.batch, run.seq), &Device::Cpu)?,
    ))
}

fn corpus(run: &Run) -> Corpus {
    Corpus::synthetic(run.sizes.vocab, 1 << 14, run.seed ^ 0x11A3A)
}

/// A built model with its forward-to-loss.
enum Model {
    Transformers(
        candle_transformers::models::llama::Llama,
        candle_transformers::models::llama::Cache,
    ),
    Own(OwnLlama),
}

impl Model {
    fn build(run: &Run, vb: VarBuilder, tp: Option<&Group>) -> candle_core::Result<Model> {
        Ok(match run.arch {
            Arch::Transformers => {
                let cfg = transformers_config(&run.sizes);
                let cache = candle_transformers::models::llama::Cache::new(
                    false,
                    DType::F32,
                    &cfg,
                    vb.device(),
                )?;
                Model::Transformers(
                    candle_transformers::models::llama::Llama::load(vb, &cfg)?,
                    cache,
                )
            }
            Arch::Own => Model::Own(OwnLlama::new(&run.sizes, vb, tp)?),
        })
    }

    fn loss(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        fsdp: Option<&FsdpVarMap>,
    ) -> candle_core::Result<Tensor> {
        match self {
            Model::Transformers(m, cache) => {
                let t = x.dim(1)?;
                let logits = match fsdp {
                    Some(map) => map.forward(ROOT_UNIT, || m.forward(x, 0, cache))?,
                    None => m.forward(x, 0, cache)?,
                };
                candle_nn::loss::cross_entropy(
                    &logits,
                    &y.narrow(1, t - 1, 1)?.squeeze(1)?.contiguous()?,
                )
            }
            Model::Own(m) => {
                let logits = m.forward(x, fsdp)?;
                candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &y.flatten_all()?)
            }
        }
    }

    fn pieces(&self) -> Pieces {
        match self {
            Model::Own(m) => m.pieces.clone(),
            Model::Transformers(..) => Pieces::new(),
        }
    }
}

fn adamw(run: &Run) -> ParamsAdamW {
    ParamsAdamW {
        lr: run.lr,
        ..ParamsAdamW::default()
    }
}

/// Trains on one device with the same initial values as the FSDP runs.
pub fn train_one_device(run: &Run) -> Result<Report, BoxErr> {
    let (map, vb) = reference_var_builder(run.seed, DType::F32, &Device::Cpu);
    let mut model = Model::build(run, vb, None)?;
    let mut opt = candle_nn::AdamW::new(map.all_vars(), adamw(run))?;
    let corpus = corpus(run);
    let vars: Vec<(String, candle_core::Var)> = {
        let data = map
            .data()
            .lock()
            .map_err(|_| "the VarMap lock is poisoned")?;
        let mut v: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let mut report = Report {
        dp: (1, 0),
        params: vars.iter().map(|(k, _)| k.clone()).collect(),
        ..Report::default()
    };
    for step in 0..run.steps {
        let (x, y) = batch(run, &corpus, step)?;
        let loss = model.loss(&x, &y, None)?;
        report.losses.push(loss.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        report.grads.push(
            vars.iter()
                .filter_map(|(k, v)| grads.get(v.as_tensor()).map(|g| (k.clone(), g.clone())))
                .collect(),
        );
        opt.step(&grads)?;
    }
    Ok(report)
}

/// Trains as one rank of a `dp x tp` mesh with the library trainer
/// ([`candle_dtensor::train::fit::Trainer`]): FSDP over `dp` with a unit per block (`--arch
/// own`: each block's forward wrapped; candle-transformers: its whole forward as the root
/// unit), tensor parallelism over `tp` (own model only). Each dp rank trains on its rows of the
/// global batch; its loss is their mean, so gradients (and the reported loss) are averaged.
pub fn train_rank(mesh: &DeviceMesh, run: &Run) -> Result<Report, BoxErr> {
    let dp = mesh.size(0)?;
    let dpc = mesh.coordinate()[0];
    let tp = match mesh.ndim() {
        2 => Some(Group::from_mesh(mesh, "tp")?),
        _ => None,
    };
    let fsdp = Fsdp::new(mesh, FsdpConfig::new(0, GradReduce::Avg))?;
    let map = FsdpVarMap::new(&fsdp, run.seed).with_units(&["model.layers.{i}"])?;
    // The model is built through the trainer's VarBuilder (the map's, recording each
    // parameter's tensor-parallel piece for the gradient norm).
    let vars = TrainVars::fsdp(mesh, &fsdp, &map, DType::F32);
    let mut model = Model::build(run, vars.var_builder()?, tp.as_ref())?;
    let mut trainer = Trainer::new(
        vars,
        TrainerConfig {
            lr: run.lr,
            tokens_per_step: run.batch * run.seq,
            ..TrainerConfig::default()
        },
    )?;
    let corpus = corpus(run);
    let (rows, off) = shard_size_and_offset(run.batch, dp, dpc);
    let mut params: Vec<String> = map.named_vars().into_iter().map(|(k, _)| k).collect();
    params.sort();
    let mut report = Report {
        pieces: model.pieces(),
        dp: (dp, dpc),
        params,
        units: map.units().into_iter().map(|(k, _)| k).collect(),
        ..Report::default()
    };
    let dev = fsdp.device();
    for step in 0..run.steps {
        let g = trainer.forward_backward(|| {
            let (x, y) = batch(run, &corpus, step)?;
            let (x, y) = (
                x.narrow(0, off, rows)?.to_device(&dev)?,
                y.narrow(0, off, rows)?.to_device(&dev)?,
            );
            model.loss(&x, &y, Some(&map))
        })?;
        report.losses.push(g.loss());
        if run.keep_grads {
            // On the host, where `compare` reads them beside the one-device reference.
            let mut host = BTreeMap::new();
            for (k, v) in map.named_vars() {
                if let Some(g) = g.grads().get(v.as_tensor()) {
                    host.insert(k, g.to_device(&Device::Cpu)?);
                }
            }
            report.grads.push(host);
        }
        trainer.apply(g)?;
    }
    report.without_grad = fsdp.params_without_grad();
    report.without_grad.sort();
    Ok(report)
}

// ---------------------------------------------------------------------------------------------
// Checking a rank's run against one device.
//
// Every check goes through `candle_dtensor::kernels::compare`: a NaN or infinite loss or
// gradient, or runs of different lengths, are failures, never a difference of 0.

/// How far a rank's run may be from one device's, in relative differences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// Every step's loss: `|loss - one device's| / |one device's|`.
    pub loss: f64,
    /// The first step's gradients, where both runs start from the same parameters:
    /// `max |g - one device's| / max |one device's|` per parameter (see [`GRAD_FLOOR`]).
    pub first_grad: f64,
    /// Every step's gradients: later steps are taken at parameters f32 rounding moved apart.
    pub any_grad: f64,
}

impl Tolerances {
    /// `train_llama --check`'s: losses and first-step gradients within 1e-5; later gradients
    /// drift (about 1e-5 after 40 steps), bounded by 1e-4.
    pub const TRAIN_LLAMA: Tolerances = Tolerances {
        loss: 1e-5,
        first_grad: 1e-5,
        any_grad: 1e-4,
    };

    /// Each tolerance must be a finite number >= 0 (a NaN tolerance would pass everything).
    pub fn validate(&self) -> Result<(), CheckFailure> {
        for (which, tol) in [
            ("loss", self.loss),
            ("first-step gradient", self.first_grad),
            ("any-step gradient", self.any_grad),
        ] {
            if !(tol.is_finite() && tol >= 0.0) {
                return Err(CheckFailure::BadTolerance { which, tol });
            }
        }
        Ok(())
    }
}

/// The smallest `max |one device's gradient|` a gradient difference is divided by: gradients
/// that are zero up to rounding are compared absolutely.
pub const GRAD_FLOOR: f64 = 1e-6;

/// What the loss series is called in a [`Mismatch`] (its elements are the steps).
const LOSS: &str = "loss (element = step)";

/// A gradient's difference from one device's: `max |g - w| / max(max |w|, GRAD_FLOOR)`.
#[derive(Debug, Clone, PartialEq)]
pub struct GradDiff {
    /// The relative difference (always finite: a non-finite gradient is a failure).
    pub rel: f64,
    /// The parameter.
    pub param: String,
    /// The step.
    pub step: usize,
}

/// At one step, parameters with a gradient on one device and none here, and the reverse.
#[derive(Debug, Clone, PartialEq)]
pub struct GradSetMismatch {
    /// The step.
    pub step: usize,
    /// With a gradient on one device (on a non-empty shard) and none here.
    pub missing: Vec<String>,
    /// With a gradient here and none on one device.
    pub extra: Vec<String>,
}

/// Why a rank's run does not match one device's.
#[derive(Debug)]
pub enum CheckFailure {
    /// A tolerance is not a finite number >= 0.
    BadTolerance {
        /// Which tolerance.
        which: &'static str,
        /// Its value.
        tol: f64,
    },
    /// One device ran no step: there is nothing to compare.
    NoSteps,
    /// There is no rank's report to compare.
    NoRanks,
    /// The losses: different step counts, a NaN or infinite loss, or a difference past the
    /// tolerance (the [`Mismatch`] names the step and both values).
    Loss(Mismatch),
    /// A report holds gradients of a different number of steps than it has losses (or none:
    /// it trained without [`Run::keep_grads`]).
    GradSteps {
        /// Whose report: "this rank" or "one device".
        side: &'static str,
        /// Steps with gradients.
        got: usize,
        /// Steps with losses.
        want: usize,
    },
    /// A gradient has a NaN or infinite element.
    GradNonFinite {
        /// The step.
        step: usize,
        /// The parameter.
        param: String,
        /// Whose gradient: "this rank's" or "one device's".
        side: &'static str,
    },
    /// A gradient's shape differs from one device's shard of it.
    GradShape {
        /// The step.
        step: usize,
        /// The parameter.
        param: String,
        /// This rank's shape.
        got: Vec<usize>,
        /// One device's shard's shape.
        want: Vec<usize>,
    },
    /// Parameters with a gradient differ.
    GradSet(GradSetMismatch),
    /// A gradient differs from one device's past the tolerance.
    GradTolerance {
        /// The difference.
        diff: GradDiff,
        /// The tolerance.
        tol: f64,
        /// Whether the first-step tolerance was the one exceeded.
        first_step: bool,
    },
    /// One device has gradients, and no rank compared any.
    NoGradients,
    /// Reading a gradient failed.
    Tensor {
        /// The step.
        step: usize,
        /// The parameter.
        param: String,
        /// The error.
        source: candle_core::Error,
    },
}

impl std::fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckFailure::BadTolerance { which, tol } => {
                write!(f, "the {which} tolerance {tol} is not a finite number >= 0")
            }
            CheckFailure::NoSteps => write!(f, "one device ran no step: nothing to compare"),
            CheckFailure::NoRanks => write!(f, "no rank's report to compare"),
            CheckFailure::Loss(m) => write!(f, "{m}"),
            CheckFailure::GradSteps { side, got, want } => write!(
                f,
                "{side} kept gradients of {got} steps but ran {want} (train with Run::keep_grads)"
            ),
            CheckFailure::GradNonFinite { step, param, side } => write!(
                f,
                "step {step}, parameter {param}: {side} gradient has a NaN or infinite element"
            ),
            CheckFailure::GradShape {
                step,
                param,
                got,
                want,
            } => write!(
                f,
                "step {step}, parameter {param}: gradient of shape {got:?}, one device's shard \
                 of it {want:?}"
            ),
            CheckFailure::GradSet(m) => write!(
                f,
                "step {}: gradients one device has and this rank lacks: {:?}; this rank has and \
                 one device lacks: {:?}",
                m.step, m.missing, m.extra
            ),
            CheckFailure::GradTolerance {
                diff,
                tol,
                first_step,
            } => {
                write!(
                f,
                "step {}, parameter {}: gradient differs from one device's by {:.3e} (max |diff| \
                 / max |one device's|), past the {} tolerance {tol:.1e}",
                diff.step,
                diff.param,
                diff.rel,
                if *first_step { "first-step" } else { "any-step" }
            )
            }
            CheckFailure::NoGradients => write!(
                f,
                "one device has gradients and no rank compared any (every shard empty?)"
            ),
            CheckFailure::Tensor {
                step,
                param,
                source,
            } => write!(f, "step {step}, parameter {param}: {source}"),
        }
    }
}

impl std::error::Error for CheckFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CheckFailure::Loss(m) => Some(m),
            CheckFailure::Tensor { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// How a rank's run compares with one device. Only a run whose losses and gradients are all
/// finite and whose step counts agree gets one ([`compare`] is an error otherwise), so a
/// difference of 0 here is a real 0.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// The losses, step by step.
    pub loss: SeriesDiff,
    /// The largest gradient difference at the first step (`None`: this rank compared no
    /// gradient, its shards of every parameter with one being empty).
    pub first_grad: Option<GradDiff>,
    /// The largest gradient difference over every step and parameter both have a gradient for.
    pub any_grad: Option<GradDiff>,
    /// Steps where the parameters with a gradient differ.
    pub grad_set_mismatch: Vec<GradSetMismatch>,
    /// Parameters compared (with a gradient on both, at the last step).
    pub compared: Vec<String>,
}

impl Comparison {
    /// Every way this comparison misses `tol` (empty: it passes).
    pub fn failures(&self, tol: &Tolerances) -> Vec<CheckFailure> {
        if let Err(e) = tol.validate() {
            return vec![e];
        }
        let mut out = Vec::new();
        if let Err(m) = self.loss.clone().within(tol.loss) {
            out.push(CheckFailure::Loss(m));
        }
        out.extend(
            self.grad_set_mismatch
                .iter()
                .cloned()
                .map(CheckFailure::GradSet),
        );
        let mut first_failed = false;
        if let Some(d) = self.first_grad.as_ref().filter(|d| d.rel > tol.first_grad) {
            first_failed = true;
            out.push(CheckFailure::GradTolerance {
                diff: d.clone(),
                tol: tol.first_grad,
                first_step: true,
            });
        }
        if let Some(d) = self.any_grad.as_ref().filter(|d| d.rel > tol.any_grad) {
            // The first step's worst, already reported against its tighter tolerance.
            if !(first_failed && d.step == 0) {
                out.push(CheckFailure::GradTolerance {
                    diff: d.clone(),
                    tol: tol.any_grad,
                    first_step: false,
                });
            }
        }
        out
    }
}

/// The elements of `t` a rank's shard holds: its tensor-parallel piece, then FSDP's
/// torch.chunk rows of it over `dp`.
fn shard_of(
    t: &Tensor,
    piece: Option<&Vec<Range<usize>>>,
    dp: (usize, usize),
) -> candle_core::Result<Tensor> {
    let ranges: Vec<Range<usize>> = match piece {
        Some(r) => r.clone(),
        None => t.dims().iter().map(|&n| 0..n).collect(),
    };
    let mut out = t.clone();
    for (d, r) in ranges.iter().enumerate() {
        out = out.narrow(d, r.start, r.len())?;
    }
    let (s, o) = shard_size_and_offset(out.dim(0)?, dp.0, dp.1);
    out.narrow(0, o, s)
}

/// `max |got - want| / max(max |want|, GRAD_FLOOR)`: NaN when either has a NaN or infinite
/// element (the kernels' `max_abs_diff` propagates them; `f64::max` would drop a NaN).
fn grad_rel(got: &Tensor, want: &Tensor) -> candle_core::Result<f64> {
    let diff = max_abs_diff(got, want)?;
    // max |want|: its distance from zero, NaN if any element is NaN.
    let scale = max_abs_diff(want, &want.zeros_like()?)?;
    if diff.is_nan() || scale.is_nan() {
        return Ok(f64::NAN);
    }
    Ok(diff / scale.max(GRAD_FLOOR))
}

/// Whether every element of `t` is finite.
fn all_finite(t: &Tensor) -> candle_core::Result<bool> {
    Ok(abs_sum(t)?.is_finite())
}

/// Compares a rank's report with the one-device report (whose gradients are whole): an error
/// when the step counts differ or a loss or gradient (of either) is NaN or infinite, else the
/// differences, to hold to a [`Tolerances`] with [`Comparison::failures`].
pub fn compare(reference: &Report, rank: &Report) -> Result<Comparison, CheckFailure> {
    let steps = reference.losses.len();
    if steps == 0 {
        return Err(CheckFailure::NoSteps);
    }
    let loss =
        compare_series_f32(LOSS, &rank.losses, &reference.losses).map_err(CheckFailure::Loss)?;
    for (side, r) in [("this rank", rank), ("one device", reference)] {
        if r.grads.len() != steps {
            return Err(CheckFailure::GradSteps {
                side,
                got: r.grads.len(),
                want: steps,
            });
        }
    }
    let mut c = Comparison {
        loss,
        first_grad: None,
        any_grad: None,
        grad_set_mismatch: Vec::new(),
        compared: Vec::new(),
    };
    for (step, (want, got)) in reference.grads.iter().zip(&rank.grads).enumerate() {
        // A shard with no rows holds no gradient: not a mismatch.
        let empty = |name: &str| -> bool {
            want.get(name).is_some_and(|t| {
                shard_of(t, rank.pieces.get(name), rank.dp).is_ok_and(|s| s.elem_count() == 0)
            })
        };
        let missing: Vec<String> = want
            .keys()
            .filter(|k| !got.contains_key(*k) && !empty(k))
            .cloned()
            .collect();
        let extra: Vec<String> = got
            .keys()
            .filter(|k| !want.contains_key(*k))
            .cloned()
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            c.grad_set_mismatch.push(GradSetMismatch {
                step,
                missing,
                extra,
            });
        }
        c.compared = got
            .keys()
            .filter(|k| want.contains_key(*k))
            .cloned()
            .collect();
        for (name, g) in got {
            let Some(w) = want.get(name) else { continue };
            let tensor_err = |source| CheckFailure::Tensor {
                step,
                param: name.clone(),
                source,
            };
            let w = shard_of(w, rank.pieces.get(name), rank.dp).map_err(tensor_err)?;
            if g.dims() != w.dims() {
                return Err(CheckFailure::GradShape {
                    step,
                    param: name.clone(),
                    got: g.dims().to_vec(),
                    want: w.dims().to_vec(),
                });
            }
            let rel = grad_rel(g, &w).map_err(tensor_err)?;
            if !rel.is_finite() {
                let side = if all_finite(g).map_err(tensor_err)? {
                    "one device's"
                } else {
                    "this rank's"
                };
                return Err(CheckFailure::GradNonFinite {
                    step,
                    param: name.clone(),
                    side,
                });
            }
            let diff = GradDiff {
                rel,
                param: name.clone(),
                step,
            };
            if step == 0 && c.first_grad.as_ref().is_none_or(|d| rel > d.rel) {
                c.first_grad = Some(diff.clone());
            }
            if c.any_grad.as_ref().is_none_or(|d| rel > d.rel) {
                c.any_grad = Some(diff);
            }
        }
    }
    Ok(c)
}

/// Every rank's run against one device's, held to one [`Tolerances`].
#[derive(Debug)]
pub struct Verdict {
    /// The ranks that could be compared, by rank.
    pub comparisons: Vec<(usize, Comparison)>,
    /// Every failure, with its rank (`None`: the check as a whole).
    pub failures: Vec<(Option<usize>, CheckFailure)>,
}

impl Verdict {
    /// Whether every rank matched one device within the tolerances.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// The largest loss difference, first-step and any-step gradient difference over the
    /// compared ranks (`None`: no rank compared one).
    pub fn worst(&self) -> (Option<f64>, Option<f64>, Option<f64>) {
        let max = |f: fn(&Comparison) -> Option<f64>| {
            self.comparisons
                .iter()
                .filter_map(|(_, c)| f(c))
                .reduce(nan_max)
        };
        (
            max(|c| Some(c.loss.max_rel)),
            max(|c| c.first_grad.as_ref().map(|d| d.rel)),
            max(|c| c.any_grad.as_ref().map(|d| d.rel)),
        )
    }
}

/// Compares every rank's report with one device's and holds them to `tol`: the check of
/// `train_llama --check` (exit status 1 unless [`Verdict::passed`]).
pub fn verdict(reference: &Report, ranks: &[Report], tol: &Tolerances) -> Verdict {
    let mut v = Verdict {
        comparisons: Vec::new(),
        failures: Vec::new(),
    };
    // A bad tolerance is one failure of the check, not one per rank.
    let tol_ok = match tol.validate() {
        Ok(()) => true,
        Err(e) => {
            v.failures.push((None, e));
            false
        }
    };
    if ranks.is_empty() {
        v.failures.push((None, CheckFailure::NoRanks));
    }
    for (rank, r) in ranks.iter().enumerate() {
        match compare(reference, r) {
            Ok(c) => {
                if tol_ok {
                    v.failures
                        .extend(c.failures(tol).into_iter().map(|f| (Some(rank), f)));
                }
                v.comparisons.push((rank, c));
            }
            Err(e) => v.failures.push((Some(rank), e)),
        }
    }
    let reference_has_grads = reference.grads.iter().any(|g| !g.is_empty());
    let compared_any = v.comparisons.iter().any(|(_, c)| c.any_grad.is_some());
    if reference_has_grads && !v.comparisons.is_empty() && !compared_any {
        v.failures.push((None, CheckFailure::NoGradients));
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Planted failures: a check that cannot fail proves nothing, so the tests (and `train_llama
// --plant`) corrupt a real report and see the check fail.

/// A failure to plant in a rank's report, at its last step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Plant {
    /// The last loss becomes NaN.
    NanLoss,
    /// One element of the last step's first non-zero gradient becomes NaN.
    NanGrad,
    /// The last loss grows by a relative 1e-3 (100 times the default tolerance).
    Loss,
    /// The last step's first non-zero gradient grows by a relative 1e-2.
    Grad,
    /// The last step is dropped: a run that stopped early.
    Short,
}

impl Plant {
    /// Every kind.
    pub const ALL: [Plant; 5] = [
        Plant::NanLoss,
        Plant::NanGrad,
        Plant::Loss,
        Plant::Grad,
        Plant::Short,
    ];

    /// Plants the failure in `r` (which must have run a step, and kept its gradients for the
    /// gradient plants).
    pub fn apply(self, r: &mut Report) -> Result<(), BoxErr> {
        let last = r
            .losses
            .len()
            .checked_sub(1)
            .ok_or("nothing to plant in a report of no step")?;
        match self {
            Plant::NanLoss => r.losses[last] = f32::NAN,
            Plant::Loss => r.losses[last] *= 1.0 + 1e-3,
            Plant::Short => {
                r.losses.truncate(last);
                r.grads.truncate(last);
            }
            Plant::NanGrad | Plant::Grad => {
                let grads = r
                    .grads
                    .get_mut(last)
                    .ok_or("no gradients at the last step (train with Run::keep_grads)")?;
                // The first gradient that is not all zero (scaling a zero changes nothing).
                for g in grads.values_mut() {
                    if abs_sum(g)? == 0.0 {
                        continue;
                    }
                    *g = if self == Plant::NanGrad {
                        let mut v = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                        v[0] = f32::NAN;
                        Tensor::from_vec(v, g.shape(), g.device())?.to_dtype(g.dtype())?
                    } else {
                        (&*g * (1.0 + 1e-2))?
                    };
                    return Ok(());
                }
                return Err("no non-zero gradient at the last step".into());
            }
        }
        Ok(())
    }
}
