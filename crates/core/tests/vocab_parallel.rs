//! Vocab-parallel embedding (the table sharded on its rows, forced with
//! `embedding_with_layout`) against single-device candle: the looked-up rows and the table's
//! gradient, for uneven row shards (a rank owning no rows included), repeated ids, ids sharded
//! on another mesh dim, and 1-D / 2-D meshes.
mod common;

use candle_core::{DType, Tensor, Var};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use common::*;

/// The lookup and the gradient of `sum(y * c)` with respect to the table on one device.
fn reference(table: &Tensor, ids: &Tensor, c: &Tensor) -> (Tensor, Tensor) {
    let w = Var::from_tensor(table).unwrap();
    let flat = ids.flatten_all().unwrap().to_dtype(DType::U32).unwrap();
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1).unwrap());
    let y = w.as_tensor().index_select(&flat, 0).unwrap();
    let y = y.reshape(dims).unwrap();
    let g = (&y * c).unwrap().sum_all().unwrap().backward().unwrap();
    (y, g.get(&w).unwrap().clone())
}

fn check(
    mesh_shape: &[usize],
    table_pl: Vec<Placement>,
    ids_pl: Vec<Placement>,
    ids_shape: &[usize],
    vocab: usize,
    seed: u64,
) {
    let d = 5;
    let mut rng = Rng::new(seed);
    let table = tensor(&mut rng, &[vocab, d], Domain::Normal);
    let ids = tensor(&mut rng, ids_shape, Domain::IdsI64(vocab));
    let mut out_dims = ids_shape.to_vec();
    out_dims.push(d);
    // Distinct weights per output element, so every row's gradient is its own sum.
    let c = tensor(&mut rng, &out_dims, Domain::Normal);
    let (want_y, want_g) = reference(&table, &ids, &c);
    let out = on_mesh(mesh_shape, |mesh| {
        let w = distribute_tensor(&table, &mesh, &table_pl)?;
        let leaf = Var::from_tensor(w.to_local())?;
        let w = DTensor::from_local_with_shape(leaf.as_tensor(), &mesh, &table_pl, &[vocab, d])?;
        let i = distribute_tensor(&ids, &mesh, &ids_pl)?;
        let y = i.embedding_with_layout(&w, Some(&table_pl))?;
        let y = y.redistribute(&all_r(mesh.ndim()))?;
        let c = distribute_tensor(&c, &mesh, &all_r(mesh.ndim()))?;
        let grads = y.mul(&c)?.sum_all()?.backward()?;
        let g = grads
            .get(&leaf)
            .cloned()
            .unwrap_or(leaf.as_tensor().zeros_like()?);
        let g = DTensor::from_local_with_shape(&g, &mesh, &table_pl, &[vocab, d])?.full_tensor()?;
        Ok((y.to_local().clone(), g))
    })
    .unwrap();
    for (rank, (y, g)) in out.iter().enumerate() {
        let what = format!(
            "mesh {mesh_shape:?} table {table_pl:?} ids {ids_pl:?} vocab {vocab} rank {rank}"
        );
        close(y, &want_y, 1e-6).unwrap_or_else(|e| panic!("{what}: rows: {e}"));
        close(g, &want_g, 1e-5).unwrap_or_else(|e| panic!("{what}: table gradient: {e}"));
    }
}

#[test]
fn vocab_sharded_embedding_matches_single_device() {
    use Placement::{Replicate as R, Shard as S};
    let mut seed = 1;
    for world in 1..=5 {
        // Uneven row shards, including a rank that owns no rows (vocab < world); many more
        // positions than rows, so ids repeat and most positions are another rank's.
        for vocab in [world * 3 + 1, 7, 3] {
            check(&[world], vec![S(0)], vec![R], &[2, 9], vocab, seed);
            seed += 1;
        }
    }
    // 2-D: ids sharded on one mesh dim, the table on the other; the table on both.
    check(&[2, 3], vec![R, S(0)], vec![S(0), R], &[4, 5], 11, 100);
    check(&[2, 2], vec![S(0), S(0)], vec![R, R], &[3, 7], 9, 101);
    check(&[3, 2], vec![S(0), R], vec![R, S(1)], &[2, 6], 5, 102);
}
