//! Fused regions: a few candle ops computed on detached tensors and recorded as ONE graph node
//! with a hand-written backward.
//!
//! candle's backward adds every gradient contribution into a fresh `zeros_like` of its target
//! (two extra passes per graph edge), so a chain like reshape -> matmul -> reshape ->
//! broadcast_add costs several full passes over the activation on top of the arithmetic. A
//! region has edges only to its real inputs. Used for `linear` (x, W, b) and the attention core
//! (q, k, v), the two largest sources of edges in a transformer block.

use std::cell::{Cell, RefCell};
use std::sync::Mutex;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Error, Layout, Shape, Tensor,
};

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
    output_from(like, y, bias)
}

/// [`output_storage`] of the output `y` itself.
fn output_from<S: DeviceStorage>(
    like: &S,
    y: Tensor,
    bias: Option<&Tensor>,
) -> CResult<(S, Shape)> {
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
/// have a CUDA forward) but most of their backward kernels are CPU ones; CUDA runs the plain
/// ops, except for [`linear`] (see [`linear_applies`]) and the attention of `crate::flash`.
fn tracked(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cpu()) && ts.iter().any(|t| t.track_op())
}

/// Whether [`linear`] applies: tensors one of which tracks gradients, `x` of rank >= 2 and no
/// empty operand (empty pieces take the plain path, which keeps the graph edges), on the CPU
/// or on CUDA (its backward is GEMMs and the bias column sum, which run there; off with
/// `CDT_FUSED_CUDA=0`), or on any device inside [`splittable_forward`].
pub fn linear_applies(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> bool {
    let all: Vec<&Tensor> = [x, w].into_iter().chain(b).collect();
    let on_cuda = cfg!(feature = "cuda")
        && all.iter().all(|t| t.device().is_cuda())
        && crate::fused::cuda_enabled()
        && all.iter().any(|t| t.track_op());
    let on_device =
        tracked(&all) || on_cuda || (split_forward() && all.iter().any(|t| t.track_op()));
    on_device && x.rank() >= 2 && all.iter().all(|t| t.elem_count() > 0)
}

// --------------------------------------------------------------------------------------------
// Split backward (zero-bubble pipeline schedules).

thread_local! {
    /// Inside [`splittable_forward`] on this thread.
    static SPLIT_FORWARD: Cell<bool> = const { Cell::new(false) };
    /// Inside [`defer_weight_grads`] on this thread: the deferred weight gradients so far.
    static DEFERRED: RefCell<Option<Vec<DeferredWeightGrad>>> = const { RefCell::new(None) };
}

fn split_forward() -> bool {
    SPLIT_FORWARD.with(Cell::get)
}

/// A [`linear`] node's weight gradient, deferred by [`defer_weight_grads`]: the operands of
/// `dW = g^T x`, kept until [`DeferredWeightGrad::grad`] computes it.
#[derive(Debug, Clone)]
pub struct DeferredWeightGrad {
    /// The weight as the node saw it (with its graph: the parameter itself, or e.g. a cast of
    /// it under a precision policy).
    w: Tensor,
    /// The node's input as `[rows, in]` (detached).
    x: Tensor,
    /// The output's gradient as `[rows, out]` (detached).
    g: Tensor,
}

impl DeferredWeightGrad {
    /// The weight whose gradient this is, as the linear saw it. When it is not a variable
    /// itself, its gradient reaches the parameters through its graph: run a backward of
    /// `sum(weight * grad)` (the gradient of that sum with respect to `weight` is `grad`).
    pub fn weight(&self) -> &Tensor {
        &self.w
    }

    /// `dW = g^T x`, of the weight's shape and dtype: what the node's backward would have
    /// given the weight.
    ///
    /// # Errors
    ///
    /// A failed matmul.
    pub fn grad(&self) -> CResult<Tensor> {
        self.g.t()?.matmul(&self.x)
    }

    /// Bytes of the operands held until [`DeferredWeightGrad::grad`] (the input may also be
    /// held elsewhere: an upper bound of what the deferral keeps alive).
    pub fn held_bytes(&self) -> usize {
        (self.x.elem_count() + self.g.elem_count()) * self.g.dtype().size_in_bytes()
    }
}

/// Restores a thread-local on drop, so a panic inside a scope does not leave it set.
struct Restore<F: FnMut()>(F);

impl<F: FnMut()> Drop for Restore<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Runs `f`, a forward whose backward will be split by [`defer_weight_grads`], with every
/// [`linear`] recorded as a region node on every device. (On the CPU linears are regions
/// anyway; elsewhere they are plain candle ops, whose matmul backward computes both operands'
/// gradients together and so cannot defer one.)
pub fn splittable_forward<R>(f: impl FnOnce() -> R) -> R {
    let before = SPLIT_FORWARD.with(|c| c.replace(true));
    let _restore = Restore(move || SPLIT_FORWARD.with(|c| c.set(before)));
    f()
}

/// Runs `f`, a backward, with the weight gradients of the [`linear`] region nodes it reaches
/// deferred, and returns them with `f`'s result: the backward computes the input and bias
/// gradients (zero-bubble's `B`, on the critical path of a pipeline) and leaves the GEMMs
/// `dW = g^T x` (zero-bubble's `W`) to the caller, who computes them later with
/// [`DeferredWeightGrad::grad`] and adds them where the weight leads. A weight that is a
/// variable gets no gradient from the node during `f`; a computed weight (such as a cast
/// parameter) gets zeros, which candle's backward needs on every node it reaches. Linears that
/// ran as plain ops (see [`linear_applies`]) are not deferred. Scopes nest: an inner one takes
/// what its own backward defers.
pub fn defer_weight_grads<R>(f: impl FnOnce() -> R) -> (R, Vec<DeferredWeightGrad>) {
    let outer = DEFERRED.with(|d| d.borrow_mut().replace(Vec::new()));
    let mut outer = Some(outer);
    let restore = Restore(move || {
        if let Some(o) = outer.take() {
            DEFERRED.with(|d| *d.borrow_mut() = o);
        }
    });
    let r = f();
    let deferred = DEFERRED.with(|d| d.borrow_mut().take()).unwrap_or_default();
    drop(restore);
    (r, deferred)
}

/// Whether [`weight_grad`] would defer `w`'s gradient (inside [`defer_weight_grads`], a
/// variable weight) rather than compute it now.
fn defers(w: &Tensor) -> bool {
    DEFERRED.with(|d| d.borrow().is_some()) && w.track_op()
}

/// On CUDA, a linear's weight gradient `g2^T x2` (in `out`) with its bias gradient (`g2`'s
/// column sums, in `out`) from one cuBLASLt matmul, the sums in its epilogue
/// (`cuda::gemm_to`): no second pass over `g2`. `None` elsewhere, where cuBLASLt is off
/// or refuses, or without the `cuda` feature: the caller computes both apart.
fn weight_and_bias_grad(g2: &Tensor, x2: &Tensor, out: DType) -> CResult<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if g2.device().is_cuda() {
        return Ok(
            match crate::cuda::gemm_to(g2, true, x2, false, true, out)? {
                Some((dw, Some(db))) => Some((dw, db)),
                _ => None,
            },
        );
    }
    let _ = (g2, x2, out);
    Ok(None)
}

/// The weight gradient of a linear node's backward: computed now, or deferred (`None` for a
/// variable weight, zeros for a computed one) inside [`defer_weight_grads`].
fn weight_grad(w: &Tensor, x2: &Tensor, g2: &Tensor) -> CResult<Option<Tensor>> {
    if !defers(w) {
        return Ok(Some(g2.t()?.matmul(x2)?));
    }
    let item = DeferredWeightGrad {
        w: w.clone(),
        x: x2.detach(),
        g: g2.detach(),
    };
    DEFERRED.with(|d| {
        if let Some(v) = d.borrow_mut().as_mut() {
            v.push(item);
        }
    });
    if w.is_variable() {
        Ok(None)
    } else {
        Ok(Some(w.zeros_like()?))
    }
}

/// [`linear`]'s graph node: `(x, w)` or `(x, w, b)`.
struct Linear {
    /// The output, until the forward takes it: a tensor the forward copies (adding `bias` on
    /// the way), or (CUDA) a storage the forward takes as it is.
    out: Mutex<Option<NodeOutput>>,
    /// An f32 bias added while the output is copied into the node's storage (CPU only).
    bias: Option<Tensor>,
}

/// What a linear node's forward hands out.
enum NodeOutput {
    /// A tensor: the forward makes the node's storage from it (see each node's `output`).
    Tensor(Tensor),
    /// The finished output, moved out as it is: made as a storage (`cuda::linear_out`,
    /// `cuda::cast_add_rows`, on the CPU `fused::linear_bias`), which no tensor owns.
    Ready(candle_core::Storage, Shape),
}

impl NodeOutput {
    /// Takes the output out of a node's slot (once: candle runs a node's forward once).
    fn take(slot: &Mutex<Option<NodeOutput>>, node: &str) -> CResult<NodeOutput> {
        slot.lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| Error::msg(format!("{node}: output already taken")))
    }

    /// The storage of a [`NodeOutput::Ready`] output, as backend `S`.
    fn ready<S: DeviceStorage>(
        s: candle_core::Storage,
        shape: Shape,
        node: &str,
    ) -> CResult<(S, Shape)> {
        let s = S::take(s)
            .ok_or_else(|| Error::msg(format!("{node}: the output is on another device than x")))?;
        Ok((s, shape))
    }
}

/// What the two linear nodes ([`Linear`], [`LinearIn`]) have of their own: the output their
/// forward hands out and the gradients `(dx, dw, db)` (`dw` `None`: deferred); [`LinearNode`]
/// makes either a graph node over `(x, w)` or `(x, w, b)`.
trait LinearParts: Send + Sync {
    const NAME: &'static str;
    fn output<S: DeviceStorage>(&self, s: &S) -> CResult<(S, Shape)>;
    /// `bias`: the bias's dtype, when there is one (its gradient's).
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
        bias: Option<DType>,
    ) -> CResult<(Tensor, Option<Tensor>, Option<Tensor>)>;
}

/// The output gradient `g` of a linear as `[rows, out]`, and the bias gradient (`g` summed
/// over rows, in the bias's dtype `bias`) when there is a bias: what both linear nodes'
/// backwards start from.
fn rows_and_bias_grad(
    g: &Tensor,
    out: usize,
    bias: Option<DType>,
) -> CResult<(Tensor, Option<Tensor>)> {
    let g2 = g.contiguous()?.reshape(((), out))?;
    let db = bias
        .map(|dt| crate::fused::row_sum_as(&g2, out, dt))
        .transpose()?;
    Ok((g2, db))
}

/// A linear node (see [`LinearParts`]).
struct LinearNode<L>(L);

impl<L: LinearParts> LinearNode<L> {
    fn output<S: DeviceStorage>(&self, s: &S, _: &Layout) -> CResult<(S, Shape)> {
        self.0.output(s)
    }
}

impl<L: LinearParts> CustomOp2 for LinearNode<L> {
    fn name(&self) -> &'static str {
        L::NAME
    }

    crate::device_fwd2!(output, first_only);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.0.grads(x, w, g, None)?;
        Ok((Some(dx), dw))
    }
}

impl<L: LinearParts> CustomOp3 for LinearNode<L> {
    fn name(&self) -> &'static str {
        L::NAME
    }

    crate::device_fwd3!(output, first_only);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.0.grads(x, w, g, Some(b.dtype()))?;
        Ok((Some(dx), dw, db))
    }
}

impl LinearParts for Linear {
    const NAME: &'static str = "fused-linear";

    fn output<S: DeviceStorage>(&self, s: &S) -> CResult<(S, Shape)> {
        match NodeOutput::take(&self.out, Self::NAME)? {
            NodeOutput::Tensor(y) => output_from(s, y, self.bias.as_ref()),
            NodeOutput::Ready(st, shape) => NodeOutput::ready(st, shape, Self::NAME),
        }
    }

    /// `(dx, dw, db)`: `dx = g @ w`, `dw = g^T @ x` (or deferred), `db` = `g` summed over rows.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
        bias: Option<DType>,
    ) -> CResult<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let inner = x.dim(candle_core::D::Minus1)?;
        let x2 = x.reshape(((), inner))?;
        let out = w.dim(0)?;
        let g2 = g.contiguous()?.reshape(((), out))?;
        // The weight and bias gradients from one matmul where cuBLASLt sums the bias's in its
        // epilogue (CUDA; a bias of the weight's dtype, the weight's gradient not deferred).
        if bias == Some(w.dtype()) && !defers(w) {
            if let Some((dw, db)) = weight_and_bias_grad(&g2, &x2, w.dtype())? {
                let dx = g2.matmul(w)?.reshape(x.shape())?;
                return Ok((dx, Some(dw), Some(db)));
            }
        }
        let (g2, db) = rows_and_bias_grad(&g2, out, bias)?;
        let dx = g2.matmul(w)?.reshape(x.shape())?;
        let dw = weight_grad(w, &x2, &g2)?;
        Ok((dx, dw, db))
    }
}

/// `y = x @ w^T (+ b)` for `x: [.., in]`, `w: [out, in]`, `b: [out]`, as one graph node
/// (plain candle ops where [`linear_applies`] is false). Its backward defers the weight's
/// gradient inside [`defer_weight_grads`].
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CResult<Tensor> {
    match linear_parts(x, w, b)? {
        Built::Node(x, node) => apply_linear(&x, w, b, node),
        Built::Plain(y) => Ok(y),
    }
}

/// What a linear's one-node path built before applying the node: the node's parts with `x`
/// as the node takes it (made contiguous), or, where the path does not apply, the plain
/// composition's result.
enum Built<L> {
    Node(Tensor, L),
    Plain(Tensor),
}

/// `parts` applied as the linear graph node over `(x, w)` or `(x, w, b)`.
fn apply_linear<L: LinearParts + 'static>(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    parts: L,
) -> CResult<Tensor> {
    match b {
        Some(b) => x.apply_op3(w, b, LinearNode(parts)),
        None => x.apply_op2(w, LinearNode(parts)),
    }
}

/// [`linear`] up to its node (see [`Built`]).
fn linear_parts(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CResult<Built<Linear>> {
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
        return compute(x, w, b).map(Built::Plain);
    }
    let x = x.contiguous()?;
    // An f32 bias is added while the output is copied into the node's storage (one pass; a
    // host loop, so CPU only).
    let fuse_bias = x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && b.is_some_and(|b| b.dtype() == candle_core::DType::F32);
    let bias = b.map(|b| b.detach());
    // On CUDA the product is made as a storage the node takes without a copy, the bias added
    // to it in place.
    #[cfg(feature = "cuda")]
    let ready = if x.device().is_cuda() {
        let mut dims = x.dims().to_vec();
        let last = dims.len() - 1;
        let rows: usize = dims[..last].iter().product();
        let x2 = x.detach().reshape((rows, dims[last]))?;
        dims[last] = w.dim(0)?;
        crate::cuda::linear_out(&x2, &w.detach(), bias.as_ref(), x2.dtype())?
            .map(|st| NodeOutput::Ready(candle_core::Storage::Cuda(st), Shape::from(dims)))
    } else {
        None
    };
    #[cfg(not(feature = "cuda"))]
    let ready: Option<NodeOutput> = None;
    let y = match ready {
        Some(r) => r,
        None if fuse_bias => match cpu_linear_bias(&x, w, bias.as_ref())? {
            Some(r) => r,
            None => NodeOutput::Tensor(compute(&x.detach(), &w.detach(), None)?),
        },
        None => NodeOutput::Tensor(compute(&x.detach(), &w.detach(), bias.as_ref())?),
    };
    let node = Linear {
        out: Mutex::new(Some(y)),
        bias: bias.filter(|_| fuse_bias),
    };
    Ok(Built::Node(x, node))
}

/// The finished `x @ w^T + b` of a contiguous f32 CPU `x` (`[.., in]`) by
/// `fused::linear_bias` (one gemm into rows that start as the bias), as a node's ready output;
/// `None` where it does not apply (a strided weight, shapes the plain path should report), the
/// caller then takes the matmul and the bias pass.
fn cpu_linear_bias(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CResult<Option<NodeOutput>> {
    let Some(b) = b else {
        return Ok(None);
    };
    let mut dims = x.dims().to_vec();
    let Some(&inner) = dims.last() else {
        return Ok(None);
    };
    let (out, w_in) = match w.dims() {
        &[o, i] => (o, i),
        _ => return Ok(None),
    };
    if !w.is_contiguous() || w.dtype() != DType::F32 || w_in != inner || b.dims() != [out] {
        return Ok(None);
    }
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let b = b.contiguous()?;
    let y = with_slice::<f32, _>(x, |xv| {
        with_slice::<f32, _>(w, |wv| {
            with_slice::<f32, _>(&b, |bv| crate::fused::linear_bias(xv, wv, bv, rows, inner))
        })
    })????;
    if let Some(last) = dims.last_mut() {
        *last = out;
    }
    Ok(Some(NodeOutput::Ready(
        candle_core::Storage::Cpu(CpuStorage::F32(y)),
        Shape::from(dims),
    )))
}

/// Whether [`linear_in`] applies: [`linear_to_applies`] with the output in `x`'s dtype and `w`
/// and `b` in it too.
pub fn linear_in_applies(x: &Tensor, w: &Tensor, b: Option<&Tensor>, compute: DType) -> bool {
    w.dtype() == x.dtype() && linear_to_applies(x, w, b, compute, x.dtype())
}

/// Whether [`linear_to`] applies with the output in `out`: [`linear_applies`]'s conditions on
/// any device (its backward is GEMMs, casts and a row sum, all candle ops), outside
/// [`splittable_forward`] (whose deferred weight gradients take [`linear`]'s node), float `x`,
/// `w` and `b`, and a cast to make: a compute dtype other than `w`'s (f32 master weights, `b`
/// in `w`'s dtype), or a `w` already in it with an `x`, an output or a bias that is not (FSDP's
/// gathered bf16 parameters, multiplied as they are, with f32 activations in or out, or bf16
/// ones with an f32 bias added to the product before its one rounding).
pub fn linear_to_applies(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    compute: DType,
    out: DType,
) -> bool {
    let all: Vec<&Tensor> = [x, w].into_iter().chain(b).collect();
    !split_forward()
        && all.iter().any(|t| t.track_op())
        && all.iter().all(|t| t.elem_count() > 0)
        && all.iter().all(|t| t.dtype().is_float())
        && out.is_float()
        && x.rank() >= 2
        && (compute != w.dtype()
            || x.dtype() != compute
            || out != compute
            || b.is_some_and(|b| b.dtype() != compute))
        && b.is_none_or(|b| b.dtype() == w.dtype() || w.dtype() == compute)
}

thread_local! {
    /// [`linear_in`] nodes built on this thread since [`take_linear_in_nodes`].
    static LINEAR_IN_NODES: Cell<usize> = const { Cell::new(0) };
}

/// How many [`linear_in`] graph nodes (mixed-precision linears as one node) this thread built
/// since the last call, and resets the count: a diagnostic, with which tests check that a
/// model's linears took the one-node path (their cast operands are inside the node, not in the
/// graph).
pub fn take_linear_in_nodes() -> usize {
    LINEAR_IN_NODES.with(|c| c.replace(0))
}

/// [`linear_in`]'s graph node: `(x, w)` or `(x, w, b)`, keeping the operands it cast for its
/// backward (as the cast nodes of the plain composition keep them). Its forward makes the
/// output from the product by the cast back and the bias add themselves.
struct LinearIn {
    /// The output, until the forward takes it: the product in the compute dtype, `[.., out]`
    /// (a tensor), or (CUDA, bf16 product, f32 output) the output itself, made from it in one
    /// pass.
    output: Mutex<Option<NodeOutput>>,
    /// The output's dtype.
    out_dtype: DType,
    bias: Option<Tensor>,
    /// `x` as `[rows, in]`, in the compute dtype (detached).
    xc: Tensor,
    /// `w` in the compute dtype (detached), or `None` under [`recast_weights`]: the backward
    /// casts its weight operand again.
    wc: Option<Tensor>,
    /// The compute dtype.
    compute: DType,
}

impl LinearIn {
    /// `w` in the compute dtype, contiguous: the kept cast, or `w` (the node's weight operand,
    /// as the backward gets it) cast again.
    fn weight(&self, w: &Tensor) -> CResult<Tensor> {
        match &self.wc {
            Some(wc) => Ok(wc.clone()),
            None => w.detach().to_dtype(self.compute)?.contiguous(),
        }
    }
}

thread_local! {
    /// Whether mixed-precision linear nodes built on this thread keep no cast of their weight
    /// ([`recast_weights`]).
    static RECAST_WEIGHTS: Cell<bool> = const { Cell::new(false) };
}

/// Restores the previous [`recast_weights`] setting when dropped (also on unwinding).
struct RecastGuard(bool);

impl Drop for RecastGuard {
    fn drop(&mut self) {
        RECAST_WEIGHTS.with(|c| c.set(self.0));
    }
}

/// Runs `f` with the mixed-precision linear nodes it builds on this thread (`recast` true)
/// keeping no copy of their weight cast to the compute dtype: the backward casts the weight
/// operand again. For a weight whose storage holds its values again by the backward but not in
/// between: FSDP's gathered parameters, released after their unit's forward and gathered again
/// before its backward, where a kept bf16 cast would hold half the unsharded weight's bytes of
/// every linear until its backward. The price is one cast pass over the weight in the backward.
/// The values are the same either way.
pub fn recast_weights<R>(recast: bool, f: impl FnOnce() -> R) -> R {
    let _restore = RecastGuard(RECAST_WEIGHTS.with(|c| c.replace(recast)));
    f()
}

impl LinearParts for LinearIn {
    const NAME: &'static str = "fused-linear-in";

    fn output<S: DeviceStorage>(&self, _: &S) -> CResult<(S, Shape)> {
        match NodeOutput::take(&self.output, Self::NAME)? {
            // The product: cast and the bias added into the node's storage.
            NodeOutput::Tensor(y) => {
                let s =
                    crate::storage::output_cast_add::<S>(&y, self.out_dtype, self.bias.as_ref())?;
                Ok((s, y.shape().clone()))
            }
            NodeOutput::Ready(st, shape) => NodeOutput::ready(st, shape, Self::NAME),
        }
    }

    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
        bias: Option<DType>,
    ) -> CResult<(Tensor, Option<Tensor>, Option<Tensor>)> {
        // The output gradient (of the output's dtype) in the compute dtype (no op when the
        // output is in it), the bias gradient summed from it in the bias's dtype.
        let out = w.dim(0)?;
        // On CUDA the weight gradient with the bias gradient in cuBLASLt's epilogue, where the
        // output gradient is already in the compute dtype (a bf16 output: the epilogue sums the
        // same bf16 values the row sum would, in f32) and the bias is of the weight's dtype.
        let g2 = g.contiguous()?.reshape(((), out))?;
        // Both in the bias's dtype: the weight's, or f32 for a bf16 weight taken as it is (its
        // gradient then rounded once to bf16, as the cast node before the linear did).
        let fused = match bias {
            Some(bd) if g2.dtype() == self.compute && (bd == w.dtype() || bd == DType::F32) => {
                weight_and_bias_grad(&g2, &self.xc, bd)?
            }
            _ => None,
        };
        let (g2, db, fused_dw) = match fused {
            Some((dw, db)) => (g2, Some(db), Some(dw.to_dtype(w.dtype())?)),
            None => {
                let (g2, db) = rows_and_bias_grad(&g2, out, bias)?;
                (g2, db, None)
            }
        };
        let gc = g2.to_dtype(self.compute)?;
        let wc = self.weight(w)?;
        // On CUDA each product written in its gradient's dtype by cuBLASLt (f32 from bf16
        // operands: one rounding, no bf16 product written and cast); else candle's GEMM in the
        // compute dtype, then the cast.
        #[cfg(feature = "cuda")]
        let (dx, dw) = (
            crate::cuda::gemm_to(&gc, false, &wc, false, false, x.dtype())?.map(|(c, _)| c),
            match fused_dw {
                Some(dw) => Some(dw),
                None => crate::cuda::gemm_to(&gc, true, &self.xc, false, false, w.dtype())?
                    .map(|(c, _)| c),
            },
        );
        #[cfg(not(feature = "cuda"))]
        let (dx, dw): (Option<Tensor>, Option<Tensor>) = (None, fused_dw);
        let dx = match dx {
            Some(dx) => dx,
            None => gc.matmul(&wc)?.to_dtype(x.dtype())?,
        }
        .reshape(x.shape())?;
        let dw = match dw {
            Some(dw) => dw,
            None => gc.t()?.matmul(&self.xc)?.to_dtype(w.dtype())?,
        };
        Ok((dx, Some(dw), db))
    }
}

/// `x @ w^T (+ b)` with the product in `compute` (bf16 under a mixed-precision policy): `x`
/// and `w` cast to it, the product cast back to `x`'s dtype, the bias added there ([`linear_to`]
/// with `x`'s dtype out). As one graph node with edges to `x`, `w` and `b` only where
/// [`linear_to_applies`] (for `w` and `b` in `x`'s dtype, [`linear_in_applies`]); otherwise the
/// plain composition (casts around [`linear`]). The plain composition on CUDA is about nine
/// graph nodes (two casts, a transpose, reshapes, the matmul, a cast back, the broadcast bias
/// add), and candle's backward adds a `zeros_like` and an add for every edge of them: full
/// passes over the activation that this node does not make. The node's forward casts the
/// product back and adds the bias into its own storage (no copy of a finished output). The cast
/// operands are kept for the backward, as the plain composition's cast nodes keep them.
pub fn linear_in(x: &Tensor, w: &Tensor, b: Option<&Tensor>, compute: DType) -> CResult<Tensor> {
    linear_to(x, w, b, compute, x.dtype())
}

/// [`linear_in`] with `x` in any float dtype and the output in `out`: `x @ w^T (+ b)` with `w`
/// and `b` in one dtype (the master weights'), or `w` already in `compute` (FSDP's gathered
/// bf16 parameters) and `b` in any float dtype; `x` and `w` cast to `compute` (no op for one
/// already in it), the product in `compute`, the bias added in `b`'s dtype to the product and
/// the sum cast to `out`. On CUDA that is one cuBLASLt matmul with the bias in its epilogue
/// (`crate::cublaslt`: the f32 accumulator plus the bias, rounded once to `out`, as autocast's
/// `addmm` does); where cuBLASLt is off or refuses, candle's bf16 GEMM writes its product in
/// bf16, so a bf16 output is rounded twice (the product, then product plus bias).
/// A mixed-precision policy's linear whose input or output is a bf16 activation (autocast's
/// data flow: the QKV projection feeding bf16 attention, the MLP's `fc1 -> GELU -> fc2` in
/// bf16) with no cast of that activation outside the node. One node
/// where [`linear_to_applies`], else the plain composition. Its backward: the output gradient
/// in `compute`, `dx` in `x`'s dtype, `dw` in `w`'s, the bias gradient summed in `b`'s (f32
/// from a bf16 gradient on CUDA without a cast pass).
pub fn linear_to(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    compute: DType,
    out: DType,
) -> CResult<Tensor> {
    match linear_to_parts(x, w, b, compute, out)? {
        Built::Node(x, node) => apply_linear(&x, w, b, node),
        Built::Plain(y) => Ok(y),
    }
}

/// [`linear_to`] up to its node (see [`Built`]).
fn linear_to_parts(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    compute: DType,
    out: DType,
) -> CResult<Built<LinearIn>> {
    if !linear_to_applies(x, w, b, compute, out) {
        let y = linear(&x.to_dtype(compute)?, &w.to_dtype(compute)?, None)?;
        return match b {
            Some(b) => crate::fused::add(&y.to_dtype(b.dtype())?, b)?.to_dtype(out),
            None => y.to_dtype(out),
        }
        .map(Built::Plain);
    }
    let dims = x.dims().to_vec();
    let inner = dims[dims.len() - 1];
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let x = x.contiguous()?;
    let xc = x.detach().reshape((rows, inner))?.to_dtype(compute)?;
    // Contiguous for the GEMMs (a weight already in `compute` is not copied by the cast).
    let wc = w.detach().to_dtype(compute)?.contiguous()?;
    let mut out_dims = dims;
    if let Some(last) = out_dims.last_mut() {
        *last = w.dim(0)?;
    }
    let bias = b.map(|b| b.detach());
    let out_shape = Shape::from(out_dims.clone());
    // On CUDA the output as a storage the node takes as it is: one cuBLASLt matmul with the
    // bias in its epilogue (a bf16 product written as f32 where `out` is wider), else the
    // product in the output's dtype with the bias added in place, or the bf16 product cast to
    // f32 and the bias added in one pass (below).
    #[cfg(feature = "cuda")]
    let ready = if x.device().is_cuda() && (out == compute || out == DType::F32) {
        crate::cuda::linear_out(&xc, &wc, bias.as_ref(), out)?
    } else {
        None
    };
    #[cfg(not(feature = "cuda"))]
    let ready: Option<candle_core::CudaStorage> = None;
    let output = match ready {
        Some(s) => NodeOutput::Ready(candle_core::Storage::Cuda(s), out_shape),
        None => {
            let product = xc.matmul(&wc.t()?)?.reshape(out_dims)?;
            #[cfg(feature = "cuda")]
            let cast = match out {
                DType::F32 if product.device().is_cuda() => {
                    crate::cuda::cast_add_rows(&product, bias.as_ref())?
                }
                _ => None,
            };
            #[cfg(not(feature = "cuda"))]
            let cast: Option<candle_core::CudaStorage> = None;
            match cast {
                Some(s) => NodeOutput::Ready(candle_core::Storage::Cuda(s), out_shape),
                None => NodeOutput::Tensor(product),
            }
        }
    };
    // Kept unless the weight is recast in the backward; a weight already in `compute` is its
    // own cast (the same storage), kept either way.
    let keep = w.dtype() == compute || !RECAST_WEIGHTS.with(|c| c.get());
    let node = LinearIn {
        output: Mutex::new(Some(output)),
        out_dtype: out,
        bias,
        xc,
        wc: keep.then_some(wc),
        compute,
    };
    LINEAR_IN_NODES.with(|c| c.set(c.get() + 1));
    Ok(Built::Node(x, node))
}

/// `gelu(x @ w^T (+ b))` (GELU's tanh form) as ONE graph node: [`linear`]'s node with the GELU
/// applied to its output inside it. The pre-activation stays in the node for the backward
/// (the plain pair's graph keeps it as the linear's output), and the backward computes the
/// GELU gradient and hands it straight to the linear's gradients: no graph edge between the
/// two, so no `zeros_like` and add over the `[rows, out]` pre-activation gradient (candle's
/// backward makes one for every edge), and no separate GELU node. The same bits as
/// `fused::gelu(linear(x, w, b))` (a gradient's zero may differ in sign: the edge's add turned
/// -0 into +0). Where the fused GELU does not take the pre-activation's dtype or device, or the
/// linear is not one node, exactly that pair.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CResult<Tensor> {
    match linear_parts(x, w, b)? {
        Built::Node(x, node) => gelu_after(&x, w, b, node, x.dtype()),
        Built::Plain(y) => crate::fused::gelu(&y),
    }
}

/// [`linear_gelu`] for [`linear_to`]: `gelu(x @ w^T (+ b))` with the product in `compute` and
/// the pre-activation and the output in `out` (the GELU in f32, rounded once to `out`).
pub fn linear_gelu_to(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    compute: DType,
    out: DType,
) -> CResult<Tensor> {
    match linear_to_parts(x, w, b, compute, out)? {
        Built::Node(x, node) => gelu_after(&x, w, b, node, out),
        Built::Plain(y) => crate::fused::gelu(&y),
    }
}

/// The node of `parts` with GELU applied to its output of dtype `pre_dtype` ([`linear_gelu`]),
/// or the linear node followed by the GELU node where the fused GELU does not apply to it.
fn gelu_after<L: LinearParts + 'static>(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    parts: L,
    pre_dtype: DType,
) -> CResult<Tensor> {
    if !crate::fused::gelu_fuses(pre_dtype, x.device()) {
        return crate::fused::gelu(&apply_linear(x, w, b, parts)?);
    }
    // The linear's output, made as its node would make it, held (untracked) for the GELU.
    let pre = x.detach().apply_op1_no_bwd(&TakeOutput(&parts))?;
    let held = Held::default();
    let (slot, bytes) = (held.0.clone(), crate::storage::held_bytes(&pre));
    let y = apply_linear(
        x,
        w,
        b,
        GeluAfter {
            inner: parts,
            pre,
            _held: held,
        },
    )?;
    // Counted as activation memory with the node's output (`node_held_bytes`) until the node
    // (and with it the entry) is dropped.
    held_table().insert(y.id(), bytes);
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(y.id());
    Ok(y)
}

/// Bytes of tensors graph nodes of this crate hold for their backward outside the graph, by
/// the id of the node's output: what [`node_held_bytes`] reads.
fn held_table(
) -> std::sync::MutexGuard<'static, std::collections::HashMap<candle_core::TensorId, usize>> {
    static HELD: std::sync::OnceLock<
        Mutex<std::collections::HashMap<candle_core::TensorId, usize>>,
    > = std::sync::OnceLock::new();
    HELD.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A node's entry in [`held_table`], removed when the node is dropped (with the graph that
/// holds it): the table holds live nodes only.
#[derive(Default)]
struct Held(std::sync::Arc<Mutex<Option<candle_core::TensorId>>>);

impl Drop for Held {
    fn drop(&mut self) {
        let id = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(id) = id {
            held_table().remove(&id);
        }
    }
}

/// Bytes the graph node whose output is `t` keeps for its backward outside the graph (a
/// linear-GELU node's pre-activation: the plain pair's graph holds it as the linear's output),
/// 0 for any other tensor. `debug::graph_bytes` adds it, so activation memory counts what the
/// node holds.
pub fn node_held_bytes(t: &Tensor) -> usize {
    held_table().get(&t.id()).copied().unwrap_or(0)
}

/// A linear's output as its node's forward makes it, without the node: a no-backward op over
/// `x` (the backend's witness) whose forward is the parts' `output`.
struct TakeOutput<'a, L>(&'a L);

impl<L: LinearParts> TakeOutput<'_, L> {
    fn output<S: DeviceStorage>(&self, s: &S, _: &Layout) -> CResult<(S, Shape)> {
        self.0.output(s)
    }
}

impl<L: LinearParts> CustomOp1 for TakeOutput<'_, L> {
    fn name(&self) -> &'static str {
        L::NAME
    }

    crate::device_fwd1!(output);
}

/// A linear's parts with GELU after it ([`linear_gelu`]): the output is the GELU of the
/// linear's output `pre`, the backward the linear's from the GELU's gradient.
struct GeluAfter<L> {
    inner: L,
    pre: Tensor,
    _held: Held,
}

impl<L: LinearParts> LinearParts for GeluAfter<L> {
    const NAME: &'static str = "fused-linear-gelu";

    fn output<S: DeviceStorage>(&self, _: &S) -> CResult<(S, Shape)> {
        crate::fused::gelu_storage::<S>(&self.pre)
    }

    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
        bias: Option<DType>,
    ) -> CResult<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let dpre = crate::fused::gelu_grad(&self.pre, g)?;
        self.inner.grads(x, w, &dpre, bias)
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

/// Attention on a packed projection `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` with `scale > 0`,
/// as one graph node (f32 on the CPU: `autodiff::packed_sdpa_local` sends other dtypes and
/// devices elsewhere, and this takes the reference composition for them). The kernel reads
/// each head's q, k and v where they lie in the packed rows and writes the output, and in the
/// backward the packed gradient, directly: no head split, transpose or merge is copied, no
/// `[B, H, T, T]` tensor is made, and the (batch, head) pairs run in parallel.
pub fn packed_sdpa(qkv: &Tensor, causal: bool, scale: f32) -> CResult<Tensor> {
    packed_sdpa_in(qkv, None, causal, scale)
}

/// [`packed_sdpa`] on the projection as the QKV linear makes it, `qkv [B, T, 3 heads d]` ->
/// `[B, T, heads d]`: the same node, its views of the packed layout taken inside it, so the
/// reshapes to and from `[B, T, heads, 3, d]` cost no graph edges either.
///
/// # Errors
///
/// `qkv` is not `[B, T, 3 heads d]`.
pub fn packed_sdpa_flat(qkv: &Tensor, heads: usize, causal: bool, scale: f32) -> CResult<Tensor> {
    packed_sdpa_in(qkv, Some(heads), causal, scale)
}

/// [`packed_sdpa`] (`flat` `None`) or [`packed_sdpa_flat`] (`Some(heads)`): the CPU kernel
/// of `fused::attention` for f32 on the CPU, forward and backward, else the reference
/// composition.
fn packed_sdpa_in(qkv: &Tensor, flat: Option<usize>, causal: bool, scale: f32) -> CResult<Tensor> {
    use crate::fused::attention::{self, Packed};
    // The packed layout [B, T, H, 3, d] the node computes on, and the output's shape.
    let (p, out): (Packed, Vec<usize>) = match (flat, qkv.dims()) {
        (None, &[b, t, h, 3, d]) => (Packed { b, t, h, d }, vec![b, t, h, d]),
        (Some(h), &[b, t, w]) if h > 0 && w % (3 * h) == 0 => {
            let d = w / (3 * h);
            (Packed { b, t, h, d }, vec![b, t, h * d])
        }
        (_, dims) => {
            return Err(crate::error::KernelError::Mismatch {
                op: "packed_sdpa",
                detail: format!(
                    "qkv {dims:?}: [B, T, H, 3, d], or [B, T, 3 x heads x d] with {flat:?} heads"
                ),
            }
            .into())
        }
    };
    // The kernel's softmax takes the row maximum of the unscaled scores as the scaled ones'.
    if !crate::fused::applies(qkv) || scale.is_nan() || scale <= 0.0 {
        let five = qkv.reshape((p.b, p.t, p.h, 3, p.d))?;
        return crate::autodiff::reference::packed_sdpa(&five, causal, f64::from(scale))?
            .reshape(out);
    }
    let x = qkv.contiguous()?;
    let y = with_slice::<f32, _>(&x, |s| attention::forward(s, p, causal, scale))??;
    let y = Tensor::from_vec(y, out, x.device())?;
    if !tracked(&[&x]) {
        return Ok(y);
    }
    node1("fused-packed-sdpa", &x, y, move |x, g| {
        let g = g.contiguous()?;
        let dx = with_slice::<f32, _>(x, |xs| {
            with_slice::<f32, _>(&g, |gs| attention::backward(xs, gs, p, causal, scale))
        })???;
        Tensor::from_vec(dx, x.shape(), x.device())
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
