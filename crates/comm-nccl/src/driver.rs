//! The real [`NcclApi`] (cudarc's raw NCCL bindings plus `dlsym` for the functions newer than
//! NCCL 2.19), the real [`Streams`] / [`Event`] (cudarc's driver API), and device pointers of
//! candle CUDA tensors.
//!
//! # Linking
//!
//! candle's `cuda` feature links the CUDA libraries dynamically (`-lnccl`, `-lcuda`, ...), and
//! Rust binaries bind every symbol at load time. The functions every supported NCCL has go
//! through `cudarc::nccl::sys`; the optional ones ([`Optional`]) are looked up with `dlsym`
//! when the API is first used, so a binary built against the 2.30 bindings still starts on an
//! NCCL 2.21 and reports those operations as unsupported (or takes the grouped send/recv path).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};

use candle_core::{CudaDevice, DType, Device, Shape, Storage, Tensor};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr};
use cudarc::nccl::sys;

use super::api::{
    Call, DevPtr, NcclApi, NcclCode, Optional, RawComm, RawStream, RawWindow, UniqueId,
};
use super::config::RawConfig;
use super::engine::{Event, Streams};

// `RawConfig` is passed where NCCL takes `ncclConfig_t*`: the layouts must agree.
const _: () = assert!(std::mem::size_of::<RawConfig>() == std::mem::size_of::<sys::ncclConfig_t>());
const _: () =
    assert!(std::mem::align_of::<RawConfig>() == std::mem::align_of::<sys::ncclConfig_t>());

/// `NCCL_WIN_COLL_SYMMETRIC`.
const WIN_COLL_SYMMETRIC: c_int = 0x01;

// C signatures of the optional functions. `ncclResult_t` and `ncclDataType_t` are C enums
// (`int`-sized); they are declared as integers so an unexpected value is just a number.
type AllToAllFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_uint,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_uint;
type RootedFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_uint,
    c_int,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_uint;
type RevokeFn = unsafe extern "C" fn(sys::ncclComm_t, c_int) -> c_uint;
type ShrinkFn = unsafe extern "C" fn(
    sys::ncclComm_t,
    *mut c_int,
    c_int,
    *mut sys::ncclComm_t,
    *mut sys::ncclConfig_t,
    c_int,
) -> c_uint;
type WinRegisterFn =
    unsafe extern "C" fn(sys::ncclComm_t, *mut c_void, usize, *mut *mut c_void, c_int) -> c_uint;
type WinDeregisterFn = unsafe extern "C" fn(sys::ncclComm_t, *mut c_void) -> c_uint;
type PutSignalFn = unsafe extern "C" fn(
    *const c_void,
    usize,
    c_uint,
    c_int,
    *mut c_void,
    usize,
    c_int,
    c_int,
    c_uint,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_uint;
type SignalFn =
    unsafe extern "C" fn(c_int, c_int, c_int, c_uint, sys::ncclComm_t, sys::cudaStream_t) -> c_uint;

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
struct WaitSignalDesc {
    op_cnt: c_int,
    peer: c_int,
    sig_idx: c_int,
    ctx: c_int,
}

type WaitSignalFn =
    unsafe extern "C" fn(c_int, *mut WaitSignalDesc, sys::ncclComm_t, sys::cudaStream_t) -> c_uint;

/// Looks `name` up among the loaded libraries (libnccl is linked, so it is loaded).
fn lookup(name: &str) -> Option<usize> {
    let cname = CString::new(name).ok()?;
    // SAFETY: `dlsym` with the `RTLD_DEFAULT` pseudo-handle and a NUL-terminated name only reads
    // the loader's tables; a null result means "not found".
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, cname.as_ptr()) };
    if !p.is_null() {
        return Some(p as usize);
    }
    // NCCL loaded privately (dlopen by someone else): look in that copy.
    for lib in [c"libnccl.so.2", c"libnccl.so"] {
        // SAFETY: RTLD_NOLOAD never loads anything; it returns a handle to an already loaded
        // library (or null). The handle is closed right after the lookup.
        let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if h.is_null() {
            continue;
        }
        // SAFETY: `h` is a valid handle from dlopen; the name is NUL-terminated.
        let p = unsafe { libc::dlsym(h, cname.as_ptr()) };
        // SAFETY: `h` came from dlopen and is closed once (the library stays loaded: it was
        // loaded before, and RTLD_NOLOAD only took a reference).
        unsafe { libc::dlclose(h) };
        if !p.is_null() {
            return Some(p as usize);
        }
    }
    None
}

fn comm_ptr(c: RawComm) -> sys::ncclComm_t {
    c.0 as sys::ncclComm_t
}

fn stream_ptr(s: RawStream) -> sys::cudaStream_t {
    s.0 as sys::cudaStream_t
}

fn code(r: sys::ncclResult_t) -> NcclCode {
    NcclCode(r as u32)
}

fn dtype_sys(dt: super::api::DataType) -> sys::ncclDataType_t {
    use super::api::DataType as D;
    use sys::ncclDataType_t as S;
    match dt {
        D::Uint8 => S::ncclUint8,
        D::Uint32 => S::ncclUint32,
        D::Int64 => S::ncclInt64,
        D::Float16 => S::ncclFloat16,
        D::Float32 => S::ncclFloat32,
        D::Float64 => S::ncclFloat64,
        D::Bfloat16 => S::ncclBfloat16,
    }
}

fn op_sys(op: super::api::RedOp) -> sys::ncclRedOp_t {
    use super::api::RedOp as R;
    use sys::ncclRedOp_t as S;
    match op {
        R::Sum => S::ncclSum,
        R::Prod => S::ncclProd,
        R::Max => S::ncclMax,
        R::Min => S::ncclMin,
        R::Avg => S::ncclAvg,
    }
}

/// NCCL through cudarc's raw bindings; see the module docs.
pub struct CudarcApi {
    optional: HashMap<Optional, usize>,
}

impl CudarcApi {
    /// The process-wide instance (optional symbols resolved once).
    pub fn get() -> Arc<CudarcApi> {
        static API: OnceLock<Arc<CudarcApi>> = OnceLock::new();
        API.get_or_init(|| {
            let optional = [
                Optional::AllToAll,
                Optional::Gather,
                Optional::Scatter,
                Optional::Revoke,
                Optional::Shrink,
                Optional::Window,
                Optional::PutSignal,
                Optional::Signal,
                Optional::WaitSignal,
            ]
            .into_iter()
            .filter_map(|f| lookup(f.symbol()).map(|p| (f, p)))
            .filter(|(f, _)| *f != Optional::Window || lookup("ncclCommWindowDeregister").is_some())
            .collect();
            Arc::new(CudarcApi { optional })
        })
        .clone()
    }

    fn sym(&self, f: Optional) -> Option<usize> {
        self.optional.get(&f).copied()
    }
}

impl NcclApi for CudarcApi {
    fn version(&self) -> Result<i32, NcclCode> {
        let mut v: c_int = 0;
        // SAFETY: ncclGetVersion writes one int through a valid pointer.
        let c = code(unsafe { sys::ncclGetVersion(&mut v) });
        if c.is_success() {
            Ok(v)
        } else {
            Err(c)
        }
    }

    fn has(&self, f: Optional) -> bool {
        self.sym(f).is_some()
    }

    fn unique_id(&self) -> Result<UniqueId, NcclCode> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: ncclGetUniqueId fills the 128-byte struct it is given.
        let c = code(unsafe { sys::ncclGetUniqueId(&mut id) });
        if !c.is_success() {
            return Err(c);
        }
        Ok(UniqueId(std::array::from_fn(|i| id.internal[i] as u8)))
    }

    fn init_rank(
        &self,
        out: &AtomicUsize,
        nranks: i32,
        id: &UniqueId,
        rank: i32,
        config: &RawConfig,
    ) -> NcclCode {
        let uid = sys::ncclUniqueId {
            internal: std::array::from_fn(|i| id.0[i] as c_char),
        };
        // SAFETY: `out` is a pointer-sized atomic that outlives the nonblocking call (the engine
        // leaks it on the paths that give up early); `config` has the layout of `ncclConfig_t`
        // (asserted above) and NCCL only reads it (and the strings it points to, owned by the
        // caller's `ConfigSpec`, alive until the call completes).
        code(unsafe {
            sys::ncclCommInitRankConfig(
                out.as_ptr().cast::<sys::ncclComm_t>(),
                nranks,
                uid,
                rank,
                (config as *const RawConfig)
                    .cast_mut()
                    .cast::<sys::ncclConfig_t>(),
            )
        })
    }

    fn split(
        &self,
        comm: RawComm,
        color: i32,
        key: i32,
        out: &AtomicUsize,
        config: &RawConfig,
    ) -> NcclCode {
        // SAFETY: as in `init_rank`; `comm` is a live communicator (the caller holds its issue
        // lock and checked it is not torn down).
        code(unsafe {
            sys::ncclCommSplit(
                comm_ptr(comm),
                color,
                key,
                out.as_ptr().cast::<sys::ncclComm_t>(),
                (config as *const RawConfig)
                    .cast_mut()
                    .cast::<sys::ncclConfig_t>(),
            )
        })
    }

    fn shrink(
        &self,
        comm: RawComm,
        excluded: &[i32],
        out: &AtomicUsize,
        config: &RawConfig,
        flags: i32,
    ) -> NcclCode {
        let Some(p) = self.sym(Optional::Shrink) else {
            return NcclCode::UNAVAILABLE;
        };
        // SAFETY: `p` is the address of `ncclCommShrink` (looked up by name, NCCL >= 2.27.3),
        // whose C signature is `ShrinkFn`.
        let f: ShrinkFn = unsafe { std::mem::transmute::<usize, ShrinkFn>(p) };
        // NCCL sorts the list it is given in place: hand it a copy.
        let mut list = excluded.to_vec();
        // SAFETY: `comm` is live (the caller holds its issue lock, checked it is not torn
        // down); `list` holds `len` ints and outlives the call (NCCL reads it during the call
        // only); `out` and `config` as in `split`. The result is a plain C int (`ShrinkFn`).
        NcclCode(unsafe {
            f(
                comm_ptr(comm),
                list.as_mut_ptr(),
                list.len() as c_int,
                out.as_ptr().cast::<sys::ncclComm_t>(),
                (config as *const RawConfig)
                    .cast_mut()
                    .cast::<sys::ncclConfig_t>(),
                flags,
            )
        })
    }

    fn async_error(&self, comm: RawComm) -> NcclCode {
        let mut state: u32 = 0;
        // SAFETY: `comm` is live (see `split`); the state is written into a u32 (a C enum is
        // int-sized), so no out-of-range value ever becomes a Rust enum.
        let c = code(unsafe {
            sys::ncclCommGetAsyncError(
                comm_ptr(comm),
                (&mut state as *mut u32).cast::<sys::ncclResult_t>(),
            )
        });
        if c.is_success() {
            NcclCode(state)
        } else {
            c
        }
    }

    fn abort(&self, comm: RawComm) -> NcclCode {
        // SAFETY: `comm` is live and is never used again after this call (the engine marks it
        // torn down under the issue lock).
        code(unsafe { sys::ncclCommAbort(comm_ptr(comm)) })
    }

    fn finalize(&self, comm: RawComm) -> NcclCode {
        // SAFETY: `comm` is live; only destroy (or abort) follows.
        code(unsafe { sys::ncclCommFinalize(comm_ptr(comm)) })
    }

    fn destroy(&self, comm: RawComm) -> NcclCode {
        // SAFETY: `comm` was finalized and is never used again.
        code(unsafe { sys::ncclCommDestroy(comm_ptr(comm)) })
    }

    fn revoke(&self, comm: RawComm) -> NcclCode {
        let Some(p) = self.sym(Optional::Revoke) else {
            return NcclCode::UNAVAILABLE;
        };
        // SAFETY: `p` is the address of `ncclCommRevoke` (looked up by name), whose C signature
        // is `RevokeFn`; `comm` is live; flags must be NCCL_REVOKE_DEFAULT (0).
        let f: RevokeFn = unsafe { std::mem::transmute::<usize, RevokeFn>(p) };
        // SAFETY: see above.
        NcclCode(unsafe { f(comm_ptr(comm), 0) })
    }

    fn count(&self, comm: RawComm) -> Result<i32, NcclCode> {
        let mut n: c_int = 0;
        // SAFETY: `comm` is live; one int is written.
        let c = code(unsafe { sys::ncclCommCount(comm_ptr(comm), &mut n) });
        if c.is_success() {
            Ok(n)
        } else {
            Err(c)
        }
    }

    fn user_rank(&self, comm: RawComm) -> Result<i32, NcclCode> {
        let mut r: c_int = 0;
        // SAFETY: `comm` is live; one int is written.
        let c = code(unsafe { sys::ncclCommUserRank(comm_ptr(comm), &mut r) });
        if c.is_success() {
            Ok(r)
        } else {
            Err(c)
        }
    }

    fn last_error(&self, comm: RawComm) -> String {
        // SAFETY: ncclGetLastError accepts any communicator (NULL included) and returns a
        // NUL-terminated string owned by NCCL, valid until the next NCCL call on this thread;
        // it is copied at once.
        unsafe {
            let p = sys::ncclGetLastError(comm_ptr(comm));
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    fn group_start(&self) -> NcclCode {
        // SAFETY: no arguments; the group state is per thread.
        code(unsafe { sys::ncclGroupStart() })
    }

    fn group_end(&self) -> NcclCode {
        // SAFETY: closes the group this thread opened.
        code(unsafe { sys::ncclGroupEnd() })
    }

    fn enqueue(&self, call: &Call, comm: RawComm, stream: RawStream) -> NcclCode {
        let (c, s) = (comm_ptr(comm), stream_ptr(stream));
        let vp = |p: DevPtr| p as *mut c_void;
        let cp = |p: DevPtr| p as *const c_void;
        // SAFETY (every arm): `comm` is live and the caller holds its issue lock; the addresses
        // are device addresses of buffers holding at least the counts given (the backend
        // computes them from candle storages it keeps alive until the stream has passed this
        // call); `s` is the communicator's stream, alive as long as the communicator.
        unsafe {
            match *call {
                Call::AllReduce {
                    send,
                    recv,
                    count,
                    dt,
                    op,
                } => code(sys::ncclAllReduce(
                    cp(send),
                    vp(recv),
                    count,
                    dtype_sys(dt),
                    op_sys(op),
                    c,
                    s,
                )),
                Call::AllGather {
                    send,
                    recv,
                    count,
                    dt,
                } => code(sys::ncclAllGather(
                    cp(send),
                    vp(recv),
                    count,
                    dtype_sys(dt),
                    c,
                    s,
                )),
                Call::ReduceScatter {
                    send,
                    recv,
                    count,
                    dt,
                    op,
                } => code(sys::ncclReduceScatter(
                    cp(send),
                    vp(recv),
                    count,
                    dtype_sys(dt),
                    op_sys(op),
                    c,
                    s,
                )),
                Call::Broadcast {
                    send,
                    recv,
                    count,
                    dt,
                    root,
                } => code(sys::ncclBroadcast(
                    cp(send),
                    vp(recv),
                    count,
                    dtype_sys(dt),
                    root,
                    c,
                    s,
                )),
                Call::Reduce {
                    send,
                    recv,
                    count,
                    dt,
                    op,
                    root,
                } => code(sys::ncclReduce(
                    cp(send),
                    vp(recv),
                    count,
                    dtype_sys(dt),
                    op_sys(op),
                    root,
                    c,
                    s,
                )),
                Call::Send {
                    buf,
                    count,
                    dt,
                    peer,
                } => code(sys::ncclSend(cp(buf), count, dtype_sys(dt), peer, c, s)),
                Call::Recv {
                    buf,
                    count,
                    dt,
                    peer,
                } => code(sys::ncclRecv(vp(buf), count, dtype_sys(dt), peer, c, s)),
                Call::AllToAll {
                    send,
                    recv,
                    count,
                    dt,
                } => match self.sym(Optional::AllToAll) {
                    Some(p) => {
                        let f = std::mem::transmute::<usize, AllToAllFn>(p);
                        NcclCode(f(cp(send), vp(recv), count, dt as c_uint, c, s))
                    }
                    None => NcclCode::UNAVAILABLE,
                },
                Call::Gather {
                    send,
                    recv,
                    count,
                    dt,
                    root,
                } => match self.sym(Optional::Gather) {
                    Some(p) => {
                        let f = std::mem::transmute::<usize, RootedFn>(p);
                        NcclCode(f(cp(send), vp(recv), count, dt as c_uint, root, c, s))
                    }
                    None => NcclCode::UNAVAILABLE,
                },
                Call::Scatter {
                    send,
                    recv,
                    count,
                    dt,
                    root,
                } => match self.sym(Optional::Scatter) {
                    Some(p) => {
                        let f = std::mem::transmute::<usize, RootedFn>(p);
                        NcclCode(f(cp(send), vp(recv), count, dt as c_uint, root, c, s))
                    }
                    None => NcclCode::UNAVAILABLE,
                },
                Call::PutSignal {
                    buf,
                    count,
                    dt,
                    peer,
                    win,
                    offset,
                } => match self.sym(Optional::PutSignal) {
                    Some(p) => {
                        let f = std::mem::transmute::<usize, PutSignalFn>(p);
                        NcclCode(f(
                            cp(buf),
                            count,
                            dt as c_uint,
                            peer,
                            win.0 as *mut c_void,
                            offset,
                            0,
                            0,
                            0,
                            c,
                            s,
                        ))
                    }
                    None => NcclCode::UNAVAILABLE,
                },
                Call::Signal { peer } => match self.sym(Optional::Signal) {
                    Some(p) => {
                        let f = std::mem::transmute::<usize, SignalFn>(p);
                        NcclCode(f(peer, 0, 0, 0, c, s))
                    }
                    None => NcclCode::UNAVAILABLE,
                },
                Call::WaitSignal { peer, count } => match self.sym(Optional::WaitSignal) {
                    Some(p) => {
                        let f = std::mem::transmute::<usize, WaitSignalFn>(p);
                        let mut desc = WaitSignalDesc {
                            op_cnt: count,
                            peer,
                            sig_idx: 0,
                            ctx: 0,
                        };
                        NcclCode(f(1, &mut desc, c, s))
                    }
                    None => NcclCode::UNAVAILABLE,
                },
            }
        }
    }

    fn mem_alloc(&self, bytes: usize) -> Result<DevPtr, NcclCode> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: ncclMemAlloc writes one pointer; the current device is the one the caller bound.
        let c = code(unsafe { sys::ncclMemAlloc(&mut p, bytes) });
        if c.is_success() && !p.is_null() {
            Ok(p as DevPtr)
        } else if c.is_success() {
            Err(NcclCode::SYSTEM_ERROR)
        } else {
            Err(c)
        }
    }

    fn mem_free(&self, ptr: DevPtr) -> NcclCode {
        // SAFETY: `ptr` came from ncclMemAlloc and is freed once, after its window was
        // deregistered.
        code(unsafe { sys::ncclMemFree(ptr as *mut c_void) })
    }

    fn window_register(
        &self,
        comm: RawComm,
        ptr: DevPtr,
        bytes: usize,
        out: &AtomicUsize,
    ) -> NcclCode {
        let Some(p) = self.sym(Optional::Window) else {
            return NcclCode::UNAVAILABLE;
        };
        // SAFETY: `p` is `ncclCommWindowRegister`, whose C signature is `WinRegisterFn`; `comm`
        // is live; `ptr` is an ncclMemAlloc buffer of `bytes` bytes; `out` is a pointer-sized
        // atomic that outlives the call.
        unsafe {
            let f = std::mem::transmute::<usize, WinRegisterFn>(p);
            NcclCode(f(
                comm_ptr(comm),
                ptr as *mut c_void,
                bytes,
                out.as_ptr().cast::<*mut c_void>(),
                WIN_COLL_SYMMETRIC,
            ))
        }
    }

    fn window_deregister(&self, comm: RawComm, win: RawWindow) -> NcclCode {
        let Some(p) = lookup("ncclCommWindowDeregister") else {
            return NcclCode::UNAVAILABLE;
        };
        // SAFETY: `p` is `ncclCommWindowDeregister` (`WinDeregisterFn`); `comm` is live and
        // `win` a window registered on it, deregistered once.
        unsafe {
            let f = std::mem::transmute::<usize, WinDeregisterFn>(p);
            NcclCode(f(comm_ptr(comm), win.0 as *mut c_void))
        }
    }
}

/// A CUDA event (cudarc's), as the engine sees it.
pub struct CudaEv(pub CudaEvent);

impl Event for CudaEv {
    fn query(&self) -> Result<bool, String> {
        self.0.try_is_complete().map_err(|e| e.to_string())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The streams of one communicator on a candle CUDA device: its own nonblocking stream, and
/// the device's stream as the calling thread sees it (candle's per-thread default stream, or
/// the stream the device was created with).
pub struct CudaStreams {
    /// The candle device (its stream is "the caller's stream").
    pub device: CudaDevice,
    /// The communicator's own stream.
    pub comm: Arc<CudaStream>,
}

impl CudaStreams {
    /// Creates the communicator's stream on `device`.
    ///
    /// # Errors
    ///
    /// A CUDA error, rendered.
    pub fn new(device: &CudaDevice) -> Result<Self, String> {
        let ctx = device.cuda_stream().context().clone();
        if !ctx.is_event_tracking() {
            // A device opened by the runtime skips cudarc's per-buffer events while its
            // context has one stream (`kernels::storage::skip_unused_buffer_events`). With the
            // communicator's stream there are two: buffers made from here on carry the events
            // again, so a buffer whose last handle is dropped on another thread (the watchdog
            // releasing an operation's tensors) is freed after the reads the caller's stream
            // queued on it.
            tracing::debug!("nccl: cudarc buffer events back on for the communicator's stream");
            // SAFETY: cudarc's caveat is that buffers made while tracking was off stay
            // untracked. Those are ordered by this backend as every buffer is: the
            // communicator's stream waits on the caller's (`comm_after_caller`), the caller's
            // waits on the operation's end event, and an operation's tensors are kept alive
            // until that event completes.
            unsafe { ctx.enable_event_tracking() };
        }
        let comm = ctx.new_stream().map_err(|e| e.to_string())?;
        Ok(CudaStreams {
            device: device.clone(),
            comm,
        })
    }
}

impl Streams for CudaStreams {
    fn bind(&self) -> Result<(), String> {
        self.comm
            .context()
            .bind_to_thread()
            .map_err(|e| e.to_string())
    }

    fn comm_stream(&self) -> RawStream {
        RawStream(self.comm.cu_stream() as usize)
    }

    fn comm_after_caller(&self) -> Result<(), String> {
        let caller = self.device.cuda_stream();
        let ev = caller.record_event(None).map_err(|e| e.to_string())?;
        self.comm.wait(&ev).map_err(|e| e.to_string())
    }

    fn record(&self) -> Result<Arc<dyn Event>, String> {
        let ev = self.comm.record_event(None).map_err(|e| e.to_string())?;
        Ok(Arc::new(CudaEv(ev)))
    }

    fn caller_after(&self, event: &dyn Event) -> Result<(), String> {
        let ev = event
            .as_any()
            .downcast_ref::<CudaEv>()
            .ok_or_else(|| "not a CUDA event".to_string())?;
        self.device
            .cuda_stream()
            .wait(&ev.0)
            .map_err(|e| e.to_string())
    }

    fn release_cached_memory(&self) -> Result<(), String> {
        use cudarc::driver::result;
        let stream = self.device.cuda_stream();
        let ctx = stream.context();
        // The caller's frees complete first, so that their blocks count as unused.
        stream.synchronize().map_err(|e| e.to_string())?;
        // SAFETY: `ctx` is the live context of this communicator's device, whose default pool
        // (candle allocates from it with `cuMemAllocAsync`) exists on every device with memory
        // pools (an error otherwise); trimming releases only memory that backs no allocation.
        unsafe {
            let pool =
                result::device::get_default_mem_pool(ctx.cu_device()).map_err(|e| e.to_string())?;
            result::mem_pool::trim_to(pool, 0).map_err(|e| e.to_string())
        }
    }
}

/// The candle CUDA device behind `device`, if it is one.
pub fn cuda_device(device: &Device) -> Option<&CudaDevice> {
    match device {
        Device::Cuda(d) => Some(d),
        _ => None,
    }
}

macro_rules! slice_ptr {
    ($cs:expr, $T:ty, $start:expr, $end:expr, $stream:expr) => {{
        let s = $cs.as_cuda_slice::<$T>().map_err(|e| e.to_string())?;
        if $end > s.len() {
            return Err(format!(
                "layout ends at element {} but the storage holds {}",
                $end,
                s.len()
            ));
        }
        let (p, _sync) = s.device_ptr($stream);
        p + ($start * std::mem::size_of::<$T>()) as u64
    }};
}

/// The device address of the first element of `t`, a contiguous CUDA tensor (the front makes
/// inputs contiguous). The address stays valid while `t` (its storage) is alive.
///
/// # Errors
///
/// A message when `t` is not a contiguous CUDA tensor of a supported dtype.
pub fn dev_ptr(t: &Tensor, stream: &CudaStream) -> Result<DevPtr, String> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| "the tensor is not contiguous".to_string())?;
    let Storage::Cuda(cs) = &*storage else {
        return Err(format!(
            "the nccl backend moves CUDA tensors; got one on {:?}",
            t.device().location()
        ));
    };
    Ok(match t.dtype() {
        DType::F32 => slice_ptr!(cs, f32, start, end, stream),
        DType::F64 => slice_ptr!(cs, f64, start, end, stream),
        DType::BF16 => slice_ptr!(cs, half::bf16, start, end, stream),
        DType::F16 => slice_ptr!(cs, half::f16, start, end, stream),
        DType::I64 => slice_ptr!(cs, i64, start, end, stream),
        DType::U32 => slice_ptr!(cs, u32, start, end, stream),
        DType::U8 => slice_ptr!(cs, u8, start, end, stream),
        other => return Err(format!("dtype {other:?} is not supported")),
    })
}

/// An uninitialised CUDA tensor (allocated on the caller's stream, before the operation's
/// stream waits on it).
///
/// # Errors
///
/// candle's allocation error.
pub fn empty(shape: &Shape, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    // SAFETY: the tensor is written completely by the NCCL operation it is allocated for before
    // anyone can read it: it is only handed out through that operation's Work, whose wait()
    // orders the reader after the operation.
    unsafe { Tensor::empty(shape.clone(), dtype, device) }
}
