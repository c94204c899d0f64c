// What r3's kernels (crates/r3-model/src/cuda/kernels.cu) take from CUDA, for the host: the
// kernel qualifiers, the thread and block indices of the emulated grid (runtime.cpp), its
// barriers and warp shuffles, the atomics, the vector types, and the bf16 / f16 types with
// the conversions of `cuda_bf16.h` / `cuda_fp16.h` (nearest, ties to even; every NaN the
// canonical NaN a GPU's `cvt.rn` writes). Included before the kernels' source, whose own
// includes build.rs strips. Its functions are `static`: each variant's copy keeps the flags
// it was compiled with.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
// Blocks run one after another on one OS thread (their threads as fibers), so a block's
// shared variables are the thread's statics; `thread_local` keeps two tests' grids, on two
// OS threads, apart.
#define __shared__ static thread_local

struct dim3 {
    unsigned x, y, z;
};

// The running fiber's indices (runtime.cpp sets them before resuming it).
struct R3EmuThread {
    dim3 thread_idx;
    dim3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
extern thread_local R3EmuThread *r3emu_current;
#define threadIdx (r3emu_current->thread_idx)
#define blockIdx (r3emu_current->block_idx)
#define blockDim (r3emu_current->block_dim)
#define gridDim (r3emu_current->grid_dim)

extern "C" void r3emu_sync_block();
extern "C" void r3emu_sync_warp();
extern "C" void *r3emu_dynamic_shared();
// The warp exchange of one shuffle (runtime.cpp): the calling lane's 8 bytes out, lane
// (lane ^ lane_mask)'s in; reading a lane that is not in the exchange (exited, or past a
// partial warp's end) is a fault of the launch, as it is undefined on a GPU.
extern "C" uint64_t r3emu_shuffle_xor(uint64_t word, unsigned lane_mask);
// Fills a static `__shared__` variable with 0xff bytes the first time a block's thread
// reaches its declaration (build.rs adds the call after each one): a GPU's shared memory
// holds garbage at a block's start, not the last block's values.
extern "C" void r3emu_fill_shared_once(void *p, size_t bytes);
// Marks the launch faulty (`code` names why: runtime.cpp's R3EMU_FAULT_*); the threads run
// on, the launch returns the first fault.
extern "C" void r3emu_fault(int code);
#define R3EMU_FAULT_MISALIGNED 5

static inline void __syncthreads() { r3emu_sync_block(); }
static inline void __syncwarp(unsigned = 0xffffffffu) { r3emu_sync_warp(); }

template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
    uint64_t word = 0;
    memcpy(&word, &v, sizeof(T));
    const uint64_t other = r3emu_shuffle_xor(word, (unsigned)lane_mask);
    T out;
    memcpy(&out, &other, sizeof(T));
    return out;
}


// One OS thread runs every fiber, so the atomics are plain read-modify-writes.
static inline unsigned atomicOr(unsigned *p, unsigned v) {
    const unsigned old = *p;
    *p = old | v;
    return old;
}
static inline unsigned atomicMax(unsigned *p, unsigned v) {
    const unsigned old = *p;
    *p = old > v ? old : v;
    return old;
}
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
}

template <typename T> static inline T max(T a, T b) { return a > b ? a : b; }
template <typename T> static inline T min(T a, T b) { return a < b ? a : b; }

// The vector types carry no alignment the host compiler could rely on (it would then use
// aligned instructions, and a misaligned access would crash the test instead of being
// reported); the alignment a GPU demands of each is `r3emu_alignment` below, which
// `r3emu_cast` checks.
struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
struct uint4 {
    unsigned x, y, z, w;
};
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}

// The correctly rounded operations (what the `_rn` intrinsics promise; build.rs compiles one
// variant without contraction, where plain expressions are these too).
static inline float __fadd_rn(float a, float b) {
    volatile float r = a + b;
    return r;
}
static inline float __fsub_rn(float a, float b) {
    volatile float r = a - b;
    return r;
}
static inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
static inline float __fdiv_rn(float a, float b) {
    volatile float r = a / b;
    return r;
}
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dadd_rn(double a, double b) {
    volatile double r = a + b;
    return r;
}
static inline double __dsub_rn(double a, double b) {
    volatile double r = a - b;
    return r;
}
static inline double __dmul_rn(double a, double b) {
    volatile double r = a * b;
    return r;
}

struct __nv_bfloat16 {
    uint16_t __x;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
struct __half {
    uint16_t __x;
};
struct alignas(4) __half2 {
    __half x, y;
};

// The alignment a GPU demands of a type read or written through a pointer: its size for
// the vector types (CUDA declares them so), its own alignment otherwise.
template <typename T> struct r3emu_alignment {
    static constexpr size_t value = alignof(T);
};
template <> struct r3emu_alignment<float2> {
    static constexpr size_t value = 8;
};
template <> struct r3emu_alignment<float4> {
    static constexpr size_t value = 16;
};
template <> struct r3emu_alignment<uint4> {
    static constexpr size_t value = 16;
};

// `reinterpret_cast` of a pointer (build.rs rewrites the kernels' casts to this): a vector
// type read or written off its alignment faults on a GPU, so it is a fault here too.
template <typename P, typename S> static inline P r3emu_cast(S *p) {
    using Target = typename std::remove_cv<typename std::remove_pointer<P>::type>::type;
    if (reinterpret_cast<uintptr_t>(p) % r3emu_alignment<Target>::value != 0)
        r3emu_fault(R3EMU_FAULT_MISALIGNED);
    return reinterpret_cast<P>(p);
}

static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }

static inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.__x << 16); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const unsigned b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return {0x7fffu};
    const unsigned rounded = b + 0x7fffu + ((b >> 16) & 1u);
    return {(uint16_t)(rounded >> 16)};
}

static inline float __half2float(__half h) {
    const unsigned sign = (unsigned)(h.__x & 0x8000u) << 16;
    const unsigned exp = (h.__x >> 10) & 0x1fu, mant = h.__x & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
    // Subnormal: mant · 2^-24, exact in f32.
    const float v = (float)mant * 5.9604644775390625e-08f;
    return sign ? -v : v;
}
static inline __half __float2half_rn(float f) {
    const unsigned b = __float_as_uint(f);
    const unsigned sign = (b >> 16) & 0x8000u;
    const unsigned abs = b & 0x7fffffffu;
    if (abs > 0x7f800000u) return {0x7fffu};
    if (abs >= 0x477ff000u) return {(uint16_t)(sign | 0x7c00u)};  // rounds past 65504: ∞
    if (abs < 0x38800000u) {
        // Below f16's smallest normal: a multiple of 2^-24, rounded to nearest even by
        // the f32 sum with 2^-1 · 2^-23 · ... (the classic magic-number trick).
        const float magic = 0.5f;
        const float v = __uint_as_float(abs) + magic;
        return {(uint16_t)(sign | (__float_as_uint(v) - __float_as_uint(magic)))};
    }
    const unsigned odd = (abs >> 13) & 1u;
    const unsigned r = abs + ((unsigned)(15 - 127) << 23) + 0xfffu + odd;
    return {(uint16_t)(sign | (r >> 13))};
}

static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
static inline __half2 __floats2half2_rn(float a, float b) {
    return {__float2half_rn(a), __float2half_rn(b)};
}
static inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
static inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
