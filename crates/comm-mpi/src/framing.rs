//! The mpi backend's wire encoding of what a rank issued at a collective (exchanged before any
//! data moves: desync detection, and the sizes `gather` / `all_to_all_v` / `split` need) and of
//! the failures peers are told about, as `u64` words. The rules themselves (compatibility,
//! failures and their messages) and the words of a descriptor and a failure are the shared ones
//! of [`candle_dtensor_comm_core::kit::desc`]; this module adds the mpi framing (magic, communicator id, collective).

use candle_dtensor_comm_core::kit::desc::{Failure, OpDesc, DESC_HEADER_WORDS};

/// Dims carried in a descriptor; tensors of higher rank are rejected at issue time.
pub(crate) const MAX_DIMS: usize = 16;
/// Words of the framing before the op descriptor: magic, uid, collective, extra count.
const FRAME_WORDS: usize = 4;
/// Words of the largest encoded descriptor without its extra words.
pub(crate) const HEADER_WORDS: usize = FRAME_WORDS + DESC_HEADER_WORDS + MAX_DIMS;
const MAGIC: u64 = 0x4344_544d_5049_0002; // "CDTMPI" v2: the op descriptor in desc.rs's words

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

    /// The encoded words: magic, uid, collective, extra count, the op descriptor in the
    /// shared wire form ([`OpDesc::encode_words`]), then `extra`.
    pub(crate) fn encode(&self) -> Vec<u64> {
        let mut w = vec![MAGIC, self.uid, self.coll, self.extra.len() as u64];
        self.what.encode_words(&mut w);
        w.extend_from_slice(&self.extra);
        w
    }

    /// Decodes `w` (a received message); `None` if it is not a descriptor.
    pub(crate) fn decode(w: &[u64]) -> Option<Desc> {
        if w.len() < FRAME_WORDS || w[0] != MAGIC {
            return None;
        }
        let extra = usize::try_from(w[3]).ok()?;
        let (what, used) = OpDesc::decode_words(&w[FRAME_WORDS..], MAX_DIMS).ok()?;
        let at = FRAME_WORDS + used;
        Some(Desc {
            uid: w[1],
            coll: w[2],
            what,
            extra: w.get(at..at.checked_add(extra)?)?.to_vec(),
        })
    }

    /// Whether `other` (another rank's descriptor of the same collective) fits with this one.
    pub(crate) fn compatible(&self, other: &Desc) -> bool {
        self.coll == other.coll && self.what.compatible(&other.what)
    }
}

/// Encodes the failures peers are told about (abort and timeout: every rank detects a desync
/// or a mismatch by itself) as a notice of communicator `uid`: magic, uid, then the failure in
/// the shared wire form ([`Failure::encode_words`]), at most `limit_words` words.
pub(crate) fn encode_notice(f: &Failure, uid: u64, limit_words: usize) -> Option<Vec<u64>> {
    if !matches!(f, Failure::Aborted { .. } | Failure::Timeout { .. }) {
        return None;
    }
    let mut w = vec![MAGIC, uid];
    w.extend(f.encode_words(limit_words.saturating_sub(w.len())));
    Some(w)
}

/// Decodes a notice of communicator `uid` (`None` if it is not one, or of another comm).
pub(crate) fn decode_notice(w: &[u64], uid: u64) -> Option<Failure> {
    if w.len() < 2 || w[0] != MAGIC || w[1] != uid {
        return None;
    }
    Failure::decode_words(&w[2..]).ok()
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
    use candle_core::DType;
    use candle_dtensor_comm_core::kit::desc::ShapeRule;
    use candle_dtensor_comm_core::{OpName, ReduceOp};

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
        bad[3] = 99; // claims more extra words than it has
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
