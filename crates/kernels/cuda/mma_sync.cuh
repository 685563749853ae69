// The PTX instructions the tensor-core attention uses: warp-level matrix products, with the
// register layouts the PTX ISA documents (unlike `nvcuda::wmma` fragments, whose element
// layout is opaque): g = lane / 4, t = lane % 4.
//
// - cdt_ldsm_x4(r, row): ldmatrix.sync.aligned.m8n8.x4.shared.b16. Lanes 8i..8i+7 pass the
//   row addresses (16 bytes each, 16-byte aligned, in shared memory) of 8 x 8 matrix i; r[i]
//   of lane l gets row g of matrix i, elements 2t and 2t + 1 (the lower in the low half).
//   cdt_ldsm_x4_t: the same with .trans, r[i] = column g, elements (rows) 2t and 2t + 1.
// - cdt_mma_bf16(d, a, b): mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b.
//   A (16 x 16): a[0] = (g, 2t..2t+1), a[1] = (g + 8, 2t..), a[2] = (g, 2t + 8..),
//   a[3] = (g + 8, 2t + 8..); B (16 x 8): b[0] = (k 2t..2t+1, n g), b[1] = (k 2t + 8.., n g);
//   D (16 x 8): d[0] = (g, 2t), d[1] = (g, 2t + 1), d[2] = (g + 8, 2t), d[3] = (g + 8, 2t + 1).
//
// - cdt_cp_async_16(dst, src, fill): cp.async.cg.shared.global, 16 bytes from global `src` to
//   shared `dst` (both 16-byte aligned) without passing through registers, or 16 zero bytes
//   when `fill` is false (src-size 0: `src` is not read). cdt_cp_async_commit() closes the
//   thread's copies since the last commit into a group; cdt_cp_async_wait<N>() returns once
//   all but the newest N of the thread's groups landed. Other threads see a copy only after
//   its issuer waited and a barrier. cdt_cp_async_4: the same for 4 bytes
//   (cp.async.ca, 4-byte aligned).
//
// Under the emulator (CDT_EMU) they are `emu::ldmatrix_x4` and `emu::mma_bf16_16816`
// (emu/mma.h), which implement those layouts on whole warps, and `emu::cp_async*`
// (cuda_emu.h), whose destination reads as NaN until the issuer waits.
#pragma once
#include "common.cuh"

#if defined(CDT_EMU)
#include <mma.h>
__device__ __forceinline__ void cdt_ldsm_x4(unsigned (&r)[4], const bf16_t* row) {
    emu::ldmatrix_x4(r, row, false);
}
__device__ __forceinline__ void cdt_ldsm_x4_t(unsigned (&r)[4], const bf16_t* row) {
    emu::ldmatrix_x4(r, row, true);
}
__device__ __forceinline__ void cdt_mma_bf16(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]) {
    emu::mma_bf16_16816(d, a, b, d);
}
#else
__device__ __forceinline__ void cdt_ldsm_x4(unsigned (&r)[4], const bf16_t* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void cdt_ldsm_x4_t(unsigned (&r)[4], const bf16_t* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void cdt_mma_bf16(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

#if defined(CDT_EMU)
__device__ __forceinline__ void cdt_cp_async_16(void* dst, const void* src, bool fill) {
    emu::cp_async(dst, src, 16, fill ? 16 : 0);
}
__device__ __forceinline__ void cdt_cp_async_4(void* dst, const void* src, bool fill) {
    emu::cp_async(dst, src, 4, fill ? 4 : 0);
}
__device__ __forceinline__ void cdt_cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cdt_cp_async_wait() {
    emu::cp_async_wait(N);
}
#else
__device__ __forceinline__ void cdt_cp_async_16(void* dst, const void* src, bool fill) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(addr), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cdt_cp_async_4(void* dst, const void* src, bool fill) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :
                 : "r"(addr), "l"(src), "r"(fill ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cdt_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cdt_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// Two floats as the bf16 pair of one register (`lo` in the low half).
__device__ __forceinline__ unsigned cdt_pack_bf16(float lo, float hi) {
    return (unsigned)from_f32<bf16_t>(lo) | ((unsigned)from_f32<bf16_t>(hi) << 16);
}

// d0 += a b[0..2] and d1 += a b[2..4]: two 8-column slices whose B fragments one ldmatrix.x4
// loaded (registers 0-1 the first slice's, 2-3 the second's).
__device__ __forceinline__ void cdt_mma_bf16_x2(float (&d0)[4], float (&d1)[4],
                                                const unsigned (&a)[4], const unsigned (&b)[4]) {
    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    cdt_mma_bf16(d0, a, b0);
    cdt_mma_bf16(d1, a, b1);
}

// The A operand (16 x 16, rounded to bf16) of two adjacent 8-column accumulator slices `lo` and
// `hi`: the C layout of their 16 columns is the A layout, register by register.
__device__ __forceinline__ void cdt_acc_to_a(unsigned (&a)[4], const float (&lo)[4],
                                             const float (&hi)[4]) {
    a[0] = cdt_pack_bf16(lo[0], lo[1]);
    a[1] = cdt_pack_bf16(lo[2], lo[3]);
    a[2] = cdt_pack_bf16(hi[0], hi[1]);
    a[3] = cdt_pack_bf16(hi[2], hi[3]);
}
