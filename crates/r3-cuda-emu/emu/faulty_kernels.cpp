// Kernels with the faults the emulator exists to show, for its own tests (tests/emulator.rs):
// a read of shared memory with no barrier after the write, and a barrier one thread waits at
// while its warp waits for it in a shuffle.
#include "cuda_shim.h"

// out[b] = the value thread 0 of block b wrote to shared memory, read by the last thread with
// no barrier between: it sees the write only if thread 0 ran first.
extern "C" void r3emu_faulty_unsynced_read(float *out) {
    __shared__ float cell;
    if (threadIdx.x == 0) cell = 1.0f;
    if (threadIdx.x == blockDim.x - 1) {
        out[blockIdx.x] = cell;
        cell = 0.0f;
    }
}

// The same with the barrier: always 1.
extern "C" void r3emu_synced_read(float *out) {
    __shared__ float cell;
    if (threadIdx.x == 0) cell = 1.0f;
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) out[blockIdx.x] = cell;
    __syncthreads();
    if (threadIdx.x == 0) cell = 0.0f;
}

// Thread 0 waits at the block's barrier while the rest of its warp shuffles: the warp's
// exchange waits for thread 0, thread 0 for the warp.
extern "C" void r3emu_faulty_split_barrier(float *out) {
    if (threadIdx.x == 0) {
        __syncthreads();
        out[0] = 0.0f;
    } else {
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
    }
}

// Lanes 16 and up finish at once; lanes below 16 shuffle with lane + 16, which is gone.
extern "C" void r3emu_faulty_shuffle_of_exited_lanes(float *out) {
    if ((threadIdx.x & 31u) >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 16);
}

// Thread 1 writes a shared cell after the block's barrier, thread 0 reads it with no second
// barrier: after a barrier the threads must leave in the launch's order, so the two orders
// disagree (a reader before a writer, or after).
extern "C" void r3emu_faulty_read_after_barrier(float *out) {
    __shared__ float cell;
    if (threadIdx.x == 0) cell = 0.0f;
    __syncthreads();
    if (threadIdx.x == 1) cell = 1.0f;
    if (threadIdx.x == 0) out[blockIdx.x] = cell;
}

// Each thread writes one float at its index into the dynamic shared memory: past its end
// when the launch asks for fewer bytes than threads.
extern "C" void r3emu_faulty_dynamic_shared_write(float *out) {
    float *smem = static_cast<float *>(r3emu_dynamic_shared());
    smem[threadIdx.x] = 1.0f;
    out[threadIdx.x] = 0.0f;
}
