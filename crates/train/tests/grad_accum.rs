//! Gradient accumulation (`Trainer::step_accum` / `forward_backward_accum`, the GPT run's
//! `TrainConfig::grad_accum`): the same tokens split into 1, 2 or 4 micro-batches (or into
//! micro-batches of unequal sizes) give the same gradients and the same losses, within 1e-6
//! relative in f32, on one device, plain data parallelism, FSDP, FSDP x TP, HSDP and TP; FSDP's
//! reduce-scatters and HSDP's replicate all-reduces per step do not grow with the number of
//! micro-batches; a bad setting fails on every rank before any step.
use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::debug::CommDebugMode;
use candle_dtensor_kernels::compare::{check_series, compare_series_f32, max_abs_diff};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::fsdp_vb::reference_var_builder;
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::fit::{
    micro_batch_size, OptimizerKind, TrainVars, Trainer, TrainerConfig, TrainerError,
};
use candle_dtensor_train::trainer::{train_rank, RankReport};

#[path = "common/mod.rs"]
mod common;
#[path = "common/user_mlp.rs"]
mod user_mlp;
use common::{fsdp_over, micro_gpt, short_run};
use user_mlp::{batch, model_and_trainer, no_wrap, Layout, Mlp, BATCH};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEED: u64 = 11;
const STEPS: usize = 3;
/// f32 results of differently split batches: the same sums in another order.
const TOL: f64 = 1e-6;
const TIMEOUT: Duration = Duration::from_secs(60);

/// What one rank saw of a run: each step's loss and gradient norm, the first step's gradient
/// of every parameter (name, values: this rank's var), and per step the collectives
/// (kind, mesh dim) -> count recorded by `CommDebugMode`.
struct Run {
    losses: Vec<f32>,
    norms: Vec<f64>,
    grads: Vec<(String, candle_core::Tensor)>,
    collectives: Vec<BTreeMap<(String, String), usize>>,
}

fn config() -> TrainerConfig {
    TrainerConfig {
        // SGD: a wrong gradient scale changes the next losses (AdamW would hide it).
        optimizer: OptimizerKind::Sgd,
        lr: 0.3,
        grad_norm_every: 1,
        tokens_per_step: BATCH,
        ..TrainerConfig::default()
    }
}

/// One rank's run of the user's model: this rank's rows split into micro-batches of
/// `split[i]` rows each (`split` sums to the rank's rows).
fn rank_run(mesh: Option<&DeviceMesh>, layout: Layout, split: &[usize]) -> R<Run> {
    let coord = mesh.map(DeviceMesh::coordinate).unwrap_or_default();
    let (dpi, dpn) = layout.data_parallel(&coord);
    let rows = BATCH / dpn;
    assert_eq!(split.iter().sum::<usize>(), rows, "{layout:?} {split:?}");
    let (model, mut trainer) = model_and_trainer(mesh, layout, SEED, config())?;
    let mut run = Run {
        losses: Vec::new(),
        norms: Vec::new(),
        grads: Vec::new(),
        collectives: Vec::new(),
    };
    // Micro-batch i: rows [start_i, start_i + split[i]) of this rank's rows.
    let starts: Vec<usize> = split
        .iter()
        .scan(dpi * rows, |s, &n| {
            let start = *s;
            *s += n;
            Some(start)
        })
        .collect();
    for step in 0..STEPS {
        let mode = CommDebugMode::start();
        let g = trainer.forward_backward_accum(split, |i| {
            let (x, y) = batch(step, starts[i]..starts[i] + split[i])?;
            model.loss(&x, &y)
        })?;
        let mut counts = BTreeMap::new();
        // Every phase: HSDP's replicate all-reduce is issued inside the backward when its
        // reduce-scatter finished early, else by `finish_backward` after it.
        for r in mode.records() {
            *counts
                .entry((r.kind.to_string(), r.mesh_dim.clone()))
                .or_insert(0) += 1;
        }
        drop(mode);
        run.collectives.push(counts);
        assert_eq!(g.micro_batches(), split.len());
        if step == 0 {
            for p in trainer.params() {
                if let Some(t) = g.grads().get(&p.var) {
                    run.grads.push((p.name.clone(), t.clone()));
                }
            }
        }
        let info = trainer.apply(g)?;
        assert_eq!(info.micro_batches, split.len());
        run.losses.push(info.loss);
        run.norms.push(
            info.grad_norm
                .ok_or("grad_norm_every = 1 computes the norm")?,
        );
    }
    Ok(run)
}

/// Every rank's run of `layout` with `split`.
fn runs(layout: Layout, split: &[usize]) -> Vec<Run> {
    if layout == Layout::One {
        return vec![rank_run(None, layout, split).unwrap_or_else(|e| panic!("one device: {e}"))];
    }
    let dims = layout.dims();
    let n = dims.iter().map(|d| d.1).product();
    LocalWorld::new(n)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            rank_run(Some(&mesh), layout, split)
        })
        .unwrap_or_else(|e| panic!("{layout:?} {split:?}: {e}"))
}

/// `got` matches `want` within [`TOL`]: losses and norms relative per step, gradients
/// relative to the largest element of each reference gradient (NaN or infinity fails).
fn assert_same(what: &str, got: &Run, want: &Run) {
    compare_series_f32(&format!("{what} loss"), &got.losses, &want.losses)
        .and_then(|d| d.within(TOL))
        .unwrap_or_else(|e| panic!("{e}"));
    check_series(&format!("{what} grad norm"), &got.norms, &want.norms, TOL)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got.grads.len(), want.grads.len(), "{what}: gradients");
    assert!(!want.grads.is_empty(), "{what}: no gradients");
    for ((n, g), (m, w)) in got.grads.iter().zip(&want.grads) {
        assert_eq!(n, m, "{what}");
        let diff = max_abs_diff(g, w).unwrap();
        let scale = w.abs().unwrap().max_keepdim(0).unwrap();
        let scale = scale.flatten_all().unwrap().max(0).unwrap();
        let scale = f64::from(scale.to_scalar::<f32>().unwrap()).max(1e-30);
        assert!(
            diff.is_finite() && diff / scale <= TOL,
            "{what}: gradient of {n}: max |diff| {diff:e} is {:e} of its largest element \
             (tolerance {TOL:e})",
            diff / scale
        );
    }
}

#[test]
fn users_model_same_gradients_whatever_the_split() {
    for layout in [
        Layout::One,
        Layout::Tp,
        Layout::Fsdp,
        Layout::FsdpTp,
        Layout::Hsdp,
    ] {
        let dpn = match layout {
            Layout::Fsdp | Layout::FsdpTp => 2,
            Layout::Hsdp => 4,
            Layout::One | Layout::Tp => 1,
        };
        let rows = BATCH / dpn;
        let reference = runs(layout, &[rows]);
        // Splits of this rank's rows: even ones (K = 2, 4 where they divide) and an uneven one
        // (micro-batches of different token counts: scaled by tokens, not by 1 / K).
        let mut splits: Vec<Vec<usize>> = [2, 4]
            .into_iter()
            .filter(|k| rows % k == 0)
            .map(|k| vec![rows / k; k])
            .collect();
        if rows >= 3 {
            splits.push(vec![1, rows - 1]);
        }
        assert!(!splits.is_empty());
        let k1 = &reference[0].collectives;
        for split in splits {
            let got = runs(layout, &split);
            assert_eq!(got.len(), reference.len());
            for (rank, (g, w)) in got.iter().zip(&reference).enumerate() {
                assert_same(&format!("{layout:?} split {split:?} rank {rank}"), g, w);
            }
            // Once per step: FSDP's reduce-scatters and HSDP's replicate all-reduces do not
            // grow with the micro-batches.
            let kk = &got[0].collectives;
            for step in 0..STEPS {
                for (kind, dim) in [
                    ("reduce_scatter", "dp"),
                    ("reduce_scatter", "shard"),
                    ("all_reduce", "replicate"),
                ] {
                    let key = (kind.to_string(), dim.to_string());
                    let (a, b) = (k1[step].get(&key), kk[step].get(&key));
                    assert_eq!(
                        a,
                        b,
                        "{layout:?} split {split:?} step {step}: {kind} over {dim} per step \
                         (K = 1: {a:?}, K = {}: {b:?})",
                        split.len()
                    );
                }
            }
            if matches!(layout, Layout::Fsdp | Layout::FsdpTp | Layout::Hsdp) {
                let dim = if layout == Layout::Hsdp {
                    "shard"
                } else {
                    "dp"
                };
                let rs = kk[0]
                    .get(&("reduce_scatter".to_string(), dim.to_string()))
                    .copied();
                // One per unit: norm, fc1, fc2, head.
                assert_eq!(rs, Some(4), "{layout:?} split {split:?}: {kk:?}");
                if layout == Layout::Hsdp {
                    let ar = kk[0].get(&("all_reduce".to_string(), "replicate".to_string()));
                    assert_eq!(ar, Some(&4), "{layout:?} split {split:?}: {kk:?}");
                }
            }
        }
    }
}

/// The GPT run (`train_rank`) with `grad_accum` micro-batches on `dims`: rank 0's report.
fn gpt(dims: &[(&str, usize)], fsdp: Option<(&str, Option<&str>)>, k: usize) -> RankReport {
    let mut c = short_run(micro_gpt(), TpPlan::gpt(false), STEPS, 5);
    c.sgd = true;
    c.lr = 0.5;
    c.grad_norm_every = 1;
    c.grad_accum = k;
    c.fsdp = fsdp.map(|(s, r)| fsdp_over(s, r));
    common::train_on_mesh(dims, &c, TIMEOUT)
}

fn backward_count(r: &RankReport, kind: &str) -> usize {
    r.collectives
        .get(kind)
        .and_then(|m| m.get("backward"))
        .copied()
        .unwrap_or(0)
}

#[test]
fn gpt_same_losses_whatever_the_split_and_reductions_once_per_step() {
    type Case = (
        &'static str,
        Vec<(&'static str, usize)>,
        Option<(&'static str, Option<&'static str>)>,
        Vec<usize>,
    );
    let cases: Vec<Case> = vec![
        ("one device", vec![("tp", 1)], None, vec![2, 4]),
        ("dp 2", vec![("dp", 2)], None, vec![2, 4]),
        ("fsdp 2", vec![("dp", 2)], Some(("dp", None)), vec![2, 4]),
        (
            "fsdp 2 x tp 2",
            vec![("dp", 2), ("tp", 2)],
            Some(("dp", None)),
            vec![2, 4],
        ),
        (
            "hsdp 2 x 2",
            vec![("replicate", 2), ("shard", 2)],
            Some(("shard", Some("replicate"))),
            vec![2],
        ),
    ];
    for (name, dims, fsdp, ks) in cases {
        let one = gpt(&dims, fsdp, 1);
        assert_eq!(one.losses.len(), STEPS);
        for k in ks {
            let got = gpt(&dims, fsdp, k);
            compare_series_f32(&format!("{name} K={k} loss"), &got.losses, &one.losses)
                .and_then(|d| d.within(TOL))
                .unwrap_or_else(|e| panic!("{e}"));
            let rs1 = backward_count(&one, "reduce_scatter");
            let rsk = backward_count(&got, "reduce_scatter");
            if fsdp.is_some() {
                assert!(rs1 > 0, "{name}: {:?}", one.collectives);
                assert_eq!(rsk, rs1, "{name}: reduce_scatters per step, K=1 vs K={k}");
            }
        }
    }
}

#[test]
fn bad_grad_accum_fails_on_every_rank_before_any_step() {
    for (k, batch) in [(0, 8), (3, 8)] {
        let mut c = short_run(micro_gpt(), TpPlan::gpt(false), STEPS, 5);
        c.batch = batch;
        c.grad_accum = k;
        let results = LocalWorld::new(2)
            .with_timeout(TIMEOUT)
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
                let mut steps = 0;
                let res = train_rank(&mesh, &c, |_| steps += 1);
                Ok((res.map(|_| ()).map_err(|e| e.to_string()), steps))
            })
            .unwrap();
        assert_eq!(results.len(), 2);
        for (rank, (res, steps)) in results.into_iter().enumerate() {
            let msg = res.expect_err("a bad grad_accum is an error");
            assert_eq!(steps, 0, "rank {rank}: no step runs");
            for want in [
                "grad_accum",
                &format!("{k} (global batch {batch})"),
                "divides the global batch",
            ] {
                assert!(msg.contains(want), "rank {rank}: {msg:?} lacks {want:?}");
            }
        }
    }
    // The library's own checks.
    assert!(matches!(
        micro_batch_size(8, 3),
        Err(TrainerError::Config {
            field: "grad_accum",
            ..
        })
    ));
    assert_eq!(micro_batch_size(8, 4).unwrap(), 2);
    let zero = TrainerConfig {
        grad_accum: 0,
        ..TrainerConfig::default()
    };
    assert!(matches!(
        zero.validate(),
        Err(TrainerError::Config {
            field: "grad_accum",
            ..
        })
    ));
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Mlp::new(vars.var_builder().unwrap(), None, &no_wrap).unwrap();
    let mut trainer = Trainer::new(vars, config()).unwrap();
    for tokens in [&[][..], &[0, 0][..]] {
        let e = trainer
            .forward_backward_accum(tokens, |_| {
                let (x, y) = batch(0, 0..BATCH)?;
                model.loss(&x, &y)
            })
            .err()
            .expect("no tokens is an error");
        assert!(e.to_string().contains("micro-batch tokens"), "{e}");
    }
}
