// The emulated grid: a launch runs its blocks one after another on the calling OS thread,
// each block's threads as fibers (ucontext) that switch only at a barrier (`__syncthreads`,
// a warp's shuffle or `__syncwarp`) or when they finish. The fibers are resumed in the
// order the caller asks (forward or backward through the block), so a kernel whose result
// depends on which thread runs first (a missing barrier) gives two answers for the two
// orders. A barrier no live thread can pass (threads waiting at different barriers) ends
// the launch with an error rather than hanging.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <vector>

#include "cuda_shim.h"

thread_local R3EmuThread *r3emu_current = nullptr;

namespace {

constexpr size_t STACK_BYTES = 256 * 1024;

enum class Wait { None, Block, Warp };

struct Fiber {
    ucontext_t context;
    void *stack = nullptr;
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
    std::vector<uint64_t> warp_slots;
    std::vector<unsigned char> dynamic_shared;
    ucontext_t scheduler;
    size_t running = 0;
};

thread_local Launch *current_launch = nullptr;

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

// Arrive at `g`: the last live thread to arrive releases the others; the rest yield until
// the generation moves on.
void arrive(Group &g, Wait kind) {
    Launch *l = current_launch;
    Fiber &f = l->fibers[l->running];
    g.arrived++;
    if (g.arrived >= g.live) {
        g.arrived = 0;
        g.generation++;
        return;
    }
    f.wait = kind;
    f.wait_generation = g.generation;
    swapcontext(&f.context, &l->scheduler);
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

}  // namespace

extern "C" void r3emu_sync_block() { arrive(current_launch->block, Wait::Block); }

extern "C" void r3emu_sync_warp() {
    Launch *l = current_launch;
    arrive(l->warps[l->fibers[l->running].thread.thread_idx.x / 32], Wait::Warp);
}

extern "C" void *r3emu_dynamic_shared() { return current_launch->dynamic_shared.data(); }

extern "C" unsigned r3emu_lane() { return r3emu_current->thread_idx.x & 31u; }

extern "C" uint64_t *r3emu_warp_slot(unsigned lane) {
    Launch *l = current_launch;
    const unsigned warp = l->fibers[l->running].thread.thread_idx.x / 32;
    return &l->warp_slots[warp * 32 + lane];
}

// Runs `body(data)` as every thread of a grid of `grid` blocks of `block` threads (x, y, z;
// threads numbered x fastest, only x-major blocks of at most 1,024 threads), with
// `shared_bytes` of dynamic shared memory (filled with 0xff bytes: a NaN in every f32, so a
// read of what no thread wrote shows). `backward` resumes a block's threads last to first.
// Returns 0, or 1 when a block deadlocked at a barrier, 2 for a bad shape, 3 when a fiber's
// stack could not be mapped.
extern "C" int r3emu_launch(const unsigned *grid, const unsigned *block, size_t shared_bytes,
                            int backward, void (*body)(const void *), const void *data) {
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024 || block[1] != 1 || block[2] != 1) return 2;
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return 2;
    Launch l;
    l.body = body;
    l.data = data;
    l.fibers.resize(threads);
    l.warps.resize((threads + 31) / 32);
    l.warp_slots.assign(l.warps.size() * 32, 0);
    Launch *outer = current_launch;
    R3EmuThread *outer_thread = r3emu_current;
    current_launch = &l;
    int status = 0;
    for (Fiber &f : l.fibers) {
        f.stack = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f.stack == MAP_FAILED) {
            f.stack = nullptr;
            status = 3;
        }
    }
    for (unsigned bz = 0; bz < grid[2] && status == 0; bz++) {
        for (unsigned by = 0; by < grid[1] && status == 0; by++) {
            for (unsigned bx = 0; bx < grid[0] && status == 0; bx++) {
                l.dynamic_shared.assign(shared_bytes, 0xff);
                l.block = Group{threads, 0, 0};
                for (size_t w = 0; w < l.warps.size(); w++) {
                    const unsigned first = (unsigned)w * 32;
                    l.warps[w] = Group{threads - first < 32 ? threads - first : 32, 0, 0};
                }
                for (unsigned t = 0; t < threads; t++) {
                    Fiber &f = l.fibers[t];
                    f.done = false;
                    f.wait = Wait::None;
                    f.thread = R3EmuThread{{t, 0, 0},
                                           {bx, by, bz},
                                           {block[0], block[1], block[2]},
                                           {grid[0], grid[1], grid[2]}};
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = f.stack;
                    f.context.uc_stack.ss_size = STACK_BYTES;
                    f.context.uc_link = &l.scheduler;
                    makecontext(&f.context, fiber_main, 0);
                }
                unsigned remaining = threads;
                while (remaining > 0) {
                    bool progressed = false;
                    for (unsigned i = 0; i < threads; i++) {
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
                        if (!any) {
                            status = 1;
                            break;
                        }
                    }
                }
            }
        }
    }
    for (Fiber &f : l.fibers) {
        if (f.stack) munmap(f.stack, STACK_BYTES);
    }
    current_launch = outer;
    r3emu_current = outer_thread;
    return status;
}
