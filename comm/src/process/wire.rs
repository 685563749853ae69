//! What travels between two ranks of a process communicator: frame headers, op descriptors
//! and failures (as JSON), and tensors with their shape.
//!
//! A frame is a 24-byte header followed by `len` payload bytes:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind: HELLO = 1, DATA = 2, P2P = 3, FAIL = 4, BYE = 5, AGREE = 6 |
//! | 1..4 | zero |
//! | 4..8 | step `u32` (DATA: which message of the collective; AGREE: the round) |
//! | 8..16 | tag `u64` (HELLO, DATA: the collective index; AGREE: the agreement's number) |
//! | 16..24 | len `u64` |
//!
//! All integers are little-endian. HELLO carries the sender's
//! [`OpDesc`](crate::desc::OpDesc) of collective `tag` as JSON; DATA carries raw element bytes
//! (or an encoded tensor, see [`tensor_preamble`]); P2P carries an encoded tensor; FAIL carries
//! a [`Failure`](crate::desc::Failure) as JSON; BYE is empty (the sender closed the
//! communicator on purpose); AGREE carries one message of a fault-tolerant agreement
//! (`crate::agree`, JSON), which is never held back by the buffer cap.

use candle_core::DType;

use crate::types::SUPPORTED_DTYPES;

/// Header size in bytes.
pub(crate) const HEADER: usize = 24;
/// Frame kinds.
pub(crate) const HELLO: u8 = 1;
pub(crate) const DATA: u8 = 2;
pub(crate) const P2P: u8 = 3;
pub(crate) const FAIL: u8 = 4;
pub(crate) const BYE: u8 = 5;
pub(crate) const AGREE: u8 = 6;
/// The largest payload accepted (a garbage length must not allocate).
pub(crate) const MAX_PAYLOAD: u64 = 1 << 40;

/// A decoded frame header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub kind: u8,
    pub step: u32,
    pub tag: u64,
    pub len: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0] = self.kind;
        h[4..8].copy_from_slice(&self.step.to_le_bytes());
        h[8..16].copy_from_slice(&self.tag.to_le_bytes());
        h[16..24].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    pub(crate) fn decode(h: &[u8; HEADER]) -> Result<Header, String> {
        let kind = h[0];
        if !(HELLO..=AGREE).contains(&kind) {
            return Err(format!("unknown frame kind {kind}"));
        }
        let step = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let mut t = [0u8; 8];
        t.copy_from_slice(&h[8..16]);
        let tag = u64::from_le_bytes(t);
        t.copy_from_slice(&h[16..24]);
        let len = u64::from_le_bytes(t);
        if len > MAX_PAYLOAD {
            return Err(format!("implausible payload length {len}"));
        }
        Ok(Header {
            kind,
            step,
            tag,
            len,
        })
    }
}

/// A received payload (8-byte aligned, so it can be read as any supported element type).
pub(crate) type Payload = crate::cpu::bytes::Bytes;

/// The wire code of a supported dtype (its index in [`SUPPORTED_DTYPES`]).
pub(crate) fn dtype_code(d: DType) -> Option<u8> {
    SUPPORTED_DTYPES
        .iter()
        .position(|&x| x == d)
        .map(|i| i as u8)
}

fn dtype_of(code: u8) -> Option<DType> {
    SUPPORTED_DTYPES.get(code as usize).copied()
}

/// The preamble of a tensor on the wire: `dtype: u8 | ndims: u8 | dims: u64 * ndims`,
/// followed by the element bytes.
pub(crate) fn tensor_preamble(dtype: DType, dims: &[usize]) -> Result<Vec<u8>, String> {
    let code = dtype_code(dtype).ok_or_else(|| format!("dtype {dtype:?} cannot travel"))?;
    if dims.len() > u8::MAX as usize {
        return Err(format!("{} dims are too many", dims.len()));
    }
    let mut b = Vec::with_capacity(2 + 8 * dims.len());
    b.push(code);
    b.push(dims.len() as u8);
    for &d in dims {
        b.extend_from_slice(&(d as u64).to_le_bytes());
    }
    Ok(b)
}

/// Splits an encoded tensor into (dtype, dims, element bytes), checking the byte count.
pub(crate) fn decode_tensor(p: &[u8]) -> Result<(DType, Vec<usize>, &[u8]), String> {
    if p.len() < 2 {
        return Err("truncated tensor frame".into());
    }
    let dtype = dtype_of(p[0]).ok_or_else(|| format!("unknown dtype code {}", p[0]))?;
    let nd = p[1] as usize;
    let head = 2 + 8 * nd;
    if p.len() < head {
        return Err("truncated tensor dims".into());
    }
    let dims: Vec<usize> = (0..nd)
        .map(|i| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&p[2 + 8 * i..10 + 8 * i]);
            u64::from_le_bytes(a) as usize
        })
        .collect();
    let elems = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or("tensor dims overflow")?;
    let want = elems
        .checked_mul(dtype.size_in_bytes())
        .ok_or("tensor size overflows")?;
    let data = &p[head..];
    if data.len() != want {
        return Err(format!(
            "tensor frame of {dims:?} {dtype:?} carries {} bytes, expected {want}",
            data.len()
        ));
    }
    Ok((dtype, dims, data))
}

/// Encodes a split list or split sizes (`u64` each).
pub(crate) fn encode_usizes(v: &[usize]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as u64).to_le_bytes()).collect()
}

/// Decodes [`encode_usizes`].
pub(crate) fn decode_usizes(b: &[u8]) -> Result<Vec<usize>, String> {
    if b.len() % 8 != 0 {
        return Err(format!("{} bytes is not a list of u64", b.len()));
    }
    Ok(b.chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a) as usize
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        let h = Header {
            kind: DATA,
            step: 7,
            tag: 1 << 40,
            len: 12345,
        };
        let d = Header::decode(&h.encode()).unwrap();
        assert_eq!((d.kind, d.step, d.tag, d.len), (DATA, 7, 1 << 40, 12345));
        let mut bad = h.encode();
        bad[0] = 99;
        assert!(Header::decode(&bad).is_err());
        let mut huge = h.encode();
        huge[23] = 0xff;
        assert!(Header::decode(&huge).is_err());
    }

    #[test]
    fn tensors_round_trip() {
        let mut p = tensor_preamble(DType::BF16, &[2, 3]).unwrap();
        p.extend_from_slice(&[0u8; 12]);
        let (d, dims, data) = decode_tensor(&p).unwrap();
        assert_eq!((d, dims, data.len()), (DType::BF16, vec![2, 3], 12));
        assert!(decode_tensor(&p[..p.len() - 1]).is_err());
        assert_eq!(
            decode_usizes(&encode_usizes(&[0, 5, 9])).unwrap(),
            vec![0, 5, 9]
        );
    }
}
