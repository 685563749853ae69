//! Pure decisions of the NCCL backend: dtype and reduce-op mapping, split colors and keys, and
//! the NCCL calls each operation enqueues (its *plan*). Plans depend on [`Gates`] (native
//! all-to-all, gather and scatter on NCCL >= 2.28.3, grouped send/recv below) and are plain
//! [`Call`] lists, so the address arithmetic is unit-tested without a GPU.

use candle_core::DType;

use super::api::{Call, DataType, DevPtr, RedOp};
use super::version::Gates;
use candle_dtensor_comm_core::ReduceOp;

/// `NCCL_SPLIT_NOCOLOR`.
pub const SPLIT_NOCOLOR: i32 = -1;

/// The NCCL type of a candle dtype (the dtypes collectives accept), or `None`.
pub fn data_type(dtype: DType) -> Option<DataType> {
    Some(match dtype {
        DType::F32 => DataType::Float32,
        DType::F64 => DataType::Float64,
        DType::BF16 => DataType::Bfloat16,
        DType::F16 => DataType::Float16,
        DType::I64 => DataType::Int64,
        DType::U32 => DataType::Uint32,
        DType::U8 => DataType::Uint8,
        _ => None?,
    })
}

/// The NCCL reduction of `op` on `dtype`, or why there is none. `Avg` is NCCL's native
/// `ncclAvg`, defined for floating-point types only (the front rejects it on integers first).
pub fn red_op(op: ReduceOp, dtype: DType) -> Result<RedOp, String> {
    Ok(match op {
        ReduceOp::Sum => RedOp::Sum,
        ReduceOp::Product => RedOp::Prod,
        ReduceOp::Max => RedOp::Max,
        ReduceOp::Min => RedOp::Min,
        ReduceOp::Avg if dtype.is_float() => RedOp::Avg,
        ReduceOp::Avg => {
            return Err(format!(
                "reduce op avg is defined for floating-point dtypes only, got {dtype:?}"
            ))
        }
    })
}

/// `(color, key)` for `ncclCommSplit` from the caller's group list: color = the smallest rank
/// of the group (the same on every member), key = the caller's position in the list (the list
/// order defines the new ranks); an empty list opts out (`NCCL_SPLIT_NOCOLOR`).
///
/// # Errors
///
/// When a non-empty list does not contain `me` (the front checks this first).
pub fn split_color_key(ranks: &[usize], me: usize) -> Result<(i32, i32), String> {
    if ranks.is_empty() {
        return Ok((SPLIT_NOCOLOR, 0));
    }
    let key = ranks
        .iter()
        .position(|&r| r == me)
        .ok_or_else(|| format!("split list {ranks:?} does not contain the caller (rank {me})"))?;
    let color = ranks.iter().copied().min().unwrap_or(0);
    let color = i32::try_from(color).map_err(|_| format!("rank {color} exceeds i32"))?;
    Ok((color, key as i32))
}

/// Encodes a split list for the validating all-gather: `[len, r0, r1, .., u32::MAX padding]`,
/// `size + 1` entries.
pub fn encode_split_list(ranks: &[usize], size: usize) -> Vec<u32> {
    let mut v = vec![u32::MAX; size + 1];
    v[0] = ranks.len() as u32;
    for (i, &r) in ranks.iter().take(size).enumerate() {
        v[i + 1] = r as u32;
    }
    v
}

/// Decodes the all-gathered split lists of every rank (see [`encode_split_list`]).
pub fn decode_split_lists(all: &[u32], size: usize) -> Result<Vec<Vec<usize>>, String> {
    if all.len() != size * (size + 1) {
        return Err(format!(
            "split list exchange returned {} entries, expected {}",
            all.len(),
            size * (size + 1)
        ));
    }
    all.chunks(size + 1)
        .enumerate()
        .map(|(r, row)| {
            let n = row[0] as usize;
            if n > size {
                return Err(format!("rank {r} sent a split list of length {n}"));
            }
            Ok(row[1..=n].iter().map(|&x| x as usize).collect())
        })
        .collect()
}

/// The plan of `all_to_all_single`: `chunk` elements to and from every one of `n` peers.
/// Native `ncclAlltoAll` when the library has it, else one group of send/recv pairs (a rank's
/// own chunk included: NCCL copies it locally).
pub fn all_to_all(
    gates: &Gates,
    send: DevPtr,
    recv: DevPtr,
    chunk: usize,
    dt: DataType,
    n: usize,
) -> Vec<Call> {
    if gates.all_to_all {
        return vec![Call::AllToAll {
            send,
            recv,
            count: chunk,
            dt,
        }];
    }
    let bytes = (chunk * dt.size()) as u64;
    (0..n)
        .flat_map(|p| {
            [
                Call::send(send + p as u64 * bytes, chunk, dt, p),
                Call::recv(recv + p as u64 * bytes, chunk, dt, p),
            ]
        })
        .collect()
}

/// The plan of `all_to_all_v_single`: `in_rows[p]` rows of `row` elements go to peer `p` (taken
/// in order from `send`), `out_rows[p]` rows come from peer `p` (placed in order in `recv`).
/// Empty transfers are skipped (the peer skips its matching one too).
pub fn all_to_all_v(
    send: DevPtr,
    recv: DevPtr,
    in_rows: &[usize],
    out_rows: &[usize],
    row: usize,
    dt: DataType,
) -> Vec<Call> {
    let row_bytes = (row * dt.size()) as u64;
    let mut calls = Vec::new();
    let (mut s_off, mut r_off) = (0u64, 0u64);
    for (p, (&i, &o)) in in_rows.iter().zip(out_rows).enumerate() {
        if i > 0 && row > 0 {
            calls.push(Call::send(send + s_off, i * row, dt, p));
        }
        if o > 0 && row > 0 {
            calls.push(Call::recv(recv + r_off, o * row, dt, p));
        }
        s_off += i as u64 * row_bytes;
        r_off += o as u64 * row_bytes;
    }
    calls
}

/// A rooted exchange of equal pieces of `count` elements of `dt` between each of `n` ranks and
/// `root`, as seen by rank `me`: `send` and `recv` as the native NCCL call takes them (the
/// root's side holds `n` pieces back to back).
#[derive(Debug, Clone, Copy)]
pub struct Rooted {
    pub send: DevPtr,
    pub recv: DevPtr,
    pub count: usize,
    pub dt: DataType,
    pub root: usize,
    pub me: usize,
    pub n: usize,
}

impl Rooted {
    /// The exchange as rank `me` of `n` sees it (the fields in declaration order).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dt: DataType,
        root: usize,
        me: usize,
        n: usize,
    ) -> Rooted {
        Rooted {
            send,
            recv,
            count,
            dt,
            root,
            me,
            n,
        }
    }

    /// The address of piece `p` of the root's `base` buffer.
    fn piece(&self, base: DevPtr, p: usize) -> DevPtr {
        base + (p * self.count * self.dt.size()) as u64
    }

    fn send_to(&self, buf: DevPtr, peer: usize) -> Call {
        Call::send(buf, self.count, self.dt, peer)
    }

    fn recv_from(&self, buf: DevPtr, peer: usize) -> Call {
        Call::recv(buf, self.count, self.dt, peer)
    }
}

/// The plan of a gather to the root: native `ncclGather` when available, else every rank sends
/// its piece to the root, which receives rank `p`'s at piece `p` (its own included).
pub fn gather(gates: &Gates, r: Rooted) -> Vec<Call> {
    let Rooted {
        send,
        recv,
        root,
        me,
        n,
        ..
    } = r;
    if gates.gather_scatter {
        let (count, dt, root) = (r.count, r.dt, root as i32);
        return vec![Call::Gather {
            send,
            recv,
            count,
            dt,
            root,
        }];
    }
    let mut calls = vec![r.send_to(send, root)];
    if me == root {
        calls.extend((0..n).map(|p| r.recv_from(r.piece(recv, p), p)));
    }
    calls
}

/// The plan of a scatter from the root: native `ncclScatter` when available, else the root
/// sends piece `p` to rank `p` (itself included) and every rank receives from the root.
pub fn scatter(gates: &Gates, r: Rooted) -> Vec<Call> {
    let Rooted {
        send,
        recv,
        root,
        me,
        n,
        ..
    } = r;
    if gates.gather_scatter {
        let (count, dt, root) = (r.count, r.dt, root as i32);
        return vec![Call::Scatter {
            send,
            recv,
            count,
            dt,
            root,
        }];
    }
    let mut calls = Vec::new();
    if me == root {
        calls.extend((0..n).map(|p| r.send_to(r.piece(send, p), p)));
    }
    calls.push(r.recv_from(recv, root));
    calls
}

/// The plan of a gather of pieces of different sizes (`counts[p]` elements from rank `p`) to
/// `root`, laid out back to back in `recv`: grouped send/recv (no NCCL collective takes
/// per-rank counts). Empty pieces are skipped on both sides.
pub fn gather_v(
    send: DevPtr,
    recv: DevPtr,
    counts: &[usize],
    dt: DataType,
    root: usize,
    me: usize,
) -> Vec<Call> {
    let mut calls = Vec::new();
    if counts.get(me).copied().unwrap_or(0) > 0 {
        calls.push(Call::send(send, counts[me], dt, root));
    }
    if me == root {
        let mut off = 0u64;
        for (p, &c) in counts.iter().enumerate() {
            if c > 0 {
                calls.push(Call::recv(recv + off, c, dt, p));
            }
            off += (c * dt.size()) as u64;
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::version::NcclVersion;

    fn old() -> Gates {
        Gates::new(NcclVersion::new(2, 27, 7), |_| true)
    }

    fn new() -> Gates {
        Gates::new(NcclVersion::new(2, 29, 2), |_| true)
    }

    #[test]
    fn dtypes_map_to_nccl_types() {
        let expect = [
            (DType::F32, DataType::Float32, 7),
            (DType::F64, DataType::Float64, 8),
            (DType::BF16, DataType::Bfloat16, 9),
            (DType::F16, DataType::Float16, 6),
            (DType::I64, DataType::Int64, 4),
            (DType::U32, DataType::Uint32, 3),
            (DType::U8, DataType::Uint8, 1),
        ];
        for (d, t, code) in expect {
            assert_eq!(data_type(d), Some(t));
            assert_eq!(t as u32, code, "{d:?}");
            assert_eq!(t.size(), d.size_in_bytes(), "{d:?}");
        }
        for d in candle_dtensor_comm_core::SUPPORTED_DTYPES {
            assert!(data_type(d).is_some(), "{d:?} is supported by the front");
        }
        assert_eq!(data_type(DType::I16), None);
        assert_eq!(data_type(DType::I32), None);
        assert_eq!(data_type(DType::F8E4M3), None);
    }

    #[test]
    fn reduce_ops_map_to_nccl_ops() {
        assert_eq!(red_op(ReduceOp::Sum, DType::U8), Ok(RedOp::Sum));
        assert_eq!(red_op(ReduceOp::Product, DType::I64), Ok(RedOp::Prod));
        assert_eq!(red_op(ReduceOp::Max, DType::BF16), Ok(RedOp::Max));
        assert_eq!(red_op(ReduceOp::Min, DType::F16), Ok(RedOp::Min));
        assert_eq!(red_op(ReduceOp::Avg, DType::F32), Ok(RedOp::Avg));
        assert_eq!(RedOp::Avg as u32, 4);
        assert_eq!(RedOp::Prod as u32, 1);
        let e = red_op(ReduceOp::Avg, DType::U32).unwrap_err();
        assert!(e.contains("avg") && e.contains("U32"), "{e}");
    }

    #[test]
    fn split_colors_and_keys() {
        // A 2x2 mesh on 4 ranks: rows {0,1} {2,3}, columns {0,2} {1,3}.
        assert_eq!(split_color_key(&[0, 1], 1), Ok((0, 1)));
        assert_eq!(split_color_key(&[2, 3], 2), Ok((2, 0)));
        assert_eq!(split_color_key(&[1, 3], 3), Ok((1, 1)));
        // The list order defines the new ranks; the color is the minimum, not the first.
        assert_eq!(split_color_key(&[3, 1, 2], 1), Ok((1, 1)));
        assert_eq!(split_color_key(&[3, 1, 2], 3), Ok((1, 0)));
        assert_eq!(split_color_key(&[], 5), Ok((SPLIT_NOCOLOR, 0)));
        assert!(split_color_key(&[0, 1], 2).unwrap_err().contains("caller"));
    }

    #[test]
    fn split_lists_round_trip_and_validate() {
        let lists = vec![vec![0, 2], vec![3, 1], vec![0, 2], vec![3, 1], vec![]];
        let enc: Vec<u32> = lists.iter().flat_map(|l| encode_split_list(l, 5)).collect();
        assert_eq!(enc.len(), 30);
        assert_eq!(decode_split_lists(&enc, 5).unwrap(), lists);
        assert_eq!(
            candle_dtensor_comm_core::kit::desc::check_split_lists(&lists),
            Ok(())
        );
        // Rank 1 lists rank 3, which passed a different order.
        let bad = vec![vec![0], vec![1, 3], vec![2], vec![3, 1]];
        let e = candle_dtensor_comm_core::kit::desc::check_split_lists(&bad).unwrap_err();
        assert!(
            e.contains("rank 1 passes [1, 3] but rank 3 passes [3, 1]"),
            "{e}"
        );
        // A rank listed by a group that opted out.
        let bad = vec![vec![0, 1], vec![]];
        let e = candle_dtensor_comm_core::kit::desc::check_split_lists(&bad).unwrap_err();
        assert!(
            e.contains("rank 0 passes [0, 1] but rank 1 passes []"),
            "{e}"
        );
        assert!(decode_split_lists(&enc[..29], 5).is_err());
        let mut garbage = enc.clone();
        garbage[0] = 9;
        assert!(decode_split_lists(&garbage, 5)
            .unwrap_err()
            .contains("length 9"));
    }

    #[test]
    fn all_to_all_is_native_or_grouped_p2p() {
        let calls = all_to_all(&new(), 0x1000, 0x9000, 3, DataType::Float32, 4);
        assert_eq!(
            calls,
            vec![Call::AllToAll {
                send: 0x1000,
                recv: 0x9000,
                count: 3,
                dt: DataType::Float32
            }]
        );
        let calls = all_to_all(&old(), 0x1000, 0x9000, 3, DataType::Float32, 3);
        assert_eq!(calls.len(), 6);
        assert_eq!(calls[2], Call::send(0x1000 + 12, 3, DataType::Float32, 1));
        assert_eq!(calls[5], Call::recv(0x9000 + 24, 3, DataType::Float32, 2));
    }

    #[test]
    fn all_to_all_v_offsets_follow_split_sizes() {
        // Rows of 2 f64 (16 bytes): send 1 row to rank 0, 0 to rank 1, 3 to rank 2; receive
        // 2 rows from rank 0, 1 from rank 1, 0 from rank 2.
        let calls = all_to_all_v(0, 1000, &[1, 0, 3], &[2, 1, 0], 2, DataType::Float64);
        assert_eq!(
            calls,
            vec![
                Call::send(0, 2, DataType::Float64, 0),
                Call::recv(1000, 4, DataType::Float64, 0),
                Call::recv(1032, 2, DataType::Float64, 1),
                Call::send(16, 6, DataType::Float64, 2),
            ]
        );
        // Rows of zero elements move nothing.
        assert!(all_to_all_v(0, 0, &[1, 2], &[2, 1], 0, DataType::Uint8).is_empty());
    }

    #[test]
    fn gather_and_scatter_plans() {
        let g = gather(&new(), Rooted::new(10, 20, 4, DataType::Uint8, 1, 0, 3));
        assert_eq!(
            g,
            vec![Call::Gather {
                send: 10,
                recv: 20,
                count: 4,
                dt: DataType::Uint8,
                root: 1
            }]
        );
        // Non-root on an old library: one send.
        let g = gather(&old(), Rooted::new(10, 20, 4, DataType::Uint8, 1, 0, 3));
        assert_eq!(g.len(), 1);
        // Root: its own send plus one receive per rank, back to back.
        let g = gather(&old(), Rooted::new(10, 100, 4, DataType::Uint32, 1, 1, 3));
        assert_eq!(g.len(), 4);
        assert_eq!(g[3], Call::recv(100 + 32, 4, DataType::Uint32, 2));
        let s = scatter(&old(), Rooted::new(100, 7, 2, DataType::Int64, 0, 0, 2));
        assert_eq!(
            s,
            vec![
                Call::send(100, 2, DataType::Int64, 0),
                Call::send(116, 2, DataType::Int64, 1),
                Call::recv(7, 2, DataType::Int64, 0),
            ]
        );
        let s = scatter(&old(), Rooted::new(0, 7, 2, DataType::Int64, 0, 1, 2));
        assert_eq!(s.len(), 1);
        assert!(matches!(
            scatter(&new(), Rooted::new(0, 7, 2, DataType::Int64, 0, 1, 2))[0],
            Call::Scatter { .. }
        ));
    }

    #[test]
    fn gather_v_skips_empty_pieces() {
        let calls = gather_v(5, 500, &[2, 0, 3], DataType::Float16, 0, 0);
        assert_eq!(
            calls,
            vec![
                Call::send(5, 2, DataType::Float16, 0),
                Call::recv(500, 2, DataType::Float16, 0),
                Call::recv(504, 3, DataType::Float16, 2),
            ]
        );
        assert!(gather_v(5, 0, &[2, 0, 3], DataType::Float16, 0, 1).is_empty());
    }
}
