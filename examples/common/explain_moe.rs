//! `explain --op moe`: the collectives of one MoE layer's forward and backward on a mesh.
//!
//! ```text
//! cargo run --release --example explain -- \
//!     --op moe --mesh ep=4 --moe experts=8,top_k=2 --shapes 4x16x32 --run
//! ```
//!
//! The plan is exact for a dropless layer (no `capacity`) whatever the routing: the count
//! exchange is one all_gather of `[layer key, tokens, top_k x experts counts]` u32 per rank
//! over the data dims, the dispatch sends every (token, choice) row once over `ep` (B*T*k rows
//! of D f32 summed over the ranks; how they split between ranks depends on the routing), the
//! combine sends them back, backward runs each exchange reversed, and the parameters'
//! gradients are all-reduced over the data dims (the router's over each, the experts' over
//! those other than `ep`; GELU experts of hidden size 4*D). `--run` builds the layer
//! on the local backend, runs forward and backward under `CommDebugMode` and checks the
//! records against the plan (`matches_plan`).

use std::error::Error;
use std::str::FromStr;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor::comm::LocalWorld;
use candle_dtensor::dtensor::debug::{CollectiveRecord, CommDebugMode, Phase};
use candle_dtensor::dtensor::{distribute_tensor, DTensor, Placement};
use candle_dtensor::mesh::DeviceMesh;
use candle_dtensor::models::layers::Builder;
use candle_dtensor::models::MoeLayer;
use candle_dtensor::parallel::moe::MoeGroups;
use candle_dtensor::parallel::{DispatchKind, MeshRoles, MoeConfig, ParamStore, TpPlan};
use serde_json::json;

type BoxErr = Box<dyn Error + Send + Sync>;

/// One planned or observed collective: kind, mesh dim, phase, label and bytes (summed over
/// the ranks).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
struct Entry {
    label: String,
    phase: &'static str,
    kind: String,
    mesh_dim: String,
    bytes: u64,
}

fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        _ => "backward",
    }
}

/// The plan (and with `run`, the observed records and `matches_plan`) of one MoE layer on
/// `mesh` (`dp=2,ep=2`), for `moe` (`experts=8,top_k=2`) and `shapes` (`BxTxD`).
pub(crate) fn report(
    mesh: &str,
    moe: &str,
    shapes: &str,
    run_it: bool,
    seed: u64,
) -> Result<serde_json::Value, BoxErr> {
    let cfg = MoeConfig::from_str(moe)?;
    let dims: Vec<(String, usize)> = mesh
        .split(',')
        .map(|d| {
            let (n, s) = d
                .split_once('=')
                .ok_or_else(|| format!("mesh dim {d:?}: expected name=size"))?;
            let s: usize = s
                .trim()
                .parse()
                .map_err(|e| format!("mesh dim {d:?}: {e}"))?;
            Ok((n.trim().to_string(), s))
        })
        .collect::<Result<_, BoxErr>>()?;
    let shape: Vec<usize> = shapes
        .split('x')
        .map(|v| v.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--shapes {shapes:?}: {e}"))?;
    let &[b, t, d] = shape.as_slice() else {
        return Err(format!("--shapes {shapes:?}: expected BxTxD").into());
    };
    if cfg.capacity_factor.is_some() {
        return Err("the plan is exact for a dropless layer only: drop capacity=".into());
    }
    let kind = match cfg.dispatch {
        DispatchKind::AllToAllV => "all_to_all_v",
        DispatchKind::Rma => "rma_put",
    };
    // Every mesh dim but tp carries the batch; ep is one of them.
    let data: Vec<&(String, usize)> = dims.iter().filter(|(n, _)| n != "tp").collect();
    let data_world: usize = data.iter().map(|(_, s)| s).product();
    let data_dims = data
        .iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join("+");
    let world: usize = dims.iter().map(|(_, s)| s).product();
    let rows = (b * t * cfg.top_k * d * 4) as u64;
    let counts = (data_world * (2 + cfg.top_k * cfg.experts) * 4) as u64;
    let mut plan = vec![Entry {
        label: "moe.counts".into(),
        phase: "forward",
        kind: "all_gather".into(),
        mesh_dim: data_dims,
        // Every rank of the world runs it (tp ranks hold the same tokens).
        bytes: counts * world as u64,
    }];
    for label in ["moe.dispatch", "moe.combine"] {
        for ph in ["forward", "backward"] {
            plan.push(Entry {
                label: label.into(),
                phase: ph,
                kind: kind.into(),
                mesh_dim: "ep".into(),
                // Each tp rank of an ep group moves the same rows.
                bytes: rows * (world / data_world) as u64,
            });
        }
    }
    // Gradient reductions of the layer's parameters over the data dims (no FSDP here): the
    // router's (replicated) over each data dim, the experts' (sharded over ep) over the data
    // dims other than ep; tp ranks hold the same tokens and reduce nothing.
    let hidden = 4 * d;
    let per_expert = (2 * hidden * d + hidden + d) as u64;
    let ep = dims.iter().find(|(n, _)| n == "ep").map_or(1, |(_, s)| *s);
    for (name, size) in data.iter().filter(|(_, s)| *s > 1) {
        plan.push(Entry {
            label: "moe.router".into(),
            phase: "backward",
            kind: "all_reduce".into(),
            mesh_dim: name.clone(),
            bytes: (world * cfg.experts * d * 4) as u64,
        });
        if name != "ep" && *size > 1 {
            plan.push(Entry {
                label: "moe.experts".into(),
                phase: "backward",
                kind: "all_reduce".into(),
                mesh_dim: name.clone(),
                // Every ep coordinate's experts, world / ep times over.
                bytes: (world / ep) as u64 * cfg.experts as u64 * per_expert * 4,
            });
        }
    }
    plan.sort();
    let mut report = json!({
        "op": "moe",
        "mesh": mesh,
        "experts": cfg.experts,
        "top_k": cfg.top_k,
        "dispatch": kind,
        "shape": [b, t, d],
        "planned": plan,
    });
    if run_it {
        let observed = run(&dims, &cfg, b, t, d, seed)?;
        report["run"] = json!({
            "observed": observed,
            "matches_plan": observed == plan,
        });
    }
    Ok(report)
}

/// `explain --op moe`: prints [`report`] (as JSON with `json`).
#[allow(dead_code)] // the explain binary's entry; tests call `report`
pub(crate) fn explain(
    mesh: &str,
    moe: Option<&str>,
    shapes: &str,
    run_it: bool,
    seed: u64,
    json: bool,
) -> Result<(), BoxErr> {
    let moe = moe.ok_or("needs --moe experts=E,top_k=K")?;
    let report = report(mesh, moe, shapes, run_it, seed)?;
    if json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "moe: {} experts, top-{}, dispatch {}, mesh {}, batch/seq/dim {}",
        report["experts"], report["top_k"], report["dispatch"], mesh, report["shape"]
    );
    let show = |title: &str, list: &serde_json::Value| {
        println!("{title}");
        for e in list.as_array().into_iter().flatten() {
            println!(
                "  {:<13} {:<8} {:<13} over {:<6} {} B",
                e["label"].as_str().unwrap_or("?"),
                e["phase"].as_str().unwrap_or("?"),
                e["kind"].as_str().unwrap_or("?"),
                e["mesh_dim"].as_str().unwrap_or("?"),
                e["bytes"]
            );
        }
    };
    show(
        "planned collectives (bytes summed over the ranks; exact for a dropless layer):",
        &report["planned"],
    );
    if let Some(r) = report.get("run") {
        show("run: observed (CommDebugMode, every rank):", &r["observed"]);
        println!("run: matches plan: {}", r["matches_plan"]);
    }
    Ok(())
}

/// Runs the layer forward and backward on every rank and returns the CommDebugMode records
/// merged over the ranks (bytes summed per label, phase, kind and mesh dim).
fn run(
    dims: &[(String, usize)],
    cfg: &MoeConfig,
    b: usize,
    t: usize,
    d: usize,
    seed: u64,
) -> Result<Vec<Entry>, BoxErr> {
    let world: usize = dims.iter().map(|(_, s)| s).product();
    let (dims, cfg) = (dims.to_vec(), cfg.clone());
    let per_rank = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(60))
        .launch(move |comm| -> Result<Vec<CollectiveRecord>, BoxErr> {
            let named: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
            let mesh = DeviceMesh::new(comm, &named)?;
            let roles = MeshRoles::of(&mesh)?;
            let groups = MoeGroups::new(&mesh, &cfg, d, 4 * d)?;
            let mut store = ParamStore::new(&mesh, seed, DType::F32);
            let layer = {
                let mut builder = Builder {
                    store: &mut store,
                    roles: roles.clone(),
                    plan: TpPlan::new(),
                };
                MoeLayer::new(&mut builder, "moe", 0, &groups, d, 4 * d, false, 0.3, 0.2)?
            };
            let batch = roles.placements(Placement::Replicate, Placement::Shard(0));
            // The same full batch on every rank (each keeps its shard), varied by `seed`.
            let x_full = Tensor::arange(0u32, (b * t * d) as u32, &Device::Cpu)?
                .to_dtype(DType::F32)?
                .affine(0.37, seed as f64)?
                .sin()?
                .reshape((b, t, d))?;
            let x_local = distribute_tensor(&x_full, &mesh, &batch)?
                .to_local()
                .clone();
            let xv = Var::from_tensor(&x_local)?;
            let x = DTensor::from_local_with_shape(xv.as_tensor(), &mesh, &batch, &[b, t, d])?;
            let mode = CommDebugMode::start();
            let (y, aux) = layer.forward(&x)?;
            let mut loss = y.sum_all()?;
            if let Some(aux) = aux {
                loss = loss.add(&aux)?;
            }
            loss.backward()?;
            Ok(mode
                .records()
                .into_iter()
                .filter(|r| r.label.as_deref().is_some_and(|l| l.starts_with("moe.")))
                .collect())
        })?;
    let mut merged: Vec<Entry> = Vec::new();
    for r in per_rank.into_iter().flatten() {
        let e = Entry {
            label: r.label.unwrap_or_default(),
            phase: phase(r.phase),
            kind: r.kind.to_string(),
            mesh_dim: r.mesh_dim,
            bytes: 0,
        };
        match merged.iter_mut().find(|m| {
            Entry {
                bytes: 0,
                ..(*m).clone()
            } == e
        }) {
            Some(m) => m.bytes += r.bytes,
            None => merged.push(Entry {
                bytes: r.bytes,
                ..e
            }),
        }
    }
    merged.sort();
    Ok(merged)
}
