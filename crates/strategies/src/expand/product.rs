//! Stage 2 of the expander: exhaustive product expansion with branch-and-bound.
//!
//! The bound of a partial assignment is admissible for the plan cost of every completion:
//! * latency: each assigned mesh dim whose input placements change by communication costs at
//!   least `launch + latency*(n-1)` per input (launch dropped for dims in a flattened group), and
//!   every unassigned dim at least its cheapest row;
//! * bandwidth: that communication moves at least `coef * bytes` where `bytes` is the input's
//!   global size divided by the largest shard factor every OTHER mesh dim can have when that
//!   communication first happens (its source or target placement if assigned, minus those that
//!   nesting forbids while this dim still shards its source tensor dim; the largest any row offers
//!   if unassigned), and `coef`
//!   is the cheapest collective that can make the change (all_to_all `(n-1)/n²` per byte of the
//!   unsharded-on-this-dim size, all_gather / reduce_scatter `(n-1)/n`, all_reduce `2(n-1)/n`,
//!   the latter dropped in flattened groups where a merged all_reduce moves less).
//!
//! Mesh dims are assigned in order of decreasing cheapest-row bound, then decreasing size, so the
//! dims that must communicate are fixed first and their byte bounds tighten as the big dims are
//! assigned.

use smallvec::SmallVec;

use super::{eps, Problem, Solution};
use crate::mesh::MAX_MESH_DIMS;
use crate::placement::Placement;
use crate::transition::{factor, wire_coef};

struct Bounds {
    dims: SmallVec<[usize; 8]>,
    /// `rest[k]`: sum of the cheapest-row latency bounds of `dims[k..]`.
    rest: SmallVec<[f64; 9]>,
    /// `fmax[m][i]`: largest shard factor input i can have on mesh dim m.
    fmax: Vec<SmallVec<[f64; 4]>>,
    in_group: SmallVec<[bool; 8]>,
}

impl Problem<'_> {
    /// Exhaustive product expansion with branch-and-bound (exact).
    pub fn product(&mut self, seed: Option<Solution>) -> Option<Solution> {
        let ndim = self.mesh.ndim();
        let mut rows: SmallVec<[usize; 8]> =
            (0..ndim).map(|m| self.fixed[m].unwrap_or(0)).collect();
        let min_lb = |m: usize| {
            self.order[m]
                .first()
                .map(|&r| self.lb[m][r])
                .unwrap_or(f64::INFINITY)
        };
        let mut dims = self.nontrivial.clone();
        if dims.iter().any(|&m| !min_lb(m).is_finite()) {
            return None;
        }
        dims.sort_by(|&a, &b| {
            min_lb(b)
                .total_cmp(&min_lb(a))
                .then(self.mesh.dim_size(b).cmp(&self.mesh.dim_size(a)))
                .then(a.cmp(&b))
        });
        let mut rest: SmallVec<[f64; 9]> = SmallVec::from_elem(0.0, dims.len() + 1);
        for k in (0..dims.len()).rev() {
            rest[k] = rest[k + 1] + min_lb(dims[k]);
        }
        let n_in = self.srcs.len();
        let fmax = (0..ndim)
            .map(|m| {
                let n = self.mesh.dim_size(m);
                (0..n_in)
                    .map(|i| {
                        let mut f = factor(self.srcs[i][m], n);
                        for &r in &self.order[m] {
                            f = f.max(factor(self.rows[r].inputs[i], n));
                        }
                        f
                    })
                    .collect()
            })
            .collect();
        let in_group = (0..ndim)
            .map(|m| self.mesh.flattened.iter().any(|g| g.contains(&m)))
            .collect();
        let b = Bounds {
            dims,
            rest,
            fmax,
            in_group,
        };
        let mut assigned = [false; MAX_MESH_DIMS];
        // The combinations that keep the current placements (no redistribution) go first: among
        // equal costs they win, so the search only has to look for strictly cheaper ones (ties
        // otherwise keep the first combination found, in the deterministic search order).
        let mut best: Option<(f64, bool, SmallVec<[usize; 8]>)> =
            self.keep_current().map(|(total, rows)| (total, true, rows));
        if let Some(s) = seed {
            if best.as_ref().is_none_or(|(b, _, _)| s.total < *b - eps(*b)) {
                best = Some((s.total, false, s.rows));
            }
        }
        self.dfs(&b, 0, &mut assigned, &mut rows, &mut best);
        best.map(|(total, _, rows)| Solution { rows, total })
    }

    /// Admissible bound of the assigned dims (latency + bandwidth parts).
    fn bound(&self, b: &Bounds, assigned: &[bool], rows: &[usize]) -> f64 {
        let mut total = 0.0;
        for &m in &b.dims {
            if assigned[m] {
                total += self.lb[m][rows[m]];
            }
        }
        for i in 0..self.srcs.len() {
            let global = self.in_ctx[i].shape.iter().product::<usize>() as f64
                * self.in_ctx[i].itemsize as f64;
            if global == 0.0 {
                continue;
            }
            for &m in &b.dims {
                if !assigned[m] {
                    continue;
                }
                let n = self.mesh.dim_size(m);
                let (from, mut to) = (self.srcs[i][m], self.rows[rows[m]].inputs[i]);
                if from == to && self.forced_unshard(b, assigned, rows, i, m) {
                    // Nesting forces this unchanged shard to be lifted (all_gather) and redone.
                    to = Placement::Replicate;
                    total += crate::cost::comm_lower_bound_us(&self.mesh.dims[m], b.in_group[m]);
                }
                let coef = wire_coef(from, to, n, b.in_group[m]);
                if coef == 0.0 {
                    continue;
                }
                // Largest shard factor every other mesh dim can have when dim m first
                // communicates. Nesting: while m still shards tensor dim d (its source), no later
                // dim can shard d and no earlier dim can start sharding d.
                let d = from.shard_dim();
                let mut others = 1.0;
                for &mm in &b.dims {
                    if mm == m {
                        continue;
                    }
                    let nn = self.mesh.dim_size(mm);
                    let src = self.srcs[i][mm];
                    others *= if !assigned[mm] {
                        b.fmax[mm][i]
                    } else {
                        let tgt = self.rows[rows[mm]].inputs[i];
                        let ok = |v: Placement| match d {
                            Some(d) => !v.shards(d) || (mm < m && v == src),
                            None => true,
                        };
                        let mut f = 1.0f64;
                        for v in [src, tgt] {
                            if ok(v) {
                                f = f.max(factor(v, nn));
                            }
                        }
                        f
                    };
                }
                let bw = self.mesh.dims[m].bandwidth_gbps * 1e3;
                total += coef * (global / others) / bw;
            }
        }
        total
    }

    /// Whether input `i` keeps `Shard(d)` on mesh dim `m` while an earlier assigned dim changes
    /// how it shards `d`: that change needs `m` un-sharded first (nesting), i.e. a collective on
    /// `m` even though its placement does not change.
    fn forced_unshard(
        &self,
        b: &Bounds,
        assigned: &[bool],
        rows: &[usize],
        i: usize,
        m: usize,
    ) -> bool {
        let Some(d) = self.srcs[i][m].shard_dim() else {
            return false;
        };
        b.dims.iter().any(|&mm| {
            mm < m && assigned[mm] && {
                let (s, t) = (self.srcs[i][mm], self.rows[rows[mm]].inputs[i]);
                s != t && (s.shards(d) || t.shards(d))
            }
        })
    }

    fn dfs(
        &mut self,
        b: &Bounds,
        depth: usize,
        assigned: &mut [bool; MAX_MESH_DIMS],
        rows: &mut SmallVec<[usize; 8]>,
        best: &mut Option<(f64, bool, SmallVec<[usize; 8]>)>,
    ) {
        if let Some((bt, _, _)) = best {
            // Strictly-better-only: ties keep the first solution found (deterministic order).
            let lb = self.bound(b, assigned, rows) + b.rest[depth];
            if lb >= *bt - eps(*bt) {
                return;
            }
        }
        if depth == b.dims.len() {
            if let Some((total, none)) = self.evaluate(rows) {
                let better = match best {
                    None => true,
                    Some((bt, bnone, _)) => {
                        total < *bt - eps(*bt) || (total <= *bt + eps(*bt) && none && !*bnone)
                    }
                };
                if better {
                    *best = Some((total, none, rows.clone()));
                }
            }
            return;
        }
        let m = b.dims[depth];
        for k in 0..self.order[m].len() {
            let r = self.order[m][k];
            if let Some((bt, _, _)) = best {
                // Rows are sorted by their latency bound: once that alone reaches the best, stop.
                if self.lb[m][r] + b.rest[depth + 1] >= *bt - eps(*bt) {
                    break;
                }
            }
            rows[m] = r;
            assigned[m] = true;
            self.dfs(b, depth + 1, assigned, rows, best);
            assigned[m] = false;
        }
    }
}
