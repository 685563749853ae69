//! Context-parallel attention per layer: forward + backward time of one causal attention on a
//! sequence sharded over a `cp` mesh dim (load-balanced layout), and how much of it the ranks
//! spent waiting on communication (exposed), for each strategy, sequence length and cp size,
//! over a modeled link on `cp` (the local backend paces every transfer to it).
//!
//! ```text
//! cargo run --release --example cp_bench -- --json
//! ```
//!
//! Prints per case: `strategy`, `t`, `cp`, `attn_ms` (forward + backward, slowest rank, best
//! of `--reps`), `exposed_ms` (time the slowest rank blocked on the strategy's transfers),
//! `exposed_frac` (`exposed_ms / attn_ms`), the same two with no link model (`*_nolink`:
//! ranks waiting for a slower peer, which on a shared CPU is most of the waiting), `link_frac`
//! (`(exposed_ms - exposed_nolink_ms) / attn_ms`: what the modeled link itself adds, the
//! communication the overlap failed to hide) and `block_xfer_ms`, the modeled time of one
//! ring step (a K and a V block), to set against the compute of one block.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use candle_dtensor::comm::link::{link_hints, parse_link_spec};
use candle_dtensor::comm::{CommOptions, LocalWorld};
use candle_dtensor::dtensor::cp::{attention, layout_scope, CpVariant, SeqLayout, Strategy};
use candle_dtensor::dtensor::debug::take_comm_wait;
use candle_dtensor::dtensor::{distribute_tensor, DTensor, Placement};
use candle_dtensor::kernels::compare::nan_max;
use candle_dtensor::mesh::DeviceMesh;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Context-parallel attention: time and exposed communication per layer")]
struct Args {
    /// Global sequence lengths, comma separated (multiples of 2 x cp).
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 2048, 4096])]
    t: Vec<usize>,
    /// Context-parallel sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4])]
    cp: Vec<usize>,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Head dim.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// The modeled link of the cp dim (`alpha:bandwidth`, as `--link` of train_gpt).
    #[arg(long, default_value = "50us:1GBps")]
    link: String,
    /// Strategies: ring, allgather, alltoall (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = ["ring".to_string(), "allgather".to_string(), "alltoall".to_string()])]
    strategy: Vec<String>,
    /// Timed repetitions (best kept), after one warm-up.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    strategy: String,
    t: usize,
    cp: usize,
    attn_ms: f64,
    exposed_ms: f64,
    exposed_frac: f64,
    attn_nolink_ms: f64,
    exposed_nolink_ms: f64,
    link_frac: f64,
    block_xfer_ms: f64,
}

#[path = "common/logging.rs"]
mod logging;

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

fn strategy(name: &str) -> Result<Strategy, BoxErr> {
    Ok(match name {
        "ring" => Strategy::Exchange(CpVariant::Ring),
        "allgather" => Strategy::Exchange(CpVariant::AllGatherKv),
        "alltoall" => Strategy::AllToAll,
        other => return Err(format!("--strategy {other:?}: ring, allgather or alltoall").into()),
    })
}

fn main() -> Result<(), BoxErr> {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    let args = Args::parse();
    let link = parse_link_spec(&format!("cp={}", args.link)).map_err(|e| format!("--link: {e}"))?;
    let model = link[0].1;
    if !args.json {
        println!(
            "{:<10} {:>6} {:>3} {:>9} {:>10} {:>12} {:>9} {:>10} {:>9} {:>13}",
            "strategy",
            "t",
            "cp",
            "attn_ms",
            "exposed_ms",
            "exposed_frac",
            "nolink_ms",
            "nolink_exp",
            "link_frac",
            "block_xfer_ms"
        );
    }
    for name in &args.strategy {
        let strat = strategy(name)?;
        for &cp in &args.cp {
            for &t in &args.t {
                if t % (2 * cp) != 0 {
                    return Err(format!("--t {t} is not a multiple of 2 x cp = {}", 2 * cp).into());
                }
                let (h, d) = (args.heads, args.head_dim);
                let reps = args.reps.max(1);
                let measure = |with_link: bool| -> Result<(f64, f64), BoxErr> {
                    let mut options = CommOptions::default().with_timeout(Duration::from_secs(600));
                    if with_link {
                        for (k, v) in link_hints(&link) {
                            options = options.with_hint(k, v);
                        }
                    }
                    let per_rank = LocalWorld::new(cp).with_options(options).launch(|comm| {
                        let mesh = DeviceMesh::new(comm, &[("cp", cp)])?;
                        let _l = layout_scope(SeqLayout::LoadBalanced, cp);
                        let pl = [Placement::Shard(2)];
                        let mut dts = Vec::new();
                        for salt in 0..3u64 {
                            let x = Tensor::randn(0f32, 1.0, (1, h, t, d), &Device::Cpu)?;
                            let x = (x + salt as f64 * 0.01)?;
                            let xd = distribute_tensor(&x, &mesh, &pl)?;
                            let var = Var::from_tensor(xd.to_local())?;
                            dts.push(DTensor::from_local_with_shape(
                                var.as_tensor(),
                                &mesh,
                                &pl,
                                x.dims(),
                            )?);
                        }
                        let mut best = (f64::INFINITY, 0.0);
                        for rep in 0..=reps {
                            mesh.comm(0)?.barrier()?.wait()?;
                            let _ = take_comm_wait();
                            let t0 = Instant::now();
                            let o = attention(&dts[0], &dts[1], &dts[2], true, None, strat)?;
                            let _g = o.sum_all()?.backward()?;
                            let ms = t0.elapsed().as_secs_f64() * 1e3;
                            let exposed = take_comm_wait().as_secs_f64() * 1e3;
                            if rep > 0 && ms < best.0 {
                                best = (ms, exposed);
                            }
                        }
                        Ok::<_, BoxErr>(best)
                    })?;
                    Ok((
                        per_rank.iter().map(|r| r.0).fold(0.0, nan_max),
                        per_rank.iter().map(|r| r.1).fold(0.0, nan_max),
                    ))
                };
                let (attn_ms, exposed_ms) = measure(true)?;
                let (attn_nolink_ms, exposed_nolink_ms) = measure(false)?;
                let block = 2 * h * (t / cp) * d * 4;
                let block_xfer_ms = model.alpha_us / 1e3 + block as f64 / (model.gbps * 1e6);
                let row = Row {
                    strategy: name.clone(),
                    t,
                    cp,
                    attn_ms,
                    exposed_ms,
                    exposed_frac: exposed_ms / attn_ms,
                    attn_nolink_ms,
                    exposed_nolink_ms,
                    link_frac: (exposed_ms - exposed_nolink_ms) / attn_ms,
                    block_xfer_ms,
                };
                if args.json {
                    println!("{}", serde_json::to_string(&row)?);
                } else {
                    println!(
                        "{:<10} {:>6} {:>3} {:>9.1} {:>10.2} {:>12.3} {:>9.1} {:>10.2} {:>9.3} \
                         {:>13.3}",
                        row.strategy,
                        t,
                        cp,
                        attn_ms,
                        exposed_ms,
                        row.exposed_frac,
                        attn_nolink_ms,
                        exposed_nolink_ms,
                        row.link_frac,
                        block_xfer_ms
                    );
                }
            }
        }
    }
    Ok(())
}
