//! FSDP, HSDP and FSDP x TP train the GPT exactly like one device.
// The GPT-training helpers every crate's GPT tests share (they train through train's run).
#[path = "../../train/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_core::DType;
use candle_dtensor_parallel::TpPlan;
use candle_dtensor_train::trainer::{FsdpSpec, RankReport, TrainConfig};
use common::{assert_close, fsdp_over, micro_gpt, short_run};

fn cfg(fsdp: Option<FsdpSpec>, sp: bool, steps: usize) -> TrainConfig {
    let mut c = short_run(micro_gpt(), TpPlan::gpt(sp), steps, 3);
    c.fsdp = fsdp;
    // SGD: a wrong gradient scale changes the losses (AdamW would normalise it away).
    c.sgd = true;
    c.lr = 0.5;
    c
}

fn spec(
    shard: &str,
    replicate: Option<&str>,
    separate_rs: bool,
    param_dtype: Option<DType>,
) -> Option<FsdpSpec> {
    Some(FsdpSpec {
        separate_rs,
        param_dtype,
        ..fsdp_over(shard, replicate)
    })
}

fn train(dims: &[(&str, usize)], c: &TrainConfig) -> RankReport {
    common::train_on_mesh(dims, c, Duration::from_secs(30))
}

/// Named mesh dims and their sizes.
type MeshShape = Vec<(&'static str, usize)>;

#[test]
fn fsdp_layouts_match_single_device() {
    let steps = 20;
    let reference = train(&[("tp", 1)], &cfg(None, false, steps));
    assert!(
        reference.losses[steps - 1] < reference.losses[0] - 0.1,
        "{:?}",
        reference.losses
    );
    let cases: Vec<(&str, MeshShape, TrainConfig)> = vec![
        (
            "fsdp 2",
            vec![("dp", 2)],
            cfg(spec("dp", None, false, None), false, steps),
        ),
        (
            "fsdp 4",
            vec![("dp", 4)],
            cfg(spec("dp", None, true, None), false, steps),
        ),
        (
            "fsdp 8",
            vec![("dp", 8)],
            cfg(spec("dp", None, false, None), false, steps),
        ),
        (
            "hsdp 2x2",
            vec![("replicate", 2), ("shard", 2)],
            cfg(spec("shard", Some("replicate"), false, None), false, steps),
        ),
        (
            "fsdp x tp 2x2",
            vec![("dp", 2), ("tp", 2)],
            cfg(spec("dp", None, false, None), false, steps),
        ),
        (
            "fsdp x tp 2x2 sp",
            vec![("dp", 2), ("tp", 2)],
            cfg(spec("dp", None, true, None), true, steps),
        ),
    ];
    for (name, dims, c) in cases {
        let r = train(&dims, &c);
        assert_close(&r.losses, &reference.losses, 1e-4, name);
        // Peak bytes held: shards + grads + AdamW state, one unit's unsharded parameters, and
        // (for a moment, at the end of its last consumer's backward) the largest parameter's
        // gradient next to its still-gathered value, which the theory formula leaves out.
        let theory = r.zero3_theory_bytes.unwrap();
        let transient = r.largest_param_bytes.unwrap();
        let measured = r.param_grad_optim_bytes;
        assert!(
            measured >= theory,
            "{name}: measured {measured} below theory {theory}"
        );
        assert!(
            measured <= theory + transient,
            "{name}: measured {measured} vs theory {theory} + {transient}"
        );
        if name == "fsdp 2" || name == "fsdp 4" {
            assert!(
                measured as f64 <= 1.10 * theory as f64,
                "{name}: measured {measured} vs theory {theory}"
            );
        }
        // One all_gather per unit forward and one backward (the head unit, last in forward and
        // first in backward, stays gathered in between), one reduce_scatter per unit.
        let ag = r.collectives.get("all_gather").cloned().unwrap_or_default();
        let rs = r
            .collectives
            .get("reduce_scatter")
            .cloned()
            .unwrap_or_default();
        let units = 4; // embed, 2 blocks, head
        let fsdp_ag_fwd = ag.get("forward").copied().unwrap_or(0);
        let fsdp_rs_bwd =
            rs.get("backward").copied().unwrap_or(0) + rs.get("forward").copied().unwrap_or(0);
        if !name.contains("sp") {
            assert_eq!(fsdp_ag_fwd, units, "{name}: {:?}", r.collectives);
            assert_eq!(
                ag.get("backward").copied().unwrap_or(0),
                units - 1,
                "{name}: {:?}",
                r.collectives
            );
            assert_eq!(fsdp_rs_bwd, units, "{name}: {:?}", r.collectives);
        }
    }
}

#[test]
fn mixed_precision_bf16_tracks_f32() {
    let steps = 10;
    let reference = train(&[("tp", 1)], &cfg(None, false, steps));
    let r = train(
        &[("dp", 2)],
        &cfg(spec("dp", None, false, Some(DType::BF16)), false, steps),
    );
    // bf16 compute: 8 bits of mantissa; the losses track within 2%.
    assert_close(&r.losses, &reference.losses, 2e-2, "bf16");
    assert!(
        r.losses.iter().zip(&reference.losses).any(|(a, b)| a != b),
        "bf16 must actually change the compute"
    );
}

/// FSDP's gathered bf16 parameters go into the linears' GEMMs as they are (with `param_dtype`
/// bf16 the GEMMs run in bf16 under the default policy too), so the graph keeps no f32 copy of
/// a gathered weight: a step's activation memory with `param_dtype` bf16 is the f32 step's plus
/// at most the position table's cast, where the cast before each linear kept every linear
/// weight in f32 until the backward (FSDP's release after each unit's forward then freed
/// nothing of them). FSDP, FSDP x TP, untied and tied head; the losses still track f32.
#[test]
fn mixed_precision_bf16_keeps_no_f32_copy_of_the_gathered_weights() {
    let steps = 3;
    let layouts: [(&[(&str, usize)], bool); 3] = [
        (&[("dp", 2)], false),
        (&[("dp", 2)], true),
        (&[("dp", 2), ("tp", 2)], false),
    ];
    for (dims, tied) in layouts {
        let run = |param_dtype: Option<DType>| {
            let mut c = cfg(spec("dp", None, false, param_dtype), false, steps);
            c.gpt.tied = tied;
            train(dims, &c)
        };
        let (f32_run, bf16_run) = (run(None), run(Some(DType::BF16)));
        let g = micro_gpt();
        let (d, tp) = (
            g.d_model,
            dims.iter().find(|(n, _)| *n == "tp").map_or(1, |p| p.1),
        );
        // Every linear weight of one rank, in f32: the blocks' 12 d^2 (qkv, out, fc1, fc2),
        // the LM head's vocab x d.
        let linears = (g.n_layers * 12 * d * d + g.vocab * d) / tp * 4;
        let extra = bf16_run
            .peak_activation_bytes
            .saturating_sub(f32_run.peak_activation_bytes);
        // What is still cast up to f32 (small): the position table (seq_len x d), the norms'
        // weights and biases (4 d a block, 2 d the last) and the linears' biases (9 d a
        // block); far under the linears.
        let allowed = (g.seq_len + 16 * g.n_layers + 8) * d * 4;
        assert!(
            extra <= allowed && allowed < linears / 4,
            "{dims:?} tied {tied}: bf16 parameters add {extra} bytes to the graph \
             (allowed {allowed}; every linear weight in f32 is {linears})"
        );
        assert_close(&bf16_run.losses, &f32_run.losses, 2e-2, "bf16 parameters");
    }
}
