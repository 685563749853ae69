//! Different communicators progress independently.

use super::*;

pub(super) fn comm_b_completes_while_comm_a_waits(cx: &Cx) -> R<()> {
    // Rank 1 joins B at once and A only after 300 ms; everyone else issues A first and then B.
    // B must complete while A is still waiting: one communicator never stalls another (issued
    // in opposite orders on different ranks, too).
    let (n, me) = (cx.size(), cx.rank());
    let a = cx.fresh("a")?;
    let b = cx.fresh("b")?;
    let x = Tensor::ones(1024, DType::F32, &Device::Cpu)?;
    let want = (1024 * n) as f32;
    if me == 1 {
        b.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        std::thread::sleep(Duration::from_millis(300));
        a.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        return Ok(());
    }
    let t0 = Instant::now();
    let wa = a.all_reduce(&x, ReduceOp::Sum)?;
    let yb = b.all_reduce(&x, ReduceOp::Sum)?.wait()?;
    let t_b = t0.elapsed();
    let a_done_at_b = wa.is_completed();
    let ya = wa.wait()?;
    let t_a = t0.elapsed();
    let sums = (
        ya.sum_all()?.to_scalar::<f32>()?,
        yb.sum_all()?.to_scalar::<f32>()?,
    );
    assert!(
        !a_done_at_b,
        "rank {me}: A finished before B ({t_b:?}, {t_a:?})"
    );
    assert!(t_b < t_a, "rank {me}: B at {t_b:?}, A at {t_a:?}");
    // A lower bound (rank 1 joins A 300 ms after B completed): load only makes it later. No
    // bound on the gap between B and A: that B completed while A still waited is what
    // `a_done_at_b` shows, whereas the gap shrinks when this rank is descheduled after B.
    assert!(t_a >= Duration::from_millis(250), "rank {me}: A at {t_a:?}");
    assert_eq!(sums, (want, want), "rank {me}");
    Ok(())
}

pub(super) fn all_gather_and_reduce_scatter(cx: &Cx) -> R<()> {
    // FSDP's pattern: an all-gather on one comm and a reduce-scatter on another, in flight
    // together, both large, both correct.
    let (n, me) = (cx.size(), cx.rank());
    let ag = cx.fresh("ag")?;
    let rs = cx.fresh("rs")?;
    let a = tensor(&copy_vals(me, LARGE_ELEMS, 0), &[LARGE_ELEMS], DType::F32)?;
    let r = tensor(
        &red_vals(me, n * LARGE_ELEMS, DType::F32, ReduceOp::Sum, 0),
        &[n * LARGE_ELEMS],
        DType::F32,
    )?;
    let w1 = ag.all_gather_single(&a)?;
    let w2 = rs.reduce_scatter_single(&r, ReduceOp::Sum)?;
    let (got_rs, got_ag) = (out(&w2.wait()?)?, out(&w1.wait()?)?);
    let gathered: Vec<f64> = (0..n).flat_map(|r| copy_vals(r, LARGE_ELEMS, 0)).collect();
    let ins: Vec<_> = (0..n)
        .map(|r| red_vals(r, n * LARGE_ELEMS, DType::F32, ReduceOp::Sum, 0))
        .collect();
    let red = reduce_ref(ReduceOp::Sum, DType::F32, &ins);
    let want_rs = (
        vec![LARGE_ELEMS],
        red[me * LARGE_ELEMS..(me + 1) * LARGE_ELEMS].to_vec(),
    );
    check(n, me, &"overlapped rs", &[got_rs], &[want_rs]);
    check(
        n,
        me,
        &"overlapped ag",
        &[got_ag],
        &[(vec![n * LARGE_ELEMS], gathered)],
    );
    Ok(())
}
