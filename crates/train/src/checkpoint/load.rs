//! Loading with resharding, consolidation into one plain file, and loading a plain file into
//! a distributed model.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};

use super::chunks::{
    check_chunks, copy_box, intersect, local_dims, parse_dtype, safetensors_header, set_var,
    strides, Array, DataFiles, OpenFile,
};
use super::exchange::{agreed, all_gather_bytes, checkpoint_comm};
use super::{
    corrupt, fqn, fsync_dir, io, read_manifest, resolve, step_dir, CheckpointError, CheckpointVar,
    ConsolidateInfo, LoadInfo, Manifest, Result, StoreCheckpoint, TensorKind, TensorMeta, Which,
    MANIFEST,
};
use crate::optim::AdamW;
use candle_dtensor_comm::Comm;
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::params::{ParamStore, VarBox};

/// A tensor to fill on this rank: its boxes of the global tensor, into a buffer shaped like
/// `var`.
struct Target {
    fqn: String,
    kind: TensorKind,
    var: Var,
    dtype: DType,
    global: Vec<usize>,
    dims: Vec<usize>,
    boxes: Vec<VarBox>,
    buf: Vec<u8>,
}

impl Target {
    fn new(
        fqn: String,
        kind: TensorKind,
        var: &Var,
        global: &[usize],
        boxes: &[VarBox],
    ) -> Result<Self> {
        Ok(Target {
            fqn,
            kind,
            var: var.clone(),
            dtype: var.dtype(),
            global: global.to_vec(),
            dims: local_dims(var, global.len())?,
            boxes: boxes.to_vec(),
            buf: vec![0u8; var.elem_count() * var.dtype().size_in_bytes()],
        })
    }
}

/// One region to copy out of a saved chunk: target `t`, box `b`, the overlap.
struct Region {
    target: usize,
    boxi: usize,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

/// Checks every target against the manifest, then reads the chunks that overlap its boxes and
/// fills its buffer. Nothing is set.
fn fill_targets(
    root: &Path,
    manifest: &Manifest,
    targets: &mut [Target],
    model_params: &[&str],
) -> Result<u64> {
    let mpath = step_dir(root, manifest.step).join(MANIFEST);
    for t in targets.iter() {
        let meta = manifest
            .tensors
            .get(&t.fqn)
            .ok_or_else(|| CheckpointError::MissingTensor {
                tensor: t.fqn.clone(),
                file: mpath.clone(),
            })?;
        if meta.shape != t.global {
            return Err(CheckpointError::ShapeMismatch {
                tensor: t.fqn.clone(),
                file: mpath.clone(),
                expected: t.global.clone(),
                found: meta.shape.clone(),
            });
        }
        if parse_dtype(&meta.dtype, &mpath, &t.fqn)? != t.dtype {
            return Err(CheckpointError::DtypeMismatch {
                tensor: t.fqn.clone(),
                file: mpath.clone(),
                expected: t.dtype.as_str().to_string(),
                found: meta.dtype.clone(),
            });
        }
        check_chunks(&t.fqn, meta, &mpath)?;
    }
    for (name, meta) in &manifest.tensors {
        if meta.kind == TensorKind::Param && !model_params.contains(&meta.param.as_str()) {
            return Err(CheckpointError::UnexpectedTensor {
                tensor: name.clone(),
                file: mpath.clone(),
            });
        }
    }
    // Plan: for every (file, key) the regions it feeds.
    let mut plan: BTreeMap<(String, String), (String, usize, Vec<Region>)> = BTreeMap::new();
    for (ti, t) in targets.iter().enumerate() {
        let meta = &manifest.tensors[&t.fqn];
        for (bi, b) in t.boxes.iter().enumerate() {
            let mut covered = 0;
            for (ci, c) in meta.chunks.iter().enumerate() {
                let Some((offsets, sizes)) =
                    intersect(&b.global_offset, &b.shape, &c.offsets, &c.sizes)
                else {
                    continue;
                };
                covered += sizes.iter().product::<usize>();
                plan.entry((c.file.clone(), c.key.clone()))
                    .or_insert_with(|| (t.fqn.clone(), ci, Vec::new()))
                    .2
                    .push(Region {
                        target: ti,
                        boxi: bi,
                        offsets,
                        sizes,
                    });
            }
            if covered != b.numel() {
                return Err(corrupt(
                    &mpath,
                    format!(
                        "tensor {}: the saved chunks cover {covered} of the {} elements at {:?}",
                        t.fqn,
                        b.numel(),
                        b.global_offset
                    ),
                ));
            }
        }
    }
    let mut files = DataFiles::new(root, manifest);
    // Read in file order, and in data order within a file.
    let mut order = Vec::with_capacity(plan.len());
    for ((file, key), (tensor, ci, _)) in &plan {
        let meta = &manifest.tensors[tensor];
        let dtype = parse_dtype(&meta.dtype, &mpath, tensor)?;
        let off = files.offset_of(tensor, dtype, &meta.chunks[*ci])?;
        order.push((file.clone(), off, key.clone()));
    }
    order.sort();
    for (file, _, key) in order {
        let Some((tensor, ci, regions)) = plan.get(&(file, key)) else {
            continue;
        };
        let meta = &manifest.tensors[tensor];
        let chunk = &meta.chunks[*ci];
        let dtype = parse_dtype(&meta.dtype, &mpath, tensor)?;
        let bytes = files.read_chunk(tensor, dtype, chunk)?;
        let elem = dtype.size_in_bytes();
        // The same layout as saved: the chunk is the target's whole buffer; no copy.
        if let [r] = regions.as_slice() {
            let t = &mut targets[r.target];
            let b = &t.boxes[r.boxi];
            if r.sizes == chunk.sizes
                && r.sizes == t.dims
                && r.offsets == chunk.offsets
                && b.local_offset.iter().all(|&o| o == 0)
                && b.global_offset == r.offsets
                && bytes.len() == t.buf.len()
            {
                t.buf = bytes;
                continue;
            }
        }
        let src = Array {
            bytes: bytes.as_slice(),
            dims: &chunk.sizes,
            skip: 0,
        };
        for r in regions {
            let t = &mut targets[r.target];
            let b = &t.boxes[r.boxi];
            let src_start: Vec<usize> = (0..r.offsets.len())
                .map(|d| r.offsets[d] - chunk.offsets[d])
                .collect();
            let dst_start: Vec<usize> = (0..r.offsets.len())
                .map(|d| b.local_offset[d] + r.offsets[d] - b.global_offset[d])
                .collect();
            let mut dst = Array {
                bytes: t.buf.as_mut_slice(),
                dims: &t.dims,
                skip: 0,
            };
            copy_box(&src, &src_start, &mut dst, &dst_start, &r.sizes, elem).map_err(|e| {
                corrupt(
                    &files.dir.join(&chunk.file),
                    format!("tensor {tensor}: {e}"),
                )
            })?;
        }
    }
    Ok(files.bytes_read)
}

/// Loads a checkpoint into `store`'s parameters (and `opt`'s moments and step count), in the
/// store's current layout, whatever layout saved it; see the module docs. Collective.
///
/// Every parameter of the model must be in the checkpoint with the same global shape and
/// dtype, and every saved parameter in the model; with `opt`, every optimized var's moments
/// must be saved too. Optimizer state in the checkpoint is ignored without `opt`; `opt`'s
/// hyper-parameters are kept (only the step count and moments are restored).
///
/// # Errors
///
/// [`CheckpointError::NotFound`], the integrity errors (missing or truncated file, checksum,
/// shape, dtype, missing or unexpected tensor, corrupt manifest), a peer's failure
/// ([`CheckpointError::Peer`]), ranks resolving different steps
/// ([`CheckpointError::Inconsistent`]). On any error no rank has changed its model.
///
/// # Blocking
///
/// Waits for every rank's reads (timeout at least [`IO_TIMEOUT`](super::IO_TIMEOUT)).
pub fn load(
    root: &Path,
    which: Which,
    store: &ParamStore,
    opt: Option<&mut AdamW>,
) -> Result<LoadInfo> {
    let comm = checkpoint_comm(Some(store.mesh()));
    load_with(root, which, comm.as_ref(), &store.checkpoint_vars(), opt)
}

/// Loads a checkpoint (of [`save`](super::save) or [`save_vars`](super::save_vars), any
/// layout) into the variables `vars` (and `opt`'s moments and step count), as [`load`] does
/// for a store: each var receives the elements of its boxes. `mesh`: the mesh every rank of
/// the model is on (`None`: one process). Collective over `mesh`.
///
/// # Errors
///
/// As [`load`]. On any error no rank has changed its vars.
///
/// # Blocking
///
/// As [`load`].
pub fn load_vars(
    root: &Path,
    which: Which,
    mesh: Option<&DeviceMesh>,
    vars: &[CheckpointVar],
    opt: Option<&mut AdamW>,
) -> Result<LoadInfo> {
    let comm = checkpoint_comm(mesh);
    load_with(root, which, comm.as_ref(), vars, opt)
}

fn load_with(
    root: &Path,
    which: Which,
    comm: Option<&Comm>,
    vars: &[CheckpointVar],
    opt: Option<&mut AdamW>,
) -> Result<LoadInfo> {
    let rank = comm.map_or(0, Comm::rank);
    let _span = tracing::info_span!("checkpoint_load", rank).entered();
    let step = agreed(comm, resolve(root, which))?;
    // The model's parameters are those of every rank together (a pipeline stage holds only
    // its own): a saved parameter none of them holds is unexpected.
    let own: Vec<&str> = vars.iter().map(|p| p.name.as_str()).collect();
    let gathered = all_gather_bytes(comm, own.join("\n").as_bytes())?;
    let mut model: Vec<String> = Vec::new();
    for b in &gathered {
        let text = String::from_utf8_lossy(b);
        model.extend(
            text.split('\n')
                .filter(|n| !n.is_empty())
                .map(str::to_string),
        );
    }
    model.sort();
    model.dedup();
    let steps = all_gather_bytes(comm, &(step as u64).to_le_bytes())?;
    if steps
        .iter()
        .any(|s| s.as_slice() != (step as u64).to_le_bytes())
    {
        return Err(CheckpointError::Inconsistent(format!(
            "rank {rank} resolved step {step}, others another step (is {} shared?)",
            root.display()
        )));
    }
    let local = (|| {
        let manifest = read_manifest(root, step)?;
        let mut targets = Vec::new();
        for p in vars {
            targets.push(Target::new(
                fqn(TensorKind::Param, &p.name),
                TensorKind::Param,
                &p.var,
                &p.global_dims,
                &p.boxes,
            )?);
            if let Some(o) = opt.as_deref() {
                if o.contains(&p.var) {
                    for kind in [TensorKind::ExpAvg, TensorKind::ExpAvgSq] {
                        targets.push(Target::new(
                            fqn(kind, &p.name),
                            kind,
                            &p.var,
                            &p.global_dims,
                            &p.boxes,
                        )?);
                    }
                }
            }
        }
        if opt.is_some() && manifest.optimizer.is_none() {
            let first = targets.iter().find(|t| t.kind != TensorKind::Param);
            return Err(CheckpointError::MissingTensor {
                tensor: first.map_or_else(|| "optimizer state".into(), |t| t.fqn.clone()),
                file: step_dir(root, step).join(MANIFEST),
            });
        }
        let names: Vec<&str> = model.iter().map(String::as_str).collect();
        let bytes_read = fill_targets(root, &manifest, &mut targets, &names)?;
        Ok((manifest, targets, bytes_read))
    })();
    let (manifest, targets, bytes_read) = agreed(comm, local)?;
    // Every rank has everything: set.
    let mut moments: HashMap<candle_core::TensorId, (Option<Tensor>, Option<Tensor>)> =
        HashMap::new();
    for t in &targets {
        if t.kind == TensorKind::Param {
            set_var(&t.var, &t.buf)?;
            continue;
        }
        let value = Tensor::from_raw_buffer(&t.buf, t.dtype, t.var.dims(), &Device::Cpu)?
            .to_device(t.var.device())?;
        match t.kind {
            TensorKind::Param => {}
            TensorKind::ExpAvg => {
                moments.entry(t.var.as_tensor().id()).or_default().0 = Some(value)
            }
            TensorKind::ExpAvgSq => {
                moments.entry(t.var.as_tensor().id()).or_default().1 = Some(value)
            }
        }
    }
    let mut optimizer_step = None;
    if let Some(o) = opt {
        for t in targets.iter().filter(|t| t.kind == TensorKind::ExpAvg) {
            if let Some((Some(m), Some(v))) = moments.get(&t.var.as_tensor().id()) {
                o.set_moments(&t.var, m, v)?;
            }
        }
        if let Some(meta) = &manifest.optimizer {
            o.set_step_count(meta.step);
            optimizer_step = Some(meta.step);
        }
    }
    tracing::debug!(step, bytes_read, "checkpoint loaded");
    Ok(LoadInfo {
        step,
        dir: step_dir(root, step),
        extra: manifest.extra.clone(),
        optimizer_step,
        bytes_read,
    })
}

/// Writes the parameters of checkpoint `which` under `root` as one plain safetensors file
/// `out` (temp, fsync, rename) of full tensors named by their parameter names, which
/// `candle_nn::VarBuilder::from_mmaped_safetensors` loads. Holds one full tensor at a time;
/// verifies every chunk's checksum. Not collective: one process runs it.
///
/// # Errors
///
/// [`CheckpointError::NotFound`], the integrity errors of [`load`], or I/O errors on `out`.
pub fn consolidate(root: &Path, which: Which, out: &Path) -> Result<ConsolidateInfo> {
    let step = resolve(root, which)?;
    let manifest = read_manifest(root, step)?;
    let mpath = step_dir(root, step).join(MANIFEST);
    let params: Vec<(&String, &TensorMeta)> = manifest
        .tensors
        .iter()
        .filter(|(_, t)| t.kind == TensorKind::Param)
        .collect();
    let mut entries = Vec::with_capacity(params.len());
    for (name, t) in &params {
        check_chunks(name, t, &mpath)?;
        entries.push((
            t.param.clone(),
            parse_dtype(&t.dtype, &mpath, name)?,
            t.shape.clone(),
        ));
    }
    let header = safetensors_header(&entries, out)?;
    let tmp = {
        let mut s = out.as_os_str().to_os_string();
        s.push(".tmp");
        PathBuf::from(s)
    };
    let file = File::create(&tmp).map_err(io("create", &tmp))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header).map_err(io("write", &tmp))?;
    let mut bytes = header.len() as u64;
    let mut files = DataFiles::new(root, &manifest);
    for ((name, t), (_, dtype, shape)) in params.iter().zip(&entries) {
        let elem = dtype.size_in_bytes();
        let mut full = vec![0u8; shape.iter().product::<usize>() * elem];
        for c in &t.chunks {
            let data = files.read_chunk(name, *dtype, c)?;
            let src = Array {
                bytes: data.as_slice(),
                dims: &c.sizes,
                skip: 0,
            };
            let mut dst = Array {
                bytes: full.as_mut_slice(),
                dims: shape,
                skip: 0,
            };
            copy_box(
                &src,
                &vec![0; shape.len()],
                &mut dst,
                &c.offsets,
                &c.sizes,
                elem,
            )
            .map_err(|e| corrupt(&mpath, format!("tensor {name}: {e}")))?;
        }
        w.write_all(&full).map_err(io("write", &tmp))?;
        bytes += full.len() as u64;
    }
    let file = w
        .into_inner()
        .map_err(|e| io("write", &tmp)(e.into_error()))?;
    file.sync_all().map_err(io("fsync", &tmp))?;
    drop(file);
    std::fs::rename(&tmp, out).map_err(io("rename", &tmp))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fsync_dir(parent)?;
    }
    Ok(ConsolidateInfo {
        step,
        tensors: entries.len(),
        bytes,
    })
}

impl StoreCheckpoint for ParamStore {
    fn checkpoint_vars(&self) -> Vec<CheckpointVar> {
        self.params()
            .iter()
            .map(|p| CheckpointVar {
                name: p.name.clone(),
                var: p.var.clone(),
                global_dims: p.tensor.shape().to_vec(),
                boxes: p.boxes.clone(),
                writer: p.writer,
            })
            .collect()
    }

    fn load_safetensors(&self, path: &Path) -> Result<()> {
        let comm = checkpoint_comm(Some(self.mesh()));
        let local = (|| {
            let first = self.params().first().map_or("", |p| p.name.as_str());
            let mut f = OpenFile::open(path, None, first)?;
            for name in f.header.tensors().keys() {
                if self.get(name).is_none() {
                    return Err(CheckpointError::UnexpectedTensor {
                        tensor: name.clone(),
                        file: path.to_path_buf(),
                    });
                }
            }
            let mut values = Vec::with_capacity(self.params().len());
            for p in self.params() {
                let shape = p.tensor.shape().to_vec();
                let dtype = p.var.dtype();
                let info = f.info(&p.name, &p.name, dtype, &shape)?;
                let elem = dtype.size_in_bytes();
                let dims = local_dims(&p.var, shape.len())?;
                let mut buf = vec![0u8; p.var.elem_count() * elem];
                let st = strides(&shape);
                for b in &p.boxes {
                    if b.numel() == 0 {
                        continue;
                    }
                    // The span from the box's first to its last element.
                    let first: usize = (0..shape.len()).map(|d| b.global_offset[d] * st[d]).sum();
                    let last: usize = (0..shape.len())
                        .map(|d| (b.global_offset[d] + b.shape[d] - 1) * st[d])
                        .sum();
                    let span = f.read(
                        &p.name,
                        (info.data_offsets.0 + first * elem) as u64,
                        (last + 1 - first) * elem,
                    )?;
                    let src = Array {
                        bytes: span.as_slice(),
                        dims: &shape,
                        skip: first,
                    };
                    let mut dst = Array {
                        bytes: buf.as_mut_slice(),
                        dims: &dims,
                        skip: 0,
                    };
                    copy_box(
                        &src,
                        &b.global_offset,
                        &mut dst,
                        &b.local_offset,
                        &b.shape,
                        elem,
                    )
                    .map_err(|e| corrupt(path, format!("tensor {}: {e}", p.name)))?;
                }
                values.push(buf);
            }
            Ok(values)
        })();
        let values = agreed(comm.as_ref(), local)?;
        for (p, v) in self.params().iter().zip(values) {
            set_var(&p.var, &v)?;
        }
        Ok(())
    }
}
