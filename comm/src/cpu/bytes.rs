//! An owned, 8-byte aligned byte buffer (so it can be read as any supported element type):
//! what the process backend receives frames into and the mpi backend stages transfers in.
//!
//! Large scratch buffers ([`Bytes::scratch`]) come from, and return to, a process-wide pool
//! with a cap: a fresh large allocation is a fresh mapping whose page faults, taken while MPI
//! writes into it, cost more than the transfer itself (measured when the mpi backend was built:
//! a 64 MiB all-gather into a fresh buffer took 3x as long as into a reused one).

#[cfg(feature = "mpi")]
use std::ffi::c_void;
use std::sync::Mutex;

/// Scratch buffers of at least this many bytes are pooled.
const POOL_MIN_BYTES: usize = 1 << 20;
/// The most the pool keeps.
const POOL_MAX_BYTES: usize = 1 << 30;

static POOL: Mutex<Vec<Vec<u64>>> = Mutex::new(Vec::new());

fn pool_take(words: usize) -> Option<Vec<u64>> {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let best = pool
        .iter()
        .enumerate()
        .filter(|(_, v)| v.len() >= words)
        .min_by_key(|(_, v)| v.len())
        .map(|(i, _)| i)?;
    Some(pool.swap_remove(best))
}

fn pool_give(v: Vec<u64>) {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let held: usize = pool.iter().map(|b| b.len() * 8).sum();
    if held + v.len() * 8 <= POOL_MAX_BYTES {
        pool.push(v);
    } else if let Some(smallest) = pool
        .iter()
        .enumerate()
        .min_by_key(|(_, b)| b.len())
        .map(|(i, _)| i)
        .filter(|&i| pool[i].len() < v.len())
    {
        pool[smallest] = v;
    }
}

/// Bytes held by the pool now (for tests and diagnostics).
#[cfg(test)]
fn pooled_bytes() -> usize {
    POOL.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|b| b.len() * 8)
        .sum()
}

/// `len` bytes in `ceil(len / 8)` initialised `u64`s.
pub(crate) struct Bytes {
    words: Vec<u64>,
    len: usize,
    /// Whether dropping it gives the words back to the pool.
    pooled: bool,
}

impl Bytes {
    /// `len` zero bytes.
    pub(crate) fn zeroed(len: usize) -> Bytes {
        Bytes {
            words: vec![0u64; len.div_ceil(8)],
            len,
            pooled: false,
        }
    }

    /// `len` zero bytes, or `None` if they cannot be allocated (a peer announcing an absurd
    /// payload must not abort the process).
    pub(crate) fn try_zeroed(len: usize) -> Option<Bytes> {
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

    /// `len` bytes of unspecified content (zeros, or what a reused buffer held), for buffers a
    /// transfer or a copy fills before anyone reads them; large ones come from the pool and go
    /// back to it when dropped.
    pub(crate) fn scratch(len: usize) -> Bytes {
        let words = len.div_ceil(8);
        if len < POOL_MIN_BYTES {
            return Bytes::zeroed(len);
        }
        Bytes {
            words: pool_take(words).unwrap_or_else(|| vec![0u64; words]),
            len,
            pooled: true,
        }
    }

    /// A copy of `b` (a scratch buffer: pooled when large).
    pub(crate) fn copy_of(b: &[u8]) -> Bytes {
        let mut p = Bytes::scratch(b.len());
        p.bytes_mut().copy_from_slice(b);
        p
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes (ceil(len / 8) u64s, a pooled
        // vector at least as many), and u8 has no alignment requirement.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    #[cfg(feature = "mpi")]
    pub(crate) fn ptr(&self) -> *const c_void {
        self.words.as_ptr().cast()
    }

    #[cfg(feature = "mpi")]
    pub(crate) fn mut_ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr().cast()
    }
}

impl Drop for Bytes {
    fn drop(&mut self) {
        if self.pooled {
            pool_give(std::mem::take(&mut self.words));
        }
    }
}

#[cfg(test)]
mod tests {
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
    fn large_scratch_is_reused_and_the_pool_is_capped() {
        let len = POOL_MIN_BYTES + 3;
        let mut a = Bytes::scratch(len);
        a.bytes_mut().fill(0xab);
        let addr = a.bytes().as_ptr() as usize;
        drop(a);
        assert!(pooled_bytes() >= len);
        // Another test may take it first; when this one gets a pooled buffer of the right size
        // back it is the same allocation, its old content visible (scratch is unspecified).
        let b = Bytes::scratch(len);
        assert_eq!(b.len(), len);
        if b.bytes().as_ptr() as usize == addr {
            assert!(b.bytes().iter().all(|&x| x == 0xab));
        }
        drop(b);
        // Zeroed and small buffers never enter the pool; the pool never exceeds its cap.
        drop(Bytes::zeroed(POOL_MIN_BYTES * 2));
        for _ in 0..3 {
            drop(Bytes::scratch(POOL_MAX_BYTES / 2));
        }
        assert!(pooled_bytes() <= POOL_MAX_BYTES);
    }
}
