//! Distributed checkpoints: every rank writes its own pieces, one manifest describes them, and
//! any layout loads them (resharding) without gathering a tensor on one rank.
//!
//! # On disk
//!
//! ```text
//! <root>/step-<N>/rank-<r>.safetensors   every rank r that holds a designated piece
//! <root>/step-<N>/manifest.json          written last, by rank 0: the checkpoint exists iff it does
//! ```
//!
//! A rank file is a plain safetensors file whose tensors are *chunks*: the box of a global
//! tensor the rank holds ([`VarBox`]), keyed by the tensor's name (`#k` appended for a
//! rank's k-th box of the same tensor). Replicated pieces are written once, by the replica
//! whose coordinate is 0 on every replicated mesh dim ([`Param::writer`](candle_dtensor_parallel::Param::writer)). Tensor names
//! are `model.<param>` for parameters and `optim.<param>.exp_avg` / `optim.<param>.exp_avg_sq`
//! for AdamW's moments (PyTorch's names).
//!
//! The manifest ([`Manifest`], JSON) records the step, the mesh that saved it, the optimizer's
//! step count and hyper-parameters, caller data (`extra`: seeds, data position), every rank
//! file with its size, and for every tensor its global shape, dtype and chunks: global
//! `offsets` and `sizes`, the `file` and `key` holding it, and the CRC-32 of its bytes.
//!
//! [`save`] and [`load`] take a [`ParamStore`]; [`save_vars`] and [`load_vars`] take any
//! model's vars described as [`CheckpointVar`]s (name, var, global shape, boxes, writer), e.g.
//! an [`FsdpVarMap`](candle_dtensor_parallel::fsdp_vb::FsdpVarMap)'s shards or a plain `VarMap` on one process
//! (what [`crate::fit::Trainer::save`] uses). Both write and read the same format, so either
//! loads the other's checkpoints.
//!
//! # Atomicity
//!
//! [`save`]: rank 0 clears the step directory if it exists (removing its manifest first), then
//! every rank writes `rank-<r>.safetensors.tmp`, fsyncs it, renames it and fsyncs the
//! directory; the chunk lists are gathered; rank 0 validates them (every element saved exactly
//! once), writes `manifest.json.tmp`, fsyncs, renames and fsyncs the directory. A crash at any
//! point leaves either no manifest for the step (the step is ignored by [`load`] with
//! [`Which::Latest`]) or a complete checkpoint; earlier steps are never touched. A failure on
//! any rank fails [`save`] on every rank and no manifest is written.
//!
//! # Loading with resharding
//!
//! [`load`] lets every rank compute the boxes of its *current* layout, intersect them with the
//! saved chunks (PyTorch DCP's "naive quadratic" planner) and read only the chunks that
//! overlap (a whole chunk, from its offset in the file: the checksum covers it). Everything is
//! read, checksummed and assembled first; only when every rank has succeeded are the vars and
//! the optimizer state set, so an error leaves every rank's model untouched.
//!
//! [`consolidate`] writes one plain safetensors file of full parameters (names are the
//! parameter names) that `candle_nn::VarBuilder::from_mmaped_safetensors` reads, holding one
//! full tensor at a time; [`StoreCheckpoint::load_safetensors`] starts distributed training from such
//! a file, each rank reading its boxes.
//!
//! # Blocking
//!
//! [`save`], [`load`] and [`StoreCheckpoint::load_safetensors`] are collective over the store's
//! mesh (every rank calls them) and exchange small messages on its root communicator with a
//! timeout of at least [`IO_TIMEOUT`], so a slow disk on one rank does not time its peers out.

mod chunks;
mod exchange;
mod load;
mod save;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::Var;
use candle_dtensor_comm::CommError;
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::params::VarBox;

pub use load::{consolidate, load, load_vars};
pub use save::{save, save_vars};

/// Name of a checkpoint's manifest inside its step directory.
pub const MANIFEST: &str = "manifest.json";
/// The `format` field of every manifest.
pub const FORMAT: &str = "candle-dtensor-checkpoint";
/// The manifest version this code writes and reads.
pub const VERSION: u32 = 1;
/// Minimum timeout of the collectives of [`save`] and [`load`] (they wait for the slowest
/// rank's disk).
pub const IO_TIMEOUT: Duration = Duration::from_secs(600);

// === Errors ===

/// Errors of saving and loading checkpoints. Integrity errors name the tensor and the file.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An I/O operation on `file` failed.
    #[error("checkpoint: {op} {file}: {source}")]
    Io {
        /// What was being done (`create`, `write`, `rename`, ...).
        op: &'static str,
        /// The file or directory.
        file: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// No complete checkpoint (a step directory with a manifest) was found.
    #[error("checkpoint: no complete checkpoint{} in {}", step.map(|s| format!(" for step {s}")).unwrap_or_default(), dir.display())]
    NotFound {
        /// The checkpoint root directory.
        dir: PathBuf,
        /// The step asked for (`None`: the latest).
        step: Option<usize>,
    },
    /// A data file the manifest lists does not exist.
    #[error("checkpoint: tensor {tensor}: file {} is missing", file.display())]
    MissingFile {
        /// A tensor with a chunk in the file.
        tensor: String,
        /// The missing file.
        file: PathBuf,
    },
    /// A file is shorter than the manifest (or its own header) says.
    #[error("checkpoint: tensor {tensor}: file {} is truncated ({found} bytes, expected {expected})", file.display())]
    Truncated {
        /// A tensor with a chunk in the file.
        tensor: String,
        /// The file.
        file: PathBuf,
        /// Bytes expected.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// A chunk's bytes do not match the checksum in the manifest.
    #[error("checkpoint: tensor {tensor}: checksum mismatch for chunk {key} at {offsets:?} in {}: crc32 {found:08x}, manifest says {expected:08x}", file.display())]
    Checksum {
        /// The tensor.
        tensor: String,
        /// The rank file.
        file: PathBuf,
        /// The chunk's key in the file.
        key: String,
        /// The chunk's global offsets.
        offsets: Vec<usize>,
        /// The checksum in the manifest.
        expected: u32,
        /// The checksum of the bytes read.
        found: u32,
    },
    /// A tensor's shape differs from the model's.
    #[error("checkpoint: tensor {tensor}: shape {found:?} in {} but the model's is {expected:?}", file.display())]
    ShapeMismatch {
        /// The tensor.
        tensor: String,
        /// The manifest or file that describes it.
        file: PathBuf,
        /// The model's shape.
        expected: Vec<usize>,
        /// The saved shape.
        found: Vec<usize>,
    },
    /// A tensor's dtype differs from the model's.
    #[error("checkpoint: tensor {tensor}: dtype {found} in {} but the model's is {expected}", file.display())]
    DtypeMismatch {
        /// The tensor.
        tensor: String,
        /// The manifest or file that describes it.
        file: PathBuf,
        /// The model's dtype.
        expected: String,
        /// The saved dtype.
        found: String,
    },
    /// The model (or optimizer) has a tensor the checkpoint lacks.
    #[error("checkpoint: tensor {tensor} is missing from {}", file.display())]
    MissingTensor {
        /// The tensor.
        tensor: String,
        /// The manifest or file searched.
        file: PathBuf,
    },
    /// The checkpoint has a parameter the model lacks (another architecture).
    #[error("checkpoint: tensor {tensor} in {} is not a parameter of the model", file.display())]
    UnexpectedTensor {
        /// The tensor.
        tensor: String,
        /// The manifest or file.
        file: PathBuf,
    },
    /// A manifest or file is malformed (bad JSON or header, chunks that overlap or leave
    /// holes, a chunk whose stored shape differs from the manifest's, ...).
    #[error("checkpoint: {}: {reason}", file.display())]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong, naming the tensor where there is one.
        reason: String,
    },
    /// Something this format does not handle (Partial parameters, non-CPU tensors, ...).
    #[error("checkpoint: unsupported: {0}")]
    Unsupported(String),
    /// Another rank failed; its message.
    #[error("checkpoint: rank {rank} failed: {message}")]
    Peer {
        /// The first failing rank.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// Ranks saw different checkpoints (e.g. a directory not shared by every rank).
    #[error("checkpoint: ranks disagree: {0}")]
    Inconsistent(String),
    /// A collective failed.
    #[error("checkpoint: {0}")]
    Comm(#[from] CommError),
    /// A candle op failed.
    #[error("checkpoint: candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`CheckpointError`].
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

fn io<'a>(op: &'static str, file: &'a Path) -> impl FnOnce(std::io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io {
        op,
        file: file.to_path_buf(),
        source,
    }
}

fn corrupt(file: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        file: file.to_path_buf(),
        reason: reason.into(),
    }
}

// === What is saved ===

/// One variable of a model as the checkpoint sees it: [`save_vars`] and [`load_vars`] take a
/// list of these, for parameters that are not in a [`ParamStore`] (an
/// [`FsdpVarMap`](candle_dtensor_parallel::fsdp_vb::FsdpVarMap)'s shards, [`tp_nn`](candle_dtensor_parallel::tp_nn) pieces, a plain
/// `VarMap`; [`crate::fit::Trainer`] builds the list). A [`ParamStore`] converts to the same
/// list ([`StoreCheckpoint::checkpoint_vars`]), so both write the same format.
#[derive(Debug, Clone)]
pub struct CheckpointVar {
    /// The parameter's name (the checkpoint's `model.<name>`).
    pub name: String,
    /// This rank's var (its dtype is the saved dtype).
    pub var: Var,
    /// The global (single-device) shape.
    pub global_dims: Vec<usize>,
    /// Where `var`'s elements sit in the global tensor (none: an empty piece).
    pub boxes: Vec<VarBox>,
    /// Whether this rank writes `var`: exactly one of the ranks holding an identical copy.
    pub writer: bool,
}

/// What checkpoints add to a [`ParamStore`] (candle-dtensor-parallel's, which knows nothing
/// of checkpoints): its parameters as [`CheckpointVar`]s, and loading a plain safetensors file
/// into it. Import it to call these as methods.
pub trait StoreCheckpoint {
    /// The store's parameters as [`CheckpointVar`]s (what [`save`] and [`load`] use).
    fn checkpoint_vars(&self) -> Vec<CheckpointVar>;

    /// Sets every parameter from a plain safetensors file of full tensors named by parameter
    /// name (e.g. from [`consolidate`], or candle's `safetensors::save`): each rank reads only
    /// the byte span of its boxes. Shapes and dtypes must match the model, and the file must
    /// hold exactly the model's parameters. Collective; nothing is set unless every rank
    /// succeeded.
    ///
    /// # Errors
    ///
    /// Missing or truncated file, missing or unexpected tensor, shape or dtype mismatch, a
    /// peer's failure.
    ///
    /// # Blocking
    ///
    /// Waits for every rank's reads (timeout at least [`IO_TIMEOUT`]).
    fn load_safetensors(&self, path: &Path) -> Result<()>;
}

// === Manifest ===

/// What a saved tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A model parameter.
    Param,
    /// AdamW's first moment of a parameter.
    ExpAvg,
    /// AdamW's second moment of a parameter.
    ExpAvgSq,
}

/// The checkpoint name of `kind` of parameter `param`.
pub fn fqn(kind: TensorKind, param: &str) -> String {
    match kind {
        TensorKind::Param => format!("model.{param}"),
        TensorKind::ExpAvg => format!("optim.{param}.exp_avg"),
        TensorKind::ExpAvgSq => format!("optim.{param}.exp_avg_sq"),
    }
}

/// One saved box of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkMeta {
    /// Global offsets, per dim.
    pub offsets: Vec<usize>,
    /// Sizes, per dim.
    pub sizes: Vec<usize>,
    /// The rank file (relative to the step directory).
    pub file: String,
    /// The tensor's key in that file.
    pub key: String,
    /// CRC-32 (IEEE) of the chunk's little-endian bytes.
    pub crc32: u32,
}

/// A saved tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The parameter it belongs to.
    pub param: String,
    /// What it is.
    pub kind: TensorKind,
    /// Global shape.
    pub shape: Vec<usize>,
    /// candle dtype name (`f32`, `bf16`, ...).
    pub dtype: String,
    /// The saved boxes: disjoint, together exactly the tensor.
    pub chunks: Vec<ChunkMeta>,
}

/// A rank file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    /// The rank that wrote it.
    pub rank: usize,
    /// Its size in bytes.
    pub bytes: u64,
}

/// AdamW's scalar state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// Steps taken (the bias-correction `t`).
    pub step: usize,
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// The manifest of one checkpoint (`manifest.json`); see the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`] of the writer.
    pub version: u32,
    /// The training step (steps completed).
    pub step: usize,
    /// Ranks of the saving world.
    pub world_size: usize,
    /// Mesh dims (name, size) of the saving run.
    pub mesh: Vec<(String, usize)>,
    /// AdamW's scalar state, if an optimizer was saved.
    pub optimizer: Option<OptimizerMeta>,
    /// Caller data (seeds, data position, ...).
    pub extra: serde_json::Value,
    /// Rank files by name.
    pub files: BTreeMap<String, FileMeta>,
    /// Tensors by name ([`fqn`]).
    pub tensors: BTreeMap<String, TensorMeta>,
}

/// Which checkpoint to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// The complete checkpoint with the highest step.
    Latest,
    /// The checkpoint of this step.
    Step(usize),
}

/// What [`save`] did on this rank.
#[derive(Debug, Clone)]
pub struct SaveInfo {
    /// The step directory.
    pub dir: PathBuf,
    /// Bytes this rank wrote (0 if it holds no designated piece).
    pub bytes: u64,
    /// Chunks this rank wrote.
    pub chunks: usize,
}

/// What [`load`] did on this rank.
#[derive(Debug, Clone)]
pub struct LoadInfo {
    /// The step loaded.
    pub step: usize,
    /// Its directory.
    pub dir: PathBuf,
    /// The caller data saved with it.
    pub extra: serde_json::Value,
    /// The optimizer step count restored (`None` without an optimizer).
    pub optimizer_step: Option<usize>,
    /// Bytes of chunks this rank read.
    pub bytes_read: u64,
}

/// What [`consolidate`] wrote.
#[derive(Debug, Clone)]
pub struct ConsolidateInfo {
    /// The step consolidated.
    pub step: usize,
    /// Number of tensors written.
    pub tensors: usize,
    /// Size of the output file.
    pub bytes: u64,
}

// === Directory layout ===

/// The directory of `step` under `root`.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step}"))
}

/// The steps under `root` that have a manifest, ascending. A missing `root` has none.
///
/// # Errors
///
/// `root` cannot be listed.
pub fn complete_steps(root: &Path) -> Result<Vec<usize>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io("list", root)(e)),
    };
    let mut steps = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io("list", root))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if entry.path().join(MANIFEST).is_file() {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// The highest complete step under `root`.
///
/// # Errors
///
/// `root` cannot be listed.
pub fn latest_step(root: &Path) -> Result<Option<usize>> {
    Ok(complete_steps(root)?.last().copied())
}

fn resolve(root: &Path, which: Which) -> Result<usize> {
    match which {
        Which::Step(s) if step_dir(root, s).join(MANIFEST).is_file() => Ok(s),
        Which::Step(s) => Err(CheckpointError::NotFound {
            dir: root.to_path_buf(),
            step: Some(s),
        }),
        Which::Latest => latest_step(root)?.ok_or_else(|| CheckpointError::NotFound {
            dir: root.to_path_buf(),
            step: None,
        }),
    }
}

/// Reads and checks the manifest of `step` under `root`.
///
/// # Errors
///
/// A missing or malformed manifest, or one of another format or version.
pub fn read_manifest(root: &Path, step: usize) -> Result<Manifest> {
    let path = step_dir(root, step).join(MANIFEST);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::NotFound {
                dir: root.to_path_buf(),
                step: Some(step),
            })
        }
        Err(e) => return Err(io("read", &path)(e)),
    };
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(&path, format!("invalid manifest: {e}")))?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(corrupt(
            &path,
            format!(
                "format {:?} version {}; this reader handles {FORMAT:?} version {VERSION}",
                m.format, m.version
            ),
        ));
    }
    if m.step != step {
        return Err(corrupt(
            &path,
            format!(
                "manifest of step {} in the directory of step {step}",
                m.step
            ),
        ));
    }
    Ok(m)
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync", dir))
}
