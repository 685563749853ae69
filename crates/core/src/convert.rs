//! Conversions between the vocabularies of candle and the compiler (the comm layer and the
//! compiler share one `ReduceOp`, from `candle-dtensor-types`: nothing to convert).

use candle_core::DType;
use candle_dtensor_strategies::DType as SDType;

/// The compiler's dtype for a candle dtype (`None` for dtypes collectives do not move).
pub(crate) fn sdtype(d: DType) -> Option<SDType> {
    Some(match d {
        DType::F32 => SDType::F32,
        DType::F64 => SDType::F64,
        DType::F16 => SDType::F16,
        DType::BF16 => SDType::BF16,
        DType::I64 => SDType::I64,
        DType::U32 => SDType::U32,
        DType::U8 => SDType::U8,
        _ => return None,
    })
}

/// The candle dtype for a compiler dtype.
pub(crate) fn cdtype(d: SDType) -> DType {
    match d {
        SDType::F32 => DType::F32,
        SDType::F64 => DType::F64,
        SDType::F16 => DType::F16,
        SDType::BF16 => DType::BF16,
        SDType::I64 => DType::I64,
        SDType::U32 => DType::U32,
        SDType::U8 => DType::U8,
    }
}
