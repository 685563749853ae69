//! Train a llama under FSDP on local ranks: candle-transformers' own (unmodified) model, or a
//! llama written with candle-nn and `candle_dtensor::nn`'s differentiable drop-ins, optionally
//! tensor-parallel.
//!
//! ```text
//! cargo run --release --example train_llama                          # candle-transformers, FSDP over 2 ranks
//! cargo run --release --example train_llama -- --ranks 4 --check     # ... compared with one device
//! cargo run --release --example train_llama -- --model own --check   # every parameter trains
//! cargo run --release --example train_llama -- --model own --ranks 4 --tp 2 --check   # FSDP x TP
//! train_llama --device cuda --check          # rank threads on the GPUs (feature `cuda`), checked on the CPU
//! ```
//!
//! The data is a synthetic corpus generated from the seed; the model is tiny (vocab 64, width
//! 32, 2 blocks). FSDP has one unit per block (`model.layers.{i}`) and a root unit for the
//! rest; each rank trains on its rows of the global batch (gradients averaged). `--check` also
//! trains the model on one device (`reference_var_builder`, the same initial values) and
//! compares every step's loss and every gradient one device has (losses and the first step's
//! gradients within 1e-5 relative; later gradients, taken at parameters f32 rounding moved
//! apart, within 1e-4), and which parameters have one.
//!
//! candle-transformers' llama uses candle-nn's fused `ops::rms_norm`, `ops::softmax_last_dim`
//! and `rotary_emb::rope`, which have no backward (candle#2168, #3011): on one device only
//! `lm_head` gets a gradient, and FSDP reproduces exactly that (the others get none and are
//! reported). `--model own` swaps in `candle_dtensor::nn`'s drop-ins, and every parameter trains.
#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "common/llama.rs"]
mod llama;
#[path = "common/rank_device.rs"]
mod rank_device;

use std::time::Duration;

use candle_dtensor::comm::{CommOptions, LocalWorld};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::models::device::DeviceSpec;
use clap::{Parser, ValueEnum};
use llama::{Arch, Report, Run, Sizes};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelArg {
    /// candle-transformers' llama, unmodified.
    Transformers,
    /// A llama written with candle-nn and candle_dtensor::nn's drop-ins (examples/common/llama.rs).
    Own,
}

#[derive(Parser, Debug)]
#[command(about = "Train a tiny llama under FSDP (x TP) on local ranks")]
struct Args {
    /// Local ranks (threads).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Tensor-parallel ranks (`--model own` only): a `dp x tp` mesh with dp = ranks / tp.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Which llama.
    #[arg(long, value_enum, default_value_t = ModelArg::Transformers)]
    model: ModelArg,
    /// Training steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Global batch (sequences per step); a multiple of the data-parallel ranks.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length (at most 64).
    #[arg(long, default_value_t = 16)]
    seq: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the parameters and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also train on one device and compare every step's loss and gradients.
    #[arg(long)]
    check: bool,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Where the ranks train: `cpu`, `cuda` (rank r on GPU r % GPUs) or `cuda:N`; `--check`'s
    /// one-device reference always trains on the CPU.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn main() {
    candle_dtensor::init_cpu_threads();
    let args = Args::parse();
    // Here, while this is still the process's only thread (later `init_gemm_threads` refuses:
    // a CUDA context or the rank threads would exist); real_main checks --ranks.
    candle_dtensor::init_gemm_threads(args.ranks, args.ranks);
    match real_main(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("train_llama: error: {e}");
            std::process::exit(2);
        }
    }
}

/// Trains; `Ok(false)` when `--check` found a difference.
fn real_main(args: &Args) -> Result<bool, String> {
    let sizes = Sizes::tiny();
    if args.ranks == 0 || args.tp == 0 || args.ranks % args.tp != 0 {
        return Err(format!(
            "--tp {} must divide --ranks {} (both at least 1)",
            args.tp, args.ranks
        ));
    }
    let arch = match args.model {
        ModelArg::Transformers => Arch::Transformers,
        ModelArg::Own => Arch::Own,
    };
    if args.tp > 1 && arch == Arch::Transformers {
        return Err(
            "--tp needs --model own: candle-transformers' llama builds candle-nn \
                    linears, which tensor parallelism cannot split"
                .into(),
        );
    }
    let dp = args.ranks / args.tp;
    if args.batch % dp != 0 || args.batch == 0 {
        return Err(format!(
            "--batch {} must be a positive multiple of the {dp} data-parallel ranks",
            args.batch
        ));
    }
    if args.seq == 0 || args.seq > sizes.max_seq {
        return Err(format!("--seq must be in 1..={}", sizes.max_seq));
    }
    let device: DeviceSpec = args.device.parse().map_err(|e| format!("--device: {e}"))?;
    device.device_for(0).map_err(|e| format!("--device: {e}"))?;
    let run = Run {
        arch,
        sizes,
        steps: args.steps,
        batch: args.batch,
        seq: args.seq,
        lr: args.lr,
        seed: args.seed,
        keep_grads: args.check,
    };
    let dims: Vec<(&str, usize)> = if args.tp > 1 {
        vec![("dp", dp), ("tp", args.tp)]
    } else {
        vec![("dp", dp)]
    };
    let timeout = Duration::from_secs(args.timeout);
    let reports = LocalWorld::new(args.ranks)
        .with_timeout(timeout)
        .launch(|comm| -> Result<Report, llama::BoxErr> {
            let options = CommOptions::default().with_timeout(timeout);
            let comm = rank_device::on_device(comm, &device, options)?;
            let mesh = DeviceMesh::new(comm, &dims)?;
            llama::train_rank(&mesh, &run)
        })
        .map_err(|e| e.to_string())?;
    let r0 = &reports[0];
    let mesh: Vec<String> = dims.iter().map(|(n, s)| format!("{n}={s}")).collect();
    println!(
        "{:?} llama ({} parameters) under FSDP on mesh {}; units: {}",
        args.model,
        r0.params.len(),
        mesh.join(","),
        r0.units.join(", ")
    );
    let reference = if args.check {
        Some(llama::train_one_device(&run).map_err(|e| e.to_string())?)
    } else {
        None
    };
    for (step, loss) in r0.losses.iter().enumerate() {
        match &reference {
            Some(r) => println!(
                "step {step:>3}: loss {loss:.6} (one device {:.6})",
                r.losses[step]
            ),
            None => println!("step {step:>3}: loss {loss:.6}"),
        }
    }
    if r0.without_grad.is_empty() {
        println!("every parameter got a gradient");
    } else {
        println!(
            "{} of {} parameters got no gradient on any rank (as on one device), so they do not \
             train: {}",
            r0.without_grad.len(),
            r0.params.len(),
            r0.without_grad.join(", ")
        );
        if arch == Arch::Transformers {
            println!(
                "  cause: candle-transformers' llama uses candle-nn's fused ops::rms_norm, \
                 ops::softmax_last_dim and rotary_emb::rope, which have no backward \
                 (candle#2168, #3011); everything before the final norm is cut from the graph. \
                 `--model own` builds a llama with candle_dtensor::nn's differentiable drop-ins."
            );
        }
    }
    let Some(reference) = reference else {
        return Ok(true);
    };
    // Losses and the first step's gradients (the same parameters on both) within 1e-5; later
    // steps' gradients are taken at parameters f32 rounding moved apart, and drift (about 1e-5
    // after 40 steps): bounded by 1e-4.
    let mut ok = true;
    let mut same_sets = true;
    let mut worst = (0.0f64, 0.0f64, 0.0f64);
    for (rank, r) in reports.iter().enumerate() {
        let c = llama::compare(&reference, r).map_err(|e| e.to_string())?;
        worst = (
            worst.0.max(c.max_loss_rel),
            worst.1.max(c.first_grad_rel),
            worst.2.max(c.max_grad_rel),
        );
        for (step, missing, extra) in &c.grad_set_mismatch {
            ok = false;
            same_sets = false;
            println!(
                "check: rank {rank} step {step}: gradients one device has and FSDP lacks: \
                 {missing:?}; FSDP has and one device lacks: {extra:?}"
            );
        }
        if c.max_loss_rel > 1e-5 || c.first_grad_rel > 1e-5 || c.max_grad_rel > 1e-4 {
            ok = false;
            println!(
                "check: rank {rank}: loss diff {:.3e}, first-step gradient diff {:.3e}, any-step \
                 gradient diff {:.3e} (worst: {:?})",
                c.max_loss_rel, c.first_grad_rel, c.max_grad_rel, c.worst
            );
        }
    }
    let with_grad = reference.grads.last().map_or(0, |g| g.len());
    println!(
        "check vs one device over {} steps: max relative loss difference {:.3e}; gradients of the \
         {with_grad} parameter(s) one device trains: max relative difference {:.3e} at the first \
         step, {:.3e} over all steps; the same parameters have gradients: {}",
        run.steps,
        worst.0,
        worst.1,
        worst.2,
        if same_sets { "yes" } else { "NO" }
    );
    Ok(ok)
}
