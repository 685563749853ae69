//! The error type of the models layer.

use candle_dtensor_comm::CommError;
use candle_dtensor_core::DTensorError;
use candle_dtensor_mesh::MeshError;
use candle_dtensor_parallel::{MoeError, ParallelError};

/// Errors of model construction and the models' forward passes.
#[non_exhaustive]
#[derive(thiserror::Error)]
pub enum ModelError {
    /// A bad configuration (mesh vs. model sizes, unknown names, ...).
    #[error("config: {0}")]
    Config(String),
    /// Sharding, a tensor-parallel plan or the expert-parallel dispatch failed (FSDP's
    /// [`ParallelError::ReleasedParameter`], a mixture-of-experts layer's [`MoeError`], ...;
    /// boxed: [`ParallelError`] is large).
    #[error(transparent)]
    Parallel(Box<ParallelError>),
    /// A DTensor op failed.
    #[error(transparent)]
    DTensor(#[from] DTensorError),
    /// A mesh op failed.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// An activation checkpoint's recompute disagreed with its forward (a checkpointed
    /// function must be deterministic).
    #[error("activation checkpointing: {0}")]
    Recompute(String),
    /// A combination of settings this crate does not implement (e.g. a tied LM head split
    /// over pipeline stages); refused rather than run wrong.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A candle op failed.
    #[error("candle: {0}")]
    Candle(candle_core::Error),
}

impl From<ParallelError> for ModelError {
    fn from(e: ParallelError) -> Self {
        ModelError::Parallel(Box::new(e))
    }
}

impl From<MoeError> for ModelError {
    fn from(e: MoeError) -> Self {
        ParallelError::from(e).into()
    }
}

/// Debug prints the message: these errors travel inside candle's `WrappedContext`, whose own
/// message shows the wrapped error with `{:?}`.
impl std::fmt::Debug for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `Result` with [`ModelError`].
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Carried through candle ops as candle's `WrappedContext`, which keeps the typed error
/// downcastable; `From<candle_core::Error>` recovers it.
impl From<ModelError> for candle_core::Error {
    fn from(e: ModelError) -> Self {
        candle_dtensor_core::into_candle(e)
    }
}

/// A wrapped [`ModelError`] comes back as itself; anything else as [`ParallelError`]'s
/// conversion makes it (a wrapped [`ParallelError`], e.g. FSDP's, as [`ModelError::Parallel`];
/// a DTensor or plain candle error as [`ModelError::DTensor`] or [`ModelError::Candle`]).
impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        let e = match candle_dtensor_core::typed_in_candle::<ModelError>(e) {
            Ok(typed) => return typed,
            Err(e) => e,
        };
        match ParallelError::from(e) {
            ParallelError::Candle(e) => ModelError::Candle(e),
            ParallelError::DTensor(e) => ModelError::DTensor(e),
            other => other.into(),
        }
    }
}
