//! The cross-rank rules every backend applies, written once: the descriptor of what a rank
//! issued at a collective index and the rule that says whether two ranks are in step
//! ([`OpDesc::compatible`]: desync detection), why a communicator is unusable ([`Failure`],
//! with one `Display` and one mapping to [`CommError`]), and the checks of `split` lists and
//! `all_to_all_v` split sizes that every rank runs on the same data, so all reach the same
//! verdict.
//!
//! It is also the one wire form of descriptors and failures: little-endian `u64` words
//! ([`OpDesc::encode_words`], [`Failure::encode_words`] and their decoders, which check every
//! code and bound every count by the words present). Every backend with a wire uses it: the
//! process backend's HELLO and FAIL frames (as bytes), the mpi backend's descriptor exchange,
//! point-to-point headers and notices (inside its own framing of magic, communicator id and
//! collective index), and the nccl backend's shape exchange for `gather` and `scatter`
//! (padded to a fixed size). `local` shares memory and needs none.

use std::fmt;

use candle_core::{DType, Tensor};

use crate::error::CommError;
use crate::vocab::{OpCtx, OpName, ReduceOp, SUPPORTED_DTYPES};

/// How shapes must agree across ranks for an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShapeRule {
    /// Identical shapes.
    Exact,
    /// Identical dims after dim 0 (all_to_all_v).
    Rows,
    /// Anything (gather: the dims still travel, an mpi root needs them).
    Any,
}

/// What a rank issued at a collective index; compared across ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpDesc {
    /// The operation.
    pub op: OpName,
    /// The input's dtype (`None`: the op has no tensor, a barrier).
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

/// `Option<DType>` as its name (`"f32"`) in JSON (hook records).
pub mod dtype_name {
    use candle_core::DType;
    use serde::{Serialize, Serializer};

    /// Writes the dtype's name, or `null`.
    pub fn serialize<S: Serializer>(d: &Option<DType>, s: S) -> Result<S::Ok, S::Error> {
        d.map(|d| d.as_str()).serialize(s)
    }
}

/// Why a communicator is unusable. The first failure wins, and every rank that hears of it
/// (through shared memory, FAIL frames or MPI notices) reports the same cause.
#[derive(Debug, Clone, PartialEq, Eq)]
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

// ---------------------------------------------------------------------------------------------
// The wire form: one encoding of descriptors and failures for every backend with a wire.
// ---------------------------------------------------------------------------------------------

/// The code of "absent" (`None`) in a word.
pub const NONE_WORD: u64 = u64::MAX;
/// The most dims a descriptor may declare on a wire (a bound on what a peer can make this end
/// allocate, far above any tensor candle builds).
pub const MAX_WIRE_DIMS: usize = 64;
/// Words of a descriptor before its dims.
pub const DESC_HEADER_WORDS: usize = 7;

/// Why words received from a peer are not a descriptor or a failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer words than the declared contents need.
    #[error("{what}: {got} words, {need} needed")]
    Short {
        /// What was being decoded.
        what: &'static str,
        /// Words needed.
        need: usize,
        /// Words present.
        got: usize,
    },
    /// A code outside its table (op, dtype, reduce op, shape rule, failure kind).
    #[error("{what}: unknown code {code}")]
    BadCode {
        /// Which table.
        what: &'static str,
        /// The code received.
        code: u64,
    },
    /// A count over its bound.
    #[error("{what}: {n} declared, at most {max} allowed")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// The count received.
        n: u64,
        /// The bound.
        max: usize,
    },
    /// A byte payload whose length is not a whole number of words.
    #[error("payload of {0} bytes is not a whole number of 8-byte words")]
    Ragged(usize),
}

/// The code of `op` on a wire (stable: append new ops at the end).
pub fn op_code(op: OpName) -> u64 {
    match op {
        OpName::AllReduce => 0,
        OpName::AllGatherSingle => 1,
        OpName::ReduceScatterSingle => 2,
        OpName::AllToAllSingle => 3,
        OpName::AllToAllVSingle => 4,
        OpName::Broadcast => 5,
        OpName::Reduce => 6,
        OpName::Gather => 7,
        OpName::Scatter => 8,
        OpName::Barrier => 9,
        OpName::Send => 10,
        OpName::Recv => 11,
        OpName::BatchP2p => 12,
        OpName::Split => 13,
        OpName::NewComm => 14,
        OpName::NewWindow => 15,
        OpName::WindowPut => 16,
        OpName::WindowGet => 17,
        OpName::WindowSignal => 18,
        OpName::WindowWaitSignal => 19,
        OpName::WindowFence => 20,
        OpName::Abort => 21,
        OpName::Shrink => 22,
        OpName::Agree => 23,
    }
}

/// The op of wire code `c`.
pub fn op_of(c: u64) -> Result<OpName, WireError> {
    Ok(match c {
        0 => OpName::AllReduce,
        1 => OpName::AllGatherSingle,
        2 => OpName::ReduceScatterSingle,
        3 => OpName::AllToAllSingle,
        4 => OpName::AllToAllVSingle,
        5 => OpName::Broadcast,
        6 => OpName::Reduce,
        7 => OpName::Gather,
        8 => OpName::Scatter,
        9 => OpName::Barrier,
        10 => OpName::Send,
        11 => OpName::Recv,
        12 => OpName::BatchP2p,
        13 => OpName::Split,
        14 => OpName::NewComm,
        15 => OpName::NewWindow,
        16 => OpName::WindowPut,
        17 => OpName::WindowGet,
        18 => OpName::WindowSignal,
        19 => OpName::WindowWaitSignal,
        20 => OpName::WindowFence,
        21 => OpName::Abort,
        22 => OpName::Shrink,
        23 => OpName::Agree,
        code => return Err(WireError::BadCode { what: "op", code }),
    })
}

/// The code of `d` on a wire (its index in [`SUPPORTED_DTYPES`]; [`NONE_WORD`] for another).
pub fn dtype_code(d: DType) -> u64 {
    SUPPORTED_DTYPES
        .iter()
        .position(|x| *x == d)
        .map_or(NONE_WORD, |i| i as u64)
}

/// The dtype of wire code `c`.
pub fn dtype_of(c: u64) -> Result<DType, WireError> {
    usize::try_from(c)
        .ok()
        .and_then(|i| SUPPORTED_DTYPES.get(i).copied())
        .ok_or(WireError::BadCode {
            what: "dtype",
            code: c,
        })
}

fn reduce_code(r: ReduceOp) -> u64 {
    ReduceOp::ALL
        .iter()
        .position(|x| *x == r)
        .map_or(NONE_WORD, |i| i as u64)
}

fn reduce_of(c: u64) -> Result<ReduceOp, WireError> {
    usize::try_from(c)
        .ok()
        .and_then(|i| ReduceOp::ALL.get(i).copied())
        .ok_or(WireError::BadCode {
            what: "reduce op",
            code: c,
        })
}

fn opt_word(v: Option<usize>) -> u64 {
    v.map_or(NONE_WORD, |v| v as u64)
}

fn word_opt(w: u64) -> Option<usize> {
    (w != NONE_WORD).then_some(w as usize)
}

fn need(what: &'static str, w: &[u64], n: usize) -> Result<(), WireError> {
    if w.len() < n {
        return Err(WireError::Short {
            what,
            need: n,
            got: w.len(),
        });
    }
    Ok(())
}

impl OpDesc {
    /// Appends the wire form: `[op, dtype, rule, root, reduce, bytes, ndim, dims..]`
    /// ([`NONE_WORD`] for what is absent), `DESC_HEADER_WORDS + ndim` words.
    pub fn encode_words(&self, out: &mut Vec<u64>) {
        self.encode_header(out, self.dims.len());
        out.extend(self.dims.iter().map(|&d| d as u64));
    }

    /// The wire form with exactly `slots` dim words (zero-padded), for exchanges whose entries
    /// must all have one size (NCCL's all-gather). `ndim` stays the true count, so a descriptor
    /// with more dims than `slots` decodes to [`WireError::TooMany`] on every rank alike.
    pub fn encode_words_padded(&self, slots: usize) -> Vec<u64> {
        let mut out = Vec::with_capacity(DESC_HEADER_WORDS + slots);
        self.encode_header(&mut out, self.dims.len());
        out.extend(self.dims.iter().take(slots).map(|&d| d as u64));
        out.resize(DESC_HEADER_WORDS + slots, 0);
        out
    }

    fn encode_header(&self, out: &mut Vec<u64>, ndim: usize) {
        out.extend([
            op_code(self.op),
            self.dtype.map_or(NONE_WORD, dtype_code),
            match self.rule {
                ShapeRule::Exact => 0,
                ShapeRule::Rows => 1,
                ShapeRule::Any => 2,
            },
            opt_word(self.root),
            self.reduce.map_or(NONE_WORD, reduce_code),
            opt_word(self.bytes),
            ndim as u64,
        ]);
    }

    /// Decodes a descriptor at the start of `w`; returns it and the words it used. Every code
    /// is checked, and `ndim` is bounded by `max_dims` (at most [`MAX_WIRE_DIMS`]) and by the
    /// words present, so a peer's words never make this end allocate more than they hold.
    pub fn decode_words(w: &[u64], max_dims: usize) -> Result<(OpDesc, usize), WireError> {
        need("op descriptor", w, DESC_HEADER_WORDS)?;
        let max = max_dims.min(MAX_WIRE_DIMS);
        let ndim = usize::try_from(w[6])
            .ok()
            .filter(|&n| n <= max)
            .ok_or(WireError::TooMany {
                what: "op descriptor dims",
                n: w[6],
                max,
            })?;
        need("op descriptor", w, DESC_HEADER_WORDS + ndim)?;
        let desc = OpDesc {
            op: op_of(w[0])?,
            dtype: if w[1] == NONE_WORD {
                None
            } else {
                Some(dtype_of(w[1])?)
            },
            rule: match w[2] {
                0 => ShapeRule::Exact,
                1 => ShapeRule::Rows,
                2 => ShapeRule::Any,
                code => {
                    return Err(WireError::BadCode {
                        what: "shape rule",
                        code,
                    })
                }
            },
            root: word_opt(w[3]),
            reduce: if w[4] == NONE_WORD {
                None
            } else {
                Some(reduce_of(w[4])?)
            },
            bytes: word_opt(w[5]),
            dims: w[DESC_HEADER_WORDS..DESC_HEADER_WORDS + ndim]
                .iter()
                .map(|&d| d as usize)
                .collect(),
        };
        Ok((desc, DESC_HEADER_WORDS + ndim))
    }
}

/// A failure's parts on the wire: kind, numbers, one rank list, texts.
struct FailureParts<'a> {
    kind: u64,
    ints: Vec<u64>,
    list: &'a [usize],
    texts: Vec<&'a str>,
}

impl Failure {
    fn parts(&self) -> FailureParts<'_> {
        let p = |kind, ints: Vec<u64>, list: &'static [usize], texts| FailureParts {
            kind,
            ints,
            list,
            texts,
        };
        match self {
            Failure::Aborted { by, reason, after } => p(
                0,
                vec![*by as u64, after.unwrap_or(NONE_WORD)],
                &[],
                vec![reason.as_str()],
            ),
            Failure::Timeout {
                collective,
                op,
                missing,
            } => FailureParts {
                kind: 1,
                ints: vec![*collective, op_code(*op)],
                list: missing,
                texts: Vec::new(),
            },
            Failure::Desync {
                collective,
                rank_a,
                op_a,
                rank_b,
                op_b,
            } => p(
                2,
                vec![*collective, *rank_a as u64, *rank_b as u64],
                &[],
                vec![op_a.as_str(), op_b.as_str()],
            ),
            Failure::Mismatch { collective, reason } => {
                p(3, vec![*collective], &[], vec![reason.as_str()])
            }
            Failure::RankFailed { world_rank, reason } => {
                p(4, vec![*world_rank as u64], &[], vec![reason.as_str()])
            }
            Failure::PeerLost { rank, reason } => {
                p(5, vec![*rank as u64], &[], vec![reason.as_str()])
            }
            Failure::Mpi { what } => p(6, Vec::new(), &[], vec![what.as_str()]),
            Failure::Finalized => p(7, Vec::new(), &[], Vec::new()),
        }
    }

    /// The wire form: `[kind, n_ints, ints.., n_list, list.., n_texts, (len, bytes..)..]`
    /// (texts UTF-8, 8 bytes a word, little-endian), at most `limit_words` words: texts are
    /// cut (never the numbers or the rank list) when the whole would not fit.
    pub fn encode_words(&self, limit_words: usize) -> Vec<u64> {
        let FailureParts {
            kind,
            ints,
            list,
            texts,
        } = self.parts();
        let mut w = vec![kind, ints.len() as u64];
        w.extend(ints);
        w.push(list.len() as u64);
        w.extend(list.iter().map(|&r| r as u64));
        w.push(texts.len() as u64);
        // What is left for text bytes after one length word per text, shared out in order.
        let mut room = limit_words
            .saturating_sub(w.len() + texts.len())
            .saturating_mul(8);
        for t in texts {
            let mut n = t.len().min(room);
            while !t.is_char_boundary(n) {
                n -= 1;
            }
            room -= n.div_ceil(8) * 8;
            w.push(n as u64);
            w.extend(t.as_bytes()[..n].chunks(8).map(|c| {
                let mut b = [0u8; 8];
                b[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(b)
            }));
        }
        w
    }

    /// Decodes a failure from all of `w` (see [`Failure::encode_words`]); every count is
    /// checked against the words present before anything is allocated.
    pub fn decode_words(w: &[u64]) -> Result<Failure, WireError> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u64], WireError> {
            need("failure", &w[at.min(w.len())..], n)?;
            at += n;
            Ok(&w[at - n..at])
        };
        let count = |c: u64, what: &'static str, left: usize| {
            usize::try_from(c)
                .ok()
                .filter(|&n| n <= left)
                .ok_or(WireError::TooMany {
                    what,
                    n: c,
                    max: left,
                })
        };
        let kind = take(1)?[0];
        let n_ints = count(take(1)?[0], "failure numbers", w.len())?;
        let ints = take(n_ints)?.to_vec();
        let n_list = count(take(1)?[0], "failure ranks", w.len())?;
        let list: Vec<usize> = take(n_list)?.iter().map(|&r| r as usize).collect();
        let n_texts = count(take(1)?[0], "failure texts", w.len())?;
        let mut texts = Vec::with_capacity(n_texts);
        for _ in 0..n_texts {
            let len = count(take(1)?[0], "failure text bytes", w.len().saturating_mul(8))?;
            let bytes: Vec<u8> = take(len.div_ceil(8))?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .take(len)
                .collect();
            texts.push(String::from_utf8_lossy(&bytes).into_owned());
        }
        let int = |i: usize| {
            ints.get(i).copied().ok_or(WireError::Short {
                what: "failure numbers",
                need: i + 1,
                got: ints.len(),
            })
        };
        let mut text = |i: usize| {
            texts
                .get_mut(i)
                .map(std::mem::take)
                .ok_or(WireError::Short {
                    what: "failure texts",
                    need: i + 1,
                    got: n_texts,
                })
        };
        Ok(match kind {
            0 => Failure::Aborted {
                by: int(0)? as usize,
                after: (int(1)? != NONE_WORD).then_some(int(1)?),
                reason: text(0)?,
            },
            1 => Failure::Timeout {
                collective: int(0)?,
                op: op_of(int(1)?)?,
                missing: list,
            },
            2 => Failure::Desync {
                collective: int(0)?,
                rank_a: int(1)? as usize,
                rank_b: int(2)? as usize,
                op_a: text(0)?,
                op_b: text(1)?,
            },
            3 => Failure::Mismatch {
                collective: int(0)?,
                reason: text(0)?,
            },
            4 => Failure::RankFailed {
                world_rank: int(0)? as usize,
                reason: text(0)?,
            },
            5 => Failure::PeerLost {
                rank: int(0)? as usize,
                reason: text(0)?,
            },
            6 => Failure::Mpi { what: text(0)? },
            7 => Failure::Finalized,
            code => {
                return Err(WireError::BadCode {
                    what: "failure kind",
                    code,
                })
            }
        })
    }
}

/// Words as little-endian bytes (a byte-stream wire's payload).
pub fn words_to_bytes(w: &[u64]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes as words; a length that is not a multiple of 8 is refused.
pub fn bytes_to_words(b: &[u8]) -> Result<Vec<u64>, WireError> {
    if b.len() % 8 != 0 {
        return Err(WireError::Ragged(b.len()));
    }
    Ok(b.chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a)
        })
        .collect())
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

    fn every_failure() -> Vec<Failure> {
        vec![
            Failure::Aborted {
                by: 3,
                reason: "operator pulled the plug".into(),
                after: Some(7),
            },
            Failure::aborted(0, ""),
            Failure::Timeout {
                collective: u64::MAX,
                op: OpName::Recv,
                missing: vec![1, 4],
            },
            Failure::desync(9, (0, &"all_reduce(f32, [4])"), (2, &"barrier()")),
            Failure::Mismatch {
                collective: 2,
                reason: "sizes differ: é".into(),
            },
            Failure::RankFailed {
                world_rank: 5,
                reason: "panicked".into(),
            },
            Failure::PeerLost {
                rank: 1,
                reason: "connection reset".into(),
            },
            Failure::Mpi {
                what: "MPI_ERR_TRUNCATE".into(),
            },
            Failure::Finalized,
        ]
    }

    /// The one wire form: every field of every descriptor and failure survives, codes are
    /// stable, and the bounds hold (dims, texts cut to the limit at a char boundary).
    #[test]
    fn descriptors_and_failures_round_trip_as_words() {
        for code in 0..24 {
            assert_eq!(op_code(op_of(code).expect("a code in the table")), code);
        }
        assert!(op_of(24).is_err());
        for d in SUPPORTED_DTYPES {
            assert_eq!(dtype_of(dtype_code(d)), Ok(d));
        }
        let descs = [
            OpDesc {
                reduce: Some(ReduceOp::Avg),
                ..OpDesc::of(OpName::ReduceScatterSingle, DType::F16, &[8, 2])
            },
            OpDesc {
                root: Some(3),
                ..OpDesc::new(OpName::Scatter)
            },
            rows(&[0, 7, 1]),
            OpDesc {
                bytes: Some(1 << 40),
                ..OpDesc::new(OpName::NewWindow)
            },
            OpDesc::of(OpName::AllGatherSingle, DType::U8, &[]),
        ];
        for d in &descs {
            let mut w = vec![42]; // appended after what is there
            d.encode_words(&mut w);
            assert_eq!(w.len(), 1 + DESC_HEADER_WORDS + d.dims.len());
            let (back, used) = OpDesc::decode_words(&w[1..], MAX_WIRE_DIMS).expect("decodes");
            assert_eq!((&back, used), (d, w.len() - 1));
            let padded = d.encode_words_padded(8);
            assert_eq!(padded.len(), DESC_HEADER_WORDS + 8);
            assert_eq!(&OpDesc::decode_words(&padded, 8).expect("decodes").0, d);
        }
        let big = OpDesc::of(OpName::Gather, DType::F32, &[1; 9]);
        assert_eq!(
            OpDesc::decode_words(&big.encode_words_padded(8), 8),
            Err(WireError::TooMany {
                what: "op descriptor dims",
                n: 9,
                max: 8
            }),
            "the true dim count travels, so every rank refuses it alike"
        );
        let mut w = Vec::new();
        descs[0].encode_words(&mut w);
        assert!(matches!(
            OpDesc::decode_words(&w[..w.len() - 1], 16),
            Err(WireError::Short { .. })
        ));
        for (i, bad) in [(0, 99), (1, 99), (2, 3), (4, 17)] {
            let mut b = w.clone();
            b[i] = bad;
            assert!(
                matches!(OpDesc::decode_words(&b, 16), Err(WireError::BadCode { .. })),
                "word {i} = {bad}"
            );
        }
        let mut b = w.clone();
        b[6] = u64::MAX; // a declared dim count never allocates
        assert!(matches!(
            OpDesc::decode_words(&b, 16),
            Err(WireError::TooMany { .. })
        ));

        for f in every_failure() {
            let w = f.encode_words(1 << 10);
            assert_eq!(Failure::decode_words(&w), Ok(f.clone()));
            let b = words_to_bytes(&w);
            assert_eq!(bytes_to_words(&b), Ok(w.clone()));
            assert!(bytes_to_words(&b[1..]).is_err() || b.len() == 1);
            for cut in 0..w.len() {
                assert!(
                    Failure::decode_words(&w[..cut]).is_err(),
                    "{f:?} cut at {cut}"
                );
            }
        }
        let long = Failure::Mismatch {
            collective: 1,
            reason: "é".repeat(10_000),
        };
        let w = long.encode_words(64);
        assert!(w.len() <= 64);
        match Failure::decode_words(&w) {
            Ok(Failure::Mismatch { collective, reason }) => {
                assert_eq!(collective, 1);
                assert!(!reason.is_empty() && reason.chars().all(|c| c == 'é'));
            }
            other => panic!("{other:?}"),
        }
        let mut huge = Failure::Finalized.encode_words(8);
        huge[1] = u64::MAX; // declares more numbers than there are words
        assert!(matches!(
            Failure::decode_words(&huge),
            Err(WireError::TooMany { .. })
        ));
        assert!(matches!(
            Failure::decode_words(&[8, 0, 0, 0]),
            Err(WireError::BadCode { .. })
        ));
    }

    /// Random words never panic the decoders and never decode to more than they hold.
    #[test]
    fn random_words_never_panic_the_decoders() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000 {
            let n = (next() % 40) as usize;
            let w: Vec<u64> = (0..n)
                .map(|_| match next() % 4 {
                    0 => next() % 8,
                    1 => u64::MAX,
                    _ => next() % 64,
                })
                .collect();
            if let Ok((d, used)) = OpDesc::decode_words(&w, MAX_WIRE_DIMS) {
                assert!(used <= w.len() && d.dims.len() <= MAX_WIRE_DIMS, "case {i}");
            }
            if let Ok(Failure::Timeout { missing, .. }) = Failure::decode_words(&w) {
                assert!(missing.len() <= w.len(), "case {i}");
            }
        }
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
