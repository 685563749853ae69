//! The errors of the expert-parallel dispatch.

/// What went wrong in a mixture-of-experts layer. Every variant names the rank reporting it
/// (`rank`, in the mesh's root communicator) and, for disagreements, the rank at fault
/// (`peer`); every rank reaches the same verdict.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// A configuration no layout can run (top-k larger than the experts, an `ep` dim larger
    /// than the experts, a zero size, ...).
    #[error("MoE {layer} (rank {rank}): {reason}")]
    Config {
        /// The layer (or `config`).
        layer: String,
        /// The reporting rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// Ranks were built with different routing tables (experts, top-k, sizes, capacity,
    /// transport).
    #[error(
        "MoE {layer} (rank {rank}): rank {peer} disagrees on the routing table: its {field} is \
         {theirs}, the other ranks' is {ours}"
    )]
    RoutingMismatch {
        /// The layer.
        layer: String,
        /// The reporting rank.
        rank: usize,
        /// The rank whose table differs from the majority's.
        peer: usize,
        /// The field.
        field: &'static str,
        /// The majority's value.
        ours: String,
        /// The peer's value.
        theirs: String,
    },
    /// A rank's exchanged counts disagree with its own token count, or come from another
    /// layer.
    #[error("MoE {layer} (rank {rank}): rank {peer} sent bad routing counts: {reason}")]
    TokenCounts {
        /// The layer.
        layer: String,
        /// The reporting rank.
        rank: usize,
        /// The rank whose counts are off.
        peer: usize,
        /// What is off.
        reason: String,
    },
    /// The RMA dispatch was asked for on a backend that cannot run it.
    #[error("MoE (rank {rank}): the RMA dispatch needs RMA windows with put and signal: {reason}")]
    RmaUnsupported {
        /// The reporting rank.
        rank: usize,
        /// The backend's capabilities, or its error.
        reason: String,
    },
}
