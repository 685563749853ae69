//! The GPT over a `pp` mesh dim: pipeline stages whose parameters equal the one-device
//! model's, trained by GPipe, 1F1B and interleaved 1F1B on pp = 2 and 4 (and dp = 2 x pp = 2,
//! tp and FSDP inside the stages, mixture-of-experts blocks with experts over ep) to the
//! one-device run's losses at every step; bad settings refused before any step.

mod common;

use std::time::Duration;

use candle_core::DType;
use candle_dtensor_comm::LocalWorld;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{AcMode, Gpt, GptConfig, GptStage};
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::pipeline::{PipelineError, ScheduleError, ScheduleKind};
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::pipeline::PipelineSpec;
use candle_dtensor_train::trainer::{train_rank, RankReport, TrainConfig};
use candle_dtensor_train::RunError;
use common::{assert_close, micro_gpt, short_run, R};

const STEPS: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(60);

/// The micro GPT with 4 blocks.
fn gpt4() -> GptConfig {
    GptConfig {
        n_layers: 4,
        ..micro_gpt()
    }
}

fn cfg(pipeline: Option<PipelineSpec>) -> TrainConfig {
    cfg_layers(4, pipeline)
}

fn cfg_layers(layers: usize, pipeline: Option<PipelineSpec>) -> TrainConfig {
    let g = GptConfig {
        n_layers: layers,
        ..micro_gpt()
    };
    let mut c = short_run(g, TpPlan::gpt(false), STEPS, 7);
    c.pipeline = pipeline;
    c
}

/// Every rank's report (or error) of training `c` on a local world shaped `dims`.
fn run_all(dims: &[(&str, usize)], c: &TrainConfig) -> Vec<Result<RankReport, RunError>> {
    let n: usize = dims.iter().map(|d| d.1).product();
    LocalWorld::new(n)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, dims)?;
            Ok(train_rank(&mesh, c, |_| {}))
        })
        .unwrap()
}

fn spec(kind: ScheduleKind, m: usize, v: usize) -> PipelineSpec {
    PipelineSpec {
        chunks: v,
        ..PipelineSpec::new(kind, m)
    }
}

#[test]
fn stage_parameters_equal_the_one_device_models() -> R<()> {
    let out = LocalWorld::new(1)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            for tied in [false, true] {
                let cfg = GptConfig { tied, ..gpt4() };
                let (_, full) = Gpt::new(&cfg, &mesh, &TpPlan::new(), 11, DType::F32)?;
                let mut store = ParamStore::new(&mesh, 11, DType::F32);
                for (s, r) in [(0, 0..1), (1, 1..3), (2, 3..4)] {
                    GptStage::new(&cfg, &mesh, &TpPlan::new(), s, 3, r, &mut store)?;
                }
                let mut n = 0;
                for p in store.params() {
                    let q = full
                        .params()
                        .iter()
                        .find(|q| q.name == p.name)
                        .ok_or_else(|| format!("{} is not a parameter of the model", p.name))?;
                    let d = (p.var.as_tensor() - q.var.as_tensor())?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    if d != 0.0 {
                        return Err(format!("tied {tied}: {} differs by {d}", p.name).into());
                    }
                    n += 1;
                }
                // The three stages hold every parameter of the model, once (a tied table
                // twice: the last stage's copy).
                if n != full.params().len() + usize::from(tied) {
                    return Err(format!(
                        "tied {tied}: {n} stage parameters, {} in the model",
                        full.params().len()
                    )
                    .into());
                }
            }
            Ok(())
        })?;
    assert_eq!(out.len(), 1);
    Ok(())
}

/// A mesh, the model's blocks, the pipeline.
type Case = (&'static [(&'static str, usize)], usize, PipelineSpec);

#[test]
fn pipelines_match_one_device() -> R<()> {
    let mut uneven = spec(ScheduleKind::OneFOneB, 4, 1);
    uneven.split = Some(vec![3, 1]);
    let cases: [Case; 17] = [
        (&[("pp", 2)], 4, uneven),
        // ZB-V: two chunks per rank in a V (rank 0 holds the first and the last stage).
        (&[("pp", 2)], 4, spec(ScheduleKind::ZeroBubbleV, 4, 2)),
        (&[("pp", 4)], 8, spec(ScheduleKind::ZeroBubbleV, 4, 2)),
        (
            &[("dp", 2), ("pp", 2)],
            4,
            spec(ScheduleKind::ZeroBubbleV, 2, 2),
        ),
        // Zero bubble: each backward split into input and weight gradients.
        (&[("pp", 2)], 4, spec(ScheduleKind::ZeroBubbleH1, 4, 1)),
        (&[("pp", 4)], 4, spec(ScheduleKind::ZeroBubbleH1, 8, 1)),
        (
            &[("dp", 2), ("pp", 2)],
            4,
            spec(ScheduleKind::ZeroBubbleH1, 2, 1),
        ),
        (
            &[("ep", 2), ("pp", 2)],
            4,
            spec(ScheduleKind::ZeroBubbleH1, 2, 1),
        ),
        (&[("pp", 4)], 8, spec(ScheduleKind::Interleaved1F1B, 8, 2)),
        (&[("pp", 2)], 4, spec(ScheduleKind::GPipe, 4, 1)),
        (&[("pp", 2)], 4, spec(ScheduleKind::OneFOneB, 4, 1)),
        (&[("pp", 2)], 4, spec(ScheduleKind::Interleaved1F1B, 4, 2)),
        (&[("pp", 4)], 4, spec(ScheduleKind::GPipe, 4, 1)),
        (&[("pp", 4)], 4, spec(ScheduleKind::OneFOneB, 8, 1)),
        (
            &[("dp", 2), ("pp", 2)],
            4,
            spec(ScheduleKind::OneFOneB, 4, 1),
        ),
        (&[("pp", 2), ("dp", 2)], 4, spec(ScheduleKind::GPipe, 2, 1)),
        // ep without mixture-of-experts blocks: one more data dim.
        (
            &[("ep", 2), ("pp", 2)],
            4,
            spec(ScheduleKind::OneFOneB, 2, 1),
        ),
    ];
    let mut references = std::collections::HashMap::new();
    for (dims, layers, s) in cases {
        let split = matches!(
            s.schedule,
            ScheduleKind::ZeroBubbleH1 | ScheduleKind::ZeroBubbleV
        );
        let m = s.micro_batches;
        let what = format!(
            "{dims:?} {layers} blocks {} m={} v={} split {:?}",
            s.schedule, s.micro_batches, s.chunks, s.split
        );
        if let std::collections::hash_map::Entry::Vacant(slot) = references.entry(layers) {
            let r = run_all(&[("dp", 1)], &cfg_layers(layers, None))
                .pop()
                .ok_or("no rank")??;
            assert_eq!(r.losses.len(), STEPS);
            // The run trains (a comparison of constant losses would prove little).
            assert!(r.losses[STEPS - 1] < r.losses[0], "{:?}", r.losses);
            slot.insert((r.losses, r.params, r.param_bytes));
        }
        let (reference, params, bytes) = &references[&layers];
        let reports = run_all(dims, &cfg_layers(layers, Some(s)));
        let dp: usize = dims
            .iter()
            .filter(|d| d.0 == "dp" || d.0 == "ep")
            .map(|d| d.1)
            .product();
        let mut held = 0;
        let mut worst = 0.0f64;
        for r in reports {
            let r = r?;
            held += r.param_bytes;
            assert_close(&r.losses, reference, 1e-5, &what);
            // The whole model's parameter count, on every rank.
            assert_eq!(r.params, *params, "{what}");
            for (a, b) in r.losses.iter().zip(reference) {
                worst = worst.max(f64::from((a - b).abs() / b.abs()));
            }
            assert_eq!(r.pipeline.len(), STEPS, "{what}");
            for st in &r.pipeline {
                assert!(
                    st.analytic_bubble > 0.0 && st.analytic_bubble < 1.0,
                    "{what}: {st:?}"
                );
                assert!(
                    st.measured_bubble.is_finite() && st.measured_bubble < 1.0,
                    "{what}: {st:?}"
                );
                // A split backward leaves every micro-batch's linear dW GEMMs (the same
                // number each) to W, which does real work; otherwise nothing is deferred.
                // The schedule simulated with the step's mean action times: a fraction, and
                // the kinds of action this schedule runs timed.
                assert!((0.0..1.0).contains(&st.modelled_bubble), "{what}: {st:?}");
                let [f, b, i, w] = st.action_ms;
                assert!(f > 0.0, "{what}: {st:?}");
                if split {
                    assert!(b == 0.0 && i > 0.0 && w > 0.0, "{what}: {st:?}");
                } else {
                    assert!(b > 0.0 && i == 0.0 && w == 0.0, "{what}: {st:?}");
                }
                if split {
                    let d = st.deferred_weight_grads;
                    assert!(d >= 4 * m && d % m == 0, "{what}: {st:?}");
                    assert!(st.weight_grad_ms > 0.0, "{what}: {st:?}");
                    assert!(st.peak_deferred_bytes > 0, "{what}: {st:?}");
                } else {
                    assert_eq!(st.deferred_weight_grads, 0, "{what}: {st:?}");
                    assert_eq!(st.peak_deferred_bytes, 0, "{what}: {st:?}");
                    assert_eq!(st.weight_grad_ms, 0.0, "{what}: {st:?}");
                }
            }
            if r.rank == 0 {
                let last = &r.pipeline[STEPS - 1];
                tracing::info!(
                    what,
                    worst,
                    analytic = last.analytic_bubble,
                    measured = last.measured_bubble,
                    "pipelined run against one device"
                );
            }
        }
        // Each rank builds only its stages' parameters: every pipeline replica holds the
        // model once.
        assert_eq!(held, dp * bytes, "{what}: parameter bytes over the ranks");
    }
    Ok(())
}

/// Every rank returns the same kind of error.
fn refused(dims: &[(&str, usize)], c: &TrainConfig) -> Vec<RunError> {
    run_all(dims, c)
        .into_iter()
        .map(|r| match r {
            Err(e) => e,
            Ok(_) => panic!("{dims:?}: the run was not refused"),
        })
        .collect()
}

/// A tied head: the last stage's copy of the token table is kept equal to the first stage's,
/// so every layout trains the one-device tied model; the gradient norm counts the table once.
#[test]
fn tied_head_matches_one_device() -> R<()> {
    let tied = |pipeline| {
        let mut c = cfg(pipeline);
        c.gpt.tied = true;
        c.grad_norm_every = 1;
        c
    };
    let train = |dims: &[(&str, usize)], c: &TrainConfig| -> R<Vec<(Vec<f32>, Vec<f64>)>> {
        let n: usize = dims.iter().map(|d| d.1).product();
        Ok(LocalWorld::new(n)
            .with_timeout(TIMEOUT)
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, dims)?;
                let mut norms = Vec::new();
                let r = train_rank(&mesh, c, |i| norms.push(i.grad_norm.unwrap_or(f64::NAN)))?;
                Ok((r.losses, norms))
            })?)
    };
    let (want, want_norms) = train(&[("dp", 1)], &tied(None))?.remove(0);
    let cases: [Case; 6] = [
        (&[("pp", 2)], 4, spec(ScheduleKind::OneFOneB, 4, 1)),
        (&[("pp", 2)], 4, spec(ScheduleKind::Interleaved1F1B, 4, 2)),
        // Both tables on one rank: ZB-V's V, and one rank with two chunks.
        (&[("pp", 2)], 4, spec(ScheduleKind::ZeroBubbleV, 4, 2)),
        (&[("pp", 1)], 4, spec(ScheduleKind::Interleaved1F1B, 4, 2)),
        (&[("pp", 4)], 4, spec(ScheduleKind::OneFOneB, 4, 1)),
        (&[("dp", 2), ("pp", 2)], 4, spec(ScheduleKind::GPipe, 2, 1)),
    ];
    for (dims, _, s) in cases {
        let what = format!("tied {dims:?} {}", s.schedule);
        for (losses, norms) in train(dims, &tied(Some(s)))? {
            assert_close(&losses, &want, 1e-5, &what);
            let n: Vec<f32> = norms.iter().map(|&x| x as f32).collect();
            let w: Vec<f32> = want_norms.iter().map(|&x| x as f32).collect();
            assert_close(&n, &w, 1e-5, &format!("{what}: gradient norms"));
        }
    }
    Ok(())
}

/// Activation checkpointing inside the stages changes no loss, and keeps less for backward.
#[test]
fn checkpointed_stages_match_one_device() -> R<()> {
    let reference = run_all(&[("dp", 1)], &cfg(None))
        .pop()
        .ok_or("no rank")??
        .losses;
    let mut bytes = Vec::new();
    for ac in [AcMode::None, AcMode::Selective, AcMode::Full] {
        let mut c = cfg(Some(spec(ScheduleKind::OneFOneB, 4, 1)));
        c.gpt.ac = ac;
        let mut most = 0;
        for r in run_all(&[("pp", 2)], &c) {
            let r = r?;
            assert_close(&r.losses, &reference, 1e-5, &format!("--ac {}", ac.name()));
            most = most.max(r.peak_activation_bytes);
        }
        bytes.push(most);
    }
    // none > selective > full, per stage (the largest over the ranks).
    assert!(bytes[0] > bytes[1] && bytes[1] > bytes[2], "{bytes:?}");
    Ok(())
}

/// Gradient clipping: the global norm over the stages (and dp replicas) clips as on one device.
#[test]
fn clipping_matches_one_device() -> R<()> {
    let clipped = |pipeline| {
        let mut c = cfg(pipeline);
        c.clip = Some(0.1);
        c
    };
    let reference = run_all(&[("dp", 1)], &clipped(None))
        .pop()
        .ok_or("no rank")??;
    let norms = LocalWorld::new(4)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 2), ("pp", 2)])?;
            let mut norms = Vec::new();
            let c = clipped(Some(spec(ScheduleKind::OneFOneB, 2, 1)));
            let r = train_rank(&mesh, &c, |i| norms.push(i.grad_norm))?;
            assert_close(&r.losses, &reference.losses, 1e-5, "clipped dp=2 x pp=2");
            Ok(norms)
        })?;
    for n in norms.into_iter().flatten() {
        // The clip is active: every step's norm exceeds it.
        let n = n.ok_or("no gradient norm")?;
        assert!(n > 0.1, "norm {n}");
    }
    Ok(())
}

#[test]
fn bad_settings_are_refused_on_every_rank() {
    // More stages than blocks (pp 4 x 2 chunks = 8 stages for 4 blocks).
    for e in refused(
        &[("pp", 4)],
        &cfg(Some(spec(ScheduleKind::Interleaved1F1B, 4, 2))),
    ) {
        assert!(
            matches!(
                &e,
                RunError::Pipeline(p) if matches!(**p, PipelineError::Split { layers: 4, stages: 8, .. })
            ),
            "{e}"
        );
    }
    // An explicit split leaving a stage empty.
    let mut s = spec(ScheduleKind::GPipe, 2, 1);
    s.split = Some(vec![4, 0]);
    for e in refused(&[("pp", 2)], &cfg(Some(s))) {
        assert!(
            e.to_string().contains("stage 1") && e.to_string().contains("empty"),
            "{e}"
        );
    }
    // Micro-batches not dividing the batch (8 rows, dp 2 x 3 micro-batches).
    for e in refused(
        &[("dp", 2), ("pp", 2)],
        &cfg(Some(spec(ScheduleKind::GPipe, 3, 1))),
    ) {
        assert!(
            matches!(&e, RunError::Config(m) if m.contains("micro-batches 3") && m.contains("batch 8")),
            "{e}"
        );
    }
    // Interleaved needs m % p == 0.
    for e in refused(
        &[("pp", 2)],
        &cfg(Some(spec(ScheduleKind::Interleaved1F1B, 1, 2))),
    ) {
        assert!(
            matches!(
                &e,
                RunError::Pipeline(p) if matches!(&**p, PipelineError::Schedule(ScheduleError::Rule { p: 2, m: 1, v: 2, .. }))
            ),
            "{e}"
        );
    }
    // ZB-V: two chunks per rank, so 2 pp stages (8 on pp=4 for 4 blocks), and no other v.
    for e in refused(
        &[("pp", 4)],
        &cfg(Some(spec(ScheduleKind::ZeroBubbleV, 4, 2))),
    ) {
        assert!(
            matches!(&e, RunError::Pipeline(p) if matches!(&**p, PipelineError::Split { layers: 4, stages: 8, .. })),
            "{e}"
        );
    }
    for e in refused(
        &[("pp", 2)],
        &cfg(Some(spec(ScheduleKind::ZeroBubbleV, 4, 1))),
    ) {
        assert!(
            matches!(&e, RunError::Pipeline(p) if p.to_string().contains("v must be 2")),
            "{e}"
        );
    }
    // Combinations not implemented: mixture-of-experts blocks next to tp inside the stages, ep next to tp, micro-batches
    // not dividing the batch over dp x ep, more ep ranks than experts.
    let moe = moe_cfg(Some(spec(ScheduleKind::GPipe, 2, 1)), 2);
    for e in refused(&[("tp", 2), ("pp", 2)], &moe) {
        assert!(
            matches!(&e, RunError::Unsupported(m) if m.contains("mixture-of-experts") && m.contains("tp")),
            "{e}"
        );
    }
    for e in refused(
        &[("ep", 2), ("tp", 2), ("pp", 2)],
        &cfg(Some(spec(ScheduleKind::GPipe, 2, 1))),
    ) {
        assert!(
            matches!(&e, RunError::Unsupported(m) if m.contains("both an ep and a tp")),
            "{e}"
        );
    }
    for e in refused(
        &[("dp", 2), ("ep", 2), ("pp", 2)],
        &moe_cfg(Some(spec(ScheduleKind::OneFOneB, 4, 1)), 4),
    ) {
        assert!(
            matches!(&e, RunError::Config(m) if m.contains("micro-batches 4")
                && m.contains("dp 2 and ep 2") && m.contains("dp x ep x micro-batches divides")),
            "{e}"
        );
    }
    let mut few = moe_cfg(Some(spec(ScheduleKind::GPipe, 2, 1)), 2);
    if let Some(m) = few.gpt.moe.as_mut() {
        m.experts = 2;
    }
    for e in refused(&[("ep", 4), ("pp", 2)], &few) {
        assert!(
            e.to_string()
                .contains("ep mesh dim has 4 ranks but there are only 2 experts"),
            "{e}"
        );
    }
    // A cp dim next to pp, and sequence parallelism inside the stages: not implemented.
    for e in refused(
        &[("cp", 2), ("pp", 2)],
        &cfg(Some(spec(ScheduleKind::GPipe, 2, 1))),
    ) {
        assert!(
            matches!(&e, RunError::Unsupported(m) if m.contains("\"cp\"")),
            "{e}"
        );
    }
    let mut c = cfg(Some(spec(ScheduleKind::GPipe, 2, 1)));
    c.plan = TpPlan::gpt(true);
    for e in refused(&[("tp", 2), ("pp", 2)], &c) {
        assert!(
            matches!(&e, RunError::Unsupported(m) if m.contains("sequence parallelism")),
            "{e}"
        );
    }
    // FSDP inside a pipeline shards over dp only: not HSDP, not over another dim.
    let mut c = cfg(Some(spec(ScheduleKind::GPipe, 2, 1)));
    c.fsdp = Some(common::fsdp_over("tp", Some("dp")));
    for e in refused(&[("dp", 2), ("tp", 2), ("pp", 2)], &c) {
        assert!(
            matches!(&e, RunError::Unsupported(m) if m.contains("HSDP")),
            "{e}"
        );
    }
    c.fsdp = Some(common::fsdp_over("tp", None));
    for e in refused(&[("tp", 2), ("pp", 2)], &c) {
        assert!(
            matches!(&e, RunError::Unsupported(m) if m.contains("FSDP over \"tp\"")),
            "{e}"
        );
    }
    // A pipeline setting without a pp dim.
    for e in refused(&[("dp", 2)], &cfg(Some(spec(ScheduleKind::GPipe, 2, 1)))) {
        assert!(
            matches!(&e, RunError::Config(m) if m.contains("pp mesh dim")),
            "{e}"
        );
    }
}

/// Checkpoints across pipeline sizes (issue 35, item 6): a run saved after step 2 on one
/// layout resumes on another and continues with the uninterrupted one-device run's losses:
/// pp=2 -> pp=4, pp=4 -> pp=2, pp=2 -> dp=2 (no pipeline), dp=2 -> pp=2 x dp=2, pp=2 ->
/// interleaved pp=2, tp=2 x pp=2 -> dp=2, pp=4 -> tp=2 x pp=2; untied and tied heads (the last stage's copy of the table is read back
/// from the first stage's).
#[test]
fn checkpoints_resume_across_pipeline_sizes() -> R<()> {
    let scratch = common::Scratch::new("pp_ckpt");
    type Layout = (&'static [(&'static str, usize)], Option<PipelineSpec>);
    let pp2: Layout = (&[("pp", 2)], Some(spec(ScheduleKind::OneFOneB, 4, 1)));
    let pp4: Layout = (&[("pp", 4)], Some(spec(ScheduleKind::GPipe, 4, 1)));
    let dp2: Layout = (&[("dp", 2)], None);
    let dp2pp2: Layout = (
        &[("dp", 2), ("pp", 2)],
        Some(spec(ScheduleKind::OneFOneB, 2, 1)),
    );
    let pp2v2: Layout = (
        &[("pp", 2)],
        Some(spec(ScheduleKind::Interleaved1F1B, 4, 2)),
    );
    let tp2pp2: Layout = (
        &[("tp", 2), ("pp", 2)],
        Some(spec(ScheduleKind::OneFOneB, 4, 1)),
    );
    // The V: with a tied head, rank 0 holds the table and the head's copy.
    let zbv: Layout = (&[("pp", 2)], Some(spec(ScheduleKind::ZeroBubbleV, 4, 2)));
    for tied in [false, true] {
        let base = |pipeline: Option<PipelineSpec>| {
            let mut c = cfg(pipeline);
            c.gpt.tied = tied;
            c
        };
        let want = run_all(&[("dp", 1)], &base(None)).remove(0)?.losses;
        assert_eq!(want.len(), STEPS);
        let cases = [
            (pp2.clone(), pp4.clone()),
            (pp4.clone(), pp2.clone()),
            (pp2.clone(), dp2.clone()),
            (dp2.clone(), dp2pp2.clone()),
            (pp2.clone(), pp2v2.clone()),
            (tp2pp2.clone(), dp2.clone()),
            (pp4.clone(), tp2pp2.clone()),
            (zbv.clone(), pp4.clone()),
            (dp2.clone(), zbv.clone()),
        ];
        for (i, ((sd, ss), (ld, ls))) in cases.into_iter().enumerate() {
            let what = format!("tied {tied}: saved on {sd:?}, resumed on {ld:?}");
            let dir = scratch.0.join(format!("{tied}-{i}"));
            let mut first = base(ss);
            first.steps = 2;
            first.save_dir = Some(dir.clone());
            first.save_every = 2;
            for r in run_all(sd, &first) {
                let r = r.map_err(|e| format!("{what}: first half: {e}"))?;
                assert_eq!(r.saved_steps, vec![2], "{what}");
                assert_close(&r.losses, &want[..2], 1e-5, &format!("{what}: first half"));
            }
            let mut second = base(ls);
            second.save_dir = Some(dir);
            second.resume = true;
            for r in run_all(ld, &second) {
                let r = r.map_err(|e| format!("{what}: resumed: {e}"))?;
                assert_eq!(r.start_step, 2, "{what}");
                assert_close(&r.losses, &want[2..], 1e-5, &format!("{what}: resumed"));
            }
        }
    }
    Ok(())
}

/// Tensor parallelism inside the stages (issue 35, item 3): every stage on its rank's `tp`
/// group with the GPT's plan (column/row-parallel blocks, vocab-parallel embedding, loss-parallel
/// head), tp=2 x pp=2 under GPipe, 1F1B, interleaved, ZB-H1 and ZB-V, dp=2 x tp=2 x pp=2
/// (1F1B, ZB-H1, ZB-V), tied and untied:
/// losses and global gradient norms (sharded parameters summed over tp, replicated ones once)
/// within 1e-5 of one device; clipping on.
#[test]
fn tensor_parallel_stages_match_one_device() -> R<()> {
    let train = |dims: &[(&str, usize)], c: &TrainConfig| -> R<Vec<(Vec<f32>, Vec<f64>)>> {
        let n: usize = dims.iter().map(|d| d.1).product();
        Ok(LocalWorld::new(n)
            .with_timeout(TIMEOUT)
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, dims)?;
                let mut norms = Vec::new();
                let r = train_rank(&mesh, c, |i| norms.push(i.grad_norm.unwrap_or(f64::NAN)))?;
                Ok((r.losses, norms))
            })?)
    };
    for tied in [false, true] {
        let base = |pipeline: Option<PipelineSpec>| {
            let mut c = cfg(pipeline);
            c.gpt.tied = tied;
            c.grad_norm_every = 1;
            c.clip = Some(0.5);
            c
        };
        let (want, want_norms) = train(&[("dp", 1)], &base(None))?.remove(0);
        let cases: [(&[(&str, usize)], PipelineSpec); 8] = [
            (&[("tp", 2), ("pp", 2)], spec(ScheduleKind::GPipe, 4, 1)),
            (
                &[("tp", 2), ("pp", 2)],
                spec(ScheduleKind::ZeroBubbleV, 4, 2),
            ),
            (
                &[("dp", 2), ("tp", 2), ("pp", 2)],
                spec(ScheduleKind::ZeroBubbleV, 2, 2),
            ),
            (
                &[("tp", 2), ("pp", 2)],
                spec(ScheduleKind::ZeroBubbleH1, 4, 1),
            ),
            (
                &[("dp", 2), ("tp", 2), ("pp", 2)],
                spec(ScheduleKind::ZeroBubbleH1, 2, 1),
            ),
            (&[("pp", 2), ("tp", 2)], spec(ScheduleKind::OneFOneB, 4, 1)),
            (
                &[("tp", 2), ("pp", 2)],
                spec(ScheduleKind::Interleaved1F1B, 4, 2),
            ),
            (
                &[("dp", 2), ("tp", 2), ("pp", 2)],
                spec(ScheduleKind::OneFOneB, 2, 1),
            ),
        ];
        for (dims, s) in cases {
            let what = format!("tied {tied} {dims:?} {}", s.schedule);
            for (losses, norms) in train(dims, &base(Some(s)))? {
                assert_close(&losses, &want, 1e-5, &what);
                let n: Vec<f32> = norms.iter().map(|&x| x as f32).collect();
                let w: Vec<f32> = want_norms.iter().map(|&x| x as f32).collect();
                assert_close(&n, &w, 1e-5, &format!("{what}: gradient norms"));
            }
        }
    }
    Ok(())
}

// === FSDP over dp composed with the pipeline (issue 35, item 3) ===

/// `c` with FSDP over `dp` (mixed precision: `param_dtype`).
fn with_fsdp(mut c: TrainConfig, param_dtype: Option<DType>) -> TrainConfig {
    let mut f = common::fsdp_over("dp", None);
    f.param_dtype = param_dtype;
    c.fsdp = Some(f);
    c
}

/// Every rank's losses and per-step gradient norms (and report) of training `c` on `dims`.
type Trained = Vec<(RankReport, Vec<f64>)>;

fn train_with_norms(dims: &[(&str, usize)], c: &TrainConfig) -> R<Trained> {
    let n: usize = dims.iter().map(|d| d.1).product();
    Ok(LocalWorld::new(n)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, dims)?;
            let mut norms = Vec::new();
            let r = train_rank(&mesh, c, |i| norms.push(i.grad_norm.unwrap_or(f64::NAN)))?;
            Ok((r, norms))
        })?)
}

/// The parameters after one step of `c` on `dims`, minus the one-device initial values: the
/// first AdamW update of every parameter, read back from the consolidated checkpoint (the
/// tied head's table once).
fn first_updates(
    dims: &[(&str, usize)],
    c: &TrainConfig,
    dir: &std::path::Path,
) -> R<std::collections::BTreeMap<String, candle_core::Tensor>> {
    use candle_dtensor_train::checkpoint::{consolidate, Which};
    let mut c = c.clone();
    c.steps = 1;
    c.save_dir = Some(dir.to_path_buf());
    for r in run_all(dims, &c) {
        assert_eq!(r?.saved_steps, vec![1]);
    }
    let file = dir.join("consolidated.safetensors");
    consolidate(dir, Which::Latest, &file)?;
    let after = candle_core::safetensors::load(&file, &candle_core::Device::Cpu)?;
    let initial = LocalWorld::new(1)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            let (_, store) = Gpt::new(&c.gpt, &mesh, &TpPlan::new(), c.seed, DType::F32)?;
            Ok(store
                .params()
                .iter()
                .map(|p| (p.name.clone(), p.var.as_tensor().clone()))
                .collect::<Vec<_>>())
        })?
        .remove(0);
    let mut out = std::collections::BTreeMap::new();
    for (name, init) in initial {
        let a = after
            .get(&name)
            .ok_or_else(|| format!("{dims:?}: {name} is not in the checkpoint"))?;
        out.insert(name, (a - init)?);
    }
    assert_eq!(out.len(), after.len(), "{dims:?}: checkpoint tensors");
    Ok(out)
}

/// A run whose first AdamW update is nearly proportional to the gradient (eps 1 above every
/// gradient element, no weight decay: `-lr g / (|g| + 1)`), so comparing the updates compares
/// the gradients element by element, scale included.
fn gradient_revealing(c: TrainConfig) -> TrainConfig {
    TrainConfig {
        eps: 1.0,
        lr: 1.0,
        weight_decay: 0.0,
        ..c
    }
}

/// FSDP over dp inside a pipeline: dp=2 x pp=2 under GPipe, 1F1B (an uneven stage split) and
/// interleaved 1F1B, dp=3 x pp=2 (most parameters' rows split unevenly, 6 sequences),
/// dp=2 x tp=2 x pp=2, tied and untied heads, an odd vocabulary (uneven token tables): losses
/// and global gradient norms within 1e-5 of one device at every step, every parameter's first
/// update (the gradient, see [`gradient_revealing`]) within 1e-4, and the shards hold the model
/// once over the data-parallel ranks.
#[test]
fn fsdp_stages_match_one_device() -> R<()> {
    let scratch = common::Scratch::new("pp_fsdp");
    let mut uneven = spec(ScheduleKind::OneFOneB, 4, 1);
    uneven.split = Some(vec![3, 1]);
    // (mesh, tied, vocab, batch, pipeline)
    type FCase = (
        &'static [(&'static str, usize)],
        bool,
        usize,
        usize,
        PipelineSpec,
    );
    let cases: [FCase; 9] = [
        // ZB-V with a tied head: the table and its copy are shards on one rank.
        (
            &[("dp", 2), ("pp", 2)],
            true,
            61,
            8,
            spec(ScheduleKind::ZeroBubbleV, 2, 2),
        ),
        // Zero bubble: the chunk's reduce_scatter after its last W.
        (
            &[("dp", 2), ("pp", 2)],
            true,
            61,
            8,
            spec(ScheduleKind::ZeroBubbleH1, 4, 1),
        ),
        (
            &[("dp", 2), ("tp", 2), ("pp", 2)],
            false,
            64,
            8,
            spec(ScheduleKind::ZeroBubbleH1, 2, 1),
        ),
        (
            &[("dp", 2), ("pp", 2)],
            false,
            61,
            8,
            spec(ScheduleKind::GPipe, 2, 1),
        ),
        (&[("dp", 2), ("pp", 2)], true, 61, 8, uneven),
        (
            &[("pp", 2), ("dp", 2)],
            false,
            64,
            8,
            spec(ScheduleKind::Interleaved1F1B, 2, 2),
        ),
        (
            &[("dp", 3), ("pp", 2)],
            false,
            61,
            6,
            spec(ScheduleKind::OneFOneB, 2, 1),
        ),
        (
            &[("dp", 2), ("tp", 2), ("pp", 2)],
            false,
            64,
            8,
            spec(ScheduleKind::OneFOneB, 2, 1),
        ),
        (
            &[("dp", 2), ("tp", 2), ("pp", 2)],
            true,
            64,
            8,
            spec(ScheduleKind::GPipe, 4, 1),
        ),
    ];
    for (i, (dims, tied, vocab, batch, s)) in cases.into_iter().enumerate() {
        let what = format!(
            "FSDP {dims:?} tied {tied} vocab {vocab} batch {batch} {} m={} v={} split {:?}",
            s.schedule, s.micro_batches, s.chunks, s.split
        );
        let base = |pipeline: Option<PipelineSpec>| {
            let mut c = cfg(pipeline);
            c.gpt.tied = tied;
            c.gpt.vocab = vocab;
            c.batch = batch;
            c.grad_norm_every = 1;
            c
        };
        let one = train_with_norms(&[("dp", 1)], &base(None))?.remove(0);
        let (want, want_norms) = (one.0.losses, one.1);
        assert!(want[STEPS - 1] < want[0], "{what}: {want:?}");
        let c = with_fsdp(base(Some(s.clone())), None);
        let mut held = 0;
        for (r, norms) in train_with_norms(dims, &c)? {
            assert_close(&r.losses, &want, 1e-5, &what);
            let n: Vec<f32> = norms.iter().map(|&x| x as f32).collect();
            let w: Vec<f32> = want_norms.iter().map(|&x| x as f32).collect();
            assert_close(&n, &w, 1e-5, &format!("{what}: gradient norms"));
            held += r.param_bytes;
        }
        // The shards of the stages: the model once over the data-parallel ranks (without tp,
        // whose replicated parameters are copies, and without the tied head's copy).
        if !tied && !dims.iter().any(|d| d.0 == "tp") {
            assert_eq!(
                held, one.0.param_bytes,
                "{what}: shard bytes over the ranks"
            );
        }
        let dir = scratch.0.join(format!("{i}"));
        let got = first_updates(dims, &gradient_revealing(c), &dir.join("pp"))?;
        let reference = first_updates(
            &[("dp", 1)],
            &gradient_revealing(base(None)),
            &dir.join("one"),
        )?;
        for (name, want) in &reference {
            let d = candle_dtensor_kernels::compare::max_rel_diff(&got[name], want)?;
            // NaN fails too.
            assert!(
                d <= 1e-4,
                "{what}: the first update of {name} differs by {d}"
            );
        }
    }
    Ok(())
}

/// Zero bubble without FSDP (issue 35, item 2): ZB-H1 on pp=2 (untied), pp=4 (tied: the
/// head's copy of the token table takes its dW in W, the embedding's gradient in B),
/// tp=2 x pp=2 (tied), pp=2 with every block checkpointed, and ZB-V on pp=2 (tied: both tables
/// on rank 0) and tp=2 x pp=2: every parameter's first update (the gradient, see
/// [`gradient_revealing`]) within 1e-4 of one device, so no weight gradient is lost, doubled
/// or left in B's zeros.
#[test]
fn zero_bubble_gradients_match_one_device() -> R<()> {
    let scratch = common::Scratch::new("pp_zb");
    /// (mesh, tied head, micro-batches, activation checkpointing, schedule)
    type ZbCase = (
        &'static [(&'static str, usize)],
        bool,
        usize,
        AcMode,
        ScheduleKind,
    );
    let zbh1 = ScheduleKind::ZeroBubbleH1;
    let cases: [ZbCase; 6] = [
        // ZB-V: the V's turn on rank p - 1, both tables on rank 0.
        (
            &[("pp", 2)],
            true,
            4,
            AcMode::None,
            ScheduleKind::ZeroBubbleV,
        ),
        (
            &[("tp", 2), ("pp", 2)],
            false,
            2,
            AcMode::None,
            ScheduleKind::ZeroBubbleV,
        ),
        (&[("pp", 2)], false, 4, AcMode::None, zbh1),
        (&[("pp", 4)], true, 4, AcMode::None, zbh1),
        (&[("tp", 2), ("pp", 2)], true, 2, AcMode::None, zbh1),
        // Checkpointed blocks: the recompute's backward (inside B) defers its dW too.
        (&[("pp", 2)], false, 2, AcMode::Full, zbh1),
    ];
    for (i, (dims, tied, m, ac, kind)) in cases.into_iter().enumerate() {
        let what = format!("{kind} {dims:?} tied {tied} m={m} --ac {}", ac.name());
        let v = if kind == ScheduleKind::ZeroBubbleV {
            2
        } else {
            1
        };
        let base = |pipeline: Option<PipelineSpec>| {
            let mut c = cfg(pipeline);
            c.gpt.tied = tied;
            c.gpt.ac = ac;
            gradient_revealing(c)
        };
        let dir = scratch.0.join(format!("{i}"));
        let got = first_updates(dims, &base(Some(spec(kind, m, v))), &dir.join("pp"))?;
        let reference = first_updates(&[("dp", 1)], &base(None), &dir.join("one"))?;
        for (name, want) in &reference {
            let d = candle_dtensor_kernels::compare::max_rel_diff(&got[name], want)?;
            // NaN fails too.
            assert!(
                d <= 1e-4,
                "{what}: the first update of {name} differs by {d}"
            );
        }
    }
    Ok(())
}

/// FSDP's collectives inside a pipeline, counted in the last step: one all_gather (at the
/// step's start) and one reduce_scatter (after the chunk's last backward) per chunk of a rank,
/// whatever the number of micro-batches (also with the reduce_scatters on their own
/// communicator, which changes no loss); none without FSDP.
#[test]
fn fsdp_reduces_once_per_step_per_stage() -> R<()> {
    let want = run_all(&[("dp", 1)], &cfg(None)).remove(0)?.losses;
    // (pipeline, FSDP, separate reduce-scatter communicator, collectives per step)
    let cases = [
        (spec(ScheduleKind::GPipe, 2, 1), true, false, 1),
        (spec(ScheduleKind::GPipe, 4, 1), true, false, 1),
        (spec(ScheduleKind::OneFOneB, 4, 1), true, false, 1),
        (spec(ScheduleKind::OneFOneB, 4, 1), true, true, 1),
        (spec(ScheduleKind::Interleaved1F1B, 2, 2), true, false, 2),
        (spec(ScheduleKind::Interleaved1F1B, 4, 2), true, false, 2),
        (spec(ScheduleKind::ZeroBubbleH1, 4, 1), true, false, 1),
        (spec(ScheduleKind::ZeroBubbleV, 4, 2), true, false, 2),
        (spec(ScheduleKind::OneFOneB, 4, 1), false, false, 0),
    ];
    for (s, fsdp, separate_rs, per_step) in cases {
        let what = format!(
            "dp=2 x pp=2 {} m={} v={} fsdp {fsdp} separate rs {separate_rs}",
            s.schedule, s.micro_batches, s.chunks
        );
        let mut c = cfg(Some(s));
        if fsdp {
            c = with_fsdp(c, None);
        }
        if let Some(f) = c.fsdp.as_mut() {
            f.separate_rs = separate_rs;
        }
        for r in run_all(&[("dp", 2), ("pp", 2)], &c) {
            let r = r?;
            assert_close(&r.losses, &want, 1e-5, &what);
            let count = |kind: &str, phase: &str| {
                r.collectives
                    .get(kind)
                    .and_then(|m| m.get(phase))
                    .copied()
                    .unwrap_or(0)
            };
            let got = [
                count("all_gather", "forward"),
                count("all_gather", "backward"),
                count("reduce_scatter", "forward"),
                count("reduce_scatter", "backward"),
            ];
            assert_eq!(
                got,
                [per_step, 0, 0, per_step],
                "{what}: {:?}",
                r.collectives
            );
        }
    }
    Ok(())
}

/// Checkpoints of FSDP inside a pipeline (issue 35, items 3 and 6): a run saved after step 2
/// on FSDP dp=2 x pp=2 resumes on FSDP dp=2 without a pipeline, on pp=4 and on plain
/// dp=2 x pp=2; FSDP dp=2 and pp=4 runs resume on FSDP dp=2 x pp=2 (interleaved too);
/// FSDP dp=2 x tp=2 x pp=2 resumes on FSDP dp=2 x pp=2: each with the uninterrupted one-device
/// run's losses, tied and untied heads.
#[test]
fn fsdp_checkpoints_resume_across_layouts() -> R<()> {
    let scratch = common::Scratch::new("pp_fsdp_ckpt");
    // (mesh, pipeline, FSDP)
    type Layout = (&'static [(&'static str, usize)], Option<PipelineSpec>, bool);
    let fsdp_dp2pp2: Layout = (
        &[("dp", 2), ("pp", 2)],
        Some(spec(ScheduleKind::OneFOneB, 2, 1)),
        true,
    );
    let fsdp_dp2pp2_v2: Layout = (
        &[("dp", 2), ("pp", 2)],
        Some(spec(ScheduleKind::Interleaved1F1B, 2, 2)),
        true,
    );
    let fsdp_dp2: Layout = (&[("dp", 2)], None, true);
    let pp4: Layout = (&[("pp", 4)], Some(spec(ScheduleKind::GPipe, 4, 1)), false);
    let dp2pp2: Layout = (
        &[("dp", 2), ("pp", 2)],
        Some(spec(ScheduleKind::GPipe, 2, 1)),
        false,
    );
    let fsdp_dp2tp2pp2: Layout = (
        &[("dp", 2), ("tp", 2), ("pp", 2)],
        Some(spec(ScheduleKind::OneFOneB, 2, 1)),
        true,
    );
    for tied in [false, true] {
        let base = |pipeline: Option<PipelineSpec>, fsdp: bool| {
            let mut c = cfg(pipeline);
            c.gpt.tied = tied;
            if fsdp {
                c = with_fsdp(c, None);
            }
            c
        };
        let want = run_all(&[("dp", 1)], &base(None, false)).remove(0)?.losses;
        assert_eq!(want.len(), STEPS);
        let cases = [
            (fsdp_dp2pp2.clone(), fsdp_dp2.clone()),
            (fsdp_dp2pp2.clone(), pp4.clone()),
            (fsdp_dp2pp2.clone(), dp2pp2.clone()),
            (fsdp_dp2.clone(), fsdp_dp2pp2.clone()),
            (pp4.clone(), fsdp_dp2pp2_v2.clone()),
            (fsdp_dp2tp2pp2.clone(), fsdp_dp2pp2.clone()),
        ];
        for (i, ((sd, ss, sf), (ld, ls, lf))) in cases.into_iter().enumerate() {
            let what =
                format!("tied {tied}: saved on {sd:?} fsdp {sf}, resumed on {ld:?} fsdp {lf}");
            let dir = scratch.0.join(format!("{tied}-{i}"));
            let mut first = base(ss, sf);
            first.steps = 2;
            first.save_dir = Some(dir.clone());
            first.save_every = 2;
            for r in run_all(sd, &first) {
                let r = r.map_err(|e| format!("{what}: first half: {e}"))?;
                assert_eq!(r.saved_steps, vec![2], "{what}");
                assert_close(&r.losses, &want[..2], 1e-5, &format!("{what}: first half"));
            }
            let mut second = base(ls, lf);
            second.save_dir = Some(dir);
            second.resume = true;
            for r in run_all(ld, &second) {
                let r = r.map_err(|e| format!("{what}: resumed: {e}"))?;
                assert_eq!(r.start_step, 2, "{what}");
                assert_close(&r.losses, &want[2..], 1e-5, &format!("{what}: resumed"));
            }
        }
    }
    Ok(())
}

/// FSDP's mixed precision inside a pipeline: the stages compute in bf16 (their full
/// parameters and the hidden states between stages) from f32 master shards. dp=2 x pp=2
/// (1F1B, ZB-H1, and tp=2 inside the stages) follows one device's FSDP bf16 run within 5e-5 relative
/// (micro-batching changes bf16 rounding only), closer than the f32 run is (about 1.2e-4
/// away: bf16 is in effect).
#[test]
fn fsdp_mixed_precision_stages_match_one_device() -> R<()> {
    let bf16 = |pipeline: Option<PipelineSpec>| with_fsdp(cfg(pipeline), Some(DType::BF16));
    let want = run_all(&[("dp", 1)], &bf16(None)).remove(0)?.losses;
    let f32_losses = run_all(&[("dp", 1)], &cfg(None)).remove(0)?.losses;
    let worst = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from((x - y).abs() / y.abs()))
            .fold(0.0, candle_dtensor_kernels::compare::nan_max)
    };
    let cases: [(&[(&str, usize)], PipelineSpec); 3] = [
        (&[("dp", 2), ("pp", 2)], spec(ScheduleKind::OneFOneB, 2, 1)),
        (
            &[("dp", 2), ("tp", 2), ("pp", 2)],
            spec(ScheduleKind::GPipe, 2, 1),
        ),
        // Zero bubble: the linears saw cast parameters, so W's dW reaches each bf16
        // parameter through its cast.
        (
            &[("dp", 2), ("pp", 2)],
            spec(ScheduleKind::ZeroBubbleH1, 2, 1),
        ),
    ];
    for (dims, s) in cases {
        let what = format!("bf16 {dims:?} {}", s.schedule);
        for r in run_all(dims, &bf16(Some(s))) {
            let r = r?;
            assert_close(&r.losses, &want, 5e-5, &what);
            let (to_bf16, to_f32) = (worst(&r.losses, &want), worst(&r.losses, &f32_losses));
            assert!(
                to_bf16 < to_f32,
                "{what}: {to_bf16} from one device's bf16 run, {to_f32} from its f32 run"
            );
        }
    }
    Ok(())
}

// === Mixture-of-experts blocks in the stages, experts over ep (issue 35, item 3) ===

/// The 4-block micro GPT with mixture-of-experts blocks 1 and 3 (top-2 of 4 experts,
/// dropless, balancing loss 0.05), batches of 8, `micro_batches` micro-batches per step: a
/// pipelined run over `pipeline`, or (`None`) the layout without a pipeline accumulating the
/// same micro-batches (the balancing loss is per micro-batch, over all its tokens, there too).
fn moe_cfg(pipeline: Option<PipelineSpec>, micro_batches: usize) -> TrainConfig {
    let mut c = cfg(pipeline.clone());
    let mut m = candle_dtensor_parallel::MoeConfig::new(4, 2);
    m.every = 2;
    m.aux_loss_coef = 0.05;
    c.gpt.moe = Some(m);
    c.grad_norm_every = 1;
    if pipeline.is_none() {
        c.grad_accum = micro_batches;
    }
    c
}

/// MoE blocks inside the stages (issue 35, item 3): pp=2 (every expert on each stage's rank),
/// ep=2 x pp=2 (experts sharded over ep, tokens dispatched over the stage's ep group) under
/// GPipe, 1F1B and interleaved 1F1B, ep and pp in either order, dp=2 x ep=2 x pp=2 with plain
/// dp and with FSDP over dp, a tied head on ep=2 x pp=2: losses (the balancing loss included)
/// and global gradient norms within 1e-5 of one device accumulating the same micro-batches,
/// and every parameter's first update (the gradient, see [`gradient_revealing`]) within 1e-4,
/// experts included; the step's balancing loss is reported.
#[test]
fn moe_stages_match_one_device() -> R<()> {
    let scratch = common::Scratch::new("pp_moe");
    // (mesh, pipeline, FSDP over dp, tied head)
    type MCase = (&'static [(&'static str, usize)], PipelineSpec, bool, bool);
    let cases: [MCase; 8] = [
        (&[("pp", 2)], spec(ScheduleKind::GPipe, 4, 1), false, false),
        (
            &[("pp", 2)],
            spec(ScheduleKind::OneFOneB, 2, 1),
            false,
            false,
        ),
        (
            &[("ep", 2), ("pp", 2)],
            spec(ScheduleKind::OneFOneB, 4, 1),
            false,
            false,
        ),
        (
            &[("pp", 2), ("ep", 2)],
            spec(ScheduleKind::GPipe, 2, 1),
            false,
            false,
        ),
        (
            &[("ep", 2), ("pp", 2)],
            spec(ScheduleKind::Interleaved1F1B, 2, 2),
            false,
            false,
        ),
        (
            &[("dp", 2), ("ep", 2), ("pp", 2)],
            spec(ScheduleKind::OneFOneB, 2, 1),
            false,
            false,
        ),
        (
            &[("dp", 2), ("ep", 2), ("pp", 2)],
            spec(ScheduleKind::GPipe, 2, 1),
            true,
            false,
        ),
        (
            &[("ep", 2), ("pp", 2)],
            spec(ScheduleKind::OneFOneB, 2, 1),
            false,
            true,
        ),
    ];
    let mut references = std::collections::HashMap::new();
    for (i, (dims, s, fsdp, tied)) in cases.into_iter().enumerate() {
        let m = s.micro_batches;
        let what = format!(
            "MoE {dims:?} {} m={m} v={} fsdp {fsdp} tied {tied}",
            s.schedule, s.chunks
        );
        let base = |pipeline: Option<PipelineSpec>| {
            let mut c = moe_cfg(pipeline, m);
            c.gpt.tied = tied;
            c
        };
        if let std::collections::hash_map::Entry::Vacant(slot) = references.entry((m, tied)) {
            let one = train_with_norms(&[("dp", 1)], &base(None))?.remove(0);
            assert!(
                one.0.losses[STEPS - 1] < one.0.losses[0],
                "{:?}",
                one.0.losses
            );
            let aux: Vec<f32> = one.0.moe.iter().map(|s| s.aux_loss).collect();
            assert!(aux.iter().all(|&a| a > 0.0), "{aux:?}");
            let updates = first_updates(
                &[("dp", 1)],
                &gradient_revealing(base(None)),
                &scratch.0.join(format!("one-{m}-{tied}")),
            )?;
            slot.insert((one.0.losses, one.1, one.0.params, updates));
        }
        let (want, want_norms, params, reference) = &references[&(m, tied)];
        let mut c = base(Some(s));
        if fsdp {
            c = with_fsdp(c, None);
        }
        for (r, norms) in train_with_norms(dims, &c)? {
            assert_close(&r.losses, want, 1e-5, &what);
            let n: Vec<f32> = norms.iter().map(|&x| x as f32).collect();
            let w: Vec<f32> = want_norms.iter().map(|&x| x as f32).collect();
            assert_close(&n, &w, 1e-5, &format!("{what}: gradient norms"));
            // The whole model's parameter count (every expert once).
            assert_eq!(r.params, *params, "{what}");
            assert_eq!(r.moe.len(), STEPS, "{what}");
            assert!(
                r.moe.iter().all(|s| s.aux_loss > 0.0),
                "{what}: {:?}",
                r.moe
            );
        }
        let got = first_updates(
            dims,
            &gradient_revealing(c),
            &scratch.0.join(format!("{i}")),
        )?;
        assert!(
            reference.keys().any(|k| k.contains(".moe.experts.")),
            "{what}: no expert parameter compared"
        );
        for (name, want) in reference {
            let d = candle_dtensor_kernels::compare::max_rel_diff(&got[name], want)?;
            // NaN fails too.
            assert!(
                d <= 1e-4,
                "{what}: the first update of {name} differs by {d}"
            );
        }
    }
    Ok(())
}

/// Checkpoints of MoE stages (issue 35, items 3 and 6): a run saved after step 2 on
/// ep=2 x pp=2 resumes on ep=2 without a pipeline (accumulating the same micro-batches), and
/// back; dp=2 x ep=2 x pp=2 resumes on pp=2: each with the uninterrupted one-device run's
/// losses (the experts' shards written under their one-device names).
#[test]
fn moe_checkpoints_resume_across_layouts() -> R<()> {
    let scratch = common::Scratch::new("pp_moe_ckpt");
    type Layout = (&'static [(&'static str, usize)], Option<PipelineSpec>);
    let ep2pp2: Layout = (
        &[("ep", 2), ("pp", 2)],
        Some(spec(ScheduleKind::OneFOneB, 2, 1)),
    );
    let ep2: Layout = (&[("ep", 2)], None);
    let dp2ep2pp2: Layout = (
        &[("dp", 2), ("ep", 2), ("pp", 2)],
        Some(spec(ScheduleKind::GPipe, 2, 1)),
    );
    let pp2: Layout = (&[("pp", 2)], Some(spec(ScheduleKind::GPipe, 2, 1)));
    let want = run_all(&[("dp", 1)], &moe_cfg(None, 2)).remove(0)?.losses;
    let cases = [
        (ep2pp2.clone(), ep2.clone()),
        (ep2, ep2pp2),
        (dp2ep2pp2, pp2),
    ];
    for (i, ((sd, ss), (ld, ls))) in cases.into_iter().enumerate() {
        let what = format!("MoE saved on {sd:?}, resumed on {ld:?}");
        let dir = scratch.0.join(format!("{i}"));
        let mut first = moe_cfg(ss, 2);
        first.steps = 2;
        first.save_dir = Some(dir.clone());
        first.save_every = 2;
        for r in run_all(sd, &first) {
            let r = r.map_err(|e| format!("{what}: first half: {e}"))?;
            assert_eq!(r.saved_steps, vec![2], "{what}");
            assert_close(&r.losses, &want[..2], 1e-5, &format!("{what}: first half"));
        }
        let mut second = moe_cfg(ls, 2);
        second.save_dir = Some(dir);
        second.resume = true;
        for r in run_all(ld, &second) {
            let r = r.map_err(|e| format!("{what}: resumed: {e}"))?;
            assert_eq!(r.start_step, 2, "{what}");
            assert_close(&r.losses, &want[2..], 1e-5, &format!("{what}: resumed"));
        }
    }
    Ok(())
}

/// MoE stages hold the one-device model's parameters (same names, same values, every one once,
/// also with SwiGLU experts of their own hidden size), `GptStage::new` without the MoE
/// communicators refuses a stage holding an MoE block, and the per-block parameter counts
/// that balance the split are the model's.
#[test]
fn moe_stage_parameters_and_counts_equal_the_one_device_models() -> R<()> {
    let out = LocalWorld::new(1)
        .with_timeout(TIMEOUT)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, &[("dp", 1)])?;
            for swiglu in [false, true] {
                let mut cfg = moe_cfg(None, 1).gpt;
                cfg.swiglu = swiglu;
                if swiglu {
                    if let Some(m) = cfg.moe.as_mut() {
                        m.hidden = Some(48);
                    }
                }
                let m = cfg.moe.clone().ok_or("no MoE")?;
                let (_, full) = Gpt::new(&cfg, &mesh, &TpPlan::new(), 11, DType::F32)?;
                let hidden = m.expert_hidden(cfg.mlp_ratio * cfg.d_model);
                let groups =
                    candle_dtensor_parallel::MoeGroups::new(&mesh, &m, cfg.d_model, hidden)?;
                let mut store = ParamStore::new(&mesh, 11, DType::F32);
                for (s, r) in [(0, 0..1), (1, 1..3), (2, 3..4)] {
                    GptStage::with_moe(
                        &cfg,
                        &mesh,
                        &TpPlan::new(),
                        s,
                        3,
                        r,
                        &mut store,
                        Some(&groups),
                    )?;
                }
                for p in store.params() {
                    let q = full
                        .params()
                        .iter()
                        .find(|q| q.name == p.name)
                        .ok_or_else(|| format!("{} is not a parameter of the model", p.name))?;
                    let d = (p.var.as_tensor() - q.var.as_tensor())?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    if d != 0.0 {
                        return Err(format!("swiglu {swiglu}: {} differs by {d}", p.name).into());
                    }
                }
                assert_eq!(store.params().len(), full.params().len(), "swiglu {swiglu}");
                // Per block: the model's parameters named blocks.{i}.
                let counts = GptStage::block_param_counts(&cfg, &mesh)?;
                for (i, &c) in counts.iter().enumerate() {
                    let want: usize = full
                        .params()
                        .iter()
                        .filter(|p| p.name.starts_with(&format!("blocks.{i}.")))
                        .map(|p| p.tensor.shape().iter().product::<usize>())
                        .sum();
                    assert_eq!(c, want, "swiglu {swiglu}: block {i}");
                }
                assert!(counts[1] > counts[0], "{counts:?}");
                // Without the communicators a stage with an MoE block is refused.
                let mut scratch = ParamStore::new(&mesh, 11, DType::F32);
                match GptStage::new(&cfg, &mesh, &TpPlan::new(), 0, 2, 0..2, &mut scratch) {
                    Err(e) => assert!(e.to_string().contains("MoE groups"), "{e}"),
                    Ok(_) => return Err("a stage with an MoE block built without groups".into()),
                }
            }
            Ok(())
        })?;
    assert_eq!(out.len(), 1);
    Ok(())
}

/// Activation checkpointing inside MoE stages (the policy counts dense blocks only, as the
/// one-device model's): ep=2 x pp=2 under `full` and `selective` gives the one-device losses
/// under the same policy (which equal the run without checkpointing), and keeps less for
/// backward: `full` on every rank, `selective` on the second stage, whose dense block 2 is the
/// model's second dense block (by the global index it would be an even block: kept whole).
#[test]
fn moe_stages_with_activation_checkpointing_match_one_device() -> R<()> {
    let want = run_all(&[("dp", 1)], &moe_cfg(None, 2)).remove(0)?.losses;
    let peaks = |ac: AcMode| -> R<Vec<(usize, usize)>> {
        let mut one = moe_cfg(None, 2);
        one.gpt.ac = ac;
        let one = run_all(&[("dp", 1)], &one).remove(0)?.losses;
        assert_close(&one, &want, 1e-5, &format!("one device {ac:?}"));
        let mut c = moe_cfg(Some(spec(ScheduleKind::OneFOneB, 2, 1)), 2);
        c.gpt.ac = ac;
        let mut out = Vec::new();
        for r in run_all(&[("ep", 2), ("pp", 2)], &c) {
            let r = r?;
            assert_close(&r.losses, &want, 1e-5, &format!("ep=2 x pp=2 {ac:?}"));
            out.push((r.rank, r.peak_activation_bytes));
        }
        out.sort();
        Ok(out)
    };
    let none = peaks(AcMode::None)?;
    let full = peaks(AcMode::Full)?;
    let selective = peaks(AcMode::Selective)?;
    for i in 0..none.len() {
        let (rank, kept) = none[i];
        assert!(full[i].1 < kept, "rank {rank}: full {full:?} none {none:?}");
        // Mesh ep=2 x pp=2: odd ranks hold the second stage (blocks 2 and 3).
        if rank % 2 == 1 {
            assert!(
                selective[i].1 < kept,
                "rank {rank}: selective {selective:?} none {none:?}"
            );
        }
    }
    Ok(())
}

/// Capacity drops and uneven experts inside the stages: 3 experts over ep=2 (torch.chunk: 2
/// and 1), top-1, every block MoE, capacity factor 1 (assignments dropped: the admission spans
/// every data-parallel rank of the micro-batch, as one device's micro-batch), dp=2 x ep=2 x
/// pp=2 with FSDP over dp under interleaved 1F1B: the one-device losses (accumulating the
/// same micro-batches) within 1e-5, and the same drops.
#[test]
fn moe_stages_with_capacity_and_uneven_experts_match_one_device() -> R<()> {
    let with = |pipeline: Option<PipelineSpec>| {
        let mut c = moe_cfg(pipeline, 2);
        if let Some(m) = c.gpt.moe.as_mut() {
            m.experts = 3;
            m.top_k = 1;
            m.every = 1;
            m.capacity_factor = Some(1.0);
        }
        c
    };
    let one = run_all(&[("dp", 1)], &with(None)).remove(0)?;
    let dropped: Vec<usize> = one.moe.iter().map(|s| s.dropped).collect();
    assert!(dropped.iter().all(|&d| d > 0), "{dropped:?}");
    let c = with_fsdp(with(Some(spec(ScheduleKind::Interleaved1F1B, 2, 2))), None);
    for r in run_all(&[("dp", 2), ("ep", 2), ("pp", 2)], &c) {
        let r = r?;
        assert_close(
            &r.losses,
            &one.losses,
            1e-5,
            "capacity, 3 experts over ep=2",
        );
        let got: Vec<usize> = r.moe.iter().map(|s| s.dropped).collect();
        assert_eq!(got, dropped, "rank {}: dropped assignments", r.rank);
    }
    Ok(())
}
