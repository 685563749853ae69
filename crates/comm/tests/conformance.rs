//! The comm crate's conformance and fault suite on the `local` backend.
//!
//! Two parts, one binary (ripgrep's `tests/tests.rs` layout):
//!
//! - `suite`: the backend-neutral cases of `candle_dtensor_comm::conformance` (every
//!   collective x dtypes x size classes x reduce ops, split, overlap, timeouts, desync, abort,
//!   hooks, RMA, typed errors), one test per case, each at the world sizes that case was
//!   always run at (1..=8 for the sweeps). The same cases run on other backends through their
//!   own launchers (`examples/mpi_conformance.rs` under `mpirun`).
//! - what only a `LocalWorld` can show: panicking and failing rank threads and the launcher's
//!   report, launch errors, progress threads that must not outlive their world, the backend
//!   registry (a backend defined here, plugged in through `new_comm`), the flight recorder's
//!   options, the local backend's capabilities; and a broken backend the suite must catch.
//!
//! Every world runs with op and bootstrap timeouts of 30 s, which nothing that passes waits
//! out: checks that something fails fast (not after a timeout) are bounded relative to them,
//! so a loaded machine does not fail them, while waiting a timeout out still does. What must
//! time out uses short timeouts: a few hundred milliseconds for the fault cases, 500 ms of
//! bootstrap for the split that a rank never joins. The collective sweep samples the large
//! size class; set `CDT_FULL_SWEEP=1` to run it at every world size.

use std::error::Error;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::conformance::{assert_ctx, eventually, fails};
use candle_dtensor_comm::{Comm, CommError, LocalWorld, ReduceOp};

type R<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// A world whose ops time out after `ms` milliseconds (fault tests).
fn short_world(n: usize, ms: u64) -> LocalWorld {
    LocalWorld::new(n)
        .with_timeout(Duration::from_millis(ms))
        .with_bootstrap_timeout(Duration::from_millis(ms.max(500)))
}

/// Op and bootstrap timeout of [`world`]: long, see the module docs.
const LONG: Duration = Duration::from_secs(30);

fn world(n: usize) -> LocalWorld {
    LocalWorld::new(n)
        .with_timeout(LONG)
        .with_bootstrap_timeout(LONG)
}

/// Runs `f` on every rank of a world of `n`; panics with the launcher's report on failure.
fn launch<T: Send>(n: usize, f: impl Fn(Comm) -> R<T> + Send + Sync) -> Vec<T> {
    world(n).launch(f).unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------------
// The backend-neutral suite on the local backend: one test per case.
// ---------------------------------------------------------------------------------------------
mod suite {
    use super::*;
    use candle_dtensor_comm::conformance::{cases, run, Outcome, Selection};

    /// Runs `case` on every world size in `worlds` (each world built by `make`) and checks it
    /// ran and passed on every rank.
    fn on_worlds(case: &str, worlds: &[usize], make: fn(usize) -> LocalWorld) {
        assert!(
            cases().iter().any(|c| c.name == case),
            "no conformance case named {case}"
        );
        let sel = Selection::only(&[case]);
        for &n in worlds {
            let reports = make(n)
                .launch(|comm| run(&comm, &sel))
                .unwrap_or_else(|e| panic!("world {n}: {e}"));
            for r in &reports {
                assert_eq!(r.cases.len(), 1, "world {n}: {r:?}");
                assert_eq!(r.cases[0].outcome, Outcome::Passed, "world {n}: {r:?}");
            }
        }
    }

    /// A world whose communicators give up on a missing peer in bootstrap quickly.
    fn quick_bootstrap(n: usize) -> LocalWorld {
        world(n).with_bootstrap_timeout(Duration::from_millis(500))
    }

    macro_rules! local_cases {
        ($($test:ident: $case:literal on $worlds:expr $(, $make:expr)?;)*) => {$(
            #[test]
            fn $test() {
                #[allow(unused_variables)]
                let make: fn(usize) -> LocalWorld = world;
                $(let make: fn(usize) -> LocalWorld = $make;)?
                on_worlds($case, &$worlds, make);
            }
        )*};
    }

    const SWEEP: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

    local_cases! {
        all_reduce: "collectives::all_reduce" on SWEEP;
        all_reduce_in_place_large: "collectives::all_reduce_in_place_large" on [3, 8];
        reduce_scatter_single: "collectives::reduce_scatter_single" on SWEEP;
        all_gather_single: "collectives::all_gather_single" on SWEEP;
        all_gather_single_of_a_scalar: "collectives::all_gather_single_of_a_scalar" on [1, 3];
        all_to_all_single: "collectives::all_to_all_single" on SWEEP;
        all_to_all_v_single: "collectives::all_to_all_v_single" on SWEEP;
        all_to_all_v_rows: "collectives::all_to_all_v_rows" on SWEEP;
        broadcast: "collectives::broadcast" on SWEEP;
        reduce: "collectives::reduce" on SWEEP;
        gather: "collectives::gather" on SWEEP;
        scatter: "collectives::scatter" on SWEEP;
        send_recv_ring: "collectives::send_recv_ring" on SWEEP;
        batch_p2p_all_pairs: "collectives::batch_p2p_all_pairs" on SWEEP;
        barrier_holds_every_rank: "collectives::barrier_holds_every_rank" on [1, 2, 5, 8];
        many_ops_in_flight: "collectives::many_ops_in_flight" on [2, 5];
        avg_on_integers: "collectives::avg_on_integers" on [2];
        split_rows_and_columns: "split::rows_and_columns" on [6, 4];
        split_list_order: "split::list_order_defines_new_ranks" on [4];
        split_non_members: "split::non_members_get_none" on [5];
        split_nested: "split::nested_splits" on [8, 3];
        split_same_name: "split::same_name_splits_are_independent" on [4];
        split_invalid_lists: "split::invalid_lists" on [3];
        split_members_that_disagree: "split::members_that_disagree" on [2, 4];
        split_rank_rejecting_its_list: "split::rank_rejecting_its_list" on [3], quick_bootstrap;
        shrink_without_the_last_rank: "shrink::without_the_last_rank" on [2, 4];
        shrink_invalid_lists: "shrink::invalid_lists" on [2, 3];
        shrink_members_that_disagree: "shrink::members_that_disagree" on [4, 5];
        overlap_comm_b_while_comm_a_waits: "overlap::comm_b_completes_while_comm_a_waits" on [4];
        overlap_all_gather_and_reduce_scatter: "overlap::all_gather_and_reduce_scatter" on [4];
        faults_skipped_collective: "faults::skipped_collective_times_out" on [3];
        faults_recv_without_send: "faults::recv_without_send_times_out" on [2];
        faults_desync: "faults::desync" on [3];
        faults_abort_from_another_thread: "faults::abort_from_another_thread" on [3];
        faults_abort_of_an_idle_comm: "faults::abort_of_an_idle_comm" on [2];
        faults_dropped_work: "faults::dropped_work" on [4];
        hooks_pre_and_post: "hooks::pre_and_post_hooks" on [2];
        hooks_abort_on_timeout: "hooks::abort_hooks_on_timeout" on [2];
        hooks_abort_on_abort: "hooks::abort_hooks_on_abort" on [1];
        hooks_failed_wait_after_hooks: "hooks::failed_wait_returns_after_the_hooks" on [2, 3];
        hooks_concurrent_aborts: "hooks::concurrent_aborts_return_after_the_hooks" on [1, 3];
        hooks_flight_recorder: "hooks::flight_recorder" on [2];
        rma_ring_put_signal_get_fence: "rma::ring_put_signal_get_fence" on [1, 2, 3, 5];
        rma_signals_count_and_time_out: "rma::signals_count_and_time_out" on [2];
        rma_out_of_range_accesses: "rma::out_of_range_accesses" on [2];
        bad_input_ranks_out_of_range: "bad_input::ranks_out_of_range" on [3];
        bad_input_dim_0_must_divide: "bad_input::dim_0_must_divide" on [3];
        bad_input_all_to_all_v_bad_lists: "bad_input::all_to_all_v_bad_lists" on [3];
        bad_input_all_to_all_v_inconsistent: "bad_input::all_to_all_v_inconsistent_lists" on [3];
        bad_input_recv_of_another_shape: "bad_input::recv_of_another_shape_or_dtype" on [2];
        bad_input_unsupported_dtypes: "bad_input::unsupported_dtypes" on [2];
        bad_input_bad_outputs: "bad_input::bad_outputs_of_into_variants" on [2];
        bad_input_bad_scatter_arguments: "bad_input::bad_scatter_arguments" on [2];
        bad_input_non_contiguous_inputs: "bad_input::non_contiguous_inputs" on [3];
    }

    /// Every case of the module has a test above (a new case without one fails here).
    #[test]
    fn every_case_runs_on_the_local_backend() {
        let src = include_str!("conformance.rs");
        let names: Vec<&str> = cases().iter().map(|c| c.name).collect();
        let mut uniq = names.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), names.len(), "duplicate case names: {names:?}");
        for name in names {
            assert!(
                src.contains(&format!("\"{name}\" on")),
                "conformance case {name} has no local test"
            );
        }
    }

    #[test]
    fn selection_skips_what_the_world_cannot_run_and_reports_it() {
        // On one rank, cases that need two are skipped (with a reason), not failed.
        let sel = Selection::only(&["faults"]).excluding(&["faults::abort_of_an_idle_comm"]);
        let reports = world(1)
            .launch(|comm| run(&comm, &sel))
            .unwrap_or_else(|e| panic!("{e}"));
        let r = &reports[0];
        assert!(r.cases.len() >= 5, "{r:?}");
        for c in &r.cases {
            match (&c.outcome, c.name) {
                (Outcome::Passed, "faults::dropped_work") => {}
                (Outcome::Skipped(why), "faults::abort_of_an_idle_comm") => {
                    assert!(why.contains("excluded"), "{why}")
                }
                (Outcome::Skipped(why), _) => assert!(why.contains("needs 2 ranks"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(r.failed(), 0);
        assert!(r.to_string().contains("1 ranks: 1 passed"), "{r}");
    }
}

// ---------------------------------------------------------------------------------------------
// Faults only a LocalWorld shows: failing rank threads, launch errors, leaked threads.
// ---------------------------------------------------------------------------------------------
mod faults {
    use super::*;
    use candle_dtensor_comm::LocalWorldError;
    use std::sync::Mutex;

    /// What a surviving peer saw: its rank, the pending op's error and how long it took, and
    /// a later op's error and how long that took.
    type PeerSeen = (usize, CommError, Duration, CommError, Duration);

    /// Launches a world of 4 (op timeout [`LONG`]) where rank 2 fails via `fail` after 100 ms
    /// while the others sit in an all_reduce; returns the launcher error and, per surviving
    /// rank, the error of the pending op, how long it took, and how long a later op took to
    /// fail.
    fn rank_two_fails(fail: impl Fn() -> R<()> + Sync) -> (LocalWorldError, Vec<PeerSeen>) {
        let seen = Mutex::new(Vec::new());
        let res = LocalWorld::new(4)
            .with_timeout(LONG)
            .launch(|comm| {
                if comm.rank() == 2 {
                    std::thread::sleep(Duration::from_millis(100));
                    fail()?;
                    return Ok(());
                }
                let x = Tensor::ones(8, DType::F32, &Device::Cpu)?;
                let t0 = Instant::now();
                let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "pending op");
                let took = t0.elapsed();
                let t1 = Instant::now();
                let later = fails(comm.barrier().and_then(|w| w.wait()), "later op");
                seen.lock()
                    .unwrap()
                    .push((comm.rank(), e, took, later, t1.elapsed()));
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
            .expect_err("rank 2 failed, so the launch fails");
        let mut seen = seen.into_inner().unwrap();
        seen.sort_by_key(|s| s.0);
        (res, seen)
    }

    fn check_peers(seen: &[PeerSeen], needle: &str) {
        assert_eq!(seen.len(), 3, "{seen:?}");
        for (rank, e, took, later, later_took) in seen {
            assert!(matches!(e, CommError::Aborted { .. }), "rank {rank}: {e}");
            assert_ctx(e, "all_reduce", "world", *rank);
            let msg = e.to_string();
            assert!(
                msg.contains("rank 2") && msg.contains(needle),
                "rank {rank}: {msg}"
            );
            // Promptly: not after the op timeout. Half of it, not a fixed second or so, so a
            // loaded machine cannot fail this while waiting the timeout out still does.
            assert!(*took < LONG / 2, "rank {rank}: failed after {took:?}");
            assert!(
                matches!(later, CommError::Aborted { .. }),
                "rank {rank}: {later}"
            );
            assert!(
                *later_took < LONG / 2,
                "rank {rank}: a later op failed after {later_took:?}"
            );
        }
    }

    #[test]
    fn a_panicking_rank_fails_its_peers_promptly_and_is_reported() {
        let (err, seen) = rank_two_fails(|| panic!("boom on purpose"));
        match &err {
            LocalWorldError::RankFailed {
                world,
                rank,
                reason,
                failures,
            } => {
                assert_eq!((*world, *rank), (4, 2), "{err}");
                assert!(
                    reason.contains("panicked") && reason.contains("boom on purpose"),
                    "{err}"
                );
                assert_eq!(failures.len(), 1, "{failures:?}");
                assert_eq!(failures[0].0, 2);
            }
            other => panic!("{other}"),
        }
        assert!(err.to_string().contains("rank 2 failed"), "{err}");
        check_peers(&seen, "boom on purpose");
    }

    #[test]
    fn a_rank_returning_an_error_fails_its_peers_promptly_and_is_reported() {
        let (err, seen) = rank_two_fails(|| Err("rank two gave up".into()));
        match &err {
            LocalWorldError::RankFailed { rank, reason, .. } => {
                assert_eq!(*rank, 2, "{err}");
                assert!(reason.contains("rank two gave up"), "{err}");
            }
            other => panic!("{other}"),
        }
        check_peers(&seen, "rank two gave up");
    }

    #[test]
    fn peers_failing_in_turn_still_report_the_first_failure() {
        // Every survivor propagates its abort error; the launcher names the root cause.
        let err = LocalWorld::new(3)
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                if comm.rank() == 1 {
                    return Err::<(), Box<dyn Error + Send + Sync>>("root cause".into());
                }
                comm.barrier()?.wait()?;
                Ok(())
            })
            .expect_err("rank 1 failed");
        match err {
            LocalWorldError::RankFailed {
                rank,
                reason,
                failures,
                ..
            } => {
                assert_eq!((rank, reason.as_str()), (1, "root cause"));
                assert_eq!(
                    failures.iter().map(|f| f.0).collect::<Vec<_>>(),
                    vec![0, 1, 2]
                );
            }
            other => panic!("{other}"),
        }
    }

    /// Elastic world: rank 3 fails; the survivors see it, agree on it and shrink around it;
    /// rank 2 fails during that shrink (a second failure): both survivors report it, shrink
    /// again without it, and compute correctly on the 2-rank communicator. The failed ranks'
    /// errors are theirs alone: the launcher reports every rank's outcome.
    #[test]
    fn survivors_of_a_failed_rank_agree_shrink_and_survive_a_second_failure() {
        let out = short_world(4, 2_000)
            .elastic(true)
            .launch_each(|comm| -> R<(usize, usize, f64)> {
                comm.barrier()?.wait()?;
                let r = comm.rank();
                if r == 3 {
                    // Let every peer's barrier complete first.
                    std::thread::sleep(Duration::from_millis(200));
                    return Err("rank 3 fails on purpose".into());
                }
                let x = Tensor::new(&[r as f64 + 0.25], &Device::Cpu)?;
                let e = comm
                    .all_reduce(&x, ReduceOp::Sum)?
                    .wait()
                    .expect_err("rank 3 is gone");
                assert!(
                    e.to_string().contains("rank 3 fails on purpose"),
                    "rank {r}: {e}"
                );
                let a = comm.agree(true)?;
                assert_eq!((a.ok, a.failed.clone()), (false, vec![3]), "rank {r}");
                if r == 2 {
                    return Err("rank 2 fails during the shrink".into());
                }
                match comm.shrink(&[3]) {
                    Err(e @ CommError::RanksLost { .. }) => {
                        assert_ctx(&e, "shrink", "world", r);
                        let CommError::RanksLost { lost, .. } = e else {
                            unreachable!()
                        };
                        assert_eq!(lost, vec![2], "rank {r}");
                    }
                    other => panic!(
                        "rank {r}: expected RanksLost, got {:?}",
                        other.map(|c| c.size())
                    ),
                }
                let s = comm.shrink(&[2, 3])?;
                let v = s.all_reduce(&x, ReduceOp::Sum)?.wait()?.to_vec1::<f64>()?[0];
                // The shrunk communicator also agrees, healthy this time.
                let a = s.agree(true)?;
                assert!(a.ok && a.failed.is_empty(), "rank {r}: {a:?}");
                Ok((s.rank(), s.size(), v))
            })
            .expect("a world of 4");
        assert_eq!(out[0].as_ref().ok(), Some(&(0, 2, 1.5)), "{out:?}");
        assert_eq!(out[1].as_ref().ok(), Some(&(1, 2, 1.5)), "{out:?}");
        assert!(out[2]
            .as_ref()
            .is_err_and(|e| e.contains("during the shrink")));
        assert!(out[3].as_ref().is_err_and(|e| e.contains("on purpose")));
    }

    /// A step that failed on one rank fails the agreement on every rank, so no rank commits an
    /// update another one dropped.
    #[test]
    fn a_failed_step_on_one_rank_fails_the_agreement_on_every_rank() {
        let out = launch(3, |comm| {
            let a = comm.agree(comm.rank() != 1)?;
            Ok((a.ok, a.failed))
        });
        assert!(out.iter().all(|a| *a == (false, vec![])), "{out:?}");
    }

    #[test]
    fn a_world_of_zero_ranks_is_a_launch_error() {
        let e = LocalWorld::new(0)
            .launch(|_| Ok::<_, CommError>(()))
            .unwrap_err();
        assert!(matches!(e, LocalWorldError::Launch(_)), "{e}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn no_progress_thread_outlives_its_world() {
        use candle_dtensor_comm::conformance::{no_threads_named, threads_named};
        // Progress threads are named "cdt-<comm>-r<rank>". After the launch returns, every
        // communicator is gone, so every progress thread must exit, including after failures.
        let ok = LocalWorld::new(3)
            .with_name("leakok")
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                let sub = comm.split(&[0, 1, 2], "leaksub")?.expect("member");
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                for _ in 0..3 {
                    comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                    sub.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                }
                let w = comm.new_window(16)?;
                w.fence()?;
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            });
        ok.unwrap_or_else(|e| panic!("{e}"));
        let failed = LocalWorld::new(3)
            .with_name("leakbad")
            .with_timeout(Duration::from_secs(3))
            .launch(|comm| {
                let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                if comm.rank() == 1 {
                    return Err::<(), Box<dyn Error + Send + Sync>>("leaving".into());
                }
                comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                Ok(())
            });
        assert!(failed.is_err());
        // Threads exit within milliseconds; the wait is long only so that a loaded machine
        // cannot fail it (it ends as soon as they are gone).
        for prefix in ["cdt-leakok-", "cdt-leaksub-", "cdt-leakbad-"] {
            assert!(
                no_threads_named(prefix, Duration::from_secs(30)),
                "{} progress threads named {prefix}* still run after their world ended",
                threads_named(prefix)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The flight recorder's options (set when a world is created).
// ---------------------------------------------------------------------------------------------
mod hooks {
    use super::*;
    use candle_dtensor_comm::{CommOptions, FlightRecorder, WorkStatus};

    fn entries(d: &serde_json::Value) -> Vec<serde_json::Value> {
        d["entries"].as_array().expect("entries").clone()
    }

    #[test]
    fn flight_recorder_is_a_ring_and_can_be_disabled_or_attached() {
        let opts = |entries| CommOptions {
            flight_recorder_entries: entries,
            ..CommOptions::default()
                .with_timeout(Duration::from_secs(3))
                .with_bootstrap_timeout(Duration::from_secs(3))
        };
        LocalWorld::new(2)
            .with_options(opts(3))
            .launch(|comm| {
                for _ in 0..5 {
                    comm.barrier()?.wait()?;
                }
                let fr = comm.flight_recorder().expect("enabled");
                assert_eq!(fr.len(), 3);
                let d = fr.dump_json(true);
                assert_eq!(d["dropped"], 2, "{d}");
                let seqs: Vec<_> = entries(&d).iter().map(|e| e["seq"].clone()).collect();
                assert_eq!(seqs, vec![3, 4, 5], "{d}");
                fr.reset();
                assert!(fr.is_empty());
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
        LocalWorld::new(2)
            .with_options(opts(0))
            .launch(|comm| {
                assert!(comm.flight_recorder().is_none());
                // One attached by hand records until its hooks are removed.
                let fr = FlightRecorder::new(8);
                let (pre, post) = fr.attach(&comm);
                comm.barrier()?.wait()?;
                comm.barrier()?.wait()?;
                pre.remove();
                post.remove();
                comm.barrier()?.wait()?;
                assert_eq!(fr.len(), 2);
                let e = fr.entries(true);
                assert!(e.iter().all(|e| e.state == WorkStatus::Completed), "{e:?}");
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// The backend registry: a backend defined here, plugged in through new_comm.
// ---------------------------------------------------------------------------------------------
mod registry {
    use super::*;
    use candle_dtensor_comm::{
        new_comm, register_backend, registered_backends, Backend, Capabilities, Collective,
        CollectiveOutput, CommOptions, OpCtx, P2POp, Work,
    };
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// A world-size-1 backend: every collective returns (a copy of) its input. Its works
    /// complete on a helper thread a little later, like a real asynchronous transport.
    struct Solo {
        device: Device,
        aborted: AtomicBool,
        mailbox: Mutex<VecDeque<Tensor>>,
        alive: Arc<AtomicUsize>,
        /// A deliberate bug, for the tests that must catch it.
        fault: Fault,
    }

    /// The bugs a [`Solo`] can be built with.
    #[derive(Clone, Copy, PartialEq)]
    enum Fault {
        None,
        /// Doubles every all_reduce result: the conformance suite must catch it.
        SumsWrong,
        /// Answers a gather with "done": the front must refuse the outcome.
        GathersDone,
    }

    impl Solo {
        fn backend_with(alive: Arc<AtomicUsize>, fault: Fault) -> Arc<dyn Backend> {
            alive.fetch_add(1, Ordering::SeqCst);
            Arc::new(Solo {
                device: Device::Cpu,
                aborted: AtomicBool::new(false),
                mailbox: Mutex::new(VecDeque::new()),
                alive,
                fault,
            })
        }

        /// World-1 point-to-point: sends queue in the mailbox, receives take from it in order.
        fn batch_p2p(
            &self,
            ctx: &OpCtx,
            ops: Vec<P2POp>,
        ) -> candle_dtensor_comm::Result<Vec<Tensor>> {
            let mut mail = self.mailbox.lock().unwrap();
            let mut got = Vec::new();
            for op in &ops {
                if let P2POp::Send { tensor, .. } = op {
                    mail.push_back(tensor.clone());
                }
            }
            for op in ops {
                if let P2POp::Recv { .. } = op {
                    got.push(mail.pop_front());
                }
            }
            got.into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing: vec![0],
                })
        }

        fn done<T: Send + 'static>(
            &self,
            ctx: OpCtx,
            r: candle_dtensor_comm::Result<T>,
        ) -> candle_dtensor_comm::Result<Work<T>> {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted {
                    ctx,
                    reason: "solo aborted".into(),
                });
            }
            let (work, completer) = Work::pending(ctx, 0);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                completer.start();
                completer.complete(r);
            });
            Ok(work)
        }
    }

    impl Drop for Solo {
        fn drop(&mut self) {
            self.alive.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn copy_to(
        ctx: &OpCtx,
        input: &Tensor,
        output: Option<Tensor>,
    ) -> candle_dtensor_comm::Result<Tensor> {
        let wrap = |e: candle_core::Error| CommError::Candle {
            ctx: ctx.clone(),
            message: e.to_string(),
        };
        match output {
            None => input.copy().map_err(wrap),
            Some(o) => {
                // A copy first: `o` may be `input` itself (in-place all_reduce).
                let src = input
                    .copy()
                    .and_then(|c| c.reshape(o.dims()))
                    .map_err(wrap)?;
                o.slice_set(&src, 0, 0).map_err(wrap)?;
                Ok(o)
            }
        }
    }

    type Res<T> = candle_dtensor_comm::Result<Work<T>>;

    impl Backend for Solo {
        fn backend_name(&self) -> &'static str {
            "solo"
        }
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            1
        }
        fn device(&self) -> &Device {
            &self.device
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                dtypes: vec!["f32".into()],
                ..Capabilities::default()
            }
        }
        fn collective(&self, ctx: OpCtx, op: Collective) -> Res<CollectiveOutput> {
            let out: candle_dtensor_comm::Result<CollectiveOutput> = match op {
                Collective::AllReduce {
                    input, output: o, ..
                } => {
                    let x = if self.fault == Fault::SumsWrong {
                        (input.to_dtype(DType::F64).unwrap() * 2.0)
                            .and_then(|y| y.to_dtype(input.dtype()))
                            .unwrap()
                    } else {
                        input
                    };
                    copy_to(&ctx, &x, o).map(Into::into)
                }
                Collective::AllGather { input, output: o } => {
                    let x = if input.rank() == 0 {
                        input.reshape(1).unwrap()
                    } else {
                        input
                    };
                    copy_to(&ctx, &x, o).map(Into::into)
                }
                Collective::ReduceScatter {
                    input, output: o, ..
                }
                | Collective::AllToAll { input, output: o } => {
                    copy_to(&ctx, &input, o).map(Into::into)
                }
                Collective::AllToAllV { input, .. } => copy_to(&ctx, &input, None).map(Into::into),
                rows @ Collective::AllToAllVRows { .. } => {
                    let op = rows.gather_rows(&ctx)?;
                    return self.collective(ctx, op);
                }
                Collective::Broadcast { tensor, .. } => Ok(tensor.into()),
                Collective::Reduce { input, .. } => Ok(Some(input).into()),
                Collective::Gather { input, .. } => Ok(Some(vec![input]).into()),
                Collective::Scatter { mut inputs, .. } => Ok(inputs.remove(0).into()),
                Collective::Barrier => Ok(().into()),
                Collective::BatchP2p { ops } => self.batch_p2p(&ctx, ops).map(Into::into),
            };
            // A deliberately wrong backend: its gathers answer "done".
            let out = match out {
                Ok(CollectiveOutput::Gathered(_)) if self.fault == Fault::GathersDone => {
                    Ok(CollectiveOutput::Done)
                }
                other => other,
            };
            self.done(ctx, out)
        }
        fn split(
            &self,
            _: OpCtx,
            ranks: &[usize],
            _: &str,
            _: &CommOptions,
        ) -> candle_dtensor_comm::Result<Option<Arc<dyn Backend>>> {
            Ok((!ranks.is_empty()).then(|| Solo::backend_with(self.alive.clone(), self.fault)))
        }
        fn abort(&self, _: &str) {
            self.aborted.store(true, Ordering::SeqCst);
        }
        fn is_aborted(&self) -> bool {
            self.aborted.load(Ordering::SeqCst)
        }
    }

    fn register_solo(name: &str) -> Arc<AtomicUsize> {
        register_solo_with(name, Fault::None)
    }

    fn register_solo_with(name: &str, fault: Fault) -> Arc<AtomicUsize> {
        let alive = Arc::new(AtomicUsize::new(0));
        let a = alive.clone();
        register_backend(
            name,
            Arc::new(
                move |_: &Device,
                      _: &str,
                      _: &CommOptions|
                      -> candle_dtensor_comm::Result<Arc<dyn Backend>> {
                    Ok(Solo::backend_with(a.clone(), fault))
                },
            ),
        );
        alive
    }

    #[test]
    fn the_suite_catches_a_backend_that_sums_wrong() -> R<()> {
        use candle_dtensor_comm::conformance::{run, ConformanceError, Selection};
        let alive = Arc::new(AtomicUsize::new(0));
        let a = alive.clone();
        register_backend(
            "solo-broken",
            Arc::new(
                move |_: &Device,
                      _: &str,
                      _: &CommOptions|
                      -> candle_dtensor_comm::Result<Arc<dyn Backend>> {
                    Ok(Solo::backend_with(a.clone(), Fault::SumsWrong))
                },
            ),
        );
        let case = "collectives::all_reduce_in_place_large";
        let sel = Selection::only(&[case]);
        // An honest world-1 backend passes the case; the broken one fails it, and the error
        // names the case, the rank and the first differing element.
        let _honest = register_solo("solo-honest");
        let good = new_comm("solo-honest", &Device::Cpu, "good", opts())?;
        let report = run(&good, &sel)?;
        assert_eq!((report.passed(), report.failed()), (1, 0), "{report}");
        let comm = new_comm("solo-broken", &Device::Cpu, "broken", opts())?;
        match run(&comm, &sel) {
            Err(e @ ConformanceError::Failed { .. }) => {
                let msg = e.to_string();
                let ConformanceError::Failed {
                    case: failed,
                    rank,
                    ranks,
                    detail,
                    report,
                } = e
                else {
                    unreachable!()
                };
                assert_eq!((failed, rank, ranks), (case, 0, vec![0]));
                assert!(
                    detail.contains("rank 0") && detail.contains("but the reference says"),
                    "{detail}"
                );
                assert!(
                    msg.contains("collectives::all_reduce") && msg.contains("element"),
                    "{msg}"
                );
                assert_eq!(report.failed(), 1, "{report}");
            }
            other => panic!("expected the broken backend to fail, got {other:?}"),
        }
        Ok(())
    }

    #[test]
    fn a_backend_that_answers_the_wrong_kind_is_named_not_obeyed() -> R<()> {
        let _alive = register_solo_with("solo-wrong-kind", Fault::GathersDone);
        let comm = new_comm("solo-wrong-kind", &Device::Cpu, "wrong", opts())?;
        let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
        // Other ops are unaffected.
        let y = comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        assert_eq!(y.to_vec1::<f32>()?, vec![1., 2.]);
        match comm.gather(&x, 0)?.wait() {
            Err(CommError::WrongOutcome { ctx, backend, got }) => {
                assert_eq!((backend, got), ("solo", "completion alone"));
                assert_eq!(&*ctx.comm, "wrong");
            }
            other => panic!("expected WrongOutcome, got {other:?}"),
        }
        Ok(())
    }

    #[test]
    fn rows_reach_a_backend_without_a_rows_path_as_their_gather() -> R<()> {
        let _alive = register_solo("solo-rows");
        let comm = new_comm("solo-rows", &Device::Cpu, "rows", opts())?;
        let x = Tensor::arange(0f32, 15., &Device::Cpu)?.reshape((5, 3))?;
        let rows = Arc::new(vec![4u32, 0, 4, 2]);
        let got = comm.all_to_all_v_rows(&x, &rows, &[4], &[4])?.wait()?;
        let ids = Tensor::new(&[4u32, 0, 4, 2], &Device::Cpu)?;
        let want = x.index_select(&ids, 0)?;
        assert_eq!(got.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        // A row out of range is refused, not read.
        let bad = Arc::new(vec![5u32]);
        assert!(comm
            .all_to_all_v_rows(&x, &bad, &[1], &[1])
            .and_then(|w| w.wait())
            .is_err());
        Ok(())
    }

    fn opts() -> CommOptions {
        CommOptions::default()
            .with_timeout(Duration::from_secs(2))
            .with_bootstrap_timeout(Duration::from_secs(2))
            .with_hint("solo.flavour", "vanilla")
    }

    #[test]
    fn a_backend_defined_outside_the_crate_runs_behind_the_front() -> R<()> {
        let _alive = register_solo("solo");
        assert!(registered_backends().contains(&"solo".to_string()));
        let comm = new_comm("solo", &Device::Cpu, "solo0", opts())?;
        assert_eq!(
            (comm.backend_name(), comm.rank(), comm.size(), comm.name()),
            ("solo", 0, 1, "solo0")
        );
        assert_eq!(
            comm.options().hints.get("solo.flavour").map(String::as_str),
            Some("vanilla")
        );
        assert!(!comm.capabilities().rma_put);
        let x = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
        let seen = Arc::new(AtomicUsize::new(0));
        let s = seen.clone();
        let _h = comm.register_pre_hook(move |_| {
            s.fetch_add(1, Ordering::SeqCst);
        });
        let w = comm.all_reduce(&x, ReduceOp::Sum)?;
        assert_eq!(w.seq(), 1);
        assert_eq!(w.wait()?.to_vec1::<f32>()?, vec![1., 2., 3., 4.]);
        let o = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
        comm.all_reduce_into(&o, &x, ReduceOp::Max)?.wait()?;
        assert_eq!(o.to_vec1::<f32>()?, vec![1., 2., 3., 4.]);
        assert_eq!(comm.all_gather_single(&x)?.wait()?.dims(), &[4]);
        assert_eq!(
            comm.reduce(&x, 0, ReduceOp::Sum)?
                .wait()?
                .map(|t| t.dims().to_vec()),
            Some(vec![4])
        );
        comm.send(&x, 0)?.wait()?;
        assert_eq!(
            comm.recv(0, 4, DType::F32)?.wait()?.to_vec1::<f32>()?,
            vec![1., 2., 3., 4.]
        );
        comm.barrier()?.wait()?;
        assert_eq!(
            seen.load(Ordering::SeqCst),
            7,
            "the front runs hooks for every backend"
        );
        // The front still validates for it.
        let e = fails(comm.broadcast(&x, 1).map(drop), "root out of range");
        assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
        // Optional ops default to Unsupported, naming backend and op.
        let e = fails(comm.new_window(64).map(drop), "window");
        assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
        assert!(
            e.to_string().contains("new_window") && e.to_string().contains("solo"),
            "{e}"
        );
        let sub = comm.split(&[0], "solo-sub")?.expect("member");
        assert_eq!(sub.all_reduce(&x, ReduceOp::Sum)?.wait()?.dims(), &[4]);
        assert!(comm.split(&[], "none")?.is_none());
        comm.abort("done");
        assert!(comm.is_aborted());
        Ok(())
    }

    #[test]
    fn dropping_a_comm_drops_its_backend() -> R<()> {
        // The front's bookkeeping (hooks, flight recorder, work callbacks) must not keep a
        // communicator alive after its last handle is gone.
        let alive = register_solo("solo-drop");
        let comm = new_comm("solo-drop", &Device::Cpu, "d", opts())?;
        let sub = comm.split(&[0], "d2")?.expect("member");
        let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        for c in [&comm, &sub] {
            c.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            drop(c.barrier()?);
        }
        assert_eq!(alive.load(Ordering::SeqCst), 2);
        drop(comm);
        drop(sub);
        // The completer threads end 20 ms after their op; long only so that a loaded machine
        // cannot fail it (it ends as soon as the backends are gone).
        let all_dropped = || alive.load(Ordering::SeqCst) == 0;
        assert!(
            eventually(Duration::from_secs(30), all_dropped),
            "{} solo backends still alive",
            alive.load(Ordering::SeqCst)
        );
        Ok(())
    }

    #[test]
    fn unknown_backends_list_the_registered_ones() {
        let e = fails(
            new_comm("nccl-typo", &Device::Cpu, "x", opts()).map(drop),
            "unknown",
        );
        match &e {
            CommError::UnknownBackend { name, available } => {
                assert_eq!(name, "nccl-typo");
                assert!(available.contains(&"local".to_string()), "{e}");
            }
            other => panic!("{other}"),
        }
        assert!(
            e.to_string().contains("registered backends") && e.to_string().contains("\"local\""),
            "{e}"
        );
    }

    /// Without the `mpi` feature the backend is still registered, and says how to get it.
    #[cfg(not(feature = "mpi"))]
    #[test]
    fn mpi_without_its_feature_is_not_compiled() {
        assert!(registered_backends().contains(&"mpi".to_string()));
        let e = fails(
            new_comm("mpi", &Device::Cpu, "world", opts()).map(drop),
            "mpi without the feature",
        );
        assert!(matches!(e, CommError::NotCompiled { .. }), "{e}");
        assert!(e.to_string().contains("feature `mpi`"), "{e}");
    }

    #[test]
    fn new_comm_local_outside_a_local_world_is_a_bootstrap_error() {
        let e = fails(
            new_comm("local", &Device::Cpu, "lonely", opts()).map(drop),
            "outside",
        );
        assert!(matches!(e, CommError::Bootstrap { .. }), "{e}");
        assert!(
            e.to_string().contains("lonely") && e.to_string().contains("LocalWorld"),
            "{e}"
        );
    }

    #[test]
    fn new_comm_local_inside_a_local_world_is_a_fresh_world_comm() {
        let got = launch(3, |comm| {
            let a = new_comm("local", &Device::Cpu, "side", opts())?;
            let b = new_comm("local", &Device::Cpu, "side", opts())?;
            assert_eq!((a.rank(), a.size(), a.name()), (comm.rank(), 3, "side"));
            // Independent of each other and of the world comm: different issue orders.
            let x = Tensor::new(&[comm.rank() as u32 + 1], &Device::Cpu)?;
            let wb = b.all_reduce(&x, ReduceOp::Product)?;
            let wa = a.all_reduce(&x, ReduceOp::Sum)?;
            let ww = comm.all_reduce(&x, ReduceOp::Max)?;
            Ok((
                wa.wait()?.to_vec1::<u32>()?,
                wb.wait()?.to_vec1::<u32>()?,
                ww.wait()?.to_vec1::<u32>()?,
            ))
        });
        for g in got {
            assert_eq!(g, (vec![6], vec![6], vec![3]));
        }
    }

    #[test]
    fn new_comm_local_that_a_rank_skips_times_out_in_bootstrap() {
        let got = short_world(2, 300)
            .launch(|comm| {
                if comm.rank() == 1 {
                    return Ok(None);
                }
                let o = CommOptions::default().with_bootstrap_timeout(Duration::from_millis(300));
                Ok::<_, CommError>(Some(fails(
                    new_comm("local", &Device::Cpu, "skipped", o).map(drop),
                    "bootstrap",
                )))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        match &got[0] {
            Some(e @ CommError::Timeout { missing, ctx, .. }) => {
                assert_eq!(missing, &vec![1], "{e}");
                assert_eq!(ctx.op.as_str(), "new_comm", "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One-sided RMA windows: what the local backend advertises.
// ---------------------------------------------------------------------------------------------
mod rma {
    use super::*;

    #[test]
    fn capabilities_of_the_local_backend() {
        launch(1, |comm| {
            let c = comm.capabilities();
            assert!(c.rma_put && c.rma_get && c.rma_signal && c.abort, "{c:?}");
            assert_eq!(c.dtypes.len(), 7, "{c:?}");
            Ok(())
        });
    }
}
