//! The error type of the models layer.

use candle_dtensor_comm::CommError;
use candle_dtensor_core::DTensorError;
use candle_dtensor_mesh::MeshError;

/// Errors of model construction and training.
#[non_exhaustive]
#[derive(thiserror::Error)]
pub enum ModelError {
    /// A bad configuration (mesh vs. model sizes, unknown names, ...).
    #[error("config: {0}")]
    Config(String),
    /// A DTensor op failed.
    #[error(transparent)]
    DTensor(#[from] DTensorError),
    /// A mesh op failed.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Fault-tolerant training ([`crate::trainer::TrainConfig::fault_tolerant`]) cannot go on:
    /// every replica lost a rank, or a step failed while no rank was lost.
    #[error("fault-tolerant training stops at step {step}: {reason} (lost world ranks {lost:?})")]
    Unrecoverable {
        /// The global step that failed.
        step: usize,
        /// The ranks of the original world that were lost so far.
        lost: Vec<usize>,
        /// Why the survivors cannot continue.
        reason: String,
    },
    /// A candle op failed.
    #[error("candle: {0}")]
    Candle(candle_core::Error),
    /// An FSDP unit's forward read a parameter whose storage is released: one used outside
    /// the unit that owns it (e.g. a tied weight shared by two units).
    #[error(
        "FSDP: the forward of unit `{unit}` read a released parameter (candle: {candle}); released now: [{}]. Use every parameter inside the forward of the unit that owns it: put shared (tied) parameters in one unit (e.g. the root), or wrap the module that uses them",
        released.join(", ")
    )]
    ReleasedParameter {
        /// The unit whose forward failed.
        unit: String,
        /// The parameters whose storage was released at that moment.
        released: Vec<String>,
        /// candle's error.
        candle: String,
    },
    /// A mixture-of-experts layer failed (bad settings, ranks that disagree).
    #[error(transparent)]
    Moe(#[from] crate::moe::MoeError),
    /// Saving or loading a checkpoint failed (boxed: the integrity errors carry paths and
    /// names).
    #[error(transparent)]
    Checkpoint(Box<crate::checkpoint::CheckpointError>),
}

impl From<crate::checkpoint::CheckpointError> for ModelError {
    fn from(e: crate::checkpoint::CheckpointError) -> Self {
        ModelError::Checkpoint(Box::new(e))
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

/// Carried through candle ops (FSDP's graph nodes) as candle's `WrappedContext`, which keeps
/// the typed error downcastable; `From<candle_core::Error>` recovers it.
impl From<ModelError> for candle_core::Error {
    fn from(e: ModelError) -> Self {
        candle_core::Error::WrappedContext {
            wrapped: Box::new(e),
            context: "raised by candle-dtensor".into(),
        }
        .bt()
    }
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        use candle_core::Error as E;
        fn holds_model(e: &E) -> bool {
            match e {
                E::WrappedContext { wrapped, .. } => wrapped.is::<ModelError>(),
                E::WithBacktrace { inner, .. }
                | E::Context { inner, .. }
                | E::WithPath { inner, .. } => holds_model(inner),
                _ => false,
            }
        }
        fn take(e: E) -> ModelError {
            match e {
                E::WrappedContext { wrapped, context } => match wrapped.downcast::<ModelError>() {
                    Ok(m) => *m,
                    Err(wrapped) => ModelError::Candle(E::WrappedContext { wrapped, context }),
                },
                E::WithBacktrace { inner, .. }
                | E::Context { inner, .. }
                | E::WithPath { inner, .. } => take(*inner),
                other => ModelError::Candle(other),
            }
        }
        if holds_model(&e) {
            return take(e);
        }
        match DTensorError::in_candle(&e) {
            Some(_) => ModelError::DTensor(DTensorError::from_candle("", 0, e)),
            None => ModelError::Candle(e),
        }
    }
}
