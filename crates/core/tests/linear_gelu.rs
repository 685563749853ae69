//! `DTensor::linear_gelu_with_layout_to`: `gelu(x W^T + b)` with the GELU in the linear's graph
//! node against one device's linear followed by GELU, forward and the gradients of x, W and b,
//! on 1-D and 2-D meshes with uneven shards, in the layouts a linear takes: rows sharded
//! (replicated weight, gradient all_reduce), column-parallel (weight rows sharded, replicated x
//! whose gradient sums over ranks), and row-parallel (contraction sharded: the output is a
//! partial sum, so the GELU must come after its reduction); for f32, a bf16 GEMM with an f32
//! output, and a bf16 output.
//!
//! Tolerance: relative 1e-5 for f32 (the row-parallel layout sums partial products in another
//! order), 1e-2 for the bf16 cases (an ulp of bf16 where a layout rounds a partial product).

mod common;

use candle_core::{DType, Tensor, Var};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use common::*;

use Placement::{Replicate as Rep, Shard as S};

/// `(y, dx, dw, db)` of `gelu(x W^T + b)` weighted by `r`, on one device (candle's composition
/// with the project's fused GELU, in the dtypes of `compute` and `out`).
fn reference(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: &Tensor,
    compute: DType,
    out: DType,
) -> [Tensor; 4] {
    let (xv, wv, bv) = (
        Var::from_tensor(x).unwrap(),
        Var::from_tensor(w).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let y = xv
        .to_dtype(compute)
        .unwrap()
        .matmul(&wv.to_dtype(compute).unwrap().t().unwrap())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .broadcast_add(bv.as_tensor())
        .unwrap()
        .to_dtype(out)
        .unwrap();
    let y = candle_dtensor_core::fused::gelu(&y)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let g = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
    [
        y,
        g.get(xv.as_tensor()).unwrap().clone(),
        g.get(wv.as_tensor()).unwrap().clone(),
        g.get(bv.as_tensor()).unwrap().clone(),
    ]
}

#[test]
fn linear_gelu_matches_one_device_in_every_layout() {
    let (rows, inner, outs) = (6, 8, 5);
    let (x, w, b) = (
        data(&[rows, inner], 0.0),
        data(&[outs, inner], 1.0),
        data(&[outs], 2.0),
    );
    let r = data(&[rows, outs], 3.0);
    let cases = [
        ("f32", DType::F32, DType::F32, 1e-5),
        ("bf16 gemm", DType::BF16, DType::F32, 1e-2),
        ("bf16 out", DType::BF16, DType::BF16, 1e-2),
    ];
    for mesh in [vec![1], vec![2], vec![3], vec![2, 2]] {
        let last = mesh.len() - 1;
        let on = |p: Placement| {
            let mut v = vec![Rep; mesh.len()];
            v[last] = p;
            v
        };
        // (layout, x, w, b placements).
        let layouts = [
            (
                "rows",
                on(S(0)),
                vec![Rep; mesh.len()],
                vec![Rep; mesh.len()],
            ),
            ("column-parallel", vec![Rep; mesh.len()], on(S(0)), on(S(0))),
            ("row-parallel", on(S(1)), on(S(1)), vec![Rep; mesh.len()]),
        ];
        for (name, compute, out, tol) in cases {
            let want = reference(&x, &w, &b, &r, compute, out);
            for (layout, xp, wp, bp) in &layouts {
                let what = format!("{name} {layout} on mesh {mesh:?}");
                let res = on_mesh(&mesh, |m| {
                    let coord = m.coordinate();
                    let piece = |t: &Tensor, p: &[Placement]| shard_piece(t, p, &m.shape(), &coord);
                    let (xv, wv, bv) = (
                        Var::from_tensor(&piece(&x, xp))?,
                        Var::from_tensor(&piece(&w, wp))?,
                        Var::from_tensor(&piece(&b, bp))?,
                    );
                    let xd =
                        DTensor::from_local_with_shape(xv.as_tensor(), &m, xp, &[rows, inner])?;
                    let wd =
                        DTensor::from_local_with_shape(wv.as_tensor(), &m, wp, &[outs, inner])?;
                    let bd = DTensor::from_local_with_shape(bv.as_tensor(), &m, bp, &[outs])?;
                    let y = xd.linear_gelu_with_layout_to(&wd, Some(&bd), None, compute, out)?;
                    assert_eq!(y.dtype(), out, "{what}: output dtype");
                    let y = y.to_dtype(DType::F32)?;
                    let rd = distribute_tensor(&r, &m, y.placements())?;
                    let full = y.redistribute(&vec![Rep; m.ndim()])?.to_local().clone();
                    let g = (y.to_local() * rd.to_local())?.sum_all()?.backward()?;
                    let grad = |v: &Var| -> R<Tensor> {
                        Ok(g.get(v.as_tensor()).ok_or("no gradient")?.clone())
                    };
                    Ok((coord, full, grad(&xv)?, grad(&wv)?, grad(&bv)?))
                })
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                for (coord, y, gx, gw, gb) in res {
                    let m = &mesh;
                    close(&y, &want[0], tol)
                        .unwrap_or_else(|e| panic!("{what} rank {coord:?} forward: {e}"));
                    for (got, full, p, which) in [
                        (&gx, &want[1], xp, "dx"),
                        (&gw, &want[2], wp, "dw"),
                        (&gb, &want[3], bp, "db"),
                    ] {
                        let expect = shard_piece(full, p, m, &coord);
                        close(got, &expect, tol)
                            .unwrap_or_else(|e| panic!("{what} rank {coord:?} {which}: {e}"));
                    }
                }
            }
        }
    }
}

/// Where the output is whole on every rank the GELU is in the linear's node: the graph holds
/// no pre-activation (one node fewer than the linear followed by GELU), while activation memory
/// (`debug::graph_bytes`) still counts the one the node keeps; on a row-parallel layout the
/// pair, with the GELU after the reduction.
#[test]
fn the_gelu_joins_the_linear_node_unless_the_output_is_partial() {
    let (x, w, b) = (data(&[6, 8], 0.0), data(&[5, 8], 1.0), data(&[5], 2.0));
    let res = on_mesh(&[2], |m| {
        let wv = Var::from_tensor(&shard_piece(&w, &[S(0)], &[2], &m.coordinate()))?;
        let bv = Var::from_tensor(&shard_piece(&b, &[S(0)], &[2], &m.coordinate()))?;
        let xd = DTensor::from_local(&x, &m, &[Rep])?;
        let wd = DTensor::from_local_with_shape(wv.as_tensor(), &m, &[S(0)], &[5, 8])?;
        let bd = DTensor::from_local_with_shape(bv.as_tensor(), &m, &[S(0)], &[5])?;
        let nodes = |t: &DTensor| t.to_local().sorted_nodes().len();
        let bytes = |t: &DTensor| candle_dtensor_core::debug::graph_bytes(t.to_local());
        let fused = xd.linear_gelu_with_layout_to(&wd, Some(&bd), None, DType::F32, DType::F32)?;
        let pair = xd
            .linear_with_layout_to(&wd, Some(&bd), None, DType::F32, DType::F32)?
            .gelu()?;
        // Row-parallel: x and w sharded on the contraction.
        let xs = distribute_tensor(&x, &m, &[S(1)])?;
        let ws = DTensor::from_local_with_shape(
            Var::from_tensor(&shard_piece(&w, &[S(1)], &[2], &m.coordinate()))?.as_tensor(),
            &m,
            &[S(1)],
            &[5, 8],
        )?;
        let rowwise = xs.linear_gelu_with_layout_to(&ws, None, None, DType::F32, DType::F32)?;
        // Activation memory counts the pre-activation the node keeps as the pair's graph
        // counts the linear's output.
        assert_eq!(bytes(&fused), bytes(&pair), "activation bytes");
        Ok((nodes(&fused), nodes(&pair), rowwise.placements().to_vec()))
    })
    .unwrap();
    for (fused, pair, rowwise) in res {
        assert_eq!(
            fused + 1,
            pair,
            "the fused graph should lack the pre-activation"
        );
        // The GELU ran after the partial sums were reduced (an all_reduce or, cheaper, a
        // reduce_scatter: the compiler's choice), never on a partial.
        assert!(
            !rowwise.iter().any(|p| p.is_partial()),
            "row-parallel: the output {rowwise:?} is partial"
        );
    }
}
