// The emulator's <mma.h>: the PTX warp-level matrix instructions the tensor-core kernels use
// through `crates/kernels/cuda/mma_sync.cuh` (ldmatrix m8n8 x4 b16, optionally transposed, and
// mma.sync.m16n8k16 with bf16 operands and f32 accumulators), with the register layouts of the
// PTX ISA. g = lane / 4, t = lane % 4:
//
// - ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8 x 8 matrix i (16 bytes each,
//   16-byte aligned); register i of lane l receives row g of matrix i, elements 2t and 2t + 1
//   (the lower one in the low half), or with .trans column g, elements (rows) 2t and 2t + 1.
// - mma.sync.m16n8k16.row.col: A (16 x 16) in a[0..4]: (g, 2t..2t+1), (g + 8, 2t..),
//   (g, 2t + 8..), (g + 8, 2t + 8..); B (16 x 8) in b[0..2]: (k 2t..2t+1, n g), (k 2t + 8.., n g);
//   C and D (16 x 8) in c[0..4]: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1). The A, B
//   and C layouts are also what nvcc 13 compiles `nvcuda::wmma` bf16 fragments to on sm_90
//   (read from `cuobjdump -sass`: the 32-bit loads of each register and the HMMA.16816 operands).
//
// Each is warp-collective: every lane enters a warp barrier, so a call some lanes skip is a
// deadlock, as on a GPU; the operands of all lanes are gathered through the warp's exchange
// slots. Both are `.aligned`: the lanes must execute the same instruction together, so their
// barriers (`warp_barrier_aligned`) fail the launch when lanes of one warp arrive from
// different places (call chains), e.g. an mma in each branch of a lane-dependent `if`. An ldmatrix row address that is not 16-byte aligned faults (the launch fails).
// mma.sync accumulates in f32, k in ascending order with separately rounded multiplies and
// adds (tensor cores use their own order and internal precision: tolerances cover it).
//
// ldmatrix also counts the shared-memory bank wavefronts the GPU would spend on it
// (`emu::bank_stats`, a performance model, not semantics): each 8 x 8 matrix is one request of
// 8 rows of 16 bytes, and takes as many wavefronts as the most distinct 4-byte words any of the
// 32 banks is asked for.
#pragma once

#include "cuda_emu.h"

namespace emu {
// The ldmatrix requests run on this OS thread and their wavefronts (one count per warp
// instruction).
struct BankStats {
    uint64_t requests = 0, wavefronts = 0;
};
inline thread_local BankStats bank_stats;

namespace bank {
// Wavefronts of one request: the word addresses `words[0..n)` (byte address / 4), the most
// distinct ones any bank is asked for.
inline uint64_t wavefronts(const uint64_t* words, int n) {
    uint64_t most = 0;
    for (int b = 0; b < 32; ++b) {
        uint64_t seen[64];
        int k = 0;
        for (int i = 0; i < n; ++i) {
            if (words[i] % 32 != static_cast<uint64_t>(b)) continue;
            bool dup = false;
            for (int j = 0; j < k; ++j) dup = dup || seen[j] == words[i];
            if (!dup) seen[k++] = words[i];
        }
        if (static_cast<uint64_t>(k) > most) most = k;
    }
    return most;
}
}  // namespace bank
}  // namespace emu

namespace emu {
namespace detail_mma {
// Every lane's `N` 32-bit words, gathered: all[lane * N + i]. Two words a round through the
// 8-byte slots.
template <int N>
inline void gather(const uint32_t (&mine)[N], uint32_t (&all)[32 * N]) {
    static_assert(N % 2 == 0, "words go two a slot");
    uint64_t* slots = warp_slots();
    const unsigned lane = lane_id(), n = warp_lane_count();
    if (n != 32) fault("a warp matrix instruction in a warp of " + std::to_string(n) + " threads");
    for (int i = 0; i < N; i += 2) {
        slots[lane] = static_cast<uint64_t>(mine[i]) | (static_cast<uint64_t>(mine[i + 1]) << 32);
        warp_barrier_aligned();
        for (unsigned l = 0; l < 32; ++l) {
            all[l * N + i] = static_cast<uint32_t>(slots[l]);
            all[l * N + i + 1] = static_cast<uint32_t>(slots[l] >> 32);
        }
        warp_barrier_aligned();
    }
}
inline float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
inline float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
}  // namespace detail_mma

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
        fault("ldmatrix: a row address not 16-byte aligned");
    uint64_t* slots = warp_slots();
    const unsigned lane = lane_id();
    if (warp_lane_count() != 32) fault("ldmatrix in a warp that is not whole");
    slots[lane] = reinterpret_cast<uintptr_t>(row);
    warp_barrier_aligned();
    if (lane == 0) {
        for (int m = 0; m < 4; ++m) {
            uint64_t words[32];
            for (int i = 0; i < 32; ++i) words[i] = (slots[8 * m + i / 4] + 4 * (i % 4)) / 4;
            bank_stats.requests += 1;
            bank_stats.wavefronts += bank::wavefronts(words, 32);
        }
    }
    const unsigned g = lane / 4, t = lane % 4;
    for (int m = 0; m < 4; ++m) {
        uint16_t e[2];
        for (int h = 0; h < 2; ++h) {
            const uint16_t* p = trans
                ? reinterpret_cast<const uint16_t*>(slots[8 * m + 2 * t + h]) + g
                : reinterpret_cast<const uint16_t*>(slots[8 * m + g]) + 2 * t + h;
            e[h] = *p;
        }
        r[m] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
    }
    warp_barrier_aligned();
}

// d = a b + c (f32, k ascending, each product and sum rounded: the tolerances cover the
// tensor cores' own order and precision).
inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                           const float (&c)[4]) {
    uint32_t ab[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    uint32_t all[32 * 6];
    detail_mma::gather<6>(ab, all);
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, t = l % 4;
        const uint32_t* w = &all[l * 6];
        for (int i = 0; i < 4; ++i) {
            const unsigned row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
            A[row][col] = detail_mma::bf16_lo(w[i]);
            A[row][col + 1] = detail_mma::bf16_hi(w[i]);
        }
        for (int i = 0; i < 2; ++i) {
            const unsigned k = 2 * t + 8 * i;
            B[k][g] = detail_mma::bf16_lo(w[4 + i]);
            B[k + 1][g] = detail_mma::bf16_hi(w[4 + i]);
        }
    }
    const unsigned g = lane_id() / 4, t = lane_id() % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float acc = c[i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        out[i] = acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}
}  // namespace emu
