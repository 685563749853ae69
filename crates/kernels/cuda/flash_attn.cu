// Attention that never materialises the T x T scores (flash-attention style, SIMT, f32
// accumulation), forward and backward, for f32 and bf16 and head dims 32, 48, 64, 96, 128.
//
// Layout: q holds BH heads of tq rows of D, k and v BH heads of tk rows, o and the gradients
// like their inputs; each tensor is placed by its own FaRows (below), so q, k and v may be the
// three parts of one packed projection [B, T, H, 3, D] and o may be written as [B, T, H, D]
// (no unpacking or transposing copies around the op); a row's D elements are contiguous. lse
// and delta are [BH, tq] in f32, contiguous. Causal: key j is visible to query i iff j <= i + (tk - tq) (the
// bottom-right alignment of the CPU reference's mask). A query that sees no key (tq > tk only)
// gets output 0 and lse -inf, and contributes no gradient.
//
// Work split: a block owns FA_ROWS rows (queries in the forward and the dQ kernel, keys in the
// dK/dV kernel), FA_TPR consecutive lanes per row, each lane D / FA_TPR of the head dim in
// registers; a dot product is the lanes' partial sums combined by two shuffles. The other side
// (keys, or queries) streams through shared memory in tiles of FA_TILE rows. The scores of a
// tile stay in registers: memory is O(T D), not O(T^2).
//
// Forward: online softmax over key tiles (running max and sum, the accumulator rescaled once
// per tile); writes o and lse = max + log(sum).
// Backward (FlashAttention-2's, without atomics, so it is deterministic): `fa_bwd_delta`
// computes delta_i = sum_e dO_ie O_ie; `fa_bwd_dkv` (a block per key tile) walks the query
// tiles recomputing p_ij = exp(s_ij - lse_i) and accumulates dV_j += p dO_i and
// dK_j += p (dO_i . v_j - delta_i) q_i scale; `fa_bwd_dq` (a block per query tile) walks the key
// tiles and accumulates dQ_i += p (dO_i . v_j - delta_i) k_j scale.
#include "common.cuh"

#define FA_ROWS 32
#define FA_TPR 4
#define FA_TILE 32
#define FA_THREADS (FA_ROWS * FA_TPR)

// Where a tensor's rows lie, in elements: head bh = b heads + h starts at off + b sb + h sh and
// its row i at that + i st. A contiguous [BH, T, D] is {0, T D, 0, D, 1}; the q part of a packed
// [B, T, H, 3, D] is {0, T H 3 D, 3 D, H 3 D, H} (k: off D, v: off 2 D). The launcher checks
// that every row of every head lies in the tensor's buffer and that the rows written do not
// overlap.
struct FaRows {
    long long off, sb, sh, st;
    int heads;
};
// As `fa_rows.rs` lays it out (the launchers pass it by value, the emulator by pointer).
static_assert(sizeof(FaRows) == 40 && alignof(FaRows) == 8, "FaRows is fa_rows.rs's layout");

// The first element of head bh (< 65536, the grid's y limit: 32-bit division).
__device__ __forceinline__ long long fa_head(const FaRows& l, long long bh) {
    const int b = (int)bh / l.heads, h = (int)bh % l.heads;
    return l.off + b * l.sb + h * l.sh;
}

// The partial dot products of a row's FA_TPR lanes, summed (every lane gets the sum).
__device__ __forceinline__ float fa_row_sum(float p) {
    p += __shfl_xor_sync(0xffffffffu, p, 1);
    p += __shfl_xor_sync(0xffffffffu, p, 2);
    return p;
}

// The last key (exclusive) any of the queries [q0, q0 + rows) sees.
__device__ __forceinline__ long long fa_key_end(long long q0, int tq, int tk, int causal,
                                                int rows = FA_ROWS) {
    if (!causal) return tk;
    long long last = q0 + rows - 1;
    if (last > tq - 1) last = tq - 1;
    long long end = last + (long long)tk - tq + 1;
    return end < 0 ? 0 : (end > tk ? tk : end);
}

// The first query any of the keys [k0, k0 + FA_ROWS) is seen by (causal: i >= j - (tk - tq)).
__device__ __forceinline__ long long fa_query_begin(long long k0, int tq, int tk, int causal) {
    if (!causal) return 0;
    long long first = k0 - ((long long)tk - tq);
    return first < 0 ? 0 : first;
}

// Loads rows [r0, r0 + FA_TILE) of an n-row matrix of row stride ld (zeros past n) into a
// shared tile, as f32.
template <typename T, int D>
__device__ __forceinline__ void fa_load_tile(float (*tile)[D], const T* m, long long ld,
                                             long long r0, int n) {
    for (int idx = threadIdx.x; idx < FA_TILE * D; idx += blockDim.x) {
        const int rr = idx / D, e = idx % D;
        const long long r = r0 + rr;
        tile[rr][e] = r < n ? to_f32(m[r * ld + e]) : 0.f;
    }
}

template <typename T, int D>
__device__ void fa_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       T* __restrict__ o, float* __restrict__ lse, const FaRows& lq,
                       const FaRows& lk, const FaRows& lv, const FaRows& lo, int tq, int tk,
                       float scale, int causal) {
    constexpr int DS = D / FA_TPR;
    __shared__ float ks[FA_TILE][D];
    __shared__ float vs[FA_TILE][D];
    const long long bh = blockIdx.y;
    const int r = threadIdx.x / FA_TPR, sub = threadIdx.x % FA_TPR;
    const long long q0 = (long long)blockIdx.x * FA_ROWS;
    const long long i = q0 + r;
    const bool active = i < tq;
    const T* qr_ptr = q + fa_head(lq, bh) + (active ? i : 0) * lq.st + sub * DS;
    const T* kb = k + fa_head(lk, bh);
    const T* vb = v + fa_head(lv, bh);
    const long long shift = (long long)tk - tq;
    float qr[DS], acc[DS];
#pragma unroll
    for (int e = 0; e < DS; ++e) {
        qr[e] = active ? to_f32(qr_ptr[e]) * scale : 0.f;
        acc[e] = 0.f;
    }
    float m = CDT_NEG_INF, l = 0.f;
    const long long kend = fa_key_end(q0, tq, tk, causal);
    for (long long j0 = 0; j0 < kend; j0 += FA_TILE) {
        __syncthreads();  // the previous tile is consumed
        fa_load_tile<T, D>(ks, kb, lk.st, j0, tk);
        fa_load_tile<T, D>(vs, vb, lv.st, j0, tk);
        __syncthreads();
        float s[FA_TILE];
        float tmax = CDT_NEG_INF;
#pragma unroll
        for (int jj = 0; jj < FA_TILE; ++jj) {
            float p = 0.f;
#pragma unroll
            for (int e = 0; e < DS; ++e) p += qr[e] * ks[jj][sub * DS + e];
            p = fa_row_sum(p);
            const long long j = j0 + jj;
            const bool vis = active && j < tk && (!causal || j <= i + shift);
            s[jj] = vis ? p : CDT_NEG_INF;
            tmax = fmaxf(tmax, s[jj]);
        }
        const float mn = fmaxf(m, tmax);
        if (mn == CDT_NEG_INF) continue;  // nothing visible to this row yet
        const float alpha = m == CDT_NEG_INF ? 0.f : expf(m - mn);
        l *= alpha;
#pragma unroll
        for (int e = 0; e < DS; ++e) acc[e] *= alpha;
#pragma unroll
        for (int jj = 0; jj < FA_TILE; ++jj) {
            const float p = s[jj] == CDT_NEG_INF ? 0.f : expf(s[jj] - mn);
            l += p;
#pragma unroll
            for (int e = 0; e < DS; ++e) acc[e] += p * vs[jj][sub * DS + e];
        }
        m = mn;
    }
    if (active) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* orow = o + fa_head(lo, bh) + i * lo.st + sub * DS;
#pragma unroll
        for (int e = 0; e < DS; ++e) orow[e] = from_f32<T>(acc[e] * inv);
        if (sub == 0) lse[bh * tq + i] = l > 0.f ? m + logf(l) : CDT_NEG_INF;
    }
}

// delta[row] = sum_e dO[row, e] O[row, e], rows = BH tq, row = bh tq + i (grid-stride, a
// thread per row).
template <typename T, int D>
__device__ void fa_bwd_delta(const T* __restrict__ o, const T* __restrict__ d_o,
                             float* __restrict__ delta, const FaRows& lo, const FaRows& ldo,
                             long long rows, int tq) {
    for (long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x; row < rows;
         row += (long long)gridDim.x * blockDim.x) {
        const long long bh = row / tq, i = row % tq;
        const T* orow = o + fa_head(lo, bh) + i * lo.st;
        const T* drow = d_o + fa_head(ldo, bh) + i * ldo.st;
        float s = 0.f;
        for (int e = 0; e < D; ++e) s += to_f32(orow[e]) * to_f32(drow[e]);
        delta[row] = s;
    }
}

// dK, dV for the keys [blockIdx.x FA_ROWS, +FA_ROWS) of head blockIdx.y, both written to `dkv`
// (placed by ldk and ldv).
template <typename T, int D>
__device__ void fa_bwd_dkv(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, const T* __restrict__ d_o,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           T* __restrict__ dkv, const FaRows& lq, const FaRows& lk,
                           const FaRows& lv, const FaRows& ldo, const FaRows& ldk,
                           const FaRows& ldv, int tq, int tk, float scale, int causal) {
    constexpr int DS = D / FA_TPR;
    __shared__ float qs[FA_TILE][D];
    __shared__ float dos[FA_TILE][D];
    __shared__ float ls[FA_TILE], dl[FA_TILE];
    const long long bh = blockIdx.y;
    const int r = threadIdx.x / FA_TPR, sub = threadIdx.x % FA_TPR;
    const long long k0 = (long long)blockIdx.x * FA_ROWS;
    const long long j = k0 + r;
    const bool active = j < tk;
    const long long jr = (active ? j : 0), col = sub * DS;
    const T* krow = k + fa_head(lk, bh) + jr * lk.st + col;
    const T* vrow = v + fa_head(lv, bh) + jr * lv.st + col;
    const long long shift = (long long)tk - tq;
    float kr[DS], vr[DS], dka[DS], dva[DS];
#pragma unroll
    for (int e = 0; e < DS; ++e) {
        kr[e] = active ? to_f32(krow[e]) : 0.f;
        vr[e] = active ? to_f32(vrow[e]) : 0.f;
        dka[e] = 0.f;
        dva[e] = 0.f;
    }
    const T* qb = q + fa_head(lq, bh);
    const T* dob = d_o + fa_head(ldo, bh);
    long long i0 = fa_query_begin(k0, tq, tk, causal);
    i0 -= i0 % FA_TILE;
    for (; i0 < tq; i0 += FA_TILE) {
        __syncthreads();
        fa_load_tile<T, D>(qs, qb, lq.st, i0, tq);
        fa_load_tile<T, D>(dos, dob, ldo.st, i0, tq);
        for (int idx = threadIdx.x; idx < FA_TILE; idx += blockDim.x) {
            const long long ii = i0 + idx;
            ls[idx] = ii < tq ? lse[bh * tq + ii] : CDT_NEG_INF;
            dl[idx] = ii < tq ? delta[bh * tq + ii] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int ii = 0; ii < FA_TILE; ++ii) {
            const long long i = i0 + ii;
            float s = 0.f, dp = 0.f;
#pragma unroll
            for (int e = 0; e < DS; ++e) {
                s += qs[ii][sub * DS + e] * kr[e];
                dp += dos[ii][sub * DS + e] * vr[e];
            }
            s = fa_row_sum(s) * scale;
            dp = fa_row_sum(dp);
            const bool vis = active && i < tq && (!causal || j <= i + shift) &&
                             ls[ii] != CDT_NEG_INF;
            const float p = vis ? expf(s - ls[ii]) : 0.f;
            const float ds = p * (dp - dl[ii]) * scale;
#pragma unroll
            for (int e = 0; e < DS; ++e) {
                dva[e] += p * dos[ii][sub * DS + e];
                dka[e] += ds * qs[ii][sub * DS + e];
            }
        }
    }
    if (active) {
        T* dkr = dkv + fa_head(ldk, bh) + j * ldk.st + col;
        T* dvr = dkv + fa_head(ldv, bh) + j * ldv.st + col;
#pragma unroll
        for (int e = 0; e < DS; ++e) {
            dkr[e] = from_f32<T>(dka[e]);
            dvr[e] = from_f32<T>(dva[e]);
        }
    }
}

// dQ for the queries [blockIdx.x FA_ROWS, +FA_ROWS) of head blockIdx.y.
template <typename T, int D>
__device__ void fa_bwd_dq(const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const T* __restrict__ d_o,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ dq, const FaRows& lq, const FaRows& lk,
                          const FaRows& lv, const FaRows& ldo, const FaRows& ldq, int tq, int tk,
                          float scale, int causal) {
    constexpr int DS = D / FA_TPR;
    __shared__ float ks[FA_TILE][D];
    __shared__ float vs[FA_TILE][D];
    const long long bh = blockIdx.y;
    const int r = threadIdx.x / FA_TPR, sub = threadIdx.x % FA_TPR;
    const long long q0 = (long long)blockIdx.x * FA_ROWS;
    const long long i = q0 + r;
    const bool active = i < tq;
    const long long ir = (active ? i : 0), col = sub * DS;
    const T* qrow = q + fa_head(lq, bh) + ir * lq.st + col;
    const T* dorow = d_o + fa_head(ldo, bh) + ir * ldo.st + col;
    const long long shift = (long long)tk - tq;
    const float li = active ? lse[bh * tq + i] : CDT_NEG_INF;
    const float di = active ? delta[bh * tq + i] : 0.f;
    float qr[DS], dor[DS], dqa[DS];
#pragma unroll
    for (int e = 0; e < DS; ++e) {
        qr[e] = active ? to_f32(qrow[e]) : 0.f;
        dor[e] = active ? to_f32(dorow[e]) : 0.f;
        dqa[e] = 0.f;
    }
    const T* kb = k + fa_head(lk, bh);
    const T* vb = v + fa_head(lv, bh);
    const long long kend = fa_key_end(q0, tq, tk, causal);
    for (long long j0 = 0; j0 < kend; j0 += FA_TILE) {
        __syncthreads();
        fa_load_tile<T, D>(ks, kb, lk.st, j0, tk);
        fa_load_tile<T, D>(vs, vb, lv.st, j0, tk);
        __syncthreads();
#pragma unroll 4
        for (int jj = 0; jj < FA_TILE; ++jj) {
            const long long j = j0 + jj;
            float s = 0.f, dp = 0.f;
#pragma unroll
            for (int e = 0; e < DS; ++e) {
                s += qr[e] * ks[jj][sub * DS + e];
                dp += dor[e] * vs[jj][sub * DS + e];
            }
            s = fa_row_sum(s) * scale;
            dp = fa_row_sum(dp);
            const bool vis = active && j < tk && (!causal || j <= i + shift) && li != CDT_NEG_INF;
            const float p = vis ? expf(s - li) : 0.f;
            const float ds = p * (dp - di) * scale;
#pragma unroll
            for (int e = 0; e < DS; ++e) dqa[e] += ds * ks[jj][sub * DS + e];
        }
    }
    if (active) {
        T* dqr = dq + fa_head(ldq, bh) + i * ldq.st + col;
#pragma unroll
        for (int e = 0; e < DS; ++e) dqr[e] = from_f32<T>(dqa[e]);
    }
}

// Entry points: cdt_fa_{fwd,bwd_delta,bwd_dkv,bwd_dq}_{f32,bf16}_d{D}. Launch: fwd and bwd_dq
// grid (ceil(tq / FA_ROWS), BH), bwd_dkv grid (ceil(tk / FA_ROWS), BH), block FA_THREADS (128);
// bwd_delta any 1-D launch (grid-stride over BH tq rows). Each tensor is placed by its FaRows;
// dK and dV are both written to `dkv`, placed by ldk and ldv.
#define FA(NAME, T, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) cdt_fa_fwd_##NAME##_d##D(        \
        const T* q, const T* k, const T* v, T* o, float* lse, FaRows lq, FaRows lk, FaRows lv, \
        FaRows lo, int tq, int tk, float scale, int causal) {                                \
        fa_fwd<T, D>(q, k, v, o, lse, lq, lk, lv, lo, tq, tk, scale, causal);                \
    }                                                                                        \
    extern "C" __global__ void cdt_fa_bwd_delta_##NAME##_d##D(                                \
        const T* o, const T* d_o, float* delta, FaRows lo, FaRows ldo, long long rows, int tq) { \
        fa_bwd_delta<T, D>(o, d_o, delta, lo, ldo, rows, tq);                                \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) cdt_fa_bwd_dkv_##NAME##_d##D(    \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse,                  \
        const float* delta, T* dkv, FaRows lq, FaRows lk, FaRows lv, FaRows ldo, FaRows ldk,  \
        FaRows ldv, int tq, int tk, float scale, int causal) {                               \
        fa_bwd_dkv<T, D>(q, k, v, d_o, lse, delta, dkv, lq, lk, lv, ldo, ldk, ldv, tq, tk,    \
                         scale, causal);                                                     \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) cdt_fa_bwd_dq_##NAME##_d##D(     \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse,                  \
        const float* delta, T* dq, FaRows lq, FaRows lk, FaRows lv, FaRows ldo, FaRows ldq,   \
        int tq, int tk, float scale, int causal) {                                           \
        fa_bwd_dq<T, D>(q, k, v, d_o, lse, delta, dq, lq, lk, lv, ldo, ldq, tq, tk, scale,    \
                        causal);                                                             \
    }

#define FA_DIMS(NAME, T) FA(NAME, T, 32) FA(NAME, T, 48) FA(NAME, T, 64) FA(NAME, T, 96) FA(NAME, T, 128)

FA_DIMS(f32, float)
FA_DIMS(bf16, bf16_t)

// ------------------------------------------------------------------------------------------
// The forward on tensor cores (bf16 operands, f32 accumulation; sm_80 and newer), as
// FlashAttention-2 computes it: everything of a warp's 16 queries stays in registers. The warp
// matrix instructions are PTX's (mma_sync.cuh: ldmatrix and mma.sync.m16n8k16, whose register
// layouts are documented), so the scores S = Q K^T come out in a known layout: each lane holds
// two rows (g and g + 8 of the warp's 16) and two adjacent columns of every 8-key slice, the
// online softmax runs on them with two shuffles across the 4 lanes of a row, the
// probabilities P become the A operand of O += P V without leaving registers (rounded to bf16
// as FlashAttention rounds them), and the running output O is rescaled in registers.
//
// A block is FA_TC_FWD_WARPS warps of 16 queries; keys stream through shared memory FA_TCF_BN at a
// time (K and V tiles copied by the whole block with cp.async, 16 bytes a thread when aligned,
// each tile's copy overlapping the products of the one before it; rows padded so that each
// 8-row ldmatrix phase hits 8 different bank groups). The queries' fragments are
// loaded once, through the key tile. Scores are kept in the log2 domain (s scale log2 e) for
// exp2. Rows with nothing visible keep m = -inf and P = 0, as the SIMT kernel does; o and lse
// are written as it writes them.
#if defined(CDT_EMU) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#include "mma_sync.cuh"

// Shared tiles of bf16 operands have rows of D + FA_TC_PAD elements. An ldmatrix phase reads 8
// rows of 16 bytes; at a row stride that is a multiple of 128 bytes (D = 64, 128) all 8 fall
// into the same 4 banks, an 8-way conflict. 16 bytes more per row put them in 8 different bank
// groups for every head dim (counted by the emulator's test
// `tensor_core_tiles_are_read_without_bank_conflicts`), and keep every row 16-byte aligned as
// ldmatrix needs.
#define FA_TC_PAD 8

// The block's copy of rows [r0, r0 + R) of an n-row bf16 matrix of row stride ld into a shared
// tile of row stride D + FA_TC_PAD, zeros past n, issued as one cp.async group of each thread:
// 16-byte copies that bypass the registers when `m` and ld allow them (m 16-byte aligned and ld
// a multiple of 8: every row then is, D being a multiple of 8), else element by element through
// registers (a tensor whose storage offset or row stride is not a multiple of 8 elements). Coalesced either way. The tile is complete
// once every thread waited for its groups and passed a barrier (fa_tc_tiles_landed); until
// then the warps go on computing, which is what lets a kernel copy the next tile while it
// works on this one.
//
// ld is below FA_TC_MAX_LD (the launcher checks it), so that an offset within the R rows fits
// 32 bits: a thread's offsets are then one register each, where the tile loop of the d = 64
// forward is at the 128 registers two blocks an SM allow.
#define FA_TC_MAX_LD (1 << 24)
template <int R, int D>
__device__ __forceinline__ void fa_tc_load_rows(bf16_t* tile, const bf16_t* __restrict__ m,
                                                int ld, long long r0, int n) {
    constexpr int LD = D + FA_TC_PAD;
    // The largest offset, (R - 1) ld + D - 1 with ld < FA_TC_MAX_LD, fits an int (with R = 128
    // rows, with about 16.8 million to spare: a taller tile needs a smaller FA_TC_MAX_LD).
    static_assert((long long)(R - 1) * (FA_TC_MAX_LD - 1) + D <= 2147483647LL,
                  "a tile row offset past an int");
    const bf16_t* base = m + r0 * ld;
    const long long left = n - r0;  // rows of the matrix from r0 on
    if ((reinterpret_cast<unsigned long long>(m) & 15ull) == 0 && (ld & 7) == 0) {
        constexpr int C = D / 8;  // 16-byte chunks a row
        for (int idx = threadIdx.x; idx < R * C; idx += blockDim.x) {
            const int r = idx / C, c = idx % C;
            const bool in = r < left;
            cdt_cp_async_16(tile + r * LD + c * 8, in ? base + (r * ld + c * 8) : m, in);
        }
    } else {
        for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
            const int r = idx / D, e = idx % D;
            tile[r * LD + e] = r < left ? base[r * ld + e] : (bf16_t)0;
        }
    }
    cdt_cp_async_commit();
}

// Every tile the block's threads copied so far is complete and visible to all of them, and
// every warp is past its reads of tiles before this point.
__device__ __forceinline__ void fa_tc_tiles_landed() {
    cdt_cp_async_wait<0>();
    __syncthreads();
}

// Writes a warp's 16 x D accumulators (mma.sync C layout: rows g and g + 8, columns 2t and
// 2t + 1 of each 8-wide slice), row h's times mul[h], as bf16 rows row[0], row[1] (those below
// n) of an n-row matrix of row stride ld: two elements a 4-byte store where `out` is 4-byte
// aligned and ld even (the op's outputs are fresh allocations), one at a time otherwise.
template <int D, typename Row>
__device__ __forceinline__ void fa_mma_write_rows(const float (&acc)[D / 8][4],
                                                  bf16_t* __restrict__ out, long long ld,
                                                  const Row (&row)[2], const float (&mul)[2], int n,
                                                  int t) {
    const bool pairs = (reinterpret_cast<unsigned long long>(out) & 3ull) == 0 && (ld & 1) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (row[h] >= n) continue;
        bf16_t* r = out + (long long)row[h] * ld;
#pragma unroll
        for (int s = 0; s < D / 8; ++s) {
            const float a = acc[s][2 * h] * mul[h], b = acc[s][2 * h + 1] * mul[h];
            if (pairs) {
                *reinterpret_cast<unsigned*>(r + s * 8 + 2 * t) = cdt_pack_bf16(a, b);
            } else {
                r[s * 8 + 2 * t] = from_f32<bf16_t>(a);
                r[s * 8 + 2 * t + 1] = from_f32<bf16_t>(b);
            }
        }
    }
}

// Zeroes N accumulator slices (mma.sync C fragments).
template <int N>
__device__ __forceinline__ void fa_zero(float (&a)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[n][e] = 0.f;
}

// The A fragments of the 16 rows [r0, r0 + 16) of a bf16 tile in shared memory (row stride
// D + FA_TC_PAD), one per 16-wide step over the head dim.
template <int D>
__device__ __forceinline__ void fa_ldsm_rows(unsigned (&a)[D / 16][4],
                                             const bf16_t (*tile)[D + FA_TC_PAD], int r0,
                                             int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        cdt_ldsm_x4(a[kk], &tile[r0 + lane % 16][kk * 16 + (lane / 16) * 8]);
}

// s (16 x 8 NS) += a b^T over the head dim: `a` the A fragments of a warp's 16 rows
// (fa_ldsm_rows), `b` a tile of 8 NS rows in shared memory whose rows are the product's
// columns, read by ldmatrix as the B operand, two 8-row slices a load. S = Q K^T and
// dP = dO V^T.
template <int D, int NS>
__device__ __forceinline__ void fa_mma_rows_dot_tile(float (&s)[NS][4],
                                                     const unsigned (&a)[D / 16][4],
                                                     const bf16_t (*b)[D + FA_TC_PAD], int lane) {
#pragma unroll
    for (int nt = 0; nt < NS; nt += 2) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned f[4];
            cdt_ldsm_x4(f, &b[nt * 8 + lane % 8 + (lane / 16) * 8][kk * 16 + ((lane / 8) % 2) * 8]);
            cdt_mma_bf16_x2(s[nt], s[nt + 1], a[kk], f);
        }
    }
}

// acc (16 x D) += s m: `s` the warp's 16 x 8 NS accumulator slices (C layout), rounded to bf16
// as the A operand 16 columns a step; `m` an 8 NS x D bf16 tile in shared memory (row stride
// D + FA_TC_PAD), read transposed by ldmatrix as the B operand. P V in the forward, dS K in
// dQ.
template <int D, int NS>
__device__ __forceinline__ void fa_mma_acc_times_tile(float (&acc)[D / 8][4], const float (&s)[NS][4],
                                                      const bf16_t (*m)[D + FA_TC_PAD], int lane) {
#pragma unroll
    for (int kk = 0; kk < NS / 2; ++kk) {
        unsigned a[4];
        cdt_acc_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            unsigned b[4];
            cdt_ldsm_x4_t(b, &m[kk * 16 + lane % 8 + ((lane / 8) % 2) * 8][n * 8 + (lane / 16) * 8]);
            cdt_mma_bf16_x2(acc[n], acc[n + 1], a, b);
        }
    }
}

// Warps a block: 8 in the forward (128 queries share each K and V tile copied, as in
// FlashAttention-2's forward), 4 in the backward kernels (whose register and shared-memory
// needs are larger).
#define FA_TC_FWD_WARPS 8
#define FA_TC_BWD_WARPS 4
// Forward blocks an SM must hold at once (__launch_bounds__'s second argument: at most 65536 /
// (32 FA_TC_FWD_WARPS blocks) registers a thread, 128 for 2 blocks): 16 warps an SM up to
// D = 64, as with the 4-warp blocks before; the larger head dims need more registers.
#define FA_TC_FWD_BLOCKS(D) ((D) <= 64 ? 2 : 1)
#define FA_TCF_BN 64

template <int D>
__device__ void fa_fwd_tc(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                          const bf16_t* __restrict__ v, bf16_t* __restrict__ o,
                          float* __restrict__ lse, const FaRows& lq, const FaRows& lk,
                          const FaRows& lv, const FaRows& lo, int tq, int tk, float scale,
                          int causal) {
    constexpr int BM = 16 * FA_TC_FWD_WARPS;
    constexpr int BN = FA_TCF_BN;
    constexpr int LD = D + FA_TC_PAD;
    constexpr int KS = D / 16;  // 16-wide steps over the head dim (S = Q K^T)
    constexpr int NS = BN / 8;  // 8-key slices of a score tile
    constexpr int NO = D / 8;   // 8-wide slices of the output
    static_assert(D % 16 == 0, "the head dim is a multiple of the 16-wide matrix steps");
    static_assert(BM <= 2 * BN, "the queries are staged through the K and V tiles");
    constexpr unsigned FULL = 0xffffffffu;
    __shared__ __align__(128) bf16_t kv[2 * BN][LD];  // K in rows [0, BN), V in [BN, 2 BN)
    bf16_t(*ks)[LD] = kv;
    bf16_t(*vs)[LD] = kv + BN;
    const long long bh = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // Row and key indices fit an int (tq, tk < 2^31, checked by the op): 32-bit arithmetic
    // keeps the loop's registers within the 128 that two blocks an SM allow.
    const int q0 = blockIdx.x * BM;
    const int shift = tk - tq;
    const bf16_t* kb = k + fa_head(lk, bh);
    const bf16_t* vb = v + fa_head(lv, bh);
    const int kst = (int)lk.st, vst = (int)lv.st;  // < FA_TC_MAX_LD
    // The warp's queries as A fragments, loaded once (through the K and V tiles).
    fa_tc_load_rows<BM, D>(&kv[0][0], q + fa_head(lq, bh), (int)lq.st, q0, tq);
    fa_tc_tiles_landed();
    unsigned qa[KS][4];
    fa_ldsm_rows<D>(qa, kv, warp * 16, lane);
    float acc[NO][4];
    fa_zero(acc);
    // Rows g and g + 8 of the warp: running maximum (log2 domain) and this lane's part of the
    // running sum (its columns; the 4 lanes of a row add theirs at the end).
    const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float m[2] = {CDT_NEG_INF, CDT_NEG_INF}, l[2] = {0.f, 0.f};
    const float sl2 = scale * 1.4426950408889634f;
    const int kend = (int)fa_key_end(q0, tq, tk, causal, BM);
    // The keys the warp's own queries see end at wkend (0 for a warp past tq): a key tile
    // beyond it changes none of the warp's rows (every score masked, P = 0, alpha = 1), so the
    // warp skips its products and takes part only in the copies and barriers. Under the
    // causal mask that is most of the diagonal tiles for the block's first warps.
    const int wrow = q0 + warp * 16;
    const int wkend = wrow >= tq ? 0 : (int)fa_key_end(wrow, tq, tk, causal, 16);
    // FlashAttention-2's software pipeline: a tile's V is copied while the warps compute its
    // S = Q K^T, the next tile's K while they compute this one's softmax and P V.
    __syncthreads();  // every warp holds its queries: the tiles are free
    if (kend > 0) fa_tc_load_rows<BN, D>(&ks[0][0], kb, kst, 0, tk);
    for (int j0 = 0; j0 < kend; j0 += BN) {
        fa_tc_tiles_landed();  // this tile's K; every warp is done with the previous V
        fa_tc_load_rows<BN, D>(&vs[0][0], vb, vst, j0, tk);
        // Warp-uniform (the warp's rows decide); every warp reaches both barriers of the tile
        // from the same call sites, computing or not.
        const bool work = j0 < wkend;
        float s[NS][4];
        float tmax[2] = {CDT_NEG_INF, CDT_NEG_INF};
        if (work) {
            // S = Q K^T.
            fa_zero(s);
            fa_mma_rows_dot_tile<D, NS>(s, qa, ks, lane);
            // Mask and scale; the tile's row maxima over the row's 4 lanes.
#pragma unroll
            for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e / 2;
                    const int j = j0 + nt * 8 + 2 * t + e % 2;
                    const bool vis = row[h] < tq && j < tk && (!causal || j <= row[h] + shift);
                    s[nt][e] = vis ? s[nt][e] * sl2 : CDT_NEG_INF;
                    tmax[h] = fmaxf(tmax[h], s[nt][e]);
                }
        }
        fa_tc_tiles_landed();  // this tile's V; every warp is done with K
        if (j0 + BN < kend) fa_tc_load_rows<BN, D>(&ks[0][0], kb, kst, j0 + BN, tk);
        if (!work) continue;
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(FULL, tmax[h], 1));
            tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(FULL, tmax[h], 2));
            const float mn = fmaxf(m[h], tmax[h]);
            // Nothing visible yet: O and l stay 0, m stays -inf.
            alpha[h] = mn == CDT_NEG_INF ? 1.f : exp2f(m[h] - mn);
            m[h] = mn;
            l[h] *= alpha[h];
        }
        // P = exp2(s - m), summed in f32, rounded to bf16 as the A operand of P V: slices 2kk
        // and 2kk + 1 are the 16 keys of step kk, in the A layout already.
#pragma unroll
        for (int nt = 0; nt < NS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2;
                const float p = m[h] == CDT_NEG_INF ? 0.f : exp2f(s[nt][e] - m[h]);
                s[nt][e] = p;
                l[h] += p;
            }
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
        // O += P V.
        fa_mma_acc_times_tile<D, NS>(acc, s, vs, lane);
    }
    // o = O / l, lse = m ln 2 + log l, for rows g and g + 8.
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(FULL, l[h], 1);
        l[h] += __shfl_xor_sync(FULL, l[h], 2);
        inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
        if (t == 0 && row[h] < tq)
            lse[bh * tq + row[h]] =
                l[h] > 0.f ? m[h] * 0.6931471805599453f + logf(l[h]) : CDT_NEG_INF;
    }
    fa_mma_write_rows<D>(acc, o + fa_head(lo, bh), lo.st, row, inv, tq, t);
}

// The backward on tensor cores, on ldmatrix and mma.sync as the forward: the SIMT kernels' work
// split (delta from cdt_fa_bwd_delta_bf16_d*; a block per key tile for dK and dV, a block per
// query tile for dQ), every product a tensor-core one and everything of a warp's 16 rows in
// registers. S and dP = dO V^T are recomputed, P = exp(S scale - lse) and
// dS = P (dP - delta) scale formed on the accumulators and rounded to bf16 as the A operands
// of dV += P^T dO, dK += dS^T Q and dQ += dS K (as FlashAttention-2 rounds them).

// dK and dV for the keys [blockIdx.x BN, +BN) of head blockIdx.y, BN = 16 FA_TC_BWD_WARPS; warp
// w owns keys [16 w, 16 w + 16) and their dK and dV accumulators. The block's K and V stay in
// shared memory; query tiles of FA_TCK_BQ(D) rows (Q, dO, lse, delta) stream through it. The
// warp computes S^T = K Q^T and dP^T = V dO^T, so that its keys are the rows of the
// accumulators and P^T, dS^T are already the A operands of the two products. Where two query
// tiles fit the 48 KB of static shared memory beside K and V (head dims up to 96), the next one
// is copied (cp.async) while the warps work on this one.
#define FA_TCK_BQ(D) ((D) <= 64 ? 32 : 16)

// The block's copies (cp.async groups) of query tile [i0, i0 + BQ) for the dK/dV kernel: its Q
// and dO rows, and its lse and delta as they are (zeros past tq).
template <int D, int BQ>
__device__ __forceinline__ void fa_tck_load_queries(bf16_t (*qs)[D + FA_TC_PAD],
                                                    bf16_t (*dos)[D + FA_TC_PAD], float* ls,
                                                    float* dl, const bf16_t* qb, int qst,
                                                    const bf16_t* dob, int dost,
                                                    const float* lse, const float* delta,
                                                    long long i0, int tq) {
    fa_tc_load_rows<BQ, D>(&qs[0][0], qb, qst, i0, tq);
    fa_tc_load_rows<BQ, D>(&dos[0][0], dob, dost, i0, tq);
    for (int r = threadIdx.x; r < BQ; r += blockDim.x) {
        const long long i = i0 + r;
        const bool in = i < tq;
        cdt_cp_async_4(&ls[r], in ? lse + i : lse, in);
        cdt_cp_async_4(&dl[r], in ? delta + i : delta, in);
    }
    cdt_cp_async_commit();
}

template <int D>
__device__ void fa_bwd_dkv_tc(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                              const bf16_t* __restrict__ v, const bf16_t* __restrict__ d_o,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              bf16_t* __restrict__ dkv, const FaRows& lq, const FaRows& lk,
                              const FaRows& lv, const FaRows& ldo, const FaRows& ldk,
                              const FaRows& ldv, int tq, int tk, float scale, int causal) {
    constexpr int BN = 16 * FA_TC_BWD_WARPS;
    constexpr int BQ = FA_TCK_BQ(D);
    constexpr int LD = D + FA_TC_PAD;
    constexpr int KS = D / 16, NQ = BQ / 8, NO = D / 8;
    static_assert(D % 16 == 0 && BQ % 16 == 0, "16-wide matrix steps over D and the query tile");
    // Query tiles in flight: K and V, plus per tile Q, dO, lse and delta.
    constexpr int KV_BYTES = 2 * BN * LD * 2, TILE_BYTES = 2 * BQ * LD * 2 + 2 * BQ * 4;
    constexpr int ST = KV_BYTES + 2 * TILE_BYTES <= 48 * 1024 ? 2 : 1;
    constexpr float LOG2E = 1.4426950408889634f;
    __shared__ __align__(128) bf16_t ks[BN][LD];
    __shared__ __align__(128) bf16_t vs[BN][LD];
    __shared__ __align__(128) bf16_t qs[ST][BQ][LD];
    __shared__ __align__(128) bf16_t dos[ST][BQ][LD];
    __shared__ float lss[ST][BQ], dls[ST][BQ];  // the tiles' lse and delta
    const long long bh = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const long long k0 = (long long)blockIdx.x * BN;
    const long long shift = (long long)tk - tq;
    const bf16_t* qb = q + fa_head(lq, bh);
    const bf16_t* dob = d_o + fa_head(ldo, bh);
    const int qst = (int)lq.st, dost = (int)ldo.st;  // < FA_TC_MAX_LD
    const float* lseb = lse + bh * tq;
    const float* deltab = delta + bh * tq;
    fa_tc_load_rows<BN, D>(&ks[0][0], k + fa_head(lk, bh), (int)lk.st, k0, tk);
    fa_tc_load_rows<BN, D>(&vs[0][0], v + fa_head(lv, bh), (int)lv.st, k0, tk);
    const long long krow[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
    const float sl2 = scale * LOG2E;
    float dka[NO][4], dva[NO][4];
    fa_zero(dka);
    fa_zero(dva);
    long long i0 = fa_query_begin(k0, tq, tk, causal);
    i0 -= i0 % BQ;
    if (ST == 2 && i0 < tq)
        fa_tck_load_queries<D, BQ>(qs[0], dos[0], lss[0], dls[0], qb, qst, dob, dost, lseb,
                                   deltab, i0, tq);
    for (int b = 0; i0 < tq; i0 += BQ, b = (b + 1) % ST) {
        if (ST == 1) {
            __syncthreads();  // every warp is done with the previous query tile
            fa_tck_load_queries<D, BQ>(qs[0], dos[0], lss[0], dls[0], qb, qst, dob, dost, lseb,
                                       deltab, i0, tq);
        }
        // This query tile (and K and V the first time); every warp is done with the previous
        // tile, so with the other buffer.
        fa_tc_tiles_landed();
        if (ST == 2 && i0 + BQ < tq) {
            const int nb = (b + 1) % ST;
            fa_tck_load_queries<D, BQ>(qs[nb], dos[nb], lss[nb], dls[nb], qb, qst, dob, dost,
                                       lseb, deltab, i0 + BQ, tq);
        }
        const bf16_t(*qt)[LD] = qs[b];
        const bf16_t(*dot)[LD] = dos[b];
        const float* ls = lss[b];
        const float* dl = dls[b];
        // S^T = K_w Q^T and dP^T = V_w dO^T: two 8-query slices a step.
        float st[NQ][4], dpt[NQ][4];
        fa_zero(st);
        fa_zero(dpt);
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            unsigned ka[4], va[4];
            cdt_ldsm_x4(ka, &ks[warp * 16 + lane % 16][kk * 16 + (lane / 16) * 8]);
            cdt_ldsm_x4(va, &vs[warp * 16 + lane % 16][kk * 16 + (lane / 16) * 8]);
#pragma unroll
            for (int nt = 0; nt < NQ; nt += 2) {
                const int r = nt * 8 + lane % 8 + (lane / 16) * 8;
                const int c = kk * 16 + ((lane / 8) % 2) * 8;
                unsigned qf[4], df[4];
                cdt_ldsm_x4(qf, &qt[r][c]);
                cdt_ldsm_x4(df, &dot[r][c]);
                cdt_mma_bf16_x2(st[nt], st[nt + 1], ka, qf);
                cdt_mma_bf16_x2(dpt[nt], dpt[nt + 1], va, df);
            }
        }
        // P^T and dS^T on the accumulators: row = key krow[h], column = query i0 + c.
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2, c = nt * 8 + 2 * t + e % 2;
                const long long i = i0 + c, j = krow[h];
                const bool vis = j < tk && i < tq && (!causal || j <= i + shift) &&
                                 ls[c] != CDT_NEG_INF;
                const float p = vis ? exp2f(st[nt][e] * sl2 - ls[c] * LOG2E) : 0.f;
                st[nt][e] = p;
                dpt[nt][e] = p * (dpt[nt][e] - dl[c]) * scale;
            }
        // dV += P^T dO and dK += dS^T Q, in one pass over the query steps (two calls of
        // fa_mma_acc_times_tile made ptxas spill at d = 64): 16 queries a step, dO and Q read
        // transposed.
#pragma unroll
        for (int kk = 0; kk < NQ / 2; ++kk) {
            unsigned pa[4], sa[4];
            cdt_acc_to_a(pa, st[2 * kk], st[2 * kk + 1]);
            cdt_acc_to_a(sa, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < NO; n += 2) {
                const int r = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
                const int c = n * 8 + (lane / 16) * 8;
                unsigned df[4], qf[4];
                cdt_ldsm_x4_t(df, &dot[r][c]);
                cdt_ldsm_x4_t(qf, &qt[r][c]);
                cdt_mma_bf16_x2(dva[n], dva[n + 1], pa, df);
                cdt_mma_bf16_x2(dka[n], dka[n + 1], sa, qf);
            }
        }
    }
    cdt_cp_async_wait<0>();  // K and V, when no query sees these keys: no copy outlives the block
    const float one[2] = {1.f, 1.f};
    fa_mma_write_rows<D>(dva, dkv + fa_head(ldv, bh), ldv.st, krow, one, tk, t);
    fa_mma_write_rows<D>(dka, dkv + fa_head(ldk, bh), ldk.st, krow, one, tk, t);
}

// dQ for the queries [blockIdx.x BM, +BM) of head blockIdx.y, on ldmatrix and mma.sync as the
// forward: BM = 16 FA_TC_BWD_WARPS, warp w owns queries [16 w, 16 w + 16), whose Q and dO rows it
// holds as A fragments, and their dQ accumulators. Key tiles of FA_TCQ_BN(D) rows stream
// through shared memory (K and V; the queries are staged through them first). Per tile, in
// registers: S = Q K^T and dP = dO V^T, P = exp(S scale - lse), dS = P (dP - delta) scale,
// rounded to bf16 as the A operand of dQ += dS K. K has two buffers, so that the next tile's K
// and V are copied (cp.async) while the warps compute this tile's dS and dQ += dS K.
#define FA_TCQ_BN(D) ((D) <= 64 ? 64 : 32)
template <int D>
__device__ void fa_bwd_dq_tc(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                             const bf16_t* __restrict__ v, const bf16_t* __restrict__ d_o,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             bf16_t* __restrict__ dq, const FaRows& lq, const FaRows& lk,
                             const FaRows& lv, const FaRows& ldo, const FaRows& ldq, int tq,
                             int tk, float scale, int causal) {
    constexpr int BM = 16 * FA_TC_BWD_WARPS;
    constexpr int BN = FA_TCQ_BN(D);
    constexpr int LD = D + FA_TC_PAD;
    constexpr int KS = D / 16, NS = BN / 8, NO = D / 8;
    static_assert(D % 16 == 0 && BN % 16 == 0, "16-wide matrix steps over D and the key tile");
    static_assert(BN <= BM && 2 * BN >= BM, "the two key buffers hold the staged queries");
    constexpr float LOG2E = 1.4426950408889634f;
    __shared__ __align__(128) bf16_t ks[2 * BN][LD];  // K of tile i in rows [(i % 2) BN, +BN)
    __shared__ __align__(128) bf16_t vs[BM][LD];
    const long long bh = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // Row and key indices in ints, as the forward's (tq, tk < 2^31).
    const int q0 = blockIdx.x * BM;
    const int shift = tk - tq;
    const bf16_t* kb = k + fa_head(lk, bh);
    const bf16_t* vb = v + fa_head(lv, bh);
    const int kst = (int)lk.st, vst = (int)lv.st;  // < FA_TC_MAX_LD
    fa_tc_load_rows<BM, D>(&ks[0][0], q + fa_head(lq, bh), (int)lq.st, q0, tq);
    fa_tc_load_rows<BM, D>(&vs[0][0], d_o + fa_head(ldo, bh), (int)ldo.st, q0, tq);
    fa_tc_tiles_landed();
    unsigned qa[KS][4], da[KS][4];
    fa_ldsm_rows<D>(qa, ks, warp * 16, lane);
    fa_ldsm_rows<D>(da, vs, warp * 16, lane);
    // Rows g and g + 8: lse (log2 domain) and delta; a row with lse -inf sees no key.
    const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float l2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l2[h] = row[h] < tq ? lse[bh * tq + row[h]] * LOG2E : CDT_NEG_INF;
        dl[h] = row[h] < tq ? delta[bh * tq + row[h]] : 0.f;
    }
    const float sl2 = scale * LOG2E;
    float acc[NO][4];
    fa_zero(acc);
    const int kend = (int)fa_key_end(q0, tq, tk, causal, BM);
    __syncthreads();  // every warp holds its queries: the tiles are free
    if (kend > 0) {
        fa_tc_load_rows<BN, D>(&ks[0][0], kb, kst, 0, tk);
        fa_tc_load_rows<BN, D>(&vs[0][0], vb, vst, 0, tk);
    }
    int buf = 0;  // which K buffer holds this tile
    for (int j0 = 0; j0 < kend; j0 += BN, buf ^= 1) {
        // This tile's K and V; every warp is done with the previous tile, so with the other
        // K buffer.
        fa_tc_tiles_landed();
        const bf16_t(*kt)[LD] = ks + buf * BN;
        // S = Q K^T and dP = dO V^T.
        float s[NS][4], dp[NS][4];
        fa_zero(s);
        fa_zero(dp);
        fa_mma_rows_dot_tile<D, NS>(dp, da, vs, lane);
        fa_mma_rows_dot_tile<D, NS>(s, qa, kt, lane);
        __syncthreads();  // every warp is done with V
        if (j0 + BN < kend) {
            fa_tc_load_rows<BN, D>(&ks[(buf ^ 1) * BN][0], kb, kst, j0 + BN, tk);
            fa_tc_load_rows<BN, D>(&vs[0][0], vb, vst, j0 + BN, tk);
        }
        // dS = P (dP - delta) scale, P = exp2(s scale log2 e - lse log2 e), masked.
#pragma unroll
        for (int nt = 0; nt < NS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2;
                const int j = j0 + nt * 8 + 2 * t + e % 2;
                const bool vis = row[h] < tq && j < tk && (!causal || j <= row[h] + shift) &&
                                 l2[h] != CDT_NEG_INF;
                const float p = vis ? exp2f(s[nt][e] * sl2 - l2[h]) : 0.f;
                s[nt][e] = p * (dp[nt][e] - dl[h]) * scale;
            }
        // dQ += dS K.
        fa_mma_acc_times_tile<D, NS>(acc, s, kt, lane);
    }
    const float one[2] = {1.f, 1.f};
    fa_mma_write_rows<D>(acc, dq + fa_head(ldq, bh), ldq.st, row, one, tq, t);
}

// cdt_fa_fwd_tc_bf16_d{D}, cdt_fa_bwd_dkv_tc_bf16_d{D}, cdt_fa_bwd_dq_tc_bf16_d{D}: the same
// arguments as their SIMT namesakes. Launch: grid (ceil(rows / (16 w)), BH) with rows tq (fwd,
// dq) or tk (dkv), block 32 w threads; w = FA_TC_FWD_WARPS for the forward, FA_TC_BWD_WARPS for
// the backward kernels.
#define FA_TC(D)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * FA_TC_FWD_WARPS, FA_TC_FWD_BLOCKS(D))    \
        cdt_fa_fwd_tc_bf16_d##D(const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* o, \
                                float* lse, FaRows lq, FaRows lk, FaRows lv, FaRows lo,       \
                                int tq, int tk, float scale, int causal) {                    \
        fa_fwd_tc<D>(q, k, v, o, lse, lq, lk, lv, lo, tq, tk, scale, causal);                 \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * FA_TC_BWD_WARPS)                        \
        cdt_fa_bwd_dkv_tc_bf16_d##D(const bf16_t* q, const bf16_t* k, const bf16_t* v,        \
                                    const bf16_t* d_o, const float* lse, const float* delta,  \
                                    bf16_t* dkv, FaRows lq, FaRows lk, FaRows lv, FaRows ldo, \
                                    FaRows ldk, FaRows ldv, int tq, int tk, float scale,      \
                                    int causal) {                                             \
        fa_bwd_dkv_tc<D>(q, k, v, d_o, lse, delta, dkv, lq, lk, lv, ldo, ldk, ldv, tq, tk,     \
                         scale, causal);                                                      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * FA_TC_BWD_WARPS)                        \
        cdt_fa_bwd_dq_tc_bf16_d##D(const bf16_t* q, const bf16_t* k, const bf16_t* v,         \
                                   const bf16_t* d_o, const float* lse, const float* delta,   \
                                   bf16_t* dq, FaRows lq, FaRows lk, FaRows lv, FaRows ldo,   \
                                   FaRows ldq, int tq, int tk, float scale, int causal) {     \
        fa_bwd_dq_tc<D>(q, k, v, d_o, lse, delta, dq, lq, lk, lv, ldo, ldq, tq, tk, scale,     \
                        causal);                                                              \
    }
FA_TC(32)
FA_TC(48)
FA_TC(64)
FA_TC(96)
FA_TC(128)
#endif
