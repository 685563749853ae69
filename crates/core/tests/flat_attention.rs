//! `flat_sdpa` (attention on the flat `[B, T, 3 H d]` projection) against the dispatched
//! reshape, `packed_sdpa`, reshape it replaces, and against one device: on whole-head layouts
//! the same bits with the projection's placements kept (no collective); elsewhere (heads split
//! unevenly, a sequence shard) the compiler moves the projection and the result is still one
//! device's.
mod common;

use candle_core::{Device, Tensor, Var};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use common::*;

/// An output and a gradient, as one rank sees them.
type Seen = (Vec<f32>, Vec<f32>);

/// The bits of `v`, for comparisons that must be exact.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Distinct values, scaled so the softmax is not flat.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 1013) as f32 / 1013.0 - 0.5) * 2.0)
        .collect()
}

/// The whole output and the gradient of this rank's piece of the projection (global
/// `[b, t, 3 h hd]`, placed by `pl`), through `flat_sdpa` (`flat`) or the dispatched reshapes
/// around `packed_sdpa`; and whether the output kept the projection's placements.
fn attend(
    mesh: &DeviceMesh,
    pl: &[Placement],
    (b, t, h, hd): (usize, usize, usize, usize),
    flat: bool,
) -> R<(Seen, bool)> {
    let full = Tensor::from_vec(
        values(b * t * 3 * h * hd, 1),
        (b, t, 3 * h * hd),
        &Device::Cpu,
    )?;
    let gy = Tensor::from_vec(values(b * t * h * hd, 2), (b, t, h * hd), &Device::Cpu)?;
    // This rank's piece as a variable, so its gradient is this rank's.
    let var = Var::from_tensor(distribute_tensor(&full, mesh, pl)?.to_local())?;
    let qkv = DTensor::from_local_with_shape(var.as_tensor(), mesh, pl, full.dims())?;
    let y = if flat {
        qkv.flat_sdpa(h, true, None)?
    } else {
        qkv.reshape(&[b, t, h, 3, hd])?
            .packed_sdpa(true, None)?
            .reshape(&[b, t, h * hd])?
    };
    let kept = y.placements() == qkv.placements();
    let full_y = y.full_tensor()?;
    let g = distribute_tensor(&gy, mesh, y.placements())?;
    let loss = (y.to_local() * g.to_local())?.sum_all()?;
    let grads = loss.backward()?;
    let dx = grads
        .get(var.as_tensor())
        .cloned()
        .unwrap_or(var.as_tensor().zeros_like()?);
    Ok((
        (
            full_y.flatten_all()?.to_vec1()?,
            dx.flatten_all()?.to_vec1()?,
        ),
        kept,
    ))
}

#[test]
fn flat_sdpa_is_the_dispatched_attention() {
    let (s, r) = (Placement::Shard, Placement::Replicate);
    // Mesh, placements, heads, whether every rank holds whole heads of whole sequences.
    let cases: Vec<(Vec<usize>, Vec<Placement>, usize, bool)> = vec![
        (vec![1], vec![s(2)], 4, true),
        (vec![2], vec![s(2)], 4, true),
        (vec![2], vec![r], 4, true),
        (vec![2], vec![s(0)], 4, true),
        (vec![2, 2], vec![s(0), s(2)], 4, true),
        (vec![2, 2], vec![s(2), s(2)], 4, true),
        (vec![3], vec![s(0)], 2, true),
        // Moved by the compiler: heads split unevenly, heads split inside a head, a sequence
        // shard.
        (vec![2], vec![s(2)], 3, false),
        (vec![4], vec![s(2)], 2, false),
        (vec![2], vec![s(1)], 4, false),
    ];
    let (b, t, hd) = (5, 7, 8);
    for (shape, pl, h, whole) in cases {
        let what = format!("mesh {shape:?} {pl:?} {h} heads");
        let outs = on_mesh(&shape, |mesh| {
            Ok([
                attend(&mesh, &pl, (b, t, h, hd), true)?,
                attend(&mesh, &pl, (b, t, h, hd), false)?,
            ])
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        // One device's attention, from candle's reference.
        let full = Tensor::from_vec(
            values(b * t * 3 * h * hd, 1),
            (b, t, h, 3, hd),
            &Device::Cpu,
        )
        .unwrap();
        let want: Vec<f32> =
            candle_dtensor_core::reference::packed_sdpa(&full, true, 1.0 / (hd as f64).sqrt())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
        for [((y, dx), kept), ((y2, dx2), _)] in outs {
            assert_eq!(kept, whole, "{what}: the output keeps the placements");
            assert!(dx.iter().any(|&x| x != 0.0), "{what}: a gradient");
            for (i, (a, w)) in y.iter().zip(&want).enumerate() {
                assert!(
                    a.is_finite() && (a - w).abs() <= 1e-5,
                    "{what}: element {i}: {a} vs {w}"
                );
            }
            if whole {
                assert_eq!(bits(&y), bits(&y2), "{what}: outputs");
                assert_eq!(bits(&dx), bits(&dx2), "{what}: gradients");
            } else {
                for (i, (a, w)) in dx.iter().zip(&dx2).enumerate() {
                    assert!((a - w).abs() <= 1e-5, "{what}: gradient {i}: {a} vs {w}");
                }
            }
        }
    }
}

/// Bad heads are a typed error naming the op and the shape, not a panic or a wrong result.
#[test]
fn flat_sdpa_refuses_heads_that_do_not_divide_the_projection() {
    let out = on_mesh(&[1], |mesh| {
        let x = Tensor::zeros((2, 3, 24), candle_core::DType::F32, &Device::Cpu)?;
        let x = distribute_tensor(&x, &mesh, &[Placement::Replicate])?;
        let errs: Vec<String> = [5usize, 0, usize::MAX]
            .iter()
            .map(|&h| match x.flat_sdpa(h, true, None) {
                Ok(_) => format!("{h} heads accepted"),
                Err(e) => e.to_string(),
            })
            .collect();
        Ok(errs)
    })
    .unwrap();
    for e in &out[0] {
        assert!(e.contains("flat_sdpa") && e.contains("[2, 3, 24]"), "{e}");
    }
}

/// In the load-balanced context-parallel order (a `cp::layout_scope`, the sequence whole on
/// each rank, as after the compiler gathered it) `flat_sdpa` masks by the global positions: on
/// the stored-order projection it gives one device's causal attention on the natural order,
/// rows stored alike, on a batch-sharded mesh too; and the same bits as the packed path.
#[test]
fn flat_sdpa_in_the_load_balanced_order_masks_global_positions() {
    use candle_dtensor_core::cp::{layout_scope, load_balanced_order, SeqLayout};
    let (b, t, h, hd, cp) = (2, 8, 2, 4, 2);
    let order = load_balanced_order(t, cp).unwrap();
    assert_ne!(
        order,
        (0..t).collect::<Vec<_>>(),
        "the order is a real permutation"
    );
    let ids = Tensor::from_vec(
        order.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        t,
        &Device::Cpu,
    )
    .unwrap();
    let natural = Tensor::from_vec(
        values(b * t * 3 * h * hd, 3),
        (b, t, 3 * h * hd),
        &Device::Cpu,
    )
    .unwrap();
    let stored = natural.index_select(&ids, 1).unwrap();
    let want = candle_dtensor_core::reference::packed_sdpa(
        &natural.reshape((b, t, h, 3, hd)).unwrap(),
        true,
        1.0 / (hd as f64).sqrt(),
    )
    .unwrap()
    .reshape((b, t, h * hd))
    .unwrap()
    .index_select(&ids, 1)
    .unwrap();
    for (shape, pl) in [
        (vec![1], Placement::Replicate),
        (vec![2], Placement::Shard(0)),
    ] {
        let out = on_mesh(&shape, |mesh| {
            let _order = layout_scope(SeqLayout::LoadBalanced, cp);
            let x = distribute_tensor(&stored, &mesh, &[pl])?;
            let flat = x.flat_sdpa(h, true, None)?.full_tensor()?;
            let packed = x
                .reshape(&[b, t, h, 3, hd])?
                .packed_sdpa(true, None)?
                .reshape(&[b, t, h * hd])?
                .full_tensor()?;
            Ok((flat, packed))
        })
        .unwrap();
        for (flat, packed) in out {
            close(&flat, &want, 1e-5).unwrap_or_else(|e| panic!("mesh {shape:?}: {e}"));
            let as_vec = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                bits(&as_vec(&flat)),
                bits(&as_vec(&packed)),
                "mesh {shape:?}"
            );
        }
    }
}
