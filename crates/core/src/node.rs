//! Graph nodes for collectives.
//!
//! candle only lets user code add graph nodes through `CustomOp`s, and a `CustomOp`'s forward
//! must return a freshly owned storage. A collective's output, however, is written by the
//! communicator into a tensor. So a collective becomes two steps: [`node`] records the graph node
//! (its forward returns a zeroed output of the right shape, its backward runs the adjoint
//! collective), then the communicator writes the real data into that output in place; the data
//! lands once, where it stays. The zeroing is not free: since the local backend makes glibc
//! reuse freed large blocks (`comm::memory`), a reused block is cleared by `calloc`. Untracked
//! inputs (e.g. `redistribute_bench`) skip the node and its zeroing.
//! An input that does not track gradients gets no node at all.

use std::sync::Arc;

use candle_core::{CustomOp1, Layout, Shape, Tensor};
use candle_dtensor_kernels::storage::{zeros_like, DeviceStorage};

/// The backward of a node: `(input, output, gradient of the output)` in, the gradient of the
/// input out.
pub(crate) type Backward =
    Arc<dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

struct Node {
    name: &'static str,
    shape: Shape,
    backward: Backward,
    /// The CommDebugMode label active when the forward ran (for the backward's records).
    label: Option<Arc<str>>,
}

impl Node {
    fn forward<S: DeviceStorage>(&self, s: &S, _: &Layout) -> candle_core::Result<(S, Shape)> {
        Ok((zeros_like(s, &self.shape, s.dtype())?, self.shape.clone()))
    }
}

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        self.name
    }

    candle_dtensor_kernels::device_fwd1!(forward);

    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let _phase = crate::debug::enter_backward_labeled(self.label.clone());
        (self.backward)(arg, res, grad_res).map(Some)
    }
}

/// A zeroed tensor of `shape` recorded in the graph as a function of `x` whose gradient is
/// `backward(grad)`. The caller fills it in place.
pub(crate) fn node(
    x: &Tensor,
    name: &'static str,
    shape: impl Into<Shape>,
    backward: Backward,
) -> candle_core::Result<Tensor> {
    x.apply_op1(Node {
        name,
        shape: shape.into(),
        backward,
        label: crate::debug::current_label(),
    })
}

/// Ties `x` into the graph of the EMPTY tensor `out`: forward a copy of `out`, backward the
/// gradient to `out` and zeros to `x`.
struct Keep;

impl Keep {
    fn forward<S: DeviceStorage>(
        &self,
        s1: &S,
        l1: &Layout,
        _: &S,
        _: &Layout,
    ) -> candle_core::Result<(S, Shape)> {
        if l1.shape().elem_count() != 0 {
            return Err(candle_core::Error::Msg(
                "dtensor-keep takes an empty tensor".into(),
            ));
        }
        Ok((zeros_like(s1, l1.shape(), s1.dtype())?, l1.shape().clone()))
    }
}

impl candle_core::CustomOp2 for Keep {
    fn name(&self) -> &'static str {
        "dtensor-keep"
    }

    candle_dtensor_kernels::device_fwd2!(forward);

    fn bwd(
        &self,
        _out: &Tensor,
        x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(x.zeros_like()?)))
    }
}

/// Makes an empty local result depend on every input that tracks gradients, in order.
///
/// candle short-circuits ops whose result has no elements (a binary op returns its left operand,
/// dropping the right one from the graph). Backward collectives are graph nodes, so a rank whose
/// piece happens to be empty would otherwise skip the adjoint collectives of the dropped inputs
/// while the other ranks run them: a desync. Tying the inputs back in keeps every rank's graph
/// (and the order of its backward collectives) the same.
pub(crate) fn keep_inputs(out: Tensor, inputs: &[Tensor]) -> candle_core::Result<Tensor> {
    if out.elem_count() != 0 || !out.dtype().is_float() {
        return Ok(out);
    }
    let mut out = out;
    for x in inputs {
        if x.track_op() && x.dtype().is_float() {
            out = out.apply_op2(x, Keep)?;
        }
    }
    Ok(out)
}

/// Zeros of `dims` that depend on `x` in the graph (gradient zero). `x * 0.0` would not do:
/// candle's backward does not walk through an `affine` with multiplier 0, which would drop `x`
/// (and its adjoint collectives) from this rank's backward only.
pub(crate) fn graph_zeros(x: &Tensor, dims: &[usize]) -> candle_core::Result<Tensor> {
    let zero = Tensor::zeros((), x.dtype(), x.device())?;
    x.sum_all()?.mul(&zero)?.broadcast_as(dims)
}
