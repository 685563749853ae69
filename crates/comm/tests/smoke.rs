//! Smoke test: a few collectives on a world of 4.

use candle_core::{Device, Tensor};
use candle_dtensor_comm::{LocalWorld, ReduceOp};
use std::time::Duration;

#[test]
fn smoke() {
    let out = LocalWorld::new(4)
        .with_timeout(Duration::from_secs(10))
        .launch(|comm| {
            let x = Tensor::full(comm.rank() as f32 + 1.0, 100_000, &Device::Cpu)?;
            let y = comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            let s = Tensor::full(comm.rank() as f32, 4, &Device::Cpu)?;
            let s = comm.all_reduce(&s, ReduceOp::Max)?.wait()?;
            let g = comm
                .all_gather_single(&Tensor::new(&[comm.rank() as u32], &Device::Cpu)?)?
                .wait()?;
            Ok::<_, candle_core::Error>((
                y.sum_all()?.to_scalar::<f32>()?,
                s.to_vec1::<f32>()?,
                g.to_vec1::<u32>()?,
            ))
        })
        .unwrap();
    for (sum, mx, g) in out {
        assert_eq!(sum, 1_000_000.0);
        assert_eq!(mx, vec![3.0; 4]);
        assert_eq!(g, vec![0, 1, 2, 3]);
    }
}

/// The link model (`comm::link`): a mesh dim's collectives take at least the modeled
/// `alpha + wire / bandwidth` (a lower bound only: sleeping guarantees it, nothing is timed
/// from above), results are unchanged, and bad hints are refused naming the dim.
#[test]
fn link_model_paces_mesh_dims_and_refuses_bad_hints() {
    use candle_dtensor::mesh::DeviceMesh;
    use candle_dtensor_comm::link::{link_hints, parse_link_spec};
    use candle_dtensor_comm::CommOptions;
    use std::time::Instant;

    let links = parse_link_spec("dp=2ms:0.01GBps").unwrap();
    let mut options = CommOptions::default().with_timeout(Duration::from_secs(10));
    for (k, v) in link_hints(&links) {
        options = options.with_hint(k, v);
    }
    let out = LocalWorld::new(2)
        .with_options(options)
        .launch(|comm| {
            let mesh = DeviceMesh::new(comm, &[("dp", 2)]).map_err(candle_core::Error::wrap)?;
            let dp = mesh.comm(0).map_err(candle_core::Error::wrap)?;
            // 10_000 f32 per rank: S = 80 kB, wire (n-1)/n S = 40 kB at 10 MB/s = 4 ms, + 2 ms.
            let x = Tensor::full(dp.rank() as f32, 10_000, &Device::Cpu)?;
            let t0 = Instant::now();
            let g = dp.all_gather_single(&x)?.wait()?;
            let took = t0.elapsed();
            Ok::<_, candle_core::Error>((took, g.sum_all()?.to_scalar::<f32>()?))
        })
        .unwrap();
    for (took, sum) in out {
        assert!(took >= Duration::from_millis(6), "took {took:?}");
        assert_eq!(sum, 10_000.0);
    }

    let bad = CommOptions::default()
        .with_timeout(Duration::from_secs(10))
        .with_hint("link.dp.gbps", "0");
    let err = LocalWorld::new(2)
        .with_options(bad)
        .launch(|comm| DeviceMesh::new(comm, &[("dp", 2)]).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"dp\"") && err.contains("positive"), "{err}");
}

/// A communicator split from a paced one without a link of its own shares its parent's link:
/// collectives in flight on both at once share the bandwidth (each of two equal all_gathers
/// then takes at least twice its idle time). A split with its own hints gets its own link.
#[test]
fn splits_share_their_parents_link_unless_given_their_own() {
    use candle_dtensor::mesh::DeviceMesh;
    use candle_dtensor_comm::CommOptions;
    use std::time::Instant;

    for own_link in [false, true] {
        // dp: 0.01 GB/s, no latency. 100_000 f32 per rank: wire 400 kB = 40 ms idle.
        let mut options = CommOptions::default()
            .with_timeout(Duration::from_secs(10))
            .with_hint("link.dp.gbps", "0.01");
        if own_link {
            options = options.with_hint("link.dp_rs.gbps", "0.01");
        }
        let out = LocalWorld::new(2)
            .with_options(options)
            .launch(move |comm| {
                let mesh = DeviceMesh::new(comm, &[("dp", 2)]).map_err(candle_core::Error::wrap)?;
                let dp = mesh.comm(0).map_err(candle_core::Error::wrap)?.clone();
                let rs = dp.split(&[0, 1], "dp_rs")?.expect("a member");
                let x = Tensor::full(dp.rank() as f32, 100_000, &Device::Cpu)?;
                // Each alone first: both paced.
                let mut alone = Vec::new();
                for c in [&dp, &rs] {
                    let t0 = Instant::now();
                    c.all_gather_single(&x)?.wait()?;
                    alone.push(t0.elapsed());
                }
                let t0 = Instant::now();
                let (a, b) = (dp.all_gather_single(&x)?, rs.all_gather_single(&x)?);
                let (a, b) = (a.wait()?, b.wait()?);
                let both = t0.elapsed();
                Ok::<_, candle_core::Error>((
                    alone,
                    both,
                    a.sum_all()?.to_scalar::<f32>()? + b.sum_all()?.to_scalar::<f32>()?,
                ))
            })
            .unwrap();
        for (alone, both, sum) in out {
            for t in &alone {
                assert!(*t >= Duration::from_millis(40), "alone {t:?}");
            }
            if !own_link {
                assert!(
                    both >= Duration::from_millis(80),
                    "shared link, both at once took {both:?}"
                );
            }
            assert_eq!(sum, 200_000.0);
        }
    }
}
