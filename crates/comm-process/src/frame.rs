//! What travels between two ranks of a process communicator: frame headers, op descriptors
//! and failures (in the shared word form of the kit's `desc`), and tensors with their shape.
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
//! [`OpDesc`](candle_dtensor_comm_core::kit::desc::OpDesc) of collective `tag` in the shared wire form of `desc.rs`
//! (little-endian `u64` words, as the mpi backend sends them); DATA carries raw element bytes
//! (or an encoded tensor, see [`tensor_preamble`]); P2P carries an encoded tensor; FAIL carries
//! a [`Failure`](candle_dtensor_comm_core::kit::desc::Failure) in the same words; BYE is empty (the sender closed the
//! communicator on purpose); AGREE carries one message of a fault-tolerant agreement
//! (`candle_dtensor_comm_core::kit::agree`, JSON), which is never held back by the buffer cap.
//!
//! **Bounds.** A header declares a length the peer chose, so nothing is allocated from it
//! alone: control frames have small fixed caps ([`max_len`]: HELLO 64 KiB, FAIL and AGREE
//! 1 MiB, BYE empty), and every body is read into a buffer that grows only as its bytes arrive
//! (`store::read_growing`: at most twice what arrived, or 64 KiB), so a DATA or P2P frame, whose
//! size the reader cannot know before the op that consumes it runs, costs memory only for the
//! bytes really sent (the per-peer buffer cap of `transport.rs` is checked before each DATA or
//! P2P frame is admitted, so it can be exceeded by that one frame; control frames are capped
//! per frame, not in total). A
//! frame over its kind's cap, of an unknown kind, whose body does not decode, or cut off
//! closes the connection with a [`FrameError`] naming the peer's rank and address, the kind
//! and the sizes.

use std::io::Read;
use std::sync::atomic::AtomicBool;

use candle_core::DType;

use candle_dtensor_comm_core::kit::desc::{
    bytes_to_words, Failure, OpDesc, WireError, MAX_WIRE_DIMS,
};
use candle_dtensor_comm_core::store::{
    growing_error, io_words, read_full_counted, read_growing, FrameError,
};

/// Header size in bytes.
pub(crate) const HEADER: usize = 24;
/// Frame kinds.
pub(crate) const HELLO: u8 = 1;
pub(crate) const DATA: u8 = 2;
pub(crate) const P2P: u8 = 3;
pub(crate) const FAIL: u8 = 4;
pub(crate) const BYE: u8 = 5;
pub(crate) const AGREE: u8 = 6;
/// The largest DATA or P2P payload accepted (its buffer grows only as bytes arrive).
pub(crate) const MAX_PAYLOAD: u64 = 1 << 40;
/// The largest HELLO payload (an op descriptor: 7 words and one per dim).
pub(crate) const MAX_HELLO: u64 = 64 << 10;
/// The largest FAIL or AGREE payload (whose rank lists grow with the world).
pub(crate) const MAX_NOTICE: u64 = 1 << 20;

/// The most words of a FAIL frame's failure (its texts are cut to fit).
pub(crate) const MAX_NOTICE_WORDS: usize = (MAX_NOTICE / 8) as usize;

/// A HELLO body: one op descriptor in the shared wire form, nothing after it.
fn decode_hello(b: &[u8]) -> Result<OpDesc, WireError> {
    let w = bytes_to_words(b)?;
    let (desc, used) = OpDesc::decode_words(&w, MAX_WIRE_DIMS)?;
    if used != w.len() {
        return Err(WireError::TooMany {
            what: "op descriptor words",
            n: w.len() as u64,
            max: used,
        });
    }
    Ok(desc)
}

/// The most bytes a frame of `kind` may carry.
pub(crate) fn max_len(kind: u8) -> u64 {
    match kind {
        HELLO => MAX_HELLO,
        FAIL | AGREE => MAX_NOTICE,
        BYE => 0,
        _ => MAX_PAYLOAD,
    }
}

/// The name of a frame kind, for messages.
pub(crate) fn kind_name(kind: u8) -> String {
    match kind {
        HELLO => "HELLO".into(),
        DATA => "DATA".into(),
        P2P => "P2P".into(),
        FAIL => "FAIL".into(),
        BYE => "BYE".into(),
        AGREE => "AGREE".into(),
        k => format!("unknown kind {k}"),
    }
}

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

    /// Decodes a header from `peer`: a known kind whose length is within [`max_len`].
    pub(crate) fn decode(h: &[u8; HEADER], peer: &str) -> Result<Header, FrameError> {
        let kind = h[0];
        let step = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let mut t = [0u8; 8];
        t.copy_from_slice(&h[8..16]);
        let tag = u64::from_le_bytes(t);
        t.copy_from_slice(&h[16..24]);
        let len = u64::from_le_bytes(t);
        if !(HELLO..=AGREE).contains(&kind) {
            return Err(FrameError::Malformed {
                peer: peer.to_string(),
                kind: kind_name(kind),
                len,
                reason: "unknown frame kind".into(),
            });
        }
        if h[1..4] != [0, 0, 0] {
            return Err(FrameError::Malformed {
                peer: peer.to_string(),
                kind: kind_name(kind),
                len,
                reason: format!("header bytes 1..4 are {:?}, not zero", &h[1..4]),
            });
        }
        if len > max_len(kind) {
            return Err(FrameError::TooLarge {
                peer: peer.to_string(),
                kind: kind_name(kind),
                len,
                max: max_len(kind),
            });
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
pub(crate) type Payload = candle_dtensor_comm_core::kit::cpu::bytes::Bytes;

/// A decoded frame.
pub(crate) enum Frame {
    Hello(OpDesc),
    Data(Payload),
    P2p(Payload),
    Fail(Failure),
    Bye,
    Agree(Payload),
}

/// How reading a frame ended, when it did not yield one.
#[derive(Debug)]
pub(crate) enum ReadEnd {
    /// This end is closing (the stop flag).
    Closing,
    /// The connection ended or failed between frames.
    Closed(std::io::Error),
    /// A frame this end will not read: the connection must be closed.
    Frame(FrameError),
}

/// Reads the next frame from `peer` (`"rank r (address)"`). `admit` sees every DATA and P2P
/// header before its body is read: `Ok(false)` reads and drops the body (the frame is `None`),
/// `Err` ends reading. The body's buffer grows only as its bytes arrive.
pub(crate) fn read_frame<R: Read + ?Sized>(
    r: &mut R,
    peer: &str,
    stop: Option<&AtomicBool>,
    mut admit: impl FnMut(&Header) -> Result<bool, ReadEnd>,
) -> Result<(Header, Option<Frame>), ReadEnd> {
    let mut head = [0u8; HEADER];
    match read_full_counted(r, &mut head, None, stop) {
        Ok(()) => {}
        Err((_, e)) if e.kind() == std::io::ErrorKind::Interrupted => return Err(ReadEnd::Closing),
        Err((0, e)) => return Err(ReadEnd::Closed(e)),
        Err((got, e)) => {
            return Err(ReadEnd::Frame(FrameError::Truncated {
                peer: peer.to_string(),
                kind: "frame header".into(),
                got: got as u64,
                len: HEADER as u64,
                reason: io_words(&e),
            }))
        }
    }
    let h = Header::decode(&head, peer).map_err(ReadEnd::Frame)?;
    let kind = kind_name(h.kind);
    if matches!(h.kind, DATA | P2P) && !admit(&h)? {
        skip(r, h.len, stop).map_err(|(n, e)| {
            if e.kind() == std::io::ErrorKind::Interrupted {
                ReadEnd::Closing
            } else {
                ReadEnd::Frame(growing_error(peer, &kind, h.len, (n, Some(e))))
            }
        })?;
        return Ok((h, None));
    }
    let len = usize::try_from(h.len).map_err(|_| {
        ReadEnd::Frame(FrameError::TooLarge {
            peer: peer.to_string(),
            kind: kind.clone(),
            len: h.len,
            max: usize::MAX as u64,
        })
    })?;
    let payload: Payload = read_growing(r, len, None, stop).map_err(|e| {
        if e.1
            .as_ref()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::Interrupted)
        {
            ReadEnd::Closing
        } else {
            ReadEnd::Frame(growing_error(peer, &kind, h.len, e))
        }
    })?;
    let malformed = |reason: String| {
        ReadEnd::Frame(FrameError::Malformed {
            peer: peer.to_string(),
            kind: kind.clone(),
            len: h.len,
            reason,
        })
    };
    let frame = match h.kind {
        HELLO => Frame::Hello(
            decode_hello(payload.bytes())
                .map_err(|e| malformed(format!("not an op descriptor: {e}")))?,
        ),
        DATA => Frame::Data(payload),
        P2P => Frame::P2p(payload),
        FAIL => Frame::Fail(
            bytes_to_words(payload.bytes())
                .and_then(|w| Failure::decode_words(&w))
                .map_err(|e| malformed(format!("not a failure notice: {e}")))?,
        ),
        BYE => Frame::Bye,
        _ => Frame::Agree(payload),
    };
    Ok((h, Some(frame)))
}

/// Reads and drops `len` bytes (64 KiB at a time); `Err` carries the bytes dropped.
fn skip<R: Read + ?Sized>(
    r: &mut R,
    len: u64,
    stop: Option<&AtomicBool>,
) -> Result<(), (usize, std::io::Error)> {
    let mut left = len;
    let mut buf = vec![0u8; (64 << 10).min(len as usize)];
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        candle_dtensor_comm_core::store::read_full(r, &mut buf[..k], None, stop)
            .map_err(|e| ((len - left) as usize, e))?;
        left -= k as u64;
    }
    Ok(())
}

/// The wire code of a supported dtype: desc.rs's code (its index in `SUPPORTED_DTYPES`), as
/// one byte.
pub(crate) fn dtype_code(d: DType) -> Option<u8> {
    u8::try_from(candle_dtensor_comm_core::kit::desc::dtype_code(d)).ok()
}

fn dtype_of(code: u8) -> Option<DType> {
    candle_dtensor_comm_core::kit::desc::dtype_of(code.into()).ok()
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
    use std::time::Instant;

    use super::*;
    use crate::test_support::{peak_alloc, Rng};
    use candle_dtensor_comm_core::store::FIRST_CHUNK;

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        let h = Header {
            kind: DATA,
            step: 7,
            tag: 1 << 40,
            len: 12345,
        };
        let d = Header::decode(&h.encode(), "rank 1").unwrap();
        assert_eq!((d.kind, d.step, d.tag, d.len), (DATA, 7, 1 << 40, 12345));
        let mut bad = h.encode();
        bad[0] = 99;
        assert!(matches!(
            Header::decode(&bad, "rank 1"),
            Err(FrameError::Malformed { .. })
        ));
        let mut huge = h.encode();
        huge[23] = 0xff;
        assert!(matches!(
            Header::decode(&huge, "rank 1"),
            Err(FrameError::TooLarge { .. })
        ));
        // Control frames have small caps of their own.
        let hello = Header {
            kind: HELLO,
            step: 0,
            tag: 0,
            len: MAX_HELLO + 1,
        };
        match Header::decode(&hello.encode(), "rank 3 (10.0.0.3:5000)") {
            Err(e @ FrameError::TooLarge { .. }) => {
                let m = e.to_string();
                assert!(
                    m.contains("rank 3 (10.0.0.3:5000)")
                        && m.contains("HELLO")
                        && m.contains(&(MAX_HELLO + 1).to_string())
                        && m.contains(&MAX_HELLO.to_string()),
                    "{m}"
                );
            }
            other => panic!("{other:?}"),
        }
        let bye = Header {
            kind: BYE,
            step: 0,
            tag: 0,
            len: 1,
        };
        assert!(Header::decode(&bye.encode(), "rank 1").is_err());
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

    /// One random frame: a kind (sometimes unknown), a body (valid JSON, garbage or raw
    /// bytes), a declared length (exact, longer than the body, huge, just over the kind's
    /// cap), sometimes non-zero padding; and whether it is well formed.
    fn random_frame(rng: &mut Rng, hello: &[u8], fail: &[u8]) -> (Vec<u8>, bool) {
        let kind = match rng.below(10) {
            0 => 0,
            1 => rng.next() as u8,
            k => (k % 6) as u8 + 1,
        };
        let garbage_json = |rng: &mut Rng| {
            let mut b = vec![0xff];
            b.extend(rng.upto(200));
            b
        };
        let (body, body_ok) = match kind {
            HELLO if rng.below(2) == 0 => (hello.to_vec(), true),
            FAIL if rng.below(2) == 0 => (fail.to_vec(), true),
            HELLO | FAIL => (garbage_json(rng), false),
            BYE => (Vec::new(), true),
            _ if rng.below(50) == 0 => (
                {
                    let n = 70_000 + rng.below(5_000) as usize;
                    rng.bytes(n)
                },
                true,
            ),
            _ => (rng.upto(300), true),
        };
        let exact = body.len() as u64;
        let declared = match rng.below(10) {
            0 => 1 << 40,
            1 => (1 << 40) + 1,
            2 => u64::MAX,
            3 => rng.next(),
            4 => exact + 1 + rng.below(1 << 20),
            5 if (HELLO..=AGREE).contains(&kind) => max_len(kind) + 1,
            _ => exact,
        };
        let pad_ok = rng.below(20) != 0;
        let mut h = Header {
            kind,
            step: rng.next() as u32,
            tag: rng.next(),
            len: declared,
        }
        .encode();
        if !pad_ok {
            h[1 + rng.below(3) as usize] = 1 + rng.below(255) as u8;
        }
        let mut f = h.to_vec();
        f.extend_from_slice(&body);
        let ok = (HELLO..=AGREE).contains(&kind) && pad_ok && declared == exact && body_ok;
        (f, ok)
    }

    /// 10,000 random frames (in streams of one to three, or plain garbage) into the decoder
    /// every reader thread runs: nothing panics, a stream of good frames ends cleanly, every
    /// bad one ends with a typed error naming the peer, and no allocation is larger than twice
    /// the bytes the stream really holds (or the first 64 KiB chunk), whatever the headers
    /// declare (up to 2^64 - 1 bytes).
    #[test]
    #[allow(clippy::print_stderr)] // what it measured, in the test's output
    fn ten_thousand_random_frames_never_allocate_from_declared_lengths() {
        let mut rng = Rng(0x34_f2a3e);
        let mut hello = Vec::new();
        OpDesc::of(
            candle_dtensor_comm_core::OpName::AllReduce,
            DType::F32,
            &[4, 5],
        )
        .encode_words(&mut hello);
        let hello = candle_dtensor_comm_core::kit::desc::words_to_bytes(&hello);
        let fail = candle_dtensor_comm_core::kit::desc::words_to_bytes(
            &Failure::PeerLost {
                rank: 2,
                reason: "gone".into(),
            }
            .encode_words(64),
        );
        let peer = "rank 1 (10.1.2.3:4567)";
        let (mut frames, mut typed, mut clean) = (0u64, 0u64, 0u64);
        let (mut max_peak, mut max_declared, mut skipped) = (0usize, 0u64, 0u64);
        let t0 = Instant::now();
        let mut case = 0u64;
        while frames < 10_000 {
            case += 1;
            let mut stream = Vec::new();
            // None: plain garbage, which may or may not happen to be frames.
            let mut all_ok = Some(true);
            if rng.below(20) == 0 {
                stream = rng.upto(64);
                all_ok = None;
                frames += 1;
            } else {
                for _ in 0..1 + rng.below(3) {
                    let (f, ok) = random_frame(&mut rng, &hello, &fail);
                    frames += 1;
                    let mut l = [0u8; 8];
                    l.copy_from_slice(&f[16..24]);
                    max_declared = max_declared.max(u64::from_le_bytes(l));
                    stream.extend_from_slice(&f);
                    if !ok {
                        all_ok = Some(false);
                        break;
                    }
                }
            }
            // Some DATA and P2P frames are dropped unread, as a failed communicator does.
            let drop_some = case % 3 == 0;
            let (end, peak) = peak_alloc(|| {
                let mut r = &stream[..];
                loop {
                    match read_frame(&mut r, peer, None, |_| Ok(!drop_some)) {
                        Ok((_, None)) => skipped += 1,
                        Ok(_) => {}
                        Err(e) => break e,
                    }
                }
            });
            match end {
                ReadEnd::Closed(e) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                    assert_ne!(all_ok, Some(false), "case {case}: a bad frame was read");
                    clean += 1;
                }
                ReadEnd::Frame(e) => {
                    assert_ne!(all_ok, Some(true), "case {case}: good frames refused: {e}");
                    assert!(e.to_string().contains(peer), "{e}");
                    typed += 1;
                }
                ReadEnd::Closing => panic!("case {case}: closing without a stop flag"),
            }
            let bound = (2 * stream.len()).max(FIRST_CHUNK);
            assert!(
                peak <= bound,
                "case {case}: allocated {peak} bytes for {} bytes of frames",
                stream.len()
            );
            max_peak = max_peak.max(peak);
        }
        eprintln!(
            "process frame fuzz: {frames} frames in {case} streams, {typed} closed with a typed \
             error, {clean} ended cleanly, {skipped} dropped unread, largest declared length \
             {max_declared}, largest allocation {max_peak} bytes, {:?}",
            t0.elapsed()
        );
        assert!(typed > 1_000 && clean > 500 && max_declared == u64::MAX);
    }
}
