//! One-sided RMA windows.
//!
//! [`Comm::new_window`](crate::Comm::new_window) is collective: every rank allocates a window of
//! the same size. Afterwards a rank can [`Window::put`] into and [`Window::get`] from a peer's
//! window without the peer taking part, and order such accesses with [`Window::signal`] /
//! [`Window::wait_signal`] (point to point) or [`Window::fence`] (collective). Offsets and
//! lengths count elements of the dtype used by the call, as torchcomms does.
//! Whether a backend has `get` is in [`Capabilities`](crate::Capabilities) (NCCL has no get).

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::comm::Comm;
use crate::error::{CommError, Result};
use crate::vocab::{OpCtx, OpName};

/// The backend side of a window. Offsets here are in bytes and already bounds-checked.
pub trait WindowBackend: Send + Sync {
    /// The window size in bytes (the same on every rank).
    fn size_bytes(&self) -> usize;
    /// Writes `data` (contiguous) into `dst`'s window at `offset_bytes`.
    fn put(&self, ctx: &OpCtx, data: &Tensor, dst: usize, offset_bytes: usize) -> Result<()>;
    /// Reads `len` elements of `dtype` from `src`'s window at `offset_bytes` (a 1-D tensor).
    fn get(
        &self,
        ctx: &OpCtx,
        src: usize,
        offset_bytes: usize,
        len: usize,
        dtype: DType,
    ) -> Result<Tensor>;
    /// Increments `peer`'s signal counter for this rank.
    fn signal(&self, ctx: &OpCtx, peer: usize) -> Result<()>;
    /// Waits (bounded by `ctx.timeout`) until `peer` has signalled this rank once more than
    /// already consumed, and consumes that signal.
    fn wait_signal(&self, ctx: &OpCtx, peer: usize) -> Result<()>;
    /// Collective: returns when every rank has reached it; puts issued before are visible after.
    fn fence(&self, ctx: &OpCtx) -> Result<()>;
}

/// A rank's handle of an RMA window; see the module docs.
#[derive(Clone)]
pub struct Window {
    backend: Arc<dyn WindowBackend>,
    comm: Comm,
}

impl Window {
    pub(crate) fn new(backend: Arc<dyn WindowBackend>, comm: Comm) -> Self {
        Window { backend, comm }
    }

    /// The window size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.backend.size_bytes()
    }

    /// The communicator the window belongs to.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    fn check_range(
        &self,
        ctx: &OpCtx,
        peer: usize,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<usize> {
        if peer >= self.comm.size() {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "peer rank {peer} out of range for a communicator of size {}",
                    self.comm.size()
                ),
            ));
        }
        let es = dtype.size_in_bytes();
        let start = offset.checked_mul(es);
        let end = offset.checked_add(len).and_then(|e| e.checked_mul(es));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.size_bytes() => Ok(s),
            _ => Err(CommError::invalid(
                ctx,
                format!(
                    "elements [{offset}, {}) of {dtype:?} ({} bytes each) exceed the {}-byte window",
                    offset.saturating_add(len),
                    es,
                    self.size_bytes()
                ),
            )),
        }
    }

    /// Writes `data` into `dst`'s window starting at element `offset` (of `data`'s dtype).
    pub fn put(&self, data: &Tensor, dst: usize, offset: usize) -> Result<()> {
        let ctx = self.comm.next_ctx(OpName::WindowPut);
        let data = self.comm.prepare_input(&ctx, data)?;
        let start = self.check_range(&ctx, dst, offset, data.elem_count(), data.dtype())?;
        self.comm.observe(self.backend.put(&ctx, &data, dst, start))
    }

    /// Reads `len` elements of `dtype` from `src`'s window starting at element `offset`.
    pub fn get(&self, src: usize, offset: usize, len: usize, dtype: DType) -> Result<Tensor> {
        let ctx = self.comm.next_ctx(OpName::WindowGet);
        let start = self.check_range(&ctx, src, offset, len, dtype)?;
        if !crate::vocab::dtype_supported(dtype) {
            return Err(CommError::UnsupportedDType {
                ctx,
                dtype,
                reason: "windows hold f32, f64, bf16, f16, i64, u32 or u8".into(),
            });
        }
        self.comm
            .observe(self.backend.get(&ctx, src, start, len, dtype))
    }

    /// Signals `peer` (it can consume the signal with [`Window::wait_signal`]).
    pub fn signal(&self, peer: usize) -> Result<()> {
        let ctx = self.comm.next_ctx(OpName::WindowSignal);
        self.check_range(&ctx, peer, 0, 0, DType::U8)?;
        self.comm.observe(self.backend.signal(&ctx, peer))
    }

    /// Waits for one signal from `peer`.
    ///
    /// # Blocking
    ///
    /// Blocks until the signal arrives or the communicator's timeout passes
    /// ([`CommError::Timeout`] naming `peer`).
    pub fn wait_signal(&self, peer: usize) -> Result<()> {
        let ctx = self.comm.next_ctx(OpName::WindowWaitSignal);
        self.check_range(&ctx, peer, 0, 0, DType::U8)?;
        self.comm.observe(self.backend.wait_signal(&ctx, peer))
    }

    /// Collective barrier over the window's ranks.
    ///
    /// # Blocking
    ///
    /// Blocks until every rank arrives or the communicator's timeout passes.
    pub fn fence(&self) -> Result<()> {
        let ctx = self.comm.next_ctx(OpName::WindowFence);
        self.comm.observe(self.backend.fence(&ctx))
    }
}
