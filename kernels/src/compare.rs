//! Element-wise comparisons of tensors, for checking a kernel against its reference (the unit
//! tests of this crate and of the models use them).

use candle_core::Tensor;

type CResult<T> = candle_core::Result<T>;

/// `max |a - b|` over all elements of two f32 tensors of one shape (non-empty).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> CResult<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// `sum |t|` over all elements of an f32 tensor: zero exactly when every element is.
pub fn abs_sum(t: &Tensor) -> CResult<f32> {
    t.abs()?.sum_all()?.to_scalar::<f32>()
}
