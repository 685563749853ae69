//! RMA windows on NCCL's symmetric memory (NCCL >= 2.29).
//!
//! The window is an `ncclMemAlloc` buffer (VMM memory, as symmetric registration needs)
//! registered with `ncclCommWindowRegister(.., NCCL_WIN_COLL_SYMMETRIC)`, a collective polled
//! under the bootstrap timeout. Operations run on the communicator's stream like collectives
//! (tracked by the watchdog, timeouts included) and return without blocking the CPU:
//!
//! - `put` is `ncclPutSignal` (signal index 0): NCCL has no put without a signal, so each put
//!   also delivers one signal to its target, which a `wait_signal` there consumes;
//! - `signal` is `ncclSignal`; `wait_signal` is `ncclWaitSignal` for one signal, stream-ordered
//!   (later operations of the communicator, and the caller's stream, wait for it);
//! - `fence` is a barrier (it blocks until every rank arrived);
//! - `get` from a peer is [`CommError::Unsupported`] (NCCL has no one-sided get); `get` from this
//!   rank's own window is a device copy ordered after the communicator's stream (how a target
//!   reads what its peers put).
//!
//! Dropping the window deregisters it (when the communicator is still usable) and frees the
//! buffer; if deregistration cannot complete, the buffer is leaked rather than freed under NCCL.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};

use super::api::{Call, DevPtr, NcclCode, RawWindow};
use super::backend::Owner;
use super::calls;
use super::driver::{dev_ptr, CudaStreams};
use super::engine::{detail, wait_ready, Delivery, Ready};
use super::errors::bootstrap_error;
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::WindowBackend;
use candle_dtensor_comm_core::{CommError, Result};

/// One rank's handle of an NCCL window; see the module docs.
pub(crate) struct NcclWindow {
    owner: Arc<Owner>,
    streams: Arc<CudaStreams>,
    device: Device,
    buf: DevPtr,
    bytes: usize,
    win: RawWindow,
}

impl NcclWindow {
    /// Collective: allocates and registers a `bytes`-byte window on every rank.
    pub(crate) fn new(
        owner: Arc<Owner>,
        streams: Arc<CudaStreams>,
        device: Device,
        ctx: &OpCtx,
        bytes: usize,
    ) -> Result<NcclWindow> {
        let core = owner.0.clone();
        if !core.gates.windows {
            return Err(CommError::Unsupported {
                backend: "nccl".into(),
                op: format!(
                    "{ctx}: windows need NCCL >= 2.29 with ncclCommWindowRegister and \
                     ncclPutSignal/ncclSignal/ncclWaitSignal; this is NCCL {}",
                    core.gates.version
                ),
            });
        }
        let st = core.lock();
        core.check_healthy(ctx)?;
        core.streams.bind().map_err(|e| {
            bootstrap_error(
                &core.name,
                core.rank,
                "binding the CUDA context",
                NcclCode::UNHANDLED_CUDA_ERROR,
                &format!(" ({e})"),
            )
        })?;
        let api = &*core.api;
        let bytes_alloc = bytes.max(1);
        let buf = api
            .mem_alloc(bytes_alloc)
            .map_err(|c| bootstrap_error(&core.name, core.rank, "ncclMemAlloc", c, ""))?;
        let out = Box::new(AtomicUsize::new(0));
        let code = api.window_register(st.raw, buf, bytes_alloc, &out);
        let deadline = Instant::now() + core.bootstrap_timeout;
        let ready = if code.is_success() {
            Ready::Ok
        } else if code == NcclCode::IN_PROGRESS {
            wait_ready(api, st.raw, deadline, Some(core.abort_requested()))
        } else {
            Ready::Failed(code)
        };
        let win = out.load(Ordering::Acquire);
        match ready {
            Ready::Ok if win != 0 => {}
            Ready::Ok | Ready::Failed(_) => {
                let c = match ready {
                    Ready::Failed(c) => c,
                    _ => NcclCode::INTERNAL_ERROR,
                };
                let e = bootstrap_error(
                    &core.name,
                    core.rank,
                    "ncclCommWindowRegister",
                    c,
                    &detail(api, st.raw),
                );
                drop(st);
                // A collective registration that failed on one rank leaves the others stuck.
                core.fail(None, e.to_string());
                Box::leak(out);
                return Err(e);
            }
            Ready::TimedOut | Ready::AbortRequested => {
                drop(st);
                let e = CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: core.bootstrap_timeout,
                    missing: Vec::new(),
                };
                core.fail(None, format!("window registration timed out: {e}"));
                Box::leak(out);
                return Err(e);
            }
        }
        Ok(NcclWindow {
            owner,
            streams,
            device,
            buf,
            bytes,
            win: RawWindow(win),
        })
    }

    fn core(&self) -> &Arc<super::engine::Core> {
        &self.owner.0
    }

    fn run(&self, ctx: &OpCtx, calls: Vec<Call>, keep: Vec<Tensor>) -> Result<()> {
        self.core()
            .issue(ctx.clone(), calls, Delivery::Published(()), Box::new(keep))?
            .wait()
    }
}

impl WindowBackend for NcclWindow {
    fn size_bytes(&self) -> usize {
        self.bytes
    }

    fn put(&self, ctx: &OpCtx, data: &Tensor, dst: usize, offset_bytes: usize) -> Result<()> {
        let dt = calls::data_type(data.dtype()).ok_or_else(|| CommError::UnsupportedDType {
            ctx: ctx.clone(),
            dtype: data.dtype(),
            reason: "the nccl backend takes f32, f64, bf16, f16, i64, u32 or u8".into(),
        })?;
        if data.elem_count() == 0 {
            return Ok(());
        }
        let buf = dev_ptr(data, &self.streams.comm).map_err(|e| CommError::invalid(ctx, e))?;
        let call = Call::PutSignal {
            buf,
            count: data.elem_count(),
            dt,
            peer: dst as i32,
            win: self.win,
            offset: offset_bytes,
        };
        self.run(ctx, vec![call], vec![data.clone()])
    }

    fn get(
        &self,
        ctx: &OpCtx,
        src: usize,
        offset_bytes: usize,
        len: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        if src != self.core().rank {
            return Err(CommError::Unsupported {
                backend: "nccl".into(),
                op: format!(
                    "{ctx}: get from rank {src}'s window (NCCL has no one-sided get; put into the \
                     reader's window and signal it instead)"
                ),
            });
        }
        let out = if len == 0 {
            Tensor::zeros(1, dtype, &self.device)
                .and_then(|t| t.narrow(0, 0, 0))
                .map_err(|e| CommError::candle(ctx, e))?
        } else {
            super::driver::empty(&Shape::from(len), dtype, &self.device)
                .map_err(|e| CommError::candle(ctx, e))?
        };
        if len == 0 {
            return Ok(out);
        }
        let core = self.core();
        core.check_healthy(ctx)?;
        let fail = |what: &str, e: String| CommError::Aborted {
            ctx: ctx.clone(),
            reason: format!("CUDA error while {what}: {e}"),
        };
        // Everything enqueued on the communicator's stream so far (puts landed, signals waited
        // for) comes before the copy, which runs on the caller's stream.
        let ev = core
            .streams
            .record()
            .map_err(|e| fail("recording an event", e))?;
        core.streams
            .caller_after(&*ev)
            .map_err(|e| fail("ordering the caller's stream", e))?;
        let caller = self.streams.device.cuda_stream();
        let dst = dev_ptr(&out, &caller).map_err(|e| CommError::invalid(ctx, e))?;
        let n = len * dtype.size_in_bytes();
        // SAFETY: `dst` is the fresh output of `n` bytes; `self.buf + offset_bytes` lies within
        // the window (the front checked `offset + len` against its size); the copy is enqueued
        // on the caller's stream, which the output's readers use, and the window outlives it
        // (freed only after deregistration, once the communicator's stream drained).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst,
                self.buf + offset_bytes as u64,
                n,
                caller.cu_stream(),
            )
        }
        .map_err(|e| fail("copying from the window", e.to_string()))?;
        Ok(out)
    }

    fn signal(&self, ctx: &OpCtx, peer: usize) -> Result<()> {
        self.run(ctx, vec![Call::Signal { peer: peer as i32 }], Vec::new())
    }

    fn wait_signal(&self, ctx: &OpCtx, peer: usize) -> Result<()> {
        self.run(
            ctx,
            vec![Call::WaitSignal {
                peer: peer as i32,
                count: 1,
            }],
            Vec::new(),
        )
    }

    fn fence(&self, ctx: &OpCtx) -> Result<()> {
        let t =
            Tensor::zeros(1, DType::F32, &self.device).map_err(|e| CommError::candle(ctx, e))?;
        let p = dev_ptr(&t, &self.streams.comm).map_err(|e| CommError::invalid(ctx, e))?;
        let call = Call::AllReduce {
            send: p,
            recv: p,
            count: 1,
            dt: super::api::DataType::Float32,
            op: super::api::RedOp::Sum,
        };
        self.core()
            .issue(
                ctx.clone(),
                vec![call],
                Delivery::Blocking(()),
                Box::new(vec![t]),
            )?
            .wait()
    }
}

impl Drop for NcclWindow {
    fn drop(&mut self) {
        let core = self.core().clone();
        let st = core.lock();
        if st.torn_down || core.failure().is_some() {
            // NCCL frees registrations with the communicator; the buffer may still be mapped
            // by peers, so it is leaked rather than freed.
            return;
        }
        if core.streams.bind().is_err() {
            return;
        }
        let api = &*core.api;
        let code = api.window_deregister(st.raw, self.win);
        let ok = code.is_success()
            || (code == NcclCode::IN_PROGRESS
                && wait_ready(api, st.raw, Instant::now() + core.bootstrap_timeout, None)
                    == Ready::Ok);
        if ok {
            let c = api.mem_free(self.buf);
            if !c.is_success() {
                tracing::warn!(comm = %core.name, rank = core.rank, code = %c, "ncclMemFree failed");
            }
        } else {
            tracing::warn!(comm = %core.name, rank = core.rank, %code, "ncclCommWindowDeregister failed; leaking the window buffer");
            drop(st);
            core.fail(None, format!("ncclCommWindowDeregister failed with {code}"));
        }
    }
}
