//! The local backend on CUDA tensors (cargo feature `cuda`): ranks are threads sharing one or
//! several GPUs, and collectives are candle ops on the peers' tensors (device-to-device copies,
//! reductions on the GPU).
//!
//! The slot protocol is the CPU one (`group.rs`: arrive with a descriptor, read the peers'
//! posts, depart), with the synchronization CUDA needs because candle's default stream is per
//! thread: the issuing thread synchronizes its stream before queuing the op (so its input is
//! complete when a peer reads it, `Core::submit`), each rank synchronizes its own stream after
//! computing its result (so it has finished reading its peers' inputs), and every rank departs
//! only when all have (so no rank returns, and lets its caller change or free its input, while a
//! peer still reads it). Results are fresh tensors; an `*_into` output is written after the
//! departure, so it may alias the input. Reductions run in rank order, half types in `f32`,
//! `avg` divides once at the end, as on the CPU (NaN propagation in `max`/`min` follows candle's
//! CUDA kernels).

use candle_core::{DType, Device, Shape, Tensor};

use super::backend::{barrier, Exec};
use super::group::{Message, Post};
use candle_dtensor_comm_core::kit::desc::{check_recv, OpDesc, ShapeRule};
use candle_dtensor_comm_core::{Collective, CollectiveOutput};
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, OpName, P2POp, ReduceOp};

fn candle(ctx: &OpCtx) -> impl Fn(candle_core::Error) -> CommError + '_ {
    move |e| CommError::candle(ctx, e)
}

fn input_of<'a>(ctx: &OpCtx, posts: &'a [Post], r: usize) -> Result<&'a Tensor> {
    posts[r]
        .input
        .as_ref()
        .ok_or_else(|| CommError::invalid(ctx, format!("rank {r} posted no input")))
}

/// `t` on `dev`, without a copy when it already is (for reading).
fn on(ctx: &OpCtx, t: &Tensor, dev: &Device) -> Result<Tensor> {
    t.to_device(dev).map_err(candle(ctx))
}

/// A copy of `t` on `dev` that shares no storage with `t`.
fn own_copy(ctx: &OpCtx, t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.elem_count() == 0 {
        return empty(ctx, t.shape(), t.dtype(), t);
    }
    if t.device().same_device(dev) {
        t.copy().map_err(candle(ctx))
    } else {
        t.to_device(dev).map_err(candle(ctx))
    }
}

/// A zero-element tensor of `shape` that allocates nothing (a view of `like`).
fn empty(ctx: &OpCtx, shape: &Shape, dtype: DType, like: &Tensor) -> Result<Tensor> {
    debug_assert_eq!(shape.elem_count(), 0);
    debug_assert_eq!(dtype, like.dtype());
    like.flatten_all()
        .and_then(|t| t.narrow(0, 0, 0))
        .and_then(|t| t.reshape(shape.clone()))
        .map_err(candle(ctx))
}

/// `[d0, ..]` as is, a scalar as `[1]`.
fn at_least_1d(ctx: &OpCtx, t: &Tensor) -> Result<Tensor> {
    if t.rank() == 0 {
        t.reshape(1).map_err(candle(ctx))
    } else {
        Ok(t.clone())
    }
}

/// Reduces `ts` (same shape and dtype, on one device) in rank order.
fn reduce_tensors(ctx: &OpCtx, ts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let dtype = ts[0].dtype();
    let half = matches!(dtype, DType::BF16 | DType::F16);
    let up = |t: &Tensor| {
        if half {
            t.to_dtype(DType::F32)
        } else {
            Ok(t.clone())
        }
    };
    let mut acc = up(&ts[0]).map_err(candle(ctx))?;
    for t in &ts[1..] {
        let t = up(t).map_err(candle(ctx))?;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.add(&t),
            ReduceOp::Product => acc.mul(&t),
            ReduceOp::Max => acc.maximum(&t),
            ReduceOp::Min => acc.minimum(&t),
        }
        .map_err(candle(ctx))?;
    }
    if op == ReduceOp::Avg {
        let n = Tensor::new(ts.len() as f64, acc.device())
            .and_then(|n| n.to_dtype(acc.dtype()))
            .map_err(candle(ctx))?;
        acc = acc.broadcast_div(&n).map_err(candle(ctx))?;
    }
    if half {
        acc = acc.to_dtype(dtype).map_err(candle(ctx))?;
    } else if ts.len() == 1 && op != ReduceOp::Avg {
        // A world of one: the result must not share the input's storage.
        acc = acc.copy().map_err(candle(ctx))?;
    }
    Ok(acc)
}

fn sync(ctx: &OpCtx, dev: &Device) -> Result<()> {
    dev.synchronize().map_err(candle(ctx))
}

/// The protocol every CUDA collective follows: post, arrive, compute from the posts on this
/// rank's stream, synchronize it, depart once every rank has. `dev` is this rank's device.
fn exchange<R>(
    e: &Exec,
    dev: &Device,
    desc: OpDesc,
    post: Post,
    compute: impl FnOnce(&[Post]) -> Result<R>,
) -> Result<R> {
    let posts = e.arrive(desc, post)?;
    let out = compute(&posts).and_then(|r| sync(e.ctx, dev).map(|()| r));
    drop(posts);
    let departed = e.depart(true);
    let out = out?;
    departed?;
    Ok(out)
}

fn post(t: &Tensor) -> Post {
    Post {
        input: Some(t.clone()),
        ..Post::default()
    }
}

/// Writes `result` into the caller's `output` (after the departure, so it may alias the input).
fn deliver(ctx: &OpCtx, result: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let Some(out) = output else {
        return Ok(result);
    };
    if out.elem_count() != result.elem_count() || out.dtype() != result.dtype() {
        return Err(CommError::invalid(
            ctx,
            format!(
                "output is {:?} {:?} but the result is {:?} {:?}",
                out.dims(),
                out.dtype(),
                result.dims(),
                result.dtype()
            ),
        ));
    }
    if out.elem_count() > 0 {
        // Both flattened: `slice_set` needs a dim 0, which a scalar (a loss, a grad norm) lacks.
        // The front checked that `out` is contiguous, so its flattened view shares its storage.
        let dst = out.flatten_all().map_err(candle(ctx))?;
        let src = result.flatten_all().map_err(candle(ctx))?;
        dst.slice_set(&src, 0, 0).map_err(candle(ctx))?;
        sync(ctx, out.device())?;
    }
    Ok(out)
}

/// Runs `op` on CUDA tensors (`AllToAllVRows` normally arrives gathered: the backend gathers
/// the rows on the GPU before queuing the exchange).
pub(crate) fn run(e: &Exec, op: Collective, dev: &Device) -> Result<CollectiveOutput> {
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
        rows @ Collective::AllToAllVRows { .. } => return run(e, rows.gather_rows(e.ctx)?, dev),
        Collective::Broadcast { tensor, root } => broadcast(e, tensor, root)?.into(),
        Collective::Reduce { input, root, op } => reduce(e, input, root, op)?.into(),
        Collective::Gather { input, root } => gather(e, input, root)?.into(),
        Collective::Scatter { inputs, root } => scatter(e, inputs, root, dev)?.into(),
        Collective::Barrier => barrier(e)?.into(),
        Collective::BatchP2p { ops } => batch_p2p(e, ops, dev)?.into(),
    })
}

pub(crate) fn all_reduce(
    e: &Exec,
    input: Tensor,
    op: ReduceOp,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let desc = OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::AllReduce, &input)
    };
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            return empty(ctx, input.shape(), input.dtype(), &input);
        }
        let ts = (0..posts.len())
            .map(|r| on(ctx, input_of(ctx, posts, r)?, &dev))
            .collect::<Result<Vec<_>>>()?;
        reduce_tensors(ctx, &ts, op)
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn all_gather(e: &Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let n = e.group.size();
    let mut dims = input.dims().to_vec();
    match dims.first_mut() {
        Some(d0) => *d0 *= n,
        None => dims.push(n),
    }
    let desc = OpDesc::tensor(OpName::AllGatherSingle, &input);
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            return empty(ctx, &Shape::from_dims(&dims), input.dtype(), &input);
        }
        let ts = (0..n)
            .map(|r| on(ctx, &at_least_1d(ctx, input_of(ctx, posts, r)?)?, &dev))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&ts, 0).map_err(candle(ctx))
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn reduce_scatter(
    e: &Exec,
    input: Tensor,
    op: ReduceOp,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let n = e.group.size();
    let rank = e.rank;
    let chunk = input.dims()[0] / n;
    let desc = OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::ReduceScatterSingle, &input)
    };
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            let mut dims = input.dims().to_vec();
            dims[0] = chunk;
            return empty(ctx, &Shape::from_dims(&dims), input.dtype(), &input);
        }
        let ts = (0..n)
            .map(|r| {
                let t = input_of(ctx, posts, r)?
                    .narrow(0, rank * chunk, chunk)
                    .map_err(candle(ctx))?;
                on(ctx, &t, &dev)
            })
            .collect::<Result<Vec<_>>>()?;
        reduce_tensors(ctx, &ts, op)
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn all_to_all(e: &Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let n = e.group.size();
    let rank = e.rank;
    let chunk = input.dims()[0] / n;
    let desc = OpDesc::tensor(OpName::AllToAllSingle, &input);
    let r = exchange(e, &dev, desc, post(&input), |posts| {
        if input.elem_count() == 0 {
            return empty(ctx, input.shape(), input.dtype(), &input);
        }
        let ts = (0..n)
            .map(|j| {
                let t = input_of(ctx, posts, j)?
                    .narrow(0, rank * chunk, chunk)
                    .map_err(candle(ctx))?;
                on(ctx, &t, &dev)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&ts, 0).map_err(candle(ctx))
    })?;
    deliver(ctx, r, output)
}

pub(crate) fn all_to_all_v(
    e: &Exec,
    input: Tensor,
    out_splits: Vec<usize>,
    in_splits: Vec<usize>,
) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let input = at_least_1d(ctx, &input)?;
    let rows: Vec<usize> = input.dims().iter().skip(1).copied().collect();
    let desc = OpDesc {
        rule: ShapeRule::Rows,
        ..OpDesc::tensor(OpName::AllToAllVSingle, &input)
    };
    let p = Post {
        input: Some(input.clone()),
        splits: Some((out_splits.clone(), in_splits)),
        ..Post::default()
    };
    let total: usize = out_splits.iter().sum();
    let mut out_dims = vec![total];
    out_dims.extend(rows);
    exchange(e, &dev, desc, p, |posts| {
        e.group.check_split_sizes(ctx, e.coll, posts)?;
        let shape = Shape::from_dims(&out_dims);
        if shape.elem_count() == 0 {
            return empty(ctx, &shape, input.dtype(), &input);
        }
        let mut ts = Vec::new();
        for (j, p) in posts.iter().enumerate() {
            let len = out_splits[j];
            if len == 0 {
                continue;
            }
            let splits = p.splits.as_ref().map(|s| &s.1[..]).unwrap_or(&[]);
            let start: usize = splits[..e.rank].iter().sum();
            let t = input_of(ctx, posts, j)?
                .narrow(0, start, len)
                .map_err(candle(ctx))?;
            ts.push(on(ctx, &t, &dev)?);
        }
        Tensor::cat(&ts, 0).map_err(candle(ctx))
    })
}

pub(crate) fn broadcast(e: &Exec, tensor: Tensor, root: usize) -> Result<Tensor> {
    let ctx = e.ctx;
    let dev = tensor.device().clone();
    let desc = OpDesc {
        root: Some(root),
        ..OpDesc::tensor(OpName::Broadcast, &tensor)
    };
    let mine = if e.rank == root {
        post(&tensor)
    } else {
        Post::default()
    };
    let is_root = e.rank == root;
    exchange(e, &dev, desc, mine, |posts| {
        if is_root {
            return Ok(tensor.clone());
        }
        own_copy(ctx, input_of(ctx, posts, root)?, &dev)
    })
}

pub(crate) fn reduce(e: &Exec, input: Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let desc = OpDesc {
        root: Some(root),
        reduce: Some(op),
        ..OpDesc::tensor(OpName::Reduce, &input)
    };
    let is_root = e.rank == root;
    exchange(e, &dev, desc, post(&input), |posts| {
        if !is_root {
            return Ok(None);
        }
        if input.elem_count() == 0 {
            return empty(ctx, input.shape(), input.dtype(), &input).map(Some);
        }
        let ts = (0..posts.len())
            .map(|r| on(ctx, input_of(ctx, posts, r)?, &dev))
            .collect::<Result<Vec<_>>>()?;
        reduce_tensors(ctx, &ts, op).map(Some)
    })
}

pub(crate) fn gather(e: &Exec, input: Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
    let ctx = e.ctx;
    let dev = input.device().clone();
    let desc = OpDesc {
        root: Some(root),
        rule: ShapeRule::Any,
        ..OpDesc::tensor(OpName::Gather, &input)
    };
    let is_root = e.rank == root;
    exchange(e, &dev, desc, post(&input), |posts| {
        if !is_root {
            return Ok(None);
        }
        (0..posts.len())
            .map(|r| own_copy(ctx, input_of(ctx, posts, r)?, &dev))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    })
}

pub(crate) fn scatter(e: &Exec, inputs: Vec<Tensor>, root: usize, dev: &Device) -> Result<Tensor> {
    let ctx = e.ctx;
    let desc = OpDesc {
        root: Some(root),
        ..OpDesc::new(OpName::Scatter)
    };
    let mine = if e.rank == root {
        Post {
            inputs,
            ..Post::default()
        }
    } else {
        Post::default()
    };
    let rank = e.rank;
    exchange(e, dev, desc, mine, |posts| {
        let src = posts[root].inputs.get(rank).ok_or_else(|| {
            CommError::invalid(ctx, format!("root {root} posted no piece for rank {rank}"))
        })?;
        own_copy(ctx, src, dev)
    })
}

pub(crate) fn batch_p2p(e: &Exec, ops: Vec<P2POp>, dev: &Device) -> Result<Vec<Tensor>> {
    let ctx = e.ctx;
    if let Some(f) = e.group.failure() {
        return Err(f.to_error(ctx, None));
    }
    // Sends are detached copies (the sender never waits), complete before they are posted.
    let mut sends = Vec::new();
    for op in &ops {
        if let P2POp::Send { tensor, peer } = op {
            sends.push((*peer, own_copy(ctx, tensor, tensor.device())?));
        }
    }
    if !sends.is_empty() {
        sync(ctx, dev)?;
    }
    for (peer, copy) in sends {
        e.group.post_message(e.rank, peer, Message { tensor: copy });
    }
    let mut received = Vec::new();
    for op in ops {
        if let P2POp::Recv { peer, shape, dtype } = op {
            let m = e.group.take_message(ctx, peer, e.rank, e.deadline)?;
            check_recv(
                peer,
                (shape.dims(), dtype),
                (m.tensor.dims(), m.tensor.dtype()),
            )
            .map_err(|e| CommError::invalid(ctx, e))?;
            // The message is a detached copy nobody else holds: moved, not copied, when it is
            // already on this device.
            received.push(on(ctx, &m.tensor, dev)?);
        }
    }
    if !received.is_empty() {
        sync(ctx, dev)?;
    }
    Ok(received)
}
