//! What the CPU backends (`local`, `process`, `mpi`) share: the per-communicator op queue
//! ([`queue`]), byte views of candle CPU storage, output buffers and the reduction kernels
//! ([`kernels`]), and how a result reaches the caller (a fresh tensor, or the caller's `*_into`
//! output). The cross-rank rules they share (descriptors, failures, split checks) are in
//! [`crate::kit::desc`].

pub mod bytes;
pub mod kernels;
pub mod queue;

use candle_core::{DType, Device, Shape, Tensor};

use crate::backend::{check_output, dtype_names, Capabilities};
use crate::error::{CommError, Result};
use crate::vocab::{OpCtx, ReduceOp, SUPPORTED_DTYPES};
use kernels::{reduce_into, write_into, OutBuf};

/// Inputs up to this many bytes per rank take the one-round (eager) path of a collective:
/// copied at arrival (local), sent whole to every peer (process, mpi).
pub const EAGER_BYTES: usize = 64 * 1024;

/// The capabilities of a CPU backend: every supported dtype, abort, shrink (`local` and
/// `process`; MPI cannot, see `no_recovery` in candle-dtensor-comm-mpi), and RMA windows or none.
pub fn capabilities(rma: bool) -> Capabilities {
    Capabilities {
        rma_put: rma,
        rma_get: rma,
        rma_signal: rma,
        abort: true,
        shrink: true,
        dtypes: dtype_names(&SUPPORTED_DTYPES),
    }
}

/// Refuses a device other than the CPU for a communicator `name` of `backend`.
pub fn require_cpu(device: &Device, backend: &str, name: &str) -> Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    Err(CommError::Bootstrap {
        comm: name.to_string(),
        reason: format!(
            "the {backend} backend runs on the CPU; got {:?}",
            device.location()
        ),
    })
}

/// Maps a kernel's message to an invalid-argument error of `ctx`.
pub fn view_err(ctx: &OpCtx) -> impl Fn(String) -> CommError + '_ {
    move |e| CommError::invalid(ctx, e)
}

/// Maps a candle error to an error of `ctx`.
pub fn candle_err(ctx: &OpCtx) -> impl Fn(candle_core::Error) -> CommError + '_ {
    move |e| CommError::candle(ctx, e)
}

/// A fresh output buffer, or an error in the op's context.
pub fn out_buf(ctx: &OpCtx, dtype: DType, elems: usize) -> Result<OutBuf> {
    OutBuf::new(dtype, elems).map_err(view_err(ctx))
}

/// Copies `src` to `dst + offset`.
///
/// # Safety
///
/// `[offset, offset + src.len())` must lie within an allocation `dst` points into that only
/// this thread writes, and `src` must not overlap it.
pub unsafe fn put_bytes(dst: *mut u8, offset: usize, src: &[u8]) {
    // SAFETY: per the function contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(offset), src.len()) }
}

/// Reduces `srcs` (one byte slice of `elems` elements of `dtype` per rank, in rank order, each
/// aligned for `dtype`) into a fresh buffer, fully written.
pub fn reduced(
    ctx: &OpCtx,
    dtype: DType,
    op: ReduceOp,
    srcs: &[&[u8]],
    elems: usize,
) -> Result<OutBuf> {
    let out = out_buf(ctx, dtype, elems)?;
    if elems > 0 {
        // SAFETY: `out` holds `elems` elements of `dtype`, private to this thread; every source
        // holds `elems` elements (the callers' receives and views check it) and is aligned for
        // `dtype` (tensor storage or an 8-byte aligned payload).
        unsafe { reduce_into(dtype, op, srcs, out.ptr(), srcs.len()) };
    }
    Ok(out)
}

/// Writes a collective's result: into `output` when the caller gave one (checked for dtype and
/// size; under its storage's write lock, so the caller must hold no read view of it), else
/// into a fresh buffer that becomes a new tensor of `shape` without a copy. `fill` gets the
/// destination's first byte and must write all `shape.elem_count()` elements.
pub fn produce(
    ctx: &OpCtx,
    output: Option<Tensor>,
    dtype: DType,
    shape: Shape,
    fill: impl FnOnce(*mut u8) -> Result<()> + Send,
) -> Result<Tensor> {
    let elems = shape.elem_count();
    let Some(t) = output else {
        let out = out_buf(ctx, dtype, elems)?;
        fill(out.ptr())?;
        // SAFETY: `fill` wrote every element (its contract).
        return unsafe { out.into_tensor(shape) }.map_err(candle_err(ctx));
    };
    check_output(ctx, &t, dtype, &shape)?;
    let mut err = None;
    write_into(&t, |ptr, len| {
        if len != elems * dtype.size_in_bytes() {
            return Err(format!(
                "output holds {len} bytes, expected {}",
                elems * dtype.size_in_bytes()
            ));
        }
        fill(ptr).map_err(|e| {
            let m = e.to_string();
            err = Some(e);
            m
        })
    })
    .map_err(|m| err.take().unwrap_or_else(|| CommError::invalid(ctx, m)))?;
    Ok(t)
}

/// A result already computed in `buf`: it becomes the new tensor of `shape` (no copy), or is
/// copied into the caller's `output`.
///
/// # Safety
///
/// Every byte of `buf` must have been written.
pub unsafe fn deliver(
    ctx: &OpCtx,
    buf: OutBuf,
    shape: Shape,
    output: Option<Tensor>,
) -> Result<Tensor> {
    if output.is_none() {
        // SAFETY: fully written (the function contract).
        return unsafe { buf.into_tensor(shape) }.map_err(candle_err(ctx));
    }
    // SAFETY: as above; nothing writes `buf` any more.
    let src = unsafe { buf.written() };
    if src.len() != shape.elem_count() * buf.dtype().size_in_bytes() {
        return Err(CommError::invalid(
            ctx,
            format!("a {}-byte result for shape {:?}", src.len(), shape.dims()),
        ));
    }
    produce(ctx, output, buf.dtype(), shape, |dst| {
        // SAFETY: `produce` checked that `dst` holds the result's bytes, as many as `src`.
        unsafe { put_bytes(dst, 0, src) };
        Ok(())
    })
}
