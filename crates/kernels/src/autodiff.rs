//! Differentiable neural-network ops on plain candle tensors, any device: softmax,
//! log_softmax, layer_norm, rms_norm and scaled dot-product attention.
//!
//! Each `*_local` function takes the fused kernel ([`crate::fused`], [`crate::region`]) where it
//! applies (f32 on the CPU; softmax, log-softmax, the norms and attention's softmax also
//! f32/bf16 on CUDA with the `cuda` feature, [`fused::device_applies`]) and the primitive
//! composition ([`mod@reference`]) otherwise (other dtypes and devices).
//! Both have backward passes; candle-nn's fused `softmax_last_dim`, `layer_norm`, `rms_norm`
//! and `sdpa` have none and silently cut the graph (candle#2168, #3011).

use candle_core::Tensor;

use crate::fused;

type CResult<T> = candle_core::Result<T>;

/// A normalization over `dim`: `last` (the fused kernel) over the last dim where it applies,
/// `reference(x, dim)` otherwise, and an empty piece (uneven sharding of another dim) as it is,
/// since candle's max refuses empty input.
fn over_dim(
    x: &Tensor,
    dim: usize,
    last: impl FnOnce(&Tensor) -> CResult<Tensor>,
    reference: impl FnOnce(&Tensor, usize) -> CResult<Tensor>,
) -> CResult<Tensor> {
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    if fused::device_applies(x) && dim + 1 == x.rank() {
        return last(x);
    }
    reference(x, dim)
}

/// Softmax over `dim` (the fused kernel for f32 over the last dim; primitives otherwise).
pub fn softmax_local(x: &Tensor, dim: usize) -> CResult<Tensor> {
    over_dim(x, dim, fused::softmax_last, reference::softmax)
}

/// Log-softmax over `dim` (fused for f32 over the last dim).
pub fn log_softmax_local(x: &Tensor, dim: usize) -> CResult<Tensor> {
    over_dim(x, dim, fused::log_softmax_last, reference::log_softmax)
}

/// Layer norm over the last dim (fused with a weight where it applies).
pub fn layer_norm_local(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f64,
) -> CResult<Tensor> {
    match w {
        Some(w)
            if fused::device_applies(x)
                && w.dtype() == x.dtype()
                && b.is_none_or(|b| b.dtype() == x.dtype()) =>
        {
            fused::layer_norm(x, w, b, eps)
        }
        _ => reference::layer_norm(x, w, b, eps),
    }
}

/// RMS norm over the last dim (fused where it applies).
pub fn rms_norm_local(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    if fused::device_applies(x) && w.dtype() == x.dtype() {
        return fused::rms_norm(x, w, eps);
    }
    reference::rms_norm(x, w, eps)
}

/// Scaled dot-product attention on `[B, H, T, d]` pieces: the one-node region for f32 on the
/// CPU; on CUDA (f32/bf16) flash attention where [`crate::flash::applies`], else candle's
/// matmuls around the fused scaled causal softmax; the composition otherwise.
pub fn sdpa_local(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> CResult<Tensor> {
    if q.elem_count() == 0 || k.elem_count() == 0 {
        // An empty batch/head piece: an empty result that keeps the graph (softmax refuses
        // empty input).
        return q.matmul(&k.t()?)?.matmul(v);
    }
    if fused::applies(q) && scale > 0.0 {
        return crate::region::sdpa(q, k, v, causal, scale as f32);
    }
    if scale > 0.0 && crate::flash::applies(q, k, v) {
        // CUDA: flash attention, no [T, T] scores in memory.
        return crate::flash::attention(q, k, v, causal, scale as f32);
    }
    if fused::device_applies(q) && !q.device().is_cpu() && scale > 0.0 {
        // CUDA, a head dim the flash kernels are not built for (or CDT_FLASH_ATTN=0): candle's
        // matmuls around the fused scaled (causal) softmax, whose mask is
        // computed in the kernel (the composition builds it on the host and uploads it on
        // every call, and takes ~6 more kernels forward and backward).
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let att = q.matmul(&k.t()?)?;
        return fused::scaled_causal_softmax(&att, scale as f32, causal)?.matmul(&v);
    }
    reference::sdpa(q, k, v, causal, scale)
}

/// Attention on a packed projection `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` (one fused node for
/// f32; the reference composition otherwise).
pub fn packed_sdpa_local(qkv: &Tensor, causal: bool, scale: f64) -> CResult<Tensor> {
    if qkv.elem_count() > 0 && fused::applies(qkv) && scale > 0.0 {
        return crate::region::packed_sdpa(qkv, causal, scale as f32);
    }
    if qkv.elem_count() > 0 && fused::device_applies(qkv) && !qkv.device().is_cpu() {
        // CUDA: flash attention as one node over the packed projection where it applies;
        // else split as the reference does, then `sdpa_local` (the fused softmax).
        let part = |i: usize| qkv.narrow(3, i, 1)?.squeeze(3)?.transpose(1, 2);
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        if scale > 0.0 && crate::flash::applies(&q, &k, &v) {
            return crate::flash::packed_attention(qkv, causal, scale as f32);
        }
        return sdpa_local(&q, &k, &v, causal, scale)?.transpose(1, 2);
    }
    reference::packed_sdpa(qkv, causal, scale)
}

/// [`packed_sdpa_local`] on the projection as the QKV linear makes it: `qkv [B, T, 3 heads d]`
/// -> `[B, T, heads d]`. One node over the flat projection, with no reshape nodes around it,
/// where [`packed_sdpa_local`] has one: f32 on the CPU (`region::packed_sdpa_flat`), and on
/// CUDA where `flash::applies_flat`; elsewhere [`packed_sdpa_local`] between the two reshapes.
/// The same values either way.
///
/// # Errors
///
/// `qkv` is not `[B, T, W]` with `W` a multiple of `3 heads`; as [`packed_sdpa_local`].
pub fn packed_sdpa_local_flat(
    qkv: &Tensor,
    heads: usize,
    causal: bool,
    scale: f64,
) -> CResult<Tensor> {
    let (b, t, w) = match qkv.dims() {
        &[b, t, w] if heads > 0 && w % (3 * heads) == 0 => (b, t, w),
        dims => {
            return Err(crate::error::KernelError::Mismatch {
                op: "packed_sdpa_flat",
                detail: format!("qkv {dims:?}: [B, T, 3 x {heads} heads x d]"),
            }
            .into())
        }
    };
    if qkv.elem_count() > 0 && scale > 0.0 && fused::applies(qkv) {
        return crate::region::packed_sdpa_flat(qkv, heads, causal, scale as f32);
    }
    if qkv.elem_count() > 0
        && scale > 0.0
        && fused::device_applies(qkv)
        && crate::flash::applies_flat(qkv, heads)
    {
        return crate::flash::packed_attention_flat(qkv, heads, causal, scale as f32);
    }
    let d = w / (3 * heads);
    packed_sdpa_local(&qkv.reshape((b, t, heads, 3, d))?, causal, scale)?.reshape((b, t, heads * d))
}

/// The same ops built from candle primitives only (every dtype; the reference the fused kernels
/// are tested against).
pub mod reference {
    use candle_core::{Tensor, D};

    type CResult<T> = candle_core::Result<T>;

    /// Softmax over `dim` (max subtracted and detached: softmax is shift-invariant).
    pub fn softmax(x: &Tensor, dim: usize) -> CResult<Tensor> {
        let m = x.max_keepdim(dim)?.detach();
        let e = x.broadcast_sub(&m)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(dim)?)
    }

    /// Log-softmax over `dim`.
    pub fn log_softmax(x: &Tensor, dim: usize) -> CResult<Tensor> {
        let m = x.max_keepdim(dim)?.detach();
        let s = x.broadcast_sub(&m)?;
        s.broadcast_sub(&s.exp()?.sum_keepdim(dim)?.log()?)
    }

    /// Layer norm over the last dim.
    pub fn layer_norm(
        x: &Tensor,
        w: Option<&Tensor>,
        b: Option<&Tensor>,
        eps: f64,
    ) -> CResult<Tensor> {
        let mu = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mu)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let mut y = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
        if let Some(w) = w {
            y = y.broadcast_mul(w)?;
        }
        if let Some(b) = b {
            y = y.broadcast_add(b)?;
        }
        Ok(y)
    }

    /// RMS norm over the last dim.
    pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
    }

    /// Scaled dot-product attention on `[B, H, T, d]`.
    pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> CResult<Tensor> {
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let att = (q.matmul(&k.t()?)? * scale)?;
        let att = if causal {
            let (t, s) = (q.dim(2)?, k.dim(2)?);
            let mask: Vec<u8> = (0..t)
                .flat_map(|i| (0..s).map(move |j| u8::from(j + t > i + s)))
                .collect();
            let mask = Tensor::from_vec(mask, (t, s), q.device())?.broadcast_as(att.shape())?;
            let ninf = Tensor::new(f32::NEG_INFINITY, q.device())?
                .to_dtype(att.dtype())?
                .broadcast_as(att.shape())?;
            mask.where_cond(&ninf, &att)?
        } else {
            att
        };
        softmax(&att, 3)?.matmul(&v)
    }

    /// Attention on a packed `qkv [B, T, H, 3, d]` -> `[B, T, H, d]`: split, [`sdpa`], merge.
    pub fn packed_sdpa(qkv: &Tensor, causal: bool, scale: f64) -> CResult<Tensor> {
        let part =
            |i: usize| -> CResult<Tensor> { qkv.narrow(3, i, 1)?.squeeze(3)?.transpose(1, 2) };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let y = if q.elem_count() == 0 || k.elem_count() == 0 {
            // An empty piece keeps the graph (softmax refuses empty input).
            q.contiguous()?
                .matmul(&k.contiguous()?.t()?)?
                .matmul(&v.contiguous()?)?
        } else {
            sdpa(&q, &k, &v, causal, scale)?
        };
        y.transpose(1, 2)
    }

    /// GELU, tanh form (candle's `gelu`).
    pub fn gelu(x: &Tensor) -> CResult<Tensor> {
        x.gelu()
    }
}
