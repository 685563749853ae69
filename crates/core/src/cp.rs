//! Context parallelism: attention over a sequence sharded on a mesh dim.
//!
//! When `q`, `k` and `v` of [`DTensor::sdpa`](crate::DTensor::sdpa) (or the packed `qkv` of
//! `packed_sdpa`) are sharded on their sequence dim over a mesh dim of size `n`, no rank holds
//! every key. The sharding compiler prices two single-dim strategies for that layout (see
//! `candle_dtensor_strategies`' attention rows) and dispatch runs the one it chose:
//!
//! * **KV exchange** (`S(seq)` in and out, a `ring_exchange` of K and V, priced as the
//!   all_gather that moves the same bytes; CommDebugMode records one per pass): by default
//!   **ring attention** ([`CpVariant::Ring`]): every rank keeps its queries, the key/value
//!   blocks travel the ring with send/recv, the next block's transfer in flight while the
//!   current block is computed, blocks combined with the online-softmax rescaling (running max
//!   and sum per query row). The backward pass runs the ring again, recomputing each block's
//!   probabilities from the saved log-sum-exp, and sends the dK/dV accumulators along with the
//!   blocks so they arrive back at their owner after `n` hops. Per rank it holds two K/V blocks
//!   and one tile's scores, never the whole sequence: queries are cut into tiles
//!   ([`tile_scope`]) and a block's keys at its runs of consecutive positions, so the half of a
//!   load-balanced block a tile cannot see is skipped. [`CpVariant::AllGatherKv`] gathers K
//!   and V instead (one collective, `n` blocks resident; its backward reduce-scatters dK/dV);
//!   pick it with [`variant_scope`].
//! * **All-to-all** (Ulysses): `q`, `k`, `v` re-sharded from the sequence to the heads, attention
//!   on whole sequences for `H/n` heads, the output re-sharded back; four all_to_alls of the local
//!   pieces, cheaper than the exchange once `n > 2`; needs `n` to divide the heads.
//!
//! Causal masks use global positions. The layout of the sequence over the ranks is a
//! [`SeqLayout`]: [`SeqLayout::Contiguous`] (torch.chunk pieces, any length `T >= n`: what a
//! plain `Shard(seq)` DTensor is) or [`SeqLayout::LoadBalanced`] (the sequence cut into `2n`
//! chunks, rank `i` holding chunks `i` and `2n-1-i`, so every rank does the same causal work;
//! needs `2n` to divide `T`). Under the balanced layout the tokens are stored permuted:
//! [`load_balanced_order`] gives the order (apply it to ids, targets and position embeddings
//! before sharding), and attention must know it: [`layout_scope`] declares it for the current
//! thread. Supported masks: none and causal (over global positions); arbitrary masks are not.

use std::cell::Cell;

use candle_core::{DType, Tensor, D};
use candle_dtensor_comm::P2POp;
use candle_dtensor_strategies::layout::shard_size_and_offset;

use crate::collectives::{self, Axis, GatherGrad};
use crate::error::invalid;

type CResult<T> = candle_core::Result<T>;

/// How a sequence sharded over a context-parallel mesh dim is laid out over its ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeqLayout {
    /// torch.chunk pieces in order: rank `i` holds positions `[off_i, off_i + len_i)`.
    #[default]
    Contiguous,
    /// `2n` equal chunks, rank `i` holding chunks `i` and `2n-1-i` (stored permuted, see
    /// [`load_balanced_order`]): every rank has the same causal attention work.
    LoadBalanced,
}

/// Which context-parallel attention runs for the KV-exchange strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpVariant {
    /// Ring attention: K/V blocks passed around the ring, overlapped with compute.
    Ring,
    /// All-gather K and V, attend locally; backward reduce-scatters dK/dV.
    AllGatherKv,
}

thread_local! {
    static LAYOUT: Cell<(SeqLayout, usize)> = const { Cell::new((SeqLayout::Contiguous, 1)) };
    static VARIANT: Cell<CpVariant> = const { Cell::new(CpVariant::Ring) };
}

/// Restores the previous [`SeqLayout`] when dropped.
#[must_use = "the layout holds while the guard lives"]
pub struct LayoutGuard((SeqLayout, usize));

impl Drop for LayoutGuard {
    fn drop(&mut self) {
        LAYOUT.with(|l| l.set(self.0));
    }
}

/// Declares, on this thread (a rank) until the guard drops, that sequences are stored in
/// `layout` for a context-parallel mesh dim of `cp` ranks. Attention uses it for its causal
/// mask wherever the sequence is: sharded over that dim (the positions of each rank's piece),
/// or whole on a rank after the compiler gathered it (still in the stored order). The
/// backward pass uses what the forward captured.
pub fn layout_scope(layout: SeqLayout, cp: usize) -> LayoutGuard {
    LayoutGuard(LAYOUT.with(|l| l.replace((layout, cp.max(1)))))
}

/// The layout declared on this thread and its context-parallel size
/// (`(SeqLayout::Contiguous, 1)` unless a [`layout_scope`] is alive).
pub fn current_layout() -> (SeqLayout, usize) {
    LAYOUT.with(|l| l.get())
}

/// Restores the previous [`CpVariant`] when dropped.
#[must_use = "the variant holds while the guard lives"]
pub struct VariantGuard(CpVariant);

impl Drop for VariantGuard {
    fn drop(&mut self) {
        VARIANT.with(|v| v.set(self.0));
    }
}

/// Runs the KV-exchange strategy as `variant` on this thread until the guard drops (default
/// [`CpVariant::Ring`]). Every rank of the mesh dim must choose the same.
pub fn variant_scope(variant: CpVariant) -> VariantGuard {
    VariantGuard(VARIANT.with(|v| v.replace(variant)))
}

/// The KV-exchange variant chosen on this thread.
pub fn current_variant() -> CpVariant {
    VARIANT.with(|v| v.get())
}

/// This thread's context-parallel settings (sequence layout, KV-exchange variant, tile size),
/// captured to replay a forward elsewhere: activation checkpointing recomputes a block inside
/// backward, after the forward's scopes have ended, and must attend with the same causal
/// positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    layout: (SeqLayout, usize),
    variant: CpVariant,
    tile: usize,
}

/// Restores the settings [`Settings::enter`] replaced when dropped.
#[must_use = "the settings hold while the guard lives"]
pub struct SettingsGuard {
    _layout: LayoutGuard,
    _variant: VariantGuard,
    _tile: TileGuard,
}

impl Settings {
    /// The settings in force on this thread.
    pub fn current() -> Settings {
        Settings {
            layout: current_layout(),
            variant: current_variant(),
            tile: TILE.with(|t| t.get()),
        }
    }

    /// Puts these settings in force on this thread until the guard drops.
    pub fn enter(self) -> SettingsGuard {
        SettingsGuard {
            _layout: layout_scope(self.layout.0, self.layout.1),
            _variant: variant_scope(self.variant),
            _tile: tile_scope(self.tile),
        }
    }
}

/// The global positions of rank `r`'s piece of a sequence of `t` tokens over `n` ranks.
///
/// Refused (naming `op` and the rule): a contiguous sequence shorter than `n` (a rank would
/// hold nothing), a balanced one shorter than `2n` chunks or not divisible into them.
pub fn positions(
    op: &str,
    t: usize,
    n: usize,
    r: usize,
    layout: SeqLayout,
) -> crate::Result<Vec<usize>> {
    check_len(op, t, n, r, layout)?;
    Ok(match layout {
        SeqLayout::Contiguous => {
            let (len, off) = shard_size_and_offset(t, n, r);
            (off..off + len).collect()
        }
        SeqLayout::LoadBalanced => {
            let c = t / (2 * n);
            let lo = r * c;
            let hi = (2 * n - 1 - r) * c;
            (lo..lo + c).chain(hi..hi + c).collect()
        }
    })
}

fn check_len(op: &str, t: usize, n: usize, r: usize, layout: SeqLayout) -> crate::Result<()> {
    match layout {
        SeqLayout::Contiguous if t < n => Err(invalid(
            op,
            r,
            format!(
                "a sequence of {t} tokens over a context-parallel dim of {n} ranks: the rule is \
                 at least one token per rank (T >= cp)"
            ),
        )),
        SeqLayout::LoadBalanced if t < 2 * n || t % (2 * n) != 0 => Err(invalid(
            op,
            r,
            format!(
                "a sequence of {t} tokens in the load-balanced layout over {n} ranks: the rule \
                 is T a multiple of 2 x cp = {} (two equal chunks per rank)",
                2 * n
            ),
        )),
        _ => Ok(()),
    }
}

/// The order in which a sequence of `t` tokens is stored for `layout` over `n` ranks: the
/// concatenation of every rank's [`positions`]. `Contiguous` is the identity; apply the
/// `LoadBalanced` order (`index_select` on the sequence dim) to ids, targets and position
/// embeddings before sharding them with `Shard(seq)`.
pub fn load_balanced_order(t: usize, n: usize) -> crate::Result<Vec<usize>> {
    let mut order = Vec::with_capacity(t);
    for r in 0..n {
        order.extend(positions(
            "load_balanced_order",
            t,
            n,
            r,
            SeqLayout::LoadBalanced,
        )?);
    }
    Ok(order)
}

/// Which keys a block of queries sees.
enum Vis {
    All,
    None,
    /// Additive mask `[Tq, Tk]`: 0 where seen, -inf where not.
    Mask(Tensor),
}

fn visibility(pq: &[usize], pk: &[usize], causal: bool, like: &Tensor) -> CResult<Vis> {
    if !causal || pq.is_empty() || pk.is_empty() {
        return Ok(Vis::All);
    }
    let (qmin, qmax) = (pq.iter().min(), pq.iter().max());
    let (kmin, kmax) = (pk.iter().min(), pk.iter().max());
    if let (Some(&qmin), Some(&qmax), Some(&kmin), Some(&kmax)) = (qmin, qmax, kmin, kmax) {
        if kmax <= qmin {
            return Ok(Vis::All);
        }
        if kmin > qmax {
            return Ok(Vis::None);
        }
    }
    let mut m = Vec::with_capacity(pq.len() * pk.len());
    for &i in pq {
        for &j in pk {
            m.push(if j <= i { 0f32 } else { f32::NEG_INFINITY });
        }
    }
    Ok(Vis::Mask(Tensor::from_vec(
        m,
        (pq.len(), pk.len()),
        like.device(),
    )?))
}

fn scores(q: &Tensor, k: &Tensor, vis: &Vis, scale: f64) -> CResult<Tensor> {
    let s = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    match vis {
        Vis::Mask(m) => s.broadcast_add(m),
        _ => Ok(s),
    }
}

/// Running online-softmax state of one rank's queries: row max, row sum, unnormalised output.
struct Online {
    m: Tensor,
    l: Tensor,
    acc: Tensor,
}

impl Online {
    fn new(q: &Tensor, dv: usize) -> CResult<Self> {
        let (b, h, t, _) = q.dims4()?;
        Ok(Online {
            m: Tensor::full(f32::NEG_INFINITY, (b, h, t, 1), q.device())?,
            l: Tensor::zeros((b, h, t, 1), DType::F32, q.device())?,
            acc: Tensor::zeros((b, h, t, dv), DType::F32, q.device())?,
        })
    }

    /// Folds in one block. A row that has seen no key yet (max still -inf) is shifted by 0
    /// instead of -inf, so blocks may come in any order without `exp(-inf - -inf)`; a row
    /// that never sees a key cannot happen under the supported masks (causal self-attention
    /// sees its own position).
    fn fold(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, vis: &Vis, scale: f64) -> CResult<()> {
        if matches!(vis, Vis::None) {
            return Ok(());
        }
        let s = scores(q, k, vis, scale)?;
        let mb = s.max_keepdim(D::Minus1)?;
        let m_new = self.m.maximum(&mb)?;
        let unseen = m_new.eq(f32::NEG_INFINITY)?;
        let m_new = unseen.where_cond(&m_new.zeros_like()?, &m_new)?;
        let p = s.broadcast_sub(&m_new)?.exp()?;
        let alpha = (&self.m - &m_new)?.exp()?;
        self.l = (self.l.broadcast_mul(&alpha)? + p.sum_keepdim(D::Minus1)?)?;
        self.acc = (self.acc.broadcast_mul(&alpha)? + p.matmul(v)?)?;
        self.m = m_new;
        Ok(())
    }

    /// The normalised output and the log-sum-exp per row (a row that saw nothing keeps
    /// max 0, which its zero sum turns into -inf).
    fn finish(self) -> CResult<(Tensor, Tensor)> {
        let o = self.acc.broadcast_div(&self.l)?;
        let lse = (self.m + self.l.log()?)?;
        Ok((o, lse))
    }
}

/// One block's share of the backward: `(dq, dk, dv)` for queries `q` against keys `k`/`v`,
/// given the saved log-sum-exp and `dsum = rowsum(dO * O)`.
#[allow(clippy::too_many_arguments)]
fn block_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: &Vis,
    scale: f64,
    lse: &Tensor,
    g: &Tensor,
    dsum: &Tensor,
) -> CResult<Option<(Tensor, Tensor, Tensor)>> {
    if matches!(vis, Vis::None) {
        return Ok(None);
    }
    let p = scores(q, k, vis, scale)?.broadcast_sub(lse)?.exp()?;
    let dv = p.t()?.contiguous()?.matmul(g)?;
    let dp = g.matmul(&v.t()?.contiguous()?)?;
    let ds = (p * dp.broadcast_sub(dsum)?)?;
    let dq = (ds.matmul(k)? * scale)?;
    let dk = (ds.t()?.contiguous()?.matmul(q)? * scale)?;
    Ok(Some((dq, dk, dv)))
}

/// About this many f32 elements in one tile's block of scores by default (16 MiB): queries
/// are cut into tiles of rows so that a block's scores, probabilities and their gradients stay
/// bounded whatever the sequence length (flash attention's query tiling; a block's keys are
/// whole). [`tile_scope`] changes it.
pub const TILE_ELEMS: usize = 1 << 22;

thread_local! {
    static TILE: Cell<usize> = const { Cell::new(TILE_ELEMS) };
}

/// Restores the previous tile size when dropped.
#[must_use = "the tile size holds while the guard lives"]
pub struct TileGuard(usize);

impl Drop for TileGuard {
    fn drop(&mut self) {
        TILE.with(|t| t.set(self.0));
    }
}

/// Cuts context-parallel attention's queries into tiles whose block of scores holds about
/// `elems` f32 elements (at least one query row per tile) on this thread until the guard
/// drops: smaller tiles hold less memory and launch more ops. The result does not depend on it
/// beyond floating-point summation order.
pub fn tile_scope(elems: usize) -> TileGuard {
    TileGuard(TILE.with(|t| t.replace(elems.max(1))))
}

/// This rank's queries (f32) cut into tiles of rows along dim 2, with their global positions.
struct QueryTiles {
    tiles: Vec<(Tensor, Vec<usize>)>,
    spans: Vec<(usize, usize)>,
}

impl QueryTiles {
    /// `qf [B, H, Tq, d]` at positions `pq`, for blocks of at most `tk_max` keys.
    fn new(qf: &Tensor, pq: &[usize], tk_max: usize) -> CResult<Self> {
        let (b, h, tq, _) = qf.dims4()?;
        let budget = TILE.with(|t| t.get());
        let rows = (budget / (b * h * tk_max.max(1)).max(1)).max(1);
        let mut tiles = Vec::new();
        let mut spans = Vec::new();
        let mut at = 0;
        while at < tq {
            let len = rows.min(tq - at);
            tiles.push((
                qf.narrow(2, at, len)?.contiguous()?,
                pq[at..at + len].to_vec(),
            ));
            spans.push((at, len));
            at += len;
        }
        Ok(QueryTiles { tiles, spans })
    }

    /// `x [B, H, Tq, ..]` cut like the queries.
    fn split(&self, x: &Tensor) -> CResult<Vec<Tensor>> {
        self.spans
            .iter()
            .map(|&(at, len)| x.narrow(2, at, len)?.contiguous())
            .collect()
    }

    /// One online-softmax state per tile.
    fn states(&self, dv: usize) -> CResult<Vec<Online>> {
        self.tiles.iter().map(|(q, _)| Online::new(q, dv)).collect()
    }

    /// Folds the block `k`/`v` at positions `pk` into every tile's state.
    #[allow(clippy::too_many_arguments)]
    fn fold(
        &self,
        states: &mut [Online],
        k: &Tensor,
        v: &Tensor,
        pk: &[usize],
        causal: bool,
        scale: f64,
    ) -> CResult<()> {
        let segs = segments(pk);
        for ((q, pq), st) in self.tiles.iter().zip(states.iter_mut()) {
            for &(at, len) in &segs {
                let vis = visibility(pq, &pk[at..at + len], causal, q)?;
                if matches!(vis, Vis::None) {
                    continue;
                }
                let (ks, vs) = (k.narrow(2, at, len)?, v.narrow(2, at, len)?);
                st.fold(q, &ks, &vs, &vis, scale)?;
            }
        }
        Ok(())
    }

    /// The output and log-sum-exp of every tile's state, joined along dim 2.
    fn finish(states: Vec<Online>) -> CResult<(Tensor, Tensor)> {
        let mut os = Vec::with_capacity(states.len());
        let mut ls = Vec::with_capacity(states.len());
        for st in states {
            let (o, l) = st.finish()?;
            os.push(o);
            ls.push(l);
        }
        Ok((Tensor::cat(&os, 2)?, Tensor::cat(&ls, 2)?))
    }

    /// The block `k`/`v`'s share of the backward, tile by tile: adds each tile's dq into
    /// `dq[tile]` and returns the block's `(dk, dv)` (`None` when no query sees it).
    #[allow(clippy::too_many_arguments)]
    fn grads(
        &self,
        k: &Tensor,
        v: &Tensor,
        pk: &[usize],
        causal: bool,
        scale: f64,
        back: &TileBackward,
        dq: &mut [Option<Tensor>],
    ) -> CResult<Option<(Tensor, Tensor)>> {
        // Per key segment: its dK/dV summed over the tiles that see it.
        let segs = segments(pk);
        let mut seg_dkv: Vec<Option<(Tensor, Tensor)>> = vec![None; segs.len()];
        for (i, (q, pq)) in self.tiles.iter().enumerate() {
            for (j, &(at, len)) in segs.iter().enumerate() {
                let vis = visibility(pq, &pk[at..at + len], causal, q)?;
                if matches!(vis, Vis::None) {
                    continue;
                }
                let (ks, vs) = (k.narrow(2, at, len)?, v.narrow(2, at, len)?);
                let Some((dqp, dkp, dvp)) = block_grads(
                    q,
                    &ks,
                    &vs,
                    &vis,
                    scale,
                    &back.lse[i],
                    &back.g[i],
                    &back.dsum[i],
                )?
                else {
                    continue;
                };
                dq[i] = Some(add_into(dq[i].take(), dqp)?);
                seg_dkv[j] = Some(match seg_dkv[j].take() {
                    Some((a, b)) => ((a + dkp)?, (b + dvp)?),
                    None => (dkp, dvp),
                });
            }
        }
        if seg_dkv.iter().all(Option::is_none) {
            return Ok(None);
        }
        // The block's dK/dV: its segments' in order, zeros where no query looked.
        let mut dks = Vec::with_capacity(segs.len());
        let mut dvs = Vec::with_capacity(segs.len());
        for (d, &(at, len)) in seg_dkv.into_iter().zip(&segs) {
            let (dk, dv) = match d {
                Some(d) => d,
                None => (
                    k.narrow(2, at, len)?.zeros_like()?,
                    v.narrow(2, at, len)?.zeros_like()?,
                ),
            };
            dks.push(dk);
            dvs.push(dv);
        }
        Ok(Some((Tensor::cat(&dks, 2)?, Tensor::cat(&dvs, 2)?)))
    }

    /// The tiles' dq joined along dim 2 (zeros for tiles no block touched).
    fn join_dq(&self, dq: Vec<Option<Tensor>>) -> CResult<Tensor> {
        let parts = dq
            .into_iter()
            .zip(&self.tiles)
            .map(|(d, (q, _))| d.map_or_else(|| q.zeros_like(), Ok))
            .collect::<CResult<Vec<_>>>()?;
        Tensor::cat(&parts, 2)
    }
}

/// The runs of consecutive positions in `pk` as `(start, len)`: a load-balanced block is two
/// chunks far apart, and a query tile usually sees one of them whole and the other not at all,
/// so cutting the keys there lets the masked half be skipped instead of computed and masked
/// (which would give the ranks unequal work, the imbalance the layout exists to remove).
fn segments(pk: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, &p) in pk.iter().enumerate() {
        match out.last_mut() {
            Some((at, len)) if pk[*at + *len - 1] + 1 == p => *len += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

/// What every block's backward reads, cut into the query tiles: the log-sum-exp, the output
/// gradient and `rowsum(dO * O)`.
struct TileBackward {
    lse: Vec<Tensor>,
    g: Vec<Tensor>,
    dsum: Vec<Tensor>,
}

impl TileBackward {
    fn new(tiles: &QueryTiles, lse: &Tensor, g: &Tensor, o: &Tensor) -> CResult<Self> {
        let dsum = (g * o)?.sum_keepdim(D::Minus1)?;
        Ok(TileBackward {
            lse: tiles.split(lse)?,
            g: tiles.split(g)?,
            dsum: tiles.split(&dsum)?,
        })
    }
}

fn f32c(t: &Tensor) -> CResult<Tensor> {
    t.to_dtype(DType::F32)?.contiguous()
}

fn block_shape(like: &Tensor, len: usize) -> CResult<Vec<usize>> {
    let mut d = like.dims().to_vec();
    d[2] = len;
    Ok(d)
}

fn add_into(acc: Option<Tensor>, x: Tensor) -> CResult<Tensor> {
    match acc {
        Some(a) => a + x,
        None => Ok(x),
    }
}

/// Sends `send` to the next rank and receives tensors of `shapes` from the previous one, as
/// one group; returns the pending work.
fn rotate(
    ax: &Axis,
    send: &[&Tensor],
    shapes: &[Vec<usize>],
    dtype: DType,
) -> CResult<candle_dtensor_comm::Work<Vec<Tensor>>> {
    let (n, r) = (ax.n, ax.coord);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut ops: Vec<P2POp> = send
        .iter()
        .map(|t| P2POp::Send {
            tensor: (*t).clone(),
            peer: next,
        })
        .collect();
    for s in shapes {
        ops.push(P2POp::Recv {
            peer: prev,
            shape: s.clone().into(),
            dtype,
        });
    }
    ax.comm.batch_p2p(ops).map_err(candle_core::Error::wrap)
}

/// Records one pass of K/V-shaped blocks around the ring for CommDebugMode, as the compiler
/// plans it (`ring_exchange`, sized as every rank's blocks together).
fn record_ring(ax: &Axis, k: &Tensor, v: &Tensor, pos: &[Vec<usize>], dtype: DType) {
    let t: usize = pos.iter().map(Vec::len).sum();
    let per_pos = |x: &Tensor| x.elem_count() / x.dim(2).unwrap_or(1).max(1);
    let bytes = (per_pos(k) + per_pos(v)) * t * dtype.size_in_bytes();
    crate::debug::record_on("ring_exchange", &ax.comm, &ax.name, bytes as u64);
}

fn take2(mut v: Vec<Tensor>, what: &str) -> CResult<(Tensor, Tensor)> {
    match (v.pop(), v.pop()) {
        (Some(b), Some(a)) => Ok((a, b)),
        _ => Err(candle_core::Error::msg(format!(
            "ring attention: {what}: expected two received blocks"
        ))),
    }
}

/// The ring's forward: `(o, lse)` in f32 for this rank's queries. `pos[i]` are rank `i`'s
/// global positions (its queries' and, since q/k/v share the layout, its keys').
fn ring_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ax: &Axis,
    pos: &[Vec<usize>],
    causal: bool,
    scale: f64,
) -> CResult<(Tensor, Tensor)> {
    let (n, r) = (ax.n, ax.coord);
    record_ring(ax, k, v, pos, k.dtype());
    let qf = f32c(q)?;
    let tk_max = pos.iter().map(Vec::len).max().unwrap_or(0);
    let tiles = QueryTiles::new(&qf, &pos[r], tk_max)?;
    let mut states = tiles.states(v.dim(3)?)?;
    let (mut ck, mut cv) = (k.contiguous()?, v.contiguous()?);
    for s in 0..n {
        let owner = (r + n - s) % n;
        let pending = if s + 1 < n {
            let src = (r + n - s - 1) % n;
            let shapes = [
                block_shape(k, pos[src].len())?,
                block_shape(v, pos[src].len())?,
            ];
            Some(rotate(ax, &[&ck, &cv], &shapes, k.dtype())?)
        } else {
            None
        };
        tiles.fold(
            &mut states,
            &f32c(&ck)?,
            &f32c(&cv)?,
            &pos[owner],
            causal,
            scale,
        )?;
        if let Some(w) = pending {
            (ck, cv) = take2(collectives::timed(w)?, "forward")?;
        }
    }
    QueryTiles::finish(states)
}

/// The ring's backward: `(dq, dk, dv)` in f32.
#[allow(clippy::too_many_arguments)]
fn ring_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    g: &Tensor,
    ax: &Axis,
    pos: &[Vec<usize>],
    causal: bool,
    scale: f64,
) -> CResult<(Tensor, Tensor, Tensor)> {
    let (n, r) = (ax.n, ax.coord);
    // K/V around the ring once more, and the f32 dK/dV accumulators all the way round.
    record_ring(ax, k, v, pos, k.dtype());
    record_ring(ax, k, v, pos, DType::F32);
    let qf = f32c(q)?;
    let tk_max = pos.iter().map(Vec::len).max().unwrap_or(0);
    let tiles = QueryTiles::new(&qf, &pos[r], tk_max)?;
    let back = TileBackward::new(&tiles, lse, &f32c(g)?, o)?;
    let mut dq: Vec<Option<Tensor>> = vec![None; tiles.tiles.len()];
    let (mut ck, mut cv) = (k.contiguous()?, v.contiguous()?);
    let mut pending_grads: Option<candle_dtensor_comm::Work<Vec<Tensor>>> = None;
    for s in 0..n {
        let owner = (r + n - s) % n;
        let kv_pending = if s + 1 < n {
            let src = (r + n - s - 1) % n;
            let shapes = [
                block_shape(k, pos[src].len())?,
                block_shape(v, pos[src].len())?,
            ];
            Some(rotate(ax, &[&ck, &cv], &shapes, k.dtype())?)
        } else {
            None
        };
        let (kf, vf) = (f32c(&ck)?, f32c(&cv)?);
        let (dk_part, dv_part) =
            match tiles.grads(&kf, &vf, &pos[owner], causal, scale, &back, &mut dq)? {
                Some(d) => d,
                None => (kf.zeros_like()?, vf.zeros_like()?),
            };
        // The accumulators of this block, with every earlier holder's share, arrived from the
        // previous rank while this block was computed.
        let (dk_acc, dv_acc) = match pending_grads.take() {
            None => (dk_part, dv_part),
            Some(w) => {
                let (a, b) = take2(collectives::timed(w)?, "backward dK/dV")?;
                ((a + dk_part)?, (b + dv_part)?)
            }
        };
        if n == 1 {
            return Ok((tiles.join_dq(dq)?, dk_acc, dv_acc));
        }
        // Onward to the next rank, which holds this block at its next step (or, after the
        // last step, owns it); receive the accumulators of the block this rank holds next.
        let next_owner = (r + n - s - 1) % n;
        let shapes = [
            block_shape(k, pos[next_owner].len())?,
            block_shape(v, pos[next_owner].len())?,
        ];
        pending_grads = Some(rotate(ax, &[&dk_acc, &dv_acc], &shapes, DType::F32)?);
        if let Some(w) = kv_pending {
            (ck, cv) = take2(collectives::timed(w)?, "backward K/V")?;
        }
    }
    let w = pending_grads
        .ok_or_else(|| candle_core::Error::msg("ring attention: no dK/dV in flight"))?;
    let (dk, dv) = take2(collectives::timed(w)?, "backward own dK/dV")?;
    Ok((tiles.join_dq(dq)?, dk, dv))
}

/// Attention of this rank's `q` against keys `k`/`v` at global positions `pq`/`pk`, as one
/// graph node (f32 math, the inputs' dtype out). Used by the all-gather and all-to-all
/// variants, whose communication is differentiable on its own.
fn local_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pq: Vec<usize>,
    pk: Vec<usize>,
    causal: bool,
    scale: f64,
) -> CResult<Tensor> {
    let qf = f32c(&q.detach())?;
    let tiles = QueryTiles::new(&qf, &pq, pk.len())?;
    let mut states = tiles.states(v.dim(3)?)?;
    tiles.fold(
        &mut states,
        &f32c(&k.detach())?,
        &f32c(&v.detach())?,
        &pk,
        causal,
        scale,
    )?;
    let (o, lse) = QueryTiles::finish(states)?;
    let y = o.to_dtype(q.dtype())?;
    drop(o);
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(y);
    }
    let dtype = (q.dtype(), k.dtype(), v.dtype());
    let label = crate::debug::current_label();
    candle_dtensor_kernels::region::node3_out("cp-attention", q, k, v, y, move |q, k, v, o, g| {
        let _phase = crate::debug::enter_backward_labeled(label.clone());
        // The node's inputs track gradients: computing on them would record a graph that
        // keeps every tile's probabilities alive until the gradients are stored.
        let (q, k, v, o, g) = (q.detach(), k.detach(), v.detach(), o.detach(), g.detach());
        let qf = f32c(&q)?;
        let tiles = QueryTiles::new(&qf, &pq, pk.len())?;
        let back = TileBackward::new(&tiles, &lse, &f32c(&g)?, &f32c(&o)?)?;
        let (kf, vf) = (f32c(&k)?, f32c(&v)?);
        let mut dq = vec![None; tiles.tiles.len()];
        let (dk, dv) = match tiles.grads(&kf, &vf, &pk, causal, scale, &back, &mut dq)? {
            Some(d) => d,
            None => (kf.zeros_like()?, vf.zeros_like()?),
        };
        Ok((
            tiles.join_dq(dq)?.to_dtype(dtype.0)?,
            dk.to_dtype(dtype.1)?,
            dv.to_dtype(dtype.2)?,
        ))
    })
}

/// The declared layout, which must be for `ax`'s size when balanced.
fn scoped_layout(ax: &Axis) -> CResult<SeqLayout> {
    match current_layout() {
        (SeqLayout::LoadBalanced, n) if n != ax.n => Err(invalid(
            "sdpa",
            ax.coord,
            format!(
                "the load-balanced layout was declared for {n} context-parallel ranks, but the                  sequence is sharded over `{}` of {} ranks (rule: layout_scope's cp is the size                  of the mesh dim that shards the sequence)",
                ax.name, ax.n
            ),
        )
        .into()),
        (layout, _) => Ok(layout),
    }
}

/// Attention on whole sequences stored in the declared order, when a balanced layout is
/// declared and the mask is causal (`None` otherwise: the plain local kernel applies). The
/// compiler gathers a sharded sequence for strategies that shard the batch or the heads
/// instead; the gathered sequence keeps the stored order, which the causal mask must follow.
pub(crate) fn stored_order_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: f64,
) -> CResult<Option<Tensor>> {
    let (layout, n) = current_layout();
    if !causal || layout != SeqLayout::LoadBalanced || n == 1 {
        return Ok(None);
    }
    let (t, tk) = (q.dim(2)?, k.dim(2)?);
    if tk != t {
        return Err(invalid(
            "sdpa",
            0,
            format!(
                "causal attention of {t} queries over {tk} keys in the load-balanced layout: \
                 the rule is one sequence for both"
            ),
        )
        .into());
    }
    let order = load_balanced_order(t, n)?;
    local_attention(q, k, v, order.clone(), order, causal, scale).map(Some)
}

/// Every rank's positions for a sequence of `t` over `ax`.
fn all_positions(op: &str, t: usize, ax: &Axis, layout: SeqLayout) -> CResult<Vec<Vec<usize>>> {
    (0..ax.n)
        .map(|r| positions(op, t, ax.n, r, layout).map_err(candle_core::Error::from))
        .collect()
}

/// Context-parallel attention of local pieces `q [B, H, Tq, d]`, `k`/`v [B, H, Tk, d]`
/// sharded on dim 2 over `ax` (global length `t`), KV-exchange strategy.
pub(crate) fn kv_exchange(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ax: &Axis,
    t: usize,
    causal: bool,
    scale: f64,
) -> CResult<Tensor> {
    let layout = scoped_layout(ax)?;
    let pos = all_positions("sdpa", t, ax, layout)?;
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        if x.rank() != 4 || x.dim(2)? != pos[ax.coord].len() {
            return Err(invalid(
                "sdpa",
                ax.coord,
                format!(
                    "context-parallel attention over `{}`: {name} piece {:?} does not hold this \
                     rank's {} of {t} positions ({layout:?} layout)",
                    ax.name,
                    x.dims(),
                    pos[ax.coord].len()
                ),
            )
            .into());
        }
    }
    match current_variant() {
        CpVariant::AllGatherKv => {
            let kf = collectives::all_gather(k, ax, 2, t, GatherGrad::ReduceScatter)?;
            let vf = collectives::all_gather(v, ax, 2, t, GatherGrad::ReduceScatter)?;
            let pk: Vec<usize> = pos.iter().flatten().copied().collect();
            local_attention(q, &kf, &vf, pos[ax.coord].clone(), pk, causal, scale)
        }
        CpVariant::Ring => {
            let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
            let (o, lse) = ring_forward(&qd, &kd, &vd, ax, &pos, causal, scale)?;
            let y = o.to_dtype(q.dtype())?;
            drop(o);
            if !(q.track_op() || k.track_op() || v.track_op()) {
                return Ok(y);
            }
            let bax = ax.clone();
            let dtype = (q.dtype(), k.dtype(), v.dtype());
            let label = crate::debug::current_label();
            candle_dtensor_kernels::region::node3_out(
                "ring-attention",
                q,
                k,
                v,
                y,
                move |q, k, v, o, g| {
                    let _phase = crate::debug::enter_backward_labeled(label.clone());
                    // Detached: on the tracked inputs every op would record a graph keeping
                    // each block's probabilities alive until the gradients are stored.
                    let (q, k, v) = (q.detach(), k.detach(), v.detach());
                    let (o, g) = (f32c(&o.detach())?, g.detach());
                    let (dq, dk, dv) =
                        ring_backward(&q, &k, &v, &o, &lse, &g, &bax, &pos, causal, scale)?;
                    Ok((
                        dq.to_dtype(dtype.0)?,
                        dk.to_dtype(dtype.1)?,
                        dv.to_dtype(dtype.2)?,
                    ))
                },
            )
        }
    }
}

/// Context-parallel attention, all-to-all (Ulysses) strategy: pieces sharded on dim 2 (the
/// sequence, global length `t`) are re-sharded to dim 1 (the heads, `h` in all), attended over
/// whole sequences, and re-sharded back.
pub(crate) fn all_to_all_heads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ax: &Axis,
    t: usize,
    causal: bool,
    scale: f64,
) -> CResult<Tensor> {
    let h = q.dim(1)?;
    if h % ax.n != 0 {
        return Err(invalid(
            "sdpa",
            ax.coord,
            format!(
                "all-to-all context parallelism over `{}`: {h} heads over {} ranks; the rule is \
                 cp divides the heads",
                ax.name, ax.n
            ),
        )
        .into());
    }
    let layout = scoped_layout(ax)?;
    let pos = all_positions("sdpa", t, ax, layout)?;
    let order: Vec<usize> = pos.iter().flatten().copied().collect();
    let qh = collectives::all_to_all(q, ax, 2, 1, t, h)?;
    let kh = collectives::all_to_all(k, ax, 2, 1, t, h)?;
    let vh = collectives::all_to_all(v, ax, 2, 1, t, h)?;
    let o = local_attention(&qh, &kh, &vh, order.clone(), order, causal, scale)?;
    collectives::all_to_all(&o, ax, 1, 2, h, t)
}

/// A context-parallel attention strategy, for [`attention`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The KV exchange, as the given variant.
    Exchange(CpVariant),
    /// All-to-all to the heads (Ulysses).
    AllToAll,
}

/// Context-parallel attention with a strategy chosen by the caller instead of the compiler
/// (benchmarks, or a model that knows better): `q [B, H, T, d]`, `k`/`v [B, H, T, d]` sharded
/// on the sequence (dim 2) over exactly one mesh dim of size > 1, the same placements on all
/// three; the output has them too. Differentiable; the layout is [`current_layout`]'s.
pub fn attention(
    q: &crate::DTensor,
    k: &crate::DTensor,
    v: &crate::DTensor,
    causal: bool,
    scale: Option<f64>,
    strategy: Strategy,
) -> crate::Result<crate::DTensor> {
    let rank = q.mesh_rank();
    let pl = q.placements();
    if k.placements() != pl || v.placements() != pl || q.shape().len() != 4 {
        return Err(invalid(
            "cp::attention",
            rank,
            format!(
                "q {:?} {:?}, k {:?}, v {:?}: the rule is 4-D q/k/v with the same placements",
                q.shape(),
                pl,
                k.placements(),
                v.placements()
            ),
        ));
    }
    let ctx = q.ctx();
    let dims: Vec<usize> = (0..pl.len())
        .filter(|&m| pl[m].shard_dim() == Some(2) && ctx.shape[m] > 1)
        .collect();
    let [m] = dims[..] else {
        return Err(invalid(
            "cp::attention",
            rank,
            format!(
                "placements {pl:?}: the rule is the sequence (dim 2) sharded over exactly one \
                 mesh dim of size > 1"
            ),
        ));
    };
    let ax = ctx.axis(q.mesh(), &[m])?;
    let t = q.shape()[2];
    let s = scale.unwrap_or(1.0 / (q.shape()[3] as f64).sqrt());
    let (ql, kl, vl) = (q.to_local(), k.to_local(), v.to_local());
    let y = match strategy {
        Strategy::Exchange(variant) => {
            let _v = variant_scope(variant);
            kv_exchange(ql, kl, vl, &ax, t, causal, s)
        }
        Strategy::AllToAll => all_to_all_heads(ql, kl, vl, &ax, t, causal, s),
    }
    .map_err(|e| invalid("cp::attention", rank, e.to_string()))?;
    let mut shape = q.shape().to_vec();
    shape[3] = v.shape()[3];
    crate::DTensor::from_local_with_shape(&y, q.mesh(), pl, &shape)
}
