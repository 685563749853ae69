//! Distributed checkpoints: resume on the same and on other meshes matches an uninterrupted
//! run, replicated pieces are written once, integrity errors are typed and load nothing, a
//! crash mid-save leaves the previous checkpoint, and consolidated files round-trip through
//! candle-nn's `VarBuilder` and back into a sharded model.
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dtensor_comm::LocalWorld;
// NaN-propagating: a NaN never passes as a difference of 0.
use candle_dtensor_kernels::compare::max_abs_diff;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_models::{Gpt, GptConfig};
use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
use candle_dtensor_parallel::init::full;
use candle_dtensor_parallel::{ParamStore, TpPlan};
use candle_dtensor_train::checkpoint::{
    self, consolidate, load, read_manifest, save, CheckpointError, LoadInfo, StoreCheckpoint,
    TensorKind, Which,
};
use candle_dtensor_train::optim::AdamW;
use candle_dtensor_train::trainer::{FsdpSpec, RankReport, TrainConfig};
use candle_nn::{Optimizer, ParamsAdamW};
use common::{assert_close, Scratch, R};

/// Copies step `step`'s directory of checkpoint root `from` into root `to`.
fn copy_step(from: &Path, to: &Path, step: usize) {
    copy_dir(
        &checkpoint::step_dir(from, step),
        &checkpoint::step_dir(to, step),
    );
}

/// Flips one bit of the file's third-to-last byte (inside its last chunk).
fn flip_a_bit_near_the_end(p: &Path) {
    let mut b = std::fs::read(p).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x10;
    std::fs::write(p, b).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// Small GPT with uneven FSDP shards: `pos_emb` has 18 rows (5,5,5,3 on 4 ranks; 3 x 6 and
/// two empty shards on 8), d_model 36.
fn gpt() -> GptConfig {
    GptConfig {
        vocab: 64,
        d_model: 36,
        n_heads: 4,
        n_layers: 2,
        seq_len: 18,
        ..GptConfig::tiny()
    }
}

fn fsdp(shard: &str, replicate: Option<&str>) -> Option<FsdpSpec> {
    Some(common::fsdp_over(shard, replicate))
}

fn cfg(fsdp: Option<FsdpSpec>, steps: usize, dir: Option<&Path>) -> TrainConfig {
    let mut c = common::short_run(gpt(), TpPlan::gpt(false), steps, 3);
    c.lr = 1e-2;
    c.fsdp = fsdp;
    c.save_dir = dir.map(Path::to_path_buf);
    c
}

fn world(dims: &[(&str, usize)]) -> LocalWorld {
    let n: usize = dims.iter().map(|d| d.1).product();
    LocalWorld::new(n).with_timeout(Duration::from_secs(60))
}

fn train(dims: &[(&str, usize)], c: &TrainConfig) -> RankReport {
    common::train_on_mesh(dims, c, Duration::from_secs(60))
}

#[test]
fn resume_on_the_same_mesh_matches_an_uninterrupted_run() {
    let dir = Scratch::new("same");
    let dims = [("dp", 4)];
    let reference = train(&dims, &cfg(fsdp("dp", None), 20, None));
    assert!(reference.losses[19] < reference.losses[0] - 0.1);
    let mut first = cfg(fsdp("dp", None), 10, Some(&dir.0));
    first.save_every = 5;
    let a = train(&dims, &first);
    assert_eq!(a.saved_steps, vec![5, 10]);
    assert_close(&a.losses, &reference.losses[..10], 1e-6, "first half");
    let mut second = cfg(fsdp("dp", None), 20, Some(&dir.0));
    second.save_every = 5;
    second.resume = true;
    let b = train(&dims, &second);
    assert_eq!(b.start_step, 10);
    assert_eq!(b.saved_steps, vec![15, 20]);
    assert_close(&b.losses, &reference.losses[10..], 1e-6, "resumed half");
    assert_eq!(
        checkpoint::complete_steps(&dir.0).unwrap(),
        vec![5, 10, 15, 20]
    );
}

#[test]
fn resume_on_other_meshes_matches_the_single_device_run() {
    let dir = Scratch::new("cross");
    let reference = train(&[("tp", 1)], &cfg(None, 20, None));
    // FSDP on 4 ranks -> FSDP x TP on 2 x 2 -> one device, and -> FSDP on 8 (empty shards).
    let a = train(&[("dp", 4)], &cfg(fsdp("dp", None), 10, Some(&dir.0)));
    assert_close(&a.losses, &reference.losses[..10], 1e-4, "fsdp 4");
    let mut c = cfg(fsdp("dp", None), 15, Some(&dir.0));
    c.resume = true;
    let b = train(&[("dp", 2), ("tp", 2)], &c);
    assert_eq!(b.start_step, 10);
    assert_close(&b.losses, &reference.losses[10..15], 1e-4, "fsdp x tp");
    let copy = Scratch::new("cross-copy");
    copy_step(&dir.0, &copy.0, 15);
    let mut c = cfg(None, 20, Some(&dir.0));
    c.resume = true;
    let single = train(&[("tp", 1)], &c);
    assert_eq!(single.start_step, 15);
    assert_close(&single.losses, &reference.losses[15..], 1e-4, "single");
    let mut c = cfg(fsdp("dp", None), 20, Some(&copy.0));
    c.resume = true;
    let eight = train(&[("dp", 8)], &c);
    assert_eq!(eight.start_step, 15);
    assert_close(&eight.losses, &reference.losses[15..], 1e-4, "fsdp 8");
}

/// Named mesh dims and their sizes.
type MeshDims = Vec<(&'static str, usize)>;

/// FSDP's (shard dim, HSDP replicate dim) by name; `None`: no FSDP.
type Sharding<'a> = Option<(&'a str, Option<&'a str>)>;

/// Builds the GPT (FSDP over `shard` when given) and its AdamW on `mesh`.
fn build(
    mesh: &DeviceMesh,
    g: &GptConfig,
    seed: u64,
    dtype: DType,
    shard: Sharding<'_>,
) -> R<(Gpt, ParamStore, AdamW)> {
    let f = match shard {
        Some((s, r)) => {
            let mut fc = FsdpConfig::new(mesh.dim_index(s)?, GradReduce::Sum);
            fc.replicate_dim = r.map(|r| mesh.dim_index(r)).transpose()?;
            Some(Fsdp::new(mesh, fc)?)
        }
        None => None,
    };
    let (model, store) = Gpt::build(g, mesh, &TpPlan::gpt(false), seed, dtype, f.as_ref())?;
    let opt = AdamW::new(store.vars(), ParamsAdamW::default())?;
    Ok((model, store, opt))
}

/// Runs `f` on every rank of a world shaped `dims`, with the parameter store and AdamW of a
/// GPT `g` [`build`] made there (seed `seed`, `dtype`, FSDP per `shard`); results in rank order.
fn with_built<T: Send>(
    dims: &[(&str, usize)],
    (g, seed, dtype): (&GptConfig, u64, DType),
    shard: Sharding<'_>,
    f: impl Fn(&ParamStore, AdamW) -> R<T> + Send + Sync,
) -> Vec<T> {
    world(dims)
        .launch(|comm| -> R<_> {
            let mesh = DeviceMesh::new(comm, dims)?;
            let (_m, store, opt) = build(&mesh, g, seed, dtype, shard)?;
            f(&store, opt)
        })
        .unwrap()
}

/// [`with_built`] for the f32 test GPT [`gpt`].
fn with_gpt<T: Send>(
    dims: &[(&str, usize)],
    seed: u64,
    shard: Sharding<'_>,
    f: impl Fn(&ParamStore, AdamW) -> R<T> + Send + Sync,
) -> Vec<T> {
    with_built(dims, (&gpt(), seed, DType::F32), shard, f)
}

/// Saves the test GPT of `seed` with its AdamW, built on a world shaped `dims`, as step `step`
/// of `root` (with `extra`).
fn save_gpt(
    root: &Path,
    step: usize,
    dims: &[(&str, usize)],
    (seed, shard): (u64, Sharding<'_>),
    extra: &serde_json::Value,
) {
    with_gpt(dims, seed, shard, |store, opt| {
        Ok(save(root, step, store, Some(&opt), extra)?)
    });
}

/// Every parameter's name and a copy of its local value.
fn named_values(store: &ParamStore) -> Vec<(String, Tensor)> {
    store
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.var.as_tensor().copy().unwrap()))
        .collect()
}

#[test]
fn replicated_pieces_are_written_once() {
    let cases: [(&str, MeshDims, Sharding<'_>); 3] = [
        ("dp x tp", vec![("dp", 2), ("tp", 2)], None),
        (
            "hsdp",
            vec![("replicate", 2), ("shard", 2)],
            Some(("shard", Some("replicate"))),
        ),
        ("fsdp x tp", vec![("dp", 2), ("tp", 2)], Some(("dp", None))),
    ];
    for (name, dims, shard) in cases {
        let dir = Scratch::new(&format!("once-{}", name.replace(' ', "")));
        // Every rank's boxes per parameter, to compare with the manifest.
        let boxes = with_gpt(&dims, 1, shard, |store, opt| {
            save(&dir.0, 0, store, Some(&opt), &serde_json::Value::Null)?;
            Ok(store
                .params()
                .iter()
                .map(|p| {
                    let b: BTreeSet<(Vec<usize>, Vec<usize>)> = p
                        .boxes
                        .iter()
                        .map(|b| (b.global_offset.clone(), b.shape.clone()))
                        .collect();
                    (p.name.clone(), b)
                })
                .collect::<BTreeMap<_, _>>())
        });
        let m = read_manifest(&dir.0, 0).unwrap();
        let mut data_bytes = 0;
        let mut numel = 0;
        for (fqn, t) in &m.tensors {
            let distinct: BTreeSet<_> = boxes.iter().flat_map(|r| r[&t.param].clone()).collect();
            let saved: Vec<_> = t
                .chunks
                .iter()
                .map(|c| (c.offsets.clone(), c.sizes.clone()))
                .collect();
            assert_eq!(
                saved.len(),
                distinct.len(),
                "{name}: {fqn}: one chunk per distinct box"
            );
            assert_eq!(
                saved.iter().cloned().collect::<BTreeSet<_>>(),
                distinct,
                "{name}: {fqn}"
            );
            data_bytes += t
                .chunks
                .iter()
                .map(|c| c.sizes.iter().product::<usize>() * 4)
                .sum::<usize>();
            if t.kind == TensorKind::Param {
                numel += t.shape.iter().product::<usize>();
            }
        }
        // Parameters and two moments, each element exactly once.
        assert_eq!(data_bytes, 3 * 4 * numel, "{name}");
        // Replicas over the first mesh dim (dp / replicate) write nothing, except FSDP whose
        // dp dim shards.
        let writers: Vec<usize> = m.files.values().map(|f| f.rank).collect();
        let expect: Vec<usize> = if name == "fsdp x tp" {
            vec![0, 1, 2, 3]
        } else {
            vec![0, 1]
        };
        assert_eq!(writers, expect, "{name}");
        for r in 0..4 {
            let exists = checkpoint::step_dir(&dir.0, 0)
                .join(format!("rank-{r}.safetensors"))
                .exists();
            assert_eq!(exists, expect.contains(&r), "{name}: rank {r}");
        }
    }
}

/// The single-device values of every parameter for `seed` (their initialisation).
fn init_values(store: &ParamStore, seed: u64) -> Vec<Vec<f32>> {
    store
        .params()
        .iter()
        .map(|p| {
            full(
                p.init,
                seed,
                &p.name,
                p.tensor.shape(),
                DType::F32,
                &Device::Cpu,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
        })
        .collect()
}

fn var_values(store: &ParamStore) -> Vec<Vec<f32>> {
    store
        .params()
        .iter()
        .map(|p| p.var.flatten_all().unwrap().to_vec1().unwrap())
        .collect()
}

/// Loads `root` into a single-device model of `g` with seed 2; returns the outcome and
/// whether the parameters are still seed 2's.
fn load_single(
    root: &Path,
    g: &GptConfig,
    dtype: DType,
) -> (Result<LoadInfo, CheckpointError>, bool) {
    with_built(&[("tp", 1)], (g, 2, dtype), None, |store, mut opt| {
        let before = if dtype == DType::F32 {
            var_values(store)
        } else {
            Vec::new()
        };
        let r = load(root, Which::Latest, store, Some(&mut opt));
        let unchanged = dtype != DType::F32 || var_values(store) == before;
        Ok((r, unchanged))
    })
    .remove(0)
}

#[test]
fn integrity_errors_are_typed_and_load_nothing() {
    let good = Scratch::new("integrity");
    // Saved from FSDP on 2 ranks, seed 1.
    let dp2 = [("dp", 2)];
    save_gpt(
        &good.0,
        3,
        &dp2,
        (1, Some(("dp", None))),
        &serde_json::json!({"seed": 1}),
    );
    // The intact checkpoint loads exactly the saved values.
    let vals = with_gpt(&[("tp", 1)], 2, None, |store, mut opt| {
        let info = load(&good.0, Which::Latest, store, Some(&mut opt))?;
        assert_eq!(info.step, 3);
        assert_eq!(info.extra["seed"], 1);
        Ok((var_values(store), init_values(store, 1)))
    })
    .remove(0);
    assert_eq!(vals.0, vals.1, "loaded values are seed 1's");

    let variant = |name: &str, f: &dyn Fn(&Path)| {
        let d = Scratch::new(&format!("integrity-{name}"));
        copy_dir(&good.0, &d.0);
        f(&checkpoint::step_dir(&d.0, 3));
        let (r, unchanged) = load_single(&d.0, &gpt(), DType::F32);
        assert!(unchanged, "{name}: the model changed");
        (r.expect_err(name), d)
    };
    let names_file = |e: &CheckpointError, file: &str| {
        let s = e.to_string();
        assert!(s.contains(file), "{s}");
        assert!(s.contains("model.") || s.contains("optim."), "{s}");
    };

    let (e, _d) = variant("missing", &|d| {
        std::fs::remove_file(d.join("rank-1.safetensors")).unwrap()
    });
    assert!(matches!(e, CheckpointError::MissingFile { .. }), "{e}");
    names_file(&e, "rank-1.safetensors");

    let (e, _d) = variant("truncated", &|d| {
        let p = d.join("rank-0.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len - 100).unwrap();
    });
    assert!(matches!(e, CheckpointError::Truncated { .. }), "{e}");
    names_file(&e, "rank-0.safetensors");

    // A flipped byte in the last chunk of rank 1's file: every other chunk verifies and would
    // have been loaded by a non-atomic loader.
    let (e, _d) = variant("flipped", &|d| {
        flip_a_bit_near_the_end(&d.join("rank-1.safetensors"))
    });
    assert!(matches!(e, CheckpointError::Checksum { .. }), "{e}");
    names_file(&e, "rank-1.safetensors");

    // Models of another shape or dtype: the error, and whether the model is unchanged.
    let load_into = |change: fn(&mut GptConfig), dtype: DType| {
        let mut g = gpt();
        change(&mut g);
        let (r, unchanged) = load_single(&good.0, &g, dtype);
        (r.unwrap_err(), unchanged)
    };
    let (e, unchanged) = load_into(|g| g.d_model = 40, DType::F32);
    assert!(unchanged);
    assert!(matches!(e, CheckpointError::ShapeMismatch { .. }), "{e}");
    names_file(&e, "manifest.json");
    let (e, _) = load_into(|g| g.n_layers = 3, DType::F32);
    assert!(
        matches!(&e, CheckpointError::MissingTensor { tensor, .. } if tensor.contains("blocks.2")),
        "{e}"
    );
    let (e, _) = load_into(|g| g.n_layers = 1, DType::F32);
    assert!(
        matches!(&e, CheckpointError::UnexpectedTensor { tensor, .. } if tensor.contains("blocks.1")),
        "{e}"
    );
    let (e, _) = load_into(|_| {}, DType::F64);
    assert!(matches!(e, CheckpointError::DtypeMismatch { .. }), "{e}");

    // On 2 ranks, only rank 1 reads the damaged file: it reports the checksum, rank 0 the
    // peer; neither model changes.
    let d = Scratch::new("integrity-peer");
    copy_dir(&good.0, &d.0);
    flip_a_bit_near_the_end(&checkpoint::step_dir(&d.0, 3).join("rank-1.safetensors"));
    let out = with_gpt(&dp2, 2, Some(("dp", None)), |store, mut opt| {
        let before = var_values(store);
        let r = load(&d.0, Which::Latest, store, Some(&mut opt));
        Ok((r.map(|_| ()), var_values(store) == before))
    });
    assert!(
        matches!(out[1].0, Err(CheckpointError::Checksum { .. })),
        "{:?}",
        out[1].0
    );
    assert!(
        matches!(out[0].0, Err(CheckpointError::Peer { rank: 1, .. })),
        "{:?}",
        out[0].0
    );
    assert!(out[0].1 && out[1].1);
}

#[test]
fn a_crash_mid_save_leaves_the_previous_checkpoint() {
    let d = Scratch::new("crash");
    let (dp2, fsdp_dp) = ([("dp", 2)], Some(("dp", None)));
    save_gpt(&d.0, 3, &dp2, (1, fsdp_dp), &serde_json::Value::Null);
    // A later save that died after the rank files (no manifest), and one that died while
    // writing its manifest (a truncated temp file), and a torn rank temp file.
    copy_dir(
        &checkpoint::step_dir(&d.0, 3),
        &checkpoint::step_dir(&d.0, 7),
    );
    std::fs::remove_file(checkpoint::step_dir(&d.0, 7).join("manifest.json")).unwrap();
    let s9 = checkpoint::step_dir(&d.0, 9);
    std::fs::create_dir_all(&s9).unwrap();
    std::fs::write(s9.join("manifest.json.tmp"), b"{\"format\": \"candle-dt").unwrap();
    std::fs::write(s9.join("rank-0.safetensors.tmp"), b"\x10\x00").unwrap();
    assert_eq!(checkpoint::latest_step(&d.0).unwrap(), Some(3));
    let (r, _) = load_single(&d.0, &gpt(), DType::F32);
    assert_eq!(r.unwrap().step, 3);
    // Asking for the incomplete step explicitly is NotFound.
    let e = with_gpt(&[("tp", 1)], 2, None, |store, _| {
        Ok(load(&d.0, Which::Step(7), store, None).map(|_| ()))
    })
    .remove(0);
    assert!(
        matches!(e, Err(CheckpointError::NotFound { step: Some(7), .. })),
        "{e:?}"
    );
    // Saving step 7 again replaces the debris and completes it.
    save_gpt(&d.0, 7, &dp2, (1, fsdp_dp), &serde_json::Value::Null);
    assert_eq!(checkpoint::complete_steps(&d.0).unwrap(), vec![3, 7]);
}

#[test]
fn consolidate_round_trips_through_var_builder_and_back() {
    let d = Scratch::new("consolidate");
    let out = d.0.join("model.safetensors");
    let dims = [("dp", 2), ("tp", 2)];
    // Step 0 (the seed's initialisation) from FSDP x TP; step 2 after training.
    let fsdp_dp = Some(("dp", None));
    save_gpt(&d.0, 0, &dims, (5, fsdp_dp), &serde_json::Value::Null);
    let info = consolidate(&d.0, Which::Step(0), &out).unwrap();
    let reference = with_gpt(&[("tp", 1)], 5, None, |store, _| Ok(named_values(store))).remove(0);
    assert_eq!(info.tensors, reference.len());
    // SAFETY: the file is not modified while mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[&out], DType::F32, &Device::Cpu).unwrap()
    };
    for (name, t) in &reference {
        let got = vb.get(t.dims(), name).unwrap();
        assert_eq!(max_abs_diff(&got, t).unwrap(), 0.0, "{name}");
    }

    // Train 2 steps on FSDP x TP, consolidate, and load that file into a sharded model of
    // another seed (then its boxes must equal the file's), and into one device via `load`.
    let mut c = cfg(fsdp("dp", None), 2, Some(&d.0));
    c.seed = 5;
    train(&dims, &c);
    let trained = d.0.join("trained.safetensors");
    consolidate(&d.0, Which::Latest, &trained).unwrap();
    let ok = with_gpt(&[("dp", 2)], 99, fsdp_dp, |store, _| {
        store.load_safetensors(&trained)?;
        let file = candle_core::safetensors::load(&trained, &Device::Cpu)?;
        for p in store.params() {
            let full = &file[&p.name];
            for b in &p.boxes {
                let mut want = full.clone();
                let mut have = p.var.as_tensor().clone();
                for dim in 0..b.shape.len() {
                    want = want.narrow(dim, b.global_offset[dim], b.shape[dim])?;
                    have = have.narrow(dim, b.local_offset[dim], b.shape[dim])?;
                }
                assert_eq!(max_abs_diff(&want, &have)?, 0.0, "{}", p.name);
            }
        }
        Ok(())
    });
    assert_eq!(ok.len(), 2);
    // The same values through `load` on one device.
    let loaded = with_gpt(&[("tp", 1)], 99, None, |store, mut opt| {
        load(&d.0, Which::Latest, store, Some(&mut opt))?;
        assert_eq!(opt.step_count(), 2);
        Ok(named_values(store))
    })
    .remove(0);
    let file = candle_core::safetensors::load(&trained, &Device::Cpu).unwrap();
    for (name, t) in &loaded {
        assert_eq!(max_abs_diff(&file[name], t).unwrap(), 0.0, "{name}");
    }
    // A plain file with a missing parameter is a typed error naming it and the file.
    let mut partial = file.clone();
    partial.remove("ln_f.weight");
    let bad = d.0.join("partial.safetensors");
    candle_core::safetensors::save(&partial, &bad).unwrap();
    let e = with_gpt(&[("dp", 2)], 99, fsdp_dp, |store, _| {
        Ok(store.load_safetensors(&bad))
    })
    .remove(0)
    .unwrap_err();
    assert!(
        matches!(&e, CheckpointError::MissingTensor { tensor, .. } if tensor == "ln_f.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("partial.safetensors"), "{e}");

    // Training from the consolidated file (`init_from`) matches on FSDP and one device.
    let mut c = cfg(fsdp("dp", None), 3, None);
    c.init_from = Some(trained.clone());
    let sharded = train(&[("dp", 2)], &c);
    c.fsdp = None;
    let single = train(&[("tp", 1)], &c);
    assert_close(&sharded.losses, &single.losses, 1e-4, "init_from");
    let fresh = train(&[("tp", 1)], &cfg(None, 3, None));
    assert!(
        (single.losses[0] - fresh.losses[0]).abs() > 1e-3,
        "init_from must change the start: {:?} vs {:?}",
        single.losses,
        fresh.losses
    );
}

/// Parameters the GPT does not have: a `StridedShard` piece (two boxes per rank), a
/// column shard, a replicated scalar, and under FSDP a scalar, uneven rows and an empty shard.
/// Saved on their mesh, loaded on one device: exactly the initial values.
#[test]
fn strided_scalar_and_empty_pieces_round_trip() {
    use candle_dtensor_core::Placement;
    use candle_dtensor_parallel::init::Init;
    type Spec = (&'static str, Vec<usize>, Vec<Placement>);
    let strided = Placement::StridedShard {
        dim: 0,
        split_factor: 2,
    };
    let r = Placement::Replicate;
    let cases: Vec<(MeshDims, bool, Vec<Spec>)> = vec![
        (
            vec![("a", 2), ("b", 2)],
            false,
            vec![
                ("strided", vec![9, 4], vec![strided, r]),
                ("col", vec![3, 5], vec![r, Placement::Shard(1)]),
                ("scalar", vec![], vec![r, r]),
            ],
        ),
        (
            vec![("dp", 3)],
            true,
            vec![
                ("scalar", vec![], vec![r]),
                ("rows", vec![7, 2], vec![r]),
                ("tiny", vec![2, 3], vec![r]),
            ],
        ),
    ];
    for (dims, with_fsdp, specs) in cases {
        let d = Scratch::new("pieces");
        // The pieces on `mesh`, initialised with `seed` (FSDP over the first dim if asked).
        let pieces = |mesh: &DeviceMesh, seed: u64| -> R<ParamStore> {
            let mut store = ParamStore::new(mesh, seed, DType::F32);
            if with_fsdp {
                let f = Fsdp::new(mesh, FsdpConfig::new(0, GradReduce::Sum))?;
                let u = f.add_unit("all", false);
                store = store.with_fsdp(f, u);
            }
            for (name, shape, pl) in &specs {
                store.param(name, shape, Init::Normal(1.0), pl)?;
            }
            Ok(store)
        };
        let multi_box = world(&dims)
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &dims)?;
                let store = pieces(&mesh, 1)?;
                save(&d.0, 1, &store, None, &serde_json::Value::Null)?;
                Ok(store.params().iter().map(|p| p.boxes.len()).max())
            })
            .unwrap();
        if !with_fsdp {
            assert_eq!(multi_box[0], Some(2), "the strided piece has two boxes");
        }
        let ok = world(&[("tp", 1)])
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &[("tp", 1)])?;
                let mut store = ParamStore::new(&mesh, 2, DType::F32);
                for (name, shape, _) in &specs {
                    store.param(name, shape, Init::Normal(1.0), &[Placement::Replicate])?;
                }
                load(&d.0, Which::Latest, &store, None)?;
                assert_eq!(var_values(&store), init_values(&store, 1), "{dims:?}");
                Ok(())
            })
            .unwrap();
        assert_eq!(ok.len(), 1);
        // And back into the saving layout (multi-box targets), over other values.
        world(&dims)
            .launch(|comm| -> R<_> {
                let mesh = DeviceMesh::new(comm, &dims)?;
                let mut stores = Vec::new();
                for seed in [1, 2] {
                    stores.push(pieces(&mesh, seed)?);
                }
                assert_ne!(var_values(&stores[0]), var_values(&stores[1]));
                load(&d.0, Which::Latest, &stores[1], None)?;
                assert_eq!(var_values(&stores[0]), var_values(&stores[1]), "{dims:?}");
                Ok(())
            })
            .unwrap();
    }
}
