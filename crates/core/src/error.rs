//! The error type of the DTensor runtime.

use candle_dtensor_comm::CommError;
use candle_dtensor_mesh::MeshError;
use candle_dtensor_strategies::StrategyError;

/// Everything that can go wrong in a DTensor operation. Messages lead with the op and the rank
/// and name the placements involved.
#[non_exhaustive]
#[derive(thiserror::Error)]
pub enum DTensorError {
    /// The sharding compiler rejected the op (no valid strategy, bad placements, shapes the op
    /// cannot take).
    #[error("{op} (rank {rank}{inputs}): {source}")]
    Strategy {
        /// The DTensor op.
        op: String,
        /// The rank (in the mesh's root communicator).
        rank: usize,
        /// The op's input specs (`, inputs [8, 16] f32 S(0); [12, 4] f32 R`), or empty.
        inputs: String,
        /// The compiler's error (names the op, the placements and the reason).
        #[source]
        source: Box<StrategyError>,
    },
    /// A collective failed.
    #[error("{op} (rank {rank}): {source}")]
    Comm {
        /// The DTensor op.
        op: String,
        /// The rank.
        rank: usize,
        /// The communicator's error (names the collective, comm and seq).
        #[source]
        source: Box<CommError>,
    },
    /// A mesh lookup failed.
    #[error(transparent)]
    Mesh(Box<MeshError>),
    /// A local candle op failed.
    #[error("{op} (rank {rank}): candle: {source}")]
    Candle {
        /// The DTensor op.
        op: String,
        /// The rank.
        rank: usize,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
    /// DTensors of one op live on different meshes.
    #[error("{op} (rank {rank}): inputs live on different meshes: {a} and {b}")]
    MeshMismatch {
        /// The DTensor op.
        op: String,
        /// The rank.
        rank: usize,
        /// One input's mesh and placements.
        a: String,
        /// The other input's mesh and placements.
        b: String,
    },
    /// A collective on this rank's local piece refused it. Raised inside candle graph ops (the
    /// forward and the backward of a redistribution), where it travels as a candle error that
    /// [`DTensorError::from_candle`] (and every DTensor op) turns back into this variant.
    /// Boxed to keep the error small.
    #[error(transparent)]
    Collective(Box<CollectiveError>),
    /// An argument is invalid (shapes that disagree across ranks, local pieces that do not form
    /// the stated global shape, a Partial loss, ...).
    #[error("{op} (rank {rank}): {reason}")]
    Invalid {
        /// The DTensor op.
        op: String,
        /// The rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
}

/// The details of [`DTensorError::Collective`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{op} over mesh dim {mesh_dim} (rank {rank} of {size} there): {reason}; local piece {shape:?}"
)]
pub struct CollectiveError {
    /// The collective (or local step of a redistribution).
    pub op: String,
    /// The mesh dim(s) it runs over (`dp+tp` when merged).
    pub mesh_dim: String,
    /// This rank's index in that communicator.
    pub rank: usize,
    /// The communicator's size.
    pub size: usize,
    /// The local piece's shape.
    pub shape: Vec<usize>,
    /// What is wrong.
    pub reason: String,
}

impl From<MeshError> for DTensorError {
    fn from(e: MeshError) -> Self {
        DTensorError::Mesh(Box::new(e))
    }
}

/// Debug prints the message: these errors travel inside candle's `WrappedContext`, whose own
/// message shows the wrapped error with `{:?}`.
impl std::fmt::Debug for DTensorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `Result` with [`DTensorError`].
pub type Result<T, E = DTensorError> = std::result::Result<T, E>;

/// A typed error inside a candle op: carried as candle's `WrappedContext` (the one variant
/// that keeps a `std::error::Error` a caller can downcast), so candle passes it through
/// backward passes and user code and [`DTensorError::from_candle`] recovers it.
impl From<DTensorError> for candle_core::Error {
    fn from(e: DTensorError) -> Self {
        into_candle(e)
    }
}

impl DTensorError {
    /// The typed DTensor error inside a candle error (raised by one of our graph nodes), if
    /// there is one, else candle's error attributed to `op` on `rank`.
    pub fn from_candle(op: &str, rank: usize, e: candle_core::Error) -> DTensorError {
        match Self::take_typed(e) {
            Ok(typed) => typed,
            Err(source) => DTensorError::Candle {
                op: op.to_string(),
                rank,
                source,
            },
        }
    }

    /// A reference to the typed DTensor error inside a candle error, if any (for callers that
    /// only look: `e.downcast_ref`-like).
    pub fn in_candle(e: &candle_core::Error) -> Option<&DTensorError> {
        use candle_core::Error as E;
        match e {
            E::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<DTensorError>(),
            E::WithBacktrace { inner, .. }
            | E::Context { inner, .. }
            | E::WithPath { inner, .. } => Self::in_candle(inner),
            _ => None,
        }
    }

    fn take_typed(e: candle_core::Error) -> std::result::Result<DTensorError, candle_core::Error> {
        typed_in_candle(e)
    }
}

/// A typed error as a candle error: candle's `WrappedContext` (the one variant that keeps a
/// `std::error::Error` a caller can downcast) with a backtrace, so candle passes it through
/// backward passes and user code, and [`typed_in_candle`] gets it back. Every crate's
/// `From<ItsError> for candle_core::Error` is this.
pub fn into_candle<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::WrappedContext {
        wrapped: Box::new(e),
        context: "raised by candle-dtensor".into(),
    }
    .bt()
}

/// The typed error `T` a candle error carries (raised inside a candle op, or a closure candle
/// calls, and wrapped as `WrappedContext`, under any backtrace, context or path layers), or the
/// candle error unchanged when it carries none. Every crate's `From<candle_core::Error>` for
/// its own error type starts here, so a typed error survives the trip through candle.
pub fn typed_in_candle<T: std::error::Error + Send + Sync + 'static>(
    e: candle_core::Error,
) -> std::result::Result<T, candle_core::Error> {
    use candle_core::Error as E;
    fn carries<T: std::error::Error + Send + Sync + 'static>(e: &E) -> bool {
        match e {
            E::WrappedContext { wrapped, .. } => wrapped.is::<T>(),
            E::WithBacktrace { inner, .. }
            | E::Context { inner, .. }
            | E::WithPath { inner, .. } => carries::<T>(inner),
            _ => false,
        }
    }
    fn take<T: std::error::Error + Send + Sync + 'static>(e: E) -> std::result::Result<T, E> {
        match e {
            E::WrappedContext { wrapped, context } => match wrapped.downcast::<T>() {
                Ok(typed) => Ok(*typed),
                Err(wrapped) => Err(E::WrappedContext { wrapped, context }),
            },
            E::WithBacktrace { inner, .. }
            | E::Context { inner, .. }
            | E::WithPath { inner, .. } => take(*inner),
            other => Err(other),
        }
    }
    if carries::<T>(&e) {
        take(e)
    } else {
        Err(e)
    }
}

/// Attaches op and rank to lower-level errors.
pub(crate) trait Context<T> {
    fn ctx(self, op: &str, rank: usize) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, op: &str, rank: usize) -> Result<T> {
        self.map_err(|e| DTensorError::from_candle(op, rank, e))
    }
}

impl<T> Context<T> for std::result::Result<T, CommError> {
    fn ctx(self, op: &str, rank: usize) -> Result<T> {
        self.map_err(|source| DTensorError::Comm {
            op: op.to_string(),
            rank,
            source: Box::new(source),
        })
    }
}

impl<T> Context<T> for std::result::Result<T, StrategyError> {
    fn ctx(self, op: &str, rank: usize) -> Result<T> {
        self.map_err(|source| DTensorError::Strategy {
            op: op.to_string(),
            rank,
            inputs: String::new(),
            source: Box::new(source),
        })
    }
}

/// An error of a local op's body (its DTensor op wraps it with the op name and the rank).
pub(crate) fn local_error(reason: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(reason.into())
}

pub(crate) fn invalid(op: &str, rank: usize, reason: impl Into<String>) -> DTensorError {
    DTensorError::Invalid {
        op: op.to_string(),
        rank,
        reason: reason.into(),
    }
}
