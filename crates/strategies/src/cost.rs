//! The alpha-beta cost model.
//!
//! `est_us = launch_us + latency_us * steps + wire_bytes / bandwidth`, per mesh dim (or per
//! flattened group, see [`MeshTopology::group_link`](crate::MeshTopology::group_link)).
//! `bytes` follows the nccl-tests "size" convention and `wire_bytes` its bus-bandwidth factors:
//!
//! | kind            | `bytes` (S)                                   | wire bytes        | steps    |
//! |-----------------|-----------------------------------------------|-------------------|----------|
//! | all_gather      | gathered output per rank (padded)             | (n-1)/n · S       | n-1      |
//! | reduce_scatter  | unreduced input per rank (padded)             | (n-1)/n · S       | n-1      |
//! | all_reduce      | the buffer                                    | 2(n-1)/n · S      | 2(n-1)   |
//! | all_to_all      | the LOCAL buffer (padded)                     | (n-1)/n · S       | n-1      |
//! | rma_get         | all requested bytes (rows owned anywhere)     | (n-1)/n · S ÷ 0.5 | n-1      |
//! | ring_exchange   | every rank's blocks (the gathered size)       | (n-1)/n · S       | n-1      |
//! | local / noop    | -                                             | 0                 | 0 (free) |
//!
//! all_to_all is priced for what it moves, not as an all_gather plus a penalty (PyTorch's +1.0).
//! rma_get: one-sided gets of scattered rows from each of the n-1 other owners; we expect
//! (n-1)/n of the requested rows to live elsewhere and assume such fine-grained transfers reach
//! half the link bandwidth ([`RMA_EFFICIENCY`]). Local ops (chunk, partition, relabel) cost 0: a
//! local copy is far cheaper than any collective, and a zero keeps "no communication" exact.
//! ring_exchange: blocks passed around the ring by send/recv, `n-1` hops (ring attention's K/V);
//! priced like the all_gather it replaces, which moves the same bytes in as many steps.
//! A group of size 1 costs 0 for every kind.

use std::fmt;

use serde::Serialize;

use crate::mesh::MeshDim;

/// Fraction of link bandwidth a one-sided gather of scattered rows achieves.
pub const RMA_EFFICIENCY: f64 = 0.5;

/// What a redistribution step (or an op's internal communication) does on its mesh dim(s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// `Shard`/`StridedShard -> Replicate`.
    AllGather,
    /// `Partial -> Replicate`.
    AllReduce,
    /// `Partial -> Shard`.
    ReduceScatter,
    /// `Shard(i) -> Shard(j)`.
    AllToAll,
    /// One-sided get of remote rows (index ops over a sharded source).
    RmaGet,
    /// Blocks passed around the ring with send/recv, each rank seeing every block once (ring
    /// attention's keys and values).
    RingExchange,
    /// `Replicate -> Shard` (local `chunk`/index select, no communication).
    LocalChunk,
    /// `Replicate -> Partial` (local: `sum` divides by n, `avg`/`max`/`min` keep the value).
    LocalPartition,
    /// Relabel only (mesh dim of size 1, `MaskPartial -> P(sum)`).
    Noop,
}

impl CollectiveKind {
    /// snake_case name (`all_gather`, ...), as serialized.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::RmaGet => "rma_get",
            CollectiveKind::RingExchange => "ring_exchange",
            CollectiveKind::LocalChunk => "local_chunk",
            CollectiveKind::LocalPartition => "local_partition",
            CollectiveKind::Noop => "noop",
        }
    }

    /// True for the kinds that move data between ranks.
    pub fn is_communication(self) -> bool {
        matches!(
            self,
            CollectiveKind::AllGather
                | CollectiveKind::AllReduce
                | CollectiveKind::ReduceScatter
                | CollectiveKind::AllToAll
                | CollectiveKind::RmaGet
                | CollectiveKind::RingExchange
        )
    }

    /// Latency-bound steps on a group of `n` ranks.
    pub fn steps(self, n: usize) -> usize {
        let n1 = n.saturating_sub(1);
        match self {
            CollectiveKind::AllReduce => 2 * n1,
            k if k.is_communication() => n1,
            _ => 0,
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes each rank puts on the wire for a collective of size `bytes` (see the module table).
pub fn wire_bytes(kind: CollectiveKind, bytes: u64, n: usize) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let frac = (n - 1) as f64 / n as f64;
    let b = bytes as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * frac * b,
        CollectiveKind::AllGather
        | CollectiveKind::ReduceScatter
        | CollectiveKind::AllToAll
        | CollectiveKind::RingExchange => frac * b,
        CollectiveKind::RmaGet => frac * b,
        _ => 0.0,
    }
}

/// Estimated time (µs) of one collective of `kind` and size `bytes` over `dim`
/// (`launch + latency * steps + wire / bandwidth`); 0 for local kinds and groups of size 1.
pub fn collective_cost_us(kind: CollectiveKind, bytes: u64, dim: &MeshDim) -> f64 {
    let n = dim.size;
    if n <= 1 || !kind.is_communication() {
        return 0.0;
    }
    let mut bw = dim.bandwidth_gbps * 1e3; // bytes per µs
    if kind == CollectiveKind::RmaGet {
        bw *= RMA_EFFICIENCY;
    }
    let wire = wire_bytes(kind, bytes, n);
    let transfer = if bw > 0.0 { wire / bw } else { f64::INFINITY };
    dim.launch_us + dim.latency_us * kind.steps(n) as f64 + transfer
}

/// A cheap admissible lower bound of any communication over `dim`: the fixed cost plus
/// `latency * (n-1)` (bytes unknown). `launch` is dropped when `in_flattened_group`, because a
/// merged collective pays one launch for several dims.
pub(crate) fn comm_lower_bound_us(dim: &MeshDim, in_flattened_group: bool) -> f64 {
    if dim.size <= 1 {
        return 0.0;
    }
    let launch = if in_flattened_group {
        0.0
    } else {
        dim.launch_us
    };
    launch + dim.latency_us * (dim.size - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dim(n: usize) -> MeshDim {
        MeshDim {
            name: "tp".into(),
            size: n,
            latency_us: 1.0,
            bandwidth_gbps: 1.0,
            launch_us: 5.0,
        }
    }

    #[test]
    fn nccl_factors() {
        // 1 GB/s = 1000 bytes per µs.
        let d = dim(4);
        let ag = collective_cost_us(CollectiveKind::AllGather, 4000, &d);
        assert!((ag - (5.0 + 3.0 + 3.0)).abs() < 1e-9, "{ag}");
        let ar = collective_cost_us(CollectiveKind::AllReduce, 4000, &d);
        assert!((ar - (5.0 + 6.0 + 6.0)).abs() < 1e-9, "{ar}");
        let a2a = collective_cost_us(CollectiveKind::AllToAll, 1000, &d);
        assert!((a2a - (5.0 + 3.0 + 0.75)).abs() < 1e-9, "{a2a}");
        let rma = collective_cost_us(CollectiveKind::RmaGet, 4000, &d);
        assert!((rma - (5.0 + 3.0 + 6.0)).abs() < 1e-9, "{rma}");
        assert_eq!(
            collective_cost_us(CollectiveKind::LocalChunk, 4000, &d),
            0.0
        );
        assert_eq!(
            collective_cost_us(CollectiveKind::AllReduce, 4000, &dim(1)),
            0.0
        );
        assert!(comm_lower_bound_us(&d, false) <= ag.min(ar).min(a2a).min(rma));
        assert_eq!(
            serde_json::to_string(&CollectiveKind::AllToAll).unwrap(),
            "\"all_to_all\""
        );
    }
}
