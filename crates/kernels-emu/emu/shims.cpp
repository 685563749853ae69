// Launch shims: one `extern "C"` function per kernel the Rust side tests, running it under the
// emulator. The kernels' sources are included as written, each `__shared__` declaration followed
// by a call poisoning its array (build.rs instruments them into OUT_DIR).

#include <cstdio>
#include <exception>

#include "selftest.cu"

// The kernels under test, as nvcc compiles them (crates/kernels/build.rs).
#include "gelu.cu"
#include "norm.cu"
#include "softmax.cu"
#include "flash_attn.cu"
#include "embedding.cu"
#include "reduce.cu"
#include "cast.cu"
#include "multi_tensor.cu"

namespace {

// The launch configuration as the Rust side passes it (`#[repr(C)] RawLaunch`).
struct EmuLaunch {
    unsigned grid[3];
    unsigned block[3];
    uint64_t shared;
    int32_t order;
    uint64_t seed;
};

// Runs `body` as the launch `l` describes; 0 on success, else 1 with the reason in `err`. No
// exception crosses into Rust.
int run(const char* name, const EmuLaunch* l, char* err, size_t err_len,
        const std::function<void()>& body) {
    try {
        emu::launch(name, dim3(l->grid[0], l->grid[1], l->grid[2]),
                    dim3(l->block[0], l->block[1], l->block[2]), l->shared,
                    static_cast<emu::Order>(l->order), l->seed, body);
        return 0;
    } catch (const emu::LaunchError& e) {
        std::snprintf(err, err_len, "%s", e.message.c_str());
    } catch (const std::exception& e) {
        std::snprintf(err, err_len, "kernel %s: %s", name, e.what());
    } catch (...) {
        std::snprintf(err, err_len, "kernel %s: an unknown C++ exception", name);
    }
    return 1;
}

}  // namespace

#define EMU_ERR const EmuLaunch *l, char *err, size_t err_len
#define EMU_RUN(kernel, ...) return run(#kernel, l, err, err_len, [&] { kernel(__VA_ARGS__); })

extern "C" {

// The shared-memory bank counts of the ldmatrix instructions run on this OS thread since the
// last reset (`emu::bank_stats`, mma.h): out = requests and wavefronts.
void emu_bank_stats(uint64_t* out) {
    out[0] = emu::bank_stats.requests;
    out[1] = emu::bank_stats.wavefronts;
}
void emu_bank_stats_reset() { emu::bank_stats = emu::BankStats{}; }

int emu_selftest_row_sum(EMU_ERR, const float* x, float* y, int n) { EMU_RUN(row_sum, x, y, n); }
int emu_selftest_racy(EMU_ERR, float* y) { EMU_RUN(racy, y); }
int emu_selftest_deadlock(EMU_ERR, float* y) { EMU_RUN(deadlock, y); }
int emu_selftest_dyn(EMU_ERR, float* y) { EMU_RUN(dyn, y); }
int emu_selftest_unguarded(EMU_ERR, float* y) { EMU_RUN(unguarded, y); }
int emu_selftest_reuse_race(EMU_ERR, const float* x, float* y) { EMU_RUN(reuse_race, x, y); }
int emu_selftest_stale_shared(EMU_ERR, float* y, int mode) { EMU_RUN(stale_shared, y, mode); }
int emu_selftest_async_copy(EMU_ERR, const float* x, float* y, int mode) {
    EMU_RUN(async_copy, x, y, mode);
}
int emu_selftest_divergent_mma(EMU_ERR, float* y, int mode) { EMU_RUN(divergent_mma, y, mode); }
int emu_selftest_ballot(EMU_ERR, const float* x, float* y, unsigned lanes) {
    EMU_RUN(ballot, x, y, lanes);
}


#define GELU_SHIM(NAME, T)                                                                    \
    int emu_gelu_fwd_##NAME(EMU_ERR, const T* x, T* y, long long len) {                       \
        EMU_RUN(cdt_gelu_fwd_##NAME, x, y, len);                                              \
    }                                                                                         \
    int emu_gelu_bwd_##NAME(EMU_ERR, const T* x, const T* g, T* dx, long long len) {          \
        EMU_RUN(cdt_gelu_bwd_##NAME, x, g, dx, len);                                          \
    }
GELU_SHIM(f32, float)
GELU_SHIM(bf16, bf16_t)

#define EMB_SHIM(NAME, T)                                                                     \
    int emu_embedding_bwd_##NAME(EMU_ERR, const unsigned* ids, int n, const T* g, T* dtable,  \
                                 int d, int vocab) {                                          \
        EMU_RUN(cdt_embedding_bwd_##NAME, ids, n, g, dtable, d, vocab);                       \
    }
EMB_SHIM(f32, float)
EMB_SHIM(bf16, bf16_t)

#define COL_SUM_SHIM(NAME, T)                                                                 \
    int emu_col_sum_partial_##NAME(EMU_ERR, const T* x, float* part, long long rows, int n) { \
        EMU_RUN(cdt_col_sum_partial_##NAME, x, part, rows, n);                                \
    }                                                                                         \
    int emu_col_sum_final_##NAME(EMU_ERR, const float* part, T* out, int chunks, int n) {     \
        EMU_RUN(cdt_col_sum_final_##NAME, part, out, chunks, n);                              \
    }
COL_SUM_SHIM(f32, float)
COL_SUM_SHIM(bf16, bf16_t)

int emu_cast_add_rows_bf16_f32(EMU_ERR, const bf16_t* y, const float* b, float* out, long long len,
                               int n) {
    EMU_RUN(cdt_cast_add_rows_bf16_f32, y, b, out, len, n);
}

#define ADD_ROWS_SHIM(NAME, T, B)                                                             \
    int emu_add_rows_##NAME(EMU_ERR, T* y, const B* b, long long len, int n) {                \
        EMU_RUN(cdt_add_rows_##NAME, y, b, len, n);                                           \
    }
ADD_ROWS_SHIM(f32_f32, float, float)
ADD_ROWS_SHIM(bf16_bf16, bf16_t, bf16_t)
ADD_ROWS_SHIM(bf16_f32, bf16_t, float)

#define NORM_SHIM(NAME, T)                                                                    \
    int emu_norm_fwd_##NAME(EMU_ERR, const T* x, const T* w, const T* b, T* y,                \
                            long long rows, int n, float eps, int center) {                   \
        EMU_RUN(cdt_norm_fwd_##NAME, x, w, b, y, rows, n, eps, center);                       \
    }                                                                                         \
    int emu_norm_bwd_dx_##NAME(EMU_ERR, const T* x, const T* w, const T* g, T* dx,            \
                               float* stats, long long rows, int n, float eps, int center) {  \
        EMU_RUN(cdt_norm_bwd_dx_##NAME, x, w, g, dx, stats, rows, n, eps, center);            \
    }                                                                                         \
    int emu_norm_bwd_partial_##NAME(EMU_ERR, const T* x, const T* g, const float* stats,      \
                                    float* part, long long rows, int n, long long per_chunk) { \
        EMU_RUN(cdt_norm_bwd_partial_##NAME, x, g, stats, part, rows, n, per_chunk);          \
    }                                                                                         \
    int emu_norm_bwd_final_##NAME(EMU_ERR, const float* part, T* wb, int chunks, int n) {     \
        EMU_RUN(cdt_norm_bwd_final_##NAME, part, wb, chunks, n);                              \
    }
NORM_SHIM(f32, float)
NORM_SHIM(bf16, bf16_t)

#define SOFTMAX_SHIM(NAME, T)                                                                 \
    int emu_softmax_fwd_##NAME(EMU_ERR, const T* x, T* y, long long rows, int n, long long t, \
                               float scale, int causal, int log_out) {                        \
        EMU_RUN(cdt_softmax_fwd_##NAME, x, y, rows, n, t, scale, causal, log_out);            \
    }                                                                                         \
    int emu_softmax_bwd_##NAME(EMU_ERR, const T* y, const T* g, T* dx, long long rows, int n, \
                               float scale, int log_out) {                                    \
        EMU_RUN(cdt_softmax_bwd_##NAME, y, g, dx, rows, n, scale, log_out);                   \
    }
SOFTMAX_SHIM(f32, float)
SOFTMAX_SHIM(bf16, bf16_t)

#define XENT_SHIM(NAME, T, INAME, I)                                                          \
    int emu_xent_fwd_##NAME##_##INAME(EMU_ERR, const T* x, const I* tgt, float* out,          \
                                      long long rows, int n, long long ignore,                \
                                      int has_ignore) {                                       \
        EMU_RUN(cdt_xent_fwd_##NAME##_##INAME, x, tgt, out, rows, n, ignore, has_ignore);     \
    }                                                                                         \
    int emu_xent_bwd_##NAME##_##INAME(EMU_ERR, const T* x, const I* tgt, const float* lg,     \
                                      T* dx, long long rows, int n, long long ignore,         \
                                      int has_ignore) {                                       \
        EMU_RUN(cdt_xent_bwd_##NAME##_##INAME, x, tgt, lg, dx, rows, n, ignore, has_ignore);  \
    }
XENT_SHIM(f32, float, u32, unsigned int)
XENT_SHIM(f32, float, i64, long long)
XENT_SHIM(bf16, bf16_t, u32, unsigned int)
XENT_SHIM(bf16, bf16_t, i64, long long)


// The flash-attention shims take the kernels' FaRows as one array, in the kernels' order.
#define FA_SHIM(NAME, T, D)                                                                   \
    int emu_fa_fwd_##NAME##_d##D(EMU_ERR, const T* q, const T* k, const T* v, T* o,           \
                                 float* lse, const FaRows* fr, int tq, int tk, float scale,    \
                                 int causal) {                                                \
        EMU_RUN(cdt_fa_fwd_##NAME##_d##D, q, k, v, o, lse, fr[0], fr[1], fr[2], fr[3], tq, tk,    \
                scale, causal);                                                               \
    }                                                                                         \
    int emu_fa_bwd_delta_##NAME##_d##D(EMU_ERR, const T* o, const T* d_o, float* delta,       \
                                       const FaRows* fr, long long rows, int tq) {             \
        EMU_RUN(cdt_fa_bwd_delta_##NAME##_d##D, o, d_o, delta, fr[0], fr[1], rows, tq);         \
    }                                                                                         \
    int emu_fa_bwd_dkv_##NAME##_d##D(EMU_ERR, const T* q, const T* k, const T* v,             \
                                     const T* d_o, const float* lse, const float* delta,      \
                                     T* dkv, const FaRows* fr, int tq, int tk, float scale,    \
                                     int causal) {                                            \
        EMU_RUN(cdt_fa_bwd_dkv_##NAME##_d##D, q, k, v, d_o, lse, delta, dkv, fr[0], fr[1],      \
                fr[2], fr[3], fr[4], fr[5], tq, tk, scale, causal);                               \
    }                                                                                         \
    int emu_fa_bwd_dq_##NAME##_d##D(EMU_ERR, const T* q, const T* k, const T* v,              \
                                    const T* d_o, const float* lse, const float* delta,       \
                                    T* dq, const FaRows* fr, int tq, int tk, float scale,      \
                                    int causal) {                                             \
        EMU_RUN(cdt_fa_bwd_dq_##NAME##_d##D, q, k, v, d_o, lse, delta, dq, fr[0], fr[1], fr[2],  \
                fr[3], fr[4], tq, tk, scale, causal);                                           \
    }
#define FA_SHIM_DIMS(NAME, T) \
    FA_SHIM(NAME, T, 32) FA_SHIM(NAME, T, 48) FA_SHIM(NAME, T, 64) FA_SHIM(NAME, T, 96) FA_SHIM(NAME, T, 128)
FA_SHIM_DIMS(f32, float)
FA_SHIM_DIMS(bf16, bf16_t)

#define FA_TC_SHIM(D)                                                                         \
    int emu_fa_fwd_tc_bf16_d##D(EMU_ERR, const bf16_t* q, const bf16_t* k, const bf16_t* v,   \
                                bf16_t* o, float* lse, const FaRows* fr, int tq, int tk,       \
                                float scale, int causal) {                                    \
        EMU_RUN(cdt_fa_fwd_tc_bf16_d##D, q, k, v, o, lse, fr[0], fr[1], fr[2], fr[3], tq, tk,     \
                scale, causal);                                                               \
    }                                                                                         \
    int emu_fa_bwd_dkv_tc_bf16_d##D(EMU_ERR, const bf16_t* q, const bf16_t* k,                \
                                    const bf16_t* v, const bf16_t* d_o, const float* lse,     \
                                    const float* delta, bf16_t* dkv, const FaRows* fr, int tq, \
                                    int tk, float scale, int causal) {                        \
        EMU_RUN(cdt_fa_bwd_dkv_tc_bf16_d##D, q, k, v, d_o, lse, delta, dkv, fr[0], fr[1], fr[2], \
                fr[3], fr[4], fr[5], tq, tk, scale, causal);                                     \
    }                                                                                         \
    int emu_fa_bwd_dq_tc_bf16_d##D(EMU_ERR, const bf16_t* q, const bf16_t* k,                 \
                                   const bf16_t* v, const bf16_t* d_o, const float* lse,      \
                                   const float* delta, bf16_t* dq, const FaRows* fr, int tq,   \
                                   int tk, float scale, int causal) {                         \
        EMU_RUN(cdt_fa_bwd_dq_tc_bf16_d##D, q, k, v, d_o, lse, delta, dq, fr[0], fr[1], fr[2],   \
                fr[3], fr[4], tq, tk, scale, causal);                                           \
    }
FA_TC_SHIM(32)
FA_TC_SHIM(48)
FA_TC_SHIM(64)
FA_TC_SHIM(96)
FA_TC_SHIM(128)


int emu_sumsq_partial_f32(EMU_ERR, const unsigned long long* ptrs, const long long* starts, int k,
                          long long chunk, float* partial) {
    EMU_RUN(cdt_sumsq_partial_f32, ptrs, starts, k, chunk, partial);
}
int emu_sumsq_partial_bf16(EMU_ERR, const unsigned long long* ptrs, const long long* starts,
                           int k, long long chunk, float* partial) {
    EMU_RUN(cdt_sumsq_partial_bf16, ptrs, starts, k, chunk, partial);
}
int emu_norm_finish(EMU_ERR, const float* partial, int blocks, float max_norm, float* out) {
    EMU_RUN(cdt_norm_finish, partial, blocks, max_norm, out);
}
int emu_adamw_f32(EMU_ERR, const unsigned long long* ps, const unsigned long long* gs,
                  const unsigned long long* ms, const unsigned long long* vs,
                  const long long* starts, int k, long long chunk, const float* coef,
                  const AdamWConsts* c) {
    EMU_RUN(cdt_adamw_f32, ps, gs, ms, vs, starts, k, chunk, coef, *c);
}

}  // extern "C"

// Every launcher's declaration (crates/kernels/src/launch_sigs.rs) checked against its kernels'
// parameter types: written by build.rs (sigcheck.rs) into the instrumented sources' directory.
#include "launch_sigs.inc"
