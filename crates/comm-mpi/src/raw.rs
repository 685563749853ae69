//! The few raw MPI calls the backend makes, each wrapped once with its safety argument.
//!
//! Everything here runs on the progress thread (the one that initialized MPI). Buffers handed
//! to nonblocking calls are owned by the operation that posted them (a
//! [`Bytes`](candle_dtensor_comm_core::kit::cpu::bytes::Bytes), an `OutBuf`, a boxed slice) and outlive the request: an
//! operation whose requests are still live when it fails is kept as a zombie until they
//! complete.

use std::ffi::{c_int, c_void};

use mpi::ffi;

/// An MPI communicator handle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RawComm(pub(crate) ffi::MPI_Comm);

// SAFETY: an MPI handle is an opaque pointer-sized value owned by the MPI library; moving it
// between threads moves no data. Calls on it are made by the progress thread only.
unsafe impl Send for RawComm {}

/// An MPI request handle.
#[derive(Debug)]
pub(crate) struct RawRequest(pub(crate) ffi::MPI_Request);

// SAFETY: as for `RawComm`: an opaque handle, tested and freed by the progress thread only.
unsafe impl Send for RawRequest {}

impl RawRequest {
    /// The null request (already complete).
    pub(crate) fn null() -> RawRequest {
        // SAFETY: reads a constant initialized by the rsmpi C shim at load time.
        RawRequest(unsafe { ffi::RSMPI_REQUEST_NULL })
    }

    pub(crate) fn is_null(&self) -> bool {
        // SAFETY: as in `null`.
        self.0 == unsafe { ffi::RSMPI_REQUEST_NULL }
    }
}

/// An MPI error: the failing call and the library's message.
#[derive(Debug, Clone)]
pub(crate) struct MpiError {
    pub(crate) call: &'static str,
    pub(crate) code: c_int,
    pub(crate) text: String,
}

impl std::fmt::Display for MpiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed (MPI error {}: {})",
            self.call, self.code, self.text
        )
    }
}

pub(crate) type MpiResult<T> = std::result::Result<T, MpiError>;

/// The library's text for an error code.
pub(crate) fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes and more;
    // MPI writes at most that many and sets `len`.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != 0 || len <= 0 {
        return format!("error code {code}");
    }
    buf.truncate(len as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

fn check(call: &'static str, code: c_int) -> MpiResult<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(MpiError {
            call,
            code,
            text: error_string(code),
        })
    }
}

/// The MPI datatype used to move elements of `size` bytes (data moves as unsigned integers
/// of the element's width: no conversion, every bit pattern preserved).
pub(crate) fn element_type(size: usize) -> ffi::MPI_Datatype {
    // SAFETY: reads constants initialized by the rsmpi C shim at load time.
    unsafe {
        match size {
            2 => ffi::RSMPI_UINT16_T,
            4 => ffi::RSMPI_UINT32_T,
            8 => ffi::RSMPI_UINT64_T,
            _ => ffi::RSMPI_UINT8_T,
        }
    }
}

/// A stand-in for empty buffers: Rust gives zero-length allocations tiny dangling addresses
/// (the element's alignment), and Open MPI reads `(void *)1` as `MPI_IN_PLACE`. MPI never
/// touches a buffer of count 0, so any valid address will do.
static EMPTY: [u64; 1] = [0];

fn c_ptr(p: *const c_void) -> *const c_void {
    if (p as usize) < 4096 {
        EMPTY.as_ptr().cast()
    } else {
        p
    }
}

fn m_ptr(p: *mut c_void) -> *mut c_void {
    // Never written through: only buffers of count 0 have such addresses.
    c_ptr(p) as *mut c_void
}

/// `MPI_COMM_WORLD`.
pub(crate) fn comm_world() -> RawComm {
    // SAFETY: reads a constant initialized by the rsmpi C shim at load time.
    RawComm(unsafe { ffi::RSMPI_COMM_WORLD })
}

/// `MPI_COMM_NULL`.
pub(crate) fn comm_null() -> RawComm {
    // SAFETY: as in `comm_world`.
    RawComm(unsafe { ffi::RSMPI_COMM_NULL })
}

/// `MPI_UNDEFINED` (the color of a rank that opts out of a split).
pub(crate) fn undefined() -> c_int {
    // SAFETY: as in `comm_world`.
    unsafe { ffi::RSMPI_UNDEFINED }
}

/// `(rank, size)` of `comm`.
pub(crate) fn rank_size(comm: RawComm) -> MpiResult<(usize, usize)> {
    let (mut r, mut s): (c_int, c_int) = (0, 0);
    // SAFETY: `comm` is a valid communicator; the out-pointers are live locals.
    check("MPI_Comm_rank", unsafe {
        ffi::MPI_Comm_rank(comm.0, &mut r)
    })?;
    // SAFETY: as above.
    check("MPI_Comm_size", unsafe {
        ffi::MPI_Comm_size(comm.0, &mut s)
    })?;
    Ok((r.max(0) as usize, s.max(0) as usize))
}

/// Makes errors on `comm` return codes instead of aborting the job (the default handler), so
/// they become typed errors.
pub(crate) fn set_errors_return(comm: RawComm) -> MpiResult<()> {
    // SAFETY: `comm` is a valid communicator; MPI_ERRORS_RETURN is a predefined handler.
    check("MPI_Comm_set_errhandler", unsafe {
        ffi::MPI_Comm_set_errhandler(comm.0, ffi::RSMPI_ERRORS_RETURN)
    })
}

/// Starts `MPI_Comm_idup(comm)`. The new handle is written to `*out` when the request
/// completes, so `out` must stay in place (boxed) until then.
pub(crate) fn comm_idup(comm: RawComm, out: &mut Box<RawComm>) -> MpiResult<RawRequest> {
    let out: *mut ffi::MPI_Comm = &mut out.0;
    // SAFETY: `comm` is valid; `out` points into a box the caller keeps alive (and unmoved on
    // the heap) until the request completes; `req` is a live local of `start`.
    start("MPI_Comm_idup", |req| unsafe {
        ffi::MPI_Comm_idup(comm.0, out, req)
    })
}

/// `MPI_Comm_split` (blocking; collective over `comm`).
pub(crate) fn comm_split(comm: RawComm, color: c_int, key: c_int) -> MpiResult<RawComm> {
    let mut out = comm_null();
    // SAFETY: `comm` is valid; `out` is a live local the call writes.
    check("MPI_Comm_split", unsafe {
        ffi::MPI_Comm_split(comm.0, color, key, &mut out.0)
    })?;
    Ok(out)
}

/// `MPI_Abort(MPI_COMM_WORLD, code)`: ends every process of the job.
pub(crate) fn abort_world(code: c_int) {
    // SAFETY: MPI is initialized; MPI_Abort does not return on success.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
}

/// Tests `req`; `Ok(Some(status))` once it completed (the request is then null). A null
/// request counts as complete.
pub(crate) fn test(req: &mut RawRequest) -> MpiResult<Option<ffi::MPI_Status>> {
    if req.is_null() {
        // SAFETY: an all-zero MPI_Status is a valid plain C struct.
        return Ok(Some(unsafe { std::mem::zeroed() }));
    }
    let mut flag: c_int = 0;
    // SAFETY: zeroed memory is a valid MPI_Status; MPI overwrites it on completion.
    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    // SAFETY: `req` is a live request of ours; `flag` and `status` are live locals.
    check("MPI_Test", unsafe {
        ffi::MPI_Test(&mut req.0, &mut flag, &mut status)
    })?;
    Ok((flag != 0).then_some(status))
}

/// The number of elements of `dtype` a completed receive got.
pub(crate) fn received_count(status: &ffi::MPI_Status, dtype: ffi::MPI_Datatype) -> usize {
    let mut n: c_int = 0;
    // SAFETY: `status` comes from a completed receive; `n` is a live local.
    let rc = unsafe { ffi::MPI_Get_count(status, dtype, &mut n) };
    if rc != 0 || n < 0 {
        0
    } else {
        n as usize
    }
}

/// Asks MPI to cancel a pending receive. The request stays live until a test reports it
/// complete (cancelled, or matched after all): its buffer must outlive that, so callers keep
/// testing it (as a zombie or a detached entry) before dropping the buffer.
pub(crate) fn cancel(req: &mut RawRequest) {
    if req.is_null() {
        return;
    }
    // SAFETY: `req` is a live request of ours; cancelling a receive is always allowed and
    // does not complete or free the request.
    unsafe {
        ffi::MPI_Cancel(&mut req.0);
    }
}

/// Runs a nonblocking MPI call that starts a request: `call` gets the address of a fresh
/// request handle, returns the call's error code, and holds the `unsafe` FFI call itself (with
/// its own safety argument).
fn start(
    name: &'static str,
    call: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
) -> MpiResult<RawRequest> {
    let mut req = RawRequest::null();
    check(name, call(&mut req.0))?;
    Ok(req)
}

/// A nonblocking send of `count` elements of `dtype` at `buf` to `dest`.
///
/// # Safety
///
/// `buf` must be valid for reads of `count` elements of `dtype` until the request completes,
/// and not written meanwhile.
pub(crate) unsafe fn isend(
    buf: *const c_void,
    count: c_int,
    dtype: ffi::MPI_Datatype,
    dest: usize,
    tag: c_int,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let dest = dest as c_int;
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start("MPI_Isend", |req| unsafe {
        ffi::MPI_Isend(c_ptr(buf), count, dtype, dest, tag, comm.0, req)
    })
}

/// A nonblocking receive of up to `count` elements of `dtype` into `buf` from `src`.
///
/// # Safety
///
/// `buf` must be valid for writes of `count` elements of `dtype` until the request completes,
/// and not accessed otherwise meanwhile.
pub(crate) unsafe fn irecv(
    buf: *mut c_void,
    count: c_int,
    dtype: ffi::MPI_Datatype,
    src: c_int,
    tag: c_int,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start("MPI_Irecv", |req| unsafe {
        ffi::MPI_Irecv(m_ptr(buf), count, dtype, src, tag, comm.0, req)
    })
}

/// `MPI_ANY_SOURCE`.
pub(crate) fn any_source() -> c_int {
    // SAFETY: reads a constant initialized by the rsmpi C shim at load time.
    unsafe { ffi::RSMPI_ANY_SOURCE }
}

/// The signature MPI's nonblocking collectives of `count` elements per rank share
/// (`MPI_Iallgather`, `MPI_Ialltoall`): send buffer, count, type; receive buffer, count, type;
/// communicator; request.
type UniformCollective = unsafe extern "C" fn(
    *const c_void,
    c_int,
    ffi::MPI_Datatype,
    *mut c_void,
    c_int,
    ffi::MPI_Datatype,
    ffi::MPI_Comm,
    *mut ffi::MPI_Request,
) -> c_int;

/// Starts `call` with `count` elements per rank sent from `send` and received into `recv`.
///
/// # Safety
///
/// The buffers satisfy `call`'s contract (see its two callers) until the request completes.
unsafe fn uniform(
    (name, call): (&'static str, UniformCollective),
    send: *const c_void,
    recv: *mut c_void,
    count: c_int,
    dtype: ffi::MPI_Datatype,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let (send, recv) = (c_ptr(send), m_ptr(recv));
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start(name, |req| unsafe {
        call(send, count, dtype, recv, count, dtype, comm.0, req)
    })
}

/// `MPI_Iallgather`.
///
/// # Safety
///
/// `send` holds `count` elements and `recv` room for `count * size` elements of `dtype`; both
/// stay valid (and `recv` untouched) until the request completes.
pub(crate) unsafe fn iallgather(
    send: *const c_void,
    count: c_int,
    recv: *mut c_void,
    dtype: ffi::MPI_Datatype,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let call = ("MPI_Iallgather", ffi::MPI_Iallgather as UniformCollective);
    // SAFETY: the contract above is `MPI_Iallgather`'s.
    unsafe { uniform(call, send, recv, count, dtype, comm) }
}

/// `MPI_Ialltoall` with `count` elements per peer.
///
/// # Safety
///
/// `send` and `recv` each hold `count * size` elements of `dtype` and stay valid (`recv`
/// untouched) until the request completes.
pub(crate) unsafe fn ialltoall(
    send: *const c_void,
    recv: *mut c_void,
    count: c_int,
    dtype: ffi::MPI_Datatype,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let call = ("MPI_Ialltoall", ffi::MPI_Ialltoall as UniformCollective);
    // SAFETY: the contract above is `MPI_Ialltoall`'s.
    unsafe { uniform(call, send, recv, count, dtype, comm) }
}

/// `MPI_Iallgatherv`.
///
/// # Safety
///
/// `send` holds `count` elements; `recv` has room for every `displs[j] + counts[j]`; `counts`
/// and `displs` have one entry per rank; all four stay valid and unmoved until the request
/// completes.
pub(crate) unsafe fn iallgatherv(
    send: *const c_void,
    count: c_int,
    recv: *mut c_void,
    counts: &[c_int],
    displs: &[c_int],
    dtype: ffi::MPI_Datatype,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let (send, recv, counts, displs) = (c_ptr(send), m_ptr(recv), counts.as_ptr(), displs.as_ptr());
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start("MPI_Iallgatherv", |req| unsafe {
        ffi::MPI_Iallgatherv(send, count, dtype, recv, counts, displs, dtype, comm.0, req)
    })
}

/// The four count/displacement arrays of an `MPI_Ialltoallv`.
pub(crate) struct VCounts {
    pub(crate) send_counts: Vec<c_int>,
    pub(crate) send_displs: Vec<c_int>,
    pub(crate) recv_counts: Vec<c_int>,
    pub(crate) recv_displs: Vec<c_int>,
}

/// `MPI_Ialltoallv`.
///
/// # Safety
///
/// `send`/`recv` cover every displacement + count of `v` (in elements of `dtype`); `send`,
/// `recv` and `v` stay valid and unmoved (`recv` untouched) until the request completes.
pub(crate) unsafe fn ialltoallv(
    send: *const c_void,
    recv: *mut c_void,
    v: &VCounts,
    dtype: ffi::MPI_Datatype,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let (send, recv) = (c_ptr(send), m_ptr(recv));
    let (sc, sd) = (v.send_counts.as_ptr(), v.send_displs.as_ptr());
    let (rc, rd) = (v.recv_counts.as_ptr(), v.recv_displs.as_ptr());
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start("MPI_Ialltoallv", |req| unsafe {
        ffi::MPI_Ialltoallv(send, sc, sd, dtype, recv, rc, rd, dtype, comm.0, req)
    })
}

/// `MPI_Ibcast` of `count` elements from `root`.
///
/// # Safety
///
/// `buf` holds `count` elements of `dtype` (read on the root, written elsewhere) and stays
/// valid, untouched, until the request completes.
pub(crate) unsafe fn ibcast(
    buf: *mut c_void,
    count: c_int,
    dtype: ffi::MPI_Datatype,
    root: usize,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let root = root as c_int;
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start("MPI_Ibcast", |req| unsafe {
        ffi::MPI_Ibcast(m_ptr(buf), count, dtype, root, comm.0, req)
    })
}

/// `MPI_Igatherv` to `root`; `v` holds the root's receive counts and displacements.
///
/// # Safety
///
/// `send` holds `count` elements; on the root `recv` and `v` describe room for every rank's
/// piece (they are ignored elsewhere); everything stays valid and unmoved until the request
/// completes.
pub(crate) unsafe fn igatherv(
    send: *const c_void,
    count: c_int,
    recv: *mut c_void,
    v: &(Vec<c_int>, Vec<c_int>),
    dtype: ffi::MPI_Datatype,
    root: usize,
    comm: RawComm,
) -> MpiResult<RawRequest> {
    let (send, recv, counts, displs) = (c_ptr(send), m_ptr(recv), v.0.as_ptr(), v.1.as_ptr());
    let root = root as c_int;
    // SAFETY: per the function contract; `req` is a live local of `start`.
    start("MPI_Igatherv", |req| unsafe {
        ffi::MPI_Igatherv(
            send, count, dtype, recv, counts, displs, dtype, root, comm.0, req,
        )
    })
}

/// The thread support level names, lowest first.
pub(crate) const THREAD_LEVELS: [&str; 4] = [
    "MPI_THREAD_SINGLE",
    "MPI_THREAD_FUNNELED",
    "MPI_THREAD_SERIALIZED",
    "MPI_THREAD_MULTIPLE",
];

/// The library's name and version (`MPI_Get_library_version`, up to the first comma).
pub(crate) fn library_version() -> String {
    mpi::environment::library_version()
        .map(|s| {
            // "Open MPI v4.1.4, package: Debian OpenMPI, ..." -> "Open MPI v4.1.4".
            let s = s.trim_matches(char::from(0));
            let first = s.lines().next().unwrap_or("");
            first.split(',').next().unwrap_or("").trim().to_string()
        })
        .unwrap_or_else(|_| "unknown MPI library".to_string())
}
