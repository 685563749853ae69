//! Every op family the compiler covers, on random shapes and placements on 1-D (n = 1..8), 2-D
//! (2x2, 2x3) and 3-D (2x2x2) meshes: `full_tensor()` of the output equals single-device candle
//! (`reference_apply`), the output's local piece has the shape its placements say, and every
//! float input's local gradient equals its piece of the single-device gradient.
//!
//! Placements are drawn per mesh dim: Shard on a random dim, Replicate, Partial(sum/avg/max/min)
//! for float inputs (split asymmetrically across ranks, see `common::make_pieces`), and now and
//! then StridedShard (FSDP-after-TP layouts).
//!
//! Gradient semantics of inputs: a Shard/Replicate input's local gradient is its piece of the
//! full gradient; a Partial input's local (candle) gradient is the derivative of the loss with
//! respect to that local summand: the replicated gradient of the value for `P(sum)`, `/n` for
//! `P(avg)`, and the gradient masked to the rank holding the extreme for `P(max)`/`P(min)`.
//! Both are checked, and so is the rule users see: every input's gradient read as a DTensor
//! (`DTensor::grad`) has a local piece that fits its placements and a `full_tensor()` equal to
//! the single-device gradient, Partial inputs included.
//!
//! Planned == executed: every case records its forward collectives with `CommDebugMode` and
//! compares them (kind and mesh dim) with the compiler's decision for the same inputs (the
//! redistribution steps and the op's internal comms).
//!
//! Tolerance: f32 relative error 1e-5 (`|a - b| <= 1e-5 (1 + |b|)`) for every op. Inputs are
//! O(1) and reductions short, so the different summation order of sharded reductions stays
//! far below it.
//!
//! Cases are seeded (splitmix64) and listed with their op, mesh, shapes and placements on
//! failure. `CDT_FULL_SWEEP=1` runs eight times as many (`CDT_SWEEP_SCALE=<n>`: n times).

mod common;

use candle_core::Tensor;
use candle_dtensor_core::{Placement, ReduceOp};
use candle_dtensor_strategies::{BinaryOp, CmpOp, Dims, Op, ScalarOp, Shape, UnaryOp};
use common::*;

/// Runs `n` cases of a family (times [`sweep_scale`]), spread over every mesh.
fn family(name: &str, n: usize, gen: impl Fn(&mut Rng, usize) -> Spec) {
    let n = n * sweep_scale();
    let mut by_mesh: Vec<Vec<Case>> = MESHES.iter().map(|_| Vec::new()).collect();
    let off = Rng::for_name(name, 0).below(MESHES.len());
    for i in 0..n {
        let mut rng = Rng::for_name(name, i as u64 + 1);
        let m = (i + off) % MESHES.len();
        let spec = gen(&mut rng, i);
        by_mesh[m].push(prepare(&mut rng, spec, MESHES[m]));
    }
    let mut fails = Vec::new();
    for (m, cases) in by_mesh.iter().enumerate() {
        if !cases.is_empty() {
            fails.extend(run_cases(MESHES[m], cases));
        }
    }
    assert_no_failures(name, &fails);
}

fn t(rng: &mut Rng, shape: &[usize], d: Domain) -> Tensor {
    tensor(rng, shape, d)
}

/// `(tensor, domain, partials)` of a float input.
fn fin(rng: &mut Rng, shape: &[usize], d: Domain) -> (Tensor, Domain, &'static [ReduceOp]) {
    (t(rng, shape, d), d, ALL_PARTIALS)
}

/// A float input of standard normal values.
fn normal(rng: &mut Rng, shape: &[usize]) -> (Tensor, Domain, &'static [ReduceOp]) {
    fin(rng, shape, Domain::Normal)
}

/// A float input split into partials only exactly (sum of integers, max, min): for ops whose
/// result a rounded sum could change (ties, casts, arg-reductions).
fn exact(rng: &mut Rng, shape: &[usize], d: Domain) -> (Tensor, Domain, &'static [ReduceOp]) {
    (t(rng, shape, d), d, EXACT_PARTIALS)
}

/// An integer (or mask) input.
fn iin(rng: &mut Rng, shape: &[usize], d: Domain) -> (Tensor, Domain, &'static [ReduceOp]) {
    (t(rng, shape, d), d, &[])
}

/// A random shape of 1-3 dims, and its number of dims.
fn any_shape(rng: &mut Rng) -> (usize, Vec<usize>) {
    let nd = rng.range(1, 3);
    (nd, rng.shape(nd))
}

/// Ids in `0..hi`, i64 with probability `p_i64`, else u32.
fn any_ids(rng: &mut Rng, p_i64: f64, hi: usize) -> Domain {
    if rng.chance(p_i64) {
        Domain::IdsI64(hi)
    } else {
        Domain::Ids(hi)
    }
}

/// An attention scale: the default (`1/sqrt(d)`) or 0.3, equally likely.
fn any_scale(rng: &mut Rng) -> Option<candle_dtensor_strategies::Scalar> {
    if rng.chance(0.5) {
        None
    } else {
        Some(0.3.into())
    }
}

/// A shape that broadcasts to `full`: some dims set to 1, maybe leading dims dropped.
fn broadcastable(rng: &mut Rng, full: &[usize]) -> Vec<usize> {
    let drop = if full.len() > 1 && rng.chance(0.3) {
        rng.range(1, full.len() - 1)
    } else {
        0
    };
    full[drop..]
        .iter()
        .map(|&d| if rng.chance(0.35) { 1 } else { d })
        .collect()
}

#[test]
fn matmul() {
    family("matmul", 22, |rng, _| {
        let nb = rng.below(3);
        let batch = rng.shape(nb);
        let (m, k, n) = (rng.dim(), rng.dim(), rng.dim());
        let x = [&batch[..], &[m, k]].concat();
        let w = [&batch[..], &[k, n]].concat();
        Spec::new(Op::Matmul, vec![normal(rng, &x), normal(rng, &w)])
    });
}

#[test]
fn broadcast_matmul() {
    family("broadcast_matmul", 22, |rng, _| {
        let nb = rng.range(1, 2);
        let batch = rng.shape(nb);
        let (m, k, n) = (rng.dim(), rng.dim(), rng.dim());
        let bx = broadcastable(rng, &batch);
        let bw = broadcastable(rng, &batch);
        let (bx, bw) = if rng.chance(0.3) {
            (bx, Vec::new())
        } else {
            (bx, bw)
        };
        let x = [&bx[..], &[m, k]].concat();
        let w = [&bw[..], &[k, n]].concat();
        Spec::new(Op::BroadcastMatmul, vec![normal(rng, &x), normal(rng, &w)])
    });
}

#[test]
fn linear() {
    family("linear", 22, |rng, i| {
        let bias = i % 2 == 0;
        let nl = rng.range(0, 2);
        let lead = rng.shape(nl);
        let (fin_, fout) = (rng.dim(), rng.dim());
        let x = [&lead[..], &[fin_]].concat();
        let mut ins = vec![normal(rng, &x), normal(rng, &[fout, fin_])];
        if bias {
            ins.push(normal(rng, &[fout]));
        }
        Spec::new(Op::Linear { bias }, ins)
    });
}

#[test]
fn unary() {
    let ops = UnaryOp::ALL;
    family("unary", 2 * ops.len(), |rng, i| {
        let u = ops[i % ops.len()];
        let d = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Recip => Domain::Positive,
            _ => Domain::Normal,
        };
        let (_, shape) = any_shape(rng);
        Spec::new(Op::Unary(u), vec![fin(rng, &shape, d)])
    });
}

#[test]
fn affine_and_scalar_ops() {
    let scalars = ScalarOp::ALL;
    family("affine_scalar", 2 * (scalars.len() + 2), |rng, i| {
        let (_, shape) = any_shape(rng);
        let k = i % (scalars.len() + 2);
        if k >= scalars.len() {
            let mul = rng.pick(&[2.0, -1.5, 0.5]);
            let add = if k == scalars.len() { 0.0 } else { 0.75 };
            return Spec::new(
                Op::Affine {
                    mul: mul.into(),
                    add: add.into(),
                },
                vec![normal(rng, &shape)],
            );
        }
        let s = scalars[k];
        let (v, d) = match s {
            ScalarOp::Add => (0.5, Domain::Normal),
            ScalarOp::Sub => (1.25, Domain::Normal),
            ScalarOp::Mul => (rng.pick(&[3.0, -2.0]), Domain::Normal),
            ScalarOp::Div => (rng.pick(&[4.0, -0.5]), Domain::Normal),
            ScalarOp::Pow => {
                if rng.chance(0.5) {
                    (2.0, Domain::Normal)
                } else {
                    (1.5, Domain::Positive)
                }
            }
            ScalarOp::Maximum => (0.1, Domain::Normal),
            ScalarOp::Minimum => (-0.2, Domain::Normal),
        };
        Spec::new(Op::ScalarOp(s, v.into()), vec![fin(rng, &shape, d)])
    });
}

#[test]
fn binary_broadcasting() {
    let ops = BinaryOp::ALL;
    family("binary", 4 * ops.len(), |rng, i| {
        let b = ops[i % ops.len()];
        let (_, full) = any_shape(rng);
        let other = broadcastable(rng, &full);
        let (sa, sb) = if rng.chance(0.5) {
            (full, other)
        } else {
            (other, full)
        };
        let db = if b == BinaryOp::Div {
            Domain::Positive
        } else {
            Domain::Normal
        };
        Spec::new(Op::Binary(b), vec![normal(rng, &sa), fin(rng, &sb, db)])
    });
}

#[test]
fn comparisons() {
    let ops = CmpOp::ALL;
    family("cmp", 2 * ops.len(), |rng, i| {
        let c = ops[i % ops.len()];
        let (_, full) = any_shape(rng);
        let other = broadcastable(rng, &full);
        // Quantized values make ties; only exact partials (a rounded sum could flip a tie).
        let a = exact(rng, &full, Domain::Quantized);
        let b = exact(rng, &other, Domain::Quantized);
        Spec::new(Op::Cmp(c), vec![a, b]).forward_only()
    });
}

fn reduce_dims(rng: &mut Rng, nd: usize) -> Dims {
    match rng.below(4) {
        0 => Dims::new(), // all dims
        1 if nd >= 2 => {
            let p = rng.perm(nd);
            let mut d: Dims = p[..2].iter().copied().collect();
            if rng.chance(0.5) {
                d.reverse();
            }
            d
        }
        _ => smallvec::smallvec![rng.below(nd)],
    }
}

#[test]
fn reductions() {
    family("reductions", 40, |rng, i| {
        let (nd, shape) = any_shape(rng);
        let dims = reduce_dims(rng, nd);
        let keepdim = rng.chance(0.5);
        let op = match i % 4 {
            0 => Op::Sum { dims, keepdim },
            1 => Op::Mean { dims, keepdim },
            2 => Op::Max { dims, keepdim },
            _ => Op::Min { dims, keepdim },
        };
        Spec::new(op, vec![normal(rng, &shape)])
    });
}

#[test]
fn argmax() {
    family("argmax", 12, |rng, _| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        let keepdim = rng.chance(0.5);
        let x = exact(rng, &shape, Domain::Normal);
        Spec::new(Op::ArgMax { dim, keepdim }, vec![x]).forward_only()
    });
}

#[test]
fn softmax_and_log_softmax() {
    family("softmax", 24, |rng, i| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        let op = if i % 2 == 0 {
            Op::Softmax { dim }
        } else {
            Op::LogSoftmax { dim }
        };
        Spec::new(op, vec![normal(rng, &shape)])
    });
}

/// Tolerance of the norms: 1e-4. The runtime runs the fused f32 kernels (one-pass backward
/// `rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat))`), the reference candle primitives. For
/// short normalized dims (1-3 here) and small row variances the three terms nearly cancel and
/// are scaled by a large `rstd`, so the two roundings differ by up to ~3e-5 relative
/// (`tests/fused.rs` compares the kernels themselves at 2e-5 on wider rows).
const NORM_TOL: f64 = 1e-4;

#[test]
fn norms() {
    family("norms", 24, |rng, i| {
        let (nd, shape) = any_shape(rng);
        let last = shape[nd - 1];
        let eps = 1e-5;
        let x = normal(rng, &shape);
        match i % 4 {
            0 => Spec::new(
                Op::LayerNorm {
                    eps: eps.into(),
                    affine: false,
                    bias: false,
                },
                vec![x],
            ),
            1 => Spec::new(
                Op::LayerNorm {
                    eps: eps.into(),
                    affine: true,
                    bias: false,
                },
                vec![x, normal(rng, &[last])],
            ),
            2 => Spec::new(
                Op::LayerNorm {
                    eps: eps.into(),
                    affine: true,
                    bias: true,
                },
                vec![x, normal(rng, &[last]), normal(rng, &[last])],
            ),
            _ => Spec::new(
                Op::RmsNorm { eps: eps.into() },
                vec![x, normal(rng, &[last])],
            ),
        }
        .with_tol(NORM_TOL)
    });
}

#[test]
fn embedding() {
    family("embedding", 22, |rng, _| {
        let v = rng.range(2, 13);
        let d = rng.dim();
        let ni = rng.range(1, 2);
        let ids_shape = rng.shape(ni);
        let ids = any_ids(rng, 0.3, v);
        Spec::new(
            Op::Embedding,
            vec![iin(rng, &ids_shape, ids), normal(rng, &[v, d])],
        )
    });
}

#[test]
fn cross_entropy() {
    // Logits [.., C] with 0-3 leading dims (rows [N], a language model's [B, T], ...).
    family("cross_entropy", 30, |rng, _| {
        let nd = [1, 1, 2, 2, 3, 0][rng.below(6)];
        let lead = rng.shape(nd);
        let c = rng.range(2, 13);
        let tgt = any_ids(rng, 0.5, c);
        let mut shape = lead.clone();
        shape.push(c);
        Spec::new(
            Op::CrossEntropy,
            vec![normal(rng, &shape), iin(rng, &lead, tgt)],
        )
    });
}

/// A target shape with the same numel: merges, splits, flatten-all, inserted 1s.
fn reshape_target(rng: &mut Rng, shape: &[usize]) -> Vec<usize> {
    let mut cands: Vec<Vec<usize>> = vec![vec![shape.iter().product()]];
    for i in 0..shape.len().saturating_sub(1) {
        let mut s = shape.to_vec();
        let merged = s[i] * s[i + 1];
        s.splice(i..i + 2, [merged]);
        cands.push(s);
    }
    for (i, &d) in shape.iter().enumerate() {
        for a in 2..d {
            if d % a == 0 {
                let mut s = shape.to_vec();
                s.splice(i..i + 1, [a, d / a]);
                cands.push(s);
            }
        }
    }
    let mut s = shape.to_vec();
    s.insert(rng.below(shape.len() + 1), 1);
    cands.push(s);
    // A regrouping across dims, e.g. [12, 8] -> [16, 6].
    let numel: usize = shape.iter().product();
    for a in [2, 3, 4, 6, 16] {
        if numel % a == 0 && a != shape[0] {
            cands.push(vec![a, numel / a]);
        }
    }
    rng.pick(&cands)
}

#[test]
fn views() {
    family("views", 60, |rng, i| {
        let (nd, mut shape) = any_shape(rng);
        let op = match i % 9 {
            0 | 1 => {
                // Sizes with factors, so splits and merges occur.
                shape = (0..nd).map(|_| rng.pick(&[1, 2, 4, 6, 8, 9, 12])).collect();
                Op::Reshape {
                    shape: Shape::from_vec(reshape_target(rng, &shape)),
                }
            }
            2 => Op::Transpose {
                dim0: rng.below(nd),
                dim1: rng.below(nd),
            },
            3 => Op::Permute {
                dims: rng.perm(nd).into_iter().collect(),
            },
            4 => {
                let dim = rng.below(nd);
                let start = rng.below(shape[dim]);
                let len = rng.range(0, shape[dim] - start);
                let len = if len == 0 { shape[dim] - start } else { len };
                if rng.chance(0.2) {
                    Op::Narrow {
                        dim,
                        start: 0,
                        len: shape[dim],
                    }
                } else {
                    Op::Narrow { dim, start, len }
                }
            }
            5 => {
                let dim = rng.below(nd);
                shape[dim] = 1;
                Op::Squeeze { dim }
            }
            6 => Op::Unsqueeze {
                dim: rng.below(nd + 1),
            },
            7 => {
                let small = broadcastable(rng, &shape);
                let mut target = shape.clone();
                if rng.chance(0.4) {
                    target.insert(0, rng.dim());
                }
                let op = Op::BroadcastAs {
                    shape: Shape::from_vec(target),
                };
                shape = small;
                op
            }
            _ => {
                let start = rng.below(nd);
                let end = rng.range(start, nd - 1);
                Op::Flatten { start, end }
            }
        };
        Spec::new(op, vec![normal(rng, &shape)])
    });
}

#[test]
fn cat_and_stack() {
    family("cat_stack", 22, |rng, i| {
        let (nd, shape) = any_shape(rng);
        let k = rng.range(2, 3);
        if i % 2 == 0 {
            let dim = rng.below(nd);
            let ins = (0..k)
                .map(|_| {
                    let mut s = shape.clone();
                    s[dim] = rng.dim();
                    normal(rng, &s)
                })
                .collect();
            Spec::new(Op::Cat { dim }, ins)
        } else {
            let dim = rng.below(nd + 1);
            let ins = (0..k).map(|_| normal(rng, &shape)).collect();
            Spec::new(Op::Stack { dim }, ins)
        }
    });
}

#[test]
fn contiguous_and_casts() {
    use candle_dtensor_strategies::DType as SD;
    family("casts", 22, |rng, i| {
        let (_, shape) = any_shape(rng);
        match i % 4 {
            0 => Spec::new(Op::Contiguous, vec![normal(rng, &shape)]),
            1 => Spec::new(Op::ToDType(SD::F64), vec![normal(rng, &shape)]),
            // Casting each summand of a P(sum) to bf16 rounds differently from casting the sum:
            // only exact partials here (max/min commute with monotone rounding).
            2 => Spec::new(
                Op::ToDType(SD::BF16),
                vec![exact(rng, &shape, Domain::Normal)],
            ),
            _ => Spec::new(
                Op::ToDType(SD::I64),
                vec![exact(rng, &shape, Domain::Quantized)],
            )
            .forward_only(),
        }
    });
}

#[test]
fn where_and_masked_fill() {
    family("where_masked_fill", 22, |rng, i| {
        let (_, full) = any_shape(rng);
        if i % 2 == 0 {
            let sc = broadcastable(rng, &full);
            let st = broadcastable(rng, &full);
            let mut ins = vec![
                iin(rng, &sc, Domain::Mask),
                normal(rng, &st),
                normal(rng, &full),
            ];
            if rng.chance(0.5) {
                ins.swap(1, 2);
            }
            Spec::new(Op::Where, ins)
        } else {
            let sm = broadcastable(rng, &full);
            Spec::new(
                Op::MaskedFill {
                    value: rng.pick(&[-1.5, 0.0, 3.0]).into(),
                },
                vec![normal(rng, &full), iin(rng, &sm, Domain::Mask)],
            )
        }
    });
}

#[test]
fn dropout() {
    family("dropout", 14, |rng, _| {
        let (_, shape) = any_shape(rng);
        let p = rng.pick(&[0.0, 0.25, 0.5]);
        Spec::new(Op::Dropout { p: p.into() }, vec![normal(rng, &shape)])
    });
}

#[test]
fn sdpa() {
    family("sdpa", 22, |rng, i| {
        let (b, h) = (rng.range(1, 4), rng.range(1, 4));
        let (tq, tk) = (rng.range(1, 6), rng.range(1, 6));
        let causal = i % 2 == 0;
        // Causal attention with more queries than keys leaves the first rows without any key:
        // the primitive reference gives NaN there and the fused kernel 0 (not a distribution
        // question), so causal cases keep tq <= tk.
        let (tq, tk) = if causal {
            (tq.min(tk), tq.max(tk))
        } else {
            (tq, tk)
        };
        let (d, dv) = (rng.range(1, 5), rng.range(1, 5));
        let scale = any_scale(rng);
        Spec::new(
            Op::Sdpa { causal, scale },
            vec![
                normal(rng, &[b, h, tq, d]),
                normal(rng, &[b, h, tk, d]),
                normal(rng, &[b, h, tk, dv]),
            ],
        )
    });
}

#[test]
fn packed_sdpa() {
    family("packed_sdpa", 22, |rng, i| {
        let (b, t, h, d) = (
            rng.range(1, 4),
            rng.range(1, 6),
            rng.range(1, 5),
            rng.range(1, 5),
        );
        let scale = any_scale(rng);
        Spec::new(
            Op::PackedSdpa {
                causal: i % 2 == 0,
                scale,
            },
            vec![normal(rng, &[b, t, h, 3, d])],
        )
    });
}

/// Attention on the flat projection `[B, T, 3 H d]`: random heads and head dims, so the
/// features' shards fall between heads on some meshes and inside them on others (then the
/// compiler must move the projection).
#[test]
fn flat_sdpa() {
    family("flat_sdpa", 22, |rng, i| {
        let (b, t, h, d) = (
            rng.range(1, 4),
            rng.range(1, 6),
            rng.range(1, 6),
            rng.range(1, 4),
        );
        let scale = any_scale(rng);
        Spec::new(
            Op::FlatSdpa {
                heads: h,
                causal: i % 2 == 0,
                scale,
            },
            vec![normal(rng, &[b, t, 3 * h * d])],
        )
    });
}

/// A column-parallel QKV projection's output as it is: feature shards of whole heads (one or
/// two mesh dims, 2-3 heads a rank) and batch shards, even or not, move nothing.
#[test]
fn flat_attention_on_whole_heads_moves_nothing() {
    let flat = |heads| Op::FlatSdpa {
        heads,
        causal: true,
        scale: None,
    };
    check_layouts(
        "flat_sdpa_heads",
        vec![
            lay(flat(6), &[3], "[2, 5, 36] S(2)", "S(2)"),
            lay(flat(4), &[2, 2], "[2, 3, 24] S(2),S(2)", "S(2),S(2)"),
            lay(flat(6), &[2, 3], "[3, 4, 72] S(0),S(2)", "S(0),S(2)"),
            lay(flat(2), &[4], "[5, 3, 12] S(0)", "S(0)"),
        ],
    );
}

#[test]
fn index_select() {
    family("index_select", 22, |rng, _| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        let k = rng.range(1, 9);
        Spec::new(
            Op::IndexSelect { dim },
            vec![normal(rng, &shape), iin(rng, &[k], Domain::Ids(shape[dim]))],
        )
    });
}

#[test]
fn gather() {
    family("gather", 22, |rng, _| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        let smaller = rng.chance(0.35);
        let idx_shape: Vec<usize> = (0..nd)
            .map(|d| {
                if d == dim {
                    rng.range(1, 6)
                } else if smaller {
                    rng.range(1, shape[d])
                } else {
                    shape[d]
                }
            })
            .collect();
        Spec::new(
            Op::Gather { dim },
            vec![
                normal(rng, &shape),
                iin(rng, &idx_shape, Domain::Ids(shape[dim])),
            ],
        )
    });
}

/// The op table's contract, at runtime ("Adding an op" in docs/ARCHITECTURE.md): every declared
/// op name, built from its declaration's example (`explain`'s parser), runs on DTensors with
/// random placements (Partial inputs from distinct summands) on a 1-D and a 2-D mesh and matches
/// single-device candle, values and gradients. A declaration whose family lacks its kernel or
/// reference fails here.
#[test]
fn every_declared_op_matches_one_device() {
    use candle_dtensor_strategies::{resolve, ExplainRequest, InputKind, Shape};
    for mesh in [&[3][..], &[2, 2]] {
        let mut cases = Vec::new();
        for decl in Op::declarations() {
            for (k, name) in decl.names.iter().enumerate() {
                let req = ExplainRequest {
                    mesh: "a=2".into(),
                    op: name.to_string(),
                    ..Default::default()
                }
                .with_example(decl.example)
                .unwrap();
                let resolved = resolve(&req).unwrap_or_else(|e| panic!("{name}: {e}"));
                let op = resolved.op.expect("an op");
                let shapes: Vec<Shape> = resolved
                    .specs
                    .iter()
                    .map(|s| s.meta.shape.clone())
                    .collect();
                let mut rng = Rng::for_name(name, mesh.len() as u64 + k as u64);
                let inputs = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let (d, partials) = match op.input_kind(i, &shapes) {
                            InputKind::Float => (Domain::Normal, ALL_PARTIALS),
                            InputKind::Positive => (Domain::Positive, ALL_PARTIALS),
                            InputKind::Index { bound } => (Domain::IdsI64(bound), &[][..]),
                            InputKind::Mask => (Domain::Mask, &[][..]),
                        };
                        (t(&mut rng, s, d), d, partials)
                    })
                    .collect();
                cases.push(prepare(&mut rng, Spec::new(op, inputs), mesh));
            }
        }
        assert_no_failures("declared ops", &run_cases(mesh, &cases));
    }
}

/// One layout the compiler must handle without moving data (issue 14 items 4-8): the op, its
/// inputs with fixed placements, the mesh, the output placements it must choose and the only
/// collectives allowed in the forward op (the op's own, e.g. softmax's two small all_reduces).
struct Layout {
    op: Op,
    inputs: Vec<(Vec<usize>, Domain, &'static str)>,
    mesh: &'static [usize],
    out: &'static str,
    comms: &'static [&'static str],
}

/// The layout of `op` on a mesh shaped `mesh` with `inputs` that must give the output
/// placements `out` (`;` between outputs), and no collectives inside the op. Inputs are
/// `;`-separated `[d0, d1, ..] [DOMAIN] PLACEMENTS`, standard normal values unless DOMAIN says
/// `pos`, `ids:N` or `ids64:N` (ids in `0..N`, u32 or i64).
fn lay(op: Op, mesh: &'static [usize], inputs: &'static str, out: &'static str) -> Layout {
    let input = |spec: &'static str| {
        let bad = || -> ! { panic!("input {spec:?} is not [SHAPE] [DOMAIN] PLACEMENTS") };
        let Some((shape, rest)) = spec
            .trim()
            .strip_prefix('[')
            .and_then(|s| s.split_once(']'))
        else {
            bad()
        };
        let shape: Vec<usize> = shape
            .split(',')
            .map(|d| d.trim().parse().unwrap_or_else(|_| bad()))
            .collect();
        let bound = |n: &str| n.parse().unwrap_or_else(|_| bad());
        let domain = |d: &str| match d.split_once(':') {
            None if d == "pos" => Domain::Positive,
            Some(("ids", n)) => Domain::Ids(bound(n)),
            Some(("ids64", n)) => Domain::IdsI64(bound(n)),
            _ => bad(),
        };
        match rest.split_whitespace().collect::<Vec<_>>()[..] {
            [p] => (shape, Domain::Normal, p),
            [d, p] => (shape, domain(d), p),
            _ => bad(),
        }
    };
    Layout {
        op,
        inputs: inputs.split(';').map(input).collect(),
        mesh,
        out,
        comms: &[],
    }
}

impl Layout {
    /// The collectives the op itself runs (e.g. softmax's two small all_reduces).
    fn comms(self, comms: &'static [&'static str]) -> Layout {
        Layout { comms, ..self }
    }
}

/// Checks each layout's decision (output placements, no redistribution, only the allowed
/// collectives), then runs it against one device (values, gradients, planned == executed).
fn check_layouts(name: &str, layouts: Vec<Layout>) {
    use candle_dtensor_strategies::{
        global_propagator, parse_placements, DTensorSpec, MeshTopology,
    };
    let mut fails = Vec::new();
    for (k, l) in layouts.into_iter().enumerate() {
        let topo = MeshTopology::new(&mesh_dims(l.mesh)).unwrap();
        let mut rng = Rng::for_name(name, k as u64);
        let ins: Vec<(Tensor, Domain, Vec<Placement>)> = l
            .inputs
            .iter()
            .map(|(shape, d, p)| {
                let t = t(&mut rng, shape, *d);
                (t, *d, parse_placements(p).unwrap().to_vec())
            })
            .collect();
        let specs: Vec<DTensorSpec> = ins
            .iter()
            .map(|(t, _, p)| {
                let dt = match t.dtype() {
                    candle_core::DType::U32 => candle_dtensor_strategies::DType::U32,
                    candle_core::DType::I64 => candle_dtensor_strategies::DType::I64,
                    candle_core::DType::U8 => candle_dtensor_strategies::DType::U8,
                    _ => candle_dtensor_strategies::DType::F32,
                };
                DTensorSpec::new(t.dims(), dt, p)
            })
            .collect();
        let refs: Vec<&DTensorSpec> = specs.iter().collect();
        let s = global_propagator().propagate(&l.op, &refs, &topo).unwrap();
        let out = s
            .output_specs
            .iter()
            .map(|o| candle_dtensor_strategies::format_placements(&o.placements))
            .collect::<Vec<_>>()
            .join(";");
        let desc = format!("{:?} on {:?} with {:?}", l.op, l.mesh, l.inputs);
        if out != l.out {
            fails.push(format!("{desc}: output {out}, expected {}", l.out));
        }
        // Local steps (chunks, the bias's partition) are fine; collectives are not.
        if s.redistributions
            .iter()
            .flatten()
            .any(|p| p.communication_steps().next().is_some())
        {
            fails.push(format!("{desc}: moves inputs: {:?}", s.redistributions));
        }
        let internal: Vec<&str> = s.internal.iter().map(|(_, c)| c.kind.name()).collect();
        if internal != l.comms {
            fails.push(format!(
                "{desc}: internal comms {internal:?}, expected {:?}",
                l.comms
            ));
        }
        let case = case_with_placements(&mut rng, l.op.clone(), ins, true, l.mesh);
        fails.extend(run_cases(l.mesh, &[case]));
    }
    assert_no_failures(name, &fails);
}

/// Row-parallel linear with a bias: activation and weight sharded on the contracted dim, the
/// bias replicated (or already `P(sum)`): `P(sum)` out, the bias added once through a free
/// `R -> P(sum)` partition; 1-3-d meshes, uneven in-features.
#[test]
fn row_parallel_linear_with_bias_is_free() {
    check_layouts(
        "row_parallel_bias",
        vec![
            lay(
                Op::Linear { bias: true },
                &[4],
                "[6, 10] S(1); [5, 10] S(1); [5] R",
                "P(sum)",
            ),
            lay(
                Op::Linear { bias: true },
                &[3],
                "[3, 4, 7] S(2); [9, 7] S(1); [9] P(sum)",
                "P(sum)",
            ),
            lay(
                Op::Linear { bias: true },
                &[2, 3],
                "[5, 9] S(0),S(1); [4, 9] R,S(1); [4] R,R",
                "S(0),P(sum)",
            ),
            lay(
                Op::Linear { bias: true },
                &[2, 2, 2],
                "[4, 6, 11] S(0),S(1),S(2); [3, 11] R,R,S(1); [3] R,R,R",
                "S(0),S(1),P(sum)",
            ),
        ],
    );
}

/// Means and cross-entropy over unevenly (even emptily) sharded rows: local sums over the
/// global count, `P(sum)`, nothing moves.
#[test]
fn uneven_batch_reductions_move_nothing() {
    let dims = |d: &[usize]| -> Dims { d.iter().copied().collect() };
    check_layouts(
        "uneven_batch",
        vec![
            lay(
                Op::CrossEntropy,
                &[4],
                "[13, 9] S(0); [13] ids64:9 S(0)",
                "P(sum)",
            ),
            lay(
                Op::CrossEntropy,
                &[5],
                "[3, 5] S(0); [3] ids:5 S(0)",
                "P(sum)",
            ),
            lay(
                Op::CrossEntropy,
                &[2, 3],
                "[5, 9] S(0),S(0); [5] ids64:9 S(0),S(0)",
                "P(sum),P(sum)",
            ),
            // [B, T, V] logits: the batch and the sequence sharded by different mesh dims (as
            // context parallelism lays them), unevenly and emptily, need no merge.
            lay(
                Op::CrossEntropy,
                &[2, 4],
                "[3, 7, 9] S(0),S(1); [3, 7] ids64:9 S(0),S(1)",
                "P(sum),P(sum)",
            ),
            lay(
                Op::CrossEntropy,
                &[4],
                "[2, 3, 5] S(1); [2, 3] ids:5 S(1)",
                "P(sum)",
            ),
            lay(
                Op::CrossEntropy,
                &[2, 2],
                "[9, 2, 6] S(0),S(0); [9, 2] ids:6 S(0),S(0)",
                "P(sum),P(sum)",
            ),
            lay(
                Op::Mean {
                    dims: dims(&[0]),
                    keepdim: false,
                },
                &[4],
                "[7, 3] S(0)",
                "P(sum)",
            ),
            lay(
                Op::Mean {
                    dims: dims(&[0, 2]),
                    keepdim: true,
                },
                &[2, 2, 2],
                "[5, 4, 3] S(0),S(2),S(1)",
                "P(sum),P(sum),S(1)",
            ),
        ],
    );
}

/// Views the layout can express cost nothing: flattening a sharded later dim keeps a strided
/// shard (PyTorch's `_StridedShard`), unflattening it back gives the plain shard, and size-1
/// dims come and go around sharded dims (uneven sizes throughout).
#[test]
fn views_the_layout_can_express_are_free() {
    let sh = |v: &[usize]| -> Shape { v.iter().copied().collect() };
    check_layouts(
        "free_views",
        vec![
            lay(
                Op::Flatten { start: 0, end: 1 },
                &[4],
                "[3, 7, 2] S(1)",
                "SS(0,3)",
            ),
            lay(
                Op::Reshape {
                    shape: sh(&[21, 2]),
                },
                &[4],
                "[3, 7, 2] S(1)",
                "SS(0,3)",
            ),
            lay(
                Op::Reshape {
                    shape: sh(&[3, 7, 2]),
                },
                &[4],
                "[21, 2] SS(0,3)",
                "S(1)",
            ),
            lay(
                Op::Flatten { start: 1, end: 2 },
                &[3],
                "[2, 5, 3] S(2)",
                "SS(1,5)",
            ),
            lay(
                Op::Flatten { start: 0, end: 2 },
                &[2],
                "[2, 4, 3] S(1)",
                "SS(0,2)",
            ),
            lay(
                Op::Reshape {
                    shape: sh(&[6, 1, 5]),
                },
                &[4],
                "[6, 5] S(1)",
                "S(2)",
            ),
            lay(
                Op::Reshape { shape: sh(&[6, 5]) },
                &[4],
                "[6, 1, 5] S(2)",
                "S(1)",
            ),
            lay(
                Op::Reshape {
                    shape: sh(&[1, 7, 3]),
                },
                &[3],
                "[7, 3] S(0)",
                "S(1)",
            ),
            lay(
                Op::Squeeze { dim: 1 },
                &[2, 2],
                "[5, 1, 3] S(2),S(0)",
                "S(1),S(0)",
            ),
            lay(
                Op::Unsqueeze { dim: 2 },
                &[2, 2],
                "[5, 3] S(1),S(0)",
                "S(1),S(0)",
            ),
            lay(
                Op::Reshape { shape: sh(&[6, 4]) },
                &[3, 2],
                "[2, 3, 4] S(1),S(2)",
                "SS(0,2),S(1)",
            ),
        ],
    );
}

/// Softmax and log-softmax over the sharded dim (uneven vocab) keep the data in place: two
/// small all_reduces (max, sum of exponentials) of the reduced shape.
#[test]
fn softmax_over_a_sharded_dim_keeps_the_data() {
    check_layouts(
        "sharded_softmax",
        vec![
            lay(Op::Softmax { dim: 1 }, &[4], "[512, 8195] S(1)", "S(1)")
                .comms(&["all_reduce", "all_reduce"]),
            lay(
                Op::LogSoftmax { dim: 1 },
                &[2, 3],
                "[256, 9001] S(0),S(1)",
                "S(0),S(1)",
            )
            .comms(&["all_reduce", "all_reduce"]),
        ],
    );
}

// === The ops of issue 14 item 9 ===

/// Reduced dims whose total count is at least 2 (a variance with correction 1 needs it).
fn dims_with_count(rng: &mut Rng, shape: &[usize]) -> Dims {
    for _ in 0..8 {
        let d = reduce_dims(rng, shape.len());
        let count: usize = if d.is_empty() {
            shape.iter().product()
        } else {
            d.iter().map(|&k| shape[k]).product()
        };
        if count >= 2 {
            return d;
        }
    }
    Dims::new()
}

#[test]
fn norm_logsumexp_var_std() {
    family("norm_lse_var", 48, |rng, i| {
        let (nd, mut shape) = any_shape(rng);
        if shape.iter().product::<usize>() < 2 {
            shape[0] = 3;
        }
        let keepdim = rng.chance(0.5);
        match i % 4 {
            0 => {
                let (p, d) = rng.pick(&[
                    (2.0, Domain::Normal),
                    (1.0, Domain::Normal),
                    (3.0, Domain::Normal),
                    (f64::INFINITY, Domain::Normal),
                    (0.5, Domain::Positive),
                ]);
                let dims = reduce_dims(rng, nd);
                Spec::new(
                    Op::Norm {
                        p: p.into(),
                        dims,
                        keepdim,
                    },
                    vec![fin(rng, &shape, d)],
                )
            }
            1 => Spec::new(
                Op::LogSumExp {
                    dims: reduce_dims(rng, nd),
                    keepdim,
                },
                vec![normal(rng, &shape)],
            ),
            k => {
                let dims = dims_with_count(rng, &shape);
                let correction = rng.below(2);
                let op = if k == 2 {
                    Op::Var {
                        dims,
                        keepdim,
                        correction,
                    }
                } else {
                    Op::Std {
                        dims,
                        keepdim,
                        correction,
                    }
                };
                // std's backward divides by the (small) standard deviation of a few values.
                Spec::new(op, vec![normal(rng, &shape)]).with_tol(1e-4)
            }
        }
    });
}

#[test]
fn prod_and_argmin() {
    family("prod_argmin", 28, |rng, i| {
        let nd = rng.range(1, 3);
        let shape: Vec<usize> = (0..nd).map(|_| rng.range(1, 5)).collect();
        let keepdim = rng.chance(0.5);
        if i % 2 == 0 {
            // Values around 1 (and now and then a zero) keep products of up to 64 values tame.
            let d = if rng.chance(0.7) {
                Domain::Positive
            } else {
                Domain::Quantized
            };
            Spec::new(
                Op::Prod {
                    dims: reduce_dims(rng, nd),
                    keepdim,
                },
                vec![fin(rng, &shape, d)],
            )
        } else {
            let x = exact(rng, &shape, Domain::Normal);
            Spec::new(
                Op::ArgMin {
                    dim: rng.below(nd),
                    keepdim,
                },
                vec![x],
            )
            .forward_only()
        }
    });
}

#[test]
fn split_and_unbind() {
    family("split_unbind", 24, |rng, i| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        if i % 2 == 0 {
            let n = shape[dim];
            let mut sizes = Vec::new();
            let mut left = n;
            while left > 0 {
                let s = rng.range(1, left);
                sizes.push(s);
                left -= s;
            }
            if sizes.is_empty() {
                sizes.push(0);
            }
            Spec::new(
                Op::Split {
                    dim,
                    sizes: Shape::from_vec(sizes),
                },
                vec![normal(rng, &shape)],
            )
        } else {
            Spec::new(Op::Unbind { dim }, vec![normal(rng, &shape)])
        }
    });
}

#[test]
fn topk() {
    family("topk", 24, |rng, _| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        let k = rng.range(0, shape[dim]);
        Spec::new(
            Op::TopK {
                k,
                dim,
                largest: rng.chance(0.6),
            },
            vec![normal(rng, &shape)],
        )
    });
}

#[test]
fn scatter_add_and_index_put() {
    family("scatter_index_put", 36, |rng, i| {
        let (nd, shape) = any_shape(rng);
        let dim = rng.below(nd);
        let mut upd = shape.clone();
        upd[dim] = rng.range(1, 6);
        let ids = any_ids(rng, 0.5, shape[dim]);
        let x = normal(rng, &shape);
        match i % 3 {
            0 => Spec::new(
                Op::ScatterAdd { dim },
                vec![x, iin(rng, &upd, ids), normal(rng, &upd)],
            ),
            k => Spec::new(
                Op::IndexPut {
                    dim,
                    accumulate: k == 1,
                },
                vec![x, iin(rng, &[upd[dim]], ids), normal(rng, &upd)],
            ),
        }
    });
}

#[test]
fn baddbmm_cumsum_pad() {
    family("baddbmm_cumsum_pad", 36, |rng, i| match i % 3 {
        0 => {
            let (b, n, k, m) = (rng.dim(), rng.dim(), rng.dim(), rng.dim());
            let bias = broadcastable(rng, &[b, n, m]);
            Spec::new(
                Op::Baddbmm {
                    alpha: rng.pick(&[1.0, 0.5]).into(),
                    beta: rng.pick(&[1.0, -2.0]).into(),
                },
                vec![
                    normal(rng, &bias),
                    normal(rng, &[b, n, k]),
                    normal(rng, &[b, k, m]),
                ],
            )
        }
        1 => {
            let (nd, shape) = any_shape(rng);
            Spec::new(Op::Cumsum { dim: rng.below(nd) }, vec![normal(rng, &shape)])
        }
        _ => {
            let (nd, shape) = any_shape(rng);
            Spec::new(
                Op::Pad {
                    dim: rng.below(nd),
                    before: rng.below(3),
                    after: rng.below(3),
                    value: rng.pick(&[0.0, 1.5]).into(),
                },
                vec![normal(rng, &shape)],
            )
        }
    });
}

/// Layouts the new ops keep for free: a fused QKV projection sharded head by head
/// (`SS(d, 3)`) splits into three `S(d)` pieces; token routing (scores sharded over tokens,
/// topk over experts) and its combine (`index_add` into token-sharded rows, each rank adding
/// the updates it owns) move nothing; a baddbmm over a sharded contraction is `P(sum)` with the
/// bias added once; a prod over a sharded dim is `P(product)`; norm, logsumexp and var over
/// a sharded dim reduce inside the op.
#[test]
fn new_ops_keep_their_layouts() {
    let sh = |v: &[usize]| -> Shape { v.iter().copied().collect() };
    let all = |v: &[usize]| -> Dims { v.iter().copied().collect() };
    check_layouts(
        "new_op_layouts",
        vec![
            lay(
                Op::Split {
                    dim: 2,
                    sizes: sh(&[5, 5, 5]),
                },
                &[2, 2],
                "[2, 3, 15] S(0),SS(2,3)",
                "S(0),S(2);S(0),S(2);S(0),S(2)",
            ),
            lay(
                Op::TopK {
                    k: 2,
                    dim: 1,
                    largest: true,
                },
                &[4],
                "[13, 6] S(0)",
                "S(0);S(0)",
            ),
            lay(
                Op::IndexPut {
                    dim: 0,
                    accumulate: true,
                },
                &[3],
                "[11, 4] S(0); [7] ids64:11 R; [7, 4] R",
                "S(0)",
            ),
            lay(
                Op::ScatterAdd { dim: 0 },
                &[3, 2],
                "[9, 4] R,S(1); [6, 4] ids:9 S(0),S(1); [6, 4] S(0),S(1)",
                "P(sum),S(1)",
            ),
            lay(
                Op::Baddbmm {
                    alpha: 0.5.into(),
                    beta: 1.0.into(),
                },
                &[3],
                "[1, 5] R; [2, 3, 7] S(2); [2, 7, 5] S(1)",
                "P(sum)",
            ),
            lay(
                Op::Prod {
                    dims: all(&[0]),
                    keepdim: false,
                },
                &[3],
                "[7, 3] pos S(0)",
                "P(product)",
            ),
            // Out S(0),R: a free local chunk of the rows on the first mesh dim shrinks the
            // all_reduces.
            lay(
                Op::LogSumExp {
                    dims: all(&[1]),
                    keepdim: false,
                },
                &[2, 4],
                "[4096, 1027] R,S(1)",
                "S(0),R",
            )
            .comms(&["all_reduce", "all_reduce"]),
            lay(
                Op::Var {
                    dims: all(&[0]),
                    keepdim: true,
                    correction: 1,
                },
                &[4],
                "[8191, 600] S(0)",
                "R",
            )
            .comms(&["all_reduce", "all_reduce"]),
        ],
    );
}
