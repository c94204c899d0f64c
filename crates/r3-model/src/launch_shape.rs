//! The grid shapes r3's CUDA kernels are launched with. `cuda/mod.rs` and the launchers turn
//! them into launch configurations; they stand outside the `cuda` feature so that the host
//! emulation of the kernels (the r3-cuda-emu crate) runs each kernel at the shapes a GPU gets.

/// Threads of one block of an elementwise (grid-stride) launch.
pub const ELEMENTWISE_THREADS: u32 = 256;

/// Threads for a row of `cols` entries: one per four entries, a whole number of warps,
/// between one warp and 1,024 threads.
pub fn row_threads(cols: usize) -> u32 {
    (cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Blocks of [`ELEMENTWISE_THREADS`] of a grid-stride launch over `n` elements: one element
/// a thread, at most 65,535 blocks (the loop takes the rest), at least one.
pub fn elementwise_blocks(n: usize) -> u32 {
    n.div_ceil(ELEMENTWISE_THREADS as usize).clamp(1, 65_535) as u32
}

/// Blocks of 256 threads the sum of squares of `n` values runs in: about 16 values a thread,
/// at most 1,024 blocks (several per SM on any GPU r3 runs on), at least one. A function of
/// `n` alone, so that the order of the sums is too.
pub fn sum_squares_blocks(n: usize) -> u32 {
    n.div_ceil(256 * 16).clamp(1, 1024) as u32
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
}
