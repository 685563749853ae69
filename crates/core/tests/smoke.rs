//! Smoke tests of the DTensor runtime.
use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use std::time::Duration;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[test]
fn megatron_mlp_one_all_reduce_each_way() {
    let dev = Device::Cpu;
    // Fixed pseudo-random inputs in [-1, 1): a failure must reproduce.
    let fixed = |n: usize, salt: usize, shape: (usize, usize)| {
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.5 - 1.0)
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    let x = fixed(32, 1, (4, 8));
    let w1 = fixed(96, 2, (8, 12));
    let w2 = fixed(96, 3, (12, 8));
    // Single-device reference.
    let (vx, v1, v2) = (
        Var::from_tensor(&x).unwrap(),
        Var::from_tensor(&w1).unwrap(),
        Var::from_tensor(&w2).unwrap(),
    );
    let y = vx.matmul(&v1).unwrap().gelu().unwrap().matmul(&v2).unwrap();
    let loss = y.sqr().unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let ref_y = y.to_vec2::<f32>().unwrap();
    let ref_g1 = g.get(&v1).unwrap().to_vec2::<f32>().unwrap();
    let ref_gx = g.get(&vx).unwrap().to_vec2::<f32>().unwrap();
    let out = LocalWorld::new(4)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("tp", 4)])?;
            let xd = distribute_tensor(&x, &mesh, &[Placement::Replicate])?;
            let xv = Var::from_tensor(xd.to_local())?;
            let xd = DTensor::from_local(xv.as_tensor(), &mesh, &[Placement::Replicate])?;
            let w1d = distribute_tensor(&w1, &mesh, &[Placement::Shard(1)])?;
            let w1v = Var::from_tensor(w1d.to_local())?;
            let w1d = DTensor::from_local(w1v.as_tensor(), &mesh, &[Placement::Shard(1)])?;
            let w2d = distribute_tensor(&w2, &mesh, &[Placement::Shard(0)])?;
            let w2v = Var::from_tensor(w2d.to_local())?;
            let w2d = DTensor::from_local(w2v.as_tensor(), &mesh, &[Placement::Shard(0)])?;
            let mode = CommDebugMode::start();
            let h = xd.matmul(&w1d)?.gelu()?;
            let y = h.matmul(&w2d)?;
            let y = y.redistribute(&[Placement::Replicate])?;
            let loss = y.sqr()?.sum_all()?;
            let grads = loss.backward()?;
            let g1 = w1d.grad(&grads)?.ok_or("no gradient")?.full_tensor()?;
            let gx = grads.get(&xv).unwrap().clone();
            let fwd = mode.count("all_reduce", Phase::Forward);
            let bwd = mode.count("all_reduce", Phase::Backward);
            let _ = w2v;
            Ok((
                y.to_local().to_vec2::<f32>()?,
                g1.to_vec2::<f32>()?,
                gx.to_vec2::<f32>()?,
                fwd,
                bwd,
                mode.table(),
            ))
        })
        .unwrap();
    // f32 sums in a different order (sharded contraction + all_reduce): the error scales with
    // the tensor's magnitude, not with each element's (an entry near zero can come out of a
    // cancellation between large terms).
    let close = |got: &[Vec<f32>], want: &[Vec<f32>], what: &str| {
        let scale = want.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
        for (a, b) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "{what} {a} vs {b} (scale {scale})"
            );
        }
    };
    for (y, g1, gx, fwd, bwd, table) in out {
        close(&y, &ref_y, "y");
        close(&g1, &ref_g1, "g1");
        close(&gx, &ref_gx, "gx");
        assert_eq!((fwd, bwd), (1, 1), "{table}");
    }
}

#[test]
fn uneven_round_trip() {
    let x = Tensor::arange(0f32, 50., &Device::Cpu)
        .unwrap()
        .reshape((5, 10))
        .unwrap();
    let out = LocalWorld::new(4)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 4)])?;
            let d = distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?;
            let local_rows = d.to_local().dim(0)?;
            let s1 = d.redistribute(&[Placement::Shard(1)])?;
            let full = s1.full_tensor()?;
            let _ = DType::F32;
            Ok((local_rows, full.to_vec2::<f32>()?))
        })
        .unwrap();
    let rows: Vec<usize> = out.iter().map(|o| o.0).collect();
    assert_eq!(rows, vec![2, 2, 1, 0]);
    for (_, f) in out {
        assert_eq!(f, x.to_vec2::<f32>().unwrap());
    }
}

/// CommDebugMode puts the link model's time next to the time each rank waited: with a slow
/// modeled link on `dp` the records of an all_gather and an all_reduce carry the alpha-beta
/// time of their bytes, and the redistribution took at least that long (the local backend
/// paces by sleeping from when the progress thread starts the op, so the caller's own blocked
/// time can be shorter when it reached the wait late; the call's duration cannot); a
/// communicator without a link records no modeled time, but the wait.
#[test]
fn comm_debug_mode_shows_modeled_and_waited_time() {
    use candle_dtensor_comm::link::{link_hints, parse_link_spec};
    use candle_dtensor_comm::CommOptions;
    let links = parse_link_spec("dp=100us:0.05GBps").unwrap();
    let mut options = CommOptions::default().with_timeout(Duration::from_secs(60));
    for (k, v) in link_hints(&links) {
        options = options.with_hint(k, v);
    }
    let out = LocalWorld::new(4)
        .with_options(options)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2), ("tp", 2)])?;
            let x = Tensor::arange(0f32, 64.0 * 64.0, &Device::Cpu)?.reshape((64, 64))?;
            let d = distribute_tensor(&x, &mesh, &[Placement::Shard(0), Placement::Shard(1)])?;
            let mode = CommDebugMode::start();
            let t0 = std::time::Instant::now();
            let r = d.redistribute(&[Placement::Replicate, Placement::Shard(1)])?;
            let gather_us = t0.elapsed().as_secs_f64() * 1e6;
            let p = DTensor::from_local(
                r.to_local(),
                &mesh,
                &[
                    Placement::Partial(candle_dtensor_core::ReduceOp::Sum),
                    Placement::Shard(1),
                ],
            )?;
            let _ = p.redistribute(&[Placement::Replicate, Placement::Replicate])?;
            let table = mode.table();
            Ok((mode.records(), table, gather_us))
        })
        .unwrap();
    for (records, table, gather_us) in out {
        let ag = records
            .iter()
            .find(|r| r.kind == "all_gather" && r.mesh_dim == "dp")
            .unwrap_or_else(|| panic!("no dp all_gather in\n{table}"));
        // 64x32 f32 gathered over dp=2: 8192 B, (n-1)/n of it on the wire.
        assert_eq!(ag.bytes, 8192);
        let want = 100.0 + 0.5 * 8192.0 / (0.05 * 1e3);
        let modeled = ag.modeled_us.expect("modeled time on dp");
        assert!((modeled - want).abs() < 1e-6, "{modeled} vs {want}");
        assert!(ag.waited_us.is_some(), "no waited time in\n{table}");
        assert!(
            gather_us >= want,
            "the gather took {gather_us} us < modeled {want} us"
        );
        let ar = records
            .iter()
            .find(|r| r.kind == "all_reduce" && r.mesh_dim == "dp")
            .unwrap_or_else(|| panic!("no dp all_reduce in\n{table}"));
        let want = 100.0 + 2.0 * 0.5 * ar.bytes as f64 / (0.05 * 1e3);
        assert!((ar.modeled_us.unwrap() - want).abs() < 1e-6);
        // tp has no link: no modeled time, but a measured wait.
        for r in records.iter().filter(|r| r.mesh_dim == "tp") {
            assert_eq!(r.modeled_us, None, "{table}");
            assert!(r.waited_us.is_some(), "{table}");
        }
        assert!(table.contains("modeled ms"), "{table}");
    }
}
