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
