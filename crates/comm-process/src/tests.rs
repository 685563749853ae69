//! Unit tests of the process backend with ranks as threads of this process (each with its own
//! TCP connections): every collective against the local backend, bit for bit, on values whose
//! float sums depend on the order; the failure paths only this backend has (bootstrap, broken
//! connections, threads left behind); and the backend-neutral conformance suite, which checks
//! splits, timeouts, desync, abort and overlap. The multi-process tests (dtrun, kill -9) are
//! in `crates/dtrun/tests/`.

use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use super::*;
use candle_dtensor_comm_core::store::{PrefixStore, Store, TcpStore, TcpStoreServer};
use candle_dtensor_comm_core::{OpName, P2POp, ReduceOp};
use candle_dtensor_comm_local::LocalWorld;

type R<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;
type Out = (Vec<usize>, Vec<u64>);

fn server() -> &'static (TcpStoreServer, String) {
    static S: OnceLock<(TcpStoreServer, String)> = OnceLock::new();
    S.get_or_init(|| {
        let s = TcpStoreServer::bind("127.0.0.1:0").expect("bind a store");
        let a = s.local_addr().to_string();
        (s, a)
    })
}

fn opts(op_ms: u64, boot_ms: u64) -> CommOptions {
    CommOptions::default()
        .with_timeout(Duration::from_millis(op_ms))
        .with_bootstrap_timeout(Duration::from_millis(boot_ms))
}

/// Runs `f` on `n` thread-ranks of a fresh process communicator; returns each rank's result.
fn run<T: Send>(n: usize, options: CommOptions, f: impl Fn(Comm) -> R<T> + Sync) -> Vec<R<T>> {
    static JOB: AtomicU64 = AtomicU64::new(0);
    let job = JOB.fetch_add(1, Ordering::Relaxed);
    let addr = &server().1;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (f, options) = (&f, options.clone());
                s.spawn(move || -> R<T> {
                    let store: Arc<dyn Store> =
                        Arc::new(TcpStore::connect(addr, Duration::from_secs(10))?);
                    let ns = Arc::new(PrefixStore::new(format!("test{job}"), store));
                    let comm = connect(ns, rank, n, "world", options)?;
                    f(comm)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    })
}

fn all_ok<T>(v: Vec<R<T>>) -> Vec<T> {
    v.into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

fn out(t: &Tensor) -> R<Out> {
    let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok((t.dims().to_vec(), v.iter().map(|x| x.to_bits()).collect()))
}

fn vals(rank: usize, len: usize, salt: usize, dt: DType) -> R<Vec<f64>> {
    Ok((0..len)
        .map(|i| {
            let b = ((rank * 7 + i * 3 + salt) % 16) as f64;
            // Fractions make float sums order-sensitive, so rank order is really tested.
            let b = if dt.is_float() {
                b + 0.1 * ((i + rank) % 7) as f64
            } else {
                b
            };
            if matches!(dt, DType::U8 | DType::U32) {
                b.floor()
            } else {
                b - 8.0
            }
        })
        .collect())
}

fn t(rank: usize, shape: &[usize], salt: usize, dt: DType) -> R<Tensor> {
    let n: usize = shape.iter().product();
    Ok(Tensor::from_vec(vals(rank, n, salt, dt)?, shape, &Device::Cpu)?.to_dtype(dt)?)
}

/// Every collective once or more, recording every output.
fn workload(c: &Comm) -> R<Vec<Out>> {
    let (me, n) = (c.rank(), c.size());
    let mut o = Vec::new();
    for (k, &dt) in candle_dtensor_comm_core::SUPPORTED_DTYPES
        .iter()
        .enumerate()
    {
        for (j, op) in ReduceOp::ALL.into_iter().enumerate() {
            if !candle_dtensor_comm_core::reduce_supported(op, dt) {
                continue;
            }
            let shape: &[usize] = match (k + j) % 4 {
                0 => &[0],
                1 => &[1],
                2 => &[13, 3],
                _ => &[70_000],
            };
            let x = t(me, shape, k + j, dt)?;
            o.push(out(&c.all_reduce(&x, op)?.wait()?)?);
        }
        let x = t(me, &[n * 3, 2], k, dt)?;
        o.push(out(&c.reduce_scatter_single(&x, ReduceOp::Sum)?.wait()?)?);
        o.push(out(&c.all_gather_single(&x)?.wait()?)?);
        o.push(out(&c.all_to_all_single(&x)?.wait()?)?);
    }
    // Large: the two-phase all_reduce (in place), reduce_scatter and all_gather into outputs.
    let big = t(me, &[n, 40_000], 3, DType::F32)?;
    let w = c.all_reduce_into(&big, &big, ReduceOp::Sum)?.wait()?;
    o.push(out(&w)?);
    let dst = Tensor::zeros(40_000, DType::F32, &Device::Cpu)?;
    o.push(out(&c
        .reduce_scatter_single_into(&dst, &big, ReduceOp::Max)?
        .wait()?)?);
    let gathered = Tensor::zeros((n * n, 40_000), DType::F32, &Device::Cpu)?;
    o.push(out(&c.all_gather_single_into(&gathered, &big)?.wait()?)?);
    // Scalars and empty pieces.
    let s = Tensor::new(me as f32, &Device::Cpu)?;
    o.push(out(&c.all_gather_single(&s)?.wait()?)?);
    o.push(out(&c
        .all_gather_single(&Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?)?
        .wait()?)?);
    // all_to_all_v with uneven splits: rank i sends (i + j) % 3 rows to rank j.
    let ins: Vec<usize> = (0..n).map(|j| (me + j) % 3).collect();
    let outs: Vec<usize> = (0..n).map(|j| (j + me) % 3).collect();
    let x = t(me, &[ins.iter().sum::<usize>(), 2], 9, DType::F32)?;
    o.push(out(&c.all_to_all_v_single(&x, &outs, &ins)?.wait()?)?);
    for root in 0..n {
        let x = t(me, &[5, 7], root, DType::F64)?;
        o.push(out(&c.broadcast(&x, root)?.wait()?)?);
        let r = c.reduce(&x, root, ReduceOp::Sum)?.wait()?;
        if let Some(r) = r {
            o.push(out(&r)?);
        }
    }
    let ragged = t(me, &[me + 1, 2], 4, DType::U8)?;
    if let Some(g) = c.gather(&ragged, n - 1)?.wait()? {
        for x in &g {
            o.push(out(x)?);
        }
    }
    let pieces: Vec<Tensor> = if me == 0 {
        (0..n)
            .map(|r| t(r, &[r + 2], 5, DType::I64))
            .collect::<R<_>>()?
    } else {
        Vec::new()
    };
    o.push(out(&c.scatter(&pieces, 0)?.wait()?)?);
    // Point to point: a ring, all pairs in one batch (sends to self included).
    let x = t(me, &[4], 6, DType::F32)?;
    c.send(&x, (me + 1) % n)?.wait()?;
    o.push(out(&c.recv((me + n - 1) % n, 4, DType::F32)?.wait()?)?);
    let mut ops = Vec::new();
    for p in 0..n {
        ops.push(P2POp::Send {
            tensor: t(me, &[p + 1], p, DType::BF16)?,
            peer: p,
        });
    }
    for p in 0..n {
        ops.push(P2POp::Recv {
            peer: p,
            shape: (me + 1).into(),
            dtype: DType::BF16,
        });
    }
    for r in c.batch_p2p(ops)?.wait()? {
        o.push(out(&r)?);
    }
    c.barrier()?.wait()?;
    Ok(o)
}

#[test]
fn every_collective_matches_the_local_backend_bit_for_bit() {
    for n in 1..=4 {
        let local = LocalWorld::new(n)
            .with_timeout(Duration::from_secs(20))
            .launch(|c| workload(&c))
            .unwrap_or_else(|e| panic!("local world {n}: {e}"));
        let procs = all_ok(run(n, opts(20_000, 10_000), |c| workload(&c)));
        for r in 0..n {
            assert_eq!(local[r].len(), procs[r].len(), "world {n} rank {r}");
            for (i, (a, b)) in local[r].iter().zip(&procs[r]).enumerate() {
                assert_eq!(a, b, "world {n} rank {r} output {i}");
            }
        }
    }
}

#[test]
fn a_rank_that_never_connects_is_named_by_the_bootstrap_timeout() {
    static JOB: AtomicU64 = AtomicU64::new(1_000_000);
    let job = JOB.fetch_add(1, Ordering::Relaxed);
    let addr = server().1.clone();
    // Only the bootstrap timeout is short: the op and store timeouts are long, so waiting out
    // either instead (60 s) fails the bound below, which is far above anything load does to a
    // 500 ms wait.
    let long = Duration::from_secs(60);
    let t0 = Instant::now();
    let errs: Vec<CommError> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    let store: Arc<dyn Store> =
                        Arc::new(TcpStore::connect(&addr, long).expect("store"));
                    let ns = Arc::new(PrefixStore::new(format!("boot{job}"), store));
                    connect(ns, rank, 3, "world", opts(60_000, 500))
                        .expect_err("rank 2 never comes")
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    });
    assert!(t0.elapsed() < long / 3, "{:?}", t0.elapsed());
    for e in errs {
        match &e {
            CommError::Timeout { ctx, missing, .. } => {
                assert_eq!(missing, &vec![2], "{e}");
                assert_eq!(ctx.op, OpName::NewComm, "{e}");
            }
            other => panic!("expected a bootstrap timeout, got {other}"),
        }
    }
}

#[test]
fn a_peer_whose_connections_break_fails_pending_ops_naming_it() {
    // Long timeouts: the loss must be seen at once, and the bound below (a third of the op
    // timeout) is far above what load does to that, while waiting the timeout out fails it.
    let got = run(3, opts(60_000, 30_000), |world| {
        let c = world.split(&[0, 1, 2], "severme")?.ok_or("member")?;
        c.barrier()?.wait()?;
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            // What the kernel does when a process is killed: every socket closes, no goodbye.
            sever(&c);
            std::thread::sleep(Duration::from_millis(300));
            return Ok(None);
        }
        let x = Tensor::ones(70_000, DType::F32, &Device::Cpu)?;
        let t0 = Instant::now();
        let e = c
            .all_reduce(&x, ReduceOp::Sum)?
            .wait()
            .expect_err("peer lost");
        Ok(Some((e, t0.elapsed())))
    });
    for (rank, g) in got.into_iter().enumerate() {
        if rank == 1 {
            continue;
        }
        let (e, took) = g.unwrap().expect("survivors report");
        let msg = e.to_string();
        assert!(matches!(e, CommError::Aborted { .. }), "rank {rank}: {msg}");
        assert!(msg.contains("peer rank 1 was lost"), "rank {rank}: {msg}");
        assert!(took < Duration::from_secs(20), "rank {rank}: {took:?}");
    }
}

/// Closes every socket of `c`'s transport at once, as a killed process would. `c` must have a
/// name no other live communicator of this test binary has.
pub(crate) fn sever(c: &Comm) {
    let t = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .find(|t| t.rank == c.rank() && t.name == c.name());
    t.expect("a live transport of that name").sever();
}

/// Transports created by this test binary (weak), so tests can sever one.
pub(crate) static LIVE: Mutex<Vec<std::sync::Weak<Transport>>> = Mutex::new(Vec::new());

#[test]
fn no_thread_outlives_its_communicator() {
    // Counted as the conformance kit counts them: one listing of /proc/self/task can skip a
    // live thread while other tests' threads exit (once, a reader still within its last read
    // tick was missed and the assertion's own listing then saw it), so a count is the largest
    // of three and the wait takes five zero counts in a row.
    use candle_dtensor_comm_conformance::{no_threads_named, threads_named};
    if !cfg!(target_os = "linux") {
        return;
    }
    all_ok(run(3, opts(5_000, 5_000), |c| {
        let sub = c.split(&[0, 1, 2], "leakp")?.ok_or("member")?;
        let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        sub.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        Ok(())
    }));
    // Threads exit within a read tick (100 ms); the wait is long only so that a loaded machine
    // cannot fail it (it ends as soon as they are gone).
    assert!(
        no_threads_named("cdt-leakp", Duration::from_secs(30)),
        "{} progress or reader threads left behind",
        threads_named("cdt-leakp")
    );
}

/// The backend-neutral conformance suite on thread-ranks of the process backend (the
/// multi-process run under dtrun is in `crates/dtrun/tests/`).
#[test]
fn the_conformance_suite_passes_on_thread_ranks() {
    use candle_dtensor_comm_conformance::{run as conform, Selection};
    // Not 2: `faults::abort_from_another_thread` needs a late third rank (with two, the
    // all_reduce it expects to be aborted completes first; the local suite runs it on 3).
    // The split a rank never joins waits out the bootstrap timeout, so it runs on its own with
    // a short one (well under the op timeout: the split must end before its peers give up on
    // the verdict). Everything else runs with long timeouts, which nothing that passes waits
    // out: the suite bounds its "fails fast" checks relative to them, so load cannot fail them.
    const REJECTING: &str = "split::rank_rejecting_its_list";
    for n in [3, 4] {
        let reports = run(n, opts(30_000, 30_000), |c| {
            conform(&c, &Selection::default().excluding(&[REJECTING]))
                .map_err(|e| e.to_string().into())
        });
        for (r, rep) in reports.into_iter().enumerate() {
            let rep = rep.unwrap_or_else(|e| panic!("world {n} rank {r}: {e}"));
            assert_eq!(rep.failed(), 0, "world {n} rank {r}: {rep}");
            assert!(rep.passed() > 20, "world {n} rank {r}: {rep}");
        }
        let reports = run(n, opts(10_000, 1_500), |c| {
            conform(&c, &Selection::only(&[REJECTING])).map_err(|e| e.to_string().into())
        });
        for (r, rep) in reports.into_iter().enumerate() {
            let rep = rep.unwrap_or_else(|e| panic!("world {n} rank {r}: {e}"));
            assert_eq!(
                (rep.passed(), rep.failed()),
                (1, 0),
                "world {n} rank {r}: {rep}"
            );
        }
    }
}

/// The live transport of `c` (see [`sever`] for the naming rule).
fn transport_of(c: &Comm) -> Arc<Transport> {
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .find(|t| t.rank == c.rank() && t.name == c.name())
        .expect("a live transport of that name")
}

/// Rank 3 is killed (its sockets close, as a killed process's do); the survivors see the loss,
/// agree on it, and shrink around it; rank 2 dies during that shrink (a second failure): the
/// survivors all report it, shrink again without it, and compute on the 2-rank communicator.
#[test]
fn survivors_of_a_killed_rank_agree_shrink_and_survive_a_second_failure() {
    // Long timeouts (shrink rounds are bounded by the bootstrap one): the bound below is a third
    // of it, far above what load does to the shrinks, while waiting it out fails it.
    let got = run(4, opts(60_000, 30_000), |world| {
        let c = world.split(&[0, 1, 2, 3], "ftshrink")?.ok_or("member")?;
        c.barrier()?.wait()?;
        let r = c.rank();
        if r == 3 {
            // Let every peer's barrier complete first (it completes when every HELLO arrived).
            std::thread::sleep(Duration::from_millis(200));
            sever(&c);
            return Ok(None);
        }
        let x = Tensor::new(&[r as f64 + 0.25], &Device::Cpu)?;
        let e = c
            .all_reduce(&x, ReduceOp::Sum)?
            .wait()
            .expect_err("rank 3 is gone");
        assert!(
            e.to_string().contains("peer rank 3 was lost"),
            "rank {r}: {e}"
        );
        let a = c.agree(true)?;
        assert_eq!((a.ok, a.failed.clone()), (false, vec![3]), "rank {r}");
        if r == 2 {
            sever(&c);
            return Ok(None);
        }
        let t0 = Instant::now();
        match c.shrink(&[3]) {
            Err(CommError::RanksLost { lost, .. }) => assert_eq!(lost, vec![2], "rank {r}"),
            other => panic!(
                "rank {r}: expected RanksLost, got {:?}",
                other.map(|c| c.size())
            ),
        }
        let s = c.shrink(&[2, 3])?;
        let took = t0.elapsed();
        assert_eq!((s.rank(), s.size(), s.name()), (r, 2, "ftshrink"));
        let v = s.all_reduce(&x, ReduceOp::Sum)?.wait()?.to_vec1::<f64>()?[0];
        Ok(Some((v, took)))
    });
    for (r, g) in got.into_iter().enumerate() {
        let g = g.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        if r >= 2 {
            assert!(g.is_none());
            continue;
        }
        let (v, took) = g.expect("a survivor");
        assert_eq!(v, 0.25 + 1.25, "rank {r}");
        // Closed connections are detected at once: no timeout was waited out.
        assert!(took < Duration::from_secs(10), "rank {r}: {took:?}");
    }
}

/// A hung rank (alive, silent) is suspected after the op timeout: every other rank reports it.
#[test]
fn a_hung_rank_is_reported_by_the_agreement_after_the_timeout() {
    let got = run(3, opts(300, 2_000), |world| {
        let c = world.split(&[0, 1, 2], "fthung")?.ok_or("member")?;
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(1_200));
            return Ok(None);
        }
        Ok(Some(c.agree(true)?))
    });
    for (r, g) in got.into_iter().enumerate().take(2) {
        let a = g
            .unwrap_or_else(|e| panic!("rank {r}: {e}"))
            .expect("agreed");
        assert_eq!((a.ok, a.failed), (false, vec![2]), "rank {r}");
    }
}

/// A peer that sends far more than the receiver consumes is held to the cap (TCP flow control
/// slows it), and every byte still arrives, in order.
#[test]
fn a_flooding_peer_is_held_to_the_buffer_cap_and_loses_nothing() {
    const CAP: usize = 1 << 20;
    const MSG: usize = 64 * 1024; // f32 elements: 256 KiB per message
    const COUNT: usize = 24; // 6 MiB in all, six times the cap
    let options = opts(20_000, 5_000).with_hint(HINT_MAX_BUFFERED, CAP.to_string());
    let got = run(2, options, |world| {
        let c = world.split(&[0, 1], "ftflood")?.ok_or("member")?;
        if c.rank() == 1 {
            let works = (0..COUNT)
                .map(|i| {
                    let x = Tensor::full(i as f32, MSG, &Device::Cpu)?;
                    Ok(c.send(&x, 0)?)
                })
                .collect::<R<Vec<_>>>()?;
            for w in works {
                w.wait()?;
            }
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(400));
        let peak = transport_of(&c).peak_buffered();
        for i in 0..COUNT {
            let y = c.recv(1, (MSG,), DType::F32)?.wait()?.to_vec1::<f32>()?;
            assert!(
                y.iter().all(|&v| v == i as f32),
                "message {i} arrived wrong"
            );
        }
        Ok(peak)
    });
    let peak = got
        .into_iter()
        .map(|g| g.unwrap_or_else(|e| panic!("{e}")))
        .max();
    // The cap plus the one frame admitted while under it (a frame is a message + its preamble).
    let peak = peak.expect("two ranks");
    assert!(peak > 0 && peak <= CAP + MSG * 4 + 4096, "peak {peak}");
}

/// A peer that sends a frame over its kind's cap (a HELLO declaring 1 GiB: descriptors are
/// a few hundred bytes, the cap 64 KiB) is cut off before anything is allocated for it: the
/// connection is closed, the communicator fails with the peer lost, and the reason, also
/// logged, names the rank and address, the frame kind and both sizes.
#[test]
fn an_oversized_control_frame_closes_the_connection_naming_the_peer() {
    use std::io::{Read, Write};
    crate::test_support::capture_warnings();
    let (t, mut evil) = with_raw_peer("oversized");
    let evil_addr = evil.local_addr().unwrap().to_string();
    let h = frame::Header {
        kind: frame::HELLO,
        step: 0,
        tag: 0,
        len: 1 << 30,
    };
    evil.write_all(&h.encode()).unwrap();
    evil.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 64];
    match evil.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the connection is still open: {other:?}"),
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let reason = loop {
        if let Some(candle_dtensor_comm_core::kit::desc::Failure::PeerLost { rank, reason }) =
            t.failure()
        {
            assert_eq!(rank, 1);
            break reason;
        }
        assert!(Instant::now() < deadline, "no failure recorded");
        std::thread::sleep(Duration::from_millis(5));
    };
    for want in [
        &format!("rank 1 ({evil_addr})"),
        "HELLO",
        "1073741824",
        "65536",
    ] {
        assert!(reason.contains(want), "{want:?} not in {reason:?}");
    }
    assert!(!crate::test_support::warnings_with(&[
        &evil_addr,
        "HELLO frame declares 1073741824 bytes"
    ])
    .is_empty());
    t.close();
}

/// Writes to `s` until its send buffer and the peer's window are full (the peer reads
/// nothing); returns the bytes written. `s` has a write timeout, which ends the filling.
fn fill(s: &mut std::net::TcpStream) -> usize {
    use std::io::Write;
    s.set_write_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let chunk = vec![0xAB_u8; 16 << 10];
    let mut total = 0;
    loop {
        match s.write(&chunk) {
            Ok(k) => total += k,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return total
            }
            Err(e) => panic!("filling a socket: {e}"),
        }
    }
}

/// A connected loopback pair.
fn socket_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Rank 0 of a two-rank transport named `name` whose peer, rank 1, is the returned raw socket
/// (the test speaks for it, frame by frame or not at all).
fn with_raw_peer(name: &str) -> (Arc<transport::Transport>, std::net::TcpStream) {
    let (mine, peer) = socket_pair();
    let rdv = Rendezvous {
        store: Arc::new(TcpStore::connect(&server().1, Duration::from_secs(10)).unwrap()),
        ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        token: Token::new(b"t"),
    };
    let t = transport::Transport::start(
        0,
        (vec![None, Some(mine)], Vec::new()),
        name,
        String::new(),
        rdv,
        1 << 20,
    )
    .unwrap();
    (t, peer)
}

/// Reads from `s` until `n` bytes came or the connection ended.
fn read_up_to(s: &mut std::net::TcpStream, n: usize) -> (Vec<u8>, Option<std::io::Error>) {
    use std::io::Read;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    while got.len() < n {
        let want = (n - got.len()).min(buf.len());
        match s.read(&mut buf[..want]) {
            Ok(0) => return (got, None),
            Ok(k) => got.extend_from_slice(&buf[..k]),
            Err(e) => return (got, Some(e)),
        }
    }
    (got, None)
}

/// The unsent count sees bytes a peer has not made room for, and falls to zero once it reads.
/// The linger waits for exactly that, no longer than its deadline, and not at all for a peer
/// known gone.
#[test]
fn linger_waits_for_a_late_reader_until_its_deadline_and_never_for_a_gone_peer() {
    let (mut a, mut b) = socket_pair();
    let total = fill(&mut a);
    let held = transport::unsent(&a).expect("Linux says how much is unsent");
    assert!(held > 0, "nothing held back after filling {total} bytes");

    // A peer that never reads holds the linger only until the deadline.
    let t0 = Instant::now();
    let left = transport::linger(
        &[(1, a.try_clone().unwrap())],
        |_| false,
        t0 + Duration::from_millis(300),
    );
    let took = t0.elapsed();
    assert_eq!(left, vec![1]);
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // A peer known gone is not waited for.
    let t0 = Instant::now();
    let left = transport::linger(
        &[(1, a.try_clone().unwrap())],
        |_| true,
        t0 + Duration::from_secs(20),
    );
    assert!(left.is_empty() && t0.elapsed() < Duration::from_secs(2));

    // A peer that reads late: the linger ends when the last byte is sent.
    let reader = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let (got, err) = read_up_to(&mut b, total);
        (got.len(), err.map(|e| e.to_string()))
    });
    let t0 = Instant::now();
    let left = transport::linger(
        &[(1, a.try_clone().unwrap())],
        |_| false,
        t0 + Duration::from_secs(20),
    );
    let took = t0.elapsed();
    assert!(left.is_empty(), "still held after {took:?}");
    assert!(took >= Duration::from_millis(250), "{took:?}");
    assert_eq!(transport::unsent(&a), Some(0));
    assert_eq!(reader.join().unwrap(), (total, None));
}

/// The unsent count is asked of sockets in every state a closing rank meets: shut down for
/// writing, reset by the peer, and after both. It answers or declines; it never misreads.
#[test]
fn the_unsent_count_answers_for_shut_down_and_reset_sockets() {
    use std::io::Write;
    let (mut a, mut b) = socket_pair();
    a.write_all(b"hello").unwrap();
    a.shutdown(std::net::Shutdown::Write).unwrap();
    let mut waited = Duration::ZERO;
    while transport::unsent(&a) != Some(0) && waited < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
        waited += Duration::from_millis(5);
    }
    assert_eq!(transport::unsent(&a), Some(0));
    // `b` closes with unread bytes: its kernel resets the connection.
    b.write_all(b"x").unwrap();
    drop(b);
    std::thread::sleep(Duration::from_millis(50));
    let after_reset = transport::unsent(&a);
    assert!(after_reset.is_none_or(|n| n < 1 << 20), "{after_reset:?}");
    let _ = a.shutdown(std::net::Shutdown::Both);
    let _ = transport::unsent(&a);
}

/// A closing rank's goodbye queued behind bytes a busy peer has not made room for is sent
/// before the rank lets its sockets go. Without that, the peer's late bytes left unread make
/// this rank's kernel reset the connection, which drops the queued goodbye, and the peer takes
/// a clean close for a crash (what blamed the wrong rank after a kill -9 under load).
#[test]
fn a_goodbye_queued_behind_a_full_window_reaches_a_peer_that_reads_late() {
    use std::io::Write;
    let (t, mut peer) = with_raw_peer("linger");
    // This rank's bytes fill the peer's window and this rank's send buffer; the peer reads half
    // of them, making room for the goodbye behind the rest, and stops.
    let filled = fill(&mut t.stream_to(1));
    let (first, err) = read_up_to(&mut peer, filled / 2);
    assert!(err.is_none() && first.len() == filled / 2);
    std::thread::sleep(Duration::from_millis(50));

    let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
    let peer_side = std::thread::spawn(move || {
        // A frame this rank's readers will not read once it has closed.
        std::thread::sleep(Duration::from_millis(300));
        let h = frame::Header {
            kind: frame::P2P,
            step: 0,
            tag: u64::MAX,
            len: 8,
        };
        peer.write_all(&h.encode()).unwrap();
        peer.write_all(&[1u8; 8]).unwrap();
        // Busy until this rank dropped its transport, or for a second.
        if dropped_rx.recv_timeout(Duration::from_secs(1)).is_ok() {
            std::thread::sleep(Duration::from_millis(200));
        }
        read_up_to(&mut peer, usize::MAX)
    });
    let t0 = Instant::now();
    t.close();
    let closing = t0.elapsed();
    // The readers stop within a tick of closing; the peer's frame lands after that.
    std::thread::sleep(Duration::from_millis(400).saturating_sub(t0.elapsed()));
    drop(t);
    let _ = dropped_tx.send(());
    let (rest, err) = peer_side.join().unwrap();
    let bye = frame::Header {
        kind: frame::BYE,
        step: 0,
        tag: 0,
        len: 0,
    }
    .encode();
    assert!(
        rest.len() == filled - filled / 2 + bye.len() && rest.ends_with(&bye),
        "the peer read {} of {} bytes and then {err:?}; close took {closing:?}",
        rest.len(),
        filled - filled / 2 + bye.len()
    );
}
