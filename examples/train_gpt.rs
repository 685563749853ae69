//! The main job: train a GPT on the embedded local backend.
//!
//! ```text
//! cargo run --release --example train_gpt        # FSDP over dp=2 x tensor parallel tp=2, tiny preset
//! cargo run --release --example train_gpt -- --mesh tp=4 --sp --steps 50 --check --json
//! cargo run --release --example train_gpt -- --mesh replicate=2,shard=2 --hsdp
//! cargo run --release --example train_gpt -- --steps 100 --save-dir ckpt --save-every 25
//! cargo run --release --example train_gpt -- --steps 200 --save-dir ckpt --resume --mesh dp=4
//! ```
//!
//! With `--save-dir` it writes distributed checkpoints (`train::checkpoint`); `--resume`
//! continues from the latest one, on any mesh, up to the total `--steps`. `--inject-fault
//! rank=R,step=S[,kind=kill|hang]` kills (or hangs) a rank after a step on a job's first start,
//! so `dtrun --max-restarts 1 -- train_gpt --backend process --save-dir d --save-every 5
//! --resume --inject-fault rank=1,step=7` restarts from step 5 and ends as an uninterrupted run.
//!
//! The data is a synthetic corpus generated from the seed (no downloads), or with `--data
//! FILE` any UTF-8 text: byte-level tokens (vocabulary 256), or the ids of `--tokenizer
//! tokenizer.json`. The global batch and its order depend only on the tokens, the seed and the
//! step, so every layout trains the same model on the same data and the losses (global means)
//! are comparable across layouts. `--eval-every N` holds out the last `--eval-fraction` of the
//! tokens and reports the held-out loss every N steps; `--sample N` generates N tokens from the
//! trained model at the end (greedy, or `--temperature T` with `--sample-seed`). At the end it
//! writes `train_gpt_loss.csv` and `train_gpt_loss.svg` (train and held-out curves). With
//! `--check` it also trains the identical single-device model and compares every step (and
//! every evaluation); `--check-against FILE` compares them with a loss CSV written earlier (a
//! recorded run, or another framework's twin writing the same CSV); `--json` prints one summary
//! object.
//!
//! The checks fail loudly: a relative loss difference above `--check-tol` (default 1e-4; with
//! `--mixed-precision` 2e-3 for f16, 2e-2 for bf16; with `--precision` 2e-3 for tf32, 2e-2
//! for bf16), a NaN or infinite loss on either side, or
//! a different number of steps or evaluations fails the run. The summary still prints (`"check_passed": false`,
//! `"check_error"`: what failed, where, and the values), then `train_gpt: check failed: ...` on
//! stderr. Exit status: 0 success; 1 a failed check (the run itself finished); 2 an error (bad
//! flags, a failed rank, an unreadable or malformed `--check-against` file).
//!
//! ```text
//! cargo run --release --example train_gpt -- --data input.txt --eval-every 25 --sample 200
//! cargo run --release --example train_gpt -- --data input.txt --tokenizer tokenizer.json --sample 50 --temperature 0.8
//! ```
//!
//! `--precision f32|tf32|bf16` picks the precision policy of every op in every layout
//! (`models::precision`): bf16 GEMMs and attention products with f32 accumulation, everything
//! else and the master weights in f32, so gradients are reduced in f32; tf32 is candle's
//! process-global reduced-precision f32 GEMM switch on CUDA, set once at startup (f32, with a
//! warning, on the CPU). The summary records `precision`, `precision_effective`,
//! `precision_fallback`, `gemm_dtype` and `grad_reduce_dtype`.
//!
//! # Job files, model shapes, schedules, metrics
//!
//! Every flag is also a key of a TOML job file (`--config job.toml`; sections `[model]`,
//! `[optimizer]`, `[lr_schedule]`, `[training]`, `[parallelism]`, `[checkpoint]`, `[data]`,
//! `[evaluation]`, `[logging]`, `[check]`, `[fault_tolerance]`; keys are the flags' long
//! names; flags on the command line override the file; examples in `examples/configs/`).
//! `--print-config` prints the resolved job (defaults included) and exits; every run writes it
//! to `<--out>.job.toml`, which `--config` reads back to the same run. Unknown or misspelt
//! keys, keys in the wrong section and values of the wrong type are errors naming the key.
//!
//! The model is `--preset` (tiny, small, gpt2, gpt2-medium) with `--layers --heads --width
//! --mlp-ratio --vocab --seq-len --tied/--untied` overriding its fields, checked before any
//! rank starts. AdamW takes `--lr --weight-decay --beta1 --beta2 --eps --clip`; the weight
//! decay applies to `--decay-params matrices` by default (no decay for norms, biases and
//! embeddings: losses differ from runs before this flag, which decayed `all`). The rate warms
//! up linearly over `--warmup` steps, then `--lr-decay none|cosine|linear` takes it to
//! `--min-lr` (default 0) at the last step of `--schedule-steps` (default `--steps`); it is a
//! function of the global step, so a resumed run continues it exactly. `--resume` with a model
//! of another shape than the checkpoint's is an error naming the flag (the checkpoint's shapes
//! from its manifest; the heads from `<--save-dir>/train_gpt.json`, which every run with
//! `--save-dir` writes).
//!
//! `<--out>.metrics.jsonl` (or `--metrics FILE`) gets one JSON object per logged step (every
//! step, or every `--log-every N`; 0: none): step, loss, lr, grad_norm, tokens_per_s, mfu
//! (`(6 N + 12 L T D)` FLOPs per token, N the parameters a token goes through, against
//! `--peak-tflops` per rank; null without it), step_ms and its forward / backward / optimizer
//! split, exposed_comm_ms, peak_bytes (rank 0's parameters, gradients and optimizer state)
//! and eval_loss (after the steps it was measured after). The SVG draws the learning rate
//! under the losses; the progress bar shows loss, rate, tokens/s and the ETA.
#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "common/job.rs"]
pub(crate) mod job;
#[path = "common/kernel_count.rs"]
mod kernel_count;
#[path = "common/rank_device.rs"]
mod rank_device;
#[path = "common/text.rs"]
pub(crate) mod text;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::DType;
use candle_dtensor::comm::env::LaunchEnv;
use candle_dtensor::comm::link::{link_hints, parse_link_spec, LinkModel};
use candle_dtensor::comm::{new_comm, Comm, CommOptions, LocalWorld};
use candle_dtensor::kernels::compare::{compare_series_f32, nan_max, Mismatch};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::models::GptConfig;
use candle_dtensor::parallel::pipeline::{split_explicit, Schedule, ScheduleKind};
use candle_dtensor::parallel::{MoeConfig, TpPlan};
use candle_dtensor::train::data::Corpus;
use candle_dtensor::train::device::DeviceSpec;
use candle_dtensor::train::pipeline::PipelineSpec;
use candle_dtensor::train::schedule::{Decay, LrSchedule, WeightDecay};
use candle_dtensor::train::trainer::{
    train_rank, EvalSpec, FsdpSpec, RankReport, SampleSpec, StepInfo, TrainConfig,
};
use clap::{CommandFactory, Parser};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a GPT with tensor / data / fully sharded parallelism")]
pub(crate) struct Args {
    /// Read the job from this TOML file (sections model, optimizer, lr_schedule, training,
    /// parallelism, checkpoint, data, evaluation, logging, check, fault_tolerance; keys are
    /// the flags' long names). Flags on the command line override the file.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Print the resolved job (every setting, defaults included, as a job file for --config)
    /// and exit without training.
    #[arg(long)]
    pub(crate) print_config: bool,
    /// The resolved job (TOML), set by [`parse_args`]; written to `<--out>.job.toml`.
    #[arg(skip)]
    pub(crate) job: Option<String>,
    /// Number of ranks (threads). Defaults to the product of --mesh.
    #[arg(long)]
    world: Option<usize>,
    /// Mesh, e.g. `tp=4`, `dp=2,tp=2`, `replicate=2,shard=2`, `dp=2,ep=2`, `dp=2,pp=2`. Dim
    /// names: dp, tp, replicate, shard, ep (experts of --moe sharded over it; a data dim
    /// otherwise), pp (pipeline stages; combines with dp, FSDP over dp with --fsdp, tp, and ep
    /// (--moe experts sharded inside each stage; not ep with tp); see --microbatches).
    #[arg(long, default_value = "dp=2,tp=2")]
    mesh: String,
    /// Shard parameters, gradients and optimizer state over the data-parallel dim (FSDP).
    /// On by default; `--no-fsdp` replicates them (data parallelism with all-reduced gradients).
    #[arg(long, overrides_with = "no_fsdp")]
    fsdp: bool,
    /// Turn FSDP off.
    #[arg(long, overrides_with = "fsdp")]
    no_fsdp: bool,
    /// HSDP: shard over `shard`, replicate over `replicate` (needs those mesh dims).
    #[arg(long)]
    hsdp: bool,
    /// Give FSDP's reduce_scatter its own communicator (overlaps the all_gathers).
    #[arg(long)]
    separate_rs_group: bool,
    /// FSDP mixed precision: compute dtype of the parameters (`bf16` or `f16`; master shards
    /// and gradient reduction stay f32). A storage and communication choice: FSDP gathers the
    /// parameters in it; norms, softmax and the loss still compute in f32 (cast up), and the
    /// GEMMs run in it unless --precision bf16 says bf16.
    #[arg(long)]
    mixed_precision: Option<String>,
    /// Precision policy of every op, in every layout: `f32` (default), `tf32` (f32, with
    /// TF32 tensor-core GEMMs on CUDA through candle's process-global switch, set once at
    /// startup; on the CPU it runs as f32, with a warning and `precision_fallback` in the
    /// summary) or `bf16` (GEMMs and attention's QK^T / PV in bf16 with f32 accumulation;
    /// norms, softmax, GELU, the loss and AdamW in f32; f32 master weights, so gradients are
    /// reduced in f32). --check compares with the one-device run under the same policy.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Mixture-of-experts blocks: `experts=8,top_k=2[,every=1][,hidden=H][,capacity=F]
    /// [,aux=0.01][,normalize=true][,dispatch=a2a|rma]` (dropless without `capacity`).
    #[arg(long)]
    moe: Option<String>,
    /// Sequence parallelism (activations sharded on the sequence dim between blocks).
    #[arg(long)]
    sp: bool,
    /// Training steps in total (a resumed run continues from the checkpoint's step up to
    /// this).
    #[arg(long, default_value_t = 150)]
    steps: usize,
    /// Directory of distributed checkpoints (one `step-N/` per save). A checkpoint is saved
    /// after the last step, and every `--save-every` steps.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (needs --save-dir; 0: only after the last step).
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Resume from the latest complete checkpoint in --save-dir (any mesh may have saved it);
    /// without one, start from step 0.
    #[arg(long)]
    resume: bool,
    /// Start from the parameters of a plain safetensors file (e.g. a consolidated
    /// checkpoint) instead of the seed's initialisation.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Model preset: tiny (1 layer, width 256), small (4 layers, width 384), gpt2 (GPT-2
    /// small's shape, 124M parameters) or gpt2-medium (350M). The shape flags below override
    /// its fields.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Transformer blocks (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads (default: the preset's); must divide --width, and be divisible by the
    /// tensor-parallel size.
    #[arg(long)]
    heads: Option<usize>,
    /// Model width d_model (default: the preset's).
    #[arg(long)]
    width: Option<usize>,
    /// MLP hidden size as a multiple of the width (default: the preset's, 4).
    #[arg(long)]
    mlp_ratio: Option<usize>,
    /// Vocabulary size (default: the preset's; with --data, the data's rounded up to a
    /// multiple of the tensor-parallel size; a given --vocab must hold the data's).
    #[arg(long)]
    vocab: Option<usize>,
    /// Sequence length: tokens per sequence and position embeddings (default: the preset's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Tie the LM head to the token embedding (default: the preset's; gpt2 presets are tied).
    #[arg(long, overrides_with = "untied")]
    tied: bool,
    /// An LM head of its own (untied from the token embedding).
    #[arg(long, overrides_with = "tied")]
    untied: bool,
    /// Seed of the parameters and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Global batch size (sequences per step, all micro-batches together).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Gradient accumulation: split each step's --batch into this many micro-batches (the same
    /// sequences), run forward and backward on each in turn, then one optimizer step. The loss
    /// is the mean over all the step's tokens; FSDP reduce-scatters once per step. Must divide
    /// --batch, and the micro-batch must divide over the data-parallel ranks.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Pipeline parallelism (a `pp` mesh dim): micro-batches per step. Micro-batch i is the
    /// i-th run of batch / microbatches sequences of --batch (as --grad-accum's), split over the
    /// dp x ep data-parallel ranks; the --pp-schedule runs them through the stages; the loss
    /// is the mean over all the step's tokens (with --moe, each micro-batch's balancing loss
    /// scaled by its share, as --grad-accum microbatches does). dp x ep x microbatches must
    /// divide --batch.
    #[arg(long, default_value_t = 1)]
    microbatches: usize,
    /// Pipeline schedule over the `pp` mesh dim: gpipe, 1f1b, interleaved-1f1b (with
    /// --pp-chunks model chunks per rank; needs microbatches % pp == 0), zb-h1 (zero bubble:
    /// each backward split into the input gradient and the linears' weight gradients, which
    /// fill the bubbles) or zb-v (zero bubble over two chunks per rank placed in a V, rank r
    /// holding stages r and 2 pp - 1 - r: half zb-h1's bubble; needs --pp-chunks 2).
    #[arg(long, default_value = "1f1b")]
    pp_schedule: String,
    /// Model chunks per pipeline rank (interleaved-1f1b's virtual stages, zb-v's 2; 1 otherwise).
    #[arg(long, default_value_t = 1)]
    pp_chunks: usize,
    /// Blocks per pipeline stage, e.g. `3,1` (pp x pp-chunks sizes adding up to the blocks);
    /// default: balanced by parameter count.
    #[arg(long)]
    pp_split: Option<String>,
    /// Activation checkpointing of the blocks: `none`, `full` (backward recomputes every
    /// block's forward; the autograd graph keeps only the blocks' inputs) or `selective` (every
    /// other block, 1, 3, 5, ...). The losses and gradients do not change; the summary's
    /// `peak_activation_bytes` shows the memory kept. Mixture-of-experts blocks are never
    /// checkpointed (`selective` then counts the dense blocks only).
    #[arg(long, default_value = "none")]
    ac: String,
    /// AdamW learning rate (the peak rate of the schedule).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Which parameters the weight decay applies to: `matrices` (every parameter of two or
    /// more dims except the embeddings: no decay for norms, biases and embeddings, as nanoGPT
    /// and torchtitan), `matrices+embeddings`, or `all` (train_gpt's behaviour before this
    /// flag existed).
    #[arg(long, default_value = "matrices")]
    decay_params: String,
    /// AdamW's first-moment decay.
    #[arg(long, default_value_t = 0.9)]
    beta1: f64,
    /// AdamW's second-moment decay.
    #[arg(long, default_value_t = 0.999)]
    beta2: f64,
    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip: Option<f64>,
    /// Learning-rate warmup: the rate rises linearly to --lr over the first N steps.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Learning-rate decay after the warmup: `none` (constant), `cosine` or `linear`, from
    /// --lr down to --min-lr at the last step of the schedule.
    #[arg(long, default_value = "none")]
    lr_decay: String,
    /// The rate --lr-decay ends at.
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
    /// Steps of the schedule (default: --steps). The rate is a function of the global step
    /// alone, so a run resumed from a checkpoint continues the schedule exactly; set this to
    /// the whole job's steps when a run stops early and is resumed with a larger --steps.
    #[arg(long)]
    schedule_steps: Option<usize>,
    /// Also train the identical single-device model and compare every step's loss (and every
    /// held-out loss) with it: a difference above --check-tol, a NaN or infinite loss on
    /// either side, or a different number of steps fails the run (exit 1).
    #[arg(long)]
    check: bool,
    /// Compare this run's per-step losses (and held-out losses) with a loss CSV an earlier
    /// train_gpt wrote (`<--out>.csv`: `step,loss,eval_loss`), with the same rule and
    /// tolerance as --check. Rows before this run's first step are skipped (a resumed run is
    /// compared from its checkpoint's step on); every other row must be a step this run ran.
    /// The file is read before training, by every process of the job.
    #[arg(long)]
    check_against: Option<PathBuf>,
    /// Largest relative loss difference (`|got - want| / |want|`, per step) --check and
    /// --check-against accept. Default 1e-4 for f32 (CPU layouts agree to about 2e-7 over 150
    /// steps; scripts/gpu_check.sh holds a GPU run to its CPU reference, --check-device cpu, to
    /// 1e-4). The f32 reference is not what --mixed-precision computes: the default is 2e-3
    /// with f16 (4e-4 measured over 20 steps on the CPU) and 2e-2 with bf16 (8 bits of
    /// mantissa: up to 1.1e-2 over 60 steps on the CPU, 3.7e-4 over 10 on an H100). Raise it
    /// for long runs, whose rounding differences grow with the steps, and for a reference from
    /// another framework (a PyTorch twin's CSV).
    #[arg(long)]
    check_tol: Option<f64>,
    /// Print one JSON summary object on stdout (and no progress bar).
    #[arg(long)]
    json: bool,
    /// Output prefix: writes `<out>.csv` (losses), `<out>.svg` (loss and learning-rate
    /// curves), `<out>.metrics.jsonl` (see --metrics) and `<out>.job.toml` (the resolved job,
    /// for --config).
    #[arg(long, default_value = "train_gpt_loss")]
    out: PathBuf,
    /// The per-step metrics log, one JSON object per logged step (default:
    /// `<out>.metrics.jsonl`): step, loss, lr, grad_norm, tokens_per_s, mfu, forward /
    /// backward / optimizer ms, exposed_comm_ms, peak_bytes (of rank 0: parameters,
    /// gradients and optimizer state), eval_loss.
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
    /// Log every N-th step (steps 0, N, 2N, ... and the last) to the metrics file, with the
    /// gradient norm computed on those steps (one all_reduce); 0: no metrics file and no
    /// gradient norm unless --clip.
    #[arg(long, default_value_t = 1)]
    log_every: usize,
    /// The peak rate of one device in TFLOP/s for the MFU in the metrics (e.g. 989 for an
    /// H100's dense BF16); without it the MFU is null.
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Count the GPU kernels of the run's last step with CUPTI (loaded at run time:
    /// `$CDT_CUPTI_LIB` or `libcupti.so` on the loader's path); needs 2 or more steps, and adds
    /// two device synchronisations around that step only. The summary's `kernels` says how
    /// many and their summed GPU time, or why it could not count. CUDA only.
    #[arg(long)]
    count_kernels: bool,
    /// Op timeout in seconds (fractions allowed, e.g. 0.5 for a quick fault detection with
    /// --fault-tolerant).
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Modeled network per mesh dim for the local backend, e.g. `dp=20us:0.2GBps,tp=2us:5GBps`
    /// (latency in ns/us/ms, bandwidth in GBps/MBps): each collective on that dim takes at
    /// least `alpha + wire bytes / bandwidth`, waiting by sleeping (`comm::link`).
    #[arg(long)]
    link: Option<String>,
    /// Slows every `--link` down by a factor so that this machine's compute : communication
    /// ratio is a GPU cluster's: `auto` measures the ranks' matmul rate here and divides an
    /// H100's dense BF16 rate by it (`comm::link::link_scale_for`); a number gives the factor.
    /// Meant with the presets, e.g. `--link dp=ib --link-scale auto`.
    #[arg(long)]
    link_scale: Option<String>,
    /// Communication backend. `local` (default) runs every rank as a thread of this process;
    /// any other registered backend (e.g. `process` under `dtrun`, `mpi` under `mpirun`) makes
    /// this process one rank of a world started by a launcher, and rank 0 prints the results.
    #[arg(long, default_value = "local")]
    backend: String,
    /// Train on this UTF-8 text file instead of the synthetic corpus (byte-level tokens unless
    /// --tokenizer is given).
    #[arg(long)]
    data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json for --data (the model's vocabulary is the tokenizer's,
    /// rounded up to a multiple of the tensor-parallel size).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Report the loss on held-out tokens after every N steps and after the last (0: no
    /// held-out split).
    #[arg(long, default_value_t = 0)]
    eval_every: usize,
    /// Fraction of the tokens (the end of the text) held out for --eval-every.
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    /// Batches (of --batch sequences) per held-out evaluation.
    #[arg(long, default_value_t = 4)]
    eval_batches: usize,
    /// Generate this many tokens from the trained model at the end, continuing the first
    /// sequence of the held-out tokens (or of the training tokens).
    #[arg(long, default_value_t = 0)]
    sample: usize,
    /// Sampling temperature for --sample (0: greedy, the most likely token).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Seed of --sample with a temperature (default: --seed).
    #[arg(long)]
    sample_seed: Option<u64>,
    /// Device of every rank: `cpu`, `cuda` (rank r on GPU r % gpus) or `cuda:N` (every rank on
    /// GPU N). CUDA needs a build with `--features cuda` (and `nccl` for `--backend nccl`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Device of the `--check` reference (default: the `--device` of rank 0), e.g. `cpu` to
    /// compare a GPU run with the CPU.
    #[arg(long)]
    check_device: Option<String>,
    /// Fault injection, `rank=R,step=S[,kind=kill|hang]`: after step S (0-based, global),
    /// rank R dies (a process rank SIGKILLs itself; a rank thread fails) or hangs (for twice
    /// the op timeout, then fails). `rank=R,collective=N[,kind=...]` instead: inside rank R's
    /// N-th collective (1-based, counted over the mesh's communicators), after it was issued
    /// and before it completes, so its peers are in the middle of it (process ranks only: a
    /// rank thread cannot die alone). Only on a job's first start
    /// (`TORCHELASTIC_RESTART_COUNT` unset or 0, which `dtrun --max-restarts` raises), so a
    /// restarted job runs through.
    #[arg(long, value_parser = parse_fault)]
    inject_fault: Option<Fault>,
    /// Fault-tolerant HSDP (needs --hsdp): when ranks die, the survivors agree on them, drop
    /// every replica group that lost one (its other ranks stop), shrink the communicators and
    /// go on from the failed step with fewer replicas, without a restart. On the local backend
    /// the world is elastic (a failed rank thread fails only its communicators); under dtrun
    /// use `--allow-failures`.
    #[arg(long)]
    fault_tolerant: bool,
}

/// The sections of a job file (`--config`): every flag of [`Args`] by long name
/// (tests/train_gpt_config.rs checks that none is missing).
pub(crate) const SECTIONS: job::Sections = &[
    (
        "model",
        &[
            "preset",
            "layers",
            "heads",
            "width",
            "mlp-ratio",
            "vocab",
            "seq-len",
            "tied",
            "untied",
            "moe",
        ],
    ),
    (
        "optimizer",
        &[
            "lr",
            "weight-decay",
            "decay-params",
            "beta1",
            "beta2",
            "eps",
            "clip",
        ],
    ),
    (
        "lr_schedule",
        &["warmup", "lr-decay", "min-lr", "schedule-steps"],
    ),
    (
        "training",
        &[
            "steps",
            "batch",
            "grad-accum",
            "microbatches",
            "ac",
            "seed",
            "device",
            "mixed-precision",
            "precision",
            "init-from",
        ],
    ),
    (
        "parallelism",
        &[
            "mesh",
            "world",
            "fsdp",
            "no-fsdp",
            "hsdp",
            "pp-schedule",
            "pp-chunks",
            "pp-split",
            "separate-rs-group",
            "sp",
            "backend",
            "timeout",
            "link",
            "link-scale",
        ],
    ),
    ("checkpoint", &["save-dir", "save-every", "resume"]),
    ("data", &["data", "tokenizer", "eval-fraction"]),
    (
        "evaluation",
        &[
            "eval-every",
            "eval-batches",
            "sample",
            "temperature",
            "sample-seed",
        ],
    ),
    (
        "logging",
        &[
            "out",
            "json",
            "metrics",
            "log-every",
            "peak-tflops",
            "count-kernels",
        ],
    ),
    (
        "check",
        &["check", "check-against", "check-tol", "check-device"],
    ),
    ("fault_tolerance", &["fault-tolerant", "inject-fault"]),
];

/// The arguments of `argv` (the program name first): the job file of `--config`, if any,
/// overridden by the command line; [`Args::job`] holds the resolved job.
pub(crate) fn parse_args(argv: Vec<std::ffi::OsString>) -> Result<Args, job::JobError> {
    let (mut args, matches) = job::parse::<Args>(SECTIONS, argv)?;
    args.job = Some(job::resolved(&Args::command(), SECTIONS, &matches));
    Ok(args)
}

/// What `--inject-fault` does to a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultKind {
    Kill,
    Hang,
}

/// When an injected fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultAt {
    /// After this step (0-based, global).
    Step(usize),
    /// Inside the rank's N-th collective (1-based), after issuing it.
    Collective(u64),
}

/// `--inject-fault`: rank `rank` dies or hangs at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fault {
    pub(crate) rank: usize,
    pub(crate) at: FaultAt,
    pub(crate) kind: FaultKind,
}

pub(crate) fn parse_fault(s: &str) -> Result<Fault, String> {
    let (mut rank, mut step, mut collective, mut kind) = (None, None, None, FaultKind::Kill);
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("--inject-fault: {part:?} is not key=value"))?;
        let num = || {
            v.parse::<usize>()
                .map_err(|e| format!("--inject-fault: {k}={v:?}: {e}"))
        };
        match k {
            "rank" => rank = Some(num()?),
            "step" => step = Some(num()?),
            "collective" => match num()? {
                0 => return Err("--inject-fault: collective=0: collectives count from 1".into()),
                n => collective = Some(n as u64),
            },
            "kind" => {
                kind = match v {
                    "kill" => FaultKind::Kill,
                    "hang" => FaultKind::Hang,
                    other => {
                        return Err(format!(
                            "--inject-fault: kind {other:?} is not kill or hang"
                        ))
                    }
                }
            }
            other => {
                return Err(format!(
                    "--inject-fault: unknown key {other:?} (rank, step, collective, kind)"
                ))
            }
        }
    }
    match (rank, step, collective) {
        (Some(rank), Some(step), None) => Ok(Fault {
            rank,
            at: FaultAt::Step(step),
            kind,
        }),
        (Some(rank), None, Some(n)) => Ok(Fault {
            rank,
            at: FaultAt::Collective(n),
            kind,
        }),
        (_, Some(_), Some(_)) => Err(format!(
            "--inject-fault {s:?}: step=S and collective=N exclude each other"
        )),
        _ => Err(format!(
            "--inject-fault {s:?}: needs rank=R,step=S or rank=R,collective=N"
        )),
    }
}

/// The fault to inject in this start of the job: none once a launcher restarted it.
fn fault_of_this_start(fault: Option<Fault>) -> Option<Fault> {
    let restarts = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
    fault.filter(|_| restarts.is_empty() || restarts == "0")
}

/// Injects `fault` into this rank after step `step` if it is due. A process rank is killed
/// with SIGKILL (no cleanup, its sockets close: what a crash looks like to its peers); a rank
/// thread cannot be killed alone, so it fails (a panic the launcher reports as the rank's
/// failure). A hang sleeps twice the op timeout first, so the peers' ops time out on it.
fn inject(fault: Option<&Fault>, rank: usize, step: usize, thread_rank: bool, timeout_s: f64) {
    let Some(f) = fault.filter(|f| f.rank == rank && f.at == FaultAt::Step(step)) else {
        return;
    };
    tracing::warn!(rank, step, kind = ?f.kind, "injecting a fault (--inject-fault)");
    if f.kind == FaultKind::Hang {
        std::thread::sleep(Duration::from_secs_f64(timeout_s.max(0.0) * 2.0));
    }
    if !thread_rank {
        #[cfg(unix)]
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        std::process::abort();
    }
    // A rank thread: fail it (LocalWorld reports the panic as this rank's failure).
    std::panic::panic_any(format!(
        "--inject-fault: rank {rank} {} after step {step}",
        match f.kind {
            FaultKind::Kill => "killed",
            FaultKind::Hang => "hung",
        }
    ));
}

/// Arms `fault` if it strikes inside a collective of this rank: a post-hook on the mesh's
/// root and per-dim communicators counts collectives, and inside the N-th one (issued, not
/// completed, so the peers are in the middle of it) the process SIGKILLs itself, after
/// twice the op timeout for a hang. The handles keep the hooks registered.
fn arm_collective_fault(
    mesh: &DeviceMesh,
    fault: Option<&Fault>,
    timeout_s: f64,
) -> Result<Vec<candle_dtensor::comm::HookHandle>, BoxErr> {
    let Some(&Fault {
        rank,
        at: FaultAt::Collective(n),
        kind,
    }) = fault.filter(|f| f.rank == mesh.rank())
    else {
        return Ok(Vec::new());
    };
    let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut comms = vec![mesh.root_comm().clone()];
    for d in 0..mesh.ndim() {
        comms.push(mesh.comm(d)?.clone());
    }
    Ok(comms
        .iter()
        .map(|c| {
            let seen = seen.clone();
            c.register_post_hook(move |rec, _| {
                if !rec.op.is_collective() {
                    return;
                }
                if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 != n {
                    return;
                }
                tracing::warn!(
                    rank,
                    collective = n,
                    op = %rec.op,
                    comm = %rec.comm,
                    seq = rec.seq,
                    kind = ?kind,
                    "injecting a fault inside a collective (--inject-fault)"
                );
                if kind == FaultKind::Hang {
                    std::thread::sleep(Duration::from_secs_f64(timeout_s.max(0.0) * 2.0));
                }
                #[cfg(unix)]
                // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                std::process::abort();
            })
        })
        .collect())
}

/// The communicator options of a run: the op timeout (seconds) and the links' hints.
fn comm_options(timeout: f64, links: &[(String, LinkModel)]) -> CommOptions {
    let mut options = CommOptions::default().with_timeout(Duration::from_secs_f64(timeout));
    for (k, v) in link_hints(links) {
        options = options.with_hint(k, v);
    }
    options
}

/// `--link`: one modeled link per named mesh dim (local backend only).
fn parse_links(args: &Args, dims: &[(String, usize)]) -> Result<Vec<(String, LinkModel)>, String> {
    let Some(spec) = &args.link else {
        return Ok(Vec::new());
    };
    if args.backend != "local" {
        return Err(format!(
            "--link models the network of the local backend; --backend is {}",
            args.backend
        ));
    }
    let links = parse_link_spec(spec).map_err(|e| format!("--link: {e}"))?;
    for (dim, _) in &links {
        if !dims.iter().any(|(d, _)| d == dim) {
            return Err(format!(
                "--link: mesh dim {dim:?} is not in --mesh {}",
                args.mesh
            ));
        }
    }
    Ok(links)
}

/// How `--link-scale` slowed the links down (for the output and the JSON summary).
#[derive(Debug, Clone, Copy)]
struct LinkScale {
    factor: f64,
    /// The per-rank matmul rate `auto` measured (FLOP/s); `None` for a given factor.
    rank_flops: Option<f64>,
}

/// Modeled links per mesh dim.
type Links = Vec<(String, LinkModel)>;

/// `--link-scale`: the links slowed down by the given or measured factor.
fn scale_links(
    args: &Args,
    links: Links,
    world: usize,
) -> Result<(Links, Option<LinkScale>), String> {
    let Some(spec) = &args.link_scale else {
        return Ok((links, None));
    };
    if links.is_empty() {
        return Err("--link-scale needs --link (e.g. --link dp=ib --link-scale auto)".into());
    }
    let scale = if spec == "auto" {
        let flops = measure_rank_flops(world)?;
        let factor = candle_dtensor::comm::link::link_scale_for(flops)
            .map_err(|e| format!("--link-scale: {e}"))?;
        LinkScale {
            factor,
            rank_flops: Some(flops),
        }
    } else {
        let factor: f64 = spec
            .parse()
            .map_err(|_| format!("--link-scale {spec:?}: not `auto` or a number"))?;
        LinkScale {
            factor,
            rank_flops: None,
        }
    };
    let scaled = links
        .iter()
        .map(|(d, l)| {
            l.scaled(d, scale.factor)
                .map(|s| (d.clone(), s))
                .map_err(|e| format!("--link-scale: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    match scale.rank_flops {
        Some(f) => eprintln!(
            "train_gpt: --link-scale auto: {:.1} GFLOP/s per rank here ({world} ranks matmul at once), \
             {:.0} TFLOP/s on the reference GPU (H100 SXM, dense BF16): links slowed {:.0}x",
            f / 1e9,
            candle_dtensor::comm::link::GPU_REFERENCE_FLOPS / 1e12,
            scale.factor
        ),
        None => eprintln!("train_gpt: --link-scale {}: links slowed {}x", spec, scale.factor),
    }
    for ((d, l), (_, s)) in links.iter().zip(&scaled) {
        eprintln!(
            "train_gpt:   {d}: {} us, {} GB/s modeled as {:.1} us, {:.6} GB/s",
            l.alpha_us, l.gbps, s.alpha_us, s.gbps
        );
    }
    Ok((scaled, Some(scale)))
}

/// The f32 matmul rate (FLOP/s) one rank sees while `world` ranks compute at once: `world`
/// threads multiply 256x256 matrices for about 0.3 s; the median thread's rate.
fn measure_rank_flops(world: usize) -> Result<f64, String> {
    use candle_core::{Device, Tensor};
    let n = 256usize;
    let rates = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world.max(1))
            .map(|i| {
                s.spawn(move || -> candle_core::Result<f64> {
                    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
                    let b =
                        Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?.affine(1.0, i as f64)?;
                    let _ = a.matmul(&b)?; // warm up
                    let t0 = Instant::now();
                    let mut reps = 0u32;
                    while t0.elapsed() < Duration::from_millis(300) {
                        let _ = a.matmul(&b)?;
                        reps += 1;
                    }
                    Ok(2.0 * (n * n * n) as f64 * f64::from(reps) / t0.elapsed().as_secs_f64())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err("a matmul thread panicked".to_string()),
            })
            .collect::<Result<Vec<f64>, String>>()
    })
    .map_err(|e| format!("--link-scale auto: measuring the matmul rate: {e}"))?;
    Ok(median(&rates))
}

/// What `--print-config` prints: the resolved job ([`parse_args`] sets it).
pub(crate) fn print_config_text(args: &Args) -> String {
    match &args.job {
        Some(job) => job.clone(),
        None => "# no resolved job: these arguments were not read by parse_args\n".to_string(),
    }
}

/// The tensor-parallel size of the mesh (1 without a `tp` dim).
fn tp_of(dims: &[(String, usize)]) -> usize {
    dims.iter().find(|(n, _)| n == "tp").map_or(1, |(_, s)| *s)
}

/// The model of `--preset` with the shape flags applied (the vocabulary of `--data` is set
/// by [`load_data`]).
fn model_config(args: &Args) -> Result<GptConfig, String> {
    let mut g = GptConfig::preset(&args.preset).map_err(|e| format!("--preset: {e}"))?;
    let set = |field: &mut usize, flag: Option<usize>| {
        if let Some(v) = flag {
            *field = v;
        }
    };
    set(&mut g.n_layers, args.layers);
    set(&mut g.n_heads, args.heads);
    set(&mut g.d_model, args.width);
    set(&mut g.mlp_ratio, args.mlp_ratio);
    set(&mut g.vocab, args.vocab);
    set(&mut g.seq_len, args.seq_len);
    if args.tied {
        g.tied = true;
    }
    if args.untied {
        g.tied = false;
    }
    g.ac = args.ac.parse().map_err(|e| format!("--ac: {e}"))?;
    // The error names the flag, the value and the choices.
    g.precision = args
        .precision
        .parse()
        .map_err(|e: candle_dtensor::models::ModelError| e.to_string())?;
    Ok(g)
}

/// A model shape [`GptConfig::validate`] refused, with the flags it came from.
fn shape_error(args: &Args, dims: &[(String, usize)], e: &str) -> String {
    let set: Vec<String> = [
        ("--layers", args.layers),
        ("--heads", args.heads),
        ("--width", args.width),
        ("--mlp-ratio", args.mlp_ratio),
        ("--vocab", args.vocab),
        ("--seq-len", args.seq_len),
    ]
    .iter()
    .filter_map(|(f, v)| v.map(|v| format!("{f} {v}")))
    .collect();
    format!(
        "bad model shape (--preset {}{}{}, tp={}): {e}",
        args.preset,
        if set.is_empty() { "" } else { " " },
        set.join(" "),
        tp_of(dims)
    )
}

/// The optimizer and learning-rate schedule flags into `cfg`, checked.
fn optimizer_settings(args: &Args, cfg: &mut TrainConfig) -> Result<(), String> {
    for (flag, v) in [
        ("--lr", args.lr),
        ("--weight-decay", args.weight_decay),
        ("--min-lr", args.min_lr),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{flag} {v}: not a finite number >= 0"));
        }
    }
    for (flag, v) in [("--beta1", args.beta1), ("--beta2", args.beta2)] {
        if !(0.0..1.0).contains(&v) {
            return Err(format!("{flag} {v}: not in [0, 1) (rule: 0 <= beta < 1)"));
        }
    }
    if !(args.eps.is_finite() && args.eps > 0.0) {
        return Err(format!("--eps {}: not a finite number > 0", args.eps));
    }
    if let Some(c) = args.clip {
        if !(c.is_finite() && c > 0.0) {
            return Err(format!("--clip {c}: not a finite number > 0"));
        }
    }
    cfg.lr = args.lr;
    cfg.clip = args.clip;
    cfg.weight_decay = args.weight_decay;
    cfg.beta1 = args.beta1;
    cfg.beta2 = args.beta2;
    cfg.eps = args.eps;
    cfg.decay_policy = args
        .decay_params
        .parse::<WeightDecay>()
        .map_err(|e| format!("--decay-params: {e}"))?;
    let decay: Decay = args
        .lr_decay
        .parse()
        .map_err(|e| format!("--lr-decay: {e}"))?;
    let total = args.schedule_steps.unwrap_or(args.steps);
    if total < args.steps {
        return Err(format!(
            "--schedule-steps {total} is less than --steps {} (rule: the schedule covers the \
             run: --schedule-steps >= --steps)",
            args.steps
        ));
    }
    cfg.schedule = if args.warmup == 0 && decay == Decay::Constant {
        None
    } else {
        Some(
            LrSchedule::new(args.lr, args.warmup, decay, total, args.min_lr).map_err(|e| {
                format!(
                    "--warmup {} --lr-decay {} --min-lr {} --lr {} over {total} steps \
                     (--schedule-steps, default --steps): {e}",
                    args.warmup, args.lr_decay, args.min_lr, args.lr
                )
            })?,
        )
    };
    Ok(())
}

/// The parameters of a GPT as [`candle_dtensor::models::Gpt::build`] creates them (name,
/// global shape), computed from the config alone: the MFU's parameter count and the shapes a
/// checkpoint must hold to be resumed (tests/train_gpt_config.rs checks both against a built
/// model).
#[derive(Debug, Clone)]
pub(crate) struct ModelShape {
    pub(crate) cfg: GptConfig,
    pub(crate) params: Vec<(String, Vec<usize>)>,
}

impl ModelShape {
    pub(crate) fn of(cfg: &GptConfig) -> ModelShape {
        let (v, d, t) = (cfg.vocab, cfg.d_model, cfg.seq_len);
        let mut p: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, shape: &[usize]| p.push((name, shape.to_vec()));
        let norm = |add: &mut dyn FnMut(String, &[usize]), name: &str| {
            add(format!("{name}.weight"), &[d]);
            if cfg.norm == candle_dtensor::models::NormKind::LayerNorm {
                add(format!("{name}.bias"), &[d]);
            }
        };
        let linear = |add: &mut dyn FnMut(String, &[usize]), name: &str, i: usize, o: usize| {
            add(format!("{name}.weight"), &[o, i]);
            add(format!("{name}.bias"), &[o]);
        };
        add("tok_emb.weight".into(), &[v, d]);
        add("pos_emb.weight".into(), &[t, d]);
        let hidden = cfg.mlp_ratio * d;
        for i in 0..cfg.n_layers {
            let b = format!("blocks.{i}");
            norm(&mut add, &format!("{b}.ln1"));
            linear(&mut add, &format!("{b}.attn.qkv"), d, 3 * d);
            linear(&mut add, &format!("{b}.attn.proj"), d, d);
            norm(&mut add, &format!("{b}.ln2"));
            match cfg.moe.as_ref().filter(|m| m.is_moe_block(i)) {
                Some(m) => {
                    let (e, h) = (m.experts, m.expert_hidden(hidden));
                    add(format!("{b}.moe.router.weight"), &[e, d]);
                    add(format!("{b}.moe.experts.w1"), &[e, h, d]);
                    add(format!("{b}.moe.experts.b1"), &[e, h]);
                    if cfg.swiglu {
                        add(format!("{b}.moe.experts.w3"), &[e, h, d]);
                        add(format!("{b}.moe.experts.b3"), &[e, h]);
                    }
                    add(format!("{b}.moe.experts.w2"), &[e, d, h]);
                    add(format!("{b}.moe.experts.b2"), &[e, d]);
                }
                None => {
                    linear(&mut add, &format!("{b}.mlp.fc1"), d, hidden);
                    if cfg.swiglu {
                        linear(&mut add, &format!("{b}.mlp.fc3"), d, hidden);
                    }
                    linear(&mut add, &format!("{b}.mlp.fc2"), hidden, d);
                }
            }
        }
        norm(&mut add, "ln_f");
        if !cfg.tied {
            add("lm_head.weight".into(), &[v, d]);
        }
        ModelShape {
            cfg: cfg.clone(),
            params: p,
        }
    }

    /// Every parameter's element count.
    pub(crate) fn total(&self) -> usize {
        self.params
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// The parameters one token goes through: with mixture-of-experts blocks, `top_k` of each
    /// block's experts.
    pub(crate) fn active(&self) -> f64 {
        let (k, e) = self
            .cfg
            .moe
            .as_ref()
            .map_or((1, 1), |m| (m.top_k, m.experts.max(1)));
        self.params
            .iter()
            .map(|(n, s)| {
                let numel = s.iter().product::<usize>() as f64;
                if n.contains(".moe.experts.") {
                    numel * k as f64 / e as f64
                } else {
                    numel
                }
            })
            .sum()
    }

    /// Training FLOPs per token: `6 N + 12 L T D` (N the parameters a token goes through,
    /// `active`; the second term the attention's score and value products), as nanoGPT's
    /// and PaLM's MFU count them.
    pub(crate) fn flops_per_token(&self) -> f64 {
        let c = &self.cfg;
        6.0 * self.active() + 12.0 * (c.n_layers * c.seq_len * c.d_model) as f64
    }

    /// The shape as the summary and the checkpoint record show it.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let c = &self.cfg;
        serde_json::json!({
            "vocab": c.vocab,
            "width": c.d_model,
            "heads": c.n_heads,
            "layers": c.n_layers,
            "seq_len": c.seq_len,
            "mlp_ratio": c.mlp_ratio,
            "tied": c.tied,
            "swiglu": c.swiglu,
            "norm": format!("{:?}", c.norm),
            "moe": c.moe.as_ref().map(|m| serde_json::json!({
                "experts": m.experts,
                "top_k": m.top_k,
                "every": m.every,
                "hidden": m.hidden,
            })),
            "params": self.total(),
            "active_params": self.active(),
        })
    }
}

/// The record of the model (and schedule) a run writes into `--save-dir`, for `--resume` to
/// compare with: what checkpoint shapes cannot tell (the heads) and what a resumed run should
/// keep.
const RUN_RECORD: &str = "train_gpt.json";

fn run_record(cfg: &TrainConfig) -> serde_json::Value {
    serde_json::json!({
        "model": ModelShape::of(&cfg.gpt).to_json(),
        "lr_schedule": cfg.schedule.map(|s| serde_json::json!({
            "lr": s.lr,
            "warmup": s.warmup,
            "decay": format!("{:?}", s.decay).to_lowercase(),
            "steps": s.steps,
            "min_lr": s.min_lr,
        })),
        "lr": cfg.lr,
    })
}

/// Writes [`RUN_RECORD`] into `dir` (atomically: a temporary file renamed).
fn write_run_record(dir: &std::path::Path, cfg: &TrainConfig) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--save-dir {}: {e}", dir.display()))?;
    let path = dir.join(RUN_RECORD);
    let tmp = dir.join(format!("{RUN_RECORD}.{}.tmp", std::process::id()));
    let text = serde_json::to_string_pretty(&run_record(cfg)).map_err(|e| e.to_string())?;
    std::fs::write(&tmp, text + "\n")
        .and_then(|_| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// `--resume` with a model of another shape than the latest checkpoint's: an error naming the
/// flag, both values and the rule, before any rank starts (the checkpoint's parameter shapes
/// from its manifest, the heads from the run record; no checkpoint: nothing to compare). A
/// different learning-rate schedule is a warning: the rates then differ from an uninterrupted
/// run's.
fn check_resume(dir: &std::path::Path, cfg: &TrainConfig) -> Result<(), String> {
    use candle_dtensor::train::checkpoint::{latest_step, read_manifest, TensorKind};
    let Some(step) = latest_step(dir).map_err(|e| format!("--resume: {e}"))? else {
        return Ok(());
    };
    let manifest = read_manifest(dir, step).map_err(|e| format!("--resume: {e}"))?;
    let saved: BTreeMap<String, Vec<usize>> = manifest
        .tensors
        .values()
        .filter(|t| t.kind == TensorKind::Param)
        .map(|t| (t.param.clone(), t.shape.clone()))
        .collect();
    let want = ModelShape::of(&cfg.gpt);
    let g = &cfg.gpt;
    let dim = |name: &str, i: usize| saved.get(name).and_then(|s| s.get(i).copied());
    let layers = saved
        .keys()
        .filter_map(|k| {
            k.strip_prefix("blocks.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |l| l + 1);
    let fc1 = (0..layers).find_map(|i| dim(&format!("blocks.{i}.mlp.fc1.weight"), 0));
    let mut diffs: Vec<String> = Vec::new();
    let mut differ = |flag: &str, there: Option<String>, here: String| {
        if let Some(there) = there {
            if there != here {
                diffs.push(format!(
                    "{flag}: {there} in the checkpoint, {here} in this run"
                ));
            }
        }
    };
    differ("--layers", Some(layers.to_string()), g.n_layers.to_string());
    differ(
        "--width",
        dim("tok_emb.weight", 1).map(|v| v.to_string()),
        g.d_model.to_string(),
    );
    differ(
        "--vocab",
        dim("tok_emb.weight", 0).map(|v| v.to_string()),
        g.vocab.to_string(),
    );
    differ(
        "--seq-len",
        dim("pos_emb.weight", 0).map(|v| v.to_string()),
        g.seq_len.to_string(),
    );
    differ(
        "--tied/--untied",
        Some(
            if saved.contains_key("lm_head.weight") {
                "untied"
            } else {
                "tied"
            }
            .into(),
        ),
        if g.tied { "tied" } else { "untied" }.into(),
    );
    if let (Some(h), Some(d)) = (fc1, dim("tok_emb.weight", 1).filter(|&d| d > 0)) {
        differ(
            "--mlp-ratio",
            Some(format!("{}", h as f64 / d as f64)),
            format!("{}", g.mlp_ratio as f64),
        );
    }
    // The heads leave no trace in the shapes: the run record has them.
    let record: Option<serde_json::Value> = std::fs::read(dir.join(RUN_RECORD))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if let Some(r) = &record {
        differ(
            "--heads",
            r["model"]["heads"].as_u64().map(|h| h.to_string()),
            g.n_heads.to_string(),
        );
        differ(
            "--moe",
            Some(r["model"]["moe"].to_string()),
            ModelShape::of(g).to_json()["moe"].to_string(),
        );
    }
    let rule = "(rule: a resumed run trains the checkpoint's model: give the model flags of the \
                run that saved it, or start a new --save-dir)";
    let at = format!("{} (step {step})", dir.display());
    if !diffs.is_empty() {
        return Err(format!(
            "--resume: the checkpoint in {at} holds another model: {} {rule}",
            diffs.join("; ")
        ));
    }
    let want_map: BTreeMap<String, Vec<usize>> = want.params.iter().cloned().collect();
    if saved != want_map {
        let what = want_map
            .iter()
            .find(|(n, s)| saved.get(*n) != Some(s))
            .map(|(n, s)| match saved.get(n) {
                Some(t) => format!("parameter {n} is {t:?} there, {s:?} here"),
                None => format!("parameter {n} of this model is not in it"),
            })
            .or_else(|| {
                saved
                    .keys()
                    .find(|n| !want_map.contains_key(*n))
                    .map(|n| format!("its parameter {n} is not in this model"))
            })
            .unwrap_or_default();
        return Err(format!(
            "--resume: the checkpoint in {at} holds another model: {what} {rule}"
        ));
    }
    if let Some(r) = &record {
        let now = run_record(cfg);
        if r["lr_schedule"] != now["lr_schedule"] || r["lr"] != now["lr"] {
            eprintln!(
                "train_gpt: warning: --resume: the run that saved {at} had lr {} and schedule \
                 {}, this run lr {} and schedule {}: its learning rates differ from an \
                 uninterrupted run's (--schedule-steps keeps a schedule across runs of \
                 different --steps)",
                r["lr"], r["lr_schedule"], now["lr"], now["lr_schedule"]
            );
        }
    }
    Ok(())
}

/// The metrics file of the flags (`None`: `--log-every 0`, no metrics).
fn metrics_path(args: &Args) -> Result<Option<PathBuf>, String> {
    match (args.log_every, &args.metrics) {
        (0, Some(p)) => Err(format!(
            "--metrics {}: --log-every is 0, which turns the metrics off (rule: --log-every >= 1 \
             with --metrics)",
            p.display()
        )),
        (0, None) => Ok(None),
        (_, Some(p)) => Ok(Some(p.clone())),
        (_, None) => Ok(Some(args.out.with_extension("metrics.jsonl"))),
    }
}

/// The metrics log (`--metrics`, JSON lines): rank 0 appends the record of every logged step
/// (steps `0, N, 2N, ...` of `--log-every N`, and the last) as it finishes, so the file can be
/// followed during the run; at the end it is rewritten with the held-out losses added to the
/// steps after which they were measured (a step `--log-every` skipped gets its line then, with
/// the values the report keeps).
#[derive(Debug)]
pub(crate) struct MetricsLog {
    path: PathBuf,
    every: usize,
    steps: usize,
    /// Global tokens per step.
    tokens: usize,
    flops_per_token: f64,
    /// The job's peak FLOP/s: `--peak-tflops` times the ranks.
    peak_flops: Option<f64>,
    file: Option<std::io::BufWriter<std::fs::File>>,
    records: BTreeMap<usize, serde_json::Value>,
    error: Option<String>,
}

impl MetricsLog {
    fn create(
        path: &std::path::Path,
        every: usize,
        steps: usize,
        tokens: usize,
        flops_per_token: f64,
        peak_flops: Option<f64>,
    ) -> Result<MetricsLog, String> {
        let file = std::fs::File::create(path)
            .map_err(|e| format!("--metrics {}: {e}", path.display()))?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            every: every.max(1),
            steps,
            tokens,
            flops_per_token,
            peak_flops,
            file: Some(std::io::BufWriter::new(file)),
            records: BTreeMap::new(),
            error: None,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        step: usize,
        loss: f32,
        lr: f64,
        grad_norm: Option<f64>,
        step_ms: f64,
        tokens: usize,
        phase_ms: [f64; 3],
        exposed_comm_ms: f64,
        peak_bytes: Option<usize>,
    ) -> serde_json::Value {
        let tps = tokens as f64 / (step_ms / 1e3);
        serde_json::json!({
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "mfu": self.peak_flops.map(|p| self.flops_per_token * tps / p),
            "step_ms": step_ms,
            "forward_ms": phase_ms[0],
            "backward_ms": phase_ms[1],
            "optimizer_ms": phase_ms[2],
            "exposed_comm_ms": exposed_comm_ms,
            "peak_bytes": peak_bytes,
            "eval_loss": null,
        })
    }

    fn on_step(&mut self, info: &StepInfo) {
        if !info.step.is_multiple_of(self.every) && info.step + 1 != self.steps {
            return;
        }
        let r = self.record(
            info.step,
            info.loss,
            info.lr,
            info.grad_norm,
            info.step_ms,
            info.tokens,
            info.phase_ms,
            info.exposed_comm_ms,
            Some(info.peak_bytes),
        );
        if let Some(f) = &mut self.file {
            use std::io::Write as _;
            if let Err(e) = writeln!(f, "{r}").and_then(|()| f.flush()) {
                self.error
                    .get_or_insert(format!("writing {}: {e}", self.path.display()));
                self.file = None;
            }
        }
        self.records.insert(info.step, r);
    }

    /// Adds the held-out losses and rewrites the file.
    fn finish(&mut self, report: &RankReport) -> Result<(), String> {
        self.file = None;
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        for g in &report.gpu_phase_ms {
            if let Some(r) = self.records.get_mut(&g.step) {
                r["gpu_forward_ms"] = serde_json::json!(g.phase_ms[0]);
                r["gpu_backward_ms"] = serde_json::json!(g.phase_ms[1]);
                r["gpu_optimizer_ms"] = serde_json::json!(g.phase_ms[2]);
            }
        }
        for &(done, loss) in &report.eval_losses {
            let step = done.saturating_sub(1);
            if !self.records.contains_key(&step) {
                let Some(i) = step.checked_sub(report.start_step) else {
                    continue;
                };
                let (Some(&l), Some(&lr), Some(&ms), Some(&ph), Some(&ex)) = (
                    report.losses.get(i),
                    report.lrs.get(i),
                    report.step_ms.get(i),
                    report.phase_ms.get(i),
                    report.exposed_comm_ms.get(i),
                ) else {
                    continue;
                };
                let r = self.record(step, l, lr, None, ms, self.tokens, ph, ex, None);
                self.records.insert(step, r);
            }
            if let Some(r) = self.records.get_mut(&step) {
                r["eval_loss"] = serde_json::json!(loss);
            }
        }
        let text: String = self.records.values().map(|r| format!("{r}\n")).collect();
        let tmp = self.path.with_extension("jsonl.tmp");
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .map_err(|e| format!("writing {}: {e}", self.path.display()))
    }
}

fn parse_mesh(s: &str) -> Result<Vec<(String, usize)>, String> {
    let mut dims = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, size) = part
            .split_once('=')
            .ok_or_else(|| format!("mesh dim {part:?} is not NAME=SIZE (e.g. dp=2,tp=2)"))?;
        let name = name.trim();
        if !["dp", "tp", "replicate", "shard", "ep", "cp", "pp"].contains(&name) {
            return Err(format!(
                "unknown mesh dim name {name:?}; use dp, tp, replicate, shard, ep, cp or pp"
            ));
        }
        if dims.iter().any(|(n, _)| n == name) {
            return Err(format!("mesh dim {name:?} appears twice"));
        }
        let size: usize = size
            .trim()
            .parse()
            .map_err(|_| format!("mesh dim {name}: size {size:?} is not a positive integer"))?;
        if size == 0 {
            return Err(format!("mesh dim {name} has size 0"));
        }
        dims.push((name.to_string(), size));
    }
    if dims.is_empty() {
        return Err("the mesh needs at least one dim".into());
    }
    Ok(dims)
}

fn validate(args: &Args, dims: &[(String, usize)], cfg: &GptConfig) -> Result<usize, String> {
    let product: usize = dims.iter().map(|(_, s)| s).product();
    let world = args.world.unwrap_or(product);
    if product != world {
        return Err(format!(
            "mesh {} has {product} ranks but --world is {world}",
            args.mesh
        ));
    }
    pipeline_spec(args, dims, cfg)?;
    // Heads and vocabulary against tp: GptConfig::validate, run before this.
    let tp = tp_of(dims);
    // cp shards the sequence, pp the layers; neither the batch.
    let data: usize = dims
        .iter()
        .filter(|(n, _)| n != "tp" && n != "cp" && n != "pp")
        .map(|(_, s)| s)
        .product();
    if let Some((_, cp)) = dims.iter().find(|(n, _)| n == "cp") {
        if cfg.seq_len < *cp {
            return Err(format!(
                "--mesh {} with --seq-len {}: the rule is seq-len >= cp = {cp} (every rank \
                 holds part of each sequence; with seq-len a multiple of 2 x cp the sequence \
                 is load-balanced for causal attention)",
                args.mesh, cfg.seq_len
            ));
        }
    }
    if !args.batch.is_multiple_of(data) {
        return Err(format!(
            "the batch of {} is not divisible by the {data} data-parallel ranks",
            args.batch
        ));
    }
    if args.grad_accum == 0 || !args.batch.is_multiple_of(args.grad_accum) {
        return Err(format!(
            "--grad-accum {} with --batch {}: the rule is grad-accum >= 1 and it divides the \
             batch (each step runs grad-accum micro-batches of batch / grad-accum sequences)",
            args.grad_accum, args.batch
        ));
    }
    let micro = args.batch / args.grad_accum;
    if !micro.is_multiple_of(data) {
        return Err(format!(
            "--grad-accum {} with --batch {}: the micro-batch of {micro} sequences is not \
             divisible by the {data} data-parallel ranks",
            args.grad_accum, args.batch
        ));
    }
    if args.sp && !cfg.seq_len.is_multiple_of(tp) {
        return Err(format!(
            "--sp: tp={tp} does not divide the sequence length {}",
            cfg.seq_len
        ));
    }
    if args.hsdp
        && !(dims.iter().any(|(n, _)| n == "replicate") && dims.iter().any(|(n, _)| n == "shard"))
    {
        return Err(
            "--hsdp needs a mesh with replicate and shard dims, e.g. replicate=2,shard=2".into(),
        );
    }
    if args.fault_tolerant && !args.hsdp {
        return Err("--fault-tolerant needs --hsdp (it drops whole replica groups)".into());
    }
    Ok(world)
}

/// The pipeline the flags ask for (None without a `pp` mesh dim), every rule checked before
/// any rank starts; the errors name the flags, their values and the rule.
fn pipeline_spec(
    args: &Args,
    dims: &[(String, usize)],
    cfg: &GptConfig,
) -> Result<Option<PipelineSpec>, String> {
    let size = |n: &str| dims.iter().find(|(d, _)| d == n).map(|(_, s)| *s);
    let Some(p) = size("pp") else {
        if args.microbatches != 1 || args.pp_chunks != 1 || args.pp_split.is_some() {
            return Err(format!(
                "--microbatches {}, --pp-chunks {}, --pp-split {:?}: pipeline settings need a pp \
                 mesh dim (--mesh {})",
                args.microbatches, args.pp_chunks, args.pp_split, args.mesh
            ));
        }
        return Ok(None);
    };
    if let Some((other, _)) = dims
        .iter()
        .find(|(d, _)| !["pp", "dp", "tp", "ep"].contains(&d.as_str()))
    {
        return Err(format!(
            "--mesh {}: a pp dim combines with dp, tp and ep only (pipeline with {other} is not \
             implemented)",
            args.mesh
        ));
    }
    if size("ep").is_some() && size("tp").is_some() {
        return Err(format!(
            "--mesh {}: a pp dim with both ep and tp is not implemented (a stage runs on its \
             ep group or on its tp group, not both)",
            args.mesh
        ));
    }
    if args.moe.is_some() && size("tp").is_some() {
        return Err(format!(
            "--mesh {} with --moe: mixture-of-experts blocks inside tensor-parallel pipeline \
             stages are not implemented (the rule: with pp and --moe, the other mesh dims are \
             dp and ep)",
            args.mesh
        ));
    }
    let refused: [(bool, &str); 7] = [
        (args.hsdp, "--hsdp"),
        (args.sp, "--sp"),
        (args.init_from.is_some(), "--init-from"),
        (args.eval_every > 0, "--eval-every"),
        (args.sample > 0, "--sample"),
        (args.fault_tolerant, "--fault-tolerant"),
        (args.grad_accum > 1, "--grad-accum (use --microbatches)"),
    ];
    if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
        return Err(format!(
            "--mesh {} with {flag}: not implemented with pipeline parallelism",
            args.mesh
        ));
    }
    let dp = size("dp").unwrap_or(1);
    let ep = size("ep").unwrap_or(1);
    let (m, v) = (args.microbatches, args.pp_chunks);
    if m == 0 || !args.batch.is_multiple_of(dp * ep * m) {
        let (what, rule) = if ep > 1 {
            (format!("dp={dp}, ep={ep}"), "dp x ep x microbatches")
        } else {
            (format!("dp={dp}"), "dp x microbatches")
        };
        return Err(format!(
            "--microbatches {m} with --batch {} and {what}: the rule is microbatches >= 1 and \
             {rule} divides the batch (micro-batches of batch / ({rule}) sequences)",
            args.batch
        ));
    }
    if v == 0 || p * v > cfg.n_layers {
        return Err(format!(
            "--mesh pp={p} with --pp-chunks {v} and {} blocks (--layers / --preset {}): the \
             rule is 1 <= pp x pp-chunks <= blocks (every stage needs at least one block)",
            cfg.n_layers, args.preset
        ));
    }
    let kind =
        ScheduleKind::from_name(&args.pp_schedule).map_err(|e| format!("--pp-schedule: {e}"))?;
    // The schedule is generated here only to refuse impossible settings naming the flags.
    Schedule::generate(kind, p, m, v).map_err(|e| {
        format!(
            "--pp-schedule {} with --microbatches {m}, --mesh pp={p}, --pp-chunks {v}: {e}",
            args.pp_schedule
        )
    })?;
    let split = match &args.pp_split {
        Some(text) => {
            let sizes = text
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("--pp-split {text:?}: not a list of block counts ({e})"))?;
            if sizes.len() != p * v {
                return Err(format!(
                    "--pp-split {text:?}: {} sizes for pp={p} x pp-chunks {v} = {} stages",
                    sizes.len(),
                    p * v
                ));
            }
            split_explicit(cfg.n_layers, &sizes)
                .map_err(|e| format!("--pp-split {text:?}: {e}"))?;
            Some(sizes)
        }
        None => None,
    };
    Ok(Some(PipelineSpec {
        micro_batches: m,
        schedule: kind,
        chunks: v,
        split,
    }))
}

/// The FSDP settings the flags ask for (None: no FSDP).
fn fsdp_spec(args: &Args, dims: &[(String, usize)]) -> Result<Option<FsdpSpec>, String> {
    let param_dtype = match args.mixed_precision.as_deref() {
        None | Some("f32") => None,
        Some("bf16") => Some(DType::BF16),
        Some("f16") => Some(DType::F16),
        Some(other) => {
            return Err(format!(
                "--mixed-precision: unknown dtype {other:?}; use bf16 or f16"
            ))
        }
    };
    let has = |n: &str| dims.iter().any(|(d, _)| d == n);
    if has("pp") {
        // FSDP inside a pipeline (each stage's parameters sharded over dp) only when asked
        // for with --fsdp: plain dp replicas of the pipeline otherwise. --hsdp is refused by
        // `pipeline_spec`.
        if args.fsdp && !args.no_fsdp {
            if !has("dp") {
                return Err(format!(
                    "--fsdp with --mesh {}: FSDP inside a pipeline shards over a dp mesh dim",
                    args.mesh
                ));
            }
            return Ok(Some(FsdpSpec {
                shard: "dp".into(),
                replicate: None,
                separate_rs: args.separate_rs_group,
                param_dtype,
                // Does not apply: a stage stays gathered for the whole step.
                reshard_after_forward: true,
            }));
        }
        if param_dtype.is_some() || args.separate_rs_group {
            return Err(format!(
                "--mesh {} with --mixed-precision / --separate-rs-group: with a pp dim these \
                 need --fsdp (FSDP over dp inside the pipeline)",
                args.mesh
            ));
        }
        return Ok(None);
    }
    if args.hsdp {
        return Ok(Some(FsdpSpec {
            shard: "shard".into(),
            replicate: Some("replicate".into()),
            separate_rs: args.separate_rs_group,
            param_dtype,
            reshard_after_forward: true,
        }));
    }
    if args.no_fsdp || !has("dp") {
        if param_dtype.is_some() {
            return Err("--mixed-precision needs FSDP (a dp mesh dim, or --hsdp)".into());
        }
        if args.separate_rs_group {
            return Err("--separate-rs-group needs FSDP (a dp mesh dim, or --hsdp)".into());
        }
        return Ok(None);
    }
    Ok(Some(FsdpSpec {
        shard: "dp".into(),
        replicate: None,
        separate_rs: args.separate_rs_group,
        param_dtype,
        reshard_after_forward: true,
    }))
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// How a job runs besides its training config: the communicators' options (op timeout, link
/// hints), the op timeout in seconds, the fault to inject and the metrics log rank 0 writes.
#[derive(Debug, Clone)]
struct Job {
    options: CommOptions,
    timeout: f64,
    fault: Option<Fault>,
    metrics: Option<Arc<std::sync::Mutex<MetricsLog>>>,
    /// `--count-kernels`: rank 0 opens and closes the counting window.
    kernels: Option<Arc<std::sync::Mutex<kernel_count::KernelWindow>>>,
}

/// What one rank does: build the mesh over `comm` and train.
fn train_on(
    comm: Comm,
    dims: &[(String, usize)],
    cfg: &TrainConfig,
    bar: Option<&ProgressBar>,
    job: Job,
) -> Result<RankReport, BoxErr> {
    let thread_rank = comm.backend_name() == "local";
    let device = comm.device().clone();
    let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let mesh = DeviceMesh::new(comm, &d)?;
    let rank = mesh.rank();
    let _fault_hooks = arm_collective_fault(&mesh, job.fault.as_ref(), job.timeout)?;
    let mut first = true;
    let report = train_rank(&mesh, cfg, |info| {
        if let (0, Some(bar)) = (rank, bar) {
            if std::mem::take(&mut first) {
                // A resumed run starts at its checkpoint's step: the ETA counts from here.
                bar.set_position(info.step as u64);
                bar.reset_eta();
            }
            let tps = info.tokens as f64 / (info.step_ms / 1e3);
            bar.set_message(format!(
                "loss {:.4}  lr {:.2e}  {:.0} tok/s",
                info.loss, info.lr, tps
            ));
            bar.set_position(info.step as u64 + 1);
        }
        if let (0, Some(m)) = (rank, &job.metrics) {
            m.lock().unwrap_or_else(|e| e.into_inner()).on_step(info);
        }
        if let (0, Some(k)) = (rank, &job.kernels) {
            k.lock()
                .unwrap_or_else(|e| e.into_inner())
                .on_step(info.step, &device);
        }
        inject(
            job.fault.as_ref(),
            rank,
            info.step,
            thread_rank,
            job.timeout,
        );
    })?;
    Ok(report)
}

/// Trains on `backend` and returns rank 0's report (`None` on the other ranks of a
/// multi-process world, which have nothing to print).
fn run(
    backend: &str,
    device: DeviceSpec,
    dims: &[(String, usize)],
    world: usize,
    cfg: &TrainConfig,
    job: Job,
    bar: Option<ProgressBar>,
) -> Result<Option<RankReport>, String> {
    let options = job.options.clone();
    if backend == "local" {
        let launch = |comm: Comm| {
            let comm = rank_device::on_device(comm, &device, options.clone())?;
            train_on(comm, dims, cfg, bar.as_ref(), job.clone())
        };
        let world = LocalWorld::new(world).with_options(options.clone());
        if !cfg.fault_tolerant {
            let reports = world.launch(launch).map_err(|e| e.to_string())?;
            return reports
                .into_iter()
                .next()
                .map(Some)
                .ok_or_else(|| "no rank reported".to_string());
        }
        // Elastic: a failed rank thread fails only its communicators; the survivors report.
        let outcomes = world
            .elastic(true)
            .launch_each(launch)
            .map_err(|e| e.to_string())?;
        let mut failures = Vec::new();
        let mut first = None;
        for (r, o) in outcomes.into_iter().enumerate() {
            match o {
                Ok(rep) if rep.rank == 0 && !rep.dropped && first.is_none() => first = Some(rep),
                Ok(_) => {}
                Err(e) => failures.push(format!("rank {r}: {e}")),
            }
        }
        for f in &failures {
            eprintln!("train_gpt: {f}");
        }
        return first.map(Some).ok_or_else(|| {
            format!(
                "no surviving rank 0 reported; failures: {}",
                failures.join("; ")
            )
        });
    }
    // One process per rank: its device from the launcher's local rank (one GPU per process).
    let local_rank = LaunchEnv::from_env().map(|e| e.local_index()).unwrap_or(0);
    let dev = device.device_for(local_rank).map_err(|e| e.to_string())?;
    let comm = new_comm(backend, &dev, "world", options).map_err(|e| e.to_string())?;
    if comm.size() != world {
        return Err(format!(
            "the launcher started {} ranks but --mesh {} needs {world}",
            comm.size(),
            dims.iter()
                .map(|(n, s)| format!("{n}={s}"))
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    let rank = comm.rank();
    let bar = bar.filter(|_| rank == 0);
    let report =
        train_on(comm, dims, cfg, bar.as_ref(), job).map_err(|e| format!("rank {rank}: {e}"))?;
    // Rank 0 of the mesh the run ended on reports (after a dropped replica group that may be
    // another process than the first).
    Ok((report.rank == 0 && !report.dropped).then_some(report))
}

/// The JSON of the mixture-of-experts layers: settings and what they measured per step.
fn moe_summary(m: &MoeConfig, report: &RankReport) -> serde_json::Value {
    let steps = &report.moe;
    let ms = |f: fn(&candle_dtensor::train::trainer::MoeStepReport) -> f64| {
        median(&steps.iter().map(f).collect::<Vec<_>>())
    };
    serde_json::json!({
        "experts": m.experts,
        "top_k": m.top_k,
        "every": m.every,
        "capacity_factor": m.capacity_factor,
        "dispatch": format!("{:?}", m.dispatch),
        "dispatch_ms_per_step_median": ms(|s| s.dispatch_ms),
        "combine_ms_per_step_median": ms(|s| s.combine_ms),
        "tokens_per_expert_min": steps.iter().map(|s| s.tokens_per_expert_min).min(),
        "tokens_per_expert_max": steps.iter().map(|s| s.tokens_per_expert_max).max(),
        "dropped_tokens": steps.iter().map(|s| s.dropped).sum::<usize>(),
        "dropped_per_step": steps.iter().map(|s| s.dropped).collect::<Vec<_>>(),
        "aux_loss": steps.iter().map(|s| s.aux_loss).collect::<Vec<_>>(),
    })
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// The loss curves: training loss per step (blue) and, when there is one, the held-out loss
/// (orange, a point after every evaluation); below them a panel of the learning rate per step
/// (green; a line of text when it is constant). `eval` holds `(steps done, loss)`; the x axis
/// counts steps from `start`.
fn write_svg(
    path: &PathBuf,
    losses: &[f32],
    eval: &[(usize, f32)],
    lrs: &[f64],
    start: usize,
    title: &str,
) -> std::io::Result<()> {
    let (w, h, m) = (640.0, 360.0, 50.0);
    let lr_panel = lr_panel_svg(lrs, w, m, h + 10.0, 90.0);
    let all = losses.iter().chain(eval.iter().map(|(_, l)| l)).copied();
    let max = all.clone().fold(f32::MIN, f32::max).max(1e-6) as f64;
    let min = all.fold(f32::MAX, f32::min).min(max as f32) as f64;
    let span = (max - min).max(1e-6);
    let n = losses.len().max(2) - 1;
    let point = |i: f64, l: f32| {
        let x = m + (w - 2.0 * m) * i / n as f64;
        let y = h - m - (h - 2.0 * m) * (l as f64 - min) / span;
        format!("{x:.1},{y:.1}")
    };
    let pts: Vec<String> = losses
        .iter()
        .enumerate()
        .map(|(i, &l)| point(i as f64, l))
        .collect();
    // An evaluation after `done` steps sits at the last of those steps.
    let eval_pts: Vec<String> = eval
        .iter()
        .map(|&(done, l)| point(done.saturating_sub(start + 1) as f64, l))
        .collect();
    let eval_svg = if eval.is_empty() {
        String::new()
    } else {
        let dots: String = eval_pts
            .iter()
            .map(|p| {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                format!("<circle cx=\"{x}\" cy=\"{y}\" r=\"2.5\" fill=\"#ff7f0e\"/>\n")
            })
            .collect();
        format!(
            "<polyline fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"1.5\" points=\"{}\"/>\n{dots}\
             <text x=\"{lx}\" y=\"{ly}\" fill=\"#1f77b4\">train</text>\n\
             <text x=\"{lx}\" y=\"{ly2}\" fill=\"#ff7f0e\">held-out</text>\n",
            eval_pts.join(" "),
            lx = w - m - 60.0,
            ly = m + 12.0,
            ly2 = m + 28.0,
        )
    };
    let svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{total_h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{cx}" y="20" text-anchor="middle" font-size="14">{title}</text>
<line x1="{m}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>
<line x1="{m}" y1="{m}" x2="{m}" y2="{b}" stroke="black"/>
<text x="{m}" y="{tb}" text-anchor="middle">{start}</text>
<text x="{r}" y="{tb}" text-anchor="middle">{steps}</text>
<text x="{cx}" y="{tb2}" text-anchor="middle">step</text>
<text x="{lx}" y="{m}" text-anchor="end">{max:.3}</text>
<text x="{lx}" y="{b}" text-anchor="end">{min:.3}</text>
<text x="14" y="{cy}" transform="rotate(-90 14 {cy})" text-anchor="middle">loss</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>
{eval_svg}{lr_panel}</svg>
"##,
        total_h = h + 110.0,
        cx = w / 2.0,
        cy = h / 2.0,
        b = h - m,
        r = w - m,
        tb = h - m + 15.0,
        tb2 = h - m + 32.0,
        lx = m - 4.0,
        steps = start + losses.len(),
        pts = pts.join(" "),
    );
    std::fs::write(path, svg)
}

/// The learning-rate panel of [`write_svg`]: a plot `height` high from `top`, the rate of
/// each step as a green line on its own axis (0 to the largest rate), or, when every step had
/// the same rate, one line of text saying so.
fn lr_panel_svg(lrs: &[f64], w: f64, m: f64, top: f64, height: f64) -> String {
    let Some(&first) = lrs.first() else {
        return String::new();
    };
    let bottom = top + height - 20.0;
    if lrs.iter().all(|&l| l == first) {
        return format!(
            "<text x=\"{m}\" y=\"{y}\" fill=\"#2ca02c\">learning rate: {first:.3e} at every step</text>\n",
            y = top + 20.0
        );
    }
    // LrSchedule refuses non-finite rates; nan_max keeps a NaN visible if one ever got here.
    let max = lrs
        .iter()
        .copied()
        .fold(0.0, nan_max)
        .max(f64::MIN_POSITIVE);
    let n = (lrs.len().max(2) - 1) as f64;
    let pts: Vec<String> = lrs
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let x = m + (w - 2.0 * m) * i as f64 / n;
            let y = bottom - (bottom - top) * l / max;
            format!("{x:.1},{y:.1}")
        })
        .collect();
    format!(
        "<line x1=\"{m}\" y1=\"{bottom}\" x2=\"{r}\" y2=\"{bottom}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{top}\" x2=\"{m}\" y2=\"{bottom}\" stroke=\"black\"/>\n\
         <text x=\"{lx}\" y=\"{ty}\" text-anchor=\"end\">{max:.2e}</text>\n\
         <text x=\"{lx}\" y=\"{bottom}\" text-anchor=\"end\">0</text>\n\
         <text x=\"{r}\" y=\"{ty}\" text-anchor=\"end\" fill=\"#2ca02c\">learning rate</text>\n\
         <polyline fill=\"none\" stroke=\"#2ca02c\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        pts.join(" "),
        r = w - m,
        lx = m - 4.0,
        ty = top + 4.0,
    )
}

/// The CSV of the curves: `step,loss,eval_loss` (the held-out loss on the rows of the steps
/// after which it was measured, empty elsewhere).
fn curves_csv(report: &RankReport) -> String {
    let eval: BTreeMap<usize, f32> = report.eval_losses.iter().copied().collect();
    std::iter::once("step,loss,eval_loss\n".to_string())
        .chain(report.losses.iter().enumerate().map(|(i, l)| {
            let step = report.start_step + i;
            match eval.get(&(step + 1)) {
                Some(e) => format!("{step},{l},{e}\n"),
                None => format!("{step},{l},\n"),
            }
        }))
        .collect()
}

/// What the data flags ask for: the tokenizer and the training / held-out tokens (`None`
/// tokens: the synthetic corpus, without a held-out split). Sets the model's vocabulary to the
/// data's (rounded up to a multiple of the tensor-parallel size).
struct Data {
    tokenizer: Option<text::Tokenizer>,
    train: Option<Arc<Corpus>>,
    eval: Option<Arc<Corpus>>,
}

fn load_data(args: &Args, dims: &[(String, usize)], cfg: &mut TrainConfig) -> Result<Data, String> {
    if args.tokenizer.is_some() && args.data.is_none() {
        return Err("--tokenizer needs --data".into());
    }
    let tp = dims.iter().find(|(n, _)| n == "tp").map_or(1, |(_, s)| *s);
    let (tokenizer, corpus) = match &args.data {
        Some(path) => {
            let tok = text::Tokenizer::load(args.tokenizer.as_deref())?;
            let corpus = text::corpus(path, &tok)?;
            cfg.gpt.vocab = match args.vocab {
                Some(v) if v < corpus.vocab() => {
                    return Err(format!(
                        "--vocab {v}: smaller than the vocabulary of --data, {} (rule: --vocab \
                         >= the data's vocabulary)",
                        corpus.vocab()
                    ))
                }
                Some(v) => v,
                None => corpus.vocab().div_ceil(tp) * tp,
            };
            (Some(tok), Some(corpus))
        }
        None => (None, None),
    };
    if args.eval_every == 0 {
        return Ok(Data {
            tokenizer,
            train: corpus.map(Arc::new),
            eval: None,
        });
    }
    // The held-out split: the end of the text (or of the synthetic corpus).
    let all = match corpus {
        Some(c) => c,
        None => cfg.synthetic_corpus(),
    };
    let (train, eval) = all
        .split(args.eval_fraction, cfg.gpt.seq_len + 1)
        .map_err(|e| e.to_string())?;
    Ok(Data {
        tokenizer,
        train: Some(Arc::new(train)),
        eval: Some(Arc::new(eval)),
    })
}

/// Exit status of a run whose `--check` or `--check-against` failed: it finished, but its
/// losses do not match the reference.
pub(crate) const EXIT_CHECK_FAILED: i32 = 1;
/// Exit status of an error: bad flags, a failed rank, an unreadable or malformed file.
pub(crate) const EXIT_ERROR: i32 = 2;

/// Why train_gpt did not succeed; [`exit_code`] gives each its exit status.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The run could not be done: bad flags, a failed rank, a malformed `--check-against`
    /// file, I/O.
    Error(String),
    /// The run finished, but its losses do not match its reference (`--check`,
    /// `--check-against`). The summary, printed with `--json` before this is returned, says
    /// `"check_passed": false`.
    Check(CheckFailed),
}

impl From<String> for Failure {
    fn from(e: String) -> Failure {
        Failure::Error(e)
    }
}

impl From<&str> for Failure {
    fn from(e: &str) -> Failure {
        Failure::Error(e.to_string())
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Error(e) => f.write_str(e),
            Failure::Check(c) => write!(f, "check failed: {c}"),
        }
    }
}

impl std::error::Error for Failure {}

/// The exit status of a run's result: 0 on success, [`EXIT_CHECK_FAILED`] when a check
/// failed, [`EXIT_ERROR`] on an error.
pub(crate) fn exit_code<T>(result: &Result<T, Failure>) -> i32 {
    match result {
        Ok(_) => 0,
        Err(Failure::Check(_)) => EXIT_CHECK_FAILED,
        Err(Failure::Error(_)) => EXIT_ERROR,
    }
}

/// A failed check: every mismatch found, and the run's summary.
#[derive(Debug)]
pub(crate) struct CheckFailed {
    /// What did not match, against which reference (at least one).
    pub(crate) errors: Vec<CheckError>,
    /// The summary `--json` printed (`check_passed` false, `check_error` the message). `main`
    /// has nothing more to do with it; callers of `real_main` (the tests) read it.
    #[allow(dead_code)]
    pub(crate) summary: Box<serde_json::Value>,
}

impl std::fmt::Display for CheckFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let all: Vec<String> = self.errors.iter().map(ToString::to_string).collect();
        f.write_str(&all.join("; "))
    }
}

/// One way a run does not match a reference (`against` names it: the single-device reference
/// of `--check`, or the file of `--check-against`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CheckError {
    /// The losses (or the held-out losses) differ: in number, by a NaN or an infinity on
    /// either side, or by more than the tolerance.
    Series { against: String, mismatch: Mismatch },
    /// The held-out losses were measured after other steps than the reference's.
    EvalSteps {
        against: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    /// The reference starts after this run's first step, so it cannot cover the steps run.
    StartsLate {
        against: String,
        run_first: usize,
        reference_first: usize,
    },
}

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckError::Series { against, mismatch } => write!(f, "against {against}: {mismatch}"),
            CheckError::EvalSteps { against, got, want } => write!(
                f,
                "against {against}: held-out losses measured after steps {got:?}, the \
                 reference's after steps {want:?}"
            ),
            CheckError::StartsLate {
                against,
                run_first,
                reference_first,
            } => write!(
                f,
                "against {against}: the reference starts at step {reference_first}, after this \
                 run's first step {run_first}"
            ),
        }
    }
}

/// `--check-tol`, or its default: 1e-4 for f32, 2e-3 with `--mixed-precision f16` or
/// `--precision tf32`, 2e-2 with bf16 either way (what the reference differs by, with a
/// margin: see the flag's help).
pub(crate) fn check_tol(args: &Args) -> Result<f64, String> {
    let checked = args.check || args.check_against.is_some();
    match args.check_tol {
        Some(_) if !checked => Err("--check-tol needs --check or --check-against".into()),
        Some(t) if !(t.is_finite() && t >= 0.0) => {
            Err(format!("--check-tol {t}: not a finite number >= 0"))
        }
        Some(t) => Ok(t),
        None => Ok(
            match (args.mixed_precision.as_deref(), args.precision.as_str()) {
                (Some("bf16"), _) | (_, "bf16") => 2e-2,
                (Some("f16"), _) | (_, "tf32") => 2e-3,
                _ => 1e-4,
            },
        ),
    }
}

/// A loss CSV as [`curves_csv`] writes it: the training loss of every step from `first`, and
/// the held-out losses as `(steps done, loss)`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LossCurves {
    /// The step of the first row (0 when there is none).
    pub(crate) first: usize,
    /// The loss of steps `first`, `first + 1`, ...
    pub(crate) losses: Vec<f32>,
    /// `(steps done, held-out loss)`: a value in the `eval_loss` column of step `s` was
    /// measured after `s + 1` steps.
    pub(crate) eval_losses: Vec<(usize, f32)>,
}

/// The header [`curves_csv`] writes.
const CURVES_HEADER: &str = "step,loss,eval_loss";

/// Reads a loss CSV strictly (`path` names the file in the errors): the exact header, then one
/// row per step, `step,loss,eval_loss` with consecutive integer steps, a loss (`NaN` and `inf`
/// parse, as the non-finite values they are) and an empty or numeric held-out loss. Anything
/// else is an error naming the file and the line.
pub(crate) fn parse_curves_csv(path: &std::path::Path, text: &str) -> Result<LossCurves, String> {
    let file = path.display();
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, CURVES_HEADER)) => {}
        Some((_, other)) => {
            return Err(format!(
                "{file}: line 1: header {other:?}, expected {CURVES_HEADER:?}"
            ))
        }
        None => {
            return Err(format!(
                "{file}: empty (expected the header {CURVES_HEADER:?})"
            ))
        }
    }
    let mut curves = LossCurves {
        first: 0,
        losses: Vec::new(),
        eval_losses: Vec::new(),
    };
    for (i, line) in lines {
        let n = i + 1;
        let fields: Vec<&str> = line.split(',').collect();
        let [step, loss, eval] = fields[..] else {
            return Err(format!(
                "{file}: line {n}: {line:?} has {} fields, expected 3 ({CURVES_HEADER})",
                fields.len()
            ));
        };
        let step: usize = step
            .parse()
            .map_err(|_| format!("{file}: line {n}: step {step:?} is not an integer >= 0"))?;
        if curves.losses.is_empty() {
            curves.first = step;
        } else if step != curves.first + curves.losses.len() {
            return Err(format!(
                "{file}: line {n}: step {step}, expected {} (steps must be consecutive)",
                curves.first + curves.losses.len()
            ));
        }
        let value = |what: &str, v: &str| {
            v.parse::<f32>()
                .map_err(|_| format!("{file}: line {n}: {what} {v:?} is not a number"))
        };
        curves.losses.push(value("loss", loss)?);
        if !eval.is_empty() {
            curves
                .eval_losses
                .push((step + 1, value("eval_loss", eval)?));
        }
    }
    Ok(curves)
}

/// [`parse_curves_csv`] of a file.
pub(crate) fn read_curves_csv(path: &std::path::Path) -> Result<LossCurves, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--check-against {}: {e}", path.display()))?;
    parse_curves_csv(path, &text).map_err(|e| format!("--check-against {e}"))
}

/// This run compared with one reference: the largest relative differences (`None` where the
/// series could not be compared, or where neither side has held-out losses) and what failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Comparison {
    pub(crate) max_rel: Option<f64>,
    pub(crate) max_rel_eval: Option<f64>,
    pub(crate) errors: Vec<CheckError>,
}

/// One series against its reference's: the largest relative difference when they could be
/// compared, and the mismatch when they fail (through `candle_dtensor::kernels::compare`: a
/// length difference, a NaN or an infinity, or a difference above `tol`).
fn compare_one(
    what: &str,
    got: &[f32],
    want: &[f32],
    tol: f64,
    against: &str,
    errors: &mut Vec<CheckError>,
) -> Option<f64> {
    let fail = |mismatch| CheckError::Series {
        against: against.to_string(),
        mismatch,
    };
    match compare_series_f32(what, got, want) {
        Ok(d) => {
            let max = d.max_rel;
            if let Err(m) = d.within(tol) {
                errors.push(fail(m));
            }
            Some(max)
        }
        Err(m) => {
            errors.push(fail(m));
            None
        }
    }
}

/// This run's losses (steps `start..`) and held-out losses against a reference's, both cut
/// to the steps this run ran.
pub(crate) fn compare_losses(
    against: &str,
    start: usize,
    (losses, evals): (&[f32], &[(usize, f32)]),
    (ref_losses, ref_evals): (&[f32], &[(usize, f32)]),
    tol: f64,
) -> Comparison {
    let mut errors = Vec::new();
    let what = if start == 0 {
        "loss per step".to_string()
    } else {
        format!("loss per step from step {start}")
    };
    let max_rel = compare_one(&what, losses, ref_losses, tol, against, &mut errors);
    let max_rel_eval = if evals.is_empty() && ref_evals.is_empty() {
        None
    } else {
        let steps = |e: &[(usize, f32)]| e.iter().map(|&(d, _)| d).collect::<Vec<_>>();
        let (got, want) = (steps(evals), steps(ref_evals));
        if got == want {
            let vals = |e: &[(usize, f32)]| e.iter().map(|&(_, l)| l).collect::<Vec<_>>();
            let (g, w) = (vals(evals), vals(ref_evals));
            compare_one("held-out loss", &g, &w, tol, against, &mut errors)
        } else {
            errors.push(CheckError::EvalSteps {
                against: against.to_string(),
                got,
                want,
            });
            None
        }
    };
    Comparison {
        max_rel,
        max_rel_eval,
        errors,
    }
}

/// The run of `report` (steps `start_step..`) against a loss CSV: rows before the run's first
/// step are skipped (a recorded run may start earlier than a resumed one); every other row
/// must be a step the run ran.
pub(crate) fn compare_with_curves(
    against: &str,
    report: &RankReport,
    curves: &LossCurves,
    tol: f64,
) -> Comparison {
    let start = report.start_step;
    if !curves.losses.is_empty() && curves.first > start {
        return Comparison {
            max_rel: None,
            max_rel_eval: None,
            errors: vec![CheckError::StartsLate {
                against: against.to_string(),
                run_first: start,
                reference_first: curves.first,
            }],
        };
    }
    let skip = start - curves.first;
    let want = curves.losses.get(skip..).unwrap_or(&[]);
    let want_evals: Vec<(usize, f32)> = curves
        .eval_losses
        .iter()
        .copied()
        .filter(|&(done, _)| done > start)
        .collect();
    compare_losses(
        against,
        start,
        (&report.losses, &report.eval_losses),
        (want, &want_evals),
        tol,
    )
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    // First, so the thread tuning below is logged (a debug line when set, a warning when
    // refused); installing the subscriber starts no thread, so the tuning still runs alone.
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    candle_dtensor::init_cpu_allocator();
    debug_assert_eq!(
        job::coverage(&Args::command(), SECTIONS),
        (Vec::new(), Vec::new()),
        "every flag needs a job-file key (SECTIONS)"
    );
    let args = match parse_args(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("train_gpt: error: {e}");
            std::process::exit(EXIT_ERROR);
        }
    };
    if args.print_config {
        print!("{}", print_config_text(&args));
        return;
    }
    // gemm threads: sized here, while this is still the process's only thread (later
    // `init_gemm_threads` refuses: `--link-scale auto`'s matmul threads, a CUDA context or the
    // ranks would exist). The local backend runs every rank as a thread of this process; other
    // backends one per process, as many per host as the launcher says. real_main reports a
    // bad --mesh.
    if args.backend == "local" {
        let world = parse_mesh(&args.mesh).map_or(1, |dims| {
            args.world.unwrap_or(dims.iter().map(|(_, n)| n).product())
        });
        candle_dtensor::init_gemm_threads(world, world);
    } else {
        let on_host = LaunchEnv::from_env()
            .ok()
            .and_then(|e| e.local_world_size)
            .unwrap_or(1);
        candle_dtensor::init_gemm_threads(1, on_host);
    }
    let result = real_main(&args);
    match &result {
        Ok(_) => {}
        Err(Failure::Error(e)) => eprintln!("train_gpt: error: {e}"),
        Err(f @ Failure::Check(_)) => eprintln!("train_gpt: {f}"),
    }
    let code = exit_code(&result);
    if code != 0 {
        std::process::exit(code);
    }
}

/// Trains as the flags say; rank 0 (or the only process) returns the summary printed with
/// `--json`. A failed `--check` or `--check-against` is [`Failure::Check`], returned after the
/// summary was printed and the curves written.
pub(crate) fn real_main(args: &Args) -> Result<Option<serde_json::Value>, Failure> {
    if args.print_config {
        print!("{}", print_config_text(args));
        return Ok(None);
    }
    let dims = parse_mesh(&args.mesh)?;
    let links = parse_links(args, &dims)?;
    let world_guess = args.world.unwrap_or(dims.iter().map(|(_, n)| n).product());
    let (links, link_scale) = scale_links(args, links, world_guess)?;
    let device: DeviceSpec = args.device.parse().map_err(|e| format!("--device: {e}"))?;
    let check_device: DeviceSpec = match &args.check_device {
        Some(d) => d.parse().map_err(|e| format!("--check-device: {e}"))?,
        None => match device {
            // The reference is one rank: rank 0's device.
            DeviceSpec::Cuda(None) => DeviceSpec::Cuda(Some(0)),
            d => d,
        },
    };
    // Fail before starting any rank when the device cannot work at all.
    device.device_for(0).map_err(|e| format!("--device: {e}"))?;
    if args.backend == "nccl" && !device.is_cuda() {
        return Err("--backend nccl needs --device cuda (one GPU per process)".into());
    }
    if args.count_kernels && !device.is_cuda() {
        return Err("--count-kernels needs --device cuda: the CPU runs no GPU kernels".into());
    }
    if let Some(Fault {
        at: FaultAt::Collective(n),
        ..
    }) = args.inject_fault
    {
        if args.backend == "local" {
            return Err(format!(
                "--inject-fault collective={n} needs process ranks (--backend process, mpi or \
                 nccl): a rank thread of the local backend cannot die alone; use step=S"
            )
            .into());
        }
    }
    let mut cfg = TrainConfig::new(model_config(args)?, TpPlan::gpt(args.sp));
    if let Some(m) = &args.moe {
        cfg.gpt.moe = Some(m.parse::<MoeConfig>().map_err(|e| format!("--moe: {e}"))?);
    }
    // The shape before the data is read (a zero size would break the corpus and its split);
    // the vocabulary of --data is the data's, checked after.
    let mut before_data = cfg.gpt.clone();
    if args.data.is_some() && args.vocab.is_none() {
        before_data.vocab = tp_of(&dims);
    }
    before_data
        .validate(tp_of(&dims))
        .map_err(|e| shape_error(args, &dims, &e.to_string()))?;
    let data = load_data(args, &dims, &mut cfg)?;
    cfg.gpt
        .validate(tp_of(&dims))
        .map_err(|e| shape_error(args, &dims, &e.to_string()))?;
    let gpt = cfg.gpt.clone();
    let world = validate(args, &dims, &gpt)?;
    // The precision policy: candle's process-global GEMM switches (TF32 on CUDA for `tf32`,
    // off otherwise; f32 accumulation for bf16), set once here before any rank starts (each
    // rank's trainer sets the same values again), and bf16's device check. `tf32` on the CPU
    // runs as f32: a warning, and `precision_fallback` in the summary.
    let precision = gpt
        .precision
        .apply(&device.device_for(0).map_err(|e| format!("--device: {e}"))?)
        .map_err(|e| format!("--precision {}: {e}", gpt.precision))?;
    let tol = check_tol(args)?;
    optimizer_settings(args, &mut cfg)?;
    if let (true, Some(dir)) = (args.resume, &args.save_dir) {
        check_resume(dir, &cfg)?;
    }
    // Read before training: a missing or malformed file fails at once, and `--out` may name
    // the same file (it is rewritten at the end).
    let against = match &args.check_against {
        Some(path) => Some((path, read_curves_csv(path)?)),
        None => None,
    };
    cfg.fsdp = fsdp_spec(args, &dims)?;
    cfg.steps = args.steps;
    cfg.seed = args.seed;
    cfg.batch = args.batch;
    cfg.grad_accum = args.grad_accum;
    cfg.pipeline = pipeline_spec(args, &dims, &gpt)?;
    if (args.resume || args.save_every > 0) && args.save_dir.is_none() {
        return Err("--resume and --save-every need --save-dir".into());
    }
    cfg.save_dir = args.save_dir.clone();
    cfg.save_every = args.save_every;
    cfg.resume = args.resume;
    cfg.init_from = args.init_from.clone();
    cfg.fault_tolerant = args.fault_tolerant;
    cfg.data = data.train.clone();
    cfg.eval = data.eval.as_ref().map(|corpus| EvalSpec {
        corpus: corpus.clone(),
        every: args.eval_every,
        batches: args.eval_batches,
    });
    let sample_mode = if args.temperature > 0.0 {
        format!(
            "temperature {} (seed {})",
            args.temperature,
            args.sample_seed.unwrap_or(args.seed)
        )
    } else {
        "greedy".to_string()
    };
    if args.sample > 0 {
        // Continue the first sequence of the held-out tokens (or of the training tokens).
        let source = match (&data.eval, &data.train) {
            (Some(c), _) | (None, Some(c)) => c.clone(),
            (None, None) => Arc::new(cfg.synthetic_corpus()),
        };
        let prompt = source.tokens()[..gpt.seq_len.min(source.len())].to_vec();
        cfg.sample = Some(SampleSpec {
            prompt,
            tokens: args.sample,
            temperature: args.temperature.max(0.0),
            seed: args.sample_seed.unwrap_or(args.seed),
        });
    }
    // The outputs of this process (every rank thread's process on the local backend; rank 0
    // of a launched world), opened before training so that a bad path fails first.
    let writes_outputs =
        args.backend == "local" || LaunchEnv::from_env().map_or(true, |e| e.rank == 0);
    let shape = ModelShape::of(&gpt);
    let flops_per_token = shape.flops_per_token();
    let metrics_path = metrics_path(args)?;
    if metrics_path.is_some() {
        // On every rank (the norm is an all_reduce), whichever process writes the file.
        cfg.grad_norm_every = args.log_every;
    }
    let metrics = match (&metrics_path, writes_outputs) {
        (Some(path), true) => Some(Arc::new(std::sync::Mutex::new(MetricsLog::create(
            path,
            args.log_every,
            args.steps,
            args.batch * gpt.seq_len,
            flops_per_token,
            args.peak_tflops.map(|t| t * 1e12 * world as f64),
        )?))),
        _ => None,
    };
    if let (Some(dir), true) = (&args.save_dir, writes_outputs) {
        write_run_record(dir, &cfg)?;
    }
    let kernels = args.count_kernels.then(|| {
        Arc::new(std::sync::Mutex::new(kernel_count::KernelWindow::new(
            args.steps,
        )))
    });
    let bar = ProgressBar::new(args.steps as u64);
    if args.json {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} step {pos}/{len} {msg} [{elapsed_precise}, ETA {eta_precise}]",
        )
        .map_err(|e| e.to_string())?,
    );
    let Some(report) = run(
        &args.backend,
        device,
        &dims,
        world,
        &cfg,
        Job {
            options: comm_options(args.timeout, &links),
            timeout: args.timeout,
            fault: fault_of_this_start(args.inject_fault),
            metrics: metrics.clone(),
            kernels: kernels.clone(),
        },
        Some(bar.clone()),
    )?
    else {
        // Not rank 0 of a multi-process world: rank 0 reports.
        return Ok(None);
    };
    bar.finish();
    let mut summary = serde_json::json!({
        "world": world,
        "backend": args.backend,
        "device": device.to_string(),
        "mesh": args.mesh,
        "sp": args.sp,
        "preset": args.preset,
        "steps": args.steps,
        "batch": args.batch,
        "grad_accum": args.grad_accum,
        // Sequences per micro-batch over all data-parallel ranks (pipeline: --microbatches).
        "micro_batch": args.batch / cfg.pipeline.as_ref().map_or(args.grad_accum, |p| p.micro_batches).max(1),
        "start_step": report.start_step,
        "saved_steps": report.saved_steps,
        "save_ms": report.save_ms,
        "losses": report.losses,
        "final_loss": report.losses.last(),
        "data": args.data.as_ref().map_or_else(|| "synthetic".to_string(), |p| p.display().to_string()),
        "tokenizer": data.tokenizer.as_ref().map(text::Tokenizer::describe),
        "vocab": gpt.vocab,
        "eval_losses": report.eval_losses,
        "step_ms_median": median(&report.step_ms),
        // Every step's wall time (rank 0), for benchmarks that leave warm-up steps out
        // (scripts/gpu_bench.sh).
        "step_ms": report.step_ms,
        "tokens_per_s": (args.batch * gpt.seq_len) as f64 / (median(&report.step_ms) / 1e3),
        "collectives": report.collectives,
        "params": report.params,
        "model": shape.to_json(),
        "flops_per_token": flops_per_token,
        "lrs": report.lrs,
        "fsdp": cfg.fsdp.is_some(),
        "hsdp": args.hsdp,
        "separate_rs_group": args.separate_rs_group,
        "link": links.iter().map(|(d, l)| (d.clone(), serde_json::json!({"alpha_us": l.alpha_us, "gbps": l.gbps}))).collect::<serde_json::Map<_, _>>(),
        "link_scale": link_scale.map(|s| serde_json::json!({"factor": s.factor, "rank_flops": s.rank_flops, "gpu_reference_flops": candle_dtensor::comm::link::GPU_REFERENCE_FLOPS})),
        "mixed_precision": args.mixed_precision.clone().unwrap_or_else(|| "f32".into()),
        "precision": gpt.precision.name(),
        "param_grad_optim_bytes_per_rank": report.param_grad_optim_bytes,
        "zero3_theory_bytes_per_rank": report.zero3_theory_bytes,
        "largest_param_bytes": report.largest_param_bytes,
        "exposed_comm_ms_per_step": median(&report.exposed_comm_ms),
        "forward_ms_median": median(&report.phase_ms.iter().map(|p| p[0]).collect::<Vec<_>>()),
        "backward_ms_median": median(&report.phase_ms.iter().map(|p| p[1]).collect::<Vec<_>>()),
        "optimizer_ms_median": median(&report.phase_ms.iter().map(|p| p[2]).collect::<Vec<_>>()),
    });
    // Activation checkpointing, and the most graph bytes one of rank 0's losses kept for
    // backward (the ranks of a layout hold equal pieces).
    summary["ac"] = serde_json::json!(gpt.ac.name());
    // What the three phases (host and GPU) are: a pipeline's forwards and backwards
    // interleave, so its first phase is the whole schedule and its second the gradients'
    // reductions and norm.
    summary["phase_split"] = serde_json::json!(if cfg.pipeline.is_some() {
        ["schedule", "reductions", "optimizer"]
    } else {
        ["forward", "backward", "optimizer"]
    });
    // Device-to-host reads per step on rank 0 (each a host synchronisation on a GPU): the loss
    // with the gradient norm, FSDP's gradient-presence flags (one read for all units), the MoE balancing
    // loss and, per MoE layer, its expert ids and gathered expert counts (the routing is
    // planned on the host), the pipeline's scalars. Not counted: reads inside candle's ops and a backend's
    // synchronisations inside its collectives (the local backend's CUDA path orders its
    // collectives with events and waits on the host only under CDT_LOCAL_CUDA_ORDER=sync, or
    // when more than 256 finished collectives are still held).
    summary["host_reads_per_step"] = serde_json::json!(report.host_reads);
    // GPU time per phase (CUDA timing events on rank 0's stream; absent on the CPU), and the
    // kernels per step with --count-kernels (CUPTI; every rank thread of this process).
    if !report.gpu_phase_ms.is_empty() {
        let col = |i: usize| {
            report
                .gpu_phase_ms
                .iter()
                .map(|g| g.phase_ms[i])
                .collect::<Vec<_>>()
        };
        let step: Vec<f64> = report
            .gpu_phase_ms
            .iter()
            .map(|g| g.phase_ms.iter().sum())
            .collect();
        summary["gpu_phases"] = serde_json::json!({
            "steps": report.gpu_phase_ms.len(),
            "gpu_forward_ms_median": median(&col(0)),
            "gpu_backward_ms_median": median(&col(1)),
            "gpu_optimizer_ms_median": median(&col(2)),
            "gpu_step_ms_median": median(&step),
        });
    }
    // The linears' GEMMs on cuBLASLt (CUDA; absent on the CPU): how many ran there, how many
    // of them with the bias (forward) or the bias gradient (weight gradient) in the epilogue,
    // and how often cuBLASLt refused a shape (those ran on candle's GEMM). All zero with CDT_CUBLASLT=0. Every rank thread of this process.
    if device.is_cuda() {
        let lt = candle_dtensor::kernels::fused::cublaslt_counts();
        summary["cublaslt"] = serde_json::json!({
            "matmuls": lt.matmuls,
            "bias_epilogues": lt.bias_epilogues,
            "bias_grads": lt.bias_grads,
            "refused": lt.refused,
            "refusals": candle_dtensor::kernels::fused::cublaslt_refusals(),
        });
    }
    if let Some(k) = &kernels {
        let in_process = if args.backend == "local" { world } else { 1 };
        summary["kernels"] = k
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .summary(in_process);
    }
    // The precision policy: asked for, run (tf32 on the CPU runs f32, and says why), the
    // GEMMs' dtype and the gradient reduction's (f32 master weights: f32 under every policy;
    // with --mixed-precision FSDP still reduce-scatters in f32).
    summary["precision_effective"] = serde_json::json!(precision.effective.name());
    summary["precision_fallback"] = serde_json::json!(precision.fallback);
    summary["gemm_dtype"] = serde_json::json!(match (
        precision.effective.gemm_dtype(),
        args.mixed_precision.as_deref()
    ) {
        (Some(d), _) => format!("{d:?}").to_lowercase(),
        (None, Some(mp)) if mp != "f32" => mp.to_string(),
        (None, _) if precision.effective == candle_dtensor::models::Precision::Tf32 =>
            "tf32".into(),
        _ => "f32".into(),
    });
    summary["grad_reduce_dtype"] =
        serde_json::json!(format!("{:?}", precision.effective.grad_reduce_dtype()).to_lowercase());
    summary["peak_activation_bytes"] = serde_json::json!(report.peak_activation_bytes);
    // Pipeline parallelism: the schedule, its analytic bubble (unit-time simulation: forward 1,
    // backward 2) and the bubble measured per step over rank 0's pipeline.
    summary["pipeline"] = match &cfg.pipeline {
        Some(p) => serde_json::json!({
            "schedule": args.pp_schedule,
            "microbatches": p.micro_batches,
            "chunks": p.chunks,
            "split": p.split,
            "analytic_bubble": report.pipeline.first().map(|s| s.analytic_bubble),
            "measured_bubble": report.pipeline.iter().map(|s| s.measured_bubble).collect::<Vec<_>>(),
            "measured_bubble_median": median(&report.pipeline.iter().map(|s| s.measured_bubble).collect::<Vec<_>>()),
            // The schedule simulated with each step's mean action times (F, B, I, W).
            "modelled_bubble": report.pipeline.iter().map(|s| s.modelled_bubble).collect::<Vec<_>>(),
            "modelled_bubble_median": median(&report.pipeline.iter().map(|s| s.modelled_bubble).collect::<Vec<_>>()),
            "action_ms": report.pipeline.last().map(|s| serde_json::json!({
                "forward": s.action_ms[0], "backward": s.action_ms[1],
                "backward_input": s.action_ms[2], "backward_weight": s.action_ms[3],
            })),
            "rank0_bubble": report.pipeline.iter().map(|s| s.rank_bubble).collect::<Vec<_>>(),
            // Zero-bubble: rank 0's weight-gradient GEMMs moved from B to W, and its W time.
            "rank0_deferred_weight_grads": report.pipeline.iter().map(|s| s.deferred_weight_grads).collect::<Vec<_>>(),
            "rank0_weight_grad_ms": report.pipeline.iter().map(|s| s.weight_grad_ms).collect::<Vec<_>>(),
            "rank0_peak_deferred_bytes": report.pipeline.iter().map(|s| s.peak_deferred_bytes).max(),
        }),
        None => serde_json::Value::Null,
    };
    // Fault tolerance (outside the macro above: its recursion limit).
    summary["fault_tolerant"] = serde_json::json!(args.fault_tolerant);
    // The global steps done when the run ended (a resumed run counts its checkpoint's).
    summary["steps_completed"] = serde_json::json!(report.start_step + report.losses.len());
    summary["lost_ranks"] = serde_json::json!(report.lost_ranks);
    // Fault detected to the retried step started, summed over recoveries (null: no fault).
    summary["recovery_ms"] = serde_json::json!((!report.recoveries.is_empty()).then(|| report
        .recoveries
        .iter()
        .map(|r| r.recovery_ms)
        .sum::<f64>()));
    summary["recoveries"] = report
        .recoveries
        .iter()
        .map(|r| {
            serde_json::json!({
                "step": r.step,
                "failed": r.failed,
                "dropped": r.dropped,
                "recovery_ms": r.recovery_ms,
                "stall_ms": r.stall_ms,
                "replicas": r.replicas,
            })
        })
        .collect::<Vec<_>>()
        .into();
    if let Some(m) = &gpt.moe {
        summary["moe"] = moe_summary(m, &report);
    }
    let mut check_errors: Vec<CheckError> = Vec::new();
    if args.check {
        let mut single = cfg.clone();
        single.fsdp = None;
        // The reference trains from scratch (or from --init-from) without checkpoints; a
        // resumed run is compared with its steps from `start_step` on.
        single.save_dir = None;
        single.save_every = 0;
        single.resume = false;
        single.fault_tolerant = false;
        // With mixture-of-experts blocks the balancing loss is per micro-batch: the reference
        // accumulates the pipeline's micro-batches (the same rows, --grad-accum's split).
        if let (Some(p), Some(_)) = (&single.pipeline, &single.gpt.moe) {
            single.grad_accum = p.micro_batches;
        }
        single.pipeline = None;
        let reference = run(
            "local",
            check_device,
            &[("tp".to_string(), 1)],
            1,
            &single,
            Job {
                options: comm_options(args.timeout, &[]),
                timeout: args.timeout,
                fault: None,
                metrics: None,
                kernels: None,
            },
            None,
        )?
        .ok_or_else(|| "the single-device reference did not report".to_string())?;
        let start = report.start_step;
        let ref_evals: Vec<(usize, f32)> = reference
            .eval_losses
            .iter()
            .copied()
            .filter(|&(done, _)| done > start)
            .collect();
        let c = compare_losses(
            "the single-device reference",
            start,
            (&report.losses, &report.eval_losses),
            (reference.losses.get(start..).unwrap_or(&[]), &ref_evals),
            tol,
        );
        summary["ref_losses"] = serde_json::json!(reference.losses);
        summary["max_rel_loss_diff"] = serde_json::json!(c.max_rel);
        summary["ref_eval_losses"] = serde_json::json!(reference.eval_losses);
        summary["max_rel_eval_loss_diff"] = serde_json::json!(c.max_rel_eval);
        summary["ref_sample_equal"] = serde_json::json!(reference.sample == report.sample);
        summary["ref_step_ms_median"] = serde_json::json!(median(&reference.step_ms));
        summary["ref_device"] = serde_json::json!(check_device.to_string());
        if !args.json {
            print_comparison("single device", &report, &c, tol);
            if cfg.sample.is_some() {
                println!(
                    "check: the single device generates {} tokens",
                    if reference.sample == report.sample {
                        "the same"
                    } else {
                        "different"
                    }
                );
            }
        }
        check_errors.extend(c.errors);
    }
    if let Some((path, curves)) = &against {
        let c = compare_with_curves(&path.display().to_string(), &report, curves, tol);
        summary["check_against"] = serde_json::json!({
            "file": path.display().to_string(),
            "max_rel_loss_diff": c.max_rel,
            "max_rel_eval_loss_diff": c.max_rel_eval,
        });
        if !args.json {
            print_comparison(&path.display().to_string(), &report, &c, tol);
        }
        check_errors.extend(c.errors);
    }
    let checked = args.check || against.is_some();
    summary["check_tol"] = serde_json::json!(checked.then_some(tol));
    summary["check_passed"] = serde_json::json!(checked.then_some(check_errors.is_empty()));
    summary["check_error"] = serde_json::json!((!check_errors.is_empty()).then(|| {
        check_errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }));
    let csv = curves_csv(&report);
    let csv_path = args.out.with_extension("csv");
    let svg_path = args.out.with_extension("svg");
    std::fs::write(&csv_path, csv).map_err(|e| format!("writing {}: {e}", csv_path.display()))?;
    write_svg(
        &svg_path,
        &report.losses,
        &report.eval_losses,
        &report.lrs,
        report.start_step,
        &format!(
            "train_gpt {} ({} layers, width {}) mesh {}",
            args.preset, gpt.n_layers, gpt.d_model, args.mesh
        ),
    )
    .map_err(|e| format!("writing {}: {e}", svg_path.display()))?;
    if let Some(m) = &metrics {
        let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
        m.finish(&report)?;
    }
    let job_path = args.out.with_extension("job.toml");
    if let Some(job) = &args.job {
        std::fs::write(&job_path, job)
            .map_err(|e| format!("writing {}: {e}", job_path.display()))?;
    }
    summary["metrics"] = serde_json::json!(metrics_path
        .as_ref()
        .filter(|_| metrics.is_some())
        .map(|p| p.display().to_string()));
    summary["job"] = serde_json::json!(args.job.as_ref().map(|_| job_path.display().to_string()));
    summary["mfu"] = serde_json::json!(args.peak_tflops.map(|t| {
        let tps = (args.batch * gpt.seq_len) as f64 / (median(&report.step_ms) / 1e3);
        flops_per_token * tps / (t * 1e12 * world as f64)
    }));
    let sample_text = data
        .tokenizer
        .as_ref()
        .unwrap_or(&text::Tokenizer::Bytes)
        .decode(&report.sample);
    if cfg.sample.is_some() {
        summary["sample"] = serde_json::json!({
            "mode": sample_mode,
            "tokens": report.sample,
            // Text for --data; the synthetic corpus's ids are not text.
            "text": data.tokenizer.is_some().then(|| sample_text.clone()),
        });
    }
    if args.json {
        println!("{summary}");
    } else {
        let coll: BTreeMap<String, BTreeMap<String, usize>> = report.collectives.clone();
        println!(
            "trained steps {}..{} on mesh {}: loss {:.4} -> {:.4}, median step {:.1} ms, {:.0} tokens/s",
            report.start_step,
            report.start_step + report.losses.len(),
            args.mesh,
            report.losses.first().copied().unwrap_or(f32::NAN),
            report.losses.last().copied().unwrap_or(f32::NAN),
            median(&report.step_ms),
            (args.batch * gpt.seq_len) as f64 / (median(&report.step_ms) / 1e3)
        );
        if args.grad_accum > 1 {
            println!(
                "gradient accumulation: {} micro-batches of {} sequences per step",
                args.grad_accum,
                args.batch / args.grad_accum
            );
        }
        println!("collectives per step: {coll:?}");
        if let Some(m) = summary.get("moe") {
            println!("mixture of experts: {m}");
        }
        if !report.saved_steps.is_empty() {
            println!(
                "saved checkpoints after steps {:?} in {}",
                report.saved_steps,
                args.save_dir
                    .as_deref()
                    .map_or_else(String::new, |d| d.display().to_string())
            );
        }
        for (done, l) in &report.eval_losses {
            println!("held-out loss after {done} steps: {l:.4}");
        }
        if let Some(spec) = &cfg.sample {
            match &data.tokenizer {
                Some(tok) => println!(
                    "sample ({sample_mode}, {} tokens) after {:?}:\n{sample_text}",
                    spec.tokens,
                    tok.decode(&spec.prompt)
                ),
                None => println!(
                    "sample ({sample_mode}, {} tokens of the synthetic corpus): {:?}",
                    spec.tokens, report.sample
                ),
            }
        }
        let mut wrote = vec![
            csv_path.display().to_string(),
            svg_path.display().to_string(),
        ];
        if let Some(p) = metrics_path.as_ref().filter(|_| metrics.is_some()) {
            wrote.push(p.display().to_string());
        }
        if args.job.is_some() {
            wrote.push(job_path.display().to_string());
        }
        println!("wrote {}", wrote.join(", "));
    }
    if !check_errors.is_empty() {
        return Err(Failure::Check(CheckFailed {
            errors: check_errors,
            summary: Box::new(summary),
        }));
    }
    Ok(Some(summary))
}

/// The `check:` lines of a comparison (without `--json`).
fn print_comparison(against: &str, report: &RankReport, c: &Comparison, tol: f64) {
    let figure =
        |m: Option<f64>| m.map_or_else(|| "not comparable".to_string(), |m| format!("{m:.3e}"));
    println!(
        "check: max relative loss difference vs {against} over {} steps: {} (tolerance {tol:.1e})",
        report.losses.len(),
        figure(c.max_rel)
    );
    if !report.eval_losses.is_empty() || c.max_rel_eval.is_some() {
        println!(
            "check: max relative held-out loss difference over {} evaluations: {}",
            report.eval_losses.len(),
            figure(c.max_rel_eval)
        );
    }
}
