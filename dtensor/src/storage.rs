//! Byte access to contiguous CPU tensors, and the block copies that pad, unpad, stack and
//! unstack shards along one dim (`[pre, len, post]` views of a tensor cut at the sharded dim).

use candle_core::{backend::BackendStorage, CpuStorage, Layout, Storage, Tensor};

fn pod<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: numeric element types without padding; the byte view borrows `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn pod_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `pod`; every byte pattern is a valid numeric value, so writes through the
    // byte view cannot create invalid values.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn cpu_bytes(s: &CpuStorage) -> Option<&[u8]> {
    Some(match s {
        CpuStorage::U8(v) => v.as_slice(),
        CpuStorage::U32(v) => pod(v),
        CpuStorage::I64(v) => pod(v),
        CpuStorage::BF16(v) => pod(v),
        CpuStorage::F16(v) => pod(v),
        CpuStorage::F32(v) => pod(v),
        CpuStorage::F64(v) => pod(v),
        _ => return None,
    })
}

fn cpu_bytes_mut(s: &mut CpuStorage) -> Option<&mut [u8]> {
    Some(match s {
        CpuStorage::U8(v) => v.as_mut_slice(),
        CpuStorage::U32(v) => pod_mut(v),
        CpuStorage::I64(v) => pod_mut(v),
        CpuStorage::BF16(v) => pod_mut(v),
        CpuStorage::F16(v) => pod_mut(v),
        CpuStorage::F32(v) => pod_mut(v),
        CpuStorage::F64(v) => pod_mut(v),
        _ => return None,
    })
}

fn msg(s: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(s.into())
}

/// Runs `f` on the bytes of the contiguous CPU tensor `t` (under its read lock).
///
/// An empty tensor gets an empty slice without touching its storage: candle lets an empty view
/// carry a start offset past the end of its (possibly empty) storage.
pub(crate) fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> candle_core::Result<R> {
    if t.elem_count() == 0 {
        return Ok(f(&[]));
    }
    let es = t.dtype().size_in_bytes();
    let (guard, layout) = t.storage_and_layout();
    let (s, e) = layout
        .contiguous_offsets()
        .ok_or_else(|| msg("expected a contiguous tensor"))?;
    match &*guard {
        Storage::Cpu(c) => {
            let b =
                cpu_bytes(c).ok_or_else(|| msg(format!("unsupported dtype {:?}", t.dtype())))?;
            Ok(f(&b[s * es..e * es]))
        }
        _ => Err(msg("expected a CPU tensor")),
    }
}

type WriteFn<'a, R> = Box<dyn FnOnce(&mut [u8]) -> R + Send + 'a>;

struct WriteBytes<'a, R> {
    f: std::sync::Mutex<Option<WriteFn<'a, R>>>,
    out: std::sync::Mutex<Option<R>>,
}

impl<R: Send> candle_core::InplaceOp1 for WriteBytes<'_, R> {
    fn name(&self) -> &'static str {
        "dtensor-write-bytes"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let es = storage.dtype().size_in_bytes();
        let (s, e) = layout
            .contiguous_offsets()
            .ok_or_else(|| msg("expected a contiguous tensor"))?;
        let b = cpu_bytes_mut(storage).ok_or_else(|| msg("unsupported dtype"))?;
        let f = self
            .f
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| msg("write closure already used"))?;
        let r = f(&mut b[s * es..e * es]);
        *self.out.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(())
    }
}

/// Runs `f` on the bytes of the contiguous CPU tensor `t` (under its write lock). This mutates
/// `t` in place: only for tensors this crate just created. An empty tensor gets an empty slice
/// (candle refuses in-place ops on it: its contiguous strides contain zeros).
pub(crate) fn with_bytes_mut<'a, R: Send>(
    t: &Tensor,
    f: impl FnOnce(&mut [u8]) -> R + Send + 'a,
) -> candle_core::Result<R> {
    if !t.device().is_cpu() {
        return Err(msg("expected a CPU tensor"));
    }
    if t.elem_count() == 0 {
        return Ok(f(&mut []));
    }
    let op = WriteBytes {
        f: std::sync::Mutex::new(Some(Box::new(f))),
        out: std::sync::Mutex::new(None),
    };
    t.inplace_op1(&op)?;
    let r = op.out.lock().unwrap_or_else(|e| e.into_inner()).take();
    r.ok_or_else(|| msg("write closure did not run"))
}

/// `x.narrow(dim, start, len)` that never builds an out-of-bounds view: when the result has no
/// elements it narrows at offset 0 instead (the values are irrelevant, the graph node and the
/// shape are the same). candle accepts `narrow` on an empty tensor with any `start <= dim` and
/// records a start offset past the end of the storage, which its copy kernels later slice and
/// panic on.
pub(crate) fn narrow(
    x: &Tensor,
    dim: usize,
    start: usize,
    len: usize,
) -> candle_core::Result<Tensor> {
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

/// A `[pre, len, post]` view of a shape cut at `dim` (in elements).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cut {
    pub pre: usize,
    pub len: usize,
    pub post: usize,
}

impl Cut {
    pub(crate) fn new(dims: &[usize], dim: usize) -> Self {
        Cut {
            pre: dims[..dim].iter().product(),
            len: dims[dim],
            post: dims[dim + 1..].iter().product(),
        }
    }
}

/// Copies, for each of the `pre` outer blocks, `rows` rows of `post` elements (`es` bytes each)
/// from `src` (rows of the block start at `src_row`, the block holds `src_len` rows) to `dst`
/// (start `dst_row`, block of `dst_len` rows).
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_rows(
    src: &[u8],
    src_len: usize,
    src_row: usize,
    dst: &mut [u8],
    dst_len: usize,
    dst_row: usize,
    pre: usize,
    rows: usize,
    post_bytes: usize,
) {
    let n = rows * post_bytes;
    if n == 0 {
        return;
    }
    for p in 0..pre {
        let s = (p * src_len + src_row) * post_bytes;
        let d = (p * dst_len + dst_row) * post_bytes;
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
}
