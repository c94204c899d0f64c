// The emulated grid: a launch runs its blocks one after another on the calling OS thread,
// each block's threads as fibers (ucontext) that switch only at a barrier (`__syncthreads`,
// a warp's shuffle or `__syncwarp`) or when they finish. Between two barriers the threads
// run one after another, first to last or last to first as the caller asks (and the blocks
// in that order too), so a kernel whose result depends on which thread runs first (a
// missing barrier) gives two answers for the two orders. A barrier no live thread can pass
// ends the launch with an error rather than hanging; so do the faults a GPU would have
// (a shuffle reading a lane that is not there, a misaligned vector access, a write past the
// dynamic shared memory).
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <new>
#include <utility>
#include <vector>

#include "cuda_shim.h"

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

thread_local R3EmuThread *r3emu_current = nullptr;

namespace {

constexpr size_t STACK_BYTES = 256 * 1024;
// One page below each stack that faults when touched: an overflow stops there instead of
// writing into the next fiber's stack.
size_t guard_bytes() {
    static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return page;
}
// A block's dynamic shared memory is at most 48 KiB (a GPU's limit without the opt-in
// attribute, which r3's launchers do not set).
constexpr size_t MAX_DYNAMIC_SHARED = 48 * 1024;
// Bytes after the dynamic shared memory that no kernel may write.
constexpr size_t CANARY_BYTES = 64;
constexpr unsigned char CANARY = 0xa5;

// Launch results (src/lib.rs maps them to `EmuError`).
constexpr int OK = 0;
constexpr int DEADLOCK = 1;
constexpr int SHAPE = 2;
constexpr int MEMORY = 3;
constexpr int ABSENT_LANE = 4;
// 5: R3EMU_FAULT_MISALIGNED (cuda_shim.h).
constexpr int SHARED_OVERRUN = 6;

enum class Wait { None, Block, Warp };

struct Fiber {
    ucontext_t context;
    void *mapping = nullptr;
    R3EmuThread thread;
    bool done = false;
    Wait wait = Wait::None;
    uint64_t wait_generation = 0;
};

struct Group {
    unsigned live = 0;
    unsigned arrived = 0;
    uint64_t generation = 0;
};

struct Launch {
    void (*body)(const void *) = nullptr;
    const void *data = nullptr;
    std::vector<Fiber> fibers;
    Group block;
    std::vector<Group> warps;
    // Each lane's published word and the exchange it was published for (its warp's barrier
    // generation then).
    std::vector<uint64_t> warp_words;
    std::vector<uint64_t> warp_rounds;
    std::vector<unsigned char> dynamic_shared;
    size_t dynamic_bytes = 0;
    ucontext_t scheduler;
    size_t running = 0;
    // Barriers released: the scheduler starts its pass over again after one, so the threads
    // leave a barrier in the launch's order.
    uint64_t releases = 0;
    int fault = OK;

    Launch() = default;
    Launch(const Launch &) = delete;
    Launch &operator=(const Launch &) = delete;
    // The stacks go on every path out of a launch, a thrown allocation failure included.
    ~Launch() {
        for (Fiber &f : fibers) {
            if (f.mapping) munmap(f.mapping, guard_bytes() + STACK_BYTES);
        }
    }
};

thread_local Launch *current_launch = nullptr;
// A block's number among every block this OS thread has run: the static shared variables
// filled in this block are those whose recorded number is this one.
thread_local uint64_t block_serial = 0;
thread_local std::vector<std::pair<void *, uint64_t>> filled_shared;

void fiber_main() {
    Launch *l = current_launch;
    Fiber &f = l->fibers[l->running];
    l->body(l->data);
    f.done = true;
    // Threads that finish no longer hold back their block's or warp's barrier.
    const unsigned warp = f.thread.thread_idx.x / 32;
    l->block.live--;
    l->warps[warp].live--;
    // The context returns to the scheduler through uc_link.
}

void yield_to_scheduler(Fiber &f) { swapcontext(&f.context, &current_launch->scheduler); }

// Arrive at `g`. The last live thread to arrive releases the others and yields too (without
// waiting), so the scheduler resumes all of them in the launch's order; the rest wait until
// the generation moves on.
void arrive(Group &g, Wait kind) {
    Launch *l = current_launch;
    Fiber &f = l->fibers[l->running];
    g.arrived++;
    if (g.arrived >= g.live) {
        g.arrived = 0;
        g.generation++;
        l->releases++;
        f.wait = Wait::None;
        yield_to_scheduler(f);
        return;
    }
    f.wait = kind;
    f.wait_generation = g.generation;
    yield_to_scheduler(f);
}

bool released(const Launch &l, const Fiber &f) {
    switch (f.wait) {
    case Wait::None:
        return true;
    case Wait::Block:
        return l.block.generation != f.wait_generation;
    case Wait::Warp:
        return l.warps[f.thread.thread_idx.x / 32].generation != f.wait_generation;
    }
    return true;
}

// A barrier whose live threads all wait there (some having finished) opens for them.
void release_stranded(Launch &l) {
    if (l.block.arrived > 0 && l.block.arrived >= l.block.live) {
        l.block.arrived = 0;
        l.block.generation++;
    }
    for (Group &w : l.warps) {
        if (w.arrived > 0 && w.arrived >= w.live) {
            w.arrived = 0;
            w.generation++;
        }
    }
}

// Runs one block's fibers to their end; false when they deadlock.
bool run_block(Launch &l, unsigned threads, bool backward) {
    unsigned remaining = threads;
    while (remaining > 0) {
        bool progressed = false;
        const uint64_t releases = l.releases;
        for (unsigned i = 0; i < threads && l.releases == releases; i++) {
            const unsigned t = backward ? threads - 1 - i : i;
            Fiber &f = l.fibers[t];
            if (f.done || !released(l, f)) continue;
            f.wait = Wait::None;
            l.running = t;
            r3emu_current = &f.thread;
            swapcontext(&l.scheduler, &f.context);
            progressed = true;
            if (f.done) remaining--;
        }
        if (!progressed) {
            release_stranded(l);
            bool any = false;
            for (const Fiber &f : l.fibers) any = any || (!f.done && released(l, f));
            if (!any) return false;
        }
    }
    return true;
}

int run_launch(Launch &l, const unsigned *grid, const unsigned *block, bool backward) {
    const unsigned threads = block[0];
    for (Fiber &f : l.fibers) {
        f.mapping = mmap(nullptr, guard_bytes() + STACK_BYTES, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f.mapping == MAP_FAILED) {
            f.mapping = nullptr;
            return MEMORY;
        }
        // Stacks grow down: the guard is the mapping's lowest page.
        if (mprotect(f.mapping, guard_bytes(), PROT_NONE) != 0) return MEMORY;
    }
    const uint64_t blocks = (uint64_t)grid[0] * grid[1] * grid[2];
    for (uint64_t n = 0; n < blocks; n++) {
        const uint64_t b = backward ? blocks - 1 - n : n;
        const unsigned bx = (unsigned)(b % grid[0]);
        const unsigned by = (unsigned)((b / grid[0]) % grid[1]);
        const unsigned bz = (unsigned)(b / ((uint64_t)grid[0] * grid[1]));
        block_serial++;
        l.dynamic_shared.assign(l.dynamic_bytes + CANARY_BYTES, 0xff);
        memset(l.dynamic_shared.data() + l.dynamic_bytes, CANARY, CANARY_BYTES);
        l.block = Group{threads, 0, 0};
        for (size_t w = 0; w < l.warps.size(); w++) {
            const unsigned first = (unsigned)w * 32;
            l.warps[w] = Group{threads - first < 32 ? threads - first : 32, 0, 0};
        }
        // No exchange has been published in this block.
        std::fill(l.warp_rounds.begin(), l.warp_rounds.end(), UINT64_MAX);
        for (unsigned t = 0; t < threads; t++) {
            Fiber &f = l.fibers[t];
            f.done = false;
            f.wait = Wait::None;
            f.thread = R3EmuThread{{t, 0, 0},
                                   {bx, by, bz},
                                   {block[0], block[1], block[2]},
                                   {grid[0], grid[1], grid[2]}};
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = static_cast<char *>(f.mapping) + guard_bytes();
            f.context.uc_stack.ss_size = STACK_BYTES;
            f.context.uc_link = &l.scheduler;
            makecontext(&f.context, fiber_main, 0);
        }
        if (!run_block(l, threads, backward)) return DEADLOCK;
        for (size_t i = 0; i < CANARY_BYTES; i++) {
            if (l.dynamic_shared[l.dynamic_bytes + i] != CANARY) return SHARED_OVERRUN;
        }
        if (l.fault != OK) return l.fault;
    }
    return OK;
}

}  // namespace

extern "C" void r3emu_sync_block() { arrive(current_launch->block, Wait::Block); }

extern "C" void r3emu_sync_warp() {
    Launch *l = current_launch;
    arrive(l->warps[l->fibers[l->running].thread.thread_idx.x / 32], Wait::Warp);
}

extern "C" void *r3emu_dynamic_shared() { return current_launch->dynamic_shared.data(); }

extern "C" void r3emu_fault(int code) {
    Launch *l = current_launch;
    if (l->fault == OK) l->fault = code;
}

extern "C" uint64_t r3emu_shuffle_xor(uint64_t word, unsigned lane_mask) {
    Launch *l = current_launch;
    const unsigned t = l->fibers[l->running].thread.thread_idx.x;
    const unsigned warp = t / 32, lane = t & 31u;
    Group &g = l->warps[warp];
    // Publish, meet, read the partner's word, meet again (so no lane overwrites a word
    // another has yet to read).
    const uint64_t round = g.generation;
    l->warp_words[warp * 32 + lane] = word;
    l->warp_rounds[warp * 32 + lane] = round;
    r3emu_sync_warp();
    const unsigned partner = (lane ^ lane_mask) & 31u;
    uint64_t out = word;
    if (l->warp_rounds[warp * 32 + partner] == round) {
        out = l->warp_words[warp * 32 + partner];
    } else {
        r3emu_fault(ABSENT_LANE);
    }
    r3emu_sync_warp();
    return out;
}

extern "C" void r3emu_fill_shared_once(void *p, size_t bytes) {
    for (auto &entry : filled_shared) {
        if (entry.first == p) {
            if (entry.second == block_serial) return;
            entry.second = block_serial;
            memset(p, 0xff, bytes);
            return;
        }
    }
    filled_shared.emplace_back(p, block_serial);
    memset(p, 0xff, bytes);
}

// Runs `body(data)` as every thread of a grid of `grid` blocks of `block` threads (x, y, z;
// threads numbered x fastest, blocks of at most 1,024 threads along x only), with
// `shared_bytes` (at most 48 KiB) of dynamic shared memory filled with 0xff bytes (a NaN in
// every f32, so a read of what no thread wrote shows). `backward` runs the blocks, and a
// block's threads between barriers, last to first. Returns 0, or 1 when a block deadlocked
// at a barrier, 2 for a bad shape, 3 when memory ran out, 4 when a shuffle read a lane not
// in the exchange, 5 for a misaligned vector access, 6 for a write past the dynamic shared
// memory.
extern "C" int r3emu_launch(const unsigned *grid, const unsigned *block, size_t shared_bytes,
                            int backward, void (*body)(const void *), const void *data) {
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024 || block[1] != 1 || block[2] != 1) return SHAPE;
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return SHAPE;
    if (shared_bytes > MAX_DYNAMIC_SHARED) return SHAPE;
    Launch *outer = current_launch;
    R3EmuThread *outer_thread = r3emu_current;
    int status = OK;
    try {
        // Room for every static shared variable's entry before any fiber runs (a fiber's
        // allocation failure could not be caught).
        filled_shared.reserve(filled_shared.size() + 256);
        Launch l;
        l.body = body;
        l.data = data;
        l.dynamic_bytes = shared_bytes;
        l.fibers.resize(threads);
        l.warps.resize((threads + 31) / 32);
        l.warp_words.assign(l.warps.size() * 32, 0);
        l.warp_rounds.assign(l.warps.size() * 32, UINT64_MAX);
        current_launch = &l;
        status = run_launch(l, grid, block, backward != 0);
    } catch (const std::bad_alloc &) {
        status = MEMORY;
    }
    current_launch = outer;
    r3emu_current = outer_thread;
    return status;
}
