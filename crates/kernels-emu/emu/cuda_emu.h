// A CPU emulator of the CUDA execution model, for testing the logic of this project's CUDA C
// kernels (crates/kernels/cuda/*.cu) on machines without a GPU (CI has none).
//
// The kernel sources are compiled unchanged as C++ with this header force-included
// (`-include cuda_emu.h -DCDT_EMU`). A launch runs the grid's blocks one after another; the
// threads of a block are cooperative fibers (ucontext) on one OS thread, switched only at the
// synchronisation points (`__syncthreads`, `__syncwarp`, the warp shuffles). So:
//
// - `__shared__` (a `static thread_local` local here) is one array per kernel and OS thread,
//   shared by the running block's threads, as on a GPU; blocks never overlap. Launches on
//   different OS threads (parallel tests) are independent. Dynamic shared memory (`CDT_DYN_SHARED`) is
//   filled with 0xFF bytes (a float NaN) before every block, so reading it uninitialised shows.
//   So is static shared memory: the build compiles each kernel source with a call to
//   `emu::fresh_shared` after every `__shared__` declaration (build.rs), which fills the
//   array with 0xFF bytes the first time a thread of the block passes it. Without that a read
//   before the block's first write would see the previous block's (or launch's) values, which
//   on a GPU are another block's garbage.
// - A barrier that some live threads of the block (or warp) never reach is a deadlock on a GPU;
//   here the scheduler finds that no thread can run and the launch fails, naming the kernel,
//   block and waiting threads (`emu::LaunchError`).
// - The fibers of a block run in an order chosen per launch (`emu::Order`): forward, reverse or
//   a seeded shuffle between each pair of barriers, and the warps run one at a time (lowest or
//   highest first) or in random subsets, a warp going on through its warp syncs while others
//   wait, so warps drift apart between __syncthreads as they may on a GPU. A kernel that reads shared memory another thread
//   writes without a barrier in between gives different results under different orders; tests
//   run each kernel under several orders and compare the outputs bit for bit.
// - Warp shuffles exchange through a per-warp slot array between two warp barriers.
//   Reading a lane no thread runs (a partial last warp) is undefined on a GPU and fails the launch,
//   as does a shuffle or __syncthreads some threads of the warp / block exited before.
// - Atomics are plain read-modify-writes: only one fiber runs at a time.
// - cp.async (sm_80's asynchronous copy from global to shared memory, `emu::cp_async` and its
//   commit and wait): the source is read at issue, the destination filled with 0xFF bytes (a
//   bf16 or f32 NaN) at issue and written when the issuing thread waits for the copy's group
//   (`cp_async_wait`). A GPU writes it at some moment in between, so a kernel that reads the
//   tile before waiting and a barrier, or issues a copy into a tile other warps still read,
//   reads NaN here. A thread that exits with copies it never waited for fails the launch.
//
// Not emulated: timing, memory coalescing, bank conflicts (but `mma.h` counts those of
// ldmatrix, a performance model), the memory model beyond barriers (every fiber sees every
// write at once), inline PTX (a kernel wraps the instructions it uses and the emulator
// provides them: `mma.h` has ldmatrix and mma.sync, and this header cp.async, for
// `mma_sync.cuh`), cooperative groups,
// `nvcuda::wmma`.
// Device pointers are host pointers.

#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __constant__ static const
#define __align__(n) __attribute__((aligned(n)))

// Dynamic shared memory: `CDT_DYN_SHARED(float, buf);` declares `buf` as the launch's dynamic
// shared memory (an `extern __shared__` array on a GPU).
#define CDT_DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(::emu::dyn_shared())

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

extern thread_local dim3 threadIdx;
extern thread_local dim3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

namespace emu {

// How the fibers of a block take turns between barriers.
enum class Order : int { Forward = 0, Reverse = 1, Shuffled = 2 };

// Why a launch failed; `message` names the kernel, the block and the threads.
struct LaunchError {
    std::string message;
};

void* dyn_shared();
// A static `__shared__` array of `bytes` at `p`, reached by a thread of the running block: the
// first call of the block fills it with 0xFF bytes (see the header's notes).
void fresh_shared(void* p, size_t bytes);
// cp.async.{ca,cg}.shared.global [dst], [src], cp_size, src_size: `cp_size` bytes (4, 8 or 16,
// both addresses aligned to it), the first `src_size` from `src`, the rest zeros.
void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size);
// cp.async.commit_group: the calling thread's copies since the last commit become a group.
void cp_async_commit();
// cp.async.wait_group `pending`: the calling thread's groups but the newest `pending` land.
void cp_async_wait(unsigned pending);
void block_barrier();
// __syncthreads_or: a block barrier that also returns whether any thread passed a non-zero
// predicate.
int block_barrier_or(int predicate);
void warp_barrier();
// The warp barrier of a `.aligned` warp instruction (mma.sync, ldmatrix): every lane of the
// warp must reach it from the same place, as the GPU requires all of them to execute that
// one instruction together. Records the calling lane's place (the return addresses of its
// call chain, which the build keeps with -fno-omit-frame-pointer); the scheduler fails the
// launch when lanes meet there from different places.
void warp_barrier_aligned();
// Exchange slot of the calling lane, in its warp's 32 slots (8 bytes each).
uint64_t* warp_slots();
unsigned lane_id();
unsigned warp_lane_count();
// Records a fault of the running thread (the first one wins); the launch then fails with it.
void fault(const std::string& what);

// Runs `body` as the threads of `grid x block`, `shared_bytes` of dynamic shared memory per
// block, fibers ordered by `order` (`seed` for Shuffled). Throws LaunchError on a deadlock.
void launch(const char* name, dim3 grid, dim3 block, size_t shared_bytes, Order order,
            uint64_t seed, const std::function<void()>& body);

template <class T>
inline T shfl_from(T v, int src, bool valid) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t* slots = warp_slots();
    unsigned lane = lane_id();
    std::memcpy(&slots[lane], &v, sizeof(T));
    warp_barrier();
    T r = v;
    if (valid && src >= 0) {
        if (static_cast<unsigned>(src) < warp_lane_count()) {
            std::memcpy(&r, &slots[src], sizeof(T));
        } else {
            // A lane of the warp's segment that no thread runs: undefined on a GPU.
            fault("a warp shuffle reads lane " + std::to_string(src) + " of a warp of " +
                  std::to_string(warp_lane_count()) + " threads (undefined on a GPU)");
        }
    }
    warp_barrier();
    return r;
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier(); }
inline int __syncthreads_or(int predicate) { return emu::block_barrier_or(predicate); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    int lane = static_cast<int>(emu::lane_id());
    int src = lane ^ lane_mask;
    bool valid = (src / width) == (lane / width);
    return emu::shfl_from(v, src, valid);
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    int lane = static_cast<int>(emu::lane_id());
    int src = lane + static_cast<int>(delta);
    bool valid = (src / width) == (lane / width);
    return emu::shfl_from(v, src, valid);
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    int lane = static_cast<int>(emu::lane_id());
    int src = lane - static_cast<int>(delta);
    bool valid = src >= 0 && (src / width) == (lane / width);
    return emu::shfl_from(v, src, valid);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    int lane = static_cast<int>(emu::lane_id());
    int src = (lane / width) * width + (src_lane % width);
    return emu::shfl_from(v, src, true);
}

// Bit l of the result is set where lane l of the warp passed a non-zero predicate, exchanged
// through the warp's slots as a shuffle is (so every lane must reach it, and lanes meet there
// before any reads the votes). Lanes past a partial last warp vote no. Only the full mask is
// emulated: a partial one (lanes outside it need not arrive on a GPU) fails the launch.
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    if (mask != 0xffffffffu) {
        emu::fault("__ballot_sync with a mask other than 0xffffffff (not emulated)");
    }
    uint64_t* slots = emu::warp_slots();
    slots[emu::lane_id()] = predicate != 0 ? 1 : 0;
    emu::warp_barrier();
    unsigned r = 0;
    for (unsigned l = 0; l < emu::warp_lane_count(); ++l) {
        r |= static_cast<unsigned>(slots[l] != 0) << l;
    }
    emu::warp_barrier();
    return r;
}
// 1 + the index of the lowest set bit, 0 for 0.
inline int __ffs(int x) { return __builtin_ffs(x); }

// Math: the device intrinsics as their exact host equivalents.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __tanhf(float x) { return std::tanh(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
// The round-to-nearest intrinsics: one IEEE operation each (the build passes
// -ffp-contract=off, so no multiply-add is fused across them, as on the GPU).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
using std::max;
using std::min;
inline int max(int a, unsigned b) { return a > static_cast<int>(b) ? a : static_cast<int>(b); }
inline int min(int a, unsigned b) { return a < static_cast<int>(b) ? a : static_cast<int>(b); }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }

#ifndef CUDART_INF_F
#define CUDART_INF_F INFINITY
#endif

// Atomics (one fiber runs at a time, so a read-modify-write is atomic).
template <class T>
inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
inline float atomicMax(float* p, float v) { float old = *p; *p = std::fmax(old, v); return old; }
template <class T>
inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T>
inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T>
inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T>
inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
inline void __threadfence() {}
inline void __threadfence_block() {}

// The 16-byte vector type (`uint4`), aligned as on the device.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// bf16 and f16 storage types with round-to-nearest-even conversions (as cuda_bf16.h /
// cuda_fp16.h do on the device).
struct __nv_bfloat16 {
    uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = static_cast<uint32_t>(h.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    __nv_bfloat16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.x = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    } else {
        uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
        h.x = static_cast<uint16_t>((u + rounding) >> 16);
    }
    return h;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
