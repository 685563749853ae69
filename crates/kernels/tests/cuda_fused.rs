//! The fused CUDA kernels against the CPU reference compositions, forward and backward, on a
//! GPU: every kernel of `crates/kernels/cuda/` (GELU, softmax, scaled-causal softmax,
//! log-softmax, layer norm with and without bias, RMS norm, softmax cross-entropy with and
//! without an ignore index, attention through the fused softmax), f32 and bf16, rows of 1, 31, 33, 1000 and 4097 elements (and the
//! GPT-2 vocabulary for the cross-entropy), empty tensors, plus the bad inputs: an f16 tensor
//! (typed error), a strided view (made contiguous), an out-of-range class id (NaN, not a
//! number). The weight/bias gradient reduction is checked to be bitwise repeatable. The
//! multi-tensor kernels: the global gradient norm and clip coefficient against the CPU's, and
//! the AdamW step bitwise equal to the CPU's over three steps with clipping.
//!
//! Inputs are made on the CPU in f32, rounded to the dtype under test, and given to both
//! sides: the CUDA fused path in that dtype, the CPU reference (`autodiff::reference`, candle
//! primitives) in f32 on the rounded values. Tolerances: `max |a - b| / max |b|` below 2e-5
//! (f32) and 2e-2 (bf16, whose outputs are rounded to 8 bits of mantissa; 4e-2 for attention,
//! whose bf16 GEMMs round the scores).
//!
//! One test walks all cases and reports every mismatch, then fails if any; without a CUDA
//! device it prints that it skipped and passes. scripts/gpu_check.sh runs the binary
//! (`--nocapture`) and passes the step only on the summary line, which a skip never prints:
//!
//!   cuda_fused: <n> checks passed on <device>
#![cfg(feature = "cuda")]
// The per-case lines and the summary are this test's output (gpu_check.sh greps them).
#![allow(clippy::print_stdout, clippy::print_stderr)]

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_kernels::autodiff::{self, reference};
use candle_dtensor_kernels::compare::max_rel_diff;
use candle_dtensor_kernels::{fused, multi_tensor};

type R<T> = candle_core::Result<T>;
type Op<'a> = &'a dyn Fn(&[Tensor]) -> R<Tensor>;

/// Row lengths of the row kernels: one, below a warp, just past one, a few blocks' worth, and
/// past a 1024-thread block by one.
const ROWS: [usize; 5] = [1, 31, 33, 1000, 4097];

fn cuda_device() -> Option<Device> {
    match std::panic::catch_unwind(|| Device::new_cuda(0)) {
        Ok(Ok(d)) => {
            // As train_gpt opens its devices (`DeviceSpec::device_for`): every case below runs
            // on buffers without cudarc's events.
            // SAFETY: a fresh device; no test here makes a second cudarc stream on its context.
            if !unsafe { candle_dtensor_kernels::storage::skip_unused_buffer_events(&d) } {
                panic!("cuda_fused: a fresh CUDA device kept cudarc's buffer events");
            }
            Some(d)
        }
        Ok(Err(e)) => {
            println!("cuda_fused: SKIPPED, no CUDA device: {e}");
            None
        }
        Err(_) => {
            println!("cuda_fused: SKIPPED, the CUDA driver bindings panicked (no driver?)");
            None
        }
    }
}

/// Deterministic pseudo-normal f32 values of `shape` (no RNG state shared between cases).
fn values(shape: &[usize], scale: f32, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            // Sum of 4 uniforms, centred: close enough to normal for test inputs.
            let mut acc = 0f32;
            for _ in 0..4 {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                acc += (s >> 40) as f32 / (1u64 << 24) as f32;
            }
            (acc - 2.0) * 1.7 * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        2e-2
    } else {
        2e-5
    }
}

/// Runs `f` forward and backward (upstream gradient `seed`) on fresh vars of `inputs`; the
/// output and the input gradients, as f32 on the CPU.
fn run(inputs: &[Tensor], f: Op, seed: &Tensor) -> R<(Tensor, Vec<Tensor>)> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<R<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let grads = y.mul(&seed.to_dtype(y.dtype())?)?.sum_all()?.backward()?;
    let host = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);
    let gs = vars
        .iter()
        .map(|v| {
            grads
                .get(v)
                .ok_or_else(|| candle_core::Error::msg("an input got no gradient"))
                .and_then(host)
        })
        .collect::<R<Vec<_>>>()?;
    Ok((host(&y)?, gs))
}

/// The outcome of all cases.
#[derive(Default)]
struct Report {
    passed: usize,
    failures: Vec<String>,
}

impl Report {
    fn record(&mut self, name: &str, outcome: R<String>) {
        match outcome {
            Ok(detail) => {
                self.passed += 1;
                println!("ok   {name}: {detail}");
            }
            Err(e) => {
                println!("FAIL {name}: {e}");
                self.failures.push(format!("{name}: {e}"));
            }
        }
    }
}

/// `fast` on `dev` in `dtype` against `slow` on the CPU in f32, forward and backward, on the
/// same (rounded) inputs and upstream gradient, within the dtype's tolerance.
fn compare(dev: &Device, dtype: DType, inputs: &[Tensor], fast: Op, slow: Op) -> R<String> {
    compare_within(dev, dtype, inputs, fast, slow, tol(dtype))
}

/// [`compare`] within `limit` (max |a - b| / max |b|, per output and per gradient).
fn compare_within(
    dev: &Device,
    dtype: DType,
    inputs: &[Tensor],
    fast: Op,
    slow: Op,
    limit: f64,
) -> R<String> {
    let rounded: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(dtype)?.to_dtype(DType::F32))
        .collect::<R<_>>()?;
    let y_ref = slow(&rounded)?;
    let seed = values(y_ref.dims(), 1.0, 99)
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?;
    let (yb, gb) = run(&rounded, slow, &seed)?;
    let on_dev: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(dtype)?.to_device(dev))
        .collect::<R<_>>()?;
    let (ya, ga) = run(&on_dev, fast, &seed.to_device(dev)?)?;
    let mut worst = max_rel_diff(&ya, &yb)?;
    let check = |what: &str, d: f64| -> R<()> {
        // NaN fails (the comparison is false).
        if d <= limit {
            Ok(())
        } else {
            Err(candle_core::Error::msg(format!(
                "{what}: max rel diff {d:e} > {limit:e}"
            )))
        }
    };
    check("forward", worst)?;
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        let d = max_rel_diff(a, b)?;
        check(&format!("grad {i}"), d)?;
        worst = worst.max(d);
    }
    Ok(format!("max rel diff {worst:.2e}"))
}

/// An empty input: the fused path gives an empty output and empty gradients of the right shapes.
/// On a driver that refuses zero-byte allocations candle cannot make an empty CUDA tensor at
/// all (its own zeros fail, before any kernel of ours): the case is then reported, not failed.
fn empty_case(dev: &Device, dtype: DType, inputs: &[Tensor], fast: Op) -> R<String> {
    if let Err(e) = Tensor::zeros((0, 1), dtype, dev) {
        return Ok(format!(
            "not run: candle cannot allocate an empty tensor on this device ({e})"
        ));
    }
    let on_dev: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(dtype)?.to_device(dev))
        .collect::<R<_>>()?;
    let y = fast(&on_dev)?;
    let seed = Tensor::zeros(y.dims(), DType::F32, &Device::Cpu)?;
    let (y, gs) = run(&on_dev, fast, &seed)?;
    for (g, t) in gs.iter().zip(inputs) {
        if g.dims() != t.dims() {
            candle_core::bail!("gradient of shape {:?} for {:?}", g.dims(), t.dims());
        }
    }
    Ok(format!("output {:?}", y.dims()))
}

fn causal_reference(x: &Tensor, scale: f64) -> R<Tensor> {
    let d = x.dims();
    let (t, s) = (d[d.len() - 2], d[d.len() - 1]);
    let mask: Vec<u8> = (0..t)
        .flat_map(|i| (0..s).map(move |j| u8::from(j + t > i + s)))
        .collect();
    let a = (x * scale)?;
    let mask = Tensor::from_vec(mask, (t, s), x.device())?.broadcast_as(a.shape())?;
    let ninf = Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(a.shape())?;
    reference::softmax(&mask.where_cond(&ninf, &a)?, d.len() - 1)
}

/// The reference per-row cross-entropy (`-log_softmax` gathered at the target, 0 where ignored).
fn ce_reference(x: &Tensor, ids: &[i64], ignore: Option<i64>) -> R<Tensor> {
    let idx: Vec<u32> = ids
        .iter()
        .map(|&t| if Some(t) == ignore { 0 } else { t as u32 })
        .collect();
    let keep: Vec<f32> = ids
        .iter()
        .map(|&t| f32::from(u8::from(Some(t) != ignore)))
        .collect();
    let n = ids.len();
    let idx = Tensor::from_vec(idx, (n, 1), x.device())?;
    let keep = Tensor::from_vec(keep, n, x.device())?;
    reference::log_softmax(x, 1)?
        .gather(&idx, 1)?
        .squeeze(1)?
        .neg()?
        .mul(&keep)
}

fn class_ids(n: usize, c: usize, ignore_every: Option<usize>) -> Vec<i64> {
    (0..n)
        .map(|i| match ignore_every {
            Some(k) if i % k == 1 => -1,
            _ => ((i * 2_654_435_761usize + 7) % c) as i64,
        })
        .collect()
}

fn row_kernels(dev: &Device, dtype: DType, rep: &mut Report) {
    for n in ROWS {
        let x = values(&[3, n], 2.0, n as u64);
        let w = (values(&[n], 0.3, 7) + 1.0).unwrap();
        let b = values(&[n], 0.3, 8);
        let tag = format!("{dtype:?} [3, {n}]");
        rep.record(
            &format!("gelu {tag}"),
            compare(
                dev,
                dtype,
                std::slice::from_ref(&x),
                &|t| fused::gelu(&t[0]),
                &|t| reference::gelu(&t[0]),
            ),
        );
        rep.record(
            &format!("softmax {tag}"),
            compare(
                dev,
                dtype,
                std::slice::from_ref(&x),
                &|t| autodiff::softmax_local(&t[0], 1),
                &|t| reference::softmax(&t[0], 1),
            ),
        );
        rep.record(
            &format!("log_softmax {tag}"),
            compare(
                dev,
                dtype,
                std::slice::from_ref(&x),
                &|t| autodiff::log_softmax_local(&t[0], 1),
                &|t| reference::log_softmax(&t[0], 1),
            ),
        );
        rep.record(
            &format!("layer_norm {tag}"),
            compare(
                dev,
                dtype,
                &[x.clone(), w.clone(), b.clone()],
                &|t| autodiff::layer_norm_local(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
                &|t| reference::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
            ),
        );
        rep.record(
            &format!("layer_norm (no bias) {tag}"),
            compare(
                dev,
                dtype,
                &[x.clone(), w.clone()],
                &|t| autodiff::layer_norm_local(&t[0], Some(&t[1]), None, 1e-5),
                &|t| reference::layer_norm(&t[0], Some(&t[1]), None, 1e-5),
            ),
        );
        rep.record(
            &format!("rms_norm {tag}"),
            compare(
                dev,
                dtype,
                &[x.clone(), w.clone()],
                &|t| autodiff::rms_norm_local(&t[0], &t[1], 1e-6),
                &|t| reference::rms_norm(&t[0], &t[1], 1e-6),
            ),
        );
    }
    // Many rows of a model's width (more rows than one chunk of the weight-gradient reduction).
    let x = values(&[4, 300, 96], 1.5, 11);
    let w = (values(&[96], 0.3, 12) + 1.0).unwrap();
    let b = values(&[96], 0.3, 13);
    rep.record(
        &format!("layer_norm {dtype:?} [4, 300, 96]"),
        compare(
            dev,
            dtype,
            &[x.clone(), w.clone(), b],
            &|t| fused::layer_norm(&t[0], &t[1], Some(&t[2]), 1e-5),
            &|t| reference::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
        ),
    );
    rep.record(
        &format!("rms_norm {dtype:?} [4, 300, 96]"),
        compare(
            dev,
            dtype,
            &[x, w],
            &|t| fused::rms_norm(&t[0], &t[1], 1e-6),
            &|t| reference::rms_norm(&t[0], &t[1], 1e-6),
        ),
    );
    // Scaled causal softmax on [B, H, T, S], square and with S > T (the CPU kernel's mask).
    for (t, s) in [(5, 5), (3, 7), (33, 33), (4, 1000), (2, 4097)] {
        let x = values(&[2, 3, t, s], 3.0, (t * s) as u64);
        rep.record(
            &format!("scaled_causal_softmax {dtype:?} [2, 3, {t}, {s}]"),
            compare(
                dev,
                dtype,
                &[x],
                &|v| fused::scaled_causal_softmax(&v[0], 0.5, true),
                &|v| causal_reference(&v[0], 0.5),
            ),
        );
    }
    // Empty tensors: no launch, shapes kept, gradients of the inputs' shapes.
    let e = Tensor::zeros((0, 33), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::ones(33, DType::F32, &Device::Cpu).unwrap();
    rep.record(
        &format!("gelu {dtype:?} empty"),
        empty_case(dev, dtype, std::slice::from_ref(&e), &|t| {
            fused::gelu(&t[0])
        }),
    );
    rep.record(
        &format!("softmax {dtype:?} empty"),
        empty_case(dev, dtype, std::slice::from_ref(&e), &|t| {
            fused::softmax_last(&t[0])
        }),
    );
    rep.record(
        &format!("log_softmax {dtype:?} empty"),
        empty_case(dev, dtype, std::slice::from_ref(&e), &|t| {
            fused::log_softmax_last(&t[0])
        }),
    );
    rep.record(
        &format!("layer_norm {dtype:?} empty"),
        empty_case(dev, dtype, &[e.clone(), w.clone(), w.clone()], &|t| {
            fused::layer_norm(&t[0], &t[1], Some(&t[2]), 1e-5)
        }),
    );
    rep.record(
        &format!("rms_norm {dtype:?} empty"),
        empty_case(dev, dtype, &[e, w], &|t| {
            fused::rms_norm(&t[0], &t[1], 1e-6)
        }),
    );
}

fn cross_entropy(dev: &Device, dtype: DType, rep: &mut Report) {
    for (n, c) in [(3, 1), (5, 31), (4, 33), (7, 1000), (2, 4097), (3, 50304)] {
        for (ignore, every) in [(None, None), (Some(-1i64), Some(3))] {
            let ids = class_ids(n, c, every);
            let x = values(&[n, c], 3.0, (n * c) as u64);
            for tdt in [DType::U32, DType::I64] {
                if ignore.is_some() && tdt == DType::U32 {
                    continue; // -1 is not a u32
                }
                let t_cpu = Tensor::new(ids.as_slice(), &Device::Cpu)
                    .and_then(|t| t.to_dtype(tdt))
                    .unwrap();
                let t_dev = t_cpu.to_device(dev).unwrap();
                rep.record(
                    &format!("cross_entropy_rows {dtype:?} [{n}, {c}] {tdt:?} ignore {ignore:?}"),
                    compare(
                        dev,
                        dtype,
                        std::slice::from_ref(&x),
                        &|v| fused::cross_entropy_rows(&v[0], &t_dev, ignore),
                        &|v| ce_reference(&v[0], &ids, ignore),
                    ),
                );
            }
        }
    }
    // The mean (what the loss uses on CUDA): no host read, the mean of the rows.
    let (n, c) = (6, 257);
    let ids = class_ids(n, c, None);
    let x = values(&[n, c], 2.0, 5);
    let t_dev = Tensor::new(ids.as_slice(), dev).unwrap();
    rep.record(
        &format!("cross_entropy (mean) {dtype:?} [{n}, {c}]"),
        compare(
            dev,
            dtype,
            &[x],
            &|v| fused::cross_entropy(&v[0], &t_dev)?.reshape(1),
            &|v| ce_reference(&v[0], &ids, None)?.mean_all()?.reshape(1),
        ),
    );
    // Logits [B, T, C] as the GPT's head makes them (no reshape before the node): a rank's
    // share of the mean over 40 rows, against the rows' reference.
    let (b, t, c) = (2, 9, 1000);
    let ids = class_ids(b * t, c, None);
    let x = values(&[b, t, c], 2.0, 6);
    let t_dev = Tensor::from_vec(ids.clone(), (b, t), dev).unwrap();
    rep.record(
        &format!("cross_entropy_share {dtype:?} [{b}, {t}, {c}] of 40 rows"),
        compare(
            dev,
            dtype,
            &[x],
            &|v| fused::cross_entropy_share(&v[0], &t_dev, 40)?.reshape(1),
            &|v| {
                ce_reference(&v[0].reshape((b * t, c))?, &ids, None)?
                    .sum_all()?
                    .affine(1.0 / 40.0, 0.0)?
                    .reshape(1)
            },
        ),
    );
    // No rows.
    let e = Tensor::zeros((0, 9), DType::F32, &Device::Cpu).unwrap();
    rep.record(
        &format!("cross_entropy_rows {dtype:?} empty"),
        empty_case(dev, dtype, &[e], &|v| {
            fused::cross_entropy_rows(&v[0], &Tensor::zeros(0, DType::U32, v[0].device())?, None)
        }),
    );
}

fn f16_is_refused(dev: &Device, x: &Tensor) -> R<String> {
    let h = x.to_dtype(DType::F16)?.to_device(dev)?;
    match fused::softmax_last(&h) {
        Ok(_) => candle_core::bail!("an f16 softmax ran"),
        Err(e) => {
            let msg = e.to_string();
            if msg.contains("softmax") && msg.contains("F16") && msg.contains("[3, 40]") {
                Ok(msg)
            } else {
                candle_core::bail!("error does not name op, dtype and shape: {msg}")
            }
        }
    }
}

fn f16_falls_back(dev: &Device, x: &Tensor) -> R<String> {
    let h = x.to_dtype(DType::F16)?.to_device(dev)?;
    let a = autodiff::softmax_local(&h, 1)?;
    let b = reference::softmax(&h, 1)?;
    let d = max_rel_diff(&a, &b)?;
    if d == 0.0 {
        Ok("identical".into())
    } else {
        candle_core::bail!("differs by {d:e}")
    }
}

fn out_of_range_is_nan(dev: &Device, x: &Tensor) -> R<String> {
    let t = Tensor::new(&[0u32, 40, 2], dev)?;
    let loss = fused::cross_entropy_rows(&x.to_device(dev)?, &t, None)?;
    let v: Vec<f32> = loss.to_vec1()?;
    if v[1].is_nan() && v[0].is_finite() && v[2].is_finite() {
        Ok(format!("{v:?}"))
    } else {
        candle_core::bail!("losses {v:?}")
    }
}

/// candle 0.11.1 has no CUDA cast from i16 or i32: such ids are refused with a typed error
/// naming the op, dtype and shape (`storage::ids_as`), not left to fail inside the launch as a
/// missing kernel; u8 ids are cast and give the loss u32 ids give.
fn narrow_int_ids(dev: &Device, x: &Tensor) -> R<String> {
    let x = x.to_device(dev)?;
    let want: Vec<f32> =
        fused::cross_entropy_rows(&x, &Tensor::new(&[0u32, 7, 39], dev)?, None)?.to_vec1()?;
    let got: Vec<f32> =
        fused::cross_entropy_rows(&x, &Tensor::new(&[0u8, 7, 39], dev)?, None)?.to_vec1()?;
    if got != want {
        candle_core::bail!("u8 ids: {got:?}, u32 ids: {want:?}");
    }
    let mut msgs = Vec::new();
    for t in [
        Tensor::new(&[0i32, 7, 39], dev)?,
        Tensor::new(&[0i16, 7, 39], dev)?,
    ] {
        match fused::cross_entropy_rows(&x, &t, None) {
            Ok(_) => candle_core::bail!("{:?} ids ran", t.dtype()),
            Err(e) => {
                let msg = e.to_string();
                if !(msg.contains("cross_entropy")
                    && msg.contains(&format!("{:?}", t.dtype()))
                    && msg.contains("[3]"))
                {
                    candle_core::bail!("error does not name op, dtype and shape: {msg}");
                }
                msgs.push(msg);
            }
        }
    }
    Ok(msgs.join("; "))
}

fn norm_grads_repeat(dev: &Device) -> R<String> {
    let x = values(&[4096, 96], 1.0, 23).to_device(dev)?;
    let w = Var::from_tensor(&values(&[96], 1.0, 24).to_device(dev)?)?;
    let b = Var::from_tensor(&values(&[96], 1.0, 25).to_device(dev)?)?;
    let grads = || -> R<Vec<f32>> {
        let y = fused::layer_norm(&x, w.as_tensor(), Some(b.as_tensor()), 1e-5)?;
        let g = y.sqr()?.sum_all()?.backward()?;
        let missing = || candle_core::Error::msg("no gradient");
        let mut v: Vec<f32> = g.get(&w).ok_or_else(missing)?.to_vec1()?;
        v.extend(g.get(&b).ok_or_else(missing)?.to_vec1::<f32>()?);
        Ok(v)
    };
    let (first, second) = (grads()?, grads()?);
    if first
        .iter()
        .zip(&second)
        .all(|(p, q)| p.to_bits() == q.to_bits())
    {
        Ok("two runs, same bits".into())
    } else {
        candle_core::bail!("two runs differ")
    }
}

/// Bad input: a dtype without a kernel, a strided view, an out-of-range class id; and the
/// weight-gradient reduction's determinism.
fn bad_input(dev: &Device, rep: &mut Report) {
    let x = values(&[3, 40], 1.0, 21);
    rep.record(
        "f16 on CUDA: typed error naming op, dtype, shape",
        f16_is_refused(dev, &x),
    );
    rep.record(
        "f16 on CUDA: the autodiff ops fall back to the composition",
        f16_falls_back(dev, &x),
    );
    let xt = values(&[40, 3], 1.0, 22).t().unwrap();
    rep.record(
        "softmax f32 of a transposed view",
        compare(
            dev,
            DType::F32,
            &[xt],
            &|t| fused::softmax_last(&t[0]),
            &|t| reference::softmax(&t[0], 1),
        ),
    );
    rep.record(
        "cross_entropy_rows: an out-of-range id gives NaN on CUDA",
        out_of_range_is_nan(dev, &x),
    );
    rep.record(
        "i32 / i16 ids on CUDA: typed error naming op, dtype, shape; u8 ids cast",
        narrow_int_ids(dev, &x),
    );
    rep.record(
        "layer_norm backward is bitwise repeatable",
        norm_grads_repeat(dev),
    );
}

/// Attention on CUDA against the CPU composition, `[B, H, T, S]` with S >= T, causal and not:
/// candle's matmuls around the fused scaled causal softmax (head dims the flash kernels are
/// not built for), the flash-attention kernels (their head dims), and the packed form.
fn attention(dev: &Device, dtype: DType, rep: &mut Report) {
    // Attention's bf16 error is the GEMMs' (scores and output rounded to bf16), not the
    // softmax's: a looser bound there; f32 as the other kernels.
    let limit = if dtype == DType::BF16 { 4e-2 } else { 2e-5 };
    for (b, h, t, s, d) in [
        (2, 3, 5, 5, 8),
        (1, 2, 33, 33, 16),
        (2, 2, 3, 7, 8),
        (1, 1, 1, 1, 4),
    ] {
        for causal in [true, false] {
            let q = values(&[b, h, t, d], 0.5, 41);
            let k = values(&[b, h, s, d], 0.5, 42);
            let v = values(&[b, h, s, d], 1.0, 43);
            let scale = 1.0 / (d as f64).sqrt();
            rep.record(
                &format!("sdpa_local {dtype:?} [{b}, {h}, {t}/{s}, {d}] causal {causal}"),
                compare_within(
                    dev,
                    dtype,
                    &[q, k, v],
                    &|x| autodiff::sdpa_local(&x[0], &x[1], &x[2], causal, scale),
                    &|x| reference::sdpa(&x[0], &x[1], &x[2], causal, scale),
                    limit,
                ),
            );
        }
    }
    // Flash attention (head dims the kernels are built for): every one of them, several key
    // tiles, fewer queries than keys, a GPT-2-long sequence, several forward blocks, q and v one element into their
    // storage (the tensor-core kernels then read them element by element instead of 16 bytes
    // at a time); the node must really be the flash one (`flash::applies`), or the case fails
    // instead of testing the fallback.
    for (b, h, t, s, d, causal, offset) in [
        (1, 2, 70, 70, 64, true, false),
        (2, 1, 17, 75, 32, true, false),
        (1, 3, 40, 40, 48, true, false),
        (1, 1, 45, 45, 96, false, false),
        (1, 1, 64, 64, 128, true, false),
        (2, 3, 33, 100, 64, false, false),
        (1, 2, 1024, 1024, 64, true, false),
        // Several 128-query forward blocks whose first warps skip causal key tiles, with and
        // without the bottom-right shift of tq < tk.
        (1, 2, 300, 300, 128, true, false),
        (1, 1, 200, 333, 96, true, false),
        (1, 2, 70, 70, 64, true, true),
        (1, 1, 45, 50, 128, false, true),
    ] {
        let q = values(&[b, h, t, d], 0.5, 45);
        let k = values(&[b, h, s, d], 0.5, 46);
        let v = values(&[b, h, s, d], 1.0, 47);
        let scale = 1.0 / (d as f64).sqrt();
        let used = (|| -> R<bool> {
            let on = |x: &Tensor| x.to_dtype(dtype)?.to_device(dev);
            Ok(candle_dtensor_kernels::flash::applies(
                &on(&q)?,
                &on(&k)?,
                &on(&v)?,
            ))
        })();
        let outcome = match used {
            Ok(true) => compare_within(
                dev,
                dtype,
                &[q, k, v],
                &|x| {
                    let (q, v) = if offset {
                        (one_element_in(&x[0])?, one_element_in(&x[2])?)
                    } else {
                        (x[0].clone(), x[2].clone())
                    };
                    autodiff::sdpa_local(&q, &x[1], &v, causal, scale)
                },
                &|x| reference::sdpa(&x[0], &x[1], &x[2], causal, scale),
                limit,
            ),
            Ok(false) => Err(candle_core::Error::msg(
                "flash::applies is false (CDT_FLASH_ATTN=0?): the flash kernels were not tested",
            )),
            Err(e) => Err(e),
        };
        let at = if offset { " q, v at offset 1" } else { "" };
        rep.record(
            &format!("flash attention {dtype:?} [{b}, {h}, {t}/{s}, {d}] causal {causal}{at}"),
            outcome,
        );
    }
    // The packed form: head dim 8 (the fused softmax), and flash head dims, where it is one
    // node over the packed projection (`flash::packed_attention`), causal and not, several
    // forward blocks.
    for (shape, causal) in [
        ([2, 9, 3, 3, 8], true),
        ([2, 70, 3, 3, 64], true),
        ([1, 150, 2, 3, 32], false),
        ([1, 200, 2, 3, 128], true),
    ] {
        let qkv = values(&shape, 0.5, 44);
        let scale = 1.0 / (shape[4] as f64).sqrt();
        rep.record(
            &format!("packed_sdpa_local {dtype:?} {shape:?} causal {causal}"),
            compare_within(
                dev,
                dtype,
                &[qkv],
                &|x| autodiff::packed_sdpa_local(&x[0], causal, scale),
                &|x| reference::packed_sdpa(&x[0], causal, scale),
                limit,
            ),
        );
    }
    // The projection as the QKV linear makes it, [B, T, 3 H d] -> [B, T, H d]: the same node
    // without the reshapes (`flash::packed_attention_flat`), uneven T, several forward blocks.
    for (b, t, h, d) in [(2, 70, 3, 64), (1, 150, 2, 128)] {
        let qkv = values(&[b, t, 3 * h * d], 0.5, 46);
        let scale = 1.0 / (d as f64).sqrt();
        rep.record(
            &format!("packed_sdpa_local_flat {dtype:?} [{b}, {t}, 3 x {h} x {d}] causal"),
            compare_within(
                dev,
                dtype,
                &[qkv],
                &|x| {
                    if !candle_dtensor_kernels::flash::applies_flat(&x[0], h)
                        && x[0].device().is_cuda()
                    {
                        return Err(candle_core::Error::msg(
                            "flash::applies_flat is false: the flat node was not tested",
                        ));
                    }
                    autodiff::packed_sdpa_local_flat(&x[0], h, true, scale)
                },
                &|x| {
                    reference::packed_sdpa(&x[0].reshape((b, t, h, 3, d))?, true, scale)?.reshape((
                        b,
                        t,
                        h * d,
                    ))
                },
                limit,
            ),
        );
    }
    // A view of the projection (rows of another length than its T, at an offset): the kernels
    // read it in place (`FaRows` from its strides), without making it contiguous.
    let qkv = values(&[2, 40, 3, 3, 64], 0.5, 45);
    let view = |x: &Tensor| x.narrow(1, 3, 33);
    rep.record(
        &format!("packed_sdpa_local {dtype:?} on a view [2, 3..36 of 40, 3, 3, 64] causal"),
        compare_within(
            dev,
            dtype,
            &[qkv],
            &|x| autodiff::packed_sdpa_local(&view(&x[0])?, true, 0.125),
            &|x| reference::packed_sdpa(&view(&x[0])?, true, 0.125),
            limit,
        ),
    );
}

/// The mixed-precision linear (`region::linear_in`, bf16 GEMM, f32 in and out: on CUDA one
/// cuBLASLt matmul with the bias in its epilogue and f32 gradients written from bf16 operands,
/// or with `CDT_CUBLASLT=0` the product widened and the bias added by `cast.cu`) against the plain composition on the CPU, forward and backward,
/// with and without a bias, 2-D and 3-D inputs.
fn mixed_linear(dev: &Device, rep: &mut Report) {
    use candle_dtensor_kernels::region;
    for xs in [vec![5, 7], vec![2, 33, 70]] {
        let inner = xs[xs.len() - 1];
        for bias in [true, false] {
            let mut inputs = vec![values(&xs, 1.0, 71), values(&[40, inner], 0.5, 72)];
            if bias {
                inputs.push(values(&[40], 1.0, 73));
            }
            let outcome = compare_within(
                dev,
                DType::F32,
                &inputs,
                &|x| region::linear_in(&x[0], &x[1], x.get(2), DType::BF16),
                &|x| {
                    let y = x[0]
                        .to_dtype(DType::BF16)?
                        .broadcast_matmul(&x[1].to_dtype(DType::BF16)?.t()?)?
                        .to_dtype(DType::F32)?;
                    match x.get(2) {
                        Some(b) => y.broadcast_add(b),
                        None => Ok(y),
                    }
                },
                // One bf16 rounding of each product (2^-8 relative) on either side.
                2e-2,
            );
            rep.record(
                &format!("linear_in bf16 {xs:?} x [40, {inner}] bias {bias}"),
                outcome,
            );
            // bf16 activations (`region::linear_to`): a bf16 x into an f32 output, an f32 x
            // into a bf16 output (on CUDA the f32 bias in cuBLASLt's epilogue, and the bias
            // gradient in the weight gradient's; with `CDT_CUBLASLT=0` the product made on the
            // storages and the f32 bias added in place, `cast.cu`), a bf16 x into a bf16 output.
            for (x_dt, out) in [
                (DType::BF16, DType::F32),
                (DType::F32, DType::BF16),
                (DType::BF16, DType::BF16),
            ] {
                let outcome = compare_within(
                    dev,
                    DType::F32,
                    &inputs,
                    &|x| {
                        region::linear_to(&x[0].to_dtype(x_dt)?, &x[1], x.get(2), DType::BF16, out)?
                            .to_dtype(DType::F32)
                    },
                    &|x| {
                        let y = x[0]
                            .to_dtype(x_dt)?
                            .to_dtype(DType::BF16)?
                            .broadcast_matmul(&x[1].to_dtype(DType::BF16)?.t()?)?
                            .to_dtype(DType::F32)?;
                        let y = match x.get(2) {
                            Some(b) => y.broadcast_add(b)?,
                            None => y,
                        };
                        y.to_dtype(out)?.to_dtype(DType::F32)
                    },
                    2e-2,
                );
                rep.record(
                    &format!("linear_to x {x_dt:?} -> {out:?} {xs:?} x [40, {inner}] bias {bias}"),
                    outcome,
                );
            }
        }
    }
}

/// GPT-2-small-shaped linears (1024 tokens, width 768), where cuBLASLt picks the algorithms a
/// training step runs (the small cases above may get others): the QKV projection (f32 x into a
/// bf16 output, f32 bias: the bias epilogue, and the bias gradient in the weight gradient's),
/// the MLP's output linear (bf16 x into an f32 output: f32 written from bf16 operands) and an
/// f32 linear (the f32 policy: f32 bias epilogue and bias-gradient epilogue), forward and
/// backward against the CPU composition.
fn gpt2_linears(dev: &Device, rep: &mut Report) {
    use candle_dtensor_kernels::region;
    for (inner, out_n, x_dt, out) in [
        (768, 2304, DType::F32, DType::BF16),
        (3072, 768, DType::BF16, DType::F32),
    ] {
        let inputs = vec![
            values(&[1024, inner], 1.0, 101),
            values(&[out_n, inner], 0.02, 102),
            values(&[out_n], 0.1, 103),
        ];
        let outcome = compare_within(
            dev,
            DType::F32,
            &inputs,
            &|x| {
                region::linear_to(&x[0].to_dtype(x_dt)?, &x[1], Some(&x[2]), DType::BF16, out)?
                    .to_dtype(DType::F32)
            },
            &|x| {
                let y = x[0]
                    .to_dtype(x_dt)?
                    .to_dtype(DType::BF16)?
                    .matmul(&x[1].to_dtype(DType::BF16)?.t()?)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&x[2])?;
                y.to_dtype(out)?.to_dtype(DType::F32)
            },
            2e-2,
        );
        rep.record(
            &format!(
                "gpt2 linear_to x {x_dt:?} -> {out:?} [1024, {inner}] x [{out_n}, {inner}] bias"
            ),
            outcome,
        );
    }
    let inputs = vec![
        values(&[1024, 768], 1.0, 111),
        values(&[768, 768], 0.02, 112),
        values(&[768], 0.1, 113),
    ];
    let outcome = compare(
        dev,
        DType::F32,
        &inputs,
        &|x| region::linear(&x[0], &x[1], Some(&x[2])),
        &|x| x[0].matmul(&x[1].t()?)?.broadcast_add(&x[2]),
    );
    rep.record("gpt2 linear f32 [1024, 768] x [768, 768] bias", outcome);
}

/// The one-node linear (`region::linear`: on CUDA one cuBLASLt matmul with the bias in its
/// epilogue and the bias gradient in the weight gradient's, or with `CDT_CUBLASLT=0` the
/// product made on the storages and the bias added in place, `cast.cu`) in f32 and bf16 against candle's matmul and broadcast add on
/// the CPU, forward and backward, with and without a bias, 2-D and 3-D inputs, uneven widths.
fn plain_linear(dev: &Device, dtype: DType, rep: &mut Report) {
    use candle_dtensor_kernels::region;
    for xs in [vec![5, 7], vec![2, 33, 70], vec![1, 1]] {
        let inner = xs[xs.len() - 1];
        for bias in [true, false] {
            let mut inputs = vec![values(&xs, 1.0, 81), values(&[37, inner], 0.5, 82)];
            if bias {
                inputs.push(values(&[37], 1.0, 83));
            }
            let outcome = compare(
                dev,
                dtype,
                &inputs,
                &|x| region::linear(&x[0], &x[1], x.get(2)),
                &|x| {
                    let y = x[0].broadcast_matmul(&x[1].t()?)?;
                    match x.get(2) {
                        Some(b) => y.broadcast_add(b),
                        None => Ok(y),
                    }
                },
            );
            rep.record(
                &format!("linear {dtype:?} {xs:?} x [37, {inner}] bias {bias}"),
                outcome,
            );
        }
    }
}

/// A linear and its GELU as one node (`region::linear_gelu`: the GELU kernel writes the node's
/// storage from the linear's product, and the backward hands the GELU gradient to the linear's
/// GEMMs; `linear_gelu_to`: the bf16 GEMM, the pre-activation and the output in bf16, as the
/// MLP runs under a bf16 policy) against candle's matmul, bias add and GELU on the CPU, forward
/// and backward, with and without a bias, 2-D and 3-D inputs, uneven widths.
fn linear_gelu(dev: &Device, dtype: DType, rep: &mut Report) {
    use candle_dtensor_kernels::region;
    for xs in [vec![5, 7], vec![2, 33, 70]] {
        let inner = xs[xs.len() - 1];
        for bias in [true, false] {
            let mut inputs = vec![values(&xs, 1.0, 91), values(&[37, inner], 0.5, 92)];
            if bias {
                inputs.push(values(&[37], 1.0, 93));
            }
            let reference = |x: &[Tensor], gemm: DType, out: DType| -> R<Tensor> {
                let y = x[0]
                    .to_dtype(gemm)?
                    .broadcast_matmul(&x[1].to_dtype(gemm)?.t()?)?
                    .to_dtype(DType::F32)?;
                let y = match x.get(2) {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                };
                y.to_dtype(out)?.to_dtype(DType::F32)?.gelu()
            };
            let outcome = compare(
                dev,
                dtype,
                &inputs,
                &|x| region::linear_gelu(&x[0], &x[1], x.get(2)),
                &|x| reference(x, DType::F32, DType::F32),
            );
            rep.record(
                &format!("linear_gelu {dtype:?} {xs:?} x [37, {inner}] bias {bias}"),
                outcome,
            );
            if dtype == DType::F32 {
                let outcome = compare_within(
                    dev,
                    DType::F32,
                    &inputs,
                    &|x| {
                        region::linear_gelu_to(&x[0], &x[1], x.get(2), DType::BF16, DType::BF16)?
                            .to_dtype(DType::F32)
                    },
                    &|x| reference(x, DType::BF16, DType::BF16),
                    // bf16 roundings of the product, the pre-activation and the GELU.
                    3e-2,
                );
                rep.record(
                    &format!("linear_gelu_to bf16 {xs:?} x [37, {inner}] bias {bias}"),
                    outcome,
                );
            }
        }
    }
}

/// The bias-gradient column sum (`fused::row_sum`: on CUDA `reduce.cu`) against candle's sum
/// over the leading dim on the CPU: one row, a ragged chunk of rows, columns past one block.
fn column_sums(dev: &Device, dtype: DType, rep: &mut Report) {
    let limit = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
    for (shape, n) in [
        (vec![1, 5], 5),
        (vec![600, 33], 33),
        (vec![2, 300, 7], 7),
        (vec![3, 1100], 1100),
    ] {
        let outcome = (|| -> R<String> {
            let x = values(&shape, 1.0, 61).to_dtype(dtype)?;
            let want = x.to_dtype(DType::F32)?.reshape(((), n))?.sum(0)?;
            let got = fused::row_sum(&x.to_device(dev)?, n)?;
            let d = max_rel_diff(&got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?, &want)?;
            // NaN fails (the comparison is false).
            if d <= limit {
                Ok(format!("max rel diff {d:.2e}"))
            } else {
                Err(candle_core::Error::msg(format!(
                    "max rel diff {d:e} > {limit:e}"
                )))
            }
        })();
        rep.record(&format!("row_sum {dtype:?} {shape:?} over {n}"), outcome);
        // The f32 sums of bf16 rows (`row_sum_as`: a bf16 output gradient's f32 bias
        // gradient), which f32 partials keep to f32's precision.
        if dtype == DType::BF16 {
            let outcome = (|| -> R<String> {
                let x = values(&shape, 1.0, 62).to_dtype(DType::BF16)?;
                let want = x.to_dtype(DType::F32)?.reshape(((), n))?.sum(0)?;
                let got = fused::row_sum_as(&x.to_device(dev)?, n, DType::F32)?;
                if got.dtype() != DType::F32 {
                    candle_core::bail!("sums in {:?}, not f32", got.dtype());
                }
                let d = max_rel_diff(&got.to_device(&Device::Cpu)?, &want)?;
                if d <= 1e-5 {
                    Ok(format!("max rel diff {d:.2e}"))
                } else {
                    Err(candle_core::Error::msg(format!(
                        "max rel diff {d:e} > 1e-5"
                    )))
                }
            })();
            rep.record(
                &format!("row_sum_as bf16 -> f32 {shape:?} over {n}"),
                outcome,
            );
        }
    }
}

/// The embedding lookup (`fused::embedding`: on CUDA one node whose backward is the embedding
/// kernel) against candle's `index_select` on the CPU: repeated ids, a token repeated past one
/// shared-memory chunk of ids, head dims under and over one column pass, ids shaped `[B, T]`.
fn embedding(dev: &Device, dtype: DType, rep: &mut Report) {
    let limit = if dtype == DType::BF16 { 2e-2 } else { 2e-5 };
    for (vocab, d, shape) in [
        (50, 33, vec![7]),
        (37, 768, vec![4, 700]),
        (1000, 1100, vec![2, 9]),
    ] {
        let n: usize = shape.iter().product();
        // Every fifth id u32::MAX: a zero row, no gradient (a vocab-parallel lookup's ids
        // of other shards).
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| {
                if i % 5 == 4 {
                    u32::MAX
                } else {
                    (i * 7 + i / 13) % vocab as u32
                }
            })
            .collect();
        let outcome = (|| -> R<String> {
            let cpu_ids = Tensor::from_vec(ids.clone(), shape.as_slice(), &Device::Cpu)?;
            let dev_ids = cpu_ids.to_device(dev)?;
            compare_within(
                dev,
                dtype,
                &[values(&[vocab, d], 1.0, 51)],
                &|x| fused::embedding(&x[0], &dev_ids),
                &|x| {
                    let mut dims = shape.clone();
                    dims.push(d);
                    x[0].index_select(&cpu_ids.flatten_all()?, 0)?.reshape(dims)
                },
                limit,
            )
        })();
        rep.record(
            &format!("embedding {dtype:?} [{vocab}, {d}] ids {shape:?}"),
            outcome,
        );
    }
}

/// `x` as a contiguous view one element into a larger storage (an offset no 16-byte access
/// fits), its gradient flowing back to `x`.
fn one_element_in(x: &Tensor) -> R<Tensor> {
    let flat = x.flatten_all()?;
    let pad = flat.narrow(0, 0, 1)?.zeros_like()?;
    let view = Tensor::cat(&[&pad, &flat], 0)?
        .narrow(0, 1, flat.elem_count())?
        .reshape(x.shape())?;
    let (_, layout) = view.storage_and_layout();
    if layout.start_offset() != 1 || !layout.is_contiguous() {
        return Err(candle_core::Error::msg(format!(
            "the offset view has start offset {} (contiguous {}), not 1",
            layout.start_offset(),
            layout.is_contiguous()
        )));
    }
    Ok(view)
}

/// The global gradient norm and clip coefficient on CUDA against the CPU's (f64) values.
fn grad_norm_case(dev: &Device, dtype: DType, sizes: &[usize], max: Option<f64>) -> R<String> {
    let cpu: Vec<Tensor> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| values(&[n], 1.0, 300 + i as u64).to_dtype(dtype))
        .collect::<R<_>>()?;
    let on_dev: Vec<Tensor> = cpu.iter().map(|t| t.to_device(dev)).collect::<R<_>>()?;
    let want: Vec<f32> = multi_tensor::grad_norm_clip(&cpu, max)?.to_vec1()?;
    let got: Vec<f32> = multi_tensor::grad_norm_clip(&on_dev, max)?.to_vec1()?;
    let rel = |a: f32, b: f32| ((a - b).abs() / b.abs().max(1e-30)) as f64;
    let (dn, dc) = (rel(got[0], want[0]), rel(got[1], want[1]));
    if dn <= 1e-5 && dc <= 1e-5 {
        Ok(format!(
            "norm {} (rel diff {dn:.1e}), coefficient {}",
            got[0], got[1]
        ))
    } else {
        candle_core::bail!("CUDA {got:?} vs CPU {want:?}")
    }
}

/// The AdamW hyper-parameters of the CUDA cases, at step `t`.
fn adamw_at(t: usize) -> multi_tensor::AdamWStep {
    multi_tensor::AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t,
    }
}

/// Three AdamW steps of the same parameters on CUDA (one launch per step and decay group) and
/// on the CPU, with clipping by a coefficient computed once on the device and used by both:
/// bitwise equal (the kernel rounds every operation as the CPU does).
fn adamw_case(dev: &Device) -> R<String> {
    let sizes = [1usize, 0, 31, 8193, 40_000, 33];
    let decay: Vec<bool> = (0..sizes.len()).map(|i| i % 3 != 1).collect();
    let make = |seed: u64, scale: f32, d: &Device| -> R<Vec<Tensor>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| values(&[n], scale, seed + i as u64).to_device(d))
            .collect()
    };
    let zeros = |d: &Device| -> R<Vec<Tensor>> {
        sizes
            .iter()
            .map(|&n| Tensor::zeros(n, DType::F32, d))
            .collect()
    };
    let (pc, mc, vc) = (
        make(500, 1.0, &Device::Cpu)?,
        zeros(&Device::Cpu)?,
        zeros(&Device::Cpu)?,
    );
    let (pd, md, vd) = (make(500, 1.0, dev)?, zeros(dev)?, zeros(dev)?);
    for t in 1..=3 {
        let step = adamw_at(t);
        let gc = make(600 + 10 * t as u64, 4.0, &Device::Cpu)?;
        let gd: Vec<Tensor> = gc.iter().map(|g| g.to_device(dev)).collect::<R<_>>()?;
        let clip_d = multi_tensor::grad_norm_clip(&gd, Some(1.0))?;
        let clip_c = clip_d.to_device(&Device::Cpu)?;
        multi_tensor::adamw_step(&pd, &gd, &md, &vd, &decay, &step, Some(&clip_d))?;
        multi_tensor::adamw_step(&pc, &gc, &mc, &vc, &decay, &step, Some(&clip_c))?;
    }
    for (what, a, b) in [("param", &pd, &pc), ("m", &md, &mc), ("v", &vd, &vc)] {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let xs: Vec<f32> = x.to_device(&Device::Cpu)?.to_vec1()?;
            let ys: Vec<f32> = y.to_vec1()?;
            if let Some(j) = (0..xs.len()).find(|&j| xs[j].to_bits() != ys[j].to_bits()) {
                candle_core::bail!("{what} {i}[{j}]: CUDA {} vs CPU {}", xs[j], ys[j]);
            }
        }
    }
    Ok("3 steps, bitwise equal".into())
}

/// Gradients that are views of one buffer (FSDP's shard gradients of a unit): the CUDA norm
/// and AdamW read each storage through one lock and give the bits of separate copies. The
/// first operand shares its buffer with the third (the node's own operand), the second with
/// the fourth; each buffer's two views are in different AdamW decay groups (a unit's weights
/// and its biases), whose launches share one upload of their tables and every storage's lock.
fn shared_storage_views(dev: &Device) -> R<String> {
    let a = values(&[64], 1.0, 71).to_device(dev)?;
    let b = values(&[40], 1.0, 72).to_device(dev)?;
    let views = vec![
        a.narrow(0, 0, 24)?,
        b.narrow(0, 0, 15)?,
        a.narrow(0, 24, 40)?,
        b.narrow(0, 15, 25)?,
    ];
    let copies: Vec<Tensor> = views.iter().map(|g| g.copy()).collect::<R<_>>()?;
    let norm = |g: &[Tensor]| -> R<Vec<u32>> {
        let v: Vec<f32> = multi_tensor::grad_norm_clip(g, Some(1.0))?.to_vec1()?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    if norm(&views)? != norm(&copies)? {
        candle_core::bail!("grad_norm_clip over views differs from over copies");
    }
    let step = adamw_at(1);
    let run = |grads: &[Tensor]| -> R<Vec<Vec<u32>>> {
        let params: Vec<Tensor> = grads
            .iter()
            .enumerate()
            .map(|(i, g)| values(&[g.elem_count()], 1.0, 80 + i as u64).to_device(dev))
            .collect::<R<_>>()?;
        let m: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect::<R<_>>()?;
        let v: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect::<R<_>>()?;
        let clip = multi_tensor::grad_norm_clip(grads, Some(0.5))?;
        multi_tensor::adamw_step(
            &params,
            grads,
            &m,
            &v,
            &[true, false, false, true],
            &step,
            Some(&clip),
        )?;
        params
            .iter()
            .map(|p| -> R<Vec<u32>> {
                let v: Vec<f32> = p.to_device(&Device::Cpu)?.to_vec1()?;
                Ok(v.iter().map(|x| x.to_bits()).collect())
            })
            .collect()
    };
    if run(&views)? != run(&copies)? {
        candle_core::bail!("adamw_step over views differs from over copies");
    }
    Ok("norm and AdamW over views equal to over copies, bitwise".into())
}

fn multi_tensor_cases(dev: &Device, rep: &mut Report) {
    let sizes = [0usize, 1, 31, 8193, 100_003, 33];
    for dtype in [DType::F32, DType::BF16] {
        for max in [None, Some(1.0), Some(1e9)] {
            rep.record(
                &format!("grad_norm_clip {dtype:?} {sizes:?} max {max:?}"),
                grad_norm_case(dev, dtype, &sizes, max),
            );
        }
    }
    rep.record(
        "grad_norm_clip of empty tensors only",
        grad_norm_case(dev, DType::F32, &[0, 0], Some(1.0)),
    );
    rep.record(
        "grad_norm_clip and adamw_step over views of one buffer",
        shared_storage_views(dev),
    );
    rep.record("adamw_step CUDA vs CPU", adamw_case(dev));
}

/// `storage::retain_freed_memory` sets the pool's release threshold, and allocation still
/// works after it.
fn pool_case(dev: &Device) -> R<String> {
    if !candle_dtensor_kernels::storage::retain_freed_memory(dev)? {
        candle_core::bail!("retain_freed_memory set no pool on a CUDA device");
    }
    let x = Tensor::ones((1024, 1024), DType::F32, dev)?;
    drop(x);
    let y = Tensor::ones((1024, 1024), DType::F32, dev)?.sum_all()?;
    let v = y.to_scalar::<f32>()?;
    if v != 1024.0 * 1024.0 {
        candle_core::bail!("sum after a freed allocation: {v}");
    }
    Ok("release threshold set; allocation after a free works".into())
}

/// `storage::skip_unused_buffer_events`: the test's device has cudarc's buffer events off (its
/// every case ran so); a device whose context already has a second stream keeps them, and
/// work on it is still right.
fn buffer_events_case(dev: &Device) -> R<String> {
    let Device::Cuda(d) = dev else {
        candle_core::bail!("not a CUDA device");
    };
    if d.is_event_tracking() {
        candle_core::bail!("the test's device still tracks buffer events");
    }
    let other = Device::new_cuda(0)?;
    let Device::Cuda(o) = &other else {
        candle_core::bail!("new_cuda gave no CUDA device");
    };
    let _second = o
        .cuda_stream()
        .context()
        .new_stream()
        .map_err(candle_core::Error::wrap)?;
    // SAFETY: refused on a context with a second stream (what this checks): nothing changes.
    if unsafe { candle_dtensor_kernels::storage::skip_unused_buffer_events(&other) } {
        candle_core::bail!("events skipped on a context with two streams");
    }
    if !o.is_event_tracking() {
        candle_core::bail!("a context with two streams lost its buffer events");
    }
    let x = Tensor::arange(0f32, 4096.0, &other)?.reshape((64, 64))?;
    let v = x.matmul(&x.t()?)?.sum_all()?.to_scalar::<f32>()?;
    let w = Tensor::arange(0f32, 4096.0, &Device::Cpu)?.reshape((64, 64))?;
    let want = w.matmul(&w.t()?)?.sum_all()?.to_scalar::<f32>()?;
    if (v - want).abs() > want.abs() * 1e-3 {
        candle_core::bail!("matmul on the two-stream context: {v}, the CPU {want}");
    }
    Ok("off on the test's device; kept on a context with a second stream".into())
}

/// `profile::Mark`: GPU time between two marks around a known amount of work is positive,
/// unreadable never after `wait`.
fn marks_case(dev: &Device) -> R<String> {
    use candle_dtensor_kernels::profile::{Mark, Stamp};
    let a = Mark::record(dev)
        .map_err(candle_core::Error::wrap)?
        .ok_or_else(|| candle_core::Error::msg("no mark on a CUDA device"))?;
    let x = Tensor::ones((2048, 2048), DType::F32, dev)?;
    let y = x.matmul(&x)?;
    let b = Mark::record(dev)
        .map_err(candle_core::Error::wrap)?
        .ok_or_else(|| candle_core::Error::msg("no mark on a CUDA device"))?;
    b.wait().map_err(candle_core::Error::wrap)?;
    let ms = b
        .ms_since(&a)
        .map_err(candle_core::Error::wrap)?
        .ok_or_else(|| candle_core::Error::msg("marks unreadable after waiting"))?;
    drop(y);
    if !(ms.is_finite() && ms > 0.0) {
        candle_core::bail!("a 2048^3 matmul took {ms} ms between marks");
    }
    Ok(format!("a 2048^3 matmul: {ms:.3} ms between marks"))
}

/// Whether the linears above took cuBLASLt (`kernels/src/cublaslt.rs`, unless
/// `CDT_CUBLASLT=0`): their values and gradients were checked with the other cases; this says
/// the path was taken at all, forwards with the bias in the epilogue included, and how often
/// cuBLASLt refused (those GEMMs ran on candle's, checked too). Fails when the path is on and
/// no forward took the bias epilogue; reports the weight gradients with the bias gradient in
/// theirs.
fn cublaslt_case() -> R<String> {
    let c = candle_dtensor_kernels::fused::cublaslt_counts();
    // What was refused, printed here (this test installs no log subscriber).
    for r in candle_dtensor_kernels::fused::cublaslt_refusals() {
        println!("     cuBLASLt refused: {r}");
    }
    let off = std::env::var("CDT_CUBLASLT").is_ok_and(|v| v.trim() == "0");
    if off {
        if c.matmuls != 0 {
            candle_core::bail!("CDT_CUBLASLT=0, yet {} GEMMs ran on cuBLASLt", c.matmuls);
        }
        return Ok("off (CDT_CUBLASLT=0): the linears ran on candle's GEMM".into());
    }
    if c.bias_epilogues == 0 {
        candle_core::bail!(
            "no linear's bias went through cuBLASLt's epilogue ({} GEMMs on cuBLASLt, {} \
             refusals, printed above): they fell back to candle's GEMM and a bias pass",
            c.matmuls,
            c.refused
        );
    }
    // The bias gradient in the weight gradient's epilogue (BGRADB) is not required: where
    // cuBLASLt has no algorithm for it, the column sum runs apart (its values checked above).
    Ok(format!(
        "{} GEMMs on cuBLASLt, {} with the bias in the epilogue, {} with the bias gradient in \
         it, {} refusals (those fell back)",
        c.matmuls, c.bias_epilogues, c.bias_grads, c.refused
    ))
}

#[test]
fn fused_cuda_kernels_match_the_cpu_reference() {
    let Some(dev) = cuda_device() else {
        return;
    };
    // With the fused CUDA path switched off the autodiff cases would compare the composition
    // with itself.
    assert!(
        std::env::var("CDT_FUSED_CUDA").map_or(true, |v| v.trim() != "0"),
        "cuda_fused: unset CDT_FUSED_CUDA=0 to check the fused kernels"
    );
    let mut rep = Report::default();
    for dtype in [DType::F32, DType::BF16] {
        row_kernels(&dev, dtype, &mut rep);
        cross_entropy(&dev, dtype, &mut rep);
        attention(&dev, dtype, &mut rep);
        embedding(&dev, dtype, &mut rep);
        column_sums(&dev, dtype, &mut rep);
        plain_linear(&dev, dtype, &mut rep);
        linear_gelu(&dev, dtype, &mut rep);
        if dtype == DType::F32 {
            mixed_linear(&dev, &mut rep);
            gpt2_linears(&dev, &mut rep);
        }
    }
    rep.record("linears on cuBLASLt's bias epilogue", cublaslt_case());
    bad_input(&dev, &mut rep);
    multi_tensor_cases(&dev, &mut rep);
    rep.record("memory pool keeps freed memory", pool_case(&dev));
    rep.record("GPU timing marks", marks_case(&dev));
    rep.record("cudarc buffer events", buffer_events_case(&dev));
    if !rep.failures.is_empty() {
        panic!(
            "cuda_fused: {} of {} checks failed:\n{}",
            rep.failures.len(),
            rep.failures.len() + rep.passed,
            rep.failures.join("\n")
        );
    }
    println!("cuda_fused: {} checks passed on {dev:?}", rep.passed);
}
