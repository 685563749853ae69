//! The error type of the parallelism layer (FSDP / HSDP, tensor parallelism, expert
//! parallelism).

use candle_dtensor_comm::CommError;
use candle_dtensor_core::DTensorError;
use candle_dtensor_mesh::MeshError;

/// Errors of sharding, tensor-parallel plans and layers, and the expert-parallel dispatch.
#[non_exhaustive]
#[derive(thiserror::Error)]
pub enum ParallelError {
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
    Moe(#[from] crate::moe::error::MoeError),
}

/// Debug prints the message: these errors travel inside candle's `WrappedContext`, whose own
/// message shows the wrapped error with `{:?}`.
impl std::fmt::Debug for ParallelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `Result` with [`ParallelError`].
pub type Result<T, E = ParallelError> = std::result::Result<T, E>;

/// Carried through candle ops (FSDP's graph nodes) as candle's `WrappedContext`, which keeps
/// the typed error downcastable; `From<candle_core::Error>` recovers it.
impl From<ParallelError> for candle_core::Error {
    fn from(e: ParallelError) -> Self {
        candle_dtensor_core::into_candle(e)
    }
}

impl From<candle_core::Error> for ParallelError {
    fn from(e: candle_core::Error) -> Self {
        let e = match candle_dtensor_core::typed_in_candle::<ParallelError>(e) {
            Ok(typed) => return typed,
            Err(e) => e,
        };
        match DTensorError::in_candle(&e) {
            Some(_) => ParallelError::DTensor(DTensorError::from_candle("", 0, e)),
            None => ParallelError::Candle(e),
        }
    }
}
