//! Tensor parallelism for candle-nn code: a two-layer MLP and an attention block written once
//! over `candle_core::Module`, built with candle-nn's layers on one device and with the
//! tensor-parallel layers (and FSDP over `dp` on a 2-D mesh) on 1-6 ranks, trained with AdamW
//! and compared step by step: losses, gradients and every rank's parameter pieces.
use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_dtensor_comm::{LocalWorld, ReduceOp};
use candle_dtensor_core::debug::{CommDebugMode, Phase};
use candle_dtensor_kernels::compare::{compare_series_f32, max_abs_diff};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::fsdp_vb::{reference_var_builder, FsdpVarMap};
use candle_dtensor_parallel::tp_nn::{
    column_parallel_linear, row_parallel_linear, vocab_parallel_embedding, ColumnParallelLinear,
    Group, RowParallelLinear, TpLinearConfig,
};
use candle_dtensor_parallel::ParallelError;
use candle_dtensor_strategies::layout::shard_size_and_offset;
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEED: u64 = 5;
const IN: usize = 6;
/// Uneven over 3 (4, 4, 2) and 4 (3, 3, 3, 1) ranks.
const HID: usize = 10;
const OUT: usize = 4;
const BATCH: usize = 8;
const STEPS: usize = 5;

fn adamw() -> ParamsAdamW {
    ParamsAdamW {
        lr: 1e-2,
        ..ParamsAdamW::default()
    }
}

fn values(dims: &[usize], salt: usize) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7 + salt * 13 + 3) % 23) as f32 - 11.0) / 9.0)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// The batch of `step`.
fn batch(step: usize) -> (Tensor, Tensor) {
    (values(&[BATCH, IN], step), values(&[BATCH, OUT], 50 + step))
}

/// The global parameters of a one-device run, by name.
type Params = HashMap<String, Tensor>;

fn snapshot(map: &candle_nn::VarMap) -> Params {
    map.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// The ranges of a whole 1-D parameter.
fn whole(n: usize) -> Vec<Range<usize>> {
    std::iter::once(0..n).collect()
}

/// The elements of `t` at `ranges` (one per dim).
fn slice(t: &Tensor, ranges: &[Range<usize>]) -> Tensor {
    let mut t = t.clone();
    for (d, r) in ranges.iter().enumerate() {
        t = t.narrow(d, r.start, r.len()).unwrap();
    }
    t
}

/// `max |a - b| / max |b|`: the error relative to the tensor's magnitude (elementwise relative
/// errors of near-zero elements only measure f32 summation order, which differs when partial
/// sums are reduced across ranks), with a floor of 1e-3 for tensors that are zero up to
/// rounding (the gradient of a key bias, to which softmax is invariant). NaN when either has a
/// NaN or infinite element (the kernels' `max_abs_diff`; a fold with `f32::max` dropped NaN).
fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let diff = max_abs_diff(a, b).unwrap();
    // max |b|: its distance from zero.
    let scale = max_abs_diff(b, &b.zeros_like().unwrap()).unwrap();
    if diff.is_nan() || scale.is_nan() {
        return f64::NAN;
    }
    diff / scale.max(1e-3)
}

/// Every step's loss within 1e-5 of one device's, relative; the same number of steps, all
/// finite.
fn assert_losses(what: &str, got: &[f32], want: &[f32]) {
    if let Err(e) = compare_series_f32(what, got, want).and_then(|d| d.within(1e-5)) {
        panic!("{e} ({got:?} vs one device {want:?})");
    }
}

/// One rank's parameter pieces: name, value, and the global ranges they hold.
type Pieces = Vec<(String, Tensor, Vec<Range<usize>>)>;

/// Named local values as pieces, each with the global ranges `range_of` gives its name.
fn pieces_at(
    named: impl IntoIterator<Item = (String, Tensor)>,
    range_of: impl Fn(&str) -> Vec<Range<usize>>,
) -> Pieces {
    named
        .into_iter()
        .map(|(n, t)| {
            let r = range_of(&n);
            (n, t, r)
        })
        .collect()
}

fn assert_pieces(what: &str, pieces: &Pieces, want: &Params) {
    for (name, got, ranges) in pieces {
        let w = slice(&want[name], ranges);
        let rel = max_rel(got, &w);
        assert!(
            rel <= 1e-5,
            "{what}: {name} {ranges:?}: max relative diff {rel:e}"
        );
    }
}

/// Runs `f` on every rank of a `world`-rank tensor-parallel group, with a fresh map and
/// builder of the one-device initialisation (seed `SEED`) to build the rank's layers from.
fn on_tp<T: Send>(
    world: usize,
    f: impl Fn(Group, candle_nn::VarMap, VarBuilder<'static>) -> R<T> + Send + Sync,
) -> Vec<T> {
    LocalWorld::new(world)
        .with_timeout(Duration::from_secs(30))
        .launch(|comm| {
            let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
            f(Group::new(&comm), map, vb)
        })
        .unwrap()
}

// ---------------------------------------------------------------- the two-layer MLP

/// The MLP, written once: `fc2(gelu(fc1(x)))`.
struct Mlp {
    fc1: Box<dyn Module>,
    fc2: Box<dyn Module>,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.gelu()?)
    }
}

/// Trains the parameters of `map` with AdamW for `steps` steps of `loss_at(step)` on one
/// device: the losses, the first step's gradients and the final parameters.
fn train_one_device(
    map: &candle_nn::VarMap,
    steps: usize,
    loss_at: impl Fn(usize) -> candle_core::Result<Tensor>,
) -> (Vec<f32>, Params, Params) {
    let mut opt = candle_nn::AdamW::new(map.all_vars(), adamw()).unwrap();
    let mut losses = Vec::new();
    let mut first = Params::new();
    for step in 0..steps {
        let loss = loss_at(step).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        let grads = loss.backward().unwrap();
        if step == 0 {
            first = gradients(map, &grads);
        }
        opt.step(&grads).unwrap();
    }
    (losses, first, snapshot(map))
}

/// Losses, the first step's gradients and the final parameters on one device.
fn one_device_mlp() -> (Vec<f32>, Params, Params) {
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let mlp = Mlp {
        fc1: Box::new(candle_nn::linear(IN, HID, vb.pp("fc1")).unwrap()),
        fc2: Box::new(candle_nn::linear(HID, OUT, vb.pp("fc2")).unwrap()),
    };
    train_one_device(&map, STEPS, |step| {
        let (x, y) = batch(step);
        candle_nn::loss::mse(&mlp.forward(&x)?, &y)
    })
}

fn gradients(map: &candle_nn::VarMap, grads: &candle_core::backprop::GradStore) -> Params {
    map.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).unwrap().clone()))
        .collect()
}

/// The tensor-parallel MLP's layers and the global ranges of their pieces.
type MlpLayers = (
    ColumnParallelLinear,
    RowParallelLinear,
    HashMap<String, Vec<Range<usize>>>,
);

fn tp_mlp(tp: &Group, vb: VarBuilder) -> R<MlpLayers> {
    let fc1 = column_parallel_linear(IN, HID, tp, vb.pp("fc1"))?;
    let fc2 = row_parallel_linear(HID, OUT, tp, vb.pp("fc2"))?;
    let (r1, r2) = (fc1.out_range(), fc2.in_range());
    let ranges = HashMap::from([
        ("fc1.weight".to_string(), vec![r1.clone(), 0..IN]),
        ("fc1.bias".to_string(), vec![r1]),
        ("fc2.weight".to_string(), vec![0..OUT, r2]),
        ("fc2.bias".to_string(), whole(OUT)),
    ]);
    Ok((fc1, fc2, ranges))
}

#[test]
fn tp_mlp_5_adamw_steps_match_one_device() {
    let (want_losses, _, want_params) = one_device_mlp();
    for world in [1usize, 2, 3, 4] {
        let out = on_tp(world, |tp, map, vb| {
            let (fc1, fc2, ranges) = tp_mlp(&tp, vb)?;
            let mlp = Mlp {
                fc1: Box::new(fc1),
                fc2: Box::new(fc2),
            };
            let mut opt = candle_nn::AdamW::new(map.all_vars(), adamw())?;
            let mut losses = Vec::new();
            let mut counts = Vec::new();
            for step in 0..STEPS {
                let (x, y) = batch(step);
                let mode = CommDebugMode::start();
                let loss = candle_nn::loss::mse(&mlp.forward(&x)?, &y)?;
                losses.push(loss.to_scalar::<f32>()?);
                opt.backward_step(&loss)?;
                counts.push((
                    mode.count("all_reduce", Phase::Forward),
                    mode.count("all_reduce", Phase::Backward),
                    mode.records().len(),
                ));
            }
            let pieces = pieces_at(snapshot(&map), |n| ranges[n].clone());
            Ok((losses, pieces, counts))
        });
        for (rank, (losses, pieces, counts)) in out.iter().enumerate() {
            let what = format!("world {world} rank {rank}");
            assert_losses(&what, losses, &want_losses);
            assert_pieces(&what, pieces, &want_params);
            assert_eq!(pieces.len(), 4, "{what}");
            // Megatron's MLP on an input without gradient: one all_reduce forward (fc2's g),
            // none backward (fc1's f has no input gradient to reduce), nothing else.
            for c in counts {
                assert_eq!(
                    *c,
                    (1, 0, 1),
                    "{what}: (forward, backward all_reduces, total)"
                );
            }
        }
    }
}

#[test]
fn fsdp_over_dp_x_tp_mlp_matches_one_device() {
    let (want_losses, want_grads, want_params) = one_device_mlp();
    for (dp, tpn) in [(2usize, 2usize), (2, 3)] {
        let world = dp * tpn;
        let out = LocalWorld::new(world)
            .with_timeout(Duration::from_secs(30))
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &[("dp", dp), ("tp", tpn)])?;
                let tp = Group::from_mesh(&mesh, "tp")?;
                let dpc = mesh.coordinate()[0];
                // Each dp rank's loss is the mean over its half of the batch.
                let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
                let map = FsdpVarMap::new(&fsdp, SEED);
                let (fc1, fc2, ranges) = tp_mlp(&tp, map.var_builder(DType::F32))?;
                // One FSDP unit per layer (its top-level name), each wrapped.
                let mlp = Mlp {
                    fc1: Box::new(map.wrap("fc1", fc1)?),
                    fc2: Box::new(map.wrap("fc2", fc2)?),
                };
                let mut opt = fsdp.optimizer(candle_nn::AdamW::new(map.all_vars(), adamw())?);
                let (rows, off) = shard_size_and_offset(BATCH, dp, dpc);
                let mut losses = Vec::new();
                let mut grads0 = Vec::new();
                for step in 0..STEPS {
                    let (x, y) = batch(step);
                    let (x, y) = (x.narrow(0, off, rows)?, y.narrow(0, off, rows)?);
                    let loss = candle_nn::loss::mse(&mlp.forward(&x)?, &y)?;
                    let global = mesh
                        .comm(0)?
                        .all_reduce(&loss.reshape(1)?, ReduceOp::Avg)?
                        .wait()?;
                    losses.push(global.to_vec1::<f32>()?[0]);
                    let grads = fsdp.backward(&loss)?;
                    if step == 0 {
                        for (n, v) in map.named_vars() {
                            let g = grads.get(v.as_tensor()).cloned();
                            grads0.push((n.clone(), g.ok_or_else(|| format!("{n}: no grad"))?));
                        }
                    }
                    opt.step(&grads)?;
                }
                // Each shard: FSDP's torch.chunk rows (over dp) of the TP piece.
                let shard_ranges = |n: &str| {
                    let mut r = ranges[n].clone();
                    let (s, o) = shard_size_and_offset(r[0].len(), dp, dpc);
                    r[0] = r[0].start + o..r[0].start + o + s;
                    r
                };
                let values = map.named_vars().into_iter();
                let pieces = pieces_at(
                    values.map(|(n, v)| (n, v.as_tensor().clone())),
                    shard_ranges,
                );
                let grads0 = pieces_at(grads0, shard_ranges);
                Ok((losses, grads0, pieces, fsdp.params_without_grad()))
            })
            .unwrap();
        for (rank, (losses, grads0, pieces, without)) in out.iter().enumerate() {
            let what = format!("dp={dp} x tp={tpn} rank {rank}");
            assert_losses(&what, losses, &want_losses);
            // Gradients directly (AdamW's normalisation would hide a wrong scale).
            assert_pieces(&format!("{what} step-0 gradient"), grads0, &want_grads);
            assert_eq!(grads0.len(), 4, "{what}");
            assert_pieces(&what, pieces, &want_params);
            assert!(without.is_empty(), "{what}: {without:?}");
        }
    }
}

#[test]
fn empty_pieces_are_refused_on_every_rank() {
    // 3 heads of 4 over 4 ranks: torch.chunk gives 1, 1, 1, 0 heads.
    let out = on_tp(4, |tp, _, vb| {
        let cfg = TpLinearConfig {
            bias: false,
            block: 4,
        };
        let e1 = ColumnParallelLinear::new(8, 12, cfg, &tp, vb.pp("attn.q")).err();
        let e2 = RowParallelLinear::new(3, 8, TpLinearConfig::default(), &tp, vb.pp("o")).err();
        let e3 = vocab_parallel_embedding(2, 8, &tp, vb.pp("emb")).err();
        let e4 = ColumnParallelLinear::new(8, 10, cfg, &tp, vb.pp("odd")).err();
        Ok([e1, e2, e3, e4]
            .map(|e| e.map(|e| (matches!(e, ParallelError::Config(_)), e.to_string()))))
    });
    for errs in out {
        let [e1, e2, e3, e4] = errs.map(|e| e.expect("must be refused"));
        for (typed, e) in [&e1, &e2, &e3, &e4] {
            assert!(*typed, "{e}");
        }
        assert!(
            e1.1.contains("attn.q") && e1.1.contains("[1, 1, 1, 0]"),
            "{}",
            e1.1
        );
        assert!(e2.1.contains("[1, 1, 1, 0]"), "{}", e2.1);
        assert!(
            e3.1.contains("emb") && e3.1.contains("[1, 1, 0, 0]"),
            "{}",
            e3.1
        );
        assert!(e4.1.contains("not whole blocks of 4"), "{}", e4.1);
    }
}

// ---------------------------------------------------------------- the attention block

const VOCAB: usize = 11;
const HEADS: usize = 7;
const HEAD_DIM: usize = 4;
const MODEL: usize = HEADS * HEAD_DIM;
const SEQ: usize = 5;
const ASTEPS: usize = 3;

/// Token embedding, causal self-attention over `heads` heads (this rank's, under TP), a
/// residual, and the LM head: written once over `Module`.
struct AttnLm {
    emb: Box<dyn Module>,
    q: Box<dyn Module>,
    k: Box<dyn Module>,
    v: Box<dyn Module>,
    o: Box<dyn Module>,
    head: Box<dyn Module>,
    heads: usize,
}

impl AttnLm {
    fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let h = self.emb.forward(ids)?;
        let split = |x: Tensor| -> candle_core::Result<Tensor> {
            x.reshape((b, t, self.heads, HEAD_DIM))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(self.q.forward(&h)?)?;
        let k = split(self.k.forward(&h)?)?;
        let v = split(self.v.forward(&h)?)?;
        let att = (q.matmul(&k.t()?)? / (HEAD_DIM as f64).sqrt())?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), ids.device())?;
        let att = candle_nn::ops::softmax(&att.broadcast_add(&mask)?, D::Minus1)?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, self.heads * HEAD_DIM))?;
        let x = (h + self.o.forward(&y)?)?;
        self.head.forward(&x)
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.logits(ids)?.flatten_to(1)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

fn tokens(step: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..2 * (SEQ + 1))
        .map(|i| ((i * 5 + step * 3 + i * i) % VOCAB) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (2, SEQ + 1), &Device::Cpu).unwrap();
    (
        ids.narrow(1, 0, SEQ).unwrap(),
        ids.narrow(1, 1, SEQ).unwrap(),
    )
}

/// Losses, the first step's gradients and the final parameters on one device.
fn one_device_attn() -> (Vec<f32>, Params, Params) {
    let (map, vb) = reference_var_builder(SEED, DType::F32, &Device::Cpu);
    let lin = |name: &str, i, o, bias| -> Box<dyn Module> {
        Box::new(candle_nn::linear_b(i, o, bias, vb.pp(name)).unwrap())
    };
    // No bias on q, k, v (as in llama): a key bias has a zero gradient (softmax is invariant
    // to it), whose rounding noise AdamW would amplify.
    let lm = AttnLm {
        emb: Box::new(candle_nn::embedding(VOCAB, MODEL, vb.pp("emb")).unwrap()),
        q: lin("q", MODEL, MODEL, false),
        k: lin("k", MODEL, MODEL, false),
        v: lin("v", MODEL, MODEL, false),
        o: lin("o", MODEL, MODEL, true),
        head: lin("head", MODEL, VOCAB, true),
        heads: HEADS,
    };
    train_one_device(&map, ASTEPS, |step| {
        let (x, y) = tokens(step);
        lm.loss(&x, &y)
    })
}

#[test]
fn tp_attention_block_matches_one_device() {
    let (want_losses, want_grads, want_params) = one_device_attn();
    // 7 heads: 4 + 3 over 2 ranks, 3 + 3 + 1 over 3, 2 + 2 + 2 + 1 over 4; vocab 11 likewise
    // uneven.
    for world in [1usize, 2, 3, 4] {
        let out = on_tp(world, |tp, map, vb| {
            let by_heads = TpLinearConfig {
                bias: false,
                block: HEAD_DIM,
            };
            let col = |name: &str| -> R<ColumnParallelLinear> {
                Ok(ColumnParallelLinear::new(
                    MODEL,
                    MODEL,
                    by_heads,
                    &tp,
                    vb.pp(name),
                )?)
            };
            let (q, k, v) = (col("q")?, col("k")?, col("v")?);
            let o_cfg = TpLinearConfig {
                bias: true,
                ..by_heads
            };
            let o = RowParallelLinear::new(MODEL, MODEL, o_cfg, &tp, vb.pp("o"))?;
            let emb = vocab_parallel_embedding(VOCAB, MODEL, &tp, vb.pp("emb"))?;
            let head =
                column_parallel_linear(MODEL, VOCAB, &tp, vb.pp("head"))?.with_gather_output(true);
            let mut ranges: HashMap<String, Vec<Range<usize>>> = HashMap::new();
            for (n, l) in [("q", &q), ("k", &k), ("v", &v), ("head", &head)] {
                let r = l.out_range();
                ranges.insert(format!("{n}.weight"), vec![r.clone(), 0..MODEL]);
                if l.bias().is_some() {
                    ranges.insert(format!("{n}.bias"), vec![r]);
                }
            }
            ranges.insert("o.weight".into(), vec![0..MODEL, o.in_range()]);
            ranges.insert("o.bias".into(), whole(MODEL));
            ranges.insert("emb.weight".into(), vec![emb.vocab_range(), 0..MODEL]);
            let heads = q.out_range().len() / HEAD_DIM;
            let lm = AttnLm {
                emb: Box::new(emb),
                q: Box::new(q),
                k: Box::new(k),
                v: Box::new(v),
                o: Box::new(o),
                head: Box::new(head),
                heads,
            };
            let mut opt = candle_nn::AdamW::new(map.all_vars(), adamw())?;
            let mut losses = Vec::new();
            let mut grads0: Pieces = Vec::new();
            let mut counts = (0, 0);
            for step in 0..ASTEPS {
                let (x, y) = tokens(step);
                let mode = CommDebugMode::start();
                let loss = lm.loss(&x, &y)?;
                losses.push(loss.to_scalar::<f32>()?);
                let grads = loss.backward()?;
                if step == 0 {
                    counts = (
                        mode.count("all_reduce", Phase::Forward),
                        mode.count("all_reduce", Phase::Backward),
                    );
                    for (name, var) in map.data().lock().unwrap().iter() {
                        let g = grads.get(var.as_tensor()).cloned();
                        let g = g.ok_or_else(|| format!("{name}: no gradient"))?;
                        grads0.push((name.clone(), g, ranges[name].clone()));
                    }
                }
                opt.step(&grads)?;
            }
            let pieces = pieces_at(snapshot(&map), |n| ranges[n].clone());
            Ok((losses, grads0, pieces, counts))
        });
        for (rank, (losses, grads0, pieces, counts)) in out.iter().enumerate() {
            let what = format!("world {world} rank {rank}");
            assert_losses(&what, losses, &want_losses);
            assert_pieces(&format!("{what} step-0 gradient"), grads0, &want_grads);
            assert_pieces(&what, pieces, &want_params);
            assert_eq!(grads0.len(), want_grads.len(), "{what}");
            // Forward: the embedding's and o's all_reduce. Backward: the f of q, k, v (on the
            // embedding's output) and of the head (on the residual stream) all_reduce their
            // input's gradient; the gathered logits' gradient is chunked (no collective).
            assert_eq!(*counts, (2, 4), "{what}: all_reduces (forward, backward)");
        }
    }
}

#[test]
fn module_errors_cross_into_candle_with_their_type() {
    // A row-parallel layer fed the whole input while it expects its piece.
    let out = on_tp(2, |tp, _, vb| {
        let row = row_parallel_linear(HID, OUT, &tp, vb.pp("fc2"))?;
        let x = Var::from_tensor(&values(&[2, HID], 0))?;
        let err = row.forward(x.as_tensor()).err().map(|e| e.to_string());
        // Scattering the whole input works.
        let y = row.with_input_is_parallel(false).forward(x.as_tensor())?;
        Ok((err, y.dims().to_vec()))
    });
    for (err, dims) in out {
        let e = err.expect("a whole input to a parallel-input layer");
        assert!(
            e.contains("row-parallel") && e.contains("10 features"),
            "{e}"
        );
        assert_eq!(dims, vec![2, OUT]);
    }
}

#[test]
fn comparisons_fail_on_nan_inf_mismatch_and_short_runs() {
    let d = Device::Cpu;
    let t = |v: &[f32]| Tensor::new(v, &d).unwrap();
    let want = t(&[1.0, -2.0, 4.0]);
    assert_eq!(max_rel(&want, &want), 0.0);
    assert!((max_rel(&t(&[1.0, -2.0, 4.04]), &want) - 0.01).abs() < 1e-6);
    // A planted NaN or infinity, on either side, gives no finite difference (so fails every
    // `rel <= tol`).
    for bad in [f32::NAN, f32::INFINITY] {
        let planted = t(&[1.0, bad, 4.0]);
        assert!(!max_rel(&planted, &want).is_finite(), "{bad} in the run");
        assert!(
            !max_rel(&want, &planted).is_finite(),
            "{bad} in the reference"
        );
    }
    let fails = |got: &[f32]| {
        let got = got.to_vec();
        std::panic::catch_unwind(move || assert_losses("planted", &got, &[2.0, 1.5, 1.0])).is_err()
    };
    assert!(!fails(&[2.0, 1.5, 1.0]));
    assert!(fails(&[2.0, f32::NAN, 1.0]), "a NaN loss");
    assert!(fails(&[2.0, 1.5, 1.001]), "a loss past 1e-5");
    assert!(fails(&[2.0, 1.5]), "a run that stopped early");
}
