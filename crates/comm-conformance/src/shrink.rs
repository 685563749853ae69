//! `Comm::shrink` on a healthy communicator: the excluded ranks simply do not call it. What
//! happens when they are dead (a failed thread, a killed process) needs a launcher that can
//! kill one, so it is tested by the backends' own tests (`crates/comm/tests/conformance.rs` for
//! `local`, `crates/comm-process/src/tests.rs` for `process`).

use super::*;

/// Each member's old rank, all-gathered over `c`, and their sum all-reduced.
fn old_ranks(c: &Comm, old: usize) -> R<(Vec<u32>, f64)> {
    let x = Tensor::new(&[old as u32], &Device::Cpu)?;
    let g = c.all_gather_single(&x)?.wait()?.to_vec1::<u32>()?;
    // Distinct, fractional summands: a wrong member set or order shows in the sum.
    let y = Tensor::new(&[old as f64 + 0.25 * old as f64], &Device::Cpu)?;
    let s = c.all_reduce(&y, ReduceOp::Sum)?.wait()?.to_vec1::<f64>()?[0];
    Ok((g, s))
}

pub(super) fn without_the_last_rank(cx: &Cx) -> R<()> {
    let (n, r) = (cx.size(), cx.rank());
    let c = cx.fresh("shr")?;
    if r == n - 1 {
        // Excluded: it does not call shrink, and its parent communicator stays as it was.
        return Ok(());
    }
    let s = c.shrink(&[n - 1])?;
    assert_eq!((s.rank(), s.size(), s.name()), (r, n - 1, "shr"));
    let want: Vec<u32> = (0..n as u32 - 1).collect();
    let sum: f64 = want.iter().map(|&x| 1.25 * x as f64).sum();
    let (g, got) = old_ranks(&s, r)?;
    assert_eq!(g, want, "rank {r}");
    assert!(
        (got - sum).abs() <= 1e-12 * sum.max(1.0),
        "rank {r}: {got} vs {sum}"
    );
    // A shrunk communicator shrinks again (down to one rank), renumbering again.
    if n >= 3 {
        if r == 0 {
            return Ok(());
        }
        let t = s.shrink(&[0])?;
        assert_eq!((t.rank(), t.size()), (r - 1, n - 2));
        let want: Vec<u32> = (1..n as u32 - 1).collect();
        assert_eq!(old_ranks(&t, r)?.0, want, "rank {r}");
    }
    Ok(())
}

fn assert_invalid(c: &Comm, e: &CommError, needle: &str) {
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    assert_ctx(e, "shrink", c.name(), c.rank());
    assert!(e.to_string().contains(needle), "rank {}: {e}", c.rank());
}

pub(super) fn invalid_lists(cx: &Cx) -> R<()> {
    let (n, r) = (cx.size(), cx.rank());
    let c = cx.fresh("shr-bad")?;
    // Every rank passes the same bad list, so every rank reports it, at once, naming the ranks.
    let t0 = Instant::now();
    let all: Vec<usize> = (0..n).collect();
    let e = fails(c.shrink(&all), "excluding every rank");
    assert_invalid(&c, &e, "keep at least one");
    let e = fails(c.shrink(&[]), "excluding nobody");
    assert_invalid(&c, &e, "exclude at least one");
    let e = fails(c.shrink(&[n]), "out of range");
    assert_invalid(&c, &e, &format!("rank {n} out of range"));
    let other = (r + 1) % n;
    let e = fails(c.shrink(&[other, other]), "twice");
    assert_invalid(&c, &e, &format!("rank {other} appears twice"));
    let e = fails(c.shrink(&[r]), "itself");
    assert_invalid(&c, &e, &format!("rank {r} excludes itself"));
    // Not after a timeout (relative to it, so load alone cannot fail this).
    assert_prompt(
        t0.elapsed(),
        shorter_timeout(&c),
        &format_args!("rank {r}: bad shrink lists"),
    );
    // Backends that agree on the lists: rank 0 alone passes a bad list (the others exclude rank
    // n-1, which excludes itself): every rank reports rank 0's list at once, not a timeout.
    if c.capabilities().shrink && c.backend_name() != "nccl" {
        let t0 = Instant::now();
        let mine: Vec<usize> = if r == 0 { vec![n + 5] } else { vec![n - 1] };
        let e = fails(c.shrink(&mine), "rank 0 alone is wrong");
        // The wrong ranks report their own mistakes, the others rank 0's (from the agreement).
        let needle = match r {
            0 => format!("rank {} out of range", n + 5),
            x if x == n - 1 => format!("rank {x} excludes itself"),
            _ => format!("rank 0 excludes [{}]", n + 5),
        };
        assert_invalid(&c, &e, &needle);
        assert_prompt(
            t0.elapsed(),
            shorter_timeout(&c),
            &format_args!("rank {r}: rank 0's bad shrink list"),
        );
    }
    // Nothing was consumed: the communicator still works and still shrinks.
    if r == n - 1 {
        return Ok(());
    }
    let s = c.shrink(&[n - 1])?;
    assert_eq!(s.size(), n - 1);
    s.barrier()?.wait()?;
    Ok(())
}

pub(super) fn members_that_disagree(cx: &Cx) -> R<()> {
    let (n, r) = (cx.size(), cx.rank());
    let c = cx.fresh("shr-dis")?;
    // Rank n-1 is excluded by everyone and does not call; rank 0 also excludes rank n-2.
    if r == n - 1 {
        return Ok(());
    }
    let mine: Vec<usize> = if r == 0 {
        vec![n - 2, n - 1]
    } else {
        vec![n - 1]
    };
    let t0 = Instant::now();
    let e = fails(c.shrink(&mine), "members disagree");
    // Nobody waits for a timeout: every proposal reached every member (bounded relative to
    // the timeouts, so load alone cannot fail it).
    assert_prompt(
        t0.elapsed(),
        shorter_timeout(&c),
        &format_args!("rank {r}: disagreeing shrink"),
    );
    match &e {
        CommError::ShrinkDisagree { proposals, .. } => {
            assert_ctx(&e, "shrink", c.name(), r);
            let zero = proposals.iter().find(|p| p.0 == 0).map(|p| p.1.clone());
            assert_eq!(zero, Some(vec![n - 2, n - 1]), "rank {r}: {e}");
            assert!(
                e.to_string()
                    .contains(&format!("rank 1 excludes [{}]", n - 1)),
                "rank {r}: {e}"
            );
        }
        other => panic!("rank {r}: expected ShrinkDisagree, got {other}"),
    }
    Ok(())
}
