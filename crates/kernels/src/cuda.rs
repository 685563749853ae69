//! The fused kernels on CUDA (feature `cuda`): launches of `crates/kernels/cuda/*.cu`, whose
//! PTX `build.rs` compiles with nvcc and this module embeds; candle's device loads each file
//! as a module at its first use (`get_or_load_custom_func`, cached per device).
//!
//! Forward passes are the `cuda_fwd` of the nodes in [`crate::fused`]; backward passes are
//! nodes of their own ([`Bwd`], applied without a backward: no double backward, as on the
//! CPU). f32 and bf16, f32 arithmetic and accumulation throughout; contiguous operands (the
//! public functions make them so); any row length up to [`MAX_ROW`]; empty tensors launch
//! nothing. The CPU kernels and the primitive compositions are the reference
//! (`crates/kernels/tests/cuda_fused.rs` compares them on a GPU).
//!
//! Launch shapes: row kernels one block per row (grid-stride over rows; 32..=1024 threads, the
//! row length rounded up to a warp), warp-shuffle reductions whose order depends only on the
//! block size; elementwise kernels 256 threads, grid-stride. The norms' weight and bias
//! gradients are column sums reduced in two deterministic stages (no atomics).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor,
};
use half::bf16;

use crate::error::KernelError;
use crate::fa_rows::{check_bwd, check_fwd, FaBwdRows, FaRows};
use crate::multi_tensor::Tables;

type Result<T> = candle_core::Result<T>;

/// The PTX of each kernel file (`$OUT_DIR/ptx.rs`, written by build.rs).
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// One kernel file: its module name in candle's per-device cache and its PTX.
struct Module {
    name: &'static str,
    ptx: &'static str,
}

const SOFTMAX: Module = Module {
    name: "cdt_fused_softmax",
    ptx: ptx::SOFTMAX,
};
const NORM: Module = Module {
    name: "cdt_fused_norm",
    ptx: ptx::NORM,
};
const GELU: Module = Module {
    name: "cdt_fused_gelu",
    ptx: ptx::GELU,
};
const MULTI_TENSOR: Module = Module {
    name: "cdt_multi_tensor",
    ptx: ptx::MULTI_TENSOR,
};
const EMBEDDING: Module = Module {
    name: "cdt_embedding",
    ptx: ptx::EMBEDDING,
};
const REDUCE: Module = Module {
    name: "cdt_reduce",
    ptx: ptx::REDUCE,
};
const CAST: Module = Module {
    name: "cdt_cast",
    ptx: ptx::CAST,
};

/// The longest extent a kernel walks with a 32-bit `int` index: `i32::MAX` less 2048, so that
/// an index one block (at most 1024 threads) or one tile past the last element still fits in
/// an `int` (a loop `for (int j = threadIdx.x; j < n; j += blockDim.x)` computes `j` up to
/// `n - 1 + blockDim.x`).
pub const MAX_INDEX: usize = i32::MAX as usize - 2048;
/// The longest row the row kernels take (their row index is a 32-bit `int`: [`MAX_INDEX`]).
pub const MAX_ROW: usize = MAX_INDEX;
/// The largest grid dim x (rows beyond it are walked grid-stride).
const MAX_GRID_X: usize = i32::MAX as usize;
/// Threads of an elementwise block, and the most blocks an elementwise launch uses.
const ELEM_THREADS: usize = 256;
const ELEM_MAX_BLOCKS: usize = 1 << 16;

/// A float type the kernels take: its variant of candle's CUDA storage (its suffix in kernel
/// names is [`KernelElem`]'s).
trait Float: KernelElem {
    const DTYPE: DType;
    fn of(s: &CudaStorageSlice) -> Option<&CudaSlice<Self>>;
    fn of_mut(s: &mut CudaStorageSlice) -> Option<&mut CudaSlice<Self>>;
    fn wrap(s: CudaSlice<Self>) -> CudaStorageSlice;
}

impl Float for f32 {
    const DTYPE: DType = DType::F32;
    fn of(s: &CudaStorageSlice) -> Option<&CudaSlice<Self>> {
        match s {
            CudaStorageSlice::F32(v) => Some(v),
            _ => None,
        }
    }
    fn of_mut(s: &mut CudaStorageSlice) -> Option<&mut CudaSlice<Self>> {
        match s {
            CudaStorageSlice::F32(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(s: CudaSlice<Self>) -> CudaStorageSlice {
        CudaStorageSlice::F32(s)
    }
}

impl Float for bf16 {
    const DTYPE: DType = DType::BF16;
    fn of(s: &CudaStorageSlice) -> Option<&CudaSlice<Self>> {
        match s {
            CudaStorageSlice::BF16(v) => Some(v),
            _ => None,
        }
    }
    fn of_mut(s: &mut CudaStorageSlice) -> Option<&mut CudaSlice<Self>> {
        match s {
            CudaStorageSlice::BF16(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(s: CudaSlice<Self>) -> CudaStorageSlice {
        CudaStorageSlice::BF16(s)
    }
}

/// Runs `$f::<T>(args)` for the float type of `$dt`, or fails naming `$op` and `$shape`.
macro_rules! by_float {
    ($dt:expr, $op:expr, $shape:expr, $f:ident($($a:expr),* $(,)?)) => {
        match $dt {
            DType::F32 => $f::<f32>($($a),*),
            DType::BF16 => $f::<bf16>($($a),*),
            other => Err(unsupported($op, other, "f32 or bf16", $shape).into()),
        }
    };
}

fn unsupported(
    op: &'static str,
    dtype: DType,
    supported: &'static str,
    shape: &Shape,
) -> KernelError {
    KernelError::UnsupportedDType {
        op,
        device: "CUDA",
        dtype,
        supported,
        shape: shape.dims().to_vec(),
    }
}

fn mismatch(op: &'static str, detail: String) -> candle_core::Error {
    KernelError::Mismatch { op, detail }.into()
}

/// The elements of the contiguous operand `(s, l)` as a typed device view.
fn view<'a, T: Float>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &'static str,
    operand: &'static str,
) -> Result<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| KernelError::NotContiguous {
            op,
            operand,
            shape: l.dims().to_vec(),
        })?;
    let slice = T::of(&s.slice).ok_or_else(|| {
        mismatch(
            op,
            format!(
                "operand {operand} is {:?}, the other operands {}",
                s.dtype(),
                T::SUFFIX
            ),
        )
    })?;
    slice.try_slice(a..b).ok_or_else(|| {
        mismatch(
            op,
            format!("operand {operand}'s view lies outside its storage"),
        )
    })
}

/// `(rows, n)` of a last-dim row kernel's input: `n` the last dim (at most [`MAX_ROW`]), rows
/// the product of the others (0 when `n` is 0: nothing to launch).
fn rows_n(op: &'static str, shape: &Shape) -> Result<(usize, usize)> {
    let n = *shape
        .dims()
        .last()
        .ok_or_else(|| mismatch(op, "needs at least one dim".into()))?;
    if n > MAX_ROW {
        return Err(KernelError::TooLarge {
            op,
            what: "a row length",
            value: n,
            limit: MAX_ROW,
            shape: shape.dims().to_vec(),
        }
        .into());
    }
    Ok((shape.elem_count().checked_div(n).unwrap_or(0), n))
}

/// One block per row: the row rounded up to a warp, 32..=1024 threads.
fn row_cfg(rows: usize, n: usize) -> LaunchConfig {
    let threads = n.div_ceil(32).clamp(1, 32) * 32;
    LaunchConfig {
        grid_dim: (rows.min(MAX_GRID_X) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elem_cfg(len: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (len.div_ceil(ELEM_THREADS).min(ELEM_MAX_BLOCKS) as u32, 1, 1),
        block_dim: (ELEM_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn wrap<T: Float>(dev: &CudaDevice, out: CudaSlice<T>) -> CudaStorage {
    CudaStorage {
        slice: T::wrap(out),
        device: dev.clone(),
    }
}

/// `len` uninitialized elements for a kernel to write.
pub(crate) fn alloc_out<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller launches, on this device's stream, a kernel (or a cuBLASLt matmul,
    // which writes every element of its output and of its bias-gradient vector, `cublaslt.rs`)
    // that writes each of the `len` elements before anything reads them (stream order); the
    // slice is not read on the host before that, and a caller that fails before the launch
    // drops it unread.
    unsafe { dev.alloc::<T>(len) }
}

fn same_shape(op: &'static str, a: &Layout, b: &Layout, what: &str) -> Result<()> {
    if a.dims() != b.dims() {
        return Err(mismatch(
            op,
            format!("{what} has shape {:?}, the input {:?}", b.dims(), a.dims()),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Typed launches

/// An element type of a kernel parameter: its suffix in kernel names (`launch_sigs.rs`).
trait KernelElem: DeviceRepr + Copy + 'static {
    const SUFFIX: &'static str;
}

impl KernelElem for f32 {
    const SUFFIX: &'static str = "f32";
}
impl KernelElem for bf16 {
    const SUFFIX: &'static str = "bf16";
}
impl KernelElem for u32 {
    const SUFFIX: &'static str = "u32";
}
impl KernelElem for i64 {
    const SUFFIX: &'static str = "i64";
}
impl KernelElem for u64 {
    const SUFFIX: &'static str = "u64";
}

/// A device buffer of `E` a kernel reads (`const E*`), pushed as cudarc pushes it (the launch
/// recorded as a read of it).
trait ArgIn<E> {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>);
}

impl<E> ArgIn<E> for CudaSlice<E> {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(self);
    }
}

impl<E> ArgIn<E> for CudaView<'_, E> {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(self);
    }
}

/// A device buffer of `E` a kernel writes (`E*`), pushed as written (`&mut`: cudarc records
/// the launch as a write of it).
trait ArgOut<E> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>);
}

impl<E> ArgOut<E> for CudaSlice<E> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        b.arg(self);
    }
}

impl<E> ArgOut<E> for CudaViewMut<'_, E> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        b.arg(self);
    }
}

/// A raw device address of `E` elements a kernel reads (`const E*`; 0 is null), for a buffer
/// no typed slice holds (an offset into a storage of several dtypes' views).
#[derive(Clone, Copy)]
struct DevAddr<E>(u64, std::marker::PhantomData<E>);

impl<E> DevAddr<E> {
    const NULL: Self = DevAddr(0, std::marker::PhantomData);

    fn new(addr: u64) -> Self {
        DevAddr(addr, std::marker::PhantomData)
    }
}

/// The null pointer an absent `Opt` parameter is passed as.
static NULL_PTR: u64 = 0;

/// The launcher `launcher`'s instance `actual` of placeholder `dom` is one of `allowed`, the
/// instances the kernels are built for (and `launch_sigs.rs`'s C++ check covers).
fn check_instance(
    launcher: &'static str,
    actual: &[(&str, std::borrow::Cow<'static, str>)],
    dom: &str,
    allowed: &[&str],
) -> Result<()> {
    match actual.iter().find(|(k, _)| *k == dom) {
        Some((_, v)) if allowed.contains(&v.as_ref()) => Ok(()),
        Some((_, v)) => Err(mismatch(
            launcher,
            format!("no kernel for {dom} = {v} (built for {allowed:?})"),
        )),
        None => Err(mismatch(
            launcher,
            format!("internal: the kernel name's placeholder {dom} is not a parameter"),
        )),
    }
}

/// One typed launcher per line of `launch_sigs.rs`, which says why (and what the emulator's
/// build checks against the kernels). `launch::NAME::<generics>(dev, cfg, values.., params..)`
/// loads the kernel its name and the instances make from its module (cached by candle per
/// device) and launches it on `dev`'s stream.
///
/// Each launcher is `unsafe`: the types make every argument's layout the kernel's, but the
/// caller guarantees what they cannot: every buffer holds the elements the kernel reads or
/// writes for the scalars given, no written buffer aliases another argument, and `cfg` is the
/// launch the kernel's indexing assumes (its block size, and a grid covering its work).
mod launch {
    use super::{
        check_instance, AdamWConsts, ArgIn, ArgOut, CudaDevice, DevAddr, FaRows, KernelElem,
        LaunchConfig, Result, WrapErr, CAST, EMBEDDING, FLASH_ATTN, GELU, MULTI_TENSOR, NORM,
        NULL_PTR, REDUCE, SOFTMAX,
    };
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use half::bf16;
    use std::borrow::Cow;

    macro_rules! cuda_kernels {
        (@ty In $e:ident) => { &dyn ArgIn<$e> };
        (@ty Out $e:ident) => { &mut dyn ArgOut<$e> };
        (@ty Opt $e:ident) => { Option<&dyn ArgIn<$e>> };
        (@ty Addr $e:ident) => { DevAddr<$e> };
        (@ty i64) => { i64 };
        (@ty i32) => { i32 };
        (@ty f32) => { f32 };
        (@ty AdamWConsts) => { AdamWConsts };
        (@ty FaRows) => { FaRows };
        (@push $b:ident In $p:ident) => { $p.push(&mut $b) };
        (@push $b:ident Out $p:ident) => { $p.push(&mut $b) };
        (@push $b:ident Opt $p:ident) => {
            match $p {
                Some(x) => x.push(&mut $b),
                None => {
                    $b.arg(&NULL_PTR);
                }
            }
        };
        (@push $b:ident Addr $p:ident) => { $b.arg(&$p.0) };
        (@push $b:ident $k:ident $p:ident) => { $b.arg(&$p) };
        ($( $launcher:ident < $($g:ident),* > $([ $($v:ident),* ])? = $module:ident $name:literal
            $( [ $dom:ident : $($inst:tt)+ ] )*
            ( $( $p:ident : $k:ident $(< $e:ident >)? ),* $(,)? ) ; )*) => {
            $(
                #[doc = concat!("Launches `", $name, "` (`launch_sigs.rs`).")]
                #[allow(clippy::too_many_arguments)]
                pub(super) unsafe fn $launcher<$($g: KernelElem),*>(
                    dev: &CudaDevice,
                    cfg: LaunchConfig,
                    $($($v: usize,)*)?
                    $( $p: cuda_kernels!(@ty $k $($e)?) ),*
                ) -> Result<()> {
                    // Each placeholder's instance: a type's suffix (no allocation), a value's
                    // digits.
                    let actual: &[(&str, Cow<'static, str>)] = &[
                        $( (stringify!($g), Cow::Borrowed(<$g as KernelElem>::SUFFIX)), )*
                        $($( (stringify!($v), Cow::Owned($v.to_string())), )*)?
                    ];
                    $( check_instance(
                        stringify!($launcher),
                        actual,
                        stringify!($dom),
                        &[$( stringify!($inst) ),+],
                    )?; )*
                    let mut name = String::from($name);
                    for (k, v) in actual {
                        name = name.replace(&format!("{{{k}}}"), v.as_ref());
                    }
                    let f = dev.get_or_load_custom_func(&name, $module.name, $module.ptx)?;
                    let mut b = f.builder();
                    $( cuda_kernels!(@push b $k $p); )*
                    // SAFETY: the arguments are the kernel's parameters in order and layout
                    // (`launch_sigs.rs`, checked against the kernel by the emulator's build);
                    // what they hold and the launch shape are the caller's (this fn's
                    // contract).
                    unsafe { b.launch(cfg) }.w()?;
                    Ok(())
                }
            )*
        };
    }

    include!("launch_sigs.rs");
}

// ---------------------------------------------------------------------------------------------
// GELU

fn gelu_launch<T: Float>(
    x: &CudaStorage,
    xl: &Layout,
    g: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let op = "gelu";
    let dev = &x.device;
    let len = xl.shape().elem_count();
    if let Some((_, gl)) = g {
        same_shape(op, xl, gl, "the output gradient")?;
    }
    if len == 0 {
        return dev.zeros_impl(xl.shape(), x.dtype());
    }
    let xv = view::<T>(x, xl, op, "x")?;
    let gv = g
        .map(|(gs, gl)| view::<T>(gs, gl, op, "grad"))
        .transpose()?;
    let mut out = alloc_out::<T>(dev, len)?;
    let (cfg, len_arg) = (elem_cfg(len), len as i64);
    // SAFETY: x, g and out hold `len` elements of T; the kernel (grid-stride) touches indices
    // below `len` only.
    unsafe {
        match &gv {
            None => launch::gelu_fwd::<T>(dev, cfg, &xv, &mut out, len_arg)?,
            Some(gv) => launch::gelu_bwd::<T>(dev, cfg, &xv, gv, &mut out, len_arg)?,
        }
    }
    Ok(wrap(dev, out))
}

/// GELU (tanh form) forward of a contiguous f32/bf16 CUDA tensor.
pub(crate) fn gelu_fwd(x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
    let s = by_float!(x.dtype(), "gelu", xl.shape(), gelu_launch(x, xl, None))?;
    Ok((s, xl.shape().clone()))
}

// ---------------------------------------------------------------------------------------------
// Softmax, scaled-causal softmax, log-softmax

fn softmax_launch<T: Float>(
    x: &CudaStorage,
    xl: &Layout,
    scale: f32,
    causal: bool,
    log: bool,
) -> Result<CudaStorage> {
    let op = if log { "log_softmax" } else { "softmax" };
    let dev = &x.device;
    let (rows, n) = rows_n(op, xl.shape())?;
    if rows == 0 {
        return dev.zeros_impl(xl.shape(), x.dtype());
    }
    let dims = xl.dims();
    let t = if dims.len() >= 2 {
        dims[dims.len() - 2]
    } else {
        1
    };
    let xv = view::<T>(x, xl, op, "x")?;
    let mut out = alloc_out::<T>(dev, rows * n)?;
    let (rows_arg, n_arg, t_arg) = (rows as i64, n as i32, t as i64);
    let (causal_arg, log_arg) = (i32::from(causal), i32::from(log));
    // SAFETY: x and out hold rows * n elements, one block a row (grid-stride); t > 0 because
    // rows > 0 is the product of the leading dims, t among them.
    unsafe {
        launch::softmax_fwd::<T>(
            dev,
            row_cfg(rows, n),
            &xv,
            &mut out,
            rows_arg,
            n_arg,
            t_arg,
            scale,
            causal_arg,
            log_arg,
        )?;
    }
    Ok(wrap(dev, out))
}

/// `softmax(scale * x)` over the last dim (causal: masked on `[.., T, S]` as the CPU kernel),
/// or log-softmax (`log`, with scale 1 and no mask).
pub(crate) fn softmax_fwd(
    x: &CudaStorage,
    xl: &Layout,
    scale: f32,
    causal: bool,
    log: bool,
) -> Result<(CudaStorage, Shape)> {
    let op = if log { "log_softmax" } else { "softmax" };
    let s = by_float!(
        x.dtype(),
        op,
        xl.shape(),
        softmax_launch(x, xl, scale, causal, log)
    )?;
    Ok((s, xl.shape().clone()))
}

fn softmax_bwd_launch<T: Float>(
    y: &CudaStorage,
    yl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
    scale: f32,
    log: bool,
) -> Result<CudaStorage> {
    let op = if log {
        "log_softmax backward"
    } else {
        "softmax backward"
    };
    let dev = &y.device;
    same_shape(op, yl, gl, "the output gradient")?;
    let (rows, n) = rows_n(op, yl.shape())?;
    if rows == 0 {
        return dev.zeros_impl(yl.shape(), y.dtype());
    }
    let yv = view::<T>(y, yl, op, "y")?;
    let gv = view::<T>(g, gl, op, "grad")?;
    let mut out = alloc_out::<T>(dev, rows * n)?;
    let (rows_arg, n_arg, log_arg) = (rows as i64, n as i32, i32::from(log));
    // SAFETY: y, g and out hold rows * n elements (same shapes, checked), one block a row.
    unsafe {
        launch::softmax_bwd::<T>(
            dev,
            row_cfg(rows, n),
            &yv,
            &gv,
            &mut out,
            rows_arg,
            n_arg,
            scale,
            log_arg,
        )?;
    }
    Ok(wrap(dev, out))
}

// ---------------------------------------------------------------------------------------------
// Layer norm, RMS norm

/// Checks a norm's weight (and bias) against the row length `n`.
fn check_affine(op: &'static str, n: usize, w: &Layout, b: Option<&Layout>) -> Result<()> {
    for (what, l) in std::iter::once(("weight", w)).chain(b.map(|b| ("bias", b))) {
        if l.shape().elem_count() != n {
            return Err(mismatch(
                op,
                format!("{what} of shape {:?} for a last dim of {n}", l.dims()),
            ));
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn norm_launch<T: Float>(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    b: Option<(&CudaStorage, &Layout)>,
    eps: f32,
    center: bool,
) -> Result<CudaStorage> {
    let op = if center { "layer_norm" } else { "rms_norm" };
    let dev = &x.device;
    let (rows, n) = rows_n(op, xl.shape())?;
    check_affine(op, n, wl, b.map(|(_, l)| l))?;
    if rows == 0 {
        return dev.zeros_impl(xl.shape(), x.dtype());
    }
    let xv = view::<T>(x, xl, op, "x")?;
    let wv = view::<T>(w, wl, op, "weight")?;
    let bv = b
        .map(|(bs, bl)| view::<T>(bs, bl, op, "bias"))
        .transpose()?;
    let mut out = alloc_out::<T>(dev, rows * n)?;
    let (rows_arg, n_arg, center_arg) = (rows as i64, n as i32, i32::from(center));
    // SAFETY: x and y hold rows * n elements, w and b (null: no bias) n (checked), one block a
    // row.
    unsafe {
        launch::norm_fwd::<T>(
            dev,
            row_cfg(rows, n),
            &xv,
            &wv,
            bv.as_ref().map(|b| b as &dyn ArgIn<T>),
            &mut out,
            rows_arg,
            n_arg,
            eps,
            center_arg,
        )?;
    }
    Ok(wrap(dev, out))
}

/// Layer norm (`center`) or RMS norm of `x` with weight `w` and optional bias over the last dim.
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_fwd(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    b: Option<(&CudaStorage, &Layout)>,
    eps: f32,
    center: bool,
) -> Result<(CudaStorage, Shape)> {
    let op = if center { "layer_norm" } else { "rms_norm" };
    let s = by_float!(
        x.dtype(),
        op,
        xl.shape(),
        norm_launch(x, xl, w, wl, b, eps, center)
    )?;
    Ok((s, xl.shape().clone()))
}

/// Rows per chunk of the first stage of the weight/bias gradient: at most 64 chunks (so the
/// second stage adds at most 64 partials per column), at least 32 rows each.
fn norm_chunk_rows(rows: usize) -> usize {
    rows.div_ceil(64).max(32)
}

/// The norm backward as one storage `[dx (rows * n) | dw (n) | db (n)]` (db all of the column
/// sums of g, also for RMS norm, where the caller drops it).
#[allow(clippy::too_many_arguments)]
fn norm_bwd_launch<T: Float>(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
    eps: f32,
    center: bool,
) -> Result<CudaStorage> {
    let op = if center {
        "layer_norm backward"
    } else {
        "rms_norm backward"
    };
    let dev = &x.device;
    same_shape(op, xl, gl, "the output gradient")?;
    let (rows, n) = rows_n(op, xl.shape())?;
    check_affine(op, n, wl, None)?;
    let total = rows * n + 2 * n;
    if total == 0 {
        return dev.zeros_impl(&Shape::from(0), x.dtype());
    }
    let mut out = alloc_out::<T>(dev, total)?;
    let n_arg = n as i32;
    if rows == 0 {
        // No rows: dw = db = 0 (the final stage adds no chunk).
        // SAFETY: with chunks 0 the kernel never reads `part` (null) and writes wb[0 .. 2n),
        // all of `out`.
        unsafe { launch::norm_bwd_final::<T>(dev, elem_cfg(n), None, &mut out, 0, n_arg)? };
        return Ok(wrap(dev, out));
    }
    let xv = view::<T>(x, xl, op, "x")?;
    let wv = view::<T>(w, wl, op, "weight")?;
    let gv = view::<T>(g, gl, op, "grad")?;
    let rn = rows * n;
    let mut stats = alloc_out::<f32>(dev, 2 * rows)?;
    let (rows_arg, center_arg) = (rows as i64, i32::from(center));
    {
        let mut dx = out.slice_mut(..rn);
        // SAFETY: x, g and dx hold rows * n elements, w n, stats 2 * rows: each row's block
        // writes its dx row and its two stats.
        unsafe {
            launch::norm_bwd_dx::<T>(
                dev,
                row_cfg(rows, n),
                &xv,
                &wv,
                &gv,
                &mut dx,
                &mut stats,
                rows_arg,
                n_arg,
                eps,
                center_arg,
            )?;
        }
    }
    let per_chunk = norm_chunk_rows(rows);
    let chunks = rows.div_ceil(per_chunk);
    let mut part = alloc_out::<f32>(dev, chunks * 2 * n)?;
    {
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block (32, 8) as the kernel requires (NB_TX, NB_TY) and grid (ceil(n / 32),
        // chunks), chunks <= 64; block (tile, chunk) reads rows of its chunk below `rows` and
        // writes part[chunk][0..2][tile columns below n]: every element of part
        // (chunks * 2 * n) is written.
        unsafe {
            launch::norm_bwd_partial::<T>(
                dev,
                cfg,
                &xv,
                &gv,
                &stats,
                &mut part,
                rows_arg,
                n_arg,
                per_chunk as i64,
            )?;
        }
    }
    {
        let mut wb = out.slice_mut(rn..);
        // SAFETY: part holds chunks * 2 * n floats, wb the last 2 * n elements of out; columns
        // below n.
        unsafe {
            launch::norm_bwd_final::<T>(
                dev,
                elem_cfg(n),
                Some(&part),
                &mut wb,
                chunks as i32,
                n_arg,
            )?;
        }
    }
    Ok(wrap(dev, out))
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy

/// The class ids of a cross-entropy: u32 or i64 (the public function converts other integer
/// types to i64).
enum Targets<'a> {
    U32(CudaView<'a, u32>),
    I64(CudaView<'a, i64>),
}

impl<'a> Targets<'a> {
    fn of(op: &'static str, s: &'a CudaStorage, l: &Layout, rows: usize) -> Result<Self> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| KernelError::NotContiguous {
                op,
                operand: "targets",
                shape: l.dims().to_vec(),
            })?;
        if b - a != rows {
            return Err(mismatch(
                op,
                format!("{} targets for {rows} rows of logits", b - a),
            ));
        }
        let outside = || mismatch(op, "the targets' view lies outside its storage".into());
        match &s.slice {
            CudaStorageSlice::U32(v) => Ok(Self::U32(v.try_slice(a..b).ok_or_else(outside)?)),
            CudaStorageSlice::I64(v) => Ok(Self::I64(v.try_slice(a..b).ok_or_else(outside)?)),
            _ => Err(unsupported(op, s.dtype(), "u32 or i64 targets", l.shape()).into()),
        }
    }
}

/// `(ignore, has_ignore)` kernel arguments.
fn ignore_args(ignore: Option<i64>) -> (i64, i32) {
    (ignore.unwrap_or(0), i32::from(ignore.is_some()))
}

fn xent_launch<T: Float>(
    x: &CudaStorage,
    xl: &Layout,
    t: &CudaStorage,
    tl: &Layout,
    ignore: Option<i64>,
) -> Result<CudaStorage> {
    let op = "cross_entropy";
    let dev = &x.device;
    let (rows, n) = rows_n(op, xl.shape())?;
    if n == 0 {
        return Err(mismatch(
            op,
            format!("logits {:?} have no classes", xl.dims()),
        ));
    }
    let tv = Targets::of(op, t, tl, rows)?;
    if rows == 0 {
        return dev.zeros_impl(&Shape::from((0, 2)), DType::F32);
    }
    let xv = view::<T>(x, xl, op, "logits")?;
    let mut out = alloc_out::<f32>(dev, 2 * rows)?;
    let (rows_arg, n_arg) = (rows as i64, n as i32);
    let (ignore_arg, has_ignore) = ignore_args(ignore);
    let cfg = row_cfg(rows, n);
    // SAFETY: x holds rows * n elements, tgt rows, out 2 * rows (each row's block writes its
    // two). A target outside [0, n) is never used as an index.
    unsafe {
        match &tv {
            Targets::U32(t) => launch::xent_fwd::<T, u32>(
                dev, cfg, &xv, t, &mut out, rows_arg, n_arg, ignore_arg, has_ignore,
            )?,
            Targets::I64(t) => launch::xent_fwd::<T, i64>(
                dev, cfg, &xv, t, &mut out, rows_arg, n_arg, ignore_arg, has_ignore,
            )?,
        }
    }
    Ok(wrap(dev, out))
}

/// Per-row `(loss, lse)` `[rows, 2]` f32 of logits `[.., C]` against `rows` class ids.
pub(crate) fn xent_fwd(
    x: &CudaStorage,
    xl: &Layout,
    t: &CudaStorage,
    tl: &Layout,
    ignore: Option<i64>,
) -> Result<(CudaStorage, Shape)> {
    let (rows, _) = rows_n("cross_entropy", xl.shape())?;
    let s = by_float!(
        x.dtype(),
        "cross_entropy",
        xl.shape(),
        xent_launch(x, xl, t, tl, ignore)
    )?;
    Ok((s, Shape::from((rows, 2))))
}

#[allow(clippy::too_many_arguments)]
fn xent_bwd_launch<T: Float>(
    x: &CudaStorage,
    xl: &Layout,
    t: &CudaStorage,
    tl: &Layout,
    lg: &CudaStorage,
    lgl: &Layout,
    ignore: Option<i64>,
) -> Result<CudaStorage> {
    let op = "cross_entropy backward";
    let dev = &x.device;
    let (rows, n) = rows_n(op, xl.shape())?;
    let tv = Targets::of(op, t, tl, rows)?;
    if lgl.shape().elem_count() != 2 * rows {
        return Err(mismatch(
            op,
            format!("(lse, grad) of shape {:?} for {rows} rows", lgl.dims()),
        ));
    }
    if rows == 0 {
        return dev.zeros_impl(xl.shape(), x.dtype());
    }
    let xv = view::<T>(x, xl, op, "logits")?;
    let lgv = view::<f32>(lg, lgl, op, "(lse, grad)")?;
    let mut out = alloc_out::<T>(dev, rows * n)?;
    let (rows_arg, n_arg) = (rows as i64, n as i32);
    let (ignore_arg, has_ignore) = ignore_args(ignore);
    let cfg = row_cfg(rows, n);
    // SAFETY: x and dx hold rows * n elements, tgt rows, lg 2 * rows (checked); each row's
    // block writes its whole dx row.
    unsafe {
        match &tv {
            Targets::U32(t) => launch::xent_bwd::<T, u32>(
                dev, cfg, &xv, t, &lgv, &mut out, rows_arg, n_arg, ignore_arg, has_ignore,
            )?,
            Targets::I64(t) => launch::xent_bwd::<T, i64>(
                dev, cfg, &xv, t, &lgv, &mut out, rows_arg, n_arg, ignore_arg, has_ignore,
            )?,
        }
    }
    Ok(wrap(dev, out))
}

// ---------------------------------------------------------------------------------------------
// Backward nodes

/// A backward kernel as a graph node of its own (applied with `apply_op*_no_bwd`).
enum Bwd {
    /// `(x, g) -> dx`.
    Gelu,
    /// `(y, g) -> dx` from the forward's output.
    Softmax { scale: f32, log: bool },
    /// `(x, w, g) -> [dx | dw | db]` flat.
    Norm { eps: f32, center: bool },
    /// `(logits, targets, (lse, g) [rows, 2] f32) -> dlogits`.
    Xent { ignore: Option<i64> },
}

impl Bwd {
    fn cpu_refused(&self) -> candle_core::Error {
        mismatch(
            "fused backward",
            "a CUDA backward node was given CPU tensors".into(),
        )
    }
}

impl CustomOp2 for Bwd {
    fn name(&self) -> &'static str {
        "fused-cuda-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(self.cpu_refused())
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let s = match *self {
            Bwd::Gelu => by_float!(
                a.dtype(),
                "gelu backward",
                al.shape(),
                gelu_launch(a, al, Some((g, gl)))
            )?,
            Bwd::Softmax { scale, log } => by_float!(
                a.dtype(),
                "softmax backward",
                al.shape(),
                softmax_bwd_launch(a, al, g, gl, scale, log)
            )?,
            _ => {
                return Err(mismatch(
                    "fused backward",
                    "a three-operand backward node was applied to two".into(),
                ))
            }
        };
        Ok((s, al.shape().clone()))
    }
}

impl CustomOp3 for Bwd {
    fn name(&self) -> &'static str {
        "fused-cuda-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(self.cpu_refused())
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
        c: &CudaStorage,
        cl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match *self {
            Bwd::Norm { eps, center } => {
                let s = by_float!(
                    a.dtype(),
                    "norm backward",
                    al.shape(),
                    norm_bwd_launch(a, al, b, bl, c, cl, eps, center)
                )?;
                let len = al.shape().elem_count() + 2 * bl.shape().elem_count();
                Ok((s, Shape::from(len)))
            }
            Bwd::Xent { ignore } => {
                let s = by_float!(
                    a.dtype(),
                    "cross_entropy backward",
                    al.shape(),
                    xent_bwd_launch(a, al, b, bl, c, cl, ignore)
                )?;
                Ok((s, al.shape().clone()))
            }
            _ => Err(mismatch(
                "fused backward",
                "a two-operand backward node was applied to three".into(),
            )),
        }
    }
}

/// The GELU gradient `dx` for input `x` and output gradient `g` (CUDA).
pub(crate) fn gelu_backward(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&g.contiguous()?, &Bwd::Gelu)
}

/// The softmax (or log-softmax, `log`) gradient from the output `y` and its gradient `g`.
pub(crate) fn softmax_backward(y: &Tensor, g: &Tensor, scale: f32, log: bool) -> Result<Tensor> {
    y.contiguous()?
        .apply_op2_no_bwd(&g.contiguous()?, &Bwd::Softmax { scale, log })
}

/// `(dx, dw, db)` of a norm (db meaningful for layer norm with a bias), shaped like x, w, w.
pub(crate) fn norm_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f32,
    center: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let packed = x.contiguous()?.apply_op3_no_bwd(
        &w.contiguous()?,
        &g.contiguous()?,
        &Bwd::Norm { eps, center },
    )?;
    let (rn, n) = (x.elem_count(), w.elem_count());
    let dx = packed.narrow(0, 0, rn)?.reshape(x.shape())?;
    // The parameter gradients get storages of their own (a parameter's gradient may be read
    // as raw storage downstream, e.g. by a reduce-scatter); dx stays a view at offset 0.
    let dw = packed
        .narrow(0, rn, n)?
        .force_contiguous()?
        .reshape(w.shape())?;
    let db = packed
        .narrow(0, rn + n, n)?
        .force_contiguous()?
        .reshape(w.shape())?;
    Ok((dx, dw, db))
}

/// The cross-entropy gradient of `logits` from `lg` = `(lse, g)` per row (`[rows, 2]` f32).
pub(crate) fn xent_backward(
    logits: &Tensor,
    targets: &Tensor,
    lg: &Tensor,
    ignore: Option<i64>,
) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &lg.contiguous()?,
        &Bwd::Xent { ignore },
    )
}

// ---------------------------------------------------------------------------------------------
// Multi-tensor: the global gradient norm and clip coefficient

/// Elements per block of the sum of squares: at least 8192, and at most 1024 blocks (the one
/// block of the second stage adds their partials).
fn sumsq_chunk(total: usize) -> usize {
    total.div_ceil(1024).max(8192)
}

/// The device address of element `range.0` of a float storage, and the guard that records the
/// read on the stream once the launch using it is enqueued. The elements `range.0..range.1`
/// must lie in the storage (an error otherwise: a launch would reach past the buffer).
fn float_ptr<'a>(
    op: &'static str,
    s: &'a CudaStorage,
    range: (usize, usize),
    stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> Result<(
    u64,
    candle_core::cuda_backend::cudarc::driver::SyncOnDrop<'a>,
)> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let (offset, end) = range;
    let inside = |len: usize| {
        if offset <= end && end <= len {
            Ok(())
        } else {
            Err(mismatch(
                op,
                format!("elements {offset}..{end} of a storage of {len}"),
            ))
        }
    };
    let (base, guard, size) = match &s.slice {
        CudaStorageSlice::F32(v) => {
            inside(v.len())?;
            let (p, g) = v.device_ptr(stream);
            (p, g, 4)
        }
        CudaStorageSlice::BF16(v) => {
            inside(v.len())?;
            let (p, g) = v.device_ptr(stream);
            (p, g, 2)
        }
        _ => return Err(mismatch(op, format!("a buffer of {:?}", s.dtype()))),
    };
    Ok((base + (offset * size) as u64, guard))
}

/// `tables` on `dev`'s stream, in one copy (`multi_tensor::Tables`: why one).
fn upload_tables(dev: &CudaDevice, tables: &Tables) -> Result<CudaSlice<u64>> {
    dev.clone_htod(tables.words())
}

/// The addresses at `r` of an uploaded [`Tables`] buffer, as the kernel's `const u64*`.
fn addr_view(buf: &CudaSlice<u64>, r: std::ops::Range<usize>) -> Result<CudaView<'_, u64>> {
    buf.try_slice(r.clone())
        .ok_or_else(|| mismatch("tables", format!("internal: range {r:?} of {}", buf.len())))
}

/// The offsets at `r` of an uploaded [`Tables`] buffer, as the kernel's `const long long*`.
fn offset_view(buf: &CudaSlice<u64>, r: std::ops::Range<usize>) -> Result<CudaView<'_, i64>> {
    let len = r.len();
    let words = addr_view(buf, r)?;
    const _: () = assert!(
        std::mem::size_of::<i64>() == std::mem::size_of::<u64>()
            && std::mem::align_of::<i64>() == std::mem::align_of::<u64>()
    );
    // SAFETY: `words` is `len` u64 of device memory; i64 has u64's size and alignment (asserted
    // above) and every bit pattern is a valid i64, so the same bytes read as `len` i64 (the
    // values `Tables::offsets` stored as bits). The view borrows `buf`, which outlives every
    // launch that reads it.
    unsafe { words.transmute::<i64>(len) }
        .ok_or_else(|| mismatch("tables", format!("internal: {len} offsets do not fit")))
}

/// `[norm, clip coefficient]` (f32 `[2]`) of the contiguous float tensors `parts` (storage,
/// layout), all of one dtype on `dev`: two launches and one small upload (the pointer table and
/// the prefix sums, in one buffer), no host read.
pub(crate) fn grad_norm(
    dev: &CudaDevice,
    parts: &[(&CudaStorage, &Layout)],
    max_norm: Option<f64>,
) -> Result<CudaStorage> {
    let op = "grad_norm";
    let dtype = parts
        .first()
        .map(|(s, _)| s.dtype())
        .ok_or_else(|| mismatch(op, "no gradients".into()))?;
    let bf16 = match dtype {
        DType::F32 => false,
        DType::BF16 => true,
        other => return Err(unsupported(op, other, "f32 or bf16", &Shape::from(0)).into()),
    };
    let stream = dev.cuda_stream();
    let mut ptrs = Vec::with_capacity(parts.len());
    let mut guards = Vec::with_capacity(parts.len());
    let mut starts = Vec::with_capacity(parts.len() + 1);
    let mut total = 0usize;
    for (s, l) in parts {
        if s.dtype() != dtype {
            return Err(mismatch(
                op,
                format!("gradients of {dtype:?} and {:?} in one call", s.dtype()),
            ));
        }
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| KernelError::NotContiguous {
                op,
                operand: "gradient",
                shape: l.dims().to_vec(),
            })?;
        let (ptr, guard) = float_ptr(op, s, (a, b), &stream)?;
        ptrs.push(ptr);
        guards.push(guard);
        starts.push(total as i64);
        total += b - a;
    }
    starts.push(total as i64);
    let max_norm = max_norm.unwrap_or(0.0) as f32;
    let mut out = alloc_out::<f32>(dev, 2)?;
    if total == 0 {
        // Nothing to sum: the finish kernel with no partials writes norm 0, coefficient 1.
        // SAFETY: with blocks 0 `partial` (null) is never read; out holds 2 floats.
        unsafe { launch::norm_finish(dev, row_cfg(1, 32), None, 0, max_norm, &mut out)? };
        drop(guards);
        return Ok(wrap(dev, out));
    }
    let chunk = sumsq_chunk(total);
    let blocks = total.div_ceil(chunk);
    let mut tables = Tables::default();
    let (ptrs_at, starts_at) = (tables.addrs(&ptrs), tables.offsets(&starts));
    let tables = upload_tables(dev, &tables)?;
    let (ptrs_dev, starts_dev) = (
        addr_view(&tables, ptrs_at)?,
        offset_view(&tables, starts_at)?,
    );
    let mut partial = alloc_out::<f32>(dev, blocks)?;
    let (cfg, k, chunk) = (row_cfg(blocks, 1024), parts.len() as i32, chunk as i64);
    // SAFETY: ptrs[i] is the address of the first element of part i, which holds
    // starts[i + 1] - starts[i] elements of the kernel's type (checked above; the storages
    // stay borrowed, and their read events are recorded by `guards` after this launch);
    // blocks = ceil(total / chunk), each writing partial[its index].
    unsafe {
        if bf16 {
            launch::sumsq_partial::<bf16>(
                dev,
                cfg,
                &ptrs_dev,
                &starts_dev,
                k,
                chunk,
                &mut partial,
            )?;
        } else {
            launch::sumsq_partial::<f32>(dev, cfg, &ptrs_dev, &starts_dev, k, chunk, &mut partial)?;
        }
    }
    // SAFETY: as above, with `blocks` partials.
    unsafe {
        launch::norm_finish(
            dev,
            row_cfg(1, 1024),
            Some(&partial),
            blocks as i32,
            max_norm,
            &mut out,
        )?;
    }
    // Record the reads of every part on the stream after the launch that made them.
    drop(guards);
    Ok(wrap(dev, out))
}

/// The f32 constants of one AdamW step (`cdt_adamw_f32`'s `AdamWConsts`, field for field).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AdamWConsts {
    pub beta1: f32,
    pub one_beta1: f32,
    pub beta2: f32,
    pub one_beta2: f32,
    pub scale_m: f32,
    pub scale_v: f32,
    pub decay: f32,
    pub eps: f32,
    pub lr: f32,
}

// SAFETY: a `#[repr(C)]` struct of nine f32, laid out as the kernel's `struct AdamWConsts` of
// nine floats (36 bytes, 4-byte aligned); passed by value as a kernel parameter.
unsafe impl DeviceRepr for AdamWConsts {}

// SAFETY: a `#[repr(C)]` struct of four i64 and an i32 (`fa_rows.rs`), laid out as the
// kernel's `struct FaRows` of four `long long` and an `int` (40 bytes with the tail padding
// both give it, 8-byte aligned); passed by value as a kernel parameter. Whatever its values,
// the launchers check them (`check_fwd`, `check_bwd`) before a launch.
unsafe impl DeviceRepr for FaRows {}

/// The `(param, grad, m, v)` quadruples of one AdamW launch and its constants (a decay group).
pub(crate) type AdamWGroup<'a> = (Vec<[(&'a CudaStorage, &'a Layout); 4]>, AdamWConsts);

/// One AdamW step in place over every `(param, grad, m, v)` of each group of `groups`
/// (contiguous f32 storages on `dev`, each quadruple of one length): one launch per non-empty
/// group, with that group's constants, and one upload of every group's tables together; `coef`
/// a device f32 whose first element multiplies every gradient (the clip coefficient), or none.
///
/// The parameters and moments are written through device addresses taken from shared
/// borrows: no host memory is involved, and the writes are ordered after every earlier use of
/// those buffers by the device's one stream (each address is taken with `device_ptr`, which
/// makes the stream wait for earlier writes). The caller (`multi_tensor::adamw_step`) checked
/// that no two of the written buffers, and no gradient, share a storage, across all groups.
pub(crate) fn adamw(
    dev: &CudaDevice,
    groups: &[AdamWGroup<'_>],
    coef: Option<(&CudaStorage, &Layout)>,
) -> Result<()> {
    let op = "adamw";
    let stream = dev.cuda_stream();
    let sets_total: usize = groups.iter().map(|(sets, _)| sets.len()).sum();
    let mut guards = Vec::with_capacity(4 * sets_total + 1);
    let mut host = Tables::default();
    // Per group with elements: its tables' ranges in `host`, its set count, its element total.
    let mut launches = Vec::with_capacity(groups.len());
    for (sets, consts) in groups {
        let mut tables: [Vec<u64>; 4] = Default::default();
        let mut starts = Vec::with_capacity(sets.len() + 1);
        let mut total = 0usize;
        for set in sets {
            let mut len = None;
            for (i, (s, l)) in set.iter().enumerate() {
                if s.dtype() != DType::F32 {
                    return Err(unsupported(op, s.dtype(), "f32", l.shape()).into());
                }
                let (a, b) = l
                    .contiguous_offsets()
                    .ok_or_else(|| KernelError::NotContiguous {
                        op,
                        operand: ["param", "grad", "m", "v"][i],
                        shape: l.dims().to_vec(),
                    })?;
                if *len.get_or_insert(b - a) != b - a {
                    return Err(mismatch(
                        op,
                        format!(
                            "a parameter and its gradient/moments differ in length ({:?})",
                            l.dims()
                        ),
                    ));
                }
                let (ptr, guard) = float_ptr(op, s, (a, b), &stream)?;
                tables[i].push(ptr);
                guards.push(guard);
            }
            starts.push(total as i64);
            total += len.unwrap_or(0);
        }
        starts.push(total as i64);
        if total == 0 {
            continue;
        }
        let [ps, gs, ms, vs] = tables;
        let at = [
            host.addrs(&ps),
            host.addrs(&gs),
            host.addrs(&ms),
            host.addrs(&vs),
            host.offsets(&starts),
        ];
        launches.push((at, sets.len(), total, *consts));
    }
    if launches.is_empty() {
        return Ok(());
    }
    let coef_ptr = match coef {
        Some((s, l)) => {
            if s.dtype() != DType::F32 {
                return Err(unsupported(op, s.dtype(), "an f32 gradient scale", l.shape()).into());
            }
            let (a, b) = l
                .contiguous_offsets()
                .filter(|(a, b)| b > a)
                .ok_or_else(|| {
                    mismatch(
                        op,
                        "the gradient scale must be a contiguous f32 of one element or more".into(),
                    )
                })?;
            let (ptr, guard) = float_ptr(op, s, (a, b), &stream)?;
            guards.push(guard);
            DevAddr::new(ptr)
        }
        None => DevAddr::NULL,
    };
    let tables = upload_tables(dev, &host)?;
    for ([ps, gs, ms, vs, starts], k, total, consts) in launches {
        let (ps, gs, ms, vs) = (
            addr_view(&tables, ps)?,
            addr_view(&tables, gs)?,
            addr_view(&tables, ms)?,
            addr_view(&tables, vs)?,
        );
        let starts = offset_view(&tables, starts)?;
        let chunk = sumsq_chunk(total);
        let blocks = total.div_ceil(chunk);
        // SAFETY: entry i of each table is the address of the first element of a contiguous
        // f32 buffer of starts[i + 1] - starts[i] elements (checked above; the storages stay
        // borrowed until `guards` is dropped after the launches); coef is null or one readable
        // f32; blocks = ceil(total / chunk) cover the group's concatenation, each element read
        // and written by one thread only (the written buffers are distinct storages, in this
        // group and across groups).
        unsafe {
            launch::adamw(
                dev,
                row_cfg(blocks, 1024),
                &ps,
                &gs,
                &ms,
                &vs,
                &starts,
                k as i32,
                chunk as i64,
                coef_ptr,
                consts,
            )?;
        }
    }
    drop(guards);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Flash attention (`cuda/flash_attn.cu`): [BH, T, d] operands, never the T x T scores

const FLASH_ATTN: Module = Module {
    name: "cdt_flash_attn",
    ptx: ptx::FLASH_ATTN,
};

/// Query (or key) rows per block and threads per block of the flash-attention kernels
/// (`FA_ROWS`, `FA_THREADS` in the source: the kernels' row mapping assumes exactly these).
const FA_ROWS: usize = 32;
const FA_THREADS: u32 = 128;
/// The largest grid dim y: the heads (batch times heads) of one launch.
pub(crate) const FA_MAX_HEADS: usize = 65_535;

/// The shape of an attention: `bh` heads of `tq` queries and `tk` keys of dim `d`.
#[derive(Clone, Copy, Debug)]
struct Fa {
    bh: usize,
    tq: usize,
    tk: usize,
    d: usize,
}

impl Fa {
    /// From `q [.., tq, d]` and `k`, `v` `[.., tk, d]` with equal leading dims (checked).
    fn of(op: &'static str, ql: &Layout, kl: &Layout, vl: &Layout) -> Result<Self> {
        let (qd, kd) = (ql.dims(), kl.dims());
        if qd.len() < 2 || kd.len() != qd.len() || vl.dims() != kd {
            return Err(mismatch(
                op,
                format!(
                    "q {:?}, k {:?}, v {:?}: [.., T, d] with k and v alike",
                    qd,
                    kd,
                    vl.dims()
                ),
            ));
        }
        let r = qd.len();
        if qd[..r - 2] != kd[..r - 2] || qd[r - 1] != kd[r - 1] {
            return Err(mismatch(
                op,
                format!("q {qd:?} and k {kd:?} differ in their leading dims or head dim"),
            ));
        }
        let s = Fa {
            bh: qd[..r - 2].iter().product(),
            tq: qd[r - 2],
            tk: kd[r - 2],
            d: qd[r - 1],
        };
        s.checked(op, qd)
    }

    /// `self` where the kernels take it (`shape`: the operand named in an error).
    fn checked(self, op: &'static str, shape: &[usize]) -> Result<Self> {
        let (s, qd) = (self, shape);
        for (what, value, limit) in [
            ("the heads (batch x heads)", s.bh, FA_MAX_HEADS),
            ("the queries", s.tq, MAX_INDEX),
            ("the keys", s.tk, MAX_INDEX),
        ] {
            if value > limit {
                return Err(KernelError::TooLarge {
                    op,
                    what,
                    value,
                    limit,
                    shape: qd.to_vec(),
                }
                .into());
            }
        }
        if !crate::flash::HEAD_DIMS.contains(&s.d) {
            return Err(mismatch(
                op,
                format!(
                    "head dim {} (q {qd:?}): the kernels are built for {:?}",
                    s.d,
                    crate::flash::HEAD_DIMS
                ),
            ));
        }
        Ok(s)
    }

    /// The tensor-core kernels' launch over `rows` (queries, or keys for dK/dV): `warps` warps
    /// a block ([`crate::flash::TENSOR_CORE_FWD_WARPS`] for the forward,
    /// [`crate::flash::TENSOR_CORE_BWD_WARPS`] for the backward kernels), 16 rows a warp.
    fn tc_cfg(&self, rows: usize, warps: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.div_ceil(16 * warps).max(1) as u32, self.bh as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Grid `(ceil(rows / 32), bh)` of 128-thread blocks.
    fn cfg(&self, rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.div_ceil(FA_ROWS).max(1) as u32, self.bh as u32, 1),
            block_dim: (FA_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The CUDA storage of a tensor the op did not receive as an operand (held by the node).
fn held<'a>(
    op: &'static str,
    what: &'static str,
    s: &'a candle_core::Storage,
) -> Result<&'a CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => Err(mismatch(op, format!("{what} is not a CUDA tensor"))),
    }
}

/// Whether the bf16 attention kernels run on tensor cores: `CDT_FLASH_TC` is not `0` and the
/// module has them (its PTX targets compute_80 or newer, the build's default: the
/// `cdt_fa_*_tc_bf16_*` kernels are compiled only there).
pub(crate) fn tensor_cores() -> bool {
    static BUILT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::flash::tensor_cores_enabled()
        && *BUILT.get_or_init(|| {
            let built = FLASH_ATTN.ptx.contains(".entry cdt_fa_fwd_tc_bf16_d");
            if !built {
                tracing::info!(
                    "the flash-attention module has no tensor-core kernels (built for an \
                     architecture before sm_80): bf16 attention runs on the SIMT kernels"
                );
            }
            built
        })
}

/// The forward on contiguous q, k, v: `(o, lse)`, o contiguous like q.
fn fa_fwd_launch<T: Float>(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    causal: bool,
    scale: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    let op = "flash_attention";
    let dev = &q.0.device;
    let s = Fa::of(op, q.1, k.1, v.1)?;
    let (qv, kv, vv) = (
        view::<T>(q.0, q.1, op, "q")?,
        view::<T>(k.0, k.1, op, "k")?,
        view::<T>(v.0, v.1, op, "v")?,
    );
    let (lq, lk) = (FaRows::contiguous(s.tq, s.d), FaRows::contiguous(s.tk, s.d));
    let ins: [(&dyn ArgIn<T>, usize); 3] = [(&qv, qv.len()), (&kv, kv.len()), (&vv, vv.len())];
    let (o, lse) = fa_fwd_rows(op, dev, s, ins, [lq, lk, lk, lq], causal, scale)?;
    Ok((wrap(dev, o), wrap(dev, lse)))
}

/// The forward on q, k and v placed by `rows[..3]` in their buffers (`ins`: each with its
/// length), o written as `rows[3]` places it into a fresh buffer of `bh tq d` elements:
/// `(o, lse)`. The placements are checked against the buffers first (`check_fwd`).
#[allow(clippy::too_many_arguments)]
fn fa_fwd_rows<T: Float>(
    op: &'static str,
    dev: &CudaDevice,
    s: Fa,
    ins: [(&dyn ArgIn<T>, usize); 3],
    rows: [FaRows; 4],
    causal: bool,
    scale: f32,
) -> Result<(CudaSlice<T>, CudaSlice<f32>)> {
    let [(q, nq), (k, nk), (v, nv)] = ins;
    let o_len = s.bh * s.tq * s.d;
    check_fwd(&rows, (s.bh, s.tq, s.tk, s.d), [nq, nk, nv, o_len]).map_err(|e| mismatch(op, e))?;
    let mut o = alloc_out::<T>(dev, o_len)?;
    let mut lse = alloc_out::<f32>(dev, s.bh * s.tq)?;
    if s.bh * s.tq > 0 {
        let (tq, tk, c) = (s.tq as i32, s.tk as i32, i32::from(causal));
        let [lq, lk, lv, lo] = rows;
        // SAFETY: the kernel is built for head dim d (`Fa::checked`; the launcher refuses
        // others). Every row of bh heads of q (tq rows), k and v (tk rows) lies in its buffer,
        // and o's bh tq rows of d lie in its o_len = bh tq d elements without overlapping
        // (`check_fwd`), so they cover o; lse holds bh tq. Block (x, h) touches rows below
        // tq / tk of head h < bh only, and writes every o and lse element of its rows; the
        // block is the thread count its row mapping assumes (128 for the SIMT kernel,
        // 32 FA_TC_FWD_WARPS for the tensor-core one, whose grid covers tq in tiles of
        // 16 FA_TC_FWD_WARPS rows: `Fa::tc_cfg`).
        unsafe {
            if T::SUFFIX == "bf16" && tensor_cores() {
                let cfg = s.tc_cfg(s.tq, crate::flash::TENSOR_CORE_FWD_WARPS);
                launch::fa_fwd_tc::<T>(
                    dev, cfg, s.d, q, k, v, &mut o, &mut lse, lq, lk, lv, lo, tq, tk, scale, c,
                )?;
            } else {
                let cfg = s.cfg(s.tq);
                launch::fa_fwd::<T>(
                    dev, cfg, s.d, q, k, v, &mut o, &mut lse, lq, lk, lv, lo, tq, tk, scale, c,
                )?;
            }
        }
    }
    Ok((o, lse))
}

/// The forward as a graph node of no backward: the output `o` (q's shape), with `lse`
/// (`[bh tq]` f32) handed over through `lse` for [`flash_fwd`] to wrap.
struct FaFwd {
    causal: bool,
    scale: f32,
    lse: std::sync::Mutex<Option<CudaStorage>>,
}

impl CustomOp3 for FaFwd {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(mismatch(
            "flash_attention",
            "the flash-attention kernels run on CUDA only".into(),
        ))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (o, lse) = by_float!(
            q.dtype(),
            "flash_attention",
            ql.shape(),
            fa_fwd_launch((q, ql), (k, kl), (v, vl), self.causal, self.scale)
        )?;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((o, ql.shape().clone()))
    }
}

/// Hands over a storage computed outside a node (an op's second output, a kernel's result) as
/// a tensor of `shape`, without a copy: the input only picks the device.
struct Handover(std::sync::Mutex<Option<(CudaStorage, Shape)>>);

impl candle_core::CustomOp1 for Handover {
    fn name(&self) -> &'static str {
        "handed-over-output"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(mismatch(
            "hand over",
            "a CUDA output handed to a CPU tensor".into(),
        ))
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| mismatch("hand over", "an output handed over twice".into()))
    }
}

fn hand_over(like: &Tensor, s: CudaStorage, shape: Shape) -> Result<Tensor> {
    like.apply_op1_no_bwd(&Handover(std::sync::Mutex::new(Some((s, shape)))))
}

// ---------------------------------------------------------------------------------------------
// Cast and bias add (a mixed-precision linear's output)

/// `f32(y) + b` for a bf16 `y [.., n]` and an f32 bias `b [n]` (or none), as a fresh f32
/// storage of y's shape: one pass (`cast.cu`). `None` where it does not apply (other dtypes, a
/// bias of another length or device): the caller casts and adds itself.
pub(crate) fn cast_add_rows(y: &Tensor, b: Option<&Tensor>) -> Result<Option<CudaStorage>> {
    let op = "cast and bias add";
    let n = *y.dims().last().unwrap_or(&0);
    let fits = y.dtype() == DType::BF16
        && crate::fused::cuda_enabled()
        && y.device().is_cuda()
        && n > 0
        && i32::try_from(n).is_ok()
        && b.is_none_or(|b| {
            b.dtype() == DType::F32 && b.dims() == [n] && b.device().same_device(y.device())
        });
    if !fits || y.elem_count() == 0 {
        return Ok(None);
    }
    let y = y.contiguous()?;
    let b = b.map(|b| b.contiguous()).transpose()?;
    let (ys, yl) = y.storage_and_layout();
    let candle_core::Storage::Cuda(ys) = &*ys else {
        return Ok(None);
    };
    let dev = &ys.device;
    let yv = view::<bf16>(ys, yl, op, "y")?;
    let len = y.elem_count();
    let mut out = alloc_out::<f32>(dev, len)?;
    let bias = b.as_ref().map(|b| b.storage_and_layout());
    let bv = match &bias {
        Some((bs, bl)) => match &**bs {
            candle_core::Storage::Cuda(bs) => Some(view::<f32>(bs, bl, op, "bias")?),
            _ => return Ok(None),
        },
        None => None,
    };
    // SAFETY: y holds len bf16 (a contiguous view), out len f32 (fresh), b either null (which
    // the kernel tests) or n f32 (a contiguous view of a bias of n elements); element i < len
    // reads y[i] and b[i % n] and writes out[i].
    unsafe {
        launch::cast_add_rows(
            dev,
            elem_cfg(len),
            &yv,
            bv.as_ref().map(|b| b as &dyn ArgIn<f32>),
            &mut out,
            len as i64,
            n as i32,
        )?;
    }
    Ok(Some(wrap(dev, out)))
}

/// `x2 @ w^T (+ b)` for a contiguous `x2 [rows, in]`, `w [out, in]` of one dtype (f32 or bf16)
/// and a bias `b [out]` of that dtype (or f32 for bf16), on one CUDA device, as a fresh storage
/// `[rows, out]` of dtype `out` (the operands' dtype, or f32 for bf16 operands) that a linear's
/// graph node hands out as its own (no tensor owns it, so the node takes it without a copy).
///
/// First as one cuBLASLt matmul with the bias in its epilogue (`crate::cublaslt`: the sum
/// rounded once, no second pass). Where cuBLASLt is off or refuses, for `out` the operands'
/// dtype: candle's GEMM called on the storages and the bias added in place (`cast.cu`; for a
/// bf16 product and an f32 bias, the bf16 product plus the bias in f32, then rounded), one pass
/// where a broadcast add writes a second tensor. `None` otherwise (other dtypes or shapes, an
/// empty operand, the fused CUDA path off, or cuBLASLt not taking a widening `out`): the caller
/// computes it with tensor ops.
pub(crate) fn linear_out(
    x2: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    out: DType,
) -> Result<Option<CudaStorage>> {
    let op = "linear";
    let dt = x2.dtype();
    if let Some(y) = crate::cublaslt::linear(x2, w, b, out)? {
        return Ok(Some(y));
    }
    if out != dt {
        return Ok(None);
    }
    let (Ok((rows, inner)), Ok((out_n, w_inner))) = (x2.dims2(), w.dims2()) else {
        return Ok(None);
    };
    let fits = crate::fused::cuda_enabled()
        && matches!(dt, DType::F32 | DType::BF16)
        && x2.device().is_cuda()
        && w.device().same_device(x2.device())
        && w.dtype() == dt
        && w_inner == inner
        && rows > 0
        && inner > 0
        && out_n > 0
        && i32::try_from(out_n).is_ok()
        && x2.is_contiguous()
        // A column-narrowed weight is a layout candle's GEMM refuses: the caller's tensor path
        // then reports it (or copies where it may).
        && w.is_contiguous()
        && b.is_none_or(|b| {
            (b.dtype() == dt || (dt == DType::BF16 && b.dtype() == DType::F32))
                && b.dims() == [out_n]
                && b.device().same_device(x2.device())
        });
    if !fits {
        return Ok(None);
    }
    let wt = w.t()?;
    let mut out = {
        let (xs, xl) = x2.storage_and_layout();
        let (ws, wl) = wt.storage_and_layout();
        let (candle_core::Storage::Cuda(xs), candle_core::Storage::Cuda(ws)) = (&*xs, &*ws) else {
            return Ok(None);
        };
        // As `Tensor::matmul` calls it for `[rows, in] @ [in, out]`: one batch, m = rows,
        // n = out, k = in, the transposed weight's strided layout.
        xs.matmul(ws, (1, rows, out_n, inner), xl, wl)?
    };
    if let Some(b) = b {
        let b = b.contiguous()?;
        let (bs, bl) = b.storage_and_layout();
        let candle_core::Storage::Cuda(bs) = &*bs else {
            return Ok(None);
        };
        let (len, n) = (rows * out_n, out_n as i32);
        match (dt, b.dtype()) {
            (DType::F32, DType::F32) => add_rows_launch::<f32, f32>(&mut out, bs, bl, len, n)?,
            (DType::BF16, DType::BF16) => add_rows_launch::<bf16, bf16>(&mut out, bs, bl, len, n)?,
            (DType::BF16, DType::F32) => add_rows_launch::<bf16, f32>(&mut out, bs, bl, len, n)?,
            (y, b) => {
                return Err(mismatch(
                    op,
                    format!("a {b:?} bias for a {y:?} product (checked above)"),
                ))
            }
        }
    }
    Ok(Some(out))
}

/// `A @ B` as one cuBLASLt matmul written in `out` (`crate::cublaslt::gemm_epi`: `A` is `a`, or
/// its transpose with `a_t`; `B` is `b`, or its transpose with `b_t`), as a tensor without a
/// graph node, and with `bgrad` the bias gradient from its epilogue (`[M]`, the sums of `A`'s
/// rows: for a weight gradient `g^T x`, `g`'s column sums; no second pass over `g`): a linear's
/// backward GEMMs, whose bf16 products go straight into the f32 gradients (no bf16 write and
/// cast pass). `None` where cuBLASLt is off, does not apply or refuses.
pub(crate) fn gemm_to(
    a: &Tensor,
    a_t: bool,
    b: &Tensor,
    b_t: bool,
    bgrad: bool,
    out: DType,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    use crate::cublaslt::Epi;
    let epi = if bgrad { Epi::BgradB } else { Epi::None };
    let Some(p) = crate::cublaslt::gemm_epi(a, a_t, b, b_t, epi, out)? else {
        return Ok(None);
    };
    let c = hand_over(a, p.c, Shape::from((p.rows, p.cols)))?;
    let db =
        p.db.map(|d| hand_over(a, d, Shape::from(p.rows)))
            .transpose()?;
    Ok(Some((c, db)))
}

fn add_rows_launch<T: Float, B: Float>(
    y: &mut CudaStorage,
    b: &CudaStorage,
    bl: &Layout,
    len: usize,
    n: i32,
) -> Result<()> {
    let op = "linear bias add";
    let dev = y.device.clone();
    let bv = view::<B>(b, bl, op, "bias")?;
    let yv = T::of_mut(&mut y.slice)
        .ok_or_else(|| mismatch(op, format!("the product is not {}", T::SUFFIX)))?;
    if yv.len() != len {
        return Err(mismatch(
            op,
            format!("a product of {} elements for {len}", yv.len()),
        ));
    }
    // SAFETY: y holds exactly len elements of T (checked above; the GEMM's fresh output), b n
    // elements of B (a contiguous view of a bias of n elements, checked by the caller); element
    // i < len reads and writes y[i] and reads b[i % n].
    unsafe { launch::add_rows::<T, B>(&dev, elem_cfg(len), yv, &bv, len as i64, n) }
}

// ---------------------------------------------------------------------------------------------
// Column sum (bias gradients)

/// `out[c] = sum over rows of g[r, c]` for `g` (f32 or bf16, any shape whose element count `n`
/// divides) viewed as `[rows, n]`, of g's dtype: `reduce.cu`'s two kernels (f32 partials of
/// [`crate::fused::COL_SUM_ROWS`] rows, then their sum in order).
pub(crate) fn col_sum(g: &Tensor, n: usize) -> Result<Tensor> {
    col_sum_as(g, n, g.dtype())
}

/// [`col_sum`] with the sums in `dtype`: g's own, or f32 for a bf16 `g` (the f32 partials
/// added by the f32 final kernel: no rounding of the sum to bf16, and no cast pass over g).
pub(crate) fn col_sum_as(g: &Tensor, n: usize, dtype: DType) -> Result<Tensor> {
    let op = "column sum";
    let g = g.contiguous()?;
    let rows = g.elem_count() / n;
    let chunks = rows.div_ceil(crate::fused::COL_SUM_ROWS).max(1);
    let too_large = |what: &'static str, value: usize, limit: usize| {
        candle_core::Error::from(KernelError::TooLarge {
            op,
            what,
            value,
            limit,
            shape: vec![rows, n],
        })
    };
    // A column index is `blockIdx.x * blockDim.x + threadIdx.x`, up to a block past `n`.
    let n_arg = i32::try_from(n)
        .ok()
        .filter(|_| n <= MAX_INDEX)
        .ok_or_else(|| too_large("a row length", n, MAX_INDEX))?;
    if chunks > 65_535 {
        return Err(too_large("row chunks (grid dim y)", chunks, 65_535));
    }
    let (gs, gl) = g.storage_and_layout();
    let candle_core::Storage::Cuda(gs) = &*gs else {
        return Err(mismatch(op, "the gradient is not a CUDA tensor".into()));
    };
    let out = match (g.dtype(), dtype) {
        (DType::F32, DType::F32) => col_sum_launch::<f32, f32>(gs, gl, rows, n_arg, chunks)?,
        (DType::BF16, DType::BF16) => col_sum_launch::<bf16, bf16>(gs, gl, rows, n_arg, chunks)?,
        (DType::BF16, DType::F32) => col_sum_launch::<bf16, f32>(gs, gl, rows, n_arg, chunks)?,
        (DType::F32 | DType::BF16, other) => {
            return Err(unsupported(op, other, "the input's dtype or f32", gl.shape()).into())
        }
        (other, _) => return Err(unsupported(op, other, "f32 or bf16", gl.shape()).into()),
    };
    hand_over(&g, out, Shape::from(n))
}

/// The two column-sum launches: partials read from `g` (of T), the final sums written as O
/// (T, or f32: `cdt_col_sum_final_f32` reads the same f32 partials whatever T was).
fn col_sum_launch<T: Float, O: Float>(
    g: &CudaStorage,
    gl: &Layout,
    rows: usize,
    n: i32,
    chunks: usize,
) -> Result<CudaStorage> {
    let op = "column sum";
    let dev = &g.device;
    let gv = view::<T>(g, gl, op, "x")?;
    let mut part = alloc_out::<f32>(dev, chunks * n as usize)?;
    let mut out = alloc_out::<O>(dev, n as usize)?;
    let threads = crate::fused::COL_SUM_THREADS;
    let bx = (n as u32).div_ceil(threads);
    let cfg = |grid_y: usize| LaunchConfig {
        grid_dim: (bx, grid_y as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x holds rows n elements (a contiguous view), part chunks n floats (fresh); thread
    // column c < n of block row `by` < chunks reads x[r n + c] for its rows r < rows and writes
    // part[by n + c], every element of part once.
    unsafe { launch::col_sum_partial::<T>(dev, cfg(chunks), &gv, &mut part, rows as i64, n)? };
    // SAFETY: `cdt_col_sum_final_{O}` (the final sums' type, whatever T was): part holds chunks
    // n floats written by the launch before on the same stream, out n elements of O (fresh);
    // thread c < n reads part[k n + c] and writes out[c].
    unsafe { launch::col_sum_final::<O>(dev, cfg(1), &part, &mut out, chunks as i32, n)? };
    Ok(wrap(dev, out))
}

// ---------------------------------------------------------------------------------------------
// Embedding backward

/// The gradient of `table [vocab, d]` (f32 or bf16) from an embedding lookup's output gradient
/// `g [n, d]` at u32 `ids [n]`: zeros plus, for each id, its positions' gradient rows summed in
/// position order (`embedding.cu`: a block per position, the first position of an id sums for
/// it; no atomics, the same bits on every run). An id >= vocab contributes nothing.
pub(crate) fn embedding_grad(table: &Tensor, ids: &Tensor, g: &Tensor) -> Result<Tensor> {
    let op = "embedding backward";
    let (vocab, d) = table.dims2()?;
    let n = ids.elem_count();
    let g = g.contiguous()?;
    let ids = ids.contiguous()?;
    if g.dims() != [n, d] {
        return Err(mismatch(
            op,
            format!(
                "gradient of shape {:?} for {n} ids of a [{vocab}, {d}] table",
                g.dims()
            ),
        ));
    }
    // An element index is a column block's start plus `threadIdx.x`, up to a block past `d`.
    let int = |what: &'static str, v: usize| {
        i32::try_from(v)
            .ok()
            .filter(|_| v <= MAX_INDEX)
            .ok_or_else(|| {
                candle_core::Error::from(KernelError::TooLarge {
                    op,
                    what,
                    value: v,
                    limit: MAX_INDEX,
                    shape: vec![vocab, d],
                })
            })
    };
    let (n_arg, d_arg, v_arg) = (
        int("positions", n)?,
        int("a row length", d)?,
        int("a vocabulary", vocab)?,
    );
    let (is, il) = ids.storage_and_layout();
    let (gs, gl) = g.storage_and_layout();
    let (candle_core::Storage::Cuda(is), candle_core::Storage::Cuda(gs)) = (&*is, &*gs) else {
        return Err(mismatch(op, "ids and gradient are not CUDA tensors".into()));
    };
    let dev = &gs.device;
    let mut out = dev.zeros_impl(&Shape::from((vocab, d)), table.dtype())?;
    if n > 0 && d > 0 {
        let (a, b) = il
            .contiguous_offsets()
            .ok_or_else(|| KernelError::NotContiguous {
                op,
                operand: "ids",
                shape: il.dims().to_vec(),
            })?;
        let CudaStorageSlice::U32(iv) = &is.slice else {
            return Err(mismatch(op, format!("ids are {:?}, not u32", is.dtype())));
        };
        let iv = iv
            .try_slice(a..b)
            .ok_or_else(|| mismatch(op, "the ids' view lies outside their storage".into()))?;
        by_float!(
            table.dtype(),
            op,
            &Shape::from((vocab, d)),
            embedding_launch(dev, &iv, n_arg, gs, gl, &mut out, d_arg, v_arg)
        )?;
    }
    hand_over(table, out, Shape::from((vocab, d)))
}

#[allow(clippy::too_many_arguments)]
fn embedding_launch<T: Float>(
    dev: &CudaDevice,
    ids: &CudaView<'_, u32>,
    n: i32,
    g: &CudaStorage,
    gl: &Layout,
    out: &mut CudaStorage,
    d: i32,
    vocab: i32,
) -> Result<()> {
    let op = "embedding backward";
    let gv = view::<T>(g, gl, op, "grad")?;
    // Passed as written (`&mut`): cudarc then records the launch as a write of it.
    let ov = T::of_mut(&mut out.slice)
        .ok_or_else(|| mismatch(op, format!("the table gradient is not {}", T::SUFFIX)))?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (crate::fused::EMBEDDING_BWD_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: ids holds n u32, g n d elements of T (contiguous views of those lengths, checked
    // by the caller's shape test), dtable vocab d (a fresh allocation); block j < n reads ids
    // and the rows of g at positions holding ids[j], and writes row ids[j] < vocab of dtable
    // only, as the first position holding it (no other block writes that row). The block size
    // is the EMB_THREADS the kernel's launch bounds declare.
    unsafe { launch::embedding_bwd::<T>(dev, cfg, ids, n, &gv, ov, d, vocab) }
}

/// `(o, lse)`: attention of contiguous `q [.., tq, d]`, `k`, `v` `[.., tk, d]` (f32 or bf16,
/// one CUDA device), `lse` f32 of q's leading dims and tq. No graph node for backward.
pub(crate) fn flash_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let op = FaFwd {
        causal,
        scale,
        lse: std::sync::Mutex::new(None),
    };
    let o = q.apply_op3_no_bwd(k, v, &op)?;
    let lse = op
        .lse
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .ok_or_else(|| mismatch("flash_attention", "the forward wrote no lse".into()))?;
    let dims = q.dims();
    let lse = hand_over(q, lse, Shape::from(&dims[..dims.len() - 1]))?;
    Ok((o, lse))
}

/// The gradients of a backward launch: dQ in its own buffer and dK, dV in one (`[2, ..]`), or
/// all three in one packed buffer.
enum FaGrads {
    Split(CudaStorage, CudaStorage),
    Packed(CudaStorage),
}

/// The backward on q, k, v, o and d_o placed by `rows` in their buffers (`ins`: each with its
/// length) and lse (`[bh tq]` f32). `packed`: dQ, dK and dV written as `rows` places them into
/// one fresh buffer of `3 bh tq d` elements (tq = tk); else dQ into one of `bh tq d` and dK, dV
/// into one of `2 bh tk d`. The placements are checked against the buffers first
/// (`check_bwd`).
#[allow(clippy::too_many_arguments)]
fn fa_bwd_rows<T: Float>(
    op: &'static str,
    dev: &CudaDevice,
    s: Fa,
    ins: [(&dyn ArgIn<T>, usize); 5],
    lse: &CudaView<'_, f32>,
    rows: FaBwdRows,
    packed: bool,
    causal: bool,
    scale: f32,
) -> Result<FaGrads> {
    let [(q, nq), (k, nk), (v, nv), (o, no), (d_o, ndo)] = ins;
    let (lq, lk) = (s.bh * s.tq * s.d, s.bh * s.tk * s.d);
    let (dq_len, dkv_len) = if packed {
        (3 * lq, None)
    } else {
        (lq, Some(2 * lk))
    };
    check_bwd(
        &rows,
        (s.bh, s.tq, s.tk, s.d),
        [nq, nk, nv, no, ndo, dq_len],
        dkv_len,
    )
    .map_err(|e| mismatch(op, e))?;
    let nrows = s.bh * s.tq;
    if lse.len() != nrows {
        return Err(mismatch(
            op,
            format!("lse of {} elements, not {nrows}", lse.len()),
        ));
    }
    if nrows == 0 || s.tk == 0 {
        // Nothing attended to: every gradient is zero.
        let z = |n: usize| dev.zeros_impl(&Shape::from(n), T::DTYPE);
        return Ok(match dkv_len {
            None => FaGrads::Packed(z(dq_len)?),
            Some(n) => FaGrads::Split(z(dq_len)?, z(n)?),
        });
    }
    let mut dq = alloc_out::<T>(dev, dq_len)?;
    let mut dkv_own = dkv_len.map(|n| alloc_out::<T>(dev, n)).transpose()?;
    let mut delta = alloc_out::<f32>(dev, nrows)?;
    let [ro, rdo] = [rows.o, rows.d_o];
    // SAFETY: o's and d_o's rows of bh heads lie in their buffers (`check_bwd`); delta holds
    // nrows = bh tq; grid-stride over the rows, each written once.
    unsafe {
        launch::fa_bwd_delta::<T>(
            dev,
            elem_cfg(nrows),
            s.d,
            o,
            d_o,
            &mut delta,
            ro,
            rdo,
            nrows as i64,
            s.tq as i32,
        )?;
    }
    let (tq, tk, c) = (s.tq as i32, s.tk as i32, i32::from(causal));
    // dK and dV (a block per key tile), then dQ (a block per query tile): the same inputs, their
    // own outputs and grid; bf16 on tensor cores (`tensor_cores`), as the forward.
    let tc = T::SUFFIX == "bf16" && tensor_cores();
    let (dkv_cfg, dq_cfg) = if tc {
        let w = crate::flash::TENSOR_CORE_BWD_WARPS;
        (s.tc_cfg(s.tk, w), s.tc_cfg(s.tq, w))
    } else {
        (s.cfg(s.tk), s.cfg(s.tq))
    };
    let FaBwdRows {
        q: rq,
        k: rk,
        v: rv,
        dq: rdq,
        dk: rdk,
        dv: rdv,
        ..
    } = rows;
    // SAFETY: every row read lies in its buffer, and the rows written (dK's and dV's into
    // their buffer, dQ's into its own, or all three into one packed buffer) lie in it without
    // overlapping (`check_bwd`); written buffers are fresh, so no written row aliases an
    // input. Their rows (bh heads of tq or tk rows of d) number exactly the buffers' lengths,
    // so the two launches cover them. delta is written by the launch before on the same
    // stream; block (x, h) writes its key rows (dkv) or query rows (dq) below tk / tq of head
    // h only, every element of them; the launch is the one the kernel indexes by (`Fa::cfg`
    // for the SIMT kernels, `Fa::tc_cfg` for the tensor-core ones). The dK/dV launch and the
    // dQ launch write disjoint rows of a shared buffer, in stream order.
    unsafe {
        let dkv: &mut CudaSlice<T> = match dkv_own.as_mut() {
            Some(b) => b,
            None => &mut dq,
        };
        if tc {
            launch::fa_bwd_dkv_tc::<T>(
                dev, dkv_cfg, s.d, q, k, v, d_o, lse, &delta, dkv, rq, rk, rv, rdo, rdk, rdv, tq,
                tk, scale, c,
            )?;
        } else {
            launch::fa_bwd_dkv::<T>(
                dev, dkv_cfg, s.d, q, k, v, d_o, lse, &delta, dkv, rq, rk, rv, rdo, rdk, rdv, tq,
                tk, scale, c,
            )?;
        }
        if tc {
            launch::fa_bwd_dq_tc::<T>(
                dev, dq_cfg, s.d, q, k, v, d_o, lse, &delta, &mut dq, rq, rk, rv, rdo, rdq, tq, tk,
                scale, c,
            )?;
        } else {
            launch::fa_bwd_dq::<T>(
                dev, dq_cfg, s.d, q, k, v, d_o, lse, &delta, &mut dq, rq, rk, rv, rdo, rdq, tq, tk,
                scale, c,
            )?;
        }
    }
    Ok(match dkv_own {
        Some(dkv) => FaGrads::Split(wrap(dev, dq), wrap(dev, dkv)),
        None => FaGrads::Packed(wrap(dev, dq)),
    })
}

/// The backward on contiguous operands: dQ, and dK, dV in one storage (`[2, ..k]`).
#[allow(clippy::too_many_arguments)]
fn fa_bwd_launch<T: Float>(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    o: (&CudaStorage, &Layout),
    d_o: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    causal: bool,
    scale: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    let op = "flash_attention backward";
    let dev = &q.0.device;
    let s = Fa::of(op, q.1, k.1, v.1)?;
    same_shape(op, q.1, o.1, "the output")?;
    same_shape(op, q.1, d_o.1, "the output gradient")?;
    if lse.0.dtype() != DType::F32 {
        return Err(mismatch(op, format!("lse of {:?}, not f32", lse.0.dtype())));
    }
    let (qv, kv, vv) = (
        view::<T>(q.0, q.1, op, "q")?,
        view::<T>(k.0, k.1, op, "k")?,
        view::<T>(v.0, v.1, op, "v")?,
    );
    let (ov, dov) = (
        view::<T>(o.0, o.1, op, "o")?,
        view::<T>(d_o.0, d_o.1, op, "d_o")?,
    );
    let lsev = view::<f32>(lse.0, lse.1, op, "lse")?;
    let ins: [(&dyn ArgIn<T>, usize); 5] = [
        (&qv, qv.len()),
        (&kv, kv.len()),
        (&vv, vv.len()),
        (&ov, ov.len()),
        (&dov, dov.len()),
    ];
    let rows = FaBwdRows::contiguous(s.bh, s.tq, s.tk, s.d);
    match fa_bwd_rows(op, dev, s, ins, &lsev, rows, false, causal, scale)? {
        FaGrads::Split(dq, dkv) => Ok((dq, dkv)),
        FaGrads::Packed(_) => Err(mismatch(op, "internal: a packed gradient".into())),
    }
}

/// The backward as a graph node over `(q, k, v)` holding the forward's `o`, `lse` and the
/// output gradient: `dq` is its output, dK and dV (one storage) are handed over through `dkv`.
struct FaBwd {
    causal: bool,
    scale: f32,
    o: Tensor,
    d_o: Tensor,
    lse: Tensor,
    dkv: std::sync::Mutex<Option<CudaStorage>>,
}

impl CustomOp3 for FaBwd {
    fn name(&self) -> &'static str {
        "flash-attention-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(mismatch(
            "flash_attention backward",
            "the flash-attention kernels run on CUDA only".into(),
        ))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "flash_attention backward";
        // Read guards on the held tensors: fresh outputs and gradients, never the storage of
        // q, k or v (whose guards candle holds around this call).
        let (os, ol) = self.o.storage_and_layout();
        let (gs, gl) = self.d_o.storage_and_layout();
        let (ls, ll) = self.lse.storage_and_layout();
        let (dq, dkv) = by_float!(
            q.dtype(),
            op,
            ql.shape(),
            fa_bwd_launch(
                (q, ql),
                (k, kl),
                (v, vl),
                (held(op, "o", &os)?, ol),
                (held(op, "the output gradient", &gs)?, gl),
                (held(op, "lse", &ls)?, ll),
                self.causal,
                self.scale,
            )
        )?;
        *self.dkv.lock().unwrap_or_else(|e| e.into_inner()) = Some(dkv);
        Ok((dq, ql.shape().clone()))
    }
}

/// `(dq, dk, dv)` of [`flash_fwd`] from its inputs, output `o`, `lse` and the output gradient
/// `g` (all contiguous made here). dK and dV are views of one storage.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    g: &Tensor,
    causal: bool,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let node = FaBwd {
        causal,
        scale,
        o: o.contiguous()?,
        d_o: g.contiguous()?,
        lse: lse.contiguous()?,
        dkv: std::sync::Mutex::new(None),
    };
    let dq = q.apply_op3_no_bwd(&k, &v, &node)?;
    let dkv = node
        .dkv
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .ok_or_else(|| mismatch("flash_attention backward", "no dk/dv written".into()))?;
    let mut dims = vec![2];
    dims.extend_from_slice(k.dims());
    let dkv = hand_over(&k, dkv, Shape::from(dims))?;
    Ok((dq, dkv.get(0)?, dkv.get(1)?))
}

/// The whole slice of a storage of `T` (its rows placed by `FaRows`, checked against its
/// length), or an error naming the operand.
fn whole<'a, T: Float>(
    op: &'static str,
    c: &'a CudaStorage,
    what: &str,
) -> Result<&'a CudaSlice<T>> {
    T::of(&c.slice).ok_or_else(|| {
        mismatch(
            op,
            format!(
                "{what} is {:?}, the kernels' operands {}",
                c.dtype(),
                T::SUFFIX
            ),
        )
    })
}

/// The dims and strides of `l` seen as heads: `[B, T, H, 3, d]` (`packed`) or `[B, T, H, d]`,
/// either as they are or, `flat` = `Some(H)`, from a `[B, T, 3 H d]` or `[B, T, H d]` layout
/// (the views are free: the last dim is unit-stride).
fn heads_view(
    op: &'static str,
    l: &Layout,
    flat: Option<usize>,
    packed: bool,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let (dims, st) = (l.dims(), l.stride());
    let parts = if packed { 3 } else { 1 };
    let bad = || {
        let want = match (flat, packed) {
            (Some(h), true) => format!("[B, T, 3 x {h} heads x d]"),
            (Some(h), false) => format!("[B, T, {h} heads x d]"),
            (None, true) => "[B, T, H, 3, d]".to_string(),
            (None, false) => "[B, T, H, d]".to_string(),
        };
        mismatch(
            op,
            format!("a layout of {dims:?} strides {st:?}: {want} with a unit-stride last dim"),
        )
    };
    let Some(h) = flat else {
        let rank = if packed { 5 } else { 4 };
        if dims.len() != rank || st[rank - 1] != 1 || (packed && dims[3] != 3) {
            return Err(bad());
        }
        return Ok((dims.to_vec(), st.to_vec()));
    };
    if dims.len() != 3 || st[2] != 1 || h == 0 || dims[2] % (parts * h) != 0 {
        return Err(bad());
    }
    let d = dims[2] / (parts * h);
    Ok(if packed {
        (
            vec![dims[0], dims[1], h, 3, d],
            vec![st[0], st[1], 3 * d, d, 1],
        )
    } else {
        (vec![dims[0], dims[1], h, d], vec![st[0], st[1], d, 1])
    })
}

/// Where part `part` of a heads view (`heads_view`: `[B, T, H, 3, d]`, or, `part` `None`,
/// `[B, T, H, d]`, of dims `dims` and strides `st` from element `start`) lies as heads
/// `b H + h` of T rows.
fn head_rows(
    op: &'static str,
    (dims, st): (&[usize], &[usize]),
    start: usize,
    part: Option<usize>,
) -> Result<FaRows> {
    let i = |v: usize| {
        i64::try_from(v).map_err(|_| mismatch(op, format!("a stride or offset {v} beyond i64")))
    };
    let heads = i32::try_from(dims[2])
        .map_err(|_| mismatch(op, format!("{} heads beyond i32", dims[2])))?;
    Ok(FaRows {
        off: i(start + part.map_or(0, |p| p * st[3]))?,
        sb: i(st[0])?,
        sh: i(st[2])?,
        st: i(st[1])?,
        heads: heads.max(1),
    })
}

/// Attention on a packed projection `qkv [B, T, H, 3, d]` -> `o [B, T, H, d]` as one graph
/// node (or, `flat` = `Some(H)`, on the projection as the linear makes it, `[B, T, 3 H d]` ->
/// `[B, T, H d]`, the same memory seen without the reshapes and their graph edges): the
/// forward kernel reads q, k and v where the projection holds them and writes o as
/// `[B, T, H, d]`; the backward kernels read the projection, o and its gradient as they are
/// and write dQ, dK and dV into one packed gradient. No copy unpacks, transposes or stacks
/// anything; the node's output is the kernel's storage. `lse` (`[B H, T]` f32) is kept for
/// the backward.
struct FaPacked {
    causal: bool,
    scale: f32,
    flat: Option<usize>,
    lse: std::sync::Mutex<Option<CudaStorage>>,
}

impl FaPacked {
    const OP: &'static str = "flash_attention (packed)";

    /// The shape of the attention, its batch and heads, and the rows of q, k and v in `l`.
    fn shape(&self, l: &Layout) -> Result<(Fa, (usize, usize), [FaRows; 3])> {
        let (dims, st) = heads_view(Self::OP, l, self.flat, true)?;
        let view = (dims.as_slice(), st.as_slice());
        let [q, k, v] = [0, 1, 2].map(|p| head_rows(Self::OP, view, l.start_offset(), Some(p)));
        let s = Fa {
            bh: dims[0] * dims[2],
            tq: dims[1],
            tk: dims[1],
            d: dims[4],
        }
        .checked(Self::OP, l.dims())?;
        Ok((s, (dims[0], dims[2]), [q?, k?, v?]))
    }

    /// The output's shape for heads `[b, t, h, d]`.
    fn out_shape(&self, [b, t, h, d]: [usize; 4]) -> Shape {
        match self.flat {
            Some(_) => Shape::from((b, t, h * d)),
            None => Shape::from((b, t, h, d)),
        }
    }
}

/// [`FaPacked`]'s forward on a storage of `T`.
fn fa_packed_fwd<T: Float>(
    node: &FaPacked,
    x: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (s, (b, h), [q, k, v]) = node.shape(l)?;
    let (t, d) = (s.tq, s.d);
    let xs = whole::<T>(FaPacked::OP, x, "qkv")?;
    let ins: [(&dyn ArgIn<T>, usize); 3] = [(xs, xs.len()), (xs, xs.len()), (xs, xs.len())];
    let o_rows = FaRows::interleaved(t, h, 1, 0, d);
    let dev = &x.device;
    let (o, lse) = fa_fwd_rows(
        FaPacked::OP,
        dev,
        s,
        ins,
        [q, k, v, o_rows],
        node.causal,
        node.scale,
    )?;
    *node.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(wrap(dev, lse));
    Ok((wrap(dev, o), node.out_shape([b, t, h, d])))
}

/// [`FaPacked`]'s backward on storages of `T`: the packed gradient.
fn fa_packed_bwd<T: Float>(
    node: &FaPacked,
    x: (&CudaStorage, &Layout),
    o: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let op = "flash_attention (packed) backward";
    let (s, (b, h), [rq, rk, rv]) = node.shape(x.1)?;
    let want = node.out_shape([b, s.tq, h, s.d]);
    if o.1.shape() != &want || g.1.shape() != &want {
        return Err(mismatch(
            op,
            format!(
                "output {:?} and gradient {:?}, not {want:?}",
                o.1.dims(),
                g.1.dims()
            ),
        ));
    }
    let rows_of = |l: &Layout| -> Result<FaRows> {
        let (dims, st) = heads_view(op, l, node.flat, false)?;
        head_rows(op, (&dims, &st), l.start_offset(), None)
    };
    let (ro, rg) = (rows_of(o.1)?, rows_of(g.1)?);
    let (xs, os, gs) = (
        whole::<T>(op, x.0, "qkv")?,
        whole::<T>(op, o.0, "o")?,
        whole::<T>(op, g.0, "the gradient")?,
    );
    let lse = node.lse.lock().unwrap_or_else(|e| e.into_inner());
    let lse = lse
        .as_ref()
        .ok_or_else(|| mismatch(op, "no forward ran (no lse)".into()))?;
    let lsev = match &lse.slice {
        CudaStorageSlice::F32(v) => v.as_view(),
        _ => return Err(mismatch(op, "lse is not f32".into())),
    };
    let (t, d) = (s.tq, s.d);
    let part = |p| FaRows::interleaved(t, h, 3, p, d);
    let rows = FaBwdRows {
        q: rq,
        k: rk,
        v: rv,
        o: ro,
        d_o: rg,
        dq: part(0),
        dk: part(1),
        dv: part(2),
    };
    let ins: [(&dyn ArgIn<T>, usize); 5] = [
        (xs, xs.len()),
        (xs, xs.len()),
        (xs, xs.len()),
        (os, os.len()),
        (gs, gs.len()),
    ];
    match fa_bwd_rows(
        op,
        &x.0.device,
        s,
        ins,
        &lsev,
        rows,
        true,
        node.causal,
        node.scale,
    )? {
        FaGrads::Packed(dx) => Ok(dx),
        FaGrads::Split(..) => Err(mismatch(op, "internal: a split gradient".into())),
    }
}

impl candle_core::CustomOp1 for FaPacked {
    fn name(&self) -> &'static str {
        "flash-attention-packed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(mismatch(
            Self::OP,
            "the flash-attention kernels run on CUDA only".into(),
        ))
    }

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        by_float!(x.dtype(), Self::OP, l.shape(), fa_packed_fwd(self, x, l))
    }

    fn bwd(&self, x: &Tensor, o: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let op = "flash_attention (packed) backward";
        // A gradient whose last dim is strided (never made by the ops here) is copied first.
        let g = if g.stride().last() == Some(&1) {
            g.clone()
        } else {
            g.contiguous()?
        };
        let dx = {
            let (xs, xl) = x.storage_and_layout();
            let (os, ol) = o.storage_and_layout();
            let (gs, gl) = g.storage_and_layout();
            let (xc, oc, gc) = (
                held(op, "qkv", &xs)?,
                held(op, "o", &os)?,
                held(op, "the gradient", &gs)?,
            );
            by_float!(
                xc.dtype(),
                op,
                xl.shape(),
                fa_packed_bwd(self, (xc, xl), (oc, ol), (gc, gl))
            )?
        };
        hand_over(x, dx, x.shape().clone()).map(Some)
    }
}

/// Attention on a packed projection `qkv [B, T, H, 3, d]` (f32 or bf16, a unit-stride last
/// dim) -> `[B, T, H, d]`, or, `flat` = `Some(H)`, on `qkv [B, T, 3 H d]` -> `[B, T, H d]`, as
/// one graph node when `qkv` tracks gradients ([`FaPacked`]).
pub(crate) fn flash_packed(
    qkv: &Tensor,
    flat: Option<usize>,
    causal: bool,
    scale: f32,
) -> Result<Tensor> {
    let node = FaPacked {
        causal,
        scale,
        flat,
        lse: std::sync::Mutex::new(None),
    };
    if qkv.track_op() {
        qkv.apply_op1(node)
    } else {
        qkv.apply_op1_no_bwd(&node)
    }
}
