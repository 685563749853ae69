//! Stage 3 of the expander: A* (Dijkstra with an admissible heuristic) over per-input placements,
//! starting from the current ones.
//!
//! Heuristic: per non-trivial mesh dim, the cheapest row reachable from the current codes, each
//! input costing its dim's fixed cost + latency when it still has to communicate there. Goals
//! add the op's internal and deferred costs. A goal reached without leaving the optimal frontier
//! is returned at once.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::{eps, Problem, Solution};
use crate::cost::comm_lower_bound_us;
use crate::placement::{Placement, Placements};
use crate::transition::{code_value, for_each_move, initial_code, reach_lb, Move};

impl Problem<'_> {
    /// A* over per-input placements, expanding at most `max_pops` states. `None` if the state
    /// does not fit 128 bits.
    pub fn astar(&mut self, max_pops: usize) -> Option<AStar> {
        let ndim = self.mesh.ndim();
        let n_in = self.srcs.len();
        if n_in * ndim > 32 || self.vals.iter().any(|v| v.len() > 14) {
            return None;
        }
        let opts: Vec<SmallVec<[Placement; 8]>> = self
            .vals
            .iter()
            .map(|v| v.iter().copied().filter(|p| !p.is_replicate()).collect())
            .collect();
        // Initial codes; size-1 dims are frozen at the fixed row's placement.
        let mut start = 0u128;
        let mut srcs_eff: Vec<Placements> = Vec::with_capacity(n_in);
        for i in 0..n_in {
            let mut src = Placements::from_slice(self.srcs[i]);
            for m in 0..ndim {
                if let Some(r) = self.fixed[m] {
                    src[m] = self.rows[r].inputs[i];
                }
                let code = initial_code(src[m]) as u128;
                start |= code << (4 * (i * ndim + m));
            }
            srcs_eff.push(src);
        }
        let decode = |key: u128, i: usize, m: usize| ((key >> (4 * (i * ndim + m))) & 0xf) as u8;
        let comm_lb: SmallVec<[f64; 8]> = (0..ndim)
            .map(|m| {
                let in_group = self.mesh.flattened.iter().any(|g| g.contains(&m));
                comm_lower_bound_us(&self.mesh.dims[m], in_group)
            })
            .collect();
        // A* heuristic: per non-trivial mesh dim, the cheapest row to reach from the codes.
        // reach_lb per (input, mesh dim, code, row) is tabulated lazily.
        let n_rows = self.rows.len();
        let table: std::cell::RefCell<Vec<f64>> =
            std::cell::RefCell::new(vec![f64::NAN; n_in * ndim * 16 * n_rows]);
        let lb_row = |i: usize, m: usize, code: u8, r: usize| -> f64 {
            let k = ((i * ndim + m) * 16 + code as usize) * n_rows + r;
            let mut t = table.borrow_mut();
            if t[k].is_nan() {
                t[k] = reach_lb(
                    srcs_eff[i][m],
                    &opts[i],
                    code,
                    self.rows[r].inputs[i],
                    comm_lb[m],
                );
            }
            t[k]
        };
        let heuristic = |key: u128| -> f64 {
            let mut h = 0.0;
            for &m in &self.nontrivial {
                let mut best_row = f64::INFINITY;
                for r in 0..n_rows {
                    let mut sum = 0.0;
                    for i in 0..n_in {
                        sum += lb_row(i, m, decode(key, i, m), r);
                        if sum >= best_row {
                            break;
                        }
                    }
                    best_row = best_row.min(sum);
                }
                h += best_row;
            }
            h
        };
        let mut best_g: FxHashMap<u128, f64> = FxHashMap::default();
        let mut closed: FxHashSet<u128> = FxHashSet::default();
        let mut heap: BinaryHeap<Entry> = BinaryHeap::new();
        best_g.insert(start, 0.0);
        let h0 = heuristic(start);
        if h0.is_finite() {
            heap.push(Entry {
                f: h0,
                g: 0.0,
                seq: 0,
                key: start,
            });
        }
        let mut seq = 0u64;
        let mut best: Option<(f64, SmallVec<[usize; 8]>)> = None;
        let mut pops = 0usize;
        let mut complete = true;
        let allow_all = |_: usize, _: usize| true;
        while let Some(e) = heap.pop() {
            if let Some((b, _)) = &best {
                // Only a strictly cheaper goal could replace the best one.
                if e.f >= *b - eps(*b) {
                    break;
                }
            }
            if best_g.get(&e.key).is_some_and(|&g| g < e.g) || !closed.insert(e.key) {
                continue;
            }
            pops += 1;
            if pops > max_pops {
                complete = false;
                break;
            }
            let cur: Vec<Placements> = (0..n_in)
                .map(|i| {
                    (0..ndim)
                        .map(|m| code_value(srcs_eff[i][m], &opts[i], decode(e.key, i, m)))
                        .collect()
                })
                .collect();
            if let Some((total, rows)) = self.goal(&cur, e.g) {
                let better = match &best {
                    None => true,
                    Some((b, _)) => total < *b - eps(*b),
                };
                if better {
                    best = Some((total, rows));
                }
            }
            // A goal reached without leaving the optimal frontier (total <= the smallest f in the
            // open list) is optimal: no need to pop it.
            let mut found: Option<(f64, SmallVec<[usize; 8]>)> = None;
            for i in 0..n_in {
                if found.is_some() {
                    break;
                }
                let codes: SmallVec<[u8; 8]> = (0..ndim).map(|m| decode(e.key, i, m)).collect();
                let ctx = self.in_ctx[i];
                let mut push = |mv: Move, code: u8| {
                    if found.is_some() {
                        return;
                    }
                    let mut key = e.key;
                    for &m in &mv.dims {
                        let shift = 4 * (i * ndim + m);
                        key = (key & !(0xfu128 << shift)) | ((code as u128) << shift);
                    }
                    let g = e.g + mv.cost;
                    if closed.contains(&key) || best_g.get(&key).is_some_and(|&old| g >= old) {
                        return;
                    }
                    if g <= e.f + eps(e.f) {
                        let mut next = cur.clone();
                        for &m in &mv.dims {
                            next[i][m] = mv.to;
                        }
                        if let Some((total, rows)) = self.goal(&next, g) {
                            if total <= e.f + eps(e.f) {
                                found = Some((total, rows));
                                return;
                            }
                        }
                    }
                    let h = heuristic(key);
                    if !h.is_finite() {
                        return;
                    }
                    best_g.insert(key, g);
                    seq += 1;
                    heap.push(Entry {
                        f: g + h,
                        g,
                        seq,
                        key,
                    });
                };
                for_each_move(
                    &ctx,
                    &srcs_eff[i],
                    &opts[i],
                    &allow_all,
                    &codes,
                    &cur[i],
                    &mut push,
                );
            }
            if let Some((total, rows)) = found {
                return Some(AStar {
                    best: Some(Solution { rows, total }),
                    complete: true,
                });
            }
        }
        Some(AStar {
            best: best.map(|(total, rows)| Solution { rows, total }),
            complete,
        })
    }

    /// If `cur` (per-input placements) matches rows on every mesh dim, the best such combination.
    fn goal(&self, cur: &[Placements], g: f64) -> Option<(f64, SmallVec<[usize; 8]>)> {
        let matches = self.matching_rows(|i, m| cur[i][m])?;
        self.best_combination(&matches, g, false)
    }
}

/// Result of a (possibly budgeted) A* run.
pub(crate) struct AStar {
    /// The best goal found.
    pub best: Option<Solution>,
    /// Whether the search proved it optimal (did not run out of budget).
    pub complete: bool,
}

#[derive(Clone, Copy, PartialEq)]
struct Entry {
    f: f64,
    g: f64,
    seq: u64,
    key: u128,
}

impl Eq for Entry {}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        other.f.total_cmp(&self.f).then(other.seq.cmp(&self.seq))
    }
}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
