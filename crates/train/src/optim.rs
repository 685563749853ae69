//! AdamW with candle-nn 0.11.1's exact arithmetic, in one fused pass per variable, and with
//! its state (step count, first and second moments) readable and writable for checkpoints.
//!
//! candle-nn's `AdamW` computes the update with nine tensor ops per variable (each a pass over
//! memory and a fresh allocation) and keeps its moments private. [`AdamW`] performs the same
//! f32 / f64 operations, in the same order and with the same constants, element by element in
//! one pass that updates the parameter and both moments in place: the results are bitwise
//! identical (tested). f32 variables on a CUDA device are updated together, one kernel launch
//! per decay group with the same element-wise arithmetic (`kernels::multi_tensor::adamw_step`;
//! `CDT_FUSED_CUDA=0` turns it off); variables of other floating dtypes (bf16, f16), and CUDA
//! variables the kernel refuses, take candle-nn's tensor path verbatim.
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{Device, Tensor, Var};
//! use candle_dtensor::train::optim::AdamW;
//! use candle_nn::{Optimizer, ParamsAdamW};
//!
//! let w = Var::new(&[1.0f32, -2.0], &Device::Cpu)?;
//! let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
//! let loss = w.as_tensor().sqr()?.sum_all()?;
//! opt.backward_step(&loss)?;
//! let (m, v) = opt.moments(&w)?.expect("w is optimized");
//! assert_eq!(opt.step_count(), 1);
//! assert_eq!(m.dims(), w.dims());
//! # let _ = v;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::ops::{Add, Div, Mul, Sub};

use candle_core::backprop::GradStore;
use candle_core::{DType, Error, Result, Tensor, TensorId, Var};
use candle_dtensor_kernels::multi_tensor::{adamw_step, AdamWStep};
use candle_dtensor_kernels::storage::{update_with, Elem as StorageElem};
use candle_nn::{Optimizer, ParamsAdamW};

/// The moments of one variable.
enum Moments {
    F32 {
        m: Vec<f32>,
        v: Vec<f32>,
    },
    F64 {
        m: Vec<f64>,
        v: Vec<f64>,
    },
    /// Other float dtypes: candle-nn's tensor ops verbatim.
    Tensors {
        m: Var,
        v: Var,
    },
}

struct VarState {
    var: Var,
    moments: Moments,
    /// Whether weight decay applies to this variable ([`AdamW::set_decay`]).
    decay: bool,
}

/// AdamW (decoupled weight decay) with candle-nn's exact math and accessible state; see the
/// module docs.
pub struct AdamW {
    vars: Vec<VarState>,
    index: HashMap<TensorId, usize>,
    step_t: usize,
    params: ParamsAdamW,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("vars", &self.vars.len())
            .field("step_t", &self.step_t)
            .field("params", &self.params)
            .finish()
    }
}

/// The per-step constants, in f64 as candle-nn computes them.
#[derive(Clone, Copy)]
struct Consts {
    beta1: f64,
    beta2: f64,
    scale_m: f64,
    scale_v: f64,
    decay: f64,
    eps: f64,
    lr: f64,
}

/// An element type of the fused kernel. `cast` is candle's `WithDType::from_f64` (`as`).
trait Elem:
    StorageElem
    + Copy
    + Mul<Output = Self>
    + Add<Output = Self>
    + Sub<Output = Self>
    + Div<Output = Self>
{
    fn cast(v: f64) -> Self;
    fn sqrt(self) -> Self;
}

impl Elem for f32 {
    fn cast(v: f64) -> Self {
        v as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Elem for f64 {
    fn cast(v: f64) -> Self {
        v
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// One AdamW update of `theta`, `m`, `v` from `g`, element by element. Each line is one of
/// candle-nn's tensor ops on one element: `t * c` and `t + c` are candle's
/// `affine(mul, add)`, i.e. `x * T::from_f64(mul) + T::from_f64(add)`, so the `+ zero` terms
/// are kept (they turn -0.0 into +0.0 exactly as candle does).
///
/// `scale`: a clip coefficient multiplying each gradient element first, as clipping's
/// `g.broadcast_mul(coefficient)` in the gradient's dtype did before the update (same bits).
fn update<T: Elem>(
    theta: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    c: Consts,
    scale: Option<f64>,
) {
    let zero = T::cast(0.0);
    let scale = scale.map(T::cast);
    let one = T::cast(1.0);
    let b1 = T::cast(c.beta1);
    let one_b1 = T::cast(1.0 - c.beta1);
    let b2 = T::cast(c.beta2);
    let one_b2 = T::cast(1.0 - c.beta2);
    let sm = T::cast(c.scale_m);
    let sv = T::cast(c.scale_v);
    let decay = T::cast(c.decay);
    let eps = T::cast(c.eps);
    let lr = T::cast(c.lr);
    for (((th, &gi), mi), vi) in theta.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let gi = scale.map_or(gi, |s| gi * s);
        // next_m = (m * beta1) + (g * (1 - beta1))
        let next_m = (*mi * b1 + zero) + (gi * one_b1 + zero);
        // next_v = (v * beta2) + (g.sqr() * (1 - beta2))
        let next_v = (*vi * b2 + zero) + ((gi * gi) * one_b2 + zero);
        // m_hat = next_m * scale_m; v_hat = next_v * scale_v
        let m_hat = next_m * sm + zero;
        let v_hat = next_v * sv + zero;
        // next_theta = theta * (1 - lr * lambda)
        let decayed = *th * decay + zero;
        // adjusted = m_hat / (v_hat.sqrt() + eps)
        let adjusted = m_hat / (v_hat.sqrt() * one + eps);
        // next_theta = next_theta - adjusted * lr
        *th = decayed - (adjusted * lr + zero);
        *mi = next_m;
        *vi = next_v;
    }
}

/// The fused update, in place on the parameter's storage, reading the gradient (CPU).
fn step_fused<T: Elem>(
    var: &Var,
    g: &Tensor,
    m: &mut [T],
    v: &mut [T],
    consts: Consts,
    scale: Option<f64>,
) -> Result<()> {
    update_with::<T>(var.as_tensor(), g, |theta, g| {
        if g.len() != theta.len() || m.len() != theta.len() || v.len() != theta.len() {
            return Err(Error::msg(format!(
                "adamw: parameter of {} elements, gradient {}, moments {} / {}",
                theta.len(),
                g.len(),
                m.len(),
                v.len()
            )));
        }
        update(theta, g, m, v, consts, scale);
        Ok(())
    })
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    /// Zero moments for every floating-point var (others are skipped, as candle-nn does).
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let mut states = Vec::with_capacity(vars.len());
        for var in vars.into_iter().filter(|v| v.dtype().is_float()) {
            let n = var.elem_count();
            let moments = match var.dtype() {
                DType::F32 if var.device().is_cpu() => Moments::F32 {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                },
                DType::F64 if var.device().is_cpu() => Moments::F64 {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                },
                dtype => Moments::Tensors {
                    m: Var::zeros(var.shape(), dtype, var.device())?,
                    v: Var::zeros(var.shape(), dtype, var.device())?,
                },
            };
            states.push(VarState {
                var,
                moments,
                decay: true,
            });
        }
        let index = states
            .iter()
            .enumerate()
            .map(|(i, s)| (s.var.as_tensor().id(), i))
            .collect();
        Ok(AdamW {
            vars: states,
            index,
            step_t: 0,
            params,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_clipped(grads, None)
    }
}

impl AdamW {
    /// [`Optimizer::step`] with gradient clipping fused into the update: `clip`, the clip
    /// coefficient (an f64 `[1]` tensor on the parameters' device, computed there), multiplies
    /// every gradient as the update reads it, instead of a scaled copy of every gradient made
    /// before. The results are the bits of scaling first (`g * coefficient` in the gradient's
    /// dtype, then the update). CUDA f32 parameters: the one-launch kernel reads the
    /// coefficient on the device (no host read, no pass over the gradients); CPU f32 / f64:
    /// inside the element loop (the coefficient read from host memory); other dtypes scale
    /// each gradient first.
    ///
    /// # Errors
    ///
    /// A gradient whose shape is not its parameter's, a coefficient that is not one element,
    /// a failed op.
    pub fn step_clipped(&mut self, grads: &GradStore, clip: Option<&Tensor>) -> Result<()> {
        if let Some(c) = clip {
            if c.elem_count() != 1 {
                return Err(Error::msg(format!(
                    "adamw: a clip coefficient of shape {:?} (one element)",
                    c.dims()
                )));
            }
        }
        self.step_t += 1;
        let p = &self.params;
        let t = self.step_t as i32;
        let consts = Consts {
            beta1: p.beta1,
            beta2: p.beta2,
            scale_m: 1f64 / (1f64 - p.beta1.powi(t)),
            scale_v: 1f64 / (1f64 - p.beta2.powi(t)),
            decay: 1f64 - p.lr * p.weight_decay,
            eps: p.eps,
            lr: p.lr,
        };
        let no_decay = Consts {
            decay: 1.0,
            ..consts
        };
        let fused = self.step_cuda_fused(grads, clip)?;
        let p = &self.params;
        // The coefficient where the CPU loop reads it, once.
        let mut host_scale: Option<f64> = None;
        for (i, s) in self.vars.iter_mut().enumerate() {
            if fused.contains(&i) {
                continue;
            }
            let Some(g) = grads.get(&s.var) else {
                continue;
            };
            // A variable without decay takes candle-nn's arithmetic with weight_decay = 0
            // (theta * (1 - lr * 0)), so it matches a second parameter group exactly.
            let consts = if s.decay { consts } else { no_decay };
            if g.dims() != s.var.dims() {
                return Err(Error::msg(format!(
                    "adamw: gradient of shape {:?} for a parameter of shape {:?}",
                    g.dims(),
                    s.var.dims()
                )));
            }
            if s.var.elem_count() == 0 {
                continue;
            }
            let contiguous;
            let g = if g.is_contiguous() {
                g
            } else {
                contiguous = g.contiguous()?;
                &contiguous
            };
            let scale = match (clip, &s.moments) {
                (Some(c), Moments::F32 { .. } | Moments::F64 { .. }) => match host_scale {
                    Some(f) => Some(f),
                    None => {
                        let f = c.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
                        host_scale = Some(f);
                        Some(f)
                    }
                },
                _ => None,
            };
            let scaled;
            let g = match (clip, &s.moments) {
                (Some(c), Moments::Tensors { .. }) => {
                    scaled = g.broadcast_mul(&c.reshape(())?.to_dtype(g.dtype())?)?;
                    &scaled
                }
                _ => g,
            };
            match &mut s.moments {
                Moments::F32 { m, v } => step_fused(&s.var, g, m, v, consts, scale)?,
                Moments::F64 { m, v } => step_fused(&s.var, g, m, v, consts, scale)?,
                Moments::Tensors { m, v } => {
                    // candle-nn 0.11.1's AdamW::step, verbatim.
                    let (beta1, beta2, lr) = (p.beta1, p.beta2, p.lr);
                    let theta = &s.var;
                    let next_m = ((m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
                    let next_v = ((v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let m_hat = (&next_m * consts.scale_m)?;
                    let v_hat = (&next_v * consts.scale_v)?;
                    let next_theta = (theta.as_tensor() * consts.decay)?;
                    let adjusted_grad = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
                    let next_theta = (next_theta - (adjusted_grad * lr)?)?;
                    m.set(&next_m)?;
                    v.set(&next_v)?;
                    theta.set(&next_theta)?;
                }
            }
        }
        Ok(())
    }

    /// The f32 variables on a CUDA device, all updated by one launch per decay group
    /// (`kernels::multi_tensor::adamw_step`: the CPU path's arithmetic, element by element, no
    /// host read) instead of candle-nn's nine tensor ops each. Returns the indices it updated
    /// (none when the fused CUDA path is off, `CDT_FUSED_CUDA=0`, or the kernel refuses the
    /// set, e.g. a gradient sharing a parameter's storage: those then take the per-variable
    /// path; gradients that are views of one buffer are accepted).
    /// `clip`: the clip coefficient (f64 `[1]`), read by the kernel on the device.
    fn step_cuda_fused(&self, grads: &GradStore, clip: Option<&Tensor>) -> Result<Vec<usize>> {
        if !candle_dtensor_kernels::fused::cuda_enabled() {
            return Ok(Vec::new());
        }
        let mut picked = Vec::new();
        let (mut params, mut gs, mut ms, mut vs, mut decay) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, s) in self.vars.iter().enumerate() {
            let Moments::Tensors { m, v } = &s.moments else {
                continue;
            };
            let Some(g) = grads.get(&s.var) else {
                continue;
            };
            if s.var.dtype() != DType::F32
                || !s.var.device().is_cuda()
                || s.var.elem_count() == 0
                || g.dims() != s.var.dims()
            {
                continue;
            }
            picked.push(i);
            params.push(s.var.as_tensor().clone());
            gs.push(g.clone());
            ms.push(m.as_tensor().clone());
            vs.push(v.as_tensor().clone());
            decay.push(s.decay);
        }
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let p = &self.params;
        let step = AdamWStep {
            lr: p.lr,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            weight_decay: p.weight_decay,
            t: self.step_t,
        };
        // The kernel reads the coefficient as element 1 of `[norm, coefficient]` (f32,
        // `multi_tensor::grad_norm_clip`'s form); element 0 is not read.
        let norm_clip = match clip {
            Some(c) => {
                let c = c.reshape(1)?.to_dtype(DType::F32)?;
                Some(Tensor::cat(&[&c, &c], 0)?)
            }
            None => None,
        };
        // One call per decay group (one launch each), so that an error tells exactly which
        // variables were not updated: a call that fails updated none of its own (its checks
        // and uploads come before its launch), and those take the per-variable path. One call
        // for both groups could fail in the second group's launch after the first group's
        // had run, and the per-variable path would then step the first group twice.
        let mut done = Vec::with_capacity(picked.len());
        for group in [true, false] {
            let sel: Vec<usize> = (0..picked.len()).filter(|&j| decay[j] == group).collect();
            if sel.is_empty() {
                continue;
            }
            let take =
                |ts: &[Tensor]| -> Vec<Tensor> { sel.iter().map(|&j| ts[j].clone()).collect() };
            let flags = vec![group; sel.len()];
            let r = adamw_step(
                &take(&params),
                &take(&gs),
                &take(&ms),
                &take(&vs),
                &flags,
                &step,
                norm_clip.as_ref(),
            );
            match r {
                Ok(()) => done.extend(sel.iter().map(|&j| picked[j])),
                Err(e) => tracing::debug!(
                    error = %e,
                    decay = group,
                    "adamw: the one-launch CUDA step refused this group; it takes the \
                     per-variable path"
                ),
            }
        }
        Ok(done)
    }

    /// AdamW with candle-nn's default hyper-parameters and learning rate `lr`.
    ///
    /// # Errors
    ///
    /// A failed allocation of the moments.
    pub fn new_lr(vars: Vec<Var>, lr: f64) -> Result<Self> {
        Self::new(
            vars,
            ParamsAdamW {
                lr,
                ..ParamsAdamW::default()
            },
        )
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Replaces the hyper-parameters.
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// Steps taken so far (the `t` of the bias corrections).
    pub fn step_count(&self) -> usize {
        self.step_t
    }

    /// Sets the step count (restoring a checkpoint).
    pub fn set_step_count(&mut self, t: usize) {
        self.step_t = t;
    }

    /// The optimized variables, in the order given to [`Optimizer::new`].
    pub fn vars(&self) -> Vec<Var> {
        self.vars.iter().map(|s| s.var.clone()).collect()
    }

    /// Turns weight decay on or off for `var` (on for every variable at construction): the
    /// second parameter group of nanoGPT-style recipes (no decay for norms, biases and
    /// embeddings; see [`crate::schedule::WeightDecay`]). Returns whether `var` is optimized
    /// here.
    pub fn set_decay(&mut self, var: &Var, decay: bool) -> bool {
        match self.index.get(&var.as_tensor().id()) {
            Some(&i) => {
                self.vars[i].decay = decay;
                true
            }
            None => false,
        }
    }

    /// Whether `var` is decayed (`None` if it is not optimized here).
    pub fn decays(&self, var: &Var) -> Option<bool> {
        self.index
            .get(&var.as_tensor().id())
            .map(|&i| self.vars[i].decay)
    }

    /// Whether `var` is optimized by this instance.
    pub fn contains(&self, var: &Var) -> bool {
        self.index.contains_key(&var.as_tensor().id())
    }

    /// Copies of `var`'s first and second moments (`exp_avg`, `exp_avg_sq`), shaped and typed
    /// like `var`; `None` if `var` is not optimized here.
    ///
    /// # Errors
    ///
    /// A failed copy.
    pub fn moments(&self, var: &Var) -> Result<Option<(Tensor, Tensor)>> {
        let Some(&i) = self.index.get(&var.as_tensor().id()) else {
            return Ok(None);
        };
        let s = &self.vars[i];
        let shape = s.var.shape();
        let dev = s.var.device();
        Ok(Some(match &s.moments {
            Moments::F32 { m, v } => (
                Tensor::from_slice(m, shape, dev)?,
                Tensor::from_slice(v, shape, dev)?,
            ),
            Moments::F64 { m, v } => (
                Tensor::from_slice(m, shape, dev)?,
                Tensor::from_slice(v, shape, dev)?,
            ),
            Moments::Tensors { m, v } => (m.as_tensor().copy()?, v.as_tensor().copy()?),
        }))
    }

    /// Replaces `var`'s moments by `m` and `v` (shaped and typed like `var`).
    ///
    /// # Errors
    ///
    /// `var` is not optimized here, or `m` / `v` have another shape or dtype.
    pub fn set_moments(&mut self, var: &Var, m: &Tensor, v: &Tensor) -> Result<()> {
        let Some(&i) = self.index.get(&var.as_tensor().id()) else {
            return Err(Error::msg(
                "adamw: set_moments on a variable this optimizer does not hold",
            ));
        };
        let s = &mut self.vars[i];
        for t in [m, v] {
            if t.dims() != s.var.dims() || t.dtype() != s.var.dtype() {
                return Err(Error::msg(format!(
                    "adamw: moments of shape {:?} {:?} for a parameter of shape {:?} {:?}",
                    t.dims(),
                    t.dtype(),
                    s.var.dims(),
                    s.var.dtype()
                )));
            }
        }
        match &mut s.moments {
            Moments::F32 { m: dm, v: dv } => {
                *dm = m.flatten_all()?.to_vec1()?;
                *dv = v.flatten_all()?.to_vec1()?;
            }
            Moments::F64 { m: dm, v: dv } => {
                *dm = m.flatten_all()?.to_vec1()?;
                *dv = v.flatten_all()?.to_vec1()?;
            }
            Moments::Tensors { m: dm, v: dv } => {
                dm.set(m)?;
                dv.set(v)?;
            }
        }
        Ok(())
    }

    /// Bytes held by the moments.
    pub fn state_bytes(&self) -> usize {
        self.vars
            .iter()
            .map(|s| 2 * s.var.elem_count() * s.var.dtype().size_in_bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Deterministic pseudo-random values in [-scale, scale), some exactly zero or negative zero.
    fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|i| {
                let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                match z % 17 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale,
                }
            })
            .collect()
    }

    fn tensor(dims: &[usize], seed: u64, scale: f64, dtype: DType) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_vec(values(n, seed, scale), dims, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// An empty `GradStore` (candle has no public constructor): the grads of a throwaway var,
    /// removed.
    fn empty_grads() -> GradStore {
        let v = Var::zeros(1, DType::F32, &Device::Cpu).unwrap();
        let mut g = v.as_tensor().sum_all().unwrap().backward().unwrap();
        g.remove(v.as_tensor());
        g
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            DType::F32 => t
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| u64::from(x.to_bits()))
                .collect(),
            _ => t
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        }
    }

    /// N steps of ours and of candle-nn's AdamW on identical vars and gradients give bitwise
    /// identical parameters: several shapes (a scalar too), f32 / f64 / bf16, a var without a
    /// gradient in some steps, a non-contiguous gradient, gradients with exact (negative)
    /// zeros, and non-default hyper-parameters. (candle-nn cannot step an empty var; ours
    /// skips it, tested below.)
    #[test]
    fn bitwise_equal_to_candle_nn() {
        let specs: Vec<(Vec<usize>, DType)> = vec![
            (vec![37, 13], DType::F32),
            (vec![64], DType::F32),
            (vec![5, 6], DType::F64),
            (vec![8, 3], DType::BF16),
            (vec![], DType::F32),
        ];
        for params in [
            ParamsAdamW::default(),
            ParamsAdamW {
                lr: 3e-2,
                beta1: 0.8,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.1,
            },
        ] {
            let init: Vec<Tensor> = specs
                .iter()
                .enumerate()
                .map(|(i, (d, t))| tensor(d, 100 + i as u64, 1.0, *t))
                .collect();
            let ours_vars: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let ref_vars: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let mut ours = AdamW::new(ours_vars.clone(), params.clone()).unwrap();
            let mut reference = candle_nn::AdamW::new(ref_vars.clone(), params.clone()).unwrap();
            for step in 0..25u64 {
                let mut g_ours = empty_grads();
                let mut g_ref = empty_grads();
                for (i, (d, t)) in specs.iter().enumerate() {
                    // Var 1 has no gradient every third step.
                    if i == 1 && step % 3 == 2 {
                        continue;
                    }
                    let scale = if step % 5 == 0 { 1e3 } else { 1e-2 };
                    let g = if i == 0 {
                        // A transposed (non-contiguous) gradient.
                        tensor(&[d[1], d[0]], step * 31 + i as u64, scale, *t)
                            .t()
                            .unwrap()
                    } else {
                        tensor(d, step * 31 + i as u64, scale, *t)
                    };
                    g_ours.insert(ours_vars[i].as_tensor(), g.clone());
                    g_ref.insert(ref_vars[i].as_tensor(), g);
                }
                ours.step(&g_ours).unwrap();
                reference.step(&g_ref).unwrap();
            }
            assert_eq!(ours.step_count(), 25);
            for (i, (a, b)) in ours_vars.iter().zip(&ref_vars).enumerate() {
                assert_eq!(
                    bits(a.as_tensor()),
                    bits(b.as_tensor()),
                    "var {i} {:?} differs from candle-nn",
                    specs[i]
                );
                assert_ne!(bits(a.as_tensor()), bits(&init[i]), "var {i} did not move");
            }
        }
    }

    #[test]
    fn empty_var_is_skipped() {
        let e = Var::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![e.clone()], ParamsAdamW::default()).unwrap();
        let mut g = empty_grads();
        g.insert(
            e.as_tensor(),
            Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap(),
        );
        opt.step(&g).unwrap();
        let (m, _) = opt.moments(&e).unwrap().unwrap();
        assert_eq!(m.dims(), &[0, 4]);
    }

    #[test]
    fn moments_round_trip_and_resume() {
        let p = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let w0 = tensor(&[4, 5], 1, 1.0, DType::F32);
        let a = Var::from_tensor(&w0).unwrap();
        let mut opt_a = AdamW::new(vec![a.clone()], p.clone()).unwrap();
        let grad = |s: u64| tensor(&[4, 5], 50 + s, 1.0, DType::F32);
        let step = |opt: &mut AdamW, v: &Var, s: u64| {
            let mut g = empty_grads();
            g.insert(v.as_tensor(), grad(s));
            opt.step(&g).unwrap();
        };
        for s in 0..3 {
            step(&mut opt_a, &a, s);
        }
        // Restore into a fresh optimizer over a copy and continue both.
        let b = Var::from_tensor(&a.as_tensor().copy().unwrap()).unwrap();
        let mut opt_b = AdamW::new(vec![b.clone()], p).unwrap();
        let (m, v) = opt_a.moments(&a).unwrap().unwrap();
        assert!(
            m.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
        opt_b.set_moments(&b, &m, &v).unwrap();
        opt_b.set_step_count(opt_a.step_count());
        for s in 3..6 {
            step(&mut opt_a, &a, s);
            step(&mut opt_b, &b, s);
        }
        assert_eq!(bits(a.as_tensor()), bits(b.as_tensor()));
        // Wrong shapes and unknown vars are errors.
        let bad = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(opt_b.set_moments(&b, &bad, &bad).is_err());
        let other = Var::zeros((4, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(opt_b.set_moments(&other, &m, &v).is_err());
        assert!(opt_b.moments(&other).unwrap().is_none());
    }

    /// Two parameter groups in one optimizer: a var with decay turned off steps exactly as
    /// candle-nn's AdamW with `weight_decay = 0`, the others exactly as with the decay (f32 on
    /// the fused path, bf16 on the tensor path).
    #[test]
    fn decay_off_matches_a_group_without_decay() {
        let params = ParamsAdamW {
            lr: 3e-2,
            weight_decay: 0.1,
            ..ParamsAdamW::default()
        };
        let no_wd = ParamsAdamW {
            weight_decay: 0.0,
            ..params.clone()
        };
        for dtype in [DType::F32, DType::BF16] {
            let init = [tensor(&[7, 3], 1, 1.0, dtype), tensor(&[9], 2, 1.0, dtype)];
            let ours: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let with_wd = Var::from_tensor(&init[0]).unwrap();
            let without_wd = Var::from_tensor(&init[1]).unwrap();
            let mut opt = AdamW::new(ours.clone(), params.clone()).unwrap();
            assert!(opt.set_decay(&ours[1], false));
            assert_eq!(opt.decays(&ours[0]), Some(true));
            assert_eq!(opt.decays(&ours[1]), Some(false));
            assert!(!opt.set_decay(&with_wd, false), "not optimized here");
            let mut ref_a = candle_nn::AdamW::new(vec![with_wd.clone()], params.clone()).unwrap();
            let mut ref_b = candle_nn::AdamW::new(vec![without_wd.clone()], no_wd.clone()).unwrap();
            for step in 0..6u64 {
                let (ga, gb) = (
                    tensor(&[7, 3], 10 + step, 0.5, dtype),
                    tensor(&[9], 20 + step, 0.5, dtype),
                );
                let mut g = empty_grads();
                g.insert(ours[0].as_tensor(), ga.clone());
                g.insert(ours[1].as_tensor(), gb.clone());
                opt.step(&g).unwrap();
                let mut g = empty_grads();
                g.insert(with_wd.as_tensor(), ga);
                ref_a.step(&g).unwrap();
                let mut g = empty_grads();
                g.insert(without_wd.as_tensor(), gb);
                ref_b.step(&g).unwrap();
            }
            assert_eq!(
                bits(ours[0].as_tensor()),
                bits(with_wd.as_tensor()),
                "{dtype:?}"
            );
            assert_eq!(
                bits(ours[1].as_tensor()),
                bits(without_wd.as_tensor()),
                "{dtype:?}"
            );
            // And the decay mattered: the decayed var differs from a run without decay.
            let plain = Var::from_tensor(&init[0]).unwrap();
            let mut ref_c = candle_nn::AdamW::new(vec![plain.clone()], no_wd.clone()).unwrap();
            for step in 0..6u64 {
                let mut g = empty_grads();
                g.insert(plain.as_tensor(), tensor(&[7, 3], 10 + step, 0.5, dtype));
                ref_c.step(&g).unwrap();
            }
            assert_ne!(
                bits(ours[0].as_tensor()),
                bits(plain.as_tensor()),
                "{dtype:?}"
            );
        }
    }

    /// `step_clipped` with a coefficient gives the bits of multiplying every gradient by it
    /// first (clipping's `broadcast_mul` in the gradient's dtype) and stepping: f32 and f64
    /// (the coefficient inside the CPU loop), bf16 (the tensor path), a transposed gradient,
    /// coefficients below and at 1. Fails if the coefficient is dropped or applied twice.
    #[test]
    fn a_fused_clip_coefficient_is_clipping_first() {
        let specs: Vec<(Vec<usize>, DType)> = vec![
            (vec![37, 13], DType::F32),
            (vec![5, 6], DType::F64),
            (vec![8, 3], DType::BF16),
        ];
        let init: Vec<Tensor> = specs
            .iter()
            .enumerate()
            .map(|(i, (d, t))| tensor(d, 300 + i as u64, 1.0, *t))
            .collect();
        let fused_vars: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let first_vars: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let params = ParamsAdamW {
            weight_decay: 0.1,
            ..ParamsAdamW::default()
        };
        let mut fused = AdamW::new(fused_vars.clone(), params.clone()).unwrap();
        let mut first = AdamW::new(first_vars.clone(), params).unwrap();
        for (step, coef) in [0.37f64, 1.0, 0.0123, 0.9].into_iter().enumerate() {
            let c = Tensor::new(&[coef], &Device::Cpu).unwrap();
            let (mut g_fused, mut g_first) = (empty_grads(), empty_grads());
            for (i, (d, t)) in specs.iter().enumerate() {
                let g = if i == 0 {
                    tensor(&[d[1], d[0]], 40 + step as u64 * 7, 3.0, *t)
                        .t()
                        .unwrap()
                } else {
                    tensor(d, 40 + step as u64 * 7 + i as u64, 3.0, *t)
                };
                let scaled = g
                    .broadcast_mul(&c.reshape(()).unwrap().to_dtype(*t).unwrap())
                    .unwrap();
                g_fused.insert(fused_vars[i].as_tensor(), g);
                g_first.insert(first_vars[i].as_tensor(), scaled);
            }
            fused.step_clipped(&g_fused, Some(&c)).unwrap();
            first.step(&g_first).unwrap();
            for (i, (a, b)) in fused_vars.iter().zip(&first_vars).enumerate() {
                assert_eq!(
                    bits(a.as_tensor()),
                    bits(b.as_tensor()),
                    "var {i} step {step}"
                );
            }
        }
        let bad = Tensor::new(&[1f64, 1.0], &Device::Cpu).unwrap();
        assert!(fused.step_clipped(&empty_grads(), Some(&bad)).is_err());
    }
}
