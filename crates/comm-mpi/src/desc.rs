//! The mpi backend's wire encoding of what a rank issued at a collective (exchanged before any
//! data moves: desync detection, and the sizes `gather` / `all_to_all_v` / `split` need) and of
//! the failures peers are told about, as `u64` words. The rules themselves (compatibility,
//! failures and their messages) are the CPU backends' shared ones, in [`candle_dtensor_comm_core::kit::desc`].

use candle_core::DType;

use candle_dtensor_comm_core::kit::desc::{Failure, OpDesc, ShapeRule};
use candle_dtensor_comm_core::{OpName, ReduceOp, SUPPORTED_DTYPES};

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

/// One rank's descriptor of a collective, as the mpi backend exchanges it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Desc {
    /// The communicator's id, agreed by its members (messages of another communicator that
    /// happen to match are recognized and dropped).
    pub uid: u64,
    /// The collective index on the communicator (0-based).
    pub coll: u64,
    /// What the rank issued (compared across ranks).
    pub what: OpDesc,
    /// Op-specific words: split lists, all_to_all_v split sizes, new_comm name hashes.
    pub extra: Vec<u64>,
}

impl Desc {
    /// The descriptor of `what` at collective `coll` of communicator `uid`.
    pub(crate) fn new(uid: u64, coll: u64, what: OpDesc) -> Self {
        Desc {
            uid,
            coll,
            what,
            extra: Vec::new(),
        }
    }

    /// The encoded words (fixed header, then `extra`).
    pub(crate) fn encode(&self) -> Vec<u64> {
        let d = &self.what;
        let mut w = vec![0u64; HEADER_WORDS];
        w[0] = MAGIC;
        w[1] = self.uid;
        w[2] = self.coll;
        w[3] = op_code(d.op);
        w[4] = d.dtype.map_or(NONE, dtype_code);
        w[5] = match d.rule {
            ShapeRule::Exact => 0,
            ShapeRule::Rows => 1,
            ShapeRule::Any => 2,
        };
        w[6] = d.dims.len() as u64;
        w[7] = d.root.map_or(NONE, |r| r as u64);
        w[8] = d.reduce.map_or(NONE, |r| code_of(&ReduceOp::ALL, &r));
        w[9] = d.bytes.map_or(NONE, |b| b as u64);
        w[10] = self.extra.len() as u64;
        for (i, &x) in d.dims.iter().take(MAX_DIMS).enumerate() {
            w[12 + i] = x as u64;
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
        let what = OpDesc {
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
                Some(from_code(&ReduceOp::ALL, w[8])?)
            },
            bytes: opt(w[9]),
        };
        Some(Desc {
            uid: w[1],
            coll: w[2],
            what,
            extra: w[HEADER_WORDS..HEADER_WORDS + extra].to_vec(),
        })
    }

    /// Whether `other` (another rank's descriptor of the same collective) fits with this one.
    pub(crate) fn compatible(&self, other: &Desc) -> bool {
        self.coll == other.coll && self.what.compatible(&other.what)
    }
}

/// Encodes the failures peers are told about (abort and timeout: every rank detects a desync
/// or a mismatch by itself) as a notice of communicator `uid`.
pub(crate) fn encode_notice(f: &Failure, uid: u64, limit_words: usize) -> Option<Vec<u64>> {
    let (kind, by, coll, op, list, text): (u64, u64, u64, u64, &[usize], &str) = match f {
        Failure::Aborted { by, reason, .. } => (0, *by as u64, NONE, NONE, &[], reason),
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
        0 => Some(Failure::aborted(w[3] as usize, text)),
        1 => Some(Failure::Timeout {
            collective: w[4],
            op: op_of(w[5])?,
            missing: list,
        }),
        _ => None,
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

    #[test]
    fn descriptors_round_trip() {
        let what = OpDesc {
            reduce: Some(ReduceOp::Max),
            ..OpDesc::of(OpName::AllReduce, DType::BF16, &[4, 5])
        };
        let mut d = Desc::new(7, 3, what);
        d.extra = vec![1, 2, 3];
        let back = Desc::decode(&d.encode()).expect("decodes");
        assert_eq!(back, d);
        let mut g = Desc::new(1, 0, OpDesc::of(OpName::Gather, DType::U8, &[9, 2]));
        g.what.rule = ShapeRule::Any;
        g.what.root = Some(1);
        assert_eq!(Desc::decode(&g.encode()), Some(g));
        assert!(Desc::decode(&[0; HEADER_WORDS]).is_none());
        let mut bad = d.encode();
        bad[10] = 99; // claims more extra words than it has
        assert!(Desc::decode(&bad).is_none());
    }

    #[test]
    fn another_collective_index_is_never_compatible() {
        let a = Desc::new(1, 2, OpDesc::of(OpName::AllReduce, DType::F32, &[4]));
        assert!(a.compatible(&a.clone()));
        let b = Desc::new(1, 3, a.what.clone());
        assert!(!a.compatible(&b));
    }

    #[test]
    fn notices_round_trip() {
        let f = Failure::Timeout {
            collective: 4,
            op: OpName::AllReduce,
            missing: vec![2, 3],
        };
        let w = encode_notice(&f, 9, 512).expect("timeouts are told");
        assert_eq!(decode_notice(&w, 9), Some(f));
        assert_eq!(decode_notice(&w, 8), None, "another communicator");
        let a = Failure::aborted(0, "operator pulled the plug");
        let w = encode_notice(&a, 9, 512).expect("aborts are told");
        assert_eq!(decode_notice(&w, 9), Some(a));
        let long = Failure::aborted(1, "x".repeat(10_000));
        let w = encode_notice(&long, 9, 64).expect("told, truncated");
        assert!(w.len() <= 64);
        let m = Failure::Mismatch {
            collective: 1,
            reason: String::new(),
        };
        assert_eq!(
            encode_notice(&m, 9, 64),
            None,
            "every rank sees a mismatch itself"
        );
    }
}
