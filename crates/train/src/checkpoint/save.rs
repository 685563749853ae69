//! Saving: every rank writes its designated boxes, rank 0 the manifest, last.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::chunks::{box_data, check_chunks, safetensors_header, tensor_bytes};
use super::exchange::{agreed, checkpoint_comm, exchange};
use super::{
    corrupt, fqn, fsync_dir, io, step_dir, CheckpointError, CheckpointVar, ChunkMeta, FileMeta,
    Manifest, OptimizerMeta, Result, SaveInfo, StoreCheckpoint, TensorKind, TensorMeta, FORMAT,
    MANIFEST, VERSION,
};
use crate::optim::AdamW;
use candle_dtensor_comm::Comm;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::params::ParamStore;

/// One chunk this rank writes.
struct Piece {
    fqn: String,
    key: String,
    offsets: Vec<usize>,
    data: Tensor,
}

/// The chunk list a rank reports to rank 0, and the tensors it holds (their global shape
/// and dtype, no chunks): a pipeline stage's rank holds only its stage's parameters, so rank
/// 0's own list does not name them all.
#[derive(Serialize, Deserialize)]
struct RankReport {
    file: Option<(String, u64)>,
    chunks: Vec<(String, ChunkMeta)>,
    #[serde(default)]
    tensors: Vec<(String, TensorMeta)>,
}

/// The tensors of `vars` (and, with `opt`, their moments) as the manifest lists them, without
/// chunks.
fn declared(vars: &[CheckpointVar], opt: Option<&AdamW>) -> Vec<(String, TensorMeta)> {
    let kinds: &[TensorKind] = if opt.is_some() {
        &[TensorKind::Param, TensorKind::ExpAvg, TensorKind::ExpAvgSq]
    } else {
        &[TensorKind::Param]
    };
    let mut out = Vec::with_capacity(vars.len() * kinds.len());
    for p in vars {
        for &kind in kinds {
            out.push((
                fqn(kind, &p.name),
                TensorMeta {
                    param: p.name.clone(),
                    kind,
                    shape: p.global_dims.clone(),
                    dtype: p.var.dtype().as_str().to_string(),
                    chunks: Vec::new(),
                },
            ));
        }
    }
    out
}

fn pieces(vars: &[CheckpointVar], opt: Option<&AdamW>) -> Result<Vec<Piece>> {
    let mut out = Vec::new();
    for p in vars.iter().filter(|p| p.writer && !p.boxes.is_empty()) {
        let mut tensors = vec![(TensorKind::Param, p.var.as_tensor().clone())];
        if let Some(o) = opt {
            let (m, v) = match o.moments(&p.var)? {
                Some(mv) => mv,
                // Not optimized (yet): the state of a fresh optimizer.
                None => (p.var.zeros_like()?, p.var.zeros_like()?),
            };
            tensors.push((TensorKind::ExpAvg, m));
            tensors.push((TensorKind::ExpAvgSq, v));
        }
        for (kind, t) in tensors {
            let name = fqn(kind, &p.name);
            for (k, b) in p.boxes.iter().enumerate() {
                out.push(Piece {
                    key: if k == 0 {
                        name.clone()
                    } else {
                        format!("{name}#{k}")
                    },
                    fqn: name.clone(),
                    offsets: b.global_offset.clone(),
                    data: box_data(&t, b)?,
                });
            }
        }
    }
    Ok(out)
}

/// Writes this rank's pieces to `dir/rank-<r>.safetensors` (temp, fsync, rename) and returns
/// its report.
fn write_rank_file(dir: &Path, rank: usize, pieces: &[Piece]) -> Result<RankReport> {
    if pieces.is_empty() {
        return Ok(RankReport {
            file: None,
            chunks: Vec::new(),
            tensors: Vec::new(),
        });
    }
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let name = format!("rank-{rank}.safetensors");
    let path = dir.join(&name);
    let tmp = dir.join(format!("{name}.tmp"));
    let entries: Vec<(String, DType, Vec<usize>)> = pieces
        .iter()
        .map(|p| (p.key.clone(), p.data.dtype(), p.data.dims().to_vec()))
        .collect();
    let header = safetensors_header(&entries, &path)?;
    let file = File::create(&tmp).map_err(io("create", &tmp))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header).map_err(io("write", &tmp))?;
    let mut bytes = header.len() as u64;
    let mut chunks = Vec::with_capacity(pieces.len());
    for p in pieces {
        let data = tensor_bytes(&p.data)?;
        let crc32 = crc32fast::hash(&data);
        w.write_all(&data).map_err(io("write", &tmp))?;
        bytes += data.len() as u64;
        chunks.push((
            p.fqn.clone(),
            ChunkMeta {
                offsets: p.offsets.clone(),
                sizes: p.data.dims().to_vec(),
                file: name.clone(),
                key: p.key.clone(),
                crc32,
            },
        ));
    }
    let file = w
        .into_inner()
        .map_err(|e| io("write", &tmp)(e.into_error()))?;
    file.sync_all().map_err(io("fsync", &tmp))?;
    drop(file);
    std::fs::rename(&tmp, &path).map_err(io("rename", &tmp))?;
    fsync_dir(dir)?;
    Ok(RankReport {
        file: Some((name, bytes)),
        chunks,
        tensors: Vec::new(),
    })
}

/// Rank 0, before anyone writes: the step directory exists and holds nothing of an earlier
/// save of the same step (its manifest goes first, so a crash leaves no half-old checkpoint).
fn prepare_dir(root: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let manifest = dir.join(MANIFEST);
    if manifest.exists() {
        std::fs::remove_file(&manifest).map_err(io("remove", &manifest))?;
        fsync_dir(dir)?;
    }
    for entry in std::fs::read_dir(dir).map_err(io("list", dir))? {
        let path = entry.map_err(io("list", dir))?.path();
        if path.is_file() {
            std::fs::remove_file(&path).map_err(io("remove", &path))?;
        }
    }
    fsync_dir(root)
}

/// Rank 0: the manifest from the tensors every rank declared and every rank's report.
fn build_manifest(
    vars: &[CheckpointVar],
    mesh: Option<&DeviceMesh>,
    opt: Option<&AdamW>,
    step: usize,
    extra: &serde_json::Value,
    reports: &[RankReport],
    path: &Path,
) -> Result<Manifest> {
    // Every tensor some rank holds, declared alike by every rank that holds it.
    let mut tensors: BTreeMap<String, TensorMeta> = declared(vars, opt).into_iter().collect();
    for (rank, r) in reports.iter().enumerate() {
        for (name, meta) in &r.tensors {
            match tensors.get(name) {
                None => {
                    tensors.insert(name.clone(), meta.clone());
                }
                Some(m)
                    if m.shape == meta.shape && m.dtype == meta.dtype && m.kind == meta.kind => {}
                Some(m) => {
                    return Err(corrupt(
                        path,
                        format!(
                            "rank {rank} holds tensor {name} as {:?} {}, rank 0 as {:?} {}",
                            meta.shape, meta.dtype, m.shape, m.dtype
                        ),
                    ))
                }
            }
        }
    }
    let mut files = BTreeMap::new();
    for (rank, r) in reports.iter().enumerate() {
        if let Some((name, bytes)) = &r.file {
            files.insert(
                name.clone(),
                FileMeta {
                    rank,
                    bytes: *bytes,
                },
            );
        }
        for (name, c) in &r.chunks {
            tensors
                .get_mut(name)
                .ok_or_else(|| {
                    corrupt(
                        path,
                        format!("rank {rank} saved tensor {name}, which no rank declared"),
                    )
                })?
                .chunks
                .push(c.clone());
        }
    }
    for (name, t) in &mut tensors {
        t.chunks.sort_by(|a, b| a.offsets.cmp(&b.offsets));
        check_chunks(name, t, path)?;
    }
    Ok(Manifest {
        format: FORMAT.to_string(),
        version: VERSION,
        step,
        world_size: mesh.map_or(1, DeviceMesh::num_ranks),
        mesh: mesh.map_or_else(Vec::new, |mesh| {
            mesh.dim_names()
                .iter()
                .map(|n| n.to_string())
                .zip(mesh.shape())
                .collect()
        }),
        optimizer: opt.map(|o| {
            let p = o.params();
            OptimizerMeta {
                step: o.step_count(),
                lr: p.lr,
                beta1: p.beta1,
                beta2: p.beta2,
                eps: p.eps,
                weight_decay: p.weight_decay,
            }
        }),
        extra: extra.clone(),
        files,
        tensors,
    })
}

fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let bytes = serde_json::to_vec_pretty(manifest)
        .map_err(|e| corrupt(&path, format!("serializing: {e}")))?;
    let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
    f.write_all(&bytes).map_err(io("write", &tmp))?;
    f.sync_all().map_err(io("fsync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(io("rename", &tmp))?;
    fsync_dir(dir)
}

/// Saves the parameters of `store` (and, with `opt`, AdamW's moments and step count) as step
/// `step` under `root`, with caller data `extra` (seeds, data position); see the module docs.
/// Collective: every rank of the store's mesh calls it with the same arguments.
///
/// # Errors
///
/// Any rank's I/O error (the others report [`CheckpointError::Peer`]), a failed collective,
/// or [`CheckpointError::Unsupported`] for Partial parameters. No manifest is written then.
///
/// # Blocking
///
/// Waits for every rank's write (timeout at least [`IO_TIMEOUT`](super::IO_TIMEOUT)).
pub fn save(
    root: &Path,
    step: usize,
    store: &ParamStore,
    opt: Option<&AdamW>,
    extra: &serde_json::Value,
) -> Result<SaveInfo> {
    let partial = store.params().iter().find(|p| {
        p.writer && !p.boxes.is_empty() && p.tensor.placements().iter().any(|pl| pl.is_partial())
    });
    let checked = match partial {
        Some(p) => Err(CheckpointError::Unsupported(format!(
            "parameter {} has a Partial placement",
            p.name
        ))),
        None => Ok(()),
    };
    let comm = checkpoint_comm(Some(store.mesh()));
    // Every rank takes part in the collectives, so a rank's Partial error fails them all.
    save_with(
        root,
        step,
        comm.as_ref(),
        Some(store.mesh()),
        checked.map(|()| store.checkpoint_vars()),
        opt,
        extra,
    )
}

/// Saves the variables `vars` (and, with `opt`, AdamW's moments and step count) as step `step`
/// under `root`, in the format of [`save`]: every rank writes the boxes of the vars it is the
/// writer of. `mesh`: the mesh every rank of the model is on (`None`: one process). Collective
/// over `mesh`; every rank passes its own vars, in the same order of names.
///
/// # Errors
///
/// As [`save`].
///
/// # Blocking
///
/// As [`save`].
pub fn save_vars(
    root: &Path,
    step: usize,
    mesh: Option<&DeviceMesh>,
    vars: &[CheckpointVar],
    opt: Option<&AdamW>,
    extra: &serde_json::Value,
) -> Result<SaveInfo> {
    let comm = checkpoint_comm(mesh);
    save_with(
        root,
        step,
        comm.as_ref(),
        mesh,
        Ok(vars.to_vec()),
        opt,
        extra,
    )
}

fn save_with(
    root: &Path,
    step: usize,
    comm: Option<&Comm>,
    mesh: Option<&DeviceMesh>,
    vars: Result<Vec<CheckpointVar>>,
    opt: Option<&AdamW>,
    extra: &serde_json::Value,
) -> Result<SaveInfo> {
    let rank = comm.map_or(0, Comm::rank);
    let dir = step_dir(root, step);
    let _span = tracing::info_span!("checkpoint_save", step, rank).entered();
    let prepared = if rank == 0 {
        prepare_dir(root, &dir)
    } else {
        Ok(())
    };
    agreed(comm, prepared)?;
    // A rank whose vars cannot be saved fails here, after the first agreement: its report is
    // its error, so every rank fails and no manifest is written.
    let (vars, unusable) = match vars {
        Ok(v) => (v, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let report = match unusable {
        Some(e) => Err(e),
        None => pieces(&vars, opt)
            .and_then(|p| write_rank_file(&dir, rank, &p))
            .map(|mut r| {
                r.tensors = declared(&vars, opt);
                r
            }),
    };
    let status = match &report {
        Ok(r) => serde_json::to_vec(r).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let gathered = exchange(comm, status);
    let report = report?;
    let gathered = gathered?;
    let written = if rank == 0 {
        let path = dir.join(MANIFEST);
        gathered
            .iter()
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice::<RankReport>(b)
                    .map_err(|e| corrupt(&path, format!("report of rank {r}: {e}")))
            })
            .collect::<Result<Vec<_>>>()
            .and_then(|reports| build_manifest(&vars, mesh, opt, step, extra, &reports, &path))
            .and_then(|m| write_manifest(&dir, &m))
    } else {
        Ok(())
    };
    agreed(comm, written)?;
    let info = SaveInfo {
        dir,
        bytes: report.file.as_ref().map_or(0, |f| f.1),
        chunks: report.chunks.len(),
    };
    tracing::debug!(bytes = info.bytes, chunks = info.chunks, "checkpoint saved");
    Ok(info)
}
