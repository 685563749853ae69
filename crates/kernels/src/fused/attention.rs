//! Attention on the packed QKV projection on the CPU (f32), forward and backward, one task per
//! (batch, head) on rayon's pool.
//!
//! The input is the QKV linear's output as it lies in memory, `[B, T, H, 3, d]` (each token's
//! row holds head 0's q, k and v, then head 1's, ...); the output is `[B, T, H, d]`, what the
//! output projection reads; the backward writes the packed gradient. No head is copied out of
//! the packed rows and no `[B, H, T, T]` tensor exists: a task computes its head's scores for
//! a block of [`ROWS`] queries against the keys the causal mask leaves them (so about half of
//! the scores under the mask are never computed), the softmax in place, and the block's
//! products, with gemm (the crate candle's CPU matmul runs on) reading and writing the packed
//! rows through their strides. The backward recomputes the probabilities as the forward did.
//!
//! Bits: the softmax and its backward are the row kernels' own functions
//! ([`super::softmax_row_in_place`], [`super::softmax_row_backward_in_place`]); a task's work does not depend on the number of threads or
//! on which thread runs it, so neither changes a bit. The products differ from a batched matmul
//! over the full `T x T` scores only in gemm's summation order (ulps).
//!
//! The tasks write disjoint elements of one output buffer through a shared pointer: task
//! `(b, h)` writes only the elements of batch `b` and head `h` (see [`Shared`]).

use super::{plain, simd, softmax_row_backward_in_place, softmax_row_in_place};

type CResult<T> = candle_core::Result<T>;

/// Queries per block of a task: a block's scores are `ROWS x keys` floats of scratch.
const ROWS: usize = 64;

/// The shape of a packed projection: `b` batches of `t` tokens, `h` heads of dim `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Packed {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
}

impl Packed {
    /// A token's row in the packed input: `3 h d`.
    fn w(&self) -> usize {
        3 * self.h * self.d
    }

    /// A token's row in the output: `h d`.
    fn hd(&self) -> usize {
        self.h * self.d
    }

    fn input_len(&self) -> Option<usize> {
        self.b
            .checked_mul(self.t)?
            .checked_mul(self.h.checked_mul(self.d)?.checked_mul(3)?)
    }

    fn output_len(&self) -> Option<usize> {
        self.b
            .checked_mul(self.t)?
            .checked_mul(self.h.checked_mul(self.d)?)
    }

    /// Where head `h` of batch `b` starts: its q in the input, its rows in the output.
    fn head(&self, task: usize) -> Head {
        let (b, h) = (task / self.h, task % self.h);
        let q = b * self.t * self.w() + h * 3 * self.d;
        Head {
            q,
            k: q + self.d,
            v: q + 2 * self.d,
            o: b * self.t * self.hd() + h * self.d,
        }
    }
}

/// Offsets of one (batch, head) task's token 0: q, k, v in the packed input (or its gradient)
/// and the row in the output (or its gradient).
#[derive(Clone, Copy)]
struct Head {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
}

/// A row-major view into a buffer: `rows x cols` elements at `off + r rs + c cs`.
#[derive(Clone, Copy, Debug)]
struct View {
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl View {
    fn new(off: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        View {
            off,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The view's transpose (the same elements).
    fn t(self) -> Self {
        View::new(self.off, self.cols, self.rows, self.cs, self.rs)
    }

    /// One past the largest element index the view names (its offset when it is empty).
    fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return self.off;
        }
        self.off + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
    }
}

/// The output buffer the tasks share (its start and length).
#[derive(Clone, Copy)]
struct Shared {
    ptr: *mut f32,
    len: usize,
}

impl Shared {
    /// The buffer `v`, to be written through by tasks (see the `Send` invariant below).
    fn of(v: &mut [f32]) -> Self {
        Shared {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }
}

// SAFETY: a `Shared` is made from a buffer that outlives every use of it: `forward`'s output
// and `backward`'s gradient, kept alive (and not otherwise referenced) until the parallel loop
// over the tasks returns, or a task's own scratch, used on that task's thread alone. Through
// an output, every task writes only the elements of its own (batch, head) pair
// (`Packed::head`'s offsets plus rows of `t` tokens at the buffer's row stride, `d` columns of
// the output or `3 d` of the gradient): distinct tasks write disjoint elements.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`: shared by the tasks only to write disjoint elements.
unsafe impl Sync for Shared {}

/// `dst = lhs rhs`, or `dst += lhs rhs` with `acc` (f32, on the calling thread), every view
/// checked against its buffer's length first.
///
/// # Panics
///
/// The views' shapes do not chain (`lhs` m x k, `rhs` k x n, `dst` m x n) or one reaches past
/// its buffer: a bug of this module's offsets, never an input's (shapes are checked before).
fn gemm(dst: Shared, dv: View, acc: bool, lhs: &[f32], lv: View, rhs: &[f32], rv: View) {
    assert!(
        lv.rows == dv.rows && rv.cols == dv.cols && lv.cols == rv.rows,
        "attention gemm: {lv:?} x {rv:?} -> {dv:?}"
    );
    assert!(
        dv.end() <= dst.len && lv.end() <= lhs.len() && rv.end() <= rhs.len(),
        "attention gemm outside a buffer: {dv:?} of {}, {lv:?} of {}, {rv:?} of {}",
        dst.len,
        lhs.len(),
        rhs.len()
    );
    if dv.rows == 0 || dv.cols == 0 {
        return;
    }
    if lv.cols == 0 {
        // An empty sum: gemm is not asked to decide what that writes.
        if !acc {
            for r in 0..dv.rows {
                for c in 0..dv.cols {
                    // SAFETY: inside `dst` (checked above); this task's element (see `Shared`).
                    unsafe { *dst.ptr.add(dv.off + r * dv.rs + c * dv.cs) = 0.0 };
                }
            }
        }
        return;
    }
    // Strides fit isize: each view ends inside a buffer of at most isize::MAX bytes.
    let s = |v: usize| v as isize;
    // SAFETY: every element the three views name is inside its buffer (checked above); `lhs`
    // and `rhs` are live shared slices, `dst`'s buffer is live and its elements named here are
    // written by this task alone (see `Shared`) and never alias `lhs` or `rhs` (the callers
    // pass the input, the output gradient or this task's scratch as operands, never the output
    // being written). The buffers are initialized (zeroed when made), whether or not gemm
    // reads `dst`.
    unsafe {
        gemm::gemm(
            dv.rows,
            dv.cols,
            lv.cols,
            dst.ptr.add(dv.off),
            s(dv.cs),
            s(dv.rs),
            acc,
            lhs.as_ptr().add(lv.off),
            s(lv.cs),
            s(lv.rs),
            rhs.as_ptr().add(rv.off),
            s(rv.cs),
            s(rv.rs),
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The keys query `row` of `t` sees (causal: itself and those before it).
fn valid(causal: bool, row: usize, t: usize) -> usize {
    if causal {
        row + 1
    } else {
        t
    }
}

/// A task's blocks of queries: the first row, the rows (at most [`ROWS`]) and the keys they
/// see (causal: up to the block's last row).
fn blocks(p: Packed, causal: bool) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..p.t).step_by(ROWS).map(move |r0| {
        let rows = ROWS.min(p.t - r0);
        (r0, rows, if causal { r0 + rows } else { p.t })
    })
}

/// One block's scores `s = q k^T` (`rows x keys`, row stride `keys`), then in place the
/// probabilities `softmax(scale s)` under the mask (zero past each row's valid keys), by the
/// causal softmax row kernel's own function.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn probs(
    qkv: &[f32],
    p: Packed,
    hd: Head,
    r0: usize,
    rows: usize,
    keys: usize,
    causal: bool,
    scale: f32,
    s: &mut Vec<f32>,
) {
    let w = p.w();
    s.clear();
    s.resize(rows * keys, 0.0);
    let sv = View::new(0, rows, keys, keys, 1);
    let out = Shared::of(s);
    let q = View::new(hd.q + r0 * w, rows, p.d, w, 1);
    let k = View::new(hd.k, keys, p.d, w, 1);
    gemm(out, sv, false, qkv, q, qkv, k.t());
    for (i, row) in s.chunks_exact_mut(keys).enumerate() {
        let n = valid(causal, r0 + i, p.t).min(keys);
        let (xr, rest) = row.split_at_mut(n);
        rest.fill(0.0);
        softmax_row_in_place(xr, scale);
    }
}

/// Runs `task(i, scratch)` for every task `0..n`: in parallel on rayon's pool (each task in
/// [`simd`]) unless the kernels run plain, there is one thread or one task.
fn for_tasks(n: usize, task: impl Fn(usize, &mut [Vec<f32>; 2]) + Sync + Send) {
    if plain() || n <= 1 || rayon::current_num_threads() == 1 {
        let mut scratch = [Vec::new(), Vec::new()];
        return simd(|| (0..n).for_each(|i| task(i, &mut scratch)));
    }
    use rayon::prelude::*;
    (0..n).into_par_iter().for_each_init(
        || [Vec::new(), Vec::new()],
        |scratch, i| simd(|| task(i, scratch)),
    );
}

/// Task `task`'s (batch, head) of [`forward`]: its output rows, block by block. Inlined into
/// the task's [`simd`] closure, so its softmax loops get the dispatched instructions.
#[inline(always)]
fn forward_head(
    qkv: &[f32],
    p: Packed,
    task: usize,
    causal: bool,
    scale: f32,
    dst: Shared,
    s: &mut Vec<f32>,
) {
    let (w, hd_w, hd) = (p.w(), p.hd(), p.head(task));
    for (r0, rows, keys) in blocks(p, causal) {
        probs(qkv, p, hd, r0, rows, keys, causal, scale, s);
        let o = View::new(hd.o + r0 * hd_w, rows, p.d, hd_w, 1);
        let v = View::new(hd.v, keys, p.d, w, 1);
        gemm(dst, o, false, s, View::new(0, rows, keys, keys, 1), qkv, v);
    }
}

/// Task `task`'s (batch, head) of [`backward`]: its q, k and v gradients, block by block
/// (inlined as [`forward_head`] is).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_head(
    qkv: &[f32],
    g: &[f32],
    p: Packed,
    task: usize,
    causal: bool,
    scale: f32,
    dst: Shared,
    s: &mut Vec<f32>,
    dp: &mut Vec<f32>,
) {
    let (w, hd_w, hd) = (p.w(), p.hd(), p.head(task));
    for (r0, rows, keys) in blocks(p, causal) {
        probs(qkv, p, hd, r0, rows, keys, causal, scale, s);
        let sv = View::new(0, rows, keys, keys, 1);
        let go = View::new(hd.o + r0 * hd_w, rows, p.d, hd_w, 1);
        let q = View::new(hd.q + r0 * w, rows, p.d, w, 1);
        let k = View::new(hd.k, keys, p.d, w, 1);
        let v = View::new(hd.v, keys, p.d, w, 1);
        // dP = dO v^T, into the second scratch.
        dp.clear();
        dp.resize(rows * keys, 0.0);
        let dpv = Shared::of(dp);
        gemm(dpv, sv, false, g, go, qkv, v.t());
        // dV += P^T dO.
        gemm(dst, v, true, s, sv.t(), g, go);
        // dS = scale P (dP - rowsum(P dP)), in place of dP, by the softmax backward row
        // kernel's own function; zero under the mask.
        for (i, (yr, gr)) in s
            .chunks_exact(keys)
            .zip(dp.chunks_exact_mut(keys))
            .enumerate()
        {
            let n = valid(causal, r0 + i, p.t).min(keys);
            let (gr, rest) = gr.split_at_mut(n);
            rest.fill(0.0);
            softmax_row_backward_in_place(&yr[..n], gr, scale);
        }
        // dQ = dS k (this block's rows: written once), dK += dS^T q.
        gemm(dst, q, false, dp, sv, qkv, k);
        gemm(dst, k, true, dp, sv.t(), qkv, q);
    }
}

fn check_len(what: &str, got: usize, want: Option<usize>, p: Packed) -> CResult<usize> {
    match want {
        Some(n) if n == got => Ok(n),
        _ => Err(candle_core::Error::msg(format!(
            "packed_sdpa (CPU): {what} has {got} elements, not the {want:?} of {p:?} \
             ([B, T, H, 3, d] in, [B, T, H, d] out)"
        ))),
    }
}

/// The attention of packed `qkv` (`[B, T, H, 3, d]`, contiguous): `[B, T, H, d]`.
///
/// # Errors
///
/// `qkv`'s length is not `p`'s.
pub(crate) fn forward(qkv: &[f32], p: Packed, causal: bool, scale: f32) -> CResult<Vec<f32>> {
    check_len("qkv", qkv.len(), p.input_len(), p)?;
    // No larger than the input's length, which fits.
    let n = p.output_len().unwrap_or(0);
    let mut out = vec![0f32; n];
    if n == 0 || p.t == 0 {
        return Ok(out);
    }
    let dst = Shared::of(&mut out);
    for_tasks(p.b * p.h, |task, [s, _]| {
        forward_head(qkv, p, task, causal, scale, dst, s)
    });
    Ok(out)
}

/// The gradient of [`forward`] with respect to `qkv`, from the output's gradient `g`
/// (`[B, T, H, d]`, contiguous): `[B, T, H, 3, d]`.
///
/// # Errors
///
/// A length is not `p`'s.
pub(crate) fn backward(
    qkv: &[f32],
    g: &[f32],
    p: Packed,
    causal: bool,
    scale: f32,
) -> CResult<Vec<f32>> {
    let n = check_len("qkv", qkv.len(), p.input_len(), p)?;
    check_len("the output gradient", g.len(), p.output_len(), p)?;
    let mut dx = vec![0f32; n];
    if n == 0 || p.t == 0 {
        return Ok(dx);
    }
    let dst = Shared::of(&mut dx);
    for_tasks(p.b * p.h, |task, [s, dp]| {
        backward_head(qkv, g, p, task, causal, scale, dst, s, dp)
    });
    Ok(dx)
}
