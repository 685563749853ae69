//! Mixed precision as a policy ([`Precision`]), applied op by op, autocast-style, by the layers
//! of [`crate::layers`], the mixture-of-experts experts and the GPT (whole or in pipeline
//! stages), in every layout.
//!
//! | op | `f32` | `tf32` | `bf16` |
//! |---|---|---|---|
//! | GEMMs: linears, LM head, experts | f32 | f32 inputs, TF32 tensor cores (CUDA) | bf16 inputs, f32 accumulation, f32 out |
//! | attention `QK^T`, `PV` | f32 | as GEMMs | bf16 inputs, f32 accumulation, f32 out |
//! | attention softmax, norms, loss, optimizer | f32 | f32 | f32 |
//! | GELU / SiLU of the dense MLP | f32 | f32 | on CUDA bf16 in and out (GELU: f32 arithmetic, one rounding); f32 on the CPU |
//! | mixture-of-experts router (its top-k is sensitive to rounding) | f32 | as GEMMs | f32 |
//! | on CUDA: the MLP's hidden activation, the QKV projection's output, attention's output and the logits (where the fused cross-entropy reads them: vocabulary not sharded) | f32 | f32 | bf16 (and their gradients) |
//! | other activations (the residual stream, norms' outputs, other logits), master weights, their gradients | f32 | f32 | f32 |
//!
//! The bf16 activations follow autocast's data flow on CUDA (on the CPU, whose bf16
//! arithmetic converts element by element, they made the step slower and stay f32): a linear
//! whose output feeds a bf16 consumer (attention's bf16 products, the MLP's GELU and second
//! GEMM, the fused loss) hands it bf16, and the linear after it reads bf16 and writes f32
//! into the residual stream
//! ([`DTensor::linear_with_layout_to`]: one node each, no cast of the activation between
//! them). On CUDA the GEMM and the f32 bias are one cuBLASLt matmul with the bias in its
//! epilogue: the f32 accumulator plus the bias, rounded once, as autocast's `addmm`; where
//! cuBLASLt refuses a shape (or `CDT_CUBLASLT=0`), the f32 bias is added to candle's bf16
//! product in f32 and the sum rounded to bf16 (two roundings). Attention's inputs are the same bits a cast of the f32 projection output gave; the
//! GELU reads its input rounded to bf16, as autocast's does.
//!
//! The master weights are f32 variables; a bf16 GEMM casts its pieces inside the op
//! ([`DTensor::linear_with_layout_in`]), after dispatch has placed them, so the gradient of a
//! master weight is f32 and so is every gradient reduction (data-parallel all_reduce, FSDP's
//! reduce-scatter): [`Precision::grad_reduce_dtype`]. Activations cross the wire in f32 too
//! (sequence-parallel all_gathers); context-parallel attention is the exception: its ring
//! exchanges K/V in bf16 and computes each block in f32 (`candle_dtensor_core::cp`).
//!
//! FSDP's `param_dtype` (e.g. bf16) is a storage and communication choice: the gathered
//! parameters are bf16, and the policy casts them up where it computes in f32 (norms, the
//! embedding sums) and runs the GEMMs in that dtype (`f32` / `tf32` policies) or in bf16. A
//! linear takes its gathered bf16 weight as it is (no f32 copy for the graph to keep until the
//! backward; the node keeps the gathered buffer, which FSDP releases after the unit's forward
//! and gathers again before its backward), wherever dispatch never reduces that weight's
//! gradient (see `gemm_as_stored`), so its reduction stays f32. With f32 FSDP parameters
//! under the `bf16` policy the node keeps no bf16 cast of the gathered weight either: the
//! backward casts it again from the re-gathered buffer (`recast_if_gathered`).
//!
//! TF32 is candle's process-global reduced-precision f32 GEMM switch
//! (`candle_core::cuda::set_gemm_reduced_precision_f32`), set by [`Precision::apply`]; on the
//! CPU TF32 does not exist and `tf32` runs as f32 (a documented fallback, reported by
//! [`Applied::fallback`]).
//!
//! The policy travels on [`GptConfig::precision`](crate::GptConfig::precision); the GPT's
//! forward enters it with [`scope`] for the ops it runs on this thread, and activation
//! checkpointing's recompute enters the same one.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor};
use candle_dtensor_core::{DTensor, Placement};

use crate::error::{ModelError, Result};

/// Which precision the model computes in; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything f32 (on CUDA, cuBLAS's full f32 compute).
    #[default]
    F32,
    /// Everything f32; on CUDA the f32 GEMMs use TF32 tensor cores.
    Tf32,
    /// GEMMs and attention's two products in bf16 with f32 accumulation; everything else f32.
    Bf16,
}

impl Precision {
    /// The names [`Precision::from_str`] accepts.
    pub const CHOICES: [&'static str; 3] = ["f32", "tf32", "bf16"];

    /// Its name (one of [`Self::CHOICES`]).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The dtype the GEMMs run in when it differs from the operands' (bf16), else `None`.
    pub fn gemm_dtype(self) -> Option<DType> {
        match self {
            Precision::Bf16 => Some(DType::BF16),
            Precision::F32 | Precision::Tf32 => None,
        }
    }

    /// The dtype of the master weights' gradients and so of their reduction (every policy:
    /// f32; the GEMMs' casts happen inside the ops, after the gradient syncs).
    pub fn grad_reduce_dtype(self) -> DType {
        DType::F32
    }

    /// Sets candle's process-global GEMM switches for this policy and checks `device` can run
    /// it. On a CUDA device: TF32 on for `tf32`, off for the others; bf16 GEMMs keep f32
    /// accumulation (candle's default, set explicitly). On the CPU the switches (which only
    /// CUDA reads) are left alone. They are process-wide: set once at startup (setting the
    /// same value from several rank threads is harmless).
    ///
    /// # Errors
    ///
    /// `bf16` where a bf16 GEMM fails or gives a wrong product on `device` (a probe: a small
    /// product against f32): [`ModelError::Unsupported`] naming the op and the device.
    pub fn apply(self, device: &Device) -> Result<Applied> {
        if device.is_cuda() {
            // Only for a CUDA device: a CPU run in the same process (train_gpt's --check
            // reference with --check-device cpu) must not switch the GPU run's TF32 off.
            candle_core::cuda::set_gemm_reduced_precision_bf16(false);
            candle_core::cuda::set_gemm_reduced_precision_f32(self == Precision::Tf32);
        }
        let fallback = match self {
            Precision::Tf32 if !device.is_cuda() => {
                let m = format!(
                    "precision tf32: TF32 needs a CUDA GPU; on {} the GEMMs run in full f32 \
                     (the f32 policy)",
                    device_name(device)
                );
                // Once per process: every rank thread applies the same policy.
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| tracing::warn!("{m}"));
                Some(m)
            }
            Precision::Bf16 => {
                probe_bf16(device)?;
                None
            }
            _ => None,
        };
        Ok(Applied {
            requested: self,
            effective: if fallback.is_some() {
                Precision::F32
            } else {
                self
            },
            fallback,
        })
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "tf32" => Ok(Precision::Tf32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(ModelError::Config(format!(
                "--precision: unknown precision \"{other}\"; choices: {}",
                Self::CHOICES.join(", ")
            ))),
        }
    }
}

/// What [`Precision::apply`] set up.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The policy asked for.
    pub requested: Precision,
    /// The policy that runs (`f32` for `tf32` on the CPU).
    pub effective: Precision,
    /// Why `effective` differs from `requested` (also logged as a warning).
    pub fallback: Option<String>,
}

fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "the CPU".into(),
        l => format!("{l:?}"),
    }
}

/// A bf16 GEMM on `device` against its f32 product: it must run and agree to bf16 rounding.
fn probe_bf16(device: &Device) -> Result<()> {
    probe_with(device, |a, b| a.matmul(b))
}

/// [`probe_bf16`] with the bf16 product computed by `product` (the test plants failures).
fn probe_with(
    device: &Device,
    product: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Result<()> {
    let unsupported = |why: String| {
        ModelError::Unsupported(format!(
            "precision bf16: the bf16 GEMM (matmul) on {}: {why}",
            device_name(device)
        ))
    };
    let run = || -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
        let a: Vec<f32> = (0..64).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
        let b: Vec<f32> = (0..64).map(|i| ((i % 5) as f32 - 2.0) * 0.5).collect();
        let a = Tensor::from_vec(a, (8, 8), device)?;
        let b = Tensor::from_vec(b, (8, 8), device)?;
        let want = a.matmul(&b)?.flatten_all()?.to_vec1::<f32>()?;
        let got = product(&a.to_dtype(DType::BF16)?, &b.to_dtype(DType::BF16)?)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok((want, got))
    };
    let (want, got) = run().map_err(|e| unsupported(e.to_string()))?;
    // The inputs are exact in bf16 and every product and sum of them is a multiple of 1/8
    // below 2^8: the bf16 product must equal the f32 one up to the output's rounding.
    for (w, g) in want.iter().zip(&got) {
        let d = (w - g).abs();
        if d.is_nan() || d > w.abs() / 128.0 {
            return Err(unsupported(format!(
                "wrong product ({g} where f32 gives {w})"
            )));
        }
    }
    Ok(())
}

thread_local! {
    static CURRENT: Cell<Option<(Precision, DType)>> = const { Cell::new(None) };
}

/// Restores the previous policy of this thread when dropped ([`scope`]).
pub struct PrecisionGuard {
    prev: Option<(Precision, DType)>,
}

impl Drop for PrecisionGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.prev));
    }
}

/// Runs the ops of this thread under `policy` until the guard drops, with `master` the dtype of
/// the master weights (the activations' dtype between ops).
pub fn scope(policy: Precision, master: DType) -> PrecisionGuard {
    let prev = CURRENT.with(|c| c.replace(Some((policy, master))));
    PrecisionGuard { prev }
}

/// This thread's policy and master dtype (`None` outside a [`scope`]: the layers then
/// compute in their inputs' dtype, as without a policy).
pub fn current() -> Option<(Precision, DType)> {
    CURRENT.with(|c| c.get())
}

/// `x` cast to `dtype` (no op when it already is).
pub(crate) fn cast(x: &DTensor, dtype: DType) -> Result<DTensor> {
    Ok(if x.dtype() == dtype {
        x.clone()
    } else {
        x.to_dtype(dtype)?
    })
}

/// `x` in the master dtype of the current [`scope`] (unchanged outside one).
pub(crate) fn to_master(x: &DTensor) -> Result<DTensor> {
    match current() {
        Some((_, m)) if x.dtype().is_float() => cast(x, m),
        _ => Ok(x.clone()),
    }
}

/// The dtype a GEMM whose weight is stored in `weight` runs in under the current policy.
fn gemm_dtype(weight: DType) -> DType {
    match current().and_then(|(p, _)| p.gemm_dtype()) {
        Some(d) => d,
        None => weight,
    }
}

/// Whether `w` goes into a GEMM computed in `compute` as it is rather than cast to `to` (and,
/// inside the op, back): a weight already in the GEMM's dtype (FSDP's gathered bf16
/// parameters under `--mixed-precision bf16`, whose GEMMs run in bf16 under every policy) whose
/// gradient dispatch never reduces: on every mesh dim of more than one rank it is sharded, or
/// its owner reduces it (`managed_grad_dims`: FSDP's reduce-scatter, which casts it to f32
/// first). So every reduction of its gradient stays in f32. The cast it saves made an f32 copy
/// of the whole gathered weight that the graph kept until the backward: FSDP's release of the
/// gathered parameters after a unit's forward freed nothing of it. Taken as it is, the weight
/// the node keeps for its backward is the gathered buffer itself, released after the forward
/// and gathered again before the backward, as FSDP2 keeps its unsharded bf16 parameters.
fn gemm_as_stored(w: &DTensor, compute: DType, to: DType) -> bool {
    if w.dtype() != compute || w.dtype() == to {
        return false;
    }
    let shape = w.mesh().shape();
    let managed = w.managed_grad_dims();
    w.placements().iter().enumerate().all(|(d, p)| {
        shape.get(d).is_none_or(|&n| n <= 1)
            || managed.contains(&d)
            || matches!(p, Placement::Shard(_))
    })
}

/// `x W^T (+ b)` under the current policy: the weight and bias cast to `x`'s dtype (FSDP's
/// gathered bf16 parameters cast up, except a weight the GEMM takes as it is:
/// [`gemm_as_stored`]; no op otherwise) and the product computed in the policy's GEMM dtype
/// (bf16) or the weight's stored dtype, back in `x`'s dtype.
pub(crate) fn linear(
    x: &DTensor,
    w: &DTensor,
    b: Option<&DTensor>,
    layout: Option<&[Placement]>,
) -> Result<DTensor> {
    let compute = gemm_dtype(w.dtype());
    let dt = x.dtype();
    if gemm_as_stored(w, compute, dt) {
        let b = b.map(|b| cast(b, dt)).transpose()?;
        return Ok(x.linear_with_layout_to(w, b.as_ref(), layout, compute, dt)?);
    }
    let w = cast(w, dt)?;
    let b = b.map(|b| cast(b, dt)).transpose()?;
    recast_if_gathered(&w, compute, || {
        Ok(x.linear_with_layout_in(&w, b.as_ref(), layout, compute)?)
    })
}

/// Runs `f`, a linear of `w` computed in `compute`, with its node keeping no cast of `w` where
/// FSDP manages `w` (`managed_grad_dims`): its gathered buffer is released after the unit's
/// forward and gathered again before the backward, which casts it again
/// (`region::recast_weights`), so no bf16 copy of every unsharded weight lives until then.
fn recast_if_gathered<R>(w: &DTensor, compute: DType, f: impl FnOnce() -> R) -> R {
    let gathered = !w.managed_grad_dims().is_empty() && w.dtype() != compute;
    candle_dtensor_core::region::recast_weights(gathered, f)
}

/// [`linear`] with the output in `out` and `x` in any float dtype: the weight and bias cast to
/// the scope's master dtype (FSDP's gathered bf16 parameters cast up; no op otherwise), the
/// product in the policy's GEMM dtype, the bias added in the master dtype and the sum rounded
/// to `out` (`DTensor::linear_with_layout_to`: one node, no cast of the activation outside
/// it). For bf16 activations between a GEMM and its bf16 consumer ([`activation_dtype`]).
pub(crate) fn linear_to(
    x: &DTensor,
    w: &DTensor,
    b: Option<&DTensor>,
    layout: Option<&[Placement]>,
    out: DType,
) -> Result<DTensor> {
    let Some((_, master)) = current() else {
        return cast(&linear(x, w, b, layout)?, out);
    };
    let compute = gemm_dtype(w.dtype());
    let w = cast_unless_stored(w, compute, master)?;
    let b = b.map(|b| cast(b, master)).transpose()?;
    recast_if_gathered(&w, compute, || {
        Ok(x.linear_with_layout_to(&w, b.as_ref(), layout, compute, out)?)
    })
}

/// `w` as the GEMM takes it: as it is where [`gemm_as_stored`], else cast to `master`.
fn cast_unless_stored(w: &DTensor, compute: DType, master: DType) -> Result<DTensor> {
    if gemm_as_stored(w, compute, master) {
        Ok(w.clone())
    } else {
        cast(w, master)
    }
}

/// `gelu(x W^T (+ b))` under the current policy: [`linear`] (`out` `None`) or [`linear_to`]
/// (`out` given) with the GELU of the output in the linear's graph node where it can be
/// (`DTensor::linear_gelu_with_layout_to`); the same values as the linear followed by GELU.
pub(crate) fn linear_gelu(
    x: &DTensor,
    w: &DTensor,
    b: Option<&DTensor>,
    layout: Option<&[Placement]>,
    out: Option<DType>,
) -> Result<DTensor> {
    let compute = gemm_dtype(w.dtype());
    match (out, current()) {
        (None, _) => {
            let dt = x.dtype();
            let w = cast_unless_stored(w, compute, dt)?;
            let b = b.map(|b| cast(b, dt)).transpose()?;
            recast_if_gathered(&w, compute, || {
                Ok(x.linear_gelu_with_layout_to(&w, b.as_ref(), layout, compute, dt)?)
            })
        }
        (Some(out), Some((_, master))) => {
            let w = cast_unless_stored(w, compute, master)?;
            let b = b.map(|b| cast(b, master)).transpose()?;
            recast_if_gathered(&w, compute, || {
                Ok(x.linear_gelu_with_layout_to(&w, b.as_ref(), layout, compute, out)?)
            })
        }
        // No policy: `linear_to`'s cast of the output, then the GELU.
        (Some(out), None) => Ok(linear_to(x, w, b, layout, out)?.gelu()?),
    }
}

/// The dtype of the activations a GEMM hands to a bf16 consumer under the current policy
/// (autocast's data flow; the layers use it on CUDA): bf16 for `bf16` (the QKV projection's
/// output, the MLP's hidden activation and its GELU, the logits), `None` (the master dtype)
/// otherwise.
pub(crate) fn activation_dtype() -> Option<DType> {
    local_gemm_dtype()
}

/// `a @ b` (activations) under the current policy: in bf16 for `bf16`, back in `a`'s dtype.
pub(crate) fn matmul(a: &DTensor, b: &DTensor) -> Result<DTensor> {
    Ok(a.matmul_in(b, gemm_dtype(a.dtype()))?)
}

/// A local GEMM's operand in the current policy's GEMM dtype (`None`: as it is) — for the
/// experts, which multiply local pieces.
pub(crate) fn local_gemm_dtype() -> Option<DType> {
    current().and_then(|(p, _)| p.gemm_dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names_the_flag_value_and_choices() {
        for c in Precision::CHOICES {
            assert_eq!(c.parse::<Precision>().unwrap().name(), c);
        }
        let e = "fp8".parse::<Precision>().unwrap_err().to_string();
        assert!(
            e.contains("--precision") && e.contains("\"fp8\"") && e.contains("f32, tf32, bf16"),
            "{e}"
        );
    }

    #[test]
    fn tf32_on_the_cpu_falls_back_to_f32() {
        let a = Precision::Tf32.apply(&Device::Cpu).unwrap();
        assert_eq!(a.effective, Precision::F32);
        assert!(a.fallback.unwrap().contains("TF32 needs a CUDA GPU"));
        let a = Precision::Bf16.apply(&Device::Cpu).unwrap();
        assert_eq!((a.effective, a.fallback), (Precision::Bf16, None));
        assert_eq!(Precision::Bf16.grad_reduce_dtype(), DType::F32);
    }

    /// bf16 where the device's bf16 GEMM fails, or gives a wrong product: a typed error naming
    /// the op and the device, never a run with wrong results.
    #[test]
    fn a_device_without_a_working_bf16_gemm_is_refused() {
        let e = probe_with(&Device::Cpu, |_, _| {
            Err(candle_core::Error::Msg("no bf16 kernel".into()))
        })
        .unwrap_err();
        assert!(matches!(e, ModelError::Unsupported(_)), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains("bf16 GEMM (matmul)") && m.contains("the CPU") && m.contains("no bf16"),
            "{m}"
        );
        let e = probe_with(&Device::Cpu, |a, b| a.matmul(b)?.affine(1.5, 0.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("wrong product") && e.contains("the CPU"), "{e}");
        probe_with(&Device::Cpu, |a, b| a.matmul(b)).unwrap();
    }

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(current(), None);
        {
            let _a = scope(Precision::Bf16, DType::F32);
            {
                let _b = scope(Precision::F32, DType::F64);
                assert_eq!(current(), Some((Precision::F32, DType::F64)));
            }
            assert_eq!(current(), Some((Precision::Bf16, DType::F32)));
        }
        assert_eq!(current(), None);
    }
}
