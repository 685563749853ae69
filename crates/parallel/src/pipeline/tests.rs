//! Unit tests of the schedules and the simulator.

use super::sim::{bubble_gpipe, bubble_interleaved, bubble_zb_h1, bubble_zb_v};
use super::*;

const EPS: f64 = 1e-9;

#[test]
fn gpipe_and_1f1b_match_the_formula() {
    for p in [1, 2, 4] {
        for m in [1, 2, 3, 4, 8, 16] {
            let want = bubble_gpipe(p, m);
            let g = Schedule::gpipe(p, m).unwrap().bubble_fraction().unwrap();
            assert!((g - want).abs() < EPS, "gpipe p={p} m={m}: {g} vs {want}");
            let o = Schedule::one_f_one_b(p, m)
                .unwrap()
                .bubble_fraction()
                .unwrap();
            assert!((o - want).abs() < EPS, "1f1b p={p} m={m}: {o} vs {want}");
        }
    }
}

#[test]
fn one_f_one_b_bounds_in_flight_activations() {
    for p in [2, 4] {
        for m in [2, 4, 8] {
            let s = Schedule::one_f_one_b(p, m).unwrap();
            for r in 0..p {
                let mut live = 0i64;
                let mut peak = 0i64;
                for a in s.actions(r) {
                    match a {
                        Action::Forward { .. } => live += 1,
                        _ => live -= 1,
                    }
                    peak = peak.max(live);
                }
                assert!(
                    peak as usize <= (p - r).min(m),
                    "p={p} m={m} r={r} peak {peak}"
                );
            }
            // GPipe keeps all m.
            let g = Schedule::gpipe(p, m).unwrap();
            assert_eq!(
                g.actions(0)
                    .iter()
                    .take_while(|a| a.letter() == 'F')
                    .count(),
                m
            );
        }
    }
}

#[test]
fn interleaved_matches_the_formula() {
    for p in [2, 4] {
        for v in [1, 2, 3] {
            for mult in [1, 2, 4] {
                let m = p * mult;
                let s = Schedule::interleaved(p, m, v).unwrap();
                let got = s.bubble_fraction().unwrap();
                let want = bubble_interleaved(p, m, v);
                assert!(
                    (got - want).abs() < 1e-9,
                    "interleaved p={p} m={m} v={v}: {got} vs {want}\n{}",
                    s.table()
                );
            }
        }
    }
}

#[test]
fn interleaved_needs_m_multiple_of_p() {
    let e = Schedule::interleaved(4, 6, 2).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            ScheduleError::Rule {
                p: 4,
                m: 6,
                v: 2,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("interleaved-1F1B") && msg.contains("m % p == 0"),
        "{msg}"
    );
}

#[test]
fn zero_bubble_h1_beats_1f1b() {
    for p in [2, 4] {
        for m in [p, 2 * p, 4 * p, 8 * p] {
            let s = Schedule::zero_bubble_h1(p, m).unwrap();
            assert!(s.splits_backward());
            let got = s.bubble_fraction().unwrap();
            let paper = bubble_zb_h1(p, m);
            let ofob = bubble_gpipe(p, m);
            assert!(
                (got - paper).abs() < 1e-9,
                "ZB-H1 p={p} m={m}: {got} vs paper {paper}\n{}",
                s.table()
            );
            assert!(got < ofob, "p={p} m={m}: {got} vs 1F1B {ofob}");
            // Bubble time is a third of 1F1B's: (p - 1) units vs 3 (p - 1).
            let t = s.simulate(&CostModel::default()).unwrap();
            let idle = t.makespan * p as f64 - (0..p).map(|r| t.busy(r)).sum::<f64>();
            assert!(
                (idle / p as f64 - (p as f64 - 1.0)).abs() < 1e-9,
                "idle {idle}"
            );
            // At most p micro-batches wait for their W on any rank.
            for r in 0..p {
                let mut pending = 0i64;
                for a in s.actions(r) {
                    match a {
                        Action::BackwardInput { .. } => pending += 1,
                        Action::BackwardWeight { .. } => pending -= 1,
                        _ => {}
                    }
                    assert!(pending as usize <= p, "p={p} m={m} r={r}");
                }
            }
        }
    }
}

#[test]
fn zero_bubble_v_halves_zb_h1_with_1f1b_memory() {
    for p in [1, 2, 3, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            let s = Schedule::zero_bubble_v(p, m).unwrap();
            assert!(s.splits_backward() && s.v_shaped());
            assert_eq!((s.chunks(), s.stages()), (2, 2 * p));
            // The V: rank r holds stages r and 2p-1-r; place_of inverts stage_of.
            for r in 0..p {
                assert_eq!(s.stage_of(r, 0), r);
                assert_eq!(s.stage_of(r, 1), 2 * p - 1 - r);
                for c in 0..2 {
                    assert_eq!(s.place_of(s.stage_of(r, c)), (r, c));
                }
            }
            let got = s.bubble_fraction().unwrap();
            let want = bubble_zb_v(p, m);
            assert!(
                (got - want).abs() < EPS,
                "ZB-V p={p} m={m}: {got} vs {want}\n{}",
                s.table()
            );
            if p > 1 {
                assert!(got < bubble_zb_h1(p, m), "p={p} m={m}: {got}");
            }
            // Activation memory: at most 2p chunk activations alive (1F1B's rank-0 peak of p
            // whole-stage micro-batches), at most 2p chunk micro-batches waiting for their W.
            for r in 0..p {
                let (mut alive, mut pending) = (0i64, 0i64);
                for a in s.actions(r) {
                    match a {
                        Action::Forward { .. } => alive += 1,
                        Action::BackwardInput { .. } => {
                            alive -= 1;
                            pending += 1
                        }
                        Action::BackwardWeight { .. } => pending -= 1,
                        Action::Backward { .. } => unreachable!("ZB-V splits every backward"),
                    }
                    assert!(alive as usize <= 2 * p, "p={p} m={m} r={r}: {alive} alive");
                    assert!(
                        pending as usize <= 2 * p,
                        "p={p} m={m} r={r}: {pending} pending"
                    );
                }
            }
        }
    }
    // Fewer micro-batches than ranks run, with a larger bubble than the formula.
    let s = Schedule::zero_bubble_v(4, 1).unwrap();
    assert!(s.bubble_fraction().unwrap() > bubble_zb_v(4, 1));
    // ZB-V has exactly two chunks per rank.
    let e = Schedule::generate(ScheduleKind::ZeroBubbleV, 2, 4, 1).unwrap_err();
    assert!(e.to_string().contains("v must be 2"), "{e}");
}

#[test]
fn validate_catches_bad_lists() {
    let f = |mb| Action::Forward { mb, chunk: 0 };
    let b = |mb| Action::Backward { mb, chunk: 0 };
    // Backward before forward.
    let e = Schedule::from_actions(1, 1, vec![vec![b(0), f(0)]]).unwrap_err();
    assert!(matches!(e, ScheduleError::Order { rank: 0, .. }), "{e}");
    // Missing backward.
    let e = Schedule::from_actions(2, 1, vec![vec![f(0), f(1), b(0)]]).unwrap_err();
    assert!(e.to_string().contains("micro-batch 1"), "{e}");
    // Cross-stage deadlock: rank 1 wants mb 1 first, rank 0 will not send it before mb 0's
    // backward.
    let e = Schedule::from_actions(
        2,
        1,
        vec![vec![f(0), b(0), f(1), b(1)], vec![f(1), b(1), f(0), b(0)]],
    )
    .unwrap_err();
    assert!(matches!(e, ScheduleError::Deadlock { .. }), "{e}");
    // m = 0.
    assert!(matches!(
        Schedule::gpipe(2, 0).unwrap_err(),
        ScheduleError::Rule { m: 0, .. }
    ));
}

#[test]
fn p2p_latency_and_custom_costs() {
    // With a transfer latency the GPipe makespan grows by 2 (p - 1) latencies.
    let s = Schedule::gpipe(4, 8).unwrap();
    let c = CostModel {
        p2p: 0.5,
        ..CostModel::default()
    };
    let t0 = s.simulate(&CostModel::default()).unwrap().makespan;
    let t1 = s.simulate(&c).unwrap().makespan;
    assert!((t1 - t0 - 2.0 * 3.0 * 0.5).abs() < 1e-9, "{t0} {t1}");
    // B = F: the formula holds for any B/F ratio.
    let c = CostModel {
        backward: 1.0,
        ..CostModel::default()
    };
    let b = Schedule::one_f_one_b(4, 8)
        .unwrap()
        .bubble_fraction_with(&c)
        .unwrap();
    assert!((b - bubble_gpipe(4, 8)).abs() < 1e-9);
}

#[test]
fn schedules_by_name() {
    for (name, kind) in [
        ("gpipe", ScheduleKind::GPipe),
        ("1F1B", ScheduleKind::OneFOneB),
        ("interleaved", ScheduleKind::Interleaved1F1B),
        ("interleaved-1f1b", ScheduleKind::Interleaved1F1B),
        ("zb-h1", ScheduleKind::ZeroBubbleH1),
        ("ZBV", ScheduleKind::ZeroBubbleV),
    ] {
        assert_eq!(ScheduleKind::from_name(name).unwrap(), kind, "{name}");
    }
    for name in ScheduleKind::NAMES {
        let kind = ScheduleKind::from_name(name).unwrap();
        let v = match kind {
            ScheduleKind::Interleaved1F1B | ScheduleKind::ZeroBubbleV => 2,
            _ => 1,
        };
        let s = Schedule::generate(kind, 4, 8, v).unwrap();
        assert_eq!(
            (s.kind(), s.ranks(), s.micro_batches(), s.chunks()),
            (kind, 4, 8, v)
        );
    }
    let e = ScheduleKind::from_name("dualpipe").unwrap_err();
    assert!(
        e.to_string().contains("\"dualpipe\"") && e.to_string().contains("zb-h1"),
        "{e}"
    );
    let e = Schedule::generate(ScheduleKind::OneFOneB, 4, 8, 2).unwrap_err();
    assert!(e.to_string().contains("v must be 1"), "{e}");
    assert!(Schedule::generate(ScheduleKind::Interleaved1F1B, 4, 6, 2).is_err());
    assert!(Schedule::generate(ScheduleKind::Custom, 2, 2, 1).is_err());
}

#[test]
fn a_cost_model_with_nan_or_negative_costs_is_refused() {
    let s = Schedule::one_f_one_b(2, 4).unwrap();
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        let c = CostModel {
            backward: bad,
            ..CostModel::default()
        };
        let e = s.bubble_fraction_with(&c).unwrap_err();
        assert!(e.to_string().contains("backward = "), "{e}");
    }
    let c = CostModel {
        p2p: f64::NAN,
        ..CostModel::default()
    };
    assert!(s.simulate(&c).is_err());
    let nan = CostModel {
        forward: f64::NAN,
        ..CostModel::default()
    };
    assert!(TimedStage::new(nan, std::time::Duration::from_millis(1), 1).is_err());
}
