//! How a row-major product is described to a column-major BLAS (cuBLASLt, `crate::cublaslt`):
//! pure index arithmetic, compiled without the `cuda` feature so that its tests run on every
//! machine against a column-major GEMM written out in them.
//!
//! A row-major `[r, c]` matrix is, read column-major, the `[c, r]` matrix with leading
//! dimension `c`: its transpose. So the row-major `C = A B` is computed as the column-major
//! `C^T = B^T A^T`: the BLAS's first operand is the row-major right factor, its second the left
//! one, and its output `[N, M]` (leading dimension N) is `C` row-major.

/// One operand as the BLAS takes it: the stored matrix's rows, columns and leading dimension
/// (column-major), and whether the product uses it transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Mat {
    pub rows: u64,
    pub cols: u64,
    pub ld: u64,
    pub trans: bool,
}

/// The column-major GEMM `D [m, n] = op(A) [m, k] op(B) [k, n]` of a row-major product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ColMajor {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// The BLAS's A: the row-major right factor's buffer.
    pub a: Mat,
    /// The BLAS's B: the row-major left factor's buffer.
    pub b: Mat,
    /// The output, column-major `[m, n]`: the row-major `[n, m]` product.
    pub d: Mat,
}

/// The row-major `C [rows, cols] = L R` with inner dim `inner`, where `L` is the contiguous
/// buffer `l` (`[rows, inner]`) or, with `l_t`, its transpose (`l` stored `[inner, rows]`), and
/// `R` is `r` (`[inner, cols]`) or, with `r_t`, its transpose (`r` stored `[cols, inner]`).
/// The BLAS's A is `r`'s buffer, its B `l`'s.
pub(crate) fn col_major(rows: u64, cols: u64, inner: u64, l_t: bool, r_t: bool) -> ColMajor {
    let (m, n, k) = (cols, rows, inner);
    // `r` stored [inner, cols] row-major is [cols, inner] = [m, k] column-major (ld m): R^T as
    // it is. Stored [cols, inner], it is [k, m] (ld k), used transposed.
    let a = if r_t {
        Mat {
            rows: k,
            cols: m,
            ld: k,
            trans: true,
        }
    } else {
        Mat {
            rows: m,
            cols: k,
            ld: m,
            trans: false,
        }
    };
    // `l` stored [rows, inner] is [k, n] column-major (ld k): L^T as it is. Stored
    // [inner, rows], it is [n, k] (ld n), used transposed.
    let b = if l_t {
        Mat {
            rows: n,
            cols: k,
            ld: n,
            trans: true,
        }
    } else {
        Mat {
            rows: k,
            cols: n,
            ld: k,
            trans: false,
        }
    };
    let d = Mat {
        rows: m,
        cols: n,
        ld: m,
        trans: false,
    };
    ColMajor { m, n, k, a, b, d }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The BLAS's GEMM as documented, element by element: `D[i + j ld_d] = sum_p op(A)[i, p]
    /// op(B)[p, j]`, `op(X)[i, p] = X[i + p ld]`, or `X[p + i ld]` transposed; every index
    /// checked against the stored matrix's rows and columns.
    fn blas_gemm(g: &ColMajor, a: &[f64], b: &[f64]) -> Vec<f64> {
        let at = |mat: &Mat, buf: &[f64], i: u64, p: u64| {
            let (r, c) = if mat.trans { (p, i) } else { (i, p) };
            assert!(
                r < mat.rows && c < mat.cols,
                "index ({r}, {c}) outside {mat:?}"
            );
            assert!(mat.ld >= mat.rows);
            buf[(r + c * mat.ld) as usize]
        };
        let (m, n, k) = (g.m, g.n, g.k);
        // op(A) is m x k and op(B) k x n.
        let (am, ak) = if g.a.trans {
            (g.a.cols, g.a.rows)
        } else {
            (g.a.rows, g.a.cols)
        };
        let (bk, bn) = if g.b.trans {
            (g.b.cols, g.b.rows)
        } else {
            (g.b.rows, g.b.cols)
        };
        assert_eq!((am, ak, bk, bn), (m, k, k, n), "operand shapes of {g:?}");
        assert_eq!((g.d.rows, g.d.cols), (m, n));
        assert_eq!(a.len() as u64, g.a.rows * g.a.cols);
        assert_eq!(b.len() as u64, g.b.rows * g.b.cols);
        let mut d = vec![0.0; (g.d.ld * n) as usize];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    s += at(&g.a, a, i, p) * at(&g.b, b, p, j);
                }
                d[(i + j * g.d.ld) as usize] = s;
            }
        }
        d
    }

    /// Distinct values, so a swapped index shows.
    fn values(len: usize, seed: f64) -> Vec<f64> {
        (0..len)
            .map(|i| seed + i as f64 * 0.37 - (i * i % 7) as f64)
            .collect()
    }

    /// Row-major `[r, c]` transposed to row-major `[c, r]`.
    fn transpose(x: &[f64], r: usize, c: usize) -> Vec<f64> {
        let mut t = vec![0.0; x.len()];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = x[i * c + j];
            }
        }
        t
    }

    #[test]
    fn the_blas_gemm_of_each_layout_is_the_row_major_product() {
        // Uneven shapes, 1s included, every transpose combination: the three a linear uses
        // (forward x w^T, input gradient g w, weight gradient g^T x) and the fourth.
        for (rows, cols, inner) in [(5, 7, 3), (1, 4, 6), (6, 1, 1), (3, 3, 9), (8, 2, 5)] {
            let (r, c, k) = (rows as usize, cols as usize, inner as usize);
            // The logical factors, row-major: L [rows, inner], R [inner, cols].
            let l = values(r * k, 1.0);
            let rr = values(k * c, -2.0);
            let mut want = vec![0.0; r * c];
            for i in 0..r {
                for j in 0..c {
                    want[i * c + j] = (0..k).map(|p| l[i * k + p] * rr[p * c + j]).sum();
                }
            }
            for (l_t, r_t) in [(false, true), (false, false), (true, false), (true, true)] {
                let g = col_major(rows, cols, inner, l_t, r_t);
                // The stored buffers: the factor itself, or its transpose stored contiguous.
                let l_buf = if l_t { transpose(&l, r, k) } else { l.clone() };
                let r_buf = if r_t {
                    transpose(&rr, k, c)
                } else {
                    rr.clone()
                };
                let d = blas_gemm(&g, &r_buf, &l_buf);
                assert_eq!(
                    d, want,
                    "rows {rows} cols {cols} inner {inner} l_t {l_t} r_t {r_t}: the column-major \
                     output read as row-major [rows, cols] is not L R"
                );
            }
        }
    }

    #[test]
    fn a_linear_forward_is_a_transposed_weight_and_a_plain_input() {
        // y [rows, out] = x [rows, in] w^T, w stored [out, in]: the BLAS's A is w used
        // transposed with ld in, its B x as it is with ld in, D [out, rows] with ld out.
        let g = col_major(10, 4, 3, false, true);
        assert_eq!((g.m, g.n, g.k), (4, 10, 3));
        assert_eq!(
            g.a,
            Mat {
                rows: 3,
                cols: 4,
                ld: 3,
                trans: true
            }
        );
        assert_eq!(
            g.b,
            Mat {
                rows: 3,
                cols: 10,
                ld: 3,
                trans: false
            }
        );
        assert_eq!(
            g.d,
            Mat {
                rows: 4,
                cols: 10,
                ld: 4,
                trans: false
            }
        );
    }
}
