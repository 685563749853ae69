// GELU, tanh form (candle's `gelu`, GPT-2's), forward and backward, elementwise (grid-stride).
#include "common.cuh"

#define GELU_C 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_A 0.044715f

template <typename T>
__device__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, long long len) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = to_f32(x[i]);
        const float t = tanhf(GELU_C * (v + GELU_A * v * v * v));
        y[i] = from_f32<T>(0.5f * v * (1.f + t));
    }
}

// dx = g * (0.5 (1 + t) + 0.5 v (1 - t^2) c (1 + 3 a v^2)), t = tanh(c (v + a v^3)).
template <typename T>
__device__ void gelu_bwd(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ dx,
                         long long len) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = to_f32(x[i]);
        const float t = tanhf(GELU_C * (v + GELU_A * v * v * v));
        const float d =
            0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * GELU_C * (1.f + 3.f * GELU_A * v * v);
        dx[i] = from_f32<T>(to_f32(g[i]) * d);
    }
}

#define GELU(NAME, T)                                                                        \
    extern "C" __global__ void cdt_gelu_fwd_##NAME(const T* x, T* y, long long len) {        \
        gelu_fwd<T>(x, y, len);                                                              \
    }                                                                                        \
    extern "C" __global__ void cdt_gelu_bwd_##NAME(const T* x, const T* g, T* dx,            \
                                                   long long len) {                          \
        gelu_bwd<T>(x, g, dx, len);                                                          \
    }

GELU(f32, float)
GELU(bf16, bf16_t)
