// Layer norm (`center`) and RMS norm over the last dim, with weight and optional bias, forward
// and backward. Row kernels: one block per row (grid-stride over rows), any row length, f32
// statistics (two passes: mean, then the centred variance, as the CPU kernel).
//
// Backward: `norm_bwd_dx` writes dx and each row's (mean, rstd); the weight and bias gradients
// are column sums over all rows, reduced in two deterministic stages (no atomics, so a step is
// bitwise repeatable): `norm_bwd_partial` sums a chunk of rows per (column tile, chunk) block
// into f32 partials [chunks, 2, n], `norm_bwd_final` adds the chunks in order.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void row_stats(const T* xr, int n, float eps, int center, float* buf,
                                          float& mean, float& rstd) {
    mean = 0.f;
    if (center) {
        float s = 0.f;
        for (int j = threadIdx.x; j < n; j += blockDim.x) s += to_f32(xr[j]);
        mean = block_sum(s, buf) / (float)n;
    }
    float v = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float d = to_f32(xr[j]) - mean;
        v += d * d;
    }
    const float var = block_sum(v, buf) / (float)n;
    rstd = 1.f / sqrtf(var + eps);
}

// y = (x - mean) * rstd * w (+ b); `b` may be null.
template <typename T>
__device__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                         const T* __restrict__ b, T* __restrict__ y, long long rows, int n,
                         float eps, int center) {
    __shared__ float buf[32];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * (long long)n;
        T* yr = y + row * (long long)n;
        float mean, rstd;
        row_stats(xr, n, eps, center, buf, mean, rstd);
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float o = (to_f32(xr[j]) - mean) * rstd * to_f32(w[j]);
            if (b) o += to_f32(b[j]);
            yr[j] = from_f32<T>(o);
        }
    }
}

// dx = rstd * (g w - mean(g w) [center only] - xhat * mean(g w xhat)); stats[row] = (mean, rstd).
template <typename T>
__device__ void norm_bwd_dx(const T* __restrict__ x, const T* __restrict__ w,
                            const T* __restrict__ g, T* __restrict__ dx,
                            float* __restrict__ stats, long long rows, int n, float eps,
                            int center) {
    __shared__ float buf[32];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = row * (long long)n;
        float mean, rstd;
        row_stats(x + o, n, eps, center, buf, mean, rstd);
        float a = 0.f, c = 0.f;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float gw = to_f32(g[o + j]) * to_f32(w[j]);
            a += gw;
            c += gw * (to_f32(x[o + j]) - mean) * rstd;
        }
        a = block_sum(a, buf) / (float)n;
        c = block_sum(c, buf) / (float)n;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float gw = to_f32(g[o + j]) * to_f32(w[j]);
            const float xh = (to_f32(x[o + j]) - mean) * rstd;
            dx[o + j] = from_f32<T>(rstd * (gw - (center ? a : 0.f) - xh * c));
        }
        if (threadIdx.x == 0) {
            stats[2 * row] = mean;
            stats[2 * row + 1] = rstd;
        }
    }
}

#define NB_TX 32
#define NB_TY 8

// Block (32, 8), grid (ceil(n / 32), chunks): column tile blockIdx.x, rows
// [blockIdx.y * per_chunk, min(rows, (blockIdx.y + 1) * per_chunk)). part[chunk][0][col] =
// sum g * xhat, part[chunk][1][col] = sum g, each over the chunk's rows in a fixed order.
template <typename T>
__device__ void norm_bwd_partial(const T* __restrict__ x, const T* __restrict__ g,
                                 const float* __restrict__ stats, float* __restrict__ part,
                                 long long rows, int n, long long per_chunk) {
    __shared__ float sw[NB_TY][NB_TX + 1], sb[NB_TY][NB_TX + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long col = (long long)blockIdx.x * NB_TX + tx;
    const long long r0 = (long long)blockIdx.y * per_chunk;
    const long long r1 = r0 + per_chunk < rows ? r0 + per_chunk : rows;
    float aw = 0.f, ab = 0.f;
    if (col < n) {
        for (long long r = r0 + ty; r < r1; r += NB_TY) {
            const float gv = to_f32(g[r * n + col]);
            aw += gv * (to_f32(x[r * n + col]) - stats[2 * r]) * stats[2 * r + 1];
            ab += gv;
        }
    }
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && col < n) {
        float w = 0.f, b = 0.f;
        for (int k = 0; k < NB_TY; ++k) {
            w += sw[k][tx];
            b += sb[k][tx];
        }
        part[(long long)blockIdx.y * 2 * n + col] = w;
        part[(long long)blockIdx.y * 2 * n + n + col] = b;
    }
}

// wb[col] = dw = sum over chunks (in order) of part[chunk][0][col]; wb[n + col] = db likewise.
// chunks == 0 (no rows) writes zeros.
template <typename T>
__device__ void norm_bwd_final(const float* __restrict__ part, T* __restrict__ wb, int chunks,
                               int n) {
    for (long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x; col < n;
         col += (long long)gridDim.x * blockDim.x) {
        float w = 0.f, b = 0.f;
        for (int k = 0; k < chunks; ++k) {
            w += part[(long long)k * 2 * n + col];
            b += part[(long long)k * 2 * n + n + col];
        }
        wb[col] = from_f32<T>(w);
        wb[n + col] = from_f32<T>(b);
    }
}

#define NORM(NAME, T)                                                                        \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_norm_fwd_##NAME(                           \
        const T* x, const T* w, const T* b, T* y, long long rows, int n, float eps,          \
        int center) {                                                                        \
        norm_fwd<T>(x, w, b, y, rows, n, eps, center);                                       \
    }                                                                                        \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_norm_bwd_dx_##NAME(                        \
        const T* x, const T* w, const T* g, T* dx, float* stats, long long rows, int n,      \
        float eps, int center) {                                                             \
        norm_bwd_dx<T>(x, w, g, dx, stats, rows, n, eps, center);                            \
    }                                                                                        \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_norm_bwd_partial_##NAME(                   \
        const T* x, const T* g, const float* stats, float* part, long long rows, int n,      \
        long long per_chunk) {                                                               \
        norm_bwd_partial<T>(x, g, stats, part, rows, n, per_chunk);                          \
    }                                                                                        \
    extern "C" __global__ void CDT_ROW_BOUNDS cdt_norm_bwd_final_##NAME(                     \
        const float* part, T* wb, int chunks, int n) {                                       \
        norm_bwd_final<T>(part, wb, chunks, n);                                              \
    }

NORM(f32, float)
NORM(bf16, bf16_t)
