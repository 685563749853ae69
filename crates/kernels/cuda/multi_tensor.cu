// Multi-tensor reductions: the global L2 norm of many gradients in two launches, with no host
// read (the clip coefficient is computed on the device). The tensors are given as a table of
// device pointers and the prefix sums of their element counts (their virtual concatenation);
// block b of stage 1 sums the squares of elements [b * chunk, (b + 1) * chunk) of it, walking
// across tensor boundaries; stage 2 (one block) adds the partials in a fixed order:
// deterministic, no atomics.
#include "common.cuh"

// starts[k + 1]: starts[i] is the first global element of tensor i, starts[k] the total.
template <typename T>
__device__ void sumsq_partial(const unsigned long long* __restrict__ ptrs,
                              const long long* __restrict__ starts, int k, long long chunk,
                              float* __restrict__ partial) {
    __shared__ float buf[32];
    const long long total = starts[k];
    const long long c0 = (long long)blockIdx.x * chunk;
    const long long c1 = c0 + chunk < total ? c0 + chunk : total;
    // The tensor holding c0: the last i with starts[i] <= c0 (binary search; empty tensors
    // have starts[i] == starts[i + 1] and are skipped by the walk).
    int lo = 0, hi = k;  // invariant: starts[lo] <= c0 < starts[hi] (c0 < total)
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= c0) lo = mid; else hi = mid;
    }
    float acc = 0.f;
    for (int t = lo; t < k && starts[t] < c1; ++t) {
        const T* p = (const T*)ptrs[t];
        const long long a = (c0 > starts[t] ? c0 : starts[t]) - starts[t];
        const long long b = (c1 < starts[t + 1] ? c1 : starts[t + 1]) - starts[t];
        for (long long i = a + threadIdx.x; i < b; i += blockDim.x) {
            const float v = to_f32(p[i]);
            acc += v * v;
        }
    }
    acc = block_sum(acc, buf);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out[0] = sqrt(sum of partials), out[1] = the clip coefficient min(1, max_norm / (norm +
// 1e-6)) (1 when max_norm <= 0: no clipping). One block; partials added in a fixed order.
extern "C" __global__ void CDT_ROW_BOUNDS cdt_norm_finish(const float* __restrict__ partial,
                                                          int blocks, float max_norm,
                                                          float* __restrict__ out) {
    __shared__ float buf[32];
    float acc = 0.f;
    for (int i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
    acc = block_sum(acc, buf);
    if (threadIdx.x == 0) {
        const float norm = sqrtf(acc);
        out[0] = norm;
        out[1] = max_norm > 0.f ? fminf(1.f, max_norm / (norm + 1e-6f)) : 1.f;
    }
}

extern "C" __global__ void CDT_ROW_BOUNDS cdt_sumsq_partial_f32(const unsigned long long* ptrs,
                                                                const long long* starts, int k,
                                                                long long chunk,
                                                                float* partial) {
    sumsq_partial<float>(ptrs, starts, k, chunk, partial);
}

extern "C" __global__ void CDT_ROW_BOUNDS cdt_sumsq_partial_bf16(const unsigned long long* ptrs,
                                                                 const long long* starts, int k,
                                                                 long long chunk,
                                                                 float* partial) {
    sumsq_partial<bf16_t>(ptrs, starts, k, chunk, partial);
}

// The constants of one AdamW step, each as the optimizer casts it from f64 to f32.
struct AdamWConsts {
    float beta1, one_beta1, beta2, one_beta2, scale_m, scale_v, decay, eps, lr;
};

// One AdamW step of every f32 tensor of the table, in place on p, m and v (pointer tables of
// k tensors, prefix sums `starts` as for the norm). Every operation is an IEEE round-to-nearest
// intrinsic in the CPU optimizer's order (crates/train/src/optim.rs `update`, candle-nn's ops
// element by element, `+ 0` terms included), so no multiply-add is contracted and the result
// is bitwise the CPU's. `coef`: null, or a device scalar multiplying every gradient first
// (the clip coefficient of cdt_norm_finish's out[1]).
extern "C" __global__ void CDT_ROW_BOUNDS cdt_adamw_f32(
    const unsigned long long* __restrict__ ps, const unsigned long long* __restrict__ gs,
    const unsigned long long* __restrict__ ms, const unsigned long long* __restrict__ vs,
    const long long* __restrict__ starts, int k, long long chunk, const float* __restrict__ coef,
    AdamWConsts c) {
    const long long total = starts[k];
    const long long c0 = (long long)blockIdx.x * chunk;
    const long long c1 = c0 + chunk < total ? c0 + chunk : total;
    int lo = 0, hi = k;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= c0) lo = mid; else hi = mid;
    }
    const float scale = coef ? coef[0] : 1.f;
    for (int t = lo; t < k && starts[t] < c1; ++t) {
        float* p = (float*)ps[t];
        const float* g = (const float*)gs[t];
        float* m = (float*)ms[t];
        float* v = (float*)vs[t];
        const long long a = (c0 > starts[t] ? c0 : starts[t]) - starts[t];
        const long long b = (c1 < starts[t + 1] ? c1 : starts[t + 1]) - starts[t];
        for (long long i = a + threadIdx.x; i < b; i += blockDim.x) {
            const float gi = coef ? __fmul_rn(g[i], scale) : g[i];
            const float next_m = __fadd_rn(__fadd_rn(__fmul_rn(m[i], c.beta1), 0.f),
                                           __fadd_rn(__fmul_rn(gi, c.one_beta1), 0.f));
            const float next_v =
                __fadd_rn(__fadd_rn(__fmul_rn(v[i], c.beta2), 0.f),
                          __fadd_rn(__fmul_rn(__fmul_rn(gi, gi), c.one_beta2), 0.f));
            const float m_hat = __fadd_rn(__fmul_rn(next_m, c.scale_m), 0.f);
            const float v_hat = __fadd_rn(__fmul_rn(next_v, c.scale_v), 0.f);
            const float decayed = __fadd_rn(__fmul_rn(p[i], c.decay), 0.f);
            const float adjusted =
                __fdiv_rn(m_hat, __fadd_rn(__fmul_rn(__fsqrt_rn(v_hat), 1.f), c.eps));
            p[i] = __fsub_rn(decayed, __fadd_rn(__fmul_rn(adjusted, c.lr), 0.f));
            m[i] = next_m;
            v[i] = next_v;
        }
    }
}
