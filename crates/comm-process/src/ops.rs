//! The collectives of the process backend. Each op first announces its descriptor to every
//! peer (HELLO: desync detection, and the arrival record that names missing ranks on a
//! timeout), then moves data, and ends by making sure every peer announced it (so an op
//! completes only once every rank has reached it, as in the local backend).
//!
//! Algorithms (n ranks, S bytes per rank):
//!
//! - `all_reduce`: up to 64 KiB, every rank sends its input to every peer and reduces all n
//!   inputs (one step). Above, a pairwise reduce-scatter (rank r receives chunk r of every
//!   input and reduces it) followed by a ring all-gather of the reduced chunks (n - 1 steps):
//!   2(n-1)/n S sent per rank, as the ring all-reduce.
//! - `reduce_scatter_single`: pairwise (chunk j to rank j), (n-1)/n S per rank.
//! - `all_gather_single`: ring, n - 1 steps, (n-1) S per rank.
//! - `all_to_all_single` / `_v`: pairwise; `_v` first exchanges every rank's split sizes so all
//!   ranks check every (sender, receiver) pair and agree on the verdict.
//! - `broadcast`: binomial tree from the root (ceil(log2 n) steps).
//! - `reduce`, `gather`: direct to the root; `scatter`: direct from the root.
//!
//! Every reduction combines the ranks' values in rank order 0, 1, ..., n-1 with the local
//! backend's kernel, so every rank, and the local backend, get the same bits for the same
//! inputs (a pairwise reduce-scatter rather than a ring one keeps that order: the bytes on the
//! wire are the same, n-1 concurrent transfers instead of n-1 sequential steps).

use std::net::SocketAddr;

use candle_core::{DType, Shape, Tensor};

use super::frame::{decode_tensor, decode_usizes, encode_usizes, tensor_preamble, Payload};
use super::transport::Exec;
use candle_dtensor_comm_core::kit::cpu::kernels::{detached_copy, read_view, OutBuf};
use candle_dtensor_comm_core::kit::cpu::{
    candle_err, deliver, produce, put_bytes as put, reduced, view_err, EAGER_BYTES,
};
use candle_dtensor_comm_core::kit::desc::{
    check_recv, check_split_lists, check_split_sizes, Failure, OpDesc, ShapeRule,
};
use candle_dtensor_comm_core::{Collective, CollectiveOutput};
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, OpName, P2POp, ReduceOp};

fn peers(x: &Exec) -> impl Iterator<Item = usize> {
    let (me, n) = (x.t.rank, x.t.size);
    (0..n).filter(move |&p| p != me)
}

/// A new CPU tensor holding a copy of `bytes`.
fn tensor_from(ctx: &OpCtx, dtype: DType, dims: &[usize], bytes: &[u8]) -> Result<Tensor> {
    let shape = Shape::from_dims(dims);
    let want = shape.elem_count() * dtype.size_in_bytes();
    if bytes.len() != want {
        return Err(CommError::invalid(
            ctx,
            format!(
                "received {} bytes for a {dims:?} {dtype:?} tensor ({want} bytes)",
                bytes.len()
            ),
        ));
    }
    let out = OutBuf::new(dtype, shape.elem_count()).map_err(view_err(ctx))?;
    // SAFETY: the buffer holds exactly `bytes.len()` bytes and is private to this thread; after
    // the write every byte is initialised.
    unsafe {
        out.write(0, bytes);
        out.into_tensor(shape)
    }
    .map_err(candle_err(ctx))
}

/// Sends bytes `range(p)` of `input` to every peer `p` (DATA step 0), receives this rank's range
/// from every peer, and reduces the n pieces in rank order into a fresh buffer (the read view of
/// the input is gone when it returns).
fn reduce_exchange(
    x: &Exec,
    input: &Tensor,
    op: ReduceOp,
    range: impl Fn(usize) -> std::ops::Range<usize>,
) -> Result<OutBuf> {
    let (me, n, dtype) = (x.t.rank, x.t.size, input.dtype());
    let v = read_view(input).map_err(view_err(x.ctx))?;
    let b = v.bytes();
    for p in peers(x) {
        x.send(p, 0, &[&b[range(p)]])?;
    }
    let mine = range(me);
    let mut got: Vec<Option<Payload>> = (0..n).map(|_| None).collect();
    for p in peers(x) {
        got[p] = Some(x.recv_exact(p, 0, mine.len())?);
    }
    let srcs: Vec<&[u8]> = got
        .iter()
        .map(|g| g.as_ref().map_or(&b[mine.clone()], Payload::bytes))
        .collect();
    reduced(x.ctx, dtype, op, &srcs, mine.len() / dtype.size_in_bytes())
}

/// Runs `op` on the progress thread (`AllToAllVRows` arrives gathered).
pub(crate) fn run(x: &mut Exec, op: Collective) -> Result<CollectiveOutput> {
    Ok(match op {
        Collective::AllReduce { input, op, output } => all_reduce(x, input, op, output)?.into(),
        Collective::AllGather { input, output } => all_gather(x, input, output)?.into(),
        Collective::ReduceScatter { input, op, output } => {
            reduce_scatter(x, input, op, output)?.into()
        }
        Collective::AllToAll { input, output } => all_to_all(x, input, output)?.into(),
        Collective::AllToAllV {
            input,
            output_split_sizes: o,
            input_split_sizes: i,
        } => all_to_all_v(x, input, o, i)?.into(),
        rows @ Collective::AllToAllVRows { .. } => return run(x, rows.gather_rows(x.ctx)?),
        Collective::Broadcast { tensor, root } => broadcast(x, tensor, root)?.into(),
        Collective::Reduce { input, root, op } => reduce(x, input, root, op)?.into(),
        Collective::Gather { input, root } => gather(x, input, root)?.into(),
        Collective::Scatter { inputs, root } => scatter(x, inputs, root)?.into(),
        Collective::Barrier => barrier(x)?.into(),
        Collective::BatchP2p { ops } => batch_p2p(x, ops)?.into(),
    })
}

pub(crate) fn all_reduce(
    x: &mut Exec,
    input: Tensor,
    op: ReduceOp,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    x.hello(OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::AllReduce, &input)
    })?;
    let (dtype, elems, es) = (
        input.dtype(),
        input.elem_count(),
        input.dtype().size_in_bytes(),
    );
    let shape = input.shape().clone();
    if n == 1 || elems * es <= EAGER_BYTES {
        let red = reduce_exchange(x, &input, op, |_| 0..elems * es)?;
        // SAFETY: `reduced` wrote every element; the input is no longer read (it may be the
        // output).
        let out = unsafe { deliver(ctx, red, shape, output) }?;
        x.t.wait_hellos(x)?;
        return Ok(out);
    }
    let chunk = elems.div_ceil(n);
    let range = |r: usize| (r * chunk).min(elems) * es..((r + 1) * chunk).min(elems) * es;
    // Reduce-scatter: chunk p of the input goes to rank p, which reduces it in rank order.
    let part = reduce_exchange(x, &input, op, range)?;
    // Ring all-gather of the reduced chunks, straight into the output (the input is no longer
    // read, so the output may be the input itself).
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let out = produce(ctx, output, dtype, shape, |dst| {
        // SAFETY: chunk `me` lies within the output, which only this thread writes; `part` was
        // fully written by `reduced`.
        unsafe { put(dst, range(me).start, part.written()) };
        for s in 0..n - 1 {
            let (send_idx, recv_idx) = ((me + n - s) % n, (me + n - s - 1) % n);
            let r = range(send_idx);
            // SAFETY: chunk `send_idx` was written before (our own, or received at step s-1).
            let src = unsafe { std::slice::from_raw_parts(dst.add(r.start), r.len()) };
            x.send(right, 1 + s as u32, &[src])?;
            let r = range(recv_idx);
            let got = x.recv_exact(left, 1 + s as u32, r.len())?;
            // SAFETY: chunk `recv_idx` lies within the output.
            unsafe { put(dst, r.start, got.bytes()) };
        }
        Ok(())
    })?;
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn all_gather(x: &mut Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    x.hello(OpDesc::tensor(OpName::AllGatherSingle, &input))?;
    let piece = input.elem_count() * input.dtype().size_in_bytes();
    let mut dims = input.dims().to_vec();
    match dims.first_mut() {
        Some(d0) => *d0 *= n,
        None => dims.push(n),
    }
    // A copy of our piece: no read lock on the input may be held while the output is written.
    let own = Payload::copy_of(read_view(&input).map_err(view_err(ctx))?.bytes());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let out = produce(ctx, output, input.dtype(), Shape::from_dims(&dims), |dst| {
        // SAFETY: piece `me` lies within the n-piece output, which only this thread writes.
        unsafe { put(dst, me * piece, own.bytes()) };
        for s in 0..n.saturating_sub(1) {
            let (send_idx, recv_idx) = ((me + n - s) % n, (me + n - s - 1) % n);
            // SAFETY: piece `send_idx` was written before (our own, or received at step s-1).
            let src = unsafe { std::slice::from_raw_parts(dst.add(send_idx * piece), piece) };
            x.send(right, s as u32, &[src])?;
            let got = x.recv_exact(left, s as u32, piece)?;
            // SAFETY: piece `recv_idx` lies within the output.
            unsafe { put(dst, recv_idx * piece, got.bytes()) };
        }
        Ok(())
    })?;
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn reduce_scatter(
    x: &mut Exec,
    input: Tensor,
    op: ReduceOp,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let (ctx, n) = (x.ctx, x.t.size);
    x.hello(OpDesc {
        reduce: Some(op),
        ..OpDesc::tensor(OpName::ReduceScatterSingle, &input)
    })?;
    let cb = input.elem_count() / n * input.dtype().size_in_bytes();
    let mut dims = input.dims().to_vec();
    dims[0] /= n;
    let red = reduce_exchange(x, &input, op, |p| p * cb..(p + 1) * cb)?;
    // SAFETY: `reduced` wrote every element.
    let out = unsafe { deliver(ctx, red, Shape::from_dims(&dims), output) }?;
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn all_to_all(x: &mut Exec, input: Tensor, output: Option<Tensor>) -> Result<Tensor> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    x.hello(OpDesc::tensor(OpName::AllToAllSingle, &input))?;
    let cb = input.elem_count() / n * input.dtype().size_in_bytes();
    let mut got: Vec<Option<Payload>> = (0..n).map(|_| None).collect();
    {
        let v = read_view(&input).map_err(view_err(ctx))?;
        let b = v.bytes();
        for p in peers(x) {
            x.send(p, 0, &[&b[p * cb..(p + 1) * cb]])?;
        }
        got[me] = Some(Payload::copy_of(&b[me * cb..(me + 1) * cb]));
    }
    for p in peers(x) {
        got[p] = Some(x.recv_exact(p, 0, cb)?);
    }
    let out = produce(ctx, output, input.dtype(), input.shape().clone(), |dst| {
        for (j, g) in got.iter().enumerate() {
            if let Some(g) = g {
                // SAFETY: chunk j lies within the output, exclusively ours.
                unsafe { put(dst, j * cb, g.bytes()) };
            }
        }
        Ok(())
    })?;
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn all_to_all_v(
    x: &mut Exec,
    input: Tensor,
    out_splits: Vec<usize>,
    in_splits: Vec<usize>,
) -> Result<Tensor> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    let rows: Vec<usize> = input.dims().iter().skip(1).copied().collect();
    x.hello(OpDesc {
        rule: ShapeRule::Rows,
        ..OpDesc::tensor(OpName::AllToAllVSingle, &input)
    })?;
    let row_bytes = rows.iter().product::<usize>() * input.dtype().size_in_bytes();
    // Step 0: every rank learns every rank's split sizes, so all reach the same verdict.
    let all = share_usizes(x, out_splits.iter().chain(&in_splits).copied().collect())?;
    if let Some((p, v)) = all.iter().enumerate().find(|(_, v)| v.len() != 2 * n) {
        return Err(CommError::invalid(
            ctx,
            format!("rank {p} sent {} split sizes, expected {}", v.len(), 2 * n),
        ));
    }
    check_split_sizes(n, |i, j| all[i][n + j], |j, i| all[j][i]).map_err(|reason| {
        let f = Failure::Mismatch {
            collective: x.coll,
            reason: reason.clone(),
        };
        x.t.fail(f, false);
        CommError::invalid(ctx, reason)
    })?;
    // Step 1: the rows.
    let offsets: Vec<usize> = in_splits
        .iter()
        .scan(0, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o * row_bytes)
        })
        .collect();
    let mut got: Vec<Option<Payload>> = (0..n).map(|_| None).collect();
    {
        let v = read_view(&input).map_err(view_err(ctx))?;
        let b = v.bytes();
        for p in peers(x) {
            x.send(
                p,
                1,
                &[&b[offsets[p]..offsets[p] + in_splits[p] * row_bytes]],
            )?;
        }
        got[me] = Some(Payload::copy_of(
            &b[offsets[me]..offsets[me] + in_splits[me] * row_bytes],
        ));
    }
    for p in peers(x) {
        got[p] = Some(x.recv_exact(p, 1, out_splits[p] * row_bytes)?);
    }
    let total: usize = out_splits.iter().sum();
    let mut out_dims = vec![total];
    out_dims.extend(rows);
    let out = produce(
        ctx,
        None,
        input.dtype(),
        Shape::from_dims(&out_dims),
        |dst| {
            let mut off = 0;
            for g in got.iter().flatten() {
                // SAFETY: the output has room for the sum of out_splits rows; written only here.
                unsafe { put(dst, off, g.bytes()) };
                off += g.len();
            }
            Ok(())
        },
    )?;
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn broadcast(x: &mut Exec, tensor: Tensor, root: usize) -> Result<Tensor> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    x.hello(OpDesc {
        root: Some(root),
        ..OpDesc::tensor(OpName::Broadcast, &tensor)
    })?;
    let bytes = tensor.elem_count() * tensor.dtype().size_in_bytes();
    let vr = (me + n - root) % n;
    let real = |v: usize| (v + root) % n;
    // Binomial tree: receive from the parent at our lowest set bit, then send to the children
    // below it.
    let mut mask = 1;
    let mut received = None;
    while mask < n {
        if vr & mask != 0 {
            received = Some(x.recv_exact(real(vr - mask), 0, bytes)?);
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    let out = match received {
        None => {
            let v = read_view(&tensor).map_err(view_err(ctx))?;
            while mask > 0 {
                if vr + mask < n {
                    x.send(real(vr + mask), 0, &[v.bytes()])?;
                }
                mask >>= 1;
            }
            tensor.clone()
        }
        Some(p) => {
            while mask > 0 {
                if vr + mask < n {
                    x.send(real(vr + mask), 0, &[p.bytes()])?;
                }
                mask >>= 1;
            }
            tensor_from(ctx, tensor.dtype(), tensor.dims(), p.bytes())?
        }
    };
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn reduce(
    x: &mut Exec,
    input: Tensor,
    root: usize,
    op: ReduceOp,
) -> Result<Option<Tensor>> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    x.hello(OpDesc {
        root: Some(root),
        reduce: Some(op),
        ..OpDesc::tensor(OpName::Reduce, &input)
    })?;
    let (dtype, elems) = (input.dtype(), input.elem_count());
    let bytes = elems * dtype.size_in_bytes();
    let v = read_view(&input).map_err(view_err(ctx))?;
    let result = if me != root {
        x.send(root, 0, &[v.bytes()])?;
        None
    } else {
        let mut got: Vec<Option<Payload>> = (0..n).map(|_| None).collect();
        for p in peers(x) {
            got[p] = Some(x.recv_exact(p, 0, bytes)?);
        }
        let srcs: Vec<&[u8]> = got
            .iter()
            .map(|g| g.as_ref().map_or(v.bytes(), Payload::bytes))
            .collect();
        let red = reduced(ctx, dtype, op, &srcs, elems)?;
        // SAFETY: `reduced` wrote every element.
        Some(unsafe { red.into_tensor(input.shape().clone()) }.map_err(candle_err(ctx))?)
    };
    drop(v);
    x.t.wait_hellos(x)?;
    Ok(result)
}

pub(crate) fn gather(x: &mut Exec, input: Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
    let ctx = x.ctx;
    let (me, n) = (x.t.rank, x.t.size);
    x.hello(OpDesc {
        root: Some(root),
        rule: ShapeRule::Any,
        ..OpDesc::tensor(OpName::Gather, &input)
    })?;
    let result = if me != root {
        let pre = tensor_preamble(input.dtype(), input.dims()).map_err(view_err(ctx))?;
        let v = read_view(&input).map_err(view_err(ctx))?;
        x.send(root, 0, &[&pre, v.bytes()])?;
        None
    } else {
        let mut out = Vec::with_capacity(n);
        for r in 0..n {
            if r == me {
                out.push(detached_copy(&input).map_err(view_err(ctx))?);
            } else {
                let p = x.recv(r, 0)?;
                let (dtype, dims, data) = decode_tensor(p.bytes())
                    .map_err(|e| CommError::invalid(ctx, format!("from rank {r}: {e}")))?;
                out.push(tensor_from(ctx, dtype, &dims, data)?);
            }
        }
        Some(out)
    };
    x.t.wait_hellos(x)?;
    Ok(result)
}

pub(crate) fn scatter(x: &mut Exec, inputs: Vec<Tensor>, root: usize) -> Result<Tensor> {
    let ctx = x.ctx;
    let me = x.t.rank;
    x.hello(OpDesc {
        root: Some(root),
        ..OpDesc::new(OpName::Scatter)
    })?;
    let out = if me == root {
        for (r, t) in inputs.iter().enumerate() {
            if r != me {
                let pre = tensor_preamble(t.dtype(), t.dims()).map_err(view_err(ctx))?;
                let v = read_view(t).map_err(view_err(ctx))?;
                x.send(r, 0, &[&pre, v.bytes()])?;
            }
        }
        let own = inputs.get(me).ok_or_else(|| {
            CommError::invalid(ctx, format!("root {root} has no piece for itself"))
        })?;
        detached_copy(own).map_err(view_err(ctx))?
    } else {
        let p = x.recv(root, 0)?;
        let (dtype, dims, data) = decode_tensor(p.bytes())
            .map_err(|e| CommError::invalid(ctx, format!("from root {root}: {e}")))?;
        tensor_from(ctx, dtype, &dims, data)?
    };
    x.t.wait_hellos(x)?;
    Ok(out)
}

pub(crate) fn barrier(x: &mut Exec) -> Result<()> {
    x.hello(OpDesc::new(OpName::Barrier))?;
    x.t.wait_hellos(x)
}

pub(crate) fn batch_p2p(x: &mut Exec, ops: Vec<P2POp>) -> Result<Vec<Tensor>> {
    let ctx = x.ctx;
    // Sends never wait, so without this check they would "succeed" on a failed communicator.
    x.t.check(ctx, None)?;
    for op in &ops {
        if let P2POp::Send { tensor, peer } = op {
            let pre = tensor_preamble(tensor.dtype(), tensor.dims()).map_err(view_err(ctx))?;
            let v = read_view(tensor).map_err(view_err(ctx))?;
            x.send_p2p(*peer, &[&pre, v.bytes()])?;
        }
    }
    let mut received = Vec::new();
    for op in ops {
        if let P2POp::Recv { peer, shape, dtype } = op {
            let p = x.t.recv_p2p(x, peer)?;
            let (got_dtype, dims, data) = decode_tensor(p.bytes())
                .map_err(|e| CommError::invalid(ctx, format!("recv from rank {peer}: {e}")))?;
            check_recv(peer, (shape.dims(), dtype), (&dims, got_dtype))
                .map_err(|e| CommError::invalid(ctx, e))?;
            received.push(tensor_from(ctx, dtype, &dims, data)?);
        }
    }
    Ok(received)
}

/// Sends `mine` to every peer (DATA step 0) and returns every rank's bytes, in rank order.
fn share_bytes(x: &Exec, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    for p in peers(x) {
        x.send(p, 0, &[&mine])?;
    }
    let mut all: Vec<Vec<u8>> = vec![Vec::new(); x.t.size];
    all[x.t.rank] = mine;
    for p in peers(x) {
        all[p] = x.recv(p, 0)?.bytes().to_vec();
    }
    Ok(all)
}

/// [`share_bytes`] of a list of `u64`s.
fn share_usizes(x: &Exec, mine: Vec<usize>) -> Result<Vec<Vec<usize>>> {
    share_bytes(x, encode_usizes(&mine))?
        .iter()
        .map(|b| decode_usizes(b).map_err(view_err(x.ctx)))
        .collect()
}

/// What a rank tells its peers in a split: its list and where it listens for its new group.
#[derive(serde::Serialize, serde::Deserialize)]
struct SplitPost {
    ranks: Vec<usize>,
    addr: Option<String>,
}

/// The split step on the parent: every rank learns every rank's list (and listener address);
/// returns the verdict (the same on every rank) and, for a non-empty list, the addresses of
/// the new group's members in its order. The child connects without the store.
pub(crate) fn exchange_split_lists(
    x: &mut Exec,
    ranks: &[usize],
    addr: Option<SocketAddr>,
) -> Result<Vec<SocketAddr>> {
    x.hello(OpDesc::new(OpName::Split))?;
    let mine = SplitPost {
        ranks: ranks.to_vec(),
        addr: addr.map(|a| a.to_string()),
    };
    let enc = serde_json::to_vec(&mine).map_err(|e| CommError::invalid(x.ctx, e.to_string()))?;
    let posts: Vec<SplitPost> = share_bytes(x, enc)?
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| {
                CommError::invalid(x.ctx, format!("rank {r} sent a bad split list: {e}"))
            })
        })
        .collect::<Result<_>>()?;
    x.t.wait_hellos(x)?;
    let lists: Vec<Vec<usize>> = posts.iter().map(|p| p.ranks.clone()).collect();
    check_split_lists(&lists).map_err(|reason| CommError::invalid(x.ctx, reason))?;
    ranks
        .iter()
        .map(|&r| {
            posts[r]
                .addr
                .as_deref()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| CommError::invalid(x.ctx, format!("rank {r} sent no address")))
        })
        .collect()
}
