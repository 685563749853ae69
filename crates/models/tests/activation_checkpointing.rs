//! Activation checkpointing ([`AcMode`]): the same losses and gradients as without it, on one
//! device and under data parallelism, tensor parallelism and FSDP, for much less autograd-graph
//! memory.
// Checkpointed closures return the models' own `Result` (`checkpoint`'s contract), whose error
// is large.
#![allow(clippy::result_large_err)]
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
            // NaN-aware: a NaN difference is the worst, never dropped.
            let worst = g
                .iter()
                .zip(w)
                .map(|(a, b)| f64::from((a - b).abs()))
                .fold(0.0, candle_dtensor_kernels::compare::nan_max);
            assert!(
                worst <= 1e-5 * f64::from(scale),
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
    // The target: the small preset at 512 tokens, per rank: one sequence on one
    // device and under TP=2, two sequences (one per rank) under FSDP dp=2.
    let cfg = GptConfig {
        seq_len: 512,
        ..GptConfig::small()
    };
    for (layout, rows) in [
        (Layout::Single, 1),
        (Layout::Tp2 { sp: false }, 1),
        (Layout::Fsdp2, 2),
    ] {
        let mut bytes = Vec::new();
        for ac in [AcMode::None, AcMode::Full, AcMode::Selective] {
            let r = run(&with_ac(&cfg, ac), layout, 1, rows);
            bytes.push((ac, r.bytes[0], r.losses[0]));
        }
        let (none, full, sel) = (bytes[0].1, bytes[1].1, bytes[2].1);
        eprintln!("graph bytes per rank on small@512, {layout:?}: {bytes:?}");
        assert!(
            3 * full <= none,
            "{layout:?}: full keeps {full} B, none {none} B: more than a third"
        );
        assert!(full < sel && sel < none, "{layout:?}: {bytes:?}");
        for (ac, _, loss) in &bytes[1..] {
            assert_eq!(
                loss.to_bits(),
                bytes[0].2.to_bits(),
                "{layout:?} {ac}: loss {loss} vs {}",
                bytes[0].2
            );
        }
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

/// Pipeline stage `s` of 2 over the micro GPT's blocks (stage 0: blocks 0-1 on the
/// micro-batch's embeddings-shaped input; stage 1: blocks 2-3, then the mean square of the
/// output as the loss), each block checkpointed or not.
struct BlockStage {
    stage: usize,
    m: usize,
    gpt: Gpt,
    vars: Vec<candle_core::Var>,
    mesh: DeviceMesh,
    ac: bool,
    saved: std::collections::HashMap<usize, (Option<candle_core::Var>, Tensor)>,
    grads: Vec<Option<Tensor>>,
}

impl BlockStage {
    fn input(&self, mb: usize) -> candle_core::Result<Tensor> {
        let d = self.gpt.cfg.d_model;
        let t = self.gpt.cfg.seq_len;
        let n = 2 * t * d;
        let v: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + mb * 104_729 + 13) % 1000) as f32) / 1000.0 - 0.5)
            .collect();
        Tensor::from_vec(v, (2, t, d), &candle_core::Device::Cpu)
    }
}

impl candle_dtensor_parallel::pipeline::Stage for BlockStage {
    fn forward(
        &mut self,
        _chunk: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Tensor, candle_dtensor_parallel::pipeline::StageError> {
        let (h, var) = match input {
            None => (self.input(mb)?, None),
            Some(t) => {
                let v = candle_core::Var::from_tensor(&t)?;
                (v.as_tensor().clone(), Some(v))
            }
        };
        let mut x = candle_dtensor_core::DTensor::from_local_with_shape(
            &h,
            &self.mesh,
            &[Placement::Replicate],
            h.dims(),
        )?;
        for i in 2 * self.stage..2 * self.stage + 2 {
            let blk = &self.gpt.blocks[i];
            x = if self.ac {
                let mlp = blk.mlp.dense().ok_or("a dense block")?.clone();
                let b = candle_dtensor_models::layers::Block {
                    ln1: blk.ln1.clone(),
                    attn: blk.attn.clone(),
                    ln2: blk.ln2.clone(),
                    mlp: candle_dtensor_models::layers::FeedForward::Dense(mlp),
                };
                candle_dtensor_models::checkpoint(&x, None, move |x| b.forward(x))?
            } else {
                blk.forward(&x)?
            };
        }
        let out = x.to_local().clone();
        let out = if self.stage == 1 {
            (out.sqr()?.mean_all()? / self.m as f64)?
        } else {
            out
        };
        self.saved.insert(mb, (var, out.clone()));
        Ok(out)
    }

    fn backward(
        &mut self,
        _chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, candle_dtensor_parallel::pipeline::StageError> {
        let (var, out) = self.saved.remove(&mb).ok_or("backward before forward")?;
        let grads = match grad_out {
            None => out.backward()?,
            Some(g) => (out * g)?.sum_all()?.backward()?,
        };
        for (slot, v) in self.grads.iter_mut().zip(&self.vars) {
            if let Some(g) = grads.get(v) {
                *slot = Some(match slot.take() {
                    Some(a) => (a + g)?,
                    None => g.clone(),
                });
            }
        }
        Ok(var.and_then(|v| grads.get(v.as_tensor()).cloned()))
    }

    fn input_shape(
        &self,
        _chunk: usize,
        _mb: usize,
    ) -> Result<(candle_core::Shape, DType), candle_dtensor_parallel::pipeline::StageError> {
        let c = &self.gpt.cfg;
        Ok(((2, c.seq_len, c.d_model).into(), DType::F32))
    }

    fn output_shape(
        &self,
        chunk: usize,
        mb: usize,
    ) -> Result<(candle_core::Shape, DType), candle_dtensor_parallel::pipeline::StageError> {
        self.input_shape(chunk, mb)
    }
}

/// Losses (on the last stage) and every block parameter's gradient of a 2-stage GPipe run of
/// `m` micro-batches; per rank.
fn pipeline(ac: bool, m: usize) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    use candle_dtensor_parallel::pipeline::{run_schedule, PipeComms, Schedule};
    let cfg = cfg4();
    LocalWorld::new(2)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> R<_> {
            let comms = PipeComms::new(&comm)?;
            // Each stage's blocks on a mesh of its own rank (pp=2 x dp=1).
            let mesh = DeviceMesh::new(comm, &[("pp", 2), ("dp", 1)])?.dim("dp")?;
            let (gpt, store) = Gpt::new(&cfg, &mesh, &TpPlan::new(), 7, DType::F32)?;
            let vars = store.vars();
            let mut s = BlockStage {
                stage: comms.rank(),
                m,
                gpt,
                grads: vec![None; vars.len()],
                vars,
                mesh,
                ac,
                saved: Default::default(),
            };
            let report = run_schedule(&mut s, &Schedule::gpipe(2, m)?, &comms)?;
            let grads = s
                .grads
                .iter()
                .flatten()
                .map(|g| g.flatten_all()?.to_vec1::<f32>())
                .collect::<Result<Vec<_>, _>>()?;
            assert!(!grads.is_empty());
            let losses = report
                .losses
                .iter()
                .map(|(_, l)| l.to_scalar::<f32>())
                .collect::<Result<Vec<_>, _>>()?;
            Ok((losses, grads))
        })
        .unwrap()
}

#[test]
fn checkpointed_blocks_inside_pipeline_stages() {
    let none = pipeline(false, 3);
    let full = pipeline(true, 3);
    for (rank, ((ln, gn), (lf, gf))) in none.iter().zip(&full).enumerate() {
        common::assert_close(lf, ln, 1e-6, &format!("rank {rank}: losses"));
        let want = Run {
            grads: vec![gn.clone()],
            losses: ln.clone(),
            ..Run::default()
        };
        let got = Run {
            grads: vec![gf.clone()],
            losses: lf.clone(),
            ..Run::default()
        };
        assert_same(&format!("pipeline rank {rank}"), &got, &want);
    }
}

#[test]
fn mixture_of_experts_blocks_run_unchecked_and_selective_counts_dense_blocks() {
    // Blocks 1 and 3 are mixture-of-experts blocks (never checkpointed); selective checkpoints
    // every other DENSE block, here block 2, so it still saves something.
    let mut moe = candle_dtensor_parallel::moe::MoeConfig::new(4, 2);
    moe.every = 2;
    let cfg = GptConfig {
        moe: Some(moe),
        ..cfg4()
    };
    let none = run(&with_ac(&cfg, AcMode::None), Layout::Dp2, 3, 4);
    for ac in [AcMode::Full, AcMode::Selective] {
        let r = run(&with_ac(&cfg, ac), Layout::Dp2, 3, 4);
        assert_same_for_less(&format!("moe dp=2 {ac}"), &r, &none);
    }
}

#[test]
fn a_recompute_that_disagrees_with_forward_is_a_typed_error() {
    // A function whose output shape changes between forward and the recompute.
    let out = LocalWorld::new(1)
        .launch(|comm| -> R<String> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            let w = candle_core::Var::ones(4, DType::F32, &candle_core::Device::Cpu)?;
            let x = candle_dtensor_core::DTensor::from_local_with_shape(
                w.as_tensor(),
                &mesh,
                &[Placement::Replicate],
                &[4],
            )?;
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let y = candle_dtensor_models::checkpoint(&x, None, move |x| {
                let n = 4 - calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(x.narrow(0, 0, n.max(1))?.exp()?)
            })?;
            let e = y.to_local().sum_all()?.backward().unwrap_err();
            Ok(e.to_string())
        })
        .unwrap();
    assert!(
        out[0].contains("activation checkpointing") && out[0].contains("deterministic"),
        "{}",
        out[0]
    );
}

#[test]
fn fsdp_without_reshard_after_forward() {
    // Units kept gathered after forward (no pre-backward node): the recompute still finds the
    // full parameters, and FSDP's own nodes release them after it.
    let run = |ac: AcMode| {
        let mut c = common::short_run(with_ac(&cfg4(), ac), TpPlan::new(), 3, 9);
        let mut f = common::fsdp_over("dp", None);
        f.reshard_after_forward = false;
        c.fsdp = Some(f);
        common::train_on_mesh(&[("dp", 2)], &c, Duration::from_secs(120))
    };
    let none = run(AcMode::None);
    let full = run(AcMode::Full);
    common::assert_close(&full.losses, &none.losses, 1e-6, "full vs none losses");
    assert!(full.peak_activation_bytes < none.peak_activation_bytes);
}
