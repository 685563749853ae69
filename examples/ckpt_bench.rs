//! Checkpoint save / load throughput against the machine's sequential disk rate, measured in
//! the same run.
//!
//! ```text
//! cargo run --release --example ckpt_bench                       # small preset, FSDP dp=4
//! cargo run --release --example ckpt_bench -- --mesh dp=2,tp=2 --reshard-to tp=1 --json
//! ```
//!
//! Every repetition: all ranks save a checkpoint (parameters + AdamW moments) and time it
//! from a barrier to the end of `save` (which returns after the manifest is durable); rank 0
//! then writes and fsyncs one file of the same total size sequentially and reads it back (the
//! baseline); then all ranks load the checkpoint into the same layout. With `--reshard-to` a
//! second world of another mesh loads every saved checkpoint (resharding). Reads (baseline and
//! loads alike) may be served from the page cache: the files were just written and this tool
//! cannot drop caches, so read ratios compare cached with cached.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use candle_dtensor::comm::{LocalWorld, ReduceOp};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::models::{Gpt, GptConfig};
use candle_dtensor::parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor::parallel::TpPlan;
use candle_dtensor::strategies::MeshTopology;
use candle_dtensor::train::checkpoint::{self, Which};
use candle_dtensor::train::optim::AdamW;
use candle_nn::{Optimizer, ParamsAdamW};
use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(about = "Distributed checkpoint save/load throughput vs. sequential disk I/O")]
struct Args {
    /// Mesh of the saving world, e.g. `dp=4`, `dp=2,tp=2` (FSDP over dp when present).
    #[arg(long, default_value = "dp=4")]
    mesh: String,
    /// Also load every checkpoint on this mesh (resharding), e.g. `tp=1` or `dp=2,tp=2`.
    #[arg(long)]
    reshard_to: Option<String>,
    /// Model preset: tiny or small.
    #[arg(long, default_value = "small")]
    preset: String,
    /// Repetitions (medians are reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Directory to write into (default: a fresh directory under the system temp dir,
    /// removed at the end).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// `--mesh` / `--reshard-to`: `NAME=SIZE,...` as the sharding compiler parses meshes, over the
/// dims this bench builds (`dp`, `tp`).
fn parse_mesh(s: &str) -> Result<Vec<(String, usize)>, String> {
    let topo = MeshTopology::parse(s).map_err(|e| e.to_string())?;
    let dims: Vec<(String, usize)> = (0..topo.ndim())
        .map(|d| (topo.group_name(&[d]), topo.dim_size(d)))
        .collect();
    match dims.iter().find(|(name, _)| name != "dp" && name != "tp") {
        Some((name, _)) => Err(format!("unknown mesh dim {name:?}; use dp and tp")),
        None => Ok(dims),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Builds the model (FSDP over `dp` if the mesh has it) and AdamW with non-zero moments.
fn build(
    mesh: &DeviceMesh,
    gpt: &GptConfig,
) -> Result<(Gpt, candle_dtensor::parallel::ParamStore, AdamW), BoxErr> {
    let fsdp = match mesh.dim_index("dp") {
        Ok(d) => Some(Fsdp::new(mesh, FsdpConfig::new(d, GradReduce::Sum))?),
        Err(_) => None,
    };
    let (model, store) = Gpt::build(gpt, mesh, &TpPlan::gpt(false), 0, DType::F32, fsdp.as_ref())?;
    let mut opt = AdamW::new(store.vars(), ParamsAdamW::default())?;
    // Moments equal to the parameters: realistic bytes, no training needed.
    for v in store.vars() {
        let t = v.as_tensor().copy()?;
        opt.set_moments(&v, &t, &t.sqr()?)?;
    }
    Ok((model, store, opt))
}

fn barrier(mesh: &DeviceMesh) -> Result<(), BoxErr> {
    mesh.root_comm().barrier()?.wait()?;
    Ok(())
}

fn sum_all(mesh: &DeviceMesh, x: u64) -> Result<u64, BoxErr> {
    let t = Tensor::new(&[x as f64], &candle_core::Device::Cpu)?;
    let s = mesh.root_comm().all_reduce(&t, ReduceOp::Sum)?.wait()?;
    Ok(s.to_vec1::<f64>()?[0] as u64)
}

/// Writes `bytes` to a fresh file in 8 MiB blocks and fsyncs it; then reads it back.
/// Returns (write seconds, read seconds).
fn disk_baseline(dir: &Path, bytes: u64) -> std::io::Result<(f64, f64)> {
    let path = dir.join("baseline.bin");
    let block: Vec<u8> = (0..8usize << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let t0 = Instant::now();
    {
        let mut f = std::fs::File::create(&path)?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])?;
            left -= n as u64;
        }
        f.sync_all()?;
    }
    std::fs::File::open(dir)?.sync_all()?;
    let write = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let mut buf = vec![0u8; block.len()];
    let mut f = std::fs::File::open(&path)?;
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let read = t0.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    if total != bytes {
        return Err(std::io::Error::other(format!(
            "read back {total} of {bytes} bytes"
        )));
    }
    Ok((write, read))
}

/// What rank 0 of the saving world measured.
#[derive(Debug, Default, Clone)]
struct Measured {
    bytes: u64,
    save_s: Vec<f64>,
    load_s: Vec<f64>,
    load_read: u64,
    disk_write_s: Vec<f64>,
    disk_read_s: Vec<f64>,
}

fn run_save_world(
    dims: &[(String, usize)],
    gpt: &GptConfig,
    dir: &Path,
    reps: usize,
) -> Result<Measured, String> {
    let world: usize = dims.iter().map(|d| d.1).product();
    let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let out = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(600))
        .launch(|comm| -> Result<Measured, BoxErr> {
            let mesh = DeviceMesh::new(comm, &d)?;
            let (_model, store, mut opt) = build(&mesh, gpt)?;
            let rank0 = mesh.rank() == 0;
            let mut m = Measured::default();
            for rep in 0..reps {
                barrier(&mesh)?;
                let t0 = Instant::now();
                let info =
                    checkpoint::save(dir, rep, &store, Some(&opt), &serde_json::Value::Null)?;
                m.save_s.push(t0.elapsed().as_secs_f64());
                m.bytes = sum_all(&mesh, info.bytes)?;
                if rank0 {
                    let (w, r) = disk_baseline(dir, m.bytes)?;
                    m.disk_write_s.push(w);
                    m.disk_read_s.push(r);
                }
                barrier(&mesh)?;
                let t0 = Instant::now();
                let li = checkpoint::load(dir, Which::Step(rep), &store, Some(&mut opt))?;
                m.load_s.push(t0.elapsed().as_secs_f64());
                m.load_read = sum_all(&mesh, li.bytes_read)?;
            }
            Ok(m)
        })
        .map_err(|e| e.to_string())?;
    out.into_iter()
        .next()
        .ok_or_else(|| "no rank reported".into())
}

fn run_reshard_world(
    dims: &[(String, usize)],
    gpt: &GptConfig,
    dir: &Path,
    reps: usize,
) -> Result<(Vec<f64>, u64), String> {
    let world: usize = dims.iter().map(|d| d.1).product();
    let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let out = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(600))
        .launch(|comm| -> Result<(Vec<f64>, u64), BoxErr> {
            let mesh = DeviceMesh::new(comm, &d)?;
            let (_model, store, mut opt) = build(&mesh, gpt)?;
            let mut times = Vec::new();
            let mut read = 0;
            for rep in 0..reps {
                barrier(&mesh)?;
                let t0 = Instant::now();
                let li = checkpoint::load(dir, Which::Step(rep), &store, Some(&mut opt))?;
                times.push(t0.elapsed().as_secs_f64());
                read = sum_all(&mesh, li.bytes_read)?;
            }
            Ok((times, read))
        })
        .map_err(|e| e.to_string())?;
    out.into_iter()
        .next()
        .ok_or_else(|| "no rank reported".into())
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    let args = Args::parse();
    if let Err(e) = real_main(&args) {
        eprintln!("ckpt_bench: error: {e}");
        std::process::exit(2);
    }
}

fn real_main(args: &Args) -> Result<(), String> {
    let dims = parse_mesh(&args.mesh)?;
    let reshard = args.reshard_to.as_deref().map(parse_mesh).transpose()?;
    let gpt = GptConfig::preset(&args.preset).map_err(|e| e.to_string())?;
    let reps = args.reps.max(1);
    let (dir, temporary) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("ckpt_bench-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let m = run_save_world(&dims, &gpt, &dir, reps);
    let r = match (&m, &reshard) {
        (Ok(_), Some(rd)) => Some(run_reshard_world(rd, &gpt, &dir, reps)),
        _ => None,
    };
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let m = m?;
    let r = r.transpose()?;
    let mb = m.bytes as f64 / 1e6;
    let save_rate = mb / median(&m.save_s);
    let load_rate = mb / median(&m.load_s);
    let write_rate = mb / median(&m.disk_write_s);
    let read_rate = mb / median(&m.disk_read_s);
    let mut summary = serde_json::json!({
        "preset": args.preset,
        "mesh": args.mesh,
        "world": dims.iter().map(|d| d.1).product::<usize>(),
        "reps": reps,
        "checkpoint_bytes": m.bytes,
        "save_s_median": median(&m.save_s),
        "load_s_median": median(&m.load_s),
        "load_bytes_read": m.load_read,
        "save_mb_s": save_rate,
        "load_mb_s": load_rate,
        "disk_write_fsync_mb_s": write_rate,
        "disk_read_mb_s": read_rate,
        "save_fraction_of_disk_write": save_rate / write_rate,
        "load_fraction_of_disk_read": load_rate / read_rate,
        "note": "reads (baseline and loads) may be served from the page cache",
    });
    if let (Some((times, read)), Some(to)) = (&r, &args.reshard_to) {
        let rate = mb / median(times);
        summary["reshard"] = serde_json::json!({
            "mesh": to,
            "load_s_median": median(times),
            "load_mb_s": rate,
            "bytes_read": read,
            "load_fraction_of_disk_read": rate / read_rate,
        });
    }
    if args.json {
        println!("{summary}");
        return Ok(());
    }
    println!(
        "{} preset on mesh {}: checkpoint {:.1} MB (parameters + AdamW moments), median of {reps}",
        args.preset, args.mesh, mb
    );
    println!(
        "  save  {:7.3} s  {:8.1} MB/s  = {:.2} x sequential write+fsync ({:.1} MB/s)",
        median(&m.save_s),
        save_rate,
        save_rate / write_rate,
        write_rate
    );
    println!(
        "  load  {:7.3} s  {:8.1} MB/s  = {:.2} x sequential read ({:.1} MB/s)",
        median(&m.load_s),
        load_rate,
        load_rate / read_rate,
        read_rate
    );
    if let (Some((times, read)), Some(to)) = (&r, &args.reshard_to) {
        let rate = mb / median(times);
        println!(
            "  load on {to} (resharding) {:7.3} s  {:8.1} MB/s  = {:.2} x sequential read; {:.1} MB read",
            median(times),
            rate,
            rate / read_rate,
            *read as f64 / 1e6
        );
    }
    println!("  (reads may be served from the page cache: the files were just written)");
    Ok(())
}
