//! Deterministic, layout-independent initialisation.
//!
//! Every element's value is a function of `(seed, parameter name, global index)` (a counter-based
//! generator: splitmix64 of the key, Box-Muller for normals), so a rank generates exactly its own
//! piece without materialising the full tensor, and a model initialised on any mesh holds the
//! parameters of the single-device model with the same seed.

use candle_core::{DType, Device, Tensor};

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    /// Uniform in `[lo, hi)`.
    Uniform(f64, f64),
    /// Every element equal to this value.
    Const(f64),
    /// Normal with this mean and standard deviation.
    NormalMean(f64, f64),
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a name (FNV-1a), so keys do not depend on the Rust version.
pub fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

fn unit(key: u64) -> f64 {
    // 53 random bits in [0, 1).
    (splitmix64(key) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The value of element `index` (row-major global linear index) of parameter `name`.
pub fn value(init: Init, seed: u64, name: &str, index: u64) -> f64 {
    let base = splitmix64(seed ^ name_hash(name).rotate_left(17))
        ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    match init {
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
        Init::Const(v) => v,
        Init::NormalMean(mean, std) => mean + value(Init::Normal(std), seed, name, index),
        Init::Uniform(lo, hi) => lo + (hi - lo) * unit(base),
        Init::Normal(std) => {
            let u1 = unit(base).max(f64::MIN_POSITIVE);
            let u2 = unit(base ^ 0xA5A5_A5A5_5A5A_5A5A);
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        }
    }
}

/// The piece of parameter `name` (global `shape`) whose global indices along each dim are
/// `indices[d]` (e.g. from `layout::local_indices`), as a tensor of those sizes.
pub fn piece(
    init: Init,
    seed: u64,
    name: &str,
    shape: &[usize],
    indices: &[Vec<usize>],
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let dims: Vec<usize> = indices.iter().map(|v| v.len()).collect();
    let n: usize = dims.iter().product();
    let strides: Vec<u64> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product::<usize>() as u64)
        .collect();
    let mut out = Vec::with_capacity(n);
    let mut pos = vec![0usize; dims.len()];
    for _ in 0..n {
        let lin: u64 = pos
            .iter()
            .enumerate()
            .map(|(d, &i)| indices[d][i] as u64 * strides[d])
            .sum();
        out.push(value(init, seed, name, lin) as f32);
        for d in (0..pos.len()).rev() {
            pos[d] += 1;
            if pos[d] < dims[d] {
                break;
            }
            pos[d] = 0;
        }
    }
    Tensor::from_vec(out, dims, device)?.to_dtype(dtype)
}

/// The full parameter (the single-device reference).
pub fn full(
    init: Init,
    seed: u64,
    name: &str,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let idx: Vec<Vec<usize>> = shape.iter().map(|&n| (0..n).collect()).collect();
    piece(init, seed, name, shape, &idx, dtype, device)
}

thread_local! {
    static PIECE: std::cell::RefCell<Option<PieceRequest>> = const { std::cell::RefCell::new(None) };
}

/// A request for a piece of a parameter, made through a candle-nn `VarBuilder` by the
/// tensor-parallel layers of [`crate::tp_nn`]: the `VarBuilder` API can only ask for a shape,
/// so the layer states here which global rows/cols the requested shape covers, and the
/// backends of this crate ([`crate::fsdp_vb::FsdpVarMap`], [`crate::fsdp_vb::reference_var_builder`])
/// produce exactly those elements of the single-device parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceRequest {
    /// The global (single-device) shape.
    pub global: Vec<usize>,
    /// The global indices along each dim of the piece.
    pub indices: Vec<Vec<usize>>,
}

impl PieceRequest {
    /// The shape of the piece.
    pub fn dims(&self) -> Vec<usize> {
        self.indices.iter().map(Vec::len).collect()
    }
}

/// Runs `f`, which creates one parameter through a `VarBuilder`, with `request` pending on
/// this thread: the first backend of this crate asked for a tensor of the piece's shape takes
/// it ([`take_piece`]). The request is gone when `f` returns (or panics), taken or not.
pub fn with_piece<T>(request: PieceRequest, f: impl FnOnce() -> T) -> T {
    struct Reset(Option<PieceRequest>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            PIECE.with(|p| *p.borrow_mut() = prev);
        }
    }
    let prev = PIECE.with(|p| p.borrow_mut().replace(request));
    let _reset = Reset(prev);
    f()
}

/// The pending [`PieceRequest`] of this thread, taken, if its piece has shape `dims` (what a
/// backend was asked for); `None` otherwise (then the backend creates the whole tensor).
pub fn take_piece(dims: &[usize]) -> Option<PieceRequest> {
    PIECE.with(|p| {
        let mut p = p.borrow_mut();
        if p.as_ref().is_some_and(|r| r.dims() == dims) {
            p.take()
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_moments() {
        let v: Vec<f64> = (0..20_000)
            .map(|i| value(Init::Normal(2.0), 7, "w", i))
            .collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "{var}");
    }

    #[test]
    fn piece_requests_are_taken_once_and_only_by_their_shape() {
        let req = PieceRequest {
            global: vec![4, 3],
            indices: vec![vec![2, 3], vec![0, 1, 2]],
        };
        let (wrong, first, second) = with_piece(req.clone(), || {
            (
                take_piece(&[4, 3]),
                take_piece(&[2, 3]),
                take_piece(&[2, 3]),
            )
        });
        assert_eq!((wrong, first, second), (None, Some(req.clone()), None));
        // Not taken inside: gone afterwards all the same.
        with_piece(req, || ());
        assert_eq!(take_piece(&[2, 3]), None);
    }

    #[test]
    fn piece_matches_full() {
        let full = full(Init::Normal(1.0), 3, "p", &[5, 4], DType::F32, &Device::Cpu).unwrap();
        let p = piece(
            Init::Normal(1.0),
            3,
            "p",
            &[5, 4],
            &[vec![3, 4], vec![1, 2, 3]],
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let expect = full.narrow(0, 3, 2).unwrap().narrow(1, 1, 3).unwrap();
        assert_eq!(
            p.to_vec2::<f32>().unwrap(),
            expect.to_vec2::<f32>().unwrap()
        );
    }
}
