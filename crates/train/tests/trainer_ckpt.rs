//! Checkpoints of the library trainer (`train::fit::Trainer`) for a model a user writes with
//! candle-nn: trained under FSDP over `dp=2` for 3 of 6 steps and saved, then resumed on
//! `dp=2`, on one device (a plain `VarMap`) and on `dp=4`, the resumed steps' losses equal the
//! uninterrupted run's (1e-6 relative on the same layout, 1e-5 across layouts); a `dp=2 x tp=2`
//! (tensor-parallel `tp_nn`) checkpoint resumes on one device too. A corrupt or missing file is
//! a typed error naming the file.
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{DType, Device};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_kernels::compare::compare_series_f32;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::fsdp_vb::{reference_var_builder, FsdpVarMap};
use candle_dtensor_parallel::tp_nn::Group;
use candle_dtensor_train::checkpoint::{self, CheckpointError, Which};
use candle_dtensor_train::fit::{
    FitOptions, StepInfo, TrainVars, Trainer, TrainerConfig, TrainerError,
};
use candle_dtensor_train::schedule::{Decay, LrSchedule, WeightDecay};

#[path = "common/user_mlp.rs"]
mod user_mlp;
use user_mlp::{batch, no_wrap, Layer, Mlp, BATCH};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEED: u64 = 11;
const STEPS: usize = 6;
const SAVE_AT: usize = 3;

fn config() -> TrainerConfig {
    TrainerConfig {
        schedule: Some(LrSchedule::new(2e-2, 2, Decay::Cosine, STEPS, 1e-3).unwrap()),
        weight_decay: 0.1,
        decay_policy: WeightDecay::Matrices { embeddings: false },
        clip: Some(0.05),
        ..TrainerConfig::default()
    }
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cdt-trainer-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

// ---------------------------------------------------------------------------------------------
// Runs.

/// How a run lays the model out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    /// One device, a plain `VarMap`.
    One,
    /// FSDP over `dp` ranks.
    Fsdp(usize),
    /// FSDP over `dp=2`, tensor parallelism over `tp=2`.
    FsdpTp,
}

/// What a rank does with checkpoints in a run up to `steps`.
#[derive(Debug, Clone, Copy)]
enum Ckpt<'a> {
    None,
    /// `fit` with `FitOptions::checkpoint(dir, SAVE_AT)`.
    Fit(&'a Path),
    /// `Trainer::load(dir, Step(SAVE_AT))` before `fit`.
    Load(&'a Path),
}

/// One rank's trainer and model of `layout` and its rows of the batch.
fn build(mesh: Option<&DeviceMesh>, layout: Layout) -> R<(Mlp, Trainer, std::ops::Range<usize>)> {
    match (layout, mesh) {
        (Layout::One, _) | (_, None) => {
            let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
            let vars = TrainVars::local(None, &map, vb);
            let model = Mlp::new(vars.var_builder()?, None, &no_wrap)?;
            Ok((model, Trainer::new(vars, config())?, 0..BATCH))
        }
        (_, Some(mesh)) => {
            let dpn = mesh.shape()[0];
            let dpi = mesh.coordinate()[0];
            let tp = match layout {
                Layout::FsdpTp => Some(Group::from_mesh(mesh, "tp")?),
                _ => None,
            };
            let fsdp = Fsdp::new(mesh, FsdpConfig::new(0, GradReduce::Avg))?;
            let map = FsdpVarMap::new(&fsdp, SEED);
            let vars = TrainVars::fsdp(mesh, &fsdp, &map, DType::F32);
            let wrap = |key: &str, l: Layer| -> candle_core::Result<Layer> {
                Ok(Layer(Box::new(map.wrap(key, l)?)))
            };
            let model = Mlp::new(vars.var_builder()?, tp.as_ref(), &wrap)?;
            let rows = BATCH / dpn;
            Ok((
                model,
                Trainer::new(vars, config())?,
                dpi * rows..(dpi + 1) * rows,
            ))
        }
    }
}

fn rank_run(
    mesh: Option<&DeviceMesh>,
    layout: Layout,
    steps: usize,
    ckpt: Ckpt,
) -> R<Vec<StepInfo>> {
    let (model, mut trainer, rows) = build(mesh, layout)?;
    let mut opts = FitOptions::new();
    match ckpt {
        Ckpt::None => {}
        Ckpt::Fit(dir) => opts = opts.checkpoint(dir, SAVE_AT),
        Ckpt::Load(dir) => {
            let info = trainer.load(dir, Which::Step(SAVE_AT))?;
            assert_eq!(info.step, SAVE_AT);
            assert_eq!(info.optimizer_step, Some(SAVE_AT));
            assert_eq!(trainer.steps_done(), SAVE_AT);
        }
    }
    let report = trainer.fit(
        steps,
        |step| batch(step, rows.clone()),
        |(x, y)| model.loss(x, y),
        opts,
    )?;
    if let Ckpt::Fit(_) = ckpt {
        // Saved after every SAVE_AT steps and after the last, from where it started.
        let start = report.resumed_from.unwrap_or(0);
        let want: Vec<usize> = (start + 1..=steps)
            .filter(|d| d % SAVE_AT == 0 || *d == steps)
            .collect();
        assert_eq!(report.saved, want);
    }
    Ok(report.steps)
}

/// Rank 0's steps of a run of `layout` (every rank's losses are the same global means).
fn run(layout: Layout, steps: usize, ckpt: Ckpt) -> R<Vec<StepInfo>> {
    let dims: Vec<(&str, usize)> = match layout {
        Layout::One => return rank_run(None, layout, steps, ckpt),
        Layout::Fsdp(n) => vec![("dp", n)],
        Layout::FsdpTp => vec![("dp", 2), ("tp", 2)],
    };
    let n = dims.iter().map(|d| d.1).product();
    let mut all = LocalWorld::new(n)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            rank_run(Some(&mesh), layout, steps, ckpt)
        })?;
    let first = all.remove(0);
    for (r, other) in all.iter().enumerate() {
        assert_eq!(
            losses(other),
            losses(&first),
            "rank {} of {layout:?}",
            r + 1
        );
    }
    Ok(first)
}

fn losses(s: &[StepInfo]) -> Vec<f32> {
    s.iter().map(|i| i.loss).collect()
}

fn within(what: &str, got: &[StepInfo], want: &[StepInfo], tol: f64) {
    assert_eq!(
        got.iter().map(|s| s.step).collect::<Vec<_>>(),
        (SAVE_AT..STEPS).collect::<Vec<_>>(),
        "{what}: the resumed steps"
    );
    assert_eq!(
        got.iter().map(|s| s.lr).collect::<Vec<_>>(),
        want[SAVE_AT..].iter().map(|s| s.lr).collect::<Vec<_>>(),
        "{what}: the schedule continues exactly"
    );
    let d = compare_series_f32(what, &losses(got), &losses(&want[SAVE_AT..]))
        .unwrap_or_else(|e| panic!("{e}"));
    tracing::info!(what, ?d, "resumed losses");
    d.within(tol).unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
fn fsdp_checkpoints_resume_on_the_same_and_other_layouts() {
    let whole = run(Layout::Fsdp(2), STEPS, Ckpt::None).unwrap();
    assert_eq!(whole.len(), STEPS);
    let one = run(Layout::One, STEPS, Ckpt::None).unwrap();
    compare_series_f32("dp=2 vs one device", &losses(&whole), &losses(&one))
        .and_then(|d| d.within(1e-5))
        .unwrap_or_else(|e| panic!("{e}"));

    // Interrupted: dp=2 trains 3 steps and saves at 3 (fit's checkpoint option).
    let dir = tmp("fsdp2");
    let first = run(Layout::Fsdp(2), SAVE_AT, Ckpt::Fit(&dir)).unwrap();
    assert_eq!(losses(&first), losses(&whole[..SAVE_AT]));
    assert_eq!(checkpoint::complete_steps(&dir).unwrap(), vec![SAVE_AT]);
    let m = checkpoint::read_manifest(&dir, SAVE_AT).unwrap();
    assert_eq!(m.world_size, 2);
    assert_eq!(m.optimizer.as_ref().map(|o| o.step), Some(SAVE_AT));
    assert!(
        m.tensors.contains_key("model.fc1.weight"),
        "{:?}",
        m.tensors.keys()
    );
    assert!(m.tensors.contains_key("optim.fc1.weight.exp_avg_sq"));
    assert_eq!(
        m.tensors["model.fc1.weight"].chunks.len(),
        2,
        "one chunk per FSDP shard"
    );

    // Resumed on every layout from the dp=2 checkpoint (explicit load: the directory keeps
    // step 3 only).
    let one_r = run(Layout::One, STEPS, Ckpt::Load(&dir)).unwrap();
    within("dp=2 -> one device", &one_r, &whole, 1e-5);
    let dp4 = run(Layout::Fsdp(4), STEPS, Ckpt::Load(&dir)).unwrap();
    within("dp=2 -> dp=4", &dp4, &whole, 1e-5);
    // On dp=2 through fit's checkpoint option: it continues from the latest (3) and saves 6.
    let again = run(Layout::Fsdp(2), STEPS, Ckpt::Fit(&dir)).unwrap();
    within("dp=2 -> dp=2", &again, &whole, 1e-6);
    assert_eq!(
        checkpoint::complete_steps(&dir).unwrap(),
        vec![SAVE_AT, STEPS]
    );
    // A finished run resumed does nothing more.
    let done = run(Layout::Fsdp(2), STEPS, Ckpt::Fit(&dir)).unwrap();
    assert!(done.is_empty(), "{done:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_dp_x_tp_checkpoint_resumes_on_one_device() {
    let whole = run(Layout::One, STEPS, Ckpt::None).unwrap();
    let dir = tmp("fsdp-tp");
    let first = run(Layout::FsdpTp, SAVE_AT, Ckpt::Fit(&dir)).unwrap();
    compare_series_f32("dp x tp", &losses(&first), &losses(&whole[..SAVE_AT]))
        .and_then(|d| d.within(1e-5))
        .unwrap_or_else(|e| panic!("{e}"));
    let m = checkpoint::read_manifest(&dir, SAVE_AT).unwrap();
    // fc1 is column-parallel (2 pieces) x 2 FSDP shards; the norm, replicated over tp, is
    // written once per FSDP shard.
    assert_eq!(m.tensors["model.fc1.weight"].chunks.len(), 4);
    assert_eq!(m.tensors["model.norm.weight"].chunks.len(), 2);
    let one_r = run(Layout::One, STEPS, Ckpt::Load(&dir)).unwrap();
    within("dp x tp -> one device", &one_r, &whole, 1e-5);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_or_missing_file_is_an_error_naming_it() {
    let dir = tmp("bad");
    run(Layout::Fsdp(2), SAVE_AT, Ckpt::Fit(&dir)).unwrap();
    let file = checkpoint::step_dir(&dir, SAVE_AT).join("rank-1.safetensors");
    let good = std::fs::read(&file).unwrap();

    // A flipped byte in the last chunk's data: a checksum error naming the file.
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x40;
    std::fs::write(&file, &bad).unwrap();
    let load = |dir: &Path| -> Result<(), TrainerError> {
        let (_, mut trainer, _) =
            build(None, Layout::One).map_err(|e| TrainerError::Params(e.to_string()))?;
        trainer.load(dir, Which::Latest).map(|_| ())
    };
    let e = load(&dir).unwrap_err();
    let msg = e.to_string();
    match &e {
        TrainerError::Checkpoint(c) => {
            assert!(matches!(**c, CheckpointError::Checksum { .. }), "{msg}")
        }
        other => panic!("not a checkpoint error: {other}"),
    }
    assert!(msg.contains("rank-1.safetensors"), "{msg}");

    // The file missing: an error naming it.
    std::fs::remove_file(&file).unwrap();
    let e = load(&dir).unwrap_err();
    let msg = e.to_string();
    match &e {
        TrainerError::Checkpoint(c) => {
            assert!(matches!(**c, CheckpointError::MissingFile { .. }), "{msg}")
        }
        other => panic!("not a checkpoint error: {other}"),
    }
    assert!(msg.contains("rank-1.safetensors"), "{msg}");

    // Restored, it loads; no checkpoint at all is a fresh start for resume, an error for load.
    std::fs::write(&file, &good).unwrap();
    load(&dir).unwrap();
    let empty = tmp("empty");
    let (_, mut trainer, _) = build(None, Layout::One).unwrap();
    assert!(trainer.resume(&empty).unwrap().is_none());
    assert_eq!(trainer.steps_done(), 0);
    let e = trainer.load(&empty, Which::Latest).unwrap_err();
    assert!(
        matches!(&e, TrainerError::Checkpoint(c) if matches!(**c, CheckpointError::NotFound { .. })),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
