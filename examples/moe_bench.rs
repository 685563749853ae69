//! Mixture-of-experts token dispatch + combine against the all_to_all floor of the same bytes,
//! over all_to_all_v and over RMA windows, measured side by side in one run.
//!
//! ```text
//! cargo run --release --example moe_bench -- --tokens 8192,65536 --json
//! ```
//!
//! Each of `--world` ranks (threads of the local backend, one mesh dim `ep`) routes `tokens`
//! tokens of `--dim` f32 to `top_k` of `--experts` experts (uniform pseudo-random choices; the
//! experts are torch.chunk-sharded over the ranks). One timed iteration is what the layer does
//! around its experts: the count exchange (one all_gather of the per-expert counts), the
//! expert-major permutation (index_select), the dispatch exchange, the reverse exchange and the
//! weighted scatter-add combine. The floor is two `all_to_all_single` of a buffer holding the
//! same rows (what the dispatch and the combine move, if routing were uniform and free).
//! `ratio` is floor time / dispatch + combine time (1 = as fast as the floor). Medians of
//! `--iters` iterations on rank 0, after a barrier each.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor::comm::LocalWorld;
use candle_dtensor::dtensor::functional::{
    exchange_gathered_rows, exchange_rows, ExchangePlan, Group, RmaExchange, Transport,
};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::parallel::moe::local::weighted_combine;
use candle_dtensor::parallel::moe::routing::owned_experts;
use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(about = "MoE dispatch + combine vs the all_to_all floor")]
struct Args {
    /// Ranks (threads), all on the `ep` mesh dim.
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// Tokens per rank, comma separated.
    #[arg(long, default_value = "8192,65536")]
    tokens: String,
    /// Model dim (f32 elements per token).
    #[arg(long, default_value_t = 256)]
    dim: usize,
    /// Experts.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Timed iterations (after two warm-up ones).
    #[arg(long, default_value_t = 7)]
    iters: usize,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Combine with the candle composition the fused kernel replaced (gate gather,
    /// broadcast_mul, zeros, index_add), to measure the two side by side.
    #[arg(long)]
    unfused_combine: bool,
    /// Permute the tokens into a send buffer (index_select), then exchange it, instead of the
    /// layer's fused dispatch (`exchange_gathered_rows`: rows read in place by the exchange).
    #[arg(long)]
    unfused_dispatch: bool,
}

#[derive(serde::Serialize)]
struct Row {
    transport: &'static str,
    world: usize,
    tokens_per_rank: usize,
    dim: usize,
    experts: usize,
    top_k: usize,
    /// Bytes rank 0 sends in the dispatch.
    dispatch_bytes: usize,
    floor_ms: f64,
    dispatch_combine_ms: f64,
    ratio: f64,
    /// `fused` (the layer's combine) or `candle` (`--unfused-combine`).
    combine: &'static str,
    /// `fused` (the layer's dispatch, permutation inside the exchange) or `permute`
    /// (`--unfused-dispatch`: index_select, then the exchange).
    dispatch: &'static str,
    /// Where the time goes (medians over the iterations, rank 0, ms): the count all_gather,
    /// the expert-major permutation (index_select), the dispatch exchange, the reverse
    /// exchange, and the weighted scatter-add combine (`parallel::moe::local::weighted_combine`).
    phase_ms: Phases,
}

/// Medians of each phase of one iteration (see [`Row::phase_ms`]).
#[derive(serde::Serialize, Clone, Copy)]
struct Phases {
    counts: f64,
    permute: f64,
    dispatch: f64,
    reverse: f64,
    combine: f64,
}

impl Phases {
    fn median_of(v: &[[f64; 5]]) -> Phases {
        let m = |i: usize| median(v.iter().map(|p| p[i]).collect());
        Phases {
            counts: m(0),
            permute: m(1),
            dispatch: m(2),
            reverse: m(3),
            combine: m(4),
        }
    }
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The expert of assignment `i` of rank `r` (a fixed hash: uniform over the experts).
fn expert_of(r: usize, i: usize, experts: usize) -> usize {
    let h = (r as u64 * 0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    ((h ^ (h >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB) >> 33) as usize % experts
}

/// `(floor_ms, [a2a_v ms, rma ms], [their phases], dispatch bytes)` for `n` tokens per rank,
/// measured on this rank.
type RankResult = (f64, Vec<f64>, Vec<Phases>, usize);

fn bench_rank(mesh: &DeviceMesh, a: &Args, n: usize) -> Result<RankResult, BoxErr> {
    let g = Group::from_mesh(mesh, "ep")?;
    let (w, me, e_n, k, d) = (g.size(), g.rank(), a.experts, a.top_k, a.dim);
    let owner = |e: usize| {
        (0..w)
            .find(|&j| {
                let (c, f) = owned_experts(e_n, w, j);
                e >= f && e < f + c
            })
            .unwrap_or(0)
    };
    // Every rank's sends per destination, from the shared hash (the layer learns the same
    // matrix from its count exchange, which the loop below still runs and times).
    let rows: Vec<Vec<usize>> = (0..w)
        .map(|s| {
            let mut r = vec![0; w];
            for i in 0..n * k {
                r[owner(expert_of(s, i, e_n))] += 1;
            }
            r
        })
        .collect();
    let plan = ExchangePlan::new(rows, me)?;
    let back = plan.reversed();
    // This rank's assignments sorted expert-major: the send permutation and combine targets.
    let mut order: Vec<u32> = (0..(n * k) as u32).collect();
    order.sort_by_key(|&i| expert_of(me, i as usize, e_n));
    let counts: Vec<u32> = (0..e_n)
        .map(|e| (0..n * k).filter(|&i| expert_of(me, i, e_n) == e).count() as u32)
        .collect();
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (n, d), &dev)?;
    // The combine's row -> (token, slot) map is the send order itself (`token * k + slot`).
    let slots = Arc::new(order.clone());
    let token_rows = Arc::new(order.iter().map(|&i| i / k as u32).collect::<Vec<u32>>());
    let tokens = Tensor::from_vec(token_rows.to_vec(), n * k, &dev)?;
    let gates = Tensor::rand(0f32, 1.0, (n, k), &dev)?;
    let sel = Tensor::from_slice(order.as_slice(), n * k, &dev)?;
    let counts = Tensor::from_vec(counts, e_n, &dev)?;
    let floor_buf = Tensor::randn(0f32, 1.0, (n * k, d), &dev)?;
    let rma = Transport::Rma(Arc::new(RmaExchange::new(&g)?));
    let comm = g.comm();
    let mut floor = Vec::new();
    let mut moe = vec![Vec::new(), Vec::new()];
    let mut phases: Vec<Vec<[f64; 5]>> = vec![Vec::new(), Vec::new()];
    for it in 0..a.iters + 2 {
        comm.barrier()?.wait()?;
        let t0 = Instant::now();
        let y = comm.all_to_all_single(&floor_buf)?.wait()?;
        let _ = comm.all_to_all_single(&y)?.wait()?;
        if it >= 2 {
            floor.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        for (ti, transport) in [Transport::AllToAllV, rma.clone()].iter().enumerate() {
            comm.barrier()?.wait()?;
            let t0 = Instant::now();
            let mut marks = [0f64; 5];
            let mut last = t0;
            let mut mark = |i: usize| {
                let now = Instant::now();
                marks[i] = (now - last).as_secs_f64() * 1e3;
                last = now;
            };
            let _table = comm.all_gather_single(&counts)?.wait()?;
            mark(0);
            let recv = if a.unfused_dispatch {
                let send = x.index_select(&tokens, 0)?;
                mark(1);
                exchange_rows(&send, &g, transport, &plan, None)?
            } else {
                // Permutation fused into the exchange: its phase is part of `dispatch`.
                mark(1);
                exchange_gathered_rows(&x, &token_rows, &g, transport, &plan, None)?
            };
            mark(2);
            let ret = exchange_rows(&recv, &g, transport, &back, None)?;
            mark(3);
            let out = if a.unfused_combine {
                let g = gates.flatten_all()?.index_select(&sel, 0)?;
                Tensor::zeros((n, d), DType::F32, &dev)?.index_add(
                    &tokens,
                    &ret.broadcast_mul(&g.unsqueeze(1)?)?,
                    0,
                )?
            } else {
                weighted_combine(&ret, &gates, &slots, n)?
            };
            drop(out);
            mark(4);
            if it >= 2 {
                moe[ti].push(t0.elapsed().as_secs_f64() * 1e3);
                phases[ti].push(marks);
            }
        }
    }
    Ok((
        median(floor),
        moe.into_iter().map(median).collect(),
        phases.iter().map(|p| Phases::median_of(p)).collect(),
        plan.send_rows() * d * 4,
    ))
}

#[path = "common/logging.rs"]
mod logging;

fn main() -> Result<(), BoxErr> {
    logging::init_logging();
    let a = Args::parse();
    let tokens: Vec<usize> = a
        .tokens
        .split(',')
        .map(|t| t.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--tokens: {e}"))?;
    if a.top_k == 0 || a.top_k > a.experts || a.world > a.experts {
        return Err(format!(
            "need 0 < top_k ({}) <= experts ({}) and world ({}) <= experts",
            a.top_k, a.experts, a.world
        )
        .into());
    }
    candle_dtensor::init_gemm_threads(a.world, a.world);
    for &n in &tokens {
        if (n * a.top_k) % a.world != 0 {
            return Err(format!("tokens x top_k must be divisible by the world ({n})").into());
        }
        let args = a.clone();
        let out = LocalWorld::new(a.world)
            .with_timeout(Duration::from_secs(600))
            .launch(move |comm| -> Result<_, BoxErr> {
                let mesh = DeviceMesh::new(comm, &[("ep", args.world)])?;
                bench_rank(&mesh, &args, n)
            })?;
        let (floor, moe, phases, bytes) = out.into_iter().next().ok_or("no rank")?;
        for ((transport, ms), ph) in ["all_to_all_v", "rma"].into_iter().zip(moe).zip(phases) {
            let row = Row {
                transport,
                world: a.world,
                tokens_per_rank: n,
                dim: a.dim,
                experts: a.experts,
                top_k: a.top_k,
                dispatch_bytes: bytes,
                floor_ms: floor,
                dispatch_combine_ms: ms,
                ratio: floor / ms,
                combine: if a.unfused_combine { "candle" } else { "fused" },
                dispatch: if a.unfused_dispatch {
                    "permute"
                } else {
                    "fused"
                },
                phase_ms: ph,
            };
            if a.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{transport:>12} tokens/rank {n:>8}: floor {floor:8.2} ms, dispatch+combine \
                     {ms:8.2} ms, ratio {:.2} (counts {:.2}, permute {:.2}, dispatch {:.2}, \
                     reverse {:.2}, {} combine {:.2} ms)",
                    floor / ms,
                    ph.counts,
                    ph.permute,
                    ph.dispatch,
                    ph.reverse,
                    row.combine,
                    ph.combine
                );
            }
        }
    }
    Ok(())
}
