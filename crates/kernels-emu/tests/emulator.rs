//! The emulator itself: a correct kernel gives the right answer under every order, and each
//! kind of kernel bug it exists to find is reported.
use candle_dtensor_kernels_emu::{same_bits, selftest, Buf, EmuError, Launch, Order, ORDERS};

#[test]
fn a_block_reduction_is_right_under_every_order() {
    let (rows, n) = (3usize, 1000usize);
    let x: Vec<f32> = (0..rows * n)
        .map(|i| ((i * 7919) % 13) as f32 - 6.0)
        .collect();
    let want: Vec<f32> = x.chunks(n).map(|r| r.iter().sum()).collect();
    for threads in [32u32, 64, 256, 1024] {
        let mut outs = Vec::new();
        for order in ORDERS {
            let xb = Buf::from_slice("x", &x);
            let mut y = Buf::filled("y", rows, f32::NAN);
            selftest::row_sum(
                &Launch::linear(rows as u32, threads, 0),
                order,
                &xb,
                &mut y,
                n,
            )
            .unwrap();
            for (g, w) in y.as_slice().iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-3,
                    "{threads} threads {order:?}: {g} vs {w}"
                );
            }
            outs.push(y.as_slice().to_vec());
        }
        // The same reduction tree whatever the order: bit for bit.
        assert!(outs.windows(2).all(|w| same_bits(&w[0], &w[1])));
    }
}

#[test]
fn a_shuffle_from_a_lane_no_thread_runs_fails() {
    let x = Buf::from_slice("x", &[1.0f32; 200]);
    let mut y = Buf::filled("y", 1, 0.0);
    let e =
        selftest::row_sum(&Launch::linear(1, 200, 0), Order::Forward, &x, &mut y, 200).unwrap_err();
    let EmuError::Launch(m) = e else {
        panic!("{e:?}")
    };
    assert!(
        m.contains("row_sum") && m.contains("warp shuffle reads lane"),
        "{m}"
    );
}

#[test]
fn a_missing_barrier_shows_as_order_dependence() {
    let run = |order| {
        let mut y = Buf::filled("y", 64, 0.0);
        selftest::racy(&Launch::linear(1, 64, 0), order, &mut y).unwrap();
        y.as_slice().to_vec()
    };
    assert!(!same_bits(&run(Order::Forward), &run(Order::Reverse)));
}

#[test]
fn a_barrier_some_threads_skip_fails_and_names_them() {
    let mut y = Buf::filled("y", 64, 0.0);
    let e = selftest::deadlock(&Launch::linear(1, 64, 0), Order::Forward, &mut y).unwrap_err();
    let EmuError::Launch(m) = e else {
        panic!("{e:?}")
    };
    assert!(
        m.contains("kernel deadlock") && m.contains("10 __syncthreads"),
        "{m}"
    );
}

#[test]
fn unwritten_dynamic_shared_memory_reads_as_nan() {
    let mut y = Buf::filled("y", 8, 0.0);
    selftest::dyn_shared(&Launch::linear(1, 8, 32), Order::Forward, &mut y).unwrap();
    assert!(y.as_slice().iter().all(|v| v.is_nan()));
}

/// Static shared memory is NaN to a block that reads it before writing it, in every block
/// (without the poisoning the second block would read the first one's ones), and a thread's
/// writes stay when the others reach the declaration after them.
#[test]
fn unwritten_static_shared_memory_reads_as_nan_in_every_block() {
    for order in candle_dtensor_kernels_emu::ORDERS {
        let mut y = Buf::filled("y", 2 * 16, 0.0);
        selftest::stale_shared(&Launch::linear(2, 16, 0), order, &mut y, false).unwrap();
        assert!(
            y.as_slice().iter().all(|v| v.is_nan()),
            "{order:?}: {:?}",
            y.as_slice()
        );
        let mut y = Buf::filled("y", 2 * 16, f32::NAN);
        selftest::stale_shared(&Launch::linear(2, 16, 0), order, &mut y, true).unwrap();
        let want: Vec<f32> = (0..32).map(|i| (i % 16) as f32).collect();
        assert_eq!(y.as_slice(), want.as_slice(), "{order:?}");
    }
}

#[test]
fn a_write_past_the_end_is_caught() {
    let mut y = Buf::filled("y", 100, 0.0);
    let e = selftest::unguarded(&Launch::linear(1, 128, 0), Order::Forward, &mut y).unwrap_err();
    assert_eq!(
        e,
        EmuError::OutOfBounds {
            kernel: "unguarded".into(),
            buffer: "y".into(),
            len: 100,
            side: "after",
            offset: 0
        }
    );
    let mut y = Buf::filled("y", 128, 0.0);
    selftest::unguarded(&Launch::linear(1, 128, 0), Order::Forward, &mut y).unwrap();
}

#[test]
fn invalid_launches_are_refused() {
    let mut y = Buf::filled("y", 2048, 0.0);
    let e = selftest::unguarded(&Launch::linear(1, 2048, 0), Order::Forward, &mut y).unwrap_err();
    assert!(
        matches!(&e, EmuError::Launch(m) if m.contains("not 1..1024 threads")),
        "{e}"
    );
    let mut y = Buf::filled("y", 64, 0.0);
    let e = selftest::dyn_shared(&Launch::linear(1, 64, 64 * 1024), Order::Forward, &mut y)
        .unwrap_err();
    assert!(
        matches!(&e, EmuError::Launch(m) if m.contains("dynamic shared memory")),
        "{e}"
    );
}

#[test]
fn warps_drift_apart_between_barriers_so_a_reused_shared_array_races() {
    let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
    let run = |order| {
        let mut y = Buf::filled("y", 128, 0.0);
        selftest::reuse_race(
            &Launch::linear(1, 128, 0),
            order,
            &Buf::from_slice("x", &x),
            &mut y,
        )
        .unwrap();
        y.as_slice().to_vec()
    };
    let outs: Vec<Vec<f32>> = ORDERS.iter().map(|&o| run(o)).collect();
    assert!(
        outs.windows(2).any(|w| !same_bits(&w[0], &w[1])),
        "every order gave the same result: warps ran in step"
    );
}

#[test]
fn an_async_copy_lands_only_when_its_thread_waits() {
    use selftest::AsyncCopy;
    let n = 96;
    let x: Vec<f32> = (0..4 * n).map(|i| i as f32 + 1.0).collect();
    let x = Buf::from_slice("x", &x);
    let run = |how, order| {
        let mut y = Buf::filled("y", n, -1.0);
        selftest::async_copy(&Launch::linear(1, n as u32, 0), order, how, &x, &mut y)
            .map(|()| y.as_slice().to_vec())
    };
    for order in ORDERS {
        let y = run(AsyncCopy::WaitThenRead, order).unwrap();
        for (t, v) in y.iter().enumerate() {
            let nb = ((t + 1) % n) as f32;
            // x[4 nb + i] = 4 nb + i + 1, summed over i < 4.
            assert_eq!(*v, 16.0 * nb + 10.0, "thread {t} under {order:?}");
        }
        let y = run(AsyncCopy::ReadWithoutWait, order).unwrap();
        assert!(y.iter().all(|v| v.is_nan()), "{order:?}: {y:?}");
        let y = run(AsyncCopy::ZeroFill, order).unwrap();
        assert!(y.iter().all(|v| *v == 0.0), "{order:?}: {y:?}");
    }
    let e = run(AsyncCopy::ExitWithoutWait, Order::Forward).unwrap_err();
    assert!(
        matches!(&e, EmuError::Launch(m) if m.contains("never waited for")),
        "{e}"
    );
    let e = run(AsyncCopy::Misaligned, Order::Forward).unwrap_err();
    assert!(
        matches!(&e, EmuError::Launch(m) if m.contains("not aligned")),
        "{e}"
    );
}

/// `mma.sync` and `ldmatrix` are `.aligned`: every lane of the warp must execute that one
/// instruction together. Lanes reaching them from two places (an mma in each branch of a
/// lane-dependent `if`) fail the launch, naming the instruction, where the barrier count alone
/// let them meet and mix their operands; one place for all lanes runs, under every order.
#[test]
fn lanes_reaching_a_matrix_instruction_from_different_places_fail() {
    use selftest::MatrixSites;
    for order in ORDERS {
        let mut y = Buf::filled("y", 32, f32::NAN);
        selftest::divergent_mma(&Launch::linear(1, 32, 0), order, &mut y, MatrixSites::One)
            .unwrap();
        // Row g of A (all ones) times column of B (all ones) over k = 16: 16 everywhere.
        assert!(
            y.as_slice().iter().all(|&v| v == 16.0),
            "{order:?}: {:?}",
            y.as_slice()
        );
        for sites in [MatrixSites::TwoMma, MatrixSites::TwoLdmatrix] {
            let mut y = Buf::filled("y", 32, f32::NAN);
            let e = selftest::divergent_mma(&Launch::linear(1, 32, 0), order, &mut y, sites)
                .unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("divergent_mma") && msg.contains("from different places"),
                "{order:?} {sites:?}: {msg}"
            );
        }
    }
}

/// `__ballot_sync` gives each lane its warp's votes, lane l as bit l, and the missing lanes of
/// a partial last warp vote no; `__ffs` names the lowest voter (plus one), 0 for none.
#[test]
fn a_ballot_is_the_warps_votes() {
    for threads in [32usize, 64, 40] {
        // Votes that differ between the two warps, lane 31 of the second voting.
        let x: Vec<f32> = (0..threads)
            .map(|t| if t % 3 == 0 || t % 7 == 1 { 1.0 } else { -1.0 })
            .collect();
        let mut want = vec![0u32; threads];
        for (t, w) in want.iter_mut().enumerate() {
            let warp = t / 32 * 32;
            let mask = (warp..threads.min(warp + 32))
                .filter(|&u| x[u] > 0.0)
                .fold(0u32, |m, u| m | 1 << (u - warp));
            *w = mask.wrapping_add(if mask == 0 {
                0
            } else {
                mask.trailing_zeros() + 1
            });
        }
        for order in ORDERS {
            let mut y = Buf::filled("y", threads, f32::NAN);
            selftest::ballot(
                &Launch::linear(1, threads as u32, 0),
                order,
                &Buf::from_slice("x", &x),
                &mut y,
                u32::MAX,
            )
            .unwrap();
            let got: Vec<u32> = y.as_slice().iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{threads} threads, {order:?}");
        }
    }
    // A partial mask (legal on a GPU, where lanes outside it need not arrive) is not
    // emulated: the launch fails rather than counting every lane's vote.
    let mut y = Buf::filled("y", 32, f32::NAN);
    let e = selftest::ballot(
        &Launch::linear(1, 32, 0),
        ORDERS[0],
        &Buf::filled("x", 32, 1.0f32),
        &mut y,
        0xffff,
    )
    .unwrap_err();
    assert!(e.to_string().contains("__ballot_sync with a mask"), "{e}");
}
