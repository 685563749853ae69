//! Bytes, boxes and safetensors files: encoding tensors, copying boxes between row-major
//! arrays, checking chunk geometry, and reading chunks with their checksums.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use candle_core::{DType, Tensor, Var};
use safetensors::tensor::{Metadata, TensorInfo};

use super::{
    corrupt, io, step_dir, CheckpointError, ChunkMeta, Manifest, Result, TensorMeta, MANIFEST,
};
use candle_dtensor_parallel::params::VarBox;

/// Largest safetensors header accepted (the crate's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// A tensor's elements (any device) as little-endian bytes (row-major), staged through host
/// memory.
pub(super) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(candle_dtensor_kernels::storage::host_bytes(t)?)
}

pub(super) fn parse_dtype(s: &str, file: &Path, tensor: &str) -> Result<DType> {
    DType::from_str(s).map_err(|_| corrupt(file, format!("tensor {tensor}: unknown dtype {s:?}")))
}

/// The intersection of two boxes (offsets, sizes), if non-empty.
pub(super) fn intersect(
    a_off: &[usize],
    a_size: &[usize],
    b_off: &[usize],
    b_size: &[usize],
) -> Option<(Vec<usize>, Vec<usize>)> {
    let mut off = Vec::with_capacity(a_off.len());
    let mut size = Vec::with_capacity(a_off.len());
    for d in 0..a_off.len() {
        let lo = a_off[d].max(b_off[d]);
        let hi = (a_off[d] + a_size[d]).min(b_off[d] + b_size[d]);
        if hi <= lo {
            return None;
        }
        off.push(lo);
        size.push(hi - lo);
    }
    Some((off, size))
}

pub(super) fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * dims[d + 1];
    }
    s
}

/// A row-major array of `dims` elements of `elem` bytes, whose first `skip` elements are not
/// in `bytes` (a span read from the middle of a file).
pub(super) struct Array<'a, B> {
    pub(super) bytes: B,
    pub(super) dims: &'a [usize],
    pub(super) skip: usize,
}

/// Copies the box of `size` at `src_start` in `src` to `dst_start` in `dst`. Trailing dims that
/// are whole in both arrays merge into one contiguous run.
pub(super) fn copy_box(
    src: &Array<'_, &[u8]>,
    src_start: &[usize],
    dst: &mut Array<'_, &mut [u8]>,
    dst_start: &[usize],
    size: &[usize],
    elem: usize,
) -> std::result::Result<(), String> {
    let nd = size.len();
    if size.contains(&0) {
        return Ok(());
    }
    let (ss, ds) = (strides(src.dims), strides(dst.dims));
    let mut j = nd.saturating_sub(1);
    while j > 0 && size[j] == src.dims[j] && size[j] == dst.dims[j] {
        j -= 1;
    }
    let run = if nd == 0 {
        elem
    } else {
        size[j..].iter().product::<usize>() * elem
    };
    let outer: usize = size[..j].iter().product();
    let mut idx = vec![0usize; j];
    for _ in 0..outer {
        let mut so = 0;
        let mut dof = 0;
        for d in 0..nd {
            let i = if d < j { idx[d] } else { 0 };
            so += (src_start[d] + i) * ss[d];
            dof += (dst_start[d] + i) * ds[d];
        }
        let so = so
            .checked_sub(src.skip)
            .ok_or("source box before the data read")?
            * elem;
        let dof = dof
            .checked_sub(dst.skip)
            .ok_or("destination box out of range")?
            * elem;
        let s = src
            .bytes
            .get(so..so + run)
            .ok_or("source box out of range")?;
        dst.bytes
            .get_mut(dof..dof + run)
            .ok_or("destination box out of range")?
            .copy_from_slice(s);
        for d in (0..j).rev() {
            idx[d] += 1;
            if idx[d] < size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(())
}

/// Sets `var` (any device) from its little-endian bytes, in place.
pub(super) fn set_var(var: &Var, bytes: &[u8]) -> Result<()> {
    Ok(candle_dtensor_kernels::storage::set_from_bytes(
        var.as_tensor(),
        bytes,
    )?)
}

/// The dims of a var as seen by its boxes (an FSDP-sharded scalar is a `[1]` var of a 0-d
/// tensor).
pub(super) fn local_dims(var: &Var, global_rank: usize) -> Result<Vec<usize>> {
    if var.rank() == global_rank {
        Ok(var.dims().to_vec())
    } else if global_rank == 0 {
        Ok(Vec::new())
    } else {
        Err(CheckpointError::Unsupported(format!(
            "a var of rank {} for a tensor of rank {global_rank}",
            var.rank()
        )))
    }
}

/// The elements of `t` (shaped like the var) in box `b`, contiguous.
pub(super) fn box_data(t: &Tensor, b: &VarBox) -> Result<Tensor> {
    if t.rank() != b.shape.len() {
        // An FSDP-sharded scalar: the var is [1], the box 0-d.
        return Ok(t.reshape(b.shape.as_slice())?);
    }
    let mut out = t.clone();
    for (d, (&off, &n)) in b.local_offset.iter().zip(&b.shape).enumerate() {
        if off != 0 || n != t.dim(d)? {
            out = out.narrow(d, off, n)?;
        }
    }
    Ok(out)
}

/// Writes a safetensors header for `entries` (key, dtype, shape) in that order and returns it
/// with the 8-byte length prefix, and the total data length.
pub(super) fn safetensors_header(
    entries: &[(String, DType, Vec<usize>)],
    file: &Path,
) -> Result<Vec<u8>> {
    let mut offset = 0;
    let mut infos = Vec::with_capacity(entries.len());
    for (key, dtype, shape) in entries {
        let n = shape.iter().product::<usize>() * dtype.size_in_bytes();
        infos.push((
            key.clone(),
            TensorInfo {
                dtype: (*dtype).into(),
                shape: shape.clone(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let meta = Metadata::new(None, infos).map_err(|e| corrupt(file, format!("header: {e}")))?;
    let mut header =
        serde_json::to_vec(&meta).map_err(|e| corrupt(file, format!("header: {e}")))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    Ok(out)
}

/// An open safetensors file with its parsed header.
pub(super) struct OpenFile {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) header: Metadata,
    pub(super) data_start: u64,
    pub(super) len: u64,
}

impl OpenFile {
    /// Opens `path`, checks its length against `expected_len` (when known) and parses its
    /// header. `tensor` names a tensor stored there, for errors.
    pub(super) fn open(path: &Path, expected_len: Option<u64>, tensor: &str) -> Result<OpenFile> {
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CheckpointError::MissingFile {
                    tensor: tensor.to_string(),
                    file: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io("open", path)(e)),
        };
        let len = file.metadata().map_err(io("stat", path))?.len();
        let truncated = |expected: u64| CheckpointError::Truncated {
            tensor: tensor.to_string(),
            file: path.to_path_buf(),
            expected,
            found: len,
        };
        if let Some(expected) = expected_len {
            if len < expected {
                return Err(truncated(expected));
            }
            if len > expected {
                return Err(corrupt(
                    path,
                    format!("{len} bytes but the manifest records {expected}"),
                ));
            }
        }
        if len < 8 {
            return Err(truncated(8));
        }
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(io("read", path))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER {
            return Err(corrupt(path, format!("header of {n} bytes")));
        }
        if 8 + n > len {
            return Err(truncated(8 + n));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io("read", path))?;
        let header: Metadata = serde_json::from_slice(&header)
            .map_err(|e| corrupt(path, format!("invalid safetensors header: {e}")))?;
        let data_start = 8 + n;
        if data_start + header.data_len() as u64 > len {
            return Err(truncated(data_start + header.data_len() as u64));
        }
        Ok(OpenFile {
            file,
            path: path.to_path_buf(),
            header,
            data_start,
            len,
        })
    }

    /// The info of `key`, checked against `dtype` and `shape`.
    pub(super) fn info(
        &self,
        tensor: &str,
        key: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<TensorInfo> {
        let info = self
            .header
            .info(key)
            .ok_or_else(|| CheckpointError::MissingTensor {
                tensor: if key == tensor {
                    tensor.to_string()
                } else {
                    format!("{tensor} (key {key})")
                },
                file: self.path.clone(),
            })?
            .clone();
        let st: safetensors::Dtype = dtype.into();
        if info.dtype != st {
            return Err(CheckpointError::DtypeMismatch {
                tensor: tensor.to_string(),
                file: self.path.clone(),
                expected: dtype.as_str().to_string(),
                found: format!("{:?}", info.dtype),
            });
        }
        if info.shape != shape {
            return Err(CheckpointError::ShapeMismatch {
                tensor: tensor.to_string(),
                file: self.path.clone(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        Ok(info)
    }

    /// Reads `len` bytes at `offset` of the data section.
    pub(super) fn read(&mut self, tensor: &str, offset: u64, len: usize) -> Result<Vec<u8>> {
        let at = self.data_start + offset;
        if at + len as u64 > self.len {
            return Err(CheckpointError::Truncated {
                tensor: tensor.to_string(),
                file: self.path.clone(),
                expected: at + len as u64,
                found: self.len,
            });
        }
        self.file
            .seek(SeekFrom::Start(at))
            .map_err(io("seek", &self.path))?;
        let mut buf = vec![0u8; len];
        match self.file.read_exact(&mut buf) {
            Ok(()) => Ok(buf),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(CheckpointError::Truncated {
                    tensor: tensor.to_string(),
                    file: self.path.clone(),
                    expected: at + len as u64,
                    found: self.len,
                })
            }
            Err(e) => Err(io("read", &self.path)(e)),
        }
    }
}

/// The data files of one checkpoint, opened on demand.
pub(super) struct DataFiles<'a> {
    pub(super) dir: PathBuf,
    pub(super) manifest: &'a Manifest,
    pub(super) manifest_path: PathBuf,
    pub(super) open: HashMap<String, OpenFile>,
    pub(super) bytes_read: u64,
}

impl<'a> DataFiles<'a> {
    pub(super) fn new(root: &Path, manifest: &'a Manifest) -> Self {
        let dir = step_dir(root, manifest.step);
        let manifest_path = dir.join(MANIFEST);
        DataFiles {
            dir,
            manifest,
            manifest_path,
            open: HashMap::new(),
            bytes_read: 0,
        }
    }

    pub(super) fn file(&mut self, name: &str, tensor: &str) -> Result<&mut OpenFile> {
        if !self.open.contains_key(name) {
            let meta = self.manifest.files.get(name).ok_or_else(|| {
                corrupt(
                    &self.manifest_path,
                    format!("tensor {tensor}: chunk in unlisted file {name:?}"),
                )
            })?;
            if name.contains(['/', '\\']) || name.starts_with('.') {
                return Err(corrupt(
                    &self.manifest_path,
                    format!("file name {name:?} is not a plain file name"),
                ));
            }
            let f = OpenFile::open(&self.dir.join(name), Some(meta.bytes), tensor)?;
            self.open.insert(name.to_string(), f);
        }
        self.open.get_mut(name).ok_or_else(|| {
            corrupt(
                &self.manifest_path,
                format!("file {name:?} could not be kept open"),
            )
        })
    }

    /// The data offset of `chunk` in its file (for ordering reads).
    pub(super) fn offset_of(
        &mut self,
        tensor: &str,
        dtype: DType,
        chunk: &ChunkMeta,
    ) -> Result<u64> {
        let f = self.file(&chunk.file, tensor)?;
        Ok(f.info(tensor, &chunk.key, dtype, &chunk.sizes)?
            .data_offsets
            .0 as u64)
    }

    /// Reads one chunk of `tensor` and verifies its shape, dtype and checksum.
    pub(super) fn read_chunk(
        &mut self,
        tensor: &str,
        dtype: DType,
        chunk: &ChunkMeta,
    ) -> Result<Vec<u8>> {
        let f = self.file(&chunk.file, tensor)?;
        let info = f.info(tensor, &chunk.key, dtype, &chunk.sizes)?;
        let (a, b) = info.data_offsets;
        let bytes = f.read(tensor, a as u64, b - a)?;
        let found = crc32fast::hash(&bytes);
        if found != chunk.crc32 {
            return Err(CheckpointError::Checksum {
                tensor: tensor.to_string(),
                file: f.path.clone(),
                key: chunk.key.clone(),
                offsets: chunk.offsets.clone(),
                expected: chunk.crc32,
                found,
            });
        }
        self.bytes_read += bytes.len() as u64;
        Ok(bytes)
    }
}

/// Checks that `meta`'s chunks lie inside the tensor, do not overlap, and cover it.
pub(super) fn check_chunks(name: &str, meta: &TensorMeta, file: &Path) -> Result<()> {
    let nd = meta.shape.len();
    let mut volume = 0usize;
    for (i, c) in meta.chunks.iter().enumerate() {
        if c.offsets.len() != nd
            || c.sizes.len() != nd
            || (0..nd).any(|d| c.offsets[d] + c.sizes[d] > meta.shape[d])
        {
            return Err(corrupt(
                file,
                format!(
                    "tensor {name}: chunk at {:?} of {:?} is outside the shape {:?}",
                    c.offsets, c.sizes, meta.shape
                ),
            ));
        }
        for o in &meta.chunks[..i] {
            if c.sizes.iter().all(|&s| s > 0)
                && intersect(&c.offsets, &c.sizes, &o.offsets, &o.sizes).is_some()
            {
                return Err(corrupt(
                    file,
                    format!(
                        "tensor {name}: chunks at {:?} and {:?} overlap",
                        o.offsets, c.offsets
                    ),
                ));
            }
        }
        volume += c.sizes.iter().product::<usize>();
    }
    let numel: usize = meta.shape.iter().product();
    if volume != numel {
        return Err(corrupt(
            file,
            format!("tensor {name}: the chunks hold {volume} of its {numel} elements"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorKind;

    #[test]
    pub(super) fn copy_box_merges_and_offsets() {
        // src: 4x5 of u8 values r*10+c; copy rows 1..3, cols 2..5 into a 3x4 dst at (1, 1).
        let src: Vec<u8> = (0..4)
            .flat_map(|r| (0..5).map(move |c| r * 10 + c))
            .collect();
        let mut dst = vec![0u8; 12];
        let s = Array {
            bytes: src.as_slice(),
            dims: &[4, 5],
            skip: 0,
        };
        let mut d = Array {
            bytes: dst.as_mut_slice(),
            dims: &[3, 4],
            skip: 0,
        };
        copy_box(&s, &[1, 2], &mut d, &[1, 1], &[2, 3], 1).unwrap();
        assert_eq!(dst, vec![0, 0, 0, 0, 0, 12, 13, 14, 0, 22, 23, 24]);
        // Whole rows merge into one run; a skipped prefix is honoured.
        let mut dst = vec![0u8; 10];
        let s = Array {
            bytes: &src[5..15],
            dims: &[4, 5],
            skip: 5,
        };
        let mut d = Array {
            bytes: dst.as_mut_slice(),
            dims: &[2, 5],
            skip: 0,
        };
        copy_box(&s, &[1, 0], &mut d, &[0, 0], &[2, 5], 1).unwrap();
        assert_eq!(dst, (10..15).chain(20..25).collect::<Vec<u8>>());
        // Out of range is an error, not a panic.
        let mut d = Array {
            bytes: dst.as_mut_slice(),
            dims: &[2, 5],
            skip: 0,
        };
        assert!(copy_box(&s, &[3, 0], &mut d, &[0, 0], &[1, 5], 1).is_err());
    }

    #[test]
    pub(super) fn chunk_checks() {
        let c = |o: Vec<usize>, s: Vec<usize>| ChunkMeta {
            offsets: o,
            sizes: s,
            file: "f".into(),
            key: "k".into(),
            crc32: 0,
        };
        let mut t = TensorMeta {
            param: "w".into(),
            kind: TensorKind::Param,
            shape: vec![4, 2],
            dtype: "f32".into(),
            chunks: vec![c(vec![0, 0], vec![3, 2]), c(vec![3, 0], vec![1, 2])],
        };
        let p = Path::new("m");
        check_chunks("w", &t, p).unwrap();
        t.chunks[1] = c(vec![2, 0], vec![2, 2]);
        assert!(check_chunks("w", &t, p).is_err(), "overlap");
        t.chunks[1] = c(vec![3, 0], vec![1, 1]);
        assert!(check_chunks("w", &t, p).is_err(), "hole");
        t.chunks[1] = c(vec![3, 0], vec![2, 2]);
        assert!(check_chunks("w", &t, p).is_err(), "outside");
    }
}
