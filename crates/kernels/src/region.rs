//! Fused regions: a few candle ops computed on detached tensors and recorded as ONE graph node
//! with a hand-written backward.
//!
//! candle's backward adds every gradient contribution into a fresh `zeros_like` of its target
//! (two extra passes per graph edge), so a chain like reshape -> matmul -> reshape ->
//! broadcast_add costs several full passes over the activation on top of the arithmetic. A
//! region has edges only to its real inputs. Used for `linear` (x, W, b) and the attention core
//! (q, k, v), the two largest sources of edges in a transformer block.

use std::sync::Mutex;

use candle_core::{CustomOp1, CustomOp2, CustomOp3, Error, Layout, Shape, Tensor};

use crate::storage::{from_host_vec, output_of, with_slice, DeviceStorage};

type CResult<T> = candle_core::Result<T>;

/// Takes the precomputed output and returns its data as a fresh storage of the node's backend
/// (one copy), adding `bias` (an f32 row broadcast over the leading dims) on the way when given.
fn output_storage<S: DeviceStorage>(
    like: &S,
    slot: &Mutex<Option<Tensor>>,
    bias: Option<&Tensor>,
) -> CResult<(S, Shape)> {
    let y = slot
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .ok_or_else(|| Error::msg("fused region: output already taken"))?;
    let Some(b) = bias else {
        return Ok((output_of::<S>(&y)?, y.shape().clone()));
    };
    let y = y.contiguous()?;
    let b = b.contiguous()?;
    let data = with_slice::<f32, _>(&y, |yv| {
        with_slice::<f32, _>(&b, |bv| crate::fused::add_rows(yv, bv))
    })??;
    Ok((from_host_vec(like, data)?, y.shape().clone()))
}

/// `dS = scale * P * (dP - rowsum(dP * P))` over the last dim (softmax backward), f32.
fn softmax_backward(p: &Tensor, dp: &Tensor, scale: f32) -> CResult<Tensor> {
    let p = p.contiguous()?;
    crate::fused::softmax_grad(&p, dp, scale, &p)
}

type Bwd1 = Box<dyn Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync>;
type Bwd2 = Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> CResult<(Tensor, Tensor)> + Send + Sync>;
type Bwd3 = Box<
    dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> CResult<(Tensor, Tensor, Tensor)> + Send + Sync,
>;

type Bwd3Out = Box<
    dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> CResult<(Tensor, Tensor, Tensor)>
        + Send
        + Sync,
>;

/// A [`node3_out`] node: the backward also reads the node's output.
struct WithOutput(Bwd3Out);

/// A region's graph node over one to three inputs (`B`: the backward closure of that arity):
/// the forward hands out the output computed beforehand, the backward calls `bwd` on the
/// inputs and the output gradient.
struct Region<B> {
    name: &'static str,
    out: Mutex<Option<Tensor>>,
    bias: Option<Tensor>,
    bwd: B,
}

impl<B> Region<B> {
    fn new(name: &'static str, y: Tensor, bias: Option<Tensor>, bwd: B) -> Self {
        Region {
            name,
            out: Mutex::new(Some(y)),
            bias,
            bwd,
        }
    }

    /// The forward of every arity: the output as a storage of the first input's backend (the
    /// inputs were read when the output was computed).
    fn output<S: DeviceStorage>(&self, s: &S, _: &Layout) -> CResult<(S, Shape)> {
        output_storage(s, &self.out, self.bias.as_ref())
    }
}

impl CustomOp1 for Region<Bwd1> {
    fn name(&self) -> &'static str {
        self.name
    }

    crate::device_fwd1!(output);

    fn bwd(&self, a: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        (self.bwd)(a, g).map(Some)
    }
}

impl CustomOp2 for Region<Bwd2> {
    fn name(&self) -> &'static str {
        self.name
    }

    crate::device_fwd2!(output, first_only);

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = (self.bwd)(a, b, g)?;
        Ok((Some(da), Some(db)))
    }
}

impl CustomOp3 for Region<Bwd3> {
    fn name(&self) -> &'static str {
        self.name
    }

    crate::device_fwd3!(output, first_only);

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (da, db, dc) = (self.bwd)(a, b, c, g)?;
        Ok((Some(da), Some(db), Some(dc)))
    }
}

impl CustomOp3 for Region<WithOutput> {
    fn name(&self) -> &'static str {
        self.name
    }

    crate::device_fwd3!(output, first_only);

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (da, db, dc) = (self.bwd.0)(a, b, c, res, g)?;
        Ok((Some(da), Some(db), Some(dc)))
    }
}

/// Whether a region applies: CPU tensors that track gradients (untracked inputs just run the
/// plain ops, which record nothing). Regions on CUDA tensors would be correct (their nodes
/// have a CUDA forward) but their backward kernels are CPU ones; CUDA runs the plain ops.
fn tracked(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cpu()) && ts.iter().any(|t| t.track_op())
}

/// Whether [`linear`] applies: CPU tensors, one of which tracks gradients, `x` of rank >= 2 and
/// no empty operand (empty pieces take the plain path, which keeps the graph edges).
pub fn linear_applies(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> bool {
    let all: Vec<&Tensor> = [x, w].into_iter().chain(b).collect();
    tracked(&all) && x.rank() >= 2 && all.iter().all(|t| t.elem_count() > 0)
}

/// `y = x @ w^T (+ b)` for `x: [.., in]`, `w: [out, in]`, `b: [out]`, as one graph node
/// (plain candle ops where [`linear_applies`] is false).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CResult<Tensor> {
    let compute = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| -> CResult<Tensor> {
        let dims = x.dims().to_vec();
        let inner = *dims
            .last()
            .ok_or_else(|| Error::msg("linear: x needs at least one dim"))?;
        // Explicit row count: `()` cannot be inferred for an empty piece.
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let y = x.reshape((rows, inner))?.matmul(&w.t()?)?;
        let y = match b {
            Some(b) => crate::fused::add(&y, b)?,
            None => y,
        };
        let mut out = dims;
        if let Some(last) = out.last_mut() {
            *last = w.dim(0)?;
        }
        y.reshape(out)
    };
    if !linear_applies(x, w, b) {
        return compute(x, w, b);
    }
    let x = x.contiguous()?;
    // An f32 bias is added while the output is copied into the node's storage (one pass).
    let fuse_bias = x.dtype() == candle_core::DType::F32
        && b.is_some_and(|b| b.dtype() == candle_core::DType::F32);
    let bias = b.map(|b| b.detach());
    let y = if fuse_bias {
        compute(&x.detach(), &w.detach(), None)?
    } else {
        compute(&x.detach(), &w.detach(), bias.as_ref())?
    };
    let bias = bias.filter(|_| fuse_bias);
    // dx = g @ w; dw = g^T @ x; db = sum of g over rows.
    let grads = |x: &Tensor, w: &Tensor, g: &Tensor| -> CResult<(Tensor, Tensor, Tensor)> {
        let inner = x.dim(candle_core::D::Minus1)?;
        let out = w.dim(0)?;
        let g2 = g.contiguous()?.reshape(((), out))?;
        let x2 = x.reshape(((), inner))?;
        let dx = g2.matmul(w)?.reshape(x.shape())?;
        let dw = g2.t()?.matmul(&x2)?;
        let db = crate::fused::row_sum(&g2, out)?;
        Ok((dx, dw, db))
    };
    match b {
        Some(b) => {
            let op = Region::<Bwd3>::new(
                "fused-linear",
                y,
                bias,
                Box::new(move |x, w, _b, g| grads(x, w, g)),
            );
            x.apply_op3(w, b, op)
        }
        None => node2("fused-linear", &x, w, y, move |x, w, g| {
            let (dx, dw, _) = grads(x, w, g)?;
            Ok((dx, dw))
        }),
    }
}

/// Scaled dot-product attention `softmax(scale * q k^T [+ causal mask]) v` on `[B, H, T, d]`
/// f32 pieces, as one graph node. The backward recomputes the probabilities (one matmul and a
/// softmax) instead of keeping them, so the `[B, H, T, S]` matrix is never held between passes.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f32) -> CResult<Tensor> {
    let probs = move |q: &Tensor, k: &Tensor| -> CResult<Tensor> {
        let s = q.matmul(&k.t()?)?;
        let s = s.detach();
        crate::fused::scaled_causal_softmax(&s, scale, causal).map(|p| p.detach())
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    if !tracked(&[&q, &k, &v]) {
        return probs(&q, &k)?.matmul(&v);
    }
    let y = probs(&q.detach(), &k.detach())?.matmul(&v.detach())?;
    node3("fused-sdpa", &q, &k, &v, y, move |q, k, v, g| {
        let g = g.contiguous()?;
        let p = probs(q, k)?;
        let dv = p.t()?.matmul(&g)?;
        let dp = g.matmul(&v.t()?)?;
        // dS = scale * P * (dP - rowsum(dP * P)); masked entries have P = 0.
        let ds = softmax_backward(&p, &dp, scale)?;
        let dq = ds.matmul(k)?;
        let dk = ds.t()?.matmul(q)?;
        Ok((dq, dk, dv))
    })
}

/// Splits a packed `[B, T, H, 3, d]` projection into contiguous `q`, `k`, `v` of `[B, H, T, d]`.
fn unpack_qkv(x: &Tensor) -> CResult<(Tensor, Tensor, Tensor)> {
    let part = |i: usize| -> CResult<Tensor> {
        x.narrow(3, i, 1)?.squeeze(3)?.transpose(1, 2)?.contiguous()
    };
    Ok((part(0)?, part(1)?, part(2)?))
}

/// Attention on a packed projection `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` (f32 CPU, tracked,
/// non-empty; see `ops::neural::packed_sdpa_local` for the other cases), as one graph node: the
/// head split, the transposes and the merge of heads cost no graph edges, and the backward
/// writes the packed gradient directly.
pub fn packed_sdpa(qkv: &Tensor, causal: bool, scale: f32) -> CResult<Tensor> {
    let probs = move |q: &Tensor, k: &Tensor| -> CResult<Tensor> {
        let s = q.matmul(&k.t()?)?;
        crate::fused::scaled_causal_softmax(&s, scale, causal).map(|p| p.detach())
    };
    let forward = move |x: &Tensor| -> CResult<Tensor> {
        let (q, k, v) = unpack_qkv(x)?;
        probs(&q, &k)?.matmul(&v)?.transpose(1, 2)?.contiguous()
    };
    let x = qkv.contiguous()?;
    if !tracked(&[&x]) {
        return forward(&x);
    }
    let y = forward(&x.detach())?;
    node1("fused-packed-sdpa", &x, y, move |x, g| {
        let (q, k, v) = unpack_qkv(x)?;
        let g = g.transpose(1, 2)?.contiguous()?;
        let p = probs(&q, &k)?;
        let dv = p.t()?.matmul(&g)?;
        let dp = g.matmul(&v.t()?)?;
        let ds = softmax_backward(&p, &dp, scale)?;
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        // [B, H, T, d] x 3 -> [B, T, H, 3, d].
        Tensor::stack(
            &[
                dq.transpose(1, 2)?,
                dk.transpose(1, 2)?,
                dv.transpose(1, 2)?,
            ],
            3,
        )
    })
}

/// Records `y`, computed by the caller from detached copies of the inputs, as ONE graph node
/// over `a` whose backward is `bwd(a, grad of y) -> grad of a`: a composite op with a
/// hand-written backward, like the regions above. Unlike candle's own ops, the node keeps its
/// edge when a tensor is empty (candle returns an empty elementwise result's left operand and
/// drops the right one from the graph), so the graph, and with it the order of the backward
/// collectives, does not depend on the data. Any device (the output is copied into a storage of
/// `a`'s backend). `a` must track gradients for the node to matter; nothing checks it.
pub fn node1(
    name: &'static str,
    a: &Tensor,
    y: Tensor,
    bwd: impl Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync + 'static,
) -> CResult<Tensor> {
    a.apply_op1(Region::<Bwd1>::new(name, y, None, Box::new(bwd)))
}

/// [`node1`] over two inputs: `bwd(a, b, grad) -> (grad of a, grad of b)`.
pub fn node2(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    y: Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor) -> CResult<(Tensor, Tensor)> + Send + Sync + 'static,
) -> CResult<Tensor> {
    a.apply_op2(b, Region::<Bwd2>::new(name, y, None, Box::new(bwd)))
}

/// [`node1`] over three inputs: `bwd(a, b, c, grad) -> (grad of a, grad of b, grad of c)`.
pub fn node3(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    y: Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> CResult<(Tensor, Tensor, Tensor)>
        + Send
        + Sync
        + 'static,
) -> CResult<Tensor> {
    a.apply_op3(b, c, Region::<Bwd3>::new(name, y, None, Box::new(bwd)))
}

/// [`node3`] whose backward also gets the node's output (the graph keeps it anyway, so a
/// backward that needs it, such as attention's `rowsum(dO * O)`, need not hold a copy):
/// `bwd(a, b, c, output, grad) -> (grad of a, grad of b, grad of c)`.
pub fn node3_out(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    y: Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> CResult<(Tensor, Tensor, Tensor)>
        + Send
        + Sync
        + 'static,
) -> CResult<Tensor> {
    a.apply_op3(
        b,
        c,
        Region::<WithOutput>::new(name, y, None, WithOutput(Box::new(bwd))),
    )
}
