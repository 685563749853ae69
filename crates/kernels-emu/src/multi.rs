//! Safe wrappers of the multi-tensor kernels of `crates/kernels/cuda/multi_tensor.cu`: the sum
//! of squares over a table of tensors (stage 1), the norm and clip coefficient (stage 2), and
//! the one-launch AdamW step. The tables hold the buffers' interior addresses (device pointers
//! are host pointers here) and the prefix sums of their lengths, built from the buffers
//! themselves, so the extents the kernels walk are the buffers' own.

use std::ffi::{c_char, c_int};

use half::bf16;

use crate::{need_elems, run, Buf, EmuError, Launch, Order, RawLaunch, Result};

type Ll = std::ffi::c_longlong;

extern "C" {
    fn emu_sumsq_partial_f32(
        l: *const RawLaunch,
        e: *mut c_char,
        el: usize,
        ptrs: *const u64,
        starts: *const Ll,
        k: c_int,
        chunk: Ll,
        partial: *mut f32,
    ) -> c_int;
    fn emu_sumsq_partial_bf16(
        l: *const RawLaunch,
        e: *mut c_char,
        el: usize,
        ptrs: *const u64,
        starts: *const Ll,
        k: c_int,
        chunk: Ll,
        partial: *mut f32,
    ) -> c_int;
    fn emu_norm_finish(
        l: *const RawLaunch,
        e: *mut c_char,
        el: usize,
        partial: *const f32,
        blocks: c_int,
        max_norm: f32,
        out: *mut f32,
    ) -> c_int;
    fn emu_adamw_f32(
        l: *const RawLaunch,
        e: *mut c_char,
        el: usize,
        ps: *const u64,
        gs: *const u64,
        ms: *const u64,
        vs: *const u64,
        starts: *const Ll,
        k: c_int,
        chunk: Ll,
        coef: *const f32,
        c: *const [f32; 9],
    ) -> c_int;
}

fn args(kernel: &str, what: String) -> EmuError {
    EmuError::Args {
        kernel: kernel.into(),
        what,
    }
}

/// Prefix sums of the lengths (k + 1 entries), checked to fit the kernels' integer types.
fn starts(kernel: &str, lens: impl Iterator<Item = usize>) -> Result<(Vec<Ll>, usize)> {
    let mut s = vec![0 as Ll];
    let mut total = 0usize;
    for n in lens {
        total = total
            .checked_add(n)
            .ok_or_else(|| args(kernel, "the lengths overflow".into()))?;
        s.push(Ll::try_from(total).map_err(|_| args(kernel, format!("{total} elements")))?);
    }
    Ok((s, total))
}

fn blocks_of(kernel: &str, total: usize, chunk: usize) -> Result<u32> {
    if chunk == 0 {
        return Err(args(kernel, "chunk 0".into()));
    }
    u32::try_from(total.div_ceil(chunk).max(1))
        .map_err(|_| args(kernel, format!("{total} / {chunk} blocks")))
}

/// The sum-of-squares shim of one element type.
type SumsqFn = unsafe extern "C" fn(
    *const RawLaunch,
    *mut c_char,
    usize,
    *const u64,
    *const Ll,
    c_int,
    Ll,
    *mut f32,
) -> c_int;

/// An element type of the sum-of-squares kernel (sealed by the crate's own impls).
pub trait SumsqDt: crate::fused::Dt {
    #[doc(hidden)]
    const SUMSQ: SumsqFn;
}
impl SumsqDt for f32 {
    const SUMSQ: SumsqFn = emu_sumsq_partial_f32;
}
impl SumsqDt for bf16 {
    const SUMSQ: SumsqFn = emu_sumsq_partial_bf16;
}

/// `[norm, clip coefficient]` of the tensors `parts` with `threads` per block and `chunk`
/// elements per stage-1 block (the CUDA op uses 1024 threads and `max(8192, total / 1024)`;
/// small chunks make blocks cross tensor boundaries). `max_norm <= 0`: no clipping.
pub fn grad_norm<T: SumsqDt>(
    order: Order,
    parts: &[Buf<T>],
    max_norm: f32,
    chunk: usize,
    threads: u32,
) -> Result<[f32; 2]> {
    let k = "grad_norm";
    let (st, total) = starts(k, parts.iter().map(Buf::len))?;
    let kk = c_int::try_from(parts.len()).map_err(|_| args(k, "too many tensors".into()))?;
    let ptrs: Vec<u64> = parts.iter().map(|b| b.ptr() as u64).collect();
    let mut out = Buf::filled("out", 2, f32::NAN);
    if total == 0 {
        // SAFETY: with 0 blocks the finish kernel never reads `partial` (null) and writes
        // out[0], out[1].
        run(&Launch::linear(1, 32, 0), order, |l, e, el| unsafe {
            emu_norm_finish(l, e, el, std::ptr::null(), 0, max_norm, out.mut_ptr())
        })?;
        out.check("norm_finish")?;
        return Ok([out.as_slice()[0], out.as_slice()[1]]);
    }
    let blocks = blocks_of(k, total, chunk)?;
    let ch = Ll::try_from(chunk).map_err(|_| args(k, format!("chunk {chunk}")))?;
    let mut partial = Buf::filled("partial", blocks as usize, f32::NAN);
    // SAFETY: ptrs[i] is the interior of parts[i], which holds starts[i + 1] - starts[i]
    // elements of T; block b reads elements [b chunk, (b + 1) chunk) ∩ [0, total) of the
    // concatenation and writes partial[b], b < blocks = ceil(total / chunk). 1-D launch.
    run(
        &Launch::linear(blocks, threads, 0),
        order,
        |l, e, el| unsafe {
            T::SUMSQ(
                l,
                e,
                el,
                ptrs.as_ptr(),
                st.as_ptr(),
                kk,
                ch,
                partial.mut_ptr(),
            )
        },
    )?;
    partial.check("sumsq_partial")?;
    // SAFETY: reads partial[0 .. blocks), writes out[0], out[1].
    run(&Launch::linear(1, threads, 0), order, |l, e, el| unsafe {
        emu_norm_finish(
            l,
            e,
            el,
            partial.ptr(),
            blocks as c_int,
            max_norm,
            out.mut_ptr(),
        )
    })?;
    out.check("norm_finish")?;
    Ok([out.as_slice()[0], out.as_slice()[1]])
}

/// One AdamW step of every tensor in place (`consts`: `AdamWStep::consts`), gradients scaled by
/// `coef` first when given.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    order: Order,
    p: &mut [Buf<f32>],
    g: &[Buf<f32>],
    m: &mut [Buf<f32>],
    v: &mut [Buf<f32>],
    consts: [f32; 9],
    coef: Option<f32>,
    chunk: usize,
    threads: u32,
) -> Result<()> {
    let k = "adamw";
    if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
        return Err(args(k, "tables of different lengths".into()));
    }
    for i in 0..p.len() {
        for len in [g[i].len(), m[i].len(), v[i].len()] {
            need_elems(k, len, p[i].len())?;
            need_elems(k, p[i].len(), len)?;
        }
    }
    let (st, total) = starts(k, p.iter().map(Buf::len))?;
    if total == 0 {
        return Ok(());
    }
    let kk = c_int::try_from(p.len()).map_err(|_| args(k, "too many tensors".into()))?;
    let ps: Vec<u64> = p.iter_mut().map(|b| b.mut_ptr() as u64).collect();
    let gs: Vec<u64> = g.iter().map(|b| b.ptr() as u64).collect();
    let ms: Vec<u64> = m.iter_mut().map(|b| b.mut_ptr() as u64).collect();
    let vs: Vec<u64> = v.iter_mut().map(|b| b.mut_ptr() as u64).collect();
    let coef_buf = coef.map(|c| Buf::from_slice("coef", &[c]));
    let coef_ptr = coef_buf.as_ref().map_or(std::ptr::null(), Buf::ptr);
    let blocks = blocks_of(k, total, chunk)?;
    let ch = Ll::try_from(chunk).map_err(|_| args(k, format!("chunk {chunk}")))?;
    // SAFETY: entry i of each table is the interior of a distinct buffer (p, m, v mutably
    // borrowed, g shared) of starts[i + 1] - starts[i] elements (lengths checked equal); each
    // element of the concatenation is read and written by one thread of the block owning its
    // chunk; coef is null or one f32; consts is 9 f32 in AdamWConsts's order.
    run(
        &Launch::linear(blocks, threads, 0),
        order,
        |l, e, el| unsafe {
            emu_adamw_f32(
                l,
                e,
                el,
                ps.as_ptr(),
                gs.as_ptr(),
                ms.as_ptr(),
                vs.as_ptr(),
                st.as_ptr(),
                kk,
                ch,
                coef_ptr,
                &consts,
            )
        },
    )?;
    for b in p.iter().chain(m.iter()).chain(v.iter()) {
        b.check(k)?;
    }
    Ok(())
}
