//! Data-path kernels of the CPU backends: byte views of candle CPU storage, uninitialised
//! output buffers that become candle tensors without a copy, and reductions (the dtype `match`
//! is written once, in [`with_elem!`]).

use std::mem::ManuallyDrop;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Shape, Storage, StorageRef, Tensor};
use half::{bf16, f16};

use crate::vocab::ReduceOp;

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype` (for supported dtypes);
/// evaluates `$other` for the rest.
macro_rules! with_elem {
    ($dtype:expr, $T:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            _ => $other,
        }
    };
}

fn pod_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is one of the plain numeric element types (no padding, no invalid bit
    // patterns for u8); the byte slice covers exactly the memory of `v` and borrows it.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn cpu_bytes(s: &CpuStorage) -> Option<&[u8]> {
    Some(match s {
        CpuStorage::U8(v) => v.as_slice(),
        CpuStorage::U32(v) => pod_bytes(v),
        CpuStorage::I64(v) => pod_bytes(v),
        CpuStorage::BF16(v) => pod_bytes(v),
        CpuStorage::F16(v) => pod_bytes(v),
        CpuStorage::F32(v) => pod_bytes(v),
        CpuStorage::F64(v) => pod_bytes(v),
        _ => return None,
    })
}

/// A read-locked, contiguous byte view of a CPU tensor.
pub struct ReadView<'a> {
    guard: StorageRef<'a>,
    start: usize,
    len: usize,
}

impl ReadView<'_> {
    /// The viewed bytes (the tensor's elements in order, native endianness).
    pub fn bytes(&self) -> &[u8] {
        match &*self.guard {
            // `read_view` only builds views of CPU storage with supported dtypes.
            Storage::Cpu(c) => match cpu_bytes(c) {
                Some(b) => &b[self.start..self.start + self.len],
                None => &[],
            },
            _ => &[],
        }
    }
}

/// Read-locks `t`'s storage and returns its bytes. `t` must be a contiguous CPU tensor of a
/// supported dtype (the front guarantees it); otherwise this says why not.
pub fn read_view(t: &Tensor) -> Result<ReadView<'_>, String> {
    let es = t.dtype().size_in_bytes();
    let (guard, layout) = t.storage_and_layout();
    let (s, e) = layout
        .contiguous_offsets()
        .ok_or_else(|| "input is not contiguous".to_string())?;
    match &*guard {
        Storage::Cpu(c) => {
            let total = cpu_bytes(c)
                .ok_or_else(|| format!("dtype {:?} is not supported", t.dtype()))?
                .len();
            if e * es > total {
                return Err(format!(
                    "layout ends at byte {} but the storage holds {total}",
                    e * es
                ));
            }
        }
        _ => {
            return Err(format!(
                "this backend moves CPU tensors only; got one on {:?}",
                t.device().location()
            ))
        }
    }
    Ok(ReadView {
        guard,
        start: s * es,
        len: (e - s) * es,
    })
}

/// An uninitialised buffer of `elems` elements of `dtype`, allocated as the `Vec` that will back
/// the output tensor (so [`OutBuf::into_tensor`] needs no copy).
pub struct OutBuf {
    dtype: DType,
    elems: usize,
    cap: usize,
    ptr: *mut u8,
}

// SAFETY: an `OutBuf` owns its allocation like a `Vec` of `Send + Sync` numeric elements.
// Concurrent writers are coordinated by the collective protocol (disjoint byte ranges, and
// reads only after a barrier that follows the writes).
unsafe impl Send for OutBuf {}
// SAFETY: see `Send`; shared access only goes through raw pointers under that protocol.
unsafe impl Sync for OutBuf {}

impl OutBuf {
    /// A buffer of `elems` elements of `dtype`; `Err` names an unsupported dtype.
    pub fn new(dtype: DType, elems: usize) -> Result<Self, String> {
        with_elem!(dtype, T => {
            // Large buffers are advised for huge pages (`crate::memory`): one fault per 2 MiB.
            let mut v = ManuallyDrop::new(crate::memory::vec_with_capacity::<T>(elems));
            Ok(OutBuf { dtype, elems, cap: v.capacity(), ptr: v.as_mut_ptr().cast::<u8>() })
        }, _ => Err(format!("dtype {dtype:?} is not supported")))
    }

    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.elems * self.dtype.size_in_bytes()
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its first byte. Writers must keep to disjoint byte ranges, and readers wait until the
    /// writes are done (the collective protocol's job).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The buffer's bytes.
    ///
    /// # Safety
    ///
    /// Every byte must have been written, and nobody may write the buffer while the slice lives.
    pub unsafe fn written(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len_bytes` bytes, initialised per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len_bytes()) }
    }

    /// Copies `src` into the buffer at byte `offset`.
    ///
    /// # Safety
    ///
    /// `offset + src.len()` must not exceed [`OutBuf::len_bytes`], and no other thread may access
    /// that byte range concurrently.
    pub unsafe fn write(&self, offset: usize, src: &[u8]) {
        debug_assert!(offset + src.len() <= self.len_bytes());
        // SAFETY: in bounds per the caller's contract; `src` is a different allocation (an input
        // tensor or a peer's buffer), so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) }
    }

    /// Turns the buffer into a CPU tensor of `shape` without copying.
    ///
    /// # Safety
    ///
    /// Every byte of the buffer must have been written.
    pub unsafe fn into_tensor(self, shape: Shape) -> candle_core::Result<Tensor> {
        let this = ManuallyDrop::new(self);
        with_elem!(this.dtype, T => {
            // SAFETY: `ptr`/`cap` come from a `Vec<T>` we leaked in `new`; all `elems` elements
            // are initialised per the caller's contract.
            let v = unsafe { Vec::from_raw_parts(this.ptr.cast::<T>(), this.elems, this.cap) };
            Tensor::from_vec(v, shape, &Device::Cpu)
        }, _ => Err(candle_core::Error::Msg("unsupported dtype".into())))
    }
}

impl Drop for OutBuf {
    fn drop(&mut self) {
        with_elem!(self.dtype, T => {
            // SAFETY: reconstitutes the leaked allocation with length 0 (numeric elements need
            // no drop), so it is freed exactly once.
            drop(unsafe { Vec::from_raw_parts(self.ptr.cast::<T>(), 0, self.cap) });
        }, _ => {})
    }
}

/// A copy of `t` into a fresh CPU tensor (used for eager sends and small collectives, so the
/// sender never waits for its receivers).
pub fn detached_copy(t: &Tensor) -> Result<Tensor, String> {
    let view = read_view(t)?;
    let out = OutBuf::new(t.dtype(), t.elem_count())?;
    // SAFETY: the buffer has exactly the view's length and is private to this thread.
    unsafe {
        out.write(0, view.bytes());
        out.into_tensor(t.shape().clone())
    }
    .map_err(|e| e.to_string())
}

/// Element types the reductions run on; half types accumulate in `f32`.
pub trait Elem: Copy + Send + Sync + 'static {
    /// The type sums and products accumulate in.
    type Acc: Copy + Default;
    /// Widens to the accumulator.
    fn to_acc(self) -> Self::Acc;
    /// Narrows from the accumulator (rounding half types).
    fn from_acc(a: Self::Acc) -> Self;
    /// `a + b` (wrapping for integers).
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// The larger of `a` and `b`.
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// The smaller of `a` and `b`.
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// Divides by the group size (`Avg`); integers never reach it (the front rejects `Avg`).
    fn div_n(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_elem {
    ($t:ty, $acc:ty, $to:expr, $from:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(a: $acc) -> Self {
                $from(a)
            }
            #[inline(always)]
            fn add(a: $acc, b: $acc) -> $acc {
                a + b
            }
            #[inline(always)]
            fn mul(a: $acc, b: $acc) -> $acc {
                a * b
            }
            #[inline(always)]
            fn max(a: $acc, b: $acc) -> $acc {
                if a >= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn min(a: $acc, b: $acc) -> $acc {
                if a <= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn div_n(a: $acc, n: usize) -> $acc {
                a / n as $acc
            }
        }
    };
}
float_elem!(f32, f32, |x| x, |a| a);
float_elem!(f64, f64, |x| x, |a| a);
float_elem!(bf16, f32, bf16::to_f32, bf16::from_f32);
float_elem!(f16, f32, f16::to_f32, f16::from_f32);

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            type Acc = $t;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(a: $t) -> Self {
                a
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                a.max(b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                a.min(b)
            }
            #[inline(always)]
            fn div_n(a: $t, n: usize) -> $t {
                a / n as $t
            }
        }
    };
}
int_elem!(i64);
int_elem!(u32);
int_elem!(u8);

const BLOCK: usize = 1024;

#[inline(always)]
fn reduce_kernel<T: Elem>(
    srcs: &[&[T]],
    dst: *mut T,
    len: usize,
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
    post: impl Fn(T::Acc) -> T::Acc,
) {
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < len {
        let m = BLOCK.min(len - start);
        let acc = &mut acc[..m];
        for (a, x) in acc.iter_mut().zip(&srcs[0][start..start + m]) {
            *a = x.to_acc();
        }
        for s in &srcs[1..] {
            for (a, x) in acc.iter_mut().zip(&s[start..start + m]) {
                *a = f(*a, x.to_acc());
            }
        }
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: `dst` has room for `len` elements (caller contract) and `start + i < len`.
            unsafe { dst.add(start + i).write(T::from_acc(post(*a))) };
        }
        start += m;
    }
}

fn typed<T>(b: &[u8]) -> &[T] {
    debug_assert_eq!(b.len() % std::mem::size_of::<T>(), 0);
    debug_assert_eq!(b.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: the bytes come from a candle storage of element type `T` (same dtype checked by
    // the desync detection) at an element-aligned offset; any bit pattern is a valid `T`.
    unsafe {
        std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / std::mem::size_of::<T>())
    }
}

/// Reduces `srcs` (byte slices of equal length holding `dtype` elements, in rank order) into
/// `dst`. `n` is the group size (for `Avg`). The order of combination is rank 0, 1, ..., so
/// every rank that reduces the same chunk gets the same bits.
///
/// # Safety
///
/// `dst` must be valid for writes of `srcs[0].len()` bytes, aligned for `dtype`, and not
/// accessed by anyone else during the call.
pub unsafe fn reduce_into(dtype: DType, op: ReduceOp, srcs: &[&[u8]], dst: *mut u8, n: usize) {
    fn run<T: Elem>(op: ReduceOp, srcs: &[&[u8]], dst: *mut u8, n: usize) {
        let srcs: Vec<&[T]> = srcs.iter().map(|s| typed::<T>(s)).collect();
        let len = srcs.first().map_or(0, |s| s.len());
        let dst = dst.cast::<T>();
        match op {
            ReduceOp::Sum => reduce_kernel(&srcs, dst, len, T::add, |a| a),
            ReduceOp::Avg => reduce_kernel(&srcs, dst, len, T::add, |a| T::div_n(a, n)),
            ReduceOp::Max => reduce_kernel(&srcs, dst, len, T::max, |a| a),
            ReduceOp::Min => reduce_kernel(&srcs, dst, len, T::min, |a| a),
            ReduceOp::Product => reduce_kernel(&srcs, dst, len, T::mul, |a| a),
        }
    }
    if srcs.is_empty() {
        return;
    }
    with_elem!(dtype, T => run::<T>(op, srcs, dst, n), _ => {})
}

/// The address of `t`'s first element (to detect outputs aliasing inputs).
pub fn data_addr(t: &Tensor) -> Option<usize> {
    let es = t.dtype().size_in_bytes();
    let (guard, layout) = t.storage_and_layout();
    match &*guard {
        Storage::Cpu(c) => cpu_bytes(c).map(|b| b.as_ptr() as usize + layout.start_offset() * es),
        _ => None,
    }
}

type WriteFn<'a> = Box<dyn FnOnce(*mut u8, usize) -> Result<(), String> + Send + 'a>;

/// An in-place candle op that hands the contiguous bytes of a CPU tensor to a closure, under
/// the storage's write lock.
struct WriteInto<'a> {
    f: std::sync::Mutex<Option<WriteFn<'a>>>,
    result: std::sync::Mutex<Option<Result<(), String>>>,
}

fn cpu_bytes_mut(s: &mut CpuStorage) -> Option<*mut u8> {
    Some(match s {
        CpuStorage::U8(v) => v.as_mut_ptr(),
        CpuStorage::U32(v) => v.as_mut_ptr().cast::<u8>(),
        CpuStorage::I64(v) => v.as_mut_ptr().cast::<u8>(),
        CpuStorage::BF16(v) => v.as_mut_ptr().cast::<u8>(),
        CpuStorage::F16(v) => v.as_mut_ptr().cast::<u8>(),
        CpuStorage::F32(v) => v.as_mut_ptr().cast::<u8>(),
        CpuStorage::F64(v) => v.as_mut_ptr().cast::<u8>(),
        _ => return None,
    })
}

impl candle_core::InplaceOp1 for WriteInto<'_> {
    fn name(&self) -> &'static str {
        "comm-write-into"
    }

    fn cpu_fwd(
        &self,
        storage: &mut CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let es = storage.dtype().size_in_bytes();
        let outcome = match (layout.contiguous_offsets(), cpu_bytes_mut(storage)) {
            (Some((s, e)), Some(base)) => {
                let f = self.f.lock().unwrap_or_else(|e| e.into_inner()).take();
                match f {
                    // SAFETY: `[s, e)` lies within the storage (candle checks layouts against the
                    // storage), and the write lock gives us exclusive access for the call.
                    Some(f) => f(unsafe { base.add(s * es) }, (e - s) * es),
                    None => Err("write-into closure already used".to_string()),
                }
            }
            (None, _) => Err("the output tensor is not contiguous".to_string()),
            (_, None) => Err(format!("dtype {:?} is not supported", storage.dtype())),
        };
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        Ok(())
    }
}

/// Runs `f` with the bytes of CPU tensor `t`, under its storage's write lock.
pub fn write_into<'a>(
    t: &Tensor,
    f: impl FnOnce(*mut u8, usize) -> Result<(), String> + Send + 'a,
) -> Result<(), String> {
    if !t.device().is_cpu() {
        return Err(format!(
            "this backend writes CPU tensors only; the output is on {:?}",
            t.device().location()
        ));
    }
    let op = WriteInto {
        f: std::sync::Mutex::new(Some(Box::new(f))),
        result: std::sync::Mutex::new(None),
    };
    t.inplace_op1(&op).map_err(|e| e.to_string())?;
    let r = op.result.lock().unwrap_or_else(|e| e.into_inner()).take();
    r.unwrap_or_else(|| Err("the output tensor is not on the CPU".to_string()))
}
