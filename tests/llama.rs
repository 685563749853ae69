//! Llamas under FSDP against one device, as `examples/train_llama.rs` trains them:
//! - a llama written with candle-nn and `candle_dtensor::nn`'s drop-ins: every parameter's
//!   gradient, every step, within 1e-5 of one device, under FSDP (per-layer units) and under
//!   FSDP over dp x TP;
//! - candle-transformers' unmodified llama: the parameters with a gradient are exactly those
//!   one device gives one (lm_head: candle-nn's fused ops cut the rest), its gradient and the
//!   losses within 1e-5, and `params_without_grad` names the cut ones.
#[path = "../examples/common/llama.rs"]
mod llama;

use std::time::Duration;

use candle_dtensor::comm::LocalWorld;
use candle_dtensor::mesh::DeviceMesh;
use llama::{Arch, Report, Run, Sizes};

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
            let c = llama::compare(&reference, r).unwrap();
            assert!(
                c.grad_set_mismatch.is_empty(),
                "{what}: {:?}",
                c.grad_set_mismatch
            );
            assert_eq!(c.compared, all_params(&reference), "{what}");
            assert!(c.max_loss_rel <= 1e-5, "{what}: loss {:e}", c.max_loss_rel);
            assert!(
                c.max_grad_rel <= 1e-5,
                "{what}: gradient {:e} at {:?}",
                c.max_grad_rel,
                c.worst
            );
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
        let c = llama::compare(&reference, r).unwrap();
        assert!(
            c.grad_set_mismatch.is_empty(),
            "rank {rank}: {:?}",
            c.grad_set_mismatch
        );
        assert_eq!(c.compared, ["lm_head.weight"], "rank {rank}");
        assert!(
            c.max_loss_rel <= 1e-5,
            "rank {rank}: loss {:e}",
            c.max_loss_rel
        );
        assert!(
            c.max_grad_rel <= 1e-5,
            "rank {rank}: lm_head {:e}",
            c.max_grad_rel
        );
        assert_eq!(
            r.without_grad, cut,
            "rank {rank}: the cut parameters are named"
        );
        assert_eq!(r.without_grad.len(), 20);
    }
}
