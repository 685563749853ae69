//! The vocabulary shared by the communicators (`candle-dtensor-comm`) and the sharding compiler
//! (`candle-dtensor-strategies`), so both speak of the same value without converting: today
//! [`ReduceOp`], the reduction of a reducing collective and of a `Partial` placement.
//!
//! It depends on neither candle nor any other crate of the project (only serde), so the compiler
//! stays pure and the comm layer does not depend on the compiler; both re-export the type
//! (`candle_dtensor_comm::ReduceOp` and `candle_dtensor_strategies::ReduceOp` are this one).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How per-rank values combine: the op of a reducing collective, and what a `Partial`
/// placement is waiting for.
///
/// `Avg` is `Sum` followed by a division by the number of ranks; collectives define it for
/// floating-point dtypes only ([`ReduceOp::float_only`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// Elementwise sum of the per-rank values.
    Sum,
    /// Elementwise mean of the per-rank values.
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Elementwise product.
    Product,
}

impl ReduceOp {
    /// All reduce ops, in declaration order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ];

    /// Lower-case name: `sum`, `avg`, `max`, `min`, `product`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        }
    }

    /// Whether the op is defined for floating-point values only (`avg`: integer division by
    /// the number of ranks would truncate).
    pub fn float_only(self) -> bool {
        self == ReduceOp::Avg
    }

    /// `sum` and `avg`: the reductions that commute with linear maps.
    pub fn is_linear(self) -> bool {
        matches!(self, ReduceOp::Sum | ReduceOp::Avg)
    }

    /// Whether reducing over two mesh dims gives the same result in either order
    /// (`sum` and `avg` commute with each other; any op commutes with itself).
    pub fn commutes_with(self, other: ReduceOp) -> bool {
        self == other || (self.is_linear() && other.is_linear())
    }

    /// The op obtained by applying a non-increasing map to a `P(self)` value (max <-> min).
    pub fn mirrored(self) -> ReduceOp {
        match self {
            ReduceOp::Max => ReduceOp::Min,
            ReduceOp::Min => ReduceOp::Max,
            other => other,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A string that names no [`ReduceOp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseReduceOpError {
    /// The text given.
    pub text: String,
}

impl ParseReduceOpError {
    /// Why the text was refused.
    pub const EXPECTED: &'static str = "expected one of sum, avg, max, min, product";
}

impl fmt::Display for ParseReduceOpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "reduce op {:?}: {}", self.text, Self::EXPECTED)
    }
}

impl std::error::Error for ParseReduceOpError {}

impl FromStr for ReduceOp {
    type Err = ParseReduceOpError;

    /// Case-insensitive; also `mean`, `prod`, and the empty string for `sum`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sum" | "" => Ok(ReduceOp::Sum),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "product" | "prod" => Ok(ReduceOp::Product),
            _ => Err(ParseReduceOpError {
                text: s.to_string(),
            }),
        }
    }
}

impl Serialize for ReduceOp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for ReduceOp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_travel_as_json_strings() {
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>(), Ok(op));
            assert_eq!(op.to_string(), op.name());
            let j = serde_json::to_string(&op).expect("serializes");
            assert_eq!(j, format!("\"{}\"", op.name()));
            assert_eq!(serde_json::from_str::<ReduceOp>(&j).expect("parses"), op);
        }
        assert_eq!(" Mean ".parse::<ReduceOp>(), Ok(ReduceOp::Avg));
        assert_eq!("prod".parse::<ReduceOp>(), Ok(ReduceOp::Product));
        let e = "median".parse::<ReduceOp>().expect_err("not an op");
        assert_eq!(
            e.to_string(),
            "reduce op \"median\": expected one of sum, avg, max, min, product"
        );
        assert!(serde_json::from_str::<ReduceOp>("\"median\"").is_err());
    }

    #[test]
    fn algebra() {
        assert!(ReduceOp::Sum.commutes_with(ReduceOp::Avg));
        assert!(!ReduceOp::Sum.commutes_with(ReduceOp::Max));
        assert!(ReduceOp::Max.commutes_with(ReduceOp::Max));
        assert_eq!(ReduceOp::Max.mirrored(), ReduceOp::Min);
        assert_eq!(ReduceOp::Sum.mirrored(), ReduceOp::Sum);
        let float_only: Vec<ReduceOp> = ReduceOp::ALL
            .into_iter()
            .filter(|o| o.float_only())
            .collect();
        assert_eq!(float_only, vec![ReduceOp::Avg]);
    }
}
