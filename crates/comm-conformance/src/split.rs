//! `Comm::split`: sub-communicators, non-members, bad lists.

use super::*;

/// All-gathers each rank's parent rank over `c`, and all-reduces (sums) it.
fn members_of(c: &Comm, parent_rank: usize) -> R<(Vec<u32>, f64)> {
    let x = Tensor::new(&[parent_rank as u32], &Device::Cpu)?;
    let g = c.all_gather_single(&x)?.wait()?.to_vec1::<u32>()?;
    let s = c
        .all_reduce(
            &Tensor::new(&[parent_rank as f64], &Device::Cpu)?,
            ReduceOp::Sum,
        )?
        .wait()?
        .to_vec1::<f64>()?[0];
    Ok((g, s))
}

fn sum(v: &[u32]) -> f64 {
    v.iter().map(|&x| x as f64).sum()
}

pub(super) fn rows_and_columns(cx: &Cx) -> R<()> {
    // A rows x cols layout (2 x 3 on 6 ranks, 2 x 2 on 4, 1 x n on primes).
    let (n, r, comm) = (cx.size(), cx.rank(), &cx.comm);
    let cols = [3, 2]
        .into_iter()
        .find(|c| n % c == 0 && n > *c)
        .unwrap_or(n);
    let rows_n = n / cols;
    let (row, col) = (r / cols, r % cols);
    let row_list: Vec<usize> = (0..cols).map(|c| row * cols + c).collect();
    let col_list: Vec<usize> = (0..rows_n).map(|x| x * cols + col).collect();
    let rows = comm.split(&row_list, "row")?.expect("a member");
    let colc = comm.split(&col_list, "col")?.expect("a member");
    assert_eq!((rows.rank(), rows.size(), rows.name()), (col, cols, "row"));
    assert_eq!(
        (colc.rank(), colc.size(), colc.name()),
        (row, rows_n, "col")
    );
    // The sub-comms and the parent interleave freely.
    let a = members_of(&rows, r)?;
    let w = members_of(comm, r)?;
    let b = members_of(&colc, r)?;
    let row_w: Vec<u32> = row_list.iter().map(|&x| x as u32).collect();
    let col_w: Vec<u32> = col_list.iter().map(|&x| x as u32).collect();
    assert_eq!(a, (row_w.clone(), sum(&row_w)), "rank {r}: row");
    assert_eq!(b, (col_w.clone(), sum(&col_w)), "rank {r}: column");
    let all: Vec<u32> = (0..n as u32).collect();
    assert_eq!(w, (all.clone(), sum(&all)), "rank {r}: parent");
    Ok(())
}

pub(super) fn list_order_defines_new_ranks(cx: &Cx) -> R<()> {
    // [n-1, 1, 2, ..., n-2, 0]: a permutation that moves the ends (e.g. [3, 1, 2, 0]).
    let (n, r) = (cx.size(), cx.rank());
    let mut order: Vec<usize> = (0..n).collect();
    order.swap(0, n - 1);
    let c = cx.comm.split(&order, "perm")?.expect("a member");
    assert_eq!(order[c.rank()], r, "rank {r}: new rank {}", c.rank());
    let g = members_of(&c, r)?.0;
    assert_eq!(
        g,
        order.iter().map(|&x| x as u32).collect::<Vec<_>>(),
        "rank {r}"
    );
    Ok(())
}

pub(super) fn non_members_get_none(cx: &Cx) -> R<()> {
    // The even ranks, largest first; the odd ones opt out.
    let (n, r, comm) = (cx.size(), cx.rank(), &cx.comm);
    let mut evens: Vec<usize> = (0..n).filter(|x| x % 2 == 0).collect();
    evens.rotate_right(1);
    let list: &[usize] = if r % 2 == 0 { &evens } else { &[] };
    let sub = comm.split(list, "evens")?;
    match &sub {
        Some(c) => {
            assert_eq!(r % 2, 0, "rank {r}: an odd rank got a communicator");
            let new = evens.iter().position(|&x| x == r).expect("listed");
            let g = members_of(c, r)?.0;
            assert_eq!(
                (c.rank(), c.size(), g),
                (
                    new,
                    evens.len(),
                    evens.iter().map(|&x| x as u32).collect::<Vec<_>>()
                ),
                "rank {r}"
            );
        }
        None => assert_eq!(r % 2, 1, "rank {r}: an even rank got none"),
    }
    // The parent is unaffected.
    comm.barrier()?.wait()?;
    Ok(())
}

pub(super) fn nested_splits(cx: &Cx) -> R<()> {
    // Halves, quarters (halves of halves) and single-rank groups, each a split of the last;
    // each level gathers over its group (8 ranks: a 2 x 2 x 2 layout).
    let (n, r, comm) = (cx.size(), cx.rank(), &cx.comm);
    // The half of `group` (world ranks) that holds `me`.
    let halves = |group: &[usize]| -> Vec<usize> {
        let mid = group.len() / 2;
        let pos = group.iter().position(|&x| x == r).unwrap_or(0);
        if group.len() == 1 {
            group.to_vec()
        } else if pos < mid {
            group[..mid].to_vec()
        } else {
            group[mid..].to_vec()
        }
    };
    let all: Vec<usize> = (0..n).collect();
    let half = halves(&all);
    let h = comm.split(&half, "half")?.expect("member");
    let quarter_w = halves(&half);
    let quarter: Vec<usize> = quarter_w
        .iter()
        .filter_map(|w| half.iter().position(|x| x == w))
        .collect();
    assert_eq!(half[h.rank()], r, "rank {r}");
    let q = h.split(&quarter, "quarter")?.expect("member");
    // Single-rank groups: each rank alone.
    let solo = q.split(&[q.rank()], "solo")?.expect("member");
    let got = (
        members_of(&h, r)?.0,
        members_of(&q, r)?.0,
        members_of(&solo, r)?.0,
    );
    let w = |v: &[usize]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
    assert_eq!(got, (w(&half), w(&quarter_w), vec![r as u32]), "rank {r}");
    Ok(())
}

pub(super) fn same_name_splits_are_independent(cx: &Cx) -> R<()> {
    // Two splits with the same name at different points give different comms.
    let (n, r, comm) = (cx.size(), cx.rank(), &cx.comm);
    let fwd: Vec<usize> = (0..n).collect();
    let rev: Vec<usize> = (0..n).rev().collect();
    let a = comm.split(&fwd, "dup")?.expect("member");
    comm.barrier()?.wait()?;
    let b = comm.split(&rev, "dup")?.expect("member");
    let g = members_of(&b, r)?.0;
    assert_eq!(
        (a.rank(), b.rank(), g),
        (r, n - 1 - r, rev.iter().map(|&x| x as u32).collect()),
        "rank {r}"
    );
    Ok(())
}

/// Runs `list(rank)` as a split of a fresh communicator, checking it fails fast.
fn bad_split(
    cx: &Cx,
    name: &str,
    list: impl Fn(usize) -> Vec<usize>,
) -> R<(Comm, Result<bool, CommError>)> {
    let c = cx.fresh(name)?;
    let t0 = Instant::now();
    let r = c.split(&list(c.rank()), "bad").map(|c| c.is_some());
    // Fast: not after the bootstrap (or op) timeout; relative to it, so load cannot fail it.
    assert_prompt(
        t0.elapsed(),
        shorter_timeout(&c),
        &format_args!("rank {}: a bad split ({name})", cx.rank()),
    );
    Ok((c, r))
}

fn assert_invalid(comm: &Comm, r: &Result<bool, CommError>, needle: &str) {
    let rank = comm.rank();
    match r {
        Err(e @ CommError::InvalidArgument { .. }) => {
            assert_ctx(e, "split", comm.name(), rank);
            assert!(e.to_string().contains(needle), "rank {rank}: {e}");
        }
        other => panic!("rank {rank}: expected InvalidArgument with {needle:?}, got {other:?}"),
    }
}

pub(super) fn invalid_lists(cx: &Cx) -> R<()> {
    let n = cx.size();
    let (c, r) = bad_split(cx, "bad-range", |_| vec![0, n])?;
    assert_invalid(&c, &r, &format!("rank {n} out of range"));
    let (c, r) = bad_split(cx, "bad-dup", |me| vec![me, me])?;
    assert_invalid(&c, &r, "appears twice");
    if n > 1 {
        let (c, r) = bad_split(cx, "bad-caller", |me| vec![(me + 1) % n])?;
        assert_invalid(&c, &r, "does not contain the caller");
    }
    Ok(())
}

pub(super) fn members_that_disagree(cx: &Cx) -> R<()> {
    let n = cx.size();
    // Every split below is collective over a fresh communicator, on every rank.
    // A member that opts out while another lists it.
    let (c, r) = bad_split(cx, "dis-optout", |me| match me {
        0 => vec![0, 1],
        1 => vec![],
        x => vec![x],
    })?;
    assert_invalid(&c, &r, "split lists disagree");
    if n >= 4 {
        // Same members, different order.
        let (c, r) = bad_split(cx, "dis-order", |me| match me {
            0 => vec![0, 1],
            1 => vec![1, 0],
            x => (2..n).filter(|_| x >= 2).collect(),
        })?;
        assert_invalid(&c, &r, "split lists disagree");
        // Rank 0 claims rank 1, but rank 1 formed a group with rank 2: rank 1 (and 2) must
        // hear of it too, not walk away with a communicator rank 0 thinks it shares.
        let (c, r) = bad_split(cx, "dis-claim", |me| match me {
            0 => vec![0, 1],
            1 | 2 => vec![1, 2],
            x => vec![x],
        })?;
        assert_invalid(&c, &r, "split lists disagree");
    }
    Ok(())
}

pub(super) fn rank_rejecting_its_list(cx: &Cx) -> R<()> {
    // Rank 0's list is invalid locally, so it never joins; the others must not hang: they time
    // out (after the bootstrap timeout) naming rank 0.
    let n = cx.size();
    let c = cx.fresh("reject")?;
    let bootstrap = c.options().bootstrap_timeout;
    let list = if c.rank() == 0 {
        vec![0, n + 4]
    } else {
        (0..n).collect()
    };
    let t0 = Instant::now();
    let r = c.split(&list, "half").map(|c| c.is_some());
    let took = t0.elapsed();
    // After the bootstrap timeout, not the (longer) op timeout: the bound lies three quarters
    // of the way from one to the other (at least 2 s past the bootstrap timeout), so load
    // alone cannot fail it while waiting out the op timeout still does.
    let limit =
        bootstrap + (c.timeout().saturating_sub(bootstrap) * 3 / 4).max(Duration::from_secs(2));
    assert!(
        took < limit,
        "rank {}: took {took:?} (bootstrap timeout {bootstrap:?}, op timeout {:?})",
        c.rank(),
        c.timeout()
    );
    if c.rank() == 0 {
        assert!(matches!(r, Err(CommError::InvalidArgument { .. })), "{r:?}");
    } else {
        match &r {
            Err(CommError::Timeout { missing, ctx, .. }) => {
                assert_eq!(missing, &vec![0], "rank {}", c.rank());
                assert_eq!(ctx.op.as_str(), "split");
            }
            other => panic!(
                "rank {}: expected a timeout naming rank 0, got {other:?}",
                c.rank()
            ),
        }
    }
    Ok(())
}
