//! A linear's GEMMs on cuBLASLt (feature `cuda`): the forward `x2 @ w^T + b` as one
//! `cublasLtMatmul` with the bias in its epilogue, the bias added to the f32 accumulator and the
//! sum rounded once to the output dtype, which may be wider than the inputs (bf16 operands,
//! f32 output); a mixed-precision linear's backward GEMMs (`dx = g w`, `dw = g^T x`) written
//! straight into their f32 gradients from bf16 operands ([`gemm`]); and the weight gradient
//! with the bias gradient (`g`'s column sums) in its epilogue ([`gemm_epi`], [`Epi::BgradB`]).
//!
//! candle's GEMM (`cublasGemmStridedBatchedEx`) writes the product in the operands' dtype, so
//! a linear on it paid a second pass over its output for the bias (`cast.cu`), and a bf16 GEMM
//! whose output feeds f32 wrote a bf16 product and read it back to widen it; a bf16 output was
//! rounded twice (the product, then product plus bias). PyTorch's `addmm` (and so autocast's
//! linear) takes the bias epilogue too. In the backward, candle's bf16 GEMMs wrote bf16
//! gradients that a cast pass widened to f32 (the master weights' and the f32 activations').
//!
//! The compute type follows the policy: f32 operands compute in f32, or TF32 where candle's
//! `gemm_reduced_precision_f32` switch is on (the `tf32` policy), as candle's own GEMM does;
//! bf16 operands accumulate in f32. A bf16 output is not split-K reduced in bf16 (the
//! reduction scheme is limited to none or the compute type), so it is rounded once.
//!
//! A plan (descriptors, layouts and the algorithm cuBLASLt's heuristic picked) is made once per
//! device and thread, shape, transposes, dtypes, epilogue, compute type and operand alignment,
//! and kept; the epilogue vector's address is the only attribute set per call. Each device and host thread has one handle and one workspace (32 MiB
//! on compute capability 9 and later, 4 MiB before, as NVIDIA recommends): candle's default
//! device enqueues on the calling thread's own stream, so a workspace is used on one stream
//! only and never by two GEMMs at once. That state lives as long as the process (a device
//! created and dropped in a loop, or a new thread per call, would keep a workspace each).
//!
//! Anything cuBLASLt refuses (no algorithm for a shape or dtype mix, an error status, no
//! handle) makes [`gemm_epi`] return `None`: the caller takes candle's GEMM and the separate
//! bias, cast or column-sum pass, as before; the refusal is logged once per plan and kept as a
//! line for checks ([`refusals`]). `CDT_CUBLASLT=0` turns the path off, `CDT_CUBLASLT_BGRAD=0`
//! the bias-gradient epilogue alone.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::result::{self as lt, CublasError};
use candle_core::cuda_backend::cudarc::cublaslt::sys;
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Tensor};
use half::bf16;

use crate::gemm_layout::{col_major, ColMajor, Mat};

type Result<T> = candle_core::Result<T>;

/// Whether the bias gradient may go in a weight gradient's epilogue (`BGRADB`):
/// `CDT_CUBLASLT_BGRAD` unset or anything but `0` (the rest of the path stays on with it `0`).
fn bgrad_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("CDT_CUBLASLT_BGRAD").map_or(true, |v| v.trim() != "0"))
}

/// The fewest rows and columns of `C` for which the bias gradient goes in the epilogue: tiny
/// products take the column sum (a cuBLASLt fault with one output feature was reported for
/// this epilogue, apex issue 1392; such shapes gain nothing from it anyway).
const BGRAD_MIN_DIM: usize = 8;

/// Whether the path is on: `CDT_CUBLASLT` unset or anything but `0`, and the fused CUDA path on
/// (`CDT_FUSED_CUDA`).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("CDT_CUBLASLT").map_or(true, |v| v.trim() != "0"))
        && crate::fused::cuda_enabled()
}

/// cuBLASLt matmuls enqueued, those of them with the bias (or the bias gradient) in the
/// epilogue, and refusals (plans
/// cuBLASLt had none for, failed matmuls, devices without a handle), in this process
/// ([`counts`]).
static MATMULS: AtomicU64 = AtomicU64::new(0);
static BIAS_EPILOGUES: AtomicU64 = AtomicU64::new(0);
static BIAS_GRADS: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// What cuBLASLt refused, one line each (the plan's key and the error), the first
/// [`REFUSALS_KEPT`] of the process: for checks to print without a log subscriber.
static REFUSALS: Mutex<Vec<String>> = Mutex::new(Vec::new());
const REFUSALS_KEPT: usize = 32;

/// Whether cuBLASLt refused a plan of an f32 bias with a bf16 output (not documented either
/// way): [`gemm`] then passes such a bias rounded to bf16 (as autocast's `addmm` gets it).
static F32_BIAS_BF16_OUT_REFUSED: AtomicBool = AtomicBool::new(false);

/// Counts a refusal and keeps its line (`what`: the call or the key, `error`: why).
fn refused(what: String, error: String) {
    REFUSED.fetch_add(1, Ordering::Relaxed);
    let mut r = REFUSALS.lock().unwrap_or_else(|e| e.into_inner());
    if r.len() < REFUSALS_KEPT {
        r.push(format!("{what}: {error}"));
    }
}

/// The refusals kept so far (`crate::fused::cublaslt_refusals`).
pub(crate) fn refusals() -> Vec<String> {
    REFUSALS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The counts so far (`crate::fused::cublaslt_counts`): whether the GEMMs took this path.
pub(crate) fn counts() -> crate::fused::CublasLtCounts {
    crate::fused::CublasLtCounts {
        matmuls: MATMULS.load(Ordering::Relaxed),
        bias_epilogues: BIAS_EPILOGUES.load(Ordering::Relaxed),
        bias_grads: BIAS_GRADS.load(Ordering::Relaxed),
        refused: REFUSED.load(Ordering::Relaxed),
    }
}

/// What one plan is for: the GEMM in cuBLASLt's column-major terms (`crate::gemm_layout`:
/// shapes, leading dimensions, transposes), the dtypes, the compute type and the operands'
/// address alignments (the heuristic picks an algorithm for them).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    gemm: ColMajor,
    input: DType,
    out: DType,
    epilogue: EpiKind,
    compute: sys::cublasComputeType_t,
    align: [u32; 4],
}

/// The epilogue of a plan: none, the bias added (its dtype), or the bias gradient of cuBLASLt's
/// B operand, the row-major left factor's sums over `k` ([`Epi::BgradB`], written in this
/// dtype).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum EpiKind {
    None,
    Bias(DType),
    BgradB(DType),
}

/// What a [`gemm_epi`] call adds to the product `C [M, N] = A @ B`.
pub(crate) enum Epi<'a> {
    None,
    /// `bias [N]` added to every row of `C`.
    Bias(&'a Tensor),
    /// Also writes `db [M]`, `db[i] = sum over k of A[i, k]`, in the output's dtype: for a
    /// weight gradient `g^T x` (`A = g^T`), `g`'s column sums, the bias gradient.
    BgradB,
}

/// A matmul descriptor, destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);
/// A matrix layout, destroyed on drop.
struct MatLayout(sys::cublasLtMatrixLayout_t);
/// A handle, destroyed on drop.
struct Handle(sys::cublasLtHandle_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by `create_matmul_desc` and destroyed only here.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
impl Drop for MatLayout {
    fn drop(&mut self) {
        // SAFETY: made by `create_matrix_layout` and destroyed only here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by `create_handle` and destroyed only here.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}

struct Plan {
    desc: Desc,
    a: MatLayout,
    b: MatLayout,
    d: MatLayout,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// A device's cuBLASLt state: its handle, workspace, plans and refusals (not retried).
struct DeviceLt {
    handle: Handle,
    workspace: CudaSlice<u8>,
    plans: HashMap<Key, Plan>,
    /// The refused plans' keys with the output's and the epilogue vector's alignment left out
    /// (those are known only once the outputs exist): a refused GEMM returns before it
    /// allocates them.
    refused: std::collections::HashSet<Key>,
}

// SAFETY: the handle, descriptors and layouts are pointers to cuBLASLt's host-side objects,
// which it lets any host thread use; every use goes through the `Mutex` that holds the
// `DeviceLt`, so no two threads touch them at once, and the device memory they name (the
// workspace) is used only on the stream of the one host thread the state belongs to.
unsafe impl Send for DeviceLt {}

/// A device and the host thread using it: candle's default CUDA device enqueues on the
/// per-thread default stream, so two threads using one `CudaDevice` enqueue on two streams,
/// and each needs a workspace of its own.
type DevKey = (candle_core::cuda_backend::DeviceId, std::thread::ThreadId);
type Devices = Mutex<HashMap<DevKey, Arc<Mutex<DeviceLt>>>>;

fn devices() -> &'static Devices {
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The state of the device on this thread, made at its first use.
fn device_lt(dev: &CudaDevice) -> Result<Arc<Mutex<DeviceLt>>> {
    let key = (dev.id(), std::thread::current().id());
    let mut all = devices().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = all.get(&key) {
        return Ok(d.clone());
    }
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let major = stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let size = if major >= 9 { 32 << 20 } else { 4 << 20 };
    // SAFETY: cuBLASLt only ever writes the workspace before reading it.
    let workspace = unsafe { stream.alloc::<u8>(size) }.w()?;
    let handle = Handle(lt::create_handle().map_err(|e| lt_error("cublasLtCreate", e))?);
    let d = Arc::new(Mutex::new(DeviceLt {
        handle,
        workspace,
        plans: HashMap::new(),
        refused: Default::default(),
    }));
    all.insert(key, d.clone());
    Ok(d)
}

fn lt_error(call: &'static str, e: CublasError) -> candle_core::Error {
    crate::error::KernelError::Mismatch {
        op: "cuBLASLt linear",
        detail: format!("{call} failed: {e:?}"),
    }
    .into()
}

fn data_type(dt: DType) -> Option<sys::cudaDataType> {
    match dt {
        DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
        _ => None,
    }
}

/// The compute type of operands of `input`: f32, or TF32 for f32 operands where candle's
/// switch asks for it (as its own GEMM does); bf16 operands always accumulate in f32 (cuBLASLt
/// documents the `FAST_*` types for f32 operands only).
fn compute_type(input: DType) -> sys::cublasComputeType_t {
    use sys::cublasComputeType_t as C;
    match input {
        DType::F32 if candle_core::cuda::gemm_reduced_precision_f32() => {
            C::CUBLAS_COMPUTE_32F_FAST_TF32
        }
        _ => C::CUBLAS_COMPUTE_32F,
    }
}

/// The largest power of two up to 256 dividing `addr` (cuBLASLt's alignment preferences).
fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

/// Sets a descriptor attribute from a value.
///
/// # Safety
/// `T` must be the type cuBLASLt documents for `attr`.
unsafe fn set_desc<T>(
    desc: &Desc,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> std::result::Result<(), CublasError> {
    // SAFETY: the caller's; `value` is alive for the call and `size_of::<T>()` bytes long.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc.0,
            attr,
            value as *const T as *const c_void,
            size_of::<T>(),
        )
    }
}

/// Makes the plan of `key`, the bias address set (the heuristic reads its alignment).
fn make_plan(
    handle: &Handle,
    key: &Key,
    bias_ptr: Option<u64>,
    workspace: usize,
) -> std::result::Result<Plan, CublasError> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    // `data_type` of the dtypes was checked by the caller.
    let ty = |dt: DType| data_type(dt).unwrap_or(sys::cudaDataType_t::CUDA_R_32F);
    // The compute type the key was made with (candle's switch may change between calls).
    let desc = Desc(lt::create_matmul_desc(
        key.compute,
        sys::cudaDataType_t::CUDA_R_32F,
    )?);
    // The layouts, leading dimensions and transposes: `gemm_layout::col_major` (tested there
    // against a column-major GEMM).
    let g = &key.gemm;
    use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t as Op;
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let (trans_a, trans_b) = (op(g.a.trans), op(g.b.trans));
    // SAFETY (every `set_desc` and `set_matmul_pref_attribute` below): the value's type is the
    // one cuBLAS documents for the attribute (cublasOperation_t, uint32_t epilogue, a device
    // pointer, cudaDataType (int32), uint64_t workspace bytes, uint32_t alignments), and the
    // descriptor / preference is alive.
    unsafe {
        set_desc(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &trans_a)?;
        set_desc(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &trans_b)?;
        use sys::cublasLtEpilogue_t as E;
        let epi = match key.epilogue {
            EpiKind::None => None,
            EpiKind::Bias(dt) => Some((E::CUBLASLT_EPILOGUE_BIAS, dt)),
            EpiKind::BgradB(dt) => Some((E::CUBLASLT_EPILOGUE_BGRADB, dt)),
        };
        if let (Some((epilogue, dt)), Some(ptr)) = (epi, bias_ptr) {
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &ty(dt))?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr)?;
        }
    }
    let layout = |dt: DType, mat: &Mat| {
        lt::create_matrix_layout(ty(dt), mat.rows, mat.cols, mat.ld as i64).map(MatLayout)
    };
    let a = layout(key.input, &g.a)?;
    let b = layout(key.input, &g.b)?;
    let d = layout(key.out, &g.d)?;
    struct Pref(sys::cublasLtMatmulPreference_t);
    impl Drop for Pref {
        fn drop(&mut self) {
            // SAFETY: made by `create_matmul_pref` and destroyed only here.
            let _ = unsafe { lt::destroy_matmul_pref(self.0) };
        }
    }
    let pref = Pref(lt::create_matmul_pref()?);
    let ws = workspace as u64;
    let set_pref = |attr: P, v: &dyn Fn() -> (*const c_void, usize)| {
        let (p, n) = v();
        // SAFETY: see above.
        unsafe { lt::set_matmul_pref_attribute(pref.0, attr, p, n) }
    };
    set_pref(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &|| {
        (&ws as *const u64 as *const c_void, size_of::<u64>())
    })?;
    if key.out != DType::F32 {
        // Split-K partial sums added in the compute type (f32) or not split: never in the
        // output's bf16, which would round more than once.
        let scheme = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        set_pref(P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &|| {
            (&scheme as *const u32 as *const c_void, size_of::<u32>())
        })?;
    }
    let [al_a, al_b, al_d, _] = &key.align;
    for (attr, v) in [
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_d),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d),
    ] {
        set_pref(attr, &|| {
            (v as *const u32 as *const c_void, size_of::<u32>())
        })?;
    }
    // SAFETY: every object is alive; D serves as C (beta is 0).
    let heuristic =
        unsafe { lt::get_matmul_algo_heuristic(handle.0, desc.0, a.0, b.0, d.0, d.0, pref.0)? };
    Ok(Plan {
        desc,
        a,
        b,
        d,
        algo: heuristic.algo,
    })
}

/// A device address of a contiguous float operand's first element, and its read guard.
macro_rules! float_addr {
    ($s:expr, $l:expr, $stream:expr) => {{
        let start = $l.start_offset();
        match &$s.slice {
            CudaStorageSlice::F32(v) => {
                let (p, g) = v.device_ptr($stream);
                Some((p + (start * 4) as u64, g))
            }
            CudaStorageSlice::BF16(v) => {
                let (p, g) = v.device_ptr($stream);
                Some((p + (start * 2) as u64, g))
            }
            _ => None,
        }
    }};
}

/// `x2 @ w^T (+ b)` as one cuBLASLt matmul with the bias in its epilogue, as a fresh storage
/// `[rows, out]` of dtype `out`: `x2 [rows, in]` and `w [out, in]` contiguous, of one dtype
/// (f32 or bf16) on one CUDA device; `b [out]` f32 or of the operands' dtype; `out` the
/// operands' dtype or f32. `None` where it does not apply or cuBLASLt refuses (see the module
/// docs): the caller computes it another way.
pub(crate) fn linear(
    x2: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    out: DType,
) -> Result<Option<CudaStorage>> {
    gemm(x2, false, w, true, b, out)
}

/// The row-major product `C [M, N] = A @ B (+ bias)` as one cuBLASLt matmul, as a fresh storage
/// of dtype `out`: `A` is `a` (`[M, K]`) or, with `a_t`, `a`'s transpose (`a` stored `[K, M]`);
/// `B` is `b` (`[K, N]`) or, with `b_t`, `b`'s transpose (`b` stored `[N, K]`); both contiguous,
/// of one dtype (f32 or bf16), on one CUDA device; `bias [N]` (added to every row) f32 or of
/// the operands' dtype; `out` the operands' dtype or f32. A linear is `gemm(x2, false, w, true)`;
/// its input gradient `gemm(g, false, w, false)`, its weight gradient `gemm(g, true, x2, false)`.
/// `None` where it does not apply or cuBLASLt refuses (see the module docs). Where cuBLASLt has
/// no plan for an f32 bias with a bf16 output (NVIDIA documents it neither way), the bias
/// rounded to bf16, as autocast's `addmm` gets it, in the same epilogue: still one pass and one
/// rounding of the sum.
///
/// In cuBLASLt's column-major terms a row-major `[r, c]` matrix is a `[c, r]` one, so `C^T =
/// B^T A^T`: cuBLASLt's A is `b` (m = N), its B is `a` (n = M), and D is `C` (`[N, M]`, ld N);
/// `crate::gemm_layout::col_major` gives the layouts.
pub(crate) fn gemm(
    a: &Tensor,
    a_t: bool,
    b: &Tensor,
    b_t: bool,
    bias: Option<&Tensor>,
    out: DType,
) -> Result<Option<CudaStorage>> {
    let epi = bias.map_or(Epi::None, Epi::Bias);
    if let Some(p) = gemm_epi(a, a_t, b, b_t, epi, out)? {
        return Ok(Some(p.c));
    }
    match bias {
        Some(v)
            if out == DType::BF16
                && v.dtype() == DType::F32
                && F32_BIAS_BF16_OUT_REFUSED.load(Ordering::Relaxed) =>
        {
            let v16 = v.to_dtype(DType::BF16)?;
            Ok(gemm_epi(a, a_t, b, b_t, Epi::Bias(&v16), out)?.map(|p| p.c))
        }
        _ => Ok(None),
    }
}

/// What [`gemm_epi`] made: the product `C` (`[rows, cols]` row-major) and, for
/// [`Epi::BgradB`], the bias gradient (`[rows]`), fresh storages of the output dtype.
pub(crate) struct Product {
    pub c: CudaStorage,
    pub rows: usize,
    pub cols: usize,
    pub db: Option<CudaStorage>,
}

/// [`gemm`] with the epilogue `epi`: the product and, for [`Epi::BgradB`], the `[M]` sums of
/// `A`'s rows (the bias gradient), both fresh storages of dtype `out` (no retry of a refused
/// f32 bias: [`gemm`]'s).
pub(crate) fn gemm_epi(
    a: &Tensor,
    a_t: bool,
    b: &Tensor,
    b_t: bool,
    epi: Epi<'_>,
    out: DType,
) -> Result<Option<Product>> {
    let input = a.dtype();
    let (Ok(ad), Ok(bd)) = (a.dims2(), b.dims2()) else {
        return Ok(None);
    };
    let (rows, inner) = if a_t { (ad.1, ad.0) } else { ad };
    let (b_inner, cols) = if b_t { (bd.1, bd.0) } else { bd };
    let bias = match &epi {
        Epi::Bias(v) => Some(*v),
        _ => None,
    };
    // The bias gradient in the epilogue: with plain f32 accumulation only (under TF32 the
    // epilogue may sum operands rounded to TF32, where the column sum adds exact f32 values),
    // and not for tiny products (see `BGRAD_MIN_DIM`).
    if matches!(epi, Epi::BgradB)
        && (!bgrad_enabled()
            || compute_type(input) != sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
            || rows < BGRAD_MIN_DIM
            || cols < BGRAD_MIN_DIM)
    {
        return Ok(None);
    }
    let fits = enabled()
        && data_type(input).is_some()
        && (out == input || out == DType::F32)
        && b.dtype() == input
        && a.device().is_cuda()
        && b.device().same_device(a.device())
        && b_inner == inner
        && rows > 0
        && inner > 0
        && cols > 0
        && i64::try_from(rows.max(inner).max(cols)).is_ok()
        && a.is_contiguous()
        && b.is_contiguous()
        && bias.is_none_or(|v| {
            (v.dtype() == input || v.dtype() == DType::F32)
                && v.dims() == [cols]
                && v.is_contiguous()
                && v.device().same_device(a.device())
        });
    if !fits {
        return Ok(None);
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (candle_core::Storage::Cuda(sa), candle_core::Storage::Cuda(sb)) = (&*sa, &*sb) else {
        return Ok(None);
    };
    let bias_sl = bias.map(|v| v.storage_and_layout());
    let bias_cuda = match &bias_sl {
        Some((bs, bl)) => match &**bs {
            candle_core::Storage::Cuda(bs) => Some((bs, bl)),
            _ => return Ok(None),
        },
        None => None,
    };
    let dev = &sa.device;
    let state = match device_lt(dev) {
        Ok(s) => s,
        Err(e) => {
            // No handle or workspace: every GEMM of this device takes the path before. Said
            // once a process; each call tries again (a later call may find memory).
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "cuBLASLt unavailable: the linears' GEMMs run on candle's (and a bias or cast pass)");
                refused("no cuBLASLt handle or workspace".into(), e.to_string());
            } else {
                REFUSED.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(None);
        }
    };
    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let Some((pa, ga)) = float_addr!(sa, la, &stream) else {
        return Ok(None);
    };
    let Some((pb, gb)) = float_addr!(sb, lb, &stream) else {
        return Ok(None);
    };
    let bias_addr = match bias_cuda {
        Some((bs, bl)) => match float_addr!(bs, bl, &stream) {
            Some(a) => Some(a),
            None => return Ok(None),
        },
        None => None,
    };
    let mut key = Key {
        gemm: col_major(rows as u64, cols as u64, inner as u64, a_t, b_t),
        input,
        out,
        epilogue: match (&epi, bias) {
            (Epi::Bias(_), Some(v)) => EpiKind::Bias(v.dtype()),
            (Epi::BgradB, _) => EpiKind::BgradB(out),
            _ => EpiKind::None,
        },
        compute: compute_type(input),
        // The output's and the epilogue vector's alignments are set once they exist.
        align: [alignment(pb), alignment(pa), 0, 0],
    };
    let shape_key = key;
    if state.refused.contains(&shape_key) {
        return Ok(None);
    }
    let alloc = |len: usize| -> Result<Output> {
        Ok(match out {
            DType::F32 => Output::F32(crate::cuda::alloc_out::<f32>(dev, len)?),
            _ => Output::Bf16(crate::cuda::alloc_out::<bf16>(dev, len)?),
        })
    };
    let mut y = alloc(rows * cols)?;
    // The bias gradient: `rows` sums (cuBLASLt's n), written by the epilogue.
    let mut db = match epi {
        Epi::BgradB => Some(alloc(rows)?),
        _ => None,
    };
    let (yp, yg) = y.ptr_mut(&stream);
    let db_addr = db.as_mut().map(|d| d.ptr_mut(&stream));
    // The epilogue's vector: the bias read, or the bias gradient written.
    let vec_ptr = match (&bias_addr, &db_addr) {
        (Some((p, _)), _) | (None, Some((p, _))) => Some(*p),
        (None, None) => None,
    };
    key.align[2] = alignment(yp);
    key.align[3] = vec_ptr.map_or(256, alignment);
    let DeviceLt {
        handle,
        workspace,
        plans,
        refused: refused_shapes,
    } = &mut *state;
    let ws_size = workspace.len();
    let plan = match plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            match make_plan(handle, &key, vec_ptr, ws_size) {
                Ok(p) => v.insert(p),
                Err(e) => {
                    if key.out == DType::BF16 && key.epilogue == EpiKind::Bias(DType::F32) {
                        F32_BIAS_BF16_OUT_REFUSED.store(true, Ordering::Relaxed);
                    }
                    refused_shapes.insert(shape_key);
                    refused(format!("no plan for {key:?}"), format!("{e:?}"));
                    tracing::warn!(
                        ?key,
                        error = ?e,
                        "cuBLASLt has no plan for this GEMM: it runs on candle's (and a bias or cast pass)"
                    );
                    return Ok(None);
                }
            }
        }
    };
    let (alpha, beta) = (1f32, 0f32);
    let (wsp, wsg) = workspace.device_ptr_mut(&stream);
    // SAFETY: the plan was made for these shapes, transposes, dtypes, epilogue and alignments
    // (the key): cuBLASLt's A is `b`'s `inner x cols` elements, its B `a`'s `rows x inner`, D
    // the fresh `rows x cols` output, all contiguous at the addresses taken above (with their
    // guards, which record this use on the stream when dropped after the enqueue); the
    // epilogue's vector set here is the bias, `cols` elements of the plan's bias dtype, or the
    // fresh bias gradient, `rows` elements of `out`; alpha and beta are f32 as the scale type;
    // C is D with beta 0 (not read); the workspace holds `ws_size` bytes and only this thread's
    // stream on this device uses it.
    let status = unsafe {
        let set = match vec_ptr {
            Some(p) => set_desc(
                &plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &p,
            ),
            None => Ok(()),
        };
        set.and_then(|()| {
            lt::matmul(
                handle.0,
                plan.desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                pb as *const c_void,
                plan.a.0,
                pa as *const c_void,
                plan.b.0,
                yp as *const c_void,
                plan.d.0,
                yp as *mut c_void,
                plan.d.0,
                &plan.algo,
                wsp as *mut c_void,
                ws_size,
                stream.cu_stream() as sys::cudaStream_t,
            )
        })
    };
    drop((ga, gb, yg, wsg, bias_addr, db_addr));
    if let Err(e) = status {
        tracing::warn!(?key, error = ?e, "cuBLASLt matmul failed: this GEMM runs on candle's (and a bias or cast pass)");
        plans.remove(&key);
        refused_shapes.insert(shape_key);
        refused(format!("cublasLtMatmul of {key:?}"), format!("{e:?}"));
        return Ok(None);
    }
    MATMULS.fetch_add(1, Ordering::Relaxed);
    match key.epilogue {
        EpiKind::Bias(_) => BIAS_EPILOGUES.fetch_add(1, Ordering::Relaxed),
        EpiKind::BgradB(_) => BIAS_GRADS.fetch_add(1, Ordering::Relaxed),
        EpiKind::None => 0,
    };
    Ok(Some(Product {
        c: y.storage(dev),
        rows,
        cols,
        db: db.map(|d| d.storage(dev)),
    }))
}

/// A fresh output buffer of the output's dtype.
enum Output {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl Output {
    fn ptr_mut<'a>(
        &'a mut self,
        stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
    ) -> (
        u64,
        candle_core::cuda_backend::cudarc::driver::SyncOnDrop<'a>,
    ) {
        match self {
            Output::F32(v) => v.device_ptr_mut(stream),
            Output::Bf16(v) => v.device_ptr_mut(stream),
        }
    }

    fn storage(self, dev: &CudaDevice) -> CudaStorage {
        let slice = match self {
            Output::F32(v) => CudaStorageSlice::F32(v),
            Output::Bf16(v) => CudaStorageSlice::BF16(v),
        };
        CudaStorage {
            slice,
            device: dev.clone(),
        }
    }
}
