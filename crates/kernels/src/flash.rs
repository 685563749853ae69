//! Attention that never materialises the `[T, T]` scores: the flash-attention CUDA kernels
//! (`cuda/flash_attn.cu`, SIMT, f32 accumulation, f32 or bf16 operands, a deterministic
//! backward without atomics) as one graph node with a hand-written backward. In bf16 the
//! forward and the backward's products run on tensor cores (warp matrix products,
//! `cdt_fa_*_tc_bf16_d*`) unless `CDT_FLASH_TC=0`.
//!
//! [`applies`] says where: CUDA tensors (feature `cuda`) of f32 or bf16, head dims in
//! [`HEAD_DIMS`], at most 65,535 heads (batch times heads) per call, unless `CDT_FLASH_ATTN=0`
//! switches it off (then `autodiff::sdpa_local` takes candle's matmuls around the fused
//! softmax). The kernels' logic is tested on the CPU under the CUDA emulator
//! (`crates/kernels-emu/tests/flash_attn.rs`); on a GPU, `crates/kernels/tests/cuda_fused.rs`
//! compares this node with the CPU reference, forward and backward.
//!
//! Memory: the forward keeps `o` and `lse` (`[B, H, T]` f32) for the backward, which
//! recomputes the probabilities tile by tile; nothing of size `T x T` exists at any point.

use candle_core::Tensor;

type CResult<T> = candle_core::Result<T>;

/// The head dims the kernels are built for (one template instance each).
pub const HEAD_DIMS: [usize; 5] = [32, 48, 64, 96, 128];

/// Warps per block of the tensor-core attention forward (`FA_TC_FWD_WARPS` of
/// `cuda/flash_attn.cu`), every head dim; each warp owns 16 queries. The CUDA op launches by
/// it; the emulator's tests check it against the launches they run the kernels under.
pub const TENSOR_CORE_FWD_WARPS: usize = 8;

/// Warps per block of the tensor-core attention backward kernels (`FA_TC_BWD_WARPS`), dK/dV
/// and dQ, every head dim; each warp owns 16 rows (keys for dK/dV, queries for dQ).
pub const TENSOR_CORE_BWD_WARPS: usize = 4;

/// Whether [`attention`] runs `q [.., tq, d]`, `k`, `v` `[.., tk, d]`: CUDA (feature `cuda`),
/// f32 or bf16 alike, a head dim of [`HEAD_DIMS`], equal leading dims whose product is at most
/// 65,535, lengths below 2^31, and `CDT_FLASH_ATTN` not `0`.
pub fn applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let (qd, kd) = (q.dims(), k.dims());
    let r = qd.len();
    k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
        && r >= 2
        && kd.len() == r
        && v.dims() == kd
        && qd[..r - 2] == kd[..r - 2]
        && qd[r - 1] == kd[r - 1]
        && applies_to(
            q,
            qd[..r - 2].iter().product(),
            qd[r - 2],
            kd[r - 2],
            qd[r - 1],
        )
}

/// Whether [`packed_attention_flat`] runs `qkv [B, T, 3 heads d]` on the flash kernels: as
/// [`applies`] for its `B heads` heads of `T` queries and keys of dim `d`.
pub fn applies_flat(qkv: &Tensor, heads: usize) -> bool {
    match qkv.dims() {
        &[b, t, w] if heads > 0 && w % (3 * heads) == 0 => {
            applies_to(qkv, b * heads, t, t, w / (3 * heads))
        }
        _ => false,
    }
}

/// [`applies`] for `bh` heads of `tq` queries and `tk` keys of dim `d`, of `x`'s device and
/// dtype.
fn applies_to(x: &Tensor, bh: usize, tq: usize, tk: usize, d: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        if !(enabled() && x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16)) {
            return false;
        }
        let fits = HEAD_DIMS.contains(&d)
            && bh <= crate::cuda::FA_MAX_HEADS
            && tq <= crate::cuda::MAX_INDEX
            && tk <= crate::cuda::MAX_INDEX;
        if !fits {
            // The composition then materialises [bh, tq, tk] scores: say so once, since it is
            // a memory and speed cliff a user would otherwise only see in the profile.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    bh,
                    tq,
                    tk,
                    d,
                    head_dims = ?HEAD_DIMS,
                    max_heads = crate::cuda::FA_MAX_HEADS,
                    "CUDA attention outside the flash kernels' shapes: it falls back to \
                     matmul-softmax-matmul with [T, T] scores (said once a process)"
                );
            });
        }
        fits
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, bh, tq, tk, d);
        false
    }
}

/// Whether the flash path is on (`CDT_FLASH_ATTN` unset or anything but `0`).
#[cfg(feature = "cuda")]
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CDT_FLASH_ATTN").map_or(true, |v| v.trim() != "0"))
}

/// Whether bf16 attention (forward and backward) may run on tensor cores (`CDT_FLASH_TC` unset
/// or anything but `0`; `0` keeps the SIMT kernels, to compare the two).
#[cfg(feature = "cuda")]
pub(crate) fn tensor_cores_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CDT_FLASH_TC").map_or(true, |v| v.trim() != "0"))
}

/// Which kernels [`attention`] (and `autodiff::sdpa_local`, which takes it where it applies)
/// runs for these operands: `"tensor cores"` (bf16 on CUDA with the module built for sm_80 or
/// newer and `CDT_FLASH_TC` not `0`), `"simt"` (the other flash kernels) or `"composition"`
/// ([`applies`] is false: candle's matmuls around the fused softmax). For benchmarks and logs.
pub fn kernels_for(q: &Tensor, k: &Tensor, v: &Tensor) -> &'static str {
    if !applies(q, k, v) {
        return "composition";
    }
    #[cfg(feature = "cuda")]
    if q.dtype() == candle_core::DType::BF16 && crate::cuda::tensor_cores() {
        return "tensor cores";
    }
    "simt"
}

/// Attention on a packed projection `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` (contiguous), where
/// [`applies`] holds for its q, k and v (`[B, H, T, d]`), as one graph node over `qkv`. The
/// kernels read q, k and v where the projection holds them and write the output as
/// `[B, T, H, d]`; the backward reads the projection, the output and its gradient as they are
/// and writes dq, dk and dv straight into the packed gradient (each operand placed by a
/// `FaRows`: `crates/kernels/src/fa_rows.rs`). No copy unpacks, transposes or stacks anything,
/// and the node's output is the kernel's. Split into views and handed to [`attention`], the
/// same attention costs graph edges for every narrow, squeeze and transpose (candle's backward
/// of a narrow zero-pads its gradient to the whole `qkv`), and copies of q, k, v and of the
/// transposed output.
///
/// # Errors
///
/// As [`attention`].
pub fn packed_attention(qkv: &Tensor, causal: bool, scale: f32) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::flash_packed(&in_place(qkv)?, None, causal, scale)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (causal, scale);
        Err(without_cuda(qkv))
    }
}

/// `qkv` as the packed kernels read it in place: itself where its head dim is unit-stride and
/// its rows (dim 1) lie less than `fa_rows::MAX_ROW_STRIDE` elements apart (always, for the
/// projection's output), else a contiguous copy.
#[cfg(feature = "cuda")]
fn in_place(qkv: &Tensor) -> CResult<Tensor> {
    let st = qkv.stride();
    let rows_ok = st
        .get(1)
        .is_some_and(|&s| (s as u64) < crate::fa_rows::MAX_ROW_STRIDE as u64);
    if st.last() == Some(&1) && rows_ok {
        Ok(qkv.clone())
    } else {
        qkv.contiguous()
    }
}

/// [`packed_attention`] on the projection as the QKV linear makes it, `qkv [B, T, 3 heads d]`
/// (each head's q, k, v side by side) -> `[B, T, heads d]`: the same node over the same memory,
/// without the reshapes to and from `[B, T, heads, 3, d]`, whose graph nodes each cost an edge
/// (a zero-filled gradient and an add of it) in candle's backward. Where [`applies_flat`].
///
/// # Errors
///
/// As [`attention`]; a width that is not `3 heads d`.
pub fn packed_attention_flat(
    qkv: &Tensor,
    heads: usize,
    causal: bool,
    scale: f32,
) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::flash_packed(&in_place(qkv)?, Some(heads), causal, scale)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (heads, causal, scale);
        Err(without_cuda(qkv))
    }
}

/// `softmax(scale q k^T [causal]) v` for `q [.., tq, d]`, `k`, `v` `[.., tk, d]` where
/// [`applies`] holds (causal: key j is seen by query i iff `j <= i + tk - tq`; a query that
/// sees no key gets 0), as one graph node whose backward is the flash-attention backward.
///
/// # Errors
///
/// Where [`applies`] is false: a typed error naming the op and what it takes (without the
/// `cuda` feature, always).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f32) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (qc, kc, vc) = (
            q.detach().contiguous()?,
            k.detach().contiguous()?,
            v.detach().contiguous()?,
        );
        let (o, lse) = crate::cuda::flash_fwd(&qc, &kc, &vc, causal, scale)?;
        crate::region::node3_out("flash-attention", q, k, v, o, move |q, k, v, o, g| {
            crate::cuda::flash_bwd(q, k, v, o, &lse, g, causal, scale)
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, causal, scale);
        Err(without_cuda(q))
    }
}

/// The error of a flash entry point in a build without the `cuda` feature, for operand `x`.
#[cfg(not(feature = "cuda"))]
fn without_cuda(x: &Tensor) -> candle_core::Error {
    crate::error::KernelError::UnsupportedDType {
        op: "flash_attention",
        device: "CPU",
        dtype: x.dtype(),
        supported: "CUDA tensors (a build with the `cuda` feature)",
        shape: x.dims().to_vec(),
    }
    .into()
}
