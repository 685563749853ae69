// Launch shims: one `extern "C"` function per kernel the Rust side tests, running it under the
// emulator. The kernels' sources are included unchanged.

#include <cstdio>
#include <exception>

#include "selftest.cu"

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

int emu_selftest_row_sum(EMU_ERR, const float* x, float* y, int n) { EMU_RUN(row_sum, x, y, n); }
int emu_selftest_racy(EMU_ERR, float* y) { EMU_RUN(racy, y); }
int emu_selftest_deadlock(EMU_ERR, float* y) { EMU_RUN(deadlock, y); }
int emu_selftest_dyn(EMU_ERR, float* y) { EMU_RUN(dyn, y); }
int emu_selftest_unguarded(EMU_ERR, float* y) { EMU_RUN(unguarded, y); }

}  // extern "C"
