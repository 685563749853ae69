//! The cross-rank rules every CPU backend applies, written once: the descriptor of what a rank
//! issued at a collective index and the rule that says whether two ranks are in step
//! ([`OpDesc::compatible`]: desync detection), why a communicator is unusable ([`Failure`],
//! with one `Display` and one mapping to [`CommError`]), and the checks of `split` lists and
//! `all_to_all_v` split sizes that every rank runs on the same data, so all reach the same
//! verdict. Backends keep only their wire encoding: none for `local` (shared memory), JSON in
//! HELLO and FAIL frames for `process`, `u64` words for `mpi`; `nccl` uses the split check.

use std::fmt;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::CommError;
use crate::op::{OpCtx, OpName, ReduceOp};

/// How shapes must agree across ranks for an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShapeRule {
    /// Identical shapes.
    Exact,
    /// Identical dims after dim 0 (all_to_all_v).
    Rows,
    /// Anything (gather: the dims still travel, an mpi root needs them).
    Any,
}

/// What a rank issued at a collective index; compared across ranks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpDesc {
    /// The operation.
    pub op: OpName,
    /// The input's dtype (`None`: the op has no tensor, a barrier).
    #[serde(with = "dtype_name")]
    pub dtype: Option<DType>,
    /// How the dims must agree across ranks.
    pub rule: ShapeRule,
    /// The input's dims.
    pub dims: Vec<usize>,
    /// The root rank of a rooted op.
    pub root: Option<usize>,
    /// The reduce op of a reduction.
    pub reduce: Option<ReduceOp>,
    /// Window size (new_window).
    pub bytes: Option<usize>,
}

impl OpDesc {
    /// A descriptor of `op` with nothing else set.
    pub fn new(op: OpName) -> Self {
        OpDesc {
            op,
            dtype: None,
            rule: ShapeRule::Any,
            dims: Vec::new(),
            root: None,
            reduce: None,
            bytes: None,
        }
    }

    /// A descriptor of `op` on a tensor of `dtype` and `dims` that must agree exactly.
    pub fn of(op: OpName, dtype: DType, dims: &[usize]) -> Self {
        OpDesc {
            dtype: Some(dtype),
            rule: ShapeRule::Exact,
            dims: dims.to_vec(),
            ..OpDesc::new(op)
        }
    }

    /// [`OpDesc::of`] `t`'s dtype and dims.
    pub fn tensor(op: OpName, t: &Tensor) -> Self {
        OpDesc::of(op, t.dtype(), t.dims())
    }

    /// Whether ranks issuing `self` and `other` at the same collective index are in step.
    pub fn compatible(&self, other: &OpDesc) -> bool {
        if self.op != other.op
            || self.root != other.root
            || self.reduce != other.reduce
            || self.bytes != other.bytes
        {
            return false;
        }
        // Scatter: only the root knows the dtype.
        if self.op != OpName::Scatter && self.dtype != other.dtype {
            return false;
        }
        match (self.rule, other.rule) {
            (ShapeRule::Any, _) | (_, ShapeRule::Any) => true,
            (ShapeRule::Exact, ShapeRule::Exact) => self.dims == other.dims,
            (ShapeRule::Rows, ShapeRule::Rows) => self.rows() == other.rows(),
            _ => false,
        }
    }

    fn rows(&self) -> &[usize] {
        self.dims.get(1..).unwrap_or(&[])
    }
}

impl fmt::Display for OpDesc {
    /// `all_reduce(sum, f32, [4])`, `all_to_all_v_single(u8, [*, [7]])`,
    /// `broadcast(f32, [4], root 1)`, `new_window(64 bytes)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(r) = self.reduce {
            parts.push(r.to_string());
        }
        if let Some(d) = self.dtype {
            parts.push(d.as_str().to_string());
        }
        match self.rule {
            ShapeRule::Exact => parts.push(format!("{:?}", self.dims)),
            ShapeRule::Rows => parts.push(format!("[*, {:?}]", self.rows())),
            ShapeRule::Any => {}
        }
        if let Some(r) = self.root {
            parts.push(format!("root {r}"));
        }
        if let Some(b) = self.bytes {
            parts.push(format!("{b} bytes"));
        }
        write!(f, "{}({})", self.op, parts.join(", "))
    }
}

/// `Option<DType>` as its name (`"f32"`) in JSON (the process backend's frames, hook records).
pub mod dtype_name {
    use candle_core::DType;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Writes the dtype's name, or `null`.
    pub fn serialize<S: Serializer>(d: &Option<DType>, s: S) -> Result<S::Ok, S::Error> {
        d.map(|d| d.as_str()).serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DType>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// Why a communicator is unusable. The first failure wins, and every rank that hears of it
/// (through shared memory, FAIL frames or MPI notices) reports the same cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Failure {
    /// `abort()` was called by rank `by` (or an op of rank `by` panicked). `after`: the
    /// collectives `by` had completed then, which may still complete on every rank, since
    /// every rank reached them (process backend; `None`: every pending op fails).
    Aborted {
        /// The rank that aborted.
        by: usize,
        /// Its reason.
        reason: String,
        /// The collectives it had completed then.
        after: Option<u64>,
    },
    /// Collective `collective` (`u64::MAX`: a point-to-point or window op) timed out waiting
    /// for `missing` (empty when the backend cannot tell: an MPI collective in flight).
    Timeout {
        /// The collective index.
        collective: u64,
        /// The op that timed out.
        op: OpName,
        /// The ranks that never arrived.
        missing: Vec<usize>,
    },
    /// Two ranks issued different collectives at index `collective`.
    Desync {
        /// The collective index.
        collective: u64,
        /// One rank.
        rank_a: usize,
        /// What it issued.
        op_a: String,
        /// Another rank.
        rank_b: usize,
        /// What that one issued.
        op_b: String,
    },
    /// Ranks passed arguments of collective `collective` that do not fit together.
    Mismatch {
        /// The collective index.
        collective: u64,
        /// What does not fit.
        reason: String,
    },
    /// Local backend: a rank thread of the world failed (returned an error or panicked).
    RankFailed {
        /// The failed rank, in the world.
        world_rank: usize,
        /// Its error or panic message.
        reason: String,
    },
    /// Process backend: the connection to `rank` broke without a goodbye (its process died).
    PeerLost {
        /// The lost rank.
        rank: usize,
        /// How the connection broke.
        reason: String,
    },
    /// MPI backend: MPI itself failed.
    Mpi {
        /// MPI's error.
        what: String,
    },
    /// MPI backend: the process is finalizing MPI.
    Finalized,
}

impl Failure {
    /// An abort by rank `by` that fails every pending op.
    pub fn aborted(by: usize, reason: impl Into<String>) -> Failure {
        Failure::Aborted {
            by,
            reason: reason.into(),
            after: None,
        }
    }

    /// Ranks `a` and `b` issued `a.1` and `b.1` at collective `collective`.
    pub fn desync(
        collective: u64,
        a: (usize, &impl fmt::Display),
        b: (usize, &impl fmt::Display),
    ) -> Failure {
        Failure::Desync {
            collective,
            rank_a: a.0,
            op_a: a.1.to_string(),
            rank_b: b.0,
            op_b: b.1.to_string(),
        }
    }

    /// The error an operation at collective index `coll` (`None`: point to point) reports for
    /// this failure: the typed error when the failure is about that very collective, else
    /// `Aborted` with the failure's own text.
    pub fn to_error(&self, ctx: &OpCtx, coll: Option<u64>) -> CommError {
        match self {
            Failure::Timeout {
                collective,
                missing,
                ..
            } if Some(*collective) == coll => CommError::Timeout {
                ctx: ctx.clone(),
                timeout: ctx.timeout,
                missing: missing.clone(),
            },
            Failure::Desync {
                collective,
                rank_a,
                op_a,
                rank_b,
                op_b,
            } if Some(*collective) == coll => CommError::Desync {
                ctx: ctx.clone(),
                collective: *collective,
                rank_a: *rank_a,
                op_a: op_a.as_str().into(),
                rank_b: *rank_b,
                op_b: op_b.as_str().into(),
            },
            Failure::Mismatch { collective, reason } if Some(*collective) == coll => {
                CommError::invalid(ctx, reason.clone())
            }
            other => CommError::Aborted {
                ctx: ctx.clone(),
                reason: other.to_string(),
            },
        }
    }

    /// Whether this failure stops an op at collective index `coll` (`None`: point to point).
    ///
    /// A failure at a later collective does not: some rank got past `coll`, so every rank
    /// reached `coll` and its data is on the way (a notice from one peer can overtake another
    /// peer's frames). Such an op completes, or fails on its own deadline or a lost peer; the
    /// next op fails.
    pub fn blocks(&self, coll: Option<u64>) -> bool {
        let at = match self {
            Failure::Timeout { collective, .. }
            | Failure::Desync { collective, .. }
            | Failure::Mismatch { collective, .. } => Some(*collective),
            Failure::Aborted { after, .. } => *after,
            _ => None,
        };
        match (at, coll) {
            (Some(k), Some(j)) if k != u64::MAX => j >= k,
            _ => true,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Aborted { by, reason, .. } => write!(f, "aborted by rank {by}: {reason}"),
            Failure::Timeout {
                collective,
                op,
                missing,
            } if *collective == u64::MAX => {
                write!(f, "an earlier {op} timed out waiting for ranks {missing:?}")
            }
            Failure::Timeout {
                collective,
                op,
                missing,
            } => write!(
                f,
                "an earlier {op} (collective #{collective}) timed out waiting for ranks {missing:?}"
            ),
            Failure::Desync {
                collective,
                rank_a,
                op_a,
                rank_b,
                op_b,
            } => write!(
                f,
                "desync at collective #{collective}: rank {rank_a} issued {op_a} but rank {rank_b} issued {op_b}"
            ),
            Failure::Mismatch { collective, reason } => {
                write!(f, "collective #{collective} had mismatched arguments: {reason}")
            }
            Failure::RankFailed { world_rank, reason } => {
                write!(f, "rank {world_rank} of the local world failed: {reason}")
            }
            Failure::PeerLost { rank, reason } => write!(f, "peer rank {rank} was lost: {reason}"),
            Failure::Mpi { what } => write!(f, "MPI failed: {what}"),
            Failure::Finalized => f.write_str("MPI was finalized (the process is exiting)"),
        }
    }
}

/// Checks that the `split` lists of all ranks (`lists[r]`: rank r's list, empty to opt out)
/// fit together: every rank some rank lists must have passed that very list.
pub fn check_split_lists(lists: &[Vec<usize>]) -> Result<(), String> {
    let n = lists.len();
    for (s, list) in lists.iter().enumerate() {
        for &r in list {
            if r >= n {
                return Err(format!(
                    "rank {s} passes split list {list:?} with rank {r} out of range for {n} ranks"
                ));
            }
            if lists[r] != *list {
                return Err(format!(
                    "split lists disagree: rank {s} passes {list:?} but rank {r} passes {:?}",
                    lists[r]
                ));
            }
        }
    }
    Ok(())
}

/// Checks the `all_to_all_v` split sizes of all `n` ranks: rank i sends rank j
/// `sends(i, j)` slices, and rank j must expect as many from it (`expects(j, i)`).
pub fn check_split_sizes(
    n: usize,
    sends: impl Fn(usize, usize) -> usize,
    expects: impl Fn(usize, usize) -> usize,
) -> Result<(), String> {
    for (i, j) in (0..n).flat_map(|i| (0..n).map(move |j| (i, j))) {
        let (sent, expected) = (sends(i, j), expects(j, i));
        if sent != expected {
            return Err(format!(
                "rank {i} sends {sent} slices to rank {j} but rank {j} expects {expected} from it"
            ));
        }
    }
    Ok(())
}

/// A point-to-point message must have the dims and dtype its receiver expects: `Err` says
/// what rank `peer` sent instead.
pub fn check_recv(
    peer: usize,
    want: (&[usize], DType),
    got: (&[usize], DType),
) -> Result<(), String> {
    if want == got {
        return Ok(());
    }
    Err(format!(
        "recv from rank {peer}: expected {:?} {:?} but rank {peer} sent {:?} {:?}",
        want.0, want.1, got.0, got.1
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn rows(dims: &[usize]) -> OpDesc {
        OpDesc {
            rule: ShapeRule::Rows,
            ..OpDesc::of(OpName::AllToAllVSingle, DType::U8, dims)
        }
    }

    #[test]
    fn descriptors_render_every_field() {
        let a = OpDesc {
            reduce: Some(ReduceOp::Max),
            ..OpDesc::of(OpName::AllReduce, DType::BF16, &[4, 5])
        };
        assert_eq!(a.to_string(), "all_reduce(max, bf16, [4, 5])");
        let b = OpDesc {
            root: Some(1),
            ..OpDesc::of(OpName::Broadcast, DType::F32, &[4])
        };
        assert_eq!(b.to_string(), "broadcast(f32, [4], root 1)");
        assert_eq!(
            rows(&[3, 7]).to_string(),
            "all_to_all_v_single(u8, [*, [7]])"
        );
        let w = OpDesc {
            bytes: Some(64),
            ..OpDesc::new(OpName::NewWindow)
        };
        assert_eq!(w.to_string(), "new_window(64 bytes)");
    }

    #[test]
    fn compatibility_compares_what_every_rank_must_agree_on() {
        let a = OpDesc::of(OpName::AllReduce, DType::F32, &[4]);
        assert!(a.compatible(&a.clone()));
        assert!(!a.compatible(&OpDesc::of(OpName::AllReduce, DType::F32, &[5])));
        assert!(!a.compatible(&OpDesc::of(OpName::AllReduce, DType::F64, &[4])));
        assert!(!a.compatible(&OpDesc::of(OpName::Broadcast, DType::F32, &[4])));
        let summed = OpDesc {
            reduce: Some(ReduceOp::Sum),
            ..a.clone()
        };
        assert!(!a.compatible(&summed));
        let rooted = OpDesc {
            root: Some(0),
            ..a.clone()
        };
        assert!(!a.compatible(&rooted));
        let w = |b| OpDesc {
            bytes: Some(b),
            ..OpDesc::new(OpName::NewWindow)
        };
        assert!(!w(8).compatible(&w(16)));
        let g = |d: &[usize]| OpDesc {
            rule: ShapeRule::Any,
            ..OpDesc::of(OpName::Gather, DType::F32, d)
        };
        assert!(g(&[4]).compatible(&g(&[9, 2])), "gather shapes may differ");
        assert!(rows(&[3, 7]).compatible(&rows(&[1, 7])));
        assert!(!rows(&[3, 7]).compatible(&rows(&[1, 8])));
        assert!(!rows(&[3, 7]).compatible(&OpDesc {
            rule: ShapeRule::Exact,
            ..rows(&[3, 7])
        }));
        let s1 = OpDesc {
            root: Some(0),
            ..OpDesc::new(OpName::Scatter)
        };
        let s2 = OpDesc {
            dtype: Some(DType::F32),
            ..s1.clone()
        };
        assert!(s1.compatible(&s2), "only the root knows a scatter's dtype");
    }

    #[test]
    fn descriptors_and_failures_round_trip_as_json() {
        let d = OpDesc {
            reduce: Some(ReduceOp::Avg),
            ..OpDesc::of(OpName::ReduceScatterSingle, DType::F16, &[8, 2])
        };
        let j = serde_json::to_vec(&d).expect("serializes");
        assert_eq!(serde_json::from_slice::<OpDesc>(&j).expect("parses"), d);
        let f = Failure::Timeout {
            collective: 3,
            op: OpName::Barrier,
            missing: vec![1],
        };
        let j = serde_json::to_vec(&f).expect("serializes");
        assert_eq!(serde_json::from_slice::<Failure>(&j).expect("parses"), f);
    }

    #[test]
    fn failures_become_typed_errors_for_their_own_collective_only() {
        let ctx = OpCtx {
            op: OpName::AllReduce,
            comm: Arc::from("tp"),
            rank: 1,
            seq: 5,
            timeout: Duration::from_secs(1),
        };
        let t = Failure::Timeout {
            collective: 4,
            op: OpName::AllReduce,
            missing: vec![2, 3],
        };
        assert!(matches!(
            t.to_error(&ctx, Some(4)),
            CommError::Timeout { .. }
        ));
        let later = t.to_error(&ctx, Some(5));
        assert!(matches!(later, CommError::Aborted { .. }));
        assert!(later
            .to_string()
            .contains("an earlier all_reduce (collective #4) timed out waiting for ranks [2, 3]"));
        let d = Failure::desync(2, (0, &"barrier()"), (1, &"all_reduce(f32, [4])"));
        assert!(matches!(
            d.to_error(&ctx, Some(2)),
            CommError::Desync { .. }
        ));
        let m = Failure::Mismatch {
            collective: 2,
            reason: "sizes".into(),
        };
        assert!(matches!(
            m.to_error(&ctx, Some(2)),
            CommError::InvalidArgument { .. }
        ));
        let a = Failure::aborted(0, "operator pulled the plug");
        assert!(a
            .to_error(&ctx, None)
            .to_string()
            .contains("aborted by rank 0: operator pulled the plug"));
        assert!(a.blocks(Some(0)) && a.blocks(None));
        let after = Failure::Aborted {
            by: 0,
            reason: String::new(),
            after: Some(3),
        };
        assert!(!after.blocks(Some(2)) && after.blocks(Some(3)) && after.blocks(None));
        assert!(!t.blocks(Some(3)) && t.blocks(Some(4)));
    }

    #[test]
    fn split_lists_must_agree_and_stay_in_range() {
        let lists = vec![vec![0, 2], vec![1], vec![0, 2], vec![]];
        assert_eq!(check_split_lists(&lists), Ok(()));
        let bad = vec![vec![0, 1], vec![1]];
        let e = check_split_lists(&bad).expect_err("rank 1 disagrees");
        assert!(e.contains("split lists disagree: rank 0 passes [0, 1] but rank 1 passes [1]"));
        let out = vec![vec![0, 5], vec![]];
        assert!(check_split_lists(&out)
            .expect_err("out of range")
            .contains("out of range"));
    }

    #[test]
    fn split_sizes_must_pair_up() {
        // rows: (sends, expects) of each rank to/from each peer
        let sends = [[1, 2], [3, 4]];
        let expects = [[1, 3], [2, 4]];
        assert_eq!(
            check_split_sizes(2, |i, j| sends[i][j], |j, i| expects[j][i]),
            Ok(())
        );
        let e = check_split_sizes(2, |i, j| sends[i][j], |_, _| 1).expect_err("mismatch");
        assert_eq!(
            e,
            "rank 0 sends 2 slices to rank 1 but rank 1 expects 1 from it"
        );
    }
}
