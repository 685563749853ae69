//! The ops the sharding compiler knows: one `Hash + Eq` enum whose `Display` is the DTensor
//! method name (also the `--op` name of the `explain` example).
//!
//! Dims in an [`Op`] are already normalized (`usize`); use [`normalize_dim`] for negative dims.
//! Shape and dtype inference lives with each op family in `ops/`.

use std::fmt;

use smallvec::SmallVec;

use crate::error::{Result, StrategyError};
use crate::spec::{DType, Shape, TensorMeta};

/// Dims argument of reductions (empty = all dims).
pub type Dims = SmallVec<[usize; 4]>;

/// An `f64` stored as its bits so ops stay `Hash + Eq` (`-0.0` is stored as `0.0`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scalar(u64);

impl Scalar {
    /// Wraps a value.
    pub fn new(v: f64) -> Self {
        Scalar(if v == 0.0 {
            0.0f64.to_bits()
        } else {
            v.to_bits()
        })
    }

    /// The value.
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl From<f64> for Scalar {
    fn from(v: f64) -> Self {
        Scalar::new(v)
    }
}

impl fmt::Debug for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// How a unary map interacts with `Partial(max|min)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Monotonicity {
    /// `f(max x) = max f(x)`: keeps `P(max)` and `P(min)`.
    NonDecreasing,
    /// `f(max x) = min f(x)`: swaps `P(max)` and `P(min)`.
    NonIncreasing,
    /// Neither.
    None,
}

macro_rules! named_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $var:ident => $s:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vdoc])* $var),+ }
        impl $name {
            /// All variants.
            pub const ALL: &'static [$name] = &[$($name::$var),+];
            /// The method name.
            pub fn name(self) -> &'static str { match self { $($name::$var => $s),+ } }
            /// Looks a variant up by method name.
            pub fn from_name(s: &str) -> Option<Self> { $name::ALL.iter().copied().find(|v| v.name() == s) }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.name()) }
        }
    };
}

named_enum!(
    /// Elementwise unary maps.
    UnaryOp {
        /// `-x` (linear, non-increasing).
        Neg => "neg",
        /// `exp(x)`.
        Exp => "exp",
        /// `ln(x)`.
        Log => "log",
        /// `max(x, 0)`.
        Relu => "relu",
        /// tanh-approximated GELU (not monotone).
        Gelu => "gelu",
        /// erf GELU (not monotone).
        GeluErf => "gelu_erf",
        /// `tanh(x)`.
        Tanh => "tanh",
        /// logistic sigmoid.
        Sigmoid => "sigmoid",
        /// `x * sigmoid(x)` (not monotone).
        Silu => "silu",
        /// `x^2` (not monotone).
        Sqr => "sqr",
        /// `sqrt(x)`.
        Sqrt => "sqrt",
        /// `|x|`.
        Abs => "abs",
        /// `1/x` (not monotone over its domain).
        Recip => "recip",
        /// `sin(x)`.
        Sin => "sin",
        /// `cos(x)`.
        Cos => "cos",
    }
);

impl UnaryOp {
    /// Linear maps keep `P(sum)` and `P(avg)`.
    pub fn is_linear(self) -> bool {
        matches!(self, UnaryOp::Neg)
    }

    /// Monotonicity over the op's domain.
    pub fn monotonicity(self) -> Monotonicity {
        match self {
            UnaryOp::Neg => Monotonicity::NonIncreasing,
            UnaryOp::Exp
            | UnaryOp::Log
            | UnaryOp::Relu
            | UnaryOp::Tanh
            | UnaryOp::Sigmoid
            | UnaryOp::Sqrt => Monotonicity::NonDecreasing,
            _ => Monotonicity::None,
        }
    }
}

named_enum!(
    /// Elementwise binary ops with numpy broadcasting.
    BinaryOp {
        /// `a + b`.
        Add => "add",
        /// `a - b`.
        Sub => "sub",
        /// `a * b`.
        Mul => "mul",
        /// `a / b`.
        Div => "div",
        /// `max(a, b)`.
        Maximum => "maximum",
        /// `min(a, b)`.
        Minimum => "minimum",
    }
);

named_enum!(
    /// Binary ops with a scalar right-hand side.
    ScalarOp {
        /// `x + s`.
        Add => "add_scalar",
        /// `x - s`.
        Sub => "sub_scalar",
        /// `x * s`.
        Mul => "mul_scalar",
        /// `x / s`.
        Div => "div_scalar",
        /// `x ^ s`.
        Pow => "pow_scalar",
        /// `max(x, s)`.
        Maximum => "maximum_scalar",
        /// `min(x, s)`.
        Minimum => "minimum_scalar",
    }
);

named_enum!(
    /// Elementwise comparisons (output `u8`).
    CmpOp {
        /// `a == b`.
        Eq => "eq",
        /// `a != b`.
        Ne => "ne",
        /// `a < b`.
        Lt => "lt",
        /// `a <= b`.
        Le => "le",
        /// `a > b`.
        Gt => "gt",
        /// `a >= b`.
        Ge => "ge",
    }
);

/// An op, with its static (non-tensor) arguments.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `[..b, m, k] x [..b, k, n]`, equal batch dims (mm / bmm).
    Matmul,
    /// Like `Matmul` with numpy-broadcast batch dims.
    BroadcastMatmul,
    /// `y = x w^T (+ b)`: inputs `x [.., in]`, `w [out, in]`, optionally `b [out]`.
    Linear {
        /// Whether the bias input is present.
        bias: bool,
    },
    /// Elementwise unary map.
    Unary(UnaryOp),
    /// `x * mul + add`.
    Affine {
        /// Multiplier.
        mul: Scalar,
        /// Offset.
        add: Scalar,
    },
    /// Binary op with a scalar.
    ScalarOp(ScalarOp, Scalar),
    /// Broadcasting binary op.
    Binary(BinaryOp),
    /// Broadcasting comparison.
    Cmp(CmpOp),
    /// Sum over `dims` (empty = all).
    Sum {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    },
    /// Mean over `dims` (empty = all).
    Mean {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    },
    /// Max over `dims` (values only; empty = all).
    Max {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    },
    /// Min over `dims` (values only; empty = all).
    Min {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    },
    /// Index of the max along `dim` (output `u32`).
    ArgMax {
        /// Reduced dim.
        dim: usize,
        /// Keep it as size 1.
        keepdim: bool,
    },
    /// Softmax along `dim`.
    Softmax {
        /// Normalized dim.
        dim: usize,
    },
    /// Log-softmax along `dim`.
    LogSoftmax {
        /// Normalized dim.
        dim: usize,
    },
    /// Layer norm over the last dim; inputs `x`, then `w` if `affine`, then `b` if `bias`.
    LayerNorm {
        /// Epsilon.
        eps: Scalar,
        /// Weight input present.
        affine: bool,
        /// Bias input present (requires `affine`).
        bias: bool,
    },
    /// RMS norm over the last dim; inputs `x`, `w`.
    RmsNorm {
        /// Epsilon.
        eps: Scalar,
    },
    /// Inputs `ids [..]` (integer), `weight [V, D]` -> `[.., D]`.
    Embedding,
    /// Inputs `logits [N, C]`, `targets [N]` (integer) -> scalar mean loss.
    CrossEntropy,
    /// View/reshape to `shape` (same numel).
    Reshape {
        /// Target global shape.
        shape: Shape,
    },
    /// Swap two dims.
    Transpose {
        /// First dim.
        dim0: usize,
        /// Second dim.
        dim1: usize,
    },
    /// Permute dims (`out[i] = in[dims[i]]`).
    Permute {
        /// The permutation.
        dims: Dims,
    },
    /// `x.narrow(dim, start, len)`.
    Narrow {
        /// Dim.
        dim: usize,
        /// First index.
        start: usize,
        /// Length.
        len: usize,
    },
    /// Remove a size-1 dim.
    Squeeze {
        /// Dim.
        dim: usize,
    },
    /// Insert a size-1 dim at `dim`.
    Unsqueeze {
        /// Position of the new dim.
        dim: usize,
    },
    /// Broadcast (expand) to `shape`.
    BroadcastAs {
        /// Target global shape.
        shape: Shape,
    },
    /// Flatten dims `start..=end` into one.
    Flatten {
        /// First dim.
        start: usize,
        /// Last dim (inclusive).
        end: usize,
    },
    /// Concatenate the inputs along `dim`.
    Cat {
        /// Dim.
        dim: usize,
    },
    /// Stack the inputs along a new dim `dim`.
    Stack {
        /// Position of the new dim.
        dim: usize,
    },
    /// Make contiguous (identity on layouts).
    Contiguous,
    /// Cast to a dtype.
    ToDType(DType),
    /// `where(cond, on_true, on_false)` with broadcasting; `cond` is `u8`.
    Where,
    /// `x.masked_fill(mask, value)`; `mask` (`u8`) broadcasts to `x`.
    MaskedFill {
        /// Fill value.
        value: Scalar,
    },
    /// Dropout with probability `p` (sharded only: a partial sum cannot be masked per summand).
    Dropout {
        /// Drop probability.
        p: Scalar,
    },
    /// Scaled dot-product attention `q [B, H, T, d]`, `k`, `v [B, H, S, d]` -> `[B, H, T, dv]`.
    Sdpa {
        /// Causal mask.
        causal: bool,
        /// Softmax scale (default `1/sqrt(d)`).
        scale: Option<Scalar>,
    },
    /// Attention on a packed projection `qkv [B, T, H, 3, d]` (each head's q, k, v side by side,
    /// as a fused QKV linear lays them out) -> `[B, T, H, d]`. One op instead of the split /
    /// transpose views, so the local kernel reads q, k, v in place and writes the merged-heads
    /// layout directly.
    PackedSdpa {
        /// Causal mask.
        causal: bool,
        /// Softmax scale (default `1/sqrt(d)`).
        scale: Option<Scalar>,
    },
    /// `src.index_select(ids, dim)`; `ids` is 1-D integer.
    IndexSelect {
        /// Indexed dim of `src`.
        dim: usize,
    },
    /// `src.gather(index, dim)`; `index` has `src`'s rank.
    Gather {
        /// Indexed dim of `src`.
        dim: usize,
    },
}

impl Op {
    /// The DTensor method name (`matmul`, `add`, `sum`, `softmax`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Matmul => "matmul",
            Op::BroadcastMatmul => "broadcast_matmul",
            Op::Linear { .. } => "linear",
            Op::Unary(u) => u.name(),
            Op::Affine { .. } => "affine",
            Op::ScalarOp(s, _) => s.name(),
            Op::Binary(b) => b.name(),
            Op::Cmp(c) => c.name(),
            Op::Sum { .. } => "sum",
            Op::Mean { .. } => "mean",
            Op::Max { .. } => "max",
            Op::Min { .. } => "min",
            Op::ArgMax { .. } => "argmax",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Embedding => "embedding",
            Op::CrossEntropy => "cross_entropy",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Permute { .. } => "permute",
            Op::Narrow { .. } => "narrow",
            Op::Squeeze { .. } => "squeeze",
            Op::Unsqueeze { .. } => "unsqueeze",
            Op::BroadcastAs { .. } => "broadcast_as",
            Op::Flatten { .. } => "flatten",
            Op::Cat { .. } => "cat",
            Op::Stack { .. } => "stack",
            Op::Contiguous => "contiguous",
            Op::ToDType(_) => "to_dtype",
            Op::Where => "where",
            Op::MaskedFill { .. } => "masked_fill",
            Op::Dropout { .. } => "dropout",
            Op::Sdpa { .. } => "sdpa",
            Op::PackedSdpa { .. } => "packed_sdpa",
            Op::IndexSelect { .. } => "index_select",
            Op::Gather { .. } => "gather",
        }
    }

    /// Every op name `explain --op` accepts.
    pub fn known_names() -> Vec<&'static str> {
        let mut v = vec![
            "matmul",
            "broadcast_matmul",
            "linear",
            "affine",
            "sum",
            "mean",
            "max",
            "min",
            "argmax",
            "softmax",
            "log_softmax",
            "layer_norm",
            "rms_norm",
            "embedding",
            "cross_entropy",
            "reshape",
            "transpose",
            "permute",
            "narrow",
            "squeeze",
            "unsqueeze",
            "broadcast_as",
            "flatten",
            "cat",
            "stack",
            "contiguous",
            "to_dtype",
            "where",
            "masked_fill",
            "dropout",
            "sdpa",
            "packed_sdpa",
            "index_select",
            "gather",
        ];
        v.extend(UnaryOp::ALL.iter().map(|u| u.name()));
        v.extend(BinaryOp::ALL.iter().map(|u| u.name()));
        v.extend(ScalarOp::ALL.iter().map(|u| u.name()));
        v.extend(CmpOp::ALL.iter().map(|u| u.name()));
        v
    }

    /// Output metas for these input metas.
    ///
    /// # Errors
    /// [`StrategyError::Shape`] / [`StrategyError::InvalidArgument`] naming the op and the shapes,
    /// e.g. `matmul: inner dims differ: [8, 16] x [12, 4]`.
    pub fn output_metas(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
        crate::ops::output_metas(self, inputs)
    }

    /// Number of tensor inputs the op takes (`None` for `cat`/`stack`, which take any number >= 1).
    pub fn num_inputs(&self) -> Option<usize> {
        Some(match self {
            Op::Matmul | Op::BroadcastMatmul | Op::Binary(_) | Op::Cmp(_) => 2,
            Op::Linear { bias } => 2 + *bias as usize,
            Op::LayerNorm { affine, bias, .. } => 1 + *affine as usize + *bias as usize,
            Op::RmsNorm { .. } | Op::Embedding | Op::CrossEntropy | Op::MaskedFill { .. } => 2,
            Op::IndexSelect { .. } | Op::Gather { .. } => 2,
            Op::Where | Op::Sdpa { .. } => 3,
            Op::Cat { .. } | Op::Stack { .. } => return None,
            _ => 1,
        })
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Resolves a possibly negative dim against `ndim` (`-1` is the last dim).
///
/// # Errors
/// [`StrategyError::InvalidArgument`] when out of range.
pub fn normalize_dim(dim: isize, ndim: usize) -> Result<usize> {
    let n = ndim as isize;
    let d = if dim < 0 { dim + n } else { dim };
    if d < 0 || d >= n {
        return Err(StrategyError::arg(
            "dim",
            format!("dim {dim} out of range for a {ndim}-d tensor"),
        ));
    }
    Ok(d as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_scalars() {
        assert_eq!(Op::Binary(BinaryOp::Add).to_string(), "add");
        assert_eq!(Op::Unary(UnaryOp::GeluErf).to_string(), "gelu_erf");
        assert_eq!(UnaryOp::from_name("silu"), Some(UnaryOp::Silu));
        assert_eq!(Scalar::new(-0.0), Scalar::new(0.0));
        assert_eq!(Scalar::new(1.5).get(), 1.5);
        assert_eq!(normalize_dim(-1, 3).unwrap(), 2);
        assert!(normalize_dim(3, 3).is_err());
        assert!(normalize_dim(-4, 3).is_err());
        let names = Op::known_names();
        assert!(names.contains(&"matmul") && names.contains(&"gelu") && names.contains(&"ge"));
    }
}
