//! The learning-rate schedule and the weight-decay policy in the trainer: the same rates and
//! losses on every layout, a resumed run continuing the schedule exactly, and a policy that
//! changes what trains.
mod common;

use std::time::Duration;

use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::schedule::{Decay, LrSchedule, WeightDecay};
use candle_dtensor_train::trainer::{RankReport, TrainConfig};
use common::{assert_close, fsdp_over, micro_gpt, short_run, train_on_mesh, Scratch};

/// 12 steps with 3 of warmup and cosine decay to a tenth, strong decay on matrices only.
fn cfg(steps: usize) -> TrainConfig {
    let mut c = short_run(micro_gpt(), TpPlan::gpt(false), steps, 5);
    c.lr = 1e-2;
    c.weight_decay = 0.5;
    c.schedule = Some(LrSchedule::new(1e-2, 3, Decay::Cosine, 12, 1e-3).unwrap());
    c.decay_policy = WeightDecay::Matrices { embeddings: false };
    c
}

fn train(dims: &[(&str, usize)], c: &TrainConfig) -> RankReport {
    train_on_mesh(dims, c, Duration::from_secs(60))
}

#[test]
fn every_layout_follows_the_schedule_with_one_devices_losses() {
    let c = cfg(12);
    let one = train(&[("tp", 1)], &c);
    let want: Vec<f64> = (0..12).map(|s| c.schedule.unwrap().lr_at(s)).collect();
    assert_eq!(one.lrs, want);
    assert_eq!(one.lrs[2], 1e-2, "warmup ends at the peak");
    assert!(one.lrs[11] < 1.1e-3, "{:?}", one.lrs);
    let mut fsdp = c.clone();
    fsdp.fsdp = Some(fsdp_over("dp", None));
    for (dims, cfg) in [
        (&[("dp", 2)][..], &fsdp),
        (&[("tp", 2)][..], &c),
        (&[("dp", 2), ("tp", 2)][..], &fsdp),
    ] {
        let r = train(dims, cfg);
        assert_eq!(r.lrs, want, "{dims:?}");
        assert_close(&r.losses, &one.losses, 1e-5, &format!("{dims:?}"));
    }
}

#[test]
fn the_policy_changes_training_and_all_is_the_default() {
    assert_eq!(
        TrainConfig::new(micro_gpt(), TpPlan::gpt(false)).decay_policy,
        WeightDecay::All
    );
    let matrices = train(&[("tp", 1)], &cfg(8));
    let mut all = cfg(8);
    all.decay_policy = WeightDecay::All;
    let all = train(&[("tp", 1)], &all);
    let mut none = cfg(8);
    none.weight_decay = 0.0;
    let none = train(&[("tp", 1)], &none);
    assert_eq!(matrices.losses[0], all.losses[0], "same first forward");
    // After some steps, decaying norms and embeddings too changes the losses, and matrices-only
    // decay differs from no decay at all.
    assert_ne!(matrices.losses[7], all.losses[7]);
    assert_ne!(matrices.losses[7], none.losses[7]);
    for l in matrices.losses.iter().chain(&all.losses) {
        assert!(l.is_finite());
    }
}

#[test]
fn a_resumed_run_continues_the_schedule_exactly() {
    let dir = Scratch::new("resume");
    let dims = [("dp", 2)];
    let mut full = cfg(12);
    full.fsdp = Some(fsdp_over("dp", None));
    let reference = train(&dims, &full);
    // The first invocation stops after 6 of the schedule's 12 steps (as a crashed job would).
    let mut first = full.clone();
    first.steps = 6;
    first.save_dir = Some(dir.0.clone());
    first.save_every = 3;
    let a = train(&dims, &first);
    assert_eq!(a.lrs, reference.lrs[..6]);
    let mut second = full.clone();
    second.save_dir = Some(dir.0.clone());
    second.resume = true;
    let b = train(&dims, &second);
    assert_eq!(b.start_step, 6);
    assert_eq!(
        b.lrs,
        reference.lrs[6..],
        "the resumed rates are the uninterrupted run's"
    );
    assert_close(&b.losses, &reference.losses[6..], 1e-6, "resumed losses");
}

#[test]
fn steps_report_their_rate_and_gradient_norm() {
    use candle_dtensor_comm::LocalWorld;
    use candle_dtensor_mesh::DeviceMesh;
    use candle_dtensor_train::trainer::{train_rank, StepInfo};
    use std::sync::Mutex;
    let mut c = cfg(6);
    c.grad_norm_every = 2;
    let seen: Mutex<Vec<StepInfo>> = Mutex::new(Vec::new());
    let report = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> common::R<_> {
            let mesh = DeviceMesh::new(comm, &[("tp", 2)])?;
            let rank = mesh.rank();
            Ok(train_rank(&mesh, &c, |i| {
                if rank == 0 {
                    seen.lock().unwrap().push(*i);
                }
            })?)
        })
        .unwrap()
        .remove(0);
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 6);
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(s.step, i);
        assert_eq!(s.lr, report.lrs[i]);
        assert_eq!(s.loss, report.losses[i]);
        assert_eq!(s.phase_ms, report.phase_ms[i]);
        assert!(s.peak_bytes > 0);
        match s.grad_norm {
            Some(n) => assert!(i % 2 == 0 && n.is_finite() && n > 0.0, "step {i}: {n}"),
            None => assert!(i % 2 == 1, "step {i} should have a norm"),
        }
    }
    // With clipping the norm is there every step, and it is the same norm (before clipping) as
    // the unclipped run's at step 0.
    let mut clipped = cfg(2);
    clipped.clip = Some(1e-3);
    let r = LocalWorld::new(1)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> common::R<_> {
            let mesh = DeviceMesh::new(comm, &[("tp", 1)])?;
            let mut norms = Vec::new();
            train_rank(&mesh, &clipped, |i| norms.push(i.grad_norm))?;
            Ok(norms)
        })
        .unwrap()
        .remove(0);
    assert!(r.iter().all(Option::is_some), "{r:?}");
    let n0 = r[0].unwrap();
    let want = seen[0].grad_norm.unwrap();
    assert!((n0 - want).abs() <= 1e-5 * want, "{n0} vs {want}");
}
