//! Safe wrappers of the fused row kernels of `crates/kernels/cuda` (GELU, layer/RMS norm,
//! softmax and log-softmax, softmax cross-entropy), forward and backward, for f32 and bf16.
//!
//! Each wrapper checks that every buffer holds what the kernel reads or writes for the shape it
//! is given, and the launch properties the kernel's indexing relies on for staying in bounds
//! (written next to each); anything else about the launch (a block size the kernels' block
//! reductions do not support, say) is the emulator's to report.

use std::ffi::{c_char, c_int};

use half::bf16;

use crate::{need_elems, run, Buf, Element, EmuError, Launch, Order, RawLaunch, Result};

#[path = "../../kernels/src/fa_rows.rs"]
mod fa_rows;
pub use fa_rows::{check_bwd, check_disjoint, check_fwd, FaBwdRows, FaRows, MAX_ROW_STRIDE};

type Ll = std::ffi::c_longlong;
type Head = (*const RawLaunch, *mut c_char, usize);
type GeluFwd<T> = unsafe fn(Head, *const T, *mut T, Ll) -> c_int;
type GeluBwd<T> = unsafe fn(Head, *const T, *const T, *mut T, Ll) -> c_int;
type EmbBwd<T> = unsafe fn(Head, *const u32, c_int, *const T, *mut T, c_int, c_int) -> c_int;
type AddRows<T> = unsafe fn(Head, *mut T, *const T, Ll, c_int) -> c_int;
type ColSumPartial<T> = unsafe fn(Head, *const T, *mut f32, Ll, c_int) -> c_int;
type ColSumFinal<T> = unsafe fn(Head, *const f32, *mut T, c_int, c_int) -> c_int;
type NormFwd<T> =
    unsafe fn(Head, *const T, *const T, *const T, *mut T, Ll, c_int, f32, c_int) -> c_int;
type NormBwdDx<T> =
    unsafe fn(Head, *const T, *const T, *const T, *mut T, *mut f32, Ll, c_int, f32, c_int) -> c_int;
type NormBwdPartial<T> =
    unsafe fn(Head, *const T, *const T, *const f32, *mut f32, Ll, c_int, Ll) -> c_int;
type NormBwdFinal<T> = unsafe fn(Head, *const f32, *mut T, c_int, c_int) -> c_int;
type SoftmaxFwd<T> = unsafe fn(Head, *const T, *mut T, Ll, c_int, Ll, f32, c_int, c_int) -> c_int;
type SoftmaxBwd<T> = unsafe fn(Head, *const T, *const T, *mut T, Ll, c_int, f32, c_int) -> c_int;
type FaFwd<T> = unsafe fn(
    Head,
    *const T,
    *const T,
    *const T,
    *mut T,
    *mut f32,
    *const FaRows,
    c_int,
    c_int,
    f32,
    c_int,
) -> c_int;
type FaDelta<T> = unsafe fn(Head, *const T, *const T, *mut f32, *const FaRows, Ll, c_int) -> c_int;
type FaDkv<T> = unsafe fn(
    Head,
    *const T,
    *const T,
    *const T,
    *const T,
    *const f32,
    *const f32,
    *mut T,
    *const FaRows,
    c_int,
    c_int,
    f32,
    c_int,
) -> c_int;
type FaDq<T> = unsafe fn(
    Head,
    *const T,
    *const T,
    *const T,
    *const T,
    *const f32,
    *const f32,
    *mut T,
    *const FaRows,
    c_int,
    c_int,
    f32,
    c_int,
) -> c_int;

/// The flash-attention shims of one element type and head dim.
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct FaFns<T> {
    fwd: FaFwd<T>,
    delta: FaDelta<T>,
    dkv: FaDkv<T>,
    dq: FaDq<T>,
}

/// The head dims the flash-attention kernels are built for.
pub const FA_HEAD_DIMS: [usize; 5] = [32, 48, 64, 96, 128];
type XentFwd<E, I> = unsafe fn(Head, *const E, *const I, *mut f32, Ll, c_int, Ll, c_int) -> c_int;
type XentBwd<E, I> =
    unsafe fn(Head, *const E, *const I, *const f32, *mut E, Ll, c_int, Ll, c_int) -> c_int;

impl Element for bf16 {
    const GUARD: Self = bf16::from_bits(0x7fa5);
}

mod sealed {
    /// Only this crate's types implement [`super::Dt`] and [`super::Index`]: the wrappers'
    /// safety rests on the function pointers being this crate's shims.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u32 {}
    impl Sealed for i64 {}
}

/// An element type the kernels are built for, with its shims (sealed).
pub trait Dt: Element + sealed::Sealed {
    /// The kernels' name suffix (`f32`, `bf16`).
    const NAME: &'static str;
    /// The value as f32.
    fn to_f32(self) -> f32;
    /// `v` rounded to this type (to nearest, ties to even).
    fn from_f32(v: f32) -> Self;
    #[doc(hidden)]
    const GELU_FWD: GeluFwd<Self>;
    #[doc(hidden)]
    const GELU_BWD: GeluBwd<Self>;
    #[doc(hidden)]
    const EMB_BWD: EmbBwd<Self>;
    #[doc(hidden)]
    const ADD_ROWS: AddRows<Self>;
    #[doc(hidden)]
    const COL_SUM_PARTIAL: ColSumPartial<Self>;
    #[doc(hidden)]
    const COL_SUM_FINAL: ColSumFinal<Self>;
    #[doc(hidden)]
    const NORM_FWD: NormFwd<Self>;
    #[doc(hidden)]
    const NORM_BWD_DX: NormBwdDx<Self>;
    #[doc(hidden)]
    const NORM_BWD_PARTIAL: NormBwdPartial<Self>;
    #[doc(hidden)]
    const NORM_BWD_FINAL: NormBwdFinal<Self>;
    #[doc(hidden)]
    const SOFTMAX_FWD: SoftmaxFwd<Self>;
    #[doc(hidden)]
    const SOFTMAX_BWD: SoftmaxBwd<Self>;
    #[doc(hidden)]
    fn fa(d: usize) -> Option<FaFns<Self>>;
    /// The tensor-core kernels (bf16 only; `None` for other types).
    #[doc(hidden)]
    fn fa_tc(_d: usize) -> Option<FaFns<Self>> {
        None
    }
}

/// A class-index type of the cross-entropy kernels, with their shims for element type `T`.
pub trait Index<T>: Element + sealed::Sealed {
    #[doc(hidden)]
    const XENT_FWD: XentFwd<T, Self>;
    #[doc(hidden)]
    const XENT_BWD: XentBwd<T, Self>;
}

// The shims take the launch head as three arguments; these adapters give them one tuple so the
// trait's function types stay short.
macro_rules! shims {
    ($($name:ident ( $($arg:ident : $ty:ty),* );)*) => {
        mod raw {
            use super::*;
            extern "C" {
                $(pub fn $name(l: *const RawLaunch, e: *mut c_char, el: usize, $($arg: $ty),*) -> c_int;)*
            }
        }
        $(
            #[allow(clippy::too_many_arguments)]
            unsafe fn $name(h: Head, $($arg: $ty),*) -> c_int {
                // SAFETY: forwarded unchanged; the caller upholds the shim's contract.
                unsafe { raw::$name(h.0, h.1, h.2, $($arg),*) }
            }
        )*
    };
}

shims! {
    emu_gelu_fwd_f32(x: *const f32, y: *mut f32, len: Ll);
    emu_gelu_bwd_f32(x: *const f32, g: *const f32, dx: *mut f32, len: Ll);
    emu_gelu_fwd_bf16(x: *const bf16, y: *mut bf16, len: Ll);
    emu_gelu_bwd_bf16(x: *const bf16, g: *const bf16, dx: *mut bf16, len: Ll);
    emu_embedding_bwd_f32(ids: *const u32, n: c_int, g: *const f32, dtable: *mut f32, d: c_int, vocab: c_int);
    emu_embedding_bwd_bf16(ids: *const u32, n: c_int, g: *const bf16, dtable: *mut bf16, d: c_int, vocab: c_int);
    emu_cast_add_rows_bf16_f32(y: *const bf16, b: *const f32, out: *mut f32, len: Ll, n: c_int);
    emu_add_rows_f32_f32(y: *mut f32, b: *const f32, len: Ll, n: c_int);
    emu_add_rows_bf16_bf16(y: *mut bf16, b: *const bf16, len: Ll, n: c_int);
    emu_add_rows_bf16_f32(y: *mut bf16, b: *const f32, len: Ll, n: c_int);
    emu_col_sum_partial_f32(x: *const f32, part: *mut f32, rows: Ll, n: c_int);
    emu_col_sum_final_f32(part: *const f32, out: *mut f32, chunks: c_int, n: c_int);
    emu_col_sum_partial_bf16(x: *const bf16, part: *mut f32, rows: Ll, n: c_int);
    emu_col_sum_final_bf16(part: *const f32, out: *mut bf16, chunks: c_int, n: c_int);
    emu_norm_fwd_f32(x: *const f32, w: *const f32, b: *const f32, y: *mut f32, rows: Ll, n: c_int, eps: f32, center: c_int);
    emu_norm_fwd_bf16(x: *const bf16, w: *const bf16, b: *const bf16, y: *mut bf16, rows: Ll, n: c_int, eps: f32, center: c_int);
    emu_norm_bwd_dx_f32(x: *const f32, w: *const f32, g: *const f32, dx: *mut f32, stats: *mut f32, rows: Ll, n: c_int, eps: f32, center: c_int);
    emu_norm_bwd_dx_bf16(x: *const bf16, w: *const bf16, g: *const bf16, dx: *mut bf16, stats: *mut f32, rows: Ll, n: c_int, eps: f32, center: c_int);
    emu_norm_bwd_partial_f32(x: *const f32, g: *const f32, stats: *const f32, part: *mut f32, rows: Ll, n: c_int, per_chunk: Ll);
    emu_norm_bwd_partial_bf16(x: *const bf16, g: *const bf16, stats: *const f32, part: *mut f32, rows: Ll, n: c_int, per_chunk: Ll);
    emu_norm_bwd_final_f32(part: *const f32, wb: *mut f32, chunks: c_int, n: c_int);
    emu_norm_bwd_final_bf16(part: *const f32, wb: *mut bf16, chunks: c_int, n: c_int);
    emu_softmax_fwd_f32(x: *const f32, y: *mut f32, rows: Ll, n: c_int, t: Ll, scale: f32, causal: c_int, log_out: c_int);
    emu_softmax_fwd_bf16(x: *const bf16, y: *mut bf16, rows: Ll, n: c_int, t: Ll, scale: f32, causal: c_int, log_out: c_int);
    emu_softmax_bwd_f32(y: *const f32, g: *const f32, dx: *mut f32, rows: Ll, n: c_int, scale: f32, log_out: c_int);
    emu_softmax_bwd_bf16(y: *const bf16, g: *const bf16, dx: *mut bf16, rows: Ll, n: c_int, scale: f32, log_out: c_int);
    emu_xent_fwd_f32_u32(x: *const f32, t: *const u32, out: *mut f32, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_xent_fwd_f32_i64(x: *const f32, t: *const i64, out: *mut f32, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_xent_fwd_bf16_u32(x: *const bf16, t: *const u32, out: *mut f32, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_xent_fwd_bf16_i64(x: *const bf16, t: *const i64, out: *mut f32, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_xent_bwd_f32_u32(x: *const f32, t: *const u32, lg: *const f32, dx: *mut f32, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_xent_bwd_f32_i64(x: *const f32, t: *const i64, lg: *const f32, dx: *mut f32, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_xent_bwd_bf16_u32(x: *const bf16, t: *const u32, lg: *const f32, dx: *mut bf16, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
    emu_fa_fwd_f32_d32(q: *const f32, k: *const f32, v: *const f32, o: *mut f32, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_f32_d32(o: *const f32, d_o: *const f32, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_f32_d32(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dkv: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_f32_d32(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dq: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_f32_d48(q: *const f32, k: *const f32, v: *const f32, o: *mut f32, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_f32_d48(o: *const f32, d_o: *const f32, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_f32_d48(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dkv: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_f32_d48(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dq: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_f32_d64(q: *const f32, k: *const f32, v: *const f32, o: *mut f32, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_f32_d64(o: *const f32, d_o: *const f32, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_f32_d64(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dkv: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_f32_d64(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dq: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_f32_d96(q: *const f32, k: *const f32, v: *const f32, o: *mut f32, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_f32_d96(o: *const f32, d_o: *const f32, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_f32_d96(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dkv: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_f32_d96(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dq: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_f32_d128(q: *const f32, k: *const f32, v: *const f32, o: *mut f32, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_f32_d128(o: *const f32, d_o: *const f32, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_f32_d128(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dkv: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_f32_d128(q: *const f32, k: *const f32, v: *const f32, d_o: *const f32, lse: *const f32, delta: *const f32, dq: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_bf16_d32(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_bf16_d32(o: *const bf16, d_o: *const bf16, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_bf16_d32(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_bf16_d32(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_bf16_d48(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_bf16_d48(o: *const bf16, d_o: *const bf16, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_bf16_d48(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_bf16_d48(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_bf16_d64(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_bf16_d64(o: *const bf16, d_o: *const bf16, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_bf16_d64(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_bf16_d64(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_bf16_d96(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_bf16_d96(o: *const bf16, d_o: *const bf16, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_bf16_d96(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_bf16_d96(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_bf16_d128(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_delta_bf16_d128(o: *const bf16, d_o: *const bf16, delta: *mut f32, l: *const FaRows, rows: Ll, tq: c_int);
    emu_fa_bwd_dkv_bf16_d128(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_bf16_d128(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_tc_bf16_d32(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_tc_bf16_d48(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_tc_bf16_d64(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_tc_bf16_d96(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_fwd_tc_bf16_d128(q: *const bf16, k: *const bf16, v: *const bf16, o: *mut bf16, lse: *mut f32, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dkv_tc_bf16_d32(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_tc_bf16_d32(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dkv_tc_bf16_d48(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_tc_bf16_d48(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dkv_tc_bf16_d64(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_tc_bf16_d64(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dkv_tc_bf16_d96(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_tc_bf16_d96(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dkv_tc_bf16_d128(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dkv: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_fa_bwd_dq_tc_bf16_d128(q: *const bf16, k: *const bf16, v: *const bf16, d_o: *const bf16, lse: *const f32, delta: *const f32, dq: *mut bf16, l: *const FaRows, tq: c_int, tk: c_int, scale: f32, causal: c_int);
    emu_xent_bwd_bf16_i64(x: *const bf16, t: *const i64, lg: *const f32, dx: *mut bf16, rows: Ll, n: c_int, ignore: Ll, has_ignore: c_int);
}

impl Dt for f32 {
    const NAME: &'static str = "f32";
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    const GELU_FWD: GeluFwd<Self> = emu_gelu_fwd_f32;
    const GELU_BWD: GeluBwd<Self> = emu_gelu_bwd_f32;
    const EMB_BWD: EmbBwd<Self> = emu_embedding_bwd_f32;
    const ADD_ROWS: AddRows<Self> = emu_add_rows_f32_f32;
    const COL_SUM_PARTIAL: ColSumPartial<Self> = emu_col_sum_partial_f32;
    const COL_SUM_FINAL: ColSumFinal<Self> = emu_col_sum_final_f32;
    const NORM_FWD: NormFwd<Self> = emu_norm_fwd_f32;
    const NORM_BWD_DX: NormBwdDx<Self> = emu_norm_bwd_dx_f32;
    const NORM_BWD_PARTIAL: NormBwdPartial<Self> = emu_norm_bwd_partial_f32;
    const NORM_BWD_FINAL: NormBwdFinal<Self> = emu_norm_bwd_final_f32;
    const SOFTMAX_FWD: SoftmaxFwd<Self> = emu_softmax_fwd_f32;
    const SOFTMAX_BWD: SoftmaxBwd<Self> = emu_softmax_bwd_f32;
    fn fa(d: usize) -> Option<FaFns<Self>> {
        match d {
            32 => Some(FaFns {
                fwd: emu_fa_fwd_f32_d32,
                delta: emu_fa_bwd_delta_f32_d32,
                dkv: emu_fa_bwd_dkv_f32_d32,
                dq: emu_fa_bwd_dq_f32_d32,
            }),
            48 => Some(FaFns {
                fwd: emu_fa_fwd_f32_d48,
                delta: emu_fa_bwd_delta_f32_d48,
                dkv: emu_fa_bwd_dkv_f32_d48,
                dq: emu_fa_bwd_dq_f32_d48,
            }),
            64 => Some(FaFns {
                fwd: emu_fa_fwd_f32_d64,
                delta: emu_fa_bwd_delta_f32_d64,
                dkv: emu_fa_bwd_dkv_f32_d64,
                dq: emu_fa_bwd_dq_f32_d64,
            }),
            96 => Some(FaFns {
                fwd: emu_fa_fwd_f32_d96,
                delta: emu_fa_bwd_delta_f32_d96,
                dkv: emu_fa_bwd_dkv_f32_d96,
                dq: emu_fa_bwd_dq_f32_d96,
            }),
            128 => Some(FaFns {
                fwd: emu_fa_fwd_f32_d128,
                delta: emu_fa_bwd_delta_f32_d128,
                dkv: emu_fa_bwd_dkv_f32_d128,
                dq: emu_fa_bwd_dq_f32_d128,
            }),
            _ => None,
        }
    }
}

impl Dt for bf16 {
    const NAME: &'static str = "bf16";
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    const GELU_FWD: GeluFwd<Self> = emu_gelu_fwd_bf16;
    const GELU_BWD: GeluBwd<Self> = emu_gelu_bwd_bf16;
    const EMB_BWD: EmbBwd<Self> = emu_embedding_bwd_bf16;
    const ADD_ROWS: AddRows<Self> = emu_add_rows_bf16_bf16;
    const COL_SUM_PARTIAL: ColSumPartial<Self> = emu_col_sum_partial_bf16;
    const COL_SUM_FINAL: ColSumFinal<Self> = emu_col_sum_final_bf16;
    const NORM_FWD: NormFwd<Self> = emu_norm_fwd_bf16;
    const NORM_BWD_DX: NormBwdDx<Self> = emu_norm_bwd_dx_bf16;
    const NORM_BWD_PARTIAL: NormBwdPartial<Self> = emu_norm_bwd_partial_bf16;
    const NORM_BWD_FINAL: NormBwdFinal<Self> = emu_norm_bwd_final_bf16;
    const SOFTMAX_FWD: SoftmaxFwd<Self> = emu_softmax_fwd_bf16;
    const SOFTMAX_BWD: SoftmaxBwd<Self> = emu_softmax_bwd_bf16;
    fn fa(d: usize) -> Option<FaFns<Self>> {
        match d {
            32 => Some(FaFns {
                fwd: emu_fa_fwd_bf16_d32,
                delta: emu_fa_bwd_delta_bf16_d32,
                dkv: emu_fa_bwd_dkv_bf16_d32,
                dq: emu_fa_bwd_dq_bf16_d32,
            }),
            48 => Some(FaFns {
                fwd: emu_fa_fwd_bf16_d48,
                delta: emu_fa_bwd_delta_bf16_d48,
                dkv: emu_fa_bwd_dkv_bf16_d48,
                dq: emu_fa_bwd_dq_bf16_d48,
            }),
            64 => Some(FaFns {
                fwd: emu_fa_fwd_bf16_d64,
                delta: emu_fa_bwd_delta_bf16_d64,
                dkv: emu_fa_bwd_dkv_bf16_d64,
                dq: emu_fa_bwd_dq_bf16_d64,
            }),
            96 => Some(FaFns {
                fwd: emu_fa_fwd_bf16_d96,
                delta: emu_fa_bwd_delta_bf16_d96,
                dkv: emu_fa_bwd_dkv_bf16_d96,
                dq: emu_fa_bwd_dq_bf16_d96,
            }),
            128 => Some(FaFns {
                fwd: emu_fa_fwd_bf16_d128,
                delta: emu_fa_bwd_delta_bf16_d128,
                dkv: emu_fa_bwd_dkv_bf16_d128,
                dq: emu_fa_bwd_dq_bf16_d128,
            }),
            _ => None,
        }
    }

    fn fa_tc(d: usize) -> Option<FaFns<Self>> {
        // Delta is the SIMT kernel's (a row sum: no product to speed up).
        let delta = Self::fa(d)?.delta;
        Some(match d {
            32 => FaFns {
                fwd: emu_fa_fwd_tc_bf16_d32,
                delta,
                dkv: emu_fa_bwd_dkv_tc_bf16_d32,
                dq: emu_fa_bwd_dq_tc_bf16_d32,
            },
            48 => FaFns {
                fwd: emu_fa_fwd_tc_bf16_d48,
                delta,
                dkv: emu_fa_bwd_dkv_tc_bf16_d48,
                dq: emu_fa_bwd_dq_tc_bf16_d48,
            },
            64 => FaFns {
                fwd: emu_fa_fwd_tc_bf16_d64,
                delta,
                dkv: emu_fa_bwd_dkv_tc_bf16_d64,
                dq: emu_fa_bwd_dq_tc_bf16_d64,
            },
            96 => FaFns {
                fwd: emu_fa_fwd_tc_bf16_d96,
                delta,
                dkv: emu_fa_bwd_dkv_tc_bf16_d96,
                dq: emu_fa_bwd_dq_tc_bf16_d96,
            },
            128 => FaFns {
                fwd: emu_fa_fwd_tc_bf16_d128,
                delta,
                dkv: emu_fa_bwd_dkv_tc_bf16_d128,
                dq: emu_fa_bwd_dq_tc_bf16_d128,
            },
            _ => return None,
        })
    }
}

macro_rules! index_impl {
    ($t:ty, $i:ty, $fwd:ident, $bwd:ident) => {
        impl Index<$t> for $i {
            const XENT_FWD: XentFwd<$t, Self> = $fwd;
            const XENT_BWD: XentBwd<$t, Self> = $bwd;
        }
    };
}
index_impl!(f32, u32, emu_xent_fwd_f32_u32, emu_xent_bwd_f32_u32);
index_impl!(f32, i64, emu_xent_fwd_f32_i64, emu_xent_bwd_f32_i64);
index_impl!(bf16, u32, emu_xent_fwd_bf16_u32, emu_xent_bwd_bf16_u32);
index_impl!(bf16, i64, emu_xent_fwd_bf16_i64, emu_xent_bwd_bf16_i64);

fn args(kernel: &str, what: String) -> EmuError {
    EmuError::Args {
        kernel: kernel.into(),
        what,
    }
}

fn int(kernel: &str, name: &str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| args(kernel, format!("{name} = {v} beyond a C int")))
}

fn ll(kernel: &str, name: &str, v: usize) -> Result<Ll> {
    Ll::try_from(v).map_err(|_| args(kernel, format!("{name} = {v} beyond a C long long")))
}

/// The row kernels index with `threadIdx.x`, `blockIdx.x` and `gridDim.x` only, and stride
/// over rows and columns: any 1-D launch stays inside `rows x n`. Their shared arrays hold 32
/// warps, which `blockDim.x <= 1024` (the emulator's limit) keeps in bounds.
fn one_d(kernel: &str, launch: &Launch) -> Result<()> {
    if launch.grid.1 != 1 || launch.grid.2 != 1 || launch.block.1 != 1 || launch.block.2 != 1 {
        return Err(args(kernel, format!("a 1-D launch, not {launch:?}")));
    }
    Ok(())
}

/// `y = gelu(x)` elementwise (grid-stride: any 1-D launch covers `x.len()` elements).
pub fn gelu_fwd<T: Dt>(launch: &Launch, order: Order, x: &Buf<T>, y: &mut Buf<T>) -> Result<()> {
    let k = "gelu_fwd";
    one_d(k, launch)?;
    need_elems(k, y.len(), x.len())?;
    let len = ll(k, "len", x.len())?;
    // SAFETY: the kernel reads x[i] and writes y[i] for i < len = x.len() <= y.len() only.
    run(launch, order, |l, e, el| unsafe {
        T::GELU_FWD((l, e, el), x.ptr(), y.mut_ptr(), len)
    })?;
    y.check(k)
}

/// `dx = g * gelu'(x)` elementwise.
pub fn gelu_bwd<T: Dt>(
    launch: &Launch,
    order: Order,
    x: &Buf<T>,
    g: &Buf<T>,
    dx: &mut Buf<T>,
) -> Result<()> {
    let k = "gelu_bwd";
    one_d(k, launch)?;
    need_elems(k, g.len(), x.len())?;
    need_elems(k, dx.len(), x.len())?;
    let len = ll(k, "len", x.len())?;
    // SAFETY: reads x[i], g[i], writes dx[i] for i < len, within all three (checked).
    run(launch, order, |l, e, el| unsafe {
        T::GELU_BWD((l, e, el), x.ptr(), g.ptr(), dx.mut_ptr(), len)
    })?;
    dx.check(k)
}

/// Threads a block of the embedding backward (`EMB_THREADS` of the kernel; the CUDA op's
/// launch, checked equal by the tests).
pub const EMB_THREADS: u32 = 256;

/// The embedding lookup's backward: `dtable[v] += sum of g[j] over the positions j with
/// ids[j] == v` (in position order), for `ids` of `n` positions, `g` `[n, d]` and `dtable`
/// `[vocab, d]`; an id >= vocab is skipped. Launched as the CUDA op launches it: a block of
/// [`EMB_THREADS`] per position.
pub fn embedding_bwd<T: Dt>(
    order: Order,
    ids: &Buf<u32>,
    g: &Buf<T>,
    dtable: &mut Buf<T>,
    d: usize,
    vocab: usize,
) -> Result<()> {
    let k = "embedding_bwd";
    let n = ids.len();
    need_elems(k, g.len(), n * d)?;
    need_elems(k, dtable.len(), vocab * d)?;
    let int = |what: &str, v: usize| {
        c_int::try_from(v).map_err(|_| args(k, format!("{what} {v} beyond a C int")))
    };
    let (nc, dc, vc) = (int("positions", n)?, int("dim", d)?, int("vocab", vocab)?);
    if n == 0 {
        return Ok(());
    }
    let launch = Launch {
        grid: (
            u32::try_from(n).map_err(|_| args(k, format!("{n} positions")))?,
            1,
            1,
        ),
        block: (EMB_THREADS, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: block j reads ids[0..n) and, for positions i holding its id, g[i d .. (i + 1) d);
    // it writes dtable[id d .. (id + 1) d) for an id < vocab only: in bounds (checked).
    run(&launch, order, |l, e, el| unsafe {
        T::EMB_BWD((l, e, el), ids.ptr(), nc, g.ptr(), dtable.mut_ptr(), dc, vc)
    })?;
    dtable.check(k)
}

/// The checks of a 1-D elementwise launch over `y_len` elements viewed as rows of `n` with a
/// bias of `b_len` elements (when given): the kernel's `(n, len)` arguments.
fn rows_args(
    k: &str,
    launch: &Launch,
    y_len: usize,
    b_len: Option<usize>,
    n: usize,
) -> Result<(c_int, Ll)> {
    one_d(k, launch)?;
    if let Some(b_len) = b_len {
        need_elems(k, b_len, n)?;
    }
    if n == 0 || y_len % n != 0 {
        return Err(args(k, format!("{y_len} elements are not rows of {n}")));
    }
    let nc = c_int::try_from(n).map_err(|_| args(k, format!("{n} columns")))?;
    Ok((nc, ll(k, "len", y_len)?))
}

/// `out[i] = f32(y[i]) + b[i % n]` (no bias: `b` `None`) for a bf16 `y` of rows of `n`
/// (`cuda/cast.cu`: a mixed-precision linear's output in one pass), any 1-D launch.
pub fn cast_add_rows(
    launch: &Launch,
    order: Order,
    y: &Buf<bf16>,
    b: Option<&Buf<f32>>,
    out: &mut Buf<f32>,
    n: usize,
) -> Result<()> {
    let k = "cast_add_rows";
    need_elems(k, out.len(), y.len())?;
    let (nc, len) = rows_args(k, launch, y.len(), b.map(Buf::len), n)?;
    let bp = b.map_or(std::ptr::null(), |b| b.ptr());
    // SAFETY: element i < len reads y[i] and (a bias given) b[i % n], writes out[i]: in bounds
    // (checked); a null b is never read.
    run(launch, order, |l, e, el| unsafe {
        emu_cast_add_rows_bf16_f32((l, e, el), y.ptr(), bp, out.mut_ptr(), len, nc)
    })?;
    out.check(k)
}

/// `y[i] += b[i % n]` in place (the sum in f32, rounded once to `T`) for `y` of rows of `n`
/// (`cuda/cast.cu`: a linear's bias added to its fresh product), any 1-D launch.
pub fn add_rows<T: Dt>(
    launch: &Launch,
    order: Order,
    y: &mut Buf<T>,
    b: &Buf<T>,
    n: usize,
) -> Result<()> {
    let (nc, len) = rows_args("add_rows", launch, y.len(), Some(b.len()), n)?;
    // SAFETY: element i < len reads and writes y[i] and reads b[i % n]: in bounds (checked).
    run(launch, order, |l, e, el| unsafe {
        T::ADD_ROWS((l, e, el), y.mut_ptr(), b.ptr(), len, nc)
    })?;
    y.check("add_rows")
}

/// [`add_rows`] of an f32 bias into a bf16 `y` (`cdt_add_rows_bf16_f32`: the f32 sum rounded
/// once to bf16).
pub fn add_rows_f32_bias(
    launch: &Launch,
    order: Order,
    y: &mut Buf<bf16>,
    b: &Buf<f32>,
    n: usize,
) -> Result<()> {
    let k = "add_rows_bf16_f32";
    let (nc, len) = rows_args(k, launch, y.len(), Some(b.len()), n)?;
    // SAFETY: element i < len reads and writes y[i] and reads b[i % n]: in bounds (checked).
    run(launch, order, |l, e, el| unsafe {
        emu_add_rows_bf16_f32((l, e, el), y.mut_ptr(), b.ptr(), len, nc)
    })?;
    y.check(k)
}

/// Threads a block and rows a partial of the column sum (`CS_THREADS`, `CS_ROWS` of
/// `cuda/reduce.cu`; the CUDA op's launch, checked equal by the tests).
pub const COL_SUM_THREADS: u32 = 256;
/// See [`COL_SUM_THREADS`].
pub const COL_SUM_ROWS: usize = 256;

/// Column sums `out[c] = sum over r of x[r, c]` of a `[rows, n]` matrix, by the two kernels
/// launched as the CUDA op launches them (partials of [`COL_SUM_ROWS`] rows, then their sum in
/// chunk order).
pub fn col_sum<T: Dt>(
    order: Order,
    x: &Buf<T>,
    out: &mut Buf<T>,
    rows: usize,
    n: usize,
) -> Result<()> {
    let k = "col_sum";
    need_elems(k, x.len(), rows * n)?;
    need_elems(k, out.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let chunks = rows.div_ceil(COL_SUM_ROWS).max(1);
    let nc = c_int::try_from(n).map_err(|_| args(k, format!("{n} columns")))?;
    let cc = c_int::try_from(chunks).map_err(|_| args(k, format!("{chunks} chunks")))?;
    let rl = ll(k, "rows", rows)?;
    let bx = u32::try_from(n.div_ceil(COL_SUM_THREADS as usize))
        .map_err(|_| args(k, format!("{n} columns")))?;
    let by = u32::try_from(chunks).map_err(|_| args(k, format!("{chunks} chunks")))?;
    let mut part = Buf::filled("part", chunks * n, f32::NAN);
    let partial = Launch {
        grid: (bx, by, 1),
        block: (COL_SUM_THREADS, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: block (bx, by) reads x[r n + c] for r < rows, c < n, and writes part[by n + c],
    // by < chunks: in bounds (checked above, part allocated for chunks n).
    run(&partial, order, |l, e, el| unsafe {
        T::COL_SUM_PARTIAL((l, e, el), x.ptr(), part.mut_ptr(), rl, nc)
    })?;
    part.check(k)?;
    let fin = Launch {
        grid: (bx, 1, 1),
        block: (COL_SUM_THREADS, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: thread c < n reads part[k n + c] for k < chunks and writes out[c]: in bounds.
    run(&fin, order, |l, e, el| unsafe {
        T::COL_SUM_FINAL((l, e, el), part.ptr(), out.mut_ptr(), cc, nc)
    })?;
    out.check(k)
}

/// The shape of a row kernel's data: `rows` rows of `n`.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    /// Rows.
    pub rows: usize,
    /// Row length.
    pub n: usize,
}

impl Rows {
    fn check(&self, k: &str) -> Result<(Ll, c_int)> {
        let total = self
            .rows
            .checked_mul(self.n)
            .ok_or_else(|| args(k, format!("{self:?} overflows")))?;
        ll(k, "rows * n", total)?;
        Ok((ll(k, "rows", self.rows)?, int(k, "n", self.n)?))
    }
}

/// Layer norm (`center`) or RMS norm of each row, times `w`, plus `b` when given.
#[allow(clippy::too_many_arguments)]
pub fn norm_fwd<T: Dt>(
    launch: &Launch,
    order: Order,
    x: &Buf<T>,
    w: &Buf<T>,
    b: Option<&Buf<T>>,
    y: &mut Buf<T>,
    shape: Rows,
    eps: f32,
    center: bool,
) -> Result<()> {
    let k = "norm_fwd";
    one_d(k, launch)?;
    let (rows, n) = shape.check(k)?;
    let total = shape.rows * shape.n;
    need_elems(k, x.len(), total)?;
    need_elems(k, y.len(), total)?;
    need_elems(k, w.len(), shape.n)?;
    if let Some(b) = b {
        need_elems(k, b.len(), shape.n)?;
    }
    let bp = b.map_or(std::ptr::null(), |b| b.ptr());
    // SAFETY: row r < rows reads x and writes y at [r n, (r + 1) n), and w[j], b[j] for j < n,
    // all in bounds (checked); b may be null (the kernel tests it).
    run(launch, order, |l, e, el| unsafe {
        T::NORM_FWD(
            (l, e, el),
            x.ptr(),
            w.ptr(),
            bp,
            y.mut_ptr(),
            rows,
            n,
            eps,
            c_int::from(center),
        )
    })?;
    y.check(k)
}

/// The gradients of [`norm_fwd`]: `dx`, and `dw` / `db` (in `wb = [dw; db]`, `2 n`), through
/// the three kernels in the order the CUDA op runs them: dx and per-row statistics, then
/// per-chunk column partials (block `(32, 8)`, `chunks` chunks of rows), then their ordered sum.
#[allow(clippy::too_many_arguments)]
pub fn norm_bwd<T: Dt>(
    launches: [&Launch; 3],
    order: Order,
    x: &Buf<T>,
    w: &Buf<T>,
    g: &Buf<T>,
    dx: &mut Buf<T>,
    wb: &mut Buf<T>,
    shape: Rows,
    eps: f32,
    center: bool,
) -> Result<()> {
    let k = "norm_bwd";
    let (rows, n) = shape.check(k)?;
    let total = shape.rows * shape.n;
    need_elems(k, x.len(), total)?;
    need_elems(k, g.len(), total)?;
    need_elems(k, dx.len(), total)?;
    need_elems(k, w.len(), shape.n)?;
    need_elems(k, wb.len(), 2 * shape.n)?;
    let mut stats = Buf::filled("stats", 2 * shape.rows, f32::NAN);
    one_d("norm_bwd_dx", launches[0])?;
    // SAFETY: row r reads x, g at [r n, (r + 1) n), w[j < n], writes dx there and stats[2r],
    // stats[2r + 1]: in bounds (checked; stats has 2 rows elements).
    run(launches[0], order, |l, e, el| unsafe {
        T::NORM_BWD_DX(
            (l, e, el),
            x.ptr(),
            w.ptr(),
            g.ptr(),
            dx.mut_ptr(),
            stats.mut_ptr(),
            rows,
            n,
            eps,
            c_int::from(center),
        )
    })?;
    dx.check("norm_bwd_dx")?;
    stats.check("norm_bwd_dx")?;

    // The partials: block (32, 8) (the kernel's shared tiles are [8][33]: another block shape
    // would index past them), grid (ceil(n / 32), chunks).
    let p = launches[1];
    if p.block != (32, 8, 1) || p.grid.2 != 1 || (p.grid.0 as usize) * 32 < shape.n {
        return Err(args(
            "norm_bwd_partial",
            format!("block (32, 8, 1) and grid (>= ceil(n / 32), chunks, 1), not {p:?}"),
        ));
    }
    let chunks = p.grid.1 as usize;
    let per_chunk = shape.rows.div_ceil(chunks.max(1));
    let mut part = Buf::filled("part", chunks * 2 * shape.n, f32::NAN);
    let pc = ll(k, "per_chunk", per_chunk)?;
    // SAFETY: block (cx, c) reads rows [c per_chunk, min(rows, (c + 1) per_chunk)) of x, g
    // and stats at columns col = 32 cx + tx < n, and writes part[c 2n + col], part[c 2n + n +
    // col]: c < chunks, so within chunks 2 n (checked by construction); the block is (32, 8).
    run(p, order, |l, e, el| unsafe {
        T::NORM_BWD_PARTIAL(
            (l, e, el),
            x.ptr(),
            g.ptr(),
            stats.ptr(),
            part.mut_ptr(),
            rows,
            n,
            pc,
        )
    })?;
    part.check("norm_bwd_partial")?;

    one_d("norm_bwd_final", launches[2])?;
    let ch = int(k, "chunks", chunks)?;
    // SAFETY: reads part[k 2n + col], part[k 2n + n + col] for k < chunks, col < n; writes
    // wb[col], wb[n + col]: in bounds (part built above, wb checked).
    run(launches[2], order, |l, e, el| unsafe {
        T::NORM_BWD_FINAL((l, e, el), part.ptr(), wb.mut_ptr(), ch, n)
    })?;
    wb.check("norm_bwd_final")
}

/// Softmax of `scale * x` per row (rows of shape `[.., t, n]` and a causal mask when
/// `causal`), or log-softmax (`log`).
#[allow(clippy::too_many_arguments)]
pub fn softmax_fwd<T: Dt>(
    launch: &Launch,
    order: Order,
    x: &Buf<T>,
    y: &mut Buf<T>,
    shape: Rows,
    t: usize,
    scale: f32,
    causal: bool,
    log: bool,
) -> Result<()> {
    let k = "softmax_fwd";
    one_d(k, launch)?;
    let (rows, n) = shape.check(k)?;
    need_elems(k, x.len(), shape.rows * shape.n)?;
    need_elems(k, y.len(), shape.rows * shape.n)?;
    if causal && t == 0 {
        // The kernel takes `row % t`.
        return Err(args(k, "a causal softmax with t = 0".into()));
    }
    let tl = ll(k, "t", t)?;
    // SAFETY: row r reads x and writes y at [r n, (r + 1) n) only; t > 0 when causal.
    run(launch, order, |l, e, el| unsafe {
        T::SOFTMAX_FWD(
            (l, e, el),
            x.ptr(),
            y.mut_ptr(),
            rows,
            n,
            tl,
            scale,
            c_int::from(causal),
            c_int::from(log),
        )
    })?;
    y.check(k)
}

/// The gradient of [`softmax_fwd`] from its output `y` and the output's gradient `g`.
#[allow(clippy::too_many_arguments)]
pub fn softmax_bwd<T: Dt>(
    launch: &Launch,
    order: Order,
    y: &Buf<T>,
    g: &Buf<T>,
    dx: &mut Buf<T>,
    shape: Rows,
    scale: f32,
    log: bool,
) -> Result<()> {
    let k = "softmax_bwd";
    one_d(k, launch)?;
    let (rows, n) = shape.check(k)?;
    for len in [y.len(), g.len(), dx.len()] {
        need_elems(k, len, shape.rows * shape.n)?;
    }
    // SAFETY: row r reads y, g and writes dx at [r n, (r + 1) n) only (checked).
    run(launch, order, |l, e, el| unsafe {
        T::SOFTMAX_BWD(
            (l, e, el),
            y.ptr(),
            g.ptr(),
            dx.mut_ptr(),
            rows,
            n,
            scale,
            c_int::from(log),
        )
    })?;
    dx.check(k)
}

/// Softmax cross-entropy per row: `out[2r] = loss`, `out[2r + 1] = logsumexp`.
pub fn xent_fwd<T: Dt, I: Index<T>>(
    launch: &Launch,
    order: Order,
    x: &Buf<T>,
    tgt: &Buf<I>,
    out: &mut Buf<f32>,
    shape: Rows,
    ignore: Option<i64>,
) -> Result<()> {
    let k = "xent_fwd";
    one_d(k, launch)?;
    let (rows, n) = shape.check(k)?;
    need_elems(k, x.len(), shape.rows * shape.n)?;
    need_elems(k, tgt.len(), shape.rows)?;
    need_elems(k, out.len(), 2 * shape.rows)?;
    let (ig, has) = (ignore.unwrap_or(0), c_int::from(ignore.is_some()));
    // SAFETY: row r reads x at [r n, (r + 1) n), tgt[r], and x[r n + c] only for a class
    // 0 <= c < n; writes out[2r], out[2r + 1]: in bounds (checked).
    run(launch, order, |l, e, el| unsafe {
        I::XENT_FWD(
            (l, e, el),
            x.ptr(),
            tgt.ptr(),
            out.mut_ptr(),
            rows,
            n,
            ig,
            has,
        )
    })?;
    out.check(k)
}

/// The cross-entropy's gradient written into `dx`, from `lg[2r] = logsumexp`,
/// `lg[2r + 1] = the row's upstream gradient`.
#[allow(clippy::too_many_arguments)]
pub fn xent_bwd<T: Dt, I: Index<T>>(
    launch: &Launch,
    order: Order,
    x: &Buf<T>,
    tgt: &Buf<I>,
    lg: &Buf<f32>,
    dx: &mut Buf<T>,
    shape: Rows,
    ignore: Option<i64>,
) -> Result<()> {
    let k = "xent_bwd";
    one_d(k, launch)?;
    let (rows, n) = shape.check(k)?;
    need_elems(k, x.len(), shape.rows * shape.n)?;
    need_elems(k, dx.len(), shape.rows * shape.n)?;
    need_elems(k, tgt.len(), shape.rows)?;
    need_elems(k, lg.len(), 2 * shape.rows)?;
    let (ig, has) = (ignore.unwrap_or(0), c_int::from(ignore.is_some()));
    // SAFETY: row r reads x at [r n, (r + 1) n), tgt[r], lg[2r], lg[2r + 1] and writes dx at
    // [r n, (r + 1) n): in bounds (checked).
    run(launch, order, |l, e, el| unsafe {
        I::XENT_BWD(
            (l, e, el),
            x.ptr(),
            tgt.ptr(),
            lg.ptr(),
            dx.mut_ptr(),
            rows,
            n,
            ig,
            has,
        )
    })?;
    dx.check(k)
}

/// The shape of an attention: `bh` heads (batch times heads), `tq` queries and `tk` keys of
/// head dim `d`, tensors `[bh, t, d]` contiguous.
#[derive(Debug, Clone, Copy)]
pub struct Attn {
    /// Batch times heads.
    pub bh: usize,
    /// Queries per head.
    pub tq: usize,
    /// Keys per head.
    pub tk: usize,
    /// Head dim.
    pub d: usize,
}

/// Query or key rows per block, and threads per block, of the flash-attention kernels.
pub const FA_ROWS: usize = 32;
const FA_THREADS: u32 = 128;

/// Which flash-attention kernels run: the SIMT ones (f32 and bf16) or the tensor-core ones
/// (bf16 only), each with the launch the CUDA op gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaKernels {
    /// `cdt_fa_*_{f32,bf16}_d*`: grid `(ceil(rows / 32), bh)` of 128 threads.
    Simt,
    /// `cdt_fa_*_tc_bf16_d*` (delta from the SIMT kernel): grid `(ceil(rows / (16 w)), bh)` of
    /// `32 w` threads, `w` = [`FA_TC_FWD_WARPS`] for the forward, [`FA_TC_BWD_WARPS`] for the
    /// backward kernels.
    TensorCores,
}

impl FaKernels {
    /// The launch over `rows` (queries, or keys for dK/dV) of `bh` heads; `tc_warps` the
    /// tensor-core kernel's warps a block.
    fn launch(self, k: &str, rows: usize, bh: u32, tc_warps: usize) -> Result<Launch> {
        let (per_block, threads) = match self {
            FaKernels::Simt => (FA_ROWS, FA_THREADS),
            FaKernels::TensorCores => (16 * tc_warps, 32 * tc_warps as u32),
        };
        let blocks = u32::try_from(rows.div_ceil(per_block).max(1))
            .map_err(|_| args(k, format!("{rows} rows need too many blocks")))?;
        Ok(Launch {
            grid: (blocks, bh, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        })
    }
}

impl Attn {
    fn check<T: Dt>(&self, k: &str, kernels: FaKernels) -> Result<(FaFns<T>, c_int, c_int, u32)> {
        if kernels == FaKernels::TensorCores && T::NAME != "bf16" {
            return Err(args(
                k,
                format!("the tensor-core kernels take bf16, not {}", T::NAME),
            ));
        }
        let fns = match kernels {
            FaKernels::Simt => T::fa(self.d),
            FaKernels::TensorCores => T::fa_tc(self.d),
        }
        .ok_or_else(|| {
            args(
                k,
                format!("head dim {} is not one of {FA_HEAD_DIMS:?}", self.d),
            )
        })?;
        let tq = int(k, "tq", self.tq)?;
        let tk = int(k, "tk", self.tk)?;
        let bh = u32::try_from(self.bh)
            .ok()
            .filter(|&b| (1..=65535).contains(&b))
            .ok_or_else(|| args(k, format!("bh = {} outside the grid's 1..=65535", self.bh)))?;
        for (name, n) in [("q", self.tq), ("k", self.tk)] {
            self.bh
                .checked_mul(n)
                .and_then(|v| v.checked_mul(self.d))
                .and_then(|v| Ll::try_from(v).ok())
                .ok_or_else(|| args(k, format!("{name} of {self:?} overflows")))?;
        }
        Ok((fns, tq, tk, bh))
    }
}

/// Flash-attention forward: `o = softmax(scale q k^T [causal]) v` and `lse` per query, on
/// `kernels` with the launch the CUDA op gives them; every operand a contiguous
/// `[bh, t, d]` ([`flash_attn_fwd_rows`] with [`FaRows::contiguous`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_fwd<T: Dt>(
    order: Order,
    kernels: FaKernels,
    q: &Buf<T>,
    k: &Buf<T>,
    v: &Buf<T>,
    o: &mut Buf<T>,
    lse: &mut Buf<f32>,
    shape: Attn,
    scale: f32,
    causal: bool,
) -> Result<()> {
    let (lq, lk) = (
        FaRows::contiguous(shape.tq, shape.d),
        FaRows::contiguous(shape.tk, shape.d),
    );
    flash_attn_fwd_rows(
        order,
        kernels,
        (q, k, v),
        o,
        lse,
        [lq, lk, lk, lq],
        shape,
        scale,
        causal,
    )
}

/// [`flash_attn_fwd`] with each operand placed by its [`FaRows`] (`rows`: q, k, v, o), so q,
/// k and v may be views of one buffer (a packed projection). Every row must lie in its buffer.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_fwd_rows<T: Dt>(
    order: Order,
    kernels: FaKernels,
    (q, k, v): (&Buf<T>, &Buf<T>, &Buf<T>),
    o: &mut Buf<T>,
    lse: &mut Buf<f32>,
    rows: [FaRows; 4],
    shape: Attn,
    scale: f32,
    causal: bool,
) -> Result<()> {
    let kn = "flash_attn_fwd";
    let (fns, tq, tk, bh) = shape.check::<T>(kn, kernels)?;
    check_fwd(
        &rows,
        (shape.bh, shape.tq, shape.tk, shape.d),
        [q.len(), k.len(), v.len(), o.len()],
    )
    .map_err(|e| args(kn, e))?;
    need_elems(kn, lse.len(), shape.bh * shape.tq)?;
    let launch = kernels.launch(kn, shape.tq, bh, FA_TC_FWD_WARPS)?;
    // SAFETY: the launch is the one `kernels`' forward indexes by (`FaKernels::launch`, the
    // kernel `check` picked for `kernels`): block (x, h) reads q and writes o at its query rows
    // within [0, tq) of head h < bh, reads k and v rows [0, tk) of head h and writes
    // lse[h tq + i] for its rows i < tq; every row of every head lies in its buffer
    // (`check_in`), o's rows do not overlap (`check_disjoint`), and `rows` outlives the call.
    run(&launch, order, |l, e, el| unsafe {
        (fns.fwd)(
            (l, e, el),
            q.ptr(),
            k.ptr(),
            v.ptr(),
            o.mut_ptr(),
            lse.mut_ptr(),
            rows.as_ptr(),
            tq,
            tk,
            scale,
            c_int::from(causal),
        )
    })?;
    o.check(kn)?;
    lse.check(kn)
}

/// Warps per block of the tensor-core forward (`FA_TC_FWD_WARPS` of the kernels), every head
/// dim; each warp 16 queries.
pub const FA_TC_FWD_WARPS: usize = 8;

/// Warps per block of the tensor-core backward kernels (`FA_TC_BWD_WARPS`), every head dim;
/// each warp 16 rows.
pub const FA_TC_BWD_WARPS: usize = 4;

/// Flash-attention backward on `kernels`: `dq`, `dk`, `dv` from the forward's `o` and `lse`
/// and the output's gradient `d_o` (three kernels: delta, dK/dV per key block, dQ per query
/// block), with the launches the CUDA op gives them; every operand a contiguous `[bh, t, d]`.
/// dK and dV are written into one buffer (as the CUDA op writes them) and copied out.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd<T: Dt>(
    order: Order,
    kernels: FaKernels,
    q: &Buf<T>,
    k: &Buf<T>,
    v: &Buf<T>,
    o: &Buf<T>,
    lse: &Buf<f32>,
    d_o: &Buf<T>,
    dq: &mut Buf<T>,
    dk: &mut Buf<T>,
    dv: &mut Buf<T>,
    shape: Attn,
    scale: f32,
    causal: bool,
) -> Result<()> {
    let kn = "flash_attn_bwd";
    let nk = shape.bh * shape.tk * shape.d;
    need_elems(kn, dk.len(), nk)?;
    need_elems(kn, dv.len(), nk)?;
    let mut dkv = Buf::filled("dkv", 2 * nk, T::GUARD);
    flash_attn_bwd_rows(
        order,
        kernels,
        (q, k, v, o, lse, d_o),
        dq,
        Some(&mut dkv),
        FaBwdRows::contiguous(shape.bh, shape.tq, shape.tk, shape.d),
        shape,
        scale,
        causal,
    )?;
    let (dks, dvs) = dkv.as_slice().split_at(nk);
    // `out` holds at least nk elements (checked above).
    dk.as_mut_slice()[..nk].copy_from_slice(dks);
    dv.as_mut_slice()[..nk].copy_from_slice(dvs);
    Ok(())
}

/// The inputs of [`flash_attn_bwd_rows`]: q, k, v, the forward's o and lse, the output's
/// gradient.
pub type FaBwdInputs<'a, T> = (
    &'a Buf<T>,
    &'a Buf<T>,
    &'a Buf<T>,
    &'a Buf<T>,
    &'a Buf<f32>,
    &'a Buf<T>,
);

/// [`flash_attn_bwd`] with each operand placed by its [`FaRows`]: the inputs may be views of
/// one buffer, and dK, dV are written into `dkv`, or, when it is `None`, into `dq`'s buffer
/// beside dQ (the packed gradient of a packed projection). Every row must lie in its buffer
/// and the written rows must not overlap.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd_rows<T: Dt>(
    order: Order,
    kernels: FaKernels,
    (q, k, v, o, lse, d_o): FaBwdInputs<'_, T>,
    dq: &mut Buf<T>,
    mut dkv: Option<&mut Buf<T>>,
    rows: FaBwdRows,
    shape: Attn,
    scale: f32,
    causal: bool,
) -> Result<()> {
    let kn = "flash_attn_bwd";
    let (fns, tq, tk, bh) = shape.check::<T>(kn, kernels)?;
    check_bwd(
        &rows,
        (shape.bh, shape.tq, shape.tk, shape.d),
        [q.len(), k.len(), v.len(), o.len(), d_o.len(), dq.len()],
        dkv.as_ref().map(|b| b.len()),
    )
    .map_err(|e| args(kn, e))?;
    let rows_n = shape.bh * shape.tq;
    need_elems(kn, lse.len(), rows_n)?;
    let mut delta = Buf::filled("delta", rows_n, f32::NAN);
    let rows_ll = ll(kn, "rows", rows_n)?;
    let (od, dq_r) = (
        [rows.o, rows.d_o],
        [rows.q, rows.k, rows.v, rows.d_o, rows.dq],
    );
    let dkv_r = [rows.q, rows.k, rows.v, rows.d_o, rows.dk, rows.dv];
    // SAFETY: grid-stride over rows < bh tq: reads o's and d_o's row (in bounds: `check_in`),
    // writes delta[row] (sized rows).
    run(&Launch::linear(4, 64, 0), order, |l, e, el| unsafe {
        (fns.delta)(
            (l, e, el),
            o.ptr(),
            d_o.ptr(),
            delta.mut_ptr(),
            od.as_ptr(),
            rows_ll,
            tq,
        )
    })?;
    delta.check("flash_attn_bwd_delta")?;
    let c = c_int::from(causal);
    let launch = kernels.launch(kn, shape.tk, bh, FA_TC_BWD_WARPS)?;
    let dkv_ptr = match dkv.as_mut() {
        Some(b) => b.mut_ptr(),
        None => dq.mut_ptr(),
    };
    // SAFETY: the launch the dK/dV kernel `check` picked for `kernels` indexes by: block
    // (x, h) reads k, v and writes dk, dv at its key rows within [0, tk) of head h < bh, reads
    // q, d_o rows [0, tq) and lse, delta [h tq, (h + 1) tq): every row in its buffer
    // (`check_in`), the written rows apart (`check_disjoint`, with dQ's when they share a
    // buffer, which this launch does not write).
    run(&launch, order, |l, e, el| unsafe {
        (fns.dkv)(
            (l, e, el),
            q.ptr(),
            k.ptr(),
            v.ptr(),
            d_o.ptr(),
            lse.ptr(),
            delta.ptr(),
            dkv_ptr,
            dkv_r.as_ptr(),
            tq,
            tk,
            scale,
            c,
        )
    })?;
    if let Some(b) = dkv.as_ref() {
        b.check("flash_attn_bwd_dkv")?;
    }
    let launch = kernels.launch(kn, shape.tq, bh, FA_TC_BWD_WARPS)?;
    // SAFETY: likewise for dQ: block (x, h) reads q, d_o, lse, delta at its query rows within
    // [0, tq) of head h < bh, k and v rows [0, tk), writes dq at its query rows: in bounds,
    // apart from dK's and dV's.
    run(&launch, order, |l, e, el| unsafe {
        (fns.dq)(
            (l, e, el),
            q.ptr(),
            k.ptr(),
            v.ptr(),
            d_o.ptr(),
            lse.ptr(),
            delta.ptr(),
            dq.mut_ptr(),
            dq_r.as_ptr(),
            tq,
            tk,
            scale,
            c,
        )
    })?;
    dq.check("flash_attn_bwd_dq")
}
