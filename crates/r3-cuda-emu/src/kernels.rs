//! The kernels' signatures, as `kernels.cu` declares them (`size_t` is `usize`, a bf16 or
//! f16 value its `half` type, `void *` a `c_void` pointer), bound twice: to the variant
//! compiled as written ([`PLAIN`]) and to the contracted one ([`FMA`]).

use std::ffi::c_void;

use half::{bf16, f16};

/// Declares every kernel once per variant and the table of each variant's entry points.
macro_rules! kernels {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ); )*) => {
        mod plain_symbols {
            use super::*;
            extern "C" {
                $(
                    #[link_name = concat!("emu_plain_", stringify!($name))]
                    pub fn $name($($arg: $ty),*);
                )*
            }
        }
        mod fma_symbols {
            use super::*;
            extern "C" {
                $(
                    #[link_name = concat!("emu_fma_", stringify!($name))]
                    pub fn $name($($arg: $ty),*);
                )*
            }
        }
        /// One variant's kernels, by their names in `kernels.cu`. Calling one outside
        /// [`crate::launch`]'s body, or with pointers that do not cover what the kernel
        /// reads and writes for its grid, is undefined behaviour, as on a GPU.
        #[allow(missing_docs)]
        pub struct Kernels {
            $( pub $name: unsafe extern "C" fn($($ty),*), )*
        }
        /// The kernels compiled with every expression rounded as written.
        pub static PLAIN: Kernels = Kernels { $( $name: plain_symbols::$name, )* };
        /// The kernels compiled with multiplies and adds contracted into fused multiply-adds.
        pub static FMA: Kernels = Kernels { $( $name: fma_symbols::$name, )* };
    };
}

kernels! {
    fn r3_masked_softmax_f32(scores: *const f32, mask: *const f32, probs: *mut f32, scale: f32, cols: u32, t_rows: u32, rows_per_batch: u32);
    fn r3_softmax_grad_f32(p: *const f32, dp: *const f32, row_dot: *const f32, ds: *mut f32, cols: u32, n: usize);
    fn r3_token_logprob_f32(logits: *const f32, targets: *const u32, logp: *mut f32, vocab: u32);
    fn r3_token_logprob_grad_f32(logits: *const f32, targets: *const u32, row_stats: *const f32, d: *mut f32, vocab: u32);
    fn r3_narrow_bf16(x: *const f32, y: *mut bf16, n: usize);
    fn r3_narrow_f16(x: *const f32, y: *mut f16, n: usize);
    fn r3_widen_bf16(x: *const bf16, y: *mut f32, n: usize);
    fn r3_widen_f16(x: *const f16, y: *mut f32, n: usize);
    fn r3_narrow_exact_bf16(x: *const f32, y: *mut bf16, inexact: *mut u32, n: usize);
    fn r3_narrow_exact_f16(x: *const f32, y: *mut f16, inexact: *mut u32, n: usize);
    fn r3_round_bf16_f32(x: *const f32, y: *mut f32, n: usize);
    fn r3_round_f16_f32(x: *const f32, y: *mut f32, n: usize);
    fn r3_add_rounded_f32(a: *const f32, b: *const f32, y: *mut f32, n: usize, round: u32);
    fn r3_rms_norm_f32(x: *const f32, w: *const f32, y: *mut f32, d: u32, eps: f64, round: u32);
    fn r3_rms_norm_dx_f32(x: *const f32, w: *const f32, g: *const f32, dx: *mut f32, d: u32, eps: f64);
    fn r3_rms_norm_dw_chunks_f32(x: *const f32, g: *const f32, parts: *mut f32, rows: u32, d: u32, chunk_rows: u32, eps: f64);
    fn r3_gather_rows_f32(src: *const f32, ids: *const u32, out: *mut f32, row: u32, quads: u32);
    fn r3_gather_rows_u16(src: *const u16, ids: *const u32, out: *mut u16, row: u32, octs: u32);
    fn r3_gather_sum_rows_f32(grad: *const f32, offsets: *const u32, uses: *const u32, out: *mut f32, row: u32, grad_rows: u32);
    fn r3_gather_sum_rows_bf16(grad: *const bf16, offsets: *const u32, uses: *const u32, out: *mut f32, row: u32, grad_rows: u32);
    fn r3_gather_sum_rows_f16(grad: *const f16, offsets: *const u32, uses: *const u32, out: *mut f32, row: u32, grad_rows: u32);
    fn r3_combine_slots_f32(y: *const f32, g: *const f32, place: *const u32, out: *mut f32, k: u32, h: u32);
    fn r3_combine_slots_bf16(y: *const bf16, g: *const f32, place: *const u32, out: *mut f32, k: u32, h: u32);
    fn r3_combine_slots_f16(y: *const f16, g: *const f32, place: *const u32, out: *mut f32, k: u32, h: u32);
    fn r3_combine_in_order_f32(y: *const f32, g: *const f32, out: *mut f32, k: u32, h: u32, round: u32);
    fn r3_combine_in_order_bf16(y: *const bf16, g: *const f32, out: *mut f32, k: u32, h: u32, round: u32);
    fn r3_combine_in_order_f16(y: *const f16, g: *const f32, out: *mut f32, k: u32, h: u32, round: u32);
    fn r3_combine_slots_dy_f32(dout: *const f32, g: *const f32, slot_of_place: *const u32, dy: *mut f32, k: u32, h: u32, none: u32);
    fn r3_combine_slots_dy_bf16(dout: *const f32, g: *const f32, slot_of_place: *const u32, dy: *mut bf16, k: u32, h: u32, none: u32);
    fn r3_combine_slots_dy_f16(dout: *const f32, g: *const f32, slot_of_place: *const u32, dy: *mut f16, k: u32, h: u32, none: u32);
    fn r3_combine_slots_dgates_f32(y: *const f32, dout: *const f32, place: *const u32, dg: *mut f32, k: u32, h: u32);
    fn r3_combine_slots_dgates_bf16(y: *const bf16, dout: *const f32, place: *const u32, dg: *mut f32, k: u32, h: u32);
    fn r3_combine_slots_dgates_f16(y: *const f16, dout: *const f32, place: *const u32, dg: *mut f32, k: u32, h: u32);
    fn r3_embedding_grad_f32(grad: *const f32, offsets: *const u32, order: *const u32, d: *mut f32, h: u32);
    fn r3_swiglu_f32(h: *const f32, y: *mut f32, n: usize, half: u32, round: u32);
    fn r3_swiglu_narrow_bf16(h: *const bf16, y: *mut bf16, n: usize, half: u32);
    fn r3_swiglu_narrow_f16(h: *const f16, y: *mut f16, n: usize, half: u32);
    fn r3_swiglu_grad_f32(h: *const f32, d: *const f32, dh: *mut f32, n: usize, half: u32);
    fn r3_swiglu_grad_narrow_bf16(h: *const bf16, d: *const bf16, dh: *mut bf16, n: usize, half: u32);
    fn r3_swiglu_grad_narrow_f16(h: *const f16, d: *const f16, dh: *mut f16, n: usize, half: u32);
    fn r3_round_bf16_stochastic(x: *const f32, y: *mut bf16, n: usize, key: u64);
    fn r3_sum_squares_f32(g: *const f32, n: usize, partials: *mut f64, first: u32);
    fn r3_sum_squares_bf16(g: *const bf16, n: usize, partials: *mut f64, first: u32);
    fn r3_sum_squares_f16(g: *const f16, n: usize, partials: *mut f64, first: u32);
    fn r3_sum_squares_total(partials: *const f64, offsets: *const u32, tensors: u32, out: *mut f32);
    fn r3_expert_slot_pointers(ids: *const u32, table: *mut u64, slots: u32, stack: u32, a0: u64, a_step: u64, b0: u64, b_step: u64, share: u32, c0: u64, c_step: u64);
    fn r3_greedy_rows_f32(logits: *const f32, out: *mut f32, cols: u32);
    fn r3_rope_rounded_f32(x: *const f32, cos: *const f32, sin: *const f32, out: *mut f32, pairs: usize, h: u32, t: u32, d: u32, interleaved: u32, round: u32);
    fn r3_attend_rows_f32(q: *const f32, k: *const f32, v: *const f32, mask: *const f32, out: *mut f32, kv: u32, rows: u32, t: u32, s: u32, dq: u32, dv: u32, k_batch: u64, k_head: u64, v_batch: u64, v_head: u64, scale: f32);
    fn r3_route_softmax_f32(x: *const f32, packed: *mut f32, rows: u32, cols: u32, k: u32, norm: u32);
    fn r3_route_grouped_f32(x: *const f32, bias: *const f32, packed: *mut f32, rows: u32, cols: u32, k: u32, n_group: u32, topk_group: u32, norm: u32, scale: f32);
    fn r3_adamw_f32(theta: *const f32, g: *const f32, m: *const f32, v: *const f32, theta_out: *mut f32, m_out: *mut f32, v_out: *mut f32, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_f32_grad_bf16(theta: *const f32, g: *const bf16, m: *const f32, v: *const f32, theta_out: *mut f32, m_out: *mut f32, v_out: *mut f32, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_f32_grad_f16(theta: *const f32, g: *const f16, m: *const f32, v: *const f32, theta_out: *mut f32, m_out: *mut f32, v_out: *mut f32, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_bf16(theta: *const bf16, g: *const f32, m: *const f32, v: *const f32, theta_out: *mut bf16, m_out: *mut f32, v_out: *mut f32, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_bf16_grad_bf16(theta: *const bf16, g: *const bf16, m: *const f32, v: *const f32, theta_out: *mut bf16, m_out: *mut f32, v_out: *mut f32, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_f32_mbf16(theta: *const f32, g: *const f32, m: *const bf16, v: *const bf16, theta_out: *mut f32, m_out: *mut bf16, v_out: *mut bf16, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_f32_grad_bf16_mbf16(theta: *const f32, g: *const bf16, m: *const bf16, v: *const bf16, theta_out: *mut f32, m_out: *mut bf16, v_out: *mut bf16, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_f32_grad_f16_mbf16(theta: *const f32, g: *const f16, m: *const bf16, v: *const bf16, theta_out: *mut f32, m_out: *mut bf16, v_out: *mut bf16, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_bf16_mbf16(theta: *const bf16, g: *const f32, m: *const bf16, v: *const bf16, theta_out: *mut bf16, m_out: *mut bf16, v_out: *mut bf16, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_adamw_bf16_grad_bf16_mbf16(theta: *const bf16, g: *const bf16, m: *const bf16, v: *const bf16, theta_out: *mut bf16, m_out: *mut bf16, v_out: *mut bf16, maxima: *mut u32, n: usize, beta1: f32, one_minus_beta1: f32, beta2: f32, one_minus_beta2: f32, inv_bc1: f32, inv_bc2: f32, eps: f32, lr: f32, decay: f32, scale: f32, use_decay: u32, use_scale: u32, copy_out: *mut c_void, copy_code: u32, key: u64, m_key: u64, v_key: u64);
    fn r3_sum_bf16_stochastic_f32_f32(a: *const f32, b: *const f32, out: *mut bf16, n: usize, key: u64);
    fn r3_sum_bf16_stochastic_f32_bf16(a: *const f32, b: *const bf16, out: *mut bf16, n: usize, key: u64);
    fn r3_sum_bf16_stochastic_bf16_f32(a: *const bf16, b: *const f32, out: *mut bf16, n: usize, key: u64);
    fn r3_sum_bf16_stochastic_bf16_bf16(a: *const bf16, b: *const bf16, out: *mut bf16, n: usize, key: u64);
}
