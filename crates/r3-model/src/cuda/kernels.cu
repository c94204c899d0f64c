// r3's own CUDA kernels: row-wise passes that candle composes from several kernels, each of
// which (when it broadcasts) computes strided indices per element. Each kernel mirrors a CPU
// implementation in r3-model (named beside it) that the CPU tests check against candle's
// composed ops; the device tests check these against the CPU. Compiled to PTX by build.rs
// (feature `cuda`), loaded by `cuda/mod.rs`.
#include <stdint.h>
#include <math.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// fmaxf's NaN rule (a NaN operand loses) across the block, as the per-thread maxima use it.
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

template <typename T, typename Op> __device__ __forceinline__ T warp_reduce(T v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reduction for a blockDim.x that is a multiple of 32 (≤ 1024); every thread gets
// the result. `identity` is the reduction's neutral value; `shared` holds 32 values.
template <typename T, typename Op>
__device__ T block_reduce(T v, T identity, T *shared, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : identity;
    if (warp == 0) v = warp_reduce(v, op);
    if (threadIdx.x == 0) shared[0] = v;
    __syncthreads();
    const T r = shared[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float *shared) { return block_reduce(v, -INFINITY, shared, MaxOp()); }
__device__ float block_sum(float v, float *shared) { return block_reduce(v, 0.0f, shared, SumOp()); }
__device__ double block_sum_f64(double v, double *shared) { return block_reduce(v, 0.0, shared, SumOp()); }

// The largest of a row's `n` values, every thread of the block reading its strided share
// (fmaxf: a NaN loses); every thread gets it.
__device__ float block_row_max(const float *z, uint32_t n, float *shared) {
    float m = -INFINITY;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, z[j]);
    return block_max(m, shared);
}

// One block per row of `scores` [rows, cols]: probs = softmax(scores · scale + mask) over the
// row, the mask row of batch b and query t (`mask` [B, T, cols], rows ordered (b, head, t)
// with `rows_per_batch` = heads · T). CPU twin: layers/attention/softmax.rs
// `masked_softmax_rows`.
extern "C" __global__ void r3_masked_softmax_f32(const float *scores, const float *mask,
                                                 float *probs, float scale, uint32_t cols,
                                                 uint32_t t_rows, uint32_t rows_per_batch) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const size_t b = row / rows_per_batch, t = row % t_rows;
    const float *s = scores + row * cols;
    const float *mk = mask + (b * t_rows + t) * cols;
    float *p = probs + row * cols;
    float m = -INFINITY;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, s[j] * scale + mk[j]);
    m = block_max(m, shared);
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) {
        const float e = expf((s[j] * scale + mk[j]) - m);
        p[j] = e;
        sum += e;
    }
    sum = block_sum(sum, shared);
    // Each thread divides the entries it wrote itself: no barrier needed.
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) p[j] = p[j] / sum;
}

// ds = p ⊙ (dp − row_dot[row]) elementwise over [rows, cols] (the softmax backward with each
// row's Σ dO ⊙ O). CPU twin: layers/attention/softmax.rs `softmax_grad_rows`.
extern "C" __global__ void r3_softmax_grad_f32(const float *p, const float *dp,
                                               const float *row_dot, float *ds, uint32_t cols,
                                               size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        ds[i] = p[i] * (dp[i] - row_dot[i / cols]);
    }
}

// One block per row of `logits` [rows, vocab]: logp[row] = (z[t] − max) − log Σ exp(z − max)
// for the row's target t (NaN for a target past the vocabulary). CPU twin: token_rows.rs
// `token_logp_rows`.
extern "C" __global__ void r3_token_logprob_f32(const float *logits, const uint32_t *targets,
                                                float *logp, uint32_t vocab) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const float *z = logits + row * vocab;
    const float m = block_row_max(z, vocab, shared);
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(z[j] - m);
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) {
        const uint32_t t = targets[row];
        logp[row] = t < vocab ? (z[t] - m) - logf(sum) : NAN;
    }
}

// One block per row: d z_j = −g · exp(z_j − lse) + g · 1[j = t], with each row's (lse, g)
// in `row_stats` [rows, 2]. CPU twin: token_rows.rs `token_logp_grad_rows`.
extern "C" __global__ void r3_token_logprob_grad_f32(const float *logits,
                                                     const uint32_t *targets,
                                                     const float *row_stats, float *d,
                                                     uint32_t vocab) {
    const size_t row = blockIdx.x;
    const float *z = logits + row * vocab;
    float *out = d + row * vocab;
    const float lse = row_stats[2 * row], g = row_stats[2 * row + 1];
    const uint32_t t = targets[row];
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = 0.0f - g * expf(z[j] - lse);
        if (j == t) v = v + g;
        out[j] = v;
    }
}

// One block per row of `logits` [rows, vocab]: the entropy −Σ p log p of the row's softmax
// and its log-sum-exp, stats[row] = (H, lse). With m the row's max, S = Σ exp(z − m) and
// T = Σ exp(z − m)·(z − m): lse = m + log S and H = log S − T / S (Σ p z − lse rearranged,
// with no cancellation between two large terms); a −∞ logit (p = 0) adds nothing. CPU twin:
// token_rows.rs `entropy_rows`.
extern "C" __global__ void r3_entropy_rows_f32(const float *logits, float *stats,
                                               uint32_t vocab) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const float *z = logits + row * vocab;
    const float m = block_row_max(z, vocab, shared);
    float s = 0.0f, t = 0.0f;
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float d = z[j] - m;
        const float e = expf(d);
        s += e;
        if (e > 0.0f) t += e * d;
    }
    s = block_sum(s, shared);
    t = block_sum(t, shared);
    if (threadIdx.x == 0) {
        const float log_s = logf(s);
        stats[2 * row] = log_s - t / s;
        stats[2 * row + 1] = m + log_s;
    }
}

// One block per row: d z_j = −g · p_j · (log p_j + H), p_j = exp(z_j − lse), with each row's
// (H, lse) in `stats` [rows, 2] and its gradient g in `grad` [rows]; 0 where p_j is (a −∞
// logit). CPU twin: token_rows.rs `entropy_grad_rows`.
extern "C" __global__ void r3_entropy_grad_f32(const float *logits, const float *stats,
                                               const float *grad, float *d, uint32_t vocab) {
    const size_t row = blockIdx.x;
    const float *z = logits + row * vocab;
    float *out = d + row * vocab;
    const float h = stats[2 * row], lse = stats[2 * row + 1], g = grad[row];
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float lp = z[j] - lse;
        const float p = expf(lp);
        out[j] = p > 0.0f ? 0.0f - g * p * (lp + h) : 0.0f;
    }
}

// f32 → bf16 / f16 (nearest, ties to even: the conversions candle's casts use) and back,
// four elements a thread with 16-byte loads (candle's cast kernels convert one element a
// thread, reading `info` per element; its bf16 → f32 cast ran at ≈ 0.6 TB/s on an H200).
// Narrowing, `x` (f32, float4 loads) starts 16-byte and `y` (16-bit) 8-byte aligned;
// widening, `x` (16-bit) 8-byte and `y` (f32, float4 stores) 16-byte aligned (the caller
// checks the offsets: a multiple of four elements). CPU twin: the CPU's casts (cast16.rs
// `Cast16`).
__device__ __forceinline__ void store2(__nv_bfloat162 *p, float a, float b) { *p = __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ void store2(__half2 *p, float a, float b) { *p = __floats2half2_rn(a, b); }
__device__ __forceinline__ void store1(__nv_bfloat16 *p, float a) { *p = __float2bfloat16_rn(a); }
__device__ __forceinline__ void store1(__half *p, float a) { *p = __float2half_rn(a); }
__device__ __forceinline__ float2 load2(const __nv_bfloat162 *p) { return __bfloat1622float2(*p); }
__device__ __forceinline__ float2 load2(const __half2 *p) { return __half22float2(*p); }
__device__ __forceinline__ float load1(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load1(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ float load1(const float *p) { return *p; }
__device__ __forceinline__ void store1(float *p, float a) { *p = a; }

// H the 16-bit float, H2 its pair type.
template <typename H, typename H2> __device__ void narrow_quads(const float *x, H *y, size_t n) {
    const size_t quads = n / 4, stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < quads; i += stride) {
        const float4 v = reinterpret_cast<const float4 *>(x)[i];
        H2 *out = reinterpret_cast<H2 *>(y) + 2 * i;
        store2(out, v.x, v.y);
        store2(out + 1, v.z, v.w);
    }
    for (size_t i = 4 * quads + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        store1(y + i, x[i]);
}

template <typename H, typename H2> __device__ void widen_quads(const H *x, float *y, size_t n) {
    const size_t quads = n / 4, stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < quads; i += stride) {
        const H2 *in = reinterpret_cast<const H2 *>(x) + 2 * i;
        const float2 a = load2(in), b = load2(in + 1);
        reinterpret_cast<float4 *>(y)[i] = make_float4(a.x, a.y, b.x, b.y);
    }
    for (size_t i = 4 * quads + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = load1(x + i);
}

extern "C" __global__ void r3_narrow_bf16(const float *x, __nv_bfloat16 *y, size_t n) {
    narrow_quads<__nv_bfloat16, __nv_bfloat162>(x, y, n);
}
extern "C" __global__ void r3_narrow_f16(const float *x, __half *y, size_t n) {
    narrow_quads<__half, __half2>(x, y, n);
}
extern "C" __global__ void r3_widen_bf16(const __nv_bfloat16 *x, float *y, size_t n) {
    widen_quads<__nv_bfloat16, __nv_bfloat162>(x, y, n);
}
extern "C" __global__ void r3_widen_f16(const __half *x, float *y, size_t n) {
    widen_quads<__half, __half2>(x, y, n);
}

// y = x narrowed to bf16 / f16 (nearest, ties to even), and *inexact set to 1 where a value
// does not widen back to itself (a NaN never does): a gradient kept in 16 bits only where
// that holds it exactly, checked in the same pass that narrows it. CPU twin: narrow_grads.rs
// `narrow_on_host`.
template <typename H> __device__ void narrow_exact(const float *x, H *y, uint32_t *inexact, size_t n) {
    bool exact = true;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float v = x[i];
        H h;
        store1(&h, v);
        y[i] = h;
        exact = exact && load1(&h) == v;
    }
    if (!exact) atomicOr(inexact, 1u);
}

extern "C" __global__ void r3_narrow_exact_bf16(const float *x, __nv_bfloat16 *y,
                                                uint32_t *inexact, size_t n) {
    narrow_exact<__nv_bfloat16>(x, y, inexact, n);
}
extern "C" __global__ void r3_narrow_exact_f16(const float *x, __half *y, uint32_t *inexact,
                                               size_t n) {
    narrow_exact<__half>(x, y, inexact, n);
}

// y = x rounded to bf16 / f16 (nearest, ties to even) and widened back to f32, one pass
// (candle's cast pair is two kernels and a 16-bit buffer). CPU twin: precision.rs `RoundTo`.
extern "C" __global__ void r3_round_bf16_f32(const float *x, float *y, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        y[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
    }
}

extern "C" __global__ void r3_round_f16_f32(const float *x, float *y, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        y[i] = __half2float(__float2half_rn(x[i]));
    }
}

// v rounded to bf16 (round 1) or f16 (round 2), nearest, ties to even, as f32; v as it is
// (round 0). The conversions of `r3_round_bf16_f32` / `r3_round_f16_f32`.
__device__ __forceinline__ float rounded_as(float v, uint32_t round) {
    if (round == 1) return __bfloat162float(__float2bfloat16_rn(v));
    if (round == 2) return __half2float(__float2half_rn(v));
    return v;
}

// y = a + b rounded by `rounded_as` (the residual stream's rounding point), one pass. CPU
// twin: precision.rs `AddRounded`.
extern "C" __global__ void r3_add_rounded_f32(const float *a, const float *b, float *y, size_t n,
                                              uint32_t round) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        y[i] = rounded_as(a[i] + b[i], round);
    }
}

// 1 / sqrt(mean(x²) + eps) of a row of `d`, the squares summed in f64 (every thread gets it).
__device__ float row_inv_rms(const float *x, uint32_t d, double eps, double *shared) {
    double acc = 0.0;
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = x[j];
        acc += (double)(v * v);
    }
    acc = block_sum_f64(acc, shared);
    return (float)(1.0 / sqrt(acc / (double)d + eps));
}

// One block per row: y = x · r · w, with the scale w read rounded and y rounded (a mixed
// forward's two rounding points in the same pass) when `round` names a 16-bit float. CPU
// twin: norm.rs `RmsNormOp::cpu_fwd` (`rms_fwd`).
extern "C" __global__ void r3_rms_norm_f32(const float *x, const float *w, float *y, uint32_t d,
                                           double eps, uint32_t round) {
    __shared__ double shared[32];
    const size_t row = blockIdx.x;
    const float *xr = x + row * d;
    float *yr = y + row * d;
    const float r = row_inv_rms(xr, d, eps, shared);
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x)
        yr[j] = rounded_as(xr[j] * r * rounded_as(w[j], round), round);
}

// One block per row: dx = r · (g·w − x·r · mean(g·w·x̂)), the mean's sum in f64. CPU twin:
// norm.rs `rms_bwd_parts` (its dx).
extern "C" __global__ void r3_rms_norm_dx_f32(const float *x, const float *w, const float *g,
                                              float *dx, uint32_t d, double eps) {
    __shared__ double shared[32];
    const size_t row = blockIdx.x;
    const float *xr = x + row * d, *gr = g + row * d;
    float *dxr = dx + row * d;
    const float r = row_inv_rms(xr, d, eps, shared);
    double dot = 0.0;
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) {
        const float xhat = xr[j] * r;
        dot += (double)(gr[j] * w[j] * xhat);
    }
    dot = block_sum_f64(dot, shared);
    const float mean = (float)(dot / (double)d);
    // `_rn`: nvcc would contract g·w − x·r·mean into an FMA and the CPU's bits would be lost.
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) {
        dxr[j] = r * __fsub_rn(__fmul_rn(gr[j], w[j]), __fmul_rn(__fmul_rn(xr[j], r), mean));
    }
}

// One block per chunk of `chunk_rows` rows: the chunk's weight-gradient sum
// Σ_rows g · (x · r) per column, rows added in order (the caller sums the chunks). CPU twin:
// norm.rs `rms_bwd_parts` (its per-chunk partials). At most 64 rows per chunk. The rows'
// inverse RMS values are computed a warp per row, the warps side by side (one block-wide
// reduction per row, one row after another, took 0.19 ms a chunk of mid's [4096, 512] on an
// H200: 64 blocks each waiting on 64 reductions in turn).
extern "C" __global__ void r3_rms_norm_dw_chunks_f32(const float *x, const float *g,
                                                     float *parts, uint32_t rows, uint32_t d,
                                                     uint32_t chunk_rows, double eps) {
    __shared__ float inv[64];
    const uint32_t first = blockIdx.x * chunk_rows;
    const uint32_t n = min(chunk_rows, rows - first);
    const uint32_t lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (uint32_t i = threadIdx.x >> 5; i < n; i += warps) {
        const float *xr = x + (size_t)(first + i) * d;
        double acc = 0.0;
        for (uint32_t j = lane; j < d; j += 32) {
            const float v = xr[j];
            acc += (double)(v * v);
        }
        acc = warp_reduce(acc, SumOp());
        if (lane == 0) inv[i] = (float)(1.0 / sqrt(acc / (double)d + eps));
    }
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
            const size_t at = (size_t)(first + i) * d + j;
            // `_rn`: nvcc would contract acc + g·x̂ into an FMA and the CPU's bits would be lost.
            acc = __fadd_rn(acc, __fmul_rn(g[at], __fmul_rn(x[at], inv[i])));
        }
        parts[(size_t)blockIdx.x * d + j] = acc;
    }
}

// out[r] = src[ids[r]], whole rows (layers/gather_rows.rs `GatherRows`): one block per output
// row, 16-byte copies (`Wide`) when `wide` (the row a multiple of a 16-byte word's values, the
// source on a 16-byte boundary). candle's index_select computes a strided index per element:
// ≈ 0.1 ms for a mid layer's 16 k rows of 512 on an H200. CPU twins: gather_rows.rs `gather`
// (f32), candle's index_select (16-bit rows, moved as their bits).
template <typename T, typename Wide>
__device__ void gather_rows(const T *src, const uint32_t *ids, T *out, uint32_t row,
                            uint32_t wide) {
    const size_t r = blockIdx.x;
    const T *s = src + (size_t)ids[r] * row;
    T *o = out + r * row;
    if (wide) {
        constexpr uint32_t per = sizeof(Wide) / sizeof(T);
        const Wide *sw = reinterpret_cast<const Wide *>(s);
        Wide *ow = reinterpret_cast<Wide *>(o);
        for (uint32_t j = threadIdx.x; j < row / per; j += blockDim.x) ow[j] = sw[j];
    } else {
        for (uint32_t j = threadIdx.x; j < row; j += blockDim.x) o[j] = s[j];
    }
}
extern "C" __global__ void r3_gather_rows_f32(const float *src, const uint32_t *ids, float *out,
                                              uint32_t row, uint32_t quads) {
    gather_rows<float, float4>(src, ids, out, row, quads);
}
// The padded experts gather their rows narrow (cast once, then gathered: half the bytes of
// gathering f32 rows): bf16 or f16 rows as 16-bit words, eight to a 16-byte copy.
extern "C" __global__ void r3_gather_rows_u16(const uint16_t *src, const uint32_t *ids,
                                              uint16_t *out, uint32_t row, uint32_t octs) {
    gather_rows<uint16_t, uint4>(src, ids, out, row, octs);
}

// The row gather's backward (layers/gather_rows.rs GatherSum). One block per source row q:
// rows below grad_rows get the sum of their uses' gradient rows, uses[offsets[q] ..
// offsets[q + 1]] in order, from zero; the rest zero. CPU twin: gather_rows.rs
// `gather_sum_host`.
// The gradient rows may be 16-bit (the padded experts' input gradient, in the GEMMs' float):
// each widened as it is read, the values of widening them first, summed in f32.
template <typename G>
__device__ void gather_sum_rows(const G *grad, const uint32_t *offsets, const uint32_t *uses,
                                float *out, uint32_t row, uint32_t grad_rows) {
    const size_t q = blockIdx.x;
    float *o = out + q * row;
    if (q >= grad_rows) {
        for (uint32_t c = threadIdx.x; c < row; c += blockDim.x) o[c] = 0.0f;
        return;
    }
    const uint32_t begin = offsets[q], end = offsets[q + 1];
    for (uint32_t c = threadIdx.x; c < row; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t j = begin; j < end; j++) acc = acc + load1(grad + (size_t)uses[j] * row + c);
        o[c] = acc;
    }
}
extern "C" __global__ void r3_gather_sum_rows_f32(const float *grad, const uint32_t *offsets,
                                                  const uint32_t *uses, float *out, uint32_t row,
                                                  uint32_t grad_rows) {
    gather_sum_rows(grad, offsets, uses, out, row, grad_rows);
}
extern "C" __global__ void r3_gather_sum_rows_bf16(const __nv_bfloat16 *grad,
                                                   const uint32_t *offsets, const uint32_t *uses,
                                                   float *out, uint32_t row, uint32_t grad_rows) {
    gather_sum_rows(grad, offsets, uses, out, row, grad_rows);
}
extern "C" __global__ void r3_gather_sum_rows_f16(const __half *grad, const uint32_t *offsets,
                                                  const uint32_t *uses, float *out, uint32_t row,
                                                  uint32_t grad_rows) {
    gather_sum_rows(grad, offsets, uses, out, row, grad_rows);
}

// The routed experts' combine (layers/moe/combine_slots.rs). One block per row: out[r] =
// Σ_j g[r, j] · y[place[r, j]], products added in slot order from zero. The expert outputs y
// may be f32 or 16-bit (the padded experts hold theirs in the GEMMs' dtype): widened exactly
// as they are read, the values of a widen kernel before the f32 form. CPU twin:
// combine_slots.rs `combine_rows`.
template <typename Y>
__device__ void combine_slots(const Y *y, const float *g, const uint32_t *place, float *out,
                              uint32_t k, uint32_t h) {
    const size_t r = blockIdx.x;
    for (uint32_t c = threadIdx.x; c < h; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            // `_rn`: nvcc would contract acc + g·y into an FMA and the CPU's bits would be lost.
            const float v = load1(y + (size_t)place[r * k + j] * h + c);
            acc = __fadd_rn(acc, __fmul_rn(g[r * k + j], v));
        }
        out[r * h + c] = acc;
    }
}
extern "C" __global__ void r3_combine_slots_f32(const float *y, const float *g,
                                                const uint32_t *place, float *out, uint32_t k,
                                                uint32_t h) {
    combine_slots(y, g, place, out, k, h);
}
extern "C" __global__ void r3_combine_slots_bf16(const __nv_bfloat16 *y, const float *g,
                                                 const uint32_t *place, float *out, uint32_t k,
                                                 uint32_t h) {
    combine_slots(y, g, place, out, k, h);
}
extern "C" __global__ void r3_combine_slots_f16(const __half *y, const float *g,
                                                const uint32_t *place, float *out, uint32_t k,
                                                uint32_t h) {
    combine_slots(y, g, place, out, k, h);
}

// The combine for slots in order (place r·k + j for slot j of row r: a device-routed decode
// step), nothing uploaded; the output rounded by `rounded_as` (a mixed forward's rounding of
// the block output in the same pass). CPU twin: combine_slots.rs `CombineInOrder::cpu_fwd`.
// The expert outputs y may be f32 or 16-bit (widened exactly as they are read: the values
// of a widen kernel before the f32 form).
template <typename Y>
__device__ void combine_in_order(const Y *y, const float *g, float *out, uint32_t k, uint32_t h,
                                 uint32_t round) {
    const size_t r = blockIdx.x;
    for (uint32_t c = threadIdx.x; c < h; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            // `_rn`: nvcc would contract acc + g·y into an FMA and the CPU's bits would be lost.
            acc = __fadd_rn(acc, __fmul_rn(g[r * k + j], load1(y + (r * k + j) * h + c)));
        }
        out[r * h + c] = rounded_as(acc, round);
    }
}
extern "C" __global__ void r3_combine_in_order_f32(const float *y, const float *g, float *out,
                                                   uint32_t k, uint32_t h, uint32_t round) {
    combine_in_order(y, g, out, k, h, round);
}
extern "C" __global__ void r3_combine_in_order_bf16(const __nv_bfloat16 *y, const float *g,
                                                    float *out, uint32_t k, uint32_t h,
                                                    uint32_t round) {
    combine_in_order(y, g, out, k, h, round);
}
extern "C" __global__ void r3_combine_in_order_f16(const __half *y, const float *g, float *out,
                                                   uint32_t k, uint32_t h, uint32_t round) {
    combine_in_order(y, g, out, k, h, round);
}

// One block per place p: dy[p] = g[s] · dout[s / k] for the slot s reading p, zeros where
// none does (s == none), written as f32 or rounded to the 16-bit float the down GEMMs'
// gradients read (nearest, ties to even: the values of the narrowing kernel after the f32
// form). CPU twin: combine_slots.rs `combine_dy_rows`, then the cast.
template <typename D>
__device__ void combine_slots_dy(const float *dout, const float *g, const uint32_t *slot_of_place,
                                 D *dy, uint32_t k, uint32_t h, uint32_t none) {
    const size_t p = blockIdx.x;
    const uint32_t s = slot_of_place[p];
    for (uint32_t c = threadIdx.x; c < h; c += blockDim.x) {
        store1(dy + p * h + c, s == none ? 0.0f : g[s] * dout[(size_t)(s / k) * h + c]);
    }
}
extern "C" __global__ void r3_combine_slots_dy_f32(const float *dout, const float *g,
                                                   const uint32_t *slot_of_place, float *dy,
                                                   uint32_t k, uint32_t h, uint32_t none) {
    combine_slots_dy(dout, g, slot_of_place, dy, k, h, none);
}
extern "C" __global__ void r3_combine_slots_dy_bf16(const float *dout, const float *g,
                                                    const uint32_t *slot_of_place,
                                                    __nv_bfloat16 *dy, uint32_t k, uint32_t h,
                                                    uint32_t none) {
    combine_slots_dy(dout, g, slot_of_place, dy, k, h, none);
}
extern "C" __global__ void r3_combine_slots_dy_f16(const float *dout, const float *g,
                                                   const uint32_t *slot_of_place, __half *dy,
                                                   uint32_t k, uint32_t h, uint32_t none) {
    combine_slots_dy(dout, g, slot_of_place, dy, k, h, none);
}

// One block per slot s: dg[s] = dout[s / k] · y[place[s]] (a block reduction), y f32 or
// 16-bit widened as it is read. CPU twin: combine_slots.rs `combine_dgates_rows` (which sums
// in order).
template <typename Y>
__device__ void combine_slots_dgates(const Y *y, const float *dout, const uint32_t *place,
                                     float *dg, uint32_t k, uint32_t h) {
    __shared__ float shared[32];
    const size_t s = blockIdx.x;
    const Y *yr = y + (size_t)place[s] * h;
    const float *dr = dout + (s / k) * h;
    float acc = 0.0f;
    for (uint32_t c = threadIdx.x; c < h; c += blockDim.x) acc = acc + load1(yr + c) * dr[c];
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) dg[s] = acc;
}
extern "C" __global__ void r3_combine_slots_dgates_f32(const float *y, const float *dout,
                                                       const uint32_t *place, float *dg,
                                                       uint32_t k, uint32_t h) {
    combine_slots_dgates(y, dout, place, dg, k, h);
}
extern "C" __global__ void r3_combine_slots_dgates_bf16(const __nv_bfloat16 *y,
                                                        const float *dout,
                                                        const uint32_t *place, float *dg,
                                                        uint32_t k, uint32_t h) {
    combine_slots_dgates(y, dout, place, dg, k, h);
}
extern "C" __global__ void r3_combine_slots_dgates_f16(const __half *y, const float *dout,
                                                       const uint32_t *place, float *dg,
                                                       uint32_t k, uint32_t h) {
    combine_slots_dgates(y, dout, place, dg, k, h);
}

// The token embedding's backward (layers/embedding_rows.rs). One block per vocabulary row v:
// d[v] = Σ grad[p] over v's positions order[offsets[v] .. offsets[v + 1]], added in order
// from zero; zeros for a token the batch does not use. CPU twin: embedding_rows.rs
// `table_gradient_rows`.
extern "C" __global__ void r3_embedding_grad_f32(const float *grad, const uint32_t *offsets,
                                                 const uint32_t *order, float *d, uint32_t h) {
    const size_t v = blockIdx.x;
    const uint32_t from = offsets[v], to = offsets[v + 1];
    for (uint32_t c = threadIdx.x; c < h; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t i = from; i < to; i++) acc = acc + grad[(size_t)order[i] * h + c];
        d[v * h + c] = acc;
    }
}

// SwiGLU over a gate-up projection's halves (layers/moe/swiglu_halves.rs): y[r, j] = silu(g) · u
// with g = h[r, j], u = h[r, I + j], silu(g) = g / (1 + exp(−g)) as candle computes it, then
// rounded by `rounded_as` (round 0: as it is; 1 / 2: the bf16 / f16 rounding point that
// follows it, `swiglu_halves_rounded`). CPU twin: swiglu_halves.rs `swiglu_rows` (then
// `round16::round_in_place`).
__device__ __forceinline__ float silu_of(float g) { return g / (1.0f + expf(-g)); }

extern "C" __global__ void r3_swiglu_f32(const float *h, float *y, size_t n, uint32_t half,
                                         uint32_t round) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = i / half, j = i % half;
        const float g = h[r * 2 * half + j], u = h[r * 2 * half + half + j];
        y[i] = rounded_as(silu_of(g) * u, round);
    }
}

// r3_swiglu_f32 over 16-bit halves, written in the same 16-bit float (nearest, ties to
// even): a device-routed decode step's experts keep their activations in the format their
// GEMMs read and write, with the f32 arithmetic of r3_swiglu_f32 between (the values of
// widen → r3_swiglu_f32 → narrow, two kernels fewer). CPU twin: swiglu_halves.rs
// `SwigluHalvesNarrow::cpu_fwd`.
template <typename H>
__device__ void swiglu_narrow(const H *h, H *y, size_t n, uint32_t half) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = i / half, j = i % half;
        const float g = load1(h + r * 2 * half + j), u = load1(h + r * 2 * half + half + j);
        store1(y + i, silu_of(g) * u);
    }
}
extern "C" __global__ void r3_swiglu_narrow_bf16(const __nv_bfloat16 *h, __nv_bfloat16 *y,
                                                 size_t n, uint32_t half) {
    swiglu_narrow(h, y, n, half);
}
extern "C" __global__ void r3_swiglu_narrow_f16(const __half *h, __half *y, size_t n,
                                                uint32_t half) {
    swiglu_narrow(h, y, n, half);
}

// Its backward, both halves of dh from d [rows, I]: d gate = d · u · σ(g) · (1 + g · (1 − σ(g))),
// d up = d · silu(g). CPU twin: swiglu_halves.rs `swiglu_grad_rows`.
extern "C" __global__ void r3_swiglu_grad_f32(const float *h, const float *d, float *dh, size_t n,
                                              uint32_t half) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = i / half, j = i % half;
        const size_t at = r * 2 * half + j;
        const float g = h[at], u = h[at + half], dd = d[i];
        const float s = 1.0f / (1.0f + expf(-g));
        // `_rn`: nvcc would contract 1 + g·(1 − s) into an FMA and the CPU's bits would be lost.
        dh[at] = dd * u * (s * __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
        dh[at + half] = dd * silu_of(g);
    }
}

// r3_swiglu_grad_f32 over 16-bit halves and a 16-bit gradient, dh written in the same 16-bit
// float (nearest, ties to even): the padded experts hold their gate-up output and receive
// the SwiGLU's gradient in the GEMMs' float, whose weight and input gradients read dh in it
// (the values of widen → r3_swiglu_grad_f32 → narrow, without the f32 copies). CPU twin:
// swiglu_halves.rs `SwigluGrad::cpu_fwd` (its 16-bit operands' branch).
template <typename H>
__device__ void swiglu_grad_narrow(const H *h, const H *d, H *dh, size_t n, uint32_t half) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = i / half, j = i % half;
        const size_t at = r * 2 * half + j;
        const float g = load1(h + at), u = load1(h + at + half), dd = load1(d + i);
        const float s = 1.0f / (1.0f + expf(-g));
        // `_rn`: nvcc would contract 1 + g·(1 − s) into an FMA and the CPU's bits would be lost.
        store1(dh + at, dd * u * (s * __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s)))));
        store1(dh + at + half, dd * silu_of(g));
    }
}
extern "C" __global__ void r3_swiglu_grad_narrow_bf16(const __nv_bfloat16 *h,
                                                      const __nv_bfloat16 *d,
                                                      __nv_bfloat16 *dh, size_t n,
                                                      uint32_t half) {
    swiglu_grad_narrow(h, d, dh, n, half);
}
extern "C" __global__ void r3_swiglu_grad_narrow_f16(const __half *h, const __half *d,
                                                     __half *dh, size_t n, uint32_t half) {
    swiglu_grad_narrow(h, d, dh, n, half);
}

// The counter-based draw of element `index` under `key` (stochastic_round.rs `hash32` /
// `rounding_bits`: the same bits on the CPU).
__device__ __forceinline__ uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}
__device__ __forceinline__ uint32_t rounding_bits(uint64_t key, uint64_t index) {
    const uint32_t salt = hash32((uint32_t)(index >> 32) ^ (uint32_t)(key >> 32));
    return hash32((uint32_t)index ^ (uint32_t)key ^ salt) >> 16;
}

// x rounded to bf16 stochastically by 16 random bits (stochastic_round.rs
// `round_bf16_stochastic`, the same bits): the bits added below bf16's half, the low half
// dropped; nothing added to ±∞, and every NaN the canonical 0x7fc0 (this GPU's f32 sums give
// the NaN 0x7fffffff where the CPU's give their NaN operand: one NaN out, the same bits).
__device__ __forceinline__ __nv_bfloat16 round_bf16_stochastic(float x, uint32_t bits) {
    const uint32_t b = __float_as_uint(x);
    const bool finite = (b & 0x7f800000u) != 0x7f800000u;
    const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = nan ? 0x7fc0u : ((b + (finite ? (bits & 0xffffu) : 0u)) >> 16);
    return __ushort_as_bfloat16((unsigned short)r);
}

// y[i] = x[i] rounded to bf16 stochastically by draw i of `key`. CPU twin:
// stochastic_round.rs `round_slice_stochastic`.
extern "C" __global__ void r3_round_bf16_stochastic(const float *x, __nv_bfloat16 *y, size_t n,
                                                    uint64_t key) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        y[i] = round_bf16_stochastic(x[i], rounding_bits(key, i));
    }
}

// One AdamW update of n f32 parameters: θ, g, m, v in, the staged θ', m', v' out (nothing
// written to the inputs), and the largest |θ'|, |m'|, |v'| as bit patterns folded into
// `maxima` [3] (which starts at zero): for non-negative floats the bit order is the numeric
// order and a NaN or infinity sorts above every finite value, so the host reads finiteness
// and the largest magnitude from one integer max each. Operation for operation the CPU pass
// (r3-train `fused_optim.rs` `adamw_chunk`, itself candle's composed ops: `affine` is
// x · mul + add with two roundings), each operation rounded on its own (no contraction into
// fused multiply-adds), so the results are the CPU's bit for bit. The gradient is f32, or
// bf16 / f16 as a backward kept it (`train.narrow_gradients`): widened as it is read, which
// is exact, so the same bits as widening it first, without the widened copy's pass.
__device__ __forceinline__ float grad_f32(float g) { return g; }
__device__ __forceinline__ float grad_f32(__nv_bfloat16 g) { return __bfloat162float(g); }
__device__ __forceinline__ float grad_f32(__half g) { return __half2float(g); }

// θ is f32, or bf16 held without an f32 master (`train.master_weights = "bf16"`): read
// widened, θ' rounded to bf16 stochastically by draw i of `key` (the CPU pass's draw), and
// the checks made on the rounded value.
__device__ __forceinline__ float param_f32(float p) { return p; }
__device__ __forceinline__ float param_f32(__nv_bfloat16 p) { return __bfloat162float(p); }
__device__ __forceinline__ float stored_param(float x, uint64_t, size_t, float *out) {
    return x;
}
__device__ __forceinline__ __nv_bfloat16 stored_param(float x, uint64_t key, size_t i,
                                                      __nv_bfloat16 *) {
    return round_bf16_stochastic(x, rounding_bits(key, i));
}

// A trainer holding a 16-bit copy of θ (`copy_code` 1 bf16, 2 f16; 0 none) has θ' rounded
// into `copy_out` too (nearest, ties to even: `cast16`'s rounding), committed with θ'. The
// moments are f32, or bf16 (`optim.moments_dtype`): read widened, m' and v' rounded
// stochastically by draw i of `m_key` / `v_key`, and the update computed from them as
// rounded (the CPU pass's order).
template <typename P, typename G, typename M>
__device__ void adamw_pass(const P *theta, const G *g, const M *m, const M *v,
                           P *theta_out, M *m_out, M *v_out, uint32_t *maxima,
                           size_t n, float beta1, float one_minus_beta1, float beta2,
                           float one_minus_beta2, float inv_bc1, float inv_bc2, float eps,
                           float lr, float decay, float scale, uint32_t use_decay,
                           uint32_t use_scale, void *copy_out, uint32_t copy_code,
                           uint64_t key, uint64_t m_key, uint64_t v_key) {
    uint32_t tmax = 0, mmax = 0, vmax = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gw = grad_f32(g[i]);
        const float gi = use_scale ? __fadd_rn(__fmul_rn(gw, scale), 0.0f) : gw;
        const M m_stored = stored_param(
            __fadd_rn(__fadd_rn(__fmul_rn(param_f32(m[i]), beta1), 0.0f),
                      __fadd_rn(__fmul_rn(gi, one_minus_beta1), 0.0f)),
            m_key, i, m_out);
        const M v_stored = stored_param(
            __fadd_rn(__fadd_rn(__fmul_rn(param_f32(v[i]), beta2), 0.0f),
                      __fadd_rn(__fmul_rn(__fmul_rn(gi, gi), one_minus_beta2), 0.0f)),
            v_key, i, v_out);
        const float m1 = param_f32(m_stored);
        const float v1 = param_f32(v_stored);
        const float m_hat = __fadd_rn(__fmul_rn(m1, inv_bc1), 0.0f);
        const float denom =
            __fadd_rn(__fmul_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(v1, inv_bc2), 0.0f)), 1.0f), eps);
        const float theta_i = param_f32(theta[i]);
        const float decayed = use_decay ? __fadd_rn(__fmul_rn(theta_i, decay), 0.0f) : theta_i;
        const float computed =
            __fsub_rn(decayed, __fadd_rn(__fmul_rn(__fdiv_rn(m_hat, denom), lr), 0.0f));
        const P stored = stored_param(computed, key, i, theta_out);
        const float updated = param_f32(stored);
        theta_out[i] = stored;
        m_out[i] = m_stored;
        v_out[i] = v_stored;
        if (copy_code == 1) {
            static_cast<__nv_bfloat16 *>(copy_out)[i] = __float2bfloat16_rn(updated);
        } else if (copy_code == 2) {
            static_cast<__half *>(copy_out)[i] = __float2half_rn(updated);
        }
        tmax = max(tmax, __float_as_uint(updated) & 0x7fffffffu);
        mmax = max(mmax, __float_as_uint(m1) & 0x7fffffffu);
        vmax = max(vmax, __float_as_uint(v1) & 0x7fffffffu);
    }
    for (int o = 16; o > 0; o >>= 1) {
        tmax = max(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
        mmax = max(mmax, __shfl_xor_sync(0xffffffffu, mmax, o));
        vmax = max(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&maxima[0], tmax);
        atomicMax(&maxima[1], mmax);
        atomicMax(&maxima[2], vmax);
    }
}

#define ADAMW_KERNEL(NAME, P, G, M)                                                            \
    extern "C" __global__ void NAME(const P *theta, const G *g, const M *m, const M *v,        \
                                    P *theta_out, M *m_out, M *v_out, uint32_t *maxima,       \
                                    size_t n, float beta1, float one_minus_beta1, float beta2, \
                                    float one_minus_beta2, float inv_bc1, float inv_bc2,       \
                                    float eps, float lr, float decay, float scale,             \
                                    uint32_t use_decay, uint32_t use_scale, void *copy_out,    \
                                    uint32_t copy_code, uint64_t key, uint64_t m_key,          \
                                    uint64_t v_key) {                                          \
        adamw_pass<P, G, M>(theta, g, m, v, theta_out, m_out, v_out, maxima, n, beta1,         \
                            one_minus_beta1, beta2, one_minus_beta2, inv_bc1, inv_bc2, eps,    \
                            lr, decay, scale, use_decay, use_scale, copy_out, copy_code, key,  \
                            m_key, v_key);                                                     \
    }
// Named by θ's dtype, the gradient's where it is not f32, and `_mbf16` for bf16 moments.
ADAMW_KERNEL(r3_adamw_f32, float, float, float)
ADAMW_KERNEL(r3_adamw_f32_grad_bf16, float, __nv_bfloat16, float)
ADAMW_KERNEL(r3_adamw_f32_grad_f16, float, __half, float)
ADAMW_KERNEL(r3_adamw_bf16, __nv_bfloat16, float, float)
ADAMW_KERNEL(r3_adamw_bf16_grad_bf16, __nv_bfloat16, __nv_bfloat16, float)
ADAMW_KERNEL(r3_adamw_f32_mbf16, float, float, __nv_bfloat16)
ADAMW_KERNEL(r3_adamw_f32_grad_bf16_mbf16, float, __nv_bfloat16, __nv_bfloat16)
ADAMW_KERNEL(r3_adamw_f32_grad_f16_mbf16, float, __half, __nv_bfloat16)
ADAMW_KERNEL(r3_adamw_bf16_mbf16, __nv_bfloat16, float, __nv_bfloat16)
ADAMW_KERNEL(r3_adamw_bf16_grad_bf16_mbf16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16)

// The global gradient norm's Σ g² (`optim_pass.rs` `sum_of_squares_on_device`), one launch
// per gradient tensor: block b sums its grid-stride share of the squares (each value widened
// to f32 and squared in f32, as the CPU squares it; the squares added in f64) and writes the
// sum to partials[first + b]. Every tensor of a step writes into one buffer, which
// `r3_sum_squares_total` reduces; no atomics and a grid that is a function of n alone, so the
// same gradients give the same bits. candle's composed `sqr()?.sum_all()` wrote the squares
// to an f32 temporary and read them back, after widening a 16-bit gradient into another
// (18 bytes a bf16 parameter of traffic where this reads 2). CPU twin: r3-train
// fused_optim.rs `sum_of_squares` (f32 sums in candle's order, so the last bits differ).
template <typename G>
__device__ void sum_squares(const G *g, size_t n, double *partials, uint32_t first) {
    __shared__ double shared[32];
    double acc = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = grad_f32(g[i]);
        acc += (double)__fmul_rn(x, x);
    }
    const double s = block_sum_f64(acc, shared);
    if (threadIdx.x == 0) partials[first + blockIdx.x] = s;
}
extern "C" __global__ void r3_sum_squares_f32(const float *g, size_t n, double *partials,
                                              uint32_t first) {
    sum_squares(g, n, partials, first);
}
extern "C" __global__ void r3_sum_squares_bf16(const __nv_bfloat16 *g, size_t n,
                                               double *partials, uint32_t first) {
    sum_squares(g, n, partials, first);
}
extern "C" __global__ void r3_sum_squares_f16(const __half *g, size_t n, double *partials,
                                              uint32_t first) {
    sum_squares(g, n, partials, first);
}

// out[i] = a[i] + b[i] in f32 (each f32 or bf16, widened), rounded to bf16 stochastically by
// draw i of `key`: a gradient's sum over micro-batches held in bf16. CPU twin:
// stochastic_round.rs `sum_slices_stochastic`.
template <typename A, typename B>
__device__ void sum_bf16_stochastic(const A *a, const B *b, __nv_bfloat16 *out, size_t n,
                                    uint64_t key) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float s = __fadd_rn(grad_f32(a[i]), grad_f32(b[i]));
        out[i] = round_bf16_stochastic(s, rounding_bits(key, i));
    }
}
#define SUM_BF16_KERNEL(NAME, A, B)                                                            \
    extern "C" __global__ void NAME(const A *a, const B *b, __nv_bfloat16 *out, size_t n,      \
                                    uint64_t key) {                                            \
        sum_bf16_stochastic<A, B>(a, b, out, n, key);                                          \
    }
SUM_BF16_KERNEL(r3_sum_bf16_stochastic_f32_f32, float, float)
SUM_BF16_KERNEL(r3_sum_bf16_stochastic_f32_bf16, float, __nv_bfloat16)
SUM_BF16_KERNEL(r3_sum_bf16_stochastic_bf16_f32, __nv_bfloat16, float)
SUM_BF16_KERNEL(r3_sum_bf16_stochastic_bf16_bf16, __nv_bfloat16, __nv_bfloat16)

// One block: tensor t's Σ g² is the f64 sum of partials[offsets[t] .. offsets[t + 1]],
// rounded to f32, and the tensors' sums are added in their order in f32 (the CPU's per-tensor
// sums added to a running total); out[0] = the total.
extern "C" __global__ void r3_sum_squares_total(const double *partials,
                                                const uint32_t *offsets, uint32_t tensors,
                                                float *out) {
    __shared__ double shared[32];
    float total = 0.0f;
    for (uint32_t t = 0; t < tensors; t++) {
        double acc = 0.0;
        for (uint32_t i = offsets[t] + threadIdx.x; i < offsets[t + 1]; i += blockDim.x)
            acc += partials[i];
        const float s = (float)block_sum_f64(acc, shared);
        total = t == 0 ? s : __fadd_rn(total, s);
    }
    if (threadIdx.x == 0) out[0] = total;
}

// The pointer table of one batched GEMM per routed slot (`expert_gemm/slots.rs`, `run_slots`):
// slot s multiplies its row (B at b0 + (s / share)·b_step bytes: `share` consecutive slots
// read one row) by its expert's matrix (A at a0 + ids[s]·a_step) into its output row (C at
// c0 + s·c_step); the table holds the A pointers, then the B pointers, then the C pointers. The ids come from the router's own top-k on the
// device, so each lies in the stack; one past it (never made) reads expert 0 rather than
// past the stack. CPU twin: the gathered matrices' product (`expert_slots_matmul`).
extern "C" __global__ void r3_expert_slot_pointers(const uint32_t *ids, uint64_t *table,
                                                   uint32_t slots, uint32_t stack, uint64_t a0,
                                                   uint64_t a_step, uint64_t b0, uint64_t b_step,
                                                   uint32_t share, uint64_t c0, uint64_t c_step) {
    for (uint32_t s = blockIdx.x * blockDim.x + threadIdx.x; s < slots;
         s += gridDim.x * blockDim.x) {
        const uint64_t e = ids[s] < stack ? ids[s] : 0;
        table[s] = a0 + e * a_step;
        table[slots + s] = b0 + (uint64_t)(s / share) * b_step;
        table[2 * (uint64_t)slots + s] = c0 + (uint64_t)s * c_step;
    }
}

// `f32::total_cmp`'s order as an integer (router.rs `total_order_key`).
__device__ __forceinline__ int total_order_key(float v) {
    const int bits = __float_as_int(v);
    return bits ^ (int)(((unsigned)(bits >> 31)) >> 1);
}

// Whether candidate (key, index) ranks before the kept one: a larger key, or an equal key at a
// lower index; UINT32_MAX is "none".
__device__ __forceinline__ bool ranks_before(int key, uint32_t index, int kept_key,
                                             uint32_t kept) {
    return index != UINT32_MAX &&
           (kept == UINT32_MAX || key > kept_key || (key == kept_key && index < kept));
}

// The warp's first-ranked (key, index) in every lane.
__device__ __forceinline__ void warp_rank_first(int &key, uint32_t &index) {
    for (int o = 16; o > 0; o >>= 1) {
        const int other_key = __shfl_xor_sync(0xffffffffu, key, o);
        const uint32_t other = __shfl_xor_sync(0xffffffffu, index, o);
        if (ranks_before(other_key, other, key, index)) {
            key = other_key;
            index = other;
        }
    }
}

// The greedy reduction of each row of logits [rows, cols] (greedy_rows.rs): out[row] =
// (largest value, log Σ exp(x − largest) + largest, first column holding the largest; cols
// where no value exceeds −∞). The largest by `>` (a NaN never wins, so a NaN or +∞ in the
// row turns the sum NaN), equal values to the lower column. One block per row. CPU twin:
// greedy_rows.rs `reduce_row` (its sum in column order, here in the block's order).
extern "C" __global__ void r3_greedy_rows_f32(const float *logits, float *out, uint32_t cols) {
    __shared__ float best_values[32];
    __shared__ uint32_t best_columns[32];
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const float *z = logits + row * cols;
    float best = -INFINITY;
    uint32_t first = UINT32_MAX;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = z[j];
        if (v > best) {
            best = v;
            first = j;
        }
    }
    // Warp, then block: the larger value, or the lower column of equal ones.
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, o);
        const uint32_t other_first = __shfl_xor_sync(0xffffffffu, first, o);
        if (other > best || (other == best && other_first < first)) {
            best = other;
            first = other_first;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_values[warp] = best;
        best_columns[warp] = first;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t w = 1; w < (blockDim.x >> 5); ++w) {
            const float other = best_values[w];
            const uint32_t other_first = best_columns[w];
            if (other > best || (other == best && other_first < first)) {
                best = other;
                first = other_first;
            }
        }
        best_values[0] = best;
        best_columns[0] = first;
    }
    __syncthreads();
    best = best_values[0];
    first = best_columns[0];
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) sum += expf(z[j] - best);
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) {
        out[row * 3] = best;
        out[row * 3 + 1] = logf(sum) + best;
        out[row * 3 + 2] = first == UINT32_MAX ? (float)cols : (float)first;
    }
}

// A decode step's rotary embedding and its rounding point (layers/attention/rope_rounded.rs):
// x [B, H, T, D] rotated by cos / sin [B, T, D/2] (half-split pairs (i, i + D/2), or
// interleaved (2i, 2i + 1)), candle's rope expressions, each output rounded by `rounded_as`.
// A thread per pair. CPU twin: rope_rounded.rs `RopeRounded::cpu_fwd`.
extern "C" __global__ void r3_rope_rounded_f32(const float *x, const float *cos, const float *sin,
                                               float *out, size_t pairs, uint32_t h, uint32_t t,
                                               uint32_t d, uint32_t interleaved, uint32_t round) {
    const uint32_t half = d / 2;
    for (size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (size_t)blockDim.x * gridDim.x) {
        const size_t row = p / half, i = p % half;
        const size_t bi = row / ((size_t)h * t), ti = row % t;
        const size_t table = (bi * t + ti) * half + i;
        const size_t i1 = row * d + (interleaved ? 2 * i : i);
        const size_t i2 = i1 + (interleaved ? 1 : half);
        const float c = cos[table], s = sin[table], x1 = x[i1], x2 = x[i2];
        // `_rn`: nvcc would contract each pair's products and sum into an FMA and the CPU's
        // bits would be lost.
        out[i1] = rounded_as(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)), round);
        out[i2] = rounded_as(__fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c)), round);
    }
}

// Query rows of a group whose dot products one pass over a key computes (the group's rows
// past it take another pass).
#define ATTEND_GROUP_DOTS 8

// A decode step's attention over a KV cache (layers/attention/rows.rs), one block per
// (batch row, key/value head, query time) along x and per span of `span` keys along y: the
// block's G query rows are the head's group, so each key and value is read once for all of
// them. q [B, KV, G·T, dq] with rows ordered (g, t), keys / values [B, KV, S, d] of element E
// (f32, or bf16 / f16 widened exactly) at the given batch and head strides (a KV cache's
// views; rows packed), seen [B·T, 4] (u32: each query row's two half-open runs of seen
// slots, within S). The block reads only the keys from the first seen slot to the last
// (a left-padded row's padding is never read), a chunk of blockDim.x at a time, with the
// running max and sum of an online softmax, so no score array grows with S: for each chunk,
// each thread's key's score q_g·k_j · scale for every row g (each dot in order of d; −∞ for
// a key neither run holds, not read), then a warp per row: the chunk's max m', the row's max
// M = max(M, m'), the chunk's probabilities p_j = exp(x_j − M) and their sum (in the warp's
// order), the row's sum and output rescaled by exp(M_old − M); then each (g, d) output adds
// Σ_j p_j v_j[d] in order of j. A row that has seen no key yet (every score −∞) has no
// probabilities. With one span (gridDim.y = 1) `out` is [B, KV, G·T, dv]: the weighted sum
// over the sum (0 / 0 = NaN for a row that sees no key, as the composed softmax gives); with
// more, `out` holds each block's and span's partial state, [blocks, spans, G, dv + 2]: the
// weighted sum, then M and the sum, which `r3_attend_group_combine_f32` merges. blockDim.x a
// multiple of 32. Dynamic shared memory (floats): G·dq queries, G·blockDim.x probabilities,
// G·dv outputs, 3·G running values. CPU twin: layers/attention/rows.rs `attend_group`.
template <typename E>
__device__ void attend_group(const float *q, const E *k, const E *v, const uint32_t *seen,
                             float *out, uint32_t kv, uint32_t groups, uint32_t t, uint32_t s,
                             uint32_t span, uint32_t dq, uint32_t dv, uint64_t k_batch,
                             uint64_t k_head, uint64_t v_batch, uint64_t v_head, float scale) {
    extern __shared__ float smem[];
    const uint32_t chunk = blockDim.x;
    float *qs = smem;
    float *ps = qs + (size_t)groups * dq;
    float *acc = ps + (size_t)groups * chunk;
    // Per row: the running max, the running sum, and the chunk's rescaling factor.
    float *run = acc + (size_t)groups * dv;
    const size_t blk = blockIdx.x;
    const size_t ti = blk % t, h = (blk / t) % kv, b = blk / ((size_t)t * kv);
    const size_t gt = (size_t)groups * t, head = b * kv + h;
    const uint32_t *runs = seen + (b * t + ti) * 4;
    // Empty runs (from ≥ to) hold nothing and bound nothing.
    const bool has0 = runs[0] < runs[1], has1 = runs[2] < runs[3];
    const uint32_t lo = min(has0 ? runs[0] : s, has1 ? runs[2] : s);
    const uint32_t hi = max(has0 ? runs[1] : 0u, has1 ? runs[3] : 0u);
    const uint32_t first = max(lo, blockIdx.y * span), last = min(hi, min(s, blockIdx.y * span + span));
    const E *kb = k + b * k_batch + h * k_head;
    const E *vb = v + b * v_batch + h * v_head;
    for (uint32_t i = threadIdx.x; i < groups * dq; i += chunk) {
        const uint32_t g = i / dq, d = i % dq;
        qs[i] = q[(head * gt + (size_t)g * t + ti) * dq + d];
    }
    for (uint32_t i = threadIdx.x; i < groups * dv; i += chunk) acc[i] = 0.0f;
    for (uint32_t g = threadIdx.x; g < groups; g += chunk) {
        run[3 * g] = -INFINITY;
        run[3 * g + 1] = 0.0f;
        run[3 * g + 2] = 1.0f;
    }
    __syncthreads();
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = chunk >> 5;
    for (uint32_t c0 = first; c0 < last; c0 += chunk) {
        const uint32_t n = min(chunk, last - c0);
        const uint32_t j = c0 + threadIdx.x;
        const bool sees = (j >= runs[0] && j < runs[1]) || (j >= runs[2] && j < runs[3]);
        if (threadIdx.x < n && !sees) {
            for (uint32_t g = 0; g < groups; ++g) ps[(size_t)g * chunk + threadIdx.x] = -INFINITY;
        } else if (threadIdx.x < n) {
            const E *kj = kb + (size_t)j * dq;
            for (uint32_t g0 = 0; g0 < groups; g0 += ATTEND_GROUP_DOTS) {
                const uint32_t gn = min((uint32_t)ATTEND_GROUP_DOTS, groups - g0);
                float dot[ATTEND_GROUP_DOTS];
#pragma unroll
                for (uint32_t g = 0; g < ATTEND_GROUP_DOTS; ++g) dot[g] = 0.0f;
                for (uint32_t d = 0; d < dq; ++d) {
                    const float kd = load1(kj + d);
#pragma unroll
                    for (uint32_t g = 0; g < ATTEND_GROUP_DOTS; ++g)
                        if (g < gn) dot[g] = dot[g] + qs[(g0 + g) * dq + d] * kd;
                }
#pragma unroll
                for (uint32_t g = 0; g < ATTEND_GROUP_DOTS; ++g)
                    if (g < gn) ps[(size_t)(g0 + g) * chunk + threadIdx.x] = dot[g] * scale;
            }
        }
        __syncthreads();
        // A warp per row; every lane of a warp takes the same rows, so the shuffles are whole.
        for (uint32_t g = warp; g < groups; g += warps) {
            float *p = ps + (size_t)g * chunk;
            float top = -INFINITY;
            for (uint32_t j = lane; j < n; j += 32) top = fmaxf(top, p[j]);
            top = warp_reduce(top, MaxOp());
            const float before = run[3 * g];
            const float now = fmaxf(before, top);
            const bool none = now == -INFINITY;
            float sum = 0.0f;
            for (uint32_t j = lane; j < n; j += 32) {
                const float e = none ? 0.0f : expf(p[j] - now);
                p[j] = e;
                sum += e;
            }
            // Every lane read `run` above before any lane leaves this exchange.
            sum = warp_reduce(sum, SumOp());
            if (lane == 0) {
                const float factor = none ? 1.0f : expf(before - now);
                run[3 * g] = now;
                run[3 * g + 1] = run[3 * g + 1] * factor + sum;
                run[3 * g + 2] = factor;
            }
        }
        __syncthreads();
        for (uint32_t i = threadIdx.x; i < groups * dv; i += chunk) {
            const uint32_t g = i / dv, d = i % dv;
            const float *p = ps + (size_t)g * chunk;
            const E *vd = vb + (size_t)c0 * dv + d;
            float a = 0.0f;
            for (uint32_t j = 0; j < n; ++j) a = a + p[j] * load1(vd + (size_t)j * dv);
            acc[i] = acc[i] * run[3 * g + 2] + a;
        }
        // The next chunk overwrites the probabilities and the factors.
        __syncthreads();
    }
    if (gridDim.y == 1) {
        for (uint32_t i = threadIdx.x; i < groups * dv; i += chunk) {
            const uint32_t g = i / dv, d = i % dv;
            out[(head * gt + (size_t)g * t + ti) * dv + d] = acc[i] / run[3 * g + 1];
        }
        return;
    }
    float *state = out + (blk * gridDim.y + blockIdx.y) * (size_t)groups * (dv + 2);
    for (uint32_t i = threadIdx.x; i < groups * (dv + 2); i += chunk) {
        const uint32_t g = i / (dv + 2), d = i % (dv + 2);
        state[i] = d < dv ? acc[g * dv + d] : run[3 * g + (d - dv)];
    }
}

// The kernel over keys and values of element E, one entry point each.
#define ATTEND_GROUP_KERNEL(NAME, E)                                                           \
    extern "C" __global__ void NAME(const float *q, const E *k, const E *v, const uint32_t *seen, \
                                    float *out, uint32_t kv, uint32_t groups, uint32_t t,      \
                                    uint32_t s, uint32_t span, uint32_t dq, uint32_t dv,       \
                                    uint64_t k_batch, uint64_t k_head, uint64_t v_batch,       \
                                    uint64_t v_head, float scale) {                            \
        attend_group<E>(q, k, v, seen, out, kv, groups, t, s, span, dq, dv, k_batch, k_head,   \
                        v_batch, v_head, scale);                                               \
    }
ATTEND_GROUP_KERNEL(r3_attend_group_f32, float)
ATTEND_GROUP_KERNEL(r3_attend_group_bf16, __nv_bfloat16)
ATTEND_GROUP_KERNEL(r3_attend_group_f16, __half)

// The spans' partial states of `r3_attend_group_*` ([blocks, spans, G, dv + 2]: weighted
// sums, max, sum) merged into [B, KV, G·T, dv], one thread per output (grid-stride): with
// M = max over spans of their maxima and w_i = exp(M_i − M) (0 for a span that saw no key),
// out = Σ_i w_i acc_i / Σ_i w_i l_i, both sums in span order; 0 / 0 = NaN where no span saw a
// key. CPU twin: layers/attention/rows.rs `combine_spans`.
extern "C" __global__ void r3_attend_group_combine_f32(const float *state, float *out,
                                                       uint32_t blocks, uint32_t groups,
                                                       uint32_t t, uint32_t spans, uint32_t dv) {
    const size_t n = (size_t)blocks * groups * dv, stride = (size_t)blockDim.x * gridDim.x;
    const size_t gt = (size_t)groups * t, width = dv + 2;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t blk = i / ((size_t)groups * dv), g = (i / dv) % groups, d = i % dv;
        const float *first = state + (blk * spans * groups + g) * width;
        const size_t next = (size_t)groups * width;
        float top = -INFINITY;
        for (uint32_t sp = 0; sp < spans; ++sp) top = fmaxf(top, first[sp * next + dv]);
        float num = 0.0f, den = 0.0f;
        for (uint32_t sp = 0; sp < spans; ++sp) {
            const float *part = first + sp * next;
            const float w = part[dv] == -INFINITY ? 0.0f : expf(part[dv] - top);
            num = num + w * part[d];
            den = den + w * part[dv + 1];
        }
        const size_t head = blk / t, ti = blk % t;
        out[(head * gt + g * t + ti) * dv + d] = num / den;
    }
}

// One row's k largest values into `out` (k indices), largest first, ties to the lower index,
// in total_cmp's order: k rounds of a block-wide arg-max over the columns not chosen yet (the
// whole block calls it; `out` is global or shared memory every thread reads).
__device__ void top_k_row(const float *row, uint32_t *out, uint32_t cols, uint32_t k) {
    __shared__ int keys[32];
    __shared__ uint32_t indices[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t j = 0; j < k; ++j) {
        int best_key = 0;
        uint32_t best = UINT32_MAX;
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
            bool taken = false;
            for (uint32_t t = 0; t < j; ++t) taken |= out[t] == c;
            const int key = total_order_key(row[c]);
            if (!taken && ranks_before(key, c, best_key, best)) {
                best_key = key;
                best = c;
            }
        }
        warp_rank_first(best_key, best);
        if (lane == 0) {
            keys[warp] = best_key;
            indices[warp] = best;
        }
        __syncthreads();
        if (warp == 0) {
            const bool held = lane < (int)(blockDim.x >> 5);
            best_key = held ? keys[lane] : 0;
            best = held ? indices[lane] : UINT32_MAX;
            warp_rank_first(best_key, best);
            if (lane == 0) out[j] = best;
        }
        // The pick is read by every thread's next round.
        __syncthreads();
    }
}

// The most experts a token chooses that `r3_route_softmax_f32` keeps in shared memory.
#define ROUTE_MAX_TOP_K 64

// A softmax router's whole choice for each row of logits, one block per row: the top-k
// (`top_k_row`), their gates softmax(logits)[id] (renormalised over the k when `norm`), and
// whether every logit is finite. Written into `packed` = [gates (rows·k) | ids as floats
// (rows·k) | flags (rows): 1 finite, 0 not]. A row with a non-finite logit gets zero gates and
// its flag 0 (the host's selection then names it). CPU twin: `Router::select_row` and
// `Router::weigh_row` (router.rs, run by `RouteSoftmax` in `layers/moe/route_rows.rs`), whose
// sums run in another order.
extern "C" __global__ void r3_route_softmax_f32(const float *x, float *packed, uint32_t rows,
                                                uint32_t cols, uint32_t k, uint32_t norm) {
    __shared__ float scratch[32];
    __shared__ uint32_t chosen[ROUTE_MAX_TOP_K];
    const size_t r = blockIdx.x;
    const float *row = x + r * cols;
    float top = -INFINITY;
    float bad = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = row[c];
        bad = isfinite(v) ? bad : 1.0f;
        top = fmaxf(top, v);
    }
    top = block_reduce(top, -INFINITY, scratch, MaxOp());
    bad = block_reduce(bad, 0.0f, scratch, MaxOp());
    float sum = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) sum += expf(row[c] - top);
    sum = block_reduce(sum, 0.0f, scratch, SumOp());
    top_k_row(row, chosen, cols, k);
    if (threadIdx.x == 0) {
        float *gates = packed + r * k;
        float *ids = packed + (size_t)rows * k + r * k;
        float kept = 0.0f;
        for (uint32_t j = 0; j < k; ++j) {
            const float g = bad > 0.0f ? 0.0f : expf(row[chosen[j]] - top) / sum;
            gates[j] = g;
            kept += g;
            ids[j] = (float)chosen[j];
        }
        if (norm && bad == 0.0f) {
            for (uint32_t j = 0; j < k; ++j) gates[j] /= kept;
        }
        packed[2 * (size_t)rows * k + r] = bad > 0.0f ? 0.0f : 1.0f;
    }
}

// `e^x` as math.rs `fast_exp` computes it, bit for bit: the same clamp, Cody–Waite reduction
// and polynomial, each of its fused multiply-adds an fmaf and every other operation rounded
// as written (the `__f*_rn` intrinsics, which nvcc never contracts into an FMA).
__device__ __forceinline__ float r3_fast_exp(float x) {
    const float shift = 12582912.0f;
    x = fminf(fmaxf(x, -87.3f), 88.7f);
    const float shifted = fmaf(x, 1.44269504088896340736f, shift);
    const float n = __fsub_rn(shifted, shift);
    float r = fmaf(n, -0.69314575f, x);
    r = fmaf(n, -1.4286068e-6f, r);
    float p = 1.9875691e-4f;
    p = fmaf(p, r, 1.3981999e-3f);
    p = fmaf(p, r, 8.333452e-3f);
    p = fmaf(p, r, 4.1665796e-2f);
    p = fmaf(p, r, 1.6666665e-1f);
    p = fmaf(p, r, 0.5f);
    p = __fadd_rn(fmaf(__fmul_rn(p, r), r, r), 1.0f);
    const uint32_t bits = (__float_as_uint(shifted) - __float_as_uint(shift) + 127u) << 23;
    return __fmul_rn(p, __uint_as_float(bits));
}

// math.rs `sigmoid`: 1 / (1 + fast_exp(−x)), bit for bit.
__device__ __forceinline__ float r3_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, r3_fast_exp(-x)));
}

// The row draws' columns per partial sum (sample_rows.rs SAMPLE_BLOCK) and the lanes each
// block of them is summed in (math.rs `lane_sum`'s LANES).
#define SAMPLE_BLOCK 256u
#define SAMPLE_LANES 16u

// e^((z − max) · inv_t) as sample_rows.rs `sample_row` computes it, bit for bit.
__device__ __forceinline__ float sample_exp(float z, float max, float inv_t) {
    return r3_fast_exp(__fmul_rn(__fsub_rn(z, max), inv_t));
}

// The f64 values of a row's draw (sample_rows.rs DRAW_VALUES): the uniform, 1 / T, and
// whether the log-prob is the scaled one.
#define SAMPLE_DRAW_VALUES 3u

// Each row's draw from its whole distribution at its own temperature (sample_rows.rs):
// draws[row] = (u in [0, 1), 1 / T, scaled), u < 0 for a row not asked; out[row] = (column,
// its log-prob: log softmax(row / T)[column] where `scaled` is nonzero (LogprobScale::Sampling,
// SGLang's default), log softmax(row)[column] where it is 0 (LogprobScale::Raw)), or (cols,
// NaN) for a row not asked or not drawable (a NaN, or no finite largest value). The column
// is the host's bit for bit: the same exponentials (r3_fast_exp), each block of SAMPLE_BLOCK columns summed as math.rs `lane_sum` sums (16
// lanes in f32 in column order, their sum then the block's tail in f64), the blocks' sums
// added in order, and the same walk (the correctly rounded `__d*_rn`, never contracted).
// One block per row; its threads in groups of 16 lanes, a group a column block at a time;
// dynamic shared memory: one double per column block. The walk is one thread's. The scaled
// log-prob, (z − max) · inv_t − ln(total), reads the walk's own total (the host's bits; the
// raw one at T = 1 is the same value); the raw one at T ≠ 1 has a second pass, its normaliser
// a block's f64 sum of `expf` (the host's is `lane_sum` of `f32::exp`: within rounding).
// CPU twin: sample_rows.rs `sample_row`.
extern "C" __global__ void r3_sample_rows_f32(const float *logits, const double *draws, float *out,
                                              uint32_t cols) {
    extern __shared__ double block_sums[];
    __shared__ float lanes[1024];
    __shared__ float shared[32];
    __shared__ double shared_f64[32];
    __shared__ uint32_t picked;
    const size_t row = blockIdx.x;
    const float *z = logits + row * cols;
    const double u = draws[SAMPLE_DRAW_VALUES * row];
    const float inv_t = (float)draws[SAMPLE_DRAW_VALUES * row + 1];
    const bool scaled = draws[SAMPLE_DRAW_VALUES * row + 2] != 0.0;
    float *o = out + 2 * row;
    // Every thread of the block reads the same draw, so the block leaves together.
    if (!(u >= 0.0)) {
        if (threadIdx.x == 0) {
            o[0] = (float)cols;
            o[1] = NAN;
        }
        return;
    }
    float m = -INFINITY, bad = 0.0f;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = z[j];
        m = fmaxf(m, v);
        if (v != v) bad = 1.0f;
    }
    m = block_max(m, shared);
    bad = block_max(bad, shared);
    if (bad > 0.0f || !isfinite(m)) {
        if (threadIdx.x == 0) {
            o[0] = (float)cols;
            o[1] = NAN;
        }
        return;
    }
    const uint32_t nblocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    const uint32_t lane = threadIdx.x % SAMPLE_LANES, group = threadIdx.x / SAMPLE_LANES;
    const uint32_t groups = blockDim.x / SAMPLE_LANES;
    // Rounds over the column blocks, the same count for every thread (barriers inside).
    for (uint32_t first = 0; first < nblocks; first += groups) {
        const uint32_t b = first + group;
        const uint32_t base = b * SAMPLE_BLOCK;
        const uint32_t len = b < nblocks ? min(SAMPLE_BLOCK, cols - base) : 0u;
        const uint32_t whole = len / SAMPLE_LANES * SAMPLE_LANES;
        float acc = 0.0f;
        for (uint32_t k = lane; k < whole; k += SAMPLE_LANES)
            acc = __fadd_rn(acc, sample_exp(z[base + k], m, inv_t));
        lanes[threadIdx.x] = acc;
        __syncthreads();
        if (lane == 0 && b < nblocks) {
            double lanes_sum = 0.0, tail = 0.0;
            for (uint32_t l = 0; l < SAMPLE_LANES; ++l)
                lanes_sum = __dadd_rn(lanes_sum, (double)lanes[threadIdx.x + l]);
            for (uint32_t k = whole; k < len; ++k)
                tail = __dadd_rn(tail, (double)sample_exp(z[base + k], m, inv_t));
            block_sums[b] = __dadd_rn(lanes_sum, tail);
        }
        __syncthreads();
    }
    double total = 0.0;
    if (threadIdx.x == 0) {
        for (uint32_t b = 0; b < nblocks; ++b) total = __dadd_rn(total, block_sums[b]);
        // Where rounding leaves the draw past the last partial sum: the last column with mass.
        uint32_t pick = 0;
        for (uint32_t j = cols; j-- > 0;) {
            if (sample_exp(z[j], m, inv_t) > 0.0f) {
                pick = j;
                break;
            }
        }
        double left = __dmul_rn(u, total);
        for (uint32_t b = 0; b < nblocks; ++b) {
            const double bs = block_sums[b];
            if (left < bs) {
                const uint32_t base = b * SAMPLE_BLOCK;
                const uint32_t end = min(base + SAMPLE_BLOCK, cols);
                // The block's sum can exceed its values stepped through: its last column.
                pick = end - 1;
                for (uint32_t j = base; j < end; ++j) {
                    left = __dsub_rn(left, (double)sample_exp(z[j], m, inv_t));
                    if (left < 0.0) {
                        pick = j;
                        break;
                    }
                }
                break;
            }
            left = __dsub_rn(left, bs);
        }
        picked = pick;
    }
    __syncthreads();
    const uint32_t pick = picked;
    // Every thread of the block reads the same draw, so the block leaves together.
    if (scaled || inv_t == 1.0f) {
        if (threadIdx.x == 0) {
            o[0] = (float)pick;
            o[1] = __fsub_rn(__fmul_rn(__fsub_rn(z[pick], m), inv_t), (float)log(total));
        }
        return;
    }
    double sum = 0.0;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) sum += (double)expf(z[j] - m);
    sum = block_sum_f64(sum, shared_f64);
    if (threadIdx.x == 0) {
        o[0] = (float)pick;
        o[1] = __fsub_rn(z[pick], __fadd_rn(m, (float)log(sum)));
    }
}

// The most experts `r3_route_grouped_f32` keeps a row of in shared memory (router.rs
// `DEVICE_SELECT_MAX_EXPERTS`), and the most groups (`DEVICE_SELECT_MAX_GROUPS`).
#define ROUTE_MAX_EXPERTS 4096
#define ROUTE_MAX_GROUPS 64

// A DeepSeek-V3 router's whole choice for each row of logits, one block per row, as
// `Router::select_row` and `Router::weigh_row` make it on the host, bit for bit: scores
// sigmoid(x) + bias; each group's score the sum of its two best; the `topk_group` best groups
// kept (ties to the lower group); the others' scores set to -inf (HF v5's, SGLang's and
// Megatron's masked_fill: a 0 would beat kept scores a negative bias put below it); the top-k
// of those (`top_k_row`); gates sigmoid(x[id]), normalised over the k (+1e-20) when `norm`,
// times `scale`. Written into `packed` as `r3_route_softmax_f32` writes it: [gates (rows·k) |
// ids as floats (rows·k) | flags (rows): 1 finite, 0 not]. Needs cols = n_group · per-group
// with at least two per group, cols ≤ ROUTE_MAX_EXPERTS, n_group ≤ ROUTE_MAX_GROUPS and
// n_group ≤ blockDim.x (the host checks). CPU twin: `RouteGrouped` (`layers/moe/route_rows.rs`).
extern "C" __global__ void r3_route_grouped_f32(const float *x, const float *bias, float *packed,
                                                uint32_t rows, uint32_t cols, uint32_t k,
                                                uint32_t n_group, uint32_t topk_group,
                                                uint32_t norm, float scale) {
    __shared__ float scores[ROUTE_MAX_EXPERTS];
    __shared__ float group_scores[ROUTE_MAX_GROUPS];
    __shared__ uint32_t kept[ROUTE_MAX_GROUPS];
    __shared__ float scratch[32];
    __shared__ uint32_t chosen[ROUTE_MAX_TOP_K];
    const size_t r = blockIdx.x;
    const float *row = x + r * cols;
    float bad = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = row[c];
        bad = isfinite(v) ? bad : 1.0f;
        scores[c] = __fadd_rn(r3_sigmoid(v), bias[c]);
    }
    // block_reduce's barriers also order every thread's `scores` writes before the reads.
    bad = block_reduce(bad, 0.0f, scratch, MaxOp());
    const uint32_t per_group = cols / n_group;
    if (threadIdx.x < n_group) {
        // The group's two best in total_cmp's order (router.rs `top_k_desc(g, 2)`).
        const float *g = scores + (size_t)threadIdx.x * per_group;
        int key0 = 0, key1 = 0;
        uint32_t at0 = UINT32_MAX, at1 = UINT32_MAX;
        for (uint32_t c = 0; c < per_group; ++c) {
            const int key = total_order_key(g[c]);
            if (ranks_before(key, c, key0, at0)) {
                key1 = key0;
                at1 = at0;
                key0 = key;
                at0 = c;
            } else if (ranks_before(key, c, key1, at1)) {
                key1 = key;
                at1 = c;
            }
        }
        group_scores[threadIdx.x] = __fadd_rn(g[at0], g[at1]);
        kept[threadIdx.x] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t j = 0; j < topk_group; ++j) {
            int best_key = 0;
            uint32_t best = UINT32_MAX;
            for (uint32_t g = 0; g < n_group; ++g) {
                const int key = total_order_key(group_scores[g]);
                if (!kept[g] && ranks_before(key, g, best_key, best)) {
                    best_key = key;
                    best = g;
                }
            }
            if (best != UINT32_MAX) kept[best] = 1;
        }
    }
    __syncthreads();
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
        if (!kept[c / per_group]) scores[c] = -INFINITY;
    }
    __syncthreads();
    top_k_row(scores, chosen, cols, k);
    if (threadIdx.x == 0) {
        float *gates = packed + r * k;
        float *ids = packed + (size_t)rows * k + r * k;
        for (uint32_t j = 0; j < k; ++j) {
            gates[j] = bad > 0.0f ? 0.0f : r3_sigmoid(row[chosen[j]]);
            ids[j] = (float)chosen[j];
        }
        if (bad == 0.0f) {
            if (norm) {
                float sum = 0.0f;
                for (uint32_t j = 0; j < k; ++j) sum = __fadd_rn(sum, gates[j]);
                sum = __fadd_rn(sum, 1e-20f);
                for (uint32_t j = 0; j < k; ++j) gates[j] = __fdiv_rn(gates[j], sum);
            }
            for (uint32_t j = 0; j < k; ++j) gates[j] = __fmul_rn(gates[j], scale);
        }
        packed[2 * (size_t)rows * k + r] = bad > 0.0f ? 0.0f : 1.0f;
    }
}
