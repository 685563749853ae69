//! Host-side routing of a mixture of experts: the count table of one step, capacity
//! admission, this rank's send order and the exchange plan over the expert-parallel group.
//! Pure arithmetic on the counts every rank received, so every rank computes the same plan
//! (and the same verdict on bad counts).
//!
//! Vocabulary: a *data rank* is a rank of the count-exchange group (the mesh's data dims,
//! flattened row-major in mesh order, `ep` included), so data rank order is the order of the
//! batch rows; an *assignment* is one (token, slot) pair, slot `s < top_k` being the token's
//! `s`-th choice; an *ep rank* is a coordinate of the `ep` mesh dim, owning the torch.chunk
//! range of experts [`owned_experts`] gives.

use std::sync::Arc;

use candle_dtensor_strategies::layout::shard_size_and_offset;

/// The first `(count, offset)` experts of ep rank `j` of `ep` (torch.chunk: uneven counts,
/// possibly none at the end).
pub fn owned_experts(experts: usize, ep: usize, j: usize) -> (usize, usize) {
    shard_size_and_offset(experts, ep, j)
}

/// The capacity of an expert: `ceil(factor * tokens * top_k / experts)` assignments (the
/// Switch / GShard definition, counting every slot), at least 1.
pub fn capacity(factor: f64, tokens: usize, top_k: usize, experts: usize) -> usize {
    let c = (factor * (tokens * top_k) as f64 / experts.max(1) as f64).ceil();
    (c.max(1.0)) as usize
}

/// One data rank's routing: the expert of every (token, slot), token-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRouting {
    /// Tokens on this rank.
    pub n_tokens: usize,
    /// Choices per token.
    pub top_k: usize,
    /// Experts in all.
    pub experts: usize,
    /// `ids[t * top_k + s]`: the expert of token `t`'s `s`-th choice.
    pub ids: Vec<u32>,
}

impl LocalRouting {
    /// The routing of `n_tokens` tokens with `top_k` choices each among `experts`.
    ///
    /// # Errors
    ///
    /// A wrong number of ids, or an id out of range (the message says which).
    pub fn new(
        ids: Vec<u32>,
        n_tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<Self, String> {
        if ids.len() != n_tokens * top_k {
            return Err(format!(
                "{} expert ids for {n_tokens} tokens x top_k {top_k}",
                ids.len()
            ));
        }
        if let Some((i, &e)) = ids.iter().enumerate().find(|(_, &e)| e as usize >= experts) {
            return Err(format!(
                "token {} slot {} routes to expert {e} of {experts}",
                i / top_k.max(1),
                i % top_k.max(1)
            ));
        }
        Ok(LocalRouting {
            n_tokens,
            top_k,
            experts,
            ids,
        })
    }

    /// Assignments per (slot, expert): `counts[s * experts + e]`.
    pub fn counts(&self) -> Vec<u32> {
        let mut c = vec![0u32; self.top_k * self.experts];
        for (i, &e) in self.ids.iter().enumerate() {
            c[(i % self.top_k) * self.experts + e as usize] += 1;
        }
        c
    }

    /// The payload this rank contributes to the count exchange: `[layer key, tokens,
    /// counts (slot-major)]`.
    pub fn payload(&self, layer_key: u32) -> Vec<u32> {
        let mut p = Vec::with_capacity(2 + self.top_k * self.experts);
        p.push(layer_key);
        p.push(self.n_tokens as u32);
        p.extend(self.counts());
        p
    }
}

/// What is wrong with a gathered count table (the data rank it is about, and what).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    /// A rank sent the counts of another layer.
    Layer {
        /// The data rank.
        peer: usize,
        /// Its layer key.
        theirs: u32,
        /// The key every other rank sent.
        ours: u32,
    },
    /// A rank's counts of one slot do not add up to its tokens.
    Tokens {
        /// The data rank.
        peer: usize,
        /// The tokens it reports.
        n_tokens: usize,
        /// The slot.
        slot: usize,
        /// The assignments it reports in that slot.
        routed: usize,
    },
    /// The gathered buffer has the wrong length.
    Length {
        /// Its length.
        got: usize,
        /// Ranks x (2 + top_k x experts).
        expected: usize,
    },
}

/// Every data rank's tokens and assignments per (slot, expert), after the count exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountTable {
    /// Experts in all.
    pub experts: usize,
    /// Choices per token.
    pub top_k: usize,
    /// Tokens per data rank.
    pub n_tokens: Vec<usize>,
    /// `counts[(r * top_k + s) * experts + e]`.
    counts: Vec<u32>,
}

impl CountTable {
    /// Parses the gathered payloads of `ranks` data ranks ([`LocalRouting::payload`], in rank
    /// order) and checks them: every rank sent the same layer key (the one most ranks sent)
    /// and counts that add up to its tokens in every slot.
    ///
    /// # Errors
    ///
    /// The first rank whose payload is off, as a [`TableError`] (the same on every rank,
    /// which all parse the same buffer).
    pub fn parse(
        raw: &[u32],
        ranks: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<CountTable, TableError> {
        let per = 2 + top_k * experts;
        if raw.len() != ranks * per {
            return Err(TableError::Length {
                got: raw.len(),
                expected: ranks * per,
            });
        }
        let key_of = |r: usize| raw[r * per];
        let ours = majority((0..ranks).map(key_of));
        let mut n_tokens = Vec::with_capacity(ranks);
        let mut counts = Vec::with_capacity(ranks * top_k * experts);
        for r in 0..ranks {
            let p = &raw[r * per..(r + 1) * per];
            if p[0] != ours {
                return Err(TableError::Layer {
                    peer: r,
                    theirs: p[0],
                    ours,
                });
            }
            let n = p[1] as usize;
            for s in 0..top_k {
                let routed: usize = p[2 + s * experts..2 + (s + 1) * experts]
                    .iter()
                    .map(|&c| c as usize)
                    .sum();
                if routed != n {
                    return Err(TableError::Tokens {
                        peer: r,
                        n_tokens: n,
                        slot: s,
                        routed,
                    });
                }
            }
            n_tokens.push(n);
            counts.extend_from_slice(&p[2..]);
        }
        Ok(CountTable {
            experts,
            top_k,
            n_tokens,
            counts,
        })
    }

    /// The table of one data rank (no exchange: a group of one).
    pub fn single(local: &LocalRouting) -> CountTable {
        CountTable {
            experts: local.experts,
            top_k: local.top_k,
            n_tokens: vec![local.n_tokens],
            counts: local.counts(),
        }
    }

    /// Data ranks.
    pub fn ranks(&self) -> usize {
        self.n_tokens.len()
    }

    /// Tokens over every data rank.
    pub fn total_tokens(&self) -> usize {
        self.n_tokens.iter().sum()
    }

    /// Assignments of data rank `r`, slot `s` to expert `e`.
    pub fn count(&self, r: usize, s: usize, e: usize) -> usize {
        self.counts[(r * self.top_k + s) * self.experts + e] as usize
    }

    /// Assignments to expert `e` over every rank and slot (before any capacity).
    pub fn assigned(&self, e: usize) -> usize {
        (0..self.ranks())
            .flat_map(|r| (0..self.top_k).map(move |s| (r, s)))
            .map(|(r, s)| self.count(r, s, e))
            .sum()
    }
}

/// The value most of `vals` hold (the earliest on ties).
fn majority(vals: impl Iterator<Item = u32> + Clone) -> u32 {
    let mut best = (0u32, 0usize);
    for v in vals.clone() {
        let n = vals.clone().filter(|&w| w == v).count();
        if n > best.1 {
            best = (v, n);
        }
    }
    best.0
}

/// Which assignments the experts keep: with a capacity `C`, expert `e` keeps its first `C`
/// assignments in priority order (every rank's first choices before any second choice, as
/// GShard; within a slot, data rank order, then token order: the single-device order of the
/// batch), and drops the rest (those tokens pass the layer on the residual only). Without a
/// capacity everything is kept (dropless).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// `kept[(r * top_k + s) * experts + e]`: the kept assignments of (rank, slot, expert),
    /// always the first ones in token order.
    kept: Vec<usize>,
    top_k: usize,
    experts: usize,
}

impl Admission {
    /// Admits `table`'s assignments under `capacity` (`None`: dropless).
    pub fn new(table: &CountTable, capacity: Option<usize>) -> Admission {
        let (k, e_n, ranks) = (table.top_k, table.experts, table.ranks());
        let mut kept = vec![0usize; ranks * k * e_n];
        for e in 0..e_n {
            let mut before = 0usize;
            for s in 0..k {
                for r in 0..ranks {
                    let c = table.count(r, s, e);
                    kept[(r * k + s) * e_n + e] = match capacity {
                        None => c,
                        Some(cap) => c.min(cap.saturating_sub(before)),
                    };
                    before += c;
                }
            }
        }
        Admission {
            kept,
            top_k: k,
            experts: e_n,
        }
    }

    /// Kept assignments of data rank `r`, slot `s`, expert `e`.
    pub fn kept(&self, r: usize, s: usize, e: usize) -> usize {
        self.kept[(r * self.top_k + s) * self.experts + e]
    }

    /// Kept assignments of data rank `r` to expert `e` (all slots): the rows it sends there.
    pub fn rows(&self, r: usize, e: usize) -> usize {
        (0..self.top_k).map(|s| self.kept(r, s, e)).sum()
    }

    /// Kept assignments of expert `e` over every rank.
    pub fn kept_by_expert(&self, e: usize) -> usize {
        let ranks = self.kept.len() / (self.top_k * self.experts).max(1);
        (0..ranks).map(|r| self.rows(r, e)).sum()
    }
}

/// The expert-parallel group as the routing sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpLayout {
    /// The data rank of every ep rank (in ep order) of this rank's group.
    pub peers: Vec<usize>,
    /// This rank's ep coordinate.
    pub me: usize,
    /// Experts in all.
    pub experts: usize,
}

impl EpLayout {
    /// The ep size.
    pub fn size(&self) -> usize {
        self.peers.len()
    }

    /// `(count, first)` of the experts ep rank `j` owns.
    pub fn owned(&self, j: usize) -> (usize, usize) {
        owned_experts(self.experts, self.size(), j)
    }
}

/// A run of received rows that one local expert computes: rows `start..start + len` of the
/// receive buffer go through local expert `expert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// First row.
    pub start: usize,
    /// Rows.
    pub len: usize,
    /// Local expert index (0 = the first expert this rank owns).
    pub expert: usize,
}

/// Everything one forward of the layer needs, derived from the count table.
#[derive(Debug, Clone)]
pub struct DispatchPlan {
    /// For each send row (expert-major, token order within an expert, kept assignments
    /// only): `token * top_k + slot`.
    pub send_slots: Arc<Vec<u32>>,
    /// For each send row: its token.
    pub send_tokens: Arc<Vec<u32>>,
    /// Rows from ep rank `i` to ep rank `j` (the same matrix on every rank of the group).
    pub matrix: Vec<Vec<usize>>,
    /// The receive buffer (source-major, expert-major within a source) as runs per local
    /// expert.
    pub segments: Arc<Vec<Segment>>,
    /// Kept assignments per expert, over every data rank.
    pub kept_per_expert: Vec<usize>,
    /// Assignments dropped by the capacity, over every data rank.
    pub dropped: usize,
    /// Fraction of all assignments routed to each expert (before the capacity): the `f_i`
    /// of the load-balancing loss.
    pub fractions: Vec<f64>,
}

/// The plan of data rank `me` routing `local` (its row of `table`) under `admission`.
pub fn plan(
    table: &CountTable,
    admission: &Admission,
    local: &LocalRouting,
    me: usize,
    ep: &EpLayout,
) -> DispatchPlan {
    let (k, e_n) = (table.top_k, table.experts);
    // Send order: bucket each kept assignment by expert, tokens in order.
    let mut buckets: Vec<Vec<u32>> = (0..e_n)
        .map(|e| Vec::with_capacity(admission.rows(me, e)))
        .collect();
    let mut seen = vec![0usize; k * e_n];
    for t in 0..local.n_tokens {
        for s in 0..k {
            let e = local.ids[t * k + s] as usize;
            let i = s * e_n + e;
            if seen[i] < admission.kept(me, s, e) {
                buckets[e].push((t * k + s) as u32);
            }
            seen[i] += 1;
        }
    }
    let send_slots: Vec<u32> = buckets.into_iter().flatten().collect();
    let send_tokens: Vec<u32> = send_slots.iter().map(|&i| i / k as u32).collect();
    let n = ep.size();
    let matrix: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    let (cnt, first) = ep.owned(j);
                    (first..first + cnt)
                        .map(|e| admission.rows(ep.peers[i], e))
                        .sum()
                })
                .collect()
        })
        .collect();
    let (mine, first) = ep.owned(ep.me);
    let mut segments = Vec::with_capacity(n * mine);
    let mut start = 0;
    for i in 0..n {
        for l in 0..mine {
            let len = admission.rows(ep.peers[i], first + l);
            segments.push(Segment {
                start,
                len,
                expert: l,
            });
            start += len;
        }
    }
    let kept_per_expert: Vec<usize> = (0..e_n).map(|e| admission.kept_by_expert(e)).collect();
    let assigned: Vec<usize> = (0..e_n).map(|e| table.assigned(e)).collect();
    let all: usize = assigned.iter().sum();
    DispatchPlan {
        send_slots: Arc::new(send_slots),
        send_tokens: Arc::new(send_tokens),
        matrix,
        segments: Arc::new(segments),
        dropped: all - kept_per_expert.iter().sum::<usize>(),
        kept_per_expert,
        fractions: assigned
            .iter()
            .map(|&a| a as f64 / all.max(1) as f64)
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(ids: &[u32], k: usize, e: usize) -> LocalRouting {
        LocalRouting::new(ids.to_vec(), ids.len() / k, k, e).unwrap()
    }

    #[test]
    fn capacity_keeps_first_choices_first_and_counts_drops() {
        // Two data ranks, 3 tokens each, top-2 over 2 experts, capacity 2 per expert.
        let r0 = routing(&[0, 1, 0, 1, 1, 0], 2, 2);
        let r1 = routing(&[0, 1, 1, 0, 0, 1], 2, 2);
        let raw: Vec<u32> = [r0.payload(7), r1.payload(7)].concat();
        let table = CountTable::parse(&raw, 2, 2, 2).unwrap();
        assert_eq!(table.assigned(0), 6);
        let adm = Admission::new(&table, Some(2));
        // Expert 0's first choices: rank 0 tokens 0 and 1 (2 of them) fill it.
        assert_eq!(adm.kept(0, 0, 0), 2);
        assert_eq!(adm.kept(1, 0, 0), 0);
        assert_eq!(adm.kept(0, 1, 0), 0);
        // Expert 1's first choices: rank 0 token 2, rank 1 token 1; then nothing more.
        assert_eq!(adm.kept(0, 0, 1), 1);
        assert_eq!(adm.kept(1, 0, 1), 1);
        assert_eq!(adm.kept(1, 1, 1), 0);
        let ep = EpLayout {
            peers: vec![0, 1],
            me: 0,
            experts: 2,
        };
        let p = plan(&table, &adm, &r0, 0, &ep);
        assert_eq!(p.kept_per_expert, vec![2, 2]);
        assert_eq!(p.dropped, 12 - 4);
        // Rank 0 keeps (t0,s0)->e0, (t1,s0)->e0, (t2,s0)->e1: expert-major, token order.
        assert_eq!(*p.send_slots, vec![0, 2, 4]);
        assert_eq!(*p.send_tokens, vec![0, 1, 2]);
        assert_eq!(p.matrix, vec![vec![2, 1], vec![0, 1]]);
        assert_eq!(
            *p.segments,
            vec![
                Segment {
                    start: 0,
                    len: 2,
                    expert: 0
                },
                Segment {
                    start: 2,
                    len: 0,
                    expert: 0
                }
            ]
        );
    }

    #[test]
    fn dropless_keeps_everything() {
        let r0 = routing(&[2, 0, 1, 2], 1, 3);
        let table = CountTable::single(&r0);
        let adm = Admission::new(&table, None);
        let ep = EpLayout {
            peers: vec![0],
            me: 0,
            experts: 3,
        };
        let p = plan(&table, &adm, &r0, 0, &ep);
        assert_eq!(p.dropped, 0);
        assert_eq!(*p.send_tokens, vec![1, 2, 0, 3]);
        assert_eq!(p.kept_per_expert, vec![1, 1, 2]);
        assert_eq!(p.fractions, vec![0.25, 0.25, 0.5]);
        assert_eq!(capacity(1.0, 4, 1, 3), 2);
        assert_eq!(capacity(1.25, 1024, 2, 8), 320);
    }

    #[test]
    fn bad_tables_name_the_rank() {
        let r0 = routing(&[0, 1], 1, 2);
        let mut bad = routing(&[1, 1], 1, 2).payload(3);
        bad[3] = 5; // 0 + 5 assignments for 2 tokens
        let raw: Vec<u32> = [r0.payload(3), bad.clone(), r0.payload(3)].concat();
        assert_eq!(
            CountTable::parse(&raw, 3, 1, 2),
            Err(TableError::Tokens {
                peer: 1,
                n_tokens: 2,
                slot: 0,
                routed: 5
            })
        );
        let raw: Vec<u32> = [r0.payload(3), r0.payload(3), r0.payload(4)].concat();
        assert_eq!(
            CountTable::parse(&raw, 3, 1, 2),
            Err(TableError::Layer {
                peer: 2,
                theirs: 4,
                ours: 3
            })
        );
        assert!(LocalRouting::new(vec![0, 2], 2, 1, 2).is_err());
    }
}
