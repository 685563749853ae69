//! Shared helpers of the models integration tests: the small GPT they train, a local world
//! that trains it on a mesh, and a relative comparison of loss lists.
#![allow(dead_code)]

use std::time::Duration;

use candle_core::{Device, Tensor};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_core::{distribute_tensor, DTensor};
use candle_dtensor_kernels::compare::compare_series_f32;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{Gpt, GptConfig};
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::data::Corpus;
use candle_dtensor_train::trainer::{train_rank, FsdpSpec, RankReport, TrainConfig};

pub type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A GPT small enough to train for a few steps in a test: vocab 64, width 32, 4 heads, 2
/// blocks, 16 positions.
pub fn micro_gpt() -> GptConfig {
    GptConfig {
        vocab: 64,
        d_model: 32,
        n_heads: 4,
        n_layers: 2,
        seq_len: 16,
        ..GptConfig::tiny()
    }
}

/// `steps` training steps of `g` under TP plan `plan`, on batches of 8 sequences from a
/// 4096-token corpus seeded with `seed`; the rest (optimizer, lr, sharding) as the test sets it.
pub fn short_run(g: GptConfig, plan: TpPlan, steps: usize, seed: u64) -> TrainConfig {
    let mut c = TrainConfig::new(g, plan);
    c.steps = steps;
    c.batch = 8;
    c.corpus_tokens = 4096;
    c.seed = seed;
    c
}

/// FSDP over mesh dim `shard` (HSDP when `replicate` names the dim to replicate over): one
/// fused reduce-scatter, parameters in their own dtype, resharded after each forward.
pub fn fsdp_over(shard: &str, replicate: Option<&str>) -> FsdpSpec {
    FsdpSpec {
        shard: shard.into(),
        replicate: replicate.map(Into::into),
        separate_rs: false,
        param_dtype: None,
        reshard_after_forward: true,
    }
}

/// Trains `c` on a local world shaped `dims` (every op bounded by `timeout`); rank 0's report.
pub fn train_on_mesh(dims: &[(&str, usize)], c: &TrainConfig, timeout: Duration) -> RankReport {
    let n: usize = dims.iter().map(|d| d.1).product();
    LocalWorld::new(n)
        .with_timeout(timeout)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, dims)?;
            Ok(train_rank(&mesh, c, |_| {})?)
        })
        .unwrap()
        .into_iter()
        .next()
        .unwrap()
}

/// Every `a[i]` within `tol` of `b[i]`, relative to `b[i]`.
pub fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    // Same length, every value finite (`|x - inf| <= tol * inf` held for any finite x), each
    // within `tol` relative.
    if let Err(e) = compare_series_f32(what, a, b).and_then(|d| d.within(f64::from(tol))) {
        panic!("{e} ({a:?} vs {b:?})");
    }
}

/// Step `step`'s batch of `rows` sequences of `seq` tokens from `corpus` (sampling seed
/// `seed`): inputs and next-token targets, placed on `mesh` as `gpt` takes them.
pub fn gpt_batch(
    corpus: &Corpus,
    step: usize,
    (rows, seq, seed): (usize, usize, u64),
    gpt: &Gpt,
    mesh: &DeviceMesh,
) -> R<(DTensor, DTensor)> {
    let (x, y) = corpus.batch(step as u64, rows, seq, seed);
    let x = Tensor::from_vec(x, (rows, seq), &Device::Cpu)?;
    let y = Tensor::from_vec(y, (rows, seq), &Device::Cpu)?;
    Ok((
        distribute_tensor(&x, mesh, &gpt.batch_placements())?,
        distribute_tensor(&y, mesh, &gpt.batch_placements())?,
    ))
}

/// A scratch directory for one test (named after the test binary, the test and the process),
/// emptied when made and removed at the end.
pub struct Scratch(pub std::path::PathBuf);

impl Scratch {
    /// A fresh directory for the test `name`.
    pub fn new(name: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!(
            "cdt-{}-{name}-{}",
            env!("CARGO_CRATE_NAME"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
