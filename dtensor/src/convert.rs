//! Conversions between the vocabularies of candle, the comm layer and the compiler.

use candle_core::DType;
use candle_dtensor_comm::ReduceOp as CommReduce;
use candle_dtensor_strategies::{DType as SDType, ReduceOp as SReduce};

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

/// The communicator's reduce op for a compiler reduce op.
pub(crate) fn comm_reduce(op: SReduce) -> CommReduce {
    match op {
        SReduce::Sum => CommReduce::Sum,
        SReduce::Avg => CommReduce::Avg,
        SReduce::Max => CommReduce::Max,
        SReduce::Min => CommReduce::Min,
        SReduce::Product => CommReduce::Product,
    }
}
