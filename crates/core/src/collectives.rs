//! Collectives on local pieces, as differentiable candle ops whose backward is the adjoint.
//!
//! Every function takes this rank's local piece and an [`Axis`] (the communicator of one mesh
//! dim, or of several merged dims) and handles torch.chunk padding: pieces are padded to
//! `ceil(L/n)` along the sharded dim for the collective and unpadded after. The `*_raw`
//! functions move data only (used for untracked tensors and inside backward passes); the others
//! also record a graph node ([`crate::node`]) with the adjoint as its backward:
//!
//! | forward | backward |
//! |---|---|
//! | all_gather `S->R` | chunk (or reduce_scatter when fused with a gradient sync) |
//! | reduce_scatter `P->S` | all_gather (`avg`: then divide by n) |
//! | all_reduce `P->R` | identity (`sum`), `/n` (`avg`), masked to the owners of the extreme, ties split (`max`/`min`), times the other ranks' values (`product`, one all_gather) |
//! | all_to_all `S(i)->S(j)` | all_to_all `S(j)->S(i)` |
//! | chunk `R->S` (local) | all_gather |
//! | strided all_gather `SS(d,sf)->R` | select this rank's strided rows (or strided reduce_scatter when fused) |
//! | strided select `R->SS(d,sf)` (local) | strided all_gather |
//! | partition `R->P` (local) | identity (`sum`, forward divides by n), `x n` (`avg`, `max`, `min`) |
//! | grad sync (identity) | all_reduce(sum) |

use std::sync::Arc;

use candle_core::Tensor;
use candle_dtensor_comm::{Comm, ReduceOp};
use candle_dtensor_strategies::layout::{shard_size_and_offset, strided_indices};

use crate::node::{node, Backward};
pub(crate) use crate::storage::fill_from;
use crate::storage::{copy_rows, narrow, Cut};

type CResult<T> = candle_core::Result<T>;

/// A typed refusal of this rank's piece `x` by the collective `op` over `ax`.
pub(crate) fn refuse(
    ax: &Axis,
    op: &str,
    x: &Tensor,
    reason: impl Into<String>,
) -> candle_core::Error {
    crate::error::DTensorError::Collective(Box::new(crate::error::CollectiveError {
        op: op.to_string(),
        mesh_dim: ax.name.to_string(),
        rank: ax.coord,
        size: ax.n,
        shape: x.dims().to_vec(),
        reason: reason.into(),
    }))
    .into()
}

/// Records collective `kind` of `bytes` over `ax` (with its link's modeled time) for
/// CommDebugMode; the next [`timed`] wait sets its waited time.
fn record_on(kind: &'static str, ax: &Axis, bytes: u64) {
    crate::debug::record_on(kind, &ax.comm, &ax.name, bytes)
}

/// Waits for `w`, adding the blocked time to the thread's comm-wait counter.
pub(crate) fn timed<T: Send + 'static>(w: candle_dtensor_comm::Work<T>) -> CResult<T> {
    let t0 = std::time::Instant::now();
    let r = w.wait();
    crate::debug::add_comm_wait(t0.elapsed());
    Ok(r?)
}

/// The communicator of one mesh dim (or of several merged dims) as seen by this rank.
#[derive(Clone)]
pub(crate) struct Axis {
    /// The communicator.
    pub comm: Comm,
    /// Its size.
    pub n: usize,
    /// This rank's index in it (its rank).
    pub coord: usize,
    /// The mesh dim name(s), for CommDebugMode (`dp+tp` when merged).
    pub name: Arc<str>,
}

fn elem_bytes(t: &Tensor) -> usize {
    t.dtype().size_in_bytes()
}

/// `x`'s dims with `dim` resized to `len`.
fn dims_with(x: &Tensor, dim: usize, len: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    dims[dim] = len;
    dims
}

/// `dest` (the caller's output) when there is one, else a fresh zero tensor of `dims` like `x`.
fn dest_or_zeros(dest: Option<&Tensor>, dims: &[usize], x: &Tensor) -> CResult<Tensor> {
    match dest {
        Some(d) => Ok(d.clone()),
        None => Tensor::zeros(dims, x.dtype(), x.device()),
    }
}

/// Delivers a value computed locally: copied into `dest` (and `dest` returned) when there is
/// one, else `v` itself.
fn deliver(dest: Option<&Tensor>, v: Tensor) -> CResult<Tensor> {
    match dest {
        Some(d) => {
            fill_from(d, &v)?;
            Ok(d.clone())
        }
        None => Ok(v),
    }
}

/// Records the bytes a padded collective of `n` blocks of `full` rows moves on `ax`.
fn record_blocks(kind: &'static str, ax: &Axis, full: usize, cut: &Cut, x: &Tensor) {
    let bytes = ax.n * full * cut.pre * cut.post * elem_bytes(x);
    record_on(kind, ax, bytes as u64);
}

fn check_piece(ax: &Axis, op: &str, x: &Tensor, dim: usize, expect: usize) -> CResult<Cut> {
    check_dim(ax, op, x, dim)?;
    let cut = Cut::new(x.dims(), dim);
    if cut.len != expect {
        return Err(refuse(
            ax,
            op,
            x,
            format!("{} rows on dim {dim}, expected {expect}", cut.len),
        ));
    }
    Ok(cut)
}

/// `dest` unless it is empty: an empty tensor needs no filling, and the communicators refuse to
/// write into one (its contiguous strides contain zeros).
fn writable(dest: Option<&Tensor>) -> Option<&Tensor> {
    dest.filter(|d| d.elem_count() > 0)
}

/// `S(dim) -> R` data path: every rank's piece of a dim of logical length `l`, concatenated.
pub(crate) fn gather_raw(
    x: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    dest: Option<&Tensor>,
) -> CResult<Tensor> {
    let dest = writable(dest);
    let n = ax.n;
    let (me, _) = shard_size_and_offset(l, n, ax.coord);
    let cut = check_piece(ax, "all_gather", x, dim, me)?;
    let full = l.div_ceil(n.max(1));
    let out_dims = dims_with(x, dim, l);
    record_blocks("all_gather", ax, full, &cut, x);
    let x = x.contiguous()?;
    let send = if me == full {
        x.flatten_all()?
    } else {
        let buf = Tensor::zeros(cut.pre * full * cut.post, x.dtype(), x.device())?;
        copy_rows(&x, me, 0, &buf, full, 0, cut.pre, me, cut.post)?;
        buf
    };
    if cut.pre == 1 && l % n == 0 {
        return match dest {
            Some(d) => {
                timed(ax.comm.all_gather_single_into(&d.flatten_all()?, &send)?)?;
                Ok(d.clone())
            }
            None => timed(ax.comm.all_gather_single(&send)?)?.reshape(out_dims),
        };
    }
    let g = timed(ax.comm.all_gather_single(&send)?)?;
    if l % n == 0 && dest.is_none() {
        // Even pieces behind outer dims: the gathered `[n, pre, piece]` with its first two
        // dims swapped is the result; one strided copy into fresh memory, no zero-filled
        // buffer to copy the pieces into (that was a third pass over the whole output).
        let g = g.reshape((n, cut.pre, full * cut.post))?;
        return g.transpose(0, 1)?.contiguous()?.reshape(out_dims);
    }
    let out = dest_or_zeros(dest, &out_dims, &x)?;
    let block = cut.pre * full * cut.post;
    let g = g.flatten_all()?;
    for r in 0..n {
        let (s, off) = shard_size_and_offset(l, n, r);
        copy_rows(
            &g.narrow(0, r * block, block)?,
            full,
            0,
            &out,
            l,
            off,
            cut.pre,
            s,
            cut.post,
        )?;
    }
    Ok(out)
}

/// `P -> S(dim)` data path: reduce over ranks and keep this rank's piece of dim `dim`
/// (logical length `l`).
pub(crate) fn reduce_scatter_raw(
    x: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    op: ReduceOp,
    dest: Option<&Tensor>,
) -> CResult<Tensor> {
    let dest = writable(dest);
    let n = ax.n;
    let cut = check_piece(ax, "reduce_scatter", x, dim, l)?;
    let full = l.div_ceil(n.max(1));
    let (me, _) = shard_size_and_offset(l, n, ax.coord);
    let out_dims = dims_with(x, dim, me);
    record_blocks("reduce_scatter", ax, full, &cut, x);
    let x = x.contiguous()?;
    let send = if cut.pre == 1 && l % n == 0 {
        x.flatten_all()?
    } else {
        let buf = Tensor::zeros(n * cut.pre * full * cut.post, x.dtype(), x.device())?;
        let block = cut.pre * full * cut.post;
        for r in 0..n {
            let (s, off) = shard_size_and_offset(l, n, r);
            copy_rows(
                &x,
                l,
                off,
                &buf.narrow(0, r * block, block)?,
                full,
                0,
                cut.pre,
                s,
                cut.post,
            )?;
        }
        buf
    };
    if me == full {
        return match dest {
            Some(d) => {
                timed(
                    ax.comm
                        .reduce_scatter_single_into(&d.flatten_all()?, &send, op)?,
                )?;
                Ok(d.clone())
            }
            None => timed(ax.comm.reduce_scatter_single(&send, op)?)?.reshape(out_dims),
        };
    }
    let recv = timed(ax.comm.reduce_scatter_single(&send, op)?)?;
    let out = dest_or_zeros(dest, &out_dims, &x)?;
    copy_rows(&recv, full, 0, &out, me, 0, cut.pre, me, cut.post)?;
    Ok(out)
}

/// `P -> R` data path.
pub(crate) fn all_reduce_raw(
    x: &Tensor,
    ax: &Axis,
    op: ReduceOp,
    dest: Option<&Tensor>,
) -> CResult<Tensor> {
    let dest = writable(dest);
    record_on("all_reduce", ax, (x.elem_count() * elem_bytes(x)) as u64);
    let x = x.contiguous()?;
    match dest {
        Some(d) => Ok(timed(ax.comm.all_reduce_into(d, &x, op)?)?),
        None => Ok(timed(ax.comm.all_reduce(&x, op)?)?),
    }
}

/// Runs of at least this many bytes are read in place by an all-to-all of rows.
const IN_PLACE_RUN_BYTES: usize = 1024;

/// An all-to-all send buffer as rows that each belong to one destination.
struct Runs {
    /// The input viewed as `[outer * n, run]`.
    rows: Tensor,
    /// Row ids ordered by destination.
    ids: Arc<Vec<u32>>,
    /// Rows each destination gets.
    per_rank: usize,
}

/// `x` (all of dim `j`, divisible by `n`) as [`Runs`]: `run` is one destination's part of dim
/// `j` times everything after it, rank `r`'s rows are `o * n + r` for every outer index `o`.
/// `None` when the runs are too short to read one by one (then packing is cheaper).
fn send_runs(x: &Tensor, j: usize, n: usize) -> CResult<Option<Runs>> {
    let dims = x.dims();
    let run: usize = dims[j] / n * dims[j + 1..].iter().product::<usize>();
    let outer: usize = dims[..j].iter().product();
    if run * elem_bytes(x) < IN_PLACE_RUN_BYTES || outer * n > u32::MAX as usize {
        return Ok(None);
    }
    let ids = (0..n)
        .flat_map(|r| (0..outer).map(move |o| (o * n + r) as u32))
        .collect::<Vec<_>>();
    Ok(Some(Runs {
        rows: x.contiguous()?.reshape((outer * n, run))?,
        ids: Arc::new(ids),
        per_rank: outer,
    }))
}

/// `S(i) -> S(j)` data path: `x` holds this rank's piece of dim `i` (logical `li`) and all of
/// dim `j` (logical `lj`); the result holds all of dim `i` and this rank's piece of dim `j`.
pub(crate) fn all_to_all_raw(
    x: &Tensor,
    ax: &Axis,
    i: usize,
    j: usize,
    li: usize,
    lj: usize,
    dest: Option<&Tensor>,
) -> CResult<Tensor> {
    let n = ax.n;
    let (me_i, _) = shard_size_and_offset(li, n, ax.coord);
    check_piece(ax, "all_to_all", x, i, me_i)?;
    check_piece(ax, "all_to_all", x, j, lj)?;
    let (full_i, full_j) = (li.div_ceil(n.max(1)), lj.div_ceil(n.max(1)));
    // Even pieces and nothing but size-1 dims before `i`: the received chunks, in rank order,
    // already are the result's memory (rank r's rows follow rank r-1's), so the only local
    // copy is packing the send buffer (the backend's all_to_all takes contiguous chunks), and
    // not even that where each destination's runs are long enough to be read in place.
    if li % n == 0 && lj % n == 0 && x.dims()[..i].iter().all(|&d| d == 1) {
        let dest = writable(dest);
        let mut out_dims = x.dims().to_vec();
        out_dims[i] = li;
        out_dims[j] = full_j;
        // Long runs per destination: let the backend read them in place instead of packing
        // (a strided copy of the whole piece that cost twice the exchange itself, measured).
        let runs = match dest {
            None => send_runs(x, j, n)?,
            Some(_) => None,
        };
        if let Some(runs) = runs {
            record_on("all_to_all", ax, (x.elem_count() * elem_bytes(x)) as u64);
            let splits = vec![runs.per_rank; n];
            let recv = ax
                .comm
                .all_to_all_v_rows(&runs.rows, &runs.ids, &splits, &splits)?;
            let recv = timed(recv)?;
            return recv.reshape(out_dims);
        }
        let chunks = (0..n)
            .map(|r| narrow(x, j, r * full_j, full_j))
            .collect::<CResult<Vec<_>>>()?;
        let send = Tensor::stack(&chunks, 0)?.flatten_all()?;
        record_on(
            "all_to_all",
            ax,
            (send.elem_count() * elem_bytes(&send)) as u64,
        );
        return match dest {
            Some(d) => {
                timed(ax.comm.all_to_all_single_into(&d.flatten_all()?, &send)?)?;
                Ok(d.clone())
            }
            None => timed(ax.comm.all_to_all_single(&send)?)?.reshape(out_dims),
        };
    }
    let pad = |t: Tensor, d: usize, to: usize| -> CResult<Tensor> {
        let have = t.dim(d)?;
        if have == to {
            return Ok(t);
        }
        let mut zd = t.dims().to_vec();
        zd[d] = to - have;
        let z = Tensor::zeros(zd, t.dtype(), t.device())?;
        Tensor::cat(&[&t, &z], d)
    };
    let x = pad(pad(x.clone(), j, n * full_j)?, i, full_i)?;
    let chunks = (0..n)
        .map(|r| narrow(&x, j, r * full_j, full_j))
        .collect::<CResult<Vec<_>>>()?;
    let send = Tensor::stack(&chunks, 0)?.contiguous()?;
    let piece_dims = send.dims()[1..].to_vec();
    record_on(
        "all_to_all",
        ax,
        (send.elem_count() * elem_bytes(&send)) as u64,
    );
    let recv = timed(ax.comm.all_to_all_single(&send.flatten_all()?)?)?;
    let recv = recv.reshape([&[n][..], &piece_dims[..]].concat())?;
    let parts = (0..n)
        .map(|r| {
            let (s, _) = shard_size_and_offset(li, n, r);
            narrow(&recv.get(r)?, i, 0, s)
        })
        .collect::<CResult<Vec<_>>>()?;
    let (me_j, _) = shard_size_and_offset(lj, n, ax.coord);
    let out = narrow(&Tensor::cat(&parts, i)?, j, 0, me_j)?.contiguous()?;
    match dest {
        Some(d) => {
            fill_from(d, &out)?;
            Ok(d.clone())
        }
        None => Ok(out),
    }
}

/// Records a node for `x` with `backward` when `x` tracks gradients, then produces the data
/// (into the node's output); untracked inputs get the plain data path.
fn emit(
    x: &Tensor,
    name: &'static str,
    out_dims: &[usize],
    backward: impl Fn(&Tensor, &Tensor, &Tensor) -> CResult<Tensor> + Send + Sync + 'static,
    produce: impl FnOnce(Option<&Tensor>) -> CResult<Tensor>,
) -> CResult<Tensor> {
    if !x.track_op() {
        return produce(None);
    }
    let bwd: Backward = Arc::new(backward);
    let y = node(x, name, out_dims, bwd)?;
    produce(Some(&y))?;
    Ok(y)
}

/// What the backward of an all_gather does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GatherGrad {
    /// The gradient arriving is replicated: keep this rank's chunk.
    Chunk,
    /// The gradient arriving is a per-rank partial sum (the gathered value fed an op whose
    /// output is sharded or partial on this mesh dim): reduce_scatter it.
    ReduceScatter,
}

/// Differentiable `S(dim) -> R`.
pub(crate) fn all_gather(
    x: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    grad: GatherGrad,
) -> CResult<Tensor> {
    check_dim(ax, "all_gather", x, dim)?;
    let out_dims = dims_with(x, dim, l);
    let bx = ax.clone();
    emit(
        x,
        "all_gather",
        &out_dims,
        move |_, _, g| match grad {
            GatherGrad::Chunk => {
                let (s, off) = shard_size_and_offset(l, bx.n, bx.coord);
                narrow(g, dim, off, s)
            }
            GatherGrad::ReduceScatter => reduce_scatter_raw(g, &bx, dim, l, ReduceOp::Sum, None),
        },
        |dest| gather_raw(x, ax, dim, l, dest),
    )
}

/// Differentiable `P(op) -> S(dim)` (`sum` and `avg`; the planner routes `max`/`min` through
/// `R`).
pub(crate) fn reduce_scatter(
    x: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    op: ReduceOp,
) -> CResult<Tensor> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) && x.track_op() {
        return Err(refuse(
            ax,
            "reduce_scatter",
            x,
            format!("a Partial({op}) value has no gradient rule; go through Replicate"),
        ));
    }
    let (me, _) = shard_size_and_offset(l, ax.n, ax.coord);
    check_dim(ax, "reduce_scatter", x, dim)?;
    let out_dims = dims_with(x, dim, me);
    let bx = ax.clone();
    emit(
        x,
        "reduce_scatter",
        &out_dims,
        move |_, _, g| {
            let full = gather_raw(g, &bx, dim, l, None)?;
            match op {
                ReduceOp::Avg => full.affine(1.0 / bx.n as f64, 0.0),
                _ => Ok(full),
            }
        },
        |dest| reduce_scatter_raw(x, ax, dim, l, op, dest),
    )
}

/// Differentiable `P(op) -> R`.
pub(crate) fn all_reduce(x: &Tensor, ax: &Axis, op: ReduceOp) -> CResult<Tensor> {
    let bx = ax.clone();
    emit(
        x,
        "all_reduce",
        x.dims(),
        move |arg, res, g| match op {
            ReduceOp::Sum => Ok(g.clone()),
            ReduceOp::Avg => g.affine(1.0 / bx.n as f64, 0.0),
            ReduceOp::Max | ReduceOp::Min => {
                // The gradient goes to the ranks holding the extreme, split among ties.
                let owner = arg.eq(res)?.to_dtype(g.dtype())?;
                let count = all_reduce_raw(&owner, &bx, ReduceOp::Sum, None)?;
                g.mul(&owner)?.div(&count)
            }
            ReduceOp::Product => {
                // g times the product of the OTHER ranks' values: exact where a value is 0,
                // unlike `g * res / arg`. One all_gather of the (partial) values.
                let all = gather_raw(&arg.unsqueeze(0)?, &bx, 0, bx.n, None)?;
                let mut others = arg.ones_like()?;
                for r in (0..bx.n).filter(|&r| r != bx.coord) {
                    others = others.mul(&all.get(r)?)?;
                }
                g.mul(&others)
            }
        },
        |dest| all_reduce_raw(x, ax, op, dest),
    )
}

/// Differentiable `S(i) -> S(j)`.
pub(crate) fn all_to_all(
    x: &Tensor,
    ax: &Axis,
    i: usize,
    j: usize,
    li: usize,
    lj: usize,
) -> CResult<Tensor> {
    check_dim(ax, "all_to_all", x, i)?;
    check_dim(ax, "all_to_all", x, j)?;
    let mut out_dims = x.dims().to_vec();
    out_dims[i] = li;
    out_dims[j] = shard_size_and_offset(lj, ax.n, ax.coord).0;
    let bx = ax.clone();
    emit(
        x,
        "all_to_all",
        &out_dims,
        move |_, _, g| all_to_all_raw(g, &bx, j, i, lj, li, None),
        |dest| all_to_all_raw(x, ax, i, j, li, lj, dest),
    )
}

/// Differentiable `R -> S(dim)`: keeps this rank's chunk; the backward all_gathers.
pub(crate) fn chunk(x: &Tensor, ax: &Axis, dim: usize) -> CResult<Tensor> {
    check_dim(ax, "chunk", x, dim)?;
    let l = x.dim(dim)?;
    let (s, off) = shard_size_and_offset(l, ax.n, ax.coord);
    let bx = ax.clone();
    emit(
        x,
        "chunk",
        &dims_with(x, dim, s),
        move |_, _, g| gather_raw(g, &bx, dim, l, None),
        |dest| deliver(dest, narrow(x, dim, off, s)?.contiguous()?),
    )
}

/// Differentiable `R -> P(op)`: `sum` splits the value evenly (`x / n` on every rank), the
/// others keep it.
pub(crate) fn partition(x: &Tensor, ax: &Axis, op: ReduceOp) -> CResult<Tensor> {
    let n = ax.n;
    if op == ReduceOp::Product {
        return Err(refuse(
            ax,
            "partition",
            x,
            "Replicate -> Partial(product) is not supported",
        ));
    }
    emit(
        x,
        "partition",
        x.dims(),
        move |_, _, g| match op {
            ReduceOp::Sum => Ok(g.clone()),
            _ => g.affine(n as f64, 0.0),
        },
        |dest| {
            let v = match op {
                ReduceOp::Sum => x.affine(1.0 / n as f64, 0.0)?,
                _ => x.copy()?,
            };
            deliver(dest, v)
        },
    )
}

/// Identity forward, all_reduce(sum) of the gradient over `axes` backward: applied to a
/// Replicate input of an op whose output is Shard or Partial on those mesh dims, where each
/// rank's local gradient is only a partial sum.
pub(crate) fn grad_sync(x: &Tensor, axes: Vec<Axis>) -> CResult<Tensor> {
    if axes.is_empty() || !x.track_op() {
        return Ok(x.clone());
    }
    emit(
        x,
        "grad_sync",
        x.dims(),
        move |_, _, g| {
            let mut g = g.clone();
            for ax in &axes {
                g = all_reduce_raw(&g, ax, ReduceOp::Sum, None)?;
            }
            Ok(g)
        },
        |dest| deliver(dest, x.clone()),
    )
}

/// The row positions (within a logical piece of `l` rows) every member of `ax` holds under
/// `StridedShard { split_factor: sf }`, and the largest count (the padded block size).
fn strided_layout(l: usize, sf: usize, n: usize) -> (Vec<Vec<usize>>, usize) {
    let idx: Vec<Vec<usize>> = (0..n).map(|r| strided_indices(l, sf, n, r)).collect();
    let full = idx.iter().map(|v| v.len()).max().unwrap_or(0);
    (idx, full)
}

fn u32_ids(v: &[usize], like: &Tensor) -> CResult<Tensor> {
    let v: Vec<u32> = v.iter().map(|&i| i as u32).collect();
    let n = v.len();
    Tensor::from_vec(v, n, like.device())
}

/// Rows `ids` of `x` along `dim` (an empty list gives an empty piece).
fn select_rows(x: &Tensor, ids: &[usize], dim: usize) -> CResult<Tensor> {
    if ids.is_empty() || x.elem_count() == 0 {
        return Tensor::zeros(dims_with(x, dim, ids.len()), x.dtype(), x.device());
    }
    x.contiguous()?.index_select(&u32_ids(ids, x)?, dim)
}

/// `x` padded with zero rows at the end of `dim` up to `to` rows.
fn pad_rows(x: &Tensor, dim: usize, to: usize) -> CResult<Tensor> {
    let have = x.dim(dim)?;
    if have >= to {
        return Ok(x.clone());
    }
    let z = Tensor::zeros(dims_with(x, dim, to - have), x.dtype(), x.device())?;
    if have == 0 {
        return Ok(z);
    }
    Tensor::cat(&[x, &z], dim)
}

/// `R -> SS(dim, sf)` data path: this rank's strided rows of the (logical) piece `x`.
pub(crate) fn strided_select_raw(x: &Tensor, ax: &Axis, dim: usize, sf: usize) -> CResult<Tensor> {
    check_dim(ax, "strided select", x, dim)?;
    let l = x.dim(dim)?;
    select_rows(x, &strided_indices(l, sf, ax.n, ax.coord), dim)?.contiguous()
}

/// `SS(dim, sf) -> R` data path: all_gather the pieces (each padded to the largest), then put
/// every row back at its position in the logical piece of `l` rows.
pub(crate) fn strided_gather_raw(
    x: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    sf: usize,
) -> CResult<Tensor> {
    let n = ax.n;
    let (idx, full) = strided_layout(l, sf, n);
    let me = &idx[ax.coord];
    let cut = check_piece(ax, "strided all_gather", x, dim, me.len())?;
    record_blocks("all_gather", ax, full, &cut, x);
    let send = pad_rows(&x.contiguous()?, dim, full)?.contiguous()?;
    let g = timed(ax.comm.all_gather_single(&send.flatten_all()?)?)?;
    let out_dims = dims_with(x, dim, l);
    // [n, pre, full, post] -> [pre, n * full, post], then pick row `r * full + k` for the
    // position `idx[r][k]`.
    let g = g
        .reshape((n, cut.pre, full, cut.post))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((cut.pre, n * full, cut.post))?;
    let mut src = vec![0usize; l];
    for (r, rows) in idx.iter().enumerate() {
        for (k, &pos) in rows.iter().enumerate() {
            src[pos] = r * full + k;
        }
    }
    select_rows(&g, &src, 1)?.reshape(out_dims)
}

/// The adjoint of [`strided_gather_raw`] for a partial-sum gradient `g` (`l` rows on `dim`):
/// reduce over the group and keep this rank's strided rows.
pub(crate) fn strided_reduce_scatter_raw(
    g: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    sf: usize,
) -> CResult<Tensor> {
    let n = ax.n;
    let (idx, full) = strided_layout(l, sf, n);
    let cut = check_piece(ax, "strided reduce_scatter", g, dim, l)?;
    record_blocks("reduce_scatter", ax, full, &cut, g);
    let blocks = idx
        .iter()
        .map(|rows| pad_rows(&select_rows(g, rows, dim)?, dim, full)?.flatten_all())
        .collect::<CResult<Vec<_>>>()?;
    let send = Tensor::cat(&blocks, 0)?;
    let recv = timed(ax.comm.reduce_scatter_single(&send, ReduceOp::Sum)?)?;
    narrow(
        &recv.reshape(dims_with(g, dim, full))?,
        dim,
        0,
        idx[ax.coord].len(),
    )?
    .contiguous()
}

fn check_dim(ax: &Axis, op: &str, x: &Tensor, dim: usize) -> CResult<()> {
    if dim >= x.rank() {
        return Err(refuse(ax, op, x, format!("dim {dim} out of range")));
    }
    Ok(())
}

/// Differentiable `SS(dim, sf) -> R` over a logical piece of `l` rows. Backward: this rank's
/// strided rows of the gradient ([`GatherGrad::Chunk`]), or the strided reduce_scatter when the
/// gradient is a per-rank partial sum ([`GatherGrad::ReduceScatter`]).
pub(crate) fn strided_all_gather(
    x: &Tensor,
    ax: &Axis,
    dim: usize,
    l: usize,
    sf: usize,
    grad: GatherGrad,
) -> CResult<Tensor> {
    check_dim(ax, "strided all_gather", x, dim)?;
    let bx = ax.clone();
    emit(
        x,
        "all_gather",
        &dims_with(x, dim, l),
        move |_, _, g| match grad {
            GatherGrad::Chunk => strided_select_raw(g, &bx, dim, sf),
            GatherGrad::ReduceScatter => strided_reduce_scatter_raw(g, &bx, dim, l, sf),
        },
        |dest| deliver(dest, strided_gather_raw(x, ax, dim, l, sf)?),
    )
}

/// Differentiable `R -> SS(dim, sf)` (local): keeps this rank's strided rows; the backward
/// all_gathers them back into place.
pub(crate) fn strided_chunk(x: &Tensor, ax: &Axis, dim: usize, sf: usize) -> CResult<Tensor> {
    check_dim(ax, "strided select", x, dim)?;
    let l = x.dim(dim)?;
    let bx = ax.clone();
    emit(
        x,
        "chunk",
        &dims_with(x, dim, strided_indices(l, sf, ax.n, ax.coord).len()),
        move |_, _, g| strided_gather_raw(g, &bx, dim, l, sf),
        |dest| deliver(dest, strided_select_raw(x, ax, dim, sf)?),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::{Device, Tensor};
    use candle_dtensor_comm::LocalWorld;
    use candle_dtensor_mesh::DeviceMesh;

    use crate::error::{Context, DTensorError};
    use crate::mesh_ctx::MeshCtx;

    /// A collective that refuses its piece inside the graph raises a typed error that survives
    /// candle (downcastable) and comes back as itself through a DTensor op's `ctx`.
    #[test]
    fn in_graph_failures_are_typed_and_name_the_mesh_dim() {
        let out = LocalWorld::new(2)
            .with_timeout(Duration::from_secs(20))
            .launch(
                |comm| -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
                    let mesh = DeviceMesh::new(comm, &[("tp", 2)])?;
                    let ctx = MeshCtx::of(&mesh)?;
                    let ax = ctx.axis(&mesh, &[0])?;
                    let x = Tensor::zeros((3, 4), candle_core::DType::F32, &Device::Cpu)?;
                    // A piece of 3 rows where a dim of 8 over 2 ranks needs 4.
                    let e = super::gather_raw(&x, &ax, 0, 8, None).unwrap_err();
                    let typed = DTensorError::in_candle(&e).map(|t| t.to_string());
                    let back = Err::<(), _>(e).ctx("redistribute", 7).unwrap_err();
                    Ok((typed, back))
                },
            )
            .unwrap();
        for (typed, back) in out {
            let typed = typed.expect("the candle error carries a DTensorError");
            assert!(
                typed.contains("all_gather over mesh dim tp") && typed.contains("[3, 4]"),
                "{typed}"
            );
            match back {
                DTensorError::Collective(c) => {
                    assert_eq!(
                        (c.op.as_str(), c.mesh_dim.as_str(), c.size),
                        ("all_gather", "tp", 2)
                    );
                    assert_eq!(c.shape, vec![3, 4]);
                }
                other => panic!("not recovered: {other}"),
            }
        }
    }
}
