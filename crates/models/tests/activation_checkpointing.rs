//! Activation checkpointing ([`AcMode`]): the same losses and gradients as without it, on one
//! device and under data parallelism, tensor parallelism and FSDP, for much less autograd-graph
//! memory.
// The GPT-training helpers every crate's GPT tests share.
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_core::{DType, Tensor};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::debug::graph_bytes;
use candle_dtensor_core::Placement;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{AcMode, Gpt, GptConfig};
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::data::Corpus;
use candle_nn::Optimizer;

use common::{micro_gpt, R};

/// What one rank saw over a short run: every step's loss, every step's gradients (one flat
/// vector per parameter, in the store's order) and the graph bytes of every step's loss.
#[derive(Debug, Default)]
struct Run {
    losses: Vec<f32>,
    grads: Vec<Vec<Vec<f32>>>,
    bytes: Vec<usize>,
}

/// How the ranks are laid out.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// One device.
    Single,
    /// Plain data parallelism over 2 ranks (replicated parameters).
    Dp2,
    /// Tensor parallelism over 2 ranks (Megatron plan, `sp`: sequence parallel).
    Tp2 { sp: bool },
    /// FSDP over 2 ranks, one unit per block.
    Fsdp2,
}

/// `steps` AdamW steps of `cfg` (its `ac` as given) laid out as `layout`, on batches of `rows`
/// sequences; rank 0's [`Run`].
fn run(cfg: &GptConfig, layout: Layout, steps: usize, rows: usize) -> Run {
    let corpus = Corpus::synthetic(cfg.vocab, 8192, 5);
    let (world, dims): (usize, Vec<(&str, usize)>) = match layout {
        Layout::Single => (1, vec![("dp", 1)]),
        Layout::Dp2 | Layout::Fsdp2 => (2, vec![("dp", 2)]),
        Layout::Tp2 { .. } => (2, vec![("tp", 2)]),
    };
    let plan = match layout {
        Layout::Tp2 { sp } => TpPlan::gpt(sp),
        _ => TpPlan::new(),
    };
    LocalWorld::new(world)
        .with_timeout(Duration::from_secs(120))
        .launch(|comm| -> R<Run> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            let fsdp = match layout {
                Layout::Fsdp2 => Some(Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Sum))?),
                _ => None,
            };
            let (gpt, store) = Gpt::build(cfg, &mesh, &plan, 7, DType::F32, fsdp.as_ref())?;
            let vars = store.vars();
            let mut opt = candle_nn::AdamW::new(
                vars.clone(),
                candle_nn::ParamsAdamW {
                    lr: 1e-3,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?;
            let mut out = Run::default();
            for step in 0..steps {
                let (x, y) =
                    common::gpt_batch(&corpus, step, (rows, cfg.seq_len, 11), &gpt, &mesh)?;
                let loss = gpt.loss(&x, &y)?;
                out.bytes.push(graph_bytes(loss.to_local()));
                let loss = loss.redistribute(&vec![Placement::Replicate; mesh.ndim()])?;
                let mut grads = loss.to_local().backward()?;
                if let Some(f) = &fsdp {
                    f.finish_backward(&mut grads)?;
                }
                let mut g = Vec::new();
                for v in &vars {
                    let t = grads.get(v).cloned().unwrap_or(Tensor::zeros(
                        v.shape(),
                        DType::F32,
                        v.device(),
                    )?);
                    g.push(t.flatten_all()?.to_vec1::<f32>()?);
                }
                out.grads.push(g);
                opt.step(&grads)?;
                out.losses.push(loss.to_local().to_scalar::<f32>()?);
            }
            Ok(out)
        })
        .unwrap()
        .into_iter()
        .next()
        .unwrap()
}

/// [`assert_same`], and the checkpointed run kept less graph than the reference at every step.
fn assert_same_for_less(what: &str, got: &Run, want: &Run) {
    assert_same(what, got, want);
    for (s, (g, w)) in got.bytes.iter().zip(&want.bytes).enumerate() {
        assert!(g < w, "{what}: step {s}: {g} graph bytes, none {w}");
    }
}

/// Losses within 1e-6 relative and every gradient element within 1e-5 (relative to the
/// parameter's largest gradient element, at least 1e-6) of the reference run.
fn assert_same(what: &str, got: &Run, want: &Run) {
    common::assert_close(&got.losses, &want.losses, 1e-6, &format!("{what}: losses"));
    assert_eq!(got.grads.len(), want.grads.len(), "{what}: steps");
    for (s, (gs, ws)) in got.grads.iter().zip(&want.grads).enumerate() {
        assert_eq!(gs.len(), ws.len(), "{what}: parameters");
        for (p, (g, w)) in gs.iter().zip(ws).enumerate() {
            assert_eq!(g.len(), w.len(), "{what}: step {s} parameter {p}: sizes");
            let scale = w.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let worst = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-5 * scale,
                "{what}: step {s} parameter {p}: gradient off by {worst} (largest {scale})"
            );
        }
    }
}

fn with_ac(cfg: &GptConfig, ac: AcMode) -> GptConfig {
    GptConfig { ac, ..cfg.clone() }
}

/// The micro GPT with 4 blocks, so `selective` checkpoints some blocks and not others.
fn cfg4() -> GptConfig {
    GptConfig {
        n_layers: 4,
        ..micro_gpt()
    }
}

#[test]
fn ac_mode_parses_and_names_the_choices() {
    for n in AcMode::NAMES {
        assert_eq!(n.parse::<AcMode>().unwrap().name(), n);
    }
    let e = "some".parse::<AcMode>().unwrap_err().to_string();
    assert!(
        e.contains("\"some\"") && e.contains("none, full, selective"),
        "{e}"
    );
    assert!(!AcMode::None.checkpoints(1));
    assert!(AcMode::Full.checkpoints(0) && AcMode::Full.checkpoints(3));
    assert!(!AcMode::Selective.checkpoints(0) && AcMode::Selective.checkpoints(1));
}

#[test]
fn single_device_same_losses_and_gradients() {
    let cfg = cfg4();
    let none = run(&with_ac(&cfg, AcMode::None), Layout::Single, 4, 4);
    assert!(none.losses[3] < none.losses[0], "{:?}", none.losses);
    for ac in [AcMode::Full, AcMode::Selective] {
        let r = run(&with_ac(&cfg, ac), Layout::Single, 4, 4);
        assert_same_for_less(&format!("{ac}"), &r, &none);
    }
}

#[test]
fn tied_head_and_rmsnorm_swiglu() {
    // The tied head uses the token table at both ends (outside the blocks); SwiGLU adds fc3.
    let cfg = GptConfig {
        tied: true,
        swiglu: true,
        norm: candle_dtensor_models::NormKind::RmsNorm,
        ..micro_gpt()
    };
    let none = run(&with_ac(&cfg, AcMode::None), Layout::Single, 3, 4);
    let full = run(&with_ac(&cfg, AcMode::Full), Layout::Single, 3, 4);
    assert_same_for_less("full, tied swiglu rms", &full, &none);
}

#[test]
fn data_parallel_same_losses_and_gradients() {
    let cfg = cfg4();
    let none = run(&with_ac(&cfg, AcMode::None), Layout::Dp2, 3, 4);
    for ac in [AcMode::Full, AcMode::Selective] {
        let r = run(&with_ac(&cfg, ac), Layout::Dp2, 3, 4);
        assert_same_for_less(&format!("dp=2 {ac}"), &r, &none);
    }
}

#[test]
fn tensor_parallel_same_losses_and_gradients() {
    let cfg = cfg4();
    for sp in [false, true] {
        let none = run(&with_ac(&cfg, AcMode::None), Layout::Tp2 { sp }, 3, 4);
        for ac in [AcMode::Full, AcMode::Selective] {
            let r = run(&with_ac(&cfg, ac), Layout::Tp2 { sp }, 3, 4);
            assert_same_for_less(&format!("tp=2 sp={sp} {ac}"), &r, &none);
        }
    }
}

#[test]
fn fsdp_same_losses_and_gradients() {
    let cfg = cfg4();
    let none = run(&with_ac(&cfg, AcMode::None), Layout::Fsdp2, 3, 4);
    for ac in [AcMode::Full, AcMode::Selective] {
        let r = run(&with_ac(&cfg, ac), Layout::Fsdp2, 3, 4);
        assert_same_for_less(&format!("fsdp dp=2 {ac}"), &r, &none);
    }
}

#[test]
// The measured bytes are printed for the record (`--nocapture`).
#[allow(clippy::print_stderr)]
fn full_keeps_at_most_a_third_on_small_at_512_tokens() {
    // The target: the small preset at 512 tokens, one sequence.
    let cfg = GptConfig {
        seq_len: 512,
        ..GptConfig::small()
    };
    let mut bytes = Vec::new();
    for ac in [AcMode::None, AcMode::Full, AcMode::Selective] {
        let r = run(&with_ac(&cfg, ac), Layout::Single, 1, 1);
        bytes.push((ac, r.bytes[0], r.losses[0]));
    }
    let (none, full, sel) = (bytes[0].1, bytes[1].1, bytes[2].1);
    eprintln!("graph bytes on small@512, batch 1: {bytes:?}");
    assert!(
        3 * full <= none,
        "full keeps {full} B, none {none} B: more than a third"
    );
    assert!(full < sel && sel < none, "{bytes:?}");
    for (ac, _, loss) in &bytes[1..] {
        assert_eq!(
            loss.to_bits(),
            bytes[0].2.to_bits(),
            "{ac}: loss {loss} vs {}",
            bytes[0].2
        );
    }
}

#[test]
fn training_run_reports_peak_activation_bytes() {
    // train's run (FSDP over dp=2, two micro-batches per step): the same losses with full
    // checkpointing, and the report's peak activation bytes drop.
    let run = |ac: AcMode| {
        let mut c = common::short_run(with_ac(&cfg4(), ac), TpPlan::new(), 3, 9);
        c.fsdp = Some(common::fsdp_over("dp", None));
        c.grad_accum = 2;
        common::train_on_mesh(&[("dp", 2)], &c, Duration::from_secs(120))
    };
    let none = run(AcMode::None);
    let full = run(AcMode::Full);
    common::assert_close(&full.losses, &none.losses, 1e-6, "full vs none losses");
    assert!(
        none.peak_activation_bytes > 0
            && 2 * full.peak_activation_bytes < none.peak_activation_bytes,
        "peak activation bytes: full {}, none {}",
        full.peak_activation_bytes,
        none.peak_activation_bytes
    );
}
