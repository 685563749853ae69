// The backward of an embedding lookup (`out[j] = table[ids[j]]`): dtable[v] = sum over the
// positions j with ids[j] == v of g[j], deterministic and without atomics.
//
// candle's own (index_add) runs one thread per column of the table, each walking every
// position in turn: 768 threads for a GPT-2 step's 8192 positions, a chain of dependent
// read-modify-writes per thread. Here a block owns a position j: it first checks whether j is
// the first position holding its id (a scan of ids[0, j) in chunks); the first one, and only
// it, sums the gradient rows of every position holding that id, in position order, and adds the
// sum to dtable's row. So each touched row is written by exactly one block and its sum has one
// fixed order: the same bits on every run.
//
// Finding the positions of [j, n) that hold the id is parallel: each warp compares 32 ids and
// ballots the matches into a bit mask of the chunk, and the threads then walk only the set bits
// (lowest first, so positions ascending). Walking every position of [j, n) one after another
// in each thread instead (as this kernel first did) cost each distinct id's block n - j serial
// steps: about 8 warps x 7500 ids x 4000 steps for a GPT-2 step of random tokens (estimated at
// about a millisecond on an H100, never measured), quadratic in the positions.
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
static_assert(EMB_THREADS % 32 == 0 && EMB_CHUNK % EMB_THREADS == 0,
              "the ballots of a chunk are whole warps, the same number in every thread");

template <typename T>
__device__ void emb_bwd(const unsigned* __restrict__ ids, int n, const T* __restrict__ g,
                        T* __restrict__ dtable, int d, int vocab) {
    // The chunk's matches: bit b of word w is position base + 32 w + b.
    __shared__ unsigned smask[EMB_CHUNK / 32];
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
            __syncthreads();  // every thread is done with the previous chunk's masks
            // Every thread makes the same EMB_CHUNK / EMB_THREADS ballots (whole warps: the
            // launch is EMB_THREADS threads), positions past the chunk voting no.
            for (int i = threadIdx.x; i < EMB_CHUNK; i += EMB_THREADS) {
                const unsigned m = __ballot_sync(0xffffffffu, i < len && ids[base + i] == id);
                if ((threadIdx.x & 31) == 0) smask[i / 32] = m;
            }
            __syncthreads();
            const int words = (len + 31) / 32;
            for (int w = 0; w < words; ++w) {
                for (unsigned m = smask[w]; m != 0; m &= m - 1) {
                    const T* row = g + (long long)(base + 32 * w + __ffs(m) - 1) * d;
#pragma unroll
                    for (int c = 0; c < EMB_COLS; ++c) {
                        const int e = c0 + c * EMB_THREADS + threadIdx.x;
                        if (e < d) acc[c] += to_f32(row[e]);
                    }
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
