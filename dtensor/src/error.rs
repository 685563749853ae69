//! The error type of the DTensor runtime.

use candle_dtensor_comm::CommError;
use candle_dtensor_mesh::MeshError;
use candle_dtensor_strategies::StrategyError;

/// Everything that can go wrong in a DTensor operation. Messages lead with the op and the rank
/// and name the placements involved.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
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

impl From<MeshError> for DTensorError {
    fn from(e: MeshError) -> Self {
        DTensorError::Mesh(Box::new(e))
    }
}

/// `Result` with [`DTensorError`].
pub type Result<T, E = DTensorError> = std::result::Result<T, E>;

impl From<DTensorError> for candle_core::Error {
    fn from(e: DTensorError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Attaches op and rank to lower-level errors.
pub(crate) trait Context<T> {
    fn ctx(self, op: &str, rank: usize) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, op: &str, rank: usize) -> Result<T> {
        self.map_err(|source| DTensorError::Candle {
            op: op.to_string(),
            rank,
            source,
        })
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

pub(crate) fn invalid(op: &str, rank: usize, reason: impl Into<String>) -> DTensorError {
    DTensorError::Invalid {
        op: op.to_string(),
        rank,
        reason: reason.into(),
    }
}
