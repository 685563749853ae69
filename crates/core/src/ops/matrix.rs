//! Matrix products: `matmul` (mm / bmm), `broadcast_matmul`, `linear`.

use candle_core::{DType, Tensor};
use candle_dtensor_strategies::{Op, Placement};

use crate::dispatch::{run1, run1_with};
use crate::error::Result;
use crate::tensor::DTensor;

/// `x @ w^T (+ b)` on local pieces, flattening leading dims into one GEMM like candle-nn.
pub(crate) fn linear_local(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    if crate::region::linear_applies(x, w, b) {
        return crate::region::linear(x, w, b);
    }
    let wt = w.t()?;
    let y = match x.dims() {
        [_] => x.unsqueeze(0)?.matmul(&wt)?.squeeze(0)?,
        [_, _] => x.matmul(&wt)?,
        dims if dims.len() > 2 && x.is_contiguous() => {
            let inner = dims[dims.len() - 1];
            let lead: Vec<usize> = dims[..dims.len() - 1].to_vec();
            // Explicit row count: `()` cannot be inferred for an empty piece.
            let rows: usize = lead.iter().product();
            let y = x.reshape((rows, inner))?.matmul(&wt)?;
            let mut out = lead;
            out.push(w.dim(0)?);
            y.reshape(out)?
        }
        _ => x.broadcast_matmul(&wt)?,
    };
    match b {
        Some(b) => crate::fused::add(&y, b),
        None => Ok(y),
    }
}

/// Whether a bias of `b`'s dtype may go with a weight of `master` computed in `compute`: a
/// weight already in the compute dtype (FSDP's gathered bf16 parameters, multiplied as they
/// are) takes a bias of any float dtype (f32: added to the f32 accumulator as for f32 master
/// weights).
fn bias_dtype_ok(master: DType, b: &DTensor, compute: DType) -> bool {
    b.dtype() == master || (master == compute && b.dtype().is_float())
}

/// `x` labelled `dtype` for the strategies (its local piece unchanged).
fn relabel_to(x: &DTensor, dtype: DType) -> Result<DTensor> {
    if x.dtype() == dtype {
        Ok(x.clone())
    } else {
        x.relabelled(dtype)
    }
}

/// The local piece of a linear whose GEMM runs in `compute` and whose output is in `out`, as
/// each of the linear methods runs it for these dtypes (`linear_with_layout`'s `linear_local`,
/// `linear_with_layout_in`'s one node or its casts, `linear_with_layout_to`'s
/// `region::linear_to`), with the GELU after it when `gelu` (in the linear's node where that
/// op is one node, `region::linear_gelu*`, else the fused GELU after it): the local op of
/// [`DTensor::linear_gelu_with_layout_to`].
fn local_linear_act(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    compute: DType,
    out: DType,
    gelu: bool,
) -> candle_core::Result<Tensor> {
    let act = |y: Tensor| if gelu { crate::fused::gelu(&y) } else { Ok(y) };
    let master = w.dtype();
    if x.dtype() == master && out == master && b.is_none_or(|b| b.dtype() == master) {
        if compute == master {
            if gelu && crate::region::linear_applies(x, w, b) {
                return crate::region::linear_gelu(x, w, b);
            }
            return act(linear_local(x, w, b)?);
        }
        if crate::region::linear_in_applies(x, w, b, compute) {
            return if gelu {
                crate::region::linear_gelu_to(x, w, b, compute, out)
            } else {
                crate::region::linear_in(x, w, b, compute)
            };
        }
        let y = cast(
            &linear_local(&cast(x, compute)?, &cast(w, compute)?, None)?,
            out,
        )?;
        return act(match b {
            Some(b) => crate::fused::add(&y, b)?,
            None => y,
        });
    }
    if gelu {
        crate::region::linear_gelu_to(x, w, b, compute, out)
    } else {
        crate::region::linear_to(x, w, b, compute, out)
    }
}

/// `beta * bias + alpha * (a @ b)` on local pieces.
fn baddbmm_local(
    bias: &Tensor,
    a: &Tensor,
    b: &Tensor,
    alpha: f64,
    beta: f64,
) -> candle_core::Result<Tensor> {
    let prod = a.matmul(b)?;
    let prod = if alpha == 1.0 {
        prod
    } else {
        prod.affine(alpha, 0.0)?
    };
    let bias = if beta == 1.0 {
        bias.clone()
    } else {
        bias.affine(beta, 0.0)?
    };
    prod.broadcast_add(&bias)
}

impl DTensor {
    /// `beta * self + alpha * (a @ b)` with `a [B, n, k]`, `b [B, k, m]` and `self` (the bias)
    /// broadcastable to `[B, n, m]` (torch.baddbmm). Contracting over a sharded `k` gives
    /// `P(sum)` with the bias added once (a free local partition of a replicated bias).
    pub fn baddbmm(&self, a: &DTensor, b: &DTensor, alpha: f64, beta: f64) -> Result<DTensor> {
        let op = Op::Baddbmm {
            alpha: alpha.into(),
            beta: beta.into(),
        };
        run1(&op, &[self, a, b], |p| {
            baddbmm_local(&p.locals[0], &p.locals[1], &p.locals[2], alpha, beta)
        })
    }

    /// `[..b, m, k] @ [..b, k, n]` with equal batch dims.
    pub fn matmul(&self, rhs: &DTensor) -> Result<DTensor> {
        run1(&Op::Matmul, &[self, rhs], |p| {
            p.locals[0].matmul(&p.locals[1])
        })
    }

    /// Like [`DTensor::matmul`] with numpy-broadcast batch dims.
    pub fn broadcast_matmul(&self, rhs: &DTensor) -> Result<DTensor> {
        run1(&Op::BroadcastMatmul, &[self, rhs], |p| {
            p.locals[0].broadcast_matmul(&p.locals[1])
        })
    }

    /// `x @ w^T + b` with `w: [out, in]`, `b: [out]`, `x: [.., in]` (as `candle_nn::Linear`).
    ///
    /// A row-parallel linear (`x` sharded on `in`, `w` on dim 1) produces a `P(sum)` output
    /// without communication; a replicated bias joins it as `P(sum)` (a free local partition:
    /// each rank adds `b / n`), so the bias is added once in the reduced value.
    pub fn linear(&self, w: &DTensor, b: Option<&DTensor>) -> Result<DTensor> {
        self.linear_with_layout(w, b, None)
    }

    /// [`DTensor::linear`] with the placements `x` must have for the product fixed by the caller
    /// (a tensor-parallel style's input layout, e.g. Replicate for a column-parallel linear fed a
    /// sequence-sharded activation). Dispatch then redistributes `x` itself, so its all_gather
    /// fuses with the gradient sync: one all_gather forward, one reduce_scatter backward.
    pub fn linear_with_layout(
        &self,
        w: &DTensor,
        b: Option<&DTensor>,
        input_layout: Option<&[Placement]>,
    ) -> Result<DTensor> {
        let op = Op::Linear { bias: b.is_some() };
        match b {
            Some(b) => run1_with(&op, &[self, w, b], &[input_layout], |p| {
                linear_local(&p.locals[0], &p.locals[1], Some(&p.locals[2]))
            }),
            None => run1_with(&op, &[self, w], &[input_layout], |p| {
                linear_local(&p.locals[0], &p.locals[1], None)
            }),
        }
    }
}

/// `a` cast to `dtype` (no node when it already is).
fn cast(a: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if a.dtype() == dtype {
        Ok(a.clone())
    } else {
        a.to_dtype(dtype)
    }
}

impl DTensor {
    /// [`DTensor::linear_with_layout`] with the GEMM computed in `compute` (mixed precision):
    /// dispatch places the inputs in their own dtype, then each rank casts its pieces of `x`
    /// and `w` to `compute`, multiplies, and casts the product back to `x`'s dtype before
    /// adding the bias (kept in that dtype). So every collective dispatch adds (the input's
    /// all_gather, the gradient sync of a replicated weight) runs in the inputs' dtype: with
    /// f32 master weights the gradient reduction is f32, and only the GEMM runs in `compute`
    /// (on CUDA and the CPU, candle's bf16 GEMM accumulates in f32). With `compute` equal to
    /// `x`'s dtype this is [`DTensor::linear_with_layout`]. `x`, `w` and `b` share a dtype.
    pub fn linear_with_layout_in(
        &self,
        w: &DTensor,
        b: Option<&DTensor>,
        input_layout: Option<&[Placement]>,
        compute: DType,
    ) -> Result<DTensor> {
        let out = self.dtype();
        if compute == out {
            return self.linear_with_layout(w, b, input_layout);
        }
        let op = Op::Linear { bias: b.is_some() };
        // One graph node where the region applies (`region::linear_in`: edges to x, w and b
        // only); else the casts around `linear_local`, and the bias added in x's dtype.
        let gemm =
            move |x: &Tensor, w: &Tensor, b: Option<&Tensor>| -> candle_core::Result<Tensor> {
                if crate::region::linear_in_applies(x, w, b, compute) {
                    return crate::region::linear_in(x, w, b, compute);
                }
                let y = cast(
                    &linear_local(&cast(x, compute)?, &cast(w, compute)?, None)?,
                    out,
                )?;
                match b {
                    Some(b) => crate::fused::add(&y, b),
                    None => Ok(y),
                }
            };
        match b {
            Some(b) => run1_with(&op, &[self, w, b], &[input_layout], |p| {
                gemm(&p.locals[0], &p.locals[1], Some(&p.locals[2]))
            }),
            None => run1_with(&op, &[self, w], &[input_layout], |p| {
                gemm(&p.locals[0], &p.locals[1], None)
            }),
        }
    }

    /// [`DTensor::linear_with_layout_in`] with `self` in any float dtype and the output in
    /// `out` (autocast's data flow for bf16 activations: the QKV projection's output feeding
    /// bf16 attention, the MLP's `fc1 -> GELU -> fc2` in bf16, with no cast of the activation
    /// outside the op). `w` and `b` share one dtype (the master weights'), or `w` is already
    /// in `compute` and `b` any float (FSDP's gathered bf16 parameters under a bf16 GEMM,
    /// multiplied as they are: no f32 copy of the weight for the graph to keep); each rank
    /// casts its pieces of `x` (no op for one already in `compute`) and `w` to `compute`,
    /// multiplies, adds the bias in its own dtype and rounds the sum to `out`, as one graph
    /// node (`region::linear_to`). Placements are chosen as for a linear of `w`'s dtype; so
    /// the collectives dispatch adds run on the pieces as they are (a bf16 `x`'s all_gather in
    /// bf16, the gradient sync of a replicated weight in its own dtype). With `x`, `b` and
    /// `out` all in `w`'s dtype this is [`DTensor::linear_with_layout_in`].
    pub fn linear_with_layout_to(
        &self,
        w: &DTensor,
        b: Option<&DTensor>,
        input_layout: Option<&[Placement]>,
        compute: DType,
        out: DType,
    ) -> Result<DTensor> {
        let master = w.dtype();
        let b_master = b.is_none_or(|b| b.dtype() == master);
        if self.dtype() == master && out == master && b_master {
            return self.linear_with_layout_in(w, b, input_layout, compute);
        }
        if let Some(b) = b.filter(|b| !bias_dtype_ok(master, b, compute)) {
            return Err(crate::error::invalid(
                "linear",
                self.mesh_rank(),
                format!(
                    "bias of {:?} for a weight of {master:?} computed in {compute:?} (they \
                     share one dtype, or the weight is in the compute dtype and the bias a \
                     float)",
                    b.dtype()
                ),
            ));
        }
        if !self.dtype().is_float() || !out.is_float() {
            return Err(crate::error::invalid(
                "linear",
                self.mesh_rank(),
                format!("x of {:?} to {out:?}: float dtypes only", self.dtype()),
            ));
        }
        // The strategies see x (and the bias) in the weight's dtype; the local op converts it.
        let x = relabel_to(self, master)?;
        let b = b.map(|b| relabel_to(b, master)).transpose()?;
        let b = b.as_ref();
        let op = Op::Linear { bias: b.is_some() };
        let y = match b {
            Some(b) => run1_with(&op, &[&x, w, b], &[input_layout], |p| {
                crate::region::linear_to(
                    &p.locals[0],
                    &p.locals[1],
                    Some(&p.locals[2]),
                    compute,
                    out,
                )
            }),
            None => run1_with(&op, &[&x, w], &[input_layout], |p| {
                crate::region::linear_to(&p.locals[0], &p.locals[1], None, compute, out)
            }),
        }?;
        if out == master {
            Ok(y)
        } else {
            y.relabelled(out)
        }
    }

    /// `gelu(x W^T (+ b))` (GELU's tanh form): [`DTensor::linear_with_layout_to`] (placements
    /// as for a linear of `w`'s dtype, the GEMM in `compute`, the output in `out`) with the GELU
    /// of its output in the same graph node (`region::linear_gelu`: no edge between the linear
    /// and the GELU, whose backward candle would pay as a `zeros_like` and an add over the
    /// pre-activation), the same values as the linear followed by [`DTensor::gelu`]. Where the
    /// compiler makes the linear's output a partial sum (a row-parallel piece, whose GELU is
    /// not the piece of the GELU), exactly that pair: the GELU after the reduction.
    pub fn linear_gelu_with_layout_to(
        &self,
        w: &DTensor,
        b: Option<&DTensor>,
        input_layout: Option<&[Placement]>,
        compute: DType,
        out: DType,
    ) -> Result<DTensor> {
        let master = w.dtype();
        if b.is_some_and(|b| !bias_dtype_ok(master, b, compute))
            || !self.dtype().is_float()
            || !out.is_float()
        {
            // The linear's own typed errors.
            return self
                .linear_with_layout_to(w, b, input_layout, compute, out)?
                .gelu();
        }
        // The strategies see x (and the bias) in the weight's dtype, as for the linear.
        let x = relabel_to(self, master)?;
        let b = b.map(|b| relabel_to(b, master)).transpose()?;
        let b = b.as_ref();
        let op = Op::Linear { bias: b.is_some() };
        let inputs: Vec<&DTensor> = [&x, w].into_iter().chain(b).collect();
        // Whether the compiler made the output a partial sum: then the local op is the linear
        // alone, and the GELU follows the reduction.
        let partial = std::cell::Cell::new(false);
        let y = run1_with(&op, &inputs, &[input_layout], |p| {
            let part = p
                .sharding
                .output_specs
                .iter()
                .any(|o| o.placements.iter().any(|q| q.is_partial()));
            partial.set(part);
            local_linear_act(
                &p.locals[0],
                &p.locals[1],
                p.locals.get(2),
                compute,
                out,
                !part,
            )
        })?;
        let y = if out == master { y } else { y.relabelled(out)? };
        if partial.get() {
            y.gelu()
        } else {
            Ok(y)
        }
    }

    /// [`DTensor::matmul`] computed in `compute`: the local pieces are cast to `compute`, multiplied
    /// and the product cast back to `self`'s dtype (see [`DTensor::linear_with_layout_in`]).
    pub fn matmul_in(&self, rhs: &DTensor, compute: DType) -> Result<DTensor> {
        let out = self.dtype();
        if compute == out {
            return self.matmul(rhs);
        }
        run1(&Op::Matmul, &[self, rhs], |p| {
            cast(
                &cast(&p.locals[0], compute)?.matmul(&cast(&p.locals[1], compute)?)?,
                out,
            )
        })
    }
}

/// The matrix family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    Ok(vec![match op {
        Op::Matmul => x[0].matmul(x[1])?,
        Op::BroadcastMatmul => x[0].broadcast_matmul(x[1])?,
        Op::Linear { .. } => x[0].linear(x[1], x.get(2).copied())?,
        Op::Baddbmm { alpha, beta } => x[0].baddbmm(x[1], x[2], alpha.get(), beta.get())?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

/// The matrix family on one device.
pub(crate) fn single_device(op: &Op, x: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    Ok(vec![match op {
        Op::Matmul => x[0].matmul(&x[1])?,
        Op::BroadcastMatmul => x[0].broadcast_matmul(&x[1])?,
        Op::Linear { bias } => {
            let y = if x[0].rank() == 1 {
                x[0].unsqueeze(0)?.matmul(&x[1].t()?)?.squeeze(0)?
            } else {
                x[0].broadcast_matmul(&x[1].t()?)?
            };
            if *bias {
                y.broadcast_add(&x[2])?
            } else {
                y
            }
        }
        Op::Baddbmm { alpha, beta } => baddbmm_local(&x[0], &x[1], &x[2], alpha.get(), beta.get())?,
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
