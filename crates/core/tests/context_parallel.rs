//! Context parallelism: attention on sequence-sharded q/k/v (and packed qkv) against one device.
//!
//! Every case builds q, k, v on one device, runs single-device attention (plain candle ops,
//! softmax with an explicit causal mask) and its gradients through a weighted sum with
//! distinct weights, then the same with the sequence sharded over a `cp` mesh dim (alone or
//! next to `dp`/`tp`), for each strategy: ring attention, all-gather K/V, all-to-all (Ulysses),
//! both sequence layouts (contiguous, uneven lengths included; load-balanced), causal or not.
//! Outputs and the gradients of q, k, v must match within 1e-5 (relative to the tensor's
//! largest entry); NaN fails. The strategy that ran is checked from the collectives recorded.

use candle_core::{Device, Tensor, Var, D};
use candle_dtensor_comm::link::{link_hints, parse_link_spec};
use candle_dtensor_comm::{CommOptions, LocalWorld};
use candle_dtensor_core::cp::{
    layout_scope, load_balanced_order, positions, tile_scope, variant_scope, CpVariant, SeqLayout,
};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{distribute_tensor, DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use std::time::Duration;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Deterministic values in [-1, 1).
fn fixed(shape: &[usize], salt: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 17) % 2003) as f32 / 1001.5 - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Single-device attention `[B, H, T, d]`.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Tensor {
    let t = q.dim(2).unwrap();
    let mut s = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    if causal {
        let m: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let m = Tensor::from_vec(m, (t, t), &Device::Cpu).unwrap();
        s = s.broadcast_add(&m).unwrap();
    }
    let mx = s.max_keepdim(D::Minus1).unwrap();
    let e = s.broadcast_sub(&mx).unwrap().exp().unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    p.matmul(v).unwrap()
}

struct Reference {
    o: Tensor,
    grads: [Tensor; 3],
}

/// The output and the gradients of `sum(o * w)`.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor, causal: bool) -> Reference {
    let scale = 1.0 / (q.dim(3).unwrap() as f64).sqrt();
    let (qv, kv, vv) = (
        Var::from_tensor(q).unwrap(),
        Var::from_tensor(k).unwrap(),
        Var::from_tensor(v).unwrap(),
    );
    let o = attention(&qv, &kv, &vv, causal, scale);
    let g = (&o * w).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = [&qv, &kv, &vv].map(|x| g.get(x).unwrap().clone());
    Reference { o, grads }
}

/// `a` and `b` equal within 1e-5 of `b`'s largest entry, no NaN.
fn close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            !x.is_nan() && (x - y).abs() <= 1e-5 * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

/// How q, k, v are laid out over the mesh, and which strategy must run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// The KV exchange, as the case's variant.
    Exchange,
    /// All-to-alls only (the Ulysses row, or re-sharding to the heads).
    AllToAll,
    /// Any plan (only the numbers are checked).
    Any,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    /// `(name, size)` of the mesh dims; the one named `cp` shards the sequence.
    mesh: &'static [(&'static str, usize)],
    b: usize,
    h: usize,
    t: usize,
    causal: bool,
    layout: SeqLayout,
    variant: CpVariant,
    /// What the compiler is expected to choose.
    expect: Expect,
    /// A modeled link on the `cp` dim (`comm::link` spec), which the compiler prices.
    link: Option<&'static str>,
    packed: bool,
    /// Query tiles of about this many score elements (`cp::tile_scope`).
    tile: Option<usize>,
}

fn placements(case: &Case, seq_dim: usize) -> Vec<Placement> {
    case.mesh
        .iter()
        .map(|(name, _)| match *name {
            "cp" => Placement::Shard(seq_dim),
            "dp" => Placement::Shard(0),
            // Heads: dim 1 of [B, H, T, d], dim 2 of packed [B, T, H, 3, d].
            "tp" => Placement::Shard(if case.packed { 2 } else { 1 }),
            _ => Placement::Replicate,
        })
        .collect()
}

/// The forward's all_to_alls, ring steps and all_gathers so far.
fn forward_counts(mode: &CommDebugMode) -> (usize, usize, usize) {
    (
        mode.count("all_to_all", Phase::Forward),
        mode.count("ring_exchange", Phase::Forward),
        mode.count("all_gather", Phase::Forward),
    )
}

/// Runs `case` on every rank; compares with one device.
fn run(case: Case) {
    let (b, h, t, d) = (case.b, case.h, case.t, 4);
    let q = fixed(&[b, h, t, d], 1);
    let k = fixed(&[b, h, t, d], 2);
    let v = fixed(&[b, h, t, d], 3);
    let w = fixed(&[b, h, t, d], 4);
    let want = reference(&q, &k, &v, &w, case.causal);
    let world: usize = case.mesh.iter().map(|m| m.1).product();
    let cp = case
        .mesh
        .iter()
        .find(|m| m.0 == "cp")
        .map(|m| m.1)
        .unwrap_or(1);
    // The stored order of the sequence (permuted for the balanced layout).
    let order = match case.layout {
        SeqLayout::Contiguous => (0..t as u32).collect::<Vec<_>>(),
        SeqLayout::LoadBalanced => load_balanced_order(t, cp)
            .unwrap()
            .into_iter()
            .map(|i| i as u32)
            .collect(),
    };
    let ids = Tensor::new(order.as_slice(), &Device::Cpu).unwrap();
    let perm = |x: &Tensor| x.index_select(&ids, 2).unwrap();
    let (qp, kp, vp, wp) = (perm(&q), perm(&k), perm(&v), perm(&w));
    let mut options = CommOptions::default().with_timeout(Duration::from_secs(60));
    if let Some(spec) = case.link {
        for (k, v) in link_hints(&parse_link_spec(spec).unwrap()) {
            options = options.with_hint(k, v);
        }
    }
    let out = LocalWorld::new(world)
        .with_options(options)
        .launch(move |comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, case.mesh)?;
            let _l = layout_scope(case.layout, cp);
            let _v = variant_scope(case.variant);
            let _t = case.tile.map(tile_scope);
            let mode = CommDebugMode::start();
            let counts;
            let (o, grads) = if case.packed {
                // qkv [B, T, H, 3, d].
                let qkv = Tensor::stack(&[&qp, &kp, &vp], 3)?
                    .transpose(1, 2)?
                    .contiguous()?;
                let pl = placements(&case, 1);
                let x = distribute_tensor(&qkv, &mesh, &pl)?;
                let xv = Var::from_tensor(x.to_local())?;
                let x = DTensor::from_local_with_shape(xv.as_tensor(), &mesh, &pl, qkv.dims())?;
                let o = x.packed_sdpa(case.causal, None)?; // [B, T, H, d]
                counts = forward_counts(&mode);
                let wt = distribute_tensor(&wp.transpose(1, 2)?.contiguous()?, &mesh, &pl)?;
                let loss = o.mul(&wt)?.sum_all()?;
                let g = loss.backward()?;
                let gx = x.grad(&g)?.ok_or("no qkv gradient")?.full_tensor()?;
                // Back to [B, H, T, d] per q/k/v, in stored order.
                let gs = [0, 1, 2].map(|i| {
                    gx.narrow(3, i, 1)
                        .and_then(|t| t.squeeze(3))
                        .and_then(|t| t.transpose(1, 2))
                        .and_then(|t| t.contiguous())
                });
                let o = o.full_tensor()?.transpose(1, 2)?.contiguous()?;
                let [a, b, c] = gs;
                (o, [a?, b?, c?])
            } else {
                let pl = placements(&case, 2);
                let mut locals = Vec::new();
                let mut dts = Vec::new();
                for x in [&qp, &kp, &vp] {
                    let xd = distribute_tensor(x, &mesh, &pl)?;
                    let var = Var::from_tensor(xd.to_local())?;
                    dts.push(DTensor::from_local_with_shape(
                        var.as_tensor(),
                        &mesh,
                        &pl,
                        x.dims(),
                    )?);
                    locals.push(var);
                }
                let o = dts[0].sdpa(&dts[1], &dts[2], case.causal, None)?;
                counts = forward_counts(&mode);
                let wd = distribute_tensor(&wp, &mesh, &pl)?;
                let g = o.mul(&wd)?.sum_all()?.backward()?;
                let mut gs = Vec::new();
                for x in &dts {
                    gs.push(x.grad(&g)?.ok_or("no gradient")?.full_tensor()?);
                }
                let [a, b, c]: [Tensor; 3] = gs.try_into().map_err(|_| "three grads")?;
                (o.full_tensor()?, [a, b, c])
            };
            let (a2a, ring, gathers) = counts;
            Ok((o, grads, a2a, ring, gathers, mode.table()))
        })
        .unwrap();
    // Undo the stored order to compare with the reference.
    let mut inv = vec![0u32; t];
    for (i, &p) in order.iter().enumerate() {
        inv[p as usize] = i as u32;
    }
    let inv = Tensor::new(inv.as_slice(), &Device::Cpu).unwrap();
    let unperm = |x: &Tensor| x.index_select(&inv, 2).unwrap();
    for (rank, (o, grads, a2a, ring, gathers, table)) in out.into_iter().enumerate() {
        let what = format!("{case:?} rank {rank}");
        close(&unperm(&o), &want.o, &format!("{what}: output"));
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            close(
                &unperm(&grads[i]),
                &want.grads[i],
                &format!("{what}: {name}"),
            );
        }
        if cp > 1 && case.expect == Expect::AllToAll {
            assert!(
                a2a >= 3 && ring == 0 && gathers == 0,
                "{what}: all-to-all strategy expected\n{table}"
            );
        }
        if cp > 1 && case.expect == Expect::Exchange {
            {
                assert_eq!(a2a, 0, "{what}: KV exchange expected\n{table}");
                match case.variant {
                    CpVariant::Ring => {
                        assert_eq!(ring, 1, "{what}: one ring exchange\n{table}")
                    }
                    CpVariant::AllGatherKv => {
                        assert_eq!(gathers, 2, "{what}: K/V gathers\n{table}")
                    }
                }
            }
        }
    }
}

const CP2: &[(&str, usize)] = &[("cp", 2)];
const CP3: &[(&str, usize)] = &[("cp", 3)];
const CP4: &[(&str, usize)] = &[("cp", 4)];
const DP2_CP2: &[(&str, usize)] = &[("dp", 2), ("cp", 2)];
const TP2_CP2: &[(&str, usize)] = &[("tp", 2), ("cp", 2)];

fn base(mesh: &'static [(&'static str, usize)]) -> Case {
    Case {
        mesh,
        b: 2,
        h: 3,
        t: 8,
        causal: true,
        layout: SeqLayout::Contiguous,
        variant: CpVariant::Ring,
        expect: Expect::Exchange,
        link: None,
        packed: false,
        tile: None,
    }
}

#[test]
fn ring_matches_one_device() {
    for mesh in [CP2, CP3, CP4] {
        for causal in [true, false] {
            for layout in [SeqLayout::Contiguous, SeqLayout::LoadBalanced] {
                let t = if mesh[0].1 == 3 { 12 } else { 16 };
                run(Case {
                    causal,
                    layout,
                    t,
                    ..base(mesh)
                });
            }
        }
    }
}

#[test]
fn ring_on_uneven_sequences() {
    // torch.chunk pieces of 7: over 2 (4, 3), over 3 (3, 3, 1), over 4 (2, 2, 2, 1).
    for (mesh, t) in [(CP2, 7), (CP3, 7), (CP4, 7)] {
        for causal in [true, false] {
            run(Case {
                t,
                causal,
                ..base(mesh)
            });
        }
    }
}

#[test]
fn all_gather_kv_matches_one_device() {
    for (mesh, layout, t) in [
        (CP2, SeqLayout::Contiguous, 7),
        (CP3, SeqLayout::LoadBalanced, 12),
    ] {
        run(Case {
            variant: CpVariant::AllGatherKv,
            layout,
            t,
            ..base(mesh)
        });
    }
}

#[test]
fn all_to_all_is_chosen_when_cheaper_and_matches() {
    // On a slow modeled link, all_to_alls of local pieces (to the heads) beat gathering K and V;
    // on the default (fast) one the exchange's single collective wins at this size.
    for layout in [SeqLayout::Contiguous, SeqLayout::LoadBalanced] {
        run(Case {
            h: 4,
            layout,
            expect: Expect::AllToAll,
            link: Some("cp=1us:0.01GBps"),
            ..base(CP4)
        });
    }
    // 3 heads over cp = 4 on the slow link: whatever is chosen, the numbers hold.
    run(Case {
        h: 3,
        expect: Expect::Any,
        link: Some("cp=1us:0.01GBps"),
        ..base(CP4)
    });
}

#[test]
fn composes_with_dp_and_tp() {
    for mesh in [DP2_CP2, TP2_CP2] {
        for layout in [SeqLayout::Contiguous, SeqLayout::LoadBalanced] {
            run(Case {
                h: 4,
                layout,
                ..base(mesh)
            });
        }
    }
}

#[test]
fn packed_attention_on_a_sharded_sequence() {
    for (mesh, layout, t) in [
        (CP2, SeqLayout::LoadBalanced, 8),
        (CP3, SeqLayout::Contiguous, 7),
        (TP2_CP2, SeqLayout::LoadBalanced, 8),
    ] {
        // Re-sharding the packed qkv to the heads (one all_to_all) usually beats gathering
        // K and V; either way the numbers must hold.
        run(Case {
            h: 4,
            layout,
            t,
            packed: true,
            expect: Expect::Any,
            ..base(mesh)
        });
    }
}

#[test]
fn layouts_and_bad_sequences() {
    assert_eq!(
        positions("t", 8, 2, 0, SeqLayout::LoadBalanced).unwrap(),
        vec![0, 1, 6, 7]
    );
    assert_eq!(
        positions("t", 8, 2, 1, SeqLayout::LoadBalanced).unwrap(),
        vec![2, 3, 4, 5]
    );
    assert_eq!(
        positions("t", 7, 3, 2, SeqLayout::Contiguous).unwrap(),
        vec![6]
    );
    assert_eq!(
        load_balanced_order(8, 2).unwrap(),
        vec![0, 1, 6, 7, 2, 3, 4, 5]
    );
    let e = positions("sdpa", 6, 2, 0, SeqLayout::LoadBalanced)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sdpa") && e.contains("multiple of 2 x cp = 4"),
        "{e}"
    );
    let e = load_balanced_order(2, 2).unwrap_err().to_string();
    assert!(e.contains("2 tokens"), "{e}");
    let e = positions("sdpa", 2, 3, 0, SeqLayout::Contiguous)
        .unwrap_err()
        .to_string();
    assert!(e.contains("T >= cp"), "{e}");
    // At run time: a balanced layout the sequence does not fit, on every rank, typed.
    let out = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| -> R<String> {
            let mesh = DeviceMesh::new(comm, CP2)?;
            let _l = layout_scope(SeqLayout::LoadBalanced, 2);
            let x = fixed(&[1, 2, 6, 4], 1);
            let d = distribute_tensor(&x, &mesh, &[Placement::Shard(2)])?;
            Ok(match d.sdpa(&d, &d, true, None) {
                Ok(_) => "accepted".into(),
                Err(e) => e.to_string(),
            })
        })
        .unwrap();
    for e in out {
        assert!(
            e.contains("sdpa") && e.contains("multiple of 2 x cp"),
            "{e}"
        );
    }
}

#[test]
fn strategies_chosen_by_the_caller_match() {
    use candle_dtensor_core::cp::{attention, Strategy};
    let (b, h, t, d) = (1, 3, 9, 4);
    let (q, k, v, w) = (
        fixed(&[b, h, t, d], 1),
        fixed(&[b, h, t, d], 2),
        fixed(&[b, h, t, d], 3),
        fixed(&[b, h, t, d], 4),
    );
    let want = reference(&q, &k, &v, &w, true);
    for strategy in [
        Strategy::Exchange(CpVariant::Ring),
        Strategy::Exchange(CpVariant::AllGatherKv),
        Strategy::AllToAll,
    ] {
        let (q, k, v, w) = (q.clone(), k.clone(), v.clone(), w.clone());
        let out = LocalWorld::new(3)
            .with_timeout(Duration::from_secs(60))
            .launch(move |comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, CP3)?;
                let pl = [Placement::Shard(2)];
                let mut dts = Vec::new();
                for x in [&q, &k, &v] {
                    let xd = distribute_tensor(x, &mesh, &pl)?;
                    let var = Var::from_tensor(xd.to_local())?;
                    dts.push(DTensor::from_local_with_shape(
                        var.as_tensor(),
                        &mesh,
                        &pl,
                        x.dims(),
                    )?);
                }
                let o = attention(&dts[0], &dts[1], &dts[2], true, None, strategy)?;
                let g = o
                    .mul(&distribute_tensor(&w, &mesh, &pl)?)?
                    .sum_all()?
                    .backward()?;
                let mut gs = vec![o.full_tensor()?];
                for x in &dts {
                    gs.push(x.grad(&g)?.ok_or("no gradient")?.full_tensor()?);
                }
                // Not sharded on the sequence: refused, typed.
                let r = distribute_tensor(&q, &mesh, &[Placement::Replicate])?;
                let e = attention(&r, &r, &r, true, None, strategy)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                Ok((gs, e))
            })
            .unwrap();
        for (gs, e) in out {
            close(&gs[0], &want.o, &format!("{strategy:?} output"));
            for i in 0..3 {
                close(
                    &gs[i + 1],
                    &want.grads[i],
                    &format!("{strategy:?} grad {i}"),
                );
            }
            assert!(
                e.contains("cp::attention") && e.contains("exactly one"),
                "{e}"
            );
        }
    }
}

#[test]
fn tiled_queries_match_one_device() {
    // Tiles of about 7 score elements: one query row per tile here (uneven last tiles on the
    // uneven sequence), so every block runs tile by tile, forward and backward.
    for (mesh, layout, t, variant) in [
        (CP2, SeqLayout::LoadBalanced, 8, CpVariant::Ring),
        (CP3, SeqLayout::Contiguous, 7, CpVariant::Ring),
        (CP2, SeqLayout::Contiguous, 9, CpVariant::AllGatherKv),
    ] {
        run(Case {
            layout,
            t,
            variant,
            tile: Some(7),
            ..base(mesh)
        });
    }
    run(Case {
        h: 4,
        expect: Expect::AllToAll,
        link: Some("cp=1us:0.01GBps"),
        tile: Some(40),
        ..base(CP4)
    });
}
