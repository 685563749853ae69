// Row kernels over the last dim: softmax (with optional scale and causal mask), log-softmax,
// their backward passes, and softmax cross-entropy over the vocabulary. One block per row
// (grid-stride over rows), any row length (each thread loops over the row), f32 accumulation.
// The Rust side (src/cuda.rs) checks contiguity, dtypes and the limits before launching.
#include "common.cuh"

// softmax(scale * x) over rows of `n`, or log-softmax (`log_out`, with scale 1 and no mask).
// Causal: the rows are [.., t, n]; row r (position i = r % t) keeps j <= i + n - t, and the
// masked entries are 0 (a row with nothing kept is all 0).
template <typename T>
__device__ void softmax_fwd(const T* __restrict__ x, T* __restrict__ y, long long rows, int n,
                            long long t, float scale, int causal, int log_out) {
    __shared__ float buf[32];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * (long long)n;
        T* yr = y + row * (long long)n;
        int valid = n;
        if (causal) {
            const long long v = row % t + (long long)n + 1 - t;
            valid = v < 0 ? 0 : (v > n ? n : (int)v);
        }
        float m = CDT_NEG_INF;
        for (int j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]) * scale);
        m = block_max(m, buf);
        float s = 0.f;
        for (int j = threadIdx.x; j < valid; j += blockDim.x) s += expf(to_f32(xr[j]) * scale - m);
        s = block_sum(s, buf);
        if (log_out) {
            const float lse = m + logf(s);
            for (int j = threadIdx.x; j < n; j += blockDim.x)
                yr[j] = from_f32<T>(to_f32(xr[j]) * scale - lse);
        } else {
            const float inv = 1.f / s;
            for (int j = threadIdx.x; j < n; j += blockDim.x)
                yr[j] = from_f32<T>(j < valid ? expf(to_f32(xr[j]) * scale - m) * inv : 0.f);
        }
    }
}

// Backward from the output y and its gradient g: softmax `scale * y * (g - <y, g>)` (masked
// entries have y = 0 and get 0), log-softmax `g - exp(y) * sum(g)`.
template <typename T>
__device__ void softmax_bwd(const T* __restrict__ y, const T* __restrict__ g, T* __restrict__ dx,
                            long long rows, int n, float scale, int log_out) {
    __shared__ float buf[32];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = row * (long long)n;
        float s = 0.f;
        for (int j = threadIdx.x; j < n; j += blockDim.x)
            s += log_out ? to_f32(g[o + j]) : to_f32(y[o + j]) * to_f32(g[o + j]);
        s = block_sum(s, buf);
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float yv = to_f32(y[o + j]), gv = to_f32(g[o + j]);
            dx[o + j] = from_f32<T>(log_out ? gv - expf(yv) * s : scale * yv * (gv - s));
        }
    }
}

// Whether a row's target is ignored, and its class otherwise (-1 when out of range).
template <typename I>
__device__ __forceinline__ long long xent_class(const I* tgt, long long row, int n,
                                                long long ignore, int has_ignore, bool& ignored) {
    const long long t = (long long)tgt[row];
    ignored = has_ignore && t == ignore;
    return (t >= 0 && t < n) ? t : -1;
}

// Cross-entropy per row: out[row] = (loss, lse) with lse = log sum_j exp(x_j) (one online
// pass) and loss = lse - x[target]; an ignored row's loss is 0, a target outside [0, n) (not
// ignored) gives a NaN loss, so a bad target is never a silent number.
template <typename T, typename I>
__device__ void xent_fwd(const T* __restrict__ x, const I* __restrict__ tgt,
                         float* __restrict__ out, long long rows, int n, long long ignore,
                         int has_ignore) {
    __shared__ float bm[32], bs[32];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * (long long)n;
        float m = CDT_NEG_INF, s = 0.f;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float v = to_f32(xr[j]);
            if (v > m) {
                s = (m == CDT_NEG_INF ? 0.f : s * expf(m - v)) + 1.f;
                m = v;
            } else {
                s += expf(v - m);
            }
        }
        block_lse(m, s, bm, bs);
        if (threadIdx.x == 0) {
            bool ignored;
            const long long c = xent_class(tgt, row, n, ignore, has_ignore, ignored);
            const float lse = m + logf(s);
            float loss;
            if (ignored) {
                loss = 0.f;
            } else if (c < 0) {
                loss = CDT_NAN;
            } else {
                loss = lse - to_f32(xr[c]);
            }
            out[2 * row] = loss;
            out[2 * row + 1] = lse;
        }
    }
}

// The cross-entropy backward written straight into dx: `g * (exp(x - lse) - onehot(target))`
// from lg[row] = (lse, g); 0 for an ignored row, NaN for an out-of-range target.
template <typename T, typename I>
__device__ void xent_bwd(const T* __restrict__ x, const I* __restrict__ tgt,
                         const float* __restrict__ lg, T* __restrict__ dx, long long rows, int n,
                         long long ignore, int has_ignore) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = row * (long long)n;
        bool ignored;
        const long long c = xent_class(tgt, row, n, ignore, has_ignore, ignored);
        const float lse = lg[2 * row], g = lg[2 * row + 1];
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float d;
            if (ignored) {
                d = 0.f;
            } else if (c < 0) {
                d = CDT_NAN;
            } else {
                d = g * (expf(to_f32(x[o + j]) - lse) - (j == c ? 1.f : 0.f));
            }
            dx[o + j] = from_f32<T>(d);
        }
    }
}

#define SOFTMAX(NAME, T)                                                                     \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_softmax_fwd_##NAME(                        \
        const T* x, T* y, long long rows, int n, long long t, float scale, int causal,       \
        int log_out) {                                                                       \
        softmax_fwd<T>(x, y, rows, n, t, scale, causal, log_out);                            \
    }                                                                                        \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_softmax_bwd_##NAME(                        \
        const T* y, const T* g, T* dx, long long rows, int n, float scale, int log_out) {    \
        softmax_bwd<T>(y, g, dx, rows, n, scale, log_out);                                   \
    }

#define XENT(NAME, T, INAME, I)                                                              \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_xent_fwd_##NAME##_##INAME(                 \
        const T* x, const I* tgt, float* out, long long rows, int n, long long ignore,       \
        int has_ignore) {                                                                    \
        xent_fwd<T, I>(x, tgt, out, rows, n, ignore, has_ignore);                            \
    }                                                                                        \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_xent_bwd_##NAME##_##INAME(                 \
        const T* x, const I* tgt, const float* lg, T* dx, long long rows, int n,             \
        long long ignore, int has_ignore) {                                                  \
        xent_bwd<T, I>(x, tgt, lg, dx, rows, n, ignore, has_ignore);                         \
    }

SOFTMAX(f32, float)
SOFTMAX(bf16, bf16_t)
XENT(f32, float, u32, unsigned int)
XENT(f32, float, i64, long long)
XENT(bf16, bf16_t, u32, unsigned int)
XENT(bf16, bf16_t, i64, long long)
