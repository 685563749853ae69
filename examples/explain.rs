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
//! ```
//!
//! Inputs are separated by `;`, mesh dims by `,`; shapes are `AxB` separated by `,` (an optional
//! `:dtype` per shape, e.g. `4x16:u32`). Errors go to stderr with a non-zero exit.
//!
//! `--run` starts one rank per mesh position (world = mesh size), builds random inputs with
//! the given shapes and placements (integer inputs hold valid indices), runs the op and the
//! backward of a random weighting of its output, and compares `full_tensor()` of the output
//! and of every input gradient with the same computation in plain candle on one device. It adds
//! `run: {fwd_max_abs_err, bwd_max_abs_err, ok, observed_collectives, matches_plan}` to the
//! report, the collectives coming from `CommDebugMode` during the forward op.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor::comm::LocalWorld;
use candle_dtensor::dtensor::debug::{CommDebugMode, Phase};
use candle_dtensor::dtensor::{apply, distribute_tensor, reference_apply, DTensor, Placement};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::strategies::{
    explain, resolve, CollectiveKind, DTensorSpec, ExpandMethod, ExplainReport, ExplainRequest,
    InputKind, Op, Shape,
};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Explain a sharding decision of candle-dtensor")]
struct Args {
    /// Mesh, e.g. `dp=2,tp=2`.
    #[arg(long)]
    mesh: String,
    /// DTensor method name (`matmul`, `add`, `sum`, `softmax`, ...) or `redistribute`.
    #[arg(long)]
    op: String,
    /// Input shapes, e.g. `64x32,32x64` (optional `:dtype` per shape).
    #[arg(long, default_value = "")]
    shapes: String,
    /// Input placements, inputs separated by `;`, e.g. `S(0),R;R,S(1)` (default: replicated).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    placements: String,
    /// Dim arguments, e.g. `0` or `0,1` (negative allowed).
    #[arg(long, allow_hyphen_values = true)]
    dims: Option<String>,
    /// Keep reduced dims.
    #[arg(long)]
    keepdim: bool,
    /// Target shape of reshape / broadcast_as, e.g. `16x6`.
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
    /// Scalar argument (scalar ops, affine multiplier, masked_fill value, dropout p).
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
}

fn main() {
    candle_dtensor::init_cpu_threads();
    let a = Args::parse();
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
        match run(&req, &report, a.seed) {
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

fn max_abs_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?;
    if d.elem_count() == 0 {
        return Ok(0.0);
    }
    d.flatten_all()?.max(0)?.to_scalar::<f64>()
}

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

/// (forward |err|, backward |err|, forward relative, backward relative, observed collectives).
type RunOut = (f64, f64, f64, f64, Vec<&'static str>);

fn run(
    req: &ExplainRequest,
    report: &ExplainReport,
    seed: u64,
) -> Result<serde_json::Value, String> {
    let resolved = resolve(req).map_err(|e| e.to_string())?;
    let dims: Vec<(String, usize)> = resolved
        .mesh
        .dims
        .iter()
        .map(|d| (d.name.clone(), d.size))
        .collect();
    let world: usize = dims.iter().map(|d| d.1).product();
    let specs = resolved.specs.clone();
    let op = resolved.op.clone();
    let full = inputs(op.as_ref(), &specs, seed).map_err(|e| e.to_string())?;
    let dst: Option<Vec<Placement>> = report.chosen_inputs.first().and_then(|c| {
        (op.is_none()).then(|| {
            candle_dtensor::strategies::parse_placements(c)
                .ok()
                .map(|p| p.to_vec())
        })?
    });
    let flatten = req.flatten.clone();
    let outs = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(60))
        .launch(
            |comm| -> Result<RunOut, Box<dyn std::error::Error + Send + Sync>> {
                let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
                let mesh = DeviceMesh::new(comm, &d)?;
                for group in &flatten {
                    let names: Vec<&str> = group.split([',', '+']).map(str::trim).collect();
                    let name = names.join("_");
                    mesh.flatten(&names, &name)?;
                }
                // Distributed inputs: float pieces are Vars so their gradients can be read.
                let mut vars: Vec<Option<Var>> = Vec::new();
                let mut dts: Vec<DTensor> = Vec::new();
                for (t, spec) in full.iter().zip(&specs) {
                    let dt = distribute_tensor(t, &mesh, &spec.placements)?;
                    if t.dtype().is_float() {
                        let v = Var::from_tensor(dt.to_local())?;
                        let dt = DTensor::from_local_with_shape(
                            v.as_tensor(),
                            &mesh,
                            &spec.placements,
                            &spec.meta.shape,
                        )?;
                        vars.push(Some(v));
                        dts.push(dt);
                    } else {
                        vars.push(None);
                        dts.push(dt);
                    }
                }
                let refs: Vec<&DTensor> = dts.iter().collect();
                let mode = CommDebugMode::start();
                let y = match (&op, &dst) {
                    (Some(op), _) => apply(op, &refs)?,
                    (None, Some(dst)) => refs[0].redistribute(dst)?,
                    (None, None) => return Err("redistribute needs --to".into()),
                };
                let observed: Vec<&'static str> = mode
                    .records()
                    .iter()
                    .filter(|r| r.phase == Phase::Forward)
                    .map(|r| r.kind)
                    .collect();
                drop(mode);
                let y_full = y.full_tensor()?;
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
                let y_ref = match &op {
                    Some(op) => reference_apply(op, &ref_inputs)?,
                    None => ref_inputs[0].clone(),
                };
                let fwd = max_abs_diff(&y_full, &y_ref)?;
                let scale = max_abs(&y_ref)?.max(1.0);
                let mut bwd = 0f64;
                let mut gscale = 1f64;
                if y_ref.dtype().is_float() {
                    let w = Tensor::from_vec(
                        (0..y_ref.elem_count())
                            .map(|k| unit(seed ^ 0x5EED, k as u64) as f32 - 0.5)
                            .collect::<Vec<f32>>(),
                        y_ref.dims(),
                        &Device::Cpu,
                    )?
                    .to_dtype(y_ref.dtype())?;
                    let wd =
                        distribute_tensor(&w, &mesh, &vec![Placement::Replicate; mesh.ndim()])?;
                    let grads = y.mul(&wd)?.sum_all()?.backward()?;
                    let ref_grads = y_ref.mul(&w)?.sum_all()?.backward()?;
                    for ((v, rv), spec) in vars.iter().zip(&ref_vars).zip(&specs) {
                        let (Some(v), Some(rv)) = (v, rv) else {
                            continue;
                        };
                        let (Some(g), Some(rg)) = (grads.get(v), ref_grads.get(rv)) else {
                            continue;
                        };
                        // A Partial input's gradient is the replicated gradient of its value.
                        let gp: Vec<Placement> = spec
                            .placements
                            .iter()
                            .map(|p| {
                                if p.is_partial() {
                                    Placement::Replicate
                                } else {
                                    *p
                                }
                            })
                            .collect();
                        let g = DTensor::from_local_with_shape(g, &mesh, &gp, &spec.meta.shape)?
                            .full_tensor()?;
                        bwd = bwd.max(max_abs_diff(&g, rg)?);
                        gscale = gscale.max(max_abs(rg)?);
                    }
                }
                Ok((fwd, bwd, fwd / scale, bwd / gscale, observed))
            },
        )
        .map_err(|e| e.to_string())?;
    let (fwd, bwd, fwd_rel, bwd_rel, observed) =
        outs.into_iter().next().ok_or("no rank reported")?;
    let mut planned: Vec<String> = report
        .collectives
        .iter()
        .filter(|c| c.kind.is_communication() && c.kind != CollectiveKind::RmaGet)
        .map(|c| c.kind.name().to_string())
        .collect();
    let mut seen: Vec<String> = observed
        .iter()
        .filter(|k| **k != "rma_get")
        .map(|k| k.to_string())
        .collect();
    planned.sort();
    seen.sort();
    // f32 tolerance: 1e-5 of the largest magnitude of the output (resp. gradients).
    let ok = fwd_rel <= 1e-5 && bwd_rel <= 1e-5;
    Ok(serde_json::json!({
        "fwd_max_abs_err": fwd,
        "bwd_max_abs_err": bwd,
        "fwd_max_rel_err": fwd_rel,
        "bwd_max_rel_err": bwd_rel,
        "ok": ok,
        "observed_collectives": observed,
        "matches_plan": planned == seen,
    }))
}
