//! The reference executor: per-rank local pieces of a full array for given placements, the
//! planned steps applied one by one on per-rank data (as the runtime would: concat/chunk in group
//! order), and the inverse (reduce partials innermost first, place shards, check every copy).
//!
//! Partial values are split asymmetrically (random summands; for max/min a random owner holds the
//! value and the others smaller/larger values) so a wrong rule cannot pass by coincidence.

use candle_dtensor_strategies::{
    local_indices, local_shape, strided_indices, CollectiveKind, Placement, ReduceOp, Step,
};

use super::{close, mix, Arr};

pub fn coords(mesh: &[usize], rank: usize) -> Vec<usize> {
    let mut c = vec![0; mesh.len()];
    let mut r = rank;
    for m in (0..mesh.len()).rev() {
        c[m] = r % mesh[m];
        r /= mesh[m];
    }
    c
}

pub fn rank_of(mesh: &[usize], c: &[usize]) -> usize {
    c.iter().zip(mesh).fold(0, |acc, (&x, &n)| acc * n + x)
}

fn world(mesh: &[usize]) -> usize {
    mesh.iter().product()
}

fn unit(seed: u64) -> f64 {
    (mix(seed) >> 11) as f64 / (1u64 << 53) as f64
}

/// Part `idx` of `v` split `n` ways for `op`, from `seed` (identical for all parts).
fn split(v: f64, op: ReduceOp, n: usize, idx: usize, seed: u64) -> f64 {
    if n == 1 {
        return v;
    }
    let r = |k: usize| unit(seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let target = if op == ReduceOp::Avg { v * n as f64 } else { v };
            let part = |k: usize| (r(k) * 2.0 - 1.0) * (1.0 + v.abs());
            if idx + 1 < n {
                part(idx)
            } else {
                target - (0..n - 1).map(part).sum::<f64>()
            }
        }
        ReduceOp::Max | ReduceOp::Min => {
            let owner = (mix(seed) % n as u64) as usize;
            if idx == owner {
                v
            } else {
                let d = 0.1 + 2.0 * r(idx);
                if op == ReduceOp::Max {
                    v - d
                } else {
                    v + d
                }
            }
        }
        ReduceOp::Product => {
            let part = |k: usize| 0.5 + 1.5 * r(k);
            if idx + 1 < n {
                part(idx)
            } else {
                v / (0..n - 1).map(part).product::<f64>()
            }
        }
    }
}

pub fn reduce_vals(op: ReduceOp, vals: &[f64]) -> f64 {
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Avg => vals.iter().sum::<f64>() / vals.len() as f64,
        ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => vals.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Product => vals.iter().product(),
    }
}

/// Per-rank local pieces of `full` laid out by `placements`.
pub fn materialize(full: &Arr, placements: &[Placement], mesh: &[usize], seed: u64) -> Vec<Arr> {
    (0..world(mesh))
        .map(|rank| {
            let c = coords(mesh, rank);
            let mut vals = full.clone();
            for (e, v) in vals.data.iter_mut().enumerate() {
                let mut s = mix(seed ^ (e as u64).wrapping_mul(0xA24B_AED4_963E_E407));
                for (m, p) in placements.iter().enumerate() {
                    if let Some(op) = p.reduce_op() {
                        *v = split(*v, op, mesh[m], c[m], s);
                        s = mix(s ^ (c[m] as u64 + 1));
                    }
                }
            }
            let maps: Vec<Vec<usize>> = (0..full.shape.len())
                .map(|d| local_indices(full.shape[d], mesh, &c, placements, d))
                .collect();
            vals.gather_dims(&maps)
        })
        .collect()
}

/// Ranks of the group of `rank` over `dims` (ascending), in flattened (row-major) order.
pub fn group(mesh: &[usize], rank: usize, dims: &[usize]) -> Vec<usize> {
    let base = coords(mesh, rank);
    let n: usize = dims.iter().map(|&d| mesh[d]).product();
    (0..n)
        .map(|g| {
            let mut c = base.clone();
            let mut r = g;
            for &d in dims.iter().rev() {
                c[d] = r % mesh[d];
                r /= mesh[d];
            }
            rank_of(mesh, &c)
        })
        .collect()
}

fn position(mesh: &[usize], rank: usize, dims: &[usize]) -> usize {
    let c = coords(mesh, rank);
    dims.iter().fold(0, |acc, &d| acc * mesh[d] + c[d])
}

fn reduce_arrs(op: ReduceOp, arrs: &[&Arr]) -> Arr {
    let mut out = arrs[0].clone();
    for (e, v) in out.data.iter_mut().enumerate() {
        let vals: Vec<f64> = arrs.iter().map(|a| a.data[e]).collect();
        *v = reduce_vals(op, &vals);
    }
    out
}

/// Applies one planned step to per-rank data, as the runtime would.
pub fn apply_step(locals: &mut [Arr], step: &Step, mesh: &[usize]) -> Result<(), String> {
    let dims = step.mesh_dims.as_slice();
    let n: usize = dims.iter().map(|&d| mesh[d]).product();
    let old = locals.to_vec();
    for rank in 0..locals.len() {
        let g = group(mesh, rank, dims);
        let me = position(mesh, rank, dims);
        let members: Vec<&Arr> = g.iter().map(|&r| &old[r]).collect();
        let new = match step.kind {
            CollectiveKind::Noop => old[rank].clone(),
            CollectiveKind::AllGather => {
                let d = step.from.shard_dim().ok_or("all_gather from a non-shard")?;
                let parts: Vec<Arr> = members.iter().map(|a| (*a).clone()).collect();
                let cat = Arr::concat(&parts, d);
                match step.from {
                    Placement::StridedShard { split_factor, .. } if step.permute => {
                        let l = cat.shape[d];
                        let mut order = Vec::new();
                        for c in 0..n {
                            order.extend(strided_indices(l, split_factor, n, c));
                        }
                        let mut inv = vec![0; l];
                        for (pos, &idx) in order.iter().enumerate() {
                            inv[idx] = pos;
                        }
                        cat.select(d, &inv)
                    }
                    _ => cat,
                }
            }
            CollectiveKind::AllReduce => {
                let op = step
                    .from
                    .reduce_op()
                    .ok_or("all_reduce from a non-partial")?;
                reduce_arrs(op, &members)
            }
            CollectiveKind::ReduceScatter => {
                let op = step
                    .from
                    .reduce_op()
                    .ok_or("reduce_scatter from a non-partial")?;
                let d = step.to.shard_dim().ok_or("reduce_scatter to a non-shard")?;
                reduce_arrs(op, &members).chunk(d, n, me)
            }
            CollectiveKind::AllToAll => {
                let (i, j) = (
                    step.from.shard_dim().ok_or("a2a")?,
                    step.to.shard_dim().ok_or("a2a")?,
                );
                let parts: Vec<Arr> = members.iter().map(|a| (*a).clone()).collect();
                Arr::concat(&parts, i).chunk(j, n, me)
            }
            CollectiveKind::LocalChunk => {
                let d = step.to.shard_dim().ok_or("chunk to a non-shard")?;
                let a = &old[rank];
                match step.to {
                    Placement::StridedShard { split_factor, .. } if step.permute => {
                        a.select(d, &strided_indices(a.shape[d], split_factor, n, me))
                    }
                    _ => a.chunk(d, n, me),
                }
            }
            CollectiveKind::LocalPartition => match step.to {
                Placement::Partial(ReduceOp::Sum) => old[rank].map(|x| x / n as f64),
                Placement::Partial(_) => old[rank].clone(),
                _ => return Err(format!("partition to {}", step.to)),
            },
            CollectiveKind::RmaGet | CollectiveKind::RingExchange => {
                return Err(format!("{} is not a redistribution step", step.kind))
            }
        };
        locals[rank] = new;
    }
    Ok(())
}

/// Reconstructs the full tensor from per-rank locals laid out by `placements`, checking shapes
/// and that every replicated copy agrees.
pub fn assemble(
    locals: &[Arr],
    placements: &[Placement],
    mesh: &[usize],
    global: &[usize],
) -> Result<Arr, String> {
    let mut cur = locals.to_vec();
    for m in (0..mesh.len()).rev() {
        if let Some(op) = placements[m].reduce_op() {
            let old = cur.clone();
            for (rank, slot) in cur.iter_mut().enumerate() {
                let g = group(mesh, rank, &[m]);
                let members: Vec<&Arr> = g.iter().map(|&r| &old[r]).collect();
                if members.iter().any(|a| a.shape != members[0].shape) {
                    return Err(format!(
                        "partial group over mesh dim {m} has different local shapes"
                    ));
                }
                *slot = reduce_arrs(op, &members);
            }
        }
    }
    let mut full = Arr::new(global, vec![f64::NAN; global.iter().product()]);
    let st = super::arr::strides(global);
    for (rank, a) in cur.iter().enumerate() {
        let c = coords(mesh, rank);
        let want = local_shape(global, mesh, &c, placements).map_err(|e| e.to_string())?;
        if a.shape != want.as_slice() {
            return Err(format!(
                "rank {rank} {c:?}: local shape {:?}, want {:?}",
                a.shape,
                want.as_slice()
            ));
        }
        let idx: Vec<Vec<usize>> = (0..global.len())
            .map(|d| local_indices(global[d], mesh, &c, placements, d))
            .collect();
        let mut err = None;
        super::arr::for_each_index(&a.shape, |li| {
            let pos: usize = li.iter().enumerate().map(|(d, &k)| idx[d][k] * st[d]).sum();
            let v = a.at(li);
            let slot = &mut full.data[pos];
            if slot.is_nan() {
                *slot = v;
            } else if !close(*slot, v) && err.is_none() {
                err = Some(format!(
                    "rank {rank} {c:?}: copies disagree at {li:?}: {slot} vs {v}"
                ));
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
    }
    if full.data.iter().any(|v| v.is_nan()) {
        return Err("some elements are held by no rank".into());
    }
    Ok(full)
}

pub fn same(a: &Arr, b: &Arr) -> bool {
    a.shape == b.shape && a.data.iter().zip(&b.data).all(|(&x, &y)| close(x, y))
}
