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

// One block per row of `scores` [rows, cols]: probs = softmax(scores · scale + mask) over the
// row, the mask row of batch b and query t (`mask` [B, T, cols], rows ordered (b, head, t)
// with `rows_per_batch` = heads · T). CPU twin: attention_softmax.rs `masked_softmax_rows`.
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
// row's Σ dO ⊙ O). CPU twin: attention_softmax.rs `softmax_grad_rows`.
extern "C" __global__ void r3_softmax_grad_f32(const float *p, const float *dp,
                                               const float *row_dot, float *ds, uint32_t cols,
                                               size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        ds[i] = p[i] * (dp[i] - row_dot[i / cols]);
    }
}

// One block per row of `logits` [rows, vocab]: logp[row] = (z[t] − max) − log Σ exp(z − max)
// for the row's target t (NaN for a target past the vocabulary). CPU twin: token_stats.rs
// `token_logp_rows`.
extern "C" __global__ void r3_token_logprob_f32(const float *logits, const uint32_t *targets,
                                                float *logp, uint32_t vocab) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const float *z = logits + row * vocab;
    float m = -INFINITY;
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, z[j]);
    m = block_max(m, shared);
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(z[j] - m);
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) {
        const uint32_t t = targets[row];
        logp[row] = t < vocab ? (z[t] - m) - logf(sum) : NAN;
    }
}

// One block per row: d z_j = −g · exp(z_j − lse) + g · 1[j = t], with each row's (lse, g)
// in `row_stats` [rows, 2]. CPU twin: token_stats.rs `token_logp_grad_rows`.
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

// One block per row: y = x · r · w. CPU twin: norm.rs `rms_fwd`.
extern "C" __global__ void r3_rms_norm_f32(const float *x, const float *w, float *y, uint32_t d,
                                           double eps) {
    __shared__ double shared[32];
    const size_t row = blockIdx.x;
    const float *xr = x + row * d;
    float *yr = y + row * d;
    const float r = row_inv_rms(xr, d, eps, shared);
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) yr[j] = xr[j] * r * w[j];
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
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) {
        dxr[j] = r * (gr[j] * w[j] - xr[j] * r * mean);
    }
}

// One block per chunk of `chunk_rows` rows: the chunk's weight-gradient sum
// Σ_rows g · (x · r) per column, rows added in order (the caller sums the chunks). CPU twin:
// norm.rs `rms_bwd_parts` (its per-chunk partials). At most 64 rows per chunk.
extern "C" __global__ void r3_rms_norm_dw_chunks_f32(const float *x, const float *g,
                                                     float *parts, uint32_t rows, uint32_t d,
                                                     uint32_t chunk_rows, double eps) {
    __shared__ double shared[32];
    __shared__ float inv[64];
    const uint32_t first = blockIdx.x * chunk_rows;
    const uint32_t n = min(chunk_rows, rows - first);
    for (uint32_t i = 0; i < n; i++) {
        const float r = row_inv_rms(x + (size_t)(first + i) * d, d, eps, shared);
        if (threadIdx.x == 0) inv[i] = r;
    }
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
            const size_t at = (size_t)(first + i) * d + j;
            acc = acc + g[at] * (x[at] * inv[i]);
        }
        parts[(size_t)blockIdx.x * d + j] = acc;
    }
}
