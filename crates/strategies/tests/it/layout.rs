use candle_dtensor_strategies::{
    local_indices, local_shape_and_offset, shard_size_and_offset, strided_indices, Placement::*,
};

use crate::common::exec::coords;

#[test]
fn torch_chunk_table() {
    let got: Vec<(usize, usize)> = (0..4).map(|r| shard_size_and_offset(5, 4, r)).collect();
    assert_eq!(
        got,
        vec![(2, 0), (2, 2), (1, 4), (0, 5)],
        "N=5, n=4: sizes [2,2,1,0], offsets [0,2,4,5]"
    );
    for (n, sizes) in [
        (12, [3, 3, 3, 3]),
        (13, [4, 4, 4, 1]),
        (14, [4, 4, 4, 2]),
        (6, [2, 2, 2, 0]),
    ] {
        let got: Vec<usize> = (0..4).map(|r| shard_size_and_offset(n, 4, r).0).collect();
        assert_eq!(got, sizes, "N={n}");
    }
}

#[test]
fn empty_shards_report_offset_n() {
    let (shape, off) = local_shape_and_offset(&[5, 10], &[4], &[3], &[Shard(0)]).unwrap();
    assert_eq!((shape[0], off[0]), (0, 5));
    let (shape, off) =
        local_shape_and_offset(&[2, 3], &[2, 2], &[1, 1], &[Shard(0), Shard(0)]).unwrap();
    assert_eq!(
        (shape[0], off[0]),
        (0, 2),
        "nested: dp1 holds row 1, tp1 gets nothing"
    );
}

#[test]
fn fsdp_after_tp_15x5_on_4x2() {
    // [15, 5] on mesh (4, 2) with [SS(0, sf=2), S(0)], ranks in row-major coordinate order.
    let p = [
        StridedShard {
            dim: 0,
            split_factor: 2,
        },
        Shard(0),
    ];
    let mut sizes = vec![];
    let mut offs = vec![];
    for rank in 0..8 {
        let c = coords(&[4, 2], rank);
        let (s, o) = local_shape_and_offset(&[15, 5], &[4, 2], &c, &p).unwrap();
        sizes.push(s[0]);
        offs.push(o[0]);
        assert_eq!(s[1], 5);
    }
    assert_eq!(sizes, vec![2, 2, 2, 2, 2, 2, 2, 1]);
    assert_eq!(offs, vec![0, 8, 2, 10, 4, 12, 6, 14]);
}

#[test]
fn fsdp_after_tp_4096_on_30x8() {
    // dtensor.md §8 case 8: size 18 (dp 28 -> 8, dp 29 -> 0); offset = tp*512 + 18*dp.
    let p = [
        StridedShard {
            dim: 0,
            split_factor: 8,
        },
        Shard(0),
    ];
    for dp in 0..30 {
        for tp in 0..8 {
            let (s, o) = local_shape_and_offset(&[4096, 4096], &[30, 8], &[dp, tp], &p).unwrap();
            let want = match dp {
                28 => 8,
                29 => 0,
                _ => 18,
            };
            assert_eq!(s[0], want, "dp {dp} tp {tp}");
            if want > 0 {
                assert_eq!(o[0], tp * 512 + 18 * dp, "dp {dp} tp {tp}");
            } else {
                assert_eq!(o[0], 4096, "empty shard reports the dim size");
            }
            assert_eq!((s[1], o[1]), (4096, 0));
        }
    }
}

#[test]
fn strided_indices_match_local_indices() {
    for len in 0..14 {
        for sf in 1..4 {
            for n in 1..5 {
                let mut all = vec![];
                for c in 0..n {
                    let a = strided_indices(len, sf, n, c);
                    let b = local_indices(
                        len,
                        &[n],
                        &[c],
                        &[StridedShard {
                            dim: 0,
                            split_factor: sf,
                        }],
                        0,
                    );
                    assert_eq!(a, b);
                    all.extend(a);
                }
                all.sort_unstable();
                assert_eq!(all, (0..len).collect::<Vec<_>>(), "a partition of 0..{len}");
            }
        }
    }
}

#[test]
fn nested_shards_partition_the_dim() {
    for len in 0..12 {
        for a in 1..4 {
            for b in 1..4 {
                let mut all = vec![];
                for ca in 0..a {
                    for cb in 0..b {
                        let idx = local_indices(len, &[a, b], &[ca, cb], &[Shard(0), Shard(0)], 0);
                        assert!(
                            idx.windows(2).all(|w| w[1] == w[0] + 1),
                            "plain nesting stays contiguous"
                        );
                        all.extend(idx);
                    }
                }
                assert_eq!(
                    all,
                    (0..len).collect::<Vec<_>>(),
                    "row-major ranks hold rows in order"
                );
            }
        }
    }
}

#[test]
fn layout_errors() {
    assert!(
        local_shape_and_offset(&[4], &[2], &[2], &[Shard(0)]).is_err(),
        "coordinate outside the mesh"
    );
    let e = local_shape_and_offset(&[4, 8], &[2], &[0], &[Shard(3)])
        .unwrap_err()
        .to_string();
    assert_eq!(e, "layout: S(3) on a 2-d tensor [4, 8]");
    assert!(
        local_shape_and_offset(&[4], &[2, 2], &[0, 0], &[Shard(0)]).is_err(),
        "placement count"
    );
}
