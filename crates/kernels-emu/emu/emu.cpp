// The scheduler of cuda_emu.h: a block's threads as ucontext fibers on one OS thread.

#include "cuda_emu.h"

#include <ucontext.h>

// getcontext is declared returns_twice, so GCC warns that the launch loop's locals "might be
// clobbered". The fibers' contexts are only ever entered through makecontext's entry point,
// never by returning from getcontext a second time, and swapcontext saves and restores the
// scheduler's registers: the warning does not apply.
#pragma GCC diagnostic ignored "-Wclobbered"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <memory>
#include <numeric>
#include <sstream>

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace emu {
namespace {

// The limits a CUDA launch is refused beyond (compute capability 8.0 and later).
constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kMaxBlockZ = 64;
constexpr unsigned kMaxGridYZ = 65535;
// Dynamic shared memory a kernel gets without cudaFuncSetAttribute's opt-in.
constexpr size_t kMaxDynShared = 48 * 1024;
// Each fiber's stack. Kernels keep a few scalars and loop indices there; 64 KiB is ample.
constexpr size_t kStack = 64 * 1024;

enum class St { Ready, BlockWait, WarpWait, Done };

struct Fiber {
    ucontext_t ctx;
    St st = St::Ready;
    // At a `.aligned` warp barrier: where the lane is (a hash of its call chain's return
    // addresses); 0 at any other barrier.
    uint64_t site = 0;
};

// A thread's cp.async copies: the bytes read at issue, written to `dst` when the thread waits
// for their group.
struct AsyncCopy {
    unsigned char* dst;
    unsigned size;
    unsigned char data[16];
};
struct AsyncState {
    std::vector<AsyncCopy> open;                  // issued since the last commit
    std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
};

struct Block {
    const std::function<void()>* body = nullptr;
    unsigned n = 0;
    char* stack_base = nullptr;
    unsigned cur = 0;
    ucontext_t sched;
    std::vector<Fiber> fibers;
    std::vector<uint64_t> slots;
    std::vector<unsigned char> dyn;
    // Static shared arrays the running block has reached (and so poisoned).
    std::vector<void*> fresh;
    std::vector<AsyncState> async;  // per thread
    // __syncthreads_or: the predicates ORed since the last block barrier's release, and the
    // result of that release (read by each thread right after it).
    int vote_acc = 0, vote_result = 0;
    std::string fault;
};

// The block being run; the emulator is single-threaded per launch and launches do not nest.
thread_local Block* g_block = nullptr;

// The fibers' stacks, kept per OS thread between launches (allocating up to 64 MiB per launch
// was most of a small launch's time).
char* stacks(size_t n) {
    thread_local std::unique_ptr<char[]> pool;
    thread_local size_t have = 0;
    if (have < n) {
        pool.reset(new char[n * kStack]);
        have = n;
    }
    return pool.get();
}

void set_index(unsigned t) {
    threadIdx.x = t % blockDim.x;
    threadIdx.y = (t / blockDim.x) % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
}

void trampoline() {
    Block* b = g_block;
    (*b->body)();
    const AsyncState& a = b->async[b->cur];
    if (!a.open.empty() || !a.groups.empty())
        fault("the thread exited with cp.async copies it never waited for");
    b->fibers[b->cur].st = St::Done;
    // Returning resumes uc_link: the scheduler.
}

void yield(St st) {
    Block* b = g_block;
    Fiber& f = b->fibers[b->cur];
    f.st = st;
    swapcontext(&f.ctx, &b->sched);
}

uint64_t next_random(uint64_t& s) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

const char* state_name(St st) {
    switch (st) {
        case St::Ready: return "ready";
        case St::BlockWait: return "__syncthreads";
        case St::WarpWait: return "warp sync";
        case St::Done: return "exited";
    }
    return "?";
}

std::string describe(const char* name, const Block& b, const char* what) {
    std::ostringstream os;
    os << "kernel " << name << ", block (" << blockIdx.x << "," << blockIdx.y << ","
       << blockIdx.z << "): " << what << ":";
    unsigned shown = 0;
    for (unsigned w = 0; w * 32 < b.n; ++w) {
        unsigned counts[4] = {0, 0, 0, 0};
        for (unsigned t = w * 32; t < std::min(b.n, w * 32 + 32); ++t) {
            counts[static_cast<int>(b.fibers[t].st)]++;
        }
        if (shown++ < 8) {
            os << " warp " << w << " {";
            for (int s = 0; s < 4; ++s) {
                if (counts[s]) os << " " << counts[s] << " " << state_name(static_cast<St>(s));
            }
            os << " }";
        }
    }
    return os.str();
}

}  // namespace

void fault(const std::string& what) {
    Block* b = g_block;
    if (b->fault.empty()) {
        std::ostringstream os;
        os << "thread (" << threadIdx.x << "," << threadIdx.y << "," << threadIdx.z << "): " << what;
        b->fault = os.str();
    }
}

void* dyn_shared() { return g_block->dyn.data(); }

void fresh_shared(void* p, size_t bytes) {
    std::vector<void*>& seen = g_block->fresh;
    if (std::find(seen.begin(), seen.end(), p) != seen.end()) return;
    seen.push_back(p);
    std::memset(p, 0xFF, bytes);
}

void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size) {
    if (cp_size != 4 && cp_size != 8 && cp_size != 16) {
        fault("cp.async of " + std::to_string(cp_size) + " bytes (4, 8 or 16)");
        return;
    }
    if (src_size > cp_size) {
        fault("cp.async reads " + std::to_string(src_size) + " source bytes of a " +
              std::to_string(cp_size) + "-byte copy");
        return;
    }
    if (reinterpret_cast<uintptr_t>(dst) % cp_size != 0 ||
        (src_size > 0 && reinterpret_cast<uintptr_t>(src) % cp_size != 0)) {
        fault("cp.async of " + std::to_string(cp_size) +
              " bytes from or to an address not aligned to its size");
        return;
    }
    AsyncCopy c;
    c.dst = static_cast<unsigned char*>(dst);
    c.size = cp_size;
    std::memset(c.data, 0, sizeof c.data);
    if (src_size > 0) std::memcpy(c.data, src, src_size);
    // Until the thread waits, the destination holds neither its old bytes nor the new ones.
    std::memset(c.dst, 0xFF, cp_size);
    g_block->async[g_block->cur].open.push_back(c);
}

void cp_async_commit() {
    AsyncState& a = g_block->async[g_block->cur];
    a.groups.push_back(std::move(a.open));
    a.open.clear();
}

void cp_async_wait(unsigned pending) {
    AsyncState& a = g_block->async[g_block->cur];
    while (a.groups.size() > pending) {
        for (const AsyncCopy& c : a.groups.front()) std::memcpy(c.dst, c.data, c.size);
        a.groups.pop_front();
    }
}
void block_barrier() { yield(St::BlockWait); }
int block_barrier_or(int predicate) {
    g_block->vote_acc |= predicate != 0;
    yield(St::BlockWait);
    return g_block->vote_result;
}
void warp_barrier() {
    g_block->fibers[g_block->cur].site = 0;
    yield(St::WarpWait);
}

// Where the calling lane stands: the return addresses of its frames, walked through the frame
// pointers (the emulator's build keeps them) while they lie in this fiber's own stack, hashed.
// Code inlined at two call sites sits at two addresses, so two different places give two
// different chains.
__attribute__((noinline)) uint64_t call_site() {
    const Block* b = g_block;
    const char* lo = b->stack_base + static_cast<size_t>(b->cur) * kStack;
    const char* hi = lo + kStack;
    auto inside = [&](const void* p) {
        const char* c = static_cast<const char*>(p);
        return c >= lo && c + 2 * sizeof(void*) <= hi;
    };
    void* const* fp = static_cast<void* const*>(__builtin_frame_address(0));
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the addresses
    for (int depth = 0; depth < 32 && inside(fp); ++depth) {
        h = (h ^ reinterpret_cast<uintptr_t>(fp[1])) * 1099511628211ull;
        void* const* next = static_cast<void* const*>(fp[0]);
        if (next <= fp) break;
        fp = next;
    }
    return h | 1;  // never 0, which marks the other barriers
}

void warp_barrier_aligned() {
    g_block->fibers[g_block->cur].site = call_site();
    yield(St::WarpWait);
}
uint64_t* warp_slots() { return &g_block->slots[(g_block->cur / 32) * 32]; }
unsigned lane_id() { return g_block->cur % 32; }
unsigned warp_lane_count() {
    unsigned base = (g_block->cur / 32) * 32;
    return std::min(32u, g_block->n - base);
}

void launch(const char* name, dim3 grid, dim3 block, size_t shared_bytes, Order order,
            uint64_t seed, const std::function<void()>& body) {
    unsigned n = block.x * block.y * block.z;
    std::ostringstream bad;
    if (n == 0 || n > kMaxThreads || block.z > kMaxBlockZ) {
        bad << "kernel " << name << ": block (" << block.x << "," << block.y << "," << block.z
            << ") is not 1.." << kMaxThreads << " threads with z <= " << kMaxBlockZ;
    } else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > kMaxGridYZ ||
               grid.z > kMaxGridYZ || grid.x > 0x7fffffffu) {
        bad << "kernel " << name << ": grid (" << grid.x << "," << grid.y << "," << grid.z
            << ") is outside 1..2^31-1 x 1..65535 x 1..65535";
    } else if (shared_bytes > kMaxDynShared) {
        bad << "kernel " << name << ": " << shared_bytes
            << " bytes of dynamic shared memory, more than the " << kMaxDynShared
            << " a launch gets without opting in";
    }
    if (!bad.str().empty()) throw LaunchError{bad.str()};
    if (g_block != nullptr) throw LaunchError{std::string("kernel ") + name + ": nested launch"};

    Block b;
    b.body = &body;
    b.n = n;
    b.fibers.resize(n);
    char* stack_base = stacks(n);
    b.stack_base = stack_base;
    b.slots.assign(((n + 31) / 32) * 32, 0);
    b.dyn.resize(std::max<size_t>(shared_bytes, 1));
    b.async.resize(n);
    blockDim = block;
    gridDim = grid;
    g_block = &b;
    struct Reset {
        ~Reset() { g_block = nullptr; }
    } reset;

    std::vector<unsigned> perm(n);
    std::vector<unsigned> ready;
    std::vector<char> run_warp;
    uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 1;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3(bx, by, bz);
                std::fill(b.dyn.begin(), b.dyn.end(), 0xFF);
                b.fresh.clear();
                for (AsyncState& a : b.async) {
                    a.open.clear();
                    a.groups.clear();
                }
                b.vote_acc = b.vote_result = 0;
                for (unsigned t = 0; t < n; ++t) {
                    Fiber& f = b.fibers[t];
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = stack_base + static_cast<size_t>(t) * kStack;
                    f.ctx.uc_stack.ss_size = kStack;
                    f.ctx.uc_link = &b.sched;
                    makecontext(&f.ctx, trampoline, 0);
                    f.st = St::Ready;
                }
                for (;;) {
                    // Warps whose live lanes all wait at a warp sync go on at once.
                    for (unsigned w = 0; w * 32 < n; ++w) {
                        unsigned end = std::min(n, w * 32 + 32);
                        bool live = false, all_warp = true, done = false;
                        for (unsigned t = w * 32; t < end; ++t) {
                            St st = b.fibers[t].st;
                            if (st == St::Done) {
                                done = true;
                                continue;
                            }
                            live = true;
                            if (st != St::WarpWait) all_warp = false;
                        }
                        if (!live || !all_warp) continue;
                        if (done) {
                            throw LaunchError{describe(
                                name, b,
                                "a warp sync or shuffle after some lanes of the warp exited "
                                "(undefined on a GPU)")};
                        }
                        // A `.aligned` instruction (mma.sync, ldmatrix) needs every lane at
                        // that one instruction: all of them at the same place.
                        uint64_t site = b.fibers[w * 32].site;
                        for (unsigned t = w * 32; t < end; ++t) {
                            if (b.fibers[t].site != site) {
                                throw LaunchError{describe(
                                    name, b,
                                    ("lanes " + std::to_string(w * 32) + " and " +
                                     std::to_string(t) +
                                     " of a warp meet at a warp-wide matrix instruction "
                                     "(mma.sync / ldmatrix, .aligned) from different places, "
                                     "or one of them at another warp sync (undefined on a "
                                     "GPU)")
                                        .c_str())};
                            }
                        }
                        for (unsigned t = w * 32; t < end; ++t)
                            if (b.fibers[t].st == St::WarpWait) b.fibers[t].st = St::Ready;
                    }
                    // Which warps run this round: of those with a thread ready, the lowest
                    // (Forward), the highest (Reverse) or a random non-empty subset
                    // (Shuffled). A warp chosen alone runs on through its warp syncs while the
                    // others wait, so warps drift apart between __syncthreads as they may on a
                    // GPU, and a race between warps shows as a difference between orders.
                    ready.clear();
                    for (unsigned w = 0; w * 32 < n; ++w) {
                        unsigned end = std::min(n, w * 32 + 32);
                        for (unsigned t = w * 32; t < end; ++t) {
                            if (b.fibers[t].st == St::Ready) {
                                ready.push_back(w);
                                break;
                            }
                        }
                    }
                    if (!ready.empty()) {
                        run_warp.assign((n + 31) / 32, 0);
                        if (order == Order::Forward) {
                            run_warp[ready.front()] = 1;
                        } else if (order == Order::Reverse) {
                            run_warp[ready.back()] = 1;
                        } else {
                            bool any = false;
                            for (unsigned w : ready) {
                                if (next_random(rng) & 1) {
                                    run_warp[w] = 1;
                                    any = true;
                                }
                            }
                            if (!any) run_warp[ready[next_random(rng) % ready.size()]] = 1;
                        }
                        // Within the chosen warps, the threads in the order's order.
                        std::iota(perm.begin(), perm.end(), 0u);
                        if (order == Order::Reverse) {
                            std::reverse(perm.begin(), perm.end());
                        } else if (order == Order::Shuffled) {
                            for (unsigned i = n; i > 1; --i) {
                                std::swap(perm[i - 1], perm[next_random(rng) % i]);
                            }
                        }
                        for (unsigned t : perm) {
                            if (b.fibers[t].st != St::Ready || !run_warp[t / 32]) continue;
                            b.cur = t;
                            set_index(t);
                            swapcontext(&b.sched, &b.fibers[t].ctx);
                        }
                        if (!b.fault.empty()) throw LaunchError{describe(name, b, b.fault.c_str())};
                        continue;
                    }
                    // No thread can run: every live one waits at __syncthreads (release them),
                    // or the block is stuck.
                    bool any_live = false, all_block = true, any_done = false;
                    for (unsigned t = 0; t < n; ++t) {
                        St st = b.fibers[t].st;
                        if (st == St::Done) {
                            any_done = true;
                            continue;
                        }
                        any_live = true;
                        if (st != St::BlockWait) all_block = false;
                    }
                    if (!any_live) break;
                    if (!all_block) {
                        throw LaunchError{describe(
                            name, b,
                            "deadlock: live threads wait at barriers the others never reach")};
                    }
                    if (any_done) {
                        throw LaunchError{describe(
                            name, b,
                            "__syncthreads after some threads of the block exited "
                            "(undefined on a GPU)")};
                    }
                    b.vote_result = b.vote_acc;
                    b.vote_acc = 0;
                    for (auto& f : b.fibers) f.st = St::Ready;
                }
            }
}

}  // namespace emu
