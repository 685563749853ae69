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
            /// All method names, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($s),+];
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
    /// Whether the map needs a float input: candle computes `relu`, `gelu`, `gelu_erf`,
    /// `silu` and `abs` on integers too, and has no integer form of the others (its kernels
    /// panic with `todo!` there).
    pub fn float_only(self) -> bool {
        !matches!(
            self,
            UnaryOp::Relu | UnaryOp::Gelu | UnaryOp::GeluErf | UnaryOp::Silu | UnaryOp::Abs
        )
    }

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

/// The op families: each has one file in `ops/` (shape inference and strategy rows) and one in
/// the runtime (the local kernel and the single-device reference). An op's family is declared in
/// the op table ([`Op`]); the registries dispatch on it, never on the op itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// matmul, linear (einsum-style rows).
    Matrix,
    /// Elementwise maps and broadcasting binary ops.
    Pointwise,
    /// Reductions over dims.
    Reduction,
    /// softmax, log_softmax, layer_norm, rms_norm.
    Norm,
    /// embedding.
    Embedding,
    /// cross_entropy.
    Loss,
    /// index_select, gather.
    Index,
    /// Scaled dot-product attention.
    Attention,
    /// Views and shape ops.
    View,
    /// cat, stack, casts, where, masked_fill, dropout, pad.
    Misc,
    /// scatter_add, index_put (writes at indices).
    Scatter,
    /// topk.
    Sort,
    /// cumsum.
    Scan,
}

/// What values an op input holds, for tools that make inputs (`explain --run`, tests): floats,
/// positive floats (log, sqrt, ...), integer indices below a bound, or a 0/1 mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// Any float.
    Float,
    /// A float in the op's domain only when positive (`log`, `sqrt`, `recip`, `pow`).
    Positive,
    /// Integer indices in `0..bound` (default dtype `i64`).
    Index {
        /// Exclusive upper bound of valid indices.
        bound: usize,
    },
    /// A `u8` mask of zeros and ones.
    Mask,
}

/// The static arguments an op is built from by name (the `explain` flags), with the input
/// shapes. Parsing an op from its name and these is declared per op in the op table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpArgs {
    /// Input shapes.
    pub shapes: Vec<Shape>,
    /// Dim arguments as given (negative allowed).
    pub dims: Vec<isize>,
    /// Keep reduced dims.
    pub keepdim: bool,
    /// Target shape (reshape, broadcast_as) or split sizes.
    pub to_shape: Option<Shape>,
    /// Target dtype (to_dtype).
    pub to_dtype: Option<DType>,
    /// A scalar argument (scalar ops, affine multiplier, fill value, dropout p, ...).
    pub scalar: Option<f64>,
    /// Causal attention.
    pub causal: bool,
}

impl OpArgs {
    /// Rank of the first input.
    pub fn ndim0(&self) -> usize {
        self.shapes.first().map_or(0, |s| s.len())
    }

    /// The dims, normalized against `ndim`.
    ///
    /// # Errors
    /// [`StrategyError::InvalidArgument`] for a dim out of range.
    pub fn norm_dims(&self, ndim: usize) -> Result<Dims> {
        self.dims.iter().map(|&d| normalize_dim(d, ndim)).collect()
    }

    /// The first dim normalized against `ndim`, or `default` when none was given.
    ///
    /// # Errors
    /// As [`OpArgs::norm_dims`].
    pub fn dim_or(&self, ndim: usize, default: usize) -> Result<usize> {
        match self.dims.first() {
            Some(&d) => normalize_dim(d, ndim),
            None => Ok(default),
        }
    }

    /// The last dim of the first input (0 for a 0-d input).
    pub fn last(&self) -> usize {
        self.ndim0().saturating_sub(1)
    }

    /// The scalar argument as a count (`k` of topk, a correction), or `default`.
    ///
    /// # Errors
    /// [`StrategyError::InvalidArgument`] for a negative or fractional value.
    pub fn count_or(&self, op: &str, default: usize) -> Result<usize> {
        match self.scalar {
            None => Ok(default),
            Some(v) if v >= 0.0 && v.fract() == 0.0 && v < 1e15 => Ok(v as usize),
            Some(v) => Err(StrategyError::arg(op, format!("{v} is not a count"))),
        }
    }

    /// The scalar argument, or `default`.
    pub fn scalar_or(&self, default: f64) -> Scalar {
        Scalar::new(self.scalar.unwrap_or(default))
    }

    /// The target shape, required by `op`.
    ///
    /// # Errors
    /// [`StrategyError::InvalidArgument`] when none was given.
    pub fn to_shape(&self, op: &str) -> Result<Shape> {
        self.to_shape
            .clone()
            .ok_or_else(|| StrategyError::arg(op, "needs --to-shape"))
    }

    /// Number of inputs.
    pub fn n_inputs(&self) -> usize {
        self.shapes.len()
    }
}

/// One declared op: the names it is built from and an example call, as `explain` flags (the
/// test of the op table runs every declaration's example on every name; see
/// `docs/ARCHITECTURE.md`, "Adding an op").
#[derive(Clone, Copy, Debug)]
pub struct OpDecl {
    /// Names the op is parsed from (the first is its method name; sub-op enums give several).
    pub names: &'static [&'static str],
    /// The family.
    pub family: Family,
    /// An example: `--shapes 4x6,6x8 --dims 1 ...` (shapes required; `--dims`, `--keepdim`,
    /// `--to-shape`, `--to-dtype`, `--scalar`, `--causal` optional).
    pub example: &'static str,
}

/// THE op table. One entry per op declares, in one place: the variant and its static arguments,
/// the method name, the family (which registers its shape inference, strategy rows, local
/// kernel and reference), the number of tensor inputs, how it is parsed from a name and
/// [`OpArgs`], and an example call. Entry syntax:
///
/// ```text
/// /// docs
/// Variant[: { fields } or (types)] => pattern binding the fields,
///     name: expr (of the bindings), names: &[..] (parsed from), family: F,
///     inputs: Option<usize> (of the bindings), parse: expr (of `name` and `a`: &OpArgs),
///     [kinds: InputKind (of the bindings, input `i` and the input `shapes`; default Float),]
///     example: "--shapes ...";
/// ```
macro_rules! op_table {
    (@kind) => { InputKind::Float };
    (@kind $kind:expr) => { $kind };
    ($name_id:ident, $args:ident, $i:ident, $shapes:ident;
     $(
        $(#[$doc:meta])*
        $variant:ident $(: $fields:tt)? => $pat:pat,
            name: $name:expr,
            names: $names:expr,
            family: $family:ident,
            inputs: $inputs:expr,
            parse: $parse:expr,
            $(kinds: $kinds:expr,)?
            example: $example:literal;
     )+) => {
        /// An op, with its static (non-tensor) arguments. Declared in the op table
        /// (`op_table!` in `op.rs`): one entry per op.
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $( $(#[$doc])* $variant $($fields)? ),+
        }

        impl Op {
            /// The DTensor method name (`matmul`, `add`, `sum`, `softmax`, ...).
            #[allow(unused_variables)]
            pub fn name(&self) -> &'static str {
                match self { $( $pat => $name ),+ }
            }

            /// The op's family (which files implement it).
            #[allow(unused_variables)]
            pub fn family(&self) -> Family {
                match self { $( $pat => Family::$family ),+ }
            }

            /// Number of tensor inputs the op takes (`None`: any number >= 1, e.g. `cat`).
            #[allow(unused_variables, clippy::identity_op)]
            pub fn num_inputs(&self) -> Option<usize> {
                match self { $( $pat => $inputs ),+ }
            }

            /// What values input `i` holds (indices and masks for the integer inputs of
            /// embedding, index ops, where, ...; positive floats where the op needs them), given
            /// the input shapes.
            #[allow(unused_variables)]
            pub fn input_kind(&self, $i: usize, $shapes: &[Shape]) -> InputKind {
                match self { $( $pat => op_table!(@kind $($kinds)?) ),+ }
            }

            /// Every declared op.
            pub fn declarations() -> &'static [OpDecl] {
                const DECLS: &[OpDecl] = &[
                    $( OpDecl { names: $names, family: Family::$family, example: $example } ),+
                ];
                DECLS
            }

            /// Builds the op called `name` from `args` (`None`: no op has that name).
            #[allow(unused_variables)]
            pub fn parse_named($name_id: &str, $args: &OpArgs) -> Option<Result<Op>> {
                $(
                    if ($names).contains(&$name_id) {
                        let parse = || -> Result<Op> { $parse };
                        return Some(parse());
                    }
                )+
                None
            }
        }
    };
}

op_table! { name, a, i, shapes;
    /// `[..b, m, k] x [..b, k, n]`, equal batch dims (mm / bmm).
    Matmul => Op::Matmul,
        name: "matmul", names: &["matmul"], family: Matrix, inputs: Some(2),
        parse: Ok(Op::Matmul),
        example: "--shapes 4x6,6x5";
    /// `beta * bias + alpha * (a @ b)`: `a [B, n, k]`, `b [B, k, m]`, `bias` broadcastable to
    /// `[B, n, m]` (inputs `bias, a, b`, as torch.baddbmm).
    Baddbmm: {
        /// Scale of the product.
        alpha: Scalar,
        /// Scale of the bias.
        beta: Scalar,
    } => Op::Baddbmm { .. },
        name: "baddbmm", names: &["baddbmm"], family: Matrix, inputs: Some(3),
        parse: Ok(Op::Baddbmm { alpha: a.scalar_or(1.0), beta: Scalar::new(1.0) }),
        example: "--shapes 2x1x5,2x4x3,2x3x5 --scalar 0.5";
    /// Like `Matmul` with numpy-broadcast batch dims.
    BroadcastMatmul => Op::BroadcastMatmul,
        name: "broadcast_matmul", names: &["broadcast_matmul"], family: Matrix, inputs: Some(2),
        parse: Ok(Op::BroadcastMatmul),
        example: "--shapes 3x4x6,6x5";
    /// `y = x w^T (+ b)`: inputs `x [.., in]`, `w [out, in]`, optionally `b [out]`.
    Linear: {
        /// Whether the bias input is present.
        bias: bool,
    } => Op::Linear { bias },
        name: "linear", names: &["linear"], family: Matrix, inputs: Some(2 + *bias as usize),
        parse: Ok(Op::Linear { bias: a.n_inputs() == 3 }),
        example: "--shapes 5x6,7x6,7";
    /// Elementwise unary map.
    Unary: (UnaryOp) => Op::Unary(u),
        name: u.name(), names: UnaryOp::NAMES, family: Pointwise, inputs: Some(1),
        parse: UnaryOp::from_name(name)
            .map(Op::Unary)
            .ok_or_else(|| StrategyError::arg(name, "not a unary op")),
        kinds: if matches!(u, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Recip) {
            InputKind::Positive
        } else {
            InputKind::Float
        },
        example: "--shapes 5x3";
    /// `x * mul + add`.
    Affine: {
        /// Multiplier.
        mul: Scalar,
        /// Offset.
        add: Scalar,
    } => Op::Affine { mul, add },
        name: "affine", names: &["affine"], family: Pointwise, inputs: Some(1),
        parse: Ok(Op::Affine { mul: a.scalar_or(1.0), add: Scalar::new(0.0) }),
        example: "--shapes 5x3 --scalar -2";
    /// Binary op with a scalar.
    ScalarOp: (ScalarOp, Scalar) => Op::ScalarOp(s, _),
        name: s.name(), names: ScalarOp::NAMES, family: Pointwise, inputs: Some(1),
        parse: ScalarOp::from_name(name)
            .map(|s| Op::ScalarOp(s, a.scalar_or(1.0)))
            .ok_or_else(|| StrategyError::arg(name, "not a scalar op")),
        kinds: if *s == ScalarOp::Pow {
            InputKind::Positive
        } else {
            InputKind::Float
        },
        example: "--shapes 5x3 --scalar 2";
    /// Broadcasting binary op.
    Binary: (BinaryOp) => Op::Binary(b),
        name: b.name(), names: BinaryOp::NAMES, family: Pointwise, inputs: Some(2),
        parse: BinaryOp::from_name(name)
            .map(Op::Binary)
            .ok_or_else(|| StrategyError::arg(name, "not a binary op")),
        example: "--shapes 5x3,1x3";
    /// Broadcasting comparison.
    Cmp: (CmpOp) => Op::Cmp(c),
        name: c.name(), names: CmpOp::NAMES, family: Pointwise, inputs: Some(2),
        parse: CmpOp::from_name(name)
            .map(Op::Cmp)
            .ok_or_else(|| StrategyError::arg(name, "not a comparison")),
        example: "--shapes 5x3,3";
    /// Sum over `dims` (empty = all).
    Sum: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::Sum { .. },
        name: "sum", names: &["sum"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Sum { dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 5x3x2 --dims 1";
    /// Mean over `dims` (empty = all).
    Mean: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::Mean { .. },
        name: "mean", names: &["mean"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Mean { dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 5x3 --dims 0 --keepdim";
    /// Max over `dims` (values only; empty = all).
    Max: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::Max { .. },
        name: "max", names: &["max"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Max { dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 5x3 --dims 1";
    /// Min over `dims` (values only; empty = all).
    Min: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::Min { .. },
        name: "min", names: &["min"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Min { dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 5x3";
    /// p-norm over `dims` (empty = all): `(sum |x|^p)^(1/p)`, `max |x|` for `p = inf`.
    Norm: {
        /// The order `p > 0` (`inf` allowed).
        p: Scalar,
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::Norm { .. },
        name: "norm", names: &["norm"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Norm { p: a.scalar_or(2.0), dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 5x6 --dims 1 --scalar 2";
    /// `log(sum(exp(x)))` over `dims` (empty = all).
    LogSumExp: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::LogSumExp { .. },
        name: "logsumexp", names: &["logsumexp"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::LogSumExp { dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 5x7 --dims 1";
    /// Variance over `dims` (empty = all) with `correction` (1: unbiased).
    Var: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
        /// Subtracted from the count (Bessel's correction: 1).
        correction: usize,
    } => Op::Var { .. },
        name: "var", names: &["var"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Var {
            dims: a.norm_dims(a.ndim0())?,
            keepdim: a.keepdim,
            correction: a.count_or(name, 1)?,
        }),
        example: "--shapes 6x5 --dims 0";
    /// Standard deviation over `dims` (empty = all) with `correction` (1: unbiased).
    Std: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
        /// Subtracted from the count (Bessel's correction: 1).
        correction: usize,
    } => Op::Std { .. },
        name: "std", names: &["std"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Std {
            dims: a.norm_dims(a.ndim0())?,
            keepdim: a.keepdim,
            correction: a.count_or(name, 1)?,
        }),
        example: "--shapes 6x5 --dims 1 --keepdim";
    /// Product over `dims` (empty = all).
    Prod: {
        /// Reduced dims.
        dims: Dims,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    } => Op::Prod { .. },
        name: "prod", names: &["prod"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::Prod { dims: a.norm_dims(a.ndim0())?, keepdim: a.keepdim }),
        example: "--shapes 4x3 --dims 0";
    /// Index of the min along `dim` (output `u32`; the first one on ties).
    ArgMin: {
        /// Reduced dim.
        dim: usize,
        /// Keep it as size 1.
        keepdim: bool,
    } => Op::ArgMin { .. },
        name: "argmin", names: &["argmin"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::ArgMin { dim: a.dim_or(a.ndim0(), a.last())?, keepdim: a.keepdim }),
        example: "--shapes 5x3 --dims 0";
    /// Index of the max along `dim` (output `u32`).
    ArgMax: {
        /// Reduced dim.
        dim: usize,
        /// Keep it as size 1.
        keepdim: bool,
    } => Op::ArgMax { .. },
        name: "argmax", names: &["argmax"], family: Reduction, inputs: Some(1),
        parse: Ok(Op::ArgMax { dim: a.dim_or(a.ndim0(), a.last())?, keepdim: a.keepdim }),
        example: "--shapes 5x3";
    /// Softmax along `dim`.
    Softmax: {
        /// Normalized dim.
        dim: usize,
    } => Op::Softmax { .. },
        name: "softmax", names: &["softmax"], family: Norm, inputs: Some(1),
        parse: Ok(Op::Softmax { dim: a.dim_or(a.ndim0(), a.last())? }),
        example: "--shapes 5x7";
    /// Log-softmax along `dim`.
    LogSoftmax: {
        /// Normalized dim.
        dim: usize,
    } => Op::LogSoftmax { .. },
        name: "log_softmax", names: &["log_softmax"], family: Norm, inputs: Some(1),
        parse: Ok(Op::LogSoftmax { dim: a.dim_or(a.ndim0(), a.last())? }),
        example: "--shapes 5x7 --dims 0";
    /// Layer norm over the last dim; inputs `x`, then `w` if `affine`, then `b` if `bias`.
    LayerNorm: {
        /// Epsilon.
        eps: Scalar,
        /// Weight input present.
        affine: bool,
        /// Bias input present (requires `affine`).
        bias: bool,
    } => Op::LayerNorm { affine, bias, .. },
        name: "layer_norm", names: &["layer_norm"], family: Norm,
        inputs: Some(1 + *affine as usize + *bias as usize),
        parse: Ok(Op::LayerNorm {
            eps: Scalar::new(1e-5),
            affine: a.n_inputs() >= 2,
            bias: a.n_inputs() == 3,
        }),
        example: "--shapes 5x6,6,6";
    /// RMS norm over the last dim; inputs `x`, `w`.
    RmsNorm: {
        /// Epsilon.
        eps: Scalar,
    } => Op::RmsNorm { .. },
        name: "rms_norm", names: &["rms_norm"], family: Norm, inputs: Some(2),
        parse: Ok(Op::RmsNorm { eps: Scalar::new(1e-6) }),
        example: "--shapes 5x6,6";
    /// Inputs `ids [..]` (integer), `weight [V, D]` -> `[.., D]`.
    Embedding => Op::Embedding,
        name: "embedding", names: &["embedding"], family: Embedding, inputs: Some(2),
        parse: Ok(Op::Embedding),
        kinds: index_or_float(i == 0, shapes, 1, 0),
        example: "--shapes 3x4,11x6";
    /// Inputs `logits [.., C]`, `targets [..]` (integer, the logits' leading dims) -> scalar
    /// mean loss over every row.
    CrossEntropy => Op::CrossEntropy,
        name: "cross_entropy", names: &["cross_entropy"], family: Loss, inputs: Some(2),
        parse: Ok(Op::CrossEntropy),
        // Class ids below C, the logits' last dim.
        kinds: index_or_float(
            i == 1,
            shapes,
            0,
            shapes.first().map_or(1, |s| s.len().saturating_sub(1)),
        ),
        example: "--shapes 7x9,7";
    /// View/reshape to `shape` (same numel).
    Reshape: {
        /// Target global shape.
        shape: Shape,
    } => Op::Reshape { .. },
        name: "reshape", names: &["reshape", "view"], family: View, inputs: Some(1),
        parse: Ok(Op::Reshape { shape: a.to_shape(name)? }),
        example: "--shapes 4x6 --to-shape 2x12";
    /// Swap two dims.
    Transpose: {
        /// First dim.
        dim0: usize,
        /// Second dim.
        dim1: usize,
    } => Op::Transpose { .. },
        name: "transpose", names: &["transpose"], family: View, inputs: Some(1),
        parse: {
            let nd = a.ndim0();
            match a.norm_dims(nd)?.as_slice() {
                [] if nd >= 2 => Ok(Op::Transpose { dim0: nd - 2, dim1: nd - 1 }),
                [d0, d1] => Ok(Op::Transpose { dim0: *d0, dim1: *d1 }),
                _ => Err(StrategyError::arg(name, "needs --dims A,B")),
            }
        },
        example: "--shapes 4x6x2 --dims 0,2";
    /// Permute dims (`out[i] = in[dims[i]]`).
    Permute: {
        /// The permutation.
        dims: Dims,
    } => Op::Permute { .. },
        name: "permute", names: &["permute"], family: View, inputs: Some(1),
        parse: Ok(Op::Permute { dims: a.norm_dims(a.ndim0())? }),
        example: "--shapes 4x6x2 --dims 2,0,1";
    /// `x.narrow(dim, start, len)`.
    Narrow: {
        /// Dim.
        dim: usize,
        /// First index.
        start: usize,
        /// Length.
        len: usize,
    } => Op::Narrow { .. },
        name: "narrow", names: &["narrow"], family: View, inputs: Some(1),
        parse: match a.dims.as_slice() {
            [d, s, l] if *s >= 0 && *l >= 0 => Ok(Op::Narrow {
                dim: normalize_dim(*d, a.ndim0())?,
                start: *s as usize,
                len: *l as usize,
            }),
            _ => Err(StrategyError::arg(name, "needs --dims DIM,START,LEN")),
        },
        example: "--shapes 4x6 --dims 1,2,3";
    /// Remove a size-1 dim.
    Squeeze: {
        /// Dim.
        dim: usize,
    } => Op::Squeeze { .. },
        name: "squeeze", names: &["squeeze"], family: View, inputs: Some(1),
        parse: Ok(Op::Squeeze { dim: a.dim_or(a.ndim0(), 0)? }),
        example: "--shapes 4x1x6 --dims 1";
    /// Insert a size-1 dim at `dim`.
    Unsqueeze: {
        /// Position of the new dim.
        dim: usize,
    } => Op::Unsqueeze { .. },
        name: "unsqueeze", names: &["unsqueeze"], family: View, inputs: Some(1),
        parse: Ok(Op::Unsqueeze { dim: a.dim_or(a.ndim0() + 1, 0)? }),
        example: "--shapes 4x6 --dims 1";
    /// Broadcast (expand) to `shape`.
    BroadcastAs: {
        /// Target global shape.
        shape: Shape,
    } => Op::BroadcastAs { .. },
        name: "broadcast_as", names: &["broadcast_as", "expand"], family: View, inputs: Some(1),
        parse: Ok(Op::BroadcastAs { shape: a.to_shape(name)? }),
        example: "--shapes 1x6 --to-shape 3x4x6";
    /// Flatten dims `start..=end` into one.
    Flatten: {
        /// First dim.
        start: usize,
        /// Last dim (inclusive).
        end: usize,
    } => Op::Flatten { .. },
        name: "flatten", names: &["flatten"], family: View, inputs: Some(1),
        parse: match a.norm_dims(a.ndim0())?.as_slice() {
            [] => Ok(Op::Flatten { start: 0, end: a.last() }),
            [s, e] => Ok(Op::Flatten { start: *s, end: *e }),
            _ => Err(StrategyError::arg(name, "needs --dims START,END")),
        },
        example: "--shapes 4x3x6 --dims 0,1";
    /// Splits `dim` into consecutive pieces of `sizes` (one output each).
    Split: {
        /// Split dim.
        dim: usize,
        /// Piece sizes (summing to the dim's size).
        sizes: Shape,
    } => Op::Split { .. },
        name: "split", names: &["split"], family: View, inputs: Some(1),
        parse: Ok(Op::Split { dim: a.dim_or(a.ndim0(), 0)?, sizes: a.to_shape(name)? }),
        example: "--shapes 9x4 --dims 0 --to-shape 2x3x4";
    /// The slices of `dim`, one output each, without that dim.
    Unbind: {
        /// Unbound dim.
        dim: usize,
    } => Op::Unbind { .. },
        name: "unbind", names: &["unbind"], family: View, inputs: Some(1),
        parse: Ok(Op::Unbind { dim: a.dim_or(a.ndim0(), 0)? }),
        example: "--shapes 3x4 --dims 0";
    /// The `k` largest (or smallest) entries along `dim` and their indices (`u32`), in order
    /// (ties: the lower index first).
    TopK: {
        /// How many.
        k: usize,
        /// Along which dim.
        dim: usize,
        /// Largest (`true`) or smallest.
        largest: bool,
    } => Op::TopK { largest, .. },
        name: if *largest { "topk" } else { "topk_smallest" },
        names: &["topk", "topk_smallest"], family: Sort, inputs: Some(1),
        parse: Ok(Op::TopK {
            k: a.count_or(name, 1)?,
            dim: a.dim_or(a.ndim0(), a.last())?,
            largest: name == "topk",
        }),
        example: "--shapes 5x7 --dims 1 --scalar 3";
    /// `x.scatter_add(index, src, dim)`: `out[.., index[i], ..] += src[i]` along `dim`;
    /// `index` (integer) and `src` have the same shape, equal to `x`'s off `dim`.
    ScatterAdd: {
        /// Scatter dim.
        dim: usize,
    } => Op::ScatterAdd { dim },
        name: "scatter_add", names: &["scatter_add"], family: Scatter, inputs: Some(3),
        parse: Ok(Op::ScatterAdd { dim: a.dim_or(a.ndim0(), 0)? }),
        kinds: index_or_float(i == 1, shapes, 0, *dim),
        example: "--shapes 6x4,3x4,3x4 --dims 0";
    /// `x.index_put(indices, values)` along `dim`: rows `indices` (1-d integer) of `x` become
    /// (`accumulate`: get added) the rows of `values` (`values` is `x`'s shape with
    /// `indices.len()` rows on `dim`). Repeated indices add their values in both modes.
    IndexPut: {
        /// Indexed dim.
        dim: usize,
        /// Add instead of write (`index_add`).
        accumulate: bool,
    } => Op::IndexPut { dim, accumulate },
        name: if *accumulate { "index_add" } else { "index_put" },
        names: &["index_put", "index_add"], family: Scatter, inputs: Some(3),
        parse: Ok(Op::IndexPut { dim: a.dim_or(a.ndim0(), 0)?, accumulate: name == "index_add" }),
        kinds: index_or_float(i == 1, shapes, 0, *dim),
        example: "--shapes 6x4,3,3x4 --dims 0";
    /// Cumulative sum along `dim`.
    Cumsum: {
        /// Scanned dim.
        dim: usize,
    } => Op::Cumsum { .. },
        name: "cumsum", names: &["cumsum"], family: Scan, inputs: Some(1),
        parse: Ok(Op::Cumsum { dim: a.dim_or(a.ndim0(), 0)? }),
        example: "--shapes 5x6 --dims 1";
    /// Constant padding of `dim`: `before` and `after` entries of `value`.
    Pad: {
        /// Padded dim.
        dim: usize,
        /// Entries before.
        before: usize,
        /// Entries after.
        after: usize,
        /// Fill value.
        value: Scalar,
    } => Op::Pad { .. },
        name: "pad", names: &["pad"], family: Misc, inputs: Some(1),
        parse: match a.dims.as_slice() {
            [d, b, e] if *b >= 0 && *e >= 0 => Ok(Op::Pad {
                dim: normalize_dim(*d, a.ndim0())?,
                before: *b as usize,
                after: *e as usize,
                value: a.scalar_or(0.0),
            }),
            _ => Err(StrategyError::arg(name, "needs --dims DIM,BEFORE,AFTER")),
        },
        example: "--shapes 4x5 --dims 1,2,1 --scalar 0.5";
    /// Concatenate the inputs along `dim`.
    Cat: {
        /// Dim.
        dim: usize,
    } => Op::Cat { .. },
        name: "cat", names: &["cat"], family: Misc, inputs: None,
        parse: Ok(Op::Cat { dim: a.dim_or(a.ndim0(), 0)? }),
        example: "--shapes 4x6,3x6";
    /// Stack the inputs along a new dim `dim`.
    Stack: {
        /// Position of the new dim.
        dim: usize,
    } => Op::Stack { .. },
        name: "stack", names: &["stack"], family: Misc, inputs: None,
        parse: Ok(Op::Stack { dim: a.dim_or(a.ndim0() + 1, 0)? }),
        example: "--shapes 4x6,4x6 --dims 2";
    /// Make contiguous (identity on layouts).
    Contiguous => Op::Contiguous,
        name: "contiguous", names: &["contiguous"], family: Misc, inputs: Some(1),
        parse: Ok(Op::Contiguous),
        example: "--shapes 4x6";
    /// Cast to a dtype.
    ToDType: (DType) => Op::ToDType(_),
        name: "to_dtype", names: &["to_dtype"], family: Misc, inputs: Some(1),
        parse: a
            .to_dtype
            .map(Op::ToDType)
            .ok_or_else(|| StrategyError::arg(name, "needs --to-dtype")),
        example: "--shapes 4x6 --to-dtype f64";
    /// `where(cond, on_true, on_false)` with broadcasting; `cond` is `u8`.
    Where => Op::Where,
        name: "where", names: &["where"], family: Misc, inputs: Some(3),
        parse: Ok(Op::Where),
        kinds: if i == 0 { InputKind::Mask } else { InputKind::Float },
        example: "--shapes 4x1,4x6,6";
    /// `x.masked_fill(mask, value)`; `mask` (`u8`) broadcasts to `x`.
    MaskedFill: {
        /// Fill value.
        value: Scalar,
    } => Op::MaskedFill { .. },
        name: "masked_fill", names: &["masked_fill"], family: Misc, inputs: Some(2),
        parse: Ok(Op::MaskedFill { value: a.scalar_or(0.0) }),
        kinds: if i == 1 { InputKind::Mask } else { InputKind::Float },
        example: "--shapes 4x6,6 --scalar -1.5";
    /// Dropout with probability `p` (sharded only: a partial sum cannot be masked per summand).
    Dropout: {
        /// Drop probability.
        p: Scalar,
    } => Op::Dropout { .. },
        name: "dropout", names: &["dropout"], family: Misc, inputs: Some(1),
        parse: Ok(Op::Dropout { p: a.scalar_or(0.1) }),
        example: "--shapes 4x6 --scalar 0.25";
    /// Scaled dot-product attention `q [B, H, T, d]`, `k`, `v [B, H, S, d]` -> `[B, H, T, dv]`.
    Sdpa: {
        /// Causal mask.
        causal: bool,
        /// Softmax scale (default `1/sqrt(d)`).
        scale: Option<Scalar>,
    } => Op::Sdpa { .. },
        name: "sdpa", names: &["sdpa", "scaled_dot_product_attention"], family: Attention,
        inputs: Some(3),
        parse: Ok(Op::Sdpa { causal: a.causal, scale: None }),
        example: "--shapes 2x3x4x5,2x3x6x5,2x3x6x2 --causal";
    /// Attention on a packed projection `qkv [B, T, H, 3, d]` (each head's q, k, v side by side,
    /// as a fused QKV linear lays them out) -> `[B, T, H, d]`. One op instead of the split /
    /// transpose views, so the local kernel reads q, k, v in place and writes the merged-heads
    /// layout directly.
    PackedSdpa: {
        /// Causal mask.
        causal: bool,
        /// Softmax scale (default `1/sqrt(d)`).
        scale: Option<Scalar>,
    } => Op::PackedSdpa { .. },
        name: "packed_sdpa", names: &["packed_sdpa"], family: Attention, inputs: Some(1),
        parse: Ok(Op::PackedSdpa { causal: a.causal, scale: None }),
        example: "--shapes 2x5x3x3x4 --causal";
    /// Attention on the flat projection `qkv [B, T, 3 H d]` as a fused QKV linear makes it
    /// (laid out head by head: each head's q, k, v rows side by side, the packed `[H, 3, d]`
    /// flattened) -> `[B, T, H d]`, with `heads` = H. [`Op::PackedSdpa`] without the reshapes
    /// to and from `[B, T, H, 3, d]` (views, but each a graph node whose backward zero-fills
    /// and adds a gradient of its size).
    FlatSdpa: {
        /// Heads (H).
        heads: usize,
        /// Causal mask.
        causal: bool,
        /// Softmax scale (default `1/sqrt(d)`).
        scale: Option<Scalar>,
    } => Op::FlatSdpa { .. },
        name: "flat_sdpa", names: &["flat_sdpa"], family: Attention, inputs: Some(1),
        parse: Ok(Op::FlatSdpa { heads: a.count_or(name, 1)?, causal: a.causal, scale: None }),
        example: "--shapes 2x5x36 --scalar 3 --causal";
    /// `src.index_select(ids, dim)`; `ids` is 1-D integer.
    IndexSelect: {
        /// Indexed dim of `src`.
        dim: usize,
    } => Op::IndexSelect { dim },
        name: "index_select", names: &["index_select"], family: Index, inputs: Some(2),
        parse: Ok(Op::IndexSelect { dim: a.dim_or(a.ndim0(), 0)? }),
        kinds: index_or_float(i == 1, shapes, 0, *dim),
        example: "--shapes 9x4,5 --dims 0";
    /// `src.gather(index, dim)`; `index` has `src`'s rank.
    Gather: {
        /// Indexed dim of `src`.
        dim: usize,
    } => Op::Gather { dim },
        name: "gather", names: &["gather"], family: Index, inputs: Some(2),
        parse: Ok(Op::Gather { dim: a.dim_or(a.ndim0(), 0)? }),
        kinds: index_or_float(i == 1, shapes, 0, *dim),
        example: "--shapes 5x7,5x3 --dims 1";
}

/// `Index { bound: shapes[t][d] }` when `is_index`, else `Float`.
fn index_or_float(is_index: bool, shapes: &[Shape], t: usize, d: usize) -> InputKind {
    if is_index {
        let bound = shapes.get(t).and_then(|s| s.get(d)).copied().unwrap_or(1);
        InputKind::Index { bound }
    } else {
        InputKind::Float
    }
}

impl Op {
    /// Every op name `explain --op` accepts.
    pub fn known_names() -> Vec<&'static str> {
        Op::declarations()
            .iter()
            .flat_map(|d| d.names.iter().copied())
            .collect()
    }

    /// Builds the op called `name` from `args`.
    ///
    /// # Errors
    /// [`StrategyError::UnknownOp`] (listing the known names) or the op's own argument errors.
    pub fn parse(name: &str, args: &OpArgs) -> Result<Op> {
        Op::parse_named(name.trim(), args).unwrap_or_else(|| {
            let mut known = Op::known_names();
            known.push("redistribute");
            known.sort_unstable();
            Err(StrategyError::UnknownOp {
                name: name.to_string(),
                known: known.join(", "),
            })
        })
    }

    /// Output metas for these input metas.
    ///
    /// # Errors
    /// [`StrategyError::Shape`] / [`StrategyError::InvalidArgument`] naming the op and the shapes,
    /// e.g. `matmul: inner dims differ: [8, 16] x [12, 4]`.
    pub fn output_metas(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
        crate::ops::output_metas(self, inputs)
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
