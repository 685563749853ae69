//! Shared helpers of the DTensor integration tests: a seeded PRNG, meshes, placements, local
//! pieces (with asymmetric Partial splits), tolerant comparisons and the op-case runner.
#![allow(dead_code)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dtensor_comm::{Comm, LocalWorld};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_core::{
    apply_all, distribute_tensor, reference_apply_all, DTensor, MeshCtx, Placement, ReduceOp,
};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_strategies::layout::{local_indices, local_shape};
use candle_dtensor_strategies::{
    format_placements, global_propagator, partials_replicated, DTensorSpec, MeshTopology, Op,
    OpSharding, RedistributePlan,
};

/// Boxed error of a rank closure.
pub type BoxErr = Box<dyn std::error::Error + Send + Sync>;
/// Result of a rank closure.
pub type R<T> = Result<T, BoxErr>;

/// f32 tolerance: `|a - b| <= TOL * (1 + |b|)`.
pub const TOL: f64 = 1e-5;

/// Every mesh the sweeps run on: 1-D n = 1..8, 2-D 2x2 and 2x3, 3-D 2x2x2.
pub const MESHES: &[&[usize]] = &[
    &[1],
    &[2],
    &[3],
    &[4],
    &[5],
    &[6],
    &[7],
    &[8],
    &[2, 2],
    &[2, 3],
    &[2, 2, 2],
];

/// `CDT_FULL_SWEEP=1` runs many more random cases.
pub fn full_sweep() -> bool {
    std::env::var("CDT_FULL_SWEEP").is_ok_and(|v| v == "1")
}

/// How many times the default number of random cases to run: 1, 8 with `CDT_FULL_SWEEP=1`, or
/// `CDT_SWEEP_SCALE=<n>` (a bigger hunt; new seeds for every extra case).
pub fn sweep_scale() -> usize {
    if let Some(n) = std::env::var("CDT_SWEEP_SCALE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        return n.max(1);
    }
    if full_sweep() {
        8
    } else {
        1
    }
}

/// splitmix64: tiny, seedable, good enough for test data.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    /// A generator seeded from a string and a number (stable across runs).
    pub fn for_name(name: &str, k: u64) -> Rng {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        Rng::new(h ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-12);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// One element of `xs`.
    pub fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())].clone()
    }

    /// A random permutation of `0..n`.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
        v
    }

    /// A dim size: mostly small and uneven, sometimes 1.
    pub fn dim(&mut self) -> usize {
        self.pick(&[1, 2, 3, 4, 5, 6, 7, 9, 10, 13])
    }

    /// A random shape with `nd` dims.
    pub fn shape(&mut self, nd: usize) -> Vec<usize> {
        (0..nd).map(|_| self.dim()).collect()
    }
}

/// What values an input holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// Standard normal.
    Normal,
    /// In `[0.5, 2)` (log, sqrt, recip, fractional pow, denominators).
    Positive,
    /// Small integers as floats (comparisons with ties).
    Quantized,
    /// Integer ids in `0..hi` (u32).
    Ids(usize),
    /// Integer ids in `0..hi` (i64).
    IdsI64(usize),
    /// A 0/1 mask (u8).
    Mask,
}

impl Domain {
    /// Whether the input is a float (differentiable) tensor.
    pub fn is_float(self) -> bool {
        matches!(self, Domain::Normal | Domain::Positive | Domain::Quantized)
    }
}

/// A random tensor of `shape` in `domain`.
pub fn tensor(rng: &mut Rng, shape: &[usize], domain: Domain) -> Tensor {
    let n: usize = shape.iter().product();
    let dev = &Device::Cpu;
    match domain {
        Domain::Normal => {
            // On a 2^-12 grid: sums of a few such values (the Partial splits) are exact in f32.
            let v: Vec<f32> = (0..n)
                .map(|_| ((rng.normal() * 4096.0).round() / 4096.0) as f32)
                .collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        }
        Domain::Positive => {
            let v: Vec<f32> = (0..n).map(|_| (0.5 + 1.5 * rng.uniform()) as f32).collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        }
        Domain::Quantized => {
            let v: Vec<f32> = (0..n)
                .map(|_| (rng.normal() * 1.5).round() as f32)
                .collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        }
        Domain::Ids(hi) => {
            let v: Vec<u32> = (0..n).map(|_| rng.below(hi) as u32).collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        }
        Domain::IdsI64(hi) => {
            let v: Vec<i64> = (0..n).map(|_| rng.below(hi) as i64).collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        }
        Domain::Mask => {
            let v: Vec<u8> = (0..n).map(|_| u8::from(rng.chance(0.5))).collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        }
    }
}

/// Row-major coordinate of flat rank `r` on `mesh`.
pub fn coord_of(mut r: usize, mesh: &[usize]) -> Vec<usize> {
    let mut c = vec![0; mesh.len()];
    for d in (0..mesh.len()).rev() {
        c[d] = r % mesh[d];
        r /= mesh[d];
    }
    c
}

/// Mesh dim names `a`, `b`, `c`, ...
pub fn mesh_dims(shape: &[usize]) -> Vec<(&'static str, usize)> {
    const NAMES: [&str; 4] = ["a", "b", "c", "d"];
    shape
        .iter()
        .enumerate()
        .map(|(i, &n)| (NAMES[i], n))
        .collect()
}

/// A world of `n` ranks with a 20 s op timeout.
pub fn world(n: usize) -> LocalWorld {
    LocalWorld::new(n)
        .with_timeout(Duration::from_secs(20))
        .with_bootstrap_timeout(Duration::from_secs(20))
}

/// Starts `shape.iter().product()` ranks, builds the mesh on each and runs `f(mesh)`.
pub fn on_mesh<T: Send>(
    shape: &[usize],
    f: impl Fn(DeviceMesh) -> R<T> + Send + Sync,
) -> Result<Vec<T>, String> {
    let n: usize = shape.iter().product();
    let dims = mesh_dims(shape);
    world(n)
        .launch(|comm: Comm| -> R<T> {
            let mesh = DeviceMesh::new(comm, &dims)?;
            f(mesh)
        })
        .map_err(|e| e.to_string())
}

/// All-Replicate placements for a mesh of `ndim` dims.
pub fn all_r(ndim: usize) -> Vec<Placement> {
    vec![Placement::Replicate; ndim]
}

/// Compares shapes and values (`|a - b| <= tol * (1 + |b|)`; NaN only matches NaN).
pub fn close(a: &Tensor, b: &Tensor, tol: f64) -> Result<(), String> {
    if a.dims() != b.dims() {
        return Err(format!("shape {:?} vs expected {:?}", a.dims(), b.dims()));
    }
    let av: Vec<f64> = a
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .map_err(|e| e.to_string())?;
    let bv: Vec<f64> = b
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .map_err(|e| e.to_string())?;
    let mut worst: Option<(usize, f64, f64)> = None;
    let mut bad = 0usize;
    for (i, (&x, &y)) in av.iter().zip(&bv).enumerate() {
        let ok = if x.is_nan() || y.is_nan() {
            x.is_nan() && y.is_nan()
        } else if x.is_infinite() || y.is_infinite() {
            x == y
        } else {
            (x - y).abs() <= tol * (1.0 + y.abs())
        };
        if !ok {
            bad += 1;
            if worst.is_none() {
                worst = Some((i, x, y));
            }
        }
    }
    match worst {
        None => Ok(()),
        Some((i, x, y)) => Err(format!(
            "{bad} of {} elements differ; first at flat index {i}: got {x}, expected {y}",
            av.len()
        )),
    }
}

/// This coordinate's piece of the full-shape tensor `t` under the Shard placements (Partial and
/// Replicate dims keep everything).
pub fn shard_piece(
    t: &Tensor,
    placements: &[Placement],
    mesh: &[usize],
    coord: &[usize],
) -> Tensor {
    let global = t.dims().to_vec();
    let mut x = t.clone();
    for (d, &len) in global.iter().enumerate() {
        if !placements.iter().any(|p| p.shards(d)) {
            continue;
        }
        let idx = local_indices(len, mesh, coord, placements, d);
        let contiguous = idx.windows(2).all(|w| w[1] == w[0] + 1);
        x = if contiguous {
            let start = idx.first().copied().unwrap_or(0);
            x.narrow(d, start, idx.len()).unwrap()
        } else {
            let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
            x.contiguous().unwrap().index_select(&ids, d).unwrap()
        };
    }
    x.contiguous().unwrap()
}

/// Splits `v` into `n` pieces whose `op`-reduction is `v`, asymmetrically (so a wrong reduction
/// or a wrong adjoint cannot pass by coincidence). Returns the pieces and, per piece, the
/// derivative of the reduction with respect to that piece (1 for sum, 1/n for avg, the owner
/// mask for max/min).
fn split_partial(
    rng: &mut Rng,
    v: &Tensor,
    n: usize,
    op: ReduceOp,
    positive: bool,
) -> (Vec<Tensor>, Vec<Tensor>) {
    let shape = v.dims().to_vec();
    let ones = Tensor::ones(shape.as_slice(), DType::F32, &Device::Cpu).unwrap();
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            // Noise of a quarter of the values' scale: clearly asymmetric, without making the
            // per-rank partial products much larger than the result (cancellation).
            let mut pieces: Vec<Tensor> = (0..n.saturating_sub(1))
                .map(|_| {
                    tensor(rng, &shape, Domain::Normal)
                        .affine(0.25, 0.0)
                        .unwrap()
                })
                .collect();
            let scale = if op == ReduceOp::Sum { 1.0 } else { n as f64 };
            let mut last = v.affine(scale, 0.0).unwrap();
            for p in &pieces {
                last = last.sub(p).unwrap();
            }
            pieces.push(last);
            let factor = if op == ReduceOp::Sum {
                ones
            } else {
                ones.affine(1.0 / n as f64, 0.0).unwrap()
            };
            (pieces, vec![factor; n])
        }
        ReduceOp::Max | ReduceOp::Min => {
            let numel: usize = shape.iter().product();
            let owner: Vec<usize> = (0..numel).map(|_| rng.below(n)).collect();
            let vals: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
            let mut pieces = Vec::with_capacity(n);
            let mut factors = Vec::with_capacity(n);
            for r in 0..n {
                let mut p = Vec::with_capacity(numel);
                let mut f = Vec::with_capacity(numel);
                for (i, &x) in vals.iter().enumerate() {
                    if owner[i] == r {
                        p.push(x);
                        f.push(1f32);
                    } else {
                        let u = rng.uniform() as f32;
                        // Positive values stay positive (log/sqrt keep P(max)/P(min)).
                        let y = match (op, positive && x > 0.0) {
                            (ReduceOp::Max, true) => x * (0.3 + 0.6 * u),
                            (ReduceOp::Max, false) => x - (0.1 + u),
                            (_, true) => x * (1.1 + u),
                            (_, false) => x + (0.1 + u),
                        };
                        p.push(y);
                        f.push(0f32);
                    }
                }
                pieces.push(Tensor::from_vec(p, shape.as_slice(), &Device::Cpu).unwrap());
                factors.push(Tensor::from_vec(f, shape.as_slice(), &Device::Cpu).unwrap());
            }
            (pieces, factors)
        }
        ReduceOp::Product => panic!("tests do not build P(product) inputs"),
    }
}

/// Every rank's local piece of `full` under `placements` on `mesh` (Partial mesh dims split
/// asymmetrically, the innermost mesh dim reduced first), and per rank the full-shape factor by
/// which the value's gradient becomes that piece's gradient (before sharding).
pub fn make_pieces(
    rng: &mut Rng,
    full: &Tensor,
    placements: &[Placement],
    mesh: &[usize],
    positive: bool,
) -> (Vec<Tensor>, Vec<Tensor>) {
    let world: usize = mesh.iter().product();
    let ones = full.ones_like().unwrap().to_dtype(DType::F32).unwrap();
    // Keyed by the coordinates on the Partial mesh dims only: Shard and Replicate mesh dims see
    // the same value (and so the same split) at every coordinate.
    let mut level: Vec<(Vec<usize>, Tensor, Tensor)> = vec![(vec![], full.clone(), ones)];
    for (m, p) in placements.iter().enumerate() {
        let Placement::Partial(op) = p else { continue };
        let mut next = Vec::new();
        for (prefix, v, f) in level {
            let (pieces, factors) = split_partial(rng, &v, mesh[m], *op, positive);
            for (c, (pc, fc)) in pieces.into_iter().zip(factors).enumerate() {
                let mut pre = prefix.clone();
                pre.push(c);
                next.push((pre, pc, f.mul(&fc).unwrap()));
            }
        }
        level = next;
    }
    let mut pieces = Vec::with_capacity(world);
    let mut factors = Vec::with_capacity(world);
    for r in 0..world {
        let coord = coord_of(r, mesh);
        let key: Vec<usize> = placements
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Placement::Partial(_)))
            .map(|(m, _)| coord[m])
            .collect();
        let (_, v, f) = level
            .iter()
            .find(|(c, _, _)| *c == key)
            .expect("coordinate");
        pieces.push(shard_piece(v, placements, mesh, &coord));
        factors.push(f.clone());
    }
    (pieces, factors)
}

/// A random placement list for a tensor of `ndim` dims: Shard on random dims, Replicate, and
/// (when `partials` is not empty) Partial of one of `partials`.
pub fn random_placements(
    rng: &mut Rng,
    ndim: usize,
    mesh_ndim: usize,
    partials: &[ReduceOp],
) -> Vec<Placement> {
    (0..mesh_ndim)
        .map(|_| {
            let u = rng.uniform();
            if !partials.is_empty() && u < 0.22 {
                Placement::Partial(rng.pick(partials))
            } else if ndim > 0 && u > 0.92 {
                // FSDP-after-TP layouts.
                Placement::StridedShard {
                    dim: rng.below(ndim),
                    split_factor: rng.range(2, 3),
                }
            } else if ndim > 0 && u < 0.7 {
                Placement::Shard(rng.below(ndim))
            } else {
                Placement::Replicate
            }
        })
        .collect()
}

/// The reduce ops a float input may be split by.
pub const ALL_PARTIALS: &[ReduceOp] = &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
/// Exact partials only (comparisons, argmax, integer casts: no rounding in the reduction).
pub const EXACT_PARTIALS: &[ReduceOp] = &[ReduceOp::Max, ReduceOp::Min];

/// One input of an op case.
#[derive(Clone)]
pub struct Input {
    /// The full tensor.
    pub full: Tensor,
    /// Its placements.
    pub placements: Vec<Placement>,
    /// Whether the gradient is checked.
    pub grad: bool,
    /// Per rank: the local piece.
    pub pieces: Vec<Tensor>,
    /// Per rank: the full-shape gradient factor (Partial splits).
    pub factors: Vec<Tensor>,
}

/// What an op-case generator describes: the op and its inputs (full tensors, domains).
pub struct Spec {
    /// The op.
    pub op: Op,
    /// `(full tensor, domain, allowed partials)` per input.
    pub inputs: Vec<(Tensor, Domain, &'static [ReduceOp])>,
    /// Whether gradients are checked (float output and float inputs).
    pub grads: bool,
    /// Tolerance (f32 ops: [`TOL`]).
    pub tol: f64,
}

impl Spec {
    /// A spec with the default tolerance; gradients checked for float inputs.
    pub fn new(op: Op, inputs: Vec<(Tensor, Domain, &'static [ReduceOp])>) -> Spec {
        Spec {
            op,
            inputs,
            grads: true,
            tol: TOL,
        }
    }

    /// A looser tolerance (document why at the call).
    pub fn with_tol(mut self, tol: f64) -> Spec {
        self.tol = tol;
        self
    }

    /// Forward only.
    pub fn forward_only(mut self) -> Spec {
        self.grads = false;
        self
    }
}

/// A fully prepared case: per-rank pieces, the reference output and expected gradient pieces.
pub struct Case {
    /// What the case is (op, mesh, shapes, placements), for messages.
    pub desc: String,
    /// The op.
    pub op: Op,
    /// The inputs.
    pub inputs: Vec<Input>,
    /// The single-device outputs.
    pub ref_outs: Vec<Tensor>,
    /// Loss weights per output (its shape and dtype): `loss = sum_k sum(y_k * w_k)` over the
    /// float outputs.
    pub weights: Vec<Tensor>,
    /// Per input: the single-device gradient (when checked).
    pub ref_grads: Vec<Option<Tensor>>,
    /// Per input, per rank: the expected local gradient piece.
    pub grad_pieces: Vec<Option<Vec<Tensor>>>,
    /// Reduce the output with DTensor ops (`(y * w).sum_all()`, `DTensor::backward`) instead
    /// of `full_tensor()` + candle.
    pub dtensor_loss: bool,
    /// Tolerance.
    pub tol: f64,
}

/// Prepares `spec` for `mesh`: random placements, pieces, and the single-device reference.
pub fn prepare(rng: &mut Rng, spec: Spec, mesh: &[usize]) -> Case {
    let mut inputs = Vec::new();
    for (full, domain, partials) in &spec.inputs {
        let partials: &[ReduceOp] = if domain.is_float() { partials } else { &[] };
        let placements = random_placements(rng, full.rank(), mesh.len(), partials);
        let (pieces, factors) =
            make_pieces(rng, full, &placements, mesh, *domain == Domain::Positive);
        inputs.push(Input {
            full: full.clone(),
            placements,
            grad: spec.grads && domain.is_float(),
            pieces,
            factors,
        });
    }
    finish_case(rng, spec.op, inputs, spec.tol, mesh)
}

/// Builds a case from inputs whose placements are already chosen.
pub fn case_with_placements(
    rng: &mut Rng,
    op: Op,
    inputs: Vec<(Tensor, Domain, Vec<Placement>)>,
    grads: bool,
    mesh: &[usize],
) -> Case {
    let inputs = inputs
        .into_iter()
        .map(|(full, domain, placements)| {
            let (pieces, factors) =
                make_pieces(rng, &full, &placements, mesh, domain == Domain::Positive);
            Input {
                full,
                placements,
                grad: grads && domain.is_float(),
                pieces,
                factors,
            }
        })
        .collect();
    finish_case(rng, op, inputs, TOL, mesh)
}

fn finish_case(rng: &mut Rng, op: Op, inputs: Vec<Input>, tol: f64, mesh: &[usize]) -> Case {
    let vars: Vec<Option<Var>> = inputs
        .iter()
        .map(|i| i.grad.then(|| Var::from_tensor(&i.full).unwrap()))
        .collect();
    let ts: Vec<Tensor> = inputs
        .iter()
        .zip(&vars)
        .map(|(i, v)| match v {
            Some(v) => v.as_tensor().clone(),
            None => i.full.clone(),
        })
        .collect();
    let ins_desc: Vec<String> = inputs
        .iter()
        .map(|i| {
            format!(
                "{:?} {:?} [{}]",
                i.full.dims(),
                i.full.dtype(),
                format_placements(&i.placements)
            )
        })
        .collect();
    let desc = format!(
        "{op:?} on mesh {mesh:?} with inputs {}",
        ins_desc.join("; ")
    );
    let ref_outs =
        reference_apply_all(&op, &ts).unwrap_or_else(|e| panic!("reference of {desc}: {e}"));
    let weights: Vec<Tensor> = ref_outs
        .iter()
        .map(|o| {
            tensor(rng, o.dims(), Domain::Normal)
                .to_dtype(o.dtype())
                .unwrap()
        })
        .collect();
    let float_out = ref_outs.iter().any(|o| o.dtype().is_float());
    let any_grad = inputs.iter().any(|i| i.grad) && float_out;
    let mut ref_grads = vec![None; inputs.len()];
    let mut grad_pieces = vec![None; inputs.len()];
    if any_grad {
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (o, w) in ref_outs.iter().zip(&weights) {
            if o.dtype().is_float() {
                let l = o
                    .mul(w)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                loss = (loss + l).unwrap();
            }
        }
        let g = loss.backward().unwrap();
        for (k, (inp, v)) in inputs.iter().zip(&vars).enumerate() {
            let Some(v) = v else { continue };
            let full_g = match g.get(v.as_tensor()) {
                Some(t) => t.to_dtype(DType::F32).unwrap(),
                None => inp.full.zeros_like().unwrap(),
            };
            let world: usize = mesh.iter().product();
            let pieces = (0..world)
                .map(|r| {
                    let c = coord_of(r, mesh);
                    shard_piece(
                        &full_g.mul(&inp.factors[r]).unwrap(),
                        &inp.placements,
                        mesh,
                        &c,
                    )
                })
                .collect();
            ref_grads[k] = Some(full_g);
            grad_pieces[k] = Some(pieces);
        }
    }
    let dtensor_loss = rng.chance(0.5);
    Case {
        desc,
        op,
        inputs,
        ref_outs: ref_outs.iter().map(|o| o.detach()).collect(),
        weights,
        ref_grads,
        grad_pieces,
        dtensor_loss,
        tol,
    }
}

/// Runs one prepared case on this rank; numerical mismatches are pushed onto `fails`, runtime
/// errors are returned (they end the world).
pub fn run_case(mesh: &DeviceMesh, case: &Case, fails: &mut Vec<String>) -> R<()> {
    run_case_inner(mesh, case, fails).map_err(|e| format!("{}: {e}", case.desc).into())
}

fn run_case_inner(mesh: &DeviceMesh, case: &Case, fails: &mut Vec<String>) -> R<()> {
    let rank = mesh.rank();
    let mesh_shape = mesh.shape();
    let coord = coord_of(rank, &mesh_shape);
    let mut vars = Vec::new();
    let mut dts = Vec::new();
    for inp in &case.inputs {
        let piece = &inp.pieces[rank];
        let (t, v) = if inp.grad {
            let v = Var::from_tensor(piece)?;
            (v.as_tensor().clone(), Some(v))
        } else {
            (piece.clone(), None)
        };
        let d = DTensor::from_local_with_shape(&t, mesh, &inp.placements, inp.full.dims())
            .map_err(|e| format!("from_local: {e}"))?;
        vars.push(v);
        dts.push(d);
    }
    let refs: Vec<&DTensor> = dts.iter().collect();
    let specs: Vec<&DTensorSpec> = dts.iter().map(|d| d.spec()).collect();
    let ctx = MeshCtx::of(mesh)?;
    let topo = ctx.topology();
    let planned = global_propagator()
        .propagate(&case.op, &specs, topo)
        .map(|s| planned_collectives(&s, topo))
        .map_err(|e| format!("propagate: {e}"))?;
    let mode = CommDebugMode::start();
    let outs = apply_all(&case.op, &refs).map_err(|e| format!("apply: {e}"))?;
    let executed = executed_collectives(&mode);
    drop(mode);
    let fail = |fails: &mut Vec<String>, what: String| {
        fails.push(format!("rank {rank}: {}: {what}", case.desc));
    };
    if planned != executed {
        fail(
            fails,
            format!("planned collectives {planned:?} but executed {executed:?}"),
        );
    }
    if outs.len() != case.ref_outs.len() {
        fail(
            fails,
            format!("{} outputs vs {}", outs.len(), case.ref_outs.len()),
        );
        return Ok(());
    }
    let mut fulls = Vec::with_capacity(outs.len());
    for (o, (out, ref_out)) in outs.iter().zip(&case.ref_outs).enumerate() {
        if out.shape() != ref_out.dims() {
            fail(
                fails,
                format!(
                    "output {o}: global shape {:?} vs {:?}",
                    out.shape(),
                    ref_out.dims()
                ),
            );
            return Ok(());
        }
        let expect_local = local_shape(out.shape(), &mesh_shape, &coord, out.placements())
            .map_err(|e| format!("local_shape: {e}"))?;
        if out.to_local().dims() != expect_local.as_slice() {
            fail(
                fails,
                format!(
                    "output {o}: local piece {:?} but {} of {:?} needs {:?}",
                    out.to_local().dims(),
                    format_placements(out.placements()),
                    out.shape(),
                    expect_local.as_slice()
                ),
            );
        }
        let full = out.full_tensor().map_err(|e| format!("full_tensor: {e}"))?;
        let tol = if ref_out.dtype().is_float() {
            case.tol
        } else {
            0.0
        };
        if let Err(e) = close(&full, ref_out, tol) {
            fail(
                fails,
                format!(
                    "forward (output {o}, {}): {e}",
                    format_placements(out.placements())
                ),
            );
        }
        fulls.push(full);
    }
    let out_float = case.ref_outs.iter().any(|o| o.dtype().is_float());
    if !case.inputs.iter().any(|i| i.grad) || !out_float {
        return Ok(());
    }
    let grads = if case.dtensor_loss {
        let mut loss: Option<DTensor> = None;
        for (out, w) in outs.iter().zip(&case.weights) {
            if !w.dtype().is_float() {
                continue;
            }
            let w = distribute_tensor(w, mesh, &all_r(mesh.ndim()))?;
            let l = out
                .mul(&w)
                .and_then(|y| y.sum_all())
                .map_err(|e| format!("loss: {e}"))?;
            loss = Some(match loss {
                Some(a) => a.add(&l).map_err(|e| format!("loss: {e}"))?,
                None => l,
            });
        }
        let loss = loss.ok_or("no float output")?;
        loss.backward().map_err(|e| format!("backward: {e}"))?
    } else {
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for (full, w) in fulls.iter().zip(&case.weights) {
            if w.dtype().is_float() {
                loss = (loss + full.mul(w)?.sum_all()?.to_dtype(DType::F32)?)?;
            }
        }
        loss.backward()?
    };
    for (k, (inp, v)) in case.inputs.iter().zip(&vars).enumerate() {
        let Some(v) = v else { continue };
        let expect = &case.grad_pieces[k].as_ref().expect("expected grads")[rank];
        let got = match grads.get(v.as_tensor()) {
            Some(g) => g.clone(),
            None => v.as_tensor().zeros_like()?,
        };
        if let Err(e) = close(&got, expect, case.tol) {
            fail(
                fails,
                format!(
                    "grad of input {k} ([{}], local piece): {e}",
                    format_placements(&inp.placements)
                ),
            );
        }
        // The gradient read as a DTensor is the single-device gradient, whatever the input's
        // placements (Partial ones included), and its placements are truthful.
        let gd = match dts[k].grad(&grads).map_err(|e| format!("grad {k}: {e}"))? {
            Some(g) => g,
            None => DTensor::from_local_with_shape(
                &got,
                mesh,
                &partials_replicated(&inp.placements),
                inp.full.dims(),
            )?,
        };
        check_grad_layout(&gd, mesh, &mut |w| {
            fail(fails, format!("grad of input {k}: {w}"))
        });
        let assembled = gd
            .full_tensor()
            .map_err(|e| format!("assembling grad {k}: {e}"))?;
        let reference = case.ref_grads[k].as_ref().expect("reference grad");
        if let Err(e) = close(&assembled, reference, case.tol) {
            fail(
                fails,
                format!(
                    "grad of input {k} as a DTensor [{}]: {e}",
                    format_placements(gd.placements())
                ),
            );
        }
    }
    Ok(())
}

/// `(kind, mesh dim)` of every collective a propagation decision plans for the forward op: its
/// redistributions' communication steps and the op's internal comms, sorted.
pub fn planned_collectives(s: &OpSharding, topo: &MeshTopology) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = s
        .redistributions
        .iter()
        .flatten()
        .flat_map(|p| plan_collectives(p, topo))
        .collect();
    v.extend(
        s.internal
            .iter()
            .filter(|(_, c)| c.kind.is_communication())
            .map(|(m, c)| (c.kind.name().to_string(), topo.group_name(&[*m]))),
    );
    v.sort();
    v
}

/// `(kind, mesh dim)` of the communication steps of a redistribution plan.
pub fn plan_collectives(p: &RedistributePlan, topo: &MeshTopology) -> Vec<(String, String)> {
    p.communication_steps()
        .map(|st| (st.kind.name().to_string(), topo.group_name(&st.mesh_dims)))
        .collect()
}

/// `(kind, mesh dim)` of every forward collective `mode` recorded, sorted.
pub fn executed_collectives(mode: &CommDebugMode) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = mode
        .records()
        .iter()
        .filter(|r| r.phase == Phase::Forward)
        .map(|r| (r.kind.to_string(), r.mesh_dim.clone()))
        .collect();
    v.sort();
    v
}

/// Checks that `d`'s local piece has the shape its placements say at this rank's coordinate.
pub fn check_grad_layout(d: &DTensor, mesh: &DeviceMesh, fail: &mut dyn FnMut(String)) {
    let shape = mesh.shape();
    let coord = coord_of(mesh.rank(), &shape);
    match local_shape(d.shape(), &shape, &coord, d.placements()) {
        Ok(s) if s.as_slice() == d.to_local().dims() => {}
        Ok(s) => fail(format!(
            "local piece {:?} but [{}] of {:?} needs {:?}",
            d.to_local().dims(),
            format_placements(d.placements()),
            d.shape(),
            s.as_slice()
        )),
        Err(e) => fail(format!("placements do not fit: {e}")),
    }
}

/// Runs `cases` (all prepared for `mesh_shape`) in one world; returns every mismatch.
pub fn run_cases(mesh_shape: &[usize], cases: &[Case]) -> Vec<String> {
    let res = on_mesh(mesh_shape, |mesh| {
        let mut fails = Vec::new();
        let me = mesh.coordinate();
        let expect = coord_of(mesh.rank(), &mesh.shape());
        if me.as_slice() != expect.as_slice() {
            return Err(format!("mesh coordinate {me:?} is not row-major {expect:?}").into());
        }
        for c in cases {
            run_case(&mesh, c, &mut fails)?;
        }
        Ok(fails)
    });
    match res {
        Ok(per_rank) => per_rank.into_iter().flatten().collect(),
        Err(e) => vec![format!("world on mesh {mesh_shape:?} failed: {e}")],
    }
}

/// Asserts that `fails` is empty, listing the first few.
pub fn assert_no_failures(what: &str, fails: &[String]) {
    if !fails.is_empty() {
        let shown: Vec<&String> = fails.iter().take(12).collect();
        panic!(
            "{what}: {} failures; first ones:\n{}",
            fails.len(),
            shown
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Smooth deterministic f32 values of `shape` on the CPU (a sine of the index, phase `k`, plus a
/// slow ramp): distinct, of size ~1, the same on every rank.
pub fn data(shape: &[usize], k: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.7312 + k).sin() * 1.37) + 0.01 * i as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}
