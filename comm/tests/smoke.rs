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
