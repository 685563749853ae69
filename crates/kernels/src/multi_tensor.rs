//! Reductions over many tensors at once: the global L2 norm of a model's gradients and the
//! clip coefficient, kept on the gradients' device.
//!
//! Gradient clipping needs `min(1, max_norm / ||g||)` over all gradients. Read back on the host
//! per parameter (a sum of squares, a host read, for each of a model's ~150 tensors) it is
//! ~300 launches and 150 device synchronizations per step. [`grad_norm_clip`] computes it in
//! two launches on CUDA (a sum of squares over the concatenation of every gradient, blocks
//! walking across tensor boundaries, then one block adding the partials in a fixed order) and
//! returns it as a device tensor: the optimizer multiplies the gradients (or its update) by
//! the coefficient without the host ever reading it. The CPU path computes the same values (f64
//! sums) and is the reference of the CUDA one (`tests/cuda_fused.rs`).

use candle_core::{CpuStorage, CustomOp1, DType, Error, Layout, Shape, Tensor};

use crate::error::KernelError;

type CResult<T> = candle_core::Result<T>;

/// The node computing `[norm, coefficient]` from the first gradient (its operand) and the
/// others (read through their storages in the CUDA forward).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct GradNorm {
    others: Vec<Tensor>,
    /// Per one of `others`, the storage it reads: [`Shared::Own`] its own, or that of the
    /// operand (0: candle's, 1..: `others[i - 1]`) already holding it (gradients that are
    /// views of one buffer, as FSDP's shard gradients of a unit are).
    shares: Vec<Shared>,
    max_norm: Option<f64>,
}

/// Where an operand's storage is locked from (see [`GradNorm::shares`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shared {
    Own,
    Of(usize),
}

/// For `tensors`, whether each one's storage is its own so far ([`Shared::Own`]) or that of an
/// earlier one ([`Shared::Of`] its index), computed before any lock is held: each storage is
/// then read-locked once per launch, never twice by one thread.
fn shared_storages(tensors: &[Tensor]) -> Vec<Shared> {
    let keys: Vec<usize> = tensors.iter().map(crate::storage::storage_key).collect();
    keys.iter()
        .enumerate()
        .map(|(i, k)| match keys[..i].iter().position(|e| e == k) {
            Some(j) => Shared::Of(j),
            None => Shared::Own,
        })
        .collect()
}

/// The host tables of a multi-tensor launch (device addresses as `u64`, element offsets as
/// `i64`), gathered into one buffer so that a launch's tables cost the CUDA path one allocation
/// and one host-to-device copy: each is a stream-ordered `cuMemAllocAsync` plus a pageable
/// `cuMemcpyHtoDAsync` and, later, a free, several microseconds of host time apiece in the
/// step's optimizer phase, while the GPU waits for the host (AdamW had ten a step).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Default, Debug)]
pub(crate) struct Tables {
    words: Vec<u64>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Tables {
    /// Appends device addresses; their range in the buffer.
    pub(crate) fn addrs(&mut self, v: &[u64]) -> std::ops::Range<usize> {
        let start = self.words.len();
        self.words.extend_from_slice(v);
        start..self.words.len()
    }

    /// Appends element offsets, stored as their two's-complement bits (`as u64`, which keeps
    /// the bits of every i64); their range in the buffer, which a kernel reads as `long long`.
    pub(crate) fn offsets(&mut self, v: &[i64]) -> std::ops::Range<usize> {
        let start = self.words.len();
        self.words.extend(v.iter().map(|&x| x as u64));
        start..self.words.len()
    }

    /// Every table, back to back, as uploaded.
    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }
}

/// The clip coefficient of a norm: `min(1, max_norm / (norm + 1e-6))`, 1 without a maximum.
pub fn clip_coefficient(norm: f64, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(m) if m > 0.0 => (m / (norm + 1e-6)).min(1.0),
        _ => 1.0,
    }
}

impl CustomOp1 for GradNorm {
    fn name(&self) -> &'static str {
        "grad-norm"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> CResult<(CpuStorage, Shape)> {
        // The CPU path does not build this node (see `grad_norm_clip`).
        Err(Error::msg("grad_norm: the multi-tensor node is CUDA-only"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        // The others' storages, each read-locked once for the launch: the first operand's is
        // locked by candle, and an operand sharing an earlier one's storage reads it through
        // that lock (`shares`, computed before any lock was taken).
        let guards: Vec<Option<_>> = self
            .others
            .iter()
            .zip(&self.shares)
            .map(|(t, sh)| (*sh == Shared::Own).then(|| t.storage_and_layout().0))
            .collect();
        let mut stores: Vec<&candle_core::CudaStorage> = vec![s];
        for (i, g) in guards.iter().enumerate() {
            let st = match (g, self.shares[i]) {
                (_, Shared::Of(j)) => stores[j],
                (Some(g), Shared::Own) => match &**g {
                    candle_core::Storage::Cuda(c) => c,
                    other => {
                        return Err(Error::msg(format!(
                            "grad_norm: gradients on CUDA and on {:?}",
                            other.device().location()
                        )))
                    }
                },
                (None, Shared::Own) => {
                    return Err(Error::msg(
                        "grad_norm: internal: an own storage left unlocked",
                    ))
                }
            };
            stores.push(st);
        }
        let mut parts = vec![(s, l)];
        for (i, t) in self.others.iter().enumerate() {
            parts.push((stores[i + 1], t.layout()));
        }
        let out = crate::cuda::grad_norm(&s.device, &parts, self.max_norm)?;
        Ok((out, Shape::from(2)))
    }
}

/// The global L2 norm of `grads` and its clip coefficient `min(1, max_norm / (norm + 1e-6))`
/// (1 when `max_norm` is `None`), as an f32 tensor `[norm, coefficient]` on the gradients'
/// device, outside the graph. On CUDA (f32 or bf16 gradients, all of one dtype; f32 sums) two
/// launches and no host read; on the CPU an f64 sum per gradient. Strided gradients are made
/// contiguous first. Gradients may be views of one buffer (FSDP's shard gradients of a unit
/// are): each is summed over its own elements.
///
/// # Errors
///
/// No gradients, gradients on several devices or (on CUDA) of several dtypes or of a dtype
/// other than f32/bf16.
pub fn grad_norm_clip(grads: &[Tensor], max_norm: Option<f64>) -> CResult<Tensor> {
    let op = "grad_norm";
    let first = grads.first().ok_or_else(|| KernelError::Mismatch {
        op,
        detail: "no gradients".into(),
    })?;
    let dev = first.device();
    if let Some(g) = grads.iter().find(|g| !g.device().same_device(dev)) {
        return Err(KernelError::Mismatch {
            op,
            detail: format!(
                "gradients on {:?} and {:?}",
                dev.location(),
                g.device().location()
            ),
        }
        .into());
    }
    if !dev.is_cuda() {
        let mut sum = 0f64;
        for g in grads {
            sum += g
                .detach()
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        let norm = sum.sqrt();
        let v = [norm as f32, clip_coefficient(norm, max_norm) as f32];
        return Tensor::new(&v, dev);
    }
    let grads: Vec<Tensor> = grads
        .iter()
        .map(|g| g.detach().contiguous())
        .collect::<CResult<_>>()?;
    // Operand j + 1's storage as the node sees it: 0 is candle's first operand.
    let shares = shared_storages(&grads)[1..].to_vec();
    let node = GradNorm {
        others: grads[1..].to_vec(),
        shares,
        max_norm,
    };
    grads[0].apply_op1_no_bwd(&node)
}

/// `g * coefficient` for each gradient, the coefficient being the second element of
/// [`grad_norm_clip`]'s result (a device tensor): clipping without a host read.
pub fn scale_grads(grads: &[Tensor], norm_clip: &Tensor) -> CResult<Vec<Tensor>> {
    let c = norm_clip.flatten_all()?.narrow(0, 1, 1)?.reshape(())?;
    grads
        .iter()
        .map(|g| g.broadcast_mul(&c.to_dtype(g.dtype())?))
        .collect()
}

/// The hyper-parameters and step of one AdamW update (candle-nn's AdamW, as
/// `candle_dtensor_train::AdamW` computes it: the per-step constants in f64, then cast to f32).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay (applied as `theta * (1 - lr * weight_decay)`).
    pub weight_decay: f64,
    /// The step number `t` of the bias corrections, from 1.
    pub t: usize,
}

impl AdamWStep {
    /// The kernel's f32 constants (`AdamWConsts` of `cuda/multi_tensor.cu`, in its field order:
    /// beta1, 1 - beta1, beta2, 1 - beta2, the two bias corrections' reciprocals, the decay
    /// factor, eps, lr); `decay` false gives `1 - lr * 0` (a parameter group without weight
    /// decay, as the CPU optimizer does it).
    pub fn consts(&self, decay: bool) -> [f32; 9] {
        let t = self.t as i32;
        let wd = if decay { self.weight_decay } else { 0.0 };
        [
            self.beta1 as f32,
            (1.0 - self.beta1) as f32,
            self.beta2 as f32,
            (1.0 - self.beta2) as f32,
            (1.0 / (1.0 - self.beta1.powi(t))) as f32,
            (1.0 / (1.0 - self.beta2.powi(t))) as f32,
            (1.0 - self.lr * wd) as f32,
            self.eps as f32,
            self.lr as f32,
        ]
    }
}

/// One AdamW update of f32 slices in place: the CPU optimizer's arithmetic
/// (`crates/train/src/optim.rs`, candle-nn's tensor ops element by element, `+ 0` terms
/// included), with the gradient first multiplied by `scale` when given. The reference of the
/// CUDA kernel, which matches it bit for bit.
///
/// # Panics
///
/// If the four slices differ in length.
pub fn adamw_reference(
    theta: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: &AdamWStep,
    decay: bool,
    scale: Option<f32>,
) {
    assert!(
        g.len() == theta.len() && m.len() == theta.len() && v.len() == theta.len(),
        "adamw_reference: slices of different lengths"
    );
    let [b1, one_b1, b2, one_b2, sm, sv, dec, eps, lr] = step.consts(decay);
    for (((th, &gi), mi), vi) in theta.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let gi = scale.map_or(gi, |s| gi * s);
        let next_m = (*mi * b1 + 0.0) + (gi * one_b1 + 0.0);
        let next_v = (*vi * b2 + 0.0) + ((gi * gi) * one_b2 + 0.0);
        let m_hat = next_m * sm + 0.0;
        let v_hat = next_v * sv + 0.0;
        let decayed = *th * dec + 0.0;
        let adjusted = m_hat / (v_hat.sqrt() * 1.0 + eps);
        *th = decayed - (adjusted * lr + 0.0);
        *mi = next_m;
        *vi = next_v;
    }
}

/// One AdamW step of every parameter in place, with their gradients and moments (f32, all on
/// one device; each parameter and moment a storage of its own; gradients, only read, may be
/// views of one buffer): on CUDA one launch
/// for all of them (plus four small uploads of the address tables), no host read; on the CPU
/// [`adamw_reference`] per parameter. `decay[i]` false leaves parameter i without weight decay.
/// `norm_clip`: [`grad_norm_clip`]'s result, whose coefficient then multiplies every gradient
/// (clipping fused into the update). Parameters and moments must be contiguous owners
/// (offset 0): they are written in place, as the optimizer's `Var`s are.
///
/// Wiring note: `candle_dtensor_train::AdamW` keeps CPU moments as `Vec`s and CUDA moments as
/// `Var`s; using this for CUDA f32 parameters means one call per step over the `Var` moments
/// (see docs/ARCHITECTURE.md).
///
/// # Errors
///
/// Lists of different lengths, a dtype other than f32, a parameter and its gradient/moments of
/// different lengths, a strided or offset parameter or moment, tensors on several devices, or
/// a parameter, moment or the coefficient sharing a storage with another of the tensors.
pub fn adamw_step(
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    decay: &[bool],
    step: &AdamWStep,
    norm_clip: Option<&Tensor>,
) -> CResult<()> {
    let op = "adamw";
    let k = params.len();
    if grads.len() != k || m.len() != k || v.len() != k || decay.len() != k {
        return Err(KernelError::Mismatch {
            op,
            detail: format!(
                "{k} parameters, {} gradients, {}/{} moments, {} decay flags",
                grads.len(),
                m.len(),
                v.len(),
                decay.len()
            ),
        }
        .into());
    }
    if k == 0 {
        return Ok(());
    }
    let dev = params[0].device().clone();
    let all = || {
        params
            .iter()
            .chain(grads)
            .chain(m)
            .chain(v)
            .chain(norm_clip)
    };
    for t in all() {
        if !t.device().same_device(&dev) {
            return Err(KernelError::Mismatch {
                op,
                detail: format!(
                    "tensors on {:?} and {:?}",
                    dev.location(),
                    t.device().location()
                ),
            }
            .into());
        }
        if t.dtype() != DType::F32 {
            return Err(KernelError::UnsupportedDType {
                op,
                device: if dev.is_cuda() { "CUDA" } else { "CPU" },
                dtype: t.dtype(),
                supported: "f32",
                shape: t.dims().to_vec(),
            }
            .into());
        }
    }
    for t in params.iter().chain(m).chain(v) {
        let l = t.layout();
        if !l.is_contiguous() || l.start_offset() != 0 {
            return Err(KernelError::NotContiguous {
                op,
                operand: "parameter or moment (updated in place, so an owner at offset 0)",
                shape: t.dims().to_vec(),
            }
            .into());
        }
    }
    let grads: Vec<Tensor> = grads
        .iter()
        .map(|g| g.detach().contiguous())
        .collect::<CResult<_>>()?;
    // Parameters and moments are written: each a storage of its own, shared with nothing.
    // Gradients are only read, so they may be views of one buffer (FSDP's shard gradients of
    // a unit are), but never of a written storage.
    let mut written: Vec<usize> = params
        .iter()
        .chain(m)
        .chain(v)
        .chain(norm_clip)
        .map(crate::storage::storage_key)
        .collect();
    written.sort_unstable();
    let grad_keys: Vec<usize> = grads.iter().map(crate::storage::storage_key).collect();
    if written.windows(2).any(|w| w[0] == w[1])
        || grad_keys.iter().any(|k| written.binary_search(k).is_ok())
    {
        return Err(KernelError::Mismatch {
            op,
            detail: "a parameter, moment or the clip coefficient shares a storage with another \
                     of the tensors"
                .into(),
        }
        .into());
    }
    for (i, p) in params.iter().enumerate() {
        for (what, t) in [("gradient", &grads[i]), ("m", &m[i]), ("v", &v[i])] {
            if t.elem_count() != p.elem_count() {
                return Err(KernelError::Mismatch {
                    op,
                    detail: format!(
                        "parameter {i} of shape {:?}, its {what} {:?}",
                        p.dims(),
                        t.dims()
                    ),
                }
                .into());
            }
        }
    }
    if dev.is_cuda() {
        return adamw_cuda(params, &grads, m, v, decay, step, norm_clip);
    }
    let scale = norm_clip
        .map(|c| c.flatten_all()?.get(1)?.to_scalar::<f32>())
        .transpose()?;
    use crate::storage::{with_slice, with_slice_mut};
    for i in 0..k {
        let d = decay[i];
        with_slice::<f32, _>(&grads[i], |g| {
            with_slice_mut::<f32>(&params[i], |th| {
                with_slice_mut::<f32>(&m[i], |mv| {
                    with_slice_mut::<f32>(&v[i], |vv| {
                        adamw_reference(th, g, mv, vv, step, d, scale);
                        Ok(())
                    })
                })
            })
        })??;
    }
    Ok(())
}

/// The CUDA path of [`adamw_step`]: one launch per decay group (with and without weight decay),
/// with one upload of both groups' tables.
#[cfg(feature = "cuda")]
fn adamw_cuda(
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    decay: &[bool],
    step: &AdamWStep,
    norm_clip: Option<&Tensor>,
) -> CResult<()> {
    use candle_core::Storage;
    fn cuda(s: &Storage) -> CResult<&candle_core::CudaStorage> {
        match s {
            Storage::Cuda(c) => Ok(c),
            _ => Err(Error::msg("adamw: a tensor left the CUDA device")),
        }
    }
    let dev = match params[0].device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => return Err(Error::msg("adamw: not a CUDA device")),
    };
    // Read guards on every storage for the launches (distinct storages, checked by the caller).
    let coef = norm_clip.map(|c| c.narrow(0, 1, 1)).transpose()?;
    let coef_guard = coef.as_ref().map(|c| c.storage_and_layout());
    let coef_part = match &coef_guard {
        Some((g, l)) => Some((cuda(g)?, *l)),
        None => None,
    };
    // Every storage read-locked once for both launches: parameters and moments are distinct
    // (checked by the caller); gradients sharing a buffer read it through one lock, in one
    // decay group or across the two (FSDP's shard gradients of a unit are views of one buffer,
    // its weights decayed and its biases and norms not).
    let shares = shared_storages(grads);
    let guards: Vec<[Option<_>; 4]> = (0..params.len())
        .zip(&shares)
        .map(|(i, sh)| {
            [
                Some(params[i].storage_and_layout().0),
                (*sh == Shared::Own).then(|| grads[i].storage_and_layout().0),
                Some(m[i].storage_and_layout().0),
                Some(v[i].storage_and_layout().0),
            ]
        })
        .collect();
    let mut sets: Vec<[(&candle_core::CudaStorage, &Layout); 4]> = Vec::with_capacity(params.len());
    for (i, gs) in guards.iter().enumerate() {
        let own = |j: usize| -> CResult<&candle_core::CudaStorage> {
            match &gs[j] {
                Some(g) => cuda(g),
                None => Err(Error::msg("adamw: internal: an own storage left unlocked")),
            }
        };
        let grad = match shares[i] {
            Shared::Own => own(1)?,
            Shared::Of(e) => sets[e][1].0,
        };
        sets.push([
            (own(0)?, params[i].layout()),
            (grad, grads[i].layout()),
            (own(2)?, m[i].layout()),
            (own(3)?, v[i].layout()),
        ]);
    }
    let groups: Vec<crate::cuda::AdamWGroup<'_>> = [true, false]
        .into_iter()
        .map(|group| {
            let [beta1, one_beta1, beta2, one_beta2, scale_m, scale_v, dec, eps, lr] =
                step.consts(group);
            let consts = crate::cuda::AdamWConsts {
                beta1,
                one_beta1,
                beta2,
                one_beta2,
                scale_m,
                scale_v,
                decay: dec,
                eps,
                lr,
            };
            let members = (0..params.len())
                .filter(|&i| decay[i] == group)
                .map(|i| sets[i])
                .collect();
            (members, consts)
        })
        .collect();
    crate::cuda::adamw(&dev, &groups, coef_part)
}

#[cfg(not(feature = "cuda"))]
fn adamw_cuda(
    _: &[Tensor],
    _: &[Tensor],
    _: &[Tensor],
    _: &[Tensor],
    _: &[bool],
    _: &AdamWStep,
    _: Option<&Tensor>,
) -> CResult<()> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn seq(n: usize, seed: u32) -> Tensor {
        let v: Vec<f32> = (0..n as u32)
            .map(|i| {
                ((i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 1000) as f32 / 250.0
                    - 2.0
            })
            .collect();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap()
    }

    #[test]
    fn norm_and_coefficient_match_the_composition() {
        let grads = vec![
            seq(7, 1).reshape((7, 1)).unwrap(),
            seq(0, 2),
            seq(1000, 3).reshape((10, 100)).unwrap().t().unwrap(),
            seq(33, 4),
        ];
        let want: f64 = grads
            .iter()
            .map(|g| {
                g.to_dtype(DType::F64)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            })
            .sum::<f64>()
            .sqrt();
        for (max, coef) in [
            (None, 1.0),
            (Some(1e9), 1.0),
            (Some(1.0), 1.0 / (want + 1e-6)),
        ] {
            let r: Vec<f32> = grad_norm_clip(&grads, max).unwrap().to_vec1().unwrap();
            assert!(
                ((r[0] as f64) - want).abs() <= 1e-6 * want,
                "{r:?} vs {want}"
            );
            assert!(((r[1] as f64) - coef).abs() <= 1e-6, "{r:?} vs {coef}");
            let scaled = scale_grads(&grads, &grad_norm_clip(&grads, max).unwrap()).unwrap();
            for (s, g) in scaled.iter().zip(&grads) {
                let d = crate::compare::max_abs_diff(s, &(g * coef).unwrap()).unwrap();
                assert!(d <= 1e-6, "{d}");
            }
        }
    }

    #[test]
    fn tables_pack_back_to_back_and_keep_offsets_bits() {
        let mut t = Tables::default();
        let a = t.addrs(&[7, u64::MAX, 0]);
        let o = t.offsets(&[0, 5, i64::MAX, -1, i64::MIN]);
        let e = t.addrs(&[]);
        let b = t.addrs(&[42]);
        assert_eq!(
            (a.clone(), o.clone(), e.clone(), b.clone()),
            (0..3, 3..8, 8..8, 8..9)
        );
        assert_eq!(t.words().len(), 9);
        assert_eq!(&t.words()[a], &[7, u64::MAX, 0]);
        assert_eq!(&t.words()[b], &[42]);
        // What the kernel reads: the same eight bytes as a `long long`.
        let back: Vec<i64> = t.words()[o]
            .iter()
            .map(|w| i64::from_ne_bytes(w.to_ne_bytes()))
            .collect();
        assert_eq!(back, [0, 5, i64::MAX, -1, i64::MIN]);
    }

    #[test]
    fn refuses_no_gradients() {
        let e = grad_norm_clip(&[], None).unwrap_err();
        assert!(e.to_string().contains("grad_norm: no gradients"), "{e}");
        assert_eq!(clip_coefficient(3.0, Some(0.0)), 1.0);
        assert_eq!(clip_coefficient(3.0, None), 1.0);
    }
}
