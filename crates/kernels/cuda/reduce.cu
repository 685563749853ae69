// Column sums of a row-major [rows, n] matrix, out[c] = sum over r of x[r, c] (a bias's
// gradient: the output gradient summed over every leading dim), in f32, deterministic.
//
// candle's sum over a leading dim gives each column a block that walks the column at a stride
// of n elements: every warp load touches 32 rows, 32 sectors for 32 useful elements. Here the
// threads of a warp take adjacent columns, so each load is one coalesced row segment:
//
// - cdt_col_sum_partial: block (bx, by) sums rows [by CS_ROWS, +CS_ROWS) of columns
//   [bx CS_THREADS, +CS_THREADS), one column a thread, rows in order, into part[by n + c];
// - cdt_col_sum_final: out[c] = the partials of column c added in chunk order, rounded to T.
//
// Launch: partial grid (ceil(n / CS_THREADS), ceil(rows / CS_ROWS)), final grid
// (ceil(n / CS_THREADS)), blocks of CS_THREADS; part holds ceil(rows / CS_ROWS) n floats.
#include "common.cuh"

#define CS_THREADS 256
#define CS_ROWS 256

template <typename T>
__device__ void col_sum_partial(const T* __restrict__ x, float* __restrict__ part,
                                long long rows, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    const long long r0 = (long long)blockIdx.y * CS_ROWS;
    const long long r1 = r0 + CS_ROWS < rows ? r0 + CS_ROWS : rows;
    float acc = 0.f;
#pragma unroll 8
    for (long long r = r0; r < r1; ++r) acc += to_f32(x[r * n + c]);
    part[(long long)blockIdx.y * n + c] = acc;
}

template <typename T>
__device__ void col_sum_final(const float* __restrict__ part, T* __restrict__ out, int chunks,
                              int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float acc = 0.f;
    for (int k = 0; k < chunks; ++k) acc += part[(long long)k * n + c];
    out[c] = from_f32<T>(acc);
}

#define COL_SUM(NAME, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(CS_THREADS)                                  \
        cdt_col_sum_partial_##NAME(const T* x, float* part, long long rows, int n) {          \
        col_sum_partial<T>(x, part, rows, n);                                                 \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(CS_THREADS)                                  \
        cdt_col_sum_final_##NAME(const float* part, T* out, int chunks, int n) {              \
        col_sum_final<T>(part, out, chunks, n);                                               \
    }

COL_SUM(f32, float)
COL_SUM(bf16, bf16_t)
