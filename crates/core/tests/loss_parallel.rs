//! Loss-parallel cross-entropy (logits sharded on the class dim, forced with
//! `cross_entropy_with_layout`) against single-device candle: the loss and the reassembled
//! logits gradient, for uneven class shards, row-sharded batches and 1-D / 2-D meshes, on
//! `[N, C]` logits and on a language model's `[B, T, V]` ones (no flattening reshape).
mod common;

use candle_core::{DType, Tensor, Var};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use common::*;

fn reference(logits: &Tensor, targets: &Tensor) -> (f32, Tensor) {
    let v = Var::from_tensor(logits).unwrap();
    let c = logits.rank() - 1;
    let lsm = candle_dtensor_core::reference::log_softmax(v.as_tensor(), c).unwrap();
    let picked = lsm
        .gather(
            &targets.to_dtype(DType::U32).unwrap().unsqueeze(c).unwrap(),
            c,
        )
        .unwrap();
    let loss = picked.neg().unwrap().mean_all().unwrap();
    let g = loss.backward().unwrap();
    (loss.to_scalar().unwrap(), g.get(&v).unwrap().clone())
}

/// Logits `[lead.., c]` placed by `logits_pl` (targets sharded on the same leading dims,
/// replicated elsewhere), the loss-parallel layout forced.
fn check(mesh_shape: &[usize], logits_pl: Vec<Placement>, lead: &[usize], c: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut shape = lead.to_vec();
    shape.push(c);
    let logits = tensor(&mut rng, &shape, Domain::Normal);
    let targets = tensor(&mut rng, lead, Domain::IdsI64(c));
    let (want_loss, want_grad) = reference(&logits, &targets);
    let tgt_pl: Vec<Placement> = logits_pl
        .iter()
        .map(|p| match p {
            Placement::Shard(d) if *d < lead.len() => Placement::Shard(*d),
            _ => Placement::Replicate,
        })
        .collect();
    let out = on_mesh(mesh_shape, |mesh| {
        let x = distribute_tensor(&logits, &mesh, &logits_pl)?;
        let leaf = Var::from_tensor(x.to_local())?;
        let x = DTensor::from_local_with_shape(leaf.as_tensor(), &mesh, &logits_pl, &shape)?;
        let t = distribute_tensor(&targets, &mesh, &tgt_pl)?;
        let loss = x.cross_entropy_with_layout(&t, Some(&logits_pl))?;
        let loss = loss.redistribute(&all_r(mesh.ndim()))?;
        let grads = loss.backward()?;
        let g = grads
            .get(&leaf)
            .cloned()
            .unwrap_or(leaf.as_tensor().zeros_like()?);
        let g = DTensor::from_local_with_shape(&g, &mesh, &logits_pl, &shape)?.full_tensor()?;
        Ok((loss.to_local().to_scalar::<f32>()?, g))
    })
    .unwrap();
    for (rank, (loss, grad)) in out.iter().enumerate() {
        let what = format!("mesh {mesh_shape:?} {logits_pl:?} {shape:?} rank {rank}");
        assert!(
            loss.is_finite() && (loss - want_loss).abs() <= 1e-5 * (1.0 + want_loss.abs()),
            "{what}: loss {loss} vs {want_loss}"
        );
        close(grad, &want_grad, 1e-5).unwrap_or_else(|e| panic!("{what}: grad: {e}"));
    }
}

#[test]
fn class_sharded_cross_entropy_matches_single_device() {
    use Placement::{Replicate as R, Shard as S};
    let mut seed = 1;
    for world in 1..=5 {
        // Uneven class shards, including a rank that owns no classes (c < world).
        for c in [world.max(2) * 3 + 1, 7, 3] {
            check(&[world], vec![S(1)], &[6], c, seed);
            seed += 1;
        }
    }
    // 2-D: rows sharded on one mesh dim, classes on the other; classes on both.
    check(&[2, 3], vec![S(0), S(1)], &[6], 11, 100);
    check(&[2, 2], vec![S(1), S(1)], &[4], 9, 101);
    check(&[2, 2], vec![R, S(1)], &[3], 10, 102);
    // [B, T, V] logits: the vocabulary sharded, alone or beside a batch or sequence shard
    // (uneven: 3 rows on 2 ranks, 5 positions on 2), and one row of logits [V].
    check(&[3], vec![S(2)], &[2, 5], 8, 103);
    check(&[2, 3], vec![S(0), S(2)], &[3, 4], 10, 104);
    check(&[2, 2], vec![S(1), S(2)], &[2, 5], 7, 105);
    check(&[2], vec![S(0)], &[], 9, 106);
}

/// bf16 logits give an f32 loss (autocast's: the loss computed in f32), on one device and with
/// the classes or the rows sharded: the f32 loss of the bf16 values, and their gradient in
/// bf16.
#[test]
fn bf16_logits_give_an_f32_loss() {
    use Placement::{Replicate as R, Shard as S};
    let (n, c) = (6, 11);
    let mut rng = Rng::new(7);
    let logits = tensor(&mut rng, &[n, c], Domain::Normal)
        .to_dtype(DType::BF16)
        .unwrap();
    let targets = tensor(&mut rng, &[n], Domain::IdsI64(c));
    let (want_loss, want_grad) = reference(&logits.to_dtype(DType::F32).unwrap(), &targets);
    for (world, pl) in [(1, R), (2, S(1)), (3, S(1)), (2, S(0)), (3, S(0))] {
        let out = on_mesh(&[world], |mesh| {
            let x = distribute_tensor(&logits, &mesh, &[pl])?;
            let leaf = Var::from_tensor(x.to_local())?;
            let x = DTensor::from_local_with_shape(leaf.as_tensor(), &mesh, &[pl], &[n, c])?;
            let tpl = if pl == S(0) { S(0) } else { R };
            let t = distribute_tensor(&targets, &mesh, &[tpl])?;
            let loss = x.cross_entropy_with_layout(&t, Some(&[pl]))?;
            let spec_f32 = format!("{:?}", loss.spec().meta.dtype) == "F32";
            let loss = loss.redistribute(&all_r(1))?;
            let grads = loss.backward()?;
            let g = grads
                .get(&leaf)
                .cloned()
                .unwrap_or(leaf.as_tensor().zeros_like()?);
            let g_dtype = g.dtype();
            let g = DTensor::from_local_with_shape(&g, &mesh, &[pl], &[n, c])?.full_tensor()?;
            Ok((
                loss.dtype(),
                spec_f32,
                loss.to_local().to_scalar::<f32>()?,
                g_dtype,
                g,
            ))
        })
        .unwrap();
        for (rank, (dt, spec_f32, loss, g_dtype, g)) in out.into_iter().enumerate() {
            let what = format!("world {world} {pl:?} rank {rank}");
            assert_eq!(dt, DType::F32, "{what}: the loss's dtype");
            assert!(spec_f32, "{what}: the loss's spec dtype");
            assert!(
                (loss - want_loss).abs() <= 1e-5 * (1.0 + want_loss.abs()),
                "{what}: loss {loss} vs {want_loss}"
            );
            assert_eq!(g_dtype, DType::BF16, "{what}: the gradient's dtype");
            // The f32 gradient rounded once to bf16 (2^-9 relative).
            close(&g.to_dtype(DType::F32).unwrap(), &want_grad, 1e-2)
                .unwrap_or_else(|e| panic!("{what}: grad: {e}"));
        }
    }
}
