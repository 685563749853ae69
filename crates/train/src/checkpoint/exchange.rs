//! The small collectives of save and load: every rank's bytes, and agreeing on success.

use candle_core::Tensor;
use candle_dtensor_comm::Comm;

use super::{CheckpointError, Result, IO_TIMEOUT};
use candle_dtensor_mesh::DeviceMesh;

/// Every rank's `bytes`, in rank order (two all_gathers: lengths, then padded payloads).
/// Without a communicator (one process), this rank's bytes alone.
pub(super) fn all_gather_bytes(comm: Option<&Comm>, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let Some(comm) = comm else {
        return Ok(vec![bytes.to_vec()]);
    };
    let len = Tensor::new(&[bytes.len() as u32], comm.device())?;
    let lens: Vec<u32> = comm.all_gather_single(&len)?.wait()?.to_vec1()?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    if max == 0 {
        return Ok(vec![Vec::new(); lens.len()]);
    }
    let mut padded = bytes.to_vec();
    padded.resize(max, 0);
    let all: Vec<u8> = comm
        .all_gather_single(&Tensor::from_vec(padded, max, comm.device())?)?
        .wait()?
        .to_vec1()?;
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &n)| all[r * max..r * max + n as usize].to_vec())
        .collect())
}

/// Exchanges every rank's outcome: `Ok(payload)` or an error message. Returns every payload
/// when all ranks succeeded; `Err(Peer)` naming the first failed rank otherwise. The caller
/// returns its own typed error before looking at this result.
pub(super) fn exchange(
    comm: Option<&Comm>,
    own: std::result::Result<Vec<u8>, String>,
) -> Result<Vec<Vec<u8>>> {
    let msg = match own {
        Ok(mut p) => {
            p.insert(0, 0);
            p
        }
        Err(e) => {
            let mut m = vec![1];
            m.extend_from_slice(e.as_bytes());
            m
        }
    };
    let all = all_gather_bytes(comm, &msg)?;
    let mut out = Vec::with_capacity(all.len());
    for (rank, m) in all.into_iter().enumerate() {
        match m.split_first() {
            Some((0, p)) => out.push(p.to_vec()),
            Some((_, e)) => {
                return Err(CheckpointError::Peer {
                    rank,
                    message: String::from_utf8_lossy(e).into_owned(),
                })
            }
            None => {
                return Err(CheckpointError::Peer {
                    rank,
                    message: "sent nothing".into(),
                })
            }
        }
    }
    Ok(out)
}

/// Runs `local` on this rank, then agrees with every rank: returns this rank's value only if
/// every rank succeeded (this rank's own error first, else the first failed peer's).
pub(super) fn agreed<T>(comm: Option<&Comm>, local: Result<T>) -> Result<T> {
    let status = match &local {
        Ok(_) => Ok(Vec::new()),
        Err(e) => Err(e.to_string()),
    };
    let gathered = exchange(comm, status);
    let value = local?;
    gathered?;
    Ok(value)
}

/// The communicator of save and load over `mesh` (none: one process), with a timeout of at
/// least [`IO_TIMEOUT`].
pub(super) fn checkpoint_comm(mesh: Option<&DeviceMesh>) -> Option<Comm> {
    mesh.map(|m| {
        let root = m.root_comm();
        root.with_timeout(root.timeout().max(IO_TIMEOUT))
    })
}
