//! Pipeline schedules on a machine of exactly balanced stages: each schedule's bubble as the
//! executor measures it (ranks as threads, activations moving over the local backend's
//! send/recv, every action a modelled time of `--unit-ms` units: F = 1, B = 2, zero-bubble's
//! I = W = 1) beside the unit-time simulator's and the textbook formula.
//!
//! ```text
//! cargo run --release --example pipeline_bench -- --json
//! ```
//!
//! Prints `schedule`, `p`, `m`, `v`, `formula`, `simulated`, `measured`, `rel_diff`
//! (measured against simulated) and `wall_ms` per case. The measured bubble is the idle share
//! of every rank's wall time from a common start; what it adds to the simulated one is the
//! executor's cost (transfers, wake-ups, sleep overshoot).
#![allow(clippy::print_stdout)]

use std::time::Duration;

use candle_dtensor::comm::LocalWorld;
use candle_dtensor::parallel::pipeline::{
    run_schedule, sim, CostModel, PipeComms, PipelineReport, Schedule, ScheduleKind, TimedStage,
};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Pipeline schedules: measured vs simulated bubble")]
struct Args {
    /// Pipeline sizes (ranks), comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4])]
    p: Vec<usize>,
    /// Micro-batches as multiples of p, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    m_per_p: Vec<usize>,
    /// Milliseconds of one modelled time unit (a forward of a rank's share of the model).
    #[arg(long, default_value_t = 4.0)]
    unit_ms: f64,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    schedule: String,
    p: usize,
    m: usize,
    v: usize,
    formula: f64,
    simulated: f64,
    measured: f64,
    rel_diff: f64,
    wall_ms: f64,
}

#[path = "common/logging.rs"]
mod logging;

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxErr> {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    let args = Args::parse();
    let unit = Duration::from_secs_f64(args.unit_ms / 1e3);
    if !args.json {
        println!(
            "{:<22} {:>2} {:>3} {:>2} {:>8} {:>9} {:>8} {:>8} {:>8}",
            "schedule", "p", "m", "v", "formula", "simulated", "measured", "rel_diff", "wall_ms"
        );
    }
    for &p in &args.p {
        for &k in &args.m_per_p {
            let m = p * k;
            let schedules = [
                Schedule::gpipe(p, m)?,
                Schedule::one_f_one_b(p, m)?,
                Schedule::interleaved(p, m, 2)?,
                Schedule::zero_bubble_h1(p, m)?,
                Schedule::zero_bubble_v(p, m)?,
            ];
            for schedule in schedules {
                let v = schedule.chunks();
                let formula = match schedule.kind() {
                    ScheduleKind::Interleaved1F1B => sim::bubble_interleaved(p, m, v),
                    ScheduleKind::ZeroBubbleH1 => sim::bubble_zb_h1(p, m),
                    ScheduleKind::ZeroBubbleV => sim::bubble_zb_v(p, m),
                    _ => sim::bubble_gpipe(p, m),
                };
                let simulated = schedule.bubble_fraction_with(&CostModel::default())?;
                let reports = LocalWorld::new(p)
                    .with_timeout(Duration::from_secs(120))
                    .launch(|comm| {
                        let comms = PipeComms::for_schedule(&comm, &schedule)?;
                        let mut stage = TimedStage::new(CostModel::default(), unit, v)?;
                        Ok::<_, BoxErr>(run_schedule(&mut stage, &schedule, &comms)?)
                    })?;
                let measured = PipelineReport::combined_bubble(&reports);
                let wall_ms = reports
                    .iter()
                    .map(|r| r.wall.as_secs_f64() * 1e3)
                    .fold(0.0, candle_dtensor::kernels::compare::nan_max);
                let row = Row {
                    schedule: schedule.kind().to_string(),
                    p,
                    m,
                    v,
                    formula,
                    simulated,
                    measured,
                    rel_diff: (measured - simulated) / simulated,
                    wall_ms,
                };
                if args.json {
                    println!("{}", serde_json::to_string(&row)?);
                } else {
                    println!(
                        "{:<22} {:>2} {:>3} {:>2} {:>8.4} {:>9.4} {:>8.4} {:>+8.3} {:>8.1}",
                        row.schedule, p, m, v, formula, simulated, measured, row.rel_diff, wall_ms
                    );
                }
            }
        }
    }
    Ok(())
}
