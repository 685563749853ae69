//! Shows what the sharding compiler decides for one op, or plans one redistribution; with
//! `--run`, also runs it forward and backward on the local backend and checks it against
//! single-device candle.
//!
//! ```text
//! cargo run --release --example explain -- \
//!     --mesh dp=2,tp=2 --op matmul --shapes 64x32,32x64 --placements "S(0),R;R,S(1)" --json
//! cargo run --release --example explain -- \
//!     --mesh dp=2,tp=2 --op redistribute --shapes 8x4 --placements "S(0),S(0)" --to "R,R"
//! cargo run --release --example explain -- \
//!     --mesh tp=4 --op matmul --shapes 8x16,16x12 --placements "R;S(1)" --run --json
//! cargo run --release --example explain -- \
//!     --op moe --mesh dp=2,ep=2 --moe experts=8,top_k=2 --shapes 4x16x32 --run
//! cargo run --release --example explain -- --pp 4 --microbatches 8 --pp-schedule 1f1b
//! ```
//!
//! `--pp P` explains a pipeline schedule instead of an op: each rank's actions (`--pp-schedule
//! gpipe|1f1b|interleaved-1f1b|zb-h1|zb-v`, `--microbatches M`, `--pp-virtual V` chunks per rank
//! for interleaved) and its bubble fraction from the unit-time simulation, beside the formula.
//!
//! `--op moe` plans one mixture-of-experts layer instead (`--moe` as train_gpt's, `--shapes`
//! the global `BxTxD`): the count exchange, the dispatch and combine exchanges both ways with
//! their bytes, and the gradient reductions; `--run` checks them against CommDebugMode.
//!
//! Inputs are separated by `;`, mesh dims by `,`; shapes are `AxB` separated by `,` (an optional
//! `:dtype` per shape, e.g. `4x16:u32`). Errors go to stderr with a non-zero exit.
//!
//! `--run` starts one rank per mesh position (world = mesh size), builds random inputs with
//! the given shapes and placements (integer inputs hold valid indices; Partial inputs are split
//! into DISTINCT summands that reduce to the value), runs the op and the backward of a random
//! weighting of its outputs, and compares `full_tensor()` of every output and of every input
//! gradient read as a DTensor (`DTensor::grad`: the single-device gradient of the input's value,
//! whatever its placements) with the same computation in plain candle on one device. It adds
//! `run: {fwd_max_abs_err, bwd_max_abs_err, ok, observed_collectives, observed_mesh_dims,
//! matches_plan}` to the report, the collectives coming from `CommDebugMode` during the forward
//! op; `ok` needs both errors within 1e-5 of the magnitudes AND the collectives that ran (kind
//! and mesh dim) equal to the planned ones.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor::comm::link::{link_hints, parse_link_spec};
use candle_dtensor::comm::{CommOptions, LocalWorld};
use candle_dtensor::dtensor::debug::{CollectiveRecord, CommDebugMode, Phase};
use candle_dtensor::dtensor::{
    apply_all, distribute_tensor, reference_apply_all, DTensor, Placement, ReduceOp,
};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::strategies::{
    explain, partials_replicated, resolve, DTensorSpec, ExpandMethod, ExplainReport,
    ExplainRequest, InputKind, Op, Shape,
};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Explain a sharding decision of candle-dtensor")]
struct Args {
    /// With `--op moe`: the MoE layer, e.g. `experts=8,top_k=2` (train_gpt's `--moe` syntax;
    /// `--shapes BxTxD` gives the global batch, sequence and model dims).
    #[arg(long)]
    moe: Option<String>,
    /// Mesh, e.g. `dp=2,tp=2`.
    #[arg(long, required_unless_present = "pp", default_value = "")]
    mesh: String,
    /// DTensor method name (`matmul`, `add`, `sum`, `softmax`, ...) or `redistribute`.
    #[arg(long, required_unless_present = "pp", default_value = "")]
    op: String,
    /// Input shapes, e.g. `64x32,32x64` (optional `:dtype` per shape).
    #[arg(long, default_value = "")]
    shapes: String,
    /// Input placements, inputs separated by `;`, e.g. `S(0),R;R,S(1)` (default: replicated).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    placements: String,
    /// Dim arguments, e.g. `0` or `0,1` (negative allowed; narrow `DIM,START,LEN`, pad
    /// `DIM,BEFORE,AFTER`).
    #[arg(long, allow_hyphen_values = true)]
    dims: Option<String>,
    /// Keep reduced dims.
    #[arg(long)]
    keepdim: bool,
    /// Target shape of reshape / broadcast_as, e.g. `16x6`; the piece sizes of split.
    #[arg(long)]
    to_shape: Option<String>,
    /// dtype of float inputs (default f32).
    #[arg(long)]
    dtype: Option<String>,
    /// Target placements for `--op redistribute`.
    #[arg(long, allow_hyphen_values = true)]
    to: Option<String>,
    /// Target dtype of `to_dtype`.
    #[arg(long)]
    to_dtype: Option<String>,
    /// Scalar argument (scalar ops, affine multiplier, masked_fill/pad value, dropout p, norm
    /// p, topk k, var/std correction, baddbmm alpha).
    #[arg(long, allow_hyphen_values = true)]
    scalar: Option<f64>,
    /// Causal attention (sdpa).
    #[arg(long)]
    causal: bool,
    /// Mesh dims with a flattened communicator, e.g. `dp,tp` (repeatable).
    #[arg(long)]
    flatten: Vec<String>,
    /// Search: auto, product or dijkstra.
    #[arg(long, default_value = "auto", value_parser = ["auto", "product", "dijkstra"])]
    method: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Also run the op (forward and backward) on the local backend and compare with one device.
    #[arg(long)]
    run: bool,
    /// Seed of the random inputs of `--run`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// With `--run`: a modeled network per mesh dim (`dp=20us:0.2GBps` or a preset, `dp=ib`;
    /// `comm::link`), so each observed collective reports its modeled time next to the time
    /// the rank waited for it.
    #[arg(long)]
    link: Option<String>,
    /// Explain a pipeline schedule on this many stages (ranks) instead of an op: each rank's
    /// actions and the bubble fraction (`parallel::pipeline`).
    #[arg(long)]
    pp: Option<usize>,
    /// With `--pp`: micro-batches per step.
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// With `--pp`: the schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v), or `all` to
    /// compare every one.
    #[arg(long, default_value = "1f1b")]
    pp_schedule: String,
    /// With `--pp` and interleaved 1F1B: model chunks (virtual stages) per rank.
    #[arg(long, default_value_t = 2)]
    pp_virtual: usize,
    /// With `--pp`: `F,B,I,W`, a model's own times of one forward, full backward,
    /// input-gradient and weight-gradient backward on one rank's whole share (train_gpt's
    /// `pipeline.action_ms` times `--pp-chunks`): the schedule's bubble and makespan with them.
    #[arg(long)]
    pp_costs: Option<String>,
}

#[path = "common/logging.rs"]
mod logging;

fn main() {
    logging::init_logging();
    candle_dtensor::init_cpu_threads();
    let a = Args::parse();
    if let Some(p) = a.pp {
        let costs = a
            .pp_costs
            .as_deref()
            .map(explain_pp::parse_costs)
            .transpose();
        let report = costs.and_then(|c| {
            explain_pp::report(p, a.microbatches, &a.pp_schedule, a.pp_virtual, c.as_ref())
        });
        match report {
            Ok(r) if a.json => {
                println!("{r}");
                return;
            }
            Ok(r) => {
                print!("{}", explain_pp::text(&r));
                return;
            }
            Err(e) => {
                eprintln!("error: --pp: {e}");
                std::process::exit(2);
            }
        }
    }
    if a.op == "moe" {
        match moe::explain(&a.mesh, a.moe.as_deref(), &a.shapes, a.run, a.seed, a.json) {
            Ok(()) => return,
            Err(e) => {
                eprintln!("error: --op moe: {e}");
                std::process::exit(2);
            }
        }
    }
    let req = ExplainRequest {
        mesh: a.mesh,
        flatten: a.flatten,
        op: a.op,
        shapes: a.shapes,
        placements: a.placements,
        dims: a.dims,
        keepdim: a.keepdim,
        to_shape: a.to_shape,
        dtype: a.dtype,
        to: a.to,
        to_dtype: a.to_dtype,
        scalar: a.scalar,
        causal: a.causal,
        method: match a.method.as_str() {
            "product" => ExpandMethod::Product,
            "dijkstra" => ExpandMethod::Dijkstra,
            _ => ExpandMethod::Auto,
        },
    };
    let report = match explain(&req) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let mut value = match serde_json::to_value(&report) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let mut run_summary = None;
    if a.run {
        match run(&req, &report, a.seed, a.link.as_deref()) {
            Ok(r) => {
                value["run"] = r.clone();
                run_summary = Some(r);
            }
            Err(e) => {
                eprintln!("error: --run: {e}");
                std::process::exit(2);
            }
        }
    }
    if a.json {
        println!("{value}");
    } else {
        println!("{report}");
        if let Some(r) = run_summary {
            println!(
                "run: forward max |err| {:.3e}, backward max |err| {:.3e}, ok {}, observed collectives {} (matches plan: {})",
                r["fwd_max_abs_err"].as_f64().unwrap_or(f64::NAN),
                r["bwd_max_abs_err"].as_f64().unwrap_or(f64::NAN),
                r["ok"],
                r["observed_collectives"],
                r["matches_plan"]
            );
            if let Some(t) = r["observed_times"].as_array().filter(|t| !t.is_empty()) {
                println!("run: collective (mesh dim, bytes): modeled ms / waited ms (rank 0)");
                for c in t {
                    let ms = |v: &serde_json::Value| {
                        v.as_f64()
                            .map_or_else(|| "-".to_string(), |v| format!("{v:.3}"))
                    };
                    println!(
                        "  {} ({}, {} B): {} / {}",
                        c["collective"].as_str().unwrap_or("?"),
                        c["mesh_dim"].as_str().unwrap_or("?"),
                        c["bytes"],
                        ms(&c["modeled_ms"]),
                        ms(&c["waited_ms"])
                    );
                }
            }
        }
    }
    let ok = value
        .get("run")
        .map(|r| r["ok"].as_bool() == Some(true))
        .unwrap_or(true);
    if !ok {
        std::process::exit(1);
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(seed: u64, i: u64) -> f64 {
    (splitmix64(seed ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> 11) as f64 / (1u64 << 53) as f64
}

/// The full input tensors (the same on every rank).
fn inputs(op: Option<&Op>, specs: &[DTensorSpec], seed: u64) -> candle_core::Result<Vec<Tensor>> {
    let shapes: Vec<Shape> = specs.iter().map(|s| s.meta.shape.clone()).collect();
    specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let n: usize = spec.meta.shape.iter().product();
            let s = seed ^ (i as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
            let dims = spec.meta.shape.as_slice();
            let dtype = candle_dtensor_dtype(spec);
            let kind = op.map_or(InputKind::Float, |o| o.input_kind(i, &shapes));
            match dtype {
                DType::U32 | DType::I64 | DType::U8 => {
                    let range = match (dtype, kind) {
                        (DType::U8, _) | (_, InputKind::Mask) => 2,
                        (_, InputKind::Index { bound }) => bound.max(1),
                        _ => 10,
                    };
                    let v: Vec<u32> = (0..n)
                        .map(|k| (unit(s, k as u64) * range as f64) as u32)
                        .collect();
                    Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dtype)
                }
                _ => {
                    let v: Vec<f32> = (0..n)
                        .map(|k| {
                            let u1 = unit(s, 2 * k as u64).max(1e-12);
                            let u2 = unit(s, 2 * k as u64 + 1);
                            let g = ((-2.0 * u1.ln()).sqrt()
                                * (2.0 * std::f64::consts::PI * u2).cos())
                                as f32;
                            if kind == InputKind::Positive {
                                g.abs() + 0.5
                            } else {
                                g
                            }
                        })
                        .collect();
                    Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dtype)
                }
            }
        })
        .collect()
}

fn candle_dtensor_dtype(spec: &DTensorSpec) -> DType {
    match spec.meta.dtype.name() {
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "i64" => DType::I64,
        "u32" => DType::U32,
        "u8" => DType::U8,
        _ => DType::F32,
    }
}

use candle_dtensor::kernels::compare::{max_abs_diff, nan_max};

fn max_abs(a: &Tensor) -> candle_core::Result<f64> {
    if a.elem_count() == 0 {
        return Ok(0.0);
    }
    a.to_dtype(DType::F64)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// What `--run` measured on one rank.
struct RunOut {
    fwd: f64,
    bwd: f64,
    fwd_rel: f64,
    bwd_rel: f64,
    /// `(kind, mesh dim)` of every forward collective, in issue order.
    observed: Vec<(&'static str, String)>,
    /// The forward collectives' CommDebugMode records (bytes, modeled and waited time).
    records: Vec<CollectiveRecord>,
}

/// The value this rank holds for `full` before sharding: on every Partial mesh dim (outermost
/// first, so the innermost dim reduces first) `full` is split into DISTINCT summands that
/// reduce to it (`sum`: random parts; `avg`: random parts of n times the value; `max`/`min`: a
/// random owner per element holds the value, the others smaller/larger values; `product`: the
/// owner holds the value, the others 1), so a wrong propagation rule or adjoint cannot pass by
/// coincidence. Every rank computes the same split from `seed`.
fn summand(
    full: &Tensor,
    placements: &[Placement],
    mesh_shape: &[usize],
    coord: &[usize],
    seed: u64,
    positive: bool,
) -> candle_core::Result<Tensor> {
    let dtype = full.dtype();
    let int = !dtype.is_float();
    let signed = dtype == DType::I64;
    let mut v: Vec<f64> = full.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let mut key = seed ^ 0x5u64.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for (m, p) in placements.iter().enumerate() {
        let Placement::Partial(op) = *p else { continue };
        let (n, c) = (mesh_shape[m], coord[m]);
        key = splitmix64(key ^ (m as u64 + 1));
        let level = key;
        // The next level's split depends on which summand this rank holds here.
        key = splitmix64(key ^ (c as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        if n <= 1 {
            continue;
        }
        let u = |k: usize, e: usize| {
            unit(
                level ^ (k as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407),
                e as u64,
            )
        };
        for (e, x) in v.iter_mut().enumerate() {
            let owner = (splitmix64(level ^ e as u64) % n as u64) as usize;
            *x = match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    let target = if op == ReduceOp::Avg {
                        *x * n as f64
                    } else {
                        *x
                    };
                    if int {
                        // Integers: the owner holds it all (exact, and unsigned stays >= 0).
                        if c == owner {
                            target
                        } else {
                            0.0
                        }
                    } else {
                        let part = |k: usize| (u(k, e) - 0.5) * 0.5 * (1.0 + x.abs());
                        if c + 1 < n {
                            part(c)
                        } else {
                            target - (0..n - 1).map(part).sum::<f64>()
                        }
                    }
                }
                ReduceOp::Max | ReduceOp::Min if c == owner => *x,
                ReduceOp::Max => match (int, positive && *x > 0.0) {
                    (true, _) if signed => *x - 1.0 - (u(c, e) * 3.0).floor(),
                    (true, _) => 0f64.min(*x),
                    (false, true) => *x * (0.3 + 0.6 * u(c, e)),
                    (false, false) => *x - (0.1 + u(c, e)),
                },
                ReduceOp::Min => match (int, positive && *x > 0.0) {
                    (true, _) => *x + 1.0 + (u(c, e) * 3.0).floor(),
                    (false, true) => *x * (1.1 + u(c, e)),
                    (false, false) => *x + (0.1 + u(c, e)),
                },
                ReduceOp::Product => {
                    if c == owner {
                        *x
                    } else {
                        1.0
                    }
                }
            };
        }
    }
    Tensor::from_vec(v, full.dims(), &Device::Cpu)?.to_dtype(dtype)
}

fn run(
    req: &ExplainRequest,
    report: &ExplainReport,
    seed: u64,
    link: Option<&str>,
) -> Result<serde_json::Value, String> {
    let resolved = resolve(req).map_err(|e| e.to_string())?;
    let dims: Vec<(String, usize)> = resolved
        .mesh
        .dims
        .iter()
        .map(|d| (d.name.clone(), d.size))
        .collect();
    let mut options = CommOptions::default().with_timeout(Duration::from_secs(60));
    if let Some(spec) = link {
        let links = parse_link_spec(spec).map_err(|e| format!("--link: {e}"))?;
        for (dim, _) in &links {
            if !dims.iter().any(|(d, _)| d == dim) {
                return Err(format!("--link: mesh dim {dim:?} is not in --mesh"));
            }
        }
        for (k, v) in link_hints(&links) {
            options = options.with_hint(k, v);
        }
    }
    let world: usize = dims.iter().map(|d| d.1).product();
    let specs = resolved.specs.clone();
    let op = resolved.op.clone();
    let full = inputs(op.as_ref(), &specs, seed).map_err(|e| e.to_string())?;
    let shapes: Vec<Shape> = specs.iter().map(|s| s.meta.shape.clone()).collect();
    let positive: Vec<bool> = (0..specs.len())
        .map(|i| {
            op.as_ref()
                .is_some_and(|o| o.input_kind(i, &shapes) == InputKind::Positive)
        })
        .collect();
    let dst: Option<Vec<Placement>> = report.chosen_inputs.first().and_then(|c| {
        (op.is_none()).then(|| {
            candle_dtensor::strategies::parse_placements(c)
                .ok()
                .map(|p| p.to_vec())
        })?
    });
    let flatten = req.flatten.clone();
    let outs = LocalWorld::new(world)
        .with_options(options)
        .launch(
            |comm| -> Result<RunOut, Box<dyn std::error::Error + Send + Sync>> {
                let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
                let mesh = DeviceMesh::new(comm, &d)?;
                for group in &flatten {
                    let names: Vec<&str> = group.split([',', '+']).map(str::trim).collect();
                    let name = names.join("_");
                    mesh.flatten(&names, &name)?;
                }
                let coord = mesh.coordinate();
                let mesh_shape = mesh.shape();
                // Distributed inputs: this rank's summand, sharded; float pieces are Vars so
                // their gradients can be read.
                let mut dts: Vec<DTensor> = Vec::new();
                for (i, (t, spec)) in full.iter().zip(&specs).enumerate() {
                    let mine = summand(
                        t,
                        &spec.placements,
                        &mesh_shape,
                        &coord,
                        seed ^ i as u64,
                        positive[i],
                    )?;
                    let no_partial = partials_replicated(&spec.placements);
                    let piece = distribute_tensor(&mine, &mesh, &no_partial)?
                        .to_local()
                        .clone();
                    let piece = if t.dtype().is_float() {
                        Var::from_tensor(&piece)?.as_tensor().clone()
                    } else {
                        piece
                    };
                    dts.push(DTensor::from_local_with_shape(
                        &piece,
                        &mesh,
                        &spec.placements,
                        &spec.meta.shape,
                    )?);
                }
                let refs: Vec<&DTensor> = dts.iter().collect();
                let mode = CommDebugMode::start();
                let ys = match (&op, &dst) {
                    (Some(op), _) => apply_all(op, &refs)?,
                    (None, Some(dst)) => vec![refs[0].redistribute(dst)?],
                    (None, None) => return Err("redistribute needs --to".into()),
                };
                let observed: Vec<(&'static str, String)> = mode
                    .records()
                    .iter()
                    .filter(|r| r.phase == Phase::Forward)
                    .map(|r| (r.kind, r.mesh_dim.clone()))
                    .collect();
                let records: Vec<CollectiveRecord> = mode
                    .records()
                    .into_iter()
                    .filter(|r| r.phase == Phase::Forward)
                    .collect();
                drop(mode);
                // Single-device reference.
                let ref_vars: Vec<Option<Var>> = full
                    .iter()
                    .map(|t| {
                        t.dtype()
                            .is_float()
                            .then(|| Var::from_tensor(t))
                            .transpose()
                    })
                    .collect::<candle_core::Result<_>>()?;
                let ref_inputs: Vec<Tensor> = full
                    .iter()
                    .zip(&ref_vars)
                    .map(|(t, v)| {
                        v.as_ref()
                            .map(|v| v.as_tensor().clone())
                            .unwrap_or_else(|| t.clone())
                    })
                    .collect();
                let ys_ref = match &op {
                    Some(op) => reference_apply_all(op, &ref_inputs)?,
                    None => vec![ref_inputs[0].clone()],
                };
                if ys.len() != ys_ref.len() {
                    return Err(format!("{} outputs, reference {}", ys.len(), ys_ref.len()).into());
                }
                let (mut fwd, mut scale) = (0f64, 1f64);
                for (y, y_ref) in ys.iter().zip(&ys_ref) {
                    fwd = nan_max(fwd, max_abs_diff(&y.full_tensor()?, y_ref)?);
                    scale = scale.max(max_abs(y_ref)?);
                }
                let mut bwd = 0f64;
                let mut gscale = 1f64;
                // Loss: a random weighting of every float output.
                let mut loss: Option<DTensor> = None;
                let mut ref_loss: Option<Tensor> = None;
                for (k, (y, y_ref)) in ys.iter().zip(&ys_ref).enumerate() {
                    if !y_ref.dtype().is_float() {
                        continue;
                    }
                    let w = Tensor::from_vec(
                        (0..y_ref.elem_count())
                            .map(|e| unit(seed ^ 0x5EED ^ (k as u64) << 20, e as u64) as f32 - 0.5)
                            .collect::<Vec<f32>>(),
                        y_ref.dims(),
                        &Device::Cpu,
                    )?
                    .to_dtype(y_ref.dtype())?;
                    let wd =
                        distribute_tensor(&w, &mesh, &vec![Placement::Replicate; mesh.ndim()])?;
                    let l = y.mul(&wd)?.sum_all()?;
                    let rl = y_ref.mul(&w)?.sum_all()?;
                    loss = Some(match loss {
                        Some(a) => a.add(&l)?,
                        None => l,
                    });
                    ref_loss = Some(match ref_loss {
                        Some(a) => (a + rl)?,
                        None => rl,
                    });
                }
                if let (Some(loss), Some(ref_loss)) = (loss, ref_loss) {
                    let grads = loss.backward()?;
                    let ref_grads = ref_loss.backward()?;
                    for (dt, rv) in dts.iter().zip(&ref_vars) {
                        let Some(rv) = rv else { continue };
                        let rg = match ref_grads.get(rv) {
                            Some(g) => g.clone(),
                            None => rv.as_tensor().zeros_like()?,
                        };
                        // The rule of docs/ARCHITECTURE.md: the gradient read as a DTensor is
                        // the single-device gradient, whatever the input's placements.
                        let g = match dt.grad(&grads)? {
                            Some(g) => g.full_tensor()?,
                            None => rg.zeros_like()?,
                        };
                        bwd = nan_max(bwd, max_abs_diff(&g, &rg)?);
                        gscale = gscale.max(max_abs(&rg)?);
                    }
                }
                Ok(RunOut {
                    fwd,
                    bwd,
                    fwd_rel: fwd / scale,
                    bwd_rel: bwd / gscale,
                    observed,
                    records,
                })
            },
        )
        .map_err(|e| e.to_string())?;
    let out = outs.into_iter().next().ok_or("no rank reported")?;
    let mut planned: Vec<(String, String)> = report
        .collectives
        .iter()
        .filter(|c| c.kind.is_communication())
        .map(|c| (c.kind.name().to_string(), c.mesh_dim.clone()))
        .collect();
    let mut seen: Vec<(String, String)> = out
        .observed
        .iter()
        .map(|(k, m)| (k.to_string(), m.clone()))
        .collect();
    planned.sort();
    seen.sort();
    let matches_plan = planned == seen;
    // f32 tolerance: 1e-5 of the largest magnitude of the output (resp. gradients); and the
    // collectives that ran are the ones planned.
    let ok = out.fwd_rel <= 1e-5 && out.bwd_rel <= 1e-5 && matches_plan;
    Ok(serde_json::json!({
        "fwd_max_abs_err": out.fwd,
        "bwd_max_abs_err": out.bwd,
        "fwd_max_rel_err": out.fwd_rel,
        "bwd_max_rel_err": out.bwd_rel,
        "ok": ok,
        "observed_collectives": out.observed.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        "observed_mesh_dims": out.observed.iter().map(|(_, m)| m.clone()).collect::<Vec<_>>(),
        "matches_plan": matches_plan,
        "observed_times": out.records.iter().map(|r| serde_json::json!({
            "collective": r.kind,
            "mesh_dim": r.mesh_dim,
            "bytes": r.bytes,
            "modeled_ms": r.modeled_us.map(|u| u / 1e3),
            "waited_ms": r.waited_us.map(|u| u / 1e3),
        })).collect::<Vec<_>>(),
    }))
}

#[path = "common/explain_moe.rs"]
mod moe;

#[path = "common/explain_pp.rs"]
mod explain_pp;
