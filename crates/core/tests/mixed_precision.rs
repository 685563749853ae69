//! Mixed-precision GEMMs (`DTensor::linear_with_layout_in`, `DTensor::matmul_in`): the product
//! is single-device candle's bf16 product (cast in, multiplied in bf16, cast back), sharded or
//! not, and differs from the f32 one by bf16 rounding; the gradient of an f32 weight is f32 and
//! so is its data-parallel all_reduce (the bytes on the wire), unlike a cast before the op.
//!
//! Tolerance: the forward runs the same local GEMM rows on any row sharding, so it agrees with
//! one device to 1e-6; a data-parallel weight gradient sums per-rank bf16 GEMMs (each rounded
//! to bf16) where one device rounds the whole sum once: an ulp of bf16 (2^-8 relative) of
//! each partial. bf16 against f32 differs by more than 1e-4 here (8 mantissa bits on operands
//! of size ~1).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{DTensor, Placement};
use common::*;

use Placement::{Replicate as Rep, Shard as S};

fn bf16_linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.to_dtype(DType::BF16)?
        .matmul(&w.to_dtype(DType::BF16)?.t()?)?
        .to_dtype(DType::F32)?
        .broadcast_add(b)
}

/// The gradient of each leaf, in order (an error naming the first without one).
fn leaf_grads<'a>(
    grads: &candle_core::backprop::GradStore,
    leaves: impl IntoIterator<Item = &'a Var>,
) -> R<Vec<Tensor>> {
    leaves
        .into_iter()
        .map(|l| {
            grads
                .get(l)
                .cloned()
                .ok_or_else(|| "a leaf without gradient".into())
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// One device: the bf16 product, not the f32 one; the gradients are f32 and are candle's.
#[test]
fn linear_in_bf16_is_the_bf16_product_with_f32_gradients() {
    let (x, w, b) = (data(&[6, 8], 0.0), data(&[5, 8], 1.0), data(&[5], 2.0));
    let want = bf16_linear(&x, &w, &b).unwrap();
    let f32_product = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    assert!(
        max_abs_diff(&want, &f32_product) > 1e-4,
        "the bf16 product must differ from the f32 one"
    );
    let res = on_mesh(&[1], |mesh| {
        let wv = Var::from_tensor(&w)?;
        let xd = DTensor::from_local(&x, &mesh, &[Rep])?;
        let wd = DTensor::from_local(wv.as_tensor(), &mesh, &[Rep])?;
        let bd = DTensor::from_local(&b, &mesh, &[Rep])?;
        let y = xd.linear_with_layout_in(&wd, Some(&bd), None, DType::BF16)?;
        let g = y.to_local().sum_all()?.backward()?;
        let gw = g.get(wv.as_tensor()).ok_or("no weight gradient")?.clone();
        Ok((y.dtype(), y.to_local().clone(), gw))
    })
    .unwrap();
    let (dt, y, gw) = res.into_iter().next().unwrap();
    assert_eq!(dt, DType::F32);
    close(&y, &want, 1e-6).unwrap();
    // Single-device candle's gradient of the same composition.
    let wv = Var::from_tensor(&w).unwrap();
    let g = bf16_linear(&x, wv.as_tensor(), &b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_gw = g.get(wv.as_tensor()).unwrap();
    assert_eq!(gw.dtype(), DType::F32);
    close(&gw, want_gw, 1e-6).unwrap();
}

/// dp = 2 (rows sharded, weight replicated): the rows are one device's; the weight gradient's
/// all_reduce runs in f32 (4 bytes per element), where casting the weight before the op would
/// reduce it in bf16 (2 bytes).
#[test]
fn sharded_linear_in_bf16_reduces_the_weight_gradient_in_f32() {
    let (x, w, b) = (data(&[6, 8], 0.0), data(&[5, 8], 1.0), data(&[5], 2.0));
    let want = bf16_linear(&x, &w, &b).unwrap();
    let wv = Var::from_tensor(&w).unwrap();
    let want_gw = bf16_linear(&x, wv.as_tensor(), &b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
        .get(wv.as_tensor())
        .unwrap()
        .clone();
    let res = on_mesh(&[2], |mesh| {
        let wv = Var::from_tensor(&w)?;
        let xd = candle_dtensor_core::distribute_tensor(&x, &mesh, &[S(0)])?;
        let wd = DTensor::from_local(wv.as_tensor(), &mesh, &[Rep])?;
        let bd = DTensor::from_local(&b, &mesh, &[Rep])?;
        let mode = CommDebugMode::start();
        let y = xd.linear_with_layout_in(&wd, Some(&bd), None, DType::BF16)?;
        let full = y.redistribute(&[Rep])?.to_local().clone();
        let g = y.to_local().sum_all()?.backward()?;
        let gw = g.get(wv.as_tensor()).ok_or("no weight gradient")?.clone();
        let reduced: Vec<u64> = mode
            .records()
            .iter()
            .filter(|r| r.phase == Phase::Backward && r.kind == "all_reduce")
            .map(|r| r.bytes)
            .collect();
        // The contrast: the weight cast before the op, its gradient synced in bf16.
        let wv2 = Var::from_tensor(&w)?;
        let wd2 = DTensor::from_local(wv2.as_tensor(), &mesh, &[Rep])?.to_dtype(DType::BF16)?;
        let mode = CommDebugMode::start();
        let y2 = xd.to_dtype(DType::BF16)?.linear(&wd2, None)?;
        y2.to_local().to_dtype(DType::F32)?.sum_all()?.backward()?;
        let reduced_cast_first: Vec<u64> = mode
            .records()
            .iter()
            .filter(|r| r.phase == Phase::Backward && r.kind == "all_reduce")
            .map(|r| r.bytes)
            .collect();
        Ok((full, gw, reduced, reduced_cast_first))
    })
    .unwrap();
    for (full, gw, reduced, cast_first) in res {
        close(&full, &want, 1e-6).unwrap();
        // Each rank's weight gradient is a bf16 GEMM over its 3 rows (rounded to bf16 before
        // the f32 sum), one device's over all 6: they differ by up to an ulp of bf16 (2^-8
        // relative) of each partial, |partial| <= 4 here.
        close(&gw, &want_gw, 2e-2).unwrap();
        assert!(max_abs_diff(&gw, &want_gw) <= 2.0 * 4.0 / 256.0);
        // The weight's (5 x 8) gradient, in f32 (the bias is a constant here).
        assert_eq!(reduced, vec![4 * 40], "the weight gradient reduces in f32");
        assert_eq!(cast_first, vec![2 * 40], "the contrast reduces in bf16");
    }
}

/// `matmul_in`: heads sharded (dim 1), the bf16 product of one device, back in f32.
#[test]
fn matmul_in_bf16_is_the_bf16_product() {
    let (a, b) = (data(&[2, 4, 3, 8], 0.5), data(&[2, 4, 8, 3], 1.5));
    let want = a
        .to_dtype(DType::BF16)
        .unwrap()
        .matmul(&b.to_dtype(DType::BF16).unwrap())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    assert!(max_abs_diff(&want, &a.matmul(&b).unwrap()) > 1e-4);
    let res = on_mesh(&[2], |mesh| {
        let ad = candle_dtensor_core::distribute_tensor(&a, &mesh, &[S(1)])?;
        let bd = candle_dtensor_core::distribute_tensor(&b, &mesh, &[S(1)])?;
        let y = ad.matmul_in(&bd, DType::BF16)?;
        Ok((y.dtype(), y.redistribute(&[Rep])?.to_local().clone()))
    })
    .unwrap();
    for (dt, y) in res {
        assert_eq!(dt, DType::F32);
        close(&y, &want, 1e-6).unwrap();
    }
}

/// bf16 activations between two tensor-parallel linears (`linear_with_layout_to`, autocast's
/// data flow): a column-parallel `fc1` from an f32 input to a bf16 output sharded on its
/// features, then a row-parallel `fc2` from that bf16 piece to an f32 partial sum, reduced in
/// f32. Against one device's composition (casts around bf16 products, f32 biases added before
/// the one rounding), forward and the f32 gradients of every weight, bias and the input, on
/// tp = 1, 2, 3 with a hidden width of 7 (uneven pieces). The values are small integers, so
/// every product and sum here is exact in bf16 and every layout must agree with one device to
/// the bit: this checks the plumbing (dtypes, placements, the f32 reduction); where bf16 rounds
/// is `kernels/tests/region.rs`'s, bit for bit against the composition.
#[test]
fn bf16_activations_between_tp_linears_match_one_device() {
    const BF: DType = DType::BF16;
    let (n, d, h) = (5, 6, 7);
    let ints = |shape: &[usize], k: usize| {
        let len: usize = shape.iter().product();
        let v: Vec<f32> = (0..len).map(|i| ((i * 7 + k) % 3) as f32 - 1.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let (x, w1, b1, w2, b2) = (
        ints(&[n, d], 0),
        ints(&[h, d], 1),
        ints(&[h], 2),
        ints(&[d, h], 0),
        ints(&[d], 1),
    );
    // One device: fc1's f32 sum rounded once to bf16; fc2 from that bf16 activation.
    let reference = |x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor| {
        let a = bf16_linear(x, w1, b1)?.to_dtype(BF)?;
        a.matmul(&w2.to_dtype(BF)?.t()?)?
            .to_dtype(DType::F32)?
            .broadcast_add(b2)
    };
    let vars: Vec<Var> = [&x, &w1, &b1, &w2, &b2]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let v: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let want = reference(v[0], v[1], v[2], v[3], v[4]).unwrap();
    let seed = ints(&[n, d], 2);
    let g = (&want * &seed)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_g: Vec<Tensor> = vars.iter().map(|v| g.get(v).unwrap().clone()).collect();
    let placements = [Rep, S(0), S(0), S(1), Rep];
    for tp in 1..=3 {
        let res = on_mesh(&[tp], |mesh| {
            // Each input's piece as a leaf of its own; the expected gradient is that piece of
            // one device's.
            let mut leaves = Vec::new();
            let mut ds = Vec::new();
            let mut want_pieces = Vec::new();
            for (i, full) in [&x, &w1, &b1, &w2, &b2].into_iter().enumerate() {
                let pl = placements[i];
                let piece = candle_dtensor_core::distribute_tensor(full, &mesh, &[pl])?;
                let leaf = Var::from_tensor(piece.to_local())?;
                ds.push(DTensor::from_local_with_shape(
                    leaf.as_tensor(),
                    &mesh,
                    &[pl],
                    full.dims(),
                )?);
                leaves.push(leaf);
                let wp = candle_dtensor_core::distribute_tensor(&want_g[i], &mesh, &[pl])?;
                want_pieces.push(wp.to_local().clone());
            }
            let (xd, w1d, b1d, w2d, b2d) = (&ds[0], &ds[1], &ds[2], &ds[3], &ds[4]);
            let a = xd.linear_with_layout_to(w1d, Some(b1d), Some(&[Rep]), BF, BF)?;
            let a_dtype = a.dtype();
            let a_pl = a.placements().to_vec();
            let mode = CommDebugMode::start();
            let y = a.linear_with_layout_to(w2d, None, Some(&[S(1)]), BF, DType::F32)?;
            let y = y.redistribute(&[Rep])?;
            let fwd_bytes: Vec<u64> = mode
                .records()
                .iter()
                .filter(|r| r.phase == Phase::Forward && r.kind == "all_reduce")
                .map(|r| r.bytes)
                .collect();
            let y = y.add(b2d)?;
            let seed_d = DTensor::from_local(&seed, &mesh, &[Rep])?;
            let loss = y.mul(&seed_d)?.sum_all()?;
            let grads = loss.backward()?;
            let gs = leaf_grads(&grads, &leaves)?;
            Ok((
                a_dtype,
                a_pl,
                fwd_bytes,
                y.to_local().clone(),
                gs,
                want_pieces,
            ))
        })
        .unwrap();
        for (rank, (a_dtype, a_pl, fwd_bytes, y, gs, want_g)) in res.into_iter().enumerate() {
            let what = format!("tp {tp} rank {rank}");
            assert_eq!(a_dtype, BF, "{what}: fc1's output dtype");
            assert_eq!(a_pl, vec![S(1)], "{what}: fc1's output placement");
            if tp > 1 {
                assert_eq!(
                    fwd_bytes,
                    vec![4 * (n * d) as u64],
                    "{what}: fc2 reduces in f32"
                );
            }
            close(&y, &want, 1e-6).unwrap_or_else(|e| panic!("{what}: output: {e}"));
            let names = ["x", "w1", "b1", "w2", "b2"];
            for ((g, w), name) in gs.iter().zip(&want_g).zip(names) {
                assert_eq!(g.dtype(), DType::F32, "{what}: {name}'s gradient dtype");
                close(g, w, 1e-6).unwrap_or_else(|e| panic!("{what}: {name}'s gradient: {e}"));
            }
        }
    }
}

/// A weight already in the GEMM's dtype (FSDP's gathered bf16 parameters) with an f32 bias and
/// f32 activations goes into the node as it is: the same output and gradients, bit for bit, as
/// the weight cast up to f32 before the op (and back to bf16 inside it), for the linear and the
/// linear-GELU node, column-parallel over 1-3 ranks (7 rows: uneven pieces). The graph no longer
/// holds the f32 copy of the weight: exactly its bytes less.
#[test]
fn a_bf16_weight_goes_into_the_gemm_as_it_is() {
    const BF: DType = DType::BF16;
    let (n, d, h) = (5, 6, 7);
    let (x, w, b) = (
        data(&[n, d], 0.0),
        data(&[h, d], 1.0).to_dtype(BF).unwrap(),
        data(&[h], 2.0),
    );
    let seed = data(&[n, h], 3.0);
    for gelu in [false, true] {
        for tp in 1..=3 {
            let res = on_mesh(&[tp], |mesh| {
                // (output, gradients of x, w, b, graph bytes) with the weight as it is or cast.
                let run = |cast_first: bool| -> R<(Tensor, Vec<Tensor>, usize)> {
                    let xl = Var::from_tensor(&x)?;
                    let wp = candle_dtensor_core::distribute_tensor(&w, &mesh, &[S(0)])?;
                    let bp = candle_dtensor_core::distribute_tensor(&b, &mesh, &[S(0)])?;
                    let (wl, bl) = (
                        Var::from_tensor(wp.to_local())?,
                        Var::from_tensor(bp.to_local())?,
                    );
                    let xd = DTensor::from_local(xl.as_tensor(), &mesh, &[Rep])?;
                    let wd =
                        DTensor::from_local_with_shape(wl.as_tensor(), &mesh, &[S(0)], &[h, d])?;
                    let bd = DTensor::from_local_with_shape(bl.as_tensor(), &mesh, &[S(0)], &[h])?;
                    let wd = if cast_first {
                        wd.to_dtype(DType::F32)?
                    } else {
                        wd
                    };
                    let y = match (gelu, cast_first) {
                        (false, true) => {
                            xd.linear_with_layout_in(&wd, Some(&bd), Some(&[Rep]), BF)?
                        }
                        (true, _) => xd.linear_gelu_with_layout_to(
                            &wd,
                            Some(&bd),
                            Some(&[Rep]),
                            BF,
                            DType::F32,
                        )?,
                        (false, false) => {
                            xd.linear_with_layout_to(&wd, Some(&bd), Some(&[Rep]), BF, DType::F32)?
                        }
                    };
                    let bytes = candle_dtensor_core::debug::graph_bytes(y.to_local());
                    let y = y.redistribute(&[Rep])?;
                    let seed_d = DTensor::from_local(&seed, &mesh, &[Rep])?;
                    let grads = y.mul(&seed_d)?.sum_all()?.backward()?;
                    let gs = leaf_grads(&grads, [&xl, &wl, &bl])?;
                    Ok((y.to_local().clone(), gs, bytes))
                };
                let piece_rows = candle_dtensor_core::distribute_tensor(&w, &mesh, &[S(0)])?
                    .to_local()
                    .dim(0)?;
                Ok((run(false)?, run(true)?, piece_rows))
            })
            .unwrap();
            for (rank, ((y, gs, bytes), (y_cast, gs_cast, bytes_cast), rows)) in
                res.into_iter().enumerate()
            {
                let what = format!("gelu {gelu} tp {tp} rank {rank}");
                assert_eq!(y.dtype(), DType::F32, "{what}");
                close(&y, &y_cast, 0.0).unwrap_or_else(|e| panic!("{what}: output: {e}"));
                for ((g, gc), name) in gs.iter().zip(&gs_cast).zip(["x", "w", "b"]) {
                    assert_eq!(g.dtype(), gc.dtype(), "{what}: {name}'s gradient dtype");
                    close(g, gc, 0.0).unwrap_or_else(|e| panic!("{what}: {name}'s gradient: {e}"));
                }
                assert_eq!(gs[1].dtype(), BF, "{what}: the bf16 weight's gradient");
                assert_eq!(
                    bytes_cast - bytes,
                    rows * d * 4,
                    "{what}: the graph without the f32 copy of the weight piece"
                );
            }
        }
    }
}
