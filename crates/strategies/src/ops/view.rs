//! View ops through a dim-map algebra (PyTorch `_view_ops.py`): each output dim is described by
//! a [`DimSpec`] over the input dims, and one generic rule turns specs into rows.
//!
//! * `InputDim(d)`: the output dim is input dim `d` -> `[S(j), S(d)]` (strided shards too).
//! * `Flatten(dims)`: sharding its FIRST (non-singleton) input dim evenly keeps one contiguous
//!   block per rank: `[S(j), S(d0)]`. Sharding a LATER input dim `d_k` cuts every run of the
//!   dims before it alike, which is exactly a strided shard of the flattened dim with split
//!   factor `prod(dims before d_k)` (PyTorch's `_StridedShard`): `[SS(j, sf), S(d_k)]`, even
//!   only when dims follow `d_k` in the group, and with no other mesh dim sharding the result
//!   (a nested strided shard would need another split factor).
//! * `Split(inner, group, id)`: the outermost non-singleton piece keeps the sharding, when the
//!   output dim is sharded evenly (pieces stay contiguous): `[S(j), S(d)]`. The inverse of the
//!   strided flatten: an input `SS(d, sf)` whose split factor is the product of the pieces
//!   before `id` becomes `S(j)` (even only when non-singleton pieces follow), with no other
//!   mesh dim sharding `d`. So `[B, T, C] S(1) -> [B*T, C] SS(0,B) -> [B, T, C] S(1)` is free.
//! * `Singleton`, `NewDim`, `Broadcast`: `R`.
//!
//! `split` / `unbind` (one output per piece): any other dim passes its sharding to every output;
//! the split dim itself must be whole, except for an input `SS(d, k)` split into its `k` equal
//! parts: each part is then exactly `S(d)` (a fused QKV or gate/up projection sharded head by
//! head splits for free).
//!
//! Views never communicate: a sharding that would need hidden communication (PyTorch #179502,
//! `x [12, 8] S(1) -> view(16, 6)`) is simply not a row, so the expander redistributes the input
//! first and `explain` shows it. Every `Partial` passes through (views are linear selections).

use smallvec::SmallVec;

use super::{check_dim, meta, p, s};
use crate::error::{Result, StrategyError};
use crate::op::Op;
use crate::placement::{Placement, ReduceOp};
use crate::spec::{shape_str, Shape, TensorMeta};
use crate::strategy::{StrategyRow, TensorRef};

/// How one output dim is made of input dims.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum DimSpec {
    /// Exactly input dim `d`.
    InputDim(usize),
    /// Input dims (>= 2, non-singleton) flattened together, outermost first.
    Flatten(SmallVec<[usize; 4]>),
    /// Piece `id` of `inner` split into `group`.
    Split {
        /// What is split.
        inner: Box<DimSpec>,
        /// Sizes of the pieces.
        group: Shape,
        /// Which piece.
        id: usize,
    },
    /// A size-1 output dim.
    Singleton,
    /// A new dim (e.g. unsqueeze).
    NewDim,
    /// An input dim of size 1 (or a missing one) broadcast to a larger size.
    Broadcast,
}

fn flatten_new(dims: &[usize], shape: &[usize]) -> DimSpec {
    let kept: SmallVec<[usize; 4]> = dims.iter().copied().filter(|&d| shape[d] != 1).collect();
    match kept.len() {
        0 => DimSpec::Singleton,
        1 => DimSpec::InputDim(kept[0]),
        _ => DimSpec::Flatten(kept),
    }
}

fn split_new(inner: DimSpec, group: &[usize], id: usize) -> DimSpec {
    if group.len() == 1 {
        inner
    } else if group[id] == 1 {
        DimSpec::Singleton
    } else {
        DimSpec::Split {
            inner: Box::new(inner),
            group: Shape::from_slice(group),
            id,
        }
    }
}

/// PyTorch `view_groups`: the dim map of a reshape from `from` to `to` (same numel, > 0).
pub(crate) fn view_groups(from: &[usize], to: &[usize]) -> Vec<DimSpec> {
    let (mut fi, mut ti) = (0usize, 0usize);
    let mut out = Vec::new();
    while fi < from.len() || ti < to.len() {
        let mut from_group: SmallVec<[usize; 4]> = SmallVec::new();
        let mut to_group: Shape = Shape::new();
        let mut f = 1usize;
        if fi < from.len() {
            f = from[fi];
            from_group.push(fi);
            fi += 1;
        }
        let mut t = 1usize;
        if ti < to.len() {
            t = to[ti];
            to_group.push(t);
            ti += 1;
        }
        if f == 1 && t != 1 {
            if !to_group.is_empty() {
                ti -= 1;
                to_group.clear();
            }
        } else if f != 1 && t == 1 {
            if !from_group.is_empty() {
                fi -= 1;
                from_group.clear();
            }
        } else {
            while f != t {
                if f < t && fi < from.len() {
                    f *= from[fi];
                    from_group.push(fi);
                    fi += 1;
                } else if ti < to.len() {
                    t *= to[ti];
                    to_group.push(to[ti]);
                    ti += 1;
                } else {
                    break; // numel mismatch: callers check before
                }
            }
        }
        if !to_group.is_empty() {
            let flat = flatten_new(&from_group, from);
            for i in 0..to_group.len() {
                out.push(split_new(flat.clone(), &to_group, i));
            }
        }
    }
    out
}

/// How one input placement can shard one output dim: the row `[out, inp]` and its conditions.
struct Source {
    inp: Placement,
    out: Placement,
    /// The input dim must be sharded evenly.
    even_in: Option<usize>,
    /// The output dim must be sharded evenly.
    even_out: bool,
    /// No other mesh dim may shard this (tensor, dim).
    sole: Option<TensorRef>,
    /// The row's `StridedShard` variants are valid too.
    strided_ok: bool,
}

impl Source {
    fn plain(inp: Placement, out: Placement) -> Self {
        Source {
            inp,
            out,
            even_in: None,
            even_out: false,
            sole: None,
            strided_ok: false,
        }
    }
}

/// The input placements that can shard output dim `j` described by `spec` (`shape`: the input
/// shape).
fn shard_sources(spec: &DimSpec, j: usize, shape: &[usize]) -> Vec<Source> {
    match spec {
        DimSpec::InputDim(d) => vec![Source {
            strided_ok: true,
            ..Source::plain(s(*d), s(j))
        }],
        DimSpec::Flatten(dims) => dims
            .iter()
            .enumerate()
            .map(|(k, &d)| {
                if k == 0 {
                    Source {
                        even_in: Some(d),
                        ..Source::plain(s(d), s(j))
                    }
                } else {
                    let split_factor = dims[..k].iter().map(|&e| shape[e]).product();
                    Source {
                        even_in: (k + 1 < dims.len()).then_some(d),
                        sole: Some(TensorRef::Output(0)),
                        ..Source::plain(
                            s(d),
                            Placement::StridedShard {
                                dim: j,
                                split_factor,
                            },
                        )
                    }
                }
            })
            .collect(),
        DimSpec::Split { inner, group, id } => {
            let mut v = Vec::new();
            let first = group.iter().position(|&g| g != 1);
            let trailing = group[id + 1..].iter().any(|&g| g != 1);
            if first == Some(*id) {
                // The outermost piece: the inner dim's own first source.
                let (d, even_in) = match inner.as_ref() {
                    DimSpec::InputDim(d) => (Some(*d), None),
                    DimSpec::Flatten(dims) => (dims.first().copied(), dims.first().copied()),
                    _ => (None, None),
                };
                if let Some(d) = d {
                    v.push(Source {
                        even_in,
                        even_out: true,
                        ..Source::plain(s(d), s(j))
                    });
                }
            }
            let split_factor: usize = group[..*id].iter().product();
            if let (DimSpec::InputDim(d), true) = (inner.as_ref(), split_factor > 1) {
                v.push(Source {
                    even_out: trailing,
                    sole: Some(TensorRef::Input(0)),
                    ..Source::plain(
                        Placement::StridedShard {
                            dim: *d,
                            split_factor,
                        },
                        s(j),
                    )
                });
            }
            v
        }
        _ => Vec::new(),
    }
}

fn dim_map(op: &Op, x: &[usize], out: &[usize]) -> Vec<DimSpec> {
    match op {
        Op::Reshape { .. } => {
            if x.iter().product::<usize>() == 0 {
                return vec![DimSpec::NewDim; out.len()];
            }
            view_groups(x, out)
        }
        Op::Transpose { dim0, dim1 } => (0..x.len())
            .map(|j| {
                DimSpec::InputDim(if j == *dim0 {
                    *dim1
                } else if j == *dim1 {
                    *dim0
                } else {
                    j
                })
            })
            .collect(),
        Op::Permute { dims } => dims.iter().map(|&d| DimSpec::InputDim(d)).collect(),
        Op::Squeeze { dim } => (0..x.len())
            .filter(|j| j != dim)
            .map(DimSpec::InputDim)
            .collect(),
        Op::Unsqueeze { dim } => (0..=x.len())
            .map(|j| match j.cmp(dim) {
                std::cmp::Ordering::Less => DimSpec::InputDim(j),
                std::cmp::Ordering::Equal => DimSpec::NewDim,
                std::cmp::Ordering::Greater => DimSpec::InputDim(j - 1),
            })
            .collect(),
        Op::Narrow { dim, start, len } => (0..x.len())
            .map(|j| {
                if j == *dim && !(*start == 0 && *len == x[j]) {
                    DimSpec::NewDim
                } else {
                    DimSpec::InputDim(j)
                }
            })
            .collect(),
        Op::BroadcastAs { shape } => {
            let off = shape.len() - x.len();
            (0..shape.len())
                .map(|j| match j.checked_sub(off) {
                    Some(d) if x[d] == shape[j] => DimSpec::InputDim(d),
                    Some(_) => DimSpec::Broadcast,
                    None => DimSpec::NewDim,
                })
                .collect()
        }
        Op::Flatten { start, end } => {
            let mut v: Vec<DimSpec> = (0..*start).map(DimSpec::InputDim).collect();
            let dims: SmallVec<[usize; 4]> = (*start..=*end).collect();
            v.push(flatten_new(&dims, x));
            v.extend((end + 1..x.len()).map(DimSpec::InputDim));
            v
        }
        _ => Vec::new(),
    }
}

/// `split` / `unbind` output metas.
fn split_metas(op: &Op, x: &TensorMeta) -> Result<Vec<TensorMeta>> {
    let nd = x.ndim();
    match op {
        Op::Split { dim, sizes } => {
            check_dim(op, *dim, nd)?;
            if sizes.is_empty() || sizes.iter().sum::<usize>() != x.shape[*dim] {
                return Err(StrategyError::arg(
                    op,
                    format!(
                        "sizes {:?} do not add up to dim {dim} of {}",
                        sizes.as_slice(),
                        shape_str(&x.shape)
                    ),
                ));
            }
            Ok(sizes
                .iter()
                .map(|&n| {
                    let mut o = x.shape.clone();
                    o[*dim] = n;
                    meta(&o, x.dtype)
                })
                .collect())
        }
        Op::Unbind { dim } => {
            check_dim(op, *dim, nd)?;
            if x.shape[*dim] == 0 {
                return Err(StrategyError::arg(
                    op,
                    format!("dim {dim} of {} is empty", shape_str(&x.shape)),
                ));
            }
            let mut o = x.shape.clone();
            o.remove(*dim);
            Ok(vec![meta(&o, x.dtype); x.shape[*dim]])
        }
        _ => Err(StrategyError::arg(op, "not a split op")),
    }
}

/// `split` / `unbind` rows.
fn split_rows(op: &Op, x: &TensorMeta, n_out: usize) -> Vec<StrategyRow> {
    let (dim, removed) = match op {
        Op::Split { dim, .. } => (*dim, false),
        Op::Unbind { dim } => (*dim, true),
        _ => return Vec::new(),
    };
    let mut rows = Vec::new();
    for d in (0..x.ndim()).filter(|&d| d != dim) {
        let o = if removed && d > dim { d - 1 } else { d };
        rows.push(StrategyRow::new(&vec![s(o); n_out], &[s(d)]));
    }
    if let Op::Split { sizes, .. } = op {
        if n_out > 1 && sizes.iter().all(|&n| n == sizes[0]) {
            let ss = Placement::StridedShard {
                dim,
                split_factor: n_out,
            };
            rows.push(
                StrategyRow::new(&vec![s(dim); n_out], &[ss])
                    .sole(TensorRef::Input(0), dim)
                    .no_strided(),
            );
        }
    }
    for op in ReduceOp::ALL {
        rows.push(StrategyRow::new(&vec![p(op); n_out], &[p(op)]));
    }
    rows
}

pub(super) fn metas(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
    let x = inputs[0];
    if matches!(op, Op::Split { .. } | Op::Unbind { .. }) {
        return split_metas(op, x);
    }
    let xs = &x.shape;
    let nd = xs.len();
    let out: Shape = match op {
        Op::Reshape { shape } => {
            if shape.iter().product::<usize>() != x.numel() {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "cannot view {} as {} (numel differs)",
                        shape_str(xs),
                        shape_str(shape)
                    ),
                ));
            }
            shape.clone()
        }
        Op::Transpose { dim0, dim1 } => {
            check_dim(op, *dim0, nd)?;
            check_dim(op, *dim1, nd)?;
            let mut o = xs.clone();
            o.swap(*dim0, *dim1);
            o
        }
        Op::Permute { dims } => {
            let mut seen = vec![false; nd];
            if dims.len() != nd
                || dims
                    .iter()
                    .any(|&d| d >= nd || std::mem::replace(&mut seen[d], true))
            {
                return Err(StrategyError::arg(
                    op,
                    format!("{dims:?} is not a permutation of {nd} dims"),
                ));
            }
            dims.iter().map(|&d| xs[d]).collect()
        }
        Op::Squeeze { dim } => {
            check_dim(op, *dim, nd)?;
            if xs[*dim] != 1 {
                return Err(StrategyError::shape(
                    op,
                    format!("dim {dim} of {} is not 1", shape_str(xs)),
                ));
            }
            let mut o = xs.clone();
            o.remove(*dim);
            o
        }
        Op::Unsqueeze { dim } => {
            check_dim(op, *dim, nd + 1)?;
            let mut o = xs.clone();
            o.insert(*dim, 1);
            o
        }
        Op::Narrow { dim, start, len } => {
            check_dim(op, *dim, nd)?;
            if start + len > xs[*dim] {
                return Err(StrategyError::shape(
                    op,
                    format!(
                        "narrow({dim}, {start}, {len}) out of range for {}",
                        shape_str(xs)
                    ),
                ));
            }
            let mut o = xs.clone();
            o[*dim] = *len;
            o
        }
        Op::BroadcastAs { shape } => {
            let ok = shape.len() >= nd
                && xs
                    .iter()
                    .zip(&shape[shape.len() - nd..])
                    .all(|(&a, &b)| a == b || a == 1);
            if !ok {
                return Err(StrategyError::shape(
                    op,
                    format!("cannot broadcast {} to {}", shape_str(xs), shape_str(shape)),
                ));
            }
            shape.clone()
        }
        Op::Flatten { start, end } => {
            check_dim(op, *start, nd)?;
            check_dim(op, *end, nd)?;
            if start > end {
                return Err(StrategyError::arg(op, format!("start {start} > end {end}")));
            }
            let mut o: Shape = xs[..*start].iter().copied().collect();
            o.push(xs[*start..=*end].iter().product());
            o.extend(xs[end + 1..].iter().copied());
            o
        }
        _ => return Err(StrategyError::arg(op, "not a view op")),
    };
    Ok(vec![meta(&out, x.dtype)])
}

pub(super) fn rows(
    op: &Op,
    inputs: &[&TensorMeta],
    outs: &[TensorMeta],
) -> Result<Vec<StrategyRow>> {
    if matches!(op, Op::Split { .. } | Op::Unbind { .. }) {
        return Ok(split_rows(op, inputs[0], outs.len()));
    }
    let shape = &inputs[0].shape;
    let specs = dim_map(op, shape, &outs[0].shape);
    let mut rows = Vec::new();
    for (j, spec) in specs.iter().enumerate() {
        for src in shard_sources(spec, j, shape) {
            let mut row = StrategyRow::new(&[src.out], &[src.inp]);
            if let Some(d) = src.even_in {
                row = row.even(TensorRef::Input(0), d);
            }
            if src.even_out {
                row = row.even(TensorRef::Output(0), j);
            }
            match src.sole {
                Some(TensorRef::Input(i)) => {
                    let d = src.inp.shard_dim().unwrap_or(0);
                    row = row.sole(TensorRef::Input(i), d);
                }
                Some(t) => row = row.sole(t, j),
                None => {}
            }
            if !src.strided_ok {
                row = row.no_strided();
            }
            rows.push(row);
        }
    }
    for op in ReduceOp::ALL {
        rows.push(StrategyRow::new(&[p(op)], &[p(op)]));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{single_dim_strategies, DType};

    fn table(op: &Op, shape: &[usize]) -> Vec<String> {
        let m = TensorMeta::new(shape, DType::F32);
        single_dim_strategies(op, &[&m])
            .unwrap()
            .iter()
            .filter(|r| !r.outputs[0].is_partial())
            .map(|r| {
                format!(
                    "{r}{}",
                    if r.requires_even.is_empty() {
                        ""
                    } else {
                        " even"
                    }
                )
            })
            .collect()
    }

    #[test]
    fn view_groups_examples() {
        assert_eq!(
            view_groups(&[2, 3], &[3, 2]),
            vec![
                DimSpec::Split {
                    inner: Box::new(DimSpec::Flatten(smallvec::smallvec![0, 1])),
                    group: smallvec::smallvec![3, 2],
                    id: 0
                },
                DimSpec::Split {
                    inner: Box::new(DimSpec::Flatten(smallvec::smallvec![0, 1])),
                    group: smallvec::smallvec![3, 2],
                    id: 1
                },
            ]
        );
        assert_eq!(
            view_groups(&[4, 1, 6], &[4, 6]),
            vec![DimSpec::InputDim(0), DimSpec::InputDim(2)]
        );
        assert_eq!(
            view_groups(&[4, 6], &[4, 1, 6]),
            vec![
                DimSpec::InputDim(0),
                DimSpec::Singleton,
                DimSpec::InputDim(1)
            ]
        );
    }

    #[test]
    fn reshape_rows() {
        // [12, 8] -> [16, 6]: only the first flattened dim can stay sharded, evenly (#179502).
        assert_eq!(
            table(
                &Op::Reshape {
                    shape: smallvec::smallvec![16, 6]
                },
                &[12, 8]
            ),
            ["S(0) <- S(0) even"]
        );
        // Flatten [4, 6, 5] -> [24, 5]: sharding the second flattened dim cuts every run of 6
        // alike, a strided shard of the 24 rows with split factor 4 (any evenness).
        assert_eq!(
            table(
                &Op::Reshape {
                    shape: smallvec::smallvec![24, 5]
                },
                &[4, 6, 5]
            ),
            ["S(0) <- S(0) even", "SS(0,4) <- S(1)", "S(1) <- S(2)"]
        );
        // Split [24] -> [4, 6], and its inverse of the strided flatten.
        assert_eq!(
            table(
                &Op::Reshape {
                    shape: smallvec::smallvec![4, 6]
                },
                &[24]
            ),
            ["S(0) <- S(0) even", "S(1) <- SS(0,4)"]
        );
        // Flatten [2, 3, 4] -> [24]: the middle dim needs even shards (dims follow it).
        assert_eq!(
            table(&Op::Flatten { start: 0, end: 2 }, &[2, 3, 4]),
            [
                "S(0) <- S(0) even",
                "SS(0,2) <- S(1) even",
                "SS(0,6) <- S(2)"
            ]
        );
    }

    #[test]
    fn split_and_unbind() {
        let x = TensorMeta::new(&[4, 9], DType::F32);
        let op = Op::Split {
            dim: 1,
            sizes: smallvec::smallvec![3, 3, 3],
        };
        let t: Vec<String> = single_dim_strategies(&op, &[&x])
            .unwrap()
            .iter()
            .filter(|r| !r.outputs[0].is_partial())
            .map(|r| r.to_string())
            .collect();
        assert_eq!(t, ["S(0),S(0),S(0) <- S(0)", "S(1),S(1),S(1) <- SS(1,3)"]);
        let op = Op::Unbind { dim: 0 };
        let rows = single_dim_strategies(&op, &[&x]).unwrap();
        assert_eq!(rows[0].to_string(), "S(0),S(0),S(0),S(0) <- S(1)");
        assert!(Op::Split {
            dim: 1,
            sizes: smallvec::smallvec![3, 3]
        }
        .output_metas(&[&x])
        .is_err());
    }

    #[test]
    fn other_views() {
        assert_eq!(
            table(&Op::Transpose { dim0: 0, dim1: 1 }, &[3, 4]),
            ["S(0) <- S(1)", "S(1) <- S(0)"]
        );
        assert_eq!(table(&Op::Unsqueeze { dim: 0 }, &[3]), ["S(1) <- S(0)"]);
        assert_eq!(
            table(
                &Op::Narrow {
                    dim: 0,
                    start: 1,
                    len: 2
                },
                &[3, 4]
            ),
            ["S(1) <- S(1)"]
        );
        assert_eq!(
            table(
                &Op::BroadcastAs {
                    shape: smallvec::smallvec![2, 3, 4]
                },
                &[1, 4]
            ),
            ["S(2) <- S(1)"]
        );
        assert_eq!(
            table(&Op::Flatten { start: 0, end: 1 }, &[3, 4]),
            ["S(0) <- S(0) even", "SS(0,3) <- S(1)"]
        );
    }
}
