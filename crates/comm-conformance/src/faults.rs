//! Faults: missing ranks, desync, abort, dropped work.

use super::*;

pub(super) fn skipped_collective_times_out(cx: &Cx) -> R<()> {
    // The last rank skips an all_reduce: the others time out naming it, with the seq and op,
    // and the communicator is unusable afterwards (and says why, at once).
    let (n, me) = (cx.size(), cx.rank());
    let t = cx.sel.fault_timeout;
    let comm = cx.short();
    comm.barrier()?.wait()?; // seq 1
    if me == n - 1 {
        return Ok(()); // skips the all_reduce
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let t0 = Instant::now();
    let e = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "skipped"); // seq 2
    let took = t0.elapsed();
    // The later op runs under the case's (long) op timeout: it must fail at once, not wait
    // that out, and the bound below is relative to it, so load alone cannot fail it.
    let long = cx.comm.timeout();
    let t1 = Instant::now();
    let later = fails(
        comm.with_timeout(long).barrier().and_then(|w| w.wait()),
        "after timeout",
    );
    let later_took = t1.elapsed();
    match &e {
        CommError::Timeout { ctx, missing, .. } => {
            assert_eq!(missing, &vec![n - 1], "rank {me}: {e}");
            assert_eq!((ctx.seq, ctx.op.as_str()), (2, "all_reduce"), "{e}");
        }
        other => panic!("rank {me}: expected a timeout, got {other}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("seq 2") && msg.contains(&format!("[{}]", n - 1)),
        "{msg}"
    );
    // The handle's timeout was honoured: not before it (a lower bound, load only adds), and
    // not the communicator's long one (three quarters of the way to it: a generous bound
    // that load alone cannot reach).
    assert!(took + Duration::from_millis(20) >= t, "rank {me}: {took:?}");
    assert!(
        took < t + long.saturating_sub(t) * 3 / 4,
        "rank {me}: {took:?} with a timeout of {t:?} (the communicator's: {long:?})"
    );
    assert!(matches!(later, CommError::Aborted { .. }), "{later}");
    assert!(later.to_string().contains("timed out"), "{later}");
    assert_prompt(
        later_took,
        long,
        &format_args!("rank {me}: an op after the timeout"),
    );
    Ok(())
}

pub(super) fn recv_without_send_times_out(cx: &Cx) -> R<()> {
    let comm = cx.short();
    if cx.rank() != 1 {
        return Ok(());
    }
    let e = fails(comm.recv(0, 4, DType::F32)?.wait(), "recv");
    match &e {
        CommError::Timeout { missing, .. } => {
            assert_eq!(missing, &vec![0], "{e}");
            assert_ctx(&e, "recv", comm.name(), 1);
        }
        other => panic!("expected a timeout naming rank 0, got {other}"),
    }
    Ok(())
}

/// Runs a fresh communicator where the last rank issues `odd` and the others `even` at the
/// same point (seq 2, collective #1); checks every rank reports the desync, naming both sides.
fn one_desync(
    cx: &Cx,
    name: &str,
    even: impl Fn(&Comm) -> Result<(), CommError>,
    odd: impl Fn(&Comm) -> Result<(), CommError>,
    even_has: &str,
    odd_has: &str,
) -> R<()> {
    let (n, me) = (cx.size(), cx.rank());
    let odd_rank = n - 1;
    let comm = cx.fresh(name)?;
    let t0 = Instant::now();
    comm.barrier()?.wait()?;
    let r = if me == odd_rank {
        odd(&comm)
    } else {
        even(&comm)
    };
    let e = fails(r, "desynced op");
    // Detected, not timed out (relative to the op timeout, so load alone cannot fail it).
    assert_prompt(
        t0.elapsed(),
        comm.timeout(),
        &format_args!("{name}, rank {me}"),
    );
    match &e {
        CommError::Desync {
            ctx,
            collective,
            rank_a,
            op_a,
            rank_b,
            op_b,
        } => {
            assert_eq!(ctx.rank, me, "{e}");
            assert_eq!(ctx.seq, 2, "{e}");
            assert_eq!(*collective, 1, "{e}");
            // One side is the odd rank with `odd`, the other a peer with `even`.
            let sides = [(*rank_a, &**op_a), (*rank_b, &**op_b)];
            let (theirs, ours) = if sides[0].0 == odd_rank {
                (sides[0], sides[1])
            } else {
                (sides[1], sides[0])
            };
            assert_eq!(theirs.0, odd_rank, "{e}");
            assert!(ours.0 < odd_rank, "{e}");
            assert!(
                theirs.1.contains(odd_has),
                "{name}: odd side {:?} lacks {odd_has:?}: {e}",
                theirs.1
            );
            assert!(
                ours.1.contains(even_has),
                "{name}: peer side {:?} lacks {even_has:?}: {e}",
                ours.1
            );
        }
        other => panic!("{name}, rank {me}: expected a desync, got {other}"),
    }
    Ok(())
}

fn f32s(n: usize) -> Tensor {
    Tensor::ones(n, DType::F32, &Device::Cpu).expect("a CPU tensor")
}

pub(super) fn desync(cx: &Cx) -> R<()> {
    one_desync(
        cx,
        "desync-ops",
        |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
        |c| c.all_gather_single(&f32s(4))?.wait().map(drop),
        "all_reduce",
        "all_gather_single",
    )?;
    one_desync(
        cx,
        "desync-dtypes",
        |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
        |c| {
            let x = Tensor::ones(4, DType::F64, &Device::Cpu).expect("a CPU tensor");
            c.all_reduce(&x, ReduceOp::Sum)?.wait().map(drop)
        },
        "f32",
        "f64",
    )?;
    one_desync(
        cx,
        "desync-sizes",
        |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
        |c| c.all_reduce(&f32s(5), ReduceOp::Sum)?.wait().map(drop),
        "[4]",
        "[5]",
    )?;
    // Small on some ranks, large (another data path) on another.
    one_desync(
        cx,
        "desync-paths",
        |c| c.all_gather_single(&f32s(4))?.wait().map(drop),
        |c| c.all_gather_single(&f32s(LARGE_ELEMS))?.wait().map(drop),
        "[4]",
        "[70000]",
    )?;
    one_desync(
        cx,
        "desync-reduce-ops",
        |c| c.all_reduce(&f32s(4), ReduceOp::Sum)?.wait().map(drop),
        |c| c.all_reduce(&f32s(4), ReduceOp::Max)?.wait().map(drop),
        "sum",
        "max",
    )?;
    one_desync(
        cx,
        "desync-roots",
        |c| c.broadcast(&f32s(4), 0)?.wait().map(drop),
        |c| c.broadcast(&f32s(4), 1)?.wait().map(drop),
        "root 0",
        "root 1",
    )
}

pub(super) fn abort_from_another_thread(cx: &Cx) -> R<()> {
    // Rank 0's watchdog aborts while the others wait in an all_reduce (the last rank joins late,
    // after the abort): every pending and later op fails at once, on every rank, naming the
    // rank that aborted and why.
    let (n, me) = (cx.size(), cx.rank());
    let comm = cx.fresh("abortee")?;
    let late = me == n - 1;
    let watchdog = (me == 0).then(|| {
        let c = comm.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            c.abort("operator pulled the plug");
        })
    });
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let t0 = Instant::now();
    if late {
        std::thread::sleep(Duration::from_millis(400));
    }
    let pending = fails(comm.all_reduce(&x, ReduceOp::Sum)?.wait(), "pending");
    let took = t0.elapsed();
    let t1 = Instant::now();
    let later: Vec<CommError> = vec![
        fails(comm.barrier().and_then(|w| w.wait()), "barrier"),
        fails(
            comm.all_gather_single(&x).and_then(|w| w.wait()),
            "all_gather",
        ),
        fails(comm.send(&x, 0).and_then(|w| w.wait()), "send after abort"),
        fails(comm.recv(0, 4, DType::F32).and_then(|w| w.wait()), "recv"),
        fails(
            comm.split(&(0..n).collect::<Vec<_>>(), "child"),
            "split after abort",
        ),
    ];
    let later_took = t1.elapsed();
    if let Some(w) = watchdog {
        w.join().map_err(|_| "watchdog panicked")?;
    }
    assert!(comm.is_aborted(), "rank {me}");
    assert!(
        matches!(pending, CommError::Aborted { .. }),
        "rank {me}: {pending}"
    );
    assert_ctx(&pending, "all_reduce", comm.name(), me);
    let msg = pending.to_string();
    assert!(
        msg.contains("aborted by rank 0") && msg.contains("operator pulled the plug"),
        "{msg}"
    );
    // The abort (150 ms in) ends the pending op, not the op timeout; later ops (and the
    // split) fail at once. Bounds relative to the timeouts, so load alone cannot fail them.
    if !late {
        assert_prompt(
            took,
            comm.timeout(),
            &format_args!("rank {me}: the aborted op"),
        );
    }
    for e in &later {
        assert!(e.is_fatal(), "rank {me}: later op failed with {e}");
        assert!(
            e.to_string().contains("operator pulled the plug"),
            "rank {me}: {e}"
        );
    }
    assert_prompt(
        later_took,
        shorter_timeout(&comm),
        &format_args!("rank {me}: ops after the abort"),
    );
    Ok(())
}

pub(super) fn abort_of_an_idle_comm(cx: &Cx) -> R<()> {
    let comm = cx.fresh("idle")?;
    let t0 = Instant::now();
    comm.abort("first");
    comm.abort("second");
    // abort() does not block on the peers (relative to the timeouts it could wait out, so
    // load alone cannot fail it).
    assert_prompt(
        t0.elapsed(),
        shorter_timeout(&comm),
        &"aborting an idle communicator twice",
    );
    assert!(comm.is_aborted());
    let e = fails(comm.barrier().and_then(|w| w.wait()), "after abort");
    // The first reason wins on every rank.
    assert!(e.to_string().contains("first"), "{e}");
    Ok(())
}

pub(super) fn dropped_work(cx: &Cx) -> R<()> {
    let (n, me, comm) = (cx.size(), cx.rank(), &cx.comm);
    let mf = me as f64;
    let small = tensor(&[mf; 5], &[5], DType::F32)?;
    let large = tensor(&vec![mf; LARGE_ELEMS], &[LARGE_ELEMS], DType::F32)?;
    let large_rs = tensor(&vec![mf; n * LARGE_ELEMS], &[n * LARGE_ELEMS], DType::F32)?;
    drop(comm.all_reduce(&small, ReduceOp::Sum)?);
    drop(comm.all_gather_single(&large)?);
    drop(comm.reduce_scatter_single(&large_rs, ReduceOp::Sum)?);
    // The caller's input may go away right after issuing; the op still runs.
    drop(large);
    drop(large_rs);
    drop(comm.send(&small, (me + 1) % n)?);
    let y = comm.all_reduce(&small, ReduceOp::Max)?.wait()?;
    let r = comm.recv((me + n - 1) % n, 5, DType::F32)?.wait()?;
    comm.barrier()?.wait()?;
    // A progress thread may clear its "running" mark just after completing the work, so
    // `pending()` may count the barrier for a moment after `wait()` returned. (Polled for up to
    // 30 s only so that a loaded machine cannot fail it: it ends as soon as nothing is pending.)
    let drained = eventually(Duration::from_secs(30), || comm.pending() == 0);
    assert_eq!(out(&y)?.1, vec![(n - 1) as f64; 5], "rank {me}");
    assert_eq!(out(&r)?.1, vec![((me + n - 1) % n) as f64; 5], "rank {me}");
    assert!(drained, "rank {me}: {} ops still pending", comm.pending());
    Ok(())
}
