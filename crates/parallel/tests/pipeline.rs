//! Pipeline parallelism end to end: an MLP split into stages on LocalWorld ranks, run by every
//! schedule, against the same model on one device (one big batch); the executor's measured
//! bubble against the simulator's; bad input refused before anything runs.

use std::collections::HashMap;
use std::time::Duration;

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_kernels::compare::max_rel_diff;
use candle_dtensor_parallel::pipeline::{
    run_schedule, split_balanced, split_explicit, Action, CostModel, PipeComms, PipelineError,
    PipelineReport, Schedule, ScheduleError, Stage, StageError, TimedStage,
};

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Width of every layer, layers, rows per micro-batch.
const D: usize = 6;
const LAYERS: usize = 8;
const ROWS: usize = 3;

/// Deterministic values in [-0.5, 0.5) (no RNG: every rank builds the same model).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729 + 13) % 1000) as f32) / 1000.0 - 0.5)
        .collect()
}

/// Layer `l`'s weight `[D, D]` and bias `[D]`; tanh after every layer but the last.
fn layer(l: usize) -> candle_core::Result<(Var, Var)> {
    let dev = Device::Cpu;
    let w = Tensor::from_vec(values(D * D, 2 * l + 1), (D, D), &dev)?;
    let b = Tensor::from_vec(values(D, 2 * l + 2), D, &dev)?;
    Ok((Var::from_tensor(&w)?, Var::from_tensor(&b)?))
}

fn batch(m: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let n = m * ROWS * D;
    let x = Tensor::from_vec(values(n, 1000), (m * ROWS, D), &Device::Cpu)?;
    let t = Tensor::from_vec(values(n, 2000), (m * ROWS, D), &Device::Cpu)?;
    Ok((x, t))
}

/// The model on one device, one batch of `m * ROWS` rows: loss (mean squared error) and every
/// layer's (weight, bias) gradient.
fn reference(m: usize) -> Result<(f64, Vec<(Tensor, Tensor)>), BoxErr> {
    let (x, t) = batch(m)?;
    let layers: Vec<(Var, Var)> = (0..LAYERS).map(layer).collect::<Result<_, _>>()?;
    let mut h = x;
    for (l, (w, b)) in layers.iter().enumerate() {
        h = h
            .matmul(&w.as_tensor().t()?)?
            .broadcast_add(b.as_tensor())?;
        if l + 1 < LAYERS {
            h = h.tanh()?;
        }
    }
    let loss = (h - t)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    let g = layers
        .iter()
        .map(|(w, b)| {
            let gw = grads.get(w.as_tensor()).cloned().ok_or("no weight grad")?;
            let gb = grads.get(b.as_tensor()).cloned().ok_or("no bias grad")?;
            Ok::<_, BoxErr>((gw, gb))
        })
        .collect::<Result<_, _>>()?;
    Ok((f64::from(loss.to_scalar::<f32>()?), g))
}

/// What B keeps for W: (layer, layer input, gradient at the pre-activation).
type WKeep = (usize, Tensor, Tensor);

/// What a chunk's forward keeps for backward.
struct Saved {
    input: Option<Var>,
    out: Tensor,
    /// Each layer's input and output (after tanh), for the split backward.
    xs: Vec<Tensor>,
    ys: Vec<Tensor>,
}

/// One rank's chunks of the MLP.
struct MlpStage {
    /// Per chunk: (stage, layer indices).
    chunks: Vec<(usize, Vec<usize>)>,
    stages: usize,
    layers: HashMap<usize, (Var, Var)>,
    x: Tensor,
    t: Tensor,
    /// Elements of the global batch's output (the mean's divisor).
    count: f64,
    /// Zero-bubble mode: forward builds no autograd graph; backward is split by hand.
    split: bool,
    saved: HashMap<(usize, usize), Saved>,
    /// Per (chunk, mb): (layer, layer input, gradient at the pre-activation) for W.
    pending_w: HashMap<(usize, usize), Vec<WKeep>>,
    grads: HashMap<usize, (Tensor, Tensor)>,
}

impl MlpStage {
    fn new(
        rank: usize,
        schedule: &Schedule,
        ranges: &[std::ops::Range<usize>],
        split: bool,
    ) -> Result<Self, BoxErr> {
        let (v, m) = (schedule.chunks(), schedule.micro_batches());
        let chunks: Vec<(usize, Vec<usize>)> = (0..v)
            .map(|c| {
                let s = schedule.stage_of(rank, c);
                (s, ranges[s].clone().collect())
            })
            .collect();
        let mut layers = HashMap::new();
        for (_, ls) in &chunks {
            for &l in ls {
                layers.insert(l, layer(l)?);
            }
        }
        let (x, t) = batch(m)?;
        Ok(MlpStage {
            chunks,
            stages: schedule.stages(),
            layers,
            x,
            t,
            count: (m * ROWS * D) as f64,
            split,
            saved: HashMap::new(),
            pending_w: HashMap::new(),
            grads: HashMap::new(),
        })
    }

    fn w(&self, l: usize) -> Result<(&Var, &Var), BoxErr> {
        let (w, b) = self.layers.get(&l).ok_or("layer not on this rank")?;
        Ok((w, b))
    }

    fn accumulate(&mut self, l: usize, gw: Tensor, gb: Tensor) -> candle_core::Result<()> {
        let e = match self.grads.remove(&l) {
            Some((w, b)) => ((w + gw)?, (b + gb)?),
            None => (gw, gb),
        };
        self.grads.insert(l, e);
        Ok(())
    }

    fn rows(&self, t: &Tensor, mb: usize) -> candle_core::Result<Tensor> {
        t.narrow(0, mb * ROWS, ROWS)
    }
}

impl Stage for MlpStage {
    fn forward(
        &mut self,
        chunk: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Tensor, StageError> {
        let (s, ls) = self.chunks[chunk].clone();
        let (mut h, var) = match input {
            None => (self.rows(&self.x, mb)?, None),
            Some(t) if self.split => (t, None),
            Some(t) => {
                let v = Var::from_tensor(&t)?;
                (v.as_tensor().clone(), Some(v))
            }
        };
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for &l in &ls {
            let (w, b) = self.w(l)?;
            let (w, b) = if self.split {
                (w.as_detached_tensor(), b.as_detached_tensor())
            } else {
                (w.as_tensor().clone(), b.as_tensor().clone())
            };
            xs.push(h.clone());
            h = h.matmul(&w.t()?)?.broadcast_add(&b)?;
            if l + 1 < LAYERS {
                h = h.tanh()?;
            }
            ys.push(h.clone());
        }
        let out = if s + 1 == self.stages {
            // This micro-batch's share of the global mean.
            ((h - self.rows(&self.t, mb)?)?.sqr()?.sum_all()? / self.count)?
        } else {
            h
        };
        self.saved.insert(
            (chunk, mb),
            Saved {
                input: var,
                out: out.clone(),
                xs,
                ys,
            },
        );
        Ok(out)
    }

    fn backward(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        let saved = self
            .saved
            .remove(&(chunk, mb))
            .ok_or("backward before forward")?;
        let grads = match grad_out {
            None => saved.out.backward()?,
            Some(g) => (saved.out * g)?.sum_all()?.backward()?,
        };
        for l in self.chunks[chunk].1.clone() {
            let (w, b) = self.w(l)?;
            let gw = grads.get(w.as_tensor()).cloned().ok_or("no weight grad")?;
            let gb = grads.get(b.as_tensor()).cloned().ok_or("no bias grad")?;
            self.accumulate(l, gw, gb)?;
        }
        Ok(saved.input.and_then(|v| grads.get(v.as_tensor()).cloned()))
    }

    /// B: the input gradient through detached weights, by hand (`dz = dy (1 - y^2)`,
    /// `dx = dz W`), keeping each layer's input and `dz` for W. candle's autograd cannot do
    /// this part alone: its matmul backward always computes both operands' gradients.
    fn backward_input(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        let saved = self
            .saved
            .remove(&(chunk, mb))
            .ok_or("backward before forward")?;
        let (s, ls) = self.chunks[chunk].clone();
        let mut dy = match grad_out {
            Some(g) => g,
            None => {
                let y = saved.ys.last().ok_or("empty chunk")?;
                ((y - self.rows(&self.t, mb)?)? * (2.0 / self.count))?
            }
        };
        let mut keep = Vec::with_capacity(ls.len());
        for (k, &l) in ls.iter().enumerate().rev() {
            let dz = if l + 1 < LAYERS {
                let y = &saved.ys[k];
                (dy * (1.0 - y.sqr()?)?)?
            } else {
                dy
            };
            dy = if k > 0 || s > 0 {
                dz.matmul(&self.w(l)?.0.as_detached_tensor())?
            } else {
                dz.zeros_like()? // stage 0's input gradient is not needed
            };
            keep.push((l, saved.xs[k].clone(), dz));
        }
        self.pending_w.insert((chunk, mb), keep);
        Ok((s > 0).then_some(dy))
    }

    /// W: the weight gradients `dW = dz^T x`, `db = sum_rows dz` from what B kept.
    fn backward_weight(&mut self, chunk: usize, mb: usize) -> Result<(), StageError> {
        let keep = self.pending_w.remove(&(chunk, mb)).ok_or("W before B")?;
        for (l, x, dz) in keep {
            let gw = dz.t()?.matmul(&x)?;
            let gb = dz.sum(0)?;
            self.accumulate(l, gw, gb)?;
        }
        Ok(())
    }

    fn input_shape(&self, _chunk: usize, _mb: usize) -> Result<(Shape, DType), StageError> {
        Ok(((ROWS, D).into(), DType::F32))
    }

    fn output_shape(&self, _chunk: usize, _mb: usize) -> Result<(Shape, DType), StageError> {
        Ok(((ROWS, D).into(), DType::F32))
    }
}

type RankOut = (PipelineReport, Vec<(usize, Tensor, Tensor)>);

/// Runs `schedule` over `p` LocalWorld ranks; returns every rank's report and gradients.
fn run(schedule: &Schedule, split: bool) -> Result<Vec<RankOut>, BoxErr> {
    let (p, v) = (schedule.ranks(), schedule.chunks());
    let counts = vec![D * D + D; LAYERS];
    let ranges = split_balanced(&counts, p * v)?;
    let out = LocalWorld::new(p)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| {
            let comms = PipeComms::for_schedule(&comm, schedule)?;
            let mut stage = MlpStage::new(comm.rank(), schedule, &ranges, split)?;
            let report = run_schedule(&mut stage, schedule, &comms)?;
            let grads = stage
                .grads
                .into_iter()
                .map(|(l, (w, b))| (l, w, b))
                .collect::<Vec<_>>();
            Ok::<_, BoxErr>((report, grads))
        })?;
    Ok(out)
}

fn check(schedule: &Schedule, split: bool) -> Result<(), BoxErr> {
    let what = format!(
        "{} p={} m={} v={}",
        schedule.kind(),
        schedule.ranks(),
        schedule.micro_batches(),
        schedule.chunks()
    );
    let (want_loss, want_grads) = reference(schedule.micro_batches())?;
    let outs = run(schedule, split)?;
    let mut loss = 0.0f64;
    let mut n_losses = 0;
    let mut seen = [false; LAYERS];
    for (report, grads) in &outs {
        for (_, l) in &report.losses {
            loss += f64::from(l.to_scalar::<f32>()?);
            n_losses += 1;
        }
        for (l, gw, gb) in grads {
            let (ww, wb) = &want_grads[*l];
            let dw = max_rel_diff(gw, ww)?;
            let db = max_rel_diff(gb, wb)?;
            // NaN fails.
            if dw.is_nan() || db.is_nan() || dw > 1e-4 || db > 1e-4 {
                return Err(
                    format!("{what}: layer {l} grads differ: weight {dw:e}, bias {db:e}").into(),
                );
            }
            seen[*l] = true;
        }
    }
    if n_losses != schedule.micro_batches() {
        return Err(format!("{what}: {n_losses} losses").into());
    }
    if let Some(l) = seen.iter().position(|s| !s) {
        return Err(format!("{what}: no gradient for layer {l}").into());
    }
    let rel = (loss - want_loss).abs() / want_loss.abs();
    if rel.is_nan() || rel > 1e-5 {
        return Err(format!("{what}: loss {loss} vs {want_loss} (rel {rel:e})").into());
    }
    Ok(())
}

#[test]
fn every_schedule_matches_one_device() -> Result<(), BoxErr> {
    // p = 1 runs the executor's loop-back path (no communicators).
    for p in [1, 2, 4] {
        for m in [p, 2 * p + 1] {
            check(&Schedule::gpipe(p, m)?, false)?;
            check(&Schedule::one_f_one_b(p, m)?, false)?;
            check(&Schedule::zero_bubble_h1(p, m)?, true)?;
        }
        for m in [p, 2 * p] {
            check(&Schedule::interleaved(p, m, 2)?, false)?;
        }
        // The V: activations turn on rank p - 1 and come back down; uneven m too.
        for m in [1, p, 2 * p + 1] {
            check(&Schedule::zero_bubble_v(p, m)?, true)?;
        }
    }
    Ok(())
}

/// The executor's measured bubble on a stage of modelled (slept) action times. Only the lower
/// side is held tight here: the dependencies of a schedule force at least its simulated idle
/// time, while a loaded machine (other tests run beside this one) only adds to it. How close
/// the measurement comes to the simulator on a quiet machine is a benchmark
/// (`examples/pipeline_bench.rs`, BENCHMARKS.md), not a test.
#[test]
fn measured_bubble_is_at_least_the_schedules() -> Result<(), BoxErr> {
    let p = 4;
    let m = 8;
    let unit = Duration::from_millis(6);
    for schedule in [
        Schedule::gpipe(p, m)?,
        Schedule::one_f_one_b(p, m)?,
        Schedule::interleaved(p, m, 2)?,
        Schedule::zero_bubble_h1(p, m)?,
        Schedule::zero_bubble_v(p, m)?,
    ] {
        let sim = schedule.bubble_fraction_with(&CostModel::default())?;
        let reports = LocalWorld::new(p)
            .with_timeout(Duration::from_secs(60))
            .launch(|comm| {
                let comms = PipeComms::for_schedule(&comm, &schedule)?;
                let mut stage = TimedStage::new(CostModel::default(), unit, schedule.chunks())?;
                Ok::<_, BoxErr>(run_schedule(&mut stage, &schedule, &comms)?)
            })?;
        let measured = PipelineReport::combined_bubble(&reports);
        tracing::info!(schedule = %schedule.kind(), sim, measured, "bubble");
        if measured.is_nan() || measured < sim - 0.03 || measured >= 1.0 {
            return Err(format!(
                "{}: measured bubble {measured:.4} vs simulated {sim:.4}",
                schedule.kind()
            )
            .into());
        }
        // Every rank ran every one of its actions, each for at least its modelled time.
        for (rank, r) in reports.iter().enumerate() {
            let modelled: f64 = schedule
                .actions(rank)
                .iter()
                .map(|a| match a {
                    Action::Forward { .. } => 1.0,
                    Action::Backward { .. } => 2.0,
                    Action::BackwardInput { .. } | Action::BackwardWeight { .. } => 1.0,
                })
                .sum::<f64>()
                * unit.as_secs_f64()
                / schedule.chunks() as f64;
            let busy = r.busy.as_secs_f64();
            if busy < modelled * 0.999 {
                return Err(format!(
                    "{}: rank {rank} busy {busy:.4}s, less than its modelled {modelled:.4}s",
                    schedule.kind()
                )
                .into());
            }
        }
    }
    Ok(())
}

#[test]
fn bad_input_is_refused_before_running() {
    // More stages than layers.
    let e = split_balanced(&[10; 3], 4).unwrap_err();
    assert!(
        matches!(
            e,
            PipelineError::Split {
                layers: 3,
                stages: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("more stages than layers"), "{e}");
    // An explicit split leaving a stage empty, or not covering the layers.
    let e = split_explicit(4, &[2, 0, 2]).unwrap_err();
    assert!(
        e.to_string().contains("stage 1") && e.to_string().contains("empty"),
        "{e}"
    );
    assert!(split_explicit(4, &[2, 1]).is_err());
    // Interleaved needs m % p == 0.
    let e = Schedule::interleaved(4, 6, 2).unwrap_err();
    assert!(
        matches!(
            e,
            ScheduleError::Rule {
                p: 4,
                m: 6,
                v: 2,
                ..
            }
        ),
        "{e}"
    );
    // A schedule for another number of ranks.
    let r = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm| {
            let comms = PipeComms::new(&comm)?;
            let schedule = Schedule::gpipe(4, 4)?;
            let mut stage = TimedStage::new(CostModel::default(), Duration::ZERO, 1)?;
            match run_schedule(&mut stage, &schedule, &comms) {
                Err(PipelineError::Setup(msg)) => Ok::<_, BoxErr>(msg),
                other => Err(format!("expected a setup error, got {other:?}").into()),
            }
        })
        .unwrap();
    assert!(r[0].contains("4 ranks"), "{}", r[0]);
    // ZB-V's activations also flow down the ranks: on 3 ranks the looped communicators lack
    // those streams (on 2, their wrap-around streams happen to be the V's).
    let r = LocalWorld::new(3)
        .with_timeout(Duration::from_secs(20))
        .launch(|comm| {
            let comms = PipeComms::new(&comm)?;
            let schedule = Schedule::zero_bubble_v(3, 3)?;
            let mut stage = TimedStage::new(CostModel::default(), Duration::ZERO, 2)?;
            match run_schedule(&mut stage, &schedule, &comms) {
                Err(PipelineError::Setup(msg)) => Ok::<_, BoxErr>(msg),
                other => Err(format!("expected a setup error, got {other:?}").into()),
            }
        })
        .unwrap();
    assert!(r.iter().any(|m| m.contains("for_schedule")), "{r:?}");
}

#[test]
fn balanced_split_by_parameter_count() {
    let r = split_balanced(&[1, 1, 1, 1, 4], 2).unwrap();
    assert_eq!(r, vec![0..4, 4..5]);
    let r = split_balanced(&[5; 8], 4).unwrap();
    assert_eq!(r, vec![0..2, 2..4, 4..6, 6..8]);
}
