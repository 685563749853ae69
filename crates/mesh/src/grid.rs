//! Rank-layout arithmetic of a row-major mesh, as pure functions.
//!
//! On a `(dp=2, tp=2)` mesh the ranks are laid out row-major:
//!
//! ```text
//!            tp=0  tp=1
//!   dp=0  [   0,    1  ]
//!   dp=1  [   2,    3  ]
//! ```
//!
//! Rank 3 has coordinate `[1, 1]`; its `tp` group is `[2, 3]` (same `dp`, every `tp`) and its
//! `dp` group is `[1, 3]`; flattening `[dp, tp]` gives `[0, 1, 2, 3]`.

use smallvec::SmallVec;

/// A mesh coordinate.
pub type Coord = SmallVec<[usize; 4]>;

/// The coordinate of `rank` in a row-major mesh of `shape`.
///
/// ```
/// use candle_dtensor::mesh::grid::unravel;
/// assert_eq!(unravel(3, &[2, 2]).as_slice(), &[1, 1]);
/// assert_eq!(unravel(5, &[2, 3]).as_slice(), &[1, 2]);
/// ```
pub fn unravel(mut rank: usize, shape: &[usize]) -> Coord {
    let mut c: Coord = SmallVec::from_elem(0, shape.len());
    for d in (0..shape.len()).rev() {
        c[d] = rank % shape[d];
        rank /= shape[d];
    }
    c
}

/// The rank at `coord` in a row-major mesh of `shape`.
///
/// ```
/// use candle_dtensor::mesh::grid::ravel;
/// assert_eq!(ravel(&[1, 2], &[2, 3]), 5);
/// ```
pub fn ravel(coord: &[usize], shape: &[usize]) -> usize {
    coord.iter().zip(shape).fold(0, |acc, (&c, &s)| acc * s + c)
}

/// The ranks that share every coordinate of `coord` except those of `dims`, ordered row-major
/// over `dims` in the order given: the group of a mesh dim (one entry in `dims`) or of a
/// flattened set of dims.
///
/// ```
/// use candle_dtensor::mesh::grid::dim_group;
/// // 2x2 mesh, rank 3 = [1, 1]
/// assert_eq!(dim_group(&[1, 1], &[2, 2], &[1]), vec![2, 3]); // its tp group
/// assert_eq!(dim_group(&[1, 1], &[2, 2], &[0]), vec![1, 3]); // its dp group
/// assert_eq!(dim_group(&[1, 1], &[2, 2], &[0, 1]), vec![0, 1, 2, 3]);
/// ```
pub fn dim_group(coord: &[usize], shape: &[usize], dims: &[usize]) -> Vec<usize> {
    let sizes: Vec<usize> = dims.iter().map(|&d| shape[d]).collect();
    let count: usize = sizes.iter().product();
    let mut c: Coord = coord.iter().copied().collect();
    (0..count)
        .map(|i| {
            let sub = unravel(i, &sizes);
            for (k, &d) in dims.iter().enumerate() {
                c[d] = sub[k];
            }
            ravel(&c, shape)
        })
        .collect()
}

/// The index of `coord` within the group of `dims` (row-major over `dims`).
pub fn group_index(coord: &[usize], shape: &[usize], dims: &[usize]) -> usize {
    dims.iter().fold(0, |acc, &d| acc * shape[d] + coord[d])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let shape = [2, 3, 4];
        for r in 0..24 {
            assert_eq!(ravel(&unravel(r, &shape), &shape), r);
        }
    }

    #[test]
    fn groups_partition_the_world() {
        let shape = [2, 3, 2];
        for dims in [
            vec![0],
            vec![1],
            vec![2],
            vec![0, 2],
            vec![1, 2],
            vec![0, 1, 2],
        ] {
            let mut seen = vec![0usize; 12];
            for r in 0..12 {
                let c = unravel(r, &shape);
                let g = dim_group(&c, &shape, &dims);
                assert_eq!(g[group_index(&c, &shape, &dims)], r);
                if g[0] == r {
                    for &m in &g {
                        seen[m] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "dims {dims:?}: {seen:?}");
        }
    }
}
