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
//! With `--save-dir` it writes distributed checkpoints (`models::checkpoint`); `--resume`
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
//! `--mixed-precision` 2e-3 for f16, 2e-2 for bf16), a NaN or infinite loss on either side, or
//! a different number of steps or evaluations fails the run. The summary still prints (`"check_passed": false`,
//! `"check_error"`: what failed, where, and the values), then `train_gpt: check failed: ...` on
//! stderr. Exit status: 0 success; 1 a failed check (the run itself finished); 2 an error (bad
//! flags, a failed rank, an unreadable or malformed `--check-against` file).
//!
//! ```text
//! cargo run --release --example train_gpt -- --data input.txt --eval-every 25 --sample 200
//! cargo run --release --example train_gpt -- --data input.txt --tokenizer tokenizer.json --sample 50 --temperature 0.8
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

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
use candle_dtensor::kernels::compare::{compare_series_f32, Mismatch};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::models::data::Corpus;
use candle_dtensor::models::device::DeviceSpec;
use candle_dtensor::models::trainer::{
    train_rank, EvalSpec, FsdpSpec, RankReport, SampleSpec, TrainConfig,
};
use candle_dtensor::models::{GptConfig, MoeConfig, TpPlan};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a GPT with tensor / data / fully sharded parallelism")]
pub(crate) struct Args {
    /// Number of ranks (threads). Defaults to the product of --mesh.
    #[arg(long)]
    world: Option<usize>,
    /// Mesh, e.g. `tp=4`, `dp=2,tp=2`, `replicate=2,shard=2`, `dp=2,ep=2`. Dim names: dp, tp,
    /// replicate, shard, ep (experts of --moe sharded over it; a data dim otherwise).
    #[arg(long, default_value = "dp=2,tp=2")]
    mesh: String,
    /// Shard parameters, gradients and optimizer state over the data-parallel dim (FSDP).
    /// On by default; `--no-fsdp` replicates them (data parallelism with all-reduced gradients).
    #[arg(long, overrides_with = "no_fsdp")]
    fsdp: bool,
    /// Turn FSDP off.
    #[arg(long)]
    no_fsdp: bool,
    /// HSDP: shard over `shard`, replicate over `replicate` (needs those mesh dims).
    #[arg(long)]
    hsdp: bool,
    /// Give FSDP's reduce_scatter its own communicator (overlaps the all_gathers).
    #[arg(long)]
    separate_rs_group: bool,
    /// FSDP mixed precision: compute dtype of the parameters (`bf16` or `f16`; master shards
    /// and gradient reduction stay f32).
    #[arg(long)]
    mixed_precision: Option<String>,
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
    /// Model preset: tiny or small.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Seed of the parameters and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Global batch size (sequences per step).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip: Option<f64>,
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
    /// Output prefix of the loss CSV and SVG.
    #[arg(long, default_value = "train_gpt_loss")]
    out: PathBuf,
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
    /// the op timeout, then fails). Only on a job's first start (`TORCHELASTIC_RESTART_COUNT`
    /// unset or 0, which `dtrun --max-restarts` raises), so a restarted job runs through.
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

/// What `--inject-fault` does to a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultKind {
    Kill,
    Hang,
}

/// `--inject-fault`: rank `rank` dies or hangs after step `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fault {
    pub(crate) rank: usize,
    pub(crate) step: usize,
    pub(crate) kind: FaultKind,
}

pub(crate) fn parse_fault(s: &str) -> Result<Fault, String> {
    let (mut rank, mut step, mut kind) = (None, None, FaultKind::Kill);
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
                    "--inject-fault: unknown key {other:?} (rank, step, kind)"
                ))
            }
        }
    }
    match (rank, step) {
        (Some(rank), Some(step)) => Ok(Fault { rank, step, kind }),
        _ => Err(format!("--inject-fault {s:?}: needs rank=R,step=S")),
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
    let Some(f) = fault.filter(|f| f.rank == rank && f.step == step) else {
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

fn parse_mesh(s: &str) -> Result<Vec<(String, usize)>, String> {
    let mut dims = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, size) = part
            .split_once('=')
            .ok_or_else(|| format!("mesh dim {part:?} is not NAME=SIZE (e.g. dp=2,tp=2)"))?;
        let name = name.trim();
        if !["dp", "tp", "replicate", "shard", "ep"].contains(&name) {
            return Err(format!(
                "unknown mesh dim name {name:?}; use dp, tp, replicate, shard or ep"
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
    let tp = dims.iter().find(|(n, _)| n == "tp").map_or(1, |(_, s)| *s);
    if !cfg.n_heads.is_multiple_of(tp) {
        return Err(format!(
            "tp={tp} does not divide the {} attention heads",
            cfg.n_heads
        ));
    }
    if !cfg.vocab.is_multiple_of(tp) {
        return Err(format!(
            "tp={tp} does not divide the vocabulary of {}",
            cfg.vocab
        ));
    }
    let data: usize = dims
        .iter()
        .filter(|(n, _)| n != "tp")
        .map(|(_, s)| s)
        .product();
    if !args.batch.is_multiple_of(data) {
        return Err(format!(
            "the batch of {} is not divisible by the {data} data-parallel ranks",
            args.batch
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
/// hints), the op timeout in seconds and the fault to inject.
#[derive(Debug, Clone)]
struct Job {
    options: CommOptions,
    timeout: f64,
    fault: Option<Fault>,
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
    let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let mesh = DeviceMesh::new(comm, &d)?;
    let rank = mesh.rank();
    let report = train_rank(&mesh, cfg, |info| {
        if let (0, Some(bar)) = (rank, bar) {
            let tps = info.tokens as f64 / (info.step_ms / 1e3);
            bar.set_message(format!("loss {:.4}  {:.0} tok/s", info.loss, tps));
            bar.set_position(info.step as u64 + 1);
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
    let ms = |f: fn(&candle_dtensor::models::trainer::MoeStepReport) -> f64| {
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
/// (orange, a point after every evaluation). `eval` holds `(steps done, loss)`; the x axis
/// counts steps from `start`.
fn write_svg(
    path: &PathBuf,
    losses: &[f32],
    eval: &[(usize, f32)],
    start: usize,
    title: &str,
) -> std::io::Result<()> {
    let (w, h, m) = (640.0, 360.0, 50.0);
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
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
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
{eval_svg}</svg>
"##,
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
            cfg.gpt.vocab = corpus.vocab().div_ceil(tp) * tp;
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

/// `--check-tol`, or its default: 1e-4 for f32, 2e-3 with `--mixed-precision f16`, 2e-2
/// with bf16 (what the f32 reference differs by, with a margin: see the flag's help).
pub(crate) fn check_tol(args: &Args) -> Result<f64, String> {
    let checked = args.check || args.check_against.is_some();
    match args.check_tol {
        Some(_) if !checked => Err("--check-tol needs --check or --check-against".into()),
        Some(t) if !(t.is_finite() && t >= 0.0) => {
            Err(format!("--check-tol {t}: not a finite number >= 0"))
        }
        Some(t) => Ok(t),
        None => Ok(match args.mixed_precision.as_deref() {
            Some("bf16") => 2e-2,
            Some("f16") => 2e-3,
            _ => 1e-4,
        }),
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

fn main() {
    candle_dtensor::init_cpu_threads();
    candle_dtensor::init_cpu_allocator();
    let args = Args::parse();
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
    let mut cfg = TrainConfig::new(
        GptConfig::preset(&args.preset).map_err(|e| e.to_string())?,
        TpPlan::gpt(args.sp),
    );
    if let Some(m) = &args.moe {
        cfg.gpt.moe = Some(m.parse::<MoeConfig>().map_err(|e| format!("--moe: {e}"))?);
    }
    let data = load_data(args, &dims, &mut cfg)?;
    let gpt = cfg.gpt.clone();
    let world = validate(args, &dims, &gpt)?;
    let tol = check_tol(args)?;
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
    cfg.lr = args.lr;
    cfg.clip = args.clip;
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
    let bar = ProgressBar::new(args.steps as u64);
    if args.json {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise}]")
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
        "tokens_per_s": (args.batch * gpt.seq_len) as f64 / (median(&report.step_ms) / 1e3),
        "collectives": report.collectives,
        "params": report.params,
        "fsdp": cfg.fsdp.is_some(),
        "hsdp": args.hsdp,
        "separate_rs_group": args.separate_rs_group,
        "link": links.iter().map(|(d, l)| (d.clone(), serde_json::json!({"alpha_us": l.alpha_us, "gbps": l.gbps}))).collect::<serde_json::Map<_, _>>(),
        "link_scale": link_scale.map(|s| serde_json::json!({"factor": s.factor, "rank_flops": s.rank_flops, "gpu_reference_flops": candle_dtensor::comm::link::GPU_REFERENCE_FLOPS})),
        "mixed_precision": args.mixed_precision.clone().unwrap_or_else(|| "f32".into()),
        "param_grad_optim_bytes_per_rank": report.param_grad_optim_bytes,
        "zero3_theory_bytes_per_rank": report.zero3_theory_bytes,
        "largest_param_bytes": report.largest_param_bytes,
        "exposed_comm_ms_per_step": median(&report.exposed_comm_ms),
        "forward_ms_median": median(&report.phase_ms.iter().map(|p| p[0]).collect::<Vec<_>>()),
        "backward_ms_median": median(&report.phase_ms.iter().map(|p| p[1]).collect::<Vec<_>>()),
        "optimizer_ms_median": median(&report.phase_ms.iter().map(|p| p[2]).collect::<Vec<_>>()),
    });
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
        report.start_step,
        &format!("train_gpt {} mesh {}", args.preset, args.mesh),
    )
    .map_err(|e| format!("writing {}: {e}", svg_path.display()))?;
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
        println!("wrote {} and {}", csv_path.display(), svg_path.display());
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
