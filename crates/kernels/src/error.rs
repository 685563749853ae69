//! Errors of the fused kernels' device paths: each names the op, the shape and what was wrong
//! (the limit, the dtype), and converts into `candle_core::Error` (wrapped) at the op boundary.

use candle_core::DType;

/// Why a fused kernel refused its input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// The kernel has no implementation for this dtype on this device.
    #[error("{op}: the fused {device} kernel takes {supported}, not {dtype:?} (shape {shape:?})")]
    UnsupportedDType {
        /// The op.
        op: &'static str,
        /// The device the kernel was asked to run on.
        device: &'static str,
        /// The dtype given.
        dtype: DType,
        /// What the kernel takes.
        supported: &'static str,
        /// The operand's shape.
        shape: Vec<usize>,
    },
    /// The operand is a strided view (the public functions make their inputs contiguous; a
    /// direct call of a node's forward may not).
    #[error("{op}: operand {operand} of shape {shape:?} must be contiguous")]
    NotContiguous {
        /// The op.
        op: &'static str,
        /// Which operand.
        operand: &'static str,
        /// The operand's shape.
        shape: Vec<usize>,
    },
    /// A size beyond what the kernel indexes (a row length is a 32-bit int in the kernels).
    #[error("{op}: {what} of {value} (shape {shape:?}) exceeds the kernel's limit of {limit}")]
    TooLarge {
        /// The op.
        op: &'static str,
        /// The size that is too large.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The kernel's limit.
        limit: usize,
        /// The operand's shape.
        shape: Vec<usize>,
    },
    /// Operands whose shapes or dtypes do not fit together.
    #[error("{op}: {detail}")]
    Mismatch {
        /// The op.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
}

impl From<KernelError> for candle_core::Error {
    fn from(e: KernelError) -> Self {
        candle_core::Error::wrap(e)
    }
}
