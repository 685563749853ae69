//! The engine against the mock NCCL and fake events: init, split, the Work state machine, the
//! watchdog (with a fake clock), async errors, abort and teardown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::api::{Call, DataType, NcclApi, NcclCode, RawComm, RedOp};
use super::config::ConfigSpec;
use super::engine::{init_comm, Core, Delivery, Ident, InitArgs};
use super::mock::{FakeStreams, Logged, MockApi};
use super::version::{Gates, NcclVersion};
use candle_dtensor_comm_core::CommError;
use candle_dtensor_comm_core::WorkStatus;
use candle_dtensor_comm_core::{OpCtx, OpName};

fn ctx(op: OpName, seq: u64, timeout: Duration) -> OpCtx {
    OpCtx {
        op,
        comm: Arc::from("tp"),
        rank: 1,
        seq,
        timeout,
    }
}

fn all_reduce(count: usize) -> Vec<Call> {
    vec![Call::AllReduce {
        send: 0x100,
        recv: 0x200,
        count,
        dt: DataType::Float32,
        op: RedOp::Sum,
    }]
}

struct Fixture {
    api: Arc<MockApi>,
    dev: Arc<FakeStreams>,
    core: Arc<Core>,
    raw: RawComm,
}

fn fixture_with(version: NcclVersion) -> Fixture {
    let api = Arc::new(MockApi::new());
    let dev = Arc::new(FakeStreams::default());
    let raw = RawComm(0xc0);
    let gates = Gates::new(version, |_| true);
    let core = Core::new(
        api.clone(),
        dev.clone(),
        gates,
        raw,
        Ident {
            name: Arc::from("tp"),
            rank: 1,
            size: 4,
            bootstrap_timeout: Duration::from_millis(300),
        },
    );
    Fixture {
        api,
        dev,
        core,
        raw,
    }
}

fn fixture() -> Fixture {
    fixture_with(NcclVersion::new(2, 29, 3))
}

/// Counts drops, to see when the engine releases the buffers of an operation.
struct Tracked(Arc<AtomicUsize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn published_work_returns_at_once_and_completes_with_its_end_event() {
    let f = fixture();
    let drops = Arc::new(AtomicUsize::new(0));
    let c = ctx(OpName::AllReduce, 7, Duration::from_secs(5));
    let work = f
        .core
        .issue(
            c,
            all_reduce(3),
            Delivery::Published(41u32),
            Box::new(Tracked(drops.clone())),
        )
        .unwrap();
    assert_eq!(
        f.api.log(),
        vec![
            Logged::GroupStart,
            Logged::Enqueue(all_reduce(3).remove(0)),
            Logged::GroupEnd
        ]
    );
    assert_eq!(f.api.calls(), all_reduce(3));
    assert_eq!(
        f.dev.comm_waits.load(Ordering::SeqCst),
        1,
        "comm stream ordered after the caller"
    );
    let state = work.state();
    assert_eq!(work.status(), WorkStatus::InProgress);
    assert_eq!(f.core.pending(), 1);
    // Nothing completed on the device yet: the watchdog keeps the buffers.
    assert!(f.core.poll_once(Instant::now()));
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    // wait() does not block: it returns the value and orders the caller's stream.
    assert_eq!(work.wait().unwrap(), 41);
    assert_eq!(f.dev.caller_waits.load(Ordering::SeqCst), 1);
    assert_eq!(state.status(), WorkStatus::InProgress);
    f.dev.complete_all();
    assert!(!f.core.poll_once(Instant::now()));
    assert_eq!(state.status(), WorkStatus::Completed);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "buffers released after the end event"
    );
    assert_eq!(f.core.pending(), 0);
}

#[test]
fn blocking_work_waits_for_the_device() {
    let f = fixture();
    let c = ctx(OpName::Barrier, 1, Duration::from_secs(5));
    let work = f
        .core
        .issue(c, all_reduce(1), Delivery::Blocking(()), Box::new(()))
        .unwrap();
    assert_eq!(work.status(), WorkStatus::NotStarted);
    let events = f.dev.events();
    assert_eq!(events.len(), 2);
    events[0].complete();
    f.core.poll_once(Instant::now());
    assert_eq!(
        work.status(),
        WorkStatus::InProgress,
        "started with its start event"
    );
    let core = f.core.clone();
    let waiter = std::thread::spawn(move || work.wait());
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !waiter.is_finished(),
        "a barrier's wait blocks until the device is done"
    );
    events[1].complete();
    core.poll_once(Instant::now());
    waiter.join().unwrap().unwrap();
}

#[test]
fn in_progress_group_end_is_polled_until_ready() {
    let f = fixture();
    f.api.script_group_end(&[NcclCode::IN_PROGRESS]);
    f.api.script(
        f.raw,
        &[
            NcclCode::IN_PROGRESS,
            NcclCode::IN_PROGRESS,
            NcclCode::SUCCESS,
        ],
    );
    let w = f
        .core
        .issue(
            ctx(OpName::AllReduce, 1, Duration::from_secs(5)),
            all_reduce(8),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    w.wait().unwrap();
    assert!(f.core.failure().is_none());
}

#[test]
fn a_group_stuck_in_progress_times_out_and_aborts() {
    let f = fixture();
    f.api.script_group_end(&[NcclCode::IN_PROGRESS]);
    f.api.set_state(f.raw, NcclCode::IN_PROGRESS);
    let t0 = Instant::now();
    let e = f
        .core
        .issue(
            ctx(OpName::AllGatherSingle, 3, Duration::from_millis(100)),
            all_reduce(8),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap_err();
    // Gives up after its 100 ms instead of polling on: a generous bound (load only adds to
    // the 100 ms), not a tight one.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    match &e {
        CommError::Timeout { ctx, timeout, .. } => {
            assert_eq!((ctx.seq, ctx.op), (3, OpName::AllGatherSingle));
            assert_eq!(*timeout, Duration::from_millis(100));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(f.core.failure().is_some());
    // Later operations fail at once, naming the cause.
    let e = f
        .core
        .issue(
            ctx(OpName::AllReduce, 4, Duration::from_secs(5)),
            all_reduce(1),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap_err();
    assert!(matches!(e, CommError::Aborted { .. }));
    assert!(e.to_string().contains("did not finish enqueuing"), "{e}");
    // The watchdog revokes (2.29 >= 2.28.7) and aborts, once.
    f.core.poll_once(Instant::now());
    f.core.poll_once(Instant::now());
    assert_eq!(f.api.count(|l| *l == Logged::Revoke(f.raw)), 1);
    assert_eq!(f.api.count(|l| *l == Logged::Abort(f.raw)), 1);
    assert_eq!(f.api.count(|l| matches!(l, Logged::Destroy(_))), 0);
}

#[test]
fn watchdog_times_out_work_from_its_start_event() {
    let f = fixture();
    let timeout = Duration::from_secs(30);
    let a = f
        .core
        .issue(
            ctx(OpName::AllReduce, 10, timeout),
            all_reduce(4),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    let b = f
        .core
        .issue(
            ctx(OpName::Broadcast, 11, timeout),
            all_reduce(4),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    let (sa, sb) = (a.state(), b.state());
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    for w in [&a, &b] {
        let fl = failures.clone();
        w.on_error(Box::new(move |e| fl.lock().unwrap().push(e.to_string())));
    }
    let t0 = Instant::now();
    // Queued behind others, never started: no timeout however long it waits.
    f.core.poll_once(t0 + Duration::from_secs(3600));
    assert_eq!(sa.status(), WorkStatus::InProgress);
    // The first op starts at t0; 29 s later it is still fine, 31 s later it times out.
    f.dev.events()[0].complete();
    f.core.poll_once(t0);
    f.core.poll_once(t0 + Duration::from_secs(29));
    assert_eq!(sa.status(), WorkStatus::InProgress);
    f.core.poll_once(t0 + Duration::from_secs(31));
    assert_eq!(sa.status(), WorkStatus::TimedOut);
    assert_eq!(sb.status(), WorkStatus::Error);
    let msgs = failures.lock().unwrap().clone();
    assert_eq!(msgs.len(), 2, "abort hooks see both failures: {msgs:?}");
    assert!(
        msgs[0].contains("all_reduce") && msgs[0].contains("timed out after 30s"),
        "{msgs:?}"
    );
    assert!(
        msgs[1].contains("seq 11")
            && msgs[1].contains("seq 10")
            && msgs[1].contains("timed out on the GPU"),
        "{msgs:?}"
    );
    // A value nobody took yet is replaced by the error.
    let e = a.wait().unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }));
    assert!(matches!(b.wait().unwrap_err(), CommError::Aborted { .. }));
    assert_eq!(
        f.api.count(|l| *l == Logged::Abort(f.raw)),
        1,
        "aborted after the timeout"
    );
}

#[test]
fn an_async_error_fails_everything_in_flight() {
    let f = fixture_with(NcclVersion::new(2, 27, 3));
    let w = f
        .core
        .issue(
            ctx(OpName::AllReduce, 2, Duration::from_secs(60)),
            all_reduce(4),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    let s = w.state();
    f.api.set_state(f.raw, NcclCode::REMOTE_ERROR);
    f.core.poll_once(Instant::now());
    assert_eq!(s.status(), WorkStatus::Error);
    let e = w.wait().unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("ncclRemoteError") && m.contains("rank 1") && m.contains("\"tp\""),
        "{m}"
    );
    // NCCL 2.27 has no revoke: abort only.
    assert_eq!(f.api.count(|l| matches!(l, Logged::Revoke(_))), 0);
    assert_eq!(f.api.count(|l| *l == Logged::Abort(f.raw)), 1);
}

#[test]
fn abort_is_immediate_on_the_cpu_side_and_aborts_nccl_from_the_watchdog() {
    let f = fixture();
    let drops = Arc::new(AtomicUsize::new(0));
    let w = f
        .core
        .issue(
            ctx(OpName::ReduceScatterSingle, 5, Duration::from_secs(60)),
            all_reduce(4),
            Delivery::Published(()),
            Box::new(Tracked(drops.clone())),
        )
        .unwrap();
    let s = w.state();
    f.core.abort("user asked");
    assert_eq!(s.status(), WorkStatus::Error);
    assert_eq!(
        f.api.count(|l| matches!(l, Logged::Abort(_))),
        0,
        "abort never calls NCCL itself"
    );
    let e = w.wait().unwrap_err();
    assert!(
        e.to_string().contains("aborted by rank 1: user asked"),
        "{e}"
    );
    f.core.poll_once(Instant::now());
    assert_eq!(f.api.count(|l| *l == Logged::Abort(f.raw)), 1);
    // The kernels have not exited yet: the buffers stay alive until the end event.
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    f.dev.complete_all();
    f.core.poll_once(Instant::now());
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let e = f
        .core
        .issue(
            ctx(OpName::AllReduce, 6, Duration::from_secs(1)),
            all_reduce(1),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap_err();
    assert!(matches!(e, CommError::Aborted { .. }));
}

#[test]
fn a_failing_call_closes_its_group_and_fails_the_communicator() {
    let f = fixture();
    f.api.fail_call("ncclRecv", NcclCode::INVALID_USAGE);
    let calls = vec![
        Call::send(1, 1, DataType::Uint8, 0),
        Call::recv(2, 1, DataType::Uint8, 0),
    ];
    let e = f
        .core
        .issue(
            ctx(OpName::BatchP2p, 9, Duration::from_secs(1)),
            calls,
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("ncclRecv failed with ncclInvalidUsage (5)") && m.contains("seq 9"),
        "{m}"
    );
    assert_eq!(
        f.api.log().last(),
        Some(&Logged::GroupEnd),
        "the group is closed"
    );
    assert!(f.core.failure().is_some());
}

#[test]
fn a_missing_function_is_unsupported_and_not_fatal() {
    let f = fixture();
    f.api.remove(super::api::Optional::AllToAll);
    let e = f
        .core
        .issue(
            ctx(OpName::AllToAllSingle, 1, Duration::from_secs(1)),
            vec![Call::AllToAll {
                send: 1,
                recv: 2,
                count: 3,
                dt: DataType::Float16,
            }],
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap_err();
    assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("ncclAlltoAll"), "{e}");
    assert!(f.core.failure().is_none());
    assert!(f.api.log().is_empty(), "refused before opening a group");
}

#[test]
fn zero_calls_complete_at_once() {
    let f = fixture();
    let w = f
        .core
        .issue(
            ctx(OpName::AllGatherSingle, 1, Duration::from_secs(1)),
            Vec::new(),
            Delivery::Published(5u8),
            Box::new(()),
        )
        .unwrap();
    assert_eq!(w.status(), WorkStatus::Completed);
    assert_eq!(w.wait().unwrap(), 5);
    assert!(f.api.log().is_empty(), "no NCCL call for an empty transfer");
}

#[test]
fn a_broken_event_fails_the_communicator() {
    let f = fixture();
    let w = f
        .core
        .issue(
            ctx(OpName::AllReduce, 3, Duration::from_secs(1)),
            all_reduce(2),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    let s = w.state();
    f.dev.events()[1].break_it();
    f.core.poll_once(Instant::now());
    assert_eq!(s.status(), WorkStatus::Error);
    assert!(f.core.failure().unwrap().contains("CUDA error"));
}

#[test]
fn shutdown_finalizes_and_destroys_a_healthy_communicator() {
    let f = fixture();
    f.api
        .script(f.raw, &[NcclCode::IN_PROGRESS, NcclCode::SUCCESS]);
    f.core.spawn_watchdog().unwrap();
    let w = f
        .core
        .issue(
            ctx(OpName::AllReduce, 1, Duration::from_secs(5)),
            all_reduce(2),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    let s = w.state();
    f.core.request_shutdown();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        f.api.count(|l| matches!(l, Logged::Finalize(_))),
        0,
        "drains work first"
    );
    f.dev.complete_all();
    // Teardown follows within milliseconds; the wait is long only so that a loaded machine
    // cannot fail it (it ends as soon as teardown happened).
    let t0 = Instant::now();
    while f.api.count(|l| matches!(l, Logged::Destroy(_))) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "teardown never happened: {:?}",
            f.api.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.status(), WorkStatus::Completed);
    let log = f.api.log();
    let fin = log
        .iter()
        .position(|l| *l == Logged::Finalize(f.raw))
        .unwrap();
    let des = log
        .iter()
        .position(|l| *l == Logged::Destroy(f.raw))
        .unwrap();
    assert!(fin < des);
    assert_eq!(f.api.count(|l| matches!(l, Logged::Abort(_))), 0);
}

#[test]
fn shutdown_after_a_failure_aborts_and_never_destroys() {
    let f = fixture();
    f.core.abort("test");
    f.core.spawn_watchdog().unwrap();
    f.core.request_shutdown();
    // Long only so that a loaded machine cannot fail it (it ends at the abort).
    let t0 = Instant::now();
    while f.api.count(|l| matches!(l, Logged::Abort(_))) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(f.api.count(|l| matches!(l, Logged::Abort(_))), 1);
    assert_eq!(
        f.api
            .count(|l| matches!(l, Logged::Destroy(_) | Logged::Finalize(_))),
        0
    );
}

fn init_args<'a>(id: &'a super::api::UniqueId, spec: &'a ConfigSpec, c: &'a OpCtx) -> InitArgs<'a> {
    InitArgs {
        id,
        rank: 1,
        size: 4,
        spec,
        ctx: c,
    }
}

#[test]
fn init_is_nonblocking_and_polled() {
    let api = MockApi::new();
    let dev = FakeStreams::default();
    let id = api.unique_id().unwrap();
    let spec = ConfigSpec::from_hints("world", &Default::default(), true).unwrap();
    let c = ctx(OpName::NewComm, 0, Duration::from_secs(5));
    // The first handle the mock hands out.
    api.script(
        RawComm(0x1000),
        &[NcclCode::IN_PROGRESS, NcclCode::IN_PROGRESS],
    );
    let raw = init_comm(&api, &dev, &init_args(&id, &spec, &c), &Vec::new).unwrap();
    assert_eq!(raw, RawComm(0x1000));
    assert_eq!(
        api.log()[0],
        Logged::Init {
            nranks: 4,
            rank: 1,
            blocking: 0
        }
    );
}

#[test]
fn init_timeout_aborts_and_names_missing_ranks() {
    let api = MockApi::new();
    let dev = FakeStreams::default();
    let id = api.unique_id().unwrap();
    let spec = ConfigSpec::from_hints("world", &Default::default(), true).unwrap();
    api.set_state(RawComm(0x1000), NcclCode::IN_PROGRESS);
    let c = ctx(OpName::NewComm, 0, Duration::from_millis(150));
    let t0 = Instant::now();
    let e = init_comm(&api, &dev, &init_args(&id, &spec, &c), &|| vec![2, 3]).unwrap_err();
    // Gives up after its 150 ms instead of polling on: a generous bound (load only adds to
    // the 150 ms), not a tight one.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let m = e.to_string();
    assert!(matches!(e, CommError::Timeout { .. }), "{m}");
    assert!(
        m.contains("new_comm")
            && m.contains("rank 1")
            && m.contains("[2, 3]")
            && m.contains("150ms"),
        "{m}"
    );
    assert_eq!(api.count(|l| *l == Logged::Abort(RawComm(0x1000))), 1);
}

#[test]
fn init_errors_name_the_rank_and_code() {
    let api = MockApi::new();
    let dev = FakeStreams::default();
    let id = api.unique_id().unwrap();
    let spec = ConfigSpec::from_hints("world", &Default::default(), true).unwrap();
    let c = ctx(OpName::NewComm, 0, Duration::from_secs(1));
    api.set_init_code(NcclCode::INVALID_ARGUMENT);
    let e = init_comm(&api, &dev, &init_args(&id, &spec, &c), &Vec::new).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, CommError::Bootstrap { .. }));
    assert!(
        m.contains("rank 1") && m.contains("ncclInvalidArgument") && m.contains("mock: last error"),
        "{m}"
    );
    // An async failure after InProgress.
    api.script(
        RawComm(0x1000),
        &[NcclCode::IN_PROGRESS, NcclCode::SYSTEM_ERROR],
    );
    let e = init_comm(&api, &dev, &init_args(&id, &spec, &c), &Vec::new).unwrap_err();
    assert!(e.to_string().contains("ncclSystemError"), "{e}");
    assert_eq!(api.count(|l| *l == Logged::Abort(RawComm(0x1000))), 1);
}

#[test]
fn init_checks_that_nccl_agrees_on_rank_and_size() {
    let api = MockApi::new();
    let dev = FakeStreams::default();
    let id = api.unique_id().unwrap();
    let spec = ConfigSpec::from_hints("world", &Default::default(), true).unwrap();
    let c = ctx(OpName::NewComm, 0, Duration::from_secs(1));
    // NCCL made a communicator of 8 ranks (the ranks were started with different sizes).
    api.set_next_shape(1, 8);
    let e = init_comm(&api, &dev, &init_args(&id, &spec, &c), &Vec::new).unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("rank 1 of 8") && m.contains("rank 1 of 4"),
        "{m}"
    );
    assert_eq!(api.count(|l| *l == Logged::Abort(RawComm(0x1000))), 1);
}

#[test]
fn split_polls_parent_then_child_and_checks_the_shape() {
    let f = fixture();
    f.api.set_handle_delay(2);
    let spec = ConfigSpec::from_hints("row", &Default::default(), true).unwrap();
    let c = ctx(OpName::Split, 4, Duration::from_secs(2));
    f.api
        .script(f.raw, &[NcclCode::IN_PROGRESS, NcclCode::IN_PROGRESS]);
    // The child's handle appears only after two polls (NVIDIA/nccl#1472); NCCL makes this
    // rank 1 of 2.
    f.api.set_next_shape(1, 2);
    let child = f.core.split(&c, 0, 1, 2, &spec).unwrap();
    assert_eq!(child, Some(RawComm(0x1000)));
    assert!(f.api.log().contains(&Logged::Split {
        comm: f.raw,
        color: 0,
        key: 1
    }));
    // A non-member passes NOCOLOR and gets nothing.
    f.api.set_handle_delay(0);
    assert_eq!(f.core.split(&c, -1, 0, 0, &spec).unwrap(), None);
    // A child whose shape disagrees is aborted and the split fails on this rank.
    let e = f.core.split(&c, 0, 1, 3, &spec).unwrap_err();
    assert!(e.to_string().contains("should be rank 1 of 3"), "{e}");
    assert!(
        f.core.failure().is_some(),
        "a failed split fails the parent"
    );
}

#[test]
fn a_split_stuck_in_progress_times_out_and_fails_the_parent() {
    let f = fixture();
    f.api.set_state(f.raw, NcclCode::IN_PROGRESS);
    let spec = ConfigSpec::from_hints("row", &Default::default(), true).unwrap();
    let c = ctx(OpName::Split, 4, Duration::from_millis(100));
    let e = f.core.split(&c, 0, 0, 2, &spec).unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    assert!(f.core.failure().unwrap().contains("split"));
}

#[test]
fn wait_ready_reports_each_outcome() {
    use super::engine::{wait_ready, Ready};
    let api = MockApi::new();
    let r = RawComm(0x77);
    assert_eq!(wait_ready(&api, r, Instant::now(), None), Ready::Ok);
    api.set_state(r, NcclCode::REMOTE_ERROR);
    assert_eq!(
        wait_ready(&api, r, Instant::now(), None),
        Ready::Failed(NcclCode::REMOTE_ERROR)
    );
    api.set_state(r, NcclCode::IN_PROGRESS);
    assert_eq!(
        wait_ready(&api, r, Instant::now() + Duration::from_millis(20), None),
        Ready::TimedOut
    );
    let flag = std::sync::atomic::AtomicBool::new(true);
    assert_eq!(
        wait_ready(
            &api,
            r,
            Instant::now() + Duration::from_secs(10),
            Some(&flag)
        ),
        Ready::AbortRequested
    );
}

#[test]
fn a_split_rejected_by_nccl_is_a_bootstrap_error_naming_the_rank() {
    let f = fixture();
    f.api.set_split_code(NcclCode::INVALID_USAGE);
    let spec = ConfigSpec::from_hints("col", &Default::default(), true).unwrap();
    let c = ctx(OpName::Split, 2, Duration::from_secs(1));
    let e = f.core.split(&c, 1, 0, 2, &spec).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, CommError::Bootstrap { .. }), "{m}");
    assert!(
        m.contains("rank 1") && m.contains("ncclCommSplit") && m.contains("ncclInvalidUsage"),
        "{m}"
    );
    assert!(f.core.failure().is_some());
}

#[test]
fn shrink_of_a_healthy_idle_communicator_uses_the_default_flag() {
    use super::api::SHRINK_DEFAULT;
    let f = fixture();
    let spec = ConfigSpec::from_hints("tp", &Default::default(), true).unwrap();
    let c = ctx(OpName::Shrink, 2, Duration::from_secs(2));
    // This is rank 1 of 4; without rank 0 it becomes rank 0 of 3.
    f.api.set_next_shape(0, 3);
    let child = f.core.shrink(&c, &[0], 0, 3, &spec).unwrap();
    assert!(f.api.log().contains(&Logged::Shrink {
        comm: f.raw,
        excluded: vec![0],
        flags: SHRINK_DEFAULT
    }));
    assert_ne!(child, f.raw);
    assert!(f.core.failure().is_none(), "the parent stays usable");
    // A child NCCL numbered differently is refused (and aborted).
    f.api.set_next_shape(2, 3);
    let e = f.core.shrink(&c, &[0], 0, 3, &spec).unwrap_err();
    assert!(e.to_string().contains("should be rank 0 of 3"), "{e}");
    // Work in flight on a healthy parent: NCCL_SHRINK_DEFAULT would deadlock.
    let _in_flight = f
        .core
        .issue(
            ctx(OpName::AllReduce, 3, Duration::from_secs(5)),
            all_reduce(1),
            Delivery::Published(()),
            Box::new(()),
        )
        .unwrap();
    let e = f.core.shrink(&c, &[0], 0, 3, &spec).unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
}

#[test]
fn a_shrinkable_communicator_is_revoked_on_failure_and_shrunk_with_abort() {
    use super::api::SHRINK_ABORT;
    let f = fixture();
    assert!(f.core.set_shrinkable(true));
    f.core.abort("rank 3 died");
    f.core.poll_once(Instant::now());
    f.core.poll_once(Instant::now());
    // Kept for the shrink: revoked once, not aborted.
    assert_eq!(f.api.count(|l| *l == Logged::Revoke(f.raw)), 1);
    assert_eq!(f.api.count(|l| *l == Logged::Abort(f.raw)), 0);
    let spec = ConfigSpec::from_hints("tp", &Default::default(), true).unwrap();
    let c = ctx(OpName::Shrink, 2, Duration::from_secs(2));
    f.api.set_next_shape(1, 3);
    f.core.shrink(&c, &[3], 1, 3, &spec).unwrap();
    assert!(f.api.log().contains(&Logged::Shrink {
        comm: f.raw,
        excluded: vec![3],
        flags: SHRINK_ABORT
    }));
    // The failed parent is aborted (never finalized) when its owner lets go of it.
    let mut st = f.core.lock();
    f.core.teardown_locked(&mut st, true);
    drop(st);
    assert_eq!(f.api.count(|l| *l == Logged::Abort(f.raw)), 1);
    assert_eq!(f.api.count(|l| *l == Logged::Revoke(f.raw)), 1);
    assert_eq!(f.api.count(|l| matches!(l, Logged::Finalize(_))), 0);
}

#[test]
fn shrink_needs_the_version_and_a_kept_parent() {
    let spec = ConfigSpec::from_hints("tp", &Default::default(), true).unwrap();
    let c = ctx(OpName::Shrink, 2, Duration::from_secs(2));
    let old = fixture_with(NcclVersion::new(2, 27, 2));
    let e = old.core.shrink(&c, &[0], 0, 3, &spec).unwrap_err();
    assert!(
        matches!(e, CommError::Unsupported { .. }) && e.to_string().contains("2.27.3"),
        "{e}"
    );
    // 2.27.3 shrinks but cannot revoke: a failed communicator is aborted at once.
    let mid = fixture_with(NcclVersion::new(2, 27, 3));
    assert!(!mid.core.set_shrinkable(true));
    // Without the hint a failure aborts the communicator, and the shrink says why it cannot.
    let f = fixture();
    f.core.abort("rank 3 died");
    f.core.poll_once(Instant::now());
    assert_eq!(f.api.count(|l| *l == Logged::Abort(f.raw)), 1);
    let e = f.core.shrink(&c, &[3], 1, 3, &spec).unwrap_err();
    assert!(
        matches!(e, CommError::Aborted { .. }) && e.to_string().contains("nccl.shrinkable"),
        "{e}"
    );
    assert_eq!(f.api.count(|l| matches!(l, Logged::Shrink { .. })), 0);
}

/// Every way a communicator is made (init, split, shrink) first hands the device allocator's
/// cached memory back (NCCL allocates outside that cache), and a refused release is logged,
/// not fatal.
#[test]
fn new_communicators_release_cached_memory_first() {
    let first = |log: &[Logged], call: &dyn Fn(&Logged) -> bool| {
        let r = log.iter().position(|l| *l == Logged::ReleaseCachedMemory);
        let c = log.iter().position(call);
        assert!(
            matches!((r, c), (Some(r), Some(c)) if r < c),
            "release at {r:?}, the call at {c:?}: {log:?}"
        );
    };
    // Init.
    let api = Arc::new(MockApi::new());
    let dev = FakeStreams::default();
    dev.log_to(api.clone());
    let id = api.unique_id().unwrap();
    let spec = ConfigSpec::from_hints("world", &Default::default(), true).unwrap();
    let c = ctx(OpName::NewComm, 0, Duration::from_secs(5));
    api.script(RawComm(0x1000), &[NcclCode::IN_PROGRESS]);
    init_comm(&*api, &dev, &init_args(&id, &spec, &c), &Vec::new).unwrap();
    first(&api.log(), &|l| matches!(l, Logged::Init { .. }));
    // A release that fails leaves the init to go on.
    dev.fail_release.store(true, Ordering::Relaxed);
    init_comm(&*api, &dev, &init_args(&id, &spec, &c), &Vec::new).unwrap();
    assert_eq!(dev.releases.load(Ordering::Relaxed), 2);
    // Split.
    let f = fixture();
    f.dev.log_to(f.api.clone());
    let spec = ConfigSpec::from_hints("row", &Default::default(), true).unwrap();
    f.api.set_next_shape(1, 2);
    f.core
        .split(
            &ctx(OpName::Split, 4, Duration::from_secs(2)),
            0,
            1,
            2,
            &spec,
        )
        .unwrap();
    first(&f.api.log(), &|l| matches!(l, Logged::Split { .. }));
    // Shrink.
    let f = fixture();
    f.dev.log_to(f.api.clone());
    f.api.set_next_shape(0, 3);
    f.core
        .shrink(
            &ctx(OpName::Shrink, 2, Duration::from_secs(2)),
            &[0],
            0,
            3,
            &spec,
        )
        .unwrap();
    first(&f.api.log(), &|l| matches!(l, Logged::Shrink { .. }));
    assert_eq!(f.dev.releases.load(Ordering::Relaxed), 1);
}
