//! The library trainer (`train::fit::Trainer`) on a model a user writes with candle-nn (a
//! norm, a column- then row-parallel MLP with a residual, a head): trained under FSDP over
//! `dp=2`, FSDP x TP (`dp=2 x tp=2`), HSDP (`replicate=2 x shard=2`) and plain tensor
//! parallelism (`tp=2`) with the same trainer, it matches one device step by step (losses and
//! gradient norms within 1e-5 relative, learning rates exactly) with warmup, cosine decay and
//! clipping that scales every step. Bad settings fail before any step, naming the rule.
use std::cell::Cell;
use std::time::Duration;

use candle_core::{DType, Device};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_kernels::compare::{check_series, compare_series_f32};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::fsdp_vb::{reference_var_builder, FsdpVarMap};
use candle_dtensor_train::fit::{
    FitOptions, StepInfo, TrainVars, Trainer, TrainerConfig, TrainerError,
};
use candle_dtensor_train::schedule::{Decay, LrSchedule, ScheduleError, WeightDecay};

#[path = "common/user_mlp.rs"]
mod user_mlp;
use user_mlp::{batch, model_and_trainer, no_wrap, Layout, Mlp, BATCH};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEED: u64 = 7;
const STEPS: usize = 12;
/// Low enough that every step's gradient is scaled (asserted).
const CLIP: f64 = 0.05;
const TOL: f64 = 1e-5;

fn schedule() -> LrSchedule {
    LrSchedule::new(2e-2, 3, Decay::Cosine, STEPS, 1e-3).unwrap()
}

fn config() -> TrainerConfig {
    TrainerConfig {
        schedule: Some(schedule()),
        weight_decay: 0.1,
        decay_policy: WeightDecay::Matrices { embeddings: false },
        clip: Some(CLIP),
        tokens_per_step: BATCH,
        ..TrainerConfig::default()
    }
}

/// One device: the whole batch every step.
fn one_device(cfg: TrainerConfig) -> R<Vec<StepInfo>> {
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Mlp::new(vars.var_builder()?, None, &no_wrap)?;
    let mut trainer = Trainer::new(vars, cfg)?;
    let report = trainer.fit(
        STEPS,
        |step| batch(step, 0..BATCH),
        |(x, y)| model.loss(x, y),
        FitOptions::new(),
    )?;
    Ok(report.steps)
}

/// A rank's steps and the copies of each of its parameters, by name.
type RankRun = (Vec<StepInfo>, Vec<(String, usize)>);

/// One rank's run of `layout`.
fn rank_run(mesh: &DeviceMesh, layout: Layout) -> R<RankRun> {
    let coord = mesh.coordinate();
    // Data-parallel index and count: this rank's rows of the global batch.
    let (dpi, dpn) = layout.data_parallel(&coord);
    let rows = BATCH / dpn;
    let rows = dpi * rows..(dpi + 1) * rows;
    let (model, mut trainer) = model_and_trainer(Some(mesh), layout, SEED, config())?;
    let copies = trainer
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.copies))
        .collect();
    let report = trainer.fit(
        STEPS,
        |step| batch(step, rows.clone()),
        |(x, y)| model.loss(x, y),
        FitOptions::new(),
    )?;
    Ok((report.steps, copies))
}

/// Every rank's run of `layout`, by rank.
fn distributed(layout: Layout) -> Vec<RankRun> {
    let dims = layout.dims();
    let n = dims.iter().map(|d| d.1).product();
    LocalWorld::new(n)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            rank_run(&mesh, layout)
        })
        .unwrap_or_else(|e| panic!("{layout:?}: {e}"))
}

fn losses(s: &[StepInfo]) -> Vec<f32> {
    s.iter().map(|i| i.loss).collect()
}

fn norms(s: &[StepInfo]) -> Vec<f64> {
    s.iter()
        .map(|i| i.grad_norm.expect("clipping computes the norm every step"))
        .collect()
}

#[test]
fn every_layout_trains_the_users_model_as_one_device_does() {
    let one = one_device(config()).unwrap();
    assert_eq!(one.len(), STEPS);
    let want_lrs: Vec<f64> = (0..STEPS).map(|k| schedule().lr_at(k)).collect();
    assert_eq!(one.iter().map(|s| s.lr).collect::<Vec<_>>(), want_lrs);
    // Clipping happens at every step (the norm before clipping is above the threshold).
    for s in &one {
        assert!(
            s.grad_norm.unwrap() > CLIP,
            "step {}: {:?}",
            s.step,
            s.grad_norm
        );
        assert_eq!(s.tokens, BATCH);
    }
    assert!(
        one[STEPS - 1].loss < 0.8 * one[0].loss,
        "it trains: {:?}",
        losses(&one)
    );
    for layout in [Layout::Fsdp, Layout::FsdpTp, Layout::Hsdp, Layout::Tp] {
        let runs = distributed(layout);
        for (rank, (steps, copies)) in runs.iter().enumerate() {
            let what = format!("{layout:?} rank {rank}");
            compare_series_f32(&format!("{what} loss"), &losses(steps), &losses(&one))
                .and_then(|d| d.within(TOL))
                .unwrap_or_else(|e| panic!("{e}"));
            check_series(
                &format!("{what} gradient norm"),
                &norms(steps),
                &norms(&one),
                TOL,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                steps.iter().map(|s| s.lr).collect::<Vec<_>>(),
                want_lrs,
                "{what}"
            );
            // The copies the trainer worked out: a tensor-parallel piece is held once per
            // data-parallel shard; a parameter replicated over tp (the norm, the head, the
            // row-parallel bias) or over HSDP's replicate dim by each replica.
            let copies_of = |name: &str| copies.iter().find(|c| c.0 == name).unwrap().1;
            let (piece, replicated) = match layout {
                Layout::Fsdp => (1, 1),
                Layout::FsdpTp => (1, 2),
                Layout::Hsdp => (2, 2),
                Layout::Tp => (1, 2),
                Layout::One => (1, 1),
            };
            assert_eq!(copies_of("fc1.weight"), piece, "{what}: {copies:?}");
            assert_eq!(copies_of("fc2.weight"), piece, "{what}: {copies:?}");
            assert_eq!(copies_of("fc2.bias"), replicated, "{what}: {copies:?}");
            assert_eq!(copies_of("norm.weight"), replicated, "{what}: {copies:?}");
            assert_eq!(copies_of("head.weight"), replicated, "{what}: {copies:?}");
        }
    }
}

#[test]
fn clipping_changes_training_and_the_norm_is_the_gradients_norm() {
    // Without clipping the run differs (the clip of the other test is not a no-op).
    let clipped = one_device(config()).unwrap();
    let free = one_device(TrainerConfig {
        clip: None,
        grad_norm_every: 1,
        ..config()
    })
    .unwrap();
    assert_eq!(clipped[0].loss, free[0].loss, "same first forward");
    assert_eq!(clipped[0].grad_norm, free[0].grad_norm, "same first norm");
    assert_ne!(clipped[STEPS - 1].loss, free[STEPS - 1].loss);
    // The trainer's norm is sqrt(sum of squared gradients), computed here by hand.
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Mlp::new(vars.var_builder().unwrap(), None, &no_wrap).unwrap();
    let mut trainer = Trainer::new(
        vars,
        TrainerConfig {
            clip: None,
            grad_norm_every: 1,
            ..config()
        },
    )
    .unwrap();
    let (x, y) = batch(0, 0..BATCH).unwrap();
    let g = trainer.forward_backward(|| model.loss(&x, &y)).unwrap();
    let mut sq = 0f64;
    let mut with_grad = 0;
    for v in map.all_vars() {
        let grad = g
            .grads()
            .get(v.as_tensor())
            .expect("every parameter trains");
        sq += grad
            .to_dtype(DType::F64)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        with_grad += 1;
    }
    assert_eq!(
        with_grad, 7,
        "the norm's weight; fc1, fc2, head: weights and biases"
    );
    let norm = g.grad_norm().unwrap();
    assert!(
        (norm - sq.sqrt()).abs() <= 1e-12 * norm,
        "{norm} vs {}",
        sq.sqrt()
    );
    assert!(!g.clipped());
    let info = trainer.apply(g).unwrap();
    assert_eq!(info.grad_norm, Some(norm));
    assert_eq!(trainer.steps_done(), 1);
}

#[test]
fn a_warmup_longer_than_the_run_is_refused_before_any_step() {
    // A schedule built field by field, past LrSchedule::new's check: Trainer::new refuses it.
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Mlp::new(vars.var_builder().unwrap(), None, &no_wrap).unwrap();
    let literal = LrSchedule {
        lr: 1e-2,
        warmup: 20,
        decay: Decay::Cosine,
        steps: 10,
        min_lr: 0.0,
    };
    let err = Trainer::new(
        vars,
        TrainerConfig {
            schedule: Some(literal),
            ..config()
        },
    )
    .err()
    .expect("a warmup of 20 in a 10-step schedule");
    assert!(
        matches!(
            err,
            TrainerError::Schedule(ScheduleError::WarmupTooLong {
                warmup: 20,
                steps: 10
            })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("rule: warmup <= steps"), "{err}");

    // A valid schedule (warmup 8 of 10 steps) and a run of 5 steps: fit refuses to start.
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model2 = Mlp::new(vars.var_builder().unwrap(), None, &no_wrap).unwrap();
    let mut trainer = Trainer::new(
        vars,
        TrainerConfig {
            schedule: Some(LrSchedule::new(1e-2, 8, Decay::Cosine, 10, 0.0).unwrap()),
            ..config()
        },
    )
    .unwrap();
    let before: Vec<Vec<f32>> = map
        .all_vars()
        .iter()
        .map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    let batches = Cell::new(0);
    let err = trainer
        .fit(
            5,
            |step| {
                batches.set(batches.get() + 1);
                batch(step, 0..BATCH)
            },
            |(x, y)| model2.loss(x, y),
            FitOptions::new(),
        )
        .expect_err("warmup 8 > 5 steps");
    assert!(
        matches!(
            err,
            TrainerError::Schedule(ScheduleError::WarmupTooLong {
                warmup: 8,
                steps: 5
            })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("warmup <= steps"), "{err}");
    assert_eq!(batches.get(), 0, "no batch was drawn");
    assert_eq!(trainer.steps_done(), 0);
    let after: Vec<Vec<f32>> = map
        .all_vars()
        .iter()
        .map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    assert_eq!(before, after, "no parameter moved");
    drop(model);
}

#[test]
fn bad_settings_and_untracked_parameters_are_named() {
    let make = |cfg: TrainerConfig| -> Result<Trainer, TrainerError> {
        let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
        let vars = TrainVars::local(None, &map, vb);
        let _model = Mlp::new(vars.var_builder()?, None, &no_wrap)?;
        Trainer::new(vars, cfg)
    };
    for (cfg, field) in [
        (
            TrainerConfig {
                clip: Some(0.0),
                ..config()
            },
            "clip",
        ),
        (
            TrainerConfig {
                beta1: 1.0,
                ..config()
            },
            "beta1",
        ),
        (
            TrainerConfig {
                lr: f64::NAN,
                ..config()
            },
            "lr",
        ),
    ] {
        match make(cfg) {
            Err(TrainerError::Config { field: f, .. }) => assert_eq!(f, field),
            Err(e) => panic!("{field}: {e}"),
            Ok(_) => panic!("{field}: accepted"),
        }
    }
    // An FSDP layer built from the map's own VarBuilder, not the trainer's: its tensor-parallel
    // piece would be unknown, so the trainer refuses it by name.
    let err = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> R<String> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
            let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
            let map = FsdpVarMap::new(&fsdp, SEED);
            let vars = TrainVars::fsdp(&mesh, &fsdp, &map, DType::F32);
            let _l1 = candle_nn::linear(4, 8, vars.var_builder()?.pp("l1"))?;
            let _l2 = candle_nn::linear(8, 2, map.var_builder(DType::F32).pp("l2"))?;
            Ok(match Trainer::new(vars, config()) {
                Err(TrainerError::Params(m)) => m,
                Err(e) => format!("another error: {e}"),
                Ok(_) => "accepted".into(),
            })
        })
        .unwrap();
    for m in err {
        assert!(
            m.contains("l2.weight") && m.contains("l2.bias") && !m.contains("l1."),
            "{m}"
        );
    }
    // The evaluation closure runs and its global mean is recorded after every 4 steps and the
    // last; an evaluation period of 0 is refused.
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Mlp::new(vars.var_builder().unwrap(), None, &no_wrap).unwrap();
    let mut trainer = Trainer::new(vars, config()).unwrap();
    let held_out = batch(1000, 0..BATCH).unwrap();
    let e = trainer
        .fit(
            STEPS,
            |step| batch(step, 0..BATCH),
            |(x, y)| model.loss(x, y),
            FitOptions::new().eval_every(0, || model.loss(&held_out.0, &held_out.1)),
        )
        .expect_err("eval every 0");
    assert!(
        matches!(
            e,
            TrainerError::Config {
                field: "eval every",
                ..
            }
        ),
        "{e}"
    );
    let mut seen = 0;
    let report = trainer
        .fit(
            STEPS - 2,
            |step| batch(step, 0..BATCH),
            |(x, y)| model.loss(x, y),
            FitOptions::new()
                .eval_every(4, || model.loss(&held_out.0, &held_out.1))
                .on_step(|_| seen += 1),
        )
        .unwrap();
    assert_eq!(seen, STEPS - 2);
    let at: Vec<usize> = report.eval_losses.iter().map(|e| e.0).collect();
    assert_eq!(at, [4, 8, 10]);
    let direct = model
        .loss(&held_out.0, &held_out.1)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    // The last evaluation ran at the parameters the run ended with.
    assert_eq!(report.eval_losses[2].1, direct);
}

/// The gradients of the first step of one device under `clip`, each flattened, in the
/// trainer's parameter order, with the norm before clipping and whether it clipped.
fn first_grads(clip: Option<f64>) -> R<(Vec<Vec<f32>>, f64, bool)> {
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Mlp::new(vars.var_builder()?, None, &no_wrap)?;
    // By name: the map's own order is a hash map's.
    let mut named: Vec<(String, candle_core::Var)> = map
        .data()
        .lock()
        .map_err(|_| "a poisoned var map")?
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let params: Vec<candle_core::Var> = named.into_iter().map(|(_, v)| v).collect();
    let mut trainer = Trainer::new(
        vars,
        TrainerConfig {
            clip,
            grad_norm_every: 1,
            ..config()
        },
    )?;
    let (x, y) = batch(0, 0..BATCH)?;
    let g = trainer.forward_backward(|| model.loss(&x, &y))?;
    let grads = params
        .iter()
        .map(|p| -> R<Vec<f32>> {
            Ok(g.grads()
                .get(p)
                .ok_or("a parameter without a gradient")?
                .flatten_all()?
                .to_vec1::<f32>()?)
        })
        .collect::<R<Vec<_>>>()?;
    Ok((grads, g.grad_norm().ok_or("no norm")?, g.clipped()))
}

#[test]
fn clipping_on_the_device_scales_by_max_over_norm_and_leaves_small_gradients_alone() -> R<()> {
    let (free, norm, clipped) = first_grads(None)?;
    assert!(!clipped && norm.is_finite() && norm > 0.0);
    // A threshold above the norm: the gradients are untouched, bit for bit.
    let (same, n2, c2) = first_grads(Some(norm * 2.0))?;
    assert!(!c2 && n2 == norm);
    for (a, b) in free.iter().zip(&same) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    // Below it: every element times max / (norm + 1e-6), the f64 factor rounded to f32 once.
    let max = norm / 3.0;
    let (scaled, n3, c3) = first_grads(Some(max))?;
    assert!(c3 && n3 == norm);
    let factor = (max / (norm + 1e-6)) as f32;
    for (a, b) in free.iter().zip(&scaled) {
        for (x, y) in a.iter().zip(b) {
            assert_eq!((x * factor).to_bits(), y.to_bits(), "{x} * {factor} vs {y}");
        }
    }
    Ok(())
}

/// A model whose first layers candle-nn cuts from the graph (its fused `RmsNorm` forward has no
/// backward): only `out` learns on one device.
struct Cut {
    inp: user_mlp::Layer,
    norm: user_mlp::Layer,
    out: user_mlp::Layer,
}

impl Cut {
    fn new(
        vb: candle_nn::VarBuilder,
        wrap: &dyn Fn(&str, user_mlp::Layer) -> candle_core::Result<user_mlp::Layer>,
    ) -> candle_core::Result<Cut> {
        use user_mlp::{Layer, D, OUT};
        Ok(Cut {
            inp: wrap(
                "inp",
                Layer(Box::new(candle_nn::linear(D, D, vb.pp("inp"))?)),
            )?,
            norm: wrap(
                "norm",
                Layer(Box::new(candle_nn::rms_norm(D, 1e-5, vb.pp("norm"))?)),
            )?,
            out: wrap(
                "out",
                Layer(Box::new(candle_nn::linear(D, OUT, vb.pp("out"))?)),
            )?,
        })
    }

    fn loss(
        &self,
        x: &candle_core::Tensor,
        y: &candle_core::Tensor,
    ) -> candle_core::Result<candle_core::Tensor> {
        use candle_core::Module;
        let h = self.norm.forward(&self.inp.forward(x)?)?;
        candle_nn::loss::mse(&self.out.forward(&h)?, y)
    }
}

/// The values of every parameter of `trainer` (this rank's pieces), by name.
fn values(trainer: &Trainer) -> R<Vec<(String, Vec<f32>)>> {
    let mut v = trainer
        .params()
        .iter()
        .map(|p| {
            Ok((
                p.name.clone(),
                p.var.as_tensor().flatten_all()?.to_vec1::<f32>()?,
            ))
        })
        .collect::<R<Vec<_>>>()?;
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// Under FSDP the trainer reads the gradient-presence flags together with the loss: until then
/// the cut parameters carry zero gradients (under clipping, which runs on the device before
/// the read), and they must leave before the optimizer step, or AdamW's decay would move them.
/// As on one device: the same losses, and the cut parameters untouched.
#[test]
fn parameters_cut_from_the_graph_stay_untouched_under_fsdp_as_on_one_device() -> R<()> {
    const CUT_STEPS: usize = 4;
    let cut = ["inp.bias", "inp.weight", "norm.weight"];
    // One device.
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let vars = TrainVars::local(None, &map, vb);
    let model = Cut::new(vars.var_builder()?, &no_wrap)?;
    let mut trainer = Trainer::new(vars, config())?;
    let before = values(&trainer)?;
    let one = trainer
        .fit(
            CUT_STEPS,
            |step| batch(step, 0..BATCH),
            |(x, y)| model.loss(x, y),
            FitOptions::new(),
        )?
        .steps;
    let after = values(&trainer)?;
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        assert_eq!(
            cut.contains(&name.as_str()),
            a == b,
            "one device: {name} should change only if it is not cut"
        );
    }
    // FSDP over dp=2, each layer a unit.
    let runs = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
            let rank = mesh.rank();
            let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
            let map = FsdpVarMap::new(&fsdp, SEED);
            let vars = TrainVars::fsdp(&mesh, &fsdp, &map, DType::F32);
            let wrap = |key: &str, l: user_mlp::Layer| -> candle_core::Result<user_mlp::Layer> {
                Ok(user_mlp::Layer(Box::new(map.wrap(key, l)?)))
            };
            let model = Cut::new(vars.var_builder()?, &wrap)?;
            let mut trainer = Trainer::new(vars, config())?;
            let before = values(&trainer)?;
            let rows = rank * BATCH / 2..(rank + 1) * BATCH / 2;
            let steps = trainer
                .fit(
                    CUT_STEPS,
                    |step| batch(step, rows.clone()),
                    |(x, y)| model.loss(x, y),
                    FitOptions::new(),
                )?
                .steps;
            Ok((steps, before, values(&trainer)?))
        })
        .map_err(|e| e.to_string())?;
    for (rank, (steps, before, after)) in runs.iter().enumerate() {
        compare_series_f32(
            &format!("rank {rank}: losses vs one device"),
            &losses(steps),
            &losses(&one),
        )
        .and_then(|d| d.within(TOL))
        .map_err(|e| e.to_string())?;
        for ((name, b), (_, a)) in before.iter().zip(after) {
            if cut.contains(&name.as_str()) {
                assert_eq!(a, b, "rank {rank}: the cut {name} moved under FSDP");
            } else if !b.is_empty() {
                assert_ne!(a, b, "rank {rank}: {name} did not train");
            }
        }
    }
    Ok(())
}

/// A run's parameters by name, its losses and whether each step clipped.
type ClippedRun = (Vec<(String, Vec<f32>)>, Vec<f32>, Vec<bool>);

/// `layout`'s parameters (this rank's) and losses after `STEPS` clipped steps, driven either
/// by `Trainer::step` (clipping left to AdamW's update: the coefficient multiplies each
/// gradient as the update reads it) or by `forward_backward` + `apply` (the gradients clipped
/// first, as a caller sees them).
fn clipped_run(mesh: Option<&DeviceMesh>, layout: Layout, fused: bool) -> R<ClippedRun> {
    let (dpi, dpn) = match mesh {
        Some(m) => layout.data_parallel(&m.coordinate()),
        None => (0, 1),
    };
    let rows = BATCH / dpn;
    let rows = dpi * rows..(dpi + 1) * rows;
    let (model, mut trainer) = model_and_trainer(mesh, layout, SEED, config())?;
    let (mut losses, mut clipped) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (x, y) = batch(step, rows.clone())?;
        let info = if fused {
            trainer.step(|| model.loss(&x, &y))?
        } else {
            let g = trainer.forward_backward(|| model.loss(&x, &y))?;
            trainer.apply(g)?
        };
        losses.push(info.loss);
        clipped.push(info.grad_norm.ok_or("clipping computes the norm")? > CLIP);
    }
    Ok((values(&trainer)?, losses, clipped))
}

/// Clipping inside the optimizer's update (`Trainer::step`, `fit`, train_gpt's loop) gives the
/// bits of clipping the gradients first (`forward_backward` then `apply`), on one device and
/// under FSDP over `dp=2`, every step clipped. Fails if the deferred coefficient is dropped
/// (the first step's update differs) or applied twice.
#[test]
fn clipping_fused_into_the_update_gives_the_bits_of_clipping_first() -> R<()> {
    let one = |fused| clipped_run(None, Layout::One, fused);
    let (a, b) = (one(true)?, one(false)?);
    assert!(a.2.iter().all(|&c| c), "every step clips: {:?}", a.2);
    assert_eq!(a.1, b.1, "one device: losses");
    assert_eq!(a.0, b.0, "one device: parameters");
    let fsdp = |fused| {
        LocalWorld::new(2)
            .with_timeout(Duration::from_secs(60))
            .launch(move |comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &Layout::Fsdp.dims())?;
                clipped_run(Some(&mesh), Layout::Fsdp, fused)
            })
            .map_err(|e| format!("fsdp: {e}"))
    };
    let (a, b) = (fsdp(true)?, fsdp(false)?);
    for (rank, (a, b)) in a.iter().zip(&b).enumerate() {
        assert!(a.2.iter().all(|&c| c), "rank {rank}: every step clips");
        assert_eq!(a.1, b.1, "rank {rank}: losses");
        assert_eq!(a.0, b.0, "rank {rank}: parameters");
    }
    Ok(())
}

/// A scalar (rank-0) parameter trains under clipping whether the gradients are clipped before
/// `apply` (`forward_backward`) or inside AdamW's update (`step`), to the same bits: the clip
/// factor once turned the scalar's gradient into `[1]`, which AdamW refused.
#[test]
fn a_scalar_parameter_trains_under_clipping_both_ways() -> R<()> {
    use candle_core::Tensor;
    use candle_nn::{Init, VarBuilder, VarMap};
    let run = |fused: bool| -> R<Vec<f32>> {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let scale = vb.get_with_hints((), "scale", Init::Const(3.0))?;
        let bias = vb.get_with_hints(4, "bias", Init::Const(0.5))?;
        let vars = TrainVars::local(None, &map, vb);
        let mut trainer = Trainer::new(
            vars,
            TrainerConfig {
                clip: Some(0.1),
                ..TrainerConfig::default()
            },
        )?;
        let x = Tensor::new(&[1f32, -2.0, 0.5, 4.0], &Device::Cpu)?;
        let loss = || (x.broadcast_mul(&scale)? + &bias)?.sqr()?.mean_all();
        for _ in 0..3 {
            if fused {
                trainer.step(loss)?;
            } else {
                let g = trainer.forward_backward(loss)?;
                assert_eq!(
                    g.grads().get(&scale).map(|t| t.dims().to_vec()),
                    Some(vec![])
                );
                trainer.apply(g)?;
            }
        }
        Ok(vec![scale.to_scalar::<f32>()?])
    };
    let (a, b) = (run(true)?, run(false)?);
    assert_eq!(a, b);
    assert_ne!(a, [3.0], "the scalar trained");
    Ok(())
}
