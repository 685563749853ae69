//! Tensor metadata ([`TensorMeta`], [`DType`]) and the sharded spec ([`DTensorSpec`]).
//!
//! The mesh is deliberately NOT inside [`DTensorSpec`]: functions take a
//! [`MeshTopology`](crate::MeshTopology) next to the specs, so specs stay small `Hash + Eq` values.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use crate::error::{Result, StrategyError};
use crate::placement::{format_placements, Placement, Placements};

/// A tensor shape (global or local).
pub type Shape = SmallVec<[usize; 6]>;

/// Formats a shape as `[8, 16]` (the form used in error messages).
pub fn shape_str(shape: &[usize]) -> String {
    format!("{shape:?}")
}

/// Element types the runtime supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit unsigned integer.
    U32,
    /// 8-bit unsigned integer (masks, comparison results).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// True for the integer types.
    pub fn is_int(self) -> bool {
        !self.is_float()
    }

    /// Lower-case name (`f32`, `bf16`, `u8`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = StrategyError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Ok(DType::F32),
            "f64" | "float64" | "double" => Ok(DType::F64),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "i64" | "int64" | "long" => Ok(DType::I64),
            "u32" | "uint32" => Ok(DType::U32),
            "u8" | "uint8" | "bool" => Ok(DType::U8),
            _ => Err(StrategyError::parse(
                "dtype",
                s,
                "expected one of f32, f64, f16, bf16, i64, u32, u8",
            )),
        }
    }
}

impl Serialize for DType {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for DType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Global shape and dtype of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Global shape.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
}

impl TensorMeta {
    /// Builds a meta from a shape slice.
    pub fn new(shape: &[usize], dtype: DType) -> Self {
        TensorMeta {
            shape: Shape::from_slice(shape),
            dtype,
        }
    }

    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (1 for a 0-d tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes of the whole (global) tensor.
    pub fn bytes(&self) -> u64 {
        self.numel() as u64 * self.dtype.size_in_bytes() as u64
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} {}", self.shape.as_slice(), self.dtype)
    }
}

/// A sharded tensor: its global meta and one placement per mesh dim.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DTensorSpec {
    /// One placement per mesh dim.
    pub placements: Placements,
    /// Global shape and dtype.
    pub meta: TensorMeta,
}

impl DTensorSpec {
    /// Builds a spec.
    pub fn new(shape: &[usize], dtype: DType, placements: &[Placement]) -> Self {
        DTensorSpec {
            placements: Placements::from_slice(placements),
            meta: TensorMeta::new(shape, dtype),
        }
    }

    /// A fully replicated spec on a mesh with `mesh_ndim` dims.
    pub fn replicated(meta: TensorMeta, mesh_ndim: usize) -> Self {
        DTensorSpec {
            placements: smallvec::smallvec![Placement::Replicate; mesh_ndim],
            meta,
        }
    }

    /// Global shape.
    pub fn shape(&self) -> &[usize] {
        &self.meta.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// Checks the placements against the tensor and a mesh with `mesh_ndim` dims: placement
    /// count, shard dims in range, strided split factors >= 1, mask sizes >= 1.
    ///
    /// # Errors
    /// [`StrategyError::PlacementCount`], [`StrategyError::ShardDimOutOfRange`] or
    /// [`StrategyError::InvalidPlacement`], naming `op`.
    pub fn validate(&self, mesh_ndim: usize, op: &str) -> Result<()> {
        validate_placements(&self.placements, &self.meta.shape, mesh_ndim, op)
    }
}

/// Checks placements against a global shape and a mesh with `mesh_ndim` dims (see
/// [`DTensorSpec::validate`]).
///
/// # Errors
/// As [`DTensorSpec::validate`].
pub fn validate_placements(
    placements: &[Placement],
    shape: &[usize],
    mesh_ndim: usize,
    op: &str,
) -> Result<()> {
    if placements.len() != mesh_ndim {
        return Err(StrategyError::PlacementCount {
            op: op.to_string(),
            expected: mesh_ndim,
            got: placements.len(),
            placements: format_placements(placements),
        });
    }
    for p in placements {
        if let Some(d) = p.shard_dim() {
            if d >= shape.len() {
                return Err(StrategyError::ShardDimOutOfRange {
                    op: op.to_string(),
                    placement: p.to_string(),
                    ndim: shape.len(),
                    shape: Shape::from_slice(shape),
                });
            }
        }
        match *p {
            Placement::StridedShard {
                split_factor: 0, ..
            } => {
                return Err(StrategyError::InvalidPlacement {
                    op: op.to_string(),
                    placement: p.to_string(),
                    reason: "split_factor must be >= 1".into(),
                })
            }
            Placement::MaskPartial { size: 0, .. } => {
                return Err(StrategyError::InvalidPlacement {
                    op: op.to_string(),
                    placement: p.to_string(),
                    reason: "mask size must be >= 1".into(),
                })
            }
            _ => {}
        }
    }
    Ok(())
}

impl fmt::Display for DTensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.meta, format_placements(&self.placements))
    }
}

/// Serializes as its display form, `"[8, 16] f32 S(0),R"`.
impl serde::Serialize for DTensorSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display() {
        let s = DTensorSpec::new(
            &[8, 16],
            DType::F32,
            &[Placement::Shard(0), Placement::Replicate],
        );
        assert_eq!(s.to_string(), "[8, 16] f32 S(0),R");
        assert_eq!(s.meta.bytes(), 8 * 16 * 4);
    }

    #[test]
    fn validate_errors() {
        let s = DTensorSpec::new(&[4, 8], DType::F32, &[Placement::Shard(3)]);
        let e = s.validate(1, "add").unwrap_err();
        assert_eq!(e.to_string(), "add: S(3) on a 2-d tensor [4, 8]");
        let e = s.validate(2, "add").unwrap_err();
        assert!(
            matches!(
                e,
                StrategyError::PlacementCount {
                    expected: 2,
                    got: 1,
                    ..
                }
            ),
            "{e}"
        );
        let s = DTensorSpec::new(
            &[4],
            DType::F32,
            &[Placement::StridedShard {
                dim: 0,
                split_factor: 0,
            }],
        );
        assert!(matches!(
            s.validate(1, "x"),
            Err(StrategyError::InvalidPlacement { .. })
        ));
    }

    #[test]
    fn dtypes() {
        for d in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::U32,
            DType::U8,
        ] {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::BF16.size_in_bytes(), 2);
        assert!(DType::F16.is_float() && DType::U32.is_int());
    }
}
