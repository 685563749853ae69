//! The error type of the comm layer.

use std::time::Duration;

use crate::vocab::OpCtx;

/// Everything that can go wrong in a communicator.
///
/// Every variant produced by an operation carries the [`OpCtx`] (op, communicator, rank, seq),
/// so a message alone tells what failed and where. `CommError` is `Clone` because one failure
/// (a timeout, an abort, a desync) is reported to every pending operation of the communicator.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not join a collective (or did not send a message) within the timeout.
    #[error("{ctx}: timed out after {timeout:?} waiting for ranks {missing:?}")]
    Timeout {
        /// Where.
        ctx: OpCtx,
        /// How long the operation waited.
        timeout: Duration,
        /// The communicator-relative ranks that never arrived.
        missing: Vec<usize>,
    },
    /// The communicator was aborted (explicitly, or because a peer failed or an earlier op
    /// timed out); pending and future operations fail with this.
    #[error("{ctx}: communicator aborted: {reason}")]
    Aborted {
        /// Where.
        ctx: OpCtx,
        /// Why the communicator is unusable.
        reason: String,
    },
    /// Two ranks issued different operations (or different dtypes / sizes) at the same place in
    /// the sequence of collectives.
    #[error("{ctx}: desync at collective #{collective}: rank {rank_a} issued {op_a} but rank {rank_b} issued {op_b}")]
    Desync {
        /// Where (the rank that reports it).
        ctx: OpCtx,
        /// The collective index (0-based, per communicator) at which the ranks disagree.
        collective: u64,
        /// One side.
        rank_a: usize,
        /// What that side issued. (`Box<str>` rather than `String` keeps `CommError` within
        /// clippy's `result_large_err` limit: it travels in every `Result` of the crate.)
        op_a: Box<str>,
        /// The other side.
        rank_b: usize,
        /// What that side issued.
        op_b: Box<str>,
    },
    /// A caller-side argument is wrong (rank out of range, sizes that do not divide, ...).
    #[error("{ctx}: invalid argument: {reason}")]
    InvalidArgument {
        /// Where.
        ctx: OpCtx,
        /// What is wrong.
        reason: String,
    },
    /// The dtype is not supported by this op or backend.
    #[error("{ctx}: unsupported dtype {dtype:?}: {reason}")]
    UnsupportedDType {
        /// Where.
        ctx: OpCtx,
        /// The dtype.
        dtype: candle_core::DType,
        /// Why.
        reason: String,
    },
    /// The backend does not implement this operation.
    #[error("{op}: not supported by backend \"{backend}\"")]
    Unsupported {
        /// The backend name.
        backend: String,
        /// The operation.
        op: String,
    },
    /// The backend exists but was not compiled in.
    #[error("backend \"{backend}\" is not compiled in; rebuild with cargo feature `{feature}`")]
    NotCompiled {
        /// The backend name.
        backend: String,
        /// The cargo feature that enables it.
        feature: String,
    },
    /// `new_comm` was asked for a backend nobody registered.
    #[error(
        "unknown backend \"{name}\"; registered backends: {available:?} (the built-in backends \
         are registered by `candle_dtensor_comm`: its `new_comm` calls `register_builtin_backends`)"
    )]
    UnknownBackend {
        /// The requested name.
        name: String,
        /// What is registered.
        available: Vec<String>,
    },
    /// Creating a communicator failed (rendezvous, registry, environment).
    #[error("bootstrap of comm \"{comm}\": {reason}")]
    Bootstrap {
        /// The communicator being created.
        comm: String,
        /// What went wrong.
        reason: String,
    },
    /// The ranks calling [`crate::Comm::shrink`] passed different excluded sets (or this rank
    /// is excluded by the set the others agreed on). Every participant reports it, naming each
    /// rank's proposal.
    #[error(
        "{ctx}: the ranks disagree on the excluded set: {}",
        render_proposals(proposals)
    )]
    ShrinkDisagree {
        /// Where.
        ctx: OpCtx,
        /// Each participant's excluded set, by rank (of the communicator being shrunk).
        proposals: Vec<(usize, Vec<usize>)>,
    },
    /// Ranks that were expected in a [`crate::Comm::shrink`] were lost (their connection broke,
    /// their thread failed) or stayed silent past the timeout during it. Every survivor reports
    /// the same ranks; shrinking again with them excluded as well succeeds.
    #[error("{ctx}: ranks {lost:?} were lost during the shrink (every survivor reports the same ranks; shrink again excluding them)")]
    RanksLost {
        /// Where.
        ctx: OpCtx,
        /// The lost ranks (of the communicator being shrunk).
        lost: Vec<usize>,
    },
    /// A backend answered a collective with another kind of outcome than the op's (a bug in
    /// the backend, not in the caller).
    #[error("{ctx}: backend \"{backend}\" answered with {got}, not the op's kind of outcome")]
    WrongOutcome {
        /// Where.
        ctx: OpCtx,
        /// The backend name.
        backend: &'static str,
        /// The kind it answered with.
        got: &'static str,
    },
    /// A candle operation inside the comm layer failed.
    #[error("{ctx}: candle: {message}")]
    Candle {
        /// Where.
        ctx: OpCtx,
        /// The candle error, rendered.
        message: String,
    },
}

impl CommError {
    /// The operation context, for the variants produced by an operation.
    pub fn ctx(&self) -> Option<&OpCtx> {
        match self {
            CommError::Timeout { ctx, .. }
            | CommError::Aborted { ctx, .. }
            | CommError::Desync { ctx, .. }
            | CommError::InvalidArgument { ctx, .. }
            | CommError::UnsupportedDType { ctx, .. }
            | CommError::Candle { ctx, .. }
            | CommError::WrongOutcome { ctx, .. }
            | CommError::ShrinkDisagree { ctx, .. }
            | CommError::RanksLost { ctx, .. } => Some(ctx),
            _ => None,
        }
    }

    /// Whether this error means the communicator is unusable from now on (timeout, abort, desync).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            CommError::Timeout { .. } | CommError::Aborted { .. } | CommError::Desync { .. }
        )
    }

    /// [`CommError::InvalidArgument`] of the operation `ctx`, saying why.
    pub fn invalid(ctx: &OpCtx, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            ctx: ctx.clone(),
            reason: reason.into(),
        }
    }

    /// [`CommError::Candle`] of the operation `ctx`: a candle error, as text.
    pub fn candle(ctx: &OpCtx, err: candle_core::Error) -> Self {
        CommError::Candle {
            ctx: ctx.clone(),
            message: err.to_string(),
        }
    }
}

fn render_proposals(p: &[(usize, Vec<usize>)]) -> String {
    p.iter()
        .map(|(r, ex)| format!("rank {r} excludes {ex:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `Result` with [`CommError`].
pub type Result<T, E = CommError> = std::result::Result<T, E>;

impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        candle_core::Error::wrap(e)
    }
}
