//! Reductions over dims: `sum`, `mean`, `max`, `min`, `argmax`.
//!
//! A reduced dim that is sharded yields a Partial output (`sum` -> `P(sum)`, `max` -> `P(max)`,
//! `mean` -> `P(sum)`: every rank divides its local sum by the GLOBAL count, so uneven and empty
//! pieces are fine).

use candle_core::Tensor;
use candle_dtensor_strategies::{Dims, Op};

use super::generic::dims_or_all;
use crate::dispatch::run1;
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

impl DTensor {
    fn check_dims(&self, op: &str, dims: &[usize]) -> Result<Dims> {
        let mut out = Dims::new();
        for &d in dims {
            if d >= self.rank() {
                return Err(invalid(
                    op,
                    self.mesh_rank(),
                    format!("dim {d} out of range for shape {:?}", self.shape()),
                ));
            }
            if out.contains(&d) {
                return Err(invalid(
                    op,
                    self.mesh_rank(),
                    format!("dim {d} repeated in {dims:?}"),
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

    /// Index of the maximum along `dim` (`u32`).
    pub fn argmax(&self, dim: usize, keepdim: bool) -> Result<DTensor> {
        self.check_dims("argmax", &[dim])?;
        run1(&Op::ArgMax { dim, keepdim }, &[self], move |p| {
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
            if keepdim {
                p.locals[0].argmax_keepdim(dim)
            } else {
                p.locals[0].argmax(dim)
            }
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

/// The reduction family on one device.
pub(crate) fn reference(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
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
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
