//! Attention alone, forward and forward + backward, at the shapes of a GPT preset: the kernels
//! `autodiff::sdpa_local` runs on this device (the flash-attention kernels on CUDA, on tensor
//! cores in bf16; on the CPU, candle's matmuls around the fused softmax for split heads and
//! the packed kernel of `fused::attention` for the `packed_*` cases), timed per call.
//! `scripts/gpu_bench.sh` runs it beside PyTorch's `scaled_dot_product_attention` on the same
//! shapes and GPU (issue 33: which part of a step falls short of PyTorch's, kernel by kernel).
//!
//! ```text
//! cargo run --release --example attn_bench -- --device cpu --shapes 1,2,128,64 --json
//! attn_bench --device cuda --json      # a GPU build (scripts/build_gpu.sh): the default shapes
//! ```
//!
//! A shape is `B,H,T,D` (batch, heads, sequence, head dim; queries and keys alike); the
//! default list is GPT-2 small's and medium's attention at batch 8 (12 and 16 heads of 64,
//! 1024 tokens) and a 128-wide head at 2048 tokens. Times are GPU time between CUDA timing
//! events around each call on CUDA (the device synchronized between calls, as the PyTorch
//! side does), wall time on the CPU; medians (p10, p90) over `--iters` after `--warmup`.
//! The forward + backward call is `sum(o * g)` differentiated (its extra elementwise product
//! and sum are O(B H T D), against the attention's O(B H T^2 D)). FLOPs as FlashAttention
//! counts them: 4 B H T^2 D for the forward (half of it under the causal mask), 2.5 times that
//! for the backward.
//!
//! Each shape is timed twice: on separate `q`, `k`, `v` `[B, H, T, D]` (the kernels alone), and
//! packed (`packed_*` keys), as a GPT layer runs it: `packed_sdpa_local` on the QKV
//! projection's `[B, T, H, 3, D]` with the output `[B, T, H, D]` (what the output projection
//! reads), so whatever the op spends besides the kernels (unpacking, transposes, copies) shows
//! as the difference.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use candle_core::{DType, Tensor, Var};
use candle_dtensor::kernels::autodiff::{packed_sdpa_local, sdpa_local};
use candle_dtensor::kernels::flash;
use candle_dtensor::train::device::DeviceSpec;
use clap::Parser;

#[path = "common/device_timing.rs"]
pub(crate) mod device_timing;
#[path = "common/logging.rs"]
mod logging;

use device_timing::{median, stats, time, Reps};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The default shapes: GPT-2 small and medium at batch 8, a 128-wide head at 2048 tokens.
pub(crate) const DEFAULT_SHAPES: &str = "8,12,1024,64;8,16,1024,64;4,8,2048,128";

#[derive(Parser, Debug, Clone)]
#[command(about = "Attention alone, forward and backward, timed per call")]
pub(crate) struct Args {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// `B,H,T,D` shapes separated by `;`.
    #[arg(long, default_value = DEFAULT_SHAPES)]
    pub(crate) shapes: String,
    /// bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub(crate) dtype: String,
    /// Attention over every key (the default is causal).
    #[arg(long)]
    pub(crate) no_causal: bool,
    #[command(flatten)]
    pub(crate) reps: Reps,
    /// Print one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `B,H,T,D;...` as `[b, h, t, d]` each (every dimension at least 1).
pub(crate) fn parse_shapes(text: &str) -> R<Vec<[usize; 4]>> {
    text.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let v = s
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("shape `{s}`: {e}"))?;
            match v.as_slice() {
                &[b, h, t, d] if b * h * t * d > 0 => Ok([b, h, t, d]),
                _ => Err(format!("shape `{s}`: four positive dimensions B,H,T,D").into()),
            }
        })
        .collect()
}

/// FlashAttention's forward FLOPs of one call: 4 B H T^2 D, halved under the causal mask.
pub(crate) fn forward_flops([b, h, t, d]: [usize; 4], causal: bool) -> f64 {
    let full = 4.0 * (b * h) as f64 * (t as f64) * (t as f64) * d as f64;
    if causal {
        full / 2.0
    } else {
        full
    }
}

pub(crate) fn run(args: &Args) -> R<serde_json::Value> {
    args.reps.check()?;
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => return Err(format!("--dtype {other}: bf16 or f32").into()),
    };
    let shapes = parse_shapes(&args.shapes)?;
    if shapes.is_empty() {
        return Err("--shapes names no shape".into());
    }
    let spec: DeviceSpec = args.device.parse()?;
    let dev = spec.device_for(0)?;
    let causal = !args.no_causal;
    let mut cases = Vec::new();
    let mut kernels = Vec::new();
    for shape in shapes {
        let [b, h, t, d] = shape;
        let x = |std: f32| -> R<Tensor> {
            Ok(Tensor::randn(0f32, std, (b, h, t, d), &dev)?.to_dtype(dtype)?)
        };
        let (q, k, v) = (
            Var::from_tensor(&x(1.0)?)?,
            Var::from_tensor(&x(1.0)?)?,
            Var::from_tensor(&x(1.0)?)?,
        );
        let g = x(1.0)?;
        let scale = 1.0 / (d as f64).sqrt();
        kernels.push(flash::kernels_for(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
        ));
        let fwd = time(&dev, args.reps, || {
            sdpa_local(q.as_tensor(), k.as_tensor(), v.as_tensor(), causal, scale)?;
            Ok(())
        })?;
        let fwd_bwd = time(&dev, args.reps, || {
            let o = sdpa_local(q.as_tensor(), k.as_tensor(), v.as_tensor(), causal, scale)?;
            (o * &g)?.sum_all()?.backward()?;
            Ok(())
        })?;
        // Packed: the QKV projection's layout in, the merged heads out.
        let qkv =
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, h, 3, d), &dev)?.to_dtype(dtype)?)?;
        let g_packed = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?.to_dtype(dtype)?;
        let packed_fwd = time(&dev, args.reps, || {
            packed_sdpa_local(qkv.as_tensor(), causal, scale)?;
            Ok(())
        })?;
        let packed_fwd_bwd = time(&dev, args.reps, || {
            let o = packed_sdpa_local(qkv.as_tensor(), causal, scale)?;
            (o * &g_packed)?.sum_all()?.backward()?;
            Ok(())
        })?;
        let flops = forward_flops(shape, causal);
        let tflops = |ms: f64, f: f64| f / (ms / 1e3) / 1e12;
        cases.push(serde_json::json!({
            "b": b, "h": h, "t": t, "d": d,
            "forward_ms": stats(&fwd),
            "forward_backward_ms": stats(&fwd_bwd),
            "forward_tflops": tflops(median(&fwd), flops),
            "forward_backward_tflops": tflops(median(&fwd_bwd), 3.5 * flops),
            "packed_forward_ms": stats(&packed_fwd),
            "packed_forward_backward_ms": stats(&packed_fwd_bwd),
        }));
    }
    kernels.dedup();
    // The packed cases: on the CPU (f32) the packed kernel of `fused::attention`, on CUDA the
    // flash kernels where they apply, as above.
    let packed_kernels = if dev.is_cpu() && dtype == DType::F32 {
        "cpu packed kernel".to_string()
    } else {
        kernels.join(", ")
    };
    Ok(serde_json::json!({
        "bench": "attention",
        "device": spec.to_string(),
        "timing": if dev.is_cuda() { "CUDA events (GPU time)" } else { "wall" },
        "dtype": args.dtype,
        "causal": causal,
        "kernels": kernels.join(", "),
        "packed_kernels": packed_kernels,
        "cases": cases,
    }))
}

#[allow(dead_code)]
fn main() {
    logging::init_logging();
    let args = Args::parse();
    match run(&args) {
        Ok(out) if args.json => println!("{out}"),
        Ok(out) => {
            println!(
                "attn_bench: {} {} causal {} on {} ({})",
                out["kernels"], args.dtype, out["causal"], out["device"], out["timing"]
            );
            for c in out["cases"].as_array().into_iter().flatten() {
                let f = |k: &str| c[k]["median"].as_f64().unwrap_or(f64::NAN);
                let t = |k: &str| c[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "  [{}, {}, {}, {}]: forward {:.3} ms ({:.1} TFLOP/s), forward + backward \
                     {:.3} ms ({:.1} TFLOP/s); packed: forward {:.3} ms, forward + backward \
                     {:.3} ms",
                    c["b"],
                    c["h"],
                    c["t"],
                    c["d"],
                    f("forward_ms"),
                    t("forward_tflops"),
                    f("forward_backward_ms"),
                    t("forward_backward_tflops"),
                    f("packed_forward_ms"),
                    f("packed_forward_backward_ms"),
                );
            }
        }
        Err(e) => {
            eprintln!("attn_bench: error: {e}");
            std::process::exit(2);
        }
    }
}
