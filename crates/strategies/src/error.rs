//! The crate's one error type, [`StrategyError`].
//!
//! Every variant carries what a reader needs to act: the op (its DTensor method name), the
//! placements involved (in the short `S(0),R` syntax) and the reason. Messages start with the op.

use crate::spec::Shape;

/// Result alias used throughout the crate.
pub type Result<T, E = StrategyError> = std::result::Result<T, E>;

/// Errors raised by placement parsing, layout math, op shape inference, sharding propagation and
/// redistribution planning.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    // === Placement / spec errors ===
    /// A `Shard`/`StridedShard` placement names a tensor dim the tensor does not have.
    #[error("{op}: {placement} on a {ndim}-d tensor {shape:?}")]
    ShardDimOutOfRange {
        /// The op (or `"layout"`, `"redistribute"`) that checked the spec.
        op: String,
        /// The offending placement, short form (`S(3)`).
        placement: String,
        /// Number of tensor dims.
        ndim: usize,
        /// The global tensor shape.
        shape: Shape,
    },
    /// The number of placements differs from the number of mesh dims.
    #[error("{op}: {got} placements ({placements}) for a {expected}-d mesh")]
    PlacementCount {
        /// The op that checked the spec.
        op: String,
        /// Mesh dims.
        expected: usize,
        /// Placements given.
        got: usize,
        /// The placements, short form.
        placements: String,
    },
    /// A placement that is malformed by itself (e.g. `StridedShard` with split factor 0).
    #[error("{op}: invalid placement {placement}: {reason}")]
    InvalidPlacement {
        /// The op that checked the spec.
        op: String,
        /// The placement, short form.
        placement: String,
        /// Why it is invalid.
        reason: String,
    },

    // === Op errors ===
    /// The op cannot take these input shapes/dtypes (e.g. `matmul: inner dims differ: [8, 16] x [12, 4]`).
    #[error("{op}: {reason}")]
    Shape {
        /// The op.
        op: String,
        /// What does not fit.
        reason: String,
    },
    /// A static argument of the op is invalid (dim out of range, bad number of inputs, ...).
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The op.
        op: String,
        /// What is wrong.
        reason: String,
    },
    /// No strategy row can be reached from the given input placements (should only happen when
    /// every row would need an unsupported transition, e.g. `Shard -> Partial`).
    #[error("{op}: no valid sharding strategy for inputs {inputs}: {reason}")]
    NoStrategy {
        /// The op.
        op: String,
        /// The input placements, `;`-separated.
        inputs: String,
        /// Why nothing fits.
        reason: String,
    },

    // === Redistribution errors ===
    /// A redistribution that DTensor semantics do not allow (`Shard -> Partial`, creating a
    /// `MaskPartial` or `P(product)`, ...).
    #[error("redistribute {from} -> {to}: mesh dim {mesh_dim}: {reason}")]
    UnsupportedTransition {
        /// Source placements, short form.
        from: String,
        /// Target placements, short form.
        to: String,
        /// The mesh dim whose transition is unsupported.
        mesh_dim: usize,
        /// Why.
        reason: String,
    },

    // === Parse / lookup errors ===
    /// Text that could not be parsed (placements, shapes, mesh, dtype, dims).
    #[error("cannot parse {what} from {text:?}: {reason}")]
    Parse {
        /// What was being parsed (`"placement"`, `"shape"`, `"mesh"`, ...).
        what: &'static str,
        /// The offending text.
        text: String,
        /// Why.
        reason: String,
    },
    /// An op name the crate does not know.
    #[error("unknown op {name:?}; known ops: {known}")]
    UnknownOp {
        /// The name given.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// An invalid mesh description (empty, duplicate or unknown dim names, size 0, ...).
    #[error("mesh: {reason}")]
    Mesh {
        /// What is wrong.
        reason: String,
    },
}

impl StrategyError {
    /// Shorthand for [`StrategyError::Shape`].
    pub(crate) fn shape(op: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        StrategyError::Shape {
            op: op.to_string(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`StrategyError::InvalidArgument`].
    pub(crate) fn arg(op: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        StrategyError::InvalidArgument {
            op: op.to_string(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`StrategyError::Parse`].
    pub(crate) fn parse(what: &'static str, text: &str, reason: impl Into<String>) -> Self {
        StrategyError::Parse {
            what,
            text: text.to_string(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`StrategyError::Mesh`].
    pub(crate) fn mesh(reason: impl Into<String>) -> Self {
        StrategyError::Mesh {
            reason: reason.into(),
        }
    }
}

impl From<candle_dtensor_types::ParseReduceOpError> for StrategyError {
    fn from(e: candle_dtensor_types::ParseReduceOpError) -> Self {
        StrategyError::parse(
            "reduce op",
            &e.text,
            candle_dtensor_types::ParseReduceOpError::EXPECTED,
        )
    }
}
