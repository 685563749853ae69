//! Reductions over dims: `sum`, `mean`, `max`, `min`, `prod`, `norm`, `logsumexp`, `var`,
//! `std`, `argmax`, `argmin`.
//!
//! A reduced dim that is sharded yields a Partial output (`sum` -> `P(sum)`, `max` -> `P(max)`,
//! `prod` -> `P(product)`, `mean` -> `P(sum)`: every rank divides its local sum by the GLOBAL
//! count, so uneven and empty pieces are fine), or is reduced inside the op (`norm`,
//! `logsumexp`, `var`, `std`: all_reduces of the output's size over the mesh dims that shard a
//! reduced dim, the output replicated there).

use candle_core::Tensor;
use candle_dtensor_comm::ReduceOp;
use candle_dtensor_strategies::{Dims, Op, Placement};

use crate::collectives::{self, Axis};
use crate::dispatch::{run1, Prepared};
use crate::error::{invalid, Result};
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

/// Whether a dim other than `d` of `x` is empty (so reducing `d` gives an empty result).
fn other_dim_empty(x: &Tensor, d: usize) -> bool {
    x.dims().iter().enumerate().any(|(k, &n)| k != d && n == 0)
}

/// Max/min over `dims` of a local piece. A piece that is empty on a dim it does not reduce has
/// an empty result, but candle refuses max/min on empty tensors: that result comes from a sum,
/// which keeps the graph node (every rank must have the same graph, or its backward collectives
/// would not match the other ranks').
fn extreme(x: &Tensor, dims: &[usize], keepdim: bool, max: bool) -> CResult<Tensor> {
    let mut r = x.clone();
    for &d in dims {
        r = if other_dim_empty(&r, d) {
            r.sum_keepdim(d)?
        } else if max {
            r.max_keepdim(d)?
        } else {
            r.min_keepdim(d)?
        };
    }
    if !keepdim {
        let mut sorted = dims.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        for d in sorted {
            r = r.squeeze(d)?;
        }
    }
    Ok(r)
}

/// The axes (mesh dims of size > 1) on which the op reduces inside itself: those where the
/// prepared input shards a reduced dim and the output is `Replicate`.
fn internal_axes(p: &Prepared, dims: &[usize]) -> CResult<Vec<Axis>> {
    let ctx = p.ctx();
    let inp = &p.sharding.input_specs[0].placements;
    let out = &p.sharding.output_specs[0].placements;
    (0..inp.len())
        .filter(|&m| {
            ctx.shape[m] > 1
                && out[m] == Placement::Replicate
                && inp[m].shard_dim().is_some_and(|d| dims.contains(&d))
        })
        .map(|m| {
            ctx.axis(p.first().mesh(), &[m])
                .map_err(candle_core::Error::from)
        })
        .collect()
}

/// `r` (reduced with keepdim over `dims`) without those dims unless `keepdim`.
fn squeeze_reduced(mut r: Tensor, dims: &[usize], keepdim: bool) -> CResult<Tensor> {
    if !keepdim {
        let mut s = dims.to_vec();
        s.sort_unstable_by(|a, b| b.cmp(a));
        for d in s {
            r = r.squeeze(d)?;
        }
    }
    Ok(r)
}

/// The max over `dims` (keepdim, no gradient), `-inf` where the piece holds nothing of them.
fn max_or_neg_inf(x: &Tensor, dims: &[usize]) -> CResult<Tensor> {
    let mut r = x.detach();
    for &d in dims {
        r = if r.elem_count() == 0 {
            let mut shape = r.dims().to_vec();
            shape[d] = 1;
            Tensor::full(f32::NEG_INFINITY, shape, r.device())?.to_dtype(r.dtype())?
        } else {
            r.max_keepdim(d)?
        };
    }
    Ok(r)
}

/// The product over dim `d` of a piece (keepdim) as a tree of pairwise products: exact
/// gradients where entries are 0 (unlike `res / x`); 1 for a piece without entries there (kept
/// in the graph).
fn prod_dim(x: &Tensor, d: usize) -> CResult<Tensor> {
    if x.dim(d)? == 0 {
        let mut shape = x.dims().to_vec();
        shape[d] = 1;
        return crate::node::graph_zeros(x, &shape)?.affine(1.0, 1.0);
    }
    let mut t = x.clone();
    while t.dim(d)? > 1 {
        let n = t.dim(d)?;
        let h = n / 2;
        let pairs = t.narrow(d, 0, h)?.mul(&t.narrow(d, h, h)?)?;
        t = if n % 2 == 1 {
            Tensor::cat(&[&pairs, &t.narrow(d, 2 * h, 1)?], d)?
        } else {
            pairs
        };
    }
    Ok(t)
}

fn prod_local(x: &Tensor, dims: &[usize], keepdim: bool) -> CResult<Tensor> {
    let mut r = x.clone();
    for &d in dims {
        r = prod_dim(&r, d)?;
    }
    squeeze_reduced(r, dims, keepdim)
}

/// `sum |x|^p` over `dims` (keepdim; `max |x|` for `p = inf`) and the map that finishes the
/// norm from it.
fn norm_parts(x: &Tensor, p: f64, dims: &[usize]) -> CResult<Tensor> {
    if p == f64::INFINITY {
        return extreme(&x.abs()?, dims, true, true);
    }
    let powered = if p == 1.0 {
        x.abs()?
    } else if p == 2.0 {
        x.sqr()?
    } else {
        x.abs()?.powf(p)?
    };
    powered.sum_keepdim(dims.to_vec())
}

fn norm_finish(s: Tensor, p: f64) -> CResult<Tensor> {
    if p == 1.0 || p == f64::INFINITY {
        Ok(s)
    } else if p == 2.0 {
        s.sqrt()
    } else {
        s.powf(1.0 / p)
    }
}

/// `log sum exp` over `dims` (keepdim), the max and sum all-reduced over `axes`.
fn logsumexp_local(x: &Tensor, dims: &[usize], axes: &[Axis]) -> CResult<Tensor> {
    let mut m = max_or_neg_inf(x, dims)?;
    for a in axes {
        m = collectives::all_reduce_raw(&m, a, ReduceOp::Max, None)?;
    }
    let mut s = x.broadcast_sub(&m)?.exp()?.sum_keepdim(dims.to_vec())?;
    for a in axes {
        s = collectives::all_reduce(&s, a, ReduceOp::Sum)?;
    }
    s.log()? + m
}

/// The variance over `dims` (keepdim) of a tensor with `count` elements there globally, the
/// sums all-reduced over `axes`. The mean is a constant of the gradient (the deviations sum to
/// zero), so it is computed without one.
fn var_local(
    x: &Tensor,
    dims: &[usize],
    count: usize,
    correction: usize,
    axes: &[Axis],
) -> CResult<Tensor> {
    let mut total = x.detach().sum_keepdim(dims.to_vec())?;
    for a in axes {
        total = collectives::all_reduce_raw(&total, a, ReduceOp::Sum, None)?;
    }
    let mean = total.affine(1.0 / count as f64, 0.0)?;
    let mut ss = x.broadcast_sub(&mean)?.sqr()?.sum_keepdim(dims.to_vec())?;
    for a in axes {
        ss = collectives::all_reduce(&ss, a, ReduceOp::Sum)?;
    }
    ss.affine(1.0 / (count as f64 - correction as f64), 0.0)
}

impl DTensor {
    fn check_dims(&self, op: &str, dims: &[usize]) -> Result<Dims> {
        let mut out = Dims::new();
        for &d in dims {
            if d >= self.rank() {
                return Err(invalid(
                    op,
                    self.mesh_rank(),
                    format!("dim {d} out of range for {}", self.spec()),
                ));
            }
            if out.contains(&d) {
                return Err(invalid(
                    op,
                    self.mesh_rank(),
                    format!("dim {d} repeated in {dims:?} (input {})", self.spec()),
                ));
            }
            out.push(d);
        }
        Ok(out)
    }

    /// Sums over `dims`.
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("sum", dims)?;
        let v = d.to_vec();
        run1(&Op::Sum { dims: d, keepdim }, &[self], move |p| {
            if keepdim {
                p.locals[0].sum_keepdim(v)
            } else {
                p.locals[0].sum(v)
            }
        })
    }

    /// Sums every element into a scalar.
    pub fn sum_all(&self) -> Result<DTensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        self.sum(&all, false)
    }

    /// Means over `dims`: the local sum over the global number of reduced elements, whatever
    /// the local piece holds of them (a mean over a sharded dim is a free `P(sum)`).
    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("mean", dims)?;
        let v = d.to_vec();
        let count: usize = v.iter().map(|&k| self.shape()[k]).product();
        run1(&Op::Mean { dims: d, keepdim }, &[self], move |p| {
            let s = if keepdim {
                p.locals[0].sum_keepdim(v)?
            } else {
                p.locals[0].sum(v)?
            };
            s.affine(1.0 / count as f64, 0.0)
        })
    }

    /// The mean of every element (a scalar).
    pub fn mean_all(&self) -> Result<DTensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        self.mean(&all, false)
    }

    /// Maximum over `dims`.
    pub fn max(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("max", dims)?;
        let v = d.to_vec();
        run1(&Op::Max { dims: d, keepdim }, &[self], move |p| {
            extreme(&p.locals[0], &v, keepdim, true)
        })
    }

    /// Minimum over `dims`.
    pub fn min(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("min", dims)?;
        let v = d.to_vec();
        run1(&Op::Min { dims: d, keepdim }, &[self], move |p| {
            extreme(&p.locals[0], &v, keepdim, false)
        })
    }

    /// Index of the maximum along `dim` (`u32`; the first one on ties).
    pub fn argmax(&self, dim: usize, keepdim: bool) -> Result<DTensor> {
        self.arg_extreme(Op::ArgMax { dim, keepdim }, dim, keepdim)
    }

    /// Index of the minimum along `dim` (`u32`; the first one on ties).
    pub fn argmin(&self, dim: usize, keepdim: bool) -> Result<DTensor> {
        self.arg_extreme(Op::ArgMin { dim, keepdim }, dim, keepdim)
    }

    fn arg_extreme(&self, op: Op, dim: usize, keepdim: bool) -> Result<DTensor> {
        self.check_dims(op.name(), &[dim])?;
        let max = matches!(op, Op::ArgMax { .. });
        run1(&op, &[self], move |p| {
            let x = &p.locals[0];
            if other_dim_empty(x, dim) {
                // An empty result (another dim is empty); candle refuses argmax on empty input.
                let mut dims = x.dims().to_vec();
                if keepdim {
                    dims[dim] = 1;
                } else {
                    dims.remove(dim);
                }
                return Tensor::zeros(dims, candle_core::DType::U32, x.device());
            }
            match (max, keepdim) {
                (true, true) => x.argmax_keepdim(dim),
                (true, false) => x.argmax(dim),
                (false, true) => x.argmin_keepdim(dim),
                (false, false) => x.argmin(dim),
            }
        })
    }

    /// The product over `dims` (a sharded dim gives `P(product)`).
    pub fn prod(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("prod", dims)?;
        let v = d.to_vec();
        run1(&Op::Prod { dims: d, keepdim }, &[self], move |p| {
            prod_local(&p.locals[0], &v, keepdim)
        })
    }

    /// The `p`-norm over `dims`: `(sum |x|^p)^(1/p)`, `max |x|` for `p = inf` (a gradient
    /// clipping norm is `norm(2, all dims)`). Over a sharded dim: `p = 1` gives `P(sum)`,
    /// `p = inf` `P(max)`, other `p` one all_reduce of the output's size inside the op.
    pub fn norm(&self, p: f64, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("norm", dims)?;
        let v = d.to_vec();
        let op = Op::Norm {
            p: p.into(),
            dims: d,
            keepdim,
        };
        run1(&op, &[self], move |pr| {
            let mut s = norm_parts(&pr.locals[0], p, &v)?;
            for a in internal_axes(pr, &v)? {
                s = collectives::all_reduce(&s, &a, ReduceOp::Sum)?;
            }
            squeeze_reduced(norm_finish(s, p)?, &v, keepdim)
        })
    }

    /// `log(sum(exp(x)))` over `dims` (max-shifted; over a sharded dim: two all_reduces of the
    /// output's size, max then sum, inside the op).
    pub fn logsumexp(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let d = self.check_dims("logsumexp", dims)?;
        let v = d.to_vec();
        run1(&Op::LogSumExp { dims: d, keepdim }, &[self], move |p| {
            let axes = internal_axes(p, &v)?;
            squeeze_reduced(logsumexp_local(&p.locals[0], &v, &axes)?, &v, keepdim)
        })
    }

    /// The variance over `dims` with `correction` (1: unbiased, as torch.var). Over a sharded
    /// dim: two all_reduces of the output's size (the sum for the mean, the sum of squared
    /// deviations) inside the op.
    pub fn var(&self, dims: &[usize], keepdim: bool, correction: usize) -> Result<DTensor> {
        self.moment(dims, keepdim, correction, false)
    }

    /// The standard deviation over `dims` with `correction` (see [`DTensor::var`]).
    pub fn std(&self, dims: &[usize], keepdim: bool, correction: usize) -> Result<DTensor> {
        self.moment(dims, keepdim, correction, true)
    }

    fn moment(
        &self,
        dims: &[usize],
        keepdim: bool,
        correction: usize,
        std: bool,
    ) -> Result<DTensor> {
        let name = if std { "std" } else { "var" };
        let d = self.check_dims(name, dims)?;
        let v = d.to_vec();
        let count: usize = v.iter().map(|&k| self.shape()[k]).product();
        let op = if std {
            Op::Std {
                dims: d,
                keepdim,
                correction,
            }
        } else {
            Op::Var {
                dims: d,
                keepdim,
                correction,
            }
        };
        run1(&op, &[self], move |p| {
            let axes = internal_axes(p, &v)?;
            let var = var_local(&p.locals[0], &v, count, correction, &axes)?;
            let r = if std { var.sqrt()? } else { var };
            squeeze_reduced(r, &v, keepdim)
        })
    }
}

/// The reduction family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    let a = x[0];
    let all = |dims: &[usize]| dims_or_all(dims, a.rank());
    Ok(vec![match op {
        Op::Sum { dims, keepdim } => a.sum(&all(dims), *keepdim)?,
        Op::Mean { dims, keepdim } => a.mean(&all(dims), *keepdim)?,
        Op::Max { dims, keepdim } => a.max(&all(dims), *keepdim)?,
        Op::Min { dims, keepdim } => a.min(&all(dims), *keepdim)?,
        Op::ArgMax { dim, keepdim } => a.argmax(*dim, *keepdim)?,
        Op::ArgMin { dim, keepdim } => a.argmin(*dim, *keepdim)?,
        Op::Prod { dims, keepdim } => a.prod(&all(dims), *keepdim)?,
        Op::Norm { p, dims, keepdim } => a.norm(p.get(), &all(dims), *keepdim)?,
        Op::LogSumExp { dims, keepdim } => a.logsumexp(&all(dims), *keepdim)?,
        Op::Var {
            dims,
            keepdim,
            correction,
        } => a.var(&all(dims), *keepdim, *correction)?,
        Op::Std {
            dims,
            keepdim,
            correction,
        } => a.std(&all(dims), *keepdim, *correction)?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

fn extreme_ref(x: &Tensor, dims: &[usize], keepdim: bool, max: bool) -> CResult<Tensor> {
    let mut r = x.clone();
    for &d in dims {
        r = if max {
            r.max_keepdim(d)?
        } else {
            r.min_keepdim(d)?
        };
    }
    squeeze_reduced(r, dims, keepdim)
}

/// The reduction family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    let x = &inputs[0];
    let all = |dims: &[usize]| dims_or_all(dims, x.rank());
    Ok(vec![match op {
        Op::Sum { dims, keepdim } => {
            squeeze_reduced(x.sum_keepdim(all(dims))?, &all(dims), *keepdim)?
        }
        Op::Mean { dims, keepdim } => {
            squeeze_reduced(x.mean_keepdim(all(dims))?, &all(dims), *keepdim)?
        }
        Op::Max { dims, keepdim } => extreme_ref(x, &all(dims), *keepdim, true)?,
        Op::Min { dims, keepdim } => extreme_ref(x, &all(dims), *keepdim, false)?,
        Op::ArgMax { dim, keepdim } => {
            if *keepdim {
                x.argmax_keepdim(*dim)?
            } else {
                x.argmax(*dim)?
            }
        }
        Op::ArgMin { dim, keepdim } => {
            if *keepdim {
                x.argmin_keepdim(*dim)?
            } else {
                x.argmin(*dim)?
            }
        }
        Op::Prod { dims, keepdim } => prod_local(x, &all(dims), *keepdim)?,
        Op::Norm { p, dims, keepdim } => {
            let p = p.get();
            let d = all(dims);
            let powered = if p == f64::INFINITY {
                extreme_ref(&x.abs()?, &d, true, true)?
            } else {
                x.abs()?.powf(p)?.sum_keepdim(d.clone())?.powf(1.0 / p)?
            };
            squeeze_reduced(powered, &d, *keepdim)?
        }
        Op::LogSumExp { dims, keepdim } => {
            let d = all(dims);
            let mut m = x.detach();
            for &k in &d {
                m = m.max_keepdim(k)?;
            }
            let s = x.broadcast_sub(&m)?.exp()?.sum_keepdim(d.clone())?;
            squeeze_reduced((s.log()? + m)?, &d, *keepdim)?
        }
        Op::Var {
            dims,
            keepdim,
            correction,
        }
        | Op::Std {
            dims,
            keepdim,
            correction,
        } => {
            let d = all(dims);
            let n: usize = d.iter().map(|&k| x.dims()[k]).product();
            let dev = x.broadcast_sub(&x.mean_keepdim(d.clone())?)?;
            let var = dev
                .sqr()?
                .sum_keepdim(d.clone())?
                .affine(1.0 / (n as f64 - *correction as f64), 0.0)?;
            let r = if matches!(op, Op::Std { .. }) {
                var.sqrt()?
            } else {
                var
            };
            squeeze_reduced(r, &d, *keepdim)?
        }
        _ => return Err(super::ref_wrong_family(op)),
    }])
}

/// `dims`, or every dim of a rank-`rank` tensor when empty (the compiler's "all dims").
fn dims_or_all(dims: &[usize], rank: usize) -> Vec<usize> {
    if dims.is_empty() {
        (0..rank).collect()
    } else {
        dims.to_vec()
    }
}
