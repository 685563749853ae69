//! Differentiable drop-ins for the candle-nn modules and ops that cut the autograd graph.
//!
//! candle-nn 0.11's fused `ops::rms_norm`, `ops::layer_norm`, `ops::softmax_last_dim` and
//! `rotary_emb::{rope, rope_i}` are built with `apply_op*_no_bwd`: no gradient flows through
//! them, and nothing says so (candle#2168, #3011). `RmsNorm::forward` and
//! `LayerNorm::forward` take those paths on contiguous input, so a model built with them (every
//! candle-transformers LLM) trains only what lies after its last norm. The items here have the
//! same signatures, names and parameters, and a backward:
//!
//! | here | replaces | computes with |
//! |---|---|---|
//! | [`RmsNorm`], [`rms_norm`] | `candle_nn::RmsNorm`, `candle_nn::rms_norm` | [`ops::rms_norm`] |
//! | [`LayerNorm`], [`layer_norm`] | `candle_nn::LayerNorm`, `candle_nn::layer_norm` | [`ops::layer_norm`] (or [`ops::rms_norm`] without `remove_mean`) |
//! | [`ops::rms_norm`], [`ops::layer_norm`], [`ops::softmax_last_dim`] | `candle_nn::ops::*` | the fused f32 CPU kernels with hand-written backward passes (`candle_dtensor_kernels::autodiff`); candle-nn's differentiable `*_slow` compositions for other dtypes and devices |
//! | [`rotary_emb::rope`], [`rotary_emb::rope_i`] | `candle_nn::rotary_emb::*` | candle primitives (as `rope_slow` / `rope_i_slow`, also for per-batch `cos`/`sin`) |
//!
//! A model of one's own switches by importing these instead (`use candle_dtensor::nn::{...}`);
//! parameters keep their names, so checkpoints and [`candle_dtensor_parallel::fsdp_vb::FsdpVarMap`] units are
//! unchanged. A candle-transformers model cannot be switched without editing its source: under
//! FSDP its cut parameters get no gradient, exactly as on one device, and
//! [`candle_dtensor_parallel::fsdp::Fsdp::params_without_grad`] names them.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_dtensor_kernels::autodiff as knn;
use candle_nn::{Init, LayerNormConfig, VarBuilder};

/// Whether the fused kernels (f32, CPU) take `x`; other dtypes follow candle-nn's own
/// differentiable compositions (which normalise half-precision input in f32).
fn fused(x: &Tensor, w: &Tensor) -> bool {
    x.dtype() == DType::F32 && w.dtype() == DType::F32 && x.device().is_cpu()
}

/// The drop-ins for `candle_nn::ops`.
pub mod ops {
    use super::*;

    /// `candle_nn::ops::rms_norm`, differentiable: `x / sqrt(mean(x^2) + eps) * alpha` over
    /// the last dim.
    ///
    /// # Errors
    ///
    /// `alpha` not of the last dim's size, or a candle error.
    pub fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
        check_affine("rms-norm", xs, alpha, None)?;
        if fused(xs, alpha) {
            return knn::rms_norm_local(xs, alpha, f64::from(eps));
        }
        candle_nn::ops::rms_norm_slow(xs, alpha, eps)
    }

    /// `candle_nn::ops::layer_norm`, differentiable: `(x - mean) / sqrt(var + eps) * alpha +
    /// beta` over the last dim.
    ///
    /// # Errors
    ///
    /// `alpha` or `beta` not of the last dim's size, or a candle error.
    pub fn layer_norm(xs: &Tensor, alpha: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
        check_affine("layer-norm", xs, alpha, Some(beta))?;
        layer_norm_opt(xs, alpha, Some(beta), eps)
    }

    /// Layer norm with an optional bias.
    pub(super) fn layer_norm_opt(
        xs: &Tensor,
        alpha: &Tensor,
        beta: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        if fused(xs, alpha) && beta.is_none_or(|b| b.dtype() == DType::F32) {
            return knn::layer_norm_local(xs, Some(alpha), beta, f64::from(eps));
        }
        match beta {
            Some(b) => candle_nn::ops::layer_norm_slow(xs, alpha, b, eps),
            None => candle_nn::ops::layer_norm_slow(xs, alpha, &alpha.zeros_like()?.detach(), eps),
        }
    }

    /// `candle_nn::ops::softmax_last_dim`, differentiable.
    ///
    /// # Errors
    ///
    /// A scalar input, or a candle error.
    pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
        if xs.rank() == 0 {
            candle_core::bail!("softmax-last-dim: a scalar has no last dim");
        }
        if xs.dtype() == DType::F32 && xs.device().is_cpu() {
            return knn::softmax_local(xs, xs.rank() - 1);
        }
        candle_nn::ops::softmax(xs, D::Minus1)
    }

    pub(super) fn check_affine(
        op: &str,
        xs: &Tensor,
        alpha: &Tensor,
        beta: Option<&Tensor>,
    ) -> Result<()> {
        let hidden = xs.dim(D::Minus1)?;
        let beta_ok = match beta {
            Some(b) => b.dims1()? == hidden,
            None => true,
        };
        let ok = alpha.dims1()? == hidden && beta_ok;
        if !ok {
            candle_core::bail!(
                "shape mismatch in {op}: src {:?} alpha {:?} beta {:?}",
                xs.shape(),
                alpha.shape(),
                beta.map(Tensor::shape)
            );
        }
        Ok(())
    }
}

/// The drop-ins for `candle_nn::rotary_emb`.
pub mod rotary_emb {
    use super::*;

    /// `cos`/`sin` of `[T', D/2]` or `[B, T', D/2]` for `x [B, H, T, D]` (`T <= T'`), as
    /// `[B or 1, 1, T, D/2]`.
    fn table(x: &Tensor, cs: &Tensor, what: &str) -> Result<Tensor> {
        let (b, _h, t, d) = x.dims4()?;
        let cs = match cs.rank() {
            2 => cs.unsqueeze(0)?,
            3 if cs.dim(0)? == b => cs.clone(),
            _ => candle_core::bail!(
                "rope: {what} has to be [T, D/2] or [{b}, T, D/2], got {:?}",
                cs.shape()
            ),
        };
        if cs.dim(2)? * 2 != d || cs.dim(1)? < t {
            candle_core::bail!(
                "inconsistent last dim size in rope {:?} {what} {:?}",
                x.shape(),
                cs.shape()
            );
        }
        cs.narrow(1, 0, t)?.unsqueeze(1)
    }

    /// `candle_nn::rotary_emb::rope` (the halves of the last dim rotated), differentiable.
    ///
    /// # Errors
    ///
    /// Shapes as candle-nn's `rope` takes them, or a candle error.
    pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (cos, sin) = (table(xs, cos, "cos")?, table(xs, sin, "sin")?);
        let cos = Tensor::cat(&[&cos, &cos], D::Minus1)?;
        let sin = Tensor::cat(&[&sin, &sin], D::Minus1)?;
        let half = xs.dim(D::Minus1)? / 2;
        let x1 = xs.narrow(D::Minus1, 0, half)?;
        let x2 = xs.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        xs.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
    }

    /// `candle_nn::rotary_emb::rope_i` (interleaved pairs rotated), differentiable.
    ///
    /// # Errors
    ///
    /// Shapes as candle-nn's `rope_i` takes them, or a candle error.
    pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, h, t, d) = xs.dims4()?;
        let (cos, sin) = (
            table(xs, cos, "cos")?.unsqueeze(D::Minus1)?,
            table(xs, sin, "sin")?.unsqueeze(D::Minus1)?,
        );
        let x = xs.reshape((b, h, t, d / 2, 2))?;
        let x0 = x.narrow(D::Minus1, 0, 1)?;
        let x1 = x.narrow(D::Minus1, 1, 1)?;
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Tensor::cat(&[y0, y1], D::Minus1)?.flatten_from(D::Minus2)
    }
}

/// `candle_nn::LayerNorm` with a backward; see the module docs.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// Layer norm with a weight and a bias.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }

    /// Layer norm with a weight only.
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }

    /// RMS norm (no mean removed).
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: false,
            eps,
        }
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The epsilon.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is removed (layer norm) or not (RMS norm).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let eps = self.eps as f32;
        match (&self.bias, self.remove_mean) {
            (b, true) => {
                ops::check_affine("layer-norm", x, &self.weight, b.as_ref())?;
                ops::layer_norm_opt(x, &self.weight, b.as_ref(), eps)
            }
            (b, false) => {
                let y = ops::rms_norm(x, &self.weight, eps)?;
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
}

/// `candle_nn::layer_norm(size, config, vb)`: `weight` (ones) and, when `config.affine`,
/// `bias` (zeros), read under candle-nn's names (`gamma`/`beta` when the `VarBuilder` has
/// those).
///
/// # Errors
///
/// The `VarBuilder`'s error.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    let config = config.into();
    let name = |a: &'static str, b: &'static str| {
        if !vb.contains_tensor(a) && vb.contains_tensor(b) {
            b
        } else {
            a
        }
    };
    let weight = vb.get_with_hints(size, name("weight", "gamma"), Init::Const(1.0))?;
    let bias = if config.affine {
        Some(vb.get_with_hints(size, name("bias", "beta"), Init::Const(0.0))?)
    } else {
        None
    };
    Ok(LayerNorm {
        weight,
        bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
    })
}

/// `candle_nn::RmsNorm` with a backward.
#[derive(Clone, Debug)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// RMS norm with `weight`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm::rms_norm(weight, eps))
    }

    /// The layer norm inside.
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The epsilon.
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

/// `candle_nn::rms_norm(size, eps, vb)`: `weight` (ones).
///
/// # Errors
///
/// The `VarBuilder`'s error.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: false,
        affine: false,
    };
    Ok(RmsNorm(layer_norm(size, config, vb)?))
}
