//! One redistribution move of one tensor: validity, collective kind, bytes and cost.
//!
//! Shared by the redistribute planner ([`crate::plan`]) and the N-d expander ([`crate::expand`]),
//! so both search exactly the same graph. A move changes ONE mesh dim, or a flattened group of
//! mesh dims that all hold the same placement and make the same change (merged collective).
//!
//! Validity rules (mesh dims of size 1 are ignored everywhere: their placement changes no data):
//! * nesting: a move on mesh dim `m` that changes how tensor dim `d` is sharded requires that no
//!   later mesh dim shards `d` (the later dim cuts `m`'s piece, so `m` cannot change under it).
//!   Exception (the FSDP-after-TP fast path): `SS(d,sf) <-> R` when the later dims sharding `d`
//!   are plain `Shard(d)` with sizes multiplying to `sf` and everything divides evenly.
//! * reduction order: a spec with `Partial` on several mesh dims means "reduce the innermost mesh
//!   dim first". Reducing dim `m` while a later dim keeps a pending reduction that does not
//!   commute with it (e.g. `P(max)` over `P(sum)`) is invalid; the planner then goes through `R`.
//! * `R -> P(sum)` divides by n, which is wrong under a pending later `P(product)`.
//! * merged moves need the group in `MeshTopology::flattened` and an evenly divisible tensor dim
//!   (PyTorch #194457 corrupts data without this guard).

use std::borrow::Cow;

use smallvec::SmallVec;

use crate::cost::{collective_cost_us, CollectiveKind};
use crate::layout::{coord0_size, padded_size};
use crate::mesh::{MeshDim, MeshTopology};
use crate::placement::{Placement, ReduceOp};
use crate::spec::Shape;

/// What the search needs to know about one tensor.
#[derive(Clone, Copy)]
pub(crate) struct TensorCtx<'a> {
    pub shape: &'a [usize],
    pub itemsize: u64,
    pub mesh: &'a MeshTopology,
}

/// One move (a future [`crate::plan::Step`]).
#[derive(Clone, Debug)]
pub(crate) struct Move {
    pub dims: SmallVec<[usize; 4]>,
    pub from: Placement,
    pub to: Placement,
    pub kind: CollectiveKind,
    pub bytes: u64,
    pub cost: f64,
    pub logical: Shape,
    pub permute: bool,
}

impl<'a> TensorCtx<'a> {
    fn size(&self, m: usize) -> usize {
        self.mesh.dim_size(m)
    }

    fn link(&self, dims: &[usize]) -> Cow<'a, MeshDim> {
        if dims.len() == 1 {
            if let Some(d) = self.mesh.dims.get(dims[0]) {
                return Cow::Borrowed(d);
            }
        }
        let mut link = MeshDim {
            name: String::new(),
            size: 1,
            latency_us: 0.0,
            bandwidth_gbps: f64::INFINITY,
            launch_us: 0.0,
        };
        for &d in dims {
            let md = &self.mesh.dims[d];
            link.size *= md.size;
            link.latency_us = link.latency_us.max(md.latency_us);
            link.bandwidth_gbps = link.bandwidth_gbps.min(md.bandwidth_gbps);
            link.launch_us = link.launch_us.max(md.launch_us);
        }
        Cow::Owned(link)
    }

    /// Coordinate-0 (largest) local shape under `cur`, treating the mesh dims in `skip` as
    /// replicated (i.e. the logical shape seen by a collective over `skip`).
    pub fn local_shape(&self, cur: &[Placement], skip: &[usize]) -> Shape {
        let mut out = Shape::from_slice(self.shape);
        for (m, p) in cur.iter().enumerate() {
            let n = self.size(m);
            if n <= 1 || skip.contains(&m) {
                continue;
            }
            if let Some(d) = p.shard_dim() {
                if d < out.len() {
                    out[d] = coord0_size(out[d], n, p);
                }
            }
        }
        out
    }

    /// Bytes of the coordinate-0 local piece under `cur`.
    pub fn local_bytes(&self, cur: &[Placement]) -> u64 {
        self.local_shape(cur, &[]).iter().product::<usize>() as u64 * self.itemsize
    }

    /// Product of the sizes of the mesh dims (size > 1) that shard tensor dim `d` in `cur`, plus
    /// those in `extra`.
    fn shard_product(&self, cur: &[Placement], d: usize, extra: &[usize]) -> usize {
        let mut prod = 1usize;
        for (m, p) in cur.iter().enumerate() {
            let n = self.size(m);
            if n > 1 && (p.shards(d) || extra.contains(&m)) {
                prod = prod.saturating_mul(n);
            }
        }
        prod
    }

    /// The FSDP-after-TP fast path for `SS(d,sf) <-> R` on mesh dim `m`.
    fn strided_fast_path(&self, cur: &[Placement], m: usize, d: usize, sf: usize) -> bool {
        let mut later = 1usize;
        for (mm, p) in cur.iter().enumerate().skip(m + 1) {
            let n = self.size(mm);
            if n <= 1 || !p.shards(d) {
                continue;
            }
            if *p != Placement::Shard(d) {
                return false;
            }
            later = later.saturating_mul(n);
        }
        later > 1
            && later == sf
            && self.shape[d].is_multiple_of(self.shard_product(cur, d, &[m]).max(1))
    }
}

/// Direct transition kind for one mesh dim, ignoring context. `None`: not a single move
/// (needs to go through `Replicate`, or is unsupported).
pub(crate) fn direct_kind(from: Placement, to: Placement) -> Option<CollectiveKind> {
    use Placement::*;
    match (from, to) {
        _ if from == to => None,
        (Shard(_) | StridedShard { .. }, Replicate) => Some(CollectiveKind::AllGather),
        (Partial(_) | MaskPartial { .. }, Replicate) => Some(CollectiveKind::AllReduce),
        // Only linear reductions scatter: a `max`/`min`/`product` reduce_scatter has no adjoint
        // the runtime can run without the full reduced value, so those go through `R`
        // (all_reduce, then a local chunk), and the plan says so.
        (Partial(op), Shard(_)) if op.is_linear() => Some(CollectiveKind::ReduceScatter),
        (MaskPartial { .. }, Shard(_)) => Some(CollectiveKind::ReduceScatter),
        (Shard(_), Shard(_)) => Some(CollectiveKind::AllToAll),
        (Replicate, Shard(_) | StridedShard { .. }) => Some(CollectiveKind::LocalChunk),
        (Replicate, Partial(op)) if op != ReduceOp::Product => Some(CollectiveKind::LocalPartition),
        (MaskPartial { .. }, Partial(ReduceOp::Sum)) => Some(CollectiveKind::Noop),
        _ => None,
    }
}

/// Why `from -> to` can never be reached on a mesh dim of size > 1 (even through `Replicate`).
pub(crate) fn unreachable_reason(from: Placement, to: Placement) -> Option<&'static str> {
    use Placement::*;
    if from == to {
        return None;
    }
    match (from, to) {
        (Shard(_) | StridedShard { .. }, Partial(_) | MaskPartial { .. }) => {
            Some("Shard -> Partial is not supported: a shard holds no summands of the other pieces")
        }
        (_, MaskPartial { .. }) if !matches!(from, MaskPartial { .. }) => {
            Some("a MaskPartial can only be produced by an op (embedding / index ops), not by redistribution")
        }
        (_, MaskPartial { .. }) => Some("MaskPartial placements with different masks do not convert"),
        (_, Partial(ReduceOp::Product)) => {
            Some("Replicate -> P(product) is not supported (no local partition for product)")
        }
        _ => None,
    }
}

/// The move of mesh dims `dims` (one dim, or an ascending flattened group whose dims all hold
/// the same placement) from `cur` to `to`, or `None` if it is not a valid single move.
pub(crate) fn direct_move(
    ctx: &TensorCtx<'_>,
    cur: &[Placement],
    dims: &[usize],
    to: Placement,
) -> Option<Move> {
    let m0 = *dims.first()?;
    let from = *cur.get(m0)?;
    if from == to || dims.iter().any(|&m| cur.get(m) != Some(&from)) {
        return None;
    }
    let merged = dims.len() > 1;
    if !merged && ctx.size(m0) <= 1 {
        return Some(Move {
            dims: SmallVec::from_slice(dims),
            from,
            to,
            kind: CollectiveKind::Noop,
            bytes: 0,
            cost: 0.0,
            logical: ctx.local_shape(cur, dims),
            permute: false,
        });
    }
    let kind = direct_kind(from, to)?;
    if merged {
        let ok_kind = matches!(
            (from, to),
            (Placement::Shard(_), Placement::Replicate)
                | (
                    Placement::Partial(_) | Placement::MaskPartial { .. },
                    Placement::Replicate | Placement::Shard(_)
                )
        );
        if !ok_kind || !ctx.mesh.has_flattened(dims) || dims.iter().any(|&m| ctx.size(m) <= 1) {
            return None;
        }
    }
    // Tensor dims whose sharding changes.
    let mut touched: SmallVec<[usize; 2]> = SmallVec::new();
    touched.extend(from.shard_dim());
    touched.extend(to.shard_dim());
    let later = |m: usize| m > m0 && !dims.contains(&m) && ctx.size(m) > 1;
    let mut permute = false;
    for &d in &touched {
        let blocked = cur.iter().enumerate().any(|(m, p)| later(m) && p.shards(d));
        let strided = match (from, to) {
            (Placement::StridedShard { split_factor, .. }, Placement::Replicate)
            | (Placement::Replicate, Placement::StridedShard { split_factor, .. }) => {
                Some(split_factor)
            }
            _ => None,
        };
        if blocked {
            match strided {
                Some(sf) if !merged && ctx.strided_fast_path(cur, m0, d, sf) => {}
                _ => return None,
            }
        } else if strided.is_some() {
            permute = true;
        }
        if merged && !ctx.shape[d].is_multiple_of(ctx.shard_product(cur, d, dims).max(1)) {
            return None;
        }
        // That divisibility makes every nesting level even only for plain shards: a
        // StridedShard of `d` elsewhere cuts uneven pieces (e.g. 8 as SS(sf=3) over 2 is 5 and
        // 3 rows), which a flattened chunk would lay out differently.
        if merged
            && cur.iter().enumerate().any(|(m, p)| {
                ctx.size(m) > 1 && matches!(p, Placement::StridedShard { dim, .. } if *dim == d)
            })
        {
            return None;
        }
    }
    // Reduction order.
    if let Some(op) = from.reduce_op() {
        if matches!(
            kind,
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
        ) {
            let bad = cur
                .iter()
                .enumerate()
                .any(|(m, p)| later(m) && p.reduce_op().is_some_and(|b| !op.commutes_with(b)));
            if bad {
                return None;
            }
        }
    }
    if to == Placement::Partial(ReduceOp::Sum) && kind == CollectiveKind::LocalPartition {
        let bad = cur
            .iter()
            .enumerate()
            .any(|(m, p)| later(m) && *p == Placement::Partial(ReduceOp::Product));
        if bad {
            return None;
        }
    }
    let logical = ctx.local_shape(cur, dims);
    let group: usize = dims.iter().map(|&m| ctx.size(m)).product();
    let rest = |skip: &[usize]| -> u64 {
        logical
            .iter()
            .enumerate()
            .filter(|(e, _)| !skip.contains(e))
            .map(|(_, &s)| s as u64)
            .product::<u64>()
    };
    let bytes = match kind {
        CollectiveKind::AllGather => {
            let d = from.shard_dim()?;
            let padded = match from {
                Placement::StridedShard { .. } => coord0_size(logical[d], group, &from) * group,
                _ => padded_size(logical[d], group),
            };
            padded as u64 * rest(&[d]) * ctx.itemsize
        }
        CollectiveKind::ReduceScatter => {
            let d = to.shard_dim()?;
            padded_size(logical[d], group) as u64 * rest(&[d]) * ctx.itemsize
        }
        CollectiveKind::AllReduce => rest(&[]) * ctx.itemsize,
        CollectiveKind::AllToAll => {
            let (i, j) = (from.shard_dim()?, to.shard_dim()?);
            let full_i = logical[i].div_ceil(group) as u64;
            let padded_j = padded_size(logical[j], group) as u64;
            full_i * padded_j * rest(&[i, j]) * ctx.itemsize
        }
        _ => 0,
    };
    let cost = collective_cost_us(kind, bytes, &ctx.link(dims));
    Some(Move {
        dims: SmallVec::from_slice(dims),
        from,
        to,
        kind,
        bytes,
        cost,
        logical,
        permute,
    })
}

/// Shard factor of a placement on a mesh dim of size `n`.
pub(crate) fn factor(p: Placement, n: usize) -> f64 {
    if p.is_shard() {
        n as f64
    } else {
        1.0
    }
}

/// Wire bytes per byte of the dim-unsharded size for the cheapest collective that turns `a` into
/// `b` on a mesh dim of size `n` (0: no communication needed).
pub(crate) fn wire_coef(a: Placement, b: Placement, n: usize, in_group: bool) -> f64 {
    use Placement::*;
    if a == b || n <= 1 || a == Replicate {
        return 0.0;
    }
    let nf = n as f64;
    let frac = (nf - 1.0) / nf;
    match (a, b) {
        (MaskPartial { .. }, Partial(crate::ReduceOp::Sum)) => 0.0,
        (Shard(_), Shard(_)) => frac / nf,
        (Shard(_) | StridedShard { .. }, _) => frac,
        (Partial(op), Shard(_)) if !op.is_linear() => {
            if in_group {
                0.0
            } else {
                2.0 * frac
            }
        }
        (Partial(_) | MaskPartial { .. }, Shard(_)) => frac,
        (Partial(_) | MaskPartial { .. }, _) => {
            if in_group {
                0.0
            } else {
                2.0 * frac
            }
        }
        _ => frac,
    }
}

/// Per-mesh-dim search state of one tensor: [`AT_SRC`], [`AT_R`], or `2 + k` = final value
/// `opts[k]`. Moves are monotone: `src -> R`, `src -> opt`, `R -> opt` (an opt may equal `src`,
/// which un-shards and re-shards a dim around a nested change). Every plan PyTorch's greedy
/// planner emits has this shape; it keeps the graph small and identical for the planner and the
/// expander.
pub(crate) const AT_SRC: u8 = 0;
/// See [`AT_SRC`].
pub(crate) const AT_R: u8 = 1;

/// Initial code of a mesh dim whose source placement is `src`.
pub(crate) fn initial_code(src: Placement) -> u8 {
    if src == Placement::Replicate {
        AT_R
    } else {
        AT_SRC
    }
}

/// The placement a code stands for.
pub(crate) fn code_value(src: Placement, opts: &[Placement], code: u8) -> Placement {
    match code {
        AT_SRC => src,
        AT_R => Placement::Replicate,
        k => opts
            .get(k as usize - 2)
            .copied()
            .unwrap_or(Placement::Replicate),
    }
}

/// The targets reachable in one move from `code` on mesh dim `m`: `(value, new code)`.
fn targets(
    src: Placement,
    opts: &[Placement],
    allowed: &dyn Fn(usize, usize) -> bool,
    m: usize,
    code: u8,
) -> SmallVec<[(Placement, u8); 8]> {
    let mut out = SmallVec::new();
    match code {
        AT_SRC if src != Placement::Replicate => {
            out.push((Placement::Replicate, AT_R));
            for (k, &o) in opts.iter().enumerate() {
                if o != src && allowed(m, k) {
                    out.push((o, 2 + k as u8));
                }
            }
        }
        AT_SRC | AT_R => {
            // Policy: what DTensor forbids (S -> P, creating a MaskPartial, ...) is not reachable
            // through R either.
            for (k, &o) in opts.iter().enumerate() {
                if allowed(m, k) && unreachable_reason(src, o).is_none() {
                    out.push((o, 2 + k as u8));
                }
            }
        }
        _ => {}
    }
    out
}

/// Lower bound of reaching `target` on mesh dim `m` from the placement `code` stands for
/// (`INF` if the code rules forbid it). Admissible and consistent for A*.
pub(crate) fn reach_lb(
    src: Placement,
    opts: &[Placement],
    code: u8,
    target: Placement,
    comm_lb: f64,
) -> f64 {
    let v = code_value(src, opts, code);
    if v == target {
        return 0.0;
    }
    if code >= 2 || unreachable_reason(src, target).is_some() {
        return f64::INFINITY;
    }
    if v == Placement::Replicate {
        return if direct_kind(v, target).is_some() {
            0.0
        } else {
            f64::INFINITY
        };
    }
    if matches!(direct_kind(v, target), Some(CollectiveKind::Noop)) {
        0.0
    } else {
        comm_lb
    }
}

/// Calls `f(move, new_code)` for every valid move of one tensor from the state `codes`
/// (`cur` = the placements the codes stand for). `opts` never contains `Replicate`; mesh dims of
/// size 1 never move (callers fix them up front).
#[allow(clippy::too_many_arguments)]
pub(crate) fn for_each_move(
    ctx: &TensorCtx<'_>,
    src: &[Placement],
    opts: &[Placement],
    allowed: &dyn Fn(usize, usize) -> bool,
    codes: &[u8],
    cur: &[Placement],
    f: &mut dyn FnMut(Move, u8),
) {
    for m in 0..cur.len() {
        if ctx.size(m) <= 1 {
            continue;
        }
        for (v, code) in targets(src[m], opts, allowed, m, codes[m]) {
            if let Some(mv) = direct_move(ctx, cur, &[m], v) {
                f(mv, code);
            }
        }
    }
    for group in &ctx.mesh.flattened {
        if group.iter().any(|&m| m >= cur.len() || ctx.size(m) <= 1) {
            continue;
        }
        let m0 = group[0];
        for (v, code) in targets(src[m0], opts, allowed, m0, codes[m0]) {
            let all = group[1..].iter().all(|&m| {
                cur[m] == cur[m0]
                    && targets(src[m], opts, allowed, m, codes[m]).contains(&(v, code))
            });
            if !all {
                continue;
            }
            if let Some(mv) = direct_move(ctx, cur, group, v) {
                f(mv, code);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    fn ctx<'a>(shape: &'a [usize], mesh: &'a MeshTopology) -> TensorCtx<'a> {
        TensorCtx {
            shape,
            itemsize: 4,
            mesh,
        }
    }

    #[test]
    fn nesting_blocks_outer_moves() {
        let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
        let c = ctx(&[8, 4], &mesh);
        // S(0),S(0): dp cannot gather while tp still cuts its piece.
        assert!(direct_move(&c, &[Shard(0), Shard(0)], &[0], Replicate).is_none());
        assert!(direct_move(&c, &[Shard(0), Shard(0)], &[1], Replicate).is_some());
        // R,S(0) -> S(0),S(0) needs tp to un-shard first.
        assert!(direct_move(&c, &[Replicate, Shard(0)], &[0], Shard(0)).is_none());
        // Different tensor dims do not interact.
        assert!(direct_move(&c, &[Shard(1), Shard(0)], &[0], Replicate).is_some());
    }

    #[test]
    fn reduction_order() {
        let mesh = MeshTopology::parse("dp=2,tp=2").unwrap();
        let c = ctx(&[8], &mesh);
        let mx = Partial(ReduceOp::Max);
        let sm = Partial(ReduceOp::Sum);
        assert!(direct_move(&c, &[mx, sm], &[0], Replicate).is_none());
        assert!(direct_move(&c, &[sm, mx], &[0], Replicate).is_none());
        assert!(direct_move(&c, &[mx, sm], &[1], Replicate).is_some());
        assert!(direct_move(&c, &[sm, Partial(ReduceOp::Avg)], &[0], Replicate).is_some());
        assert!(direct_move(&c, &[Replicate, Partial(ReduceOp::Product)], &[0], sm).is_none());
    }

    #[test]
    fn strided_fast_path() {
        let mesh = MeshTopology::parse("dp=4,tp=2").unwrap();
        let ss = StridedShard {
            dim: 0,
            split_factor: 2,
        };
        let even = ctx(&[16, 5], &mesh);
        let m = direct_move(&even, &[ss, Shard(0)], &[0], Replicate).unwrap();
        assert!(!m.permute);
        let uneven = ctx(&[15, 5], &mesh);
        assert!(direct_move(&uneven, &[ss, Shard(0)], &[0], Replicate).is_none());
        let m = direct_move(&uneven, &[ss, Replicate], &[0], Replicate).unwrap();
        assert!(m.permute);
    }

    #[test]
    fn no_merge_under_a_strided_shard() {
        let mesh = MeshTopology::parse("a=2,b=2,c=2")
            .unwrap()
            .with_flattened(&[1, 2])
            .unwrap();
        let c = ctx(&[16, 8], &mesh);
        let ss = StridedShard {
            dim: 1,
            split_factor: 3,
        };
        assert!(direct_move(&c, &[ss, Shard(1), Shard(1)], &[1, 2], Replicate).is_none());
        assert!(direct_move(&c, &[Shard(1), Shard(1), Shard(1)], &[1, 2], Replicate).is_some());
        assert!(direct_move(&c, &[ss, Shard(1), Shard(1)], &[2], Replicate).is_some());
    }

    #[test]
    fn bytes_follow_nccl_sizes() {
        let mesh = MeshTopology::parse("dp=2,tp=4").unwrap();
        let c = ctx(&[10, 8], &mesh);
        // S(0) over tp=4 on a 10-row tensor: padded to 12 rows of 8 f32.
        let m = direct_move(&c, &[Replicate, Shard(0)], &[1], Replicate).unwrap();
        assert_eq!(m.kind, CollectiveKind::AllGather);
        assert_eq!(m.bytes, 12 * 8 * 4);
        let m = direct_move(&c, &[Replicate, Shard(0)], &[1], Shard(1)).unwrap();
        assert_eq!(m.kind, CollectiveKind::AllToAll);
        assert_eq!(m.bytes, 3 * 8 * 4);
        let m = direct_move(&c, &[Replicate, Partial(ReduceOp::Sum)], &[1], Replicate).unwrap();
        assert_eq!(m.bytes, 10 * 8 * 4);
    }
}
