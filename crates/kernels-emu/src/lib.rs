//! The CUDA C kernels of `candle-dtensor-kernels` (`crates/kernels/cuda/*.cu`), run on the CPU
//! under an emulator of the CUDA execution model, so that their logic is tested on every
//! machine, CI included, where no GPU is.
//!
//! The kernel sources are compiled unchanged as C++ with `emu/cuda_emu.h` force-included
//! (see that header for what is emulated and what is not). A launch runs the grid's blocks one
//! after another, each block's threads as cooperative fibers switched at `__syncthreads`,
//! warp syncs and shuffles, in an [`Order`] chosen per launch. A launch fails with
//! [`EmuError::Launch`] on what would hang or be undefined on a GPU: a barrier some threads
//! never reach or reach after others exited, a shuffle from a lane no thread runs, an invalid
//! launch configuration. Buffers passed to a kernel are [`Buf`]s with guard zones on both
//! sides; a kernel that writes into one fails with [`EmuError::OutOfBounds`]. Running a kernel
//! under two orders and comparing the outputs bit for bit finds shared-memory races.
//!
//! What this does not show: speed, and anything of the real hardware beyond the programming
//! model (the memory model past barriers, floating-point contraction choices of nvcc, bf16
//! intrinsics' exact rounding where the kernels rely on it). The GPU tests
//! (`crates/kernels/tests/cuda_fused.rs`, run by `scripts/gpu_check.sh`) check those.
//!
//! The crate is test infrastructure (`publish = false`): the library exposes one safe wrapper
//! per kernel, each checking that its buffers are large enough for the shape it launches.

use std::ffi::{c_char, c_int};

use thiserror::Error;

pub mod fused;
pub mod multi;

/// What went wrong running a kernel under the emulator.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EmuError {
    /// The emulator refused or stopped the launch (deadlock, divergent barrier, bad shuffle,
    /// invalid configuration); the message names the kernel, block and threads.
    #[error("{0}")]
    Launch(String),
    /// The kernel wrote into a buffer's guard zone.
    #[error(
        "kernel {kernel}: wrote outside buffer `{buffer}` of {len} elements ({side} guard zone, \
         element {offset} past the edge)"
    )]
    OutOfBounds {
        /// The kernel.
        kernel: String,
        /// The buffer's name.
        buffer: String,
        /// Its length in elements.
        len: usize,
        /// `before` or `after`.
        side: &'static str,
        /// How far past the edge (0 = the first element outside).
        offset: usize,
    },
    /// The arguments do not describe a launch the wrapper can run safely.
    #[error("kernel {kernel}: {what}")]
    Args {
        /// The kernel.
        kernel: String,
        /// What is wrong.
        what: String,
    },
}

/// Result of an emulated launch.
pub type Result<T> = std::result::Result<T, EmuError>;

/// The order in which the fibers of a block take turns between synchronisation points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Thread 0 first.
    Forward,
    /// The last thread first.
    Reverse,
    /// A shuffled order, reshuffled between every pair of barriers (the seed picks it).
    Shuffled(u64),
}

/// The orders a kernel's determinism is checked under.
pub const ORDERS: [Order; 3] = [Order::Forward, Order::Reverse, Order::Shuffled(0x5eed)];

/// A launch configuration: grid and block dimensions and dynamic shared memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: usize,
}

impl Launch {
    /// A one-dimensional launch.
    pub fn linear(blocks: u32, threads: u32, shared_bytes: usize) -> Self {
        Self {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes,
        }
    }

    /// The number of threads of the whole grid.
    pub fn threads(&self) -> u64 {
        let (g, b) = (self.grid, self.block);
        [g.0, g.1, g.2, b.0, b.1, b.2]
            .iter()
            .map(|&v| u64::from(v))
            .product()
    }
}

/// The C layout of a launch (`EmuLaunch` in `emu/shims.cpp`); only this crate builds one.
#[doc(hidden)]
#[repr(C)]
pub struct RawLaunch {
    grid: [u32; 3],
    block: [u32; 3],
    shared: u64,
    order: i32,
    seed: u64,
}

const ERR_LEN: usize = 2048;

/// Runs one shim: `call(raw launch, error buffer, its length)` returns 0 on success.
fn run(
    launch: &Launch,
    order: Order,
    call: impl FnOnce(*const RawLaunch, *mut c_char, usize) -> c_int,
) -> Result<()> {
    let (order, seed) = match order {
        Order::Forward => (0, 0),
        Order::Reverse => (1, 0),
        Order::Shuffled(s) => (2, s),
    };
    let raw = RawLaunch {
        grid: [launch.grid.0, launch.grid.1, launch.grid.2],
        block: [launch.block.0, launch.block.1, launch.block.2],
        shared: launch.shared_bytes as u64,
        order,
        seed,
    };
    let mut err = vec![0u8; ERR_LEN];
    if call(&raw, err.as_mut_ptr().cast::<c_char>(), ERR_LEN) == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(ERR_LEN);
    Err(EmuError::Launch(
        String::from_utf8_lossy(&err[..end]).into_owned(),
    ))
}

/// Elements of guard zone on each side of a [`Buf`].
pub const GUARD: usize = 4096;

/// An element type a [`Buf`] holds, with the byte pattern its guard zones are filled with.
pub trait Element: Copy + PartialEq + std::fmt::Debug {
    /// The guard value (a bit pattern no kernel output is expected to produce).
    const GUARD: Self;
}

impl Element for f32 {
    // A signalling NaN with a payload: compared by bits, never produced by arithmetic.
    const GUARD: Self = f32::from_bits(0x7fa5_a5a5);
}
impl Element for u16 {
    const GUARD: Self = 0x7fa5;
}
impl Element for i32 {
    const GUARD: Self = 0x5a5a_a5a5;
}
impl Element for u32 {
    const GUARD: Self = 0xa5a5_5a5a;
}
impl Element for i64 {
    const GUARD: Self = 0x5a5a_a5a5_5a5a_a5a5;
}

/// A device buffer of the emulator: `len` elements between two guard zones of [`GUARD`]
/// elements, so a kernel that writes up to `GUARD` elements past either edge is caught
/// ([`Buf::check`]) instead of corrupting memory. Kernels get pointers to its interior only.
#[derive(Debug, Clone)]
pub struct Buf<T: Element> {
    name: &'static str,
    data: Vec<T>,
    /// Where the interior starts in `data` (at least [`GUARD`]).
    start: usize,
    len: usize,
}

impl<T: Element> Buf<T> {
    /// A buffer holding `v`.
    pub fn from_slice(name: &'static str, v: &[T]) -> Self {
        Self::placed(name, v, |_| 0)
    }

    /// A buffer holding `v` whose first element is one element past a 16-byte boundary, for
    /// the paths kernels take when a pointer does not allow 16-byte vector accesses.
    pub fn misaligned(name: &'static str, v: &[T]) -> Self {
        let size = std::mem::size_of::<T>();
        assert!(
            size < 16,
            "an element of 16 bytes or more is never one past a boundary"
        );
        Self::placed(name, v, |at| {
            (0..16 / size)
                .find(|s| (at + s * size) % 16 == size)
                .expect("an element size that is a power of two below 16 reaches every residue")
        })
    }

    /// The interior starts `shift(address after the front guard zone)` elements (below 16)
    /// past the front guard zone, chosen on the allocation itself.
    fn placed(name: &'static str, v: &[T], shift: impl FnOnce(usize) -> usize) -> Self {
        const SLACK: usize = 16;
        let mut data = vec![T::GUARD; v.len() + 2 * GUARD + SLACK];
        let start = GUARD + shift(data[GUARD..].as_ptr() as usize).min(SLACK);
        data[start..start + v.len()].copy_from_slice(v);
        Self {
            name,
            data,
            start,
            len: v.len(),
        }
    }

    /// A buffer of `len` copies of `fill`.
    pub fn filled(name: &'static str, len: usize, fill: T) -> Self {
        Self::from_slice(name, &vec![fill; len])
    }

    /// Its elements.
    pub fn as_slice(&self) -> &[T] {
        &self.data[self.start..self.start + self.len]
    }

    /// Its elements, to write on the host (the guard zones stay out of reach).
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.data[self.start..self.start + self.len]
    }

    /// Its length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A pointer to its first element, for a kernel that reads it.
    pub(crate) fn ptr(&self) -> *const T {
        self.data[self.start..].as_ptr()
    }

    /// A pointer to its first element, for a kernel that writes it.
    pub(crate) fn mut_ptr(&mut self) -> *mut T {
        self.data[self.start..].as_mut_ptr()
    }

    /// Whether its first element is 16-byte aligned.
    pub fn is_aligned_16(&self) -> bool {
        (self.ptr() as usize) % 16 == 0
    }

    /// [`EmuError::OutOfBounds`] if a guard zone changed (the element nearest the buffer
    /// first).
    pub fn check(&self, kernel: &str) -> Result<()> {
        let same = |a: &T| a == &T::GUARD || bits_eq(a, &T::GUARD);
        let before = &self.data[..self.start];
        let after = &self.data[self.start + self.len..];
        let oob = |side, offset| EmuError::OutOfBounds {
            kernel: kernel.to_string(),
            buffer: self.name.to_string(),
            len: self.len,
            side,
            offset,
        };
        if let Some(i) = before.iter().rev().position(|v| !same(v)) {
            return Err(oob("before", i));
        }
        if let Some(i) = after.iter().position(|v| !same(v)) {
            return Err(oob("after", i));
        }
        Ok(())
    }
}

/// Bitwise equality (a NaN guard value equals itself).
fn bits_eq<T: Copy>(a: &T, b: &T) -> bool {
    let n = std::mem::size_of::<T>();
    // SAFETY: `a` and `b` are valid, initialised values of the same `Copy` type of size `n`;
    // reading their bytes is reading initialised memory (the Element types have no padding).
    let (x, y) = unsafe {
        (
            std::slice::from_raw_parts((a as *const T).cast::<u8>(), n),
            std::slice::from_raw_parts((b as *const T).cast::<u8>(), n),
        )
    };
    x == y
}

/// The same values, bit for bit (NaNs compared by their bits).
pub fn same_bits<T: Element>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| bits_eq(x, y))
}

/// [`EmuError::Args`] unless a buffer of `len` elements holds the `need` a launch touches.
pub(crate) fn need_elems(kernel: &str, len: usize, need: usize) -> Result<()> {
    if len < need {
        return Err(EmuError::Args {
            kernel: kernel.into(),
            what: format!("a buffer of {len} elements where the launch needs {need}"),
        });
    }
    Ok(())
}

/// Shared-memory bank wavefronts of the `ldmatrix` loads (`mma_sync.cuh`) of the launches a
/// closure ran ([`count_banks`]): a performance model, not semantics. Each 8 x 8 matrix of an
/// `ldmatrix` is one request of 8 rows of 16 bytes; it costs as many wavefronts as the most
/// distinct 4-byte words one of the 32 banks is asked for (`emu/mma.h`): 1 when its rows fall
/// into different banks, up to 8.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BankStats {
    /// 8 x 8 matrix loads (four per `ldmatrix.x4`).
    pub requests: u64,
    /// Their wavefronts.
    pub wavefronts: u64,
}

impl BankStats {
    /// Wavefronts per request: 1 when conflict-free, n for n-way conflicts.
    pub fn ways(&self) -> f64 {
        self.wavefronts as f64 / self.requests.max(1) as f64
    }
}

/// Runs `f` and returns what the `ldmatrix` loads of the launches it ran on this thread
/// counted (launches run on the calling thread; other threads' are not counted).
pub fn count_banks<R>(f: impl FnOnce() -> R) -> (R, BankStats) {
    // SAFETY: touches only the calling thread's counters (a thread_local of the emulator).
    unsafe { emu_bank_stats_reset() };
    let r = f();
    let mut out = [0u64; 2];
    // SAFETY: as above; `out` holds the 2 counters the function writes.
    unsafe { emu_bank_stats(out.as_mut_ptr()) };
    let [requests, wavefronts] = out;
    (
        r,
        BankStats {
            requests,
            wavefronts,
        },
    )
}

extern "C" {
    fn emu_bank_stats(out: *mut u64);
    fn emu_bank_stats_reset();
    fn emu_selftest_row_sum(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        x: *const f32,
        y: *mut f32,
        n: c_int,
    ) -> c_int;
    fn emu_selftest_racy(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        y: *mut f32,
    ) -> c_int;
    fn emu_selftest_deadlock(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        y: *mut f32,
    ) -> c_int;
    fn emu_selftest_dyn(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        y: *mut f32,
    ) -> c_int;
    fn emu_selftest_stale_shared(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        y: *mut f32,
        mode: c_int,
    ) -> c_int;
    fn emu_selftest_reuse_race(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        x: *const f32,
        y: *mut f32,
    ) -> c_int;
    fn emu_selftest_unguarded(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        y: *mut f32,
    ) -> c_int;
    fn emu_selftest_async_copy(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        x: *const f32,
        y: *mut f32,
        mode: c_int,
    ) -> c_int;
    fn emu_selftest_divergent_mma(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        y: *mut f32,
        mode: c_int,
    ) -> c_int;
    fn emu_selftest_ballot(
        l: *const RawLaunch,
        err: *mut c_char,
        err_len: usize,
        x: *const f32,
        y: *mut f32,
        lanes: u32,
    ) -> c_int;
}

/// The emulator's own kernels (`emu/selftest/selftest.cu`): a correct block reduction and one
/// kernel per kind of bug the emulator must report. Used by `tests/emulator.rs`.
pub mod selftest {
    use super::*;

    /// `y[r] = sum(x[r, ..])` for `rows = launch.grid.0` rows of `n`.
    pub fn row_sum(
        launch: &Launch,
        order: Order,
        x: &Buf<f32>,
        y: &mut Buf<f32>,
        n: usize,
    ) -> Result<()> {
        let k = "row_sum";
        let rows = launch.grid.0 as usize;
        need_elems(k, x.len(), rows * n)?;
        need_elems(k, y.len(), rows)?;
        let n = c_int::try_from(n).map_err(|_| EmuError::Args {
            kernel: k.into(),
            what: format!("row length {n} beyond a C int"),
        })?;
        if launch.grid.1 != 1 || launch.grid.2 != 1 || launch.block.1 != 1 || launch.block.2 != 1 {
            return Err(EmuError::Args {
                kernel: k.into(),
                what: "a 1-D launch".into(),
            });
        }
        // SAFETY: block r reads x[r n .. (r + 1) n] and writes y[r] for r < grid.x = rows,
        // both in bounds (checked above); the launch is 1-D, so no other block exists. The
        // buffers outlive the call, which is synchronous.
        run(launch, order, |l, e, el| unsafe {
            emu_selftest_row_sum(l, e, el, x.ptr(), y.mut_ptr(), n)
        })?;
        y.check(k)
    }

    /// Thread `t` writes `y[t]`: needs `y.len() >= threads`.
    fn per_thread(
        k: &str,
        launch: &Launch,
        order: Order,
        y: &mut Buf<f32>,
        f: impl FnOnce(*const RawLaunch, *mut c_char, usize, *mut f32) -> c_int,
    ) -> Result<()> {
        if launch.grid != (1, 1, 1) || launch.block.1 != 1 || launch.block.2 != 1 {
            return Err(EmuError::Args {
                kernel: k.into(),
                what: "one 1-D block".into(),
            });
        }
        need_elems(k, y.len(), launch.block.0 as usize)?;
        // `f` runs a kernel whose thread t of the single 1-D block writes y[t] only, t < block.x
        // <= y.len() (checked above). The buffer outlives the synchronous call.
        run(launch, order, |l, e, el| f(l, e, el, y.mut_ptr()))?;
        y.check(k)
    }

    /// Thread `t` reads thread `t + 1`'s shared slot without a barrier.
    pub fn racy(launch: &Launch, order: Order, y: &mut Buf<f32>) -> Result<()> {
        // SAFETY: the kernel writes y[t] for thread t of one 1-D block only (per_thread checks).
        per_thread("racy", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_racy(l, e, el, y)
        })
    }

    /// A barrier only threads 0..10 reach.
    pub fn deadlock(launch: &Launch, order: Order, y: &mut Buf<f32>) -> Result<()> {
        // SAFETY: the kernel writes y[t] for thread t of one 1-D block only (per_thread checks).
        per_thread("deadlock", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_deadlock(l, e, el, y)
        })
    }

    /// Copies unwritten dynamic shared memory to `y`.
    pub fn dyn_shared(launch: &Launch, order: Order, y: &mut Buf<f32>) -> Result<()> {
        if launch.shared_bytes < 4 * launch.block.0 as usize {
            return Err(EmuError::Args {
                kernel: "dyn".into(),
                what: "dynamic shared memory of 4 bytes per thread".into(),
            });
        }
        // SAFETY: the kernel writes y[t] for thread t of one 1-D block only (per_thread checks).
        per_thread("dyn", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_dyn(l, e, el, y)
        })
    }

    /// A static `__shared__` array of 64 floats read before the block writes it (`written`
    /// false: each thread copies its slot to `y`, then writes it), or after thread 0 wrote it
    /// all (`written` true: slot t holds t). Thread t of block b writes `y[b * block.x + t]`;
    /// a 1-D launch of at most 64 threads a block.
    pub fn stale_shared(
        launch: &Launch,
        order: Order,
        y: &mut Buf<f32>,
        written: bool,
    ) -> Result<()> {
        let k = "stale_shared";
        if launch.grid.1 != 1
            || launch.grid.2 != 1
            || launch.block.1 != 1
            || launch.block.2 != 1
            || launch.block.0 > 64
        {
            return Err(EmuError::Args {
                kernel: k.into(),
                what: "a 1-D launch of at most 64 threads a block".into(),
            });
        }
        need_elems(k, y.len(), launch.grid.0 as usize * launch.block.0 as usize)?;
        // SAFETY: thread t of block b writes y[b * block.x + t] only, below grid.x * block.x <=
        // y.len() (checked above), and reads its own 64-slot shared array within block.x <= 64.
        run(launch, order, |l, e, el| unsafe {
            emu_selftest_stale_shared(l, e, el, y.mut_ptr(), c_int::from(written))
        })?;
        y.check(k)
    }

    /// Two block sums through one shared array without the barrier between them: thread `t`
    /// reads `x[t]` and writes `y[t]` of one 1-D block.
    pub fn reuse_race(launch: &Launch, order: Order, x: &Buf<f32>, y: &mut Buf<f32>) -> Result<()> {
        need_elems("reuse_race", x.len(), launch.block.0 as usize)?;
        // SAFETY: per_thread checks the single 1-D block and y; x is checked above; thread t
        // reads x[t] only.
        per_thread("reuse_race", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_reuse_race(l, e, el, x.ptr(), y)
        })
    }

    /// How [`async_copy`] uses its cp.async copy.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum AsyncCopy {
        /// Waits for the copy, then a barrier, then reads (correct).
        WaitThenRead = 0,
        /// Reads after the barrier without waiting for the copy.
        ReadWithoutWait = 1,
        /// Copies no source bytes: the destination is zero-filled.
        ZeroFill = 2,
        /// Exits without waiting for the copy.
        ExitWithoutWait = 3,
        /// Copies 16 bytes to an address 4 bytes past a 16-byte boundary.
        Misaligned = 4,
    }

    /// Thread `t` copies `x[4t..4t + 4]` into shared memory with one 16-byte cp.async and
    /// writes the sum of thread `t + 1`'s four to `y[t]`, as `how` says: at most 1024 threads
    /// of one 1-D block.
    pub fn async_copy(
        launch: &Launch,
        order: Order,
        how: AsyncCopy,
        x: &Buf<f32>,
        y: &mut Buf<f32>,
    ) -> Result<()> {
        need_elems("async_copy", x.len(), 4 * launch.block.0 as usize)?;
        // SAFETY: per_thread checks the single 1-D block (at most 1024 threads, the shared
        // array's size) and y; x is checked above; thread t reads x[4t..4t + 4] only.
        per_thread("async_copy", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_async_copy(l, e, el, x.ptr(), y, how as c_int)
        })
    }

    /// Where the lanes of one warp reach a warp-wide matrix instruction (`.aligned`) from.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum MatrixSites {
        /// Every lane through one call of `mma.sync` (correct).
        One = 0,
        /// Half the lanes through one call of `mma.sync`, half through another.
        TwoMma = 1,
        /// Half the lanes through one call of `ldmatrix`, half through another.
        TwoLdmatrix = 2,
    }

    /// One warp (a 1-D block of 32 threads) runs a bf16 `mma.sync` (or `ldmatrix`) reached
    /// from the places `sites` says; thread `t` writes its first accumulator to `y[t]`.
    pub fn divergent_mma(
        launch: &Launch,
        order: Order,
        y: &mut Buf<f32>,
        sites: MatrixSites,
    ) -> Result<()> {
        if launch.block.0 != 32 {
            return Err(EmuError::Args {
                kernel: "divergent_mma".into(),
                what: "one warp: a block of 32 threads".into(),
            });
        }
        // SAFETY: per_thread checks the single 1-D block (32 threads) and y; thread t writes
        // y[t] only and reads its warp's 512-byte shared tile at lane * 16 bytes.
        per_thread("divergent_mma", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_divergent_mma(l, e, el, y, sites as c_int)
        })
    }

    /// Thread `t` of one 1-D block votes `x[t] > 0` with `__ballot_sync(lanes, ..)` and
    /// writes, as the bits of `y[t]`, its warp's mask plus `__ffs` of it (`mask + lowest voting
    /// lane + 1`).
    pub fn ballot(
        launch: &Launch,
        order: Order,
        x: &Buf<f32>,
        y: &mut Buf<f32>,
        lanes: u32,
    ) -> Result<()> {
        need_elems("ballot", x.len(), launch.block.0 as usize)?;
        // SAFETY: per_thread checks the single 1-D block and y; x is checked above; thread t
        // reads x[t] only.
        per_thread("ballot", launch, order, y, |l, e, el, y| unsafe {
            emu_selftest_ballot(l, e, el, x.ptr(), y, lanes)
        })
    }

    /// Writes `y[i]` for every thread `i` of the grid, with no bounds check: `y` may be
    /// shorter by at most [`GUARD`] elements (the guard zone catches the overrun).
    pub fn unguarded(launch: &Launch, order: Order, y: &mut Buf<f32>) -> Result<()> {
        let k = "unguarded";
        if launch.grid.1 != 1 || launch.grid.2 != 1 || launch.block.1 != 1 || launch.block.2 != 1 {
            return Err(EmuError::Args {
                kernel: k.into(),
                what: "a 1-D launch".into(),
            });
        }
        let threads = launch.threads() as usize;
        need_elems(k, y.len() + GUARD, threads)?;
        // SAFETY: thread i writes element i < threads <= y.len() + GUARD of the interior
        // pointer, which is inside y's allocation (interior plus the after-guard zone).
        run(launch, order, |l, e, el| unsafe {
            emu_selftest_unguarded(l, e, el, y.mut_ptr())
        })?;
        y.check(k)
    }
}
