//! `DTensor::redistribute` as a user calls it, against the copy floor measured in the same run.
//!
//! ```text
//! cargo run --release --example redistribute_bench -- --json
//! cargo run --release --example redistribute_bench -- --sizes 4096 --mesh 4
//! ```
//!
//! Cases (f32, `n x n` global tensors, `--sizes` default 1024,4096): on a 1-D mesh of 4,
//! `S(0)->R`, `R->S(0)`, `P->R`, `P->S(0)`, `S(0)->S(1)`; on a 2x2 mesh the same five on each
//! mesh dim (the other dim `R`), plus `[S(0),S(1)]->[R,R]` and `[P,P]->[R,S(0)]`. Each iteration
//! is one `redistribute` call on every rank between barriers, including dropping its result
//! (what a user's loop pays); the slowest rank decides, the median over iterations is reported.
//!
//! `floor_ms` is the time the bytes the compiler's plan must move between ranks (the nccl-tests
//! bus factors of each step, summed over the ranks) take at the aggregate memcpy rate of the
//! mesh's threads copying buffers of the tensor's size, measured in the same run; `efficiency = floor_ms / median_ms`, `null` where
//! nothing must move (`R->S(0)` is a local chunk). `--json` prints one object per case with
//! `case`, `mesh`, `n`, `median_ms`, `floor_ms`, `efficiency`, `plan`, `wire_bytes` and
//! `copy_rate_gbps`.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use candle_dtensor::comm::{LocalWorld, ReduceOp};
use candle_dtensor::dtensor::{distribute_tensor, DTensor, MeshCtx, Placement};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::strategies::{cost::wire_bytes, format_placements, plan_redistribute};
use clap::Parser;

#[path = "common/copy_floor.rs"]
mod copy_floor;
use copy_floor::{copy_rate, gather_rate, median};

#[derive(Parser, Debug)]
#[command(about = "DTensor::redistribute against the copy floor")]
struct Args {
    /// Square sizes n (the global tensor is n x n f32), comma separated.
    #[arg(long, default_value = "1024,4096")]
    sizes: String,
    /// Meshes, comma separated: `4` (1-D) and/or `2x2`.
    #[arg(long, default_value = "4,2x2")]
    mesh: String,
    /// Timed iterations per case at sizes of 16 MiB and more (smaller sizes run 3x as many).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Only the cases whose name contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// One JSON object per case instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    case: String,
    mesh: String,
    n: usize,
    median_ms: f64,
    floor_ms: f64,
    efficiency: Option<f64>,
    plan: String,
    /// Bytes the plan moves between ranks, summed over the ranks.
    wire_bytes: f64,
    copy_rate_gbps: f64,
}

/// A case: source and target placements (one per mesh dim).
struct Case {
    src: Vec<Placement>,
    dst: Vec<Placement>,
}

impl Case {
    fn name(&self) -> String {
        let f = |p: &[Placement]| {
            if p.len() == 1 {
                p[0].to_string()
            } else {
                format!("[{}]", format_placements(p))
            }
        };
        // `P` is `P(sum)`, the only reduction the cases use (the issue's table writes it so).
        format!("{}->{}", f(&self.src), f(&self.dst)).replace("P(sum)", "P")
    }
}

fn cases(dims: usize) -> Vec<Case> {
    use Placement::{Partial, Replicate as R, Shard};
    let p = Partial(ReduceOp::Sum);
    let one = [
        (Shard(0), R),
        (R, Shard(0)),
        (p, R),
        (p, Shard(0)),
        (Shard(0), Shard(1)),
    ];
    let mut out = Vec::new();
    for d in 0..dims {
        for &(a, b) in &one {
            let mut src = vec![R; dims];
            let mut dst = vec![R; dims];
            src[d] = a;
            dst[d] = b;
            out.push(Case { src, dst });
        }
    }
    if dims == 2 {
        out.push(Case {
            src: vec![Shard(0), Shard(1)],
            dst: vec![R, R],
        });
        out.push(Case {
            src: vec![p, p],
            dst: vec![R, Shard(0)],
        });
    }
    out
}

/// The source DTensor of a case: the full `n x n` tensor distributed to `src`; a Partial
/// dim holds distinct summands (the full value times `1 + coordinate` on each rank).
fn source(full: &Tensor, mesh: &DeviceMesh, src: &[Placement]) -> candle_core::Result<DTensor> {
    if src.iter().all(|p| !p.is_partial()) {
        return Ok(distribute_tensor(full, mesh, src)?);
    }
    // Partial on some dims: every rank's local piece is its piece of the non-partial dims,
    // scaled so the summands differ.
    let plain: Vec<Placement> = src
        .iter()
        .map(|p| {
            if p.is_partial() {
                Placement::Replicate
            } else {
                *p
            }
        })
        .collect();
    let base = distribute_tensor(full, mesh, &plain)?;
    let local = base.to_local().affine(1.0 + mesh.rank() as f64, 0.0)?;
    Ok(DTensor::from_local_with_shape(
        &local,
        mesh,
        src,
        base.shape(),
    )?)
}

fn run_case(
    shape: &[(&'static str, usize)],
    n: usize,
    case: &Case,
    iters: usize,
) -> Result<(f64, f64, String), Box<dyn std::error::Error>> {
    let world: usize = shape.iter().map(|(_, s)| s).product();
    let out = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(120))
        .launch(|comm| -> candle_core::Result<(Vec<f64>, f64, String)> {
            let mesh = DeviceMesh::new(comm, shape).map_err(candle_core::Error::wrap)?;
            let full = Tensor::arange(0f32, (n * n) as f32, &Device::Cpu)?
                .affine(1.0 / (n * n) as f64, 0.0)?
                .reshape((n, n))?;
            let x = source(&full, &mesh, &case.src)?;
            drop(full);
            let ctx = MeshCtx::of(&mesh)?;
            let plan = plan_redistribute(x.spec(), &case.dst, ctx.topology())
                .map_err(candle_core::Error::wrap)?;
            // Bytes per rank of every communication step, times the ranks.
            let wire: f64 = plan
                .communication_steps()
                .map(|s| {
                    let group: usize = s.mesh_dims.iter().map(|&m| shape[m].1).product();
                    wire_bytes(s.kind, s.bytes, group) * world as f64
                })
                .sum();
            for _ in 0..2 {
                drop(x.redistribute(&case.dst)?);
            }
            let root = mesh.root_comm();
            let mut times = Vec::with_capacity(iters);
            for _ in 0..iters {
                root.barrier()?.wait()?;
                let t0 = Instant::now();
                let y = x.redistribute(&case.dst)?;
                drop(y);
                times.push(t0.elapsed().as_secs_f64());
            }
            let t = Tensor::new(times.as_slice(), &Device::Cpu)?;
            let t = root.all_reduce(&t, ReduceOp::Max)?.wait()?;
            Ok((t.to_vec1::<f64>()?, wire, plan.to_string()))
        })?;
    let (times, wire, plan) = out.into_iter().next().ok_or("no rank reported")?;
    Ok((median(times), wire, plan))
}

#[path = "common/logging.rs"]
mod logging;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    // Before any thread starts (LocalWorld::launch also runs it, but threads that exited
    // before, like the copy-floor threads, leave arenas that new threads would take over).
    candle_dtensor::init_cpu_allocator();
    let args = Args::parse();
    let sizes = args
        .sizes
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--sizes: {e}"))?;
    let meshes: Vec<(String, Vec<(&'static str, usize)>)> = args
        .mesh
        .split(',')
        .map(|m| match m.trim() {
            "4" => Ok(("4".to_string(), vec![("x", 4)])),
            "2x2" => Ok(("2x2".to_string(), vec![("x", 2), ("y", 2)])),
            other => Err(format!("--mesh: {other:?} is not 4 or 2x2")),
        })
        .collect::<Result<_, _>>()?;
    // The floor of each size is the copy rate at that size (small tensors copy from cache).
    let rates: Vec<f64> = sizes.iter().map(|n| copy_rate(4, n * n * 4)).collect();
    let mut rows = Vec::new();
    if !args.json {
        for (n, rate) in sizes.iter().zip(&rates) {
            let g = gather_rate(4, n * n * 4);
            println!(
                "aggregate memcpy rate of 4 threads, {n}^2 f32 each: {:.2} GB/s; in all_gather's \
                 pattern (shared pieces): {:.2} GB/s ({:.2} of it)",
                rate / 1e9,
                g / 1e9,
                g / rate.max(1e-9)
            );
        }
        println!(
            "{:<22} {:>4} {:>5} {:>10} {:>9} {:>10}  plan",
            "case", "mesh", "n", "median_ms", "floor_ms", "efficiency"
        );
    }
    for (mesh_name, shape) in &meshes {
        for (&n, &rate) in sizes.iter().zip(&rates) {
            for case in cases(shape.len()) {
                let name = case.name();
                if args
                    .filter
                    .as_ref()
                    .is_some_and(|f| !name.contains(f.as_str()))
                {
                    continue;
                }
                let iters = if n * n * 4 >= 16 << 20 {
                    args.iters.max(1)
                } else {
                    3 * args.iters.max(1)
                };
                let (t, wire, plan) = run_case(shape, n, &case, iters)?;
                let floor = if wire > 0.0 { wire / rate } else { 0.0 };
                rows.push(Row {
                    case: name,
                    mesh: mesh_name.clone(),
                    n,
                    median_ms: t * 1e3,
                    floor_ms: floor * 1e3,
                    efficiency: (wire > 0.0 && t > 0.0).then(|| floor / t),
                    plan,
                    wire_bytes: wire,
                    copy_rate_gbps: rate / 1e9,
                });
                if !args.json {
                    let r = rows.last().ok_or("no row")?;
                    println!(
                        "{:<22} {:>4} {:>5} {:>10.2} {:>9.2} {:>10}  {}",
                        r.case,
                        r.mesh,
                        r.n,
                        r.median_ms,
                        r.floor_ms,
                        r.efficiency.map_or("-".to_string(), |e| format!("{e:.2}")),
                        r.plan
                    );
                }
            }
        }
    }
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    }
    Ok(())
}
