//! Pre/post/abort hooks and the flight recorder, as every backend must drive them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::*;
use candle_dtensor_comm_core::OpName;
use candle_dtensor_comm_core::OpRecord;
use candle_dtensor_comm_core::{WorkState, WorkStatus};

/// What the post-hook saw: seq and work state.
type Seen = Arc<Mutex<Vec<(u64, Arc<dyn WorkState>)>>>;
/// The fields of an op record a case checks.
type RecordView = (
    OpName,
    Vec<Vec<usize>>,
    Option<DType>,
    Option<usize>,
    Option<usize>,
    Option<ReduceOp>,
    usize,
);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn pre_and_post_hooks(cx: &Cx) -> R<()> {
    let (n, rank, comm) = (cx.size(), cx.rank(), &cx.comm);
    let pre: Arc<Mutex<Vec<OpRecord>>> = Arc::default();
    let post: Seen = Arc::default();
    let p = pre.clone();
    let h_pre = comm.register_pre_hook(move |rec| lock(&p).push(rec.clone()));
    let q = post.clone();
    let h_post = comm.register_post_hook(move |rec, w| lock(&q).push((rec.seq, w.clone())));
    let (to, from) = ((rank + 1) % n, (rank + n - 1) % n);
    let cpu = &Device::Cpu;
    comm.all_reduce(&Tensor::ones(3, DType::F32, cpu)?, ReduceOp::Sum)?
        .wait()?;
    comm.all_gather_single(&Tensor::ones((2, 2), DType::BF16, cpu)?)?
        .wait()?;
    let root = n - 1;
    comm.broadcast(&Tensor::zeros(5, DType::U8, cpu)?, root)?
        .wait()?;
    comm.barrier()?.wait()?;
    comm.send(&Tensor::zeros(2, DType::I64, cpu)?, to)?.wait()?;
    comm.recv(from, 2, DType::I64)?.wait()?;
    comm.reduce_scatter_single(&Tensor::ones(4 * n, DType::F64, cpu)?, ReduceOp::Max)?
        .wait()?;
    h_pre.remove();
    h_post.remove();
    comm.barrier()?.wait()?; // seq 8: after removal, seen by nobody
    let pre = lock(&pre).clone();
    let post = lock(&post).clone();
    assert_eq!(comm.seq(), 8, "rank {rank}");
    let want: Vec<RecordView> = vec![
        (
            OpName::AllReduce,
            vec![vec![3]],
            Some(DType::F32),
            None,
            None,
            Some(ReduceOp::Sum),
            12,
        ),
        (
            OpName::AllGatherSingle,
            vec![vec![2, 2]],
            Some(DType::BF16),
            None,
            None,
            None,
            8,
        ),
        (
            OpName::Broadcast,
            vec![vec![5]],
            Some(DType::U8),
            Some(root),
            None,
            None,
            5,
        ),
        (OpName::Barrier, vec![], None, None, None, None, 0),
        (
            OpName::Send,
            vec![vec![2]],
            Some(DType::I64),
            None,
            Some(to),
            None,
            16,
        ),
        (
            OpName::Recv,
            vec![vec![2]],
            Some(DType::I64),
            None,
            Some(from),
            None,
            16,
        ),
        (
            OpName::ReduceScatterSingle,
            vec![vec![4 * n]],
            Some(DType::F64),
            None,
            None,
            Some(ReduceOp::Max),
            32 * n,
        ),
    ];
    assert_eq!(pre.len(), want.len(), "rank {rank}: {pre:?}");
    for (i, (rec, w)) in pre.iter().zip(&want).enumerate() {
        assert_eq!(rec.seq, i as u64 + 1, "rank {rank}: {rec:?}");
        let got = (
            rec.op,
            rec.shapes.clone(),
            rec.dtype,
            rec.root,
            rec.peer,
            rec.reduce_op,
            rec.bytes,
        );
        assert_eq!(&got, w, "rank {rank}, seq {}", rec.seq);
        assert_eq!(
            (&*rec.comm, rec.backend, rec.rank, rec.size),
            (comm.name(), comm.backend_name(), rank, n)
        );
    }
    assert_eq!(
        post.iter().map(|p| p.0).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    for (seq, w) in &post {
        assert_eq!(w.status(), WorkStatus::Completed, "rank {rank}, seq {seq}");
        let (s, f) = (
            w.started_at().expect("started"),
            w.finished_at().expect("finished"),
        );
        assert!(w.issued_at() <= s && s <= f, "rank {rank}, seq {seq}");
        assert_eq!(w.error(), None);
    }
    Ok(())
}

pub(super) fn abort_hooks_on_timeout(cx: &Cx) -> R<()> {
    let (n, rank) = (cx.size(), cx.rank());
    let comm = cx.short();
    let count = Arc::new(AtomicUsize::new(0));
    let first: Arc<Mutex<Option<String>>> = Arc::default();
    let (c, f) = (count.clone(), first.clone());
    let _keep = comm.register_abort_hook(move |e| {
        c.fetch_add(1, Ordering::SeqCst);
        lock(&f).get_or_insert_with(|| e.to_string());
    });
    let removed = Arc::new(AtomicUsize::new(0));
    let r = removed.clone();
    comm.register_abort_hook(move |_| {
        r.fetch_add(1, Ordering::SeqCst);
    })
    .remove();
    comm.barrier()?.wait()?;
    if rank == n - 1 {
        return Ok(());
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "timeout");
    // Long only so that a loaded machine cannot fail it: it ends as soon as the hook ran.
    let fired = eventually(Duration::from_secs(30), || count.load(Ordering::SeqCst) > 0);
    for _ in 0..3 {
        let _ = comm.barrier().and_then(|w| w.wait());
    }
    std::thread::sleep(Duration::from_millis(50));
    let msg = lock(&first).clone();
    if rank == 0 {
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        assert_eq!(msg, Some(e.to_string()));
    } else {
        // Another rank may hear of the failure from rank 0 before its own timeout.
        assert!(e.is_fatal(), "{e}");
    }
    assert!(fired, "rank {rank}: the abort hook never ran");
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "abort hooks run once per communicator"
    );
    assert_eq!(
        removed.load(Ordering::SeqCst),
        0,
        "a removed abort hook ran"
    );
    Ok(())
}

pub(super) fn abort_hooks_on_abort(cx: &Cx) -> R<()> {
    let comm = cx.fresh("aborting")?;
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let _keep = comm.register_abort_hook(move |e| {
        assert!(e.to_string().contains("stop now"), "{e}");
        c.fetch_add(1, Ordering::SeqCst);
    });
    // Every rank aborts at the same point: the hooks of this rank fire at once, once. A peer
    // that leaves the barrier first may abort before this rank's barrier returns (its abort
    // reaches this rank: the barrier fails with the peer's reason and the hooks fire for it).
    if let Err(e) = comm.barrier().and_then(|w| w.wait()) {
        if !e.to_string().contains("stop now") {
            return Err(e.into());
        }
    }
    comm.abort("stop now");
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "abort runs the hooks at once"
    );
    comm.abort("stop again");
    let _ = comm.barrier().and_then(|w| w.wait());
    assert_eq!(count.load(Ordering::SeqCst), 1);
    Ok(())
}

/// How long the hooks of the two cases below take: long enough that an observer which does not
/// wait for them returns before they finish.
const SLOW_HOOK: Duration = Duration::from_millis(150);

/// Registers an abort hook that sleeps [`SLOW_HOOK`] and then counts its runs.
fn slow_counting_hook(comm: &Comm) -> Arc<AtomicUsize> {
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    // Dropping the handle keeps the hook for the communicator's life.
    let _keep = comm.register_abort_hook(move |_| {
        std::thread::sleep(SLOW_HOOK);
        c.fetch_add(1, Ordering::SeqCst);
    });
    count
}

pub(super) fn failed_wait_returns_after_the_hooks(cx: &Cx) -> R<()> {
    let (n, rank) = (cx.size(), cx.rank());
    let comm = cx.short();
    let count = slow_counting_hook(&comm);
    comm.barrier()?.wait()?;
    if rank == n - 1 {
        return Ok(());
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    // The failure is observed on the backend's thread (a timeout, or a peer's report); the
    // waiter must not wake before the hooks it set off have finished.
    let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "timeout");
    assert!(e.is_fatal(), "{e}");
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "rank {rank}: a failed wait returned before the abort hooks had run"
    );
    Ok(())
}

pub(super) fn concurrent_aborts_return_after_the_hooks(cx: &Cx) -> R<()> {
    let comm = cx.fresh("racing-aborts")?;
    let count = slow_counting_hook(&comm);
    let start = Arc::new(std::sync::Barrier::new(3));
    let racers: Vec<_> = (0..3)
        .map(|i| {
            let (comm, start, count) = (comm.clone(), start.clone(), count.clone());
            std::thread::spawn(move || {
                start.wait();
                comm.abort(&format!("racer {i}"));
                count.load(Ordering::SeqCst)
            })
        })
        .collect();
    for r in racers {
        let seen = r.join().map_err(|_| "an aborting thread panicked")?;
        assert_eq!(seen, 1, "an abort returned before the abort hooks had run");
    }
    Ok(())
}

fn entries(d: &serde_json::Value) -> Vec<serde_json::Value> {
    d["entries"].as_array().cloned().unwrap_or_default()
}

pub(super) fn flight_recorder(cx: &Cx) -> R<()> {
    let (n, rank) = (cx.size(), cx.rank());
    let comm = cx.fresh("frtest")?.with_timeout(cx.sel.fault_timeout);
    let Some(fr) = comm.flight_recorder().cloned() else {
        return Ok(()); // disabled by the options of the communicator under test
    };
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    comm.all_reduce(&x, ReduceOp::Sum)?.wait()?; // seq 1
    comm.all_gather_single(&x)?.wait()?; // seq 2
    if rank == n - 1 {
        return Ok(());
    }
    let w1 = comm.all_reduce(&x, ReduceOp::Sum)?; // seq 3: the last rank never comes
    let w2 = comm.barrier()?; // seq 4
    let w3 = comm.all_gather_single(&x)?; // seq 5
    let during = fr.dump_json(true);
    let e = fails(w1.wait(), "seq 3");
    let _ = w2.wait();
    let _ = w3.wait();
    let (after, failed_only) = (fr.dump_json(true), fr.dump_json(false));
    if rank != 0 {
        // Only rank 0 is sure to time out itself; the others may hear of it first.
        return Ok(());
    }
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    let d = entries(&during);
    assert_eq!(d.len(), 5, "{during}");
    for (i, (op, state)) in [
        ("all_reduce", "completed"),
        ("all_gather_single", "completed"),
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(d[i]["op"], *op, "{during}");
        assert_eq!(d[i]["state"], *state, "{during}");
        assert_eq!(d[i]["seq"], i + 1, "{during}");
        assert_eq!(d[i]["comm"], "frtest");
        assert_eq!(d[i]["dtype"], "f32");
        assert_eq!(d[i]["shapes"], serde_json::json!([[4]]));
        assert!(d[i]["duration_us"].is_u64(), "{during}");
    }
    let s = d[2]["state"].as_str().unwrap_or("");
    assert!(s == "in_progress" || s == "not_started", "{during}");
    assert_eq!(d[3]["state"], "not_started", "{during}");
    assert_eq!(d[3]["op"], "barrier");
    assert_eq!(d[4]["state"], "not_started", "{during}");
    assert!(d[4]["queued_us"].is_null(), "{during}");

    let a = entries(&after);
    assert_eq!(a[2]["state"], "timed_out", "{after}");
    assert!(
        a[2]["error"].as_str().unwrap_or("").contains("timed out"),
        "{after}"
    );
    assert_eq!(a[3]["state"], "error", "{after}");
    assert_eq!(a[4]["state"], "error", "{after}");
    let f: Vec<_> = entries(&failed_only)
        .iter()
        .map(|e| e["seq"].clone())
        .collect();
    assert_eq!(f, vec![3, 4, 5], "{failed_only}");
    Ok(())
}
