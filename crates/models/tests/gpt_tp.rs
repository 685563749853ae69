//! GPT under tensor parallelism matches the single-rank model.
// The GPT-training helpers every crate's GPT tests share (they train through train's run).
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_core::DType;
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::debug::CommDebugMode;
use candle_dtensor_kernels::compare::compare_series_f32;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::Gpt;
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::data::Corpus;
use candle_nn::Optimizer;

use common::{micro_gpt, R};

fn train(world: usize, tp: usize, sp: bool, steps: usize) -> (Vec<f32>, String) {
    let cfg = micro_gpt();
    let corpus = Corpus::synthetic(cfg.vocab, 4096, 5);
    let out = LocalWorld::new(world)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| -> R<_> {
            let dims: Vec<(&str, usize)> = if world / tp > 1 {
                vec![("dp", world / tp), ("tp", tp)]
            } else {
                vec![("tp", tp)]
            };
            let mesh = DeviceMesh::new(comm, &dims)?;
            let (gpt, store) = Gpt::new(&cfg, &mesh, &TpPlan::gpt(sp), 7, DType::F32)?;
            let mut opt = candle_nn::AdamW::new(
                store.vars(),
                candle_nn::ParamsAdamW {
                    lr: 1e-3,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?;
            let mut losses = Vec::new();
            let mut table = String::new();
            for step in 0..steps {
                let (x, y) = common::gpt_batch(&corpus, step, (4, cfg.seq_len, 11), &gpt, &mesh)?;
                let mode = CommDebugMode::start();
                let loss = gpt.loss(&x, &y)?;
                let loss = loss.redistribute(&vec![
                    candle_dtensor_core::Placement::Replicate;
                    mesh.ndim()
                ])?;
                let grads = loss.backward()?;
                opt.step(&grads)?;
                losses.push(loss.to_local().to_scalar::<f32>()?);
                table = mode.table();
            }
            Ok((losses, table))
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn tp_matches_single() {
    // 20 steps, TP=2 and TP=4 with and without sequence parallelism, and dp x tp: every loss
    // within 1e-4 relative of the single-device run.
    let steps = 20;
    let (reference, _) = train(1, 1, false, steps);
    assert!(
        reference[steps - 1] < reference[0] - 0.1,
        "the model must learn: {reference:?}"
    );
    for (world, tp, sp) in [
        (2, 2, false),
        (4, 4, false),
        (2, 2, true),
        (4, 4, true),
        (4, 2, true),
    ] {
        let (losses, table) = train(world, tp, sp, steps);
        if let Err(e) = compare_series_f32("loss", &losses, &reference).and_then(|d| d.within(1e-4))
        {
            panic!("world {world} tp {tp} sp {sp}: {e} ({losses:?} vs {reference:?})\n{table}");
        }
    }
}

/// Collectives of one training step by (label, phase, kind).
fn pattern(sp: bool) -> std::collections::BTreeMap<(String, String, String), usize> {
    let cfg = micro_gpt();
    let corpus = Corpus::synthetic(cfg.vocab, 4096, 5);
    let out = LocalWorld::new(4)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("tp", 4)])?;
            let (gpt, _) = Gpt::new(&cfg, &mesh, &TpPlan::gpt(sp), 7, DType::F32)?;
            let (x, y) = common::gpt_batch(&corpus, 0, (4, cfg.seq_len, 11), &gpt, &mesh)?;
            let mode = CommDebugMode::start();
            gpt.loss(&x, &y)?.backward()?;
            Ok(mode
                .counts_by_label()
                .into_iter()
                .map(|((l, p, k), n)| ((l, format!("{p:?}"), k.to_string()), n))
                .collect::<std::collections::BTreeMap<_, _>>())
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

fn count(
    p: &std::collections::BTreeMap<(String, String, String), usize>,
    label: &str,
    phase: &str,
    kind: &str,
) -> usize {
    p.get(&(label.to_string(), phase.to_string(), kind.to_string()))
        .copied()
        .unwrap_or(0)
}

#[test]
fn megatron_pattern_per_block() {
    // Without SP: one all_reduce forward and one backward per attention and per MLP, nothing else.
    let p = pattern(false);
    for b in 0..2 {
        for part in ["attn", "mlp"] {
            let l = format!("blocks.{b}.{part}");
            assert_eq!(count(&p, &l, "Forward", "all_reduce"), 1, "{l}: {p:?}");
            assert_eq!(count(&p, &l, "Backward", "all_reduce"), 1, "{l}: {p:?}");
            let total: usize = p.iter().filter(|(k, _)| k.0 == l).map(|(_, n)| n).sum();
            assert_eq!(total, 2, "{l}: {p:?}");
        }
    }
    // Vocab-parallel embedding: one all_reduce forward; loss-parallel cross-entropy: three small
    // all_reduces forward (max, sum of exps, target logit) and no communication backward.
    assert_eq!(count(&p, "embed", "Forward", "all_reduce"), 1, "{p:?}");
    assert_eq!(count(&p, "loss", "Forward", "all_reduce"), 3, "{p:?}");
    assert_eq!(count(&p, "loss", "Backward", "all_reduce"), 0, "{p:?}");
    assert!(
        !p.keys()
            .any(|k| k.2 == "all_to_all" || (k.0 == "loss" && k.2 == "all_gather")),
        "{p:?}"
    );

    // With SP: one all_gather and one reduce_scatter each way per attention and per MLP; the
    // only other collectives are the backward all_reduces of the replicated norm weights and
    // row-parallel biases, whose gradients are partial sums over the sequence shards.
    let p = pattern(true);
    for b in 0..2 {
        for part in ["attn", "mlp"] {
            let l = format!("blocks.{b}.{part}");
            for phase in ["Forward", "Backward"] {
                assert_eq!(count(&p, &l, phase, "all_gather"), 1, "{l} {phase}: {p:?}");
                assert_eq!(
                    count(&p, &l, phase, "reduce_scatter"),
                    1,
                    "{l} {phase}: {p:?}"
                );
            }
            assert_eq!(count(&p, &l, "Forward", "all_reduce"), 0, "{l}: {p:?}");
            // ln weight, ln bias, row-parallel bias.
            assert_eq!(count(&p, &l, "Backward", "all_reduce"), 3, "{l}: {p:?}");
        }
    }
}
