//! One-sided RMA windows (run only where the backend has them).

use super::*;

pub(super) fn ring_put_signal_get_fence(cx: &Cx) -> R<()> {
    let (me, n, comm) = (cx.rank(), cx.size(), &cx.comm);
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let w = comm.new_window(64 * 4)?;
    assert_eq!(w.size_bytes(), 256);
    assert_eq!(w.comm().name(), comm.name());
    let mine: Vec<f32> = (0..8).map(|i| (me * 100 + i) as f32).collect();
    // Put at element 8 (bytes 32..64) of the right neighbour's window, then signal.
    w.put(&Tensor::new(mine.as_slice(), &Device::Cpu)?, right, 8)?;
    w.signal(right)?;
    w.wait_signal(left)?;
    let from_left = w.get(me, 8, 8, DType::F32)?.to_vec1::<f32>()?;
    // After a fence every put is visible to everyone: read the right neighbour's.
    w.fence()?;
    let at_right = w.get(right, 8, 8, DType::F32)?.to_vec1::<f32>()?;
    // The untouched head of the window is still zero, in any dtype.
    let head = w.get(left, 0, 32, DType::U8)?.to_vec1::<u8>()?;
    // Other dtypes at their own element offsets: u8 at byte 200, i64 at byte 16.
    w.put(&Tensor::new(&[me as u8 + 1, 7], &Device::Cpu)?, left, 200)?;
    w.put(&Tensor::new(&[-(me as i64)], &Device::Cpu)?, left, 2)?;
    w.fence()?;
    let bytes = w.get(me, 200, 2, DType::U8)?.to_vec1::<u8>()?;
    let long = w.get(me, 2, 1, DType::I64)?.to_vec1::<i64>()?;
    w.fence()?;
    let want = |r: usize| (0..8).map(|i| (r * 100 + i) as f32).collect::<Vec<_>>();
    assert_eq!(from_left, want(left), "world {n}, rank {me}");
    assert_eq!(at_right, want(me), "world {n}, rank {me}");
    assert_eq!(head[..16], [0u8; 16], "world {n}, rank {me}");
    assert_eq!(bytes, vec![right as u8 + 1, 7], "world {n}, rank {me}");
    assert_eq!(long, vec![-(right as i64)], "world {n}, rank {me}");
    Ok(())
}

pub(super) fn signals_count_and_time_out(cx: &Cx) -> R<()> {
    let (me, comm) = (cx.rank(), &cx.comm);
    // Window ops run under the timeout of the handle the window was made from: a short one
    // for the wait that must time out, the case's for the fences.
    let short = cx.short().new_window(16)?;
    let w = comm.new_window(16)?;
    if me == 1 {
        short.signal(0)?;
        short.signal(0)?;
    }
    w.fence()?;
    if me == 0 {
        short.wait_signal(1)?;
        short.wait_signal(1)?;
        let t0 = Instant::now();
        let e = fails(short.wait_signal(1), "third wait");
        let took = t0.elapsed();
        match &e {
            CommError::Timeout { missing, .. } => assert_eq!(missing, &vec![1], "{e}"),
            other => panic!("{other}"),
        }
        assert_ctx(&e, "window_wait_signal", comm.name(), 0);
        // The short handle's timeout was honoured: not before it (a lower bound, load only
        // adds), and not the case communicator's long one (three quarters of the way to it:
        // generous, so load alone cannot fail it).
        let (t, long) = (cx.sel.fault_timeout, comm.timeout());
        assert!(
            took + Duration::from_millis(20) >= t && took < t + long.saturating_sub(t) * 3 / 4,
            "{took:?} with a timeout of {t:?} (the communicator's: {long:?})"
        );
    }
    // A timed-out wait breaks the communicator, like a missed collective: later ops fail fast
    // on every rank instead of hanging.
    let after = w.fence();
    assert!(
        matches!(after, Err(CommError::Aborted { .. })),
        "rank {me}: later ops must fail fast, got {after:?}"
    );
    Ok(())
}

pub(super) fn out_of_range_accesses(cx: &Cx) -> R<()> {
    let (me, n, comm) = (cx.rank(), cx.size(), &cx.comm);
    let w = comm.new_window(64)?; // 16 f32
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let errs = vec![
        ("window_put", fails(w.put(&x, 1, 13), "put past the end")),
        ("window_put", fails(w.put(&x, n, 0), "put to rank n")),
        (
            "window_get",
            fails(w.get(0, 15, 2, DType::F32), "get past the end"),
        ),
        (
            "window_get",
            fails(w.get(0, usize::MAX, 2, DType::F32), "overflowing offset"),
        ),
        (
            "window_get",
            fails(w.get(n + 3, 0, 1, DType::F32), "get from rank n + 3"),
        ),
        ("window_signal", fails(w.signal(n), "signal rank n")),
        (
            "window_wait_signal",
            fails(w.wait_signal(n + 1), "wait on rank n + 1"),
        ),
    ];
    for (op, e) in &errs {
        assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
        assert_ctx(e, op, comm.name(), me);
    }
    assert!(
        errs[0].1.to_string().contains("64-byte window"),
        "{}",
        errs[0].1
    );
    // Exactly the end is fine.
    w.put(&x, (me + 1) % n, 12)?;
    w.fence()?;
    let tail = w.get(me, 12, 4, DType::F32)?.to_vec1::<f32>()?;
    assert_eq!(tail, vec![1.0; 4], "rank {me}");
    let e = fails(w.get(me, 0, 1, DType::I32), "i32 get");
    assert!(matches!(e, CommError::UnsupportedDType { .. }), "{e}");
    Ok(())
}
