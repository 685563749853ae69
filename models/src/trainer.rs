//! The training loop shared by the `train_gpt` example and the tests: one rank's side of
//! training a [`Gpt`] on the synthetic corpus with candle-nn's AdamW.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{distribute_tensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use candle_nn::Optimizer;

use crate::data::Corpus;
use crate::error::Result;
use crate::gpt::{Gpt, GptConfig};
use crate::plan::TpPlan;
use crate::train::clip_grad_norm;

/// What to train.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model.
    pub gpt: GptConfig,
    /// The tensor-parallel plan.
    pub plan: TpPlan,
    /// Global batch size (sequences per step).
    pub batch: usize,
    /// Steps to run.
    pub steps: usize,
    /// Seed of the parameters and the data.
    pub seed: u64,
    /// AdamW learning rate.
    pub lr: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value.
    pub clip: Option<f64>,
    /// Tokens in the synthetic corpus.
    pub corpus_tokens: usize,
}

impl TrainConfig {
    /// The defaults of a preset: batch 8, AdamW lr 1e-3, weight decay 0.01, no clipping.
    pub fn new(gpt: GptConfig, plan: TpPlan) -> Self {
        TrainConfig {
            gpt,
            plan,
            batch: 8,
            steps: 100,
            seed: 0,
            lr: 1e-3,
            weight_decay: 0.01,
            clip: None,
            corpus_tokens: 1 << 18,
        }
    }
}

/// One finished step, as reported to the progress callback.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    /// 0-based step index.
    pub step: usize,
    /// The global mean loss of the step.
    pub loss: f32,
    /// Wall time of the step (ms).
    pub step_ms: f64,
    /// Global tokens per step.
    pub tokens: usize,
}

/// What one rank saw.
#[derive(Debug, Clone, Default)]
pub struct RankReport {
    /// Global mean loss per step.
    pub losses: Vec<f32>,
    /// Wall time per step (ms).
    pub step_ms: Vec<f64>,
    /// Collectives issued in the last step by (kind, phase) -> count.
    pub collectives: BTreeMap<String, BTreeMap<String, usize>>,
    /// Bytes of this rank's parameter pieces.
    pub param_bytes: usize,
    /// Global parameter count.
    pub params: usize,
}

/// Trains on `mesh` (every rank of the mesh calls this) and reports per-step losses.
/// `on_step` runs after every step on this rank.
pub fn train_rank(
    mesh: &DeviceMesh,
    cfg: &TrainConfig,
    mut on_step: impl FnMut(&StepInfo),
) -> Result<RankReport> {
    let (gpt, store) = Gpt::new(&cfg.gpt, mesh, &cfg.plan, cfg.seed, DType::F32)?;
    let corpus = Corpus::synthetic(cfg.gpt.vocab, cfg.corpus_tokens, cfg.seed ^ 0xC0FFEE);
    let mut opt = candle_nn::AdamW::new(
        store.vars(),
        candle_nn::ParamsAdamW {
            lr: cfg.lr,
            weight_decay: cfg.weight_decay,
            ..Default::default()
        },
    )?;
    let placements = gpt.batch_placements();
    let all_r = vec![Placement::Replicate; mesh.ndim()];
    let t = cfg.gpt.seq_len;
    let mut report = RankReport {
        param_bytes: store.local_bytes(),
        params: store.global_numel(),
        ..RankReport::default()
    };
    for step in 0..cfg.steps {
        let t0 = Instant::now();
        let (x, y) = corpus.batch(step as u64, cfg.batch, t, cfg.seed);
        let x = Tensor::from_vec(x, (cfg.batch, t), &Device::Cpu)?;
        let y = Tensor::from_vec(y, (cfg.batch, t), &Device::Cpu)?;
        let x = distribute_tensor(&x, mesh, &placements)?;
        let y = distribute_tensor(&y, mesh, &placements)?;
        let last = step + 1 == cfg.steps;
        let mode = last.then(CommDebugMode::start);
        let loss = gpt.loss(&x, &y)?.redistribute(&all_r)?;
        let mut grads = loss.backward()?;
        if let Some(c) = cfg.clip {
            clip_grad_norm(&store, &mut grads, c)?;
        }
        opt.step(&grads)?;
        let value = loss.to_local().to_scalar::<f32>()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if let Some(mode) = mode {
            for ((phase, kind), n) in mode.counts() {
                let phase = match phase {
                    Phase::Forward => "forward",
                    Phase::Backward => "backward",
                };
                *report
                    .collectives
                    .entry(kind.to_string())
                    .or_default()
                    .entry(phase.to_string())
                    .or_insert(0) += n;
            }
        }
        report.losses.push(value);
        report.step_ms.push(ms);
        on_step(&StepInfo {
            step,
            loss: value,
            step_ms: ms,
            tokens: cfg.batch * t,
        });
    }
    Ok(report)
}
