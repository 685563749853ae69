// Kernels the emulator's own tests run (crates/kernels-emu/tests/emulator.rs): a correct block
// reduction and one kernel for each kind of bug the emulator must report.

__device__ float selftest_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// y[row] = sum of row `blockIdx.x` of x (n columns): a grid-stride loop, a warp shuffle
// reduction and a cross-warp step through shared memory. Correct for a multiple of 32 threads;
// with a partial last warp its shuffles read lanes no thread runs.
__global__ void row_sum(const float* x, float* y, int n) {
    __shared__ float part[32];
    const float* xr = x + static_cast<size_t>(blockIdx.x) * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
    s = selftest_warp_sum(s);
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    if (lane == 0) part[w] = s;
    __syncthreads();
    if (w == 0) {
        int nw = (blockDim.x + 31) / 32;
        s = lane < nw ? part[lane] : 0.f;
        s = selftest_warp_sum(s);
        if (lane == 0) y[blockIdx.x] = s;
    }
}

// Reads a neighbour's shared-memory slot without a barrier after the writes.
__global__ void racy(float* y) {
    __shared__ float v[1024];
    v[threadIdx.x] = static_cast<float>(threadIdx.x);
    y[threadIdx.x] = v[(threadIdx.x + 1) % blockDim.x];
}

// A __syncthreads only some threads reach.
__global__ void deadlock(float* y) {
    if (threadIdx.x < 10) __syncthreads();
    y[threadIdx.x] = 1.f;
}

// Reads dynamic shared memory nobody wrote.
__global__ void dyn(float* y) {
    CDT_DYN_SHARED(float, buf);
    y[threadIdx.x] = buf[threadIdx.x];
}

// Writes one element per thread with no bounds check.
__global__ void unguarded(float* y) { y[blockIdx.x * blockDim.x + threadIdx.x] = 2.f; }

// Two block sums in a row through one shared array, without a barrier before the second one's
// writes: a fast warp overwrites a slot a slow warp has not read yet. Only shows when warps
// drift apart between __syncthreads.
__device__ float selftest_block_sum_no_lead(float v, float* buf) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = selftest_warp_sum(v);
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    v = lane < nw ? buf[lane] : 0.f;
    return selftest_warp_sum(v);
}

__global__ void reuse_race(const float* x, float* y) {
    __shared__ float buf[32];
    const float a = selftest_block_sum_no_lead(x[threadIdx.x], buf);
    const float b = selftest_block_sum_no_lead(2.f * x[threadIdx.x], buf);
    y[threadIdx.x] = a + 10.f * b;
}

// cp.async (emu::cp_async): thread t copies x[4t, 4t + 4) into shared memory as one 16-byte
// copy, then writes the sum of its neighbour's four to y[t]. `mode`: 0 waits for the copy
// and meets a barrier before reading (correct); 1 reads after the barrier without waiting;
// 2 copies no source bytes (zero fill); 3 exits without waiting; 4 copies to a misaligned
// address.
__global__ void async_copy(const float* x, float* y, int mode) {
    __shared__ __align__(16) float buf[4 * 1024 + 4];
    const unsigned t = threadIdx.x, nb = (t + 1) % blockDim.x;
    float* dst = buf + 4 * t + (mode == 4 ? 1 : 0);
    emu::cp_async(dst, x + 4 * t, 16, mode == 2 ? 0 : 16);
    emu::cp_async_commit();
    if (mode == 3) return;
    if (mode != 1) emu::cp_async_wait(0);
    __syncthreads();
    y[t] = buf[4 * nb] + buf[4 * nb + 1] + buf[4 * nb + 2] + buf[4 * nb + 3];
    if (mode == 1) {
        __syncthreads();  // every thread has read before any waits
        emu::cp_async_wait(0);
    }
}

// A static shared array read before the block writes it (mode 0: each thread reads its slot,
// then, after a barrier, writes it; on a GPU the read is another block's or kernel's garbage,
// here NaN in every block, the second one included), or read after one thread wrote all of it
// (mode 1: the other threads' passing the declaration later must not wipe those writes).
// Thread t of block b writes y[b * blockDim.x + t]; blockDim.x <= 64.
__global__ void stale_shared(float* y, int mode) {
    __shared__ float buf[64];
    const unsigned t = threadIdx.x, out = blockIdx.x * blockDim.x + t;
    if (mode == 0) {
        y[out] = buf[t];
        __syncthreads();
        buf[t] = 1.f;
    } else {
        if (t == 0)
            for (unsigned i = 0; i < blockDim.x; ++i) buf[i] = (float)i;
        __syncthreads();
        y[out] = buf[t];
    }
}

// y[t] holds (as bits) the ballot of x[u] > 0 over the lanes u of thread t's warp; a partial
// last warp's missing lanes vote no. Then y[t] += the lowest voting lane's __ffs, so a wrong
// __ffs shows too: y[t] = mask + __ffs(mask), as an unsigned. `lanes`: the ballot's mask
// argument (only 0xffffffff is emulated).
__global__ void ballot(const float* x, float* y, unsigned lanes) {
    const unsigned m = __ballot_sync(lanes, x[threadIdx.x] > 0.f);
    y[threadIdx.x] = __uint_as_float(m + static_cast<unsigned>(__ffs(static_cast<int>(m))));
}

// A warp-wide matrix instruction (.aligned) reached by the lanes of one warp from different
// places: `mode` 0, every lane through one call (fine); 1, the lower half through
// `selftest_mma_a` and the upper half through `selftest_mma_b` (undefined on a GPU: the
// emulator must fail the launch); 2, the same split for an ldmatrix. y[t]: lane t's first
// accumulator.
#include "mma.h"

__attribute__((noinline)) void selftest_mma_a(float (&d)[4], const unsigned (&a)[4],
                                              const unsigned (&b)[2]) {
    emu::mma_bf16_16816(d, a, b, d);
}
__attribute__((noinline)) void selftest_mma_b(float (&d)[4], const unsigned (&a)[4],
                                              const unsigned (&b)[2]) {
    emu::mma_bf16_16816(d, a, b, d);
    d[0] += 1.f;
}
__attribute__((noinline)) void selftest_ldsm_a(unsigned (&r)[4], const void* row) {
    emu::ldmatrix_x4(r, row, false);
}
__attribute__((noinline)) void selftest_ldsm_b(unsigned (&r)[4], const void* row) {
    emu::ldmatrix_x4(r, row, true);
}
__global__ void divergent_mma(float* y, int mode) {
    __shared__ __align__(16) unsigned short tile[32 * 8];
    const unsigned lane = threadIdx.x % 32;
    for (unsigned i = lane; i < 32 * 8; i += 32) tile[i] = 0x3f80;  // bf16 1.0
    __syncwarp();
    unsigned a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
    unsigned b[2] = {0x3f803f80u, 0x3f803f80u};
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    if (mode == 2) {
        unsigned r[4];
        const void* row = &tile[(lane % 32) * 8];
        if (lane < 16)
            selftest_ldsm_a(r, row);
        else
            selftest_ldsm_b(r, row);
        d[0] = static_cast<float>(r[0] & 0xffffu);
    } else if (mode == 1 && lane >= 16) {
        selftest_mma_b(d, a, b);
    } else {
        selftest_mma_a(d, a, b);
    }
    y[threadIdx.x] = d[0];
}
