//! Placements: how a tensor is laid out along ONE mesh dim.
//!
//! Short display syntax used everywhere (errors, logs, CLI): `S(0)`, `SS(0,2)`, `R`, `P(sum)`,
//! `P(avg)`, `P(max)`, `P(min)`, `P(product)`, `MP(0,512)`; lists are comma-separated: `S(0),R`.
//! `Debug` prints the full form (`Shard(0)`, `StridedShard { dim: 0, split_factor: 2 }`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use crate::error::{Result, StrategyError};

/// The reduction a `Partial` placement is waiting for: the comm layer's reduce op itself (one
/// type, defined in `candle-dtensor-types`).
pub use candle_dtensor_types::ReduceOp;

/// How a tensor is laid out along one mesh dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Each rank holds one `torch.chunk` piece along this tensor dim (uneven and empty pieces allowed).
    Shard(usize),
    /// FSDP-after-TP layout (PyTorch `_StridedShard`): the tensor dim is chunked into
    /// `split_factor` pieces, each piece is chunked over this mesh dim, and rank `c` holds the
    /// concatenation of the `c`-th sub-chunk of every piece. `split_factor` is normally the number
    /// of shards later mesh dims cut this tensor dim into.
    StridedShard {
        /// The tensor dim.
        dim: usize,
        /// Number of first-level pieces.
        split_factor: usize,
    },
    /// Every rank holds the full tensor.
    Replicate,
    /// Every rank holds a summand; the value is the reduction over the mesh dim.
    Partial(ReduceOp),
    /// Vocab-parallel partial: a partial SUM where each rank only filled the rows whose index
    /// along the masked source dim `dim` (of global size `size`) it owns; zeros elsewhere.
    /// Reduces like `P(sum)`; it may be relabelled `P(sum)` for free.
    MaskPartial {
        /// The source tensor dim whose indices are owned per rank (e.g. the vocab dim 0 of an
        /// embedding table).
        dim: usize,
        /// Global size of that source dim.
        size: usize,
    },
}

/// Placements of one tensor, one per mesh dim.
pub type Placements = SmallVec<[Placement; 4]>;

impl Placement {
    /// `Shard(d)` or `StridedShard { dim: d, .. }`.
    pub fn shard_dim(&self) -> Option<usize> {
        match *self {
            Placement::Shard(d) | Placement::StridedShard { dim: d, .. } => Some(d),
            _ => None,
        }
    }

    /// True for `Shard` and `StridedShard`.
    pub fn is_shard(&self) -> bool {
        self.shard_dim().is_some()
    }

    /// True if this placement shards tensor dim `dim` (plain or strided).
    pub fn shards(&self, dim: usize) -> bool {
        self.shard_dim() == Some(dim)
    }

    /// True for `Partial` and `MaskPartial`.
    pub fn is_partial(&self) -> bool {
        matches!(self, Placement::Partial(_) | Placement::MaskPartial { .. })
    }

    /// True for `Replicate`.
    pub fn is_replicate(&self) -> bool {
        matches!(self, Placement::Replicate)
    }

    /// The pending reduction (`MaskPartial` reduces like `sum`).
    pub fn reduce_op(&self) -> Option<ReduceOp> {
        match *self {
            Placement::Partial(op) => Some(op),
            Placement::MaskPartial { .. } => Some(ReduceOp::Sum),
            _ => None,
        }
    }

    /// Parses one placement, resolving negative shard dims against `ndim`.
    pub fn parse_with_ndim(s: &str, ndim: Option<usize>) -> Result<Placement> {
        parse_one(s, ndim)
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::StridedShard { dim, split_factor } => write!(f, "SS({dim},{split_factor})"),
            Placement::Replicate => f.write_str("R"),
            Placement::Partial(op) => write!(f, "P({op})"),
            Placement::MaskPartial { dim, size } => write!(f, "MP({dim},{size})"),
        }
    }
}

impl FromStr for Placement {
    type Err = StrategyError;
    fn from_str(s: &str) -> Result<Self> {
        parse_one(s, None)
    }
}

impl Serialize for Placement {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `placements` with every Partial (and MaskPartial) mesh dim made `Replicate`: how each
/// summand of a Partial value is laid out (and how the value is held once reduced).
pub fn partials_replicated(placements: &[Placement]) -> Placements {
    placements
        .iter()
        .map(|p| {
            if p.is_partial() {
                Placement::Replicate
            } else {
                *p
            }
        })
        .collect()
}

/// Formats placements in the short list syntax: `S(0),R`.
pub fn format_placements(placements: &[Placement]) -> String {
    let mut out = String::new();
    for (i, p) in placements.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&p.to_string());
    }
    out
}

/// Parses a comma-separated placement list (`"S(0),R"`, `"Shard(0), Replicate"`).
///
/// # Errors
/// [`StrategyError::Parse`] on empty input or a malformed element (the message quotes it).
pub fn parse_placements(s: &str) -> Result<Placements> {
    parse_placements_with_ndim(s, None)
}

/// Like [`parse_placements`], but negative shard dims (`S(-1)`) are resolved against `ndim`.
///
/// # Errors
/// [`StrategyError::Parse`] on empty input, a malformed element or an out-of-range negative dim.
pub fn parse_placements_with_ndim(s: &str, ndim: Option<usize>) -> Result<Placements> {
    if s.trim().is_empty() {
        return Err(StrategyError::parse(
            "placements",
            s,
            "empty placement list",
        ));
    }
    let mut out = Placements::new();
    let mut depth = 0i32;
    let mut start = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(parse_one(&s[start..i], ndim)?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(StrategyError::parse(
            "placements",
            s,
            "unbalanced parentheses",
        ));
    }
    out.push(parse_one(&s[start..], ndim)?);
    Ok(out)
}

fn parse_one(raw: &str, ndim: Option<usize>) -> Result<Placement> {
    let s: String = raw.chars().filter(|c| !c.is_whitespace()).collect();
    if s.is_empty() {
        return Err(StrategyError::parse("placement", raw, "empty placement"));
    }
    let (head, args) = match s.find('(') {
        Some(open) => {
            if !s.ends_with(')') {
                return Err(StrategyError::parse("placement", raw, "missing ')'"));
            }
            (&s[..open], Some(&s[open + 1..s.len() - 1]))
        }
        None => (s.as_str(), None),
    };
    let args: Vec<&str> = match args {
        Some(a) if !a.is_empty() => a.split(',').map(strip_keyword).collect(),
        _ => Vec::new(),
    };
    let int = |a: &str| -> Result<usize> {
        let v: i64 = a.parse().map_err(|_| {
            StrategyError::parse("placement", raw, format!("{a:?} is not an integer"))
        })?;
        if v >= 0 {
            return Ok(v as usize);
        }
        match ndim {
            Some(n) if (-v as usize) <= n => Ok((n as i64 + v) as usize),
            Some(n) => Err(StrategyError::parse(
                "placement",
                raw,
                format!("dim {v} out of range for a {n}-d tensor"),
            )),
            None => Err(StrategyError::parse(
                "placement",
                raw,
                "negative dims need the tensor's ndim (give shapes)",
            )),
        }
    };
    let want = |n: usize| -> Result<()> {
        if args.len() == n {
            Ok(())
        } else {
            Err(StrategyError::parse(
                "placement",
                raw,
                format!("expected {n} argument(s)"),
            ))
        }
    };
    match head.to_ascii_lowercase().as_str() {
        "s" | "shard" => {
            want(1)?;
            Ok(Placement::Shard(int(args[0])?))
        }
        "ss" | "stridedshard" | "_stridedshard" => {
            want(2)?;
            Ok(Placement::StridedShard {
                dim: int(args[0])?,
                split_factor: int(args[1])?,
            })
        }
        "r" | "replicate" => {
            want(0)?;
            Ok(Placement::Replicate)
        }
        "p" | "partial" => match args.len() {
            0 => Ok(Placement::Partial(ReduceOp::Sum)),
            1 => Ok(Placement::Partial(
                args[0].trim_matches(|c| c == '"' || c == '\'').parse()?,
            )),
            _ => Err(StrategyError::parse(
                "placement",
                raw,
                "expected at most 1 argument",
            )),
        },
        "mp" | "maskpartial" | "_maskpartial" => {
            want(2)?;
            Ok(Placement::MaskPartial {
                dim: int(args[0])?,
                size: int(args[1])?,
            })
        }
        _ => Err(StrategyError::parse(
            "placement",
            raw,
            "expected S(d), SS(d,sf), R, P(op) or MP(d,size)",
        )),
    }
}

/// Strips a `name=` keyword prefix (`dim=0` -> `0`, `reduce_op=sum` -> `sum`).
fn strip_keyword(a: &str) -> &str {
    match a.find('=') {
        Some(i) => &a[i + 1..],
        None => a,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_parse_round_trip() {
        let all = [
            Placement::Shard(0),
            Placement::StridedShard {
                dim: 1,
                split_factor: 2,
            },
            Placement::Replicate,
            Placement::Partial(ReduceOp::Sum),
            Placement::Partial(ReduceOp::Avg),
            Placement::Partial(ReduceOp::Max),
            Placement::Partial(ReduceOp::Min),
            Placement::Partial(ReduceOp::Product),
            Placement::MaskPartial { dim: 0, size: 512 },
        ];
        let text = format_placements(&all);
        assert_eq!(
            text,
            "S(0),SS(1,2),R,P(sum),P(avg),P(max),P(min),P(product),MP(0,512)"
        );
        assert_eq!(parse_placements(&text).unwrap().as_slice(), &all);
    }

    #[test]
    fn long_forms_and_whitespace() {
        let p = parse_placements(" Shard(0) , Replicate(), Partial(avg), Partial , P").unwrap();
        assert_eq!(
            p.as_slice(),
            &[
                Placement::Shard(0),
                Placement::Replicate,
                Placement::Partial(ReduceOp::Avg),
                Placement::Partial(ReduceOp::Sum),
                Placement::Partial(ReduceOp::Sum)
            ]
        );
        assert_eq!(
            parse_placements("StridedShard(dim=0, split_factor=4)").unwrap()[0],
            Placement::StridedShard {
                dim: 0,
                split_factor: 4
            }
        );
        assert_eq!(format!("{:?}", Placement::Shard(0)), "Shard(0)");
    }

    #[test]
    fn negative_dims_need_ndim() {
        assert!(parse_placements("S(-1)").is_err());
        assert_eq!(
            parse_placements_with_ndim("S(-1)", Some(3)).unwrap()[0],
            Placement::Shard(2)
        );
        assert!(parse_placements_with_ndim("S(-4)", Some(3)).is_err());
    }

    #[test]
    fn errors_quote_the_text() {
        for bad in ["", "S", "S(x)", "Q(0)", "S(0", "P(foo)", "S(0,1)", "R,,R"] {
            let e = parse_placements(bad).unwrap_err();
            assert!(matches!(e, StrategyError::Parse { .. }), "{bad}: {e}");
        }
        let msg = parse_placements("S(0),Q(1)").unwrap_err().to_string();
        assert!(msg.contains("Q(1)"), "{msg}");
    }

    #[test]
    fn serde_uses_short_form() {
        let p = Placement::Partial(ReduceOp::Max);
        let js = serde_json::to_string(&p).unwrap();
        assert_eq!(js, "\"P(max)\"");
        let back: Placement = serde_json::from_str(&js).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn reduce_op_algebra() {
        assert!(ReduceOp::Sum.commutes_with(ReduceOp::Avg));
        assert!(!ReduceOp::Sum.commutes_with(ReduceOp::Max));
        assert!(ReduceOp::Max.commutes_with(ReduceOp::Max));
        assert_eq!(ReduceOp::Max.mirrored(), ReduceOp::Min);
        assert_eq!("mean".parse::<ReduceOp>().unwrap(), ReduceOp::Avg);
    }
}
