//! The operations of the `mpi` backend, as [`Body`]s the engine drives.
//!
//! Data moves as unsigned integers of the element's width (no conversion). Reductions never
//! use MPI's reduction ops: the ranks exchange the pieces they reduce (an all-gather for small
//! inputs, an all-to-all of chunks for large ones) and reduce them with the local backend's
//! kernels, in rank order, accumulating half-precision types in `f32` and rounding once. So
//! every dtype and op is supported, and every rank gets the same bits as the local backend.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};

use super::engine::{
    Body, CommShared, Cx, Fail, Reqs, Step, TAG_P2P_DATA, TAG_P2P_HDR, TAG_SCATTER_DATA,
    TAG_SCATTER_HDR,
};
use super::framing::{self, Desc, MAX_DIMS};
use super::raw::{self, MpiResult, RawComm, VCounts};
use candle_dtensor_comm_core::kit::cpu::bytes::Bytes;
use candle_dtensor_comm_core::kit::cpu::kernels::{read_view, reduce_into, OutBuf};
use candle_dtensor_comm_core::kit::cpu::{deliver, produce, put_bytes, EAGER_BYTES};
use candle_dtensor_comm_core::kit::desc::{
    check_recv, check_split_lists, check_split_sizes, Failure, OpDesc, ShapeRule, DESC_HEADER_WORDS,
};
use candle_dtensor_comm_core::Backend;
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, OpName, ReduceOp};

/// A copy of a caller's tensor, owned by the op (the caller may drop or change its tensor as
/// soon as the op is issued; MPI reads this copy).
pub(crate) struct Input {
    pub(crate) buf: Bytes,
    pub(crate) dtype: DType,
    pub(crate) dims: Vec<usize>,
}

impl Input {
    /// Copies `t` (contiguous, on the CPU: the front made it so).
    pub(crate) fn of(ctx: &OpCtx, t: &Tensor) -> Result<Input> {
        if t.rank() > MAX_DIMS {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "the mpi backend moves tensors of at most {MAX_DIMS} dims; got {:?}",
                    t.dims()
                ),
            ));
        }
        if t.elem_count() > c_int::MAX as usize {
            return Err(CommError::invalid(
                ctx,
                format!(
                    "the mpi backend moves at most {} elements per call; got {}",
                    c_int::MAX,
                    t.elem_count()
                ),
            ));
        }
        let view = read_view(t).map_err(|e| CommError::invalid(ctx, e))?;
        Ok(Input {
            buf: Bytes::copy_of(view.bytes()),
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
        })
    }

    fn elems(&self) -> usize {
        self.buf.len() / self.dtype.size_in_bytes()
    }

    fn mpi_type(&self) -> mpi::ffi::MPI_Datatype {
        raw::element_type(self.dtype.size_in_bytes())
    }

    fn desc(&self, uid: u64, coll: u64, op: OpName) -> Desc {
        Desc::new(uid, coll, OpDesc::of(op, self.dtype, &self.dims))
    }
}

fn op_err(ctx: &OpCtx, msg: impl Into<String>) -> Fail {
    Fail::Op(CommError::invalid(ctx, msg))
}

/// `n` as an MPI count.
fn count(ctx: &OpCtx, n: usize) -> std::result::Result<c_int, Fail> {
    c_int::try_from(n).map_err(|_| {
        op_err(
            ctx,
            format!(
                "the mpi backend moves at most {} elements per peer; got {n}",
                c_int::MAX
            ),
        )
    })
}

/// Counts and the displacements of their prefix sums.
fn counts_displs(ctx: &OpCtx, v: &[usize]) -> std::result::Result<(Vec<c_int>, Vec<c_int>), Fail> {
    let counts = v
        .iter()
        .map(|&x| count(ctx, x))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut displs = Vec::with_capacity(v.len());
    let mut at = 0usize;
    for &x in v {
        displs.push(count(ctx, at)?);
        at += x;
    }
    Ok((counts, displs))
}

fn out_buf(ctx: &OpCtx, dtype: DType, elems: usize) -> std::result::Result<OutBuf, Fail> {
    OutBuf::new(dtype, elems).map_err(|e| op_err(ctx, e))
}

/// Where a result is written: a buffer that becomes the result tensor without a copy, or,
/// for the `*_into` variants, pooled scratch memory copied into the caller's tensor at the end
/// (MPI never writes into candle storage: it may be read meanwhile).
pub(crate) enum OutMem {
    Tensor(OutBuf),
    Scratch(Bytes, DType),
}

impl OutMem {
    /// Memory for `elems` elements of `dtype`; scratch when the result goes `into` a tensor.
    fn new(
        ctx: &OpCtx,
        dtype: DType,
        elems: usize,
        into: bool,
    ) -> std::result::Result<OutMem, Fail> {
        Ok(if into {
            OutMem::Scratch(Bytes::scratch(elems * dtype.size_in_bytes()), dtype)
        } else {
            OutMem::Tensor(out_buf(ctx, dtype, elems)?)
        })
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            OutMem::Tensor(o) => o.ptr(),
            OutMem::Scratch(b, _) => b.mut_ptr().cast(),
        }
    }
}

impl From<OutBuf> for OutMem {
    fn from(o: OutBuf) -> Self {
        OutMem::Tensor(o)
    }
}

/// The finished output: a new tensor of `dims` over `out`, or `out` copied into the caller's
/// `into` tensor (which is returned).
fn output(
    ctx: &OpCtx,
    out: impl Into<OutMem>,
    dims: &[usize],
    into: Option<Tensor>,
) -> std::result::Result<Tensor, Fail> {
    let shape = Shape::from_dims(dims);
    let elems = shape.elem_count();
    match (out.into(), into) {
        // SAFETY: every op calls this only after MPI (or a reduction) wrote all of `o`.
        (OutMem::Tensor(o), into) => unsafe { deliver(ctx, o, shape, into) },
        (OutMem::Scratch(b, dtype), Some(t)) => produce(ctx, Some(t), dtype, shape, |dst| {
            if b.len() != elems * dtype.size_in_bytes() {
                return Err(CommError::invalid(
                    ctx,
                    "a scratch result of the wrong size",
                ));
            }
            // SAFETY: `produce` checked that `dst` holds the result's bytes, as many as `b`,
            // which MPI (or a reduction) wrote.
            unsafe { put_bytes(dst, 0, b.bytes()) };
            Ok(())
        }),
        (OutMem::Scratch(..), None) => Err(CommError::invalid(
            ctx,
            "internal: a scratch result without a target",
        )),
    }
    .map_err(Fail::Op)
}

/// Reduces `n` equal pieces of `src` (in rank order) into `dst`.
///
/// `src` holds `n * piece` elements of `dtype`, piece-aligned; `dst` has room for `piece`.
fn reduce_pieces(dtype: DType, op: ReduceOp, src: &[u8], n: usize, dst: *mut u8) {
    let piece = src.len() / n.max(1);
    let srcs: Vec<&[u8]> = (0..n).map(|r| &src[r * piece..(r + 1) * piece]).collect();
    // SAFETY: callers pass a `dst` valid for `piece` bytes that nothing else accesses, and
    // `src` comes from an 8-byte aligned `Bytes`, cut at multiples of the element size.
    unsafe { reduce_into(dtype, op, &srcs, dst, n) };
}

/// The chunk of `elems` rank `r` reduces in the large path (the local backend's split).
fn chunk_range(elems: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    let chunk = elems.div_ceil(n.max(1));
    (r * chunk).min(elems)..((r + 1) * chunk).min(elems)
}

/// The all-to-all that gives this rank its chunk of every rank's input (the reduce-scatter
/// half of a large reduction).
fn post_chunk_exchange(
    cx: &Cx,
    x: &Input,
    reqs: &mut Reqs,
) -> std::result::Result<(Bytes, Box<VCounts>), Fail> {
    let (n, me, es) = (cx.size, cx.rank, x.dtype.size_in_bytes());
    let ranges: Vec<_> = (0..n).map(|r| chunk_range(x.elems(), n, r)).collect();
    let mine = ranges[me].len();
    let (send_counts, send_displs) =
        counts_displs(cx.ctx, &ranges.iter().map(|r| r.len()).collect::<Vec<_>>())?;
    let (recv_counts, recv_displs) = counts_displs(cx.ctx, &vec![mine; n])?;
    let v = Box::new(VCounts {
        send_counts,
        send_displs,
        recv_counts,
        recv_displs,
    });
    let mut recv = Bytes::scratch(n * mine * es);
    // SAFETY: `x.buf` covers every send range, `recv` holds n * mine elements; the body owns
    // both and the boxed counts until the request completes (or keeps them as a zombie).
    let req = unsafe { raw::ialltoallv(x.buf.ptr(), recv.mut_ptr(), &v, x.mpi_type(), cx.comm) }?;
    reqs.push(req);
    Ok((recv, v))
}

// ---------------------------------------------------------------------------------------------
// all_reduce and reduce
// ---------------------------------------------------------------------------------------------

/// all_reduce (`root: None`) and reduce to `root`. Small all_reduce inputs are all-gathered and
/// reduced whole on every rank; otherwise every rank reduces its chunk of every input (an
/// all-to-all of chunks), and the reduced chunks are all-gathered (all_reduce) or gathered to
/// the root (reduce).
struct Reduction {
    x: Input,
    op: ReduceOp,
    root: Option<usize>,
    into: Option<Tensor>,
    stage: u8,
    recv: Option<Bytes>,
    /// The counts MPI reads while the all-to-all runs.
    _v: Option<Box<VCounts>>,
    /// This rank's reduced chunk, which MPI reads while the gather runs.
    _mine: Option<Bytes>,
    out: Option<OutMem>,
    gather: (Vec<c_int>, Vec<c_int>),
}

impl Reduction {
    fn new(x: Input, op: ReduceOp, root: Option<usize>, into: Option<Tensor>) -> Self {
        Reduction {
            x,
            op,
            root,
            into,
            stage: 0,
            recv: None,
            _v: None,
            _mine: None,
            out: None,
            gather: (Vec::new(), Vec::new()),
        }
    }

    fn desc(&self, uid: u64, coll: u64) -> Desc {
        let op = match self.root {
            Some(_) => OpName::Reduce,
            None => OpName::AllReduce,
        };
        let mut d = self.x.desc(uid, coll, op);
        d.what.root = self.root;
        d.what.reduce = Some(self.op);
        d
    }

    /// The result in `out`, shaped as the input (into the caller's output if it gave one).
    fn finish(&mut self, cx: &Cx, out: OutMem) -> std::result::Result<Tensor, Fail> {
        output(cx.ctx, out, &self.x.dims, self.into.take())
    }

    /// The receive buffer posted by the previous stage.
    fn take_recv(&mut self, cx: &Cx) -> std::result::Result<Bytes, Fail> {
        self.recv
            .take()
            .ok_or_else(|| op_err(cx.ctx, "lost buffer"))
    }

    /// The [`Body::step`] of both ops: `Some(result)` once done, where the result is `None` on
    /// the ranks of a reduce that are not its root.
    fn step(&mut self, cx: &mut Cx, reqs: &mut Reqs) -> Step<Option<Tensor>> {
        let (n, dtype, elems) = (cx.size, self.x.dtype, self.x.elems());
        match self.stage {
            0 if n == 1 => {
                let mut out = OutMem::new(cx.ctx, dtype, elems, self.into.is_some())?;
                reduce_pieces(dtype, self.op, self.x.buf.bytes(), 1, out.ptr());
                Ok(Some(Some(self.finish(cx, out)?)))
            }
            0 if self.root.is_none() && self.x.buf.len() <= EAGER_BYTES => {
                let mut recv = Bytes::scratch(n * self.x.buf.len());
                let c = count(cx.ctx, elems)?;
                // SAFETY: `x.buf` holds `elems` elements and `recv` n times that; both are
                // owned by this body until the request completes.
                let req = unsafe {
                    raw::iallgather(
                        self.x.buf.ptr(),
                        c,
                        recv.mut_ptr(),
                        self.x.mpi_type(),
                        cx.comm,
                    )
                }?;
                reqs.push(req);
                self.recv = Some(recv);
                self.stage = 1;
                Ok(None)
            }
            0 => {
                let (recv, v) = post_chunk_exchange(cx, &self.x, reqs)?;
                self.recv = Some(recv);
                self._v = Some(v);
                self.stage = 2;
                Ok(None)
            }
            1 => {
                let recv = self.take_recv(cx)?;
                let mut out = OutMem::new(cx.ctx, dtype, elems, self.into.is_some())?;
                reduce_pieces(dtype, self.op, recv.bytes(), n, out.ptr());
                Ok(Some(Some(self.finish(cx, out)?)))
            }
            2 => {
                let recv = self.take_recv(cx)?;
                let ranges: Vec<_> = (0..n).map(|r| chunk_range(elems, n, r)).collect();
                let mut mine = Bytes::scratch(ranges[cx.rank].len() * dtype.size_in_bytes());
                reduce_pieces(dtype, self.op, recv.bytes(), n, mine.mut_ptr().cast());
                self.gather =
                    counts_displs(cx.ctx, &ranges.iter().map(|r| r.len()).collect::<Vec<_>>())?;
                let c = count(cx.ctx, ranges[cx.rank].len())?;
                // Only the ranks that get the result have an output (all of them, or the root).
                if self.root.is_none_or(|r| r == cx.rank) {
                    self.out = Some(OutMem::new(cx.ctx, dtype, elems, self.into.is_some())?);
                }
                let recv_ptr = self
                    .out
                    .as_mut()
                    .map_or(std::ptr::null_mut(), |o| o.ptr().cast());
                // SAFETY: `mine` holds this rank's chunk; `out` (where there is one) has room for
                // every chunk at its displacement (elsewhere a gather ignores the receive
                // arguments); the body owns all of them and the count arrays until completion.
                let req = unsafe {
                    match self.root {
                        None => raw::iallgatherv(
                            mine.ptr(),
                            c,
                            recv_ptr,
                            &self.gather.0,
                            &self.gather.1,
                            self.x.mpi_type(),
                            cx.comm,
                        ),
                        Some(root) => raw::igatherv(
                            mine.ptr(),
                            c,
                            recv_ptr,
                            &self.gather,
                            self.x.mpi_type(),
                            root,
                            cx.comm,
                        ),
                    }
                }?;
                reqs.push(req);
                self._mine = Some(mine);
                self.stage = 3;
                Ok(None)
            }
            _ => match self.out.take() {
                Some(out) => Ok(Some(Some(self.finish(cx, out)?))),
                None => Ok(Some(None)),
            },
        }
    }
}

pub(crate) struct AllReduce(Reduction);

impl AllReduce {
    pub(crate) fn new(x: Input, op: ReduceOp, into: Option<Tensor>) -> Self {
        AllReduce(Reduction::new(x, op, None, into))
    }
}

impl Body for AllReduce {
    type Out = Tensor;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        Some(self.0.desc(uid, coll))
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Tensor> {
        match self.0.step(cx, reqs)? {
            Some(None) => Err(op_err(cx.ctx, "lost buffer")),
            done => Ok(done.flatten()),
        }
    }
}

pub(crate) struct Reduce(Reduction);

impl Reduce {
    pub(crate) fn new(x: Input, root: usize, op: ReduceOp) -> Self {
        Reduce(Reduction::new(x, op, Some(root), None))
    }
}

impl Body for Reduce {
    type Out = Option<Tensor>;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        Some(self.0.desc(uid, coll))
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Option<Tensor>> {
        self.0.step(cx, reqs)
    }
}

// ---------------------------------------------------------------------------------------------
// reduce_scatter_single, all_gather_single, all_to_all_single, all_to_all_v_single
// ---------------------------------------------------------------------------------------------

pub(crate) struct ReduceScatter {
    x: Input,
    op: ReduceOp,
    into: Option<Tensor>,
    recv: Option<Bytes>,
}

impl ReduceScatter {
    pub(crate) fn new(x: Input, op: ReduceOp, into: Option<Tensor>) -> Self {
        ReduceScatter {
            x,
            op,
            into,
            recv: None,
        }
    }
}

impl Body for ReduceScatter {
    type Out = Tensor;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let mut d = self.x.desc(uid, coll, OpName::ReduceScatterSingle);
        d.what.reduce = Some(self.op);
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Tensor> {
        let (n, dtype) = (cx.size, self.x.dtype);
        let chunk = self.x.elems() / n;
        let mut dims = self.x.dims.clone();
        if let Some(d0) = dims.first_mut() {
            *d0 /= n;
        }
        match self.recv.take() {
            None if n > 1 => {
                let mut recv = Bytes::scratch(self.x.buf.len());
                let c = count(cx.ctx, chunk)?;
                // SAFETY: both buffers hold n * chunk elements and are owned by this body
                // until the request completes.
                let req = unsafe {
                    raw::ialltoall(
                        self.x.buf.ptr(),
                        recv.mut_ptr(),
                        c,
                        self.x.mpi_type(),
                        cx.comm,
                    )
                }?;
                reqs.push(req);
                self.recv = Some(recv);
                Ok(None)
            }
            recv => {
                let src = recv.as_ref().unwrap_or(&self.x.buf);
                let mut out = OutMem::new(cx.ctx, dtype, chunk, self.into.is_some())?;
                reduce_pieces(dtype, self.op, src.bytes(), n, out.ptr());
                Ok(Some(output(cx.ctx, out, &dims, self.into.take())?))
            }
        }
    }
}

/// all_gather_single (`gather: true`) and all_to_all_single: one MPI collective into a fresh
/// buffer.
pub(crate) struct Exchange1 {
    x: Input,
    into: Option<Tensor>,
    gather: bool,
    out: Option<OutMem>,
}

impl Exchange1 {
    pub(crate) fn all_gather(x: Input, into: Option<Tensor>) -> Self {
        Exchange1 {
            x,
            into,
            gather: true,
            out: None,
        }
    }

    pub(crate) fn all_to_all(x: Input, into: Option<Tensor>) -> Self {
        Exchange1 {
            x,
            into,
            gather: false,
            out: None,
        }
    }
}

impl Body for Exchange1 {
    type Out = Tensor;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let op = if self.gather {
            OpName::AllGatherSingle
        } else {
            OpName::AllToAllSingle
        };
        Some(self.x.desc(uid, coll, op))
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Tensor> {
        let (n, elems) = (cx.size, self.x.elems());
        match self.out.take() {
            None => {
                let out_elems = if self.gather { n * elems } else { elems };
                let mut out = OutMem::new(cx.ctx, self.x.dtype, out_elems, self.into.is_some())?;
                let (send, recv, t) = (
                    self.x.buf.ptr(),
                    out.ptr().cast::<c_void>(),
                    self.x.mpi_type(),
                );
                // SAFETY: `x.buf` holds `elems` elements, `out` the gathered (n * elems) or
                // exchanged (elems) result; both stay owned by this body until completion.
                let req = unsafe {
                    if self.gather {
                        raw::iallgather(send, count(cx.ctx, elems)?, recv, t, cx.comm)
                    } else {
                        raw::ialltoall(send, recv, count(cx.ctx, elems / n)?, t, cx.comm)
                    }
                }?;
                reqs.push(req);
                self.out = Some(out);
                Ok(None)
            }
            Some(out) => {
                let mut dims = self.x.dims.clone();
                if self.gather {
                    match dims.first_mut() {
                        Some(d0) => *d0 *= n,
                        None => dims.push(n),
                    }
                }
                Ok(Some(output(cx.ctx, out, &dims, self.into.take())?))
            }
        }
    }
}

pub(crate) struct AllToAllV {
    x: Input,
    out_splits: Vec<usize>,
    in_splits: Vec<usize>,
    /// The counts MPI reads while the all-to-all runs.
    _v: Option<Box<VCounts>>,
    out: Option<OutBuf>,
}

impl AllToAllV {
    pub(crate) fn new(x: Input, out_splits: Vec<usize>, in_splits: Vec<usize>) -> Self {
        AllToAllV {
            x,
            out_splits,
            in_splits,
            _v: None,
            out: None,
        }
    }
}

impl Body for AllToAllV {
    type Out = Tensor;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let mut d = self.x.desc(uid, coll, OpName::AllToAllVSingle);
        d.what.rule = ShapeRule::Rows;
        d.extra = self
            .out_splits
            .iter()
            .chain(&self.in_splits)
            .map(|&s| s as u64)
            .collect();
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, descs: &[Desc], reqs: &mut Reqs) -> Step<Tensor> {
        let n = cx.size;
        let row: usize = self.x.dims.iter().skip(1).product();
        let total: usize = self.out_splits.iter().sum();
        if let Some(out) = self.out.take() {
            let mut dims = vec![total];
            dims.extend(self.x.dims.iter().skip(1));
            return Ok(Some(output(cx.ctx, out, &dims, None)?));
        }
        // Every rank checks every (sender, receiver) pair, so all reach the same verdict
        // before any data moves.
        let split = |r: usize, i: usize| descs[r].extra.get(i).copied().unwrap_or(0) as usize;
        check_split_sizes(n, |i, j| split(i, n + j), split).map_err(|reason| {
            Fail::Comm(Failure::Mismatch {
                collective: cx.coll,
                reason,
            })
        })?;
        let rows = |v: &[usize]| v.iter().map(|&s| s * row).collect::<Vec<_>>();
        let (send_counts, send_displs) = counts_displs(cx.ctx, &rows(&self.in_splits))?;
        let (recv_counts, recv_displs) = counts_displs(cx.ctx, &rows(&self.out_splits))?;
        let v = Box::new(VCounts {
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
        });
        let out = out_buf(cx.ctx, self.x.dtype, total * row)?;
        // SAFETY: the counts describe `x.buf` (its rows by destination) and `out` (the rows
        // by source, summing to `total`); the body owns all of them until completion.
        let req = unsafe {
            raw::ialltoallv(
                self.x.buf.ptr(),
                out.ptr().cast(),
                &v,
                self.x.mpi_type(),
                cx.comm,
            )
        }?;
        reqs.push(req);
        self._v = Some(v);
        self.out = Some(out);
        Ok(None)
    }
}

// ---------------------------------------------------------------------------------------------
// broadcast, reduce, gather, scatter, barrier
// ---------------------------------------------------------------------------------------------

pub(crate) struct Broadcast {
    x: Input,
    tensor: Option<Tensor>,
    root: usize,
    out: Option<OutBuf>,
    posted: bool,
}

impl Broadcast {
    pub(crate) fn new(x: Input, tensor: Tensor, root: usize) -> Self {
        Broadcast {
            x,
            tensor: Some(tensor),
            root,
            out: None,
            posted: false,
        }
    }
}

impl Body for Broadcast {
    type Out = Tensor;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let mut d = self.x.desc(uid, coll, OpName::Broadcast);
        d.what.root = Some(self.root);
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Tensor> {
        let me_root = cx.rank == self.root;
        if self.posted {
            return match self.out.take() {
                Some(out) => Ok(Some(output(cx.ctx, out, &self.x.dims, None)?)),
                None => self
                    .tensor
                    .take()
                    .map(Some)
                    .ok_or_else(|| op_err(cx.ctx, "lost tensor")),
            };
        }
        self.posted = true;
        let c = count(cx.ctx, self.x.elems())?;
        let ptr = if me_root {
            self.x.buf.mut_ptr()
        } else {
            let out = out_buf(cx.ctx, self.x.dtype, self.x.elems())?;
            let p = out.ptr().cast();
            self.out = Some(out);
            p
        };
        // SAFETY: `ptr` is this body's copy of the root's tensor (read) or its output buffer
        // (written), `elems` elements either way, owned until the request completes.
        let req = unsafe { raw::ibcast(ptr, c, self.x.mpi_type(), self.root, cx.comm) }?;
        reqs.push(req);
        Ok(None)
    }
}

pub(crate) struct Gather {
    x: Input,
    root: usize,
    recv: Option<Bytes>,
    sizes: Vec<(Vec<usize>, usize)>,
    counts: (Vec<c_int>, Vec<c_int>),
    posted: bool,
}

impl Gather {
    pub(crate) fn new(x: Input, root: usize) -> Self {
        Gather {
            x,
            root,
            recv: None,
            sizes: Vec::new(),
            counts: (Vec::new(), Vec::new()),
            posted: false,
        }
    }
}

impl Body for Gather {
    type Out = Option<Vec<Tensor>>;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let mut d = self.x.desc(uid, coll, OpName::Gather);
        d.what.rule = ShapeRule::Any;
        d.what.root = Some(self.root);
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, descs: &[Desc], reqs: &mut Reqs) -> Step<Option<Vec<Tensor>>> {
        let es = self.x.dtype.size_in_bytes();
        let me_root = cx.rank == self.root;
        if !self.posted {
            self.posted = true;
            // Every rank's shape came with its descriptor.
            self.sizes = descs
                .iter()
                .map(|d| (d.what.dims.clone(), d.what.dims.iter().product::<usize>()))
                .collect();
            let elems: Vec<usize> = self.sizes.iter().map(|s| s.1).collect();
            self.counts = counts_displs(cx.ctx, &elems)?;
            let recv_ptr = if me_root {
                let mut recv = Bytes::scratch(elems.iter().sum::<usize>() * es);
                let p = recv.mut_ptr();
                self.recv = Some(recv);
                p
            } else {
                std::ptr::null_mut()
            };
            let c = count(cx.ctx, self.x.elems())?;
            // SAFETY: on the root `recv` has room for every rank's piece at its displacement
            // (the counts come from the pieces' shapes); the body owns the buffers and counts
            // until completion.
            let req = unsafe {
                raw::igatherv(
                    self.x.buf.ptr(),
                    c,
                    recv_ptr,
                    &self.counts,
                    self.x.mpi_type(),
                    self.root,
                    cx.comm,
                )
            }?;
            reqs.push(req);
            return Ok(None);
        }
        let Some(recv) = self.recv.take() else {
            return Ok(Some(None));
        };
        let mut at = 0;
        let mut pieces = Vec::with_capacity(self.sizes.len());
        for (dims, elems) in &self.sizes {
            let out = out_buf(cx.ctx, self.x.dtype, *elems)?;
            // SAFETY: `out` holds `elems` elements, private to this thread; the slice is in
            // bounds of the gathered buffer.
            unsafe { out.write(0, &recv.bytes()[at..at + elems * es]) };
            at += elems * es;
            pieces.push(output(cx.ctx, out, dims, None)?);
        }
        Ok(Some(Some(pieces)))
    }
}

/// A point-to-point (or scatter) header: what the payload that follows holds, as magic,
/// communicator id and the payload's descriptor (dtype and dims) in the shared wire form,
/// padded to a fixed size so a receive can be posted before it arrives.
const HDR_WORDS: usize = 2 + DESC_HEADER_WORDS + MAX_DIMS;
const HDR_MAGIC: u64 = 0x4344_5450_3250_0002; // "CDTP2P" v2: desc.rs's words

fn header(uid: u64, x: &Input) -> Box<[u64]> {
    let mut h = vec![HDR_MAGIC, uid];
    h.extend(OpDesc::of(OpName::Send, x.dtype, &x.dims).encode_words_padded(MAX_DIMS));
    h.into_boxed_slice()
}

/// (dtype, dims) of a received header, if it is one of communicator `uid`.
fn read_header(h: &[u64], uid: u64) -> Option<(DType, Vec<usize>)> {
    if h.len() < HDR_WORDS || h[0] != HDR_MAGIC || h[1] != uid {
        return None;
    }
    let (d, _) = OpDesc::decode_words(&h[2..], MAX_DIMS).ok()?;
    Some((d.dtype?, d.dims))
}

/// Sends header and payload of `x` to `dest` (buffered: the requests are detached with the
/// buffers they read).
fn send_with_header(
    cx: &mut Cx,
    x: Input,
    dest: usize,
    tags: (c_int, c_int),
) -> std::result::Result<(), Fail> {
    let hdr = header(cx.uid, &x);
    let c = count(cx.ctx, x.elems())?;
    // SAFETY: `hdr` and `x.buf` move into the detached list together with these requests
    // right below and stay there until both complete.
    let reqs = unsafe {
        vec![
            raw::isend(
                hdr.as_ptr().cast(),
                HDR_WORDS as c_int,
                raw::element_type(8),
                dest,
                tags.0,
                cx.comm,
            )?,
            raw::isend(x.buf.ptr(), c, x.mpi_type(), dest, tags.1, cx.comm)?,
        ]
    };
    cx.detach(reqs, Box::new((hdr, x)));
    Ok(())
}

/// One receive: header first, then the payload into a buffer of the announced size.
struct Incoming {
    peer: usize,
    want: Option<(DType, Vec<usize>)>,
    hdr: Box<[u64]>,
    out: Option<OutBuf>,
    drain: Option<Bytes>,
    got: Option<(DType, Vec<usize>)>,
}

impl Incoming {
    fn new(peer: usize, want: Option<(DType, Vec<usize>)>) -> Self {
        Incoming {
            peer,
            want,
            hdr: vec![0u64; HDR_WORDS].into_boxed_slice(),
            out: None,
            drain: None,
            got: None,
        }
    }

    fn post_header(&mut self, cx: &Cx, tag: c_int, reqs: &mut Reqs) -> MpiResult<()> {
        // SAFETY: `hdr` is a boxed slice owned by this receive (inside its op) until the
        // request completes.
        let r = unsafe {
            raw::irecv(
                self.hdr.as_mut_ptr().cast(),
                HDR_WORDS as c_int,
                raw::element_type(8),
                self.peer as c_int,
                tag,
                cx.comm,
            )
        }?;
        reqs.push_recv(r, self.peer);
        Ok(())
    }

    /// After the header arrived: receives the payload, into an output when it is what the
    /// caller expects, else into a scratch buffer (it must be consumed either way). Returns
    /// the mismatch, if any.
    fn post_payload(&mut self, cx: &Cx, tag: c_int, reqs: &mut Reqs) -> Step<String> {
        let (dtype, dims) = read_header(&self.hdr, cx.uid).ok_or_else(|| {
            Fail::Comm(Failure::Mpi {
                what: format!("rank {} sent an unreadable message header", self.peer),
            })
        })?;
        let elems: usize = dims.iter().product();
        let mismatch = self
            .want
            .as_ref()
            .and_then(|(wd, ws)| check_recv(self.peer, (ws, *wd), (&dims, dtype)).err());
        let ptr: *mut c_void = if mismatch.is_some() {
            let mut d = Bytes::scratch(elems * dtype.size_in_bytes());
            let p = d.mut_ptr();
            self.drain = Some(d);
            p
        } else {
            let out = out_buf(cx.ctx, dtype, elems)?;
            let p = out.ptr().cast();
            self.out = Some(out);
            p
        };
        let c = count(cx.ctx, elems)?;
        // SAFETY: `ptr` is this receive's output or scratch buffer, sized by the header to
        // exactly the payload that follows it; owned until the request completes.
        let r = unsafe {
            raw::irecv(
                ptr,
                c,
                raw::element_type(dtype.size_in_bytes()),
                self.peer as c_int,
                tag,
                cx.comm,
            )
        }?;
        reqs.push_recv(r, self.peer);
        self.got = Some((dtype, dims));
        Ok(mismatch)
    }

    fn tensor(&mut self, ctx: &OpCtx) -> std::result::Result<Tensor, Fail> {
        let (out, (_, dims)) = self
            .out
            .take()
            .zip(self.got.take())
            .ok_or_else(|| op_err(ctx, "lost buffer"))?;
        output(ctx, out, &dims, None)
    }
}

pub(crate) struct Scatter {
    pieces: Vec<Input>,
    root: usize,
    incoming: Option<Incoming>,
    stage: u8,
}

impl Scatter {
    pub(crate) fn new(pieces: Vec<Input>, root: usize) -> Self {
        Scatter {
            pieces,
            root,
            incoming: None,
            stage: 0,
        }
    }
}

impl Body for Scatter {
    type Out = Tensor;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        // Only the root knows dtype and shapes (as in the local backend).
        let mut d = Desc::new(uid, coll, OpDesc::new(OpName::Scatter));
        d.what.root = Some(self.root);
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Tensor> {
        if cx.rank == self.root {
            let mut mine = None;
            for (j, x) in std::mem::take(&mut self.pieces).into_iter().enumerate() {
                if j == cx.rank {
                    mine = Some(x);
                } else {
                    send_with_header(cx, x, j, (TAG_SCATTER_HDR, TAG_SCATTER_DATA))?;
                }
            }
            let x = mine.ok_or_else(|| op_err(cx.ctx, "the root has no piece for itself"))?;
            let out = out_buf(cx.ctx, x.dtype, x.elems())?;
            // SAFETY: `out` holds exactly the piece's bytes, private to this thread.
            unsafe { out.write(0, x.buf.bytes()) };
            return Ok(Some(output(cx.ctx, out, &x.dims, None)?));
        }
        match self.stage {
            0 => {
                let mut inc = Incoming::new(self.root, None);
                inc.post_header(cx, TAG_SCATTER_HDR, reqs)?;
                self.incoming = Some(inc);
                self.stage = 1;
                Ok(None)
            }
            1 => {
                let inc = self
                    .incoming
                    .as_mut()
                    .ok_or_else(|| op_err(cx.ctx, "lost receive"))?;
                inc.post_payload(cx, TAG_SCATTER_DATA, reqs)?;
                self.stage = 2;
                Ok(None)
            }
            _ => {
                let inc = self
                    .incoming
                    .as_mut()
                    .ok_or_else(|| op_err(cx.ctx, "lost receive"))?;
                Ok(Some(inc.tensor(cx.ctx)?))
            }
        }
    }
}

/// `barrier`: the descriptor exchange is one (nobody completes it before everyone joined).
pub(crate) struct Barrier;

impl Body for Barrier {
    type Out = ();

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        Some(Desc::new(uid, coll, OpDesc::new(OpName::Barrier)))
    }

    fn step(&mut self, _: &mut Cx, _: &[Desc], _: &mut Reqs) -> Step<()> {
        Ok(Some(()))
    }
}

// ---------------------------------------------------------------------------------------------
// batch_p2p (send and recv are batches of one)
// ---------------------------------------------------------------------------------------------

/// One operation of a batch, inputs already copied.
pub(crate) enum P2P {
    Send(Input, usize),
    Recv(usize, Vec<usize>, DType),
}

pub(crate) struct BatchP2p {
    ops: Vec<P2P>,
    incoming: Vec<Incoming>,
    mismatch: Option<String>,
    stage: u8,
}

impl BatchP2p {
    pub(crate) fn new(ops: Vec<P2P>) -> Self {
        BatchP2p {
            ops,
            incoming: Vec::new(),
            mismatch: None,
            stage: 0,
        }
    }
}

impl Body for BatchP2p {
    type Out = Vec<Tensor>;

    fn desc(&self, _: u64, _: u64) -> Option<Desc> {
        None
    }

    fn step(&mut self, cx: &mut Cx, _: &[Desc], reqs: &mut Reqs) -> Step<Vec<Tensor>> {
        match self.stage {
            0 => {
                // Sends first (buffered: they complete for the caller now), then every
                // header receive, in op order (MPI matches them per peer in that order).
                for op in std::mem::take(&mut self.ops) {
                    match op {
                        P2P::Send(x, peer) => {
                            send_with_header(cx, x, peer, (TAG_P2P_HDR, TAG_P2P_DATA))?
                        }
                        P2P::Recv(peer, dims, dtype) => {
                            let mut inc = Incoming::new(peer, Some((dtype, dims)));
                            inc.post_header(cx, TAG_P2P_HDR, reqs)?;
                            self.incoming.push(inc);
                        }
                    }
                }
                self.stage = 1;
                if self.incoming.is_empty() {
                    return Ok(Some(Vec::new()));
                }
                Ok(None)
            }
            1 => {
                // Payload receives in op order too, so payloads match their headers.
                for inc in &mut self.incoming {
                    let m = inc.post_payload(cx, TAG_P2P_DATA, reqs)?;
                    if self.mismatch.is_none() {
                        self.mismatch = m;
                    }
                }
                self.stage = 2;
                Ok(None)
            }
            _ => {
                if let Some(m) = self.mismatch.take() {
                    // Not fatal: the mismatched message was consumed, later ones still match.
                    return Err(op_err(cx.ctx, m));
                }
                let ctx = cx.ctx;
                let got = self
                    .incoming
                    .iter_mut()
                    .map(|inc| inc.tensor(ctx))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Ok(Some(got))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// split and new_comm
// ---------------------------------------------------------------------------------------------

pub(crate) struct Split {
    ranks: Vec<usize>,
    make: Box<dyn Fn(Arc<CommShared>) -> Arc<dyn Backend> + Send>,
}

impl Split {
    /// Splits into the group `ranks`; `make` wraps the new communicator in a backend.
    pub(crate) fn new(
        ranks: Vec<usize>,
        make: Box<dyn Fn(Arc<CommShared>) -> Arc<dyn Backend> + Send>,
    ) -> Self {
        Split { ranks, make }
    }
}

impl Body for Split {
    type Out = Option<Arc<dyn Backend>>;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let mut d = Desc::new(uid, coll, OpDesc::new(OpName::Split));
        d.extra = self.ranks.iter().map(|&r| r as u64).collect();
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, descs: &[Desc], _: &mut Reqs) -> Step<Self::Out> {
        // Every member of every new group must have passed that group's list; checked over
        // all lists, so every rank reaches the same verdict.
        let lists: Vec<Vec<usize>> = descs
            .iter()
            .map(|d| d.extra.iter().map(|&r| r as usize).collect())
            .collect();
        check_split_lists(&lists).map_err(|reason| op_err(cx.ctx, reason))?;
        let color = match self.ranks.iter().min() {
            Some(&m) => c_int::try_from(m).unwrap_or(c_int::MAX),
            None => raw::undefined(),
        };
        let key = self.ranks.iter().position(|&r| r == cx.rank).unwrap_or(0);
        // MPI_Comm_split blocks until every member of the parent calls it. Every member is
        // past the exchange (it sent its list), so each is about to: the wait is short, and
        // MPI keeps progressing the nonblocking operations of other communicators meanwhile.
        // (It runs here, not on a helper thread: Open MPI 4.1 crashes in `add_comm` when a
        // communicator is created on one thread while another tests requests.)
        let new = raw::comm_split(cx.comm, color, key as c_int)?;
        if self.ranks.is_empty() {
            return Ok(Some(None));
        }
        let (rank, size) = raw::rank_size(new)?;
        if (rank, size) != (key, self.ranks.len()) {
            return Err(Fail::Comm(Failure::Mpi {
                what: format!(
                    "MPI_Comm_split made rank {rank} of {size}, expected {key} of {}",
                    self.ranks.len()
                ),
            }));
        }
        let uid = framing::mix(framing::mix(cx.uid, cx.coll), color as u64);
        let shared = cx.register(new, uid, rank, size)?;
        Ok(Some(Some((self.make)(shared))))
    }
}

/// `new_comm`: an exchange on the bootstrap communicator (names compared), then
/// `MPI_Comm_idup(MPI_COMM_WORLD)`.
pub(crate) struct NewComm {
    name: String,
    raw: Box<RawComm>,
    posted: bool,
}

impl NewComm {
    pub(crate) fn new(name: &str) -> Self {
        NewComm {
            name: name.to_string(),
            raw: Box::new(raw::comm_null()),
            posted: false,
        }
    }
}

impl Body for NewComm {
    type Out = Arc<CommShared>;

    fn desc(&self, uid: u64, coll: u64) -> Option<Desc> {
        let mut d = Desc::new(uid, coll, OpDesc::new(OpName::NewComm));
        d.extra = vec![framing::hash_str(&self.name)];
        Some(d)
    }

    fn step(&mut self, cx: &mut Cx, descs: &[Desc], reqs: &mut Reqs) -> Step<Arc<CommShared>> {
        if !self.posted {
            let mine = framing::hash_str(&self.name);
            if let Some(r) = descs.iter().position(|d| d.extra.first() != Some(&mine)) {
                return Err(op_err(
                    cx.ctx,
                    format!(
                        "new_comm is collective: this rank creates \"{}\" but rank {r} another communicator at the same point",
                        self.name
                    ),
                ));
            }
            reqs.push(raw::comm_idup(raw::comm_world(), &mut self.raw)?);
            self.posted = true;
            return Ok(None);
        }
        let uid = framing::mix(
            framing::hash_str("world"),
            framing::mix(framing::hash_str(&self.name), cx.coll),
        );
        let raw = *self.raw;
        let (rank, size) = raw::rank_size(raw)?;
        Ok(Some(cx.register(raw, uid, rank, size)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_element_once() {
        for (elems, n) in [(0, 3), (1, 4), (7, 3), (70_005, 8), (12, 4)] {
            let mut next = 0;
            for r in 0..n {
                let c = chunk_range(elems, n, r);
                assert_eq!(c.start, next.min(elems), "{elems} over {n}, rank {r}");
                next = c.end;
            }
            assert_eq!(next, elems);
        }
    }

    #[test]
    fn reductions_of_pieces_match_the_rank_order_reference() {
        // bf16 sums accumulate in f32 and round once: 1 + 2^-8 + 2^-8 rounds to 1 + 2^-7 in
        // one rounding, but to 1 when rounded after every step.
        let vals = [1.0f32, 2f32.powi(-8), 2f32.powi(-8)];
        let src: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let buf = Bytes::copy_of(&src);
        let out = OutBuf::new(DType::BF16, 1).expect("a buffer");
        reduce_pieces(DType::BF16, ReduceOp::Sum, buf.bytes(), 3, out.ptr());
        // SAFETY: fully written by the reduction.
        let t = unsafe { out.into_tensor(Shape::from_dims(&[1])) }.expect("a tensor");
        let got = t.to_vec1::<half::bf16>().expect("bf16")[0].to_f32();
        assert_eq!(got, 1.0 + 2f32.powi(-7));
    }

    #[test]
    fn headers_round_trip_and_reject_other_communicators() {
        let x = Input {
            buf: Bytes::scratch(24),
            dtype: DType::F16,
            dims: vec![3, 4],
        };
        let h = header(5, &x);
        assert_eq!(read_header(&h, 5), Some((DType::F16, vec![3, 4])));
        assert_eq!(read_header(&h, 6), None);
        assert_eq!(read_header(&h[..3], 5), None);
    }

    #[test]
    fn counts_refuse_what_mpi_cannot_address() {
        let ctx = OpCtx {
            op: OpName::AllGatherSingle,
            comm: Arc::from("w"),
            rank: 0,
            seq: 1,
            timeout: std::time::Duration::from_secs(1),
        };
        assert!(count(&ctx, c_int::MAX as usize).is_ok());
        assert!(matches!(
            count(&ctx, c_int::MAX as usize + 1),
            Err(Fail::Op(CommError::InvalidArgument { .. }))
        ));
        let (c, d) = counts_displs(&ctx, &[2, 0, 3]).ok().expect("small");
        assert_eq!((c, d), (vec![2, 0, 3], vec![0, 2, 2]));
    }
}
