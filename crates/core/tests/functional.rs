//! The public differentiable collectives on plain tensors against one device: values, the
//! gradients their adjoints produce (with distinct per-rank summands), and the collectives
//! CommDebugMode sees, on worlds 1-5 with uneven (and empty) torch.chunk pieces.
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::functional::{self as f, GatherBackward, Group};
use candle_dtensor_core::ReduceOp;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::shard_size_and_offset;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A deterministic tensor whose values depend on `salt` (distinct per rank when it is the
/// rank).
fn values(dims: &[usize], salt: usize) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7 + salt * 13 + 3) % 23) as f32 - 11.0) / 7.0)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{what}: element {i}: {x} vs {y}"
        );
    }
}

fn piece(t: &Tensor, dim: usize, n: usize, r: usize) -> Tensor {
    let (s, off) = shard_size_and_offset(t.dim(dim).unwrap(), n, r);
    t.narrow(dim, off, s).unwrap()
}

fn sum_over_ranks(n: usize, dims: &[usize]) -> Tensor {
    let mut acc = Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap();
    for r in 0..n {
        acc = (acc + values(dims, 100 + r)).unwrap();
    }
    acc
}

/// What one rank returns: (output, gradient of its input, forward and backward counts of the
/// expected collective kind).
type Out = (Tensor, Tensor, usize, usize);

fn on_world(n: usize, f: impl Fn(Group) -> R<Out> + Send + Sync) -> Vec<Out> {
    LocalWorld::new(n)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| f(Group::new(&comm)))
        .unwrap()
}

fn grad_of(grads: &candle_core::backprop::GradStore, v: &Var) -> R<Tensor> {
    Ok(match grads.get(v.as_tensor()) {
        Some(g) => g.clone(),
        None => v.as_tensor().zeros_like()?,
    })
}

fn counts(mode: &CommDebugMode, kind: &str) -> (usize, usize) {
    (
        mode.count(kind, Phase::Forward),
        mode.count(kind, Phase::Backward),
    )
}

const DIMS: [usize; 2] = [5, 3];

#[test]
fn copy_to_group_is_f() {
    for n in 1..=5 {
        let out = on_world(n, |g| {
            let x = Var::from_tensor(&values(&DIMS, 0))?;
            let mode = CommDebugMode::start();
            let y = f::copy_to_group(x.as_tensor(), &g)?;
            // A per-rank consumer: each rank's gradient is a partial sum.
            let loss = (&y * values(&DIMS, 100 + g.rank()))?.sum_all()?;
            let grads = loss.backward()?;
            let (fw, bw) = counts(&mode, "all_reduce");
            Ok((y, grad_of(&grads, &x)?, fw, bw))
        });
        for (r, (y, g, fw, bw)) in out.iter().enumerate() {
            let what = format!("world {n} rank {r}");
            close(y, &values(&DIMS, 0), &what);
            close(g, &sum_over_ranks(n, &DIMS), &what);
            assert_eq!(
                (*fw, *bw),
                (0, 1),
                "{what}: all_reduces (forward, backward)"
            );
        }
    }
}

#[test]
fn reduce_from_group_is_g() {
    for n in 1..=5 {
        let out = on_world(n, |g| {
            let x = Var::from_tensor(&values(&DIMS, 100 + g.rank()))?;
            let mode = CommDebugMode::start();
            let y = f::reduce_from_group(x.as_tensor(), &g)?;
            // A replicated consumer: the same on every rank.
            let loss = (&y * values(&DIMS, 7))?.sum_all()?;
            let grads = loss.backward()?;
            let (fw, bw) = counts(&mode, "all_reduce");
            Ok((y, grad_of(&grads, &x)?, fw, bw))
        });
        for (r, (y, g, fw, bw)) in out.iter().enumerate() {
            let what = format!("world {n} rank {r}");
            close(y, &sum_over_ranks(n, &DIMS), &what);
            close(g, &values(&DIMS, 7), &what);
            assert_eq!(
                (*fw, *bw),
                (1, 0),
                "{what}: all_reduces (forward, backward)"
            );
        }
    }
}

#[test]
fn all_reduce_avg_and_max() {
    for n in [2, 3] {
        let out = on_world(n, |g| {
            let x = Var::from_tensor(&values(&DIMS, 100 + g.rank()))?;
            let avg = f::all_reduce(x.as_tensor(), &g, ReduceOp::Avg)?;
            let grads = (&avg * values(&DIMS, 7))?.sum_all()?.backward()?;
            Ok((avg, grad_of(&grads, &x)?, 0, 0))
        });
        let want = (sum_over_ranks(n, &DIMS) / n as f64).unwrap();
        for (r, (y, g, _, _)) in out.iter().enumerate() {
            close(y, &want, &format!("avg world {n} rank {r}"));
            close(
                g,
                &(values(&DIMS, 7) / n as f64).unwrap(),
                &format!("avg grad world {n} rank {r}"),
            );
        }
    }
}

#[test]
fn all_gather_both_backwards_uneven() {
    // 7 rows over 4 ranks: 2, 2, 2, 1; 5 over 4: 2, 2, 1, 0 (an empty piece).
    for (n, rows) in [(1, 4), (2, 5), (3, 7), (4, 7), (4, 5), (5, 6)] {
        let full = values(&[rows, 3], 0);
        for backward in [GatherBackward::Chunk, GatherBackward::ReduceScatter] {
            let out = on_world(n, |g| {
                let x = Var::from_tensor(&piece(&full, 0, n, g.rank()))?;
                let mode = CommDebugMode::start();
                let y = f::all_gather(x.as_tensor(), &g, 0, rows, backward)?;
                let c = match backward {
                    GatherBackward::Chunk => values(&[rows, 3], 7),
                    GatherBackward::ReduceScatter => values(&[rows, 3], 100 + g.rank()),
                };
                let grads = (&y * c)?.sum_all()?.backward()?;
                let rs = mode.count("reduce_scatter", Phase::Backward);
                let (fw, _) = counts(&mode, "all_gather");
                Ok((y, grad_of(&grads, &x)?, fw, rs))
            });
            let dl = match backward {
                GatherBackward::Chunk => values(&[rows, 3], 7),
                GatherBackward::ReduceScatter => sum_over_ranks(n, &[rows, 3]),
            };
            for (r, (y, g, fw, rs)) in out.iter().enumerate() {
                let what = format!("{backward:?} world {n} rows {rows} rank {r}");
                close(y, &full, &what);
                close(g, &piece(&dl, 0, n, r), &what);
                assert_eq!(*fw, 1, "{what}: forward all_gathers");
                let want_rs = usize::from(backward == GatherBackward::ReduceScatter);
                assert_eq!(*rs, want_rs, "{what}: backward reduce_scatters");
            }
        }
    }
}

#[test]
fn reduce_scatter_and_scatter_uneven_last_dim() {
    for (n, cols) in [(2, 5), (3, 7), (4, 5)] {
        let dims = [3, cols];
        // reduce_scatter: distinct full-shaped summands in, this rank's columns of the sum out.
        let out = on_world(n, |g| {
            let x = Var::from_tensor(&values(&dims, 100 + g.rank()))?;
            let mode = CommDebugMode::start();
            let y = f::reduce_scatter(x.as_tensor(), &g, 1)?;
            let c = piece(&values(&dims, 7), 1, n, g.rank());
            let grads = (&y * c)?.sum_all()?.backward()?;
            let (fw, _) = counts(&mode, "reduce_scatter");
            let (_, bw) = counts(&mode, "all_gather");
            Ok((y, grad_of(&grads, &x)?, fw, bw))
        });
        for (r, (y, g, fw, bw)) in out.iter().enumerate() {
            let what = format!("reduce_scatter world {n} cols {cols} rank {r}");
            close(y, &piece(&sum_over_ranks(n, &dims), 1, n, r), &what);
            close(g, &values(&dims, 7), &what);
            assert_eq!((*fw, *bw), (1, 1), "{what}: rs forward, ag backward");
        }
        // scatter_to_group: a replicated input, this rank's columns out; the gradient of the
        // input is every rank's piece gathered.
        let out = on_world(n, |g| {
            let x = Var::from_tensor(&values(&dims, 0))?;
            let y = f::scatter_to_group(x.as_tensor(), &g, 1)?;
            let c = piece(&values(&dims, 7), 1, n, g.rank());
            let grads = (&y * c)?.sum_all()?.backward()?;
            Ok((y, grad_of(&grads, &x)?, 0, 0))
        });
        for (r, (y, g, _, _)) in out.iter().enumerate() {
            let what = format!("scatter world {n} cols {cols} rank {r}");
            close(y, &piece(&values(&dims, 0), 1, n, r), &what);
            close(g, &values(&dims, 7), &what);
        }
    }
}

#[test]
fn vocab_parallel_embedding_matches_one_device() {
    let ids = Tensor::new(&[[0u32, 4, 2], [3, 3, 1]], &Device::Cpu).unwrap();
    for (n, vocab) in [(1, 5), (2, 5), (3, 5), (4, 5), (4, 9)] {
        let table = values(&[vocab, 4], 0);
        let c = values(&[2, 3, 4], 7);
        // One device.
        let w = Var::from_tensor(&table).unwrap();
        let want = candle_nn::Embedding::new(w.as_tensor().clone(), 4);
        let want_y = candle_core::Module::forward(&want, &ids).unwrap();
        let want_g = (&want_y * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
            .get(w.as_tensor())
            .unwrap()
            .clone();
        let out = on_world(n, |g| {
            let w = Var::from_tensor(&piece(&table, 0, n, g.rank()))?;
            let mode = CommDebugMode::start();
            let y = f::vocab_parallel_embedding(&ids, w.as_tensor(), vocab, &g)?;
            let grads = (&y * &c)?.sum_all()?.backward()?;
            let (fw, bw) = counts(&mode, "all_reduce");
            Ok((y, grad_of(&grads, &w)?, fw, bw))
        });
        for (r, (y, g, fw, bw)) in out.iter().enumerate() {
            let what = format!("world {n} vocab {vocab} rank {r}");
            close(y, &want_y, &what);
            close(g, &piece(&want_g, 0, n, r), &what);
            assert_eq!((*fw, *bw), (1, 0), "{what}: all_reduces");
        }
    }
}

#[test]
fn bad_pieces_are_typed_errors() {
    let out = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| -> R<_> {
            let g = Group::new(&comm);
            // 4 rows on every rank, where a vocab of 5 over 2 ranks is 3 + 2 rows: every rank
            // fails before any collective (a rank that went on would wait for the others).
            let w = Tensor::zeros((4, 4), DType::F32, &Device::Cpu)?;
            let ids = Tensor::new(&[0u32, 1], &Device::Cpu)?;
            let e1 = f::vocab_parallel_embedding(&ids, &w, 5, &g)
                .err()
                .map(|e| e.to_string());
            let e2 = f::vocab_parallel_embedding(&ids.to_dtype(DType::F32)?, &w, 8, &g)
                .err()
                .map(|e| e.to_string());
            let e3 = f::all_gather(&w, &g, 0, 5, GatherBackward::Chunk)
                .err()
                .map(|e| e.to_string());
            Ok((e1, e2, e3))
        })
        .unwrap();
    for (e1, e2, e3) in out {
        let e = e1.expect("a table piece of the wrong size");
        assert!(
            e.contains("vocab_parallel_embedding") && e.contains("4 rows"),
            "{e}"
        );
        let e = e2.expect("float ids");
        assert!(e.contains("integers"), "{e}");
        let e = e3.expect("a 4-row piece of 5 rows over 2 ranks");
        assert!(e.contains("all_gather") && e.contains("4 rows"), "{e}");
    }
}

#[test]
fn group_of_a_mesh_dim_records_under_its_name() {
    let out = LocalWorld::new(4)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2), ("tp", 2)])?;
            let tp = Group::from_mesh(&mesh, "tp")?;
            let mode = CommDebugMode::start();
            let x = values(&[2, 2], 100 + mesh.rank());
            let y = f::reduce_from_group(&x, &tp)?;
            let rec = mode.records();
            Ok((tp.size(), tp.rank(), y, rec[0].mesh_dim.clone()))
        })
        .unwrap();
    for (rank, (size, r, y, dim)) in out.iter().enumerate() {
        assert_eq!((*size, *r), (2, rank % 2));
        assert_eq!(dim, "tp");
        // Ranks 2d and 2d+1 form a tp group.
        let d = rank / 2;
        let want = (values(&[2, 2], 100 + 2 * d) + values(&[2, 2], 101 + 2 * d)).unwrap();
        close(y, &want, &format!("rank {rank}"));
    }
}
