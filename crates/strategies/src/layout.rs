//! Local shapes and global offsets, exactly as `torch.chunk` (PyTorch
//! `compute_local_shape_and_global_offset`).
//!
//! One tensor dim of global size `N` sharded over `n` ranks: `full = ceil(N/n)`; rank `r` holds
//! `[full*r, min(N, full*(r+1)))`; later ranks may be empty, and an empty shard reports offset `N`
//! (the out-of-bounds sentinel DCP relies on). Mesh dims are walked left to right; a second mesh
//! dim sharding the same tensor dim shards the first one's local piece (nesting).
//! [`Placement::StridedShard`] pieces are explicit index lists (see [`strided_indices`]).
//!
//! Internally an index set along one tensor dim is a short list of contiguous global ranges, so
//! nothing here is sized by the world size.

use smallvec::SmallVec;

use crate::error::{Result, StrategyError};
use crate::placement::{format_placements, Placement};
use crate::spec::{validate_placements, Shape};

/// `(size, offset)` of chunk `idx` when `n_elems` elements are split into `num_chunks` pieces by
/// `torch.chunk`. Empty chunks report offset `n_elems`.
///
/// `N=5, n=4` gives sizes `[2,2,1,0]` and offsets `[0,2,4,5]`. `num_chunks == 0` is treated as 1
/// and an `idx >= num_chunks` gets the empty chunk `(0, n_elems)`.
pub fn shard_size_and_offset(n_elems: usize, num_chunks: usize, idx: usize) -> (usize, usize) {
    let n = num_chunks.max(1);
    if idx >= n {
        return (0, n_elems);
    }
    if n_elems.is_multiple_of(n) {
        let s = n_elems / n;
        return (s, s * idx);
    }
    let full = n_elems.div_ceil(n);
    let start = full * idx;
    if start >= n_elems {
        return (0, n_elems);
    }
    ((n_elems).min(start + full) - start, start)
}

/// Size every chunk is padded to for a collective: `ceil(N/n)`.
pub fn padded_chunk_size(n_elems: usize, num_chunks: usize) -> usize {
    n_elems.div_ceil(num_chunks.max(1))
}

/// Total padded size `ceil(N/n) * n` (the all-gather output / reduce-scatter input length).
pub fn padded_size(n_elems: usize, num_chunks: usize) -> usize {
    padded_chunk_size(n_elems, num_chunks) * num_chunks.max(1)
}

/// Padding rank `idx` appends to its chunk before a collective (`full - size`); the receiver
/// removes it again (`narrow(dim, 0, size)`).
pub fn pad_amount(n_elems: usize, num_chunks: usize, idx: usize) -> usize {
    padded_chunk_size(n_elems, num_chunks) - shard_size_and_offset(n_elems, num_chunks, idx).0
}

/// Positions (within a piece of length `len`) held by coordinate `coord` of a
/// `StridedShard { split_factor }` over `num_chunks` ranks: the piece is chunked into
/// `split_factor` parts, each part into `num_chunks`, and the rank takes its sub-chunk of every part.
///
/// `len=9, sf=2, n=4` gives `[0,1,5]`, `[2,3,6]`, `[4,7]`, `[8]`.
pub fn strided_indices(
    len: usize,
    split_factor: usize,
    num_chunks: usize,
    coord: usize,
) -> Vec<usize> {
    let mut out = Vec::new();
    for seg in Segs::full(len).strided(split_factor, num_chunks, coord).0 {
        out.extend(seg.0..seg.0 + seg.1);
    }
    out
}

/// Local shape and global offset of the shard held by mesh coordinate `coord`.
///
/// Walks mesh dims left to right, nesting repeated sharding of one tensor dim. The offset of a
/// dim is the first global index held (for a `StridedShard` the first of its index list), or the
/// dim's global size when the rank holds nothing of it.
///
/// ```
/// use candle_dtensor::strategies::{local_shape_and_offset, Placement::*};
/// // [15, 5] on a (4, 2) mesh, FSDP-after-TP layout: rank (3, 1) holds row 14 only.
/// let (shape, off) = local_shape_and_offset(
///     &[15, 5], &[4, 2], &[3, 1], &[StridedShard { dim: 0, split_factor: 2 }, Shard(0)]).unwrap();
/// assert_eq!((shape.as_slice(), off.as_slice()), (&[1, 5][..], &[14, 0][..]));
/// ```
///
/// # Errors
/// Placement/mesh/coordinate length mismatch, a coordinate outside the mesh, or an invalid placement.
pub fn local_shape_and_offset(
    global: &[usize],
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<(Shape, Shape)> {
    check_coord(global, mesh_shape, coord, placements)?;
    let mut shape = Shape::from_slice(global);
    let mut offset: Shape = smallvec::smallvec![0; global.len()];
    for d in 0..global.len() {
        if !placements.iter().any(|p| p.shards(d)) {
            continue;
        }
        let segs = dim_segments(global[d], mesh_shape, coord, placements, d);
        shape[d] = segs.len();
        offset[d] = segs.first_or(global[d]);
    }
    Ok((shape, offset))
}

/// Local shape only (see [`local_shape_and_offset`]).
///
/// # Errors
/// As [`local_shape_and_offset`].
pub fn local_shape(
    global: &[usize],
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<Shape> {
    Ok(local_shape_and_offset(global, mesh_shape, coord, placements)?.0)
}

/// The global indices along `tensor_dim` (of global size `global_dim`) that coordinate `coord`
/// holds, in local order. Needed for `StridedShard` gathers, masks and checkpoints.
///
/// Placements beyond the shorter of `mesh_shape`/`coord` are ignored; callers validate with
/// [`local_shape_and_offset`] first.
pub fn local_indices(
    global_dim: usize,
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
    tensor_dim: usize,
) -> Vec<usize> {
    let segs = dim_segments(global_dim, mesh_shape, coord, placements, tensor_dim);
    let mut out = Vec::with_capacity(segs.len());
    for &(s, l) in &segs.0 {
        out.extend(s..s + l);
    }
    out
}

fn check_coord(
    global: &[usize],
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<()> {
    validate_placements(placements, global, mesh_shape.len(), "layout")?;
    if coord.len() != mesh_shape.len() || coord.iter().zip(mesh_shape).any(|(c, n)| c >= n) {
        return Err(StrategyError::InvalidArgument {
            op: "layout".into(),
            reason: format!(
                "coordinate {coord:?} is not in mesh {mesh_shape:?} (placements {})",
                format_placements(placements)
            ),
        });
    }
    Ok(())
}

fn dim_segments(
    global_dim: usize,
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
    tensor_dim: usize,
) -> Segs {
    let mut segs = Segs::full(global_dim);
    for ((p, &n), &c) in placements.iter().zip(mesh_shape).zip(coord) {
        match *p {
            Placement::Shard(d) if d == tensor_dim => {
                let (size, off) = shard_size_and_offset(segs.len(), n, c);
                segs = segs.slice(off, size);
            }
            Placement::StridedShard { dim, split_factor } if dim == tensor_dim => {
                segs = segs.strided(split_factor, n, c);
            }
            _ => {}
        }
    }
    segs
}

/// A list of contiguous global index ranges `(start, len)`, in local order.
#[derive(Clone, Debug)]
struct Segs(SmallVec<[(usize, usize); 4]>);

impl Segs {
    fn full(n: usize) -> Segs {
        let mut v = SmallVec::new();
        if n > 0 {
            v.push((0, n));
        }
        Segs(v)
    }

    fn len(&self) -> usize {
        self.0.iter().map(|s| s.1).sum()
    }

    fn first_or(&self, empty: usize) -> usize {
        self.0.first().map(|s| s.0).unwrap_or(empty)
    }

    fn push(&mut self, start: usize, len: usize) {
        if len == 0 {
            return;
        }
        if let Some(last) = self.0.last_mut() {
            if last.0 + last.1 == start {
                last.1 += len;
                return;
            }
        }
        self.0.push((start, len));
    }

    /// Positions `[pos, pos+len)` of this list.
    fn slice(&self, pos: usize, len: usize) -> Segs {
        let mut out = Segs(SmallVec::new());
        let (mut skip, mut want) = (pos, len);
        for &(s, l) in &self.0 {
            if want == 0 {
                break;
            }
            if skip >= l {
                skip -= l;
                continue;
            }
            let take = (l - skip).min(want);
            out.push(s + skip, take);
            skip = 0;
            want -= take;
        }
        out
    }

    fn strided(&self, split_factor: usize, n: usize, c: usize) -> Segs {
        let total = self.len();
        let sf = split_factor.max(1);
        let mut out = Segs(SmallVec::new());
        for j in 0..sf {
            let (psize, poff) = shard_size_and_offset(total, sf, j);
            let (ssize, soff) = shard_size_and_offset(psize, n, c);
            if ssize == 0 {
                continue;
            }
            for &(s, l) in &self.slice(poff + soff, ssize).0 {
                out.push(s, l);
            }
        }
        out
    }
}

/// Size of coordinate 0's piece (the largest) of a dim of length `len` under placement `p` on a
/// mesh dim of size `n`. Used for byte estimates; O(split_factor) for strided shards.
pub(crate) fn coord0_size(len: usize, n: usize, p: &Placement) -> usize {
    match *p {
        Placement::Shard(_) => shard_size_and_offset(len, n, 0).0,
        Placement::StridedShard { split_factor, .. } => {
            let sf = split_factor.max(1);
            (0..sf)
                .map(|j| shard_size_and_offset(shard_size_and_offset(len, sf, j).0, n, 0).0)
                .sum()
        }
        _ => len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    #[test]
    fn chunk_table() {
        let sizes: Vec<_> = (0..4).map(|r| shard_size_and_offset(5, 4, r)).collect();
        assert_eq!(sizes, vec![(2, 0), (2, 2), (1, 4), (0, 5)]);
        let s13: Vec<_> = (0..4).map(|r| shard_size_and_offset(13, 4, r).0).collect();
        assert_eq!(s13, vec![4, 4, 4, 1]);
        let s6: Vec<_> = (0..4).map(|r| shard_size_and_offset(6, 4, r).0).collect();
        assert_eq!(s6, vec![2, 2, 2, 0]);
        assert_eq!(shard_size_and_offset(0, 3, 1), (0, 0));
        assert_eq!(padded_size(5, 4), 8);
        assert_eq!(pad_amount(5, 4, 3), 2);
    }

    #[test]
    fn strided_docstring_example() {
        let got: Vec<_> = (0..4).map(|c| strided_indices(9, 2, 4, c)).collect();
        assert_eq!(got, vec![vec![0, 1, 5], vec![2, 3, 6], vec![4, 7], vec![8]]);
    }

    #[test]
    fn nested_plain_shards() {
        // [[0..4],[10..14]] on mesh (2,2) with (S(1),S(1)): PyTorch docstring.
        let mut shapes = vec![];
        let mut offs = vec![];
        for a in 0..2 {
            for b in 0..2 {
                let (s, o) =
                    local_shape_and_offset(&[2, 5], &[2, 2], &[a, b], &[Shard(1), Shard(1)])
                        .unwrap();
                shapes.push(s.to_vec());
                offs.push(o.to_vec());
            }
        }
        assert_eq!(shapes, vec![vec![2, 2], vec![2, 1], vec![2, 1], vec![2, 1]]);
        assert_eq!(offs, vec![vec![0, 0], vec![0, 2], vec![0, 3], vec![0, 4]]);
    }

    #[test]
    fn coord0_is_largest() {
        for len in 0..20 {
            for n in 1..5 {
                for p in [
                    Shard(0),
                    StridedShard {
                        dim: 0,
                        split_factor: 2,
                    },
                    StridedShard {
                        dim: 0,
                        split_factor: 3,
                    },
                ] {
                    let max = (0..n)
                        .map(|c| local_indices(len, &[n], &[c], &[p], 0).len())
                        .max()
                        .unwrap_or(0);
                    assert_eq!(coord0_size(len, n, &p), max, "len {len} n {n} {p}");
                }
            }
        }
    }
}
