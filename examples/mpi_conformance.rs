//! The backend-neutral conformance suite on the `mpi` backend, one rank per process.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_conformance
//! mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/mpi_conformance
//! ```
//!
//! Runs `candle_dtensor_comm::conformance` on a world communicator (`new_comm("mpi", ..)`),
//! then on communicators split from it: the two halves of the world at once (two groups
//! running the suite side by side on disjoint communicators) and the whole world in reverse
//! rank order. Rank 0 prints one summary line; every rank that saw a case fail prints why;
//! the exit status is non-zero on every rank if anything failed anywhere.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use candle_dtensor::comm::conformance::{cases, run, ConformanceError, Report, Selection};
use candle_dtensor::comm::{new_comm, Comm, CommOptions, ReduceOp};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "The comm conformance suite on the mpi backend (run under mpirun)")]
struct Args {
    /// Run only these cases or areas (e.g. `collectives`, `split::nested_splits`); repeatable.
    #[arg(long)]
    only: Vec<String>,
    /// Skip these cases or areas; repeatable.
    #[arg(long)]
    skip: Vec<String>,
    /// Sweep every size class for every (dtype, op) pair.
    #[arg(long)]
    full: bool,
    /// Op timeout of the communicators, seconds.
    #[arg(long, default_value_t = 30)]
    timeout_s: u64,
    /// Bootstrap timeout (new_comm, split), milliseconds; the split fault case waits this long.
    #[arg(long, default_value_t = 2000)]
    bootstrap_ms: u64,
    /// Op timeout of the fault cases, milliseconds.
    #[arg(long, default_value_t = 400)]
    fault_timeout_ms: u64,
    /// Only the world communicator (no split phases).
    #[arg(long)]
    no_splits: bool,
    /// List the cases and exit.
    #[arg(long)]
    list: bool,
}

/// The outcome of one phase on this rank: (phase, passed, skipped, failed, this rank's errors).
struct Phase {
    name: String,
    report: Option<Report>,
    errors: Vec<String>,
}

fn run_phase(name: String, comm: &Comm, sel: &Selection) -> Phase {
    match run(comm, sel) {
        Ok(report) => Phase {
            name,
            report: Some(report),
            errors: vec![],
        },
        Err(ConformanceError::Failed { report, .. }) => {
            let errors = report
                .failures()
                .map(|c| match &c.outcome {
                    candle_dtensor::comm::conformance::Outcome::Failed {
                        detail: Some(d), ..
                    } => d.clone(),
                    other => format!("case {} failed elsewhere: {other:?}", c.name),
                })
                .collect();
            Phase {
                name,
                report: Some(*report),
                errors,
            }
        }
        Err(e) => Phase {
            name,
            report: None,
            errors: vec![e.to_string()],
        },
    }
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    let args = Args::parse();
    if args.list {
        for c in cases() {
            println!(
                "{} (min {} ranks, needs {:?})",
                c.name, c.min_ranks, c.needs
            );
        }
        return;
    }
    match real_main(&args) {
        Ok(0) => {}
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("mpi_conformance: error: {e}");
            std::process::exit(2);
        }
    }
}

/// `new_comm("mpi", .., "world")` again gives an independent communicator: ops issued on the
/// two in opposite orders on different ranks both complete, with the right values.
fn second_world(world: &Comm, options: &CommOptions) -> Result<(), Box<dyn std::error::Error>> {
    let other = new_comm("mpi", &Device::Cpu, "world", options.clone())?;
    let (rank, n) = (world.rank(), world.size());
    if (other.rank(), other.size()) != (rank, n) {
        return Err(format!("second world is rank {} of {}", other.rank(), other.size()).into());
    }
    let x = Tensor::new(&[rank as f32 + 1.0], &Device::Cpu)?;
    let (a, b) = if rank % 2 == 0 {
        let a = world.all_reduce(&x, ReduceOp::Sum)?;
        (a, other.all_reduce(&x, ReduceOp::Max)?)
    } else {
        let b = other.all_reduce(&x, ReduceOp::Max)?;
        (world.all_reduce(&x, ReduceOp::Sum)?, b)
    };
    let (sum, max) = (
        a.wait()?.to_vec1::<f32>()?[0],
        b.wait()?.to_vec1::<f32>()?[0],
    );
    let want = ((n * (n + 1) / 2) as f32, n as f32);
    if (sum, max) != want {
        return Err(format!("got (sum, max) = {:?}, expected {want:?}", (sum, max)).into());
    }
    Ok(())
}

fn real_main(args: &Args) -> Result<i32, Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let options = CommOptions::default()
        .with_timeout(Duration::from_secs(args.timeout_s))
        .with_bootstrap_timeout(Duration::from_millis(args.bootstrap_ms));
    let world = new_comm("mpi", &Device::Cpu, "world", options.clone())?;
    let (rank, n) = (world.rank(), world.size());
    let only: Vec<&str> = args.only.iter().map(String::as_str).collect();
    let skip: Vec<&str> = args.skip.iter().map(String::as_str).collect();
    let mut sel = Selection::only(&only)
        .excluding(&skip)
        .with_fault_timeout(Duration::from_millis(args.fault_timeout_ms));
    sel.full_sweep |= args.full;

    let mut phases = vec![run_phase("world".into(), &world, &sel)];
    let second_ok = match second_world(&world, &options) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("mpi_conformance: rank {rank}, second world: {e}");
            false
        }
    };
    if !args.no_splits && n > 1 {
        // The two halves side by side: independent communicators progressing at once.
        let half_ranks: Vec<usize> = if rank < n / 2 {
            (0..n / 2).collect()
        } else {
            (n / 2..n).collect()
        };
        let half = world
            .split(&half_ranks, "half")?
            .ok_or("no half communicator")?;
        let which = if rank < n / 2 { 0 } else { 1 };
        phases.push(run_phase(
            format!("half {which} ({} ranks)", half.size()),
            &half,
            &sel,
        ));
        world.barrier()?.wait()?;
        let reversed: Vec<usize> = (0..n).rev().collect();
        let rev = world
            .split(&reversed, "reversed")?
            .ok_or("no reversed communicator")?;
        phases.push(run_phase("reversed".into(), &rev, &sel));
    }

    // Everyone learns every phase's counts (the halves differ) and whether anything failed.
    let mut line = Vec::new();
    let mut any_failed = false;
    for p in &phases {
        let (pass, skipped, failed) = p
            .report
            .as_ref()
            .map_or((0, 0, 1), |r| (r.passed(), r.skipped(), r.failed()));
        let mine = Tensor::new(
            &[
                pass as u32,
                skipped as u32,
                failed as u32,
                u32::from(!p.errors.is_empty()),
            ],
            &Device::Cpu,
        )?;
        let all = world.all_gather_single(&mine)?.wait()?.to_vec1::<u32>()?;
        let failed_ranks: Vec<usize> = (0..n).filter(|r| all[4 * r + 3] != 0).collect();
        any_failed |= !failed_ranks.is_empty();
        // Report each distinct communicator once: the first rank of each half speaks for it.
        let speakers: Vec<usize> = if p.name.starts_with("half") {
            vec![0, n / 2]
        } else {
            vec![0]
        };
        for s in speakers {
            let tag = if p.name.starts_with("half") {
                format!("half {}", usize::from(s != 0))
            } else {
                p.name.clone()
            };
            line.push(format!(
                "{tag}: {} passed, {} skipped, {} failed",
                all[4 * s],
                all[4 * s + 1],
                all[4 * s + 2]
            ));
        }
        for e in &p.errors {
            eprintln!("mpi_conformance: rank {rank}, {}: {e}", p.name);
        }
    }
    let flag = Tensor::new(&[u32::from(!second_ok)], &Device::Cpu)?;
    let second_failed = world
        .all_reduce(&flag, ReduceOp::Max)?
        .wait()?
        .to_vec1::<u32>()?[0]
        != 0;
    any_failed |= second_failed;
    line.push(format!(
        "second world comm: {}",
        if second_failed {
            "FAILED"
        } else {
            "independent"
        }
    ));
    if rank == 0 {
        let info = candle_dtensor::comm::mpi::info();
        println!(
            "mpi_conformance: {n} ranks ({}, {}): {}; {} in {:.1} s",
            info.as_ref().map_or("MPI", |i| i.library.as_str()),
            info.as_ref().map_or("?", |i| i.thread_level),
            line.join("; "),
            if any_failed { "FAILED" } else { "ok" },
            t0.elapsed().as_secs_f64()
        );
    }
    // A last collective so no rank exits (and finalizes) while a peer still reports.
    let flag = Tensor::new(&[u32::from(any_failed)], &Device::Cpu)?;
    let any = world
        .all_reduce(&flag, ReduceOp::Max)?
        .wait()?
        .to_vec1::<u32>()?[0];
    Ok(if any != 0 { 1 } else { 0 })
}
