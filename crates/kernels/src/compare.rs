//! Comparisons that can fail: a run against its reference, a kernel against its composition.
//!
//! Every check the project ships (train_gpt's and train_llama's `--check`, the GPU examples,
//! the kernel and model tests) goes through these helpers, so they share one rule:
//!
//! - **NaN and infinity are failures**, never a difference of zero. A running maximum taken
//!   with `f64::max` drops NaN (it returns the other operand), which is how a run whose losses
//!   were all NaN used to report a difference of 0; [`nan_max`] propagates NaN instead.
//! - **Lengths must agree**: two series of different lengths are a [`Mismatch::Length`], not a
//!   comparison of the shorter prefix (a run that stopped early is not a run that matched).
//! - **A tolerance is part of the check**: [`SeriesDiff::within`] turns a difference into a
//!   pass or a typed [`Mismatch`] naming the series, the step and both values.
//!
//! The relative difference of `got` against `want` is `|got - want| / max(|want|, 1e-12)`.

use candle_core::{DType, Tensor};

type CResult<T> = candle_core::Result<T>;

/// The smallest `|want|` a relative difference divides by (so an exact zero reference does not
/// turn a tiny absolute difference into infinity... or a zero into NaN).
pub const REL_FLOOR: f64 = 1e-12;

/// `max(a, b)` that propagates NaN: NaN if either is NaN. (`f64::max` returns the non-NaN
/// operand, which makes a fold over differences blind to NaN.)
pub fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// `|got - want| / max(|want|, REL_FLOOR)`: NaN when either value is NaN, infinite when either
/// is infinite (even two equal infinities: an infinite loss is a failed run).
pub fn rel_diff(got: f64, want: f64) -> f64 {
    if got.is_nan() || want.is_nan() {
        return f64::NAN;
    }
    if got.is_infinite() || want.is_infinite() {
        return f64::INFINITY;
    }
    (got - want).abs() / want.abs().max(REL_FLOOR)
}

/// Why a comparison failed: what was compared, where, and the values seen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Mismatch {
    /// The two series have different lengths.
    #[error("{what}: {got} values, but the reference has {want} (a run that stopped early or ran longer does not match)")]
    Length {
        /// What was compared ("loss", "held-out loss", "grad wte", ...).
        what: String,
        /// Values in the series checked.
        got: usize,
        /// Values in the reference.
        want: usize,
    },
    /// A value (of either side) is NaN or infinite.
    #[error("{what}: element {index} is not finite (got {got}, reference {want})")]
    NonFinite {
        /// What was compared.
        what: String,
        /// Index of the first non-finite pair (a step, or a flat element index).
        index: usize,
        /// The checked value there.
        got: f64,
        /// The reference value there.
        want: f64,
    },
    /// The largest relative difference exceeds the tolerance.
    #[error("{what}: relative difference {rel:.3e} at element {index} exceeds the tolerance {tol:.1e} (got {got}, reference {want})")]
    Tolerance {
        /// What was compared.
        what: String,
        /// Index of the worst pair.
        index: usize,
        /// Its relative difference.
        rel: f64,
        /// The tolerance it was held to.
        tol: f64,
        /// The checked value there.
        got: f64,
        /// The reference value there.
        want: f64,
    },
    /// The tolerance itself is not a finite number of at least 0.
    #[error("{what}: tolerance {tol} is not a finite number >= 0")]
    BadTolerance {
        /// What was to be compared.
        what: String,
        /// The tolerance given.
        tol: f64,
    },
}

/// The result of comparing two series of equal length with only finite values.
#[derive(Debug, Clone, PartialEq)]
pub struct SeriesDiff {
    /// What was compared.
    pub what: String,
    /// How many pairs were compared.
    pub len: usize,
    /// The largest relative difference (0 for empty series).
    pub max_rel: f64,
    /// Index of the pair with the largest relative difference.
    pub worst: usize,
    /// The checked and reference values at `worst`.
    pub worst_values: (f64, f64),
}

impl SeriesDiff {
    /// `Ok(self)` when `max_rel <= tol`, else [`Mismatch::Tolerance`] at the worst pair.
    pub fn within(self, tol: f64) -> Result<SeriesDiff, Mismatch> {
        if !(tol.is_finite() && tol >= 0.0) {
            return Err(Mismatch::BadTolerance {
                what: self.what,
                tol,
            });
        }
        if self.max_rel <= tol {
            Ok(self)
        } else {
            Err(Mismatch::Tolerance {
                what: self.what,
                index: self.worst,
                rel: self.max_rel,
                tol,
                got: self.worst_values.0,
                want: self.worst_values.1,
            })
        }
    }
}

/// Compares `got` with `want` pair by pair: an error when the lengths differ or any value is
/// NaN or infinite, else the largest relative difference and where it is.
pub fn compare_series(what: &str, got: &[f64], want: &[f64]) -> Result<SeriesDiff, Mismatch> {
    if got.len() != want.len() {
        return Err(Mismatch::Length {
            what: what.to_string(),
            got: got.len(),
            want: want.len(),
        });
    }
    let mut out = SeriesDiff {
        what: what.to_string(),
        len: got.len(),
        max_rel: 0.0,
        worst: 0,
        worst_values: (
            got.first().copied().unwrap_or(0.0),
            want.first().copied().unwrap_or(0.0),
        ),
    };
    for (index, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !g.is_finite() || !w.is_finite() {
            return Err(Mismatch::NonFinite {
                what: what.to_string(),
                index,
                got: g,
                want: w,
            });
        }
        let rel = rel_diff(g, w);
        if rel > out.max_rel {
            out.max_rel = rel;
            out.worst = index;
            out.worst_values = (g, w);
        }
    }
    Ok(out)
}

/// [`compare_series`] then [`SeriesDiff::within`]: the whole check in one call.
pub fn check_series(
    what: &str,
    got: &[f64],
    want: &[f64],
    tol: f64,
) -> Result<SeriesDiff, Mismatch> {
    compare_series(what, got, want)?.within(tol)
}

/// [`compare_series`] for f32 series (losses are f32 in the trainers).
pub fn compare_series_f32(what: &str, got: &[f32], want: &[f32]) -> Result<SeriesDiff, Mismatch> {
    let g: Vec<f64> = got.iter().map(|&v| v as f64).collect();
    let w: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    compare_series(what, &g, &w)
}

fn host_f64(t: &Tensor) -> CResult<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// `max |a - b|` over all elements of two tensors of one shape (any float dtype, any device),
/// NaN when any element of either is NaN, infinite when any is infinite, 0 for empty tensors.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> CResult<f64> {
    if a.dims() != b.dims() {
        candle_core::bail!(
            "max_abs_diff: shapes differ: {:?} vs {:?}",
            a.dims(),
            b.dims()
        );
    }
    let (av, bv) = (host_f64(a)?, host_f64(b)?);
    Ok(av.iter().zip(&bv).fold(0.0, |m, (&x, &y)| {
        let d = if x.is_infinite() || y.is_infinite() {
            f64::INFINITY
        } else {
            (x - y).abs()
        };
        nan_max(m, d)
    }))
}

/// `max |a - b| / max |b|`: a tensor's difference relative to the reference's magnitude (the
/// gradient checks' measure), NaN-propagating like [`max_abs_diff`]; 0 when both are all zero.
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> CResult<f64> {
    let diff = max_abs_diff(a, b)?;
    let scale = host_f64(b)?.iter().fold(0.0, |m, &v| nan_max(m, v.abs()));
    if diff.is_nan() || scale.is_nan() {
        return Ok(f64::NAN);
    }
    if diff == 0.0 {
        return Ok(0.0);
    }
    Ok(diff / scale.max(REL_FLOOR))
}

/// `sum |t|` over all elements of a tensor: zero exactly when every element is (NaN if any is).
pub fn abs_sum(t: &Tensor) -> CResult<f64> {
    Ok(host_f64(t)?.iter().map(|v| v.abs()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn fold_with_nan_max_keeps_nan() {
        let v = [0.1, f64::NAN, 0.3];
        assert!(v.iter().copied().fold(0.0, nan_max).is_nan());
        // The bug this module exists for: f64::max returns the other operand, so a running
        // maximum built on it loses the NaN.
        assert_eq!(f64::max(f64::NAN, 0.3), 0.3);
        assert_eq!(f64::max(0.3, f64::NAN), 0.3);
    }

    #[test]
    fn series_failures_are_typed() {
        let want = [1.0, 2.0, 3.0];
        assert!(matches!(
            compare_series("loss", &[1.0, 2.0], &want),
            Err(Mismatch::Length {
                got: 2,
                want: 3,
                ..
            })
        ));
        assert!(matches!(
            compare_series("loss", &[1.0, f64::NAN, 3.0], &want),
            Err(Mismatch::NonFinite { index: 1, .. })
        ));
        assert!(matches!(
            compare_series("loss", &want, &[1.0, 2.0, f64::INFINITY]),
            Err(Mismatch::NonFinite { index: 2, .. })
        ));
        // NaN on both sides is still a failure, not "equal".
        assert!(compare_series("loss", &[f64::NAN], &[f64::NAN]).is_err());
        let e = check_series("loss", &[1.0, 2.2, 3.0], &want, 1e-3).unwrap_err();
        match &e {
            Mismatch::Tolerance { index, rel, .. } => {
                assert_eq!(*index, 1);
                assert!((rel - 0.1).abs() < 1e-12);
            }
            other => panic!("expected a tolerance failure, got {other:?}"),
        }
        assert!(e.to_string().contains("loss"));
        let ok = check_series("loss", &[1.0, 2.0 + 1e-9, 3.0], &want, 1e-6).unwrap();
        assert_eq!(ok.len, 3);
        assert_eq!(ok.worst, 1);
        assert!(check_series("loss", &want, &want, f64::NAN).is_err());
        assert!(check_series("loss", &want, &want, -1.0).is_err());
        assert_eq!(check_series("loss", &[], &[], 0.0).unwrap().max_rel, 0.0);
    }

    #[test]
    fn tensor_diffs_propagate_nan_and_inf() -> CResult<()> {
        let d = Device::Cpu;
        let a = Tensor::new(&[1f32, 2.0, 3.0], &d)?;
        let b = Tensor::new(&[1f32, 2.5, 3.0], &d)?;
        assert_eq!(max_abs_diff(&a, &b)?, 0.5);
        assert!((max_rel_diff(&a, &b)? - 0.5 / 3.0).abs() < 1e-12);
        let n = Tensor::new(&[1f32, f32::NAN, 3.0], &d)?;
        assert!(max_abs_diff(&n, &b)?.is_nan());
        assert!(max_abs_diff(&b, &n)?.is_nan());
        assert!(max_rel_diff(&a, &n)?.is_nan());
        assert!(abs_sum(&n)?.is_nan());
        let i = Tensor::new(&[1f32, f32::INFINITY, 3.0], &d)?;
        assert_eq!(max_abs_diff(&i, &i)?, f64::INFINITY);
        assert!(max_abs_diff(&a, &Tensor::new(&[1f32, 2.0], &d)?).is_err());
        let z = Tensor::zeros(3, DType::F32, &d)?;
        assert_eq!(max_rel_diff(&z, &z)?, 0.0);
        assert_eq!(abs_sum(&z)?, 0.0);
        Ok(())
    }
}
