//! Fault-tolerant HSDP on the local backend: a rank thread of one replica group fails (or
//! hangs past the op timeout) after a step; the survivors agree on it, drop its replica group,
//! shrink and train on from the failed step, and their losses equal those of a run started on
//! the surviving replica's state at that step (a checkpoint of an uninterrupted run, resumed on
//! one replica).
// The GPT-training helpers every crate's GPT tests share (they train through train's run).
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use candle_dtensor_comm::LocalWorld;
use candle_dtensor_kernels::compare::compare_series_f32;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::trainer::{train_rank, RankReport, TrainConfig};
use common::{fsdp_over, micro_gpt, short_run, R};

const STEPS: usize = 8;
/// The victim fails after this step (0-based); the next one fails and is retried.
const FAULT_STEP: usize = 3;
/// The longest a hung victim hangs: until every other rank has returned, at most this long.
const HANG_CAP: Duration = Duration::from_secs(60);

fn cfg() -> TrainConfig {
    let mut c = short_run(micro_gpt(), TpPlan::gpt(false), STEPS, 5);
    // AdamW: its moments and step count must survive the recovery for the losses to match.
    c.lr = 1e-2;
    c.fsdp = Some(fsdp_over("shard", Some("replicate")));
    c
}

fn world(n: usize, timeout: Duration) -> LocalWorld {
    LocalWorld::new(n)
        .with_timeout(timeout)
        .with_bootstrap_timeout(Duration::from_secs(20))
}

/// An uninterrupted run on `replicas` x 2 ranks; rank 0's report.
fn plain(replicas: usize, c: &TrainConfig) -> RankReport {
    world(replicas * 2, Duration::from_secs(30))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("replicate", replicas), ("shard", 2)])?;
            Ok(train_rank(&mesh, c, |_| {})?)
        })
        .expect("uninterrupted run")
        .into_iter()
        .next()
        .expect("rank 0")
}

/// The reference: an uninterrupted 2 x 2 run checkpointed after the fault step, resumed on one
/// replica (the surviving replica's state at the failed step) for the remaining steps.
fn reference(name: &str) -> (RankReport, RankReport) {
    let dir = std::env::temp_dir().join(format!("cdt-ft-hsdp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut before = cfg();
    before.steps = FAULT_STEP + 1;
    before.save_dir = Some(dir.clone());
    let head = plain(2, &before);
    let mut after = cfg();
    after.save_dir = Some(dir.clone());
    after.resume = true;
    let tail = plain(1, &after);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(tail.start_step, FAULT_STEP + 1);
    (head, tail)
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Fail,
    Hang,
}

/// The fault-tolerant 2 x 2 run with `victim` failing after [`FAULT_STEP`]: every rank's
/// outcome. A hung victim stays hung until every other rank has returned (at most
/// [`HANG_CAP`]), so survivors that waited for it to end instead of suspecting it after the op
/// timeout would stall that long.
fn ft_run(victim: usize, kind: Kind, timeout: Duration) -> Vec<Result<RankReport, String>> {
    let mut c = cfg();
    c.fault_tolerant = true;
    let returned = AtomicUsize::new(0);
    world(4, timeout)
        .elastic(true)
        .launch_each(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("replicate", 2), ("shard", 2)])?;
            let me = mesh.rank();
            let out = train_rank(&mesh, &c, |info| {
                if me == victim && info.step == FAULT_STEP {
                    if kind == Kind::Hang {
                        let t0 = Instant::now();
                        while returned.load(Ordering::SeqCst) < 3 && t0.elapsed() < HANG_CAP {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    panic!("injected failure of rank {me} after step {}", info.step);
                }
            });
            returned.fetch_add(1, Ordering::SeqCst);
            Ok(out?)
        })
        .expect("launch")
}

fn check(victim: usize, kind: Kind, timeout: Duration, name: &str) {
    let (head, tail) = reference(name);
    let outcomes = ft_run(victim, kind, timeout);
    let lost_replica: Vec<usize> = if victim < 2 { vec![0, 1] } else { vec![2, 3] };
    let survivors: Vec<usize> = (0..4).filter(|r| !lost_replica.contains(r)).collect();
    for (r, o) in outcomes.iter().enumerate() {
        if r == victim {
            let e = o.as_ref().expect_err("the victim fails");
            assert!(e.contains("injected failure"), "{name}: rank {r}: {e}");
            continue;
        }
        let rep = o
            .as_ref()
            .unwrap_or_else(|e| panic!("{name}: rank {r} failed: {e}"));
        assert_eq!(rep.lost_ranks, lost_replica, "{name}: rank {r}");
        // Identical to the uninterrupted run up to the fault.
        assert_eq!(
            &rep.losses[..=FAULT_STEP],
            &head.losses[..],
            "{name}: rank {r} before the fault"
        );
        if lost_replica.contains(&r) {
            // The victim's shard peer stops with its replica group.
            assert!(rep.dropped, "{name}: rank {r} should be dropped");
            assert_eq!(rep.losses.len(), FAULT_STEP + 1, "{name}: rank {r}");
            continue;
        }
        assert!(!rep.dropped, "{name}: rank {r}");
        assert_eq!(
            rep.losses.len(),
            STEPS,
            "{name}: rank {r} finishes every step"
        );
        assert_eq!(
            rep.rank,
            survivors.iter().position(|&s| s == r).unwrap(),
            "{name}: renumbered"
        );
        assert_eq!(rep.recoveries.len(), 1, "{name}");
        let rec = &rep.recoveries[0];
        assert_eq!(
            rec.step,
            FAULT_STEP + 1,
            "{name}: the failed step is retried"
        );
        assert_eq!(
            rec.failed,
            vec![victim],
            "{name}: the lost rank is reported"
        );
        assert_eq!(rec.dropped, lost_replica, "{name}");
        assert_eq!(rec.replicas, 1, "{name}");
        // Element i is step FAULT_STEP + 1 + i.
        let after = &rep.losses[FAULT_STEP + 1..];
        if let Err(e) = compare_series_f32("loss after the fault", after, &tail.losses)
            .and_then(|d| d.within(1e-5))
        {
            panic!("{name}: rank {r}: {e} ({after:?} vs {:?})", tail.losses);
        }
        // Detected without waiting out what it need not: a failed victim at once, not after the
        // op timeout; a hung one after the op timeout, not when it ends (it hangs until the
        // survivors are done, up to HANG_CAP). Half of those, so load alone cannot fail it.
        let limit = match kind {
            Kind::Fail => timeout / 2,
            Kind::Hang => HANG_CAP / 2,
        };
        assert!(
            rec.stall_ms < limit.as_secs_f64() * 1e3,
            "{name}: rank {r} stalled {} ms at the failed step (limit {limit:?})",
            rec.stall_ms
        );
    }
}

#[test]
fn a_failed_rank_thread_drops_its_replica_and_the_survivors_match_a_fresh_run() {
    // The last rank (replica 1) and rank 0 (replica 0: the survivors are renumbered). The op
    // timeout is long: the failure must be seen at once, and waiting it out fails the check.
    check(3, Kind::Fail, Duration::from_secs(30), "fail-3");
    check(0, Kind::Fail, Duration::from_secs(30), "fail-0");
}

#[test]
fn a_hung_rank_is_suspected_after_the_op_timeout_and_dropped() {
    let timeout = Duration::from_millis(500);
    check(1, Kind::Hang, timeout, "hang-1");
}
