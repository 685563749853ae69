//! Random ops with random (valid) input metas and placements.

use candle_dtensor_strategies::{
    BinaryOp, DTensorSpec, DType, MeshTopology, Op, Placement, Placements, ReduceOp, Scalar,
    ScalarOp, Shape, UnaryOp,
};

use super::Rng;

pub struct Case {
    pub op: Op,
    pub specs: Vec<DTensorSpec>,
    /// Integer inputs hold indices below this bound.
    pub index_bound: usize,
}

fn sz(rng: &mut Rng) -> usize {
    rng.range(1, 6)
}

fn shape(rng: &mut Rng, nd: usize) -> Vec<usize> {
    (0..nd).map(|_| sz(rng)).collect()
}

fn dims_subset(rng: &mut Rng, nd: usize) -> smallvec::SmallVec<[usize; 4]> {
    let mut v: smallvec::SmallVec<[usize; 4]> = (0..nd).filter(|_| rng.chance(0.5)).collect();
    if v.is_empty() {
        v.push(rng.below(nd));
    }
    v
}

fn placement(rng: &mut Rng, ndim: usize, partial: bool, strided: bool) -> Placement {
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    let x = rng.unit();
    if x < 0.35 || ndim == 0 {
        if partial && rng.chance(0.3) {
            Placement::Partial(*rng.pick(&ops))
        } else {
            Placement::Replicate
        }
    } else if x < 0.8 || !partial {
        if strided && rng.chance(0.1) {
            Placement::StridedShard {
                dim: rng.below(ndim),
                split_factor: 2,
            }
        } else {
            Placement::Shard(rng.below(ndim))
        }
    } else {
        Placement::Partial(*rng.pick(&ops))
    }
}

/// A random op with metas; placements are random per input (integer inputs never partial).
pub fn random_case(rng: &mut Rng, mesh: &MeshTopology, partial: bool) -> Case {
    let f = DType::F32;
    let mut index_bound = 0;
    let (op, metas): (Op, Vec<(Vec<usize>, DType)>) = match rng.below(15) {
        0 => {
            let (m, k, n) = (sz(rng), sz(rng), sz(rng));
            if rng.chance(0.3) {
                let b = sz(rng);
                (Op::Matmul, vec![(vec![b, m, k], f), (vec![b, k, n], f)])
            } else {
                (Op::Matmul, vec![(vec![m, k], f), (vec![k, n], f)])
            }
        }
        1 => {
            let (b, i, o) = (sz(rng), sz(rng), sz(rng));
            let bias = rng.chance(0.5);
            let mut v = vec![(vec![b, i], f), (vec![o, i], f)];
            if bias {
                v.push((vec![o], f));
            }
            (Op::Linear { bias }, v)
        }
        2 | 3 => {
            let a = {
                let nd = rng.range(1, 3);
                shape(rng, nd)
            };
            let mut b: Vec<usize> = a[rng.below(a.len())..].to_vec();
            for d in b.iter_mut() {
                if rng.chance(0.3) {
                    *d = 1;
                }
            }
            let (x, y) = if rng.chance(0.5) { (a, b) } else { (b, a) };
            let op = *rng.pick(&[
                BinaryOp::Add,
                BinaryOp::Sub,
                BinaryOp::Mul,
                BinaryOp::Maximum,
                BinaryOp::Div,
            ]);
            (Op::Binary(op), vec![(x, f), (y, f)])
        }
        4 => {
            let op = match rng.below(4) {
                0 => Op::Unary(*rng.pick(&[
                    UnaryOp::Neg,
                    UnaryOp::Exp,
                    UnaryOp::Relu,
                    UnaryOp::Tanh,
                ])),
                1 => Op::Affine {
                    mul: Scalar::new(*rng.pick(&[-2.0, 0.5])),
                    add: Scalar::new(*rng.pick(&[0.0, 1.5])),
                },
                2 => Op::ScalarOp(
                    *rng.pick(&[ScalarOp::Add, ScalarOp::Mul, ScalarOp::Maximum]),
                    Scalar::new(-0.5),
                ),
                _ => Op::Unary(UnaryOp::Sqr),
            };
            (
                op,
                vec![(
                    {
                        let nd = rng.range(1, 3);
                        shape(rng, nd)
                    },
                    f,
                )],
            )
        }
        5 | 6 => {
            let nd = rng.range(1, 3);
            let dims = dims_subset(rng, nd);
            let keepdim = rng.chance(0.5);
            let op = match rng.below(4) {
                0 => Op::Sum { dims, keepdim },
                1 => Op::Mean { dims, keepdim },
                2 => Op::Max { dims, keepdim },
                _ => Op::Min { dims, keepdim },
            };
            (op, vec![(shape(rng, nd), f)])
        }
        7 => {
            let nd = rng.range(1, 3);
            (
                Op::Softmax { dim: rng.below(nd) },
                vec![(shape(rng, nd), f)],
            )
        }
        8 => {
            let choices: &[(&[usize], &[usize])] = &[
                (&[4, 6], &[24]),
                (&[4, 6], &[2, 12]),
                (&[4, 6], &[8, 3]),
                (&[12, 8], &[16, 6]),
                (&[24], &[4, 6]),
                (&[2, 3, 4], &[6, 4]),
                (&[2, 3, 4], &[2, 12]),
                (&[6, 1, 4], &[6, 4]),
                (&[5, 3], &[15]),
                (&[3, 5], &[5, 3]),
            ];
            let (a, b) = *rng.pick(choices);
            (
                Op::Reshape {
                    shape: Shape::from_slice(b),
                },
                vec![(a.to_vec(), f)],
            )
        }
        9 => {
            let nd = rng.range(2, 3);
            let (a, b) = (rng.below(nd), rng.below(nd));
            (
                Op::Transpose { dim0: a, dim1: b },
                vec![(shape(rng, nd), f)],
            )
        }
        10 => {
            let s = {
                let nd = rng.range(1, 3);
                shape(rng, nd)
            };
            let dim = rng.below(s.len());
            let start = rng.below(s[dim]);
            let len = rng.range(0, s[dim] - start);
            (Op::Narrow { dim, start, len }, vec![(s, f)])
        }
        11 => {
            let a = {
                let nd = rng.range(1, 3);
                shape(rng, nd)
            };
            let dim = rng.below(a.len());
            let mut b = a.clone();
            b[dim] = sz(rng);
            (Op::Cat { dim }, vec![(a, f), (b, f)])
        }
        12 => {
            let v = rng.range(2, 9);
            index_bound = v;
            let ids = if rng.chance(0.5) {
                vec![sz(rng)]
            } else {
                vec![sz(rng), sz(rng)]
            };
            (
                Op::Embedding,
                vec![(ids, DType::U32), (vec![v, sz(rng)], f)],
            )
        }
        13 => {
            let src = shape(rng, 2);
            let dim = rng.below(2);
            index_bound = src[dim];
            let k = rng.range(1, 7);
            (
                Op::IndexSelect { dim },
                vec![(src, f), (vec![k], DType::U32)],
            )
        }
        _ => {
            let s = {
                let nd = rng.range(1, 3);
                shape(rng, nd)
            };
            (
                Op::Unsqueeze {
                    dim: rng.below(s.len() + 1),
                },
                vec![(s, f)],
            )
        }
    };
    let specs = metas
        .into_iter()
        .map(|(shape, dtype)| {
            let pl: Placements = (0..mesh.ndim())
                .map(|_| {
                    placement(
                        rng,
                        shape.len(),
                        partial && dtype.is_float(),
                        dtype.is_float(),
                    )
                })
                .collect();
            DTensorSpec::new(&shape, dtype, &pl)
        })
        .collect();
    Case {
        op,
        specs,
        index_bound,
    }
}
