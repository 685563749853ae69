//! Mixture of experts: the layer against a plain-candle single-device reference (forward,
//! balancing loss, every gradient), expert parallelism over `ep` (ep=4, dp=2 x ep=2, uneven
//! and empty expert shards, all_to_all_v and RMA dispatch), capacity drops, a GPT with MoE
//! blocks training like the single-device one, and the typed errors of bad settings.
// The GPT-training helpers every crate's GPT tests share (they train through train's run).
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_comm::{Comm, LocalWorld};
use candle_dtensor_core::debug::{CollectiveRecord, CommDebugMode, Phase};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use candle_dtensor_kernels::compare::compare_series_f32;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::layers::Builder;
use candle_dtensor_models::{Gpt, GptConfig, MoeLayer};
use candle_dtensor_parallel::moe::routing::LocalRouting;
use candle_dtensor_parallel::moe::MoeGroups;
use candle_dtensor_parallel::{
    DispatchKind, MeshRoles, MoeConfig, MoeError, ParallelError, ParamStore, TpPlan,
};
use candle_dtensor_train::data::Corpus;
use candle_nn::Optimizer;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const B: usize = 7;
const T: usize = 3;
const D: usize = 8;
const H: usize = 12;

fn data(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = (i as u64)
                .wrapping_mul(2654435761)
                .wrapping_add(seed * 40503)
                % 2000;
            v as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Single-device reference in plain candle: every expert on every token, weighted by the
/// (top-k, renormalised, capacity-masked) router weights. Returns `(out [N, D], aux)`.
struct Reference {
    out: Tensor,
    aux: Tensor,
    dropped: usize,
}

#[allow(clippy::too_many_arguments)]
fn reference(
    cfg: &MoeConfig,
    x: &Tensor,
    router: &Tensor,
    w1: &Tensor,
    b1: &Tensor,
    w2: &Tensor,
    b2: &Tensor,
    w3: Option<(&Tensor, &Tensor)>,
) -> R<Reference> {
    let (n, _) = x.dims2()?;
    let (e_n, k) = (cfg.experts, cfg.top_k);
    let logits = x.matmul(&router.t()?)?;
    let m = logits.max_keepdim(1)?.detach();
    let ex = logits.broadcast_sub(&m)?.exp()?;
    let probs = ex.broadcast_div(&ex.sum_keepdim(1)?)?;
    // Top-k on the host (ties to the lower expert), then the capacity in priority order:
    // every first choice (token order) before any second choice.
    let p: Vec<Vec<f32>> = probs.to_vec2()?;
    let choice: Vec<Vec<usize>> = p
        .iter()
        .map(|row| {
            let mut idx: Vec<usize> = (0..e_n).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            idx[..k].to_vec()
        })
        .collect();
    let cap = cfg
        .capacity_factor
        .map(|f| ((f * (n * k) as f64 / e_n as f64).ceil() as usize).max(1));
    let mut sel = vec![0f32; n * e_n];
    let mut keep = vec![0f32; n * e_n];
    let mut used = vec![0usize; e_n];
    let mut assigned = vec![0usize; e_n];
    let mut dropped = 0;
    for s in 0..k {
        for (t, c) in choice.iter().enumerate() {
            let e = c[s];
            sel[t * e_n + e] = 1.0;
            assigned[e] += 1;
            if cap.is_none_or(|c| used[e] < c) {
                used[e] += 1;
                keep[t * e_n + e] = 1.0;
            } else {
                dropped += 1;
            }
        }
    }
    let sel = Tensor::from_vec(sel, (n, e_n), x.device())?;
    let keep = Tensor::from_vec(keep, (n, e_n), x.device())?;
    let chosen = probs.mul(&sel)?;
    let gates = if k > 1 && cfg.normalize_top_k {
        chosen.broadcast_div(&chosen.sum_keepdim(1)?)?
    } else {
        chosen
    };
    let gates = gates.mul(&keep)?;
    let mut out = Tensor::zeros((n, D), DType::F32, x.device())?;
    for e in 0..e_n {
        let h = x.matmul(&w1.get(e)?.t()?)?.broadcast_add(&b1.get(e)?)?;
        let h = match w3 {
            Some((w3, b3)) => {
                let g = x.matmul(&w3.get(e)?.t()?)?.broadcast_add(&b3.get(e)?)?;
                h.silu()?.mul(&g)?
            }
            None => h.gelu()?,
        };
        let y = h.matmul(&w2.get(e)?.t()?)?.broadcast_add(&b2.get(e)?)?;
        out = (out + y.broadcast_mul(&gates.narrow(1, e, 1)?)?)?;
    }
    let f: Vec<f32> = assigned
        .iter()
        .map(|&a| a as f32 / (n * k) as f32)
        .collect();
    let f = Tensor::from_vec(f, e_n, x.device())?;
    let aux = (probs.mean(0)?.mul(&f)?.sum_all()? * (cfg.aux_loss_coef * e_n as f64))?;
    Ok(Reference { out, aux, dropped })
}

fn close(what: &str, a: &Tensor, b: &Tensor, tol: f32) {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    // f32::max keeps an infinity, which would make every finite difference pass (a NaN in
    // `a` or `b` fails the comparison below).
    assert!(scale.is_finite(), "{what}: the reference is not finite");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

const PARAMS: [&str; 7] = [
    "moe.router.weight",
    "moe.experts.w1",
    "moe.experts.b1",
    "moe.experts.w2",
    "moe.experts.b2",
    "moe.experts.w3",
    "moe.experts.b3",
];

/// What one run of the layer gives (full tensors, identical on every rank).
struct LayerRun {
    out: Tensor,
    aux: f32,
    dropped: usize,
    /// Full parameters and their full gradients, by `PARAMS` name (present ones).
    params: Vec<(String, Tensor, Tensor)>,
    dx: Tensor,
    tokens_per_expert: Vec<usize>,
    /// What CommDebugMode recorded on this rank over forward and backward.
    records: Vec<CollectiveRecord>,
}

fn run_layer(dims: &[(&str, usize)], cfg: &MoeConfig, swiglu: bool) -> R<LayerRun> {
    Ok(run_layer_all(dims, cfg, swiglu)?
        .into_iter()
        .next()
        .ok_or("no rank")?)
}

/// Every rank's [`LayerRun`].
fn run_layer_all(dims: &[(&str, usize)], cfg: &MoeConfig, swiglu: bool) -> R<Vec<LayerRun>> {
    let world: usize = dims.iter().map(|d| d.1).product();
    let dims: Vec<(String, usize)> = dims.iter().map(|(n, s)| (n.to_string(), *s)).collect();
    let cfg = cfg.clone();
    let out = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(30))
        .launch(move |comm| -> R<LayerRun> {
            let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
            let mesh = DeviceMesh::new(comm, &d)?;
            let roles = MeshRoles::of(&mesh)?;
            let groups = MoeGroups::new(&mesh, &cfg, D, H)?;
            let mut store = ParamStore::new(&mesh, 3, DType::F32);
            let layer = {
                let mut b = Builder {
                    store: &mut store,
                    roles: roles.clone(),
                    plan: TpPlan::new(),
                };
                MoeLayer::new(&mut b, "moe", 0, &groups, D, H, swiglu, 0.3, 0.2)?
            };
            let batch = roles.placements(Placement::Replicate, Placement::Shard(0));
            let x_full = Tensor::from_vec(data(B * T * D, 1), (B, T, D), &Device::Cpu)?;
            let x_local = distribute_tensor(&x_full, &mesh, &batch)?
                .to_local()
                .clone();
            let xv = Var::from_tensor(&x_local)?;
            let x = DTensor::from_local_with_shape(xv.as_tensor(), &mesh, &batch, &[B, T, D])?;
            let mode = CommDebugMode::start();
            let (y, aux) = layer.forward(&x)?;
            let aux = aux.ok_or("no aux loss")?;
            // A weighted sum, so every output element's gradient differs.
            let wts = Tensor::from_vec(data(B * T * D, 2), (B, T, D), &Device::Cpu)?;
            let wts = distribute_tensor(&wts, &mesh, &batch)?;
            let loss = y.mul(&wts)?.sum_all()?.add(&aux)?;
            let grads = loss.backward()?;
            let records = mode.records();
            let mut params = Vec::new();
            for name in PARAMS {
                if let Some(p) = store.get(name) {
                    let g = p.tensor.grad(&grads)?.ok_or("no gradient")?;
                    params.push((name.to_string(), p.tensor.full_tensor()?, g.full_tensor()?));
                }
            }
            let dx = x.grad(&grads)?.ok_or("no input gradient")?.full_tensor()?;
            let all_r = vec![Placement::Replicate; mesh.ndim()];
            let stats = layer.take_stats();
            Ok(LayerRun {
                out: y.full_tensor()?,
                aux: aux.redistribute(&all_r)?.to_local().to_scalar::<f32>()?,
                dropped: stats.dropped,
                params,
                dx,
                tokens_per_expert: stats.tokens_per_expert,
                records,
            })
        })?;
    Ok(out)
}

/// The layer on `dims` matches the plain-candle reference: output, aux loss, dropped count
/// and every gradient (router, experts, input).
fn check_layer(dims: &[(&str, usize)], cfg: &MoeConfig, swiglu: bool) {
    let run = run_layer(dims, cfg, swiglu).unwrap_or_else(|e| panic!("{dims:?}: {e}"));
    let get = |n: &str| run.params.iter().find(|p| p.0 == n).map(|p| p.1.clone());
    let vars: Vec<(String, Var)> = run
        .params
        .iter()
        .map(|(n, t, _)| (n.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let v = |n: &str| {
        vars.iter()
            .find(|p| p.0 == n)
            .map(|p| p.1.as_tensor().clone())
    };
    let x =
        Var::from_tensor(&Tensor::from_vec(data(B * T * D, 1), (B * T, D), &Device::Cpu).unwrap())
            .unwrap();
    let w3 = v("moe.experts.w3");
    let b3 = v("moe.experts.b3");
    let r = reference(
        cfg,
        x.as_tensor(),
        &v("moe.router.weight").unwrap(),
        &v("moe.experts.w1").unwrap(),
        &v("moe.experts.b1").unwrap(),
        &v("moe.experts.w2").unwrap(),
        &v("moe.experts.b2").unwrap(),
        w3.as_ref().zip(b3.as_ref()),
    )
    .unwrap();
    assert_eq!(get("moe.experts.w3").is_some(), swiglu);
    let tag = format!("{dims:?} {cfg:?}");
    close(
        &format!("{tag} out"),
        &run.out.reshape((B * T, D)).unwrap(),
        &r.out,
        1e-5,
    );
    let aux_ref = r.aux.to_scalar::<f32>().unwrap();
    assert!(
        (run.aux - aux_ref).abs() <= 1e-5 * aux_ref.abs(),
        "{tag} aux {} vs {aux_ref}",
        run.aux
    );
    assert_eq!(run.dropped, r.dropped, "{tag} dropped");
    let kept: usize = run.tokens_per_expert.iter().sum();
    assert_eq!(kept + r.dropped, B * T * cfg.top_k, "{tag}");
    let wts = Tensor::from_vec(data(B * T * D, 2), (B * T, D), &Device::Cpu).unwrap();
    let loss = (r.out.mul(&wts).unwrap().sum_all().unwrap() + &r.aux).unwrap();
    let grads = loss.backward().unwrap();
    for ((name, _, g), (_, var)) in run.params.iter().zip(&vars) {
        close(
            &format!("{tag} grad {name}"),
            g,
            grads.get(var.as_tensor()).unwrap(),
            1e-4,
        );
    }
    close(
        &format!("{tag} grad x"),
        &run.dx.reshape((B * T, D)).unwrap(),
        grads.get(x.as_tensor()).unwrap(),
        1e-4,
    );
}

#[test]
fn layer_matches_reference_single_device_and_expert_parallel() {
    // Top-2 over 6 experts: ep=4 holds 2, 2, 2, 0 (torch.chunk; the last rank owns none but
    // still sends its tokens and joins every exchange); dp=2 x ep=2 holds 3, 3.
    let mut top2 = MoeConfig::new(6, 2);
    top2.aux_loss_coef = 0.1;
    for dims in [vec![("dp", 1)], vec![("ep", 4)], vec![("dp", 2), ("ep", 2)]] {
        check_layer(&dims, &top2, false);
    }
    // Top-1 (Switch) over 5 experts, SwiGLU: ep=2 holds 3 and 2, over the RMA transport too.
    let mut top1 = MoeConfig::new(5, 1);
    top1.aux_loss_coef = 0.1;
    check_layer(&[("dp", 1)], &top1, true);
    check_layer(&[("ep", 2), ("dp", 2)], &top1, true);
    top1.dispatch = DispatchKind::Rma;
    check_layer(&[("ep", 4)], &top1, true);
}

#[test]
fn capacity_drops_match_reference_on_every_mesh() {
    // A small capacity (ceil(0.5 * 21 * 2 / 4) = 6 per expert) drops assignments; the
    // admission is global, so ep=4 drops exactly what one device drops.
    let mut cfg = MoeConfig::new(4, 2);
    cfg.capacity_factor = Some(0.5);
    cfg.aux_loss_coef = 0.05;
    let one = run_layer(&[("dp", 1)], &cfg, false).unwrap();
    assert!(one.dropped > 0, "the capacity must drop something");
    assert!(
        one.tokens_per_expert.iter().all(|&c| c <= 6),
        "{:?}",
        one.tokens_per_expert
    );
    check_layer(&[("dp", 1)], &cfg, false);
    check_layer(&[("ep", 4)], &cfg, false);
    cfg.dispatch = DispatchKind::Rma;
    check_layer(&[("dp", 2), ("ep", 2)], &cfg, false);
}

fn gpt_cfg(experts: usize, top_k: usize) -> GptConfig {
    let mut moe = MoeConfig::new(experts, top_k);
    moe.every = 2;
    GptConfig {
        vocab: 48,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        seq_len: 8,
        moe: Some(moe),
        ..GptConfig::tiny()
    }
}

/// Losses (forward value including the balancing loss) of `steps` AdamW steps on `dims`.
fn train(dims: &[(&str, usize)], cfg: &GptConfig, steps: usize) -> Vec<f32> {
    train_with(dims, cfg, steps, TpPlan::new())
}

/// [`train`] with a tensor-parallel plan (it applies where the mesh has `tp`).
fn train_with(dims: &[(&str, usize)], cfg: &GptConfig, steps: usize, plan: TpPlan) -> Vec<f32> {
    let world: usize = dims.iter().map(|d| d.1).product();
    let dims: Vec<(String, usize)> = dims.iter().map(|(n, s)| (n.to_string(), *s)).collect();
    let cfg = cfg.clone();
    let corpus = Corpus::synthetic(cfg.vocab, 2048, 5);
    let out = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(60))
        .launch(move |comm| -> R<Vec<f32>> {
            let d: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
            let mesh = DeviceMesh::new(comm, &d)?;
            let (gpt, store) = Gpt::new(&cfg, &mesh, &plan, 7, DType::F32)?;
            assert_eq!(gpt.moe_layers().count(), 1);
            // Where the mesh has `tp`, the attention weights really are tensor-parallel: a
            // Shard over tp, a local piece smaller than the global weight.
            if let Some(tp) = mesh.dim_names().iter().position(|n| *n == "tp") {
                let attn: Vec<_> = store
                    .params()
                    .iter()
                    .filter(|p| p.name.contains(".attn.") && p.name.ends_with("weight"))
                    .collect();
                assert!(!attn.is_empty(), "no attention weights");
                for p in attn {
                    assert!(
                        matches!(p.tensor.placements()[tp], Placement::Shard(_)),
                        "{}: {:?}",
                        p.name,
                        p.tensor.placements()
                    );
                    let local: usize = p.var.elem_count();
                    let global: usize = p.tensor.shape().iter().product();
                    assert_eq!(local * 2, global, "{}", p.name);
                }
            }
            let mut opt = candle_nn::AdamW::new(
                store.vars(),
                candle_nn::ParamsAdamW {
                    lr: 3e-3,
                    ..Default::default()
                },
            )?;
            let all_r = vec![Placement::Replicate; mesh.ndim()];
            let mut losses = Vec::new();
            for step in 0..steps {
                let (x, y) = common::gpt_batch(&corpus, step, (4, cfg.seq_len, 11), &gpt, &mesh)?;
                let loss = gpt.loss(&x, &y)?.redistribute(&all_r)?;
                assert!(gpt.last_aux_loss().is_some());
                let grads = loss.backward()?;
                opt.step(&grads)?;
                losses.push(loss.to_local().to_scalar::<f32>()?);
            }
            Ok(losses)
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn gpt_with_moe_trains_like_single_device() {
    // Dropless top-2 over 6 experts in block 1 (every=2); 6 AdamW steps: each step's loss
    // depends on every earlier gradient, so matching losses check the backward too.
    let cfg = gpt_cfg(6, 2);
    let steps = 6;
    let reference = train(&[("dp", 1)], &cfg, steps);
    assert!(reference[steps - 1] < reference[0], "{reference:?}");
    // The last: Megatron TP over `tp` on the attention (and dense MLP) blocks beside the
    // experts over `ep`.
    for dims in [
        vec![("ep", 4)],
        vec![("dp", 2), ("ep", 2)],
        vec![("ep", 2), ("tp", 2)],
    ] {
        let losses = train_with(&dims, &cfg, steps, TpPlan::gpt(false));
        if let Err(e) = compare_series_f32("loss", &losses, &reference).and_then(|d| d.within(1e-4))
        {
            panic!("{dims:?}: {e} ({losses:?} vs {reference:?})");
        }
    }
}

fn config_error(
    dims: Vec<(&'static str, usize)>,
    per_rank: impl Fn(usize) -> MoeConfig + Send + Sync + 'static,
) -> Vec<String> {
    let world: usize = dims.iter().map(|d| d.1).product();
    let per_rank = Arc::new(per_rank);
    LocalWorld::new(world)
        .with_timeout(Duration::from_secs(20))
        .launch(move |comm: Comm| -> R<String> {
            let rank = comm.rank();
            let mesh = DeviceMesh::new(comm, &dims)?;
            match MoeGroups::new(&mesh, &per_rank(rank), D, H) {
                Ok(_) => Err("accepted".into()),
                Err(ParallelError::Moe(e)) => Ok(e.to_string()),
                Err(e) => Err(format!("untyped: {e}").into()),
            }
        })
        .unwrap()
}

#[test]
fn bad_settings_are_typed_errors_naming_the_rank() {
    let e = config_error(vec![("ep", 2)], |_| MoeConfig::new(4, 5));
    assert!(e[1].contains("rank 1") && e[1].contains("top_k 5"), "{e:?}");
    let e = config_error(vec![("ep", 4)], |_| MoeConfig::new(3, 1));
    assert!(
        e[2].contains("rank 2") && e[2].contains("only 3 experts"),
        "{e:?}"
    );
    // Rank 2 was built with 7 experts: every rank names it.
    let e = config_error(vec![("dp", 2), ("ep", 2)], |r| {
        MoeConfig::new(if r == 2 { 7 } else { 8 }, 2)
    });
    for (r, msg) in e.iter().enumerate() {
        assert!(
            msg.contains(&format!("(rank {r})")) && msg.contains("rank 2 disagrees"),
            "{msg}"
        );
        assert!(msg.contains("experts is 7"), "{msg}");
    }
    // Token counts that do not add up: rank 3 claims 5 tokens but routes 4.
    let out = LocalWorld::new(4)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm: Comm| -> R<String> {
            let rank = comm.rank();
            let mesh = DeviceMesh::new(comm, &[("dp", 2), ("ep", 2)])?;
            let groups = MoeGroups::new(&mesh, &MoeConfig::new(4, 1), D, H)?;
            let mut local = LocalRouting::new(vec![0, 1, 2, 3], 4, 1, 4)?;
            if rank == 3 {
                local.n_tokens = 5;
            }
            match groups.count_table("blocks.0.moe", 0, &local) {
                Ok(_) => Err("accepted".into()),
                Err(ParallelError::Moe(e @ MoeError::TokenCounts { .. })) => Ok(e.to_string()),
                Err(e) => Err(format!("other error: {e}").into()),
            }
        })
        .unwrap();
    for (r, msg) in out.iter().enumerate() {
        assert!(
            msg.contains(&format!("(rank {r})")) && msg.contains("rank 3 sent bad routing counts"),
            "{msg}"
        );
    }
}

#[test]
fn comm_debug_mode_shows_dispatch_and_combine_with_bytes() {
    // ep=4, dropless top-2: over the ranks the forward dispatch sends every assignment's row
    // once (B*T*k rows of D f32), the combine sends them back, and backward runs each reverse
    // once. Over RMA the same bytes are recorded as rma_put.
    let row = (D * 4) as u64;
    let total = (B * T * 2) as u64 * row;
    for (dispatch, kind) in [
        (DispatchKind::AllToAllV, "all_to_all_v"),
        (DispatchKind::Rma, "rma_put"),
    ] {
        let mut cfg = MoeConfig::new(6, 2);
        cfg.dispatch = dispatch;
        let runs = run_layer_all(&[("ep", 4)], &cfg, false).unwrap();
        let bytes = |label: &str, phase: Phase| -> u64 {
            runs.iter()
                .flat_map(|r| &r.records)
                .filter(|c| {
                    c.kind == kind
                        && c.phase == phase
                        && c.mesh_dim == "ep"
                        && c.label.as_deref() == Some(label)
                })
                .map(|c| c.bytes)
                .sum()
        };
        for label in ["moe.dispatch", "moe.combine"] {
            for phase in [Phase::Forward, Phase::Backward] {
                assert_eq!(bytes(label, phase), total, "{kind} {label} {phase:?}");
            }
        }
        for r in &runs {
            let n = |phase| {
                r.records
                    .iter()
                    .filter(|c| c.kind == kind && c.phase == phase)
                    .count()
            };
            assert_eq!(
                (n(Phase::Forward), n(Phase::Backward)),
                (2, 2),
                "{:?}",
                r.records
            );
            // The count exchange: one all_gather of [key, tokens, k x E counts] per rank.
            let counts: Vec<&CollectiveRecord> = r
                .records
                .iter()
                .filter(|c| c.label.as_deref() == Some("moe.counts"))
                .collect();
            assert_eq!(counts.len(), 1, "{counts:?}");
            assert_eq!(counts[0].bytes, (4 * (2 + 2 * 6) * 4) as u64);
        }
    }
}

/// FSDP over `dp` composed with experts over `ep` (mesh dp=2 x ep=2): every parameter, expert
/// weights included, is row-sharded by FSDP over dp beside its ep placement, and the trainer's
/// losses (dropless top-2, SGD so a wrong gradient scale shows) match one device's per step.
#[test]
fn fsdp_over_dp_with_experts_over_ep_trains_like_single_device() {
    use candle_dtensor_train::trainer::TrainConfig;
    let mut c = TrainConfig::new(gpt_cfg(6, 2), TpPlan::gpt(false));
    c.steps = 5;
    c.batch = 4;
    c.corpus_tokens = 2048;
    c.seed = 5;
    c.sgd = true;
    c.lr = 0.3;
    let run = |dims: &[(&str, usize)], c: &TrainConfig| {
        common::train_on_mesh(dims, c, Duration::from_secs(60))
    };
    let reference = run(&[("dp", 1)], &c);
    assert!(
        reference.losses[c.steps - 1] < reference.losses[0],
        "{:?}",
        reference.losses
    );
    let mut f = c.clone();
    f.fsdp = Some(common::fsdp_over("dp", None));
    let sharded = run(&[("dp", 2), ("ep", 2)], &f);
    assert_eq!(sharded.losses.len(), reference.losses.len());
    // FSDP ran: reduce_scatters in the backward, and this rank holds at most half of the
    // parameters (FSDP halves every one over dp; ep halves the experts again). Without FSDP
    // the dense weights would be whole here: more than half.
    assert!(
        sharded.collectives.contains_key("reduce_scatter"),
        "{:?}",
        sharded.collectives
    );
    assert!(
        sharded.param_bytes * 2 <= reference.param_bytes,
        "{} vs {}",
        sharded.param_bytes,
        reference.param_bytes
    );
    if let Err(e) =
        compare_series_f32("loss", &sharded.losses, &reference.losses).and_then(|d| d.within(1e-4))
    {
        panic!("{e} ({:?} vs {:?})", sharded.losses, reference.losses);
    }
}
