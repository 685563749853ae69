//! Fused kernels with hand-written backward passes, for the ops that dominate a transformer
//! step outside matmuls: GELU (tanh form), layer norm, RMS norm, softmax (plain and
//! scaled-causal for attention), log-softmax and softmax cross-entropy, all over the last dim
//! of contiguous data.
//!
//! Built from candle primitives these ops take 5-30x longer (GELU: `powf` and `tanh` from libm
//! and a ten-op backward; norms and softmax: a dozen passes and allocations each). Each kernel
//! here is one pass forward and one or two backward. On the CPU they take f32; with the `cuda`
//! feature the same nodes have CUDA forwards and backward nodes for f32 and bf16
//! (`crate::cuda`, f32 arithmetic). Other dtypes and devices use the primitive compositions in
//! `ops::neural` ([`crate::autodiff::reference`]), which are the reference these kernels are
//! tested against. [`applies`] says where the CPU kernels run, [`device_applies`] where the
//! row kernels (GELU, norms, softmax family, cross-entropy) run.
//!
//! **SIMD and threads on the CPU.** The loops are written plainly and run inside [`simd`],
//! which compiles them for AVX-512, AVX2+FMA and the baseline and picks by what the CPU has at
//! run time. Each loop keeps its order of floating-point operations (Rust neither reassociates
//! nor fuses a multiply and an add on its own), so every width gives the same bits:
//! elementwise loops and maxima vectorize, and a sum keeps its one sequential order. A loop
//! that computes exponentials and sums them is split into the exponentials (vectorized) and
//! the sum. Row kernels run blocks of about 32K elements of whole rows in parallel on rayon's
//! pool (the one candle's CPU ops and GEMMs use, `RAYON_NUM_THREADS` threads); rows are
//! independent, and sums across rows (the norms' weight gradients, the mean loss) stay in row
//! order, so the thread count changes no bit either. `CDT_CPU_KERNELS=plain` runs them without
//! either (the baseline loops on the calling thread).

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Error, Layout, Shape, Tensor,
};

use crate::storage::{with_slice, Elem};

pub(crate) mod attention;

type CResult<T> = candle_core::Result<T>;

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> CResult<&'a [f32]> {
    let v = <f32 as Elem>::slice(s)
        .ok_or_else(|| Error::msg(format!("{op}: fused kernel takes f32")))?;
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| Error::msg(format!("{op}: input must be contiguous")))?;
    v.get(a..b)
        .ok_or_else(|| Error::msg(format!("{op}: input view outside its storage")))
}

/// Runs `f` on the f32 data of a contiguous CPU tensor.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> CResult<R> {
    if t.dtype() != DType::F32 {
        return Err(Error::msg("fused kernel takes f32"));
    }
    with_slice::<f32, R>(t, f)
}

fn from_vec(v: Vec<f32>, shape: &Shape, like: &Tensor) -> CResult<Tensor> {
    Tensor::from_vec(v, shape.clone(), like.device())
}

/// Whether the fused CPU path applies: f32 on the CPU (every kernel of this module).
pub fn applies(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.device().is_cpu()
}

/// Whether the fused row kernels with a device implementation apply: [`applies`], or, with the
/// `cuda` feature, f32 or bf16 on a CUDA device. These are [`gelu`], [`softmax_last`],
/// [`scaled_causal_softmax`], [`log_softmax_last`], [`layer_norm`], [`rms_norm`] and
/// [`cross_entropy_rows`] (and [`cross_entropy`] through it); the others are CPU-only.
///
/// `CDT_FUSED_CUDA=0` in the environment (read once) turns the CUDA path off: those tensors then
/// take the primitive compositions, as without the feature (a fallback while a kernel is in
/// doubt on some GPU; the CPU kernels are unaffected).
pub fn device_applies(t: &Tensor) -> bool {
    applies(t)
        || (cfg!(feature = "cuda")
            && t.device().is_cuda()
            && matches!(t.dtype(), DType::F32 | DType::BF16)
            && cuda_enabled())
}

/// Whether the fused CUDA path is on (`CDT_FUSED_CUDA` unset or anything but `0`): the row
/// kernels here, the embedding backward, the bias column sum, the linears' bias epilogue
/// (cuBLASLt; also off alone with `CDT_CUBLASLT=0`) or output pass, the trainer's multi-tensor gradient norm and the optimizer's one-launch AdamW
/// (`candle_dtensor_train`). `0` takes candle's ops for all of them.
pub fn cuda_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CDT_FUSED_CUDA").map_or(true, |v| v.trim() != "0"))
}

/// How the linears' GEMMs used cuBLASLt in this process ([`cublaslt_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CublasLtCounts {
    /// GEMMs run as one cuBLASLt matmul: linears' forwards, mixed-precision linears' `dx` and
    /// `dW`, and weight gradients with the bias gradient in the epilogue.
    pub matmuls: u64,
    /// Of those, forwards with the bias in the epilogue.
    pub bias_epilogues: u64,
    /// Of those, weight gradients with the bias gradient in the epilogue.
    pub bias_grads: u64,
    /// Refusals: shape/dtype plans cuBLASLt had no algorithm for, failed matmuls, devices
    /// without a handle. Those GEMMs ran on candle's (and a bias or cast pass).
    pub refused: u64,
}

/// What cuBLASLt refused in this process (the first 32): one line each, the GEMM's plan key
/// (shapes, layouts, dtypes, epilogue, compute type, alignments) and the error. Empty without
/// the `cuda` feature. A diagnostic for GPU checks, which may run without a log subscriber.
pub fn cublaslt_refusals() -> Vec<String> {
    #[cfg(feature = "cuda")]
    {
        crate::cublaslt::refusals()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

/// How many GEMMs took cuBLASLt (`kernels/src/cublaslt.rs`) in this process, and how many
/// times it refused. All zero without the `cuda` feature, or with `CDT_CUBLASLT=0` (the path
/// off) or `CDT_FUSED_CUDA=0`. A diagnostic for GPU checks.
pub fn cublaslt_counts() -> CublasLtCounts {
    #[cfg(feature = "cuda")]
    {
        crate::cublaslt::counts()
    }
    #[cfg(not(feature = "cuda"))]
    {
        CublasLtCounts::default()
    }
}

/// Whether `t` lives on a CUDA device (always false without the `cuda` feature, where no
/// tensor can).
fn on_cuda(t: &Tensor) -> bool {
    cfg!(feature = "cuda") && t.device().is_cuda()
}

/// `exp(x)` for f32 without libm: range reduction by ln 2 and a degree-6 polynomial
/// (relative error below 2e-7 over the whole range; written branch-free so loops vectorize).
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding it rounds to an integer (no SSE4.1 `round` needed), which then sits in
    // the low bits of the sum's representation.
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = exp_poly(r);
    // 2^n from the integer n in [-126, 127] read off `t`'s bits (t = MAGIC + n exactly): the
    // same value as `(n as i32 + 127) << 23`, without a saturating float-to-int conversion,
    // which keeps the loops around this vectorized.
    let k = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let bits = (k.wrapping_add(127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// `exp(r)` for `|r| <= ln 2 / 2`: its Taylor polynomial to degree 7, in Horner form.
#[inline(always)]
fn exp_poly(r: f32) -> f32 {
    1.0 + r
        * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668
                        + r * (0.008_333_334 + r * (0.001_388_889 + r * 0.000_198_412_7))))))
}

#[inline(always)]
fn fast_tanh(z: f32) -> f32 {
    1.0 - 2.0 / (fast_exp(2.0 * z) + 1.0)
}

/// Whether the CPU kernels run plain: no SIMD dispatch, one block on the calling thread
/// (`CDT_CPU_KERNELS=plain`; tests switch it to compare). The same bits either way.
static PLAIN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn plain() -> bool {
    static FROM_ENV: std::sync::Once = std::sync::Once::new();
    FROM_ENV.call_once(|| {
        if std::env::var("CDT_CPU_KERNELS").is_ok_and(|v| v.trim() == "plain") {
            PLAIN.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    PLAIN.load(std::sync::atomic::Ordering::Relaxed)
}

/// Runs `f` with its loops compiled for the widest SIMD instructions this CPU has (AVX-512,
/// AVX2+FMA, or the baseline), picked at run time (`pulp`); the same bits on every width (see
/// the module docs). What `f` calls is vectorized only where it is inlined into it.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    if plain() {
        return f();
    }
    pulp::Arch::new().dispatch(f)
}

/// About this many elements of input make one parallel task of a row kernel.
const PAR_GRAIN: usize = 1 << 15;

/// Runs `f(first_row, a_block, b_block, out_block)` over blocks of whole rows: `a` and `b`
/// have `n` elements a row (`b` may be empty: then its blocks are), `out` `m`; rows past the
/// end of the shortest are left out. Each block runs
/// in [`simd`]; blocks run in parallel on rayon's pool (candle's CPU ops and GEMMs use it too)
/// when there are several. Every caller's rows are independent of each other, so neither the
/// blocking nor the thread count changes a bit of the result.
#[inline(always)]
fn par_rows2(
    a: &[f32],
    b: &[f32],
    n: usize,
    out: &mut [f32],
    m: usize,
    f: impl Fn(usize, &[f32], &[f32], &mut [f32]) + Sync,
) {
    if n == 0 || m == 0 {
        return;
    }
    // The rows all operands have (a non-empty `b` limits them too).
    let mut rows = (a.len() / n).min(out.len() / m);
    if !b.is_empty() {
        rows = rows.min(b.len() / n);
    }
    let per = (PAR_GRAIN / n).max(1);
    let (a, out) = (&a[..rows * n], &mut out[..rows * m]);
    let b = if b.is_empty() { b } else { &b[..rows * n] };
    let b_block = if b.is_empty() { 0 } else { per * n };
    if rows <= per || plain() || rayon::current_num_threads() == 1 {
        return simd(|| f(0, a, b, out));
    }
    use rayon::prelude::*;
    let out_blocks = out.par_chunks_mut(per * m);
    let a_blocks = a.par_chunks(per * n);
    let b_of = |i: usize| {
        if b_block == 0 {
            &b[..0]
        } else {
            &b[(i * b_block).min(b.len())..((i + 1) * b_block).min(b.len())]
        }
    };
    a_blocks
        .zip(out_blocks)
        .enumerate()
        .for_each(|(i, (ab, ob))| simd(|| f(i * per, ab, b_of(i), ob)));
}

/// [`par_rows2`] with one input.
#[inline(always)]
fn par_rows(
    x: &[f32],
    n: usize,
    out: &mut [f32],
    m: usize,
    f: impl Fn(usize, &[f32], &mut [f32]) + Sync,
) {
    par_rows2(x, &[], n, out, m, |r, xb, _, ob| f(r, xb, ob));
}

/// Lanes of the maxima below: a multiple of every vector width.
const LANES: usize = 16;

/// The largest element of a row (`-inf` for an empty one; NaNs are skipped, as `f32::max`
/// does). Kept per lane, then across lanes: a maximum does not depend on the order it is taken
/// in, so this is the sequential fold's value, and it vectorizes.
#[inline(always)]
fn row_max(xr: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = xr.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v);
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    lanes.iter().fold(m, |a, &b| a.max(b))
}

/// `sum_j exp(x_j - m)` over a row, the exponentials written to `scratch` (vectorized) and
/// summed in order.
#[inline(always)]
fn sum_exp(xr: &[f32], m: f32, scratch: &mut Vec<f32>) -> f32 {
    scratch.resize(xr.len(), 0.0);
    for (e, &v) in scratch.iter_mut().zip(xr) {
        *e = fast_exp(v - m);
    }
    scratch.iter().sum()
}

/// The row walk of every row kernel here: each row of `n` elements of `x` goes through
/// `f(row_index, x_row, out_row)` into a zeroed output of `x`'s length (all zeros when
/// `n == 0`), in blocks of rows run in parallel ([`par_rows`]). Generic, so each kernel's loop
/// is compiled on its own.
#[inline(always)]
fn map_rows(x: &[f32], n: usize, f: impl Fn(usize, &[f32], &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    par_rows(x, n, &mut out, n, |first, xb, ob| {
        for (i, (xr, or)) in xb.chunks_exact(n).zip(ob.chunks_exact_mut(n)).enumerate() {
            f(first + i, xr, or);
        }
    });
    out
}

/// [`map_rows`] over the rows of two arrays of the same layout: `f(a_row, b_row, out_row)`
/// (rows past the shorter array's end stay zero).
#[inline(always)]
fn map_rows2(
    a: &[f32],
    b: &[f32],
    n: usize,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    if n == 0 {
        return out;
    }
    let rows = (a.len() / n).min(b.len() / n);
    par_rows2(
        &a[..rows * n],
        &b[..rows * n],
        n,
        &mut out,
        n,
        |_, ab, bb, ob| {
            for ((ar, br), or) in ab
                .chunks_exact(n)
                .zip(bb.chunks_exact(n))
                .zip(ob.chunks_exact_mut(n))
            {
                f(ar, br, or);
            }
        },
    );
    out
}

/// `x w^T + b` for row-major `x: [rows, inner]`, `w: [out, inner]` and `b: [out]` (f32,
/// CPU), as one gemm accumulating into output rows that start as copies of the bias: no zero
/// fill (candle's matmul makes its output zeroed, then writes it), no separate bias pass and
/// no second buffer. gemm runs on candle's CPU matmul threads, as `matmul` would.
///
/// # Errors
///
/// A slice length that does not match the shapes.
pub(crate) fn linear_bias(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    rows: usize,
    inner: usize,
) -> CResult<Vec<f32>> {
    let out = b.len();
    if Some(x.len()) != rows.checked_mul(inner) || Some(w.len()) != out.checked_mul(inner) {
        return Err(Error::msg(format!(
            "linear (CPU): x of {} elements for [{rows}, {inner}], w of {} for [{out}, {inner}]",
            x.len(),
            w.len()
        )));
    }
    let mut y = Vec::with_capacity(rows * out);
    for _ in 0..rows {
        y.extend_from_slice(b);
    }
    if y.is_empty() || inner == 0 {
        // No product to add (an empty sum is the bias alone).
        return Ok(y);
    }
    let threads = if plain() {
        1
    } else {
        candle_core::utils::get_num_threads()
    };
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // Strides fit isize: each buffer is a live allocation of at most isize::MAX bytes.
    let (inner_s, out_s) = (inner as isize, out as isize);
    // SAFETY: `y` is `rows x out` initialized elements (the bias rows above), row stride `out`,
    // read and written; `x` is `rows x inner` elements, row stride `inner`; `w` read as its
    // transpose, `inner x out` with column stride `inner` and row stride 1, is its `out x inner`
    // elements (lengths checked above). `y` is a fresh buffer, so it aliases neither input.
    unsafe {
        gemm::gemm(
            rows,
            out,
            inner,
            y.as_mut_ptr(),
            1,
            out_s,
            true,
            x.as_ptr(),
            1,
            inner_s,
            w.as_ptr(),
            inner_s,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(y)
}

/// `x + b` for `b` one row broadcast over the rows of `x` (nothing when `b` is empty).
#[inline(always)]
pub(crate) fn add_rows(x: &[f32], b: &[f32]) -> Vec<f32> {
    let n = b.len();
    if n == 0 {
        return Vec::new();
    }
    let rows = x.len() / n;
    let mut y = vec![0f32; rows * n];
    par_rows(x, n, &mut y, n, |_, xb, yb| {
        for (yr, xr) in yb.chunks_exact_mut(n).zip(xb.chunks_exact(n)) {
            for ((o, &a), &c) in yr.iter_mut().zip(xr).zip(b) {
                *o = a + c;
            }
        }
    });
    y
}

fn last_dim(shape: &Shape, op: &str) -> CResult<usize> {
    shape
        .dims()
        .last()
        .copied()
        .ok_or_else(|| Error::msg(format!("{op}: needs at least one dim")))
}

/// A fused kernel over one contiguous f32 CPU tensor; [`Fused1`] makes it a graph node, doing
/// the storage plumbing (dtype and layout checks, the output storage) once for all of them.
trait UnaryKernel: Send + Sync + 'static {
    /// The graph node's name.
    const NODE: &'static str;
    /// The op's name in error messages.
    const OP: &'static str;
    /// The output and its shape for the elements `x` of an input of `shape` (loops in
    /// [`par_rows`] blocks, so in [`simd`]).
    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)>;
    /// The gradient of the input `arg`, given the output `res` and its gradient `g`.
    fn backward(&self, arg: &Tensor, res: &Tensor, g: &Tensor) -> CResult<Tensor>;
    /// The forward on a CUDA device (`crate::cuda`); none by default.
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        Err(crate::error::KernelError::UnsupportedDType {
            op: Self::OP,
            device: "CUDA",
            dtype: candle_core::backend::BackendStorage::dtype(s),
            supported: "nothing (a CPU-only kernel)",
            shape: l.dims().to_vec(),
        }
        .into())
    }
}

/// The graph node of a [`UnaryKernel`].
struct Fused1<K>(K);

impl<K: UnaryKernel> CustomOp1 for Fused1<K> {
    fn name(&self) -> &'static str {
        K::NODE
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, K::OP)?;
        let (y, shape) = self.0.forward(x, l.shape())?;
        Ok((CpuStorage::F32(y), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        self.0.cuda_forward(s, l)
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        self.0.backward(arg, res, g).map(Some)
    }
}

/// `k` applied to `x` (made contiguous) as one graph node.
fn apply1<K: UnaryKernel>(x: &Tensor, k: K) -> CResult<Tensor> {
    x.contiguous()?.apply_op1(Fused1(k))
}

/// The gradient of a last-dim row kernel from its output `res` and the output gradient `g`:
/// `f(res_row, g_row, dx_row)` on each row, as a tensor like `arg`.
fn grad_from_output(
    arg: &Tensor,
    res: &Tensor,
    g: &Tensor,
    op: &str,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
) -> CResult<Tensor> {
    let n = last_dim(res.shape(), op)?;
    let g = g.contiguous()?;
    let dx = with_f32(res, |y| with_f32(&g, |g| map_rows2(y, g, n, f)))??;
    from_vec(dx, arg.shape(), arg)
}

/// The gradient of a last-dim row kernel from its input `arg` alone: `f(x_row, dx_row, item)`
/// on each row `r` for which `item(r)` gives one (the others stay zero), as a tensor like
/// `arg`.
fn grad_from_input<E>(
    arg: &Tensor,
    op: &str,
    item: impl Fn(usize) -> Option<E> + Sync,
    f: impl Fn(&[f32], &mut [f32], E) + Sync,
) -> CResult<Tensor> {
    let c = last_dim(arg.shape(), op)?;
    let dx = with_f32(arg, |x| {
        map_rows(x, c, |r, xr, dr| {
            if let Some(e) = item(r) {
                f(xr, dr, e)
            }
        })
    })?;
    from_vec(dx, arg.shape(), arg)
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_A: f32 = 0.044_715;

/// GELU, tanh form (as candle's `gelu` and GPT-2).
struct Gelu;

impl UnaryKernel for Gelu {
    const NODE: &'static str = "fused-gelu";
    const OP: &'static str = "gelu";

    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)> {
        // A plain loop into a zeroed buffer: `collect` would run in a function of its own,
        // outside `simd`'s target features.
        let mut y = vec![0f32; x.len()];
        par_rows(x, 1, &mut y, 1, |_, xb, yb| {
            for (o, &v) in yb.iter_mut().zip(xb) {
                *o = 0.5 * v * (1.0 + fast_tanh(GELU_C * (v + GELU_A * v * v * v)));
            }
        });
        Ok((y, shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::gelu_fwd(s, l)
    }

    fn backward(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(arg) {
            return crate::cuda::gelu_backward(arg, g);
        }
        let g = g.contiguous()?;
        let dx = with_f32(arg, |x| {
            with_f32(&g, |g| {
                let n = x.len().min(g.len());
                let mut dx = vec![0f32; x.len()];
                par_rows2(&x[..n], &g[..n], 1, &mut dx, 1, |_, xb, gb, ob| {
                    for ((o, &v), &gv) in ob.iter_mut().zip(xb).zip(gb) {
                        let t = fast_tanh(GELU_C * (v + GELU_A * v * v * v));
                        let d = 0.5 * (1.0 + t)
                            + 0.5 * v * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * v * v);
                        *o = gv * d;
                    }
                });
                dx
            })
        })??;
        from_vec(dx, arg.shape(), arg)
    }
}

/// GELU (tanh form) with a fused kernel where [`device_applies`], candle's otherwise. A bf16
/// CPU tensor takes the f32 kernel between two casts: f32 arithmetic and one rounding to bf16,
/// forward and backward, as the CUDA kernel computes bf16 (candle's bf16 backward is a chain of
/// bf16 ops, each rounding), so a bf16 policy's GELU gives the CPU what it gives the GPU.
pub fn gelu(x: &Tensor) -> CResult<Tensor> {
    if device_applies(x) {
        apply1(x, Gelu)
    } else if x.dtype() == DType::BF16 && x.device().is_cpu() {
        apply1(&x.to_dtype(DType::F32)?, Gelu)?.to_dtype(DType::BF16)
    } else {
        x.gelu()
    }
}

/// Whether [`gelu_storage`] and [`gelu_grad`] take `dtype` on `device`: f32 and bf16 on the
/// CPU (bf16 through the f32 kernel, as [`gelu`]), or on CUDA with the fused path on.
pub(crate) fn gelu_fuses(dtype: DType, device: &candle_core::Device) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
        && (device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda() && cuda_enabled()))
}

/// [`gelu`] of `x` (where [`gelu_fuses`]) as a fresh storage of backend `S`: a graph node's
/// output computed in its forward (no copy of a finished tensor), the same bits as [`gelu`]
/// gives.
pub(crate) fn gelu_storage<S: crate::storage::DeviceStorage>(x: &Tensor) -> CResult<(S, Shape)> {
    let x = x.contiguous()?;
    let shape = x.shape().clone();
    let storage = if on_cuda(&x) {
        #[cfg(feature = "cuda")]
        {
            let (st, l) = x.storage_and_layout();
            let candle_core::Storage::Cuda(cs) = &*st else {
                return Err(Error::msg("gelu: a CUDA tensor without CUDA storage"));
            };
            candle_core::Storage::Cuda(crate::cuda::gelu_fwd(cs, l)?.0)
        }
        #[cfg(not(feature = "cuda"))]
        return Err(Error::msg("gelu: a CUDA tensor in a build without `cuda`"));
    } else {
        let x32 = x.to_dtype(DType::F32)?;
        let (y, _) = with_f32(&x32, |v| Gelu.forward(v, &shape))??;
        match x.dtype() {
            DType::F32 => candle_core::Storage::Cpu(CpuStorage::F32(y)),
            DType::BF16 => candle_core::Storage::Cpu(CpuStorage::BF16(
                y.into_iter().map(half::bf16::from_f32).collect(),
            )),
            other => {
                return Err(crate::error::KernelError::UnsupportedDType {
                    op: "gelu",
                    device: "CPU",
                    dtype: other,
                    supported: "f32 or bf16",
                    shape: shape.dims().to_vec(),
                }
                .into())
            }
        }
    };
    let s = S::take(storage).ok_or_else(|| Error::msg("gelu: the output's backend differs"))?;
    Ok((s, shape))
}

/// The GELU gradient `g * gelu'(x)` (where [`gelu_fuses`]): what [`gelu`]'s backward gives for
/// input `x` and output gradient `g` (bf16 on the CPU in f32, rounded once).
pub(crate) fn gelu_grad(x: &Tensor, g: &Tensor) -> CResult<Tensor> {
    // `Gelu::backward` is the fused node's own (the CUDA kernel on CUDA, the f32 loop on the
    // CPU); a bf16 CPU input goes through f32 as `gelu`'s casts around the node do.
    if x.dtype() == DType::BF16 && !on_cuda(x) {
        let x32 = x.to_dtype(DType::F32)?;
        return Gelu
            .backward(&x32, &x32, &g.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16);
    }
    Gelu.backward(x, x, g)
}

/// Softmax over the last dim with optional scale and causal mask (`[.., T, S]`: position
/// `(i, j)` is masked when `j > i + S - T`).
struct Softmax {
    scale: f32,
    causal: bool,
}

impl Softmax {
    fn rows_t(&self, shape: &Shape) -> usize {
        let d = shape.dims();
        if d.len() >= 2 {
            d[d.len() - 2]
        } else {
            1
        }
    }
}

/// `softmax(scale * x)` of one row, in place (`-inf`-safe: the maximum is subtracted first).
/// The one copy of this arithmetic: the softmax row kernel and the CPU attention kernel
/// (`fused::attention`) both call it, so their bits agree.
#[inline(always)]
fn softmax_row_in_place(row: &mut [f32], scale: f32) {
    let m = row_max(row) * scale;
    for v in row.iter_mut() {
        *v = fast_exp(*v * scale - m);
    }
    let sum: f32 = row.iter().sum();
    let inv = 1.0 / sum;
    for v in row {
        *v *= inv;
    }
}

/// The softmax backward of one row, in place of the output gradient:
/// `g <- scale * y * (g - <y, g>)`. The one copy of this arithmetic, as
/// [`softmax_row_in_place`] is.
#[inline(always)]
fn softmax_row_backward_in_place(yr: &[f32], g: &mut [f32], scale: f32) {
    let s: f32 = yr.iter().zip(g.iter()).map(|(a, b)| a * b).sum();
    for (d, &yv) in g.iter_mut().zip(yr) {
        *d = scale * yv * (*d - s);
    }
}

/// The softmax backward of one row: `dx = scale * y * (g - <y, g>)`.
#[inline(always)]
fn softmax_row_backward(yr: &[f32], gr: &[f32], dr: &mut [f32], scale: f32) {
    dr.copy_from_slice(gr);
    softmax_row_backward_in_place(yr, dr, scale);
}

/// The backward of `softmax(scale * x)` over the last dim from its output `y` and output
/// gradient `g` (f32 CPU): `scale * y * (g - rowsum(g * y))`, a tensor like `like`. Masked
/// entries have `y = 0` and get no gradient.
pub(crate) fn softmax_grad(y: &Tensor, g: &Tensor, scale: f32, like: &Tensor) -> CResult<Tensor> {
    grad_from_output(like, y, g, "softmax", |yr, gr, dr| {
        softmax_row_backward(yr, gr, dr, scale)
    })
}

impl UnaryKernel for Softmax {
    const NODE: &'static str = "fused-softmax";
    const OP: &'static str = "softmax";

    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)> {
        let n = last_dim(shape, Self::OP)?;
        let t = self.rows_t(shape);
        let y = map_rows(x, n, |row, xr, yr| {
            let valid = if self.causal {
                let i = row % t;
                (i + n + 1).saturating_sub(t).min(n)
            } else {
                n
            };
            if valid == 0 {
                return;
            }
            let yr = &mut yr[..valid];
            yr.copy_from_slice(&xr[..valid]);
            softmax_row_in_place(yr, self.scale);
        });
        Ok((y, shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::softmax_fwd(s, l, self.scale, self.causal, false)
    }

    fn backward(&self, arg: &Tensor, res: &Tensor, g: &Tensor) -> CResult<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(arg) {
            return crate::cuda::softmax_backward(res, g, self.scale, false);
        }
        softmax_grad(res, g, self.scale, arg)
    }
}

/// Softmax over the last dim (fused: f32 on the CPU, f32/bf16 on CUDA).
pub fn softmax_last(x: &Tensor) -> CResult<Tensor> {
    apply1(
        x,
        Softmax {
            scale: 1.0,
            causal: false,
        },
    )
}

/// `softmax(scale * x)` over the last dim with a causal mask on `[.., T, S]` (fused: f32 on
/// the CPU, f32/bf16 on CUDA).
pub fn scaled_causal_softmax(x: &Tensor, scale: f32, causal: bool) -> CResult<Tensor> {
    apply1(x, Softmax { scale, causal })
}

/// Log-softmax over the last dim.
struct LogSoftmax;

impl UnaryKernel for LogSoftmax {
    const NODE: &'static str = "fused-log-softmax";
    const OP: &'static str = "log_softmax";

    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)> {
        let n = last_dim(shape, Self::OP)?;
        let mut y = vec![0f32; x.len()];
        par_rows(x, n, &mut y, n, |_, xb, yb| {
            let mut scratch = Vec::with_capacity(n);
            for (xr, yr) in xb.chunks_exact(n).zip(yb.chunks_exact_mut(n)) {
                let m = row_max(xr);
                let lse = m + sum_exp(xr, m, &mut scratch).ln();
                for (o, &v) in yr.iter_mut().zip(xr) {
                    *o = v - lse;
                }
            }
        });
        Ok((y, shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::softmax_fwd(s, l, 1.0, false, true)
    }

    fn backward(&self, arg: &Tensor, res: &Tensor, g: &Tensor) -> CResult<Tensor> {
        #[cfg(feature = "cuda")]
        if on_cuda(arg) {
            return crate::cuda::softmax_backward(res, g, 1.0, true);
        }
        grad_from_output(arg, res, g, Self::OP, |yr, gr, dr| {
            let s: f32 = gr.iter().sum();
            for ((d, &yv), &gv) in dr.iter_mut().zip(yr).zip(gr) {
                *d = gv - fast_exp(yv) * s;
            }
        })
    }
}

/// Log-softmax over the last dim (fused: f32 on the CPU, f32/bf16 on CUDA).
pub fn log_softmax_last(x: &Tensor) -> CResult<Tensor> {
    apply1(x, LogSoftmax)
}

#[inline(always)]
fn row_stats(xr: &[f32], eps: f32, center: bool) -> (f32, f32) {
    let n = xr.len() as f32;
    let mean = if center {
        xr.iter().sum::<f32>() / n
    } else {
        0.0
    };
    let var = xr.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Layer norm (`center`) or RMS norm (no centering) over the last dim, with weight and bias.
struct Norm {
    eps: f32,
    center: bool,
}

impl Norm {
    #[inline(always)]
    fn forward(&self, x: &[f32], w: &[f32], b: Option<&[f32]>, n: usize) -> Vec<f32> {
        map_rows(x, n, |_, xr, yr| {
            let (mean, rstd) = row_stats(xr, self.eps, self.center);
            match b {
                Some(b) => {
                    for (((o, &v), &wv), &bv) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                        *o = (v - mean) * rstd * wv + bv;
                    }
                }
                None => {
                    for ((o, &v), &wv) in yr.iter_mut().zip(xr).zip(w) {
                        *o = (v - mean) * rstd * wv;
                    }
                }
            }
        })
    }

    /// (dx, dw, db) for x, w and the output gradient g.
    #[inline(always)]
    fn backward(
        &self,
        x: &[f32],
        w: &[f32],
        g: &[f32],
        n: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut dw = vec![0f32; n];
        let mut db = vec![0f32; n];
        let mut dx = vec![0f32; x.len()];
        if n == 0 {
            return (dx, dw, db);
        }
        let inv_n = 1.0 / n as f32;
        let rows = (x.len() / n).min(g.len() / n);
        let (x, g) = (&x[..rows * n], &g[..rows * n]);
        // Per row (blocks of rows in parallel): x̂, kept for the weight gradients, and dx.
        let mut xhat = vec![0f32; rows * n];
        let body = |xb: &[f32], gb: &[f32], db_: &mut [f32], hb: &mut [f32]| {
            simd(|| {
                let rows = xb.chunks_exact(n).zip(gb.chunks_exact(n));
                for ((xr, gr), (dr, hr)) in
                    rows.zip(db_.chunks_exact_mut(n).zip(hb.chunks_exact_mut(n)))
                {
                    let (mean, rstd) = row_stats(xr, self.eps, self.center);
                    for (h, &v) in hr.iter_mut().zip(xr) {
                        *h = (v - mean) * rstd;
                    }
                    // The two sums in order.
                    let mut a = 0f32;
                    let mut c = 0f32;
                    for i in 0..n {
                        let gw = gr[i] * w[i];
                        a += gw;
                        c += gw * hr[i];
                    }
                    let (a, c) = (a * inv_n, c * inv_n);
                    for i in 0..n {
                        let gw = gr[i] * w[i];
                        dr[i] = if self.center {
                            rstd * (gw - a - hr[i] * c)
                        } else {
                            rstd * (gw - hr[i] * c)
                        };
                    }
                }
            })
        };
        let block = (PAR_GRAIN / n).max(1) * n;
        let dxr = &mut dx[..rows * n];
        if plain() || rows * n <= block || rayon::current_num_threads() == 1 {
            body(x, g, dxr, &mut xhat);
        } else {
            use rayon::prelude::*;
            dxr.par_chunks_mut(block)
                .zip(xhat.par_chunks_mut(block))
                .zip(x.par_chunks(block).zip(g.par_chunks(block)))
                .for_each(|((d, h), (xb, gb))| body(xb, gb, d, h));
        }
        // The weight and bias gradients: the rows in order, each row's elements vectorized.
        simd(|| {
            for (hr, gr) in xhat.chunks_exact(n).zip(g.chunks_exact(n)) {
                for i in 0..n {
                    dw[i] += gr[i] * hr[i];
                    db[i] += gr[i];
                }
            }
        });
        (dx, dw, db)
    }

    /// The node's forward on the CPU operands `x`, `w` and, when given, `b` (storage, layout).
    fn cpu_fwd(
        &self,
        (xs, xl): (&CpuStorage, &Layout),
        (ws, wl): (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl, "norm")?, f32_slice(ws, wl, "norm")?);
        let b = b.map(|(bs, bl)| f32_slice(bs, bl, "norm")).transpose()?;
        let n = last_dim(xl.shape(), "norm")?;
        match b {
            None if w.len() != n => {
                return Err(Error::msg(format!(
                    "norm: weight has {} elements for a last dim of {n}",
                    w.len()
                )))
            }
            Some(b) if w.len() != n || b.len() != n => {
                return Err(Error::msg(format!(
                    "norm: weight/bias have {}/{} elements for a last dim of {n}",
                    w.len(),
                    b.len()
                )))
            }
            _ => {}
        }
        Ok((
            CpuStorage::F32(self.forward(x, w, b, n)),
            xl.shape().clone(),
        ))
    }

    /// The node's backward: `dx` and `dw` as tensors like `x` and `w`, and `db` (used by the
    /// node with a bias).
    fn grads(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> CResult<(Tensor, Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if on_cuda(x) {
            return crate::cuda::norm_backward(x, w, g, self.eps, self.center);
        }
        let n = last_dim(x.shape(), "norm")?;
        let g = g.contiguous()?;
        let (dx, dw, db) = with_f32(x, |xs| {
            with_f32(w, |ws| with_f32(&g, |gs| self.backward(xs, ws, gs, n)))
        })???;
        Ok((
            from_vec(dx, x.shape(), x)?,
            from_vec(dw, w.shape(), w)?,
            from_vec(db, w.shape(), w)?,
        ))
    }
}

struct NormAffine(Norm);
struct NormAffineBias(Norm);

impl CustomOp2 for NormAffine {
    fn name(&self) -> &'static str {
        "fused-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.0.cpu_fwd((s1, l1), (s2, l2), None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::norm_fwd(s1, l1, s2, l2, None, self.0.eps, self.0.center)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.0.grads(x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for NormAffineBias {
    fn name(&self) -> &'static str {
        "fused-norm-bias"
    }

    #[allow(clippy::too_many_arguments)]
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.0.cpu_fwd((s1, l1), (s2, l2), Some((s3, l3)))
    }

    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::norm_fwd(s1, l1, s2, l2, Some((s3, l3)), self.0.eps, self.0.center)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.0.grads(x, w, g)?;
        Ok((Some(dx), Some(dw), Some(db.reshape(b.shape())?)))
    }
}

/// Layer norm over the last dim with a weight (`w`/`b` of the last dim's size; fused: f32 on
/// the CPU, f32/bf16 on CUDA with `w`, `b` of `x`'s dtype).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> CResult<Tensor> {
    let norm = Norm {
        eps: eps as f32,
        center: true,
    };
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, NormAffineBias(norm)),
        None => x.apply_op2(&w, NormAffine(norm)),
    }
}

/// RMS norm over the last dim (fused: f32 on the CPU, f32/bf16 on CUDA).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    let norm = Norm {
        eps: eps as f32,
        center: false,
    };
    x.contiguous()?
        .apply_op2(&w.contiguous()?, NormAffine(norm))
}

/// Checks that the logits `x` of `shape` are `[rows, C]` with C > 0 and at least `min_rows`
/// rows, for a kernel given one `per_row` item a row; returns C.
fn logit_rows(
    x: &[f32],
    shape: &Shape,
    (rows, min_rows): (usize, usize),
    op: &str,
    per_row: &str,
) -> CResult<usize> {
    let c = last_dim(shape, op)?;
    if c == 0 || rows < min_rows || x.len() != rows * c {
        return Err(Error::msg(format!("{op}: logits/{per_row} shape mismatch")));
    }
    Ok(c)
}

/// The elements of `t` (any dtype and layout) as f32 on the host, in row-major order: the
/// per-row operands and gradients of the row-reducing kernels.
fn host_f32(t: &Tensor) -> CResult<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// Mean cross-entropy of logits `[N, C]` against class ids (one per row), as one node:
/// forward `mean(lse_i - x[i, t_i])`, backward `g / N * (softmax(x) - onehot(t))`.
struct CrossEntropy {
    targets: Vec<u32>,
}

impl UnaryKernel for CrossEntropy {
    const NODE: &'static str = "fused-cross-entropy";
    const OP: &'static str = "cross_entropy";

    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)> {
        let rows = self.targets.len();
        let c = logit_rows(x, shape, (rows, 1), Self::OP, "targets")?;
        if let Some(t) = self.targets.iter().find(|&&t| t as usize >= c) {
            return Err(Error::msg(format!(
                "cross_entropy: class id {t} >= {c} classes"
            )));
        }
        // Each row's loss (rows in parallel), then their sum in row order.
        let mut per_row = vec![0f32; rows];
        par_rows(x, c, &mut per_row, 1, |first, xb, lb| {
            let mut scratch = Vec::with_capacity(c);
            for (i, (xr, l)) in xb.chunks_exact(c).zip(lb.iter_mut()).enumerate() {
                let m = row_max(xr);
                let picked = xr[self.targets[first + i] as usize];
                *l = m + sum_exp(xr, m, &mut scratch).ln() - picked;
            }
        });
        let total: f64 = per_row
            .iter()
            .map(|&l| f64::from(l))
            .fold(0.0, |a, b| a + b);
        Ok((vec![(total / rows as f64) as f32], Shape::from(())))
    }

    fn backward(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<Tensor> {
        let scale = g.to_dtype(DType::F32)?.to_scalar::<f32>()? / self.targets.len() as f32;
        grad_from_input(
            arg,
            Self::OP,
            |r| self.targets.get(r),
            |xr, dr, &t| {
                let m = row_max(xr);
                for (d, &v) in dr.iter_mut().zip(xr) {
                    *d = fast_exp(v - m);
                }
                let inv = scale / dr.iter().sum::<f32>();
                for d in dr.iter_mut() {
                    *d *= inv;
                }
                if let Some(d) = dr.get_mut(t as usize) {
                    *d -= scale;
                }
            },
        )
    }
}

/// Mean cross-entropy of logits `[N, C]` (N, C > 0; or `[.., C]`, the leading dims the rows)
/// against integer targets, one per row in any shape, in the logits' dtype. On the CPU (f32) one graph node (see `CrossEntropy`); on CUDA (f32/bf16, see
/// [`device_applies`]) the mean of [`cross_entropy_rows`] (f32 per row and summed in f32, then
/// cast, as the composition's result has the logits' dtype), with no host read of the targets
/// or the loss.
pub fn cross_entropy(x: &Tensor, targets: &Tensor) -> CResult<Tensor> {
    if on_cuda(x) {
        let n = x.elem_count() / last_dim(x.shape(), "cross_entropy")?.max(1);
        return cross_entropy_rows(x, targets, None)?
            .sum_all()?
            .affine(1.0 / n.max(1) as f64, 0.0)?
            .to_dtype(x.dtype());
    }
    let targets = targets
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_vec1::<u32>()?;
    apply1(x, CrossEntropy { targets })
}

/// This rank's share of the mean cross-entropy over `global_rows` rows: the fused node's mean
/// over its own rows of logits `[.., C]` (any leading dims: no reshape node before the node)
/// against `targets` (one class id per row, any shape), times `rows / global_rows`, so that
/// the ranks' shares sum to the global mean. bf16 logits give their f32 per-row losses' f32
/// mean ([`cross_entropy_rows`]); f32 logits [`cross_entropy`]. Where
/// [`cross_entropy_applies`], for logits with rows and classes.
///
/// # Errors
///
/// As [`cross_entropy_rows`].
pub fn cross_entropy_share(x: &Tensor, targets: &Tensor, global_rows: usize) -> CResult<Tensor> {
    let c = last_dim(x.shape(), "cross_entropy")?;
    let n = x.elem_count() / c.max(1);
    let mean = if matches!(x.dtype(), DType::BF16 | DType::F16) {
        cross_entropy_rows(x, targets, None)?
            .sum_all()?
            .affine(1.0 / n as f64, 0.0)?
    } else {
        cross_entropy(x, targets)?
    };
    if n == global_rows {
        Ok(mean)
    } else {
        mean.affine(n as f64 / global_rows as f64, 0.0)
    }
}

/// Softmax cross-entropy of each row of logits `[N, C]` against its class id, as one node with
/// two outputs per row, `[N, 2]` f32 `(loss, lse)`: `lse = log sum_j exp(x_j)` and
/// `loss = lse - x[target]`. The backward writes `g * (exp(x - lse) - onehot(target))`
/// straight into the logits' gradient (one pass, no softmax or one-hot of the logits' size
/// kept), from the saved `lse`. A row whose target is the ignore index has loss 0 and no
/// gradient. CPU: f32 logits, u32/i64 targets, an out-of-range target is an error; CUDA
/// (`crate::cuda`): f32/bf16 logits, f32 arithmetic, and an out-of-range target gives that
/// row a NaN loss and gradient (checking would read the targets on the host).
struct CrossEntropyRows {
    ignore: Option<i64>,
}

/// The class of row `i` for [`CrossEntropyRows`]: `Ok(None)` when ignored.
fn ce_class(t: i64, ignore: Option<i64>, c: usize) -> CResult<Option<usize>> {
    if ignore == Some(t) {
        return Ok(None);
    }
    match usize::try_from(t) {
        Ok(k) if k < c => Ok(Some(k)),
        _ => Err(crate::error::KernelError::Mismatch {
            op: "cross_entropy",
            detail: format!("class id {t} outside 0..{c}"),
        }
        .into()),
    }
}

/// The class ids of a contiguous CPU targets operand (u32 or i64) as i64.
fn ce_targets(s: &CpuStorage, l: &Layout) -> CResult<Vec<i64>> {
    let (a, b) =
        l.contiguous_offsets()
            .ok_or_else(|| crate::error::KernelError::NotContiguous {
                op: "cross_entropy",
                operand: "targets",
                shape: l.dims().to_vec(),
            })?;
    let outside = || Error::msg("cross_entropy: the targets' view lies outside its storage");
    match s {
        CpuStorage::U32(v) => Ok(v
            .get(a..b)
            .ok_or_else(outside)?
            .iter()
            .map(|&t| i64::from(t))
            .collect()),
        CpuStorage::I64(v) => Ok(v.get(a..b).ok_or_else(outside)?.to_vec()),
        other => Err(crate::error::KernelError::UnsupportedDType {
            op: "cross_entropy",
            device: "CPU",
            dtype: candle_core::backend::BackendStorage::dtype(other),
            supported: "u32 or i64 targets",
            shape: l.dims().to_vec(),
        }
        .into()),
    }
}

impl CustomOp2 for CrossEntropyRows {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-rows"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = f32_slice(xs, xl, "cross_entropy")?;
        let targets = ce_targets(ts, tl)?;
        let rows = targets.len();
        let c = logit_rows(x, xl.shape(), (rows, 0), "cross_entropy", "targets")?;
        let classes = targets
            .iter()
            .map(|&t| ce_class(t, self.ignore, c))
            .collect::<CResult<Vec<_>>>()?;
        let mut out = vec![0f32; 2 * rows];
        par_rows(x, c, &mut out, 2, |first, xb, ob| {
            let mut scratch = Vec::with_capacity(c);
            for (i, (xr, o)) in xb.chunks_exact(c).zip(ob.chunks_exact_mut(2)).enumerate() {
                let m = row_max(xr);
                let lse = m + sum_exp(xr, m, &mut scratch).ln();
                o[0] = match classes[first + i] {
                    Some(k) => lse - xr[k],
                    None => 0.0,
                };
                o[1] = lse;
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((rows, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::xent_fwd(xs, xl, ts, tl, self.ignore)
    }

    fn bwd(
        &self,
        x: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        // Per row (lse, upstream gradient of the loss): [N, 2], small.
        let lg = Tensor::cat(
            &[
                res.narrow(1, 1, 1)?,
                g.to_dtype(DType::F32)?.narrow(1, 0, 1)?,
            ],
            1,
        )?;
        #[cfg(feature = "cuda")]
        if on_cuda(x) {
            let dx = crate::cuda::xent_backward(x, targets, &lg, self.ignore)?;
            return Ok((Some(dx), None));
        }
        let c = last_dim(x.shape(), "cross_entropy")?;
        let lg = lg.flatten_all()?.to_vec1::<f32>()?;
        let targets = targets
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1::<i64>()?;
        let classes = targets
            .iter()
            .map(|&t| ce_class(t, self.ignore, c))
            .collect::<CResult<Vec<_>>>()?;
        let dx = grad_from_input(
            x,
            "cross_entropy",
            |r| Some((classes.get(r)?, lg.get(2 * r..2 * r + 2)?)),
            |xr, dr, (&k, lg)| {
                let Some(k) = k else { return };
                let (lse, gv) = (lg[0], lg[1]);
                for (d, &v) in dr.iter_mut().zip(xr) {
                    *d = gv * fast_exp(v - lse);
                }
                dr[k] -= gv;
            },
        )?;
        Ok((Some(dx), None))
    }
}

/// Whether [`cross_entropy_rows`] (and [`cross_entropy`]'s fused path) takes logits `x`: f32 on
/// the CPU, f32/bf16 on CUDA with the `cuda` feature (see [`device_applies`]).
pub fn cross_entropy_applies(x: &Tensor) -> bool {
    device_applies(x)
}

/// Per-row softmax cross-entropy `[N]` (f32) of logits `[N, C]` (C > 0; or `[.., C]`, its
/// leading dims the N rows, with no reshape node before the node) against integer class ids,
/// one per row in any shape (u32 or i64 as they are, other integer types converted to i64),
/// as one fused node
/// (see `CrossEntropyRows`); rows whose target equals `ignore_index` have loss 0 and no
/// gradient. The mean over rows (or over the rows not ignored) is the caller's: the per-row
/// form is what a sharded batch or a token mask needs.
///
/// Logits the fused node does not take ([`cross_entropy_applies`] false) are refused with a
/// typed error naming the dtype and device; the composition `log_softmax` + `gather` is the
/// fallback for those.
pub fn cross_entropy_rows(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: Option<i64>,
) -> CResult<Tensor> {
    let op = "cross_entropy";
    let dims = logits.dims();
    let c = *dims.last().unwrap_or(&0);
    if dims.len() < 2 || c == 0 {
        return Err(crate::error::KernelError::Mismatch {
            op,
            detail: format!(
                "logits {:?} have no classes or no rows: [N, C] or [.., C], C > 0",
                logits.dims()
            ),
        }
        .into());
    }
    let n = logits.elem_count() / c;
    if targets.elem_count() != n {
        return Err(crate::error::KernelError::Mismatch {
            op,
            detail: format!(
                "targets of shape {:?} for logits {:?}",
                targets.dims(),
                logits.dims()
            ),
        }
        .into());
    }
    if !cross_entropy_applies(logits) {
        return Err(crate::error::KernelError::UnsupportedDType {
            op,
            device: if logits.device().is_cpu() {
                "CPU"
            } else {
                "non-CPU"
            },
            dtype: logits.dtype(),
            supported: "f32 on the CPU, f32 or bf16 on CUDA",
            shape: logits.dims().to_vec(),
        }
        .into());
    }
    let t = targets.flatten_all()?;
    let t = match t.dtype() {
        DType::U32 | DType::I64 => t.contiguous()?,
        _ => crate::storage::ids_as(op, &t, DType::I64)?,
    };
    logits
        .contiguous()?
        .apply_op2(
            &t,
            CrossEntropyRows {
                ignore: ignore_index,
            },
        )?
        .narrow(1, 0, 1)?
        .squeeze(1)
}

/// `sum_j exp(x[i, j] - m[i])` of f32 logits `[N, C]` with a detached row shift `m [N, 1]`, as
/// one node (`[N, 1]`; backward `g[i] * exp(x[i, j] - m[i])`): the local part of a
/// class-sharded (loss-parallel) log-sum-exp.
struct SumExpShifted {
    m: Vec<f32>,
}

impl UnaryKernel for SumExpShifted {
    const NODE: &'static str = "fused-sum-exp";
    const OP: &'static str = "sum_exp";

    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)> {
        let rows = self.m.len();
        let c = logit_rows(x, shape, (rows, 0), Self::OP, "shift")?;
        let mut y = vec![0f32; rows];
        par_rows(x, c, &mut y, 1, |first, xb, yb| {
            let mut scratch = Vec::with_capacity(c);
            for (i, (o, xr)) in yb.iter_mut().zip(xb.chunks_exact(c)).enumerate() {
                *o = sum_exp(xr, self.m[first + i], &mut scratch);
            }
        });
        Ok((y, Shape::from((rows, 1))))
    }

    fn backward(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<Tensor> {
        let g = host_f32(g)?;
        let item = |r: usize| Some((self.m.get(r)?, g.get(r)?));
        grad_from_input(arg, Self::OP, item, |xr, dr, (&m, &gv)| {
            for (d, &v) in dr.iter_mut().zip(xr) {
                *d = gv * fast_exp(v - m);
            }
        })
    }
}

/// See `SumExpShifted`; `x` f32 `[N, C]` with C > 0, `m` `[N, 1]` (not differentiated).
pub fn sum_exp_shifted(x: &Tensor, m: &Tensor) -> CResult<Tensor> {
    let m = host_f32(m)?;
    apply1(x, SumExpShifted { m })
}

/// `x[i, ids[i]] * inside[i]` of f32 `[N, C]` as one node (`[N, 1]`): the target logit where this
/// rank owns the target's class, 0 elsewhere. Backward scatters `g` to those positions.
struct PickMasked {
    ids: Vec<u32>,
    inside: Vec<bool>,
}

impl UnaryKernel for PickMasked {
    const NODE: &'static str = "fused-pick";
    const OP: &'static str = "pick";

    fn forward(&self, x: &[f32], shape: &Shape) -> CResult<(Vec<f32>, Shape)> {
        let rows = self.ids.len();
        let c = logit_rows(x, shape, (rows, 0), Self::OP, "ids")?;
        let mut y = vec![0f32; rows];
        for (i, (&id, &inside)) in self.ids.iter().zip(&self.inside).enumerate() {
            if inside {
                y[i] = *x
                    .get(i * c + id as usize)
                    .filter(|_| (id as usize) < c)
                    .ok_or_else(|| Error::msg(format!("pick: local class id {id} >= {c}")))?;
            }
        }
        Ok((y, Shape::from((rows, 1))))
    }

    fn backward(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<Tensor> {
        let c = last_dim(arg.shape(), Self::OP)?;
        let g = host_f32(g)?;
        let mut dx = vec![0f32; arg.elem_count()];
        for (i, ((&id, &inside), &gv)) in self.ids.iter().zip(&self.inside).zip(&g).enumerate() {
            if inside && (id as usize) < c {
                dx[i * c + id as usize] = gv;
            }
        }
        from_vec(dx, arg.shape(), arg)
    }
}

/// See `PickMasked`: `x` f32 `[N, C]` with C > 0, `ids` local class ids `[N]` (u32), `inside`
/// `[N]` (nonzero where this rank owns the target).
pub fn pick_masked(x: &Tensor, ids: &Tensor, inside: &Tensor) -> CResult<Tensor> {
    let ids = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
    let inside = host_f32(inside)?.into_iter().map(|v| v != 0.0).collect();
    apply1(x, PickMasked { ids, inside })
}

/// Sums the rows of a tensor viewed as `[rows, n]`: the gradient of a bias broadcast over
/// leading dims. On the CPU (f32) candle's `sum(0)` walks that layout with a strided index
/// (several ns per element); this adds whole rows, which vectorizes. Rows are added in order,
/// as candle does. On CUDA (f32, bf16) the column-sum kernels (`cuda/reduce.cu`: a warp's
/// threads on adjacent columns, so every load is coalesced, where candle's reduction walks each
/// column at a stride of n; f32 partials of 256 rows added in order, deterministic), up to
/// 65,535 partials (16.7M rows; candle's sum beyond).
pub fn row_sum(g: &Tensor, n: usize) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    if col_sum_fits(g, n) {
        return crate::cuda::col_sum(g, n);
    }
    if !applies(g) || n == 0 || g.elem_count() % n != 0 {
        return g.reshape(((), n))?.sum(0);
    }
    let g = g.contiguous()?;
    let acc = with_f32(&g, |gv| {
        simd(|| {
            let mut acc = vec![0f32; n];
            for row in gv.chunks_exact(n) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
            acc
        })
    })?;
    Tensor::from_vec(acc, n, g.device())
}

/// Whether the CUDA column sum takes `g` viewed as `[rows, n]`.
#[cfg(feature = "cuda")]
fn col_sum_fits(g: &Tensor, n: usize) -> bool {
    g.device().is_cuda()
        && cuda_enabled()
        && matches!(g.dtype(), DType::F32 | DType::BF16)
        && n > 0
        && g.elem_count() % n == 0
        && (g.elem_count() / n).div_ceil(COL_SUM_ROWS) <= 65_535
}

/// [`row_sum`] with the sums in `dtype`: the f32 bias gradient of a bf16 output gradient, with
/// no rounding of the sums to bf16. On CUDA the column-sum kernels read the bf16 rows and keep
/// their f32 sums (no cast pass over `g`); elsewhere `g` is cast first.
pub fn row_sum_as(g: &Tensor, n: usize, dtype: DType) -> CResult<Tensor> {
    if g.dtype() == dtype {
        return row_sum(g, n);
    }
    #[cfg(feature = "cuda")]
    if col_sum_fits(g, n) && g.dtype() == DType::BF16 && dtype == DType::F32 {
        return crate::cuda::col_sum_as(g, n, dtype);
    }
    row_sum(&g.to_dtype(dtype)?, n)
}

/// `x + b` where `b`'s shape is a suffix of `x`'s (a bias or a position table broadcast over
/// leading dims), as one node: forward is one pass, backward passes `g` through to `x` and
/// row-sums it for `b` (see [`row_sum`]).
struct AddRows;

impl CustomOp2 for AddRows {
    fn name(&self) -> &'static str {
        "fused-add-rows"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = f32_slice(xs, xl, "add_rows")?;
        let b = f32_slice(bs, bl, "add_rows")?;
        Ok((CpuStorage::F32(add_rows(x, b)), xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let db = row_sum(g, b.elem_count())?.reshape(b.shape())?;
        Ok((Some(g.clone()), Some(db)))
    }
}

/// `x + b` with numpy broadcasting; when one side's shape is a proper suffix of the other's
/// and both are f32 CPU tensors, one fused node (see `AddRows`), candle's otherwise.
pub fn add(x: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let suffix = |long: &Tensor, short: &Tensor| {
        short.rank() < long.rank()
            && short.elem_count() > 0
            && long.dims().ends_with(short.dims())
            && applies(long)
            && applies(short)
    };
    if suffix(x, b) {
        x.contiguous()?.apply_op2(&b.contiguous()?, AddRows)
    } else if suffix(b, x) {
        b.contiguous()?.apply_op2(&x.contiguous()?, AddRows)
    } else {
        x.broadcast_add(b)
    }
}

/// Threads a block of the CUDA column sum (`CS_THREADS` of `cuda/reduce.cu`).
pub const COL_SUM_THREADS: u32 = 256;
/// Rows each partial of the CUDA column sum adds (`CS_ROWS` of `cuda/reduce.cu`).
pub const COL_SUM_ROWS: usize = 256;

/// Threads a block of the CUDA embedding backward (`EMB_THREADS` of `cuda/embedding.cu`).
pub const EMBEDDING_BWD_THREADS: u32 = 256;

/// The lookup `table[ids]` as a graph node whose backward is the embedding kernel.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Embedding;

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "fused-embedding"
    }

    fn cpu_fwd(
        &self,
        t: &CpuStorage,
        tl: &Layout,
        ids: &CpuStorage,
        il: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = t.index_select(ids, tl, il, 0)?;
        Ok((out, Shape::from((il.shape().elem_count(), tl.dims()[1]))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        t: &candle_core::CudaStorage,
        tl: &Layout,
        ids: &candle_core::CudaStorage,
        il: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = t.index_select(ids, tl, il, 0)?;
        Ok((out, Shape::from((il.shape().elem_count(), tl.dims()[1]))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if table.device().is_cuda() {
            return Ok((Some(crate::cuda::embedding_grad(table, ids, g)?), None));
        }
        // The node is built on CUDA only; elsewhere candle's own backward of the lookup.
        let dt = table.zeros_like()?.index_add(ids, &g.contiguous()?, 0)?;
        Ok((Some(dt), None))
    }
}

/// `table[ids]`: rows of `table [V, D]` at the u32 `ids` (any shape), `[.., D]`. candle's
/// `index_select`; on CUDA (an f32 or bf16 table that tracks gradients) as one node whose
/// backward is the embedding kernel (`cuda/embedding.cu`: a block per position, each id's rows
/// summed in position order by its first position, no atomics) instead of candle's
/// `index_add`, whose CUDA kernel runs one thread per column of the table, each walking every
/// position in turn (768 threads for a GPT-2 step's 8192 positions).
///
/// An id of `u32::MAX` looks up a zero row and gets no gradient, as in candle's `index_select`
/// (a vocab-parallel lookup gives it to the positions another shard owns).
///
/// # Errors
///
/// As `index_select`: ids that are not u32, or out of range.
pub fn embedding(table: &Tensor, ids: &Tensor) -> CResult<Tensor> {
    let flat = ids.flatten_all()?;
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    let node = on_cuda(table)
        && cuda_enabled()
        && matches!(table.dtype(), DType::F32 | DType::BF16)
        && flat.dtype() == DType::U32
        && table.rank() == 2
        && table.track_op()
        && flat.elem_count() > 0;
    if !node {
        return table.index_select(&flat, 0)?.reshape(dims);
    }
    table
        .contiguous()?
        .apply_op2(&flat.contiguous()?, Embedding)?
        .reshape(dims)
}

/// Checks the operands of the MoE combine kernels and returns `(m, d)`: `y` `[M, D]` and
/// `gates` `[N, k]` f32 on the CPU, every slot below `N * k`.
fn combine_dims(
    y: &Tensor,
    gates: &Tensor,
    slots: &[u32],
    k: usize,
    n: usize,
) -> CResult<(usize, usize)> {
    let (m, d) = y.dims2()?;
    if !applies(y) || !applies(gates) {
        return Err(Error::msg(
            "weighted_scatter_add: fused kernel takes f32 CPU tensors",
        ));
    }
    if gates.dims() != [n, k] || m != slots.len() {
        return Err(Error::msg(format!(
            "weighted_scatter_add: y {:?} for {} slots, gates {:?} for {n} tokens x top-{k}",
            y.dims(),
            slots.len(),
            gates.dims()
        )));
    }
    if let Some(&s) = slots.iter().find(|&&s| s as usize >= n * k) {
        return Err(Error::msg(format!(
            "weighted_scatter_add: slot {s} outside {n} tokens x top-{k}"
        )));
    }
    Ok((m, d))
}

/// The MoE combine in one pass: `out[slots[j] / k] += gates[slots[j]] * y[j]` for `y: [M, D]`,
/// `gates: [N, k]` (flattened, `slots[j] = token * k + slot`), returning `[N, D]` with zeros for
/// tokens no row names. Built from candle ops this is a gate gather, a broadcast multiply
/// that allocates `[M, D]`, a zero-filled `[N, D]` and `index_add`: three passes over
/// `[M, D]` and two allocations; here each output row is written once, as the gate-weighted
/// sum of its token's rows, added in `j` order from zero (as `index_add` adds them).
pub fn weighted_scatter_add(
    y: &Tensor,
    gates: &Tensor,
    slots: &[u32],
    k: usize,
    n: usize,
) -> CResult<Tensor> {
    let (m, d) = combine_dims(y, gates, slots, k, n)?;
    let (y, gates) = (y.contiguous()?, gates.contiguous()?);
    // The rows of each token, in `j` order (CSR): each output row is then written once, from
    // its rows' sum, with no zero-fill pass and no read-modify-write of the output.
    let mut start = vec![0usize; n + 1];
    for &s in slots {
        start[s as usize / k + 1] += 1;
    }
    for t in 0..n {
        start[t + 1] += start[t];
    }
    let mut fill = start.clone();
    let mut rows = vec![0usize; m];
    for (j, &s) in slots.iter().enumerate() {
        let t = s as usize / k;
        rows[fill[t]] = j;
        fill[t] += 1;
    }
    let out = with_f32(&y, |yv| {
        with_f32(&gates, |gv| {
            let mut out = Vec::with_capacity(n * d);
            let mut acc = vec![0f32; d];
            for t in 0..n {
                acc.fill(0.0);
                for &j in &rows[start[t]..start[t + 1]] {
                    let g = gv[slots[j] as usize];
                    for (a, &v) in acc.iter_mut().zip(&yv[j * d..(j + 1) * d]) {
                        *a += g * v;
                    }
                }
                out.extend_from_slice(&acc);
            }
            out
        })
    })??;
    Tensor::from_vec(out, (n, d), y.device())
}

/// The backward of [`weighted_scatter_add`] for the output gradient `grad: [N, D]`:
/// `dy[j] = gates[slots[j]] * grad[slots[j] / k]` (`[M, D]`) and
/// `dgates[slots[j]] += <grad[slots[j] / k], y[j]>` (`[N, k]`, zero for slots no row names),
/// in one pass over `y`.
pub fn weighted_scatter_add_backward(
    y: &Tensor,
    gates: &Tensor,
    slots: &[u32],
    k: usize,
    grad: &Tensor,
) -> CResult<(Tensor, Tensor)> {
    let (n, _) = gates.dims2()?;
    let (m, d) = combine_dims(y, gates, slots, k, n)?;
    if grad.dims() != [n, d] || !applies(grad) {
        return Err(Error::msg(format!(
            "weighted_scatter_add backward: gradient {:?} {:?} for [{n}, {d}] f32",
            grad.dims(),
            grad.dtype()
        )));
    }
    let (y, gates, grad) = (y.contiguous()?, gates.contiguous()?, grad.contiguous()?);
    let (dy, dg) = with_f32(&y, |yv| {
        with_f32(&gates, |gv| {
            with_f32(&grad, |go| {
                let mut dy = vec![0f32; m * d];
                let mut dg = vec![0f32; n * k];
                if d > 0 {
                    for ((row, drow), &s) in
                        yv.chunks_exact(d).zip(dy.chunks_exact_mut(d)).zip(slots)
                    {
                        let t = s as usize / k;
                        let g = gv[s as usize];
                        let orow = &go[t * d..(t + 1) * d];
                        let mut dot = 0f32;
                        for ((dv, &o), &v) in drow.iter_mut().zip(orow).zip(row) {
                            *dv = g * o;
                            dot += o * v;
                        }
                        dg[s as usize] += dot;
                    }
                }
                (dy, dg)
            })
        })
    })???;
    Ok((
        Tensor::from_vec(dy, (m, d), y.device())?,
        Tensor::from_vec(dg, (n, k), y.device())?,
    ))
}

#[cfg(test)]
mod tests {

    /// `linear_bias` against a plain triple loop (f64 sums), including its empty cases, and a
    /// length that does not match the shapes refused.
    #[test]
    fn linear_bias_matches_a_loop() {
        for (rows, inner, out) in [
            (0, 3, 2),
            (3, 0, 2),
            (3, 2, 0),
            (1, 1, 1),
            (5, 7, 3),
            (4, 600, 5),
        ] {
            let f = |n: usize, k: u32| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i as u32 * 7 + k) % 13) as f32 / 13.0 - 0.4)
                    .collect()
            };
            let (x, w, b) = (f(rows * inner, 1), f(out * inner, 2), f(out, 3));
            let y = linear_bias(&x, &w, &b, rows, inner).unwrap();
            assert_eq!(y.len(), rows * out);
            for r in 0..rows {
                for o in 0..out {
                    let want = b[o] as f64
                        + (0..inner)
                            .map(|k| x[r * inner + k] as f64 * w[o * inner + k] as f64)
                            .sum::<f64>();
                    let got = y[r * out + o] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{rows}x{inner}x{out} [{r},{o}]: {got} vs {want}"
                    );
                }
            }
        }
        assert!(linear_bias(&[1.0; 5], &[1.0; 6], &[0.0; 2], 2, 3).is_err());
        assert!(linear_bias(&[1.0; 6], &[1.0; 5], &[0.0; 2], 2, 3).is_err());
    }
    use super::*;
    use crate::compare::abs_sum;

    #[test]
    fn fast_exp_accuracy() {
        let mut worst = 0f64;
        let mut x = -80f32;
        while x < 80.0 {
            let a = fast_exp(x) as f64;
            let b = (x as f64).exp();
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(fast_exp(-200.0), fast_exp(-87.0));
        assert!(fast_exp(200.0).is_finite());
    }

    /// `fast_exp` as it was before its `2^n` came from `t`'s bits: `(n as i32 + 127) << 23`.
    fn fast_exp_by_cast(x: f32) -> f32 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        let x = x.clamp(-87.0, 88.0);
        let n = (x * LOG2E + 12_582_912.0) - 12_582_912.0;
        let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
        exp_poly(r) * f32::from_bits(((n as i32 + 127) << 23) as u32)
    }

    /// The exponent read off the rounding sum's bits is the cast's, for every input the clamp
    /// lets through and beyond: the same bits everywhere (NaN stays NaN).
    #[test]
    fn fast_exp_by_bits_is_fast_exp_by_cast() {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            -87.0,
            88.0,
            -87.5,
            88.5,
            -1e30,
            1e30,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        // Every 2^-10 over the clamp's range and past it, and the neighbours of each
        // half-integer multiple of ln 2 (where the rounding to n changes).
        let mut x = -100f32;
        while x <= 100.0 {
            xs.push(x);
            x += 1.0 / 1024.0;
        }
        for k in -260..=260 {
            let edge = (k as f32 + 0.5) * std::f32::consts::LN_2;
            xs.extend([edge, f32::from_bits(edge.to_bits() + 1), edge.next_down()]);
        }
        for &x in &xs {
            let (a, b) = (fast_exp(x), fast_exp_by_cast(x));
            assert_eq!(a.to_bits(), b.to_bits(), "fast_exp({x:e}): {a:e} vs {b:e}");
        }
        assert!(fast_exp(f32::NAN).is_nan());
    }

    /// The maximum kept per lane is the sequential fold's (NaNs skipped alike), for rows of
    /// every length around the lane count.
    #[test]
    fn the_lane_maximum_is_the_fold() {
        for len in 0..70usize {
            for salt in 0..4u32 {
                let mut row: Vec<f32> = (0..len as u32)
                    .map(|i| (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) as f32)
                    .map(|v| (v % 1000.0) - 600.0)
                    .collect();
                if salt == 1 && len > 3 {
                    row[len / 2] = f32::NAN;
                }
                if salt == 2 {
                    row.iter_mut().for_each(|v| *v = f32::NAN);
                }
                let fold = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let lanes = row_max(&row);
                assert!(
                    lanes == fold || (lanes.is_nan() && fold.is_nan()),
                    "len {len} salt {salt}: {lanes} vs {fold}"
                );
            }
        }
    }

    /// A kernel's output as bits: as usual (SIMD, blocks in parallel) and plain.
    type Bits = (Vec<u32>, Vec<u32>);
    /// A norm backward's (dx, dw, db).
    type Grads = (Vec<f32>, Vec<f32>, Vec<f32>);

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `f` as usual and plain (no SIMD dispatch, one block on this thread). The switch is the
    /// process's: other tests running meanwhile may run plain for a moment, which by the
    /// property checked here changes none of their results.
    fn usual_and_plain<T>(f: impl Fn() -> T) -> (T, T) {
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        assert!(!plain(), "CDT_CPU_KERNELS=plain is set: nothing to compare");
        let usual = f();
        PLAIN.store(true, std::sync::atomic::Ordering::Relaxed);
        let plain_run = f();
        PLAIN.store(false, std::sync::atomic::Ordering::Relaxed);
        (usual, plain_run)
    }

    fn both(f: &dyn Fn() -> Vec<f32>) -> Bits {
        let (a, b) = usual_and_plain(f);
        (bits(&a), bits(&b))
    }

    /// Each kernel gives the same bits as usual (its loops in `simd`, the widest instructions
    /// this CPU has; blocks of rows in parallel on rayon's pool) as plain (the baseline build's
    /// loops, one block on the calling thread): rows of uneven lengths, enough of them for
    /// several blocks, causal and scaled softmax, both norms, every backward. (The loops are
    /// vectorized in an optimized build: `cargo test --release` checks the widths too.)
    #[test]
    fn every_cpu_kernel_gives_the_same_bits_in_parallel_simd_blocks_as_plain() {
        for n in [1usize, 7, 16, 33, 130] {
            // At least three blocks of rows.
            let rows = 3 * PAR_GRAIN / n + 7;
            let x = seq(&[rows, n], n as u32);
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let g = seq(&[rows, n], 7 + n as u32);
            let gs = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let sh = x.shape().clone();
            let targets: Vec<u32> = (0..rows as u32).map(|r| r % n as u32).collect();
            let causal = Softmax {
                scale: 0.37,
                causal: true,
            };
            let plain_softmax = Softmax {
                scale: 1.0,
                causal: false,
            };
            let shifted = SumExpShifted {
                m: (0..rows).map(|r| r as f32 / rows as f32).collect(),
            };
            let ce = CrossEntropy { targets };
            let ce_grad = || {
                let gl = Tensor::new(0.5f32, &candle_core::Device::Cpu).unwrap();
                ce.backward(&x, &x, &gl)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let checks: Vec<(&str, Bits)> = vec![
                ("gelu", both(&|| Gelu.forward(&xs, &sh).unwrap().0)),
                (
                    "softmax",
                    both(&|| plain_softmax.forward(&xs, &sh).unwrap().0),
                ),
                (
                    "causal softmax",
                    both(&|| causal.forward(&xs, &sh).unwrap().0),
                ),
                (
                    "log_softmax",
                    both(&|| LogSoftmax.forward(&xs, &sh).unwrap().0),
                ),
                ("sum_exp", both(&|| shifted.forward(&xs, &sh).unwrap().0)),
                ("cross_entropy", both(&|| ce.forward(&xs, &sh).unwrap().0)),
                ("cross_entropy backward", both(&ce_grad)),
                ("add_rows", both(&|| add_rows(&xs, &gs[..n]))),
                (
                    "softmax backward",
                    both(&|| {
                        map_rows2(&xs, &gs, n, |y, gr, d| softmax_row_backward(y, gr, d, 0.37))
                    }),
                ),
                (
                    "gelu backward",
                    both(&|| {
                        let dx = Gelu.backward(&x, &x, &g).unwrap();
                        dx.flatten_all().unwrap().to_vec1().unwrap()
                    }),
                ),
            ];
            for (name, (usual, plain_run)) in checks {
                assert_eq!(usual, plain_run, "{name}, n {n}");
            }
            for center in [true, false] {
                let norm = Norm { eps: 1e-5, center };
                let (w, b) = (&gs[..n], &xs[..n]);
                let (usual, plain_run) = both(&|| norm.forward(&xs, w, Some(b), n));
                assert_eq!(usual, plain_run, "norm (center {center}) forward, n {n}");
                let back = |(dx, dw, db): Grads| [bits(&dx), bits(&dw), bits(&db)];
                let (usual, plain_run) = usual_and_plain(|| back(norm.backward(&xs, w, &gs, n)));
                assert_eq!(usual, plain_run, "norm (center {center}) backward, n {n}");
            }
        }
    }

    fn seq(dims: &[usize], seed: u32) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n as u32)
            .map(|i| {
                ((i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect();
        Tensor::from_vec(v, dims, &candle_core::Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        crate::compare::max_abs_diff(a, b).unwrap()
    }

    #[test]
    fn weighted_scatter_add_matches_the_candle_composition_forward_and_backward() {
        let dev = candle_core::Device::Cpu;
        // 5 tokens, top-2, 7 rows: token 1 twice, token 3 not at all, a repeated slot.
        let (n, k, d) = (5usize, 2usize, 6usize);
        let slots = vec![3u32, 0, 2, 9, 8, 5, 3];
        let y = seq(&[slots.len(), d], 1);
        let gates = seq(&[n, k], 2);
        let grad = seq(&[n, d], 3);
        let sl = Tensor::new(slots.as_slice(), &dev).unwrap();
        let tok: Vec<u32> = slots.iter().map(|s| s / k as u32).collect();
        let tk = Tensor::new(tok.as_slice(), &dev).unwrap();
        let g = gates.flatten_all().unwrap().index_select(&sl, 0).unwrap();
        let reference = Tensor::zeros((n, d), DType::F32, &dev)
            .unwrap()
            .index_add(&tk, &y.broadcast_mul(&g.unsqueeze(1).unwrap()).unwrap(), 0)
            .unwrap();
        let out = weighted_scatter_add(&y, &gates, &slots, k, n).unwrap();
        assert!(max_diff(&out, &reference) < 1e-6);
        assert_eq!(abs_sum(&out.get(3).unwrap()).unwrap(), 0.0);

        let (dy, dg) = weighted_scatter_add_backward(&y, &gates, &slots, k, &grad).unwrap();
        let rows = grad.index_select(&tk, 0).unwrap();
        let rdy = rows.broadcast_mul(&g.unsqueeze(1).unwrap()).unwrap();
        let rdg = Tensor::zeros(n * k, DType::F32, &dev)
            .unwrap()
            .index_add(&sl, &rows.mul(&y).unwrap().sum(1).unwrap(), 0)
            .unwrap()
            .reshape((n, k))
            .unwrap();
        assert!(max_diff(&dy, &rdy) < 1e-6);
        assert!(max_diff(&dg, &rdg) < 1e-5);

        // Empty rows and zero width.
        let none = weighted_scatter_add(&y.narrow(0, 0, 0).unwrap(), &gates, &[], k, n).unwrap();
        assert_eq!(none.dims(), &[n, d]);
        let flat = Tensor::zeros((7, 0), DType::F32, &dev).unwrap();
        assert_eq!(
            weighted_scatter_add(&flat, &gates, &slots, k, n)
                .unwrap()
                .dims(),
            &[n, 0]
        );
    }

    #[test]
    fn weighted_scatter_add_refuses_bad_operands() {
        let y = seq(&[3, 4], 1);
        let gates = seq(&[2, 2], 2);
        // A slot past N * k, a wrong slot count, a gates shape that disagrees, a dtype.
        let e = weighted_scatter_add(&y, &gates, &[0, 1, 4], 2, 2).unwrap_err();
        assert!(
            e.to_string().contains("slot 4 outside 2 tokens x top-2"),
            "{e}"
        );
        assert!(weighted_scatter_add(&y, &gates, &[0, 1], 2, 2).is_err());
        assert!(weighted_scatter_add(&y, &gates, &[0, 1, 2], 2, 3).is_err());
        let yh = y.to_dtype(DType::F16).unwrap();
        assert!(weighted_scatter_add(&yh, &gates, &[0, 1, 2], 2, 2).is_err());
        let bad_grad = seq(&[2, 5], 3);
        assert!(weighted_scatter_add_backward(&y, &gates, &[0, 1, 2], 2, &bad_grad).is_err());
    }

    /// The packed attention kernel gives the same bits with its (batch, head) tasks in parallel
    /// (15 tasks, each past one block of queries) as plain, forward and backward, causal or
    /// not: the tasks write disjoint elements of one buffer, and a task that wrote another's
    /// (or raced with it) would show here. Wrong lengths are typed errors.
    #[test]
    fn packed_attention_gives_the_same_bits_in_parallel_as_plain() {
        use attention::{backward, forward, Packed};
        let p = Packed {
            b: 3,
            t: 70,
            h: 5,
            d: 8,
        };
        let vals = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let x = vals(seq(&[p.b, p.t, p.h, 3, p.d], 5));
        let g = vals(seq(&[p.b, p.t, p.h, p.d], 11));
        for causal in [false, true] {
            let (usual, plain_run) = both(&|| forward(&x, p, causal, 0.4).unwrap());
            assert_eq!(usual, plain_run, "forward, causal {causal}");
            let (usual, plain_run) = both(&|| backward(&x, &g, p, causal, 0.4).unwrap());
            assert_eq!(usual, plain_run, "backward, causal {causal}");
            assert!(usual.iter().all(|v| f32::from_bits(*v).is_finite()));
        }
        let e = forward(&x[1..], p, true, 0.4).unwrap_err().to_string();
        assert!(e.contains("packed_sdpa") && e.contains("qkv"), "{e}");
        let e = backward(&x, &g[1..], p, true, 0.4).unwrap_err().to_string();
        assert!(e.contains("output gradient"), "{e}");
    }
}
