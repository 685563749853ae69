//! The storage seam: the one module above `comm/` that reads or writes a tensor's memory.
//!
//! Everything else (collective nodes, regions, FSDP, the optimizer, checkpoints) goes through
//! the functions here, so the dtype `match` and the device `match` are each written once
//! ([`with_slice!`](crate::with_cpu_slice) over candle's CPU variants, [`DeviceStorage`] over
//! its backends), and the CPU test suite runs the same logic the CUDA path uses.
//!
//! - **Reading and writing.** [`with_slice`] / [`with_slice_mut`] give typed host slices of a
//!   contiguous CPU tensor (kernels); [`copy_rows`], [`fill_from`] and [`pad_dim`] move blocks
//!   of rows between tensors on any device (candle's `copy2d`, the same kernel on CPU and CUDA);
//!   [`host_bytes`] / [`set_from_bytes`] stage data through host memory (checkpoints).
//! - **Graph-node outputs.** A `CustomOp` forward must return a storage of the op's backend.
//!   [`DeviceStorage`] lets one generic forward serve both ([`zeros_like`], [`owned_copy`],
//!   [`output_of`]); the `device_fwd*!` macros write the `cpu_fwd` / `cuda_fwd` pair that calls it.
//! - **Release and refill** ([`release`], [`refill`], [`is_released`]): FSDP frees a full
//!   parameter's memory between uses and puts the gathered values back in place, so every view
//!   a model keeps sees them.
//!
//! # The released-storage invariant
//!
//! A released tensor keeps its shape and layout but holds a *placeholder* storage: zero
//! elements of [`RELEASED_DTYPE`] (candle's `F4`, a storage-only dummy type no op computes on).
//! candle checks storage dtypes before any kernel touches memory (binary ops, matmul and copies
//! compare the two storages' dtypes; unary ops, reductions, casts and index ops dispatch on the
//! storage variant and refuse the dummy types), so any op on a released tensor fails with a
//! typed candle error (`DTypeMismatchBinaryOp`, `UnsupportedDTypeForOp`) instead of reading
//! past the end of an empty buffer. An *empty* storage of the tensor's own dtype, which this
//! crate used before, let gemm read unowned memory: undefined behaviour from safe code.
//! [`refill`] only ever installs a storage of exactly the tensor's element count and dtype, and
//! only into a contiguous tensor that starts at offset 0 (the owner), so every view of it is in
//! bounds again. The tests in `crates/kernels/tests/storage.rs` run candle's op families on released
//! tensors and try the refill with wrong lengths, dtypes and layouts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, DType, Error, Layout, Shape, Storage, Tensor};

type Result<T> = candle_core::Result<T>;

/// The dtype of a released tensor's placeholder storage.
pub const RELEASED_DTYPE: DType = DType::F4;

// --------------------------------------------------------------------------------------------
// Element types: the dtype match, written once.

/// Runs `$body` with `$v` bound to the element vector of a CPU storage of a numeric dtype (any
/// of u8, u32, i16, i32, i64, bf16, f16, f32, f64), or evaluates `$other` for the dummy and
/// fp8 types. Works on `&CpuStorage` and `&mut CpuStorage` alike.
#[macro_export]
macro_rules! with_cpu_slice {
    ($s:expr, $v:ident => $body:expr, _ => $other:expr) => {{
        use $crate::candle_core::CpuStorage as __S;
        match $s {
            __S::U8($v) => $body,
            __S::U32($v) => $body,
            __S::I16($v) => $body,
            __S::I32($v) => $body,
            __S::I64($v) => $body,
            __S::BF16($v) => $body,
            __S::F16($v) => $body,
            __S::F32($v) => $body,
            __S::F64($v) => $body,
            #[allow(unreachable_patterns)]
            _ => $other,
        }
    }};
}

/// A numeric element type and its CPU storage variant.
pub trait Elem: candle_core::WithDType {
    /// The elements of `s` if it holds this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// The elements of `s` if it holds this type, mutably.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    /// `v` as a CPU storage (moved).
    fn into_storage(v: Vec<Self>) -> CpuStorage;
}

macro_rules! elem {
    ($($t:ty => $variant:ident),*) => {$(
        impl Elem for $t {
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn into_storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
        }
    )*};
}

elem!(u8 => U8, u32 => U32, i16 => I16, i32 => I32, i64 => I64, half::bf16 => BF16,
      half::f16 => F16, f32 => F32, f64 => F64);

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: only instantiated with candle's numeric element types (integers, IEEE floats,
    // bf16/f16): no padding bytes, so every byte of the slice is initialized; the view borrows
    // `v` and has its exact size.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every bit pattern is a valid value of these types, so writes
    // through the byte view cannot create an invalid value.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Number of elements a CPU storage holds (0 for a released one).
fn cpu_len(s: &CpuStorage) -> usize {
    with_cpu_slice!(s, v => v.len(), _ => match s {
        CpuStorage::F8E4M3(v) => v.len(),
        CpuStorage::F6E2M3(v) | CpuStorage::F6E3M2(v) | CpuStorage::F4(v) | CpuStorage::F8E8M0(v) => v.len(),
        _ => 0,
    })
}

// --------------------------------------------------------------------------------------------
// Backends: the device match, written once.

/// A candle backend storage the runtime's graph nodes and in-place ops work on: implemented for
/// the CPU and for CUDA (candle's dummy CUDA type, whose every call fails, without the `cuda`
/// feature).
pub trait DeviceStorage: BackendStorage<Device: BackendDevice<Storage = Self>> + Sized {
    /// `s` if it is this backend's storage.
    fn of(s: &Storage) -> Option<&Self>;
    /// `s` itself if it is this backend's storage (moved, not copied).
    fn take(s: Storage) -> Option<Self>;
    /// Number of elements held.
    fn len(&self) -> usize;
    /// Whether nothing is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The placeholder a released tensor holds (see the module docs), on `self`'s device.
    fn released(&self) -> Result<Self>;
    /// Zeros of `shape` and `dtype` on `self`'s device.
    fn zeros(&self, shape: &Shape, dtype: DType) -> Result<Self> {
        self.device().zeros_impl(shape, dtype)
    }
    /// A host storage moved (CPU) or copied (devices) to `self`'s device.
    fn upload(&self, s: CpuStorage) -> Result<Self> {
        self.device().storage_from_cpu_storage_owned(s)
    }
}

impl DeviceStorage for CpuStorage {
    fn of(s: &Storage) -> Option<&Self> {
        match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        }
    }

    fn take(s: Storage) -> Option<Self> {
        match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        }
    }

    fn len(&self) -> usize {
        cpu_len(self)
    }

    fn released(&self) -> Result<Self> {
        Ok(CpuStorage::F4(Vec::new()))
    }
}

/// Without the `cuda` feature this is candle's dummy type: nothing is held and every call fails
/// (its device cannot be reached, so `zeros` and `upload` fail here too).
impl DeviceStorage for CudaStorage {
    fn of(s: &Storage) -> Option<&Self> {
        match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        }
    }

    fn take(s: Storage) -> Option<Self> {
        match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        }
    }

    #[cfg(feature = "cuda")]
    fn len(&self) -> usize {
        use candle_core::cuda_backend::CudaStorageSlice as S;
        match &self.slice {
            S::U8(v) => v.len(),
            S::U32(v) => v.len(),
            S::I16(v) => v.len(),
            S::I32(v) => v.len(),
            S::I64(v) => v.len(),
            S::BF16(v) => v.len(),
            S::F16(v) => v.len(),
            S::F32(v) => v.len(),
            S::F64(v) => v.len(),
            S::F8E4M3(v) => v.len(),
            S::F6E2M3(v) | S::F6E3M2(v) | S::F4(v) | S::F8E8M0(v) => v.len(),
        }
    }

    #[cfg(feature = "cuda")]
    fn released(&self) -> Result<Self> {
        use candle_core::cuda_backend::CudaStorageSlice as S;
        // One byte rather than none: a zero-byte device allocation is refused by some driver
        // versions; the dtype, not the length, is what makes every op refuse it.
        let slice = self.device.alloc_zeros::<u8>(1)?;
        Ok(CudaStorage {
            slice: S::F4(slice),
            device: self.device.clone(),
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn len(&self) -> usize {
        0
    }

    #[cfg(not(feature = "cuda"))]
    fn released(&self) -> Result<Self> {
        Err(candle_core::Error::NotCompiledWithCudaSupport)
    }

    #[cfg(not(feature = "cuda"))]
    fn zeros(&self, _: &Shape, _: DType) -> Result<Self> {
        Err(candle_core::Error::NotCompiledWithCudaSupport)
    }

    #[cfg(not(feature = "cuda"))]
    fn upload(&self, _: CpuStorage) -> Result<Self> {
        Err(candle_core::Error::NotCompiledWithCudaSupport)
    }
}

/// The storage behind a read guard as backend `S`, or an error naming the device.
fn backend_of<'a, S: DeviceStorage>(s: &'a Storage, what: &str) -> Result<&'a S> {
    S::of(s).ok_or_else(|| {
        Error::msg(format!(
            "{what}: tensors on {:?} and on another device",
            s.device().location()
        ))
    })
}

/// One `cpu_fwd` / `cuda_fwd` of a custom op (storage type `$S`, arguments `(s, l)` pairs, `mut`
/// for in-place ops) forwarding to the generic method `self.$m`, with every pair or, after
/// `first_only`, the first pair alone; the `device_*` macros below write both of an op's
/// forwards with it.
#[doc(hidden)]
#[macro_export]
macro_rules! __device_fwd {
    ($f:ident, $S:ident, $m:ident, ($($s:ident $l:ident),+)) => {
        #[allow(clippy::too_many_arguments)]
        fn $f(
            &self,
            $($s: &$crate::candle_core::$S, $l: &$crate::candle_core::Layout),+
        ) -> $crate::candle_core::Result<($crate::candle_core::$S, $crate::candle_core::Shape)> {
            self.$m($($s, $l),+)
        }
    };
    ($f:ident, $S:ident, $m:ident, first_only ($s1:ident $l1:ident, $($s:ident $l:ident),+)) => {
        #[allow(clippy::too_many_arguments)]
        fn $f(
            &self,
            $s1: &$crate::candle_core::$S,
            $l1: &$crate::candle_core::Layout,
            $($s: &$crate::candle_core::$S, $l: &$crate::candle_core::Layout),+
        ) -> $crate::candle_core::Result<($crate::candle_core::$S, $crate::candle_core::Shape)> {
            let _ = ($($s, $l),+);
            self.$m($s1, $l1)
        }
    };
    ($f:ident, $S:ident, $m:ident, mut $s:ident $l:ident) => {
        fn $f(
            &self,
            $s: &mut $crate::candle_core::$S,
            $l: &$crate::candle_core::Layout,
        ) -> $crate::candle_core::Result<()> {
            self.$m($s, $l)
        }
    };
}

/// Implements a `CustomOp1`'s `cpu_fwd` and `cuda_fwd` by calling the generic method
/// `self.$m::<S: DeviceStorage>(&S, &Layout) -> Result<(S, Shape)>`.
#[macro_export]
macro_rules! device_fwd1 {
    ($m:ident) => {
        $crate::__device_fwd!(cpu_fwd, CpuStorage, $m, (s1 l1));
        $crate::__device_fwd!(cuda_fwd, CudaStorage, $m, (s1 l1));
    };
}

/// `device_fwd1!` for `CustomOp2` (`self.$m(s1, l1, s2, l2)`; `self.$m(s1, l1)` with
/// `first_only`, for an op whose output does not read the second operand).
#[macro_export]
macro_rules! device_fwd2 {
    ($m:ident $(, $only:ident)?) => {
        $crate::__device_fwd!(cpu_fwd, CpuStorage, $m, $($only)? (s1 l1, s2 l2));
        $crate::__device_fwd!(cuda_fwd, CudaStorage, $m, $($only)? (s1 l1, s2 l2));
    };
}

/// `device_fwd1!` for `CustomOp3` (`self.$m(s1, l1, s2, l2, s3, l3)`; `self.$m(s1, l1)` with
/// `first_only`).
#[macro_export]
macro_rules! device_fwd3 {
    ($m:ident $(, $only:ident)?) => {
        $crate::__device_fwd!(cpu_fwd, CpuStorage, $m, $($only)? (s1 l1, s2 l2, s3 l3));
        $crate::__device_fwd!(cuda_fwd, CudaStorage, $m, $($only)? (s1 l1, s2 l2, s3 l3));
    };
}

/// Implements an `InplaceOp1`'s `cpu_fwd` and `cuda_fwd` by calling the generic method
/// `self.$m::<S: DeviceStorage>(&mut S, &Layout) -> Result<()>`.
#[macro_export]
macro_rules! device_inplace1 {
    ($m:ident) => {
        $crate::__device_fwd!(cpu_fwd, CpuStorage, $m, mut s l);
        $crate::__device_fwd!(cuda_fwd, CudaStorage, $m, mut s l);
    };
}

// --------------------------------------------------------------------------------------------
// Graph-node outputs.

/// Zeros of `shape` and `dtype` on `like`'s device.
pub fn zeros_like<S: DeviceStorage>(like: &S, shape: &Shape, dtype: DType) -> Result<S> {
    if dtype == RELEASED_DTYPE {
        return Err(released_error("graph node"));
    }
    like.zeros(shape, dtype)
}

/// `v` as a storage of `like`'s backend (moved on the CPU, copied to the device otherwise).
pub fn from_host_vec<S: DeviceStorage, T: Elem>(like: &S, v: Vec<T>) -> Result<S> {
    like.upload(T::into_storage(v))
}

/// A fresh storage holding the elements of `(s, l)` in row-major order.
pub fn owned_copy<S: DeviceStorage>(s: &S, l: &Layout) -> Result<S> {
    let mut out = zeros_like(s, l.shape(), s.dtype())?;
    s.copy_strided_src(&mut out, 0, l)?;
    Ok(out)
}

/// The elements of `t` as a fresh storage of backend `S` (the output of a node whose result was
/// computed beforehand, e.g. a region). One copy; none more when `t` is a plain contiguous
/// tensor.
pub fn output_of<S: DeviceStorage>(t: &Tensor) -> Result<S> {
    if t.elem_count() == 0 {
        // An empty view may carry an offset past the end of its storage.
        let (g, _) = t.storage_and_layout();
        let s = backend_of::<S>(&g, "node output")?;
        return zeros_like(s, t.shape(), t.dtype());
    }
    let (g, l) = t.storage_and_layout();
    let s = backend_of::<S>(&g, "node output")?;
    if s.dtype() == RELEASED_DTYPE {
        return Err(released_error("node output"));
    }
    if l.is_contiguous() && l.start_offset() == 0 && s.len() == t.elem_count() {
        s.try_clone(l)
    } else {
        owned_copy(s, l)
    }
}

/// The elements of `y` plus `bias` (broadcast over `y`'s leading dims, the sum in the bias's
/// dtype) when given, cast to `dtype`, as a fresh storage of backend `S`: the output of a node
/// whose last steps are a bias add and a cast, computed from its precomputed product (a
/// mixed-precision linear). One pass (the cast writes the fresh storage), two with a bias in
/// `dtype`, three with one in another dtype (an f32 bias of a bf16 output: added in f32, then
/// the sum rounded to bf16); no copy of a finished output as [`output_of`] makes.
pub fn output_cast_add<S: DeviceStorage>(
    y: &Tensor,
    dtype: DType,
    bias: Option<&Tensor>,
) -> Result<S> {
    let (g, l) = y.storage_and_layout();
    let s = backend_of::<S>(&g, "node output")?;
    if s.dtype() == RELEASED_DTYPE {
        return Err(released_error("node output"));
    }
    let Some(b) = bias else {
        return s.to_dtype(l, dtype);
    };
    let (bg, bl) = b.storage_and_layout();
    let bs = backend_of::<S>(&bg, "node bias")?;
    let shape = y.shape();
    let whole = Layout::contiguous(shape);
    let sum = s
        .to_dtype(l, bs.dtype())?
        .binary_impl::<candle_core::op::Add>(bs, &whole, &bl.broadcast_as(shape)?)?;
    if sum.dtype() == dtype {
        Ok(sum)
    } else {
        sum.to_dtype(&whole, dtype)
    }
}

// --------------------------------------------------------------------------------------------
// Lengths and the released state.

/// Number of elements `t`'s storage holds (the whole buffer, not just `t`'s view of it).
pub fn storage_elems(t: &Tensor) -> usize {
    let (g, _) = t.storage_and_layout();
    match &*g {
        Storage::Cpu(c) => c.len(),
        Storage::Cuda(c) => c.len(),
        Storage::Metal(_) => 0,
    }
}

/// Bytes `t`'s storage holds (0 when released).
pub fn held_bytes(t: &Tensor) -> usize {
    if is_released(t) {
        return 0;
    }
    storage_elems(t) * t.dtype().size_in_bytes()
}

/// Whether `t`'s storage has been released (see the module docs).
pub fn is_released(t: &Tensor) -> bool {
    let (g, _) = t.storage_and_layout();
    g.dtype() == RELEASED_DTYPE && t.dtype() != RELEASED_DTYPE
}

fn released_error(what: &str) -> candle_core::Error {
    Error::msg(format!("{what}: the tensor's storage has been released"))
}

/// Names of released storages, for error messages: keyed by the address of the `Storage` in
/// its tensor's shared lock (stable while the storage lives). Entries are written at release
/// and removed at refill; a lookup only trusts an entry while that storage is released.
fn names() -> &'static Mutex<HashMap<usize, Arc<str>>> {
    static NAMES: OnceLock<Mutex<HashMap<usize, Arc<str>>>> = OnceLock::new();
    NAMES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Integer ids (token ids, class ids, gather and select indices) as `to` (u32 or i64), for an
/// index kernel on their device. candle 0.11.1's CUDA backend has no cast from i16 or i32 (its
/// `cast.cu` has none), so there the conversion would fail inside the launch as a missing
/// kernel: on CUDA those dtypes are refused here with a typed error naming the op and the
/// shape. Other dtypes are cast (a no-op when `ids` already has `to`).
///
/// # Errors
///
/// i16 or i32 ids on a CUDA device; a failed cast.
pub fn ids_as(op: &'static str, ids: &Tensor, to: DType) -> candle_core::Result<Tensor> {
    if ids.dtype() == to {
        return Ok(ids.clone());
    }
    if ids.device().is_cuda() && matches!(ids.dtype(), DType::I16 | DType::I32) {
        return Err(crate::error::KernelError::UnsupportedDType {
            op,
            device: "CUDA",
            dtype: ids.dtype(),
            supported: "u8, u32 or i64 ids (candle 0.11.1 has no CUDA cast from i16 or i32)",
            shape: ids.dims().to_vec(),
        }
        .into());
    }
    ids.to_dtype(to)
}

/// The identity of the storage behind `t` (equal for two views of one storage, while it lives).
pub fn storage_key(t: &Tensor) -> usize {
    let (g, _) = t.storage_and_layout();
    std::ptr::from_ref::<Storage>(&*g) as usize
}

/// The name given to [`release`] for the released storage `t` (or a view of it) holds.
pub fn released_name(t: &Tensor) -> Option<Arc<str>> {
    if !is_released(t) {
        return None;
    }
    let key = storage_key(t);
    names()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .cloned()
}

/// The tensor an owner may release and refill: contiguous from offset 0 (so the storage holds
/// exactly its elements and every view of it lies inside them).
fn check_owner(t: &Tensor, what: &str) -> Result<()> {
    let l = t.layout();
    if !l.is_contiguous() || l.start_offset() != 0 {
        return Err(Error::msg(format!(
            "{what}: only a contiguous tensor at offset 0 can own a releasable storage"
        )));
    }
    if t.dtype() == RELEASED_DTYPE {
        return Err(Error::msg(format!(
            "{what}: {RELEASED_DTYPE:?} tensors cannot be released"
        )));
    }
    Ok(())
}

/// What [`release`] and [`refill_from_segments`] put into an owner's storage.
enum Swap<'a> {
    Released,
    /// Concatenated `(start, len)` element ranges of a contiguous source, as a storage of
    /// `shape` and `dtype`.
    Segments {
        src: &'a Tensor,
        segs: &'a [(usize, usize)],
        shape: &'a Shape,
        dtype: DType,
    },
}

impl Swap<'_> {
    fn apply<S: DeviceStorage>(&self, s: &mut S, _l: &Layout) -> Result<()> {
        let new = match self {
            Swap::Released => s.released()?,
            Swap::Segments {
                src,
                segs,
                shape,
                dtype,
            } => {
                let mut out = s.zeros(shape, *dtype)?;
                let (g, src_l) = src.storage_and_layout();
                let src_s = backend_of::<S>(&g, "refill")?;
                let mut at = 0;
                for &(start, len) in segs.iter() {
                    if len > 0 {
                        // One block of `len` elements.
                        let from = src_l.start_offset() + start;
                        copy2d_fits(&out, "refill", 1, len, len, len)?;
                        src_s.copy2d(&mut out, 1, len, len, len, from, at)?;
                    }
                    at += len;
                }
                out
            }
        };
        *s = new;
        Ok(())
    }
}

impl candle_core::InplaceOp1 for Swap<'_> {
    fn name(&self) -> &'static str {
        "storage-swap"
    }
    device_inplace1!(apply);
}

/// Whether two tensors share one storage (candle's own check is crate-private). The guards are
/// taken one after the other: holding two read guards of one lock could deadlock behind a
/// queued writer.
pub fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    storage_key(a) == storage_key(b)
}

/// Releases the storage of `t` (its owner: contiguous, offset 0), replacing it by the
/// placeholder; returns the bytes freed (0 when already released). `name` appears in errors of
/// later uses that the runtime catches ([`released_name`]).
pub fn release(t: &Tensor, name: &str) -> Result<usize> {
    check_owner(t, "release")?;
    if is_released(t) {
        return Ok(0);
    }
    let held = held_bytes(t);
    let key = storage_key(t);
    if t.elem_count() == 0 {
        // candle refuses in-place ops on empty tensors (their strides contain zeros); there is
        // nothing to free.
        return Ok(0);
    }
    t.inplace_op1(&Swap::Released)?;
    names()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, Arc::from(name));
    Ok(held)
}

/// Puts the elements of `src` (same element count, dtype and device; any layout) into the
/// storage of `t` (its owner: contiguous, offset 0), in place: every view of `t` sees them.
/// Works whether or not `t` is released.
pub fn refill(t: &Tensor, src: &Tensor) -> Result<()> {
    let src = src.contiguous()?;
    refill_from_segments(t, &src, &[(0, src.elem_count())])
}

/// Like [`refill`], with `t`'s elements taken as the concatenation of the `(start, len)`
/// element ranges of the contiguous `src` (e.g. every rank's piece of a gathered buffer).
pub fn refill_from_segments(t: &Tensor, src: &Tensor, segs: &[(usize, usize)]) -> Result<()> {
    check_owner(t, "refill")?;
    let total: usize = segs.iter().map(|s| s.1).sum();
    let end = segs.iter().map(|s| s.0 + s.1).max().unwrap_or(0);
    if total != t.elem_count() || src.dtype() != t.dtype() || end > src.elem_count() {
        return Err(Error::msg(format!(
            "refill: {total} elements (up to element {end}) of a {:?} {:?} tensor into {:?} {:?}",
            src.dims(),
            src.dtype(),
            t.dims(),
            t.dtype()
        )));
    }
    if !src.is_contiguous() {
        return Err(Error::msg("refill: the source must be contiguous"));
    }
    if is_released(src) {
        return Err(released_error("refill"));
    }
    if !src.device().same_device(t.device()) {
        return Err(Error::msg(format!(
            "refill: source on {:?}, tensor on {:?}",
            src.device().location(),
            t.device().location()
        )));
    }
    if t.elem_count() == 0 {
        return Ok(());
    }
    if same_storage(t, src) {
        return Err(Error::msg("refill: the source shares the tensor's storage"));
    }
    let key = storage_key(t);
    t.inplace_op1(&Swap::Segments {
        src,
        segs,
        shape: t.shape(),
        dtype: t.dtype(),
    })?;
    names()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
    Ok(())
}

// --------------------------------------------------------------------------------------------
// Moving rows, any device.

/// Copies block rows from `src` into the tensor the op runs on (candle's `copy2d`, one kernel
/// on every backend): `d1` blocks of `d2` elements, read at block stride `src_s` from element
/// `src_o` of the source and written at stride `dst_s` from element `dst_o` of the destination
/// (offsets counted from each layout's start).
struct CopyBlocks<'a> {
    src: &'a Tensor,
    d1: usize,
    d2: usize,
    src_s: usize,
    dst_s: usize,
    src_o: usize,
    dst_o: usize,
}

impl CopyBlocks<'_> {
    fn apply<S: DeviceStorage>(&self, dst: &mut S, dst_l: &Layout) -> Result<()> {
        let (g, src_l) = self.src.storage_and_layout();
        let src = backend_of::<S>(&g, "copy_rows")?;
        copy2d_fits(dst, "copy_rows", self.d1, self.d2, self.src_s, self.dst_s)?;
        src.copy2d(
            dst,
            self.d1,
            self.d2,
            self.src_s,
            self.dst_s,
            src_l.start_offset() + self.src_o,
            dst_l.start_offset() + self.dst_o,
        )
    }
}

impl candle_core::InplaceOp1 for CopyBlocks<'_> {
    fn name(&self) -> &'static str {
        "copy-rows"
    }
    device_inplace1!(apply);
}

/// Whether candle's CUDA `copy2d` kernel copies `d1` blocks of `d2` elements at block strides
/// `src_s` and `dst_s` right: it takes the four as `u32` (candle casts them) and indexes in
/// `u32` (`d1 d2` threads, element `(i / d2) stride + i % d2`), so every count and the largest
/// index on either side must fit. Offsets travel as pointers and have no such limit.
fn copy2d_fits_u32(d1: usize, d2: usize, src_s: usize, dst_s: usize) -> bool {
    if d1 == 0 || d2 == 0 {
        return true;
    }
    let fits = |v: Option<usize>| v.is_some_and(|v| u32::try_from(v).is_ok());
    let last = |stride: usize| (d1 - 1).checked_mul(stride)?.checked_add(d2 - 1);
    fits(d1.checked_mul(d2))
        && fits(Some(src_s))
        && fits(Some(dst_s))
        && fits(last(src_s))
        && fits(last(dst_s))
}

/// [`copy2d_fits_u32`] where the copy runs on a device (the CPU's `copy2d` indexes in
/// `usize`): a typed error naming `op` and the sizes instead of a copy of the wrong elements.
fn copy2d_fits<S: DeviceStorage>(
    dst: &S,
    op: &str,
    d1: usize,
    d2: usize,
    src_s: usize,
    dst_s: usize,
) -> Result<()> {
    let on_cpu = matches!(dst.device().location(), candle_core::DeviceLocation::Cpu);
    if on_cpu || copy2d_fits_u32(d1, d2, src_s, dst_s) {
        return Ok(());
    }
    Err(Error::msg(format!(
        "{op}: {d1} blocks of {d2} elements at strides {src_s} (source) and {dst_s} \
         (destination) on {:?}: candle's device copy kernel indexes in 32 bits (at most {} \
         elements and index {} each)",
        dst.device().location(),
        u32::MAX,
        u32::MAX
    )))
}

/// A `[pre, len, post]` view of a shape cut at `dim` (in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Product of the dims before `dim`.
    pub pre: usize,
    /// The size of `dim`.
    pub len: usize,
    /// Product of the dims after `dim`.
    pub post: usize,
}

impl Cut {
    /// The cut of `dims` at `dim` (`dim < dims.len()`).
    pub fn new(dims: &[usize], dim: usize) -> Self {
        Cut {
            pre: dims[..dim].iter().product(),
            len: dims[dim],
            post: dims[dim + 1..].iter().product(),
        }
    }
}

fn check_rows(t: &Tensor, what: &str) -> Result<()> {
    if !t.is_contiguous() {
        return Err(Error::msg(format!("{what}: expected a contiguous tensor")));
    }
    if is_released(t) {
        return Err(released_error(what));
    }
    Ok(())
}

/// Copies rows between two contiguous tensors of the same dtype and device seen as
/// `[pre, src_len, post]` and `[pre, dst_len, post]`: for each of the `pre` outer blocks, rows
/// `src_row..src_row + rows` of `src` go to rows `dst_row..` of `dst`. `dst` is written in
/// place: only for tensors the caller just created and has not shared.
#[allow(clippy::too_many_arguments)]
pub fn copy_rows(
    src: &Tensor,
    src_len: usize,
    src_row: usize,
    dst: &Tensor,
    dst_len: usize,
    dst_row: usize,
    pre: usize,
    rows: usize,
    post: usize,
) -> Result<()> {
    if rows * post * pre == 0 {
        return Ok(());
    }
    check_rows(src, "copy_rows")?;
    check_rows(dst, "copy_rows")?;
    if src.dtype() != dst.dtype() {
        return Err(Error::msg(format!(
            "copy_rows: {:?} rows into a {:?} tensor",
            src.dtype(),
            dst.dtype()
        )));
    }
    if same_storage(dst, src) {
        return Err(Error::msg(
            "copy_rows: source and destination share a storage",
        ));
    }
    let in_bounds = |len: usize, row: usize, n: usize| row + rows <= len && pre * len * post <= n;
    if !in_bounds(src_len, src_row, src.elem_count())
        || !in_bounds(dst_len, dst_row, dst.elem_count())
    {
        return Err(Error::msg(format!(
            "copy_rows: {rows} rows of {post} from row {src_row} of [{pre}, {src_len}] ({} elements) to row {dst_row} of [{pre}, {dst_len}] ({} elements)",
            src.elem_count(),
            dst.elem_count()
        )));
    }
    dst.inplace_op1(&CopyBlocks {
        src,
        d1: pre,
        d2: rows * post,
        src_s: src_len * post,
        dst_s: dst_len * post,
        src_o: src_row * post,
        dst_o: dst_row * post,
    })
}

/// Copies `src` (any layout; same element count, dtype and device) into `dest` in place. Only
/// for tensors the caller just created and has not shared.
pub fn fill_from(dest: &Tensor, src: &Tensor) -> Result<()> {
    if src.elem_count() != dest.elem_count() || src.dtype() != dest.dtype() {
        return Err(Error::msg(format!(
            "fill: {:?} {:?} into {:?} {:?}",
            src.dims(),
            src.dtype(),
            dest.dims(),
            dest.dtype()
        )));
    }
    let n = src.elem_count();
    if n == 0 {
        return Ok(());
    }
    let src = src.contiguous()?;
    copy_rows(&src, 1, 0, dest, 1, 0, 1, 1, n)
}

/// `x` with zero rows appended on `dim` up to `to` rows (a fresh contiguous tensor; `x` itself
/// when it already has `to`).
pub fn pad_dim(x: &Tensor, dim: usize, to: usize) -> Result<Tensor> {
    let cut = Cut::new(x.dims(), dim);
    if cut.len == to {
        return Ok(x.clone());
    }
    if cut.len > to {
        return Err(Error::msg(format!(
            "pad: {} rows on dim {dim} of {:?} exceed {to}",
            cut.len,
            x.dims()
        )));
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = to;
    let out = Tensor::zeros(dims, x.dtype(), x.device())?;
    let x = x.contiguous()?;
    copy_rows(&x, cut.len, 0, &out, to, 0, cut.pre, cut.len, cut.post)?;
    Ok(out)
}

/// `x.narrow(dim, start, len)` that never builds an out-of-bounds view: when the result has no
/// elements it narrows at offset 0 instead (the values are irrelevant, the graph node and the
/// shape are the same). candle accepts `narrow` on an empty tensor with any `start <= dim` and
/// records a start offset past the end of the storage, which its copy kernels later slice and
/// panic on.
pub fn narrow(x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
    let empty = len == 0
        || x.dims()
            .iter()
            .enumerate()
            .any(|(d, &n)| d != dim && n == 0);
    if empty {
        x.narrow(dim, 0, len)
    } else {
        x.narrow(dim, start, len)
    }
}

// --------------------------------------------------------------------------------------------
// Host slices (CPU kernels) and host staging.

/// The element range `a..b` a contiguous layout views in its storage.
fn contiguous_range(l: &Layout) -> Result<std::ops::Range<usize>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| Error::msg("expected a contiguous tensor"))?;
    Ok(a..b)
}

/// Runs `f` on the elements of the contiguous CPU tensor `t` (under its read lock). An empty
/// tensor gets an empty slice without touching its storage.
pub fn with_slice<T: Elem, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    if t.elem_count() == 0 {
        return Ok(f(&[]));
    }
    let (g, l) = t.storage_and_layout();
    let range = contiguous_range(l)?;
    let s = match &*g {
        Storage::Cpu(c) => c,
        other => {
            return Err(Error::msg(format!(
                "expected a CPU tensor, got one on {:?}",
                other.device().location()
            )))
        }
    };
    let v = T::slice(s).ok_or_else(|| {
        if s.dtype() == RELEASED_DTYPE {
            released_error("read")
        } else {
            Error::msg(format!(
                "expected {:?} data, the tensor holds {:?}",
                T::DTYPE,
                s.dtype()
            ))
        }
    })?;
    let v = v
        .get(range)
        .ok_or_else(|| Error::msg("tensor view outside its storage"))?;
    Ok(f(v))
}

struct WriteSlice<T, F> {
    f: Mutex<Option<F>>,
    _t: std::marker::PhantomData<fn(&mut [T])>,
}

impl<T: Elem, F: FnOnce(&mut [T]) -> Result<()> + Send> candle_core::InplaceOp1
    for WriteSlice<T, F>
{
    fn name(&self) -> &'static str {
        "write-slice"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let range = contiguous_range(l)?;
        let dtype = s.dtype();
        let v = T::slice_mut(s)
            .ok_or_else(|| Error::msg(format!("expected {:?} data, got {dtype:?}", T::DTYPE)))?
            .get_mut(range)
            .ok_or_else(|| Error::msg("tensor view outside its storage"))?;
        let f = self
            .f
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| Error::msg("write closure already used"))?;
        f(v)
    }
}

/// Runs `f` on the elements of the contiguous CPU tensor `t`, mutably (under its write lock):
/// `t` changes in place, so every tensor sharing its storage sees it.
pub fn with_slice_mut<T: Elem>(
    t: &Tensor,
    f: impl FnOnce(&mut [T]) -> Result<()> + Send,
) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(Error::msg(format!(
            "expected a CPU tensor, got one on {:?}",
            t.device().location()
        )));
    }
    if t.elem_count() == 0 {
        return f(&mut []);
    }
    t.inplace_op1(&WriteSlice {
        f: Mutex::new(Some(f)),
        _t: std::marker::PhantomData,
    })
}

/// Runs `f` on the elements of `dst` (mutably) and `src`, both contiguous CPU tensors of type
/// `T` with the same element count: an in-place update of `dst` reading `src` (one pass).
pub fn update_with<T: Elem>(
    dst: &Tensor,
    src: &Tensor,
    f: impl FnOnce(&mut [T], &[T]) -> Result<()> + Send,
) -> Result<()> {
    if same_storage(dst, src) {
        return Err(Error::msg("update: source and destination share a storage"));
    }
    if src.elem_count() != dst.elem_count() {
        return Err(Error::msg(format!(
            "update: {} elements from a tensor of {}",
            dst.elem_count(),
            src.elem_count()
        )));
    }
    let src = src.contiguous()?;
    with_slice_mut::<T>(dst, |d| with_slice::<T, _>(&src, |s| f(d, s))?)
}

/// The elements of `t` (any device and layout) as little-endian bytes in row-major order,
/// staged through host memory.
pub fn host_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.to_device(&candle_core::Device::Cpu)?.contiguous()?;
    if t.elem_count() == 0 {
        return Ok(Vec::new());
    }
    let (g, l) = t.storage_and_layout();
    let range = contiguous_range(l)?;
    let Storage::Cpu(s) = &*g else {
        return Err(Error::msg("host staging: not a CPU tensor"));
    };
    if s.dtype() == RELEASED_DTYPE {
        return Err(released_error("host staging"));
    }
    // Little-endian targets only (x86_64, aarch64): the in-memory bytes are the file's bytes.
    const _: () = assert!(cfg!(target_endian = "little"));
    with_cpu_slice!(s, v => Ok(as_bytes(&v[range]).to_vec()), _ => Err(Error::msg(format!(
        "host staging: unsupported dtype {:?}",
        t.dtype()
    ))))
}

/// Sets the elements of `t` (any device; contiguous) from little-endian row-major bytes, in
/// place. CPU tensors are written in one pass; others through a host tensor.
pub fn set_from_bytes(t: &Tensor, bytes: &[u8]) -> Result<()> {
    let want = t.elem_count() * t.dtype().size_in_bytes();
    if bytes.len() != want {
        return Err(Error::msg(format!(
            "set from bytes: {} bytes for a {:?} {:?} tensor ({want} bytes)",
            bytes.len(),
            t.dims(),
            t.dtype()
        )));
    }
    if t.elem_count() == 0 {
        return Ok(());
    }
    if !t.device().is_cpu() {
        let host = Tensor::from_raw_buffer(bytes, t.dtype(), t.dims(), &candle_core::Device::Cpu)?;
        return fill_from(t, &host.to_device(t.device())?);
    }
    struct Write<'b>(&'b [u8]);
    impl candle_core::InplaceOp1 for Write<'_> {
        fn name(&self) -> &'static str {
            "set-from-bytes"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
            let (a, b) = l
                .contiguous_offsets()
                .ok_or_else(|| Error::msg("set from bytes: expected a contiguous tensor"))?;
            let dtype = s.dtype();
            with_cpu_slice!(s, v => {
                let dst = v.get_mut(a..b).ok_or_else(|| Error::msg("tensor view outside its storage"))?;
                as_bytes_mut(dst).copy_from_slice(self.0);
                Ok(())
            }, _ => Err(Error::msg(format!("set from bytes: unsupported dtype {dtype:?}"))))
        }
    }
    t.inplace_op1(&Write(bytes))
}

/// Keeps GPU memory freed into `device`'s default stream-ordered pool there, instead of
/// handing it back to the driver at every synchronisation (CUDA's default release threshold is
/// 0): candle allocates every op's output with `cuMemAllocAsync` from that pool, so without
/// this a step re-obtains its working memory from the driver after each loss read. The caching
/// allocator PyTorch uses keeps it the same way. What the pool keeps is not available to
/// allocations outside it: the NCCL backend trims the pool before it creates a communicator
/// (`comm-nccl`'s `Streams::release_cached_memory`), as PyTorch empties its cache when an
/// allocation fails. Returns whether a pool was set (`false` on the CPU, and without the
/// `cuda` feature).
///
/// # Errors
///
/// The driver refused (a device without memory pools).
pub fn retain_freed_memory(device: &candle_core::Device) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
        let mut threshold: u64 = u64::MAX;
        // SAFETY: `ctx.cu_device()` is the device of a live context; the default pool exists
        // for every device with memory pools (an error otherwise); the release threshold
        // attribute is a `cuuint64_t`, and `threshold` is one that outlives the call.
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device())
                .map_err(candle_core::Error::wrap)?;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .map_err(candle_core::Error::wrap)?;
        }
        return Ok(true);
    }
    let _ = device;
    Ok(false)
}

/// Stops the buffers candle allocates on `device` from now on from carrying cudarc's two
/// per-buffer CUDA events, where those events would never be used. Returns whether it did
/// (`false` on the CPU, without the `cuda` feature, and on a context that already has a
/// second stream).
///
/// cudarc gives every buffer a read and a write event (`cuEventCreate` twice at each
/// allocation, `cuEventDestroy` twice at each free) so that it can order the buffer's uses
/// across streams, but it records or waits on them only once a second stream exists in the
/// context (`is_in_multi_stream_mode`). Until then they are pure host cost on every tensor
/// candle makes, which is the launch-bound regime's bottleneck. The runtime orders its own
/// cross-stream work with explicit events (`StreamPoint`, the local backend's collectives, the
/// NCCL backend's streams), never through these.
///
/// A backend that later makes a second stream on this context (NCCL's communicator stream)
/// turns tracking back on first (`comm-nccl`'s `CudaStreams::new`), so buffers made from then
/// on are tracked again; those made before it are not, which is why it is for a device just
/// opened (`train::device::DeviceSpec::device_for`).
///
/// # Safety
///
/// cudarc's contract for untracked buffers, which this hands to the caller: whoever makes a
/// second cudarc stream on this device's context (`CudaContext::new_stream`, `fork`) either
/// turns tracking back on before making it (`CudaContext::enable_event_tracking`, as the NCCL
/// backend does) or orders every use of the buffers made meanwhile across the streams itself
/// (no free before another stream's use ends, no use before the allocation on its stream, no
/// concurrent writes). Candle's own API makes no second stream on an existing context.
pub unsafe fn skip_unused_buffer_events(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        if ctx.is_in_multi_stream_mode() {
            return false;
        }
        // SAFETY: cudarc's contract for untracked buffers is that the user orders their uses
        // across streams. This context has one stream in cudarc's sense (the check above),
        // where cudarc itself never records or waits on the events, so untracked buffers are
        // used exactly as tracked ones would be; a second cudarc stream is the caller's to
        // handle (this function's `# Safety`). The runtime's other streams (rank threads'
        // per-thread streams, `redistribute_async`'s helper) are not cudarc's multi-stream
        // mode and are ordered by its own events either way.
        unsafe { ctx.disable_event_tracking() };
        return true;
    }
    let _ = device;
    false
}

/// The number of CUDA devices the driver reports (`CUDA_VISIBLE_DEVICES` applied), without
/// opening any: no context, cuBLAS handle or memory is made on a GPU to count it, so a GPU
/// that another process holds in exclusive-process mode is counted too. 0 without the `cuda`
/// feature, without a driver, or without a GPU.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        // The driver bindings panic where the driver library is missing.
        match std::panic::catch_unwind(CudaContext::device_count) {
            Ok(Ok(n)) => usize::try_from(n).unwrap_or(0),
            _ => 0,
        }
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// A point in the work the calling thread has queued on a device, which work queued later by
/// another thread can be ordered after ([`StreamPoint::order_after`]).
///
/// candle runs each host thread's CUDA work on that thread's own stream (the per-thread
/// default stream), and those streams do not wait for each other: a tensor one thread made is
/// not safe to read from another thread's kernels until the reader's stream waits for the
/// maker's. On the CPU every op has finished when it returns: there is no point to record
/// ([`StreamPoint::record`] gives `None`).
pub struct StreamPoint {
    #[cfg(feature = "cuda")]
    event: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl StreamPoint {
    /// The point after the work the calling thread queued on `device` so far: `None` on a
    /// device whose ops finish before they return (the CPU).
    ///
    /// # Errors
    ///
    /// The driver refused to create or record an event.
    pub fn record(device: &candle_core::Device) -> Result<Option<StreamPoint>> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = device {
            let event = d
                .cuda_stream()
                .record_event(None)
                .map_err(candle_core::Error::wrap)?;
            return Ok(Some(StreamPoint { event }));
        }
        let _ = device;
        Ok(None)
    }

    /// Makes the work the calling thread queues on `device` from now on wait (on the device,
    /// without blocking the host) until the work before this point has finished.
    ///
    /// # Errors
    ///
    /// `device` is not a CUDA device, or the driver refused.
    pub fn order_after(&self, device: &candle_core::Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let candle_core::Device::Cuda(d) = device else {
                return Err(Error::msg(format!(
                    "a CUDA stream point cannot order work on {:?}",
                    device.location()
                )));
            };
            d.cuda_stream()
                .wait(&self.event)
                .map_err(candle_core::Error::wrap)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            match self.never {}
        }
    }
}

// --------------------------------------------------------------------------------------------
// Host reads: what a training step reads back from the device.

thread_local! {
    static HOST_READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Notes that this thread read device data back to the host (on a GPU, a synchronisation of
/// the host with the device's stream). The training code calls it wherever a step reads a
/// value back: the loss, the gradient norm, FSDP's gradient-presence flags, the MoE balancing
/// loss, the pipeline's scalars. [`take_host_reads`] gives a step's count.
pub fn note_host_read() {
    HOST_READS.with(|c| c.set(c.get() + 1));
}

/// The host reads this thread noted since the last call (and starts counting afresh).
pub fn take_host_reads() -> usize {
    HOST_READS.with(|c| c.replace(0))
}

#[cfg(test)]
mod tests {
    use super::copy2d_fits_u32;

    /// The limits of candle's 32-bit device copy: thread count `d1 d2`, each stride, and the
    /// largest index on either side, each at most `u32::MAX`; one past any of them refused.
    #[test]
    fn device_copies_past_32_bit_indices_are_refused() {
        let max = u32::MAX as usize;
        assert!(
            copy2d_fits_u32(0, max + 5, max + 5, max + 5),
            "nothing to copy"
        );
        assert!(copy2d_fits_u32(1, max, max, max));
        assert!(
            !copy2d_fits_u32(1, max + 1, max + 1, max + 1),
            "d1 d2 past u32"
        );
        assert!(copy2d_fits_u32(65_536, 65_535, 65_535, 65_535));
        assert!(
            !copy2d_fits_u32(65_536, 65_536, 65_536, 65_536),
            "2^32 threads"
        );
        // 2 blocks of 1 element, the second at index `stride`.
        assert!(copy2d_fits_u32(2, 1, 1, max));
        assert!(
            !copy2d_fits_u32(2, 1, 1, max + 1),
            "a destination stride past u32"
        );
        assert!(
            !copy2d_fits_u32(2, 1, max + 1, 1),
            "a source stride past u32"
        );
        // The last block's last element: (d1 - 1) stride + d2 - 1.
        assert!(copy2d_fits_u32(3, 2, (max - 1) / 2, 2));
        assert!(
            !copy2d_fits_u32(3, 2, max / 2 + 1, 2),
            "the last index past u32"
        );
        assert!(
            !copy2d_fits_u32(usize::MAX, 2, 1, 1),
            "overflowing products"
        );
    }
}
