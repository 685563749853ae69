//! Differentiable collectives on plain candle tensors, for tensor parallelism in ordinary
//! candle / candle-nn code (no DTensor).
//!
//! Each function takes this rank's tensor and a [`Group`] (one communicator, e.g. the `tp` dim
//! of a mesh) and records a graph node whose backward is the adjoint collective, so
//! `loss.backward()` runs the backward collectives in the right places. They are Megatron-LM's
//! "mappings":
//!
//! | function | forward | backward | Megatron |
//! |---|---|---|---|
//! | [`copy_to_group`] | identity | all_reduce(sum) | `f`, `copy_to_tensor_model_parallel_region` |
//! | [`reduce_from_group`] | all_reduce(sum) | identity | `g`, `reduce_from_tensor_model_parallel_region` |
//! | [`scatter_to_group`] | keep this rank's chunk | all_gather | `scatter_to_tensor_model_parallel_region` |
//! | [`all_gather`] ([`GatherBackward::Chunk`]) | all_gather | keep this rank's chunk | `gather_from_tensor_model_parallel_region` |
//! | [`all_gather`] ([`GatherBackward::ReduceScatter`]) | all_gather | reduce_scatter | `gather_from_sequence_parallel_region` |
//! | [`reduce_scatter`] | reduce_scatter(sum) | all_gather | `reduce_scatter_to_sequence_parallel_region` |
//! | [`vocab_parallel_embedding`] | masked lookup in this rank's rows, all_reduce | lookup's gradient, local | `VocabParallelEmbedding` |
//! | [`all_to_all_v`], [`exchange_rows`] | irregular all-to-all of dim-0 rows (all_to_all_v, or RMA puts into the receivers' windows) | the reverse exchange (splits swapped) | mixture-of-experts token dispatch / combine |
//!
//! Chunks follow torch.chunk (`ceil(len / n)` rows per rank, the last ones smaller or empty;
//! [`Group::chunk`]); the collectives pad and unpad uneven pieces. Every rank of the group must
//! call the same functions in the same order (they are collectives), and so must its backward:
//! ranks running the same model code build the same graph, which candle walks in the same
//! order. [`crate::debug::CommDebugMode`] records each collective under the group's name.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::dtensor::functional::{copy_to_group, reduce_from_group, Group};
//!
//! // A Megatron MLP on 2 ranks: each holds half of w1's columns and half of w2's rows.
//! let out = LocalWorld::run(2, |comm| {
//!     let tp = Group::new(&comm);
//!     let x = Var::from_tensor(&Tensor::ones((3, 4), DType::F32, &Device::Cpu)?)?;
//!     let w1 = Var::from_tensor(&Tensor::ones((4, 8 / 2), DType::F32, &Device::Cpu)?)?;
//!     let w2 = Var::from_tensor(&Tensor::ones((8 / 2, 4), DType::F32, &Device::Cpu)?)?;
//!     let h = copy_to_group(x.as_tensor(), &tp)?.matmul(w1.as_tensor())?.relu()?;
//!     let y = reduce_from_group(&h.matmul(w2.as_tensor())?, &tp)?; // sums the two halves
//!     let grads = y.sum_all()?.backward()?; // x's gradient is all-reduced by copy_to_group
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
//!         y.to_vec2::<f32>()?[0][0],
//!         grads.get(x.as_tensor()).map(|g| g.to_vec2::<f32>()).transpose()?,
//!     ))
//! })?;
//! assert_eq!(out[0].0, 32.0); // 4 inputs x 8 hidden units, each 1
//! assert_eq!(out[0].1.as_ref().unwrap()[0][0], 32.0);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use candle_dtensor_comm::{Comm, Window};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::shard_size_and_offset;

use crate::collectives::{self, Axis, GatherGrad};
use crate::error::{invalid, Context, Result};
use crate::mesh_ctx::MeshCtx;
use crate::ReduceOp;

/// The ranks a functional collective runs over: one communicator and this rank's place in it.
/// Cheap to clone.
#[derive(Clone)]
pub struct Group {
    axis: Axis,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group({}: rank {} of {})",
            self.axis.name, self.axis.coord, self.axis.n
        )
    }
}

impl Group {
    /// The group of every rank of `comm` (recorded under the communicator's name).
    pub fn new(comm: &Comm) -> Group {
        Group {
            axis: Axis {
                comm: comm.clone(),
                n: comm.size(),
                coord: comm.rank(),
                name: Arc::from(comm.name()),
            },
        }
    }

    /// The group of mesh dim `dim` of `mesh` (this rank and the ranks that differ from it only
    /// on that dim), recorded under the dim's name, as DTensor ops are.
    ///
    /// # Errors
    ///
    /// No such dim.
    pub fn from_mesh(mesh: &DeviceMesh, dim: &str) -> Result<Group> {
        let d = mesh.dim_index(dim)?;
        let ctx = MeshCtx::of(mesh)?;
        Ok(Group {
            axis: ctx.axes[d].clone(),
        })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.axis.n
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.axis.coord
    }

    /// The name collectives are recorded under.
    pub fn name(&self) -> &str {
        &self.axis.name
    }

    /// The communicator.
    pub fn comm(&self) -> &Comm {
        &self.axis.comm
    }

    /// `(size, offset)` of this rank's torch.chunk piece of `len` rows.
    pub fn chunk(&self, len: usize) -> (usize, usize) {
        shard_size_and_offset(len, self.axis.n, self.axis.coord)
    }

    /// `(size, offset)` of rank `rank`'s torch.chunk piece of `len` rows.
    pub fn chunk_of(&self, len: usize, rank: usize) -> (usize, usize) {
        shard_size_and_offset(len, self.axis.n, rank)
    }

    fn op(&self, op: &str) -> String {
        format!("functional::{op} (group {})", self.axis.name)
    }
}

/// What the backward of [`all_gather`] does with the gradient of the gathered tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherBackward {
    /// The gathered tensor feeds the same computation on every rank (its gradient is the same
    /// everywhere): keep this rank's chunk. Megatron's `gather_from_tensor_model_parallel_region`.
    Chunk,
    /// The gathered tensor feeds a per-rank computation whose gradients are partial sums (e.g.
    /// a column-parallel linear under sequence parallelism): reduce_scatter them. Megatron's
    /// `gather_from_sequence_parallel_region`.
    ReduceScatter,
}

/// Megatron's `f`: identity forward, all_reduce(sum) of the gradient backward. Put it where a
/// replicated value enters rank-local computation (the input of a column-parallel linear).
///
/// # Errors
///
/// A failed candle op.
pub fn copy_to_group(x: &Tensor, g: &Group) -> Result<Tensor> {
    collectives::grad_sync(x, vec![g.axis.clone()]).ctx(&g.op("copy_to_group"), g.rank())
}

/// Megatron's `g`: all_reduce(sum) forward, identity backward. Put it where per-rank partial
/// sums become the replicated value (the output of a row-parallel linear).
///
/// # Errors
///
/// A failed collective.
pub fn reduce_from_group(x: &Tensor, g: &Group) -> Result<Tensor> {
    all_reduce(x, g, ReduceOp::Sum)
}

/// Differentiable all_reduce with `op`: backward is the identity for `Sum`, divides by the
/// group size for `Avg`, and sends the gradient to the ranks holding the extreme (split among
/// ties) for `Max`/`Min`.
///
/// # Errors
///
/// A failed collective.
pub fn all_reduce(x: &Tensor, g: &Group, op: ReduceOp) -> Result<Tensor> {
    collectives::all_reduce(x, &g.axis, op).ctx(&g.op("all_reduce"), g.rank())
}

/// Concatenates every rank's piece of dim `dim` (global length `len`, torch.chunk pieces;
/// this rank's piece must have `g.chunk(len).0` rows). Backward: see [`GatherBackward`].
///
/// # Errors
///
/// A piece of the wrong size, `dim` out of range, or a failed collective.
pub fn all_gather(
    x: &Tensor,
    g: &Group,
    dim: usize,
    len: usize,
    backward: GatherBackward,
) -> Result<Tensor> {
    let grad = match backward {
        GatherBackward::Chunk => GatherGrad::Chunk,
        GatherBackward::ReduceScatter => GatherGrad::ReduceScatter,
    };
    collectives::all_gather(x, &g.axis, dim, len, grad).ctx(&g.op("all_gather"), g.rank())
}

/// Sums `x` over the group and keeps this rank's torch.chunk piece of dim `dim`; backward
/// all_gathers the gradient.
///
/// # Errors
///
/// `dim` out of range, or a failed collective.
pub fn reduce_scatter(x: &Tensor, g: &Group, dim: usize) -> Result<Tensor> {
    let op = g.op("reduce_scatter");
    let len = x.dim(dim).ctx(&op, g.rank())?;
    collectives::reduce_scatter(x, &g.axis, dim, len, ReduceOp::Sum).ctx(&op, g.rank())
}

/// Keeps this rank's torch.chunk piece of dim `dim` of a replicated `x` (no communication);
/// backward all_gathers the gradient.
///
/// # Errors
///
/// `dim` out of range, or a failed collective (backward).
pub fn scatter_to_group(x: &Tensor, g: &Group, dim: usize) -> Result<Tensor> {
    collectives::chunk(x, &g.axis, dim).ctx(&g.op("scatter_to_group"), g.rank())
}

/// The lookup of a vocab-parallel embedding: `weight` holds this rank's torch.chunk rows of a
/// `[vocab, hidden]` table; ids outside them give zeros, and the all_reduce sums the ranks'
/// rows into the full lookup `[ids.., hidden]` (replicated). Backward needs no communication:
/// each rank's rows get the gradient of the ids they hold.
///
/// # Errors
///
/// A table piece with the wrong number of rows, non-integer ids, or a failed collective.
pub fn vocab_parallel_embedding(
    ids: &Tensor,
    weight: &Tensor,
    vocab: usize,
    g: &Group,
) -> Result<Tensor> {
    let op = g.op("vocab_parallel_embedding");
    let (rows, off) = g.chunk(vocab);
    let (have, hidden) = weight.dims2().ctx(&op, g.rank())?;
    if have != rows {
        return Err(invalid(
            &op,
            g.rank(),
            format!(
                "the table piece has {have} rows; rank {} of {} holds rows {off}..{} of a vocab \
                 of {vocab}",
                g.rank(),
                g.size(),
                off + rows
            ),
        ));
    }
    if ids.dtype().is_float() {
        return Err(invalid(
            &op,
            g.rank(),
            format!("ids must be integers, got {:?}", ids.dtype()),
        ));
    }
    let mut out_dims = ids.dims().to_vec();
    out_dims.push(hidden);
    let local = (|| {
        if rows == 0 {
            // No rows here: zeros that stay in the graph of the (empty) table.
            return crate::node::graph_zeros(weight, &out_dims);
        }
        // Other ranks' ids look up u32::MAX: a zero row, skipped by the backward (as
        // `DTensor::embedding`'s vocab-parallel lookup).
        let local = crate::ops::neural::shard_ids(ids, off, rows)?;
        crate::fused::embedding(weight, &local)?.reshape(out_dims.as_slice())
    })()
    .ctx(&op, g.rank())?;
    reduce_from_group(&local, g)
}

// ---------------------------------------------------------------------------------------------
// Irregular all-to-all of rows (mixture-of-experts token dispatch and combine).

/// Who sends how many dim-0 rows to whom in an irregular all-to-all: `rows[s][d]` rows go from
/// rank `s` to rank `d` of the group. Every rank holds the same matrix (a mixture of experts
/// knows it after its count exchange), which is what lets the RMA transport put each rank's
/// rows straight to their place in the receiver's window and lets every rank size the windows
/// alike. A receiver gets its rows in source-rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangePlan {
    rows: Arc<Vec<Vec<usize>>>,
    me: usize,
}

impl ExchangePlan {
    /// The plan of rank `me` for the `n x n` matrix `rows`.
    ///
    /// # Errors
    ///
    /// A matrix that is not square, or `me` out of range.
    pub fn new(rows: Vec<Vec<usize>>, me: usize) -> Result<ExchangePlan> {
        let n = rows.len();
        if me >= n || rows.iter().any(|r| r.len() != n) {
            return Err(invalid(
                "functional::ExchangePlan",
                me,
                format!(
                    "the rows matrix must be square with one row per rank and rank {me} in range; \
                     got {n} rows of lengths {:?}",
                    rows.iter().map(Vec::len).collect::<Vec<_>>()
                ),
            ));
        }
        Ok(ExchangePlan {
            rows: Arc::new(rows),
            me,
        })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.rows.len()
    }

    /// The matrix: `rows()[s][d]` rows go from `s` to `d`.
    pub fn rows(&self) -> &[Vec<usize>] {
        &self.rows
    }

    /// Rows this rank sends to each rank (`input_split_sizes`).
    pub fn send_splits(&self) -> Vec<usize> {
        self.rows[self.me].clone()
    }

    /// Rows this rank receives from each rank (`output_split_sizes`).
    pub fn recv_splits(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r[self.me]).collect()
    }

    /// Rows this rank sends in all.
    pub fn send_rows(&self) -> usize {
        self.rows[self.me].iter().sum()
    }

    /// Rows this rank receives in all.
    pub fn recv_rows(&self) -> usize {
        self.rows.iter().map(|r| r[self.me]).sum()
    }

    /// The exchange that sends every row back where it came from (the transposed matrix):
    /// the combine after a dispatch, and every exchange's backward.
    pub fn reversed(&self) -> ExchangePlan {
        let n = self.size();
        let t = (0..n)
            .map(|s| (0..n).map(|d| self.rows[d][s]).collect())
            .collect();
        ExchangePlan {
            rows: Arc::new(t),
            me: self.me,
        }
    }

    /// Where this rank's rows start in rank `d`'s receive buffer (the rows of lower sources
    /// come first).
    fn offset_at(&self, d: usize) -> usize {
        self.rows[..self.me].iter().map(|r| r[d]).sum()
    }

    /// The largest receive of any rank (rows): what a receive window must hold.
    pub fn max_recv_rows(&self) -> usize {
        let n = self.size();
        (0..n)
            .map(|d| self.rows.iter().map(|r| r[d]).sum::<usize>())
            .max()
            .unwrap_or(0)
    }
}

/// Wall time spent in row exchanges, forward and backward (shared by clones), for a layer to
/// report its dispatch and combine time including the backward's reverse exchanges.
#[derive(Clone, Default, Debug)]
pub struct ExchangeTimes(Arc<Mutex<[Duration; 2]>>);

impl ExchangeTimes {
    /// A fresh pair of clocks.
    pub fn new() -> Self {
        Self::default()
    }

    fn add(&self, backward: bool, d: Duration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        t[usize::from(backward)] += d;
    }

    /// Returns and resets `(forward, backward)`.
    pub fn take(&self) -> (Duration, Duration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let out = (t[0], t[1]);
        *t = [Duration::ZERO; 2];
        out
    }
}

/// How [`exchange_rows`] moves rows.
#[derive(Clone)]
pub enum Transport {
    /// One `all_to_all_v_single` (any backend).
    AllToAllV,
    /// Puts with a signal into the receivers' RMA windows ([`RmaExchange`]).
    Rma(Arc<RmaExchange>),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::AllToAllV => write!(f, "AllToAllV"),
            Transport::Rma(_) => write!(f, "Rma"),
        }
    }
}

/// Elements per dim-0 row of `x`.
fn row_elems(x: &Tensor) -> usize {
    x.dims().iter().skip(1).product()
}

fn waited<T: Send + 'static>(w: candle_dtensor_comm::Work<T>) -> candle_core::Result<T> {
    let t0 = Instant::now();
    let r = w.wait();
    crate::debug::add_comm_wait(t0.elapsed());
    Ok(r?)
}

/// The data path of the collective transport.
fn a2a_v_raw(
    x: &Tensor,
    g: &Group,
    output_splits: &[usize],
    input_splits: &[usize],
) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    dims[0] = output_splits.iter().sum();
    if g.size() == 1 {
        return x.contiguous();
    }
    let bytes = x.elem_count() * x.dtype().size_in_bytes();
    crate::debug::record("all_to_all_v", g.name(), bytes as u64);
    let x = x.contiguous()?;
    let out = waited(
        g.comm()
            .all_to_all_v_single(&x, output_splits, input_splits)?,
    )?;
    out.reshape(dims)
}

/// Moves `x`'s rows as `plan` says over `transport` (the data path; no graph node).
fn exchange_raw(
    x: &Tensor,
    g: &Group,
    transport: &Transport,
    plan: &ExchangePlan,
    times: Option<&ExchangeTimes>,
    backward: bool,
) -> candle_core::Result<Tensor> {
    let t0 = Instant::now();
    let out = match transport {
        Transport::AllToAllV => a2a_v_raw(x, g, &plan.recv_splits(), &plan.send_splits())?,
        Transport::Rma(ex) => ex.exchange(x, plan).map_err(candle_core::Error::wrap)?,
    };
    if let Some(t) = times {
        t.add(backward, t0.elapsed());
    }
    Ok(out)
}

fn check_rows(op: &str, x: &Tensor, g: &Group, send: &[usize], recv: &[usize]) -> Result<()> {
    let n = g.size();
    let rows = x.dims().first().copied();
    if send.len() != n || recv.len() != n || rows != Some(send.iter().sum()) {
        return Err(invalid(
            op,
            g.rank(),
            format!(
                "input {:?}: the split sizes (input {send:?}, output {recv:?}) need one entry per \
                 rank of the group of {n} and the input rows must sum to its dim 0",
                x.dims()
            ),
        ));
    }
    Ok(())
}

/// Differentiable irregular all-to-all of dim-0 rows: `input_splits[j]` rows of `x` go to rank
/// `j` (in order), `output_splits[j]` rows come from rank `j`; the result is the received rows
/// in source-rank order. Backward: the reverse all_to_all_v of the gradient (splits swapped).
/// Recorded in [`crate::debug::CommDebugMode`] as `all_to_all_v` with the bytes this rank
/// sends.
///
/// # Errors
///
/// Split lists of the wrong length or not matching `x`'s rows, or a failed collective (which
/// also reports split sizes that disagree between ranks).
pub fn all_to_all_v(
    x: &Tensor,
    g: &Group,
    output_splits: &[usize],
    input_splits: &[usize],
) -> Result<Tensor> {
    let op = g.op("all_to_all_v");
    check_rows(&op, x, g, input_splits, output_splits)?;
    let (out_s, in_s) = (output_splits.to_vec(), input_splits.to_vec());
    let bg = g.clone();
    rows_node(
        x,
        "all_to_all_v",
        output_splits.iter().sum(),
        |x| a2a_v_raw(x, g, output_splits, input_splits),
        move |grad| a2a_v_raw(grad, &bg, &in_s, &out_s),
    )
    .ctx(&op, g.rank())
}

/// Differentiable irregular all-to-all of dim-0 rows as `plan` says (this rank sends
/// `plan.send_splits()`, receives `plan.recv_splits()`, in source-rank order), over
/// `transport`; backward runs the reversed plan over the same transport. `times`, when given,
/// accumulates the wall time of the forward and backward exchanges. Recorded in
/// [`crate::debug::CommDebugMode`] as `all_to_all_v` (or `rma_put`) with the bytes this rank
/// sends.
///
/// # Errors
///
/// A plan for another group size, `x` whose rows are not the plan's, or a failed exchange.
pub fn exchange_rows(
    x: &Tensor,
    g: &Group,
    transport: &Transport,
    plan: &ExchangePlan,
    times: Option<&ExchangeTimes>,
) -> Result<Tensor> {
    let op = g.op("exchange_rows");
    check_rows(&op, x, g, &plan.send_splits(), &plan.recv_splits())?;
    check_plan_rank(&op, g, plan)?;
    let (bg, bt, bp) = (g.clone(), transport.clone(), plan.reversed());
    let btimes = times.cloned();
    rows_node(
        x,
        match transport {
            Transport::AllToAllV => "all_to_all_v",
            Transport::Rma(_) => "rma_all_to_all_v",
        },
        plan.recv_rows(),
        |x| exchange_raw(x, g, transport, plan, times, false),
        move |grad| exchange_raw(grad, &bg, &bt, &bp, btimes.as_ref(), true),
    )
    .ctx(&op, g.rank())
}

/// [`exchange_rows`] of `x`'s dim-0 rows `rows`, in that order (repeats allowed): the result
/// of `exchange_rows(&x.index_select(rows, 0), ..)`, without the permuted send buffer where
/// the communicator reads rows in place (`Comm::all_to_all_v_rows`; the RMA transport
/// gathers first). The MoE dispatch: permutation and exchange in one pass over the rows.
/// Backward: the reversed exchange of the gradient, added back into `x`'s rows (zero for
/// rows not sent). Recorded in [`crate::debug::CommDebugMode`] like [`exchange_rows`].
///
/// # Errors
///
/// As [`exchange_rows`], a row count that is not the plan's, and a row outside `x` (raised by
/// the communicator, or by the gather on the RMA path).
pub fn exchange_gathered_rows(
    x: &Tensor,
    rows: &Arc<Vec<u32>>,
    g: &Group,
    transport: &Transport,
    plan: &ExchangePlan,
    times: Option<&ExchangeTimes>,
) -> Result<Tensor> {
    let op = g.op("exchange_rows");
    let n = x.dims().first().copied().unwrap_or(0);
    let send = plan.send_splits();
    // Rows outside `x` are refused where they are read (the communicator's front, or the
    // gather's index_select), not scanned for twice here.
    if rows.len() != send.iter().sum::<usize>() {
        return Err(invalid(
            &op,
            g.rank(),
            format!(
                "{} rows of an input {:?} for a plan sending {send:?}: the rows must number \
                 what the plan sends",
                rows.len(),
                x.dims()
            ),
        ));
    }
    check_plan_rank(&op, g, plan)?;
    let (bg, bt, bp) = (g.clone(), transport.clone(), plan.reversed());
    let (btimes, brows) = (times.cloned(), rows.clone());
    let x_dims = x.dims().to_vec();
    rows_node(
        x,
        match transport {
            Transport::AllToAllV => "all_to_all_v",
            Transport::Rma(_) => "rma_all_to_all_v",
        },
        plan.recv_rows(),
        |x| {
            let t0 = Instant::now();
            let out = match transport {
                Transport::AllToAllV if g.size() > 1 => {
                    let x = x.contiguous()?;
                    let row_bytes = x.elem_count() / n.max(1) * x.dtype().size_in_bytes();
                    crate::debug::record("all_to_all_v", g.name(), (rows.len() * row_bytes) as u64);
                    let mut dims = x.dims().to_vec();
                    dims[0] = plan.recv_rows();
                    let out = waited(g.comm().all_to_all_v_rows(
                        &x,
                        rows,
                        &plan.recv_splits(),
                        &send,
                    )?)?;
                    out.reshape(dims)?
                }
                _ => {
                    let ids = Tensor::from_slice(rows.as_slice(), rows.len(), x.device())?;
                    let gathered = x.contiguous()?.index_select(&ids, 0)?;
                    return exchange_raw(&gathered, g, transport, plan, times, false);
                }
            };
            if let Some(t) = times {
                t.add(false, t0.elapsed());
            }
            Ok(out)
        },
        move |grad| {
            let back = exchange_raw(grad, &bg, &bt, &bp, btimes.as_ref(), true)?;
            let zeros = Tensor::zeros(x_dims.as_slice(), back.dtype(), back.device())?;
            if brows.is_empty() {
                return Ok(zeros);
            }
            let ids = Tensor::from_slice(brows.as_slice(), brows.len(), back.device())?;
            zeros.index_add(&ids, &back.contiguous()?, 0)
        },
    )
    .ctx(&op, g.rank())
}

/// A plan is made for one rank of its group.
fn check_plan_rank(op: &str, g: &Group, plan: &ExchangePlan) -> Result<()> {
    if plan.me != g.rank() {
        return Err(invalid(
            op,
            g.rank(),
            format!("the plan is rank {}'s, not this rank's", plan.me),
        ));
    }
    Ok(())
}

/// A graph node for a row exchange of `x` (when `x` tracks gradients): forward `forward(x)`,
/// backward `backward(grad)`.
fn rows_node(
    x: &Tensor,
    name: &'static str,
    out_rows: usize,
    forward: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    backward: impl Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
) -> candle_core::Result<Tensor> {
    if !x.track_op() {
        return forward(x);
    }
    let mut dims = x.dims().to_vec();
    dims[0] = out_rows;
    let y = crate::node::node(x, name, dims, Arc::new(move |_, _, g| backward(g)))?;
    let data = forward(x)?;
    crate::storage::fill_from(&y, &data)?;
    Ok(y)
}

/// The windows of [`RmaExchange`].
struct RmaState {
    /// The receive window (grown collectively when a plan needs more).
    data: Option<Window>,
    /// A tiny window whose signals say "I have read my receive window" (its own signal
    /// counters, so they never mix with the data window's).
    acks: Window,
    /// Exchanges run so far.
    exchanges: u64,
}

/// Row exchanges over RMA windows: each rank puts the rows it sends straight into their place
/// in the receiver's window and signals it; a receiver waits for every source's signal, reads
/// its window and acknowledges on a second window, which a sender waits for before it writes
/// into that receiver's window again (so a fast rank never overwrites rows a slow one has not
/// read). The receive window holds the largest receive of any rank ([`ExchangePlan::max_recv_rows`],
/// known to every rank), and grows (a collective `new_window`, at the same exchange on every
/// rank) when a plan needs more. One instance serves every exchange of a group in program
/// order (forward and backward, several layers).
///
/// Needs a backend whose windows have `put` and `signal` and whose `put` does not signal by
/// itself (the local backend); NCCL's put always signals, so the protocol would count two
/// signals there and is refused.
pub struct RmaExchange {
    group: Group,
    state: Mutex<RmaState>,
}

impl RmaExchange {
    /// Creates the exchange over `g` (collective: allocates the acknowledgement window).
    ///
    /// # Errors
    ///
    /// A backend without RMA `put`/`signal` (the process and MPI backends), the NCCL backend
    /// (its put signals), or a failed window allocation.
    pub fn new(g: &Group) -> Result<RmaExchange> {
        let op = g.op("RmaExchange");
        let comm = g.comm();
        let caps = comm.capabilities();
        if !caps.rma_put || !caps.rma_signal {
            return Err(invalid(
                &op,
                g.rank(),
                format!(
                    "the `{}` backend has no RMA windows with put and signal (capabilities: \
                     rma_put {}, rma_signal {}); use the all_to_all_v transport",
                    comm.backend_name(),
                    caps.rma_put,
                    caps.rma_signal
                ),
            ));
        }
        if comm.backend_name() == "nccl" {
            return Err(invalid(
                &op,
                g.rank(),
                "the nccl backend's put signals by itself, which this protocol (put, then an \
                 explicit signal) would count twice; use the all_to_all_v transport",
            ));
        }
        let acks = comm.new_window(1).ctx(&op, g.rank())?;
        Ok(RmaExchange {
            group: g.clone(),
            state: Mutex::new(RmaState {
                data: None,
                acks,
                exchanges: 0,
            }),
        })
    }

    /// The group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Bytes of the receive window now (0 before the first exchange).
    pub fn window_bytes(&self) -> usize {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.data.as_ref().map_or(0, Window::size_bytes)
    }

    /// One exchange of `x`'s rows as `plan` says (collective over the group; no graph node).
    fn exchange(&self, x: &Tensor, plan: &ExchangePlan) -> Result<Tensor> {
        let g = &self.group;
        let op = g.op("rma_all_to_all_v");
        let rank = g.rank();
        let n = g.size();
        let mut out_dims = x.dims().to_vec();
        out_dims[0] = plan.recv_rows();
        if n == 1 {
            return x.contiguous().ctx(&op, rank);
        }
        let x = x.contiguous().ctx(&op, rank)?;
        let row = row_elems(&x);
        let dtype = x.dtype();
        let es = dtype.size_in_bytes();
        crate::debug::record("rma_put", g.name(), (x.elem_count() * es) as u64);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // Every rank computes the same size from the same matrix, so every rank grows here.
        let need = (plan.max_recv_rows() * row * es).max(1);
        if st.data.as_ref().is_none_or(|w| w.size_bytes() < need) {
            let have = st.data.as_ref().map_or(0, Window::size_bytes);
            let bytes = need.max(have + have / 2);
            st.data = None;
            st.data = Some(g.comm().new_window(bytes).ctx(&op, rank)?);
        }
        let (data, acks) = match &st.data {
            Some(d) => (d.clone(), st.acks.clone()),
            None => return Err(invalid(&op, rank, "internal: no receive window")),
        };
        let first = st.exchanges == 0;
        let send = plan.send_splits();
        let mut start = 0;
        let mut starts = vec![0; n];
        for (d, s) in send.iter().enumerate() {
            starts[d] = start;
            start += s;
        }
        // Staggered destinations: rank r writes to r+1 first, so writers do not queue behind
        // one receiver.
        for i in 1..=n {
            let d = (rank + i) % n;
            if !first {
                acks.wait_signal(d).ctx(&op, rank)?;
            }
            if send[d] > 0 {
                let rows = x.narrow(0, starts[d], send[d]).ctx(&op, rank)?;
                data.put(&rows, d, plan.offset_at(d) * row).ctx(&op, rank)?;
            }
            data.signal(d).ctx(&op, rank)?;
        }
        let t0 = Instant::now();
        for s in 0..n {
            data.wait_signal(s).ctx(&op, rank)?;
        }
        crate::debug::add_comm_wait(t0.elapsed());
        let total = plan.recv_rows();
        let out = if total == 0 {
            Tensor::zeros(out_dims.as_slice(), dtype, x.device()).ctx(&op, rank)?
        } else {
            data.get(rank, 0, total * row, dtype)
                .ctx(&op, rank)?
                .reshape(out_dims.as_slice())
                .ctx(&op, rank)?
        };
        for s in 0..n {
            acks.signal(s).ctx(&op, rank)?;
        }
        st.exchanges += 1;
        Ok(out)
    }
}
