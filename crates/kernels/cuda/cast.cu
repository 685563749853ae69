// A mixed-precision linear's output from its bf16 product: out[i] = f32(y[i]) + b[i % n] (b may
// be null: no bias), elementwise, grid-stride. One pass where a cast and a broadcast bias add
// make two (the second reading and writing the whole f32 output again).
#include "common.cuh"

extern "C" __global__ void cdt_cast_add_rows_bf16_f32(const bf16_t* __restrict__ y,
                                                      const float* __restrict__ b,
                                                      float* __restrict__ out, long long len,
                                                      int n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = to_f32(y[i]);
        out[i] = b ? v + b[i % n] : v;
    }
}

// A linear's bias, added in place to its product: y[i] += b[i % n] (the sum in f32, rounded
// once to T), elementwise, grid-stride. The product is a fresh GEMM output the linear's graph
// node then hands out as its own storage, so adding in place saves the copy a broadcast add
// into a new tensor makes. The bias is of T, or f32 for a bf16 product whose output stays bf16
// (a mixed-precision linear feeding another bf16 op: the f32 master bias added to the bf16
// product in f32, then rounded). Named cdt_add_rows_{T}_{B} for every pair of f32 and bf16 (the
// launcher's declaration in crates/kernels/src/launch_sigs.rs covers them all).
template <typename T, typename B>
__device__ void add_rows(T* __restrict__ y, const B* __restrict__ b, long long len, int n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(b[i % n]));
    }
}

#define ADD_ROWS(NAME, T, B)                                                                   \
    extern "C" __global__ void cdt_add_rows_##NAME(T* y, const B* b, long long len, int n) {   \
        add_rows<T, B>(y, b, len, n);                                                          \
    }

ADD_ROWS(f32_f32, float, float)
ADD_ROWS(f32_bf16, float, bf16_t)
ADD_ROWS(bf16_bf16, bf16_t, bf16_t)
ADD_ROWS(bf16_f32, bf16_t, float)
