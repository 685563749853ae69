//! An owned, 8-byte aligned byte buffer (so it can be read as any supported element type):
//! what the process backend receives frames into and the mpi backend stages transfers in.
//!
//! Large scratch buffers ([`Bytes::scratch`]) come from, and return to, a process-wide pool
//! with a cap: a fresh large allocation is a fresh mapping whose page faults, taken while MPI
//! writes into it, cost more than the transfer itself (measured when the mpi backend was built:
//! a 64 MiB all-gather into a fresh buffer took 3x as long as into a reused one).

use std::ffi::c_void;
use std::sync::Mutex;

/// Scratch buffers of at least this many bytes are pooled.
const POOL_MIN_BYTES: usize = 1 << 20;
/// The most the pool keeps.
const POOL_MAX_BYTES: usize = 1 << 30;

/// Freed scratch vectors kept for reuse, at most `max` bytes of them.
struct Pool {
    bufs: Mutex<Vec<Vec<u64>>>,
    max: usize,
}

impl Pool {
    const fn new(max: usize) -> Pool {
        Pool {
            bufs: Mutex::new(Vec::new()),
            max,
        }
    }

    /// The smallest kept vector of at least `words` words.
    fn take(&self, words: usize) -> Option<Vec<u64>> {
        let mut bufs = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let best = bufs
            .iter()
            .enumerate()
            .filter(|(_, v)| v.len() >= words)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i)?;
        Some(bufs.swap_remove(best))
    }

    /// Keeps `v` if it fits under the cap, else in place of a smaller kept one, else drops it.
    fn give(&self, v: Vec<u64>) {
        let mut bufs = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = bufs.iter().map(|b| b.len() * 8).sum();
        if held + v.len() * 8 <= self.max {
            bufs.push(v);
        } else if let Some(smallest) = bufs
            .iter()
            .enumerate()
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i)
            .filter(|&i| {
                bufs[i].len() < v.len() && held - bufs[i].len() * 8 + v.len() * 8 <= self.max
            })
        {
            bufs[smallest] = v;
        }
    }

    /// Bytes kept now.
    #[cfg(test)]
    fn held(&self) -> usize {
        let bufs = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        bufs.iter().map(|b| b.len() * 8).sum()
    }
}

static POOL: Pool = Pool::new(POOL_MAX_BYTES);

/// `len` bytes in `ceil(len / 8)` initialised `u64`s.
pub struct Bytes {
    words: Vec<u64>,
    len: usize,
    /// Whether dropping it gives the words back to the pool.
    pooled: bool,
}

impl Bytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Bytes {
        Bytes {
            words: vec![0u64; len.div_ceil(8)],
            len,
            pooled: false,
        }
    }

    /// `len` zero bytes, or `None` if they cannot be allocated (a peer announcing an absurd
    /// payload must not abort the process).
    pub fn try_zeroed(len: usize) -> Option<Bytes> {
        let words = len.div_ceil(8);
        let mut v = Vec::new();
        v.try_reserve_exact(words).ok()?;
        v.resize(words, 0u64);
        Some(Bytes {
            words: v,
            len,
            pooled: false,
        })
    }

    /// Grows to `len` bytes (`len >= self.len()`), keeping the content; the new bytes are zero.
    /// In place where the allocator can extend the block (no copy), and only the new part is
    /// zeroed. `None` if the memory cannot be allocated (the buffer is then unchanged).
    pub fn try_grow(&mut self, len: usize) -> Option<()> {
        // A pooled buffer's vector can hold more words than its length: not grown here (the
        // wire grows only the buffers it allocated itself).
        if len < self.len || self.pooled {
            return None;
        }
        let words = len.div_ceil(8);
        let more = words.saturating_sub(self.words.len());
        self.words.try_reserve_exact(more).ok()?;
        self.words.resize(words, 0u64);
        self.len = len;
        Some(())
    }

    /// `len` bytes of unspecified content (zeros, or what a reused buffer held), for buffers a
    /// transfer or a copy fills before anyone reads them; large ones come from the pool and go
    /// back to it when dropped.
    pub fn scratch(len: usize) -> Bytes {
        let words = len.div_ceil(8);
        if len < POOL_MIN_BYTES {
            return Bytes::zeroed(len);
        }
        Bytes {
            words: POOL.take(words).unwrap_or_else(|| vec![0u64; words]),
            len,
            pooled: true,
        }
    }

    /// A copy of `b` (a scratch buffer: pooled when large).
    pub fn copy_of(b: &[u8]) -> Bytes {
        let mut p = Bytes::scratch(b.len());
        p.bytes_mut().copy_from_slice(b);
        p
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes (ceil(len / 8) u64s, a pooled
        // vector at least as many), and u8 has no alignment requirement.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    /// The bytes, to be written.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// The first byte, for a C API that reads the buffer (MPI); 8-byte aligned.
    pub fn ptr(&self) -> *const c_void {
        self.words.as_ptr().cast()
    }

    /// The first byte, for a C API that writes the buffer (MPI); 8-byte aligned.
    pub fn mut_ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr().cast()
    }
}

impl Drop for Bytes {
    fn drop(&mut self) {
        if self.pooled {
            POOL.give(std::mem::take(&mut self.words));
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn try_grow_keeps_the_content_and_zeroes_the_new_bytes() {
        let mut b = Bytes::try_zeroed(13).unwrap();
        b.bytes_mut().copy_from_slice(&[7u8; 13]);
        b.try_grow(100).unwrap();
        assert_eq!(b.len(), 100);
        assert_eq!(&b.bytes_mut()[..13], &[7u8; 13]);
        assert!(b.bytes_mut()[13..].iter().all(|&x| x == 0));
        // Shrinking is not growing: refused, the buffer unchanged.
        assert!(b.try_grow(50).is_none());
        assert_eq!(b.len(), 100);
        // Nor in the same 8-byte word.
        assert!(b.try_grow(97).is_none());
        assert_eq!(b.len(), 100);
        // An absurd size is refused, not an abort.
        assert!(b.try_grow(usize::MAX).is_none());
        assert_eq!(b.len(), 100);
    }

    use super::*;

    #[test]
    fn views_cover_exactly_len_bytes_and_copies_are_equal() {
        for len in [0, 1, 7, 8, 9, 4097] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let b = Bytes::copy_of(&src);
            assert_eq!(b.len(), len);
            assert_eq!(b.bytes(), &src[..]);
            assert_eq!(b.bytes().as_ptr() as usize % 8, 0);
            assert!(Bytes::zeroed(len).bytes().iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn only_large_scratch_is_pooled() {
        assert!(!Bytes::zeroed(POOL_MIN_BYTES * 2).pooled);
        assert!(!Bytes::scratch(POOL_MIN_BYTES - 1).pooled);
        assert!(!Bytes::copy_of(&[7u8; 100]).pooled);
        assert!(Bytes::scratch(POOL_MIN_BYTES).pooled);
        assert!(Bytes::try_zeroed(POOL_MIN_BYTES).is_some_and(|b| !b.pooled));
    }

    #[test]
    fn the_pool_reuses_the_best_fit_and_keeps_its_cap() {
        // A pool of its own: the process-wide one is shared with concurrent tests.
        let pool = Pool::new(64 * 8);
        pool.give(vec![1u64; 16]);
        pool.give(vec![2u64; 32]);
        assert_eq!(pool.held(), 48 * 8);
        // Best fit: the smallest vector that is large enough, with its old content.
        let v = pool.take(10).expect("a 16-word vector fits 10 words");
        assert_eq!((v.len(), v[0]), (16, 1));
        assert!(pool.take(40).is_none());
        // Over the cap: a larger vector replaces a smaller one only if the total still fits,
        // otherwise it is dropped; the pool never holds more than its cap.
        pool.give(vec![3u64; 40]);
        assert_eq!(pool.held(), 40 * 8);
        pool.give(vec![4u64; 48]);
        assert!(pool.held() <= 64 * 8);
        pool.give(vec![5u64; 100]);
        assert!(pool.held() <= 64 * 8);
        assert!(pool.take(100).is_none());
    }
}
