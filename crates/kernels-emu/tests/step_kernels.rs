//! Kernels of a GPU training step outside the row and attention families, under the emulator:
//! the embedding backward (`crates/kernels/cuda/embedding.cu`), the bias-gradient column sum
//! (`cuda/reduce.cu`), the mixed-precision linear's output pass and a linear's in-place bias add
//! (`cuda/cast.cu`).
//!
//! The embedding backward: each touched row of the table's gradient is its earlier value plus
//! the sum, in position order, of the gradient rows of the positions holding that id, bit for
//! bit (f32 and bf16, the sum in f32); untouched rows and out-of-range ids are left alone; the
//! same bits under every fiber order.
use candle_dtensor_kernels_emu::fused::{self, Dt};
use candle_dtensor_kernels_emu::{same_bits, Buf, ORDERS};
use half::bf16;

/// The kernel's result, computed on the host in the kernel's order.
fn reference<T: Dt>(ids: &[u32], g: &[T], init: &[T], d: usize, vocab: usize) -> Vec<T> {
    let mut out = init.to_vec();
    let mut done = vec![false; vocab];
    for (j, &id) in ids.iter().enumerate() {
        let v = id as usize;
        if v >= vocab || done[v] {
            continue;
        }
        done[v] = true;
        for e in 0..d {
            let mut acc = 0f32;
            for (i, _) in ids.iter().enumerate().skip(j).filter(|(_, &x)| x == id) {
                acc += g[i * d + e].to_f32();
            }
            out[v * d + e] = T::from_f32(out[v * d + e].to_f32() + acc);
        }
    }
    out
}

fn values<T: Dt>(n: usize, seed: u32) -> Vec<T> {
    (0..n)
        .map(|i| {
            T::from_f32((((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

fn case<T: Dt>(ids: &[u32], d: usize, vocab: usize) {
    let g = values::<T>(ids.len() * d, 7);
    let init = values::<T>(vocab * d, 11);
    let want = reference(ids, &g, &init, d, vocab);
    let mut first: Option<Vec<T>> = None;
    for order in ORDERS {
        let mut dt = Buf::from_slice("dtable", &init);
        fused::embedding_bwd(
            order,
            &Buf::from_slice("ids", ids),
            &Buf::from_slice("g", &g),
            &mut dt,
            d,
            vocab,
        )
        .unwrap();
        let got = dt.as_slice().to_vec();
        assert!(
            same_bits(&got, &want),
            "{} n={} d={d} vocab={vocab} {order:?}: differs from the reference",
            T::NAME,
            ids.len()
        );
        if let Some(f) = &first {
            assert!(
                same_bits(f, &got),
                "{order:?}: another order gave other bits"
            );
        }
        first = Some(got);
    }
}

/// Ids with repeats: a small vocabulary over many positions (several shared-memory chunks of
/// ids, a token repeated hundreds of times), a head dim over two column passes, ids past the
/// vocabulary (`u32::MAX` among them), a single position.
#[test]
fn the_embedding_backward_sums_each_ids_rows_in_order() {
    let many: Vec<u32> = (0..2500u32).map(|i| (i * 7 + i / 13) % 37).collect();
    for (ids, d, vocab) in [
        (many.clone(), 20, 37),
        (vec![3, 1, 3, 3, 0, 9, 1], 1100, 12),
        (vec![5, 40, 5, 2, 41], 33, 40),
        // u32::MAX: the id a vocab-parallel lookup gives other shards' positions.
        (vec![u32::MAX, 2, u32::MAX, 0, 2, u32::MAX], 9, 3),
        (vec![0], 7, 1),
    ] {
        case::<f32>(&ids, d, vocab);
        case::<bf16>(&ids, d, vocab);
    }
}

/// A NaN in one position's gradient reaches its id's row only.
#[test]
fn a_nan_gradient_reaches_only_its_row() {
    let ids = [2u32, 0, 2, 1];
    let d = 5;
    let mut g = values::<f32>(ids.len() * d, 3);
    g[2 * d + 4] = f32::NAN; // position 2, id 2, column 4
    let mut dt = Buf::filled("dtable", 3 * d, 0f32);
    fused::embedding_bwd(
        ORDERS[0],
        &Buf::from_slice("ids", &ids),
        &Buf::from_slice("g", &g),
        &mut dt,
        d,
        3,
    )
    .unwrap();
    let out = dt.as_slice();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(v.is_nan(), i == 2 * d + 4, "element {i}: {v}");
    }
}

/// The CUDA op launches the kernel with the block size run here.
#[test]
fn the_cuda_op_launches_the_embedding_backward_as_tested_here() {
    assert_eq!(
        candle_dtensor_kernels::fused::EMBEDDING_BWD_THREADS,
        fused::EMB_THREADS
    );
}

/// The column sum's result on the host, in the kernels' order: rows in order within each chunk
/// of `COL_SUM_ROWS`, then the chunks' partials in order.
fn col_sum_reference<T: Dt>(x: &[T], rows: usize, n: usize) -> Vec<T> {
    (0..n)
        .map(|c| {
            let mut total = 0f32;
            for r0 in (0..rows.max(1)).step_by(fused::COL_SUM_ROWS) {
                let mut part = 0f32;
                for r in r0..(r0 + fused::COL_SUM_ROWS).min(rows) {
                    part += x[r * n + c].to_f32();
                }
                total += part;
            }
            T::from_f32(total)
        })
        .collect()
}

fn col_sum_case<T: Dt>(rows: usize, n: usize) {
    let x = values::<T>(rows * n, 5);
    let want = col_sum_reference(&x, rows, n);
    for order in ORDERS {
        let mut out = Buf::filled("out", n, T::from_f32(f32::NAN));
        fused::col_sum(order, &Buf::from_slice("x", &x), &mut out, rows, n).unwrap();
        assert!(
            same_bits(out.as_slice(), &want),
            "{} rows={rows} n={n} {order:?}: differs from the reference",
            T::NAME
        );
    }
}

/// The bias-gradient column sum (`cuda/reduce.cu`): one row, rows within one chunk, several
/// chunks with a ragged last one, columns past one block; no rows gives zeros.
#[test]
fn the_column_sum_adds_rows_in_chunk_order() {
    for (rows, n) in [(1, 5), (100, 300), (600, 33), (257, 1)] {
        col_sum_case::<f32>(rows, n);
        col_sum_case::<bf16>(rows, n);
    }
    let mut out = Buf::filled("out", 4, f32::NAN);
    fused::col_sum(ORDERS[0], &Buf::from_slice("x", &[0f32; 0]), &mut out, 0, 4).unwrap();
    assert_eq!(out.as_slice(), [0.0; 4]);
}

/// The CUDA op launches the column sum with the block and chunk sizes run here.
#[test]
fn the_cuda_op_launches_the_column_sum_as_tested_here() {
    assert_eq!(
        (
            candle_dtensor_kernels::fused::COL_SUM_THREADS,
            candle_dtensor_kernels::fused::COL_SUM_ROWS
        ),
        (fused::COL_SUM_THREADS, fused::COL_SUM_ROWS)
    );
}

/// The mixed-precision linear's output pass (`cuda/cast.cu`): the bf16 product widened exactly
/// and the bias added in f32, with and without a bias, a grid smaller than the elements.
#[test]
fn the_cast_and_bias_add_is_one_exact_pass() {
    use candle_dtensor_kernels_emu::Launch;
    let (rows, n) = (13, 7);
    let y = values::<bf16>(rows * n, 9);
    let b = values::<f32>(n, 4);
    for bias in [Some(&b), None] {
        let want: Vec<f32> = y
            .iter()
            .enumerate()
            .map(|(i, v)| v.to_f32() + bias.map_or(0.0, |b| b[i % n]))
            .collect();
        for order in ORDERS {
            let mut out = Buf::filled("out", rows * n, f32::NAN);
            let bb = bias.map(|b| Buf::from_slice("b", b));
            fused::cast_add_rows(
                &Launch::linear(2, 32, 0),
                order,
                &Buf::from_slice("y", &y),
                bb.as_ref(),
                &mut out,
                n,
            )
            .unwrap();
            assert!(
                same_bits(out.as_slice(), &want),
                "bias {} {order:?}",
                bias.is_some()
            );
        }
    }
}

/// A linear's bias added in place (`cuda/cast.cu`): each element the f32 sum of itself and its
/// column's bias, rounded once, a grid smaller than the elements.
#[test]
fn the_bias_is_added_in_place_row_by_row() {
    use candle_dtensor_kernels_emu::Launch;
    fn check<T: Dt>() {
        let (rows, n) = (11, 9);
        let y = values::<T>(rows * n, 5);
        let b = values::<T>(n, 6);
        let want: Vec<T> = y
            .iter()
            .enumerate()
            .map(|(i, v)| T::from_f32(v.to_f32() + b[i % n].to_f32()))
            .collect();
        for order in ORDERS {
            let mut out = Buf::from_slice("y", &y);
            fused::add_rows(
                &Launch::linear(3, 32, 0),
                order,
                &mut out,
                &Buf::from_slice("b", &b),
                n,
            )
            .unwrap();
            assert!(same_bits(out.as_slice(), &want), "{} {order:?}", T::NAME);
        }
    }
    check::<f32>();
    check::<bf16>();
    // An f32 bias into a bf16 product: the f32 sum, rounded once.
    let (rows, n) = (6, 13);
    let y = values::<bf16>(rows * n, 7);
    let b = values::<f32>(n, 8);
    let want: Vec<bf16> = y
        .iter()
        .enumerate()
        .map(|(i, v)| bf16::from_f32(v.to_f32() + b[i % n]))
        .collect();
    for order in ORDERS {
        let mut out = Buf::from_slice("y", &y);
        fused::add_rows_f32_bias(
            &Launch::linear(2, 32, 0),
            order,
            &mut out,
            &Buf::from_slice("b", &b),
            n,
        )
        .unwrap();
        assert!(
            same_bits(out.as_slice(), &want),
            "bf16 + f32 bias {order:?}"
        );
    }
}
