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
//! apart, within 1e-4; `--loss-tol`, `--first-grad-tol`, `--grad-tol`), and which parameters
//! have one. It exits with status 1 when a difference is past its tolerance, a loss or
//! gradient is NaN or infinite, the step counts differ or the parameters with a gradient
//! differ, naming the rank, step and parameter (2 on any other error). `--plant KIND` corrupts
//! the last rank's report before the check, to see it fail (`--plant nan-loss --check` must
//! exit 1).
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
use candle_dtensor::train::device::DeviceSpec;
use clap::{Parser, ValueEnum};
use llama::{Arch, Plant, Report, Run, Sizes, Tolerances};

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
    /// Also train on one device and compare every step's loss and gradients. Exit status 1
    /// when a loss or gradient differs past its tolerance (--loss-tol, --first-grad-tol,
    /// --grad-tol), is NaN or infinite, the step counts differ, or the parameters with a
    /// gradient differ.
    #[arg(long)]
    check: bool,
    /// --check: tolerance of every step's loss, |loss - one device's| / |one device's|.
    #[arg(long, default_value_t = Tolerances::TRAIN_LLAMA.loss)]
    loss_tol: f64,
    /// --check: tolerance of the first step's gradients (both runs at the same parameters),
    /// max |g - one device's| / max(max |one device's|, 1e-6) per parameter.
    #[arg(long, default_value_t = Tolerances::TRAIN_LLAMA.first_grad)]
    first_grad_tol: f64,
    /// --check: tolerance of every step's gradients (later steps are taken at parameters f32
    /// rounding moved apart), measured as for --first-grad-tol.
    #[arg(long, default_value_t = Tolerances::TRAIN_LLAMA.any_grad)]
    grad_tol: f64,
    /// --check: plant a failure in the last rank's report before comparing (the check must
    /// then exit 1).
    #[arg(long, value_enum, requires = "check")]
    plant: Option<Plant>,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Where the ranks train: `cpu`, `cuda` (rank r on GPU r % GPUs) or `cuda:N`; `--check`'s
    /// one-device reference always trains on the CPU.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    // First, so the thread tuning below is logged (a debug line when set, a warning when
    // refused); installing the subscriber starts no thread, so the tuning still runs alone.
    logging::init_logging();
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

/// Trains; `Ok(false)` when `--check` failed.
fn real_main(args: &Args) -> Result<bool, String> {
    let sizes = Sizes::tiny();
    let tol = Tolerances {
        loss: args.loss_tol,
        first_grad: args.first_grad_tol,
        any_grad: args.grad_tol,
    };
    tol.validate().map_err(|e| e.to_string())?;
    if args.ranks == 0 || args.tp == 0 || !args.ranks.is_multiple_of(args.tp) {
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
    if !args.batch.is_multiple_of(dp) || args.batch == 0 {
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
    let mut reports = LocalWorld::new(args.ranks)
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
        match reference.as_ref().and_then(|r| r.losses.get(step)) {
            Some(one) => println!("step {step:>3}: loss {loss:.6} (one device {one:.6})"),
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
    if let Some(plant) = args.plant {
        let rank = reports.len().checked_sub(1).ok_or("no rank reported")?;
        plant
            .apply(&mut reports[rank])
            .map_err(|e| format!("--plant: {e}"))?;
        println!("check: planted {plant:?} in rank {rank}'s report");
    }
    let verdict = llama::verdict(&reference, &reports, &tol);
    for (rank, failure) in &verdict.failures {
        match rank {
            Some(r) => println!("check FAILED: rank {r}: {failure}"),
            None => println!("check FAILED: {failure}"),
        }
    }
    let (loss, first, any) = verdict.worst();
    let show = |d: Option<f64>| d.map_or("none compared".to_string(), |d| format!("{d:.3e}"));
    let with_grad = reference.grads.last().map_or(0, |g| g.len());
    println!(
        "check vs one device over {} steps: max relative loss difference {} (tolerance {:.1e}); gradients of the {with_grad} parameter(s) one device trains: max relative \
         difference {} at the first step (tolerance {:.1e}), {} over all steps (tolerance \
         {:.1e}): {}",
        run.steps,
        show(loss),
        tol.loss,
        show(first),
        tol.first_grad,
        show(any),
        tol.any_grad,
        if verdict.passed() {
            "passed".to_string()
        } else {
            format!("FAILED ({} failure(s))", verdict.failures.len())
        }
    );
    Ok(verdict.passed())
}
