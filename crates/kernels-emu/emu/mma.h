// The emulator's <mma.h>: CUDA's warp matrix functions (`nvcuda::wmma`) for the shapes and
// types the kernels use (m16n16k16, bf16 operands, f32 accumulator), with the semantics the
// CUDA programming guide gives them and nothing more:
//
// - Every operation is warp-collective: each emulated lane enters a warp barrier first, so a
//   call some lanes of the warp skip is a deadlock, as on a GPU.
// - A fragment's contents are opaque. Each lane here holds the whole tile (computing the same
//   product redundantly), and fragments expose no element access (`x[]`), so a kernel that
//   assumes a lane-to-element mapping does not compile.
// - `store_matrix_sync` writes each element from one lane only (element e from lane e % 32),
//   so a lane that reads another lane's element of a stored tile without a `__syncwarp()` in
//   between reads stale memory under some fiber orders, and the tests' bit-for-bit comparison
//   of orders shows it.
// - `mma_sync` accumulates in f32, k in ascending order with separately rounded multiplies and
//   adds (tensor cores use their own order and internal precision: tolerances cover it).
// - Loads and stores fault (the launch fails) on what the guide leaves undefined: an address
//   not 256-bit aligned, a leading dimension not a multiple of 16 bytes.
// - Loads and stores count the shared-memory bank wavefronts the GPU would spend on them
//   (`emu::bank_stats`): not semantics, a performance model, taken from the SASS nvcc 13
//   emits for sm_80/sm_90 (`cuobjdump -sass`): a 16-bit operand tile is four 32-bit loads per
//   lane in the mma.m16n8k16 fragment layout (lane l reads word l % 4 of line l / 4 of an
//   8 x 8 block; a line is a row of a row-major source, a column of a column-major one), an
//   f32 accumulator tile four 64-bit accesses per lane (lane l: row l / 4 (+8), columns
//   2 (l % 4) and the next (+8)). A request takes as many wavefronts as the most distinct
//   words any of the 32 banks is asked for (a 64-bit request: per half-warp). Every wmma
//   load and store is counted as a shared-memory access (the kernels use them on shared
//   tiles only).
#pragma once

#include <type_traits>

#include "cuda_emu.h"

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

}  // namespace wmma
}  // namespace nvcuda

namespace emu {
// Shared-memory wavefronts of the warp matrix loads and stores run on this OS thread (one
// count per warp operation), against the fewest the same requests could take.
struct BankStats {
    uint64_t operand_requests = 0, operand_wavefronts = 0;
    uint64_t accumulator_requests = 0, accumulator_wavefronts = 0;
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

// A 16-bit operand tile: 16 lines of 16 elements, line i at `base + i * line_bytes`.
inline void operand(const void* base, size_t line_bytes) {
    if (lane_id() != 0) return;  // once per warp operation
    const uintptr_t p = reinterpret_cast<uintptr_t>(base);
    for (int block = 0; block < 4; ++block) {
        const int l0 = (block % 2) * 8, c0 = (block / 2) * 16;  // byte offset in the line
        uint64_t words[32];
        for (int lane = 0; lane < 32; ++lane)
            words[lane] = (p + (l0 + lane / 4) * line_bytes + c0 + 4 * (lane % 4)) / 4;
        bank_stats.operand_requests += 1;
        bank_stats.operand_wavefronts += wavefronts(words, 32);
    }
}

// An f32 accumulator tile, element (r, c) at `base + r * rs + c * cs` bytes.
inline void accumulator(const void* base, size_t rs, size_t cs) {
    if (lane_id() != 0) return;
    const uintptr_t p = reinterpret_cast<uintptr_t>(base);
    for (int part = 0; part < 4; ++part) {
        const int r0 = (part % 2) * 8, c0 = (part / 2) * 8;
        uint64_t total = 0;
        for (int half = 0; half < 2; ++half) {
            uint64_t words[32];
            int n = 0;
            for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
                const size_t r = r0 + lane / 4, c = c0 + 2 * (lane % 4);
                words[n++] = (p + r * rs + c * cs) / 4;
                words[n++] = (p + r * rs + (c + 1) * cs) / 4;
            }
            total += wavefronts(words, n);
        }
        bank_stats.accumulator_requests += 1;
        bank_stats.accumulator_wavefronts += total;
    }
}
}  // namespace bank
}  // namespace emu

namespace nvcuda {
namespace wmma {

namespace detail {
// The guide's requirements on a load's or store's memory: 256-bit aligned, ldm a multiple of
// 8 elements for 16-bit types and of 4 for 32-bit ones.
template <class T>
inline void check_memory(const char* op, const T* p, unsigned ldm) {
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
        emu::fault(std::string("wmma::") + op + ": address not 256-bit aligned");
    if ((ldm * sizeof(T)) % 16 != 0)
        emu::fault(std::string("wmma::") + op + ": ldm " + std::to_string(ldm) +
                   " is not a multiple of 16 bytes");
}
inline float to_float(float v) { return v; }
inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment;

// matrix_a: M x K; matrix_b: K x N; accumulator: M x N (all 16 x 16 here). `tile` is
// row-major in every case; an operand says whether memory holds it column-major.
template <class Use, class T, class Layout>
struct fragment<Use, 16, 16, 16, T, Layout> {
    static_assert(std::is_same<Use, matrix_a>::value || std::is_same<Use, matrix_b>::value,
                  "an operand fragment is matrix_a or matrix_b");
    static constexpr int rows = 16, cols = 16;
    static constexpr bool col_major_src = std::is_same<Layout, col_major>::value;
    float tile[16 * 16];
};
template <class T>
struct fragment<accumulator, 16, 16, 16, T, void> {
    static constexpr int rows = 16, cols = 16;
    float tile[16 * 16];
};

template <class Frag>
inline void fill_fragment(Frag& f, float v) {
    emu::warp_barrier();
    for (float& e : f.tile) e = v;
}

// A or B operand: (r, c) of the tile at p[r * ldm + c] (row-major) or p[c * ldm + r].
template <class Frag, class T>
inline void load_matrix_sync(Frag& f, const T* p, unsigned ldm) {
    detail::check_memory("load_matrix_sync", p, ldm);
    emu::warp_barrier();
    emu::bank::operand(p, static_cast<size_t>(ldm) * sizeof(T));
    for (int r = 0; r < Frag::rows; ++r)
        for (int c = 0; c < Frag::cols; ++c)
            f.tile[r * Frag::cols + c] = detail::to_float(
                Frag::col_major_src ? p[(size_t)c * ldm + r] : p[(size_t)r * ldm + c]);
}

// The accumulator, from f32 memory in the layout given.
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
    detail::check_memory("load_matrix_sync", p, ldm);
    emu::warp_barrier();
    emu::bank::accumulator(p, layout == mem_row_major ? ldm * 4 : 4,
                           layout == mem_row_major ? 4 : ldm * 4);
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
            f.tile[r * 16 + c] =
                layout == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
    detail::check_memory("store_matrix_sync", p, ldm);
    emu::warp_barrier();
    emu::bank::accumulator(p, layout == mem_row_major ? ldm * 4 : 4,
                           layout == mem_row_major ? 4 : ldm * 4);
    const unsigned lane = emu::lane_id();
    for (int e = static_cast<int>(lane); e < 256; e += 32) {
        const int r = e / 16, c = e % 16;
        float* dst = layout == mem_row_major ? &p[(size_t)r * ldm + c] : &p[(size_t)c * ldm + r];
        *dst = f.tile[e];
    }
}

template <class A, class B>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const A& a, const B& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    emu::warp_barrier();
    float out[256];
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            float acc = c.tile[m * 16 + n];
            for (int k = 0; k < 16; ++k) acc += a.tile[m * 16 + k] * b.tile[k * 16 + n];
            out[m * 16 + n] = acc;
        }
    for (int i = 0; i < 256; ++i) d.tile[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda

// The PTX warp-level matrix instructions the kernels use through `mma_sync.cuh`: ldmatrix
// (m8n8, x4, b16, optionally transposed) and mma.sync.m16n8k16 (bf16 operands, f32
// accumulators), with the register layouts of the PTX ISA. g = lane / 4, t = lane % 4:
//
// - ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8 x 8 matrix i (16 bytes each,
//   16-byte aligned); register i of lane l receives row g of matrix i, elements 2t and 2t + 1
//   (the lower one in the low half), or with .trans column g, elements (rows) 2t and 2t + 1.
// - mma.sync.m16n8k16.row.col: A (16 x 16) in a[0..4]: (g, 2t..2t+1), (g + 8, 2t..),
//   (g, 2t + 8..), (g + 8, 2t + 8..); B (16 x 8) in b[0..2]: (k 2t..2t+1, n g), (k 2t + 8.., n g);
//   C and D (16 x 8) in c[0..4]: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
//
// Each is warp-collective (every lane enters a warp barrier; one skipped is a deadlock), the
// operands of all lanes gathered through the warp's exchange slots. An ldmatrix row address
// that is not 16-byte aligned faults. ldmatrix counts its bank wavefronts like a wmma load
// (one request per 8 x 8 matrix: 8 rows of 16 bytes).
namespace emu {
namespace detail_mma {
// Every lane's `n` 32-bit words, gathered: all[lane * n + i].
template <int N>
inline void gather(const uint32_t (&mine)[N], uint32_t (&all)[32 * N]) {
    uint64_t* slots = warp_slots();
    const unsigned lane = lane_id(), n = warp_lane_count();
    if (n != 32) fault("a warp matrix instruction in a warp of " + std::to_string(n) + " threads");
    for (int i = 0; i < N; ++i) {
        slots[lane] = mine[i];
        warp_barrier();
        for (unsigned l = 0; l < 32; ++l) all[l * N + i] = static_cast<uint32_t>(slots[l]);
        warp_barrier();
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
    warp_barrier();
    if (lane == 0) {
        for (int m = 0; m < 4; ++m) {
            uint64_t words[32];
            for (int i = 0; i < 32; ++i) words[i] = (slots[8 * m + i / 4] + 4 * (i % 4)) / 4;
            bank_stats.operand_requests += 1;
            bank_stats.operand_wavefronts += bank::wavefronts(words, 32);
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
    warp_barrier();
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
