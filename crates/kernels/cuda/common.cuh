// Helpers shared by the fused kernels: bf16 <-> f32 conversions and block reductions.
//
// bf16 is handled as its 16-bit storage (`unsigned short`, `half::bf16` on the Rust side) with
// the conversions written out, so the kernels need no CUDA header and compile for any
// architecture; all arithmetic is f32.
#pragma once

typedef unsigned short bf16_t;

// The most threads a row kernel (softmax, cross-entropy, norms: `row_cfg` gives up to 1024)
// or a multi-tensor kernel (1024) is launched with. As their `__launch_bounds__` it keeps the
// compiler within the registers a block of 1024 threads may have (64 a thread): an edit that
// went past them would otherwise fail only at launch on a GPU (too many resources requested),
// which the emulator cannot see.
#define CDT_ROW_BOUNDS __launch_bounds__(1024)
#define CDT_NEG_INF (__int_as_float(0xff800000))
#define CDT_NAN (__int_as_float(0x7fc00000))

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
// Round to nearest, ties to even (as half::bf16::from_f32); NaN stays a (quiet) NaN.
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for a 1-D block whose size is a multiple of 32 (at most 1024); every thread
// returns the same value (each warp reduces the same 32 partials in the same order), and the
// order of additions depends only on the block size: deterministic. `buf` is __shared__ [32];
// the leading barrier lets consecutive calls reuse it.
__device__ __forceinline__ float block_sum(float v, float* buf) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    v = lane < nw ? buf[lane] : 0.f;
    return warp_sum(v);
}

// As block_sum, for the maximum (-inf for no elements; fmaxf ignores a NaN operand, as the CPU
// kernels' f32::max does: a NaN input still reaches the output through the exponentials).
__device__ __forceinline__ float block_max(float v, float* buf) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    v = lane < nw ? buf[lane] : CDT_NEG_INF;
    return warp_max(v);
}

// Merges two (max, sum of exp(x - max)) pairs of an online softmax.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    const float a = (m == CDT_NEG_INF) ? 0.f : s * expf(m - mn);
    const float b = (m2 == CDT_NEG_INF) ? 0.f : s2 * expf(m2 - mn);
    m = mn;
    s = a + b;
}

// Block-wide merge of per-thread online-softmax pairs; every thread gets the row's pair.
// `bm`, `bs` are __shared__ [32].
__device__ __forceinline__ void block_lse(float& m, float& s, float* bm, float* bs) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    __syncthreads();
    if (lane == 0) {
        bm[wid] = m;
        bs[wid] = s;
    }
    __syncthreads();
    m = lane < nw ? bm[lane] : CDT_NEG_INF;
    s = lane < nw ? bs[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
}
