//! Mesh dims of one rank cost nothing. A GPT on a mesh whose dims all have size 1 (`dp=1`;
//! `tp=1` under the tensor-parallel plan, with and without sequence parallelism; `dp=1 x tp=1`)
//! runs no collective, and its autograd graph holds activations only: no copy of a parameter
//! (the gradient sync of a replicated parameter, an all_reduce over one rank, used to be a
//! graph node copying the parameter on every use) and no separate bias add after a row-parallel
//! linear (the bias was added after the reduction of partial products, which one rank does not
//! have). Every layout's loss and gradients are the same bits as `dp=1`'s.
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_core::{DType, Tensor};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::debug::CommDebugMode;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::Gpt;
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::data::Corpus;

use common::{micro_gpt, R};

/// Batch rows and sequence length: `B` and `B * T` (3 and 48) are no parameter's leading dim
/// in `micro_gpt` (64, 16, 32, 96, 128), so the graph's shapes tell activations from copies of
/// parameters.
const B: usize = 3;
const T: usize = 16;

/// What one layout's forward and backward give.
struct Run {
    loss: f32,
    grads: Vec<Vec<f32>>,
    /// Shapes of the graph's non-parameter nodes.
    nodes: Vec<Vec<usize>>,
    collectives: usize,
}

fn run(dims: &[(&'static str, usize)], plan: TpPlan) -> Run {
    let cfg = micro_gpt();
    let corpus = Corpus::synthetic(cfg.vocab, 4096, 5);
    let dims = dims.to_vec();
    LocalWorld::new(1)
        .with_timeout(Duration::from_secs(120))
        .launch(move |comm| -> R<Run> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            let (gpt, store) = Gpt::build(&cfg, &mesh, &plan, 7, DType::F32, None)?;
            let (x, y) = common::gpt_batch(&corpus, 0, (B, T, 11), &gpt, &mesh)?;
            let mode = CommDebugMode::start();
            let loss = gpt.loss(&x, &y)?;
            let l = loss.to_local();
            let nodes = l
                .sorted_nodes()
                .iter()
                .filter(|n| !n.is_variable())
                .map(|n| n.dims().to_vec())
                .collect();
            let grads = l.backward()?;
            let grads = store
                .vars()
                .iter()
                .map(|v| -> R<Vec<f32>> {
                    let g = grads
                        .get(v.as_tensor())
                        .ok_or("a parameter without gradient")?;
                    Ok(g.flatten_all()?.to_vec1::<f32>()?)
                })
                .collect::<R<_>>()?;
            Ok(Run {
                loss: l.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                grads,
                nodes,
                collectives: mode.records().len(),
            })
        })
        .expect("the rank ran")
        .into_iter()
        .next()
        .expect("one rank")
}

#[test]
fn one_rank_dims_add_no_node_and_no_collective() {
    let reference = run(&[("dp", 1)], TpPlan::gpt(false));
    for n in &reference.nodes {
        assert!(
            n.is_empty() || n[0] == B || n[0] == B * T,
            "dp=1: a graph node of shape {n:?} is not an activation (a parameter's copy?)"
        );
    }
    assert_eq!(reference.collectives, 0, "dp=1 ran collectives");
    for (name, dims, plan) in [
        ("tp=1", vec![("tp", 1)], TpPlan::gpt(false)),
        ("tp=1 sequence parallel", vec![("tp", 1)], TpPlan::gpt(true)),
        (
            "dp=1 x tp=1",
            vec![("dp", 1), ("tp", 1)],
            TpPlan::gpt(false),
        ),
    ] {
        let r = run(&dims, plan);
        assert_eq!(r.collectives, 0, "{name}: collectives ran");
        assert_eq!(
            r.nodes, reference.nodes,
            "{name}: the graph's nodes differ from dp=1's"
        );
        assert_eq!(r.loss.to_bits(), reference.loss.to_bits(), "{name}: loss");
        assert_eq!(r.grads.len(), reference.grads.len());
        for (i, (a, b)) in r.grads.iter().zip(&reference.grads).enumerate() {
            let same =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{name}: gradient {i} differs from dp=1's");
            assert!(
                a.iter().all(|x| x.is_finite()),
                "{name}: gradient {i} not finite"
            );
        }
    }
}

/// The reference is not vacuous: on two ranks the same parameter's gradient does need its
/// all_reduce (a node per use), and the graph holds it.
#[test]
fn two_data_parallel_ranks_still_sync_parameter_gradients() {
    let cfg = micro_gpt();
    let corpus = Corpus::synthetic(cfg.vocab, 4096, 5);
    let out = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(120))
        .launch(move |comm| -> R<(usize, bool)> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
            let (gpt, _store) = Gpt::build(&cfg, &mesh, &TpPlan::gpt(false), 7, DType::F32, None)?;
            let (x, y) = common::gpt_batch(&corpus, 0, (2 * B, T, 11), &gpt, &mesh)?;
            let mode = CommDebugMode::start();
            let loss = gpt.loss(&x, &y)?;
            let l: &Tensor = loss.to_local();
            let copies = l.sorted_nodes().iter().any(|n| {
                !n.is_variable() && !n.dims().is_empty() && n.dims()[0] != B && n.dims()[0] != B * T
            });
            l.backward()?;
            let backward_reduces = mode
                .records()
                .iter()
                .filter(|r| r.kind == "all_reduce")
                .count();
            Ok((backward_reduces, copies))
        })
        .expect("the ranks ran");
    for (rank, (reduces, copies)) in out.into_iter().enumerate() {
        assert!(reduces > 0, "rank {rank}: no gradient all_reduce on dp=2");
        assert!(
            copies,
            "rank {rank}: no synced parameter in the graph on dp=2"
        );
    }
}
