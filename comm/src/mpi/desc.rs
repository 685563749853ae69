//! What a rank issued at a collective (exchanged before any data moves, compared across
//! ranks: desync detection, and the sizes `gather` / `all_to_all_v` / `split` need), and why a
//! communicator is unusable.

use std::fmt;

use candle_core::DType;

use crate::types::{OpName, ReduceOp, SUPPORTED_DTYPES};

/// Dims carried in a descriptor; tensors of higher rank are rejected at issue time.
pub(crate) const MAX_DIMS: usize = 16;
/// Words of the fixed part of an encoded descriptor.
pub(crate) const HEADER_WORDS: usize = 12 + MAX_DIMS;
const MAGIC: u64 = 0x4344_544d_5049_0001; // "CDTMPI" v1
const NONE: u64 = u64::MAX;

const OPS: [OpName; 22] = [
    OpName::AllReduce,
    OpName::AllGatherSingle,
    OpName::ReduceScatterSingle,
    OpName::AllToAllSingle,
    OpName::AllToAllVSingle,
    OpName::Broadcast,
    OpName::Reduce,
    OpName::Gather,
    OpName::Scatter,
    OpName::Barrier,
    OpName::Send,
    OpName::Recv,
    OpName::BatchP2p,
    OpName::Split,
    OpName::NewComm,
    OpName::NewWindow,
    OpName::WindowPut,
    OpName::WindowGet,
    OpName::WindowSignal,
    OpName::WindowWaitSignal,
    OpName::WindowFence,
    OpName::Abort,
];

const REDUCE_OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

fn code_of<T: PartialEq>(table: &[T], v: &T) -> u64 {
    table.iter().position(|x| x == v).map_or(NONE, |i| i as u64)
}

fn from_code<T: Copy>(table: &[T], c: u64) -> Option<T> {
    usize::try_from(c).ok().and_then(|i| table.get(i).copied())
}

pub(crate) fn dtype_code(d: DType) -> u64 {
    code_of(&SUPPORTED_DTYPES, &d)
}

pub(crate) fn dtype_of(c: u64) -> Option<DType> {
    from_code(&SUPPORTED_DTYPES, c)
}

pub(crate) fn op_code(op: OpName) -> u64 {
    code_of(&OPS, &op)
}

pub(crate) fn op_of(c: u64) -> Option<OpName> {
    from_code(&OPS, c)
}

/// How shapes must agree across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShapeRule {
    /// Identical shapes.
    Exact,
    /// Identical dims after dim 0 (all_to_all_v).
    Rows,
    /// Anything (gather; the dims still travel: the root needs them).
    Any,
}

/// One rank's descriptor of a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Desc {
    /// The communicator's id, agreed by its members (messages of another communicator that
    /// happen to match are recognized and dropped).
    pub uid: u64,
    /// The collective index on the communicator (0-based).
    pub coll: u64,
    pub op: OpName,
    pub dtype: Option<DType>,
    pub rule: ShapeRule,
    pub dims: Vec<usize>,
    pub root: Option<usize>,
    pub reduce: Option<ReduceOp>,
    pub bytes: Option<usize>,
    /// Op-specific words: split lists, all_to_all_v split sizes, new_comm name hashes.
    pub extra: Vec<u64>,
}

impl Desc {
    /// A descriptor of `op` with nothing else set.
    pub(crate) fn new(uid: u64, coll: u64, op: OpName) -> Self {
        Desc {
            uid,
            coll,
            op,
            dtype: None,
            rule: ShapeRule::Any,
            dims: Vec::new(),
            root: None,
            reduce: None,
            bytes: None,
            extra: Vec::new(),
        }
    }

    /// A descriptor of `op` on a tensor of `dtype` and `dims` that must agree exactly.
    pub(crate) fn tensor(uid: u64, coll: u64, op: OpName, dtype: DType, dims: &[usize]) -> Self {
        Desc {
            dtype: Some(dtype),
            rule: ShapeRule::Exact,
            dims: dims.to_vec(),
            ..Desc::new(uid, coll, op)
        }
    }

    /// The encoded words (fixed header, then `extra`).
    pub(crate) fn encode(&self) -> Vec<u64> {
        let mut w = vec![0u64; HEADER_WORDS];
        w[0] = MAGIC;
        w[1] = self.uid;
        w[2] = self.coll;
        w[3] = op_code(self.op);
        w[4] = self.dtype.map_or(NONE, dtype_code);
        w[5] = match self.rule {
            ShapeRule::Exact => 0,
            ShapeRule::Rows => 1,
            ShapeRule::Any => 2,
        };
        w[6] = self.dims.len() as u64;
        w[7] = self.root.map_or(NONE, |r| r as u64);
        w[8] = self.reduce.map_or(NONE, |r| code_of(&REDUCE_OPS, &r));
        w[9] = self.bytes.map_or(NONE, |b| b as u64);
        w[10] = self.extra.len() as u64;
        for (i, &d) in self.dims.iter().take(MAX_DIMS).enumerate() {
            w[12 + i] = d as u64;
        }
        w.extend_from_slice(&self.extra);
        w
    }

    /// Decodes `w` (a received message); `None` if it is not a descriptor.
    pub(crate) fn decode(w: &[u64]) -> Option<Desc> {
        if w.len() < HEADER_WORDS || w[0] != MAGIC {
            return None;
        }
        let ndim = usize::try_from(w[6]).ok().filter(|&n| n <= MAX_DIMS)?;
        let extra = usize::try_from(w[10]).ok()?;
        if w.len() < HEADER_WORDS + extra {
            return None;
        }
        let opt = |v: u64| (v != NONE).then_some(v as usize);
        Some(Desc {
            uid: w[1],
            coll: w[2],
            op: op_of(w[3])?,
            dtype: if w[4] == NONE {
                None
            } else {
                Some(dtype_of(w[4])?)
            },
            rule: match w[5] {
                0 => ShapeRule::Exact,
                1 => ShapeRule::Rows,
                _ => ShapeRule::Any,
            },
            dims: w[12..12 + ndim].iter().map(|&d| d as usize).collect(),
            root: opt(w[7]),
            reduce: if w[8] == NONE {
                None
            } else {
                Some(from_code(&REDUCE_OPS, w[8])?)
            },
            bytes: opt(w[9]),
            extra: w[HEADER_WORDS..HEADER_WORDS + extra].to_vec(),
        })
    }

    /// Whether `other` (another rank's descriptor of the same collective) fits with this one;
    /// the same rules as the local backend.
    pub(crate) fn compatible(&self, other: &Desc) -> bool {
        if self.op != other.op
            || self.coll != other.coll
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
            (ShapeRule::Rows, ShapeRule::Rows) => self.dims.get(1..) == other.dims.get(1..),
            _ => false,
        }
    }
}

impl fmt::Display for Desc {
    /// `all_reduce(sum, f32, [4])`, `broadcast(f32, [4], root 1)`: as the local backend.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.op)?;
        let mut parts: Vec<String> = Vec::new();
        if let Some(r) = self.reduce {
            parts.push(r.to_string());
        }
        if let Some(d) = self.dtype {
            parts.push(d.as_str().to_string());
        }
        match self.rule {
            ShapeRule::Exact => parts.push(format!("{:?}", self.dims)),
            ShapeRule::Rows => parts.push(format!("[*, {:?}]", self.dims.get(1..).unwrap_or(&[]))),
            ShapeRule::Any => {}
        }
        if let Some(r) = self.root {
            parts.push(format!("root {r}"));
        }
        if let Some(b) = self.bytes {
            parts.push(format!("{b} bytes"));
        }
        write!(f, "{})", parts.join(", "))
    }
}

/// Why a communicator is unusable (the first failure wins, on every rank that hears of it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// `abort()` was called by rank `by`.
    Aborted { by: usize, reason: String },
    /// Collective `collective` (`u64::MAX` for point-to-point and window ops) timed out waiting
    /// for `missing` (empty when MPI cannot tell: a collective already in flight).
    Timeout {
        collective: u64,
        op: OpName,
        missing: Vec<usize>,
    },
    /// Two ranks issued different collectives at index `collective`.
    Desync {
        collective: u64,
        rank_a: usize,
        op_a: String,
        rank_b: usize,
        op_b: String,
    },
    /// Ranks passed arguments of collective `collective` that do not fit together.
    Mismatch { collective: u64, reason: String },
    /// MPI itself failed.
    Mpi { what: String },
    /// The process is finalizing MPI.
    Finalized,
}

crate::error::impl_failure_to_error!(Failure);

impl Failure {
    /// Encodes the failures peers are told about (abort and timeout: every rank detects a
    /// desync or a mismatch by itself).
    pub(crate) fn encode_notice(&self, uid: u64, limit_words: usize) -> Option<Vec<u64>> {
        let (kind, by, coll, op, list, text): (u64, u64, u64, u64, &[usize], &str) = match self {
            Failure::Aborted { by, reason } => (0, *by as u64, NONE, NONE, &[], reason),
            Failure::Timeout {
                collective,
                op,
                missing,
            } => (1, NONE, *collective, op_code(*op), missing, ""),
            _ => return None,
        };
        let mut w = vec![MAGIC, uid, kind, by, coll, op, list.len() as u64];
        w.extend(list.iter().map(|&m| m as u64));
        let room = limit_words.saturating_sub(w.len() + 1) * 8;
        let text = &text.as_bytes()[..text.len().min(room)];
        w.push(text.len() as u64);
        w.extend(text.chunks(8).map(|c| {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(b)
        }));
        Some(w)
    }

    /// Decodes a notice of communicator `uid` (`None` if it is not one, or of another comm).
    pub(crate) fn decode_notice(w: &[u64], uid: u64) -> Option<Failure> {
        if w.len() < 8 || w[0] != MAGIC || w[1] != uid {
            return None;
        }
        let n = usize::try_from(w[6]).ok()?;
        let list: Vec<usize> = w.get(7..7 + n)?.iter().map(|&m| m as usize).collect();
        let tlen = usize::try_from(*w.get(7 + n)?).ok()?;
        let bytes: Vec<u8> = w
            .get(8 + n..)?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .take(tlen)
            .collect();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        match w[2] {
            0 => Some(Failure::Aborted {
                by: w[3] as usize,
                reason: text,
            }),
            1 => Some(Failure::Timeout {
                collective: w[4],
                op: op_of(w[5])?,
                missing: list,
            }),
            _ => None,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Aborted { by, reason } => write!(f, "aborted by rank {by}: {reason}"),
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
            Failure::Mpi { what } => write!(f, "MPI failed: {what}"),
            Failure::Finalized => f.write_str("MPI was finalized (the process is exiting)"),
        }
    }
}

/// A 64-bit mix (splitmix64's finalizer) for communicator ids.
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a string (FNV-1a), for names in descriptors and ids.
pub(crate) fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CommError;
    use crate::types::OpCtx;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn descriptors_round_trip_and_render_like_the_local_backend() {
        let mut d = Desc::tensor(7, 3, OpName::AllReduce, DType::BF16, &[4, 5]);
        d.reduce = Some(ReduceOp::Max);
        d.extra = vec![1, 2, 3];
        let back = Desc::decode(&d.encode()).expect("decodes");
        assert_eq!(back, d);
        assert_eq!(d.to_string(), "all_reduce(max, bf16, [4, 5])");
        let mut b = Desc::tensor(1, 0, OpName::Broadcast, DType::F32, &[4]);
        b.root = Some(1);
        assert_eq!(b.to_string(), "broadcast(f32, [4], root 1)");
        assert!(Desc::decode(&[0; HEADER_WORDS]).is_none());
        let mut bad = d.encode();
        bad[10] = 99; // claims more extra words than it has
        assert!(Desc::decode(&bad).is_none());
    }

    #[test]
    fn compatibility_follows_the_local_rules() {
        let a = Desc::tensor(1, 2, OpName::AllReduce, DType::F32, &[4]);
        assert!(a.compatible(&a.clone()));
        let b = Desc::tensor(1, 2, OpName::AllReduce, DType::F32, &[5]);
        assert!(!a.compatible(&b));
        let c = Desc::tensor(1, 2, OpName::AllReduce, DType::F64, &[4]);
        assert!(!a.compatible(&c));
        let d = Desc::tensor(1, 3, OpName::AllReduce, DType::F32, &[4]);
        assert!(!a.compatible(&d), "another collective index");
        let mut g1 = Desc::tensor(1, 0, OpName::Gather, DType::F32, &[4]);
        let mut g2 = Desc::tensor(1, 0, OpName::Gather, DType::F32, &[9, 2]);
        g1.rule = ShapeRule::Any;
        g2.rule = ShapeRule::Any;
        assert!(g1.compatible(&g2), "gather shapes may differ");
        let mut r1 = Desc::tensor(1, 0, OpName::AllToAllVSingle, DType::U8, &[3, 7]);
        let mut r2 = Desc::tensor(1, 0, OpName::AllToAllVSingle, DType::U8, &[1, 7]);
        r1.rule = ShapeRule::Rows;
        r2.rule = ShapeRule::Rows;
        assert!(r1.compatible(&r2));
        r2.dims = vec![1, 8];
        assert!(!r1.compatible(&r2));
        let mut s1 = Desc::new(1, 0, OpName::Scatter);
        s1.root = Some(0);
        let mut s2 = s1.clone();
        s2.dtype = Some(DType::F32);
        assert!(s1.compatible(&s2), "only the root knows a scatter's dtype");
    }

    #[test]
    fn notices_round_trip_and_errors_read_like_the_local_backend() {
        let f = Failure::Timeout {
            collective: 4,
            op: OpName::AllReduce,
            missing: vec![2, 3],
        };
        let w = f.encode_notice(9, 512).expect("timeouts are told");
        assert_eq!(Failure::decode_notice(&w, 9), Some(f.clone()));
        assert_eq!(Failure::decode_notice(&w, 8), None, "another communicator");
        let a = Failure::Aborted {
            by: 0,
            reason: "operator pulled the plug".into(),
        };
        let w = a.encode_notice(9, 512).expect("aborts are told");
        assert_eq!(Failure::decode_notice(&w, 9), Some(a.clone()));
        let long = Failure::Aborted {
            by: 1,
            reason: "x".repeat(10_000),
        };
        let w = long.encode_notice(9, 64).expect("told, truncated");
        assert!(w.len() <= 64);
        let ctx = OpCtx {
            op: OpName::AllReduce,
            comm: Arc::from("tp"),
            rank: 1,
            seq: 5,
            timeout: Duration::from_secs(1),
        };
        assert!(matches!(
            f.to_error(&ctx, Some(4)),
            CommError::Timeout { .. }
        ));
        let later = f.to_error(&ctx, Some(5));
        assert!(matches!(later, CommError::Aborted { .. }));
        assert!(
            later
                .to_string()
                .contains("timed out waiting for ranks [2, 3]"),
            "{later}"
        );
        assert!(a
            .to_error(&ctx, None)
            .to_string()
            .contains("aborted by rank 0: operator pulled the plug"));
    }
}
