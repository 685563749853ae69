//! `LocalBackend`: one rank of one local communicator, with its own progress thread.
//!
//! Issuing an op assigns it the next collective index and queues it; the progress thread runs
//! queued ops one at a time, in issue order, so ops on one communicator are ordered while ops
//! on different communicators (different threads) overlap. An idle progress thread sleeps on a
//! condvar: nothing spins.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};

use super::group::{Group, GroupKey, Message, Post};
use super::window::{LocalWindow, WindowShared};
use candle_dtensor_comm_core::kit::agree::{self, Agreement, Heard, Net};
use candle_dtensor_comm_core::kit::cpu::kernels::{
    detached_copy, read_view, reduce_into, ReadView,
};
use candle_dtensor_comm_core::kit::cpu::queue::Queue;
use candle_dtensor_comm_core::kit::cpu::{
    candle_err, out_buf, produce, put_bytes, reduced, view_err, EAGER_BYTES,
};
use candle_dtensor_comm_core::kit::desc::{
    check_recv, check_split_lists, Failure, OpDesc, ShapeRule,
};
use candle_dtensor_comm_core::WindowBackend;
use candle_dtensor_comm_core::Work;
use candle_dtensor_comm_core::{Backend, Capabilities, Collective, CollectiveOutput, CommOptions};
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, OpName, P2POp, ReduceOp};

/// What an op body gets to run with.
pub(crate) struct Exec<'a> {
    pub group: &'a Arc<Group>,
    pub rank: usize,
    pub coll: u64,
    pub ctx: &'a OpCtx,
    pub deadline: Instant,
    /// CUDA, ordered by events: the event the issuing thread recorded on its stream when it
    /// queued the op (its inputs are complete after it; `cuda.rs`).
    #[cfg(feature = "cuda")]
    pub ready: Option<Arc<candle_core::cuda_backend::cudarc::driver::CudaEvent>>,
}

impl Exec<'_> {
    /// Posts `post` with `desc` for this op and waits for every rank's (see `Group::arrive`).
    pub(crate) fn arrive(&self, desc: OpDesc, post: Post) -> Result<Vec<Post>> {
        let (ctx, coll, rank) = (self.ctx, self.coll, self.rank);
        self.group
            .arrive(ctx, coll, rank, desc, post, self.deadline)
    }

    /// [`Exec::arrive`] with `input` as this rank's post input (an eager copy when small, see
    /// [`post_input`]); also returns whether peers read this rank's own memory.
    pub(crate) fn arrive_with_input(
        &self,
        desc: OpDesc,
        input: &Tensor,
        post: Post,
    ) -> Result<(Vec<Post>, bool)> {
        let (mine, lent) = post_input(self.ctx, input)?;
        let post = Post {
            input: Some(mine),
            ..post
        };
        Ok((self.arrive(desc, post)?, lent))
    }

    /// Leaves this op; with `lent`, waits until no peer reads this rank's memory any more.
    pub(crate) fn depart(&self, lent: bool) -> Result<()> {
        let (ctx, coll, rank) = (self.ctx, self.coll, self.rank);
        self.group.depart(ctx, coll, rank, lent, self.deadline)
    }
}

/// The shared core of a local backend (also used by its windows).
pub(crate) struct Core {
    pub group: Arc<Group>,
    pub rank: usize,
    device: Device,
    queue: Arc<Queue>,
    /// The modeled link its collectives are paced to (`candle_dtensor_comm_core::link`), set once at creation;
    /// shared with the communicators split from it that have no link of their own.
    link: std::sync::OnceLock<Arc<candle_dtensor_comm_core::link::Link>>,
    /// Agreements and shrinks started on this communicator (their instance numbers).
    ft_seq: AtomicU64,
    /// CUDA ranks: the tensors of ops whose GPU work may still run (`cuda::Retirement`).
    #[cfg(feature = "cuda")]
    pub(crate) retired: Arc<super::cuda::Retirement>,
}

/// One rank of a local communicator.
pub(crate) struct LocalBackend {
    core: Arc<Core>,
}

impl Drop for LocalBackend {
    fn drop(&mut self) {
        // The progress thread drains what is queued (peers may need it) and then exits.
        self.core.queue.shutdown();
    }
}

impl LocalBackend {
    pub(crate) fn new(group: Arc<Group>, rank: usize, name: &str) -> Result<Arc<LocalBackend>> {
        Self::with_device(group, rank, name, Device::Cpu)
    }

    /// A rank whose tensors live on `device` (CUDA devices need feature `cuda`).
    pub(crate) fn with_device(
        group: Arc<Group>,
        rank: usize,
        name: &str,
        device: Device,
    ) -> Result<Arc<LocalBackend>> {
        let queue = Queue::new();
        queue.spawn(name, rank, || {})?;
        Ok(Arc::new(LocalBackend {
            core: Arc::new(Core {
                group,
                rank,
                device,
                queue,
                link: std::sync::OnceLock::new(),
                ft_seq: AtomicU64::new(0),
                #[cfg(feature = "cuda")]
                retired: Arc::default(),
            }),
        }))
    }
}

impl LocalBackend {
    /// Paces this rank's collectives (`candle_dtensor_comm_core::link`): to a link of its own when the hints name
    /// communicator `name` (`link.<name>.gbps`), else to `parent`'s link (shared with it),
    /// else to the link of the general hints (`link.gbps`), else not at all.
    pub(crate) fn set_link(
        &self,
        options: &CommOptions,
        name: &str,
        parent: Option<&Core>,
    ) -> Result<(), String> {
        let named = options.hints.contains_key(&format!("link.{name}.gbps"))
            || options.hints.contains_key(&format!("link.{name}.alpha_us"));
        let inherited = parent
            .and_then(|p| p.link.get().cloned())
            .filter(|_| !named);
        let own = match inherited {
            Some(_) => None,
            None => candle_dtensor_comm_core::link::LinkModel::from_hints(&options.hints, name)
                .map_err(|e| e.to_string())?,
        };
        let link = match own {
            Some(l) => Some(candle_dtensor_comm_core::link::Link::new(l)),
            None => inherited,
        };
        if let Some(l) = link {
            let m = l.model();
            tracing::debug!(
                comm = name,
                alpha_us = m.alpha_us,
                gbps = m.gbps,
                shared_with_parent = own.is_none(),
                "link model"
            );
            // Set once, right after creation, before any op is queued.
            let _ = self.core.link.set(l);
        }
        Ok(())
    }
}

impl Core {
    /// Queues collective `body`, paced to the link model (if any): after `body` ran on the
    /// progress thread, it sleeps for what is left of the modeled time of an op whose larger
    /// buffer has `bytes` bytes, so later ops on this communicator queue behind it.
    pub(crate) fn submit_paced<T: Send + 'static>(
        &self,
        ctx: OpCtx,
        bytes: usize,
        body: impl FnOnce(&Exec) -> Result<T> + Send + 'static,
    ) -> Result<Work<T>> {
        let paced = self.link.get().and_then(|l| {
            let wire = l.model().wire_bytes(ctx.op, bytes, self.group.size())?;
            Some((l.clone(), wire))
        });
        let Some((link, wire)) = paced else {
            return self.submit(ctx, true, body);
        };
        self.submit(ctx, true, move |e| {
            let t = link.begin(wire);
            let r = body(e);
            match &r {
                Ok(_) => link.finish(t),
                Err(_) => link.cancel(t),
            }
            r
        })
    }

    /// The device this rank's tensors live on.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// Queues `body` as the next op. `collective` ops take the next collective index.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        ctx: OpCtx,
        collective: bool,
        body: impl FnOnce(&Exec) -> Result<T> + Send + 'static,
    ) -> Result<Work<T>> {
        // candle's stream is per thread: the op runs on another thread (the progress thread),
        // which must see the issuer's work producing the inputs complete (`cuda::issue`).
        #[cfg(feature = "cuda")]
        let ready = if self.device.is_cuda() {
            super::cuda::issue(&ctx, &self.device)?
        } else {
            None
        };
        let (group, rank) = (self.group.clone(), self.rank);
        let on_panic_group = group.clone();
        self.queue.submit(
            ctx,
            collective,
            move |ctx, coll| {
                body(&Exec {
                    group: &group,
                    rank,
                    coll,
                    ctx,
                    deadline: Instant::now() + ctx.timeout,
                    #[cfg(feature = "cuda")]
                    ready,
                })
            },
            move |ctx, _, reason| {
                on_panic_group.fail(Failure::aborted(rank, reason.clone()));
                CommError::Aborted {
                    ctx: ctx.clone(),
                    reason,
                }
            },
        )
    }

    /// Runs a collective body and waits for it (used by split, new_window, fence).
    pub(crate) fn run_sync<T: Send + 'static>(
        &self,
        ctx: OpCtx,
        body: impl FnOnce(&Exec) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.submit(ctx, true, body)?.wait()
    }
}

/// One agreement's messages through the group's shared state.
struct LocalNet<'a> {
    core: &'a Core,
    instance: u64,
}

impl Net for LocalNet<'_> {
    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.group.size()
    }

    fn send(&self, peer: usize, round: u32, bytes: &[u8]) {
        self.core
            .group
            .agree_post(self.instance, round, self.core.rank, peer, bytes);
    }

    fn recv(&self, peer: usize, round: u32, deadline: Instant) -> Heard {
        self.core
            .group
            .agree_take(self.instance, round, peer, self.core.rank, deadline)
    }

    fn done(&self) {
        self.core.group.agree_done(self.instance, self.core.rank);
    }
}

/// The input a rank posts: an eager copy for small inputs, the tensor itself otherwise.
/// Returns the post input and whether peers read this rank's own memory (departure must wait).
fn post_input(ctx: &OpCtx, input: &Tensor) -> Result<(Tensor, bool)> {
    let bytes = input.elem_count() * input.dtype().size_in_bytes();
    if bytes <= EAGER_BYTES {
        Ok((detached_copy(input).map_err(view_err(ctx))?, false))
    } else {
        Ok((input.clone(), true))
    }
}

fn input_of<'a>(ctx: &OpCtx, posts: &'a [Post], r: usize) -> Result<&'a Tensor> {
    posts[r]
        .input
        .as_ref()
        .ok_or_else(|| CommError::invalid(ctx, format!("rank {r} posted no input")))
}

/// Read views of every rank's posted input, in rank order.
fn views<'a>(ctx: &OpCtx, posts: &'a [Post]) -> Result<Vec<ReadView<'a>>> {
    (0..posts.len())
        .map(|r| read_view(input_of(ctx, posts, r)?).map_err(view_err(ctx)))
        .collect()
}

fn all_reduce(e: &Exec, input: Tensor, op: ReduceOp, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = e.ctx;
    let n = e.group.size();
    let (dtype, elems, es) = (
        input.dtype(),
        input.elem_count(),
        input.dtype().size_in_bytes(),
    );
    let desc = OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::AllReduce, &input)
    };
    let shape = input.shape().clone();
    let (mine, lent) = post_input(ctx, &input)?;
    if !lent {
        // Small: one barrier, then every rank reduces everything (in rank order, so identically).
        let post = Post {
            input: Some(mine),
            ..Post::default()
        };
        let posts = e.arrive(desc, post)?;
        let out = produce(ctx, output, dtype, shape, |dst| {
            let views = views(ctx, &posts)?;
            let srcs: Vec<&[u8]> = views.iter().map(|v| v.bytes()).collect();
            // SAFETY: `dst` holds `elems` elements of `dtype`, exclusively ours.
            unsafe { reduce_into(dtype, op, &srcs, dst, n) };
            Ok(())
        })?;
        drop(posts);
        e.depart(false)?;
        return Ok(out);
    }
    // Large: rank r reduces chunk r of every input into a private chunk buffer (reduce-scatter),
    // barrier (after which no input is read again, so `output` may alias `input`), then every
    // rank copies all chunks into its output (all-gather): 2(n-1)/n of the data crosses per rank,
    // and no peer ever touches a rank's output.
    let chunk = elems.div_ceil(n);
    let range = |r: usize| (r * chunk).min(elems)..((r + 1) * chunk).min(elems);
    let mine_range = range(e.rank);
    let part = Arc::new(out_buf(ctx, dtype, mine_range.len())?);
    let post = Post {
        input: Some(mine),
        out: Some(part.clone()),
        ..Post::default()
    };
    let posts = e.arrive(desc, post)?;
    {
        let views = views(ctx, &posts)?;
        let srcs: Vec<&[u8]> = views
            .iter()
            .map(|v| &v.bytes()[mine_range.start * es..mine_range.end * es])
            .collect();
        // SAFETY: `part` holds exactly this chunk and only this thread writes it.
        unsafe { reduce_into(dtype, op, &srcs, part.ptr(), n) };
    }
    e.group.sync(ctx, e.coll, e.rank, 2, e.deadline)?;
    let out = produce(ctx, output, dtype, shape, |dst| {
        for (j, p) in posts.iter().enumerate() {
            let peer = p
                .out
                .as_ref()
                .ok_or_else(|| CommError::invalid(ctx, format!("rank {j} posted no chunk")))?;
            let r = range(j);
            // SAFETY: rank j finished writing its chunk before the stage-2 barrier and never
            // writes it again; the Arc keeps it alive while we read.
            let src = unsafe { std::slice::from_raw_parts(peer.ptr(), r.len() * es) };
            // SAFETY: chunk j of `dst` is in bounds and exclusively ours.
            unsafe { put_bytes(dst, r.start * es, src) };
        }
        Ok(())
    })?;
    drop(posts);
    e.depart(false)?;
    Ok(out)
}

/// The common shape of the copy collectives: post, arrive, fill the output from the posts,
/// depart (waiting for peers when they read this rank's own input).
fn copy_collective(
    e: &Exec,
    desc: OpDesc,
    input: &Tensor,
    output: Option<Tensor>,
    out_dtype: DType,
    out_shape: Shape,
    fill: impl FnOnce(&[Post], *mut u8) -> Result<()> + Send,
) -> Result<Tensor> {
    let (posts, lent) = e.arrive_with_input(desc, input, Post::default())?;
    let out = produce(e.ctx, output, out_dtype, out_shape, |dst| fill(&posts, dst));
    drop(posts);
    let departed = e.depart(lent);
    let out = out?;
    departed?;
    Ok(out)
}

fn all_gather(e: &Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let n = e.group.size();
    let ctx = e.ctx;
    let bytes = input.elem_count() * input.dtype().size_in_bytes();
    let mut dims = input.dims().to_vec();
    match dims.first_mut() {
        Some(d0) => *d0 *= n,
        None => dims.push(n),
    }
    let desc = OpDesc::tensor(OpName::AllGatherSingle, &input);
    copy_collective(
        e,
        desc,
        &input,
        output,
        input.dtype(),
        Shape::from_dims(&dims),
        |posts, dst| {
            for r in 0..n {
                let v = read_view(input_of(ctx, posts, r)?).map_err(view_err(ctx))?;
                // SAFETY: piece r of `bytes` bytes lies within the n * bytes output.
                unsafe { put_bytes(dst, r * bytes, v.bytes()) };
            }
            Ok(())
        },
    )
}

fn reduce_scatter(e: &Exec, input: Tensor, op: ReduceOp, output: Option<Tensor>) -> Result<Tensor> {
    let n = e.group.size();
    let ctx = e.ctx;
    let (dtype, es) = (input.dtype(), input.dtype().size_in_bytes());
    let chunk = input.elem_count() / n;
    let mut dims = input.dims().to_vec();
    dims[0] /= n;
    let desc = OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::ReduceScatterSingle, &input)
    };
    let rank = e.rank;
    copy_collective(
        e,
        desc,
        &input,
        output,
        dtype,
        Shape::from_dims(&dims),
        |posts, dst| {
            let views = views(ctx, posts)?;
            let srcs: Vec<&[u8]> = views
                .iter()
                .map(|v| &v.bytes()[rank * chunk * es..(rank + 1) * chunk * es])
                .collect();
            // SAFETY: `dst` holds `chunk` elements, exclusively ours.
            unsafe { reduce_into(dtype, op, &srcs, dst, n) };
            Ok(())
        },
    )
}

fn all_to_all(e: &Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let n = e.group.size();
    let ctx = e.ctx;
    let cb = input.elem_count() / n * input.dtype().size_in_bytes();
    let desc = OpDesc::tensor(OpName::AllToAllSingle, &input);
    let rank = e.rank;
    copy_collective(
        e,
        desc,
        &input,
        output,
        input.dtype(),
        input.shape().clone(),
        |posts, dst| {
            for j in 0..n {
                let v = read_view(input_of(ctx, posts, j)?).map_err(view_err(ctx))?;
                // SAFETY: chunk j of the output is in bounds and exclusively ours.
                unsafe { put_bytes(dst, j * cb, &v.bytes()[rank * cb..(rank + 1) * cb]) };
            }
            Ok(())
        },
    )
}

fn all_to_all_v(
    e: &Exec,
    input: Tensor,
    out_splits: Vec<usize>,
    in_splits: Vec<usize>,
) -> Result<Tensor> {
    exchange_rows(e, input, None, out_splits, in_splits)
}

/// all_to_all_v of `input`'s rows `rows` (`None`: all of them, in order). Each receiver copies
/// its rows straight out of the sender's input, so a permuted send buffer is never built.
fn exchange_rows(
    e: &Exec,
    input: Tensor,
    send_rows: Option<Arc<Vec<u32>>>,
    out_splits: Vec<usize>,
    in_splits: Vec<usize>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dims = input.dims().to_vec();
    let rows: Vec<usize> = dims.iter().skip(1).copied().collect();
    let row_bytes = rows.iter().product::<usize>() * input.dtype().size_in_bytes();
    let desc = OpDesc {
        rule: ShapeRule::Rows,
        ..OpDesc::tensor(OpName::AllToAllVSingle, &input)
    };
    let post = Post {
        splits: Some((out_splits.clone(), in_splits.clone())),
        rows: send_rows,
        ..Post::default()
    };
    let (posts, lent) = e.arrive_with_input(desc, &input, post)?;
    e.group.check_split_sizes(ctx, e.coll, &posts)?;
    let total: usize = out_splits.iter().sum();
    let out = out_buf(
        ctx,
        input.dtype(),
        total * row_bytes / input.dtype().size_in_bytes().max(1),
    )?;
    let outside = |j: usize| {
        CommError::invalid(
            ctx,
            format!("rank {j} sends rows outside its input (row list or split sizes)"),
        )
    };
    let mut off = 0;
    for (j, p) in posts.iter().enumerate() {
        let v = read_view(input_of(ctx, &posts, j)?).map_err(view_err(ctx))?;
        let bytes = v.bytes();
        let splits = p.splits.as_ref().map(|s| &s.1[..]).unwrap_or(&[]);
        let first: usize = splits[..e.rank].iter().sum();
        let count = out_splits[j];
        match &p.rows {
            None => {
                let src = bytes
                    .get(first * row_bytes..(first + count) * row_bytes)
                    .ok_or_else(|| outside(j))?;
                // SAFETY: the output has room for the sum of out_splits rows; written only here.
                unsafe { out.write(off, src) };
            }
            Some(ids) => {
                let ids = ids.get(first..first + count).ok_or_else(|| outside(j))?;
                for (r, &id) in ids.iter().enumerate() {
                    let at = id as usize * row_bytes;
                    let src = bytes.get(at..at + row_bytes).ok_or_else(|| outside(j))?;
                    // SAFETY: row r of this block lies inside the output (count rows from
                    // `off`, the sum of out_splits in all); written only here.
                    unsafe { out.write(off + r * row_bytes, src) };
                }
            }
        }
        off += count * row_bytes;
    }
    drop(posts);
    e.depart(lent)?;
    let mut out_dims = vec![total];
    out_dims.extend(rows);
    // SAFETY: `off` reached the full output size.
    unsafe { out.into_tensor(Shape::from_dims(&out_dims)) }.map_err(candle_err(ctx))
}

fn broadcast(e: &Exec, tensor: Tensor, root: usize) -> Result<Tensor> {
    let ctx = e.ctx;
    let desc = OpDesc {
        root: Some(root),
        ..OpDesc::tensor(OpName::Broadcast, &tensor)
    };
    if e.rank == root {
        let (posts, lent) = e.arrive_with_input(desc, &tensor, Post::default())?;
        drop(posts);
        e.depart(lent)?;
        return Ok(tensor);
    }
    let posts = e.arrive(desc, Post::default())?;
    let copy = detached_copy(input_of(ctx, &posts, root)?).map_err(view_err(ctx))?;
    drop(posts);
    e.depart(false)?;
    Ok(copy)
}

fn reduce(e: &Exec, input: Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
    let ctx = e.ctx;
    let desc = OpDesc {
        root: Some(root),
        reduce: Some(op),
        ..OpDesc::tensor(OpName::Reduce, &input)
    };
    let (dtype, elems, shape) = (input.dtype(), input.elem_count(), input.shape().clone());
    let (posts, lent) = e.arrive_with_input(desc, &input, Post::default())?;
    let result = if e.rank == root {
        let views = views(ctx, &posts)?;
        let srcs: Vec<&[u8]> = views.iter().map(|v| v.bytes()).collect();
        let out = reduced(ctx, dtype, op, &srcs, elems)?;
        // SAFETY: `reduced` wrote every element.
        Some(unsafe { out.into_tensor(shape) }.map_err(candle_err(ctx))?)
    } else {
        None
    };
    drop(posts);
    e.depart(lent)?;
    Ok(result)
}

fn gather(e: &Exec, input: Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
    let ctx = e.ctx;
    let desc = OpDesc {
        root: Some(root),
        rule: ShapeRule::Any,
        ..OpDesc::tensor(OpName::Gather, &input)
    };
    let (posts, lent) = e.arrive_with_input(desc, &input, Post::default())?;
    let result = if e.rank == root {
        Some(
            (0..e.group.size())
                .map(|r| detached_copy(input_of(ctx, &posts, r)?).map_err(view_err(ctx)))
                .collect::<Result<Vec<_>>>()?,
        )
    } else {
        None
    };
    drop(posts);
    e.depart(lent)?;
    Ok(result)
}

fn scatter(e: &Exec, inputs: Vec<Tensor>, root: usize) -> Result<Tensor> {
    let ctx = e.ctx;
    let desc = OpDesc {
        root: Some(root),
        ..OpDesc::new(OpName::Scatter)
    };
    let mut lent = false;
    let post = if e.rank == root {
        let mut posted = Vec::with_capacity(inputs.len());
        for t in &inputs {
            let (p, l) = post_input(ctx, t)?;
            lent |= l;
            posted.push(p);
        }
        Post {
            inputs: posted,
            ..Post::default()
        }
    } else {
        Post::default()
    };
    let posts = e.arrive(desc, post)?;
    let src = posts[root].inputs.get(e.rank).ok_or_else(|| {
        CommError::invalid(
            ctx,
            format!("root {root} posted no piece for rank {}", e.rank),
        )
    })?;
    let out = detached_copy(src).map_err(view_err(ctx))?;
    drop(posts);
    e.depart(lent)?;
    Ok(out)
}

fn batch_p2p(e: &Exec, ops: Vec<P2POp>) -> Result<Vec<Tensor>> {
    let ctx = e.ctx;
    // Sends never wait, so without this check they would "succeed" on a failed communicator.
    if let Some(f) = e.group.failure() {
        return Err(f.to_error(ctx, None));
    }
    let mut received = Vec::new();
    for op in &ops {
        if let P2POp::Send { tensor, peer } = op {
            let copy = detached_copy(tensor).map_err(view_err(ctx))?;
            e.group.post_message(e.rank, *peer, Message::new(copy));
        }
    }
    for op in ops {
        if let P2POp::Recv { peer, shape, dtype } = op {
            let m = e.group.take_message(ctx, peer, e.rank, e.deadline)?;
            check_recv(
                peer,
                (shape.dims(), dtype),
                (m.tensor.dims(), m.tensor.dtype()),
            )
            .map_err(|e| CommError::invalid(ctx, e))?;
            received.push(m.tensor);
        }
    }
    Ok(received)
}

/// The nccl-tests size S of `op` for the link model: the gathered output of all_gather and
/// gather, the rows sent by all_to_all_v_rows, the input otherwise; `None` for the ops the
/// model does not pace (a scatter's size is known on its root only).
pub(crate) fn link_size(op: &Collective, n: usize) -> Option<usize> {
    let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    match op {
        Collective::AllReduce { input, .. }
        | Collective::ReduceScatter { input, .. }
        | Collective::AllToAll { input, .. }
        | Collective::AllToAllV { input, .. }
        | Collective::Reduce { input, .. }
        | Collective::Broadcast { tensor: input, .. } => Some(bytes(input)),
        Collective::AllGather { input, .. } | Collective::Gather { input, .. } => {
            Some(bytes(input) * n)
        }
        Collective::AllToAllVRows { input, rows, .. } => {
            let row_elems: usize = input.dims().iter().skip(1).product();
            Some(rows.len() * row_elems * input.dtype().size_in_bytes())
        }
        Collective::Scatter { .. } | Collective::Barrier | Collective::BatchP2p { .. } => None,
    }
}

/// Runs `op` on the progress thread (CPU tensors; CUDA ranks queue through `cuda::submit`).
fn run(e: &Exec, op: Collective) -> Result<CollectiveOutput> {
    Ok(match op {
        Collective::AllReduce { input, op, output } => all_reduce(e, input, op, output)?.into(),
        Collective::AllGather { input, output } => all_gather(e, input, output)?.into(),
        Collective::ReduceScatter { input, op, output } => {
            reduce_scatter(e, input, op, output)?.into()
        }
        Collective::AllToAll { input, output } => all_to_all(e, input, output)?.into(),
        Collective::AllToAllV {
            input,
            output_split_sizes: o,
            input_split_sizes: i,
        } => all_to_all_v(e, input, o, i)?.into(),
        Collective::AllToAllVRows {
            input,
            rows,
            output_split_sizes: o,
            input_split_sizes: i,
        } => exchange_rows(e, input, Some(rows), o, i)?.into(),
        Collective::Broadcast { tensor, root } => broadcast(e, tensor, root)?.into(),
        Collective::Reduce { input, root, op } => reduce(e, input, root, op)?.into(),
        Collective::Gather { input, root } => gather(e, input, root)?.into(),
        Collective::Scatter { inputs, root } => scatter(e, inputs, root)?.into(),
        Collective::Barrier => barrier(e)?.into(),
        Collective::BatchP2p { ops } => batch_p2p(e, ops)?.into(),
    })
}

/// Returns when every rank has arrived (any device: no data moves).
pub(crate) fn barrier(e: &Exec) -> Result<()> {
    e.arrive(OpDesc::new(OpName::Barrier), Post::default())?;
    e.depart(false)
}

impl Backend for LocalBackend {
    fn backend_name(&self) -> &'static str {
        "local"
    }

    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.group.size()
    }

    fn device(&self) -> &Device {
        &self.core.device
    }

    fn capabilities(&self) -> Capabilities {
        candle_dtensor_comm_core::kit::cpu::capabilities(true)
    }

    fn collective(&self, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>> {
        // Rows are read in place on the CPU only.
        let op = if self.core.device.is_cpu() {
            op
        } else {
            op.gather_rows(&ctx)?
        };
        #[cfg(feature = "cuda")]
        if self.core.device.is_cuda() {
            return super::cuda::submit(&self.core, ctx, op);
        }
        match link_size(&op, self.core.group.size()) {
            Some(bytes) => self.core.submit_paced(ctx, bytes, move |e| run(e, op)),
            None => {
                let collective = !matches!(op, Collective::BatchP2p { .. });
                self.core.submit(ctx, collective, move |e| run(e, op))
            }
        }
    }

    fn split(
        &self,
        ctx: OpCtx,
        ranks: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let ranks = ranks.to_vec();
        let options = options.clone();
        let name = name.to_string();
        let core = self.core.clone();
        self.core.run_sync(ctx, move |e| {
            let post = Post {
                ranks: Some(ranks.clone()),
                ..Post::default()
            };
            let posts = e.arrive(OpDesc::new(OpName::Split), post)?;
            // Checked over all posts, so every rank reaches the same verdict: a split fails on
            // all ranks or on none (a rank listed by a peer it disagrees with must hear of it).
            let lists: Vec<Vec<usize>> = posts
                .iter()
                .map(|p| p.ranks.clone().unwrap_or_default())
                .collect();
            drop(posts);
            e.depart(false)?;
            check_split_lists(&lists).map_err(|reason| CommError::invalid(e.ctx, reason))?;
            if ranks.is_empty() {
                return Ok(None);
            }
            let color = ranks.iter().copied().min().unwrap_or(0);
            let members: Vec<usize> = ranks.iter().map(|&r| e.group.members[r]).collect();
            let key = GroupKey::Split {
                parent: e.group.id,
                coll: e.coll,
                color,
            };
            let child = e.group.world.rendezvous(key, || members);
            let my = ranks.iter().position(|&r| r == core.rank).unwrap_or(0);
            let b = LocalBackend::with_device(child, my, &name, core.device.clone())?;
            b.set_link(&options, &name, Some(&core))
                .map_err(|reason| CommError::invalid(e.ctx, reason))?;
            Ok(Some(b as Arc<dyn Backend>))
        })
    }

    fn shrink(
        &self,
        ctx: OpCtx,
        excluded: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        let core = &self.core;
        let instance = core.ft_seq.fetch_add(1, Ordering::Relaxed);
        let net = LocalNet { core, instance };
        let survivors = agree::shrink_agreement(&net, &ctx, excluded, None)?;
        let members: Vec<usize> = survivors
            .iter()
            .map(|(r, _)| core.group.members[*r])
            .collect();
        let my = survivors
            .iter()
            .position(|(r, _)| *r == core.rank)
            .ok_or_else(|| CommError::invalid(&ctx, "this rank is not a survivor"))?;
        let key = GroupKey::Shrink {
            parent: core.group.id,
            instance,
            members: members.clone(),
        };
        let child = core.group.world.rendezvous(key, || members);
        let b = LocalBackend::with_device(child, my, name, core.device.clone())?;
        b.set_link(options, name, Some(core))
            .map_err(|reason| CommError::invalid(&ctx, reason))?;
        Ok(b as Arc<dyn Backend>)
    }

    fn shrink_agrees_on_lists(&self) -> bool {
        true
    }

    fn agree(&self, ctx: OpCtx, ok: bool) -> Result<Agreement> {
        let instance = self.core.ft_seq.fetch_add(1, Ordering::Relaxed);
        let net = LocalNet {
            core: &self.core,
            instance,
        };
        Ok(agree::agree_ok(&net, ok, ctx.timeout))
    }

    fn new_window(&self, ctx: OpCtx, bytes: usize) -> Result<Arc<dyn WindowBackend>> {
        let core = self.core.clone();
        self.core.run_sync(ctx, move |e| {
            let desc = OpDesc {
                bytes: Some(bytes),
                ..OpDesc::new(OpName::NewWindow)
            };
            e.arrive(desc, Post::default())?;
            let shared = WindowShared::get_or_create(e.group, e.coll, bytes);
            e.depart(false)?;
            Ok(Arc::new(LocalWindow::new(shared, core)) as Arc<dyn WindowBackend>)
        })
    }

    fn abort(&self, reason: &str) {
        self.core
            .group
            .fail(Failure::aborted(self.core.rank, reason));
    }

    fn is_aborted(&self) -> bool {
        self.core.group.failure().is_some()
    }

    fn pending(&self) -> usize {
        self.core.queue.pending()
    }
}
