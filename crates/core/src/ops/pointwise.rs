//! Elementwise ops: unary maps, affine and scalar ops, binary ops with broadcasting,
//! comparisons, `where_cond`, `masked_fill`, `dropout`, dtype casts.

use candle_core::{DType, Tensor};
use candle_dtensor_strategies::{BinaryOp, CmpOp, Op, ScalarOp, UnaryOp};

use super::local_dims;
use crate::dispatch::run1;
use crate::error::Result;
use crate::tensor::DTensor;

type CResult<T> = candle_core::Result<T>;

/// `1 / (1 + exp(-x))` from primitives (candle-core has no sigmoid with a backward).
pub(crate) fn sigmoid(x: &Tensor) -> CResult<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

fn apply_unary(u: UnaryOp, x: &Tensor) -> CResult<Tensor> {
    match u {
        UnaryOp::Neg => x.neg(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Relu => x.relu(),
        UnaryOp::Gelu => crate::fused::gelu(x),
        UnaryOp::GeluErf => x.gelu_erf(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Silu => x.silu(),
        UnaryOp::Sqr => x.sqr(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Recip => x.recip(),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
    }
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $v:ident),* $(,)?) => {
        impl DTensor {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> Result<DTensor> {
                    self.unary(UnaryOp::$v)
                }
            )*
        }
    };
}

unary_methods!(
    /// `-x`.
    neg => Neg,
    /// `exp(x)`.
    exp => Exp,
    /// `ln(x)`.
    log => Log,
    /// `max(x, 0)`.
    relu => Relu,
    /// GELU, tanh approximation.
    gelu => Gelu,
    /// GELU, erf form.
    gelu_erf => GeluErf,
    /// `tanh(x)`.
    tanh => Tanh,
    /// Logistic sigmoid.
    sigmoid => Sigmoid,
    /// `x * sigmoid(x)`.
    silu => Silu,
    /// `x^2`.
    sqr => Sqr,
    /// `sqrt(x)`.
    sqrt => Sqrt,
    /// `|x|`.
    abs => Abs,
    /// `1 / x`.
    recip => Recip,
    /// `sin(x)`.
    sin => Sin,
    /// `cos(x)`.
    cos => Cos,
);

impl DTensor {
    /// Applies an elementwise unary map.
    pub fn unary(&self, u: UnaryOp) -> Result<DTensor> {
        run1(&Op::Unary(u), &[self], |p| apply_unary(u, &p.locals[0]))
    }

    /// `x * mul + add`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<DTensor> {
        let op = Op::Affine {
            mul: mul.into(),
            add: add.into(),
        };
        run1(&op, &[self], |p| p.locals[0].affine(mul, add))
    }

    pub(crate) fn scalar(&self, s: ScalarOp, v: f64) -> Result<DTensor> {
        run1(&Op::ScalarOp(s, v.into()), &[self], |p| {
            let x = &p.locals[0];
            match s {
                ScalarOp::Add => x.affine(1.0, v),
                ScalarOp::Sub => x.affine(1.0, -v),
                ScalarOp::Mul => x.affine(v, 0.0),
                ScalarOp::Div => x.affine(1.0 / v, 0.0),
                ScalarOp::Pow => x.powf(v),
                ScalarOp::Maximum => x.maximum(v),
                ScalarOp::Minimum => x.minimum(v),
            }
        })
    }

    /// `x + s`.
    pub fn add_scalar(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Add, s)
    }
    /// `x - s`.
    pub fn sub_scalar(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Sub, s)
    }
    /// `x * s`.
    pub fn mul_scalar(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Mul, s)
    }
    /// `x / s`.
    pub fn div_scalar(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Div, s)
    }
    /// `x ^ s`.
    pub fn powf(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Pow, s)
    }
    /// `max(x, s)`.
    pub fn maximum_scalar(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Maximum, s)
    }
    /// `min(x, s)`.
    pub fn minimum_scalar(&self, s: f64) -> Result<DTensor> {
        self.scalar(ScalarOp::Minimum, s)
    }

    /// An elementwise binary op with numpy broadcasting.
    pub fn binary(&self, b: BinaryOp, rhs: &DTensor) -> Result<DTensor> {
        run1(&Op::Binary(b), &[self, rhs], |p| {
            let (x, y) = (&p.locals[0], &p.locals[1]);
            match b {
                BinaryOp::Add => crate::fused::add(x, y),
                BinaryOp::Sub => x.broadcast_sub(y),
                BinaryOp::Mul => x.broadcast_mul(y),
                BinaryOp::Div => x.broadcast_div(y),
                BinaryOp::Maximum => x.broadcast_maximum(y),
                BinaryOp::Minimum => x.broadcast_minimum(y),
            }
        })
    }

    /// `a + b` (broadcasting).
    pub fn add(&self, rhs: &DTensor) -> Result<DTensor> {
        self.binary(BinaryOp::Add, rhs)
    }
    /// `a - b` (broadcasting).
    pub fn sub(&self, rhs: &DTensor) -> Result<DTensor> {
        self.binary(BinaryOp::Sub, rhs)
    }
    /// `a * b` (broadcasting).
    pub fn mul(&self, rhs: &DTensor) -> Result<DTensor> {
        self.binary(BinaryOp::Mul, rhs)
    }
    /// `a / b` (broadcasting).
    pub fn div(&self, rhs: &DTensor) -> Result<DTensor> {
        self.binary(BinaryOp::Div, rhs)
    }
    /// `max(a, b)` (broadcasting).
    pub fn maximum(&self, rhs: &DTensor) -> Result<DTensor> {
        self.binary(BinaryOp::Maximum, rhs)
    }
    /// `min(a, b)` (broadcasting).
    pub fn minimum(&self, rhs: &DTensor) -> Result<DTensor> {
        self.binary(BinaryOp::Minimum, rhs)
    }

    /// An elementwise comparison with broadcasting (`u8` output).
    pub fn cmp(&self, c: CmpOp, rhs: &DTensor) -> Result<DTensor> {
        run1(&Op::Cmp(c), &[self, rhs], |p| {
            let (x, y) = (&p.locals[0], &p.locals[1]);
            match c {
                CmpOp::Eq => x.broadcast_eq(y),
                CmpOp::Ne => x.broadcast_ne(y),
                CmpOp::Lt => x.broadcast_lt(y),
                CmpOp::Le => x.broadcast_le(y),
                CmpOp::Gt => x.broadcast_gt(y),
                CmpOp::Ge => x.broadcast_ge(y),
            }
        })
    }

    /// `cond ? on_true : on_false` with broadcasting; `self` is the `u8` condition.
    pub fn where_cond(&self, on_true: &DTensor, on_false: &DTensor) -> Result<DTensor> {
        run1(&Op::Where, &[self, on_true, on_false], |p| {
            let dims = local_dims(p, 0)?;
            let c = p.locals[0].broadcast_as(dims.as_slice())?;
            let t = p.locals[1].broadcast_as(dims.as_slice())?;
            let f = p.locals[2].broadcast_as(dims.as_slice())?;
            c.where_cond(&t, &f)
        })
    }

    /// Sets the elements where `mask` (`u8`, broadcastable) is non-zero to `value`.
    pub fn masked_fill(&self, mask: &DTensor, value: f64) -> Result<DTensor> {
        run1(
            &Op::MaskedFill {
                value: value.into(),
            },
            &[self, mask],
            |p| {
                let x = &p.locals[0];
                let m = p.locals[1].broadcast_as(x.dims())?;
                let v = Tensor::full(value, x.dims(), x.device())?.to_dtype(x.dtype())?;
                m.where_cond(&v, x)
            },
        )
    }

    /// Casts to `dtype` (Partial placements are kept only where the cast keeps sums).
    pub fn to_dtype(&self, dtype: DType) -> Result<DTensor> {
        let target = crate::convert::sdtype(dtype).ok_or_else(|| {
            crate::error::invalid(
                "to_dtype",
                self.mesh_rank(),
                format!("unsupported dtype {dtype:?}"),
            )
        })?;
        run1(&Op::ToDType(target), &[self], |p| {
            p.locals[0].to_dtype(dtype)
        })
    }

    /// A contiguous copy.
    pub fn contiguous(&self) -> Result<DTensor> {
        run1(&Op::Contiguous, &[self], |p| p.locals[0].contiguous())
    }

    /// Inverted dropout with keep probability `1 - p`: elements are zeroed with probability `p`
    /// and the rest scaled by `1 / (1 - p)`. The mask is a function of `seed` and each element's
    /// global index, so any layout drops exactly the elements the single-device run drops.
    pub fn dropout(&self, p: f64, seed: u64) -> Result<DTensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(crate::error::invalid(
                "dropout",
                self.mesh_rank(),
                format!("drop probability {p} must be in [0, 1)"),
            ));
        }
        let global = self.shape().to_vec();
        run1(&Op::Dropout { p: p.into() }, &[self], |pr| {
            let x = &pr.locals[0];
            let spec = &pr.sharding.input_specs[0];
            let ctx = pr.ctx();
            let idx: Vec<Vec<usize>> = (0..global.len())
                .map(|d| {
                    candle_dtensor_strategies::layout::local_indices(
                        global[d],
                        &ctx.shape,
                        &ctx.coord,
                        &spec.placements,
                        d,
                    )
                })
                .collect();
            let mask = dropout_mask(&global, &idx, p, seed);
            let keep = Tensor::from_vec(mask, x.dims(), x.device())?.to_dtype(x.dtype())?;
            x.mul(&keep)?.affine(1.0 / (1.0 - p), 0.0)
        })
    }
}

/// The keep mask (1/0) of the local piece whose global indices per dim are `idx`.
fn dropout_mask(global: &[usize], idx: &[Vec<usize>], p: f64, seed: u64) -> Vec<u8> {
    let strides: Vec<usize> = (0..global.len())
        .map(|d| global[d + 1..].iter().product())
        .collect();
    let n: usize = idx.iter().map(|v| v.len()).product();
    let mut out = Vec::with_capacity(n);
    let mut pos = vec![0usize; idx.len()];
    let threshold = (p * (u64::MAX as f64)) as u64;
    for _ in 0..n {
        let lin: usize = pos
            .iter()
            .enumerate()
            .map(|(d, &i)| idx[d][i] * strides[d])
            .sum();
        out.push(u8::from(
            splitmix64(seed ^ (lin as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >= threshold,
        ));
        for d in (0..pos.len()).rev() {
            pos[d] += 1;
            if pos[d] < idx[d].len() {
                break;
            }
            pos[d] = 0;
        }
    }
    out
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Single-device reference of [`DTensor::dropout`]'s mask (for tests and the single-device
/// twin of a model).
pub fn dropout_mask_full(shape: &[usize], p: f64, seed: u64) -> Vec<u8> {
    let idx: Vec<Vec<usize>> = shape.iter().map(|&n| (0..n).collect()).collect();
    dropout_mask(shape, &idx, p, seed)
}

macro_rules! binop_trait {
    ($tr:ident, $m:ident, $scalar:ident) => {
        impl std::ops::$tr<&DTensor> for &DTensor {
            type Output = Result<DTensor>;
            fn $m(self, rhs: &DTensor) -> Result<DTensor> {
                DTensor::$m(self, rhs)
            }
        }
        impl std::ops::$tr<f64> for &DTensor {
            type Output = Result<DTensor>;
            fn $m(self, rhs: f64) -> Result<DTensor> {
                self.$scalar(rhs)
            }
        }
    };
}
binop_trait!(Add, add, add_scalar);
binop_trait!(Sub, sub, sub_scalar);
binop_trait!(Mul, mul, mul_scalar);
binop_trait!(Div, div, div_scalar);

impl std::ops::Neg for &DTensor {
    type Output = Result<DTensor>;
    fn neg(self) -> Result<DTensor> {
        DTensor::neg(self)
    }
}

/// The pointwise family on DTensors (dispatched by [`super::generic::apply_all`]).
pub(crate) fn apply(op: &Op, x: &[&DTensor]) -> Result<Vec<DTensor>> {
    let a = x[0];
    Ok(vec![match op {
        Op::Unary(u) => a.unary(*u)?,
        Op::Affine { mul, add } => a.affine(mul.get(), add.get())?,
        Op::ScalarOp(s, v) => a.scalar(*s, v.get())?,
        Op::Binary(b) => a.binary(*b, x[1])?,
        Op::Cmp(c) => a.cmp(*c, x[1])?,
        _ => return Err(super::wrong_family(op, x)),
    }])
}

fn unary_ref(u: UnaryOp, x: &Tensor) -> CResult<Tensor> {
    match u {
        UnaryOp::Gelu => x.gelu(),
        other => apply_unary(other, x),
    }
}

/// The pointwise family on one device.
pub(crate) fn single_device(op: &Op, inputs: &[Tensor]) -> CResult<Vec<Tensor>> {
    let x = &inputs[0];
    Ok(vec![match op {
        Op::Unary(u) => unary_ref(*u, x)?,
        Op::Affine { mul, add } => x.affine(mul.get(), add.get())?,
        Op::ScalarOp(s, v) => {
            let v = v.get();
            match s {
                ScalarOp::Add => (x + v)?,
                ScalarOp::Sub => (x - v)?,
                ScalarOp::Mul => (x * v)?,
                ScalarOp::Div => (x / v)?,
                ScalarOp::Pow => x.powf(v)?,
                ScalarOp::Maximum => x.maximum(v)?,
                ScalarOp::Minimum => x.minimum(v)?,
            }
        }
        Op::Binary(b) => {
            let y = &inputs[1];
            match b {
                BinaryOp::Add => x.broadcast_add(y)?,
                BinaryOp::Sub => x.broadcast_sub(y)?,
                BinaryOp::Mul => x.broadcast_mul(y)?,
                BinaryOp::Div => x.broadcast_div(y)?,
                BinaryOp::Maximum => x.broadcast_maximum(y)?,
                BinaryOp::Minimum => x.broadcast_minimum(y)?,
            }
        }
        Op::Cmp(c) => {
            let y = &inputs[1];
            match c {
                CmpOp::Eq => x.broadcast_eq(y)?,
                CmpOp::Ne => x.broadcast_ne(y)?,
                CmpOp::Lt => x.broadcast_lt(y)?,
                CmpOp::Le => x.broadcast_le(y)?,
                CmpOp::Gt => x.broadcast_gt(y)?,
                CmpOp::Ge => x.broadcast_ge(y)?,
            }
        }
        _ => return Err(super::ref_wrong_family(op)),
    }])
}
