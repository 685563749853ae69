//! The local, differentiable pieces of a mixture-of-experts layer, each ONE graph node with a
//! hand-written backward ([`candle_dtensor_kernels::region::node1`] and friends).
//!
//! Why nodes of our own rather than candle's ops: how many rows a rank sends, receives or
//! computes per expert depends on the routing, and candle drops graph edges of empty
//! elementwise results (an empty product returns its left operand). A rank whose experts got
//! no tokens would then lose its expert weights' gradient, and with it their backward
//! collectives (FSDP's reduce_scatter, the data-parallel all_reduce), while its peers run
//! them: a hang. These nodes keep every edge whatever the counts (empty inputs give empty or
//! zero gradients), so every rank builds the same graph. Computed with candle ops on detached
//! tensors: any dtype and device.

use std::sync::Arc;

use candle_core::{DType, Tensor, D};
use candle_dtensor_kernels::fused;
use candle_dtensor_kernels::region::{node1, node2, node3};

use super::routing::Segment;

type CResult<T> = candle_core::Result<T>;

fn ids_tensor(ids: &[u32], like: &Tensor) -> CResult<Tensor> {
    Tensor::from_slice(ids, ids.len(), like.device())
}

/// Rows `ids` of `x: [N, D]` -> `[M, D]` (the dispatch permutation). Backward: the gradient
/// rows added back into `[N, D]` (zero for tokens no row took).
pub fn gather_rows(x: &Tensor, ids: &Arc<Vec<u32>>) -> CResult<Tensor> {
    let (n, d) = x.dims2()?;
    let pick = |x: &Tensor| -> CResult<Tensor> {
        if ids.is_empty() {
            return Tensor::zeros((0, d), x.dtype(), x.device());
        }
        x.contiguous()?.index_select(&ids_tensor(ids, x)?, 0)
    };
    if !x.track_op() {
        return pick(x);
    }
    let y = pick(&x.detach())?;
    let ids = ids.clone();
    node1("moe-gather-rows", x, y, move |x, g| {
        let out = Tensor::zeros((n, d), g.dtype(), x.device())?;
        if ids.is_empty() {
            return Ok(out);
        }
        out.index_add(&ids_tensor(&ids, x)?, &g.contiguous()?, 0)
    })
}

/// `y[rows of segment] = x[rows] @ w[e]^T + b[e]` for every segment (`x: [R, in]`,
/// `w: [E_local, out, in]`, `b: [E_local, out]`, segments covering `0..R` in order): the
/// grouped GEMM of the local experts, one matmul per non-empty segment, no per-token work.
/// Backward: `dx = g @ w[e]`, `dw[e] = sum of g^T x`, `db[e] = sum of g` over its segments
/// (zeros for an expert without rows).
pub fn grouped_linear(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    segments: &Arc<Vec<Segment>>,
) -> CResult<Tensor> {
    let (rows, _) = x.dims2()?;
    let (_, out_f, _) = w.dims3()?;
    let covered: usize = segments.iter().map(|s| s.len).sum();
    if covered != rows {
        return Err(candle_core::Error::Msg(format!(
            "moe grouped_linear: segments cover {covered} rows of {rows}"
        )));
    }
    let forward = |x: &Tensor, w: &Tensor, b: &Tensor| -> CResult<Tensor> {
        let mut parts = Vec::with_capacity(segments.len());
        for s in segments.iter().filter(|s| s.len > 0) {
            let xs = x.narrow(0, s.start, s.len)?;
            let y = xs.matmul(&w.get(s.expert)?.t()?)?;
            parts.push(y.broadcast_add(&b.get(s.expert)?)?);
        }
        if parts.is_empty() {
            return Tensor::zeros((rows, out_f), x.dtype(), x.device());
        }
        Tensor::cat(&parts, 0)
    };
    let x = x.contiguous()?;
    if !(x.track_op() || w.track_op() || b.track_op()) {
        return forward(&x, w, b);
    }
    let y = forward(&x.detach(), &w.detach(), &b.detach())?;
    let segs = segments.clone();
    node3("moe-grouped-linear", &x, w, b, y, move |x, w, b, g| {
        let g = g.contiguous()?;
        let e_local = w.dim(0)?;
        let mut dw: Vec<Option<Tensor>> = vec![None; e_local];
        let mut db: Vec<Option<Tensor>> = vec![None; e_local];
        let mut dx = Vec::with_capacity(segs.len());
        let add = |acc: &mut Option<Tensor>, t: Tensor| -> CResult<()> {
            *acc = Some(match acc.take() {
                Some(a) => (a + t)?,
                None => t,
            });
            Ok(())
        };
        for s in segs.iter().filter(|s| s.len > 0) {
            let gs = g.narrow(0, s.start, s.len)?;
            let xs = x.narrow(0, s.start, s.len)?;
            let we = w.get(s.expert)?;
            dx.push(gs.matmul(&we)?);
            add(&mut dw[s.expert], gs.t()?.matmul(&xs)?)?;
            add(&mut db[s.expert], gs.sum(0)?)?;
        }
        let dx = if dx.is_empty() {
            x.zeros_like()?
        } else {
            Tensor::cat(&dx, 0)?
        };
        let stack = |parts: Vec<Option<Tensor>>, like: &Tensor| -> CResult<Tensor> {
            if parts.is_empty() {
                return like.zeros_like();
            }
            let zero = like.get(0)?.zeros_like()?;
            let parts: Vec<Tensor> = parts
                .into_iter()
                .map(|p| p.unwrap_or_else(|| zero.clone()))
                .collect();
            Tensor::stack(&parts, 0)
        };
        Ok((dx, stack(dw, w)?, stack(db, b)?))
    })
}

/// SwiGLU's gate `silu(a) * g` as one node (both edges kept for empty inputs).
pub fn swiglu(a: &Tensor, g: &Tensor) -> CResult<Tensor> {
    if !(a.track_op() || g.track_op()) {
        return a.silu()?.mul(g);
    }
    let y = a.detach().silu()?.mul(&g.detach())?;
    node2("moe-swiglu", a, g, y, |a, g, grad| {
        // sigmoid(a) = 1 / (1 + exp(-a)); silu'(a) = s (1 + a (1 - s)).
        let s = (a.neg()?.exp()? + 1.0)?.recip()?;
        let silu = a.mul(&s)?;
        let dsilu = s.mul(&((a.mul(&s.affine(-1.0, 1.0)?)?) + 1.0)?)?;
        Ok((grad.mul(g)?.mul(&dsilu)?, grad.mul(&silu)?))
    })
}

/// The combine: `out[t] = sum over the rows j of token t of gates[t, slot_j] * y[j]` for
/// `y: [M, D]` (the expert outputs back in send order), `gates: [N, top_k]` (f32, the router's
/// weights) and `slots[j] = t * top_k + slot`; computed in f32 and returned in `y`'s dtype as
/// `[N, D]`. A token none of whose assignments was kept gets zeros (it passes the layer on the
/// residual). Backward: `dy[j] = gates[t, s] * dout[t]`, `dgates[t, s] = <dout[t], y[j]>`
/// (zero for dropped assignments).
pub fn weighted_combine(
    y: &Tensor,
    gates: &Tensor,
    slots: &Arc<Vec<u32>>,
    n: usize,
) -> CResult<Tensor> {
    let (m, d) = y.dims2()?;
    let (gn, k) = gates.dims2()?;
    if m != slots.len() || gn != n {
        return Err(candle_core::Error::Msg(format!(
            "moe weighted_combine: {m} rows for {} slots, gates {:?} for {n} tokens",
            slots.len(),
            gates.dims()
        )));
    }
    let dtype = y.dtype();
    let tokens: Arc<Vec<u32>> = Arc::new(slots.iter().map(|&i| i / k as u32).collect());
    // f32 on the CPU: one pass ([`fused::weighted_scatter_add`]); any other dtype or device:
    // the candle composition below, which is the reference the kernel is tested against.
    let fused_path = fused::applies(y) && fused::applies(gates);
    let forward = |y: &Tensor, gates: &Tensor| -> CResult<Tensor> {
        if fused_path {
            return fused::weighted_scatter_add(y, gates, slots, k, n);
        }
        let out = Tensor::zeros((n, d), DType::F32, y.device())?;
        if m == 0 {
            return out.to_dtype(dtype);
        }
        let g = gates
            .to_dtype(DType::F32)?
            .flatten_all()?
            .index_select(&ids_tensor(slots, y)?, 0)?;
        let w = y.to_dtype(DType::F32)?.broadcast_mul(&g.unsqueeze(1)?)?;
        out.index_add(&ids_tensor(&tokens, y)?, &w, 0)?
            .to_dtype(dtype)
    };
    if !(y.track_op() || gates.track_op()) {
        return forward(y, gates);
    }
    let out = forward(&y.detach(), &gates.detach())?;
    let slots = slots.clone();
    node2("moe-combine", y, gates, out, move |y, gates, grad| {
        let gdt = gates.dtype();
        if m == 0 {
            return Ok((y.zeros_like()?, gates.zeros_like()?));
        }
        if fused_path && fused::applies(grad) {
            return fused::weighted_scatter_add_backward(y, gates, &slots, k, grad);
        }
        let sl = ids_tensor(&slots, y)?;
        let rows = grad
            .to_dtype(DType::F32)?
            .contiguous()?
            .index_select(&ids_tensor(&tokens, y)?, 0)?;
        let g = gates
            .to_dtype(DType::F32)?
            .flatten_all()?
            .index_select(&sl, 0)?;
        let dy = rows.broadcast_mul(&g.unsqueeze(1)?)?.to_dtype(y.dtype())?;
        let dg = rows.mul(&y.to_dtype(DType::F32)?)?.sum(D::Minus1)?;
        let dgates = Tensor::zeros(n * k, DType::F32, y.device())?
            .index_add(&sl, &dg, 0)?
            .reshape((n, k))?
            .to_dtype(gdt)?;
        Ok((dy, dgates))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use candle_dtensor_kernels::compare::{abs_sum, max_abs_diff};

    fn close(a: &Tensor, b: &Tensor) {
        let d = max_abs_diff(a, b).unwrap();
        assert!(d < 1e-5, "{a} vs {b}");
    }

    fn randn(dims: &[usize], seed: u64) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    #[test]
    fn grouped_linear_matches_per_row_linears_and_keeps_empty_experts() {
        // Three local experts; expert 2 gets no rows.
        let x = Var::from_tensor(&randn(&[5, 4], 1)).unwrap();
        let w = Var::from_tensor(&randn(&[3, 6, 4], 2)).unwrap();
        let b = Var::from_tensor(&randn(&[3, 6], 3)).unwrap();
        let segs = Arc::new(vec![
            Segment {
                start: 0,
                len: 2,
                expert: 1,
            },
            Segment {
                start: 2,
                len: 0,
                expert: 2,
            },
            Segment {
                start: 2,
                len: 3,
                expert: 0,
            },
        ]);
        let y = grouped_linear(x.as_tensor(), w.as_tensor(), b.as_tensor(), &segs).unwrap();
        let experts = [1usize, 1, 0, 0, 0];
        let reference: Vec<Tensor> = experts
            .iter()
            .enumerate()
            .map(|(r, &e)| {
                x.as_tensor()
                    .narrow(0, r, 1)
                    .unwrap()
                    .matmul(&w.as_tensor().get(e).unwrap().t().unwrap())
                    .unwrap()
                    .broadcast_add(&b.as_tensor().get(e).unwrap())
                    .unwrap()
            })
            .collect();
        let reference = Tensor::cat(&reference, 0).unwrap();
        close(&y, &reference);
        let wy = randn(&[5, 6], 4);
        let g1 = (y * &wy).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (reference * &wy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&x, &w, &b] {
            close(g1.get(v).unwrap(), g2.get(v).unwrap());
        }
        // Expert 2's gradient exists and is zero.
        let dw = g1.get(&w).unwrap().get(2).unwrap();
        assert_eq!(abs_sum(&dw).unwrap(), 0.0);
        // No rows at all: every input still gets a gradient (the edges stay).
        let x0 =
            Var::from_tensor(&Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap()).unwrap();
        let none = Arc::new(vec![Segment {
            start: 0,
            len: 0,
            expert: 0,
        }]);
        let y0 = grouped_linear(x0.as_tensor(), w.as_tensor(), b.as_tensor(), &none).unwrap();
        let g = y0.sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_some() && g.get(&b).is_some());
    }

    #[test]
    fn gather_combine_and_swiglu_match_candle_autograd() {
        let x = Var::from_tensor(&randn(&[4, 3], 5)).unwrap();
        let ids = Arc::new(vec![2u32, 0, 2, 3]);
        let y = gather_rows(x.as_tensor(), &ids).unwrap();
        let r = x
            .as_tensor()
            .index_select(&Tensor::new(&[2u32, 0, 2, 3], &Device::Cpu).unwrap(), 0)
            .unwrap();
        close(&y, &r);
        let gates = Var::from_tensor(&randn(&[4, 2], 6)).unwrap();
        // Rows: token 2 slot 1, token 0 slot 0, token 2 slot 0, token 3 slot 1.
        let slots = Arc::new(vec![5u32, 0, 4, 7]);
        let out = weighted_combine(&y, gates.as_tensor(), &slots, 4).unwrap();
        let gsel = gates
            .as_tensor()
            .flatten_all()
            .unwrap()
            .index_select(&Tensor::new(&[5u32, 0, 4, 7], &Device::Cpu).unwrap(), 0)
            .unwrap();
        let rout = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)
            .unwrap()
            .index_add(
                &Tensor::new(&[2u32, 0, 2, 3], &Device::Cpu).unwrap(),
                &r.broadcast_mul(&gsel.unsqueeze(1).unwrap()).unwrap(),
                0,
            )
            .unwrap();
        close(&out, &rout);
        let a = Var::from_tensor(&randn(&[4, 3], 8)).unwrap();
        let s1 = swiglu(a.as_tensor(), &out).unwrap();
        let s2 = a.as_tensor().silu().unwrap().mul(&rout).unwrap();
        close(&s1, &s2);
        let wy = randn(&[4, 3], 9);
        let g1 = (s1 * &wy).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (s2 * &wy).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &gates, &a] {
            close(g1.get(v).unwrap(), g2.get(v).unwrap());
        }
    }

    #[test]
    fn the_fused_combine_and_the_composition_agree() {
        // f32 on the CPU takes the fused kernel; f64 takes the candle composition. Same
        // values, same gradients (a token with no rows, a token with two).
        let y32 = randn(&[5, 3], 11);
        let g32 = randn(&[4, 2], 12);
        let slots = Arc::new(vec![1u32, 6, 7, 0, 1]);
        let run = |dtype: DType| {
            let y = Var::from_tensor(&y32.to_dtype(dtype).unwrap()).unwrap();
            let g = Var::from_tensor(&g32.to_dtype(dtype).unwrap()).unwrap();
            let out = weighted_combine(y.as_tensor(), g.as_tensor(), &slots, 4).unwrap();
            let w = randn(&[4, 3], 13).to_dtype(dtype).unwrap();
            let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            (
                f(&out),
                f(grads.get(&y).unwrap()),
                f(grads.get(&g).unwrap()),
            )
        };
        let (a, b) = (run(DType::F32), run(DType::F64));
        close(&a.0, &b.0);
        close(&a.1, &b.1);
        close(&a.2, &b.2);
        // Token 1 got no row: zeros out, zero gate gradients.
        assert_eq!(abs_sum(&a.0.get(1).unwrap()).unwrap(), 0.0);
    }
}
