// The backward of an embedding lookup (`out[j] = table[ids[j]]`): dtable[v] = sum over the
// positions j with ids[j] == v of g[j], deterministic and without atomics.
//
// candle's own (index_add) runs one thread per column of the table, each walking every
// position in turn: 768 threads for a GPT-2 step's 8192 positions, a chain of dependent
// read-modify-writes per thread. Here a block owns a position j: it first checks whether j is
// the first position holding its id (a scan of ids[0, j) in shared-memory chunks); the first
// one, and only it, sums the gradient rows of every position holding that id, in position
// order, and adds the sum to dtable's row. So each touched row is written by exactly one block
// and its sum has one fixed order: the same bits on every run.
//
// Layout: ids [n] (u32), g [n, d] contiguous, dtable [vocab, d] contiguous, holding the gradient
// so far (zeros, or an earlier contribution, which the sum is added to). An id >= vocab is
// skipped (the forward's lookup refuses it). Launch: grid (n), block EMB_THREADS.
#include "common.cuh"

#define EMB_THREADS 256
// Ids staged in shared memory at a time.
#define EMB_CHUNK 1024
// Columns a thread accumulates per pass over the positions.
#define EMB_COLS 4

template <typename T>
__device__ void emb_bwd(const unsigned* __restrict__ ids, int n, const T* __restrict__ g,
                        T* __restrict__ dtable, int d, int vocab) {
    __shared__ unsigned sid[EMB_CHUNK];
    const int j = blockIdx.x;
    const unsigned id = ids[j];
    if (id >= (unsigned)vocab) return;  // the whole block: id is the same for every thread
    // Is an earlier position holding the same id? Then that one's block sums this row.
    int earlier = 0;
    for (int base = 0; base < j; base += EMB_CHUNK) {
        const int len = min(EMB_CHUNK, j - base);
        for (int i = threadIdx.x; i < len; i += blockDim.x) earlier |= ids[base + i] == id;
        if (__syncthreads_or(earlier)) return;
    }
    // The sum of the rows holding id, positions ascending, EMB_COLS columns a thread a pass.
    for (int c0 = 0; c0 < d; c0 += EMB_THREADS * EMB_COLS) {
        float acc[EMB_COLS];
#pragma unroll
        for (int c = 0; c < EMB_COLS; ++c) acc[c] = 0.f;
        for (int base = j; base < n; base += EMB_CHUNK) {
            const int len = min(EMB_CHUNK, n - base);
            __syncthreads();  // every thread is done with the previous chunk
            for (int i = threadIdx.x; i < len; i += blockDim.x) sid[i] = ids[base + i];
            __syncthreads();
            for (int i = 0; i < len; ++i) {
                if (sid[i] != id) continue;
                const T* row = g + (long long)(base + i) * d;
#pragma unroll
                for (int c = 0; c < EMB_COLS; ++c) {
                    const int e = c0 + c * EMB_THREADS + threadIdx.x;
                    if (e < d) acc[c] += to_f32(row[e]);
                }
            }
        }
        T* out = dtable + (long long)id * d;
#pragma unroll
        for (int c = 0; c < EMB_COLS; ++c) {
            const int e = c0 + c * EMB_THREADS + threadIdx.x;
            if (e < d) out[e] = from_f32<T>(to_f32(out[e]) + acc[c]);
        }
    }
}

#define EMB(NAME, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) cdt_embedding_bwd_##NAME(       \
        const unsigned* ids, int n, const T* g, T* dtable, int d, int vocab) {                \
        emb_bwd<T>(ids, n, g, dtable, d, vocab);                                              \
    }

EMB(f32, float)
EMB(bf16, bf16_t)
