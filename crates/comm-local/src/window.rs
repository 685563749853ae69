//! RMA windows of the local backend: every rank's window is a buffer in shared memory that
//! peers read and write directly under a per-buffer lock.

use std::sync::{Arc, RwLock};

use candle_core::{DType, Shape, Tensor};

use super::backend::Core;
use super::group::{Group, Post};
use candle_dtensor_comm_core::kit::cpu::kernels::{read_view, OutBuf};
use candle_dtensor_comm_core::kit::desc::OpDesc;
use candle_dtensor_comm_core::WindowBackend;
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, OpName};

/// The buffers of one window, one per rank.
pub(crate) struct WindowShared {
    id: u64,
    bytes: usize,
    bufs: Vec<RwLock<Vec<u8>>>,
}

impl WindowShared {
    /// The window created by collective `id` of `group` (the first rank to get here allocates).
    pub(crate) fn get_or_create(group: &Arc<Group>, id: u64, bytes: usize) -> Arc<WindowShared> {
        let n = group.size();
        let mut st = group.lock();
        st.windows.retain(|_, w| w.strong_count() > 0);
        if let Some(w) = st.windows.get(&id).and_then(std::sync::Weak::upgrade) {
            return w;
        }
        let w = Arc::new(WindowShared {
            id,
            bytes,
            bufs: (0..n).map(|_| RwLock::new(vec![0u8; bytes])).collect(),
        });
        st.windows.insert(id, Arc::downgrade(&w));
        st.signals.insert(id, (vec![0; n * n], vec![0; n * n]));
        w
    }
}

/// One rank's handle of a local window.
pub(crate) struct LocalWindow {
    shared: Arc<WindowShared>,
    core: Arc<Core>,
}

impl LocalWindow {
    pub(crate) fn new(shared: Arc<WindowShared>, core: Arc<Core>) -> Self {
        LocalWindow { shared, core }
    }
}

impl WindowBackend for LocalWindow {
    fn size_bytes(&self) -> usize {
        self.shared.bytes
    }

    fn put(&self, ctx: &OpCtx, data: &Tensor, dst: usize, offset_bytes: usize) -> Result<()> {
        // Windows live in host memory; CUDA data is staged through it.
        #[cfg(feature = "cuda")]
        let staged = data
            .to_device(&candle_core::Device::Cpu)
            .map_err(|e| CommError::candle(ctx, e))?;
        #[cfg(feature = "cuda")]
        let data = &staged;
        let view = read_view(data).map_err(|e| CommError::invalid(ctx, e))?;
        let src = view.bytes();
        let mut buf = self.shared.bufs[dst]
            .write()
            .unwrap_or_else(|e| e.into_inner());
        buf[offset_bytes..offset_bytes + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn get(
        &self,
        ctx: &OpCtx,
        src: usize,
        offset_bytes: usize,
        len: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let out = OutBuf::new(dtype, len).map_err(|e| CommError::invalid(ctx, e))?;
        let buf = self.shared.bufs[src]
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let n = len * dtype.size_in_bytes();
        // SAFETY: `out` holds exactly `n` bytes and is private to this thread.
        let t = unsafe {
            out.write(0, &buf[offset_bytes..offset_bytes + n]);
            out.into_tensor(Shape::from_dims(&[len]))
        }
        .map_err(|e| CommError::candle(ctx, e))?;
        #[cfg(feature = "cuda")]
        let t = t
            .to_device(self.core.device())
            .map_err(|e| CommError::candle(ctx, e))?;
        Ok(t)
    }

    fn signal(&self, ctx: &OpCtx, peer: usize) -> Result<()> {
        let g = &self.core.group;
        let n = g.size();
        let mut st = g.lock();
        let (counts, _) = st
            .signals
            .get_mut(&self.shared.id)
            .ok_or_else(|| CommError::invalid(ctx, "window was freed"))?;
        counts[peer * n + self.core.rank] += 1;
        drop(st);
        g.notify();
        Ok(())
    }

    fn wait_signal(&self, ctx: &OpCtx, peer: usize) -> Result<()> {
        let g = &self.core.group;
        let n = g.size();
        let idx = self.core.rank * n + peer;
        let deadline = std::time::Instant::now() + ctx.timeout;
        let mut st = g.lock();
        loop {
            let (counts, consumed) = st
                .signals
                .get_mut(&self.shared.id)
                .ok_or_else(|| CommError::invalid(ctx, "window was freed"))?;
            if counts[idx] > consumed[idx] {
                consumed[idx] += 1;
                return Ok(());
            }
            if let Some(f) = g.failure_locked(&st) {
                return Err(f.to_error(ctx, None));
            }
            let (guard, timed_out) = g.wait(st, deadline);
            st = guard;
            if timed_out {
                drop(st);
                g.fail(candle_dtensor_comm_core::kit::desc::Failure::Timeout {
                    collective: u64::MAX,
                    op: ctx.op,
                    missing: vec![peer],
                });
                return Err(CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing: vec![peer],
                });
            }
        }
    }

    fn fence(&self, ctx: &OpCtx) -> Result<()> {
        self.core.run_sync(ctx.clone(), |e| {
            let desc = OpDesc::new(OpName::WindowFence);
            e.arrive(desc, Post::default())?;
            e.depart(false)
        })
    }
}
