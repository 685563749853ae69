//! Inputs shared by the kernel tests: deterministic values, and their rounding to a kernel's
//! element type.
#![allow(dead_code)]

use candle_dtensor_kernels_emu::fused::Dt;

/// `len` deterministic values in `[-scale, scale)` (xorshift from `seed`).
pub fn values(len: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `v` rounded to `T`, and back as the f32 values the reference computes on.
pub fn as_dt<T: Dt>(v: &[f32]) -> (Vec<T>, Vec<f32>) {
    let t: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
    let back = t.iter().map(|&x| x.to_f32()).collect();
    (t, back)
}
