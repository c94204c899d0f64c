//! The grid shapes r3's CUDA kernels are launched with. `cuda/mod.rs` and the launchers turn
//! them into launch configurations; they stand outside the `cuda` feature so that the host
//! emulation of the kernels (the r3-cuda-emu crate) runs each kernel at the shapes a GPU gets.

/// Threads of one block of an elementwise (grid-stride) launch.
pub const ELEMENTWISE_THREADS: u32 = 256;

/// Threads for a row of `cols` entries: one per four entries, a whole number of warps,
/// between one warp and 1,024 threads.
pub fn row_threads(cols: usize) -> u32 {
    whole_warps(cols.div_ceil(4))
}

/// At least `threads` threads in whole warps, between one warp and 1,024.
fn whole_warps(threads: usize) -> u32 {
    (threads.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Blocks of [`ELEMENTWISE_THREADS`] of a grid-stride launch over `n` elements: one element
/// a thread, at most 65,535 blocks (the loop takes the rest), at least one.
pub fn elementwise_blocks(n: usize) -> u32 {
    n.div_ceil(ELEMENTWISE_THREADS as usize).clamp(1, 65_535) as u32
}

/// Blocks of [`SUM_SQUARES_THREADS`] the sum of squares of `n` values runs in: about 16
/// values a thread, at most 1,024 blocks (several per SM on any GPU r3 runs on), at least
/// one. A function of `n` alone, so that the order of the sums is too.
pub fn sum_squares_blocks(n: usize) -> u32 {
    n.div_ceil(SUM_SQUARES_THREADS as usize * 16).clamp(1, 1024) as u32
}

/// Threads of one block of the gradient norm's sums of squares (`r3_sum_squares_*`, one
/// launch of [`sum_squares_blocks`] blocks per tensor).
pub const SUM_SQUARES_THREADS: u32 = 256;

/// Threads of the one block that adds the sums of squares' partials up
/// (`r3_sum_squares_total`).
pub const SUM_SQUARES_TOTAL_THREADS: u32 = 1024;

/// Rows a chunk of the RMSNorm weight gradient sums (a parallel task on the CPU, a block of
/// `r3_rms_norm_dw_chunks_f32` on a GPU, which holds a chunk's inverse RMS values in 64
/// slots): the chunks' partial sums are then added in chunk order, so both devices give the
/// same partials only with the same chunk.
pub const RMS_NORM_DW_CHUNK_ROWS: usize = 64;

/// Threads of a block of the RMSNorm weight gradient's chunks (`r3_rms_norm_dw_chunks_f32`,
/// a block per chunk of rows) for rows of `d` columns: one per column, a whole number of
/// warps (the rows' inverse RMS values are a warp's each), between one warp and 1,024.
pub fn rms_norm_dw_chunk_threads(d: usize) -> u32 {
    whole_warps(d)
}

/// Threads of a block of the decode attention (`r3_attend_group_*`, a block per batch row,
/// key/value head and query time): also the keys its online softmax takes at a time.
pub const ATTEND_GROUP_THREADS: u32 = 128;

/// Most dynamic shared memory a kernel's block may ask for without opting in (48 KiB).
pub const MAX_DYNAMIC_SHARED_BYTES: usize = 48 * 1024;

/// Threads of a block of the decode attention for a group of `groups` query rows of
/// `dq`-wide queries and `dv`-wide values: [`ATTEND_GROUP_THREADS`], or one or two warps
/// where a chunk of that many keys' probabilities would take the block past
/// [`MAX_DYNAMIC_SHARED_BYTES`] (a large group of wide heads). The keys a chunk takes are as
/// many, on the GPU and in the CPU's twin alike.
pub fn attend_group_threads(groups: usize, dq: usize, dv: usize) -> u32 {
    [ATTEND_GROUP_THREADS, 64, 32]
        .into_iter()
        .find(|&t| attend_group_shared_bytes(groups, dq, dv, t) <= MAX_DYNAMIC_SHARED_BYTES)
        .unwrap_or(32)
}

/// Blocks a decode attention launch aims for when a step has few of its own (a small batch
/// over a long context): two waves of an H100's or H200's 132 multiprocessors.
pub const ATTEND_GROUP_TARGET_BLOCKS: usize = 264;

/// Keys a span of the decode attention is sized from: four chunks of its block's threads,
/// so that a span's partial state (written out and merged) stays small beside its reads.
pub const ATTEND_GROUP_MIN_SPAN: usize = 4 * ATTEND_GROUP_THREADS as usize;

/// The spans a decode attention step of `blocks` blocks (batch rows × key/value heads ×
/// query positions) over `s` keys takes its keys in, and the keys of each (the last may
/// hold fewer; none is empty): one span where the step's own blocks fill the GPU or the keys
/// are few, else as many as bring the launch to [`ATTEND_GROUP_TARGET_BLOCKS`] with no more
/// spans than `S / ATTEND_GROUP_MIN_SPAN` rounded up, the keys shared evenly (so a span holds
/// about [`ATTEND_GROUP_MIN_SPAN`] keys or more: flash-decoding's split of the keys).
pub fn attend_group_spans(blocks: usize, s: usize) -> (usize, usize) {
    let want = ATTEND_GROUP_TARGET_BLOCKS.div_ceil(blocks.max(1));
    let spans = want.min(s.div_ceil(ATTEND_GROUP_MIN_SPAN)).max(1);
    let span = s.div_ceil(spans).max(1);
    (s.div_ceil(span).max(1), span)
}

/// Bytes of dynamic shared memory a block of `r3_attend_group_*` of `threads` threads
/// takes for a group of `groups` query rows of `dq`-wide queries and `dv`-wide values: the
/// queries, a chunk's probabilities, the outputs and three running values a row, as f32.
pub fn attend_group_shared_bytes(groups: usize, dq: usize, dv: usize, threads: u32) -> usize {
    groups * (dq + threads as usize + dv + 3) * std::mem::size_of::<f32>()
}

/// Threads of a block of the row draws (`r3_sample_rows_f32`, a block per row): 32 groups
/// of 16, each group summing one block of `SAMPLE_BLOCK` columns at a time.
pub const SAMPLE_ROWS_THREADS: u32 = 512;

/// The most columns a row of `r3_sample_rows_f32` may have: its blocks' f64 partial sums,
/// one per 256 columns, fill at most 40 KiB of dynamic shared memory (a launch may ask for
/// 48 KiB without opting in; the kernel's own arrays take the rest).
pub const SAMPLE_ROWS_MAX_COLUMNS: usize = 40 * 1024 / 8 * 256;

/// Bytes of dynamic shared memory a block of `r3_sample_rows_f32` takes for rows of `cols`
/// columns: one f64 partial sum per block of 256 columns.
pub fn sample_rows_shared_bytes(cols: usize) -> usize {
    cols.div_ceil(256) * std::mem::size_of::<f64>()
}

/// Threads of a block of the grouped (DeepSeek-V3) router (`r3_route_grouped_f32`, a block
/// per row) over `cols` experts in `n_group` groups: a row's threads ([`row_threads`]), and
/// at least one thread per group, in whole warps.
pub fn route_grouped_threads(cols: usize, n_group: usize) -> u32 {
    row_threads(cols).max(whole_warps(n_group))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes at their bounds, by hand.
    #[test]
    fn shapes_at_their_bounds() {
        assert_eq!(row_threads(0), 32);
        assert_eq!(row_threads(128), 32);
        assert_eq!(row_threads(129), 64);
        assert_eq!(row_threads(2048), 512);
        assert_eq!(row_threads(1 << 20), 1024);
        assert_eq!(elementwise_blocks(0), 1);
        assert_eq!(elementwise_blocks(257), 2);
        assert_eq!(elementwise_blocks(usize::MAX / 2), 65_535);
        assert_eq!(sum_squares_blocks(0), 1);
        assert_eq!(sum_squares_blocks(4097), 2);
        assert_eq!(sum_squares_blocks(1 << 40), 1024);
    }

    /// The RMSNorm weight gradient's chunk threads, by hand: a warp for up to 32 columns,
    /// whole warps above, 1,024 at most.
    #[test]
    fn rms_norm_dw_chunk_threads_by_hand() {
        assert_eq!(rms_norm_dw_chunk_threads(0), 32);
        assert_eq!(rms_norm_dw_chunk_threads(1), 32);
        assert_eq!(rms_norm_dw_chunk_threads(32), 32);
        assert_eq!(rms_norm_dw_chunk_threads(33), 64);
        assert_eq!(rms_norm_dw_chunk_threads(40), 64);
        assert_eq!(rms_norm_dw_chunk_threads(1000), 1024);
        assert_eq!(rms_norm_dw_chunk_threads(1024), 1024);
        assert_eq!(rms_norm_dw_chunk_threads(4096), 1024);
    }

    /// The decode attention's block, by hand: 128 threads; G · (dq + threads + dv + 3) floats
    /// of shared memory.
    #[test]
    fn attend_group_shape_by_hand() {
        assert_eq!(ATTEND_GROUP_THREADS, 128);
        assert_eq!(attend_group_shared_bytes(0, 128, 128, 128), 0);
        // 8 × (128 + 128 + 128 + 3) floats: the 30B-A3B shape's group.
        assert_eq!(attend_group_shared_bytes(8, 128, 128, 128), 12_384);
        assert_eq!(attend_group_shared_bytes(2, 24, 40, 32), 792);
    }

    /// The decode attention's threads, by hand: 128 for the 30B-A3B shape's group (12.4 KB);
    /// 64 for 32 query heads of 128 a group (49.5 KB at 128 threads, 41.4 at 64); 32 for 48
    /// (62.0 KB at 64, 55.9 at 32: no launch fits, as `attend_group_shared_bytes` says).
    #[test]
    fn attend_group_threads_by_hand() {
        assert_eq!(attend_group_threads(8, 128, 128), 128);
        assert_eq!(attend_group_shared_bytes(32, 128, 128, 128), 49_536);
        assert_eq!(attend_group_threads(32, 128, 128), 64);
        assert_eq!(attend_group_shared_bytes(48, 128, 128, 64), 62_016);
        assert_eq!(attend_group_threads(48, 128, 128), 32);
        assert!(attend_group_shared_bytes(48, 128, 128, 32) > MAX_DYNAMIC_SHARED_BYTES);
    }

    /// The decode attention's spans, by hand: one for a full batch or a short context; a
    /// batch of one over 32 k keys (4 blocks: 66 spans wanted, 64 of 512 keys allowed); 1,000
    /// keys over 4 blocks (2 spans of 500); an uneven split (3 spans of 534, 534 and 532).
    #[test]
    fn attend_group_spans_by_hand() {
        assert_eq!(ATTEND_GROUP_MIN_SPAN, 512);
        assert_eq!(attend_group_spans(1024, 32_768), (1, 32_768));
        assert_eq!(attend_group_spans(4, 160), (1, 160));
        assert_eq!(attend_group_spans(4, 32_768), (64, 512));
        assert_eq!(attend_group_spans(4, 1000), (2, 500));
        assert_eq!(attend_group_spans(100, 1600), (3, 534));
        assert_eq!(attend_group_spans(0, 1), (1, 1));
    }

    /// The row draws' block, by hand: 512 threads; a double per 256 columns; 1,310,720
    /// columns at most (40 KiB of partial sums).
    #[test]
    fn sample_rows_shape_by_hand() {
        assert_eq!(SAMPLE_ROWS_THREADS, 512);
        assert_eq!(sample_rows_shared_bytes(0), 0);
        assert_eq!(sample_rows_shared_bytes(256), 8);
        assert_eq!(sample_rows_shared_bytes(257), 16);
        assert_eq!(sample_rows_shared_bytes(151_936), 4_752);
        assert_eq!(SAMPLE_ROWS_MAX_COLUMNS, 1_310_720);
        assert_eq!(sample_rows_shared_bytes(SAMPLE_ROWS_MAX_COLUMNS), 40 * 1024);
    }

    /// The sums of squares' blocks: 256 threads each, the total in one block of 1,024;
    /// 4,096 values a block.
    #[test]
    fn sum_squares_threads_by_hand() {
        assert_eq!(SUM_SQUARES_THREADS, 256);
        assert_eq!(SUM_SQUARES_TOTAL_THREADS, 1024);
        assert_eq!(sum_squares_blocks(4096), 1);
        assert_eq!(sum_squares_blocks(3 * 4096), 3);
        assert_eq!(sum_squares_blocks(3 * 4096 + 1), 4);
    }

    /// The grouped router's block, by hand: the row's threads unless the groups need more
    /// warps.
    #[test]
    fn route_grouped_threads_by_hand() {
        // 256 experts (64 threads) in 8 groups: the row's threads.
        assert_eq!(route_grouped_threads(256, 8), 64);
        // 8 experts (one warp) in 4 groups: one warp.
        assert_eq!(route_grouped_threads(8, 4), 32);
        // 128 experts (one warp) in 64 groups: two warps, one thread per group.
        assert_eq!(route_grouped_threads(128, 64), 64);
        // 4,096 experts (1,024 threads) in 64 groups.
        assert_eq!(route_grouped_threads(4096, 64), 1024);
        // 80 experts (20 quads: one warp) in 40 groups of 2: two warps for the groups.
        assert_eq!(route_grouped_threads(80, 40), 64);
    }
}
