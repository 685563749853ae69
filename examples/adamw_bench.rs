//! The fused AdamW step (`kernels::multi_tensor::adamw_step`: one launch for every f32
//! parameter on CUDA) against its memory-bandwidth floor, with candle-nn's AdamW (nine tensor
//! ops and three copies per parameter) beside it, on one device and the parameter shapes of a
//! GPT preset (issue 33: "AdamW step within 2x of its memory-bandwidth floor").
//!
//! ```text
//! cargo run --release --example adamw_bench -- --device cpu --preset small --json
//! adamw_bench --device cuda --preset gpt2 --json        # a GPU build (scripts/build_gpu.sh)
//! ```
//!
//! The floor: an AdamW step reads the parameter, its gradient and both moments and writes the
//! parameter and both moments, 28 bytes per f32 element; a device copy of 3.5 elements per
//! parameter element into a buffer allocated once moves the same bytes (read plus write),
//! timed the same way, in the same run. `ratio` is the fused step's median over the copy's. Times are GPU time between CUDA
//! timing events around each call on CUDA (`kernels::profile::Mark`; the device synchronized
//! between calls), wall time on the CPU; medians (p10, p90) over `--iters` after `--warmup`.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use candle_core::{DType, Tensor, Var};
use candle_dtensor::kernels::multi_tensor::{adamw_step, AdamWStep};
use candle_dtensor::models::GptConfig;
use candle_dtensor::train::device::DeviceSpec;
use candle_nn::Optimizer;
use clap::Parser;

#[path = "common/device_timing.rs"]
pub(crate) mod device_timing;
#[path = "common/logging.rs"]
mod logging;

use device_timing::{median, stats, time, Reps};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
#[command(about = "The fused AdamW step against its memory-bandwidth floor")]
pub(crate) struct Args {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// The GPT preset whose parameter shapes are updated (tiny, small, gpt2, gpt2-medium).
    #[arg(long, default_value = "gpt2")]
    pub(crate) preset: String,
    #[command(flatten)]
    pub(crate) reps: Reps,
    /// Leave out candle-nn's AdamW (it needs as much memory again for its temporaries).
    #[arg(long)]
    pub(crate) no_candle_nn: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The parameter shapes of a dense GPT preset as `models::Gpt` holds them: token and
/// position embeddings, per block two norms (weight and bias), the fused QKV projection, the
/// attention output projection and the MLP's two linears (weights and biases), the final norm,
/// and an untied head's weight.
pub(crate) fn shapes(cfg: &GptConfig) -> Vec<Vec<usize>> {
    let (d, h) = (cfg.d_model, cfg.d_model * cfg.mlp_ratio);
    let mut s = vec![vec![cfg.vocab, d], vec![cfg.seq_len, d]];
    for _ in 0..cfg.n_layers {
        s.extend([
            vec![d],
            vec![d],
            vec![3 * d, d],
            vec![3 * d],
            vec![d, d],
            vec![d],
            vec![d],
            vec![d],
            vec![h, d],
            vec![h],
            vec![d, h],
            vec![d],
        ]);
    }
    s.extend([vec![d], vec![d]]);
    if !cfg.tied {
        s.push(vec![cfg.vocab, d]);
    }
    s
}

pub(crate) fn run(args: &Args) -> R<serde_json::Value> {
    args.reps.check()?;
    let spec: DeviceSpec = args.device.parse()?;
    let dev = spec.device_for(0)?;
    let cfg = GptConfig::preset(&args.preset)?;
    let shapes = shapes(&cfg);
    let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let vars = shapes
        .iter()
        .map(|s| {
            Ok(Var::from_tensor(
                &(Tensor::randn(0f32, 0.02, s.as_slice(), &dev)?),
            )?)
        })
        .collect::<R<Vec<Var>>>()?;
    let grads = shapes
        .iter()
        .map(|s| Ok((Tensor::randn(0f32, 1e-3, s.as_slice(), &dev)?).contiguous()?))
        .collect::<R<Vec<Tensor>>>()?;
    let zeros = || -> R<Vec<Tensor>> {
        shapes
            .iter()
            .map(|s| Ok(Tensor::zeros(s.as_slice(), DType::F32, &dev)?))
            .collect()
    };
    let (m, v) = (zeros()?, zeros()?);
    let params: Vec<Tensor> = vars.iter().map(|x| x.as_tensor().clone()).collect();
    // Matrices decay, vectors do not (train_gpt's default policy).
    let decay: Vec<bool> = shapes.iter().map(|s| s.len() >= 2).collect();
    let mut t = 0;
    let fused = time(&dev, args.reps, || {
        t += 1;
        let step = AdamWStep {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            t,
        };
        Ok(adamw_step(&params, &grads, &m, &v, &decay, &step, None)?)
    })?;
    drop((m, v));
    // The floor: the same bytes through a plain device copy (3.5 elements per parameter
    // element, read and written).
    let copy_elems = n * 7 / 2;
    let src = Tensor::zeros(copy_elems, DType::F32, &dev)?;
    let dst = Tensor::zeros(copy_elems, DType::F32, &dev)?;
    let copy = time(&dev, args.reps, || Ok(dst.slice_set(&src, 0, 0)?))?;
    drop((src, dst));
    let candle_nn_ms = if args.no_candle_nn {
        None
    } else {
        // candle-nn's optimizer takes a GradStore: the backward of sum(p * g) gives g.
        let mut loss = Tensor::zeros((), DType::F32, &dev)?;
        for (p, g) in vars.iter().zip(&grads) {
            loss = (loss + (p.as_tensor() * g)?.sum_all()?)?;
        }
        let store = loss.backward()?;
        let mut opt = candle_nn::AdamW::new(
            vars.clone(),
            candle_nn::ParamsAdamW {
                lr: 1e-4,
                weight_decay: 0.01,
                ..Default::default()
            },
        )?;
        Some(time(&dev, args.reps, || Ok(opt.step(&store)?))?)
    };
    let med = median;
    let bytes = 28.0 * n as f64;
    let out = serde_json::json!({
        "bench": "adamw",
        "device": spec.to_string(),
        "timing": if dev.is_cuda() { "CUDA events (GPU time)" } else { "wall" },
        "preset": args.preset,
        "params": n,
        "tensors": shapes.len(),
        "bytes_per_step": bytes,
        "fused_adamw_ms": stats(&fused),
        "copy_same_bytes_ms": stats(&copy),
        "ratio_to_floor": med(&fused) / med(&copy),
        "copy_gbps": bytes / (med(&copy) / 1e3) / 1e9,
        "fused_gbps": bytes / (med(&fused) / 1e3) / 1e9,
        "candle_nn_adamw_ms": candle_nn_ms.as_deref().map(stats),
        "candle_nn_over_fused": candle_nn_ms.as_deref().map(|c| med(c) / med(&fused)),
    });
    Ok(out)
}

#[allow(dead_code)]
fn main() {
    logging::init_logging();
    let args = Args::parse();
    match run(&args) {
        Ok(out) if args.json => println!("{out}"),
        Ok(out) => {
            println!(
                "adamw_bench: {} on {}: {} parameters in {} tensors",
                args.preset, out["device"], out["params"], out["tensors"]
            );
            println!(
                "  fused AdamW {:.3} ms, copy of the same bytes {:.3} ms: {:.2}x the floor \
                 ({:.0} GB/s copy, {:.0} GB/s AdamW)",
                out["fused_adamw_ms"]["median"].as_f64().unwrap_or(f64::NAN),
                out["copy_same_bytes_ms"]["median"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
                out["ratio_to_floor"].as_f64().unwrap_or(f64::NAN),
                out["copy_gbps"].as_f64().unwrap_or(f64::NAN),
                out["fused_gbps"].as_f64().unwrap_or(f64::NAN),
            );
            if let Some(c) = out["candle_nn_adamw_ms"]["median"].as_f64() {
                println!("  candle-nn AdamW {c:.3} ms");
            }
        }
        Err(e) => {
            eprintln!("adamw_bench: error: {e}");
            std::process::exit(2);
        }
    }
}
