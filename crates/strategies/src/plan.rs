//! The redistribute planner: any source placements to any target placements on an N-d mesh.
//!
//! Transitions per mesh dim (see [`CollectiveKind`]): `S->R` all_gather, `P->R` all_reduce,
//! `P(sum|avg)->S` reduce_scatter (`P(max|min|product)->S` is all_reduce then a local chunk), `S(i)->S(j)` all_to_all, `R->S` local chunk, `R->P` local partition
//! (`sum`: divide by n; `avg`/`max`/`min`: keep), `MP->P(sum)` relabel, `P(a)->P(b)` and anything
//! involving a `StridedShard` (other than the FSDP fast path) through `R`. `S->P`, creating a
//! `MaskPartial` and `R->P(product)` are typed errors.
//!
//! The plan is the cheapest path (alpha-beta cost model, [`crate::cost`]) in the graph of valid
//! moves described in `transition.rs`: each mesh dim goes `src -> dst` directly or via `R`, moves
//! respect nesting (a tensor dim sharded by several mesh dims is un-sharded innermost first, as
//! PyTorch's greedy planner does) and the pending-reduction order, and consecutive same-kind
//! collectives merge onto a flattened communicator when one exists and the dim divides evenly.
//! Mesh dims of size 1 only relabel ([`CollectiveKind::Noop`] steps, emitted first).
//! Planning cost depends only on the number of mesh dims, never on the world size.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;

use serde::Serialize;

use crate::cost::CollectiveKind;
use crate::error::{Result, StrategyError};
use crate::layout::local_shape;
use crate::mesh::{MeshTopology, MAX_MESH_DIMS};
use crate::placement::{format_placements, Placement, Placements};
use crate::spec::{validate_placements, DTensorSpec, Shape};
use crate::transition::{
    code_value, direct_move, for_each_move, initial_code, unreachable_reason, Move, TensorCtx,
};

fn ser_seq<A: smallvec::Array, S: serde::Serializer>(
    v: &smallvec::SmallVec<A>,
    s: S,
) -> std::result::Result<S::Ok, S::Error>
where
    A::Item: Serialize,
{
    s.collect_seq(v.iter())
}

fn ser_placements<S: serde::Serializer>(
    v: &Placements,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&format_placements(v))
}

/// One step of a redistribution.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    /// The mesh dims the step runs over: one, or several (ascending) merged onto a flattened
    /// communicator.
    #[serde(serialize_with = "ser_seq")]
    pub mesh_dims: smallvec::SmallVec<[usize; 4]>,
    /// Placement on those mesh dims before the step.
    pub from: Placement,
    /// Placement on those mesh dims after the step.
    pub to: Placement,
    /// What runs.
    pub kind: CollectiveKind,
    /// The tensor shape as seen by this step's group before it (coordinate 0, the largest piece):
    /// the global shape cut by every OTHER mesh dim that shards it. Padding is computed from it.
    /// For uneven nested sharding other coordinates see smaller pieces: use
    /// [`Step::logical_shape_at`].
    #[serde(serialize_with = "ser_seq")]
    pub logical_shape: Shape,
    /// The collective's size per rank in the nccl-tests convention (all_gather: gathered output,
    /// reduce_scatter: unreduced input, all_reduce: the buffer, all_to_all: the local buffer; all
    /// padded to `ceil(L/n)*n`); 0 for local steps. Wire bytes: [`crate::cost::wire_bytes`].
    pub bytes: u64,
    /// Estimated time (µs).
    pub est_us: f64,
    /// All placements of the tensor before this step.
    #[serde(serialize_with = "ser_placements")]
    pub before: Placements,
    /// `true` when the data movement is NOT a plain contiguous chunk/concat: an all_gather from a
    /// `StridedShard` must reorder the gathered pieces (and a local chunk to one must select) by
    /// [`crate::layout::strided_indices`] of the logical piece.
    pub permute: bool,
}

impl Step {
    /// Placements after the step.
    pub fn after(&self) -> Placements {
        let mut p = self.before.clone();
        for &m in &self.mesh_dims {
            if let Some(slot) = p.get_mut(m) {
                *slot = self.to;
            }
        }
        p
    }

    /// The logical shape this step's group sees at mesh coordinate `coord` (the local shape under
    /// `before` with this step's mesh dims treated as replicated).
    ///
    /// # Errors
    /// A coordinate outside the mesh or placements that do not fit `global`.
    pub fn logical_shape_at(
        &self,
        global: &[usize],
        mesh_shape: &[usize],
        coord: &[usize],
    ) -> Result<Shape> {
        let mut p = self.before.clone();
        for &m in &self.mesh_dims {
            if let Some(slot) = p.get_mut(m) {
                *slot = Placement::Replicate;
            }
        }
        local_shape(global, mesh_shape, coord, &p)
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.mesh_dims.iter().map(|d| d.to_string()).collect();
        write!(
            f,
            "{} {}->{} on mesh dim {} (logical {:?}, {} B, {:.2} us)",
            self.kind,
            self.from,
            self.to,
            dims.join("+"),
            self.logical_shape.as_slice(),
            self.bytes,
            self.est_us
        )
    }
}

/// An ordered list of steps taking a tensor from `src` to `dst` placements.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RedistributePlan {
    /// Source placements.
    #[serde(serialize_with = "ser_placements")]
    pub src: Placements,
    /// Target placements.
    #[serde(serialize_with = "ser_placements")]
    pub dst: Placements,
    /// The steps, in execution order.
    pub steps: Vec<Step>,
    /// Sum of the steps' estimates (µs).
    pub est_us: f64,
}

impl RedistributePlan {
    /// Steps that move data between ranks (not local chunks, partitions or relabels).
    pub fn communication_steps(&self) -> impl Iterator<Item = &Step> {
        self.steps.iter().filter(|s| s.kind.is_communication())
    }
}

impl fmt::Display for RedistributePlan {
    /// `S(0),S(0) -> R,S(0) -> R,R`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_placements(&self.src))?;
        for s in &self.steps {
            write!(f, " -> {}", format_placements(&s.after()))?;
        }
        Ok(())
    }
}

/// Plans the redistribution of `src` to `dst` placements on `mesh`.
///
/// ```
/// use candle_dtensor::strategies::*;
/// let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
/// let src = DTensorSpec::new(&[8, 4], DType::F32, &parse_placements("S(0),S(0)").unwrap());
/// let plan = plan_redistribute(&src, &parse_placements("R,S(0)").unwrap(), &mesh).unwrap();
/// assert_eq!(plan.to_string(), "S(0),S(0) -> S(0),R -> R,R -> R,S(0)");
/// ```
///
/// # Errors
/// Invalid specs ([`StrategyError::PlacementCount`], [`StrategyError::ShardDimOutOfRange`]),
/// or [`StrategyError::UnsupportedTransition`] (`S->P`, creating a `MaskPartial`, ...).
pub fn plan_redistribute(
    src: &DTensorSpec,
    dst: &[Placement],
    mesh: &MeshTopology,
) -> Result<RedistributePlan> {
    let ndim = mesh.ndim();
    src.validate(ndim, "redistribute")?;
    validate_placements(dst, &src.meta.shape, ndim, "redistribute")?;
    if ndim > MAX_MESH_DIMS {
        return Err(StrategyError::mesh(format!(
            "meshes with more than {MAX_MESH_DIMS} dims are not supported"
        )));
    }
    let ctx = TensorCtx {
        shape: &src.meta.shape,
        itemsize: src.meta.dtype.size_in_bytes() as u64,
        mesh,
    };
    let unsupported = |m: usize, reason: &str| StrategyError::UnsupportedTransition {
        from: format_placements(&src.placements),
        to: format_placements(dst),
        mesh_dim: m,
        reason: reason.to_string(),
    };
    for (m, (&from, &to)) in src.placements.iter().zip(dst).enumerate() {
        if mesh.dim_size(m) > 1 {
            if let Some(r) = unreachable_reason(from, to) {
                return Err(unsupported(m, r));
            }
        }
    }
    let moves = shortest_moves(&ctx, &src.placements, dst, true).ok_or_else(|| {
        let m = (0..ndim).find(|&m| src.placements[m] != dst[m]).unwrap_or(0);
        unsupported(m, "no valid order of moves (pending reductions that do not commute with a product partition)")
    })?;
    Ok(build_plan(&src.placements, dst, moves.1))
}

/// Assembles a plan from a move list.
pub(crate) fn build_plan(
    src: &[Placement],
    dst: &[Placement],
    moves: Vec<Move>,
) -> RedistributePlan {
    let mut cur = Placements::from_slice(src);
    let mut steps = Vec::with_capacity(moves.len());
    let mut total = 0.0;
    for mv in moves {
        let before = cur.clone();
        for &m in &mv.dims {
            cur[m] = mv.to;
        }
        total += mv.cost;
        steps.push(Step {
            mesh_dims: mv.dims,
            from: mv.from,
            to: mv.to,
            kind: mv.kind,
            logical_shape: mv.logical,
            bytes: mv.bytes,
            est_us: mv.cost,
            before,
            permute: mv.permute,
        });
    }
    RedistributePlan {
        src: Placements::from_slice(src),
        dst: Placements::from_slice(dst),
        steps,
        est_us: total,
    }
}

/// Cost of the cheapest plan (no step list), `None` if unreachable.
pub(crate) fn plan_cost(ctx: &TensorCtx<'_>, src: &[Placement], dst: &[Placement]) -> Option<f64> {
    shortest_moves(ctx, src, dst, false).map(|r| r.0)
}

#[derive(Clone, Copy, PartialEq)]
struct HeapEntry {
    f: f64,
    g: f64,
    steps: u32,
    seq: u32,
    idx: u32,
}

impl Eq for HeapEntry {}

impl Ord for HeapEntry {
    fn cmp(&self, other: &Self) -> Ordering {
        // Min-heap on (f, steps, seq).
        other
            .f
            .total_cmp(&self.f)
            .then(other.steps.cmp(&self.steps))
            .then(other.seq.cmp(&self.seq))
    }
}

impl PartialOrd for HeapEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Fast path: every differing dim but at most one changes locally (`R -> S`, `R -> P`,
/// relabel), and doing those first leaves one valid direct collective. That plan is optimal:
/// local moves are free, every plan needs a collective on the remaining dim, and after the local
/// moves every other dim is at its largest shard factor, so that collective moves the fewest
/// bytes possible (and a direct collective is never dearer than going through `R`).
fn local_then_one(
    ctx: &TensorCtx<'_>,
    cur: &[Placement],
    dst: &[Placement],
    differing: &[usize],
    want_moves: bool,
) -> Option<(f64, Vec<Move>)> {
    use crate::cost::CollectiveKind::{LocalChunk, LocalPartition, Noop};
    let is_local = |m: usize| {
        matches!(
            crate::transition::direct_kind(cur[m], dst[m]),
            Some(LocalChunk | LocalPartition | Noop)
        )
    };
    let comm: smallvec::SmallVec<[usize; 2]> = differing
        .iter()
        .copied()
        .filter(|&m| !is_local(m))
        .collect();
    if comm.len() > 1 {
        return None;
    }
    let mut state = Placements::from_slice(cur);
    let mut pending: smallvec::SmallVec<[usize; 8]> =
        differing.iter().copied().filter(|&m| is_local(m)).collect();
    let mut moves = Vec::new();
    while !pending.is_empty() {
        let before = pending.len();
        let mut k = 0;
        while k < pending.len() {
            let m = pending[k];
            match direct_move(ctx, &state, &[m], dst[m]) {
                Some(mv) => {
                    state[m] = dst[m];
                    if want_moves {
                        moves.push(mv);
                    }
                    pending.remove(k);
                }
                None => k += 1,
            }
        }
        if pending.len() == before {
            return None;
        }
    }
    let mut cost = 0.0;
    if let Some(&m) = comm.first() {
        let mv = direct_move(ctx, &state, &[m], dst[m])?;
        cost = mv.cost;
        if want_moves {
            moves.push(mv);
        }
    }
    Some((cost, moves))
}

/// Phase of a mesh dim in the planner's state: 0 at src, 1 at R, 2 at dst.
fn phase_of(code: u8) -> u32 {
    match code {
        crate::transition::AT_SRC => 0,
        crate::transition::AT_R => 1,
        _ => 2,
    }
}

/// Cheapest move list from `src` to `dst` (size-1 mesh dims relabelled first). `want_moves`:
/// build the list (otherwise only the cost is returned, with an empty list).
///
/// A* over the `3^ndim` phase states with an admissible heuristic: every mesh dim that still
/// needs communication to reach its target costs at least the dim's fixed cost plus
/// `latency * (n-1)` (launch dropped for dims in a flattened group, since a merged collective
/// pays one launch), plus a bandwidth bound.
pub(crate) fn shortest_moves(
    ctx: &TensorCtx<'_>,
    src: &[Placement],
    dst: &[Placement],
    want_moves: bool,
) -> Option<(f64, Vec<Move>)> {
    let ndim = src.len();
    let mut moves = Vec::new();
    let mut cur = Placements::from_slice(src);
    for m in 0..ndim {
        if ctx.mesh.dim_size(m) <= 1 && cur[m] != dst[m] {
            if want_moves {
                moves.push(direct_move(ctx, &cur, &[m], dst[m])?);
            }
            cur[m] = dst[m];
        }
    }
    let differing: smallvec::SmallVec<[usize; 8]> =
        (0..ndim).filter(|&m| cur[m] != dst[m]).collect();
    if differing.is_empty() {
        return Some((0.0, moves));
    }
    if differing.len() == 1 {
        // A single valid direct move is optimal: detours only add collectives or bytes.
        if let Some(mv) = direct_move(ctx, &cur, &differing, dst[differing[0]]) {
            let c = mv.cost;
            if want_moves {
                moves.push(mv);
            }
            return Some((c, moves));
        }
    }
    if let Some(r) = local_then_one(ctx, &cur, dst, &differing, want_moves) {
        moves.extend(r.1);
        return Some((r.0, moves));
    }
    let mut opts: smallvec::SmallVec<[Placement; 8]> = smallvec::SmallVec::new();
    for &p in dst {
        if p != Placement::Replicate && !opts.contains(&p) {
            opts.push(p);
        }
    }
    let allowed = |m: usize, k: usize| opts.get(k) == dst.get(m);
    let final_code: smallvec::SmallVec<[u8; 8]> = (0..ndim)
        .map(|m| {
            opts.iter()
                .position(|&o| o == dst[m])
                .map(|k| 2 + k as u8)
                .unwrap_or(crate::transition::AT_R)
        })
        .collect();
    let code_of_phase = |m: usize, ph: u32| -> u8 {
        match ph {
            0 => crate::transition::AT_SRC,
            1 => crate::transition::AT_R,
            _ => final_code[m],
        }
    };
    // Heuristic per (dim, phase).
    let mut h = [[0.0f64; 3]; MAX_MESH_DIMS];
    for m in 0..ndim {
        if ctx.mesh.dim_size(m) <= 1 {
            continue;
        }
        let in_group = ctx.mesh.flattened.iter().any(|g| g.contains(&m));
        let lb = crate::cost::comm_lower_bound_us(&ctx.mesh.dims[m], in_group);
        for ph in 0..3u32 {
            let v = code_value(cur[m], &opts, code_of_phase(m, ph));
            h[m][ph as usize] = if v == dst[m] {
                0.0
            } else if v == Placement::Replicate {
                if crate::transition::direct_kind(v, dst[m]).is_some() {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else if matches!(
                crate::transition::direct_kind(v, dst[m]),
                Some(crate::cost::CollectiveKind::Noop)
            ) {
                0.0
            } else {
                lb
            };
        }
    }
    let pow3: smallvec::SmallVec<[u32; 8]> = (0..ndim).map(|m| 3u32.pow(m as u32)).collect();
    // Bandwidth part of the heuristic: a dim that still has to communicate moves at least
    // `coef * global / (largest shard factor every other dim can have at that time)` bytes; the
    // other dims can only take values reachable from their phase, minus what nesting forbids
    // while this dim still shards its current tensor dim (see expand/product.rs). Admissible;
    // not necessarily consistent, so states are re-opened when a cheaper path appears.
    let global = ctx.shape.iter().product::<usize>() as f64 * ctx.itemsize as f64;
    let in_group: smallvec::SmallVec<[bool; 8]> = (0..ndim)
        .map(|m| ctx.mesh.flattened.iter().any(|g| g.contains(&m)))
        .collect();
    let value = |m: usize, ph: u32| code_value(cur[m], &opts, code_of_phase(m, ph));
    let heuristic = |idx: u32| -> f64 {
        let mut total = 0.0;
        for m in 0..ndim {
            let n = ctx.mesh.dim_size(m);
            if n <= 1 {
                continue;
            }
            let ph = (idx / pow3[m]) % 3;
            total += h[m][ph as usize];
            let v = value(m, ph);
            let mut target = dst[m];
            if v == dst[m] && ph < 2 {
                // Nesting: an earlier dim that still has to change how it shards v's tensor dim
                // forces this shard to be lifted first.
                if let Some(d) = v.shard_dim() {
                    let forced = (0..m).any(|mm| {
                        let now = value(mm, (idx / pow3[mm]) % 3);
                        ctx.mesh.dim_size(mm) > 1
                            && now != dst[mm]
                            && (now.shards(d) || dst[mm].shards(d))
                    });
                    if forced {
                        target = Placement::Replicate;
                        total += crate::cost::comm_lower_bound_us(&ctx.mesh.dims[m], in_group[m]);
                    }
                }
            }
            let coef = crate::transition::wire_coef(v, target, n, in_group[m]);
            if coef == 0.0 || global == 0.0 {
                continue;
            }
            let d = v.shard_dim();
            let mut others = 1.0f64;
            for mm in 0..ndim {
                let nn = ctx.mesh.dim_size(mm);
                if mm == m || nn <= 1 {
                    continue;
                }
                let pm = (idx / pow3[mm]) % 3;
                let now = value(mm, pm);
                let mut f = 1.0f64;
                for (k, w) in [now, Placement::Replicate, dst[mm]].into_iter().enumerate() {
                    let reachable = k == 0 || (k == 1 && pm == 0) || (k == 2 && pm < 2);
                    let ok = match d {
                        Some(d) => !w.shards(d) || (mm < m && w == now),
                        None => true,
                    };
                    if reachable && ok {
                        f = f.max(crate::transition::factor(w, nn));
                    }
                }
                others *= f;
            }
            total += coef * (global / others) / (ctx.mesh.dims[m].bandwidth_gbps * 1e3);
        }
        total
    };
    let n_states = 3usize.pow(ndim as u32);
    let mut g = vec![f64::INFINITY; n_states];
    let mut pred: Vec<(u32, Option<Move>)> = if want_moves {
        vec![(0, None); n_states]
    } else {
        Vec::new()
    };
    let start_phase = |m: usize| -> u32 {
        if ctx.mesh.dim_size(m) <= 1 {
            match cur[m] {
                Placement::Replicate => 1,
                p if p == dst[m] && final_code[m] >= 2 => 2,
                _ => 0,
            }
        } else {
            phase_of(initial_code(cur[m]))
        }
    };
    let mut start = 0u32;
    for m in 0..ndim {
        start += start_phase(m) * pow3[m];
    }
    let h0 = heuristic(start);
    if !h0.is_finite() {
        return None;
    }
    let src_cur = cur.clone();
    g[start as usize] = 0.0;
    let mut heap = BinaryHeap::new();
    heap.push(HeapEntry {
        f: h0,
        g: 0.0,
        steps: 0,
        seq: 0,
        idx: start,
    });
    let mut seq = 0u32;
    let mut codes = [0u8; MAX_MESH_DIMS];
    let mut place = Placements::new();
    while let Some(e) = heap.pop() {
        let i = e.idx as usize;
        if e.g > g[i] {
            continue;
        }
        place.clear();
        for m in 0..ndim {
            let ph = (e.idx / pow3[m]) % 3;
            codes[m] = code_of_phase(m, ph);
            place.push(code_value(src_cur[m], &opts, codes[m]));
        }
        if place.as_slice() == dst {
            if want_moves {
                let mut path = Vec::new();
                let mut k = i;
                while let (p, Some(mv)) = &pred[k] {
                    path.push(mv.clone());
                    k = *p as usize;
                }
                path.reverse();
                moves.extend(path);
            }
            return Some((e.g, moves));
        }
        let codes_now = codes;
        for_each_move(
            ctx,
            &src_cur,
            &opts,
            &allowed,
            &codes_now[..ndim],
            &place,
            &mut |mv, code| {
                let mut next = e.idx;
                let new_phase = phase_of(code);
                for &m in &mv.dims {
                    let old = (e.idx / pow3[m]) % 3;
                    next = next - old * pow3[m] + new_phase * pow3[m];
                }
                let j = next as usize;
                let cost = e.g + mv.cost;
                if cost >= g[j] {
                    return;
                }
                let hn = heuristic(next);
                if !hn.is_finite() {
                    return;
                }
                g[j] = cost;
                if want_moves {
                    pred[j] = (e.idx, Some(mv));
                }
                seq += 1;
                heap.push(HeapEntry {
                    f: cost + hn,
                    g: cost,
                    steps: e.steps + 1,
                    seq,
                    idx: next,
                });
            },
        );
    }
    None
}
