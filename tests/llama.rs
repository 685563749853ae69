//! Llamas under FSDP against one device, as `examples/train_llama.rs` trains them:
//! - a llama written with candle-nn and `candle_dtensor::nn`'s drop-ins: every parameter's
//!   gradient, every step, within 1e-5 of one device, under FSDP (per-layer units) and under
//!   FSDP over dp x TP;
//! - candle-transformers' unmodified llama: the parameters with a gradient are exactly those
//!   one device gives one (lm_head: candle-nn's fused ops cut the rest), its gradient and the
//!   losses within 1e-5, and `params_without_grad` names the cut ones;
//! - the check itself (`llama::verdict`, what `train_llama --check` exits by): a NaN loss, a
//!   NaN gradient, a loss or gradient past its tolerance and a run that stopped early, each
//!   planted in a copy of a real report, fail it, naming the step and parameter.
#[path = "../examples/common/llama.rs"]
mod llama;

use std::time::Duration;

use candle_dtensor::comm::LocalWorld;
use candle_dtensor::kernels::compare::Mismatch;
use candle_dtensor::mesh::DeviceMesh;
use llama::{Arch, CheckFailure, Plant, Report, Run, Sizes, Tolerances};

/// The tests' tolerances: every loss and every step's gradient within 1e-5.
const TOL: Tolerances = Tolerances {
    loss: 1e-5,
    first_grad: 1e-5,
    any_grad: 1e-5,
};

fn run(arch: Arch, steps: usize) -> Run {
    Run {
        arch,
        sizes: Sizes::tiny(),
        steps,
        batch: 4,
        seq: 8,
        lr: 3e-3,
        seed: 3,
        keep_grads: true,
    }
}

fn on_mesh(dims: &[(&str, usize)], run: &Run) -> Vec<Report> {
    let n = dims.iter().map(|(_, s)| s).product();
    LocalWorld::new(n)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| -> Result<Report, llama::BoxErr> {
            let mesh = DeviceMesh::new(comm, dims)?;
            llama::train_rank(&mesh, run)
        })
        .unwrap()
}

fn all_params(r: &Report) -> Vec<String> {
    r.params.clone()
}

#[test]
fn own_llama_under_fsdp_and_fsdp_x_tp_matches_one_device_in_every_gradient() {
    let run = run(Arch::Own, 3);
    let reference = llama::train_one_device(&run).unwrap();
    // 2 blocks x 9 parameters + embedding, final norm, head.
    assert_eq!(reference.params.len(), 21);
    for g in &reference.grads {
        assert_eq!(g.len(), 21, "one device: every parameter has a gradient");
    }
    for dims in [vec![("dp", 2)], vec![("dp", 2), ("tp", 2)]] {
        let reports = on_mesh(&dims, &run);
        for (rank, r) in reports.iter().enumerate() {
            let what = format!("{dims:?} rank {rank}");
            let c = llama::compare(&reference, r).unwrap_or_else(|e| panic!("{what}: {e}"));
            let failures: Vec<String> = c.failures(&TOL).iter().map(|f| f.to_string()).collect();
            assert!(failures.is_empty(), "{what}: {failures:?}");
            assert_eq!(c.compared, all_params(&reference), "{what}");
            assert_eq!(c.loss.len, 3, "{what}: every step's loss compared");
            assert!(c.any_grad.is_some(), "{what}: gradients compared");
            assert!(r.without_grad.is_empty(), "{what}: {:?}", r.without_grad);
            assert_eq!(
                r.units,
                ["root", "model.layers.0", "model.layers.1"],
                "{what}"
            );
            if dims.len() == 2 {
                // Tensor-parallel pieces: the q projection by heads, the head by vocab rows.
                assert_eq!(
                    r.pieces["model.layers.0.self_attn.q_proj.weight"][0].len(),
                    16
                );
                assert_eq!(r.pieces["lm_head.weight"][0].len(), 32);
            }
        }
    }
}

#[test]
fn candle_transformers_llama_under_fsdp_has_exactly_one_devices_gradients() {
    let run = run(Arch::Transformers, 3);
    let reference = llama::train_one_device(&run).unwrap();
    assert_eq!(reference.params.len(), 21);
    for g in &reference.grads {
        let names: Vec<&String> = g.keys().collect();
        assert_eq!(
            names,
            ["lm_head.weight"],
            "candle-nn's fused ops cut the rest"
        );
    }
    let reports = on_mesh(&[("dp", 2)], &run);
    let cut: Vec<String> = reference
        .params
        .iter()
        .filter(|p| *p != "lm_head.weight")
        .cloned()
        .collect();
    for (rank, r) in reports.iter().enumerate() {
        let c = llama::compare(&reference, r).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let failures: Vec<String> = c.failures(&TOL).iter().map(|f| f.to_string()).collect();
        assert!(failures.is_empty(), "rank {rank}: {failures:?}");
        assert_eq!(c.compared, ["lm_head.weight"], "rank {rank}");
        assert_eq!(
            c.any_grad.as_ref().map(|d| d.param.as_str()),
            Some("lm_head.weight"),
            "rank {rank}"
        );
        assert_eq!(
            r.without_grad, cut,
            "rank {rank}: the cut parameters are named"
        );
        assert_eq!(r.without_grad.len(), 20);
    }
}

/// The failures of a verdict, as messages with their rank.
fn messages(v: &llama::Verdict) -> Vec<String> {
    v.failures
        .iter()
        .map(|(rank, f)| format!("rank {rank:?}: {f}"))
        .collect()
}

#[test]
fn planted_nan_mismatch_and_short_run_fail_the_check() {
    let run = run(Arch::Own, 2);
    let reference = llama::train_one_device(&run).unwrap();
    let reports = on_mesh(&[("dp", 2)], &run);
    let tol = Tolerances::TRAIN_LLAMA;
    // The real run passes, so each failure below is its plant's.
    let v = llama::verdict(&reference, &reports, &tol);
    assert!(v.passed(), "{:?}", messages(&v));
    assert_eq!(v.comparisons.len(), 2);
    let last = run.steps - 1;
    for plant in Plant::ALL {
        let mut planted = reports.clone();
        plant.apply(&mut planted[1]).unwrap();
        let v = llama::verdict(&reference, &planted, &tol);
        let all = messages(&v);
        assert!(!v.passed(), "{plant:?} passed the check");
        // Only the planted rank fails.
        assert!(
            v.failures.iter().all(|(rank, _)| *rank == Some(1)),
            "{plant:?}: {all:?}"
        );
        let f = &v.failures[0].1;
        let ok = match plant {
            Plant::NanLoss => matches!(
                f,
                CheckFailure::Loss(Mismatch::NonFinite { index, got, .. })
                    if *index == last && got.is_nan()
            ),
            Plant::Loss => matches!(
                f,
                CheckFailure::Loss(Mismatch::Tolerance { index, rel, .. })
                    if *index == last && (rel - 1e-3).abs() < 1e-4
            ),
            Plant::Short => matches!(
                f,
                CheckFailure::Loss(Mismatch::Length {
                    got: 1,
                    want: 2,
                    ..
                })
            ),
            Plant::NanGrad => matches!(
                f,
                CheckFailure::GradNonFinite { step, side: "this rank's", .. } if *step == last
            ),
            Plant::Grad => matches!(
                f,
                CheckFailure::GradTolerance { diff, first_step: false, .. }
                    if diff.step == last && diff.rel > 1e-3
            ),
        };
        assert!(ok, "{plant:?}: {all:?}");
        assert_eq!(v.failures.len(), 1, "{plant:?}: {all:?}");
        // The message names the step (and for a gradient, the parameter).
        let msg = f.to_string();
        match plant {
            Plant::NanGrad | Plant::Grad => {
                assert!(msg.contains(&format!("step {last}, parameter ")), "{msg}")
            }
            Plant::Short => assert!(msg.contains("1 values, but the reference has 2"), "{msg}"),
            _ => assert!(msg.contains(&format!("element {last}")), "{msg}"),
        }
    }
    // One device's own NaN fails the check: a reference that diverged is no reference. Its
    // NaN loss fails every rank; its NaN gradient (element 0) the rank whose shard holds it.
    let mut bad = reference.clone();
    Plant::NanLoss.apply(&mut bad).unwrap();
    let v = llama::verdict(&bad, &reports, &tol);
    assert_eq!(v.failures.len(), 2, "{:?}", messages(&v));
    let mut bad = reference.clone();
    Plant::NanGrad.apply(&mut bad).unwrap();
    let v = llama::verdict(&bad, &reports, &tol);
    assert!(
        matches!(
            v.failures[..],
            [(
                Some(0),
                CheckFailure::GradNonFinite {
                    side: "one device's",
                    ..
                }
            )]
        ),
        "{:?}",
        messages(&v)
    );
    // A check of nothing, or held to a NaN tolerance, fails too.
    assert!(!llama::verdict(&reference, &[], &tol).passed());
    let nan_tol = Tolerances {
        any_grad: f64::NAN,
        ..tol
    };
    assert!(!llama::verdict(&reference, &reports, &nan_tol).passed());
    let mut no_grads = reports.clone();
    no_grads[0].grads.clear();
    let v = llama::verdict(&reference, &no_grads, &tol);
    assert!(
        matches!(
            v.failures[..],
            [(
                Some(0),
                CheckFailure::GradSteps {
                    got: 0,
                    want: 2,
                    ..
                }
            )]
        ),
        "{:?}",
        messages(&v)
    );
    let no_steps = Report {
        losses: Vec::new(),
        grads: Vec::new(),
        ..reference.clone()
    };
    assert!(!llama::verdict(&no_steps, std::slice::from_ref(&no_steps), &tol).passed());
}
